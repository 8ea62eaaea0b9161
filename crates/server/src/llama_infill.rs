//! llama-server's `POST /infill`: `input_prefix`, `input_suffix`, an optional `prompt` (the
//! start of the middle, already written) and `input_extra` (other files as context), with
//! llama-server's sampling fields (`n_predict`, `repeat_penalty` beside the OpenAI names). The
//! prompt is built as `/v1/completions` builds one with a `suffix` (infill.rs). The answer has
//! llama-server's `/completion` shape: `content`, `stop`, `stop_type`, `stopping_word`,
//! `tokens_predicted`, `tokens_evaluated`, `tokens_cached`; streamed, a `data:` chunk a piece
//! of text and a last one with `stop: true` and the counts (and no `[DONE]`, as llama-server
//! ends its own streams). `n_probs` is refused: the logprobs live on `/v1/completions`.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use q4moe_engine::Finish;
use serde_json::{json, Value};

use crate::errors::ApiError;
use crate::fields::{in_range, opt_f32, opt_str, parse_body, present, Obj};
use crate::infill::{FimTokens, Infill};
use crate::openai::{self, Prompt, Usage};
use crate::routes::{body_bytes, order_headers, App};
use crate::scheduler::{Collected, Event, JobPrompt, Ticket};

pub async fn infill(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    run(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn run(app: App, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let o = parse_body(&body_bytes(body)?)?;
    let (infill, gen) = request(&o)?;
    app.check_model(opt_str(&o, "model")?.as_deref())?;
    app.check_max_tokens(&gen)?;
    FimTokens::require(app.engine.tokenizer(), "input_suffix")?;
    let stream = gen.stream;
    let mut ticket = app.engine.submit(JobPrompt::Infill(infill), gen).await?;
    let started = ticket.started().await?;
    let seq = ticket.seq;
    if stream {
        return Ok(order_headers(
            seq,
            &started,
            sse(ticket, app.model_name.clone()),
        ));
    }
    let c = ticket.collect_all().await?;
    let body = last(&app.model_name, &c.text, &outcome(&c));
    Ok(order_headers(seq, &started, Json(body).into_response()))
}

/// Reads an `/infill` body: the texts, then the sampling fields under their OpenAI names.
pub fn request(o: &Obj) -> Result<(Infill, openai::GenParams), ApiError> {
    let text = |name: &str| opt_str(o, name).map(Option::unwrap_or_default);
    let infill = Infill {
        prefix: Prompt::Text(text("input_prefix")?),
        suffix: text("input_suffix")?,
        middle: text("prompt")?,
        extra: extra(o)?,
        fields: ("input_prefix", "input_suffix"),
    };
    if present(o, "n_probs").is_some_and(|v| v.as_u64() != Some(0)) {
        return Err(ApiError::invalid(
            "n_probs",
            "'n_probs' is not served on /infill; /v1/completions with 'suffix' and 'logprobs' reports them",
        ));
    }
    if present(o, "n").is_some_and(|v| v.as_u64() != Some(1)) {
        return Err(ApiError::invalid(
            "n",
            "/infill answers with one completion",
        ));
    }
    let mut g = o.clone();
    // llama-server's `n_predict`: -1 (its default) for as many as the context leaves.
    match present(o, "n_predict").map(Value::as_i64) {
        None | Some(Some(-1)) => {}
        Some(Some(n @ 1..)) => {
            g.insert("max_tokens".into(), json!(n));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "n_predict",
                "'n_predict' must be -1 or a positive integer",
            ))
        }
    }
    if let Some(p) = opt_f32(o, "repeat_penalty")? {
        g.insert(
            "repetition_penalty".into(),
            json!(in_range("repeat_penalty", p, 0.0, 10.0, true)?),
        );
    }
    Ok((infill, openai::gen_params(&g)?))
}

/// `input_extra`: an array of `{"filename", "text"}` (the filename defaults to `tmp`, as
/// llama-server's does).
fn extra(o: &Obj) -> Result<Vec<(String, String)>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "input_extra",
            "'input_extra' must be an array of {\"filename\": string, \"text\": string}",
        )
    };
    let items = match present(o, "input_extra") {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(bad()),
    };
    items
        .iter()
        .map(|c| {
            let name = match c.get("filename") {
                None | Some(Value::Null) => Some("tmp"),
                Some(v) => v.as_str(),
            };
            match (name, c.get("text").and_then(Value::as_str)) {
                (Some(n), Some(t)) => Ok((n.to_string(), t.to_string())),
                _ => Err(bad()),
            }
        })
        .collect()
}

