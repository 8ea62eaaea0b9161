//! Server-sent event streams for both endpoints: chunks as the engine produces text, a final
//! chunk with `finish_reason`, an optional usage chunk, then `data: [DONE]`. Dropping the stream
//! (client gone) drops the ticket's receiver, which makes the worker's text callback stop.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use q4moe_engine::Finish;
use q4moe_tokenizer::{ReasoningSplitter, Split};

use crate::openai::{self, Meta, Usage};
use crate::scheduler::{Event, Started, Ticket};
use crate::tool_markup::{CallParser, Piece};

/// What differs between the chat and completion streams.
enum Shape {
    /// The content is read for tool calls where the request has tools.
    Chat(ReasoningSplitter, Option<CallParser>),
    Completion,
}

struct StreamState {
    ticket: Ticket,
    shape: Shape,
    meta: Meta,
    include_usage: bool,
    done: bool,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl StreamState {
    fn object(&self) -> &'static str {
        match self.shape {
            Shape::Chat(..) => "chat.completion.chunk",
            Shape::Completion => "text_completion",
        }
    }

    fn text_chunks(&mut self, text: &str, out: &mut Vec<SseEvent>) {
        match &mut self.shape {
            Shape::Chat(splitter, _) => {
                let split = splitter.push(text);
                self.split_chunks(split, out);
            }
            Shape::Completion if !text.is_empty() => {
                out.push(data(&openai::completion(&self.meta, text, None, None)))
            }
            Shape::Completion => {}
        }
    }

    fn split_chunks(&mut self, s: Split, out: &mut Vec<SseEvent>) {
        if !s.reasoning.is_empty() {
            out.push(data(&openai::chat_chunk(
                &self.meta,
                json!({ "reasoning_content": s.reasoning }),
                None,
            )));
        }
        let pieces = match &mut self.shape {
            Shape::Chat(_, Some(calls)) => calls.push(&s.content),
            _ => vec![Piece::Text(s.content)],
        };
        self.piece_chunks(pieces, out);
    }

    /// Content deltas, and each call as OpenAI streams one: its index, id, type and name, then
    /// its arguments.
    fn piece_chunks(&self, pieces: Vec<Piece>, out: &mut Vec<SseEvent>) {
        for p in pieces {
            let delta = match p {
                Piece::Text(t) if t.is_empty() => continue,
                Piece::Text(t) => json!({ "content": t }),
                Piece::Call(index, c) => {
                    let head = json!({ "tool_calls": [{ "index": index, "id": c.id, "type": "function",
                        "function": { "name": c.function.name, "arguments": "" } }] });
                    out.push(data(&openai::chat_chunk(&self.meta, head, None)));
                    json!({ "tool_calls": [{ "index": index,
                        "function": { "arguments": c.function.arguments } }] })
                }
            };
            out.push(data(&openai::chat_chunk(&self.meta, delta, None)));
        }
    }

    /// Tool calls streamed so far.
    fn calls(&self) -> usize {
        match &self.shape {
            Shape::Chat(_, Some(calls)) => calls.calls(),
            _ => 0,
        }
    }

    fn finish_chunks(&mut self, finish: Finish, usage: Usage, out: &mut Vec<SseEvent>) {
        if let Shape::Chat(splitter, _) = &mut self.shape {
            let rest = splitter.finish();
            self.split_chunks(rest, out);
        }
        if let Shape::Chat(_, Some(calls)) = &mut self.shape {
            let rest = calls.finish();
            self.piece_chunks(rest, out);
        }
        let reason = openai::chat_finish_reason(finish, self.calls());
        out.push(data(&match self.shape {
            Shape::Chat(..) => openai::chat_chunk(&self.meta, json!({}), Some(reason)),
            Shape::Completion => openai::completion(&self.meta, "", Some(reason), None),
        }));
        if self.include_usage {
            out.push(data(&openai::usage_chunk(&self.meta, self.object(), usage)));
        }
    }

    /// The SSE events for the next engine event; `None` once the stream is over.
    async fn next(mut self) -> Option<(Vec<SseEvent>, Self)> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        match self.ticket.events.recv().await {
            Some(Event::Text(t)) => self.text_chunks(&t, &mut out),
            Some(Event::Started(_)) => {}
            Some(Event::Done { finish, usage }) => {
                self.finish_chunks(finish, usage, &mut out);
                self.done = true;
            }
            Some(Event::Error(e)) => {
                // Headers are already sent: the error travels in the stream, as OpenAI does.
                out.push(data(&e.body()));
                self.done = true;
            }
            None => {
                out.push(data(
                    &crate::errors::ApiError::internal("the engine worker stopped").body(),
                ));
                self.done = true;
            }
        }
        if self.done {
            out.push(SseEvent::default().data("[DONE]"));
        }
        Some((out, self))
    }
}

fn respond(state: StreamState, first: Option<Value>) -> Response {
    let head = stream::iter(first.map(|v| data(&v)));
    let body = stream::unfold(state, StreamState::next).flat_map(stream::iter);
    Sse::new(head.chain(body).map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `parse_calls`: the request has tools, whose calls the content is read for.
pub fn chat(
    meta: Meta,
    started: Started,
    ticket: Ticket,
    include_usage: bool,
    parse_calls: bool,
) -> Response {
    // OpenAI opens with the role in an otherwise empty delta.
    let first = openai::chat_chunk(&meta, json!({ "role": "assistant", "content": "" }), None);
    let calls = parse_calls.then(CallParser::default);
    let shape = Shape::Chat(ReasoningSplitter::new(started.think_open), calls);
    respond(
        StreamState {
            ticket,
            shape,
            meta,
            include_usage,
            done: false,
        },
        Some(first),
    )
}

pub fn completion(meta: Meta, ticket: Ticket, include_usage: bool) -> Response {
    respond(
        StreamState {
            ticket,
            shape: Shape::Completion,
            meta,
            include_usage,
            done: false,
        },
        None,
    )
}
