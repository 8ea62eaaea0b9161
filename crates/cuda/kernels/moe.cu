// Mixture-of-experts: softmax + top-k over the router logits, gate+up+SiLU for all selected
// experts in one launch, then down + weighted sum + residual. Expert ids stay on the device.
struct TopkParams {
    u64 logits;   // const float* [n_expert]
    u64 ids;      // int* [n_used]
    u64 weights;  // float* [n_used]
    int n_expert;
    int n_used;
    int norm_topk;
};
SIZE_IS(TopkParams, 40); FIELD_AT(TopkParams, logits, 0); FIELD_AT(TopkParams, ids, 8);
FIELD_AT(TopkParams, weights, 16); FIELD_AT(TopkParams, n_expert, 24); FIELD_AT(TopkParams, n_used, 28);
FIELD_AT(TopkParams, norm_topk, 32);

// Logits a lane of topk_block's first warp holds in registers (n_expert <= 256).
#define TOPK_REG 8

// Rank of entry i of pr[0..n) (NaN taken as `nan_as`): larger values first, the lower index
// first on ties, so every entry has its own rank.
__device__ __forceinline__ int rank_in(const float* pr, int n, int i, float nan_as) {
    float v = pr[i];
    v = v == v ? v : nan_as;
    int rank = 0;
#pragma unroll 8
    for (int j = 0; j < n; j++) {
        float u = pr[j];
        u = u == u ? u : nan_as;
        rank += (u > v) || (u == v && j < i);
    }
    return rank;
}

