//! The CPU's paged KV (kv.rs): every session's pages come from one pool bounded in bytes, a
//! forked session shares its source's prefix pages (copying only the partly filled page it
//! writes into), and a step the pool cannot hold is refused with `KvFull`, changing nothing.

mod shared;

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, PAGE};
use q4moe_model::backend::{Backend, BackendError, Logits};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};
use shared::batch::step_bits as step;

fn model() -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    synth::write(&path, &Config::tiny(), SynthQuant::Q4_0, 31, false).unwrap();
    let m = Arc::new(Model::load(&path).unwrap());
    (dir, m)
}

/// Random in-vocabulary tokens (a fixed seed).
fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = q4moe_model::sampling::Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

#[test]
fn a_fork_shares_the_prefix_pages_and_copies_only_the_page_it_writes() {
    let (_dir, m) = model();
    let c = m.config.clone();
    let mut b = CpuBackend::new(m, 128);
    let page = b.kv_pool().unwrap().page_bytes;
    assert_eq!(
        page,
        2 * PAGE * c.kv_dim() * 2,
        "keys and values, f16 (the default)"
    );
    let prompt = tokens(40, 1, c.vocab_size);
    b.prefill(1, &prompt, Logits::None).unwrap();
    assert_eq!(
        b.kv_bytes(1),
        3 * c.n_layer * page,
        "40 positions: three pages a layer"
    );
    let used = b.kv_pool().unwrap().used_bytes;
    b.fork(1, 2, 35).unwrap();
    assert_eq!(
        b.kv_pool().unwrap().used_bytes,
        used,
        "a fork takes no page"
    );
    assert_eq!(
        b.kv_bytes_of(&[1, 2]),
        b.kv_bytes(1),
        "the shared pages count once"
    );
    // Both hold the partly filled third page: whichever writes first copies it, and the
    // other then holds it alone.
    assert_eq!(
        b.kv_needed(2, 1),
        c.n_layer * page,
        "a copy of the page it writes into"
    );
    assert_eq!(b.kv_needed(1, 1), c.n_layer * page);
    let t = tokens(1, 2, c.vocab_size)[0];
    let got = step(&mut b, &[(1, t), (2, t)]).unwrap();
    assert_eq!(b.kv_pool().unwrap().used_bytes, used + c.n_layer * page);
    // Each continues bit-identically to a session that prefilled its prefix itself.
    b.prefill(3, &prompt, Logits::None).unwrap();
    b.prefill(4, &prompt[..35], Logits::None).unwrap();
    let want = step(&mut b, &[(3, t), (4, t)]).unwrap();
    assert!(got[0] == want[0], "the source changed under its fork");
    assert!(
        got[1] == want[1],
        "the fork differs from a session that prefilled its prefix"
    );
    // Dropping the source leaves the fork whole: the shared pages stay while one holds them.
    b.drop_session(1);
    b.drop_session(3);
    let t2 = tokens(1, 3, c.vocab_size)[0];
    assert!(step(&mut b, &[(2, t2)]).unwrap() == step(&mut b, &[(4, t2)]).unwrap());
    for s in [2, 4] {
        b.drop_session(s);
    }
    assert_eq!(
        b.kv_pool().unwrap().used_bytes,
        0,
        "every page back in the pool"
    );
}

#[test]
fn a_full_pool_refuses_with_kv_full_and_changes_nothing() {
    let (_dir, m) = model();
    let c = m.config.clone();
    let page = 2 * PAGE * c.kv_dim() * 2; // keys and values, f16 (the default)
                                          // Four pages a layer: 64 positions of one session, or 48 of one and 16 of another.
    let mut b = CpuBackend::new(m.clone(), 128).with_kv_pool(4 * c.n_layer * page);
    let mut free = CpuBackend::new(m, 128);
    let pool = b.kv_pool().unwrap();
    assert_eq!(pool.capacity_bytes, 4 * c.n_layer * page);
    let prompt = tokens(48, 5, c.vocab_size);
    b.prefill(1, &prompt, Logits::None).unwrap();
    assert_eq!(b.kv_needed(2, 20), 2 * c.n_layer * page);
    let err = b
        .prefill(2, &tokens(20, 6, c.vocab_size), Logits::None)
        .unwrap_err();
    assert!(
        matches!(err, BackendError::KvFull { session: 2, needed, free, .. }
            if needed == 2 * c.n_layer * page && free == c.n_layer * page),
        "{err}"
    );
    assert!(err.to_string().contains("KV pool is full"), "{err}");
    assert_eq!(
        (b.kv_len(1), b.kv_len(2)),
        (48, 0),
        "a refused prefill writes nothing"
    );
    // 16 positions fit; then the pool is full and a step that needs a page is refused whole.
    let second = tokens(16, 7, c.vocab_size);
    b.prefill(2, &second, Logits::None).unwrap();
    let t = tokens(1, 8, c.vocab_size)[0];
    let err = step(&mut b, &[(1, t), (2, t)]).unwrap_err();
    assert!(matches!(err, BackendError::KvFull { .. }), "{err}");
    assert!(
        decode_refused(&mut b, 1, t),
        "a decode past the pool is refused"
    );
    assert_eq!(
        (b.kv_len(1), b.kv_len(2)),
        (48, 16),
        "a refused step changes no session"
    );
    // Once a session gives its pages back, the other steps, with the bits of an unbounded pool.
    b.drop_session(2);
    free.prefill(1, &prompt, Logits::None).unwrap();
    assert!(step(&mut b, &[(1, t)]).unwrap() == step(&mut free, &[(1, t)]).unwrap());
}

/// Whether `decode` of one token on `session` fails with the pool's error.
fn decode_refused(b: &mut dyn Backend, session: u64, token: u32) -> bool {
    let sampling = q4moe_model::sampling::SamplingParams::default();
    let req = q4moe_model::backend::DecodeRequest {
        session,
        first_token: token,
        max_tokens: 1,
        sampling: &sampling,
        history: &[token],
        want_logits: false,
    };
    let r = b.decode(&req, &mut |_| q4moe_model::backend::Flow::Continue);
    matches!(r, Err(BackendError::KvFull { .. }))
}
