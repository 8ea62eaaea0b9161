//! Request fields q4moe does not implement yet. Ignoring them would answer a different question
//! than the client asked (a legacy `functions` call, several completions ranked), so a value
//! that asks for the feature is a 400 naming the field; a value that asks for nothing
//! (`best_of: 1`, `functions: []`) is accepted. (`tools`, `tool_choice`, `response_format`,
//! `grammar`, `logprobs`, `logit_bias`, `echo` and `n` are implemented.)

use serde_json::{Map, Value};

use crate::errors::ApiError;

/// Whether the value asks for the feature; `Null` never does.
fn asks(name: &str, v: &Value) -> bool {
    match (name, v) {
        (_, Value::Null) => false,
        ("best_of", v) => v.as_u64() != Some(1),
        (_, Value::Bool(b)) => *b,
        (_, Value::Number(n)) => n.as_f64() != Some(0.0),
        (_, Value::String(s)) => !s.is_empty(),
        (_, Value::Array(a)) => !a.is_empty(),
        (_, Value::Object(o)) => !o.is_empty(),
    }
}

const CHAT: &[&str] = &["functions", "function_call"];

const COMPLETION: &[&str] = &["best_of", "suffix"];

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
