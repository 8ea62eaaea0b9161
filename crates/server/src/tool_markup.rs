//! Reading tool calls out of generated text: Qwen3's `<tool_call>{"name": ..., "arguments":
//! {...}}</tool_call>` markup becomes OpenAI tool calls (ids `call_<random>`, arguments as JSON
//! text), the text around them stays content. One incremental parser serves streams and whole
//! answers alike, so a streamed answer reassembles to the non-streamed one. A block whose JSON
//! is not a call, or that never closes, stays content as it was written.

use q4moe_engine::ToolCall;
use rand::distributions::Alphanumeric;
use rand::Rng;
use serde_json::Value;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// What the parser hands on: content text, or a whole call with its index among the calls.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(usize, ToolCall),
}

/// Whitespace between calls, before the first or after the last is markup, not content: it is
/// held until text follows it, and dropped if a call does.
#[derive(Debug, Default)]
pub struct CallParser {
    /// Text not yet handed on: a possible start of `<tool_call>`, an open block (with the
    /// blanks before it), held blanks.
    buf: String,
    /// Where `<tool_call>` starts in `buf` while a block is open.
    open_at: Option<usize>,
    /// The last thing handed on was a call: blanks that follow are markup.
    after_call: bool,
    calls: usize,
}

impl CallParser {
    /// Calls handed on so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if let Some(open) = self.open_at {
                let Some(end) = self.buf[open..].find(CLOSE).map(|e| e + open) else {
                    break;
                };
                let block: String = self.buf.drain(..end + CLOSE.len()).collect();
                self.open_at = None;
                match parse_call(&block[open + OPEN.len()..end]) {
                    Some(call) => {
                        out.push(Piece::Call(self.calls, call));
                        self.calls += 1;
                        self.after_call = true;
                    }
                    None => self.text(&mut out, block),
                }
                continue;
            }
            if let Some(at) = self.buf.find(OPEN) {
                // The blanks before a block stay with it: dropped if it is a call.
                let blanks = self.buf[..at].len() - self.buf[..at].trim_end().len();
                let before: String = self.buf.drain(..at - blanks).collect();
                self.text(&mut out, before);
                self.open_at = Some(blanks);
                continue;
            }
            // Keep what may still become `<tool_call>` and trailing blanks; hand on the rest.
            let keep = held_suffix(&self.buf);
            let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
            self.text(&mut out, ready);
            break;
        }
        out
    }

    /// The end of the text: an unclosed block stays content, held blanks too unless calls
    /// were made.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        if self.open_at.take().is_some() || self.calls == 0 || !rest.trim().is_empty() {
            self.text(&mut out, rest);
        }
        out
    }

    /// Hands on content, less the blanks that directly follow a call.
    fn text(&mut self, out: &mut Vec<Piece>, s: String) {
        let s = match self.after_call {
            true => s.trim_start().to_string(),
            false => s,
        };
        if !s.is_empty() {
            self.after_call = false;
            out.push(Piece::Text(s));
        }
    }
}

/// Bytes at the end of `buf` to hold back: trailing blanks and a prefix of `<tool_call>`.
fn held_suffix(buf: &str) -> usize {
    let open = (1..OPEN.len())
        .rev()
        .find(|&n| buf.ends_with(&OPEN[..n]))
        .unwrap_or(0);
    let body = &buf[..buf.len() - open];
    open + body.len() - body.trim_end().len()
}

/// A call's JSON (`{"name": ..., "arguments": ...}`); None if it is not one.
fn parse_call(inner: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(inner.trim()).ok()?;
    let name = v.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall::function(call_id(), name, args))
}

/// `call_` and 24 random letters and digits, as OpenAI's ids look.
fn call_id() -> String {
    let tail: String = rand::thread_rng()
        .sample_iter(&Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("call_{tail}")
}

/// A whole answer's content (None when only calls and blanks) and calls.
pub fn parse_whole(text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut p = CallParser::default();
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(_, c) => calls.push(c),
        }
    }
    (
        (!content.is_empty() || calls.is_empty()).then_some(content),
        calls,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names_args(calls: &[ToolCall]) -> Vec<(String, String)> {
        calls
            .iter()
            .map(|c| {
                let args = c.function.arguments.as_str().unwrap_or_default();
                (c.function.name.clone(), args.to_string())
            })
            .collect()
    }

    #[test]
    fn text_around_two_calls() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_whole(text);
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(
            names_args(&calls),
            [
                ("get_weather".into(), "{\"city\":\"Paris\"}".into()),
                ("now".into(), "{}".into())
            ]
        );
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29);
        assert_ne!(calls[0].id, calls[1].id);
        assert_eq!(calls[0].kind, "function");
    }

    #[test]
    fn only_calls_give_no_content_and_plain_text_stays() {
        let (content, calls) = parse_whole(
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>\n",
        );
        assert_eq!(content, None);
        assert_eq!(names_args(&calls), [("f".into(), "{\"a\": 1}".into())]);
        let (content, calls) = parse_whole("just words, a < sign\n");
        assert_eq!(content.as_deref(), Some("just words, a < sign\n"));
        assert!(calls.is_empty());
    }

    #[test]
    fn malformed_or_unclosed_markup_stays_content() {
        let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>";
        let (content, calls) = parse_whole(bad);
        assert_eq!((content.as_deref(), calls.len()), (Some(bad), 0));
        let no_name = "<tool_call>{\"arguments\": {}}</tool_call>";
        assert_eq!(parse_whole(no_name).0.as_deref(), Some(no_name));
        let open = "text <tool_call>{\"name\": \"f\", \"argu";
        assert_eq!(parse_whole(open), (Some(open.to_string()), vec![]));
    }

    /// Fed a byte at a time (a partial tag at every cut), the pieces add up to the whole parse.
    #[test]
    fn partial_markup_streams_to_the_whole_result() {
        let text = "Sure. <tool_c\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>\n\n<tool_call>{\"name\": \"g\"}</tool_call> done";
        let (want_content, want_calls) = parse_whole(text);
        let mut p = CallParser::default();
        let mut pieces = Vec::new();
        for c in text.chars() {
            pieces.extend(p.push(&c.to_string()));
        }
        pieces.extend(p.finish());
        let content: String = pieces
            .iter()
            .filter_map(|x| match x {
                Piece::Text(t) => Some(t.as_str()),
                Piece::Call(..) => None,
            })
            .collect();
        let calls: Vec<ToolCall> = pieces
            .into_iter()
            .filter_map(|x| match x {
                Piece::Call(_, c) => Some(c),
                Piece::Text(_) => None,
            })
            .collect();
        assert_eq!(Some(content), want_content);
        assert_eq!(names_args(&calls), names_args(&want_calls));
        assert_eq!(want_content.as_deref(), Some("Sure. <tool_cdone"));
        assert_eq!(p.calls(), 2);
    }
}
