//! Device layouts of the "split" types, repacked at load so a lane reads one 32-weight block
//! with aligned vector loads: a nibble plane at `Qw::data` (16 bytes a block; byte j holds
//! weight j in its low nibble and weight j + 16 in its high one) and an aux plane at
//! `Qw::scales`. Q4_0's aux is the f16 scale (2 bytes a block). Q6_K's is 12 bytes a block,
//! grouped per 256-weight super-block (96 bytes, so a row's aux is contiguous): the 8 blocks'
//! high-bit words first (8 bytes each), then their scale words (4 bytes each). Q4_K's is 2.5
//! bytes a block, grouped per super-block (20 bytes, unpadded: 4 bytes of padding were 2.6% of
//! what a Q4_K weight read): d | dmin (f16 each), then each block's 6-bit scale and min
//! unpacked to a byte pair. All mirror `split_aux` and the `*Piece` structs in
//! kernels/quant.cuh.

use q4moe_gguf::quant::{blocks, BlockQ4K, BlockQ6K};
use q4moe_gguf::GgmlType;
use rayon::prelude::*;

/// ggml blocks a piece of `write_planes` repacks on one thread (0.3-3.4 MB of source): the
/// repack ran at ~1-2 GB/s on one core, most of a full-size model's load (NOTES session 20).
const PIECE_BLOCKS: usize = 1 << 14;

/// Q4_K's aux bytes a super-block (quant.cuh Q4_K_AUX).
const Q4_K_AUX: usize = 20;

/// Aux bytes of 8 32-weight blocks (a K-quant super-block) of a split type, or None for types
/// kept in ggml's bytes.
fn split_aux_bytes8(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 => Some(16),
        GgmlType::Q4_K => Some(Q4_K_AUX),
        GgmlType::Q6_K => Some(96),
        _ => None,
    }
}

/// Aux bytes of `blocks` 32-weight blocks of a split type (a K-quant's come in whole
/// super-blocks), or None for types kept in ggml's bytes.
pub fn aux_bytes(ty: GgmlType, blocks: usize) -> Option<usize> {
    split_aux_bytes8(ty).map(|a| blocks * a / 8)
}

/// Device bytes of `rows` rows of `k` weights (split types: both planes).
pub fn device_row_bytes(ty: GgmlType, k: usize) -> usize {
    match aux_bytes(ty, k / 32) {
        Some(aux) => k / 32 * 16 + aux,
        None => ty.row_bytes(k).unwrap_or(0),
    }
}

/// (nibble plane, aux plane) bytes of a split-type matrix of `src_len` ggml bytes; None for
/// other types.
pub fn plane_bytes(ty: GgmlType, src_len: usize) -> Option<(usize, usize)> {
    let blocks = src_len / ty.type_size() * (ty.block_size() / 32);
    Some((blocks * 16, aux_bytes(ty, blocks)?))
}

/// Writes a split-type matrix in ggml's bytes as its two planes (sized by `plane_bytes`), in
/// place, in parallel pieces; false (nothing written) for other types.
pub fn write_planes(ty: GgmlType, src: &[u8], nibbles: &mut [u8], aux: &mut [u8]) -> bool {
    write_planes_in(ty, src, nibbles, aux, PIECE_BLOCKS)
}

/// `write_planes` in pieces of `piece` ggml blocks, each piece into its own slices of the planes.
fn write_planes_in(
    ty: GgmlType,
    src: &[u8],
    nibbles: &mut [u8],
    aux: &mut [u8],
    piece: usize,
) -> bool {
    let subs = ty.block_size() / 32; // 32-weight blocks a ggml block
    let Some(aux_piece) = aux_bytes(ty, subs * piece) else {
        return false;
    };
    let pieces = src
        .par_chunks(ty.type_size() * piece)
        .zip(nibbles.par_chunks_mut(16 * subs * piece))
        .zip(aux.par_chunks_mut(aux_piece));
    pieces.for_each(|((s, n), a)| match ty {
        GgmlType::Q4_0 => q4_0_planes(s, n, a),
        GgmlType::Q4_K => q4_k_planes(s, n, a),
        GgmlType::Q6_K => q6_k_planes(s, n, a),
        _ => unreachable!("aux_bytes names only the split types"),
    });
    true
}

