//! Q4_0 rows x Q8_0x8 activations (`q4_0x`): one activation or several per unpacked row.
//!
//! A group's weights are transposed once so that i32 lane b of every product vector holds only
//! block b's products (see `q4_0x`'s layout). Each activation then costs 8 u8 x i8 products
//! summed straight into its block sums, with no horizontal reduction; the transpose is paid
//! once per group however many activations share it. Every variant computes the same exact
//! i32 block sums and the same f32 operations in the same order, so all agree bit for bit.
//!
//! Variants: AVX2 (`vpmaddubsw`, sums in i16), AVX-VNNI (`vpdpbusd` on ymm), and AVX-512
//! (VBMI `vpermt2b` transposes a group in two permutes, `vpdpbusd` on zmm).

use std::arch::x86_64::*;

use super::q4_0x::{GROUP_BLOCKS, GROUP_BYTES};
use super::x86_lanes::hsum;
use super::{BlockQ4_0, Isa};

/// The kernel family for `isa` (the AVX-512 one also needs BW, DQ and VBMI).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    Avx2,
    AvxVnni,
    /// AVX512-VNNI + VL on ymm (32 registers).
    Vnni256,
    Avx512,
}

impl Kernel {
    pub(crate) fn of(isa: Isa) -> Kernel {
        match isa {
            Isa::Avx512Vnni if has_bw_dq_vbmi() => Kernel::Avx512,
            Isa::Avx512Vnni => Kernel::Vnni256,
            Isa::AvxVnni => Kernel::AvxVnni,
            _ => Kernel::Avx2,
        }
    }
}

fn has_bw_dq_vbmi() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vbmi")
    })
}

/// The f16 scales of 8 consecutive Q4_0 blocks (18-byte stride) as f32 lanes, gathered in
/// general-purpose registers (idle in this loop) so the vector ports only see one convert.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales8(b: *const BlockQ4_0) -> __m256 {
    let d = |i: usize| u16::from_le_bytes((*b.add(i)).d) as u64;
    let lo = d(0) | d(1) << 16 | d(2) << 32 | d(3) << 48;
    let hi = d(4) | d(5) << 16 | d(6) << 32 | d(7) << 48;
    _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
}

/// Offset in a prepared group of the activations paired with the low nibbles of dword `q`
/// (the high nibbles' are 64 bytes on).
const fn lo_at(q: usize) -> usize {
    128 * (q / 2) + 32 * (q % 2)
}

/// A group's weights for the 256-bit kernels: for dword q = 0..4, `[low, high]` nibbles with
/// lane b holding block b's bytes 4q..4q+4 (a 4x4 dword transpose per 128-bit half).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles256(b: *const BlockQ4_0) -> [[__m256i; 2]; 4] {
    let r: [__m256i; 4] = std::array::from_fn(|k| {
        let lo = _mm_loadu_si128((*b.add(k)).qs.as_ptr().cast());
        let hi = _mm_loadu_si128((*b.add(k + 4)).qs.as_ptr().cast());
        _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1)
    });
    let (a, c) = (
        _mm256_unpacklo_epi32(r[0], r[1]),
        _mm256_unpacklo_epi32(r[2], r[3]),
    );
    let (e, f) = (
        _mm256_unpackhi_epi32(r[0], r[1]),
        _mm256_unpackhi_epi32(r[2], r[3]),
    );
    let t = [
        _mm256_unpacklo_epi64(a, c),
        _mm256_unpackhi_epi64(a, c),
        _mm256_unpacklo_epi64(e, f),
        _mm256_unpackhi_epi64(e, f),
    ];
    let m4 = _mm256_set1_epi8(15);
    t.map(|t| {
        [
            _mm256_and_si256(t, m4),
            _mm256_and_si256(_mm256_srli_epi16(t, 4), m4),
        ]
    })
}

/// `acc` plus one group: block sums as i32 lanes, converted, scaled by `d_w * d_a`, FMA'd.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn finish(acc: __m256, s: __m256i, d_w: __m256, y: *const u8) -> __m256 {
    let d = _mm256_mul_ps(d_w, _mm256_loadu_ps(y.add(288).cast()));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc)
}

