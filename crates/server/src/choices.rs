//! Requests for several choices: a completion's prompts times `n` (or `best_of` candidates, of
//! which best_of.rs keeps `n`), a chat's `n`. Each choice is its own job, so its own sequence:
//! batched rows where the server runs a continuous batch, one after another where it runs jobs
//! serially. Choice `i` of a prompt samples from seed + i, so a seeded request is reproducible
//! and its choices still differ. Choices are indexed prompt first (`index = prompt * n + i`),
//! as OpenAI orders them.

use serde_json::Value;

use crate::errors::ApiError;
use crate::openai::{GenParams, Usage};
use crate::scheduler::{EngineHandle, JobPrompt, Ticket};

/// Each choice's (or candidate's) job, submitted in index order.
pub async fn submit_all(
    engine: &EngineHandle,
    prompts: &[JobPrompt],
    gen: &GenParams,
) -> Result<Vec<Ticket>, ApiError> {
    let per_prompt = gen.best_of.max(gen.n);
    let mut tickets = Vec::with_capacity(prompts.len() * per_prompt);
    let mut base = gen.clone();
    base.logprobs = crate::best_of::candidate_logprobs(gen.logprobs, gen.n, per_prompt);
    for p in prompts {
        for i in 0..per_prompt {
            let mut g = base.clone();
            g.sampling.seed = gen.sampling.seed.wrapping_add(i as u64);
            tickets.push(engine.submit(p.clone(), g).await?);
        }
    }
    Ok(tickets)
}

/// Usage across choices: each prompt's tokens once (its first choice's, `n` the choices or
/// candidates a prompt), every choice's completion tokens.
pub fn total_usage(usages: &[Usage], n: usize) -> Usage {
    let mut total = Usage::default();
    for (i, u) in usages.iter().enumerate() {
        if i % n.max(1) == 0 {
            total.prompt_tokens += u.prompt_tokens;
            total.cached_tokens += u.cached_tokens;
        }
        total.completion_tokens += u.completion_tokens;
    }
    total
}

/// Sets the one choice of a single-choice body (response or chunk) to `index`, with
/// `logprobs` where asked for (else it stays null).
pub fn set_choice(v: &mut Value, index: usize, logprobs: Option<Value>) {
    if let Some(c) = v["choices"].get_mut(0) {
        c["index"] = index.into();
        if let Some(lp) = logprobs {
            c["logprobs"] = lp;
        }
    }
}

/// Sets the index of a single-choice body's one choice, keeping its logprobs.
pub fn set_index(v: &mut Value, index: usize) {
    if let Some(c) = v["choices"].get_mut(0) {
        c["index"] = index.into();
    }
}

/// One response from each choice's single-choice body (in index order), with `usage` summed.
pub fn gather(bodies: Vec<Value>, usage: Usage) -> Value {
    let mut choices = Vec::with_capacity(bodies.len());
    let mut first = None;
    for mut b in bodies {
        if let Some(c) = b["choices"].get_mut(0) {
            choices.push(c.take());
        }
        first.get_or_insert(b);
    }
    let mut out = first.unwrap_or(Value::Null);
    out["choices"] = Value::Array(choices);
    out["usage"] = usage.json();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_counts_each_prompt_once_and_every_completion() {
        let u = |p, c| Usage {
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens: 0,
        };
        // Two prompts (5 and 7 tokens), n = 2.
        let t = total_usage(&[u(5, 1), u(5, 2), u(7, 3), u(7, 4)], 2);
        assert_eq!((t.prompt_tokens, t.completion_tokens), (12, 10));
    }

    #[test]
    fn gather_indexes_the_choices_of_single_choice_bodies() {
        let body = |text: &str| json!({ "id": "x", "choices": [{ "index": 0, "text": text, "logprobs": null }] });
        let mut a = body("a");
        let mut b = body("b");
        set_choice(&mut a, 0, None);
        set_choice(&mut b, 1, Some(json!({ "tokens": [] })));
        let g = gather(vec![a, b], Usage::default());
        assert_eq!(g["id"], "x");
        assert_eq!(g["choices"][1]["index"], 1);
        assert_eq!(g["choices"][1]["text"], "b");
        assert!(g["choices"][0]["logprobs"].is_null());
        assert_eq!(g["choices"][1]["logprobs"]["tokens"], json!([]));
        assert_eq!(g["usage"]["total_tokens"], 0);
    }
}
