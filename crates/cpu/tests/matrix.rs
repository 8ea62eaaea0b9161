//! The CPU backend against transformers over a matrix of geometries and quant mixes (issue 55
//! item 10): GGUFs written by gguf-py (tools/gguf_matrix/make_matrix.py, an independent writer,
//! not `q4moe synth`), loaded through the normal loader, with golden logits from
//! `Qwen3MoeForCausalLM` in float64 on the same dequantised weights. The points and what each
//! covers: tools/gguf_matrix/README.md.
//!
//! Per point: the file is the one the reference ran on (sha256); the loader reads the geometry
//! the script wrote (including epsilon, RoPE theta and a tied head); the tokenizer it carries
//! builds and round-trips text; then support/check.rs's checks on the exact path (f32 KV, every
//! row within TOL, every greedy token) and on the default Q8 path (f16 KV, median within
//! Q8_MEDIAN_TOL, greedy tokens up to the first step where its own teacher-forced row picks
//! another token than the reference: the Q8 error, up to ~1e-1 of the largest logit on a
//! row, exceeds these random models' top-2 gaps of a few 1e-3).

mod support;

use std::sync::Arc;

use q4moe_cpu::Precision;
use q4moe_model::backend::KvType;
use q4moe_model::Model;
use support::check::{self, Bound, Expect, Greedy, Q8_MEDIAN_TOL, TOL};
use support::matrix::Point;

/// Loads the point's file through the normal loader and checks it is the one the reference ran
/// on, with the geometry the script wrote.
fn model(p: &Point) -> Arc<Model> {
    let bytes = std::fs::read(&p.gguf).unwrap_or_else(|e| panic!("{}: {e}", p.gguf.display()));
    assert!(
        support::sha256(&bytes) == p.gguf_sha256,
        "{}: the GGUF is not the one the reference ran on; rerun tools/gguf_matrix/make_matrix.py",
        p.name
    );
    let m = Model::load(&p.gguf).unwrap_or_else(|e| panic!("{}: load: {e}", p.name));
    assert_eq!(m.config, p.config, "{}: loaded geometry", p.name);
    assert_eq!(
        m.output.range == m.token_embd.range,
        p.tied,
        "{}: tied head",
        p.name
    );
    Arc::new(m)
}

/// The tokenizer gguf-py wrote builds, and text survives encode then decode.
fn tokenizer_round_trips(p: &Point, m: &Model) {
    let t = q4moe_tokenizer::Tokenizer::from_spec(&m.tokenizer)
        .unwrap_or_else(|e| panic!("{}: tokenizer: {e}", p.name));
    let text = "The quick brown fox: fn main() { x.iter() } \u{e9}\u{4e2d}";
    let ids = t.encode(text, false).expect("encode");
    if m.tokenizer.merges.len() >= 32 {
        assert!(ids.len() < text.len(), "{}: no merge applied", p.name);
    }
    assert_eq!(t.decode(&ids, false).expect("decode"), text, "{}", p.name);
}

fn exact(name: &str) {
    let p = support::matrix::load(name);
    let m = model(&p);
    tokenizer_round_trips(&p, &m);
    let want = Expect {
        precision: Precision::Exact,
        kv_type: KvType::F32,
        bound: Bound::Max(TOL),
        greedy: Greedy::All,
    };
    check::run(&format!("{name} ({})", p.mix), &p.golden, m, want);
}

fn q8(name: &str) {
    let p = support::matrix::load(name);
    let want = Expect {
        precision: Precision::Q8,
        kv_type: KvType::F16,
        bound: Bound::Median(Q8_MEDIAN_TOL),
        greedy: Greedy::WhileForcedAgrees,
    };
    check::run(&format!("{name} ({})", p.mix), &p.golden, model(&p), want);
}

macro_rules! points {
    ($($name:ident),* $(,)?) => {
        const POINTS: &[&str] = &[$(stringify!($name)),*];
        $(
            mod $name {
                #[test]
                fn exact() {
                    super::exact(stringify!($name));
                }
                #[test]
                fn q8() {
                    super::q8(stringify!($name));
                }
            }
        )*
    };
}

crate::matrix_points!(points);

#[test]
fn every_fixture_has_a_test() {
    support::matrix::assert_every_fixture_tested(POINTS);
}
