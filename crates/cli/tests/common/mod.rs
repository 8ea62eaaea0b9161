//! Helpers shared by the CLI's end-to-end tests.
#![allow(dead_code)] // not every test file uses every helper

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

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

/// Starts `q4moe serve` (CPU, model name `tiny`, `extra` flags) on a free port; returns the
/// child, its stderr and its address once it serves.
pub fn serve(
    model: &str,
    extra: &[&str],
) -> (
    std::process::Child,
    BufReader<std::process::ChildStderr>,
    String,
) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_q4moe"))
        .args([
            "serve",
            "-m",
            model,
            "--device",
            "cpu",
            "--port",
            "0",
            "--model-name",
            "tiny",
        ])
        .args(extra)
        .env_remove("Q4MOE_API_KEY")
        .env("Q4MOE_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let t = Instant::now();
    let mut line = String::new();
    while t.elapsed() < Duration::from_secs(120) {
        line.clear();
        if err.read_line(&mut line).unwrap() == 0 {
            break;
        }
        assert!(
            !line.contains('\x1b'),
            "colour codes in a piped log: {line:?}"
        );
        if let Some(at) = line.find("http://") {
            let addr = line[at + 7..].split([' ', ')']).next().unwrap().to_string();
            return (child, err, addr);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the server did not start: {line}");
}

/// A copy of the GGUF at `src`, written to `dst`, whose `tokenizer.chat_template` is `template`.
pub fn with_chat_template(src: &Path, dst: &Path, template: &str) {
    use q4moe_gguf::{GgufFile, GgufWriter, Value};
    let f = GgufFile::open(src).unwrap();
    let meta: Vec<(String, Value)> = f
        .header
        .metadata
        .iter()
        .map(|(k, v)| match k.as_str() {
            "tokenizer.chat_template" => (k.clone(), Value::String(template.into())),
            _ => (k.clone(), v.clone()),
        })
        .collect();
    let decl = f
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
        .collect();
    let file = std::fs::File::create(dst).unwrap();
    let mut w = GgufWriter::new(file, &meta, decl).unwrap();
    for t in f.tensors() {
        w.write_tensor_data(&t.name, f.tensor(&t.name).unwrap().data)
            .unwrap();
    }
    w.finish().unwrap();
}
