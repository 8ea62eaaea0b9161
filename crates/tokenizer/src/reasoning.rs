//! Qwen3's reasoning split: the thinking switch a conversation asks for, and the generated
//! `<think>` block taken apart from the answer, whole (`split_reasoning`) or incrementally for
//! streams (`ReasoningSplitter`, also used on whole texts so streamed and non-streamed answers
//! agree). Where a block is opened (by the text or the prompt) the splitter's result equals
//! `split_reasoning`'s; a stray `</think>` in text that never opened a block stays content, since a
//! stream cannot take back text it has already sent as content.

use crate::chat::ChatMessage;

/// Qwen3's thinking switch: an explicit `enable_thinking=false` always wins (the soft switches
/// have no effect then, as in Qwen's docs); otherwise the latest `/think` or `/no_think` in a user
/// or system message decides.
pub fn thinking_switch(messages: &[ChatMessage], explicit: Option<bool>) -> Option<bool> {
    if explicit == Some(false) {
        return explicit;
    }
    let soft = messages
        .iter()
        .rev()
        .filter(|m| m.role == "user" || m.role == "system")
        .find_map(|m| {
            let (t, n) = (m.content.rfind("/think"), m.content.rfind("/no_think"));
            match (t, n) {
                (None, None) => None,
                (Some(t), Some(n)) => Some(t > n),
                (t, _) => Some(t.is_some()),
            }
        });
    soft.or(explicit)
}

/// Splits generated text into `(reasoning, content)` at `</think>`. Handles a leading `<think>` in
/// the text and a `<think>` already opened by the generation prompt (text starts inside the block).
/// Without `</think>`: a text starting with `<think>` is all (unfinished) reasoning, anything else
/// is all content. Empty reasoning (`enable_thinking=false`'s empty block) gives `None`.
pub fn split_reasoning(text: &str) -> (Option<String>, String) {
    let nonempty = |r: &str| {
        let r = r.trim_matches('\n');
        (!r.trim().is_empty()).then(|| r.to_string())
    };
    if let Some((before, after)) = text.split_once("</think>") {
        let reasoning = before.rsplit_once("<think>").map_or(before, |(_, r)| r);
        return (
            nonempty(reasoning),
            after.trim_start_matches('\n').to_string(),
        );
    }
    match text.trim_start().strip_prefix("<think>") {
        Some(reasoning) => (nonempty(reasoning), String::new()),
        None => (None, text.to_string()),
    }
}

/// `(reasoning, content)` of a whole generation; reasoning `None` when empty.
pub fn split_whole(text: &str, think_open: bool) -> (Option<String>, String) {
    let mut s = ReasoningSplitter::new(think_open);
    let (a, b) = (s.push(text), s.finish());
    let reasoning = a.reasoning + &b.reasoning;
    (
        (!reasoning.is_empty()).then_some(reasoning),
        a.content + &b.content,
    )
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Not yet known whether the text opens a think block.
    Start,
    /// Inside the block; leading newlines not yet passed.
    ReasoningStart,
    Reasoning,
    /// After `</think>`; leading newlines are dropped.
    ContentStart,
    Content,
}

/// Pieces of one push: reasoning text and answer text, either possibly empty.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

pub struct ReasoningSplitter {
    mode: Mode,
    /// Text held back: a possible `<think>` at the start, or a possible `</think>` (and the
    /// newlines before it, which `split_reasoning` trims) inside the block.
    held: String,
}

