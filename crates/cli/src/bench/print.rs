//! The bench record for people: the full table (GPU-only columns only on a GPU), the batched
//! step's table, and llama-bench's markdown pp/tg table (`--output md`).

use serde_json::Value;

/// A text field of the record, without JSON's quotes.
fn text(x: &Value) -> &str {
    x.as_str().unwrap_or("?")
}

/// A number of the record, NaN where it is missing.
fn num(x: &Value) -> f64 {
    x.as_f64().unwrap_or(f64::NAN)
}

/// A share of the copy bandwidth, or "-" where none was measured.
fn pct(x: &Value) -> String {
    x.as_f64().map_or("-".into(), |p| format!("{p:.1}"))
}

fn header(r: &Value) {
    println!(
        "\nq4moe bench | {} | {} ({}) | commit {}",
        text(&r["model"]),
        text(&r["backend"]),
        text(&r["device"]),
        text(&r["commit"])
    );
    println!(
        "prompt {} tok, decode {} tok, {} runs, KV {}, {:.3} GB of weights read per token",
        r["prompt_len"],
        r["decode_len"],
        r["runs"],
        text(&r["kv_type"]),
        num(&r["bytes_read_per_token"]) / 1e9
    );
}

pub fn print_table(r: &Value) {
    header(r);
    if !r["batched"].is_null() || !r["prefill_sweep"].is_null() || !r["constrained"].is_null() {
        if !r["batched"].is_null() {
            print_batched(&r["batched"]);
        }
        if !r["constrained"].is_null() {
            print_constrained(&r["constrained"]);
        }
        if !r["prefill_sweep"].is_null() {
            print_prefill(&r["prefill_sweep"]);
        }
        print_kernels(
            r,
            "--profile kernels: the timed runs' launches (their prefills and steps, not the references'), eager, timed with events",
        );
        return;
    }
    let gpu = r["backend"] != "cpu";
    let mut head = format!(
        "{:<24} {:>11} {:>11} {:>11} {:>9}",
        "variant", "tok/s", "min tok/s", "max tok/s", "ms/tok"
    );
    if gpu {
        head += &format!(
            " {:>7} {:>9} {:>9} {:>9}",
            "setup %", "submit ms", "wait ms", "tail ms"
        );
    }
    head += &format!(" {:>8}", "GB/s");
    let copy = r["copy_bandwidth_gb_s"].as_f64().is_some();
    if copy {
        head += &format!(" {:>7}", "% copy");
    }
    println!("{head}");
    let f = num;
    for v in r["variants"].as_array().into_iter().flatten() {
        let p = &v["phases_ms"];
        let t = &v["decode_tok_s"];
        let mut line = format!(
            "{:<24} {:>11.1} {:>11.1} {:>11.1} {:>9.3}",
            text(&v["name"]),
            f(&t["median"]),
            f(&t["min"]),
            f(&t["max"]),
            f(&v["ms_per_token"])
        );
        if gpu {
            line += &format!(
                " {:>7.2} {:>9.3} {:>9.3} {:>9.3}",
                f(&p["setup_pct_of_wall"]),
                f(&p["submit"]),
                f(&p["wait"]),
                f(&p["tail"])
            );
        }
        line += &format!(" {:>8.1}", f(&v["achieved_gb_s"]));
        if copy {
            line += &format!(" {:>7}", pct(&v["pct_of_copy_bandwidth"]));
        }
        println!("{line}");
    }
    footer(r);
}

