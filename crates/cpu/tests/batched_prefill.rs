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
/// cross sessions) against each prefilled alone: the next steps' logits bit for bit, for a
/// session with a prefix held, one whose prompt spans two chunks, and a one-token prompt; a
/// refused call (a session twice, a token past the vocabulary, no tokens) changes no session.
#[test]
fn prompts_prefilled_together_are_each_prefilled_alone() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_0, "many");
    let v = cfg.vocab_size as u32;
    let prompt = |len: u32, seed: u32| -> Vec<u32> {
        (0..len).map(|i| (i * 53 + seed * 31 + 7) % v).collect()
    };
    for precision in [Precision::Q8, Precision::Exact] {
        let mut b = CpuBackend::with_precision(m.clone(), 512, precision);
        let prompts = [prompt(9, 1), prompt(100, 2), prompt(1, 3)];
        // Session 1 (and 11, its twin alone) already holds a prefix.
        for s in [1, 11] {
            b.prefill(s, &prompt(20, 4), Logits::None).unwrap();
        }
        let items: Vec<(u64, &[u32])> = (1..=3).zip(prompts.iter().map(|p| &p[..])).collect();
        for bad in [
            vec![(1, &prompts[0][..]), (1, &prompts[1][..])],
            vec![(1, &prompts[0][..]), (2, &[v][..])],
            vec![(1, &prompts[0][..]), (2, &[][..])],
        ] {
            let before: Vec<usize> = (1..=3).map(|s| b.kv_len(s)).collect();
            assert!(b.prefill_many(&bad).is_err(), "{bad:?} is refused");
            let after: Vec<usize> = (1..=3).map(|s| b.kv_len(s)).collect();
            assert_eq!(before, after, "a refused prefill changes no session");
        }
        b.prefill_many(&items).unwrap();
        for (s, p) in (11..=13).zip(&prompts) {
            b.prefill(s, p, Logits::None).unwrap();
        }
        for s in 1..=3 {
            assert_eq!(b.kv_len(s), b.kv_len(s + 10), "session {s}'s length");
            for t in [5u32, 17] {
                let together = b.prefill(s, &[t], Logits::Last).unwrap();
                let alone = b.prefill(s + 10, &[t], Logits::Last).unwrap();
                assert!(together.iter().all(|x| x.is_finite()));
                assert_eq!(
                    together, alone,
                    "{precision:?}: session {s} after token {t}"
                );
            }
        }
    }
}
