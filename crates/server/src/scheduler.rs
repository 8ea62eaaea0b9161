//! One engine, one worker thread, one bounded FIFO queue. The engine is Send but not Sync, so it
//! lives on the worker; handlers talk to it only through jobs and event channels. Every accepted
//! job gets exactly one `Done` or `Error` unless its client has gone (then nobody is listening).
//!
//! The worker runs the continuous batch (`batching`) when the backend has a batched step, and
//! otherwise, explicitly, one job at a time here (`serial_worker`). Prompts are rendered and
//! tokenised before a job is queued, on tokio's blocking pool with a clone of the engine's
//! `Prompter`: a hostile chat template or a huge prompt costs that request, never the engine
//! thread the running streams depend on.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use q4moe_engine::{
    BatchOptions, Batcher, ChatMessage, Engine, EngineError, Finish, Prompter, TokenLogprob,
    Tokenizer,
};
use tokio::sync::mpsc;

use crate::errors::{from_engine, ApiError};
use crate::fields::check_ids;
use crate::infill::Infill;
use crate::job::{prepare, report, take, BuiltPrompt, Job, Order, TextSender};
pub use crate::job::{Event, Started};
use crate::metrics::Metrics;
use crate::openai::{GenParams, Prompt, Usage};

#[derive(Clone)]
pub enum JobPrompt {
    Chat {
        messages: Vec<ChatMessage>,
        enable_thinking: Option<bool>,
        /// OpenAI's `tools` array, for the chat template to describe.
        tools: Option<serde_json::Value>,
    },
    Completion(Prompt),
    /// Fill-in-the-middle (infill.rs).
    Infill(Infill),
}

impl JobPrompt {
    /// The request field a prompt error is about.
    fn param(&self) -> &'static str {
        match self {
            JobPrompt::Chat { .. } => "messages",
            JobPrompt::Completion(_) => "prompt",
            JobPrompt::Infill(f) => f.fields.0,
        }
    }
}

/// Cloneable front of the worker. Dropping every clone ends the worker after its queue drains.
#[derive(Clone)]
pub struct EngineHandle {
    /// Held with the next sequence number, so numbering and queue order agree.
    tx: Arc<Mutex<(u64, mpsc::Sender<Job>)>>,
    pub metrics: Arc<Metrics>,
    prompter: Prompter,
}

/// A submitted job's event stream.
pub struct Ticket {
    pub seq: u64,
    pub events: mpsc::UnboundedReceiver<Event>,
}

impl Ticket {
    /// Waits for the engine to take the job (queue time) or reject it.
    pub async fn started(&mut self) -> Result<Started, ApiError> {
        match self.events.recv().await {
            Some(Event::Started(s)) => Ok(s),
            Some(Event::Error(e)) => Err(e),
            _ => Err(ApiError::internal("the engine worker stopped")),
        }
    }

    /// Gathers a whole (non-streamed) generation.
    pub async fn collect(&mut self) -> Result<(String, Finish, Usage), ApiError> {
        let c = self.collect_all().await?;
        Ok((c.text, c.finish, c.usage))
    }

    /// Gathers a whole generation with its logprobs and the stop string that ended it:
    /// exactly what its stream would carry.
    pub async fn collect_all(&mut self) -> Result<Collected, ApiError> {
        let (mut text, mut logprobs, mut prompt_logprobs) = (String::new(), vec![], vec![]);
        loop {
            match self.events.recv().await {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Logprobs(l)) => logprobs.extend(l),
                Some(Event::PromptLogprobs(l)) => prompt_logprobs = l,
                Some(Event::Done {
                    finish,
                    usage,
                    stop_sequence,
                }) => {
                    return Ok(Collected {
                        text,
                        finish,
                        usage,
                        stop_sequence,
                        logprobs,
                        prompt_logprobs,
                    })
                }
                Some(Event::Error(e)) => return Err(e),
                Some(Event::Started(_)) => {}
                None => return Err(ApiError::internal("the engine worker stopped")),
            }
        }
    }
}

/// A whole generation as `Ticket::collect_all` gathers it.
#[derive(Debug, Clone)]
pub struct Collected {
    pub text: String,
    pub finish: Finish,
    pub usage: Usage,
    /// The stop string that ended the text, if one did.
    pub stop_sequence: Option<String>,
    pub logprobs: Vec<TokenLogprob>,
    pub prompt_logprobs: Vec<TokenLogprob>,
}

