//! Issue 56 items 6 and 8 and issue 54 item 6: llama.cpp's flag names, one error line per
//! failure, and `bench` for people (the batched step, the markdown table, dated records).

mod common;

use common::{q4moe, synth_tiny, with_stdin};

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `-f FILE`, `-p -` (stdin) and `-p TEXT` give the same greedy text; `-t`, `-c`, `--temp`
/// and `-s` are accepted.
#[test]
fn prompt_from_a_file_or_stdin_and_llama_cpp_flag_names() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "Hello there").unwrap();
    let common = [
        "-m",
        &model,
        "-n",
        "4",
        "--device",
        "cpu",
        "--ignore-eos",
        "-t",
        "1",
        "-c",
        "64",
        "--temp",
        "0",
        "-s",
        "5",
    ];
    let from_text = q4moe(&[&["run", "-p", "Hello there"][..], &common].concat());
    assert!(from_text.status.success(), "{}", stderr_of(&from_text));
    let from_file = q4moe(&[&["run", "-f", file.to_str().unwrap()][..], &common].concat());
    assert!(from_file.status.success(), "{}", stderr_of(&from_file));
    assert_eq!(from_text.stdout, from_file.stdout);
    let from_stdin = with_stdin(&[&["run", "-p", "-"][..], &common].concat(), "Hello there");
    assert!(from_stdin.status.success(), "{}", stderr_of(&from_stdin));
    assert_eq!(from_text.stdout, from_stdin.stdout);
    let both = q4moe(&["run", "-m", &model, "-p", "x", "-f", file.to_str().unwrap()]);
    assert!(!both.status.success());
    let neither = q4moe(&["run", "-m", &model]);
    assert!(!neither.status.success());
}

/// A missing file names its path once, on one line; a directory says so (not the kernel's
/// "No such device"); a zero thread count and a missing prompt file are refused by name.
#[test]
fn each_failure_is_one_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let one_line = |args: &[&str], want: &str| {
        let out = q4moe(args);
        let e = stderr_of(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{args:?}: {e}");
        assert!(
            e.starts_with("error: ") && e.contains(want),
            "{args:?}: {e}"
        );
        e
    };
    let e = one_line(
        &[
            "run",
            "-m",
            "/nonexistent/m.gguf",
            "-p",
            "x",
            "--device",
            "cpu",
        ],
        "/nonexistent/m.gguf",
    );
    assert_eq!(e.matches("/nonexistent/m.gguf").count(), 1, "{e}");
    let d = dir.path().to_str().unwrap();
    let e = one_line(
        &["run", "-m", d, "-p", "x", "--device", "cpu"],
        "is a directory",
    );
    assert!(!e.contains("No such device"), "{e}");
    one_line(&["bench", "-m", d, "--device", "cpu"], "is a directory");
    let model = synth_tiny(dir.path());
    one_line(
        &["run", "-m", &model, "-p", "x", "--device", "cpu", "-t", "0"],
        "--threads 0",
    );
    one_line(
        &["run", "-m", &model, "-f", "/nonexistent/prompt.txt"],
        "/nonexistent/prompt.txt",
    );
    one_line(
        &["bench", "-m", &model, "--device", "cpu", "--batch", "0"],
        "--batch",
    );
}

/// The help lists `--device`'s values, gpu among them, and every flag has help text.
#[test]
fn help_documents_the_device_values_and_every_flag() {
    for cmd in ["run", "chat", "bench"] {
        let out = q4moe(&[cmd, "--help"]);
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("[possible values: auto, cpu, cuda, gpu]"),
            "{cmd}: {help}"
        );
        // clap prints a flag without help text as the bare flag on its own line.
        for line in help.lines().map(str::trim) {
            let bare = line.starts_with('-') && !line.contains("  ") && !line.ends_with(']');
            let has_own_line_help = help.contains(&format!("{line}\n          "));
            assert!(!bare || has_own_line_help, "{cmd}: no help for {line}");
        }
    }
}

