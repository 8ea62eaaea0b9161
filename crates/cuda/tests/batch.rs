//! The CUDA batched decode step (`Backend::step_batch`, batch.rs): the batch-invariance gate
//! (a sequence's logits bit-identical alone, as the only row, or in any batch, any slot, with
//! companions joining and leaving, with the setup cache on or off), its logits against the CPU's within 2e-3 of the largest
//! |logit| (the bound of tests/parity.rs), refused steps, and more rows than one submission
//! takes. Bodies shared with the CPU (crates/cpu/tests/shared/batch.rs). Every test needs a
//! CUDA GPU and is ignored by default: `cargo test -p q4moe-cuda --release --test batch --
//! --include-ignored`.

#[path = "../../cpu/tests/shared/mod.rs"]
mod shared;

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_cuda::{CudaBackend, CudaOptions, KvType};
use q4moe_model::backend::Backend;
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};
use shared::batch::{self as body, AloneBy, Lcg};

fn require_gpu() {
    if let Err(why) = q4moe_cuda::cuda_available() {
        panic!("this test needs a CUDA GPU: {why}");
    }
}

fn model(cfg: &Config, q: SynthQuant, dir: &tempfile::TempDir) -> Arc<Model> {
    let path = dir.path().join(format!("m-{}-{q:?}.gguf", cfg.d_model));
    synth::write(&path, cfg, q, 23, false).unwrap();
    Arc::new(Model::load(&path).unwrap())
}

fn cuda(m: &Arc<Model>, cap: usize, prefill_chunk: usize) -> CudaBackend {
    let opts = CudaOptions {
        kv_capacity: cap,
        prefill_chunk,
        batched_step: true,
        ..CudaOptions::default()
    };
    let b = CudaBackend::new(m.clone(), opts).unwrap();
    assert!(b.info().batched_step, "the geometry has batched kernels");
    b
}

