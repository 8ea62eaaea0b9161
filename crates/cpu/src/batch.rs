//! Several tokens through every layer at once: a prompt's tokens a chunk at a time (the tokens
//! before its last: they need only their keys and values), or one token of each of several
//! sessions (the batched decode step, step_batch.rs). A run of a matrix's rows is read from memory once for the
//! chunk and dotted with every token's activations while it sits in cache; a token at a time,
//! each token read every active row again (the prefill was bound by those reads). Every output
//! is the same `rows_dot` of the same rows and activations as `forward::token_layers` computes,
//! and sums run in the same order, so the cache and residuals are bit-identical to running the
//! tokens one at a time. Nothing a token computes depends on the other tokens of its batch
//! (thread splits cut between rows, never inside one row's dot product), which is what makes
//! the batched step batch-invariant.

use q4moe_gguf::quant::{vec_dot_q4_0x_rows, vec_dot_q4_0x_rows_acts, vec_dot_q8_rows_acts};
use q4moe_gguf::GgmlType;
use q4moe_model::{Config, LayerTensors, Model, QTensor};

use crate::attend::{attend_heads, heads_a_task};
use crate::forward::{
    choose, norm_and_rotate, prepare, rows_dot, up_shares_act, Act, HostWeights, LayerNorms,
    Scratch, MIN_ROWS, RUN_ROWS,
};
use crate::group::ExpertGroups;
use crate::kv::KvCache;
use crate::ops::{rmsnorm, silu};
use crate::par;

/// Tokens a chunk: their activations stay in cache beside a run of rows (64 tokens of
/// Qwen3-30B-A3B: ~10 MB of buffers, ~150 KB of quantised activations a matrix).
pub const CHUNK: usize = 64;

/// A chunk's activations, grown to the largest chunk seen.
#[derive(Default)]
pub struct Batch {
    /// [t, d_model] residuals, and their norms
    x: Vec<f32>,
    n: Vec<f32>,
    /// [rows, t] a matrix's outputs, row-major over the tokens (`matmul`)
    out: Vec<f32>,
    /// [rows, t] the Q, K and V projections' outputs
    qkv: [Vec<f32>; 3],
    /// [t, q_dim] queries (normed, rotated), then attention outputs
    q: Vec<f32>,
    attn: Vec<f32>,
    /// [t x heads, longest] attention scores
    scores: Vec<f32>,
    /// [rows, slots] the experts' silu(gate) * up, then [slots, d_ff] for the down rows
    hidden: Vec<f32>,
    hidden_t: Vec<f32>,
    /// Quantised activations of the chunk's vectors.
    xq: Vec<u8>,
    /// [t] each token's position in its cache
    pos: Vec<usize>,
    /// [t, head_dim / 2] each token's RoPE angles (`Rope::angles`), for every layer
    angles: Vec<(f32, f32)>,
    /// [t] each token's experts and their weights, in its own top-k order
    picks: Vec<(Vec<usize>, Vec<f32>)>,
    groups: ExpertGroups,
    /// Bytes of the experts' weights the last `run` read: each chosen expert of a layer once.
    pub experts_read: u64,
}

/// Where a batch's tokens sit: the caches they append to, and so their positions.
pub(crate) enum Seats<'a> {
    /// A prompt's chunk: token i at position `kv.len() + i` of one cache.
    Chunk(&'a mut KvCache),
    /// Tokens of several sessions: token i goes to `kvs[of[i]]`, at its next position after
    /// the batch's earlier tokens of that cache (a session's tokens in order). One token a
    /// session is the batched decode step; runs of several, prompts prefilled together.
    Runs(&'a mut [KvCache], &'a [usize]),
}

impl Seats<'_> {
    fn positions(&self, t: usize, out: &mut Vec<usize>) {
        out.clear();
        match self {
            Seats::Chunk(kv) => out.extend((0..t).map(|i| kv.len() + i)),
            Seats::Runs(kvs, of) => {
                assert_eq!(of.len(), t, "a cache a token");
                let mut next: Vec<usize> = kvs.iter().map(KvCache::len).collect();
                out.extend(of.iter().map(|&c| {
                    next[c] += 1;
                    next[c] - 1
                }));
            }
        }
    }

    fn kv(&mut self, i: usize) -> &mut KvCache {
        match self {
            Seats::Chunk(kv) => kv,
            Seats::Runs(kvs, of) => &mut kvs[of[i]],
        }
    }

    fn kv_ref(&self, i: usize) -> &KvCache {
        match self {
            Seats::Chunk(kv) => kv,
            Seats::Runs(kvs, of) => &kvs[of[i]],
        }
    }
}

