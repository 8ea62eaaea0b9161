#!/usr/bin/env python3
"""Parity fixtures over a matrix of Qwen3-MoE geometries and quant mixes, written by gguf-py's
GGUFWriter (an independent writer: nothing of q4moe's own `synth` is used) with the golden
logits of transformers in float64 on the same dequantised weights. See README.md.

For each point in POINTS: random float weights (seeded) are quantised here (Q4_0/Q8_0 by
gguf-py, Q4_K/Q6_K by kquants.py), written with the metadata keys and tensor names llama.cpp's
converter gives a Qwen3-MoE file, read back with GGUFReader and dequantised, and run through
tools/oracle/reference.py (transformers float64, cross-checked against `generate` and an
independent numpy forward). A seed whose greedy steps or router choices come near a tie is
replaced by the next one. Writes tests/fixtures/matrix/<name>.gguf and <name>.bin.

Reference file (little-endian):
  magic    b"Q4MMATRX" (8 bytes)
  u32      version = 1
  char[32] point name (ASCII, NUL-padded)
  char[16] quant mix (ASCII, NUL-padded): q4_0 | q8_0 | q4_k | q4_k_m | q6_k
  u64      weight seed (the first that passed the near-tie checks)
  u32[10]  geometry: n_layer, d_model, n_head, n_kv_head, head_dim, n_expert, n_expert_used,
           d_ff_expert, vocab, context
  u32      1 when the file has no output.weight (the head is the token embedding), else 0
  f32      rms epsilon, f32 rope theta
  u8[32]   sha256 of <name>.gguf
  u32      n_prompt, n_gen, n_rows (= n_prompt + n_gen), vocab
  u32      reference float bits (64)
  f32      smallest top1-top2 logit gap over the greedy steps, relative to max |logit|
  f32      smallest gap between the k-th and (k+1)-th router probability (1 when all are used)
  u32[n_rows]        tokens: the prompt, then the reference's greedy tokens
  f32[n_rows, vocab] logits of every position (row i = after feeding tokens[0..=i])
  f32[n_gen]         each greedy step's top1-top2 gap relative to that row's max |logit|
"""
import argparse
import hashlib
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "oracle"))
from reference import DIM_KEYS, ReferenceError, greedy_run, read_weights  # noqa: E402

import kquants  # noqa: E402
import vocab  # noqa: E402

VERSION = 1
MAGIC = b"Q4MMATRX"
N_PROMPT = 16
N_GEN = 16
OUT = ROOT / "tests" / "fixtures" / "matrix"
MAX_SEED_TRIES = 64
# A greedy run that repeats one or two tokens exercises little past the first steps.
MIN_DISTINCT = N_GEN // 4
# llama_ftype of each mix (general.file_type).
FILE_TYPE = {"q4_0": 2, "q8_0": 7, "q4_k": 14, "q4_k_m": 15, "q6_k": 18}


@dataclass
class Point:
    name: str
    mix: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ff: int
    vocab: int
    seed: int
    tied: bool = False
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    context: int = 512
    covers: str = ""

    def dims(self) -> dict:
        d = {k: getattr(self, k) for k in DIM_KEYS}
        return {**d, "tied": self.tied, "rms_eps": self.rms_eps, "rope_theta": self.rope_theta}


