//! Structured output and tool calls through the real server over a random-weight model: the
//! constraint alone must make its output valid (the model knows nothing), and calls must come
//! back in OpenAI's shapes, streamed or not.

mod common;

use common::{chat_body, start_roomy, user, Server};
use serde_json::{json, Value};

/// The JSON schema subset these tests use: type, properties, required, additionalProperties,
/// items, enum, const, maxLength, maxItems, minimum, maximum. Returns what is wrong, if anything.
fn violation(schema: &Value, v: &Value, at: &str) -> Option<String> {
    let fail = |what: &str| Some(format!("{at}: {what} ({v})"));
    if let Some(c) = schema.get("const") {
        return (c != v).then(|| format!("{at}: not {c}"))?.into();
    }
    if let Some(Value::Array(e)) = schema.get("enum") {
        if !e.contains(v) {
            return fail("not in the enum");
        }
    }
    let ty = schema.get("type").and_then(Value::as_str);
    match (ty, v) {
        (None, _) => None,
        (Some("string"), Value::String(s)) => {
            let max = schema.get("maxLength").and_then(Value::as_u64);
            max.filter(|&m| s.chars().count() as u64 > m)
                .and_then(|_| fail("too long"))
        }
        (Some("boolean"), Value::Bool(_)) => None,
        (Some("integer"), Value::Number(n)) if n.is_i64() || n.is_u64() => {
            let x = n.as_f64().unwrap();
            let lo = schema.get("minimum").and_then(Value::as_f64);
            let hi = schema.get("maximum").and_then(Value::as_f64);
            (lo.is_some_and(|l| x < l) || hi.is_some_and(|h| x > h))
                .then(|| format!("{at}: {x} out of range"))
        }
        (Some("array"), Value::Array(items)) => {
            let max = schema.get("maxItems").and_then(Value::as_u64);
            if max.is_some_and(|m| items.len() as u64 > m) {
                return fail("too many items");
            }
            let item = schema.get("items").cloned().unwrap_or(json!({}));
            items
                .iter()
                .enumerate()
                .find_map(|(i, x)| violation(&item, x, &format!("{at}[{i}]")))
        }
        (Some("object"), Value::Object(o)) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let required = schema.get("required").and_then(Value::as_array);
            if let Some(r) = required
                .into_iter()
                .flatten()
                .find(|r| !o.contains_key(r.as_str().unwrap()))
            {
                return fail(&format!("missing {r}"));
            }
            let closed = schema.get("additionalProperties") == Some(&json!(false));
            o.iter()
                .find_map(|(k, x)| match props.and_then(|p| p.get(k)) {
                    Some(s) => violation(s, x, &format!("{at}.{k}")),
                    None if closed => Some(format!("{at}: unexpected {k}")),
                    None => None,
                })
        }
        (Some(t), _) => fail(&format!("not a {t}")),
    }
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": { "type": "string", "maxLength": 12 },
            "age": { "type": "integer", "minimum": 0, "maximum": 120 },
            "member": { "type": "boolean" },
            "tags": { "type": "array", "items": { "enum": ["red", "green", "blue"] }, "maxItems": 3 },
        },
        "required": ["name", "age", "member", "tags"],
        "additionalProperties": false,
    })
}

/// Short, so the tools fit the tiny model's context beside the template's preamble.
fn weather_tools() -> Value {
    json!([
        { "type": "function", "function": { "name": "weather", "parameters": { "type": "object",
            "properties": { "city": { "type": "string", "maxLength": 8 } }, "required": ["city"],
            "additionalProperties": false } } },
        { "type": "function", "function": { "name": "clock", "parameters": { "type": "object",
            "properties": { "tz": { "enum": ["utc", "local"] } }, "required": ["tz"],
            "additionalProperties": false } } },
    ])
}

fn params_of(tools: &Value, name: &str) -> Value {
    tools
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == name)
        .map(|t| t["function"]["parameters"].clone())
        .unwrap_or_else(|| panic!("no tool {name}"))
}

async fn chat(s: &Server, body: &Value) -> Value {
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{v}");
    v
}

#[tokio::test]
async fn json_schema_output_validates_whatever_the_sampling() {
    let s = start_roomy().await;
    let schema = person_schema();
    for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.0, 2)] {
        let mut body = chat_body(user("Describe a person."), 300);
        body["temperature"] = json!(temperature);
        body["seed"] = json!(seed);
        body["response_format"] = json!({ "type": "json_schema",
            "json_schema": { "name": "person", "strict": true, "schema": schema } });
        let v = chat(&s, &body).await;
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{v}");
        let content = choice["message"]["content"].as_str().unwrap();
        let out: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
        assert_eq!(violation(&schema, &out, "$"), None, "{content}");
    }
    // The same through /v1/completions, and llama-server's GBNF grammar.
    let body = json!({ "prompt": "The answer is", "max_tokens": 20, "temperature": 1.0, "seed": 3,
        "grammar": "root ::= (\"yes\" | \"no\") \"!\"" });
    let (status, v) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text == "yes!" || text == "no!", "{text:?}");
}

