use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    // The I/O error is part of the message, not a `source`, so error chains print it once.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("not a GGUF file: bad magic {0:#010x} (expected 0x46554747 'GGUF')")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0} (q4moe reads versions 2 and 3)")]
    BadVersion(u32),
    #[error("file truncated: needed {needed} bytes at offset {offset} while reading {what}, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("header field {what} is {value}, more than the {limit} the file's remaining bytes or q4moe's limits allow (truncated or corrupt file?)")]
    Absurd {
        what: String,
        value: u64,
        limit: u64,
    },
    #[error("metadata key {key}: {msg}")]
    Metadata { key: String, msg: String },
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },
    #[error("unknown ggml type id {0}")]
    UnknownType(u32),
    #[error("{0}")]
    Other(String),
}

impl GgufError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        GgufError::Io {
            path: path.into(),
            error: source,
        }
    }
    pub fn tensor(name: &str, msg: impl Into<String>) -> Self {
        GgufError::Tensor {
            name: name.to_string(),
            msg: msg.into(),
        }
    }
    pub fn metadata(key: &str, msg: impl Into<String>) -> Self {
        GgufError::Metadata {
            key: key.to_string(),
            msg: msg.into(),
        }
    }
}
