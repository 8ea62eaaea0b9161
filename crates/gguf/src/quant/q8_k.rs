//! Q8_K: the activation format for Q4_K/Q6_K integer dot products (never stored in files).

use super::{nearest_int, push_blocks, Block, QK_K};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8K {
    /// f32 scale, little-endian bytes.
    pub d: [u8; 4],
    pub qs: [i8; QK_K],
    /// Sums of each 16 `qs`, i16 little-endian: lets the Q4_K min term skip a pass over `qs`.
    pub bsums: [[u8; 2]; 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);
impl Block for BlockQ8K {}

impl BlockQ8K {
    #[inline]
    pub fn d(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }

    #[inline]
    pub fn bsum(&self, g: usize) -> i32 {
        i16::from_le_bytes(self.bsums[g]) as i32
    }
}

/// Symmetric: d = amax/127, q = round_half_even(x/d). Keeping |q| <= 127 lets the SIMD
/// kernels use sign tricks and maddubs without saturation.
pub(crate) fn quantize(src: &[f32], out: &mut Vec<u8>) {
    debug_assert_eq!(src.len() % QK_K, 0);
    for x in src.chunks_exact(QK_K) {
        let amax = super::float::abs_max(x);
        let mut b = BlockQ8K {
            d: [0; 4],
            qs: [0; QK_K],
            bsums: [[0; 2]; 16],
        };
        if amax > 0.0 {
            let iscale = 127.0 / amax;
            for (q, &v) in b.qs.iter_mut().zip(x) {
                *q = nearest_int(iscale * v).clamp(-127, 127) as i8;
            }
            b.d = (1.0 / iscale).to_le_bytes();
        } else if amax.is_nan() {
            // A NaN scale carries the NaN into every dot product (see `abs_max`).
            b.d = f32::NAN.to_le_bytes();
        }
        for (g, s) in b.bsums.iter_mut().enumerate() {
            let sum: i32 = b.qs[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum();
            *s = (sum as i16).to_le_bytes();
        }
        push_blocks(out, &[b]);
    }
}
