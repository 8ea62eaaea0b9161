//! The generation loop, gpt-fast's shape: checks the request once, prefills the prompt but its
//! last token (keys and values only, reusing a cached prefix), then hands the last prompt token
//! to the backend's decode-n, which produces every generated token, the first included; stop
//! ids, stop strings and streaming text are handled here.

use std::time::Instant;

use q4moe_model::backend::{DecodeRequest, DecodeStats, Flow, Logits, SessionId, TokenEvent};

use crate::collect::{Collector, Outcome};
use crate::request::{GenerateOutput, GenerateRequest};
use crate::{Engine, EngineError, Result};

impl Engine {
    /// Generates a completion, streaming text through `on_text` (return `Flow::Stop` to cancel).
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str) -> Flow,
    ) -> Result<GenerateOutput> {
        let max_tokens = self.check_request(req)?;
        let (session, cached) =
            self.sessions
                .acquire(self.backend.as_mut(), &req.prompt, req.reuse_prefix);
        let result = self.run_session(req, session, cached, max_tokens, on_text);
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
        Ok(req.max_tokens.min(capacity - req.prompt.len()))
    }

    fn run_session(
        &mut self,
        req: &GenerateRequest,
        session: u64,
        cached: usize,
        max_tokens: usize,
        on_text: &mut dyn FnMut(&str) -> Flow,
    ) -> Result<GenerateOutput> {
        let t0 = Instant::now();
        // The session store leaves at least the last prompt token uncached: decode runs it.
        let (&last, before) = req.prompt.split_last().expect("checked: not empty");
        self.backend
            .prefill(session, &before[cached..], Logits::None)?;
        let mut c = Collector::new(self.prompter.tokenizer(), req);
        let mut stats = DecodeStats::default();
        if max_tokens > 0 {
            let dreq = DecodeRequest {
                session,
                first_token: last,
                max_tokens,
                sampling: &req.sampling,
                history: &req.prompt,
                want_logits: req.want_logits,
            };
            stats = self.backend.decode(&dreq, &mut |ev: TokenEvent<'_>| {
                c.accept(ev.token, ev.logits, on_text)
            })?;
        }
        let outcome = Outcome {
            prompt_tokens: req.prompt.len(),
            cached_tokens: cached,
            started: t0,
            stats,
        };
        Ok(c.finish(outcome, on_text))
    }
}
