//! Building a prompt: the chat template's rendering and the tokenisation within the context.
//! Both need only the tokenizer and the template, shared and immutable, so a `Prompter` is cheap
//! to clone and a front end (the server) runs it on its own threads: a hostile template or a
//! huge prompt then costs a request handler's time, never the engine thread's.

use std::sync::Arc;

use q4moe_tokenizer::{
    ChatMessage, RenderedPrompt, TemplateOptions, TemplateRenderer, Tokenizer, TokenizerError,
};

use crate::constraint::{GrammarLimits, Grammars};
use crate::{EngineError, Result};

/// A prompt to tokenise: a rendered chat, whose messages' control tokens stay text, or raw text
/// (a completion prompt, the CLI's `--prompt`), whose control tokens all count.
#[derive(Debug, Clone, Copy)]
pub enum PromptText<'a> {
    Raw(&'a str),
    Chat(&'a RenderedPrompt),
}

impl<'a> From<&'a str> for PromptText<'a> {
    fn from(t: &'a str) -> Self {
        PromptText::Raw(t)
    }
}

impl<'a, 'b: 'a> From<&'a &'b str> for PromptText<'a> {
    fn from(t: &'a &'b str) -> Self {
        PromptText::Raw(t)
    }
}

impl<'a> From<&'a String> for PromptText<'a> {
    fn from(t: &'a String) -> Self {
        PromptText::Raw(t)
    }
}

impl<'a> From<&'a RenderedPrompt> for PromptText<'a> {
    fn from(p: &'a RenderedPrompt) -> Self {
        PromptText::Chat(p)
    }
}

/// The model's chat template and tokenizer, with the context a prompt must leave room in.
#[derive(Clone)]
pub struct Prompter {
    tokenizer: Arc<Tokenizer>,
    template: Option<Arc<TemplateRenderer>>,
    /// Positions one sequence may hold.
    context: usize,
    /// The model's vocabulary (token ids a prompt may hold; may exceed the tokenizer's).
    vocab: usize,
    /// Compiles a request's output constraint against this vocabulary.
    grammars: Grammars,
}

impl Prompter {
    /// `context`: the positions a sequence may hold (the backend's KV capacity); `vocab`: the
    /// model's vocabulary size; `template`: the chat template's limits and where it renders.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        context: usize,
        vocab: usize,
        template: &TemplateOptions,
    ) -> Result<Prompter> {
        let template = match tokenizer.chat_template() {
            Some(src) => Some(Arc::new(TemplateRenderer::new(src, template)?)),
            None => None,
        };
        Ok(Prompter {
            grammars: Grammars::new(tokenizer.clone(), vocab, GrammarLimits::default()),
            tokenizer,
            template,
            context,
            vocab,
        })
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Positions one sequence may hold.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The model's vocabulary size: a prompt's token ids are below it.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The grammar compiler for constrained output over this vocabulary.
    pub fn grammars(&self) -> &Grammars {
        &self.grammars
    }

    /// Renders a conversation with the model's chat template. The messages' text is marked so
    /// that [`Self::encode_prompt`] reads control tokens typed in it as text (no forged turns).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        enable_thinking: Option<bool>,
    ) -> Result<RenderedPrompt> {
        self.render_chat_tools(messages, None, enable_thinking)
    }

    /// [`Self::render_chat`] with OpenAI's `tools` list for the template to describe (its text
    /// marked as the messages' is).
    pub fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        enable_thinking: Option<bool>,
    ) -> Result<RenderedPrompt> {
        let t = self.template.as_ref().ok_or_else(|| {
            EngineError::Invalid("the model has no tokenizer.chat_template".into())
        })?;
        let marked = self.tokenizer.mark_messages(messages);
        let tools = tools.map(|v| self.tokenizer.mark_json(v));
        let text = t.render_tools(&marked, tools.as_ref(), true, enable_thinking)?;
        Ok(RenderedPrompt::from_marked(&text))
    }

    /// Tokenises a prompt (BOS first if the model asks for it). A prompt that cannot leave room
    /// in the context is refused with [`EngineError::PromptOverContext`] before it is tokenised
    /// whole, so a multi-megabyte prompt costs no more than one that fits.
    pub fn encode_prompt<'p>(&self, prompt: impl Into<PromptText<'p>>) -> Result<Vec<u32>> {
        let plain;
        let rendered = match prompt.into() {
            PromptText::Chat(p) => p,
            PromptText::Raw(t) => {
                plain = RenderedPrompt::plain(t);
                &plain
            }
        };
        let context = self.context;
        match self
            .tokenizer
            .encode_within(rendered, context.saturating_sub(1))
        {
            Err(TokenizerError::TooLong { .. }) => Err(EngineError::PromptOverContext { context }),
            other => Ok(other?),
        }
    }
}
