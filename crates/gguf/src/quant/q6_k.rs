//! Q6_K: 256-weight super-blocks of 16 sub-blocks (16 weights) with i8 scales and one f16 `d`.

use super::{f16_to_f32, f32_to_f16, nearest_int, push_blocks, Block, BlockQ8K, QK_K};

/// Weight `i` of a 128-weight half `h` (`i = 128h + 32k + l`, `k` in 0..4, `l` in 0..32) has
/// low 4 bits in `ql[64h + l + 32*(k&1)]` (low nibble for k < 2, high nibble for k >= 2) and
/// high 2 bits in `qh[32h + l] >> 2k`; its scale is `scales[8h + 2k + l/16]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    /// i8 values stored as bytes.
    pub scales: [u8; 16],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);
impl Block for BlockQ6K {}

impl BlockQ6K {
    /// Unsigned 6-bit value `i` (0..256); the weight is `d * scale * (q - 32)`.
    #[inline]
    pub fn q(&self, i: usize) -> u8 {
        let (h, k, l) = (i / 128, i % 128 / 32, i % 32);
        let low = self.ql[64 * h + l + 32 * (k & 1)];
        let low = if k < 2 { low & 15 } else { low >> 4 };
        low | (((self.qh[32 * h + l] >> (2 * k)) & 3) << 4)
    }

    #[inline]
    pub fn scale(&self, sub: usize) -> i8 {
        self.scales[sub] as i8
    }
}

pub(crate) fn dequantize(bs: &[BlockQ6K], out: &mut [f32]) {
    for (b, o) in bs.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        for (i, o) in o.iter_mut().enumerate() {
            // gguf-py association: (d*scale)*(q-32).
            *o = d * b.scale(sub_of(i)) as f32 * (b.q(i) as i32 - 32) as f32;
        }
    }
}

/// The 16-weight sub-block (scale index) of weight `i`.
#[inline]
fn sub_of(i: usize) -> usize {
    i / 16
}

pub(crate) fn vec_dot_ref(bs: &[BlockQ6K], x: &[f32]) -> f32 {
    let mut w = [0f32; QK_K];
    let mut sum = 0f32;
    for (b, x) in bs.iter().zip(x.chunks_exact(QK_K)) {
        dequantize(std::slice::from_ref(b), &mut w);
        sum += w.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
    }
    sum
}

pub(crate) fn vec_dot_q8_ref(bs: &[BlockQ6K], xq: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in bs.iter().zip(xq) {
        let mut sumi = 0i32;
        for s in 0..16 {
            let dot: i32 = (16 * s..16 * s + 16)
                .map(|i| (b.q(i) as i32 - 32) * y.qs[i] as i32)
                .sum();
            sumi += b.scale(s) as i32 * dot;
        }
        sum += f16_to_f32(b.d) * y.d() * sumi as f32;
    }
    sum
}

/// ggml's quantize_row_q6_K_ref: per sub-block a scale search (make_qx_quants), then the 16
/// scales quantised to i8 against the largest and the weights requantised against them.
pub(crate) fn quantize(src: &[f32], out: &mut Vec<u8>) {
    let bs: Vec<BlockQ6K> = src.chunks_exact(QK_K).map(quantize_block).collect();
    push_blocks(out, &bs);
}

fn quantize_block(x: &[f32]) -> BlockQ6K {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for s in 0..16 {
        scales[s] = make_qx_quants(32, &x[16 * s..16 * s + 16], &mut l[16 * s..16 * s + 16]);
        if scales[s].abs() > max_abs {
            max_abs = scales[s].abs();
            max_scale = scales[s];
        }
    }
    let mut b = BlockQ6K {
        ql: [0; 128],
        qh: [0; 64],
        scales: [0; 16],
        d: [0; 2],
    };
    if max_abs < 1e-15 {
        return b;
    }
    let iscale = -128.0 / max_scale;
    b.d = f32_to_f16(1.0 / iscale);
    for (q, s) in b.scales.iter_mut().zip(scales) {
        *q = nearest_int(iscale * s).clamp(-128, 127) as i8 as u8;
    }
    let d = f16_to_f32(b.d);
    for s in 0..16 {
        let ds = d * b.scale(s) as f32;
        if ds == 0.0 {
            continue;
        }
        for i in 16 * s..16 * s + 16 {
            l[i] = (nearest_int(x[i] / ds).clamp(-32, 31) + 32) as u8;
        }
    }
    pack(&l, &mut b);
    b
}

fn pack(l: &[u8; QK_K], b: &mut BlockQ6K) {
    for h in 0..2 {
        let (l, ql, qh) = (&l[128 * h..], &mut b.ql[64 * h..], &mut b.qh[32 * h..]);
        for i in 0..32 {
            ql[i] = (l[i] & 15) | ((l[i + 64] & 15) << 4);
            ql[i + 32] = (l[i + 32] & 15) | ((l[i + 96] & 15) << 4);
            qh[i] = (l[i] >> 4)
                | ((l[i + 32] >> 4) << 2)
                | ((l[i + 64] >> 4) << 4)
                | ((l[i + 96] >> 4) << 6);
        }
    }
}

/// ggml's make_qx_quants with rmse_type 1 (weights x^2): symmetric scale search around
/// nmax/max. Writes L = q + nmax and returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let q = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        x.iter().fold((0f32, 0f32), |(slx, sl2), &v| {
            let (w, li) = (v * v, q(iscale, v) as f32);
            (slx + w * v * li, sl2 + w * li * li)
        })
    };
    let mut iscale = -(nmax as f32) / max;
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let try_iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(try_iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            iscale = try_iscale;
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    for (l, &v) in l.iter_mut().zip(x) {
        *l = (q(iscale, v) + nmax) as u8;
    }
    scale
}
