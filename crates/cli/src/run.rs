use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use clap::Args;
use q4moe_engine::{ChatMessage, Engine, Flow, GenerateRequest, RenderedPrompt, SamplingParams};

use crate::DeviceArgs;

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature (also --temp); 0 picks the most likely token (greedy).
    #[arg(long, visible_alias = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens before sampling; 0 keeps all.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: keep the most likely tokens whose probabilities sum to p; 1 keeps all.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the most likely one; 0 keeps all.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalty on tokens already in the context (1 = none; llama.cpp's --repeat-penalty).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Seed of the sampler's random draws (the same seed gives the same text).
    #[arg(short = 's', long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    pub model: PathBuf,
    /// The prompt text; `-` reads it from standard input.
    #[arg(long, short, required_unless_present = "file", conflicts_with = "file")]
    pub prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: the system message.
    #[arg(long)]
    pub system: Option<String>,
    /// With --chat: Qwen3's thinking switch (on/off); default is the template's.
    #[arg(long, value_parser = ["on", "off"])]
    pub think: Option<String>,
    /// Stop when this string is generated (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Write each step's logits as float32 [steps, vocab] to this .npy file.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// The prompt as given: `-p TEXT`, `-p -` (standard input) or `-f FILE`.
pub fn read_prompt(prompt: Option<&str>, file: Option<&Path>) -> anyhow::Result<String> {
    use anyhow::Context;
    match (prompt, file) {
        (_, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading the prompt file {}", f.display())),
        (Some("-"), None) => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from standard input")?;
            Ok(s)
        }
        (Some(p), None) => Ok(p.to_string()),
        (None, None) => anyhow::bail!("no prompt: give -p TEXT, -p - (stdin) or -f FILE"),
    }
}

/// The raw prompt keeps parsing control tokens; a chat's messages do not.
fn prompt_text(engine: &Engine, a: &RunArgs, prompt: String) -> anyhow::Result<RenderedPrompt> {
    if !a.chat {
        return Ok(RenderedPrompt::plain(prompt));
    }
    let mut msgs = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage::system(s.clone()));
    }
    msgs.push(ChatMessage::user(prompt));
    Ok(engine.render_chat(&msgs, a.think.as_deref().map(|t| t == "on"))?)
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let text = read_prompt(a.prompt.as_deref(), a.file.as_deref())?;
    let mut engine = crate::load_engine(&a.model, &a.device)?;
    let prompt = engine.encode_prompt(&prompt_text(&engine, &a, text)?)?;
    let mut req = GenerateRequest::new(prompt, a.max_tokens);
    req.sampling = a.sampling.params();
    req.stop = a.stop.clone();
    req.stop_at_eos = !a.ignore_eos;
    req.want_logits = a.logits_out.is_some();
    let mut stdout = std::io::stdout();
    let out = engine.generate(&req, &mut |text| {
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
        Flow::Continue
    })?;
    println!();
    if let Some(path) = &a.logits_out {
        crate::npy::write_f32_matrix(path, &out.logits, engine.model.config.vocab_size)?;
    }
    let decoded = out.tokens.len().saturating_sub(1);
    let info = engine.backend().info();
    eprintln!(
        "[{}, KV {}] prompt {} tok in {:.2} s ({:.1} tok/s) | decode {} tok in {:.2} s ({:.1} tok/s) | finish {:?}",
        info.device,
        info.kv_type.name(),
        out.prompt_tokens,
        out.prefill_time.as_secs_f64(),
        out.prompt_tokens as f64 / out.prefill_time.as_secs_f64(),
        decoded,
        out.decode_time.as_secs_f64(),
        decoded as f64 / out.decode_time.as_secs_f64().max(1e-9),
        out.finish,
    );
    Ok(())
}
