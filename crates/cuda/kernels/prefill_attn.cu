// Batched prefill's attention (after prefill.cu, whose chunk layout it shares): the chunk's
// tokens through attention.cu's per-token kernels (blockIdx.z the token), or, for Qwen3-MoE's
// shapes, all of them at once on tensor cores (pf_attn_tc).

// attention.cu's per-token kernels over a chunk: blockIdx.z is the token, whose projections,
// queries, partials and outputs sit at the token's offset and whose position is its own
// StepState's. Every token's keys and values are in the cache first (pf_qk_norm_rope over the
// chunk), so token t attends to the positions up to its own.
__device__ __forceinline__ RopeParams pf_rope_token(RopeParams p) {
    u64 z = blockIdx.z, q_dim = (u64)p.n_head * p.head_dim;
    p.qkv += z * (q_dim + 2ull * p.n_kv_head * p.head_dim) * 4;
    p.q_out += z * q_dim * 4;
    p.state += z * sizeof(StepState);
    return p;
}

extern "C" __global__ void pf_qk_norm_rope(RopeParams p) {
    pdl_start();
    qk_norm_rope_head(pf_rope_token(p));
}

__device__ __forceinline__ AttnParams pf_token(AttnParams p) {
    u64 z = blockIdx.z, q_dim = (u64)p.n_head * p.head_dim;
    p.q += z * q_dim * 4;
    p.out += z * q_dim * 4;
    p.part += z * p.n_head * p.n_split * (p.head_dim + 2ull) * 4;
    p.state += z * sizeof(StepState);
    return p;
}

extern "C" __global__ void pf_attn_split(const AttnParams p) {
    pdl_start();
    attn_split_chunk(pf_token(p));
}

extern "C" __global__ void pf_attn_combine(const AttnParams p) {
    pdl_start();
    attn_combine_unit(pf_token(p), this_unit());
}

// The batched decode step's attention (batch.rs): the same per-token kernels, but token z of
// the step is one session's next token, so its keys and values live in that session's cache:
// this layer's K and V of token z are at kv[2z] and kv[2z + 1], a table the host writes each
// step. The merge (pf_attn_combine) reads no cache and serves both.
struct BtRopeParams {
    RopeParams r;
    u64 kv;  // const u64* [tokens][2]
};
SIZE_IS(BtRopeParams, 88); FIELD_AT(BtRopeParams, r, 0); FIELD_AT(BtRopeParams, kv, 80);

struct BtAttnParams {
    AttnParams a;
    u64 kv;  // const u64* [tokens][2]
};
SIZE_IS(BtAttnParams, 80); FIELD_AT(BtAttnParams, a, 0); FIELD_AT(BtAttnParams, kv, 72);

// Token blockIdx.z's K and V cache of this layer, from the table.
template <typename P> __device__ __forceinline__ P bt_cache(P p, u64 tab) {
    const u64* kv = (const u64*)tab + 2ull * blockIdx.z;
    p.k_cache = kv[0];
    p.v_cache = kv[1];
    return p;
}

extern "C" __global__ void bt_qk_norm_rope(const BtRopeParams b) {
    pdl_start();
    qk_norm_rope_head(bt_cache(pf_rope_token(b.r), b.kv));
}

extern "C" __global__ void bt_attn_split(const BtAttnParams b) {
    pdl_start();
    attn_split_chunk(bt_cache(pf_token(b.a), b.kv));
}

// Attention of a chunk's tokens on tensor cores (Qwen3-MoE's shapes: head_dim 128, 8 or 16
// query heads a KV head, f16 cache; the host picks it where these hold). A block takes a KV
// head and 16 (8) of the chunk's tokens, consecutive positions; warp w's 16 mma rows are token
// 2w's 8 heads, then token 2w + 1's (token w's 16 heads). The block walks the keys up to its last token's position in 64-key tiles that
// cp.async stages in shared memory, one tile ahead, so each tile's K and V are read once for
// 128 query rows (attn_split_chunk read them once a token and head: at a 4,096-token prompt it
// was half the prefill). A warp runs FlashAttention-2's loop over 16-key steps: S = Q K^T (Q in
// f16, pre-scaled, in registers; K by ldmatrix), a running maximum and l per row, the f16
// weights as the A operand of P V (V by ldmatrix.trans), each token masked at its own position.
#define PFA_KEYS 64
#define PFA_ROW 136  // halves a staged K or V row: 128 + 8, so ldmatrix's 8 rows hit distinct banks