/// AVX2: products summed in i16 (8 vectors of pairs, each <= 2 * 15 * 128: at most 30720),
/// widened once, plus the stored -8 * sum(y).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(acc: __m256, w: &[[__m256i; 2]; 4], d_w: __m256, y: *const u8) -> __m256 {
    let p: [__m256i; 4] = std::array::from_fn(|q| {
        let yq = y.add(lo_at(q));
        _mm256_add_epi16(
            _mm256_maddubs_epi16(w[q][0], _mm256_loadu_si256(yq.cast())),
            _mm256_maddubs_epi16(w[q][1], _mm256_loadu_si256(yq.add(64).cast())),
        )
    });
    let p = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    let s = _mm256_add_epi32(
        _mm256_madd_epi16(p, _mm256_set1_epi16(1)),
        _mm256_loadu_si256(y.add(256).cast()),
    );
    finish(acc, s, d_w, y)
}

/// AVX-VNNI: two `vpdpbusd` chains, the first started from the stored -8 * sum(y).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn dot_avxvnni(acc: __m256, w: &[[__m256i; 2]; 4], d_w: __m256, y: *const u8) -> __m256 {
    let mut s0 = _mm256_loadu_si256(y.add(256).cast());
    let mut s1 = _mm256_setzero_si256();
    for (q, w) in w.iter().enumerate() {
        let yq = y.add(lo_at(q));
        s0 = _mm256_dpbusd_avx_epi32(s0, w[0], _mm256_loadu_si256(yq.cast()));
        s1 = _mm256_dpbusd_avx_epi32(s1, w[1], _mm256_loadu_si256(yq.add(64).cast()));
    }
    finish(acc, _mm256_add_epi32(s0, s1), d_w, y)
}

/// AVX512-VNNI on ymm (VL): as `dot_avxvnni`, for CPUs without VBMI or AVX-VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dot_vnni256(acc: __m256, w: &[[__m256i; 2]; 4], d_w: __m256, y: *const u8) -> __m256 {
    let mut s0 = _mm256_loadu_si256(y.add(256).cast());
    let mut s1 = _mm256_setzero_si256();
    for (q, w) in w.iter().enumerate() {
        let yq = y.add(lo_at(q));
        s0 = _mm256_dpbusd_epi32(s0, w[0], _mm256_loadu_si256(yq.cast()));
        s1 = _mm256_dpbusd_epi32(s1, w[1], _mm256_loadu_si256(yq.add(64).cast()));
    }
    finish(acc, _mm256_add_epi32(s0, s1), d_w, y)
}

/// `vpermt2b` indices taking, from 64 bytes at group byte `8p` (indices < 64) and 64 at
/// `72 + 8p` (>= 64), dwords 2p (low 256 bits) and 2p + 1 (high) of each block's `qs`, block
/// b in dword lane b. Both passes share it: the windows move with p.
static TRANSPOSE_512: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        let (h, b, i) = (j / 32, (j % 32) / 4, j % 4);
        t[j] = ((b / 4) * 64 + (b % 4) * 18 + 2 + 4 * h + i) as u8;
        j += 1;
    }
    t
};

/// `vpermt2w` indices taking the 8 blocks' f16 scales (words 9b of the group's first 64
/// bytes for b < 4, of the 64 at byte 72 for b >= 4) into the low 8 words.
static SCALES_512: [u16; 32] = {
    let mut t = [0u16; 32];
    let mut b = 0;
    while b < 8 {
        t[b] = ((b / 4) * 32 + (b % 4) * 9) as u16;
        b += 1;
    }
    t
};

/// A group's weights for the 512-bit kernel: for p = 0, 1, `[low, high]` nibbles of dwords
/// 2p and 2p + 1 (as `nibbles256`'s q = 2p in the low half, q = 2p + 1 in the high half);
/// and the 8 weight scales as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
unsafe fn nibbles512(b: *const BlockQ4_0) -> ([[__m512i; 2]; 2], __m256) {
    let g = b.cast::<u8>();
    let idx = _mm512_loadu_si512(TRANSPOSE_512.as_ptr().cast());
    let m4 = _mm512_set1_epi8(15);
    // Four 64-byte windows inside the group's 144 bytes: never a byte past the row.
    let a: [__m512i; 2] = std::array::from_fn(|p| _mm512_loadu_si512(g.add(8 * p).cast()));
    let c: [__m512i; 2] = std::array::from_fn(|p| _mm512_loadu_si512(g.add(72 + 8 * p).cast()));
    let w = std::array::from_fn(|p| {
        let t = _mm512_permutex2var_epi8(a[p], idx, c[p]);
        [
            _mm512_and_si512(t, m4),
            _mm512_and_si512(_mm512_srli_epi16(t, 4), m4),
        ]
    });
    let d = _mm512_permutex2var_epi16(a[0], _mm512_loadu_si512(SCALES_512.as_ptr().cast()), c[0]);
    (w, _mm256_cvtph_ps(_mm512_castsi512_si128(d)))
}

