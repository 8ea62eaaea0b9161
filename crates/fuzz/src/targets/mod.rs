//! The fuzz targets. Each turns bytes into a call of the code under test and checks what must
//! hold whatever the input: no panic, and the target's own properties (a round trip, a limit).

mod gguf;
mod request;
mod selftest;
mod template;
mod tokenizer;

use std::path::PathBuf;

use q4moe_tokenizer::WorkerCommand;

use crate::FuzzError;

pub trait Target {
    fn name(&self) -> &'static str;
    /// Inputs are cut to this many bytes.
    fn max_len(&self) -> usize;
    /// Words the parser branches on, spliced into mutants.
    fn dict(&self) -> &'static [&'static [u8]];
    /// `Ok`: what kind of result the input had (the feedback signal); `Err`: a property failed.
    fn run(&mut self, input: &[u8]) -> Result<String, String>;
}

pub const TARGET_NAMES: [&str; 4] = ["gguf", "tokenizer", "template", "request"];

/// What a target may need from its caller.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    /// A folder the target may write to (the GGUF loader reads files).
    pub scratch: PathBuf,
    /// A GGUF whose tokenizer the `tokenizer` target uses instead of the synthetic one (the
    /// real Qwen vocabulary from `tools/qwen_vocab.py`).
    pub vocab: Option<PathBuf>,
    /// The program the `template` target renders in (the product's template worker); `None`
    /// renders in this process.
    pub template_worker: Option<WorkerCommand>,
}

impl TargetConfig {
    pub fn new(scratch: impl Into<PathBuf>) -> Self {
        Self {
            scratch: scratch.into(),
            vocab: None,
            template_worker: None,
        }
    }
}

/// A target by name. `selftest` is the harness's own target: it panics, aborts, hangs or
/// over-allocates on demand.
pub fn target_by_name(name: &str, c: &TargetConfig) -> Result<Box<dyn Target>, FuzzError> {
    Ok(match name {
        "gguf" => Box::new(gguf::Gguf::new(&c.scratch)?),
        "tokenizer" => Box::new(tokenizer::TokenizerTarget::new(c.vocab.as_deref())?),
        "template" => Box::new(template::Template::new(c.template_worker.as_ref())),
        "request" => Box::new(request::Request),
        "selftest" => Box::new(selftest::SelfTest),
        other => return Err(FuzzError::UnknownTarget(other.into())),
    })
}
