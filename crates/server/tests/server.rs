//! The real server on 127.0.0.1:0 over a tiny synthetic model (CPU), driven over HTTP.

mod common;

use std::time::Duration;

use common::{chat_body, metric, open_stream, start, start_default, user};
use q4moe_server::ServeConfig;
use serde_json::{json, Value};

#[tokio::test]
async fn chat_non_streaming_has_openai_shape() {
    let s = start_default().await;
    let (status, v) = s
        .post("/v1/chat/completions", &chat_body(user("Hello there"), 6))
        .await;
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    let u = &v["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 0);
    let completion = u["completion_tokens"].as_u64().unwrap();
    assert!((1..=6).contains(&completion));
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + completion
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
}

#[tokio::test]
async fn chat_streaming_matches_non_streaming() {
    let s = start_default().await;
    let mut body = chat_body(user("Tell me a story"), 8);
    body["ignore_eos"] = json!(true);
    let (_, whole) = s.post("/v1/chat/completions", &body).await;
    body["stream"] = json!(true);
    body["stream_options"] = json!({ "include_usage": true });
    let events = s.stream("/v1/chat/completions", &body).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        content,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
}

#[tokio::test]
async fn completions_streaming_and_not() {
    let s = start_default().await;
    let body = json!({ "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": true });
    let (status, v) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let events = s.stream("/v1/completions", &sb).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());
    // Token ids as the prompt.
    let (status, v) = s
        .post(
            "/v1/completions",
            &json!({ "prompt": [1, 2, 3, 4], "max_tokens": 2, "temperature": 0 }),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
}

#[tokio::test]
async fn concurrent_requests_all_complete_in_queue_order() {
    let s = start_default().await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (http, url) = (s.http.clone(), format!("{}/v1/chat/completions", s.base));
        let mut body = chat_body(user(&format!("request number {i}")), 4);
        body["stream"] = json!(i % 2 == 0);
        tasks.push(tokio::spawn(async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            let h = |n: &str| r.headers()[n].to_str().unwrap().parse::<u64>().unwrap();
            let (status, seq, run) = (r.status().as_u16(), h("x-q4moe-seq"), h("x-q4moe-run"));
            let text = r.text().await.unwrap();
            (status, seq, run, text)
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    assert!(done.iter().all(|d| d.0 == 200), "{done:?}");
    done.sort_by_key(|d| d.1);
    let runs: Vec<u64> = done.iter().map(|d| d.2).collect();
    assert!(
        runs.windows(2).all(|w| w[0] < w[1]),
        "served out of queue order: {runs:?}"
    );
    assert!(done.iter().all(|d| d.3.contains("finish_reason")));
}

/// A two-turn conversation: the second turn reuses the first's KV on one server and matches a
/// fresh server's answer exactly.
#[tokio::test]
async fn prefix_reuse_reports_cached_tokens_and_changes_nothing() {
    let a = start_default().await;
    let turn1 = user("What is the capital of France?");
    let (_, r1) = a
        .post("/v1/chat/completions", &chat_body(turn1.clone(), 6))
        .await;
    let answer = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let turn2 = json!([
        turn1[0],
        { "role": "assistant", "content": answer },
        { "role": "user", "content": "And of Germany?" },
    ]);
    let (_, r2) = a
        .post("/v1/chat/completions", &chat_body(turn2.clone(), 8))
        .await;
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "second turn reused nothing: {r2}");
    let b = start_default().await;
    let (_, fresh) = b.post("/v1/chat/completions", &chat_body(turn2, 8)).await;
    assert_eq!(fresh["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(r2["choices"][0]["message"], fresh["choices"][0]["message"]);
    assert_eq!(
        r2["usage"]["completion_tokens"],
        fresh["usage"]["completion_tokens"]
    );
}

#[tokio::test]
async fn thinking_switches_change_the_prompt() {
    let s = start_default().await;
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut body = chat_body(user("hi /no_think"), 1);
    let (_, soft) = s.post("/v1/chat/completions", &body).await;
    body["enable_thinking"] = json!(false);
    let (_, explicit) = s.post("/v1/chat/completions", &body).await;
    body["enable_thinking"] = json!(true);
    let (_, on) = s.post("/v1/chat/completions", &body).await;
    body.as_object_mut().unwrap().remove("enable_thinking");
    body["chat_template_kwargs"] = json!({ "enable_thinking": false });
    let (_, kwargs) = s.post("/v1/chat/completions", &body).await;
    let (_, plain) = s
        .post("/v1/chat/completions", &chat_body(user("hi /think"), 1))
        .await;
    // enable_thinking=false opens and closes an empty think block in the generation prompt.
    assert_eq!(tokens(&soft), tokens(&explicit));
    assert_eq!(tokens(&kwargs), tokens(&explicit));
    assert_eq!(
        tokens(&on),
        tokens(&explicit),
        "/no_think wins over enable_thinking=true"
    );
    assert!(tokens(&plain) < tokens(&explicit));
}

#[tokio::test]
async fn bad_inputs_get_openai_errors_naming_the_field() {
    let s = start_default().await;
    let long = "word ".repeat(3000);
    let chat: Vec<(Vec<u8>, u16, Option<&str>)> = vec![
        (b"{".to_vec(), 400, None),
        (b"[1, 2]".to_vec(), 400, None),
        (
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            None,
        ),
        (json!({}).to_string().into(), 400, Some("messages")),
        (
            json!({ "messages": "hi" }).to_string().into(),
            400,
            Some("messages"),
        ),
        (
            json!({ "messages": [] }).to_string().into(),
            400,
            Some("messages"),
        ),
        (
            json!({ "messages": [{ "role": "user", "content": 5 }] })
                .to_string()
                .into(),
            400,
            Some("messages[0].content"),
        ),
        (
            json!({ "messages": [{ "role": "robot", "content": "x" }] })
                .to_string()
                .into(),
            400,
            Some("messages[0].role"),
        ),
        (
            json!({ "model": "gpt-4", "messages": user("x") })
                .to_string()
                .into(),
            404,
            Some("model"),
        ),
        (
            json!({ "messages": user("x"), "temperature": "hot" })
                .to_string()
                .into(),
            400,
            Some("temperature"),
        ),
        (
            json!({ "messages": user("x"), "temperature": 5 })
                .to_string()
                .into(),
            400,
            Some("temperature"),
        ),
        (
            json!({ "messages": user("x"), "top_p": 0 })
                .to_string()
                .into(),
            400,
            Some("top_p"),
        ),
        (
            json!({ "messages": user("x"), "top_k": -1 })
                .to_string()
                .into(),
            400,
            Some("top_k"),
        ),
        (
            json!({ "messages": user("x"), "min_p": 2 })
                .to_string()
                .into(),
            400,
            Some("min_p"),
        ),
        (
            json!({ "messages": user("x"), "repetition_penalty": 0 })
                .to_string()
                .into(),
            400,
            Some("repetition_penalty"),
        ),
        (
            json!({ "messages": user("x"), "presence_penalty": 3 })
                .to_string()
                .into(),
            400,
            Some("presence_penalty"),
        ),
        (
            json!({ "messages": user("x"), "frequency_penalty": -3 })
                .to_string()
                .into(),
            400,
            Some("frequency_penalty"),
        ),
        (
            json!({ "messages": user("x"), "n": 0 }).to_string().into(),
            400,
            Some("n"),
        ),
        (
            json!({ "messages": user("x"), "top_logprobs": 2 })
                .to_string()
                .into(),
            400,
            Some("top_logprobs"),
        ),
        (
            json!({ "messages": user("x"), "logprobs": true, "top_logprobs": 21 })
                .to_string()
                .into(),
            400,
            Some("top_logprobs"),
        ),
        (
            json!({ "messages": user("x"), "logprobs": 1 })
                .to_string()
                .into(),
            400,
            Some("logprobs"),
        ),
        (
            json!({ "messages": user("x"), "stop": 5 })
                .to_string()
                .into(),
            400,
            Some("stop"),
        ),
        (
            json!({ "messages": user("x"), "stream": "yes" })
                .to_string()
                .into(),
            400,
            Some("stream"),
        ),
        (
            json!({ "messages": user("x"), "seed": "s" })
                .to_string()
                .into(),
            400,
            Some("seed"),
        ),
        (
            json!({ "messages": user("x"), "enable_thinking": "no" })
                .to_string()
                .into(),
            400,
            Some("enable_thinking"),
        ),
        (
            json!({ "messages": user("x"), "max_tokens": "x" })
                .to_string()
                .into(),
            400,
            Some("max_tokens"),
        ),
        (
            json!({ "messages": user("x"), "max_tokens": 100000 })
                .to_string()
                .into(),
            400,
            Some("max_tokens"),
        ),
        (
            json!({ "messages": user("x"), "max_completion_tokens": 0 })
                .to_string()
                .into(),
            400,
            Some("max_completion_tokens"),
        ),
        // Fits alone, not beside the prompt: found by the worker after tokenising.
        (
            json!({ "messages": user("x"), "max_tokens": 505 })
                .to_string()
                .into(),
            400,
            Some("max_tokens"),
        ),
        (
            json!({ "messages": user(&long) }).to_string().into(),
            400,
            Some("messages"),
        ),
        (
            json!({ "messages": user(&"x".repeat(70 << 10)) })
                .to_string()
                .into(),
            413,
            None,
        ),
    ];
    for (body, want, param) in chat {
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).to_string();
        let (status, v) = s.post_raw("/v1/chat/completions", body).await;
        assert_eq!(status, want, "{shown}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{shown}: {v}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error", "{shown}: {v}");
        assert_eq!(v["error"]["param"].as_str(), param, "{shown}: {v}");
    }
    let completions = [
        (json!({}), "prompt"),
        (json!({ "prompt": 5 }), "prompt"),
        (json!({ "prompt": [] }), "prompt"),
        (json!({ "prompt": "" }), "prompt"),
        (json!({ "prompt": [99999] }), "prompt"),
        (json!({ "prompt": [-1] }), "prompt"),
        (json!({ "prompt": ["a", ""] }), "prompt"),
        (json!({ "prompt": [[1, 2], "b"] }), "prompt"),
        (json!({ "prompt": [[]] }), "prompt"),
        (json!({ "prompt": "a", "logprobs": 21 }), "logprobs"),
        (json!({ "prompt": "a", "logprobs": true }), "logprobs"),
        (json!({ "prompt": ["a", "b"], "n": 40 }), "n"),
        (
            json!({ "prompt": "a", "logit_bias": { "1": 100.5 } }),
            "logit_bias",
        ),
        (
            json!({ "prompt": "a", "logit_bias": { "x": 1 } }),
            "logit_bias",
        ),
        (
            json!({ "prompt": "a", "logit_bias": { "4000000000": 1 } }),
            "logit_bias",
        ),
        (json!({ "prompt": "a", "logit_bias": [1] }), "logit_bias"),
    ];
    for (body, param) in completions {
        let (status, v) = s.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // Still serving.
    let (status, _) = s
        .post("/v1/chat/completions", &chat_body(user("still there?"), 2))
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn api_key_is_required_when_set() {
    let s = start(ServeConfig {
        api_key: Some("sekret".into()),
        model_name: "tiny".into(),
        ..Default::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", s.base);
    let body = chat_body(user("hi"), 1);
    for auth in [None, Some("Bearer wrong"), Some("sekret")] {
        let mut rq = s.http.post(&url).json(&body);
        if let Some(a) = auth {
            rq = rq.header("authorization", a);
        }
        let r = rq.send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{auth:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let r = s
        .http
        .post(&url)
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = s
        .http
        .get(format!("{}/v1/models", s.base))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        s.get_text("/health").await.0,
        200,
        "health stays open for probes"
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_frees_the_engine() {
    use futures_util::StreamExt;
    let s = start_default().await;
    let mut bytes = Box::pin(open_stream(&s, "go on forever", 480).await);
    let first = bytes.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    drop(bytes);
    // The next request runs only once the engine is free: it must not wait for 480 tokens.
    let t = std::time::Instant::now();
    let (status, _) = s
        .post("/v1/chat/completions", &chat_body(user("next"), 2))
        .await;
    assert_eq!(status, 200);
    let metrics = s.get_text("/metrics").await.1;
    let tokens: u64 = metric(&metrics, "q4moe_completion_tokens_total");
    assert!(
        tokens < 400,
        "the abandoned stream ran on ({tokens} tokens, {:?})",
        t.elapsed()
    );
    assert!(metric(&metrics, "q4moe_cancelled_total") >= 1);
}

#[tokio::test]
async fn metrics_models_health_and_unknown_paths() {
    let s = start_default().await;
    s.post("/v1/chat/completions", &chat_body(user("count me"), 3))
        .await;
    s.post("/v1/chat/completions", &json!({ "messages": [] }))
        .await;
    let (status, m) = s.get_text("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        m.contains("q4moe_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("q4moe_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1"),
        "{m}"
    );
    assert!(metric(&m, "q4moe_prompt_tokens_total") > 0);
    assert!(metric(&m, "q4moe_completion_tokens_total") > 0);
    assert!(m.contains("q4moe_queue_depth 0"));
    assert!(
        m.contains("q4moe_time_to_first_token_seconds_count 1"),
        "{m}"
    );
    assert!(m.contains("q4moe_time_per_output_token_seconds_bucket{le=\"+Inf\"}"));
    let (status, models) = s.get_text("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(s.get_text("/health").await.0, 200);
    let (status, body) = s.get_text("/v2/nothing").await;
    assert_eq!(status, 404);
    assert!(body.contains("\"error\""));
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A full queue refuses at once (503, OpenAI shape); what it accepted still completes.
#[tokio::test]
async fn full_queue_refuses_new_requests_and_loses_none() {
    use futures_util::StreamExt;
    let s = start(ServeConfig {
        model_name: "tiny".into(),
        queue_capacity: 1,
        // One sequence at a time, so the busy stream holds the engine and the queue fills.
        batch: q4moe_server::BatchOptions {
            max_batch: 1,
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    let mut busy = open_stream(&s, "keep the engine busy", 480).await;
    busy.next().await.unwrap().unwrap();
    // The engine is taken and one request may wait: of a burst, the surplus is refused at once,
    // and every request gets an answer.
    let burst: Vec<_> = (0..6)
        .map(|i| {
            let (http, url) = (s.http.clone(), format!("{}/v1/chat/completions", s.base));
            let body = chat_body(user(&format!("burst {i}")), 2);
            tokio::spawn(async move {
                let r = http.post(url).json(&body).send().await.unwrap();
                let retry = r
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_string());
                (
                    r.status().as_u16(),
                    (retry, r.json::<Value>().await.unwrap()),
                )
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in burst {
        answers.push(t.await.unwrap());
    }
    drop(busy);
    assert!(
        answers.iter().all(|(st, _)| *st == 200 || *st == 503),
        "{answers:?}"
    );
    assert!(answers.iter().any(|(st, _)| *st == 200), "{answers:?}");
    let refused = answers
        .iter()
        .find(|(st, _)| *st == 503)
        .expect("a full queue refused nothing");
    assert_eq!(refused.1 .1["error"]["code"], "queue_full");
    assert_eq!(
        refused.1 .0.as_deref(),
        Some("1"),
        "503 without Retry-After"
    );
    assert!(answers
        .iter()
        .all(|(st, (retry, _))| (*st == 503) == retry.is_some()));
}

#[tokio::test]
async fn sampling_fields_seed_and_stop_strings() {
    let s = start_default().await;
    let body = json!({
        "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "top_k": 40,
        "min_p": 0.01, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
        "seed": 42, "ignore_eos": true,
    });
    let (status, a) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = s.post("/v1/completions", &body).await;
    assert_eq!(
        a["choices"][0]["text"], b["choices"][0]["text"],
        "same seed, same text"
    );
    // Stop at a piece of the greedy text: cut before it, finish_reason stop.
    let greedy = json!({ "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": true });
    let (_, g) = s.post("/v1/completions", &greedy).await;
    let text = g["choices"][0]["text"].as_str().unwrap().to_string();
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(3).collect();
    let mut stopped = greedy.clone();
    stopped["stop"] = json!(["\u{1}never", stop]);
    let (_, st) = s.post("/v1/completions", &stopped).await;
    assert_eq!(st["choices"][0]["finish_reason"], "stop", "{st}");
    assert_eq!(
        st["choices"][0]["text"].as_str().unwrap(),
        &text[..text.find(&stop).unwrap()]
    );
}