/// Any object: a random model may write one string for ever (a tiny vocabulary has few
/// tokens with a quote), so an answer may run out of tokens; then it must be a prefix of an
/// object (serde_json stops at the end of the input, not at a syntax error), else an object.
#[tokio::test]
async fn json_object_output_parses_as_an_object() {
    let s = start_roomy().await;
    for seed in 0..3 {
        let mut body = chat_body(user("Any JSON."), 100);
        body["response_format"] = json!({ "type": "json_object" });
        body["temperature"] = json!(1.0);
        body["seed"] = json!(seed);
        let v = chat(&s, &body).await;
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        match serde_json::from_str::<Value>(content) {
            Ok(out) => {
                assert!(out.is_object(), "{content}");
                assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
            }
            Err(e) => {
                assert!(e.is_eof() && content.starts_with('{'), "{e}: {content}");
                assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
            }
        }
    }
}

fn required_call_body(stream: bool) -> Value {
    let mut body = chat_body(user("Weather?"), 80);
    body["tools"] = weather_tools();
    body["tool_choice"] = json!("required");
    body["parallel_tool_calls"] = json!(false);
    body["stream"] = json!(stream);
    body
}

#[tokio::test]
async fn required_tool_choice_returns_a_call_matching_the_schema() {
    let s = start_roomy().await;
    let tools = weather_tools();
    let v = chat(&s, &required_call_body(false)).await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], Value::Null, "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let call = &calls[0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    let name = call["function"]["name"].as_str().unwrap();
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(violation(&params_of(&tools, name), &args, name), None);

    // A named function is the one called.
    let mut body = required_call_body(false);
    body["tool_choice"] = json!({ "type": "function", "function": { "name": "clock" } });
    body["temperature"] = json!(1.0);
    body["seed"] = json!(9);
    let v = chat(&s, &body).await;
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "clock", "{v}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(violation(&params_of(&tools, "clock"), &args, "clock"), None);
}

#[tokio::test]
async fn streamed_tool_calls_reassemble_to_the_non_streamed_ones() {
    let s = start_roomy().await;
    let whole = chat(&s, &required_call_body(false)).await;
    let want = &whole["choices"][0]["message"]["tool_calls"];
    let mut calls: Vec<Value> = Vec::new();
    let mut finish = Value::Null;
    for d in s
        .stream("/v1/chat/completions", &required_call_body(true))
        .await
    {
        if d == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&d).unwrap();
        let choice = &chunk["choices"][0];
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
        // As the openai client does: by index, the head then the argument fragments.
        for part in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = part["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                calls.push(json!({ "id": part["id"], "type": part["type"],
                    "function": { "name": part["function"]["name"], "arguments": "" } }));
            }
            let frag = part["function"]["arguments"].as_str().unwrap_or_default();
            let args = calls[i]["function"]["arguments"]
                .as_str()
                .unwrap()
                .to_string()
                + frag;
            calls[i]["function"]["arguments"] = json!(args);
        }
    }
    assert_eq!(finish, "tool_calls");
    assert_eq!(calls.len(), want.as_array().unwrap().len());
    for (got, want) in calls.iter().zip(want.as_array().unwrap()) {
        assert_eq!(got["function"], want["function"]);
        assert!(got["id"].as_str().unwrap().starts_with("call_") && got["type"] == "function");
    }
}

/// Each of `n` choices is read for calls, whole and streamed (chunks carry their choice's index).
#[tokio::test]
async fn every_choice_of_n_is_read_for_calls() {
    let s = start_roomy().await;
    let mut body = required_call_body(false);
    body["n"] = json!(2);
    body["temperature"] = json!(1.0);
    body["seed"] = json!(4);
    let v = chat(&s, &body).await;
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert_eq!(
            c["message"]["tool_calls"].as_array().unwrap().len(),
            1,
            "{v}"
        );
    }
    body["stream"] = json!(true);
    let mut heads = [0, 0];
    let mut finishes = [Value::Null, Value::Null];
    for d in s.stream("/v1/chat/completions", &body).await {
        let Ok(chunk) = serde_json::from_str::<Value>(&d) else {
            continue;
        };
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        heads[i] += c["delta"]["tool_calls"][0]["id"].is_string() as usize;
        if !c["finish_reason"].is_null() {
            finishes[i] = c["finish_reason"].clone();
        }
    }
    assert_eq!(heads, [1, 1]);
    assert_eq!(finishes, [json!("tool_calls"), json!("tool_calls")]);
}