# What each point is for is in README.md's table (and `covers`). Head dims 64/128/256, query
# heads a KV head 1/2/4/8/16, experts 8/16/64/256 with 1/2/4/8 used, widths 256/320/512/768,
# every mix; sizes keep the whole matrix a few MB (experts dominate: K-quants need 256-wide rows).
POINTS = [
    Point("h64_g1_e8k1_q8_0", "q8_0", 1, 256, 2, 2, 64, 8, 1, 32, 272, 100, tied=True,
          covers="one query head a KV head, one expert used, Q8_0 everywhere"),
    Point("h64_g16_e64k8_d128_q4_0", "q4_0", 1, 128, 16, 1, 64, 64, 8, 32, 300, 200,
          covers="16 query heads a KV head at head_dim 64, 64 experts of which 8 used"),
    Point("h128_g8_e8k4_d128_q4_0", "q4_0", 1, 128, 16, 2, 128, 8, 4, 32, 300, 300,
          covers="Qwen3-30B-A3B's attention shape (head_dim 128, 8 query heads a KV head, 2 KV heads): the specialised attention"),
    Point("h128_g16_e8k2_d128_q4_0", "q4_0", 1, 128, 16, 1, 128, 8, 2, 32, 280, 400, tied=True,
          covers="Qwen3-235B-A22B's ratio (head_dim 128, 16 a KV head), tied embeddings"),
    Point("h256_g2_e8k2_q6_k", "q6_k", 1, 256, 2, 1, 256, 8, 2, 32, 272, 500, rope_theta=1e4,
          covers="head_dim 256; Q6_K-heavy (ffn_down, 32 wide, falls back to Q8_0 as llama.cpp does); rope theta 1e4"),
    Point("h128_g2_e8k2_q4_k_m", "q4_k_m", 1, 256, 4, 2, 128, 8, 2, 256, 272, 600,
          covers="Q4_K_M: Q4_K with Q6_K attn_v, ffn_down and output (QKV of two types)"),
    Point("h64_g4_e8k2_q4_k", "q4_k", 1, 256, 4, 1, 64, 8, 2, 256, 272, 700, tied=True,
          covers="all Q4_K (ffn_down included), tied embeddings"),
    Point("h64_g2_e256k8_d64_q4_0", "q4_0", 1, 64, 4, 2, 64, 256, 8, 32, 272, 800,
          covers="256 experts (tiny FFN, width 64), 8 used"),
    Point("h64_g4_e8k2_d320_q4_0", "q4_0", 2, 320, 4, 1, 64, 8, 2, 32, 300, 900, rms_eps=1e-5,
          covers="width 320 (not a multiple of 256), two layers, rms epsilon 1e-5"),
    Point("h64_g2_e8k2_d512_q4_0", "q4_0", 1, 512, 2, 1, 64, 8, 2, 32, 280, 1000, tied=True,
          covers="width 512"),
    Point("h64_g1_e8k8_d768_q4_0", "q4_0", 1, 768, 1, 1, 64, 8, 8, 32, 264, 1100, tied=True,
          covers="width 768, every expert used (no router choice)"),
]


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers): which layers Q4_K_M gives Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, role: str, layer: int, n_layer: int, row: int) -> T:
    """The type llama.cpp's quantizer gives a tensor of `mix` (for Qwen3-MoE's expert count: its
    8-expert special cases are left out), then its fallback where the row is not a whole number
    of the type's blocks (Q6_K -> Q8_0)."""
    if role in ("norm", "router"):
        return T.F32
    base = {"q4_0": T.Q4_0, "q8_0": T.Q8_0, "q4_k": T.Q4_K, "q4_k_m": T.Q4_K, "q6_k": T.Q6_K}[mix]
    ty = base
    if mix == "q4_k_m" and (role == "output" or (role in ("attn_v", "ffn_down") and use_more_bits(layer, n_layer))):
        ty = T.Q6_K
    block = gguf.GGML_QUANT_SIZES[ty][0]
    if row % block:
        if ty != T.Q6_K:
            raise ValueError(f"{mix} {role}: row {row} is not a multiple of {ty.name}'s {block}")
        ty = T.Q8_0
    return ty


def quantize(x: np.ndarray, ty: T) -> np.ndarray:
    if ty == T.F32:
        return x.astype(np.float32)
    if ty in kquants.QUANTIZERS:
        return kquants.quantize(x, ty)
    return gguf.quants.quantize(x.astype(np.float32), ty)


