//! Serves a GGUF (or a synthetic tiny model written to a temp dir) until Ctrl-C, for driving the
//! server by hand or with dev/openai_e2e before the CLI's `serve` exists.
//!
//! cargo run -p q4moe-server --example serve_tiny -- [--model F.gguf] [--port 8080] [--api-key K] [--device cpu]

use q4moe_engine::{Device, Engine, EngineOptions};
use q4moe_server::ServeConfig;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let model = match arg("--model") {
        Some(m) => m.into(),
        None => {
            let path = dir.path().join("tiny.gguf");
            q4moe_model::synth::write(
                &path,
                &q4moe_model::Config::tiny(),
                q4moe_model::synth::SynthQuant::Q4_0,
                0,
                false,
            )?;
            path
        }
    };
    let device = Device::parse(&arg("--device").unwrap_or_else(|| "cpu".into()))?;
    let engine = Engine::load(
        &model,
        &EngineOptions {
            device,
            ..Default::default()
        },
    )?;
    let cfg = ServeConfig {
        port: arg("--port").map_or(Ok(8080), |p| p.parse())?,
        api_key: arg("--api-key"),
        model_name: arg("--model-name").unwrap_or_else(|| "q4moe".into()),
        ..Default::default()
    };
    eprintln!(
        "serving {} on http://{}:{}",
        model.display(),
        cfg.host,
        cfg.port
    );
    q4moe_server::serve(engine, cfg).await
}
