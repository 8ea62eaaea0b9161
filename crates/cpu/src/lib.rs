//! CPU backend: the reference Qwen3-MoE forward pass, computing directly on the quantised
//! weights (each row is dequantised block by block inside the dot product), threaded by a small spinning fork-join pool (`par`).

mod attend;
mod batch;
mod forward;
mod group;
mod kv;
mod measure;
mod ops;
mod par;
pub use par::{set_threads, threads, ThreadsError};
mod step_batch;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use q4moe_model::backend::{
    check_span, sample_and_emit, Backend, BackendError, BackendInfo, BackendResult, BatchOut,
    BatchRow, DecodeRequest, DecodeStats, Flow, KvPoolStats, KvType, Logits, PhaseTimes, RowCopies,
    SessionId, TokenEvent,
};
use q4moe_model::sampling::Sampler;
use q4moe_model::{Config, Model};

pub use forward::{Precision, Scratch};
pub use kv::{KvCache, KvPool, PAGE};
pub use measure::copy_bandwidth;

pub struct CpuBackend {
    model: Arc<Model>,
    weights: forward::HostWeights,
    kv_capacity: usize,
    /// Every session's KV pages come from here (kv.rs).
    pool: KvPool,
    sessions: HashMap<SessionId, KvCache>,
    scratch: Scratch,
    /// The prompt's chunks' activations (batch::Batch).
    batch: batch::Batch,
    /// The batched step's rows' copies of their logits for the samplers.
    row_copies: RowCopies,
}

impl CpuBackend {
    /// `kv_capacity`: positions a session may hold (at most the model's context length).
    /// Uses the fast `Precision::Q8` path.
    pub fn new(model: Arc<Model>, kv_capacity: usize) -> Self {
        Self::with_precision(model, kv_capacity, Precision::Q8)
    }

    pub fn with_precision(model: Arc<Model>, kv_capacity: usize, precision: Precision) -> Self {
        let kv_capacity = kv_capacity.min(model.config.context_length).max(1);
        let pool = KvPool::new(&model.config, KvType::default(), usize::MAX);
        populate(model.file.bytes());
        let weights = forward::HostWeights::new(&model);
        let scratch = Scratch::new(&model.config, precision);
        CpuBackend {
            model,
            weights,
            kv_capacity,
            pool,
            sessions: HashMap::new(),
            scratch,
            batch: batch::Batch::default(),
            row_copies: RowCopies::default(),
        }
    }

    /// Stores keys and values as `kv_type` (default f16, as the GPU's cache: half the bytes
    /// of f32). Keeps the pool's bound in bytes; set before the first session.
    pub fn with_kv_type(mut self, kv_type: KvType) -> Self {
        self.sessions.clear();
        self.pool = KvPool::new(&self.model.config, kv_type, self.pool.max_bytes());
        self
    }

    /// Bounds every session's KV together to `max_bytes` of pages (default: unbounded). Set
    /// before the first session.
    pub fn with_kv_pool(mut self, max_bytes: usize) -> Self {
        self.sessions.clear();
        self.pool = KvPool::new(&self.model.config, self.pool.kv_type(), max_bytes);
        self
    }

    /// Takes the pages `n` more positions of `session` need (a new session starts empty), or
    /// refuses with `KvFull`, the session unchanged.
    fn reserve(&mut self, session: SessionId, n: usize) -> BackendResult<()> {
        let (c, pool) = (&self.model.config, &self.pool);
        let kv = session_kv(&mut self.sessions, c, pool, session);
        kv.reserve(n).map_err(|e| pool_full(pool, session, e))
    }

    /// `tokens` may go into `session` next (backend::check_span).
    fn check_span(&self, session: SessionId, tokens: &[u32]) -> BackendResult<()> {
        let held = self.kv_len(session);
        check_span(&self.model.config, session, held, self.kv_capacity, tokens)
    }

    /// Runs one token and leaves the logits in the scratch; non-finite logits are an error.
    fn step(&mut self, session: SessionId, token: u32) -> BackendResult<&[f32]> {
        self.reserve(session, 1)?;
        self.advance(session, token);
        let position = self.kv_len(session) - 1;
        let logits = forward::head(&self.model, &self.weights, &mut self.scratch);
        forward::check_finite(logits, position)?;
        Ok(logits)
    }

    /// `token` through every layer of `session` (its keys and values cached, its page
    /// reserved), without the output head.
    fn advance(&mut self, session: SessionId, token: u32) {
        let kv = self.sessions.get_mut(&session).expect("reserved");
        forward::token_layers(&self.model, &self.weights, kv, token, &mut self.scratch);
    }

