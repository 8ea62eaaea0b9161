//! Python's `str`, `dict` and `list` methods for chat templates (`.startswith`, `.split`,
//! `.items()`, ...): minijinja-contrib's `pycompat`, the set transformers' users rely on, behind
//! a guard for the two methods whose output can dwarf their input (`replace`, `join`), so a
//! hostile template cannot allocate past the render's output limit before the limit sees it.

use minijinja::{Error, ErrorKind, State, Value};

/// The environment's unknown-method callback; `max_len` is the render's output limit in bytes.
pub(crate) fn call_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
    max_len: usize,
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        match method {
            "replace" => check_replace_len(s, args, max_len)?,
            "join" => check_join_len(s, args, max_len)?,
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn too_long(method: &str, len: usize, max_len: usize) -> Error {
    let msg = format!("{method} would build {len} bytes (output limit {max_len})");
    Error::new(ErrorKind::InvalidOperation, msg)
}

/// Refuses a `replace` whose result would pass the output limit, before building it. Malformed
/// arguments are left for pycompat to report.
fn check_replace_len(s: &str, args: &[Value], max_len: usize) -> Result<(), Error> {
    let (Some(from), Some(to)) = (
        args.first().and_then(Value::as_str),
        args.get(1).and_then(Value::as_str),
    ) else {
        return Ok(());
    };
    // An empty `from` matches between every char and at both ends.
    let mut hits = if from.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(from).count()
    };
    if let Some(n) = args.get(2).and_then(|v| i64::try_from(v.clone()).ok()) {
        if n >= 0 {
            hits = hits.min(n as usize);
        }
    }
    let len = (s.len() - hits * from.len()).saturating_add(hits.saturating_mul(to.len()));
    if len > max_len {
        return Err(too_long("replace", len, max_len));
    }
    Ok(())
}

/// Refuses a `join` whose separators alone would pass the output limit (the items are values
/// that exist already; the separator is what repeats).
fn check_join_len(sep: &str, args: &[Value], max_len: usize) -> Result<(), Error> {
    let Some(n) = args.first().and_then(Value::len) else {
        return Ok(());
    };
    let len = sep.len().saturating_mul(n.saturating_sub(1));
    if len > max_len {
        return Err(too_long("join", len, max_len));
    }
    Ok(())
}
