// Decode attention on tensor cores (after attention.cu, whose GQA layout, spans and merge it
// shares).

// Qwen3-MoE's attention shape on tensor cores, over the f16 cache (sm_80+; the host picks it where
// both hold, unless CudaOptions::attn_tensor_cores is off). Why: attention.cu's scalar walk spends
// ~75 ns of an SM a position at long context (8 shared-memory query loads and a 9-shuffle butterfly
// a position and warp, three barriers a chunk) against ~8 ns of arithmetic (docs/performance.md).
// Each warp walks 16-position tiles of the block's range: S^T = Q K^T as mma.m16n8k16 (A = the 8
// queries, pre-scaled, in f16, padded to 16 rows, in registers for the whole walk; B = K rows
// straight from the cache), whose accumulators are the A operand of P V as they stand
// (FlashAttention-2's register reuse); V through shared memory and ldmatrix.trans. A warp keeps its
// running maximum, l and sums; the block merges its warps' into attn_gqa's partial layout, so
// attn_gqa_merge is unchanged. Dot products run over the 128 dims in a permuted order (the same for
// Q and K): a thread's two pairs of a 16-dim step are 4 adjacent dims, and one 16-byte load feeds
// two steps.
#if defined(KV_F16) && __CUDA_ARCH__ >= 800
#define TC_ROW 136  // halves a staged V row: 128 + 8, so ldmatrix's 8 rows hit distinct banks
#define TC_STAGE_MAX 2  // AttnGqaParams::stage at most (params.rs ATT_TC_STAGE_MAX: 2 x 64 KB fit H100 / H200)
#define TC_OROW 136  // floats a head's P V sums: 128 + 8, so a warp's float2 stores (8 heads x 4
                     // lanes) take 2 wavefronts, not 8 as at 128 (ncu: 41% excess wavefronts)
struct TcSmem {
    __align__(16) float qs[8][128];
    __align__(16) float knew[128];
    __align__(16) float vnew[128];
    float wm[8][8], wl[8][8];  // per warp and head: running maximum, l
    float ml[8][2];
    union {
        __align__(16) u16 v[8][16 * TC_ROW];   // per warp: its tile's V rows
        __align__(16) float o[8][8][TC_OROW];  // per warp and head: the P V sums (after the walk)
    };
    // A warp's sums take exactly its own V rows' bytes, so it writes them once it is done with
    // its V (tc_block_merge), whatever the other warps are at.
    static_assert(sizeof(float) * 8 * TC_OROW == sizeof(u16) * 16 * TC_ROW, "o[w] must overlay v[w] only");
};

__device__ __forceinline__ u32 pack_h2(float lo, float hi) { return (u32)f2h(lo) | (u32)f2h(hi) << 16; }
__device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(pack_h2(f[0], f[1]), pack_h2(f[2], f[3]), pack_h2(f[4], f[5]), pack_h2(f[6], f[7]));
}

// c += A B for A's rows 0..7 (a0: k 0..7 pair, a2: k 8..15 pair; rows 8..15 zero: the 8 heads
// padded to 16), B one 8-column tile (b0: k 0..7, b1: k 8..15). f16 in, f32 accumulate.
__device__ __forceinline__ void mma_h8(float (&c)[4], u32 a0, u32 a2, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Four 8x8 f16 matrices from shared memory, transposed: the B operands of two 8-column tiles.
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const u16* ptr) {
    u32 a = (u32)__cvta_generic_to_shared(ptr);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// A tile's rows from the cache (zeros past `last`): kq[j * 4 + s] = K row t0 + 8j + lane / 4,
// dims 32s + 8 (lane % 4) .. + 8 (a thread's B operands); vq[i] = V row t0 + 2i + lane / 16,
// dims 8 (lane % 16) .. + 8 (coalesced, for shared memory).
__device__ __forceinline__ void tc_load(const kv_t* kc, const kv_t* vc, int kv_dim, int t0, int last, uint4 (&kq)[8], uint4 (&vq)[8]) {
    int lane = threadIdx.x & 31;
    uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int t = t0 + 8 * j + (lane >> 2);
#pragma unroll
        for (int s = 0; s < 4; s++)
            kq[j * 4 + s] = t < last ? __ldcg((const uint4*)(kc + (u64)t * kv_dim + 32 * s + 8 * (lane & 3))) : z;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int t = t0 + 2 * i + (lane >> 4);
        vq[i] = t < last ? __ldcg((const uint4*)(vc + (u64)t * kv_dim + 8 * (lane & 15))) : z;
    }
}

