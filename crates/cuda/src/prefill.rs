//! Batched prefill (kernels/prefill.cu): a chunk of prompt tokens goes through each layer at
//! once, so each weight row is read once a chunk, not once a token as in the decode step (which
//! prefill ran once a prompt token: ~670 tok/s on an H200). Only the keys and values matter
//! here: the prompt's last token runs the decode step, which gives its logits; so the last
//! layer's experts are skipped.

use q4moe_model::Config;

use crate::device::Device;
use crate::kernel::{is_f32, Kernel};
use crate::launch::Launch;
use crate::memory::DevBuf;
use crate::params::*;
use crate::rows::{
    dense_launch, dense_params, f32_few_launch, f32_split_sizes, few_launch, padded_len,
    quant_launch, quant_params, quant_words, rows_launch, splits, swiglu_counters, swiglu_fuses,
    Groups, Rows, Swiglu, F32_FEW, PFM_ENTRIES,
};
use crate::step::{
    att_rows, attn_params, gqa_params, rope_params, split_attention, topk, topk_params, Kv,
    TOPK_THREADS,
};
use crate::weights::{LayerW, Weights};
use crate::{KvType, Result};

/// pf_attn_tc's dynamic shared memory: two staged tiles of 64 keys' K and V rows (136 halves
/// each).
const PFA_SMEM: u32 = 4 * 64 * 136 * 2;
/// The largest row length the rows kernels and pf_quant take.
const PF_MAX_K: usize = 4096;
const THREADS: u32 = 256;
/// Slots (tokens x experts a token) bt_route lists at most (prefill.cu BT_ROUTE_SLOTS).
const BT_ROUTE_SLOTS: usize = 256;

/// Floats of each of Prefill's buffers for `chunk` tokens, in `new`'s order (x, xq, xf, qkv, q,
/// att, logits, ids, weights, list, counts, tiles, gu, hq, hf, y, f32_part, f32_count,
/// route_done, bt_done, h_count): `new` allocates them and
/// `bytes` sums them, so the memory check counts what is allocated.
fn buffer_floats(c: &Config, chunk: usize) -> [usize; 21] {
    let (t, slots) = (chunk, chunk * c.n_expert_used);
    let (k_max, dff) = (c.d_model.max(c.q_dim()), c.d_ff_expert);
    let (f32_part, f32_count) = f32_split_sizes(c.n_expert, c.d_model, F32_FEW.min(chunk));
    [
        t * c.d_model,
        t * quant_words(k_max),
        t * padded_len(k_max),
        t * (c.q_dim() + 2 * c.kv_dim()),
        t * c.q_dim(),
        t * c.q_dim(),
        t * c.n_expert,
        slots,
        slots,
        2 * c.n_expert * t,
        c.n_expert,
        2 * (1 + max_tiles(c, t)),
        slots * 2 * dff,
        slots * quant_words(dff),
        slots * padded_len(dff),
        slots * c.d_model,
        f32_part,
        f32_count,
        1,
        t * (c.n_kv_head + c.n_head),
        swiglu_counters(slots.max(c.n_expert), dff),
    ]
}

/// Whether the device has the tensor cores pf_mma and pf_attn_tc use (sm_80+).
pub(crate) fn tensor_cores(dev: &Device) -> bool {
    dev.sm_major >= 8
}

/// Whether the batched kernels take this geometry: every activation row a multiple of 32 and
/// at most PF_MAX_K (load_x_fast).
pub fn supports(c: &Config) -> bool {
    let rows = [c.d_model, c.q_dim(), c.d_ff_expert];
    rows.iter().all(|&n| n % 32 == 0 && n <= PF_MAX_K) && c.head_dim <= 512
}

