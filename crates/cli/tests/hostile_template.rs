//! Issue 55 item 2 end to end: a model whose chat template is hostile makes `q4moe run --chat`
//! fail with a clear error naming the limit within seconds, and makes `q4moe serve` answer 500
//! in the OpenAI error shape while it keeps serving. Both render in the binary's own template
//! workers (`q4moe template-worker`), the path every command that loads a model takes.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{q4moe, serve, synth_tiny, with_chat_template};

/// The inputs the fuzzer found: each grows an intermediate value without bound.
fn known_templates() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/known/template");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{}: {files:?}", dir.display());
    files
}

#[test]
fn run_chat_refuses_hostile_templates_quickly_naming_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = synth_tiny(dir.path());
    for file in known_templates() {
        let model = dir.path().join("hostile.gguf");
        with_chat_template(
            Path::new(&tiny),
            &model,
            &std::fs::read_to_string(&file).unwrap(),
        );
        let t = Instant::now();
        let out = q4moe(&[
            "run",
            "-m",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--chat",
            "-p",
            "hi",
            "-n",
            "1",
        ]);
        let took = t.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let name = file.file_name().unwrap().to_string_lossy();
        eprintln!("{name}: {took:?}: {}", stderr.trim());
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(
            stderr.contains("chat template exceeded its memory limit of 1024 MiB")
                || stderr.contains("chat template exceeded its time limit of 2000 ms"),
            "{name}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        // The model loads in a fraction of a second; the render stops at its limit (2 s).
        assert!(took < Duration::from_secs(8), "{name}: {took:?}");
    }
}

/// Qwen3's template behind two switches on the first message: `boom` doubles a string past any
/// memory, `spin` repeats 10 MB strings for minutes.
fn switched_template() -> String {
    // The length depends on the messages, so compiling cannot fold the repetition.
    let boom = r#"{% set ns = namespace(s="x" * (99999999 + messages|length)) %}{% for i in range(8) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"#;
    let spin = r#"{% for i in range(100000) %}{% set s = "x" * (9999999 + loop.index0 % 2) %}{% endfor %}"#;
    format!(
        "{{% if messages[0].content == 'boom' %}}{boom}{{% elif messages[0].content == 'spin' %}}{spin}{{% endif %}}{}",
        q4moe_tokenizer::QWEN3_CHAT_TEMPLATE
    )
}

fn post_chat(addr: &str, content: &str) -> (u16, serde_json::Value) {
    let body = serde_json::json!({
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let status = reply[9..12].parse().unwrap();
    // The body may come chunked: the JSON is what lies between its outer braces.
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let json = match (body.find('{'), body.rfind('}')) {
        (Some(a), Some(b)) => &body[a..=b],
        _ => "",
    };
    (status, serde_json::from_str(json).unwrap_or_default())
}

/// `q4moe serve` with `flags` on the tiny model behind `switched_template`, and its address.
/// The model's directory and the server's stderr are kept while the server runs (a closed
/// stderr would end it at its next log line).
struct Switched {
    _dir: tempfile::TempDir,
    _err: std::io::BufReader<std::process::ChildStderr>,
    child: std::process::Child,
    addr: String,
}

fn serve_switched(flags: &[&str]) -> Switched {
    let dir = tempfile::tempdir().unwrap();
    let tiny = synth_tiny(dir.path());
    let model = dir.path().join("switched.gguf");
    with_chat_template(Path::new(&tiny), &model, &switched_template());
    let (child, err, addr) = serve(model.to_str().unwrap(), flags);
    Switched {
        _dir: dir,
        _err: err,
        child,
        addr,
    }
}

#[test]
fn serve_answers_500_for_a_hostile_template_and_keeps_serving() {
    // Time enough for `boom` to reach its memory limit while other tests load the machine.
    let flags = ["--template-timeout", "3s", "--template-memory-mb", "256"];
    let mut server = serve_switched(&flags);
    let addr = server.addr.clone();
    let cases = [
        ("boom", "chat template exceeded its memory limit of 256 MiB"),
        ("spin", "chat template exceeded its time limit of 3000 ms"),
    ];
    for (content, want) in cases {
        let t = Instant::now();
        let (status, body) = post_chat(&addr, content);
        assert_eq!(status, 500, "{content}: {body}");
        let e = &body["error"];
        assert_eq!(e["type"], "server_error", "{body}");
        assert!(e["message"].as_str().unwrap().contains(want), "{body}");
        assert!(
            e.get("param").is_some() && e.get("code").is_some(),
            "{body}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{content}: {:?}",
            t.elapsed()
        );
        // The server is still up, and the next request renders in a fresh worker.
        let (status, body) = post_chat(&addr, "hi");
        assert_eq!(status, 200, "after {content}: {body}");
        assert_eq!(body["choices"][0]["message"]["role"], "assistant", "{body}");
    }
    let _ = server.child.kill();
    let _ = server.child.wait();
}

/// Templates render off the engine's thread (issue 55 item 2): while one request's template
/// spins toward its time limit, another request is rendered, decoded and answered, before the
/// spinning one's 500.
#[test]
fn a_slow_render_holds_up_no_other_request() {
    let flags = ["--template-timeout", "3s", "--template-workers", "2"];
    let mut server = serve_switched(&flags);
    let addr = server.addr.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let spin = {
        let (addr, tx) = (addr.clone(), tx.clone());
        std::thread::spawn(move || {
            let (status, _) = post_chat(&addr, "spin");
            tx.send(("spin", status)).unwrap();
        })
    };
    // The spinning render has started (its worker is busy) before the other request comes.
    std::thread::sleep(Duration::from_millis(300));
    let (status, body) = post_chat(&addr, "hi");
    tx.send(("hi", status)).unwrap();
    spin.join().unwrap();
    let order: Vec<(&str, u16)> = rx.try_iter().collect();
    assert_eq!(order, [("hi", 200), ("spin", 500)], "{body}");
    let _ = server.child.kill();
    let _ = server.child.wait();
}
