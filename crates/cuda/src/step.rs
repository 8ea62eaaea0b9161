//! One decode step as a list of resolved launches. The setup cache keeps this list (and the
//! graph captured from it) per session; the eager path rebuilds it every token.

use q4moe_model::backend::KvType;
use q4moe_model::sampling::SamplingParams;
use q4moe_model::Config;

use crate::device::{DevBuf, Device, Kernel, Launch, GATE_UP};
use crate::l2::L2Plan;
use crate::params::*;
use crate::weights::Weights;
use crate::{AttGrid, CudaOptions, Result};

const THREADS: u32 = 256;
const WARPS: u32 = THREADS / 32;
/// router_topk's block: its x load needs k <= 4 floats x 4 a thread (k <= 2048 here).
const ROUTER_THREADS: u32 = 128;
/// router_cluster's cluster (blocks) and rows a block (warps): RC_BLOCKS / RC_WARPS in moe.cu.
const RC_BLOCKS: usize = 8;
const RC_WARPS: usize = 16;
/// Blocks of the arg-max's first stage.
pub const ARGMAX_BLOCKS: usize = 128;

/// Activations shared by every session (one stream runs one step at a time).
pub struct Scratch {
    /// StepState
    pub state: DevBuf,
    /// The host-mapped StepState ring the step's token choice writes (CudaOptions::
    /// mapped_readback; the backend sets it before any step is built), or 0: the host copies
    /// `state` back after each step.
    pub publish: u64,
    /// [d_model] residual stream
    pub x: DevBuf,
    /// [d_model] the residual's second buffer with the folded router (`residual`)
    pub x2: DevBuf,
    /// [d_model] normalised input of the FFN
    pub xn: DevBuf,
    /// [q_dim + 2 kv_dim]
    pub qkv: DevBuf,
    /// [q_dim] roped queries
    pub q: DevBuf,
    /// [n_head, n_split, head_dim + 2]
    pub part: DevBuf,
    /// [q_dim]
    pub attn: DevBuf,
    /// [n_expert]
    pub router: DevBuf,
    /// The folded router's gather (moe.cu RouterFold): [n_expert] u64 slots (a logit under its
    /// launch's tag) and the u32 epoch (the last gather's tag); zeroed once, never reset.
    pub router_slots: DevBuf,
    pub router_epoch: DevBuf,
    /// [n_used] i32 and [n_used] f32
    pub ids: DevBuf,
    pub topw: DevBuf,
    /// [n_used, d_ff]
    pub h: DevBuf,
    /// [vocab]
    pub logits: DevBuf,
    /// The arg-max's partials, f32 and i32: ARGMAX_BLOCKS, or the head's grid with the greedy
    /// choice in its tail, whichever is larger
    pub am_v: DevBuf,
    pub am_i: DevBuf,
    /// u32 last-block counter of the head's greedy choice (0 between launches)
    pub head_counter: DevBuf,
    /// The output head takes the greedy choice in its tail (CudaOptions::head_argmax).
    pub head_argmax: bool,
    /// i32 completion counter of router_topk's last-block pattern (0 between launches)
    pub counter: DevBuf,
    /// [n_kv_head + n_head] u32: attn_gqa's chunk completion counts, then its heads' maximum
    /// score keys (0 between launches)
    pub attn_done: DevBuf,
    /// SampleConfig of the request being decoded with the device sampler
    pub sample_cfg: DevBuf,
    /// u64 SplitMix64 state of that request
    pub rng: DevBuf,
    /// The device sampler's buffers (SampleParams::work, finite, nucleus; step::sample_bytes)
    pub sample_work: DevBuf,
    pub sample_finite: DevBuf,
    pub sample_nucleus: DevBuf,
    /// u32 [vocab]: each id's count in the request's history and draws (the device penalties)
    pub sample_counts: DevBuf,
    pub n_split: usize,
    /// attn_gqa's blocks a KV head (CudaOptions::attn_max_blocks, at most n_split).
    pub att_blocks: usize,
    /// Attention's grid for the positions reached, not att_blocks (CudaOptions::attn_grid not
    /// AttGrid::Capacity).
    pub att_grid_by_reach: bool,
    /// The router as one thread block cluster (`router_cluster`, Device::clusters).
    pub router_cluster: bool,
    /// The output head's grid (`looped`): 2 blocks an SM, as the walking kernels' launch bounds
    /// hold (matvec.cu MV_LOOP_KERNEL), or Q4MOE_CUDA_HEAD_BLOCKS when it parses, as
    /// Q4MOE_CUDA_ATT_BLOCKS does (0: a block a unit of rows).
    pub head_blocks: u32,
    /// Dynamic shared memory of attn_gqa's launches (Device::att_solo_smem, sized for the
    /// Qwen3-shape kernel; the generic one's static part is no larger, so its blocks are alone
    /// on an SM too).
    pub att_solo_smem: u32,
    /// Qwen3-shape attention on tensor cores (attn_gqa_128_8_tc): the f16 cache on sm_80+,
    /// where CudaOptions::attn_tensor_cores.
    pub att_tc: bool,
    /// Chunks a tensor-core attention block takes at least: CudaOptions::attn_min_span or
    /// ATT_TC_MIN_SPAN_DEFAULT, at least 1. The scalar kernels take 1.
    pub att_min_span: usize,
    /// Tiles past its first a warp of the tensor-core attention loads into shared memory
    /// before pdl_wait (AttnGqaParams::stage): CudaOptions::attn_stage or ATT_TC_STAGE_DEFAULT,
    /// at most what the kernel's dynamic shared memory holds and ATT_TC_STAGE_MAX. The scalar
    /// kernels take 0.
    pub att_stage: usize,
    /// moe_gate_up's grid along a slot's units, by mode (CudaOptions::gate_up_cols; 0: a block
    /// a unit, as the generic mode always takes).
    pub gate_up_cols: [u32; GATE_UP.len()],
    /// The weights' L2 policy: which launches get which access-policy window (l2.rs).
    pub l2: L2Plan,
    /// Owns the small buffers above (`Arena`); dropped last, after their views.
    _arena: Arena,
}

/// The step's small buffers (activations, counters, ids) in one allocation, each 256-byte
/// aligned in a fixed order, so where they lie against each other does not follow what else is
/// allocated (the attention partials' size followed the KV's capacity and moved every buffer
/// after it: ~0.8% of Q4_K_M's decode, NOTES.md session 38). Q4MOE_CUDA_ARENA=0 allocates
/// each on its own; Q4MOE_CUDA_ARENA_PAD=<bytes> sets the gap before `attn` (ARENA_GAP),
/// Q4MOE_CUDA_ARENA_LEAD=<bytes> the free bytes before the first buffer (0), which moves them all.
struct Arena {
    buf: Option<DevBuf>,
    used: usize,
}

/// A byte count from the environment (the arena's layout A/B knobs), if set and a number.
fn env_bytes(key: &str) -> Option<usize> {
    std::env::var(key).ok().and_then(|v| v.parse().ok())
}