    /// `tokens` through every layer of `session` a chunk at a time (batch.rs): the same keys,
    /// values and residual as `advance` a token at a time, with each run of weight rows read
    /// once a chunk.
    fn advance_batched(&mut self, session: SessionId, tokens: &[u32]) -> BackendResult<()> {
        self.reserve(session, tokens.len())?;
        let kv = self.sessions.get_mut(&session).expect("reserved");
        for chunk in tokens.chunks(batch::CHUNK) {
            let (model, weights) = (&self.model, &self.weights);
            self.batch
                .layers(model, weights, kv, chunk, &mut self.scratch);
        }
        Ok(())
    }

    /// Several sessions' tokens through every layer together (`prefill_many`), in runs of at
    /// most a chunk (batch.rs `Seats::Runs`): every span checked first, then every session's
    /// pages reserved (a refusal runs no token), each session's KV the bits of `advance_batched`.
    fn advance_many(&mut self, items: &[(SessionId, &[u32])]) -> BackendResult<()> {
        for (i, &(session, tokens)) in items.iter().enumerate() {
            if items[..i].iter().any(|&(s, _)| s == session) {
                return Err(BackendError::Invalid(format!(
                    "session {session} appears twice in one prefill"
                )));
            }
            self.check_span(session, tokens)?;
        }
        for &(session, tokens) in items {
            self.reserve(session, tokens.len())?;
        }
        let mut kvs: Vec<KvCache> = items
            .iter()
            .map(|&(s, _)| self.sessions.remove(&s).expect("reserved"))
            .collect();
        let tokens: Vec<u32> = items.iter().flat_map(|&(_, t)| t.iter().copied()).collect();
        let of: Vec<usize> = (items.iter().enumerate())
            .flat_map(|(i, &(_, t))| std::iter::repeat_n(i, t.len()))
            .collect();
        for (run, of) in tokens.chunks(batch::CHUNK).zip(of.chunks(batch::CHUNK)) {
            let seats = &mut batch::Seats::Runs(&mut kvs, of);
            let (model, weights) = (&self.model, &self.weights);
            self.batch
                .run(model, weights, seats, run, &mut self.scratch);
        }
        for (&(session, _), kv) in items.iter().zip(kvs) {
            self.sessions.insert(session, kv);
        }
        Ok(())
    }
}

/// The error a refused reservation of `session`'s pages gives, in bytes.
pub(crate) fn pool_full(pool: &KvPool, session: SessionId, e: kv::PoolFull) -> BackendError {
    BackendError::KvFull {
        session,
        needed: e.needed_pages * pool.page_bytes(),
        free: e.free_pages * pool.page_bytes(),
        capacity: pool.capacity_pages() * pool.page_bytes(),
    }
}

/// `session`'s KV cache, a new one on its first token.
fn session_kv<'a>(
    sessions: &'a mut HashMap<SessionId, KvCache>,
    c: &Config,
    pool: &KvPool,
    session: SessionId,
) -> &'a mut KvCache {
    sessions
        .entry(session)
        .or_insert_with(|| KvCache::new(c, pool))
}

