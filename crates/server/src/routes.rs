//! Handlers: parse, check, submit, answer. Each is short; the work is in `openai`, `scheduler`
//! and `sse`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use q4moe_engine::Tokenizer;
use serde_json::json;

use crate::best_of;
use crate::choices::{self, gather, set_choice, submit_all, total_usage};
use crate::errors::ApiError;
use crate::infill::{FimTokens, Infill};
use crate::logprobs::{chat_logprobs, completion_logprobs};
use crate::openai::{self, finish_reason, GenParams, Meta, Prompt, Usage};
use crate::scheduler::{Collected, EngineHandle, JobPrompt, Started};
use crate::sse;
use crate::tool_markup;

pub struct AppState {
    pub engine: EngineHandle,
    pub model_name: String,
    pub created: u64,
}

pub type App = Arc<AppState>;

/// The body, or the extractor's complaint in OpenAI's shape (413 when over the size limit).
pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        let status = r.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "body_too_large"
        } else {
            "invalid_body"
        };
        ApiError::bad_body(format!(
            "could not read the request body: {}",
            r.body_text()
        ))
        .with_status(status, code)
    })
}

impl AppState {
    pub(crate) fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError::unknown_model(m, &self.model_name)),
            _ => Ok(()),
        }
    }

    /// Rejects a `max_tokens` no prompt could fit beside; the exact check needs the prompt's
    /// length, which only the worker knows.
    pub(crate) fn check_max_tokens(&self, gen: &GenParams) -> Result<(), ApiError> {
        let ctx = self.engine.context_capacity();
        match gen.max_tokens {
            Some(m) if m >= ctx => Err(ApiError::invalid(
                gen.max_tokens_param,
                format!(
                    "{} = {m} is beyond this model's context of {ctx} positions",
                    gen.max_tokens_param
                ),
            )
            .with_status(StatusCode::BAD_REQUEST, "context_length_exceeded")),
            _ => Ok(()),
        }
    }
}

impl AppState {
    fn stream_common(&self, meta: Meta, gen: &GenParams) -> sse::Common {
        sse::Common {
            meta,
            tokenizer: self.engine.tokenizer().clone(),
            logprobs: gen.logprobs.is_some(),
            include_usage: gen.include_usage,
            n: gen.n,
            legacy_functions: false,
        }
    }
}

/// Queue order headers, so clients (and tests) can see the queue is served first in, first out.
pub(crate) fn order_headers(seq: u64, started: &Started, mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert("x-q4moe-seq", HeaderValue::from(seq));
    h.insert("x-q4moe-run", HeaderValue::from(started.run));
    r
}

