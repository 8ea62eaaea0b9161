//! `/v1/messages` with `stream: true`: Anthropic's named server-sent events. `message_start`,
//! then per content block `content_block_start`, its deltas (`thinking_delta` while the model
//! reasons, `text_delta` for the answer) and `content_block_stop`, then `message_delta` (stop
//! reason and usage) and `message_stop`. There is always a text block unless the model called
//! tools, as in the whole response; each call is a `tool_use` block whose input comes whole in
//! one `input_json_delta`.
//! Dropping the stream (client gone) drops the ticket, which stops the generation.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use q4moe_tokenizer::{ReasoningSplitter, Split};
use serde_json::{json, Value};

use crate::anthropic_shape::{error_body, stop_reason, usage_json};
use crate::errors::ApiError;
use crate::openai::{Meta, Usage};
use crate::scheduler::{Event, Started, Ticket};
use crate::tool_markup::{CallParser, Piece};
use q4moe_engine::{Finish, ToolCall};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
}

impl Block {
    fn name(self) -> &'static str {
        match self {
            Block::Thinking => "thinking",
            Block::Text => "text",
        }
    }
}

struct StreamState {
    ticket: Ticket,
    splitter: ReasoningSplitter,
    /// Reads the answer for tool calls where the request has tools.
    calls: Option<CallParser>,
    /// The block open now and its index.
    open: Option<(Block, usize)>,
    /// Blocks started so far (the next one's index).
    started: usize,
    text_started: bool,
    done: bool,
}

fn event(v: Value) -> SseEvent {
    let name = v["type"].as_str().unwrap_or("message").to_string();
    SseEvent::default().event(name).data(v.to_string())
}

impl StreamState {
    /// Moves to a block of `kind`, closing the one open if it is another.
    fn enter(&mut self, kind: Block, out: &mut Vec<SseEvent>) -> usize {
        match self.open {
            Some((k, i)) if k == kind => return i,
            Some(_) => self.close(out),
            None => {}
        }
        let i = self.started;
        self.started += 1;
        self.text_started |= kind == Block::Text;
        self.open = Some((kind, i));
        let block = match kind {
            Block::Thinking => json!({ "type": "thinking", "thinking": "", "signature": "" }),
            Block::Text => json!({ "type": "text", "text": "" }),
        };
        out.push(event(
            json!({ "type": "content_block_start", "index": i, "content_block": block }),
        ));
        i
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if let Some((_, i)) = self.open.take() {
            out.push(event(json!({ "type": "content_block_stop", "index": i })));
        }
    }

    fn delta(&mut self, kind: Block, text: &str, out: &mut Vec<SseEvent>) {
        if text.is_empty() {
            return;
        }
        let i = self.enter(kind, out);
        let field = kind.name();
        let delta = json!({ "type": format!("{field}_delta"), field: text });
        out.push(event(
            json!({ "type": "content_block_delta", "index": i, "delta": delta }),
        ));
    }

    fn split(&mut self, s: Split, out: &mut Vec<SseEvent>) {
        self.delta(Block::Thinking, &s.reasoning, out);
        let pieces = match &mut self.calls {
            Some(p) => p.push(&s.content),
            None => vec![Piece::Text(s.content)],
        };
        self.pieces(pieces, out);
    }

    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<SseEvent>) {
        for p in pieces {
            match p {
                Piece::Text(t) => self.delta(Block::Text, &t, out),
                Piece::Call(_, call) => self.tool_use(&call, out),
            }
        }
    }

    /// A call's whole block: start (input empty, as Anthropic streams it), the input, stop.
    fn tool_use(&mut self, call: &ToolCall, out: &mut Vec<SseEvent>) {
        self.close(out);
        let i = self.started;
        self.started += 1;
        let mut block = crate::anthropic_tools::tool_use(call);
        let input = std::mem::replace(&mut block["input"], json!({}));
        out.push(event(
            json!({ "type": "content_block_start", "index": i, "content_block": block }),
        ));
        let delta = json!({ "type": "input_json_delta", "partial_json": input.to_string() });
        out.push(event(
            json!({ "type": "content_block_delta", "index": i, "delta": delta }),
        ));
        out.push(event(json!({ "type": "content_block_stop", "index": i })));
    }

    fn finish(
        &mut self,
        finish: Finish,
        stop: Option<String>,
        usage: &Usage,
        out: &mut Vec<SseEvent>,
    ) {
        let rest = self.splitter.finish();
        self.split(rest, out);
        let rest = self
            .calls
            .as_mut()
            .map(CallParser::finish)
            .unwrap_or_default();
        self.pieces(rest, out);
        let calls = self.calls.as_ref().map_or(0, CallParser::calls);
        let reason = stop_reason(finish, stop.as_deref(), calls);
        if !self.text_started && calls == 0 {
            self.enter(Block::Text, out);
        }
        self.close(out);
        out.push(event(json!({
            "type": "message_delta",
            "delta": { "stop_reason": reason, "stop_sequence": stop },
            "usage": usage_json(usage),
        })));
        out.push(event(json!({ "type": "message_stop" })));
    }

    /// The events for the next engine event; `None` once the stream is over.
    async fn next(mut self) -> Option<(Vec<SseEvent>, Self)> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        match self.ticket.events.recv().await {
            Some(Event::Text(t)) => {
                let s = self.splitter.push(&t);
                self.split(s, &mut out);
            }
            // Logprobs are never asked for here (the Messages API has none).
            Some(Event::Started(_) | Event::Logprobs(_) | Event::PromptLogprobs(_)) => {}
            Some(Event::Done {
                finish,
                usage,
                stop_sequence,
            }) => {
                self.finish(finish, stop_sequence, &usage, &mut out);
                self.done = true;
            }
            Some(Event::Error(e)) => {
                // Headers are already sent: the error travels in the stream, as Anthropic's does.
                out.push(event(error_body(&e)));
                self.done = true;
            }
            None => {
                out.push(event(error_body(&ApiError::internal(
                    "the engine worker stopped",
                ))));
                self.done = true;
            }
        }
        Some((out, self))
    }
}

/// `parse_calls`: the request has tools, whose calls the answer is read for.
pub fn stream(meta: Meta, started: Started, ticket: Ticket, parse_calls: bool) -> Response {
    let usage = Usage {
        prompt_tokens: started.prompt_tokens,
        ..Usage::default()
    };
    let first = event(json!({
        "type": "message_start",
        "message": {
            "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
            "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage_json(&usage),
        },
    }));
    let state = StreamState {
        ticket,
        splitter: ReasoningSplitter::new(started.think_open),
        calls: parse_calls.then(CallParser::default),
        open: None,
        started: 0,
        text_started: false,
        done: false,
    };
    let body = stream::unfold(state, StreamState::next).flat_map(stream::iter);
    Sse::new(stream::iter([first]).chain(body).map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}
