//! Quant kernels: fast vs scalar reference on random inputs, round-trip error bounds, errors.

use q4moe_gguf::quant::{self, Isa};
use q4moe_gguf::GgmlType::{self, *};
use rand::{rngs::StdRng, Rng, SeedableRng};

const ALL: [GgmlType; 7] = [F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K];
const INT: [GgmlType; 4] = [Q8_0, Q4_0, Q4_K, Q6_K];

fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    // Sum of uniforms: roughly normal, never all zeros; occasional outliers like real weights.
    (0..n)
        .map(|_| {
            let v: f32 = (0..4).map(|_| rng.gen_range(-1.0f32..1.0)).sum();
            if rng.gen_ratio(1, 64) {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}

fn quantize(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut q = Vec::new();
    quant::quantize_row(ty, x, &mut q).unwrap();
    assert_eq!(q.len(), ty.row_bytes(x.len()).unwrap());
    q
}

fn dequantize(ty: GgmlType, q: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    quant::dequantize_row(ty, q, &mut out).unwrap();
    out
}

fn rel_rmse(a: &[f32], b: &[f32]) -> f32 {
    let err: f32 = a.iter().zip(b).map(|(a, b)| (a - b) * (a - b)).sum();
    let norm: f32 = a.iter().map(|a| a * a).sum();
    (err / norm).sqrt()
}

/// Tolerance scale for a dot: the sum of |w*x|, so cancellation does not shrink it.
fn abs_dot(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(w, x)| (w * x).abs()).sum()
}

#[test]
fn round_trip_error_is_bounded() {
    let mut rng = StdRng::seed_from_u64(1);
    for ty in ALL {
        for n in [256, 768, 2048] {
            let x = randn(&mut rng, n);
            let y = dequantize(ty, &quantize(ty, &x), n);
            let bound = match ty {
                F32 => 0.0,
                F16 => 1e-3,
                BF16 => 5e-3,
                Q8_0 => 1e-2,
                Q6_K => 3e-2,
                Q4_0 => 0.15,
                Q4_K => 0.12,
                _ => unreachable!(),
            };
            let e = rel_rmse(&x, &y);
            assert!(e <= bound, "{ty} n={n}: relative rmse {e} > {bound}");
        }
    }
}

#[test]
fn k_quants_beat_plain_rounding() {
    // The searched scales must do at least as well as a naive 4-/6-bit grid would.
    let mut rng = StdRng::seed_from_u64(2);
    let x = randn(&mut rng, 4096);
    let e4 = rel_rmse(&x, &dequantize(Q4_K, &quantize(Q4_K, &x), x.len()));
    let e40 = rel_rmse(&x, &dequantize(Q4_0, &quantize(Q4_0, &x), x.len()));
    let e6 = rel_rmse(&x, &dequantize(Q6_K, &quantize(Q6_K, &x), x.len()));
    assert!(e4 < e40, "Q4_K {e4} vs Q4_0 {e40}");
    assert!(e6 < e4 / 2.0, "Q6_K {e6} vs Q4_K {e4}");
}

#[test]
fn quantize_handles_zeros_and_constants() {
    for ty in ALL {
        for v in [0.0f32, 1.5, -3.0] {
            let x = vec![v; 512];
            let y = dequantize(ty, &quantize(ty, &x), 512);
            for (a, b) in x.iter().zip(&y) {
                assert!(
                    (a - b).abs() <= 0.02 * v.abs() + 1e-6,
                    "{ty} constant {v}: got {b}"
                );
            }
        }
    }
}

/// Random rows as valid blocks: quantised random data, plus random bytes for the q-types (every
/// bit pattern of the payload is valid; scales are forced to sane f16).
fn random_rows(rng: &mut StdRng, ty: GgmlType, n: usize) -> Vec<Vec<u8>> {
    let mut rows = vec![quantize(ty, &randn(rng, n))];
    if matches!(ty, Q4_0 | Q8_0 | Q4_K | Q6_K) {
        let mut raw: Vec<u8> = (0..ty.row_bytes(n).unwrap()).map(|_| rng.gen()).collect();
        for b in raw.chunks_exact_mut(ty.type_size()) {
            let mut set = |off: usize| {
                let d = half::f16::from_f32(rng.gen_range(-0.05f32..0.05)).to_le_bytes();
                b[off..off + 2].copy_from_slice(&d);
            };
            match ty {
                Q4_0 | Q8_0 => set(0),
                Q4_K => {
                    set(0);
                    set(2)
                }
                _ => set(208),
            }
        }
        rows.push(raw);
    }
    rows
}

/// `rows` consecutive Q4_0 rows of `n` values, alternately quantised Gaussian and random bytes
/// (`random_rows`), and the bytes of one.
fn q4_0_matrix(rng: &mut StdRng, n: usize, rows: usize) -> (Vec<u8>, usize) {
    let data: Vec<u8> = (0..rows)
        .flat_map(|r| random_rows(rng, Q4_0, n).swap_remove(r % 2))
        .collect();
    let row_bytes = data.len() / rows;
    (data, row_bytes)
}

#[test]
fn vec_dot_fast_matches_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    for ty in ALL {
        for n in [256, 768, 2048] {
            for row in random_rows(&mut rng, ty, n) {
                let x = randn(&mut rng, n);
                let w = dequantize(ty, &row, n);
                let want = quant::vec_dot_ref(ty, &row, &x);
                let tol = 1e-5 * abs_dot(&w, &x);
                for isa in quant::available_isas() {
                    let got = quant::vec_dot_isa(isa, ty, &row, &x);
                    assert!(
                        (got - want).abs() <= tol,
                        "{ty} {isa:?} n={n}: {got} vs {want} (tol {tol})"
                    );
                }
                assert!((quant::vec_dot(ty, &row, &x) - want).abs() <= tol);
            }
        }
    }
}

