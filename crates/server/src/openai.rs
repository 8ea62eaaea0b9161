//! OpenAI request parsing and response shapes. Requests are read field by field from a JSON value
//! (not derived with serde) so that every rejection names the field the client got wrong.

use q4moe_engine::{ChatMessage, Finish, LogprobOptions, SamplingParams, ToolCall};
use serde_json::{json, Value};

use crate::errors::ApiError;
use crate::fields::{in_range, opt_bool, opt_f32, opt_str, opt_uint, present, Obj};
pub use crate::fields::{parse_body, MAX_CHOICES};
use crate::structured::GrammarField;
use crate::tools::Tools;

/// Generation settings shared by both endpoints.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// `None`: as many as the context leaves.
    pub max_tokens: Option<usize>,
    /// The name `max_tokens` came under, for errors about it.
    pub max_tokens_param: &'static str,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Extension (as vLLM): keep going past end-of-sequence, for benchmarks.
    pub ignore_eos: bool,
    /// What the output is constrained to (`response_format`, `grammar`, a required tool call).
    pub grammar: Option<GrammarField>,
    /// Choices per prompt (`n`), each its own sequence.
    pub n: usize,
    /// Candidates generated per prompt (`best_of`, at least `n`), of which the `n` best are
    /// returned (best_of.rs); `n` where the request has no `best_of`.
    pub best_of: usize,
    pub logprobs: Option<LogprobOptions>,
    /// Completions: the prompt's text goes before each choice's text.
    pub echo: bool,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub enable_thinking: Option<bool>,
    pub tools: Option<Tools>,
    pub gen: GenParams,
}

#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// One choice (or `n`) each.
    pub prompts: Vec<Prompt>,
    /// Fill-in-the-middle: the text after the gap each prompt is the text before.
    pub suffix: Option<String>,
    pub gen: GenParams,
}

fn sampling(o: &Obj) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let f = |name, default: f32, lo, hi, open| -> Result<f32, ApiError> {
        opt_f32(o, name)?.map_or(Ok(default), |v| in_range(name, v, lo, hi, open))
    };
    // OpenAI's default temperature is 1; without a seed each request draws its own.
    let seed = match present(o, "seed") {
        None => fresh_seed(),
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_i64().map(|i| i as u64))
            .ok_or_else(|| ApiError::invalid("seed", "'seed' must be an integer"))?,
    };
    Ok(SamplingParams {
        temperature: f("temperature", 1.0, 0.0, 2.0, false)?,
        top_p: f("top_p", d.top_p, 0.0, 1.0, true)?,
        top_k: opt_uint(o, "top_k")?.map_or(d.top_k, |k| k as usize),
        min_p: f("min_p", d.min_p, 0.0, 1.0, false)?,
        repetition_penalty: f("repetition_penalty", d.repetition_penalty, 0.0, 10.0, true)?,
        presence_penalty: f("presence_penalty", d.presence_penalty, -2.0, 2.0, false)?,
        frequency_penalty: f("frequency_penalty", d.frequency_penalty, -2.0, 2.0, false)?,
        seed,
        constraint: None,
        logit_bias: crate::logprobs::logit_bias(o)?,
    })
}

pub(crate) fn fresh_seed() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn stop_list(o: &Obj) -> Result<Vec<String>, ApiError> {
    string_list(o, "stop", true)
}

/// Field `name`: an array of at most 16 strings (or, with `one_ok`, a single string); absent,
/// none. The stop strings of every endpoint.
pub(crate) fn string_list(o: &Obj, name: &str, one_ok: bool) -> Result<Vec<String>, ApiError> {
    let bad = || {
        let what = if one_ok {
            "a string or an array"
        } else {
            "an array"
        };
        ApiError::invalid(
            name,
            format!("'{name}' must be {what} of at most 16 strings"),
        )
    };
    match present(o, name) {
        None => Ok(Vec::new()),
        Some(Value::String(s)) if one_ok => Ok(vec![s.clone()]),
        Some(Value::Array(items)) if items.len() <= 16 => items
            .iter()
            .map(|v| v.as_str().map(String::from).ok_or_else(bad))
            .collect(),
        Some(_) => Err(bad()),
    }
}

