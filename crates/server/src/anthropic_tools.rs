//! Tools on Anthropic's `/v1/messages`. Its `tools` (`name`, `description`, `input_schema`) and
//! `tool_choice` (`auto`, `any`, `tool`, `none`, `disable_parallel_tool_use`) are rewritten into
//! OpenAI's and read by tools.rs, so the template's tool list, the grammar that forces a call
//! and the call parser are the chat endpoint's own; only the answer's shape differs: each call
//! is a `tool_use` block.

use q4moe_engine::ToolCall;
use serde_json::{json, Map, Value};

use crate::errors::ApiError;
use crate::fields::{present, Obj};
use crate::tools::Tools;

/// `tools` and `tool_choice`; `None` when no tools were sent.
pub fn parse(o: &Obj) -> Result<Option<Tools>, ApiError> {
    let list = match present(o, "tools") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, t)| function(i, t))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    let mut openai = Map::new();
    openai.insert("tools".into(), Value::Array(list));
    if let Some(c) = present(o, "tool_choice") {
        let (choice, parallel) = choice(c)?;
        openai.insert("tool_choice".into(), choice);
        openai.insert("parallel_tool_calls".into(), parallel.into());
    }
    crate::tools::parse(&openai)
}

/// A client tool as OpenAI's `{"type": "function", "function": {...}}`.
fn function(i: usize, t: &Value) -> Result<Value, ApiError> {
    let at = format!("tools[{i}]");
    let bad =
        |f: &str, what: &str| ApiError::invalid(format!("{at}.{f}"), format!("'{at}.{f}' {what}"));
    match t.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(k)) if k == "custom" => {}
        Some(k) => {
            return Err(bad(
                "type",
                &format!("is {k}: server tools are not run here; send client tools (name, description, input_schema)"),
            ))
        }
    }
    let name = t
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad("name", "must be a non-empty string"))?;
    let schema = match t.get("input_schema") {
        Some(s @ Value::Object(_)) => s.clone(),
        _ => return Err(bad("input_schema", "must be a JSON schema object")),
    };
    let mut f = json!({ "name": name, "parameters": schema });
    if let Some(d) = t.get("description").and_then(Value::as_str) {
        f["description"] = d.into();
    }
    Ok(json!({ "type": "function", "function": f }))
}

/// OpenAI's `tool_choice` and `parallel_tool_calls` for Anthropic's `tool_choice`.
fn choice(c: &Value) -> Result<(Value, bool), ApiError> {
    let parallel = !c
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let choice = match c.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match c.get("name").and_then(Value::as_str) {
            Some(n) => json!({ "type": "function", "function": { "name": n } }),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    "a {\"type\": \"tool\"} choice needs the tool's 'name'",
                ))
            }
        },
        _ => {
            return Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
            ))
        }
    };
    Ok((choice, parallel))
}

/// A call as a `tool_use` block: the id reads `toolu_...`, `input` is the arguments' JSON. The
/// parser keeps arguments as the model wrote them; text that is not JSON stays a string rather
/// than being dropped.
pub fn tool_use(call: &ToolCall) -> Value {
    let id = match call.id.strip_prefix("call_") {
        Some(tail) => format!("toolu_{tail}"),
        None => call.id.clone(),
    };
    let input = match &call.function.arguments {
        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        v => v.clone(),
    };
    json!({ "type": "tool_use", "id": id, "name": call.function.name, "input": input })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolChoice;

    fn body(v: Value) -> Obj {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn anthropic_tools_read_as_openai_tools() {
        let weather = json!({ "name": "get_weather", "description": "Weather now",
            "input_schema": { "type": "object", "properties": { "city": { "type": "string" } } } });
        let t = parse(&body(json!({ "tools": [weather] })))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert_eq!(t.list[0]["type"], "function");
        assert_eq!(t.list[0]["function"]["name"], "get_weather");
        assert_eq!(t.list[0]["function"]["description"], "Weather now");
        assert_eq!(
            t.list[0]["function"]["parameters"]["properties"]["city"]["type"],
            "string"
        );
        assert!(t.grammar().is_none(), "auto is not forced");
        let forced = [
            (json!({ "type": "any" }), ToolChoice::Required),
            (
                json!({ "type": "tool", "name": "get_weather" }),
                ToolChoice::Named("get_weather".into()),
            ),
        ];
        for (c, want) in forced {
            let t = parse(&body(json!({ "tools": [weather], "tool_choice": c })))
                .unwrap()
                .unwrap();
            assert_eq!(t.choice, want);
            assert!(t.grammar().is_some(), "{want:?} is enforced by a grammar");
        }
        let none = json!({ "tools": [weather], "tool_choice": { "type": "none" } });
        assert!(!parse(&body(none)).unwrap().unwrap().parses_calls());
        assert!(parse(&body(json!({ "tools": [] }))).unwrap().is_none());
    }

    #[test]
    fn bad_tools_name_the_field() {
        let cases = [
            (json!({ "tools": {} }), "tools"),
            (
                json!({ "tools": [{ "input_schema": {} }] }),
                "tools[0].name",
            ),
            (
                json!({ "tools": [{ "name": "f" }] }),
                "tools[0].input_schema",
            ),
            (
                json!({ "tools": [{ "type": "web_search_20250305", "name": "web_search" }] }),
                "tools[0].type",
            ),
            (
                json!({ "tools": [{ "name": "f", "input_schema": {} }], "tool_choice": { "type": "tool" } }),
                "tool_choice.name",
            ),
            (
                json!({ "tools": [{ "name": "f", "input_schema": {} }], "tool_choice": { "type": "tool", "name": "g" } }),
                "tool_choice",
            ),
            (json!({ "tool_choice": { "type": "any" } }), "tool_choice"),
        ];
        for (b, field) in cases {
            let e = parse(&body(b.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{b}: {}", e.message);
        }
    }

    #[test]
    fn calls_become_tool_use_blocks() {
        let b = tool_use(&ToolCall::function(
            "call_abc",
            "f",
            "{\"city\": \"Paris\"}",
        ));
        assert_eq!(
            b,
            json!({ "type": "tool_use", "id": "toolu_abc", "name": "f", "input": { "city": "Paris" } })
        );
        let raw = tool_use(&ToolCall::function("x", "f", "not json"));
        assert_eq!(raw["input"], "not json");
        assert_eq!(raw["id"], "x");
    }
}