/// Bytes left free between the buffers up to `q` and those from `attn` on. Why: every fast
/// layout measured had one (the partials between them, 216 KB at a 392-position KV, 682 KB at
/// 1,288: Q4_K_M 797-799 tok/s), every slow one none (the partials at 2.3 MB in an allocation
/// of their own, or allocated last: 790-794); the layout at a 392-position KV (NOTES.md
/// session 38). Why it matters is not known. 256 KB: the best of 14 gaps from 0 to 1 MB in one
/// binary (session 41: Q4_K_M 791.1-795.7 tok/s over the gaps, 216 KB 794.1, 256 KB 795.7).
const ARENA_GAP: usize = 256 << 10;

impl Arena {
    const BYTES: usize = 2 << 20;

    fn new(dev: &Device) -> Result<Arena> {
        let on = std::env::var("Q4MOE_CUDA_ARENA").map_or(true, |v| v != "0");
        let buf = on.then(|| DevBuf::new(dev, Arena::BYTES)).transpose()?;
        Ok(Arena { buf, used: 0 })
    }

    /// `bytes` of the arena, zeroed; their own allocation past its end or with it off.
    fn take(&mut self, dev: &Device, bytes: usize) -> Result<DevBuf> {
        let at = self.used.next_multiple_of(256);
        let b = match &self.buf {
            Some(buf) if at + bytes <= Arena::BYTES => {
                self.used = at + bytes;
                buf.view(at, bytes)
            }
            _ => DevBuf::new(dev, bytes)?,
        };
        b.fill(dev, 0)?;
        Ok(b)
    }

    fn skip(&mut self, bytes: usize) {
        // past the end every later buffer takes an allocation of its own (no overflow)
        self.used = (self.used + bytes.min(Arena::BYTES)).min(Arena::BYTES);
    }
}

impl Scratch {
    pub fn new(dev: &Device, c: &Config, opts: &CudaOptions, l2: L2Plan) -> Result<Scratch> {
        let (kv_capacity, attn_max_blocks) = (opts.kv_capacity, opts.attn_max_blocks);
        let f = |n: usize| DevBuf::new(dev, n * 4);
        let mut arena = Arena::new(dev)?;
        arena.skip(env_bytes("Q4MOE_CUDA_ARENA_LEAD").unwrap_or(0));
        let mut a = |bytes: usize| arena.take(dev, bytes);
        let n_split = kv_capacity.div_ceil(ATT_CHUNK);
        let counter = a(4)?;
        let (router_slots, router_epoch) = (a(8 * c.n_expert)?, a(4)?);
        let attn_done = a(4 * (c.n_kv_head + c.n_head))?;
        let att_tc = opts.attn_tensor_cores && dev.kv_type == KvType::F16 && dev.sm_major >= 8;
        let stage_room = dev.dynamic_smem_room(Kernel::AttnGqa128x8Tc) / ATT_TC_STAGE_BYTES;
        let stage_fit = ATT_TC_STAGE_MAX.min(stage_room as usize);
        let (sample_work, sample_finite, sample_nucleus) = sample_bytes(c.vocab_size);
        let head_blocks = match std::env::var("Q4MOE_CUDA_HEAD_BLOCKS").map(|v| v.parse()) {
            Ok(Ok(n)) => n,
            _ => 2 * dev.sm_count()?,
        };
        let head_counter = a(4)?;
        let partials = ARGMAX_BLOCKS.max(head_blocks as usize);
        let (state, x, x2, xn) = (
            a(size_of::<StepState>())?,
            a(4 * c.d_model)?,
            a(4 * c.d_model)?,
            a(4 * c.d_model)?,
        );
        let (qkv, q) = (a(4 * (c.q_dim() + 2 * c.kv_dim()))?, a(4 * c.q_dim())?);
        arena.skip(env_bytes("Q4MOE_CUDA_ARENA_PAD").unwrap_or(ARENA_GAP));
        let mut a = |bytes: usize| arena.take(dev, bytes);
        let (attn, router) = (a(4 * c.q_dim())?, a(4 * c.n_expert)?);
        let (ids, topw) = (a(4 * c.n_expert_used)?, a(4 * c.n_expert_used)?);
        let h = a(4 * c.n_expert_used * c.d_ff_expert)?;
        let (am_v, am_i) = (a(4 * partials)?, a(4 * partials)?);
        let (sample_cfg, rng) = (a(size_of::<SampleConfig>())?, a(8)?);
        Ok(Scratch {
            state,
            publish: 0,
            x,
            x2,
            xn,
            qkv,
            q,
            attn,
            router,
            router_slots,
            router_epoch,
            ids,
            topw,
            h,
            logits: f(c.vocab_size)?,
            am_v,
            am_i,
            head_counter,
            head_argmax: opts.head_argmax,
            counter,
            attn_done,
            sample_cfg,
            rng,
            sample_work: DevBuf::new(dev, sample_work)?,
            sample_finite: DevBuf::new(dev, sample_finite)?,
            sample_nucleus: DevBuf::new(dev, sample_nucleus)?,
            sample_counts: f(c.vocab_size)?,
            n_split,
            att_blocks: n_split.min(attn_max_blocks.max(1)),
            att_grid_by_reach: opts.attn_grid != AttGrid::Capacity,
            router_cluster: dev.clusters,
            head_blocks,
            att_solo_smem: dev.att_solo_smem(Kernel::AttnGqa128x8)?,
            att_tc,
            att_min_span: opts.attn_min_span.unwrap_or(ATT_TC_MIN_SPAN_DEFAULT).max(1),
            att_stage: opts
                .attn_stage
                .unwrap_or(ATT_TC_STAGE_DEFAULT)
                .min(stage_fit),
            gate_up_cols: gate_up_cols(dev, c, opts.gate_up_cols)?,
            // Last: its size follows the KV's capacity, and the buffers after it moved with it.
            part: f(c.n_head * n_split * (c.head_dim + 2))?,
            l2,
            _arena: arena,
        })
    }

    pub fn bytes(c: &Config, kv_capacity: usize) -> usize {
        let n_split = kv_capacity.div_ceil(ATT_CHUNK);
        let (work, finite, nucleus) = sample_bytes(c.vocab_size);
        work + finite
            + nucleus
            + 4 * c.vocab_size
            + 4
            + 4 * (4 * c.d_model
                + 3 * c.q_dim()
                + 2 * c.kv_dim()
                + c.n_head * n_split * (c.head_dim + 2)
                + c.vocab_size
                + c.n_expert * 4)
    }
}

/// A session's KV cache: [n_layer, capacity, kv_dim] for K and for V, of the device's KV type.
pub struct Kv {
    pub k: DevBuf,
    pub v: DevBuf,
    pub capacity: usize,
    elem_bytes: usize,
}

impl Kv {
    /// Bytes of K and V together (what Kv::new allocates).
    pub fn bytes(c: &Config, capacity: usize, kv_type: KvType) -> usize {
        2 * c.n_layer * capacity * c.kv_dim() * kv_type.bytes()
    }

