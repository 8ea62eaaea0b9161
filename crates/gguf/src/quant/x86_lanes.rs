//! Lane helpers shared by the AVX2 kernels (`x86`, `x86_q8`) and the AVX-512 ones (`x86_512`):
//! horizontal sums and f16 scale conversion. They sit below every kernel file, so no kernel
//! file imports another's helpers.

use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The f16 scales of up to 8 blocks as f32 lanes (missing ones are 0). Converting them in one
/// `vcvtph2ps` per 8 blocks matters: converting one at a time, LLVM inserts the half into a
/// register that holds the accumulator, chaining every block to the previous one (~3x slower).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16x8(n: usize, d: impl Fn(usize) -> [u8; 2]) -> __m256 {
    let mut h = [0u16; 8];
    for (i, h) in h.iter_mut().enumerate().take(n) {
        *h = u16::from_le_bytes(d(i));
    }
    _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()))
}

/// `f16x8` stored to an array, for per-block broadcasts.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16x8_array(n: usize, d: impl Fn(usize) -> [u8; 2]) -> [f32; 8] {
    to_array(f16x8(n, d))
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn to_array(v: __m256) -> [f32; 8] {
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), v);
    out
}

/// One f16 to f32 (tails and non-hot paths only; see `f16x8`).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16(b: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
    ))
}
