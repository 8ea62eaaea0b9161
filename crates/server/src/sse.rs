//! Server-sent event streams for both endpoints: chunks as the engine produces text (each with
//! its choice's index and, when asked for, the logprobs of its tokens), a final chunk a choice
//! with `finish_reason`, an optional usage chunk once every choice is done, then
//! `data: [DONE]`. A chat whose request has tools reads each choice's content for tool calls,
//! streamed as `tool_calls` deltas. Several choices interleave as their text comes. Dropping the stream (client
//! gone) drops the tickets' receivers, which makes the worker's text callbacks stop.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::{json, Value};

use q4moe_engine::{Finish, TokenLogprob, Tokenizer};
use q4moe_tokenizer::{ReasoningSplitter, Split};

use crate::choices::{set_choice, total_usage};
use crate::logprobs::{chat_logprobs, completion_logprobs};
use crate::openai::{self, Meta, Usage};
use crate::scheduler::{Event, Started, Ticket};
use crate::tool_markup::{CallParser, Piece};

/// What every choice of one response shares.
pub struct Common {
    pub meta: Meta,
    pub tokenizer: Arc<Tokenizer>,
    /// Logprobs were asked for: chunks carry them.
    pub logprobs: bool,
    pub include_usage: bool,
    /// Choices per prompt, for the usage.
    pub n: usize,
    /// Calls go out in the legacy `function_call` shape (functions.rs).
    pub legacy_functions: bool,
}

/// What differs between the chat and completion streams.
enum Shape {
    /// The content is read for tool calls where the request has tools.
    Chat(ReasoningSplitter, Option<CallParser>),
    Completion {
        /// With `echo`: the prompt's text, sent before the first generated text.
        echo: Option<String>,
        /// With `echo` and a suffix: the suffix, sent after the last generated text.
        tail: Option<String>,
        /// Where the next token's text starts in the choice's text (`text_offset`).
        offset: usize,
    },
}

struct ChoiceState {
    ticket: Ticket,
    index: usize,
    shape: Shape,
    /// Logprobs of tokens whose text has not gone out in a chunk yet.
    pending: Vec<TokenLogprob>,
    done: bool,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl ChoiceState {
    /// Sends `v` as this choice's chunk, with the logprobs pending.
    fn chunk(&mut self, c: &Common, mut v: Value, out: &mut Vec<Value>) {
        if c.legacy_functions {
            crate::functions::legacy_shape(&mut v, "delta");
        }
        let lps = std::mem::take(&mut self.pending);
        let logprobs = c.logprobs.then(|| match &mut self.shape {
            Shape::Chat(..) => chat_logprobs(&c.tokenizer, &lps),
            Shape::Completion { offset, .. } => completion_logprobs(&c.tokenizer, &lps, offset),
        });
        set_choice(&mut v, self.index, logprobs);
        out.push(v);
    }

    fn text(&mut self, c: &Common, text: &str, out: &mut Vec<Value>) {
        match &mut self.shape {
            Shape::Chat(splitter, _) => {
                let split = splitter.push(text);
                self.split_chunks(c, split, out);
            }
            Shape::Completion { .. } if !text.is_empty() => {
                self.chunk(c, openai::completion(&c.meta, text, None, None), out)
            }
            Shape::Completion { .. } => {}
        }
    }

    fn split_chunks(&mut self, c: &Common, s: Split, out: &mut Vec<Value>) {
        if !s.reasoning.is_empty() {
            let delta = json!({ "reasoning_content": s.reasoning });
            self.chunk(c, openai::chat_chunk(&c.meta, delta, None), out);
        }
        let pieces = match &mut self.shape {
            Shape::Chat(_, Some(calls)) => calls.push(&s.content),
            _ => vec![Piece::Text(s.content)],
        };
        self.piece_chunks(c, pieces, out);
    }

    /// Content deltas, and each call as OpenAI streams one: its index, id, type and name, then
    /// its arguments.
    fn piece_chunks(&mut self, c: &Common, pieces: Vec<Piece>, out: &mut Vec<Value>) {
        for p in pieces {
            let delta = match p {
                Piece::Text(t) if t.is_empty() => continue,
                Piece::Text(t) => json!({ "content": t }),
                Piece::Call(index, call) => {
                    let head = json!({ "tool_calls": [{ "index": index, "id": call.id,
                        "type": "function",
                        "function": { "name": call.function.name, "arguments": "" } }] });
                    self.chunk(c, openai::chat_chunk(&c.meta, head, None), out);
                    json!({ "tool_calls": [{ "index": index,
                        "function": { "arguments": call.function.arguments } }] })
                }
            };
            self.chunk(c, openai::chat_chunk(&c.meta, delta, None), out);
        }
    }

    /// Tool calls streamed so far.
    fn calls(&self) -> usize {
        match &self.shape {
            Shape::Chat(_, Some(calls)) => calls.calls(),
            _ => 0,
        }
    }

    /// The echoed prompt (completions with `echo`), once, with the prompt's logprobs.
    fn echo(&mut self, c: &Common, prompt_lps: Vec<TokenLogprob>, out: &mut Vec<Value>) {
        if let Shape::Completion { echo, .. } = &mut self.shape {
            if let Some(text) = echo.take() {
                self.pending.splice(0..0, prompt_lps);
                self.chunk(c, openai::completion(&c.meta, &text, None, None), out);
            }
        }
    }

    fn finish(&mut self, c: &Common, finish: Finish, out: &mut Vec<Value>) {
        if let Shape::Chat(splitter, _) = &mut self.shape {
            let rest = splitter.finish();
            self.split_chunks(c, rest, out);
        }
        if let Shape::Chat(_, Some(calls)) = &mut self.shape {
            let rest = calls.finish();
            self.piece_chunks(c, rest, out);
        }
        if let Shape::Completion { tail, .. } = &mut self.shape {
            if let Some(t) = tail.take().filter(|t| !t.is_empty()) {
                self.chunk(c, openai::completion(&c.meta, &t, None, None), out);
            }
        }
        let reason = openai::chat_finish_reason(finish, self.calls());
        let last = match self.shape {
            Shape::Chat(..) => openai::chat_chunk(&c.meta, json!({}), Some(reason)),
            Shape::Completion { .. } => openai::completion(&c.meta, "", Some(reason), None),
        };
        self.chunk(c, last, out);
    }

    /// The chunks for the next engine event, and the choice's usage when it is done.
    async fn next(&mut self, c: &Common) -> (Vec<Value>, Option<Usage>) {
        let mut out = Vec::new();
        match self.ticket.events.recv().await {
            Some(Event::Started(_)) => {}
            Some(Event::Logprobs(l)) => self.pending.extend(l),
            Some(Event::PromptLogprobs(l)) => self.echo(c, l, &mut out),
            Some(Event::Text(t)) => {
                self.echo(c, Vec::new(), &mut out);
                self.text(c, &t, &mut out);
            }
            Some(Event::Done { finish, usage, .. }) => {
                self.echo(c, Vec::new(), &mut out);
                self.finish(c, finish, &mut out);
                self.done = true;
                return (out, Some(usage));
            }
            Some(Event::Error(e)) => {
                // Headers are already sent: the error travels in the stream, as OpenAI does.
                out.push(e.body());
                self.done = true;
            }
            None => {
                out.push(crate::errors::ApiError::internal("the engine worker stopped").body());
                self.done = true;
            }
        }
        (out, None)
    }
}

/// One choice's chunks until it is done; its usage lands in `usages[index]`.
fn choice_stream(
    state: ChoiceState,
    c: Arc<Common>,
    usages: Arc<Mutex<Vec<Usage>>>,
) -> BoxStream<'static, SseEvent> {
    stream::unfold(state, move |mut s| {
        let (c, usages) = (c.clone(), usages.clone());
        async move {
            if s.done {
                return None;
            }
            let (chunks, usage) = s.next(&c).await;
            if let Some(u) = usage {
                usages.lock().unwrap_or_else(|p| p.into_inner())[s.index] = u;
            }
            Some((chunks.iter().map(data).collect::<Vec<_>>(), s))
        }
    })
    .flat_map(stream::iter)
    .boxed()
}

