// Batched prefill: a chunk of prompt tokens through a layer at once, so each weight row is read
// once a chunk instead of once a token (the decode step reads all active weights per token).
// Rows of activations (tokens, or token-expert slots) are quantised once (pf_quant) and every
// weight row then dots them all in registers (pf_rows). Experts run over the slots that chose
// them (pf_route, pf_lists): the lists are built in token order by one block, so a layer's
// arithmetic is the same whatever the scheduling.

// Embedding rows of the chunk's tokens: grid (ceil(k / 256), tokens), 256 threads.
extern "C" __global__ void pf_embed(const EmbedParams p) {
    pdl_start();
    int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    u32 tok = ((const StepState*)p.state)[t].token;
    if (i < p.w.k) ((float*)p.x)[(u64)t * p.w.k + i] = weight_at(p.w, (u64)tok, i);
}

struct PfQuantParams {
    u64 src;   // const float*: row r at src + r * stride (swiglu: gate values, then up's at + n)
    u64 norm;  // const float* [n] RMSNorm weights, or 0 (no norm)
    u64 xq;    // u32* [rows, n / 32 * QXW] quantised groups (quant_store)
    u64 xf;    // float* [rows, padded_len(n)] padded floats (for the unsplit weight types)
    int n;     // n % 32 == 0, n <= 16 * 256 (load_x_fast)
    int stride;
    int swiglu;  // the row is silu(gate) * up of its 2n inputs
    float eps;
};

// grid rows, 256 threads; dynamic shared memory n floats with swiglu.
extern "C" __global__ void pf_quant(const PfQuantParams p) {
    extern __shared__ float hs[];
    __shared__ float red[33];
    pdl_start();
    int r = blockIdx.x;
    const float* src = (const float*)p.src + (u64)r * p.stride;
    if (p.swiglu) {
        for (int i = threadIdx.x; i < p.n; i += blockDim.x) {
            float g = src[i];
            hs[i] = g / (1.f + expf(-g)) * src[p.n + i];
        }
        __syncthreads();
        src = hs;
    }
    const float* norm = (const float*)p.norm;
    load_x_fast<X_QUANT>((u32*)p.xq + (u64)r * (p.n >> 5) * QXW, src, p.n, norm, p.eps, red);
    load_x_fast<X_PAD>((float*)p.xf + (u64)r * padded_len(p.n), src, p.n, norm, p.eps, red);
}

struct PfRowsParams {
    QW w;         // all groups' rows: group g's row r is row g * rows + r
    u64 xq;       // const u32* activation rows, quantised (split types)
    u64 xf;       // const float* activation rows, padded (other types)
    u64 out;      // float*: entry (in, o) and row r write out[o * out_stride + r]
    u64 list;     // const int2* [groups, list_cap] entries (activation row, output row); 0: dense
    u64 counts;   // const int* [groups] entries a group; 0: dense (n_dense entries (i, i))
    int rows;     // rows a group
    int out_stride;
    int list_cap;
    int n_dense;
    int accumulate;  // out += the dot
    int in_is_out;   // an entry's activation row is its output row (the down projection's slots)
    int z_entries;   // entries a blockIdx.z tile (dense launches), 0: all in one
    int pad;
};

// Rows a warp of pf_rows, and a block's (8 warps).
#define PF_R 4
#define PF_ROWS (8 * PF_R)

__device__ __forceinline__ int2 pf_entry(const PfRowsParams& p, const int2* list, int e) {
    int2 io = list ? list[e] : make_int2(e, e);
    if (p.in_is_out) io.x = io.y;
    return io;
}

// This lane's parts of nr split-type rows from row0 against one entry's quantised activations:
// blocks sub, sub + 4, ..; each activation group is loaded once into registers for the nr
// rows, and the 8 entries' lanes of the same sub load the same weight blocks (one broadcast).
template <class P>
__device__ __forceinline__ void pf_tile(const QW& w, u64 row0, int nr, const u32* x, int sub, float (&acc)[PF_R]) {
    int nb = w.k >> 5;
    for (int b = sub; b < nb; b += 4) {
        uint4 gv[QXW / 4];
#pragma unroll
        for (int k = 0; k < QXW / 4; k++) gv[k] = ((const uint4*)(x + b * QXW))[k];
#pragma unroll
        for (int i = 0; i < PF_R; i++)
            if (i < nr) {
                P piece;
                piece.load(w, (row0 + i) * nb + b);
                acc[i] += piece.dot((const u32*)gv);
            }
    }
}

