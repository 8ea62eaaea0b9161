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
pub use q4moe_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

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
    #[error("{0}")]
    Invalid(String),
    /// A sequence was stopped by a failure outside its own request (a batched step it was in).
    #[error("generation aborted: {0}")]
    Aborted(String),
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

    /// Renders a conversation with the model's chat template.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        let t = self.template.as_ref().ok_or_else(|| {
            EngineError::Invalid("the model has no tokenizer.chat_template".into())
        })?;
        Ok(t.render(messages, true, enable_thinking)?)
    }

    /// Tokenises a prompt (special tokens parsed, BOS added if the model asks for it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.tokenizer.add_bos() {
            ids.extend(self.tokenizer.bos_id());
        }
        ids.extend(self.tokenizer.encode(text, true)?);
        Ok(ids)
    }

    /// Forgets every cached conversation.
    pub fn reset_sessions(&mut self) {
        self.sessions.clear(self.backend.as_mut());
    }
}