/// A group's block sums against one activation as zmm: 16 i32 lanes, block b's in lanes b
/// and 8 + b; the stored -8 * sum(y) in the low half.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn sums512(w: &[[__m512i; 2]; 2], y: *const u8) -> __m512i {
    let ld = |o: usize| _mm512_loadu_si512(y.add(o).cast());
    let s = _mm512_zextsi256_si512(_mm256_loadu_si256(y.add(256).cast()));
    let s = _mm512_dpbusd_epi32(s, w[0][0], ld(0));
    let s = _mm512_dpbusd_epi32(s, w[0][1], ld(64));
    let s = _mm512_dpbusd_epi32(s, w[1][0], ld(128));
    _mm512_dpbusd_epi32(s, w[1][1], ld(192))
}

/// AVX-512, one activation: `sums512` with its halves folded.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn dot512(acc: __m256, w: &[[__m512i; 2]; 2], d_w: __m256, y: *const u8) -> __m256 {
    let s = sums512(w, y);
    let s = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s));
    finish(acc, s, d_w, y)
}

/// AVX-512, two activations `a` (low half) and `b` (high half) of a zmm accumulator: their
/// halves folded together, then one convert, scale and FMA for both (lane for lane the same
/// operations as `finish`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn dot512x2(
    acc: __m512,
    w: &[[__m512i; 2]; 2],
    d_w: __m512,
    a: *const u8,
    b: *const u8,
) -> __m512 {
    let (sa, sb) = (sums512(w, a), sums512(w, b));
    let s = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0x44>(sa, sb),
        _mm512_shuffle_i64x2::<0xee>(sa, sb),
    );
    let d_a = _mm512_insertf32x8::<1>(
        _mm512_castps256_ps512(_mm256_loadu_ps(a.add(288).cast())),
        _mm256_loadu_ps(b.add(288).cast()),
    );
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d_w, d_a), acc)
}

/// The 512-bit kernel's `n` (see the macro): activations in pairs, an odd last one alone.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn n512<const N: usize>(bs: &[BlockQ4_0], ys: &[&[u8]], out: &mut [f32]) {
    let groups = bs.len() / GROUP_BLOCKS;
    let y: [*const u8; N] = std::array::from_fn(|j| {
        debug_assert!(ys[j].len() >= groups * GROUP_BYTES);
        ys[j].as_ptr()
    });
    // Only the first N / 2 are used (no const arithmetic in array lengths).
    let mut acc2 = [_mm512_setzero_ps(); N];
    let mut acc1 = _mm256_setzero_ps();
    for g in 0..groups {
        let b = bs.as_ptr().add(GROUP_BLOCKS * g);
        let (w, d_w) = nibbles512(b);
        let d_w2 = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(d_w), d_w);
        let o = GROUP_BYTES * g;
        for p in 0..N / 2 {
            acc2[p] = dot512x2(acc2[p], &w, d_w2, y[2 * p].add(o), y[2 * p + 1].add(o));
        }
        if N % 2 == 1 {
            acc1 = dot512(acc1, &w, d_w, y[N - 1].add(o));
        }
    }
    for p in 0..N / 2 {
        out[2 * p] = hsum(_mm512_castps512_ps256(acc2[p]));
        out[2 * p + 1] = hsum(_mm512_extractf32x8_ps::<1>(acc2[p]));
    }
    if N % 2 == 1 {
        out[N - 1] = hsum(acc1);
    }
}

/// Bytes ahead of the row being read that the row loops prefetch. The hardware prefetchers
/// stop at 4 KB page boundaries, so a streamed matrix stalls on a demand miss (and a TLB walk)
/// at each new page; prefetching a page ahead keeps the next page's lines in flight.
const PREFETCH_AHEAD: usize = 4096;

/// Prefetches row `r`'s bytes `PREFETCH_AHEAD` on, never at or past `limit`.
#[inline(always)]
unsafe fn prefetch_row(r: *const u8, row_bytes: usize, limit: usize) {
    let mut line = (r as usize + PREFETCH_AHEAD) & !63;
    let end = (r as usize + PREFETCH_AHEAD + row_bytes).min(limit);
    while line < end {
        _mm_prefetch::<_MM_HINT_T0>(line as *const i8);
        line += 64;
    }
}