// The unsplit types: this lane's part of each row (values or blocks sub, sub + 4, ..).
__device__ __forceinline__ void pf_tile_plain(const QW& w, u64 row0, int nr, const float* xs, int sub, float (&acc)[PF_R]) {
#pragma unroll
    for (int i = 0; i < PF_R; i++) {
        if (i >= nr) break;
        switch (w.type) {
            case T_Q8_0: acc[i] = dot_q8_0(w, row0 + i, xs, sub, 4); break;
            case T_F16: acc[i] = dot_f16(w, row0 + i, xs, sub, 4); break;
            default: acc[i] = dot_f32(w, row0 + i, xs, sub, 4);
        }
    }
}

// A warp's PF_R rows from r0 against entries [e_lo, e_hi), 8 at a time, 4 lanes an entry:
// each loaded activation group serves PF_R rows and each weight block 8 entries (the warp per
// row and entry read every entry's whole activation row once a row: ~180 MB a token a layer).
__device__ void pf_rows_warp(const PfRowsParams& p, int g, int r0, const int2* list, int e_lo, int e_hi) {
    int lane = threadIdx.x & 31, sub = lane & 3;
    int nr = min(PF_R, p.rows - r0), nb = p.w.k >> 5;
    u64 row0 = (u64)g * p.rows + r0;
    for (int e = e_lo + (lane >> 2); e - (lane >> 2) < e_hi; e += 8) {
        bool live = e < e_hi;
        int2 io = live ? pf_entry(p, list, e) : make_int2(0, 0);
        float acc[PF_R] = {};
        if (live) {
            const u32* xq = (const u32*)p.xq + (u64)io.x * nb * QXW;
            const float* xf = (const float*)p.xf + (u64)io.x * padded_len(p.w.k);
            switch (p.w.type) {
                case T_Q4_0: pf_tile<Q4_0Piece>(p.w, row0, nr, xq, sub, acc); break;
                case T_Q4_K: pf_tile<Q4_KPiece>(p.w, row0, nr, xq, sub, acc); break;
                case T_Q6_K: pf_tile<Q6_KPiece>(p.w, row0, nr, xq, sub, acc); break;
                default: pf_tile_plain(p.w, row0, nr, xf, sub, acc);
            }
        }
#pragma unroll
        for (int i = 0; i < PF_R; i++) {
            acc[i] += __shfl_xor_sync(0xffffffff, acc[i], 1);
            acc[i] += __shfl_xor_sync(0xffffffff, acc[i], 2);
        }
        if (live && sub == 0)
            for (int i = 0; i < nr; i++) {
                float* dst = (float*)p.out + (u64)io.y * p.out_stride + r0 + i;
                *dst = p.accumulate ? *dst + acc[i] : acc[i];
            }
    }
}

// grid (ceil(rows / PF_ROWS), groups, entry tiles), 256 threads. Dense launches split their
// entries in tiles of z_entries over blockIdx.z (more blocks); grouped ones take all of a
// group's entries in one.
extern "C" __global__ void __launch_bounds__(256, 3) pf_rows(const PfRowsParams p) {
    pdl_start();
    int g = blockIdx.y, r0 = blockIdx.x * PF_ROWS + (threadIdx.x >> 5) * PF_R;
    int n = p.counts ? ((const int*)p.counts)[g] : p.n_dense;
    int e_lo = p.z_entries ? blockIdx.z * p.z_entries : 0;
    int e_hi = p.z_entries ? min(n, e_lo + p.z_entries) : n;
    if (e_lo >= e_hi || r0 >= p.rows) return;  // an expert no token chose: its rows are not read
    const int2* list = p.list ? (const int2*)p.list + (u64)g * p.list_cap : nullptr;
    pf_rows_warp(p, g, r0, list, e_lo, e_hi);
}

