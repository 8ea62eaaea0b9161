//! Sampling parameters and the host sampler (the reference every device sampler matches).
//! Its passes over the vocabulary run on rayon's threads: each element's weight and each fixed
//! chunk's sum are computed alone, so the draws do not depend on the thread count.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::constraint::{Constraint, TokenMask};

/// Temperature 0 means greedy (argmax, lowest id on ties).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off.
    pub min_p: f32,
    /// 1.0 = off (llama.cpp/CTRL style: divide positive logits, multiply negative ones).
    pub repetition_penalty: f32,
    /// OpenAI-style additive penalties; 0.0 = off.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Tokens outside the constraint (a grammar, a JSON schema) get -inf before each choice.
    pub constraint: Option<Constraint>,
    /// OpenAI's `logit_bias`: (token id, bias in [-100, 100]) added to the token's logit before
    /// the penalties and every cut. Ids outside the vocabulary are ignored here (the server
    /// refuses them). The device samplers do not apply it: a request with a bias samples on
    /// the host.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            constraint: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
    /// Names the first out-of-range field.
    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (
                "temperature",
                self.temperature.is_finite() && self.temperature >= 0.0,
            ),
            ("top_p", self.top_p > 0.0 && self.top_p <= 1.0),
            ("min_p", (0.0..=1.0).contains(&self.min_p)),
            (
                "repetition_penalty",
                self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
            ),
            (
                "presence_penalty",
                (-2.0..=2.0).contains(&self.presence_penalty),
            ),
            (
                "frequency_penalty",
                (-2.0..=2.0).contains(&self.frequency_penalty),
            ),
        ];
        let bias_ok = self
            .logit_bias
            .iter()
            .all(|&(_, b)| (-100.0..=100.0).contains(&b));
        match checks
            .iter()
            .chain(&[("logit_bias", bias_ok)])
            .find(|(_, ok)| !ok)
        {
            Some((name, _)) => Err(format!("{name} is out of range")),
            None => Ok(()),
        }
    }
}

/// Deterministic PRNG (SplitMix64): the same on every platform, cheap to mirror on a device.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Index of the largest value; the lowest index wins ties. NaN never wins.
///
/// 16 lanes keep their own best (a value and its first index) and meet at the end, so the
/// compiler keeps the scan in vector registers: the one-at-a-time scan took ~560 us over
/// 151,936 logits on the 2-core development machine (the constrained decode's host tail on the
/// GPU was 622 us a token), this ~65. Where no lane holds a value above -inf (every value -inf
/// or NaN) the one-at-a-time scan decides, so the answer is always `argmax_scan`'s.
pub fn argmax(logits: &[f32]) -> u32 {
    const L: usize = 16;
    let (mut m, mut ix) = ([f32::NEG_INFINITY; L], [u32::MAX; L]);
    let chunks = logits.chunks_exact(L);
    let tail = chunks.remainder();
    for (c, ch) in chunks.enumerate() {
        for j in 0..L {
            // Strictly greater: a lane keeps its first index of its best; NaN compares false.
            let gt = ch[j] > m[j];
            m[j] = if gt { ch[j] } else { m[j] };
            ix[j] = if gt { (c * L + j) as u32 } else { ix[j] };
        }
    }
    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    for j in 0..L {
        if ix[j] != u32::MAX && (m[j] > bv || (m[j] == bv && ix[j] < bi)) {
            (bv, bi) = (m[j], ix[j]);
        }
    }
    let base = logits.len() - tail.len();
    for (j, &v) in tail.iter().enumerate() {
        if v > bv {
            (bv, bi) = (v, (base + j) as u32);
        }
    }
    match bi {
        u32::MAX => argmax_scan(logits),
        _ => bi,
    }
}

/// `argmax` one value at a time: the definition (where the first values are NaN, the next
/// replaces them; an empty or all-NaN slice gives its last index, or 0).
pub fn argmax_scan(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Host sampler: penalties over the context, the constraint's mask, then temperature, top-k,
/// top-p, min-p.
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    counts: HashMap<u32, u32>,
    /// This sequence's state of `params.constraint`.
    mask: Option<Box<dyn TokenMask>>,
}

