//! A job's life on the worker, shared by the serial worker (scheduler.rs) and the continuous
//! batch (batching.rs): its prompt as built before queueing, taking it off the queue, the
//! engine's request, streaming its text, and its one `Done` or `Error`.

use std::sync::Arc;
use std::time::Instant;

use q4moe_engine::{
    EngineError, Finish, Flow, GenerateOutput, GenerateRequest, Piece, TokenLogprob,
};
use tokio::sync::mpsc;

use crate::access_log::UsageCell;
use crate::errors::{from_engine, ApiError};
use crate::metrics::Metrics;
use crate::openai::{GenParams, Usage};

/// A job's prompt, rendered and tokenised off the engine thread.
pub(crate) struct BuiltPrompt {
    pub ids: Vec<u32>,
    /// The chat template's generation prompt opened a `<think>` block.
    pub think_open: bool,
    /// Tokens to generate (what was asked, or what fits beside the prompt).
    pub max_tokens: usize,
    /// The request field a prompt error is about.
    pub param: &'static str,
}

pub(crate) struct Job {
    pub prompt: BuiltPrompt,
    pub gen: GenParams,
    pub accepted: Instant,
    pub events: mpsc::UnboundedSender<Event>,
    /// The request's access-log line learns the token counts here.
    pub usage_log: Option<UsageCell>,
}

#[derive(Debug)]
pub enum Event {
    /// The prompt was accepted by the engine; generation begins.
    Started(Started),
    /// The logprobs of the tokens behind the next `Text` (sent just before it).
    Logprobs(Vec<TokenLogprob>),
    /// With `echo` and logprobs: the prompt's, before any text.
    PromptLogprobs(Vec<TokenLogprob>),
    Text(String),
    Done {
        finish: Finish,
        usage: Usage,
        /// The stop string that ended the text, if one did.
        stop_sequence: Option<String>,
    },
    Error(ApiError),
}

#[derive(Debug, Clone, Copy)]
pub struct Started {
    /// The chat template's generation prompt opened a `<think>` block.
    pub think_open: bool,
    /// Order in which the worker began jobs (1, 2, ...), to check the queue is FIFO.
    pub run: u64,
    /// Order in which jobs were accepted into the queue.
    pub seq: u64,
    /// The prompt's length in tokens.
    pub prompt_tokens: usize,
}

/// Jobs counted as the worker takes them off the queue.
#[derive(Default)]
pub(crate) struct Order {
    seq: u64,
    run: u64,
}

/// Takes a job off the queue: `None` when its client already left (it costs the engine
/// nothing), else the ids it starts with.
pub(crate) fn take(job: &Job, order: &mut Order, metrics: &Metrics) -> Option<Started> {
    metrics.queue_delta(-1);
    order.seq += 1;
    if job.events.is_closed() {
        metrics.cancelled();
        metrics.finished("cancelled");
        return None;
    }
    order.run += 1;
    metrics.queue_wait(job.accepted.elapsed().as_secs_f64());
    Some(Started {
        think_open: false,
        run: order.run,
        seq: order.seq,
        prompt_tokens: job.prompt.ids.len(),
    })
}

/// The engine's request for a job (its prompt was built when it was submitted); the client is
/// told it started.
pub(crate) fn prepare(job: &Job, ids: Started) -> GenerateRequest {
    let think_open = job.prompt.think_open;
    let _ = job
        .events
        .send(Event::Started(Started { think_open, ..ids }));
    GenerateRequest {
        prompt: job.prompt.ids.clone(),
        max_tokens: job.prompt.max_tokens,
        sampling: job.gen.sampling.clone(),
        stop: job.gen.stop.clone(),
        stop_at_eos: !job.gen.ignore_eos,
        want_logits: false,
        reuse_prefix: true,
        logprobs: job.gen.logprobs,
    }
}

/// Streams a job's text to its client, timing the gaps; `Stop` once the client is gone.
pub(crate) struct TextSender {
    pub events: mpsc::UnboundedSender<Event>,
    pub metrics: Arc<Metrics>,
    pub last: Option<Instant>,
}

impl TextSender {
    /// A piece of the generation: its logprobs (when any) go just before its text.
    pub fn piece(&mut self, piece: Piece<'_>) -> Flow {
        let sent = match piece {
            Piece::Prompt(lps) => self.events.send(Event::PromptLogprobs(lps.to_vec())),
            // Tokens without text (the last ones): only their logprobs.
            Piece::Text { text: "", logprobs } => {
                self.events.send(Event::Logprobs(logprobs.to_vec()))
            }
            Piece::Text { text, logprobs } => {
                if !logprobs.is_empty() {
                    let _ = self.events.send(Event::Logprobs(logprobs.to_vec()));
                }
                return self.send(text);
            }
        };
        if sent.is_ok() {
            Flow::Continue
        } else {
            Flow::Stop
        }
    }

    pub fn send(&mut self, text: &str) -> Flow {
        let now = Instant::now();
        if let Some(last) = self.last.replace(now) {
            self.metrics.inter_token((now - last).as_secs_f64());
        }
        if self.events.send(Event::Text(text.to_string())).is_ok() {
            Flow::Continue
        } else {
            Flow::Stop
        }
    }
}

/// A job's one `Done` or `Error`, and its metrics. `admitted` is when the engine took it.
pub(crate) fn report(
    job: &Job,
    admitted: Instant,
    result: Result<GenerateOutput, EngineError>,
    metrics: &Metrics,
) {
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            metrics.finished("error");
            let _ = job
                .events
                .send(Event::Error(from_engine(e, job.prompt.param)));
            return;
        }
    };
    let ttft = (admitted - job.accepted + out.prefill_time).as_secs_f64();
    let n = out.tokens.len();
    let tpot = (n > 1).then(|| out.decode_time.as_secs_f64() / (n - 1) as f64);
    metrics.generation(
        out.prompt_tokens,
        out.cached_tokens,
        n,
        (n > 0).then_some(ttft),
        tpot,
    );
    if out.finish == Finish::Cancelled {
        metrics.cancelled();
    }
    metrics.finished(match out.finish {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::Cancelled => "cancelled",
    });
    let usage = Usage {
        prompt_tokens: out.prompt_tokens,
        completion_tokens: n,
        cached_tokens: out.cached_tokens,
    };
    if let Some(cell) = &job.usage_log {
        cell.set(usage);
    }
    let _ = job.events.send(Event::Done {
        finish: out.finish,
        usage,
        stop_sequence: out.stop_sequence,
    });
}