/// The chunk's activations on the device, sized for `chunk` tokens.
pub struct Prefill {
    pub chunk: usize,
    /// Bytes of attention partials the generic attention holds at once
    /// (CudaOptions::prefill_part_budget: a chunk of 1,024 tokens at 16,384 positions would
    /// need 8.7 GB at once).
    part_budget: usize,
    /// How the split types' rows run: tensor cores (sm_80+: pf_mma), and the most tokens a
    /// launch takes on bt_mma instead (CudaOptions::few_tokens).
    mma: bool,
    few_tokens: usize,
    /// Attention on tensor cores (pf_attn_tc, Qwen3-MoE's shapes over an f16 cache): the
    /// kernel and the tokens a block takes.
    attn_tc: Option<(Kernel, usize)>,
    states: DevBuf,
    x: DevBuf,
    xq: DevBuf,
    xf: DevBuf,
    qkv: DevBuf,
    q: DevBuf,
    att: DevBuf,
    /// Attention partials, grown to the context a chunk reaches.
    part: DevBuf,
    logits: DevBuf,
    ids: DevBuf,
    weights: DevBuf,
    list: DevBuf,
    counts: DevBuf,
    /// The grouped pf_mma launches' work list (pf_tiles): a count, then (expert, first slot).
    tiles: DevBuf,
    gu: DevBuf,
    hq: DevBuf,
    hf: DevBuf,
    y: DevBuf,
    /// The router's split bt_f32rows launches (a chain of its sum a block): the chains' sums
    /// and each tile's counter of blocks done.
    f32_part: DevBuf,
    f32_count: DevBuf,
    /// bt_route's counter of blocks done (zero between launches).
    route_done: DevBuf,
    /// The batched step's attention on tensor cores, where the device and geometry take it.
    bt_gqa: Option<BtGqa>,
    /// bt_attn_gqa_tc's merge counters and maxima, [rows][n_kv_head + n_head] (zero between
    /// launches).
    bt_done: DevBuf,
    /// The fused gate-and-up launches' counters of block pairs (rows::Swiglu; zero between
    /// launches).
    h_count: DevBuf,
}

/// The batched step's attention on tensor cores (bt_attn_gqa_tc, Qwen3-MoE's shape over an f16
/// cache): the single-stream kernel's span knobs (AttnGqaParams::max_blocks, min_span, stage),
/// the backend's and not the batch's, so a row's span is its own length's alone or in a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BtGqa {
    pub max_blocks: usize,
    pub min_span: usize,
    pub stage: usize,
}

impl Prefill {
    pub fn new(
        dev: &Device,
        c: &Config,
        chunk: usize,
        (part_budget, few_tokens): (usize, usize),
        bt_gqa: Option<BtGqa>,
    ) -> Result<Prefill> {
        let f = |n: usize| DevBuf::new(dev, n.max(1) * 4);
        let mma = tensor_cores(dev);
        let group = c.n_head / c.n_kv_head.max(1);
        let tc = mma
            && dev.kv_type == KvType::F16
            && c.head_dim == 128
            && c.n_head.is_multiple_of(c.n_kv_head.max(1));
        let attn_tc = match group {
            8 if tc => Some((Kernel::PfAttnTc, 16)),
            16 if tc => Some((Kernel::PfAttnTcG16, 8)),
            _ => None,
        };
        let [x, xq, xf, qkv, q, att, logits, ids, weights, list, counts, tiles, gu, hq, hf, y, f32_part, f32_count, route_done, bt_done, h_count] =
            buffer_floats(c, chunk);
        let f32_count = f(f32_count)?;
        f32_count.fill(dev, 0)?; // bt_f32rows' counters start at zero and end each launch there
        let route_done = f(route_done)?;
        route_done.fill(dev, 0)?; // bt_route's too
        let bt_done = f(bt_done)?;
        bt_done.fill(dev, 0)?; // and bt_attn_gqa_tc's
        let h_count = f(h_count)?;
        h_count.fill(dev, 0)?; // and the fused gate-and-up launches'
        Ok(Prefill {
            chunk,
            part_budget,
            mma,
            few_tokens,
            attn_tc,
            states: DevBuf::new(dev, chunk * std::mem::size_of::<StepState>())?,
            x: f(x)?,
            xq: f(xq)?,
            xf: f(xf)?,
            qkv: f(qkv)?,
            q: f(q)?,
            att: f(att)?,
            part: f(0)?,
            logits: f(logits)?,
            ids: f(ids)?,
            weights: f(weights)?,
            list: f(list)?,
            counts: f(counts)?,
            tiles: f(tiles)?,
            gu: f(gu)?,
            hq: f(hq)?,
            hf: f(hf)?,
            y: f(y)?,
            f32_part: f(f32_part)?,
            f32_count,
            route_done,
            bt_gqa: bt_gqa.filter(|_| attn_tc.is_some_and(|(k, _)| k == Kernel::PfAttnTc)),
            bt_done,
            h_count,
        })
    }

