//! End-to-end generation on a tiny synthetic model with the CPU backend.

use std::sync::Arc;

use q4moe_engine::{
    Device, Engine, EngineError, EngineOptions, Finish, Flow, GenerateRequest, SamplingParams,
};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

mod common;
use common::tiny_engine;

fn greedy(engine: &mut Engine, prompt: &str, n: usize) -> (Vec<u32>, String) {
    let ids = engine.encode_prompt(prompt).unwrap();
    let mut req = GenerateRequest::new(ids, n);
    req.stop_at_eos = false;
    let out = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
    (out.tokens, out.text)
}

#[test]
fn greedy_generation_is_deterministic_and_varied() {
    let dir = tempfile::tempdir().unwrap();
    for quant in [SynthQuant::Q4_0, SynthQuant::Q4_K_M, SynthQuant::Q8_0] {
        let mut a = tiny_engine(&dir, quant);
        let (t1, s1) = greedy(&mut a, "The quick brown fox jumps over the lazy dog.", 32);
        let (t2, s2) = greedy(&mut a, "The quick brown fox jumps over the lazy dog.", 32);
        assert_eq!(t1.len(), 32);
        assert_eq!(
            (t1.clone(), s1.clone()),
            (t2, s2),
            "{quant:?}: same engine, second run differs"
        );
        let mut b = tiny_engine(&dir, quant);
        assert_eq!(
            greedy(&mut b, "The quick brown fox jumps over the lazy dog.", 32).0,
            t1,
            "{quant:?}: fresh engine differs"
        );
        let distinct: std::collections::HashSet<_> = t1.iter().collect();
        assert!(
            distinct.len() > 3,
            "{quant:?}: output collapsed to {distinct:?}"
        );
    }
}

#[test]
fn logits_are_finite_and_not_degenerate() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let ids = e.encode_prompt("def main():\n    return 42\n").unwrap();
    let mut req = GenerateRequest::new(ids, 8);
    req.want_logits = true;
    req.stop_at_eos = false;
    let out = e.generate(&req, &mut |_| Flow::Continue).unwrap();
    assert_eq!(out.logits.len(), 8);
    for l in &out.logits {
        assert!(l.iter().all(|v| v.is_finite()));
        let mean = l.iter().sum::<f32>() / l.len() as f32;
        let var = l.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / l.len() as f32;
        assert!(var > 0.1, "logit variance {var} too small");
    }
}

#[test]
fn prompt_longer_than_context_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let req = GenerateRequest::new(vec![5; 300], 4);
    match e.generate(&req, &mut |_| Flow::Continue) {
        Err(EngineError::PromptTooLong {
            prompt: 300,
            context: 256,
        }) => {}
        other => panic!("expected PromptTooLong, got {:?}", other.map(|o| o.tokens)),
    }
    // The engine keeps working afterwards.
    assert_eq!(greedy(&mut e, "hello", 4).0.len(), 4);
}

#[test]
fn generation_stops_at_max_tokens_and_context_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let mut req = GenerateRequest::new(vec![11; 250], 100);
    req.stop_at_eos = false;
    let out = e.generate(&req, &mut |_| Flow::Continue).unwrap();
    assert_eq!(
        out.tokens.len(),
        6,
        "context of 256 leaves room for 6 tokens"
    );
    assert_eq!(out.finish, Finish::Length);
}

#[test]
fn sampled_generation_is_seeded() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let ids = e.encode_prompt("Once upon a time").unwrap();
    let run = |e: &mut Engine, seed| {
        let mut req = GenerateRequest::new(ids.clone(), 24);
        req.stop_at_eos = false;
        req.sampling = SamplingParams {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.95,
            seed,
            ..Default::default()
        };
        e.generate(&req, &mut |_| Flow::Continue).unwrap().tokens
    };
    assert_eq!(run(&mut e, 3), run(&mut e, 3));
    assert_ne!(run(&mut e, 3), run(&mut e, 4));
}

