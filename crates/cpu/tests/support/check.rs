//! The CPU backend against a golden run (oracle.rs, matrix.rs): every prompt position (one
//! prefill with all logits), every decode position teacher-forced on the reference's greedy
//! tokens (one-token prefills), and our own greedy decode (`backend.decode`, argmax sampler)
//! from the prompt: its tokens, and its logits while they follow the reference's.

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_model::backend::{Backend, DecodeRequest, Flow, KvType, Logits};
use q4moe_model::sampling::{argmax, SamplingParams};
use q4moe_model::Model;

use super::Golden;

/// max |ours - ref| / max |ref| over a fixture's logits. The reference is float64 (with
/// transformers' own float32 steps: RMSNorm, softmax, RoPE tables); we compute in f32 on the same
/// dequantised weights, so what is left is f32 rounding and accumulation order, measured at
/// ~1e-6 (see tools/oracle/README.md). 1e-4 leaves ~2 orders of margin and still sits two orders
/// below what a broken op costs (>= 1e-2).
pub const TOL: f32 = 1e-4;

/// The fast path quantises activations to 8 bits per product (as llama.cpp does). Measured median
/// (over positions) relative logit errors: 2.2e-3 (mid q4_0), 5.2e-3 (tiny q4_0), 2.3e-2
/// (tiny q4_k). Where the router's k-th and (k+1)-th experts are nearly tied (these random models
/// have gaps down to 2e-5) the rounding can pick the other expert: that position's logits move by
/// up to ~0.6 of the largest, and its keys and values shift every later position a little. So
/// the bound is on the median, and the greedy tokens must still all match.
pub const Q8_MEDIAN_TOL: f32 = 5e-2;

/// Relative error of `ours` against reference row(s) `reference`; NaN/inf anywhere gives +inf.
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    abs_err(ours, reference) / scale
}

/// max |ours - reference|; NaN/inf anywhere gives +inf.
pub fn abs_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let mut err = 0.0f32;
    for (a, b) in ours.iter().zip(reference) {
        let d = (a - b).abs();
        if !d.is_finite() {
            return f32::INFINITY;
        }
        err = err.max(d);
    }
    err
}

/// Worst relative error seen in one kind of check, and where.
#[derive(Default, Clone)]
pub struct Worst {
    pub err: f32,
    pub pos: usize,
    /// The largest absolute difference on any row.
    pub abs: f32,
    /// Every position's error, for the median.
    pub all: Vec<f32>,
}

impl Worst {
    fn see(&mut self, g: &Golden, pos: usize, ours: &[f32]) {
        let err = rel_err(ours, g.row(pos));
        self.abs = self.abs.max(abs_err(ours, g.row(pos)));
        self.all
            .push(if err.is_nan() { f32::INFINITY } else { err });
        if err > self.err || err.is_nan() {
            (self.err, self.pos) = (err, pos);
        }
    }

    pub fn median(&self) -> f32 {
        let mut v = self.all.clone();
        v.sort_by(f32::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f32::INFINITY)
    }
}

/// Prompt in one prefill, then the reference's tokens one at a time (teacher-forced). Also
/// returns each row's argmax.
fn teacher_forced(g: &Golden, b: &mut CpuBackend) -> (Worst, Worst, Vec<u32>) {
    let (np, vocab) = (g.n_prompt, g.vocab);
    let all = b.prefill(0, &g.tokens[..np], Logits::All).expect("prefill");
    let mut prefill = Worst::default();
    (0..np).for_each(|i| prefill.see(g, i, &all[i * vocab..(i + 1) * vocab]));
    let mut picks: Vec<u32> = all.chunks(vocab).map(argmax).collect();
    let mut decode = Worst::default();
    for i in np..g.tokens.len() {
        let row = b
            .prefill(0, &g.tokens[i..=i], Logits::Last)
            .expect("one-token prefill");
        decode.see(g, i, &row);
        picks.push(argmax(&row));
    }
    (prefill, decode, picks)
}

/// Our own greedy generation from the prompt; returns the generated tokens and the logits error.
fn greedy(g: &Golden, b: &mut CpuBackend) -> (Vec<u32>, Worst) {
    let np = g.n_prompt;
    let last = b
        .prefill(1, &g.tokens[..np], Logits::Last)
        .expect("prefill");
    let mut out = vec![argmax(&last)];
    let mut worst = Worst::default();
    let greedy = SamplingParams::greedy();
    let req = DecodeRequest {
        session: 1,
        first_token: out[0],
        max_tokens: g.n_gen - 1,
        sampling: &greedy,
        history: &g.tokens[..np],
        want_logits: true,
    };
    b.decode(&req, &mut |ev| {
        let pos = np + out.len() - 1;
        // Rows past a divergence are another sequence's; the token check reports it.
        if out[..] == g.tokens[np..np + out.len()] {
            worst.see(g, pos, ev.logits.expect("want_logits"));
        }
        out.push(ev.token);
        Flow::Continue
    })
    .expect("decode");
    (out, worst)
}

