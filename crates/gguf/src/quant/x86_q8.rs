//! Integer dot products against quantised activations (llama.cpp's q4_0_q8_0, q8_0_q8_0,
//! q4_K_q8_K, q6_K_q8_K). The i8 pair-sum primitive is the only ISA-specific piece, so the
//! kernels are stamped out per ISA by a macro: `vpmaddubsw`+`vpmaddwd` on AVX2, one `vpdpbusd`
//! with VNNI. Q4_K/Q6_K fold their sub-block scales into `vpmaddwd`, where VNNI saves nothing,
//! so they run the AVX2 kernel on every ISA.

use std::arch::x86_64::*;

use super::x86_lanes::{f16x8, f16x8_array, hsum, to_array};
use super::{blocks, BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8K, BlockQ8_0, Isa};
use crate::GgmlType;

/// # Safety
/// The CPU must support `isa` (and AVX2, FMA, F16C).
pub(crate) unsafe fn vec_dot_q8(isa: Isa, ty: GgmlType, row: &[u8], xq: &[u8]) -> f32 {
    match (ty, isa) {
        (GgmlType::Q4_0, Isa::Avx512Vnni) => vnni512::q4_0(blocks(row), blocks(xq)),
        (GgmlType::Q4_0, Isa::AvxVnni) => avxvnni::q4_0(blocks(row), blocks(xq)),
        (GgmlType::Q4_0, _) => avx2::q4_0(blocks(row), blocks(xq)),
        (GgmlType::Q8_0, Isa::Avx512Vnni) => vnni512::q8_0(blocks(row), blocks(xq)),
        (GgmlType::Q8_0, Isa::AvxVnni) => avxvnni::q8_0(blocks(row), blocks(xq)),
        (GgmlType::Q8_0, _) => avx2::q8_0(blocks(row), blocks(xq)),
        (GgmlType::Q4_K, _) => q4_k(blocks(row), blocks(xq)),
        (GgmlType::Q6_K, _) => q6_k(blocks(row), blocks(xq)),
        _ => panic!("vec_dot_q8: type {ty} has no integer dot product"),
    }
}

/// Sum of u8*i8 products in groups of 4 bytes, added to i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_u8i8_avx2(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)),
    )
}

#[inline]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn dot_u8i8_avxvnni(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, a, b)
}

#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
unsafe fn dot_u8i8_vnni512(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, a, b)
}

/// The 32 nibbles of a Q4_0 block in weight order, minus 8, as i8.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4_0_bytes(qs: &[u8; 16]) -> __m256i {
    // The 16 bytes in both halves (a load-port broadcast, no shuffle), the upper half shifted
    // right by 4 with one variable shift: two ALU ops fewer than insert + shift.
    let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.as_ptr().cast()));
    let v = _mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4));
    _mm256_sub_epi8(
        _mm256_and_si256(v, _mm256_set1_epi8(15)),
        _mm256_set1_epi8(8),
    )
}

/// A 32-weight block with an f16 scale first.
trait Scaled {
    fn d(&self) -> [u8; 2];
}
impl Scaled for BlockQ4_0 {
    fn d(&self) -> [u8; 2] {
        self.d
    }
}
impl Scaled for BlockQ8_0 {
    fn d(&self) -> [u8; 2] {
        self.d
    }
}

/// Products of weight and activation scales for up to 8 blocks (see `x86::f16x8`).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales8<B: Scaled>(bc: &[B], yc: &[BlockQ8_0]) -> [f32; 8] {
    to_array(_mm256_mul_ps(
        f16x8(bc.len(), |i| bc[i].d()),
        f16x8(yc.len(), |i| yc[i].d),
    ))
}

