//! Micro benchmark: GB/s of weight bytes streamed by vec_dot / vec_dot_q8 over a working set
//! larger than L3 (so the figure is memory bandwidth, not cache). Plain std::time.
//!
//! `cargo bench -p q4moe-gguf --bench vec_dot` (env: Q4MOE_BENCH_MB = working set, default 256;
//! Q4MOE_BENCH_THREADS = extra multi-threaded run, default all cores).

use std::hint::black_box;
use std::time::Instant;

use q4moe_gguf::quant::{self, Isa};
use q4moe_gguf::GgmlType::{self, *};

/// Fast deterministic bytes (xorshift), since quantising 256 MB would take minutes.
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// Random payload with sane f16 scales in every block.
fn random_rows(ty: GgmlType, total: usize) -> Vec<u8> {
    let mut w = random_bytes(total / ty.type_size() * ty.type_size(), 42);
    // Real weights' scales vary block to block (Q4MOE_BENCH_SCALES=fixed: all 0.01).
    let fixed = std::env::var("Q4MOE_BENCH_SCALES").is_ok_and(|v| v == "fixed");
    let mut s = 0x9e37_79b9_u32;
    for b in w.chunks_exact_mut(ty.type_size()) {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        let d = if fixed {
            0.01
        } else {
            0.002 + (s % 10_000) as f32 * 4e-6
        };
        let d = half::f16::from_f32(d).to_le_bytes();
        let offs: &[usize] = match ty {
            Q4_K => &[0, 2],
            Q6_K => &[208],
            _ => &[0],
        };
        for &o in offs {
            b[o..o + 2].copy_from_slice(&d);
        }
    }
    w
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Best of a few passes over all rows, split across `threads`; returns GB/s of weights.
/// CPU time of the calling thread (s): on a shared machine, single-thread figures that exclude
/// time the thread was preempted (Q4MOE_BENCH_CPUTIME=1).
fn thread_cpu_time() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clk: i32, tp: *mut Timespec) -> i32;
    }
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: CLOCK_THREAD_CPUTIME_ID = 3 on Linux; `t` is a valid out pointer.
    unsafe { clock_gettime(3, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

fn measure(w: &[u8], row_bytes: usize, threads: usize, dot: &(dyn Fn(&[u8]) -> f32 + Sync)) -> f64 {
    let rows_per = (w.len() / row_bytes).div_ceil(threads) * row_bytes;
    let mut best = f64::MAX;
    let cpu = std::env::var("Q4MOE_BENCH_CPUTIME").is_ok();
    for _ in 0..4 {
        let t = Instant::now();
        if threads == 1 {
            // Inline, so small (cache-resident) working sets do not time a thread spawn.
            let c = thread_cpu_time();
            black_box(w.chunks_exact(row_bytes).map(dot).sum::<f32>());
            best = best.min(if cpu {
                thread_cpu_time() - c
            } else {
                t.elapsed().as_secs_f64()
            });
            continue;
        }
        std::thread::scope(|s| {
            for part in w.chunks(rows_per) {
                s.spawn(move || {
                    let mut acc = 0f32;
                    for row in part.chunks_exact(row_bytes) {
                        acc += dot(row);
                    }
                    black_box(acc)
                });
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    w.len() as f64 / best / 1e9
}

fn main() {
    let total = env("Q4MOE_BENCH_MB", 256) << 20;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = env("Q4MOE_BENCH_THREADS", cores);
    println!(
        "working set {} MB, isa {:?} (available {:?}), {cores} cores",
        total >> 20,
        quant::detected_isa(),
        quant::available_isas()
    );
    println!(
        "{:<6} {:>5} {:>8} {:>14} {:>14}",
        "type", "n", "threads", "vec_dot GB/s", "vec_dot_q8 GB/s"
    );
    let w = random_bytes(total, 1);
    let mut counts = vec![1];
    if threads > 1 {
        counts.push(threads);
    }
    for &t in &counts {
        // Baseline: plain streaming read of the same working set (u64 sums, vectorised).
        let read = |r: &[u8]| {
            r.chunks_exact(8).fold(0u64, |a, c| {
                a.wrapping_add(u64::from_le_bytes(c.try_into().unwrap()))
            }) as f32
        };
        println!(
            "{:<6} {:>5} {t:>8} {:>14.2} (plain read)",
            "read",
            2048,
            measure(&w, 2048, t, &read)
        );
    }
    drop(w);
    for ty in [Q4_0, Q4_K, Q6_K] {
        let w = random_rows(ty, total);
        for n in [2048usize, 768] {
            let row_bytes = ty.row_bytes(n).unwrap();
            let x: Vec<f32> = random_bytes(n, 7)
                .iter()
                .map(|&b| b as f32 / 128.0 - 1.0)
                .collect();
            let mut xq = Vec::new();
            quant::quantize_activation_q8(ty, &x, &mut xq);
            for &t in &counts {
                let f = measure(&w, row_bytes, t, &|r| quant::vec_dot(ty, r, &x));
                let q = measure(&w, row_bytes, t, &|r| quant::vec_dot_q8(ty, r, &xq));
                if quant::q4_0x_applies(ty, n) {
                    let mut xp = Vec::new();
                    quant::quantize_activation_q4_0x(&x, &mut xp);
                    let p = measure(&w, row_bytes, t, &|r| quant::vec_dot_q4_0x(r, &xp));
                    // 32 rows per call, as the CPU backend's tasks do.
                    let rows32 = measure(&w, 32 * row_bytes, t, &|r| {
                        let mut o = [0f32; 32];
                        quant::vec_dot_q4_0x_rows(r, row_bytes, &xp, &mut o);
                        o[0] + o[31]
                    });
                    let rows64 = measure(&w, 64 * row_bytes, t, &|r| {
                        let mut o = [0f32; 64];
                        quant::vec_dot_q4_0x_rows(r, row_bytes, &xp, &mut o);
                        o[0] + o[63]
                    });
                    println!("{:<6} {n:>5} {t:>8} {f:>14.2} {q:>14.2} (q4_0x {p:.2}, 32 rows/call {rows32:.2}, 64 rows/call {rows64:.2})", ty.name());
                } else {
                    println!("{:<6} {n:>5} {t:>8} {f:>14.2} {q:>14.2}", ty.name());
                }
            }
        }
    }
    if std::env::var("Q4MOE_BENCH_ISAS").is_ok() {
        compare_isas(total);
    }
}

/// Single-thread q8 throughput per ISA (to see what VNNI buys).
fn compare_isas(total: usize) {
    for ty in [Q4_0, Q8_0] {
        let w = random_rows(ty, total);
        let n = 2048;
        let x: Vec<f32> = random_bytes(n, 7)
            .iter()
            .map(|&b| b as f32 / 128.0 - 1.0)
            .collect();
        let mut xq = Vec::new();
        quant::quantize_activation_q8(ty, &x, &mut xq);
        for isa in quant::available_isas()
            .into_iter()
            .filter(|&i| i != Isa::Scalar)
        {
            let q = measure(&w, ty.row_bytes(n).unwrap(), 1, &|r| {
                quant::vec_dot_q8_isa(isa, ty, r, &xq)
            });
            println!("{:<6} {n:>5} {isa:?} vec_dot_q8 {q:.2} GB/s", ty.name());
        }
    }
}