// Staged tiles (dynamic shared memory): tc_load's registers of one warp's tile, uint4 i of lane l
// at [i][l], so each thread reads back what it copied (no barrier but the copies' own wait) and
// no two lanes share a bank group. 8 KB a warp and tile.
__device__ __forceinline__ void tc_stage(const kv_t* kc, const kv_t* vc, int kv_dim, int t0, int last, uint4* st) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int t = t0 + 8 * j + (lane >> 2);
        const kv_t* row = kc + (u64)min(t, last - 1) * kv_dim;  // a valid address even when unread
#pragma unroll
        for (int s = 0; s < 4; s++) cp_async16(st + (j * 4 + s) * 32 + lane, row + 32 * s + 8 * (lane & 3), t < last);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int t = t0 + 2 * i + (lane >> 4);
        cp_async16(st + (8 + i) * 32 + lane, vc + (u64)min(t, last - 1) * kv_dim + 8 * (lane & 15), t < last);
    }
}
__device__ __forceinline__ void tc_unstage(const uint4* st, uint4 (&kq)[8], uint4 (&vq)[8]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        kq[i] = st[i * 32 + lane];
        vq[i] = st[(8 + i) * 32 + lane];
    }
}

// The new position's rows, as the cache holds them, over what was loaded for it (the loads may
// predate this step's write).
__device__ __forceinline__ void tc_patch_new(const TcSmem& sm, int t0, u32 pos, uint4 (&kq)[8], uint4 (&vq)[8]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 2; j++)
        if (t0 + 8 * j + (lane >> 2) == (int)pos)
#pragma unroll
            for (int s = 0; s < 4; s++) kq[j * 4 + s] = pack8(sm.knew + 32 * s + 8 * (lane & 3));
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (t0 + 2 * i + (lane >> 4) == (int)pos) vq[i] = pack8(sm.vnew + 8 * (lane & 15));
}

// Running softmax state (m in base 2, as the scores are) and P V sums of one warp: head lane / 4,
// dims 8n + 2 (lane % 4) + {0, 1} of tile n in o[n][0..1] (o[n][2..3]: the padded heads, zero).
struct TcRun {
    float m, l;
    float o[16][4];
};

// 2^x as one MUFU.EX2 (ftz): exp2f adds a range test and two multiplies for results below 2^-126,
// which the tile's weights (rounded to f16, whose least is 2^-24) and factors do not need.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One 16-position tile at t0 (rows in kq, V staged at vs): scores, the running maximum and l
// (l over the f16 weights P V uses), P V.
__device__ __forceinline__ void tc_tile(const uint4 (&kq)[8], const u16* vs, const u32 (&qa)[8][2], int t0, int last, TcRun& r) {
    int lane = threadIdx.x & 31, c = lane & 3;
    // The scores as two sums each (even and odd k-steps): four chains of 4 dependent mma, not two
    // of 8. A warp's tiles run one after another and only two warps share a scheduler, so the
    // tile's time is its dependent latency more than its issue.
    float sc[2][4], so[2][4];
#pragma unroll
    for (int j = 0; j < 2; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) sc[j][e] = so[j][e] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            uint4 w = kq[j * 4 + (k >> 1)];
            mma_h8(k & 1 ? so[j] : sc[j], qa[k][0], qa[k][1], k & 1 ? w.z : w.x, k & 1 ? w.w : w.y);
        }
#pragma unroll
        for (int e = 0; e < 4; e++) sc[j][e] += so[j][e];
    }
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            if (t0 + 8 * j + 2 * c + e >= last) sc[j][e] = -INFINITY;
            mx = fmaxf(mx, sc[j][e]);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    float m = fmaxf(r.m, mx), f = ex2(r.m - m);  // the first tile: f = 0
    r.m = m;
    u32 pa[2];
    float ls = 0.f;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        u16 h0 = f2h(ex2(sc[j][0] - m)), h1 = f2h(ex2(sc[j][1] - m));
        ls += h2f(h0) + h2f(h1);
        pa[j] = (u32)h0 | (u32)h1 << 16;
    }
    r.l = r.l * f + ls;
