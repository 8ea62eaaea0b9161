//! The step's buffers: the activations every session shares (`Scratch`, one stream runs one
//! step at a time) and a session's KV cache (`Kv`).

use q4moe_model::backend::KvType;
use q4moe_model::Config;

use super::modes::gate_up_cols;
use crate::device::Device;
use crate::kernel::{GateUpMode, Kernel};
use crate::l2::L2Plan;
use crate::memory::DevBuf;
use crate::params::*;
use crate::{CudaOptions, Result};

/// Blocks of the arg-max's first stage.
pub const ARGMAX_BLOCKS: usize = 128;

/// Activations shared by every session (one stream runs one step at a time).
pub struct Scratch {
    /// StepState
    pub state: DevBuf,
    /// The host-mapped StepState ring the step's token choice writes (pipeline.rs; the backend
    /// sets it before any step is built).
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
    /// u32 [ceil(vocab / 32)]: the tokens a constraint allows next, a bit each (mask_logits)
    pub mask: DevBuf,
    pub n_split: usize,
    /// attn_gqa's blocks a KV head (CudaOptions::attn_max_blocks, at most n_split).
    pub att_blocks: usize,
    /// The router as one thread block cluster (`router_cluster`, Device::clusters).
    pub router_cluster: bool,
    /// The output head's grid (`looped`): 2 blocks an SM, as the walking kernels' launch bounds
    /// hold (matvec.cu MV_LOOP_KERNEL).
    pub head_blocks: u32,
    /// Dynamic shared memory of attn_gqa's launches (Device::att_solo_smem, sized for the
    /// Qwen3-shape kernel; the generic one's static part is no larger, so its blocks are alone
    /// on an SM too).
    pub att_solo_smem: u32,
    /// Qwen3-shape attention on tensor cores (attn_gqa_128_8_tc): the f16 cache on sm_80+,
    /// where CudaOptions::attn_tensor_cores.
    pub att_tc: bool,
    /// Tiles past its first a warp of the tensor-core attention loads into shared memory
    /// before pdl_wait (AttnGqaParams::stage): CudaOptions::attn_stage or ATT_TC_STAGE_DEFAULT,
    /// at most what the kernel's dynamic shared memory holds and ATT_TC_STAGE_MAX. The scalar
    /// kernels take 0.
    pub att_stage: usize,
    /// moe_gate_up's grid along a slot's units, by mode (`GateUpMode as usize`;
    /// CudaOptions::gate_up_cols; 0: a block a unit, as the generic mode always takes).
    pub gate_up_cols: [u32; GateUpMode::ALL.len()],
    /// The weights' L2 policy: which launches get which access-policy window (l2.rs).
    pub l2: L2Plan,
    /// Owns the small buffers above (`Arena`); dropped last, after their views.
    _arena: Arena,
}

/// The step's small buffers (activations, counters, ids) in one allocation, each 256-byte
/// aligned in a fixed order, so where they lie against each other does not follow what else is
/// allocated (the attention partials' size followed the KV's capacity and moved every buffer
/// after it: ~0.8% of Q4_K_M's decode, docs/performance.md).
struct Arena {
    buf: DevBuf,
    used: usize,
}

/// Bytes left free between the buffers up to `q` and those from `attn` on. Why: every fast
/// layout measured had one (the partials between them, 216 KB at a 392-position KV, 682 KB at
/// 1,288: Q4_K_M 797-799 tok/s), every slow one none (the partials at 2.3 MB in an allocation
/// of their own, or allocated last: 790-794); the layout at a 392-position KV (docs/performance.md).
/// Why it matters is not known. 256 KB: the best of 14 gaps from 0 to 1 MB in one
/// binary (session 41: Q4_K_M 791.1-795.7 tok/s over the gaps, 216 KB 794.1, 256 KB 795.7).
const ARENA_GAP: usize = 256 << 10;

impl Arena {
    const BYTES: usize = 2 << 20;

    fn new(dev: &Device) -> Result<Arena> {
        Ok(Arena {
            buf: DevBuf::new(dev, Arena::BYTES)?,
            used: 0,
        })
    }

