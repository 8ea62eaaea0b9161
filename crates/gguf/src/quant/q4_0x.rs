//! "Q8_0x8": Q8_0 activations re-laid out once per vector for the fast Q4_0 integer kernel.
//!
//! Per group of 8 Q8_0 blocks y0..y7 (256 weights), 320 bytes:
//!
//! | bytes            | content |
//! |------------------|---------|
//! | 64k..64k+32      | `yk.qs[0..16] ++ y(k+4).qs[0..16]` for k = 0..4 (pairs with the low nibbles) |
//! | 64k+32..64k+64   | `yk.qs[16..32] ++ y(k+4).qs[16..32]` (pairs with the high nibbles) |
//! | 256..288         | i32 x 8: `8 * sum(yb.qs)` for b = 0..8 |
//! | 288..320         | f32 x 8: `f16(yb.d)` for b = 0..8 |
//!
//! Pairing block k with block k + 4 puts block b's integer sum in lane b after the kernel's
//! horizontal adds, so the 8 weight scales convert in one `vcvtph2ps` in natural order and a
//! group costs one subtract, one convert and one FMA. Unsigned nibbles times signed activations
//! (`vpmaddubsw`) minus the precomputed `8 * sum(y)` give the same per-block integer sums as
//! `vec_dot_q8` on plain Q8_0 activations.

use super::{blocks, f16_to_f32, BlockQ4_0, BlockQ8_0};

/// Q8_0 blocks per group.
pub const GROUP_BLOCKS: usize = 8;

/// Bytes of prepared activations per group (256 elements).
pub const GROUP_BYTES: usize = 320;

/// Re-lays out Q8_0 blocks (a multiple of 8) as Q8_0x8, appending to `out`.
pub(crate) fn from_q8_0(ys: &[BlockQ8_0], out: &mut Vec<u8>) {
    assert_eq!(
        ys.len() % GROUP_BLOCKS,
        0,
        "Q8_0x8 needs whole groups of 8 blocks"
    );
    out.reserve(ys.len() / GROUP_BLOCKS * GROUP_BYTES);
    for g in ys.chunks_exact(GROUP_BLOCKS) {
        for k in 0..4 {
            out.extend_from_slice(&g[k].qs[..16]);
            out.extend_from_slice(&g[k + 4].qs[..16]);
            out.extend_from_slice(&g[k].qs[16..]);
            out.extend_from_slice(&g[k + 4].qs[16..]);
        }
        for y in g {
            let sum: i32 = y.qs.iter().map(|&q| q as i8 as i32).sum();
            out.extend_from_slice(&(8 * sum).to_le_bytes());
        }
        for y in g {
            out.extend_from_slice(&f16_to_f32(y.d).to_le_bytes());
        }
    }
}

/// One prepared group: each block's values and scale.
fn unpack(g: &[u8]) -> [([i8; 32], f32); GROUP_BLOCKS] {
    std::array::from_fn(|b| {
        let (k, half) = (b % 4, 16 * (b / 4));
        let mut y = [0i8; 32];
        for j in 0..16 {
            y[j] = g[64 * k + half + j] as i8;
            y[16 + j] = g[64 * k + 32 + half + j] as i8;
        }
        let o = 288 + 4 * b;
        (y, f32::from_le_bytes(g[o..o + 4].try_into().unwrap()))
    })
}

/// Scalar reference: exact integer sums per block, f32 scaling (as `q4_0::vec_dot_q8_ref`).
pub(crate) fn vec_dot_ref(row: &[u8], act: &[u8]) -> f32 {
    let bs: &[BlockQ4_0] = blocks(row);
    let mut sum = 0f32;
    for (g, ga) in bs
        .chunks_exact(GROUP_BLOCKS)
        .zip(act.chunks_exact(GROUP_BYTES))
    {
        for (b, (y, dy)) in g.iter().zip(unpack(ga)) {
            let s: i32 = b
                .values()
                .iter()
                .zip(y)
                .map(|(&w, y)| w as i32 * y as i32)
                .sum();
            sum += f16_to_f32(b.d) * dy * s as f32;
        }
    }
    sum
}
