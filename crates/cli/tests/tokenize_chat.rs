//! `q4moe tokenize` / `detokenize`, `q4moe chat` over piped input, and the server's log lines
//! (one per request, no colour codes when stderr is not a terminal), end to end on a tiny model.

mod common;

use std::io::{BufRead, Read, Write};
use std::process::Output;
use std::time::{Duration, Instant};

use common::{q4moe, serve, synth_tiny, with_stdin};

fn stdout_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let text = "Hello world, héllo <|im_start|>user\n  1234";
    let ids = stdout_ok(&q4moe(&["tokenize", "-m", &model, text]));
    let list: Vec<u32> = ids.split_whitespace().map(|t| t.parse().unwrap()).collect();
    assert!(list.len() > 5, "{ids}");
    let back = stdout_ok(&q4moe(&["detokenize", "-m", &model, ids.trim()]));
    assert_eq!(back, text);
    // JSON out, JSON in through standard input; the same ids.
    let json = stdout_ok(&q4moe(&[
        "tokenize", "-m", &model, "--format", "json", text,
    ]));
    let parsed: Vec<u32> = serde_json::from_str(&json).unwrap();
    assert_eq!(parsed, list);
    let back = stdout_ok(&with_stdin(&["detokenize", "-m", &model], &json));
    assert_eq!(back, text);
    // The text from standard input and from a file; control tokens as text on request.
    let file = dir.path().join("text.txt");
    std::fs::write(&file, text).unwrap();
    let from_file = stdout_ok(&q4moe(&[
        "tokenize",
        "-m",
        &model,
        "-f",
        file.to_str().unwrap(),
    ]));
    assert_eq!(from_file, ids);
    assert_eq!(
        stdout_ok(&with_stdin(&["tokenize", "-m", &model], text)),
        ids
    );
    let literal = stdout_ok(&q4moe(&[
        "tokenize",
        "-m",
        &model,
        "--no-parse-special",
        text,
    ]));
    assert!(literal.split_whitespace().count() > list.len());
    let pieces = stdout_ok(&q4moe(&[
        "tokenize", "-m", &model, "--format", "pieces", "ab cd",
    ]));
    let joined: String = pieces
        .lines()
        .map(|l| serde_json::from_str::<String>(l.split('\t').nth(1).unwrap()).unwrap())
        .collect();
    assert_eq!(joined, "ab cd");
    let bad = q4moe(&["detokenize", "-m", &model, "1 two 3"]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("'two' is not a token id") && !err.contains("panicked"),
        "{err}"
    );
    let outside = q4moe(&["detokenize", "-m", &model, "99999999"]);
    assert!(!outside.status.success());
}

#[test]
fn chat_reads_piped_input_and_leaves_at_bye() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let args = [
        "chat",
        "-m",
        &model,
        "--device",
        "cpu",
        "-n",
        "3",
        "--no-history",
    ];
    let input = "Hello\n\"\"\"\nfirst line\nsecond line\n\"\"\"\n/clear\n/bye\nnever read\n";
    let out = with_stdin(&args, input);
    let stdout = stdout_ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Prompts for: Hello, the block (its continuation lines prompt "... "), /clear, /bye.
    assert_eq!(stdout.matches(">>> ").count(), 4, "{stdout}");
    assert_eq!(stdout.matches("... ").count(), 3, "{stdout}");
    assert!(stderr.contains("(conversation cleared)"), "{stderr}");
    // Ctrl-D (the end of input) leaves too.
    let out = with_stdin(&args, "Hello");
    assert_eq!(stdout_ok(&out).matches(">>> ").count(), 2);
}

#[test]
fn the_server_logs_a_plain_line_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let (mut child, mut err, addr) = serve(&model, &[]);
    let body = r#"{"model":"tiny","max_tokens":3,"temperature":0,"ignore_eos":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let mut line = String::new();
    let t = Instant::now();
    while !line.contains("POST /v1/messages") && t.elapsed() < Duration::from_secs(30) {
        line.clear();
        if err.read_line(&mut line).unwrap() == 0 {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        !line.contains('\x1b'),
        "colour codes in a piped log: {line:?}"
    );
    assert!(line.contains("POST /v1/messages 200 "), "{line}");
    assert!(line.contains(" ms tokens in="), "{line}");
    assert!(line.trim_end().ends_with("out=3"), "{line}");
}