/// Maps every page of the (page-cached) model into this process's page tables up front, as
/// llama.cpp's MAP_POPULATE does. Otherwise each token faults in the pages of experts not used
/// before: ~0.17 s per GB touched here, more than the whole decode step while experts are new.
fn populate(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        const MADV_POPULATE_READ: i32 = 22; // Linux 5.14+
        const PAGE: usize = 4096;
        if bytes.is_empty() {
            return;
        }
        let start = bytes.as_ptr() as usize & !(PAGE - 1);
        let len = bytes.as_ptr() as usize + bytes.len() - start;
        // SAFETY: advice on pages of a live read-only mapping; it changes no contents.
        if unsafe { madvise(start as *mut std::ffi::c_void, len, MADV_POPULATE_READ) } == 0 {
            return;
        }
        // Older kernels: fault the pages in by reading one byte of each.
        let mut acc = 0u8;
        for i in (0..bytes.len()).step_by(PAGE) {
            acc = acc.wrapping_add(bytes[i]);
        }
        std::hint::black_box(acc);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

fn cpu_description() -> String {
    // The instruction set the quantised dot products actually run with.
    format!(
        "{} threads, {:?}",
        par::pool().threads(),
        q4moe_gguf::quant::detected_isa()
    )
}

impl Backend for CpuBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            kind: "cpu".into(),
            device: cpu_description(),
            resident_bytes: self.model.weight_bytes(),
            kv_capacity: self.kv_capacity,
            kv_type: self.pool.kv_type(),
            cache_policy: String::new(),
            step_readback: String::new(),
            batched_step: true,
        }
    }

    fn config(&self) -> &Config {
        &self.model.config
    }

    fn prefill(
        &mut self,
        session: SessionId,
        tokens: &[u32],
        logits: Logits,
    ) -> BackendResult<Vec<f32>> {
        self.check_span(session, tokens)?;
        logits.check(tokens)?;
        let vocab = self.model.config.vocab_size;
        match logits {
            Logits::None => {
                if !tokens.is_empty() {
                    self.advance_batched(session, tokens)?;
                }
                Ok(Vec::new())
            }
            Logits::All => {
                let mut out = Vec::with_capacity(tokens.len() * vocab);
                for &t in tokens {
                    out.extend_from_slice(self.step(session, t)?);
                }
                Ok(out)
            }
            Logits::Last => {
                let (last, before) = tokens.split_last().expect("checked: not empty");
                if !before.is_empty() {
                    self.advance_batched(session, before)?;
                }
                Ok(self.step(session, *last)?.to_vec())
            }
        }
    }

    fn prefill_many(&mut self, items: &[(SessionId, &[u32])]) -> BackendResult<()> {
        if items.iter().any(|(_, t)| t.is_empty()) {
            return Err(BackendError::Invalid(
                "a session of a batched prefill has no tokens".into(),
            ));
        }
        self.advance_many(items)
    }

    fn decode(
        &mut self,
        req: &DecodeRequest<'_>,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> BackendResult<DecodeStats> {
        let mut sampler = Sampler::new(req.sampling.clone(), req.history);
        let mut stats = DecodeStats::default();
        let mut token = req.first_token;
        let mut logits = Vec::new();
        for _ in 0..req.max_tokens {
            self.check_span(req.session, &[token])?;
            let t0 = Instant::now();
            logits.clear();
            logits.extend_from_slice(self.step(req.session, token)?);
            let t1 = Instant::now();
            let flow;
            (token, flow) = sample_and_emit(&mut sampler, &mut logits, req.want_logits, on_token);
            stats.phases.push(PhaseTimes {
                wait: t1 - t0,
                tail: t1.elapsed(),
                ..Default::default()
            });
            if flow == Flow::Stop {
                break;
            }
        }
        Ok(stats)
    }

    fn step_batch(&mut self, rows: &mut [BatchRow<'_>], out: &mut BatchOut) -> BackendResult<()> {
        self.run_batch(rows, out)?;
        // As `step`: a row's non-finite logits are an error, naming the row's position.
        for (i, row) in rows.iter().enumerate() {
            forward::check_finite(out.row(i), self.kv_len(row.session) - 1)?;
        }
        Ok(())
    }

    fn kv_len(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, KvCache::len)
    }

    fn kv_bytes(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, KvCache::bytes)
    }

    fn kv_bytes_of(&self, sessions: &[SessionId]) -> usize {
        let pages: std::collections::HashSet<usize> = sessions
            .iter()
            .filter_map(|s| self.sessions.get(s))
            .flat_map(KvCache::page_ids)
            .collect();
        pages.len() * self.pool.page_bytes()
    }

    fn kv_pool(&self) -> Option<KvPoolStats> {
        let page_bytes = self.pool.page_bytes();
        Some(KvPoolStats {
            capacity_bytes: self.pool.capacity_pages().saturating_mul(page_bytes),
            used_bytes: self.pool.used_pages() * page_bytes,
            page_positions: PAGE,
            page_bytes,
        })
    }

    fn kv_needed(&self, session: SessionId, positions: usize) -> usize {
        let pages = match self.sessions.get(&session) {
            Some(kv) => kv.pages_needed(positions),
            None => positions.div_ceil(PAGE) * self.model.config.n_layer,
        };
        pages * self.pool.page_bytes()
    }

    fn truncate(&mut self, session: SessionId, len: usize) {
        if let Some(kv) = self.sessions.get_mut(&session) {
            kv.truncate(len);
        }
    }

    fn drop_session(&mut self, session: SessionId) {
        self.sessions.remove(&session);
    }

    fn fork(&mut self, src: SessionId, dst: SessionId, len: usize) -> BackendResult<()> {
        q4moe_model::backend::check_fork(src, dst, len, self.kv_len(src))?;
        let kv = self.sessions.get(&src).map(|kv| kv.fork(len));
        self.sessions.insert(
            dst,
            kv.unwrap_or_else(|| KvCache::new(&self.model.config, &self.pool)),
        );
        Ok(())
    }
}