macro_rules! q8_0_kernels {
    ($name:ident, $features:literal, $dot:ident) => {
        mod $name {
            use super::*;

            /// Signed i8 x i8 via |a| * (b with a's sign): the u8*i8 form `dot` needs.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot_i8(a: __m256i, b: __m256i) -> __m256 {
                let s = $dot(
                    _mm256_setzero_si256(),
                    _mm256_sign_epi8(a, a),
                    _mm256_sign_epi8(b, a),
                );
                _mm256_cvtepi32_ps(s)
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn q4_0(bs: &[BlockQ4_0], ys: &[BlockQ8_0]) -> f32 {
                // Four accumulators: one FMA chain would cap a block at the FMA latency.
                let mut acc = [_mm256_setzero_ps(); 4];
                for (bc, yc) in bs.chunks(8).zip(ys.chunks(8)) {
                    for (i, ((b, y), d)) in bc.iter().zip(yc).zip(scales8(bc, yc)).enumerate() {
                        let p = dot_i8(q4_0_bytes(&b.qs), _mm256_loadu_si256(y.qs.as_ptr().cast()));
                        acc[i % 4] = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc[i % 4]);
                    }
                }
                hsum(_mm256_add_ps(
                    _mm256_add_ps(acc[0], acc[1]),
                    _mm256_add_ps(acc[2], acc[3]),
                ))
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn q8_0(bs: &[BlockQ8_0], ys: &[BlockQ8_0]) -> f32 {
                // Four accumulators: one FMA chain would cap a block at the FMA latency.
                let mut acc = [_mm256_setzero_ps(); 4];
                for (bc, yc) in bs.chunks(8).zip(ys.chunks(8)) {
                    for (i, ((b, y), d)) in bc.iter().zip(yc).zip(scales8(bc, yc)).enumerate() {
                        let x = _mm256_loadu_si256(b.qs.as_ptr().cast());
                        let p = dot_i8(x, _mm256_loadu_si256(y.qs.as_ptr().cast()));
                        acc[i % 4] = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc[i % 4]);
                    }
                }
                hsum(_mm256_add_ps(
                    _mm256_add_ps(acc[0], acc[1]),
                    _mm256_add_ps(acc[2], acc[3]),
                ))
            }
        }
    };
}

q8_0_kernels!(avx2, "avx2,fma,f16c", dot_u8i8_avx2);
q8_0_kernels!(avxvnni, "avx2,fma,f16c,avxvnni", dot_u8i8_avxvnni);
q8_0_kernels!(
    vnni512,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    dot_u8i8_vnni512
);

/// Q4_K x Q8_K: per 64-weight chunk two `vpmaddubsw` (nibbles are unsigned, activations
/// |q| <= 127, so no saturation) scaled by `vpmaddwd`; the min term comes from `bsums`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k(bs: &[BlockQ4K], ys: &[BlockQ8K]) -> f32 {
    let mut out = [0f32];
    q4_k_acts::<1>(bs, &[ys], &mut out);
    out[0]
}

/// Activations `q4_k_acts` and `q6_k_acts` take at a call (each costs an accumulator register).
pub(crate) const Q4K_ACTS: usize = 4;

