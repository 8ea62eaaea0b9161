//! The CPU backend against transformers (DESIGN.md section 7): golden logits written by
//! tools/oracle/make_fixtures.py from `Qwen3MoeForCausalLM` in float64 on the dequantised
//! weights of a `q4moe synth` GGUF. The GGUF is regenerated here from the fixture's synth
//! parameters and must hash to the fixture's sha256.
//!
//! Checked per fixture: every prompt position (one prefill with all logits), every decode
//! position teacher-forced on the reference's greedy tokens (one-token prefills), and our own
//! greedy decode (`backend.decode`, argmax sampler) from the prompt: same tokens at every step,
//! and its logits within tolerance too.

mod support;

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_model::backend::{Backend, DecodeRequest, Flow, KvType, Logits};
use q4moe_model::sampling::{argmax, SamplingParams};
use q4moe_model::{synth, Model};
use support::Fixture;

/// max |ours - ref| / max |ref| over a fixture's logits. The reference is float64 (with
/// transformers' own float32 steps: RMSNorm, softmax, RoPE tables); we compute in f32 on the same
/// dequantised weights, so what is left is f32 rounding and accumulation order, measured at
/// ~1e-6 (see tools/oracle/README.md). 1e-4 leaves ~2 orders of margin and still sits two orders
/// below what a broken op costs (>= 1e-2).
const TOL: f32 = 1e-4;
/// The f16 KV cache against transformers' f32 one (exact path): measured max 7.6e-5 (mid q4_0).
const KV_F16_TOL: f32 = 5e-4;

/// Deletes the regenerated GGUF however the test ends.
struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn regenerate(fx: &Fixture) -> (TempFile, Arc<Model>) {
    // Tests run in parallel threads of one process: each regenerates into its own file.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "q4moe-oracle-{}-{}-{n}.gguf",
        fx.name,
        std::process::id()
    ));
    let file = TempFile(path);
    synth::write(&file.0, &fx.config, fx.quant, fx.seed, false).expect("synth::write");
    let sha = support::sha256(&std::fs::read(&file.0).expect("read regenerated GGUF"));
    assert!(
        sha == fx.gguf_sha256,
        "{}: the GGUF synth::write makes now (sha256 {}) is not the one the fixture was made from ({}): \
         synth's output changed, so the golden logits no longer apply. Rerun tools/oracle/make_fixtures.py \
         (see tools/oracle/README.md) and commit the new fixtures.",
        fx.name,
        support::hex(&sha),
        support::hex(&fx.gguf_sha256)
    );
    let model = Arc::new(Model::load(&file.0).expect("load regenerated GGUF"));
    assert_eq!(
        model.config, fx.config,
        "{}: loaded geometry differs from the fixture's",
        fx.name
    );
    (file, model)
}

/// Relative error of `ours` against reference row(s) `reference`; NaN/inf anywhere gives +inf.
fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let mut err = 0.0f32;
    for (a, b) in ours.iter().zip(reference) {
        let d = (a - b).abs();
        if !d.is_finite() {
            return f32::INFINITY;
        }
        err = err.max(d);
    }
    err / scale
}

/// Worst relative error seen in one kind of check, and where.
#[derive(Default, Clone)]
struct Worst {
    err: f32,
    pos: usize,
    /// Every position's error, for the median.
    all: Vec<f32>,
}

impl Worst {
    fn see(&mut self, fx: &Fixture, pos: usize, ours: &[f32]) {
        let err = rel_err(ours, fx.row(pos));
        self.all
            .push(if err.is_nan() { f32::INFINITY } else { err });
        if err > self.err || err.is_nan() {
            (self.err, self.pos) = (err, pos);
        }
    }

    fn median(&self) -> f32 {
        let mut v = self.all.clone();
        v.sort_by(f32::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f32::INFINITY)
    }
}

/// Prompt in one prefill, then the reference's tokens one at a time (teacher-forced).
fn teacher_forced(fx: &Fixture, b: &mut CpuBackend) -> (Worst, Worst) {
    let (np, vocab) = (fx.n_prompt, fx.vocab);
    let all = b
        .prefill(0, &fx.tokens[..np], Logits::All)
        .expect("prefill");
    let mut prefill = Worst::default();
    (0..np).for_each(|i| prefill.see(fx, i, &all[i * vocab..(i + 1) * vocab]));
    let mut decode = Worst::default();
    for i in np..fx.tokens.len() {
        let row = b
            .prefill(0, &fx.tokens[i..=i], Logits::Last)
            .expect("one-token prefill");
        decode.see(fx, i, &row);
    }
    (prefill, decode)
}

