//! Random quantised blocks generated directly (no f32 round trip), so a full-size model writes
//! at disk speed. Each generator centres its weights on zero with the requested standard
//! deviation; the nibbles and scales are uniform, so every code path of the format is exercised.

use half::f16;
use q4moe_gguf::GgmlType;

use crate::sampling::Rng;

/// Fills `out` (whole blocks of `ty`) with random weights of standard deviation `std`.
pub fn fill(ty: GgmlType, std: f32, rng: &mut Rng, out: &mut [u8]) {
    let bs = ty.type_size();
    debug_assert_eq!(out.len() % bs, 0);
    for block in out.chunks_exact_mut(bs) {
        match ty {
            GgmlType::Q4_0 => q4_0(std, rng, block),
            GgmlType::Q8_0 => q8_0(std, rng, block),
            GgmlType::Q4_K => q4_k(std, rng, block),
            GgmlType::Q6_K => q6_k(std, rng, block),
            GgmlType::F32 => block.copy_from_slice(&(gaussian(rng) * std).to_le_bytes()),
            other => unreachable!("synth never asks for {other}"),
        }
    }
}

/// Approximately normal (sum of four uniforms, rescaled to unit variance).
fn gaussian(rng: &mut Rng) -> f32 {
    let s: f32 = (0..4).map(|_| rng.next_f32()).sum();
    (s - 2.0) * 3.0f32.sqrt()
}

fn random_bytes(rng: &mut Rng, out: &mut [u8]) {
    for chunk in out.chunks_mut(8) {
        let r = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
}

/// Scale jitter in [0.75, 1.25) so blocks differ in magnitude, as trained weights do.
fn jitter(rng: &mut Rng) -> f32 {
    0.75 + 0.5 * rng.next_f32()
}

/// Q4_0: q in 1..=15 so w = d*(q-8) is symmetric; std of (q-8) is sqrt(224/12).
fn q4_0(std: f32, rng: &mut Rng, b: &mut [u8]) {
    let d = std * jitter(rng) / (224.0f32 / 12.0).sqrt();
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    random_bytes(rng, &mut b[2..]);
    for q in &mut b[2..] {
        let lo = 1 + (*q & 0x0F) % 15;
        let hi = 1 + (*q >> 4) % 15;
        *q = lo | (hi << 4);
    }
}

/// Q8_0: q uniform in -127..=127 (std ~73.3).
fn q8_0(std: f32, rng: &mut Rng, b: &mut [u8]) {
    let d = std * jitter(rng) / 73.3;
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    random_bytes(rng, &mut b[2..]);
    for q in &mut b[2..] {
        if *q == 0x80 {
            *q = 0x81;
        }
    }
}

/// Q4_K: per sub-block w = d*sc*q - dmin*m with dmin = 8d and m = round(sc*15/16), which
/// centres q in 0..=15 on 7.5. Layout: d, dmin (f16), 12 bytes of packed 6-bit scales/mins, 128 bytes nibbles.
fn q4_k(std: f32, rng: &mut Rng, b: &mut [u8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        sc[j] = 32 + (rng.next_u64() % 32) as u8;
        m[j] = ((sc[j] as f32) * 15.0 / 16.0).round() as u8;
    }
    let d = std * jitter(rng) / (47.5 * 4.61);
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(8.0 * d).to_le_bytes());
    let s = &mut b[4..16];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
    random_bytes(rng, &mut b[16..]);
}

/// Q6_K: ql[128], qh[64], scales[16] (i8), d (f16); w = d*sc*(q-32), q uniform in 0..64.
fn q6_k(std: f32, rng: &mut Rng, b: &mut [u8]) {
    random_bytes(rng, &mut b[..192]);
    for s in &mut b[192..208] {
        *s = 48 + (rng.next_u64() % 48) as u8;
    }
    let d = std * jitter(rng) / (71.5 * 18.47);
    b[208..210].copy_from_slice(&f16::from_f32(d).to_le_bytes());
}
