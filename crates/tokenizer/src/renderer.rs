//! Where a chat template renders: in this process, or in worker processes that bound its memory
//! and time as well (see `worker`). Front ends choose at the edge; the engine holds the result.

use crate::worker::{WorkerCommand, WorkerPool};
use crate::{ChatMessage, ChatTemplate, TemplateLimits, TokenizerError};

/// How the model's chat template renders.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateOptions {
    pub limits: TemplateLimits,
    pub isolation: TemplateIsolation,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TemplateIsolation {
    /// In the calling thread: fuel and output are bounded, memory and time are not. For
    /// templates one trusts, and tests.
    #[default]
    InProcess,
    /// In up to `max_workers` warm worker processes that `command` starts, each under the
    /// memory limit and killed past the time limit.
    Workers {
        command: WorkerCommand,
        max_workers: usize,
    },
}

/// A compiled chat template and where it renders.
pub enum TemplateRenderer {
    InProcess(ChatTemplate),
    Workers(WorkerPool),
}

impl TemplateRenderer {
    /// Compiles `source` (in a first worker, when isolated): a syntax error fails here.
    pub fn new(source: &str, opts: &TemplateOptions) -> Result<Self, TokenizerError> {
        Ok(match &opts.isolation {
            TemplateIsolation::InProcess => {
                Self::InProcess(ChatTemplate::with_limits(source, opts.limits)?)
            }
            TemplateIsolation::Workers {
                command,
                max_workers,
            } => Self::Workers(WorkerPool::new(
                source,
                command.clone(),
                opts.limits,
                *max_workers,
            )?),
        })
    }

    /// [`ChatTemplate::render_tools`], wherever the template renders; the text is the same.
    pub fn render_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        match self {
            Self::InProcess(t) => {
                t.render_tools(messages, tools, add_generation_prompt, enable_thinking)
            }
            Self::Workers(p) => {
                p.render_tools(messages, tools, add_generation_prompt, enable_thinking)
            }
        }
    }
}
