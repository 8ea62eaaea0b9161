//! Continuous batching over the backend's batched step: sequences join at step boundaries,
//! their prompts are prefilled in chunks under a per-iteration token budget, every sequence
//! whose prompt is in advances one token per `Backend::step_batch`, and a finished or cancelled
//! sequence leaves at once, its session back in the store for prefix reuse.
//!
//! A sequence's output is the same as `Engine::generate` gives the same request alone: the
//! backend's step is batch-invariant, each sequence keeps its own seeded `Sampler` (built from
//! the prompt as `decode` builds it), and tokens are accepted by the same `Collector`.

use std::time::Instant;

use q4moe_model::backend::{
    BackendError, BatchOut, BatchRow, DecodeStats, Flow, Logits, SessionId,
};
use q4moe_model::sampling::Sampler;

use crate::collect::{Collector, Outcome};
use crate::logprobs::{prompt_logprobs, Piece, PROMPT_LOGITS_CHUNK};
use crate::{Engine, EngineError, GenerateOutput, GenerateRequest, Result};

/// How many sequences run at once and how much prompt a step takes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOptions {
    /// Sequences in the running batch, 1 to `MAX_BATCH`.
    pub max_batch: usize,
    /// Prompt tokens prefilled per iteration, across the sequences still taking in their
    /// prompts, before the batch's decode step: bounds how long running streams wait.
    pub prefill_budget: usize,
}

impl BatchOptions {
    pub const MAX_BATCH: usize = 256;

    pub fn validate(&self) -> Result<()> {
        if !(1..=Self::MAX_BATCH).contains(&self.max_batch) {
            return Err(EngineError::Invalid(format!(
                "the batch size {} is outside 1..={}",
                self.max_batch,
                Self::MAX_BATCH
            )));
        }
        if self.prefill_budget == 0 {
            return Err(EngineError::Invalid(
                "the prefill budget must be at least one token a step".into(),
            ));
        }
        Ok(())
    }
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            max_batch: 16,
            prefill_budget: 512,
        }
    }
}

/// Where one sequence's results go. Every admitted sequence gets exactly one `finished`.
pub trait SequenceSink: Send {
    /// Text as it becomes safe to show (and logprobs, when asked for); `Flow::Stop` cancels
    /// the sequence.
    fn piece(&mut self, piece: Piece<'_>) -> Flow;
    /// Checked at every step boundary: true frees the sequence's slot at once (a client that
    /// went away), whether or not it had text to take.
    fn cancelled(&self) -> bool;
    fn finished(self: Box<Self>, result: Result<GenerateOutput>);
}

struct Sequence {
    req: GenerateRequest,
    session: SessionId,
    /// Prompt tokens already in the session's KV before this request.
    cached: usize,
    /// Prompt tokens in the KV now; decoding starts at `prompt.len() - 1` (the last prompt
    /// token is the first decode step's input, as in `generate`).
    fed: usize,
    max_tokens: usize,
    /// The token the next step feeds.
    next: u32,
    sampler: Sampler,
    collector: Collector,
    sink: Box<dyn SequenceSink>,
    admitted: Instant,
    /// Finished (stopped, out of tokens, cancelled): leaves at the next retirement.
    done: bool,
}

impl Sequence {
    fn prompt_in(&self) -> bool {
        self.fed + 1 == self.req.prompt.len()
    }
}

/// What `Batcher::share` did for a sequence about to prefill.
enum Share {
    /// No earlier sequence shares more of its prompt than it has.
    None,
    /// Its KV now holds the prefix an earlier sequence computed.
    Forked,
    /// An earlier sequence is still computing the prefix they share.
    Wait,
}

/// The running batch. The caller owns the loop: `admit` at step boundaries, then `step`.
pub struct Batcher {
    opts: BatchOptions,
    /// In admission order: prompts are prefilled first come, first served.
    seqs: Vec<Sequence>,
    out: BatchOut,
}

impl Batcher {
    pub fn new(opts: BatchOptions) -> Result<Batcher> {
        opts.validate()?;
        Ok(Batcher {
            opts,
            seqs: Vec::new(),
            out: BatchOut::default(),
        })
    }

    pub fn options(&self) -> BatchOptions {
        self.opts
    }

