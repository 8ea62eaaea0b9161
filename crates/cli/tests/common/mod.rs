//! Helpers shared by the CLI's end-to-end tests.

use std::path::Path;
use std::process::{Command, Output};

pub fn q4moe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_q4moe"))
        .args(args)
        .output()
        .expect("run q4moe")
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
