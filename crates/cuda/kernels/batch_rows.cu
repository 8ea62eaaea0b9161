// Weight rows against a few activation rows (the batched decode step's B tokens, a short
// prompt's chunk): pf_mma's launches (the split types, k % 256 == 0) where every group has few
// entries. Why: pf_mma takes 128 rows a block, so a dense launch of 4,096 rows is 32 blocks and
// every launch waits on a few SMs; at B = 1 the batched step took 17.8 ms (H100) against the
// decode step's 1.24. Here a warp takes BTR_R rows and its lanes split k (block j to lane
// j % 32, as the decode's matvecs), so a launch has 16x pf_mma's blocks. Measured (H100, Q4_0,
// with bt_f32rows below): the B = 1 step 17.8 -> 7.2 ms; at B = 16 and 32 pf_mma stays faster,
// hence CudaOptions::few_tokens = 8 (docs/performance.md).
//
// The same bits as pf_mma, so the kernel can change with the batch size and a sequence's
// output stays its own (batch invariance): a block's integer sum is exact in both (dp4a here,
// mma there), and each output adds its blocks' terms in k order through the same expression
// (the Pfm structs' `term`), one lane an output: lanes write their blocks' sums to shared
// memory, then lane r * BTR_E + e walks the 32 blocks of the chunk for row r and entry e.

#define BTR_R 2
#define BTR_ROWS (8 * BTR_R)
#define BTR_E 8

// A split type's decode piece (quant.cuh) and pf_mma's term for one block: `sums` the exact
// integer sums of a loaded piece against a quantised group, `scales` the piece's floats, `term`
// pf_mma's expression of them against the group's tail.
struct BtQ4_0 {
    using Piece = Q4_0Piece;
    __device__ __forceinline__ static int2 sums(const Piece& w, const u32* g) {
        int s0, s1;
        nibble_idot(w.q, g, s0, s1);
        return make_int2(s0 + s1 - 8 * group_qsum(g), 0);  // the centred nibbles' sum
    }
    __device__ __forceinline__ static float3 scales(const Piece& w) { return make_float3(h2f(w.d), 0.f, 0.f); }
    __device__ __forceinline__ static float term(float3 f, int2 c, uint4 s) {
        PfmQ4_0 t;
        t.d[0] = f.x;
        return t.term(0, c.x, s);
    }
};
struct BtQ4_K {
    using Piece = Q4_KPiece;
    __device__ __forceinline__ static int2 sums(const Piece& w, const u32* g) {
        int s0, s1;
        nibble_idot(w.q, g, s0, s1);
        return make_int2(s0 + s1, 0);
    }
    __device__ __forceinline__ static float3 scales(const Piece& w) { return make_float3(w.scale(), w.offset(), 0.f); }
    __device__ __forceinline__ static float term(float3 f, int2 c, uint4 s) {
        PfmQ4_K t;
        t.ds[0] = f.x;
        t.dm[0] = f.y;
        return t.term(0, c.x, s);
    }
};
struct BtQ6_K {
    using Piece = Q6_KPiece;
    __device__ __forceinline__ static int2 sums(const Piece& w, const u32* g) {
        u32 lo[4], hi[4];
        q6_k_bytes(w.q, w.g, lo, hi);
        int s0, s1;
        byte_idot(lo, hi, g, s0, s1);
        return make_int2(s0, s1);
    }
    __device__ __forceinline__ static float3 scales(const Piece& w) {
        return make_float3(h2f((u16)(w.s & 0xffff)), (float)(signed char)(w.s >> 16), (float)(signed char)(w.s >> 24));
    }
    __device__ __forceinline__ static float term(float3 f, int2 c, uint4 s) { return PfmQ6_K::term(f.x, f.y, f.z, c.x, c.y, s); }
};

// Shared memory a warp: each (row, entry, block of the chunk)'s sums (a padded stride, so the
// walking lanes' reads of one block hit distinct banks) and each (row, block)'s scales.
struct BtrWarp {
    int2 c[BTR_R][BTR_E][33];
    float3 f[BTR_R][32];
};

// Chunks of 32 blocks a lane holds at once in registers (k <= 4,096 = 4 chunks: a row's
// chunks in BTR_CH-chunk spans).
#define BTR_CH 2

// A span of a warp's rows: the lane's blocks of them (block ch * 32 + lane of each row, for the
// span's chunks), in registers. Loading is apart from the dots so a dense launch can issue its
// first span's loads before it waits on the launch before it (the weights never change), and a
// row of one span keeps them for every pass of entries.
template <class T>
struct BtrRows {
    typename T::Piece w[BTR_CH][BTR_R];
    __device__ __forceinline__ void load(const QW& qw, u64 row0, int nr, int nb, int span) {
        int lane = threadIdx.x & 31;
#pragma unroll
        for (int ch = 0; ch < BTR_CH; ch++) {
            int j = (span * BTR_CH + ch) * 32 + lane;
#pragma unroll
            for (int r = 0; r < BTR_R; r++)
                if (r < nr && j < nb) w[ch][r].load(qw, (row0 + r) * nb + j);
        }
    }
};

