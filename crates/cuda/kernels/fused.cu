// Every layer of the decode step as ONE persistent grid: one block per SM, grid-wide barriers
// between the phases of a layer (qkv, attention, [combine], o_proj, router, gate_up, down).
// Why: a graph of ~340 dependent launches pays launch, block scheduling and a cold weight
// fetch per kernel (NOTES.md). Here each block owns a fixed slice of every op (one round, no
// serial units) and its weights are copied into shared memory by TMA bulk copies one or two
// phases AHEAD of use: qkv/o_proj/router of layer L+1 stream in during layer L's down phase,
// the experts' gate/up and down rows as soon as top-k (computed redundantly by every block)
// names them. A phase then waits for its own copy group, not for DRAM.
// Every output is computed with the launch path's functions in the launch path's order (per
// lane, then one warp_sum), so both paths give the same bits: the parity tests require their
// token streams to be identical.
// Opt-in and slower than the graph so far (NOTES.md v9): the weights arrive in time but the
// phases' own code is slow; likely the same instruction-fetch bound Nsight Compute showed in
// the launch path, this kernel being 318 KB of SASS.
//
// Requires every block to be resident at once (host: grid = SM count, occupancy checked).

// Phases stamped per layer (Q4MOE_CUDA_STAMPS=1).
#define PH_QKV 0
#define PH_ATTN 1
#define PH_O 2
#define PH_ROUTER 3
#define PH_GATE_UP 4
#define PH_DOWN 5
#define N_PH 6

// Inline the attention combine into o_proj's prologue up to this many ATT_CHUNK-position chunks;
// past it a separate combine phase (one more barrier) reads fewer bytes per block.
#define INLINE_CHUNKS 4
#define MAX_USED 16
#define MAX_RUNS 2
#define FUSED_MAX_EXPERT 256

struct LayerDesc {
    QW q, k, v, o, router, gate, up, down;
    u64 attn_norm, q_norm, k_norm, ffn_norm;
    u64 k_cache, v_cache;  // kv_t* [capacity, kv_dim] of this layer
};

// Monotonic arrival counter: barrier i of a step waits for base + (i+1) * grid arrivals; the
// last action of a step stores its final count as the next step's base (read at start).
struct StepBar {
    u64 count;
    u64 base;
};

struct FusedParams {
    u64 layers;  // const LayerDesc* [n_layer]
    QW embd;
    u64 state;   // const StepState*
    u64 x;       // float* [d_model] residual stream
    u64 qkv;     // float* [q_dim + 2 kv_dim]
    u64 part;    // float* [n_head, n_split, head_dim + 2]
    u64 attn;    // float* [q_dim] (combine phase only)
    u64 logits;  // float* [n_expert]
    u64 h;       // float* [n_used, d_ff]
    u64 bar;     // StepBar*
    u64 stamps;  // u64* [n_layer * N_PH + 1] or 0
    int n_layer, d_model, n_head, n_kv_head, head_dim, n_split;
    int n_expert, n_used, d_ff, norm_topk;
    float eps, theta, scale;
    u32 a_off, x_off, y_off;  // byte offsets of the activation, X and Y regions in smem
};

// A staged slice of a matrix: `v` reads rows 0..n-1 (generic pointers into shared memory);
// they are rows row0.. of the global matrix.
struct SegV {
    QW v;
    long long row0;
    int n;
    int pad;
};

struct FusedPlan {
    SegV qkv[3];
    SegV o;
    SegV router;
    SegV gate[MAX_RUNS], up[MAX_RUNS];
    int run_slot[MAX_RUNS];
    int n_run;
    SegV down[MAX_USED];
    int ids[MAX_USED];
    float ws[MAX_USED];
    float pr[FUSED_MAX_EXPERT];
    float red[36];
    u64 mbar[5];  // MB_* copy groups
};
#define MB_QKV 0
#define MB_O 1
#define MB_ROUTER 2
#define MB_GATE_UP 3
#define MB_DOWN 4

