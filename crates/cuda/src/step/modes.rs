//! Which kernel a weight launch takes and its geometry, as pure functions of the shapes and
//! types: a staged mode where the quantisation and the sizes have one, else the generic kernel
//! (any type, row by row), which also serves the shapes the staged kernels do not take.

use q4moe_model::Config;

use crate::device::Device;
use crate::kernel::{DownMode, GateUpMode, Kernel, MatvecMode, Quant, Staged};
use crate::params::Qw;
use crate::weights::LayerW;
use crate::Result;

pub(crate) const THREADS: u32 = 256;
pub(crate) const WARPS: u32 = THREADS / 32;

/// Shared memory of the experts' ids and weights (moe.cu Experts::scratch: 64 floats).
pub(crate) const EXPERTS_SMEM: u32 = 64 * 4;

/// Dynamic shared memory of an input of `k` floats staged for the matvecs.
pub(crate) fn smem_x(k: usize) -> u32 {
    // red (36 floats, keeps xs 16-byte aligned) + xs padded to XS = 36 per 32 (common.cuh)
    (((k / 32) * 36 + 36 + 36) * 4) as u32
}

/// Rows each warp computes: enough blocks to fill the GPU (132 SMs) without re-loading the
/// activations into shared memory more often than needed.
pub(crate) fn rows_per_warp(rows: usize) -> usize {
    if rows >= 8192 {
        4
    } else if rows >= 2048 {
        2
    } else {
        1
    }
}

/// (mode, rows per warp) of `matvec` (matvec.cu, a kernel each): a staged mode when every
/// matrix has the same type (or Q4_K and Q6_K: KMixed) and a group of rows never spans two
/// matrices.
pub(crate) fn mv_mode(ws: &[(Qw, u64, usize)], k: usize) -> (MatvecMode, usize) {
    let total: usize = ws.iter().map(|w| w.2).sum();
    let generic = (MatvecMode::Generic, rows_per_warp(total));
    let ty = ws[0].0.ty;
    let staged = |quant, width| MatvecMode::Staged {
        kernel: Staged::new(quant, width),
        walk: false,
    };
    // Split types (as repacked): one 32-weight block a lane piece.
    let pieces = (k / 32).div_ceil(32);
    let (mode, nr) = if ws.iter().any(|w| w.0.ty != ty) {
        // Q4_K_M's QKV on half the layers: Q4_K q and k, Q6_K v.
        let k_quant = |t: i32| matches!(Quant::of(t), Some(Quant::Q4K | Quant::Q6K));
        if !ws.iter().all(|w| k_quant(w.0.ty)) || !k.is_multiple_of(256) || k > 2048 {
            return generic;
        }
        (MatvecMode::KMixed, 2)
    } else {
        match Quant::of(ty) {
            Some(q @ (Quant::Q4_0 | Quant::Q6K)) if k.is_multiple_of(32) => match pieces {
                1 => (staged(q, 1), 4),
                2 => (staged(q, 2), 2),
                3 | 4 => (staged(q, 4), 1),
                _ => return generic,
            },
            // Q4_K: no 4-row mode (k <= 1024 takes the 2-row one).
            Some(Quant::Q4K) if k.is_multiple_of(256) => match pieces {
                1 | 2 => (staged(Quant::Q4K, 1), 2),
                3 | 4 => (staged(Quant::Q4K, 2), 1),
                _ => return generic,
            },
            _ => return generic,
        }
    };
    if ws[..ws.len() - 1].iter().any(|w| w.2 % nr != 0) {
        return generic;
    }
    (mode, nr)
}

/// (mode, rows per warp) of `moe_gate_up`, a kernel each: gate and up of one type, staged
/// (Q4_0 k <= 1024: two rows a warp; k <= 2048: one, at most 4 staged pieces a lane as in
/// `mv_mode`; Q4_K).
pub(crate) fn gate_up_mode(lw: &LayerW, k: usize) -> (GateUpMode, usize) {
    if lw.gate.ty != lw.up.ty {
        return (GateUpMode::Generic, 1);
    }
    match Quant::of(lw.gate.ty) {
        Some(Quant::Q4_0) if k.is_multiple_of(32) && k <= 1024 => (GateUpMode::Q4_0Rows2, 2),
        Some(Quant::Q4_0) if k.is_multiple_of(32) && k <= 2048 => (GateUpMode::Q4_0Rows1, 1),
        Some(Quant::Q4K) if k.is_multiple_of(256) && k <= 2048 => (GateUpMode::Q4K, 1),
        _ => (GateUpMode::Generic, 1),
    }
}

