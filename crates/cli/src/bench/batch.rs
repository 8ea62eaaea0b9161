//! `q4moe bench --batch 1,2,4,..`: the batched decode step (`Backend::step_batch`). For each B,
//! B sequences with distinct random prompts are prefilled, then advanced together one token a
//! step with greedy samplers; every row's tokens and its first step's logits are checked, bit for
//! bit, against the same sequence run alone through the batched step: batch invariance.

use std::time::Instant;

use anyhow::Context;
use q4moe_engine::{Backend, SamplingParams};
use q4moe_model::backend::{BackendError, BatchOut, BatchRow, Logits};
use q4moe_model::sampling::Sampler;
use q4moe_model::Model;
use serde_json::{json, Value};

use super::report::{median, stats};

/// The most sequences one step may carry here.
pub const MAX_BATCH: usize = 256;

/// Sessions of the batched bench start here, clear of the single-stream bench's.
const SESSION_BASE: u64 = 1 << 32;

/// One sequence decoded alone: its greedy tokens and its first step's logits.
pub struct Alone {
    tokens: Vec<u32>,
    first_logits: Vec<f32>,
}

/// What the batched bench needs from the command line.
pub struct BatchPlan<'a> {
    pub batch: &'a [usize],
    pub prompt_len: usize,
    pub decode_len: usize,
    pub runs: usize,
    pub seed: u64,
}

/// Row `i`'s prompt: the same for every B, so one reference serves them all.
fn prompt(plan: &BatchPlan<'_>, vocab: usize, i: usize) -> Vec<u32> {
    super::random_prompt(plan.prompt_len, vocab, plan.seed.wrapping_add(1 + i as u64))
}

/// Prefills every row's prompt but its last token (that one is the first step's input, the
/// engine's shape), returning the sessions' first tokens.
fn prefill_rows(b: &mut dyn Backend, prompts: &[Vec<u32>]) -> anyhow::Result<Vec<u32>> {
    let mut first = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let (&last, before) = p.split_last().context("the bench prompt is empty")?;
        b.prefill(SESSION_BASE + i as u64, before, Logits::None)?;
        first.push(last);
    }
    Ok(first)
}

/// Row `i` alone: the batched step with it as the only row (greedy), the invariance
/// reference. (On the CPU that is also what `decode` gives, bit for bit; on CUDA `decode` runs
/// the single-stream kernels, another path.)
fn alone(b: &mut dyn Backend, prompt: &[u32], n: usize) -> anyhow::Result<Alone> {
    let run = one_batch(b, std::slice::from_ref(&prompt.to_vec()), n)?;
    Ok(Alone {
        tokens: run.tokens.into_iter().next().unwrap_or_default(),
        first_logits: run.first_logits.into_iter().next().unwrap_or_default(),
    })
}

/// One timed run at batch size `prompts.len()`: the steps' seconds and the expert bytes each
/// read (where the backend counts them), every row's tokens and the first step's logits.
struct BatchRun {
    step_s: Vec<f64>,
    expert_bytes: Vec<Option<u64>>,
    tokens: Vec<Vec<u32>>,
    first_logits: Vec<Vec<f32>>,
}

