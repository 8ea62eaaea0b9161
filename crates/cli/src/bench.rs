//! `q4moe bench`: the isolated decode benchmark (DESIGN.md section 8). Drives a backend through
//! the `Backend` trait with random prompt tokens, greedy decode, several runs per configuration.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use q4moe_engine::{Backend, Device, Flow, PhaseTimes, SamplingParams};
use q4moe_model::backend::{DecodeRequest, KvType, Logits};
use q4moe_model::sampling::Rng;
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};
use serde_json::{json, Value};

mod batch;
mod constrained;
mod prefill;
mod print;
mod report;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A GGUF to benchmark; without it a synthetic model is written to the temp dir.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Geometry of the synthetic model (tiny, mid, qwen3-30b-a3b).
    #[arg(long, default_value = "mid")]
    geometry: String,
    /// Weight type of the synthetic model (q4_0, q4_k_m, ...: as `q4moe synth --quant`).
    #[arg(long, default_value = "q4_0")]
    quant: String,
    /// Where the model runs: auto (the GPU when one is usable), cpu, or cuda (`gpu` is another
    /// name for cuda).
    #[arg(long, default_value = "auto", value_parser = crate::DEVICES)]
    device: String,
    /// CPU threads for the forward pass (default: every core, or RAYON_NUM_THREADS).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Prompt tokens of each run (random tokens), prefilled before decoding (llama-bench's pp).
    #[arg(short = 'p', long, default_value_t = 128)]
    prompt_len: usize,
    /// Tokens decoded each run (llama-bench's tg); the first step is warm-up, not timed.
    #[arg(short = 'n', long, default_value_t = 256)]
    decode_len: usize,
    /// Runs of each configuration (median, min and max are reported).
    #[arg(short = 'r', long, default_value_t = 5)]
    runs: usize,
    /// Batch sizes of the batched decode step to measure, e.g. 1,2,4,8 (1 to 256). Replaces the
    /// single-stream variants; each size is checked for batch invariance against each sequence
    /// run alone through the batched step.
    #[arg(long, value_delimiter = ',', value_name = "B,B,..")]
    batch: Vec<usize>,
    /// Prompt lengths to measure prefill alone at, e.g. 128,512,2048,8192. Replaces the
    /// single-stream variants (with --batch, runs after it).
    #[arg(long, value_delimiter = ',', value_name = "N,N,..")]
    prefill: Vec<usize>,
    /// A JSON schema file: greedy decode held to it beside the same decode unconstrained
    /// (tok/s of each; replaces the single-stream variants). E.g. a file holding
    /// `{"type": "string", "minLength": 4096}` keeps the model writing for the whole run.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    /// Printed output: `table` (every figure), or `md` (llama-bench's markdown pp/tg table).
    #[arg(short = 'o', long, default_value = "table", value_parser = ["table", "md"])]
    output: String,
    /// KV cache element type, f16 or f32 (f16 halves what attention reads a position).
    #[arg(long, default_value = "f16", value_parser = KvType::parse)]
    kv_type: KvType,
    /// GPU: setup cache configurations to measure.
    #[arg(long, default_value = "both", value_parser = ["on", "off", "both"])]
    setup_cache: String,
    /// GPU: in-flight depths to measure with the cache on.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    in_flight: Vec<usize>,
    /// GPU: prompt tokens prefilled at once (0: a decode step a token). Default 1,024.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// GPU: a CUDA backend option, KEY=VALUE (repeatable; `--cuda-opt help` lists the keys).
    #[arg(long = "cuda-opt", value_name = "KEY=VALUE", long_help = crate::cuda_opts::long_help())]
    cuda_opt: Vec<String>,
    /// Also decode after this many positions of context (0 = skip).
    #[arg(long, default_value_t = 0)]
    long_context: usize,
    /// GPU: `kernels` times every kernel (on the eager path).
    #[arg(long, value_parser = ["kernels"])]
    profile: Option<String>,
    /// Write the JSON record here: a file, or a directory (existing, or a path without an
    /// extension), where it gets a dated name (bench-cpu-2026-01-31T12-00-00Z.json).
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Seed of the synthetic model's weights and of the random prompts.
    #[arg(short = 's', long, default_value_t = 0)]
    seed: u64,
    /// GPU: also measure sampled decoding (cache on) with Qwen3's recommended settings
    /// (temperature 0.6, top-k 20, top-p 0.95: the device sampler), with top-k off (the host
    /// sampler's nucleus) and with the OpenAI API's defaults (temperature 1, no top-k, top-p 1:
    /// the device sampler's vocabulary-order walk).
    #[arg(long)]
    sampled: bool,
}