    /// Device bytes of `new` (the partials grow later, with the context).
    pub fn bytes(c: &Config, chunk: usize) -> usize {
        let floats: usize = buffer_floats(c, chunk).iter().sum();
        floats * 4 + chunk * std::mem::size_of::<StepState>()
    }

    /// Uploads the chunk's tokens and positions and makes room for its attention partials.
    pub fn load(&mut self, dev: &Device, c: &Config, tokens: &[u32], pos0: usize) -> Result<()> {
        let states: Vec<StepState> = (0..tokens.len())
            .map(|i| StepState {
                token: tokens[i],
                pos: (pos0 + i) as u32,
            })
            .collect();
        // pf_attn_tc keeps no partials.
        let len = pos0 + tokens.len();
        self.load_states(dev, c, &states, len, self.attn_tc.is_none())
            .map(|_| ())
    }

    /// Uploads the batched step's rows (each its token at its session's next position) and
    /// makes room for their attention partials at `len` positions at most; returns the
    /// partials' address.
    pub fn load_rows(
        &mut self,
        dev: &Device,
        c: &Config,
        rows: &[StepState],
        len: usize,
    ) -> Result<u64> {
        self.load_states(dev, c, rows, len, true)
    }

    /// Uploads the tokens' step states and, with `partials`, grows the attention partials for
    /// them at `len` positions (the old buffer freed first); returns the partials' address.
    fn load_states(
        &mut self,
        dev: &Device,
        c: &Config,
        states: &[StepState],
        len: usize,
        partials: bool,
    ) -> Result<u64> {
        self.states.upload(dev, 0, states)?;
        let part = states.len().min(self.part_tokens(c, len)) * part_bytes(c, len);
        if partials && part > self.part.bytes {
            self.part = DevBuf::new(dev, 0)?;
            self.part = DevBuf::new(dev, part)?;
        }
        Ok(self.part.ptr)
    }

    /// Tokens whose attention partials at `len` positions fit the budget.
    fn part_tokens(&self, c: &Config, len: usize) -> usize {
        (self.part_budget / part_bytes(c, len).max(1)).max(1)
    }

    /// Every layer for the `n` tokens `load` put up, which sit at positions pos0.. of `kv`.
    pub fn launches(&self, c: &Config, w: &Weights, kv: &Kv, pos0: usize, n: usize) -> Vec<Launch> {
        let keys = |l| Keys::Prompt(kv.layer(c, l), pos0);
        self.layers(c, w, keys, n, false)
    }

    /// The batched decode step (batch.rs) for the `n` rows `load_rows` put up: every layer,
    /// each token attending over its own session's cache (`tab` holds each layer's
    /// [n][2] cache addresses, layer after layer; `len` the longest context a row reaches),
    /// then the output head: logits[t * vocab + i] at `logits`.
    pub fn step_launches(
        &self,
        c: &Config,
        w: &Weights,
        (tab, len): (u64, usize),
        n: usize,
        logits: u64,
    ) -> Vec<Launch> {
        let layer_bytes = (n * 2 * 8) as u64;
        let keys = |l: usize| Keys::Rows(tab + l as u64 * layer_bytes, len);
        // The last layer's combine quantised the residual with the head's norm.
        let mut out = self.layers(c, w, keys, n, true);
        let head = self.dense(w.output, c.vocab_size, logits, c.vocab_size, n, false);
        out.push(named(head, "pf head"));
        out
    }

    /// The embedding and every layer; the last layer's experts only with `last_experts` (a
    /// prompt's chunk needs no output from them: only the keys and values matter).
    fn layers(
        &self,
        c: &Config,
        w: &Weights,
        keys: impl Fn(usize) -> Keys,
        n: usize,
        last_experts: bool,
    ) -> Vec<Launch> {
        let e = EmbedParams {
            w: w.embd,
            state: self.states.ptr,
            x: self.x.ptr,
        };
        let mut out = vec![Launch::new(
            Kernel::PfEmbed,
            "pf_embed",
            ((c.d_model as u32).div_ceil(THREADS), n as u32, 1),
            THREADS,
            0,
            &e,
            0,
        )];
        out.push(self.quant(c, self.x.ptr, w.layers[0].attn_norm, c.d_model, n));
        for (l, lw) in w.layers.iter().enumerate() {
            self.attention(c, lw, keys(l), n, &mut out);
            // The experts' combine quantises the residual for what follows: the next layer's
            // attention, or the head (`step_launches`).
            let next_norm = w
                .layers
                .get(l + 1)
                .map_or(w.output_norm, |next| next.attn_norm);
            if last_experts || l + 1 < w.layers.len() {
                self.experts(c, lw, n, next_norm, &mut out);
            }
        }
        out
    }

