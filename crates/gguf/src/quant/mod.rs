//! Quantised block formats: scalar reference kernels beside SIMD ones, one file per family.
//!
//! Block layouts (all little-endian, byte-aligned, bit-exact with ggml and `gguf.quants`):
//!
//! | type | bytes / weights | layout | weight |
//! |------|-----------------|--------|--------|
//! | Q4_0 | 18 / 32  | `d: f16, qs: [u8; 16]` | `w[j] = d*((qs[j] & 15) - 8)`, `w[j+16] = d*((qs[j] >> 4) - 8)` |
//! | Q8_0 | 34 / 32  | `d: f16, qs: [i8; 32]` | `w[j] = d*qs[j]` |
//! | Q4_K | 144 / 256 | `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]` | 8 sub-blocks of 32 with 6-bit scale `sc[s]` and min `m[s]` packed in `scales`; `w = d*sc[s]*q - dmin*m[s]`; 64-weight chunk `c` reads `qs[32c..32c+32]`: low nibbles are sub-block `2c`, high nibbles `2c+1` |
//! | Q6_K | 210 / 256 | `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16` | 16 sub-blocks of 16; `w = d*scales[s]*(q - 32)` with the 6-bit `q` split as 4 low bits in `ql` and 2 high bits in `qh` (see `q6_k.rs`) |
//! | Q8_K | 292 / 256 | `d: f32, qs: [i8; 256], bsums: [i16; 16]` | activations only: `x = d*qs`, `bsums[g]` = sum of `qs[16g..16g+16]` |
//!
//! Every struct is `#[repr(C)]` with alignment 1 (multi-byte fields are byte arrays), so a
//! tensor's bytes in the mmap can be viewed as a block slice without copying.
//!
//! Two dot-product paths exist for weights times activations:
//! - `vec_dot`: f32 activations, each block dequantised in registers (exact f32 math).
//! - `vec_dot_q8`: activations quantised once per token by `quantize_activation_q8` (Q8_0 for
//!   Q4_0/Q8_0 weights, Q8_K for Q4_K/Q6_K), then integer dot products as in llama.cpp.

mod float;
mod q4_0;
pub mod q4_0x;
mod q4_k;
mod q6_k;
mod q8_0;
mod q8_k;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;
#[cfg(target_arch = "x86_64")]
mod x86_lanes;
#[cfg(target_arch = "x86_64")]
mod x86_q4x;
#[cfg(target_arch = "x86_64")]
mod x86_q8;

use crate::{GgmlType, GgufError, Result};

pub use q4_0::BlockQ4_0;
pub use q4_k::BlockQ4K;
pub use q6_k::BlockQ6K;
pub use q8_0::BlockQ8_0;
pub use q8_k::BlockQ8K;

/// Weights per K-quant super-block.
pub const QK_K: usize = 256;

/// A quantised block: plain bytes, alignment 1, every bit pattern valid. Sealed: only the
/// block types above implement it, which is what makes `blocks` sound.
pub trait Block: Copy + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::BlockQ4_0 {}
    impl Sealed for super::BlockQ8_0 {}
    impl Sealed for super::BlockQ4K {}
    impl Sealed for super::BlockQ6K {}
    impl Sealed for super::BlockQ8K {}
}

/// Views bytes (a tensor's, in the mmap) as blocks, without copying. Callers guarantee
/// `bytes.len()` is a multiple of the block size.
#[inline]
pub fn blocks<B: Block>(bytes: &[u8]) -> &[B] {
    debug_assert_eq!(std::mem::align_of::<B>(), 1);
    debug_assert_eq!(bytes.len() % std::mem::size_of::<B>(), 0);
    let n = bytes.len() / std::mem::size_of::<B>();
    // SAFETY: B is repr(C) of byte arrays (alignment 1, no padding, any bit pattern valid), and
    // n blocks fit in `bytes`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), n) }
}

/// Appends blocks to a byte vector.
pub(crate) fn push_blocks<B: Block>(out: &mut Vec<u8>, bs: &[B]) {
    // SAFETY: as in `blocks`: B is plain bytes.
    let bytes =
        unsafe { std::slice::from_raw_parts(bs.as_ptr().cast::<u8>(), std::mem::size_of_val(bs)) };
    out.extend_from_slice(bytes);
}

