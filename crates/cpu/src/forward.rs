//! One token through every layer (DESIGN.md section 2). Matrices stay quantised: every output
//! element is one `vec_dot` over a quantised row; rows are split across the threads of `par`.

use q4moe_gguf::quant::{
    activation_type, q4_0x_act_bytes, q4_0x_applies, quantize_activation_q4_0x,
    quantize_activation_q8, vec_dot, vec_dot_q4_0x, vec_dot_q4_0x_rows, vec_dot_q8,
};
use q4moe_gguf::GgmlType;
use q4moe_model::{Config, LayerTensors, Model, QTensor};

use crate::attend::{attend_heads, heads_a_task};
use crate::kv::{KvCache, KvView};
use crate::ops::{rmsnorm, rmsnorm_heads, rope_neox, silu, softmax, top_k, Rope};
use crate::par;

/// How activations meet quantised weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 activations against blocks dequantised in registers: the reference, within 1e-3
    /// of transformers (tests/oracle.rs).
    Exact,
    /// Activations quantised to Q8_0 / Q8_K per matrix-vector product and integer dot products,
    /// as llama.cpp does: several times faster, with a few 1e-3 of relative logit error.
    Q8,
}

/// An activation vector ready for dot products with rows of one weight type.
#[derive(Clone, Copy)]
pub(crate) enum Act<'a> {
    F32(&'a [f32]),
    /// Quantised blocks; `stride` bytes per vector when several are packed (experts' hidden).
    Q8(&'a [u8], usize),
    /// Q8_0 re-laid out for Q4_0 rows (`quant::q4_0x`); `stride` as for `Q8`.
    Q4x(&'a [u8], usize),
}

impl<'a> Act<'a> {
    /// The `i`-th of several packed vectors of `n` elements each.
    pub(crate) fn part(self, i: usize, n: usize) -> Act<'a> {
        match self {
            Act::F32(x) => Act::F32(&x[i * n..(i + 1) * n]),
            Act::Q8(q, stride) => Act::Q8(&q[i * stride..(i + 1) * stride], stride),
            Act::Q4x(q, stride) => Act::Q4x(&q[i * stride..(i + 1) * stride], stride),
        }
    }

    fn dot(&self, ty: GgmlType, row: &[u8]) -> f32 {
        match *self {
            Act::F32(x) => vec_dot(ty, row, x),
            Act::Q8(q, _) => vec_dot_q8(ty, row, q),
            Act::Q4x(q, _) => {
                debug_assert_eq!(ty, GgmlType::Q4_0);
                vec_dot_q4_0x(row, q)
            }
        }
    }
}

/// Types with an integer dot product against Q8 activations.
pub(crate) fn is_quantised(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q6_K
    )
}

/// Prepares `x` (one or more packed vectors of `n` elements) for weights of type `ty`,
/// quantising into `buf` when the precision asks for it and the weights are quantised.
pub(crate) fn prepare<'a>(
    p: Precision,
    ty: GgmlType,
    x: &'a [f32],
    n: usize,
    buf: &'a mut Vec<u8>,
) -> Act<'a> {
    if p == Precision::Exact || !is_quantised(ty) {
        return Act::F32(x);
    }
    buf.clear();
    if q4_0x_applies(ty, n) {
        // From a 64-byte boundary (vectors are multiples of 64 bytes): the AVX-512 kernel
        // reads them 64 bytes at a time, and loads split across cache lines cost it ~15%.
        let stride = q4_0x_act_bytes(n);
        buf.reserve(x.len() / n * stride + 63);
        let pad = (64 - buf.as_ptr() as usize % 64) % 64;
        buf.resize(pad, 0);
        for v in x.chunks(n) {
            quantize_activation_q4_0x(v, buf);
        }
        return Act::Q4x(&buf[pad..], stride);
    }
    for v in x.chunks(n) {
        quantize_activation_q8(ty, v, buf);
    }
    let stride = activation_type(ty)
        .row_bytes(n)
        .expect("rows are whole blocks");
    Act::Q8(buf, stride)
}

/// The smallest piece of a matrix a thread claims (`par::guided_mut`): the last claims of a
/// region are this small, so the threads finish within a few microseconds of each other.
pub(crate) const MIN_ROWS: usize = 16;

/// Rows per step of the experts' loops (their stack buffers' length).
pub(crate) const RUN_ROWS: usize = 64;

/// Norm vectors, dequantised once at load (a few KB per layer).
pub struct HostWeights {
    pub(crate) layers: Vec<LayerNorms>,
    output_norm: Vec<f32>,
}

pub(crate) struct LayerNorms {
    pub(crate) attn_norm: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    pub(crate) ffn_norm: Vec<f32>,
}

impl HostWeights {
    pub(crate) fn output_norm(&self) -> &[f32] {
        &self.output_norm
    }