// The warp's rows r0.. (row0 their first row in the weights; `rows` holds their first span)
// against the group's n entries, BTR_E at a time, each output adding its blocks in k order.
template <class T>
__device__ void btr_dots(const PfRowsParams& p, BtrRows<T>& rows, u64 row0, int r0, const int2* list, int n, BtrWarp& sm) {
    int lane = threadIdx.x & 31, nb = p.w.k >> 5, nr = min(BTR_R, p.rows - r0);
    int my_r = lane / BTR_E, my_e = lane % BTR_E, spans = (nb + 32 * BTR_CH - 1) / (32 * BTR_CH);
    const u32* xq = (const u32*)p.xq;
    for (int e0 = 0; e0 < n; e0 += BTR_E) {
        int ne = min(BTR_E, n - e0);
        bool mine = my_r < nr && my_e < ne;
        int2 io = mine ? pf_entry(p, list, e0 + my_e) : make_int2(0, 0);
        float acc = 0.f;
        for (int span = 0; span < spans; span++) {
            if (spans > 1 && (span > 0 || e0 > 0)) rows.load(p.w, row0, nr, nb, span);
#pragma unroll
            for (int ch = 0; ch < BTR_CH; ch++) {
                int j0 = (span * BTR_CH + ch) * 32, j = j0 + lane;
                if (j0 >= nb) break;
                if (j < nb) {
#pragma unroll
                    for (int r = 0; r < BTR_R; r++)
                        if (r < nr) sm.f[r][lane] = T::scales(rows.w[ch][r]);
                    for (int e = 0; e < ne; e++) {
                        const u32* g = xq + ((u64)pf_entry(p, list, e0 + e).x * nb + j) * QXW;
#pragma unroll
                        for (int r = 0; r < BTR_R; r++)
                            if (r < nr) sm.c[r][e][lane] = T::sums(rows.w[ch][r], g);
                    }
                }
                __syncwarp();
                if (mine) {
                    const uint4* tail = (const uint4*)(xq + ((u64)io.x * nb + j0) * QXW + 16);
                    int jn = min(32, nb - j0);
#pragma unroll 4
                    for (int jj = 0; jj < jn; jj++)
                        acc += T::term(sm.f[my_r][jj], sm.c[my_r][my_e][jj], tail[jj * (QXW / 4)]);
                }
                __syncwarp();
            }
        }
        if (mine) {
            float* dst = (float*)p.out + (u64)io.y * p.out_stride + r0 + my_r;
            *dst = p.accumulate ? *dst + acc : acc;
        }
    }
}

// The expert a grouped launch's block takes: with `ids` (the routed slots, a blockIdx.y each)
// the slot's expert, or -1 where an earlier slot chose it too (that block takes the expert);
// else blockIdx.y itself. Why slots: at B = 1 the expert grid was 128 rows of blocks for 8
// experts, and the 120 idle rows of blocks each waited on a read of their count before they
// left, two blocks an SM at a time. The slot's id and the earlier slots' (the first 64 of
// them) are loaded together: one round trip, which the expert grid spent on its count.
__device__ __forceinline__ int btr_group(const int* ids) {
    int y = blockIdx.y, lane = threadIdx.x & 31;
    if (!ids) return y;
    int e = __ldcg(ids + y);
    int a = lane < y ? __ldcg(ids + lane) : -1, b = lane + 32 < y ? __ldcg(ids + lane + 32) : -1;
    bool dup = a == e || b == e;
    for (int j = lane + 64; j < y; j += 32) dup |= __ldcg(ids + j) == e;
    return __any_sync(0xffffffffu, dup) ? -1 : e;
}

// A warp's rows r0.. of group grp (grouped: btr_group's answer after the wait): a dense launch
// loads them before it waits (n is its own); a grouped one first reads how many entries its
// group has (an expert no token chose: its rows are not read).
template <class T>
__device__ void btr_warp(const PfRowsParams& p, int grp, const int* ids, int r0, BtrWarp& sm) {
    int nb = p.w.k >> 5, nr = min(BTR_R, p.rows - r0);
    u64 row0 = (u64)grp * p.rows + r0;
    BtrRows<T> rows;
    if (!p.counts) {
        if (r0 < p.rows) rows.load(p.w, row0, nr, nb, 0);
        pdl_start();
        if (r0 >= p.rows) return;
        btr_dots<T>(p, rows, row0, r0, nullptr, p.n_dense, sm);
        return;
    }
    pdl_start();
    grp = btr_group(ids);
    if (grp < 0 || r0 >= p.rows) return;
    row0 = (u64)grp * p.rows + r0;
    const int* counts = (const int*)p.counts;
    int n;
    if (ids) {  // a routed slot's expert has entries: its weights' loads go out beside the count
        rows.load(p.w, row0, nr, nb, 0);
        n = counts[grp];
    } else {
        n = counts[grp];
        if (n == 0) return;
        rows.load(p.w, row0, nr, nb, 0);
    }
    btr_dots<T>(p, rows, row0, r0, (const int2*)p.list + (u64)grp * p.list_cap, n, sm);
}