#[test]
fn f32_rows_of_any_length() {
    let mut rng = StdRng::seed_from_u64(4);
    for ty in [F32, F16, BF16] {
        for n in [1, 7, 9, 33, 100] {
            let x = randn(&mut rng, n);
            let row = quantize(ty, &randn(&mut rng, n));
            let want = quant::vec_dot_ref(ty, &row, &x);
            let got = quant::vec_dot(ty, &row, &x);
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{ty} n={n}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn vec_dot_q8_fast_matches_reference() {
    let mut rng = StdRng::seed_from_u64(5);
    for ty in INT {
        for n in [256, 768, 2048] {
            for row in random_rows(&mut rng, ty, n) {
                let x = randn(&mut rng, n);
                let mut xq = Vec::new();
                quant::quantize_activation_q8(ty, &x, &mut xq);
                let w = dequantize(ty, &row, n);
                // Integer sums are exact on every path; only the f32 scaling order differs.
                let want = quant::vec_dot_q8_ref(ty, &row, &xq);
                let tol = 1e-5 * abs_dot(&w, &x);
                for isa in quant::available_isas() {
                    let got = quant::vec_dot_q8_isa(isa, ty, &row, &xq);
                    assert!(
                        (got - want).abs() <= tol,
                        "{ty} {isa:?} n={n}: {got} vs {want} (tol {tol})"
                    );
                }
                // Against the f32 path: activation quantisation costs about 1% (8 bits).
                let exact = quant::vec_dot_ref(ty, &row, &x);
                let tol8 = 1e-2 * abs_dot(&w, &x);
                assert!(
                    (want - exact).abs() <= tol8,
                    "{ty} n={n}: q8 {want} vs f32 {exact} (tol {tol8})"
                );
            }
        }
    }
}

#[test]
fn activation_formats_and_sizes() {
    let x = vec![0.5f32; 512];
    let mut q = Vec::new();
    quant::quantize_activation_q8(Q4_0, &x, &mut q);
    assert_eq!(q.len(), 16 * 34);
    q.clear();
    quant::quantize_activation_q8(Q4_K, &x, &mut q);
    assert_eq!(q.len(), 2 * 292);
    let b: &quant::BlockQ8K = unsafe { &*(q.as_ptr() as *const quant::BlockQ8K) };
    assert_eq!(b.qs[0], 127);
    assert_eq!(b.bsum(3), 16 * 127);
}

#[test]
fn errors_name_the_type() {
    let mut out = vec![0f32; 32];
    let e = quant::dequantize_row(Q4_1, &[0u8; 20], &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q4_1"), "{e}");
    let e = quant::dequantize_row(Q4_0, &[0u8; 17], &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q4_0") && e.contains("18"), "{e}");
    let mut out = vec![0f32; 100];
    let e = quant::dequantize_row(Q4_K, &[0u8; 144], &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q4_K") && e.contains("256"), "{e}");
    let e = quant::quantize_row(Q6_K, &[1.0; 100], &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q6_K"), "{e}");
    let e = quant::quantize_row(Q5_K, &[1.0; 256], &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q5_K"), "{e}");
}

#[test]
fn detected_isa_is_available() {
    let isa = quant::detected_isa();
    assert!(quant::isa_available(isa));
    assert!(quant::available_isas().contains(&Isa::Scalar));
    eprintln!("detected {isa:?}, available {:?}", quant::available_isas());
}

/// Q8_0x8 activations for `x`, and the plain Q8_0 activations they were laid out from.
fn q4_0x_activations(x: &[f32]) -> (Vec<u8>, Vec<u8>) {
    let (mut xq, mut xp) = (Vec::new(), Vec::new());
    quant::quantize_activation_q8(Q4_0, x, &mut xq);
    quant::quantize_activation_q4_0x(x, &mut xp);
    assert_eq!(xp.len(), quant::q4_0x_act_bytes(x.len()));
    (xq, xp)
}

/// Per-block integer sums are exact in every kernel; what differs is f32 summation order, bounded
/// by a few ulps of the sum of |products| (1e-5 of it, as `vec_dot_fast_matches_reference`).
fn q4_0x_tol(row: &[u8], xq: &[u8], n: usize) -> f32 {
    1e-5 * abs_dot(&dequantize(Q4_0, row, n), &dequantize(Q8_0, xq, n))
}

#[test]
fn vec_dot_q4_0x_matches_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    for n in [256usize, 768, 2048, 4096] {
        for row in random_rows(&mut rng, Q4_0, n) {
            let (xq, xp) = q4_0x_activations(&randn(&mut rng, n));
            let want = quant::vec_dot_q8_ref(Q4_0, &row, &xq);
            let tol = q4_0x_tol(&row, &xq, n);
            let r = quant::vec_dot_q4_0x_ref(&row, &xp);
            assert!((want - r).abs() <= tol, "n={n}: ref {r} vs q8 ref {want}");
            for isa in quant::available_isas() {
                let got = quant::vec_dot_q4_0x_isa(isa, &row, &xp);
                assert!(
                    (want - got).abs() <= tol,
                    "n={n} {isa:?}: {got} vs {want} (tol {tol})"
                );
            }
        }
    }
}

#[test]
fn vec_dot_q4_0x_rows_matches_reference() {
    // Enough rows that the prefetch window runs past the last row (it must stop there).
    let mut rng = StdRng::seed_from_u64(12);
    for (n, rows) in [(768usize, 64usize), (2048, 7), (256, 200)] {
        let (xq, xp) = q4_0x_activations(&randn(&mut rng, n));
        let (data, row_bytes) = q4_0_matrix(&mut rng, n, rows);
        let mut out = vec![0f32; rows];
        quant::vec_dot_q4_0x_rows(&data, row_bytes, &xp, &mut out);
        for (r, &got) in out.iter().enumerate() {
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            let want = quant::vec_dot_q8_ref(Q4_0, row, &xq);
            let tol = q4_0x_tol(row, &xq, n);
            assert!(
                (want - got).abs() <= tol,
                "n={n} row {r}: {got} vs {want} (tol {tol})"
            );
        }
    }
}

/// The batched kernel gives every activation exactly what the one-activation kernel gives it
/// (the batched CPU decode step's invariance rests on this), for 1 to 19 activations.
#[test]
fn vec_dot_q4_0x_acts_is_bit_exact_with_one_activation_at_a_time() {
    let mut rng = StdRng::seed_from_u64(13);
    for (n, rows) in [(768usize, 5usize), (2048, 3), (256, 2)] {
        let (data, row_bytes) = q4_0_matrix(&mut rng, n, rows);
        for count in [1usize, 2, 7, 8, 9, 19] {
            let acts: Vec<Vec<u8>> = (0..count)
                .map(|_| q4_0x_activations(&randn(&mut rng, n)).1)
                .collect();
            let refs: Vec<&[u8]> = acts.iter().map(|a| a.as_slice()).collect();
            // From every row to the last (prefetching up to the end of `data`, never past it).
            for r0 in 0..rows {
                let mut got = vec![0f32; count * (rows - r0)];
                quant::vec_dot_q4_0x_rows_acts(&data[r0 * row_bytes..], row_bytes, &refs, &mut got);
                for (r, got) in (r0..rows).zip(got.chunks(count)) {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    for (j, a) in refs.iter().enumerate() {
                        let want = quant::vec_dot_q4_0x(row, a);
                        assert_eq!(got[j].to_bits(), want.to_bits(), "n={n} row {r} act {j}");
                    }
                }
            }
        }
    }
}

#[test]
fn activation_q8_0_is_bit_exact_with_quantize_row() {
    let mut rng = StdRng::seed_from_u64(11);
    for n in [32usize, 64, 768, 2048] {
        for case in 0..20 {
            let mut x = randn(&mut rng, n);
            if case % 4 == 1 {
                // Values that land on exact halves after scaling (amax 127 -> id 1).
                for (i, v) in x.iter_mut().enumerate() {
                    *v = (i % 255) as f32 - 127.0 + if i % 3 == 0 { 0.5 } else { 0.0 };
                }
            }
            if case % 4 == 2 {
                x.iter_mut().take(32).for_each(|v| *v = 0.0);
            }
            let mut want = Vec::new();
            quant::quantize_row(Q8_0, &x, &mut want).unwrap();
            let mut got = Vec::new();
            quant::quantize_activation_q8(Q4_0, &x, &mut got);
            assert_eq!(got, want, "n={n} case {case}");
        }
    }
}

/// Issue 55 item 3: a NaN or an infinity in the activations reaches the dot product on every
/// path (as in the CUDA kernels) instead of being quantised to zero, so broken weights surface
/// as non-finite logits rather than as plausible garbage.
#[test]
fn non_finite_activations_are_never_hidden() {
    let mut rng = StdRng::seed_from_u64(17);
    let n = 512;
    for ty in INT {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 37, n - 1] {
                let row = &random_rows(&mut rng, ty, n)[0];
                let mut x = randn(&mut rng, n);
                x[at] = bad;
                let mut xq = Vec::new();
                quant::quantize_activation_q8(ty, &x, &mut xq);
                let want = quant::vec_dot_q8_ref(ty, row, &xq);
                assert!(
                    !want.is_finite(),
                    "{ty} {bad} at {at}: reference gave {want}"
                );
                for isa in quant::available_isas() {
                    let got = quant::vec_dot_q8_isa(isa, ty, row, &xq);
                    assert!(!got.is_finite(), "{ty} {isa:?} {bad} at {at}: {got}");
                }
                if ty == Q4_0 {
                    let (_, xp) = q4_0x_activations(&x);
                    for isa in quant::available_isas() {
                        let got = quant::vec_dot_q4_0x_isa(isa, row, &xp);
                        assert!(!got.is_finite(), "q4_0x {isa:?} {bad} at {at}: {got}");
                    }
                }
            }
        }
    }
}

/// Every ISA's Q4_0 x Q8_0x8 kernel (one row, rows, rows x N activations) gives bit for bit
/// what the scalar model of its arithmetic gives, hence what every other ISA gives: a sequence
/// computes the same alone (one activation, any ISA) as in a batch of any size.
#[test]
fn q4_0x_kernels_are_bit_exact_with_the_lane_model() {
    let mut rng = StdRng::seed_from_u64(19);
    for (n, rows) in [(256usize, 3usize), (768, 5), (2048, 2)] {
        // Random nibbles and scales (never zero) as well as quantised Gaussian rows.
        let (data, row_bytes) = q4_0_matrix(&mut rng, n, rows);
        let row = |r: usize| &data[r * row_bytes..(r + 1) * row_bytes];
        let acts: Vec<Vec<u8>> = (0..9)
            .map(|_| q4_0x_activations(&randn(&mut rng, n)).1)
            .collect();
        let want: Vec<Vec<u32>> = (0..rows)
            .map(|r| {
                acts.iter()
                    .map(|a| quant::vec_dot_q4_0x_lanes(row(r), a).to_bits())
                    .collect()
            })
            .collect();
        for isa in quant::available_isas()
            .into_iter()
            .filter(|&i| i >= Isa::Avx2)
        {
            for (r, want) in want.iter().enumerate() {
                for (j, a) in acts.iter().enumerate() {
                    let got = quant::vec_dot_q4_0x_isa(isa, row(r), a);
                    assert_eq!(got.to_bits(), want[j], "{isa:?} n={n} row {r} act {j}");
                }
            }
            for (j, a) in acts.iter().enumerate() {
                let mut out = vec![0f32; rows];
                quant::vec_dot_q4_0x_rows_isa(isa, &data, row_bytes, a, &mut out);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(
                        got.to_bits(),
                        want[r][j],
                        "{isa:?} rows n={n} row {r} act {j}"
                    );
                }
            }
            for count in 1..=acts.len() {
                let refs: Vec<&[u8]> = acts[..count].iter().map(|a| a.as_slice()).collect();
                let mut out = vec![0f32; rows * count];
                quant::vec_dot_q4_0x_rows_acts_isa(isa, &data, row_bytes, &refs, &mut out);
                for (r, got) in out.chunks(count).enumerate() {
                    for (j, got) in got.iter().enumerate() {
                        assert_eq!(
                            got.to_bits(),
                            want[r][j],
                            "{isa:?} N={count} n={n} row {r} act {j}"
                        );
                    }
                }
            }
        }
    }
}

/// Several activations against a run of rows give each (row, activation) pair `vec_dot_q8`'s
/// bits: Q4_K (rows unpacked once for up to four activations; 1 to 9 activations, so every
/// group size and a remainder) and the other integer types (a `vec_dot_q8` a pair), over rows of
/// quantised data and random bytes, with a slice reaching past the rows computed.
#[test]
fn vec_dot_q8_rows_acts_gives_each_pair_vec_dot_q8_bits() {
    let mut rng = StdRng::seed_from_u64(21);
    for ty in INT {
        let n = 512;
        let rows: Vec<u8> = (0..6)
            .flat_map(|r| random_rows(&mut rng, ty, n).swap_remove(r % 2))
            .collect();
        let row_bytes = rows.len() / 6;
        for k in 1..=9 {
            let acts: Vec<Vec<u8>> = (0..k)
                .map(|_| {
                    let mut q = Vec::new();
                    quant::quantize_activation_q8(ty, &randn(&mut rng, n), &mut q);
                    q
                })
                .collect();
            let refs: Vec<&[u8]> = acts.iter().map(|a| &a[..]).collect();
            let mut out = vec![f32::NAN; 5 * k];
            quant::vec_dot_q8_rows_acts(ty, &rows, row_bytes, &refs, &mut out);
            for (i, o) in out.chunks(k).enumerate() {
                let row = &rows[i * row_bytes..(i + 1) * row_bytes];
                for (j, (&got, a)) in o.iter().zip(&refs).enumerate() {
                    let want = quant::vec_dot_q8(ty, row, a);
                    assert!(want.is_finite(), "{ty} row {i} act {j}: {want}");
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} row {i} act {j} of {k}");
                }
            }
        }
    }
}
