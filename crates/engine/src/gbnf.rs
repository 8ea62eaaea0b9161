//! llama.cpp's GBNF, translated to llguidance's Lark syntax (which reads GBNF's `{m,n}` repeats
//! but not its `::=` rules, `[...]` classes, `.` or dashed names). llguidance ships no Rust
//! converter (its Python package has one), so this is a small tokenizer: each GBNF rule becomes
//! one Lark line, `root` becomes `start`, names become lower-case Lark rule names, strings are
//! re-escaped as JSON, character classes become regexes.

use std::collections::HashMap;

/// Whether `grammar` reads as GBNF (a line opening a `name ::=` rule) rather than Lark.
pub fn looks_like_gbnf(grammar: &str) -> bool {
    grammar.lines().any(|l| {
        let l = l.trim_start();
        let name = l.len()
            - l.trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                .len();
        name > 0 && l[name..].trim_start().starts_with("::=")
    })
}

#[derive(Debug, PartialEq)]
enum Tok {
    Name(String),
    Define,
    Str(String),
    /// A class's inside, as written (between the brackets).
    Class(String),
    Any,
    /// `*`, `+`, `?`, `|`, `(`, `)` or a `{m,n}` repeat: copied as written.
    Punct(String),
}

/// Translates a GBNF grammar to Lark; the error names the offending spot.
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let toks = tokenize(src)?;
    let mut names: HashMap<String, String> = HashMap::new();
    let mut lark_name = |n: &str| -> Result<String, String> {
        let l = if n == "root" {
            "start".to_string()
        } else {
            n.to_ascii_lowercase().replace('-', "_")
        };
        match names.insert(l.clone(), n.to_string()) {
            Some(other) if other != n => Err(format!(
                "rules '{other}' and '{n}' have the same Lark name '{l}'"
            )),
            _ => Ok(l),
        }
    };
    let mut out = String::new();
    let mut i = 0;
    while i < toks.len() {
        match (&toks[i], toks.get(i + 1)) {
            (Tok::Name(n), Some(Tok::Define)) => {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(&lark_name(n)?);
                out.push(':');
                i += 2;
                continue;
            }
            _ if out.is_empty() => return Err("a GBNF grammar starts with 'name ::='".into()),
            (Tok::Name(n), _) => out.push_str(&format!(" {}", lark_name(n)?)),
            (Tok::Define, _) => return Err("'::=' without a rule name before it".into()),
            (Tok::Str(s), _) => {
                let quoted = serde_json::to_string(s).map_err(|e| e.to_string())?;
                out.push_str(&format!(" {quoted}"));
            }
            (Tok::Class(c), _) => out.push_str(&format!(" /[{}]/", c.replace('/', "\\/"))),
            (Tok::Any, _) => out.push_str(" /(?s:.)/"),
            (Tok::Punct(p), _) => out.push_str(&format!(" {p}")),
        }
        i += 1;
    }
    if !names.contains_key("start") {
        return Err("a GBNF grammar needs a 'root' rule".into());
    }
    out.push('\n');
    Ok(out)
}

fn tokenize(src: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = src.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            c if c.is_whitespace() => {}
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                toks.push(Tok::Define);
                i += 2;
            }
            '"' => {
                let (s, end) = string(&chars, i + 1)?;
                toks.push(Tok::Str(s));
                i = end;
            }
            '[' => {
                let end = class_end(&chars, i + 1)?;
                toks.push(Tok::Class(chars[i + 1..end].iter().collect()));
                i = end;
            }
            '.' => toks.push(Tok::Any),
            '{' => {
                let end = chars[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .ok_or("an unclosed '{' repeat")?;
                toks.push(Tok::Punct(chars[i..=i + end].iter().collect()));
                i += end;
            }
            '*' | '+' | '?' | '|' | '(' | ')' => toks.push(Tok::Punct(c.to_string())),
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_')
                {
                    i += 1;
                }
                toks.push(Tok::Name(chars[start..i].iter().collect()));
                continue;
            }
            other => return Err(format!("unexpected '{other}' in the GBNF grammar")),
        }
        i += 1;
    }
    Ok(toks)
}

/// A string's text from just after its opening quote; returns it and the closing quote's index.
fn string(chars: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut out = String::new();
    while i < chars.len() {
        match chars[i] {
            '"' => return Ok((out, i)),
            '\\' => {
                let (c, next) = escape(chars, i + 1)?;
                out.push(c);
                i = next;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Err("an unclosed string".into())
}

/// One escape after a backslash at `i`: the char and the index after it.
fn escape(chars: &[char], i: usize) -> Result<(char, usize), String> {
    let hex = |n: usize| -> Result<(char, usize), String> {
        let digits: String = chars.get(i + 1..i + 1 + n).unwrap_or(&[]).iter().collect();
        u32::from_str_radix(&digits, 16)
            .ok()
            .filter(|_| digits.len() == n)
            .and_then(char::from_u32)
            .map(|c| (c, i + 1 + n))
            .ok_or_else(|| format!("a bad escape '\\{}{digits}'", chars[i]))
    };
    match chars.get(i) {
        Some('n') => Ok(('\n', i + 1)),
        Some('t') => Ok(('\t', i + 1)),
        Some('r') => Ok(('\r', i + 1)),
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some(&c @ ('\\' | '"' | '[' | ']')) => Ok((c, i + 1)),
        Some(c) => Err(format!("an unknown escape '\\{c}'")),
        None => Err("a backslash at the end".into()),
    }
}

/// The index of a class's closing `]` (escapes skipped), from just after its `[`.
fn class_end(chars: &[char], mut i: usize) -> Result<usize, String> {
    while i < chars.len() {
        match chars[i] {
            ']' => return Ok(i),
            '\\' => i += 2,
            _ => i += 1,
        }
    }
    Err("an unclosed character class".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_become_lark_lines() {
        let g = r#"
# a yes/no answer
root ::= answer ("\n" answer)*
answer ::= "yes" | "no" | num-word{1,3}
num-word ::= [0-9a-z/] .
"#;
        assert!(looks_like_gbnf(g));
        let lark = gbnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: answer ( \"\\n\" answer ) *\n\
             answer: \"yes\" | \"no\" | num_word {1,3}\n\
             num_word: /[0-9a-z\\/]/ /(?s:.)/\n"
        );
        assert!(!looks_like_gbnf("start: \"a\" | \"b\"\n"));
        assert!(!looks_like_gbnf("start: \"x ::= y\"\n# a ::= b\n"));
    }

    #[test]
    fn escapes_are_decoded_and_errors_say_where() {
        let lark = gbnf_to_lark(r#"root ::= "\x41\u00e9\"""#).unwrap();
        assert_eq!(lark, "start: \"Aé\\\"\"\n");
        for (bad, want) in [
            ("root ::= \"open", "unclosed string"),
            ("root ::= [a-z", "unclosed character class"),
            ("answer ::= \"x\"", "'root' rule"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= a\na-b ::= \"x\"\na_b ::= \"y\"", "same Lark name"),
            ("\"x\" ::= \"y\"", "starts with"),
        ] {
            let err = gbnf_to_lark(bad).unwrap_err();
            assert!(err.contains(want), "{bad}: {err}");
        }
    }
}