pub(crate) fn gen_params(o: &Obj) -> Result<GenParams, ApiError> {
    let n = match present(o, "n") {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(n @ 1..) if n as usize <= MAX_CHOICES => n as usize,
            _ => {
                return Err(ApiError::invalid(
                    "n",
                    format!("'n' must be an integer in [1, {MAX_CHOICES}]"),
                ))
            }
        },
    };
    // `max_completion_tokens` is the newer name; it wins when both are sent.
    let (name, max) = match opt_uint(o, "max_completion_tokens")? {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", opt_uint(o, "max_tokens")?),
    };
    if max == Some(0) {
        return Err(ApiError::invalid(
            name,
            format!("'{name}' must be at least 1"),
        ));
    }
    let include_usage = match present(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => opt_bool(so, "include_usage")
            .map_err(|_| {
                ApiError::invalid(
                    "stream_options.include_usage",
                    "'stream_options.include_usage' must be a boolean",
                )
            })?
            .unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' must be an object",
            ))
        }
    };
    Ok(GenParams {
        max_tokens: max.map(|m| m.min(usize::MAX as u64) as usize),
        max_tokens_param: name,
        sampling: sampling(o)?,
        stop: stop_list(o)?,
        stream: opt_bool(o, "stream")?.unwrap_or(false),
        include_usage,
        ignore_eos: opt_bool(o, "ignore_eos")?.unwrap_or(false),
        grammar: crate::structured::parse(o)?,
        n,
        best_of: n,
        logprobs: None,
        echo: false,
    })
}

/// Message content: a string, or an array of `{"type": "text", "text": ...}` parts.
fn content_text(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    let bad = || {
        ApiError::invalid(
            at,
            format!("'{at}' must be a string or an array of text parts"),
        )
    };
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => Ok(t),
                    _ => Err(bad()),
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.concat()),
        Some(_) => Err(bad()),
    }
}

fn message(i: usize, v: &Value) -> Result<ChatMessage, ApiError> {
    let at = |f: &str| format!("messages[{i}].{f}");
    let o = v.as_object().ok_or_else(|| {
        ApiError::invalid(format!("messages[{i}]"), "each message must be an object")
    })?;
    let role = match o.get("role").and_then(Value::as_str) {
        Some("developer") => "system",
        Some(r @ ("system" | "user" | "assistant" | "tool" | "function")) => r,
        _ => {
            return Err(ApiError::invalid(
                at("role"),
                "'role' must be one of system, developer, user, assistant, tool, function",
            ))
        }
    };
    if role != "assistant" && !matches!(o.get("content"), Some(Value::String(_) | Value::Array(_)))
    {
        return Err(ApiError::invalid(
            at("content"),
            format!("a {role} message needs 'content'"),
        ));
    }
    if role == "function" && opt_str(o, "name").ok().flatten().is_none() {
        return Err(ApiError::invalid(
            at("name"),
            "a function message needs the 'name' of the function whose result it is",
        ));
    }
    // A legacy function result is a tool result (functions.rs).
    let as_role = if role == "function" { "tool" } else { role };
    let mut m = ChatMessage::new(as_role, content_text(o.get("content"), &at("content"))?);
    m.reasoning_content = opt_str(o, "reasoning_content")
        .map_err(|_| ApiError::invalid(at("reasoning_content"), "must be a string"))?;
    if role == "assistant" {
        m.tool_calls = crate::tools::message_calls(i, o.get("tool_calls"))?;
        m.tool_calls
            .extend(crate::functions::message_call(i, o.get("function_call"))?);
    }
    m.tool_call_id = opt_str(o, "tool_call_id")
        .map_err(|_| ApiError::invalid(at("tool_call_id"), "must be a string"))?;
    Ok(m)
}

