//! The batch-invariance gate's bodies (`Backend::step_batch`), run on every backend:
//! crates/cpu/tests/batch_invariance.rs and crates/cuda/tests/batch.rs include this file
//! (`#[path]`). A scenario runs sequences batched (joining and leaving between steps, rows
//! shuffled every step, some rows choosing their token through a sampler in the row) and
//! compares every row's logits with a reference of the sequence run alone: bit for bit
//! (`tol` 0), or within `tol` of the largest |logit| against another backend.

use q4moe_model::backend::{
    Backend, BackendError, BatchOut, BatchRow, DecodeRequest, Flow, Logits,
};
use q4moe_model::sampling::{argmax, Sampler, SamplingParams};

use super::rel_err;

/// A small deterministic generator (the tests need no dependencies).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.next(i + 1));
        }
    }
}

/// One sequence of a scenario: its prompt, the global step it joins at, its steps.
pub struct Seq {
    pub prompt: Vec<u32>,
    pub join: usize,
    pub steps: usize,
}

/// What a sequence computes alone: its first token (greedy from the prompt) and each decode
/// step's logits, each step fed the greedy token of the one before.
pub struct Alone {
    pub first: u32,
    pub logits: Vec<Vec<f32>>,
}

/// How the reference runs a sequence alone.
#[derive(Clone, Copy, Debug)]
pub enum AloneBy {
    /// `decode` with its logits handed back (the CPU: one path for both).
    Decode,
    /// `step_batch` with the sequence as its only row (CUDA, whose `decode` runs other kernels).
    BatchOfOne,
}

pub fn alone(b: &mut dyn Backend, session: u64, seq: &Seq, by: AloneBy) -> Alone {
    let first = argmax(&b.prefill(session, &seq.prompt, Logits::Last).unwrap());
    let mut logits = Vec::new();
    match by {
        AloneBy::Decode => {
            let req = DecodeRequest {
                session,
                first_token: first,
                max_tokens: seq.steps,
                sampling: &SamplingParams::greedy(),
                history: &seq.prompt,
                want_logits: true,
            };
            b.decode(&req, &mut |ev| {
                logits.push(ev.logits.unwrap().to_vec());
                Flow::Continue
            })
            .unwrap();
        }
        AloneBy::BatchOfOne => {
            let mut out = BatchOut::default();
            let mut token = first;
            for _ in 0..seq.steps {
                let row = BatchRow {
                    session,
                    token,
                    sampler: None,
                    logits: true,
                };
                b.step_batch(&mut [row], &mut out).unwrap();
                token = argmax(out.row(0));
                logits.push(out.row(0).to_vec());
            }
        }
    }
    assert_eq!(logits.len(), seq.steps);
    Alone { first, logits }
}

