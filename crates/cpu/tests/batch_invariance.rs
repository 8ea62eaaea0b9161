//! Batch invariance, the gate of the batched decode step (`Backend::step_batch`): a sequence's
//! logits are bit-identical whether it runs alone (`decode`) or in a batch, at any batch size,
//! in any slot, with any companions, sequences joining and leaving between steps; both
//! precisions, both quant mixes, both KV types. The tokens a row's sampler chooses are the ones
//! `decode` samples.

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_model::backend::{
    Backend, BackendError, BatchOut, BatchRow, DecodeRequest, Flow, KvType, Logits,
};
use q4moe_model::sampling::{argmax, Sampler, SamplingParams};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

/// A small deterministic generator (the tests need no dependencies).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.next(i + 1));
        }
    }
}

fn model(cfg: &Config, q: SynthQuant) -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{q:?}.gguf"));
    synth::write(&path, cfg, q, 23, false).unwrap();
    let m = Arc::new(Model::load(&path).unwrap());
    (dir, m)
}

/// One sequence of a scenario: its prompt, the global step it joins at, its steps.
struct Seq {
    prompt: Vec<u32>,
    join: usize,
    steps: usize,
}

/// What a sequence computes alone: its first token (greedy from the prompt) and each decode
/// step's logits.
struct Alone {
    first: u32,
    logits: Vec<Vec<f32>>,
}

