//! Q8_0: 32 weights per block, one f16 scale, signed bytes. Also the activation format for
//! Q4_0/Q8_0 integer dot products.

use super::{f16_to_f32, f32_to_f16, push_blocks, Block};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    /// i8 values stored as bytes.
    pub qs: [u8; 32],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
impl Block for BlockQ8_0 {}

pub(crate) fn dequantize(bs: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in bs.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_to_f32(b.d);
        for (o, &q) in o.iter_mut().zip(&b.qs) {
            *o = q as i8 as f32 * d;
        }
    }
}

/// Bit-exact with ggml's quantize_row_q8_0_ref and gguf-py (round half away from zero).
pub(crate) fn quantize(src: &[f32], out: &mut Vec<u8>) {
    debug_assert_eq!(src.len() % 32, 0);
    for x in src.chunks_exact(32) {
        let amax = super::float::abs_max(x);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut b = BlockQ8_0 {
            d: f32_to_f16(d),
            qs: [0; 32],
        };
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8 as u8;
        }
        push_blocks(out, &[b]);
    }
}

pub(crate) fn vec_dot_ref(bs: &[BlockQ8_0], x: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, x) in bs.iter().zip(x.chunks_exact(32)) {
        let s: f32 = b.qs.iter().zip(x).map(|(&q, &x)| q as i8 as f32 * x).sum();
        sum += f16_to_f32(b.d) * s;
    }
    sum
}

pub(crate) fn vec_dot_q8_ref(bs: &[BlockQ8_0], xq: &[BlockQ8_0]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in bs.iter().zip(xq) {
        let s: i32 =
            b.qs.iter()
                .zip(&y.qs)
                .map(|(&q, &y)| q as i8 as i32 * y as i8 as i32)
                .sum();
        sum += f16_to_f32(b.d) * f16_to_f32(y.d) * s as f32;
    }
    sum
}