// TMA bulk copies and their mbarriers need sm_90: below it step_fused is an empty stub the host
// never launches (fused.rs).
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Completion of each copy group: one mbarrier per group, one phase per layer (parity l & 1).
__device__ __forceinline__ void mbar_init(u64* m) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(m)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(u64* m, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(m)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* m, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_u32(m)), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ u32 round16(u64 n) { return (u32)((n + 15) & ~15ull); }

// Bulk (TMA) copy of [src, src + bytes) rounded out to 16 bytes to `dst` (16-aligned), issued
// by thread 0 and counted on `m`; returns src's offset in the copy. Why TMA: a few bulk copies
// per block keep ~100 KB a SM in flight where per-thread 16-byte copies are capped by the
// load unit. Tensors are 256-aligned with 256-aligned ends, so rounding stays in the
// allocation.
__device__ __forceinline__ u32 stage_bytes(u8* dst, u64 src, u64 bytes, u64* m) {
    u64 a = src & ~15ull;
    u32 delta = (u32)(src - a), n = round16(delta + bytes);
    if (threadIdx.x == 0 && n > 0)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_u32(dst)), "l"(a), "r"(n), "r"(smem_u32(m)) : "memory");
    return delta;
}

// Stages rows [row0, row0 + n) of w at dst; thread 0 stores the view in `out` (read after the
// group's mbarrier wait); returns the bytes copied.
__device__ u32 stage_rows(const QW& w, long long row0, int n, u8* dst, SegV& out, u64* m) {
    SegV s;
    s.v = w;
    s.row0 = row0;
    s.n = max(n, 0);
    s.pad = 0;
    u32 used = 0;
    if (n > 0 && split_aux(w.type)) {
        u64 nb = w.k >> 5, qb = (u64)n * nb * 16, sb = aux_bytes(w.type, (u64)n * nb);
        u32 d0 = stage_bytes(dst, w.data + row0 * nb * 16, qb, m);
        used = round16(d0 + qb);
        u32 d1 = stage_bytes(dst + used, w.scales + aux_bytes(w.type, row0 * nb), sb, m);
        s.v.data = (u64)(dst + d0);
        s.v.scales = (u64)(dst + used + d1);
        used += round16(d1 + sb);
    } else if (n > 0) {
        u64 rb = row_bytes(w.type, w.k);
        u32 d0 = stage_bytes(dst, w.data + (u64)row0 * rb, (u64)n * rb, m);
        s.v.data = (u64)(dst + d0);
        used = round16(d0 + (u64)n * rb);
    }
    if (threadIdx.x == 0) out = s;
    return used;
}