// Softmax over the router logits, the n_used largest probabilities (lower index first on ties)
// and, with norm_topk, their renormalisation, by the whole block: warp 0 takes the max and the
// sum of exponentials (a lane sums i = lane, lane + 32, .. in order, then warp_sum), then every
// expert's rank among all places it, and warp 0 sums the chosen weights in rank order. Why the
// rank: n_used serial warp arg-max rounds sat between the router and the experts' weight
// fetches. Logits are read through L2 (__ldcg): other blocks of the same grid wrote them.
// The chosen ids and weights gather in shared memory and are stored once, renormalised: the
// renormalisation read them back from `ids` / `ws` (global), an L2 round trip between the router
// and the experts' weight fetches.
// `pr`: n_expert floats of shared scratch; `red`: at least one float of shared memory.
// `SHARED_LG`: the logits are in this block's shared memory (router_cluster), not global.
template <bool SHARED_LG = false>
__device__ void topk_block(const float* lg, int n_expert, int n_used, int norm_topk, int* ids, float* ws, float* pr, float* red) {
    __shared__ float sel_w[32];  // n_used <= 32
    __shared__ int sel_id[32];
    int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        float m = -INFINITY, s = 0.f;
        if (n_expert <= 32 * TOPK_REG) {
            float v[TOPK_REG];  // all of a lane's logits loaded at once
#pragma unroll
            for (int j = 0; j < TOPK_REG; j++)
                if (lane + 32 * j < n_expert) v[j] = SHARED_LG ? lg[lane + 32 * j] : __ldcg(lg + lane + 32 * j);
#pragma unroll
            for (int j = 0; j < TOPK_REG; j++)
                if (lane + 32 * j < n_expert) m = fmaxf(m, v[j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
#pragma unroll
            for (int j = 0; j < TOPK_REG; j++)
                if (lane + 32 * j < n_expert) {
                    float e = expf(v[j] - m);
                    pr[lane + 32 * j] = e;
                    s += e;
                }
        } else {
            for (int i = lane; i < n_expert; i += 32) m = fmaxf(m, SHARED_LG ? lg[i] : __ldcg(lg + i));
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
            for (int i = lane; i < n_expert; i += 32) {
                float e = expf((SHARED_LG ? lg[i] : __ldcg(lg + i)) - m);
                pr[i] = e;
                s += e;
            }
        }
        s = warp_sum(s);
        if (lane == 0) red[0] = s;
    }
    __syncthreads();
    float s = red[0];
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
        float v = pr[i];
        v = v == v ? v : -1.f;  // NaN ranks last, as the arg-max rounds skipped it
        int rank = rank_in(pr, n_expert, i, -1.f);
        if (rank < n_used) {
            sel_id[rank] = i;
            sel_w[rank] = v / s;
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float chosen = 0.f;  // in rank order
        for (int k = 0; k < n_used; k++) chosen += sel_w[k];
        if (lane < n_used) {
            ids[lane] = sel_id[lane];
            ws[lane] = norm_topk ? sel_w[lane] / chosen : sel_w[lane];
        }
    }
    __syncthreads();
}

extern "C" __global__ void moe_topk(const TopkParams p) {
    __shared__ float pr[4096];
    __shared__ float red[1];
    pdl_start();
    topk_block((const float*)p.logits, p.n_expert, p.n_used, p.norm_topk, (int*)p.ids, (float*)p.weights, pr, red);
}

// RMSNorm + F32 router (one row per warp, the row staged in registers before pdl_wait) +
// softmax/top-k/renormalise in the last block to finish (integer counter, reset by that block).
struct RouterParams {
    u64 w;        // const float* [n_expert, k]
    u64 in;       // const float* [k] residual stream
    u64 norm;     // const float* [k]
    u64 xn_out;   // float* [k] normalised input (block 0 writes it)
    u64 logits;   // float* [n_expert]
    u64 ids;      // int* [n_used]
    u64 weights;  // float* [n_used]
    u64 counter;  // int*, 0 between launches
    int n_expert;
    int k;        // multiple of 128, <= 2048
    int n_used;
    int norm_topk;
    float eps;
};
SIZE_IS(RouterParams, 88); FIELD_AT(RouterParams, w, 0); FIELD_AT(RouterParams, in, 8);
FIELD_AT(RouterParams, norm, 16); FIELD_AT(RouterParams, xn_out, 24); FIELD_AT(RouterParams, logits, 32);
FIELD_AT(RouterParams, ids, 40); FIELD_AT(RouterParams, weights, 48); FIELD_AT(RouterParams, counter, 56);
FIELD_AT(RouterParams, n_expert, 64); FIELD_AT(RouterParams, k, 68); FIELD_AT(RouterParams, n_used, 72);
FIELD_AT(RouterParams, norm_topk, 76); FIELD_AT(RouterParams, eps, 80);

// The logit of router row `row` (this warp's; every lane gets it): the row's F32 weights load
// before pdl_wait, then the normalised input into xs (unpadded; k % 128 == 0, <= 2048), which
// the block with `store_xn` also writes to xn_out for the experts.
__device__ __forceinline__ float router_logit(const RouterParams& p, float* xs, float* red, int row, bool store_xn) {
    int lane = threadIdx.x & 31, nq = p.k >> 7;
    float4 wv[16];
    const float4* wr = (const float4*)((const float*)p.w + (u64)(row < p.n_expert ? row : 0) * p.k);
#pragma unroll
    for (int j = 0; j < 16; j++)
        if (j < nq) wv[j] = wr[lane + 32 * j];
    pdl_start();
    load_x_fast<X_PLAIN>(xs, (const float*)p.in, p.k, (const float*)p.norm, p.eps, red);
    if (store_xn)
        for (int i = threadIdx.x; i < p.k; i += blockDim.x) ((float*)p.xn_out)[i] = xs[i];
    float acc = 0.f;
    const float4* x4 = (const float4*)xs;
#pragma unroll
    for (int j = 0; j < 16; j++)
        if (j < nq) {
            float4 a = wv[j], b = x4[lane + 32 * j];
            acc += dot4(a, b);
        }
    return warp_sum(acc);
}

// grid ceil(n_expert / warps), 128 threads (router rows over more SMs: one round trip each),
// dynamic smem (36 + k + n_expert + 4) floats.
__device__ __forceinline__ void router_topk_unit(const RouterParams& p, float* smem, Unit u) {
    float* red = smem;
    float* xs = smem + 36;  // 16-byte aligned, unpadded
    float* pr = xs + p.k;   // [n_expert] top-k scratch
    int* is_last = (int*)(pr + p.n_expert);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int row = u.x * nw + warp;
    float acc = router_logit(p, xs, red, row, u.x == 0);
    if (lane == 0 && row < p.n_expert) ((float*)p.logits)[row] = acc;
    if (!last_to_arrive((u32*)p.counter, u.nx, is_last)) return;
    topk_block((const float*)p.logits, p.n_expert, p.n_used, p.norm_topk, (int*)p.ids, (float*)p.weights, pr, red);
}

extern "C" __global__ void router_topk(const RouterParams p) {
    extern __shared__ __align__(16) float smem[];
    router_topk_unit(p, smem, this_unit());
}

// router_topk in one cluster of RC_BLOCKS blocks (sm_90 thread block clusters): block b's warps
// take rows RC_WARPS * b + w, each lane stores its row's logit straight into block 0's shared
// memory (distributed shared memory), and after one cluster barrier block 0 takes the top-k from
// there. Why: router_topk's last-block pattern waits out a global store, a fence, a completion
// count and a reload of the logits -- several L2 round trips between the router and the experts.
// n_expert <= RC_BLOCKS * RC_WARPS; dynamic smem (36 + k + 2 n_expert) floats.
#define RC_BLOCKS 8
#define RC_WARPS 16
__device__ __forceinline__ void st_block0_f32(float* local, float v) {
    u32 a = (u32)__cvta_generic_to_shared(local), r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(r) : "r"(a));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(r), "f"(v) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// A block may touch another's shared memory only once that block has started: arrive at the
// start, wait just before the first remote access (every block is long past its start then).
__device__ __forceinline__ void cluster_arrive_started() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait_started() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

#if __CUDA_ARCH__ >= 900
extern "C" __global__ void __cluster_dims__(RC_BLOCKS, 1, 1) __launch_bounds__(RC_WARPS * 32, 1) router_cluster(const RouterParams p) {
    extern __shared__ __align__(16) float smem[];
    float* red = smem;
    float* xs = smem + 36;      // [k], unpadded
    float* lgs = xs + p.k;      // [n_expert]: block 0 gathers the logits here
    float* pr = lgs + p.n_expert;  // [n_expert] top-k scratch
    cluster_arrive_started();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row = blockIdx.x * RC_WARPS + warp;
    float acc = router_logit(p, xs, red, row, blockIdx.x == 0);
    cluster_wait_started();
    if (lane == 0 && row < p.n_expert) st_block0_f32(lgs + row, acc);
    cluster_sync();  // every logit is in block 0's lgs; no block touches another's memory after
    if (blockIdx.x != 0) return;
    topk_block<true>(lgs, p.n_expert, p.n_used, p.norm_topk, (int*)p.ids, (float*)p.weights, pr, red);
}
#else
extern "C" __global__ void router_cluster(const RouterParams p) {}  // clusters need sm_90: never launched
#endif

// ---- The router folded into o_proj's launch (step/moe.rs `router_fold`). The router's logits are
// linear in the residual before RMSNorm: with x' = x + W_o a (o_proj's output) and the norm's
// factor s = rsqrt(mean(x'^2) + eps) > 0,
//     R (s x' * g) = s ((R * g) x + ((R * g) W_o) a),
// so the unscaled logits need only x (final before o_proj starts) and a (o_proj's own input):
// they are computed by extra blocks of o_proj's launch, with F = (R * g) W_o built at load
// (router_fold_build). s changes no ranking, so the top-k runs at once; moe_down, which reads
// x' anyway, applies s when it turns the chosen logits into weights (fold_weights). Why: the
// router was a launch of its own, 5.9 us of the ~35 a layer (docs/performance.md) -- a launch
// boundary and a chain of L2 round trips between o_proj and the experts.
struct RouterFold {
    u64 w;        // const float* [n_expert, d_model] router rows, as stored
    u64 fold;     // const float* [n_expert, q_dim] F
    u64 norm;     // const float* [d_model] the FFN's RMSNorm weight g
    u64 x;        // const float* [d_model] the residual before o_proj (moe_down wrote it
                  // three launches back: read before pdl_wait)
    u64 slots;    // u64* [n_expert]: each row's unscaled logit (low word) under its launch's
                  // tag (high word; router_fold_row)
    u64 ids;      // int* [n_used] chosen experts, rank order
    u64 sel;      // float* [n_used] their unscaled logits
    u64 epoch;    // u32*: the last gather's tag (0 at first; never reset)
    int n_expert; // the launch's first n_expert blocks take a router row each
    int d_model;  // <= 4 * RF_X * blockDim
    int q_dim;    // <= 4 * RF_A * blockDim
    int n_used;
};
SIZE_IS(RouterFold, 80); FIELD_AT(RouterFold, w, 0); FIELD_AT(RouterFold, fold, 8);
FIELD_AT(RouterFold, norm, 16); FIELD_AT(RouterFold, x, 24); FIELD_AT(RouterFold, slots, 32);
FIELD_AT(RouterFold, ids, 40); FIELD_AT(RouterFold, sel, 48); FIELD_AT(RouterFold, epoch, 56);
FIELD_AT(RouterFold, n_expert, 64); FIELD_AT(RouterFold, d_model, 68); FIELD_AT(RouterFold, q_dim, 72);
FIELD_AT(RouterFold, n_used, 76);
struct OprojRouterParams {
    MatvecParams mv;  // o_proj: accumulate, its residual read from RouterFold::x
    RouterFold r;
};
SIZE_IS(OprojRouterParams, 232); FIELD_AT(OprojRouterParams, mv, 0); FIELD_AT(OprojRouterParams, r, 152);
#define RF_X 2
#define RF_A 4

// A float's order as an unsigned key: larger floats give larger keys, -0 ties with +0 and NaN
// with -inf (so it ranks last).
__device__ __forceinline__ u32 order_key(float v) { return float_key(v == v ? (v == 0.f ? 0.f : v) : -INFINITY); }

// c += key > thr as one predicated add: C's `c += key > thr` compiles to an add and a
// predicated move, two instructions a key where this is one.
__device__ __forceinline__ void count_above(int& c, u32 key, u32 thr) {
    asm("{\n\t.reg .pred p;\n\tsetp.gt.u32 p, %1, %2;\n\t@p add.s32 %0, %0, 1;\n\t}" : "+r"(c) : "r"(key), "r"(thr));
}

// The n_used largest unscaled logits (NaN ranks last but keeps its value, so it reaches the
// weights), ids and values in rank order, as rank_in orders them, once every row's slot holds
// this launch's `tag`: the gather polls the slots (a thread a slot) instead of counting
// arrivals. Why: the last-block pattern put three L2 round trips after the last logit (its
// store's acknowledgement under the release, the count's atomic, the reload); a poll in flight
// sees the store about as it lands. A spin past 2^26 polls traps (a launch error, not a hang).
// Why not rank_in: one block ranks on the step's critical path, a thread an entry over all n --
// 128 dependent compares with one warp a scheduler, ~2 us a layer (docs/performance.md). Here
// every entry's count is split over `parts` threads, four keys a 16-byte load with one threshold
// (before i, key - 1: the lower index wins a tie) and a compare a key. The select a key it
// replaced (j < i per key) made ~7 instructions a key, ~0.5 us a layer at 128 experts. The keys
// are padded with zeros to a multiple of 4, below every key (keys are >= order_key(-inf) > 0).
// smem: lg [n4], key [n4] and cnt [max(n_expert, blockDim)], 4 bytes each (n4: n_expert rounded
// up to a multiple of 4; lg 16-byte aligned).
__device__ void topk_logits(const RouterFold& r, u32 tag, float* smem) {
    int n = r.n_expert, n4 = (n + 3) & ~3, parts = max(1, (int)blockDim.x / n);
    int len = ((n4 >> 2) + parts - 1) / parts * 4;
    float inv_n = __fdividef(1.f, (float)n);
    float* lg = smem;
    u32* key = (u32*)(lg + n4);
    int* cnt = (int*)(key + n4);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        if (i >= n) {
            key[i] = 0;
            continue;
        }
        u64 v;
        int polls = 0;
        do {
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"((const u64*)r.slots + i) : "memory");
            if (++polls == 1 << 26) __trap();
        } while ((u32)(v >> 32) != tag);
        lg[i] = __uint_as_float((u32)v);
        key[i] = order_key(lg[i]);
    }
    __syncthreads();
    for (int t = threadIdx.x; t < parts * n; t += blockDim.x) {
        int q = floor_div_small(t, inv_n), i = t - q * n, lo = q * len, hi = min(lo + len, n4);
        u32 ki = key[i];
        int c0 = 0, c1 = 0, c2 = 0, c3 = 0;
#pragma unroll 4
        for (int j = lo; j < hi; j += 4) {
            uint4 k = *(const uint4*)(key + j);
            u32 thr = j < i ? ki - 1 : ki;  // before i a tie beats i
            count_above(c0, k.x, thr);
            count_above(c1, k.y, thr);
            count_above(c2, k.z, thr);
            count_above(c3, k.w, thr);
        }
        // The load holding i, i not its first key, took ki - 1 for its keys from i on too: those
        // equal to ki (i among them) were counted and do not beat i.
        int i4 = i & ~3, c = (c0 + c1) + (c2 + c3);
        if (i != i4 && i4 >= lo && i4 < hi)
            for (int m = i; m < i4 + 4; m++) c -= key[m] == ki;
        cnt[t] = c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int rank = 0;
        for (int q = 0; q < parts; q++) rank += cnt[q * n + i];
        if (rank < r.n_used) {
            ((int*)r.ids)[rank] = i;
            ((float*)r.sel)[rank] = lg[i];
        }
    }
    if (threadIdx.x == 0) *(u32*)r.epoch = tag;  // every row read the epoch before its store
}