    /// `bytes` of the arena, zeroed; their own allocation past its end.
    fn take(&mut self, dev: &Device, bytes: usize) -> Result<DevBuf> {
        let at = self.used.next_multiple_of(256);
        let b = match at + bytes <= Arena::BYTES {
            true => {
                self.used = at + bytes;
                self.buf.view(at, bytes)
            }
            false => DevBuf::new(dev, bytes)?,
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
        let mut a = |bytes: usize| arena.take(dev, bytes);
        let n_split = kv_capacity.div_ceil(ATT_CHUNK);
        let counter = a(4)?;
        let (router_slots, router_epoch) = (a(8 * c.n_expert)?, a(4)?);
        let attn_done = a(4 * (c.n_kv_head + c.n_head))?;
        let att_tc = opts.attn_tensor_cores && dev.kv_type == KvType::F16 && dev.sm_major >= 8;
        let stage_room = dev.dynamic_smem_room(Kernel::AttnGqa128x8Tc) / ATT_TC_STAGE_BYTES;
        let stage_fit = ATT_TC_STAGE_MAX.min(stage_room as usize);
        let (sample_work, sample_finite, sample_nucleus) = sample_bytes(c.vocab_size);
        let head_blocks = 2 * dev.sm_count()?;
        let head_counter = a(4)?;
        let partials = ARGMAX_BLOCKS.max(head_blocks as usize);
        let (state, x, x2, xn) = (
            a(size_of::<StepState>())?,
            a(4 * c.d_model)?,
            a(4 * c.d_model)?,
            a(4 * c.d_model)?,
        );
        let (qkv, q) = (a(4 * (c.q_dim() + 2 * c.kv_dim()))?, a(4 * c.q_dim())?);
        arena.skip(ARENA_GAP);
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
            counter,
            attn_done,
            sample_cfg,
            rng,
            sample_work: DevBuf::new(dev, sample_work)?,
            sample_finite: DevBuf::new(dev, sample_finite)?,
            sample_nucleus: DevBuf::new(dev, sample_nucleus)?,
            sample_counts: f(c.vocab_size)?,
            mask: f(c.vocab_size.div_ceil(32))?,
            n_split,
            att_blocks: n_split.min(attn_max_blocks.max(1)),
            router_cluster: dev.clusters,
            head_blocks,
            att_solo_smem: dev.att_solo_smem(Kernel::AttnGqa128x8)?,
            att_tc,
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
                + c.vocab_size.div_ceil(32)
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

    /// Bytes this KV holds (its K and V allocations).
    pub fn held_bytes(&self) -> usize {
        self.k.bytes + self.v.bytes
    }

    /// Positions a session's KV is allocated for when it must hold `need`: `from` doubled
    /// until it does, at most `max` (CudaOptions::kv_grow_from, kv_capacity).
    pub fn capacity_for(need: usize, from: usize, max: usize) -> usize {
        let mut cap = from.max(1);
        while cap < need {
            cap *= 2;
        }
        cap.min(max)
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

    /// Copies `from`'s first `len` positions into this cache, layer by layer (a layer's
    /// positions are one range), in stream order.
    pub(crate) fn copy_from(&self, dev: &Device, c: &Config, from: &Kv, len: usize) -> Result<()> {
        let bytes = len * c.kv_dim() * self.elem_bytes;
        assert!(len <= self.capacity.min(from.capacity) && self.elem_bytes == from.elem_bytes);
        if bytes == 0 {
            return Ok(());
        }
        for l in 0..c.n_layer {
            let ((sk, sv), (dk, dv)) = (from.layer(c, l), self.layer(c, l));
            dev.copy_async(dk, sk, bytes)?;
            dev.copy_async(dv, sv, bytes)?;
        }
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::Kv;

    /// A KV starts at `from` positions and doubles until it holds what is needed, never past
    /// the capacity.
    #[test]
    fn kv_capacity_doubles_from_its_start_up_to_the_cap() {
        let cases = [
            (0, 256, 4096, 256),
            (256, 256, 4096, 256),
            (257, 256, 4096, 512),
            (3000, 256, 4096, 4096),
            (4096, 256, 4096, 4096),
            (5, 4, 256, 8),
            (100, 4, 100, 100),
            (1, 0, 8, 1),
            (40, 4096, 512, 512),
        ];
        for (need, from, max, want) in cases {
            assert_eq!(
                Kv::capacity_for(need, from, max),
                want,
                "{need} from {from} up to {max}"
            );
        }
    }
}