/// A quantised matrix (or one expert's) as raw bytes.
#[derive(Clone, Copy)]
struct Rows<'a> {
    ty: GgmlType,
    data: &'a [u8],
    row_bytes: usize,
}

impl<'a> Rows<'a> {
    fn of(m: &'a Model, t: &QTensor) -> Self {
        Rows {
            ty: t.ty,
            data: m.data(t),
            row_bytes: t.row_bytes(),
        }
    }

    fn expert(m: &'a Model, t: &QTensor, e: usize) -> Self {
        Rows {
            ty: t.ty,
            data: m.expert(t, e),
            row_bytes: t.row_bytes(),
        }
    }
}

/// Activations the batched kernels take at a call.
const ACTS_AT_ONCE: usize = 32;

/// Rows [r, r + len) of `w` (len <= RUN_ROWS) against every one of `acts`: `put(i, j, v)` with
/// v = row r + i . acts[j]. Several quantised activations go through a batched kernel (Q4_0
/// rows with Q8_0x8 activations, Q4_K rows with Q8_K: each row unpacked once for all of them),
/// one activation through its single kernel; either way v is bit for bit what `rows_dot`
/// computes for that row alone. The kernels may prefetch the rows past the run.
fn dots(
    w: Rows<'_>,
    r: usize,
    len: usize,
    acts: &[Act<'_>],
    mut put: impl FnMut(usize, usize, f32),
) {
    let (rb, rows) = (w.row_bytes, &w.data[r * w.row_bytes..]);
    match acts {
        [Act::Q4x(..), _, ..] => several(acts, len, &mut put, |q, out| {
            vec_dot_q4_0x_rows_acts(rows, rb, q, out)
        }),
        [Act::Q8(..), _, ..] => several(acts, len, &mut put, |q, out| {
            vec_dot_q8_rows_acts(w.ty, rows, rb, q, out)
        }),
        _ => {
            let mut buf = [0f32; RUN_ROWS];
            for (j, &act) in acts.iter().enumerate() {
                match act {
                    Act::Q4x(q, _) => vec_dot_q4_0x_rows(rows, rb, q, &mut buf[..len]),
                    _ => rows_dot(w.ty, w.data, rb, r, act, &mut buf[..len]),
                }
                buf[..len]
                    .iter()
                    .enumerate()
                    .for_each(|(i, &v)| put(i, j, v));
            }
        }
    }
}

/// `dots` through a batched kernel: `kernel(acts' bytes, out)` fills `out[i * n + j]` for `len`
/// rows and n <= ACTS_AT_ONCE activations at a call.
fn several(
    acts: &[Act<'_>],
    len: usize,
    put: &mut impl FnMut(usize, usize, f32),
    kernel: impl Fn(&[&[u8]], &mut [f32]),
) {
    let mut q = [&[][..]; ACTS_AT_ONCE];
    let mut buf = [0f32; ACTS_AT_ONCE * RUN_ROWS];
    for (c, chunk) in acts.chunks(ACTS_AT_ONCE).enumerate() {
        for (q, a) in q.iter_mut().zip(chunk) {
            *q = match *a {
                Act::Q4x(bytes, _) | Act::Q8(bytes, _) => bytes,
                Act::F32(_) => panic!("a matrix's activations are prepared alike"),
            };
        }
        let n = chunk.len();
        let out = &mut buf[..len * n];
        kernel(&q[..n], out);
        for (i, o) in out.chunks(n).enumerate() {
            o.iter()
                .enumerate()
                .for_each(|(j, &v)| put(i, c * ACTS_AT_ONCE + j, v));
        }
    }
}

/// `out[r * acts.len() + t]` = row r . acts[t] for every row of `w`: the rows split across the
/// threads, each run of RUN_ROWS rows dotted with every activation vector.
fn matmul(w: Rows<'_>, acts: &[Act<'_>], out: &mut [f32]) {
    let mut rows: Vec<&mut [f32]> = out.chunks_mut(acts.len()).collect();
    par::guided_mut(&mut rows, MIN_ROWS, |r0, piece| {
        for (j, run) in piece.chunks_mut(RUN_ROWS).enumerate() {
            dots(w, r0 + j * RUN_ROWS, run.len(), acts, |i, t, v| {
                run[i][t] = v
            });
        }
    });
}

/// `t`'s column of `out` ([rows, n] from `matmul`) into `dst`.
fn column(out: &[f32], n: usize, t: usize, dst: &mut [f32]) {
    dst.iter_mut()
        .enumerate()
        .for_each(|(r, d)| *d = out[r * n + t]);
}

/// Rows a tile of `tiled`: a tile reads TILE rows along and writes runs of TILE values, whole
/// cache lines both ways (a row at a time, the writes of a [64, 1024] result strode 4 KB, into
/// one cache set).
const TILE: usize = 16;

/// `f(r, j)` for every row r < rows and column j < n of a [rows, n] matrix, a tile of TILE
/// rows by every column at a time: the order for moving it into [n, rows].
fn tiled(rows: usize, n: usize, mut f: impl FnMut(usize, usize)) {
    for r0 in (0..rows).step_by(TILE) {
        for j in 0..n {
            (r0..(r0 + TILE).min(rows)).for_each(|r| f(r, j));
        }
    }
}

/// `src` ([rows, n]) as [n, rows] into `dst`.
fn transpose(src: &[f32], n: usize, dst: &mut [f32]) {
    let rows = src.len() / n;
    tiled(rows, n, |r, j| dst[j * rows + r] = src[r * n + j]);
}

/// The `n` vectors of `k` values at `x` prepared for `ty`'s rows, one Act a vector.
fn acts<'a>(
    s: &Scratch,
    ty: GgmlType,
    x: &'a [f32],
    k: usize,
    buf: &'a mut Vec<u8>,
) -> Vec<Act<'a>> {
    let all = prepare(s.precision, ty, x, k, buf);
    (0..x.len() / k).map(|t| all.part(t, k)).collect()
}

