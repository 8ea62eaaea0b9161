//! The chat template's limits (issue 55 item 2), parsed into the engine's typed options here.
//! Every command that loads a model renders its template in warm worker processes of this same
//! binary (the hidden `template-worker` subcommand), each under the memory limit and killed past
//! the time limit: the template comes from the model file and may be hostile.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use q4moe_engine::{TemplateIsolation, TemplateLimits, TemplateOptions, WorkerCommand};

/// The hidden subcommand that runs a template worker.
pub const WORKER_SUBCOMMAND: &str = "template-worker";

#[derive(Args, Clone, Debug)]
pub struct TemplateArgs {
    /// Template instructions one chat render may execute.
    #[arg(long, default_value_t = TemplateLimits::default().fuel)]
    template_fuel: u64,
    /// MiB one chat render may output.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    template_output_mb: u64,
    /// MiB of address space a template worker may use (its own code included).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(64..=1 << 20))]
    template_memory_mb: u64,
    /// Time one chat render may take (e.g. 2s, 500ms).
    #[arg(long, default_value = "2s", value_parser = crate::serve_limits::parse_duration)]
    template_timeout: Duration,
    /// Template worker processes at most (renders beyond them wait for one).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    template_workers: u32,
}

impl TemplateArgs {
    pub fn options(&self) -> anyhow::Result<TemplateOptions> {
        let program = std::env::current_exe().context("locating the q4moe binary")?;
        Ok(TemplateOptions {
            limits: TemplateLimits {
                fuel: self.template_fuel,
                max_output_bytes: (self.template_output_mb << 20) as usize,
                max_memory_bytes: (self.template_memory_mb << 20) as usize,
                max_time: self.template_timeout,
            },
            isolation: TemplateIsolation::Workers {
                command: WorkerCommand::new(program, &[WORKER_SUBCOMMAND]),
                max_workers: self.template_workers as usize,
            },
        })
    }
}