/// One measured configuration of the backend.
#[derive(Clone, Debug)]
struct Variant {
    name: String,
    setup_cache: bool,
    in_flight: usize,
    sampling: SamplingParams,
}

/// What one run measured.
struct RunResult {
    steady_tok_s: f64,
    prefill_tok_s: f64,
    phases: PhaseTimes,
    tokens: Vec<u32>,
}

enum AnyBackend {
    Cpu(Box<q4moe_cpu::CpuBackend>),
    Cuda(Box<q4moe_cuda::CudaBackend>),
}

impl AnyBackend {
    fn get(&mut self) -> &mut dyn Backend {
        match self {
            AnyBackend::Cpu(b) => b.as_mut(),
            AnyBackend::Cuda(b) => b.as_mut(),
        }
    }

    fn configure(&mut self, v: &Variant) {
        if let AnyBackend::Cuda(b) = self {
            b.set_setup_cache(v.setup_cache);
            b.set_in_flight(v.in_flight);
        }
    }
}

fn load_model(a: &BenchArgs) -> anyhow::Result<(Arc<Model>, String)> {
    let (path, label) = match &a.model {
        Some(p) => (p.clone(), p.display().to_string()),
        None => {
            let cfg = Config::geometry(&a.geometry)?;
            let p = std::env::temp_dir().join(format!(
                "q4moe-bench-{}-{}-{}.gguf",
                a.geometry, a.quant, a.seed
            ));
            if !p.exists() {
                eprintln!(
                    "writing synthetic {} {} model to {}",
                    a.geometry,
                    a.quant,
                    p.display()
                );
                synth::write(&p, &cfg, SynthQuant::parse(&a.quant)?, a.seed, true)?;
            }
            (p, format!("synthetic {} {}", a.geometry, a.quant))
        }
    };
    Ok((crate::load_model(&path)?, label))
}

fn open(model: &Arc<Model>, a: &BenchArgs, ctx: usize) -> anyhow::Result<AnyBackend> {
    let want_cuda = match Device::parse(&a.device)? {
        Device::Cpu => false,
        Device::Cuda => {
            q4moe_cuda::cuda_available().map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
            true
        }
        Device::Auto => q4moe_cuda::cuda_available().is_ok(),
    };
    let kv_type = a.kv_type;
    if !want_cuda {
        model.prefault(true);
        return Ok(AnyBackend::Cpu(Box::new(
            q4moe_cpu::CpuBackend::new(model.clone(), ctx).with_kv_type(kv_type),
        )));
    }
    let opts = q4moe_cuda::CudaOptions {
        kv_capacity: ctx,
        kv_type,
        profile_kernels: a.profile.as_deref() == Some("kernels"),
        prefill_chunk: prefill_chunk(a),
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        ..Default::default()
    };
    let opts = crate::cuda_opts::apply(opts, &a.cuda_opt)?;
    Ok(AnyBackend::Cuda(Box::new(q4moe_cuda::CudaBackend::new(
        model.clone(),
        opts,
    )?)))
}

/// The GPU's batched prefill chunk: `--prefill-chunk`, else CudaOptions' default.
fn prefill_chunk(a: &BenchArgs) -> usize {
    a.prefill_chunk
        .unwrap_or_else(|| q4moe_cuda::CudaOptions::default().prefill_chunk)
}

