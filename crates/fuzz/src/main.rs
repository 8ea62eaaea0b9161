//! `q4moe-fuzz`: runs the fuzz targets (see the crate docs), reproduces a failure from its file,
//! and regenerates the binary seeds.
//!
//! ```text
//! q4moe-fuzz run all --execs 1000000          # each target, supervised; exit 1 on any failure
//! q4moe-fuzz repro gguf target/fuzz-out/panic-gguf-....bin
//! q4moe-fuzz seeds                             # rewrite crates/fuzz/corpus/gguf/*.gguf
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use q4moe_fuzz::supervise::{supervise, Campaign, Slot, REPORT_PREFIX};
use q4moe_fuzz::{
    alloc, corpus_dir, load_corpus, run_one, target_by_name, Fuzzer, Options, TargetConfig,
    TARGET_NAMES,
};
use q4moe_tokenizer::WorkerCommand;

#[global_allocator]
static ALLOC: alloc::CappedAlloc = alloc::CappedAlloc;

#[derive(Parser)]
#[command(name = "q4moe-fuzz", about = "Fuzz q4moe's parsers on stable Rust")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct Common {
    /// Executions per target, the seeds included.
    #[arg(long, default_value_t = 100_000)]
    execs: u64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where reproducers (and the GGUF target's scratch file) go.
    #[arg(long, default_value = "target/fuzz-out")]
    out: PathBuf,
    /// An execution slower than this is a failure.
    #[arg(long)]
    slow_ms: Option<u64>,
    /// A process whose live allocations would pass this is a failure.
    #[arg(long, default_value_t = 1024)]
    mem_cap_mb: usize,
    /// A GGUF whose tokenizer the `tokenizer` target fuzzes (default: a synthetic one).
    #[arg(long)]
    vocab_gguf: Option<PathBuf>,
}

impl Common {
    fn target_config(&self, scratch: PathBuf) -> Result<TargetConfig> {
        Ok(TargetConfig {
            scratch,
            vocab: self.vocab_gguf.clone(),
            template_worker: Some(template_worker()?),
        })
    }
}

/// The `template` target renders in the product's template worker, run by this binary.
fn template_worker() -> Result<WorkerCommand> {
    let exe = std::env::current_exe().context("locating q4moe-fuzz")?;
    Ok(WorkerCommand::new(exe, &["template-worker"]))
}

