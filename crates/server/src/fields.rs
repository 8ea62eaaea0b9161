//! Reading a request body's JSON fields: the shared readers every endpoint's parser uses
//! (OpenAI, Anthropic, llama-server's), each naming the field in its 400.

use serde_json::{Map, Value};

use crate::errors::ApiError;

/// The most sequences one request may start (its prompts times `n`).
pub const MAX_CHOICES: usize = 64;

pub(crate) type Obj = Map<String, Value>;

/// Parses a body: UTF-8, then JSON, then a JSON object.
pub fn parse_body(body: &[u8]) -> Result<Obj, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_body(format!("the request body is not valid UTF-8 ({e})")))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad_body("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_body(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

pub(crate) fn present<'a>(o: &'a Obj, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

pub(crate) fn opt_f32(o: &Obj, name: &str) -> Result<Option<f32>, ApiError> {
    present(o, name)
        .map(|v| {
            v.as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| ApiError::invalid(name, format!("'{name}' must be a number")))
        })
        .transpose()
}

pub(crate) fn opt_uint(o: &Obj, name: &str) -> Result<Option<u64>, ApiError> {
    present(o, name)
        .map(|v| {
            v.as_u64().ok_or_else(|| {
                ApiError::invalid(name, format!("'{name}' must be a non-negative integer"))
            })
        })
        .transpose()
}

pub(crate) fn opt_bool(o: &Obj, name: &str) -> Result<Option<bool>, ApiError> {
    present(o, name)
        .map(|v| {
            v.as_bool()
                .ok_or_else(|| ApiError::invalid(name, format!("'{name}' must be a boolean")))
        })
        .transpose()
}

pub(crate) fn opt_str(o: &Obj, name: &str) -> Result<Option<String>, ApiError> {
    present(o, name)
        .map(|v| {
            v.as_str()
                .map(String::from)
                .ok_or_else(|| ApiError::invalid(name, format!("'{name}' must be a string")))
        })
        .transpose()
}

pub(crate) fn in_range(
    name: &str,
    v: f32,
    lo: f32,
    hi: f32,
    lo_open: bool,
) -> Result<f32, ApiError> {
    let ok = v.is_finite() && v <= hi && if lo_open { v > lo } else { v >= lo };
    let bound = if lo_open {
        format!("({lo}, {hi}]")
    } else {
        format!("[{lo}, {hi}]")
    };
    ok.then_some(v)
        .ok_or_else(|| ApiError::invalid(name, format!("'{name}' must be in {bound}, got {v}")))
}

/// A prompt's token ids must be in the model's vocabulary.
pub(crate) fn check_ids(ids: &[u32], vocab: usize, param: &str) -> Result<(), ApiError> {
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(ApiError::invalid(
            param,
            format!("token id {t} is outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}
