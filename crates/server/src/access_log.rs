//! One log line per request, through `tracing` (target `q4moe_server::access`): method, path,
//! status, prompt and generated tokens where the request generated, and the latency in ms,
//! written when the response's last byte is (a stream's end, not its first event).
//!
//! The token counts come from the engine worker, which learns them when the job ends: the
//! middleware opens a per-request [`UsageCell`] as a task-local for the handler's run, and
//! `EngineHandle::submit` hands it to the job. A task-local, not a handler argument, so that
//! every endpoint that generates is logged without each threading the cell through. (tower-http's
//! `TraceLayer` times requests too, but cannot see the engine's token counts.)

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;

use crate::openai::Usage;

/// Where a job reports its token counts for the request's log line.
#[derive(Clone, Default, Debug)]
pub struct UsageCell(Arc<Mutex<Option<Usage>>>);

impl UsageCell {
    pub fn set(&self, u: Usage) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(u);
    }

    fn get(&self) -> Option<Usage> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

tokio::task_local! {
    static CURRENT: UsageCell;
}

/// The cell of the request being handled, if the access log is on.
pub fn current() -> Option<UsageCell> {
    CURRENT.try_with(UsageCell::clone).ok()
}

/// The line's text: `POST /v1/chat/completions 200 12.3 ms tokens in=21 out=8`.
pub fn line(method: &str, path: &str, status: u16, ms: f64, usage: Option<Usage>) -> String {
    let tokens = usage.map_or(String::new(), |u| {
        format!(" tokens in={} out={}", u.prompt_tokens, u.completion_tokens)
    });
    format!("{method} {path} {status} {ms:.1} ms{tokens}")
}

/// Writes the line when dropped: with the body, once it has been sent or abandoned.
struct Pending {
    method: String,
    path: String,
    status: u16,
    start: Instant,
    usage: UsageCell,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let ms = self.start.elapsed().as_secs_f64() * 1e3;
        let text = line(&self.method, &self.path, self.status, ms, self.usage.get());
        tracing::info!(target: "q4moe_server::access", "{text}");
    }
}

/// The middleware: times the request and logs it once its response body is done.
pub async fn log_requests(req: Request, next: Next) -> Response {
    let start = Instant::now();
    let (method, path) = (req.method().to_string(), req.uri().path().to_string());
    let usage = UsageCell::default();
    let r = CURRENT.scope(usage.clone(), next.run(req)).await;
    let pending = Pending {
        method,
        path,
        status: r.status().as_u16(),
        start,
        usage,
    };
    r.map(|b| {
        Body::new(b.map_frame(move |f| {
            let _ = &pending;
            f
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_the_request_and_its_tokens() {
        let u = Usage {
            prompt_tokens: 21,
            completion_tokens: 8,
            cached_tokens: 0,
        };
        assert_eq!(
            line("POST", "/v1/messages", 200, 12.34, Some(u)),
            "POST /v1/messages 200 12.3 ms tokens in=21 out=8"
        );
        assert_eq!(
            line("GET", "/health", 200, 0.31, None),
            "GET /health 200 0.3 ms"
        );
    }
}