/// A sampled generation is one draw sequence: replaying the returned logits through a single
/// host sampler gives the same tokens (the first token's draw is not reused by decode).
#[test]
fn sampled_generation_is_one_draw_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let ids = e.encode_prompt("Once upon a time").unwrap();
    let mut req = GenerateRequest::new(ids.clone(), 24);
    req.stop_at_eos = false;
    req.want_logits = true;
    req.sampling = SamplingParams {
        temperature: 1.0,
        top_k: 40,
        seed: 12,
        ..Default::default()
    };
    let out = e.generate(&req, &mut |_| Flow::Continue).unwrap();
    assert_eq!(out.logits.len(), out.tokens.len());
    let mut s = q4moe_model::sampling::Sampler::new(req.sampling.clone(), &ids);
    let replay: Vec<u32> = out
        .logits
        .iter()
        .map(|l| s.sample(&mut l.clone()))
        .collect();
    assert_eq!(replay, out.tokens);
}

#[test]
fn prefix_reuse_gives_identical_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let base = e
        .encode_prompt("A long shared system prompt about foxes and dogs.")
        .unwrap();
    let mut first = GenerateRequest::new(base.clone(), 8);
    first.stop_at_eos = false;
    first.reuse_prefix = true;
    let out1 = e.generate(&first, &mut |_| Flow::Continue).unwrap();
    let mut prompt2 = base.clone();
    prompt2.extend(&out1.tokens);
    prompt2.extend(e.encode_prompt(" And then?").unwrap());
    let mut second = GenerateRequest::new(prompt2.clone(), 8);
    second.stop_at_eos = false;
    second.reuse_prefix = true;
    let reused = e.generate(&second, &mut |_| Flow::Continue).unwrap();
    assert!(
        reused.cached_tokens >= base.len(),
        "cached {} of {}",
        reused.cached_tokens,
        prompt2.len()
    );
    let mut fresh = tiny_engine(&dir, SynthQuant::Q4_0);
    second.reuse_prefix = false;
    let recomputed = fresh.generate(&second, &mut |_| Flow::Continue).unwrap();
    assert_eq!(recomputed.cached_tokens, 0);
    assert_eq!(reused.tokens, recomputed.tokens);
}

#[test]
fn stop_strings_cut_the_text() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let (_, text) = greedy(&mut e, "The quick brown fox", 24);
    let cut = text
        .char_indices()
        .nth(text.chars().count() / 2)
        .map(|(i, _)| i)
        .unwrap();
    let stop = text[cut..].chars().take(2).collect::<String>();
    let ids = e.encode_prompt("The quick brown fox").unwrap();
    let mut req = GenerateRequest::new(ids, 24);
    req.stop_at_eos = false;
    req.stop = vec![stop.clone()];
    let mut streamed = String::new();
    let out = e
        .generate(&req, &mut |t| {
            streamed.push_str(t);
            Flow::Continue
        })
        .unwrap();
    assert_eq!(out.finish, Finish::Stop);
    assert_eq!(out.text, streamed);
    assert!(!out.text.contains(&stop));
    assert!(text.starts_with(&out.text));
}

