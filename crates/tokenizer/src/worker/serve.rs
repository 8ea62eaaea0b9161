//! The worker's side: compile the template it is sent, render each request, answer each with
//! one reply, and end when the parent closes its input. Its memory is capped by the parent
//! (an address-space rlimit set before exec); its own watchdog ends it if a render runs far past
//! the time limit, so a worker whose parent died mid-render does not spin on for hours.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, Messages, RenderArgs, Reply, Request};
use crate::{ChatTemplate, TokenizerError};

/// The parent kills a render at its time limit; the watchdog acts only if the parent did not
/// (it died, or is stopped), so it waits this much longer.
const WATCHDOG_GRACE: Duration = Duration::from_secs(2);

/// Error messages quote the template's source; a hostile one may be megabytes on one line.
const MAX_MESSAGE: usize = 64 << 10;

/// The worker process's body: serves renders over standard input and output until the parent
/// closes the input. A binary exposes this as the hidden subcommand a [`super::WorkerCommand`]
/// names. It takes over the process's panic hook, so a panicking render answers as an error
/// without writing to stderr (which the parent reads only after a death).
pub fn run_template_worker() -> Result<(), TokenizerError> {
    std::panic::set_hook(Box::new(|_| {}));
    serve(io::stdin().lock(), io::stdout().lock())
}

/// Serves renders over `input` / `output` until the input ends.
pub(crate) fn serve(input: impl Read, output: impl Write) -> Result<(), TokenizerError> {
    let io_err = |e: io::Error| TokenizerError::TemplateWorker(format!("worker pipe: {e}"));
    let mut input = BufReader::new(input);
    let mut output = BufWriter::new(output);
    let watchdog = Watchdog::start().map_err(io_err)?;
    let mut template: Option<ChatTemplate> = None;
    while let Some(frame) = read_frame(&mut input).map_err(io_err)? {
        let reply = match serde_json::from_slice::<Request>(&frame) {
            Ok(Request::Load { source, limits }) => {
                watchdog.set_limit(limits.max_time + WATCHDOG_GRACE);
                // Compiling folds constant expressions: it can take time too.
                match watchdog.guard(|| ChatTemplate::with_limits(&source, limits)) {
                    Ok(t) => {
                        template = Some(t);
                        Reply::Loaded
                    }
                    Err(e) => Reply::from(Err(e)),
                }
            }
            Ok(Request::Render(args)) => match &template {
                Some(t) => watchdog.guard(|| render(t, args)),
                None => Reply::Failed("no template was loaded before the render".into()),
            },
            Err(e) => Reply::Failed(format!("an unreadable request: {e}")),
        };
        write_frame(&mut output, &shorten(reply)).map_err(io_err)?;
    }
    Ok(())
}

fn render(t: &ChatTemplate, a: RenderArgs) -> Reply {
    // A panic is a bug in a filter or method, but the template is hostile: answer it as an
    // error and keep serving (the template is immutable, nothing is left half-changed).
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let (tools, gen, think) = (
            a.tools.as_deref(),
            a.add_generation_prompt,
            a.enable_thinking,
        );
        match &a.messages {
            Messages::Chat(m) => t.render_tools(m, tools, gen, think),
            Messages::Json(m) => t.render_json(m, tools, gen, think),
        }
    }));
    match r {
        Ok(r) => Reply::from(r),
        Err(payload) => {
            let why = (payload.downcast_ref::<&str>().copied())
                .or(payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            Reply::Failed(format!("the render panicked: {why}"))
        }
    }
}

fn shorten(reply: Reply) -> Reply {
    match reply {
        Reply::Failed(mut msg) if msg.len() > MAX_MESSAGE => {
            let mut cut = MAX_MESSAGE;
            while !msg.is_char_boundary(cut) {
                cut -= 1;
            }
            msg.truncate(cut);
            msg.push_str(" [...]");
            Reply::Failed(msg)
        }
        other => other,
    }
}

/// Ends the process when a render outlives its deadline.
struct Watchdog {
    state: Arc<(Mutex<WatchState>, Condvar)>,
}

struct WatchState {
    limit: Duration,
    deadline: Option<Instant>,
}

impl Watchdog {
    fn start() -> io::Result<Self> {
        let state = Arc::new((
            Mutex::new(WatchState {
                limit: Duration::from_secs(60),
                deadline: None,
            }),
            Condvar::new(),
        ));
        let watched = state.clone();
        std::thread::Builder::new()
            .name("template-watchdog".into())
            .spawn(move || watch(&watched))?;
        Ok(Self { state })
    }

    fn set_limit(&self, limit: Duration) {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner()).limit = limit;
    }

    fn guard<T>(&self, f: impl FnOnce() -> T) -> T {
        self.arm(true);
        let out = f();
        self.arm(false);
        out
    }

    fn arm(&self, on: bool) {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
        s.deadline = on.then(|| Instant::now() + s.limit);
        cv.notify_one();
    }
}

fn watch(state: &(Mutex<WatchState>, Condvar)) {
    let (lock, cv) = state;
    let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        s = match s.deadline {
            None => cv.wait(s).unwrap_or_else(|p| p.into_inner()),
            Some(d) if Instant::now() >= d => {
                let _ =
                    io::stderr().write_all(b"template worker: a render ran past its deadline\n");
                // SAFETY: `_exit` ends the process at once; the render thread may hold any lock,
                // so no exit handler or destructor may run.
                unsafe { libc::_exit(3) }
            }
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                cv.wait_timeout(s, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::super::wire::{encode, take_frame, Messages, RenderArgs, Reply, Request};
    use crate::{ChatMessage, TemplateLimits, QWEN3_CHAT_TEMPLATE};

    fn replies(requests: &[Request]) -> Vec<Reply> {
        let input: Vec<u8> = requests.iter().flat_map(encode).collect();
        let mut output = Vec::new();
        super::serve(&input[..], &mut output).unwrap();
        let mut out = Vec::new();
        while let Some(body) = take_frame(&mut output, usize::MAX).unwrap() {
            out.push(serde_json::from_slice(&body).unwrap());
        }
        out
    }

    fn render(messages: &[ChatMessage]) -> Request<'_> {
        Request::Render(RenderArgs {
            messages: Messages::Chat(messages.into()),
            tools: None,
            add_generation_prompt: true,
            enable_thinking: Some(false),
        })
    }

    #[test]
    fn the_worker_loads_renders_and_reports_errors_and_limits() {
        let limits = TemplateLimits::default();
        let msgs = [ChatMessage::user("hi")];
        let load = |source: &'static str| Request::Load {
            source: source.into(),
            limits,
        };
        let out = replies(&[
            render(&msgs),
            load("{% if %}"),
            load(QWEN3_CHAT_TEMPLATE),
            render(&msgs),
            load("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"),
            render(&msgs),
        ]);
        assert_eq!(out.len(), 6, "{out:?}");
        assert!(
            matches!(&out[0], Reply::Failed(m) if m.contains("no template")),
            "{out:?}"
        );
        assert!(
            matches!(&out[1], Reply::Failed(m) if m.contains("syntax")),
            "{out:?}"
        );
        assert!(matches!(out[2], Reply::Loaded));
        let want = crate::ChatTemplate::new(QWEN3_CHAT_TEMPLATE)
            .unwrap()
            .render(&msgs, true, Some(false))
            .unwrap();
        assert!(
            matches!(&out[3], Reply::Rendered(t) if *t == want),
            "{out:?}"
        );
        let fuel = crate::TemplateLimit::Fuel(limits.fuel);
        assert!(matches!(out[5], Reply::Limit(l) if l == fuel), "{out:?}");
    }
}