impl EngineHandle {
    /// Moves the engine onto its worker thread, with room for `queue` waiting jobs. With
    /// `batch` and a backend that has a batched step, the worker runs a continuous batch;
    /// otherwise it serves one job at a time.
    pub fn spawn(
        engine: Engine,
        queue: usize,
        batch: Option<BatchOptions>,
    ) -> Result<EngineHandle, EngineError> {
        let batcher = match batch {
            Some(opts) if engine.batched_step() => Some(Batcher::new(opts)?),
            _ => None,
        };
        let (tx, rx) = mpsc::channel(queue.max(1));
        let metrics = Arc::new(Metrics::default());
        let prompter = engine.prompter();
        let m = metrics.clone();
        std::thread::Builder::new()
            .name("q4moe-engine".into())
            .spawn(move || match batcher {
                Some(b) => crate::batching::worker(engine, b, rx, m),
                None => serial_worker(engine, rx, m),
            })
            .expect("spawning the engine worker thread");
        Ok(EngineHandle {
            tx: Arc::new(Mutex::new((0, tx))),
            metrics,
            prompter,
        })
    }

    /// Positions one sequence may hold.
    pub fn context_capacity(&self) -> usize {
        self.prompter.context()
    }

    /// The chat template and tokenizer, for work that needs no engine (`/tokenize`).
    pub fn prompter(&self) -> &Prompter {
        &self.prompter
    }

    /// The length in tokens of a chat prompt, rendered and tokenised as [`Self::submit`] would,
    /// on the blocking pool.
    pub async fn count_chat_tokens(
        &self,
        messages: Vec<ChatMessage>,
        tools: Option<serde_json::Value>,
        enable_thinking: Option<bool>,
    ) -> Result<usize, ApiError> {
        let p = self.prompter.clone();
        tokio::task::spawn_blocking(move || {
            let text = p.render_chat_tools(&messages, tools.as_ref(), enable_thinking)?;
            p.encode_prompt(&text).map(|ids| ids.len())
        })
        .await
        .map_err(|_| ApiError::internal("counting the prompt failed (a panic)"))?
        .map_err(|e| from_engine(e, "messages"))
    }

    /// The model's tokenizer (token texts for logprobs, echoed token prompts).
    pub fn tokenizer(&self) -> &std::sync::Arc<Tokenizer> {
        self.prompter.tokenizer()
    }

    /// Renders and tokenises the prompt on the blocking pool, then queues the job; a full queue
    /// is refused at once (503) rather than waited on.
    pub async fn submit(&self, prompt: JobPrompt, gen: GenParams) -> Result<Ticket, ApiError> {
        let prompter = self.prompter.clone();
        let (prompt, gen) = tokio::task::spawn_blocking(move || {
            let mut gen = gen;
            let built = build_prompt(&prompter, &prompt, &mut gen);
            (built, gen)
        })
        .await
        .map_err(|_| ApiError::internal("building the prompt failed (a panic)"))?;
        let prompt = prompt?;
        let (etx, erx) = mpsc::unbounded_channel();
        let job = Job {
            prompt,
            gen,
            accepted: Instant::now(),
            events: etx,
            usage_log: crate::access_log::current(),
        };
        let mut guard = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        self.metrics.queue_delta(1);
        match guard.1.try_send(job) {
            Ok(()) => {
                guard.0 += 1;
                Ok(Ticket {
                    seq: guard.0,
                    events: erx,
                })
            }
            Err(e) => {
                self.metrics.queue_delta(-1);
                Err(match e {
                    mpsc::error::TrySendError::Full(_) => ApiError::busy(),
                    mpsc::error::TrySendError::Closed(_) => {
                        ApiError::internal("the engine worker stopped")
                    }
                })
            }
        }
    }
}

