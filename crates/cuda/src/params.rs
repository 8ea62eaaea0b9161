//! Kernel params structs, mirrored field for field from `kernels/*.cu` (`#[repr(C)]`; sizes
//! checked at compile time so a field added on one side only fails the build).

/// `QW`: a weight matrix on the device (see common.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Qw {
    pub data: u64,
    pub scales: u64,
    pub ty: i32,
    pub k: i32,
}
const _: () = assert!(std::mem::size_of::<Qw>() == 24);

/// `StepState`: per-token values the step's kernels advance.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepState {
    pub token: u32,
    pub pos: u32,
}

/// `STATE_RING` in common.cuh: slots of the host's step-state ring; the step at position `pos`
/// is read back from slot pos % STATE_RING (finish_step).
pub const STATE_RING: usize = 32;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MatvecParams {
    pub w: [Qw; 3],
    pub out: [u64; 3],
    pub input: u64,
    pub norm: u64,
    pub xn_out: u64,
    pub rows: [i32; 3],
    pub n_w: i32,
    pub k: i32,
    pub accumulate: i32,
    pub rows_per_warp: i32,
    pub eps: f32,
}
const _: () = assert!(std::mem::size_of::<MatvecParams>() == 152);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EmbedParams {
    pub w: Qw,
    pub state: u64,
    pub x: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeParams {
    pub qkv: u64,
    pub q_out: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub state: u64,
    pub n_head: i32,
    pub n_kv_head: i32,
    pub head_dim: i32,
    pub eps: f32,
    pub theta: f32,
}

/// Positions per attention chunk (`ATT_CHUNK` in attention.cu).
pub const ATT_CHUNK: usize = 32;

/// attn_gqa's blocks a KV head at most, by default (CudaOptions::attn_max_blocks).
pub const ATT_MAX_BLOCKS: usize = 32;

/// Tiles a warp of the tensor-core attention stages in shared memory at most (`TC_STAGE_MAX`
/// in attention.cu), and the bytes each costs the block (8 warps x 16 uint4 x 32 lanes).
pub const ATT_TC_STAGE_MAX: usize = 2;
pub const ATT_TC_STAGE_BYTES: u32 = 8 * 16 * 32 * 16;
/// ... and by default: one (256 positions in one block). H200, quick bench, session 16: Q4_0
/// 703.4 tok/s with 1, 696.0 with 0, 683.1 with 2 (Q4_K_M 671.1 / 656.1 / 669.6).
pub const ATT_TC_STAGE_DEFAULT: usize = 1;
/// Prompt tokens the batched prefill takes at once by default (CudaOptions::prefill_chunk).
/// H200, synthetic Qwen3-30B-A3B Q4_0, 4,096-token prompt, session 22: 0.88 s at 512, 0.86 s at
/// 1,024, 0.82 s at 2,048 (6.09 s a token at a time); 1,024 keeps its buffers near 250 MB.
pub const PREFILL_CHUNK_DEFAULT: usize = 1024;
/// Chunks a tensor-core attention block takes at least, by default (CudaOptions::attn_min_span).
pub const ATT_TC_MIN_SPAN_DEFAULT: usize = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnParams {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub part: u64,
    pub out: u64,
    pub state: u64,
    pub n_head: i32,
    pub n_kv_head: i32,
    pub head_dim: i32,
    pub n_split: i32,
    pub scale: f32,
}

/// `ProbeParams` in probe.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProbeParams {
    pub cell: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TopkParams {
    pub logits: u64,
    pub ids: u64,
    pub weights: u64,
    pub n_expert: i32,
    pub n_used: i32,
    pub norm_topk: i32,
}

/// `Experts` in moe.cu: the selected experts' ids and weights, and where a block keeps them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Experts {
    pub ids: u64,
    pub weights: u64,
    pub n_used: i32,
    pub scratch: i32,
}
const _: () = assert!(std::mem::size_of::<Experts>() == 24);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GateUpParams {
    pub gate: Qw,
    pub up: Qw,
    pub xn: u64,
    pub h: u64,
    pub norm: u64,
    pub experts: Experts,
    pub d_ff: i32,
    pub rows_per_warp: i32,
    pub eps: f32,
}
const _: () = assert!(std::mem::size_of::<GateUpParams>() == 112);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DownParams {
    pub down: Qw,
    pub h: u64,
    pub x: u64,
    pub out: u64,
    /// The folded router's slots (RouterFold::slots), or 0: experts' weights as given.
    pub slots: u64,
    pub experts: Experts,
    pub d_model: i32,
    pub n_used: i32,
    pub rows_per_warp: i32,
    pub n_expert: i32,
    pub norm_topk: i32,
    pub eps: f32,
}
const _: () = assert!(std::mem::size_of::<DownParams>() == 104);

/// `RouterFold` in moe.cu: the router's rows of o_proj's launch (step.rs `router_fold`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RouterFold {
    pub w: u64,
    pub fold: u64,
    pub norm: u64,
    pub x: u64,
    /// u64 [n_expert]: logit bits (low word) under the launch's tag (high word)
    pub slots: u64,
    pub ids: u64,
    pub sel: u64,
    /// u32: the last gather's tag (0 at first, never reset)
    pub epoch: u64,
    pub n_expert: i32,
    pub d_model: i32,
    pub q_dim: i32,
    pub n_used: i32,
}

