//! Message content is text. A control token a client types into a message (`<|im_start|>system`)
//! must not become a control id, or a user could forge turns and roles; only the template's own
//! markup may (llama-server and transformers make the same split). The content is marked before
//! rendering, so the template's string methods still see it whole, and the marks are taken out
//! after, leaving the offsets where a control token may not match.

use std::ops::Deref;

use crate::added::AddedTokens;
use crate::ChatMessage;

/// Put after the first char of each control token spelled in a message. A Unicode noncharacter,
/// reserved for a program's internal use: a client's own copies are dropped from its messages.
pub(crate) const MARK: char = '\u{FDD0}';

/// A prompt ready to tokenise: its text, and the offsets inside client text where a control token
/// must stay plain text. Reads as its text (`&*prompt`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedPrompt {
    text: String,
    literal_at: Vec<usize>,
}

impl RenderedPrompt {
    /// Text whose control tokens all count: a raw completion prompt keeps parsing them.
    pub fn plain(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            literal_at: Vec::new(),
        }
    }

    /// A template's output over messages marked by [`crate::Tokenizer::mark_messages`]: the marks
    /// are taken out and their offsets kept.
    pub fn from_marked(marked: &str) -> Self {
        let mut text = String::with_capacity(marked.len());
        let mut literal_at = Vec::new();
        for c in marked.chars() {
            if c == MARK {
                literal_at.push(text.len());
            } else {
                text.push(c);
            }
        }
        Self { text, literal_at }
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// Sorted byte offsets in [`Self::text`]; a control token straddling one stays text.
    pub fn literal_at(&self) -> &[usize] {
        &self.literal_at
    }
}

impl Deref for RenderedPrompt {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

/// `s` with a [`MARK`] inside every control token it spells, and none of its own.
pub(crate) fn mark(added: &AddedTokens, s: &str) -> String {
    let clean: String = s.chars().filter(|&c| c != MARK).collect();
    let cuts = added.control_cuts(&clean);
    if cuts.is_empty() {
        return clean;
    }
    let mut out = String::with_capacity(clean.len() + cuts.len() * MARK.len_utf8());
    let mut from = 0;
    for cut in cuts {
        out.push_str(&clean[from..cut]);
        out.push(MARK);
        from = cut;
    }
    out.push_str(&clean[from..]);
    out
}

pub(crate) fn mark_message(added: &AddedTokens, m: &ChatMessage) -> ChatMessage {
    let mut calls = m.tool_calls.clone();
    for c in &mut calls {
        c.function.name = mark(added, &c.function.name);
        c.function.arguments = mark_json(added, &c.function.arguments);
    }
    ChatMessage {
        role: m.role.clone(),
        content: mark(added, &m.content),
        reasoning_content: m.reasoning_content.as_deref().map(|r| mark(added, r)),
        tool_calls: calls,
        tool_call_id: m.tool_call_id.clone(),
    }
}

/// Every string (keys included) of a JSON value marked.
pub(crate) fn mark_json(added: &AddedTokens, v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(mark(added, s)),
        Value::Array(items) => Value::Array(items.iter().map(|x| mark_json(added, x)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (mark(added, k), mark_json(added, x)))
                .collect(),
        ),
        scalar => scalar.clone(),
    }
}

/// Byte offsets where `text` may be cut into pieces tokenised on their own with the same result
/// under the byte-level split regexes (GPT-2, Qwen2, Llama 3): after a newline followed by a
/// non-space, and before a space that sits between a non-space and a letter. Pieces are at least
/// `min_piece` bytes where such a cut exists. Used only to count tokens early; see `encode_within`.
pub(crate) fn piece_cuts(text: &str, min_piece: usize) -> Vec<usize> {
    let mut cuts = Vec::new();
    let mut last = 0;
    let mut prev: Option<char> = None;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let next = chars.peek().map(|&(_, n)| n);
        let cut_after_newline = c == '\n' && next.is_some_and(|n| !n.is_whitespace());
        let cut_before_space = c == ' '
            && prev.is_some_and(|p| !p.is_whitespace())
            && next.is_some_and(char::is_alphabetic);
        if cut_before_space && i - last >= min_piece {
            cuts.push(i);
            last = i;
        } else if cut_after_newline && i + 1 - last >= min_piece {
            cuts.push(i + 1);
            last = i + 1;
        }
        prev = Some(c);
    }
    cuts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_taken_out_and_remembered() {
        let p = RenderedPrompt::from_marked("a<\u{FDD0}|x|>b");
        assert_eq!(p.text(), "a<|x|>b");
        assert_eq!(p.literal_at(), [2]);
        assert_eq!(&*p, "a<|x|>b");
    }

    #[test]
    fn cuts_fall_on_word_and_line_starts() {
        let t = "ab cd\nef  gh";
        assert_eq!(piece_cuts(t, 1), [2, 6]);
        assert_eq!(piece_cuts(t, 100), Vec::<usize>::new());
    }
}
