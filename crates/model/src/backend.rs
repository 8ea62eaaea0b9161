//! The contract every backend implements and the engine drives. Session state (KV caches,
//! setup caches) lives inside the backend, keyed by `SessionId`; the model stays immutable.

use rayon::prelude::*;
use std::time::Duration;

use crate::sampling::{Sampler, SamplingParams};
use crate::{Config, ModelError};

/// A conversation's KV cache identity inside a backend.
pub type SessionId = u64;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("session {session}: {needed} positions exceed the context capacity of {capacity}")]
    ContextFull {
        session: SessionId,
        needed: usize,
        capacity: usize,
    },
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    BadToken { token: u32, vocab: usize },
    /// The KV pool cannot give a session the pages it needs now (other sessions hold them).
    #[error("session {session}: the KV pool is full ({needed} more bytes needed, {free} of {capacity} free; --kv-cache-mb sets the pool)")]
    KvFull {
        session: SessionId,
        needed: usize,
        free: usize,
        capacity: usize,
    },
    #[error("device: {0}")]
    Device(String),
    #[error("{0}")]
    Invalid(String),
    /// The backend does not implement this operation (yet); the message names it.
    #[error("not supported by this backend: {0}")]
    Unsupported(String),
}

pub type BackendResult<T> = std::result::Result<T, BackendError>;

/// One host-sampled decode step, the same on every backend: samples from `logits` (penalties
/// are applied in place) and hands the token to `on_token`, with the logits as they were
/// before the penalties when `want_logits`.
pub fn sample_and_emit(
    sampler: &mut Sampler,
    logits: &mut [f32],
    want_logits: bool,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
) -> (u32, Flow) {
    let shown = want_logits.then(|| logits.to_vec());
    let token = sampler.sample(logits);
    let flow = on_token(TokenEvent {
        token,
        logits: shown.as_deref(),
    });
    (token, flow)
}

/// The invariant every backend checks before it writes keys and values, whoever called it:
/// `tokens` at positions `held..` of `session` stay inside the KV's `capacity` and every id
/// inside the embedding table, so bad input is an error, never an out-of-bounds write or read.
/// The engine checks a request up front with user-facing errors; this is the backstop.
pub fn check_span(
    config: &Config,
    session: SessionId,
    held: usize,
    capacity: usize,
    tokens: &[u32],
) -> BackendResult<()> {
    let needed = held + tokens.len();
    if needed > capacity {
        return Err(BackendError::ContextFull {
            session,
            needed,
            capacity,
        });
    }
    let vocab = config.vocab_size;
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(&token) => Err(BackendError::BadToken { token, vocab }),
        None => Ok(()),
    }
}

/// Which logits a prefill returns. Generation passes `None` (the prompt's keys and values only:
/// the first generated token comes from decode, like every other); `Last` and `All` serve
/// evaluation (`--logits-out`, oracle and parity tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Nothing: the output head is skipped.
    None,
    /// The last position's logits `[vocab]`.
    Last,
    /// Every position's logits `[tokens.len(), vocab]`.
    All,
}

impl Logits {
    /// Logits need a position to come from: only `None` accepts an empty prefill.
    pub fn check(self, tokens: &[u32]) -> BackendResult<()> {
        if tokens.is_empty() && self != Logits::None {
            return Err(BackendError::Invalid(
                "a prefill of no tokens has no logits to return".into(),
            ));
        }
        Ok(())
    }
}

/// How a backend stores the KV cache's keys and values. F16 halves the bytes attention reads
/// a position (what long contexts are bound by) at a relative rounding of at most 2^-11 a value;
/// every backend rounds the same way, so the CPU and GPU agree on what attention sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    F32,
    #[default]
    F16,
}

impl KvType {
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> Result<KvType, BackendError> {
        match s {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            other => Err(BackendError::Invalid(format!(
                "unknown KV cache type '{other}' (f16, f32)"
            ))),
        }
    }

    /// A value as the cache holds it.
    pub fn round(self, x: f32) -> f32 {
        match self {
            KvType::F32 => x,
            KvType::F16 => half::f16::from_f32(x).to_f32(),
        }
    }
}

