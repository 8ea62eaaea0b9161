use std::path::PathBuf;

use thiserror::Error;

/// The harness's own failures (not the target's: those are [`crate::Failure`]s).
#[derive(Debug, Error)]
pub enum FuzzError {
    #[error("unknown fuzz target '{0}' (known: {known})", known = crate::TARGET_NAMES.join(", "))]
    UnknownTarget(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the seed corpus {0} is empty")]
    EmptyCorpus(PathBuf),
    #[error("fuzz worker: {0}")]
    Worker(String),
}

impl FuzzError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
