//! Timing of the Q4_0 x Q8_0x8 kernels on expert-like shapes, one thread, plain std::time:
//! `vec_dot_q4_0x_rows` (one activation) and `vec_dot_q4_0x_rows_acts` (N activations), called
//! on runs of 64 rows as the CPU backend's batched step calls them, over a working set of
//! several experts (so weights stream from beyond L2 as in a decode step).
//!
//! `cargo run --release -p q4moe-gguf --example q4x_timing [reps]` (env: Q4X_ISA = avx2,
//! avxvnni or avx512vnni to time that ISA's kernel instead of the detected one's; Q4X_EXPERTS,
//! Q4X_ALIGN below).
//!
//! Each line ends with a hash of every output's bits: two builds (say, before and after a
//! kernel change) that print the same hashes computed the same values.

use std::hint::black_box;
use std::time::Instant;

use q4moe_gguf::quant::{self, Isa};

/// Rows per call, as the CPU backend's `RUN_ROWS`.
const RUN_ROWS: usize = 64;

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Random Q4_0 rows with sane, varying f16 scales.
fn q4_0_rows(n_bytes: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut w: Vec<u8> = (0..n_bytes)
        .map(|_| (xorshift(&mut s) >> 24) as u8)
        .collect();
    for b in w.chunks_exact_mut(18) {
        let d = 0.002 + (xorshift(&mut s) % 10_000) as f32 * 4e-6;
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    }
    w
}

fn activation(k: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let x: Vec<f32> = (0..k)
        .map(|_| (xorshift(&mut s) % 20_001) as f32 / 10_000.0 - 1.0)
        .collect();
    let mut out = Vec::new();
    quant::quantize_activation_q4_0x(&x, &mut out);
    out
}

fn fold(h: u64, v: &[f32]) -> u64 {
    v.iter().fold(h, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn main() {
    let isa = match std::env::var("Q4X_ISA").as_deref() {
        Ok("avx2") => Isa::Avx2,
        Ok("avxvnni") => Isa::AvxVnni,
        Ok("avx512vnni") => Isa::Avx512Vnni,
        _ => quant::detected_isa(),
    };
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    // Q4X_EXPERTS=1: one matrix, which stays in L2 (the kernel's compute alone).
    let experts = std::env::var("Q4X_EXPERTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    println!(
        "{:<12} {:>2} {:>10} {:>10} {:>8}  hash",
        "rows x k", "N", "ns/row", "ns/row.act", "GB/s"
    );
    for (rows, k) in [(768usize, 2048usize), (2048, 768)] {
        let row_bytes = k / 32 * 18;
        let w = q4_0_rows(experts * rows * row_bytes, (rows * k) as u64);
        let acts: Vec<Vec<u8>> = (0..8).map(|j| activation(k, 7 + j)).collect();
        // All activations in one buffer at Q4X_ALIGN bytes past a 64-byte boundary (default
        // 16: what malloc gives), as the CPU backend's one buffer per batch.
        let act_bytes = acts[0].len();
        let mut buf = vec![0u8; 8 * act_bytes + 128];
        let skew = std::env::var("Q4X_ALIGN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16usize);
        let at = (64 - buf.as_ptr() as usize % 64) % 64 + skew;
        for (j, a) in acts.iter().enumerate() {
            buf[at + j * act_bytes..at + (j + 1) * act_bytes].copy_from_slice(a);
        }
        let refs: Vec<&[u8]> = (0..8)
            .map(|j| &buf[at + j * act_bytes..at + (j + 1) * act_bytes])
            .collect();
        for n in [0usize, 1, 2, 3, 4, 8] {
            // N = 0 stands for the one-activation kernel (`vec_dot_q4_0x_rows`).
            let width = n.max(1);
            let mut out = vec![0f32; RUN_ROWS * width];
            let mut hash = 0xcbf2_9ce4_8422_2325u64;
            let mut best = f64::MAX;
            for rep in 0..reps + 1 {
                let t = Instant::now();
                for e in 0..experts {
                    let m = &w[e * rows * row_bytes..(e + 1) * rows * row_bytes];
                    for r in (0..rows).step_by(RUN_ROWS) {
                        let run = &m[r * row_bytes..];
                        if n == 0 {
                            quant::vec_dot_q4_0x_rows_isa(isa, run, row_bytes, refs[0], &mut out);
                        } else {
                            quant::vec_dot_q4_0x_rows_acts_isa(
                                isa,
                                run,
                                row_bytes,
                                &refs[..n],
                                &mut out,
                            );
                        }
                        if rep == 0 {
                            hash = fold(hash, &out);
                        }
                        black_box(&mut out);
                    }
                }
                if rep > 0 {
                    best = best.min(t.elapsed().as_secs_f64());
                }
            }
            let total_rows = (experts * rows) as f64;
            let ns_row = best * 1e9 / total_rows;
            let label = if n == 0 {
                "1*".to_string()
            } else {
                n.to_string()
            };
            println!(
                "{:<12} {label:>2} {ns_row:>10.1} {:>10.1} {:>8.2}  {hash:016x}",
                format!("{rows}x{k}"),
                ns_row / width as f64,
                total_rows * row_bytes as f64 / best / 1e9,
            );
        }
    }
    println!(
        "(N = 1*: vec_dot_q4_0x_rows; the rest vec_dot_q4_0x_rows_acts; best of {reps}; {isa:?})"
    );
}
