//! `tokenizer.ggml.*` metadata <-> `TokenizerSpec`.

use q4moe_gguf::{GgufHeader, Value, ValueType};
use q4moe_tokenizer::TokenizerSpec;

use crate::{ModelError, Result};

fn key_err(file: &str, key: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Key {
        file: file.into(),
        key: key.into(),
        msg: msg.into(),
    }
}

fn strings(h: &GgufHeader, file: &str, key: &str) -> Result<Vec<String>> {
    let Some(v) = h.get(key) else {
        return Ok(Vec::new());
    };
    let arr = v
        .as_array()
        .ok_or_else(|| key_err(file, key, "is not an array"))?;
    arr.iter()
        .map(|x| {
            x.as_str()
                .map(str::to_string)
                .ok_or_else(|| key_err(file, key, "holds a non-string element"))
        })
        .collect()
}

fn opt_u32(h: &GgufHeader, file: &str, key: &str) -> Result<Option<u32>> {
    match h.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| key_err(file, key, format!("{v:?} is not a token id"))),
    }
}

/// An optional key's value, or `None` when it is absent or has the wrong type. A wrong type does
/// not stop the load (the default serves), but it is never silent: the warning names the key, the
/// type expected and the type found.
fn optional<'h, T>(
    h: &'h GgufHeader,
    file: &str,
    key: &str,
    expected: &str,
    read: impl Fn(&'h Value) -> Option<T>,
) -> Option<T> {
    let v = h.get(key)?;
    let out = read(v);
    if out.is_none() {
        let found = v.value_type();
        tracing::warn!("{file}: metadata key {key}: expected {expected}, found {found:?}; ignored");
    }
    out
}

pub fn spec_from_gguf(h: &GgufHeader, file: &str) -> Result<TokenizerSpec> {
    let s = |key: &str| optional(h, file, key, "a string", |v| v.as_str().map(str::to_string));
    let model = h
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| key_err(file, "tokenizer.ggml.model", "missing or not a string"))?;
    let tokens = strings(h, file, "tokenizer.ggml.tokens")?;
    if tokens.is_empty() {
        return Err(key_err(file, "tokenizer.ggml.tokens", "missing or empty"));
    }
    let token_types = match h.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => v
            .as_array()
            .ok_or_else(|| key_err(file, "tokenizer.ggml.token_type", "is not an array"))?
            .iter()
            .map(|x| x.as_i64().map(|t| t as i32))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                key_err(
                    file,
                    "tokenizer.ggml.token_type",
                    "holds a non-integer element",
                )
            })?,
    };
    let eos_id = opt_u32(h, file, "tokenizer.ggml.eos_token_id")?
        .ok_or_else(|| key_err(file, "tokenizer.ggml.eos_token_id", "missing"))?;
    Ok(TokenizerSpec {
        model,
        pre: s("tokenizer.ggml.pre").unwrap_or_else(|| "default".into()),
        tokens,
        token_types,
        merges: strings(h, file, "tokenizer.ggml.merges")?,
        bos_id: opt_u32(h, file, "tokenizer.ggml.bos_token_id")?,
        eos_id,
        pad_id: opt_u32(h, file, "tokenizer.ggml.padding_token_id")?,
        add_bos: optional(
            h,
            file,
            "tokenizer.ggml.add_bos_token",
            "a bool",
            Value::as_bool,
        )
        .unwrap_or(false),
        chat_template: s("tokenizer.chat_template"),
    })
}

pub fn spec_to_metadata(spec: &TokenizerSpec) -> Vec<(String, Value)> {
    let mut m = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String(spec.model.clone()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            Value::String(spec.pre.clone()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::string_array(spec.tokens.iter().cloned()),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(
                ValueType::I32,
                spec.token_types.iter().map(|&t| Value::I32(t)).collect(),
            ),
        ),
        (
            "tokenizer.ggml.merges".to_string(),
            Value::string_array(spec.merges.iter().cloned()),
        ),
        (
            "tokenizer.ggml.eos_token_id".to_string(),
            Value::U32(spec.eos_id),
        ),
    ];
    if let Some(b) = spec.bos_id {
        m.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
    }
    if let Some(p) = spec.pad_id {
        m.push(("tokenizer.ggml.padding_token_id".into(), Value::U32(p)));
    }
    m.push((
        "tokenizer.ggml.add_bos_token".into(),
        Value::Bool(spec.add_bos),
    ));
    if let Some(t) = &spec.chat_template {
        m.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
    }
    m
}