/// The required, non-empty `messages` array (both chat APIs).
pub(crate) fn messages_array(o: &Obj) -> Result<&Vec<Value>, ApiError> {
    match o.get("messages") {
        Some(Value::Array(items)) if !items.is_empty() => Ok(items),
        Some(Value::Array(_)) => Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        )),
        Some(_) => Err(ApiError::invalid("messages", "'messages' must be an array")),
        None => Err(ApiError::invalid("messages", "'messages' is required")),
    }
}

pub fn chat_request(o: &Obj) -> Result<ChatRequest, ApiError> {
    let messages = messages_array(o)?
        .iter()
        .enumerate()
        .map(|(i, v)| message(i, v))
        .collect::<Result<Vec<_>, _>>()?;
    let kwargs_thinking = match present(o, "chat_template_kwargs") {
        None => None,
        Some(Value::Object(k)) => opt_bool(k, "enable_thinking").map_err(|_| {
            ApiError::invalid("chat_template_kwargs.enable_thinking", "must be a boolean")
        })?,
        Some(_) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                "'chat_template_kwargs' must be an object",
            ))
        }
    };
    let explicit = opt_bool(o, "enable_thinking")?.or(kwargs_thinking);
    // Ranked candidates are a completions feature (OpenAI's chat API has none); asking for
    // them here would otherwise be ignored.
    if present(o, "best_of").is_some_and(|v| v.as_u64() != Some(1)) {
        return Err(ApiError::invalid(
            "best_of",
            "'best_of' is a /v1/completions field; chat takes 'n'",
        ));
    }
    let legacy = crate::functions::parse(o)?;
    let tools = crate::tools::parse(o)?.or(legacy);
    let mut gen = gen_params(o)?;
    gen.logprobs = crate::logprobs::chat_options(o)?;
    if let Some(g) = tools.as_ref().and_then(Tools::grammar) {
        if gen.grammar.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a required tool call and 'response_format' / 'grammar' both constrain the output; send one",
            ));
        }
        gen.grammar = Some(g);
    }
    let mut enable_thinking = q4moe_tokenizer::thinking_switch(&messages, explicit);
    // A constrained answer skips the think block unless thinking was asked for (then the
    // constraint starts after it).
    if gen.grammar.is_some() && enable_thinking.is_none() {
        enable_thinking = Some(false);
    }
    Ok(ChatRequest {
        model: opt_str(o, "model")?,
        enable_thinking,
        messages,
        tools,
        gen,
    })
}

/// OpenAI's `finish_reason` for how a generation ended (a cancelled one reads as a stop).
pub fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::Cancelled => "stop",
        Finish::Length => "length",
    }
}

/// A chat's `finish_reason`: `tool_calls` when it stopped after calling tools.
pub fn chat_finish_reason(f: Finish, tool_calls: usize) -> &'static str {
    match (f, tool_calls) {
        (Finish::Stop, 1..) => "tool_calls",
        _ => finish_reason(f),
    }
}

pub fn completion_request(o: &Obj) -> Result<CompletionRequest, ApiError> {
    let prompts = prompts(o.get("prompt"))?;
    let mut gen = gen_params(o)?;
    gen.best_of = crate::best_of::parse(o, gen.n, gen.stream)?;
    if prompts.len() * gen.best_of > MAX_CHOICES {
        let field = if gen.best_of > gen.n { "best_of" } else { "n" };
        return Err(ApiError::invalid(
            field,
            format!(
                "{} prompts times {field} = {} is over {MAX_CHOICES} sequences a request",
                prompts.len(),
                gen.best_of
            ),
        ));
    }
    // An empty suffix asks for nothing: the text simply continues the prompt.
    let suffix = opt_str(o, "suffix")?.filter(|s| !s.is_empty());
    gen.echo = opt_bool(o, "echo")?.unwrap_or(false);
    // With a suffix the prompt's tokens sit among the fill-in-the-middle markup and the
    // suffix's own tokens, so its logprobs are not reported (infill.rs says why).
    let prompt_logprobs = gen.echo && suffix.is_none();
    gen.logprobs = crate::logprobs::completion_options(o, prompt_logprobs)?;
    Ok(CompletionRequest {
        model: opt_str(o, "model")?,
        prompts,
        suffix,
        gen,
    })
}

