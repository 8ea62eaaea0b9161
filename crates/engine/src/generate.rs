//! The generation loop, gpt-fast's shape: checks the request once, prefills the prompt but its
//! last token (keys and values only, reusing a cached prefix), then hands the last prompt token
//! to the backend's decode-n, which produces every generated token, the first included; stop
//! ids, stop strings and streaming text are handled here.

use std::time::Instant;

use q4moe_model::backend::{
    BackendError, DecodeRequest, DecodeStats, Flow, Logits, SessionId, TokenEvent,
};

use crate::collect::{Collector, Outcome};
use crate::logprobs::{prompt_logprobs, LogprobOptions, Piece, PROMPT_LOGITS_CHUNK};
use crate::request::{GenerateOutput, GenerateRequest};
use crate::{Engine, EngineError, Result};

impl Engine {
    /// Generates a completion, streaming text through `on_text` (return `Flow::Stop` to cancel).
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str) -> Flow,
    ) -> Result<GenerateOutput> {
        self.generate_pieces(req, &mut |p| match p {
            Piece::Text { text, .. } => on_text(text),
            Piece::Prompt(_) => Flow::Continue,
        })
    }

    /// `generate`, with the logprobs (`GenerateRequest::logprobs`) handed over beside the text.
    pub fn generate_pieces(
        &mut self,
        req: &GenerateRequest,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<GenerateOutput> {
        let max_tokens = self.check_request(req)?;
        let (session, cached) = self.sessions.acquire(
            self.backend.as_mut(),
            &req.prompt,
            req.reuse_prefix && !req.prompt_logprobs(),
        );
        // Run alone after the store made room: a pool too small for it is too small, full stop.
        let result = self
            .run_session(req, session, cached, max_tokens, on_piece)
            .map_err(|e| match e {
                EngineError::Backend(BackendError::KvFull { capacity, .. }) => {
                    EngineError::KvExceeded { capacity }
                }
                e => e,
            });
        match &result {
            Ok(out) => self.release_session(session, &req.prompt, &out.tokens),
            Err(_) => self.sessions.discard(self.backend.as_mut(), session),
        }
        result
    }

    /// Returns a finished sequence's session to the store for prefix reuse.
    pub(crate) fn release_session(
        &mut self,
        session: SessionId,
        prompt: &[u32],
        generated: &[u32],
    ) {
        // The KV holds a prefix of what was fed: the prompt, then the generated tokens.
        let held = self.backend.kv_len(session);
        let mut in_kv = prompt.to_vec();
        in_kv.extend_from_slice(generated);
        in_kv.truncate(held);
        self.sessions.release(self.backend.as_mut(), session, in_kv);
    }

    /// The request's checks, once, before any backend work: a non-empty prompt inside the
    /// vocabulary with room after it, valid sampling. Returns `max_tokens` clamped to the room.
    pub(crate) fn check_request(&self, req: &GenerateRequest) -> Result<usize> {
        let capacity = self.context_capacity();
        if req.prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        if req.prompt.len() >= capacity {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt.len(),
                context: capacity,
            });
        }
        let vocab = self.model.config.vocab_size;
        if let Some((i, t)) = req
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(EngineError::Invalid(format!(
                "prompt token {i} (id {t}) is outside the vocabulary of {vocab}"
            )));
        }
        req.sampling.validate().map_err(EngineError::Invalid)?;
        check_bias_and_logprobs(req, vocab)?;
        Ok(req.max_tokens.min(capacity - req.prompt.len()))
    }

    fn run_session(
        &mut self,
        req: &GenerateRequest,
        session: u64,
        cached: usize,
        max_tokens: usize,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<GenerateOutput> {
        let t0 = Instant::now();
        // The session store leaves at least the last prompt token uncached: decode runs it.
        let (&last, before) = req.prompt.split_last().expect("checked: not empty");
        let mut c = Collector::new(self.prompter.tokenizer(), req);
        // Room in the KV pool for the whole request where one is kept (cached sessions dropped
        // for it); a request that outgrows what is left ends with the pool's error.
        let positions = req.prompt.len() - cached + max_tokens;
        self.sessions
            .make_room(self.backend.as_mut(), &[(session, positions)]);
        match req.logprobs.filter(|o| o.prompt) {
            // In bounded chunks: every position's logits are vocab floats each.
            Some(o) => {
                let vocab = self.model.config.vocab_size;
                for start in (cached..before.len()).step_by(PROMPT_LOGITS_CHUNK) {
                    let end = (start + PROMPT_LOGITS_CHUNK).min(before.len());
                    let all = self
                        .backend
                        .prefill(session, &before[start..end], Logits::All)?;
                    let lps = prompt_logprobs(&req.prompt, start, &all, vocab, o.top);
                    c.push_prompt_logprobs(lps);
                }
            }
            None => {
                self.backend
                    .prefill(session, &before[cached..], Logits::None)?;
            }
        }
        let mut stats = DecodeStats::default();
        if max_tokens > 0 {
            let dreq = DecodeRequest {
                session,
                first_token: last,
                max_tokens,
                sampling: &req.sampling,
                history: &req.prompt,
                want_logits: req.needs_logits(),
            };
            stats = self.backend.decode(&dreq, &mut |ev: TokenEvent<'_>| {
                c.accept(ev.token, ev.logits, on_piece)
            })?;
        }
        let outcome = Outcome {
            prompt_tokens: req.prompt.len(),
            cached_tokens: cached,
            started: t0,
            stats,
        };
        Ok(c.finish(outcome, on_piece))
    }
}

/// A bias on an id the model does not have, or more alternatives than OpenAI allows.
fn check_bias_and_logprobs(req: &GenerateRequest, vocab: usize) -> Result<()> {
    let bias = &req.sampling.logit_bias;
    if let Some(&(t, _)) = bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return Err(EngineError::Invalid(format!(
            "logit_bias names token id {t}, outside the vocabulary of {vocab}"
        )));
    }
    match req.logprobs.filter(|o| o.top > LogprobOptions::MAX_TOP) {
        Some(o) => Err(EngineError::Invalid(format!(
            "top_logprobs = {} is above {}",
            o.top,
            LogprobOptions::MAX_TOP
        ))),
        None => Ok(()),
    }
}
