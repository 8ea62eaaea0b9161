//! The `q4moe` command line: run, chat, serve, bench, synth, inspect.

mod bench;
mod inspect;
mod npy;
mod run;
mod synth_cmd;

use clap::{Args, Parser, Subcommand};
use q4moe_engine::{Device, EngineOptions};

pub const COMMIT: &str = env!("Q4MOE_COMMIT");

#[derive(Parser)]
#[command(name = "q4moe", version, about = "Fast single-stream inference for q4 Mixture-of-Experts GGUF models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from one prompt, streaming it.
    Run(run::RunArgs),
    /// Isolated decode benchmark (setup cache off vs on, in-flight 1 vs N).
    Bench(bench::BenchArgs),
    /// Write a GGUF with random weights and a real geometry.
    Synth(synth_cmd::SynthArgs),
    /// Print a GGUF file's metadata and tensors.
    Inspect(inspect::InspectArgs),
}

/// Options shared by every command that loads a model onto a backend.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// auto picks the GPU when one is usable.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Reuse per-session setup (offset tables, argument buffers, captured step) across tokens.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub setup_cache: String,
    /// Decode steps kept in flight on the GPU before reading tokens back.
    #[arg(long, default_value_t = 2)]
    pub in_flight: usize,
    /// Positions a session may hold (KV capacity), at most the model's context length.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
}

impl DeviceArgs {
    pub fn engine_options(&self) -> anyhow::Result<EngineOptions> {
        Ok(EngineOptions {
            device: Device::parse(&self.device)?,
            kv_capacity: self.ctx,
            setup_cache: self.setup_cache == "on",
            in_flight: self.in_flight.max(1),
            ..EngineOptions::default()
        })
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("Q4MOE_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Synth(a) => synth_cmd::run(a),
        Command::Inspect(a) => inspect::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