fn one_batch(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<BatchRun, anyhow::Error> {
    let n = prompts.len();
    let mut next = prefill_rows(b, prompts)?;
    let mut samplers: Vec<Sampler> = prompts
        .iter()
        .map(|p| Sampler::new(SamplingParams::greedy(), p))
        .collect();
    let mut out = BatchOut::default();
    let mut run = BatchRun {
        step_s: Vec::with_capacity(steps),
        expert_bytes: Vec::with_capacity(steps),
        tokens: vec![Vec::with_capacity(steps); n],
        first_logits: Vec::new(),
    };
    for step in 0..steps {
        let mut rows: Vec<BatchRow<'_>> = samplers
            .iter_mut()
            .enumerate()
            .map(|(i, s)| BatchRow {
                session: SESSION_BASE + i as u64,
                token: next[i],
                sampler: Some(s),
                // The first step's logits for the invariance check; after it, tokens only,
                // as a server's greedy rows run.
                logits: step == 0,
            })
            .collect();
        let t0 = Instant::now();
        b.step_batch(&mut rows, &mut out)?;
        run.step_s.push(t0.elapsed().as_secs_f64());
        run.expert_bytes.push(out.expert_bytes);
        if step == 0 {
            run.first_logits = (0..n).map(|i| out.row(i).to_vec()).collect();
        }
        for (i, t) in next.iter_mut().enumerate() {
            *t = out.tokens[i].context("a row with a sampler came back without a token")?;
            run.tokens[i].push(*t);
        }
    }
    (0..n).for_each(|i| b.drop_session(SESSION_BASE + i as u64));
    Ok(run)
}

/// One expert's weights in every layer.
fn one_expert_bytes(m: &Model) -> u64 {
    m.layers.iter().map(|l| l.expert_bytes() as u64).sum()
}

/// Weight bytes one step reads at batch size `b` besides the experts': attention, router and
/// head once, and the token embeddings' `b` rows.
fn shared_bytes(m: &Model, b: usize) -> u64 {
    m.bytes_per_token() - m.config.n_expert_used as u64 * one_expert_bytes(m)
        + (b.saturating_sub(1) * m.token_embd.row_bytes()) as u64
}

/// Weight bytes one step reads at batch size `b`, at most: `shared_bytes` and min(b * used,
/// experts) distinct experts a layer (where the backend does not count the experts its
/// routers chose).
pub fn distinct_bytes_bound(m: &Model, b: usize) -> u64 {
    let c = &m.config;
    shared_bytes(m, b) + (b * c.n_expert_used).min(c.n_expert) as u64 * one_expert_bytes(m)
}

/// The distinct weight bytes a timed step read, on average: `shared_bytes` and the experts the
/// backend counted; None where some step was not counted.
fn distinct_bytes_counted(m: &Model, b: usize, runs: &[BatchRun]) -> Option<u64> {
    let counted: Option<Vec<u64>> = runs
        .iter()
        .flat_map(|r| {
            r.expert_bytes[1.min(r.expert_bytes.len() - 1)..]
                .iter()
                .copied()
        })
        .collect();
    let counted = counted.filter(|c| !c.is_empty())?;
    Some(shared_bytes(m, b) + counted.iter().sum::<u64>() / counted.len() as u64)
}

/// Every row's tokens equal to its sequence alone, and its first logits bit for bit.
fn invariant(run: &BatchRun, refs: &[Alone]) -> bool {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    run.tokens.iter().zip(refs).all(|(t, r)| *t == r.tokens)
        && run
            .first_logits
            .iter()
            .zip(refs)
            .all(|(l, r)| bits(l) == bits(&r.first_logits))
}

/// Every row's sequence alone (the invariance references), for the largest B of the plan, run
/// before any timed batch (so a kernel profile taken between the two holds the batches' launches
/// only); `None` where the backend has no batched step (a geometry without CUDA's batched
/// kernels), after saying so on stderr.
pub fn references(b: &mut dyn Backend, plan: &BatchPlan<'_>) -> anyhow::Result<Option<Vec<Alone>>> {
    let vocab = b.config().vocab_size;
    let most = plan.batch.iter().copied().max().unwrap_or(0);
    let mut refs = Vec::with_capacity(most);
    for i in 0..most {
        match alone(b, &prompt(plan, vocab, i), plan.decode_len) {
            Ok(r) => refs.push(r),
            Err(e) if is_unsupported(&e) => {
                eprintln!(
                    "batched decode: this backend has no batched step here ({}); skipped",
                    b.info().kind
                );
                b.drop_session(SESSION_BASE);
                return Ok(None);
            }
            Err(e) => return Err(e.context("a sequence alone through the batched step")),
        }
    }
    Ok(Some(refs))
}

/// Runs the batched bench at each B of the plan against `refs` (`references`).
pub fn run(
    b: &mut dyn Backend,
    m: &Model,
    plan: &BatchPlan<'_>,
    refs: &[Alone],
) -> anyhow::Result<Value> {
    let vocab = m.config.vocab_size;
    let mut sizes = Vec::new();
    let mut all_counted = true;
    for &size in plan.batch {
        let prompts: Vec<Vec<u32>> = (0..size).map(|i| prompt(plan, vocab, i)).collect();
        let mut runs = Vec::with_capacity(plan.runs);
        for _ in 0..plan.runs {
            let r = one_batch(b, &prompts, plan.decode_len)
                .with_context(|| format!("batched step at B = {size}"))?;
            runs.push(r);
        }
        let same = runs.iter().all(|r| invariant(r, &refs[..size]));
        let counted = distinct_bytes_counted(m, size, &runs);
        all_counted &= counted.is_some();
        let bytes = counted.unwrap_or_else(|| distinct_bytes_bound(m, size));
        let rec = size_record(size, &runs, plan.decode_len, same, bytes);
        eprintln!(
            "  B = {size:<3} {:.1} tok/s aggregate, {}",
            rec["aggregate_tok_s"]["median"]
                .as_f64()
                .unwrap_or(f64::NAN),
            verdict(same)
        );
        sizes.push(rec);
    }
    Ok(json!({
        "prompt_len": plan.prompt_len,
        "decode_len": plan.decode_len,
        "runs": plan.runs,
        "sampling": "greedy, one sampler a row",
        // Counted: the shared weights and the experts the step's routers chose, averaged over
        // the timed steps; a bound: min(B x used, experts) experts a layer.
        "distinct_bytes_are_a_bound": !all_counted,
        "sizes": sizes,
    }))
}

/// The copy bandwidth measured in the same run, and each size's weight bandwidth as a share
/// of it.
pub fn add_copy_share(batched: &mut Value, copy_gbs: f64) {
    batched["copy_gb_s"] = json!(copy_gbs);
    for s in batched["sizes"].as_array_mut().into_iter().flatten() {
        let gbs = s["weight_gb_s"].as_f64().unwrap_or(0.0);
        s["share_of_copy_bandwidth"] = json!(gbs / copy_gbs);
    }
}

fn is_unsupported(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<BackendError>(),
        Some(BackendError::Unsupported(_))
    )
}

