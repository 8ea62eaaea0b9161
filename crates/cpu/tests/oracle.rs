//! The CPU backend against transformers (DESIGN.md section 7): golden logits written by
//! tools/oracle/make_fixtures.py from `Qwen3MoeForCausalLM` in float64 on the dequantised
//! weights of a `q4moe synth` GGUF. The GGUF is regenerated here from the fixture's synth
//! parameters and must hash to the fixture's sha256. The checks are support/check.rs's: every
//! prompt row, every teacher-forced decode row, and our own greedy decode (tokens and logits).

mod support;

use std::sync::Arc;

use q4moe_cpu::Precision;
use q4moe_model::backend::KvType;
use q4moe_model::{synth, Model};
use support::check::{self, Bound, Expect, Greedy, Q8_MEDIAN_TOL, TOL};
use support::Fixture;

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

/// transformers' cache holds f32: the exact comparison keeps ours f32 too.
fn run(name: &str) {
    run_with(name, Precision::Exact, KvType::F32, Bound::Max(TOL));
}

fn run_with(name: &str, precision: Precision, kv_type: KvType, bound: Bound) {
    let fx = support::load(name);
    let (_file, model) = regenerate(&fx);
    let want = Expect {
        precision,
        kv_type,
        bound,
        greedy: Greedy::All,
    };
    check::run(name, &fx.golden, model, want);
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
