//! Logprobs on the CPU over the tiny synthetic model: each token's logprob is the log-softmax of
//! the logits the backend returned for its step, the prompt's come from a prefill's every
//! position, and the continuous batch reports what `generate` reports.

use std::sync::{Arc, Mutex};

use q4moe_engine::{
    BatchOptions, Batcher, Flow, GenerateOutput, GenerateRequest, LogprobOptions, Piece,
    SamplingParams, SequenceSink, TokenLogprob,
};
use q4moe_model::backend::Logits;
use q4moe_model::synth::SynthQuant;

mod common;
use common::tiny_engine;

/// The log-softmax of `logits` at `token`, in f64 the plain way.
fn reference(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    logits[token as usize] as f64 - max - sum.ln()
}

fn request(top: usize, prompt: bool) -> GenerateRequest {
    let mut req = GenerateRequest::new(vec![3, 17, 42, 7, 99, 5], 8);
    req.stop_at_eos = false;
    req.want_logits = true;
    req.logprobs = Some(LogprobOptions { top, prompt });
    req
}

#[test]
fn each_token_logprob_is_the_log_softmax_of_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let req = request(5, false);
    let mut streamed: Vec<TokenLogprob> = Vec::new();
    let out = engine
        .generate_pieces(&req, &mut |p| {
            if let Piece::Text { logprobs, .. } = p {
                streamed.extend_from_slice(logprobs);
            }
            Flow::Continue
        })
        .unwrap();
    assert_eq!(out.logprobs.len(), out.tokens.len());
    assert_eq!(out.logits.len(), out.tokens.len());
    assert!(out.prompt_logprobs.is_empty());
    for ((lp, logits), &t) in out.logprobs.iter().zip(&out.logits).zip(&out.tokens) {
        assert_eq!(lp.token, t);
        let want = reference(logits, t);
        assert!(
            (lp.logprob.unwrap() as f64 - want).abs() < 1e-5,
            "{lp:?} vs {want}"
        );
        // Greedy: the chosen token is the best, and the list is sorted best first.
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0].0, t);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{:?}", lp.top);
        for &(id, v) in &lp.top {
            assert!((v as f64 - reference(logits, id)).abs() < 1e-5);
        }
    }
    // The pieces carried every token's logprob, the ones without text included.
    assert_eq!(streamed, out.logprobs);
}

#[test]
fn prompt_logprobs_come_from_every_position_of_a_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    // A short prompt, and one longer than a prompt-logits chunk.
    let long: Vec<u32> = (0..150).map(|i| (i * 37 + 11) % 1000).collect();
    for prompt in [request(2, true).prompt, long] {
        let mut req = request(2, true);
        req.prompt = prompt;
        check_prompt_logprobs(&mut engine, &req);
    }
}

fn check_prompt_logprobs(engine: &mut q4moe_engine::Engine, req: &GenerateRequest) {
    let vocab = engine.model.config.vocab_size;
    let all = engine
        .backend_mut()
        .prefill(1 << 40, &req.prompt, Logits::All)
        .unwrap();
    engine.backend_mut().drop_session(1 << 40);
    // Twice: the second run could reuse the first's KV, but prompt logprobs need the prefill.
    for _ in 0..2 {
        let mut prompt_piece = Vec::new();
        let out = engine
            .generate_pieces(req, &mut |p| {
                if let Piece::Prompt(lps) = p {
                    prompt_piece = lps.to_vec();
                }
                Flow::Continue
            })
            .unwrap();
        assert_eq!(out.cached_tokens, 0);
        let lps = &out.prompt_logprobs;
        assert_eq!(lps, &prompt_piece);
        assert_eq!(lps.len(), req.prompt.len());
        assert_eq!((lps[0].token, lps[0].logprob), (req.prompt[0], None));
        for (i, lp) in lps.iter().enumerate().skip(1) {
            assert_eq!(lp.token, req.prompt[i]);
            let want = reference(&all[(i - 1) * vocab..i * vocab], req.prompt[i]);
            assert!((lp.logprob.unwrap() as f64 - want).abs() < 1e-5);
            assert_eq!(lp.top.len(), 2);
        }
    }
}

