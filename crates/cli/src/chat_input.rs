//! What `q4moe chat` reads: a line editor with history (rustyline) when standard input is a
//! terminal, plain lines otherwise (a pipe, a file, the tests). Either way a message may span
//! lines: a line ending in `\` continues on the next, and `"""` opens a block that a later `"""`
//! closes (as in ollama). Lines starting with `/` are commands.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use rustyline::error::ReadlineError;

/// One thing the user typed.
#[derive(Debug, PartialEq, Eq)]
pub enum Input {
    Message(String),
    /// `/bye`, `/exit`, `/quit`, Ctrl-D (end of input) or Ctrl-C at the prompt.
    Quit,
    /// `/clear` or `/reset`: a new conversation.
    Clear,
    Help,
    /// A `/word` that is no command.
    Unknown(String),
}

pub const HELP: &str =
    "commands: /clear (new conversation), /bye (or /exit, Ctrl-D) to leave, /help; \
a line ending in \\ continues on the next, \"\"\" opens and closes a multi-line message; \
Ctrl-C stops an answer";

/// Where lines come from.
pub enum Lines {
    Editor {
        editor: Box<rustyline::DefaultEditor>,
        history: Option<PathBuf>,
    },
    Plain(Box<dyn BufRead>),
}

impl Lines {
    /// The editor when standard input is a terminal, else plain lines from it. `history`: the
    /// file the editor's history is kept in (loaded now, saved by [`Self::save_history`]).
    pub fn stdin(history: Option<PathBuf>) -> Lines {
        if std::io::stdin().is_terminal() {
            if let Ok(mut editor) = rustyline::DefaultEditor::new() {
                if let Some(h) = &history {
                    // A first run has no history file yet.
                    let _ = editor.load_history(h);
                }
                return Lines::Editor {
                    editor: Box::new(editor),
                    history,
                };
            }
        }
        Lines::Plain(Box::new(std::io::BufReader::new(std::io::stdin())))
    }

    /// One line without its newline; `None` at the end of input (or Ctrl-C / Ctrl-D).
    fn line(&mut self, prompt: &str) -> anyhow::Result<Option<String>> {
        match self {
            Lines::Editor { editor, .. } => match editor.readline(prompt) {
                Ok(l) => Ok(Some(l)),
                Err(ReadlineError::Eof | ReadlineError::Interrupted) => Ok(None),
                Err(e) => Err(e.into()),
            },
            Lines::Plain(r) => {
                print!("{prompt}");
                std::io::stdout().flush()?;
                let mut l = String::new();
                if r.read_line(&mut l)? == 0 {
                    return Ok(None);
                }
                let trimmed = l.strip_suffix('\n').unwrap_or(&l);
                Ok(Some(
                    trimmed.strip_suffix('\r').unwrap_or(trimmed).to_string(),
                ))
            }
        }
    }

    fn remember(&mut self, entry: &str) {
        if let Lines::Editor { editor, .. } = self {
            let _ = editor.add_history_entry(entry);
        }
    }

    /// Writes the editor's history to its file; a failure only warns.
    pub fn save_history(&mut self) {
        if let Lines::Editor {
            editor,
            history: Some(h),
        } = self
        {
            if let Err(e) = editor.save_history(h) {
                eprintln!("(could not save the chat history to {}: {e})", h.display());
            }
        }
    }

    /// Reads until a whole message or command; blank lines are skipped.
    pub fn read(&mut self, prompt: &str, more: &str) -> anyhow::Result<Input> {
        loop {
            let Some(first) = self.line(prompt)? else {
                return Ok(Input::Quit);
            };
            let text = match self.message(first, more)? {
                Some(t) => t,
                None => return Ok(Input::Quit),
            };
            if text.trim().is_empty() {
                continue;
            }
            self.remember(&text);
            return Ok(command(&text).unwrap_or(Input::Message(text)));
        }
    }

    /// The message that begins with `first`: continued lines joined with newlines. `None`: the
    /// input ended inside a block.
    fn message(&mut self, first: String, more: &str) -> anyhow::Result<Option<String>> {
        if let Some(rest) = first.trim_start().strip_prefix("\"\"\"") {
            if let Some(body) = rest.strip_suffix("\"\"\"") {
                return Ok(Some(body.to_string()));
            }
            let mut parts = vec![rest.to_string()];
            loop {
                let Some(l) = self.line(more)? else {
                    return Ok(None);
                };
                if let Some(last) = l.trim_end().strip_suffix("\"\"\"") {
                    parts.push(last.to_string());
                    let text = parts.join("\n");
                    return Ok(Some(text.trim_matches('\n').to_string()));
                }
                parts.push(l);
            }
        }
        let mut text = first;
        while let Some(head) = text.strip_suffix('\\') {
            text = format!("{head}\n");
            match self.line(more)? {
                Some(l) => text.push_str(&l),
                None => return Ok(None),
            }
        }
        Ok(Some(text))
    }
}

/// A line that is a command.
fn command(text: &str) -> Option<Input> {
    let t = text.trim();
    if !t.starts_with('/') || t.contains('\n') {
        return None;
    }
    Some(match t {
        "/bye" | "/exit" | "/quit" => Input::Quit,
        "/clear" | "/reset" => Input::Clear,
        "/help" | "/?" => Input::Help,
        // A path or a fraction is a message, not a mistyped command.
        _ if t[1..].contains(['/', ' ']) => return None,
        other => Input::Unknown(other.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(text: &str) -> Vec<Input> {
        let mut lines = Lines::Plain(Box::new(std::io::Cursor::new(text.to_string())));
        let mut out = Vec::new();
        loop {
            match lines.read("", "").unwrap() {
                Input::Quit => return out,
                i => out.push(i),
            }
        }
    }

    #[test]
    fn messages_span_lines_with_backslash_or_triple_quotes() {
        let got = all("hello\n\n  \none \\\ntwo\\\nthree\n\"\"\"\nfirst\n\n second\n\"\"\"\n\"\"\"inline\"\"\"\n");
        assert_eq!(
            got,
            [
                Input::Message("hello".into()),
                Input::Message("one \ntwo\nthree".into()),
                Input::Message("first\n\n second".into()),
                Input::Message("inline".into()),
            ]
        );
    }

    #[test]
    fn commands_and_the_end_of_input() {
        assert_eq!(
            all("/clear\n/reset\n/help\n/what\n/usr/bin is a path\nhi\n/bye\nnot read\n"),
            [
                Input::Clear,
                Input::Clear,
                Input::Help,
                Input::Unknown("/what".into()),
                Input::Message("/usr/bin is a path".into()),
                Input::Message("hi".into()),
            ]
        );
        // An unclosed block at the end of input, like Ctrl-D, ends the chat.
        assert_eq!(all("a\n\"\"\"\nunfinished\n"), [Input::Message("a".into())]);
        assert!(all("").is_empty());
    }
}