#[inline]
pub(crate) fn f16_to_f32(b: [u8; 2]) -> f32 {
    half::f16::from_le_bytes(b).to_f32()
}

#[inline]
pub(crate) fn f32_to_f16(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// ggml's `nearest_int`: round half to even.
#[inline]
pub(crate) fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// The instruction sets the fast kernels can use, best first. Detected once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA (+ F16C for F16 rows).
    Avx2,
    /// AVX2 kernels with 256-bit `vpdpbusd` from AVX-VNNI.
    AvxVnni,
    /// AVX2 kernels with 256-bit `vpdpbusd` from AVX512-VNNI + AVX512VL, and AVX-512F table
    /// lookups for f32 dots on Q4_0/Q4_K/Q8_0 rows.
    Avx512Vnni,
}

/// The best `Isa` this CPU supports.
pub fn detected_isa() -> Isa {
    use std::sync::atomic::{AtomicU8, Ordering};
    static CACHE: AtomicU8 = AtomicU8::new(u8::MAX);
    const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];
    let c = CACHE.load(Ordering::Relaxed);
    if let Some(&isa) = ALL.get(c as usize) {
        return isa;
    }
    let isa = detect();
    CACHE.store(
        ALL.iter().position(|&i| i == isa).unwrap() as u8,
        Ordering::Relaxed,
    );
    isa
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return Isa::Scalar;
        }
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
        {
            return Isa::Avx512Vnni;
        }
        if is_x86_feature_detected!("avxvnni") {
            return Isa::AvxVnni;
        }
        Isa::Avx2
    }
    #[cfg(not(target_arch = "x86_64"))]
    Isa::Scalar
}

/// The ISAs usable on this CPU (for tests and benchmarks that compare them).
pub fn available_isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni]
        .into_iter()
        .filter(|&i| isa_available(i))
        .collect()
}

/// Whether the kernels of `isa` can run on this CPU.
pub fn isa_available(isa: Isa) -> bool {
    let best = detected_isa();
    match isa {
        Isa::Scalar => true,
        Isa::Avx2 => best >= Isa::Avx2,
        Isa::Avx512Vnni => best == Isa::Avx512Vnni,
        Isa::AvxVnni => best >= Isa::AvxVnni && has_avxvnni(),
    }
}

/// Panics where `isa`'s kernels need features this CPU lacks: the `*_isa` entry points take an
/// ISA from their caller (tests, timing tools) and must never run an unsupported instruction.
#[cfg(target_arch = "x86_64")]
#[track_caller]
fn assert_available(isa: Isa) {
    assert!(
        isa_available(isa),
        "{isa:?} kernels requested on a CPU without them"
    );
}

fn has_avxvnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avxvnni");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn check_len(ty: GgmlType, what: &str, bytes: usize, n: usize) -> Result<()> {
    if !ty.is_supported() {
        return Err(GgufError::Other(format!(
            "{what}: type {ty} is not supported"
        )));
    }
    match ty.row_bytes(n) {
        Some(b) if b == bytes => Ok(()),
        Some(b) => Err(GgufError::Other(format!(
            "{what}: {n} {ty} elements need {b} bytes, got {bytes}"
        ))),
        None => Err(GgufError::Other(format!(
            "{what}: {n} elements is not a multiple of the {ty} block size {}",
            ty.block_size()
        ))),
    }
}

/// Decodes `out.len()` elements of type `ty` from `src` (exactly their bytes). Scalar reference,
/// bit-exact with `gguf.quants.dequantize`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<()> {
    check_len(ty, "dequantize_row", src.len(), out.len())?;
    match ty {
        GgmlType::F32 => float::dequantize_f32(src, out),
        GgmlType::F16 => float::dequantize_f16(src, out),
        GgmlType::BF16 => float::dequantize_bf16(src, out),
        GgmlType::Q8_0 => q8_0::dequantize(blocks(src), out),
        GgmlType::Q4_0 => q4_0::dequantize(blocks(src), out),
        GgmlType::Q4_K => q4_k::dequantize(blocks(src), out),
        GgmlType::Q6_K => q6_k::dequantize(blocks(src), out),
        _ => unreachable!("check_len rejects unsupported types"),
    }
    Ok(())
}