    /// Quantises `rows` activation rows of `k` values (RMSNorm'd with `norm` unless 0).
    fn quant(&self, c: &Config, src: u64, norm: u64, k: usize, rows: usize) -> Launch {
        quant_launch(src, norm, (self.xq.ptr, self.xf.ptr), k, rows, c.rms_eps)
    }

    /// Dense rows of `w` against the n quantised activation rows: out[t * stride + r].
    fn dense(&self, w: Qw, rows: usize, out: u64, stride: usize, n: usize, add: bool) -> Launch {
        let x = (self.xq.ptr, self.xf.ptr);
        let on = match is_f32(w.ty) {
            true => self.rows_on_f32(n),
            false => self.rows_on(n),
        };
        dense_launch(on, w, rows, x, (out, stride), n, add)
    }

    /// The F32 rows' kernel for a launch of `n` tokens: bt_f32rows up to F32_FEW tokens
    /// whatever few_tokens says (but 0: the pf kernels only).
    fn rows_on_f32(&self, n: usize) -> Rows {
        Rows::pick(
            self.mma,
            n <= self.few_tokens || (n <= F32_FEW && self.few_tokens > 0),
        )
    }

    fn attention(&self, c: &Config, lw: &LayerW, keys: Keys, n: usize, out: &mut Vec<Launch>) {
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let stride = q_dim + 2 * kv_dim;
        // The residual came quantised with lw.attn_norm (the embedding's launch after, or the
        // layer before's combine).
        let cols = [
            (lw.q, 0, q_dim),
            (lw.k, q_dim, kv_dim),
            (lw.v, q_dim + kv_dim, kv_dim),
        ];
        if self.rows_on(n) == Rows::Few && cols.iter().all(|c| splits(&c.0)) {
            let (xq, xf) = (self.xq.ptr, self.xf.ptr);
            let base = PfRowsParams {
                xq,
                xf,
                out_stride: stride as i32,
                n_dense: n as i32,
                ..Default::default()
            };
            let parts = cols.map(|(m, col, rows)| (m, rows, self.qkv.ptr + 4 * col as u64));
            out.push(named(
                few_launch(base, &parts, Groups::Each(1), None),
                "pf qkv",
            ));
        } else {
            for ((m, col, rows), name) in cols.into_iter().zip(["pf q", "pf k", "pf v"]) {
                let l = self.dense(m, rows, self.qkv.ptr + 4 * col as u64, stride, n, false);
                out.push(named(l, name));
            }
        }
        match (keys, self.bt_gqa) {
            // Its launch quantises its outputs too.
            (Keys::Rows(tab, len), Some(g)) => self.rows_attention_tc(c, lw, (tab, len), n, g, out),
            _ => {
                self.split_heads(c, lw, keys, n, out);
                out.push(self.quant(c, self.att.ptr, 0, q_dim, n));
            }
        }
        let o = self.dense(lw.o, c.d_model, self.x.ptr, c.d_model, n, true);
        out.push(named(o, "pf o"));
    }