// Router row `row`'s unscaled logit by the whole block: the weights, g, x and the epoch before
// pdl_wait (the previous layer's gather set it, launches back), then a; the logit goes to its
// slot under tag epoch + 1, and the last row's block gathers and ranks (topk_logits). Which
// block gathers changes no result; the last is dispatched after the others, so it spins least.
// smem: 40 floats, then topk_logits'.
__device__ void router_fold_row(const RouterFold& r, const float* a, float* smem, int row) {
    float* red = smem;
    int t = threadIdx.x, nt = blockDim.x, nx = r.d_model >> 2, na = r.q_dim >> 2;
    const float4* w4 = (const float4*)((const float*)r.w + (u64)row * r.d_model);
    const float4* f4 = (const float4*)((const float*)r.fold + (u64)row * r.q_dim);
    float4 wv[RF_X], gv[RF_X], xv[RF_X], fv[RF_A];
#pragma unroll
    for (int j = 0; j < RF_X; j++)
        if (t + j * nt < nx) {
            wv[j] = w4[t + j * nt];
            gv[j] = ((const float4*)r.norm)[t + j * nt];
            xv[j] = __ldcg((const float4*)r.x + t + j * nt);
        }
#pragma unroll
    for (int j = 0; j < RF_A; j++)
        if (t + j * nt < na) fv[j] = f4[t + j * nt];
    u32 tag = __ldcg((const u32*)r.epoch) + 1;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < RF_X; j++)
        if (t + j * nt < nx) acc += dot4(mul4(wv[j], gv[j]), xv[j]);
    pdl_start();