/// Stamps out one variant's entry points: `q4_0x` (one row, one activation), `rows` (rows,
/// one activation) and `rows_acts` (rows, up to `$wide` activations per unpacked group), from
/// a group's weights (`$nibbles`) and one activation's dot with them (`$dot`), or from an `n`
/// given whole (`@`).
macro_rules! q4x_kernels {
    ($name:ident, $features:literal, $nibbles:ident, $dot:ident, $wide:literal) => {
        q4x_kernels!(@ $name, $features, $wide, {
            /// `out[j] = q4_0x(bs, ys[j])` for exactly N activations, each group unpacked once.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn n<const N: usize>(bs: &[BlockQ4_0], ys: &[&[u8]], out: &mut [f32]) {
                let groups = bs.len() / GROUP_BLOCKS;
                let y: [*const u8; N] = std::array::from_fn(|j| {
                    debug_assert!(ys[j].len() >= groups * GROUP_BYTES);
                    ys[j].as_ptr()
                });
                let mut acc = [_mm256_setzero_ps(); N];
                for g in 0..groups {
                    let b = bs.as_ptr().add(GROUP_BLOCKS * g);
                    let (w, d_w) = ($nibbles(b), scales8(b));
                    for j in 0..N {
                        acc[j] = $dot(acc[j], &w, d_w, y[j].add(GROUP_BYTES * g));
                    }
                }
                for j in 0..N {
                    out[j] = hsum(acc[j]);
                }
            }
        });
    };
    (@ $name:ident, $features:literal, $wide:literal, { $($n:tt)* }) => {
        pub(crate) mod $name {
            use super::*;

            $($n)*

            /// Q4_0 row x Q8_0x8 activations. `bs.len()` is a multiple of 8 and `act` holds
            /// `bs.len() / 8` prepared groups.
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn q4_0x(bs: &[BlockQ4_0], act: &[u8]) -> f32 {
                let mut out = [0f32];
                n::<1>(bs, &[act], &mut out);
                out[0]
            }

            /// `out[j] = q4_0x(bs, acts[j])` for every j.
            #[target_feature(enable = $features)]
            unsafe fn acts(bs: &[BlockQ4_0], acts: &[&[u8]], out: &mut [f32]) {
                for (ys, o) in acts.chunks($wide).zip(out.chunks_mut($wide)) {
                    match ys.len() {
                        8 => n::<8>(bs, ys, o),
                        7 => n::<7>(bs, ys, o),
                        6 => n::<6>(bs, ys, o),
                        5 => n::<5>(bs, ys, o),
                        4 => n::<4>(bs, ys, o),
                        3 => n::<3>(bs, ys, o),
                        2 => n::<2>(bs, ys, o),
                        _ => n::<1>(bs, ys, o),
                    }
                }
            }

            /// `out[i] = q4_0x(row i, act)` for `out.len()` consecutive rows of `row_bytes`,
            /// prefetching ahead (never past `rows`).
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn rows(rows: &[u8], row_bytes: usize, act: &[u8], out: &mut [f32]) {
                debug_assert!(rows.len() >= out.len() * row_bytes);
                let nb = row_bytes / std::mem::size_of::<BlockQ4_0>();
                let base = rows.as_ptr();
                let limit = base as usize + rows.len();
                for (i, o) in out.iter_mut().enumerate() {
                    let r = base.add(i * row_bytes);
                    prefetch_row(r, row_bytes, limit);
                    *o = q4_0x(std::slice::from_raw_parts(r.cast::<BlockQ4_0>(), nb), act);
                }
            }

            /// `acts` for each of the first `out.len() / acts.len()` rows of `rows` into its
            /// `acts.len()` outputs, prefetching ahead (never past `rows`).
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn rows_acts(
                rows: &[u8],
                row_bytes: usize,
                ys: &[&[u8]],
                out: &mut [f32],
            ) {
                let nb = row_bytes / std::mem::size_of::<BlockQ4_0>();
                let base = rows.as_ptr();
                let limit = base as usize + rows.len();
                for (i, o) in out.chunks_mut(ys.len()).enumerate() {
                    let r = base.add(i * row_bytes);
                    prefetch_row(r, row_bytes, limit);
                    acts(std::slice::from_raw_parts(r.cast::<BlockQ4_0>(), nb), ys, o);
                }
            }
        }
    };
}

// 4 activations at a time on AVX2/AVX-VNNI: with 16 registers, more accumulators spill.
q4x_kernels!(avx2, "avx2,fma,f16c", nibbles256, dot_avx2, 4);
q4x_kernels!(avxvnni, "avx2,fma,f16c,avxvnni", nibbles256, dot_avxvnni, 4);
q4x_kernels!(
    vnni256,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    nibbles256,
    dot_vnni256,
    8
);
q4x_kernels!(@ avx512, "avx512f,avx512bw,avx512vbmi,avx512vnni,avx512vl,avx512dq,avx2,fma,f16c", 8, {
    use super::n512 as n;
});

