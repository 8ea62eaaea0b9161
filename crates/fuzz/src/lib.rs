//! Fuzzing that runs on stable Rust, without coverage instrumentation: seed corpora committed
//! under `crates/fuzz/corpus/<target>`, dictionary-guided mutation, and a cheap feedback signal
//! (an input whose outcome is a kind of result or error not seen before joins the corpus).
//!
//! cargo-fuzz needs a nightly toolchain and sanitizer runtimes, which CI does not have; this
//! harness needs neither, so the same targets run as a short smoke inside `cargo test` and for
//! millions of executions from the `q4moe-fuzz` binary, whose supervisor also catches aborts,
//! stack overflows, runaway allocation and hangs (see `supervise`).

pub mod alloc;
mod error;
mod fuzzer;
mod mutate;
pub mod seeds;
pub mod supervise;
pub mod targets;

pub use error::FuzzError;
pub use fuzzer::{
    load_corpus, run_one, write_reproducer, Failure, FailureKind, Fuzzer, Options, Report,
};
pub use mutate::Mutator;
pub use targets::{target_by_name, Target, TargetConfig, TARGET_NAMES};

/// Where each target's committed seed corpus lives.
pub fn corpus_dir(target: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}
