// Batched prefill: a chunk of prompt tokens through a layer at once, so each weight row is read
// once a chunk instead of once a token (the decode step reads all active weights per token).
// Rows of activations (tokens, or token-expert slots) are quantised once (pf_quant) and every
// weight row then dots them all: on tensor cores for the split types (pf_mma), in shared-memory
// tiles for F32 (pf_f32rows, the router), in registers for the rest (pf_rows). Experts run over
// the slots that chose them (pf_route, pf_lists, pf_tiles): each expert's list is in token
// order and every output is written by one thread, so a layer's arithmetic is the same
// whatever the scheduling. Attention is prefill_attn.cu.

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
SIZE_IS(PfQuantParams, 48); FIELD_AT(PfQuantParams, src, 0); FIELD_AT(PfQuantParams, norm, 8);
FIELD_AT(PfQuantParams, xq, 16); FIELD_AT(PfQuantParams, xf, 24); FIELD_AT(PfQuantParams, n, 32);
FIELD_AT(PfQuantParams, stride, 36); FIELD_AT(PfQuantParams, swiglu, 40); FIELD_AT(PfQuantParams, eps, 44);

// Row r of p's activations from the values at `src`: its quantised groups and padded floats
// (RMSNorm'd with p.norm unless 0). `red`: 33 floats of shared memory.
__device__ __forceinline__ void pf_quant_row(const PfQuantParams& p, int r, const float* src, float* red) {
    const float* norm = (const float*)p.norm;
    load_x_fast<X_QUANT>((u32*)p.xq + (u64)r * (p.n >> 5) * QXW, src, p.n, norm, p.eps, red);
    load_x_fast<X_PAD>((float*)p.xf + (u64)r * padded_len(p.n), src, p.n, norm, p.eps, red);
}

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
            hs[i] = swiglu(g, src[p.n + i]);
        }
        __syncthreads();
        src = hs;
    }
    pf_quant_row(p, r, src, red);
}

struct PfRowsParams {
    QW w;         // all groups' rows: group g's row r is row g * rows + r
    u64 xq;       // const u32* activation rows, quantised (split types)
    u64 xf;       // const float* activation rows, padded (other types)
    u64 out;      // float*: entry (in, o) and row r write out[o * out_stride + r]
    u64 list;     // const int2* [groups, list_cap] entries (activation row, output row); 0: dense
    u64 counts;   // const int* [groups] entries a group; 0: dense (n_dense entries (i, i))
    u64 tiles;    // const int2*: [0].x tiles, then (group, first entry) of each (pf_tiles); pf_mma's
                  // grouped launches take one a blockIdx.y
    int rows;     // rows a group
    int out_stride;
    int list_cap;
    int n_dense;
    int accumulate;  // out += the dot
    int in_is_out;   // an entry's activation row is its output row (the down projection's slots)
    int z_entries;   // entries a blockIdx.z tile (dense launches), 0: all in one
    int pad;
};
SIZE_IS(PfRowsParams, 104); FIELD_AT(PfRowsParams, w, 0); FIELD_AT(PfRowsParams, xq, 24);
FIELD_AT(PfRowsParams, xf, 32); FIELD_AT(PfRowsParams, out, 40); FIELD_AT(PfRowsParams, list, 48);
FIELD_AT(PfRowsParams, counts, 56); FIELD_AT(PfRowsParams, tiles, 64); FIELD_AT(PfRowsParams, rows, 72);
FIELD_AT(PfRowsParams, out_stride, 76); FIELD_AT(PfRowsParams, list_cap, 80);
FIELD_AT(PfRowsParams, n_dense, 84); FIELD_AT(PfRowsParams, accumulate, 88);
FIELD_AT(PfRowsParams, in_is_out, 92); FIELD_AT(PfRowsParams, z_entries, 96);
FIELD_AT(PfRowsParams, pad, 100);

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

