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
/// in attention_tc.cu), and the bytes each costs the block (8 warps x 16 uint4 x 32 lanes).
pub const ATT_TC_STAGE_MAX: usize = 2;
pub const ATT_TC_STAGE_BYTES: u32 = 8 * 16 * 32 * 16;
/// ... and by default: one (256 positions in one block). H200, quick bench, session 16: Q4_0
/// 703.4 tok/s with 1, 696.0 with 0, 683.1 with 2 (Q4_K_M 671.1 / 656.1 / 669.6).
pub const ATT_TC_STAGE_DEFAULT: usize = 1;
/// Prompt tokens the batched prefill takes at once by default (CudaOptions::prefill_chunk).
/// H200, synthetic Qwen3-30B-A3B Q4_0, 4,096-token prompt, session 22: 0.88 s at 512, 0.86 s at
/// 1,024, 0.82 s at 2,048 (6.09 s a token at a time); 1,024 keeps its buffers near 250 MB.
pub const PREFILL_CHUNK_DEFAULT: usize = 1024;

/// CudaOptions::few_tokens' default: launches of at most this many tokens run on bt_mma.
/// H100, synthetic Qwen3-30B-A3B Q4_0, batched step, prompt 128, 64 tokens, median of 5, one
/// call (bench/results/batch-bt-mma-h100-2026-12-06.json): at B = 16, 1,880.9 tok/s with 64
/// and 1,861.3 with 32 (bt_mma) against 1,360.9 with 8 (pf_mma); at B = 32 bt_mma gave 1,889.6
/// (pf_mma: 2,846.1 in the last session's H100 record), at B = 64 2,063.7 against pf_mma's
/// 4,343.2: bt_mma's passes of 8 entries re-read an expert's weights for each.
pub const FEW_TOKENS_DEFAULT: usize = 16;
/// Chunks a tensor-core attention block takes at least (8 tiles, one a warp; session 16: 1 and 8
/// were both ~4% slower at the bench's context).
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

/// `BtRopeParams` in prefill_attn.cu: the batched step's norm, RoPE and KV append, `kv` a
/// device table of each token's K and V cache for the layer ([tokens][2] addresses).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BtRopeParams {
    pub r: RopeParams,
    pub kv: u64,
}

/// `BtAttnParams` in prefill_attn.cu: the batched step's attention partials, `kv` as in
/// BtRopeParams.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BtAttnParams {
    pub a: AttnParams,
    pub kv: u64,
}

/// `BtArgmaxParams` in sample.cu: the batched step's greedy choice, a row a block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BtArgmaxParams {
    pub logits: u64,
    pub tokens: u64,
    pub n: i32,
    pub pad: i32,
}

/// What bt_argmax writes for a row holding a NaN or an infinity.
pub const BT_NON_FINITE: u32 = u32::MAX;

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

/// `MaskLogitsParams` in sample.cu: the logits, the constraint's bits, the vocabulary.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MaskLogitsParams {
    pub logits: u64,
    pub mask: u64,
    pub n: i32,
    pub pad: i32,
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

/// `BtGqaParams` in attention_tc.cu: the batched step's attention on tensor cores, row
/// blockIdx.z's buffers `g`'s advanced by the strides, its cache from the table at `kv`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BtGqaParams {
    pub g: AttnGqaParams,
    pub kv: u64,
    pub qkv_stride: u32,
    pub part_stride: u32,
    pub xq: u64,
    pub xf: u64,
}

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

/// `BtRowsParams` in batch_rows.cu: up to three matrices over one launch's activations (q, k
/// and v; gate and up): part 0 is `p`'s, parts 1 and 2 replace its weights, rows and output;
/// blocks [0, blocks0) take part 0, the next blocks1 part 1, the rest part 2.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BtRowsParams {
    pub p: PfRowsParams,
    pub w1: Qw,
    pub w2: Qw,
    pub out1: u64,
    pub out2: u64,
    pub rows1: i32,
    pub rows2: i32,
    pub blocks0: i32,
    pub blocks1: i32,
    /// const int* [slots]: a grouped launch over the routed slots (`Groups::Slots`), or 0.
    pub ids: u64,
    /// bt_mma's gate-and-up launch with `hcount`: silu(gate) * up quantised into `hq` / `hf`
    /// (`rows::Swiglu`).
    pub hq: u64,
    pub hf: u64,
    pub hcount: u64,
}

/// `BtF32Params` in batch_rows.cu: a dense F32 launch on bt_f32rows, with the split form's
/// buffers (the chains' sums, the tiles' counters) or 0 for the one-block-a-tile form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BtF32Params {
    pub p: PfRowsParams,
    pub part: u64,
    pub count: u64,
}

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

/// `BtRouteParams` in prefill.cu: bt_route's pf_route part, its pf_lists part, and the counter
/// of blocks done (zero between launches).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BtRouteParams {
    pub t: TopkParams,
    pub l: PfListsParams,
    pub done: u64,
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

/// `PfCombineQuantParams` in prefill.cu: pf_combine_quant's combine and its quantisation of
/// the same rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PfCombineQuantParams {
    pub c: PfCombineParams,
    pub q: PfQuantParams,
}

// ---- Layouts (dev/params_layout.py writes this block and the kernels' SIZE_IS / FIELD_AT)
// Each params struct's size and field offsets, the numbers the kernels assert for the same
// fields: a field moved, resized, added or dropped on one side only fails the build.
macro_rules! layout {
    ($t:ty, $size:expr; $($f:ident @ $off:expr),+ $(,)?) => {
        const _: () = {
            assert!(std::mem::size_of::<$t>() == $size);
            $(assert!(std::mem::offset_of!($t, $f) == $off);)+
        };
    };
}
layout!(Qw, 24; data @ 0, scales @ 8, ty @ 16, k @ 20);
layout!(StepState, 8; token @ 0, pos @ 4);
layout!(MatvecParams, 152; w @ 0, out @ 72, input @ 96, norm @ 104, xn_out @ 112, rows @ 120,
    n_w @ 132, k @ 136, accumulate @ 140, rows_per_warp @ 144, eps @ 148);
