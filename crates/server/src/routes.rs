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
use serde_json::json;

use crate::errors::ApiError;
use crate::openai::{self, finish_reason, GenParams, Meta};
use crate::scheduler::{EngineHandle, JobPrompt, Started};
use crate::sse;
use crate::tool_markup;

pub struct AppState {
    pub engine: EngineHandle,
    pub model_name: String,
    pub created: u64,
}

pub type App = Arc<AppState>;

/// The body, or the extractor's complaint in OpenAI's shape (413 when over the size limit).
fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
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
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError::unknown_model(m, &self.model_name)),
            _ => Ok(()),
        }
    }

    /// Rejects a `max_tokens` no prompt could fit beside; the exact check needs the prompt's
    /// length, which only the worker knows.
    fn check_max_tokens(&self, gen: &GenParams) -> Result<(), ApiError> {
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

/// Queue order headers, so clients (and tests) can see the queue is served first in, first out.
fn order_headers(seq: u64, started: &Started, mut r: Response) -> Response {
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
    let (stream, include_usage) = (req.gen.stream, req.gen.include_usage);
    let parse_calls = req.tools.as_ref().is_some_and(|t| t.parses_calls());
    let prompt = JobPrompt::Chat {
        messages: req.messages,
        enable_thinking: req.enable_thinking,
        tools: req.tools.map(|t| t.list),
    };
    let mut ticket = app.engine.submit(prompt, req.gen).await?;
    let started = ticket.started().await?;
    let meta = Meta::new("chatcmpl", &app.model_name);
    if stream {
        let seq = ticket.seq;
        return Ok(order_headers(
            seq,
            &started,
            sse::chat(meta, started, ticket, include_usage, parse_calls),
        ));
    }
    let (text, finish, usage) = ticket.collect().await?;
    let (reasoning, content) = q4moe_tokenizer::split_whole(&text, started.think_open);
    let (content, calls) = match parse_calls {
        true => tool_markup::parse_whole(&content),
        false => (Some(content), Vec::new()),
    };
    let body = openai::chat_completion(
        &meta,
        content.as_deref(),
        reasoning.as_deref(),
        &calls,
        openai::chat_finish_reason(finish, calls.len()),
        usage,
    );
    Ok(order_headers(
        ticket.seq,
        &started,
        Json(body).into_response(),
    ))
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
    let (stream, include_usage) = (req.gen.stream, req.gen.include_usage);
    let mut ticket = app
        .engine
        .submit(JobPrompt::Completion(req.prompt), req.gen)
        .await?;
    let started = ticket.started().await?;
    let meta = Meta::new("cmpl", &app.model_name);
    if stream {
        let seq = ticket.seq;
        return Ok(order_headers(
            seq,
            &started,
            sse::completion(meta, ticket, include_usage),
        ));
    }
    let (text, finish, usage) = ticket.collect().await?;
    let body = openai::completion(&meta, &text, Some(finish_reason(finish)), Some(usage));
    Ok(order_headers(
        ticket.seq,
        &started,
        Json(body).into_response(),
    ))
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
