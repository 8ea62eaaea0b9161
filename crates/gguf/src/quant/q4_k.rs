//! Q4_K: 256-weight super-blocks of 8 sub-blocks (32 weights), each with a 6-bit scale and a
//! 6-bit min, themselves scaled by the f16 `d` and `dmin`. What Q4_K_M files use.

use super::{f16_to_f32, f32_to_f16, nearest_int, push_blocks, Block, BlockQ8K, QK_K};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    /// 8 scales and 8 mins, 6 bits each: bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7
    /// mins 0-3; bytes 8-11 hold the low 4 bits of scale/min 4-7, whose top 2 bits sit in the
    /// top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
impl Block for BlockQ4K {}

impl BlockQ4K {
    /// (scale, min) of sub-block `j` (ggml's get_scale_min_k4).
    #[inline]
    pub fn scale_min(&self, j: usize) -> (u8, u8) {
        let q = &self.scales;
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        }
    }

    /// 4-bit value `i` (0..256) of the super-block.
    #[inline]
    fn q(&self, i: usize) -> u8 {
        let byte = self.qs[i / 64 * 32 + i % 32];
        if i % 64 < 32 {
            byte & 15
        } else {
            byte >> 4
        }
    }
}

pub(crate) fn dequantize(bs: &[BlockQ4K], out: &mut [f32]) {
    for (b, o) in bs.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        for (s, o) in o.chunks_exact_mut(32).enumerate() {
            let (sc, m) = b.scale_min(s);
            // Same association as gguf-py: (d*sc)*q - dmin*m.
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            for (l, o) in o.iter_mut().enumerate() {
                *o = d1 * b.q(32 * s + l) as f32 - m1;
            }
        }
    }
}

pub(crate) fn vec_dot_ref(bs: &[BlockQ4K], x: &[f32]) -> f32 {
    let mut w = [0f32; QK_K];
    let mut sum = 0f32;
    for (b, x) in bs.iter().zip(x.chunks_exact(QK_K)) {
        dequantize(std::slice::from_ref(b), &mut w);
        sum += w.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
    }
    sum
}

pub(crate) fn vec_dot_q8_ref(bs: &[BlockQ4K], xq: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in bs.iter().zip(xq) {
        let (mut sumi, mut summ) = (0i32, 0i32);
        for s in 0..8 {
            let (sc, m) = b.scale_min(s);
            let dot: i32 = (0..32)
                .map(|l| b.q(32 * s + l) as i32 * y.qs[32 * s + l] as i32)
                .sum();
            sumi += sc as i32 * dot;
            summ += m as i32 * (y.bsum(2 * s) + y.bsum(2 * s + 1));
        }
        let dy = y.d();
        sum += f16_to_f32(b.d) * dy * sumi as f32 - f16_to_f32(b.dmin) * dy * summ as f32;
    }
    sum
}

/// ggml's quantize_row_q4_K_ref: per sub-block a weighted least-squares (scale, min) search
/// (make_qkx2_quants), then the 16 scales/mins quantised to 6 bits against the largest.
pub(crate) fn quantize(src: &[f32], out: &mut Vec<u8>) {
    let bs: Vec<BlockQ4K> = src.chunks_exact(QK_K).map(quantize_block).collect();
    push_blocks(out, &bs);
}

fn quantize_block(x: &[f32]) -> BlockQ4K {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) =
            make_qkx2_quants(15, xs, &weights, &mut l[32 * j..32 * j + 32], -1.0, 0.1, 20);
    }
    let max_scale = scales.iter().fold(0f32, |a, &b| a.max(b));
    let max_min = mins.iter().fold(0f32, |a, &b| a.max(b));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut b = BlockQ4K {
        d: f32_to_f16(max_scale / 63.0),
        dmin: f32_to_f16(max_min / 63.0),
        scales: [0; 12],
        qs: [0; 128],
    };
    for j in 0..8 {
        let ls = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
        let lm = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
        if j < 4 {
            b.scales[j] = ls;
            b.scales[j + 4] = lm;
        } else {
            b.scales[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            b.scales[j - 4] |= (ls >> 4) << 6;
            b.scales[j] |= (lm >> 4) << 6;
        }
    }
    // Requantise against the scales as stored, so rounding in them is compensated.
    let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
    for j in 0..8 {
        let (sc, m) = b.scale_min(j);
        let d1 = d * sc as f32;
        if d1 == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / d1).clamp(0, 15) as u8;
        }
    }
    for c in 0..4 {
        for i in 0..32 {
            b.qs[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
    b
}

/// Returns (scale, -min) such that x ≈ scale*L + min, L in 0..=nmax, min <= 0.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    w: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x.iter().fold(x[0], |a, &b| a.min(b));
    let max = x.iter().fold(x[0], |a, &b| a.max(b));
    let sum_w: f32 = w.iter().sum();
    let sum_x: f32 = w.iter().zip(x).map(|(w, x)| w * x).sum();
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let quant =
        |iscale: f32, min: f32, i: usize| nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
    let iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_err = 0f32;
    for i in 0..n {
        l[i] = quant(iscale, min, i);
        let diff = scale * l[i] as f32 + min - x[i];
        best_err += w[i] * diff * diff;
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        let iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            laux[i] = quant(iscale, min, i);
            let li = laux[i] as f32;
            sum_l += w[i] * li;
            sum_l2 += w[i] * li * li;
            sum_xl += w[i] * li * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det <= 0.0 {
            continue;
        }
        let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if this_min > 0.0 {
            this_min = 0.0;
            this_scale = sum_xl / sum_l2;
        }
        let err: f32 = (0..n)
            .map(|i| {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                w[i] * diff * diff
            })
            .sum();
        if err < best_err {
            l.copy_from_slice(&laux[..n]);
            best_err = err;
            scale = this_scale;
            min = this_min;
        }
    }
    (scale, -min)
}