/// Encodes `src` as type `ty`, appending to `out`. Q4_0/Q8_0/F16/BF16 are bit-exact with
/// `gguf.quants.quantize`; Q4_K/Q6_K follow ggml's reference quantisers.
pub fn quantize_row(ty: GgmlType, src: &[f32], out: &mut Vec<u8>) -> Result<()> {
    let n_bytes = ty.row_bytes(src.len()).unwrap_or(0);
    check_len(ty, "quantize_row", n_bytes, src.len())?;
    out.reserve(n_bytes);
    match ty {
        GgmlType::F32 => float::quantize_f32(src, out),
        GgmlType::F16 => float::quantize_f16(src, out),
        GgmlType::BF16 => float::quantize_bf16(src, out),
        GgmlType::Q8_0 => q8_0::quantize(src, out),
        GgmlType::Q4_0 => q4_0::quantize(src, out),
        GgmlType::Q4_K => q4_k::quantize(src, out),
        GgmlType::Q6_K => q6_k::quantize(src, out),
        _ => unreachable!("check_len rejects unsupported types"),
    }
    Ok(())
}

/// Scalar reference dot product of one row of type `ty` with `x` (`x.len()` elements).
pub fn vec_dot_ref(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(
        ty.row_bytes(x.len()),
        Some(row.len()),
        "vec_dot_ref: {ty} row/x length mismatch"
    );
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => float::vec_dot_ref(ty, row, x),
        GgmlType::Q8_0 => q8_0::vec_dot_ref(blocks(row), x),
        GgmlType::Q4_0 => q4_0::vec_dot_ref(blocks(row), x),
        GgmlType::Q4_K => q4_k::vec_dot_ref(blocks(row), x),
        GgmlType::Q6_K => q6_k::vec_dot_ref(blocks(row), x),
        _ => panic!("vec_dot_ref: type {ty} is not supported"),
    }
}

/// Fast dot product of one row of type `ty` with `x`; same math as `vec_dot_ref` up to f32
/// summation order. The CPU backend's hot loop for f32 activations.
#[inline]
pub fn vec_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    vec_dot_isa(detected_isa(), ty, row, x)
}

/// `vec_dot` with an explicit ISA (must be one of `available_isas()`).
pub fn vec_dot_isa(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(
        ty.row_bytes(x.len()),
        Some(row.len()),
        "vec_dot: {ty} row/x length mismatch"
    );
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        assert_available(isa);
        // SAFETY: the features of `isa` were detected at run time (asserted above).
        return unsafe { x86::vec_dot_f32(isa, ty, row, x) };
    }
    let _ = isa;
    vec_dot_ref(ty, row, x)
}

/// The block type activations are quantised to for a dot with weights of type `ty`.
pub fn activation_type(ty: GgmlType) -> GgmlType {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 => GgmlType::Q8_0,
        GgmlType::Q4_K | GgmlType::Q6_K => GgmlType::Q8_K,
        _ => panic!("no integer dot product for {ty} weights"),
    }
}

/// Quantises activations `x` for `vec_dot_q8` against weights of type `ty_of_weights`, appending
/// Q8_0 blocks (Q4_0/Q8_0 weights) or Q8_K blocks (Q4_K/Q6_K weights) to `out`.
pub fn quantize_activation_q8(ty_of_weights: GgmlType, x: &[f32], out: &mut Vec<u8>) {
    match activation_type(ty_of_weights) {
        GgmlType::Q8_0 => {
            debug_assert_eq!(x.len() % 32, 0);
            for c in x.chunks_exact(32) {
                push_blocks(out, &[quantize_q8_0_block(c)]);
            }
        }
        _ => q8_k::quantize(x, out),
    }
}

