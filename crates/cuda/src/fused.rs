//! The fused step (kernels/fused.cu): embedding and every layer as one persistent kernel, one
//! block per SM, each block's weight slices staged in shared memory ahead of use. The setup
//! cache builds it once per session key; the captured graph holds it plus the head and the
//! token choice.

use q4moe_gguf::GgmlType;
use q4moe_model::Config;

use crate::device::{DevBuf, Device, Kernel, Launch};
use crate::params::*;
use crate::repack::aux_bytes;
use crate::step::{Kv, Scratch};
use crate::weights::Weights;
use crate::Result;

const THREADS: u32 = 256;

pub struct FusedStep {
    launch: Launch,
    n_layer: usize,
    /// [n_layer * phases * marks + 1] %globaltimer at each phase's marks (block 0), then the
    /// step's end; written when the profile is on.
    stamps: Option<DevBuf>,
    _layers: DevBuf,
    _bar: DevBuf,
}

/// Q4MOE_CUDA_STAMPS=1: the fused step stamps each phase's start, read back after every step.
pub fn stamps_enabled() -> bool {
    std::env::var_os("Q4MOE_CUDA_STAMPS").is_some()
}

/// Bytes `stage_rows` uses for `n` rows from `row0` (None: any row, worst-case alignment).
fn staged_bytes(w: &Qw, row0: Option<usize>, n: usize) -> usize {
    let r16 = |b: usize| b.next_multiple_of(16);
    let delta = |addr: u64, off: usize| row0.map_or(15, |_| (addr as usize + off) & 15);
    if n == 0 {
        return 0;
    }
    let r = row0.unwrap_or(0);
    let ty = GgmlType::from_id(w.ty as u32).expect("valid type");
    let nb = w.k as usize / 32;
    if let (Some(before), Some(aux)) = (aux_bytes(ty, r * nb), aux_bytes(ty, n * nb)) {
        return r16(delta(w.data, r * nb * 16) + n * nb * 16) + r16(delta(w.scales, before) + aux);
    }
    let rb = ty.row_bytes(w.k as usize).unwrap_or(0);
    r16(delta(w.data, r * rb) + n * rb)
}

/// `part_range` in fused.cu: block b's share of `total` items over `g` blocks.
fn part_range(total: usize, b: usize, g: usize) -> (usize, usize) {
    (total * b / g, total * (b + 1) / g)
}

/// Shared memory of one block: (activations, region X, region Y) in bytes, or why the fused
/// step cannot run this model.
fn smem_plan(
    c: &Config,
    w: &Weights,
    g: usize,
) -> std::result::Result<(usize, usize, usize), String> {
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    let padded = |n: usize| (n / 32) * 36 + 36;
    let act = padded(c.d_model)
        .max(padded(q_dim))
        .max(c.n_expert_used * (c.d_ff_expert / 32) * 36)
        * 4;
    let (mut x, mut y) = (0usize, GQA_SMEM_BYTES as usize);
    for lw in &w.layers {
        for b in 0..g {
            let (lo, hi) = part_range(q_dim + 2 * kv_dim, b, g);
            let mut attn = 0;
            for (m, start, len) in [
                (&lw.q, 0, q_dim),
                (&lw.k, q_dim, kv_dim),
                (&lw.v, q_dim + kv_dim, kv_dim),
            ] {
                let (a, e) = (lo.max(start), hi.min(start + len));
                if e > a {
                    attn += staged_bytes(m, Some(a - start), e - a);
                }
            }
            let (lo, hi) = part_range(c.d_model, b, g);
            attn += staged_bytes(&lw.o, Some(lo), hi - lo);
            let (lo, hi) = part_range(c.n_expert, b, g);
            attn += staged_bytes(&lw.router, Some(lo), hi - lo);
            let (lo, hi) = part_range(c.n_expert_used * c.d_ff_expert, b, g);
            let (mut experts, mut a, mut runs) = (0, lo, 0);
            while a < hi {
                let e = hi.min((a / c.d_ff_expert + 1) * c.d_ff_expert);
                experts += staged_bytes(&lw.gate, None, e - a) + staged_bytes(&lw.up, None, e - a);
                runs += 1;
                a = e;
            }
            if runs > FUSED_MAX_RUNS {
                return Err(format!("a block's expert rows span {runs} experts"));
            }
            x = x.max(attn).max(experts);
            let (lo, hi) = part_range(c.d_model, b, g);
            y = y.max(c.n_expert_used * staged_bytes(&lw.down, None, hi - lo));
        }
    }
    Ok((act.next_multiple_of(16), x.next_multiple_of(16), y))
}