impl ReasoningSplitter {
    /// `think_open`: the generation prompt already opened a `<think>` block.
    pub fn new(think_open: bool) -> Self {
        ReasoningSplitter {
            mode: if think_open {
                Mode::ReasoningStart
            } else {
                Mode::Start
            },
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.held.push_str(text);
        loop {
            let before = (self.mode, self.held.len());
            self.step(&mut out);
            if (self.mode, self.held.len()) == before {
                return out;
            }
        }
    }

    /// Flushes what was held at the end of generation.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.mode {
            // `split_reasoning` treats an unclosed block as all reasoning, trimming its newlines.
            Mode::Reasoning | Mode::ReasoningStart => {
                let r = held.trim_end_matches('\n');
                Split {
                    reasoning: if r.trim().is_empty() {
                        String::new()
                    } else {
                        r.to_string()
                    },
                    ..Default::default()
                }
            }
            Mode::Start if held.trim_start().starts_with(OPEN) => Split::default(),
            _ => Split {
                content: held,
                ..Default::default()
            },
        }
    }

    fn step(&mut self, out: &mut Split) {
        match self.mode {
            Mode::Start => {
                let t = self.held.trim_start();
                if let Some(rest) = t.strip_prefix(OPEN) {
                    self.held = rest.to_string();
                    self.mode = Mode::ReasoningStart;
                } else if !OPEN.starts_with(t) {
                    out.content.push_str(&std::mem::take(&mut self.held));
                    self.mode = Mode::Content;
                }
            }
            Mode::ReasoningStart => {
                let t = self.held.trim_start_matches('\n');
                if !t.is_empty() {
                    self.held = t.to_string();
                    self.mode = Mode::Reasoning;
                }
            }
            Mode::Reasoning => {
                if let Some(i) = self.held.find(CLOSE) {
                    out.reasoning
                        .push_str(self.held[..i].trim_end_matches('\n'));
                    self.held = self.held[i + CLOSE.len()..].to_string();
                    self.mode = Mode::ContentStart;
                } else {
                    let keep = held_tail(&self.held);
                    let emit = self.held.len() - keep;
                    out.reasoning.push_str(&self.held[..emit]);
                    self.held.drain(..emit);
                }
            }
            Mode::ContentStart => {
                let t = self.held.trim_start_matches('\n');
                if !t.is_empty() {
                    self.held = t.to_string();
                    self.mode = Mode::Content;
                } else {
                    self.held.clear();
                }
            }
            Mode::Content => out.content.push_str(&std::mem::take(&mut self.held)),
        }
    }
}

/// Bytes at the end of `s` to hold: trailing newlines plus a partial `</think>` after them.
fn held_tail(s: &str) -> usize {
    let partial = (1..CLOSE.len())
        .rev()
        .find(|&n| s.ends_with(&CLOSE[..n]))
        .unwrap_or(0);
    let body = &s[..s.len() - partial];
    partial + (body.len() - body.trim_end_matches('\n').len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(text: &str, think_open: bool, chunk: usize) -> (Option<String>, String) {
        let mut s = ReasoningSplitter::new(think_open);
        let (mut r, mut c) = (String::new(), String::new());
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(chunk) {
            let out = s.push(&piece.iter().collect::<String>());
            r += &out.reasoning;
            c += &out.content;
        }
        let out = s.finish();
        r += &out.reasoning;
        c += &out.content;
        ((!r.is_empty()).then_some(r), c)
    }

    #[test]
    fn streaming_matches_split_reasoning() {
        let cases = [
            "<think>\nlet me see\n\n</think>\n\nThe answer.",
            "<think>\n\n</think>\n\nShort.",
            "<think>\nunfinished thought",
            "  <thi",
            "<th is not a tag",
            "no think at all",
            "<think>a</thi</think>b",
        ];
        for text in cases {
            for chunk in [1, 2, 3, 7, 100] {
                assert_eq!(
                    streamed(text, false, chunk),
                    split_reasoning(text),
                    "{text:?} chunk {chunk}"
                );
            }
        }
        assert_eq!(
            streamed("plain </think> text", false, 3),
            (None, "plain </think> text".into())
        );
        assert_eq!(
            split_whole("<think>\nr\n</think>\n\nc", false),
            (Some("r".into()), "c".into())
        );
        // The prompt opened the block: generated text starts inside it.
        for chunk in [1, 4, 100] {
            let text = "thinking\n</think>\n\nanswer";
            assert_eq!(
                streamed(text, true, chunk),
                split_reasoning(text),
                "open {chunk}"
            );
        }
    }

    #[test]
    fn thinking_switch_lets_explicit_false_win_then_the_latest_soft_switch() {
        let msgs = |texts: &[(&str, &str)]| -> Vec<ChatMessage> {
            texts
                .iter()
                .map(|(role, text)| match *role {
                    "system" => ChatMessage::system(*text),
                    "assistant" => ChatMessage::assistant(*text),
                    _ => ChatMessage::user(*text),
                })
                .collect()
        };
        let m = msgs(&[("system", "be brief /no_think"), ("user", "hi /think")]);
        assert_eq!(thinking_switch(&m, None), Some(true));
        assert_eq!(thinking_switch(&m, Some(false)), Some(false));
        let m = msgs(&[("user", "a /think then /no_think"), ("assistant", "/think")]);
        assert_eq!(thinking_switch(&m, Some(true)), Some(false));
        let m = msgs(&[("user", "no switch here")]);
        assert_eq!(thinking_switch(&m, None), None);
        assert_eq!(thinking_switch(&m, Some(true)), Some(true));
    }
}
