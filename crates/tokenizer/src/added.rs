//! [`AddedTokens`]: control and user-defined tokens, matched whole in the text before BPE.
//!
//! This replaces `tokenizers`' own added vocabulary, whose matcher is an Aho-Corasick DFA whenever
//! there are at most 100 added tokens (Qwen3 has 26): building that DFA walks failure chains
//! without memoising them, so one repetitive 20 KB token took 25 s to load and 200 KB never
//! finished. An NFA built from the same patterns is linear in their total length. The matching
//! rules are `tokenizers`' for non-normalized tokens without lstrip/rstrip/single_word:
//! leftmost-longest over all added tokens, and a control token matched while control tokens are
//! plain text stays text (its bytes are not searched again for shorter tokens).

use std::collections::HashSet;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, AhoCorasickKind, MatchKind};

use crate::TokenizerError;

/// One added token: its vocabulary id and whether it is a control (special) token.
#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u32,
    control: bool,
}

pub(crate) struct AddedTokens {
    /// `None` when the vocabulary has no added tokens.
    matcher: Option<AhoCorasick>,
    /// Per matcher pattern.
    entries: Vec<Entry>,
}

/// A piece of the text: plain text for BPE, or an added token's id.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Segment<'a> {
    Text(&'a str),
    Token(u32),
}

impl AddedTokens {
    /// `control` and `user` are `(spelling, id)` pairs. A spelling seen before keeps its first
    /// entry, control tokens first, as `tokenizers` does; empty spellings never match.
    pub(crate) fn new<'a>(
        control: impl IntoIterator<Item = (&'a str, u32)>,
        user: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Result<Self, TokenizerError> {
        let mut seen = HashSet::new();
        let mut patterns = Vec::new();
        let mut entries = Vec::new();
        let tagged = control
            .into_iter()
            .map(|(t, id)| (t, id, true))
            .chain(user.into_iter().map(|(t, id)| (t, id, false)));
        for (t, id, control) in tagged {
            if !t.is_empty() && seen.insert(t) {
                patterns.push(t);
                entries.push(Entry { id, control });
            }
        }
        if patterns.is_empty() {
            return Ok(Self {
                matcher: None,
                entries,
            });
        }
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .kind(Some(AhoCorasickKind::ContiguousNFA))
            .build(&patterns)
            .map_err(|e| TokenizerError::spec("tokens", format!("added tokens: {e}")))?;
        Ok(Self {
            matcher: Some(matcher),
            entries,
        })
    }

    /// Splits `text` into plain text and added tokens; control tokens count only with
    /// `parse_special`. Empty text pieces are left out.
    #[cfg(test)]
    pub(crate) fn split<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Segment<'t>> {
        self.split_except(text, parse_special, &[])
    }

    /// [`Self::split`], except that a control token straddling one of the sorted byte offsets in
    /// `literal_at` stays text: it was typed into a message, not written by the template.
    pub(crate) fn split_except<'t>(
        &self,
        text: &'t str,
        parse_special: bool,
        literal_at: &[usize],
    ) -> Vec<Segment<'t>> {
        let mut out = Vec::new();
        let mut start = 0;
        for m in self.matcher.iter().flat_map(|ac| ac.find_iter(text)) {
            let entry = self.entries[m.pattern().as_usize()];
            if entry.control && (!parse_special || straddles(literal_at, m.start(), m.end())) {
                continue;
            }
            if start < m.start() {
                out.push(Segment::Text(&text[start..m.start()]));
            }
            out.push(Segment::Token(entry.id));
            start = m.end();
        }
        if start < text.len() {
            out.push(Segment::Text(&text[start..]));
        }
        out
    }

    /// Byte offsets, one inside each control token spelled in `text` (after its first char), where
    /// [`crate::literal`] puts a mark so the token cannot match once the text is rendered.
    pub(crate) fn control_cuts(&self, text: &str) -> Vec<usize> {
        let Some(ac) = &self.matcher else {
            return Vec::new();
        };
        ac.find_iter(text)
            .filter(|m| self.entries[m.pattern().as_usize()].control)
            .map(|m| m.start() + text[m.start()..].chars().next().map_or(1, char::len_utf8))
            .collect()
    }
}

/// Whether a sorted offset lies strictly inside `start..end`.
fn straddles(sorted: &[usize], start: usize, end: usize) -> bool {
    let i = sorted.partition_point(|&p| p <= start);
    sorted.get(i).is_some_and(|&p| p < end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Segment::{Text, Token};

    fn added() -> AddedTokens {
        AddedTokens::new(
            [("<|a|>", 10), ("<x", 12)],
            [("<think>", 11), ("<|a|>", 13), ("", 14)],
        )
        .unwrap()
    }

    #[test]
    fn leftmost_longest_and_control_as_text() {
        let a = added();
        let text = "hi<|a|><think>yo<x";
        let got = a.split(text, true);
        assert_eq!(
            got,
            [Text("hi"), Token(10), Token(11), Text("yo"), Token(12)]
        );
        // A skipped control match is not searched again for shorter tokens.
        let got = a.split(text, false);
        assert_eq!(got, [Text("hi<|a|>"), Token(11), Text("yo<x")]);
        assert_eq!(a.split("", true), []);
    }

    #[test]
    fn a_control_token_straddling_a_literal_offset_stays_text() {
        let a = added();
        let text = "<|a|>x<|a|>";
        assert_eq!(a.control_cuts(text), [1, 7]);
        assert_eq!(
            a.split_except(text, true, &[7]),
            [Token(10), Text("x<|a|>")]
        );
        // An offset at a token's edge does not protect it.
        assert_eq!(
            a.split_except(text, true, &[6]),
            [Token(10), Text("x"), Token(10)]
        );
    }

    #[test]
    fn no_added_tokens_is_one_text_piece() {
        let a = AddedTokens::new([], []).unwrap();
        assert_eq!(a.split("abc", true), [Text("abc")]);
    }
}