/// References for `seqs` (sessions 0..), their sessions dropped after.
pub fn alone_all(b: &mut dyn Backend, seqs: &[Seq], by: AloneBy) -> Vec<Alone> {
    let refs = (0..seqs.len())
        .map(|i| alone(b, i as u64, &seqs[i], by))
        .collect();
    (0..seqs.len()).for_each(|i| b.drop_session(i as u64));
    refs
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs `seqs` batched (rows shuffled every step; odd sessions choose their token through a
/// greedy sampler in the row, asking for their logits every other step only, so a device may
/// choose without sending them; even ones from the logits) and checks every row's logits
/// against the sequence run alone: bit for bit where `tol` is 0 (a row that asked for none: its
/// token is the alone run's greedy one), else within `tol` of the largest |logit| (every row
/// asks; each row then fed the reference's greedy token, so near-ties cannot fork the
/// streams). Returns the largest relative error seen.
pub fn check_scenario(
    b: &mut dyn Backend,
    seqs: &[Seq],
    refs: &[Alone],
    rng: &mut Lcg,
    tol: f32,
    tag: &str,
) -> f32 {
    let base = 1000;
    for (i, s) in seqs.iter().enumerate() {
        b.prefill(base + i as u64, &s.prompt, Logits::Last).unwrap();
    }
    let mut next: Vec<u32> = refs.iter().map(|r| r.first).collect();
    let mut done = vec![0usize; seqs.len()];
    let mut samplers: Vec<Sampler> = seqs
        .iter()
        .map(|s| Sampler::new(SamplingParams::greedy(), &s.prompt))
        .collect();
    let mut out = BatchOut::default();
    let mut worst = 0f32;
    let last = seqs.iter().map(|s| s.join + s.steps).max().unwrap();
    for step in 0..last {
        let mut active: Vec<usize> = (0..seqs.len())
            .filter(|&i| step >= seqs[i].join && done[i] < seqs[i].steps)
            .collect();
        rng.shuffle(&mut active);
        // Rows in `active`'s order, each odd session lending its sampler.
        let mut lent: Vec<Option<&mut Sampler>> = samplers.iter_mut().map(Some).collect();
        let mut rows: Vec<BatchRow<'_>> = Vec::new();
        let asks = |i: usize| tol > 0.0 || i % 2 == 0 || step % 2 == 0;
        for &i in &active {
            rows.push(BatchRow {
                session: base + i as u64,
                token: next[i],
                sampler: if i % 2 == 1 { lent[i].take() } else { None },
                logits: asks(i),
            });
        }
        b.step_batch(&mut rows, &mut out).unwrap();
        assert_eq!(out.tokens.len(), active.len());
        for (slot, &i) in active.iter().enumerate() {
            let (got, want) = (out.row(slot), &refs[i].logits[done[i]]);
            let at = format!(
                "{tag}: seq {i} step {} in slot {slot} of {}",
                done[i],
                active.len()
            );
            if !asks(i) {
                assert_eq!(out.tokens[slot], Some(argmax(want)), "{at}");
                next[i] = argmax(want);
                done[i] += 1;
                continue;
            }
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{at}: a logit not finite"
            );
            if tol == 0.0 {
                assert!(bits(got) == bits(want), "{at} differs from alone");
            } else {
                let e = rel_err(got, want);
                worst = worst.max(e);
                assert!(
                    e <= tol,
                    "{at}: relative logit error {e:.2e} over {tol:.0e}"
                );
            }
            let greedy = argmax(got);
            assert_eq!(out.tokens[slot], (i % 2 == 1).then_some(greedy), "{at}");
            next[i] = argmax(want);
            done[i] += 1;
        }
    }
    for (i, s) in seqs.iter().enumerate() {
        assert_eq!(b.kv_len(base + i as u64), s.prompt.len() + s.steps, "{tag}");
        b.drop_session(base + i as u64);
    }
    worst
}

/// `n` sequences of random prompts (1 to 12 tokens); staggered: joining at steps 0 to 3 with 1
/// to 6 steps each, else all at step 0 with 4 steps.
pub fn random_seqs(rng: &mut Lcg, n: usize, vocab: usize, staggered: bool) -> Vec<Seq> {
    (0..n)
        .map(|_| Seq {
            prompt: (0..1 + rng.next(12))
                .map(|_| rng.next(vocab) as u32)
                .collect(),
            join: if staggered { rng.next(4) } else { 0 },
            steps: if staggered { 1 + rng.next(6) } else { 4 },
        })
        .collect()
}

/// The gate on one backend: for 1 to `max_n` sequences, together and staggered, every row's
/// logits bit-identical to the sequence alone (`by`).
pub fn invariance(b: &mut dyn Backend, vocab: usize, max_n: usize, by: AloneBy, tag: &str) {
    let mut rng = Lcg(7);
    for n in 1..=max_n {
        for staggered in [false, true] {
            let seqs = random_seqs(&mut rng, n, vocab, staggered);
            let refs = alone_all(b, &seqs, by);
            let tag = format!("{tag}, {n} seqs, staggered {staggered}");
            check_scenario(b, &seqs, &refs, &mut rng, 0.0, &tag);
        }
    }
}

/// A row whose caller chooses its token from its logits.
fn row(session: u64, token: u32) -> BatchRow<'static> {
    BatchRow {
        session,
        token,
        sampler: None,
        logits: true,
    }
}

/// One batched step of `(session, token)` rows, each row's logits brought back: every row's
/// logits as bits.
pub fn step_bits(b: &mut dyn Backend, rows: &[(u64, u32)]) -> Result<Vec<Vec<u32>>, BackendError> {
    let mut out = BatchOut::default();
    let mut rows: Vec<BatchRow<'_>> = rows.iter().map(|&(s, t)| row(s, t)).collect();
    b.step_batch(&mut rows, &mut out)?;
    Ok((0..rows.len()).map(|i| bits(out.row(i))).collect())
}

