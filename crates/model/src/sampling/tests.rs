//! The host sampler's tests.

use super::*;

#[test]
fn argmax_prefers_lowest_index_on_ties_and_skips_nan() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 0.5, 0.25]), 1);
}

/// The lane-parallel arg-max gives the one-at-a-time scan's answer on random logits with
/// ties, NaN and -inf in every place, at lengths around the lanes' multiples.
#[test]
fn argmax_matches_the_scan() {
    let mut rng = Rng::new(3);
    for case in 0..4000 {
        let n = match case % 4 {
            0 => (rng.next_u64() % 40) as usize,
            1 => 151_936,
            _ => (rng.next_u64() % 300) as usize,
        };
        if case % 4 == 1 && case > 40 {
            continue; // a few full vocabularies are enough
        }
        // Few distinct values, so ties are common.
        let levels = 1 + rng.next_u64() % 6;
        let special = rng.next_u64() % 4; // 0: none, 1: NaN, 2: -inf, 3: both
        let logits: Vec<f32> = (0..n)
            .map(|_| match rng.next_u64() % 10 {
                0 if special & 1 == 1 => f32::NAN,
                1 if special & 2 == 2 => f32::NEG_INFINITY,
                _ => (rng.next_u64() % levels) as f32 - 2.0,
            })
            .collect();
        assert_eq!(
            argmax(&logits),
            argmax_scan(&logits),
            "case {case}: {logits:?}"
        );
    }
    let all = |v: f32, n: usize| vec![v; n];
    for n in [0, 1, 15, 16, 17, 33] {
        assert_eq!(argmax(&all(f32::NAN, n)), argmax_scan(&all(f32::NAN, n)));
        let ninf = all(f32::NEG_INFINITY, n);
        assert_eq!(argmax(&ninf), argmax_scan(&ninf));
    }
}

#[test]
fn top_k_one_is_greedy_and_seed_is_deterministic() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32 * 0.1).collect();
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 1,
        seed: 7,
        ..Default::default()
    };
    assert_eq!(
        Sampler::new(p, &[]).sample(&mut logits.clone()),
        argmax(&logits)
    );
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        seed: 42,
        ..Default::default()
    };
    let a: Vec<u32> = {
        let mut s = Sampler::new(p.clone(), &[]);
        (0..20).map(|_| s.sample(&mut logits.clone())).collect()
    };
    let b: Vec<u32> = {
        let mut s = Sampler::new(p, &[]);
        (0..20).map(|_| s.sample(&mut logits.clone())).collect()
    };
    assert_eq!(a, b);
    assert!(
        a.iter().any(|&t| t != a[0]),
        "sampling at temperature 1 should vary: {a:?}"
    );
}

#[test]
fn counts_are_the_history_below_the_vocabulary() {
    let mut s = Sampler::new(SamplingParams::greedy(), &[3, 1, 3, 9, 3]);
    s.observe(1);
    assert_eq!(s.counts(5), [0, 2, 0, 3, 0]); // id 9 is past the vocabulary
}

/// top-k selects and then sorts only k candidates: it must order them exactly as the full
/// sort does. With k tokens far above the rest (whose probabilities underflow to 0), top-k
/// k and top-k n (a full sort) draw the same tokens; exact ties among the k test the id order.
#[test]
fn top_k_selection_orders_like_a_full_sort() {
    let mut rng = Rng::new(3);
    let n = 5000;
    for k in [1usize, 7, 40, 300] {
        let mut logits: Vec<f32> = (0..n).map(|_| -200.0 + (rng.next_f32() - 0.5)).collect();
        for j in 0..k {
            let at = (rng.next_u64() % n as u64) as usize;
            logits[at] = if j % 3 == 0 {
                2.5
            } else {
                rng.next_f32() * 4.0
            };
        }
        let hot = logits.iter().filter(|&&v| v > -100.0).count();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: hot,
            top_p: 0.9,
            seed: k as u64,
            ..Default::default()
        };
        let off = SamplingParams {
            top_k: n, // no cut, still the sorted path (top-k off takes sample_nucleus)
            ..p.clone()
        };
        let (mut a, mut b) = (Sampler::new(p, &[]), Sampler::new(off, &[]));
        for _ in 0..50 {
            assert_eq!(a.sample(&mut logits.clone()), b.sample(&mut logits.clone()));
        }
    }
}

#[test]
fn min_p_and_top_p_exclude_unlikely_tokens() {
    let mut logits = vec![-10.0f32; 50];
    logits[3] = 5.0;
    logits[9] = 4.5;
    let p = SamplingParams {
        temperature: 1.0,
        min_p: 0.05,
        seed: 1,
        ..Default::default()
    };
    let mut s = Sampler::new(p, &[]);
    for _ in 0..200 {
        let t = s.sample(&mut logits.clone());
        assert!(t == 3 || t == 9, "sampled {t}");
    }
}

