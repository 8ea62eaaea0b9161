"""Q4_K and Q6_K quantisers in numpy (gguf-py 0.19.0 dequantises them but cannot quantise).

They need not match llama.cpp's search for the best scales (the fixtures' reference runs on the
dequantised weights, so any valid block will do); they must pack blocks exactly as the format
says. `check` proves that: each quantiser also returns the values its codes stand for, computed
from the codes and scales here, and those must equal what `gguf.quants.dequantize` reads back
from the packed bytes, and lie within half a quantisation step of the input.

Layouts (ggml-common.h, QK_K = 256):
  block_q4_K: f16 d, f16 dmin, u8 scales[12] (8 six-bit scales and 8 six-bit mins), u8 qs[128]
              (4-bit codes; byte j*32+l holds element 64j+l low, 64j+32+l high); x = d*sc*q - dmin*m
  block_q6_K: u8 ql[128] (low 4 bits), u8 qh[64] (high 2 bits), i8 scales[16], f16 d;
              x = d*scale*(q - 32), a scale a 16 elements
"""
import numpy as np
import gguf

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: [n, 256] f32 -> (blocks [n, 144] u8, the values the codes stand for [n, 256] f32)."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # a min of 0 at most: the format subtracts dmin * m >= 0
    hi = sub.max(-1)
    scale, mins = (hi - lo) / 15.0, -lo
    d = _f16(scale.max(-1) / 63.0)
    dmin = _f16(mins.max(-1) / 63.0)
    div = lambda a, b: np.divide(a, b[:, None], out=np.zeros_like(a), where=b[:, None] > 0)
    sc = np.clip(np.rint(div(scale, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(div(mins, dmin)), 0, 63).astype(np.uint8)
    eff = (d[:, None] * sc.astype(np.float32))[..., None]  # [n, 8, 1]
    off = (dmin[:, None] * m.astype(np.float32))[..., None]
    q = np.clip(np.rint(np.divide(sub + off, eff, out=np.zeros_like(sub), where=eff > 0)), 0, 15).astype(np.uint8)
    values = (eff * q.astype(np.float32) - off).reshape(n, QK_K)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # sub-blocks 2j (low nibble) and 2j+1 (high) share bytes
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    head = np.concatenate([d.astype(np.float16)[:, None], dmin.astype(np.float16)[:, None]], 1).view(np.uint8)
    return np.concatenate([head, scales, qs], 1), values


def quantize_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: [n, 256] f32 -> (blocks [n, 210] u8, the values the codes stand for [n, 256] f32)."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31.0
    d = _f16(scale.max(-1) / 127.0)
    sc = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, 127).astype(np.int8)
    eff = (d[:, None] * sc.astype(np.float32))[..., None]  # [n, 16, 1]
    q = np.clip(np.rint(np.divide(sub, eff, out=np.zeros_like(sub), where=eff > 0)), -32, 31)
    values = (eff * q).reshape(n, QK_K)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128
    low, high = u & 0x0F, u >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    qh = (high[:, :, 0:32] | (high[:, :, 32:64] << 2) | (high[:, :, 64:96] << 4) | (high[:, :, 96:128] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16)[:, None].view(np.uint8)], 1), values


QUANTIZERS = {
    gguf.GGMLQuantizationType.Q4_K: (quantize_q4_k, 144),
    gguf.GGMLQuantizationType.Q6_K: (quantize_q6_k, 210),
}


def quantize(x: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """x: [..., row] f32 (row a multiple of 256) -> packed rows [..., row / 256 * block bytes] u8,
    checked against gguf-py's dequantiser."""
    fn, size = QUANTIZERS[qtype]
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)
    blocks, values = fn(flat)
    check(flat, blocks, values, qtype)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // QK_K * size)


def check(x: np.ndarray, blocks: np.ndarray, values: np.ndarray, qtype) -> None:
    """The packed bytes decode (gguf-py) to exactly the values the codes were chosen for, and
    those are within half a step (plus f16 rounding of the scales) of the input."""
    back = gguf.quants.dequantize(blocks, qtype).reshape(values.shape)
    if not np.allclose(back, values, rtol=1e-6, atol=1e-7):
        raise AssertionError(f"{qtype.name}: packing broken: gguf-py reads back {np.abs(back - values).max():.3e} off")
    step = np.abs(x).reshape(x.shape[0], -1).max(-1, keepdims=True) / (7.0 if qtype.name == "Q4_K" else 31.0)
    err = np.abs(values - x).reshape(x.shape[0], -1)
    if not (err <= step + 1e-6).all():
        raise AssertionError(f"{qtype.name}: round trip error {err.max():.3e} exceeds a quantisation step")


def self_test(seed: int = 0) -> None:
    """Round-trips random, constant, all-zero and one-spike blocks through both quantisers, and
    shows `check` refuses a block with one byte of its codes changed."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (64, QK_K)).astype(np.float32)
    x[1] = 0.0
    x[2] = 0.37
    x[3] = 0.0
    x[3, 17] = -5.0
    x[4] = np.abs(x[4])
    for qtype, (fn, size) in QUANTIZERS.items():
        quantize(x, qtype)
        blocks, values = fn(x)
        blocks[5, size // 2] ^= 0x21
        try:
            check(x, blocks, values, qtype)
        except AssertionError:
            continue
        raise AssertionError(f"{qtype.name}: check accepted a corrupted block")
