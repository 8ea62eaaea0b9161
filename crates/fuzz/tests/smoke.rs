//! CI's short run of every fuzz target (seeds plus a few hundred mutants, seconds in debug), and
//! checks that the harness itself catches each kind of failure.

use std::path::Path;
use std::process::Command;

use q4moe_fuzz::{
    corpus_dir, load_corpus, target_by_name, FailureKind, Fuzzer, Options, TargetConfig,
};
use q4moe_tokenizer::WorkerCommand;

fn smoke(name: &str, mutants: u64) {
    let scratch = tempfile::tempdir().unwrap();
    smoke_with(name, mutants, &TargetConfig::new(scratch.path()));
}

fn smoke_with(name: &str, mutants: u64, config: &TargetConfig) {
    let mut target = target_by_name(name, config).unwrap();
    let seeds = load_corpus(&corpus_dir(name)).unwrap();
    let n_seeds = seeds.len() as u64;
    let opts = Options {
        execs: n_seeds + mutants,
        seed: 1,
        ..Options::default()
    };
    let report = Fuzzer::new(target.as_mut(), seeds)
        .run(&opts, |_, _| {})
        .unwrap();
    let failures: Vec<String> = report
        .failures
        .iter()
        .map(|f| {
            format!(
                "{:?} on {:?}: {}",
                f.kind,
                String::from_utf8_lossy(&f.input),
                f.message
            )
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{}\n{}",
        report.summary(),
        failures.join("\n")
    );
    assert_eq!(report.execs, n_seeds + mutants);
    // Seeds and mutants reach several different outcomes, so the run was not vacuous.
    assert!(report.outcomes >= 4, "{}", report.summary());
    eprintln!("{}", report.summary());
}

#[test]
fn gguf_smoke() {
    smoke("gguf", 2000);
}

#[test]
fn tokenizer_smoke() {
    smoke("tokenizer", 1000);
}

#[test]
fn template_smoke() {
    smoke("template", 600);
}

/// The same through the product's template worker (run by the fuzz binary), as campaigns run.
#[test]
fn template_worker_smoke() {
    let scratch = tempfile::tempdir().unwrap();
    let config = TargetConfig {
        template_worker: Some(WorkerCommand::new(
            env!("CARGO_BIN_EXE_q4moe-fuzz"),
            &["template-worker"],
        )),
        ..TargetConfig::new(scratch.path())
    };
    smoke_with("template", 300, &config);
}

#[test]
fn request_smoke() {
    smoke("request", 5000);
}

#[test]
fn in_process_failures_are_caught_and_written() {
    let out = tempfile::tempdir().unwrap();
    let mut target = target_by_name("selftest", &TargetConfig::new(out.path())).unwrap();
    let seeds = vec![b"ok".to_vec(), b"PANIC".to_vec(), b"WRONG".to_vec()];
    let opts = Options {
        execs: 50,
        out_dir: Some(out.path().to_path_buf()),
        ..Options::default()
    };
    let report = Fuzzer::new(target.as_mut(), seeds)
        .run(&opts, |_, _| {})
        .unwrap();
    let kinds: Vec<FailureKind> = report.failures.iter().map(|f| f.kind).collect();
    assert!(kinds.contains(&FailureKind::Panic), "{kinds:?}");
    assert!(kinds.contains(&FailureKind::Property), "{kinds:?}");
    let panic = report
        .failures
        .iter()
        .find(|f| f.kind == FailureKind::Panic)
        .unwrap();
    assert!(
        panic.message.contains("selftest panic"),
        "{}",
        panic.message
    );
    assert_eq!(
        std::fs::read(panic.file.as_ref().unwrap()).unwrap(),
        b"PANIC"
    );
}

/// Runs the binary's supervisor on a one-seed corpus; returns its stdout and the reproducers.
fn supervised(seed: &[u8], extra: &[&str]) -> (bool, String, Vec<Vec<u8>>) {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    std::fs::write(corpus.join("a"), b"fine").unwrap();
    std::fs::write(corpus.join("b"), seed).unwrap();
    let out = dir.path().join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_q4moe-fuzz"))
        .args(["run", "selftest", "--execs", "20", "--max-crashes", "1"])
        .arg("--corpus")
        .arg(&corpus)
        .arg("--out")
        .arg(&out)
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    (o.status.success(), stdout, reproducers(&out))
}

fn reproducers(dir: &Path) -> Vec<Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .map(|p| std::fs::read(p).unwrap())
        .collect()
}

#[test]
fn supervisor_saves_aborts_hangs_and_runaway_allocations() {
    let (ok, stdout, files) = supervised(b"ABORT", &[]);
    assert!(!ok && stdout.contains("crash"), "{stdout}");
    assert_eq!(files, vec![b"ABORT".to_vec()]);

    let (ok, stdout, files) = supervised(b"HANG", &["--hang-secs", "1"]);
    assert!(!ok && stdout.contains("hang"), "{stdout}");
    assert_eq!(files, vec![b"HANG".to_vec()]);

    let (ok, stdout, files) = supervised(b"ALLOC", &["--mem-cap-mb", "256"]);
    assert!(
        !ok && stdout.contains(q4moe_fuzz::alloc::CAP_MESSAGE),
        "{stdout}"
    );
    assert_eq!(files, vec![b"ALLOC".to_vec()]);

    let (ok, stdout, files) = supervised(b"also fine", &[]);
    assert!(ok && stdout.contains("20 executions"), "{stdout}");
    assert!(files.is_empty());
}
