//! One token through every layer (DESIGN.md section 2). Matrices stay quantised: every output
//! element is one `vec_dot` over a quantised row; rows are split across rayon threads.

use q4moe_gguf::quant::{activation_type, quantize_activation_q8, vec_dot, vec_dot_q8};
use q4moe_gguf::GgmlType;
use q4moe_model::{Config, LayerTensors, Model, QTensor};
use rayon::prelude::*;

use crate::kv::KvCache;
use crate::ops::{rmsnorm, rmsnorm_heads, rope_neox, silu, softmax, top_k};

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
enum Act<'a> {
    F32(&'a [f32]),
    /// Quantised blocks; `stride` bytes per vector when several are packed (experts' hidden).
    Q8(&'a [u8], usize),
}

impl Act<'_> {
    /// The `i`-th of several packed vectors of `n` elements each.
    fn part(&self, i: usize, n: usize) -> Act<'_> {
        match *self {
            Act::F32(x) => Act::F32(&x[i * n..(i + 1) * n]),
            Act::Q8(q, stride) => Act::Q8(&q[i * stride..(i + 1) * stride], stride),
        }
    }

    fn dot(&self, ty: GgmlType, row: &[u8]) -> f32 {
        match *self {
            Act::F32(x) => vec_dot(ty, row, x),
            Act::Q8(q, _) => vec_dot_q8(ty, row, q),
        }
    }
}

/// Types with an integer dot product against Q8 activations.
fn is_quantised(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q6_K)
}

/// Prepares `x` (one or more packed vectors of `n` elements) for weights of type `ty`,
/// quantising into `buf` when the precision asks for it and the weights are quantised.
fn prepare<'a>(p: Precision, ty: GgmlType, x: &'a [f32], n: usize, buf: &'a mut Vec<u8>) -> Act<'a> {
    if p == Precision::Exact || !is_quantised(ty) {
        return Act::F32(x);
    }
    buf.clear();
    for v in x.chunks(n) {
        quantize_activation_q8(ty, v, buf);
    }
    let stride = activation_type(ty).row_bytes(n).expect("rows are whole blocks");
    Act::Q8(buf, stride)
}

/// Rows per rayon task: enough work to amortise scheduling, small enough to balance 2+ cores.
const ROWS_PER_TASK: usize = 32;

/// Norm vectors, dequantised once at load (a few KB per layer).
pub struct HostWeights {
    layers: Vec<LayerNorms>,
    output_norm: Vec<f32>,
}

struct LayerNorms {
    attn_norm: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
}

impl HostWeights {
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
        HostWeights { layers, output_norm: m.vector_f32(&m.output_norm) }
    }
}

/// Activations of one token, allocated once per backend.
pub struct Scratch {
    /// [d_model] residual stream
    x: Vec<f32>,
    /// [d_model] normed input of the current sub-block
    n: Vec<f32>,
    /// [q_dim], [kv_dim], [kv_dim]
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// [q_dim] attention output
    attn: Vec<f32>,
    /// [d_model]
    proj: Vec<f32>,
    /// [n_expert] router probabilities
    router: Vec<f32>,
    /// [n_expert_used, d_ff_expert] silu(gate) * up
    hidden: Vec<f32>,
    /// [vocab]
    logits: Vec<f32>,
    /// Quantised activations (Q8 precision), reused across products.
    xq: Vec<u8>,
    precision: Precision,
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
            attn: vec![0.0; c.q_dim()],
            proj: vec![0.0; c.d_model],
            router: vec![0.0; c.n_expert],
            hidden: vec![0.0; c.n_expert_used * c.d_ff_expert],
            logits: vec![0.0; c.vocab_size],
        }
    }
}

/// `out[r] = row_r(w) . x` for the rows of a quantised matrix given as raw bytes.
fn matvec(ty: GgmlType, data: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
    out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(ci, chunk)| {
        for (i, o) in chunk.iter_mut().enumerate() {
            let r = ci * ROWS_PER_TASK + i;
            *o = x.dot(ty, &data[r * row_bytes..(r + 1) * row_bytes]);
        }
    });
}

/// `out = t x`, preparing `x` for `t`'s type.
fn matvec_t(m: &Model, t: &QTensor, x: &[f32], xq: &mut Vec<u8>, p: Precision, out: &mut [f32]) {
    let act = prepare(p, t.ty, x, x.len(), xq);
    matvec(t.ty, m.data(t), t.row_bytes(), act, out);
}

/// Runs `token` at the next position of `kv` and returns the logits.
pub fn token_logits<'s>(m: &Model, w: &HostWeights, kv: &mut KvCache, token: u32, s: &'s mut Scratch) -> &'s [f32] {
    let c = &m.config;
    let pos = kv.len();
    q4moe_gguf::quant::dequantize_row(m.token_embd.ty, m.row(&m.token_embd, token as usize), &mut s.x)
        .expect("embedding type validated at load");
    for (li, l) in m.layers.iter().enumerate() {
        attention_block(m, l, &w.layers[li], kv, li, pos, s);
        moe_block(m, l, &w.layers[li], s);
    }
    rmsnorm(&s.x, &w.output_norm, c.rms_eps, &mut s.n);
    matvec_t(m, &m.output, &s.n, &mut s.xq, s.precision, &mut s.logits);
    &s.logits
}