/// The engine's loop (prefill all but the last prompt token, decode every generated token from
/// it) against a direct backend run in the other shape (prefill the whole prompt for its last
/// logits, argmax on the host, decode the rest): greedy tokens and the logits each was chosen
/// from are the same, for a long prompt and a 1-token one (which prefills nothing).
fn matches_a_direct_backend_run(opts: &EngineOptions) {
    use q4moe_model::backend::{DecodeRequest, Logits};
    use q4moe_model::sampling::argmax;

    let dir = tempfile::tempdir().unwrap();
    for quant in [SynthQuant::Q4_0, SynthQuant::Q4_K_M] {
        let path = dir.path().join("tiny.gguf");
        synth::write(&path, &Config::tiny(), quant, 7, false).unwrap();
        let model = Arc::new(Model::load(&path).unwrap());
        let mut e = Engine::from_model(model.clone(), opts).unwrap();
        let long: Vec<u32> = (0..37).map(|i| (i * 7919 % 400) as u32 + 3).collect();
        for (prompt, want_logits) in [(long.clone(), true), (long, false), (vec![42], true)] {
            let n = 12;
            let mut req = GenerateRequest::new(prompt.clone(), n);
            req.stop_at_eos = false;
            req.want_logits = want_logits;
            let out = e.generate(&req, &mut |_| Flow::Continue).unwrap();

            let mut b = q4moe_engine::open_backend(model.clone(), opts).unwrap();
            let mut logits = vec![b.prefill(1, &prompt, Logits::Last).unwrap()];
            let mut tokens = vec![argmax(&logits[0])];
            let greedy = SamplingParams::greedy();
            let dreq = DecodeRequest {
                session: 1,
                first_token: tokens[0],
                max_tokens: n - 1,
                sampling: &greedy,
                history: &prompt,
                want_logits,
            };
            b.decode(&dreq, &mut |ev| {
                tokens.push(ev.token);
                logits.extend(ev.logits.map(<[f32]>::to_vec));
                Flow::Continue
            })
            .unwrap();
            let what = format!("{quant:?}, prompt of {}", prompt.len());
            assert_eq!(out.tokens, tokens, "{what}: tokens");
            if want_logits {
                assert!(out.logits == logits, "{what}: logits");
            }
            assert_eq!(out.finish, Finish::Length);
        }
    }
}

#[test]
fn greedy_generation_matches_a_direct_backend_run() {
    matches_a_direct_backend_run(&EngineOptions {
        device: Device::Cpu,
        kv_capacity: 256,
        ..Default::default()
    });
}

/// The same on the GPU, where decode chooses every token on the device, with the batched
/// prefill and with a decode step a prompt token.
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_generation_matches_a_direct_backend_run_on_cuda() {
    for prefill_chunk in [EngineOptions::default().cuda.prefill_chunk, 0] {
        let mut opts = EngineOptions {
            device: Device::Cuda,
            kv_capacity: 256,
            ..Default::default()
        };
        opts.cuda.prefill_chunk = prefill_chunk;
        matches_a_direct_backend_run(&opts);
    }
}

/// A prompt the cache holds whole (the same prompt again) still runs its last token: the
/// session store reuses all but it, and the tokens are a fresh run's.
#[test]
fn a_fully_cached_prompt_reuses_all_but_its_last_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let ids = e.encode_prompt("Foxes and dogs, again and again.").unwrap();
    let mut req = GenerateRequest::new(ids.clone(), 6);
    req.stop_at_eos = false;
    req.reuse_prefix = true;
    let first = e.generate(&req, &mut |_| Flow::Continue).unwrap();
    let again = e.generate(&req, &mut |_| Flow::Continue).unwrap();
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(again.cached_tokens, ids.len() - 1);
    assert_eq!(again.tokens, first.tokens);
}

