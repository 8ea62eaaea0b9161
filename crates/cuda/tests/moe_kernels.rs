//! The experts' kernels (moe.cu), every mode, against a scalar host reference on random
//! inputs: the two launches that read two thirds of a decode step's bytes. Every test needs a
//! CUDA GPU, so each is ignored by default: run them on one with
//! `cargo test -p q4moe-cuda --release --test moe_kernels -- --include-ignored`.

use q4moe_gguf::quant::{dequantize_row, quantize_row};
use q4moe_gguf::GgmlType;
use q4moe_model::sampling::Rng;

mod common;
use common::{device, randn, rmsnorm, EVERY_TYPE};
use q4moe_cuda::testing::{
    DownCase, DownFold, DownMode, GateUpCase, GateUpMode, Quant, TestDevice,
};

/// Rows `first..first + n` of a matrix of rows of `k` weights in ggml bytes, dequantised.
fn rows_f32(ty: GgmlType, bytes: &[u8], k: usize, first: usize, n: usize) -> Vec<Vec<f32>> {
    let rb = ty.row_bytes(k).unwrap();
    (first..first + n)
        .map(|r| {
            let mut w = vec![0f32; k];
            dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut w).unwrap();
            w
        })
        .collect()
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

fn quantized(ty: GgmlType, rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut bytes = Vec::new();
    quantize_row(ty, &randn(rng, n, 1.0), &mut bytes).unwrap();
    bytes
}

/// moe_gate_up of `mode` against the host in f64: h = silu(g) * u with g, u the rows of each
/// slot's expert against rmsnorm(x) * norm. The staged modes hold the normalised input as 16-bit
/// groups (quant.cuh QXW: g and u within 1e-4 of their largest, as check_matvec's bound), so
/// the bound on h is 3e-4 x max|g| x max|u| (|silu'| <= 1.1, |silu(g)| <= |g|).
fn check_gate_up(
    dev: &TestDevice,
    mode: GateUpMode,
    ty: GgmlType,
    k: usize,
    d_ff: usize,
    n_used: usize,
) {
    let n_expert = n_used + 3;
    let mut rng = Rng::new(ty.id() as u64 * 7 + (k * 31 + d_ff * 7 + n_used) as u64);
    let gate = quantized(ty, &mut rng, n_expert * d_ff * k);
    let up = quantized(ty, &mut rng, n_expert * d_ff * k);
    let (x, norm) = (randn(&mut rng, k, 2.0), randn(&mut rng, k, 1.0));
    let xn = rmsnorm(&x, &norm, 1e-6);
    // distinct experts, not in order
    let ids: Vec<i32> = (0..n_used)
        .map(|s| ((s * 5 + 2) % n_expert) as i32)
        .collect();
    let mut want = Vec::new();
    let (mut gmax, mut umax) = (0f64, 0f64);
    for &e in &ids {
        let first = e as usize * d_ff;
        let (gr, ur) = (
            rows_f32(ty, &gate, k, first, d_ff),
            rows_f32(ty, &up, k, first, d_ff),
        );
        for (g, u) in gr.iter().zip(&ur) {
            let (g, u) = (dot64(g, &xn), dot64(u, &xn));
            (gmax, umax) = (gmax.max(g.abs()), umax.max(u.abs()));
            want.push(g / (1.0 + (-g).exp()) * u);
        }
    }
    let case = GateUpCase {
        ty,
        gate: &gate,
        up: &up,
        d_ff,
        x: if mode == GateUpMode::Generic { &xn } else { &x },
        norm: &norm,
        eps: 1e-6,
        ids: &ids,
    };
    let bound = 3e-4 * gmax * umax;
    let units = d_ff.div_ceil(if mode == GateUpMode::Q4_0Rows2 { 16 } else { 8 }) as u32;
    let walks = match mode {
        GateUpMode::Generic => vec![None],
        _ => vec![None, Some(1), Some(units.div_ceil(3).max(1))],
    };
    for cols in walks {
        let got = dev.moe_gate_up(&case, mode, cols).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= bound,
                "{mode:?} {ty:?} k {k} d_ff {d_ff} {n_used} slots, cols {cols:?}: slot {} row {}: got {g}, want {w} (bound {bound:.3e})",
                i / d_ff,
                i % d_ff
            );
        }
    }
}

/// Every moe_gate_up kernel at the shapes it takes (step's gate_up_mode: Q4_0 two rows a warp
/// at k <= 1024, one at k <= 2048, Q4_K at k % 256 == 0, k <= 2048; the generic kernel for any
/// type), d_ff a whole number of units and not, a slot and eight, each staged kernel with a
/// block a unit and with its blocks walking the units (one column, and a third of them).
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_gate_up_every_mode_matches_host() {
    let dev = device();
    for (k, d_ff, n_used) in [(256, 96, 1), (1024, 200, 8), (512, 768, 4)] {
        check_gate_up(&dev, GateUpMode::Q4_0Rows2, GgmlType::Q4_0, k, d_ff, n_used);
    }
    for (k, d_ff, n_used) in [(1536, 100, 3), (2048, 768, 8)] {
        check_gate_up(&dev, GateUpMode::Q4_0Rows1, GgmlType::Q4_0, k, d_ff, n_used);
    }
    for (k, d_ff, n_used) in [(256, 136, 2), (2048, 768, 8), (1280, 64, 1)] {
        check_gate_up(&dev, GateUpMode::Q4K, GgmlType::Q4_K, k, d_ff, n_used);
    }
    for ty in EVERY_TYPE {
        check_gate_up(&dev, GateUpMode::Generic, ty, 512, 72, 4);
    }
}

