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
    Backend, BackendError, BatchOut, BatchRow, DecodeStats, Flow, Logits, SessionId,
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
    /// The prompt, then the tokens generated so far: the KV must hold all but the last before
    /// the next decode step, which feeds the last (`next`).
    context: Vec<u32>,
    /// Positions in the KV now: the prompt's as it is prefilled (decoding starts when all but
    /// its last token are in, as in `generate`), then one more a step.
    fed: usize,
    max_tokens: usize,
    /// Its KV was taken for older sequences once (the pool was full) and its context is
    /// prefilled again: its reused prompt tokens (`cached`) stay what they were.
    requeued: bool,
    sampler: Sampler,
    collector: Collector,
    sink: Box<dyn SequenceSink>,
    admitted: Instant,
    /// Finished (stopped, out of tokens, cancelled): leaves at the next retirement.
    done: bool,
}

impl Sequence {
    fn prompt_in(&self) -> bool {
        self.fed + 1 == self.context.len()
    }

    /// Whether a full KV pool may take this sequence's KV and prefill its context again later
    /// (preemption by recompute): not where the prompt's logprobs come from that prefill.
    fn recomputable(&self) -> bool {
        !self.req.prompt_logprobs()
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
    /// Sequences whose KV a full pool took back so far (`requeue`).
    preempted: u64,
}

impl Batcher {
    pub fn new(opts: BatchOptions) -> Result<Batcher> {
        opts.validate()?;
        Ok(Batcher {
            opts,
            seqs: Vec::new(),
            out: BatchOut::default(),
            preempted: 0,
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

    /// Times a full KV pool took a running sequence's KV back, to prefill its context again
    /// later (the sequence's output is unchanged).
    pub fn preemptions(&self) -> u64 {
        self.preempted
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
        self.seqs.push(Sequence {
            session,
            cached,
            context: req.prompt.clone(),
            fed: cached,
            max_tokens,
            requeued: false,
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

    /// Prompts (and the contexts of requeued sequences) a chunk at a time, first come, first
    /// served, under the budget. Where the KV is pooled and others are decoding, a chunk goes
    /// in only while the pool keeps a page for each of them besides (kept sessions dropped for
    /// it first); otherwise it waits for them, and the younger prompts behind it wait too, so
    /// a new prompt neither takes the pages the running sequences are about to need nor
    /// overtakes an older one.
    fn prefill(&mut self, engine: &mut Engine) {
        let mut budget = self.opts.prefill_budget;
        let page = engine.backend.kv_pool().map_or(0, |p| p.page_positions);
        let running = self.decoding(page);
        self.prefill_together(engine, &mut budget, &running);
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
            let s = &self.seqs[i];
            let wanted = s.req.logprobs.filter(|o| o.prompt);
            let take = wanted.map_or(budget, |_| budget.min(PROMPT_LOGITS_CHUNK));
            let (session, fed) = (s.session, s.fed);
            let end = (fed + take).min(s.context.len() - 1);
            if end <= fed {
                continue;
            }
            let chunk = s.context[fed..end].to_vec();
            let mode = wanted.map_or(Logits::None, |_| Logits::All);
            let mut needs = vec![(session, chunk.len())];
            needs.extend_from_slice(&running);
            let room = engine.sessions.make_room(engine.backend.as_mut(), &needs);
            // First come, first served: the younger prompts wait behind one that does not fit.
            if !room && !running.is_empty() {
                break;
            }
            // With nothing decoding, a full pool is held by other prompts half in: the newest
            // after this one gives its KV back (first come, first served), until this one fits
            // or holds the only KV there is.
            let result = loop {
                let r = engine.backend.prefill(session, &chunk, mode);
                let younger = match &r {
                    Err(BackendError::KvFull { .. }) if running.is_empty() => {
                        let b = engine.backend.as_ref();
                        (i + 1..self.seqs.len())
                            .rev()
                            .find(|&j| b.kv_len(self.seqs[j].session) > 0)
                    }
                    _ => None,
                };
                match younger {
                    Some(j) => self.requeue(engine, j),
                    None => break r,
                }
            };
            match result {
                Ok(all) => {
                    let s = &mut self.seqs[i];
                    if let Some(o) = wanted {
                        let vocab = engine.model.config.vocab_size;
                        let lps = prompt_logprobs(&s.req.prompt, fed, &all, vocab, o.top);
                        s.collector.push_prompt_logprobs(lps);
                    }
                    budget -= chunk.len();
                    s.fed = end;
                }
                // Past the pool with no other sequence holding KV: it never fits.
                Err(BackendError::KvFull { capacity, .. })
                    if alone(engine.backend.as_ref(), &self.seqs, i) =>
                {
                    failed.push((i, EngineError::KvExceeded { capacity }))
                }
                // Older sequences hold the pages (decoding, or their prompts half in): wait
                // for them to finish and give theirs back.
                Err(BackendError::KvFull { .. }) => {}
                Err(e) => failed.push((i, EngineError::from(e))),
            }
        }
        for (i, e) in failed.into_iter().rev() {
            self.fail(engine, i, e);
        }
    }

    /// The chunks of the first sequences whose prompts are going in (first come, first
    /// served, under the budget) through one `Backend::prefill_many`, where at least two can go
    /// and the pool holds all of them beside the running sequences: every weight row read once
    /// for all their tokens (a batch of prompts arriving together is one pass, not one a
    /// prompt). Gathering stops at the first sequence that cannot go with them (it waits on a
    /// shared prefix, wants its prompt's logprobs, or fails); `prefill` then takes it and the
    /// rest one at a time, with its handling of a full pool and of errors. On an error here
    /// the sequences the backend did prefill (`kv_len` says) count as fed, and the others
    /// are left to `prefill`, which meets the error again for the one refused.
    fn prefill_together(
        &mut self,
        engine: &mut Engine,
        budget: &mut usize,
        running: &[(SessionId, usize)],
    ) {
        let mut left = *budget;
        let mut group: Vec<(usize, usize)> = Vec::new(); // (sequence, end of its chunk)
        for i in 0..self.seqs.len() {
            if left == 0 {
                break;
            }
            if self.seqs[i].req.logprobs.is_some_and(|o| o.prompt) {
                break;
            }
            match self.share(engine, i) {
                Ok(Share::None | Share::Forked) => {}
                Ok(Share::Wait) | Err(_) => break,
            }
            let s = &self.seqs[i];
            let end = (s.fed + left).min(s.context.len() - 1);
            if end > s.fed {
                left -= end - s.fed;
                group.push((i, end));
            }
        }
        if group.len() < 2 {
            return;
        }
        let mut needs: Vec<(SessionId, usize)> = group
            .iter()
            .map(|&(i, end)| (self.seqs[i].session, end - self.seqs[i].fed))
            .collect();
        needs.extend_from_slice(running);
        if !engine.sessions.make_room(engine.backend.as_mut(), &needs) {
            return;
        }
        let before: Vec<usize> = group
            .iter()
            .map(|&(i, _)| engine.backend.kv_len(self.seqs[i].session))
            .collect();
        let items: Vec<(SessionId, &[u32])> = group
            .iter()
            .map(|&(i, end)| {
                let s = &self.seqs[i];
                (s.session, &s.context[s.fed..end])
            })
            .collect();
        let all = engine.backend.prefill_many(&items).is_ok();
        for (&(i, end), held) in group.iter().zip(before) {
            let s = &mut self.seqs[i];
            if all || engine.backend.kv_len(s.session) == held + (end - s.fed) {
                *budget -= end - s.fed;
                s.fed = end;
            }
        }
    }

    /// Prompt sharing within the batch: sequence `i` takes the longest prompt prefix it
    /// shares with an earlier sequence from that one's KV (Backend::fork) instead of computing
    /// it again (the `n` choices of one prompt, requests with one system prompt), and waits
    /// while the earlier one is still computing it. Earlier only, so no two wait on each other.
    /// A sequence that wants its prompt's logprobs computes its own prompt.
    fn share(&mut self, engine: &mut Engine, i: usize) -> Result<Share> {
        let s = &self.seqs[i];
        let mine = &s.context[..s.context.len() - 1];
        if s.prompt_in() || s.req.logprobs.is_some_and(|o| o.prompt) {
            return Ok(Share::None);
        }
        let best = self.seqs[..i]
            .iter()
            .map(|t| {
                let theirs = &t.context[..t.context.len() - 1];
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
        if s.fed == s.cached && !s.requeued {
            s.cached = n;
        }
        s.fed = n;
        Ok(Share::Forked)
    }

    /// One batched step for every sequence whose prompt is in. Where the KV pool cannot give
    /// every row its next position (cached sessions dropped first), the newest sequence holding
    /// KV (a row, or a prompt half in) gives its KV back and waits to prefill its context (the
    /// prompt and what it generated) again, and the step runs without it: the older ones always
    /// go on, and its output is the same (batch invariance: the prefilled context's KV is the
    /// decoded one's bits). Only a sequence that alone outgrows the pool (or whose prompt
    /// logprobs came from its prefill) ends with the pool's error.
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
                    let i = self
                        .seqs
                        .iter()
                        .rposition(|s| holds_kv(b, s))
                        .expect("a refused step had rows");
                    let others = !alone(b, &self.seqs, i);
                    if others && self.seqs[i].recomputable() {
                        self.requeue(engine, i);
                        continue;
                    }
                    let e = if others {
                        let session = self.seqs[i].session;
                        EngineError::from(BackendError::KvFull {
                            session,
                            needed,
                            free,
                            capacity,
                        })
                    } else {
                        EngineError::KvExceeded { capacity }
                    };
                    self.fail(engine, i, e);
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
        let needs = self.decoding(1);
        engine.sessions.make_room(engine.backend.as_mut(), &needs);
        let mut rows: Vec<BatchRow<'_>> = self
            .seqs
            .iter_mut()
            .zip(&ready)
            .filter(|(_, &r)| r)
            .map(|(s, _)| BatchRow {
                session: s.session,
                token: *s.context.last().expect("not empty"),
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
            // The fed token's KV is in; the new one is fed next.
            s.fed += 1;
            s.context.push(token);
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

    /// Each decoding sequence's session with `positions` it is about to add.
    fn decoding(&self, positions: usize) -> Vec<(SessionId, usize)> {
        self.seqs
            .iter()
            .filter(|s| s.prompt_in())
            .map(|s| (s.session, positions))
            .collect()
    }

    /// Takes sequence `i`'s KV back into the pool: it prefills its context again once there is
    /// room, into a new empty session (so it holds nothing while it waits, and the next
    /// preemption takes another), forking what an earlier sequence shares with it (`share`).
    fn requeue(&mut self, engine: &mut Engine, i: usize) {
        let backend = engine.backend.as_mut();
        let s = &mut self.seqs[i];
        engine.sessions.discard(backend, s.session);
        let (session, held) = engine.sessions.acquire(backend, &s.context, false);
        debug_assert_eq!(held, 0, "a new session");
        s.session = session;
        s.fed = 0;
        s.requeued = true;
        self.preempted += 1;
    }

    /// Ends sequence `i` with an error; its KV is in doubt, so its session is dropped.
    fn fail(&mut self, engine: &mut Engine, i: usize, e: EngineError) {
        let s = self.seqs.remove(i);
        engine.sessions.discard(engine.backend.as_mut(), s.session);
        s.sink.finished(Err(e));
    }
}

/// Whether `s` holds KV or is about to (its prompt in: a one-token prompt holds none yet).
fn holds_kv(b: &dyn Backend, s: &Sequence) -> bool {
    s.prompt_in() || b.kv_len(s.session) > 0
}

/// Whether no sequence but `i` holds KV.
fn alone(b: &dyn Backend, seqs: &[Sequence], i: usize) -> bool {
    seqs.iter()
        .enumerate()
        .all(|(j, t)| j == i || !holds_kv(b, t))
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
