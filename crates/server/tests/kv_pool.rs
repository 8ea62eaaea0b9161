//! The server over a KV pool too small for its concurrent requests (the CPU's paged KV,
//! `--kv-cache-mb`): they wait for pages, or give theirs back and prefill again, and each is
//! answered with what it gives alone; a request that alone outgrows the pool is a 400 naming
//! it; the pool's pages and the preemptions are in the metrics; the server serves on.

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
async fn concurrent_requests_past_the_pool_all_complete_and_one_too_large_is_a_400() {
    let cfg = q4moe_model::Config::tiny();
    let page = 2 * 16 * cfg.kv_dim() * 2; // keys and values, f16 (the default)
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
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, _, v) = t.await.unwrap();
        assert_eq!(status, 200, "request {i}: {v}");
        assert_eq!(v["choices"][0]["text"], alone[i].as_str(), "request {i}");
    }
    // A request that alone outgrows the pool: 400, naming the pool; no retry would help.
    let mut big = body(9);
    big["max_tokens"] = json!(200);
    let (status, v) = s.post("/v1/completions", &big).await;
    assert_eq!(
        (status, &v["error"]["code"]),
        (400, &json!("kv_cache_exceeded")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--kv-cache-mb"),
        "{v}"
    );
    let m = s.get_text("/metrics").await.1;
    let capacity = 8 * cfg.n_layer as u64;
    assert_eq!(
        metric(&m, "q4moe_kv_pages{state=\"capacity\"}"),
        capacity,
        "{m}"
    );
    assert!(
        metric(&m, "q4moe_kv_pages{state=\"used\"}") <= capacity,
        "{m}"
    );
    assert!(m.contains("q4moe_kv_preemptions_total "), "{m}");
    // And it serves on.
    let (status, v) = s.post("/v1/completions", &body(0)).await;
    assert_eq!(
        (status, v["choices"][0]["text"].as_str()),
        (200, Some(alone[0].as_str()))
    );
}