fn variants(a: &BenchArgs, backend: &AnyBackend) -> Vec<Variant> {
    if matches!(backend, AnyBackend::Cpu(_)) {
        return vec![Variant {
            name: "cpu".into(),
            setup_cache: false,
            in_flight: 1,
            sampling: SamplingParams::greedy(),
        }];
    }
    let mut v = Vec::new();
    if a.setup_cache != "on" {
        v.push(Variant {
            name: "cache off, in-flight 1".into(),
            setup_cache: false,
            in_flight: 1,
            sampling: SamplingParams::greedy(),
        });
    }
    if a.setup_cache != "off" {
        for &n in &a.in_flight {
            v.push(Variant {
                name: format!("cache on, in-flight {n}"),
                setup_cache: true,
                in_flight: n.max(1),
                sampling: SamplingParams::greedy(),
            });
        }
    }
    if a.sampled && a.setup_cache != "off" {
        let qwen3 = SamplingParams {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            seed: 7,
            ..Default::default()
        };
        let in_flight = *a.in_flight.iter().max().unwrap_or(&1);
        v.push(Variant {
            name: format!("sampled k20, in-flight {in_flight}"),
            setup_cache: true,
            in_flight,
            sampling: qwen3.clone(),
        });
        v.push(Variant {
            name: "sampled k off p0.95".into(),
            setup_cache: true,
            in_flight,
            sampling: SamplingParams {
                top_k: 0,
                ..qwen3.clone()
            },
        });
        v.push(Variant {
            name: "sampled k20 rep1.1".into(),
            setup_cache: true,
            in_flight,
            sampling: SamplingParams {
                repetition_penalty: 1.1,
                ..qwen3.clone()
            },
        });
        v.push(Variant {
            name: "sampled T1 p1".into(),
            setup_cache: true,
            in_flight,
            sampling: SamplingParams {
                temperature: 1.0,
                seed: 7,
                ..Default::default()
            },
        });
    }
    v
}

fn random_prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed ^ 0x5EED);
    // Stay clear of the special tokens at the top of the vocabulary.
    let hi = (vocab * 9 / 10).max(1) as u64;
    (0..len).map(|_| (rng.next_u64() % hi) as u32).collect()
}

/// Prefill `prompt` in `session` but its last token, then decode `n` tokens with `sampling`
/// from that token (the engine's shape: every generated token comes out of decode), timing
/// every token.
fn one_run(
    b: &mut dyn Backend,
    session: u64,
    prompt: &[u32],
    n: usize,
    sampling: &SamplingParams,
) -> anyhow::Result<RunResult> {
    let (&last, before) = prompt.split_last().context("the bench prompt is empty")?;
    let t0 = Instant::now();
    b.prefill(session, before, Logits::None)?;
    let prefill = t0.elapsed();
    let req = DecodeRequest {
        session,
        first_token: last,
        max_tokens: n,
        sampling,
        history: prompt,
        want_logits: false,
    };
    let mut stamps = Vec::with_capacity(n);
    let mut tokens = Vec::with_capacity(n);
    let stats = b.decode(&req, &mut |ev| {
        stamps.push(Instant::now());
        tokens.push(ev.token);
        Flow::Continue
    })?;
    anyhow::ensure!(
        stamps.len() >= 2,
        "decode produced {} tokens; need at least 2",
        stamps.len()
    );
    // Steady state: the first decode step (graph capture, warm-up) is excluded.
    let steady = stamps[stamps.len() - 1] - stamps[0];
    let steady_phases = &stats.phases[1.min(stats.phases.len())..];
    Ok(RunResult {
        steady_tok_s: (stamps.len() - 1) as f64 / steady.as_secs_f64(),
        prefill_tok_s: before.len() as f64 / prefill.as_secs_f64(),
        phases: mean_phases(steady_phases),
        tokens,
    })
}

