//! Incremental detokenizer: text arrives token by token without ever splitting a UTF-8 char.

use std::ops::Deref;

use crate::Tokenizer;

/// Feeds ids one at a time and returns text as soon as it forms complete UTF-8. The concatenation of
/// every `push` result and `finish()` equals `Tokenizer::decode` of the same ids (invalid sequences
/// become U+FFFD exactly as `String::from_utf8_lossy` does). `T` is how the decoder holds the
/// tokenizer: a borrow, or an `Arc` where the decoder outlives any one borrow (a sequence in a
/// running batch).
pub struct StreamDecoder<T: Deref<Target = Tokenizer>> {
    tokenizer: T,
    skip_special: bool,
    /// Bytes not yet returned: at most an incomplete char's prefix between calls.
    pending: Vec<u8>,
}

impl<T: Deref<Target = Tokenizer>> StreamDecoder<T> {
    pub fn new(tokenizer: T, skip_special: bool) -> Self {
        Self {
            tokenizer,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the newly complete text, or `None` when nothing new is complete yet
    /// (or the id is out of range or a skipped control token).
    pub fn push(&mut self, id: u32) -> Option<String> {
        let idx = id as usize;
        let bytes = self.tokenizer.token_bytes.get(idx)?;
        if self.skip_special && self.tokenizer.is_control[idx] {
            return None;
        }
        self.pending.extend_from_slice(bytes);
        let out = self.drain_complete();
        (!out.is_empty()).then_some(out)
    }

    /// Whatever is left, with a trailing incomplete char as U+FFFD; resets the decoder.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Takes every complete char off the front of `pending`, keeping an incomplete tail.
    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid]).expect("validated"),
                    );
                    match e.error_len() {
                        // Invalid bytes in the middle: one U+FFFD per maximal bad run, like lossy.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + len;
                        }
                        // Truncated char at the end: wait for the next token.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
