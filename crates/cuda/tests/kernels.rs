//! Every kernel against a scalar host reference on random inputs (outputs poisoned first).
//! Every test needs a CUDA GPU, so each is ignored by default: run them on one with
//! `cargo test -p q4moe-cuda --release --test kernels -- --include-ignored` (a missing GPU then
//! fails the test).

use q4moe_cuda::testing::TestDevice;
use q4moe_gguf::quant::{dequantize_row, quantize_row};
use q4moe_gguf::GgmlType;
use q4moe_model::sampling::{argmax, Rng, Sampler, SamplingParams};

mod common;
use common::{device, randn, rmsnorm, EVERY_TYPE};

/// `walk`: the rows walked by at most that many blocks (the output head's launch).
fn check_matvec(
    dev: &TestDevice,
    ty: GgmlType,
    rows: usize,
    k: usize,
    fused_norm: bool,
    walk: Option<u32>,
) {
    let mut rng = Rng::new(ty.id() as u64 * 1000 + rows as u64 + k as u64);
    let wf = randn(&mut rng, rows * k, 1.0);
    let mut bytes = Vec::new();
    quantize_row(ty, &wf, &mut bytes).unwrap();
    let x = randn(&mut rng, k, 1.0);
    let nw = randn(&mut rng, k, 1.0);
    let xin = if fused_norm {
        rmsnorm(&x, &nw, 1e-6)
    } else {
        x.clone()
    };
    let rb = bytes.len() / rows;
    let want: Vec<f32> = (0..rows)
        .map(|r| {
            let mut w = vec![0f32; k];
            dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut w).unwrap();
            w.iter()
                .zip(&xin)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum::<f64>() as f32
        })
        .collect();
    let got = dev
        .matvec(
            ty,
            &bytes,
            rows,
            k,
            &x,
            fused_norm.then_some((&nw[..], 1e-6)),
            walk,
        )
        .unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * scale.max(1.0),
            "{ty:?} {rows}x{k} (walk {walk:?}) row {r}: got {g}, want {w}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matvec_every_type_matches_host() {
    let dev = device();
    for ty in EVERY_TYPE {
        for (rows, k) in [(37, 256), (130, 768), (64, 2048), (9, 4096)] {
            check_matvec(&dev, ty, rows, k, false, None);
        }
        check_matvec(&dev, ty, 50, 1024, true, None);
    }
}

/// The batched prefill's weight rows (prefill.rs dense_launch: pf_mma for the split types,
/// pf_f32rows for F32, pf_rows for the others) against the host in f64, over activation-row
/// counts that fill no, one and several 32-entry tiles, and row counts past a block's rows;
/// and bt_mma bit-identical to pf_mma.
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_rows_match_host() {
    let dev = device();
    for ty in EVERY_TYPE {
        for (rows, k, n) in [(37, 256, 1), (130, 768, 33), (200, 2048, 70), (9, 4096, 5)] {
            let mut rng = Rng::new(ty.id() as u64 * 7919 + (rows * k + n) as u64);
            let wf = randn(&mut rng, rows * k, 1.0);
            let mut bytes = Vec::new();
            quantize_row(ty, &wf, &mut bytes).unwrap();
            let x = randn(&mut rng, n * k, 1.0);
            let got = dev.prefill_rows(ty, &bytes, (rows, k), &x, false).unwrap();
            // bt_mma (the batched step's few-token launches) gives pf_mma's bits exactly: the
            // batch size may pick either without changing a sequence's output.
            let few = dev.prefill_rows(ty, &bytes, (rows, k), &x, true).unwrap();
            for (i, (a, b)) in got.iter().zip(&few).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() && a.is_finite(),
                    "{ty:?} {rows}x{k}, {n} tokens: output {i}: {a} (pf kernels), {b} (bt_mma)"
                );
            }
            if ty == GgmlType::F32 {
                // bt_f32rows' split form (a chain a block): the same bits, and again on the
                // counters the first launch left.
                for (j, split) in dev
                    .f32_rows_split(&bytes, (rows, k), &x)
                    .unwrap()
                    .iter()
                    .enumerate()
                {
                    for (i, (a, b)) in got.iter().zip(split).enumerate() {
                        assert!(
                            a.to_bits() == b.to_bits(),
                            "F32 {rows}x{k}, {n} tokens, split launch {j}: output {i}: {a} (pf), {b}"
                        );
                    }
                }
            }
            let rb = bytes.len() / rows;
            let mut w = vec![0f32; k];
            let mut scale = 1f32;
            let mut want = vec![0f32; n * rows];
            for r in 0..rows {
                dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut w).unwrap();
                for t in 0..n {
                    let xs = &x[t * k..(t + 1) * k];
                    let d: f64 = w.iter().zip(xs).map(|(a, b)| *a as f64 * *b as f64).sum();
                    want[t * rows + r] = d as f32;
                    scale = scale.max(d.abs() as f32);
                }
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * scale,
                    "{ty:?} {rows}x{k}, {n} rows of activations: token {} row {}: got {g}, want {w}",
                    i / rows,
                    i % rows
                );
            }
        }
    }
}

