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
