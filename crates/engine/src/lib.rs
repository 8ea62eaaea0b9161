//! The engine: a model, a backend, a tokenizer and the sessions' token histories, with the
//! generation loop every front end (run, chat, serve, bench) drives.

mod batch;
mod collect;
mod device;
mod generate;
mod sessions;
mod stop;

pub use batch::{BatchOptions, Batcher, SequenceSink};
pub use device::{open_backend, Device, EngineOptions};
pub use generate::{Finish, GenerateOutput, GenerateRequest, PromptInput};
pub use sessions::SessionStore;
pub use stop::StopMatcher;

pub use q4moe_model::backend::{
    Backend, BackendError, BackendInfo, DecodeStats, Flow, PhaseTimes, SessionId,
};
pub use q4moe_model::sampling::SamplingParams;
pub use q4moe_tokenizer::{ChatMessage, ChatTemplate, RenderedPrompt, Tokenizer};

use std::path::Path;
use std::sync::Arc;

use q4moe_model::Model;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] q4moe_model::ModelError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Tokenizer(#[from] q4moe_tokenizer::TokenizerError),
    #[error("prompt of {prompt} tokens leaves no room in the context of {context} positions")]
    PromptTooLong { prompt: usize, context: usize },
    /// Refused before the prompt was tokenised whole, so its exact length is unknown.
    #[error(
        "prompt of {context} or more tokens leaves no room in the context of {context} positions"
    )]
    PromptOverContext { context: usize },
    #[error("{0}")]
    Invalid(String),
    /// A sequence was stopped by a failure outside its own request (a batched step it was in).
    #[error("generation aborted: {0}")]
    Aborted(String),
}

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

pub type Result<T> = std::result::Result<T, EngineError>;

pub struct Engine {
    pub model: Arc<Model>,
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    sessions: SessionStore,
}

impl Engine {
    pub fn load(path: impl AsRef<Path>, opts: &EngineOptions) -> Result<Engine> {
        let model = Arc::new(Model::load(path)?);
        Self::from_model(model, opts)
    }

    pub fn from_model(model: Arc<Model>, opts: &EngineOptions) -> Result<Engine> {
        let tokenizer = Arc::new(Tokenizer::from_spec(&model.tokenizer)?);
        let template = match tokenizer.chat_template() {
            Some(src) => Some(ChatTemplate::new(src)?),
            None => None,
        };
        let backend = open_backend(model.clone(), opts)?;
        let capacity = backend.info().kv_capacity;
        let sessions = SessionStore::new(opts.max_cached_positions.max(capacity));
        Ok(Engine {
            model,
            backend,
            tokenizer,
            template,
            sessions,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    pub fn backend_mut(&mut self) -> &mut dyn Backend {
        self.backend.as_mut()
    }

    /// Whether the backend runs a batched step (continuous batching with `Batcher`); without
    /// one, sequences run one at a time through `generate`.
    pub fn batched_step(&self) -> bool {
        self.backend.info().batched_step
    }

    /// Positions one sequence may hold.
    pub fn context_capacity(&self) -> usize {
        self.backend.info().kv_capacity
    }

    /// Renders a conversation with the model's chat template. The messages' text is marked so
    /// that [`Self::encode_prompt`] reads control tokens typed in it as text (no forged turns).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        enable_thinking: Option<bool>,
    ) -> Result<RenderedPrompt> {
        let t = self.template.as_ref().ok_or_else(|| {
            EngineError::Invalid("the model has no tokenizer.chat_template".into())
        })?;
        let marked = self.tokenizer.mark_messages(messages);
        Ok(RenderedPrompt::from_marked(&t.render(
            &marked,
            true,
            enable_thinking,
        )?))
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
        let context = self.context_capacity();
        match self
            .tokenizer
            .encode_within(rendered, context.saturating_sub(1))
        {
            Err(q4moe_tokenizer::TokenizerError::TooLong { .. }) => {
                Err(EngineError::PromptOverContext { context })
            }
            other => Ok(other?),
        }
    }

    /// Forgets every cached conversation.
    pub fn reset_sessions(&mut self) {
        self.sessions.clear(self.backend.as_mut());
    }
}