impl Batch {
    /// `tokens` through every layer of `kv` (at its next positions), the last token's residual
    /// left in `s.x` as `forward::token_layers` leaves it.
    pub fn layers(
        &mut self,
        m: &Model,
        w: &HostWeights,
        kv: &mut KvCache,
        tokens: &[u32],
        s: &mut Scratch,
    ) {
        self.run(m, w, &mut Seats::Chunk(kv), tokens, s);
        let d = m.config.d_model;
        s.x.copy_from_slice(&self.x[self.x.len() - d..]);
    }

    /// `tokens` through every layer at their `seats`, the residuals left in `self.x`.
    pub(crate) fn run(
        &mut self,
        m: &Model,
        w: &HostWeights,
        seats: &mut Seats<'_>,
        tokens: &[u32],
        s: &mut Scratch,
    ) {
        let (c, t) = (&m.config, tokens.len());
        self.x.resize(t * c.d_model, 0.0);
        self.n.resize(t * c.d_model, 0.0);
        for (x, &tok) in self.x.chunks_mut(c.d_model).zip(tokens) {
            let row = m.row(&m.token_embd, tok as usize);
            q4moe_gguf::quant::dequantize_row(m.token_embd.ty, row, x)
                .expect("embedding type validated at load");
        }
        let mut pos = std::mem::take(&mut self.pos);
        seats.positions(t, &mut pos);
        self.angles.clear();
        pos.iter().for_each(|&p| s.rope.angles(p, &mut self.angles));
        self.experts_read = 0;
        for (li, l) in m.layers.iter().enumerate() {
            self.attention(m, l, &w.layers[li], seats, li, &pos, s);
            self.experts(m, l, &w.layers[li], s);
        }
        self.pos = pos;
    }

    /// The logits of every residual `run` left, `[t, vocab]` into `logits`: the output head's
    /// rows read once for all of them.
    pub(crate) fn head(&mut self, m: &Model, w: &HostWeights, s: &Scratch, logits: &mut Vec<f32>) {
        let c = &m.config;
        let t = self.x.len() / c.d_model;
        self.norm(c, w.output_norm());
        let n = std::mem::take(&mut self.n);
        self.project(m, s, &m.output, &n, c.d_model);
        self.n = n;
        logits.resize(t * c.vocab_size, 0.0);
        for (i, row) in logits.chunks_mut(c.vocab_size).enumerate() {
            column(&self.out, t, i, row);
        }
    }

    /// RMSNorm of every residual into `n`.
    fn norm(&mut self, c: &Config, weight: &[f32]) {
        for (x, n) in self.x.chunks(c.d_model).zip(self.n.chunks_mut(c.d_model)) {
            rmsnorm(x, weight, c.rms_eps, n);
        }
    }

