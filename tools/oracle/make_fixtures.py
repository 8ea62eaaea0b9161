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
import gguf
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

VERSION = 1
MAGIC = b"Q4MORACL"
N_PROMPT = 16
N_GEN = 24
# A backend within relative tolerance TOL of the reference keeps its argmax when the top-2 gap
# exceeds 2*TOL; the Rust test's TOL is 1e-4, so refuse greedy steps closer than 5e-4. A router
# near-tie would route differently under f32 rounding (~1e-7 on probabilities).
MIN_GREEDY_GAP = 5e-4
MIN_ROUTER_GAP = 1e-5
DIM_KEYS = ["layers", "d_model", "heads", "kv_heads", "head_dim", "experts", "experts_used", "expert_ff", "vocab", "context"]
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


def read_weights(path: Path) -> dict:
    """GGUF tensor name -> float64 array; numpy shapes are GGUF dims reversed ([out, in])."""
    r = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}


def hf_model(d: dict, w: dict) -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(
        vocab_size=d["vocab"], hidden_size=d["d_model"], intermediate_size=d["expert_ff"],
        moe_intermediate_size=d["expert_ff"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"],
        num_experts=d["experts"], num_experts_per_tok=d["experts_used"], norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=d["context"],
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the grouped_mm kernel has no float64
    model = Qwen3MoeForCausalLM(cfg).to(torch.float64).eval()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    sd = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
          "lm_head.weight": w["output.weight"]}
    for i in range(d["layers"]):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        sd.update({
            h + "input_layernorm.weight": w[b + "attn_norm.weight"],
            h + "post_attention_layernorm.weight": w[b + "ffn_norm.weight"],
            h + "self_attn.q_proj.weight": w[b + "attn_q.weight"],
            h + "self_attn.k_proj.weight": w[b + "attn_k.weight"],
            h + "self_attn.v_proj.weight": w[b + "attn_v.weight"],
            h + "self_attn.o_proj.weight": w[b + "attn_output.weight"],
            h + "self_attn.q_norm.weight": w[b + "attn_q_norm.weight"],
            h + "self_attn.k_norm.weight": w[b + "attn_k_norm.weight"],
            h + "mlp.gate.weight": w[b + "ffn_gate_inp.weight"],
            # [n_expert, 2*ff, d]: gate rows then up rows (forward does .chunk(2) as gate, up)
            h + "mlp.experts.gate_up_proj": np.concatenate([w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"]], axis=1),
            h + "mlp.experts.down_proj": w[b + "ffn_down_exps.weight"],  # [n_expert, d, ff]
        })
    expected = set(model.state_dict().keys())
    if expected != set(sd):
        sys.exit(f"state_dict mismatch: missing {expected - set(sd)}, unexpected {set(sd) - expected}")
    model.load_state_dict({k: t(v) for k, v in sd.items()}, strict=True)
    return model


def numpy_forward(d: dict, w: dict, tokens: list) -> np.ndarray:
    """Independent float64 forward pass straight from GGUF names (DESIGN.md section 2), to check
    the HF weight mapping. Returns [len(tokens), vocab]."""
    eps, hd, nh, nkv = 1e-6, d["head_dim"], d["heads"], d["kv_heads"]
    rms = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g
    n = len(tokens)
    pos = np.arange(n)[:, None] * (1e6 ** (-np.arange(0, hd, 2) / hd))[None, :]
    cos, sin = np.cos(pos), np.sin(pos)

    def rope(x):  # [n, heads, hd], NeoX: rotate halves
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    x = w["token_embd.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(d["layers"]):
        g = lambda s: w[f"blk.{i}.{s}.weight"]
        h = rms(x, g("attn_norm"))
        q = rms((h @ g("attn_q").T).reshape(n, nh, hd), g("attn_q_norm"))
        k = rms((h @ g("attn_k").T).reshape(n, nkv, hd), g("attn_k_norm"))
        v = (h @ g("attn_v").T).reshape(n, nkv, hd)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, nh * hd) @ g("attn_output").T
        h = rms(x, g("ffn_norm"))
        r = h @ g("ffn_gate_inp").T
        r = np.exp(r - r.max(-1, keepdims=True))
        r /= r.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(n):
            top = np.argsort(-r[t], kind="stable")[: d["experts_used"]]
            for e in top:
                gt, up = g("ffn_gate_exps")[e] @ h[t], g("ffn_up_exps")[e] @ h[t]
                out[t] += r[t, e] / r[t, top].sum() * (g("ffn_down_exps")[e] @ (gt / (1 + np.exp(-gt)) * up))
        x = x + out
    return rms(x, w["output_norm.weight"]) @ w["output.weight"].T


def router_margin(model, tokens: list, k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability: a near-tie could route
    differently in f32 and make the comparison meaningless, so the script refuses it."""
    gaps = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, inp, out: gaps.append(float((lambda p: (p[:, k - 1] - p[:, k]).min())(
            torch.softmax(out[0], -1).sort(-1, descending=True).values))))
        for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([tokens]), use_cache=False)
    for hk in hooks:
        hk.remove()
    return min(gaps)


def run(fx: Fixture, q4moe: Path, gguf_dir: Path | None) -> None:
    d = fx.dims()
    with tempfile.TemporaryDirectory() as tmp:
        path = (gguf_dir / f"{fx.name}.gguf") if gguf_dir else Path(tmp) / f"{fx.name}.gguf"
        if not gguf_dir:
            synth(q4moe, fx, path)
        sha = hashlib.sha256(path.read_bytes()).digest()
        w = read_weights(path)
    model = hf_model(d, w)
    prompt = [int(t) for t in np.random.default_rng(1000 + fx.seed).integers(0, d["vocab"], N_PROMPT)]
    tokens, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(N_GEN):
            last = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            top2 = torch.topk(last, 2).values
            gaps.append(float((top2[0] - top2[1]) / last.abs().max()))
            tokens.append(int(torch.argmax(last)))
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()  # [n_rows, vocab] f64
        cached = model.generate(torch.tensor([prompt]), max_new_tokens=N_GEN, do_sample=False, use_cache=True)
    if cached[0].tolist() != tokens:
        sys.exit(f"{fx.name}: KV-cache generate disagrees with full-forward greedy:\n{cached[0].tolist()}\n{tokens}")
    ref = numpy_forward(d, w, tokens)
    mapping_err = float(np.abs(ref - logits).max() / np.abs(logits).max())
    if not mapping_err < 1e-5:
        sys.exit(f"{fx.name}: transformers and the numpy forward disagree (rel {mapping_err:.2e}): weight mapping broken")
    rmargin = router_margin(model, tokens, d["experts_used"])
    if min(gaps) < MIN_GREEDY_GAP or rmargin < MIN_ROUTER_GAP:
        sys.exit(f"{fx.name}: near-tie (greedy gap {min(gaps):.2e}, router gap {rmargin:.2e}); pick another seed")
    write(fx, d, sha, tokens, logits.astype(np.float32), min(gaps), rmargin)
    print(f"  max|logit| {np.abs(logits).max():.3f}, transformers vs numpy f64 rel {mapping_err:.1e}, "
          f"greedy gap {min(gaps):.2e}, router gap {rmargin:.2e}, sha256 {sha.hex()[:16]}")
    print(f"  greedy: {tokens[N_PROMPT:]}")


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