/// `vec_dot_q4_0x` for one row.
///
/// # Safety
/// The CPU has `k`'s features; `act` holds `bs.len() / 8` groups.
pub(crate) unsafe fn q4_0x(k: Kernel, bs: &[BlockQ4_0], act: &[u8]) -> f32 {
    match k {
        Kernel::Avx2 => avx2::q4_0x(bs, act),
        Kernel::AvxVnni => avxvnni::q4_0x(bs, act),
        Kernel::Vnni256 => vnni256::q4_0x(bs, act),
        Kernel::Avx512 => avx512::q4_0x(bs, act),
    }
}

/// `vec_dot_q4_0x_rows`.
///
/// # Safety
/// As `q4_0x`, for `out.len()` rows of `row_bytes` in `rows`.
pub(crate) unsafe fn q4_0x_rows(
    k: Kernel,
    rows: &[u8],
    row_bytes: usize,
    act: &[u8],
    out: &mut [f32],
) {
    match k {
        Kernel::Avx2 => avx2::rows(rows, row_bytes, act, out),
        Kernel::AvxVnni => avxvnni::rows(rows, row_bytes, act, out),
        Kernel::Vnni256 => vnni256::rows(rows, row_bytes, act, out),
        Kernel::Avx512 => avx512::rows(rows, row_bytes, act, out),
    }
}

/// `vec_dot_q4_0x_rows_acts`.
///
/// # Safety
/// As `q4_0x`, for `out.len() / acts.len()` rows of `row_bytes` in `rows` and every activation.
pub(crate) unsafe fn q4_0x_rows_acts(
    k: Kernel,
    rows: &[u8],
    row_bytes: usize,
    acts: &[&[u8]],
    out: &mut [f32],
) {
    match k {
        Kernel::Avx2 => avx2::rows_acts(rows, row_bytes, acts, out),
        Kernel::AvxVnni => avxvnni::rows_acts(rows, row_bytes, acts, out),
        Kernel::Vnni256 => vnni256::rows_acts(rows, row_bytes, acts, out),
        Kernel::Avx512 => avx512::rows_acts(rows, row_bytes, acts, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{q4_0x, quantize_activation_q4_0x, quantize_row};
    use crate::GgmlType;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Every kernel this CPU runs, `Vnni256` included (no `Isa` reaches it where VBMI is
    /// present), matches the scalar lane model bit for bit on 1..=9 activations.
    #[test]
    fn every_kernel_matches_the_lane_model() {
        use std::arch::is_x86_feature_detected as has;
        let f = |s: &str| {
            crate::quant::detected_isa() >= Isa::Avx2
                && match s {
                    "avxvnni" => has!("avxvnni"),
                    "vnni256" => has!("avx512f") && has!("avx512vnni") && has!("avx512vl"),
                    "avx512" => {
                        has!("avx512f")
                            && has!("avx512vnni")
                            && has!("avx512vl")
                            && has_bw_dq_vbmi()
                    }
                    _ => true,
                }
        };
        let kernels: Vec<Kernel> = [
            ("avx2", Kernel::Avx2),
            ("avxvnni", Kernel::AvxVnni),
            ("vnni256", Kernel::Vnni256),
            ("avx512", Kernel::Avx512),
        ]
        .into_iter()
        .filter(|(s, _)| f(s))
        .map(|(_, k)| k)
        .collect();
        let mut rng = StdRng::seed_from_u64(23);
        let (n, rows) = (768usize, 4usize);
        let mut data = Vec::new();
        for _ in 0..rows {
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            quantize_row(GgmlType::Q4_0, &x, &mut data).unwrap();
        }
        let row_bytes = data.len() / rows;
        let acts: Vec<Vec<u8>> = (0..9)
            .map(|_| {
                let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                let mut a = Vec::new();
                quantize_activation_q4_0x(&x, &mut a);
                a
            })
            .collect();
        for k in kernels {
            for count in 1..=acts.len() {
                let refs: Vec<&[u8]> = acts[..count].iter().map(|a| a.as_slice()).collect();
                let mut out = vec![0f32; rows * count];
                // SAFETY: the kernel's features were detected above; lengths match.
                unsafe { q4_0x_rows_acts(k, &data, row_bytes, &refs, &mut out) };
                for (r, got) in out.chunks(count).enumerate() {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    for (got, a) in got.iter().zip(&refs) {
                        let want = q4_0x::vec_dot_lanes(row, a);
                        assert_eq!(got.to_bits(), want.to_bits(), "{k:?} N={count} row {r}");
                    }
                }
            }
        }
    }
}