    /// The n tokens' attention over their projections in `self.qkv` into `self.att`: norm and
    /// RoPE (appending the keys and values), then a prompt's on tensor cores where the shape
    /// has it, else the generic split chunks and their merge (the rows' forms for the batched
    /// step).
    fn split_heads(&self, c: &Config, lw: &LayerW, keys: Keys, n: usize, out: &mut Vec<Launch>) {
        let ((kc, vc), len) = match keys {
            Keys::Prompt(kv, pos0) => (kv, pos0 + n),
            // The rows' caches come from the table (bt_*); these two are unused.
            Keys::Rows(_, len) => ((0, 0), len),
        };
        let q_dim = c.q_dim();
        let r = rope_params(c, lw, (kc, vc), (self.qkv.ptr, self.q.ptr), self.states.ptr);
        let bufs = (self.q.ptr, self.part.ptr, self.att.ptr, self.states.ptr);
        let a = attn_params(c, (kc, vc), bufs, n_split(len));
        let kernels = [
            Kernel::PfQkNormRope,
            Kernel::PfAttnSplit,
            Kernel::PfAttnCombine,
        ];
        let [rope, ..] = split_attention(c, &r, &a, n as u32, kernels);
        out.push(match keys {
            Keys::Prompt(..) => rope,
            Keys::Rows(tab, _) => {
                rows_form(&rope, Kernel::BtQkNormRope, &BtRopeParams { r, kv: tab })
            }
        });
        if let (Keys::Prompt(..), Some((kernel, tokens))) = (keys, self.attn_tc) {
            let tc = AttnParams {
                n_split: n as i32,
                ..a
            };
            let grid = (c.n_kv_head as u32, n.div_ceil(tokens) as u32, 1);
            let name = kernel.symbol();
            out.push(Launch::new(kernel, name, grid, THREADS, PFA_SMEM, &tc, 0));
        } else {
            // The chunk's tokens in sub-batches whose partials fit the budget.
            let sub = self.part_tokens(c, len);
            for z0 in (0..n).step_by(sub) {
                let (qz, sz) = (
                    (z0 * q_dim * 4) as u64,
                    (z0 * size_of::<StepState>()) as u64,
                );
                let az = AttnParams {
                    q: a.q + qz,
                    out: a.out + qz,
                    state: a.state + sz,
                    ..a
                };
                let [_, split, combine] =
                    split_attention(c, &r, &az, sub.min(n - z0) as u32, kernels);
                let split = match keys {
                    Keys::Prompt(..) => split,
                    Keys::Rows(tab, _) => {
                        let kv = tab + (z0 * 2 * 8) as u64;
                        rows_form(&split, Kernel::BtAttnSplit, &BtAttnParams { a: az, kv })
                    }
                };
                out.extend([split, combine]);
            }
        }
    }

    /// The batched step's attention of `n` rows on tensor cores (bt_attn_gqa_tc: norm, RoPE,
    /// the KV append, the chunks and their merge in one launch, and the outputs quantised for
    /// the o projection as `quant` would without a norm), each row's cache in the table
    /// at `tab`, contexts up to `len`: in sub-batches whose partials fit the budget, as the
    /// generic path's (the partials are laid out as its: n_split(len) chunks a head).
    fn rows_attention_tc(
        &self,
        c: &Config,
        lw: &LayerW,
        (tab, len): (u64, usize),
        n: usize,
        g: BtGqa,
        out: &mut Vec<Launch>,
    ) {
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        // Each row's cache comes from the table: (0, 0) here.
        let bufs = [
            self.qkv.ptr,
            self.part.ptr,
            self.states.ptr,
            self.att.ptr,
            self.bt_done.ptr,
        ];
        let knobs = (g.max_blocks, g.min_span, g.stage);
        let p = gqa_params(c, lw, (0, 0), bufs, n_split(len), knobs);
        let blocks = att_rows(len, (g.min_span, g.stage), g.max_blocks) as u32;
        let smem = g.stage as u32 * ATT_TC_STAGE_BYTES;
        let stride = q_dim + 2 * kv_dim;
        let part_stride = (part_bytes(c, len) / 4) as u32;
        let sub = self.part_tokens(c, len);
        // A row's quantised groups and padded floats (bytes), as `quant` lays them out.
        let (xq_row, xf_row) = (4 * quant_words(q_dim) as u64, 4 * padded_len(q_dim) as u64);
        for z0 in (0..n).step_by(sub) {
            let z = z0 as u64;
            let b = BtGqaParams {
                g: AttnGqaParams {
                    qkv: p.qkv + 4 * z * stride as u64,
                    state: p.state + z * size_of::<StepState>() as u64,
                    out: p.out + 4 * z * q_dim as u64,
                    ..p
                },
                kv: tab + z * 2 * 8, // a row's K and V addresses
                qkv_stride: stride as u32,
                part_stride,
                xq: self.xq.ptr + z * xq_row,
                xf: self.xf.ptr + z * xf_row,
            };
            let grid = (c.n_kv_head as u32, blocks, sub.min(n - z0) as u32);
            let k = Kernel::BtAttnGqaTc;
            out.push(Launch::new(k, "bt_attn_gqa_tc", grid, 256, smem, &b, 0));
        }
    }