struct Keep(Arc<Mutex<Option<GenerateOutput>>>);

impl SequenceSink for Keep {
    fn piece(&mut self, _: Piece<'_>) -> Flow {
        Flow::Continue
    }
    fn cancelled(&self) -> bool {
        false
    }
    fn finished(self: Box<Self>, result: q4moe_engine::Result<GenerateOutput>) {
        *self.0.lock().unwrap() = Some(result.unwrap());
    }
}

#[test]
fn the_batch_reports_what_generate_reports_and_applies_the_bias() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let mut req = request(3, true);
    let alone = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
    // A prefill budget smaller than the prompt: its logprobs come in chunks.
    let opts = BatchOptions {
        max_batch: 4,
        prefill_budget: 2,
    };
    let run = |engine: &mut _, req: &GenerateRequest| {
        let mut batch = Batcher::new(opts).unwrap();
        let slot = Arc::new(Mutex::new(None));
        batch.admit(engine, req.clone(), Box::new(Keep(slot.clone())));
        while !batch.is_empty() {
            batch.step(engine);
        }
        let out = slot.lock().unwrap().take().unwrap();
        out
    };
    let batched = run(&mut engine, &req);
    assert_eq!(batched.tokens, alone.tokens);
    assert_eq!(batched.logprobs, alone.logprobs);
    assert_eq!(batched.prompt_logprobs, alone.prompt_logprobs);
    // -100 on the greedy first token moves the choice, on both paths alike.
    req.sampling = SamplingParams {
        logit_bias: vec![(alone.tokens[0], -100.0)],
        ..SamplingParams::greedy()
    };
    let biased = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
    assert_ne!(biased.tokens[0], alone.tokens[0]);
    assert_eq!(run(&mut engine, &req).tokens, biased.tokens);
    // The logprob stays the model's (raw logits), whatever the bias.
    assert_eq!(biased.logprobs[0].top, alone.logprobs[0].top);
}

/// On CUDA: logprobs come from the device's logits, and a logit bias (which the device
/// sampler cannot apply) sends the choice to the host sampler, greedy or not.
#[test]
#[ignore = "needs a CUDA GPU"]
fn logprobs_and_logit_bias_on_cuda() {
    use q4moe_engine::{Device, Engine, EngineOptions};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let config = q4moe_model::Config::tiny();
    q4moe_model::synth::write(&path, &config, SynthQuant::Q4_0, 7, false).unwrap();
    let opts = EngineOptions {
        device: Device::Cuda,
        kv_capacity: 256,
        ..Default::default()
    };
    let mut engine = Engine::load(&path, &opts).unwrap();
    let req = request(3, true);
    let out = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
    assert_eq!(out.logprobs.len(), out.tokens.len());
    assert_eq!(out.prompt_logprobs.len(), req.prompt.len());
    for ((lp, logits), &t) in out.logprobs.iter().zip(&out.logits).zip(&out.tokens) {
        assert!((lp.logprob.unwrap() as f64 - reference(logits, t)).abs() < 1e-5);
        assert_eq!(lp.top[0].0, t);
    }
    // Without logits wanted, greedy and sampled requests would run on the device sampler.
    for temperature in [0.0, 0.8] {
        let mut req = GenerateRequest::new(req.prompt.clone(), 6);
        req.stop_at_eos = false;
        let sampling = |bias| SamplingParams {
            temperature,
            seed: 3,
            logit_bias: bias,
            ..SamplingParams::greedy()
        };
        req.sampling = sampling(vec![]);
        let plain = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
        req.sampling = sampling(vec![(plain.tokens[0], -100.0)]);
        let banned = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
        assert_ne!(
            banned.tokens[0], plain.tokens[0],
            "temperature {temperature}"
        );
        req.sampling = sampling(vec![(5, 100.0)]);
        let forced = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
        assert_eq!(forced.tokens, vec![5; 6], "temperature {temperature}");
    }
}
