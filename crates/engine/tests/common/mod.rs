//! What the engine's test files share: a CPU engine over the tiny synthetic model.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use q4moe_engine::{
    Batcher, Device, Engine, EngineOptions, Flow, GenerateOutput, GenerateRequest, SequenceSink,
};
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

pub type Results = Arc<Mutex<Vec<Option<q4moe_engine::Result<GenerateOutput>>>>>;

/// A sink keeping each sequence's result by its index, error or not.
pub struct Keep {
    id: usize,
    results: Results,
}

impl SequenceSink for Keep {
    fn piece(&mut self, _: q4moe_engine::Piece<'_>) -> Flow {
        Flow::Continue
    }
    fn cancelled(&self) -> bool {
        false
    }
    fn finished(self: Box<Self>, result: q4moe_engine::Result<GenerateOutput>) {
        self.results.lock().unwrap()[self.id] = Some(result);
    }
}

/// Admits `reqs` into `batch`, each with a sink keeping its result by index.
pub fn admit_all(engine: &mut Engine, batch: &mut Batcher, reqs: &[GenerateRequest]) -> Results {
    let results: Results = Arc::new(Mutex::new(reqs.iter().map(|_| None).collect()));
    for (id, r) in reqs.iter().enumerate() {
        let results = results.clone();
        batch.admit(engine, r.clone(), Box::new(Keep { id, results }));
    }
    results
}