/// The gate and the CPU comparison on one geometry and quant: for 1 to 9 sequences, together
/// and staggered, bit for bit against each alone; then 6 staggered sequences against the
/// CPU's `decode`.
fn check(cfg: Config, q: SynthQuant) {
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let m = model(&cfg, q, &dir);
    let mut gpu = cuda(&m, 256, 1024);
    let tag = format!("{q:?} d_model {}", cfg.d_model);
    body::invariance(&mut gpu, cfg.vocab_size, 9, AloneBy::BatchOfOne, &tag);
    // The setup cache off (launches one by one) gives what its graphs give, bit for bit.
    let mut rng = Lcg(5);
    let seqs = body::random_seqs(&mut rng, 5, cfg.vocab_size, true);
    let refs = body::alone_all(&mut gpu, &seqs, AloneBy::BatchOfOne);
    gpu.set_setup_cache(false);
    body::check_scenario(
        &mut gpu,
        &seqs,
        &refs,
        &mut rng,
        0.0,
        &format!("{tag}, cache off"),
    );
    gpu.set_setup_cache(true);
    let mut cpu = CpuBackend::with_precision(m, 256, Precision::Exact).with_kv_type(KvType::F16);
    let mut rng = Lcg(11);
    let seqs = body::random_seqs(&mut rng, 6, cfg.vocab_size, true);
    let refs = body::alone_all(&mut cpu, &seqs, AloneBy::Decode);
    let worst = body::check_scenario(&mut gpu, &seqs, &refs, &mut rng, 2e-3, &tag);
    eprintln!("{tag}: batched CUDA logits vs the CPU's: largest relative error {worst:.2e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_q4_0() {
    check(Config::tiny(), SynthQuant::Q4_0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_q4_k_m() {
    check(Config::tiny(), SynthQuant::Q4_K_M);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_q4_0() {
    check(Config::mid(), SynthQuant::Q4_0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_q4_k_m() {
    check(Config::mid(), SynthQuant::Q4_K_M);
}

/// Qwen3-30B-A3B's attention shape (head_dim 128, 8 query heads a KV head), whose batched step
/// attends on tensor cores (bt_attn_gqa_tc) over the f16 cache.
fn qwen3_attention() -> Config {
    Config {
        n_head: 32,
        n_kv_head: 4,
        ..Config::mid()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_q4_0_qwen3_attention() {
    check(qwen3_attention(), SynthQuant::Q4_0);
}

/// Rows of up to 300 positions with no tiles staged (attn_stage 0), so on tensor cores a row's
/// context splits over up to 3 blocks a KV head that merge, beside rows one block holds: each
/// row bit for bit as alone, and within the tolerance of the CPU's decode.
#[test]
#[ignore = "needs a CUDA GPU"]
fn qwen3_attention_long_rows_split_and_merge() {
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let cfg = qwen3_attention();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    let opts = CudaOptions {
        kv_capacity: 512,
        prefill_chunk: 1024,
        batched_step: true,
        attn_stage: Some(0),
        ..CudaOptions::default()
    };
    let mut gpu = CudaBackend::new(m.clone(), opts).unwrap();
    let mut rng = Lcg(29);
    let seqs: Vec<body::Seq> = [300, 7, 170, 129, 33]
        .iter()
        .map(|&len| body::Seq {
            prompt: (0..len).map(|_| rng.next(cfg.vocab_size) as u32).collect(),
            join: rng.next(3),
            steps: 4,
        })
        .collect();
    let refs = body::alone_all(&mut gpu, &seqs, AloneBy::BatchOfOne);
    body::check_scenario(&mut gpu, &seqs, &refs, &mut rng, 0.0, "long rows");
    let mut cpu = CpuBackend::with_precision(m, 512, Precision::Exact).with_kv_type(KvType::F16);
    let refs = body::alone_all(&mut cpu, &seqs, AloneBy::Decode);
    let worst = body::check_scenario(&mut gpu, &seqs, &refs, &mut rng, 2e-3, "long rows, CPU");
    eprintln!("long rows: batched CUDA logits vs the CPU's: largest relative error {worst:.2e}");
}

/// Across the switch from the few-token kernels (bt_mma, whose gate-and-up launch quantises
/// silu(gate) * up itself, and bt_route) to pf_mma (with pf_quant, pf_route, pf_lists and
/// pf_tiles): with `few_tokens` 3, batches of 1 to 7 sequences put a sequence on either side,
/// and each gives what it gives alone (a batch of one, the few-token side), bit for bit; on
/// both quants.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_few_token_kernels_and_pf_mma_give_the_same_bits() {
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let cfg = qwen3_attention();
    for q in [SynthQuant::Q4_0, SynthQuant::Q4_K_M] {
        let m = model(&cfg, q, &dir);
        let opts = CudaOptions {
            kv_capacity: 256,
            prefill_chunk: 1024,
            batched_step: true,
            few_tokens: 3,
            ..CudaOptions::default()
        };
        let mut gpu = CudaBackend::new(m, opts).unwrap();
        let tag = format!("{q:?}, few_tokens 3");
        body::invariance(&mut gpu, cfg.vocab_size, 7, AloneBy::BatchOfOne, &tag);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn refused_steps_change_no_session() {
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::tiny();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    body::refused_steps_change_no_session(&mut cuda(&m, 8, 1024), cfg.vocab_size);
}

/// More rows than one submission takes (a prefill chunk of 32 rows: 3 submissions for 70
/// rows) give each row what it gives alone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn more_rows_than_a_submission() {
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::tiny();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    let mut gpu = cuda(&m, 64, 32);
    let mut rng = Lcg(3);
    let seqs = body::random_seqs(&mut rng, 70, cfg.vocab_size, false);
    let refs = body::alone_all(&mut gpu, &seqs, AloneBy::BatchOfOne);
    body::check_scenario(&mut gpu, &seqs, &refs, &mut rng, 0.0, "70 rows, chunk 32");
}

/// A forked session (a device copy of another's prefix) continues as one that prefilled the
/// prefix itself, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fork_continues_as_prefilled() {
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::tiny();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    body::fork_continues_as_prefilled(&mut cuda(&m, 64, 1024), cfg.vocab_size);
}

/// A session whose KV grows (CudaOptions::kv_grow_from 4: 4, 8, .. positions, each growth a
/// copy into a larger allocation) gives the bits of one holding its whole capacity from the
/// start: a prefill's logits, a greedy and a sampled decode on the device, a fork, and batched
/// steps; and it holds the bytes of what it has grown to, not of the capacity.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_growing_kv_gives_the_whole_capacitys_bits() {
    use q4moe_model::backend::{BatchOut, BatchRow, DecodeRequest, Flow, Logits};
    use q4moe_model::sampling::{Sampler, SamplingParams};
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::tiny();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    let backend = |from: usize| {
        let opts = CudaOptions {
            kv_capacity: 256,
            kv_grow_from: from,
            batched_step: true,
            ..CudaOptions::default()
        };
        CudaBackend::new(m.clone(), opts).unwrap()
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut rng = Lcg(17);
    let prompt: Vec<u32> = (0..37).map(|_| rng.next(cfg.vocab_size) as u32).collect();
    let short: Vec<u32> = prompt[..5].to_vec();
    let greedy = SamplingParams::greedy();
    let sampled = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        seed: 5,
        ..Default::default()
    };
    let run = |b: &mut CudaBackend| {
        let mut seen = Vec::new();
        let lg = b.prefill(1, &prompt[..36], Logits::All).unwrap();
        seen.push(bits(&lg));
        for (sampling, n) in [(&greedy, 60), (&sampled, 40)] {
            let first = *prompt.last().unwrap();
            let req = DecodeRequest {
                session: 1,
                first_token: first,
                max_tokens: n,
                sampling,
                history: &prompt,
                want_logits: false,
            };
            let mut toks = Vec::new();
            b.decode(&req, &mut |ev| {
                toks.push(ev.token);
                Flow::Continue
            })
            .unwrap();
            seen.push(toks);
            b.truncate(1, 36);
        }
        b.fork(1, 2, 30).unwrap();
        b.prefill(3, &short, Logits::None).unwrap();
        let bytes3 = b.kv_bytes(3);
        let mut samplers: Vec<Sampler> =
            (0..3).map(|_| Sampler::new(greedy.clone(), &[])).collect();
        let mut next = [prompt[36], prompt[30], prompt[4]];
        let mut out = BatchOut::default();
        for _ in 0..20 {
            let mut rows: Vec<BatchRow<'_>> = samplers
                .iter_mut()
                .zip(next)
                .enumerate()
                .map(|(i, (s, token))| BatchRow {
                    session: [1, 2, 3][i],
                    token,
                    sampler: Some(s),
                    logits: true,
                })
                .collect();
            b.step_batch(&mut rows, &mut out).unwrap();
            seen.push(bits(&out.logits));
            for (i, t) in out.tokens.iter().enumerate() {
                next[i] = t.unwrap();
            }
        }
        (seen, bytes3)
    };
    let (grown, grown_bytes) = run(&mut backend(4));
    let (whole, whole_bytes) = run(&mut backend(256));
    assert_eq!(grown.len(), whole.len());
    for (i, (g, w)) in grown.iter().zip(&whole).enumerate() {
        assert!(
            g == w,
            "record {i} differs between a growing KV and a whole one"
        );
    }
    // Session 3 holds 5 positions: a KV of 8 against one of 256.
    assert_eq!(
        grown_bytes * 32,
        whole_bytes,
        "{grown_bytes} against {whole_bytes}"
    );
}

/// `kv_pool_bytes` bounds every session's KV together: a prefill, a batched step or a fork that
/// would grow past it is refused with KvFull and changes nothing; once a session is dropped the
/// same work runs, with the bits of an unbounded backend.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_kv_pool_bounds_every_sessions_kv() {
    use q4moe_model::backend::{BackendError, Logits};
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::tiny();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    let backend = |pool: usize| {
        let opts = CudaOptions {
            kv_capacity: 256,
            kv_grow_from: 16,
            kv_pool_bytes: pool,
            batched_step: true,
            ..CudaOptions::default()
        };
        CudaBackend::new(m.clone(), opts).unwrap()
    };
    let mut free = backend(usize::MAX);
    assert!(free.kv_pool().is_none(), "no bound, no pool");
    let mut rng = Lcg(29);
    let prompt: Vec<u32> = (0..40).map(|_| rng.next(cfg.vocab_size) as u32).collect();
    free.prefill(1, &prompt[..20], Logits::None).unwrap();
    let one = free.kv_bytes(1); // 32 positions (16 doubled)
                                // Room for 64 positions in all.
    let mut b = backend(2 * one);
    let pool = b.kv_pool().unwrap();
    assert_eq!((pool.capacity_bytes, pool.used_bytes), (2 * one, 0));
    b.prefill(1, &prompt[..20], Logits::None).unwrap();
    assert_eq!(
        b.kv_needed(2, 40),
        2 * one,
        "a new session of 40 positions: 64 of them"
    );
    let err = b.prefill(2, &prompt, Logits::None).unwrap_err();
    assert!(
        matches!(err, BackendError::KvFull { session: 2, .. }),
        "{err}"
    );
    assert_eq!(
        (b.kv_len(2), b.kv_bytes(2)),
        (0, 0),
        "a refused prefill holds nothing"
    );
    b.prefill(2, &prompt[..10], Logits::None).unwrap();
    assert!(matches!(b.fork(1, 3, 20), Err(BackendError::KvFull { .. })));
    let step = body::step_bits;
    // Session 1 at 32 positions must double to 64 for its next: the step is refused whole.
    b.prefill(1, &prompt[20..32], Logits::None).unwrap();
    assert_eq!(b.kv_len(1), 32);
    let err = step(&mut b, &[(2, 7), (1, 9)]).unwrap_err();
    assert!(matches!(err, BackendError::KvFull { .. }), "{err}");
    assert_eq!(
        (b.kv_len(1), b.kv_len(2)),
        (32, 10),
        "a refused step changes no session"
    );
    b.drop_session(2);
    free.prefill(1, &prompt[20..32], Logits::None).unwrap();
    assert!(step(&mut b, &[(1, 9)]).unwrap() == step(&mut free, &[(1, 9)]).unwrap());
}
