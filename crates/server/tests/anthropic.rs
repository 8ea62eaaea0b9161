//! Anthropic's Messages API on the real server (tiny synthetic model, CPU): the response shape,
//! the stream's events and their text against the whole response, errors in Anthropic's shape,
//! `x-api-key`.

mod common;

use common::{start, start_default, Server};
use q4moe_server::ServeConfig;
use serde_json::{json, Value};

fn body(text: &str, max_tokens: usize) -> Value {
    json!({
        "model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        "system": "Be brief.",
        "messages": [{ "role": "user", "content": [{ "type": "text", "text": text }] }],
    })
}

/// Posts a streaming request; returns each event's name and data.
async fn events(s: &Server, body: &Value) -> Vec<(String, Value)> {
    let r = s
        .http
        .post(format!("{}/v1/messages", s.base))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_string(), serde_json::from_str(data).unwrap()))
        })
        .collect()
}

/// The text of the blocks of one kind in a whole response.
fn block_text(v: &Value, kind: &str) -> String {
    v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == kind)
        .map(|b| b[kind].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn messages_has_anthropic_shape() {
    let s = start_default().await;
    let (status, v) = s.post("/v1/messages", &body("Hello there", 6)).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("msg-"), "{v}");
    assert_eq!(
        (&v["type"], &v["role"], &v["model"]),
        (&json!("message"), &json!("assistant"), &json!("tiny"))
    );
    let blocks = v["content"].as_array().unwrap();
    assert_eq!(blocks.last().unwrap()["type"], "text");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["stop_sequence"], Value::Null);
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 5);
    assert_eq!(v["usage"]["output_tokens"], 6);
}

#[tokio::test]
async fn streamed_events_follow_anthropics_sequence_and_match_the_whole_text() {
    let s = start_default().await;
    let mut b = body("Tell me a story", 8);
    let (_, whole) = s.post("/v1/messages", &b).await;
    b["stream"] = json!(true);
    let ev = events(&s, &b).await;
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    assert_eq!(names[names.len() - 3], "content_block_stop");
    for (n, d) in &ev {
        assert_eq!(d["type"], n.as_str(), "event name and data type agree");
    }
    let start = &ev[0].1["message"];
    assert_eq!(start["role"], "assistant");
    assert_eq!(
        start["usage"]["input_tokens"],
        whole["usage"]["input_tokens"]
    );
    // Blocks open and close in order, one at a time, each delta inside its block.
    let mut open: Option<u64> = None;
    let mut next = 0;
    let (mut text, mut thinking) = (String::new(), String::new());
    for (n, d) in &ev[1..ev.len() - 2] {
        match n.as_str() {
            "content_block_start" => {
                assert_eq!((open, d["index"].as_u64()), (None, Some(next)));
                open = Some(next);
                next += 1;
            }
            "content_block_delta" => {
                assert_eq!(d["index"].as_u64(), open);
                match d["delta"]["type"].as_str().unwrap() {
                    "text_delta" => text += d["delta"]["text"].as_str().unwrap(),
                    "thinking_delta" => thinking += d["delta"]["thinking"].as_str().unwrap(),
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(d["index"].as_u64(), open);
                open = None;
            }
            "ping" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    assert!(next >= 1, "at least the text block");
    assert_eq!(text, block_text(&whole, "text"));
    assert_eq!(thinking, block_text(&whole, "thinking"));
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], whole["stop_reason"]);
    assert_eq!(delta["usage"]["output_tokens"], 8);
}

#[tokio::test]
async fn stop_sequences_end_the_text_and_are_named() {
    let s = start_default().await;
    let (_, g) = s.post("/v1/messages", &body("Once upon a time", 12)).await;
    let text = block_text(&g, "text");
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(3).collect();
    let mut b = body("Once upon a time", 12);
    b["stop_sequences"] = json!(["\u{1}never", stop]);
    let (status, v) = s.post("/v1/messages", &b).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], json!(stop));
    assert_eq!(block_text(&v, "text"), &text[..text.find(&stop).unwrap()]);
}

#[tokio::test]
async fn tool_use_and_tool_result_blocks_reach_the_template() {
    let s = start_default().await;
    let mut b = body("Weather in Paris?", 2);
    let (_, plain) = s.post("/v1/messages/count_tokens", &b).await;
    b["messages"] = json!([
        { "role": "user", "content": "Weather in Paris?" },
        { "role": "assistant", "content": [
            { "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": { "city": "Paris" } } ] },
        { "role": "user", "content": [
            { "type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny" } ] },
    ]);
    let (_, with_tools) = s.post("/v1/messages/count_tokens", &b).await;
    let (n0, n1) = (
        plain["input_tokens"].as_u64().unwrap(),
        with_tools["input_tokens"].as_u64().unwrap(),
    );
    // The call's markup and the tool response make the prompt longer.
    assert!(n1 > n0 + 10, "{n0} -> {n1}");
    let (status, v) = s.post("/v1/messages", &b).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["input_tokens"].as_u64(), Some(n1));
}

async fn expect_error(s: &Server, r: reqwest::RequestBuilder, status: u16, kind: &str) -> String {
    let _ = s;
    let r = r.send().await.unwrap();
    assert_eq!(r.status().as_u16(), status);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    v["error"]["message"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn errors_have_anthropics_shape() {
    let s = start_default().await;
    let url = format!("{}/v1/messages", s.base);
    let mut no_max = body("hi", 4);
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let m = expect_error(
        &s,
        s.http.post(&url).json(&no_max),
        400,
        "invalid_request_error",
    )
    .await;
    assert!(m.contains("max_tokens"), "{m}");
    let mut image = body("hi", 4);
    image["messages"][0]["content"] = json!([{ "type": "image", "source": { "type": "base64", "media_type": "image/png", "data": "" } }]);
    let m = expect_error(
        &s,
        s.http.post(&url).json(&image),
        400,
        "invalid_request_error",
    )
    .await;
    assert!(m.contains("image"), "{m}");
    let mut model = body("hi", 4);
    model["model"] = json!("claude-x");
    expect_error(&s, s.http.post(&url).json(&model), 404, "not_found_error").await;
    // Answered by the shared layers, reshaped for this path.
    expect_error(&s, s.http.get(&url), 405, "invalid_request_error").await;
    expect_error(
        &s,
        s.http.post(&url).body("{"),
        400,
        "invalid_request_error",
    )
    .await;
    let form = s
        .http
        .post(&url)
        .header("content-type", "text/plain")
        .body("{}");
    expect_error(&s, form, 415, "invalid_request_error").await;
}

#[tokio::test]
async fn x_api_key_is_accepted_as_well_as_bearer() {
    let s = start(ServeConfig {
        model_name: "tiny".into(),
        api_key: Some("sekret".into()),
        ..Default::default()
    })
    .await;
    let url = format!("{}/v1/messages", s.base);
    let b = body("hi", 2);
    expect_error(&s, s.http.post(&url).json(&b), 401, "authentication_error").await;
    let wrong = s.http.post(&url).header("x-api-key", "nope").json(&b);
    expect_error(&s, wrong, 401, "authentication_error").await;
    for r in [
        s.http.post(&url).header("x-api-key", "sekret"),
        s.http.post(&url).bearer_auth("sekret"),
    ] {
        let r = r
            .header("anthropic-version", "2023-06-01")
            .json(&b)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let tok = s
        .http
        .post(format!("{}/tokenize", s.base))
        .header("x-api-key", "sekret");
    let r = tok.json(&json!({ "content": "hi" })).send().await.unwrap();
    assert_eq!(r.status(), 200);
}
