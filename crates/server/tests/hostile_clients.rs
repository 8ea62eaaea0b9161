//! Issue 55 items 6, 7 and 9: slow, idle, flooding and careless clients, over real sockets.

use std::time::{Duration, Instant};

use q4moe_server::{ConnLimits, ServeConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;
use common::engine;

/// Short timeouts, so the tests see them fire.
fn quick() -> ServeConfig {
    ServeConfig {
        model_name: "tiny".into(),
        conn: ConnLimits {
            header_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(800),
            body_timeout: Duration::from_millis(500),
            max_connections: 64,
        },
        ..Default::default()
    }
}

async fn start(cfg: ServeConfig) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let engine = engine();
    tokio::spawn(async move {
        q4moe_server::serve_on(listener, engine, cfg, std::future::pending())
            .await
            .unwrap()
    });
    addr
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Waits for the server to close `s` (EOF or reset); returns how long that took, or `None`.
/// The status `/health` answers with.
async fn health(addr: &str) -> u16 {
    let r = client()
        .get(format!("http://{addr}/health"))
        .send()
        .await
        .unwrap();
    r.status().as_u16()
}

async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at((t + limit).into(), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(t.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test]
async fn half_sent_headers_time_out_and_health_keeps_answering() {
    let addr = start(quick()).await;
    // More slow clients than the cap: each new one displaces the longest-idle, the rest time out.
    let mut slow = Vec::new();
    for _ in 0..100 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await
            .unwrap();
        slow.push(s);
    }
    for s in &mut slow {
        assert!(
            closed_within(s, Duration::from_secs(3)).await.is_some(),
            "a half-sent header was never timed out"
        );
    }
    assert_eq!(health(&addr).await, 200);
}

/// At the cap a new connection takes the place of the one idle longest: a flood of silent
/// connections cannot keep a client that sends its request out.
#[tokio::test]
async fn at_the_cap_the_longest_idle_connection_gives_way() {
    let mut cfg = quick();
    cfg.conn.max_connections = 4;
    cfg.conn.idle_timeout = Duration::from_secs(30);
    cfg.conn.header_timeout = Duration::from_secs(30);
    let addr = start(cfg).await;
    let mut held = Vec::new();
    for i in 0..4 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        if i > 0 {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .await
                .unwrap();
        }
        held.push(s);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // Served at once, not after the held ones' 30 s timeouts.
    let t0 = std::time::Instant::now();
    assert_eq!(health(&addr).await, 200);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(
        closed_within(&mut held[0], Duration::from_secs(2))
            .await
            .is_some(),
        "the longest-idle connection was not the one to give way"
    );
    assert!(
        closed_within(&mut held[3], Duration::from_millis(300))
            .await
            .is_none(),
        "a newer idle connection was closed instead"
    );
}

/// Where every open connection has a request in flight (here each waits for its body), a new
/// connection is closed at once and none of the busy ones is cut.
#[tokio::test]
async fn at_the_cap_busy_connections_are_kept_and_the_new_one_closed() {
    let mut cfg = quick();
    cfg.conn.max_connections = 4;
    cfg.conn.body_timeout = Duration::from_secs(30);
    let addr = start(cfg).await;
    let mut busy = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n",
        )
        .await
        .unwrap();
        busy.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = TcpStream::connect(&addr).await.unwrap();
    let _ = extra
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let took = closed_within(&mut extra, Duration::from_secs(2)).await;
    assert!(
        took.is_some(),
        "the connection over the cap was served or held"
    );
    for s in &mut busy {
        assert!(
            closed_within(s, Duration::from_millis(100)).await.is_none(),
            "a connection with a request in flight was cut"
        );
    }
    drop(busy);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(health(&addr).await, 200);
}