#if defined(KV_F16) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_h16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const u16* ptr) {
    u32 a = (u32)__cvta_generic_to_shared(ptr);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The block's copies of keys k0.. (zeros past `last`) of KV head kvh into ks / vs.
__device__ __forceinline__ void pfa_load(const AttnParams& p, int kvh, int k0, int last, u16* ks, u16* vs) {
    int kv_dim = p.n_kv_head * 128;
    for (int i = threadIdx.x; i < PFA_KEYS * 16; i += blockDim.x) {
        int r = i >> 4, c = i & 15, t = k0 + r;
        u64 at = (u64)min(t, last - 1) * kv_dim + kvh * 128 + 8 * c;
        cp_async16((uint4*)(ks + r * PFA_ROW + 8 * c), (const u16*)p.k_cache + at, t < last);
        cp_async16((uint4*)(vs + r * PFA_ROW + 8 * c), (const u16*)p.v_cache + at, t < last);
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

// One warp's 16-key step at key t0: rows g (token a) and g + 8 (token b) masked past their
// positions pa, pb; m, l and o as tc_tile's, for both rows.
__device__ __forceinline__ void pfa_step(const u16* ks, const u16* vs, const u32 (&qa)[8][4], int t0, int pa, int pb,
                                         float (&m)[2], float (&l)[2], float (&o)[16][4]) {
    int lane = threadIdx.x & 31, c = lane & 3;
    float sc[2][4] = {};
    int kr = (lane & 7) + ((lane >> 4) << 3), kd = ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        u32 b[4];  // keys 0..7: dims 16k.., 16k+8..; keys 8..15: the same
        ldsm_x4(b, ks + kr * PFA_ROW + 16 * k + kd);
        mma_h16(sc[0], qa[k], b[0], b[1]);
        mma_h16(sc[1], qa[k], b[2], b[3]);
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int key = t0 + 8 * j + 2 * c + (e & 1);
            if (key > (e < 2 ? pa : pb)) sc[j][e] = -INFINITY;
            mx[e >> 1] = fmaxf(mx[e >> 1], sc[j][e]);
        }
    float f[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
        float mn = fmaxf(m[r], mx[r]);
        f[r] = expf(m[r] - mn);  // the first step: 0 (key 0 is every token's)
        m[r] = mn;
    }
    u32 pa4[4];
    float ls[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            u16 h0 = f2h(expf(sc[j][2 * r] - m[r])), h1 = f2h(expf(sc[j][2 * r + 1] - m[r]));
            ls[r] += h2f(h0) + h2f(h1);
            pa4[2 * j + r] = (u32)h0 | (u32)h1 << 16;  // A: row g keys 2c.. (j 0), row g + 8, then keys 8 + 2c..
        }
#pragma unroll
    for (int r = 0; r < 2; r++) l[r] = l[r] * f[r] + ls[r];
#pragma unroll
    for (int n = 0; n < 16; n++) {
        o[n][0] *= f[0];
        o[n][1] *= f[0];
        o[n][2] *= f[1];
        o[n][3] *= f[1];
    }
    int mi = lane >> 3, row = (mi & 1) * 8 + (lane & 7);
#pragma unroll
    for (int n = 0; n < 16; n += 2) {
        u32 b[4];
        ldsm_x4_t(b, vs + row * PFA_ROW + 8 * (n + (mi >> 1)));
        mma_h16(o[n], pa4, b[0], b[1]);
        mma_h16(o[n + 1], pa4, b[2], b[3]);
    }
}
#endif

#if defined(KV_F16) && __CUDA_ARCH__ >= 800
// A block of pf_attn_tc for G query heads a KV head (a divisor of 16): warp w's mma row R
// (0..15) is head R % G of token w * 16 / G + R / G of the block's 8 * 16 / G.
template <int G>
__device__ void pfa_block(const AttnParams& p, u16* smem) {
    constexpr int TW = 16 / G, TOKENS = 8 * TW;
    int kvh = blockIdx.x, z0 = blockIdx.y * TOKENS, n = p.n_split;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const StepState* st = (const StepState*)p.state;
    int q_dim = p.n_head * 128, z[2], zc[2], h[2], pos[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {  // this lane's rows g and g + 8
        int row = g + 8 * r;
        z[r] = z0 + w * TW + row / G;
        zc[r] = min(z[r], n - 1);
        h[r] = kvh * G + row % G;
        pos[r] = (int)st[zc[r]].pos;
    }
    int last = (int)st[min(z0 + TOKENS, n) - 1].pos + 1;
    u32 qa[8][4];  // A: rows g / g + 8, dims 16k + 2c.., 16k + 8 + 2c..
#pragma unroll
    for (int k = 0; k < 8; k++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float* q = (const float*)p.q + (u64)zc[i & 1] * q_dim + h[i & 1] * 128;
            float2 v = *(const float2*)(q + 16 * k + 8 * (i >> 1) + 2 * c);
            qa[k][i] = pack_h2(v.x * p.scale, v.y * p.scale);
        }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[16][4] = {};
    const int tile = 2 * PFA_KEYS * PFA_ROW;  // a staged tile's K, then its V
    int tiles = (last + PFA_KEYS - 1) / PFA_KEYS, mine = max(pos[0], pos[1]);
    pfa_load(p, kvh, 0, last, smem, smem + PFA_KEYS * PFA_ROW);
    for (int i = 0; i < tiles; i++) {
        if (i + 1 < tiles) {
            u16* next = smem + ((i + 1) & 1) * tile;
            pfa_load(p, kvh, (i + 1) * PFA_KEYS, last, next, next + PFA_KEYS * PFA_ROW);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads();
        const u16 *ks = smem + (i & 1) * tile, *vs = ks + PFA_KEYS * PFA_ROW;
        for (int s = 0; s < PFA_KEYS / 16; s++) {
            int t0 = i * PFA_KEYS + 16 * s;
            if (t0 > mine) break;  // past both rows' positions
            pfa_step(ks + 16 * s * PFA_ROW, vs + 16 * s * PFA_ROW, qa, t0, pos[0], pos[1], m, l, o);
        }
        __syncthreads();  // the buffer is refilled two tiles on
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
        if (z[r] >= n) continue;
        float* out = (float*)p.out + (u64)z[r] * q_dim + h[r] * 128;
#pragma unroll
        for (int nt = 0; nt < 16; nt++)
            *(float2*)(out + 8 * nt + 2 * c) = make_float2(o[nt][2 * r] / l[r], o[nt][2 * r + 1] / l[r]);
    }
}
#endif

// grid (n_kv_head, ceil(tokens / (128 / G))), 256 threads, dynamic shared memory for two
// staged tiles (4 * PFA_KEYS * PFA_ROW halves). p.q / p.out: the chunk's tokens' rows; p.state:
// theirs. `tokens` in p.n_split. pf_attn_tc: G = 8 (Qwen3-30B-A3B); pf_attn_tc_g16: 16
// (Qwen3-235B-A22B).
#if defined(KV_F16) && __CUDA_ARCH__ >= 800
#define PFA_BODY(G)                                       \
    extern __shared__ __align__(16) u16 pfa_smem[];       \
    pdl_start();                                          \
    pfa_block<G>(p, pfa_smem);
#else
#define PFA_BODY(G)
#endif
extern "C" __global__ void __launch_bounds__(256, 1) pf_attn_tc(const AttnParams p) { PFA_BODY(8) }
extern "C" __global__ void __launch_bounds__(256, 1) pf_attn_tc_g16(const AttnParams p) { PFA_BODY(16) }