#pragma unroll
    for (int n = 0; n < 16; n++) {
        r.o[n][0] *= f;
        r.o[n][1] *= f;
    }
    int mi = lane >> 3, row = (mi & 1) * 8 + (lane & 7);
#pragma unroll
    for (int n = 0; n < 16; n += 2) {
        u32 b[4];
        ldsm_x4_t(b, vs + row * TC_ROW + 8 * (n + (mi >> 1)));
        mma_h8(r.o[n], pa[0], pa[1], b[0], b[1]);
        mma_h8(r.o[n + 1], pa[0], pa[1], b[2], b[3]);
    }
}

// The block's warps' states merged into the partial of attn_gqa_unit's layout (or the heads'
// outputs where the block holds all positions), ml as attn_gqa_merge reads it.
__device__ __forceinline__ void tc_block_merge(const AttnGqaParams& p, TcSmem& sm, const TcRun& r, int kvh, int s, bool direct) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    float l = r.l + __shfl_xor_sync(0xffffffff, r.l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    __syncwarp();  // this warp is done with its staged V: its sums o[warp] take the same bytes, v[warp]
    if (c == 0) { sm.wm[warp][g] = r.m; sm.wl[warp][g] = l; }
#pragma unroll
    for (int n = 0; n < 16; n++) *(float2*)&sm.o[warp][g][8 * n + 2 * c] = make_float2(r.o[n][0], r.o[n][1]);
    __syncthreads();
    // Warp h merges head h, every lane its 8 factors (8 broadcast loads and exponentials): no
    // third barrier after a 64-thread factor pass, and in direct mode one division a lane, not
    // one an output (the merge is on the layer's critical path).
    int h = warp;
    float m = sm.wm[0][h];
#pragma unroll
    for (int w = 1; w < 8; w++) m = fmaxf(m, sm.wm[w][h]);
    float f[8], L = 0.f;
#pragma unroll
    for (int w = 0; w < 8; w++) {
        f[w] = ex2(sm.wm[w][h] - m);  // idle warps: 0
        L += f[w] * sm.wl[w][h];
    }
    float scale = direct ? 1.f / L : 1.f;
    float* part = (float*)p.part + ((u64)(kvh * 8 + h) * p.n_split + s) * 130;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int d = lane + 32 * k;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < 8; w++) v += f[w] * sm.o[w][h][d];
        if (direct) ((float*)p.out)[(kvh * 8 + h) * 128 + d] = v * scale;
        else part[2 + d] = v;
    }
    if (direct) return;
    if (lane == 0) {
        float m_e = m * 0.69314718f;  // the merges' m: base e
        part[0] = m_e;
        part[1] = L;
        sm.ml[h][0] = m_e;
        sm.ml[h][1] = L;
    }
    __syncthreads();  // ml for attn_gqa_merge's first warp
}

