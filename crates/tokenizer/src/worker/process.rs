//! One render worker process, seen from the parent: started under an address-space rlimit,
//! asked over pipes, waited on with a deadline, killed when it overruns, and its death read as
//! the limit it hit.

use std::borrow::Cow;
use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use super::wire::{encode, take_frame, Messages, RenderArgs, Reply, Request};
use crate::{ChatMessage, TemplateLimit, TemplateLimits, TokenizerError};

/// A fresh process must exec and load its binary before it answers: its first request may take
/// this much longer than a render.
const START_GRACE: Duration = Duration::from_secs(10);

/// What std's allocation-failure hook prints before it aborts: the worker ran out of its
/// address space.
const ALLOC_FAILED: &str = "memory allocation of";

/// The program (and its arguments) that runs [`super::run_template_worker`] on its standard
/// input and output; typically the current binary with a hidden subcommand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

impl WorkerCommand {
    pub fn new(program: impl Into<PathBuf>, args: &[&str]) -> Self {
        Self {
            program: program.into(),
            args: args.iter().map(OsString::from).collect(),
        }
    }
}

/// One worker process with a template loaded. A failed call that leaves the worker unusable
/// (it died, overran or broke the protocol) kills it; [`Self::is_alive`] then says false.
pub struct TemplateWorker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    stderr: Option<ChildStderr>,
    limits: TemplateLimits,
    /// Reply bytes read but not yet a whole frame.
    pending: Vec<u8>,
    alive: bool,
    /// No request answered yet: the process may still be starting.
    fresh: bool,
}

/// Why a call got no reply.
enum Fail {
    Overran,
    Died,
    Broken(String),
}

impl TemplateWorker {
    /// Starts a worker under `limits` (memory is its address-space rlimit) and compiles `source`
    /// in it: a syntax error is [`TokenizerError::Template`], as in this process.
    pub fn start(
        command: &WorkerCommand,
        limits: TemplateLimits,
        source: &str,
    ) -> Result<Self, TokenizerError> {
        let mut w = Self::spawn(command, limits).map_err(|e| {
            let what = command.program.display();
            TokenizerError::TemplateWorker(format!("starting the worker {what}: {e}"))
        })?;
        w.load(source)?;
        Ok(w)
    }

    /// Compiles `source` in the worker, replacing its template (the fuzzer reuses one worker
    /// for many templates).
    pub fn load(&mut self, source: &str) -> Result<(), TokenizerError> {
        let load = Request::Load {
            source: source.into(),
            limits: self.limits,
        };
        let grace = if std::mem::take(&mut self.fresh) {
            START_GRACE
        } else {
            Duration::ZERO
        };
        match self.call(&load, self.limits.max_time + grace)? {
            Reply::Loaded => Ok(()),
            other => Err(other.into_result().err().unwrap_or_else(|| {
                TokenizerError::TemplateWorker("the worker answered a load with a render".into())
            })),
        }
    }

