//! Q4_0: 32 weights per block, one f16 scale, 4-bit offsets around 8.

use super::{f16_to_f32, f32_to_f16, push_blocks, Block, BlockQ8_0};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
impl Block for BlockQ4_0 {}

impl BlockQ4_0 {
    /// The 32 signed 4-bit values, in weight order.
    #[inline]
    pub fn values(&self) -> [i8; 32] {
        let mut v = [0i8; 32];
        for j in 0..16 {
            v[j] = (self.qs[j] & 15) as i8 - 8;
            v[j + 16] = (self.qs[j] >> 4) as i8 - 8;
        }
        v
    }
}

pub(crate) fn dequantize(bs: &[BlockQ4_0], out: &mut [f32]) {
    for (b, o) in bs.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_to_f32(b.d);
        for (o, q) in o.iter_mut().zip(b.values()) {
            *o = d * q as f32;
        }
    }
}

/// Bit-exact with ggml's quantize_row_q4_0_ref and gguf-py: the signed value of largest
/// magnitude maps to -8, so the scale's sign carries it.
pub(crate) fn quantize(src: &[f32], out: &mut Vec<u8>) {
    let bs: Vec<BlockQ4_0> = src.chunks_exact(32).map(quantize_block).collect();
    push_blocks(out, &bs);
}

fn quantize_block(x: &[f32]) -> BlockQ4_0 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = |v: f32| ((v * id + 8.5).trunc() as u8).min(15);
    let mut qs = [0u8; 16];
    for j in 0..16 {
        qs[j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
    BlockQ4_0 {
        d: f32_to_f16(d),
        qs,
    }
}

pub(crate) fn vec_dot_ref(bs: &[BlockQ4_0], x: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, x) in bs.iter().zip(x.chunks_exact(32)) {
        let d = f16_to_f32(b.d);
        let s: f32 = b.values().iter().zip(x).map(|(&q, &x)| q as f32 * x).sum();
        sum += d * s;
    }
    sum
}

pub(crate) fn vec_dot_q8_ref(bs: &[BlockQ4_0], xq: &[BlockQ8_0]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in bs.iter().zip(xq) {
        let s: i32 = b
            .values()
            .iter()
            .zip(&y.qs)
            .map(|(&q, &y)| q as i32 * y as i8 as i32)
            .sum();
        sum += f16_to_f32(b.d) * f16_to_f32(y.d) * s as f32;
    }
    sum
}