/// The two planes of a split-type matrix as new buffers; None for other types.
pub fn split_planes(ty: GgmlType, src: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let (n, a) = plane_bytes(ty, src.len())?;
    let (mut nibbles, mut aux) = (vec![0u8; n], vec![0u8; a]);
    write_planes(ty, src, &mut nibbles, &mut aux);
    Some((nibbles, aux))
}

fn q4_0_planes(src: &[u8], nibbles: &mut [u8], scales: &mut [u8]) {
    let planes = nibbles.chunks_exact_mut(16).zip(scales.chunks_exact_mut(2));
    for (b, (n, d)) in src.chunks_exact(18).zip(planes) {
        n.copy_from_slice(&b[2..18]);
        d.copy_from_slice(&b[0..2]);
    }
}

/// Sub-block j of a super-block (its 32 weights: nibble j % 2 of chunk j / 2's 32 bytes) in
/// Q4_0's nibble order, and the super-block's aux: d, dmin, then (scale, min) of each block.
fn q4_k_planes(src: &[u8], nibbles: &mut [u8], aux: &mut [u8]) {
    for (s, b) in blocks::<BlockQ4K>(src).iter().enumerate() {
        let a = &mut aux[s * Q4_K_AUX..(s + 1) * Q4_K_AUX];
        a[0..2].copy_from_slice(&b.d);
        a[2..4].copy_from_slice(&b.dmin);
        for j in 0..8 {
            let q = |l: usize| (b.qs[j / 2 * 32 + l] >> (4 * (j % 2))) & 15;
            let n = &mut nibbles[(s * 8 + j) * 16..(s * 8 + j + 1) * 16];
            for (m, byte) in n.iter_mut().enumerate() {
                *byte = q(m) | (q(m + 16) << 4);
            }
            let (sc, m) = b.scale_min(j);
            a[4 + 2 * j] = sc;
            a[5 + 2 * j] = m;
        }
    }
}