impl Sampler {
    pub fn new(params: SamplingParams, history: &[u32]) -> Self {
        let mut s = Sampler {
            rng: Rng::new(params.seed),
            mask: params.constraint.as_ref().map(Constraint::start),
            params,
            counts: HashMap::new(),
        };
        history.iter().for_each(|&t| s.observe(t));
        s
    }

    /// The RNG state (a device sampler continues from it).
    pub fn rng_state(&self) -> u64 {
        self.rng.0
    }

    /// Each id's count in the history and draws so far, for ids below `vocab` (the ones
    /// `apply_penalties` can reach): what a device sampler applies the penalties from.
    pub fn counts(&self, vocab: usize) -> Vec<u32> {
        let mut dense = vec![0u32; vocab];
        for (&t, &n) in &self.counts {
            if let Some(d) = dense.get_mut(t as usize) {
                *d = n;
            }
        }
        dense
    }

    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Plain greedy: the arg-max of the logits as they come (no bias, penalties or
    /// constraint), so a device may choose the token itself (`accept` records it).
    pub fn plain_greedy(&self) -> bool {
        let p = &self.params;
        p.is_greedy() && !p.has_penalties() && p.logit_bias.is_empty() && self.mask.is_none()
    }

    /// Records a token chosen elsewhere (a device's arg-max for a `plain_greedy` sampler) as
    /// `sample` records its own choice.
    pub fn accept(&mut self, token: u32) {
        if let Some(m) = &mut self.mask {
            m.commit(token);
        }
        self.observe(token);
    }

    /// The constraint's next allowed tokens as bits (`TokenMask::allowed_bits`), for a device
    /// that masks the logits and chooses the token itself; `accept` then takes its choice.
    /// False without a constraint, or where it cannot say.
    pub fn mask_bits(&mut self, words: &mut [u32]) -> bool {
        self.mask.as_mut().is_some_and(|m| m.allowed_bits(words))
    }

    /// Prepares the constraint's next mask, if the sampler has one (`TokenMask::prepare`): for
    /// a backend to call while the next logits are being computed.
    pub fn prepare(&mut self) {
        if let Some(m) = &mut self.mask {
            m.prepare();
        }
    }

    /// Samples a token and records it in the history (and the constraint's state). `logits` is
    /// modified (penalties, the constraint's -inf).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.apply_bias(logits);
        self.apply_penalties(logits);
        if let Some(m) = &mut self.mask {
            m.mask(logits);
        }
        let token = if self.params.is_greedy() {
            argmax(logits)
        } else {
            self.sample_stochastic(logits)
        };
        if let Some(m) = &mut self.mask {
            m.commit(token);
        }
        self.observe(token);
        token
    }

    fn apply_bias(&self, logits: &mut [f32]) {
        for &(tok, bias) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(tok as usize) {
                *l += bias;
            }
        }
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if !p.has_penalties() {
            return;
        }
        for (&tok, &n) in &self.counts {
            let Some(l) = logits.get_mut(tok as usize) else {
                continue;
            };
            if p.repetition_penalty != 1.0 {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
            *l -= p.presence_penalty + p.frequency_penalty * n as f32;
        }
    }

    fn sample_stochastic(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let n_finite = || logits.iter().filter(|v| v.is_finite()).count();
        if p.top_p >= 1.0 && (p.top_k == 0 || p.top_k >= n_finite()) {
            return self.sample_unsorted(logits);
        }
        if p.top_k == 0 {
            return self.sample_nucleus(logits);
        }
        let mut cand = top_candidates(logits, p.temperature, p.top_k);
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_unstable_by(best_first);
        // Relative to the best candidate's (the first).
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - cand[0].1).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            keep = probs
                .iter()
                .position(|&q| {
                    acc += q;
                    acc >= p.top_p
                })
                .map_or(keep, |i| i + 1);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.next_f32() * total;
        for (i, &q) in probs[..keep].iter().enumerate() {
            r -= q;
            if r < 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }

    /// Top-p without top-k: the nucleus is every token at least as good (best first, ties by
    /// id) as the one where the running sum of weights reaches top_p of their total. The sums
    /// are of the weights in fixed point (nucleus_fixed): integers add up the same in any
    /// order, so the cut is the full sort's and the device sampler's parallel sums find the
    /// same one. The weights are summed in quarter-octave buckets and only the bucket holding
    /// the boundary is sorted, instead of the whole vocabulary (~7 ms a token at 151,936); the
    /// draw then walks the nucleus in vocabulary order, as sample_unsorted walks everything.
    fn sample_nucleus(&mut self, logits: &[f32]) -> u32 {
        const BUCKETS: usize = 256;
        let Some(mut w) = relative_weights(logits, self.params.temperature) else {
            return argmax(logits);
        };
        // Weights lie in [0, 1], and positive floats order as their bits: 4 buckets an octave.
        let bucket = |x: f32| (((1.0f32.to_bits() - x.to_bits()) >> 21) as usize).min(BUCKETS - 1);
        let sums = w
            .par_chunks(w.len().div_ceil(PAR_CHUNKS))
            .map(|c| {
                let mut sums = [0u64; BUCKETS];
                c.iter().for_each(|&x| sums[bucket(x)] += nucleus_fixed(x));
                sums
            })
            .reduce(
                || [0u64; BUCKETS],
                |mut a, b| {
                    a.iter_mut().zip(b).for_each(|(s, x)| *s += x);
                    a
                },
            );
        let target = nucleus_target(self.params.top_p, sums.iter().sum());
        let (mut acc, mut b) = (0u64, 0);
        while b + 1 < BUCKETS && acc + sums[b] < target {
            acc += sums[b];
            b += 1;
        }
        let mut edge: Vec<(u32, f32)> = (0..w.len() as u32)
            .into_par_iter()
            .zip(&w)
            .filter(|&(_, &x)| x > 0.0 && bucket(x) == b)
            .map(|(i, &x)| (i, x))
            .collect();
        edge.sort_unstable_by(best_first);
        let last = edge.iter().position(|e| {
            acc += nucleus_fixed(e.1);
            acc >= target
        });
        // The worst token kept (rounding may leave the sum just short: then all of them).
        let cut = last.or(edge.len().checked_sub(1)).map(|i| edge[i]);
        let floor = self.params.min_p.max(0.0);
        w.par_iter_mut().enumerate().for_each(|(i, x)| {
            let kept = cut.map_or(bucket(*x) < b, |k| best_first(&(i as u32, *x), &k).is_le());
            if !kept || *x < floor {
                *x = 0.0;
            }
        });
        self.walk_unsorted(&w) as u32
    }

    /// No top-k or top-p cut (the OpenAI API's defaults): the whole distribution, above the
    /// min-p floor, walked in vocabulary order. Same distribution as the sorted walk, without
    /// its sort (~7 ms a token at 151,936 tokens, on the host between two device steps), and
    /// straight from the logits (no candidate list; non-finite logits weigh 0).
    fn sample_unsorted(&mut self, logits: &[f32]) -> u32 {
        let Some(mut w) = relative_weights(logits, self.params.temperature) else {
            return argmax(logits);
        };
        // The weights are probabilities relative to the best token's, so min-p is their floor.
        let floor = self.params.min_p.max(0.0);
        if floor > 0.0 {
            w.par_iter_mut()
                .filter(|x| **x < floor)
                .for_each(|x| *x = 0.0);
        }
        self.walk_unsorted(&w) as u32
    }

