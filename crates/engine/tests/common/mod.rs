//! What the engine's test files share: a CPU engine over the tiny synthetic model.
#![allow(dead_code)]

use std::sync::Arc;

use q4moe_engine::{Batcher, Device, Engine, EngineOptions, Flow, GenerateOutput, GenerateRequest};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

/// The tiny model in `quant`, written into `dir`, on the CPU with a 256-position KV.
pub fn tiny_engine(dir: &tempfile::TempDir, quant: SynthQuant) -> Engine {
    tiny_engine_with(dir, quant, EngineOptions::default().kv_cache_bytes)
}

/// `tiny_engine` with a KV pool of `kv_cache_bytes`.
pub fn tiny_engine_with(
    dir: &tempfile::TempDir,
    quant: SynthQuant,
    kv_cache_bytes: usize,
) -> Engine {
    let path = dir.path().join("tiny.gguf");
    synth::write(&path, &Config::tiny(), quant, 7, false).unwrap();
    let opts = EngineOptions {
        device: Device::Cpu,
        kv_capacity: 256,
        kv_cache_bytes,
        ..Default::default()
    };
    Engine::from_model(Arc::new(Model::load(&path).unwrap()), &opts).unwrap()
}

/// Steps the batch until every sequence has finished.
pub fn run_to_end(engine: &mut Engine, batch: &mut Batcher) {
    for _ in 0..10_000 {
        if batch.is_empty() {
            return;
        }
        batch.step(engine);
    }
    panic!("the batch never drained");
}

/// `n` random ids below `vocab` (a fixed seed).
pub fn random_tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = q4moe_model::sampling::Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// What each request gives alone, each from a fresh session store.
pub fn alone(engine: &mut Engine, reqs: &[GenerateRequest]) -> Vec<GenerateOutput> {
    let out = reqs
        .iter()
        .map(|r| {
            engine.reset_sessions();
            engine.generate(r, &mut |_| Flow::Continue).unwrap()
        })
        .collect();
    engine.reset_sessions();
    out
}