// Before a group's copies: earlier generic-proxy accesses of the region (reads of the last
// weights, attention's scratch) are ordered before the async-proxy writes.
__device__ __forceinline__ void begin_group() {
    if (threadIdx.x == 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void end_group(u64* m, u32 bytes) {
    if (threadIdx.x == 0) mbar_arrive_tx(m, bytes);
}

__device__ __forceinline__ void part_range(long long total, int b, int g, long long& lo, long long& hi) {
    lo = total * b / g;
    hi = total * (b + 1) / g;
}

__device__ __forceinline__ const LayerDesc& layer_desc(const FusedParams& p, int l) {
    return ((const LayerDesc*)p.layers)[l];
}

// qkv, o_proj and router slices of layer l into region X (groups MB_QKV, MB_O, MB_ROUTER).
__device__ void stage_attn_weights(const FusedParams& p, int l, u8* X, FusedPlan& pl) {
    const LayerDesc& L = layer_desc(p, l);
    int q_dim = p.n_head * p.head_dim, kv_dim = p.n_kv_head * p.head_dim;
    long long lo, hi;
    begin_group();
    part_range(q_dim + 2 * kv_dim, blockIdx.x, gridDim.x, lo, hi);
    const QW* m[3] = {&L.q, &L.k, &L.v};
    int start[3] = {0, q_dim, q_dim + kv_dim}, len[3] = {q_dim, kv_dim, kv_dim};
    u32 off = 0;
#pragma unroll
    for (int j = 0; j < 3; j++) {
        long long a = max(lo, (long long)start[j]), b = min(hi, (long long)(start[j] + len[j]));
        off += stage_rows(*m[j], a - start[j], (int)max(b - a, 0ll), X + off, pl.qkv[j], &pl.mbar[MB_QKV]);
    }
    end_group(&pl.mbar[MB_QKV], off);
    part_range(p.d_model, blockIdx.x, gridDim.x, lo, hi);
    u32 n = stage_rows(L.o, lo, (int)(hi - lo), X + off, pl.o, &pl.mbar[MB_O]);
    end_group(&pl.mbar[MB_O], n);
    off += n;
    part_range(p.n_expert, blockIdx.x, gridDim.x, lo, hi);
    n = stage_rows(L.router, lo, (int)(hi - lo), X + off, pl.router, &pl.mbar[MB_ROUTER]);
    end_group(&pl.mbar[MB_ROUTER], n);
}

// The selected experts' gate/up rows of this block's (slot, row) pairs into X and down rows
// into Y (groups MB_GATE_UP, MB_DOWN). Needs pl.ids.
__device__ void stage_expert_weights(const FusedParams& p, int l, u8* X, u8* Y, FusedPlan& pl) {
    const LayerDesc& L = layer_desc(p, l);
    long long lo, hi;
    begin_group();
    part_range((long long)p.n_used * p.d_ff, blockIdx.x, gridDim.x, lo, hi);
    u32 off = 0;
    int nr = 0;
    u64* m = &pl.mbar[MB_GATE_UP];
    for (long long a = lo; a < hi && nr < MAX_RUNS; nr++) {
        int slot = (int)(a / p.d_ff);
        long long b = min(hi, (long long)(slot + 1) * p.d_ff);
        long long row0 = (long long)pl.ids[slot] * p.d_ff + (a - (long long)slot * p.d_ff);
        off += stage_rows(L.gate, row0, (int)(b - a), X + off, pl.gate[nr], m);
        off += stage_rows(L.up, row0, (int)(b - a), X + off, pl.up[nr], m);
        if (threadIdx.x == 0) pl.run_slot[nr] = slot;
        a = b;
    }
    if (threadIdx.x == 0) pl.n_run = nr;
    end_group(m, off);
    part_range(p.d_model, blockIdx.x, gridDim.x, lo, hi);
    off = 0;
    m = &pl.mbar[MB_DOWN];
    for (int s = 0; s < p.n_used; s++)
        off += stage_rows(L.down, (long long)pl.ids[s] * p.d_model + lo, (int)(hi - lo), Y + off, pl.down[s], m);
    end_group(m, off);
}

__device__ __forceinline__ void bar_wait(StepBar* b, u64& target) {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(&b->count) : "memory");
        u64 c;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(&b->count) : "memory");
        } while (c < target);
    }
    __syncthreads();
}

// Block 0's clock in phase i at mark `which`: 0 start, 1 prologue done (activations in
// shared memory / copies issued), 2 weights arrived, 3 barrier reached.
#define N_MARK 4
__device__ __forceinline__ void stamp(const FusedParams& p, int i, int which) {
    if (p.stamps && blockIdx.x == 0 && threadIdx.x == 0) ((u64*)p.stamps)[N_MARK * i + which] = global_ns();
}

// Rows of up to three staged segments, warp-strided; out[j][row0 + i] (+)= dot. The same
// per-lane order and warp_sum as matvec's paths, so results match the launch path's bits.
__device__ void seg_matvec(const SegV* segs, int nseg, float* const* outs, const float* xs, bool acc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int total = 0;
    for (int j = 0; j < nseg; j++) total += segs[j].n;
    for (int t = warp; t < total; t += nw) {
        int j = 0, i = t;
        while (j < nseg - 1 && i >= segs[j].n) { i -= segs[j].n; j++; }
        float v = row_dot(segs[j].v, (u64)i, xs, lane);
        if (lane == 0) {
            float* o = outs[j] + segs[j].row0 + i;
            *o = acc ? *o + v : v;
        }
    }
}