    pub fn new(m: &Model) -> Self {
        let layers = m
            .layers
            .iter()
            .map(|l| LayerNorms {
                attn_norm: m.vector_f32(&l.attn_norm),
                q_norm: m.vector_f32(&l.attn_q_norm),
                k_norm: m.vector_f32(&l.attn_k_norm),
                ffn_norm: m.vector_f32(&l.ffn_norm),
            })
            .collect();
        HostWeights {
            layers,
            output_norm: m.vector_f32(&m.output_norm),
        }
    }
}

/// Activations of one token, allocated once per backend.
pub struct Scratch {
    /// [d_model] residual stream
    pub(crate) x: Vec<f32>,
    /// [d_model] normed input of the current sub-block
    n: Vec<f32>,
    /// [q_dim], [kv_dim], [kv_dim]
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    /// [q_dim + 2 kv_dim] fused Q/K/V output
    qkv: Vec<f32>,
    /// [n_head x positions] attention scores
    scores: Vec<f32>,
    /// [q_dim] attention output
    pub(crate) attn: Vec<f32>,
    /// [d_model]
    proj: Vec<f32>,
    /// [n_expert] router probabilities
    pub(crate) router: Vec<f32>,
    /// [n_expert_used, d_ff_expert] silu(gate) * up
    hidden: Vec<f32>,
    /// [vocab]
    pub(crate) logits: Vec<f32>,
    pub(crate) rope: Rope,
    /// The current token's RoPE angles (`Rope::angles`)
    angles: Vec<(f32, f32)>,
    /// Quantised activations (Q8 precision), reused across products.
    pub(crate) xq: Vec<u8>,
    pub(crate) precision: Precision,
}

impl Scratch {
    pub fn new(c: &Config, precision: Precision) -> Self {
        Scratch {
            xq: Vec::new(),
            precision,
            x: vec![0.0; c.d_model],
            n: vec![0.0; c.d_model],
            q: vec![0.0; c.q_dim()],
            k: vec![0.0; c.kv_dim()],
            v: vec![0.0; c.kv_dim()],
            qkv: vec![0.0; c.q_dim() + 2 * c.kv_dim()],
            scores: Vec::new(),
            attn: vec![0.0; c.q_dim()],
            proj: vec![0.0; c.d_model],
            router: vec![0.0; c.n_expert],
            hidden: vec![0.0; c.n_expert_used * c.d_ff_expert],
            logits: vec![0.0; c.vocab_size],
            rope: Rope::new(c.head_dim, c.rope_theta),
            angles: Vec::new(),
        }
    }
}

/// `out[i] = row_{r0+i}(w) . x` for consecutive rows of a matrix given as raw bytes.
pub(crate) fn rows_dot(
    ty: GgmlType,
    data: &[u8],
    row_bytes: usize,
    r0: usize,
    x: Act<'_>,
    out: &mut [f32],
) {
    match x {
        Act::Q4x(q, _) => vec_dot_q4_0x_rows(
            &data[r0 * row_bytes..(r0 + out.len()) * row_bytes],
            row_bytes,
            q,
            out,
        ),
        _ => {
            for (i, o) in out.iter_mut().enumerate() {
                let r = r0 + i;
                *o = x.dot(ty, &data[r * row_bytes..(r + 1) * row_bytes]);
            }
        }
    }
}

