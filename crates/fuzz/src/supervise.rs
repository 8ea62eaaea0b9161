//! Runs a campaign in a child process, so that what cannot be caught in-process (an abort, a
//! stack overflow, the allocation cap, a hang) still yields a reproducer: before each execution
//! the child copies its input into a memory-mapped slot file, and the parent, which watches the
//! slot's execution counter, saves that input when the child dies or stops making progress, then
//! starts a new child for the executions left.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::fuzzer::write_reproducer;
use crate::{Failure, FailureKind, FuzzError};

/// Slot layout: execution counter (u64), input length (u64), input bytes.
const SLOT_HEADER: usize = 16;
const SLOT_INPUT: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct Campaign {
    pub target: String,
    pub corpus: PathBuf,
    pub execs: u64,
    pub seed: u64,
    pub out_dir: PathBuf,
    pub hang: Duration,
    pub slow: Option<Duration>,
    pub mem_cap_mb: usize,
    /// The tokenizer target's vocabulary (see [`crate::TargetConfig`]).
    pub vocab: Option<PathBuf>,
    /// The campaign stops after this many dead children.
    pub max_crashes: u32,
}

/// What the worker prints as its last stdout line, after this prefix, as JSON.
pub const REPORT_PREFIX: &str = "WORKER-REPORT ";

#[derive(Debug, Clone, Default)]
pub struct CampaignReport {
    pub target: String,
    pub execs: u64,
    pub failing_execs: u64,
    /// One line per distinct failure: kind, reproducer, message.
    pub failures: Vec<String>,
    pub outcomes: u64,
    /// Executions per outcome class, from the workers that finished (see [`crate::Report`]).
    pub classes: std::collections::BTreeMap<String, u64>,
    pub elapsed: Duration,
}

impl CampaignReport {
    pub fn summary(&self) -> String {
        let rate = self.execs as f64 / self.elapsed.as_secs_f64().max(1e-9);
        format!(
            "{}: {} executions in {:.1} s ({rate:.0}/s), {} distinct outcomes, {} failing, {} distinct failures",
            self.target,
            self.execs,
            self.elapsed.as_secs_f64(),
            self.outcomes,
            self.failing_execs,
            self.failures.len()
        )
    }
}

/// A crashing child is expected here: it must not leave core files behind (where a machine
/// keeps them in the working directory, CI's checkout would fill up).
pub fn no_core_dumps() {
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit reads the struct and changes only this process's own limit.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) };
}

/// The child's side: the slot it writes each input to.
pub struct Slot {
    map: MmapMut,
}

impl Slot {
    fn create(path: &Path) -> Result<Self, FuzzError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| FuzzError::io(path, e))?;
        file.set_len((SLOT_HEADER + SLOT_INPUT) as u64)
            .map_err(|e| FuzzError::io(path, e))?;
        Self::open(path)
    }

    pub fn open(path: &Path) -> Result<Self, FuzzError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| FuzzError::io(path, e))?;
        // SAFETY: the slot file is private to one supervisor and its one child at a time.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| FuzzError::io(path, e))?;
        Ok(Self { map })
    }

    /// Records the input about to run; the counter moves last, so a stale input never pairs
    /// with a new count.
    pub fn record(&mut self, exec: u64, input: &[u8]) {
        let n = input.len().min(SLOT_INPUT);
        self.map[SLOT_HEADER..SLOT_HEADER + n].copy_from_slice(&input[..n]);
        self.map[8..16].copy_from_slice(&(n as u64).to_le_bytes());
        self.map[0..8].copy_from_slice(&(exec + 1).to_le_bytes());
    }

    fn count(&self) -> u64 {
        u64::from_le_bytes(self.map[0..8].try_into().expect("8 bytes"))
    }

    fn input(&self) -> Vec<u8> {
        let n = u64::from_le_bytes(self.map[8..16].try_into().expect("8 bytes")) as usize;
        self.map[SLOT_HEADER..SLOT_HEADER + n.min(SLOT_INPUT)].to_vec()
    }
}

/// Collects a child's stream on a thread; keeps the whole stdout, or the tail of stderr.
fn collect(mut r: impl Read + Send + 'static, keep_tail: Option<usize>) -> Arc<Mutex<Vec<u8>>> {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let out = buf.clone();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n) = r.read(&mut chunk) {
            if n == 0 {
                break;
            }
            let mut b = out.lock().expect("collector lock");
            b.extend_from_slice(&chunk[..n]);
            if let Some(tail) = keep_tail.filter(|&t| b.len() > 2 * t) {
                let cut = b.len() - tail;
                b.drain(..cut);
            }
        }
    });
    buf
}

