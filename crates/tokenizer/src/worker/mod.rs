//! Rendering a chat template out of process. minijinja bounds a render's instructions (fuel)
//! and its output, but not the values its operators build: `~` doubles a string in a loop to
//! gigabytes, `"x"|list * 10**8` is a lazy sequence that printing walks whole, and a single
//! 100 MB repetition counts as one instruction. It has no hook on those operators, and a render
//! in progress cannot be stopped, so the only bound that holds for every path is the process:
//! a worker under an address-space rlimit, killed when a render passes its wall-clock limit.
//!
//! Workers stay warm between renders (the template is compiled once per worker), so a render
//! costs a pipe round trip over the in-process one; see docs/architecture.md for the figure.

mod pool;
mod process;
mod serve;
mod wire;

pub use pool::WorkerPool;
pub use process::{TemplateWorker, WorkerCommand};
pub use serve::run_template_worker;
