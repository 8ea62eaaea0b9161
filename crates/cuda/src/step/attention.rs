//! attention.cu's launches: the one-launch grouped-query attention (norm, RoPE, KV append,
//! split-K chunks and their merge; Qwen3's shape with its own kernels, on tensor cores over an
//! f16 cache) and the generic three-launch path for the shapes it does not take.

use q4moe_model::Config;

use super::scratch::{Kv, Scratch};
use crate::kernel::Kernel;
use crate::launch::Launch;
use crate::params::*;
use crate::weights::LayerW;

/// Layer `l`'s attention over the projections in `s.qkv`: the one-launch attention where the
/// geometry has it (its grid for attention lengths up to `reach`), else the generic three
/// launches.
pub(crate) fn attention(
    c: &Config,
    lw: &LayerW,
    s: &Scratch,
    kv: &Kv,
    (l, reach): (usize, usize),
    out: &mut Vec<Launch>,
) {
    let (kc, vc) = kv.layer(c, l);
    let bufs = (s.q.ptr, s.part.ptr, s.attn.ptr, s.state.ptr);
    let a = attn_params(c, (kc, vc), bufs, s.n_split);
    if let Some(g) = gqa(c, s) {
        let (kernel, min_span, stage) = (g.kernel, g.min_span, g.stage);
        let bufs = [
            s.qkv.ptr,
            s.part.ptr,
            s.state.ptr,
            s.attn.ptr,
            s.attn_done.ptr,
        ];
        let knobs = (s.att_blocks, min_span, stage);
        let g = gqa_params(c, lw, (kc, vc), bufs, s.n_split, knobs);
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
}

/// attn_gqa's params for layer `lw` over the cache (k, v): `bufs` the projections, partials,
/// step state, output and merge counters; partials laid out for `n_split` chunks a head; the
/// span knobs (max_blocks, min_span, stage). The batched step's attention takes row 0's.
pub(crate) fn gqa_params(
    c: &Config,
    lw: &LayerW,
    (k_cache, v_cache): (u64, u64),
    [qkv, part, state, out, done]: [u64; 5],
    n_split: usize,
    (max_blocks, min_span, stage): (usize, usize, usize),
) -> AttnGqaParams {
    AttnGqaParams {
        qkv,
        q_norm: lw.q_norm,
        k_norm: lw.k_norm,
        k_cache,
        v_cache,
        part,
        state,
        out,
        done,
        n_head: c.n_head as i32,
        n_kv_head: c.n_kv_head as i32,
        head_dim: c.head_dim as i32,
        n_split: n_split as i32,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
        eps: c.rms_eps,
        theta: c.rope_theta,
        max_blocks: max_blocks as i32,
        min_span: min_span as i32,
        stage: stage as i32,
    }
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
    let fits = c.n_head.is_multiple_of(c.n_kv_head)
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
            min_span: ATT_TC_MIN_SPAN_DEFAULT,
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
    gqa(c, s).map_or(0, |g| att_rows(reach, (g.min_span, g.stage), s.att_blocks))
}

/// attn_gqa's launch grid for attention lengths up to `reach`: a row of `att_grid` blocks a
/// KV head.
fn att_dims(c: &Config, s: &Scratch, reach: usize) -> (u32, u32, u32) {
    (c.n_kv_head as u32, att_grid(c, s, reach) as u32, 1)
}

/// `att_grid` for the span knobs (min_span, stage) and at most `max_blocks` blocks.
pub(crate) fn att_rows(
    reach: usize,
    (min_span, stage): (usize, usize),
    max_blocks: usize,
) -> usize {
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