// c += a (16 x 32 bytes, signed: SA) times b (32 x 8 bytes, signed: SB) in s32. Not volatile:
// the mma have no side effects, so the compiler may schedule them among the epilogue's arithmetic.
#define PFM_MMA_K32(ta, tb)                                                                                            \
    asm("mma.sync.aligned.m16n8k32.row.col.s32." ta "." tb ".s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])                                                            \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <bool SA, bool SB>
__device__ __forceinline__ void mma_k32(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (SA && SB) PFM_MMA_K32("s8", "s8");
    else if (SA) PFM_MMA_K32("s8", "u8");
    else if (SB) PFM_MMA_K32("u8", "s8");
    else PFM_MMA_K32("u8", "u8");
}
// mma_k32's m16n8k16 (unsigned a: Q6_K's 6-bit values).
#define PFM_MMA_K16(tb)                                                                                 \
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8." tb ".s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};" \
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])                                             \
        : "r"(a0), "r"(a1), "r"(b))
template <bool SB>
__device__ __forceinline__ void mma_k16(int (&c)[4], u32 a0, u32 a1, u32 b) {
    if (SB) PFM_MMA_K16("s8");
    else PFM_MMA_K16("u8");
}
// Exact integer sums of the weights (signed: SA) against q = 256 hi + lo: hi's sums, scaled,
// start lo's.
template <bool SA>
__device__ __forceinline__ void idot_k32(int (&c)[4], const u32 (&a)[4], u32 hi0, u32 lo0, u32 hi1, u32 lo1) {
    c[0] = c[1] = c[2] = c[3] = 0;
    mma_k32<SA, true>(c, a, hi0, hi1);
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] <<= 8;
    mma_k32<SA, false>(c, a, lo0, lo1);
}
// idot_k32 of rows g and g + 8's nibble words q (A: their low nibbles are weights 4t..4t+3,
// the high ones 16+4t..) against an entry's activation words x (high, low, high, low bytes);
// CENTRED: the nibbles less 8 as signed bytes ((n + 0x78) ^ 0x80 a byte: no carries), so Q4_0's
// sums need no correction by the group's sum after.
template <bool CENTRED>
__device__ __forceinline__ void nibble_idot_k32(int (&c)[4], const u32 (&q)[2], uint4 x) {
    u32 a[4] = {q[0] & 0x0F0F0F0Fu, q[1] & 0x0F0F0F0Fu, (q[0] >> 4) & 0x0F0F0F0Fu, (q[1] >> 4) & 0x0F0F0F0Fu};
    if (CENTRED)
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = (a[i] + 0x78787878u) ^ 0x80808080u;
    idot_k32<CENTRED>(c, a, x.x, x.y, x.z, x.w);
}
__device__ __forceinline__ void idot_k16(int (&c)[4], u32 a0, u32 a1, u32 hi, u32 lo) {
    c[0] = c[1] = c[2] = c[3] = 0;
    mma_k16<true>(c, a0, a1, hi);
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] <<= 8;
    mma_k16<false>(c, a0, a1, lo);
}

// A stage of pf_mma: PFM_STAGE blocks (one K super-block) of the block's rows and entries in
// shared memory, copied by cp.async while the previous stage's mma run. Strides are padded so
// a warp's reads of 8 rows' (or entries') words hit distinct banks.
#define PFM_STAGE 8
#define PFM_WROW 144                        // a row's nibbles: 8 blocks x 16 bytes + 16
#define PFM_AROW 104                        // a row's aux, at most (Q6_K: 96 + 8)
#define PFM_XENT 576                        // an entry's words 0..15 of 8 groups (64 bytes) + 64

// The staged stride of a super-block's (8 blocks') aux bytes (split_aux) of a row: an odd number
// of 8-byte words, so 8 rows' reads hit distinct banks.
__device__ __forceinline__ int pfm_aux_stride(int type) { return type == T_Q4_0 ? 24 : type == T_Q4_K ? 24 : 104; }

// A tile of the tensor-core kernels: W warps of 16 rows, NT n-tiles of 8 entries (pf_mma: 8 x
// 4; bt_mma in batch_rows.cu: fewer of each).
// STAGES super-blocks are in flight at once (staged buffers); FEW: the tile's entries are few
// and may repeat (the batched step's), so only the distinct ones are copied, through L1.
template <int W, int NT, int STAGES_, bool FEW_>
struct PfmShape {
    static constexpr int ROWS = 16 * W, ENTRIES = 8 * NT, STAGES = STAGES_;
    static constexpr bool FEW = FEW_;
    static constexpr int STAGE_BYTES = ROWS * (PFM_WROW + PFM_AROW) + ENTRIES * (PFM_XENT + 16 * PFM_STAGE);
};
typedef PfmShape<PFM_WARPS, PFM_NT, 2, false> PfmFull;

