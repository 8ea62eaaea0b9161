//! Anthropic's Messages API, `POST /v1/messages` (and `/v1/messages/count_tokens`), over the same
//! engine path as OpenAI's chat endpoint: the request becomes chat messages, rendered with the
//! model's template off the engine thread, under the same limits and batching.
//!
//! Mapping: `system` (a string or text blocks) opens the conversation; `text` blocks are the
//! message text; an assistant's `tool_use` blocks become the template's tool calls and a user's
//! `tool_result` blocks its `tool` messages; an assistant's `thinking` block its reasoning.
//! Image and document blocks are refused (the model reads text only). `tools` and `tool_choice`
//! are the chat endpoint's (anthropic_tools.rs); calls in the answer come back as `tool_use`
//! blocks with `stop_reason: "tool_use"`. The model's reasoning, when it writes one, comes back
//! as a `thinking` block before the `text` block.
//!
//! Usage: `input_tokens` counts the whole prompt; `cache_read_input_tokens` the part of it whose
//! KV was reused from an earlier request.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use q4moe_engine::{ChatMessage, SamplingParams, ToolCall};
use serde_json::{json, Value};

use crate::anthropic_shape::{error_response, message_json, stop_reason};
use crate::errors::ApiError;
use crate::fields::{in_range, opt_bool, opt_f32, opt_str, opt_uint, parse_body, present, Obj};
use crate::openai::{self, fresh_seed, GenParams, Meta};
use crate::routes::{body_bytes, App};
use crate::scheduler::JobPrompt;
use crate::tool_markup;
use crate::tools::Tools;

/// A parsed `/v1/messages` request.
#[derive(Debug, Clone)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub enable_thinking: Option<bool>,
    pub tools: Option<Tools>,
    pub gen: GenParams,
}

pub async fn messages(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(app, body).await.unwrap_or_else(error_response)
}

async fn respond(app: App, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = messages_request(&parse_body(&body_bytes(body)?)?)?;
    app.check_model(req.model.as_deref())?;
    app.check_max_tokens(&req.gen)?;
    let stream = req.gen.stream;
    let parse_calls = req.tools.as_ref().is_some_and(Tools::parses_calls);
    let prompt = JobPrompt::Chat {
        messages: req.messages,
        enable_thinking: req.enable_thinking,
        tools: req.tools.map(|t| t.list),
    };
    let mut ticket = app.engine.submit(prompt, req.gen).await?;
    let started = ticket.started().await?;
    let meta = Meta::new("msg", &app.model_name);
    if stream {
        return Ok(crate::anthropic_sse::stream(
            meta,
            started,
            ticket,
            parse_calls,
        ));
    }
    let c = ticket.collect_all().await?;
    let (reasoning, text) = q4moe_tokenizer::split_whole(&c.text, started.think_open);
    let (text, calls): (Option<String>, Vec<ToolCall>) = match parse_calls {
        true => tool_markup::parse_whole(&text),
        false => (Some(text), Vec::new()),
    };
    let reason = stop_reason(c.finish, c.stop_sequence.as_deref(), calls.len());
    let body = message_json(
        &meta,
        reasoning.as_deref(),
        text.as_deref().unwrap_or_default(),
        &calls,
        reason,
        c.stop_sequence.as_deref(),
        &c.usage,
    );
    Ok(Json(body).into_response())
}

/// `POST /v1/messages/count_tokens`: the prompt's length as `/v1/messages` would build it.
pub async fn count_tokens(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    count(app, body).await.unwrap_or_else(error_response)
}

async fn count(app: App, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let mut o = parse_body(&body_bytes(body)?)?;
    // count_tokens takes no max_tokens; the rest of the request is read as /v1/messages reads it.
    o.insert("max_tokens".into(), json!(1));
    let req = messages_request(&o)?;
    app.check_model(req.model.as_deref())?;
    let n = app
        .engine
        .count_chat_tokens(req.messages, req.tools.map(|t| t.list), req.enable_thinking)
        .await?;
    Ok(Json(json!({ "input_tokens": n })).into_response())
}

