//! Serving benchmark: the isolated engine's steady decode rate, then the same engine behind the
//! HTTP server: one stream's steady rate and time to first token, and aggregate rates at 1, 4
//! and 16 concurrent streams. Writes bench/results/serve-<date>.json.
//!
//! cargo run --release -p q4moe-server --example serve_bench -- [--model F.gguf | --geometry mid]
//!     [--device auto] [--tokens 64] [--runs 5] [--concurrency 1,4,16] [--max-batch 64] [--cuda-opt KEY=VALUE]... [--out FILE]

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use q4moe_engine::{Device, Engine, EngineOptions, GenerateRequest};
use q4moe_server::ServeConfig;
use serde_json::{json, Value};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

const PROMPT: &str =
    "The history of the mixture of experts architecture begins with a simple idea:";

/// Each request's number, least significant digit first, opens its prompt: neighbours differ in
/// the first character, so no request reuses more than a token of another's KV (fair prefill).
fn prompt(i: usize) -> String {
    let id: String = i.to_string().chars().rev().collect();
    format!("{id}: {PROMPT}")
}

/// The p50 and p99 of `xs` (nearest rank).
fn percentiles(xs: &[f64]) -> Value {
    let mut s = xs.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| {
        s.get(((p * s.len() as f64).ceil() as usize).saturating_sub(1))
            .copied()
    };
    json!({ "p50": at(0.50), "p99": at(0.99), "n": s.len() })
}

fn stats(xs: &[f64]) -> Value {
    let mut s = xs.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    json!({ "median": s.get(s.len() / 2), "min": s.first(), "max": s.last(), "runs": xs })
}

/// Steady decode tok/s of the engine alone (first token excluded) and its first-token latency.
fn isolated(
    engine: &mut Engine,
    tokens: usize,
    runs: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let (mut rates, mut ttft) = (Vec::new(), Vec::new());
    for i in 0..=runs {
        let mut req = GenerateRequest::new(engine.encode_prompt(&prompt(1000 + i))?, tokens);
        req.stop_at_eos = false;
        let out = engine.generate(&req, &mut |_| q4moe_engine::Flow::Continue)?;
        if i > 0 {
            // run 0 warms caches and threads
            rates.push((out.tokens.len() - 1) as f64 / out.decode_time.as_secs_f64());
            ttft.push(out.prefill_time.as_secs_f64() * 1e3);
        }
    }
    engine.reset_sessions();
    Ok((rates, ttft))
}

struct StreamTiming {
    ttft: Duration,
    /// From the first text chunk to the last.
    decode: Duration,
    tokens: usize,
    /// Milliseconds between consecutive text chunks (one token each).
    gaps: Vec<f64>,
}

async fn one_stream(
    http: &reqwest::Client,
    base: &str,
    i: usize,
    tokens: usize,
) -> anyhow::Result<StreamTiming> {
    let body = json!({
        "prompt": prompt(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": true,
        "stream": true, "stream_options": { "include_usage": true },
    });
    let t0 = Instant::now();
    let r = http
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await?
        .error_for_status()?;
    let mut bytes = r.bytes_stream();
    let (mut first, mut last, mut n, mut buf) = (None, t0, 0, String::new());
    let mut gaps = Vec::new();
    while let Some(chunk) = bytes.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
                n = u as usize;
            } else if v["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            {
                let now = Instant::now();
                if first.is_some() {
                    gaps.push((now - last).as_secs_f64() * 1e3);
                }
                first.get_or_insert(now);
                last = now;
            }
        }
    }
    let first = first.ok_or_else(|| anyhow::anyhow!("stream {i} produced no text"))?;
    Ok(StreamTiming {
        ttft: first - t0,
        decode: last - first,
        tokens: n,
        gaps,
    })
}

/// `c` streams at once: aggregate tok/s over the wall time, each stream's time to first token,
/// and every inter-token gap.
async fn concurrent(
    http: &reqwest::Client,
    base: &str,
    c: usize,
    tokens: usize,
    seed: usize,
) -> anyhow::Result<(f64, Vec<f64>, Vec<f64>)> {
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|k| {
            let (http, base) = (http.clone(), base.to_string());
            tokio::spawn(async move { one_stream(&http, &base, seed + k, tokens).await })
        })
        .collect();
    let mut total = 0;
    let (mut ttft, mut gaps) = (Vec::new(), Vec::new());
    for t in tasks {
        let s = t.await??;
        total += s.tokens;
        ttft.push(s.ttft.as_secs_f64() * 1e3);
        gaps.extend(s.gaps);
    }
    Ok((total as f64 / t0.elapsed().as_secs_f64(), ttft, gaps))
}

/// The server's own decode-time record: (sum of per-request mean seconds per token, requests).
async fn server_tpot(http: &reqwest::Client, base: &str) -> anyhow::Result<(f64, f64)> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let get = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok((
        get("q4moe_time_per_output_token_seconds_sum "),
        get("q4moe_time_per_output_token_seconds_count "),
    ))
}

fn date() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        / 86400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    format!("{:04}-{m:02}-{d:02}", yoe + era * 400 + i64::from(m <= 2))
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("model name"))
            .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
    });
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok();
    json!({ "cpu": cpu, "threads": std::thread::available_parallelism().map(|n| n.get()).ok(), "hostname": host })
}

