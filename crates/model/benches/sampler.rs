//! Micro benchmark: milliseconds a draw of the host sampler over a full Qwen3 vocabulary, for
//! the settings the GPU hands to the host (top-k off) and one it keeps on the device, to set
//! against the step's ~2.3 ms. Each draw includes copying the logits, as a decode step does.
//! Plain std::time; the best of 15 rounds of 50 draws.
//!
//! `cargo bench -p q4moe-model --bench sampler`

use std::hint::black_box;
use std::time::Instant;

use q4moe_model::backend::{choose_on_host, choose_row, BatchRow, RowCopies};
use q4moe_model::sampling::{Sampler, SamplingParams};

/// 151,936 uniform logits in [-12, 12) (xorshift, fixed seed).
fn logits() -> Vec<f32> {
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..151_936)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / 16_777_216.0 - 0.5) * 24.0
        })
        .collect()
}

fn main() {
    let lg = logits();
    let settings = [
        ("temperature 1, no cut (OpenAI defaults)", 1.0, 0, 1.0),
        ("temperature 0.6, top-p 0.95, top-k off", 0.6, 0, 0.95),
        ("temperature 0.6, top-k 20, top-p 0.95", 0.6, 20, 0.95),
    ];
    for (name, temperature, top_k, top_p) in settings {
        let p = SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p, &[]);
        let best = (0..15)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..50 {
                    black_box(s.sample(&mut lg.clone()));
                }
                t.elapsed().as_secs_f64() * 1e3 / 50.0
            })
            .fold(f64::MAX, f64::min);
        println!("{name:<42} {best:7.3} ms a draw");
    }
    batch_rows(&lg);
}

/// A batched step's 16 sampled rows (temperature 0.6, top-k 20, top-p 0.95): drawn one after
/// another, then in parallel across rows (`choose_on_host`); ms a step, best of 15 rounds of 10.
fn batch_rows(lg: &[f32]) {
    const ROWS: usize = 16;
    let logits: Vec<f32> = (0..ROWS).flat_map(|_| lg.iter().copied()).collect();
    let p = SamplingParams {
        temperature: 0.6,
        top_k: 20,
        top_p: 0.95,
        seed: 1,
        ..Default::default()
    };
    let mut samplers: Vec<Sampler> = (0..ROWS).map(|_| Sampler::new(p.clone(), &[])).collect();
    let (mut copies, mut tmp) = (RowCopies::default(), Vec::new());
    for parallel in [false, true] {
        let best = (0..15)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..10 {
                    let mut rows: Vec<BatchRow<'_>> = samplers
                        .iter_mut()
                        .map(|s| BatchRow {
                            session: 0,
                            token: 0,
                            sampler: Some(s),
                            logits: false,
                        })
                        .collect();
                    let mut tokens = vec![None; ROWS];
                    if parallel {
                        choose_on_host(&mut rows, &logits, &[true; ROWS], &mut copies, &mut tokens);
                    } else {
                        for (i, row) in rows.iter_mut().enumerate() {
                            tokens[i] =
                                choose_row(row, &logits[i * lg.len()..][..lg.len()], &mut tmp);
                        }
                    }
                    black_box(tokens);
                }
                t.elapsed().as_secs_f64() * 1e3 / 10.0
            })
            .fold(f64::MAX, f64::min);
        let how = if parallel {
            "in parallel"
        } else {
            "one after another"
        };
        println!("{ROWS} sampled rows of a batched step, {how:<17} {best:7.3} ms a step");
    }
}