/// What a backend is and holds, for summaries and benchmark records.
#[derive(Debug, Clone, Default)]
pub struct BackendInfo {
    /// "cpu" or "cuda".
    pub kind: String,
    /// Human-readable device, e.g. "NVIDIA H200" or "2 threads, avx512f".
    pub device: String,
    /// Bytes of weights resident where the backend computes.
    pub resident_bytes: u64,
    /// Positions each session may hold.
    pub kv_capacity: usize,
    pub kv_type: KvType,
    /// How the device's cache treats the weights (empty where there is no such policy).
    pub cache_policy: String,
    /// How a decode step hands its token back (empty where there is nothing to choose).
    pub step_readback: String,
    /// Front ends may drive `step_batch` (continuous batching); false where it answers
    /// `Unsupported` or the backend holds it back (CUDA without `batched_step=on`), and front
    /// ends run one sequence at a time through `decode`.
    pub batched_step: bool,
}

/// The pool a paged backend keeps every session's KV in (`Backend::kv_pool`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvPoolStats {
    /// Bytes the pool may hold in all, and holds now (a page shared by sessions counted once).
    pub capacity_bytes: usize,
    pub used_bytes: usize,
    /// Positions a page holds, and its bytes (one layer's keys and values).
    pub page_positions: usize,
    pub page_bytes: usize,
}

impl KvPoolStats {
    pub fn free_bytes(&self) -> usize {
        self.capacity_bytes.saturating_sub(self.used_bytes)
    }
}

/// One decode-n run: feed `first_token` at the session's current length, sample the next token
/// from its logits, feed that back, and so on until `on_token` says stop or `max_tokens` tokens
/// were produced. The engine passes the prompt's last token as `first_token`, so every
/// generated token, the first included, comes out of the same step.
pub struct DecodeRequest<'a> {
    pub session: SessionId,
    pub first_token: u32,
    pub max_tokens: usize,
    /// One draw sequence per generation, starting at the seed (`Sampler::new`).
    pub sampling: &'a SamplingParams,
    /// Tokens already in the context, `first_token` included, for repetition/presence/frequency
    /// penalties.
    pub history: &'a [u32],
    /// Hand each step's logits to `on_token` (slower on devices: they are copied back).
    pub want_logits: bool,
}

/// One sampled token, and the logits it was sampled from when asked for.
pub struct TokenEvent<'a> {
    pub token: u32,
    pub logits: Option<&'a [f32]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// Host wall-clock split of one decode step (DESIGN.md section 4) and its GPU time if known.
#[derive(Debug, Clone, Copy, Default)]
pub struct PhaseTimes {
    pub setup: Duration,
    pub submit: Duration,
    pub wait: Duration,
    pub tail: Duration,
    pub gpu: Option<Duration>,
}

impl PhaseTimes {
    pub fn total(&self) -> Duration {
        self.setup + self.submit + self.wait + self.tail
    }
}

/// Per-token phase times of a decode run, in token order.
#[derive(Debug, Clone, Default)]
pub struct DecodeStats {
    pub phases: Vec<PhaseTimes>,
}

/// One sequence's row of a batched decode step (`Backend::step_batch`).
pub struct BatchRow<'a> {
    pub session: SessionId,
    /// Fed at the session's next position (`kv_len(session)`), appended to its KV.
    pub token: u32,
    /// When set, the step chooses this row's next token with it (penalties, temperature,
    /// seed's draw sequence, all as in `decode`) and its state advances; when `None`, the
    /// caller chooses from the row's logits. See `step_batch` for why the choice can travel
    /// with the row.
    pub sampler: Option<&'a mut Sampler>,
    /// The caller reads this row's logits (`BatchOut::row`). A row with a sampler may say
    /// false, and a device backend then sends back only the token where it can choose it
    /// itself (a plain greedy sampler): the row's logits in `BatchOut` are then unspecified.
    pub logits: bool,
}