    /// The split types' kernel for a launch of `n` tokens (each group, dense or an expert, has
    /// at most n entries).
    fn rows_on(&self, n: usize) -> Rows {
        Rows::pick(self.mma, n <= self.few_tokens)
    }

    /// The layer's experts over the n tokens; `next_norm` the RMSNorm weights the residual is
    /// quantised with after them (the next launch's input).
    fn experts(&self, c: &Config, lw: &LayerW, n: usize, next_norm: u64, out: &mut Vec<Launch>) {
        self.route(c, lw, n, out);
        self.ffn(c, lw, n, next_norm, out);
    }

    /// The router's logits, each token's experts and weights, each expert's slots and the
    /// work list of their tiles.
    fn route(&self, c: &Config, lw: &LayerW, n: usize, out: &mut Vec<Launch>) {
        let (nu, ne) = (c.n_expert_used, c.n_expert);
        out.push(self.quant(c, self.x.ptr, lw.ffn_norm, c.d_model, n));
        let split = is_f32(lw.router.ty) && self.rows_on_f32(n) == Rows::Few && n <= F32_FEW;
        let router = match split {
            // A chain of each sum a block (bt_f32rows' split form): the buffers are the
            // router's, for up to F32_FEW tokens (few_tokens may say more).
            true => {
                let x = (self.xq.ptr, self.xf.ptr);
                let p = dense_params(lw.router, ne, x, (self.logits.ptr, ne), n, false);
                f32_few_launch(p, n, Some((self.f32_part.ptr, self.f32_count.ptr)))
            }
            false => self.dense(lw.router, ne, self.logits.ptr, ne, n, false),
        };
        out.push(named(router, "pf router"));
        let bufs = (self.logits.ptr, self.ids.ptr, self.weights.ptr);
        let lists = PfListsParams {
            ids: self.ids.ptr,
            list: self.list.ptr,
            counts: self.counts.ptr,
            tiles: self.tiles.ptr,
            tokens: n as i32,
            n_used: nu as i32,
            n_expert: ne as i32,
            list_cap: self.chunk as i32,
        };
        if self.rows_on(n) == Rows::Few && n * nu <= BT_ROUTE_SLOTS {
            // Both in one launch (bt_mma takes an expert or a slot a blockIdx.y: no work list).
            let p = BtRouteParams {
                t: topk_params(c, bufs),
                l: lists,
                done: self.route_done.ptr,
            };
            let grid = (n as u32, 1, 1);
            out.push(Launch::new(
                Kernel::BtRoute,
                "bt_route",
                grid,
                TOPK_THREADS,
                0,
                &p,
                0,
            ));
            return;
        }
        out.push(topk(c, Kernel::PfRoute, bufs, n as u32));
        out.push(Launch::new(
            Kernel::PfLists,
            "pf_lists",
            (ne as u32, 1, 1),
            THREADS,
            0,
            &lists,
            0,
        ));
        if self.rows_on(n) == Rows::Few {
            return; // bt_mma takes an expert a blockIdx.y: no work list
        }
        let tiles = Kernel::PfTiles;
        out.push(Launch::new(
            tiles,
            "pf_tiles",
            (1, 1, 1),
            THREADS,
            0,
            &lists,
            0,
        ));
    }