// Router logits of this block's rows. F32 rows with k % 128 == 0, k <= 2048 use router_topk's
// float4 expression (same bits); others matvec's row_dot.
__device__ void router_rows(const SegV& sg, float* logits, const float* xs) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int k = sg.v.k, nq = k >> 7;
    bool f4 = sg.v.type == T_F32 && (k & 127) == 0 && k <= 2048;
    for (int i = warp; i < sg.n; i += nw) {
        float v;
        if (f4) {
            const float4* wr = (const float4*)((const float*)sg.v.data + (u64)i * k);
            float acc = 0.f;
            for (int j = 0; j < nq; j++) {
                float4 a = wr[lane + 32 * j], b = *(const float4*)(xs + pad_idx(4 * (lane + 32 * j)));
                acc += dot4(a, b);
            }
            v = warp_sum(acc);
        } else {
            v = row_dot(sg.v, (u64)i, xs, lane);
        }
        if (lane == 0) logits[sg.row0 + i] = v;
    }
}

// Attention output of every head into padded xs, merging <= INLINE_CHUNKS chunk partials in
// attn_combine's order. A thread takes 8 outputs of one head at a time and issues all their loads
// at once (a loop over single outputs waited one L2 round trip per output).
__device__ void combine_into(const FusedParams& p, int n_active, float* xs) {
    int hd = p.head_dim, q_dim = p.n_head * hd;
    const float* part = (const float*)p.part;
    for (int o0 = threadIdx.x * 8; o0 < q_dim; o0 += blockDim.x * 8) {
        int h = o0 / hd, d0 = o0 - h * hd;
        const float* base = part + (u64)h * p.n_split * (hd + 2);
        float2 ml[INLINE_CHUNKS], a[INLINE_CHUNKS][4];
#pragma unroll
        for (int s = 0; s < INLINE_CHUNKS; s++)
            if (s < n_active) {
                const float* pt = base + s * (hd + 2);
                ml[s] = *(const float2*)pt;
#pragma unroll
                for (int k = 0; k < 4; k++) a[s][k] = *(const float2*)(pt + 2 + d0 + 2 * k);
            }
        float m = -INFINITY;
#pragma unroll
        for (int s = 0; s < INLINE_CHUNKS; s++)
            if (s < n_active) m = fmaxf(m, ml[s].x);
        float f[INLINE_CHUNKS], l = 0.f;
#pragma unroll
        for (int s = 0; s < INLINE_CHUNKS; s++)
            if (s < n_active) {
                f[s] = expf(ml[s].x - m);
                l += f[s] * ml[s].y;
            }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float a0 = 0.f, a1 = 0.f;
#pragma unroll
            for (int s = 0; s < INLINE_CHUNKS; s++)
                if (s < n_active) {
                    a0 += f[s] * a[s][k].x;
                    a1 += f[s] * a[s][k].y;
                }
            xs[pad_idx(o0 + 2 * k)] = a0 / l;
            xs[pad_idx(o0 + 2 * k + 1)] = a1 / l;
        }
    }
    __syncthreads();
}

__device__ void attention_phase(const FusedParams& p, const LayerDesc& L, int n_active, u8* Y) {
    AttnGqaParams a;
    a.qkv = p.qkv;
    a.q_norm = L.q_norm;
    a.k_norm = L.k_norm;
    a.k_cache = L.k_cache;
    a.v_cache = L.v_cache;
    a.part = p.part;
    a.state = p.state;
    a.n_head = p.n_head;
    a.n_kv_head = p.n_kv_head;
    a.head_dim = p.head_dim;
    a.n_split = p.n_split;
    a.scale = p.scale;
    a.eps = p.eps;
    a.theta = p.theta;
    int n = p.n_kv_head * n_active;
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        attn_gqa_unit(a, *(GqaSmem*)Y, Unit{t % p.n_kv_head, t / p.n_kv_head, p.n_kv_head}, false, 1);
        __syncthreads();
    }
}

__device__ void combine_phase(const FusedParams& p) {
    AttnParams a;
    a.part = p.part;
    a.out = p.attn;
    a.state = p.state;
    a.n_head = p.n_head;
    a.n_kv_head = p.n_kv_head;
    a.head_dim = p.head_dim;
    a.n_split = p.n_split;
    for (int h = blockIdx.x; h < p.n_head; h += gridDim.x) attn_combine_unit(a, Unit{h, 0, p.n_head});
}