#pragma unroll
    for (int j = 0; j < RF_A; j++)
        if (t + j * nt < na) {
            float4 v = __ldcg((const float4*)a + t + j * nt);
            acc += dot4(fv[j], v);
        }
    warp_partial(acc, red);  // thread 0 sums the partials: one barrier, not block_sum's three
    __syncthreads();
    if (t == 0) {
        u64 v = (u64)tag << 32 | __float_as_uint(partials_sum<true>(red));
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"((u64*)r.slots + row), "l"(v) : "memory");
    }
    tl_mark(TL_X);
    if (row == r.n_expert - 1) topk_logits(r, tag, smem + 40);
    tl_mark(TL_END);
}

// o_proj with the router folded in: blocks [0, n_expert) are router rows, the rest o_proj's
// staged rows (mode `mv_mode` as matvec's), which write x' = x + W_o a to mv.out. One kernel per
// mode, as matvec's; 3 blocks an SM as MV_KERNEL. Dynamic smem: o_proj's (smem_x(q_dim)) and at
// least the router's.
#define OPROJ_ROUTER_KERNEL(name, NR, ...)                                                        \
    extern "C" __global__ void __launch_bounds__(256, 3) name(const OprojRouterParams p) {       \
        extern __shared__ __align__(16) float smem[];                                             \
        Unit u = this_unit();                                                                     \
        if (u.x < p.r.n_expert) return router_fold_row(p.r, (const float*)p.mv.in, smem, u.x);    \
        Unit o{u.x - p.r.n_expert, 0, u.nx - p.r.n_expert};                                       \
        mv_staged<NR, __VA_ARGS__>(p.mv, smem + 36, smem, o, (const float*)p.r.x);                \
    }
#define OPROJ_ROUTER_MODE(sfx, NR, ...) OPROJ_ROUTER_KERNEL(o_proj_router_##sfx, NR, __VA_ARGS__)
STAGED_MODES(OPROJ_ROUTER_MODE)  // matvec.cu's staged kernels

// F = (R * g) W_o at load, in double: grid (ceil(q_dim / 256), n_expert), 256 threads, one
// element a thread (W_o's rows are o_proj's outputs, its k = q_dim).
struct FoldBuildParams {
    QW o;
    u64 router;  // const float* [n_expert, d_model]
    u64 norm;    // const float* [d_model]
    u64 out;     // float* [n_expert, q_dim]
    int d_model;
    int q_dim;
};
SIZE_IS(FoldBuildParams, 56); FIELD_AT(FoldBuildParams, o, 0); FIELD_AT(FoldBuildParams, router, 24);
FIELD_AT(FoldBuildParams, norm, 32); FIELD_AT(FoldBuildParams, out, 40);
FIELD_AT(FoldBuildParams, d_model, 48); FIELD_AT(FoldBuildParams, q_dim, 52);
extern "C" __global__ void router_fold_build(const FoldBuildParams p) {
    int j = blockIdx.x * blockDim.x + threadIdx.x, e = blockIdx.y;
    if (j >= p.q_dim) return;
    const float* r = (const float*)p.router + (u64)e * p.d_model;
    double acc = 0.0;
    for (int i = 0; i < p.d_model; i++)
        acc += (double)r[i] * (double)((const float*)p.norm)[i] * (double)weight_at(p.o, (u64)i, j);
    ((float*)p.out)[(u64)e * p.q_dim + j] = (float)acc;
}