/// Without a top-k/top-p cut the draw walks the vocabulary unsorted: token frequencies
/// must still follow the softmax, and min-p must still exclude.
#[test]
fn unsorted_walk_follows_the_distribution() {
    let logits = [
        0.5f32.ln(),
        f32::NEG_INFINITY,
        0.3f32.ln(),
        0.2f32.ln(),
        -30.0,
    ];
    let p = SamplingParams {
        temperature: 1.0,
        seed: 11,
        ..Default::default()
    };
    let mut s = Sampler::new(p.clone(), &[]);
    let mut count = [0usize; 5];
    let n = 20000;
    for _ in 0..n {
        count[s.sample(&mut logits.to_vec()) as usize] += 1;
    }
    assert_eq!(count[1], 0, "a -inf logit was drawn");
    for (t, want) in [(0, 0.5), (2, 0.3), (3, 0.2)] {
        let got = count[t] as f64 / n as f64;
        assert!((got - want).abs() < 0.02, "token {t}: {got} vs {want}");
    }
    let mut s = Sampler::new(SamplingParams { min_p: 0.5, ..p }, &[]);
    for _ in 0..500 {
        let t = s.sample(&mut logits.to_vec());
        assert!(t == 0 || t == 2, "min-p 0.5 kept token {t}");
    }
}

/// Top-p with top-k off (sample_nucleus): the nucleus renormalised, nothing outside it, and
/// a 1,500-token nucleus inside one weight bucket (all of it the sorted boundary bucket).
#[test]
fn nucleus_follows_the_renormalised_distribution() {
    let mut logits = vec![-40.0f32; 1000];
    for (t, q) in [(7, 0.4f32), (3, 0.3), (500, 0.2), (999, 0.1)] {
        logits[t] = q.ln();
    }
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.75,
        seed: 5,
        ..Default::default()
    };
    let mut s = Sampler::new(p.clone(), &[]);
    let mut count = std::collections::HashMap::new();
    let n = 20000;
    for _ in 0..n {
        *count.entry(s.sample(&mut logits.clone())).or_insert(0usize) += 1;
    }
    assert_eq!(count.len(), 3, "outside the nucleus: {count:?}");
    for (t, want) in [(7, 0.4 / 0.9), (3, 0.3 / 0.9), (500, 0.2 / 0.9)] {
        let got = count[&t] as f64 / n as f64;
        assert!((got - want).abs() < 0.02, "token {t}: {got} vs {want}");
    }
    // min-p 0.6 of the best: 0.3 / 0.4 stays, 0.2 / 0.4 goes
    let mut s = Sampler::new(SamplingParams { min_p: 0.6, ..p }, &[]);
    for _ in 0..500 {
        let t = s.sample(&mut logits.clone());
        assert!(t == 7 || t == 3, "min-p 0.6 kept token {t}");
    }
    // 3,000 equal logits, top-p 0.5: the nucleus is the 1,500 lowest ids (ties by id)
    let flat = vec![0.25f32; 3000];
    let mut s = Sampler::new(
        SamplingParams {
            temperature: 0.7,
            top_p: 0.5,
            seed: 8,
            ..Default::default()
        },
        &[],
    );
    let draws: Vec<u32> = (0..3000).map(|_| s.sample(&mut flat.clone())).collect();
    assert!(draws.iter().all(|&t| t < 1500), "outside the nucleus");
    assert!(draws.iter().any(|&t| t < 64) && draws.iter().any(|&t| t >= 512));
}

/// The passes run on rayon's threads (top-k by chunks); the draws must not depend on how
/// many there are.
#[test]
fn draws_do_not_depend_on_the_thread_count() {
    let mut rng = Rng::new(3);
    let logits: Vec<f32> = (0..40_000).map(|_| rng.next_f32() * 20.0).collect();
    let nucleus = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        min_p: 0.001,
        seed: 11,
        ..Default::default()
    };
    let unsorted = SamplingParams {
        temperature: 1.0,
        seed: 12,
        ..Default::default()
    };
    let top_k = SamplingParams {
        temperature: 0.9,
        top_k: 30,
        top_p: 0.95,
        repetition_penalty: 1.1,
        seed: 13,
        ..Default::default()
    };
    for p in [nucleus, unsorted, top_k] {
        let draws = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut s = Sampler::new(p.clone(), &[]);
                (0..40)
                    .map(|_| s.sample(&mut logits.clone()))
                    .collect::<Vec<_>>()
            })
        };
        let one = draws(1);
        assert!(one.iter().any(|&t| t != one[0]), "sampling never varied");
        assert_eq!(one, draws(3), "{p:?}");
    }
}