/// `OprojRouterParams` in moe.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct OprojRouterParams {
    pub mv: MatvecParams,
    pub r: RouterFold,
}
const _: () = assert!(std::mem::size_of::<OprojRouterParams>() == 152 + 80);

/// Float4s of the residual / the attention output a thread of a router row takes (RF_X, RF_A
/// in moe.cu), at 256 threads.
pub const RF_MAX_D_MODEL: usize = 2 * 4 * 256;
pub const RF_MAX_Q_DIM: usize = 4 * 4 * 256;
/// Experts the folded router's top-k ranks within shared memory (moe.cu topk_logits: 3 x 4
/// bytes an expert, 48 KB).
pub const RF_MAX_EXPERTS: usize = 4000;

/// `FoldBuildParams` in moe.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FoldBuildParams {
    pub o: Qw,
    pub router: u64,
    pub norm: u64,
    pub out: u64,
    pub d_model: i32,
    pub q_dim: i32,
}
const _: () = assert!(std::mem::size_of::<FoldBuildParams>() == 56);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RouterParams {
    pub w: u64,
    pub input: u64,
    pub norm: u64,
    pub xn_out: u64,
    pub logits: u64,
    pub ids: u64,
    pub weights: u64,
    pub counter: u64,
    pub n_expert: i32,
    pub k: i32,
    pub n_used: i32,
    pub norm_topk: i32,
    pub eps: f32,
}
const _: () = assert!(std::mem::size_of::<RouterParams>() == 88);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ArgmaxParams {
    pub logits: u64,
    pub part_v: u64,
    pub part_i: u64,
    pub state: u64,
    /// Host-mapped StepState [STATE_RING], or 0 (common.cuh finish_step).
    pub publish: u64,
    pub n: i32,
    pub n_blocks: i32,
}

/// `HeadArgmaxParams` in sample.cu: the walking head's params, then the arg-max's (part_v /
/// part_i of the head's grid, n_blocks its size) and the last block's counter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HeadArgmaxParams {
    pub mv: MatvecParams,
    pub am: ArgmaxParams,
    pub counter: u64,
}
const _: () = assert!(std::mem::size_of::<HeadArgmaxParams>() == 208);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnGqaParams {
    pub qkv: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub part: u64,
    pub state: u64,
    pub out: u64,
    pub done: u64,
    pub n_head: i32,
    pub n_kv_head: i32,
    pub head_dim: i32,
    pub n_split: i32,
    pub scale: f32,
    pub eps: f32,
    pub theta: f32,
    pub max_blocks: i32,
    pub min_span: i32,
    pub stage: i32,
}
const _: () = assert!(std::mem::size_of::<AttnGqaParams>() == 112);

/// `SampleConfig` in sample.cu: the device sampler's settings, uploaded per request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleConfig {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
    pub pad: i32,
}
const _: () = assert!(std::mem::size_of::<SampleConfig>() == 32);

/// `SampleParams` in sample.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SampleParams {
    pub logits: u64,
    pub state: u64,
    /// Host-mapped StepState [STATE_RING], or 0 (common.cuh finish_step).
    pub publish: u64,
    pub cfg: u64,
    pub rng: u64,
    pub work: u64,
    pub finite: u64,
    pub nucleus: u64,
    pub counts: u64,
    pub n: i32,
    pub n_blocks: i32,
    pub walk_cpb: i32,
}
const _: () = assert!(std::mem::size_of::<SampleParams>() == 88);

/// `SAMPLE_MAX_K` in sample.cu: the largest top-k the device sampler takes (its block size).
pub const SAMPLE_MAX_K: usize = 1024;

/// `SAMPLE_CHUNK` in sample.cu: the logits a `sample_partial` block takes.
pub const SAMPLE_CHUNK: usize = 4096;

/// `WALK_CHUNKS` in sample.cu (q4moe_model::sampling::WALK_CHUNKS): the no-cut walk's chunks.
pub const WALK_CHUNKS: usize = q4moe_model::sampling::WALK_CHUNKS;

/// `PfQuantParams` in prefill.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PfQuantParams {
    pub src: u64,
    pub norm: u64,
    pub xq: u64,
    pub xf: u64,
    pub n: i32,
    pub stride: i32,
    pub swiglu: i32,
    pub eps: f32,
}
const _: () = assert!(std::mem::size_of::<PfQuantParams>() == 48);

/// `PfRowsParams` in prefill.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PfRowsParams {
    pub w: Qw,
    pub xq: u64,
    pub xf: u64,
    pub out: u64,
    pub list: u64,
    pub counts: u64,
    pub tiles: u64,
    pub rows: i32,
    pub out_stride: i32,
    pub list_cap: i32,
    pub n_dense: i32,
    pub accumulate: i32,
    pub in_is_out: i32,
    pub z_entries: i32,
    pub pad: i32,
}
const _: () = assert!(std::mem::size_of::<PfRowsParams>() == 104);

/// `PfListsParams` in prefill.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PfListsParams {
    pub ids: u64,
    pub list: u64,
    pub counts: u64,
    pub tiles: u64,
    pub tokens: i32,
    pub n_used: i32,
    pub n_expert: i32,
    pub list_cap: i32,
}
const _: () = assert!(std::mem::size_of::<PfListsParams>() == 48);

/// `PfCombineParams` in prefill.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PfCombineParams {
    pub x: u64,
    pub y: u64,
    pub weights: u64,
    pub d: i32,
    pub n_used: i32,
}
const _: () = assert!(std::mem::size_of::<PfCombineParams>() == 32);