// Tensor-core rows for the split types (Q4_0, Q4_K, Q6_K): pf_rows' dots as int8 mma, a warp's
// 16 rows against 8 entries a tile (m16n8k32; Q6_K's two half-blocks have their own scales, so
// m16n8k16 each). A weight block's nibbles (values 0..15, or Q6_K's 0..63) are the unsigned A
// operand; the activation group's signed high and unsigned low bytes (QXW) are two B operands,
// summed as 256 hi + lo in the accumulator, so a block's integer sum is exact, as dp4a's, and
// each block's scales apply to it as in the decode's dots. Why: pf_rows' dp4a dots were the
// batched prefill's whole time (1.46 of ~1.65 s at a 1,024-token prompt), slower than the
// decode step run once a token.
#define PFM_WARPS 8
#define PFM_ROWS (16 * PFM_WARPS)
#define PFM_NT 4
#define PFM_ENTRIES (8 * PFM_NT)

// c += a (16 x 32 unsigned bytes) times b (32 x 8 bytes, signed: SB) in s32.
template <bool SB>
__device__ __forceinline__ void mma_k32(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (SB)
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <bool SB>
__device__ __forceinline__ void mma_k16(int (&c)[4], u32 a0, u32 a1, u32 b) {
    if (SB)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a0), "r"(a1), "r"(b));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a0), "r"(a1), "r"(b));
}
// Exact integer sums of the weights against q = 256 hi + lo: hi's sums, scaled, start lo's.
__device__ __forceinline__ void idot_k32(int (&c)[4], const u32 (&a)[4], u32 hi0, u32 lo0, u32 hi1, u32 lo1) {
    c[0] = c[1] = c[2] = c[3] = 0;
    mma_k32<true>(c, a, hi0, hi1);
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] <<= 8;
    mma_k32<false>(c, a, lo0, lo1);
}
__device__ __forceinline__ void idot_k16(int (&c)[4], u32 a0, u32 a1, u32 hi, u32 lo) {
    c[0] = c[1] = c[2] = c[3] = 0;
    mma_k16<true>(c, a0, a1, hi);
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] <<= 8;
    mma_k16<false>(c, a0, a1, lo);
}

// One lane's part of a block of rows g and g + 8: the nibble word t (weights 4t..4t+3 in its
// low nibbles, 16+4t.. in its high ones) and the rows' scales. `add` adds the block's part of
// each output this lane holds (c[i]: row g (i < 2) or g + 8, entry 2t + (i & 1)) given the
// 8 entries' activation words x (entry g's words 4t..4t+3) and the lane's two entries' group
// tails s0, s1 (scale, half sums).
struct PfmQ4_0 {
    u32 q[2];
    float d[2];
    __device__ __forceinline__ void load(const QW& w, const u64 (&bi)[2], int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            q[r] = ((const u32*)w.data)[bi[r] * 4 + t];
            d[r] = h2f(((const u16*)w.scales)[bi[r]]);
        }
    }
    __device__ __forceinline__ void add(uint4 x, uint4 s0, uint4 s1, float (&acc)[4]) const {
        u32 a[4] = {q[0] & 0x0F0F0F0Fu, q[1] & 0x0F0F0F0Fu, (q[0] >> 4) & 0x0F0F0F0Fu, (q[1] >> 4) & 0x0F0F0F0Fu};
        int c[4];
        idot_k32(c, a, x.x, x.y, x.z, x.w);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 s = (i & 1) ? s1 : s0;
            acc[i] += d[i >> 1] * (__uint_as_float(s.x) * (float)(c[i] - 8 * (int)(s.y + s.z)));
        }
    }
};
struct PfmQ4_K {
    u32 q[2];
    float ds[2], dm[2];
    __device__ __forceinline__ void load(const QW& w, const u64 (&bi)[2], int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            Q4_KPiece piece;
            const u8* a = (const u8*)w.scales + (bi[r] >> 3) * 24;
            piece.dm = *(const u32*)a;
            piece.sm = *(const u16*)(a + 4 + (bi[r] & 7) * 2);
            q[r] = ((const u32*)w.data)[bi[r] * 4 + t];
            ds[r] = piece.scale();
            dm[r] = piece.offset();
        }
    }
    __device__ __forceinline__ void add(uint4 x, uint4 s0, uint4 s1, float (&acc)[4]) const {
        u32 a[4] = {q[0] & 0x0F0F0F0Fu, q[1] & 0x0F0F0F0Fu, (q[0] >> 4) & 0x0F0F0F0Fu, (q[1] >> 4) & 0x0F0F0F0Fu};
        int c[4];
        idot_k32(c, a, x.x, x.y, x.z, x.w);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 s = (i & 1) ? s1 : s0;
            int r = i >> 1;
            acc[i] += __uint_as_float(s.x) * (ds[r] * (float)c[i] - dm[r] * (float)(int)(s.y + s.z));
        }
    }
};
struct PfmQ6_K {
    u32 lo[2], hi[2];  // 6-bit values of weights 4t.. and 16+4t.. (q6_k_bytes' word t)
    float d[2], sc0[2], sc1[2];
    __device__ __forceinline__ void load(const QW& w, const u64 (&bi)[2], int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const u8* a = (const u8*)w.scales + (bi[r] >> 3) * 96;
            uint2 g = *(const uint2*)(a + (bi[r] & 7) * 8);
            u32 sw = *(const u32*)(a + 64 + (bi[r] & 7) * 4);
            u32 q = ((const u32*)w.data)[bi[r] * 4 + t];
            lo[r] = (q & 0x0F0F0F0Fu) | (((g.x >> (2 * t)) & 0x03030303u) << 4);
            hi[r] = ((q >> 4) & 0x0F0F0F0Fu) | (((g.y >> (2 * t)) & 0x03030303u) << 4);
            d[r] = h2f((u16)(sw & 0xffff));
            sc0[r] = (float)(signed char)(sw >> 16);
            sc1[r] = (float)(signed char)(sw >> 24);
        }
    }
    __device__ __forceinline__ void add(uint4 x, uint4 s0, uint4 s1, float (&acc)[4]) const {
        int c0[4], c1[4];
        idot_k16(c0, lo[0], lo[1], x.x, x.y);
        idot_k16(c1, hi[0], hi[1], x.z, x.w);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 s = (i & 1) ? s1 : s0;
            int r = i >> 1;
            float a = sc0[r] * (float)(c0[i] - 32 * (int)s.y), b = sc1[r] * (float)(c1[i] - 32 * (int)s.z);
            acc[i] += d[r] * (__uint_as_float(s.x) * (a + b));
        }
    }
};

