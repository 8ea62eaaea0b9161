//! Limits on what one client may hold: connections and their timeouts (enforced in `conn`), and
//! the request body's deadline (enforced here, as middleware in front of the handlers).

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::errors::ApiError;

/// Connection limits of `q4moe serve`; see `conn` for when each timeout runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// From a request's first byte to the end of its headers.
    pub header_timeout: Duration,
    /// A silent connection between requests (or before the first) is closed after this.
    pub idle_timeout: Duration,
    /// From the end of the headers to the end of the body.
    pub body_timeout: Duration,
    /// Open connections; at it a new one takes the place of the one idle longest, or is closed
    /// at once where every open one has a request in flight.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            max_connections: 512,
        }
    }
}

/// What [`read_body`] needs.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub timeout: Duration,
    pub max_bytes: usize,
}

/// Reads the whole request body within its deadline, so a client trickling it cannot hold a
/// handler (and a connection slot) open: past the deadline it gets 408 and the connection closes.
pub async fn read_body(State(lim): State<BodyLimits>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(lim.timeout, axum::body::to_bytes(body, lim.max_bytes));
    match read.await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) if is_length_limit(&e) => ApiError::bad_body(format!(
            "the request body is over the limit of {} bytes",
            lim.max_bytes
        ))
        .with_status(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
        .into_response(),
        Ok(Err(e)) => {
            ApiError::bad_body(format!("could not read the request body: {e}")).into_response()
        }
        Err(_) => {
            let mut r = ApiError::bad_body(format!(
                "the request body did not arrive within {} s",
                lim.timeout.as_secs_f32()
            ))
            .with_status(StatusCode::REQUEST_TIMEOUT, "request_timeout")
            .into_response();
            // The rest of the body may still come: it must not be read as the next request.
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        }
    }
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}
