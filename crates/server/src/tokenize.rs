//! `/tokenize` and `/detokenize` in llama-server's shape: `{"content", "add_special",
//! "parse_special", "with_pieces"}` -> `{"tokens": [ids]}` (or `[{"id", "piece"}]`), and
//! `{"tokens": [ids]}` -> `{"content"}`. Bounded as prompts are: the body limit, and a text or
//! id list longer than the model's context is refused before it is worked through whole. The
//! work runs on the blocking pool, never on the engine's thread.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use q4moe_tokenizer::{Tokenizer, TokenizerError};
use serde_json::{json, Value};

use crate::errors::ApiError;
use crate::fields::{opt_bool, parse_body, Obj};
use crate::routes::{body_bytes, App};

pub async fn tokenize(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    run_tokenize(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub async fn detokenize(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    run_detokenize(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A token's text: a string when its bytes are UTF-8, else the bytes (as llama-server does for
/// a piece of a multi-byte character).
pub fn piece_json(tk: &Tokenizer, id: u32) -> Value {
    let bytes = tk.token_bytes(id).unwrap_or_default();
    match std::str::from_utf8(bytes) {
        Ok(s) => json!(s),
        Err(_) => json!(bytes),
    }
}

fn too_long(field: &str, context: usize) -> ApiError {
    ApiError::invalid(
        field,
        format!("'{field}' is longer than this model's context of {context} tokens"),
    )
    .with_status(StatusCode::BAD_REQUEST, "context_length_exceeded")
}

async fn run_tokenize(app: App, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let o = parse_body(&body_bytes(body)?)?;
    let content = match o.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::invalid("content", "'content' must be a string")),
        None => return Err(ApiError::invalid("content", "'content' is required")),
    };
    let add_special = opt_bool(&o, "add_special")?.unwrap_or(false);
    let parse_special = opt_bool(&o, "parse_special")?.unwrap_or(true);
    let with_pieces = opt_bool(&o, "with_pieces")?.unwrap_or(false);
    let p = app.engine.prompter().clone();
    let context = p.context();
    let tokens = tokio::task::spawn_blocking(move || {
        let tk = p.tokenizer();
        let ids = tk.tokenize(&content, add_special, parse_special, context)?;
        Ok::<_, TokenizerError>(if with_pieces {
            ids.iter()
                .map(|&id| json!({ "id": id, "piece": piece_json(tk, id) }))
                .collect()
        } else {
            json!(ids)
        })
    })
    .await
    .map_err(|_| ApiError::internal("tokenizing failed (a panic)"))?
    .map_err(|e| match e {
        TokenizerError::TooLong { .. } => too_long("content", context),
        other => ApiError::invalid("content", other.to_string()),
    })?;
    Ok(Json(json!({ "tokens": tokens })).into_response())
}

/// `tokens`: an array of ids inside the vocabulary, no longer than the context.
fn token_ids(o: &Obj, vocab: usize, context: usize) -> Result<Vec<u32>, ApiError> {
    let Some(Value::Array(items)) = o.get("tokens") else {
        return Err(ApiError::invalid(
            "tokens",
            "'tokens' must be an array of token ids",
        ));
    };
    if items.len() > context {
        return Err(too_long("tokens", context));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(t) if t < vocab as u64 => Ok(t as u32),
            Some(t) => Err(ApiError::invalid(
                format!("tokens[{i}]"),
                format!("token id {t} is outside the vocabulary of {vocab}"),
            )),
            None => Err(ApiError::invalid(
                format!("tokens[{i}]"),
                "a token id must be a non-negative integer",
            )),
        })
        .collect()
}

async fn run_detokenize(
    app: App,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let o = parse_body(&body_bytes(body)?)?;
    let p = app.engine.prompter().clone();
    let vocab = p.tokenizer().vocab_size();
    let ids = token_ids(&o, vocab, p.context())?;
    let content = tokio::task::spawn_blocking(move || p.tokenizer().decode(&ids, false))
        .await
        .map_err(|_| ApiError::internal("detokenizing failed (a panic)"))?
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(Json(json!({ "content": content })).into_response())
}
