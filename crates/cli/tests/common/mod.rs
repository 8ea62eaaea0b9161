//! Helpers shared by the CLI's end-to-end tests.
#![allow(dead_code)] // not every test file uses every helper

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

pub fn q4moe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_q4moe"))
        .args(args)
        .output()
        .expect("run q4moe")
}

/// `q4moe args` with `input` on its standard input.
pub fn with_stdin(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_q4moe"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

pub fn synth_tiny(dir: &Path) -> String {
    let p = dir.join("tiny.gguf").display().to_string();
    let out = q4moe(&[
        "synth",
        "--geometry",
        "tiny",
        "--quant",
        "q4_k_m",
        "--seed",
        "3",
        "--out",
        &p,
        "--layers",
        "3",
    ]);
    assert!(
        out.status.success(),
        "synth failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    p
}