/// `out[j] = q4_k(bs, ys[j])` bit for bit, for up to `Q4K_ACTS` activations: a chunk's nibbles
/// and scales are unpacked once for all of them; each activation's integer sums are `q4_k`'s
/// (exact, in any order) and its f32 steps `q4_k`'s, in its order.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_acts<const N: usize>(bs: &[BlockQ4K], ys: &[&[BlockQ8K]], out: &mut [f32]) {
    let m4 = _mm256_set1_epi8(15);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut acc_m = [0f32; N];
    for (k, bc) in bs.chunks(4).enumerate() {
        let ds = f16x8_array(2 * bc.len(), |i| {
            if i % 2 == 0 {
                bc[i / 2].d
            } else {
                bc[i / 2].dmin
            }
        });
        for (i, b) in bc.iter().enumerate() {
            // Integer sums are exact, so a chunk's nibbles and scales serve every activation
            // before the next chunk's; the f32 steps below run per block in `q4_k`'s order.
            let y: [&BlockQ8K; N] = std::array::from_fn(|j| &ys[j][4 * k + i]);
            let mut sumi = [_mm256_setzero_si256(); N];
            let mut summ = [0i32; N];
            for c in 0..4 {
                let ((sc0, m0), (sc1, m1)) = (b.scale_min(2 * c), b.scale_min(2 * c + 1));
                let q4 = _mm256_loadu_si256(b.qs.as_ptr().add(32 * c).cast());
                let lo = _mm256_and_si256(q4, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
                let (s0, s1) = (_mm256_set1_epi16(sc0 as i16), _mm256_set1_epi16(sc1 as i16));
                for j in 0..N {
                    let y = y[j];
                    summ[j] += m0 as i32 * (y.bsum(4 * c) + y.bsum(4 * c + 1))
                        + m1 as i32 * (y.bsum(4 * c + 2) + y.bsum(4 * c + 3));
                    let q8 = y.qs.as_ptr().add(64 * c);
                    let pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(q8.cast()));
                    let ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(q8.add(32).cast()));
                    sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(pl, s0));
                    sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(ph, s1));
                }
            }
            for j in 0..N {
                let dy = y[j].d();
                acc[j] = _mm256_fmadd_ps(
                    _mm256_set1_ps(ds[2 * i] * dy),
                    _mm256_cvtepi32_ps(sumi[j]),
                    acc[j],
                );
                acc_m[j] += ds[2 * i + 1] * dy * summ[j] as f32;
            }
        }
    }
    for j in 0..N {
        out[j] = hsum(acc[j]) - acc_m[j];
    }
}

/// Q4_K or Q6_K rows x Q8_K activations: `out[i * acts.len() + j]` = row i . acts[j], each
/// `q4_k`'s or `q6_k`'s bits, for the first `out.len() / acts.len()` rows of `rows`; each row
/// unpacked once for every `Q4K_ACTS` activations.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; the rows are whole blocks of `ty` and every activation holds
/// as many Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn k_rows_acts(
    ty: GgmlType,
    rows: &[u8],
    row_bytes: usize,
    acts: &[&[u8]],
    out: &mut [f32],
) {
    let ys: Vec<&[BlockQ8K]> = acts.iter().map(|a| blocks(a)).collect();
    for (i, o) in out.chunks_mut(acts.len()).enumerate() {
        let row = &rows[i * row_bytes..(i + 1) * row_bytes];
        for (ys, o) in ys.chunks(Q4K_ACTS).zip(o.chunks_mut(Q4K_ACTS)) {
            match (ty, ys.len()) {
                (GgmlType::Q4_K, 4) => q4_k_acts::<4>(blocks(row), ys, o),
                (GgmlType::Q4_K, 3) => q4_k_acts::<3>(blocks(row), ys, o),
                (GgmlType::Q4_K, 2) => q4_k_acts::<2>(blocks(row), ys, o),
                (GgmlType::Q4_K, _) => q4_k_acts::<1>(blocks(row), ys, o),
                (GgmlType::Q6_K, 4) => q6_k_acts::<4>(blocks(row), ys, o),
                (GgmlType::Q6_K, 3) => q6_k_acts::<3>(blocks(row), ys, o),
                (GgmlType::Q6_K, 2) => q6_k_acts::<2>(blocks(row), ys, o),
                (GgmlType::Q6_K, _) => q6_k_acts::<1>(blocks(row), ys, o),
                _ => panic!("k_rows_acts: {ty} is not a K-quant with a batched kernel"),
            }
        }
    }
}

/// For Q6_K scale pair `p` (0..8): bytes selecting scales 2p (low 8) and 2p+1 (high 8).
static Q6_SCALE_SHUFFLE: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut p = 0;
    while p < 8 {
        let mut i = 0;
        while i < 16 {
            t[p][i] = (2 * p + i / 8) as u8;
            i += 1;
        }
        p += 1;
    }
    t
};

