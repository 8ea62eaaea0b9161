//! AVX-512 kernels for f32 activations on 4-bit rows. A 4-bit value indexes a 16-entry table
//! of the block's dequantised weights with one `vpermps` (`_mm512_permutexvar_ps`), so a weight
//! costs a permute and an FMA instead of the shift/convert/scale chain of the AVX2 kernels.
//! Table entries are computed exactly as the reference does, so the weights are bit-identical.

use std::arch::x86_64::*;

use super::x86_lanes::f16x8_array;
use super::{BlockQ4K, BlockQ4_0, BlockQ8_0, QK_K};

/// Table lane `q` holds `q` as f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn iota16() -> __m512 {
    _mm512_setr_ps(
        0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
    )
}

/// Sixteen bytes at `p`, zero-extended to i32 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn u8x16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_0(bs: &[BlockQ4_0], x: &[f32]) -> f32 {
    let (m15, eight) = (_mm512_set1_epi32(15), _mm512_set1_ps(8.0));
    let minus8 = _mm512_sub_ps(iota16(), eight);
    // Four accumulators: with fewer, the FMA latency would bound a block.
    let mut acc = [_mm512_setzero_ps(); 4];
    for (bc, xc) in bs.chunks(8).zip(x.chunks(256)) {
        let ds = f16x8_array(bc.len(), |i| bc[i].d);
        for (i, ((b, x), d)) in bc.iter().zip(xc.chunks_exact(32)).zip(ds).enumerate() {
            let j = 2 * (i % 2);
            // Reference weight: d * (q - 8), one rounding.
            let table = _mm512_mul_ps(minus8, _mm512_set1_ps(d));
            let q = u8x16(b.qs.as_ptr());
            let lo = _mm512_permutexvar_ps(_mm512_and_si512(q, m15), table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
            acc[j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x.as_ptr()), acc[j]);
            acc[j + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x.as_ptr().add(16)), acc[j + 1]);
        }
    }
    sum4(acc)
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0(bs: &[BlockQ8_0], x: &[f32]) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 4];
    for (bc, xc) in bs.chunks(8).zip(x.chunks(256)) {
        let ds = f16x8_array(bc.len(), |i| bc[i].d);
        for (i, ((b, x), d)) in bc.iter().zip(xc.chunks_exact(32)).zip(ds).enumerate() {
            let dv = _mm512_set1_ps(d);
            for (h, acc) in acc[2 * (i % 2)..2 * (i % 2) + 2].iter_mut().enumerate() {
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.qs.as_ptr().add(16 * h).cast()));
                let w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), dv);
                *acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(x.as_ptr().add(16 * h)), *acc);
            }
        }
    }
    sum4(acc)
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k(bs: &[BlockQ4K], x: &[f32]) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 4];
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
    sum4(acc)
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn q4_k_block(b: &BlockQ4K, x: &[f32], d: f32, dmin: f32, acc: &mut [__m512; 4]) {
    let m15 = _mm512_set1_epi32(15);
    // Reference weight: (d*sc)*q - dmin*m, rounded as the scalar code rounds it.
    let table = |s: usize| {
        let (sc, m) = b.scale_min(s);
        _mm512_sub_ps(
            _mm512_mul_ps(iota16(), _mm512_set1_ps(d * sc as f32)),
            _mm512_set1_ps(dmin * m as f32),
        )
    };
    for c in 0..4 {
        let (t0, t1) = (table(2 * c), table(2 * c + 1));
        let xp = x.as_ptr().add(64 * c);
        for h in 0..2 {
            let q = u8x16(b.qs.as_ptr().add(32 * c + 16 * h));
            let lo = _mm512_permutexvar_ps(_mm512_and_si512(q, m15), t0);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t1);
            acc[h] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp.add(16 * h)), acc[h]);
            acc[2 + h] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp.add(32 + 16 * h)), acc[2 + h]);
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn sum4(a: [__m512; 4]) -> f32 {
    _mm512_reduce_add_ps(_mm512_add_ps(
        _mm512_add_ps(a[0], a[1]),
        _mm512_add_ps(a[2], a[3]),
    ))
}