#[derive(Subcommand)]
enum Cmd {
    /// Fuzz one target, or `all`, each in a supervised child process.
    Run {
        target: String,
        #[command(flatten)]
        common: Common,
        /// Seconds without progress that count as a hang.
        #[arg(long, default_value_t = 10)]
        hang_secs: u64,
        /// Stop a target after this many crashes or hangs.
        #[arg(long, default_value_t = 5)]
        max_crashes: u32,
        /// Seed corpus folder (one target only); default: the committed one.
        #[arg(long)]
        corpus: Option<PathBuf>,
    },
    /// Run one input and print its outcome or failure.
    Repro {
        target: String,
        file: PathBuf,
        /// The vocabulary the failing run used, if not the default.
        #[arg(long)]
        vocab_gguf: Option<PathBuf>,
    },
    /// Rewrite the generated GGUF seeds.
    Seeds {
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// The supervised child (internal).
    #[command(hide = true)]
    Worker {
        target: String,
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        corpus: PathBuf,
        #[arg(long)]
        slot: PathBuf,
        #[arg(long, default_value_t = 0)]
        resume_at: u64,
        #[arg(long)]
        print_outcomes: bool,
    },
    /// Renders chat templates for the `template` target (internal).
    #[command(hide = true)]
    TemplateWorker,
}

fn main() -> Result<ExitCode> {
    match Cli::parse().cmd {
        Cmd::Run {
            target,
            common,
            hang_secs,
            max_crashes,
            corpus,
        } => {
            let limits = (Duration::from_secs(hang_secs), max_crashes);
            run(&target, &common, limits, corpus)
        }
        Cmd::Repro {
            target,
            file,
            vocab_gguf,
        } => {
            let input = std::fs::read(&file).with_context(|| file.display().to_string())?;
            let config = TargetConfig {
                vocab: vocab_gguf,
                template_worker: Some(template_worker()?),
                ..TargetConfig::new(std::env::temp_dir())
            };
            let mut t = target_by_name(&target, &config)?;
            match run_one(t.as_mut(), &input) {
                Ok(outcome) => {
                    println!("ok: {outcome}");
                    Ok(ExitCode::SUCCESS)
                }
                Err(f) => {
                    println!("{}: {}", f.kind.name(), f.message);
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Cmd::Seeds { dir } => {
            let dir = dir.unwrap_or_else(|| corpus_dir("gguf"));
            for name in q4moe_fuzz::seeds::write_gguf_seeds(&dir)? {
                println!("{}", dir.join(name).display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Worker {
            target,
            common,
            corpus,
            slot,
            resume_at,
            print_outcomes,
        } => worker(
            &target,
            &common,
            (&corpus, &slot),
            (resume_at, print_outcomes),
        ),
        Cmd::TemplateWorker => {
            q4moe_tokenizer::run_template_worker()?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn run(
    target: &str,
    c: &Common,
    (hang, max_crashes): (Duration, u32),
    corpus: Option<PathBuf>,
) -> Result<ExitCode> {
    let targets: Vec<&str> = match target {
        "all" => TARGET_NAMES.to_vec(),
        one => vec![one],
    };
    anyhow::ensure!(
        corpus.is_none() || targets.len() == 1,
        "--corpus names one target's seeds"
    );
    let exe = std::env::current_exe().context("locating q4moe-fuzz")?;
    let mut failed = false;
    for t in targets {
        let campaign = Campaign {
            target: t.to_string(),
            corpus: corpus.clone().unwrap_or_else(|| corpus_dir(t)),
            execs: c.execs,
            seed: c.seed,
            out_dir: c.out.clone(),
            hang,
            slow: c.slow_ms.map(Duration::from_millis),
            mem_cap_mb: c.mem_cap_mb,
            vocab: c.vocab_gguf.clone(),
            max_crashes,
        };
        let report = supervise(&exe, &campaign)?;
        println!("{}", report.summary());
        for (class, n) in &report.classes {
            println!("  outcome class {class:?}: {n}");
        }
        for f in &report.failures {
            println!("  {f}");
        }
        failed |= !report.failures.is_empty();
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn worker(
    target: &str,
    c: &Common,
    (corpus, slot): (&std::path::Path, &std::path::Path),
    (resume_at, print_outcomes): (u64, bool),
) -> Result<ExitCode> {
    q4moe_fuzz::supervise::no_core_dumps();
    let mut t = target_by_name(target, &c.target_config(c.out.clone())?)?;
    let seeds = load_corpus(corpus)?;
    let mut slot = Slot::open(slot)?;
    alloc::set_cap(c.mem_cap_mb << 20);
    let opts = Options {
        execs: c.execs,
        resume_at,
        seed: c.seed,
        out_dir: Some(c.out.clone()),
        slow: c.slow_ms.map(Duration::from_millis),
        print_outcomes,
        ..Options::default()
    };
    let report = Fuzzer::new(t.as_mut(), seeds).run(&opts, |i, input| slot.record(i, input))?;
    let failures: Vec<_> = report
        .failures
        .iter()
        .map(|f| {
            serde_json::json!({
                "kind": f.kind.name(),
                "file": f.file.as_ref().map(|p| p.display().to_string()),
                "message": f.message,
            })
        })
        .collect();
    let json = serde_json::json!({
        "execs": report.execs,
        "failing_execs": report.failing_execs,
        "outcomes": report.outcomes,
        "corpus": report.corpus,
        "classes": report.classes,
        "failures": failures,
    });
    println!("{REPORT_PREFIX}{json}");
    Ok(ExitCode::SUCCESS)
}