/// sample_unsorted works on the logits directly; the device sampler matches it bit for bit,
/// so it must draw exactly what this reference does: weights over the whole vocabulary (0
/// for non-finite logits and below the min-p floor), chunk sums, their sum, a chunk skipped
/// while the remainder covers it, then the walk inside the chunk it falls in.
#[test]
fn unsorted_walk_draws_as_the_chunked_reference() {
    fn reference(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
        let t = p.temperature;
        let max = logits
            .iter()
            .filter(|v| v.is_finite())
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v / t));
        let weight = |v: f32| {
            let w = if v.is_finite() {
                (v / t - max).exp()
            } else {
                0.0
            };
            if w >= p.min_p {
                w
            } else {
                0.0
            }
        };
        let len = logits.len().div_ceil(1024);
        let mut sums = vec![];
        for chunk in logits.chunks(len) {
            let mut s = 0f32;
            for &v in chunk {
                s += weight(v);
            }
            sums.push(s);
        }
        let mut total = 0f32;
        for &s in &sums {
            total += s;
        }
        let mut r = rng.next_f32() * total;
        let mut last = 0;
        for (c, &s) in sums.iter().enumerate() {
            let mut ids = c * len..((c + 1) * len).min(logits.len());
            if s > 0.0 && r >= s {
                r -= s;
                last = ids.rfind(|&i| weight(logits[i]) > 0.0).unwrap();
                continue;
            }
            for i in ids {
                if weight(logits[i]) > 0.0 {
                    last = i;
                    r -= weight(logits[i]);
                    if r < 0.0 {
                        return i as u32;
                    }
                }
            }
        }
        last as u32
    }
    let mut rng = Rng::new(21);
    for (n, t, min_p) in [(700, 1.3f32, 0.0f32), (151936, 0.8, 0.0), (5000, 1.0, 0.1)] {
        let mut logits: Vec<f32> = (0..n).map(|_| (rng.next_f32() - 0.5) * 10.0).collect();
        logits[3] = f32::NAN;
        logits[n - 2] = f32::NEG_INFINITY;
        let p = SamplingParams {
            temperature: t,
            min_p,
            seed: n as u64,
            ..Default::default()
        };
        let mut s = Sampler::new(p.clone(), &[]);
        let mut r = Rng::new(p.seed);
        let draws: Vec<u32> = (0..40).map(|_| s.sample(&mut logits.clone())).collect();
        let want: Vec<u32> = (0..40).map(|_| reference(&logits, &p, &mut r)).collect();
        assert_eq!(draws, want, "n {n}");
        assert!(
            draws.iter().any(|&d| d as usize >= n / 2),
            "n {n}: no draw past mid-vocab"
        );
    }
}

/// Over a full vocabulary the chunk skipping must still follow the distribution: a few
/// heavy tokens spread over chunks, the rest negligible.
#[test]
fn chunked_walk_follows_the_distribution() {
    let mut logits = vec![-40.0f32; 151936];
    let heavy = [
        (5, 0.1f32),
        (20000, 0.25),
        (20001, 0.15),
        (99999, 0.3),
        (151935, 0.2),
    ];
    for (t, q) in heavy {
        logits[t] = q.ln();
    }
    let p = SamplingParams {
        temperature: 1.0,
        seed: 3,
        ..Default::default()
    };
    let mut s = Sampler::new(p, &[]);
    let mut count = std::collections::HashMap::new();
    let n = 4000;
    for _ in 0..n {
        *count.entry(s.sample(&mut logits.clone())).or_insert(0usize) += 1;
    }
    for (t, want) in heavy {
        let got = *count.get(&(t as u32)).unwrap_or(&0) as f64 / n as f64;
        assert!(
            (got - want as f64).abs() < 0.03,
            "token {t}: {got} vs {want}"
        );
    }
}

#[test]
fn repetition_penalty_lowers_seen_tokens() {
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..Default::default()
    };
    let mut s = Sampler::new(p, &[0]);
    let mut logits = vec![4.0, 3.0, -1.0];
    assert_eq!(s.sample(&mut logits), 1);
    assert_eq!(logits[0], 2.0);
}

#[test]
fn logit_bias_moves_the_choice_and_is_range_checked() {
    let logits = [1.0f32, 3.0, 2.0, 0.5];
    let pick = |bias: Vec<(u32, f32)>| {
        let p = SamplingParams {
            logit_bias: bias,
            ..SamplingParams::greedy()
        };
        Sampler::new(p, &[]).sample(&mut logits.clone())
    };
    assert_eq!(pick(vec![]), 1);
    assert_eq!(pick(vec![(1, -100.0)]), 2);
    assert_eq!(pick(vec![(3, 100.0)]), 3);
    // An id past the logits is ignored, not an out-of-bounds write.
    assert_eq!(pick(vec![(99, 100.0)]), 1);
    let bad = SamplingParams {
        logit_bias: vec![(0, 100.5)],
        ..SamplingParams::greedy()
    };
    assert_eq!(bad.validate().unwrap_err(), "logit_bias is out of range");
}
