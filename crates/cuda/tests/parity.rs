//! The CUDA backend against the CPU backend on synthetic models: logits within 2e-3 of the
//! largest |logit|, identical greedy streams, setup cache on/off and in-flight 1/2 identical,
//! and a stop found late leaves the KV as the contract says. Every test but the last needs a CUDA
//! GPU and is ignored by default: run them on one with
//! `cargo test -p q4moe-cuda --release --test parity -- --include-ignored`.

#[path = "../../cpu/tests/shared/mod.rs"]
mod shared;

use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_cuda::{CudaBackend, CudaOptions, KvType};
use q4moe_model::backend::{Backend, DecodeRequest, Flow, Logits};
use q4moe_model::sampling::SamplingParams;
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};
use shared::rel_err;

const CAP: usize = 512;

fn model(cfg: &Config, q: SynthQuant, dir: &tempfile::TempDir) -> Arc<Model> {
    let path = dir.path().join(format!("m-{}-{q:?}.gguf", cfg.d_model));
    synth::write(&path, cfg, q, 42, false).unwrap();
    Arc::new(Model::load(&path).unwrap())
}

fn greedy(
    b: &mut dyn Backend,
    session: u64,
    first: u32,
    n: usize,
    stop_after: Option<usize>,
) -> Vec<u32> {
    let greedy = SamplingParams::greedy();
    decode(b, &request(session, first, n, &greedy, false), stop_after)
}

/// A decode of `n` tokens after `first` without history. `want_logits`: the logits come back to
/// the host, and so the CUDA backend samples there.
fn request(
    session: u64,
    first: u32,
    n: usize,
    params: &SamplingParams,
    want_logits: bool,
) -> DecodeRequest<'_> {
    DecodeRequest {
        session,
        first_token: first,
        max_tokens: n,
        sampling: params,
        history: &[],
        want_logits,
    }
}

fn decode(b: &mut dyn Backend, req: &DecodeRequest, stop_after: Option<usize>) -> Vec<u32> {
    let mut out = Vec::new();
    b.decode(req, &mut |e| {
        out.push(e.token);
        if Some(out.len()) == stop_after {
            Flow::Stop
        } else {
            Flow::Continue
        }
    })
    .unwrap();
    out
}

/// Fails the test, saying why, where no GPU is usable (these tests run only when asked).
fn require_gpu() {
    if let Err(why) = q4moe_cuda::cuda_available() {
        panic!("this test needs a CUDA GPU: {why}");
    }
}

/// The tiny geometry's Q4_0 model (its directory holds the file).
fn tiny_q4_0_model() -> (tempfile::TempDir, Config, Arc<Model>) {
    require_gpu();
    let cfg = Config::tiny();
    let dir = tempfile::tempdir().unwrap();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    (dir, cfg, m)
}

fn test_prompt(len: u32, cfg: &Config) -> Vec<u32> {
    (0..len)
        .map(|i| (i * 37 + 5) % cfg.vocab_size as u32)
        .collect()
}

/// The CPU reference over one model, its KV cache holding `kv_type` as the GPU's does.
fn cpu(m: &Arc<Model>, kv_type: KvType) -> CpuBackend {
    // The exact f32 path: the default Q8-activation path is itself ~1e-2 off (crates/cpu).
    // The same KV cache type on both: the CPU rounds what it stores as the GPU's cache does.
    CpuBackend::with_precision(m.clone(), CAP, Precision::Exact).with_kv_type(kv_type)
}

/// A CUDA backend with `opts`, its kv_capacity set to CAP.
fn cuda(m: &Arc<Model>, opts: CudaOptions) -> CudaBackend {
    let opts = CudaOptions {
        kv_capacity: CAP,
        ..opts
    };
    CudaBackend::new(m.clone(), opts).unwrap()
}

/// The CPU reference and a CUDA backend with `opts` (its kv_capacity set to CAP).
fn backends_with(m: &Arc<Model>, opts: CudaOptions) -> (CpuBackend, CudaBackend) {
    (cpu(m, opts.kv_type), cuda(m, opts))
}

fn backends(m: &Arc<Model>) -> (CpuBackend, CudaBackend) {
    backends_with(m, CudaOptions::default())
}

fn run(cfg: Config, q: SynthQuant) {
    run_with(cfg, q, CudaOptions::default());
}

