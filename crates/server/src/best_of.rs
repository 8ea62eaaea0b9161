//! `best_of` (completions): each prompt's `best_of` candidates are generated server-side, as
//! sequences of the continuous batch like `n`'s choices (candidate i samples from seed + i), and
//! the `n` with the highest mean log probability per token are returned, best first.
//!
//! The ranking is the mean, not the sum, of the chosen tokens' logprobs: OpenAI documents
//! best_of as "the one with the highest log probability per token", and a sum would favour
//! whichever candidate stopped soonest (every token only lowers it). A logprob here is the
//! log-softmax of the model's raw logits (logprobs.rs), so the ranking is the model's own
//! judgement, not one bent by temperature or penalties. Ties keep the lower candidate first.
//! Every candidate's completion tokens count in the usage, as OpenAI bills them.

use crate::errors::ApiError;
use crate::fields::{present, Obj, MAX_CHOICES};
use q4moe_engine::{LogprobOptions, TokenLogprob};

/// `best_of`: absent, `n`; else an integer in [n, MAX_CHOICES]. More candidates than choices
/// cannot be streamed (the best is known only once all are done), as OpenAI says.
pub fn parse(o: &Obj, n: usize, stream: bool) -> Result<usize, ApiError> {
    let best_of = match present(o, "best_of") {
        None => return Ok(n),
        Some(v) => match v.as_u64() {
            Some(b @ 1..) if b as usize <= MAX_CHOICES => b as usize,
            _ => {
                return Err(ApiError::invalid(
                    "best_of",
                    format!("'best_of' must be an integer in [1, {MAX_CHOICES}]"),
                ))
            }
        },
    };
    if best_of < n {
        return Err(ApiError::invalid(
            "best_of",
            format!("'best_of' ({best_of}) must be at least 'n' ({n})"),
        ));
    }
    if stream && best_of > n {
        return Err(ApiError::invalid(
            "best_of",
            "'best_of' greater than 'n' cannot be streamed: the best candidates are known only once all are done",
        ));
    }
    Ok(best_of)
}

/// The logprobs a candidate's job computes: what the client asked for, or (when candidates are
/// ranked) at least the chosen tokens', which the ranking needs.
pub fn candidate_logprobs(
    asked: Option<LogprobOptions>,
    n: usize,
    best_of: usize,
) -> Option<LogprobOptions> {
    match asked {
        None if best_of > n => Some(LogprobOptions {
            top: 0,
            prompt: false,
        }),
        other => other,
    }
}

/// The mean logprob of the generated tokens; a candidate without any ranks last.
pub fn mean_logprob(lps: &[TokenLogprob]) -> f64 {
    let values: Vec<f64> = lps
        .iter()
        .filter_map(|l| l.logprob)
        .map(f64::from)
        .collect();
    match values.len() {
        0 => f64::NEG_INFINITY,
        len => values.iter().sum::<f64>() / len as f64,
    }
}

/// Each prompt's `n` best of its `best_of` candidates (`candidates` holds them prompt by
/// prompt; `logprobs` gives a candidate's chosen tokens' logprobs), best first, with the
/// prompt's index. With `best_of == n` the order is kept.
pub fn choose<C>(
    candidates: Vec<C>,
    n: usize,
    best_of: usize,
    logprobs: impl Fn(&C) -> &[TokenLogprob],
) -> Vec<(usize, C)> {
    let best_of = best_of.max(1);
    let mut out = Vec::with_capacity(candidates.len() / best_of * n);
    let mut rest = candidates.into_iter();
    for prompt in 0.. {
        let mut group: Vec<C> = rest.by_ref().take(best_of).collect();
        if group.is_empty() {
            break;
        }
        if best_of > n {
            let score: Vec<f64> = group.iter().map(|c| mean_logprob(logprobs(c))).collect();
            let mut order: Vec<usize> = (0..group.len()).collect();
            // Stable: equal means keep the lower candidate first.
            order.sort_by(|&a, &b| score[b].total_cmp(&score[a]));
            let mut slots: Vec<Option<C>> = group.into_iter().map(Some).collect();
            group = order
                .iter()
                .take(n)
                .filter_map(|&i| slots[i].take())
                .collect();
        }
        out.extend(group.into_iter().map(|c| (prompt, c)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A candidate as the ranking sees it: its text and its tokens' logprobs.
    #[derive(Clone)]
    struct Cand(&'static str, Vec<TokenLogprob>);

    fn candidate(text: &'static str, lps: &[f32]) -> Cand {
        let lps = lps
            .iter()
            .map(|&l| TokenLogprob {
                token: 0,
                logprob: Some(l),
                top: vec![],
            })
            .collect();
        Cand(text, lps)
    }

    fn pick(cands: Vec<Cand>, n: usize, best_of: usize) -> Vec<(usize, &'static str)> {
        choose(cands, n, best_of, |c: &Cand| &c.1)
            .into_iter()
            .map(|(p, c)| (p, c.0))
            .collect()
    }

    #[test]
    fn the_highest_mean_logprob_wins_not_the_highest_sum() {
        // b's sum (-1.5) beats c's (-2.0), but c's mean (-0.5) beats b's (-1.5).
        let cands = vec![
            candidate("a", &[-3.0, -3.0]),
            candidate("b", &[-1.5]),
            candidate("c", &[-0.5, -0.5, -0.5, -0.5]),
            candidate("d", &[-0.1]),
            candidate("e", &[-2.0]),
            candidate("f", &[-0.2, -0.2]),
        ];
        // Two prompts, best_of 3, n 2.
        assert_eq!(pick(cands, 2, 3), [(0, "c"), (0, "b"), (1, "d"), (1, "f")]);
    }

    #[test]
    fn equal_counts_keep_their_order_and_ties_the_lower_candidate() {
        let cands = vec![candidate("x", &[-1.0]), candidate("y", &[-1.0])];
        assert_eq!(pick(cands.clone(), 1, 2), [(0, "x")]);
        assert_eq!(pick(cands, 2, 2), [(0, "x"), (0, "y")]);
        assert_eq!(mean_logprob(&[]), f64::NEG_INFINITY);
    }

    #[test]
    fn best_of_must_cover_n_and_not_stream() {
        let o = |v: serde_json::Value| v.as_object().unwrap().clone();
        assert_eq!(parse(&o(json!({})), 3, false).unwrap(), 3);
        assert_eq!(parse(&o(json!({"best_of": 4})), 2, false).unwrap(), 4);
        assert_eq!(parse(&o(json!({"best_of": 2})), 2, true).unwrap(), 2);
        for (body, n, stream) in [
            (json!({"best_of": 1}), 2, false),
            (json!({"best_of": 3}), 1, true),
            (json!({"best_of": 0}), 1, false),
            (json!({"best_of": "2"}), 1, false),
            (json!({"best_of": 65}), 1, false),
        ] {
            let e = parse(&o(body.clone()), n, stream).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("best_of"), "{body}");
        }
        let forced = candidate_logprobs(None, 1, 2).unwrap();
        assert_eq!((forced.top, forced.prompt), (0, false));
        assert!(candidate_logprobs(None, 2, 2).is_none());
    }
}
