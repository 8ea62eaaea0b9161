//! OpenAI's legacy chat function calling, read as tools: `functions` (a list of function
//! objects) is `tools`, `function_call` (`"none"`, `"auto"`, `{"name": ...}`) is `tool_choice`,
//! and one call at most is made. Answers speak the legacy shape back: `message.function_call`
//! `{name, arguments}` instead of `tool_calls`, `finish_reason: "function_call"`, streamed
//! `delta.function_call` pieces. A model that writes several calls anyway is answered with the
//! first: the legacy shape has room for one. In the history, an assistant turn's
//! `function_call` and a `role: "function"` message (with `name`) render as the tool-call and
//! tool-result turns `tool_calls` and `role: "tool"` render as.

use q4moe_engine::ToolCall;
use serde_json::{json, Value};

use crate::errors::ApiError;
use crate::fields::{present, Obj};
use crate::tools::{self, ToolChoice, Tools};

/// `functions` and `function_call`; `None` without functions. Either beside `tools` or
/// `tool_choice` is refused: the two ways of asking for calls would disagree.
pub fn parse(o: &Obj) -> Result<Option<Tools>, ApiError> {
    let sent = match present(o, "functions") {
        None => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "functions",
                "'functions' must be an array",
            ))
        }
    };
    let new_style =
        |f: &str| present(o, f).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()));
    if !sent.is_empty() && (new_style("tools") || new_style("tool_choice")) {
        return Err(ApiError::invalid(
            "functions",
            "'functions' and 'tools' / 'tool_choice' both ask for calls; send one (the legacy 'functions' is 'tools' in the new API)",
        ));
    }
    let functions = sent
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let at = format!("functions[{i}]");
            let f = f.as_object().ok_or_else(|| {
                ApiError::invalid(at.clone(), format!("'{at}' must be a function object"))
            })?;
            tools::named_function(&at, "", f)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let choice = choice(present(o, "function_call"), &functions)?;
    if functions.is_empty() {
        return Ok(None);
    }
    Ok(Some(tools::legacy(&sent, functions, choice)))
}

fn choice(v: Option<&Value>, functions: &[(String, Value)]) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::invalid("function_call", m);
    match v {
        None => Ok(ToolChoice::Auto),
        Some(Value::String(s)) if s == "none" => Ok(ToolChoice::None),
        Some(Value::String(s)) if s == "auto" => Ok(ToolChoice::Auto),
        Some(Value::Object(c)) => match c.get("name").and_then(Value::as_str) {
            Some(n) if functions.iter().any(|f| f.0 == n) => Ok(ToolChoice::Named(n.into())),
            Some(n) => Err(bad(format!(
                "'function_call' names '{n}', which is not in 'functions'"
            ))),
            None => Err(bad("a named 'function_call' is {\"name\": ...}".into())),
        },
        Some(_) => Err(bad(
            "'function_call' must be \"none\", \"auto\" or {\"name\": ...}".into(),
        )),
    }
}

/// A past assistant turn's legacy `function_call` (message `i`), as a tool call.
pub fn message_call(i: usize, v: Option<&Value>) -> Result<Option<ToolCall>, ApiError> {
    let at = format!("messages[{i}].function_call");
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let name = v.get("name").and_then(Value::as_str);
    let args = match v.get("arguments") {
        Some(a @ (Value::String(_) | Value::Object(_))) => Some(a.clone()),
        None | Some(Value::Null) => Some(json!({})),
        Some(_) => None,
    };
    match (name, args) {
        (Some(n), Some(a)) => Ok(Some(ToolCall::function("", n, a))),
        _ => Err(ApiError::invalid(
            at.clone(),
            format!("'{at}' needs 'name' and 'arguments' (a JSON string or object)"),
        )),
    }
}

