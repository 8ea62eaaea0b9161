//! Batch invariance, the gate of the batched decode step (`Backend::step_batch`): a sequence's
//! logits are bit-identical whether it runs alone (`decode`) or in a batch, at any batch size,
//! in any slot, with any companions, sequences joining and leaving between steps; both
//! precisions, both quant mixes, both KV types. The tokens a row's sampler chooses are the ones
//! `decode` samples. The bodies are shared with the CUDA backend's tests (shared/batch.rs).

mod shared;

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_model::backend::{Backend, BatchOut, BatchRow, DecodeRequest, Flow, KvType, Logits};
use q4moe_model::sampling::{argmax, Sampler, SamplingParams};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};
use shared::batch::{self as body, AloneBy};

fn model(cfg: &Config, q: SynthQuant) -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{q:?}.gguf"));
    synth::write(&path, cfg, q, 23, false).unwrap();
    let m = Arc::new(Model::load(&path).unwrap());
    (dir, m)
}

fn check(q: SynthQuant, precision: Precision, kv: KvType) {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, q);
    let tag = format!("{q:?} {precision:?} kv {}", kv.name());
    let mut b = CpuBackend::with_precision(m, 64, precision).with_kv_type(kv);
    body::invariance(&mut b, cfg.vocab_size, 9, AloneBy::Decode, &tag);
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
                logits: true,
            },
            BatchRow {
                session: 2,
                token,
                sampler: Some(&mut sampler),
                logits: true,
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
    body::refused_steps_change_no_session(&mut b, cfg.vocab_size);
}

/// A forked session continues as one that prefilled the prefix itself (Backend::fork).
#[test]
fn fork_continues_as_prefilled() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_0);
    let mut b = CpuBackend::with_precision(m, 64, Precision::Q8);
    body::fork_continues_as_prefilled(&mut b, cfg.vocab_size);
}

/// A step counts the expert weights it read, each expert a layer's rows chose once: one row
/// reads its `n_expert_used` experts a layer; two rows with the same token and history choose
/// the same experts, so they read no more than one; rows of other tokens read at least as much
/// and at most every expert.
#[test]
fn a_step_counts_each_chosen_expert_once() {
    let cfg = Config::tiny();
    let (_dir, m) = model(&cfg, SynthQuant::Q4_K_M);
    let one_expert: u64 = m.layers.iter().map(|l| l.expert_bytes() as u64).sum();
    let mut b = CpuBackend::new(m.clone(), 64);
    let mut read = |rows: &[(u64, u32)]| {
        let mut out = BatchOut::default();
        let mut rows: Vec<BatchRow<'_>> = rows
            .iter()
            .map(|&(session, token)| BatchRow {
                session,
                token,
                sampler: None,
                logits: false,
            })
            .collect();
        b.step_batch(&mut rows, &mut out).unwrap();
        out.expert_bytes.expect("the CPU counts them")
    };
    // One row reads n_expert_used experts of every layer (Q4_K_M's mix: their bytes differ
    // from layer to layer, so the sum is over layers).
    let used = cfg.n_expert_used as u64;
    assert_eq!(read(&[(1, 7)]), used * one_expert);
    assert_eq!(
        read(&[(2, 7), (3, 7)]),
        used * one_expert,
        "the same choices, read once"
    );
    let many = read(&[(4, 1), (5, 2), (6, 3), (7, 4)]);
    assert!(
        many >= used * one_expert && many <= cfg.n_expert as u64 * one_expert,
        "{many}"
    );
}
