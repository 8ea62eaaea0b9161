//! OpenAI-compatible HTTP server over the engine: `/v1/chat/completions`, `/v1/completions`
//! (streaming or not), `/v1/models`, Anthropic's `/v1/messages`, llama-server's `/tokenize`,
//! `/detokenize` and `/infill` (fill-in-the-middle), `/health`, `/metrics`; a log line per
//! request. One engine worker serves a bounded FIFO queue: as a continuous batch where the
//! backend has a batched step, else one request at a time.

pub mod access_log;
pub mod anthropic;
pub mod anthropic_shape;
mod anthropic_sse;
mod anthropic_tools;
pub mod auth;
mod batching;
mod best_of;
mod choices;
mod conn;
pub mod cors;
pub mod errors;
pub mod fields;
mod functions;
mod guards;
pub mod infill;
mod job;
pub mod limits;
mod llama_infill;
mod logprobs;
pub mod metrics;
pub mod openai;
mod routes;
pub mod scheduler;
mod sse;
pub mod structured;
pub mod tokenize;
mod tool_markup;
pub mod tools;

use std::future::Future;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

pub use limits::ConnLimits;
pub use q4moe_engine::BatchOptions;
pub use scheduler::EngineHandle;

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// When set, `/v1/*`, `/tokenize`, `/detokenize` and `/infill` require
    /// `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`).
    pub api_key: Option<String>,
    /// The id `/v1/models` lists and requests must name (or leave out).
    pub model_name: String,
    pub max_body_bytes: usize,
    /// Requests that may wait for the engine; beyond it new ones get 503.
    pub queue_capacity: usize,
    /// The continuous batch's size and prefill budget (used where the backend has a batched
    /// step).
    pub batch: BatchOptions,
    /// Connection cap and timeouts.
    pub conn: ConnLimits,
    /// `/metrics` needs the API key too (when one is set).
    pub metrics_auth: bool,
    /// Origins whose pages may call the API (`*`: any); empty: no CORS headers.
    pub cors_origins: Vec<String>,
}

impl ServeConfig {
    /// Refuses settings that would weaken the server silently (an empty key, a bad origin).
    pub fn validate(&self) -> anyhow::Result<()> {
        auth::check_key(self.api_key.as_deref())?;
        cors::layer(&self.cors_origins)?;
        anyhow::ensure!(
            self.conn.max_connections > 0,
            "the connection cap must be at least 1"
        );
        Ok(())
    }
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            model_name: "q4moe".into(),
            max_body_bytes: 4 << 20,
            queue_capacity: 64,
            batch: BatchOptions::default(),
            conn: ConnLimits::default(),
            metrics_auth: true,
            cors_origins: Vec::new(),
        }
    }
}

/// The application over an engine worker (tests bind it to their own listener). Fails only on
/// settings [`ServeConfig::validate`] refuses.
pub fn router(handle: EngineHandle, cfg: &ServeConfig) -> anyhow::Result<Router> {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    auth::check_key(cfg.api_key.as_deref())?;
    let app = Arc::new(routes::AppState {
        engine: handle,
        model_name: cfg.model_name.clone(),
        created,
    });
    let key =
        axum::middleware::from_fn_with_state(auth::ApiKey(cfg.api_key.clone()), auth::require_key);
    let v1 = Router::new()
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/models", get(routes::models))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/infill", post(llama_infill::infill))
        .route_layer(key.clone());
    let metrics = Router::new().route("/metrics", get(routes::metrics));
    let metrics = if cfg.metrics_auth {
        metrics.route_layer(key)
    } else {
        metrics
    };
    let body = limits::BodyLimits {
        timeout: cfg.conn.body_timeout,
        max_bytes: cfg.max_body_bytes,
    };
    let router = Router::new()
        .merge(v1)
        .merge(metrics)
        .route("/health", get(routes::health))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(guards::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            body,
            limits::read_body,
        ))
        .layer(axum::middleware::from_fn(guards::require_json))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            routes::observe,
        ))
        .layer(axum::middleware::from_fn(anthropic_shape::reshape_errors))
        .layer(axum::middleware::from_fn(access_log::log_requests))
        .layer(DefaultBodyLimit::max(cfg.max_body_bytes))
        .with_state(app);
    // Outermost, so a browser's preflight is answered before the key is asked for.
    Ok(match cors::layer(&cfg.cors_origins)? {
        Some(c) => router.layer(c),
        None => router,
    })
}

/// Serves until Ctrl-C (or SIGTERM), letting requests in flight finish.
pub async fn serve(engine: q4moe_engine::Engine, cfg: ServeConfig) -> anyhow::Result<()> {
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", cfg.host, cfg.port))?;
    serve_on(listener, engine, cfg, shutdown_signal()).await
}

/// `serve` on a listener already bound, until `shutdown` resolves.
pub async fn serve_on(
    listener: TcpListener,
    engine: q4moe_engine::Engine,
    cfg: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    cfg.validate()?;
    if let Some(w) = auth::open_server_warning(&cfg.host, cfg.api_key.as_deref()) {
        tracing::warn!("{w}");
    }
    // --max-batch 1 serves one request at a time through `decode`, the single-stream path (on
    // CUDA its own kernels, not the batched step's).
    let batched = engine.batched_step() && cfg.batch.max_batch > 1;
    let mode = if batched {
        format!(
            "continuous batching: up to {} sequences, {} prompt tokens a step",
            cfg.batch.max_batch, cfg.batch.prefill_budget
        )
    } else if engine.batched_step() {
        "one request at a time (--max-batch 1)".to_string()
    } else {
        format!(
            "one request at a time: the {} backend has no batched step",
            engine.backend().info().kind
        )
    };
    let handle = EngineHandle::spawn(engine, cfg.queue_capacity, batched.then_some(cfg.batch))?;
    let app = router(handle, &cfg)?;
    tracing::info!(
        "serving '{}' on http://{} ({mode})",
        cfg.model_name,
        listener.local_addr()?
    );
    conn::serve(listener, app, cfg.conn, shutdown).await?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: finishing requests in flight");
}
