//! AVX2 + FMA kernels for f32 activations: each block is widened to i32 lanes straight from
//! memory (`vpmovzxbd`), converted to f32 and fused into the accumulator, so a row is never
//! expanded to a buffer. The integer (q8) kernels live in `x86_q8.rs`.

use std::arch::x86_64::*;

use super::x86_lanes::{f16, f16x8_array, hsum};
use super::{blocks, BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8_0, Isa, QK_K};
use crate::GgmlType;

pub(crate) use super::x86_q8::vec_dot_q8;

/// # Safety
/// The CPU must support `isa` (at least AVX2, FMA and F16C).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_f32(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    if isa == Isa::Avx512Vnni {
        match ty {
            GgmlType::Q4_0 => return super::x86_512::dot_q4_0(blocks(row), x),
            GgmlType::Q8_0 => return super::x86_512::dot_q8_0(blocks(row), x),
            GgmlType::Q4_K => return super::x86_512::dot_q4_k(blocks(row), x),
            _ => {}
        }
    }
    match ty {
        GgmlType::F32 => dot_f32(row, x),
        GgmlType::F16 => dot_f16(row, x),
        GgmlType::BF16 => dot_bf16(row, x),
        GgmlType::Q4_0 => dot_q4_0(blocks(row), x),
        GgmlType::Q8_0 => dot_q8_0(blocks(row), x),
        GgmlType::Q4_K => dot_q4_k(blocks(row), x),
        GgmlType::Q6_K => dot_q6_k(blocks(row), x),
        _ => panic!("vec_dot: type {ty} is not supported"),
    }
}

/// Eight bytes at `p`, zero-extended to i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

/// A generic f32 dot over `n` (a multiple of 8) elements where `load(i)` yields weights i..i+8 as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_lanes(n: usize, x: &[f32], load: impl Fn(usize) -> __m256) -> f32 {
    let xp = x.as_ptr();
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        a0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(xp.add(i)), a0);
        a1 = _mm256_fmadd_ps(load(i + 8), _mm256_loadu_ps(xp.add(i + 8)), a1);
        i += 16;
    }
    if i + 8 <= n {
        a0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(xp.add(i)), a0);
        i += 8;
    }
    debug_assert_eq!(i, n, "dot_lanes needs a multiple of 8 elements");
    hsum(_mm256_add_ps(a0, a1))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    // Clamped so that a caller's length mismatch can never read out of bounds.
    let n = x.len().min(row.len() / 4);
    let p = row.as_ptr().cast::<f32>();
    let main = n / 8 * 8;
    let s = dot_lanes(main, x, |i| _mm256_loadu_ps(p.add(i)));
    s + (main..n)
        .map(|i| p.add(i).read_unaligned() * x[i])
        .sum::<f32>()
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let n = x.len().min(row.len() / 2);
    let p = row.as_ptr();
    let main = n / 8 * 8;
    let s = dot_lanes(main, x, |i| {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i).cast()))
    });
    s + (main..n)
        .map(|i| f16([row[2 * i], row[2 * i + 1]]) * x[i])
        .sum::<f32>()
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let n = x.len().min(row.len() / 2);
    let p = row.as_ptr();
    let main = n / 8 * 8;
    let load = |i: usize| {
        let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * i).cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
    };
    let s = dot_lanes(main, x, load);
    s + (main..n)
        .map(|i| super::float::bf16_to_f32([row[2 * i], row[2 * i + 1]]) * x[i])
        .sum::<f32>()
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0(bs: &[BlockQ4_0], x: &[f32]) -> f32 {
    let (m15, m8) = (_mm256_set1_epi32(15), _mm256_set1_epi32(8));
    // Two accumulators and a tree inside the block keep the FMA latency chains short.
    let mut acc = [_mm256_setzero_ps(); 4];
    for (bc, xc) in bs.chunks(8).zip(x.chunks(256)) {
        let ds = f16x8_array(bc.len(), |i| bc[i].d);
        for (i, ((b, x), d)) in bc.iter().zip(xc.chunks_exact(32)).zip(ds).enumerate() {
            let xp = x.as_ptr();
            let (q0, q1) = (u8x8(b.qs.as_ptr()), u8x8(b.qs.as_ptr().add(8)));
            let lane = |q: __m256i| _mm256_cvtepi32_ps(_mm256_sub_epi32(q, m8));
            let s0 = _mm256_mul_ps(lane(_mm256_and_si256(q0, m15)), _mm256_loadu_ps(xp));
            let s1 = _mm256_mul_ps(lane(_mm256_and_si256(q1, m15)), _mm256_loadu_ps(xp.add(8)));
            let s0 = _mm256_fmadd_ps(
                lane(_mm256_srli_epi32(q0, 4)),
                _mm256_loadu_ps(xp.add(16)),
                s0,
            );
            let s1 = _mm256_fmadd_ps(
                lane(_mm256_srli_epi32(q1, 4)),
                _mm256_loadu_ps(xp.add(24)),
                s1,
            );
            acc[i % 4] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_add_ps(s0, s1), acc[i % 4]);
        }
    }
    hsum(sum4(acc))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0(bs: &[BlockQ8_0], x: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    for (bc, xc) in bs.chunks(8).zip(x.chunks(256)) {
        let ds = f16x8_array(bc.len(), |i| bc[i].d);
        for (i, ((b, x), d)) in bc.iter().zip(xc.chunks_exact(32)).zip(ds).enumerate() {
            let (xp, qp) = (x.as_ptr(), b.qs.as_ptr());
            let lane = |k: usize| {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(qp.add(8 * k).cast())))
            };
            let s0 = _mm256_fmadd_ps(
                lane(1),
                _mm256_loadu_ps(xp.add(8)),
                _mm256_mul_ps(lane(0), _mm256_loadu_ps(xp)),
            );
            let s1 = _mm256_fmadd_ps(
                lane(3),
                _mm256_loadu_ps(xp.add(24)),
                _mm256_mul_ps(lane(2), _mm256_loadu_ps(xp.add(16))),
            );
            acc[i % 4] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_add_ps(s0, s1), acc[i % 4]);
        }
    }
    hsum(sum4(acc))
}

