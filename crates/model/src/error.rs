#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] q4moe_gguf::GgufError),
    #[error("{file}: metadata key {key}: {msg}")]
    Key {
        file: String,
        key: String,
        msg: String,
    },
    #[error("{file}: tensor {tensor}: {msg}")]
    Tensor {
        file: String,
        tensor: String,
        msg: String,
    },
    #[error("{file}: {msg}")]
    Unsupported { file: String, msg: String },
    #[error(transparent)]
    Tokenizer(#[from] q4moe_tokenizer::TokenizerError),
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
}