/// Our own greedy generation from the prompt; returns the generated tokens and the logits error.
fn greedy(fx: &Fixture, b: &mut CpuBackend) -> (Vec<u32>, Worst) {
    let np = fx.n_prompt;
    let last = b
        .prefill(1, &fx.tokens[..np], Logits::Last)
        .expect("prefill");
    let mut out = vec![argmax(&last)];
    let mut worst = Worst::default();
    let greedy = SamplingParams::greedy();
    let req = DecodeRequest {
        session: 1,
        first_token: out[0],
        max_tokens: fx.n_gen - 1,
        sampling: &greedy,
        history: &fx.tokens[..np],
        want_logits: true,
    };
    b.decode(&req, &mut |ev| {
        let pos = np + out.len() - 1;
        // Rows past a divergence are another sequence's; the token assert below reports it.
        if out[..] == fx.tokens[np..np + out.len()] {
            worst.see(fx, pos, ev.logits.expect("want_logits"));
        }
        out.push(ev.token);
        Flow::Continue
    })
    .expect("decode");
    (out, worst)
}

/// The fast path quantises activations to 8 bits per product (as llama.cpp does). Measured median
/// (over positions) relative logit errors: 2.2e-3 (mid q4_0), 5.2e-3 (tiny q4_0), 2.3e-2
/// (tiny q4_k). Where the router's k-th and (k+1)-th experts are nearly tied (these random models
/// have gaps down to 2e-5) the rounding can pick the other expert: that position's logits move by
/// up to ~0.6 of the largest, and its keys and values shift every later position a little. So
/// the bound is on the median, and the greedy tokens must still all match.
const Q8_MEDIAN_TOL: f32 = 5e-2;

/// What a run must meet: the bound and whether it applies to every position or to the median.
#[derive(Clone, Copy, Debug)]
enum Bound {
    Max(f32),
    Median(f32),
}

/// transformers' cache holds f32: the exact comparison keeps ours f32 too.
fn run(name: &str) {
    run_with(name, Precision::Exact, KvType::F32, Bound::Max(TOL));
}

fn run_with(name: &str, precision: Precision, kv_type: KvType, bound: Bound) {
    let fx = support::load(name);
    let (_file, model) = regenerate(&fx);
    let mut b =
        CpuBackend::with_precision(model, fx.tokens.len() + 8, precision).with_kv_type(kv_type);
    let (prefill, forced) = teacher_forced(&fx, &mut b);
    let (tokens, decoded) = greedy(&fx, &mut b);
    let want = &fx.tokens[fx.n_prompt..];
    let first_diff = tokens.iter().zip(want).position(|(a, b)| a != b);
    eprintln!(
        "{name}: max rel logit error prefill {:.2e}, teacher-forced decode {:.2e}, greedy decode {:.2e} \
         ({precision:?}, KV {kv_type:?}, {bound:?}; median errors {:.2e} / {:.2e} / {:.2e}; reference greedy gap {:.1e}, router gap {:.1e}); greedy tokens {}",
        prefill.err,
        forced.err,
        decoded.err,
        prefill.median(),
        forced.median(),
        decoded.median(),
        fx.greedy_gap,
        fx.router_gap,
        first_diff.map_or(format!("all {} match", want.len()), |s| format!("diverge at step {s}"))
    );
    for (what, w) in [
        ("prefill", &prefill),
        ("teacher-forced decode", &forced),
        ("greedy decode", &decoded),
    ] {
        match bound {
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
    assert!(
        first_diff.is_none() && tokens.len() == want.len(),
        "{name}: greedy tokens differ from transformers' at step {first_diff:?}\n ours: {tokens:?}\n  ref: {want:?}"
    );
}

#[test]
fn oracle_tiny_q4_0() {
    run("tiny_q4_0");
}

#[test]
fn oracle_tiny_q4_k() {
    run("tiny_q4_k");
}

#[test]
fn oracle_mid_q4_0() {
    run("mid_q4_0");
}

/// The f16 cache (the default) on the exact path: each key and value rounded to 2^-11
/// relative, what the GPU's cache holds too.
#[test]
fn oracle_kv_f16_mid_q4_0() {
    run_with(
        "mid_q4_0",
        Precision::Exact,
        KvType::F16,
        Bound::Max(KV_F16_TOL),
    );
}

#[test]
fn oracle_q8_activations_tiny_q4_0() {
    run_with(
        "tiny_q4_0",
        Precision::Q8,
        KvType::F16,
        Bound::Median(Q8_MEDIAN_TOL),
    );
}

#[test]
fn oracle_q8_activations_tiny_q4_k() {
    run_with(
        "tiny_q4_k",
        Precision::Q8,
        KvType::F16,
        Bound::Median(Q8_MEDIAN_TOL),
    );
}

#[test]
fn oracle_q8_activations_mid_q4_0() {
    run_with(
        "mid_q4_0",
        Precision::Q8,
        KvType::F16,
        Bound::Median(Q8_MEDIAN_TOL),
    );
}

#[test]
fn sha256_matches_known_vectors() {
    assert_eq!(
        support::hex(&support::sha256(b"")),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        support::hex(&support::sha256(&[b'a'; 1000])),
        "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3"
    );
}