// Block u.y of KV head u.x: positions [first, last) as attn_gqa_unit's, in 16-position tiles
// (warp w: tiles w, w + 8, ..). Before pdl_wait the warp's first tile loads into registers and
// its next p.stage tiles into `st` (cp.async; their DRAM latency overlaps the predecessor
// kernel) where that stages all of them; otherwise (long context) each later tile's rows are in
// flight while the one before it is computed. Staging 2 of a warp's 4 tiles at 16,384 positions
// measured 7% slower (docs/performance.md).
__device__ __forceinline__ void attn_tc_unit(const AttnGqaParams& p, TcSmem& sm, uint4* st, Unit u, int span, bool direct) {
    int kvh = u.x, s = u.y, kv_dim = p.n_kv_head * 128;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    u32 pos = __ldcg(&((const StepState*)p.state)->pos);  // before pdl_wait: from L2
    int first = s * span * ATT_CHUNK, last = min(first + span * ATT_CHUNK, (int)pos + 1);
    int n_tiles = (last - first + 15) >> 4;
    const kv_t* kc = (const kv_t*)p.k_cache + kvh * 128;
    const kv_t* vc = (const kv_t*)p.v_cache + kvh * 128;
    uint4 kq[8], vq[8];
    if (warp < n_tiles) tc_load(kc, vc, kv_dim, first + 16 * warp, last, kq, vq);  // written by earlier steps
    st += warp * 16 * 32;  // this warp's staged tiles, 8 warps apart
    int stage = n_tiles <= 8 * (1 + p.stage) ? p.stage : 0;
#pragma unroll
    for (int j = 1; j <= TC_STAGE_MAX; j++)
        if (j <= stage && warp + 8 * j < n_tiles) tc_stage(kc, vc, kv_dim, first + 16 * (warp + 8 * j), last, st + (j - 1) * 8 * 16 * 32);
    asm volatile("cp.async.commit_group;\n" ::);
    LaneRope rp = lane_rope(128, pos, p.theta);
    float qn[4], kn[4];
    lane_norm((const float*)p.q_norm, 128, qn);
    lane_norm((const float*)p.k_norm, 128, kn);
    pdl_start();
    bool has_new = (int)pos >= first && (int)pos < last;
    // Scores in base 2 (q scaled by log2 e): a tile's weights are one MUFU.EX2 each where expf
    // takes ~8 dependent instructions; exp2(s log2 e - m) = exp(s - m ln 2), so only m changes base.
    // The scale goes in with the queries' RMS factor, before the barrier, not on each packed pair.
    gqa_stage_new<128, 8>(p, sm.qs, sm.knew, sm.vnew, kvh, pos, has_new, rp, qn, kn, p.scale * 1.44269504f);
    __syncthreads();
    tl_mark(TL_X);
    u32 qa[8][2];  // k-step k: this thread's dims 32 (k / 2) + 8c + 4 (k % 2) + {0, 1} and {2, 3}
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float* q = sm.qs[g] + 32 * (k >> 1) + 8 * c + 4 * (k & 1);
        qa[k][0] = pack_h2(q[0], q[1]);
        qa[k][1] = pack_h2(q[2], q[3]);
    }
    TcRun r;
    r.m = -INFINITY;
    r.l = 0.f;
#pragma unroll
    for (int n = 0; n < 16; n++) r.o[n][0] = r.o[n][1] = r.o[n][2] = r.o[n][3] = 0.f;
    u16* vs = sm.v[warp];
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#pragma unroll 1
    for (int nth = 0, tile = warp; tile < n_tiles; nth++, tile += 8) {  // the warp's nth tile
        int t0 = first + 16 * tile;
        if (nth >= 1 && nth <= stage) tc_unstage(st + (nth - 1) * 8 * 16 * 32, kq, vq);
        if ((u32)((int)pos - t0) < 16) tc_patch_new(sm, t0, pos, kq, vq);  // only the tile holding pos
#pragma unroll
        for (int i = 0; i < 8; i++) *(uint4*)(vs + (2 * i + (lane >> 4)) * TC_ROW + 8 * (lane & 15)) = vq[i];
        __syncwarp();
        uint4 kt[8];
#pragma unroll
        for (int i = 0; i < 8; i++) kt[i] = kq[i];
        if (tile + 8 < n_tiles && nth + 1 > stage) tc_load(kc, vc, kv_dim, t0 + 128, last, kq, vq);
        tc_tile(kt, vs, qa, t0, last, r);
        __syncwarp();  // vs is rewritten by the next tile
    }
    tl_mark_warps(TL_MID);
    tc_block_merge(p, sm, r, kvh, s, direct);
}
#endif

extern "C" __global__ void __launch_bounds__(256, 1) attn_gqa_128_8_tc(const AttnGqaParams p) {
#if defined(KV_F16) && __CUDA_ARCH__ >= 800
    __shared__ TcSmem sm;
    extern __shared__ __align__(16) uint4 tc_staged[];  // [p.stage][8 warps][16][32]
    Unit u = this_unit();
    GqaSpan w = gqa_span(p);
    if (u.y >= w.n_act) return;
    attn_tc_unit(p, sm, tc_staged, u, w.span, w.n_act == 1);
    if (w.n_act > 1) attn_gqa_merge<128, 8>(p, sm.ml, u.x, w.n_act);
    tl_mark(TL_END);
#endif
}

