//! "Q8_0x2": Q8_0 activations re-laid out once per vector for the fast Q4_0 integer kernel.
//!
//! Per pair of Q8_0 blocks A = 2p, B = 2p + 1 (64 weights), 128 bytes:
//!
//! | bytes    | content |
//! |----------|---------|
//! | 0..32    | `A.qs[0..16] ++ B.qs[0..16]`  (pairs with the low nibbles of `A.qs ++ B.qs`) |
//! | 32..64   | `A.qs[16..32] ++ B.qs[16..32]` (pairs with the high nibbles) |
//! | 64..96   | i32 x 8: `8 * sum(A.qs)` in lane 0, `8 * sum(B.qs)` in lane 4, zeros elsewhere |
//! | 96..128  | f32 x 8: `f16(A.d)` in lanes 0..4, `f16(B.d)` in lanes 4..8 |
//!
//! With it a pair of Q4_0 rows' blocks needs no sign tricks: unsigned nibbles times signed
//! activations (`vpmaddubsw`), minus the precomputed `8 * sum(y)` offset term. Integer sums per
//! block are identical to `vec_dot_q8` on plain Q8_0 activations.

use super::{blocks, f16_to_f32, BlockQ4_0, BlockQ8_0};

/// Bytes of prepared activations per 64 elements.
pub const PAIR_BYTES: usize = 128;

/// Re-lays out Q8_0 blocks (an even number) as Q8_0x2, appending to `out`.
pub(crate) fn from_q8_0(ys: &[BlockQ8_0], out: &mut Vec<u8>) {
    assert_eq!(ys.len() % 2, 0, "Q8_0x2 needs an even number of blocks");
    out.reserve(ys.len() / 2 * PAIR_BYTES);
    for p in ys.chunks_exact(2) {
        let (a, b) = (&p[0], &p[1]);
        out.extend_from_slice(&a.qs[..16]);
        out.extend_from_slice(&b.qs[..16]);
        out.extend_from_slice(&a.qs[16..]);
        out.extend_from_slice(&b.qs[16..]);
        let sum = |y: &BlockQ8_0| 8 * y.qs.iter().map(|&q| q as i8 as i32).sum::<i32>();
        let mut corr = [0i32; 8];
        corr[0] = sum(a);
        corr[4] = sum(b);
        for c in corr {
            out.extend_from_slice(&c.to_le_bytes());
        }
        let (da, db) = (f16_to_f32(a.d), f16_to_f32(b.d));
        for i in 0..8 {
            out.extend_from_slice(&(if i < 4 { da } else { db }).to_le_bytes());
        }
    }
}

/// One prepared pair: (values of A, values of B, scale A, scale B).
fn unpack(p: &[u8]) -> ([i8; 32], [i8; 32], f32, f32) {
    let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
    for j in 0..16 {
        a[j] = p[j] as i8;
        b[j] = p[16 + j] as i8;
        a[16 + j] = p[32 + j] as i8;
        b[16 + j] = p[48 + j] as i8;
    }
    let f = |o: usize| f32::from_le_bytes(p[o..o + 4].try_into().unwrap());
    (a, b, f(96), f(112))
}

/// Scalar reference: exact integer sums per block, f32 scaling (as `q4_0::vec_dot_q8_ref`).
pub(crate) fn vec_dot_ref(row: &[u8], act: &[u8]) -> f32 {
    let bs: &[BlockQ4_0] = blocks(row);
    let mut sum = 0f32;
    for (p, pa) in bs.chunks_exact(2).zip(act.chunks_exact(PAIR_BYTES)) {
        let (ya, yb, da, db) = unpack(pa);
        for (b, y, dy) in [(&p[0], ya, da), (&p[1], yb, db)] {
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

/// f16 bit pattern to f32 (every pattern: subnormals, infinities, NaN), usable in const context.
const fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: normalise.
            let mut e = 127 - 15 + 1;
            let mut m = man;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((m & 0x3ff) << 13)
        }
    } else if exp == 31 {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 127 - 15) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// Every f16 as f32 (256 KB; the few scales in use stay in L1/L2): a scalar scale conversion
/// that is two loads and no ALU work.
pub(crate) static F16_LUT: [f32; 65536] = {
    let mut t = [0f32; 65536];
    let mut i = 0;
    while i < 65536 {
        t[i] = f16_bits_to_f32(i as u16);
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    #[test]
    fn lut_matches_half() {
        for i in 0..=u16::MAX {
            let want = super::f16_to_f32(i.to_le_bytes());
            let got = super::F16_LUT[i as usize];
            assert!(
                want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                "{i:#x}: {want} vs {got}"
            );
        }
    }
}
