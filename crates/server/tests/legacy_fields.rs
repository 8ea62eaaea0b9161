//! The OpenAI fields older clients still send, through the real server over the tiny model
//! (CPU): `best_of` (the candidates with the highest mean logprob, checked against the same
//! candidates generated through `n` with `logprobs`), `suffix` and llama-server's `/infill`
//! (fill-in-the-middle, checked against the same prompt spelled as token ids), and the legacy
//! chat `functions` / `function_call`.

mod common;

use common::{chat_body, start_roomy, user, Server};
use serde_json::{json, Value};

async fn ok(s: &Server, path: &str, body: &Value) -> Value {
    let (status, v) = s.post(path, body).await;
    assert_eq!(status, 200, "{body} -> {v}");
    v
}

async fn refused(s: &Server, path: &str, body: &Value, field: &str) -> Value {
    let (status, v) = s.post(path, body).await;
    assert_eq!(status, 400, "{body} -> {v}");
    assert_eq!(v["error"]["param"], field, "{v}");
    v
}

fn mean(lps: &Value) -> f64 {
    let v: Vec<f64> = lps["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    v.iter().sum::<f64>() / v.len() as f64
}

fn sampled(prompt: &str, seed: u64) -> Value {
    json!({ "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 1.2,
        "seed": seed, "ignore_eos": false })
}

#[tokio::test]
async fn best_of_returns_the_candidates_with_the_highest_mean_logprob() {
    let s = start_roomy().await;
    let mut reordered = false;
    for seed in [3, 11] {
        // The candidates, through n (candidate i samples from seed + i either way).
        let mut all = sampled("Once upon a time", seed);
        all["n"] = json!(4);
        all["logprobs"] = json!(0);
        let all = ok(&s, "/v1/completions", &all).await;
        let mut ranked: Vec<(f64, String)> = all["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    mean(&c["logprobs"]),
                    c["text"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let in_order: Vec<String> = ranked.iter().map(|r| r.1.clone()).collect();
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
        reordered |= ranked[..2].iter().map(|r| &r.1).ne(in_order[..2].iter());

        let mut best = sampled("Once upon a time", seed);
        best["n"] = json!(2);
        best["best_of"] = json!(4);
        let v = ok(&s, "/v1/completions", &best).await;
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2, "{v}");
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
            assert_eq!(c["text"], ranked[i].1, "seed {seed}: {v} vs {all}");
            // Logprobs were not asked for: none come back, though the ranking used them.
            assert!(c["logprobs"].is_null(), "{v}");
        }
        // Every candidate's tokens are billed; the prompt once (its cache may differ).
        for k in ["prompt_tokens", "completion_tokens"] {
            assert_eq!(v["usage"][k], all["usage"][k], "{v}");
        }

        // With logprobs asked for, they are the chosen candidates'.
        best["logprobs"] = json!(1);
        let v = ok(&s, "/v1/completions", &best).await;
        assert!((mean(&v["choices"][0]["logprobs"]) - ranked[0].0).abs() < 1e-9);
    }
    // The seeds are ones where the best are not simply the first candidates.
    assert!(reordered, "no seed tells ranking from taking the first n");
}

/// The candidates of one prompt compute it once: the others copy its KV (Backend::fork), which
/// the metrics count as cached prompt tokens.
#[tokio::test]
async fn best_of_candidates_compute_the_prompt_once() {
    let s = start_roomy().await;
    let cached = |m: &str| common::metric(m, "q4moe_cached_prompt_tokens_total");
    let before = cached(&s.get_text("/metrics").await.1);
    let mut body = sampled(
        "A prompt no earlier request has seen, long enough to count",
        5,
    );
    body["best_of"] = json!(4);
    let v = ok(&s, "/v1/completions", &body).await;
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let after = cached(&s.get_text("/metrics").await.1);
    // Three candidates copy all but the last prompt token (it runs as the first input).
    assert!(
        after - before >= 3 * (prompt - 1),
        "{before} -> {after}, prompt {prompt}"
    );
}

#[tokio::test]
async fn best_of_errors_and_streaming() {
    let s = start_roomy().await;
    let mut body = sampled("Hello", 1);
    body["n"] = json!(3);
    body["best_of"] = json!(2);
    let v = refused(&s, "/v1/completions", &body, "best_of").await;
    assert!(v["error"]["message"].as_str().unwrap().contains("at least"));
    let mut body = sampled("Hello", 1);
    body["best_of"] = json!(2);
    body["stream"] = json!(true);
    let v = refused(&s, "/v1/completions", &body, "best_of").await;
    assert!(v["error"]["message"].as_str().unwrap().contains("stream"));
    body["prompt"] = json!(vec!["a"; 40]);
    body["stream"] = json!(false);
    refused(&s, "/v1/completions", &body, "best_of").await;
    let mut chat = chat_body(user("Hello"), 2);
    chat["best_of"] = json!(2);
    refused(&s, "/v1/chat/completions", &chat, "best_of").await;
    // best_of == n streams, as n does.
    let mut body = sampled("Hello", 1);
    body["n"] = json!(2);
    body["best_of"] = json!(2);
    body["stream"] = json!(true);
    let chunks = s.stream("/v1/completions", &body).await;
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let finished = chunks
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finished, 2);
}

