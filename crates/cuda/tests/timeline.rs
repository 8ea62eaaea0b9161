//! The launch timeline (the `timeline` feature: kernels compiled with -DQ4MOE_TIMELINE) on a
//! GPU: `cargo test -p q4moe-cuda --release --features timeline --test timeline -- --ignored`.
#![cfg(feature = "timeline")]

use std::sync::Arc;

use q4moe_cuda::{CudaBackend, CudaOptions};
use q4moe_model::backend::{Backend, DecodeRequest, Flow, Logits};
use q4moe_model::sampling::SamplingParams;
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

/// Decode steps from which the backend records (timeline.rs FROM_STEP), and steps after it.
const FROM_STEP: usize = 32;
const RECORDED: usize = 16;

#[test]
#[ignore = "needs a CUDA GPU"]
fn timeline_names_each_layer_launch() {
    if let Err(why) = q4moe_cuda::cuda_available() {
        panic!("this test needs a CUDA GPU: {why}");
    }
    let cfg = Config::mid();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mid.gguf");
    synth::write(&path, &cfg, SynthQuant::Q4_0, 42, false).unwrap();
    let m = Arc::new(Model::load(&path).unwrap());
    let opts = CudaOptions {
        kv_capacity: 256,
        ..Default::default()
    };
    let mut gpu = CudaBackend::new(m, opts).unwrap();
    gpu.prefill(1, &[1, 2, 3, 4], Logits::Last).unwrap();
    let req = DecodeRequest {
        session: 1,
        first_token: 5,
        max_tokens: FROM_STEP + RECORDED,
        sampling: &SamplingParams::greedy(),
        history: &[],
        want_logits: false,
    };
    gpu.decode(&req, &mut |_| Flow::Continue).unwrap();
    let prof = gpu.kernel_profile();
    let steps: Vec<_> = prof
        .iter()
        .filter(|k| k.name.starts_with("timeline ") && k.name.ends_with(" step"))
        .collect();
    for k in &steps {
        eprintln!(
            "{}: {} calls, {:.2} us a call",
            k.name,
            k.calls,
            k.total.as_secs_f64() * 1e6 / k.calls as f64
        );
    }
    assert!(
        !steps.iter().any(|k| k.name.contains("(other)")),
        "a recorded launch matched no launch of the step"
    );
    // Each layer kernel once a layer and recorded step: a launch per slot, none merged or lost
    // (a slot is a launch's %gridid past the step's first; a graph's replays repeat them, so
    // each step is recorded apart: with one table for all, this count was one step's).
    let want = (cfg.n_layer * RECORDED) as u64;
    for kernel in ["attn_gqa", "moe_gate_up", "moe_down"] {
        let calls: u64 = steps
            .iter()
            .filter(|k| k.name.contains(kernel))
            .map(|k| k.calls)
            .sum();
        assert!(
            calls >= want,
            "{kernel}: {calls} steps recorded, want {want} or more"
        );
    }
    let total: f64 = steps.iter().map(|k| k.total.as_secs_f64()).sum();
    assert!(total > 0.0 && total.is_finite(), "steps sum to {total} s");
}