/// A chat answer (whole, or one streamed chunk) in the legacy shape: its first call's
/// `function` as `function_call`, the finish `function_call`. A streamed piece of a later call
/// keeps only its logprobs.
pub fn legacy_shape(body: &mut Value, delta_key: &str) {
    let Some(choice) = body["choices"].get_mut(0) else {
        return;
    };
    if choice["finish_reason"] == "tool_calls" {
        choice["finish_reason"] = json!("function_call");
    }
    let Some(m) = choice.get_mut(delta_key).and_then(Value::as_object_mut) else {
        return;
    };
    let Some(calls) = m.remove("tool_calls") else {
        return;
    };
    if let Some(first) = calls
        .get(0)
        .filter(|c| c["index"].as_u64().unwrap_or(0) == 0)
    {
        m.insert("function_call".into(), first["function"].clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(v: Value) -> Obj {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn functions_read_as_tools_with_one_call() {
        let f = json!([{ "name": "get_weather", "description": "Weather now",
            "parameters": { "type": "object", "properties": { "city": { "type": "string" } } } }]);
        let t = parse(&o(json!({ "functions": f }))).unwrap().unwrap();
        assert!(t.legacy && t.choice == ToolChoice::Auto);
        // The template sees the function whole, description included.
        assert_eq!(t.list[0]["function"]["description"], "Weather now");
        assert_eq!(t.list[0]["type"], "function");
        let t = parse(&o(json!({ "functions": f, "function_call": "none" })))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::None);
        let named = json!({ "functions": f, "function_call": { "name": "get_weather" } });
        let t = parse(&o(named)).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        let q4moe_engine::Grammar::Lark(g) = t.grammar().unwrap().grammar else {
            panic!("not lark")
        };
        assert!(g.starts_with("start: call\n"), "{g}");
        assert!(parse(&o(json!({ "functions": [] }))).unwrap().is_none());
    }

    #[test]
    fn bad_or_clashing_fields_are_named() {
        let f = json!([{ "name": "f" }]);
        for (body, field) in [
            (
                json!({ "functions": f, "tools": [{ "type": "function", "function": { "name": "g" } }] }),
                "functions",
            ),
            (
                json!({ "functions": f, "tool_choice": "auto" }),
                "functions",
            ),
            (json!({ "functions": {} }), "functions"),
            (
                json!({ "functions": [{ "description": "x" }] }),
                "functions[0]",
            ),
            (json!({ "functions": [3] }), "functions[0]"),
            (
                json!({ "functions": f, "function_call": "required" }),
                "function_call",
            ),
            (
                json!({ "functions": f, "function_call": { "name": "g" } }),
                "function_call",
            ),
            (json!({ "function_call": { "name": "g" } }), "function_call"),
        ] {
            let e = parse(&o(body.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
        }
        let e = message_call(3, Some(&json!({ "arguments": "{}" }))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[3].function_call"));
        let c = message_call(1, Some(&json!({ "name": "f", "arguments": "{\"a\":1}" })))
            .unwrap()
            .unwrap();
        assert_eq!(c, ToolCall::function("", "f", json!("{\"a\":1}")));
    }

    #[test]
    fn answers_take_the_legacy_shape() {
        let call = |i: u64| {
            json!({ "index": i, "id": "call_x", "type": "function",
            "function": { "name": "f", "arguments": "{}" } })
        };
        let mut whole = json!({ "choices": [{ "index": 0, "finish_reason": "tool_calls",
            "message": { "role": "assistant", "content": null, "tool_calls": [call(0), call(1)] } }] });
        legacy_shape(&mut whole, "message");
        let c = &whole["choices"][0];
        assert_eq!(c["finish_reason"], "function_call");
        assert_eq!(
            c["message"]["function_call"],
            json!({ "name": "f", "arguments": "{}" })
        );
        assert!(c["message"].get("tool_calls").is_none());
        let mut later =
            json!({ "choices": [{ "delta": { "tool_calls": [call(1)] }, "finish_reason": null }] });
        legacy_shape(&mut later, "delta");
        assert_eq!(later["choices"][0]["delta"], json!({}));
    }
}