/// `bench --batch`: every size bit-identical to its sequences alone on the CPU, the record in a
/// dated file with a structured geometry, and no debug quotes or GPU columns in the table.
#[test]
fn bench_batch_reports_invariance_and_a_dated_structured_record() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let outdir = dir.path().join("results");
    let out = q4moe(&[
        "bench",
        "-m",
        &model,
        "--device",
        "cpu",
        "--batch",
        "1,2,3",
        "-p",
        "5",
        "-n",
        "4",
        "-r",
        "2",
        "--json-out",
        outdir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(stdout.matches("bit-identical").count(), 3, "{stdout}");
    assert!(
        !stdout.contains("DIFFERS") && !stdout.contains("\"cpu\""),
        "{stdout}"
    );
    let files: Vec<_> = std::fs::read_dir(&outdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1);
    let name = files[0].file_name().unwrap().to_str().unwrap().to_string();
    assert!(
        name.starts_with("bench-cpu-batch-20") && name.ends_with("Z.json"),
        "{name}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    assert_eq!(r["geometry"]["n_layer"], 3);
    let sizes = r["batched"]["sizes"].as_array().unwrap();
    assert_eq!(sizes.len(), 3);
    for (s, b) in sizes.iter().zip(1..) {
        assert_eq!(s["batch"], b);
        assert_eq!(s["invariance"], "bit-identical");
        assert!(s["aggregate_tok_s"]["median"].as_f64().unwrap() > 0.0);
    }
    let b1 = sizes[0]["distinct_weight_bytes_per_step"].as_u64().unwrap();
    let b3 = sizes[2]["distinct_weight_bytes_per_step"].as_u64().unwrap();
    assert!(
        b3 > b1,
        "three rows may touch more experts than one: {b1} {b3}"
    );
}

/// `--output md`: llama-bench's table, a pp and a tg row with the thread count; the plain table
/// on the CPU has no GPU-only columns.
#[test]
fn bench_prints_llama_benchs_table_and_no_gpu_columns_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let bench = |extra: &[&str]| {
        let args = [
            &[
                "bench", "-m", &model, "--device", "cpu", "-p", "5", "-n", "4", "-r", "2", "-t",
                "1",
            ][..],
            extra,
        ]
        .concat();
        let out = q4moe(&args);
        assert!(out.status.success(), "{}", stderr_of(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let md = bench(&["-o", "md"]);
    assert!(
        md.contains("| model | size | params | backend | threads | test | t/s |"),
        "{md}"
    );
    assert!(
        md.contains("| cpu | 1 | pp5 | ") && md.contains("| cpu | 1 | tg4 | "),
        "{md}"
    );
    assert!(md.contains(" ± "), "{md}");
    let table = bench(&[]);
    assert!(
        table.contains("tok/s") && table.contains("ms/tok"),
        "{table}"
    );
    for gpu_only in ["setup %", "submit ms", "\"cpu\""] {
        assert!(!table.contains(gpu_only), "{gpu_only} in {table}");
    }
    // The share of the copy bandwidth is measured on the CPU too, in the same run.
    assert!(table.contains("% copy"), "{table}");
}

/// `bench --json-schema`: greedy decode with and without the schema, both timed, in the record;
/// a file that is not JSON is an error naming it.
#[test]
fn bench_json_schema_times_decode_with_and_without_the_schema() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path());
    let schema = dir.path().join("schema.json");
    std::fs::write(&schema, r#"{"type": "string", "minLength": 200}"#).unwrap();
    let json = dir.path().join("r.json");
    let args = |schema: &str| {
        vec![
            "bench".to_string(),
            "-m".into(),
            model.clone(),
            "--device".into(),
            "cpu".into(),
            "-p".into(),
            "5".into(),
            "-n".into(),
            "8".into(),
            "-r".into(),
            "2".into(),
            "--json-schema".into(),
            schema.into(),
            "--json-out".into(),
            json.to_str().unwrap().into(),
        ]
    };
    let a = args(schema.to_str().unwrap());
    let out = q4moe(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        stdout.contains("unconstrained") && stdout.contains("constrained /"),
        "{stdout}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for side in ["unconstrained", "constrained"] {
        let runs = r["constrained"][side]["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2, "{side}");
        assert!(runs.iter().all(|v| v.as_f64().unwrap() > 0.0), "{side}");
    }
    std::fs::write(&schema, "{not json").unwrap();
    let out = q4moe(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!out.status.success());
    let err = stderr_of(&out);
    assert!(
        err.contains("schema.json") && err.contains("not a JSON document"),
        "{err}"
    );
}