/// moe_down of `mode` against the host in f64: out = x + sum_s w_s (W_down[ids_s] h_s); with the
/// folded router the weights from the chosen unscaled logits l and the residual's RMS factor
/// r = 1 / sqrt(mean(x^2) + eps): w_s = exp(r l_s) over the sum of exp(r l) over the chosen
/// (norm_topk) or every expert. The staged modes hold h as 16-bit groups: bound 1e-4 of the
/// largest sum of |w_s dot_s| a row, plus f32's rounding of the residual.
fn check_down(
    dev: &TestDevice,
    mode: DownMode,
    ty: GgmlType,
    d_model: usize,
    d_ff: usize,
    n_used: usize,
    fold: Option<bool>,
) {
    let n_expert = n_used + 4;
    let mut rng = Rng::new(ty.id() as u64 * 13 + (d_model * 3 + d_ff * 5 + n_used) as u64);
    let down = quantized(ty, &mut rng, n_expert * d_model * d_ff);
    let h = randn(&mut rng, n_used * d_ff, 3.0);
    let x = randn(&mut rng, d_model, 4.0);
    let logits = randn(&mut rng, n_expert, 2.0);
    // the chosen: the largest logits, rank order (as the router leaves them)
    let mut order: Vec<usize> = (0..n_expert).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let (ids, weights): (Vec<i32>, Vec<f32>) = match fold {
        Some(_) => order[..n_used]
            .iter()
            .map(|&e| (e as i32, logits[e]))
            .unzip(),
        None => (0..n_used)
            .map(|s| (((s * 5 + 2) % n_expert) as i32, rng.next_f32() + 0.05))
            .unzip(),
    };
    let w: Vec<f64> = match fold {
        Some(norm_topk) => {
            let r = 1.0
                / (x.iter().map(|v| *v as f64 * *v as f64).sum::<f64>() / d_model as f64 + 1e-6)
                    .sqrt();
            let e = |l: f32| (r * (l as f64 - weights[0] as f64)).exp();
            let den: f64 = match norm_topk {
                true => weights.iter().map(|&l| e(l)).sum(),
                false => logits.iter().map(|&l| e(l)).sum(),
            };
            weights.iter().map(|&l| e(l) / den).collect()
        }
        None => weights.iter().map(|&v| v as f64).collect(),
    };
    let mut want = x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let mut scale = vec![0f64; d_model];
    for (s, &e) in ids.iter().enumerate() {
        let rows = rows_f32(ty, &down, d_ff, e as usize * d_model, d_model);
        for (r, row) in rows.iter().enumerate() {
            let t = w[s] * dot64(row, &h[s * d_ff..(s + 1) * d_ff]);
            want[r] += t;
            scale[r] += t.abs();
        }
    }
    let top = scale.iter().fold(0f64, |m, v| m.max(*v));
    let xmax = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let bound = 1e-4 * top + 1e-6 * xmax;
    let case = DownCase {
        ty,
        down: &down,
        h: &h,
        x: &x,
        ids: &ids,
        weights: &weights,
        fold: fold.map(|norm_topk| DownFold {
            logits: &logits,
            norm_topk,
            eps: 1e-6,
        }),
    };
    let got = dev.moe_down(&case, mode).unwrap();
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= bound,
            "{mode:?} {ty:?} d_model {d_model} d_ff {d_ff} {n_used} slots, fold {fold:?}: row {r}: got {g}, want {w} (bound {bound:.3e})"
        );
    }
}

/// Every moe_down kernel: each staged quantisation at each width (2, 6, 8 pieces a lane) over
/// slot counts and d_ff that fill its range of (slot, block) pieces (step's down_mode: up to 64,
/// 192, 256) at its edge and inside it, with the slots' weights given and from the folded
/// router (with and without norm_topk), d_model a whole number of blocks' rows and not; the
/// generic kernel for every type.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_down_every_mode_matches_host() {
    let dev = device();
    let staged = [
        (GgmlType::Q4_0, Quant::Q4_0),
        (GgmlType::Q4_K, Quant::Q4K),
        (GgmlType::Q6_K, Quant::Q6K),
    ];
    // (pieces a lane, [(d_model, d_ff, slots)]): pieces = slots * d_ff / 32 at the range's top
    // and inside it
    let shapes: [(u8, [(usize, usize, usize); 2]); 3] = [
        (2, [(256, 512, 4), (200, 256, 1)]),
        (6, [(2048, 768, 8), (200, 768, 3)]),
        (8, [(512, 1024, 8), (200, 1024, 7)]),
    ];
    for (ty, quant) in staged {
        for (pieces, cases) in shapes {
            for (d_model, d_ff, n_used) in cases {
                let mode = DownMode::Staged { quant, pieces };
                for fold in [None, Some(true), Some(false)] {
                    check_down(&dev, mode, ty, d_model, d_ff, n_used, fold);
                }
            }
        }
    }
    for ty in EVERY_TYPE {
        check_down(&dev, DownMode::Generic, ty, 200, 512, 4, None);
    }
}