    fn spawn(command: &WorkerCommand, limits: TemplateLimits) -> io::Result<Self> {
        let mut cmd = Command::new(&command.program);
        cmd.args(&command.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let memory = limits.max_memory_bytes as libc::rlim_t;
        // SAFETY: between fork and exec only async-signal-safe calls: setrlimit, on this
        // process's own limits, with structs on the stack.
        unsafe {
            cmd.pre_exec(move || {
                set_rlimit(libc::RLIMIT_AS, memory)?;
                // A worker that hits its cap aborts: no core file where it runs.
                set_rlimit(libc::RLIMIT_CORE, 0)
            });
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take().expect("piped");
        set_nonblocking(stdin.as_raw_fd())?;
        Ok(Self {
            stdout: child.stdout.take().expect("piped"),
            stderr: child.stderr.take(),
            stdin,
            child,
            limits,
            pending: Vec::new(),
            alive: true,
            fresh: true,
        })
    }

    pub fn is_alive(&self) -> bool {
        self.alive
    }

    /// Renders as [`crate::ChatTemplate::render_tools`] would in this process, within the
    /// limits: past the time limit the worker is killed, past the memory limit it dies, and
    /// either is a [`TokenizerError::TemplateLimit`] naming the limit.
    pub fn render(
        &mut self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let messages = Messages::Chat(messages.into());
        self.render_args(messages, tools, add_generation_prompt, enable_thinking)
    }

    /// [`Self::render`] of OpenAI-style JSON messages, as [`crate::ChatTemplate::render_json`].
    pub fn render_json(
        &mut self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let messages = Messages::Json(Cow::Borrowed(messages));
        self.render_args(messages, tools, add_generation_prompt, enable_thinking)
    }

    fn render_args(
        &mut self,
        messages: Messages,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let req = Request::Render(RenderArgs {
            messages,
            tools: tools.map(Cow::Borrowed),
            add_generation_prompt,
            enable_thinking,
        });
        self.call(&req, self.limits.max_time)?.into_result()
    }

    fn call(&mut self, req: &Request, limit: Duration) -> Result<Reply, TokenizerError> {
        if !self.alive {
            return Err(TokenizerError::TemplateWorker(
                "the worker has ended".into(),
            ));
        }
        let deadline = Instant::now() + limit;
        let body = self
            .send(&encode(req), deadline)
            .and_then(|()| self.receive(deadline));
        let fail = match body {
            Ok(body) => match serde_json::from_slice::<Reply>(&body) {
                Ok(reply) => return Ok(reply),
                Err(e) => Fail::Broken(format!("an unreadable reply: {e}")),
            },
            Err(fail) => fail,
        };
        Err(self.end(fail))
    }

    /// Kills the worker and names what ended the call.
    fn end(&mut self, fail: Fail) -> TokenizerError {
        self.alive = false;
        let _ = self.child.kill();
        let status = self.child.wait();
        match fail {
            // A load's start-up grace is the process's, not the template's: name the limit.
            Fail::Overran => {
                TokenizerError::TemplateLimit(TemplateLimit::Time(self.limits.max_time))
            }
            Fail::Broken(why) => TokenizerError::TemplateWorker(why),
            Fail::Died => {
                let said = self.stderr_tail();
                if said.contains(ALLOC_FAILED) {
                    let limit = TemplateLimit::MemoryBytes(self.limits.max_memory_bytes);
                    return TokenizerError::TemplateLimit(limit);
                }
                let how = match status {
                    Ok(s) => match s.signal() {
                        Some(sig) => format!("signal {sig}"),
                        None => s.to_string(),
                    },
                    Err(e) => e.to_string(),
                };
                let last = said.lines().last().unwrap_or("").trim();
                TokenizerError::TemplateWorker(format!("the worker died ({how}): {last}"))
            }
        }
    }

    /// What the dead worker wrote to stderr (its last 16 KiB at most).
    fn stderr_tail(&mut self) -> String {
        let mut out = Vec::new();
        if let Some(e) = self.stderr.take() {
            let _ = e.take(16 << 10).read_to_end(&mut out);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    fn send(&mut self, mut frame: &[u8], deadline: Instant) -> Result<(), Fail> {
        while !frame.is_empty() {
            match self.stdin.write(frame) {
                Ok(0) => return Err(Fail::Died),
                Ok(n) => frame = &frame[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_ready(self.stdin.as_raw_fd(), libc::POLLOUT, deadline)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(Fail::Died),
            }
        }
        Ok(())
    }

    fn receive(&mut self, deadline: Instant) -> Result<Vec<u8>, Fail> {
        // JSON may escape each output byte into six; errors are cut short by the worker.
        let max = self.limits.max_output_bytes.saturating_mul(6) + (1 << 20);
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            if let Some(body) = take_frame(&mut self.pending, max).map_err(Fail::Broken)? {
                return Ok(body);
            }
            wait_ready(self.stdout.as_raw_fd(), libc::POLLIN, deadline)?;
            match self.stdout.read(&mut chunk) {
                Ok(0) => return Err(Fail::Died),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(Fail::Died),
            }
        }
    }
}

impl Drop for TemplateWorker {
    fn drop(&mut self) {
        // A worker holds nothing but the compiled template: killing it loses nothing.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `fd` is ready for `events` (or hung up), or fails at `deadline`.
fn wait_ready(fd: RawFd, events: libc::c_short, deadline: Instant) -> Result<(), Fail> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Fail::Overran);
        }
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // Rounded up, so a wait never ends before the deadline and spins.
        let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd, for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            return Ok(());
        }
        if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return Err(Fail::Died);
        }
    }
}

#[cfg(target_env = "gnu")]
type Resource = libc::__rlimit_resource_t;
#[cfg(not(target_env = "gnu"))]
type Resource = libc::c_int;

fn set_rlimit(resource: Resource, value: libc::rlim_t) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit reads the struct and changes only this process's own limit.
    if unsafe { libc::setrlimit(resource, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Writes to the worker must not block past the deadline (a worker that stopped reading).
fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this process owns; only the status flags change.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
