//! Accepting a generated token, the one implementation both generation loops share (the
//! single-sequence `Engine::generate` and the continuous batch): stop ids, the streaming
//! decoder, stop strings, the text sink, and the output a finished sequence reports.

use std::sync::Arc;
use std::time::Instant;

use q4moe_model::backend::{DecodeStats, Flow};
use q4moe_tokenizer::{StreamDecoder, Tokenizer};

use crate::logprobs::{token_logprob, LogprobOptions, Piece, TokenLogprob};
use crate::request::{Finish, GenerateOutput, GenerateRequest};
use crate::stop::StopMatcher;

/// One sequence's bookkeeping while it generates. The text sink is passed to each call rather
/// than held, so the batch can keep its sinks beside the collectors.
pub(crate) struct Collector {
    stop_ids: Vec<u32>,
    stop_at_eos: bool,
    decoder: StreamDecoder<Arc<Tokenizer>>,
    matcher: StopMatcher,
    tokens: Vec<u32>,
    text: String,
    /// Raw logits are kept only for `want_logits`; logprobs only for `logprobs`.
    keep_logits: bool,
    logits: Vec<Vec<f32>>,
    logprob_opts: Option<LogprobOptions>,
    logprobs: Vec<TokenLogprob>,
    /// `logprobs[shown..]` were accepted but their text not yet shown.
    shown: usize,
    prompt_logprobs: Vec<TokenLogprob>,
    /// The prompt's logprobs went out (before the first text).
    prompt_sent: bool,
    finish: Option<Finish>,
    /// When the first token arrived.
    first_at: Option<Instant>,
}

/// What a finished sequence reports beside its tokens and text.
pub(crate) struct Outcome {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// When the request's work began (its prefill), for the time to first token.
    pub started: Instant,
    pub stats: DecodeStats,
}

impl Collector {
    pub fn new(tokenizer: &Arc<Tokenizer>, req: &GenerateRequest) -> Self {
        Collector {
            stop_ids: tokenizer.stop_ids(),
            stop_at_eos: req.stop_at_eos,
            decoder: StreamDecoder::new(tokenizer.clone(), true),
            matcher: StopMatcher::new(&req.stop),
            tokens: Vec::new(),
            text: String::new(),
            keep_logits: req.want_logits,
            logits: Vec::new(),
            logprob_opts: req.logprobs,
            logprobs: Vec::new(),
            shown: 0,
            prompt_logprobs: crate::logprobs::first_prompt_token(&req.prompt),
            prompt_sent: !req.prompt_logprobs(),
            finish: None,
            first_at: None,
        }
    }

    /// Tokens accepted so far.
    pub fn generated(&self) -> usize {
        self.tokens.len()
    }

    /// The tokens accepted so far, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The logprobs of the prompt tokens a prefill chunk just ran (`LogprobOptions::prompt`).
    pub fn push_prompt_logprobs(&mut self, lps: Vec<TokenLogprob>) {
        self.prompt_logprobs.extend(lps);
    }

    /// Takes one generated token (and the logits it came from, when asked for); `Stop` once
    /// the sequence is finished by a stop id, a stop string or the sink.
    pub fn accept(
        &mut self,
        token: u32,
        logits: Option<&[f32]>,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Flow {
        self.first_at.get_or_insert_with(Instant::now);
        self.send_prompt(on_piece);
        self.tokens.push(token);
        if let (Some(l), true) = (logits, self.keep_logits) {
            self.logits.push(l.to_vec());
        }
        if let (Some(l), Some(o)) = (logits, self.logprob_opts) {
            self.logprobs.push(token_logprob(l, token, o.top));
        }
        if self.stop_at_eos && self.stop_ids.contains(&token) {
            self.finish = Some(Finish::Stop);
            return Flow::Stop;
        }
        let piece = self.decoder.push(token).unwrap_or_default();
        let (out, hit) = self.matcher.push(&piece);
        self.emit(&out, on_piece);
        if hit {
            self.finish = Some(Finish::Stop);
        }
        if self.finish.is_some() {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }

    /// The client went away: nothing more is emitted.
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(Finish::Cancelled);
    }

    fn send_prompt(&mut self, on_piece: &mut dyn FnMut(Piece<'_>) -> Flow) {
        if std::mem::replace(&mut self.prompt_sent, true) || self.finish.is_some() {
            return;
        }
        if on_piece(Piece::Prompt(&self.prompt_logprobs)) == Flow::Stop {
            self.finish = Some(Finish::Cancelled);
        }
    }

    fn emit(&mut self, s: &str, on_piece: &mut dyn FnMut(Piece<'_>) -> Flow) {
        if s.is_empty() || self.finish.is_some() {
            return;
        }
        self.text.push_str(s);
        let logprobs = &self.logprobs[self.shown..];
        self.shown = self.logprobs.len();
        if on_piece(Piece::Text { text: s, logprobs }) == Flow::Stop {
            self.finish = Some(Finish::Cancelled);
        }
    }

    /// Emits the text held back (an incomplete char, a possible stop string's start) unless the
    /// sequence already finished, and reports it.
    pub fn finish(
        mut self,
        outcome: Outcome,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> GenerateOutput {
        let end = Instant::now();
        let first_at = self.first_at.unwrap_or(end);
        self.send_prompt(on_piece);
        if self.finish.is_none() {
            let tail = self.decoder.finish();
            let (out, _) = self.matcher.push(&tail);
            self.emit(&out, on_piece);
            let held = self.matcher.finish();
            self.emit(&held, on_piece);
        }
        // The tokens whose text never showed (an end-of-sequence id, a stop string).
        if self.shown < self.logprobs.len() && self.finish != Some(Finish::Cancelled) {
            let logprobs = &self.logprobs[self.shown..];
            on_piece(Piece::Text { text: "", logprobs });
            self.shown = self.logprobs.len();
        }
        GenerateOutput {
            finish: self.finish.unwrap_or(Finish::Length),
            stop_sequence: self.matcher.matched().map(String::from),
            tokens: self.tokens,
            text: self.text,
            prompt_tokens: outcome.prompt_tokens,
            cached_tokens: outcome.cached_tokens,
            prefill_time: first_at - outcome.started,
            decode_time: end - first_at,
            stats: outcome.stats,
            logits: self.logits,
            logprobs: self.logprobs,
            prompt_logprobs: if self.logprob_opts.is_some_and(|o| o.prompt) {
                self.prompt_logprobs
            } else {
                Vec::new()
            },
        }
    }
}
