//! `tojson` as transformers defines it for chat templates: Python's `json.dumps` with
//! `ensure_ascii=False`, honouring `indent`, `separators`, `sort_keys` and `ensure_ascii`.
//! minijinja's own `tojson` escapes HTML characters and spaces differently, which changes the
//! tokens a tool list renders to.

use minijinja::value::Kwargs;
use minijinja::{Error, ErrorKind, Value};
use serde_json::Value as Json;

/// How `json.dumps` lays out its output.
struct Layout {
    /// `None`: one line. `Some(s)`: a newline and `s` per level (Python's `indent`).
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl Layout {
    fn from_kwargs(kw: &Kwargs) -> Result<Layout, Error> {
        let indent = match kw.get::<Option<Value>>("indent")? {
            None => None,
            Some(v) if v.is_none() || v.is_undefined() => None,
            Some(v) => Some(match v.as_str() {
                Some(s) => s.to_string(),
                None => {
                    let n = i64::try_from(v.clone()).map_err(|_| bad("indent", &v))?;
                    " ".repeat(n.clamp(0, 64) as usize)
                }
            }),
        };
        // Python's defaults: ", " between items on one line, "," when indenting.
        let (mut item_sep, mut key_sep) = match indent {
            None => (", ".to_string(), ": ".to_string()),
            Some(_) => (",".to_string(), ": ".to_string()),
        };
        if let Some(v) = kw.get::<Option<Value>>("separators")? {
            let pair: Vec<Value> = v.try_iter().map_err(|_| bad("separators", &v))?.collect();
            match pair.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    item_sep = a.as_str().unwrap_or_default().to_string();
                    key_sep = b.as_str().unwrap_or_default().to_string();
                }
                _ => return Err(bad("separators", &v)),
            }
        }
        Ok(Layout {
            indent,
            item_sep,
            key_sep,
            sort_keys: kw.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
            ensure_ascii: kw.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        })
    }
}

fn bad(name: &str, v: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: bad {name} argument {v}"),
    )
}

/// The `tojson` filter.
pub(crate) fn tojson(value: Value, kw: Kwargs) -> Result<Value, Error> {
    let layout = Layout::from_kwargs(&kw)?;
    kw.assert_all_used()?;
    let json: Json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write(&json, &layout, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` of `v` at nesting `depth`.
fn write(v: &Json, l: &Layout, depth: usize, out: &mut String) {
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separate(l, i, depth + 1, out);
                write(item, l, depth + 1, out);
            }
            close(l, depth, out);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if l.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                separate(l, i, depth + 1, out);
                write_str(k, l.ensure_ascii, out);
                out.push_str(&l.key_sep);
                write(item, l, depth + 1, out);
            }
            close(l, depth, out);
            out.push('}');
        }
        Json::String(s) => write_str(s, l.ensure_ascii, out),
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// Before the `i`th item of a container whose items sit at `depth`.
fn separate(l: &Layout, i: usize, depth: usize, out: &mut String) {
    if i > 0 {
        out.push_str(&l.item_sep);
    }
    if let Some(ind) = &l.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
}

/// Before the closing bracket of a container at `depth`.
fn close(l: &Layout, depth: usize, out: &mut String) {
    if let Some(ind) = &l.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
}

fn write_str(s: &str, ensure_ascii: bool, out: &mut String) {
    let quoted = Json::from(s).to_string();
    if !ensure_ascii || quoted.is_ascii() {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use minijinja::Environment;
    use serde_json::json;

    fn render(src: &str, v: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        env.render_str(src, minijinja::context! { v => v }).unwrap()
    }

    #[test]
    fn matches_python_json_dumps() {
        let v = json!({"a": [1, 2.5, "é"], "b": {}, "c": []});
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            render("{{ v | tojson }}", v.clone()),
            r#"{"a": [1, 2.5, "é"], "b": {}, "c": []}"#
        );
        // json.dumps(v, ensure_ascii=False, indent=2)
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", v.clone()),
            "{\n  \"a\": [\n    1,\n    2.5,\n    \"é\"\n  ],\n  \"b\": {},\n  \"c\": []\n}"
        );
        // json.dumps(v, indent=0, ensure_ascii=True, separators=(",", ":"))
        assert_eq!(
            render(
                r#"{{ v | tojson(indent=0, ensure_ascii=true, separators=[",", ":"]) }}"#,
                json!({"k": "é😀"})
            ),
            "{\n\"k\":\"\\u00e9\\ud83d\\ude00\"\n}"
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        let ctx = minijinja::context! { v => 1 };
        assert!(env
            .render_str("{{ v | tojson(indent=[1]) }}", ctx.clone())
            .is_err());
        assert!(env.render_str("{{ v | tojson(bogus=1) }}", ctx).is_err());
    }
}