// h[slot, r] = silu(gate . xn) * (up . xn) for this block's pairs (one pair per warp at a time).
__device__ void gate_up_phase(const FusedParams& p, const FusedPlan& pl, const float* xs) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = 0; j < pl.n_run; j++) {
        const SegV& g = pl.gate[j];
        const SegV& u = pl.up[j];
        int slot = pl.run_slot[j];
        for (int i = warp; i < g.n; i += nw) {
            float gv = row_dot(g.v, (u64)i, xs, lane), uv = row_dot(u.v, (u64)i, xs, lane);
            long long r = g.row0 - (long long)pl.ids[slot] * p.d_ff + i;
            if (lane == 0) ((float*)p.h)[(u64)slot * p.d_ff + r] = gv / (1.f + expf(-gv)) * uv;
        }
    }
}

// down_row for split types: moe_down's down_blocks order.
template <class P>
__device__ float down_row_blocks(const FusedParams& p, const FusedPlan& pl, int i, const float* hs, int plen, int lane) {
    int nb = pl.down[0].v.k >> 5, items = p.n_used * nb;
    float acc = 0.f;
    for (int f = lane; f < items; f += 32) {
        int s = f / nb, b = f - s * nb;
        P piece;
        piece.load(pl.down[s].v, (u64)i * nb + b);
        acc += pl.ws[s] * piece.dot(hs + s * plen + b * XS);
    }
    return warp_sum(acc);
}

// One output row of down for every slot, weighted: moe_down's flattened piece order (split
// types, items <= 256: every (slot, block) piece spread over the lanes) or its generic order
// (slot by slot), so results match the launch path's bits.
__device__ float down_row(const FusedParams& p, const FusedPlan& pl, int i, const float* hs, int plen, int lane) {
    const QW& w0 = pl.down[0].v;
    if (split_aux(w0.type) && p.n_used * (w0.k >> 5) <= 256) switch (w0.type) {
        case T_Q4_0: return down_row_blocks<Q4_0Piece>(p, pl, i, hs, plen, lane);
        case T_Q4_K: return down_row_blocks<Q4_KPiece>(p, pl, i, hs, plen, lane);
        default: return down_row_blocks<Q6_KPiece>(p, pl, i, hs, plen, lane);
    }
    float acc = 0.f;
    for (int s = 0; s < p.n_used; s++) acc += pl.ws[s] * row_dot(pl.down[s].v, (u64)i, hs + s * plen, lane);
    return acc;
}

// x[r] += the weighted expert outputs for this block's rows (one row per warp at a time).
__device__ void down_phase(const FusedParams& p, const FusedPlan& pl, const float* hs, int plen) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int n = pl.down[0].n;
    for (int i = warp; i < n; i += nw) {
        float acc = down_row(p, pl, i, hs, plen, lane);
        if (lane == 0) ((float*)p.x)[pl.down[0].row0 - (long long)pl.ids[0] * p.d_model + i] += acc;
    }
}

__device__ void embed_phase(const FusedParams& p) {
    u32 tok = ((const StepState*)p.state)->token;
    long long lo, hi;
    part_range(p.d_model, blockIdx.x, gridDim.x, lo, hi);
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) ((float*)p.x)[i] = weight_at(p.embd, (u64)tok, (int)i);
}

// A phase's weights are waited for on its group's mbarrier: one phase per layer.
#define WAIT_GROUP(g) \
    do { mbar_wait(&pl.mbar[g], (u32)l & 1); } while (0)
#define MARK(ph, which) stamp(p, l * N_PH + (ph), which)

