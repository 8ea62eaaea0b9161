//! Isolated decode benchmark of the CUDA backend (until `q4moe bench` drives it):
//! `cuda_bench <model.gguf|geometry> <quant> <out.json> [runs]`. With a geometry name the model
//! is synthesised to /tmp first. 128-token prompt, 256 decode tokens, the first excluded;
//! setup cache off/on x in-flight 1/2; bytes/token and GB/s against the copy bandwidth; a
//! per-kernel profile from the eager path.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use q4moe_cuda::{CudaBackend, CudaOptions};
use q4moe_model::backend::{Backend, DecodeRequest, Flow};
use q4moe_model::sampling::SamplingParams;
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};
use serde_json::json;

const PROMPT: usize = 128;
const DECODE: usize = 256;

fn model_path(arg: &str, quant: &str) -> PathBuf {
    if arg.ends_with(".gguf") {
        return arg.into();
    }
    let cfg = Config::geometry(arg).expect("geometry");
    let q = SynthQuant::parse(quant).expect("quant");
    let path = PathBuf::from(format!("/tmp/q4moe-{arg}-{quant}.gguf"));
    if !path.exists() {
        let t = Instant::now();
        synth::write(&path, &cfg, q, 1, false).expect("synth");
        eprintln!("synthesised {} in {:.1}s", path.display(), t.elapsed().as_secs_f64());
    }
    path
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One run: fresh prefill, then DECODE greedy tokens; returns (steady tok/s, phase sums, tokens).
fn run(b: &mut CudaBackend, prompt: &[u32], session: u64) -> (f64, serde_json::Value, Vec<u32>) {
    b.drop_session(session);
    let logits = b.prefill(session, prompt, false).unwrap();
    let first = q4moe_model::sampling::argmax(&logits);
    let params = SamplingParams::greedy();
    let req = DecodeRequest { session, first_token: first, max_tokens: DECODE, sampling: &params, history: &[], want_logits: false };
    let mut stamps = Vec::with_capacity(DECODE);
    let mut toks = Vec::with_capacity(DECODE);
    let stats = b
        .decode(&req, &mut |e| {
            stamps.push(Instant::now());
            toks.push(e.token);
            Flow::Continue
        })
        .unwrap();
    let steady = (stamps.len() - 2) as f64 / (stamps[stamps.len() - 1] - stamps[1]).as_secs_f64();
    let ph = &stats.phases[1..];
    let n = ph.len() as f64;
    let us = |f: &dyn Fn(&q4moe_model::backend::PhaseTimes) -> f64| ph.iter().map(f).sum::<f64>() / n * 1e6;
    let phases = json!({
        "setup_us": us(&|p| p.setup.as_secs_f64()),
        "submit_us": us(&|p| p.submit.as_secs_f64()),
        "wait_us": us(&|p| p.wait.as_secs_f64()),
        "tail_us": us(&|p| p.tail.as_secs_f64()),
        "gpu_us": us(&|p| p.gpu.map_or(0.0, |g| g.as_secs_f64())),
    });
    (steady, phases, toks)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (target, quant, out) = (&args[1], &args[2], &args[3]);
    let runs: usize = args.get(4).map_or(5, |s| s.parse().unwrap());
    let path = model_path(target, quant);
    let model = Arc::new(Model::load(&path).unwrap());
    let t = Instant::now();
    let mut b = CudaBackend::new(model.clone(), CudaOptions { kv_capacity: 1024, ..Default::default() }).unwrap();
    let load_s = t.elapsed().as_secs_f64();
    let bw = b.measure_copy_bandwidth();
    let bpt = model.bytes_per_token();
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7919 + 13) % model.config.vocab_size as u32).collect();
    let mut configs = Vec::new();
    let mut reference: Option<Vec<u32>> = None;
    for (cache, fl) in [(false, 1), (false, 2), (true, 1), (true, 2)] {
        b.set_setup_cache(cache);
        b.set_in_flight(fl);
        run(&mut b, &prompt, 1); // warm-up (captures the graph)
        let mut tps = Vec::new();
        let mut phases = Vec::new();
        for _ in 0..runs {
            let (t, p, toks) = run(&mut b, &prompt, 1);
            if let Some(r) = &reference {
                assert_eq!(r, &toks, "token stream differs between configurations");
            } else {
                reference = Some(toks);
            }
            tps.push(t);
            phases.push(p);
        }
        let (min, max) = (tps.iter().cloned().fold(f64::MAX, f64::min), tps.iter().cloned().fold(0.0, f64::max));
        let med = median(&mut tps.clone());
        let gbs = med * bpt as f64 / 1e9;
        eprintln!("setup_cache {cache} in_flight {fl}: median {med:.1} tok/s (min {min:.1}, max {max:.1}), {gbs:.0} GB/s = {:.0}% of copy", 100.0 * gbs / bw);
        configs.push(json!({
            "setup_cache": cache, "in_flight": fl, "runs": runs, "tok_s": tps,
            "median_tok_s": med, "min_tok_s": min, "max_tok_s": max,
            "achieved_gb_s": gbs, "fraction_of_copy_bw": gbs / bw, "phases_mean": phases[phases.len() / 2],
        }));
    }
    b.set_setup_cache(false);
    b.set_in_flight(1);
    b.set_profile_kernels(true);
    b.reset_kernel_profile();
    run(&mut b, &prompt, 2);
    let prof: Vec<_> = b
        .kernel_profile()
        .iter()
        .map(|k| {
            let s = k.total.as_secs_f64();
            eprintln!("  {:14} calls {:7} total {:8.2} ms  {:6.0} GB/s", k.name, k.calls, s * 1e3, k.bytes_read as f64 / s / 1e9);
            json!({"name": k.name, "calls": k.calls, "total_ms": s * 1e3, "bytes_read": k.bytes_read, "gb_s": k.bytes_read as f64 / s / 1e9})
        })
        .collect();
    let info = b.info();
    let rec = json!({
        "bench": "cuda_bench", "device": info.device, "model": path.display().to_string(), "quant": quant,
        "geometry": format!("{:?}", model.config), "prompt_tokens": PROMPT, "decode_tokens": DECODE,
        "first_token_excluded": true, "resident_bytes": info.resident_bytes, "load_s": load_s,
        "bytes_per_token": bpt, "copy_bandwidth_gb_s": bw, "configs": configs, "kernel_profile_eager": prof,
        "commit": std::env::var("Q4MOE_COMMIT").unwrap_or_default(),
    });
    std::fs::write(out, serde_json::to_string_pretty(&rec).unwrap()).unwrap();
}