fn alone(b: &mut CpuBackend, session: u64, seq: &Seq) -> Alone {
    let first = argmax(&b.prefill(session, &seq.prompt, Logits::Last).unwrap());
    let mut logits = Vec::new();
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
    assert_eq!(logits.len(), seq.steps);
    Alone { first, logits }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs `seqs` batched (rows shuffled every step; odd sessions choose their token through a
/// greedy sampler in the row, even ones from the logits) and checks every row's logits against
/// the sequence run alone, bit for bit.
fn check_scenario(b: &mut CpuBackend, seqs: &[Seq], refs: &[Alone], rng: &mut Lcg, tag: &str) {
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
    let last = seqs.iter().map(|s| s.join + s.steps).max().unwrap();
    for step in 0..last {
        let mut active: Vec<usize> = (0..seqs.len())
            .filter(|&i| step >= seqs[i].join && done[i] < seqs[i].steps)
            .collect();
        rng.shuffle(&mut active);
        // Rows in `active`'s order, each odd session lending its sampler.
        let mut lent: Vec<Option<&mut Sampler>> = samplers.iter_mut().map(Some).collect();
        let mut rows: Vec<BatchRow<'_>> = Vec::new();
        for &i in &active {
            rows.push(BatchRow {
                session: base + i as u64,
                token: next[i],
                sampler: if i % 2 == 1 { lent[i].take() } else { None },
            });
        }
        b.step_batch(&mut rows, &mut out).unwrap();
        assert_eq!(out.tokens.len(), active.len());
        for (slot, &i) in active.iter().enumerate() {
            let want = &refs[i].logits[done[i]];
            assert!(
                bits(out.row(slot)) == bits(want),
                "{tag}: seq {i} step {} in slot {slot} of {} differs from alone",
                done[i],
                active.len()
            );
            let greedy = argmax(out.row(slot));
            assert_eq!(out.tokens[slot], (i % 2 == 1).then_some(greedy), "{tag}");
            next[i] = greedy;
            done[i] += 1;
        }
    }
    for (i, s) in seqs.iter().enumerate() {
        assert_eq!(b.kv_len(base + i as u64), s.prompt.len() + s.steps, "{tag}");
        b.drop_session(base + i as u64);
    }
}

fn random_seqs(rng: &mut Lcg, n: usize, vocab: usize, staggered: bool) -> Vec<Seq> {
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

fn check(q: SynthQuant, precision: Precision, kv: KvType) {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, q);
    let tag = format!("{q:?} {precision:?} kv {}", kv.name());
    let mut b = CpuBackend::with_precision(m, 64, precision).with_kv_type(kv);
    let mut rng = Lcg(7);
    for n in 1..=9 {
        for staggered in [false, true] {
            let seqs = random_seqs(&mut rng, n, cfg.vocab_size, staggered);
            let refs: Vec<Alone> = seqs
                .iter()
                .enumerate()
                .map(|(i, s)| alone(&mut b, i as u64, s))
                .collect();
            (0..seqs.len()).for_each(|i| b.drop_session(i as u64));
            let tag = format!("{tag}, {n} seqs, staggered {staggered}");
            check_scenario(&mut b, &seqs, &refs, &mut rng, &tag);
        }
    }
}

#[test]
fn batched_steps_are_bit_identical_to_each_sequence_alone() {
    for precision in [Precision::Q8, Precision::Exact] {
        for q in [SynthQuant::Q4_0, SynthQuant::Q4_K_M] {
            check(q, precision, KvType::F16);
        }
    }
    check(SynthQuant::Q4_0, Precision::Q8, KvType::F32);
}

/// A stochastic sampler with penalties in the row chooses, step after step, the tokens `decode`
/// samples with the same parameters and seed, whatever rides along in the batch.
#[test]
fn a_rows_sampler_chooses_the_tokens_decode_samples() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_0);
    let mut b = CpuBackend::with_precision(m, 64, Precision::Q8);
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        repetition_penalty: 1.3,
        frequency_penalty: 0.2,
        seed: 99,
        ..SamplingParams::default()
    };
    let prompt = [5u32, 77, 300, 12];
    b.prefill(1, &prompt, Logits::Last).unwrap();
    let mut decoded = Vec::new();
    let req = DecodeRequest {
        session: 1,
        first_token: 42,
        max_tokens: 8,
        sampling: &params,
        history: &prompt,
        want_logits: false,
    };
    b.decode(&req, &mut |ev| {
        decoded.push(ev.token);
        Flow::Continue
    })
    .unwrap();
    b.prefill(2, &prompt, Logits::Last).unwrap();
    b.prefill(3, &[9, 8, 7], Logits::Last).unwrap();
    let mut sampler = Sampler::new(params.clone(), &prompt);
    let (mut token, mut companion) = (42u32, 1u32);
    let mut out = BatchOut::default();
    let mut batched = Vec::new();
    for step in 0..8 {
        let mut rows = vec![
            BatchRow {
                session: 3,
                token: companion,
                sampler: None,
            },
            BatchRow {
                session: 2,
                token,
                sampler: Some(&mut sampler),
            },
        ];
        if step % 2 == 1 {
            rows.swap(0, 1);
        }
        b.step_batch(&mut rows, &mut out).unwrap();
        let slot = usize::from(step % 2 == 0);
        token = out.tokens[slot].expect("the row lent a sampler");
        companion = argmax(out.row(1 - slot));
        batched.push(token);
    }
    assert_eq!(batched, decoded);
}

/// A step the backend refuses (a bad token, a session twice, a full context) changes no
/// session, and an empty step is fine.
#[test]
fn refused_steps_change_no_session() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_0);
    let mut b = CpuBackend::with_precision(m, 8, Precision::Q8);
    b.prefill(1, &[1, 2, 3], Logits::Last).unwrap();
    b.prefill(2, &[4; 8], Logits::Last).unwrap();
    let row = |session, token| BatchRow {
        session,
        token,
        sampler: None,
    };
    let mut out = BatchOut::default();
    let vocab = cfg.vocab_size as u32;
    let err = b
        .step_batch(&mut [row(1, 5), row(3, vocab)], &mut out)
        .unwrap_err();
    assert!(
        matches!(err, BackendError::BadToken { token, .. } if token == vocab),
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
    assert_eq!(out.logits.len(), 2 * cfg.vocab_size);
}