struct PfmStage {
    u8* w;       // [ROWS][PFM_WROW] nibbles
    u8* aux;     // [ROWS][aux stride]
    u8* x;       // [ENTRIES][PFM_XENT] words 0..15 of each group
    uint4* tail; // [PFM_STAGE][ENTRIES] words 16..19 (scale, half sums)
};
template <class S>
__device__ __forceinline__ PfmStage pfm_stage(u8* smem, int s) {
    u8* b = smem + s * S::STAGE_BYTES;
    return PfmStage{b, b + S::ROWS * PFM_WROW, b + S::ROWS * (PFM_WROW + PFM_AROW),
                    (uint4*)(b + S::ROWS * (PFM_WROW + PFM_AROW) + S::ENTRIES * PFM_XENT)};
}

// The 4-bit types' add: the integer sums of the rows' nibbles, then each output's term (the
// type's scales) for its row and its entry's group tail.
template <class F>
__device__ __forceinline__ void nibble_add(const F& f, uint4 x, uint4 s0, uint4 s1, float (&acc)[4]) {
    int c[4];
    nibble_idot_k32<F::CENTRED>(c, f.q, x);
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] += f.term(i >> 1, c[i], (i & 1) ? s1 : s0);
}

// One lane's part of block j of rows g and g + 8 (`w` at the rows' nibbles, `aux` at their
// super-block's aux): the nibble word t (weights 4t..4t+3 in its low nibbles, 16+4t.. in its
// high ones) and the rows' scales. `add` adds the block's part of each output this lane holds
// (c[i]: row g (i < 2) or g + 8, entry 2t + (i & 1)) given entry g's activation words x (4t..
// 4t+3) and the lane's two entries' group tails s0, s1 (scale, half sums).
struct PfmQ4_0 {
    static constexpr bool CENTRED = true;
    u32 q[2];
    float d[2];
    __device__ __forceinline__ void load(const u8* const (&w)[2], const u8* const (&aux)[2], int j, int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            q[r] = *(const u32*)(w[r] + 16 * j + 4 * t);
            d[r] = h2f(*(const u16*)(aux[r] + 2 * j));
        }
    }
    // Row r's block against a group (tail s) with integer sum c of the centred nibbles: d * s * c.
    __device__ __forceinline__ float term(int r, int c, uint4 s) const {
        return d[r] * (__uint_as_float(s.x) * (float)c);
    }
    __device__ __forceinline__ void add(uint4 x, uint4 s0, uint4 s1, float (&acc)[4]) const { nibble_add(*this, x, s0, s1, acc); }
};
struct PfmQ4_K {
    static constexpr bool CENTRED = false;
    u32 q[2];
    float ds[2], dm[2];
    __device__ __forceinline__ void load(const u8* const (&w)[2], const u8* const (&aux)[2], int j, int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            Q4_KPiece piece;
            piece.dm = *(const u32*)aux[r];
            piece.sm = *(const u16*)(aux[r] + 4 + 2 * j);
            q[r] = *(const u32*)(w[r] + 16 * j + 4 * t);
            ds[r] = piece.scale();
            dm[r] = piece.offset();
        }
    }
    // s * (ds c - dm sum(q)): ggml's (d * sc) * q - dmin * m.
    __device__ __forceinline__ float term(int r, int c, uint4 s) const {
        return __uint_as_float(s.x) * (ds[r] * (float)c - dm[r] * (float)(int)(s.y + s.z));
    }
    __device__ __forceinline__ void add(uint4 x, uint4 s0, uint4 s1, float (&acc)[4]) const { nibble_add(*this, x, s0, s1, acc); }
};
struct PfmQ6_K {
    u32 lo[2], hi[2];  // 6-bit values of weights 4t.. and 16+4t.. (q6_k_bytes' word t)
    float d[2], sc0[2], sc1[2];
    __device__ __forceinline__ void load(const u8* const (&w)[2], const u8* const (&aux)[2], int j, int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            uint2 g = *(const uint2*)(aux[r] + 8 * j);
            u32 sw = *(const u32*)(aux[r] + 64 + 4 * j);
            u32 q = *(const u32*)(w[r] + 16 * j + 4 * t);
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
            int r = i >> 1;
            acc[i] += term(d[r], sc0[r], sc1[r], c0[i], c1[i], (i & 1) ? s1 : s0);
        }
    }
    // A block's term from its halves' integer sums c0, c1 against a group (tail s).
    __device__ __forceinline__ static float term(float d, float sc0, float sc1, int c0, int c1, uint4 s) {
        float a = sc0 * (float)(c0 - 32 * (int)s.y), b = sc1 * (float)(c1 - 32 * (int)s.z);
        return d * (__uint_as_float(s.x) * (a + b));
    }
};