    pub fn new(dev: &Device, c: &Config, capacity: usize) -> Result<Kv> {
        let elem_bytes = dev.kv_type.bytes();
        let bytes = Kv::bytes(c, capacity, dev.kv_type) / 2;
        Ok(Kv {
            k: DevBuf::new(dev, bytes)?,
            v: DevBuf::new(dev, bytes)?,
            capacity,
            elem_bytes,
        })
    }
    pub(crate) fn layer(&self, c: &Config, l: usize) -> (u64, u64) {
        let off = (l * self.capacity * c.kv_dim() * self.elem_bytes) as u64;
        (self.k.ptr + off, self.v.ptr + off)
    }
}

fn smem_x(k: usize) -> u32 {
    // red (36 floats, keeps xs 16-byte aligned) + xs padded to XS = 36 per 32 (common.cuh)
    (((k / 32) * 36 + 36 + 36) * 4) as u32
}

pub(crate) fn weight_bytes(w: &Qw, rows: usize) -> u64 {
    let ty = q4moe_gguf::GgmlType::from_id(w.ty as u32).expect("valid type");
    (crate::repack::device_row_bytes(ty, w.k as usize) * rows) as u64
}

/// Rows each warp computes: enough blocks to fill the GPU (132 SMs) without re-loading the
/// activations into shared memory more often than needed.
fn rows_per_warp(rows: usize) -> usize {
    if rows >= 8192 {
        4
    } else if rows >= 2048 {
        2
    } else {
        1
    }
}

/// Q4MOE_CUDA_LEGACY=1 selects the v2 kernel paths (row-by-row matvecs, separate top-k): a
/// bisecting aid for the staged paths, not a supported configuration.
fn legacy() -> bool {
    std::env::var_os("Q4MOE_CUDA_LEGACY").is_some()
}

pub(crate) const T_F32: i32 = 0;
pub(crate) const T_Q4_0: i32 = 2;
pub(crate) const T_Q4_K: i32 = 12;
pub(crate) const T_Q6_K: i32 = 14;

/// (mode, rows per warp) of `matvec` (matvec.cu, a kernel each): a staged mode when
/// every matrix has the same type (or Q4_K and Q6_K, mode 9) and a group of rows never
/// spans two matrices.
fn mv_mode(ws: &[(Qw, u64, usize)], k: usize) -> (u8, usize) {
    let total: usize = ws.iter().map(|w| w.2).sum();
    let generic = (0, rows_per_warp(total));
    let ty = ws[0].0.ty;
    if legacy() {
        return generic;
    }
    let (mode, nr) = match ty {
        // Q4_K_M's QKV on half the layers: Q4_K q and k, Q6_K v.
        _ if ws.iter().any(|w| w.0.ty != ty) => {
            let k_quant = |t: i32| t == T_Q4_K || t == T_Q6_K;
            if !ws.iter().all(|w| k_quant(w.0.ty)) || !k.is_multiple_of(256) || k > 2048 {
                return generic;
            }
            (9, 2)
        }
        // Split types (as repacked): one 32-weight block a lane piece.
        T_Q4_0 | T_Q6_K if k.is_multiple_of(32) => {
            let first = if ty == T_Q4_0 { 1 } else { 6 };
            match (k / 32).div_ceil(32) {
                1 => (first, 4),
                2 => (first + 1, 2),
                3 | 4 => (first + 2, 1),
                _ => return generic,
            }
        }
        // Q4_K: no 4-row mode (k <= 1024 takes the 2-row one).
        T_Q4_K if k.is_multiple_of(256) => match (k / 32).div_ceil(32) {
            1 | 2 => (4, 2),
            3 | 4 => (5, 1),
            _ => return generic,
        },
        _ => return generic,
    };
    if ws[..ws.len() - 1].iter().any(|w| w.2 % nr != 0) {
        return generic;
    }
    (mode, nr)
}

/// One matvec launch's operands: up to three matrices (weights, output, rows) whose rows are
/// concatenated in the output space, over one input of k values.
pub(crate) struct Mv<'a> {
    pub ws: &'a [(Qw, u64, usize)],
    pub input: u64,
    pub k: usize,
    /// RMSNorm weight applied to the input (0: none), with `eps`
    pub norm: u64,
    pub eps: f32,
    /// Where block 0 also stores the normalised input (0: nowhere; the generic mode only)
    pub xn_out: u64,
    /// out += result (the residual add) instead of out = result
    pub accumulate: bool,
}