/// Scalar reference of `vec_dot_q8`: exact integer sums per block, f32 scaling.
pub fn vec_dot_q8_ref(ty: GgmlType, row: &[u8], xq: &[u8]) -> f32 {
    debug_assert_q8_lengths(ty, row, xq);
    match ty {
        GgmlType::Q8_0 => q8_0::vec_dot_q8_ref(blocks(row), blocks(xq)),
        GgmlType::Q4_0 => q4_0::vec_dot_q8_ref(blocks(row), blocks(xq)),
        GgmlType::Q4_K => q4_k::vec_dot_q8_ref(blocks(row), blocks(xq)),
        GgmlType::Q6_K => q6_k::vec_dot_q8_ref(blocks(row), blocks(xq)),
        _ => panic!("vec_dot_q8: type {ty} has no integer dot product"),
    }
}

/// Integer dot product of one quantised row with activations from `quantize_activation_q8`.
#[inline]
pub fn vec_dot_q8(ty: GgmlType, row: &[u8], xq: &[u8]) -> f32 {
    vec_dot_q8_isa(detected_isa(), ty, row, xq)
}

/// `vec_dot_q8` with an explicit ISA (must be one of `available_isas()`).
pub fn vec_dot_q8_isa(isa: Isa, ty: GgmlType, row: &[u8], xq: &[u8]) -> f32 {
    debug_assert_q8_lengths(ty, row, xq);
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        assert_available(isa);
        // SAFETY: the features of `isa` were detected at run time (asserted above).
        return unsafe { x86::vec_dot_q8(isa, ty, row, xq) };
    }
    let _ = isa;
    vec_dot_q8_ref(ty, row, xq)
}

/// A rows-by-activations call's shapes: `out` a value for each of `out.len() / acts.len()`
/// rows and each activation, and `rows` holding those rows.
fn check_rows_acts(rows: &[u8], row_bytes: usize, acts: &[&[u8]], out: &[f32], what: &str) {
    let n = out.len() / acts.len().max(1);
    assert!(
        !acts.is_empty() && out.len() == n * acts.len() && rows.len() >= n * row_bytes,
        "{what}: rows, activations and outputs differ"
    );
}

/// `out[i * acts.len() + j] = vec_dot_q8(ty, row i, acts[j])` bit for bit, for the first
/// `out.len() / acts.len()` rows of `rows` (`row_bytes` each): a batch's tokens against a run of
/// rows. Q4_K and Q6_K rows are unpacked once for several activations; other types take one
/// `vec_dot_q8` a pair.
pub fn vec_dot_q8_rows_acts(
    ty: GgmlType,
    rows: &[u8],
    row_bytes: usize,
    acts: &[&[u8]],
    out: &mut [f32],
) {
    check_rows_acts(rows, row_bytes, acts, out, "vec_dot_q8_rows_acts");
    #[cfg(target_arch = "x86_64")]
    if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) && detected_isa() >= Isa::Avx2 {
        let act_bytes = activation_type(ty).row_bytes(row_bytes / ty.type_size() * ty.block_size());
        assert!(
            row_bytes % ty.type_size() == 0 && acts.iter().all(|a| Some(a.len()) == act_bytes),
            "vec_dot_q8_rows_acts: row and activations differ"
        );
        // SAFETY: AVX2 (with FMA and F16C) detected; whole blocks, activations of the rows'
        // length (asserted).
        return unsafe { x86_q8::k_rows_acts(ty, rows, row_bytes, acts, out) };
    }
    for (i, o) in out.chunks_mut(acts.len()).enumerate() {
        let row = &rows[i * row_bytes..(i + 1) * row_bytes];
        for (o, a) in o.iter_mut().zip(acts) {
            *o = vec_dot_q8(ty, row, a);
        }
    }
}

fn debug_assert_q8_lengths(ty: GgmlType, row: &[u8], xq: &[u8]) {
    if cfg!(debug_assertions) {
        let act = activation_type(ty);
        let n_blocks = row.len() / ty.type_size();
        assert_eq!(
            row.len() % ty.type_size(),
            0,
            "vec_dot_q8: {ty} row is not whole blocks"
        );
        let n = n_blocks * ty.block_size();
        assert_eq!(
            act.row_bytes(n),
            Some(xq.len()),
            "vec_dot_q8: {ty} row and {act} activations differ in length"
        );
    }
}

