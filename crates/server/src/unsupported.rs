//! Request fields q4moe does not implement yet. Ignoring them would answer a different question
//! than the client asked (no logprobs, no second choice), so a value that asks for the
//! feature is a 400 naming the field; a value that asks for nothing (`echo: false`,
//! `logprobs: false`, `n: 1`) is accepted. (`tools`, `tool_choice`, `response_format` and
//! `grammar` are implemented: tools.rs, structured.rs.)

use serde_json::{Map, Value};

use crate::errors::ApiError;

/// Whether the value asks for the feature; `Null` never does.
fn asks(name: &str, v: &Value) -> bool {
    match (name, v) {
        (_, Value::Null) => false,
        ("n" | "best_of", v) => v.as_u64() != Some(1),
        (_, Value::Bool(b)) => *b,
        (_, Value::Number(n)) => n.as_f64() != Some(0.0),
        (_, Value::String(s)) => !s.is_empty(),
        (_, Value::Array(a)) => !a.is_empty(),
        (_, Value::Object(o)) => !o.is_empty(),
    }
}

const CHAT: &[&str] = &[
    "functions",
    "function_call",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "n",
];

const COMPLETION: &[&str] = &["logprobs", "logit_bias", "echo", "n", "best_of", "suffix"];

fn check(o: &Map<String, Value>, fields: &[&str]) -> Result<(), ApiError> {
    match fields
        .iter()
        .find(|&&f| o.get(f).is_some_and(|v| asks(f, v)))
    {
        Some(f) => Err(ApiError::invalid(
            *f,
            format!("'{f}' is not supported by this server yet; leave it out"),
        )
        .with_status(axum::http::StatusCode::BAD_REQUEST, "unsupported_parameter")),
        None => Ok(()),
    }
}

pub fn check_chat(o: &Map<String, Value>) -> Result<(), ApiError> {
    check(o, CHAT)
}

pub fn check_completion(o: &Map<String, Value>) -> Result<(), ApiError> {
    check(o, COMPLETION)
}