impl<'a> Mv<'a> {
    /// `ws` times `input`, no norm, no residual.
    pub fn new(ws: &'a [(Qw, u64, usize)], input: u64, k: usize) -> Mv<'a> {
        Mv {
            ws,
            input,
            k,
            norm: 0,
            eps: 0.0,
            xn_out: 0,
            accumulate: false,
        }
    }
}

pub(crate) fn matvec(name: &'static str, m: &Mv) -> Launch {
    let (p, mode, blocks, bytes) = matvec_params(m);
    let smem = smem_x(m.k);
    Launch::new(
        Kernel::Matvec(mode),
        name,
        (blocks, 1, 1),
        THREADS,
        smem,
        &p,
        bytes,
    )
}

/// `matvec`'s params, mode, blocks and weight bytes.
fn matvec_params(m: &Mv) -> (MatvecParams, u8, u32, u64) {
    let Mv {
        ws,
        input,
        k,
        norm,
        eps,
        xn_out,
        accumulate,
    } = *m;
    let mut p = MatvecParams {
        input,
        norm,
        xn_out,
        k: k as i32,
        accumulate: accumulate as i32,
        eps,
        n_w: ws.len() as i32,
        ..Default::default()
    };
    let mut total = 0;
    for (i, (w, out, rows)) in ws.iter().enumerate() {
        p.w[i] = *w;
        p.out[i] = *out;
        p.rows[i] = *rows as i32;
        total += rows;
    }
    // The staged modes keep only the quantised input (matvec.cu mv_staged): none for xn_out.
    let (mode, rpw) = if xn_out == 0 {
        mv_mode(ws, k)
    } else {
        (0, rows_per_warp(total))
    };
    p.rows_per_warp = rpw as i32;
    let blocks = total.div_ceil(rpw * WARPS as usize) as u32;
    let bytes = ws.iter().map(|(w, _, r)| weight_bytes(w, *r)).sum();
    (p, mode, blocks, bytes)
}

/// Whether every layer's router is folded into its o_proj launch (moe.cu RouterFold): the fold
/// was built (weights.rs router_fold_applies) and o_proj and both expert launches have staged
/// modes (the generic ones neither normalise the experts' input nor weigh the folded logits).
fn router_fold(c: &Config, w: &Weights) -> bool {
    w.layers.iter().all(|lw| {
        lw.router_fold != 0
            && matches!(mv_mode(&[(lw.o, 0, c.d_model)], c.q_dim()).0, 1..=8)
            && gate_up_mode(lw, c.d_model).0 != 0
            && down_mode(lw, c).0 != 0
    })
}

/// A layer's residual buffers: `x` in and out, and the residual after attention (o_proj's
/// output, the experts' input): `x` itself, updated in place, without the fold. With it o_proj
/// writes `x2` while its router rows still read `x`, and moe_down writes the layer's output
/// back to `x` while its blocks read `x2` (moe.cu fold_weights: every block reads all of it
/// before its wait, so in place a block that started late could read rows another had updated).
fn residual(s: &Scratch, fold: bool) -> (u64, u64) {
    (s.x.ptr, if fold { s.x2.ptr } else { s.x.ptr })
}

/// o_proj (`x_out = r.x + o attn`) with the router's rows as the launch's first n_expert
/// blocks (moe.cu OPROJ_ROUTER_KERNEL): the unscaled logits, the chosen experts' ids and
/// logits. `router` (F32) is only for the bytes read; the caller checks o's mode is staged.
pub(crate) fn o_proj_router(o: Qw, router: &Qw, attn: u64, x_out: u64, r: RouterFold) -> Launch {
    let (n_expert, q_dim) = (r.n_expert as usize, r.q_dim as usize);
    let ws = [(o, x_out, r.d_model as usize)];
    let o_proj = Mv {
        accumulate: true,
        ..Mv::new(&ws, attn, q_dim)
    };
    let (mv, mode, blocks, bytes) = matvec_params(&o_proj);
    let router_bytes = weight_bytes(router, n_expert) + (n_expert * q_dim * 4) as u64;
    Launch::new(
        Kernel::OprojRouter(mode),
        "o_proj",
        (blocks + n_expert as u32, 1, 1),
        THREADS,
        smem_x(q_dim).max(
            ((40 + 2 * n_expert.next_multiple_of(4) + n_expert.max(THREADS as usize)) * 4) as u32,
        ),
        &OprojRouterParams { mv, r },
        bytes + router_bytes,
    )
}

/// Layer `lw`'s o_proj_router over the step's buffers.
fn layer_o_proj_router(
    c: &Config,
    lw: &crate::weights::LayerW,
    s: &Scratch,
    x_in: u64,
    x_out: u64,
) -> Launch {
    let r = RouterFold {
        w: lw.router.data,
        fold: lw.router_fold,
        norm: lw.ffn_norm,
        x: x_in,
        slots: s.router_slots.ptr,
        ids: s.ids.ptr,
        sel: s.topw.ptr,
        epoch: s.router_epoch.ptr,
        n_expert: c.n_expert as i32,
        d_model: c.d_model as i32,
        q_dim: c.q_dim() as i32,
        n_used: c.n_expert_used as i32,
    };
    o_proj_router(lw.o, &lw.router, s.attn.ptr, x_out, r).with_l2(s.l2.o_proj(c, lw))
}

/// The device sampler's settings for `p`, or None when it needs the host sampler (top-k above
/// SAMPLE_MAX_K). Top-k off is the device's nucleus (with a top-p cut) or its
/// vocabulary-order walk (without).
pub fn sample_config(p: &SamplingParams) -> Option<SampleConfig> {
    (p.top_k <= SAMPLE_MAX_K).then_some(SampleConfig {
        temperature: p.temperature,
        top_k: p.top_k as i32,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition: p.repetition_penalty,
        presence: p.presence_penalty,
        frequency: p.frequency_penalty,
        pad: 0,
    })
}

/// How a step chooses its token after the head: the arg-max or the device sampler
/// (`sampled`), after the penalties of the request's history and draws (`penalized`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Choice {
    pub sampled: bool,
    pub penalized: bool,
}

impl Choice {
    pub fn of(p: &SamplingParams) -> Choice {
        Choice {
            sampled: !p.is_greedy(),
            penalized: p.has_penalties(),
        }
    }
}

/// What a step runs after its layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The output head and the token's choice (decode; a prompt's last token).
    Head(Choice),
    /// Nothing: a prompt's tokens before its last leave only their keys and values (the head
    /// read 175 MB a token, ~3% of a Qwen3-30B-A3B step).
    LayersOnly,
}

/// The whole step for a session's KV and attention lengths up to `reach`: embedding, every
/// layer, then what `ending` says (the head and the token's choice, with the settings in
/// `s.sample_cfg`, or nothing).
pub fn build(
    c: &Config,
    w: &Weights,
    s: &Scratch,
    (kv, reach): (&Kv, usize),
    ending: Ending,
) -> Vec<Launch> {
    let mut out = layers(c, w, s, (kv, reach));
    out.extend(tail(c, w, s, ending));
    out
}

/// The embedding and every layer (what the fused step replaces), for attention lengths up to
/// `reach` (`att_grid`).
pub fn layers(c: &Config, w: &Weights, s: &Scratch, (kv, reach): (&Kv, usize)) -> Vec<Launch> {
    let mut out = Vec::with_capacity(8 * c.n_layer + 1);
    let fold = router_fold(c, w);
    let e = EmbedParams {
        w: w.embd,
        state: s.state.ptr,
        x: s.x.ptr, // every layer's input (residual)
    };
    out.push(Launch::new(
        Kernel::Embed,
        "embed",
        ((c.d_model as u32).div_ceil(THREADS), 1, 1),
        THREADS,
        0,
        &e,
        weight_bytes(&w.embd, 1),
    ));
    for l in 0..c.n_layer {
        layer(c, w, s, kv, (l, reach), fold, &mut out);
    }
    omit(out)
}

/// Timing experiments only (the output is wrong): Q4MOE_CUDA_OMIT=o_proj,moe_down leaves those
/// launches out (layers' or the tail's, e.g. head), so the step time drops by what they cost
/// inside the graph.
fn omit(mut out: Vec<Launch>) -> Vec<Launch> {
    if let Ok(omit) = std::env::var("Q4MOE_CUDA_OMIT") {
        out.retain(|l| !omit.split(',').any(|n| n == l.name));
    }
    out
}

/// `l` on at most `blocks` blocks that walk its rows grid-wide (matvec.cu mv_staged LOOP:
/// modes 10..17 are modes 1..8 walking); other launches, and grids no larger, stay as they
/// are. Only for a `matvec` of one matrix without accumulate (the walk keeps the first unit's
/// matrix and reads no old outputs): the head, and the kernel test of it.
pub(crate) fn looped(mut l: Launch, blocks: u32) -> Launch {
    if let Kernel::Matvec(m @ 1..=8) = l.kernel {
        if blocks > 0 && l.grid.0 > blocks {
            l.kernel = Kernel::Matvec(m + 9);
            l.grid.0 = blocks;
        }
    }
    l
}

/// The device sampler's buffers over `n` logits, in bytes (SampleParams): `work` (the candidates,
/// a key and an id for up to SAMPLE_MAX_K a chunk; or the walk's weights, chunk sums and last
/// ids; or the nucleus's weights and edge), `finite` (the chunks' finite counts and maxima),
/// `nucleus` (its 256 bucket sums and the edge's length).
pub(crate) fn sample_bytes(n: usize) -> (usize, usize, usize) {
    let chunks = n.div_ceil(SAMPLE_CHUNK);
    let work = (chunks * SAMPLE_MAX_K * 8)
        .max(4 * (n + 2 * WALK_CHUNKS))
        .max(12 * n);
    (work, chunks * 8, 257 * 8)
}

