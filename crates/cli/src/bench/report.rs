//! The benchmark record: JSON with its conditions, and the printed table.

use std::path::{Path, PathBuf};

use q4moe_engine::BackendInfo;
use q4moe_model::Model;
use serde_json::{json, Value};

use super::{BenchArgs, RunResult, Variant};

pub struct Extras {
    /// Seconds from the loaded model to a backend ready to decode (device start-up, kernels,
    /// the weights' repack and upload).
    pub open_s: f64,
    /// CUDA only: the copy bandwidth measured in the run, the per-kernel profile, the setup
    /// cache's graph captures over the whole bench.
    pub copy_gbs: Option<f64>,
    pub kernels: Vec<q4moe_cuda::KernelTime>,
    pub graph_setups: Option<q4moe_cuda::GraphSetups>,
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

pub fn stats(v: &[f64]) -> Value {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({ "median": median(v), "min": min, "max": max, "runs": v })
}

fn quant_summary(m: &Model) -> Value {
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    for t in m.file.tensors() {
        *counts.entry(t.ggml_type.name().to_string()).or_default() += t.n_bytes().unwrap_or(0);
    }
    json!(counts)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn variant_json(
    v: &Variant,
    runs: &[RunResult],
    bytes_per_token: u64,
    copy_gbs: Option<f64>,
    reference: &[u32],
) -> Value {
    let tok_s: Vec<f64> = runs.iter().map(|r| r.steady_tok_s).collect();
    let med = median(&tok_s);
    let p = super::mean_phases(&runs.iter().map(|r| r.phases).collect::<Vec<_>>());
    let total = ms(p.total()).max(1e-12);
    let gbs = bytes_per_token as f64 * med / 1e9;
    // Sampled variants draw other tokens by design; greedy ones must match the first variant.
    let identical = v
        .sampling
        .is_greedy()
        .then(|| runs.iter().all(|r| r.tokens == reference));
    let s = &v.sampling;
    json!({
        "name": v.name,
        "setup_cache": v.setup_cache,
        "in_flight": v.in_flight,
        "sampling": { "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                      "min_p": s.min_p, "seed": s.seed },
        "decode_tok_s": stats(&tok_s),
        "prefill_tok_s": stats(&runs.iter().map(|r| r.prefill_tok_s).collect::<Vec<_>>()),
        "ms_per_token": 1e3 / med,
        "phases_ms": {
            "setup": ms(p.setup), "submit": ms(p.submit), "wait": ms(p.wait), "tail": ms(p.tail),
            "gpu": p.gpu.map(ms),
            "setup_pct_of_wall": 100.0 * ms(p.setup) / total,
        },
        "achieved_gb_s": gbs,
        "pct_of_copy_bandwidth": copy_gbs.map(|c| 100.0 * gbs / c),
        "greedy_tokens_identical_to_first_variant": identical,
    })
}

pub fn build(
    a: &BenchArgs,
    label: &str,
    m: &Model,
    info: &BackendInfo,
    results: &[(Variant, Vec<RunResult>)],
    long: Option<&Value>,
    extras: &Extras,
) -> Value {
    let bpt = m.bytes_per_token();
    let reference = &results[0].1[0].tokens;
    let variants: Vec<Value> = results
        .iter()
        .map(|(v, r)| variant_json(v, r, bpt, extras.copy_gbs, reference))
        .collect();
    let parity = variants
        .iter()
        .all(|v| v["greedy_tokens_identical_to_first_variant"] != json!(false));
    let kernels: Vec<Value> = extras
        .kernels
        .iter()
        .map(|k| {
            let s = k.total.as_secs_f64();
            let gbs = if s > 0.0 { k.bytes_read as f64 / s / 1e9 } else { 0.0 };
            json!({ "name": k.name, "calls": k.calls, "total_ms": s * 1e3, "bytes_read": k.bytes_read,
                    "us_per_call": s * 1e6 / k.calls.max(1) as f64, "gb_s": gbs,
                    "pct_of_copy_bandwidth": extras.copy_gbs.map(|c| 100.0 * gbs / c) })
        })
        .collect();
    json!({
        "kind": "q4moe-bench",
        "commit": crate::COMMIT,
        "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "model": label,
        "geometry": format!("{:?}", m.config),
        "quant_bytes_by_type": quant_summary(m),
        "backend": info.kind, "device": info.device,
        "resident_bytes": info.resident_bytes,
        "cache_policy": info.cache_policy,
        "step_readback": info.step_readback,
        "backend_open_seconds": extras.open_s,
        "kv_type": info.kv_type.name(),
        "gpu_prefill_chunk": super::prefill_chunk(a),
        "prompt_len": a.prompt_len, "decode_len": a.decode_len, "runs": a.runs, "batch": 1,
        "bytes_read_per_token": bpt,
        "copy_bandwidth_gb_s": extras.copy_gbs,
        "variants": variants,
        "parity_all_variants_identical": parity,
        "long_context": long,
        "kernel_profile": kernels,
        "graph_captures": extras.graph_setups.map(|g| g.captures),
        // Q4MOE_* settings (kernel paths, tunables) are conditions of the figures too.
        "environment": std::env::vars().filter(|(k, _)| k.starts_with("Q4MOE_")).collect::<std::collections::BTreeMap<_, _>>(),
        "note": "steady decode excludes the first decode step; tok/s from token arrival times on the host",
    })
}

pub fn print_table(r: &Value) {
    println!(
        "\nq4moe bench | {} | {} | {} | commit {}",
        r["model"].as_str().unwrap_or(""),
        r["backend"],
        r["device"],
        r["commit"]
    );
    println!(
        "prompt {} tok, decode {} tok, {} runs, KV {}, {:.3} GB read per token",
        r["prompt_len"],
        r["decode_len"],
        r["runs"],
        r["kv_type"].as_str().unwrap_or("?"),
        r["bytes_read_per_token"].as_f64().unwrap_or(0.0) / 1e9
    );
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "variant",
        "tok/s",
        "min",
        "max",
        "ms/tok",
        "setup%",
        "submit",
        "wait",
        "tail",
        "GB/s",
        "%copy"
    );
    let f = num;
    for v in r["variants"].as_array().into_iter().flatten() {
        let p = &v["phases_ms"];
        println!(
            "{:<24} {:>10.1} {:>10.1} {:>10.1} {:>9.3} {:>8.2} {:>8.3} {:>8.3} {:>8.3} {:>8.0} {:>7}",
            v["name"].as_str().unwrap_or(""),
            f(&v["decode_tok_s"]["median"]), f(&v["decode_tok_s"]["min"]), f(&v["decode_tok_s"]["max"]),
            f(&v["ms_per_token"]), f(&p["setup_pct_of_wall"]), f(&p["submit"]), f(&p["wait"]), f(&p["tail"]),
            f(&v["achieved_gb_s"]), pct(&v["pct_of_copy_bandwidth"]),
        );
    }
    if let Some(v) = r["variants"].as_array().and_then(|v| v.first()) {
        let p = &v["prefill_tok_s"];
        println!(
            "prefill of the {}-token prompt but its last token ({}): median {:.0} tok/s ({:.0}-{:.0})",
            r["prompt_len"],
            v["name"].as_str().unwrap_or(""),
            f(&p["median"]),
            f(&p["min"]),
            f(&p["max"])
        );
    }
    if let Some(l) = r.get("long_context").filter(|l| !l.is_null()) {
        let (p, t) = (&l["prefill_seconds"], &l["prefill_tok_s"]);
        println!(
            "decode at {} context: median {:.1} tok/s (its prefill: {:.3} s, {:.3}-{:.3}; {:.0} tok/s)",
            l["context"],
            f(&l["tok_s"]["median"]),
            f(&p["median"]),
            f(&p["min"]),
            f(&p["max"]),
            f(&t["median"])
        );
    }
    println!(
        "parity (greedy tokens identical across variants): {}",
        r["parity_all_variants_identical"]
    );
    if let Some(c) = r["graph_captures"].as_u64() {
        println!("setup cache over the bench: {c} graph captures");
    }
    let kernels = kernel_lines(r);
    if !kernels.is_empty() {
        println!("kernel profile (largest total first; --profile kernels: the setup-cache-off runs' eager launches timed with events; the fused step's stamps and the launch timeline add their rows):");
        println!(
            "{:<24} {:>10} {:>10} {:>10} {:>8} {:>7}",
            "kernel", "calls", "ms", "us/call", "GB/s", "%copy"
        );
        kernels.iter().for_each(|l| println!("{l}"));
    }
}

/// A number of the record, NaN where it is missing.
fn num(x: &Value) -> f64 {
    x.as_f64().unwrap_or(f64::NAN)
}

/// A share of the copy bandwidth, or "-" where none was measured (the CPU).
fn pct(x: &Value) -> String {
    x.as_f64().map_or("-".into(), |p| format!("{p:.1}"))
}

/// The kernel profile's rows, largest total time first: each kernel's time set against the
/// weight bytes it reads.
fn kernel_lines(r: &Value) -> Vec<String> {
    let f = num;
    let mut ks: Vec<&Value> = r["kernel_profile"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    ks.sort_by(|a, b| f(&b["total_ms"]).total_cmp(&f(&a["total_ms"])));
    ks.iter()
        .map(|k| {
            format!(
                "{:<24} {:>10} {:>10.3} {:>10.2} {:>8.0} {:>7}",
                k["name"].as_str().unwrap_or(""),
                k["calls"],
                f(&k["total_ms"]),
                f(&k["us_per_call"]),
                f(&k["gb_s"]),
                pct(&k["pct_of_copy_bandwidth"])
            )
        })
        .collect()
}

pub fn write_json(out: &Path, record: &Value) -> anyhow::Result<PathBuf> {
    let path = if out.is_dir() || out.extension().is_none() {
        std::fs::create_dir_all(out)?;
        out.join(format!(
            "bench-{}-{}.json",
            record["backend"].as_str().unwrap_or("x"),
            record["date_unix"]
        ))
    } else {
        out.to_path_buf()
    };
    std::fs::write(&path, serde_json::to_string_pretty(record)?)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_lines_put_the_largest_total_first_with_its_bandwidth() {
        let r = json!({ "kernel_profile": [
            { "name": "qkv", "calls": 10, "total_ms": 0.05, "us_per_call": 5.0, "gb_s": 1180.0, "pct_of_copy_bandwidth": 27.6 },
            { "name": "moe_gate_up", "calls": 10, "total_ms": 0.11, "us_per_call": 11.0, "gb_s": 1290.0, "pct_of_copy_bandwidth": 30.2 },
            { "name": "argmax", "calls": 5, "total_ms": 0.01, "us_per_call": 2.0, "gb_s": 0.0, "pct_of_copy_bandwidth": null },
        ]});
        let lines = kernel_lines(&r);
        let names: Vec<&str> = lines
            .iter()
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        assert_eq!(names, ["moe_gate_up", "qkv", "argmax"]);
        let cols: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(
            cols,
            ["moe_gate_up", "10", "0.110", "11.00", "1290", "30.2"]
        );
        assert!(
            lines[2].ends_with(" -"),
            "no copy bandwidth, no percentage: {}",
            lines[2]
        );
        assert!(kernel_lines(&json!({ "kernel_profile": [] })).is_empty());
    }
}
