//! Chat templates (minijinja, configured like transformers' Jinja environment) and the
//! `<think>` reasoning split.

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde::{Deserialize, Serialize};

use crate::limits::LimitedBuf;
use crate::{TemplateLimit, TemplateLimits, TokenizerError};

/// Qwen3's chat template (Qwen3-30B-A3B `tokenizer_config.json`): tools, `<think>` handling of past
/// assistant turns, and `enable_thinking=false` opening an empty think block.
pub const QWEN3_CHAT_TEMPLATE: &str = include_str!("qwen3_chat_template.jinja");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's reasoning, rendered inside `<think>` by templates that support it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant turn's tool calls, in OpenAI's shape (templates read `tool_calls`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// One call of a function by the model: `{"id", "type": "function", "function": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI's shape), rendered as they are.
    pub arguments: String,
}

impl ToolCall {
    pub fn function(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A chat template compiled once; rendering is cheap, and bounded by [`TemplateLimits`].
pub struct ChatTemplate {
    env: Environment<'static>,
    limits: TemplateLimits,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source` with the default [`TemplateLimits`].
    pub fn new(source: &str) -> Result<Self, TokenizerError> {
        Self::with_limits(source, TemplateLimits::default())
    }

    pub fn with_limits(source: &str, limits: TemplateLimits) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks + lstrip_blocks; templates are written for that.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(limits.fuel));
        let max = limits.max_output_bytes;
        env.set_unknown_method_callback(move |state, value, method, args| {
            python_str_methods(state, value, method, args, max)
        });
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())?;
        Ok(Self { env, limits })
    }

    /// Renders `messages`; `enable_thinking: None` leaves the variable undefined (template default).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        self.render_tools(messages, None, add_generation_prompt, enable_thinking)
    }

    /// [`Self::render`] with the `tools` list (OpenAI's `tools`) the template may describe.
    pub fn render_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        self.render_with(
            Value::from_serialize(messages),
            tools.map(Value::from_serialize),
            add_generation_prompt,
            enable_thinking,
        )
    }

    /// Renders OpenAI-style JSON messages (which may carry `tool_calls`) and an optional `tools` list.
    /// Objects keep serde_json's key order (sorted unless its `preserve_order` feature is on), so
    /// `tojson` of a tool may order keys differently from Python.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let tools = tools.map(Value::from_serialize);
        self.render_with(
            Value::from_serialize(messages),
            tools,
            add_generation_prompt,
            enable_thinking,
        )
    }

    fn render_with(
        &self,
        messages: Value,
        tools: Option<Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let tmpl = self.env.get_template(NAME)?;
        // Absent values stay undefined: templates test `enable_thinking is defined`.
        let mut ctx = vec![
            ("messages", messages),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ];
        ctx.extend(tools.map(|t| ("tools", t)));
        ctx.extend(enable_thinking.map(|on| ("enable_thinking", Value::from(on))));
        let ctx: Value = ctx.into_iter().collect();
        let mut out = LimitedBuf::new(self.limits.max_output_bytes);
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => {}
            Err(_) if out.exceeded => {
                let limit = TemplateLimit::OutputBytes(self.limits.max_output_bytes);
                return Err(TokenizerError::TemplateLimit(limit));
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                let limit = TemplateLimit::Fuel(self.limits.fuel);
                return Err(TokenizerError::TemplateLimit(limit));
            }
            Err(e) => return Err(e.into()),
        }
        // Output only ever receives whole `str`s.
        String::from_utf8(out.buf).map_err(|e| TokenizerError::Template(e.to_string()))
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps` (transformers' `tojson`): no HTML escaping, ", " and ": " separators.
fn tojson(value: Value, _kw: Kwargs) -> Result<Value, Error> {
    let json: serde_json::Value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_py_json(&json, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_json(v: &serde_json::Value, out: &mut String) {
    match v {
        serde_json::Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                out.push_str(if i == 0 { "" } else { ", " });
                write_py_json(item, out);
            }
            out.push(']');
        }
        serde_json::Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                out.push_str(if i == 0 { "" } else { ", " });
                out.push_str(&serde_json::Value::from(k.as_str()).to_string());
                out.push_str(": ");
                write_py_json(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// The Python `str` methods chat templates call (`startswith`, `split`, `strip`, ...), which
/// minijinja does not provide natively.
fn python_str_methods(
    _: &State,
    value: &Value,
    method: &str,
    args: &[Value],
    max_len: usize,
) -> Result<Value, Error> {
    let Some(s) = value.as_str() else {
        return Err(Error::from(ErrorKind::UnknownMethod));
    };
    let arg = |i: usize| args.get(i).and_then(Value::as_str);
    let chars = |i: usize| arg(i).map(|c| c.chars().collect::<Vec<char>>());
    let strip = |s: &str, i: usize, left: bool, right: bool| -> String {
        let set = chars(i);
        let pred = |c: char| {
            set.as_ref()
                .map_or(c.is_whitespace(), |set| set.contains(&c))
        };
        let s = if left { s.trim_start_matches(pred) } else { s };
        let s = if right { s.trim_end_matches(pred) } else { s };
        s.to_string()
    };
    Ok(match method {
        "startswith" => Value::from(arg(0).is_some_and(|p| s.starts_with(p))),
        "endswith" => Value::from(arg(0).is_some_and(|p| s.ends_with(p))),
        "strip" => Value::from(strip(s, 0, true, true)),
        "lstrip" => Value::from(strip(s, 0, true, false)),
        "rstrip" => Value::from(strip(s, 0, false, true)),
        "lower" => Value::from(s.to_lowercase()),
        "upper" => Value::from(s.to_uppercase()),
        "replace" => match (arg(0), arg(1)) {
            (Some(from), Some(to)) => {
                check_replace_len(s, from, to, max_len)?;
                Value::from(s.replace(from, to))
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "replace needs two strings",
                ))
            }
        },
        "split" => match arg(0) {
            Some(sep) if !sep.is_empty() => {
                Value::from(s.split(sep).map(String::from).collect::<Vec<_>>())
            }
            _ => Value::from(s.split_whitespace().map(String::from).collect::<Vec<_>>()),
        },
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

/// Refuses a `replace` whose result would pass the output limit, before building it.
fn check_replace_len(s: &str, from: &str, to: &str, max_len: usize) -> Result<(), Error> {
    // An empty `from` matches between every char and at both ends.
    let hits = if from.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(from).count()
    };
    let len = (s.len() - hits * from.len()).saturating_add(hits.saturating_mul(to.len()));
    if len > max_len {
        let msg = format!("replace would build {len} bytes (output limit {max_len})");
        return Err(Error::new(ErrorKind::InvalidOperation, msg));
    }
    Ok(())
}