fn mean_phases(p: &[PhaseTimes]) -> PhaseTimes {
    let n = p.len().max(1) as u32;
    let sum = |f: fn(&PhaseTimes) -> Duration| p.iter().map(f).sum::<Duration>() / n;
    let gpu: Vec<Duration> = p.iter().filter_map(|x| x.gpu).collect();
    PhaseTimes {
        setup: sum(|x| x.setup),
        submit: sum(|x| x.submit),
        wait: sum(|x| x.wait),
        tail: sum(|x| x.tail),
        gpu: (!gpu.is_empty()).then(|| gpu.iter().sum::<Duration>() / gpu.len() as u32),
    }
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.runs >= 1 && a.decode_len >= 2 && a.prompt_len >= 1,
        "need runs >= 1, decode-len >= 2, prompt-len >= 1"
    );
    anyhow::ensure!(
        a.batch.iter().all(|&b| (1..=batch::MAX_BATCH).contains(&b)),
        "--batch sizes must be 1 to {}",
        batch::MAX_BATCH
    );
    crate::apply_threads(a.threads)?;
    let (model, label) = load_model(&a)?;
    let longest = a.prefill.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(
        longest <= model.config.context_length,
        "--prefill {longest} is past the model's context of {} tokens",
        model.config.context_length
    );
    anyhow::ensure!(
        !a.prefill.contains(&0),
        "--prefill lengths must be at least 1"
    );
    let ctx = (a.prompt_len.max(a.long_context).max(longest) + a.decode_len + 8)
        .min(model.config.context_length);
    let opened = Instant::now();
    let mut backend = open(&model, &a, ctx)?;
    let open_s = opened.elapsed().as_secs_f64();
    eprintln!("backend ready in {open_s:.2} s");
    let info = backend.get().info();
    if !info.cache_policy.is_empty() {
        eprintln!("cache policy: {}", info.cache_policy);
    }
    if !info.step_readback.is_empty() {
        eprintln!("step read-back: {}", info.step_readback);
    }
    if !a.batch.is_empty() || !a.prefill.is_empty() || a.json_schema.is_some() {
        return run_batched(&a, &label, &model, &mut backend, open_s);
    }
    let prompt = random_prompt(a.prompt_len, model.config.vocab_size, a.seed);
    let mut results = Vec::new();
    let mut session = 1u64;
    for v in variants(&a, &backend) {
        backend.configure(&v);
        let mut runs = Vec::new();
        for _ in 0..a.runs {
            runs.push(one_run(
                backend.get(),
                session,
                &prompt,
                a.decode_len,
                &v.sampling,
            )?);
            backend.get().drop_session(session);
            session += 1;
        }
        eprintln!(
            "  {:<24} median {:.1} tok/s",
            v.name,
            report::median(&runs.iter().map(|r| r.steady_tok_s).collect::<Vec<_>>())
        );
        results.push((v, runs));
    }
    let long = if a.long_context > 0 {
        Some(long_context_run(
            &mut backend,
            &a,
            model.config.vocab_size,
            &mut session,
        )?)
    } else {
        None
    };
    let extras = match &backend {
        AnyBackend::Cuda(b) => report::Extras {
            open_s,
            copy_gbs: Some(b.measure_copy_bandwidth()),
            kernels: b.kernel_profile(),
            graph_setups: Some(b.graph_setups()),
        },
        AnyBackend::Cpu(_) => report::Extras {
            open_s,
            copy_gbs: Some(cpu_copy_bandwidth()),
            kernels: Vec::new(),
            graph_setups: None,
        },
    };
    let record = report::build(&a, &label, &model, &info, &results, long.as_ref(), &extras);
    finish(&a, &record)
}

/// The CPU's copy bandwidth, measured in the run as the GPU's is: 256 MiB copied by the
/// forward pass's threads, the median of 5 copies.
fn cpu_copy_bandwidth() -> f64 {
    q4moe_cpu::copy_bandwidth(256 << 20, 5)
}