// The selected experts, as router_topk / moe_topk wrote them.
struct Experts {
    u64 ids;      // const int* [n_used]
    u64 weights;  // const float* [n_used]
    int n_used;   // <= 32
    int scratch;  // float offset of 64 floats of the block's dynamic shared memory for them
};
SIZE_IS(Experts, 24); FIELD_AT(Experts, ids, 0); FIELD_AT(Experts, weights, 8); FIELD_AT(Experts, n_used, 16);
FIELD_AT(Experts, scratch, 20);

// The experts' ids and weights into shared memory (weights at `ws`, ids at `ids`), through L2:
// moe_down reads them before pdl_wait (the router ran two launches before it), so it can issue
// its expert weight loads while moe_gate_up finishes. Ends with __syncthreads.
__device__ __forceinline__ void block_experts(const Experts& t, float* smem, int*& ids, float*& ws) {
    ws = smem + t.scratch;
    ids = (int*)(ws + 32);
    if (threadIdx.x < t.n_used) {
        ids[threadIdx.x] = __ldcg((const int*)t.ids + threadIdx.x);
        ws[threadIdx.x] = __ldcg((const float*)t.weights + threadIdx.x);
    }
    __syncthreads();
}

struct GateUpParams {
    QW gate;     // rows of all experts: expert e's row r is row e*d_ff + r
    QW up;
    u64 xn;      // const float* [d_model]: the generic mode's normalised input; the staged
                 // modes' residual, which they normalise (load_xg_quant)
    u64 h;       // float* [n_used, d_ff]
    u64 norm;    // const float* [d_model] the FFN's RMSNorm weight (staged modes)
    Experts experts;
    int d_ff;
    int rows_per_warp;
    float eps;
};
SIZE_IS(GateUpParams, 112); FIELD_AT(GateUpParams, gate, 0); FIELD_AT(GateUpParams, up, 24);
FIELD_AT(GateUpParams, xn, 48); FIELD_AT(GateUpParams, h, 56); FIELD_AT(GateUpParams, norm, 64);
FIELD_AT(GateUpParams, experts, 72); FIELD_AT(GateUpParams, d_ff, 96);
FIELD_AT(GateUpParams, rows_per_warp, 100); FIELD_AT(GateUpParams, eps, 104);

// One unit of the staged gate/up modes: NR rows a warp of the gate and up of the slot's expert
// e, their weights loaded first, then h = silu(gate) * up against the quantised input, whose
// RMS factor s is applied after the integer dots. The router's ids are never negative; testing
// `e >= 0` anyway lets the compiler take the row arithmetic as non-negative:
// moe_gate_up_q4_0_2 compiles to 56 registers with the test, 60 without, and the build with it
// measured +2.2% on Q4_0 (docs/performance.md).
template <int NR, class Rows>
struct GateUpUnit {
    Rows G, U;
    long long rows[NR];
    int slot, first;
    // The warp's rows of unit u of expert e (-1 past d_ff); returns the first's index in the expert.
    __device__ __forceinline__ static int unit_rows(const GateUpParams& p, int e, Unit u, long long* r) {
        int f = (u.x * (int)(blockDim.x >> 5) + (int)(threadIdx.x >> 5)) * NR;
#pragma unroll
        for (int i = 0; i < NR; i++) r[i] = e >= 0 && f + i < p.d_ff ? (long long)e * p.d_ff + f + i : -1;
        return f;
    }
    __device__ __forceinline__ void load(const GateUpParams& p, int e, Unit u, int lane) {
        slot = u.y;
        first = unit_rows(p, e, u, rows);
        G.load(p.gate, rows, lane);
        U.load(p.up, rows, lane);
    }
    // Unit u's rows into L2 (a walker's next unit), nothing kept in registers.
    __device__ __forceinline__ static void prefetch(const GateUpParams& p, int e, Unit u, int lane) {
        long long r[NR];
        unit_rows(p, e, u, r);
        Rows::prefetch(p.gate, r, lane);
        Rows::prefetch(p.up, r, lane);
    }
    __device__ __forceinline__ void finish(const GateUpParams& p, const u32* qx, float s, int lane) {
        float ag[NR], au[NR];
        const u32* xp[NR];
#pragma unroll
        for (int i = 0; i < NR; i++) { ag[i] = 0.f; au[i] = 0.f; xp[i] = qx; }
        G.dot(p.gate, rows, xp, lane, ag);
        U.dot(p.up, rows, xp, lane, au);
#pragma unroll
        for (int i = 0; i < NR; i++) {
            float g = warp_sum(ag[i]) * s, u = warp_sum(au[i]) * s;
            if (lane == 0 && rows[i] >= 0) ((float*)p.h)[slot * p.d_ff + first + i] = swiglu(g, u);
        }
    }
};

// Where moe_gate_up's x loads go against the ids' barrier and the weights' loads, measured per
// kernel (docs/performance.md):
// X_BESIDE_IDS (the Q4_0 kernels): x's loads before the ids' barrier, their round trip beside
// the ids' (the barrier keeps them ahead of the weights'): +0.9% on Q4_0.
// X_SUM_FIRST (moe_gate_up_q4_k): x's loads after the barrier, the weights' after x has come --
// pinned there by making the expert id depend on the lane's sum of x^2. ptxas had chosen an
// order like it by itself (the weights after the warp's sum); each change that let it issue the
// weights first (x before the barrier, x after the weights, 32-bit aux offsets) cost Q4_K_M 4%.
// Pinned on the warp's sum, the 32-bit aux offsets measured +0.8%; on the lane's, +0.4% more.
enum XOrder { X_BESIDE_IDS, X_SUM_FIRST };

