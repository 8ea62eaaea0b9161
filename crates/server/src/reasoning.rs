//! Incremental `<think>` splitting for streams, also used on whole texts so streamed and
//! non-streamed answers agree. Where a block is opened (by the text or the prompt) the result
//! equals `split_reasoning`'s; a stray `</think>` in text that never opened a block stays content,
//! since a stream cannot take back text it has already sent as content.

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
    use q4moe_tokenizer::split_reasoning;

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
}
