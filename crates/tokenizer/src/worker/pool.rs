//! Warm workers for one template: a render takes an idle worker (or starts one, up to the
//! pool's size, else waits for one), and gives it back after. A worker that died or overran is
//! replaced at once by the call that ended it, so the hostile request pays for the restart and
//! the next one finds a warm worker.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::{TemplateWorker, WorkerCommand};
use crate::{ChatMessage, TemplateLimits, TokenizerError};

pub struct WorkerPool {
    source: String,
    command: WorkerCommand,
    limits: TemplateLimits,
    max_workers: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
}

struct PoolState {
    idle: Vec<TemplateWorker>,
    /// Workers idle, rendering or starting.
    live: usize,
}

impl WorkerPool {
    /// Starts one worker with `source` compiled, so a template that does not compile, or a
    /// command that does not start, fails here rather than at the first request.
    pub fn new(
        source: &str,
        command: WorkerCommand,
        limits: TemplateLimits,
        max_workers: usize,
    ) -> Result<Self, TokenizerError> {
        let first = TemplateWorker::start(&command, limits, source)?;
        Ok(Self {
            source: source.to_string(),
            command,
            limits,
            max_workers: max_workers.max(1),
            state: Mutex::new(PoolState {
                idle: vec![first],
                live: 1,
            }),
            freed: Condvar::new(),
        })
    }

    pub fn limits(&self) -> TemplateLimits {
        self.limits
    }

    pub fn render_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let mut w = self.checkout()?;
        let out = w.render(messages, tools, add_generation_prompt, enable_thinking);
        self.checkin(w);
        out
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start(&self) -> Result<TemplateWorker, TokenizerError> {
        TemplateWorker::start(&self.command, self.limits, &self.source)
    }

    fn checkout(&self) -> Result<TemplateWorker, TokenizerError> {
        let mut s = self.lock();
        loop {
            if let Some(w) = s.idle.pop() {
                return Ok(w);
            }
            if s.live < self.max_workers {
                s.live += 1;
                drop(s);
                return self.start().inspect_err(|_| self.forget_one());
            }
            s = self.freed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn checkin(&self, w: TemplateWorker) {
        let w = if w.is_alive() {
            Some(w)
        } else {
            drop(w);
            // Without a replacement the slot frees, and the next render starts one.
            self.start().ok()
        };
        match w {
            Some(w) => self.lock().idle.push(w),
            None => self.lock().live -= 1,
        }
        self.freed.notify_one();
    }

    fn forget_one(&self) {
        self.lock().live -= 1;
        self.freed.notify_one();
    }
}