/// Reads a `/v1/messages` body field by field, naming the field at fault in every refusal.
pub fn messages_request(o: &Obj) -> Result<MessagesRequest, ApiError> {
    let tools = crate::anthropic_tools::parse(o)?;
    let mut messages = system(o)?;
    let items = openai::messages_array(o)?;
    for (i, m) in items.iter().enumerate() {
        message(i, m, &mut messages)?;
    }
    if messages.last().is_some_and(|m| m.role == "assistant") {
        return Err(ApiError::invalid(
            format!("messages[{}].role", items.len() - 1),
            "a final assistant message (a prefilled answer) is not supported; end with a user message",
        ));
    }
    let mut gen = gen_params(o)?;
    gen.grammar = tools.as_ref().and_then(Tools::grammar);
    let mut enable_thinking = q4moe_tokenizer::thinking_switch(&messages, thinking(o)?);
    // A forced call skips the think block unless thinking was asked for, as on the chat
    // endpoint (then the grammar starts after it).
    if gen.grammar.is_some() && enable_thinking.is_none() {
        enable_thinking = Some(false);
    }
    Ok(MessagesRequest {
        model: opt_str(o, "model")?,
        enable_thinking,
        messages,
        tools,
        gen,
    })
}

/// `thinking: {"type": "enabled" | "disabled"}` switches the template's thinking (Qwen3's
/// `enable_thinking`); `budget_tokens` is not enforced (thinking counts against `max_tokens`).
fn thinking(o: &Obj) -> Result<Option<bool>, ApiError> {
    let Some(t) = present(o, "thinking") else {
        return Ok(None);
    };
    match t.get("type").and_then(Value::as_str) {
        Some("enabled") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        _ => Err(ApiError::invalid(
            "thinking",
            "'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}",
        )),
    }
}

fn gen_params(o: &Obj) -> Result<GenParams, ApiError> {
    let max = opt_uint(o, "max_tokens")?
        .ok_or_else(|| ApiError::invalid("max_tokens", "'max_tokens' is required"))?;
    if max == 0 {
        return Err(ApiError::invalid(
            "max_tokens",
            "'max_tokens' must be at least 1",
        ));
    }
    let f = |name, default: f32, lo, hi, open| -> Result<f32, ApiError> {
        opt_f32(o, name)?.map_or(Ok(default), |v| in_range(name, v, lo, hi, open))
    };
    let d = SamplingParams::default();
    // Anthropic's temperature default is 1 (its range is [0, 1]; up to 2 is accepted here).
    let sampling = SamplingParams {
        temperature: f("temperature", 1.0, 0.0, 2.0, false)?,
        top_p: f("top_p", d.top_p, 0.0, 1.0, true)?,
        top_k: opt_uint(o, "top_k")?.map_or(d.top_k, |k| k as usize),
        seed: fresh_seed(),
        ..d
    };
    Ok(GenParams {
        max_tokens: Some(max.min(usize::MAX as u64) as usize),
        max_tokens_param: "max_tokens",
        sampling,
        stop: stop_sequences(o)?,
        stream: opt_bool(o, "stream")?.unwrap_or(false),
        include_usage: false,
        // Extension (as on the OpenAI endpoints): keep going past end-of-sequence.
        ignore_eos: opt_bool(o, "ignore_eos")?.unwrap_or(false),
        // The Messages API has one answer a request and no logprobs or echo.
        n: 1,
        best_of: 1,
        logprobs: None,
        echo: false,
        grammar: None,
    })
}

fn stop_sequences(o: &Obj) -> Result<Vec<String>, ApiError> {
    openai::string_list(o, "stop_sequences", false)
}

/// `system`: a string or an array of text blocks; the opening system message, if any.
fn system(o: &Obj) -> Result<Vec<ChatMessage>, ApiError> {
    let text = match present(o, "system") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .enumerate()
            .map(|(j, b)| match b.get("type").and_then(Value::as_str) {
                Some("text") => text_of(b, &format!("system[{j}]")),
                _ => Err(ApiError::invalid(
                    format!("system[{j}]"),
                    "'system' blocks must be text blocks",
                )),
            })
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        Some(_) => {
            return Err(ApiError::invalid(
                "system",
                "'system' must be a string or an array of text blocks",
            ))
        }
    };
    Ok((!text.is_empty())
        .then(|| ChatMessage::system(text))
        .into_iter()
        .collect())
}

fn text_of(block: &Value, at: &str) -> Result<String, ApiError> {
    block
        .get("text")
        .and_then(Value::as_str)
        .map(String::from)
        .ok_or_else(|| {
            ApiError::invalid(format!("{at}.text"), "a text block needs a string 'text'")
        })
}

