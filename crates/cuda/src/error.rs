//! The crate's one error type.

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC failed to compile the kernels:\n{0}")]
    Compile(String),
    #[error("CUDA option kernel_dir: cannot read kernel source {path}: {source}")]
    KernelSource {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("not enough device memory: need {need} bytes, {free} free")]
    OutOfMemory { need: usize, free: usize },
    #[error("unsupported by the CUDA backend: {0}")]
    Unsupported(String),
    #[error("step state read-back: {0}")]
    ReadBack(String),
    /// The sessions' KV would pass `CudaOptions::kv_pool_bytes`.
    #[error("session {session}: the KV pool is full")]
    KvFull {
        session: u64,
        needed: usize,
        free: usize,
        capacity: usize,
    },
}

pub type Result<T> = std::result::Result<T, CudaError>;

impl From<CudaError> for q4moe_model::backend::BackendError {
    fn from(e: CudaError) -> Self {
        use q4moe_model::backend::BackendError;
        match e {
            CudaError::KvFull {
                session,
                needed,
                free,
                capacity,
            } => BackendError::KvFull {
                session,
                needed,
                free,
                capacity,
            },
            e => BackendError::Device(e.to_string()),
        }
    }
}
