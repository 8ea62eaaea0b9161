#!/usr/bin/env python3
"""Emulates attn_gqa_128_8_tc's fragment index math (attention.cu) for one warp's tile, from the
PTX ISA's fragment layouts of mma.m16n8k16 (f16) and ldmatrix.x4.trans, against direct attention:
the dims' permutation inside each 16-dim step, K's B operands from a thread's 16-byte loads, P
taken from the S^T accumulators as they stand, V's B operands through ldmatrix.trans. Runs
without a GPU (needs numpy): python3 dev/cuda-tools/tc_layout_emu.py"""
import numpy as np
rng = np.random.default_rng(1)
Q = rng.standard_normal((8, 128)).astype(np.float32)
K = rng.standard_normal((16, 128)).astype(np.float32)
V = rng.standard_normal((16, 128)).astype(np.float32)
scale = 0.088
def mma(c, a, b):
    # a: per thread 8 halves (a0..a7); b: per thread 4 halves; c: per thread 4 floats. Build matrices.
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for t in range(32):
        g, tig = t >> 2, t & 3
        for i in range(8):
            A[g + 8 * ((i >> 1) & 1), tig * 2 + (i & 1) + 8 * (i >> 2)] = a[t][i]
        for i in range(4):
            B[tig * 2 + (i & 1) + 8 * (i >> 1), g] = b[t][i]
        for i in range(4):
            C[g + 8 * (i >> 1), tig * 2 + (i & 1)] = c[t][i]
    D = A @ B + C
    return [[D[(t >> 2) + 8 * (i >> 1), (t & 3) * 2 + (i & 1)] for i in range(4)] for t in range(32)]
def frag_err(frags, ref):
    # max |C fragment - reference| over 8-column tiles n: thread t holds head t / 4, columns
    # 8n + 2 (t % 4) + {0, 1} in its first two accumulators (the last two: the padded heads)
    return max(abs(frags[n][t][e] - ref[t >> 2, 8 * n + 2 * (t & 3) + e])
               for n in range(len(frags)) for t in range(32) for e in range(2))
# K rows as loaded: kq[j*4+s] = row 8j + g, dims 32s + 8c .. +8 (8 halves x,y,z,w pairs)
sc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
for j in range(2):
    for k in range(8):
        a = []; b = []
        for t in range(32):
            g, c = t >> 2, t & 3
            base = 32 * (k >> 1) + 8 * c + 4 * (k & 1)
            q = Q[g] * scale
            # qa[k][0] = (q[base], q[base+1]) -> a0,a1 ; qa[k][1] = (q[base+2], q[base+3]) -> a4,a5; rows 8..15 zero
            a.append([q[base], q[base + 1], 0, 0, q[base + 2], q[base + 3], 0, 0])
            row = 8 * j + g
            w = K[row, 32 * (k >> 1) + 8 * c: 32 * (k >> 1) + 8 * c + 8]  # halves 0..7
            b0 = (w[4], w[5]) if k & 1 else (w[0], w[1])
            b1 = (w[6], w[7]) if k & 1 else (w[2], w[3])
            b.append([b0[0], b0[1], b1[0], b1[1]])
        sc[j] = mma(sc[j], a, b)
S = (Q * scale) @ K.T  # [8 heads, 16 positions]
err = frag_err(sc, S)
assert all(abs(sc[j][t][e]) < 1e-9 for j in range(2) for t in range(32) for e in (2, 3))  # padded heads
print("scores max err", err)
assert err < 1e-5
# softmax over the tile (single tile: m = row max), P as A: pa[0] = (p[j=0][e0], p[j=0][e1]), pa[1] = j=1's
m = S.max(axis=1)
P = np.exp(S - m[:, None])
o = [[[0.0] * 4 for _ in range(32)] for _ in range(16)]
# ldmatrix x4 trans over the staged V (rows = positions, 8 halves a matrix row)
def ldsm_x4_t(addr):  # addr[t] = (row, col) of the 8-element row thread t provides
    mats = [np.array([V[addr[8 * mi + r][0], addr[8 * mi + r][1]: addr[8 * mi + r][1] + 8] for r in range(8)]) for mi in range(4)]
    return [[(mats[mi][2 * (t & 3), t >> 2], mats[mi][2 * (t & 3) + 1, t >> 2]) for mi in range(4)] for t in range(32)]
for n in range(0, 16, 2):
    addr = []
    for t in range(32):
        mi = t >> 3; row = (mi & 1) * 8 + (t & 7)
        addr.append((row, 8 * (n + (mi >> 1))))
    r = ldsm_x4_t(addr)
    a = []
    for t in range(32):
        g, c = t >> 2, t & 3
        a.append([P[g, 2 * c], P[g, 2 * c + 1], 0, 0, P[g, 8 + 2 * c], P[g, 8 + 2 * c + 1], 0, 0])
    o[n] = mma(o[n], a, [[r[t][0][0], r[t][0][1], r[t][1][0], r[t][1][1]] for t in range(32)])
    o[n + 1] = mma(o[n + 1], a, [[r[t][2][0], r[t][2][1], r[t][3][0], r[t][3][1]] for t in range(32)])
O = P @ V
err = frag_err(o, O)
print("P V max err", err)
assert err < 1e-5
