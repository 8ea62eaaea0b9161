//! The real server on 127.0.0.1:0 over a tiny synthetic model (CPU): what every server test
//! file shares.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use q4moe_engine::{Device, Engine, EngineOptions};
use q4moe_server::ServeConfig;
use serde_json::{json, Value};

pub fn model_path() -> &'static PathBuf {
    static PATH: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &PATH
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tiny.gguf");
            let cfg = q4moe_model::Config::tiny();
            q4moe_model::synth::write(&path, &cfg, q4moe_model::synth::SynthQuant::Q4_0, 7, false)
                .unwrap();
            (dir, path)
        })
        .1
}

pub struct Server {
    pub base: String,
    pub http: reqwest::Client,
}

/// An engine on the CPU over the tiny model.
pub fn engine() -> Engine {
    let opts = EngineOptions {
        device: Device::Cpu,
        ..Default::default()
    };
    Engine::load(model_path(), &opts).unwrap()
}

pub async fn start(cfg: ServeConfig) -> Server {
    start_engine(engine(), cfg).await
}

/// The server over `engine` (e.g. one with a longer context).
pub async fn start_engine(engine: Engine, cfg: ServeConfig) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(q4moe_server::serve_on(
        listener,
        engine,
        cfg,
        std::future::pending(),
    ));
    Server {
        base,
        http: reqwest::Client::new(),
    }
}

/// The server over the tiny model with room for tool and function descriptions (its tokenizer
/// spends many tokens on JSON): a 2,048-position context and 64 KiB bodies.
pub async fn start_roomy() -> Server {
    let opts = EngineOptions {
        device: Device::Cpu,
        kv_capacity: 2048,
        ..Default::default()
    };
    let engine = Engine::load(model_path(), &opts).unwrap();
    let cfg = ServeConfig {
        model_name: "tiny".into(),
        max_body_bytes: 64 << 10,
        ..Default::default()
    };
    start_engine(engine, cfg).await
}

pub async fn start_default() -> Server {
    start(ServeConfig {
        model_name: "tiny".into(),
        max_body_bytes: 64 << 10,
        ..Default::default()
    })
    .await
}

impl Server {
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, body.to_string().into_bytes()).await
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// Posts a streaming request and returns every `data:` payload.
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let text = r.text().await.unwrap();
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(String::from)
            .collect()
    }
}

pub fn chat_body(messages: Value, max_tokens: usize) -> Value {
    json!({ "model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0 })
}

pub fn user(text: &str) -> Value {
    json!([{ "role": "user", "content": text }])
}

pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Opens a streaming chat (EOS ignored) and returns its byte stream once the response began.
pub async fn open_stream(
    s: &Server,
    text: &str,
    max_tokens: usize,
) -> impl futures_util::Stream<Item = reqwest::Result<axum::body::Bytes>> {
    let mut body = chat_body(user(text), max_tokens);
    body["ignore_eos"] = json!(true);
    body["stream"] = json!(true);
    let r = s
        .http
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes_stream()
}