/// bt_mma' launch over several matrices at once (q, k and v; gate and up) gives each matrix's
/// outputs the bits of its own pf_mma launch, for parts of different types and row counts past
/// a block's rows, and token counts of one and several passes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bt_mma_parts_match_a_launch_each() {
    let dev = device();
    use GgmlType::*;
    for (k, n) in [(256, 1), (2048, 3), (4096, 11)] {
        let mut rng = Rng::new((k * 31 + n) as u64);
        let shapes = [(Q4_0, 37), (Q4_K, 130), (Q6_K, 9)];
        let bytes: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(ty, rows)| {
                let mut b = Vec::new();
                quantize_row(ty, &randn(&mut rng, rows * k, 1.0), &mut b).unwrap();
                b
            })
            .collect();
        let x = randn(&mut rng, n * k, 1.0);
        for m in 1..=3 {
            let parts: Vec<(GgmlType, &[u8], usize)> = (0..m)
                .map(|i| (shapes[i].0, bytes[i].as_slice(), shapes[i].1))
                .collect();
            let (fused, apart) = dev.rows_parts(&parts, k, &x).unwrap();
            for (i, (a, b)) in fused.iter().zip(&apart).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() && a.is_finite(),
                    "k {k}, {n} tokens, {m} parts: output {i}: {a} (bt_mma), {b} (pf_mma)"
                );
            }
        }
    }
}

/// The output head's launch: a few blocks walk every row (several units a warp, the last one
/// partly past the end), with the head's RMSNorm, for each staged type and k up to 4096.
#[test]
#[ignore = "needs a CUDA GPU"]
fn walked_matvec_matches_host() {
    let dev = device();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        for (rows, k, blocks) in [(1001, 256, 3), (517, 2048, 2), (203, 4096, 5)] {
            check_matvec(&dev, ty, rows, k, true, Some(blocks));
        }
    }
}