pub fn verdict(same: bool) -> &'static str {
    if same {
        "bit-identical"
    } else {
        "DIFFERS"
    }
}

/// One batch size's figures: the steps of a run after its first (warm-up) are timed.
fn size_record(size: usize, runs: &[BatchRun], steps: usize, same: bool, bytes: u64) -> Value {
    let timed = |r: &BatchRun| r.step_s[1.min(r.step_s.len() - 1)..].to_vec();
    let secs: Vec<f64> = runs.iter().map(|r| timed(r).iter().sum()).collect();
    let counted = timed(&runs[0]).len() as f64;
    let agg: Vec<f64> = secs.iter().map(|s| size as f64 * counted / s).collect();
    let per_seq: Vec<f64> = agg.iter().map(|a| a / size as f64).collect();
    let step_ms: Vec<f64> = secs.iter().map(|s| 1e3 * s / counted).collect();
    let gbs = bytes as f64 / (median(&step_ms) / 1e3) / 1e9;
    json!({
        "batch": size,
        "decode_steps": steps,
        "aggregate_tok_s": stats(&agg),
        "per_sequence_tok_s": stats(&per_seq),
        "step_ms": stats(&step_ms),
        "distinct_weight_bytes_per_step": bytes,
        "weight_gb_s": gbs,
        "invariance": verdict(same),
        "bit_identical_to_alone": same,
    })
}
