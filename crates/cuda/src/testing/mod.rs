//! Single-kernel entry points for the unit tests (each kernel against a scalar host reference).
//! Not part of the stable API.

use q4moe_gguf::GgmlType;

use cudarc::driver::{result, sys};

use crate::device::Device;
use crate::graph::Graph;
use crate::kernel::Kernel;
use crate::launch::Launch;
use crate::memory::{DevBuf, Pinned};
use crate::params::*;
use crate::prefill;
use crate::repack::{aux_bytes, split_planes};
use crate::rows;
use crate::step::Mv;
use crate::Result;

/// What `TestDevice::o_proj_router` returns.
pub struct FoldOut {
    /// x + o attn
    pub x: Vec<f32>,
    /// Unscaled router logits (no RMSNorm factor)
    pub logits: Vec<f32>,
    /// The chosen experts and their logits, rank order
    pub ids: Vec<i32>,
    pub sel: Vec<f32>,
}

/// One attention launch's inputs (`TestDevice::attention`).
pub struct AttentionCase {
    pub n_kv_head: usize,
    /// The raw projections [q_dim + 2 * kv_dim].
    pub qkv: Vec<f32>,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    /// [capacity, kv_dim] f16 bits: rows before `pos` are the context.
    pub k_cache: Vec<u16>,
    pub v_cache: Vec<u16>,
    pub pos: usize,
    pub scale: f32,
    pub eps: f32,
    pub theta: f32,
    pub max_blocks: usize,
    pub min_span: usize,
    /// Tiles a warp stages in shared memory (tensor cores only; AttnGqaParams::stage).
    pub stage: usize,
}

/// What `TestDevice::step_boundary` measured: microseconds a step.
pub struct StepBoundary {
    pub bare: f64,
    pub evented: f64,
    pub copied: f64,
    pub joined: f64,
}

/// What `TestDevice::attention` returns.
pub struct AttentionOut {
    pub out: Vec<f32>,
    pub k_row: Vec<u16>,
    pub v_row: Vec<u16>,
}

pub struct TestDevice {
    dev: Device,
}

impl TestDevice {
    pub fn new() -> Result<TestDevice> {
        Ok(TestDevice {
            dev: Device::new(&crate::CudaOptions::default())?,
        })
    }

    fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf> {
        let b = DevBuf::new(&self.dev, std::mem::size_of_val(data))?;
        b.upload(&self.dev, 0, data)?;
        Ok(b)
    }

    /// A poisoned (NaN-filled) output buffer of n floats.
    fn poisoned(&self, n: usize) -> Result<DevBuf> {
        let b = DevBuf::new(&self.dev, n * 4)?;
        b.fill(&self.dev, 0xff)?;
        Ok(b)
    }

    fn read(&self, b: &DevBuf, n: usize) -> Result<Vec<f32>> {
        let mut v = vec![0f32; n];
        b.download(&self.dev, 0, &mut v)?;
        Ok(v)
    }

    /// Uploads a matrix of `rows` rows of `k` elements in its ggml bytes, as the backend does.
    fn weight(&self, ty: GgmlType, bytes: &[u8], k: usize) -> Result<(Qw, Vec<DevBuf>)> {
        if let Some((nibbles, aux)) = split_planes(ty, bytes) {
            let (a, b) = (self.upload(&nibbles)?, self.upload(&aux)?);
            return Ok((
                Qw {
                    data: a.ptr,
                    scales: b.ptr,
                    ty: ty.id() as i32,
                    k: k as i32,
                },
                vec![a, b],
            ));
        }
        let a = self.upload(bytes)?;
        Ok((
            Qw {
                data: a.ptr,
                scales: 0,
                ty: ty.id() as i32,
                k: k as i32,
            },
            vec![a],
        ))
    }

