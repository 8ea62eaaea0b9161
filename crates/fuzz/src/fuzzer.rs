//! The in-process loop: run the seeds, then mutants of the corpus; catch panics and property
//! failures, time each execution, and write a reproducer for every distinct failure.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::{FuzzError, Mutator, Target};

/// One fuzzing campaign's settings, built by the caller (the CLI or a test).
#[derive(Debug, Clone)]
pub struct Options {
    /// Executions in all, the seeds included.
    pub execs: u64,
    /// Executions already done by an earlier process of the same campaign: a restarted worker
    /// goes on from there (seeds before it are not run again, so a crashing seed is not retried).
    pub resume_at: u64,
    pub seed: u64,
    /// Where reproducers go; `None` keeps failures in the report only.
    pub out_dir: Option<PathBuf>,
    /// An execution slower than this is a failure (a limit that does not hold).
    pub slow: Option<Duration>,
    /// The corpus stops growing here.
    pub max_corpus: usize,
    /// Print each new kind of outcome to stderr (to see what the feedback tells apart).
    pub print_outcomes: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            execs: 1000,
            resume_at: 0,
            seed: 0,
            out_dir: None,
            slow: None,
            max_corpus: 4096,
            print_outcomes: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    Panic,
    Property,
    Slow,
    /// The process died (abort, stack overflow, the allocation cap): seen by the supervisor.
    Crash,
    /// No progress within the supervisor's timeout.
    Hang,
}

impl FailureKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Panic => "panic",
            Self::Property => "property",
            Self::Slow => "slow",
            Self::Crash => "crash",
            Self::Hang => "hang",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
    pub input: Vec<u8>,
    /// The reproducer written for it, if an output folder was given.
    pub file: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct Report {
    pub target: &'static str,
    pub execs: u64,
    /// Distinct outcomes seen (the feedback signal).
    pub outcomes: usize,
    pub corpus: usize,
    /// One per distinct failure; `failing_execs` counts them all.
    pub failures: Vec<Failure>,
    pub failing_execs: u64,
    /// Executions per outcome class (an outcome's text up to its first ':'): how deep inputs got.
    pub classes: BTreeMap<String, u64>,
    pub elapsed: Duration,
}

impl Report {
    pub fn summary(&self) -> String {
        let rate = self.execs as f64 / self.elapsed.as_secs_f64().max(1e-9);
        format!(
            "{}: {} executions in {:.1} s ({rate:.0}/s), {} distinct outcomes, corpus {}, {} failing executions, {} distinct failures",
            self.target,
            self.execs,
            self.elapsed.as_secs_f64(),
            self.outcomes,
            self.corpus,
            self.failing_execs,
            self.failures.len()
        )
    }
}

thread_local! {
    /// Set while a target runs on this thread: its panic message is kept, not printed.
    static CAPTURE: RefCell<Option<Option<String>>> = const { RefCell::new(None) };
}

fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let captured = CAPTURE.with(|c| {
                let mut c = c.borrow_mut();
                match c.as_mut() {
                    Some(slot) => {
                        let at = info
                            .location()
                            .map_or(String::new(), |l| format!(" at {l}"));
                        *slot = Some(format!("{}{at}", panic_message(info.payload())));
                        true
                    }
                    None => false,
                }
            });
            if !captured {
                previous(info);
            }
        }));
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// Runs one input: `Ok(outcome)`, or the failure (panic or broken property) it caused.
pub fn run_one(target: &mut dyn Target, input: &[u8]) -> Result<String, Failure> {
    install_panic_hook();
    CAPTURE.with(|c| *c.borrow_mut() = Some(None));
    let result = panic::catch_unwind(AssertUnwindSafe(|| target.run(input)));
    let message = CAPTURE.with(|c| c.borrow_mut().take().flatten());
    let fail = |kind, message| Failure {
        kind,
        message,
        input: input.to_vec(),
        file: None,
    };
    match result {
        Ok(Ok(outcome)) => Ok(outcome),
        Ok(Err(broken)) => Err(fail(FailureKind::Property, broken)),
        Err(payload) => Err(fail(
            FailureKind::Panic,
            message.unwrap_or_else(|| panic_message(payload.as_ref())),
        )),
    }
}

/// Outcomes differ in kind, not in the names and numbers inside them.
fn signature(outcome: &str) -> String {
    let mut out = String::new();
    let mut quote: Option<char> = None;
    for c in outcome.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if matches!(c, '"' | '\'' | '`') => quote = Some(c),
            None if c.is_ascii_digit() => {
                if !out.ends_with('#') {
                    out.push('#');
                }
            }
            None => out.push(c),
        }
        if out.len() >= 120 {
            break;
        }
    }
    out
}

