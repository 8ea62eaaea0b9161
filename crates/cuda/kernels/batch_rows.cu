// Weight rows against a few activation rows (the batched decode step's B tokens, a short
// prompt's chunk): pf_mma's launches (the split types, k % 256 == 0) where every group has few
// entries, on bt_mma. Why: pf_mma takes 128 rows and 32 entries a block, so a dense launch of
// 4,096 rows is 32 blocks and every launch waits on a few SMs (at B = 1 the batched step took
// 17.8 ms, H100, against the decode step's 1.24). bt_mma takes 32 rows and 8 entries a block.
// It replaced bt_rows (a warp 2 rows, its lanes along k with dp4a, each output walking its
// blocks' terms in k order from shared memory), which read each entry's 80-byte activation
// group again for every 2 rows: ~17x its weight bytes through L1 at B = 8 (docs/performance.md).
//
// The same bits as pf_mma, so the kernel can change with the batch size and a sequence's
// output stays its own (batch invariance): bt_mma runs pf_mma's tile code (pfm_tile: each
// block's exact integer sums on the int8 tensor cores, each output adding its blocks' terms in
// k order through the Pfm structs' expression) on a smaller tile.

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
    // With hcount (bt_mma, gate and up as parts 0 and 1): silu(gate) * up of each block's 32
    // rows quantised as pf_quant's swiglu rows, by the second of the two blocks to finish.
    u64 hq;      // u32* [slots][rows / 32 * QXW]
    u64 hf;      // float* [slots][padded_len(rows)]
    u64 hcount;  // int* [grid y][blocks0], zero between launches
};
SIZE_IS(BtRowsParams, 216); FIELD_AT(BtRowsParams, p, 0); FIELD_AT(BtRowsParams, w1, 104);
FIELD_AT(BtRowsParams, w2, 128); FIELD_AT(BtRowsParams, out1, 152); FIELD_AT(BtRowsParams, out2, 160);
FIELD_AT(BtRowsParams, rows1, 168); FIELD_AT(BtRowsParams, rows2, 172); FIELD_AT(BtRowsParams, blocks0, 176);
FIELD_AT(BtRowsParams, blocks1, 180); FIELD_AT(BtRowsParams, ids, 184); FIELD_AT(BtRowsParams, hq, 192);
FIELD_AT(BtRowsParams, hf, 200); FIELD_AT(BtRowsParams, hcount, 208);

// The few-token launches (params BtRowsParams: up to three parts, dense or grouped by expert or
// routed slot) on pf_mma's tensor-core tiles: a block BTM_W warps of 16 rows against its
// group's entries in tiles of 8 (one n-tile), each tile over every super-block through
// BTM_STAGES staged buffers (pfm_tile), so its outputs are pf_mma's bits. A tile reads an
// entry's groups once for its 32 rows, and the mma take its 8 entries at once. A dense launch
// issues its first stage's weight copies before pdl_wait. Measured (H100, Q4_0, one call):
// the batched step 284.3 / 524.5 / 981.5 / 1,448.0 tok/s at B = 1 / 2 / 4 / 8 against 240.1 /
// 391.7 / 546.5 / 672.8 on bt_rows, the new side with its launch fusions of the same change
// (the attention's and gate-and-up's quantisation, the arg-max, the top-k's threads).
// grid (blocks of every part at BTM_ROWS rows, groups or routed slots, 1), 32 * BTM_W threads,
// BTM_STAGES * BtmShape::STAGE_BYTES of dynamic shared memory.
#define BTM_W 2
#define BTM_ROWS (16 * BTM_W)
#define BTM_STAGES 3
typedef PfmShape<BTM_W, 1, BTM_STAGES, true> BtmShape;