// smem: red [36], then the input's quantised groups (the host gives k % 32 == 0, <= 2048);
// `gs`: the norm weights (stage_norm); `in`: x's loads, issued already with X_BESIDE_IDS. A grid
// narrower than the slot's units (step/modes.rs gate_up_cols: the blocks the device keeps resident,
// or a share of them) walks them: the block's later units reuse its expert and quantised
// input, so they cost their weights' round trip and dots, not a block's start, the norm
// weights', the ids' and the input's round trips again.
template <int NR, XOrder X_ORDER, class Rows>
__device__ __forceinline__ void gate_up_staged(const GateUpParams& p, float* smem, const float* gs, XgIn<>& in, int e,
                                               Unit u) {
    int lane = threadIdx.x & 31;
    if (X_ORDER == X_SUM_FIRST) {
        in.load((const float*)p.xn, gs, p.gate.k);
        // A sum of squares is never negative (NaN compares false): e is unchanged, but the
        // weights' addresses now wait for x.
        e += in.own_sum() < 0.f;
    }
    GateUpUnit<NR, Rows> unit;
    unit.load(p, e, u, lane);
    int rows = (blockDim.x >> 5) * NR;  // a unit's
    u32* qx = (u32*)(smem + 36);
    float s = in.quant(qx, gs, p.gate.k, p.eps, smem);
    tl_mark(TL_X);
    // A walker's second unit into L2 once the input is staged: its loads then cost an L2 round
    // trip after this unit's dots, not a DRAM one (+0.3% Q4_K_M, Q4_0 level). Issued beside
    // this unit's own loads instead (the same burst) it cost 2.3% / 6.2% (docs/performance.md).
    if ((u.x + (int)gridDim.x) * rows < p.d_ff) GateUpUnit<NR, Rows>::prefetch(p, e, Unit{u.x + (int)gridDim.x, u.y, u.nx}, lane);
    unit.finish(p, qx, s, lane);
    tl_mark(TL_MID);
    for (int x = u.x + gridDim.x; x * rows < p.d_ff; x += gridDim.x) {
        GateUpUnit<NR, Rows> next;
        next.load(p, e, Unit{x, u.y, u.nx}, lane);
        next.finish(p, qx, s, lane);
    }
    tl_mark(TL_END);
}

// The expert of the block's slot (grid (ceil(d_ff / rows per block) or fewer, n_used)).
__device__ __forceinline__ int slot_expert(const GateUpParams& p, float* smem) {
    int* ids;
    float* ws;
    block_experts(p.experts, smem, ids, ws);
    return ids[blockIdx.y];
}

// The norm weights into shared memory (n floats, n % 4 == 0), before pdl_wait; slot_expert's
// barrier publishes them.
__device__ __forceinline__ void stage_norm(float* gs, const float* g, int n) {
    for (int i = threadIdx.x; i < n >> 2; i += blockDim.x) ((float4*)gs)[i] = ((const float4*)g)[i];
}

// One kernel per staged mode, as matvec's. 4 blocks per SM (<= 64 registers, no more spills
// than at 3): one staged row a warp gives 768 units for Qwen3-30B-A3B, on the 528 blocks the
// H200 keeps resident (Q4_0) or 7/8 of them (Q4_K: step/modes.rs gate_up_share), walked by
// gate_up_staged.
// X_ORDER: where x's loads go (gate_up_staged).
// Dynamic smem: smem_x(k), the experts (64 floats at experts.scratch), then the norm weights.
#define GATE_UP_KERNEL(name, NR, X_ORDER, ...)                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4) name(const GateUpParams p) {           \
        extern __shared__ __align__(16) float smem[];                                           \
        float* gs = smem + p.experts.scratch + 64;                                              \
        stage_norm(gs, (const float*)p.norm, p.gate.k);                                         \
        pdl_start();                                                                            \
        XgIn<> in;                                                                              \
        if (X_ORDER == X_BESIDE_IDS) in.load((const float*)p.xn, gs, p.gate.k);                 \
        gate_up_staged<NR, X_ORDER, __VA_ARGS__>(p, smem, gs, in, slot_expert(p, smem), this_unit()); \
    }
GATE_UP_KERNEL(moe_gate_up_q4_0_1, 2, X_BESIDE_IDS, Q4_0Rows<2, 1>)
GATE_UP_KERNEL(moe_gate_up_q4_0_2, 1, X_BESIDE_IDS, Q4_0Rows<1, 2>)
GATE_UP_KERNEL(moe_gate_up_q4_k, 1, X_SUM_FIRST, Q4_KRowsAux32<1, 2>)

// The generic mode: row by row, any type.
extern "C" __global__ void __launch_bounds__(256, 4) moe_gate_up(const GateUpParams p) {
    extern __shared__ __align__(16) float xs[];
    pdl_start();
    int e = slot_expert(p, xs), slot = blockIdx.y;
    load_x(xs, (const float*)p.xn, p.gate.k, 0, 0.f, 0);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int first = (blockIdx.x * nwarps + warp) * p.rows_per_warp;
    for (int r = first; r < first + p.rows_per_warp && r < p.d_ff; r++) {
        u64 row = (u64)e * p.d_ff + r;
        float g = row_dot(p.gate, row, xs, lane);
        float up = row_dot(p.up, row, xs, lane);
        if (lane == 0) ((float*)p.h)[slot * p.d_ff + r] = swiglu(g, up);
    }
}