// The whole block's copies of super-block kb into st: its S::ROWS rows from r0 (rows past the
// end read as the last; with PFM_LOAD_W) and the tile's entries' groups (activation rows `in`;
// with PFM_LOAD_X, which commits the copies as one group). Apart so a launch whose weights
// never change can issue its first stage's weight copies before pdl_wait.
#define PFM_LOAD_W 1
#define PFM_LOAD_X 2
template <class S>
__device__ void pfm_load(const PfRowsParams& p, int grp, int r0, const int* in, int ne, int kb, const PfmStage& st, int what) {
    // The aux copies in 8-byte words where the super-block's aux is a whole number of them,
    // else in 4-byte ones (Q4_K's 20 bytes).
    int nb = p.w.k >> 5, aux = split_aux(p.w.type), as = pfm_aux_stride(p.w.type);
    int unit = aux & 7 ? 4 : 8, na = aux / unit;
    u64 base = (u64)grp * p.rows;
    if (what & PFM_LOAD_W) {
        for (int i = threadIdx.x; i < S::ROWS * PFM_STAGE; i += blockDim.x) {
            int r = i >> 3, j = i & 7;
            u64 row = base + min(r0 + r, p.rows - 1);
            cp_async16((uint4*)(st.w + r * PFM_WROW + 16 * j), (const uint4*)p.w.data + row * nb + kb * PFM_STAGE + j, true);
        }
        for (int i = threadIdx.x; i < S::ROWS * na; i += blockDim.x) {
            int r = i / na, c = i - r * na;
            u64 row = base + min(r0 + r, p.rows - 1);
            const u8* src = (const u8*)p.w.scales + (row * (nb >> 3) + kb) * aux + unit * c;
            if (unit == 8) cp_async8(st.aux + r * as + 8 * c, src);
            else cp_async4(st.aux + r * as + 4 * c, src);
        }
    }
    if (!(what & PFM_LOAD_X)) return;
    // FEW: the first ne entries only (the others' outputs are never stored), through L1: at B
    // = 1 every block of a launch copied the one token's groups at once, 8 times over, all
    // from the same few L2 lines.
    int n_x = S::FEW ? ne : S::ENTRIES;
    for (int i = threadIdx.x; i < n_x * PFM_STAGE * 5; i += blockDim.x) {
        int e = i / (PFM_STAGE * 5), r = i - e * (PFM_STAGE * 5), j = r / 5, c = r - j * 5;
        const u32* src = (const u32*)p.xq + ((u64)in[e] * nb + kb * PFM_STAGE + j) * QXW + 4 * c;
        uint4* dst = c < 4 ? (uint4*)(st.x + e * PFM_XENT + 64 * j + 16 * c) : st.tail + j * S::ENTRIES + e;
        if (S::FEW) cp_async16_ca(dst, src);
        else cp_async16(dst, src, true);
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

// A warp's 16 rows (from r0 within the block's rows) against one tile of entries (the first ne
// of them distinct), over every super-block through S::STAGES staged buffers (S::STAGES - 1
// super-blocks ahead); the outputs this lane holds in acc. `w0`: the first stage's weights
// were issued already (pfm_load with PFM_LOAD_W).
template <class F, class S>
__device__ void pfm_tile(const PfRowsParams& p, int grp, int rb, const int* in, int ne, u8* smem, float (&acc)[S::ENTRIES / 8][4], bool w0) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wr = (threadIdx.x >> 5) * 16 + g;
    int nk = p.w.k >> 8, as = pfm_aux_stride(p.w.type);
#pragma unroll
    for (int s = 0; s < S::STAGES - 1; s++) {
        if (s < nk) pfm_load<S>(p, grp, rb, in, ne, s, pfm_stage<S>(smem, s), s == 0 && w0 ? PFM_LOAD_X : PFM_LOAD_W | PFM_LOAD_X);
        else asm volatile("cp.async.commit_group;\n" ::);  // empty: every iteration waits on the same count
    }
    for (int kb = 0; kb < nk; kb++) {
        int ahead = kb + S::STAGES - 1;
        if (ahead < nk) pfm_load<S>(p, grp, rb, in, ne, ahead, pfm_stage<S>(smem, ahead % S::STAGES), PFM_LOAD_W | PFM_LOAD_X);
        else asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(S::STAGES - 1) : "memory");  // super-block kb's copies landed
        __syncthreads();
        PfmStage st = pfm_stage<S>(smem, kb % S::STAGES);
        const u8* const w[2] = {st.w + wr * PFM_WROW, st.w + (wr + 8) * PFM_WROW};
        const u8* const aux[2] = {st.aux + wr * as, st.aux + (wr + 8) * as};
#pragma unroll 2
        for (int j = 0; j < PFM_STAGE; j++) {
            F f;
            f.load(w, aux, j, t);
#pragma unroll
            for (int n = 0; n < S::ENTRIES / 8; n++) {
                uint4 x = *(const uint4*)(st.x + (n * 8 + g) * PFM_XENT + 64 * j + 16 * t);
                const uint4* tl = st.tail + j * S::ENTRIES + n * 8 + 2 * t;
                f.add(x, tl[0], tl[1], acc[n]);
            }
        }
        __syncthreads();  // the buffer is refilled S::STAGES stages on
    }
}