/// The head with the greedy choice in its tail (sample.cu head_argmax): the same logits, bit
/// for bit, as the walking head without it, the token their arg-max (lower index on ties: a
/// matrix of one row repeated gives every row the same logit, so row 0 must win), the position
/// advanced, over grids from a few blocks to more than a wave of partials.
#[test]
#[ignore = "needs a CUDA GPU"]
fn head_argmax_matches_walked_head() {
    let dev = device();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        for (rows, k, blocks, repeated) in [
            (1001, 256, 3, false),
            (517, 2048, 2, false),
            (203, 4096, 5, false),
            (9001, 256, 264, false),
            (700, 512, 7, true),
        ] {
            let mut rng = Rng::new(ty.id() as u64 * 31 + (rows * k) as u64);
            let wf = randn(&mut rng, if repeated { k } else { rows * k }, 1.0);
            let mut bytes = Vec::new();
            quantize_row(ty, &wf, &mut bytes).unwrap();
            if repeated {
                bytes = bytes.repeat(rows);
            }
            let (x, nw) = (randn(&mut rng, k, 1.0), randn(&mut rng, k, 1.0));
            let norm = (&nw[..], 1e-6);
            let want = dev
                .matvec(ty, &bytes, rows, k, &x, Some(norm), Some(blocks))
                .unwrap();
            let (got, st) = dev.head_argmax(ty, &bytes, rows, &x, norm, blocks).unwrap();
            let case = format!("{ty:?} {rows}x{k} on {blocks} blocks");
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "{case}: logits differ from the walking head's"
            );
            assert_eq!(st.token, argmax(&want), "{case}: token");
            assert!(!repeated || st.token == 0, "{case}: a tie goes to row 0");
            assert_eq!(st.pos, 8, "{case}: position");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_row_matches_host_for_every_type() {
    let dev = device();
    let (rows, k) = (5, 512);
    for ty in EVERY_TYPE {
        let mut rng = Rng::new(ty.id() as u64 + 77);
        let mut bytes = Vec::new();
        quantize_row(ty, &randn(&mut rng, rows * k, 1.0), &mut bytes).unwrap();
        let rb = bytes.len() / rows;
        let mut want = vec![0f32; k];
        dequantize_row(ty, &bytes[3 * rb..4 * rb], &mut want).unwrap();
        let got = dev.embed(ty, &bytes, k, 3).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                "{ty:?} weight {i}: got {g}, want {w}"
            );
        }
    }
}