fn run_with(cfg: Config, q: SynthQuant, opts: CudaOptions) {
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    run_model(&cfg, q, &model(&cfg, q, &dir), opts);
}

/// The parity checks on model `m` (geometry `cfg`, quant `q`).
fn run_model(cfg: &Config, q: SynthQuant, m: &Arc<Model>, opts: CudaOptions) {
    let prompt = test_prompt(12, cfg);
    let (mut cpu, mut gpu) = backends_with(m, opts);
    let lc = cpu.prefill(1, &prompt, Logits::All).unwrap();
    let lg = gpu.prefill(1, &prompt, Logits::All).unwrap();
    assert_eq!(lc.len(), lg.len());
    for (i, (a, b)) in lg
        .chunks(cfg.vocab_size)
        .zip(lc.chunks(cfg.vocab_size))
        .enumerate()
    {
        let e = rel_err(a, b);
        eprintln!(
            "{q:?} d_model {} position {i}: relative logit error {e:.2e}",
            cfg.d_model
        );
        assert!(e <= 2e-3, "position {i}: relative logit error {e}");
    }
    let first = q4moe_model::sampling::argmax(&lc[lc.len() - cfg.vocab_size..]);
    let want = greedy(&mut cpu, 1, first, 64, None);
    let mut streams = Vec::new();
    for (cache, fl) in [(true, 2), (false, 1), (true, 1), (false, 2)] {
        gpu.set_setup_cache(cache);
        gpu.set_in_flight(fl);
        gpu.truncate(1, prompt.len());
        streams.push(greedy(&mut gpu, 1, first, 64, None));
        assert_eq!(gpu.kv_len(1), prompt.len() + 64);
    }
    let agree = want
        .iter()
        .zip(&streams[0])
        .take_while(|(a, b)| a == b)
        .count();
    eprintln!(
        "{q:?} d_model {}: CPU and CUDA agree on {agree} of 64 greedy tokens",
        cfg.d_model
    );
    assert_eq!(
        streams[0], want,
        "CUDA greedy stream differs from the CPU's"
    );
    assert!(
        streams.iter().all(|s| *s == streams[0]),
        "setup cache / in-flight variants differ"
    );
    // A stop found late (in-flight 2) must leave the KV as if decoding ran one step at a time.
    gpu.set_in_flight(2);
    gpu.truncate(1, prompt.len());
    let short = greedy(&mut gpu, 1, first, 64, Some(10));
    assert_eq!(short, want[..10]);
    assert_eq!(gpu.kv_len(1), prompt.len() + 10);
    let more = greedy(&mut gpu, 1, short[9], 20, None);
    assert_eq!(
        more,
        want[10..30],
        "decode after a late stop continues the same stream"
    );
    // Sampled decoding on the device (temperature, top-k, top-p, min-p, seeded) draws what the
    // host sampler draws from the same (the GPU's) logits; pipelined and eager runs draw the
    // same. Not the CPU's draws: logits within rounding of the CPU's can still cross a draw's
    // boundary (one draw in 48 did with the f16 KV cache, session 15).
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.02,
        seed: 5,
        ..Default::default()
    };
    gpu.set_in_flight(2);
    gpu.set_setup_cache(true);
    gpu.truncate(1, prompt.len());
    let want = decode(&mut gpu, &request(1, first, 48, &p, true), None);
    let mut streams = Vec::new();
    for (cache, fl) in [(true, 2), (true, 1), (false, 1)] {
        gpu.set_setup_cache(cache);
        gpu.set_in_flight(fl);
        gpu.truncate(1, prompt.len());
        streams.push(decode(&mut gpu, &request(1, first, 48, &p, false), None));
    }
    assert!(want.iter().any(|&t| t != want[0]), "sampling never varied");
    assert_eq!(streams[0], want, "device sampler differs from the host's");
    assert!(
        streams.iter().all(|s| *s == want),
        "sampled variants differ"
    );
    // Penalties, greedy and sampled: the device applies them as the host sampler does to the
    // same (the GPU's) logits, so the tokens are the same. The history is the prompt and the
    // unpenalised decode's tokens many times over: the frequency penalty then pushes those
    // tokens down by tens of logits, so the penalties surely change the stream (a random model's
    // greedy tokens rarely repeat, nor come from the prompt).
    let penalised = [
        SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 1.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            repetition_penalty: 1.2,
            frequency_penalty: 0.3,
            ..p.clone()
        },
    ];
    for (i, pp) in penalised.iter().enumerate() {
        let unpenalised = SamplingParams {
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            ..pp.clone()
        };
        gpu.truncate(1, prompt.len());
        let plain = decode(&mut gpu, &request(1, first, 32, &unpenalised, false), None);
        let history: Vec<u32> = prompt
            .iter()
            .chain(plain.repeat(64).iter())
            .copied()
            .collect();
        let on = |want_logits| DecodeRequest {
            history: &history,
            ..request(1, first, 32, pp, want_logits)
        };
        gpu.truncate(1, prompt.len());
        let host = decode(&mut gpu, &on(true), None);
        gpu.truncate(1, prompt.len());
        let device = decode(&mut gpu, &on(false), None);
        assert_eq!(
            device, host,
            "penalties {i}: device differs from the host sampler"
        );
        assert_ne!(device, plain, "penalties {i} changed no token");
    }
    // A second session's prefill (batched by default: only the last token's logits) is within
    // the bound of the first's (a decode step a token), and a third's is the second's, bit for
    // bit: sessions share nothing.
    let l2 = gpu.prefill(2, &prompt, Logits::Last).unwrap();
    let e = rel_err(&l2, &lg[lg.len() - cfg.vocab_size..]);
    assert!(
        e <= 2e-3,
        "second session's prefill: relative logit error {e}"
    );
    assert_eq!(gpu.prefill(3, &prompt, Logits::Last).unwrap(), l2);
}

