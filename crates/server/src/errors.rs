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
        Self::retry_later("the request queue is full; retry later", "queue_full")
    }

    /// 503 with `Retry-After: 1`: the server's momentary state, not the request's fault.
    pub fn retry_later(message: impl Into<String>, code: &'static str) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code),
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
        E::KvExceeded { .. } => ApiError::invalid("max_tokens", e.to_string())
            .with_status(StatusCode::BAD_REQUEST, "kv_cache_exceeded"),
        // Other sequences hold the KV pool's pages: the client may retry once they finish.
        E::Backend(full @ q4moe_model::backend::BackendError::KvFull { .. }) => {
            ApiError::retry_later(full.to_string(), "kv_cache_full")
        }
        // The model's template overran its limits or its worker failed: the server's fault
        // (its model file), not the request's.
        E::Tokenizer(t @ (TokenizerError::TemplateLimit(_) | TokenizerError::TemplateWorker(_))) => {
            ApiError::internal(t.to_string())
        }
        E::Tokenizer(t) => ApiError::invalid(prompt_param, t.to_string()),
        other => ApiError::internal(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::from_engine;
    use axum::http::StatusCode;
    use q4moe_engine::EngineError;
    use q4moe_tokenizer::{TemplateLimit, TokenizerError};

    /// A template past its limits is the model file's fault (500); its own
    /// `raise_exception` answers the request (400).
    #[test]
    fn template_limits_are_server_errors_and_template_exceptions_client_errors() {
        let limit = TokenizerError::TemplateLimit(TemplateLimit::MemoryBytes(1 << 30));
        let e = from_engine(EngineError::Tokenizer(limit), "messages");
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.body()["error"]["type"], "server_error");
        let msg = e.body()["error"]["message"].as_str().unwrap().to_string();
        assert_eq!(msg, "chat template exceeded its memory limit of 1024 MiB");
        let dead = TokenizerError::TemplateWorker("the worker died (signal 11): ".into());
        let e = from_engine(EngineError::Tokenizer(dead), "messages");
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        let raised = TokenizerError::Template("no system role".into());
        let e = from_engine(EngineError::Tokenizer(raised), "messages");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["param"], "messages");
    }

    /// A full KV pool is the server's momentary state: 503 with Retry-After, the pool named.
    #[test]
    fn a_full_kv_pool_is_503_with_retry_after_and_a_request_past_it_400() {
        let full = q4moe_model::backend::BackendError::KvFull {
            session: 3,
            needed: 4096,
            free: 1024,
            capacity: 1 << 20,
        };
        let e = from_engine(EngineError::Backend(full), "messages");
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.retry_after, Some(1));
        assert_eq!(e.body()["error"]["code"], "kv_cache_full");
        let msg = e.body()["error"]["message"].as_str().unwrap().to_string();
        assert!(
            msg.contains("KV pool is full (4096 more bytes needed, 1024 of 1048576 free"),
            "{msg}"
        );
        // A request that alone outgrows the pool is the request's to change: 400.
        let e = from_engine(EngineError::KvExceeded { capacity: 1 << 20 }, "messages");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.retry_after, None);
        assert_eq!(e.body()["error"]["code"], "kv_cache_exceeded");
    }
}