struct DownParams {
    QW down;     // expert e's row r is row e*d_model + r; k = d_ff
    u64 h;       // const float* [n_used, d_ff]
    u64 x;       // const float* [d_model], the residual after attention (the staged modes read
                 // it before pdl_wait)
    u64 out;     // float* [d_model]: x + the experts' sums; x itself without the fold (step/moe.rs
                 // residual: fold_weights reads all of x before the wait)
    u64 slots;   // the folded router's slots [n_expert] (RouterFold; experts.weights then holds
                 // the chosen ones', fold_weights), or 0: experts.weights are the weights
    Experts experts;
    int d_model;
    int n_used;
    int rows_per_warp;
    int n_expert;
    int norm_topk;
    float eps;
};
SIZE_IS(DownParams, 104); FIELD_AT(DownParams, down, 0); FIELD_AT(DownParams, h, 24);
FIELD_AT(DownParams, x, 32); FIELD_AT(DownParams, out, 40); FIELD_AT(DownParams, slots, 48);
FIELD_AT(DownParams, experts, 56); FIELD_AT(DownParams, d_model, 80); FIELD_AT(DownParams, n_used, 84);
FIELD_AT(DownParams, rows_per_warp, 88); FIELD_AT(DownParams, n_expert, 92);
FIELD_AT(DownParams, norm_topk, 96); FIELD_AT(DownParams, eps, 100);

// softmax(s * logits) at the chosen experts, whose unscaled logits `ws` holds in rank order,
// renormalised over them with norm_topk, in place (warp 0; ends with a barrier). Without
// norm_topk the denominator takes every logit from the router's slots (RouterFold::slots).
__device__ __forceinline__ void chosen_weights(float* ws, float s, const u64* slots, int n_used, int n_expert, int norm_topk) {
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        float top = ws[0];
        float e = lane < n_used ? expf(s * (ws[lane] - top)) : 0.f;
        float den = 0.f;
        if (norm_topk) den = e;
        else
            for (int j = lane; j < n_expert; j += 32) den += expf(s * (__uint_as_float((u32)__ldcg(slots + j)) - top));
        den = warp_sum(den);
        if (lane < n_used) ws[lane] = e / den;
    }
    __syncthreads();
}

// The residual x' (d_model <= 8 * blockDim floats, the fold's bound) a thread's float4s
// threadIdx.x + j * blockDim.x, through L2 (o_proj wrote it two launches back), all in flight
// at once. DOWN_KERNEL issues them with the experts' ids, before the ids' barrier.
struct FoldX {
    float4 v[2];
    __device__ __forceinline__ void load(const DownParams& p) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int i = threadIdx.x + j * blockDim.x;
            v[j] = p.slots && i < p.d_model >> 2 ? __ldcg((const float4*)p.x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
};

// The folded router's weights of the chosen experts from their unscaled logits (already in
// `ws`, rank order) and s = rsqrt(mean(x'^2) + eps) of the residual o_proj wrote two launches
// back (chosen_weights), which no moe_down block writes (DownParams::out). Before pdl_wait;
// moe_down's blocks find no room until moe_gate_up's leave, so this is on the step's chain for
// the late ones: x' comes in with the ids (FoldX), not after them in a loop of two dependent
// round trips as before. `red`: 32 floats of shared memory.
__device__ __forceinline__ void fold_weights(const DownParams& p, const FoldX& x, float* ws, float* red) {
    warp_partial(dot4(x.v[0], x.v[0]) + dot4(x.v[1], x.v[1]), red);
    __syncthreads();
    chosen_weights(ws, rms_factor(red, p.d_model, p.eps), (const u64*)p.slots, p.n_used, p.n_expert, p.norm_topk);
}

// Stages h [n_used, dff] in shared memory at `dst` as quantised groups, slot after slot (group
// f = slot * dff / 32 + block), float4 loads issued LOAD_V * 2 at a time per thread (dff is a
// multiple of 32).
__device__ __forceinline__ void stage_slots(const float* h, int n_used, int dff, u32* dst) {
    int nv = n_used * dff >> 2;
    const float4* h4 = (const float4*)h;
    for (int base = 0; base < nv; base += 2 * LOAD_V * blockDim.x) {
        float4 v[2 * LOAD_V];
#pragma unroll
        for (int j = 0; j < 2 * LOAD_V; j++) {
            int i = base + threadIdx.x + j * blockDim.x;
            v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < nv) v[j] = h4[i];
        }
        if (base == 0) tl_mark_after(TL_IN, v[0].x);
#pragma unroll
        for (int j = 0; j < 2 * LOAD_V; j++) {
            if (base + j * (int)blockDim.x >= nv) break;  // no lane has values here
            int i = base + threadIdx.x + j * blockDim.x;
            quant_store(dst, i, v[j], i < nv);
        }
    }
    __syncthreads();
}

// h in shared memory as quantised groups, once the predecessor (moe_gate_up, which writes h)
// has finished. Its own predecessor wrote the router's results, so the DOWN_KERNELs take the
// experts and the staged paths issue their weight loads before this.
__device__ __forceinline__ void stage_h(const DownParams& p, u32* hq) {
    pdl_start();
    stage_slots((const float*)p.h, p.n_used, p.down.k, hq);
}