    /// One draw over weights in vocabulary order, zero weights skipped: the index where the
    /// running remainder of u * sum goes negative, the last weighted one if rounding never gets
    /// there. The sums go by WALK_CHUNKS contiguous chunks -- each chunk's sum, then those in
    /// order -- and the walk skips whole chunks the remainder covers, so the device sampler
    /// (sample.cu, one thread a chunk) adds the same numbers in the same order.
    fn walk_unsorted(&mut self, w: &[f32]) -> usize {
        let len = w.len().div_ceil(WALK_CHUNKS).max(1);
        let partial: Vec<f32> = w.par_chunks(len).map(|c| c.iter().sum()).collect();
        let total: f32 = partial.iter().sum();
        let mut r = self.rng.next_f32() * total;
        let mut last = 0;
        for (c, (&sum, chunk)) in partial.iter().zip(w.chunks(len)).enumerate() {
            if sum == 0.0 {
                continue;
            }
            if r >= sum {
                r -= sum;
                last = c * len + chunk.iter().rposition(|&x| x > 0.0).unwrap_or(0);
                continue;
            }
            for (i, &x) in chunk.iter().enumerate() {
                if x > 0.0 {
                    last = c * len + i;
                    r -= x;
                    if r < 0.0 {
                        return last;
                    }
                }
            }
        }
        last
    }
}

/// Chunks of walk_unsorted's sums: the device sampler's threads (one chunk each).
pub const WALK_CHUNKS: usize = 1024;

/// Fixed chunks of the nucleus's bucket sums and of top-k's selection, done in parallel and
/// combined in chunk order (so the result does not depend on the thread count); 64 keep 16
/// threads busy.
const PAR_CHUNKS: usize = 64;

/// The k best finite logits divided by t, as (id, value), unordered: only they need ordering
/// (a full sort of a 151,936-token vocabulary is ~7 ms a token), so each fixed chunk's k best
/// are selected in O(n) (in parallel), then the k best of those. best_first is a total order,
/// so the set is the same however the vocabulary is cut.
fn top_candidates(logits: &[f32], t: f32, k: usize) -> Vec<(u32, f32)> {
    let keep_best = |mut cand: Vec<(u32, f32)>| {
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, best_first);
            cand.truncate(k);
        }
        cand
    };
    let len = logits.len().div_ceil(PAR_CHUNKS).max(1);
    let best = logits
        .par_chunks(len)
        .enumerate()
        .flat_map_iter(|(c, chunk)| {
            let finite = chunk.iter().enumerate().filter(|(_, v)| v.is_finite());
            keep_best(
                finite
                    .map(|(i, &v)| ((c * len + i) as u32, v / t))
                    .collect(),
            )
        })
        .collect();
    keep_best(best)
}

/// A weight (in [0, 1]) in the nucleus's fixed point: 40 fractional bits, truncated, so a
/// vocabulary's sum stays below 2^58. Weights under 2^-40 count as 0 toward the cut.
pub fn nucleus_fixed(w: f32) -> u64 {
    (w * (1u64 << 40) as f32) as u64
}

/// The running sum of fixed-point weights (best first) at which the nucleus ends: top_p of the
/// total, computed in f64 (rounding as the device's), at least 1 and at most the total.
pub fn nucleus_target(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64) as u64).clamp(1, total.max(1))
}

/// exp(v / t - max / t) of every logit (0 where it is not finite): each token's probability
/// relative to the best one's, which weighs 1. None when no logit is finite. Division by t > 0
/// is monotone, so the largest v / t is the largest v divided by t: one division a token fewer,
/// the same bits (the device sampler computes the same).
fn relative_weights(logits: &[f32], t: f32) -> Option<Vec<f32>> {
    let finite = logits.par_iter().copied().filter(|v| v.is_finite());
    let max = finite.reduce_with(f32::max)? / t;
    let weight = |v: f32| {
        if v.is_finite() {
            (v / t - max).exp()
        } else {
            0.0
        }
    };
    Some(logits.par_iter().map(|&v| weight(v)).collect())
}

/// Best first; ties by lower id (a total order, so the result is unique).
fn best_first(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

#[cfg(test)]
mod tests;
