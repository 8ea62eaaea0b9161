//! Answers for requests the API does not take, in OpenAI's error shape: a method a route does not
//! serve (405, with `Allow`) and a body that is not JSON (415).

use axum::extract::Request;
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::errors::ApiError;

/// The method-not-allowed fallback; axum adds the route's `Allow` header to it.
pub async fn method_not_allowed(method: Method) -> Response {
    ApiError::invalid("", format!("this endpoint does not take {method}"))
        .with_status(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
        .into_response()
}

/// A POST body must be JSON. A request without `Content-Type` is read as JSON (curl and the
/// tests send none); one that names another type (a form, text/plain: what a web page may send
/// cross-origin without a preflight) gets 415.
pub async fn require_json(req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    match req.headers().get(header::CONTENT_TYPE).map(|v| v.to_str()) {
        None => next.run(req).await,
        Some(Ok(ct)) if is_json(ct) => next.run(req).await,
        Some(ct) => ApiError::bad_body(format!(
            "the request body must be application/json, not {:?}",
            ct.unwrap_or("(not text)")
        ))
        .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
        .into_response(),
    }
}

/// `application/json`, with or without parameters (`; charset=utf-8`), or a `+json` type.
fn is_json(ct: &str) -> bool {
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn json_types() {
        assert!(super::is_json("application/json"));
        assert!(super::is_json("Application/JSON; charset=utf-8"));
        assert!(super::is_json("application/vnd.api+json"));
        assert!(!super::is_json("text/plain"));
        assert!(!super::is_json("application/x-www-form-urlencoded"));
        assert!(!super::is_json("multipart/form-data; boundary=x"));
    }
}