fn footer(r: &Value) {
    let f = num;
    if let Some(v) = r["variants"].as_array().and_then(|v| v.first()) {
        let p = &v["prefill_tok_s"];
        println!(
            "prefill of the {}-token prompt but its last token ({}): median {:.0} tok/s ({:.0}..{:.0})",
            r["prompt_len"],
            text(&v["name"]),
            f(&p["median"]),
            f(&p["min"]),
            f(&p["max"])
        );
    }
    if let Some(l) = r.get("long_context").filter(|l| !l.is_null()) {
        let (p, t) = (&l["prefill_seconds"], &l["prefill_tok_s"]);
        println!(
            "decode at {} context: median {:.1} tok/s (its prefill: {:.3} s, {:.3}..{:.3} s; {:.0} tok/s)",
            l["context"],
            f(&l["tok_s"]["median"]),
            f(&p["median"]),
            f(&p["min"]),
            f(&p["max"]),
            f(&t["median"])
        );
    }
    let parity = if r["parity_all_variants_identical"] == true {
        "yes"
    } else {
        "NO"
    };
    println!("greedy tokens identical across variants: {parity}");
    if let Some(c) = r["graph_captures"].as_u64() {
        println!("setup cache over the bench: {c} graph captures");
    }
    print_kernels(
        r,
        "--profile kernels: the setup-cache-off runs' eager launches timed with events; the \
         fused step's stamps and the launch timeline add their rows",
    );
}

/// A statistic's median (min..max) at `p` decimals, from its record (`median`, `min`, `max`).
fn span(s: &Value, p: usize) -> String {
    format!(
        "{:.p$} ({:.p$}..{:.p$})",
        num(&s["median"]),
        num(&s["min"]),
        num(&s["max"])
    )
}

/// The batched step's sizes: median (min..max) of the runs.
fn print_batched(b: &Value) {
    println!(
        "batched decode step, greedy, one sampler a row; median (min..max) of {} runs",
        b["runs"]
    );
    println!(
        "{:>4} {:>26} {:>22} {:>22} {:>12} {:>12} {:>7}  invariance",
        "B", "aggregate tok/s", "tok/s a sequence", "step ms", "weights MB", "GB/s", "% copy"
    );
    for s in b["sizes"].as_array().into_iter().flatten() {
        let share = s["share_of_copy_bandwidth"]
            .as_f64()
            .map(|x| Value::from(100.0 * x));
        println!(
            "{:>4} {:>26} {:>22} {:>22} {:>12.1} {:>12.1} {:>7}  {}",
            s["batch"].as_u64().unwrap_or(0),
            span(&s["aggregate_tok_s"], 1),
            span(&s["per_sequence_tok_s"], 1),
            span(&s["step_ms"], 2),
            num(&s["distinct_weight_bytes_per_step"]) / 1e6,
            num(&s["weight_gb_s"]),
            pct(&share.unwrap_or(Value::Null)),
            text(&s["invariance"])
        );
    }
    let weights = match b["distinct_bytes_are_a_bound"].as_bool() {
        Some(false) => {
            "attention, router and head once, and the experts the rows' routers \
                        chose, each once a layer, as the backend counted them, averaged over \
                        the timed steps"
        }
        _ => {
            "at most: attention, router and head once, and min(B x experts used, experts) \
              experts a layer, a bound, where the backend does not count its routers' choices"
        }
    };
    println!(
        "weights MB: the distinct weight bytes a step reads ({weights}); GB/s: those bytes over \
         the median step{}; invariance: every row's tokens and first logits against the \
         sequence run alone through the batched step",
        match b["copy_gb_s"].as_f64() {
            Some(c) => format!(" (the copy bandwidth measured in the run: {c:.0} GB/s)"),
            None => String::new(),
        }
    );
}

/// Decode held to a JSON schema beside the same decode unconstrained.
fn print_constrained(c: &Value) {
    println!(
        "greedy decode of {} tokens, with and without a JSON schema; median (min..max) of {} runs",
        c["decode_tokens"], c["runs"]
    );
    for name in ["unconstrained", "constrained"] {
        let s = &c[name];
        println!(
            "{name:<14} {:>9.1} tok/s ({:.1}..{:.1})",
            num(&s["median"]),
            num(&s["min"]),
            num(&s["max"])
        );
    }
    println!(
        "constrained / unconstrained: {:.1}%",
        100.0 * num(&c["constrained_share"])
    );
}