/// One Anthropic message as chat messages: a user's `tool_result` blocks become `tool`
/// messages (before its text, which the template puts in a turn of its own).
fn message(i: usize, v: &Value, out: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
    let at = |f: &str| format!("messages[{i}].{f}");
    let role = match v.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(ApiError::invalid(
                at("role"),
                "'role' must be user or assistant",
            ))
        }
    };
    let blocks = match v.get("content") {
        Some(Value::String(s)) => {
            out.push(ChatMessage::new(role, s.clone()));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(ApiError::invalid(
                at("content"),
                "'content' must be a string or an array of content blocks",
            ))
        }
    };
    let mut turn = ChatMessage::new(role, "");
    let mut texts = Vec::new();
    let before = out.len();
    for (j, b) in blocks.iter().enumerate() {
        let at = at(&format!("content[{j}]"));
        block(role, b, &at, &mut turn, &mut texts, out)?;
    }
    turn.content = texts.concat();
    // A user message of tool results alone is those results; no empty user turn after them.
    if !(out.len() > before && turn.content.is_empty()) {
        out.push(turn);
    }
    Ok(())
}

/// One content block into the turn being built (or, for a tool result, a message of its own).
fn block(
    role: &str,
    b: &Value,
    at: &str,
    turn: &mut ChatMessage,
    texts: &mut Vec<String>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
    match (role, kind) {
        (_, "text") => texts.push(text_of(b, at)?),
        (_, "image" | "document") => {
            return Err(ApiError::invalid(
                format!("{at}.type"),
                format!("'{kind}' blocks are not supported: this model reads text only"),
            ))
        }
        ("assistant", "tool_use") => turn.tool_calls.push(tool_use(b, at)?),
        ("assistant", "thinking") => {
            turn.reasoning_content = b.get("thinking").and_then(Value::as_str).map(String::from)
        }
        ("assistant", "redacted_thinking") => {}
        ("user", "tool_result") => out.push(tool_result(b, at)?),
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.type"),
                format!("a {role} message cannot hold a '{kind}' block"),
            ))
        }
    }
    Ok(())
}

fn tool_use(b: &Value, at: &str) -> Result<ToolCall, ApiError> {
    let field = |f: &str| {
        b.get(f).and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                format!("{at}.{f}"),
                format!("a tool_use block needs a string '{f}'"),
            )
        })
    };
    let input = match b.get("input") {
        Some(v @ Value::Object(_)) => v.clone(),
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.input"),
                "a tool_use block needs an object 'input'",
            ))
        }
    };
    Ok(ToolCall::function(field("id")?, field("name")?, input))
}

/// A tool result as the template's `tool` message; an error result is marked as one in its text.
fn tool_result(b: &Value, at: &str) -> Result<ChatMessage, ApiError> {
    let id = b
        .get("tool_use_id")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ApiError::invalid(
                format!("{at}.tool_use_id"),
                "a tool_result block needs a string 'tool_use_id'",
            )
        })?;
    let text = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(k, p)| match p.get("type").and_then(Value::as_str) {
                Some("text") => text_of(p, &format!("{at}.content[{k}]")),
                other => Err(ApiError::invalid(
                    format!("{at}.content[{k}].type"),
                    format!(
                        "a tool_result may hold only text blocks, not {}",
                        other.unwrap_or("untyped")
                    ),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?
            .concat(),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                "a tool_result's 'content' must be a string or an array of text blocks",
            ))
        }
    };
    let is_error = b.get("is_error").and_then(Value::as_bool).unwrap_or(false);
    let mut m = ChatMessage::new(
        "tool",
        if is_error {
            format!("Error: {text}")
        } else {
            text
        },
    );
    m.tool_call_id = Some(id.to_string());
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Result<MessagesRequest, ApiError> {
        messages_request(v.as_object().unwrap())
    }

    #[test]
    fn blocks_map_to_chat_messages() {
        let r = req(json!({
            "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "look it up", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "Thanks"}]},
            ],
        }))
        .unwrap();
        let roles: Vec<_> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(r.messages[1].content, "Weather in Paris?");
        let a = &r.messages[2];
        assert_eq!(
            (a.content.as_str(), a.reasoning_content.as_deref()),
            ("Checking.", Some("look it up"))
        );
        assert_eq!(a.tool_calls[0].function.name, "weather");
        assert_eq!(a.tool_calls[0].function.arguments, json!({"city": "Paris"}));
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(r.messages[3].content, "sunny");
        assert_eq!(r.gen.max_tokens, Some(8));
        assert_eq!(r.gen.sampling.temperature, 1.0);
    }

    #[test]
    fn refusals_name_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({"messages": user}), "max_tokens"),
            (json!({"max_tokens": 0, "messages": user}), "max_tokens"),
            (json!({"max_tokens": 5}), "messages"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]}),
                "messages[1].role",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "temperature": 3}),
                "temperature",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "stop_sequences": "x"}),
                "stop_sequences",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": [{"type": "bash_20250124", "name": "bash"}]}),
                "tools[0].type",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "system": 3}),
                "system",
            ),
        ];
        for (body, field) in cases {
            let e = req(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
    }
}