/// Prefetches the first 4 KB of `bytes` (the start of the next run of rows a task reads: the
/// hardware prefetchers only ramp up after demand misses in each new page).
#[inline]
fn prefetch_head(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for off in (0..bytes.len().min(4096)).step_by(64) {
            // SAFETY: prefetch of an address inside `bytes` (a hint; never faults).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(off).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// `out[r] = row_r(w) . x` for the rows of a quantised matrix given as raw bytes.
fn matvec(ty: GgmlType, data: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
    par::guided_mut(out, MIN_ROWS, |r0, chunk| {
        rows_dot(ty, data, row_bytes, r0, x, chunk);
    });
}

/// Several matrices of one type against the same `x` in one parallel region: `out` is their
/// outputs concatenated (`parts[i]` gives matrix i's bytes and rows).
fn matvec_concat(
    ty: GgmlType,
    parts: &[(&[u8], usize)],
    row_bytes: usize,
    x: Act<'_>,
    out: &mut [f32],
) {
    par::guided_mut(out, MIN_ROWS, |r0, chunk| {
        let (mut r, mut done) = (r0, 0);
        let mut base = 0;
        for &(data, rows) in parts {
            if done == chunk.len() {
                break;
            }
            if r < base + rows {
                let n = (base + rows - r).min(chunk.len() - done);
                rows_dot(ty, data, row_bytes, r - base, x, &mut chunk[done..done + n]);
                done += n;
                r += n;
            }
            base += rows;
        }
    });
}

/// `out = t x`, preparing `x` for `t`'s type.
fn matvec_t(m: &Model, t: &QTensor, x: &[f32], xq: &mut Vec<u8>, p: Precision, out: &mut [f32]) {
    let act = prepare(p, t.ty, x, x.len(), xq);
    matvec(t.ty, m.data(t), t.row_bytes(), act, out);
}

/// The embedding of `token` and every layer at the cache's next position (its keys and values
/// appended), the residual left in `s.x`. That is all the tokens before a prompt's last need:
/// the output head reads 151,936 rows for Qwen3, ~10% of a Qwen3-30B-A3B token's bytes.
pub fn token_layers(m: &Model, w: &HostWeights, kv: &mut KvCache, token: u32, s: &mut Scratch) {
    let pos = kv.len();
    q4moe_gguf::quant::dequantize_row(
        m.token_embd.ty,
        m.row(&m.token_embd, token as usize),
        &mut s.x,
    )
    .expect("embedding type validated at load");
    s.angles.clear();
    s.rope.angles(pos, &mut s.angles);
    for (li, l) in m.layers.iter().enumerate() {
        attention_block(m, l, &w.layers[li], kv, li, pos, s);
        moe_block(m, l, &w.layers[li], s);
    }
}

pub use q4moe_model::backend::check_finite;

/// The logits of the residual `token_layers` left in `s.x`.
pub fn head<'s>(m: &Model, w: &HostWeights, s: &'s mut Scratch) -> &'s [f32] {
    rmsnorm(&s.x, &w.output_norm, m.config.rms_eps, &mut s.n);
    matvec_t(m, &m.output, &s.n, &mut s.xq, s.precision, &mut s.logits);
    &s.logits
}

fn attention_block(
    m: &Model,
    l: &LayerTensors,
    w: &LayerNorms,
    kv: &mut KvCache,
    li: usize,
    pos: usize,
    s: &mut Scratch,
) {
    let c = &m.config;
    rmsnorm(&s.x, &w.attn_norm, c.rms_eps, &mut s.n);
    let p = s.precision;
    let (tq, tk, tv) = (&l.attn_q, &l.attn_k, &l.attn_v);
    if tq.ty == tk.ty
        && tq.ty == tv.ty
        && tq.row_bytes() == tk.row_bytes()
        && tq.row_bytes() == tv.row_bytes()
    {
        // One parallel region for Q, K and V (one activation preparation, one join).
        let act = prepare(p, tq.ty, &s.n, c.d_model, &mut s.xq);
        let (nq, nk) = (s.q.len(), s.k.len());
        let parts = [(m.data(tq), nq), (m.data(tk), nk), (m.data(tv), s.v.len())];
        matvec_concat(tq.ty, &parts, tq.row_bytes(), act, &mut s.qkv);
        s.q.copy_from_slice(&s.qkv[..nq]);
        s.k.copy_from_slice(&s.qkv[nq..nq + nk]);
        s.v.copy_from_slice(&s.qkv[nq + nk..]);
    } else {
        matvec_t(m, tq, &s.n, &mut s.xq, p, &mut s.q);
        matvec_t(m, tk, &s.n, &mut s.xq, p, &mut s.k);
        matvec_t(m, tv, &s.n, &mut s.xq, p, &mut s.v);
    }
    attend_token(c, w, kv, li, pos, s);
    matvec_t(m, &l.attn_output, &s.attn, &mut s.xq, p, &mut s.proj);
    s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
}

/// The token at `pos` whose projections are in `s.q`, `s.k`, `s.v`: their per-head norms and
/// RoPE, its keys and values appended to the cache, its attention output in `s.attn`.
pub(crate) fn attend_token(
    c: &Config,
    w: &LayerNorms,
    kv: &mut KvCache,
    li: usize,
    pos: usize,
    s: &mut Scratch,
) {
    let angles = std::mem::take(&mut s.angles);
    push_token(c, w, kv, li, &angles, s);
    s.angles = angles;
    attend(c, &s.q, &kv.view(li, pos + 1), &mut s.scores, &mut s.attn);
}

/// The head norms and RoPE (its position's `angles`) of the token's `s.q` and `s.k` (in
/// place), and its keys and values appended to layer `li` of `kv`: what attention needs
/// before it runs.
pub(crate) fn push_token(
    c: &Config,
    w: &LayerNorms,
    kv: &mut KvCache,
    li: usize,
    angles: &[(f32, f32)],
    s: &mut Scratch,
) {
    norm_and_rotate(c, w, &mut s.q, &mut s.k, angles);
    kv.push(li, &s.k, &s.v);
}