/// Whether `quantize_activation_q4_0x` / `vec_dot_q4_0x` apply: Q4_0 weights, rows of a whole
/// number of 256-weight groups.
pub fn q4_0x_applies(ty: GgmlType, n: usize) -> bool {
    ty == GgmlType::Q4_0 && n % GROUP_WEIGHTS == 0
}

/// Weights per Q8_0x8 group (`q4_0x`).
const GROUP_WEIGHTS: usize = 32 * q4_0x::GROUP_BLOCKS;

/// Bytes of `quantize_activation_q4_0x` output for `n` elements (a multiple of 256).
pub fn q4_0x_act_bytes(n: usize) -> usize {
    n / GROUP_WEIGHTS * q4_0x::GROUP_BYTES
}

/// Quantises `x` (a multiple of 256 elements) to Q8_0 exactly as `quantize_activation_q8` does,
/// laid out for `vec_dot_q4_0x` (see `q4_0x`), appending to `out`.
pub fn quantize_activation_q4_0x(x: &[f32], out: &mut Vec<u8>) {
    assert_eq!(
        x.len() % GROUP_WEIGHTS,
        0,
        "Q8_0x8 activations need a multiple of 256 elements"
    );
    out.reserve(q4_0x_act_bytes(x.len()));
    for c in x.chunks_exact(GROUP_WEIGHTS) {
        let group: [BlockQ8_0; q4_0x::GROUP_BLOCKS] =
            std::array::from_fn(|b| quantize_q8_0_block(&c[32 * b..]));
        q4_0x::from_q8_0(&group, out);
    }
}

/// One Q8_0 block of 32 values (SIMD where available; bit-exact with `q8_0::quantize`).
#[inline]
fn quantize_q8_0_block(x: &[f32]) -> BlockQ8_0 {
    #[cfg(target_arch = "x86_64")]
    if detected_isa() >= Isa::Avx2 {
        // SAFETY: AVX2/FMA/F16C detected; `x` holds 32 values.
        return unsafe { x86_q8::quantize_q8_0_block(&x[..32]) };
    }
    let mut v = Vec::with_capacity(34);
    q8_0::quantize(&x[..32], &mut v);
    blocks::<BlockQ8_0>(&v)[0]
}

/// Scalar reference of `vec_dot_q4_0x`.
pub fn vec_dot_q4_0x_ref(row: &[u8], act: &[u8]) -> f32 {
    q4_0x::vec_dot_ref(row, act)
}

/// Scalar model of `vec_dot_q4_0x`'s SIMD arithmetic, in the same order: bit for bit what every
/// ISA's kernel returns (tests hold them to it).
pub fn vec_dot_q4_0x_lanes(row: &[u8], act: &[u8]) -> f32 {
    q4_0x::vec_dot_lanes(row, act)
}

/// A Q4_0 row (a whole number of 256-weight groups) against `quantize_activation_q4_0x` output:
/// the same per-block integer sums as `vec_dot_q8`, fewer instructions per block.
#[inline]
pub fn vec_dot_q4_0x(row: &[u8], act: &[u8]) -> f32 {
    vec_dot_q4_0x_isa(detected_isa(), row, act)
}

/// `vec_dot_q4_0x` with an explicit ISA (must be one of `available_isas()`).
pub fn vec_dot_q4_0x_isa(isa: Isa, row: &[u8], act: &[u8]) -> f32 {
    let bs: &[BlockQ4_0] = blocks(row);
    assert!(
        bs.len() % q4_0x::GROUP_BLOCKS == 0
            && act.len() == bs.len() / q4_0x::GROUP_BLOCKS * q4_0x::GROUP_BYTES,
        "vec_dot_q4_0x: row and activations differ"
    );
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        assert_available(isa);
        // SAFETY: the features of `isa`'s kernel were detected at run time (asserted above);
        // lengths asserted.
        return unsafe { x86_q4x::q4_0x(x86_q4x::Kernel::of(isa), bs, act) };
    }
    let _ = isa;
    q4_0x::vec_dot_ref(row, act)
}