/// The device sampler over `n` logits (sample.cu): each chunk's candidates, the walk's chunk
/// sums or the nucleus's bucket sums, the nucleus's edge, then the draw. `p`'s buffers as
/// sample_bytes(n) sizes them; n, n_blocks and walk_cpb are set here.
pub(crate) fn sample(mut p: SampleParams, n: usize) -> [Launch; 4] {
    p.n = n as i32;
    p.n_blocks = n.div_ceil(SAMPLE_CHUNK) as i32;
    // A walk block's chunks in at most 32 KB of shared memory where they fit.
    let len = n.div_ceil(WALK_CHUNKS).max(1);
    p.walk_cpb = (8192 / len).clamp(1, 32) as i32;
    let walk_smem = (p.walk_cpb as usize * len * 4) as u32;
    let walk_blocks = WALK_CHUNKS.div_ceil(p.walk_cpb as usize) as u32;
    let threads = SAMPLE_MAX_K as u32;
    [
        Launch::new(
            Kernel::SamplePartial,
            "sample",
            (p.n_blocks as u32, 1, 1),
            threads,
            0,
            &p,
            0,
        ),
        Launch::new(
            Kernel::SampleWalk,
            "sample",
            (walk_blocks, 1, 1),
            256,
            walk_smem,
            &p,
            0,
        ),
        Launch::new(
            Kernel::SampleEdge,
            "sample",
            (p.n_blocks as u32, 1, 1),
            threads,
            0,
            &p,
            0,
        ),
        Launch::new(Kernel::SampleTopk, "sample", (1, 1, 1), threads, 0, &p, 0),
    ]
}

/// The output head, then the token choice as `ending` says: the penalties (rewriting the
/// logits), the arg-max or the device sampler, the choice counted for the next penalties. A
/// plain greedy choice runs in the head's own tail where it can (`head_argmax`).
pub fn tail(c: &Config, w: &Weights, s: &Scratch, ending: Ending) -> Vec<Launch> {
    omit(tail_launches(c, w, s, ending))
}

fn tail_launches(c: &Config, w: &Weights, s: &Scratch, ending: Ending) -> Vec<Launch> {
    let Ending::Head(choice) = ending else {
        return Vec::new();
    };
    let rows = [(w.output, s.logits.ptr, c.vocab_size)];
    let head = Mv {
        norm: w.output_norm,
        eps: c.rms_eps,
        ..Mv::new(&rows, s.x.ptr, c.d_model)
    };
    let l2 = s.l2.head(c, w);
    let greedy = !choice.sampled && !choice.penalized && s.head_argmax;
    let am = argmax_params(c, s, 0);
    if let Some(l) = greedy
        .then(|| head_argmax(&head, s.head_blocks, am, s.head_counter.ptr))
        .flatten()
    {
        return vec![l.with_l2(l2)];
    }
    let mut out = vec![looped(matvec("head", &head).with_l2(l2), s.head_blocks)];
    let p = SampleParams {
        logits: s.logits.ptr,
        state: s.state.ptr,
        publish: s.publish,
        cfg: s.sample_cfg.ptr,
        rng: s.rng.ptr,
        work: s.sample_work.ptr,
        finite: s.sample_finite.ptr,
        nucleus: s.sample_nucleus.ptr,
        counts: s.sample_counts.ptr,
        n: c.vocab_size as i32,
        ..Default::default()
    };
    let one = |k: Kernel, grid: u32| Launch::new(k, "sample", (grid, 1, 1), THREADS, 0, &p, 0);
    if choice.penalized {
        out.push(one(
            Kernel::SamplePenalize,
            (c.vocab_size as u32).div_ceil(THREADS),
        ));
    }
    if choice.sampled {
        out.extend(sample(p, c.vocab_size));
    } else {
        out.extend(argmax(c, s));
    }
    if choice.penalized {
        out.push(one(Kernel::SampleCount, 1));
    }
    out
}

/// The head (`head`, one matrix) walking its rows on at most `blocks` blocks with the greedy
/// choice in its tail (sample.cu head_argmax): the logits as the head writes them and the
/// state as `am`'s arg-max (its partials at least the grid's; `counter` a zeroed u32). None
/// where the rows have no staged mode or `blocks` is 0 (a block a unit of rows: no walk).
pub(crate) fn head_argmax(
    head: &Mv,
    blocks: u32,
    am: ArgmaxParams,
    counter: u64,
) -> Option<Launch> {
    let (mv, mode, rows_blocks, bytes) = matvec_params(head);
    if !(1..=8).contains(&mode) || blocks == 0 {
        return None;
    }
    let grid = rows_blocks.min(blocks);
    let p = HeadArgmaxParams {
        mv,
        am: ArgmaxParams {
            n_blocks: grid as i32,
            ..am
        },
        counter,
    };
    Some(Launch::new(
        Kernel::HeadArgmax(mode),
        "head",
        (grid, 1, 1),
        THREADS,
        smem_x(head.k),
        &p,
        bytes,
    ))
}

/// The arg-max's params over the logits into the step state, `n_blocks` partials.
fn argmax_params(c: &Config, s: &Scratch, n_blocks: usize) -> ArgmaxParams {
    ArgmaxParams {
        logits: s.logits.ptr,
        part_v: s.am_v.ptr,
        part_i: s.am_i.ptr,
        state: s.state.ptr,
        publish: s.publish,
        n: c.vocab_size as i32,
        n_blocks: n_blocks as i32,
    }
}

/// The arg-max of the logits into the step state: partial maxima, then the final one.
fn argmax(c: &Config, s: &Scratch) -> [Launch; 2] {
    let am = argmax_params(c, s, ARGMAX_BLOCKS);
    [
        Launch::new(
            Kernel::ArgmaxPartial,
            "argmax",
            (ARGMAX_BLOCKS as u32, 1, 1),
            THREADS,
            0,
            &am,
            0,
        ),
        Launch::new(Kernel::ArgmaxFinal, "argmax", (1, 1, 1), 128, 0, &am, 0),
    ]
}