/// Activations past f16's range: layer 0's FFN norm scaled by 1e4, so on the tiny geometry
/// (expert rows of std 1/sqrt(d_model)) gate and up reach ~1e4, h = silu(gate) * up ~1e8, and
/// the residual after the experts about as much. Real models' activations reach 1e3-1e4; no
/// step on the path may hold them as f16 (session 44's f16 h kept such values as floats).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_activations_past_f16_range() {
    require_gpu();
    let cfg = Config::tiny();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big-h.gguf");
    synth::write(&path, &cfg, SynthQuant::Q4_0, 42, false).unwrap();
    scale_f32_tensor(&path, "blk.0.ffn_norm.weight", 1e4);
    let m = Arc::new(Model::load(&path).unwrap());
    run_model(&cfg, SynthQuant::Q4_0, &m, CudaOptions::default());
}

/// Multiplies an F32 tensor of the GGUF file at `path` by `by`, in place.
fn scale_f32_tensor(path: &std::path::Path, name: &str, by: f32) {
    use std::io::{Read, Seek, SeekFrom, Write};
    let (start, len) = {
        let f = q4moe_gguf::GgufFile::open(path).unwrap();
        let t = f.tensor(name).unwrap();
        assert_eq!(t.info.ggml_type, q4moe_gguf::GgmlType::F32, "{name}");
        (f.header.data_offset + t.info.offset, t.data.len())
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut bytes = vec![0u8; len];
    file.seek(SeekFrom::Start(start)).unwrap();
    file.read_exact(&mut bytes).unwrap();
    for v in bytes.chunks_exact_mut(4) {
        let x = f32::from_le_bytes(v.try_into().unwrap()) * by;
        v.copy_from_slice(&x.to_le_bytes());
    }
    file.seek(SeekFrom::Start(start)).unwrap();
    file.write_all(&bytes).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_q4_0() {
    run(Config::tiny(), SynthQuant::Q4_0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_q4_k_m() {
    run(Config::tiny(), SynthQuant::Q4_K_M);
}

/// The router as its own launch (CudaOptions::router_fold off, as where the fold does not
/// apply): the cluster router writes the normalised input, the experts still normalise the
/// residual themselves.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_router_unfolded() {
    for q in [SynthQuant::Q4_0, SynthQuant::Q4_K_M] {
        let opts = CudaOptions {
            router_fold: false,
            ..Default::default()
        };
        run_with(Config::tiny(), q, opts);
    }
}

/// One and three decode steps a graph replay (CudaOptions::graph_steps; the other tests run
/// the default, 4), each token read as its step publishes it: the CPU's greedy stream at
/// in-flight 1 and 2 (64 tokens: with 3, a last step a graph of its own), a stop inside a graph
/// leaving the KV as one step at a time would, the device sampler's draws.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_graph_steps() {
    for (q, graph_steps) in [
        (SynthQuant::Q4_0, 3),
        (SynthQuant::Q4_K_M, 3),
        (SynthQuant::Q4_0, 1),
    ] {
        let opts = CudaOptions {
            graph_steps,
            ..Default::default()
        };
        run_with(Config::tiny(), q, opts);
    }
}

/// Attention's grid follows the request's reach (blocks a KV head: 1 to 32 positions, 2 to 64,
/// 4 to 128): a decode keeps one grid, another reach captures the step again. Every stream is
/// the CPU's; a grid left too small would trap in attn_gqa (an error, not a silent loss).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_attention_grid_follows_the_request() {
    require_gpu();
    let cfg = Config::tiny();
    let dir = tempfile::tempdir().unwrap();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    let prompt = test_prompt(12, &cfg);
    let mut cpu = cpu(&m, KvType::default());
    let lc = cpu.prefill(1, &prompt, Logits::All).unwrap();
    let first = q4moe_model::sampling::argmax(&lc[lc.len() - cfg.vocab_size..]);
    let want = greedy(&mut cpu, 1, first, 64, None);
    let mut gpu = cuda(&m, CudaOptions::default());
    gpu.prefill(1, &prompt, Logits::All).unwrap();
    for (round, n) in [64, 16, 64].into_iter().enumerate() {
        gpu.truncate(1, prompt.len());
        let before = gpu.graph_setups();
        let got = greedy(&mut gpu, 1, first, n, None);
        let after = gpu.graph_setups();
        let what = format!("round {round}, {n} tokens: {before:?} -> {after:?}");
        eprintln!("{what}");
        assert_eq!(got, want[..n], "{what}: not the CPU's stream");
        assert_eq!(after.captures, before.captures + 1, "{what}");
    }
}

/// The f32 KV cache (--kv-type f32): the kernels compiled without KV_F16.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_kv_f32() {
    let opts = CudaOptions {
        kv_type: KvType::F32,
        ..Default::default()
    };
    run_with(Config::tiny(), SynthQuant::Q4_0, opts);
}

