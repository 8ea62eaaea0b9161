//! The `q4moe` command line: run, chat, serve, bench, synth, inspect, tokenize, detokenize.

mod bench;
mod chat;
mod chat_cmd;
mod chat_input;
mod cuda_opts;
mod inspect;
mod npy;
mod run;
mod serve_cmd;
mod serve_limits;
mod synth_cmd;
mod template_args;
mod tokenize_cmd;

use clap::{Args, Parser, Subcommand};
use q4moe_engine::{Device, EngineOptions};
use q4moe_model::backend::KvType;

pub const COMMIT: &str = env!("Q4MOE_COMMIT");

#[derive(Parser)]
#[command(
    name = "q4moe",
    version,
    about = "Fast single-stream inference for q4 Mixture-of-Experts GGUF models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from one prompt, streaming it.
    Run(run::RunArgs),
    /// Interactive chat in the terminal.
    Chat(chat_cmd::ChatArgs),
    /// OpenAI-compatible HTTP server.
    Serve(serve_cmd::ServeArgs),
    /// Isolated decode benchmark (GPU: setup cache off vs on, in-flight 1 vs N; --batch: the
    /// batched decode step at several batch sizes, with its invariance check).
    Bench(bench::BenchArgs),
    /// Write a GGUF with random weights and a real geometry.
    Synth(synth_cmd::SynthArgs),
    /// Print a GGUF file's metadata and tensors.
    Inspect(inspect::InspectArgs),
    /// Token ids of a text (from an argument, -f FILE or standard input).
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Text of token ids (a JSON array or a list; from an argument, -f FILE or standard input).
    Detokenize(tokenize_cmd::DetokenizeArgs),
    /// Renders chat templates for a parent q4moe over standard input and output (internal).
    #[command(name = template_args::WORKER_SUBCOMMAND, hide = true)]
    TemplateWorker,
}

/// Options shared by every command that loads a model onto a backend.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Where the model runs: auto (the GPU when one is usable, else the CPU), cpu, or cuda
    /// (`gpu` is accepted as another name for cuda).
    #[arg(long, default_value = "auto", value_parser = DEVICES)]
    pub device: String,
    /// CPU threads for the forward pass, the calling thread included (default: every core,
    /// or RAYON_NUM_THREADS). Set once a process.
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// GPU: reuse per-session setup (offset tables, argument buffers, captured step) across
    /// tokens (on, off).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub setup_cache: String,
    /// GPU: decode steps kept in flight before reading tokens back.
    #[arg(long, default_value_t = 2)]
    pub in_flight: usize,
    /// Positions a session may hold (KV capacity, llama.cpp's -c), at most the model's context
    /// length.
    #[arg(short = 'c', long, default_value_t = 4096)]
    pub ctx: usize,
    /// MiB of KV every session may hold together, running requests and the conversations
    /// kept for prefix reuse (kept ones are dropped, least recently used first, when a request
    /// needs room; past it, the newest running request waits and picks up later). CPU: one pool
    /// of 16-position pages; CUDA: each session's own allocation, doubling from 256 positions.
    #[arg(long, default_value_t = 4096)]
    pub kv_cache_mb: usize,
    /// KV cache element type, f16 or f32: f16 halves the bytes attention reads a position (long
    /// contexts are bound by them) at a rounding of at most 2^-11 a value; f32 keeps them exact.
    #[arg(long, default_value = "f16", value_parser = KvType::parse)]
    pub kv_type: KvType,
    /// Prompt tokens the GPU prefills at once (each weight row read once a chunk); 0 runs the
    /// decode step once a prompt token. Default 1,024.
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// CPU: how activations meet the 4-bit weights: q8 (quantised to 8 bits as llama.cpp does;
    /// fast) or exact (f32 activations against the dequantised blocks: the float reference,
    /// several times slower).
    #[arg(long, default_value = "q8", value_parser = ["q8", "exact"])]
    pub precision: String,
    /// A CUDA backend option, KEY=VALUE (repeatable; `--cuda-opt help` lists the keys).
    #[arg(long = "cuda-opt", value_name = "KEY=VALUE", long_help = cuda_opts::long_help())]
    pub cuda_opt: Vec<String>,
    #[command(flatten)]
    pub template: template_args::TemplateArgs,
}

impl DeviceArgs {
    pub fn engine_options(&self) -> anyhow::Result<EngineOptions> {
        apply_threads(self.threads)?;
        let defaults = EngineOptions::default();
        let mut cuda = defaults.cuda.clone();
        cuda.setup_cache = self.setup_cache == "on";
        cuda.in_flight = self.in_flight.max(1);
        cuda.progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
        if let Some(chunk) = self.prefill_chunk {
            cuda.prefill_chunk = chunk;
        }
        Ok(EngineOptions {
            device: Device::parse(&self.device)?,
            kv_capacity: self.ctx,
            kv_type: self.kv_type,
            kv_cache_bytes: self.kv_cache_mb.saturating_mul(1 << 20),
            cuda: cuda_opts::apply(cuda, &self.cuda_opt)?,
            cpu_precision: match self.precision.as_str() {
                "exact" => q4moe_cpu::Precision::Exact,
                _ => q4moe_cpu::Precision::Q8,
            },
            template: self.template.options()?,
            ..defaults
        })
    }
}

/// Loads a model onto the chosen backend; on the CPU the file's pages are read in first (with a
/// progress bar) so the first tokens do not pay for disk reads.
pub fn load_engine(
    path: &std::path::Path,
    device: &DeviceArgs,
) -> anyhow::Result<q4moe_engine::Engine> {
    let opts = device.engine_options()?;
    let model = load_model(path)?;
    if opts.device == Device::Cpu || q4moe_cuda::cuda_available().is_err() {
        model.prefault(true);
    }
    Ok(q4moe_engine::Engine::from_model(model, &opts)?)
}

/// The values `--device` takes.
pub const DEVICES: [&str; 4] = ["auto", "cpu", "cuda", "gpu"];

/// Sets the CPU pool's thread count where `--threads` gave one.
pub fn apply_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        q4moe_cpu::set_threads(n).map_err(|e| anyhow::anyhow!("--threads {n}: {e}"))?;
    }
    Ok(())
}

/// Maps a model file, with one error line naming the path once (the loader's own message names
/// it already) and a plain word for a directory, which the kernel would call "No such device".
pub fn load_model(path: &std::path::Path) -> anyhow::Result<std::sync::Arc<q4moe_model::Model>> {
    use anyhow::Context;
    anyhow::ensure!(
        !path.is_dir(),
        "loading the model: {} is a directory, not a GGUF file",
        path.display()
    );
    let model = q4moe_model::Model::load(path).context("loading the model")?;
    Ok(std::sync::Arc::new(model))
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("Q4MOE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,q4moe_server=info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only where a person reads them: not in a log file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => chat_cmd::run(a),
        Command::Serve(a) => serve_cmd::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Synth(a) => synth_cmd::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Tokenize(a) => tokenize_cmd::tokenize(a),
        Command::Detokenize(a) => tokenize_cmd::detokenize(a),
        Command::TemplateWorker => q4moe_tokenizer::run_template_worker().map_err(Into::into),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