fn layer(
    c: &Config,
    w: &Weights,
    s: &Scratch,
    kv: &Kv,
    (l, reach): (usize, usize),
    fold: bool,
    out: &mut Vec<Launch>,
) {
    let lw = &w.layers[l];
    let (x, x_mid) = residual(s, fold);
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    let qkv = [
        (lw.q, s.qkv.ptr, q_dim),
        (lw.k, s.qkv.ptr + 4 * q_dim as u64, kv_dim),
        (lw.v, s.qkv.ptr + 4 * (q_dim + kv_dim) as u64, kv_dim),
    ];
    let stream = s.l2.stream(&qkv.map(|(w, _, rows)| (w, rows)));
    let qkv = Mv {
        norm: lw.attn_norm,
        eps: c.rms_eps,
        ..Mv::new(&qkv, x, c.d_model)
    };
    out.push(matvec("qkv", &qkv).with_l2(stream));
    let (kc, vc) = kv.layer(c, l);
    let bufs = (s.q.ptr, s.part.ptr, s.attn.ptr, s.state.ptr);
    let a = attn_params(c, (kc, vc), bufs, s.n_split);
    if let Some(g) = gqa(c, s) {
        let (kernel, min_span, stage) = (g.kernel, g.min_span, g.stage);
        let g = AttnGqaParams {
            qkv: s.qkv.ptr,
            q_norm: lw.q_norm,
            k_norm: lw.k_norm,
            k_cache: kc,
            v_cache: vc,
            part: s.part.ptr,
            state: s.state.ptr,
            out: s.attn.ptr,
            done: s.attn_done.ptr,
            n_head: c.n_head as i32,
            n_kv_head: c.n_kv_head as i32,
            head_dim: c.head_dim as i32,
            n_split: s.n_split as i32,
            scale: a.scale,
            eps: c.rms_eps,
            theta: c.rope_theta,
            max_blocks: s.att_blocks as i32,
            min_span: min_span as i32,
            stage: stage as i32,
        };
        // The staged tiles' shared memory holds the blocks one an SM as att_solo_smem does.
        let smem = s.att_solo_smem.max(stage as u32 * ATT_TC_STAGE_BYTES);
        out.push(Launch::new(
            kernel,
            "attn_gqa",
            att_dims(c, s, reach),
            256,
            smem,
            &g,
            0,
        ));
    } else {
        let r = rope_params(c, lw, (kc, vc), (s.qkv.ptr, s.q.ptr), s.state.ptr);
        let kernels = [Kernel::QkNormRope, Kernel::AttnSplit, Kernel::AttnCombine];
        out.extend(split_attention(c, &r, &a, 1, kernels));
    }
    if fold {
        out.push(layer_o_proj_router(c, lw, s, x, x_mid));
    } else {
        o_proj_then_router(c, lw, s, x_mid, out);
    }
    experts(c, lw, s, fold, (x_mid, x), out);
}

/// The one-launch attention's kernel and its span knobs (AttnGqaParams::min_span, stage), where
/// the geometry has one (else the generic three launches, `split_attention`).
struct Gqa {
    kernel: Kernel,
    min_span: usize,
    stage: usize,
}

fn gqa(c: &Config, s: &Scratch) -> Option<Gqa> {
    let group = c.n_head / c.n_kv_head.max(1);
    let fits = !legacy()
        && std::env::var_os("Q4MOE_CUDA_NO_GQA").is_none()
        && c.n_head.is_multiple_of(c.n_kv_head)
        && group <= 8
        && c.head_dim.is_multiple_of(64)
        && c.head_dim <= 128;
    if !fits {
        return None;
    }
    // Qwen3-MoE's shape has a kernel with it as constants (attention.cu), also on tensor cores;
    // the span and staging knobs are that kernel's.
    let kernel = match (c.head_dim == 128 && c.n_head == 8 * c.n_kv_head, s.att_tc) {
        (true, true) => Kernel::AttnGqa128x8Tc,
        (true, false) => Kernel::AttnGqa128x8,
        (false, _) => Kernel::AttnGqa,
    };
    Some(match kernel {
        Kernel::AttnGqa128x8Tc => Gqa {
            kernel,
            min_span: s.att_min_span,
            stage: s.att_stage,
        },
        _ => Gqa {
            kernel,
            min_span: 1,
            stage: 0,
        },
    })
}

/// attn_gqa's blocks a KV head for attention lengths up to `reach`: at least as many as
/// gqa_span (attention.cu) makes active at any of those lengths (at most ceil(chunks /
/// min_span), at most att_blocks), rounded up to a power of two; 0 where the geometry takes
/// the generic attention. Why not att_blocks always (n_split or ATT_MAX_BLOCKS): the blocks past
/// the active ones only exit, but each first waits for an SM of its own (the kernels hold one an
/// SM), so at the default 4,096-position KV 116 of the 128 blocks of a short context cost the
/// step that wait. A graph holds the grid of its capture: the setup cache keys on this, and the
/// power of two bounds a session's captures to log2(att_blocks) + 1.
pub fn att_grid(c: &Config, s: &Scratch, reach: usize) -> usize {
    let g = gqa(c, s);
    match s.att_grid_by_reach {
        true => g.map_or(0, |g| att_rows(reach, (g.min_span, g.stage), s.att_blocks)),
        false => g.map_or(0, |_| s.att_blocks),
    }
}

/// attn_gqa's launch grid for attention lengths up to `reach`: a row of `att_grid` blocks a
/// KV head.
fn att_dims(c: &Config, s: &Scratch, reach: usize) -> (u32, u32, u32) {
    (c.n_kv_head as u32, att_grid(c, s, reach) as u32, 1)
}

/// The one-launch attention's kernel and its grid for lengths up to `reach`, where the
/// geometry has it: what a captured step changes in place when its reach grows (Graph::regrid)
/// rather than being captured again.
pub fn att_regrid(c: &Config, s: &Scratch, reach: usize) -> Option<(Kernel, (u32, u32, u32))> {
    gqa(c, s).map(|g| (g.kernel, att_dims(c, s, reach)))
}

/// `att_grid` for the span knobs (min_span, stage) and at most `max_blocks` blocks.
fn att_rows(reach: usize, (min_span, stage): (usize, usize), max_blocks: usize) -> usize {
    let chunks = reach.max(1).div_ceil(ATT_CHUNK);
    let fit = match stage {
        0 => 0,
        st => (1 + st) * 8 * 16 / ATT_CHUNK, // gqa_span's chunks one block loads early
    };
    let active = match chunks <= fit {
        true => 1,
        false => chunks.div_ceil(min_span.max(1)).min(max_blocks),
    };
    active.next_power_of_two().min(max_blocks).max(1)
}

/// attention.cu's per-head norm and RoPE of layer `lw`: projections at `qkv`, the roped
/// queries to `q_out`, keys and values appended to the layer's cache at the position in `state`.
pub(crate) fn rope_params(
    c: &Config,
    lw: &crate::weights::LayerW,
    (k_cache, v_cache): (u64, u64),
    (qkv, q_out): (u64, u64),
    state: u64,
) -> RopeParams {
    RopeParams {
        qkv,
        q_out,
        q_norm: lw.q_norm,
        k_norm: lw.k_norm,
        k_cache,
        v_cache,
        state,
        n_head: c.n_head as i32,
        n_kv_head: c.n_kv_head as i32,
        head_dim: c.head_dim as i32,
        eps: c.rms_eps,
        theta: c.rope_theta,
    }
}

