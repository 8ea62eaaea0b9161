//! The CUDA backend against the CPU backend over the geometry and quant matrix (issue 55 item
//! 10): the gguf-py files of tests/fixtures/matrix (tools/gguf_matrix/README.md), which the CPU
//! test (crates/cpu/tests/matrix.rs) holds to transformers. Per point, with the CUDA options as
//! by default (the specialised kernels where the geometry has them) and as `general()` (router
//! unfolded, scalar attention, the prefill a decode step a token, moe_gate_up walking, an f32
//! cache): every prompt row's logits within 2e-3 of the largest |logit| of the CPU's exact path
//! (parity.rs's bound), and the CPU's greedy stream (up to a step the CPU's top-2 gap puts
//! within the GPU's error of a tie). The geometry and the quant types pick the
//! rest: Q8_0 and mixed-type matrices, widths past the staged kernels' and Q8_0's lack of a
//! staged mode reach the generic matvec, gate_up and down kernels. Not named matrix.rs: the CPU
//! test is, and dev/gpu-check.sh picks test binaries by name.
//!
//! Every test but the last needs a CUDA GPU and is ignored by default:
//! `cargo test -p q4moe-cuda --release --test matrix_parity -- --include-ignored --nocapture`.

#[path = "../../cpu/tests/support/mod.rs"]
mod support;

mod common;

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_cuda::{CudaBackend, CudaOptions, KvType};
use q4moe_model::backend::{Backend, DecodeRequest, Flow, Logits};
use q4moe_model::sampling::{argmax, SamplingParams};
use q4moe_model::Model;
use support::check::rel_err;

/// parity.rs's bound: f32 on both sides, other summation orders and the GPU's own f16 steps.
const TOL: f32 = 2e-3;
/// Greedy tokens compared after the prompt.
const N_GEN: usize = 32;
/// Positions a session holds (parity.rs's; every point's context is 512).
const CAP: usize = 512;

/// The general kernels where an option reaches them (options.rs).
fn general() -> CudaOptions {
    CudaOptions {
        router_fold: false,
        attn_tensor_cores: false,
        attn_stage: Some(0),
        prefill_chunk: 0,
        gate_up_cols: Some(1),
        graph_steps: 1,
        kv_type: KvType::F32,
        ..CudaOptions::default()
    }
}

/// `N_GEN` greedy tokens after `first`, and each step's top-2 gap relative to its largest
/// |logit| (where the backend hands the logits back: the CPU's).
fn greedy(b: &mut dyn Backend, first: u32, history: &[u32], logits: bool) -> (Vec<u32>, Vec<f32>) {
    let params = SamplingParams::greedy();
    let req = DecodeRequest {
        session: 1,
        first_token: first,
        max_tokens: N_GEN,
        sampling: &params,
        history,
        want_logits: logits,
    };
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    b.decode(&req, &mut |e| {
        out.push(e.token);
        if let Some(l) = e.logits {
            gaps.push(top2_gap(l));
        }
        Flow::Continue
    })
    .expect("decode");
    (out, gaps)
}

fn top2_gap(l: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in l {
        if v > a {
            (a, b) = (v, a);
        } else if v > b {
            b = v;
        }
    }
    (a - b) / l.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// One point under one set of options: prompt rows, then the greedy stream.
fn compare(name: &str, m: &Arc<Model>, prompt: &[u32], opts: CudaOptions, what: &str) {
    let vocab = m.config.vocab_size;
    let mut cpu =
        CpuBackend::with_precision(m.clone(), CAP, Precision::Exact).with_kv_type(opts.kv_type);
    let opts = CudaOptions {
        kv_capacity: CAP,
        progress: false,
        ..opts
    };
    let mut gpu = CudaBackend::new(m.clone(), opts)
        .unwrap_or_else(|e| panic!("{name} ({what}): CUDA backend: {e}"));
    let lc = cpu.prefill(1, prompt, Logits::All).expect("CPU prefill");
    let lg = gpu
        .prefill(1, prompt, Logits::All)
        .unwrap_or_else(|e| panic!("{name} ({what}): CUDA prefill: {e}"));
    let worst = lg
        .chunks(vocab)
        .zip(lc.chunks(vocab))
        .map(|(g, c)| rel_err(g, c))
        .fold(0f32, f32::max);
    let first = argmax(&lc[lc.len() - vocab..]);
    let (want, gaps) = greedy(&mut cpu, first, prompt, true);
    let (got, _) = greedy(&mut gpu, first, prompt, false);
    let agree = want.iter().zip(&got).take_while(|(a, b)| a == b).count();
    // A step whose CPU top-2 gap is within the GPU's error of a tie may go either way: the
    // streams are held equal up to the first such step (4x the prompt rows' worst error, at
    // least 1e-5; a decode step's error is of the prompt rows' size).
    let flip = 4.0 * worst.max(2.5e-6);
    let held = gaps.iter().position(|&g| g < flip).unwrap_or(N_GEN);
    eprintln!(
        "{name} ({what}): max rel logit error over {} prompt rows {worst:.2e}; greedy tokens agree on {agree} of {N_GEN}, held to {held}",
        prompt.len()
    );
    assert_eq!(lg.len(), lc.len(), "{name} ({what}): logits length");
    assert!(
        worst <= TOL,
        "{name} ({what}): relative logit error {worst:.3e} > {TOL:e}"
    );
    assert_eq!(
        got[..held],
        want[..held],
        "{name} ({what}): greedy stream differs from the CPU's before any near-tie"
    );
}

fn run(name: &str) {
    common::require_gpu();
    let p = support::matrix::load(name);
    let m = Arc::new(Model::load(&p.gguf).unwrap_or_else(|e| panic!("{name}: load: {e}")));
    let prompt = &p.golden.tokens[..p.golden.n_prompt];
    compare(name, &m, prompt, CudaOptions::default(), "default kernels");
    compare(name, &m, prompt, general(), "general kernels");
}

macro_rules! points {
    ($($name:ident),* $(,)?) => {
        const POINTS: &[&str] = &[$(stringify!($name)),*];
        $(
            #[test]
            #[ignore = "needs a CUDA GPU"]
            fn $name() {
                run(stringify!($name));
            }
        )*
    };
}

crate::matrix_points!(points);

#[test]
fn every_fixture_has_a_test() {
    support::matrix::assert_every_fixture_tested(POINTS);
}
