//! logprobs, top_logprobs, echo, logit_bias, several prompts and n > 1 through the real server
//! over the tiny synthetic model (CPU). The reference for every logprob is the engine's own
//! logits for the same greedy run, log-softmaxed here in f64.

mod common;

use common::{chat_body, start_default, user, Server};
use q4moe_engine::{Engine, Flow, GenerateRequest, SamplingParams};
use q4moe_model::backend::Logits;
use serde_json::{json, Value};

/// log-softmax of `logits` at `token`, the plain way.
fn log_softmax(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    logits[token as usize] as f64 - max - sum.ln()
}

/// The engine's greedy run of `prompt` (EOS ignored): its tokens and each step's logits.
fn reference(
    engine: &mut Engine,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut req = GenerateRequest::new(prompt, max_tokens);
    req.want_logits = true;
    req.stop_at_eos = false;
    let out = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
    (out.tokens, out.logits)
}

fn chat_prompt(engine: &Engine, text: &str) -> Vec<u32> {
    let messages = vec![q4moe_engine::ChatMessage::new("user", text)];
    let thinking = q4moe_tokenizer::thinking_switch(&messages, None);
    let rendered = engine.render_chat(&messages, thinking).unwrap();
    engine.encode_prompt(&rendered).unwrap()
}

fn close(a: &Value, b: f64) -> bool {
    a.as_f64().is_some_and(|a| (a - b).abs() < 1e-5)
}

/// Every streamed chunk's choice objects, in order.
async fn stream_choices(s: &Server, path: &str, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    s.stream(path, &body)
        .await
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .flat_map(|v| v["choices"].as_array().cloned().unwrap_or_default())
        .collect()
}