/// FNV-1a: a stable name for a reproducer.
fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Writes `failure`'s input and message under `dir`; returns the input's path.
pub fn write_reproducer(dir: &Path, target: &str, failure: &Failure) -> Result<PathBuf, FuzzError> {
    std::fs::create_dir_all(dir).map_err(|e| FuzzError::io(dir, e))?;
    let stem = format!(
        "{}-{target}-{:016x}",
        failure.kind.name(),
        hash(&failure.input)
    );
    let path = dir.join(format!("{stem}.bin"));
    std::fs::write(&path, &failure.input).map_err(|e| FuzzError::io(&path, e))?;
    let note = dir.join(format!("{stem}.txt"));
    let text = format!(
        "target: {target}\nkind: {}\nreproduce: q4moe-fuzz repro {target} {}\n\n{}\n",
        failure.kind.name(),
        path.display(),
        failure.message
    );
    std::fs::write(&note, text).map_err(|e| FuzzError::io(&note, e))?;
    Ok(path)
}

pub struct Fuzzer<'t> {
    target: &'t mut dyn Target,
    corpus: Vec<Vec<u8>>,
    seeds: usize,
    seen: HashSet<String>,
}

impl<'t> Fuzzer<'t> {
    pub fn new(target: &'t mut dyn Target, seeds: Vec<Vec<u8>>) -> Self {
        Self {
            target,
            seeds: seeds.len(),
            corpus: seeds,
            seen: HashSet::new(),
        }
    }

    /// Runs `opts.execs` executions; `before_each` sees each input first (the supervisor keeps
    /// it where a crash cannot lose it).
    pub fn run(
        &mut self,
        opts: &Options,
        mut before_each: impl FnMut(u64, &[u8]),
    ) -> Result<Report, FuzzError> {
        let start = Instant::now();
        let name = self.target.name();
        let mut mutator = Mutator::new(opts.seed, self.target.max_len());
        let mut failures: Vec<Failure> = Vec::new();
        let mut failed_kinds = HashSet::new();
        let mut failing_execs = 0;
        let mut classes = BTreeMap::new();
        for exec in opts.resume_at..opts.execs {
            let input = if (exec as usize) < self.seeds {
                self.corpus[exec as usize].clone()
            } else {
                self.next_mutant(&mut mutator)
            };
            before_each(exec, &input);
            let t0 = Instant::now();
            let mut result = run_one(self.target, &input);
            let took = t0.elapsed();
            if let (Ok(_), Some(slow)) = (&result, opts.slow) {
                if took > slow {
                    result = Err(Failure {
                        kind: crate::FailureKind::Slow,
                        message: format!("took {took:?} (limit {slow:?})"),
                        input: input.clone(),
                        file: None,
                    });
                }
            }
            match result {
                Ok(outcome) => {
                    let class = outcome.split(':').next().unwrap_or("").to_string();
                    *classes.entry(class).or_insert(0) += 1;
                    self.learn(outcome, input, opts)
                }
                Err(mut failure) => {
                    failing_execs += 1;
                    if failed_kinds.insert((failure.kind, signature(&failure.message))) {
                        if let Some(dir) = &opts.out_dir {
                            failure.file = Some(write_reproducer(dir, name, &failure)?);
                        }
                        failures.push(failure);
                    }
                }
            }
        }
        Ok(Report {
            target: name,
            execs: opts.execs.saturating_sub(opts.resume_at),
            outcomes: self.seen.len(),
            corpus: self.corpus.len(),
            failures,
            failing_execs,
            classes,
            elapsed: start.elapsed(),
        })
    }

    fn next_mutant(&mut self, mutator: &mut Mutator) -> Vec<u8> {
        if self.corpus.is_empty() {
            return Vec::new();
        }
        // Half the mutants come from the seeds: entries learned later are mostly early refusals,
        // and the seeds are what reach deep (a whole model file).
        let n = self.corpus.len();
        let from_seeds = self.seeds > 0 && mutator.rng().gen_bool(0.5);
        let a = mutator
            .rng()
            .gen_range(0..if from_seeds { self.seeds } else { n });
        let b = mutator.rng().gen_range(0..n);
        let dict = self.target.dict();
        mutator.mutate(&self.corpus[a], &self.corpus[b], dict)
    }

    fn learn(&mut self, outcome: String, input: Vec<u8>, opts: &Options) {
        let sig = signature(&outcome);
        if opts.print_outcomes && !self.seen.contains(&sig) {
            eprintln!("new outcome: {sig}");
        }
        if self.seen.insert(sig) && self.corpus.len() < opts.max_corpus {
            self.corpus.push(input);
        }
    }
}

/// Every file of a seed corpus folder, in name order.
pub fn load_corpus(dir: &Path) -> Result<Vec<Vec<u8>>, FuzzError> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| FuzzError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(FuzzError::EmptyCorpus(dir.to_path_buf()));
    }
    paths
        .iter()
        .map(|p| std::fs::read(p).map_err(|e| FuzzError::io(p, e)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_ignore_names_and_numbers() {
        assert_eq!(
            signature("tensor 'a.weight' has 3 dims at 1024"),
            signature("tensor 'b' has 12 dims at 7")
        );
        assert_ne!(signature("bad magic"), signature("bad version"));
    }
}
