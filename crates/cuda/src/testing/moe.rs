//! The experts' kernels (moe.cu moe_gate_up / moe_down) through `TestDevice`, every mode, for
//! tests/moe_kernels.rs.

use q4moe_gguf::GgmlType;

use super::TestDevice;
use crate::kernel::Kernel;
use crate::launch::Launch;
use crate::params::*;
use crate::Result;

pub use crate::kernel::{DownMode, GateUpMode, Quant};

/// One moe_gate_up launch's inputs (`TestDevice::moe_gate_up`).
pub struct GateUpCase<'a> {
    pub ty: GgmlType,
    /// [n_expert * d_ff, d_model] each, ggml bytes of `ty`: expert e's row r is row e * d_ff + r
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub d_ff: usize,
    /// [d_model]: the residual, which the staged modes normalise by `norm`; for
    /// GateUpMode::Generic the normalised input itself (the router wrote it)
    pub x: &'a [f32],
    /// [d_model] the FFN's RMSNorm weight
    pub norm: &'a [f32],
    pub eps: f32,
    /// [n_used] each slot's expert
    pub ids: &'a [i32],
}

/// The folded router's side of moe_down (DownParams::slots): the chosen experts' weights come
/// from their unscaled logits and the residual's RMS factor (moe.cu fold_weights).
pub struct DownFold<'a> {
    /// [n_expert] every expert's unscaled logit (the router's slots)
    pub logits: &'a [f32],
    pub norm_topk: bool,
    pub eps: f32,
}

/// One moe_down launch's inputs (`TestDevice::moe_down`).
pub struct DownCase<'a> {
    pub ty: GgmlType,
    /// [n_expert * d_model, d_ff] ggml bytes of `ty`: expert e's row r is row e * d_model + r
    pub down: &'a [u8],
    /// [n_used, d_ff] the slots' silu(gate) * up
    pub h: &'a [f32],
    /// [d_model] the residual the sums are added to
    pub x: &'a [f32],
    /// [n_used] each slot's expert
    pub ids: &'a [i32],
    /// [n_used] each slot's weight; with `fold`, the chosen experts' unscaled logits, rank order
    pub weights: &'a [f32],
    pub fold: Option<DownFold<'a>>,
}

/// Floats of moe.cu's shared input staging (red, then k values padded to XS = 36 per 32), where
/// the experts' scratch starts (step's smem_x).
fn staged_x_floats(k: usize) -> usize {
    (k / 32) * 36 + 72
}

impl TestDevice {
    /// h = silu(W_gate x) * (W_up x) [n_used, d_ff] through moe_gate_up's kernel of `mode`, each
    /// slot's grid `cols` wide at most (None: a block a unit; fewer: the blocks walk the units).
    pub fn moe_gate_up(
        &self,
        c: &GateUpCase,
        mode: GateUpMode,
        cols: Option<u32>,
    ) -> Result<Vec<f32>> {
        let (k, n_used) = (c.x.len(), c.ids.len());
        let (gate, _g) = self.weight(c.ty, c.gate, k)?;
        let (up, _u) = self.weight(c.ty, c.up, k)?;
        let (xb, nb, ids) = (self.upload(c.x)?, self.upload(c.norm)?, self.upload(c.ids)?);
        let ws = self.upload(&vec![1f32; n_used])?;
        let h = self.poisoned(n_used * c.d_ff)?;
        let rows_per_warp = if mode == GateUpMode::Q4_0Rows2 { 2 } else { 1 };
        let scratch = staged_x_floats(k);
        let p = GateUpParams {
            gate,
            up,
            xn: xb.ptr,
            h: h.ptr,
            norm: nb.ptr,
            experts: Experts {
                ids: ids.ptr,
                weights: ws.ptr,
                n_used: n_used as i32,
                scratch: scratch as i32,
            },
            d_ff: c.d_ff as i32,
            rows_per_warp: rows_per_warp as i32,
            eps: c.eps,
        };
        let units = c.d_ff.div_ceil(8 * rows_per_warp) as u32;
        let grid = (cols.map_or(units, |n| units.min(n)), n_used as u32, 1);
        // the input, the experts (64 floats), the norm weights
        let smem = (4 * (scratch + 64 + k)) as u32;
        let l = Launch::new(
            Kernel::MoeGateUp(mode),
            "moe_gate_up",
            grid,
            256,
            smem,
            &p,
            0,
        );
        self.dev.launch(&l)?;
        self.dev.sync()?;
        self.read(&h, n_used * c.d_ff)
    }

    /// x + sum over the slots of weight * W_down h [d_model] through moe_down's kernel of `mode`.
    pub fn moe_down(&self, c: &DownCase, mode: DownMode) -> Result<Vec<f32>> {
        let (d_model, n_used) = (c.x.len(), c.ids.len());
        let d_ff = c.h.len() / n_used;
        let (down, _d) = self.weight(c.ty, c.down, d_ff)?;
        let (hb, xb, ids) = (self.upload(c.h)?, self.upload(c.x)?, self.upload(c.ids)?);
        let ws = self.upload(c.weights)?;
        let slots: Vec<u64> = c.fold.as_ref().map_or(vec![0], |f| {
            let tagged = |v: &f32| 1u64 << 32 | v.to_bits() as u64;
            f.logits.iter().map(tagged).collect()
        });
        let sb = self.upload(&slots)?;
        let out = self.poisoned(d_model)?;
        // h staged as padded floats (the generic mode; the staged ones' groups take less), then
        // the experts (64 floats) and fold_weights' sums (32)
        let h_floats = n_used * (d_ff / 32) * 36;
        let p = DownParams {
            down,
            h: hb.ptr,
            x: xb.ptr,
            out: out.ptr,
            slots: if c.fold.is_some() { sb.ptr } else { 0 },
            experts: Experts {
                ids: ids.ptr,
                weights: ws.ptr,
                n_used: n_used as i32,
                scratch: h_floats as i32,
            },
            d_model: d_model as i32,
            n_used: n_used as i32,
            rows_per_warp: 1,
            n_expert: c.fold.as_ref().map_or(0, |f| f.logits.len() as i32),
            norm_topk: c.fold.as_ref().is_some_and(|f| f.norm_topk) as i32,
            eps: c.fold.as_ref().map_or(0.0, |f| f.eps),
        };
        let smem = (4 * (h_floats + 64 + 32)) as u32;
        let grid = (d_model.div_ceil(8) as u32, 1, 1);
        let l = Launch::new(Kernel::MoeDown(mode), "moe_down", grid, 256, smem, &p, 0);
        self.dev.launch(&l)?;
        self.dev.sync()?;
        self.read(&out, d_model)
    }
}