#[test]
fn bad_requests_are_refused_before_the_backend_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let vocab = e.model.config.vocab_size as u32;
    let err = e
        .generate(&GenerateRequest::new(vec![1, vocab, 2], 4), &mut |_| {
            Flow::Continue
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("prompt token 1") && err.contains("outside the vocabulary"),
        "{err}"
    );
    let err = e
        .generate(&GenerateRequest::new(Vec::new(), 4), &mut |_| {
            Flow::Continue
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty"), "{err}");
    let mut req = GenerateRequest::new(vec![1, 2], 4);
    req.sampling.top_p = 0.0;
    let err = e
        .generate(&req, &mut |_| Flow::Continue)
        .unwrap_err()
        .to_string();
    assert!(err.contains("top_p"), "{err}");
    // Nothing was left behind: a good request runs as on a fresh engine.
    let mut fresh = tiny_engine(&dir, SynthQuant::Q4_0);
    assert_eq!(greedy(&mut e, "hello", 4), greedy(&mut fresh, "hello", 4));
}

/// Two conversations sharing only their first tokens (a chat template's opening) each keep
/// their own session: the second gets a copy of the opening (Backend::fork) instead of taking
/// over and truncating the first, whose next turn reuses all it had (issue 54: it used to
/// reuse 4 of 208 tokens); the forked conversation's tokens are a fresh run's.
#[test]
fn a_conversation_sharing_only_an_opening_keeps_the_other_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let opening = [1u32, 2, 3, 4];
    let turn = |seed: u32| -> Vec<u32> {
        let mut p = opening.to_vec();
        p.extend((0..40).map(|i| 10 + (i * 7 + seed * 13) % 200));
        p
    };
    let run = |e: &mut Engine, prompt: Vec<u32>| {
        let mut req = GenerateRequest::new(prompt, 6);
        req.stop_at_eos = false;
        req.reuse_prefix = true;
        e.generate(&req, &mut |_| Flow::Continue).unwrap()
    };
    let a1 = turn(1);
    let a_out = run(&mut e, a1.clone());
    let b_out = run(&mut e, turn(2));
    assert_eq!(
        b_out.cached_tokens,
        opening.len(),
        "B forks the shared opening"
    );
    let other = tempfile::tempdir().unwrap();
    let mut fresh = tiny_engine(&other, SynthQuant::Q4_0);
    assert_eq!(b_out.tokens, run(&mut fresh, turn(2)).tokens);
    let mut a2 = a1.clone();
    a2.extend(&a_out.tokens);
    a2.extend([7u32, 8, 9]);
    let a2_out = run(&mut e, a2.clone());
    assert!(
        a2_out.cached_tokens >= a1.len(),
        "A's second turn reused {} of {} tokens",
        a2_out.cached_tokens,
        a2.len()
    );
    // A regenerated turn (the same prompt again) still reuses all but its last token.
    let again = run(&mut e, a2.clone());
    assert_eq!(again.cached_tokens, a2.len() - 1);
    assert_eq!(again.tokens, a2_out.tokens);
}

/// The session store keeps finished conversations within `kv_cache_bytes` of KV (on the CPU, the
/// pool every session's pages come from), dropping the least recently used: with room for about
/// two, a third conversation drops the first, whose next turn then starts from nothing, while
/// the last two still reuse their prefixes.
#[test]
fn the_session_store_is_bounded_in_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let cfg = q4moe_model::Config::tiny();
    q4moe_model::synth::write(&path, &cfg, SynthQuant::Q4_0, 5, false).unwrap();
    // One conversation (40 prompt tokens, 4 generated) holds three 16-position pages a layer on
    // the CPU; the pool holds eight (129 positions' worth, rounded down to pages).
    // Keys and values of every layer, f16 (the default).
    let per_position = 2 * cfg.n_layer * cfg.kv_dim() * 2;
    let opts = q4moe_engine::EngineOptions {
        device: q4moe_engine::Device::Cpu,
        kv_cache_bytes: 2 * 64 * per_position + per_position,
        ..Default::default()
    };
    let mut e = Engine::load(&path, &opts).unwrap();
    let prompt = |k: u32| -> Vec<u32> { (0..40).map(|i| 5 + k * 50 + i).collect() };
    let run = |e: &mut Engine, p: Vec<u32>| {
        let mut req = GenerateRequest::new(p, 4);
        req.stop_at_eos = false;
        req.reuse_prefix = true;
        e.generate(&req, &mut |_| Flow::Continue)
            .unwrap()
            .cached_tokens
    };
    for k in 0..3 {
        assert_eq!(run(&mut e, prompt(k)), 0);
    }
    // The first was dropped; the two later ones are kept.
    assert_eq!(
        run(&mut e, prompt(0)),
        0,
        "the oldest conversation was kept"
    );
    assert_eq!(
        run(&mut e, prompt(2)),
        39,
        "a recent conversation was dropped"
    );
}
