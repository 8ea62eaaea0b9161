//! Continuous batching through HTTP on the CPU backend: concurrent requests get what each gets
//! alone, their streams overlap, and a client that leaves frees its slot. Orders of events are
//! asserted, never timings.

mod common;

use std::sync::{Arc, Mutex};

use common::{chat_body, metric, open_stream, start, start_default, user};
use futures_util::StreamExt;
use q4moe_server::{BatchOptions, ServeConfig};
use serde_json::{json, Value};

fn completion_body(i: usize) -> Value {
    let mut b = json!({
        "prompt": format!("Request {i}: once upon a time, far away"),
        "max_tokens": 16 + 4 * i, "temperature": 0, "ignore_eos": true,
    });
    if i % 2 == 1 {
        b["temperature"] = json!(0.9);
        b["top_p"] = json!(0.9);
        b["seed"] = json!(100 + i);
    }
    b
}

#[tokio::test]
async fn concurrent_requests_give_exactly_what_each_gives_alone() {
    let s = start_default().await;
    let mut alone = Vec::new();
    for i in 0..4 {
        let (status, v) = s.post("/v1/completions", &completion_body(i)).await;
        assert_eq!(status, 200, "{v}");
        alone.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (http, url) = (s.http.clone(), format!("{}/v1/completions", s.base));
            tokio::spawn(async move {
                let r = http
                    .post(url)
                    .json(&completion_body(i))
                    .send()
                    .await
                    .unwrap();
                r.json::<Value>().await.unwrap()
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let v = t.await.unwrap();
        assert_eq!(v["choices"][0]["text"], alone[i].as_str(), "request {i}");
    }
    assert!(alone.iter().all(|t| !t.is_empty()));
    let m = s.get_text("/metrics").await.1;
    assert_eq!(
        metric(&m, "q4moe_sequences_finished_total{reason=\"length\"}"),
        8,
        "{m}"
    );
    for name in [
        "q4moe_batch_size",
        "q4moe_queue_wait_seconds_count",
        "q4moe_inter_token_latency_seconds_count",
    ] {
        assert!(m.contains(name), "{name} missing:\n{m}");
    }
    assert!(metric(&m, "q4moe_inter_token_latency_seconds_count") > 0);
    // Once the worker is past its last step (the gauges follow each step, a little after the
    // responses), nothing runs and the finished conversations' KV is kept for reuse.
    let running = "q4moe_kv_bytes{state=\"running\"}";
    let mut m = m;
    for _ in 0..100 {
        if m.contains(running) && metric(&m, running) == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        m = s.get_text("/metrics").await.1;
    }
    assert!(m.contains(running) && metric(&m, running) == 0, "{m}");
    assert!(metric(&m, "q4moe_kv_bytes{state=\"cached\"}") > 0, "{m}");
}

/// Some generated text arrived (content or reasoning; the opening role chunk has none).
fn has_text(seen: &str) -> bool {
    let key = "content\":\"";
    seen.match_indices(key).any(|(i, _)| {
        seen[i + key.len()..]
            .chars()
            .next()
            .is_some_and(|c| c != '"')
    })
}

/// Reads a stream to its end, logging `(id, "token")` at the first content and `(id, "done")`.
async fn follow(
    mut bytes: impl futures_util::Stream<Item = reqwest::Result<axum::body::Bytes>> + Unpin,
    id: usize,
    log: Arc<Mutex<Vec<(usize, &'static str)>>>,
) {
    let mut seen = String::new();
    let mut first = false;
    while let Some(chunk) = bytes.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        if !first && has_text(&seen) {
            first = true;
            log.lock().unwrap().push((id, "token"));
        }
    }
    assert!(
        seen.contains("[DONE]"),
        "stream {id} ended without [DONE]: {seen}"
    );
    log.lock().unwrap().push((id, "done"));
}

#[tokio::test]
async fn streams_overlap_a_late_request_gets_tokens_before_an_early_one_ends() {
    let s = start_default().await;
    let log: Arc<Mutex<Vec<(usize, &'static str)>>> = Arc::default();
    let mut first = Box::pin(open_stream(&s, "the first, long one", 300).await);
    first.next().await.unwrap().unwrap();
    let long = tokio::spawn(follow(first, 0, log.clone()));
    let mut later = Vec::new();
    for i in 1..4 {
        let b = Box::pin(open_stream(&s, &format!("later number {i}"), 8).await);
        later.push(tokio::spawn(follow(b, i, log.clone())));
    }
    for t in later {
        t.await.unwrap();
    }
    long.await.unwrap();
    let log = log.lock().unwrap().clone();
    let at = |e: (usize, &'static str)| log.iter().position(|x| *x == e).unwrap_or(usize::MAX);
    assert!(
        at((3, "token")) < at((0, "done")),
        "the 4th request's first token came after the 1st finished: {log:?}"
    );
}

#[tokio::test]
async fn a_client_that_leaves_frees_its_slot_for_the_next_request() {
    let s = start(ServeConfig {
        model_name: "tiny".into(),
        batch: BatchOptions {
            max_batch: 2,
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    let log: Arc<Mutex<Vec<(usize, &'static str)>>> = Arc::default();
    let mut a = Box::pin(open_stream(&s, "stream a goes on", 480).await);
    a.next().await.unwrap().unwrap();
    let mut b = Box::pin(open_stream(&s, "stream b goes on", 480).await);
    b.next().await.unwrap().unwrap();
    let b = tokio::spawn(follow(b, 1, log.clone()));
    // Both slots are taken; a leaves, and a third request must run beside b.
    drop(a);
    let (status, v) = s
        .post("/v1/chat/completions", &chat_body(user("the newcomer"), 4))
        .await;
    assert_eq!(status, 200, "{v}");
    log.lock().unwrap().push((2, "done"));
    b.await.unwrap();
    let log = log.lock().unwrap().clone();
    let at = |e| log.iter().position(|x| *x == e).unwrap();
    assert!(
        at((2, "done")) < at((1, "done")),
        "the newcomer waited for b: the slot was not freed ({log:?})"
    );
    let m = s.get_text("/metrics").await.1;
    assert!(metric(&m, "q4moe_cancelled_total") >= 1, "{m}");
}