/// moe_gate_up's staged kernels with one block along each slot's units (CudaOptions::
/// gate_up_cols), so every block walks all of its slot's units: the walk's loop against the CPU
/// (the wide tests walk at the device's own grid, on the H200 66 of 96 units).
#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_gate_up_walks() {
    for q in [SynthQuant::Q4_0, SynthQuant::Q4_K_M] {
        let opts = CudaOptions {
            gate_up_cols: Some(1),
            ..Default::default()
        };
        run_with(Config::mid(), q, opts);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_q4_0() {
    run(Config::mid(), SynthQuant::Q4_0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_q4_k_m() {
    run(Config::mid(), SynthQuant::Q4_K_M);
}

/// Qwen3-30B-A3B's attention shape (head_dim 128, 8 query heads a KV head), which has an
/// attention kernel of its own (attention.cu attn_gqa_128_8).
#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_q4_0_qwen3_attention() {
    let cfg = Config {
        n_head: 32,
        n_kv_head: 4,
        ..Config::mid()
    };
    run(cfg.clone(), SynthQuant::Q4_0);
    let f32_kv = CudaOptions {
        kv_type: KvType::F32,
        ..Default::default()
    };
    run_with(cfg, SynthQuant::Q4_0, f32_kv);
}

/// Qwen3-30B-A3B's layer widths (d_model 2048, 8 of the experts' 768-row FFNs, head_dim 128, 8
/// query heads a KV head) on two layers: the kernel modes the full geometry takes (qkv and the
/// head at k 2048, o_proj at 4096, gate_up at 2048, down's 192 pieces a row) against the CPU.
fn wide() -> Config {
    Config {
        n_layer: 2,
        d_model: 2048,
        n_head: 32,
        n_kv_head: 4,
        n_expert: 16,
        n_expert_used: 8,
        d_ff_expert: 768,
        vocab_size: 4096,
        ..Config::mid()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wide_q4_0() {
    run(wide(), SynthQuant::Q4_0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wide_q4_k_m() {
    run(wide(), SynthQuant::Q4_K_M);
}

#[test]
fn missing_cuda_is_a_clear_error() {
    match q4moe_cuda::cuda_available() {
        Ok(name) => eprintln!("CUDA device: {name}"),
        Err(why) => assert!(!why.is_empty()),
    }
}

/// A fresh CUDA backend's prefill of `prompt` against the CPU's logits `lc` (2e-3 of the
/// largest), then its greedy stream from `first` against the CPU's `want`.
fn check_long_prompt(
    gpu: &mut CudaBackend,
    prompt: &[u32],
    lc: &[f32],
    first: u32,
    want: &[u32],
    what: &str,
) {
    let lg = gpu.prefill(1, prompt, Logits::Last).unwrap();
    let e = rel_err(&lg, lc);
    eprintln!("{what}: relative logit error {e:.2e}");
    assert!(e <= 2e-3, "{what}: relative logit error {e}");
    assert_eq!(
        greedy(gpu, 1, first, want.len(), None),
        want,
        "{what}: greedy stream differs from the CPU's"
    );
}

/// A 300-token prompt (past four 32-position attention chunks, ATT_CHUNK): the prefill's logits
/// and the greedy stream after it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_long_context() {
    let (_dir, cfg, m) = tiny_q4_0_model();
    let prompt = test_prompt(300, &cfg);
    let (mut cpu, mut gpu) = backends(&m);
    let lc = cpu.prefill(1, &prompt, Logits::Last).unwrap();
    let lg = gpu.prefill(1, &prompt, Logits::Last).unwrap();
    let e = rel_err(&lg, &lc);
    eprintln!("300-token prompt: relative logit error {e:.2e}");
    assert!(e <= 2e-3, "relative logit error {e}");
    let first = q4moe_model::sampling::argmax(&lc);
    let want = greedy(&mut cpu, 1, first, 32, None);
    gpu.truncate(1, prompt.len());
    let got = greedy(&mut gpu, 1, first, 32, None);
    assert_eq!(got, want, "greedy stream differs from the CPU's");
    // Attention blocks that walk several chunks each (5-6 of the 10-11 here), as past
    // ATT_MAX_BLOCKS chunks at long context: the running maximum / l / sums across chunks.
    let opts = CudaOptions {
        attn_max_blocks: 2,
        ..Default::default()
    };
    let what = "300-token prompt, 2 attention blocks a KV head";
    check_long_prompt(&mut cuda(&m, opts), &prompt, &lc, first, &want, what);
}

/// Qwen3-30B-A3B's attention shape past the bench's context (a 300-token prompt: 10 chunks),
/// on tensor cores (the f16 cache's default: 16-position tiles, at least 4 chunks a block, the
/// new position's rows patched in) and on the scalar kernel; with 32 blocks a KV head (tensor
/// cores: 3 active, 8 tiles = one a warp in the first two, merged; scalar: 10) and with 2 (each
/// block 5 chunks = 10 tiles: warps 0-1 take 2, the rest 1).
#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_qwen3_attention_long_context() {
    require_gpu();
    let cfg = Config {
        n_head: 32,
        n_kv_head: 4,
        ..Config::mid()
    };
    let dir = tempfile::tempdir().unwrap();
    let m = model(&cfg, SynthQuant::Q4_0, &dir);
    let prompt = test_prompt(300, &cfg);
    let mut host = cpu(&m, KvType::default());
    let lc = host.prefill(1, &prompt, Logits::Last).unwrap();
    let first = q4moe_model::sampling::argmax(&lc);
    let want = greedy(&mut host, 1, first, 16, None);
    // Tensor cores as by default (one block a KV head with staged tiles up to 256 positions,
    // which the prompt passes through; then 3 blocks a KV head) and without staging (two blocks
    // walking 5 chunks), and the scalar kernel.
    for (tc, max_blocks, stage) in [(true, 32, None), (true, 2, Some(0)), (false, 32, None)] {
        let opts = CudaOptions {
            attn_max_blocks: max_blocks,
            attn_tensor_cores: tc,
            attn_stage: stage,
            ..Default::default()
        };
        let what = format!("Qwen3 attention, 300-token prompt, tensor cores {tc}, {max_blocks} blocks a KV head, stage {stage:?}");
        check_long_prompt(&mut cuda(&m, opts), &prompt, &lc, first, &want, &what);
    }
}

/// The batched prefill (CudaOptions::prefill_chunk, prefill.rs) against the CPU: a prompt of
/// `len` tokens over several chunks (the last one short), then a second prompt in the same
/// session, whose chunks sit past the first's positions and cross an attention chunk; each's
/// last logits within 2e-3 of the CPU's, then the CPU's greedy stream.
fn run_batched_prefill(cfg: Config, q: SynthQuant, chunk: usize, len: u32) {
    let opts = CudaOptions {
        prefill_chunk: chunk,
        ..Default::default()
    };
    run_prefill(cfg, q, opts, len);
}

fn run_prefill(cfg: Config, q: SynthQuant, opts: CudaOptions, len: u32) {
    let chunk = opts.prefill_chunk;
    require_gpu();
    let dir = tempfile::tempdir().unwrap();
    let m = model(&cfg, q, &dir);
    let (mut cpu, mut gpu) = backends_with(&m, opts);
    let prompt = test_prompt(len, &cfg);
    let more: Vec<u32> = test_prompt(41, &cfg)[17..].to_vec();
    let mut last = Vec::new();
    for (i, part) in [&prompt[..], &more[..]].into_iter().enumerate() {
        let lc = cpu.prefill(1, part, Logits::Last).unwrap();
        let lg = gpu.prefill(1, part, Logits::Last).unwrap();
        let e = rel_err(&lg, &lc);
        eprintln!(
            "batched prefill, chunk {chunk}, {q:?} d_model {} prompt {i}: relative logit error {e:.2e}",
            cfg.d_model
        );
        assert!(
            lg.iter().all(|v| v.is_finite()),
            "prompt {i}: non-finite logits"
        );
        assert!(e <= 2e-3, "prompt {i}: relative logit error {e}");
        last = lc;
    }
    let first = q4moe_model::sampling::argmax(&last);
    let want = greedy(&mut cpu, 1, first, 32, None);
    assert_eq!(greedy(&mut gpu, 1, first, 32, None), want);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_prefill_tiny() {
    run_batched_prefill(Config::tiny(), SynthQuant::Q4_0, 5, 23);
    run_batched_prefill(Config::tiny(), SynthQuant::Q4_K_M, 8, 23);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_prefill_qwen3_attention() {
    let cfg = Config {
        n_head: 32,
        n_kv_head: 4,
        ..Config::mid()
    };
    run_batched_prefill(cfg, SynthQuant::Q4_K_M, 16, 23);
    run_batched_prefill(wide(), SynthQuant::Q4_0, 64, 23);
}

/// Chunks of many tokens: dense launches over several entry tiles, and experts chosen by more
/// tokens than a tile of pf_mma takes (32).
#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_prefill_long() {
    run_batched_prefill(wide(), SynthQuant::Q4_K_M, 128, 300);
    run_batched_prefill(wide(), SynthQuant::Q4_0, 256, 400);
}

/// 16 query heads a KV head (Qwen3-235B-A22B's ratio: pf_attn_tc_g16; the decode's attention
/// takes the generic kernels), over several 64-key tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_prefill_sixteen_heads_a_kv_head() {
    let cfg = Config {
        n_head: 32,
        n_kv_head: 2,
        ..Config::mid()
    };
    run_batched_prefill(cfg, SynthQuant::Q4_0, 64, 150);
}

/// The shared body (crates/cpu/tests/shared): a refused prompt leaves the session as it was;
/// the next prompt's logits within 1e-5 of a fresh backend's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn refused_prompts_leave_the_session_as_it_was() {
    let (_dir, _cfg, m) = tiny_q4_0_model();
    let mut make = || -> Box<dyn Backend> { Box::new(cuda(&m, CudaOptions::default())) };
    shared::refused_prompts_leave_the_session(&mut make, CAP, 1e-5);
}

/// The prefill a decode step a token (chunk 0), which the batched prefill replaced by default.
#[test]
#[ignore = "needs a CUDA GPU"]
fn per_token_prefill() {
    run_batched_prefill(wide(), SynthQuant::Q4_K_M, 0, 23);
}

/// The generic attention (tiny: not Qwen3's head shape) in sub-batches of 2 tokens, as a long
/// context's partials would split it (CudaOptions::prefill_part_budget).
#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_prefill_attention_sub_batches() {
    let opts = CudaOptions {
        prefill_chunk: 16,
        prefill_part_budget: 5000,
        ..Default::default()
    };
    run_prefill(Config::tiny(), SynthQuant::Q4_0, opts, 23);
}