// A warp's 16 rows from r0 (group g's) against entries [e_lo, e_hi), PFM_ENTRIES at a time.
// Rows and entries past the ends are read as the last ones and not stored.
template <class F>
__device__ void pfm_warp(const PfRowsParams& p, int grp, int r0, const int2* list, int e_lo, int e_hi) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, nb = p.w.k >> 5;
    u64 base = (u64)grp * p.rows;
    u64 bi[2] = {(base + min(r0 + g, p.rows - 1)) * nb, (base + min(r0 + g + 8, p.rows - 1)) * nb};
    const u32* xq = (const u32*)p.xq;
    for (int e0 = e_lo; e0 < e_hi; e0 += PFM_ENTRIES) {
        u32 xb[PFM_NT], xs[PFM_NT][2];  // word offsets: entry g's activations, entries 2t, 2t+1's
#pragma unroll
        for (int n = 0; n < PFM_NT; n++) {
            xb[n] = (u32)pf_entry(p, list, min(e0 + n * 8 + g, e_hi - 1)).x * nb * QXW + 4 * t;
#pragma unroll
            for (int j = 0; j < 2; j++) xs[n][j] = (u32)pf_entry(p, list, min(e0 + n * 8 + 2 * t + j, e_hi - 1)).x * nb * QXW + 16;
        }
        float acc[PFM_NT][4] = {};
#pragma unroll 1
        for (int b = 0; b < nb; b++) {
            F f;
            u64 bb[2] = {bi[0] + b, bi[1] + b};
            f.load(p.w, bb, t);
#pragma unroll
            for (int n = 0; n < PFM_NT; n++) {
                uint4 x = *(const uint4*)(xq + xb[n] + b * QXW);
                uint4 s0 = *(const uint4*)(xq + xs[n][0] + b * QXW);
                uint4 s1 = *(const uint4*)(xq + xs[n][1] + b * QXW);
                f.add(x, s0, s1, acc[n]);
            }
        }
#pragma unroll
        for (int n = 0; n < PFM_NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int e = e0 + n * 8 + 2 * t + (i & 1), r = r0 + g + 8 * (i >> 1);
                if (e >= e_hi || r >= p.rows) continue;
                float* dst = (float*)p.out + (u64)pf_entry(p, list, e).y * p.out_stride + r;
                *dst = p.accumulate ? *dst + acc[n][i] : acc[n][i];
            }
    }
}

