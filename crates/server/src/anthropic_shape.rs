//! Anthropic's response shapes: the whole message, `usage`, `stop_reason`, and errors as
//! `{"type": "error", "error": {"type", "message"}}`, also for the errors the shared layers
//! answer in OpenAI's shape on Anthropic's paths.

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use q4moe_engine::{Finish, ToolCall};
use serde_json::{json, Value};

use crate::errors::ApiError;
use crate::openai::{Meta, Usage};

/// Anthropic's `stop_reason` for how a generation ended (`tool_calls`: the calls it made); a
/// cancelled one reads as a turn's end.
pub fn stop_reason(finish: Finish, stop_sequence: Option<&str>, tool_calls: usize) -> &'static str {
    match (finish, stop_sequence, tool_calls) {
        (Finish::Length, ..) => "max_tokens",
        (Finish::Stop, Some(_), _) => "stop_sequence",
        (Finish::Stop, None, 1..) => "tool_use",
        _ => "end_turn",
    }
}

/// The `usage` object: the prompt whole, its reused part, and the generated tokens.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// A whole (non-streamed) response: thinking, text (left out when empty beside tool calls),
/// then a `tool_use` block per call.
pub fn message_json(
    meta: &Meta,
    reasoning: Option<&str>,
    text: &str,
    calls: &[ToolCall],
    reason: &str,
    stop_sequence: Option<&str>,
    usage: &Usage,
) -> Value {
    let mut content = Vec::new();
    if let Some(r) = reasoning.filter(|r| !r.is_empty()) {
        content.push(json!({ "type": "thinking", "thinking": r, "signature": "" }));
    }
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({ "type": "text", "text": text }));
    }
    content.extend(calls.iter().map(crate::anthropic_tools::tool_use));
    json!({
        "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
        "content": content, "stop_reason": reason, "stop_sequence": stop_sequence,
        "usage": usage_json(usage),
    })
}

/// Anthropic's error type for a status.
fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500.. => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(e: &ApiError) -> Value {
    json!({ "type": "error", "error": { "type": error_type(e.status.as_u16()), "message": e.message } })
}

/// Rewrites an error the shared layers answered in OpenAI's shape (a missing key, 405, 415,
/// 413, 408, an unknown path under `/v1/messages`) into Anthropic's, for Anthropic's paths.
pub async fn reshape_errors(req: Request, next: Next) -> Response {
    let ours = req.uri().path().starts_with("/v1/messages");
    let r = next.run(req).await;
    if !ours || r.status().is_success() {
        return r;
    }
    let (mut parts, body) = r.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if v.get("type").and_then(Value::as_str) == Some("error") {
        return Response::from_parts(parts, axum::body::Body::from(bytes));
    }
    let message = v["error"]["message"]
        .as_str()
        .or(parts.status.canonical_reason())
        .unwrap_or("error")
        .to_string();
    let body = json!({ "type": "error", "error": { "type": error_type(parts.status.as_u16()), "message": message } });
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, axum::body::Body::from(body.to_string()))
}

pub fn error_response(e: ApiError) -> Response {
    let mut r = (e.status, Json(error_body(&e))).into_response();
    if let Some(secs) = e.retry_after {
        r.headers_mut().insert(header::RETRY_AFTER, secs.into());
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_reasons_and_error_shape() {
        assert_eq!(stop_reason(Finish::Stop, None, 0), "end_turn");
        assert_eq!(stop_reason(Finish::Stop, Some("x"), 0), "stop_sequence");
        assert_eq!(stop_reason(Finish::Length, None, 0), "max_tokens");
        assert_eq!(stop_reason(Finish::Stop, None, 2), "tool_use");
        assert_eq!(stop_reason(Finish::Length, None, 1), "max_tokens");
        let e = error_body(&ApiError::busy());
        assert_eq!(e["type"], "error");
        assert_eq!(e["error"]["type"], "overloaded_error");
        assert_eq!(
            error_body(&ApiError::unauthorized())["error"]["type"],
            "authentication_error"
        );
    }
}
