//! Issue 55 items 6 and 9 at the command line: `q4moe serve` refuses weak or malformed settings
//! before loading the model, and warns when it would serve a public address to anyone.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn serve(args: &[&str], env_key: Option<&str>) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_q4moe"));
    cmd.arg("serve").args(args).env_remove("Q4MOE_API_KEY");
    if let Some(k) = env_key {
        cmd.env("Q4MOE_API_KEY", k);
    }
    let out = cmd.output().expect("run q4moe");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The model does not exist: each refusal must come before the model is looked at.
const NO_MODEL: &str = "/nonexistent/model.gguf";

#[test]
fn an_empty_api_key_is_refused() {
    for (args, env) in [
        (vec!["--model", NO_MODEL], Some("")),
        (vec!["--model", NO_MODEL, "--api-key", ""], None),
        (vec!["--model", NO_MODEL, "--api-key", "  "], None),
    ] {
        let (code, stderr) = serve(&args, env);
        assert_eq!(code, 1, "{args:?} {env:?}: {stderr}");
        assert!(stderr.contains("API key is empty"), "{stderr}");
    }
}

#[test]
fn bad_limits_and_origins_are_refused_naming_the_flag() {
    let cases: [(&[&str], &str); 8] = [
        (&["--cors-origin", "app.example"], "--cors-origin"),
        (&["--cors-origin", "https://app.example/x"], "--cors-origin"),
        (&["--header-timeout", "0s"], "--header-timeout"),
        (&["--idle-timeout", "soon"], "--idle-timeout"),
        (&["--max-connections", "0"], "--max-connections"),
        (&["--template-timeout", "0s"], "--template-timeout"),
        (&["--template-memory-mb", "1"], "--template-memory-mb"),
        (&["--template-workers", "0"], "--template-workers"),
    ];
    for (extra, flag) in cases {
        let mut args = vec!["--model", NO_MODEL];
        args.extend_from_slice(extra);
        let (code, stderr) = serve(&args, None);
        assert!(code == 1 || code == 2, "{args:?}: exit {code}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let (code, stderr) = serve(&["--model", NO_MODEL, "--metrics-auth", "maybe"], None);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--metrics-auth"), "{stderr}");
}

#[test]
fn a_public_address_without_a_key_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf").display().to_string();
    let synth = Command::new(env!("CARGO_BIN_EXE_q4moe"))
        .args([
            "synth",
            "--geometry",
            "tiny",
            "--out",
            &model,
            "--layers",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_q4moe"))
        .args([
            "serve", "--model", &model, "--host", "0.0.0.0", "--port", "0",
        ])
        .env_remove("Q4MOE_API_KEY")
        .env_remove("Q4MOE_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let t = Instant::now();
    let mut seen = String::new();
    let mut warned = false;
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap_or_default();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains("without an API key") {
            warned = true;
            break;
        }
        if line.contains("serving") || t.elapsed() > Duration::from_secs(60) {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(warned, "no warning:\n{seen}");
}