// The batched decode step's attention on tensor cores (prefill.rs Keys::Rows, Qwen3-MoE's shape
// over an f16 cache): attn_gqa_128_8_tc for row blockIdx.z of the step, its projections, cache,
// position, partials, merge counters and output found from row 0's by the strides and the
// step's table of caches. A row's span is its own length's (gqa_span: the knobs are the
// backend's, not the batch's), so its bits are the same alone or beside any rows; norm, RoPE and
// the KV append are in the launch, as alone. grid (n_kv_head, blocks a KV head, rows).
struct BtGqaParams {
    AttnGqaParams g;  // row 0's buffers
    u64 kv;           // const u64* [rows][2]: this layer's K and V cache of each row
    u32 qkv_stride;   // floats between rows' projections
    u32 part_stride;  // floats between rows' partials
    u64 xq;           // u32* [rows][q_dim / 32 * QXW]: the outputs quantised, as pf_quant's (no norm)
    u64 xf;           // float* [rows][padded_len(q_dim)]: and padded
};
SIZE_IS(BtGqaParams, 144); FIELD_AT(BtGqaParams, g, 0); FIELD_AT(BtGqaParams, kv, 112);
FIELD_AT(BtGqaParams, qkv_stride, 120); FIELD_AT(BtGqaParams, part_stride, 124);
FIELD_AT(BtGqaParams, xq, 128); FIELD_AT(BtGqaParams, xf, 136);

// Warp w's head (KV head kvh's w-th) of row z's output, just written by this warp, quantised
// for the o projection as pf_quant's load_x_fast (no norm) quantises it: lane i the values
// 4i..4i+3 of the head's 128 (four groups of 32, eight lanes each), so quant_store sees the
// lanes and values pf_quant's threads give it, and the padded floats as X_PAD stores them. Why:
// pf_quant was a launch of its own after every layer's attention (~6 us eager, H200).
__device__ __forceinline__ void bt_quant_head(const BtGqaParams& b, const AttnGqaParams& p, u64 z, int kvh) {
    int lane = threadIdx.x & 31, h = kvh * 8 + (threadIdx.x >> 5), q_dim = p.n_head * 128;
    __syncwarp();  // the warp's lanes wrote the head's outputs
    float4 v = ((const float4*)((const float*)p.out + h * 128))[lane];
    u32* xq = (u32*)b.xq + z * (u64)((q_dim >> 5) * QXW) + h * 4 * QXW;
    quant_store(xq, lane, v, true);
    float* xf = (float*)b.xf + z * (u64)padded_len(q_dim);
    *(float4*)(xf + pad_idx(h * 128 + 4 * lane)) = v;
}

extern "C" __global__ void __launch_bounds__(256, 1) bt_attn_gqa_tc(const BtGqaParams b) {
#if defined(KV_F16) && __CUDA_ARCH__ >= 800
    __shared__ TcSmem sm;
    extern __shared__ __align__(16) uint4 tc_staged[];  // [p.stage][8 warps][16][32]
    AttnGqaParams p = b.g;
    u64 z = blockIdx.z;
    // The table and the states were uploaded before the step: read before pdl_wait, from L2.
    const u64* kv = (const u64*)b.kv + 2 * z;
    p.k_cache = __ldcg(kv);
    p.v_cache = __ldcg(kv + 1);
    p.qkv += 4 * z * b.qkv_stride;
    p.part += 4 * z * b.part_stride;
    p.out += 4 * z * (u64)(p.n_head * 128);
    p.done += 4 * z * (u64)(p.n_kv_head + p.n_head);
    p.state += z * sizeof(StepState);
    Unit u = this_unit();
    GqaSpan w = gqa_span(p);
    if (u.y >= w.n_act) return;
    attn_tc_unit(p, sm, tc_staged, u, w.span, w.n_act == 1);
    // The block that wrote the KV head's outputs: alone (direct), or the merge's last.
    bool wrote = w.n_act == 1 || attn_gqa_merge<128, 8>(p, sm.ml, u.x, w.n_act);
    if (wrote && b.xq) bt_quant_head(b, p, z, u.x);
#endif
}
