use std::path::PathBuf;

use clap::Args;
use q4moe_server::{BatchOptions, ServeConfig};

use crate::DeviceArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[arg(long, short)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer <key>` on /v1/*.
    #[arg(long, env = "Q4MOE_API_KEY")]
    api_key: Option<String>,
    /// The model id clients name (default: the file's stem).
    #[arg(long)]
    model_name: Option<String>,
    /// Requests that may wait for the engine before new ones are refused with 503.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Sequences decoded together in one batched step (1 to 256), where the backend has one;
    /// 1, or a backend without one, serves one request at a time through the single-stream
    /// decode.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Prompt tokens prefilled per step across newly admitted requests, so running streams keep
    /// flowing while a long prompt comes in.
    #[arg(long, default_value_t = 512)]
    prefill_budget: usize,
    #[command(flatten)]
    limits: crate::serve_limits::ServeLimitArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let batch = BatchOptions {
        max_batch: a.max_batch,
        prefill_budget: a.prefill_budget,
    };
    batch.validate()?;
    let stem = a
        .model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "q4moe".into());
    let mut cfg = ServeConfig {
        host: a.host,
        port: a.port,
        api_key: a.api_key,
        model_name: a.model_name.unwrap_or(stem),
        queue_capacity: a.queue.max(1),
        batch,
        ..ServeConfig::default()
    };
    a.limits.apply(&mut cfg);
    // Refused before the (slow) model load: an empty key, a bad origin.
    cfg.validate()?;
    let engine = crate::load_engine(&a.model, &a.device)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(q4moe_server::serve(engine, cfg))
}