pub async fn chat_completions(
    State(app): State<App>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    chat(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat(app: App, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = openai::chat_request(&openai::parse_body(&body_bytes(body)?)?)?;
    app.check_model(req.model.as_deref())?;
    app.check_max_tokens(&req.gen)?;
    let gen = req.gen;
    let parse_calls = req.tools.as_ref().is_some_and(|t| t.parses_calls());
    let legacy = req.tools.as_ref().is_some_and(|t| t.legacy);
    let prompt = JobPrompt::Chat {
        messages: req.messages,
        enable_thinking: req.enable_thinking,
        tools: req.tools.map(|t| t.list),
    };
    let mut tickets = submit_all(&app.engine, &[prompt], &gen).await?;
    let started = tickets[0].started().await?;
    let seq = tickets[0].seq;
    let meta = Meta::new("chatcmpl", &app.model_name);
    if gen.stream {
        let c = sse::Common {
            legacy_functions: legacy,
            ..app.stream_common(meta, &gen)
        };
        return Ok(order_headers(
            seq,
            &started,
            sse::chat(c, started, tickets, parse_calls),
        ));
    }
    let tok = app.engine.tokenizer();
    let (mut bodies, mut usages) = (Vec::new(), Vec::new());
    for (i, t) in tickets.iter_mut().enumerate() {
        let c = t.collect_all().await?;
        let (reasoning, content) = q4moe_tokenizer::split_whole(&c.text, started.think_open);
        let (content, calls) = match parse_calls {
            true => tool_markup::parse_whole(&content),
            false => (Some(content), Vec::new()),
        };
        let finish = openai::chat_finish_reason(c.finish, calls.len());
        let mut b = openai::chat_completion(
            &meta,
            content.as_deref(),
            reasoning.as_deref(),
            &calls,
            finish,
            c.usage,
        );
        if legacy {
            crate::functions::legacy_shape(&mut b, "message");
        }
        let logprobs = gen.logprobs.map(|_| chat_logprobs(tok, &c.logprobs));
        set_choice(&mut b, i, logprobs);
        bodies.push(b);
        usages.push(c.usage);
    }
    let body = gather(bodies, total_usage(&usages, gen.n));
    Ok(order_headers(seq, &started, Json(body).into_response()))
}

pub async fn completions(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    completion(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completion(app: App, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = openai::completion_request(&openai::parse_body(&body_bytes(body)?)?)?;
    app.check_model(req.model.as_deref())?;
    app.check_max_tokens(&req.gen)?;
    let tok = app.engine.tokenizer().clone();
    if req.suffix.is_some() {
        FimTokens::require(&tok, "suffix")?;
    }
    let (gen, suffix) = (req.gen, req.suffix);
    // The prompts' text: echoed, and where the logprobs' text offsets start.
    let texts: Vec<String> = req
        .prompts
        .iter()
        .map(|p| match p {
            Prompt::Text(s) => s.clone(),
            Prompt::Tokens(ids) => tok.decode(ids, false).unwrap_or_default(),
        })
        .collect();
    let prompts: Vec<JobPrompt> = req
        .prompts
        .into_iter()
        .map(|prefix| match &suffix {
            None => JobPrompt::Completion(prefix),
            Some(s) => JobPrompt::Infill(Infill {
                prefix,
                suffix: s.clone(),
                middle: String::new(),
                extra: Vec::new(),
                fields: ("prompt", "suffix"),
            }),
        })
        .collect();
    let mut tickets = submit_all(&app.engine, &prompts, &gen).await?;
    let started = tickets[0].started().await?;
    let seq = tickets[0].seq;
    let meta = Meta::new("cmpl", &app.model_name);
    // Echo gives the whole text: with a suffix, the filled-in document (infill.rs).
    let echo = gen.echo.then(|| suffix.unwrap_or_default());
    if gen.stream {
        let c = app.stream_common(meta, &gen);
        let prompt_lps = gen.logprobs.is_some_and(|l| l.prompt);
        let r = sse::completion(c, tickets, &texts, echo, prompt_lps);
        return Ok(order_headers(seq, &started, r));
    }
    let mut candidates = Vec::with_capacity(tickets.len());
    for t in tickets.iter_mut() {
        candidates.push(t.collect_all().await?);
    }
    let usages: Vec<Usage> = candidates.iter().map(|c| c.usage).collect();
    let usage = total_usage(&usages, gen.best_of);
    let bodies = best_of::choose(candidates, gen.n, gen.best_of, |c| &c.logprobs)
        .into_iter()
        .enumerate()
        .map(|(i, (p, c))| {
            let mut b = completion_choice(&meta, &tok, &gen, &texts[p], echo.as_deref(), c);
            choices::set_index(&mut b, i);
            b
        })
        .collect();
    let body = gather(bodies, usage);
    Ok(order_headers(seq, &started, Json(body).into_response()))
}

/// One choice's body; `echo` is the suffix to close an echoed text with (empty without one).
fn completion_choice(
    meta: &Meta,
    tok: &Tokenizer,
    gen: &GenParams,
    prompt: &str,
    echo: Option<&str>,
    c: Collected,
) -> serde_json::Value {
    let text = match echo {
        Some(suffix) => format!("{prompt}{}{suffix}", c.text),
        None => c.text,
    };
    let finish = Some(finish_reason(c.finish));
    let mut b = openai::completion(meta, &text, finish, Some(c.usage));
    let logprobs = gen.logprobs.map(|asked| {
        // Offsets count from the start of the echoed prompt, or from where the text would
        // follow it.
        let mut offset = if asked.prompt {
            0
        } else {
            prompt.chars().count()
        };
        let mut lps = c.prompt_logprobs;
        lps.extend(c.logprobs);
        completion_logprobs(tok, &lps, &mut offset)
    });
    set_choice(&mut b, 0, logprobs);
    b
}

pub async fn models(State(app): State<App>) -> Response {
    Json(openai::models(&app.model_name, app.created)).into_response()
}

pub async fn health(State(app): State<App>) -> Response {
    Json(json!({ "status": "ok", "model": app.model_name, "queue_depth": app.engine.metrics.queue_depth() })).into_response()
}

pub async fn metrics(State(app): State<App>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.engine.metrics.render(),
    )
        .into_response()
}

pub async fn not_found() -> Response {
    ApiError::invalid("", "no such endpoint")
        .with_status(StatusCode::NOT_FOUND, "not_found")
        .into_response()
}

/// Counts every response by route and status.
pub async fn observe(State(app): State<App>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("other".to_string(), |p| p.as_str().to_string());
    let r = next.run(req).await;
    app.engine.metrics.request(&endpoint, r.status().as_u16());
    r
}