fn commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tokens: usize = arg("--tokens").map_or(Ok(64), |s| s.parse())?;
    let runs: usize = arg("--runs").map_or(Ok(5), |s| s.parse())?.max(1);
    let max_batch: usize = arg("--max-batch").map_or(Ok(64), |s| s.parse())?;
    let levels: Vec<usize> = arg("--concurrency")
        .unwrap_or_else(|| "1,4,16".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let dir = tempfile::tempdir()?;
    let (model_path, quant) = match arg("--model") {
        Some(m) => (m.into(), "from file".to_string()),
        None => {
            let geometry = arg("--geometry").unwrap_or_else(|| "mid".into());
            let path = dir.path().join(format!("{geometry}.gguf"));
            eprintln!("writing a synthetic {geometry} model (q4_0)");
            q4moe_model::synth::write(
                &path,
                &q4moe_model::Config::geometry(&geometry)?,
                q4moe_model::synth::SynthQuant::Q4_0,
                0,
                false,
            )?;
            (path, "q4_0 (synthetic)".to_string())
        }
    };
    let device = Device::parse(&arg("--device").unwrap_or_else(|| "auto".into()))?;
    let mut opts = EngineOptions {
        device,
        ..Default::default()
    };
    // `--cuda-opt KEY=VALUE` (repeatable), as `q4moe serve` takes it.
    let argv: Vec<String> = std::env::args().collect();
    for w in argv.windows(2).filter(|w| w[0] == "--cuda-opt") {
        let (k, v) = w[1]
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--cuda-opt {}: expected KEY=VALUE", w[1]))?;
        opts.cuda
            .set(k, v)
            .map_err(|e| anyhow::anyhow!("--cuda-opt {}: {e}", w[1]))?;
    }
    let mut engine = Engine::load(&model_path, &opts)?;
    let info = engine.backend().info();
    let c = engine.model.config.clone();
    eprintln!(
        "backend {} ({}); isolated engine, {runs} runs of {tokens} tokens",
        info.kind, info.device
    );
    let (iso_rate, iso_ttft) = isolated(&mut engine, tokens, runs)?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let mut cfg = ServeConfig::default();
    cfg.batch.max_batch = max_batch;
    tokio::spawn(q4moe_server::serve_on(
        listener,
        engine,
        cfg,
        std::future::pending(),
    ));
    let http = reqwest::Client::new();
    one_stream(&http, &base, 0, tokens).await?; // warm-up
    eprintln!("HTTP single stream");
    let (mut rate, mut ttft, mut served) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        let before = server_tpot(&http, &base).await?;
        let s = one_stream(&http, &base, 2000 + i, tokens).await?;
        // text chunks are tokens less the first; usage counts them all
        rate.push((s.tokens - 1) as f64 / s.decode.as_secs_f64());
        ttft.push(s.ttft.as_secs_f64() * 1e3);
        // The engine's own rate inside the server: separates HTTP cost from engine slowdowns.
        let after = server_tpot(&http, &base).await?;
        served.push((after.1 - before.1) / (after.0 - before.0));
    }
    let mut conc = Vec::new();
    for &level in &levels {
        eprintln!("HTTP {level} concurrent streams");
        let (mut agg, mut t, mut gaps) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..runs {
            let (a, tt, g) =
                concurrent(&http, &base, level, tokens, 10_000 * (r + 1) + 100 * level).await?;
            agg.push(a);
            t.extend(tt);
            gaps.extend(g);
        }
        conc.push(json!({
            "streams": level, "aggregate_tok_s": stats(&agg), "ttft_ms": stats(&t),
            "ttft_ms_percentiles": percentiles(&t), "inter_token_ms": percentiles(&gaps),
        }));
    }
    let record = json!({
        "bench": "serve_bench",
        "date": date(),
        "commit": commit(),
        "machine": machine(),
        "backend": { "kind": info.kind, "device": info.device, "kv_capacity": info.kv_capacity },
        "model": {
            "path": arg("--model"), "quant": quant, "n_layer": c.n_layer, "d_model": c.d_model, "n_head": c.n_head,
            "n_kv_head": c.n_kv_head, "head_dim": c.head_dim, "n_expert": c.n_expert, "n_expert_used": c.n_expert_used,
            "d_ff_expert": c.d_ff_expert, "vocab_size": c.vocab_size,
        },
        "conditions": { "decode_tokens": tokens, "prompt": PROMPT, "greedy": true, "ignore_eos": true, "runs": runs, "max_batch": max_batch,
                        "steady_rate": "tokens after the first / time from first to last token" },
        "isolated": { "steady_tok_s": stats(&iso_rate), "prefill_ms": stats(&iso_ttft) },
        "http_single_stream": { "steady_tok_s": stats(&rate), "ttft_ms": stats(&ttft), "engine_in_server_tok_s": stats(&served) },
        "http_concurrent": conc,
    });
    let out = arg("--out").unwrap_or_else(|| format!("bench/results/serve-{}.json", date()));
    if let Some(parent) = std::path::Path::new(&out).parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&record)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&record)?);
    eprintln!("wrote {out}");
    Ok(())
}
