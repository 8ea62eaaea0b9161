//! Chat templates (minijinja, configured like transformers' Jinja environment: trim and lstrip
//! blocks, Python's string/dict/list methods, `tojson` as `json.dumps`).

use minijinja::{Environment, Error, ErrorKind, Value};
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
    /// A `tool` turn: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A tool call in OpenAI's message shape (`{"id", "type": "function", "function": {"name",
/// "arguments"}}`), which is the shape chat templates read.
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
    /// A JSON object, or a string holding one: OpenAI sends a string, Anthropic's `tool_use`
    /// an object; Qwen3's template renders a string as it is and anything else with `tojson`.
    pub arguments: serde_json::Value,
}

impl ToolCall {
    pub fn function(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<serde_json::Value>,
    ) -> Self {
        Self {
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
            crate::pycompat::call_method(state, value, method, args, max)
        });
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", crate::pyjson::tojson);
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