/// Why the fused step's kernels cannot serve this geometry, if they cannot.
fn unsupported(c: &Config) -> Option<String> {
    let group = c.n_head / c.n_kv_head.max(1);
    if c.n_kv_head == 0 || !c.n_head.is_multiple_of(c.n_kv_head) || group > 8 {
        return Some(format!(
            "{} query heads over {} KV heads",
            c.n_head, c.n_kv_head
        ));
    }
    if !c.head_dim.is_multiple_of(64) || c.head_dim > 128 {
        return Some(format!("head_dim {}", c.head_dim));
    }
    if !c.d_ff_expert.is_multiple_of(32) || !c.d_model.is_multiple_of(4) {
        return Some(format!("d_ff {} / d_model {}", c.d_ff_expert, c.d_model));
    }
    if c.n_expert > FUSED_MAX_EXPERT || c.n_expert_used > FUSED_MAX_USED || c.n_expert_used == 0 {
        return Some(format!("{} of {} experts", c.n_expert_used, c.n_expert));
    }
    None
}

impl FusedStep {
    /// The fused form of the step's embedding and layers for one session's KV, or None (with
    /// the reason in the log) when this model's shapes do not fit it.
    pub fn new(
        dev: &Device,
        c: &Config,
        w: &Weights,
        s: &Scratch,
        kv: &Kv,
        bytes_read: u64,
    ) -> Result<Option<FusedStep>> {
        let g = dev.sm_count()? as usize;
        if dev.sm_major < 9 {
            tracing::info!("fused step off: it needs sm_90 (TMA bulk copies)");
            return Ok(None);
        }
        let plan = match unsupported(c).map_or_else(|| smem_plan(c, w, g), Err) {
            Ok(p) => p,
            Err(why) => {
                tracing::info!("fused step off for this model: {why}");
                return Ok(None);
            }
        };
        let (act, x, y) = plan;
        let smem = act + x + y;
        let static_smem = dev.static_smem(Kernel::StepFused)?;
        if smem + static_smem > dev.max_smem_optin()? {
            tracing::info!("fused step off for this model: {smem} bytes of shared memory a block");
            return Ok(None);
        }
        dev.set_max_dynamic_smem(Kernel::StepFused, smem as u32)?;
        if (dev.resident_blocks(Kernel::StepFused, THREADS, smem as u32)? as usize) < g {
            tracing::info!("fused step off for this model: its blocks do not fit one per SM");
            return Ok(None);
        }
        let descs: Vec<LayerDesc> = w
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| {
                let (k_cache, v_cache) = kv.layer(c, l);
                LayerDesc {
                    q: lw.q,
                    k: lw.k,
                    v: lw.v,
                    o: lw.o,
                    router: lw.router,
                    gate: lw.gate,
                    up: lw.up,
                    down: lw.down,
                    attn_norm: lw.attn_norm,
                    q_norm: lw.q_norm,
                    k_norm: lw.k_norm,
                    ffn_norm: lw.ffn_norm,
                    k_cache,
                    v_cache,
                }
            })
            .collect();
        let layers = DevBuf::new(dev, std::mem::size_of_val(descs.as_slice()))?;
        layers.upload(dev, 0, &descs)?;
        let bar = DevBuf::new(dev, 16)?;
        bar.fill(dev, 0)?;
        let n_stamps = c.n_layer * FUSED_PHASES.len() * FUSED_INTERVALS.len() + 1;
        let stamps = match stamps_enabled() {
            true => Some(DevBuf::new(dev, 8 * n_stamps)?),
            false => None,
        };
        let p = FusedParams {
            layers: layers.ptr,
            embd: w.embd,
            state: s.state.ptr,
            x: s.x.ptr,
            qkv: s.qkv.ptr,
            part: s.part.ptr,
            attn: s.attn.ptr,
            logits: s.router.ptr,
            h: s.h.ptr,
            bar: bar.ptr,
            stamps: stamps.as_ref().map_or(0, |s| s.ptr),
            n_layer: c.n_layer as i32,
            d_model: c.d_model as i32,
            n_head: c.n_head as i32,
            n_kv_head: c.n_kv_head as i32,
            head_dim: c.head_dim as i32,
            n_split: s.n_split as i32,
            n_expert: c.n_expert as i32,
            n_used: c.n_expert_used as i32,
            d_ff: c.d_ff_expert as i32,
            norm_topk: c.norm_topk_prob as i32,
            eps: c.rms_eps,
            theta: c.rope_theta,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            a_off: 0,
            x_off: act as u32,
            y_off: (act + x) as u32,
        };
        Ok(Some(FusedStep {
            launch: Launch::new(
                Kernel::StepFused,
                "step_fused",
                (g as u32, 1, 1),
                THREADS,
                smem as u32,
                &p,
                bytes_read,
            ),
            n_layer: c.n_layer,
            stamps,
            _layers: layers,
            _bar: bar,
        }))
    }

    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// (name, seconds) of every interval of every layer's phases in the last step, named
    /// "<phase> <interval>". Empty when stamps are off. Synchronises the stream.
    pub fn phase_times(&self, dev: &Device) -> Result<Vec<(String, f64)>> {
        let Some(st) = &self.stamps else {
            return Ok(Vec::new());
        };
        let marks = self.n_layer * FUSED_PHASES.len() * FUSED_INTERVALS.len();
        let mut ns = vec![0u64; marks + 1];
        st.download(dev, 0, &mut ns)?;
        Ok(ns
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let ph = FUSED_PHASES[(i / FUSED_INTERVALS.len()) % FUSED_PHASES.len()];
                let iv = FUSED_INTERVALS[i % FUSED_INTERVALS.len()];
                (
                    format!("{ph} {iv}"),
                    w[1].saturating_sub(w[0]) as f64 * 1e-9,
                )
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_range_tiles_every_item_once() {
        for (total, g) in [(5120, 132), (128, 132), (2048, 132), (6144, 132), (7, 3)] {
            let mut next = 0;
            for b in 0..g {
                let (lo, hi) = part_range(total, b, g);
                assert_eq!(lo, next, "block {b} of {g} over {total}");
                assert!(hi >= lo);
                next = hi;
            }
            assert_eq!(next, total);
        }
    }

    #[test]
    fn staged_bytes_round_out_to_16_bytes() {
        // Q8_0 rows of 160 weights are 170 bytes: row 1 starts 10 bytes into a 16-byte line.
        let q8 = Qw {
            data: 0x1000,
            scales: 0,
            ty: 8,
            k: 160,
        };
        assert_eq!(
            staged_bytes(&q8, Some(1), 1),
            (10 + 170usize).next_multiple_of(16)
        );
        assert_eq!(
            staged_bytes(&q8, None, 1),
            (15 + 170usize).next_multiple_of(16)
        );
        assert_eq!(staged_bytes(&q8, Some(1), 0), 0);
        // Split types (24 blocks a row): nibbles (384 bytes a row) and aux staged apart.
        let q4 = Qw {
            data: 0x1000,
            scales: 0x9000,
            ty: 2,
            k: 768,
        };
        assert_eq!(staged_bytes(&q4, Some(3), 2), 2 * 384 + 2 * 48);
        let q6 = Qw { ty: 14, ..q4 };
        assert_eq!(staged_bytes(&q6, Some(3), 2), 2 * 384 + 2 * 288);
        // Q4_K: 60 bytes of aux a row; row 3's start 180 bytes in, 4 into a line.
        let q4k = Qw { ty: 12, ..q4 };
        assert_eq!(
            staged_bytes(&q4k, Some(3), 2),
            2 * 384 + (4 + 2 * 60usize).next_multiple_of(16)
        );
        // 5 blocks a row: row 1's 10 bytes of scales start 10 bytes into a line.
        let q4 = Qw { k: 160, ..q4 };
        assert_eq!(
            staged_bytes(&q4, Some(1), 1),
            80 + (10 + 10usize).next_multiple_of(16)
        );
    }
}