fn respond(
    c: Common,
    choices: Vec<ChoiceState>,
    head: Vec<Value>,
    object: &'static str,
) -> Response {
    let c = Arc::new(c);
    let usages = Arc::new(Mutex::new(vec![Usage::default(); choices.len()]));
    let merged = stream::select_all(
        choices
            .into_iter()
            .map(|s| choice_stream(s, c.clone(), usages.clone())),
    );
    let tail = stream::once(async move {
        let mut out = Vec::new();
        if c.include_usage {
            let all = usages.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let usage = total_usage(&all, c.n);
            out.push(data(&openai::usage_chunk(&c.meta, object, usage)));
        }
        out.push(SseEvent::default().data("[DONE]"));
        stream::iter(out)
    })
    .flatten();
    let head = stream::iter(head.iter().map(data).collect::<Vec<_>>());
    Sse::new(head.chain(merged).chain(tail).map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn states(tickets: Vec<Ticket>, mut shape: impl FnMut(usize) -> Shape) -> Vec<ChoiceState> {
    tickets
        .into_iter()
        .enumerate()
        .map(|(index, ticket)| ChoiceState {
            ticket,
            index,
            shape: shape(index),
            pending: Vec::new(),
            done: false,
        })
        .collect()
}

/// `parse_calls`: the request has tools, whose calls each choice's content is read for.
pub fn chat(c: Common, started: Started, tickets: Vec<Ticket>, parse_calls: bool) -> Response {
    // OpenAI opens each choice with the role in an otherwise empty delta.
    let head = (0..tickets.len())
        .map(|i| {
            let delta = json!({ "role": "assistant", "content": "" });
            let mut v = openai::chat_chunk(&c.meta, delta, None);
            set_choice(&mut v, i, None);
            v
        })
        .collect();
    let choices = states(tickets, |_| {
        let calls = parse_calls.then(CallParser::default);
        Shape::Chat(ReasoningSplitter::new(started.think_open), calls)
    });
    respond(c, choices, head, "chat.completion.chunk")
}

/// `prompts[i / n]` is choice i's prompt text (for `echo` and the logprobs' text offsets);
/// `echo`, when the prompt is echoed, is the suffix to send after the text (empty without one);
/// `prompt_lps`: the prompt's logprobs come first (echo without a suffix, infill.rs says why).
pub fn completion(
    c: Common,
    tickets: Vec<Ticket>,
    prompts: &[String],
    echo: Option<String>,
    prompt_lps: bool,
) -> Response {
    let n = c.n.max(1);
    let choices = states(tickets, |i| {
        let prompt = prompts.get(i / n).cloned().unwrap_or_default();
        Shape::Completion {
            offset: if prompt_lps {
                0
            } else {
                prompt.chars().count()
            },
            tail: echo.clone(),
            echo: echo.is_some().then_some(prompt),
        }
    });
    respond(c, choices, Vec::new(), "text_completion")
}