#[tokio::test]
async fn chat_logprobs_are_the_log_softmax_of_the_engines_logits_streamed_or_not() {
    let s = start_default().await;
    let mut engine = common::engine();
    let ids = chat_prompt(&engine, "Tell me a story");
    let (tokens, logits) = reference(&mut engine, ids, 6);
    let tok = engine.tokenizer();
    let mut body = chat_body(user("Tell me a story"), 6);
    body["ignore_eos"] = json!(true);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (status, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), tokens.len(), "{v}");
    for (i, e) in content.iter().enumerate() {
        let want = tok.token_bytes(tokens[i]).unwrap();
        assert_eq!(e["bytes"], json!(want), "token {i}: {e}");
        assert!(
            close(&e["logprob"], log_softmax(&logits[i], tokens[i])),
            "{e}"
        );
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token leads the alternatives, which are sorted.
        assert_eq!(top[0]["bytes"], e["bytes"]);
        assert_eq!(top[0]["logprob"], e["logprob"]);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{lps:?}");
    }
    let streamed: Vec<Value> = stream_choices(&s, "/v1/chat/completions", &body)
        .await
        .iter()
        .filter_map(|c| c["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content);
}

#[tokio::test]
async fn completion_logprobs_in_the_legacy_shape_streamed_or_not() {
    let s = start_default().await;
    let mut engine = common::engine();
    let (tokens, logits) = reference(&mut engine, vec![1, 2, 3, 4], 5);
    let body = json!({ "prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0,
        "ignore_eos": true, "logprobs": 2 });
    let (status, v) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let values = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(values.len(), tokens.len(), "{v}");
    for (i, x) in values.iter().enumerate() {
        assert!(close(x, log_softmax(&logits[i], tokens[i])), "{i}: {x}");
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2, "{lp}");
        assert!(
            top.values().any(|t| t == x),
            "the chosen token is in the top: {lp}"
        );
    }
    // Offsets run through the text, from the prompt's end (it is not echoed).
    let tokens_text: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let offsets = lp["text_offset"].as_array().unwrap();
    let prompt_len = engine
        .tokenizer()
        .decode(&[1, 2, 3, 4], false)
        .unwrap()
        .chars()
        .count();
    assert_eq!(offsets[0], prompt_len);
    for i in 1..offsets.len() {
        let step = offsets[i].as_u64().unwrap() - offsets[i - 1].as_u64().unwrap();
        assert_eq!(step as usize, tokens_text[i - 1].chars().count());
    }
    // Streamed: the same columns, chunk by chunk.
    let mut joined =
        json!({ "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [] });
    for c in stream_choices(&s, "/v1/completions", &body).await {
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            if let Some(a) = c["logprobs"][k].as_array() {
                joined[k].as_array_mut().unwrap().extend(a.iter().cloned());
            }
        }
    }
    assert_eq!(&joined, lp);
}

#[tokio::test]
async fn echo_prepends_the_prompt_and_its_logprobs() {
    let s = start_default().await;
    let mut engine = common::engine();
    let prompt = vec![5u32, 6, 7, 8, 9];
    let vocab = engine.model.config.vocab_size;
    let all = engine
        .backend_mut()
        .prefill(1 << 40, &prompt, Logits::All)
        .unwrap();
    let body = json!({ "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true,
        "echo": true, "logprobs": 1 });
    let (status, v) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    let prompt_text = engine.tokenizer().decode(&prompt, false).unwrap();
    assert!(text.starts_with(&prompt_text), "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let values = lp["token_logprobs"].as_array().unwrap();
    assert!(
        values[0].is_null() && lp["top_logprobs"][0].is_null(),
        "{lp}"
    );
    assert_eq!(lp["text_offset"][0], 0);
    for i in 1..prompt.len() {
        let want = log_softmax(&all[(i - 1) * vocab..i * vocab], prompt[i]);
        assert!(close(&values[i], want), "{i}: {lp}");
    }
    assert_eq!(values.len(), prompt.len() + 3);
    // Streamed: the prompt comes first, the whole text and logprobs as without streaming.
    let chunks = stream_choices(&s, "/v1/completions", &body).await;
    assert_eq!(chunks[0]["text"], prompt_text);
    let joined: String = chunks.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(joined, text);
    let streamed: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["logprobs"]["token_logprobs"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, values);
    // Without logprobs, echo is just the text.
    let body = json!({ "prompt": "Once upon", "max_tokens": 2, "temperature": 0, "echo": true });
    let (_, v) = s.post("/v1/completions", &body).await;
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Once upon"),
        "{v}"
    );
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[tokio::test]
async fn logit_bias_bans_and_forces_tokens() {
    let s = start_default().await;
    let mut engine = common::engine();
    let (tokens, _) = reference(&mut engine, vec![1, 2, 3, 4], 4);
    let body = |bias: Value| {
        json!({ "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, "ignore_eos": true,
            "logprobs": 0, "logit_bias": bias })
    };
    let first = |v: &Value| v["choices"][0]["logprobs"]["tokens"][0].clone();
    let (_, plain) = s.post("/v1/completions", &body(json!({}))).await;
    let greedy_text =
        String::from_utf8_lossy(engine.tokenizer().token_bytes(tokens[0]).unwrap()).into_owned();
    assert_eq!(first(&plain), greedy_text.as_str());
    let banned = json!({ tokens[0].to_string(): -100 });
    let (status, v) = s.post("/v1/completions", &body(banned)).await;
    assert_eq!(status, 200, "{v}");
    assert_ne!(first(&v), first(&plain), "{v}");
    // +100 on one token forces it at every step.
    let forced = *engine
        .tokenizer()
        .encode("a", false)
        .unwrap()
        .last()
        .unwrap();
    let forced_text =
        String::from_utf8_lossy(engine.tokenizer().token_bytes(forced).unwrap()).into_owned();
    let (_, v) = s
        .post("/v1/completions", &body(json!({ forced.to_string(): 100 })))
        .await;
    let got = v["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(got.len(), 4, "{v}");
    assert!(got.iter().all(|t| t == forced_text.as_str()), "{v}");
    // Chat too; an id outside the vocabulary is named.
    let mut chat = chat_body(user("hi"), 3);
    chat["logit_bias"] = json!({ forced.to_string(): 100 });
    chat["ignore_eos"] = json!(true);
    let (_, v) = s.post("/v1/chat/completions", &chat).await;
    let m = &v["choices"][0]["message"];
    let all = format!(
        "{}{}",
        m["reasoning_content"].as_str().unwrap_or(""),
        m["content"].as_str().unwrap_or("")
    );
    assert_eq!(all, forced_text.repeat(3), "{v}");
    chat["logit_bias"] = json!({ "1024": 5 });
    let (status, v) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("logit_bias")),
        "{v}"
    );
}

fn texts(v: &Value) -> Vec<String> {
    let choices = v["choices"].as_array().unwrap();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
    }
    choices
        .iter()
        .map(|c| {
            c["text"]
                .as_str()
                .or(c["message"]["content"].as_str())
                .unwrap()
                .to_string()
        })
        .collect()
}