extern "C" __global__ void __launch_bounds__(256, 1) step_fused(const FusedParams p) {
    extern __shared__ __align__(16) u8 dsm[];
    __shared__ FusedPlan pl;
    float* xs = (float*)(dsm + p.a_off);
    u8* X = dsm + p.x_off;
    u8* Y = dsm + p.y_off;
    StepBar* bar = (StepBar*)p.bar;
    u64 target = __ldcg(&bar->base);
    int len = (int)((const StepState*)p.state)->pos + 1;
    int n_active = (len + ATT_CHUNK - 1) / ATT_CHUNK;
    int q_dim = p.n_head * p.head_dim, kv_dim = p.n_kv_head * p.head_dim;
    int plen = (p.d_ff >> 5) * XS;
    float* qkv_out[3] = {(float*)p.qkv, (float*)p.qkv + q_dim, (float*)p.qkv + q_dim + kv_dim};
    float* x_out[1] = {(float*)p.x};

    if (threadIdx.x == 0)
        for (int g = 0; g < 5; g++) mbar_init(&pl.mbar[g]);
    __syncthreads();
    stage_attn_weights(p, 0, X, pl);
    embed_phase(p);
    bar_wait(bar, target);
    for (int l = 0; l < p.n_layer; l++) {
        const LayerDesc& L = layer_desc(p, l);
        MARK(PH_QKV, 0);
        load_x(xs, (const float*)p.x, p.d_model, (const float*)L.attn_norm, p.eps, pl.red);
        MARK(PH_QKV, 1);
        WAIT_GROUP(MB_QKV);
        MARK(PH_QKV, 2);
        seg_matvec(pl.qkv, 3, qkv_out, xs, false);
        MARK(PH_QKV, 3);
        bar_wait(bar, target);

        MARK(PH_ATTN, 0);
        MARK(PH_ATTN, 1);
        MARK(PH_ATTN, 2);
        attention_phase(p, L, n_active, Y);
        MARK(PH_ATTN, 3);
        bar_wait(bar, target);

        MARK(PH_O, 0);
        if (n_active <= INLINE_CHUNKS) {
            combine_into(p, n_active, xs);
        } else {
            combine_phase(p);
            bar_wait(bar, target);
            load_x(xs, (const float*)p.attn, q_dim, 0, 0.f, pl.red);
        }
        MARK(PH_O, 1);
        WAIT_GROUP(MB_O);
        MARK(PH_O, 2);
        seg_matvec(&pl.o, 1, x_out, xs, true);
        MARK(PH_O, 3);
        bar_wait(bar, target);

        MARK(PH_ROUTER, 0);
        load_x(xs, (const float*)p.x, p.d_model, (const float*)L.ffn_norm, p.eps, pl.red);
        MARK(PH_ROUTER, 1);
        WAIT_GROUP(MB_ROUTER);
        MARK(PH_ROUTER, 2);
        router_rows(pl.router, (float*)p.logits, xs);
        MARK(PH_ROUTER, 3);
        bar_wait(bar, target);

        // xs still holds the normalised FFN input: the experts read it from here.
        MARK(PH_GATE_UP, 0);
        topk_block((const float*)p.logits, p.n_expert, p.n_used, p.norm_topk, pl.ids, pl.ws, pl.pr, pl.red);
        stage_expert_weights(p, l, X, Y, pl);
        MARK(PH_GATE_UP, 1);
        WAIT_GROUP(MB_GATE_UP);
        MARK(PH_GATE_UP, 2);
        gate_up_phase(p, pl, xs);
        MARK(PH_GATE_UP, 3);
        bar_wait(bar, target);

        MARK(PH_DOWN, 0);
        if (l + 1 < p.n_layer) stage_attn_weights(p, l + 1, X, pl);
        stage_slots<X_PAD>((const float*)p.h, p.n_used, p.d_ff, xs, plen);
        MARK(PH_DOWN, 1);
        WAIT_GROUP(MB_DOWN);
        MARK(PH_DOWN, 2);
        down_phase(p, pl, xs, plen);
        MARK(PH_DOWN, 3);
        if (l + 1 < p.n_layer) bar_wait(bar, target);
    }
    stamp(p, p.n_layer * N_PH, 0);
    // Every block passed the same barriers: the next step counts from here.
    if (blockIdx.x == 0 && threadIdx.x == 0) bar->base = target;
}
#else
extern "C" __global__ void step_fused(const FusedParams p) {}
#endif
