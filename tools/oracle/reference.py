"""The outside reference both fixture generators share (tools/oracle/make_fixtures.py over
`q4moe synth` GGUFs, tools/gguf_matrix/make_matrix.py over gguf-py ones): transformers'
`Qwen3MoeForCausalLM` in float64 on a GGUF's dequantised weights, its greedy run, and the
cross-checks that make the run trustworthy. tools/oracle/README.md explains the mapping, the
cross-checks and the tolerances.

`d` is a geometry dict with the keys of DIM_KEYS; optional keys: `rms_eps` (default 1e-6),
`rope_theta` (1e6), `tied` (False: the file has its own `output.weight`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import gguf

try:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
except ImportError:  # rebuilding GGUFs from committed references (make_matrix.py --gguf-only) needs neither
    torch = None

DIM_KEYS = ["layers", "d_model", "heads", "kv_heads", "head_dim", "experts", "experts_used", "expert_ff", "vocab", "context"]
# A backend within relative tolerance TOL of the reference keeps its argmax when the top-2 gap
# exceeds 2*TOL; the Rust tests' TOL is 1e-4, so refuse greedy steps closer than 5e-4. A router
# near-tie would route differently under f32 rounding (~1e-7 on probabilities).
MIN_GREEDY_GAP = 5e-4
MIN_ROUTER_GAP = 1e-5


def eps(d: dict) -> float:
    return d.get("rms_eps", 1e-6)


def theta(d: dict) -> float:
    return d.get("rope_theta", 1e6)


def read_weights(path) -> dict:
    """GGUF tensor name -> float64 array; numpy shapes are GGUF dims reversed ([out, in])."""
    r = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}


def head(w: dict) -> np.ndarray:
    """The output head: `output.weight`, or the token embedding where the file ties them."""
    return w.get("output.weight", w["token_embd.weight"])


def hf_model(d: dict, w: dict) -> Qwen3MoeForCausalLM:
    tied = d.get("tied", False)
    cfg = Qwen3MoeConfig(
        vocab_size=d["vocab"], hidden_size=d["d_model"], intermediate_size=d["expert_ff"],
        moe_intermediate_size=d["expert_ff"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"],
        num_experts=d["experts"], num_experts_per_tok=d["experts_used"], norm_topk_prob=True,
        rms_norm_eps=eps(d), rope_theta=theta(d), max_position_embeddings=d["context"],
        tie_word_embeddings=tied, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the grouped_mm kernel has no float64
    model = Qwen3MoeForCausalLM(cfg).to(torch.float64).eval()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    sd = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
          "lm_head.weight": head(w)}
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
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        sys.exit("tie_word_embeddings did not tie lm_head to the embedding")
    return model


def numpy_forward(d: dict, w: dict, tokens: list) -> np.ndarray:
    """Independent float64 forward pass straight from GGUF names (DESIGN.md section 2), to check
    the HF weight mapping. Returns [len(tokens), vocab]."""
    e, hd, nh, nkv = eps(d), d["head_dim"], d["heads"], d["kv_heads"]
    rms = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + e) * g
    n = len(tokens)
    pos = np.arange(n)[:, None] * (theta(d) ** (-np.arange(0, hd, 2) / hd))[None, :]
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
            for ex in top:
                gt, up = g("ffn_gate_exps")[ex] @ h[t], g("ffn_up_exps")[ex] @ h[t]
                out[t] += r[t, ex] / r[t, top].sum() * (g("ffn_down_exps")[ex] @ (gt / (1 + np.exp(-gt)) * up))
        x = x + out
    return rms(x, w["output_norm.weight"]) @ head(w).T


def router_margin(model, tokens: list, k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability: a near-tie could route
    differently in f32 and make the comparison meaningless, so the generators refuse it. With
    every expert used there is no (k+1)-th: the gap is 1."""
    gaps = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, inp, out: gaps.append(float((lambda p: (p[:, k - 1] - p[:, k]).min() if p.shape[1] > k else 1.0)(
            torch.softmax(out[0], -1).sort(-1, descending=True).values))))
        for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([tokens]), use_cache=False)
    for hk in hooks:
        hk.remove()
    return min(gaps)


class ReferenceError(Exception):
    """The reference disagrees with itself (KV-cache path, numpy forward): a broken mapping."""


@dataclass
class Run:
    """One greedy run of the reference."""
    tokens: list  # the prompt, then the greedy tokens
    logits: np.ndarray  # [n_rows, vocab] float64, row i = after tokens[0..=i]
    gaps: list  # every greedy step's top1-top2 gap relative to max |logit|
    router_gap: float
    mapping_err: float  # transformers vs the numpy forward, relative

    def near_tie(self) -> bool:
        return min(self.gaps) < MIN_GREEDY_GAP or self.router_gap < MIN_ROUTER_GAP


def greedy_run(d: dict, w: dict, prompt: list, n_gen: int) -> Run:
    """Greedy decoding with a full forward over the whole sequence at every step (no KV cache),
    then one full forward over prompt + generated tokens for every row, cross-checked against
    `generate` (the KV-cache path) and against `numpy_forward`."""
    model = hf_model(d, w)
    tokens, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(n_gen):
            last = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            top2 = torch.topk(last, 2).values
            gaps.append(float((top2[0] - top2[1]) / last.abs().max()))
            tokens.append(int(torch.argmax(last)))
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()  # [n_rows, vocab] f64
        cached = model.generate(torch.tensor([prompt]), max_new_tokens=n_gen, do_sample=False, use_cache=True)
    if cached[0].tolist() != tokens:
        raise ReferenceError(f"KV-cache generate disagrees with full-forward greedy:\n{cached[0].tolist()}\n{tokens}")
    ref = numpy_forward(d, w, tokens)
    mapping_err = float(np.abs(ref - logits).max() / np.abs(logits).max())
    if not mapping_err < 1e-5:
        raise ReferenceError(f"transformers and the numpy forward disagree (rel {mapping_err:.2e}): weight mapping broken")
    return Run(tokens, logits, gaps, router_margin(model, tokens, d["experts_used"]), mapping_err)