def tensors(p: Point, rng: np.random.Generator):
    """(name, numpy shape [.., out, in], role, std) of every tensor, in llama.cpp's order."""
    d, q, kv, e, f = p.d_model, p.heads * p.head_dim, p.kv_heads * p.head_dim, p.experts, p.expert_ff
    # A tied embedding is also the head: kept small beside what the layers add to the residual,
    # or each token's own row would dominate its logits and greedy decoding would repeat it.
    yield "token_embd.weight", (p.vocab, d), "token_embd", 1.0 / np.sqrt(d) if p.tied else 1.0
    yield "output_norm.weight", (d,), "norm", None
    if not p.tied:
        yield "output.weight", (p.vocab, d), "output", 3.0 / np.sqrt(d)
    for i in range(p.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,), "norm", None
        yield b + "attn_q.weight", (q, d), "attn_q", 1 / np.sqrt(d)
        yield b + "attn_k.weight", (kv, d), "attn_k", 1 / np.sqrt(d)
        yield b + "attn_v.weight", (kv, d), "attn_v", 1 / np.sqrt(d)
        yield b + "attn_output.weight", (d, q), "attn_output", 1 / np.sqrt(q)
        yield b + "attn_q_norm.weight", (p.head_dim,), "norm", None
        yield b + "attn_k_norm.weight", (p.head_dim,), "norm", None
        yield b + "ffn_norm.weight", (d,), "norm", None
        yield b + "ffn_gate_inp.weight", (e, d), "router", 4 / np.sqrt(d)
        yield b + "ffn_gate_exps.weight", (e, f, d), "ffn_gate", 1 / np.sqrt(d)
        yield b + "ffn_up_exps.weight", (e, f, d), "ffn_up", 1 / np.sqrt(d)
        yield b + "ffn_down_exps.weight", (e, d, f), "ffn_down", 1 / np.sqrt(f)


def weights(shape, std, rng: np.random.Generator) -> np.ndarray:
    if std is not None:
        return rng.normal(0.0, std, shape).astype(np.float32)
    # Norm gains as trained models have them: nowhere 1, a level of their own a tensor
    # (0.5 to 2) and a log-normal spread around it.
    level = rng.uniform(np.log(0.5), np.log(2.0))
    return np.exp(level + rng.normal(0.0, 0.3, shape)).astype(np.float32)


