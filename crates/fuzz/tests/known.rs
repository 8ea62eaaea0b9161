//! The inputs under `known/`: failures the fuzzer once found (see known/README.md), kept as
//! regressions. Each runs in a supervised worker (1 GiB cap, 5 s hang limit), so a regression
//! fails cleanly instead of taking the machine's memory.

use std::process::Command;

/// Each hostile template grows an intermediate value without bound; rendered in the product's
/// template worker, each must end in a limit error, not a crash or a hang of the fuzz worker.
#[test]
fn known_template_inputs_stay_within_limits() {
    let known = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("known/template");
    let out = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_q4moe-fuzz"))
        .args([
            "run",
            "template",
            "--max-crashes",
            "4",
            "--mem-cap-mb",
            "1024",
        ])
        .args(["--hang-secs", "5", "--execs", "4", "--corpus"])
        .arg(&known)
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}");
    assert!(stdout.contains("4 executions"), "{stdout}");
    assert!(stdout.contains("0 failing"), "{stdout}");
    // Every one rendered to an error (the outcome class names no detail of which limit).
    assert!(stdout.contains("outcome class \"render\": 4"), "{stdout}");
}