/// What a batched step hands back; the caller keeps one and reuses its buffers every step.
#[derive(Debug, Clone, Default)]
pub struct BatchOut {
    /// [rows, vocab]: row i's logits for `rows[i]`, before any penalties.
    pub logits: Vec<f32>,
    /// [rows]: the token chosen for `rows[i]` where it carried a sampler, else `None`.
    pub tokens: Vec<Option<u32>>,
    /// Bytes of expert weights the step read (each expert a layer's rows chose, once), where
    /// the backend counts them (the CPU); None where it does not (CUDA: its routers choose on
    /// the device).
    pub expert_bytes: Option<u64>,
}

impl BatchOut {
    /// Row `i`'s logits.
    pub fn row(&self, i: usize) -> &[f32] {
        let vocab = self.logits.len() / self.tokens.len().max(1);
        &self.logits[i * vocab..(i + 1) * vocab]
    }
}

/// A batched step's token choice, the same on every backend that chooses on the host: each
/// row with a sampler samples from a copy of its logits (the penalties change them in
/// place; `out.logits` keeps them as computed), as `decode` samples a token.
pub fn choose_tokens(rows: &mut [BatchRow<'_>], out: &mut BatchOut, copies: &mut RowCopies) {
    out.tokens.clear();
    out.tokens.resize(rows.len(), None);
    let host = vec![true; rows.len()];
    choose_on_host(rows, &out.logits, &host, copies, &mut out.tokens);
}

/// Each row's copy of its logits for a host draw, kept by the backend and reused every step.
#[derive(Debug, Default)]
pub struct RowCopies(Vec<Vec<f32>>);

/// The rows `host` marks choose their tokens into `tokens` (row i from row i of `logits`,
/// [rows][vocab], through `choose_row`); the others' entries are left as they are. A large
/// step's rows draw in parallel: each row's choice is its own (its sampler, its logits), so the
/// order they run in changes no token. Why: a draw over 151,936 logits is 0.4-1.3 ms on the
/// 2-core development machine (`cargo bench -p q4moe-model --bench sampler`), and a step's
/// sampled rows drew one after another. A small step draws on the calling thread: on the CPU
/// backend, waking rayon's threads for a few thousand logits made the batched step at one row
/// ~40% slower than the single-token path (their spinning took the cores from the forward
/// pass's pool; mid geometry, 2 cores).
pub fn choose_on_host(
    rows: &mut [BatchRow<'_>],
    logits: &[f32],
    host: &[bool],
    copies: &mut RowCopies,
    tokens: &mut [Option<u32>],
) {
    let n = rows.len();
    assert!(
        host.len() == n && tokens.len() == n,
        "a flag and a token a row"
    );
    let vocab = logits.len() / n.max(1);
    copies.0.resize_with(n, Vec::new);
    let draw = |i: usize, row: &mut BatchRow<'_>, token: &mut Option<u32>, copy: &mut Vec<f32>| {
        if host[i] {
            *token = choose_row(row, &logits[i * vocab..][..vocab], copy);
        }
    };
    // Small steps draw on this thread: handing a few thousand logits to the pool costs more
    // than the draws (and wakes its threads beside the forward pass's).
    if n * vocab < PARALLEL_DRAW_LOGITS {
        let each = rows
            .iter_mut()
            .zip(tokens.iter_mut())
            .zip(copies.0.iter_mut());
        for (i, ((row, token), copy)) in each.enumerate() {
            draw(i, row, token, copy);
        }
        return;
    }
    rows.par_iter_mut()
        .zip(tokens.par_iter_mut())
        .zip(copies.0.par_iter_mut())
        .enumerate()
        .for_each(|(i, ((row, token), copy))| draw(i, row, token, copy));
}

/// Logits a step holds (rows x vocabulary) from which its rows draw in parallel: two rows of
/// Qwen3's 151,936.
const PARALLEL_DRAW_LOGITS: usize = 1 << 18;

/// One row's token with its sampler, from a copy of its `logits` (None without a sampler).
pub fn choose_row(row: &mut BatchRow<'_>, logits: &[f32], tmp: &mut Vec<f32>) -> Option<u32> {
    row.sampler.as_deref_mut().map(|sampler| {
        tmp.clear();
        tmp.extend_from_slice(logits);
        sampler.sample(tmp)
    })
}

/// Logits holding a NaN or an infinity come from broken weights (a NaN norm, an overflowing
/// matrix). Sampling would turn them into garbage that looks like output, so the position that
/// produced them is an error instead, on every backend.
pub fn check_finite(logits: &[f32], position: usize) -> BackendResult<()> {
    match logits.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(id) => Err(non_finite(
            position,
            &format!("token id {id}: {}", logits[id]),
        )),
    }
}