// After a gate or up block of bt_mma's gate-and-up launch stored its rows [rb, rb + 32) of
// its n entries: the second of the two blocks of those rows to finish quantises silu(gate) *
// up of them into each entry's slot row of hq / hf, with pf_quant's arithmetic (the same
// expression, quant_store from lane i's values 4i..4i+3 of the group, the padded floats): 8
// lanes an entry, the block's entries 8 at a time. Why: pf_quant was a launch of its own
// between gate_up and down in every layer (~6 us eager, H200). BTM_ROWS is the group's 32.
__device__ void btm_swiglu(const BtRowsParams& bp, const PfRowsParams& p, int bx, int rb, const int2* list, int n) {
    __shared__ int second;
    __threadfence();  // this block's outputs, published before its count
    __syncthreads();
    if (threadIdx.x == 0) {
        int* count = (int*)bp.hcount + (u64)blockIdx.y * bp.blocks0 + bx;
        second = atomicAdd(count, 1) == 1;
        if (second) *count = 0;  // for the next launch
    }
    __syncthreads();
    if (!second) return;
    __threadfence();  // the other block's outputs
    int dff = bp.p.rows, l8 = threadIdx.x & 7;
    for (int e0 = 0; e0 < n; e0 += 32 * BTM_W / 8) {  // the same trips for every lane (quant_store's shuffles)
        int e = e0 + (threadIdx.x >> 3);
        bool valid = e < n;
        int o = valid ? pf_entry(p, list, e).y : 0;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (valid) {
            u64 at = (u64)o * p.out_stride + rb + 4 * l8;
            float4 g = __ldcg((const float4*)((const float*)bp.p.out + at));
            float4 u = __ldcg((const float4*)((const float*)bp.out1 + at));
            v = make_float4(swiglu(g.x, u.x), swiglu(g.y, u.y), swiglu(g.z, u.z), swiglu(g.w, u.w));
        }
        quant_store((u32*)bp.hq + (u64)o * ((dff >> 5) * QXW), (rb >> 2) + l8, v, valid);
        if (valid) *(float4*)((float*)bp.hf + (u64)o * padded_len(dff) + pad_idx(rb + 4 * l8)) = v;
    }
}

extern "C" __global__ void __launch_bounds__(32 * BTM_W) bt_mma(const BtRowsParams bp) {
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) u8 btm_smem[];
    __shared__ int in[8], out[8];
    PfRowsParams p = bp.p;
    int bx = blockIdx.x;
    if (bx >= bp.blocks0) {
        bool one = bx < bp.blocks0 + bp.blocks1;
        p.w = one ? bp.w1 : bp.w2;
        p.out = one ? bp.out1 : bp.out2;
        p.rows = one ? bp.rows1 : bp.rows2;
        bx -= one ? bp.blocks0 : bp.blocks0 + bp.blocks1;
    }
    int rb = bx * BTM_ROWS, grp = 0, n;
    const int2* list = nullptr;
    bool w0 = !p.counts;
    if (w0) {  // dense: the weights never change, so the first stage's copies go out now
        pfm_load<BtmShape>(p, 0, rb, in, 0, 0, pfm_stage<BtmShape>(btm_smem, 0), PFM_LOAD_W);
        pdl_start();
        n = p.n_dense;
    } else {
        pdl_start();
        grp = btr_group((const int*)bp.ids);
        if (grp < 0) return;
        n = ((const int*)p.counts)[grp];
        if (n == 0) return;
        list = (const int2*)p.list + (u64)grp * p.list_cap;
    }
    for (int e_lo = 0; e_lo < n; e_lo += 8) {
        int e_hi = min(n, e_lo + 8);
        if (threadIdx.x < 8) {
            int2 io = pf_entry(p, list, min(e_lo + (int)threadIdx.x, e_hi - 1));
            in[threadIdx.x] = io.x;
            out[threadIdx.x] = io.y;
        }
        __syncthreads();
        float acc[1][4] = {};
        pfm_tile_any<BtmShape>(p, grp, rb, in, e_hi - e_lo, btm_smem, acc, w0 && e_lo == 0);
        pfm_store<BtmShape>(p, rb, e_lo, e_hi, out, acc);
        __syncthreads();  // in and out are rewritten for the next tile
    }
    if (bp.hcount) btm_swiglu(bp, p, bx, rb, list, n);
#endif
}

// F32 rows (the router) against few tokens' padded activations, in pf_f32rows' order (chains
// of F32_CHAIN values, then the chains in order). A block takes BTF_R rows x BTF_E entries, a
// thread an output, over one chain (blockIdx.z) whose values of its rows and entries it stages
// at once (cp.async; the weights before the wait: they never change). With `part`, each block
// writes its chains' sums there and the last of a tile's blocks to finish (a counter in
// `count`, which it resets) adds them in chain order; without, gridDim.z is 1 and a thread
// walks every chain. Why: one thread an output walking all 2,048 values (one chain) took ~29
// us a launch at B = 1 (H100, eager), most of it the chain's latency; a chain a block is 8x
// shorter and 8x the blocks.
// grid (ceil(rows / BTF_R), ceil(n / BTF_E), chains or 1), BTF_R * BTF_E threads.
#define BTF_R 8
#define BTF_E 8
#define BTF_S (F32_CHAIN + 4)  // a padded stride: the warp's 4 rows and 8 entries hit distinct banks