/// A step the backend refuses (a bad token, a session twice, a full context) changes no
/// session, and an empty step is fine. `b` holds 8 positions a session.
pub fn refused_steps_change_no_session(b: &mut dyn Backend, vocab: usize) {
    b.prefill(1, &[1, 2, 3], Logits::Last).unwrap();
    b.prefill(2, &[4; 8], Logits::Last).unwrap();
    let mut out = BatchOut::default();
    let v = vocab as u32;
    let err = b
        .step_batch(&mut [row(1, 5), row(3, v)], &mut out)
        .unwrap_err();
    assert!(
        matches!(err, BackendError::BadToken { token, .. } if token == v),
        "{err}"
    );
    let err = b
        .step_batch(&mut [row(1, 5), row(1, 6)], &mut out)
        .unwrap_err();
    assert!(err.to_string().contains("session 1 appears twice"), "{err}");
    let err = b
        .step_batch(&mut [row(1, 5), row(2, 6)], &mut out)
        .unwrap_err();
    assert!(
        matches!(err, BackendError::ContextFull { session: 2, .. }),
        "{err}"
    );
    assert_eq!((b.kv_len(1), b.kv_len(2), b.kv_len(3)), (3, 8, 0));
    b.step_batch(&mut [], &mut out).unwrap();
    assert!(out.logits.is_empty() && out.tokens.is_empty());
    // A new session joins a step at position 0.
    b.step_batch(&mut [row(1, 5), row(3, 6)], &mut out).unwrap();
    assert_eq!((b.kv_len(1), b.kv_len(3)), (4, 1));
    assert_eq!(out.logits.len(), 2 * vocab);
}

/// `Backend::fork`: a session forked from another's prefix continues bit-identically to one
/// that prefilled that prefix itself (decode steps through `step_batch`, the source stepping in
/// the same batch), the source is unchanged, and a fork past what the source holds or onto
/// itself is refused.
pub fn fork_continues_as_prefilled(b: &mut dyn Backend, vocab: usize) {
    let mut rng = Lcg(19);
    let prompt: Vec<u32> = (0..20).map(|_| rng.next(vocab) as u32).collect();
    let tail: Vec<u32> = (0..5).map(|_| rng.next(vocab) as u32).collect();
    let mut out = BatchOut::default();
    let mut run = |b: &mut dyn Backend, rows: &[(u64, u32)]| -> Vec<Vec<u32>> {
        let mut rows: Vec<_> = rows.iter().map(|&(s, t)| row(s, t)).collect();
        b.step_batch(&mut rows, &mut out).unwrap();
        (0..rows.len()).map(|i| bits(out.row(i))).collect()
    };
    // Reference: session 1 prefills 12 tokens itself, then steps the tail alone.
    b.prefill(1, &prompt[..12], Logits::None).unwrap();
    let want: Vec<Vec<u32>> = tail.iter().map(|&t| run(b, &[(1, t)]).remove(0)).collect();
    // Session 2 holds all 20; session 3 forks its first 12 and steps the tail beside it.
    b.prefill(2, &prompt, Logits::None).unwrap();
    b.fork(2, 3, 12).unwrap();
    assert_eq!((b.kv_len(2), b.kv_len(3)), (20, 12));
    for (i, &t) in tail.iter().enumerate() {
        let got = run(b, &[(2, t), (3, t)]);
        assert!(
            got[1] == want[i],
            "forked session's step {i} differs from the prefilled one's"
        );
    }
    assert_eq!((b.kv_len(2), b.kv_len(3)), (25, 17));
    // Forking onto an existing session replaces it; bad forks are refused and change nothing.
    b.fork(2, 1, 12).unwrap();
    assert_eq!(b.kv_len(1), 12);
    assert!(b
        .fork(2, 4, 26)
        .unwrap_err()
        .to_string()
        .contains("holds 25"));
    assert!(b.fork(2, 2, 3).is_err());
    assert_eq!((b.kv_len(2), b.kv_len(4)), (25, 0));
    for s in 1..=3 {
        b.drop_session(s);
    }
}
