//! CUDA backend: NVRTC-compiled kernels (kernels/*.cu), weights resident as 4-bit blocks, the
//! whole decode step on the device (greedy token choice included), a session-keyed setup cache
//! that replays a captured CUDA graph, pipelined decode and a per-phase / per-kernel profiler.
//!
//! The crate builds and runs without CUDA: `cuda_available()` probes libcuda and libnvrtc
//! before any cudarc call (cudarc panics on first use when they are absent).

mod backend;
mod device;
mod fused;
mod graph;
mod l2;
mod params;
mod prefill;
mod repack;
mod step;
#[doc(hidden)]
pub mod testing;
mod timeline;
mod weights;

use std::time::Duration;

pub use q4moe_model::backend::KvType;

pub use backend::CudaBackend;
pub use l2::L2Target;

/// The attention lengths attention's grid is sized for (step::att_grid: a power of two of blocks
/// a KV head, the setup cache keyed on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttGrid {
    /// The KV's capacity (4 x 32 blocks at the default 4,096 positions), whatever the length.
    Capacity,
    /// The positions each graph of steps reaches: the grid changes as a decode goes on
    /// (session 38: +0.15-0.2% Q4_K_M over Capacity at a 4,360-position KV, but a capture or a
    /// regrid inside the bench's 256 tokens, ~1 ms each).
    Step,
    /// The positions the whole decode request can reach (its first position + max_tokens):
    /// one grid for the request, so its steps never change graph midway.
    Request,
}