fn attention_block(m: &Model, l: &LayerTensors, w: &LayerNorms, kv: &mut KvCache, li: usize, pos: usize, s: &mut Scratch) {
    let c = &m.config;
    rmsnorm(&s.x, &w.attn_norm, c.rms_eps, &mut s.n);
    let p = s.precision;
    matvec_t(m, &l.attn_q, &s.n, &mut s.xq, p, &mut s.q);
    matvec_t(m, &l.attn_k, &s.n, &mut s.xq, p, &mut s.k);
    matvec_t(m, &l.attn_v, &s.n, &mut s.xq, p, &mut s.v);
    rmsnorm_heads(&mut s.q, &w.q_norm, c.rms_eps);
    rmsnorm_heads(&mut s.k, &w.k_norm, c.rms_eps);
    rope_neox(&mut s.q, c.head_dim, pos, c.rope_theta);
    rope_neox(&mut s.k, c.head_dim, pos, c.rope_theta);
    kv.k[li].extend_from_slice(&s.k);
    kv.v[li].extend_from_slice(&s.v);
    attend(c, &s.q, &kv.k[li], &kv.v[li], &mut s.attn);
    matvec_t(m, &l.attn_output, &s.attn, &mut s.xq, p, &mut s.proj);
    s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
}

/// Grouped-query attention of one query position over every cached position, head-parallel.
fn attend(c: &Config, q: &[f32], keys: &[f32], values: &[f32], out: &mut [f32]) {
    let (hd, kv_dim) = (c.head_dim, c.kv_dim());
    let len = keys.len() / kv_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(hd).enumerate().for_each(|(h, o)| {
        let g = h / c.n_group();
        let qh = &q[h * hd..(h + 1) * hd];
        let mut scores: Vec<f32> = (0..len)
            .map(|t| {
                let kt = &keys[t * kv_dim + g * hd..t * kv_dim + (g + 1) * hd];
                qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>() * scale
            })
            .collect();
        softmax(&mut scores);
        o.fill(0.0);
        for (t, &p) in scores.iter().enumerate() {
            let vt = &values[t * kv_dim + g * hd..t * kv_dim + (g + 1) * hd];
            o.iter_mut().zip(vt).for_each(|(a, b)| *a += p * b);
        }
    });
}

/// Router, top-k with renormalisation, then the selected experts' SwiGLU FFNs, weighted.
fn moe_block(m: &Model, l: &LayerTensors, w: &LayerNorms, s: &mut Scratch) {
    let c = &m.config;
    rmsnorm(&s.x, &w.ffn_norm, c.rms_eps, &mut s.n);
    let p = s.precision;
    matvec_t(m, &l.ffn_gate_inp, &s.n, &mut s.xq, p, &mut s.router);
    softmax(&mut s.router);
    let chosen = top_k(&s.router, c.n_expert_used);
    let mut weights: Vec<f32> = chosen.iter().map(|&e| s.router[e]).collect();
    if c.norm_topk_prob {
        let sum: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|p| *p /= sum);
    }
    let (gate, up, down) = (&l.ffn_gate_exps, &l.ffn_up_exps, &l.ffn_down_exps);
    let ff = c.d_ff_expert;
    let same_act = gate.ty == up.ty || (is_quantised(gate.ty) && is_quantised(up.ty) && activation_type(gate.ty) == activation_type(up.ty));
    let x_f32 = &s.n;
    let n = prepare(p, gate.ty, &s.n, c.d_model, &mut s.xq);
    s.hidden.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(ci, chunk)| {
        for (i, h) in chunk.iter_mut().enumerate() {
            let idx = ci * ROWS_PER_TASK + i;
            let (e, r) = (chosen[idx / ff], idx % ff);
            let g = n.dot(gate.ty, &m.expert(gate, e)[r * gate.row_bytes()..(r + 1) * gate.row_bytes()]);
            let up_row = &m.expert(up, e)[r * up.row_bytes()..(r + 1) * up.row_bytes()];
            // A file whose gate and up differ in activation type gets the exact path for up.
            let u = if same_act { n.dot(up.ty, up_row) } else { vec_dot(up.ty, up_row, x_f32) };
            *h = silu(g) * u;
        }
    });
    let hidden = prepare(p, down.ty, &s.hidden, ff, &mut s.xq);
    s.proj.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(ci, chunk)| {
        for (i, o) in chunk.iter_mut().enumerate() {
            let r = ci * ROWS_PER_TASK + i;
            *o = chosen
                .iter()
                .zip(&weights)
                .enumerate()
                .map(|(k, (&e, &p))| {
                    let row = &m.expert(down, e)[r * down.row_bytes()..(r + 1) * down.row_bytes()];
                    p * hidden.part(k, ff).dot(down.ty, row)
                })
                .sum();
        }
    });
    s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
}
