//! The `q4moe` binary end to end on a tiny synthetic model (CPU).

mod common;

use common::{q4moe, synth_tiny};

#[test]
fn run_streams_text_summarises_and_writes_logits() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let npy = dir.path().join("logits.npy").display().to_string();
    let out = q4moe(&[
        "run",
        "-m",
        &model,
        "-p",
        "Hello there",
        "-n",
        "6",
        "--device",
        "cpu",
        "--ignore-eos",
        "--logits-out",
        &npy,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("decode 5 tok") && stderr.contains("tok/s"),
        "summary line missing: {stderr}"
    );
    assert!(!out.stdout.is_empty(), "no text streamed");
    let b = std::fs::read(&npy).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = String::from_utf8_lossy(&b[10..10 + hlen]).to_string();
    assert!(header.contains("'shape': (6, 1024)"), "{header}");
    assert_eq!(b.len() - 10 - hlen, 6 * 1024 * 4);
}

#[test]
fn chat_flag_applies_the_template_and_greedy_is_repeatable() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let args = [
        "run",
        "-m",
        &model,
        "-p",
        "Why is the sky blue?",
        "--chat",
        "--think",
        "off",
        "-n",
        "8",
        "--device",
        "cpu",
        "--ignore-eos",
    ];
    let (a, b) = (q4moe(&args), q4moe(&args));
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn inspect_lists_metadata_and_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let out = q4moe(&["inspect", &model]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for needle in [
        "general.architecture = \"qwen3moe\"",
        "qwen3moe.expert_count = U32(8)",
        "blk.2.ffn_down_exps.weight",
        "Q6_K",
        "tokenizer.ggml.merges",
    ] {
        assert!(s.contains(needle), "inspect output lacks {needle}");
    }
}

#[test]
fn bad_inputs_fail_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = q4moe(&[
        "run",
        "-m",
        "/nonexistent/model.gguf",
        "-p",
        "x",
        "--device",
        "cpu",
    ]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/model.gguf"));
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all, just text").unwrap();
    let out = q4moe(&["inspect", &junk.display().to_string()]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bad magic"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let model = synth_tiny(dir.path());
    let long = "word ".repeat(600);
    let out = q4moe(&[
        "run", "-m", &model, "-p", &long, "--device", "cpu", "--ctx", "512",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("prompt of") && stderr.contains("context"),
        "{stderr}"
    );
    let out = q4moe(&["run", "-m", &model, "-p", "x", "--device", "cuda"]);
    if !out.status.success() {
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("CUDA"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn kv_type_flag_picks_the_cache_and_rejects_others() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let run = |kv: &str| {
        q4moe(&[
            "run",
            "-m",
            &model,
            "-p",
            "Hi",
            "-n",
            "3",
            "--device",
            "cpu",
            "--ignore-eos",
            "--kv-type",
            kv,
        ])
    };
    for kv in ["f16", "f32"] {
        let out = run(kv);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stderr.contains(&format!("KV {kv}]")),
            "summary lacks the KV type: {stderr}"
        );
    }
    let out = run("bf16");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("bf16") && stderr.contains("--kv-type"),
        "{stderr}"
    );
}

/// `bench` with a long context: each run prefills the context again, so the record holds the
/// prefill's spread (seconds and tok/s a run) beside the decode's, and the table prints both.
#[test]
fn bench_times_the_long_context_prefill_every_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let json = dir.path().join("bench.json").display().to_string();
    let out = q4moe(&[
        "bench",
        "--model",
        &model,
        "--device",
        "cpu",
        "--prompt-len",
        "8",
        "--decode-len",
        "4",
        "--runs",
        "2",
        "--long-context",
        "40",
        "--json-out",
        &json,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("decode at 40 context"), "{stdout}");
    assert!(stdout.contains("prefill of the 8-token prompt"), "{stdout}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let long = &r["long_context"];
    for key in ["prefill_seconds", "prefill_tok_s", "tok_s"] {
        let runs = long[key]["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2, "{key}: {runs:?}");
        assert!(
            runs.iter()
                .all(|v| v.as_f64().is_some_and(|x| x.is_finite() && x > 0.0)),
            "{key}: {runs:?}"
        );
    }
}

/// The first position's logits of `run --logits-out` at one precision (a one-token decode).
fn first_logits(model: &str, dir: &std::path::Path, precision: &str) -> Vec<f32> {
    let npy = dir.join(format!("{precision}.npy")).display().to_string();
    let out = q4moe(&[
        "run",
        "-m",
        model,
        "-p",
        "Hello there",
        "-n",
        "1",
        "--device",
        "cpu",
        "--ignore-eos",
        "--precision",
        precision,
        "--logits-out",
        &npy,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b = std::fs::read(&npy).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hlen..]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `--precision exact` runs the CPU's float path: logits close to the default Q8 path's (within
/// a few 1e-3 of the largest, as the oracle tests bound Q8) but not the same bits.
#[test]
fn precision_exact_is_the_float_path() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let (exact, q8) = (
        first_logits(&model, dir.path(), "exact"),
        first_logits(&model, dir.path(), "q8"),
    );
    assert_eq!(exact.len(), q8.len());
    assert!(exact.iter().all(|v| v.is_finite()));
    let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = exact
        .iter()
        .zip(&q8)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err > 0.0, "exact and q8 gave the same bits");
    assert!(
        err / scale < 2e-2,
        "exact vs q8: relative error {}",
        err / scale
    );
    let bad = q4moe(&["run", "-m", &model, "-p", "x", "--precision", "f64"]);
    assert!(!bad.status.success());
}