/// Per 32-weight block j of a super-block (half h = j / 4, quant k = j % 4: weights
/// 128h + 32k + l, l < 32): the low 4 bits as in Q4_0's nibble plane; high-bit words G0 (l < 16)
/// and G1 (l >= 16) with the 2 high bits of weight 4w + b (of its half) at bits 8b + 2w, so the
/// kernel lifts them next to nibble word w with one shift and mask; the scale word
/// d (f16) | scales[8h + 2k] << 16 | scales[8h + 2k + 1] << 24.
fn q6_k_planes(src: &[u8], nibbles: &mut [u8], aux: &mut [u8]) {
    for (s, b) in blocks::<BlockQ6K>(src).iter().enumerate() {
        let a = &mut aux[s * 96..s * 96 + 96];
        for j in 0..8 {
            let (h, k) = (j / 4, j % 4);
            let q = |l: usize| b.q(128 * h + 32 * k + l);
            let n = &mut nibbles[(s * 8 + j) * 16..(s * 8 + j + 1) * 16];
            let (mut g0, mut g1) = (0u32, 0u32);
            for (m, byte) in n.iter_mut().enumerate() {
                *byte = (q(m) & 15) | ((q(m + 16) & 15) << 4);
                let at = 8 * (m % 4) + 2 * (m / 4);
                g0 |= ((q(m) >> 4) as u32) << at;
                g1 |= ((q(m + 16) >> 4) as u32) << at;
            }
            a[8 * j..8 * j + 4].copy_from_slice(&g0.to_le_bytes());
            a[8 * j + 4..8 * j + 8].copy_from_slice(&g1.to_le_bytes());
            let sc = [
                b.d[0],
                b.d[1],
                b.scales[8 * h + 2 * k],
                b.scales[8 * h + 2 * k + 1],
            ];
            a[64 + 4 * j..68 + 4 * j].copy_from_slice(&sc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use q4moe_gguf::quant::{dequantize_row, quantize_row};

    /// Weight i of a Q6_K matrix read from the planes the way the kernels read them.
    fn q6_k_weight(nibbles: &[u8], aux: &[u8], i: usize) -> f32 {
        let (bi, j) = (i / 32, i % 32);
        let m = j % 16;
        let byte = nibbles[bi * 16 + m];
        let low = if j < 16 { byte & 15 } else { byte >> 4 };
        let a = &aux[bi / 8 * 96..];
        let g = 8 * (bi % 8) + 4 * (j / 16);
        let g = u32::from_le_bytes(a[g..g + 4].try_into().unwrap());
        let high = (g >> (8 * (m % 4) + 2 * (m / 4))) & 3;
        let s = &a[64 + 4 * (bi % 8)..68 + 4 * (bi % 8)];
        let d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
        let sc = s[2 + j / 16] as i8 as f32;
        d * sc * (((high << 4) | low as u32) as i32 - 32) as f32
    }

    /// Weight i of a Q4_K matrix read from the planes the way the kernels read them.
    fn q4_k_weight(nibbles: &[u8], aux: &[u8], i: usize) -> f32 {
        let (bi, j) = (i / 32, i % 32);
        let byte = nibbles[bi * 16 + j % 16];
        let q = if j < 16 { byte & 15 } else { byte >> 4 };
        let a = &aux[bi / 8 * Q4_K_AUX..];
        let f = |o: usize| half::f16::from_le_bytes([a[o], a[o + 1]]).to_f32();
        let (sc, m) = (a[4 + 2 * (bi % 8)], a[5 + 2 * (bi % 8)]);
        f(0) * sc as f32 * q as f32 - f(2) * m as f32
    }

    #[test]
    fn q6_k_planes_hold_every_weight() {
        planes_hold_every_weight(GgmlType::Q6_K, q6_k_weight, 1e-6);
    }

    #[test]
    fn q4_k_planes_hold_every_weight() {
        // The kernels' (d * sc) * q - dmin * m is the CPU's association: the same bits.
        planes_hold_every_weight(GgmlType::Q4_K, q4_k_weight, 0.0);
    }

    /// Quantises random rows as `ty`, splits them into planes and reads every weight back with
    /// `weight` against ggml's dequantisation, within `rel` of it.
    fn planes_hold_every_weight(ty: GgmlType, weight: fn(&[u8], &[u8], usize) -> f32, rel: f32) {
        let k = 512;
        let x: Vec<f32> = (0..2 * k)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
            .collect();
        let mut raw = Vec::new();
        for row in x.chunks_exact(k) {
            quantize_row(ty, row, &mut raw).unwrap();
        }
        let mut want = vec![0f32; 2 * k];
        for (r, o) in want.chunks_exact_mut(k).enumerate() {
            let rb = ty.row_bytes(k).unwrap();
            dequantize_row(ty, &raw[r * rb..(r + 1) * rb], o).unwrap();
        }
        let (nibbles, aux) = split_planes(ty, &raw).unwrap();
        assert_eq!(nibbles.len() + aux.len(), device_row_bytes(ty, k) * 2);
        let mut distinct = std::collections::HashSet::new();
        for (i, w) in want.iter().enumerate() {
            let got = weight(&nibbles, &aux, i);
            // Q6_K: d * sc * (q - 32) in another association than the CPU's (d * sc) * (q - 32).
            assert!(
                (got - w).abs() <= rel * w.abs().max(1e-3),
                "{ty:?} weight {i}: {got} vs {w}"
            );
            distinct.insert(got.to_bits());
        }
        assert!(distinct.len() > 200, "the test matrix uses few levels");
    }

    #[test]
    fn pieces_write_the_planes_of_the_whole() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K] {
            let src: Vec<u8> = (0..37 * ty.type_size())
                .map(|i| (i * 7919 % 251) as u8)
                .collect();
            let (n, a) = plane_bytes(ty, src.len()).unwrap();
            let planes = |piece: usize| {
                let (mut nibbles, mut aux) = (vec![0u8; n], vec![0u8; a]);
                assert!(write_planes_in(ty, &src, &mut nibbles, &mut aux, piece));
                (nibbles, aux)
            };
            let whole = planes(37);
            assert!(whole.0.iter().any(|&b| b != 0) && whole.1.iter().any(|&b| b != 0));
            for piece in [1, 5, 36, 1000] {
                assert!(planes(piece) == whole, "{ty:?} in pieces of {piece}");
            }
        }
    }

    #[test]
    fn q4_0_planes_split_nibbles_and_scales() {
        let raw: Vec<u8> = (0..36u32).map(|i| (i * 37 % 251) as u8).collect();
        let (n, s) = split_planes(GgmlType::Q4_0, &raw).unwrap();
        assert_eq!(n, [&raw[2..18], &raw[20..36]].concat());
        assert_eq!(s, [raw[0], raw[1], raw[18], raw[19]]);
        assert!(split_planes(GgmlType::Q8_0, &raw).is_none());
    }
}