/// attention.cu's attention over a layer's cache for the queries at `q`: partials of n_split
/// chunks at `part`, outputs at `out`, the position in `state`.
pub(crate) fn attn_params(
    c: &Config,
    (k_cache, v_cache): (u64, u64),
    (q, part, out, state): (u64, u64, u64, u64),
    n_split: usize,
) -> AttnParams {
    AttnParams {
        q,
        k_cache,
        v_cache,
        part,
        out,
        state,
        n_head: c.n_head as i32,
        n_kv_head: c.n_kv_head as i32,
        head_dim: c.head_dim as i32,
        n_split: n_split as i32,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
    }
}

/// The generic attention path's three launches over `tokens` tokens (blockIdx.z): norm and RoPE,
/// the chunks' partials, their merge; `kernels` the decode's or the batched prefill's forms.
pub(crate) fn split_attention(
    c: &Config,
    r: &RopeParams,
    a: &AttnParams,
    tokens: u32,
    [rope, split, combine]: [Kernel; 3],
) -> [Launch; 3] {
    let (heads, hd) = (c.n_head as u32, c.head_dim as u32);
    let all = heads + c.n_kv_head as u32;
    [
        Launch::new(rope, rope.symbol(), (all, 1, tokens), hd, 0, r, 0),
        Launch::new(
            split,
            split.symbol(),
            (heads, a.n_split as u32, tokens),
            128,
            0,
            a,
            0,
        ),
        Launch::new(combine, combine.symbol(), (heads, 1, tokens), hd, 0, a, 0),
    ]
}

/// The chosen experts' FFN over the residual at `x_mid`, added into `x_next` (`residual`):
/// moe_gate_up then moe_down.
fn experts(
    c: &Config,
    lw: &crate::weights::LayerW,
    s: &Scratch,
    fold: bool,
    (x_mid, x_next): (u64, u64),
    out: &mut Vec<Launch>,
) {
    let experts = Experts {
        ids: s.ids.ptr,
        weights: s.topw.ptr,
        n_used: c.n_expert_used as i32,
        scratch: 0,
    };
    // The staged modes normalise the residual themselves (moe.cu load_xg_quant): with the fold
    // no router writes xn.
    let (gmode, grpw) = gate_up_mode(lw, c.d_model);
    let g = GateUpParams {
        gate: lw.gate,
        up: lw.up,
        xn: if gmode == 0 { s.xn.ptr } else { x_mid },
        h: s.h.ptr,
        norm: lw.ffn_norm,
        eps: c.rms_eps,
        experts: Experts {
            scratch: (smem_x(c.d_model) / 4) as i32,
            ..experts
        },
        d_ff: c.d_ff_expert as i32,
        rows_per_warp: grpw as i32,
    };
    let (dmode, drpw) = down_mode(lw, c);
    // room for h staged per slot as padded floats (the staged modes keep quantised groups, which
    // take less), then the experts
    let h_floats = c.n_expert_used * (c.d_ff_expert / 32) * 36;
    let d = DownParams {
        down: lw.down,
        h: s.h.ptr,
        x: x_mid,
        out: x_next,
        slots: if fold { s.router_slots.ptr } else { 0 },
        n_expert: c.n_expert as i32,
        norm_topk: c.norm_topk_prob as i32,
        eps: c.rms_eps,
        experts: Experts {
            scratch: h_floats as i32,
            ..experts
        },
        d_model: c.d_model as i32,
        n_used: c.n_expert_used as i32,
        rows_per_warp: drpw as i32,
    };
    let used = c.n_expert_used as u64;
    let ffn_rows = c.n_expert * c.d_ff_expert;
    let down_grid = ((c.d_model as u32).div_ceil(WARPS * drpw as u32), 1, 1);
    let units = (c.d_ff_expert as u32).div_ceil(WARPS * grpw as u32);
    let cols = s.gate_up_cols[gmode as usize];
    let grid = (
        if cols == 0 { units } else { units.min(cols) },
        c.n_expert_used as u32,
        1,
    );
    out.push(
        Launch::new(
            Kernel::MoeGateUp(gmode),
            "moe_gate_up",
            grid,
            THREADS,
            gate_up_smem(c),
            &g,
            used * (lw.slab[0] + lw.slab[1]),
        )
        .with_l2(s.l2.stream(&[(lw.gate, ffn_rows), (lw.up, ffn_rows)])),
    );
    let smem = (h_floats * 4) as u32 + EXPERTS_SMEM + 32 * 4; // + fold_weights' sums
    out.push(
        Launch::new(
            Kernel::MoeDown(dmode),
            "moe_down",
            down_grid,
            THREADS,
            smem,
            &d,
            used * lw.slab[2],
        )
        .with_l2(s.l2.stream(&[(lw.down, c.n_expert * c.d_model)])),
    );
}

/// Shared memory of the experts' ids and weights (moe.cu Experts::scratch: 64 floats).
const EXPERTS_SMEM: u32 = 64 * 4;

/// The share (numerator, denominator) of the resident grid moe_gate_up's staged modes take by
/// default (GATE_UP's order). moe_gate_up_q4_k at 7/8: since its walkers prefetch their second
/// unit into L2 once their input is staged (moe.cu gate_up_staged), fewer columns (more
/// walkers) measured faster on the H200 (Q4_K_M, 66 resident columns): 56-58 columns +1.7-1.8%
/// over 66, 50 +0.4%, 62 +0.8%. The Q4_0 kernels lose at every share below the whole grid
/// (58 columns -1.1%, 50 -2.3%): not explained (NOTES.md session 47).
const GATE_UP_SHARE: [(u32, u32); GATE_UP.len()] = [(1, 1), (1, 1), (1, 1), (7, 8)];

/// Scratch::gate_up_cols: for each staged mode the option's, or by default its share
/// (GATE_UP_SHARE, rounded) of the blocks the device keeps resident at once divided among the
/// slots (at least 1); 0 for the generic mode.
fn gate_up_cols(dev: &Device, c: &Config, opt: Option<u32>) -> Result<[u32; GATE_UP.len()]> {
    let mut cols = [0; GATE_UP.len()];
    for (m, col) in cols.iter_mut().enumerate().skip(1) {
        *col = match opt {
            Some(n) => n,
            None => {
                let k = Kernel::MoeGateUp(m as u8);
                let resident = dev.resident_blocks(k, THREADS, gate_up_smem(c))?;
                let (num, den) = GATE_UP_SHARE[m];
                let whole = resident / c.n_expert_used.max(1) as u32;
                ((whole * num + den / 2) / den).max(1)
            }
        };
    }
    Ok(cols)
}

/// moe_gate_up's dynamic shared memory: the input (smem_x), the experts, the norm weights.
fn gate_up_smem(c: &Config) -> u32 {
    smem_x(c.d_model) + EXPERTS_SMEM + 4 * c.d_model as u32
}