// The tile's type dispatch (pfm_tile for the weights' type).
template <class S>
__device__ __forceinline__ void pfm_tile_any(const PfRowsParams& p, int grp, int rb, const int* in, int ne, u8* smem, float (&acc)[S::ENTRIES / 8][4], bool w0) {
    switch (p.w.type) {
        case T_Q4_0: pfm_tile<PfmQ4_0, S>(p, grp, rb, in, ne, smem, acc, w0); break;
        case T_Q4_K: pfm_tile<PfmQ4_K, S>(p, grp, rb, in, ne, smem, acc, w0); break;
        default: pfm_tile<PfmQ6_K, S>(p, grp, rb, in, ne, smem, acc, w0);
    }
}

// The tile's outputs this lane holds (entries e_lo.. below e_hi, rows from the warp's first,
// rb + 16 * warp), to their rows of `out` (the entries' output rows, from e_lo).
template <class S>
__device__ __forceinline__ void pfm_store(const PfRowsParams& p, int rb, int e_lo, int e_hi, const int* out, const float (&acc)[S::ENTRIES / 8][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, r0 = rb + (threadIdx.x >> 5) * 16 + g;
#pragma unroll
    for (int n = 0; n < S::ENTRIES / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int e = e_lo + n * 8 + 2 * t + (i & 1), r = r0 + 8 * (i >> 1);
            if (e >= e_hi || r >= p.rows) continue;
            float* dst = (float*)p.out + (u64)out[e - e_lo] * p.out_stride + r;
            *dst = p.accumulate ? *dst + acc[n][i] : acc[n][i];
        }
}

// grid (ceil(rows / PFM_ROWS), 1, entry tiles) dense (z_entries = PFM_ENTRIES), or
// (ceil(rows / PFM_ROWS), tiles at most, 1) grouped (p.tiles), 256 threads, 2 * PfmFull::STAGE_BYTES
// of dynamic shared memory: pf_rows for the split types (k % 256 == 0; sm_80+), a tile of
// PFM_ENTRIES entries a block. Rows and entries past the
// ends are read as the last ones and not stored.
extern "C" __global__ void __launch_bounds__(256, 2) pf_mma(const PfRowsParams p) {
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) u8 pfm_smem[];
    __shared__ int in[PFM_ENTRIES], out[PFM_ENTRIES];
    pdl_start();
    int grp = 0, rb = blockIdx.x * PFM_ROWS, e_lo = blockIdx.z * p.z_entries, e_hi = p.n_dense;
    if (p.tiles) {  // grouped: tile blockIdx.y of the work list
        const int2* tiles = (const int2*)p.tiles;
        if ((int)blockIdx.y >= tiles[0].x) return;
        int2 tile = tiles[1 + blockIdx.y];
        grp = tile.x;
        e_lo = tile.y;
        e_hi = ((const int*)p.counts)[grp];
    }
    e_hi = min(e_hi, e_lo + PFM_ENTRIES);
    if (e_lo >= e_hi) return;
    const int2* list = p.list ? (const int2*)p.list + (u64)grp * p.list_cap : nullptr;
    if (threadIdx.x < PFM_ENTRIES) {
        int2 io = pf_entry(p, list, min(e_lo + (int)threadIdx.x, e_hi - 1));
        in[threadIdx.x] = io.x;
        out[threadIdx.x] = io.y;
    }
    __syncthreads();
    float acc[PFM_NT][4] = {};
    pfm_tile_any<PfmFull>(p, grp, rb, in, PFM_ENTRIES, pfm_smem, acc, false);
    pfm_store<PfmFull>(p, rb, e_lo, e_hi, out, acc);
#endif
}

