//! Attention of one query position over its cache, a few query heads of one KV group at a time.
//!
//! `attend_head` is the definition: a head's scores are `dot_f32(q, key) * scale` (eight
//! running sums, combined pairwise), softmax, then the values summed position by position from
//! 0 with a multiply and an add per element. `attend_heads` computes exactly those operations
//! for several heads of one group: on AVX2 the keys are read once for all of them, four
//! positions' dot products run side by side (independent add chains instead of one chain a
//! dot), and the output accumulates in registers, a 64-value half at a time. No FMA, no other
//! order: every path gives the same bits, alone or in a batch, so attention stays
//! batch-invariant and the single-token, prefill and batched paths agree.

#[cfg(target_arch = "x86_64")]
use q4moe_model::backend::KvType;
use q4moe_model::Config;

use crate::kv::KvView;
use crate::ops::{dot_f32, softmax};

/// Query head `h` of `q` over the `cached` keys and values (as many positions as `scores`
/// holds) into `o`.
pub(crate) fn attend_head(
    c: &Config,
    h: usize,
    q: &[f32],
    cached: &KvView<'_>,
    scores: &mut [f32],
    o: &mut [f32],
) {
    let hd = c.head_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let g = h / c.n_group();
    let qh = &q[h * hd..(h + 1) * hd];
    // A position's head as f32 (exact, whatever the cache stores).
    let mut row = vec![0f32; hd];
    for (t, sc) in scores.iter_mut().enumerate() {
        cached.key_into(t, g * hd, &mut row);
        *sc = dot_f32(qh, &row) * scale;
    }
    softmax(scores);
    o.fill(0.0);
    for (t, &p) in scores.iter().enumerate() {
        cached.value_into(t, g * hd, &mut row);
        o.iter_mut().zip(&row).for_each(|(a, b)| *a += p * b);
    }
}

/// Query heads `h0 .. h0 + n` of `q` (all in one KV group) over `len` cached positions:
/// head `h0 + i`'s scores into `scores[i * len..(i + 1) * len]` and its output into
/// `o[i * head_dim..]`; bit for bit `attend_head` for each.
pub(crate) fn attend_heads(
    c: &Config,
    h0: usize,
    q: &[f32],
    cached: &KvView<'_>,
    len: usize,
    scores: &mut [f32],
    o: &mut [f32],
) {
    let (hd, n) = (c.head_dim, o.len() / c.head_dim);
    debug_assert_eq!(h0 / c.n_group(), (h0 + n - 1) / c.n_group(), "one KV group");
    #[cfg(target_arch = "x86_64")]
    if hd % 64 == 0 && avx2::usable() {
        let (qh, g) = (&q[h0 * hd..(h0 + n) * hd], h0 / c.n_group());
        let scores = &mut scores[..n * len];
        // SAFETY: AVX2 and F16C are present; the heads' queries, scores and outputs are sized
        // alike (`avx2::heads` asserts it).
        return unsafe {
            match cached.kv_type() {
                KvType::F16 => avx2::heads::<true>(c, g, qh, cached, scores, o),
                KvType::F32 => avx2::heads::<false>(c, g, qh, cached, scores, o),
            }
        };
    }
    for (i, o) in o.chunks_mut(hd).enumerate() {
        let scores = &mut scores[i * len..(i + 1) * len];
        attend_head(c, h0 + i, q, cached, scores, o);
    }
}