/// What a run must meet: the bound and whether it applies to every position or to the median.
#[derive(Clone, Copy, Debug)]
pub enum Bound {
    Max(f32),
    Median(f32),
}

/// Which of our greedy tokens must be the reference's.
#[derive(Clone, Copy, Debug)]
pub enum Greedy {
    /// Every step: the bound is far below the reference's smallest top-2 gap.
    All,
    /// Up to the first step whose teacher-forced row (our logits on the reference's own
    /// prefix) already picks another token: for a path whose error can exceed the reference's
    /// top-2 gaps, the steps where it cannot have flipped.
    WhileForcedAgrees,
}

/// One configuration of the CPU backend and what it must meet.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    pub precision: Precision,
    pub kv_type: KvType,
    pub bound: Bound,
    pub greedy: Greedy,
}

/// The three kinds of rows' errors and our greedy tokens.
pub struct Measured {
    pub prefill: Worst,
    pub forced: Worst,
    pub decoded: Worst,
    pub tokens: Vec<u32>,
    /// The first greedy step whose token differs from the reference's.
    pub first_diff: Option<usize>,
    /// Greedy steps held to the reference's tokens (Expect::greedy).
    pub compared: usize,
}

/// Runs the three checks on `model` against `g`, prints what they measured, and fails where
/// `want` is not met.
pub fn run(name: &str, g: &Golden, model: Arc<Model>, want: Expect) -> Measured {
    let mut b = CpuBackend::with_precision(model, g.tokens.len() + 8, want.precision)
        .with_kv_type(want.kv_type);
    let (prefill, forced, picks) = teacher_forced(g, &mut b);
    let (tokens, decoded) = greedy(g, &mut b);
    let reference = &g.tokens[g.n_prompt..];
    let first_diff = tokens.iter().zip(reference).position(|(a, b)| a != b);
    // Step s's token is the argmax of row n_prompt - 1 + s.
    let compared = match want.greedy {
        Greedy::All => g.n_gen,
        Greedy::WhileForcedAgrees => (picks[g.n_prompt - 1..].iter().zip(reference))
            .position(|(a, b)| a != b)
            .unwrap_or(g.n_gen),
    };
    let m = Measured {
        prefill,
        forced,
        decoded,
        tokens,
        first_diff,
        compared,
    };
    report(name, g, &m, &want);
    assert_met(name, g, &m, &want);
    m
}

fn report(name: &str, g: &Golden, m: &Measured, want: &Expect) {
    eprintln!(
        "{name}: max rel logit error prefill {:.2e}, teacher-forced decode {:.2e}, greedy decode {:.2e} \
         (max abs {:.2e}; {:?}, KV {:?}, {:?}; median errors {:.2e} / {:.2e} / {:.2e}; reference greedy gap {:.1e}, router gap {:.1e}); greedy tokens {}",
        m.prefill.err,
        m.forced.err,
        m.decoded.err,
        m.prefill.abs.max(m.forced.abs).max(m.decoded.abs),
        want.precision,
        want.kv_type,
        want.bound,
        m.prefill.median(),
        m.forced.median(),
        m.decoded.median(),
        g.greedy_gap,
        g.router_gap,
        m.first_diff.map_or(format!("all {} match", g.n_gen), |s| format!("diverge at step {s}"))
    );
    if m.compared < g.n_gen {
        eprintln!(
            "{name}: {:?}: our teacher-forced row picks another token at step {}: greedy tokens compared up to it",
            want.precision, m.compared
        );
    }
}

fn assert_met(name: &str, g: &Golden, m: &Measured, want: &Expect) {
    let precision = want.precision;
    for (what, w) in [
        ("prefill", &m.prefill),
        ("teacher-forced decode", &m.forced),
        ("greedy decode", &m.decoded),
    ] {
        match want.bound {
            Bound::Max(tol) => assert!(
                w.err <= tol,
                "{name} {precision:?}: {what}: max relative logit error {:.3e} (worst at position {}) > {tol:e}",
                w.err,
                w.pos
            ),
            Bound::Median(tol) => assert!(
                w.median() <= tol,
                "{name} {precision:?}: {what}: median relative logit error {:.3e} > {tol:e}",
                w.median()
            ),
        }
    }
    let reference = &g.tokens[g.n_prompt..];
    assert_eq!(m.tokens.len(), reference.len(), "{name}: greedy length");
    let n = m.compared;
    assert!(
        m.tokens[..n] == reference[..n],
        "{name} {precision:?}: greedy tokens differ from the reference's at step {:?} (of the first {n} compared)\n ours: {:?}\n  ref: {reference:?}",
        m.first_diff,
        m.tokens
    );
}