/// (mode, rows per warp) of `moe_down`, a kernel each: every (slot, block) piece of a row
/// spread over the lanes, 2, 6 or 8 pieces a lane.
pub(crate) fn down_mode(lw: &LayerW, c: &Config) -> (DownMode, usize) {
    let (dff, used) = (c.d_ff_expert, c.n_expert_used);
    let generic = (DownMode::Generic, 1);
    if used > 16 {
        return generic;
    }
    match Quant::of(lw.down.ty) {
        Some(quant) if dff.is_multiple_of(32) => {
            let pieces = match used * dff / 32 {
                0..=64 => 2,
                65..=192 => 6,
                193..=256 => 8,
                _ => return generic,
            };
            (DownMode::Staged { quant, pieces }, 1)
        }
        _ => generic,
    }
}

/// The share (numerator, denominator) of the resident grid a staged moe_gate_up mode takes by
/// default. moe_gate_up_q4_k at 7/8: since its walkers prefetch their second unit into L2 once
/// their input is staged (moe.cu gate_up_staged), fewer columns (more walkers) measured faster
/// on the H200 (Q4_K_M, 66 resident columns): 56-58 columns +1.7-1.8% over 66, 50 +0.4%, 62
/// +0.8%. The Q4_0 kernels lose at every share below the whole grid (58 columns -1.1%, 50
/// -2.3%): not explained (docs/performance.md).
fn gate_up_share(m: GateUpMode) -> (u32, u32) {
    match m {
        GateUpMode::Q4K => (7, 8),
        _ => (1, 1),
    }
}

/// moe_gate_up's dynamic shared memory: the input (smem_x), the experts, the norm weights.
pub(crate) fn gate_up_smem(c: &Config) -> u32 {
    smem_x(c.d_model) + EXPERTS_SMEM + 4 * c.d_model as u32
}

/// moe_gate_up's grid along a slot's units, by mode (`GateUpMode as usize`): for each staged
/// mode `opt`, or by default its share (gate_up_share, rounded) of the blocks the device keeps
/// resident at once divided among the slots (at least 1); 0 (a block a unit) for the generic
/// mode.
pub(crate) fn gate_up_cols(
    dev: &Device,
    c: &Config,
    opt: Option<u32>,
) -> Result<[u32; GateUpMode::ALL.len()]> {
    let mut cols = [0; GateUpMode::ALL.len()];
    for m in GateUpMode::ALL {
        cols[m as usize] = match (m, opt) {
            (GateUpMode::Generic, _) => 0,
            (_, Some(n)) => n,
            (_, None) => {
                let k = Kernel::MoeGateUp(m);
                let resident = dev.resident_blocks(k, THREADS, gate_up_smem(c))?;
                let (num, den) = gate_up_share(m);
                let whole = resident / c.n_expert_used.max(1) as u32;
                ((whole * num + den / 2) / den).max(1)
            }
        };
    }
    Ok(cols)
}

#[cfg(test)]
mod tests {
    use super::*;
    use q4moe_gguf::GgmlType;

    fn w(ty: GgmlType) -> Qw {
        Qw {
            ty: ty.id() as i32,
            ..Qw::default()
        }
    }

    fn staged(quant: Quant, width: u8) -> MatvecMode {
        MatvecMode::Staged {
            kernel: Staged::new(quant, width),
            walk: false,
        }
    }

    /// The modes the old index arithmetic chose (modes 1..=9 and 0), shape by shape.
    #[test]
    fn matvec_modes_follow_type_and_width() {
        let one = |ty, rows, k| mv_mode(&[(w(ty), 0, rows)], k);
        assert_eq!(one(GgmlType::Q4_0, 4096, 1024), (staged(Quant::Q4_0, 1), 4));
        assert_eq!(one(GgmlType::Q4_0, 4096, 2048), (staged(Quant::Q4_0, 2), 2));
        assert_eq!(one(GgmlType::Q4_0, 4096, 4096), (staged(Quant::Q4_0, 4), 1));
        assert_eq!(one(GgmlType::Q4_0, 4096, 8192).0, MatvecMode::Generic);
        assert_eq!(one(GgmlType::Q4_K, 4096, 2048), (staged(Quant::Q4K, 1), 2));
        assert_eq!(one(GgmlType::Q4_K, 4096, 4096), (staged(Quant::Q4K, 2), 1));
        assert_eq!(one(GgmlType::Q6_K, 4096, 1024), (staged(Quant::Q6K, 1), 4));
        assert_eq!(one(GgmlType::F32, 128, 2048), (MatvecMode::Generic, 1));
        let mixed = [
            (w(GgmlType::Q4_K), 0, 4096),
            (w(GgmlType::Q4_K), 0, 512),
            (w(GgmlType::Q6_K), 0, 512),
        ];
        assert_eq!(mv_mode(&mixed, 2048), (MatvecMode::KMixed, 2));
        // A group of 4 rows would span two matrices: generic.
        let ragged = [(w(GgmlType::Q4_0), 0, 6), (w(GgmlType::Q4_0), 0, 8)];
        assert_eq!(mv_mode(&ragged, 1024).0, MatvecMode::Generic);
    }
}
