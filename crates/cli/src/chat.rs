//! `q4moe chat`: an interactive multi-turn terminal chat over the engine. Ctrl-C stops the answer
//! being written; Ctrl-C at the prompt (or Ctrl-D, or /bye) leaves. Input (line editing,
//! history, multi-line messages, commands) is `chat_input`'s.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use q4moe_engine::{
    ChatMessage, Engine, EngineError, Finish, Flow, GenerateRequest, SamplingParams,
};
use q4moe_tokenizer::{thinking_switch, ReasoningSplitter};

use crate::chat_input::{Input, Lines, HELP};

#[derive(Debug, Clone)]
pub struct ChatOptions {
    pub system: Option<String>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Qwen3's thinking switch; `None` keeps the template's default.
    pub enable_thinking: Option<bool>,
    /// The line editor's history file (used when standard input is a terminal).
    pub history: Option<PathBuf>,
}

/// Set by Ctrl-C while an answer streams; `generating` tells the handler which case it is in.
struct Interrupt {
    stop: AtomicBool,
    generating: AtomicBool,
}

pub fn run_chat(mut engine: Engine, opts: ChatOptions) -> anyhow::Result<()> {
    let irq = Arc::new(Interrupt {
        stop: AtomicBool::new(false),
        generating: AtomicBool::new(false),
    });
    let h = irq.clone();
    ctrlc::set_handler(move || {
        if h.generating.load(Ordering::SeqCst) {
            h.stop.store(true, Ordering::SeqCst);
        } else {
            println!();
            std::process::exit(130);
        }
    })?;
    let style = Style::new();
    eprintln!(
        "q4moe chat: {} positions of context. {HELP}",
        engine.context_capacity()
    );
    let mut messages = fresh(&opts);
    let mut lines = Lines::stdin(opts.history.clone());
    loop {
        // A plain prompt: the line editor measures its width, which colour codes would upset.
        match lines.read(">>> ", "... ")? {
            Input::Quit => break,
            Input::Help => eprintln!("{HELP}"),
            Input::Unknown(c) => eprintln!("unknown command {c}; {HELP}"),
            Input::Clear => {
                messages = fresh(&opts);
                engine.reset_sessions();
                eprintln!("(conversation cleared)");
            }
            Input::Message(text) => {
                messages.push(ChatMessage::user(text));
                match answer(&mut engine, &messages, &opts, &irq, &style) {
                    Ok(reply) => messages.push(reply),
                    Err(e) => {
                        messages.pop();
                        eprintln!("error: {e}");
                        if matches!(e, EngineError::PromptTooLong { .. }) {
                            eprintln!("(the conversation no longer fits: /clear to start over)");
                        }
                    }
                }
            }
        }
    }
    lines.save_history();
    Ok(())
}

fn fresh(opts: &ChatOptions) -> Vec<ChatMessage> {
    opts.system.iter().map(ChatMessage::system).collect()
}

/// Streams one answer; returns the assistant turn to keep (a stopped answer is kept as far as it got).
fn answer(
    engine: &mut Engine,
    messages: &[ChatMessage],
    opts: &ChatOptions,
    irq: &Interrupt,
    style: &Style,
) -> Result<ChatMessage, EngineError> {
    let thinking = thinking_switch(messages, opts.enable_thinking);
    let rendered = engine.render_chat(messages, thinking)?;
    let think_open = rendered.trim_end_matches('\n').ends_with("<think>");
    let prompt = engine.encode_prompt(&rendered)?;
    let room = engine.context_capacity().saturating_sub(prompt.len());
    let mut req = GenerateRequest::new(prompt, opts.max_tokens.min(room));
    req.sampling = opts.sampling.clone();
    req.reuse_prefix = true;
    let mut splitter = ReasoningSplitter::new(think_open);
    let (mut reasoning, mut content) = (String::new(), String::new());
    let mut out = std::io::stdout();
    let mut show = |r: &str, c: &str| {
        // Reasoning is dimmed; the answer is plain.
        if !r.is_empty() {
            let _ = write!(out, "{}{r}{}", style.dim, style.reset);
        }
        let _ = write!(out, "{c}");
        let _ = out.flush();
    };
    irq.stop.store(false, Ordering::SeqCst);
    irq.generating.store(true, Ordering::SeqCst);
    let result = engine.generate(&req, &mut |piece: &str| {
        let s = splitter.push(piece);
        show(&s.reasoning, &s.content);
        reasoning += &s.reasoning;
        content += &s.content;
        if irq.stop.load(Ordering::SeqCst) {
            Flow::Stop
        } else {
            Flow::Continue
        }
    });
    irq.generating.store(false, Ordering::SeqCst);
    let tail = splitter.finish();
    show(&tail.reasoning, &tail.content);
    reasoning += &tail.reasoning;
    content += &tail.content;
    let out = result?;
    match out.finish {
        Finish::Cancelled => println!("\n{}(stopped){}", style.dim, style.reset),
        Finish::Length => println!("\n{}(length limit){}", style.dim, style.reset),
        Finish::Stop => println!(),
    }
    let mut reply = ChatMessage::assistant(content.trim());
    reply.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
    Ok(reply)
}

/// ANSI codes when stdout is a terminal, nothing when piped.
struct Style {
    dim: &'static str,
    reset: &'static str,
}

impl Style {
    fn new() -> Self {
        if std::io::stdout().is_terminal() {
            Style {
                dim: "\x1b[2m",
                reset: "\x1b[0m",
            }
        } else {
            Style { dim: "", reset: "" }
        }
    }
}