#[tokio::test]
async fn idle_keep_alive_connections_are_closed() {
    let addr = start(quick()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // The idle timeout (0.8 s), not the header timeout (0.3 s), applies between requests.
    let took = closed_within(&mut s, Duration::from_secs(3))
        .await
        .expect("an idle keep-alive connection was never closed");
    assert!(took >= Duration::from_millis(600), "closed after {took:?}");
}

#[tokio::test]
async fn a_trickled_body_is_cut_off_with_408() {
    let addr = start(quick()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 1000\r\n\r\n{\"prompt\": \"",
    )
    .await
    .unwrap();
    let t = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while t.elapsed() < Duration::from_secs(5) {
        if s.write_all(b"a").await.is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text:?}");
    assert!(text.contains("request_timeout"), "{text}");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
}

async fn post(addr: &str, path: &str, body: Value) -> (u16, Value) {
    let r = client()
        .post(format!("http://{addr}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn user(text: &str) -> Value {
    json!([{ "role": "user", "content": text }])
}

#[tokio::test]
async fn a_multi_megabyte_prompt_is_refused_for_length() {
    let mut cfg = quick();
    cfg.max_body_bytes = 8 << 20;
    cfg.conn.body_timeout = Duration::from_secs(30);
    let addr = start(cfg).await;
    let huge = "All work and no play makes Jack a dull boy. ".repeat(80_000);
    let (status, v) = post(
        &addr,
        "/v1/completions",
        json!({ "prompt": huge, "max_tokens": 1 }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "prompt");
    let body = json!({ "messages": user(&huge), "max_tokens": 1 });
    let (status, v) = post(&addr, "/v1/chat/completions", body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
}

#[tokio::test]
async fn wrong_method_is_405_in_openai_shape_with_allow() {
    let addr = start(quick()).await;
    let r = client()
        .get(format!("http://{addr}/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers()["allow"], "POST");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "method_not_allowed");
    assert_eq!(v["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn a_body_that_is_not_json_is_415() {
    let addr = start(quick()).await;
    let body = json!({ "prompt": "hi", "max_tokens": 1 }).to_string();
    for ct in ["text/plain", "application/x-www-form-urlencoded"] {
        let r = client()
            .post(format!("http://{addr}/v1/completions"))
            .header("content-type", ct)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 415, "{ct}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "unsupported_media_type");
    }
    let (status, _) = post(
        &addr,
        "/v1/completions",
        json!({ "prompt": "hi", "max_tokens": 1 }),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn values_that_ask_for_nothing_pass() {
    let addr = start(quick()).await;
    let chat = |extra: Value| {
        let mut b = json!({ "messages": user("hi"), "max_tokens": 1 });
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let harmless = json!({ "tools": [], "functions": [], "logprobs": false,
        "response_format": { "type": "text" }, "n": 1 });
    let (status, v) = post(&addr, "/v1/chat/completions", chat(harmless)).await;
    assert_eq!(status, 200, "{v}");
    let completion = json!({ "prompt": "hi", "max_tokens": 1, "best_of": 1, "suffix": "" });
    let (status, v) = post(&addr, "/v1/completions", completion).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test]
async fn metrics_needs_the_key_unless_turned_off() {
    for (metrics_auth, want) in [(true, 401), (false, 200)] {
        let mut cfg = quick();
        cfg.api_key = Some("sekret".into());
        cfg.metrics_auth = metrics_auth;
        let addr = start(cfg).await;
        let url = format!("http://{addr}/metrics");
        let r = client().get(&url).send().await.unwrap();
        assert_eq!(r.status().as_u16(), want, "metrics_auth {metrics_auth}");
        let r = client()
            .get(&url)
            .bearer_auth("sekret")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        // Health stays open, for load balancers.
        assert_eq!(health(&addr).await, 200);
    }
}

#[tokio::test]
async fn an_empty_api_key_is_refused_at_startup() {
    let mut cfg = quick();
    cfg.api_key = Some(String::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let served = q4moe_server::serve_on(listener, engine(), cfg, async {}).await;
    let err = served.expect_err("an empty key was accepted");
    assert!(err.to_string().contains("API key is empty"), "{err}");
}

#[tokio::test]
async fn cors_allows_only_the_configured_origins() {
    let preflight = |addr: &str, origin: &str| {
        client()
            .request(
                reqwest::Method::OPTIONS,
                format!("http://{addr}/v1/chat/completions"),
            )
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .send()
    };
    let mut cfg = quick();
    cfg.api_key = Some("sekret".into());
    cfg.cors_origins = vec!["https://app.example".into()];
    let addr = start(cfg).await;
    let r = preflight(&addr, "https://app.example").await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(
        r.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let r = preflight(&addr, "https://evil.example").await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
    // Without --cors-origin: no CORS headers at all.
    let addr = start(quick()).await;
    let r = preflight(&addr, "https://app.example").await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
}
