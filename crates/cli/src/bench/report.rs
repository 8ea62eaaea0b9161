//! The benchmark record: JSON with its conditions, and the printed table.

use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// The per-kernel profile's rows (`--profile kernels`): calls, time, and the weight bytes read
/// against the run's copy bandwidth.
pub fn kernel_json(kernels: &[q4moe_cuda::KernelTime], copy_gbs: Option<f64>) -> Vec<Value> {
    kernels
        .iter()
        .map(|k| {
            let s = k.total.as_secs_f64();
            let gbs = if s > 0.0 { k.bytes_read as f64 / s / 1e9 } else { 0.0 };
            json!({ "name": k.name, "calls": k.calls, "total_ms": s * 1e3, "bytes_read": k.bytes_read,
                    "us_per_call": s * 1e6 / k.calls.max(1) as f64, "gb_s": gbs,
                    "pct_of_copy_bandwidth": copy_gbs.map(|c| 100.0 * gbs / c) })
        })
        .collect()
}

/// The launches timed since `before` (both cumulative profiles of one backend): each kernel's
/// calls, time and bytes less what `before` had; kernels with no new call left out.
pub fn kernels_since(
    now: &[q4moe_cuda::KernelTime],
    before: &[q4moe_cuda::KernelTime],
) -> Vec<q4moe_cuda::KernelTime> {
    now.iter()
        .filter_map(|k| {
            let b = before.iter().find(|b| b.name == k.name);
            let calls = k.calls - b.map_or(0, |b| b.calls);
            (calls > 0).then(|| q4moe_cuda::KernelTime {
                name: k.name.clone(),
                calls,
                total: k
                    .total
                    .saturating_sub(b.map_or(Duration::ZERO, |b| b.total)),
                bytes_read: k.bytes_read - b.map_or(0, |b| b.bytes_read),
            })
        })
        .collect()
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

/// The model's geometry as named fields.
fn geometry(c: &q4moe_model::Config) -> Value {
    json!({
        "arch": c.arch.gguf_name(), "n_layer": c.n_layer, "d_model": c.d_model,
        "n_head": c.n_head, "n_kv_head": c.n_kv_head, "head_dim": c.head_dim,
        "n_expert": c.n_expert, "n_expert_used": c.n_expert_used, "d_ff_expert": c.d_ff_expert,
        "vocab_size": c.vocab_size, "context_length": c.context_length, "rms_eps": c.rms_eps,
        "rope_theta": c.rope_theta, "norm_topk_prob": c.norm_topk_prob,
    })
}

/// The conditions every record carries: what ran, where, on what, with which settings.
pub fn conditions(a: &BenchArgs, label: &str, m: &Model, info: &BackendInfo, open_s: f64) -> Value {
    let cpu = info.kind == "cpu";
    json!({
        "kind": "q4moe-bench",
        "commit": crate::COMMIT,
        "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "model": label,
        "geometry": geometry(&m.config),
        "parameters": m.file.tensors().iter().map(|t| t.n_elements()).sum::<u64>(),
        "weight_bytes": m.weight_bytes(),
        "quant_bytes_by_type": quant_summary(m),
        "backend": info.kind, "device": info.device,
        "threads": cpu.then(q4moe_cpu::threads),
        "resident_bytes": info.resident_bytes,
        "cache_policy": info.cache_policy,
        "step_readback": info.step_readback,
        "backend_open_seconds": open_s,
        "kv_type": info.kv_type.name(),
        "gpu_prefill_chunk": (!cpu).then(|| super::prefill_chunk(a)),
        "prompt_len": a.prompt_len, "decode_len": a.decode_len, "runs": a.runs,
        "bytes_read_per_token": m.bytes_per_token(),
        // Q4MOE_* settings (kernel paths, tunables) are conditions of the figures too.
        "environment": std::env::vars().filter(|(k, _)| k.starts_with("Q4MOE_")).collect::<std::collections::BTreeMap<_, _>>(),
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
    let kernels = kernel_json(&extras.kernels, extras.copy_gbs);
    let mut r = conditions(a, label, m, info, extras.open_s);
    let more = json!({
        "batch": 1,
        "copy_bandwidth_gb_s": extras.copy_gbs,
        "variants": variants,
        "parity_all_variants_identical": parity,
        "long_context": long,
        "kernel_profile": kernels,
        "graph_captures": extras.graph_setups.map(|g| g.captures),
        "note": "steady decode excludes the first decode step; tok/s from token arrival times on the host",
    });
    if let (Some(r), Value::Object(more)) = (r.as_object_mut(), more) {
        r.extend(more);
    }
    r
}

/// `secs` since the Unix epoch as a UTC date and time fit for a file name,
/// 2026-01-31T12-00-00Z (days to a civil date: Howard Hinnant's algorithm).
pub fn utc_stamp(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}-{:02}-{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Writes the record to `out`; a directory (or a path without an extension, created) gets a
/// dated name: bench-<backend>[-batch]-<UTC date>.json.
pub fn write_json(out: &Path, record: &Value) -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    let path = if out.is_dir() || out.extension().is_none() {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let batch = if record["batched"].is_null() {
            ""
        } else {
            "-batch"
        };
        out.join(format!(
            "bench-{}{batch}-{}.json",
            record["backend"].as_str().unwrap_or("x"),
            utc_stamp(record["date_unix"].as_u64().unwrap_or(0))
        ))
    } else {
        out.to_path_buf()
    };
    std::fs::write(&path, serde_json::to_string_pretty(record)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps_name_the_calendar_date() {
        assert_eq!(utc_stamp(0), "1970-01-01T00-00-00Z");
        assert_eq!(utc_stamp(951_782_400 + 3_723), "2000-02-29T01-02-03Z");
        assert_eq!(utc_stamp(1_798_761_599), "2026-12-31T23-59-59Z");
    }

    #[test]
    fn a_directory_gets_a_dated_file_name() {
        let dir = tempfile::tempdir().unwrap();
        let r = json!({ "backend": "cpu", "date_unix": 0 });
        let p = write_json(dir.path(), &r).unwrap();
        assert_eq!(
            p.file_name().unwrap().to_str().unwrap(),
            "bench-cpu-1970-01-01T00-00-00Z.json"
        );
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(back, r);
    }

    /// The profile of what ran since a snapshot: the differences of each kernel's counts, a
    /// kernel first seen since then whole, one with no new call left out.
    #[test]
    fn kernels_since_keeps_what_ran_after_the_snapshot() {
        let k = |name: &str, calls, us, bytes_read| q4moe_cuda::KernelTime {
            name: name.into(),
            calls,
            total: Duration::from_micros(us),
            bytes_read,
        };
        let before = [k("pf o", 10, 100, 1_000), k("pf_quant", 30, 90, 0)];
        let now = [
            k("pf o", 25, 260, 2_500),
            k("pf_quant", 30, 90, 0),
            k("bt_argmax", 4, 8, 0),
        ];
        let got: Vec<_> = kernels_since(&now, &before)
            .into_iter()
            .map(|t| (t.name, t.calls, t.total.as_micros(), t.bytes_read))
            .collect();
        assert_eq!(
            got,
            [
                ("pf o".to_string(), 15, 160, 1_500),
                ("bt_argmax".to_string(), 4, 8, 0)
            ]
        );
    }
}
