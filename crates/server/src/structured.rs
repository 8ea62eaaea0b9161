//! Structured output requests: OpenAI's `response_format` (`json_object`, `json_schema`) and
//! llama-server's `grammar` (GBNF or llguidance's Lark), read into the engine's `Grammar`. The
//! grammar is compiled later, with the prompt, off the engine thread (scheduler.rs).

use q4moe_engine::Grammar;
use serde_json::{Map, Value};

use crate::errors::ApiError;

/// A constraint on the output and the request field it came from (for errors about it).
#[derive(Debug, Clone, PartialEq)]
pub struct GrammarField {
    pub param: &'static str,
    pub grammar: Grammar,
}

/// `response_format` or `grammar` (not both); `None` when neither asks for anything.
pub fn parse(o: &Map<String, Value>) -> Result<Option<GrammarField>, ApiError> {
    let format = response_format(o)?;
    let grammar = grammar_field(o)?;
    match (format, grammar) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "grammar",
            "'grammar' and 'response_format' both constrain the output; send one",
        )),
        (f, g) => Ok(f.or(g)),
    }
}

fn response_format(o: &Map<String, Value>) -> Result<Option<GrammarField>, ApiError> {
    let param = "response_format";
    let rf = match o.get(param) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(rf)) => rf,
        Some(_) => {
            return Err(ApiError::invalid(
                param,
                "'response_format' must be an object",
            ))
        }
    };
    let field = |grammar| Ok(Some(GrammarField { param, grammar }));
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => match rf.get("schema") {
            // llama-server's shorthand: a schema beside json_object.
            Some(s @ Value::Object(_)) => field(Grammar::JsonSchema(s.clone())),
            _ => field(Grammar::JsonObject),
        },
        Some("json_schema") => {
            let at = "response_format.json_schema";
            let js = rf
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| ApiError::invalid(at, format!("'{at}' must be an object")))?;
            match js.get("schema") {
                Some(s @ Value::Object(_)) => field(Grammar::JsonSchema(s.clone())),
                // OpenAI's default schema is any JSON object.
                None | Some(Value::Null) => field(Grammar::JsonObject),
                Some(_) => Err(ApiError::invalid(
                    format!("{at}.schema"),
                    format!("'{at}.schema' must be a JSON schema object"),
                )),
            }
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "'response_format.type' must be one of text, json_object, json_schema",
        )),
    }
}

/// llama-server's `grammar`: GBNF (rules with `::=`) or llguidance's Lark.
fn grammar_field(o: &Map<String, Value>) -> Result<Option<GrammarField>, ApiError> {
    let param = "grammar";
    let text = match o.get(param) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() => return Ok(None),
        Some(Value::String(s)) => s,
        Some(_) => return Err(ApiError::invalid(param, "'grammar' must be a string")),
    };
    let lark = if q4moe_engine::looks_like_gbnf(text) {
        q4moe_engine::gbnf_to_lark(text)
            .map_err(|e| ApiError::invalid(param, format!("the GBNF grammar is invalid: {e}")))?
    } else {
        text.clone()
    };
    Ok(Some(GrammarField {
        param,
        grammar: Grammar::Lark(lark),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(v: Value) -> Result<Option<GrammarField>, ApiError> {
        parse(v.as_object().unwrap())
    }

    #[test]
    fn formats_and_grammars_read_into_the_engine_grammar() {
        assert_eq!(parsed(json!({})).unwrap(), None);
        assert_eq!(
            parsed(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        let g = parsed(json!({"response_format": {"type": "json_object"}})).unwrap();
        assert_eq!(g.unwrap().grammar, Grammar::JsonObject);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let g = parsed(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "strict": true, "schema": schema}}}))
        .unwrap()
        .unwrap();
        assert_eq!(
            (g.param, g.grammar),
            ("response_format", Grammar::JsonSchema(schema))
        );
        let g = parsed(json!({"grammar": "root ::= \"yes\" | \"no\""}))
            .unwrap()
            .unwrap();
        assert_eq!(g.grammar, Grammar::Lark("start: \"yes\" | \"no\"\n".into()));
        let g = parsed(json!({"grammar": "start: \"a\""})).unwrap().unwrap();
        assert_eq!(g.grammar, Grammar::Lark("start: \"a\"".into()));
    }

    #[test]
    fn bad_formats_name_their_field() {
        for (body, field) in [
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"grammar": 5}), "grammar"),
            (json!({"grammar": "root ::= \"open"}), "grammar"),
            (
                json!({"grammar": "start: \"a\"", "response_format": {"type": "json_object"}}),
                "grammar",
            ),
        ] {
            let err = parsed(body.clone()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(field), "{body}");
        }
    }
}
