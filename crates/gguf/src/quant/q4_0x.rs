//! "Q8_0x8": Q8_0 activations re-laid out once per vector for the fast Q4_0 integer kernel.
//!
//! Per group of 8 Q8_0 blocks y0..y7 (256 weights), 320 bytes:
//!
//! | bytes                      | content |
//! |----------------------------|---------|
//! | 128p + 32h + 4b .. +4      | `yb.qs[4q..4q+4]`, q = 2p + h (p, h in 0..2, b in 0..8): pairs with low nibbles |
//! | 128p + 64 + 32h + 4b .. +4 | `yb.qs[16+4q..16+4q+4]`: pairs with high nibbles |
//! | 256..288                   | i32 x 8: `-8 * sum(yb.qs)` for b = 0..8 |
//! | 288..320                   | f32 x 8: `f16(yb.d)` for b = 0..8 |
//!
//! Every 32-byte piece holds 4 bytes of each block, block b at i32 lane b, and the kernel
//! transposes a group's weights to match (once per group, whatever the number of activations):
//! u8 x i8 products summed 4 at a time (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`) then land in
//! lane b with no horizontal adds, starting from the stored `-8 * sum(y)` (nibbles are
//! unsigned), which gives the same per-block integer sums as `vec_dot_q8` on plain Q8_0
//! activations. The scales then convert in one `vcvtph2ps` in natural order and a group costs
//! one convert and one FMA an activation. 64-byte halves (p) serve the 512-bit kernel.

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
        // A group at a time in a fixed array, then one append (not 96 small ones).
        let mut group = [0u8; GROUP_BYTES];
        for p in 0..2 {
            for (hi, high) in [0, 16].into_iter().enumerate() {
                for h in 0..2 {
                    let q = 2 * p + h;
                    for (b, y) in g.iter().enumerate() {
                        let at = 128 * p + 64 * hi + 32 * h + 4 * b;
                        group[at..at + 4].copy_from_slice(&y.qs[high + 4 * q..high + 4 * q + 4]);
                    }
                }
            }
        }
        for (b, y) in g.iter().enumerate() {
            let sum: i32 = y.qs.iter().map(|&q| q as i8 as i32).sum();
            group[256 + 4 * b..260 + 4 * b].copy_from_slice(&(-8 * sum).to_le_bytes());
            group[288 + 4 * b..292 + 4 * b].copy_from_slice(&f16_to_f32(y.d).to_le_bytes());
        }
        out.extend_from_slice(&group);
    }
}

/// One prepared group: each block's values and scale.
fn unpack(g: &[u8]) -> [([i8; 32], f32); GROUP_BLOCKS] {
    std::array::from_fn(|b| {
        let mut y = [0i8; 32];
        for j in 0..16 {
            let (q, i) = (j / 4, j % 4);
            let at = 128 * (q / 2) + 32 * (q % 2) + 4 * b + i;
            y[j] = g[at] as i8;
            y[16 + j] = g[at + 64] as i8;
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
            sum += f16_to_f32(b.d) * dy * block_sum(b, &y) as f32;
        }
    }
    sum
}

/// A block's exact integer dot: its weights (nibbles less 8) against the activation's 32 values.
fn block_sum(b: &BlockQ4_0, y: &[i8; 32]) -> i32 {
    b.values()
        .iter()
        .zip(y)
        .map(|(&w, &y)| w as i32 * y as i32)
        .sum()
}

/// The SIMD kernels' arithmetic in scalar code, bit for bit: lane b accumulates, group after
/// group, `fma(sum_b, d_w * d_a, acc_b)` of its block's exact integer sum; then the 8 lanes
/// are summed in `x86_lanes::hsum`'s order.
pub(crate) fn vec_dot_lanes(row: &[u8], act: &[u8]) -> f32 {
    let bs: &[BlockQ4_0] = blocks(row);
    let mut acc = [0f32; GROUP_BLOCKS];
    for (g, ga) in bs
        .chunks_exact(GROUP_BLOCKS)
        .zip(act.chunks_exact(GROUP_BYTES))
    {
        for ((acc, b), (y, dy)) in acc.iter_mut().zip(g).zip(unpack(ga)) {
            *acc = (block_sum(b, &y) as f32).mul_add(f16_to_f32(b.d) * dy, *acc);
        }
    }
    let s: [f32; 4] = std::array::from_fn(|i| acc[i] + acc[i + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}