/// `prompt`: a string, token ids, or an array of either (one choice each).
fn prompts(v: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "'prompt' must be a string, an array of token ids, or an array of either",
        )
    };
    let empty = || ApiError::invalid("prompt", "'prompt' must not be empty");
    let ids = |items: &[Value]| -> Result<Prompt, ApiError> {
        let ids = items
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&t| t <= u32::MAX as u64)
                    .map(|t| t as u32)
                    .ok_or_else(bad)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if ids.is_empty() {
            return Err(empty());
        }
        Ok(Prompt::Tokens(ids))
    };
    let one = |v: &Value| match v {
        Value::String(s) if s.is_empty() => Err(empty()),
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => ids(items),
        _ => Err(bad()),
    };
    match v {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(Value::Array(items)) if items.is_empty() => Err(empty()),
        Some(Value::Array(items)) if items[0].is_number() => Ok(vec![ids(items)?]),
        Some(Value::Array(items)) if items.len() > MAX_CHOICES => Err(ApiError::invalid(
            "prompt",
            format!("at most {MAX_CHOICES} prompts a request"),
        )),
        // All strings or all token arrays, as OpenAI takes them.
        Some(Value::Array(items))
            if items.iter().any(|v| v.is_string() != items[0].is_string()) =>
        {
            Err(bad())
        }
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// Token counts reported back.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens },
        })
    }
}

/// What every response object carries.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    pub fn new(prefix: &str, model: &str) -> Meta {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Meta {
            id: format!("{prefix}-{:x}{:06x}", fresh_seed() & 0xffff_ffff_ffff, n),
            created,
            model: model.to_string(),
        }
    }
}

/// `content` None: an answer of tool calls only (`null`, as OpenAI sends it).
pub fn chat_completion(
    meta: &Meta,
    content: Option<&str>,
    reasoning: Option<&str>,
    tool_calls: &[ToolCall],
    finish: &str,
    usage: Usage,
) -> Value {
    let mut message = json!({ "role": "assistant", "content": content });
    if let Some(r) = reasoning {
        message["reasoning_content"] = json!(r);
    }
    if !tool_calls.is_empty() {
        message["tool_calls"] = json!(tool_calls);
    }
    json!({
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "choices": [{ "index": 0, "message": message, "logprobs": null, "finish_reason": finish }],
        "usage": usage.json(),
    })
}

/// One streamed chat chunk; `delta` is `{}` on the last one, which carries `finish_reason`.
pub fn chat_chunk(meta: &Meta, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
        "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }],
    })
}

pub fn completion(meta: &Meta, text: &str, finish: Option<&str>, usage: Option<Usage>) -> Value {
    let mut v = json!({
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [{ "index": 0, "text": text, "logprobs": null, "finish_reason": finish }],
    });
    if let Some(u) = usage {
        v["usage"] = u.json();
    }
    v
}

/// The closing chunk of a stream with `include_usage`: no choices, just usage.
pub fn usage_chunk(meta: &Meta, object: &str, usage: Usage) -> Value {
    json!({ "id": meta.id, "object": object, "created": meta.created, "model": meta.model, "choices": [], "usage": usage.json() })
}

pub fn models(model: &str, created: u64) -> Value {
    json!({ "object": "list", "data": [{ "id": model, "object": "model", "created": created, "owned_by": "q4moe" }] })
}
