use std::path::PathBuf;

use clap::Args;

use crate::chat::{run_chat, ChatOptions};
use crate::run::SamplingArgs;
use crate::DeviceArgs;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    model: PathBuf,
    /// The system message that opens the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Tokens per answer at most.
    #[arg(short = 'n', long, default_value_t = 1024)]
    max_tokens: usize,
    /// Qwen3's thinking switch (on/off); default is the template's.
    #[arg(long, value_parser = ["on", "off"])]
    think: Option<String>,
    /// The file the line editor keeps its history in (default: ~/.q4moe_history).
    #[arg(long, value_name = "FILE", conflicts_with = "no_history")]
    history: Option<PathBuf>,
    /// Keep no history file.
    #[arg(long)]
    no_history: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(a: ChatArgs) -> anyhow::Result<()> {
    let engine = crate::load_engine(&a.model, &a.device)?;
    run_chat(
        engine,
        ChatOptions {
            system: a.system,
            sampling: a.sampling.params(),
            max_tokens: a.max_tokens,
            enable_thinking: a.think.map(|t| t == "on"),
            history: match (a.no_history, a.history) {
                (true, _) => None,
                (false, Some(h)) => Some(h),
                // The edge reads the environment: HOME names where the history goes.
                (false, None) => {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".q4moe_history"))
                }
            },
        },
    )
}