    /// y = W x (with optional fused RMSNorm of x), through the `matvec` kernel; with `walk`, one
    /// matrix whose rows at most that many blocks walk, as the output head's launch
    /// (step::looped).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        k: usize,
        x: &[f32],
        norm: Option<(&[f32], f32)>,
        walk: Option<u32>,
    ) -> Result<Vec<f32>> {
        let (w, _keep) = self.weight(ty, bytes, k)?;
        let xb = self.upload(x)?;
        let nb = norm.map(|(n, _)| self.upload(n)).transpose()?;
        let out = self.poisoned(rows)?;
        let norm_ptr = nb.as_ref().map_or(0, |b| b.ptr);
        let eps = norm.map_or(0.0, |n| n.1);
        // Two matrices (the same weights) when the rows split evenly: exercises the multi-matrix
        // row mapping of the staged modes as the QKV launch uses it.
        let half = rows / 2;
        let l = if walk.is_none() && rows.is_multiple_of(8) && half > 0 {
            let mut w2 = w;
            w2.data += (half * ty.row_bytes(k).unwrap()) as u64;
            if let Some(aux) = aux_bytes(ty, half * (k / 32)) {
                w2.data = w.data + (half * (k / 32) * 16) as u64;
                w2.scales = w.scales + aux as u64;
            }
            let ws = [
                (w, out.ptr, half),
                (w2, out.ptr + 4 * half as u64, rows - half),
            ];
            let m = Mv {
                norm: norm_ptr,
                eps,
                ..Mv::new(&ws, xb.ptr, k)
            };
            crate::step::matvec("matvec", &m)
        } else {
            let ws = [(w, out.ptr, rows)];
            let m = Mv {
                norm: norm_ptr,
                eps,
                ..Mv::new(&ws, xb.ptr, k)
            };
            crate::step::looped(crate::step::matvec("matvec", &m), walk.unwrap_or(0))
        };
        self.dev.launch(&l)?;
        self.dev.sync()?;
        self.read(&out, rows)
    }

    /// The output head with the greedy choice in its tail (step::head_argmax): the rows
    /// (RMSNorm of `x` by `norm`) walked by at most `blocks` blocks; the logits it wrote and the
    /// state it left (pos 7 -> 8), the state also published into a host-mapped ring.
    pub fn head_argmax(
        &self,
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        x: &[f32],
        norm: (&[f32], f32),
        blocks: u32,
    ) -> Result<(Vec<f32>, StepState)> {
        let k = x.len();
        let (w, _keep) = self.weight(ty, bytes, k)?;
        let (xb, nb) = (self.upload(x)?, self.upload(norm.0)?);
        let out = self.poisoned(rows)?;
        let (pv, pi) = (
            self.poisoned(blocks as usize)?,
            self.poisoned(blocks as usize)?,
        );
        let st = self.upload(&[StepState { token: 3, pos: 7 }])?;
        let counter = self.upload(&[0u32])?;
        let ring = Pinned::<StepState>::mapped(STATE_RING)?;
        let ws = [(w, out.ptr, rows)];
        let m = Mv {
            norm: nb.ptr,
            eps: norm.1,
            ..Mv::new(&ws, xb.ptr, k)
        };
        let am = ArgmaxParams {
            part_v: pv.ptr,
            part_i: pi.ptr,
            state: st.ptr,
            publish: ring.device_ptr(),
            n: rows as i32,
            ..Default::default()
        };
        let l = crate::step::head_argmax(&m, blocks, am, counter.ptr).expect("a staged type walks");
        self.dev.launch(&l)?;
        self.dev.sync()?;
        let mut s = [StepState::default()];
        st.download(&self.dev, 0, &mut s)?;
        let mut left = [1u32];
        counter.download(&self.dev, 0, &mut left)?;
        assert_eq!(left[0], 0, "the last block resets the counter");
        assert_eq!(ring.read_state(7), s[0], "published state");
        Ok((self.read(&out, rows)?, s[0]))
    }

    /// `n` activation rows `x` ([n, k]) through pf_quant and the batched prefill's weight rows
    /// (pf_mma, pf_f32rows or pf_rows: the kernel prefill.rs picks for the type and device; with
    /// `few`, bt_mma and bt_f32rows where it would pick pf_mma and pf_f32rows): out[t * rows
    /// + r].
    pub fn prefill_rows(
        &self,
        ty: GgmlType,
        bytes: &[u8],
        (rows, k): (usize, usize),
        x: &[f32],
        few: bool,
    ) -> Result<Vec<f32>> {
        let n = x.len() / k;
        let (w, _keep) = self.weight(ty, bytes, k)?;
        let xb = self.upload(x)?;
        let xq = DevBuf::new(&self.dev, n * rows::quant_words(k) * 4)?;
        let xf = DevBuf::new(&self.dev, n * rows::padded_len(k) * 4)?;
        let out = self.poisoned(n * rows)?;
        let acts = (xq.ptr, xf.ptr);
        self.dev
            .launch(&rows::quant_launch(xb.ptr, 0, acts, k, n, 1e-6))?;
        let on = rows::Rows::pick(prefill::tensor_cores(&self.dev), few);
        let l = rows::dense_launch(on, w, rows, acts, (out.ptr, rows), n, false);
        self.dev.launch(&l)?;
        self.dev.sync()?;
        self.read(&out, n * rows)
    }

    /// F32 rows ([rows, k] little-endian f32 `bytes`) against `n` activation rows `x` through
    /// bt_f32rows' split form (a chain of each sum a block, the last block of a tile adding
    /// them), launched twice on the same counters: both outputs (out[t * rows + r]).
    pub fn f32_rows_split(
        &self,
        bytes: &[u8],
        (rows, k): (usize, usize),
        x: &[f32],
    ) -> Result<[Vec<f32>; 2]> {
        let n = x.len() / k;
        let (w, _keep) = self.weight(GgmlType::F32, bytes, k)?;
        let xb = self.upload(x)?;
        let xq = DevBuf::new(&self.dev, n * rows::quant_words(k) * 4)?;
        let xf = DevBuf::new(&self.dev, n * rows::padded_len(k) * 4)?;
        self.dev
            .launch(&rows::quant_launch(xb.ptr, 0, (xq.ptr, xf.ptr), k, n, 1e-6))?;
        let (part, count) = rows::f32_split_sizes(rows, k, n);
        let (part, count) = (
            DevBuf::new(&self.dev, part * 4)?,
            DevBuf::new(&self.dev, count * 4)?,
        );
        count.fill(&self.dev, 0)?;
        let mut outs = [Vec::new(), Vec::new()];
        for o in &mut outs {
            let out = self.poisoned(n * rows)?;
            let p = rows::dense_params(w, rows, (xq.ptr, xf.ptr), (out.ptr, rows), n, false);
            self.dev
                .launch(&rows::f32_few_launch(p, n, Some((part.ptr, count.ptr))))?;
            self.dev.sync()?;
            *o = self.read(&out, n * rows)?;
        }
        Ok(outs)
    }

    /// `n` activation rows `x` ([n, k]) against up to three matrices (`parts`: type, ggml bytes,
    /// rows) side by side in one output ([n][sum of rows], a part's columns after the one
    /// before's): (bt_mma' one launch over all parts, pf_mma a launch each). sm_80+.
    pub fn rows_parts(
        &self,
        parts: &[(GgmlType, &[u8], usize)],
        k: usize,
        x: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = x.len() / k;
        let total: usize = parts.iter().map(|p| p.2).sum();
        let mut keep = Vec::new();
        let mut ws = Vec::new();
        for &(ty, bytes, rows) in parts {
            let (w, bufs) = self.weight(ty, bytes, k)?;
            keep.extend(bufs);
            ws.push((w, rows));
        }
        let xb = self.upload(x)?;
        let xq = DevBuf::new(&self.dev, n * rows::quant_words(k) * 4)?;
        let xf = DevBuf::new(&self.dev, n * rows::padded_len(k) * 4)?;
        let acts = (xq.ptr, xf.ptr);
        self.dev
            .launch(&rows::quant_launch(xb.ptr, 0, acts, k, n, 1e-6))?;
        let (fused, apart) = (self.poisoned(n * total)?, self.poisoned(n * total)?);
        let base = PfRowsParams {
            xq: xq.ptr,
            xf: xf.ptr,
            out_stride: total as i32,
            n_dense: n as i32,
            ..Default::default()
        };
        let mut col = 0u64;
        let mut fused_parts = Vec::new();
        for &(w, rows) in &ws {
            fused_parts.push((w, rows, fused.ptr + 4 * col));
            let l = rows::dense_launch(
                rows::Rows::Mma,
                w,
                rows,
                acts,
                (apart.ptr + 4 * col, total),
                n,
                false,
            );
            self.dev.launch(&l)?;
            col += rows as u64;
        }
        self.dev.launch(&rows::few_launch(
            base,
            &fused_parts,
            rows::Groups::Each(1),
            None,
        ))?;
        self.dev.sync()?;
        Ok((self.read(&fused, n * total)?, self.read(&apart, n * total)?))
    }

    /// Row `token` of a matrix in ggml's bytes, through the `embed` kernel (weight_at).
    pub fn embed(&self, ty: GgmlType, bytes: &[u8], k: usize, token: u32) -> Result<Vec<f32>> {
        let (w, _keep) = self.weight(ty, bytes, k)?;
        let st = self.upload(&[StepState { token, pos: 0 }])?;
        let out = self.poisoned(k)?;
        let p = EmbedParams {
            w,
            state: st.ptr,
            x: out.ptr,
        };
        let blocks = k.div_ceil(256) as u32;
        self.dev.launch(&Launch::new(
            Kernel::Embed,
            "embed",
            (blocks, 1, 1),
            256,
            0,
            &p,
            0,
        ))?;
        self.dev.sync()?;
        self.read(&out, k)
    }

    /// o_proj with the folded router on one layer's inputs: the fold of `o` (rows d_model of
    /// k = attn.len(), ggml bytes of `ty`), `router` (F32 [n_expert, d_model]) and `norm` built
    /// by router_fold_build, then the o_proj_router launch, twice (after launch n the epoch and
    /// every slot's tag must read n). Returns (x + o attn, unscaled logits, ids, their logits).
    #[allow(clippy::too_many_arguments)]
    pub fn o_proj_router(
        &self,
        ty: GgmlType,
        o_bytes: &[u8],
        router: &[f32],
        norm: &[f32],
        x: &[f32],
        attn: &[f32],
        n_used: usize,
    ) -> Result<FoldOut> {
        let (d_model, q_dim) = (x.len(), attn.len());
        let n_expert = router.len() / d_model;
        let (o, _keep) = self.weight(ty, o_bytes, q_dim)?;
        let (rb, nb) = (self.upload(router)?, self.upload(norm)?);
        let (xb, ab) = (self.upload(x)?, self.upload(attn)?);
        let fold = self.poisoned(n_expert * q_dim)?;
        let fp = FoldBuildParams {
            o,
            router: rb.ptr,
            norm: nb.ptr,
            out: fold.ptr,
            d_model: d_model as i32,
            q_dim: q_dim as i32,
        };
        crate::weights::build_fold(&self.dev, &fp, n_expert)?;
        let x_out = self.poisoned(d_model)?;
        let (ids, sel) = (self.poisoned(n_used)?, self.poisoned(n_used)?);
        let (slots, epoch) = (
            DevBuf::new(&self.dev, 8 * n_expert)?,
            DevBuf::new(&self.dev, 4)?,
        );
        slots.fill(&self.dev, 0)?;
        epoch.fill(&self.dev, 0)?;
        let r = RouterFold {
            w: rb.ptr,
            fold: fold.ptr,
            norm: nb.ptr,
            x: xb.ptr,
            slots: slots.ptr,
            ids: ids.ptr,
            sel: sel.ptr,
            epoch: epoch.ptr,
            n_expert: n_expert as i32,
            d_model: d_model as i32,
            q_dim: q_dim as i32,
            n_used: n_used as i32,
        };
        let rq = Qw {
            data: rb.ptr,
            ty: GgmlType::F32.id() as i32,
            k: d_model as i32,
            ..Default::default()
        };
        let l = crate::step::o_proj_router(o, &rq, ab.ptr, x_out.ptr, r).ok_or_else(|| {
            crate::CudaError::Unsupported(format!("o_proj_router: {ty:?} has no staged mode"))
        })?;
        let (mut tag, mut sv) = ([0u32], vec![0u64; n_expert]);
        for launch in 1..=2u32 {
            self.dev.launch(&l)?;
            self.dev.sync()?;
            epoch.download(&self.dev, 0, &mut tag)?;
            slots.download(&self.dev, 0, &mut sv)?;
            if let Some(bad) = std::iter::once(tag[0])
                .chain(sv.iter().map(|v| (v >> 32) as u32))
                .find(|&t| t != launch)
            {
                return Err(crate::CudaError::Unsupported(format!(
                    "o_proj_router launch {launch} left a tag of {bad} (epoch {})",
                    tag[0]
                )));
            }
        }
        let mut iv = vec![0i32; n_used];
        ids.download(&self.dev, 0, &mut iv)?;
        Ok(FoldOut {
            x: self.read(&x_out, d_model)?,
            logits: sv.iter().map(|&v| f32::from_bits(v as u32)).collect(),
            ids: iv,
            sel: self.read(&sel, n_used)?,
        })
    }

    /// Router softmax + top-k (+ renormalisation): returns (ids, weights).
    pub fn topk(&self, logits: &[f32], n_used: usize, norm: bool) -> Result<(Vec<i32>, Vec<f32>)> {
        let lb = self.upload(logits)?;
        let (ids, ws) = (self.poisoned(n_used)?, self.poisoned(n_used)?);
        let p = TopkParams {
            logits: lb.ptr,
            ids: ids.ptr,
            weights: ws.ptr,
            n_expert: logits.len() as i32,
            n_used: n_used as i32,
            norm_topk: norm as i32,
        };
        self.dev.launch(&Launch::new(
            Kernel::MoeTopk,
            "moe_topk",
            (1, 1, 1),
            crate::step::TOPK_THREADS,
            0,
            &p,
            0,
        ))?;
        self.dev.sync()?;
        let mut iv = vec![0i32; n_used];
        ids.download(&self.dev, 0, &mut iv)?;
        Ok((iv, self.read(&ws, n_used)?))
    }

    /// A captured graph of `n` dependent `pdl_probe` launches of `blocks` x `threads`, replayed
    /// `reps` times after one warm-up: microseconds a launch (event-timed) and the probe's final
    /// count (n x (reps + 1) when every launch ran).
    pub fn launch_chain(
        &self,
        n: usize,
        blocks: u32,
        threads: u32,
        reps: usize,
    ) -> Result<(f64, u32)> {
        let cell = self.upload(&[0u32])?;
        let graph = self.probe_graph(n, blocks, threads, cell.ptr)?;
        graph.launch(&self.dev)?;
        self.dev.sync()?;
        let ms = self
            .dev
            .time_ms(|| (0..reps).try_for_each(|_| graph.launch(&self.dev)))?;
        let mut count = [0u32];
        cell.download(&self.dev, 0, &mut count)?;
        Ok((ms as f64 * 1e3 / (n * reps) as f64, count[0]))
    }

    /// What the stream costs between two decode steps, apart from their kernels: microseconds a
    /// replay of a graph of `n` probe launches (a step), replayed back to back (`bare`), each
    /// replay followed by the 8-byte device-to-host copy and the two event records the copy
    /// read-back puts after a step (`copied`), and a graph of 2n launches per two steps
    /// (`joined`: no boundary between them).
    pub fn step_boundary(&self, n: usize, blocks: u32, reps: usize) -> Result<StepBoundary> {
        let cell = self.upload(&[0u32])?;
        let one = self.probe_graph(n, blocks, 256, cell.ptr)?;
        let two = self.probe_graph(2 * n, blocks, 256, cell.ptr)?;
        let state = self.upload(&[StepState::default()])?;
        let mut host = Pinned::<StepState>::new(1)?;
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let (e0, e1) = (result::event::create(flags)?, result::event::create(flags)?);
        let stream = self.dev.stream;
        let mut step = |copy: bool| -> Result<()> {
            // SAFETY: our events and one pinned StepState, copied in stream order.
            unsafe {
                result::event::record(e0, stream)?;
                one.launch(&self.dev)?;
                if copy {
                    result::memcpy_dtoh_async(host.all(), state.ptr, stream)?;
                }
                result::event::record(e1, stream)?;
            }
            Ok(())
        };
        let time = |work: &mut dyn FnMut() -> Result<()>, per: usize| -> Result<f64> {
            work()?;
            self.dev.sync()?;
            let ms = self.dev.time_ms(|| (0..reps).try_for_each(|_| work()))?;
            Ok(ms as f64 * 1e3 / (reps * per) as f64)
        };
        let out = StepBoundary {
            bare: time(&mut || one.launch(&self.dev), 1)?,
            evented: time(&mut || step(false), 1)?,
            copied: time(&mut || step(true), 1)?,
            joined: time(&mut || two.launch(&self.dev), 2)?,
        };
        // SAFETY: created above, no longer recorded.
        unsafe {
            let _ = result::event::destroy(e0);
            let _ = result::event::destroy(e1);
        }
        Ok(out)
    }

    fn probe_graph(&self, n: usize, blocks: u32, threads: u32, cell: u64) -> Result<Graph> {
        let p = ProbeParams { cell };
        let launches: Vec<Launch> = (0..n)
            .map(|_| {
                Launch::new(
                    Kernel::PdlProbe,
                    "pdl_probe",
                    (blocks, 1, 1),
                    threads,
                    0,
                    &p,
                    0,
                )
            })
            .collect();
        Graph::capture(&self.dev, &launches)
    }

    /// Qwen3-shape attention (head_dim 128, 8 query heads a KV head) at position `pos` over an
    /// f16 cache of `capacity` rows, through `attn_gqa_128_8_tc` (`tensor_cores`) or
    /// `attn_gqa_128_8`: the heads' outputs [n_head * 128] and the cache rows the kernel wrote
    /// at `pos` (K, V as f16 bits).
    pub fn attention(&self, a: &AttentionCase, tensor_cores: bool) -> Result<AttentionOut> {
        let (kv_dim, n_head) = (a.n_kv_head * 128, a.n_kv_head * 8);
        let capacity = a.k_cache.len() / kv_dim;
        let n_split = capacity.div_ceil(ATT_CHUNK);
        let (kc, vc) = (self.upload(&a.k_cache)?, self.upload(&a.v_cache)?);
        let (qkv, qn, kn) = (
            self.upload(&a.qkv)?,
            self.upload(&a.q_norm)?,
            self.upload(&a.k_norm)?,
        );
        let state = self.upload(&[StepState {
            token: 0,
            pos: a.pos as u32,
        }])?;
        let part = self.poisoned(n_head * n_split * 130)?;
        let done = self.upload(&vec![0u32; a.n_kv_head + n_head])?;
        let out = self.poisoned(n_head * 128)?;
        let p = AttnGqaParams {
            qkv: qkv.ptr,
            q_norm: qn.ptr,
            k_norm: kn.ptr,
            k_cache: kc.ptr,
            v_cache: vc.ptr,
            part: part.ptr,
            state: state.ptr,
            out: out.ptr,
            done: done.ptr,
            n_head: n_head as i32,
            n_kv_head: a.n_kv_head as i32,
            head_dim: 128,
            n_split: n_split as i32,
            scale: a.scale,
            eps: a.eps,
            theta: a.theta,
            max_blocks: a.max_blocks as i32,
            min_span: a.min_span as i32,
            stage: if tensor_cores { a.stage as i32 } else { 0 },
        };
        let k = if tensor_cores {
            Kernel::AttnGqa128x8Tc
        } else {
            Kernel::AttnGqa128x8
        };
        let grid = (a.n_kv_head as u32, a.max_blocks.min(n_split) as u32, 1);
        let smem = p.stage as u32 * ATT_TC_STAGE_BYTES;
        self.dev
            .launch(&Launch::new(k, "attn_gqa", grid, 256, smem, &p, 0))?;
        self.dev.sync()?;
        let row = |b: &DevBuf| -> Result<Vec<u16>> {
            let mut v = vec![0u16; kv_dim];
            b.download(&self.dev, a.pos * kv_dim * 2, &mut v)?;
            Ok(v)
        };
        Ok(AttentionOut {
            out: self.read(&out, n_head * 128)?,
            k_row: row(&kc)?,
            v_row: row(&vc)?,
        })
    }

    /// Greedy choice over `logits` through both arg-max stages, the new state published into a
    /// host-mapped ring as the decode's mapped read-back has it (checked against the device's).
    pub fn argmax(&self, logits: &[f32]) -> Result<u32> {
        let lb = self.upload(logits)?;
        let (pv, pi) = (self.poisoned(128)?, self.poisoned(128)?);
        let pos = STATE_RING + 5; // a slot other than the position itself
        let st = self.upload(&[StepState {
            token: 12345,
            pos: pos as u32,
        }])?;
        let ring = Pinned::<StepState>::mapped(STATE_RING)?;
        let p = ArgmaxParams {
            logits: lb.ptr,
            part_v: pv.ptr,
            part_i: pi.ptr,
            state: st.ptr,
            publish: ring.device_ptr(),
            n: logits.len() as i32,
            n_blocks: 128,
        };
        self.dev.launch(&Launch::new(
            Kernel::ArgmaxPartial,
            "argmax",
            (128, 1, 1),
            256,
            0,
            &p,
            0,
        ))?;
        self.dev.launch(&Launch::new(
            Kernel::ArgmaxFinal,
            "argmax",
            (1, 1, 1),
            128,
            0,
            &p,
            0,
        ))?;
        let mut s = [StepState::default()];
        st.download(&self.dev, 0, &mut s)?;
        assert_eq!(s[0].pos as usize, pos + 1, "arg-max advances the position");
        for slot in 0..STATE_RING {
            let want = match slot == pos % STATE_RING {
                true => s[0],
                false => StepState::default(),
            };
            assert_eq!(ring.read_state(slot), want, "published slot {slot}");
        }
        Ok(s[0].token)
    }

    /// The batched step's greedy choice (bt_argmax) over `rows` rows of `logits`, one token a
    /// row (BT_NON_FINITE where the row holds a NaN or an infinity).
    pub fn bt_argmax(&self, logits: &[f32], rows: usize) -> Result<Vec<u32>> {
        let lb = self.upload(logits)?;
        let tokens = self.poisoned(rows)?;
        let p = BtArgmaxParams {
            logits: lb.ptr,
            tokens: tokens.ptr,
            n: (logits.len() / rows) as i32,
            pad: 0,
        };
        let k = Kernel::BtArgmax;
        let grid = (rows as u32, 1, 1);
        self.dev
            .launch(&Launch::new(k, "bt_argmax", grid, 1024, 0, &p, 0))?;
        self.dev.sync()?;
        let mut out = vec![0u32; rows];
        tokens.download(&self.dev, 0, &mut out)?;
        Ok(out)
    }

    /// `draws` device samples of one logits vector, the RNG state carried from draw to draw
    /// (starting at `params.seed`) and the penalties' counts from `history` and the draws, as
    /// a decode would (the logits fresh each draw, as the host sampler is given them); None
    /// when the device sampler does not take these settings.
    pub fn sample(
        &self,
        logits: &[f32],
        params: &q4moe_model::sampling::SamplingParams,
        history: &[u32],
        draws: usize,
    ) -> Result<Option<Vec<u32>>> {
        let Some(cfg) = crate::step::sample_config(params) else {
            return Ok(None);
        };
        let n = logits.len();
        let lb = self.upload(logits)?;
        let (cb, rng) = (self.upload(&[cfg])?, self.upload(&[params.seed])?);
        let st = self.upload(&[StepState { token: 0, pos: 0 }])?;
        let host = q4moe_model::sampling::Sampler::new(params.clone(), history);
        let counts = self.upload(&host.counts(n))?;
        let (work, finite, nucleus) = crate::step::sample_bytes(n);
        let (work, finite) = (self.poisoned(work / 4)?, self.poisoned(finite / 4)?);
        let nucleus = self.poisoned(nucleus / 4)?;
        let p = SampleParams {
            logits: lb.ptr,
            state: st.ptr,
            cfg: cb.ptr,
            rng: rng.ptr,
            work: work.ptr,
            finite: finite.ptr,
            nucleus: nucleus.ptr,
            counts: counts.ptr,
            n: n as i32,
            ..Default::default()
        };
        let pen =
            |k: Kernel, grid: usize| Launch::new(k, "sample", (grid as u32, 1, 1), 256, 0, &p, 0);
        let mut out = Vec::with_capacity(draws);
        for i in 0..draws {
            lb.upload(&self.dev, 0, logits)?;
            if params.has_penalties() {
                self.dev
                    .launch(&pen(Kernel::SamplePenalize, n.div_ceil(256)))?;
            }
            for l in crate::step::sample(p, n) {
                self.dev.launch(&l)?;
            }
            if params.has_penalties() {
                self.dev.launch(&pen(Kernel::SampleCount, 1))?;
            }
            let mut s = [StepState::default()];
            st.download(&self.dev, 0, &mut s)?;
            assert_eq!(s[0].pos as usize, i + 1, "sampling advances the position");
            out.push(s[0].token);
        }
        Ok(Some(out))
    }
}

mod moe;
pub use moe::{DownCase, DownFold, DownMode, GateUpCase, GateUpMode, Quant};