// Up to three matrices in one launch over the same activations (q, k and v; gate and up): part
// 0 is `p`'s own, parts 1 and 2 replace its weights, rows and output. Blocks [0, blocks0) take
// part 0, [blocks0, blocks0 + blocks1) part 1, the rest part 2.
struct BtRowsParams {
    PfRowsParams p;
    QW w1, w2;
    u64 out1, out2;
    int rows1, rows2;
    int blocks0, blocks1;
    u64 ids;  // const int* [slots]: grouped launches over the routed slots (btr_group), or 0
};
SIZE_IS(BtRowsParams, 192); FIELD_AT(BtRowsParams, p, 0); FIELD_AT(BtRowsParams, w1, 104);
FIELD_AT(BtRowsParams, w2, 128); FIELD_AT(BtRowsParams, out1, 152); FIELD_AT(BtRowsParams, out2, 160);
FIELD_AT(BtRowsParams, rows1, 168); FIELD_AT(BtRowsParams, rows2, 172); FIELD_AT(BtRowsParams, blocks0, 176);
FIELD_AT(BtRowsParams, blocks1, 180); FIELD_AT(BtRowsParams, ids, 184);

// grid (blocks of every part, groups or routed slots, 1), 256 threads: pf_mma's launches
// (dense: n_dense entries; grouped: a group's counts[g] entries of its list) on few entries, a
// part's block BTR_ROWS rows.
extern "C" __global__ void __launch_bounds__(256, 2) bt_rows(const BtRowsParams bp) {
    __shared__ BtrWarp warps[8];
    PfRowsParams p = bp.p;
    int bx = blockIdx.x;
    if (bx >= bp.blocks0) {
        bool one = bx < bp.blocks0 + bp.blocks1;
        p.w = one ? bp.w1 : bp.w2;
        p.out = one ? bp.out1 : bp.out2;
        p.rows = one ? bp.rows1 : bp.rows2;
        bx -= one ? bp.blocks0 : bp.blocks0 + bp.blocks1;
    }
    int grp = blockIdx.y, r0 = bx * BTR_ROWS + (threadIdx.x >> 5) * BTR_R;
    const int* ids = (const int*)bp.ids;
    BtrWarp& sm = warps[threadIdx.x >> 5];
    switch (p.w.type) {
        case T_Q4_0: btr_warp<BtQ4_0>(p, grp, ids, r0, sm); break;
        case T_Q4_K: btr_warp<BtQ4_K>(p, grp, ids, r0, sm); break;
        default: btr_warp<BtQ6_K>(p, grp, ids, r0, sm);
    }
}

// F32 rows (the router) against few tokens' padded activations: pf_f32rows' launch, whose
// blocks of 32 rows (4 for the router's 128) wait on a global load every 32 values (67 us a
// launch at B = 1, H100). Here a block takes BTF_R rows x BTF_E entries, a thread an output,
// and stages BTF_K values of its rows and entries at once (cp.async, one wait a stage); each
// output is the same chain as pf_f32rows' (fmaf in k order from 0), so the same bits.
// grid (ceil(rows / BTF_R), ceil(n / BTF_E), 1), BTF_R * BTF_E threads.
#define BTF_R 8
#define BTF_E 8
#define BTF_K 512
#define BTF_S (BTF_K + 4)  // a padded stride: the warp's 4 rows and 8 entries hit distinct banks
extern "C" __global__ void __launch_bounds__(BTF_R * BTF_E) bt_f32rows(const PfRowsParams p) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) float ws[BTF_R][BTF_S], xs[BTF_E][BTF_S];
    pdl_start();
    int r0 = blockIdx.x * BTF_R, e0 = blockIdx.y * BTF_E, k = p.w.k, plen = padded_len(k);
    int r = threadIdx.x / BTF_E, e = threadIdx.x % BTF_E;
    float acc = 0.f;
    for (int k0 = 0; k0 < k; k0 += BTF_K) {
        int q = min(BTF_K, k - k0) >> 2;  // float4s a row this stage
        __syncthreads();                  // the last stage's reads are done
        for (int i = threadIdx.x; i < (BTF_R + BTF_E) * q; i += blockDim.x) {
            int row = i / q, c = 4 * (i - row * q);
            if (row < BTF_R) {
                const float* src = (const float*)p.w.data + (u64)min(r0 + row, p.rows - 1) * k + k0 + c;
                cp_async16((uint4*)&ws[row][c], src, true);
            } else {
                int t = min(e0 + row - BTF_R, p.n_dense - 1);
                const float* src = (const float*)p.xf + (u64)t * plen + pad_idx(k0 + c);
                cp_async16((uint4*)&xs[row - BTF_R][c], src, true);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < 4 * q; kk++) acc = fmaf(ws[r][kk], xs[e][kk], acc);
    }
    if (r0 + r < p.rows && e0 + e < p.n_dense) {
        float* dst = (float*)p.out + (u64)(e0 + e) * p.out_stride + r0 + r;
        *dst = p.accumulate ? *dst + acc : acc;
    }
#endif
}
