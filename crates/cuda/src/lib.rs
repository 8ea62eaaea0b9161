//! CUDA backend: NVRTC-compiled kernels (kernels/*.cu), weights resident as 4-bit blocks, the
//! whole decode step on the device (greedy token choice included), a session-keyed setup cache
//! that replays a captured CUDA graph, pipelined decode and a per-phase / per-kernel profiler.
//!
//! The crate builds and runs without CUDA: `cuda_available()` probes libcuda and libnvrtc
//! before any cudarc call (cudarc panics on first use when they are absent).
//!
//! Layout: the Rust side mirrors the kernels. `kernel` names every kernel and its mode,
//! `nvrtc` compiles them, `device` / `memory` / `launch` run them, `params` mirrors their
//! argument structs, `step/` builds a decode step's launches by op family (matvec, attention,
//! moe, sample), `prefill` the batched prompt, `session` the setup cache, `pipeline` the
//! in-flight read-back ring, `backend` the `Backend` implementation.

mod backend;
mod batch;
mod device;
mod error;
mod graph;
mod kernel;
mod l2;
mod launch;
mod memory;
mod nvrtc;
mod options;
mod params;
mod pipeline;
mod prefill;
mod profile;
mod repack;
mod rows;
mod session;
mod step;
#[doc(hidden)]
pub mod testing;
#[cfg(feature = "timeline")]
mod timeline;
mod weights;

use std::time::Duration;

pub use q4moe_model::backend::KvType;

pub use backend::CudaBackend;
pub use error::{CudaError, Result};
pub use options::{default_cache_dir, CudaOptions};

/// GPU time of one kernel family, to set against the weight bytes it reads.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub calls: u64,
    pub total: Duration,
    pub bytes_read: u64,
}

/// How the setup cache came by its graphs: each capture (and instantiation) of a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphSetups {
    pub captures: u64,
}

/// The first GPU's name, or why CUDA cannot be used here.
pub fn cuda_available() -> std::result::Result<String, String> {
    device::probe()?;
    let ctx = cudarc::driver::CudaContext::new(0)
        .map_err(|e| format!("cannot create a CUDA context: {e}"))?;
    ctx.name()
        .map_err(|e| format!("cannot read the device name: {e}"))
}