layout!(EmbedParams, 40; w @ 0, state @ 24, x @ 32);
layout!(RopeParams, 80; qkv @ 0, q_out @ 8, q_norm @ 16, k_norm @ 24, k_cache @ 32,
    v_cache @ 40, state @ 48, n_head @ 56, n_kv_head @ 60, head_dim @ 64, eps @ 68, theta @ 72);
layout!(AttnParams, 72; q @ 0, k_cache @ 8, v_cache @ 16, part @ 24, out @ 32, state @ 40,
    n_head @ 48, n_kv_head @ 52, head_dim @ 56, n_split @ 60, scale @ 64);
layout!(BtRopeParams, 88; r @ 0, kv @ 80);
layout!(BtAttnParams, 80; a @ 0, kv @ 72);
layout!(BtArgmaxParams, 24; logits @ 0, tokens @ 8, n @ 16, pad @ 20);
layout!(ProbeParams, 8; cell @ 0);
layout!(TopkParams, 40; logits @ 0, ids @ 8, weights @ 16, n_expert @ 24, n_used @ 28,
    norm_topk @ 32);
layout!(Experts, 24; ids @ 0, weights @ 8, n_used @ 16, scratch @ 20);
layout!(GateUpParams, 112; gate @ 0, up @ 24, xn @ 48, h @ 56, norm @ 64, experts @ 72,
    d_ff @ 96, rows_per_warp @ 100, eps @ 104);
layout!(DownParams, 104; down @ 0, h @ 24, x @ 32, out @ 40, slots @ 48, experts @ 56,
    d_model @ 80, n_used @ 84, rows_per_warp @ 88, n_expert @ 92, norm_topk @ 96, eps @ 100);
layout!(RouterFold, 80; w @ 0, fold @ 8, norm @ 16, x @ 24, slots @ 32, ids @ 40, sel @ 48,
    epoch @ 56, n_expert @ 64, d_model @ 68, q_dim @ 72, n_used @ 76);
layout!(OprojRouterParams, 232; mv @ 0, r @ 152);
layout!(FoldBuildParams, 56; o @ 0, router @ 24, norm @ 32, out @ 40, d_model @ 48, q_dim @ 52);
layout!(RouterParams, 88; w @ 0, input @ 8, norm @ 16, xn_out @ 24, logits @ 32, ids @ 40,
    weights @ 48, counter @ 56, n_expert @ 64, k @ 68, n_used @ 72, norm_topk @ 76, eps @ 80);
layout!(ArgmaxParams, 48; logits @ 0, part_v @ 8, part_i @ 16, state @ 24, publish @ 32, n @ 40,
    n_blocks @ 44);
layout!(MaskLogitsParams, 24; logits @ 0, mask @ 8, n @ 16, pad @ 20);
layout!(HeadArgmaxParams, 208; mv @ 0, am @ 152, counter @ 200);
layout!(AttnGqaParams, 112; qkv @ 0, q_norm @ 8, k_norm @ 16, k_cache @ 24, v_cache @ 32,
    part @ 40, state @ 48, out @ 56, done @ 64, n_head @ 72, n_kv_head @ 76, head_dim @ 80,
    n_split @ 84, scale @ 88, eps @ 92, theta @ 96, max_blocks @ 100, min_span @ 104, stage @ 108);
layout!(BtGqaParams, 144; g @ 0, kv @ 112, qkv_stride @ 120, part_stride @ 124, xq @ 128,
    xf @ 136);
layout!(SampleConfig, 32; temperature @ 0, top_k @ 4, top_p @ 8, min_p @ 12, repetition @ 16,
    presence @ 20, frequency @ 24, pad @ 28);
layout!(SampleParams, 88; logits @ 0, state @ 8, publish @ 16, cfg @ 24, rng @ 32, work @ 40,
    finite @ 48, nucleus @ 56, counts @ 64, n @ 72, n_blocks @ 76, walk_cpb @ 80);
layout!(PfQuantParams, 48; src @ 0, norm @ 8, xq @ 16, xf @ 24, n @ 32, stride @ 36,
    swiglu @ 40, eps @ 44);
layout!(PfRowsParams, 104; w @ 0, xq @ 24, xf @ 32, out @ 40, list @ 48, counts @ 56,
    tiles @ 64, rows @ 72, out_stride @ 76, list_cap @ 80, n_dense @ 84, accumulate @ 88,
    in_is_out @ 92, z_entries @ 96, pad @ 100);
layout!(BtRowsParams, 216; p @ 0, w1 @ 104, w2 @ 128, out1 @ 152, out2 @ 160, rows1 @ 168,
    rows2 @ 172, blocks0 @ 176, blocks1 @ 180, ids @ 184, hq @ 192, hf @ 200, hcount @ 208);
layout!(BtF32Params, 120; p @ 0, part @ 104, count @ 112);
layout!(PfListsParams, 48; ids @ 0, list @ 8, counts @ 16, tiles @ 24, tokens @ 32, n_used @ 36,
    n_expert @ 40, list_cap @ 44);
layout!(BtRouteParams, 96; t @ 0, l @ 40, done @ 88);
layout!(PfCombineParams, 32; x @ 0, y @ 8, weights @ 16, d @ 24, n_used @ 28);
layout!(PfCombineQuantParams, 80; c @ 0, q @ 32);