/// `out[i * acts.len() + j] = vec_dot_q4_0x(row i, acts[j])` bit for bit, for the first
/// `out.len() / acts.len()` rows of `rows` (`row_bytes` each): each row is read and unpacked
/// once for all the activations (a batch's tokens). The rest of `rows` (what the caller reads
/// next) is only prefetched.
pub fn vec_dot_q4_0x_rows_acts(rows: &[u8], row_bytes: usize, acts: &[&[u8]], out: &mut [f32]) {
    vec_dot_q4_0x_rows_acts_isa(detected_isa(), rows, row_bytes, acts, out)
}

/// `vec_dot_q4_0x_rows_acts` with an explicit ISA (must be one of `available_isas()`).
pub fn vec_dot_q4_0x_rows_acts_isa(
    isa: Isa,
    rows: &[u8],
    row_bytes: usize,
    acts: &[&[u8]],
    out: &mut [f32],
) {
    check_rows_acts(rows, row_bytes, acts, out, "vec_dot_q4_0x_rows_acts");
    assert!(
        row_bytes % GROUP_ROW_BYTES == 0,
        "vec_dot_q4_0x_rows_acts: rows of whole groups"
    );
    let act_bytes = row_bytes / GROUP_ROW_BYTES * q4_0x::GROUP_BYTES;
    assert!(
        acts.iter().all(|a| a.len() == act_bytes),
        "vec_dot_q4_0x_rows_acts: row and activations differ"
    );
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        assert_available(isa);
        // SAFETY: the features of `isa`'s kernel were detected at run time (asserted above);
        // n rows and activations of their length (asserted).
        unsafe { x86_q4x::q4_0x_rows_acts(x86_q4x::Kernel::of(isa), rows, row_bytes, acts, out) };
        return;
    }
    let _ = isa;
    for (i, o) in out.chunks_mut(acts.len()).enumerate() {
        let row = &rows[i * row_bytes..(i + 1) * row_bytes];
        for (o, a) in o.iter_mut().zip(acts) {
            *o = q4_0x::vec_dot_ref(row, a);
        }
    }
}

/// Bytes of a Q4_0 row per Q8_0x8 group.
const GROUP_ROW_BYTES: usize = std::mem::size_of::<BlockQ4_0>() * q4_0x::GROUP_BLOCKS;

/// `out[i] = vec_dot_q4_0x(row i of rows, act)` for `out.len()` consecutive rows of `row_bytes`
/// bytes each: one dispatch for many rows (rows of 768 weights are only ~100 cycles of work).
/// The rest of `rows` (what the caller reads next) is only prefetched.
pub fn vec_dot_q4_0x_rows(rows: &[u8], row_bytes: usize, act: &[u8], out: &mut [f32]) {
    vec_dot_q4_0x_rows_isa(detected_isa(), rows, row_bytes, act, out)
}

/// `vec_dot_q4_0x_rows` with an explicit ISA (must be one of `available_isas()`).
pub fn vec_dot_q4_0x_rows_isa(
    isa: Isa,
    rows: &[u8],
    row_bytes: usize,
    act: &[u8],
    out: &mut [f32],
) {
    assert!(
        rows.len() >= out.len() * row_bytes,
        "vec_dot_q4_0x_rows: too few rows"
    );
    assert!(
        row_bytes % GROUP_ROW_BYTES == 0
            && act.len() == row_bytes / GROUP_ROW_BYTES * q4_0x::GROUP_BYTES,
        "vec_dot_q4_0x_rows: row and activations differ"
    );
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        assert_available(isa);
        // SAFETY: the features of `isa`'s kernel were detected at run time (asserted above);
        // `out.len()` rows of the activations' length (asserted).
        unsafe { x86_q4x::q4_0x_rows(x86_q4x::Kernel::of(isa), rows, row_bytes, act, out) };
        return;
    }
    let _ = isa;
    for (i, o) in out.iter_mut().enumerate() {
        *o = q4_0x::vec_dot_ref(&rows[i * row_bytes..(i + 1) * row_bytes], act);
    }
}