// grid (ceil(rows / PFM_ROWS), groups, entry tiles), 256 threads: pf_rows for the split types.
extern "C" __global__ void __launch_bounds__(256, 2) pf_mma(const PfRowsParams p) {
    pdl_start();
    int g = blockIdx.y, r0 = blockIdx.x * PFM_ROWS + (threadIdx.x >> 5) * 16;
    int n = p.counts ? ((const int*)p.counts)[g] : p.n_dense;
    int e_lo = p.z_entries ? blockIdx.z * p.z_entries : 0;
    int e_hi = p.z_entries ? min(n, e_lo + p.z_entries) : n;
    if (e_lo >= e_hi || r0 >= p.rows) return;  // an expert no token chose: its rows are not read
    const int2* list = p.list ? (const int2*)p.list + (u64)g * p.list_cap : nullptr;
    switch (p.w.type) {
        case T_Q4_0: pfm_warp<PfmQ4_0>(p, g, r0, list, e_lo, e_hi); break;
        case T_Q4_K: pfm_warp<PfmQ4_K>(p, g, r0, list, e_lo, e_hi); break;
        default: pfm_warp<PfmQ6_K>(p, g, r0, list, e_lo, e_hi);
    }
}

// Each token's experts and weights from its router logits (topk_block, as moe_topk): grid
// tokens, 32 threads.
extern "C" __global__ void pf_route(const TopkParams p) {
    __shared__ float pr[4096];
    __shared__ float red[1];
    pdl_start();
    int t = blockIdx.x;
    topk_block((const float*)p.logits + (u64)t * p.n_expert, p.n_expert, p.n_used, p.norm_topk,
               (int*)p.ids + t * p.n_used, (float*)p.weights + t * p.n_used, pr, red);
}

struct PfListsParams {
    u64 ids;     // const int* [tokens, n_used]
    u64 list;    // int2* [n_expert, list_cap]: (token, slot t * n_used + k) of each choice
    u64 counts;  // int* [n_expert]
    int tokens;
    int n_used;
    int n_expert;
    int list_cap;
};

// One block: thread e lists expert e's slots in token order (a token picks an expert once).
extern "C" __global__ void pf_lists(const PfListsParams p) {
    pdl_start();
    const int* ids = (const int*)p.ids;
    for (int e = threadIdx.x; e < p.n_expert; e += blockDim.x) {
        int2* list = (int2*)p.list + (u64)e * p.list_cap;
        int n = 0;
        for (int i = 0; i < p.tokens * p.n_used; i++)
            if (ids[i] == e && n < p.list_cap) list[n++] = make_int2(i / p.n_used, i);
        ((int*)p.counts)[e] = n;
    }
}

struct PfCombineParams {
    u64 x;        // float* [tokens, d] residual (+=)
    u64 y;        // const float* [tokens * n_used, d] each slot's expert output
    u64 weights;  // const float* [tokens, n_used]
    int d;
    int n_used;
};

// x[t] += the weighted sum of its slots' outputs, in slot order: grid (ceil(d / 256), tokens).
extern "C" __global__ void pf_combine(const PfCombineParams p) {
    pdl_start();
    int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.d) return;
    const float* w = (const float*)p.weights + t * p.n_used;
    float acc = 0.f;
    for (int k = 0; k < p.n_used; k++) acc += w[k] * ((const float*)p.y)[((u64)t * p.n_used + k) * p.d + i];
    ((float*)p.x)[(u64)t * p.d + i] += acc;
}

// attention.cu's per-token kernels over a chunk: blockIdx.z is the token, whose projections,
// queries, partials and outputs sit at the token's offset and whose position is its own
// StepState's. Every token's keys and values are in the cache first (pf_qk_norm_rope over the
// chunk), so token t attends to the positions up to its own.
extern "C" __global__ void pf_qk_norm_rope(RopeParams p) {
    pdl_start();
    u64 z = blockIdx.z, q_dim = (u64)p.n_head * p.head_dim;
    p.qkv += z * (q_dim + 2ull * p.n_kv_head * p.head_dim) * 4;
    p.q_out += z * q_dim * 4;
    p.state += z * sizeof(StepState);
    qk_norm_rope_head(p);
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
