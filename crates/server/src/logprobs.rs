//! `logprobs`, `top_logprobs`, `echo` and `logit_bias`: reading them from a request, and the
//! two response shapes logprobs travel in (the chat `content` list, the legacy completions
//! columns). A token's logprob is the log-softmax of the model's raw logits for its step, before
//! the logit bias, penalties and temperature (the engine's `logprobs` module).

use q4moe_engine::{LogprobOptions, TokenLogprob, Tokenizer};
use serde_json::{json, Map, Value};

use crate::errors::ApiError;

type Obj = Map<String, Value>;

/// Chat: `logprobs: true` and `top_logprobs` 0..=20 (which needs `logprobs`, as OpenAI says).
pub fn chat_options(o: &Obj) -> Result<Option<LogprobOptions>, ApiError> {
    let on = match o.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "logprobs",
                "'logprobs' must be a boolean",
            ))
        }
    };
    let top = top_count("top_logprobs", o.get("top_logprobs"))?;
    match (on, top) {
        (true, top) => Ok(Some(LogprobOptions {
            top: top.unwrap_or(0),
            prompt: false,
        })),
        // 0 asks for nothing; some clients send it by default.
        (false, Some(0) | None) => Ok(None),
        (false, Some(_)) => Err(ApiError::invalid(
            "top_logprobs",
            "'top_logprobs' needs 'logprobs': true",
        )),
    }
}

/// Completions: `logprobs` is the count of alternatives, 0..=20 (OpenAI allows 5; vLLM and
/// llama-server more); with `echo` the prompt's tokens are reported too.
pub fn completion_options(o: &Obj, echo: bool) -> Result<Option<LogprobOptions>, ApiError> {
    Ok(top_count("logprobs", o.get("logprobs"))?.map(|top| LogprobOptions { top, prompt: echo }))
}

fn top_count(name: &str, v: Option<&Value>) -> Result<Option<usize>, ApiError> {
    let max = LogprobOptions::MAX_TOP;
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n as usize <= max => Ok(Some(n as usize)),
            _ => Err(ApiError::invalid(
                name,
                format!("'{name}' must be an integer in [0, {max}]"),
            )),
        },
    }
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to a bias in [-100, 100].
/// Ids are checked against the vocabulary once the prompt is built (`check_bias_ids`).
pub fn logit_bias(o: &Obj) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match o.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "'logit_bias' must be an object from token ids to biases",
            ))
        }
    };
    if map.len() > 1024 {
        return Err(ApiError::invalid(
            "logit_bias",
            "'logit_bias' may name at most 1024 tokens",
        ));
    }
    map.iter()
        .map(|(k, v)| {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' key '{k}' is not a token id"),
                )
            })?;
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' for token {id} must be a number in [-100, 100]"),
                )),
            }
        })
        .collect()
}

/// A bias on an id outside the vocabulary is the client's mistake, named.
pub fn check_bias_ids(bias: &[(u32, f32)], vocab: usize) -> Result<(), ApiError> {
    match bias.iter().find(|(t, _)| *t as usize >= vocab) {
        Some((t, _)) => Err(ApiError::invalid(
            "logit_bias",
            format!("'logit_bias' names token id {t}, outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// A token as text (invalid UTF-8 replaced) and its raw bytes.
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.token_bytes(id).unwrap_or_default().to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat's `logprobs.content` entries.
pub fn chat_content(tok: &Tokenizer, lps: &[TokenLogprob]) -> Vec<Value> {
    let entry = |id: u32, lp: Option<f32>| {
        let (text, bytes) = token_text(tok, id);
        json!({ "token": text, "logprob": lp, "bytes": bytes })
    };
    lps.iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, v)| entry(id, Some(v))).collect();
            e
        })
        .collect()
}

/// Chat's `logprobs` object for some tokens.
pub fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    json!({ "content": chat_content(tok, lps), "refusal": null })
}

/// The legacy completions columns. `offset` is where the first token's text starts, in
/// characters of the choice's text (the prompt's length when it is not echoed); it advances.
pub fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let (mut tokens, mut values, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for l in lps {
        let (text, _) = token_text(tok, l.token);
        offsets.push(*offset);
        *offset += text.chars().count();
        tokens.push(text);
        values.push(l.logprob);
        // The prompt's first token has no step, so no alternatives (null, as OpenAI).
        tops.push(match l.logprob {
            None => Value::Null,
            Some(_) => Value::Object(
                l.top
                    .iter()
                    .map(|&(id, v)| (token_text(tok, id).0, json!(v)))
                    .collect(),
            ),
        });
    }
    json!({ "tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets })
}
