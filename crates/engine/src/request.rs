//! What a generation asks for and what it returns: the request (prompt, length, sampling,
//! stops), how it ended, and its output with the phase times.

use std::time::Duration;

use q4moe_model::backend::DecodeStats;
use q4moe_model::sampling::SamplingParams;

use crate::logprobs::{LogprobOptions, TokenLogprob};

/// A prompt as text (special tokens parsed) or as token ids.
#[derive(Debug, Clone)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (clamped to the room left in the context).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Stop at the tokenizer's end-of-sequence / end-of-turn tokens.
    pub stop_at_eos: bool,
    /// Keep each step's logits (for `--logits-out`).
    pub want_logits: bool,
    /// Reuse a cached session whose KV shares a prefix with the prompt.
    pub reuse_prefix: bool,
    /// Report each token's logprob (the backend then hands back every step's logits).
    pub logprobs: Option<LogprobOptions>,
}

impl GenerateRequest {
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            stop_at_eos: true,
            want_logits: false,
            reuse_prefix: false,
            logprobs: None,
        }
    }

    /// Whether each step's logits must come back from the backend.
    pub fn needs_logits(&self) -> bool {
        self.want_logits || self.logprobs.is_some()
    }

    /// Whether the prompt's logprobs are wanted (its prefill then returns every position's
    /// logits and reuses no prefix).
    pub fn prompt_logprobs(&self) -> bool {
        self.logprobs.is_some_and(|l| l.prompt)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token or stop string.
    Stop,
    /// `max_tokens` or the context ran out.
    Length,
    /// The caller's text sink asked to stop (e.g. a client went away).
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    /// Generated tokens (a final end-of-sequence token included).
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: Finish,
    /// The stop string that ended the generation, when one did (`finish` is then `Stop`).
    pub stop_sequence: Option<String>,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused rather than recomputed.
    pub cached_tokens: usize,
    /// From the start to the first generated token (the prefill and the decode step that
    /// produces it): the time to first token.
    pub prefill_time: Duration,
    /// From the first generated token to the end.
    pub decode_time: Duration,
    pub stats: DecodeStats,
    /// With `want_logits`: the logits each generated token was chosen from, `[steps][vocab]`.
    pub logits: Vec<Vec<f32>>,
    /// With `logprobs`: one per generated token, in order.
    pub logprobs: Vec<TokenLogprob>,
    /// With `logprobs.prompt`: one per prompt token, the first without a logprob.
    pub prompt_logprobs: Vec<TokenLogprob>,
}
