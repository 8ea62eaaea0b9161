//! Test bodies every backend runs (candle's habit: one body, each device): the CPU's tests call
//! them here, crates/cuda/tests/parity.rs includes this file (`#[path]`) and calls them on the
//! CUDA backend. A body takes `make`, which builds a fresh backend over one model, and the bound
//! its backend's logits keep (0: bit for bit). Not every file that includes this one runs every
//! body.
#![allow(dead_code)]

use q4moe_model::backend::{Backend, Logits};

/// The batched step's bodies.
pub mod batch;

/// Largest |a - b| over the largest |b|; infinite where `a` holds a NaN or an infinity.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return f32::INFINITY;
    }
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    if err == 0.0 {
        0.0
    } else {
        err / scale
    }
}

/// A prompt the backend refuses (empty, `cap` tokens past the 3 a session holds: past its KV
/// capacity, a token outside the vocabulary) leaves the session as it was: the next good
/// prompt's logits are those of a fresh backend, within `tol` of the largest.
pub fn refused_prompts_leave_the_session(
    make: &mut dyn FnMut() -> Box<dyn Backend>,
    cap: usize,
    tol: f32,
) {
    let mut b = make();
    let good = [3u32, 9, 27];
    b.prefill(1, &good, Logits::Last).unwrap();
    let vocab = b.config().vocab_size as u32;
    for bad in [vec![], vec![1; cap], vec![4, vocab, 5]] {
        let n = bad.len();
        assert!(
            b.prefill(1, &bad, Logits::Last).is_err(),
            "a {n}-token prompt was accepted"
        );
        assert_eq!(
            b.kv_len(1),
            good.len(),
            "a refused {n}-token prompt changed the session"
        );
    }
    let after = b.prefill(1, &[11], Logits::Last).unwrap();
    let mut fresh = make();
    fresh.prefill(1, &good, Logits::Last).unwrap();
    let want = fresh.prefill(1, &[11], Logits::Last).unwrap();
    let e = rel_err(&after, &want);
    assert!(
        e <= tol,
        "relative logit error {e} against a fresh backend (bound {tol})"
    );
}

/// Several sessions prefilled together (`prefill_many`) against each prefilled alone on the same
/// backend: the next steps' logits bit for bit, for a session with a prefix held, one whose
/// prompt spans `long` tokens (past a chunk), and a one-token prompt; a refused call (a session
/// twice, a token past the vocabulary, no tokens) changes no session. Sessions 1-3 and 11-13.
pub fn prompts_prefilled_together_are_each_alone(
    b: &mut dyn Backend,
    vocab: usize,
    long: u32,
    tag: &str,
) {
    let v = vocab as u32;
    let prompt = |len: u32, seed: u32| -> Vec<u32> {
        (0..len).map(|i| (i * 53 + seed * 31 + 7) % v).collect()
    };
    let prompts = [prompt(9, 1), prompt(long, 2), prompt(1, 3)];
    // Session 1 (and 11, its twin alone) already holds a prefix.
    for s in [1, 11] {
        b.prefill(s, &prompt(20, 4), Logits::None).unwrap();
    }
    for bad in [
        vec![(1, &prompts[0][..]), (1, &prompts[1][..])],
        vec![(1, &prompts[0][..]), (2, &[v][..])],
        vec![(1, &prompts[0][..]), (2, &[][..])],
    ] {
        let before: Vec<usize> = (1..=3).map(|s| b.kv_len(s)).collect();
        assert!(b.prefill_many(&bad).is_err(), "{tag}: {bad:?} is refused");
        let after: Vec<usize> = (1..=3).map(|s| b.kv_len(s)).collect();
        assert_eq!(before, after, "{tag}: a refused prefill changes no session");
    }
    let items: Vec<(u64, &[u32])> = (1..=3).zip(prompts.iter().map(|p| &p[..])).collect();
    b.prefill_many(&items).unwrap();
    for (s, p) in (11..=13).zip(&prompts) {
        b.prefill(s, p, Logits::None).unwrap();
    }
    for s in 1..=3 {
        assert_eq!(b.kv_len(s), b.kv_len(s + 10), "{tag}: session {s}'s length");
        for t in [5u32, 17] {
            let together = b.prefill(s, &[t], Logits::Last).unwrap();
            let alone = b.prefill(s + 10, &[t], Logits::Last).unwrap();
            assert!(
                together.iter().all(|x| x.is_finite()),
                "{tag}: finite logits"
            );
            assert_eq!(together, alone, "{tag}: session {s} after token {t}");
        }
    }
}