#[tokio::test]
async fn several_prompts_and_n_give_indexed_choices() {
    let s = start_default().await;
    let one =
        |p: &str| json!({ "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": true });
    let mut alone = Vec::new();
    for p in ["Once upon a time", "The cat sat"] {
        let (_, v) = s.post("/v1/completions", &one(p)).await;
        alone.push(texts(&v)[0].clone());
    }
    let mut two = one("");
    two["prompt"] = json!(["Once upon a time", "The cat sat"]);
    let (status, v) = s.post("/v1/completions", &two).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(texts(&v), alone);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    // Two prompts, n = 2: prompt-major order, each prompt's tokens counted once.
    two["n"] = json!(2);
    let (_, v2) = s.post("/v1/completions", &two).await;
    let want = [&alone[0], &alone[0], &alone[1], &alone[1]].map(String::clone);
    assert_eq!(texts(&v2), want);
    assert_eq!(v2["usage"]["prompt_tokens"], v["usage"]["prompt_tokens"]);
    assert_eq!(v2["usage"]["completion_tokens"], 24);
    // Streamed: every choice's text arrives under its index.
    let mut joined = vec![String::new(); 4];
    let mut finished = 0;
    for c in stream_choices(&s, "/v1/completions", &two).await {
        joined[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
        finished += c["finish_reason"].is_string() as usize;
    }
    assert_eq!((joined, finished), (texts(&v2), 4));
}

#[tokio::test]
async fn n_choices_are_identical_greedy_and_reproducible_seeded() {
    let s = start_default().await;
    let mut body = chat_body(user("Say something"), 6);
    body["ignore_eos"] = json!(true);
    body["n"] = json!(3);
    let (status, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let greedy = texts(&v);
    assert_eq!(greedy.len(), 3);
    assert!(greedy.iter().all(|t| t == &greedy[0]), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 18);
    body["temperature"] = json!(1.0);
    body["seed"] = json!(42);
    let (_, a) = s.post("/v1/chat/completions", &body).await;
    let (_, b) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(texts(&a), texts(&b));
    // Choice i samples from seed + i: choice 1 of seed 42 is choice 0 of seed 43.
    body["n"] = json!(1);
    body["seed"] = json!(43);
    let (_, c) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(texts(&c)[0], texts(&a)[1]);
    // Streamed n = 3: each index opens with the role and ends with a finish reason.
    body["n"] = json!(3);
    body["seed"] = json!(42);
    let mut joined = vec![String::new(); 3];
    let mut roles = 0;
    for ch in stream_choices(&s, "/v1/chat/completions", &body).await {
        let i = ch["index"].as_u64().unwrap() as usize;
        roles += ch["delta"]["role"].is_string() as usize;
        joined[i] += ch["delta"]["content"].as_str().unwrap_or("");
    }
    assert_eq!((joined, roles), (texts(&a), 3));
}

/// The serial worker (backends without a batched step) reports what the batch reports.
#[tokio::test]
async fn the_serial_worker_reports_the_same_logprobs_as_the_batch() {
    use q4moe_engine::LogprobOptions;
    use q4moe_server::openai::{GenParams, Prompt};
    use q4moe_server::scheduler::{EngineHandle, JobPrompt};
    let gen = GenParams {
        max_tokens: Some(5),
        max_tokens_param: "max_tokens",
        sampling: SamplingParams {
            temperature: 0.8,
            seed: 9,
            ..SamplingParams::greedy()
        },
        stop: Vec::new(),
        stream: false,
        include_usage: false,
        ignore_eos: true,
        n: 1,
        best_of: 1,
        logprobs: Some(LogprobOptions {
            top: 2,
            prompt: true,
        }),
        echo: true,
        grammar: None,
    };
    let mut got = Vec::new();
    for batch in [None, Some(q4moe_server::BatchOptions::default())] {
        let handle = EngineHandle::spawn(common::engine(), 4, batch).unwrap();
        let prompt = JobPrompt::Completion(Prompt::Tokens(vec![3, 1, 4, 1, 5]));
        let mut t = handle.submit(prompt, gen.clone()).await.unwrap();
        t.started().await.unwrap();
        let c = t.collect_all().await.unwrap();
        assert_eq!(c.prompt_logprobs.len(), 5);
        assert!(!c.logprobs.is_empty());
        got.push((c.text, c.logprobs, c.prompt_logprobs));
    }
    assert_eq!(got[0], got[1]);
}
