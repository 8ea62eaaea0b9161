//! The tokenizer on arbitrary text: encode/decode round trips with and without control tokens,
//! the stream decoder against `decode`, the early length check of `encode_within` against a full
//! encode, and typed control tokens staying text. Input: a flags byte, then either the text, or
//! (flag bit 0) added tokens separated by `\x01`, a `\x00`, and the text: those tokens join a
//! small vocabulary for this one execution (even ones as control, odd ones as user-defined).

use q4moe_tokenizer::{
    synthetic_spec, unicode_to_byte, ChatMessage, RenderedPrompt, TokenType, Tokenizer,
    TokenizerError, TokenizerSpec, SYNTHETIC_MIN_VOCAB,
};

use std::path::Path;

use q4moe_gguf::GgufFile;
use q4moe_model::spec_from_gguf;

use super::Target;
use crate::FuzzError;

pub struct TokenizerTarget {
    /// Qwen3-shaped, 4096 tokens (or a GGUF's): built once.
    fixed: Tokenizer,
    fixed_control: Vec<u32>,
    /// The smallest synthetic vocabulary, which added tokens from the input extend.
    small: TokenizerSpec,
}

impl TokenizerTarget {
    /// `vocab`: a GGUF whose tokenizer replaces the synthetic 4096-token one.
    pub fn new(vocab: Option<&Path>) -> Result<Self, FuzzError> {
        let spec = match vocab {
            None => synthetic_spec(4096, 0),
            Some(path) => {
                let bad = |e: String| FuzzError::Worker(format!("{}: {e}", path.display()));
                let file = GgufFile::open(path).map_err(|e| bad(e.to_string()))?;
                spec_from_gguf(&file.header, &path.display().to_string())
                    .map_err(|e| bad(e.to_string()))?
            }
        };
        let fixed = Tokenizer::from_spec(&spec).map_err(|e| FuzzError::Worker(e.to_string()))?;
        Ok(Self {
            fixed_control: control_ids(&spec),
            fixed,
            small: synthetic_spec(SYNTHETIC_MIN_VOCAB, 0),
        })
    }
}

/// Ids of the control tokens, where their spelling is not also an ordinary token's.
fn control_ids(spec: &TokenizerSpec) -> Vec<u32> {
    (0..spec.tokens.len() as u32)
        .filter(|&i| spec.token_types[i as usize] == TokenType::Control as i32)
        .collect()
}

const DICT: &[&[u8]] = &[
    b"<|im_start|>",
    b"<|im_end|>",
    b"<|endoftext|>",
    b"<think>",
    b"</think>",
    b"<tool_call>",
    b"<|fim_prefix|>",
    b"<|im_start",
    b"\xef\xb7\x90", // U+FDD0, the literal-text mark
    b"\x00",
    b"\x01",
    b"   ",
    b"\r\n",
    b"\t\t",
    b"'s",
    b"'LL",
    b"123456",
    b"\xf0\x9f\x98\x80",
    b"\xe4\xb8\xad\xe6\x96\x87",
    b"\xcc\x81",
    b"\xe2\x80\x8d",
];

impl Target for TokenizerTarget {
    fn name(&self) -> &'static str {
        "tokenizer"
    }

    fn max_len(&self) -> usize {
        4096
    }

    fn dict(&self) -> &'static [&'static [u8]] {
        DICT
    }

    fn run(&mut self, input: &[u8]) -> Result<String, String> {
        let (flags, rest) = input.split_first().unwrap_or((&0, &[]));
        if flags & 1 == 0 {
            let text = String::from_utf8_lossy(rest);
            return check_text(&self.fixed, &self.fixed_control, &text, true);
        }
        let (added, text) = match rest.iter().position(|&b| b == 0) {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (&[][..], rest),
        };
        let (spec, ascii) = extend(&self.small, added);
        let tok = match Tokenizer::from_spec(&spec) {
            Ok(t) => t,
            Err(e) => return Ok(format!("spec: {e}")),
        };
        let text = String::from_utf8_lossy(text);
        check_text(&tok, &control_ids(&spec), &text, ascii).map(|o| format!("added: {o}"))
    }
}