/// The error `check_finite` gives, for a backend that found the non-finite logit elsewhere.
pub fn non_finite(position: usize, what: &str) -> BackendError {
    BackendError::Invalid(format!(
        "non-finite logits at position {position} ({what}); \
         the model's weights hold NaN or infinity, or overflow"
    ))
}

/// A batched step's checks, the same on every backend, before anything runs: every row's
/// token inside the vocabulary, no session twice (a session advances one token a step), room
/// for one more position in each (`held(session)` positions of `capacity`).
pub fn check_batch(
    config: &Config,
    rows: &[BatchRow<'_>],
    capacity: usize,
    held: impl Fn(SessionId) -> usize,
) -> BackendResult<()> {
    for (i, row) in rows.iter().enumerate() {
        check_span(
            config,
            row.session,
            held(row.session),
            capacity,
            &[row.token],
        )?;
        if rows[..i].iter().any(|r| r.session == row.session) {
            return Err(BackendError::Invalid(format!(
                "session {} appears twice in one batched step",
                row.session
            )));
        }
    }
    Ok(())
}

pub trait Backend: Send {
    fn info(&self) -> BackendInfo;
    fn config(&self) -> &Config;

    /// Runs `tokens` at positions `kv_len(session)..`, appending to the session's KV (creating
    /// the session if new), and returns the logits asked for (empty for `Logits::None`). An
    /// empty `tokens` is a no-op with `Logits::None` and an error otherwise.
    fn prefill(
        &mut self,
        session: SessionId,
        tokens: &[u32],
        logits: Logits,
    ) -> BackendResult<Vec<f32>>;

    /// `prefill` with `Logits::None` for several sessions (distinct, each with tokens): where
    /// the backend batches them (the CPU), their tokens go through every layer together, each
    /// weight row read once for all of them; each session's KV is the bits of its own
    /// `prefill`. On an error the sessions before the refused one may be prefilled and the
    /// rest are not: `kv_len` tells which. This default prefills them one after another.
    fn prefill_many(&mut self, items: &[(SessionId, &[u32])]) -> BackendResult<()> {
        for &(session, tokens) in items {
            self.prefill(session, tokens, Logits::None)?;
        }
        Ok(())
    }

    /// Decode-n (see `DecodeRequest`): every step's token is chosen where the backend likes
    /// (on a GPU, on the device) and handed to `on_token`. On return the session's KV holds
    /// `first_token` and every token handed to `on_token` except the last, whatever was
    /// computed ahead.
    fn decode(
        &mut self,
        req: &DecodeRequest<'_>,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> BackendResult<DecodeStats>;

    /// One decode step for a batch of sequences (continuous batching): each row's token runs at
    /// its own session's next position over its own KV (sessions of different lengths; a new
    /// session starts at 0), and `out` gets every row's logits, row i for `rows[i]`. Sessions
    /// join and leave between steps freely: nothing is kept per batch, only per session.
    ///
    /// Batch invariance: a row's logits are bit-identical to the same session run alone
    /// (`decode`, or this step with one row), whatever the batch's size, order and companions.
    ///
    /// Why the token choice may travel with the row: sampling state (seed's draw sequence,
    /// penalty counts) is per sequence and lives with the caller's `Sampler`, so the engine
    /// keeps one sampler per sequence on every backend; a row without one hands the choice to
    /// the caller (logits only). A device backend samples on the device from the sampler's
    /// state (`rng_state`, `counts`) and reads back B tokens, not B x vocab logits. Stop
    /// conditions stay with the caller, who drops a finished row from the next step.
    ///
    /// A refused step (bad token, a session twice, a full context) changes no session.
    fn step_batch(&mut self, rows: &mut [BatchRow<'_>], out: &mut BatchOut) -> BackendResult<()>;

    /// Positions the session's KV holds (0 for an unknown session).
    fn kv_len(&self, session: SessionId) -> usize;
    /// Bytes the session's KV takes (0 for an unknown session): on the CPU the pages it holds
    /// (those it shares with another session counted whole), on CUDA its allocation (doubling
    /// as it grows).
    fn kv_bytes(&self, session: SessionId) -> usize;
    /// Bytes the sessions' KV takes together, a page two of them share counted once.
    fn kv_bytes_of(&self, sessions: &[SessionId]) -> usize {
        sessions.iter().map(|&s| self.kv_bytes(s)).sum()
    }
    /// The pool every session's KV comes from, where the backend keeps KV in pages of one
    /// pool bounded in bytes (the CPU); None where each session holds its own allocation.
    fn kv_pool(&self) -> Option<KvPoolStats> {
        None
    }
    /// Bytes `session` (new or held) must take from the pool to hold `positions` more: its new
    /// pages, and a copy of a partly filled page it shares with another session. 0 without a
    /// pool. A step refused with `KvFull` needs at least this much free.
    fn kv_needed(&self, session: SessionId, positions: usize) -> usize {
        let _ = (session, positions);
        0
    }
    /// Keeps the first `len` positions (for prefix reuse); no-op if already shorter.
    fn truncate(&mut self, session: SessionId, len: usize);
    /// Frees the session's KV and any setup cached for it.
    fn drop_session(&mut self, session: SessionId);
    /// Makes `dst` (a new session; any session of that id is replaced) hold `src`'s first
    /// `len` positions, so requests sharing a prompt prefix (the `n` choices of one prompt, a
    /// conversation branching) compute it once. A paged backend (the CPU) shares the prefix's
    /// pages, copying only a partly filled one when either session writes into it; CUDA copies
    /// the positions (its KV is not paged). The forked positions are bit-identical to `src`'s,
    /// so a sequence's output is the same forked or prefilled itself.
    fn fork(&mut self, src: SessionId, dst: SessionId, len: usize) -> BackendResult<()>;
}

/// The check every backend's `fork` makes first: `src` holds `len` positions and is not `dst`.
pub fn check_fork(src: SessionId, dst: SessionId, len: usize, held: usize) -> BackendResult<()> {
    if src == dst {
        return Err(BackendError::Invalid(format!(
            "fork: session {src} onto itself"
        )));
    }
    if len > held {
        return Err(BackendError::Invalid(format!(
            "fork: session {src} holds {held} positions, not {len}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_span_names_what_would_overrun() {
        let c = Config::tiny();
        let vocab = c.vocab_size as u32;
        let err = check_span(&c, 3, 10, 16, &[1; 7]).unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::ContextFull {
                    session: 3,
                    needed: 17,
                    capacity: 16
                }
            ),
            "{err}"
        );
        let err = check_span(&c, 3, 0, 16, &[1, vocab, 2]).unwrap_err();
        assert!(
            matches!(err, BackendError::BadToken { token, .. } if token == vocab),
            "{err}"
        );
        check_span(&c, 3, 10, 16, &[0, 1, vocab - 1, 5, 6, 7]).unwrap();
        check_span(&c, 3, 16, 16, &[]).unwrap();
        Logits::None.check(&[]).unwrap();
        Logits::Last.check(&[4]).unwrap();
        for l in [Logits::Last, Logits::All] {
            let err = l.check(&[]).unwrap_err().to_string();
            assert!(err.contains("no tokens"), "{err}");
        }
    }

    /// The rows' draws in parallel give each row the tokens it draws alone, step after step
    /// (each sampler's state advancing as its own), and leave the rows the host does not
    /// choose as they were.
    #[test]
    fn rows_drawn_in_parallel_draw_what_they_draw_alone() {
        use crate::sampling::Rng;
        let vocab = 5000;
        let params = |i: usize| SamplingParams {
            temperature: [0.0, 0.7, 1.0, 0.6, 1.3][i % 5],
            top_k: [0, 20, 0, 0, 5][i % 5],
            top_p: [1.0, 0.8, 1.0, 0.95, 1.0][i % 5],
            min_p: [0.0, 0.0, 0.05, 0.0, 0.0][i % 5],
            seed: 100 + i as u64,
            ..Default::default()
        };
        let n = 11;
        let mut mine: Vec<Sampler> = (0..n).map(|i| Sampler::new(params(i), &[1, 2])).collect();
        let mut alone: Vec<Sampler> = (0..n).map(|i| Sampler::new(params(i), &[1, 2])).collect();
        let host: Vec<bool> = (0..n).map(|i| i % 4 != 3).collect();
        let mut rng = Rng::new(9);
        let mut copies = RowCopies::default();
        for step in 0..6 {
            let logits: Vec<f32> = (0..n * vocab)
                .map(|_| rng.next_f32() * 16.0 - 8.0)
                .collect();
            let mut rows: Vec<BatchRow<'_>> = mine
                .iter_mut()
                .enumerate()
                .map(|(i, s)| BatchRow {
                    session: i as u64,
                    token: 0,
                    sampler: (i % 6 != 5).then_some(s),
                    logits: false,
                })
                .collect();
            let mut tokens = vec![Some(u32::MAX); n];
            choose_on_host(&mut rows, &logits, &host, &mut copies, &mut tokens);
            for i in 0..n {
                let want = match (host[i], i % 6 != 5) {
                    (false, _) => Some(u32::MAX),
                    (true, false) => None,
                    (true, true) => {
                        Some(alone[i].sample(&mut logits[i * vocab..][..vocab].to_vec()))
                    }
                };
                assert_eq!(tokens[i], want, "row {i} at step {step}");
            }
        }
    }

    #[test]
    fn check_batch_names_a_bad_token_a_repeated_session_and_a_full_one() {
        let c = Config::tiny();
        let row = |session, token| BatchRow {
            session,
            token,
            sampler: None,
            logits: true,
        };
        let held = |s: SessionId| if s == 2 { 16 } else { 3 };
        check_batch(&c, &[], 16, held).unwrap();
        check_batch(&c, &[row(1, 0), row(3, 7), row(4, 9)], 16, held).unwrap();
        let vocab = c.vocab_size as u32;
        let err = check_batch(&c, &[row(1, 0), row(3, vocab)], 16, held).unwrap_err();
        assert!(
            matches!(err, BackendError::BadToken { token, .. } if token == vocab),
            "{err}"
        );
        let err = check_batch(&c, &[row(1, 0), row(3, 1), row(1, 2)], 16, held).unwrap_err();
        assert!(err.to_string().contains("session 1 appears twice"), "{err}");
        let err = check_batch(&c, &[row(1, 0), row(2, 1)], 16, held).unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::ContextFull {
                    session: 2,
                    needed: 17,
                    capacity: 16
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn kv_type_parses_its_names_and_names_a_bad_one() {
        for t in [KvType::F16, KvType::F32] {
            assert_eq!(KvType::parse(t.name()).unwrap(), t);
        }
        let err = KvType::parse("bf16").unwrap_err().to_string();
        assert!(err.contains("'bf16'") && err.contains("f16, f32"), "{err}");
        assert_eq!(KvType::default(), KvType::F16);
        assert_eq!((KvType::F16.bytes(), KvType::F32.bytes()), (2, 4));
        // 1 + 2^-11 is halfway between two f16 values: it rounds to the even one, 1.
        assert_eq!(KvType::F16.round(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(
            KvType::F32.round(1.0 + 2f32.powi(-11)),
            1.0 + 2f32.powi(-11)
        );
    }
}
