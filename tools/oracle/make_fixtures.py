#!/usr/bin/env python3
"""Golden logits for q4moe's CPU backend from the outside reference: transformers'
`Qwen3MoeForCausalLM`, in float64, loaded with the dequantised weights of a `q4moe synth` GGUF.
See README.md for how to rerun and what the tolerances are.

For each fixture in FIXTURES: write the GGUF with `q4moe synth` (deterministic from the seed),
build the HF model from it, run a fixed prompt then greedy decoding (full forward over the
whole sequence each step, no KV cache, so every row is a plain teacher-forced position), and
write tests/fixtures/oracle/<name>.bin. The GGUF itself is not committed: the Rust test
regenerates it with `synth::write` and checks its sha256 against the one stored here.

Fixture file (little-endian):
  magic    b"Q4MORACL" (8 bytes)
  u32      version = 1
  char[16] geometry name (ASCII, NUL-padded): "tiny" | "mid"
  char[8]  quant (ASCII, NUL-padded): "q4_0" | "q4_k" | ...
  u64      synth seed
  u32[10]  the full geometry after overrides: n_layer, d_model, n_head, n_kv_head, head_dim,
           n_expert, n_expert_used, d_ff_expert, vocab, context
  u8[32]   sha256 of the GGUF `q4moe synth` writes for the above
  u32      n_prompt, n_gen, n_rows (= n_prompt + n_gen), vocab
  u32      reference float bits (64)
  f32      smallest top1-top2 logit gap over the greedy steps, relative to max |logit|
  f32      smallest gap between the k-th and (k+1)-th router probability over all layers/positions
  u32[n_prompt + n_gen]  tokens: the prompt, then the reference's greedy tokens
  f32[n_rows, vocab]     logits of every position (row i = after feeding tokens[0..=i])
"""
import argparse
import hashlib
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reference import DIM_KEYS, ReferenceError, greedy_run, read_weights

VERSION = 1
MAGIC = b"Q4MORACL"
N_PROMPT = 16
N_GEN = 24
GEOMETRY = {  # mirrors Config::tiny() / Config::mid() in crates/model/src/config.rs
    "tiny": dict(layers=2, d_model=256, heads=4, kv_heads=2, head_dim=64, experts=8, experts_used=2, expert_ff=256, vocab=1024, context=512),
    "mid": dict(layers=4, d_model=1024, heads=16, kv_heads=4, head_dim=128, experts=32, experts_used=4, expert_ff=512, vocab=4096, context=4096),
}
ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "oracle"


@dataclass
class Fixture:
    name: str
    geometry: str
    quant: str
    seed: int
    overrides: dict = field(default_factory=dict)

    def dims(self) -> dict:
        return {**GEOMETRY[self.geometry], **self.overrides}


FIXTURES = [
    Fixture("tiny_q4_0", "tiny", "q4_0", 11),
    Fixture("tiny_q4_k", "tiny", "q4_k", 16),
    # mid shrunk to stay commit- and debug-test-sized: still 4 KV heads of 4 query heads each,
    # head_dim 128, 16 experts of which 4 used.
    Fixture("mid_q4_0", "mid", "q4_0", 13, dict(layers=2, experts=16, expert_ff=256, vocab=2048)),
]


def synth(q4moe: Path, fx: Fixture, out: Path) -> None:
    args = [str(q4moe), "synth", "--geometry", fx.geometry, "--quant", fx.quant, "--seed", str(fx.seed), "--out", str(out)]
    for k, v in fx.overrides.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    subprocess.run(args, check=True, stderr=subprocess.DEVNULL)


def run(fx: Fixture, q4moe: Path, gguf_dir: Path | None) -> None:
    d = fx.dims()
    with tempfile.TemporaryDirectory() as tmp:
        path = (gguf_dir / f"{fx.name}.gguf") if gguf_dir else Path(tmp) / f"{fx.name}.gguf"
        if not gguf_dir:
            synth(q4moe, fx, path)
        sha = hashlib.sha256(path.read_bytes()).digest()
        w = read_weights(path)
    prompt = [int(t) for t in np.random.default_rng(1000 + fx.seed).integers(0, d["vocab"], N_PROMPT)]
    try:
        r = greedy_run(d, w, prompt, N_GEN)
    except ReferenceError as e:
        sys.exit(f"{fx.name}: {e}")
    if r.near_tie():
        sys.exit(f"{fx.name}: near-tie (greedy gap {min(r.gaps):.2e}, router gap {r.router_gap:.2e}); pick another seed")
    write(fx, d, sha, r.tokens, r.logits.astype(np.float32), min(r.gaps), r.router_gap)
    print(f"  max|logit| {np.abs(r.logits).max():.3f}, transformers vs numpy f64 rel {r.mapping_err:.1e}, "
          f"greedy gap {min(r.gaps):.2e}, router gap {r.router_gap:.2e}, sha256 {sha.hex()[:16]}")
    print(f"  greedy: {r.tokens[N_PROMPT:]}")


def write(fx, d, sha, tokens, logits, gap, rmargin) -> None:
    n_rows, vocab = logits.shape
    head = MAGIC + struct.pack("<I", VERSION)
    head += fx.geometry.encode().ljust(16, b"\0") + fx.quant.encode().ljust(8, b"\0")
    head += struct.pack("<Q", fx.seed) + struct.pack("<10I", *[d[k] for k in DIM_KEYS]) + sha
    head += struct.pack("<5I", N_PROMPT, N_GEN, n_rows, vocab, 64) + struct.pack("<2f", gap, rmargin)
    body = np.asarray(tokens, dtype="<u4").tobytes() + np.ascontiguousarray(logits, dtype="<f4").tobytes()
    path = OUT / f"{fx.name}.bin"
    path.write_bytes(head + body)
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q4moe", type=Path, default=ROOT / "target" / "debug" / "q4moe", help="q4moe binary (for `synth`)")
    ap.add_argument("--gguf-dir", type=Path, help="use <name>.gguf from here instead of running synth")
    ap.add_argument("--only", help="comma-separated fixture names")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    OUT.mkdir(parents=True, exist_ok=True)
    for fx in FIXTURES:
        if a.only and fx.name not in a.only.split(","):
            continue
        print(f"{fx.name}: {fx.geometry} {fx.quant} seed {fx.seed} {fx.overrides or ''}")
        run(fx, a.q4moe, a.gguf_dir)


if __name__ == "__main__":
    main()