    /// `tensor` against the `k`-value vectors at `x` ([t, k]) into `self.out` ([rows, t]).
    fn project(&mut self, m: &Model, s: &Scratch, tensor: &QTensor, x: &[f32], k: usize) {
        let n = x.len() / k;
        self.out.resize(tensor.rows() * n, 0.0);
        let a = acts(s, tensor.ty, x, k, &mut self.xq);
        matmul(Rows::of(m, tensor), &a, &mut self.out);
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        m: &Model,
        l: &LayerTensors,
        w: &LayerNorms,
        seats: &mut Seats<'_>,
        li: usize,
        pos: &[usize],
        s: &mut Scratch,
    ) {
        let c = &m.config;
        let t = self.x.len() / c.d_model;
        self.norm(c, &w.attn_norm);
        let n = std::mem::take(&mut self.n);
        // Q, K and V of one weight type take one preparation of the normed activations.
        let mut qkv = std::mem::take(&mut self.qkv);
        let tensors = [&l.attn_q, &l.attn_k, &l.attn_v];
        let shared = tensors.iter().all(|x| x.ty == l.attn_q.ty);
        let mut a = Vec::new();
        for (tensor, dst) in tensors.into_iter().zip(&mut qkv) {
            if a.is_empty() || !shared {
                a = acts(s, tensor.ty, &n, c.d_model, &mut self.xq);
            }
            dst.resize(tensor.rows() * t, 0.0);
            matmul(Rows::of(m, tensor), &a, dst);
        }
        drop(a);
        self.n = n;
        // Every token's queries and keys normed and rotated (a parallel region over the
        // tokens, their outputs token-major first), its keys and values into its cache, its
        // queries left in `q`; then one parallel region over every (token, head).
        for out in &mut qkv {
            self.hidden_t.resize(out.len(), 0.0);
            transpose(out, t, &mut self.hidden_t);
            std::mem::swap(out, &mut self.hidden_t);
        }
        let [q, k, v] = &mut qkv;
        let (angles, half) = (&self.angles, c.head_dim / 2);
        par::chunks_mut2(q, c.q_dim(), k, c.kv_dim(), |i, q, k| {
            norm_and_rotate(c, w, q, k, &angles[i * half..(i + 1) * half])
        });
        for (i, (k, v)) in k.chunks(c.kv_dim()).zip(v.chunks(c.kv_dim())).enumerate() {
            seats.kv(i).push(li, k, v);
        }
        std::mem::swap(&mut self.q, q);
        self.qkv = qkv;
        self.attend(c, seats, li, pos);
        let attn = std::mem::take(&mut self.attn);
        self.project(m, s, &l.attn_output, &attn, c.q_dim());
        self.attn = attn;
        self.add_out(c.d_model, t);
    }

    /// Token i's queries (`self.q`) over its cache's first `pos[i] + 1` positions of layer
    /// `li`, a few heads of a group of a token a task (`heads_a_task`), every token's in one
    /// parallel region, into `self.attn`.
    fn attend(&mut self, c: &Config, seats: &Seats<'_>, li: usize, pos: &[usize]) {
        let hd = c.head_dim;
        let each = heads_a_task(c, pos.len(), par::threads());
        let tasks = c.n_head / each;
        let longest = pos.iter().max().map_or(0, |p| p + 1);
        self.attn.resize(pos.len() * c.q_dim(), 0.0);
        self.scores.resize(pos.len() * c.n_head * longest, 0.0);
        let q = &self.q;
        par::chunks_mut2(
            &mut self.attn,
            each * hd,
            &mut self.scores,
            each * longest,
            |j, o, scores| {
                let (i, h) = (j / tasks, j % tasks * each);
                let len = pos[i] + 1;
                let cached = seats.kv_ref(i).view(li, len);
                let q = &q[i * c.q_dim()..(i + 1) * c.q_dim()];
                attend_heads(c, h, q, &cached, len, scores, o);
            },
        );
    }

    /// Each residual += its column of `self.out` ([d_model, t]).
    fn add_out(&mut self, d: usize, t: usize) {
        let (x, out) = (&mut self.x, &self.out);
        tiled(d, t, |r, i| x[i * d + r] += out[r * t + i]);
    }