// F32 rows (the router) against the padded float activations: a block's 32 rows x 32 entries,
// 32-value steps of both staged in shared memory (transposed: a thread reads its 2 rows' and
// 2 entries' values as float2), 2 x 2 outputs a thread. Why: pf_rows' dots, a warp a row
// and 8 entries a block, took 263 us a 1,024-token chunk (the router's 128 rows x 2,048),
// more than any pf_mma launch. grid (ceil(rows / 32), 1, ceil(n / 32)), 256 threads;
// PfRowsParams as a dense pf_rows launch's.
// The order of every F32 row's sum (bt_f32rows keeps it too): chains of F32_CHAIN values,
// each fmaf in k order from 0, then the chains added in order from 0. Why chains: bt_f32rows
// takes a chain a block, so a few tokens' router is not one 2,048-long fmaf chain an output.
#define PFF_TILE 32
#define F32_CHAIN 256
extern "C" __global__ void __launch_bounds__(256) pf_f32rows(const PfRowsParams p) {
    __shared__ __align__(16) float ws[PFF_TILE][PFF_TILE + 2], xs[PFF_TILE][PFF_TILE + 2];
    pdl_start();
    int r0 = blockIdx.x * PFF_TILE, e0 = blockIdx.z * PFF_TILE, k = p.w.k, plen = padded_len(k);
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;  // rows 2ty.., entries 2tx..
    int lr = threadIdx.x >> 3, lc = (threadIdx.x & 7) * 4;  // loader: row / entry lr, values lc..
    const float* wrow = (const float*)p.w.data + (u64)min(r0 + lr, p.rows - 1) * k;
    const float* xrow = (const float*)p.xf + (u64)min(e0 + lr, p.n_dense - 1) * plen;
    float acc[2][2] = {}, tot[2][2] = {};
    for (int k0 = 0; k0 < k; k0 += PFF_TILE) {
        float4 wv = *(const float4*)(wrow + k0 + lc);
        float4 xv = *(const float4*)(xrow + pad_idx(k0 + lc));
        __syncthreads();  // the last step's reads are done
#pragma unroll
        for (int j = 0; j < 4; j++) {
            ws[lc + j][lr] = (&wv.x)[j];
            xs[lc + j][lr] = (&xv.x)[j];
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < PFF_TILE; kk++) {
            float2 a = *(const float2*)&ws[kk][2 * ty], b = *(const float2*)&xs[kk][2 * tx];
            acc[0][0] = fmaf(a.x, b.x, acc[0][0]);
            acc[0][1] = fmaf(a.x, b.y, acc[0][1]);
            acc[1][0] = fmaf(a.y, b.x, acc[1][0]);
            acc[1][1] = fmaf(a.y, b.y, acc[1][1]);
        }
        if ((k0 + PFF_TILE) % F32_CHAIN == 0 || k0 + PFF_TILE >= k) {  // a chain ends
#pragma unroll
            for (int i = 0; i < 4; i++) {
                tot[i >> 1][i & 1] += acc[i >> 1][i & 1];
                acc[i >> 1][i & 1] = 0.f;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int r = r0 + 2 * ty + i, e = e0 + 2 * tx + j;
            if (r >= p.rows || e >= p.n_dense) continue;
            float* dst = (float*)p.out + (u64)e * p.out_stride + r;
            *dst = p.accumulate ? *dst + tot[i][j] : tot[i][j];
        }
}

// Each token's experts and weights from its router logits (topk_block, as moe_topk): grid
// tokens, TOPK_THREADS (step/moe.rs) threads.
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
    u64 tiles;   // int2* (pf_tiles): [0].x tiles, then each expert's tiles of PFM_ENTRIES slots
    int tokens;
    int n_used;
    int n_expert;
    int list_cap;
};
SIZE_IS(PfListsParams, 48); FIELD_AT(PfListsParams, ids, 0); FIELD_AT(PfListsParams, list, 8);
FIELD_AT(PfListsParams, counts, 16); FIELD_AT(PfListsParams, tiles, 24); FIELD_AT(PfListsParams, tokens, 32);
FIELD_AT(PfListsParams, n_used, 36); FIELD_AT(PfListsParams, n_expert, 40);
FIELD_AT(PfListsParams, list_cap, 44);

// pf_route and pf_lists in one launch, for few tokens: block t picks token t's experts as
// pf_route does, and the last block to finish (a counter at `done`, which it resets) lists
// every expert's slots in token order as pf_lists does (the same lists and counts), from the
// ids in shared memory. Why: at B = 1 the batched step ran ~14 launches a layer, each a few
// microseconds of latency with little work. grid tokens, TOPK_THREADS (step/moe.rs) threads; tokens x n_used <= 256.
#define BT_ROUTE_SLOTS 256
struct BtRouteParams {
    TopkParams t;
    PfListsParams l;
    u64 done;  // int*, zero between launches
};
SIZE_IS(BtRouteParams, 96); FIELD_AT(BtRouteParams, t, 0); FIELD_AT(BtRouteParams, l, 40);
FIELD_AT(BtRouteParams, done, 88);

extern "C" __global__ void bt_route(const BtRouteParams p) {
    __shared__ float pr[4096];
    __shared__ float red[1];
    __shared__ int ids[BT_ROUTE_SLOTS];
    __shared__ int last;
    pdl_start();
    int t = blockIdx.x, nu = p.t.n_used;
    topk_block((const float*)p.t.logits + (u64)t * p.t.n_expert, p.t.n_expert, nu, p.t.norm_topk,
               (int*)p.t.ids + t * nu, (float*)p.t.weights + t * nu, pr, red);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd((int*)p.done, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // every block's ids, published before its count
    int total = p.l.tokens * p.l.n_used;
    for (int i = threadIdx.x; i < total; i += blockDim.x) ids[i] = __ldcg((const int*)p.l.ids + i);
    __syncthreads();
    for (int e = threadIdx.x; e < p.l.n_expert; e += blockDim.x) {
        int2* list = (int2*)p.l.list + (u64)e * p.l.list_cap;
        int n = 0;
        for (int i = 0; i < total; i++)
            if (ids[i] == e) {
                if (n < p.l.list_cap) list[n] = make_int2(i / p.l.n_used, i);
                n++;
            }
        ((int*)p.l.counts)[e] = min(n, p.l.list_cap);
    }
    if (threadIdx.x == 0) *(int*)p.done = 0;  // for the next launch
}

// grid n_expert, 256 threads: block e lists expert e's slots in token order (a token picks an
// expert once), 256 ids a pass, each hit's place from the warps' ballots.
extern "C" __global__ void pf_lists(const PfListsParams p) {
    __shared__ int warp_hits[8];
    pdl_start();
    const int* ids = (const int*)p.ids;
    int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, total = p.tokens * p.n_used, n = 0;
    int2* list = (int2*)p.list + (u64)e * p.list_cap;
    for (int i0 = 0; i0 < total; i0 += 256) {
        int i = i0 + threadIdx.x;
        bool hit = i < total && ids[i] == e;
        u32 m = __ballot_sync(0xffffffff, hit);
        if (lane == 0) warp_hits[w] = __popc(m);
        __syncthreads();
        int before = n, all = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            before += k < w ? warp_hits[k] : 0;
            all += warp_hits[k];
        }
        int at = before + __popc(m & ((1u << lane) - 1));
        if (hit && at < p.list_cap) list[at] = make_int2(i / p.n_used, i);
        n += all;
        __syncthreads();
    }
    if (threadIdx.x == 0) ((int*)p.counts)[e] = min(n, p.list_cap);
}

// One block: the grouped pf_mma launches' work list, each expert's slots in tiles of
// PFM_ENTRIES (expert by expert, tile by tile), so an expert most tokens chose spreads over
// many blocks (one block an expert took 1.4 ms for a 1,024-token chunk's gate rows, on a
// synthetic router that sends most tokens to a few experts).
extern "C" __global__ void pf_tiles(const PfListsParams p) {
    __shared__ int warp_tiles[32], total;
    pdl_start();
    int2* tiles = (int2*)p.tiles;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (threadIdx.x == 0) total = 0;
    for (int e0 = 0; e0 < p.n_expert; e0 += blockDim.x) {
        int e = e0 + threadIdx.x;
        int n = e < p.n_expert ? (((const int*)p.counts)[e] + PFM_ENTRIES - 1) / PFM_ENTRIES : 0;
        int incl = n;  // inclusive scan over the warp, then over the warps
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(0xffffffff, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) warp_tiles[w] = incl;
        __syncthreads();
        int base = total;
        for (int k = 0; k < w; k++) base += warp_tiles[k];
        base += incl - n;
        for (int t = 0; t < n; t++) tiles[1 + base + t] = make_int2(e, t * PFM_ENTRIES);
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) total = base + n;
        __syncthreads();
    }
    if (threadIdx.x == 0) tiles[0] = make_int2(total, 0);
}