    /// The chosen experts' FFN over their slots (gate, up, silu(gate) * up, down), then each
    /// token's weighted sum into the residual.
    fn ffn(&self, c: &Config, lw: &LayerW, n: usize, next_norm: u64, out: &mut Vec<Launch>) {
        let (nu, ne, dff) = (c.n_expert_used, c.n_expert, c.d_ff_expert);
        let params =
            |w: Qw, rows: usize, (xq, xf): (u64, u64), o: u64, in_is_out: bool| PfRowsParams {
                w,
                xq,
                xf,
                out: o,
                list: self.list.ptr,
                counts: self.counts.ptr,
                tiles: self.tiles.ptr,
                rows: rows as i32,
                out_stride: if in_is_out { c.d_model } else { 2 * dff } as i32,
                list_cap: self.chunk as i32,
                in_is_out: in_is_out as i32,
                ..Default::default()
            };
        let on = self.rows_on(n);
        let slots = Groups::routed(self.ids.ptr, n * nu, ne);
        let grouped = |p: PfRowsParams| rows_launch(on, p, n * nu, slots);
        let x = (self.xq.ptr, self.xf.ptr);
        let up = self.gu.ptr + 4 * dff as u64;
        let gate = params(lw.gate, dff, x, self.gu.ptr, false);
        // Whether gate and up's launch quantises their product for down itself (bt_mma, whose
        // blocks are its groups' rows): then no pf_quant launch.
        let mut fused = false;
        if on == Rows::Few && splits(&lw.gate) && splits(&lw.up) {
            // One launch for both: gate's blocks, then up's.
            let parts = [(lw.gate, dff, self.gu.ptr), (lw.up, dff, up)];
            let h = swiglu_fuses(dff).then_some(Swiglu {
                hq: self.hq.ptr,
                hf: self.hf.ptr,
                count: self.h_count.ptr,
            });
            fused = h.is_some();
            out.push(named(few_launch(gate, &parts, slots, h), "pf gate_up"));
        } else {
            out.push(named(grouped(gate), "pf gate"));
            let l = grouped(params(lw.up, dff, x, up, false));
            out.push(named(l, "pf up"));
        }
        if !fused {
            let h = PfQuantParams {
                src: self.gu.ptr,
                norm: 0,
                xq: self.hq.ptr,
                xf: self.hf.ptr,
                n: dff as i32,
                stride: 2 * dff as i32,
                swiglu: 1,
                eps: c.rms_eps,
            };
            let smem = 4 * dff as u32;
            out.push(Launch::new(
                Kernel::PfQuant,
                "pf_quant",
                ((n * nu) as u32, 1, 1),
                THREADS,
                smem,
                &h,
                0,
            ));
        }
        let hs = (self.hq.ptr, self.hf.ptr);
        let down = grouped(params(lw.down, c.d_model, hs, self.y.ptr, true));
        out.push(named(down, "pf down"));
        out.push(self.combine(c, next_norm, n));
    }

    /// Each of the n tokens' weighted sum of its experts' outputs into the residual, quantised
    /// with `next_norm` for what follows.
    fn combine(&self, c: &Config, next_norm: u64, n: usize) -> Launch {
        let comb = PfCombineQuantParams {
            c: PfCombineParams {
                x: self.x.ptr,
                y: self.y.ptr,
                weights: self.weights.ptr,
                d: c.d_model as i32,
                n_used: c.n_expert_used as i32,
            },
            q: quant_params(
                self.x.ptr,
                next_norm,
                (self.xq.ptr, self.xf.ptr),
                c.d_model,
                c.rms_eps,
            ),
        };
        Launch::new(
            Kernel::PfCombineQuant,
            "pf_combine_quant",
            (n as u32, 1, 1),
            THREADS,
            0,
            &comb,
            0,
        )
    }
}

/// Whose keys and values a layer's attention reads and appends to.
#[derive(Clone, Copy)]
enum Keys {
    /// A prompt's chunk: the layer's (K, V) of one session, the chunk at positions pos0..
    Prompt((u64, u64), usize),
    /// The batched step's rows, each at its own session's next position: the device table of
    /// the rows' [n][2] cache addresses for the layer, and the longest context a row reaches.
    Rows(u64, usize),
}

/// `l`'s launch (grid, block) on the batched step's form of its kernel, with that form's params.
fn rows_form<P: Copy>(l: &Launch, kernel: Kernel, p: &P) -> Launch {
    Launch::new(kernel, kernel.symbol(), l.grid, l.block, l.smem, p, 0)
}

/// A weight launch under its matrix's name in the kernel profile (pf_mma or pf_rows runs it).
fn named(mut l: Launch, name: &'static str) -> Launch {
    l.name = name;
    l
}

/// Tiles of PFM_ENTRIES slots the experts of `tokens` tokens take at most (pf_tiles): each
/// expert's last tile may be partial.
fn max_tiles(c: &Config, tokens: usize) -> usize {
    (tokens * c.n_expert_used).div_ceil(PFM_ENTRIES) + c.n_expert
}

/// Attention chunks of a context of `len` positions.
pub(crate) fn n_split(len: usize) -> usize {
    len.div_ceil(ATT_CHUNK)
}

/// A token's attention partials at a context of `len` positions.
fn part_bytes(c: &Config, len: usize) -> usize {
    c.n_head * n_split(len) * (c.head_dim + 2) * 4
}