/// Prints the record as `--output` asks and writes it where `--json-out` says.
fn finish(a: &BenchArgs, record: &Value) -> anyhow::Result<()> {
    match a.output.as_str() {
        "md" => print::print_markdown(record),
        _ => print::print_table(record),
    }
    if let Some(out) = &a.json_out {
        let path = report::write_json(out, record)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `--batch` (the batched decode step at every size asked for), `--json-schema` (decode held to
/// a schema beside the same decode unconstrained) and `--prefill` (prefill alone at every length
/// asked for).
fn run_batched(
    a: &BenchArgs,
    label: &str,
    model: &Model,
    backend: &mut AnyBackend,
    open_s: f64,
) -> anyhow::Result<()> {
    let info = backend.get().info();
    let mut record = report::conditions(a, label, model, &info, open_s);
    if !a.batch.is_empty() {
        let plan = batch::BatchPlan {
            batch: &a.batch,
            prompt_len: a.prompt_len,
            decode_len: a.decode_len,
            runs: a.runs,
            seed: a.seed,
        };
        if let Some(refs) = batch::references(backend.get(), &plan)? {
            let before = match backend {
                AnyBackend::Cuda(b) => b.kernel_profile(),
                AnyBackend::Cpu(_) => Vec::new(),
            };
            let mut batched = batch::run(backend.get(), model, &plan, &refs)?;
            match backend {
                AnyBackend::Cuda(b) => {
                    let copy = b.measure_copy_bandwidth();
                    batch::add_copy_share(&mut batched, copy);
                    // --profile kernels: the timed runs' launches (their prompts' prefills and
                    // their steps), eager and timed; not the references'.
                    let timed = report::kernels_since(&b.kernel_profile(), &before);
                    record["kernel_profile"] = report::kernel_json(&timed, Some(copy)).into();
                }
                AnyBackend::Cpu(_) => batch::add_copy_share(&mut batched, cpu_copy_bandwidth()),
            }
            record["batched"] = batched;
        }
    }
    if let Some(schema) = &a.json_schema {
        let plan = constrained::Plan {
            schema,
            prompt_len: a.prompt_len,
            decode_len: a.decode_len,
            runs: a.runs,
            seed: a.seed,
        };
        record["constrained"] = constrained::run(backend.get(), model, &plan)?;
    }
    if !a.prefill.is_empty() {
        let vocab = model.config.vocab_size;
        let p = prefill::run(backend.get(), vocab, &a.prefill, a.runs, a.seed)?;
        record["prefill_sweep"] = p;
    }
    finish(a, &record)
}

/// Decode steady tok/s after `long_context` positions, and the prefill of those positions: each
/// run prefills a new session, then decodes.
fn long_context_run(
    b: &mut AnyBackend,
    a: &BenchArgs,
    vocab: usize,
    session: &mut u64,
) -> anyhow::Result<Value> {
    let v = Variant {
        name: "long".into(),
        setup_cache: true,
        in_flight: *a.in_flight.iter().max().unwrap_or(&1),
        sampling: SamplingParams::greedy(),
    };
    b.configure(&v);
    let ctx_prompt = random_prompt(a.long_context, vocab, a.seed ^ 1);
    let (mut tok_s, mut prefill_s) = (Vec::new(), Vec::new());
    for _ in 0..a.runs {
        let s = *session;
        *session += 1;
        let (&last, before) = ctx_prompt.split_last().context("--long-context is 0")?;
        let t0 = Instant::now();
        b.get().prefill(s, before, Logits::None)?;
        prefill_s.push(t0.elapsed().as_secs_f64());
        let sampling = SamplingParams::greedy();
        let req = DecodeRequest {
            session: s,
            first_token: last,
            max_tokens: a.decode_len,
            sampling: &sampling,
            history: &ctx_prompt,
            want_logits: false,
        };
        let mut stamps = Vec::new();
        b.get().decode(&req, &mut |_| {
            stamps.push(Instant::now());
            Flow::Continue
        })?;
        tok_s
            .push((stamps.len() - 1) as f64 / (stamps[stamps.len() - 1] - stamps[0]).as_secs_f64());
        b.get().drop_session(s);
    }
    let prefill_tok_s: Vec<f64> = prefill_s
        .iter()
        .map(|s| (a.long_context - 1) as f64 / s)
        .collect();
    Ok(json!({
        "context": a.long_context,
        "decode_tokens": a.decode_len,
        "prefill_seconds": report::stats(&prefill_s),
        "prefill_tok_s": report::stats(&prefill_tok_s),
        "config": v.name,
        "tok_s": report::stats(&tok_s),
    }))
}
