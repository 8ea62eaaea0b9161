//! Tool calling, the request side: OpenAI's `tools` and `tool_choice`, the tool calls of past
//! assistant turns, and the grammar that enforces `required` or a named function with
//! constrained decoding: Qwen3's call markup around JSON whose arguments match the function's
//! parameter schema. Reading calls back out of the text is tool_markup.rs.

use q4moe_engine::{with_layout, Grammar, ToolCall};
use serde_json::{json, Map, Value};

use crate::errors::ApiError;
use crate::structured::GrammarField;

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// Never parse calls out of the text.
    None,
    /// The model decides; calls in its text are parsed.
    Auto,
    /// At least one call, enforced.
    Required,
    /// One call of this function, enforced.
    Named(String),
}

/// A request's tools.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The `tools` array as sent, for the chat template to describe.
    pub list: Value,
    pub choice: ToolChoice,
    /// Each function's name and parameter schema.
    functions: Vec<(String, Value)>,
    /// `parallel_tool_calls` (OpenAI's default true): a required choice may make several calls.
    parallel: bool,
    /// Sent as the legacy `functions` (functions.rs): the answer carries `function_call`.
    pub legacy: bool,
}

impl Tools {
    /// Whether the generated text is read for calls.
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The constraint that enforces `required` or a named function (None otherwise).
    pub fn grammar(&self) -> Option<GrammarField> {
        let (functions, several): (Vec<&(String, Value)>, bool) = match &self.choice {
            ToolChoice::Required => (self.functions.iter().collect(), self.parallel),
            ToolChoice::Named(n) => (self.functions.iter().filter(|f| &f.0 == n).collect(), false),
            ToolChoice::None | ToolChoice::Auto => return None,
        };
        let alternatives: Vec<Value> = functions
            .iter()
            .map(|(name, params)| {
                json!({
                    "type": "object",
                    "properties": { "name": { "const": name }, "arguments": params },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = with_layout(match <[Value; 1]>::try_from(alternatives) {
            Ok([one]) => one,
            Err(many) => json!({ "anyOf": many }),
        });
        // The markup exactly as Qwen3's template writes past calls.
        let more = if several { " (\"\\n\" call)*" } else { "" };
        let lark = format!(
            "start: call{more}\ncall: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n"
        );
        Some(GrammarField {
            param: "tools",
            grammar: Grammar::Lark(lark),
        })
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no tools were sent.
pub fn parse(o: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let list = match o.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    let functions = list
        .iter()
        .enumerate()
        .map(|(i, t)| function(i, t))
        .collect::<Result<Vec<_>, _>>()?;
    let choice = choice(o.get("tool_choice"), &functions)?;
    if functions.is_empty() {
        return Ok(None);
    }
    let parallel = match o.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                "'parallel_tool_calls' must be a boolean",
            ))
        }
    };
    Ok(Some(Tools {
        list: Value::Array(list),
        choice,
        functions,
        parallel,
        legacy: false,
    }))
}

/// The legacy `functions` (`sent`, each as it was sent, so the template describes it whole) as
/// tools: one call at most (`function_call` names one function).
pub(crate) fn legacy(sent: &[Value], functions: Vec<(String, Value)>, choice: ToolChoice) -> Tools {
    let list = sent
        .iter()
        .map(|f| json!({ "type": "function", "function": f }))
        .collect();
    Tools {
        list: Value::Array(list),
        choice,
        functions,
        parallel: false,
        legacy: true,
    }
}

fn function(i: usize, t: &Value) -> Result<(String, Value), ApiError> {
    let at = format!("tools[{i}]");
    let bad = |what: &str| ApiError::invalid(at.clone(), format!("'{at}' {what}"));
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("must have \"type\": \"function\""));
    }
    let f = t
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("needs a 'function' object"))?;
    named_function(&at, "function.", f)
}

/// A function's name and parameter schema; `at` and `path` name it in errors (`tools[0]` and
/// `function.`, or the legacy `functions[0]` and nothing).
pub(crate) fn named_function(
    at: &str,
    path: &str,
    f: &Map<String, Value>,
) -> Result<(String, Value), ApiError> {
    let bad = |what: String| ApiError::invalid(at, format!("'{at}' {what}"));
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad(format!("needs a non-empty '{path}name'")))?;
    let params = match f.get("parameters") {
        None | Some(Value::Null) => json!({ "type": "object" }),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(bad(format!(
                "'{path}parameters' must be a JSON schema object"
            )))
        }
    };
    Ok((name.to_string(), params))
}