/// The fallback for backends without a batched step: one job at a time, each to its end.
fn serial_worker(mut engine: Engine, mut rx: mpsc::Receiver<Job>, metrics: Arc<Metrics>) {
    let mut order = Order::default();
    while let Some(job) = rx.blocking_recv() {
        let Some(ids) = take(&job, &mut order, &metrics) else {
            continue;
        };
        metrics.batch_size(1);
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run_job(&mut engine, &job, ids, &metrics)
        }));
        metrics.batch_size(0);
        metrics.kv_bytes(0, engine.cached_kv_bytes());
        metrics.kv_pool(engine.kv_pool());
        if outcome.is_err() {
            // The sessions' KV may be half-written: forget them and keep serving.
            engine.reset_sessions();
            metrics.finished("error");
            let _ = job.events.send(Event::Error(ApiError::internal(
                "the engine panicked on this request",
            )));
        }
    }
}

/// Renders and tokenises the prompt, sets the tokens to generate and compiles the output's
/// constraint into the sampling parameters.
fn build_prompt(
    p: &Prompter,
    prompt: &JobPrompt,
    gen: &mut GenParams,
) -> Result<BuiltPrompt, ApiError> {
    compile_constraint(p, prompt, gen)?;
    let param = prompt.param();
    let (ids, think_open) = match prompt {
        JobPrompt::Chat {
            messages,
            enable_thinking,
            tools,
        } => {
            let text = p
                .render_chat_tools(messages, tools.as_ref(), *enable_thinking)
                .map_err(|e| from_engine(e, param))?;
            let open = text.trim_end_matches('\n').ends_with("<think>");
            (
                p.encode_prompt(&text).map_err(|e| from_engine(e, param))?,
                open,
            )
        }
        JobPrompt::Completion(Prompt::Text(t)) => (
            p.encode_prompt(t).map_err(|e| from_engine(e, param))?,
            false,
        ),
        JobPrompt::Completion(Prompt::Tokens(ids)) => {
            check_ids(ids, p.vocab(), param)?;
            (ids.clone(), false)
        }
        JobPrompt::Infill(f) => (crate::infill::encode(p, f)?, false),
    };
    crate::logprobs::check_bias_ids(&gen.sampling.logit_bias, p.vocab())?;
    let max_tokens = budget(ids.len(), p.context(), gen, param)?;
    Ok(BuiltPrompt {
        ids,
        think_open,
        max_tokens,
        param,
    })
}

/// Compiles the request's grammar (400 naming its field when it is bad). A chat that thinks
/// first is constrained only after its `</think>`.
fn compile_constraint(
    p: &Prompter,
    prompt: &JobPrompt,
    gen: &mut GenParams,
) -> Result<(), ApiError> {
    let Some(field) = &gen.grammar else {
        return Ok(());
    };
    let thinks = matches!(
        prompt,
        JobPrompt::Chat {
            enable_thinking: Some(true),
            ..
        }
    );
    let after = thinks.then(|| p.tokenizer().token_id("</think>")).flatten();
    let constraint = p.grammars().compile(&field.grammar, after).map_err(|e| {
        ApiError::invalid(
            field.param,
            format!("'{}' cannot be used: {e}", field.param),
        )
    })?;
    gen.sampling.constraint = Some(constraint);
    Ok(())
}

/// Tokens to generate: what was asked, which must fit beside the prompt, else what fits.
fn budget(prompt: usize, context: usize, gen: &GenParams, param: &str) -> Result<usize, ApiError> {
    if prompt >= context {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt is {prompt} tokens; this model's context holds {context} positions"
            ),
        )
        .with_status(
            axum::http::StatusCode::BAD_REQUEST,
            "context_length_exceeded",
        ));
    }
    match gen.max_tokens {
        Some(m) if prompt + m > context => Err(ApiError::invalid(
            gen.max_tokens_param,
            format!("the prompt ({prompt} tokens) plus {} = {m} exceeds the context of {context} positions", gen.max_tokens_param),
        )
        .with_status(axum::http::StatusCode::BAD_REQUEST, "context_length_exceeded")),
        Some(m) => Ok(m),
        None => Ok(context - prompt),
    }
}

fn run_job(engine: &mut Engine, job: &Job, ids: Started, metrics: &Arc<Metrics>) {
    let admitted = Instant::now();
    let req = prepare(job, ids);
    let mut sender = TextSender {
        events: job.events.clone(),
        metrics: metrics.clone(),
        last: None,
    };
    let result = engine.generate_pieces(&req, &mut |p| sender.piece(p));
    report(job, admitted, result, metrics);
}
