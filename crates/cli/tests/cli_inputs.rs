//! Issue 55 item 4: every bad command-line input is a message naming the problem and a non-zero
//! exit, never a panic. Each case is one run of the binary on edge or absurd values.

use std::process::Command;

fn q4moe(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_q4moe"))
        .args(args)
        .output()
        .expect("run q4moe");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `args` and checks the exit is a failure without a panic and stderr holds every `want`.
fn refused(args: &[&str], want: &[&str]) {
    let (code, stderr) = q4moe(args);
    assert!(code != 0, "{args:?} succeeded: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    // 101 is Rust's exit code for a panic, 134 an abort.
    assert!(code == 1 || code == 2, "{args:?}: exit {code}: {stderr}");
    for w in want {
        assert!(stderr.contains(w), "{args:?}: {w:?} not in {stderr}");
    }
}

#[test]
fn synth_refuses_bad_geometry_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.gguf").display().to_string();
    let synth = |extra: &[&str], want: &[&str]| {
        let mut args = vec!["synth", "--out", &out];
        args.extend_from_slice(extra);
        refused(&args, want);
    };
    synth(&["--vocab", "2"], &["vocab_size 2", "--vocab"]);
    synth(&["--vocab", "0"], &["vocab_size", "--vocab"]);
    synth(&["--vocab", "100000000000"], &["vocab_size", "--vocab"]);
    synth(&["--layers", "0"], &["block_count", "--layers"]);
    synth(&["--layers", "100000"], &["block_count", "--layers"]);
    synth(&["--experts", "0"], &["expert_count", "--experts"]);
    synth(
        &["--experts-used", "9"],
        &["expert_used_count", "--experts-used"],
    );
    synth(&["--heads", "3"], &["head_count", "--heads"]);
    synth(&["--kv-heads", "3"], &["head_count_kv", "--kv-heads"]);
    synth(&["--head-dim", "3"], &["head dimension", "--head-dim"]);
    synth(&["--head-dim", "0"], &["key_length", "--head-dim"]);
    synth(&["--d-model", "100"], &["row length 100"]);
    synth(
        &["--d-model", "18446744073709551615"],
        &["embedding_length"],
    );
    synth(
        &["--expert-ff", "1000000000"],
        &["expert_feed_forward_length", "--expert-ff"],
    );
    synth(&["--context", "0"], &["context_length", "--context"]);
    synth(&["--layers", "-1"], &["'-1'"]);
    synth(&["--geometry", "huge"], &["unknown geometry"]);
    synth(&["--quant", "q2_k"], &["unknown quant"]);
    assert!(!dir.path().join("m.gguf").exists() || std::fs::metadata(&out).unwrap().len() == 0);
    // The output path is a directory, or lies in a missing one.
    let d = dir.path().display().to_string();
    refused(&["synth", "--out", &d], &[&d]);
    let missing = dir.path().join("no/such/dir/m.gguf").display().to_string();
    refused(&["synth", "--out", &missing], &["no/such/dir"]);
}

#[test]
fn model_paths_that_are_not_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let empty = empty.display().to_string();
    for path in [d.as_str(), "/nonexistent/m.gguf", empty.as_str()] {
        refused(&["inspect", path], &[path]);
        refused(&["run", "-m", path, "-p", "x", "--device", "cpu"], &[path]);
        refused(&["chat", "-m", path, "--device", "cpu"], &[path]);
        refused(
            &["serve", "-m", path, "--device", "cpu", "--port", "0"],
            &[path],
        );
        refused(&["bench", "--model", path, "--device", "cpu"], &[path]);
    }
}