/// o_proj (`x += W_o attn`) and the router as a launch of its own (without the fold): the
/// router with its top-k in one launch where it can (`router_cluster` / `router_topk`, which
/// also write the normalised input to xn for the generic experts' mode), else a matvec and
/// `moe_topk`.
fn o_proj_then_router(
    c: &Config,
    lw: &crate::weights::LayerW,
    s: &Scratch,
    x: u64,
    out: &mut Vec<Launch>,
) {
    let o = [(lw.o, x, c.d_model)];
    let o_proj = Mv {
        accumulate: true,
        ..Mv::new(&o, s.attn.ptr, c.q_dim())
    };
    out.push(matvec("o_proj", &o_proj));
    let with_topk = !legacy()
        && lw.router.ty == T_F32
        && c.d_model.is_multiple_of(128)
        && c.d_model <= 2048
        && c.n_expert <= 4096
        && c.n_expert_used <= 32;
    if with_topk {
        let r = RouterParams {
            w: lw.router.data,
            input: x,
            norm: lw.ffn_norm,
            xn_out: s.xn.ptr,
            logits: s.router.ptr,
            ids: s.ids.ptr,
            weights: s.topw.ptr,
            counter: s.counter.ptr,
            n_expert: c.n_expert as i32,
            k: c.d_model as i32,
            n_used: c.n_expert_used as i32,
            norm_topk: c.norm_topk_prob as i32,
            eps: c.rms_eps,
        };
        let (kernel, blocks, threads, smem_floats) =
            if s.router_cluster && c.n_expert <= RC_BLOCKS * RC_WARPS {
                // One cluster: the logits meet in block 0's shared memory (moe.cu).
                let (b, t) = (RC_BLOCKS as u32, 32 * RC_WARPS as u32);
                (Kernel::RouterCluster, b, t, 36 + c.d_model + 2 * c.n_expert)
            } else {
                // 4 rows a block: the 1 MB of router rows spread over 32 SMs instead of 16.
                let b = (c.n_expert as u32).div_ceil(ROUTER_THREADS / 32);
                (
                    Kernel::RouterTopk,
                    b,
                    ROUTER_THREADS,
                    36 + c.d_model + c.n_expert + 4,
                )
            };
        out.push(Launch::new(
            kernel,
            "router_topk",
            (blocks, 1, 1),
            threads,
            (smem_floats * 4) as u32,
            &r,
            weight_bytes(&lw.router, c.n_expert),
        ));
    } else {
        let rows = [(lw.router, s.router.ptr, c.n_expert)];
        let router = Mv {
            norm: lw.ffn_norm,
            eps: c.rms_eps,
            xn_out: s.xn.ptr,
            ..Mv::new(&rows, x, c.d_model)
        };
        out.push(matvec("router", &router));
        let bufs = (s.router.ptr, s.ids.ptr, s.topw.ptr);
        out.push(topk(c, Kernel::MoeTopk, bufs, 1));
    }
}

/// Softmax, top-k and renormalisation of the router logits (moe.cu topk_block), a block for
/// each of `tokens` tokens: the decode's moe_topk or the batched prefill's pf_route.
pub(crate) fn topk(
    c: &Config,
    kernel: Kernel,
    (logits, ids, weights): (u64, u64, u64),
    tokens: u32,
) -> Launch {
    let t = TopkParams {
        logits,
        ids,
        weights,
        n_expert: c.n_expert as i32,
        n_used: c.n_expert_used as i32,
        norm_topk: c.norm_topk_prob as i32,
    };
    Launch::new(kernel, kernel.symbol(), (tokens, 1, 1), 32, 0, &t, 0)
}

/// (mode, rows per warp) of `moe_gate_up`, a kernel each: gate and up of one type, staged
/// (Q4_0 k <= 1024: two rows a warp, mode 1; k <= 2048: one, at most 4 staged pieces a lane as
/// in `mv_mode`, mode 2; Q4_K mode 3).
fn gate_up_mode(lw: &crate::weights::LayerW, k: usize) -> (u8, usize) {
    if legacy() || lw.gate.ty != lw.up.ty {
        return (0, 1);
    }
    match lw.gate.ty {
        T_Q4_0 if k.is_multiple_of(32) && k <= 1024 => (1, 2),
        T_Q4_0 if k.is_multiple_of(32) && k <= 2048 => (2, 1),
        T_Q4_K if k.is_multiple_of(256) && k <= 2048 => (3, 1),
        _ => (0, 1),
    }
}

/// (mode, rows per warp) of `moe_down`, a kernel each: every (slot, block) piece of a row spread
/// over the lanes (2, 6 or 8 pieces a lane; modes 1-3 Q4_0, 4-6 Q4_K, 7-9 Q6_K).
fn down_mode(lw: &crate::weights::LayerW, c: &Config) -> (u8, usize) {
    let (dff, used) = (c.d_ff_expert, c.n_expert_used);
    if legacy() || used > 16 {
        return (0, 1);
    }
    match lw.down.ty {
        T_Q4_0 | T_Q4_K | T_Q6_K if dff % 32 == 0 => {
            let first = match lw.down.ty {
                T_Q4_0 => 1,
                T_Q4_K => 4,
                _ => 7,
            };
            match used * dff / 32 {
                0..=64 => (first, 1),
                65..=192 => (first + 1, 1),
                193..=256 => (first + 2, 1),
                _ => (0, 1),
            }
        }
        _ => (0, 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gqa_span's active blocks at attention length `len` (attention.cu, as the kernel
    /// computes them).
    fn active(len: usize, (min_span, stage): (usize, usize), max_blocks: usize) -> usize {
        let chunks = len.div_ceil(ATT_CHUNK);
        let fit = if stage > 0 {
            (1 + stage) * 8 * 16 / ATT_CHUNK
        } else {
            0
        };
        let span = match chunks <= fit {
            true => chunks,
            false => chunks.div_ceil(max_blocks).max(min_span),
        };
        chunks.div_ceil(span)
    }

    #[test]
    fn att_rows_hold_every_active_block_up_to_the_reach() {
        for knobs in [(4, 1), (1, 0), (4, 0), (2, 2), (8, 1)] {
            for max_blocks in [1, 3, 13, 32] {
                let mut most = 0;
                let mut rows_seen = Vec::new();
                for reach in 1..=20_000 {
                    most = most.max(active(reach, knobs, max_blocks));
                    let rows = att_rows(reach, knobs, max_blocks);
                    assert!(
                        rows >= most && rows <= max_blocks,
                        "{knobs:?}, {max_blocks} blocks at most, reach {reach}: {rows} rows, {most} active"
                    );
                    assert!(rows.is_power_of_two() || rows == max_blocks);
                    if rows_seen.last() != Some(&rows) {
                        rows_seen.push(rows);
                    }
                }
                // Only ever larger: a session's captures stay few.
                assert!(rows_seen.windows(2).all(|w| w[0] < w[1]), "{rows_seen:?}");
            }
        }
    }

    #[test]
    fn att_rows_stay_small_at_a_short_context() {
        // The benchmark's decode (positions 128..384) on the tensor-core defaults.
        assert_eq!(att_rows(256, (4, 1), 32), 1);
        assert_eq!(att_rows(384, (4, 1), 32), 4);
        assert_eq!(att_rows(4096, (4, 1), 32), 32);
    }
}