/// Four accumulators: with one or two, the FMA latency (4-5 cycles) would bound a block.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sum4(a: [__m256; 4]) -> __m256 {
    _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k(bs: &[BlockQ4K], x: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    for (bc, xc) in bs.chunks(4).zip(x.chunks(4 * QK_K)) {
        let ds = f16x8_array(2 * bc.len(), |i| {
            if i % 2 == 0 {
                bc[i / 2].d
            } else {
                bc[i / 2].dmin
            }
        });
        for (i, (b, x)) in bc.iter().zip(xc.chunks_exact(QK_K)).enumerate() {
            q4_k_block(b, x, ds[2 * i], ds[2 * i + 1], &mut acc);
        }
    }
    hsum(sum4(acc))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q4_k_block(b: &BlockQ4K, x: &[f32], d: f32, dmin: f32, acc: &mut [__m256; 4]) {
    let m15 = _mm256_set1_epi32(15);
    for c in 0..4 {
        let (sc0, m0) = b.scale_min(2 * c);
        let (sc1, m1) = b.scale_min(2 * c + 1);
        let (d0, mn0) = (
            _mm256_set1_ps(d * sc0 as f32),
            _mm256_set1_ps(dmin * m0 as f32),
        );
        let (d1, mn1) = (
            _mm256_set1_ps(d * sc1 as f32),
            _mm256_set1_ps(dmin * m1 as f32),
        );
        let (qp, xp) = (b.qs.as_ptr().add(32 * c), x.as_ptr().add(64 * c));
        for g in 0..4 {
            let q = u8x8(qp.add(8 * g));
            let lo = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, m15)), d0, mn0);
            let hi = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d1, mn1);
            let j = 2 * (g % 2);
            acc[j] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp.add(8 * g)), acc[j]);
            acc[j + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp.add(32 + 8 * g)), acc[j + 1]);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k(bs: &[BlockQ6K], x: &[f32]) -> f32 {
    let (m15, m3, m48, m32) = (
        _mm256_set1_epi32(15),
        _mm256_set1_epi32(3),
        _mm256_set1_epi32(48),
        _mm256_set1_epi32(32),
    );
    let mut acc = [_mm256_setzero_ps(); 4];
    for (bc, xc) in bs.chunks(8).zip(x.chunks(8 * QK_K)) {
        let ds = f16x8_array(bc.len(), |i| bc[i].d);
        for ((b, x), d) in bc.iter().zip(xc.chunks_exact(QK_K)).zip(ds) {
            let dsc: [f32; 16] = std::array::from_fn(|s| d * b.scale(s) as f32);
            for h in 0..2 {
                let (ql, qh, xp) = (
                    b.ql.as_ptr().add(64 * h),
                    b.qh.as_ptr().add(32 * h),
                    x.as_ptr().add(128 * h),
                );
                for g in 0..4 {
                    let (lo_a, lo_b, hb) = (
                        u8x8(ql.add(8 * g)),
                        u8x8(ql.add(32 + 8 * g)),
                        u8x8(qh.add(8 * g)),
                    );
                    let q = [
                        _mm256_or_si256(
                            _mm256_and_si256(lo_a, m15),
                            _mm256_slli_epi32(_mm256_and_si256(hb, m3), 4),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(lo_b, m15),
                            _mm256_and_si256(_mm256_slli_epi32(hb, 2), m48),
                        ),
                        _mm256_or_si256(_mm256_srli_epi32(lo_a, 4), _mm256_and_si256(hb, m48)),
                        _mm256_or_si256(
                            _mm256_srli_epi32(lo_b, 4),
                            _mm256_and_si256(_mm256_srli_epi32(hb, 2), m48),
                        ),
                    ];
                    for (k, q) in q.into_iter().enumerate() {
                        let w = _mm256_mul_ps(
                            _mm256_cvtepi32_ps(_mm256_sub_epi32(q, m32)),
                            _mm256_set1_ps(dsc[8 * h + 2 * k + g / 2]),
                        );
                        let xv = _mm256_loadu_ps(xp.add(32 * k + 8 * g));
                        acc[k] = _mm256_fmadd_ps(w, xv, acc[k]);
                    }
                }
            }
        }
    }
    hsum(sum4(acc))
}
