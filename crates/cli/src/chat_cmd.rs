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
        },
    )
}