/// How a generation ended, in llama-server's words, and its counts.
struct Outcome {
    stop_type: &'static str,
    stopping_word: String,
    usage: Usage,
}

fn outcome(c: &Collected) -> Outcome {
    ended(c.finish, c.stop_sequence.clone(), c.usage)
}

fn ended(finish: Finish, stop: Option<String>, usage: Usage) -> Outcome {
    let stop_type = match (finish, &stop) {
        (Finish::Stop, Some(_)) => "word",
        (Finish::Stop, None) => "eos",
        (Finish::Length, _) => "limit",
        (Finish::Cancelled, _) => "none",
    };
    Outcome {
        stop_type,
        stopping_word: stop.unwrap_or_default(),
        usage,
    }
}

/// The whole answer, or a stream's last chunk (its `content` empty).
fn last(model: &str, content: &str, o: &Outcome) -> Value {
    json!({
        "index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": true,
        "model": model, "stop_type": o.stop_type, "stopping_word": o.stopping_word,
        "tokens_predicted": o.usage.completion_tokens,
        "tokens_evaluated": o.usage.prompt_tokens,
        "tokens_cached": o.usage.cached_tokens,
        "truncated": false, "has_new_line": content.contains('\n'),
    })
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// A chunk a piece of text, then the last one; an error travels in the stream.
fn sse(ticket: Ticket, model: String) -> Response {
    let chunks = stream::unfold(Some(ticket), move |t| {
        let model = model.clone();
        async move {
            let mut t = t?;
            let (v, more) = next_chunk(&mut t, &model).await;
            Some((data(&v), more.then_some(t)))
        }
    });
    Sse::new(chunks.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The stream's next chunk, and whether more follow.
async fn next_chunk(t: &mut Ticket, model: &str) -> (Value, bool) {
    loop {
        match t.events.recv().await {
            Some(Event::Text(s)) if !s.is_empty() => {
                let v =
                    json!({ "index": 0, "content": s, "tokens": [], "id_slot": 0, "stop": false });
                return (v, true);
            }
            Some(Event::Done {
                finish,
                usage,
                stop_sequence,
            }) => return (last(model, "", &ended(finish, stop_sequence, usage)), false),
            Some(Event::Error(e)) => return (e.body(), false),
            None => {
                return (
                    ApiError::internal("the engine worker stopped").body(),
                    false,
                )
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(v: Value) -> Obj {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn llama_server_fields_read_into_the_infill_and_its_sampling() {
        let (f, g) = request(&o(json!({
            "input_prefix": "def f(", "input_suffix": "):\n", "prompt": "x",
            "input_extra": [{"filename": "a.py", "text": "A"}, {"text": "B"}],
            "n_predict": 7, "repeat_penalty": 1.1, "temperature": 0, "stop": ["\n"],
        })))
        .unwrap();
        assert!(matches!(&f.prefix, Prompt::Text(t) if t == "def f("));
        assert_eq!((f.suffix.as_str(), f.middle.as_str()), ("):\n", "x"));
        assert_eq!(
            f.extra,
            [("a.py".into(), "A".into()), ("tmp".into(), "B".into())]
        );
        assert_eq!(g.max_tokens, Some(7));
        assert!((g.sampling.repetition_penalty - 1.1).abs() < 1e-6);
        assert_eq!(g.stop, ["\n"]);
        let (_, g) = request(&o(json!({ "n_predict": -1 }))).unwrap();
        assert_eq!(g.max_tokens, None);
    }

    #[test]
    fn bad_fields_are_named() {
        for (body, field) in [
            (json!({ "n_predict": 0 }), "n_predict"),
            (json!({ "n_predict": "5" }), "n_predict"),
            (json!({ "repeat_penalty": 0 }), "repeat_penalty"),
            (
                json!({ "input_extra": [{ "filename": "a" }] }),
                "input_extra",
            ),
            (json!({ "input_extra": "x" }), "input_extra"),
            (json!({ "input_prefix": 3 }), "input_prefix"),
            (json!({ "n_probs": 2 }), "n_probs"),
            (json!({ "n": 2 }), "n"),
        ] {
            let e = request(&o(body.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
        }
        let stop = ended(Finish::Stop, Some("\n".into()), Usage::default());
        assert_eq!(
            (stop.stop_type, stop.stopping_word.as_str()),
            ("word", "\n")
        );
        assert_eq!(
            ended(Finish::Length, None, Usage::default()).stop_type,
            "limit"
        );
    }
}
