//! The batched prefill (src/batch.rs) against the same tokens run one at a time: the prompt's
//! last logits and the following steps' logits bit for bit (the keys and values it cached are
//! the ones a token at a time caches), over several chunks, both precisions and quants.

mod shared;

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_model::backend::{Backend, Logits};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

fn model(cfg: &Config, q: SynthQuant, tag: &str) -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{tag}.gguf"));
    synth::write(&path, cfg, q, 11, false).unwrap();
    let m = Arc::new(Model::load(&path).unwrap());
    (dir, m)
}

fn check(cfg: Config, q: SynthQuant, precision: Precision, len: u32) {
    let tag = format!("{q:?}-{precision:?}-{}", cfg.d_model);
    let (_dir, m) = model(&cfg, q, &tag);
    let mut b = CpuBackend::with_precision(m, 512, precision);
    let prompt: Vec<u32> = (0..len)
        .map(|i| (i * 53 + 7) % cfg.vocab_size as u32)
        .collect();
    let batched = b.prefill(1, &prompt, Logits::Last).unwrap();
    let one_by_one = b.prefill(2, &prompt, Logits::All).unwrap();
    let last = &one_by_one[one_by_one.len() - cfg.vocab_size..];
    assert!(
        batched.iter().all(|v| v.is_finite()),
        "{tag}: non-finite logits"
    );
    assert_eq!(batched, last, "{tag}: the prompt's last logits differ");
    for (i, t) in [5u32, 17, 99].into_iter().enumerate() {
        let a = b.prefill(1, &[t], Logits::Last).unwrap();
        let c = b.prefill(2, &[t], Logits::Last).unwrap();
        assert_eq!(a, c, "{tag}: step {i} after the prompt differs");
    }
    assert_eq!(b.kv_len(1), b.kv_len(2));
}

#[test]
fn batched_prefill_is_the_token_by_token_prefill() {
    for precision in [Precision::Q8, Precision::Exact] {
        for q in [SynthQuant::Q4_0, SynthQuant::Q4_K_M] {
            check(Config::tiny(), q, precision, 150);
        }
    }
    check(Config::mid(), SynthQuant::Q4_0, Precision::Q8, 70);
}

/// A refused prompt leaves the session as it was (the shared body; the CUDA backend runs it in
/// crates/cuda/tests/parity.rs): bit for bit, at either precision.
#[test]
fn refused_prompts_leave_the_session_as_it_was() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_0, "refused");
    for precision in [Precision::Q8, Precision::Exact] {
        let mut make = || -> Box<dyn Backend> {
            Box::new(CpuBackend::with_precision(m.clone(), 32, precision))
        };
        shared::refused_prompts_leave_the_session(&mut make, 32, 0.0);
    }
}

/// Several sessions prefilled together (`prefill_many`: their tokens in runs of a chunk that
/// cross sessions) against each prefilled alone (the shared body), at either precision.
#[test]
fn prompts_prefilled_together_are_each_prefilled_alone() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_0, "many");
    for precision in [Precision::Q8, Precision::Exact] {
        let mut b = CpuBackend::with_precision(m.clone(), 512, precision);
        let tag = format!("{precision:?}");
        shared::prompts_prefilled_together_are_each_alone(&mut b, cfg.vocab_size, 100, &tag);
    }
}
