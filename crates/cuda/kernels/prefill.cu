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
};

// Rows a block of pf_rows: a warp a row.
#define PF_ROWS 8

__device__ __forceinline__ int2 pf_entry(const PfRowsParams& p, const int2* list, int e) {
    int2 io = list ? list[e] : make_int2(e, e);
    if (p.in_is_out) io.x = io.y;
    return io;
}

// This lane's part of a split-type row against its entry's quantised activations: blocks
// sub, sub + L, ..; the row's blocks come from L1 for every entry after the first.
template <class P, int L>
__device__ __forceinline__ float pf_part(const QW& w, u64 row, const u32* x, int sub) {
    int nb = w.k >> 5;
    float acc = 0.f;
#pragma unroll 4
    for (int b = sub; b < nb; b += L) {
        P piece;
        piece.load(w, row * nb + b);
        acc += piece.dot(x + b * QXW);
    }
    return acc;
}

template <int L>
__device__ __forceinline__ float pf_dot(const PfRowsParams& p, u64 row, int2 io, int sub) {
    const QW& w = p.w;
    const u32* xq = (const u32*)p.xq + (u64)io.x * (w.k >> 5) * QXW;
    const float* xf = (const float*)p.xf + (u64)io.x * padded_len(w.k);
    switch (w.type) {
        case T_Q4_0: return pf_part<Q4_0Piece, L>(w, row, xq, sub);
        case T_Q4_K: return pf_part<Q4_KPiece, L>(w, row, xq, sub);
        case T_Q6_K: return pf_part<Q6_KPiece, L>(w, row, xq, sub);
        case T_Q8_0: return dot_q8_0(w, row, xf, sub, L);
        case T_F16: return dot_f16(w, row, xf, sub, L);
        default: return dot_f32(w, row, xf, sub, L);
    }
}

// Row `row` (output column r) against the n entries, 32 / L entries at a time, L lanes an
// entry: no warp-wide reduction a dot (it was the chain each row and token waited on), and a
// lane's blocks are a sequence of independent loads.
template <int L>
__device__ void pf_row(const PfRowsParams& p, u64 row, int r, const int2* list, int n) {
    int lane = threadIdx.x & 31, sub = lane % L;
    for (int e = lane / L; e - lane / L < n; e += 32 / L) {
        bool live = e < n;
        int2 io = live ? pf_entry(p, list, e) : make_int2(0, 0);
        float acc = live ? pf_dot<L>(p, row, io, sub) : 0.f;
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
        if (live && sub == 0) {
            float* dst = (float*)p.out + (u64)io.y * p.out_stride + r;
            *dst = p.accumulate ? *dst + acc : acc;
        }
    }
}

// grid (ceil(rows / PF_ROWS), groups), 256 threads. A group with at most 8 entries (an expert
// in a chunk of few tokens) gives each 4 lanes, a larger one each entry a lane.
extern "C" __global__ void __launch_bounds__(256, 3) pf_rows(const PfRowsParams p) {
    pdl_start();
    int g = blockIdx.y, r = blockIdx.x * PF_ROWS + (threadIdx.x >> 5);
    int n = p.counts ? ((const int*)p.counts)[g] : p.n_dense;
    if (n == 0 || r >= p.rows) return;  // an expert no token chose: its rows are not read
    const int2* list = p.list ? (const int2*)p.list + (u64)g * p.list_cap : nullptr;
    u64 row = (u64)g * p.rows + r;
    if (n <= 8) pf_row<4>(p, row, r, list, n);
    else pf_row<1>(p, row, r, list, n);
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