struct BtF32Params {
    PfRowsParams p;
    u64 part;   // float* [chains][n_dense][rows] the chains' sums, or 0
    u64 count;  // int* [tiles], zero between launches: a tile's blocks done (with part)
};
SIZE_IS(BtF32Params, 120); FIELD_AT(BtF32Params, p, 0); FIELD_AT(BtF32Params, part, 104);
FIELD_AT(BtF32Params, count, 112);

// Chain c's values of the block's rows (with `w`) and entries (with `x`) into ws / xs, one
// cp.async commit group; entries past n_dense are not loaded (their outputs are not stored).
__device__ __forceinline__ void btf_stage(const PfRowsParams& p, float (*ws)[BTF_S], float (*xs)[BTF_S], int r0,
                                          int e0, int c, bool w, bool x) {
    int k = p.w.k, plen = padded_len(k), k0 = c * F32_CHAIN, q = min(F32_CHAIN, k - k0) >> 2;
    int ne = min(BTF_E, p.n_dense - e0);
    for (int i = threadIdx.x; i < (BTF_R + BTF_E) * q; i += blockDim.x) {
        int row = i / q, col = 4 * (i - row * q);
        if (row < BTF_R) {
            const float* src = (const float*)p.w.data + (u64)min(r0 + row, p.rows - 1) * k + k0 + col;
            if (w) cp_async16((uint4*)&ws[row][col], src, true);
        } else if (x && row - BTF_R < ne) {
            const float* src = (const float*)p.xf + (u64)(e0 + row - BTF_R) * plen + pad_idx(k0 + col);
            cp_async16((uint4*)&xs[row - BTF_R][col], src, true);
        }
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

extern "C" __global__ void __launch_bounds__(BTF_R * BTF_E) bt_f32rows(const BtF32Params bp) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) float ws[BTF_R][BTF_S], xs[BTF_E][BTF_S];
    __shared__ int last;
    const PfRowsParams& p = bp.p;
    int r0 = blockIdx.x * BTF_R, e0 = blockIdx.y * BTF_E, k = p.w.k;
    int r = threadIdx.x / BTF_E, e = threadIdx.x % BTF_E, chains = (k + F32_CHAIN - 1) / F32_CHAIN;
    bool split = gridDim.z > 1;
    int c0 = split ? blockIdx.z : 0, c1 = split ? c0 + 1 : chains;
    float tot = 0.f;
    for (int c = c0; c < c1; c++) {
        if (c == c0) {
            btf_stage(p, ws, xs, r0, e0, c, true, false);
            pdl_start();
            btf_stage(p, ws, xs, r0, e0, c, false, true);
        } else {
            __syncthreads();  // the last chain's reads are done
            btf_stage(p, ws, xs, r0, e0, c, true, true);
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();
        float acc = 0.f;
        int n = min(F32_CHAIN, k - c * F32_CHAIN);
#pragma unroll 8
        for (int kk = 0; kk < n; kk++) acc = fmaf(ws[r][kk], xs[e][kk], acc);
        tot += acc;
    }
    bool mine = r0 + r < p.rows && e0 + e < p.n_dense;
    if (split) {
        float* part = (float*)bp.part;
        if (mine) part[((u64)c0 * p.n_dense + e0 + e) * p.rows + r0 + r] = tot;
        __threadfence();
        __syncthreads();
        int* count = (int*)bp.count + blockIdx.y * gridDim.x + blockIdx.x;
        if (threadIdx.x == 0) last = atomicAdd(count, 1) == (int)gridDim.z - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();  // the other blocks' sums, published before their counts
        tot = 0.f;
        for (int c = 0; c < chains; c++)
            if (mine) tot += __ldcg(part + ((u64)c * p.n_dense + e0 + e) * p.rows + r0 + r);
        if (threadIdx.x == 0) *count = 0;  // for the next launch
    }
    if (mine) {
        float* dst = (float*)p.out + (u64)(e0 + e) * p.out_stride + r0 + r;
        *dst = p.accumulate ? *dst + tot : tot;
    }
#endif
}
