//! `q4moe bench --prefill 128,512,2048,8192`: prompt processing alone. For each length, a
//! random prompt of that many tokens is prefilled into a fresh session (the last token's logits
//! computed, as a request's prompt is), once to warm up and then `runs` times timed.

use std::time::Instant;

use q4moe_engine::Backend;
use q4moe_model::backend::Logits;
use serde_json::{json, Value};

use super::report::{median, stats};

/// Sessions of the prefill sweep start here, clear of the other benches'.
const SESSION_BASE: u64 = 1 << 40;

pub fn run(
    b: &mut dyn Backend,
    vocab: usize,
    lens: &[usize],
    runs: usize,
    seed: u64,
) -> anyhow::Result<Value> {
    let mut sizes = Vec::new();
    let mut session = SESSION_BASE;
    for &n in lens {
        let prompt = super::random_prompt(n, vocab, seed.wrapping_add(n as u64));
        let mut secs = Vec::with_capacity(runs);
        for r in 0..=runs {
            let t0 = Instant::now();
            b.prefill(session, &prompt, Logits::Last)?;
            let s = t0.elapsed().as_secs_f64();
            b.drop_session(session);
            session += 1;
            if r > 0 {
                secs.push(s);
            }
        }
        let tok_s: Vec<f64> = secs.iter().map(|s| n as f64 / s).collect();
        eprintln!("  prefill {n:>6} tokens: {:.0} tok/s", median(&tok_s));
        sizes.push(json!({
            "tokens": n,
            "tok_s": stats(&tok_s),
            "ms": stats(&secs.iter().map(|s| s * 1e3).collect::<Vec<_>>()),
        }));
    }
    Ok(json!({
        "runs": runs,
        "what": "a fresh session's prefill of a random prompt, the last token's logits included; \
                 one warm-up run first",
        "sizes": sizes,
    }))
}
