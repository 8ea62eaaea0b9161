//! The worker over a continuous batch: jobs join the running batch at step boundaries (while
//! it has room; the rest wait in the bounded queue), each sequence streams through its own
//! sink, and a client that goes away frees its slot at the next step.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use q4moe_engine::{Batcher, Engine, EngineError, Flow, GenerateOutput, Piece, SequenceSink};
use tokio::sync::mpsc;

use crate::job::{prepare, report, take, Job, Order, TextSender};
use crate::metrics::Metrics;

/// One job's sequence in the batch: its text goes to the client, its end to `report`.
struct JobSink {
    job: Job,
    admitted: Instant,
    text: TextSender,
}

impl SequenceSink for JobSink {
    fn piece(&mut self, piece: Piece<'_>) -> Flow {
        self.text.piece(piece)
    }

    fn cancelled(&self) -> bool {
        self.job.events.is_closed()
    }

    fn finished(self: Box<Self>, result: Result<GenerateOutput, EngineError>) {
        report(&self.job, self.admitted, result, &self.text.metrics);
    }
}

/// How often a running batch refreshes the KV byte gauges.
const KV_GAUGES_EVERY: Duration = Duration::from_millis(200);

pub(crate) fn worker(
    mut engine: Engine,
    mut batch: Batcher,
    mut rx: mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
) {
    let mut order = Order::default();
    let mut kv_counted: Option<Instant> = None;
    loop {
        // Admit at the step boundary; wait for work only when nothing runs.
        while batch.has_room() {
            let job = if batch.is_empty() {
                match rx.blocking_recv() {
                    Some(job) => job,
                    None => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                }
            };
            admit(&mut engine, &mut batch, job, &mut order, &metrics);
        }
        metrics.batch_size(batch.running());
        if batch.is_empty() {
            continue;
        }
        let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| batch.step(&mut engine)));
        if stepped.is_err() {
            // The batch's KV may be half-written: end its sequences with an error, forget
            // every session and keep serving.
            batch.abort(&mut engine, "the engine panicked in a batched step");
            engine.reset_sessions();
        }
        metrics.batch_size(batch.running());
        // The KV byte gauges walk every kept session's pages (the CPU counts shared pages once
        // through a set of page ids): a few times a second, not every step, and when the batch
        // empties.
        if batch.is_empty() || kv_counted.is_none_or(|t| t.elapsed() >= KV_GAUGES_EVERY) {
            metrics.kv_bytes(batch.kv_bytes(&engine), engine.cached_kv_bytes());
            kv_counted = Some(Instant::now());
        }
        metrics.kv_pool(engine.kv_pool());
        metrics.preemptions(batch.preemptions());
    }
}

fn admit(engine: &mut Engine, batch: &mut Batcher, job: Job, order: &mut Order, m: &Arc<Metrics>) {
    let Some(ids) = take(&job, order, m) else {
        return;
    };
    let admitted = Instant::now();
    let req = prepare(&job, ids);
    let text = TextSender {
        events: job.events.clone(),
        metrics: m.clone(),
        last: None,
    };
    let sink = JobSink {
        job,
        admitted,
        text,
    };
    batch.admit(engine, req, Box::new(sink));
}
