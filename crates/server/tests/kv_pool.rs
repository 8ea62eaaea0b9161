//! The server over a KV pool too small for its concurrent requests (the CPU's paged KV,
//! `--kv-cache-mb`): every request is answered, either with what it gives alone or with 503
//! `kv_cache_full` and `Retry-After` (never dropped, never hung), the pool's pages are in the
//! metrics, and the server serves on.

mod common;

use common::{metric, model_path, start_engine};
use q4moe_engine::{Device, Engine, EngineOptions};
use q4moe_server::ServeConfig;
use serde_json::{json, Value};

fn body(i: usize) -> Value {
    json!({
        "prompt": format!("Request {i}: once upon a time, far away"),
        "max_tokens": 80, "temperature": 0, "ignore_eos": true,
    })
}

#[tokio::test]
async fn requests_past_the_pool_get_503_with_retry_after_and_the_rest_complete() {
    let cfg = q4moe_model::Config::tiny();
    let page = 2 * 16 * cfg.kv_dim() * 4;
    // Eight pages a layer, 128 positions: one request (about 90) fits, two do not.
    let opts = EngineOptions {
        device: Device::Cpu,
        kv_cache_bytes: 8 * cfg.n_layer * page,
        ..Default::default()
    };
    let s = start_engine(
        Engine::load(model_path(), &opts).unwrap(),
        ServeConfig {
            model_name: "tiny".into(),
            ..Default::default()
        },
    )
    .await;
    let mut alone = Vec::new();
    for i in 0..4 {
        let (status, v) = s.post("/v1/completions", &body(i)).await;
        assert_eq!(status, 200, "request {i} alone: {v}");
        alone.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (http, url) = (s.http.clone(), format!("{}/v1/completions", s.base));
            tokio::spawn(async move {
                let r = http.post(url).json(&body(i)).send().await.unwrap();
                let retry = r.headers().get("retry-after").cloned();
                (r.status().as_u16(), retry, r.json::<Value>().await.unwrap())
            })
        })
        .collect();
    let mut done = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, retry, v) = t.await.unwrap();
        match status {
            200 => {
                assert_eq!(v["choices"][0]["text"], alone[i].as_str(), "request {i}");
                done += 1;
            }
            503 => {
                assert_eq!(v["error"]["code"], "kv_cache_full", "request {i}: {v}");
                assert!(
                    v["error"]["message"].as_str().unwrap().contains("KV pool is full"),
                    "{v}"
                );
                assert_eq!(retry.unwrap(), "1", "request {i}: no Retry-After");
            }
            _ => panic!("request {i}: {status} {v}"),
        }
    }
    assert!(done >= 1, "no request completed");
    let m = s.get_text("/metrics").await.1;
    let capacity = 8 * cfg.n_layer as u64;
    assert_eq!(metric(&m, "q4moe_kv_pages{state=\"capacity\"}"), capacity, "{m}");
    assert!(metric(&m, "q4moe_kv_pages{state=\"used\"}") <= capacity, "{m}");
    // And it serves on.
    let (status, v) = s.post("/v1/completions", &body(0)).await;
    assert_eq!((status, v["choices"][0]["text"].as_str()), (200, Some(alone[0].as_str())));
}
