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
}

pub type Result<T> = std::result::Result<T, CudaError>;

impl From<CudaError> for q4moe_model::backend::BackendError {
    fn from(e: CudaError) -> Self {
        q4moe_model::backend::BackendError::Device(e.to_string())
    }
}