/// Token ids of `text`, control tokens spelled in it parsed as `parse_special` says.
async fn ids(s: &Server, text: &str, parse_special: bool) -> Vec<u64> {
    let body = json!({ "content": text, "parse_special": parse_special });
    let v = ok(s, "/tokenize", &body).await;
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn greedy(prompt: Value, max_tokens: usize) -> Value {
    json!({ "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true })
}

#[tokio::test]
async fn suffix_fills_in_the_middle_with_the_markup_as_control_tokens() {
    let s = start_roomy().await;
    // A control token typed in the texts stays text.
    let (prefix, suffix) = ("def add(a, b):\n<|fim_middle|>", "\n    return c\n");
    let mut want = ids(&s, "<|fim_prefix|>", true).await;
    assert_eq!(want.len(), 1);
    want.extend(ids(&s, prefix, false).await);
    want.extend(ids(&s, "<|fim_suffix|>", true).await);
    want.extend(ids(&s, suffix, false).await);
    want.extend(ids(&s, "<|fim_middle|>", true).await);
    let spelled = ok(&s, "/v1/completions", &greedy(json!(want), 5)).await;

    let mut body = greedy(json!(prefix), 5);
    body["suffix"] = json!(suffix);
    let v = ok(&s, "/v1/completions", &body).await;
    let middle = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(middle, spelled["choices"][0]["text"].as_str().unwrap());
    assert_eq!(v["usage"]["prompt_tokens"], want.len(), "{v}");

    // Echo gives the whole filled text; logprobs cover the middle, offset after the prompt.
    body["echo"] = json!(true);
    body["logprobs"] = json!(0);
    let v = ok(&s, "/v1/completions", &body).await;
    let c = &v["choices"][0];
    assert_eq!(c["text"], format!("{prefix}{middle}{suffix}"), "{v}");
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5, "{v}");
    assert_eq!(lp["text_offset"][0], prefix.chars().count(), "{v}");
    assert!(lp["token_logprobs"][0].is_number());

    // Streamed with echo: the prompt, the middle, then the suffix.
    body["stream"] = json!(true);
    let text: String = s
        .stream("/v1/completions", &body)
        .await
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(text, format!("{prefix}{middle}{suffix}"));

    // Several prompts each fill their own gap; an empty suffix asks for nothing.
    let mut two = greedy(json!([prefix, "x = 1"]), 5);
    two["suffix"] = json!(suffix);
    let v = ok(&s, "/v1/completions", &two).await;
    assert_eq!(v["choices"][0]["text"], middle.as_str());
    let mut plain = greedy(json!(prefix), 5);
    plain["suffix"] = json!("");
    let p = ok(&s, "/v1/completions", &plain).await;
    assert_eq!(
        p["usage"]["prompt_tokens"],
        ids(&s, prefix, true).await.len()
    );
    let mut bad = greedy(json!(prefix), 5);
    bad["suffix"] = json!(3);
    refused(&s, "/v1/completions", &bad, "suffix").await;
}

#[tokio::test]
async fn infill_answers_in_llama_servers_shape_on_the_same_path() {
    let s = start_roomy().await;
    let (prefix, suffix) = ("fn main() {\n", "\n}\n");
    let mut completion = greedy(json!(prefix), 4);
    completion["suffix"] = json!(suffix);
    let c = ok(&s, "/v1/completions", &completion).await;
    let body = json!({ "input_prefix": prefix, "input_suffix": suffix, "n_predict": 4,
        "temperature": 0, "ignore_eos": true });
    let v = ok(&s, "/infill", &body).await;
    assert_eq!(v["content"], c["choices"][0]["text"], "{v}");
    assert_eq!(v["stop"], true);
    assert_eq!(v["stop_type"], "limit");
    assert_eq!(v["tokens_predicted"], 4);
    assert_eq!(v["tokens_evaluated"], c["usage"]["prompt_tokens"]);

    // Streamed: pieces of content, a last chunk with stop, no [DONE].
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks: Vec<Value> = s
        .stream("/infill", &streamed)
        .await
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .map(|c| c["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, v["content"].as_str().unwrap());
    let last = chunks.last().unwrap();
    assert_eq!(
        (last["stop"].clone(), last["tokens_predicted"].clone()),
        (json!(true), json!(4))
    );
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["stop"] == false));

    // `prompt` starts the middle; other files come before, in the repository pattern.
    let mut more = body.clone();
    more["prompt"] = json!("let");
    more["input_extra"] = json!([{ "filename": "lib.rs", "text": "pub fn f() {}\n" }]);
    let m = ok(&s, "/infill", &more).await;
    let added = ids(&s, "let", false).await.len()
        + ids(
            &s,
            "<|repo_name|>myproject\n<|file_sep|>lib.rs\npub fn f() {}\n<|file_sep|>filename\n",
            true,
        )
        .await
        .len();
    let base = v["tokens_evaluated"].as_u64().unwrap() as usize;
    assert_eq!(m["tokens_evaluated"], base + added, "{m}");

    for (extra, field) in [
        (json!({ "n_predict": 0 }), "n_predict"),
        (json!({ "n_probs": 3 }), "n_probs"),
        (
            json!({ "input_extra": [{ "filename": "a" }] }),
            "input_extra",
        ),
        (json!({ "temperature": 9 }), "temperature"),
    ] {
        let mut b = body.clone();
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        refused(&s, "/infill", &b, field).await;
    }
}

fn functions() -> Value {
    json!([
        { "name": "weather", "description": "The weather in a city", "parameters": {
            "type": "object", "properties": { "city": { "type": "string", "maxLength": 8 } },
            "required": ["city"], "additionalProperties": false } },
        { "name": "clock", "parameters": { "type": "object",
            "properties": { "tz": { "enum": ["utc", "local"] } }, "required": ["tz"],
            "additionalProperties": false } },
    ])
}

fn named_call(stream: bool) -> Value {
    let mut body = chat_body(user("Time?"), 60);
    body["functions"] = functions();
    body["function_call"] = json!({ "name": "clock" });
    body["stream"] = json!(stream);
    body
}

#[tokio::test]
async fn legacy_function_calls_answer_in_the_legacy_shape() {
    let s = start_roomy().await;
    let v = ok(&s, "/v1/chat/completions", &named_call(false)).await;
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "function_call", "{v}");
    assert!(c["message"].get("tool_calls").is_none(), "{v}");
    assert_eq!(c["message"]["content"], Value::Null, "{v}");
    let call = &c["message"]["function_call"];
    assert_eq!(call["name"], "clock", "{v}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["tz"] == "utc" || args["tz"] == "local", "{args}");

    // Streamed: function_call pieces, as the openai client reassembles them.
    let (mut name, mut arguments, mut finish) = (String::new(), String::new(), Value::Null);
    for d in s.stream("/v1/chat/completions", &named_call(true)).await {
        let Ok(chunk) = serde_json::from_str::<Value>(&d) else {
            continue;
        };
        let choice = &chunk["choices"][0];
        assert!(choice["delta"].get("tool_calls").is_none(), "{chunk}");
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
        let f = &choice["delta"]["function_call"];
        name += f["name"].as_str().unwrap_or_default();
        arguments += f["arguments"].as_str().unwrap_or_default();
    }
    assert_eq!(finish, "function_call");
    assert_eq!(name, "clock");
    assert_eq!(arguments, call["arguments"].as_str().unwrap());

    // "none": no call is read out of the text.
    let mut none = named_call(false);
    none["function_call"] = json!("none");
    none["max_tokens"] = json!(3);
    let v = ok(&s, "/v1/chat/completions", &none).await;
    assert!(
        v["choices"][0]["message"].get("function_call").is_none(),
        "{v}"
    );
    assert_ne!(v["choices"][0]["finish_reason"], "function_call");

    let mut both = named_call(false);
    both["tools"] = json!([{ "type": "function", "function": { "name": "f" } }]);
    refused(&s, "/v1/chat/completions", &both, "functions").await;
    let mut unknown = named_call(false);
    unknown["function_call"] = json!({ "name": "nope" });
    refused(&s, "/v1/chat/completions", &unknown, "function_call").await;
}

#[tokio::test]
async fn legacy_history_renders_as_tool_turns_do() {
    let s = start_roomy().await;
    let history = |legacy: bool, result: &str| {
        let mut m = user("Weather?").as_array().unwrap().clone();
        let args = "{\"city\": \"Paris\"}";
        if legacy {
            m.push(json!({ "role": "assistant", "content": null,
                "function_call": { "name": "weather", "arguments": args } }));
            m.push(json!({ "role": "function", "name": "weather", "content": result }));
        } else {
            m.push(
                json!({ "role": "assistant", "content": null, "tool_calls": [{ "id": "call_1",
                "type": "function", "function": { "name": "weather", "arguments": args } }] }),
            );
            m.push(json!({ "role": "tool", "tool_call_id": "call_1", "content": result }));
        }
        let mut b = chat_body(Value::Array(m), 4);
        if legacy {
            b["functions"] = functions();
        } else {
            let tools: Vec<Value> = functions()
                .as_array()
                .unwrap()
                .iter()
                .map(|f| json!({ "type": "function", "function": f }))
                .collect();
            b["tools"] = json!(tools);
        }
        b["logprobs"] = json!(true);
        b["ignore_eos"] = json!(true);
        b
    };
    let old = ok(&s, "/v1/chat/completions", &history(true, "sunny")).await;
    let new = ok(&s, "/v1/chat/completions", &history(false, "sunny")).await;
    // The same prompt: the same length, and the same greedy tokens with the same logprobs.
    assert_eq!(old["usage"]["prompt_tokens"], new["usage"]["prompt_tokens"]);
    assert_eq!(
        old["choices"][0]["logprobs"], new["choices"][0]["logprobs"],
        "{old}\n{new}"
    );
    let longer = ok(
        &s,
        "/v1/chat/completions",
        &history(true, "sunny, 21 degrees"),
    )
    .await;
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        tokens(&longer) > tokens(&old),
        "the function result is not in the prompt"
    );

    let mut nameless = history(true, "sunny");
    nameless["messages"][2]
        .as_object_mut()
        .unwrap()
        .remove("name");
    refused(&s, "/v1/chat/completions", &nameless, "messages[2].name").await;
}
