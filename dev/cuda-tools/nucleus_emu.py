#!/usr/bin/env python3
"""The device nucleus's cut (sample.cu nucleus_edge / nucleus_cut: fixed-point bucket sums, the
crossing bucket, a weighted radix select over the edge's weight bits in any order, then the ties'
count select by id) against the host's rule (q4moe_model::sampling: the first token, best first
and ties by id, where the running fixed-point sum reaches nucleus_target) on random, flat and
tied weights. Logic only (no CUDA): run with numpy, prints ok.
usage: python3 dev/cuda-tools/nucleus_emu.py"""
import numpy as np, struct, random
def bits(x): return struct.unpack('<I', struct.pack('<f', np.float32(x)))[0]
def f32(b): return struct.unpack('<f', struct.pack('<I', b))[0]
ONE = bits(1.0)
def bucket(w): return min((ONE - bits(w)) >> 21, 255)
def fixed(w): return int(np.float32(w) * np.float32(2**40))  # exact product in f32, truncate
def target(top_p, total):
    t = int(float(np.float32(top_p)) * float(total))
    return min(max(t, 1), max(total, 1))

def host_cut(w, top_p):
    # full sort semantics with integer sums (what the new host computes)
    order = sorted([i for i in range(len(w)) if w[i] > 0], key=lambda i: (-bits(w[i]), i))
    total = sum(fixed(x) for x in w)
    T = target(top_p, total)
    acc = 0
    for i in order:
        acc += fixed(w[i])
        if acc >= T: return (bits(w[i]), i)
    return None

def crossing(h, desc, want):
    order = list(range(255, -1, -1)) if desc else list(range(256))
    acc = 0
    for b in order:
        if acc + h[b] >= want: return b, acc
        acc += h[b]
    raise Exception("no crossing")

def device_cut(w, top_p):
    hist = [0]*256
    for x in w:
        if x > 0: hist[bucket(x)] += fixed(x)
    total = sum(hist)
    T = target(top_p, total)
    b, before = crossing(hist, False, T)
    rest = T - before
    edge = [(bits(x), i) for i, x in enumerate(w) if x > 0 and bucket(x) == b]
    random.shuffle(edge)
    prefix = mask = 0; want = rest
    for shift in (24, 16, 8, 0):
        h = [0]*256
        for k, i in edge:
            if (k & mask) == prefix: h[(k >> shift) & 255] += fixed(f32(k))
        bb, bef = crossing(h, True, want)
        prefix |= bb << shift; want -= bef; mask |= 255 << shift
    q = fixed(f32(prefix)); assert q > 0
    ties = (want + q - 1) // q
    idp = imask = 0
    for shift in (24, 16, 8, 0):
        h = [0]*256
        for k, i in edge:
            if k == prefix and (i & imask) == idp: h[(i >> shift) & 255] += 1
        bb, bef = crossing(h, False, ties)
        idp |= bb << shift; ties -= bef; imask |= 255 << shift
    return (prefix, idp)

rng = np.random.default_rng(1)
for trial in range(300):
    n = int(rng.integers(5, 3000))
    kind = trial % 4
    if kind == 0: lg = rng.normal(0, 3, n)
    elif kind == 1: lg = np.full(n, 0.25)
    elif kind == 2: lg = np.round(rng.normal(0, 2, n))  # many ties
    else: lg = rng.normal(0, 0.3, n)
    t = np.float32(rng.choice([0.7, 1.0, 1.3]))
    lg = lg.astype(np.float32)
    mx = np.float32(lg.max() / t)
    w = [np.float32(np.exp(np.float64(np.float32(x / t) - mx))) for x in lg]
    top_p = rng.choice([0.5, 0.9, 0.95, 0.99, 0.1])
    h, d = host_cut(w, top_p), device_cut(w, top_p)
    assert h == d, (trial, kind, n, top_p, h, d)
print("ok")
