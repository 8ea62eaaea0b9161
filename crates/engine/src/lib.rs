//! The engine: a model, a backend, a tokenizer and the sessions' token histories, with the
//! generation loop every front end (run, chat, serve, bench) drives.

mod batch;
mod collect;
mod constraint;
mod device;
mod gbnf;
mod generate;
mod logprobs;
mod prompt;
mod request;
mod sessions;
mod stop;

pub use batch::{BatchOptions, Batcher, SequenceSink};
pub use constraint::{with_layout, Grammar, GrammarLimits, Grammars};
pub use device::{open_backend, Device, EngineOptions};
pub use gbnf::{gbnf_to_lark, looks_like_gbnf};
pub use logprobs::{token_logprob, LogprobOptions, Piece, TokenLogprob};
pub use prompt::{PromptText, Prompter};
pub use request::{Finish, GenerateOutput, GenerateRequest, PromptInput};
pub use sessions::SessionStore;
pub use stop::StopMatcher;

pub use q4moe_model::backend::{
    Backend, BackendError, BackendInfo, DecodeStats, Flow, PhaseTimes, SessionId,
};
pub use q4moe_model::constraint::Constraint;
pub use q4moe_model::sampling::SamplingParams;
pub use q4moe_tokenizer::{
    ChatMessage, ChatTemplate, RenderedPrompt, TemplateIsolation, TemplateLimits, TemplateOptions,
    Tokenizer, ToolCall, WorkerCommand,
};

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
    /// The request alone needs more KV than the pool holds (the pool's bytes), whatever else
    /// gives its pages back: a retry fails the same way.
    #[error("the request needs more KV than the pool of {capacity} bytes holds (--kv-cache-mb); shorten the prompt or max_tokens, or raise the pool")]
    KvExceeded { capacity: usize },
    /// A sequence was stopped by a failure outside its own request (a batched step it was in).
    #[error("generation aborted: {0}")]
    Aborted(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

pub struct Engine {
    pub model: Arc<Model>,
    backend: Box<dyn Backend>,
    prompter: Prompter,
    sessions: SessionStore,
}

impl Engine {
    pub fn load(path: impl AsRef<Path>, opts: &EngineOptions) -> Result<Engine> {
        let model = Arc::new(Model::load(path)?);
        Self::from_model(model, opts)
    }

    pub fn from_model(model: Arc<Model>, opts: &EngineOptions) -> Result<Engine> {
        let tokenizer = Arc::new(Tokenizer::from_spec(&model.tokenizer)?);
        let backend = open_backend(model.clone(), opts)?;
        let capacity = backend.info().kv_capacity;
        let prompter = Prompter::new(tokenizer, capacity, model.config.vocab_size, &opts.template)?;
        let sessions = SessionStore::new(opts.kv_cache_bytes);
        Ok(Engine {
            model,
            backend,
            prompter,
            sessions,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        self.prompter.tokenizer()
    }

    /// The prompt builder (chat template and tokenizer, shared): a front end renders and
    /// tokenises with a clone of it on its own threads, off the engine's.
    pub fn prompter(&self) -> Prompter {
        self.prompter.clone()
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    pub fn backend_mut(&mut self) -> &mut dyn Backend {
        self.backend.as_mut()
    }

    /// Whether the backend runs a batched step (continuous batching with `Batcher`); without
    /// one, sequences run one at a time through `generate`.
    /// Bytes the cached (idle) sessions' KV takes, kept for prefix reuse.
    pub fn cached_kv_bytes(&self) -> usize {
        self.sessions.bytes(self.backend.as_ref())
    }

    /// The KV pool, where the backend keeps every session's KV in one (the CPU).
    pub fn kv_pool(&self) -> Option<q4moe_model::backend::KvPoolStats> {
        self.backend.kv_pool()
    }

    pub fn batched_step(&self) -> bool {
        self.backend.info().batched_step
    }

    /// Positions one sequence may hold.
    pub fn context_capacity(&self) -> usize {
        self.backend.info().kv_capacity
    }

    /// Renders a conversation with the model's chat template (`Prompter::render_chat`).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        enable_thinking: Option<bool>,
    ) -> Result<RenderedPrompt> {
        self.prompter.render_chat(messages, enable_thinking)
    }

    /// Tokenises a prompt within the context (`Prompter::encode_prompt`).
    pub fn encode_prompt<'p>(&self, prompt: impl Into<PromptText<'p>>) -> Result<Vec<u32>> {
        self.prompter.encode_prompt(prompt)
    }

    /// Forgets every cached conversation.
    pub fn reset_sessions(&mut self) {
        self.sessions.clear(self.backend.as_mut());
    }
}
