//! The engine over a KV pool bounded in bytes (the CPU's paged KV, `--kv-cache-mb`): the `n`
//! choices of one prompt hold its pages once; when running sequences need room, kept
//! conversations go first; when the running ones alone fill the pool, the newest gives its KV
//! back and prefills its context again later, every output unchanged; a sequence that alone
//! outgrows the pool, or a serial request, fails with a clear error and the engine serves on.

use q4moe_engine::{
    BatchOptions, Batcher, Engine, EngineError, Flow, GenerateRequest, SamplingParams,
};
use q4moe_model::synth::SynthQuant;

mod common;
use common::{admit_all, alone, random_tokens, run_to_end, tiny_engine_with};

/// Bytes of one page (16 positions of one layer's keys and values) and the layers.
fn page(engine: &Engine) -> (usize, usize) {
    let pool = engine.kv_pool().expect("the CPU keeps a pool");
    (pool.page_bytes, engine.model.config.n_layer)
}

fn request(prompt: Vec<u32>, max_tokens: usize, seed: u64) -> GenerateRequest {
    let mut req = GenerateRequest::new(prompt, max_tokens);
    req.stop_at_eos = false;
    req.sampling = SamplingParams {
        temperature: 1.0,
        seed,
        ..Default::default()
    };
    req
}

/// Random ids of the tiny model's vocabulary past its first few (a fixed seed).
fn tokens(n: usize, seed: u64) -> Vec<u32> {
    random_tokens(n, seed, 1000)
        .into_iter()
        .map(|t| t + 3)
        .collect()
}

#[test]
fn the_choices_of_one_prompt_hold_its_pages_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine_with(&dir, SynthQuant::Q4_0, 64 << 20);
    let (page_bytes, layers) = page(&engine);
    // 70 tokens: the 69 prefilled fill four pages a layer, shared by all three choices.
    let prompt = tokens(70, 1);
    let reqs: Vec<_> = (0..3).map(|i| request(prompt.clone(), 6, 50 + i)).collect();
    let mut batch = Batcher::new(BatchOptions {
        max_batch: 4,
        prefill_budget: 512,
    })
    .unwrap();
    let results = admit_all(&mut engine, &mut batch, &reqs);
    // One step: the first takes its prompt in, the others fork it, all three decode a token.
    batch.step(&mut engine);
    let one = 70usize.div_ceil(16) * layers * page_bytes;
    let held = batch.kv_bytes(&engine);
    assert!(
        held < 2 * one,
        "three choices hold {held} bytes, one alone {one}: the prompt's pages were copied"
    );
    assert_eq!(held, engine.kv_pool().unwrap().used_bytes);
    run_to_end(&mut engine, &mut batch);
    // Each choice gives what it gives alone.
    for (i, r) in reqs.iter().enumerate() {
        engine.reset_sessions();
        let alone = engine.generate(r, &mut |_| Flow::Continue).unwrap();
        let got = results.lock().unwrap()[i].take().unwrap().unwrap();
        assert_eq!(got.tokens, alone.tokens, "choice {i}");
    }
}

#[test]
fn a_full_pool_takes_the_newest_sequences_kv_and_every_output_stays_its_own() {
    let dir = tempfile::tempdir().unwrap();
    // Eight pages a layer (128 positions): each request wants 20 + 80 = 100, so the two
    // collide mid-decode, and the newer prefills its context again after the older is done.
    let (page_bytes, layers) = page(&tiny_engine_with(&dir, SynthQuant::Q4_0, 0));
    let mut engine = tiny_engine_with(&dir, SynthQuant::Q4_0, 8 * layers * page_bytes);
    let reqs: Vec<_> = (0..2)
        .map(|i| request(tokens(20, 10 + i), 80, 7 + i))
        .collect();
    let alone = alone(&mut engine, &reqs);
    // A kept conversation takes pages too: it is dropped for the running ones first.
    engine
        .generate(&request(tokens(40, 99), 4, 1), &mut |_| Flow::Continue)
        .unwrap();
    assert!(engine.cached_kv_bytes() > 0);
    let mut batch = Batcher::new(BatchOptions::default()).unwrap();
    let results = admit_all(&mut engine, &mut batch, &reqs);
    run_to_end(&mut engine, &mut batch);
    assert!(batch.preemptions() >= 1, "the two never collided");
    let mut results = results.lock().unwrap();
    for (i, a) in alone.iter().enumerate() {
        let got = results[i].take().unwrap().expect("every sequence finishes");
        assert_eq!(got.tokens, a.tokens, "sequence {i}'s tokens changed");
    }
}

/// A sequence that alone outgrows the pool ends with that error; the others finish.
#[test]
fn a_sequence_alone_past_the_pool_ends_with_kv_exceeded() {
    let dir = tempfile::tempdir().unwrap();
    let (page_bytes, layers) = page(&tiny_engine_with(&dir, SynthQuant::Q4_0, 0));
    let mut engine = tiny_engine_with(&dir, SynthQuant::Q4_0, 4 * layers * page_bytes);
    let small = request(tokens(10, 5), 8, 3);
    let alone = engine.generate(&small, &mut |_| Flow::Continue).unwrap();
    engine.reset_sessions();
    let mut batch = Batcher::new(BatchOptions::default()).unwrap();
    let reqs = [small, request(tokens(30, 6), 100, 4)];
    let results = admit_all(&mut engine, &mut batch, &reqs);
    run_to_end(&mut engine, &mut batch);
    let mut results = results.lock().unwrap();
    assert_eq!(results[0].take().unwrap().unwrap().tokens, alone.tokens);
    match results[1].take().unwrap() {
        Err(EngineError::KvExceeded { capacity }) => assert_eq!(capacity, 4 * layers * page_bytes),
        other => panic!("a sequence past the pool should end with KvExceeded: {other:?}"),
    }
}

#[test]
fn a_request_larger_than_the_pool_fails_clearly_and_the_engine_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let (page_bytes, layers) = page(&tiny_engine_with(&dir, SynthQuant::Q4_0, 0));
    let mut engine = tiny_engine_with(&dir, SynthQuant::Q4_0, 4 * layers * page_bytes);
    let big = request(tokens(30, 3), 100, 1);
    match engine.generate(&big, &mut |_| Flow::Continue) {
        Err(e @ EngineError::KvExceeded { capacity }) => {
            assert_eq!(capacity, 4 * layers * page_bytes);
            assert!(e.to_string().contains("--kv-cache-mb"), "{e}");
        }
        other => panic!("a request past the pool should fail with KvExceeded: {other:?}"),
    }
    assert_eq!(
        engine.kv_pool().unwrap().used_bytes,
        0,
        "the failed session's pages came back"
    );
    let small = engine
        .generate(&request(tokens(30, 3), 10, 1), &mut |_| Flow::Continue)
        .unwrap();
    assert_eq!(small.tokens.len(), 10);
}