/// Anthropic's tools (`input_schema`, `tool_choice: any`) through the same constraint: the
/// answer is a `tool_use` block whose input matches the schema, streamed as the same input.
#[tokio::test]
async fn anthropic_tools_answer_with_tool_use_blocks() {
    let s = start_roomy().await;
    let openai = weather_tools();
    let tools: Vec<Value> = openai
        .as_array()
        .unwrap()
        .iter()
        .map(|t| json!({ "name": t["function"]["name"], "input_schema": t["function"]["parameters"] }))
        .collect();
    let body = |stream: bool| {
        json!({ "model": "tiny", "max_tokens": 80, "temperature": 0, "stream": stream,
            "messages": [{ "role": "user", "content": "Weather?" }], "tools": tools,
            "tool_choice": { "type": "any", "disable_parallel_tool_use": true } })
    };
    let (status, v) = s.post("/v1/messages", &body(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let uses: Vec<&Value> = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect();
    assert_eq!(uses.len(), 1, "{v}");
    let name = uses[0]["name"].as_str().unwrap();
    assert!(uses[0]["id"].as_str().unwrap().starts_with("toolu_"));
    let input = &uses[0]["input"];
    assert_eq!(
        violation(&params_of(&openai, name), input, name),
        None,
        "{v}"
    );

    let (mut streamed, mut partial, mut reason) = (Value::Null, String::new(), Value::Null);
    for d in s.stream("/v1/messages", &body(true)).await {
        let e: Value = serde_json::from_str(&d).unwrap();
        match e["type"].as_str().unwrap() {
            "content_block_start" if e["content_block"]["type"] == "tool_use" => {
                streamed = e["content_block"].clone()
            }
            "content_block_delta" if e["delta"]["type"] == "input_json_delta" => {
                partial += e["delta"]["partial_json"].as_str().unwrap()
            }
            "message_delta" => reason = e["delta"]["stop_reason"].clone(),
            _ => {}
        }
    }
    assert_eq!(streamed["name"], name);
    assert_eq!(&serde_json::from_str::<Value>(&partial).unwrap(), input);
    assert_eq!(reason, "tool_use");
}

#[tokio::test]
async fn tools_and_tool_results_reach_the_prompt() {
    let s = start_roomy().await;
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    let question = user("Weather?");
    let plain = chat(&s, &chat_body(question.clone(), 1)).await;
    let mut body = chat_body(question.clone(), 1);
    body["tools"] = weather_tools();
    let with_tools = chat(&s, &body).await;
    assert!(
        tokens(&with_tools) > tokens(&plain) + 50,
        "the tools are not in the prompt"
    );
    let turn = |result: &str| {
        let mut m = question.as_array().unwrap().clone();
        m.push(
            json!({ "role": "assistant", "content": null, "tool_calls": [{ "id": "call_1",
            "type": "function", "function": { "name": "weather",
            "arguments": "{\"city\": \"Paris\"}" } }] }),
        );
        m.push(json!({ "role": "tool", "tool_call_id": "call_1", "content": result }));
        let mut b = chat_body(Value::Array(m), 1);
        b["tools"] = weather_tools();
        b
    };
    let short = chat(&s, &turn("sunny")).await;
    let long = chat(&s, &turn("sunny, 21 degrees, some wind")).await;
    assert!(
        tokens(&short) > tokens(&with_tools) + 10,
        "the call is not in the prompt"
    );
    assert!(
        tokens(&long) > tokens(&short) + 5,
        "the tool result is not in the prompt"
    );
}

#[tokio::test]
async fn bad_schemas_and_grammars_are_400_naming_the_field() {
    let s = start_roomy().await;
    let with = |extra: Value| {
        let mut b = chat_body(user("hi"), 5);
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let schema = |s: Value| {
        json!({ "response_format": { "type": "json_schema",
        "json_schema": { "name": "x", "schema": s } } })
    };
    let cases = [
        (schema(json!({ "type": "strnig" })), "response_format"),
        (
            schema(json!({ "$ref": "#/$defs/missing" })),
            "response_format",
        ),
        (json!({ "grammar": "start: undefined_rule" }), "grammar"),
        (json!({ "grammar": "root ::= [a-z" }), "grammar"),
        (
            json!({ "tools": [{ "type": "function", "function": { "name": "f",
                "parameters": { "type": "object", "properties": { "a": { "type": "nope" } } } } }],
                "tool_choice": "required" }),
            "tools",
        ),
    ];
    for (extra, field) in cases {
        let (status, v) = s.post("/v1/chat/completions", &with(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
}
