use thiserror::Error;

/// Every failure names the spec field or operation at fault, so a bad GGUF is easy to diagnose.
#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("invalid tokenizer spec: field `{field}`: {message}")]
    InvalidSpec {
        field: &'static str,
        message: String,
    },
    #[error("unsupported tokenizer: field `{field}` = {value:?} ({supported})")]
    Unsupported {
        field: &'static str,
        value: String,
        supported: &'static str,
    },
    #[error("token id {id} out of range (vocab size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },
    /// The text is more tokens than the caller allows (counting stopped there).
    #[error("the text is longer than {max_tokens} tokens")]
    TooLong { max_tokens: usize },
    #[error("tokenizer backend: {0}")]
    Backend(String),
    #[error("chat template: {0}")]
    Template(String),
    /// A render ran past its [`crate::TemplateLimits`]: the template loops or grows too much.
    #[error("chat template exceeded its {0}")]
    TemplateLimit(crate::TemplateLimit),
    /// The render worker failed in a way that names no limit (it would not start, or crashed).
    #[error("chat template worker: {0}")]
    TemplateWorker(String),
}

impl TokenizerError {
    pub(crate) fn spec(field: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidSpec {
            field,
            message: message.into(),
        }
    }
}

impl From<minijinja::Error> for TokenizerError {
    fn from(e: minijinja::Error) -> Self {
        // `{:#}` includes the template line and the cause chain.
        Self::Template(format!("{e:#}"))
    }
}