/// `base` plus the input's added tokens that are spelled in the byte alphabet and not already in
/// it (others are respelled or shadowed by design, which the `gguf` target covers); also whether
/// they are all printable ASCII (the byte-level decoder reads other spellings as bytes, as
/// transformers does, so only those round-trip as text).
fn extend(base: &TokenizerSpec, added: &[u8]) -> (TokenizerSpec, bool) {
    let mut spec = base.clone();
    let mut ascii = true;
    for (i, raw) in added.split(|&b| b == 1).enumerate().take(64) {
        let t = String::from_utf8_lossy(raw).into_owned();
        let in_alphabet = t.chars().all(|c| unicode_to_byte(c).is_some());
        if t.is_empty() || !in_alphabet || spec.tokens.contains(&t) {
            continue;
        }
        ascii &= t.bytes().all(|b| b.is_ascii_graphic());
        let ty = if i % 2 == 0 {
            TokenType::Control
        } else {
            TokenType::UserDefined
        };
        spec.tokens.push(t);
        spec.token_types.push(ty as i32);
    }
    (spec, ascii)
}

fn check_text(
    tok: &Tokenizer,
    control: &[u32],
    text: &str,
    round_trips: bool,
) -> Result<String, String> {
    let enc = |parse_special| {
        tok.encode(text, parse_special)
            .map_err(|e| format!("encode({parse_special}) failed: {e}"))
    };
    let (plain, special) = (enc(false)?, enc(true)?);
    for ids in [&plain, &special] {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= tok.vocab_size()) {
            return Err(format!("id {id} >= vocab {}", tok.vocab_size()));
        }
        let back = tok.decode(ids, false).map_err(|e| format!("decode: {e}"))?;
        if round_trips && back != text {
            return Err(format!("round trip: {text:?} -> {ids:?} -> {back:?}"));
        }
        check_stream(tok, ids)?;
    }
    if plain.iter().any(|id| control.contains(id)) {
        return Err(format!("control id in text encoded as plain: {plain:?}"));
    }
    check_within(tok, text, special.len())?;
    check_typed_controls(tok, control, text)?;
    // Digits are not part of an outcome's kind (see `signature`): say it in words.
    let size = match plain.len() {
        0 => "empty",
        1 => "one token",
        2..=9 => "a few tokens",
        _ => "many tokens",
    };
    let controls = special.iter().filter(|id| control.contains(id)).count();
    let parsed = ["no control", "a control", "controls"][controls.min(2)];
    let merged = if special.len() < plain.len() {
        ", fewer with specials"
    } else {
        ""
    };
    Ok(format!("{size}, {parsed}{merged}"))
}

/// The stream decoder's pieces add up to `decode`, with and without control tokens.
fn check_stream(tok: &Tokenizer, ids: &[u32]) -> Result<(), String> {
    for skip in [false, true] {
        let mut stream = tok.stream_decoder(skip);
        let mut text: String = ids.iter().filter_map(|&id| stream.push(id)).collect();
        text.push_str(&stream.finish());
        let whole = tok.decode(ids, skip).map_err(|e| format!("decode: {e}"))?;
        if text != whole {
            return Err(format!("stream (skip {skip}) {text:?} != decode {whole:?}"));
        }
    }
    Ok(())
}

/// `encode_within` accepts exactly the prompts of at most `max` tokens, with the same ids.
fn check_within(tok: &Tokenizer, text: &str, n: usize) -> Result<(), String> {
    let prompt = RenderedPrompt::plain(text);
    let full = tok.encode(text, true).map_err(|e| format!("encode: {e}"))?;
    match tok.encode_within(&prompt, n) {
        Ok(ids) if ids == full => {}
        other => return Err(format!("encode_within({n}) = {other:?}, encode = {full:?}")),
    }
    if n > 0 {
        match tok.encode_within(&prompt, n - 1) {
            Err(TokenizerError::TooLong { .. }) => {}
            other => {
                return Err(format!(
                    "encode_within({}) of {n} tokens = {other:?}",
                    n - 1
                ))
            }
        }
    }
    Ok(())
}

/// Content typed by a client never yields a control id, and marking keeps its text intact.
fn check_typed_controls(tok: &Tokenizer, control: &[u32], text: &str) -> Result<(), String> {
    let marked = tok.mark_messages(&[ChatMessage::user(text)]);
    let prompt = RenderedPrompt::from_marked(&marked[0].content);
    let clean: String = text.chars().filter(|&c| c != '\u{FDD0}').collect();
    if prompt.text() != clean {
        return Err(format!("marking changed the text: {:?}", prompt.text()));
    }
    let ids = tok
        .encode_within(&prompt, usize::MAX / 2)
        .map_err(|e| format!("encode_within: {e}"))?;
    if let Some(id) = ids.iter().find(|id| control.contains(id)) {
        return Err(format!("typed text yielded control id {id}: {ids:?}"));
    }
    Ok(())
}