fn choice(v: Option<&Value>, functions: &[(String, Value)]) -> Result<ToolChoice, ApiError> {
    let param = "tool_choice";
    let c = match v {
        None | Some(Value::Null) => return Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(ApiError::invalid(
                    param,
                    "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
        Some(Value::Object(c)) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| c.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        "a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !functions.iter().any(|f| f.0 == name) {
                return Err(ApiError::invalid(
                    param,
                    format!("'tool_choice' names '{name}', which is not in 'tools'"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(ApiError::invalid(param, "'tool_choice' must be a string or an object")),
    };
    if c == ToolChoice::Required && functions.is_empty() {
        return Err(ApiError::invalid(
            param,
            "'tool_choice' is required but 'tools' is empty",
        ));
    }
    Ok(c)
}

/// A past assistant turn's `tool_calls` (message `i`).
pub fn message_calls(i: usize, v: Option<&Value>) -> Result<Vec<ToolCall>, ApiError> {
    let at = format!("messages[{i}].tool_calls");
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::invalid(
                at.clone(),
                format!("'{at}' must be an array"),
            ))
        }
    };
    items
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let at = format!("{at}[{j}]");
            let f = c.get("function");
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
            let args = match f.and_then(|f| f.get("arguments")) {
                // Some clients send the arguments as an object: the template renders it with
                // `tojson`, a string as it is.
                Some(a @ (Value::String(_) | Value::Object(_))) => Some(a.clone()),
                None | Some(Value::Null) => Some(json!({})),
                Some(_) => None,
            };
            let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
            match (name, args) {
                (Some(name), Some(args)) => Ok(ToolCall::function(id, name, args)),
                _ => Err(ApiError::invalid(
                    at.clone(),
                    format!(
                        "'{at}' needs 'function.name' and 'function.arguments' (a JSON string or object)"
                    ),
                )),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(extra: Value) -> Map<String, Value> {
        let mut o = json!({"tools": [
            {"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "now"}},
        ]});
        o.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        o.as_object().unwrap().clone()
    }

    #[test]
    fn choices_parse_and_required_ones_have_a_grammar() {
        let t = parse(&tools(json!({}))).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parses_calls() && t.grammar().is_none());
        let t = parse(&tools(json!({"tool_choice": "none"})))
            .unwrap()
            .unwrap();
        assert!(!t.parses_calls());
        let t = parse(&tools(json!({"tool_choice": "required"})))
            .unwrap()
            .unwrap();
        let Grammar::Lark(g) = t.grammar().unwrap().grammar else {
            panic!("not lark")
        };
        assert!(g.contains("(\"\\n\" call)*") && g.contains("anyOf"), "{g}");
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "now"}}});
        let t = parse(&tools(named)).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Named("now".into()));
        let Grammar::Lark(g) = t.grammar().unwrap().grammar else {
            panic!("not lark")
        };
        assert!(
            g.starts_with("start: call\n") && !g.contains("get_weather"),
            "{g}"
        );
        assert!(parse(&Map::new()).unwrap().is_none());
    }

    #[test]
    fn bad_tools_name_their_field() {
        let named = |n: &str| json!({"tool_choice": {"type": "function", "function": {"name": n}}});
        for (body, field) in [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [{"type": "function"}]}), "tools[0]"),
            (
                json!({"tools": [{"type": "x", "function": {"name": "f"}}]}),
                "tools[0]",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
        ] {
            let err = parse(body.as_object().unwrap()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(field), "{body}");
        }
        for extra in [json!({"tool_choice": "always"}), named("missing")] {
            let err = parse(&tools(extra)).unwrap_err();
            assert_eq!(err.param.as_deref(), Some("tool_choice"));
        }
        let err = message_calls(2, Some(&json!([{"function": {"arguments": "{}"}}]))).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[2].tool_calls[0]"));
        let calls = message_calls(
            1,
            Some(&json!([{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": {"a": 1}}}])),
        )
        .unwrap();
        // An object stays one: the template renders it with `tojson`, as transformers does.
        assert_eq!(calls, [ToolCall::function("c1", "f", json!({"a": 1}))]);
    }
}
