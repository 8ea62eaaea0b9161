//! The batched prefill (src/batch.rs) against the same tokens run one at a time: the prompt's
//! last logits and the following steps' logits bit for bit (the keys and values it cached are
//! the ones a token at a time caches), over several chunks, both precisions and quants.

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

/// A prompt the backend refuses (empty, past the context, a token outside the vocabulary)
/// leaves the session as it was: the next good prompt's logits are those of a fresh backend.
#[test]
fn refused_prompts_leave_the_session_as_it_was() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_0, "refused");
    let mut b = CpuBackend::with_precision(m.clone(), 32, Precision::Q8);
    let good = [3u32, 9, 27];
    b.prefill(1, &good, Logits::Last).unwrap();
    let vocab = cfg.vocab_size as u32;
    for bad in [vec![], vec![1; 30], vec![4, vocab, 5]] {
        assert!(
            b.prefill(1, &bad, Logits::Last).is_err(),
            "{bad:?} was accepted"
        );
        assert_eq!(b.kv_len(1), good.len(), "{bad:?} changed the session");
    }
    let after = b.prefill(1, &[11], Logits::Last).unwrap();
    let mut fresh = CpuBackend::with_precision(m, 32, Precision::Q8);
    fresh.prefill(1, &good, Logits::Last).unwrap();
    assert_eq!(after, fresh.prefill(1, &[11], Logits::Last).unwrap());
}