def write_gguf(p: Point, seed: int, path: Path) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(f"q4moe matrix {p.name}")
    w.add_context_length(p.context)
    w.add_embedding_length(p.d_model)
    w.add_feed_forward_length(p.expert_ff * p.experts_used)
    w.add_block_count(p.layers)
    w.add_head_count(p.heads)
    w.add_head_count_kv(p.kv_heads)
    w.add_rope_freq_base(p.rope_theta)
    w.add_layer_norm_rms_eps(p.rms_eps)
    w.add_expert_used_count(p.experts_used)
    w.add_expert_count(p.experts)
    w.add_expert_feed_forward_length(p.expert_ff)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_file_type(FILE_TYPE[p.mix])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.add_tokenizer(w, p.vocab)
    for name, shape, role, std in tensors(p, rng):
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        ty = tensor_type(p.mix, role, layer, p.layers, shape[-1])
        data = quantize(weights(shape, std, rng), ty)
        w.add_tensor(name, data, raw_dtype=None if ty == T.F32 else ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run(p: Point) -> None:
    d = p.dims()
    path = OUT / f"{p.name}.gguf"
    prompt = [int(t) for t in np.random.default_rng(7000 + p.seed).integers(0, p.vocab, N_PROMPT)]
    for seed in range(p.seed, p.seed + MAX_SEED_TRIES):
        write_gguf(p, seed, path)
        try:
            r = greedy_run(d, read_weights(path), prompt, N_GEN)
        except ReferenceError as e:
            sys.exit(f"{p.name}: {e}")
        distinct = len(set(r.tokens[N_PROMPT:]))
        if not r.near_tie() and distinct >= MIN_DISTINCT:
            break
        print(f"  seed {seed}: near-tie or a loop (greedy gap {min(r.gaps):.1e}, router gap {r.router_gap:.1e}, "
              f"{distinct} distinct greedy tokens), next seed")
    else:
        sys.exit(f"{p.name}: no seed in {MAX_SEED_TRIES} passes the near-tie checks")
    sha = hashlib.sha256(path.read_bytes()).digest()
    write_reference(p, d, seed, sha, r)
    print(f"  seed {seed}, gguf {path.stat().st_size} bytes, max|logit| {np.abs(r.logits).max():.3f}, "
          f"transformers vs numpy f64 rel {r.mapping_err:.1e}, greedy gap {min(r.gaps):.2e}, router gap {r.router_gap:.2e}")
    print(f"  greedy: {r.tokens[N_PROMPT:]}")


def write_reference(p: Point, d: dict, seed: int, sha: bytes, r) -> None:
    n_rows, n_vocab = r.logits.shape
    head = MAGIC + struct.pack("<I", VERSION)
    head += p.name.encode().ljust(32, b"\0") + p.mix.encode().ljust(16, b"\0")
    head += struct.pack("<Q", seed) + struct.pack("<10I", *[d[k] for k in DIM_KEYS])
    head += struct.pack("<I2f", int(p.tied), p.rms_eps, p.rope_theta) + sha
    head += struct.pack("<5I", N_PROMPT, N_GEN, n_rows, n_vocab, 64) + struct.pack("<2f", min(r.gaps), r.router_gap)
    body = np.asarray(r.tokens, dtype="<u4").tobytes() + np.ascontiguousarray(r.logits, dtype="<f4").tobytes()
    body += np.asarray(r.gaps, dtype="<f4").tobytes()
    path = OUT / f"{p.name}.bin"
    path.write_bytes(head + body)
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes")


def gguf_only(only) -> None:
    """Rebuilds each point's GGUF from the seed its committed reference names, without torch,
    and checks it against the sha256 the reference holds (the writer is deterministic)."""
    bad = 0
    for p in POINTS:
        if only and p.name not in only.split(","):
            continue
        ref = (OUT / f"{p.name}.bin").read_bytes()
        assert ref[:8] == MAGIC, f"{p.name}.bin: not a matrix reference"
        at = 8 + 4 + 32 + 16
        seed = struct.unpack_from("<Q", ref, at)[0]
        at += 8 + 10 * 4 + 4 + 8
        want = ref[at:at + 32]
        path = OUT / f"{p.name}.gguf"
        write_gguf(p, seed, path)
        ok = hashlib.sha256(path.read_bytes()).digest() == want
        bad += not ok
        print(f"{path.relative_to(ROOT)}: seed {seed}, {path.stat().st_size} bytes, sha256 {'matches' if ok else 'DIFFERS'}")
    if bad:
        sys.exit(f"{bad} GGUFs differ from what their references were made from")


def plan() -> None:
    """Each point's tensor types and file size, without writing anything."""
    total = 0
    for p in POINTS:
        size, types = 0, set()
        for name, shape, role, _ in tensors(p, np.random.default_rng(0)):
            ty = tensor_type(p.mix, role, int(name.split(".")[1]) if name.startswith("blk.") else 0, p.layers, shape[-1])
            block, nbytes = gguf.GGML_QUANT_SIZES[ty]
            size += int(np.prod(shape)) // block * nbytes
            types.add(ty.name)
        ref = (N_PROMPT + N_GEN) * p.vocab * 4
        total += size + ref
        print(f"{p.name:28} {size / 1e3:7.0f} KB + ref {ref / 1e3:3.0f} KB  {sorted(types)}")
    print(f"total {total / 1e6:.2f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated point names")
    ap.add_argument("--plan", action="store_true", help="print each point's types and size, write nothing")
    ap.add_argument("--gguf-only", action="store_true",
                    help="rebuild the GGUFs from the committed references' seeds (no torch), check their sha256")
    a = ap.parse_args()
    if a.plan:
        return plan()
    if a.gguf_only:
        return gguf_only(a.only)
    import torch
    torch.set_num_threads(max(1, torch.get_num_threads()))
    kquants.self_test()
    OUT.mkdir(parents=True, exist_ok=True)
    for p in POINTS:
        if a.only and p.name not in a.only.split(","):
            continue
        print(f"{p.name}: {p.mix}, {p.covers}")
        run(p)


if __name__ == "__main__":
    main()