/// The prefill sweep: tok/s and ms, median (min..max) of the runs.
fn print_prefill(p: &Value) {
    println!(
        "prefill alone, a fresh session each run; median (min..max) of {} runs",
        p["runs"]
    );
    println!("{:>8} {:>30} {:>30}", "tokens", "tok/s", "ms");
    for s in p["sizes"].as_array().into_iter().flatten() {
        println!(
            "{:>8} {:>30} {:>30}",
            s["tokens"].as_u64().unwrap_or(0),
            span(&s["tok_s"], 1),
            span(&s["ms"], 1)
        );
    }
}

/// Mean and standard deviation of a stats object's runs, as llama-bench prints them.
fn mean_std(s: &Value) -> String {
    let v: Vec<f64> = s["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .collect();
    let n = v.len().max(1) as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    format!("{mean:.2} ± {:.2}", var.sqrt())
}

/// llama-bench's markdown table: a pp and a tg row (a tg row a batch size with `--batch`).
pub fn print_markdown(r: &Value) {
    for l in markdown_lines(r) {
        println!("{l}");
    }
}

fn markdown_lines(r: &Value) -> Vec<String> {
    let size = format!("{:.2} GiB", num(&r["weight_bytes"]) / (1u64 << 30) as f64);
    let params = format!("{:.2} B", num(&r["parameters"]) / 1e9);
    let threads = r["threads"].as_u64().map_or("-".into(), |t| t.to_string());
    let prefix = format!(
        "| {} | {size} | {params} | {} | {threads} |",
        text(&r["model"]),
        text(&r["backend"])
    );
    let mut rows = vec![
        "| model | size | params | backend | threads | test | t/s |".to_string(),
        "| ----- | ---: | -----: | ------- | ------: | ---: | --: |".to_string(),
    ];
    let (pp, tg) = (&r["prompt_len"], &r["decode_len"]);
    if let Some(v) = r["variants"].as_array().and_then(|v| v.first()) {
        rows.push(format!(
            "{prefix} pp{pp} | {} |",
            mean_std(&v["prefill_tok_s"])
        ));
        rows.push(format!(
            "{prefix} tg{tg} | {} |",
            mean_std(&v["decode_tok_s"])
        ));
    }
    for s in r["batched"]["sizes"].as_array().into_iter().flatten() {
        rows.push(format!(
            "{prefix} tg{tg} x{} | {} |",
            s["batch"],
            mean_std(&s["aggregate_tok_s"])
        ));
    }
    rows
}

/// The kernel profile, where the record has one: `how` says what was timed.
fn print_kernels(r: &Value, how: &str) {
    let kernels = kernel_lines(r);
    if kernels.is_empty() {
        return;
    }
    println!("kernel profile (largest total first; {how}):");
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>8} {:>7}",
        "kernel", "calls", "total ms", "us/call", "GB/s", "% copy"
    );
    kernels.iter().for_each(|l| println!("{l}"));
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
                text(&k["name"]),
                k["calls"],
                f(&k["total_ms"]),
                f(&k["us_per_call"]),
                f(&k["gb_s"]),
                pct(&k["pct_of_copy_bandwidth"])
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_markdown_table_has_llama_benchs_columns_and_mean_std() {
        let r = json!({
            "model": "synthetic tiny q4_0", "backend": "cpu", "threads": 2,
            "weight_bytes": 3u64 << 30, "parameters": 1_500_000_000u64,
            "prompt_len": 128, "decode_len": 256,
            "variants": [{ "prefill_tok_s": { "runs": [10.0, 14.0] },
                           "decode_tok_s": { "runs": [5.0, 5.0, 5.0] } }],
            "batched": null,
        });
        let l = markdown_lines(&r);
        assert_eq!(
            l[0],
            "| model | size | params | backend | threads | test | t/s |"
        );
        assert_eq!(
            l[2],
            "| synthetic tiny q4_0 | 3.00 GiB | 1.50 B | cpu | 2 | pp128 | 12.00 ± 2.83 |"
        );
        assert!(l[3].ends_with("| tg256 | 5.00 ± 0.00 |"), "{}", l[3]);
        assert_eq!(l.len(), 4);
    }

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