// Flattened pieces: every (slot, block) of a row is one lane piece, so all lanes are busy and
// all slots' loads are in flight at once. Split-type piece f: slot f / nb, block f % nb. NR rows
// a warp of the unit's, their weights and residual rows loaded first (the residual was written
// three launches back), then the dots against h's quantised groups, weighted by the chosen
// experts' weights `sw`.
template <int NR, int CH, class P>
struct DownRows {
    P piece[NR][CH];
    float prev[NR];
    int first;
    __device__ __forceinline__ void load(const DownParams& p, const int* ids, Unit u, int lane) {
        first = (u.x * (int)(blockDim.x >> 5) + (int)(threadIdx.x >> 5)) * NR;
        int nb = p.down.k >> 5, items = p.n_used * nb;
        float inv_nb = __fdividef(1.f, (float)nb);
#pragma unroll
        for (int i = 0; i < NR; i++) prev[i] = lane == 0 && first + i < p.d_model ? __ldcg((const float*)p.x + first + i) : 0.f;
        // Pieces past `items` and rows past d_model load a valid piece that finish skips:
        // straight-line code, so the pieces' ids, addresses and loads interleave (a branch a
        // piece kept them apart).
#pragma unroll
        for (int j = 0; j < CH; j++) {
            int f = min(lane + 32 * j, items - 1), s = floor_div_small(f, inv_nb), b = f - s * nb;
            u64 e = (u64)ids[s];
#pragma unroll
            for (int i = 0; i < NR; i++) piece[i][j].load(p.down, (e * p.d_model + min(first + i, p.d_model - 1)) * nb + b);
        }
    }
    __device__ __forceinline__ void finish(const DownParams& p, const u32* hq, const float* sw, int lane) {
        int nb = p.down.k >> 5, items = p.n_used * nb;
        float inv_nb = __fdividef(1.f, (float)nb), acc[NR];
#pragma unroll
        for (int i = 0; i < NR; i++) acc[i] = 0.f;
#pragma unroll
        for (int j = 0; j < CH; j++) {
            int f = lane + 32 * j;
            if (f < items) {
                int s = floor_div_small(f, inv_nb);
                const u32* x = hq + f * QXW;  // group f: slot s, block f - s * nb
#pragma unroll
                for (int i = 0; i < NR; i++) acc[i] += sw[s] * piece[i][j].dot(x);
            }
        }
#pragma unroll
        for (int i = 0; i < NR; i++) {
            float v = warp_sum(acc[i]);
            if (lane == 0 && first + i < p.d_model) ((float*)p.out)[first + i] = prev[i] + v;
        }
    }
};

template <int NR, int CH, class P>
__device__ __forceinline__ void down_blocks(const DownParams& p, u32* hq, const int* ids, float* sw, const FoldX& x, Unit u) {
    int lane = threadIdx.x & 31;
    DownRows<NR, CH, P> rows;
    rows.load(p, ids, u, lane);
    if (p.slots) fold_weights(p, x, sw, sw + 64);  // the loads above in flight meanwhile
    stage_h(p, hq);
    tl_mark(TL_X);
    rows.finish(p, hq, sw, lane);
    tl_mark(TL_END);
}

// grid ceil(d_model / rows per block); dynamic smem n_used * plen floats of h, then the
// experts (Experts::scratch: 64 floats, and 32 more for fold_weights). The staged modes (CH
// pieces of type P a lane: 2, 6 or 8 for items <= 64 / 192 / 256) issue their weight loads
// first, then stage h (stage_h). One kernel per staged mode, as matvec's.
#define DOWN_KERNEL(name, CH, P)                                                          \
    extern "C" __global__ void name(const DownParams p) {                                 \
        extern __shared__ __align__(16) float smem[];                                     \
        int* ids;                                                                         \
        float* ws;                                                                        \
        FoldX x;                                                                          \
        x.load(p);                                                                        \
        block_experts(p.experts, smem, ids, ws); /* before pdl_wait */                    \
        down_blocks<1, CH, P>(p, (u32*)smem, ids, ws, x, this_unit());                    \
    }
DOWN_KERNEL(moe_down_q4_0_2, 2, Q4_0Piece)
DOWN_KERNEL(moe_down_q4_0_6, 6, Q4_0Piece)
DOWN_KERNEL(moe_down_q4_0_8, 8, Q4_0Piece)
DOWN_KERNEL(moe_down_q4_k_2, 2, Q4_KPieceT<true>)
DOWN_KERNEL(moe_down_q4_k_6, 6, Q4_KPieceT<true>)
DOWN_KERNEL(moe_down_q4_k_8, 8, Q4_KPieceT<true>)
DOWN_KERNEL(moe_down_q6_k_2, 2, Q6_KPiece)
DOWN_KERNEL(moe_down_q6_k_6, 6, Q6_KPiece)
DOWN_KERNEL(moe_down_q6_k_8, 8, Q6_KPiece)

// The generic mode: row by row, the slots summed in order.
extern "C" __global__ void moe_down(const DownParams p) {
    extern __shared__ __align__(16) float smem[];
    int dff = p.down.k, plen = padded_len(dff) - XS;
    int* ids;
    float* ws;
    block_experts(p.experts, smem, ids, ws);
    pdl_start();
    for (int s = 0; s < p.n_used; s++)
        for (int i = threadIdx.x; i < dff; i += blockDim.x)
            smem[s * plen + pad_idx(i)] = ((const float*)p.h)[s * dff + i];
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int first = (blockIdx.x * nwarps + warp) * p.rows_per_warp;
    for (int r = first; r < first + p.rows_per_warp && r < p.d_model; r++) {
        float acc = 0.f;
        for (int s = 0; s < p.n_used; s++) acc += ws[s] * row_dot(p.down, (u64)ids[s] * p.d_model + r, smem + s * plen, lane);
        if (lane == 0) ((float*)p.out)[r] = ((const float*)p.x)[r] + acc;
    }
}