struct PfCombineParams {
    u64 x;        // float* [tokens, d] residual (+=)
    u64 y;        // const float* [tokens * n_used, d] each slot's expert output
    u64 weights;  // const float* [tokens, n_used]
    int d;
    int n_used;
};
SIZE_IS(PfCombineParams, 32); FIELD_AT(PfCombineParams, x, 0); FIELD_AT(PfCombineParams, y, 8);
FIELD_AT(PfCombineParams, weights, 16); FIELD_AT(PfCombineParams, d, 24);
FIELD_AT(PfCombineParams, n_used, 28);

// x[t] += the weighted sum of its slots' outputs, in slot order, then row t of x quantised
// for the next launch (`q`: the next layer's attention norm, or the head's; q.src is x):
// what a combine launch and a pf_quant launch did (the same bits), one launch a layer fewer.
// grid tokens, 256 threads.
struct PfCombineQuantParams {
    PfCombineParams c;
    PfQuantParams q;
};
SIZE_IS(PfCombineQuantParams, 80); FIELD_AT(PfCombineQuantParams, c, 0);
FIELD_AT(PfCombineQuantParams, q, 32);

extern "C" __global__ void pf_combine_quant(const PfCombineQuantParams cq) {
    __shared__ float red[33];
    const PfCombineParams& p = cq.c;
    pdl_start();
    int t = blockIdx.x;
    const float* w = (const float*)p.weights + t * p.n_used;
    float* x = (float*)p.x + (u64)t * p.d;
    for (int i = threadIdx.x; i < p.d; i += blockDim.x) {
        float acc = 0.f;
        for (int k = 0; k < p.n_used; k++) acc += w[k] * ((const float*)p.y)[((u64)t * p.n_used + k) * p.d + i];
        x[i] += acc;
    }
    __syncthreads();  // the row's new values, to every thread of the block
    pf_quant_row(cq.q, t, x, red);
}
