//! Unquantised rows: F32, F16, BF16 (scalar reference; SIMD versions live in `x86.rs`).

use super::{f16_to_f32, f32_to_f16};
use crate::GgmlType;

/// The largest |x|, compared on the bits of |x|: the same order as the floats for finite values,
/// and a NaN (above infinity) wins instead of being skipped as `f32::max` skips it, so a block
/// holding one gets a NaN scale and the dot products it meets stay non-finite (the CUDA
/// kernels' rule: non-finite inputs are never hidden).
pub(crate) fn abs_max(x: &[f32]) -> f32 {
    f32::from_bits(
        x.iter()
            .map(|v| v.to_bits() & 0x7fff_ffff)
            .max()
            .unwrap_or(0),
    )
}

pub(crate) fn dequantize_f32(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes(b.try_into().unwrap());
    }
}

pub(crate) fn dequantize_f16(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16_to_f32([b[0], b[1]]);
    }
}

#[inline]
pub(crate) fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
}

pub(crate) fn dequantize_bf16(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16_to_f32([b[0], b[1]]);
    }
}

pub(crate) fn quantize_f32(src: &[f32], out: &mut Vec<u8>) {
    for x in src {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], out: &mut Vec<u8>) {
    for &x in src {
        out.extend_from_slice(&f32_to_f16(x));
    }
}

/// As ggml_compute_fp32_to_bf16: NaN made quiet, otherwise round to nearest even.
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n >> 16) | 64) as u16;
    }
    ((n as u64 + (0x7fff + ((n >> 16) & 1)) as u64) >> 16) as u16
}

pub(crate) fn quantize_bf16(src: &[f32], out: &mut Vec<u8>) {
    for &x in src {
        out.extend_from_slice(&f32_to_bf16(x).to_le_bytes());
    }
}

pub(crate) fn vec_dot_ref(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let w: fn(&[u8]) -> f32 = match ty {
        GgmlType::F32 => |b| f32::from_le_bytes(b.try_into().unwrap()),
        GgmlType::F16 => |b| f16_to_f32([b[0], b[1]]),
        _ => |b| bf16_to_f32([b[0], b[1]]),
    };
    row.chunks_exact(ty.type_size())
        .zip(x)
        .map(|(b, &x)| w(b) * x)
        .sum()
}