/// o_proj with the folded router (moe.cu RouterFold): the new residual as o_proj's, the
/// unscaled logits as (router * norm) (x + W_o attn) in f64, and the chosen experts the largest
/// of them (a tie to the lower index), for each staged type and the test geometries' shapes up
/// to Qwen3-30B-A3B's, 30 experts (keys padded to a multiple of 4) and 300 (more than the
/// block's threads rank at once).
#[test]
#[ignore = "needs a CUDA GPU"]
fn o_proj_with_folded_router_matches_host() {
    let dev = device();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        for (d_model, q_dim, n_expert, n_used) in [
            (256, 256, 8, 2),
            (256, 256, 30, 3),
            (1024, 2048, 32, 4),
            (2048, 4096, 128, 8),
            (256, 512, 300, 8),
        ] {
            let mut rng = Rng::new(ty.id() as u64 * 31 + d_model as u64);
            let mut o_bytes = Vec::new();
            quantize_row(ty, &randn(&mut rng, d_model * q_dim, 1.0), &mut o_bytes).unwrap();
            let mut router = randn(&mut rng, n_expert * d_model, 0.05);
            let norm = randn(&mut rng, d_model, 1.0);
            let x = randn(&mut rng, d_model, 4.0);
            let attn = randn(&mut rng, q_dim, 1.0);
            let rb = o_bytes.len() / d_model;
            let xo: Vec<f64> = (0..d_model)
                .map(|r| {
                    let mut w = vec![0f32; q_dim];
                    dequantize_row(ty, &o_bytes[r * rb..(r + 1) * rb], &mut w).unwrap();
                    let dot: f64 = w
                        .iter()
                        .zip(&attn)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    x[r] as f64 + dot
                })
                .collect();
            // Rows 1 and n_expert / 2 alike, each element's sign that of its term: both rank
            // first, a tie the lower index must win (computed alike, so bit-identical logits).
            for i in 0..d_model {
                let v = 0.05f32.copysign(norm[i] * xo[i] as f32);
                router[d_model + i] = v;
                router[n_expert / 2 * d_model + i] = v;
            }
            let want: Vec<f64> = router
                .chunks(d_model)
                .map(|row| {
                    (0..d_model)
                        .map(|i| row[i] as f64 * norm[i] as f64 * xo[i])
                        .sum()
                })
                .collect();
            let got = dev
                .o_proj_router(ty, &o_bytes, &router, &norm, &x, &attn, n_used)
                .unwrap();
            let what = format!("{ty:?} d_model {d_model} q_dim {q_dim} {n_expert} experts");
            let xs = xo.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (i, (g, w)) in got.x.iter().zip(&xo).enumerate() {
                assert!(
                    (*g as f64 - w).abs() <= 1e-4 * xs,
                    "{what}: x[{i}] {g} vs {w}"
                );
            }
            let ls = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (e, (g, w)) in got.logits.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() <= 1e-4 * ls,
                    "{what}: logit {e} {g} vs {w}"
                );
            }
            // The chosen are the largest got logits in rank order, their own values, and
            // within the tolerance of the host's largest.
            let mut order: Vec<usize> = (0..n_expert).collect();
            order.sort_by(|&a, &b| got.logits[b].total_cmp(&got.logits[a]).then(a.cmp(&b)));
            let ids: Vec<i32> = order[..n_used].iter().map(|&i| i as i32).collect();
            assert_eq!(got.ids, ids, "{what}: chosen experts");
            assert_eq!(got.logits[1], got.logits[n_expert / 2], "{what}: the tie");
            assert!(
                got.ids[..2] == [1, n_expert as i32 / 2],
                "{what}: the tie's order"
            );
            for (j, &i) in order[..n_used].iter().enumerate() {
                assert_eq!(got.sel[j], got.logits[i], "{what}: chosen logit {j}");
            }
            let mut host: Vec<f64> = want.clone();
            host.sort_by(|a, b| b.total_cmp(a));
            assert!(
                (want[order[n_used - 1]] - host[n_used - 1]).abs() <= 2e-4 * ls,
                "{what}: the last chosen is not among the host's largest"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn topk_matches_host() {
    let dev = device();
    let mut rng = Rng::new(5);
    // 300 experts take topk_block's path without registers.
    for (n, k) in [(8, 2), (32, 4), (128, 8), (300, 8)] {
        let mut lg = randn(&mut rng, n, 3.0);
        lg[n / 2] = lg[1]; // a tie: the lower index must win
        let m = lg.iter().fold(f32::MIN, |a, &b| a.max(b));
        let p: Vec<f32> = lg.iter().map(|v| (v - m).exp()).collect();
        let s: f32 = p.iter().sum();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top = &idx[..k];
        let tsum: f32 = top.iter().map(|&i| p[i] / s).sum();
        let (ids, ws) = dev.topk(&lg, k, true).unwrap();
        assert_eq!(ids, top.iter().map(|&i| i as i32).collect::<Vec<_>>());
        for (j, &i) in top.iter().enumerate() {
            assert!(
                (ws[j] - p[i] / s / tsum).abs() < 1e-5,
                "weight {j}: {} vs {}",
                ws[j],
                p[i] / s / tsum
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn argmax_matches_host_with_ties_and_nan() {
    let dev = device();
    let mut rng = Rng::new(9);
    for n in [1000, 151936] {
        let mut lg = randn(&mut rng, n, 5.0);
        lg[n / 3] = 100.0;
        lg[n - 5] = 100.0;
        lg[7] = f32::NAN;
        assert_eq!(dev.argmax(&lg).unwrap(), argmax(&lg));
    }
    assert_eq!(dev.argmax(&[f32::NEG_INFINITY; 64]).unwrap(), 0);
}

/// The batched step's arg-max (bt_argmax), a row a block: the host's choice (the lowest index
/// among equal maxima, wherever they fall in a thread's loads) on rows of whole float4s and of
/// other lengths, and BT_NON_FINITE for a row with a NaN or an infinity, whatever its neighbours.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bt_argmax_matches_host_per_row() {
    let dev = device();
    let mut rng = Rng::new(21);
    for n in [151936, 1001, 4096 + 3] {
        let rows = 6;
        let mut lg = randn(&mut rng, n * rows, 5.0);
        let row = |r: usize, i: usize| r * n + i;
        // Row 0: a tie between two threads' loads; row 1: a tie inside one float4; row 2: the
        // maximum in the last value (the scalar tail where n % 4 != 0); rows 3 and 4: a NaN and
        // an infinity; row 5: random.
        lg[row(0, n / 3)] = 100.0;
        lg[row(0, n - 5)] = 100.0;
        lg[row(1, 9)] = 100.0;
        lg[row(1, 10)] = 100.0;
        lg[row(2, n - 1)] = 100.0;
        lg[row(3, n / 2)] = f32::NAN;
        lg[row(4, 3)] = f32::INFINITY;
        let got = dev.bt_argmax(&lg, rows).unwrap();
        for (r, &g) in got.iter().enumerate() {
            let v = &lg[r * n..(r + 1) * n];
            let want = match v.iter().all(|x| x.is_finite()) {
                true => argmax(v),
                false => u32::MAX, // BT_NON_FINITE
            };
            assert_eq!(g, want, "n {n}, row {r}");
        }
    }
}

/// The device sampler draws exactly the host sampler's tokens (same seed, same draw sequence):
/// several settings (a top-k cut with and without top-p, the nucleus, no cut), a small and the
/// full Qwen3 vocabulary, exact ties and non-finite logits, and a flat vocabulary whose nucleus
/// ends inside thousands of ties.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sampler_matches_host_sampler() {
    let dev = device();
    let mut rng = Rng::new(11);
    let settings = [
        (0.7, 20, 0.95, 0.0),
        (1.0, 1, 1.0, 0.0),
        (1.3, 1024, 1.0, 0.0),
        (0.6, 50, 0.8, 0.05),
        (2.0, 300, 1.0, 0.2),
        // no cut at n = 700: the host's vocabulary-order walk, with a min-p floor
        (1.1, 1024, 1.0, 0.1),
        // top-k off, no top-p (the OpenAI defaults): the chunked vocabulary walk
        (1.0, 0, 1.0, 0.0),
        (0.8, 0, 1.0, 0.05),
        // top-k off with top-p: the nucleus
        (0.7, 0, 0.9, 0.0),
        (1.0, 0, 0.5, 0.05),
        (1.3, 0, 0.99, 0.0),
    ];
    for n in [700, 151936] {
        let mut lg = randn(&mut rng, n, 3.0);
        // exact ties across the top-k boundary and values that must never be drawn
        for i in 0..40 {
            lg[(i * 97 + 13) % n] = 6.5;
        }
        lg[5] = f32::NAN;
        lg[n - 2] = f32::INFINITY;
        lg[n - 3] = f32::NEG_INFINITY;
        for (t, k, top_p, min_p) in settings {
            let p = SamplingParams {
                temperature: t,
                top_k: k,
                top_p,
                min_p,
                seed: 1000 + k as u64,
                ..Default::default()
            };
            let got = dev
                .sample(&lg, &p, &[], 64)
                .unwrap()
                .expect("device sampler takes it");
            let mut host = Sampler::new(p.clone(), &[]);
            let want: Vec<u32> = (0..64).map(|_| host.sample(&mut lg.clone())).collect();
            assert_eq!(got, want, "n {n}, settings {p:?}");
            let distinct = want.iter().collect::<std::collections::HashSet<_>>().len();
            assert!(k == 1 || distinct > 1, "settings {p:?} never varied");
        }
    }
    // 3,000 equal logits: the nucleus is the lowest ids, its cut inside the ties.
    let flat = vec![0.25f32; 3000];
    for top_p in [0.5, 0.9] {
        let p = SamplingParams {
            temperature: 0.7,
            top_p,
            seed: 8,
            ..Default::default()
        };
        let got = dev
            .sample(&flat, &p, &[], 64)
            .unwrap()
            .expect("device nucleus");
        let mut host = Sampler::new(p.clone(), &[]);
        let want: Vec<u32> = (0..64).map(|_| host.sample(&mut flat.clone())).collect();
        assert_eq!(got, want, "flat logits, top-p {top_p}");
    }
    // Penalties over a history and the draws: the logits the host rewrites, the same draws.
    let n = 151936;
    let lg = randn(&mut rng, n, 3.0);
    let history: Vec<u32> = (0..300).map(|i| ((i * 7919) % 5000) as u32).collect();
    let best: Vec<u32> = (0..50u32).map(|i| i * 3001 % n as u32).collect();
    let mut lg_hot = lg.clone();
    best.iter()
        .for_each(|&i| lg_hot[i as usize] = 9.0 + (i % 7) as f32 * 0.1); // drawn again and again
    let history = [history, best.clone()].concat();
    for (t, k, rep, presence, frequency) in [
        (0.7, 20, 1.3, 0.0, 0.0),
        (1.0, 0, 1.1, 0.5, 0.2),
        (0.8, 40, 1.0, -0.4, 0.3),
    ] {
        let p = SamplingParams {
            temperature: t,
            top_k: k,
            top_p: 0.95,
            repetition_penalty: rep,
            presence_penalty: presence,
            frequency_penalty: frequency,
            seed: 77,
            ..Default::default()
        };
        let got = dev
            .sample(&lg_hot, &p, &history, 64)
            .unwrap()
            .expect("device penalties");
        let mut host = Sampler::new(p.clone(), &history);
        let want: Vec<u32> = (0..64).map(|_| host.sample(&mut lg_hot.clone())).collect();
        assert_eq!(got, want, "penalties {p:?}");
        let plain = SamplingParams {
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            ..p.clone()
        };
        let mut host = Sampler::new(plain, &history);
        let unpenalised: Vec<u32> = (0..64).map(|_| host.sample(&mut lg_hot.clone())).collect();
        assert_ne!(want, unpenalised, "penalties {p:?} changed no draw");
    }
    let wide_k = SamplingParams {
        temperature: 1.0,
        top_k: 2000,
        ..Default::default()
    };
    assert_eq!(
        dev.sample(&[0.0; 8], &wide_k, &[], 1).unwrap(),
        None,
        "top-k above SAMPLE_MAX_K: host path"
    );
}

/// NeoX RoPE (rotate-half) of one head at `pos`, as attention.cu and the CPU backend.
fn rope(v: &mut [f32], pos: usize, theta: f32) {
    let half = v.len() / 2;
    for i in 0..half {
        let freq = theta.powf(-2.0 * i as f32 / v.len() as f32);
        let (s, c) = (pos as f32 * freq).sin_cos();
        let (x0, x1) = (v[i], v[i + half]);
        v[i] = x0 * c - x1 * s;
        v[i + half] = x0 * s + x1 * c;
    }
}

fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

fn f16_val(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// Host attention of `TestDevice::attention`'s case: the new K (normalised, roped) and V
/// rounded to f16 as the cache holds them, then softmax(q k / sqrt) v over positions 0..=pos in
/// f64. Returns the outputs and the new K / V rows (f32, before rounding).
fn attention_reference(a: &q4moe_cuda::testing::AttentionCase) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (kvd, nh) = (a.n_kv_head * 128, a.n_kv_head * 8);
    let qd = nh * 128;
    let head = |src: &[f32], w: &[f32]| {
        let mut v = rmsnorm(src, w, a.eps);
        rope(&mut v, a.pos, a.theta);
        v
    };
    let mut k_new = Vec::new();
    for h in 0..a.n_kv_head {
        k_new.extend(head(&a.qkv[qd + h * 128..qd + (h + 1) * 128], &a.k_norm));
    }
    let v_new = a.qkv[qd + kvd..].to_vec();
    let key = |t: usize, i: usize| {
        if t == a.pos {
            f16_val(f16_bits(k_new[i]))
        } else {
            f16_val(a.k_cache[t * kvd + i])
        }
    };
    let val = |t: usize, i: usize| {
        if t == a.pos {
            f16_val(f16_bits(v_new[i]))
        } else {
            f16_val(a.v_cache[t * kvd + i])
        }
    };
    let mut out = vec![0f32; qd];
    for h in 0..nh {
        let q = head(&a.qkv[h * 128..(h + 1) * 128], &a.q_norm);
        let kvh = h / 8;
        let s: Vec<f64> = (0..=a.pos)
            .map(|t| {
                (0..128)
                    .map(|d| q[d] as f64 * key(t, kvh * 128 + d) as f64)
                    .sum::<f64>()
                    * a.scale as f64
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f64 = w.iter().sum();
        for d in 0..128 {
            let o: f64 = (0..=a.pos)
                .map(|t| w[t] * val(t, kvh * 128 + d) as f64)
                .sum();
            out[h * 128 + d] = (o / l) as f32;
        }
    }
    (out, k_new, v_new)
}

/// The Qwen3-shape attention kernels (scalar and tensor cores) over an f16 cache against the
/// host: one block a KV head (direct), several merged, blocks walking several chunks, the new
/// position inside a tile, rows past it NaN (never read). Bounds, relative to the largest |out|:
/// 1e-4 scalar (f32 arithmetic), 4e-3 tensor cores (queries and softmax weights in f16).
#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_matches_host() {
    let dev = device();
    let mut rng = Rng::new(11);
    let (n_kv_head, capacity) = (2, 512);
    let kvd = n_kv_head * 128;
    let nan = 0x7e00u16;
    // (pos, max_blocks, min_span, staged tiles a warp): the staged cases hold all positions in
    // one block (300: the new position in a staged tile; 100: nothing to stage), two blocks of
    // two tiles a warp, and one block of four tiles a warp, too many to stage (all load late).
    for (pos, max_blocks, min_span, stage) in [
        (5, 32, 1, 0),
        (37, 32, 1, 0),
        (300, 32, 1, 0),
        (300, 32, 4, 0),
        (300, 2, 4, 0),
        (469, 4, 1, 0),
        (100, 32, 4, 2),
        (300, 32, 4, 2),
        (469, 2, 4, 1),
        (469, 1, 1, 1),
    ] {
        let mut k_cache = vec![nan; capacity * kvd];
        let mut v_cache = vec![nan; capacity * kvd];
        for i in 0..pos * kvd {
            k_cache[i] = f16_bits((rng.next_f32() * 2.0 - 1.0) * 3.0);
            v_cache[i] = f16_bits((rng.next_f32() * 2.0 - 1.0) * 2.0);
        }
        let case = q4moe_cuda::testing::AttentionCase {
            n_kv_head,
            qkv: randn(&mut rng, n_kv_head * 8 * 128 + 2 * kvd, 2.0),
            q_norm: randn(&mut rng, 128, 1.5),
            k_norm: randn(&mut rng, 128, 1.5),
            k_cache,
            v_cache,
            pos,
            scale: 1.0 / (128f32).sqrt(),
            eps: 1e-6,
            theta: 1e6,
            max_blocks,
            min_span,
            stage,
        };
        let (want, k_new, v_new) = attention_reference(&case);
        let top = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for tc in [false, true] {
            let got = dev.attention(&case, tc).unwrap();
            let err = got
                .out
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(
                    0f32,
                    |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
                );
            let bound = if tc { 4e-3 } else { 1e-4 };
            let what = format!("pos {pos}, {max_blocks} blocks, min span {min_span}, stage {stage}, tensor cores {tc}");
            eprintln!("{what}: max error {err:.2e} of {top:.2e}");
            assert!(err <= bound * top, "{what}: error {err} > {bound} x {top}");
            for (i, (&g, (&k, &v))) in got.k_row.iter().zip(k_new.iter().zip(&v_new)).enumerate() {
                assert!(
                    (f16_val(g) - k).abs() <= 2e-3 * k.abs().max(1e-3),
                    "K row at pos, dim {i}: {} vs {k}",
                    f16_val(g)
                );
                assert_eq!(got.v_row[i], f16_bits(v), "V row at pos, dim {i}");
            }
        }
    }
}
