//! OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.
//! Every failure a client can cause ends here, so nothing in the request path panics.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    /// The request field at fault, as the client named it.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before trying again (`Retry-After`), for a refusal that
    /// is about load, not about the request.
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some("invalid_value"),
            retry_after: None,
        }
    }

    /// A 400 about the request as a whole (malformed JSON, invalid UTF-8).
    pub fn bad_body(message: impl Into<String>) -> Self {
        ApiError {
            param: None,
            code: Some("invalid_body"),
            ..Self::invalid("", message)
        }
    }

    pub fn with_status(mut self, status: StatusCode, code: &'static str) -> Self {
        self.status = status;
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or incorrect API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    pub fn unknown_model(name: &str, served: &str) -> Self {
        Self::invalid(
            "model",
            format!("the model '{name}' does not exist; this server serves '{served}'"),
        )
        .with_status(StatusCode::NOT_FOUND, "model_not_found")
    }

    /// The engine's queue is full: the request was not accepted, so the client may retry.
    pub fn busy() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the request queue is full; retry later".into(),
            kind: "server_error",
            param: None,
            code: Some("queue_full"),
            retry_after: Some(1),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        r
    }
}

/// Maps the engine's errors to client errors where the client caused them.
pub fn from_engine(e: q4moe_engine::EngineError, prompt_param: &str) -> ApiError {
    use q4moe_engine::EngineError as E;
    use q4moe_tokenizer::TokenizerError;
    match e {
        E::PromptTooLong { prompt, context } => ApiError::invalid(
            prompt_param,
            format!(
                "the prompt is {prompt} tokens; this model's context holds {context} positions"
            ),
        )
        .with_status(StatusCode::BAD_REQUEST, "context_length_exceeded"),
        E::PromptOverContext { context } => ApiError::invalid(
            prompt_param,
            format!("the prompt is {context} tokens or more; this model's context holds {context} positions"),
        )
        .with_status(StatusCode::BAD_REQUEST, "context_length_exceeded"),
        E::Invalid(msg) => ApiError::invalid(prompt_param, msg),
        // The model's template overran its limits or its worker failed: the server's fault
        // (its model file), not the request's.
        E::Tokenizer(t @ (TokenizerError::TemplateLimit(_) | TokenizerError::TemplateWorker(_))) => {
            ApiError::internal(t.to_string())
        }
        E::Tokenizer(t) => ApiError::invalid(prompt_param, t.to_string()),
        other => ApiError::internal(other.to_string()),
    }
}