fn spawn(exe: &Path, c: &Campaign, slot: &Path, done: u64, seed: u64) -> std::io::Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.arg("worker")
        .arg(&c.target)
        .args(["--execs", &c.execs.to_string(), "--seed", &seed.to_string()])
        .args(["--resume-at", &done.to_string()])
        .arg("--out")
        .arg(&c.out_dir)
        .arg("--corpus")
        .arg(&c.corpus)
        .arg("--slot")
        .arg(slot)
        .args(["--mem-cap-mb", &c.mem_cap_mb.to_string()]);
    if let Some(vocab) = &c.vocab {
        cmd.arg("--vocab-gguf").arg(vocab);
    }
    if let Some(slow) = c.slow {
        cmd.args(["--slow-ms", &slow.as_millis().to_string()]);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()
}

/// How one child ended.
enum End {
    Finished(serde_json::Value),
    Died(String),
    Hung,
}

fn watch(mut child: Child, slot: &Slot, hang: Duration) -> Result<End, FuzzError> {
    let stdout = collect(child.stdout.take().expect("piped"), None);
    let stderr = collect(child.stderr.take().expect("piped"), Some(4096));
    let (mut last, mut moved) = (slot.count(), Instant::now());
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .map_err(|e| FuzzError::Worker(e.to_string()))?
        {
            break status;
        }
        std::thread::sleep(Duration::from_millis(20));
        let now = slot.count();
        if now != last {
            (last, moved) = (now, Instant::now());
        } else if moved.elapsed() > hang {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(End::Hung);
        }
    };
    // The collector threads finish once the pipes close.
    std::thread::sleep(Duration::from_millis(50));
    let out = String::from_utf8_lossy(&stdout.lock().expect("lock")).into_owned();
    let report = out
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(REPORT_PREFIX))
        .and_then(|j| serde_json::from_str(j).ok());
    match (status.success(), report) {
        (true, Some(r)) => Ok(End::Finished(r)),
        _ => {
            let err = String::from_utf8_lossy(&stderr.lock().expect("lock")).into_owned();
            Ok(End::Died(format!("worker exited with {status}\n{err}")))
        }
    }
}

/// Runs the campaign to its execution count, restarting dead or hung children.
pub fn supervise(exe: &Path, c: &Campaign) -> Result<CampaignReport, FuzzError> {
    std::fs::create_dir_all(&c.out_dir).map_err(|e| FuzzError::io(&c.out_dir, e))?;
    let slot_path = c
        .out_dir
        .join(format!(".slot-{}-{}", c.target, std::process::id()));
    let start = Instant::now();
    let mut report = CampaignReport {
        target: c.target.clone(),
        ..Default::default()
    };
    let mut crashes = 0;
    while report.execs < c.execs && crashes < c.max_crashes {
        let slot = Slot::create(&slot_path)?;
        let seed = c.seed.wrapping_add(crashes as u64);
        let child =
            spawn(exe, c, &slot_path, report.execs, seed).map_err(|e| FuzzError::io(exe, e))?;
        let (kind, message) = match watch(child, &slot, c.hang)? {
            End::Finished(r) => {
                absorb(&mut report, &r);
                break;
            }
            End::Died(msg) => (FailureKind::Crash, msg),
            End::Hung => (FailureKind::Hang, format!("no progress for {:?}", c.hang)),
        };
        crashes += 1;
        // The slot counts executions from the campaign's start, the failing one included.
        report.execs = report.execs.max(slot.count());
        report.failing_execs += 1;
        let failure = Failure {
            kind,
            message,
            input: slot.input(),
            file: None,
        };
        let file = write_reproducer(&c.out_dir, &c.target, &failure)?;
        report.failures.push(format!(
            "{}: {} ({})",
            kind.name(),
            file.display(),
            failure.message.lines().last().unwrap_or("")
        ));
    }
    let _ = std::fs::remove_file(&slot_path);
    report.elapsed = start.elapsed();
    Ok(report)
}

fn absorb(report: &mut CampaignReport, r: &serde_json::Value) {
    let n = |k: &str| r[k].as_u64().unwrap_or(0);
    report.execs += n("execs");
    report.failing_execs += n("failing_execs");
    report.outcomes = report.outcomes.max(n("outcomes"));
    for (class, count) in r["classes"].as_object().into_iter().flatten() {
        *report.classes.entry(class.clone()).or_insert(0) += count.as_u64().unwrap_or(0);
    }
    for f in r["failures"].as_array().into_iter().flatten() {
        report.failures.push(format!(
            "{}: {} ({})",
            f["kind"].as_str().unwrap_or("?"),
            f["file"].as_str().unwrap_or("-"),
            f["message"].as_str().unwrap_or("")
        ));
    }
}
