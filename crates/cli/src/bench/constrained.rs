//! `bench --json-schema FILE`: greedy decode held to a JSON schema beside the same decode
//! unconstrained (issue 56: on CUDA a constrained request samples on the host, with the token
//! mask llguidance computes there; this measures what that costs against the device's own
//! choice). A schema the model can follow for the whole run keeps the two runs the same length,
//! e.g. `{"type": "string", "minLength": 4096}`.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context};
use q4moe_engine::{
    with_layout, Backend, Grammar, GrammarLimits, Grammars, SamplingParams, Tokenizer,
};
use q4moe_model::Model;
use serde_json::{json, Value};

use super::{one_run, random_prompt, report};

/// What `--json-schema` measures.
pub struct Plan<'a> {
    pub schema: &'a Path,
    pub prompt_len: usize,
    pub decode_len: usize,
    pub runs: usize,
    pub seed: u64,
}

/// Steady decode tok/s unconstrained and constrained, `runs` runs each (a fresh session a run).
pub fn run(b: &mut dyn Backend, model: &Model, plan: &Plan<'_>) -> anyhow::Result<Value> {
    let path = plan.schema.display();
    let text = std::fs::read_to_string(plan.schema).with_context(|| format!("{path}"))?;
    let schema: Value =
        serde_json::from_str(&text).with_context(|| format!("{path}: not a JSON document"))?;
    let tokenizer = Arc::new(Tokenizer::from_spec(&model.tokenizer)?);
    let vocab = model.config.vocab_size;
    let grammars = Grammars::new(tokenizer, vocab, GrammarLimits::default());
    let constraint = grammars
        .compile(&Grammar::JsonSchema(with_layout(schema.clone())), None)
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let prompt = random_prompt(plan.prompt_len, vocab, plan.seed);
    let constrained = SamplingParams {
        constraint: Some(constraint),
        ..SamplingParams::greedy()
    };
    let mut out = json!({ "schema": schema, "runs": plan.runs, "decode_tokens": plan.decode_len });
    let mut session = 1u64;
    for (name, sampling) in [
        ("unconstrained", SamplingParams::greedy()),
        ("constrained", constrained),
    ] {
        let mut rates = Vec::with_capacity(plan.runs);
        let mut phases = Vec::with_capacity(plan.runs);
        for _ in 0..plan.runs {
            let r = one_run(b, session, &prompt, plan.decode_len, &sampling)?;
            b.drop_session(session);
            session += 1;
            rates.push(r.steady_tok_s);
            phases.push(r.phases);
        }
        // Where a token's time goes (means over the runs' steady tokens): waiting on the
        // device, and the host's tail after it (the constrained runs' logits, mask and choice).
        let p = super::mean_phases(&phases);
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        eprintln!(
            "  {name:<14} median {:.1} tok/s; a token's wait {:.0} us, tail {:.0} us",
            report::median(&rates),
            us(p.wait),
            us(p.tail)
        );
        out[name] = report::stats(&rates);
        out[format!("{name}_phases_us")] = json!({
            "setup": us(p.setup), "submit": us(p.submit), "wait": us(p.wait), "tail": us(p.tail),
            "gpu": p.gpu.map(us),
        });
    }
    let ratio = report::median(&stats_runs(&out["constrained"]))
        / report::median(&stats_runs(&out["unconstrained"]));
    out["constrained_share"] = json!(ratio);
    Ok(out)
}

fn stats_runs(s: &Value) -> Vec<f64> {
    s["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .collect()
}
