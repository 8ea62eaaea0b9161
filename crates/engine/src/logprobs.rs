//! Log-probabilities of chosen tokens (OpenAI's `logprobs` / `top_logprobs`, `echo`'s prompt
//! logprobs). A token's logprob is the log-softmax of the raw logits the backend returned for
//! its step: before the logit bias, the penalties and the temperature, so it describes the
//! model, not the sampler's settings (as llama-server and vLLM's default report it).

/// Prompt positions whose logits one prefill returns when the prompt's logprobs are wanted:
/// each is `vocab` floats (600 KB for Qwen3's 151,936), so a long prompt goes in bounded chunks.
pub const PROMPT_LOGITS_CHUNK: usize = 64;

/// What a request asks for beside its tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogprobOptions {
    /// The most likely alternatives to report at each step, 0 to `MAX_TOP`.
    pub top: usize,
    /// The prompt's tokens too (`echo`): the prompt is prefilled with every position's logits
    /// and without prefix reuse, since a reused prefix has no logits to give.
    pub prompt: bool,
}

impl LogprobOptions {
    /// OpenAI's bound on `top_logprobs`.
    pub const MAX_TOP: usize = 20;
}

/// One token's log-probability and the most likely tokens at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    /// `None` for a prompt's first token, which nothing predicts.
    pub logprob: Option<f32>,
    /// The `top` most likely ids and their logprobs, best first (lower id first on ties).
    pub top: Vec<(u32, f32)>,
}

/// What a generation hands its caller as it goes.
#[derive(Debug, Clone, Copy)]
pub enum Piece<'a> {
    /// The prompt's logprobs (with `LogprobOptions::prompt`), once, before any text.
    Prompt(&'a [TokenLogprob]),
    /// Text as it becomes safe to show, with the logprobs of the tokens accepted since the last
    /// piece (empty unless asked for). Every generated token's logprob is handed over: those
    /// whose text never shows (an end-of-sequence id, a stop string) go with the last piece,
    /// whose text may be empty. A cancelled sequence hands over no more.
    Text {
        text: &'a str,
        logprobs: &'a [TokenLogprob],
    },
}

/// The log-sum-exp of `logits` in f64 (NaN entries count as minus infinity).
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| (v as f64 - max).exp())
        .sum();
    max + sum.ln()
}

/// `token`'s logprob under `logits` and the `top` best ids at that step.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    let lp = |v: f32| (v as f64 - lse) as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&v| lp(v));
    TokenLogprob {
        token,
        logprob: Some(logprob),
        top: top_ids(logits, top)
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

/// The `k` largest entries' ids, best first, the lower id first on ties; NaN never chosen.
/// One pass keeping a sorted list of k (k is at most 20).
fn top_ids(logits: &[f32], k: usize) -> Vec<u32> {
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() || (best.len() == k && v <= logits[best[k - 1] as usize]) {
            continue;
        }
        // Strictly greater goes first: an equal value keeps the lower id ahead.
        let at = best.partition_point(|&j| logits[j as usize] >= v);
        best.insert(at, i as u32);
        best.truncate(k);
    }
    best
}

/// The prompt's logprobs from a prefill's every-position logits: `logits` is
/// `[positions, vocab]` for `prompt[start..start + positions]`, and row j predicts
/// `prompt[start + j + 1]`.
pub fn prompt_logprobs(
    prompt: &[u32],
    start: usize,
    logits: &[f32],
    vocab: usize,
    top: usize,
) -> Vec<TokenLogprob> {
    logits
        .chunks_exact(vocab)
        .zip(&prompt[start + 1..])
        .map(|(row, &t)| token_logprob(row, t, top))
        .collect()
}

/// The prompt's first token: nothing predicts it.
pub fn first_prompt_token(prompt: &[u32]) -> Vec<TokenLogprob> {
    prompt
        .first()
        .map(|&token| TokenLogprob {
            token,
            logprob: None,
            top: Vec::new(),
        })
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_stable_log_softmax() {
        // Large logits would overflow a naive exp in f32.
        let logits = [1000.0f32, 999.0, 998.0, f32::NAN];
        let z = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
        let t = token_logprob(&logits, 1, 2);
        assert!((t.logprob.unwrap() as f64 - (-1.0 - z.ln())).abs() < 1e-6);
        assert_eq!(t.top.len(), 2);
        assert_eq!(t.top[0].0, 0);
        assert_eq!(t.top[1].0, 1);
        assert!((t.top[0].1 as f64 + z.ln()).abs() < 1e-6);
        let total: f64 = [0u32, 1, 2]
            .iter()
            .map(|&i| (token_logprob(&logits, i, 0).logprob.unwrap() as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn top_ids_order_best_first_lower_id_on_ties() {
        let logits = [0.5f32, 2.0, 2.0, -1.0, 3.0, f32::NAN];
        assert_eq!(top_ids(&logits, 3), vec![4, 1, 2]);
        assert_eq!(top_ids(&logits, 10), vec![4, 1, 2, 0, 3]);
        assert!(top_ids(&logits, 0).is_empty());
    }

    #[test]
    fn prompt_rows_predict_the_next_token() {
        let vocab = 3;
        // Row 0 predicts prompt[2] (start 1), row 1 prompt[3].
        let logits = [0.0f32, 5.0, 0.0, 0.0, 0.0, 5.0];
        let lps = prompt_logprobs(&[9, 9, 1, 2], 1, &logits, vocab, 1);
        assert_eq!(lps.len(), 2);
        assert_eq!((lps[0].token, lps[1].token), (1, 2));
        assert!(lps.iter().all(|l| l.logprob.unwrap() > -0.02));
        assert_eq!(first_prompt_token(&[7])[0].logprob, None);
        assert!(first_prompt_token(&[]).is_empty());
    }
}