    /// Router, top-k, then each chosen expert's SwiGLU FFN over the slots that chose it,
    /// weighted into the residuals in each token's order of its experts.
    fn experts(&mut self, m: &Model, l: &LayerTensors, w: &LayerNorms, s: &mut Scratch) {
        let c = &m.config;
        let (t, nu) = (self.x.len() / c.d_model, c.n_expert_used);
        self.norm(c, &w.ffn_norm);
        let n = std::mem::take(&mut self.n);
        self.project(m, s, &l.ffn_gate_inp, &n, c.d_model);
        let mut picks = std::mem::take(&mut self.picks);
        picks.clear();
        for i in 0..t {
            column(&self.out, t, i, &mut s.router);
            picks.push(choose(c, &mut s.router));
        }
        // Token i's k-th choice is slot i * nu + k.
        let mut groups = std::mem::take(&mut self.groups);
        groups.build(
            c.n_expert,
            picks.iter().flat_map(|(e, _)| e.iter().copied()),
        );
        self.experts_read += (groups.iter().count() * l.expert_bytes()) as u64;
        self.gate_up(m, l, s, &n, &groups, t * nu);
        self.n = n;
        self.down(m, l, s, &groups, t * nu);
        self.groups = groups;
        // out: [d_model, slots]; each token's experts summed in its order from 0, then added
        // to its residual, as moe_block does (the same operations on each value), in tiles:
        // a token's slots are contiguous in a row of `out`.
        let (d, x, out) = (c.d_model, &mut self.x, &self.out);
        tiled(d, t, |r, i| {
            let mut proj = 0f32;
            for (k, &p) in picks[i].1.iter().enumerate() {
                proj += p * out[r * t * nu + i * nu + k];
            }
            x[i * d + r] += proj;
        });
        self.picks = picks;
    }

    /// silu(gate) * up of every slot into `self.hidden_t` ([slots, d_ff]).
    fn gate_up(
        &mut self,
        m: &Model,
        l: &LayerTensors,
        s: &Scratch,
        n: &[f32],
        groups: &ExpertGroups,
        total: usize,
    ) {
        let c = &m.config;
        let (gate, up, ff, nu) = (
            &l.ffn_gate_exps,
            &l.ffn_up_exps,
            c.d_ff_expert,
            c.n_expert_used,
        );
        let a = acts(s, gate.ty, n, c.d_model, &mut self.xq);
        let shared = up_shares_act(gate.ty, up.ty, a[0]);
        let exact: Vec<Act<'_>> = n.chunks(c.d_model).map(Act::F32).collect();
        let up_acts = if shared { &a } else { &exact };
        // Each slot's token's activations, in the groups' order (an expert's are contiguous).
        let ga: Vec<Act<'_>> = groups.slots().iter().map(|&s| a[s / nu]).collect();
        let ua: Vec<Act<'_>> = groups.slots().iter().map(|&s| up_acts[s / nu]).collect();
        self.hidden.resize(ff * total, 0.0);
        let mut rows: Vec<&mut [f32]> = self.hidden.chunks_mut(total).collect();
        par::guided_mut(&mut rows, MIN_ROWS, |r0, piece| {
            for (e, at, list) in groups.iter() {
                let span = at..at + list.len();
                let (g, u) = (Rows::expert(m, gate, e), Rows::expert(m, up, e));
                for (j, run) in piece.chunks_mut(RUN_ROWS).enumerate() {
                    let (r, len) = (r0 + j * RUN_ROWS, run.len());
                    dots(g, r, len, &ga[span.clone()], |i, k, v| run[i][list[k]] = v);
                    dots(u, r, len, &ua[span.clone()], |i, k, v| {
                        let h = &mut run[i][list[k]];
                        *h = silu(*h) * v;
                    });
                }
            }
        });
        self.hidden_t.resize(total * ff, 0.0);
        transpose(&self.hidden, total, &mut self.hidden_t);
    }

    /// Every slot's down rows of its expert into `self.out` ([d_model, slots]).
    fn down(
        &mut self,
        m: &Model,
        l: &LayerTensors,
        s: &Scratch,
        groups: &ExpertGroups,
        total: usize,
    ) {
        let c = &m.config;
        let (down, ff) = (&l.ffn_down_exps, c.d_ff_expert);
        let h = acts(s, down.ty, &self.hidden_t, ff, &mut self.xq);
        let gh: Vec<Act<'_>> = groups.slots().iter().map(|&s| h[s]).collect();
        self.out.resize(c.d_model * total, 0.0);
        let mut rows: Vec<&mut [f32]> = self.out.chunks_mut(total).collect();
        par::guided_mut(&mut rows, MIN_ROWS, |r0, piece| {
            for (e, at, list) in groups.iter() {
                let d = Rows::expert(m, down, e);
                for (j, run) in piece.chunks_mut(RUN_ROWS).enumerate() {
                    let r = r0 + j * RUN_ROWS;
                    dots(d, r, run.len(), &gh[at..at + list.len()], |i, k, v| {
                        run[i][list[k]] = v
                    });
                }
            }
        });
    }
}