/// Q6_K x Q8_K: 6-bit values as unsigned (0..63) for `vpmaddubsw`, minus 32*q8 via a second
/// `vpmaddubsw`; each 32-weight group spans two scales, one per 128-bit lane.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k(bs: &[BlockQ6K], ys: &[BlockQ8K]) -> f32 {
    let mut out = [0f32];
    q6_k_acts::<1>(bs, &[ys], &mut out);
    out[0]
}

/// `out[j] = q6_k(bs, ys[j])` bit for bit, for up to `Q4K_ACTS` activations: a half-block's
/// 6-bit values and scales are built once for all of them; each activation's integer sums are
/// `q6_k`'s (exact, in any order) and its f32 step `q6_k`'s, in its order.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_acts<const N: usize>(bs: &[BlockQ6K], ys: &[&[BlockQ8K]], out: &mut [f32]) {
    let (m4, m2, m32) = (
        _mm256_set1_epi8(15),
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(32),
    );
    let mut acc = [_mm256_setzero_ps(); N];
    for (k8, bc) in bs.chunks(8).enumerate() {
        let ds = f16x8_array(bc.len(), |i| bc[i].d);
        for (i, (b, d)) in bc.iter().zip(ds).enumerate() {
            let y: [&BlockQ8K; N] = std::array::from_fn(|j| &ys[j][8 * k8 + i]);
            let scales = _mm_loadu_si128(b.scales.as_ptr().cast());
            let mut sumi = [_mm256_setzero_si256(); N];
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h).cast());
                let ql1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h + 32).cast());
                let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * h).cast());
                let high = |shift: i32| {
                    let v = match shift {
                        0 => qh,
                        2 => _mm256_srli_epi16(qh, 2),
                        4 => _mm256_srli_epi16(qh, 4),
                        _ => _mm256_srli_epi16(qh, 6),
                    };
                    _mm256_slli_epi16(_mm256_and_si256(v, m2), 4)
                };
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), high(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), high(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high(6)),
                ];
                for (k, q) in q.into_iter().enumerate() {
                    let shuf = _mm_loadu_si128(Q6_SCALE_SHUFFLE[4 * h + k].as_ptr().cast());
                    let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuf));
                    for j in 0..N {
                        let q8 = _mm256_loadu_si256(y[j].qs.as_ptr().add(128 * h + 32 * k).cast());
                        let p = _mm256_sub_epi16(
                            _mm256_maddubs_epi16(q, q8),
                            _mm256_maddubs_epi16(m32, q8),
                        );
                        sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(p, sc));
                    }
                }
            }
            for j in 0..N {
                let dy = y[j].d();
                acc[j] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
            }
        }
    }
    for j in 0..N {
        out[j] = hsum(acc[j]);
    }
}

/// One Q8_0 block of `x` (32 values), bit-exact with `q8_0::quantize` (round half away from
/// zero, saturating), AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0_block(x: &[f32]) -> BlockQ8_0 {
    debug_assert!(x.len() >= 32);
    let p = x.as_ptr();
    let sign = _mm256_set1_ps(-0.0);
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    // |x| compared as integers, as `float::abs_max` does: a NaN wins and makes the scale NaN.
    let a = v.map(|v| _mm256_castps_si256(_mm256_andnot_ps(sign, v)));
    let m = _mm256_max_epi32(_mm256_max_epi32(a[0], a[1]), _mm256_max_epi32(a[2], a[3]));
    let m = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    let m = _mm_max_epi32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epi32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    let amax = f32::from_bits(_mm_cvtsi128_si32(m) as u32);
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let q = v.map(|v| {
        let t = _mm256_mul_ps(v, id);
        let tr = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
        // |t - trunc(t)| is exact; at >= 0.5 step away from zero (f32::round).
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(t, tr));
        let step = _mm256_or_ps(_mm256_and_ps(t, sign), one);
        let r = _mm256_add_ps(
            tr,
            _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), step),
        );
        _mm256_cvttps_epi32(r)
    });
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut b = BlockQ8_0 {
        d: super::f32_to_f16(d),
        qs: [0; 32],
    };
    _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), w);
    b
}