/// A token's queries `q` and keys `k` (in place): the per-head norms, then RoPE at its
/// position's `angles`.
pub(crate) fn norm_and_rotate(
    c: &Config,
    w: &LayerNorms,
    q: &mut [f32],
    k: &mut [f32],
    angles: &[(f32, f32)],
) {
    rmsnorm_heads(q, &w.q_norm, c.rms_eps);
    rmsnorm_heads(k, &w.k_norm, c.rms_eps);
    rope_neox(q, angles);
    rope_neox(k, angles);
}

/// Grouped-query attention of one query position over every cached position, a few heads of
/// a group a task (`heads_a_task`). `scores` is scratch (resized to heads x positions, so no
/// allocation per head or token).
fn attend(c: &Config, q: &[f32], cached: &KvView<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    let (len, hd) = (cached.len(), c.head_dim);
    let each = heads_a_task(c, 1, par::threads());
    scores.resize((out.len() / hd) * len, 0.0);
    par::chunks_mut2(out, each * hd, scores, each * len, |j, o, scores| {
        attend_heads(c, j * each, q, cached, len, scores, o)
    });
}

/// The router's logits as probabilities (in place), the chosen experts and their weights
/// (renormalised where the model asks).
pub(crate) fn choose(c: &Config, router: &mut [f32]) -> (Vec<usize>, Vec<f32>) {
    softmax(router);
    let chosen = top_k(router, c.n_expert_used);
    let mut weights: Vec<f32> = chosen.iter().map(|&e| router[e]).collect();
    if c.norm_topk_prob {
        let sum: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|p| *p /= sum);
    }
    (chosen, weights)
}

/// Whether the up rows take the gate rows' prepared activations `act`; otherwise (a file whose
/// gate and up differ in activation type) up takes the exact f32 path.
pub(crate) fn up_shares_act(gate: GgmlType, up: GgmlType, act: Act<'_>) -> bool {
    gate == up
        || (!matches!(act, Act::Q4x(..))
            && is_quantised(gate)
            && is_quantised(up)
            && activation_type(gate) == activation_type(up))
}

/// Router, top-k with renormalisation, then the selected experts' SwiGLU FFNs, weighted.
fn moe_block(m: &Model, l: &LayerTensors, w: &LayerNorms, s: &mut Scratch) {
    let c = &m.config;
    rmsnorm(&s.x, &w.ffn_norm, c.rms_eps, &mut s.n);
    let p = s.precision;
    matvec_t(m, &l.ffn_gate_inp, &s.n, &mut s.xq, p, &mut s.router);
    let (chosen, weights) = choose(c, &mut s.router);
    let (gate, up, down) = (&l.ffn_gate_exps, &l.ffn_up_exps, &l.ffn_down_exps);
    let ff = c.d_ff_expert;
    let x_f32 = &s.n;
    let n = prepare(p, gate.ty, &s.n, c.d_model, &mut s.xq);
    let same_act = up_shares_act(gate.ty, up.ty, n);
    let (grb, urb) = (gate.row_bytes(), up.row_bytes());
    par::guided_mut(&mut s.hidden, MIN_ROWS, |r0, chunk| {
        let mut u = [0f32; RUN_ROWS];
        let mut done = 0;
        while done < chunk.len() {
            // A run of rows within one expert.
            let idx = r0 + done;
            let (k, r) = (idx / ff, idx % ff);
            let len = (ff - r).min(chunk.len() - done).min(RUN_ROWS);
            let e = chosen[k];
            let hs = &mut chunk[done..done + len];
            // The up rows come next: start their first page now (prefetchers stop at pages).
            prefetch_head(&m.expert(up, e)[r * urb..]);
            rows_dot(gate.ty, m.expert(gate, e), grb, r, n, hs);
            let us = &mut u[..len];
            let up_act = if same_act { n } else { Act::F32(x_f32) };
            rows_dot(up.ty, m.expert(up, e), urb, r, up_act, us);
            hs.iter_mut()
                .zip(us.iter())
                .for_each(|(h, &u)| *h = silu(*h) * u);
            done += len;
        }
    });
    let hidden = prepare(p, down.ty, &s.hidden, ff, &mut s.xq);
    let drb = down.row_bytes();
    par::guided_mut(&mut s.proj, MIN_ROWS, |r0, chunk| {
        for (j, run) in chunk.chunks_mut(RUN_ROWS).enumerate() {
            let r = r0 + j * RUN_ROWS;
            let mut t = [0f32; RUN_ROWS];
            let t = &mut t[..run.len()];
            run.fill(0.0);
            for (k, (&e, &p)) in chosen.iter().zip(&weights).enumerate() {
                if let Some(&next) = chosen.get(k + 1) {
                    prefetch_head(&m.expert(down, next)[r * drb..]);
                }
                rows_dot(down.ty, m.expert(down, e), drb, r, hidden.part(k, ff), t);
                run.iter_mut().zip(t.iter()).for_each(|(o, &d)| *o += p * d);
            }
        }
    });
    s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
}