/// Options of the CUDA backend.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaOptions {
    /// Keep offset tables, argument buffers and the captured step graph per session.
    pub setup_cache: bool,
    /// Decode steps submitted before the oldest token is read back.
    pub in_flight: usize,
    /// Positions each session's KV cache holds.
    pub kv_capacity: usize,
    /// How the KV cache stores keys and values (attention.cu's kv_t, chosen when the kernels
    /// are compiled): f16 halves what attention reads at long context.
    pub kv_type: KvType,
    /// Time every kernel with events (eager path only; slows decoding).
    pub profile_kernels: bool,
    /// With the setup cache on: run the embedding and every layer as one persistent kernel
    /// (kernels/fused.cu) instead of a graph of ~340 launches; the head and the token choice
    /// stay launches in the same graph. Off by default: measured slower than the graph so far
    /// (NOTES.md v9); Q4MOE_CUDA_FUSED=1 turns it on.
    pub fused_step: bool,
    /// Attention blocks a KV head at most: past this many 32-position chunks a block walks
    /// several (one wave of blocks at long context, a short merge). Q4MOE_CUDA_ATT_BLOCKS
    /// overrides the default (for measuring).
    pub attn_max_blocks: usize,
    /// What attention's grid is sized for (step::att_grid). Q4MOE_CUDA_ATT_GRID=capacity|step
    /// sets it (A/B measurements); the default is AttGrid::Request.
    pub attn_grid: AttGrid,
    /// A captured step whose attention grid changes takes the new grid in place
    /// (Graph::regrid) instead of being captured again. Off by default: it saves the host the
    /// capture (~1 ms at the full geometry) but the GPU lost more (session 39, AttGrid::Step,
    /// a change at position 257 of a 384-position decode: 792.2 against 794.3 tok/s Q4_K_M);
    /// Q4MOE_CUDA_REGRID=1 turns it on.
    pub regrid_in_place: bool,
    /// Fold the router into o_proj's launch where it applies (moe.cu RouterFold; NOTES.md
    /// session 14: +8%). On by default; Q4MOE_CUDA_ROUTER_FOLD=0 turns it off (A/B
    /// measurements; the parity tests run both).
    pub router_fold: bool,
    /// Qwen3-shape attention on tensor cores where the cache is f16 (attention.cu
    /// attn_gqa_128_8_tc, sm_80+; session 16, H200: +3.3% Q4_0 at the bench's context, +16% at
    /// 4,096). On by default; Q4MOE_CUDA_ATT_TC=0 turns it off.
    pub attn_tensor_cores: bool,
    /// Tiles past its first a warp of the tensor-core attention loads into shared memory before
    /// pdl_wait (AttnGqaParams::stage): a KV head whose positions fit one block's tiles then
    /// takes one block, with no merge. None = 1 (params::ATT_TC_STAGE_DEFAULT: 256 positions;
    /// session 16: +2.7% Q4_0, +3.3% Q4_K_M), at most 2 and what the device's shared memory
    /// holds. Q4MOE_CUDA_ATT_STAGE=<n> sets it (A/B measurements; the parity tests run 0).
    pub attn_stage: Option<usize>,
    /// Chunks a tensor-core attention block takes at least. None = 4
    /// (params::ATT_TC_MIN_SPAN_DEFAULT: 8 tiles, one a warp; session 16: 1 and 8 were both ~4%
    /// slower at the bench's context). Q4MOE_CUDA_ATT_MIN_SPAN=<n> sets it (A/B measurements).
    pub attn_min_span: Option<usize>,
    /// Prompt tokens the batched prefill (prefill.rs) takes at once; 0 runs the decode step
    /// once a prompt token. Default params::PREFILL_CHUNK_DEFAULT; Q4MOE_CUDA_PREFILL_CHUNK=<n>
    /// sets it (`--prefill-chunk` on the command line).
    pub prefill_chunk: usize,
    /// Bytes of attention partials the batched prefill's generic attention (shapes and caches
    /// pf_attn_tc does not take) holds at once; it runs a chunk's tokens in sub-batches that fit.
    /// Default 64 MiB.
    pub prefill_part_budget: usize,
    /// Blocks along a slot's units of moe_gate_up's staged kernels, each walking the units past
    /// the grid (moe.cu gate_up_staged). None: the mode's share (step.rs GATE_UP_SHARE) of the
    /// blocks the device keeps resident, shared among the slots (no second wave of block
    /// starts); Some(0): a block a unit; Some(n): at most n. Q4MOE_CUDA_GU_COLS=<n> sets it
    /// (A/B measurements; the parity tests walk at 1).
    pub gate_up_cols: Option<u32>,
    /// L2 set aside for `l2_targets` (l2.rs), in MiB: None = as much as the device allows,
    /// Some(0) = none. Q4MOE_CUDA_L2_PERSIST=<MiB> sets it.
    pub l2_persist_mib: Option<usize>,
    /// The weights the set-aside L2 holds (none by default: the head measured slower, the set-
    /// aside costing the layers more than the head gained; NOTES.md session 35).
    /// Q4MOE_CUDA_L2_TARGET=head,fold|none sets them (an unknown name is an error at start-up).
    pub l2_targets: Vec<L2Target>,
    /// The weight launches (qkv, o_proj, the experts', the head) mark their weights streaming
    /// in L2 (l2.rs), so the data read again keeps the cache. On by default (session 35, one
    /// binary, 3 calls: +0.2% Q4_K_M, +0.3% Q4_0); Q4MOE_CUDA_L2_STREAM=0 turns it off.
    pub l2_stream: bool,
    /// The step's token choice writes the new step state into host-mapped memory (common.cuh
    /// finish_step), so no device-to-host copy sits between one step and the next in the
    /// stream. Q4MOE_CUDA_READBACK=copy turns it off (a copy after each step, as before).
    pub mapped_readback: bool,
    /// A plain greedy step takes its token in the output head's own tail (sample.cu
    /// head_argmax: each block's best, the last block's merge) instead of two arg-max launches
    /// after it. Q4MOE_CUDA_HEAD_ARGMAX=0 turns it off.
    pub head_argmax: bool,
    /// Decode steps one graph replay runs (mapped read-back only: each step's token reaches the
    /// host as it ends): the stream's boundary (the end event, the graph's start without the
    /// previous launches' overlap) comes once a graph. Default 4 (session 37: +0.1-0.5% over 1,
    /// 8 no better); a stop found late discards up to in_flight x 4 + 3 computed steps.
    /// Q4MOE_CUDA_GRAPH_STEPS=<n> sets it (1: a step a graph).
    pub graph_steps: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            setup_cache: true,
            in_flight: 2,
            kv_capacity: 4096,
            kv_type: KvType::default(),
            profile_kernels: false,
            fused_step: std::env::var("Q4MOE_CUDA_FUSED").is_ok_and(|v| v != "0"),
            attn_max_blocks: std::env::var("Q4MOE_CUDA_ATT_BLOCKS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(params::ATT_MAX_BLOCKS),
            attn_grid: match std::env::var("Q4MOE_CUDA_ATT_GRID").as_deref() {
                Ok("capacity") => AttGrid::Capacity,
                Ok("step") => AttGrid::Step,
                _ => AttGrid::Request,
            },
            regrid_in_place: std::env::var("Q4MOE_CUDA_REGRID").is_ok_and(|v| v != "0"),
            router_fold: std::env::var("Q4MOE_CUDA_ROUTER_FOLD").map_or(true, |v| v != "0"),
            attn_tensor_cores: std::env::var("Q4MOE_CUDA_ATT_TC").map_or(true, |v| v != "0"),
            attn_stage: std::env::var("Q4MOE_CUDA_ATT_STAGE")
                .ok()
                .and_then(|v| v.parse().ok()),
            attn_min_span: std::env::var("Q4MOE_CUDA_ATT_MIN_SPAN")
                .ok()
                .and_then(|v| v.parse().ok()),
            prefill_chunk: std::env::var("Q4MOE_CUDA_PREFILL_CHUNK")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(params::PREFILL_CHUNK_DEFAULT),
            prefill_part_budget: 64 << 20,
            gate_up_cols: std::env::var("Q4MOE_CUDA_GU_COLS")
                .ok()
                .and_then(|v| v.parse().ok()),
            l2_persist_mib: std::env::var("Q4MOE_CUDA_L2_PERSIST")
                .ok()
                .and_then(|v| v.parse().ok()),
            l2_targets: Vec::new(),
            l2_stream: std::env::var("Q4MOE_CUDA_L2_STREAM").map_or(true, |v| v != "0"),
            mapped_readback: std::env::var("Q4MOE_CUDA_READBACK").map_or(true, |v| v != "copy"),
            head_argmax: std::env::var("Q4MOE_CUDA_HEAD_ARGMAX").map_or(true, |v| v != "0"),
            graph_steps: std::env::var("Q4MOE_CUDA_GRAPH_STEPS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(4),
        }
    }
}

/// GPU time of one kernel family, to set against the weight bytes it reads.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub calls: u64,
    pub total: Duration,
    pub bytes_read: u64,
}

/// How the setup cache came by its graphs: each capture (and instantiation) of a step, and each
/// in-place change of a captured step's attention grid as its reach grew or shrank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphSetups {
    pub captures: u64,
    pub regrids: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC failed to compile the kernels:\n{0}")]
    Compile(String),
    #[error("Q4MOE_CUDA_KERNEL_DIR: cannot read kernel source {path}: {source}")]
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

/// The first GPU's name, or why CUDA cannot be used here.
pub fn cuda_available() -> std::result::Result<String, String> {
    device::probe()?;
    let ctx = cudarc::driver::CudaContext::new(0)
        .map_err(|e| format!("cannot create a CUDA context: {e}"))?;
    ctx.name()
        .map_err(|e| format!("cannot read the device name: {e}"))
}