/// Heads a task takes for `tokens` tokens: a whole KV group where that still gives each of
/// `threads` at least two tasks, else halves of it (down to one head, or an odd group whole),
/// so a many-core machine keeps every core busy on a single token.
pub(crate) fn heads_a_task(c: &Config, tokens: usize, threads: usize) -> usize {
    let mut n = c.n_group();
    while n % 2 == 0 && tokens * c.n_head / n < 2 * threads {
        n /= 2;
    }
    n
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use q4moe_model::Config;

    use crate::kv::{KvView, PAGE};
    use crate::ops::softmax;

    /// `dot_f32`'s eight running sums combined as it combines them:
    /// ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)), plus its (empty) tail.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn reduce(acc: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        let h = _mm_hadd_ps(s, s);
        let tail: f32 = [0f32; 0].iter().sum();
        _mm_cvtss_f32(_mm_hadd_ps(h, h)) + tail
    }

    pub(super) fn usable() -> bool {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
    }

    /// Eight elements from `p` (element `i` on) as f32: f16 (`F16`, converted exactly) or f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8<const F16: bool>(p: *const u8, i: usize) -> __m256 {
        if F16 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i).cast()))
        } else {
            _mm256_loadu_ps(p.add(4 * i).cast())
        }
    }

    /// `attend_heads` for the heads whose queries are `qh` (of KV group `g`): as many
    /// positions as `scores` holds for each; `hd` is a multiple of 64; the cache stores f16
    /// where `F16`, else f32.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn heads<const F16: bool>(
        c: &Config,
        g: usize,
        qh: &[f32],
        cached: &KvView<'_>,
        scores: &mut [f32],
        o: &mut [f32],
    ) {
        let hd = c.head_dim;
        let n = o.len() / hd;
        let len = scores.len() / n;
        assert!(qh.len() == n * hd && scores.len() == n * len && len <= cached.len());
        let scale = 1.0 / (hd as f32).sqrt();
        let qp = qh.as_ptr();
        // Each page's first position once; a position is then a stride on from it.
        let stride = c.kv_dim() * if F16 { 2 } else { 4 };
        let pages = len.div_ceil(PAGE);
        let kp: Vec<*const u8> = (0..pages)
            .map(|p| cached.key_ptr(p * PAGE, g * hd))
            .collect();
        let vp: Vec<*const u8> = (0..pages)
            .map(|p| cached.value_ptr(p * PAGE, g * hd))
            .collect();
        let key = |t: usize| kp.get_unchecked(t / PAGE).add(t % PAGE * stride);
        let value = |t: usize| vp.get_unchecked(t / PAGE).add(t % PAGE * stride);
        // Scores: four positions at a time (four independent add chains: one chain a dot
        // would wait on each add), each head's query chunk loaded once for the four keys; a
        // last block of fewer repeats its last key and keeps only its own.
        let mut t = 0;
        while t < len {
            let m = (len - t).min(4);
            let ks: [*const u8; 4] = std::array::from_fn(|j| key(t + j.min(m - 1)));
            for i in 0..n {
                let qh = qp.add(i * hd);
                let mut a = [_mm256_setzero_ps(); 4];
                for ch in (0..hd).step_by(8) {
                    let x = _mm256_loadu_ps(qh.add(ch));
                    for (a, k) in a.iter_mut().zip(&ks) {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(x, load8::<F16>(*k, ch)));
                    }
                }
                for (j, a) in a.iter().enumerate().take(m) {
                    scores[i * len + t + j] = reduce(*a) * scale;
                }
            }
            t += 4;
        }
        // Softmax, then each head's output a 64-value half at a time in eight registers.
        for i in 0..n {
            let sc = &mut scores[i * len..(i + 1) * len];
            softmax(sc);
            for half in (0..hd).step_by(64) {
                let mut acc = [_mm256_setzero_ps(); 8];
                for (t, &p) in sc.iter().enumerate() {
                    let (p, v) = (_mm256_set1_ps(p), value(t));
                    for (j, a) in acc.iter_mut().enumerate() {
                        let x = load8::<F16>(v, half + 8 * j);
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(p, x));
                    }
                }
                let out = o.as_mut_ptr().add(i * hd + half);
                for (j, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(8 * j), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvCache, KvPool};
    use q4moe_model::backend::KvType;

    /// Random values in [-2, 2) (a fixed seed).
    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = q4moe_model::sampling::Rng::new(seed);
        (0..n).map(|_| rng.next_f32() * 4.0 - 2.0).collect()
    }

    /// Every way of splitting a group into tasks gives each head `attend_head`'s bits, on the
    /// vector path (head dims 64, 128) and the plain one (40), over f16 and f32 caches of 1 to 2
    /// pages and odd lengths (a last block of fewer than four positions).
    #[test]
    fn heads_together_give_each_head_s_own_bits() {
        let shapes = [(16, 4, 128), (8, 1, 64), (4, 4, 128), (6, 2, 40)];
        for ((n_head, n_kv_head, hd), kv_type) in shapes
            .into_iter()
            .flat_map(|s| [(s, KvType::F16), (s, KvType::F32)])
        {
            let mut c = Config::tiny();
            (c.n_head, c.n_kv_head, c.head_dim, c.n_layer) = (n_head, n_kv_head, hd, 1);
            let pool = KvPool::new(&c, kv_type, usize::MAX);
            let mut kv = KvCache::new(&c, &pool);
            let q = random(c.q_dim(), 1);
            for len in [1, 2, 7, 33, crate::kv::PAGE + 3] {
                while kv.len() < len {
                    kv.reserve(1).unwrap();
                    let t = kv.len() as u64;
                    kv.push(
                        0,
                        &random(c.kv_dim(), 10 + 2 * t),
                        &random(c.kv_dim(), 11 + 2 * t),
                    );
                }
                let view = kv.view(0, len);
                let mut want = vec![0f32; c.q_dim()];
                let mut scores = vec![0f32; len];
                for (h, o) in want.chunks_mut(hd).enumerate() {
                    attend_head(&c, h, &q, &view, &mut scores, o);
                }
                assert!(want.iter().all(|x| x.is_finite()));
                for each in (1..=c.n_group()).filter(|e| c.n_group() % e == 0) {
                    let mut got = vec![f32::NAN; c.q_dim()];
                    let mut scores = vec![f32::NAN; each * len];
                    for (t, o) in got.chunks_mut(each * hd).enumerate() {
                        attend_heads(&c, t * each, &q, &view, len, &mut scores, o);
                    }
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    let what = format!("{n_head}/{n_kv_head} heads x {hd}, {kv_type:?}");
                    assert!(same, "{what}, {len} positions, {each} a task");
                }
            }
        }
    }

    #[test]
    fn a_task_takes_a_group_unless_the_cores_want_more_tasks() {
        let mut c = Config::tiny();
        (c.n_head, c.n_kv_head) = (32, 4);
        assert_eq!(heads_a_task(&c, 1, 2), 8, "4 tasks for 2 threads");
        assert_eq!(heads_a_task(&c, 1, 16), 1, "32 tasks for 16 threads");
        assert_eq!(heads_a_task(&c, 1, 4), 4);
        assert_eq!(heads_a_task(&c, 4, 16), 4, "4 tokens: 32 tasks");
        (c.n_head, c.n_kv_head) = (6, 2);
        assert_eq!(heads_a_task(&c, 1, 16), 3, "an odd group is not split");
    }
}
