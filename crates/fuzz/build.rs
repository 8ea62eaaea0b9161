//! Tells the tests whether `tools/qwen_vocab.py` has written the real-vocabulary fixture, so the
//! test that needs it is reported as ignored without it, never as passed.

use std::path::Path;

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("../../tests/fixtures/qwen_vocab");
    // A folder is rescanned whole: writing the fixture re-runs this script.
    println!("cargo::rerun-if-changed={}", dir.display());
    println!("cargo::rustc-check-cfg=cfg(qwen_vocab_fixture)");
    if dir.join("expected.json").is_file() && dir.join("qwen3_vocab.gguf").is_file() {
        println!("cargo::rustc-cfg=qwen_vocab_fixture");
    }
}