    /// Sequences admitted and not yet finished.
    pub fn running(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Bytes the running sequences' KV takes (a page they share counted once).
    pub fn kv_bytes(&self, engine: &Engine) -> usize {
        let ids: Vec<SessionId> = self.seqs.iter().map(|s| s.session).collect();
        engine.backend.kv_bytes_of(&ids)
    }

    pub fn has_room(&self) -> bool {
        self.seqs.len() < self.opts.max_batch
    }

    /// Takes a request into the batch (its prompt is prefilled by the next steps). A request
    /// the engine refuses is finished at once with the error.
    pub fn admit(
        &mut self,
        engine: &mut Engine,
        req: GenerateRequest,
        sink: Box<dyn SequenceSink>,
    ) {
        let max_tokens = match engine.check_request(&req) {
            Ok(m) => m,
            Err(e) => return sink.finished(Err(e)),
        };
        let (session, cached) = engine.sessions.acquire(
            engine.backend.as_mut(),
            &req.prompt,
            req.reuse_prefix && !req.prompt_logprobs(),
        );
        let last = *req.prompt.last().expect("checked: not empty");
        self.seqs.push(Sequence {
            session,
            cached,
            fed: cached,
            max_tokens,
            next: last,
            sampler: Sampler::new(req.sampling.clone(), &req.prompt),
            collector: Collector::new(engine.prompter.tokenizer(), &req),
            sink,
            admitted: Instant::now(),
            done: false,
            req,
        });
    }

    /// One iteration: drop cancelled sequences, prefill prompts under the budget, then one
    /// batched decode step for every sequence whose prompt is in.
    pub fn step(&mut self, engine: &mut Engine) {
        for s in &mut self.seqs {
            if s.sink.cancelled() {
                s.collector.cancel();
                s.done = true;
            }
        }
        self.retire_done(engine);
        self.prefill(engine);
        // A request for no tokens is done once its prompt is in.
        for s in &mut self.seqs {
            s.done = s.prompt_in() && s.max_tokens == 0;
        }
        self.retire_done(engine);
        self.decode(engine);
        self.retire_done(engine);
    }

    /// Ends every running sequence with `why` (after a failure that leaves their state in
    /// doubt) and forgets their sessions.
    pub fn abort(&mut self, engine: &mut Engine, why: &str) {
        for s in self.seqs.drain(..) {
            engine.sessions.discard(engine.backend.as_mut(), s.session);
            s.sink.finished(Err(EngineError::Aborted(why.to_string())));
        }
    }

    fn prefill(&mut self, engine: &mut Engine) {
        let mut budget = self.opts.prefill_budget;
        let decoding = self.seqs.iter().any(Sequence::prompt_in);
        let mut failed = Vec::new();
        for i in 0..self.seqs.len() {
            if budget == 0 {
                break;
            }
            match self.share(engine, i) {
                Ok(Share::Wait) => continue,
                Ok(Share::None | Share::Forked) => {}
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            }
            let s = &mut self.seqs[i];
            let wanted = s.req.logprobs.filter(|o| o.prompt);
            let take = wanted.map_or(budget, |_| budget.min(PROMPT_LOGITS_CHUNK));
            let end = (s.fed + take).min(s.req.prompt.len() - 1);
            if end <= s.fed {
                continue;
            }
            let chunk = &s.req.prompt[s.fed..end];
            let mode = wanted.map_or(Logits::None, |_| Logits::All);
            let backend = engine.backend.as_mut();
            engine
                .sessions
                .make_room(backend, &[(s.session, chunk.len())]);
            match backend.prefill(s.session, chunk, mode) {
                Ok(all) => {
                    if let Some(o) = wanted {
                        let vocab = engine.model.config.vocab_size;
                        let lps = prompt_logprobs(&s.req.prompt, s.fed, &all, vocab, o.top);
                        s.collector.push_prompt_logprobs(lps);
                    }
                    budget -= chunk.len();
                    s.fed = end;
                }
                // The pool is full of running sequences' pages: wait while some are decoding
                // (they finish and give theirs back); with none decoding, none would.
                Err(BackendError::KvFull { .. }) if decoding => {}
                Err(e) => failed.push((i, EngineError::from(e))),
            }
        }
        for (i, e) in failed.into_iter().rev() {
            self.fail(engine, i, e);
        }
    }

    /// Prompt sharing within the batch: sequence `i` takes the longest prompt prefix it
    /// shares with an earlier sequence from that one's KV (Backend::fork) instead of computing
    /// it again (the `n` choices of one prompt, requests with one system prompt), and waits
    /// while the earlier one is still computing it. Earlier only, so no two wait on each other.
    /// A sequence that wants its prompt's logprobs computes its own prompt.
    fn share(&mut self, engine: &mut Engine, i: usize) -> Result<Share> {
        let s = &self.seqs[i];
        let mine = &s.req.prompt[..s.req.prompt.len() - 1];
        if s.prompt_in() || s.req.logprobs.is_some_and(|o| o.prompt) {
            return Ok(Share::None);
        }
        let best = self.seqs[..i]
            .iter()
            .map(|t| {
                let theirs = &t.req.prompt[..t.req.prompt.len() - 1];
                (t, crate::sessions::common_prefix(theirs, mine))
            })
            .max_by_key(|&(_, n)| n);
        let Some((t, n)) = best.filter(|&(_, n)| n > s.fed) else {
            return Ok(Share::None);
        };
        if t.fed < n {
            return Ok(Share::Wait);
        }
        let (src, dst) = (t.session, s.session);
        engine.backend.fork(src, dst, n)?;
        let s = &mut self.seqs[i];
        // Counted as cached (usage's cached_tokens) when this request computed none of it.
        if s.fed == s.cached {
            s.cached = n;
        }
        s.fed = n;
        Ok(Share::Forked)
    }

    /// One batched step for every sequence whose prompt is in. Where the KV pool cannot give
    /// every row its next position (cached sessions dropped first), the newest sequence holding
    /// KV (a row, or a prompt half in) ends with the pool's error, and the step runs again
    /// without it: the older ones always go on.
    fn decode(&mut self, engine: &mut Engine) {
        loop {
            match self.try_decode(engine) {
                Err(BackendError::KvFull {
                    needed,
                    free,
                    capacity,
                    ..
                }) => {
                    let b = engine.backend.as_ref();
                    let holds = |s: &Sequence| s.prompt_in() || b.kv_len(s.session) > 0;
                    let i = self
                        .seqs
                        .iter()
                        .rposition(holds)
                        .expect("a refused step had rows");
                    let session = self.seqs[i].session;
                    let e = BackendError::KvFull {
                        session,
                        needed,
                        free,
                        capacity,
                    };
                    self.fail(engine, i, e.into());
                }
                Err(e) => {
                    let why = format!("the batched step failed: {e}");
                    for i in (0..self.seqs.len()).rev() {
                        if self.seqs[i].prompt_in() {
                            self.fail(engine, i, EngineError::Aborted(why.clone()));
                        }
                    }
                    return;
                }
                Ok(()) => return,
            }
        }
    }

    fn try_decode(&mut self, engine: &mut Engine) -> std::result::Result<(), BackendError> {
        let ready: Vec<bool> = self.seqs.iter().map(Sequence::prompt_in).collect();
        if !ready.contains(&true) {
            return Ok(());
        }
        let needs: Vec<(SessionId, usize)> = self
            .seqs
            .iter()
            .filter(|s| s.prompt_in())
            .map(|s| (s.session, 1))
            .collect();
        engine.sessions.make_room(engine.backend.as_mut(), &needs);
        let mut rows: Vec<BatchRow<'_>> = self
            .seqs
            .iter_mut()
            .zip(&ready)
            .filter(|(_, &r)| r)
            .map(|(s, _)| BatchRow {
                session: s.session,
                token: s.next,
                logits: s.req.needs_logits(),
                sampler: Some(&mut s.sampler),
            })
            .collect();
        let stepped = engine.backend.step_batch(&mut rows, &mut self.out);
        drop(rows);
        stepped?;
        let mut row = 0;
        for s in self
            .seqs
            .iter_mut()
            .zip(&ready)
            .filter(|(_, &r)| r)
            .map(|(s, _)| s)
        {
            let token = self.out.tokens[row].expect("every row carried its sampler");
            let logits = s.req.needs_logits().then(|| self.out.row(row));
            row += 1;
            let sink = &mut s.sink;
            let flow = s.collector.accept(token, logits, &mut |p| sink.piece(p));
            s.next = token;
            s.done = flow == Flow::Stop || s.collector.generated() >= s.max_tokens;
        }
        Ok(())
    }

    /// Finishes the sequences marked done and returns their sessions to the store.
    fn retire_done(&mut self, engine: &mut Engine) {
        if !self.seqs.iter().any(|s| s.done) {
            return;
        }
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.seqs)
            .into_iter()
            .partition(|s| s.done);
        self.seqs = kept;
        for s in gone {
            finish_ok(engine, s);
        }
    }

    /// Ends sequence `i` with an error; its KV is in doubt, so its session is dropped.
    fn fail(&mut self, engine: &mut Engine, i: usize, e: EngineError) {
        let s = self.seqs.remove(i);
        engine.sessions.discard(engine.backend.as_mut(), s.session);
        s.sink.finished(Err(e));
    }
}

fn finish_ok(engine: &mut Engine, s: Sequence) {
    let Sequence {
        req,
        session,
        cached,
        collector,
        mut sink,
        admitted,
        ..
    } = s;
    engine.release_session(session, &req.prompt, collector.tokens());
    let outcome = Outcome {
        prompt_tokens: req.prompt.len(),
        cached_tokens: cached,
        started: admitted,
        stats: DecodeStats::default(),
    };
    let out = collector.finish(outcome, &mut |p| sink.piece(p));
    sink.finished(Ok(out));
}
