#!/usr/bin/env python3
"""Bit-exact quant fixtures from gguf-py (`gguf.quants`), the outside reference for q4moe's
dequantize_row / quantize_row. See README.md.

Each fixture file (little-endian):
  magic b"Q4QF", u32 version=1, u32 kind (0 = dequantize, 1 = quantize), u32 ggml type id,
  u32 n_elements, u32 n_bytes, then
  kind 0: n_bytes raw blocks, then n_elements f32 = gguf.quants.dequantize(blocks)
  kind 1: n_elements f32 input, then n_bytes = gguf.quants.quantize(input)
"""
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

VERSION = 1
N = 4096  # elements per fixture: 16 K-quant super-blocks, 128 Q4_0 blocks
SEED = 20260

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "quant"


def write(name: str, kind: int, ty: T, n: int, first: bytes, second: bytes) -> None:
    n_bytes = len(first) if kind == 0 else len(second)
    head = b"Q4QF" + struct.pack("<5I", VERSION, kind, int(ty), n, n_bytes)
    path = OUT / name
    path.write_bytes(head + first + second)
    print(f"{path.relative_to(OUT.parents[1])}: {path.stat().st_size} bytes")


def sane_f16(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """Random positive/negative f16 scales of moderate size (no NaN, inf or zero)."""
    mag = rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)
    return mag.astype(np.float16)


def random_blocks(rng: np.random.Generator, ty: T) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[ty]
    nb = N // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    if ty in (T.Q4_0, T.Q8_0):
        raw[:, 0:2] = sane_f16(rng, nb, 1e-3, 2.0).view(np.uint8).reshape(nb, 2)
    elif ty == T.Q4_K:  # d, dmin: positive, as real quantisers write
        raw[:, 0:2] = np.abs(sane_f16(rng, nb, 1e-4, 0.1)).view(np.uint8).reshape(nb, 2)
        raw[:, 2:4] = np.abs(sane_f16(rng, nb, 1e-4, 0.1)).view(np.uint8).reshape(nb, 2)
    elif ty == T.Q6_K:  # d is the last field
        raw[:, 208:210] = sane_f16(rng, nb, 1e-4, 0.05).view(np.uint8).reshape(nb, 2)
    elif ty == T.F16:
        raw = (rng.standard_normal(N) * 3).astype(np.float16).view(np.uint8)
    elif ty == T.BF16:
        bits = (rng.standard_normal(N).astype(np.float32) * 3).view(np.uint32) >> 16
        raw = bits.astype(np.uint16).view(np.uint8)
    return raw.reshape(-1)


def quant_input(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(N).astype(np.float32)
    x[rng.random(N) < 0.02] *= 10  # outliers, as in real weights
    # Blocks on the Q4_0/Q8_0 grids, so the rounding of exact ties is pinned down too.
    g = rng.integers(-8, 8, 32 * 8).astype(np.float32)
    g[::32] = -8
    x[: 32 * 8] = g * np.float32(0.37)
    x[32 * 8 : 32 * 9] = 0  # an all-zero block
    return x


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for ty in (T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.F16, T.BF16):
        raw = random_blocks(rng, ty)
        deq = dequantize(raw, ty).astype(np.float32).reshape(-1)
        assert deq.size == N and np.isfinite(deq).all(), ty
        write(f"dequant_{ty.name.lower()}.bin", 0, ty, N, raw.tobytes(), deq.tobytes())
    for ty in (T.Q4_0, T.Q8_0, T.F16, T.BF16):
        x = quant_input(rng)
        q = np.asarray(quantize(x.reshape(-1, 256), ty)).view(np.uint8).reshape(-1)
        write(f"quant_{ty.name.lower()}.bin", 1, ty, N, x.tobytes(), q.tobytes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
