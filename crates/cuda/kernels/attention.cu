// The KV cache's element type: f16 where Device::new passes -DKV_F16 (the default: half the
// bytes a position, what long contexts are bound by), else f32. Stores round to nearest even,
// as the CPU backend's cache does. A lane's 4 values of a K or V row travel as kv4 (8 or 16
// bytes) and are widened where they are used.
#ifdef KV_F16
typedef u16 kv_t;
typedef uint2 kv4;
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float kv_get(kv_t v) { return h2f(v); }
__device__ __forceinline__ kv_t kv_put(float f) { return f2h(f); }
__device__ __forceinline__ float4 kv_f4(kv4 v) {
    return make_float4(h2f((u16)v.x), h2f((u16)(v.x >> 16)), h2f((u16)v.y), h2f((u16)(v.y >> 16)));
}
__device__ __forceinline__ kv4 kv_pack(float4 f) {
    return make_uint2(f2h(f.x) | (u32)f2h(f.y) << 16, f2h(f.z) | (u32)f2h(f.w) << 16);
}
__device__ __forceinline__ kv4 kv_zero() { return make_uint2(0u, 0u); }
#else
typedef float kv_t;
typedef float4 kv4;
__device__ __forceinline__ float kv_get(kv_t v) { return v; }
__device__ __forceinline__ kv_t kv_put(float f) { return f; }
__device__ __forceinline__ float4 kv_f4(kv4 v) { return v; }
__device__ __forceinline__ kv4 kv_pack(float4 f) { return f; }
__device__ __forceinline__ kv4 kv_zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
#endif

// Per-head RMSNorm + RoPE (NeoX, rotate-half) + KV append, then flash-decoding attention:
// the KV sequence is split in fixed chunks across blocks, each writing (max, sum, acc), and a
// combine kernel merges the chunks in order.
struct RopeParams {
    u64 qkv;      // const float* [q_dim + 2*kv_dim]
    u64 q_out;    // float* [q_dim]
    u64 q_norm;   // const float* [head_dim]
    u64 k_norm;   // const float* [head_dim]
    u64 k_cache;  // kv_t* [capacity, kv_dim] (this layer)
    u64 v_cache;  // kv_t* [capacity, kv_dim]
    u64 state;    // const StepState*
    int n_head;
    int n_kv_head;
    int head_dim;
    float eps;
    float theta;
};
SIZE_IS(RopeParams, 80); FIELD_AT(RopeParams, qkv, 0); FIELD_AT(RopeParams, q_out, 8);
FIELD_AT(RopeParams, q_norm, 16); FIELD_AT(RopeParams, k_norm, 24); FIELD_AT(RopeParams, k_cache, 32);
FIELD_AT(RopeParams, v_cache, 40); FIELD_AT(RopeParams, state, 48); FIELD_AT(RopeParams, n_head, 56);
FIELD_AT(RopeParams, n_kv_head, 60); FIELD_AT(RopeParams, head_dim, 64); FIELD_AT(RopeParams, eps, 68);
FIELD_AT(RopeParams, theta, 72);

// A head's RMS factor from its whole sum of squares (Qwen3's per-head q / k norm).
__device__ __forceinline__ float head_rms(float ss, int hd, float eps) { return rsqrtf(ss / (float)hd + eps); }

// Head blockIdx.x (queries first, then keys) of one token; head_dim threads.
__device__ __forceinline__ void qk_norm_rope_head(const RopeParams& p) {
    __shared__ float red[33];
    __shared__ float v[512];
    int h = blockIdx.x, t = threadIdx.x, hd = p.head_dim, half = hd / 2;
    bool is_q = h < p.n_head;
    int kvh = h - p.n_head;
    int q_dim = p.n_head * hd, kv_dim = p.n_kv_head * hd;
    u32 pos = ((const StepState*)p.state)->pos;
    const float* src = (const float*)p.qkv + (is_q ? h * hd : q_dim + kvh * hd);
    float x = src[t];
    float ss = block_sum(x * x, red);
    float r = head_rms(ss, hd, p.eps);
    v[t] = x * r * ((const float*)(is_q ? p.q_norm : p.k_norm))[t];
    __syncthreads();
    int i = t < half ? t : t - half;
    float freq = powf(p.theta, -2.0f * (float)i / (float)hd);
    float s, c;
    sincosf((float)pos * freq, &s, &c);
    float x0 = v[i], x1 = v[i + half];
    float o = t < half ? x0 * c - x1 * s : x0 * s + x1 * c;
    if (is_q) {
        ((float*)p.q_out)[h * hd + t] = o;
    } else {
        u64 off = (u64)pos * kv_dim + kvh * hd + t;
        ((kv_t*)p.k_cache)[off] = kv_put(o);
        ((kv_t*)p.v_cache)[off] = kv_put(src[kv_dim + t]);
    }
}

// grid = n_head + n_kv_head blocks, head_dim threads.
extern "C" __global__ void qk_norm_rope(const RopeParams p) {
    pdl_start();
    qk_norm_rope_head(p);
}

// Small chunks: each block's loop over positions is latency-bound, so many short blocks win.
#define ATT_CHUNK 32
struct AttnParams {
    u64 q;        // const float* [q_dim]
    u64 k_cache;  // const kv_t* [capacity, kv_dim]
    u64 v_cache;
    u64 part;     // float* [n_head, n_split, head_dim + 2]
    u64 out;      // float* [q_dim]
    u64 state;
    int n_head;
    int n_kv_head;
    int head_dim;
    int n_split;
    float scale;
};
SIZE_IS(AttnParams, 72); FIELD_AT(AttnParams, q, 0); FIELD_AT(AttnParams, k_cache, 8);
FIELD_AT(AttnParams, v_cache, 16); FIELD_AT(AttnParams, part, 24); FIELD_AT(AttnParams, out, 32);
FIELD_AT(AttnParams, state, 40); FIELD_AT(AttnParams, n_head, 48); FIELD_AT(AttnParams, n_kv_head, 52);
FIELD_AT(AttnParams, head_dim, 56); FIELD_AT(AttnParams, n_split, 60); FIELD_AT(AttnParams, scale, 64);

// Chunk blockIdx.y of head blockIdx.x; 128 threads. Chunks past the sequence write an empty
// partial.
__device__ __forceinline__ void attn_split_chunk(const AttnParams& p) {
    __shared__ float qs[512];
    __shared__ float sc[ATT_CHUNK];
    __shared__ float red[33];
    int h = blockIdx.x, s = blockIdx.y, hd = p.head_dim;
    int kvh = h / (p.n_head / p.n_kv_head), kv_dim = p.n_kv_head * hd;
    int len = (int)((const StepState*)p.state)->pos + 1;
    int start = s * ATT_CHUNK, end = min(start + ATT_CHUNK, len);
    float* part = (float*)p.part + ((u64)h * p.n_split + s) * (hd + 2);
    if (start >= len) {
        if (threadIdx.x == 0) { part[0] = -INFINITY; part[1] = 0.f; }
        return;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = ((const float*)p.q)[h * hd + d];
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const kv_t* kc = (const kv_t*)p.k_cache + kvh * hd;
    for (int t = start + warp; t < end; t += nw) {
        const kv_t* kr = kc + (u64)t * kv_dim;
        float a = 0.f;
        for (int d = lane; d < hd; d += 32) a += qs[d] * kv_get(kr[d]);
        a = warp_sum(a);
        if (lane == 0) sc[t - start] = a * p.scale;
    }
    __syncthreads();
    int n = end - start;
    // Max in a fixed order by warp 0 (deterministic), then exponentials.
    if (warp == 0) {
        float m = -INFINITY;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, sc[i]);
        m = warp_max(m);
        if (lane == 0) red[0] = m;
    }
    __syncthreads();
    float m = red[0];
    __syncthreads();
    float l = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float e = expf(sc[i] - m); sc[i] = e; l += e; }
    l = block_sum(l, red);
    const kv_t* vc = (const kv_t*)p.v_cache + kvh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int i = 0; i < n; i++) acc += sc[i] * kv_get(vc[(u64)(start + i) * kv_dim + d]);
        part[2 + d] = acc;
    }
    if (threadIdx.x == 0) { part[0] = m; part[1] = l; }
}

// grid (n_head, n_split), 128 threads.
extern "C" __global__ void attn_split(const AttnParams p) {
    pdl_start();
    attn_split_chunk(p);
}

// grid n_head, head_dim threads: merges the chunks that hold positions, in index order.
__device__ __forceinline__ void attn_combine_unit(const AttnParams& p, Unit u) {
    int h = u.x, d = threadIdx.x, hd = p.head_dim;
    if (d >= hd) return;
    int len = (int)((const StepState*)p.state)->pos + 1;
    int n_active = min(p.n_split, (len + ATT_CHUNK - 1) / ATT_CHUNK);
    const float* base = (const float*)p.part + (u64)h * p.n_split * (hd + 2);
    // Unrolled so several chunks' loads are in flight (a rolled loop waits one L2 round trip
    // per chunk: 64 of them at 4,096 positions).
    float m = -INFINITY;
#pragma unroll 8
    for (int s = 0; s < n_active; s++) m = fmaxf(m, base[s * (hd + 2)]);
    float l = 0.f, acc = 0.f;
#pragma unroll 8
    for (int s = 0; s < n_active; s++) {
        const float* pt = base + s * (hd + 2);
        float f = expf(pt[0] - m);
        l += f * pt[1];
        acc += f * pt[2 + d];
    }
    ((float*)p.out)[h * hd + d] = acc / l;
}

extern "C" __global__ void attn_combine(const AttnParams p) {
    pdl_start();
    attn_combine_unit(p, this_unit());
}

// Grouped-query attention with the per-head RMSNorm + RoPE + KV append fused in: one block per
// (KV head, chunk) serves all G <= 8 query heads of the group, so K/V are read once. 8 warps; a
// warp owns positions w, w+8, .. of the chunk (its K and V rows are loaded in one go, a lane
// holds 4 dims), queries live in shared memory, heads past G are zero padding. Partials use
// attn_split's layout; the last chunk of a KV head to finish merges them (attn_gqa_merge), so
// the launch path needs no attn_combine.
struct AttnGqaParams {
    u64 qkv;      // const float* [q_dim + 2*kv_dim] (raw projections)
    u64 q_norm;   // const float* [head_dim]
    u64 k_norm;   // const float* [head_dim]
    u64 k_cache;  // kv_t* [capacity, kv_dim] (this layer)
    u64 v_cache;
    u64 part;     // float* [n_head, n_split, head_dim + 2]
    u64 state;    // const StepState*
    u64 out;      // float* [q_dim] (attn_gqa only)
    u64 done;     // u32* [n_kv_head + n_head] chunks finished per KV head, then each head's
                  // maximum key; 0 between launches (attn_gqa only)
    int n_head;
    int n_kv_head;
    int head_dim; // multiple of 64, <= 128
    int n_split;
    float scale;
    float eps;
    float theta;
    int max_blocks;  // blocks a KV head at most (attn_gqa only): past max_blocks chunks, a block
                     // walks several, so a long context takes one wave and a short merge
    int min_span;    // chunks a block at least (attn_gqa only): the tensor-core kernel's warps
                     // take 16-position tiles, so a 32-position block leaves 6 of 8 idle
    int stage;       // tiles past its first a warp of the tensor-core kernel loads into dynamic
                     // shared memory before pdl_wait (0 elsewhere); a KV head whose positions
                     // fit one block's 8 * (1 + stage) tiles takes one block, with no merge
};
SIZE_IS(AttnGqaParams, 112); FIELD_AT(AttnGqaParams, qkv, 0); FIELD_AT(AttnGqaParams, q_norm, 8);
FIELD_AT(AttnGqaParams, k_norm, 16); FIELD_AT(AttnGqaParams, k_cache, 24);
FIELD_AT(AttnGqaParams, v_cache, 32); FIELD_AT(AttnGqaParams, part, 40); FIELD_AT(AttnGqaParams, state, 48);
FIELD_AT(AttnGqaParams, out, 56); FIELD_AT(AttnGqaParams, done, 64); FIELD_AT(AttnGqaParams, n_head, 72);
FIELD_AT(AttnGqaParams, n_kv_head, 76); FIELD_AT(AttnGqaParams, head_dim, 80);
FIELD_AT(AttnGqaParams, n_split, 84); FIELD_AT(AttnGqaParams, scale, 88); FIELD_AT(AttnGqaParams, eps, 92);
FIELD_AT(AttnGqaParams, theta, 96); FIELD_AT(AttnGqaParams, max_blocks, 100);
FIELD_AT(AttnGqaParams, min_span, 104); FIELD_AT(AttnGqaParams, stage, 108);

// RoPE angles of a lane's rotated pairs (i = lane, lane + 32) at `pos`, and its norm weights
// (dims lane, lane + 32, ..): they depend on pos and weights only, so attn_gqa takes them before
// pdl_wait.
struct LaneRope {
    float c[2], s[2];
};
__device__ __forceinline__ LaneRope lane_rope(int hd, u32 pos, float theta) {
    LaneRope r;
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 2; j++)
        if (j < hd >> 6) {
            float freq = powf(theta, -2.0f * (float)(lane + 32 * j) / (float)hd);
            sincosf((float)pos * freq, &r.s[j], &r.c[j]);
        }
    return r;
}
__device__ __forceinline__ void lane_norm(const float* nw, int hd, float (&w)[4]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 4; j++) w[j] = j < hd >> 5 ? nw[lane + 32 * j] : 0.f;
}

// A lane's 4 values of one head of hd <= 128 (lane l: dims l, l+32, ..; zeros past hd).
__device__ __forceinline__ void lane_head(const float* src, int hd, float (&v)[4]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = j < hd >> 5 ? src[lane + 32 * j] : 0.f;
}

// A lane's part of its head's sum of squares (lane_head's layout).
__device__ __forceinline__ float lane_ss(const float (&v)[4]) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) ss += v[j] * v[j];
    return ss;
}
// Scales by the head's RMS factor `r` and the lane's norm weights `nw`, then ropes, one head held
// 4 values a lane (lane_head's layout), result into dst (shared). One warp.
__device__ __forceinline__ void gqa_scale_rope(float (&v)[4], const float (&nw)[4], float* dst, int hd, const LaneRope& rp, float r) {
    int lane = threadIdx.x & 31, nj = hd >> 5, half = hd >> 1;
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (j < nj) v[j] = v[j] * r * nw[j];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        if (j < nj / 2) {
            int i = lane + 32 * j;
            float x0 = v[j], x1 = v[j + nj / 2], c = rp.c[j], s = rp.s[j];
            dst[i] = x0 * c - x1 * s;
            dst[i + half] = x0 * s + x1 * c;
        }
    }
}

struct GqaSmem {
    __align__(16) float qs[8][128];
    __align__(16) float knew[128];
    __align__(16) float vnew[128];
    float sc[8][ATT_CHUNK];
    float ml[8][2];
    float fac[8];  // each head's rescale of the running sums when a later chunk raises its maximum
    __align__(16) float red[8][8][128];
};

// One chunk [start, end) of attn_gqa_unit: its scores, then each head's running maximum and l
// (warp g, head g) and this warp's P V added into its sums (sm.red[warp], a lane's 4 dims of
// each head: shared memory, not registers, which hold two chunks' K/V rows) after rescaling
// them. The first chunk (m_run = -inf) gives fac 0 and so exactly the one-chunk sums.
template <int NP>
__device__ __forceinline__ void gqa_chunk(const AttnGqaParams& p, GqaSmem& sm, kv4 (&kr)[NP], kv4 (&vr)[NP], int start, int end, u32 pos, int hd, int G, float& m_run, float& l_run) {
    float (&qs)[8][128] = sm.qs;
    float (&sc)[8][ATT_CHUNK] = sm.sc;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The new position's K/V (produced by attn_gqa_unit) replaces its zero placeholder, as the
    // cache holds it.
#pragma unroll
    for (int i = 0; i < NP; i++)
        if (start + warp + 8 * i == (int)pos && lane * 4 < hd) {
            kr[i] = kv_pack(*(const float4*)(sm.knew + lane * 4));
            vr[i] = kv_pack(*(const float4*)(sm.vnew + lane * 4));
        }
    // Scores: 8 head partials per lane, reduced by a transposing butterfly (9 shuffles for 8
    // heads); lane 4g ends with head g's total.
#pragma unroll
    for (int i = 0; i < NP; i++) {
        int t = start + warp + 8 * i;
        float4 k = kv_f4(kr[i]);
        float a[8];
#pragma unroll
        for (int g = 0; g < 8; g++) {
            float4 q = *(const float4*)(&qs[g][lane * 4]);
            a[g] = q.x * k.x + q.y * k.y + q.z * k.z + q.w * k.w;
        }
        float b[4];
        bool hi = lane & 16;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float send = hi ? a[k] : a[k + 4];
            float keep = hi ? a[k + 4] : a[k];
            b[k] = keep + __shfl_xor_sync(0xffffffff, send, 16);
        }
        float c2[2];
        hi = lane & 8;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            float send = hi ? b[k] : b[k + 2];
            float keep = hi ? b[k + 2] : b[k];
            c2[k] = keep + __shfl_xor_sync(0xffffffff, send, 8);
        }
        hi = lane & 4;
        float z = (hi ? c2[1] : c2[0]) + __shfl_xor_sync(0xffffffff, hi ? c2[0] : c2[1], 4);
        z += __shfl_xor_sync(0xffffffff, z, 2);
        z += __shfl_xor_sync(0xffffffff, z, 1);
        if ((lane & 3) == 0 && t < end) sc[lane >> 2][t - start] = z * p.scale;
    }
    __syncthreads();
    int n = end - start;
    // Softmax statistics per head (warp g), exponentials in place; padded heads get zeros.
    {
        int g = warp;
        float m = m_run;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, sc[g][i]);
        m = warp_max(m);
        float l = 0.f;
        for (int i = lane; i < ATT_CHUNK; i += 32) {
            float e = (i < n && g < G) ? expf(sc[g][i] - m) : 0.f;
            sc[g][i] = e;
            l += e;
        }
        l = warp_sum(l);
        float f = expf(m_run - m);
        m_run = m;
        l_run = l_run * f + l;
        if (lane == 0) sm.fac[g] = f;
    }
    __syncthreads();
    // P V: this warp's positions for all heads, added to the rescaled sums.
    float4 v[NP];
#pragma unroll
    for (int i = 0; i < NP; i++) v[i] = kv_f4(vr[i]);
#pragma unroll
    for (int g = 0; g < 8; g++) {
        float4* sum = (float4*)&sm.red[warp][g][lane * 4];
        float4 acc = *sum;
        float f = sm.fac[g];
        acc.x *= f;
        acc.y *= f;
        acc.z *= f;
        acc.w *= f;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            float e = sc[g][warp + 8 * i];
            acc.x += e * v[i].x;
            acc.y += e * v[i].y;
            acc.z += e * v[i].z;
            acc.w += e * v[i].w;
        }
        *sum = acc;
    }
}

// K and V rows of a warp's positions of the chunk at `start` (4 dims a lane; zeros past hd/4,
// past `end` and at the new position, which attn_gqa_unit produces itself).
template <int NP>
__device__ __forceinline__ void gqa_load_kv(const kv_t* kc, const kv_t* vc, int kv_dim, int hd, int start, int end, u32 pos, kv4 (&kr)[NP], kv4 (&vr)[NP]) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < NP; i++) {
        int t = start + warp + 8 * i;
        kr[i] = kv_zero();
        vr[i] = kr[i];
        if (t < end && lane * 4 < hd && t != (int)pos) {
            kr[i] = __ldcg((const kv4*)(kc + (u64)t * kv_dim + lane * 4));
            vr[i] = __ldcg((const kv4*)(vc + (u64)t * kv_dim + lane * 4));
        }
    }
}

// After pdl_wait: the group's queries into qs, times `qmul` (warp g -> head g, zero padding
// past G and hd); in the block whose positions hold pos, the new K (normalised, roped) / V into
// knew / vnew and the cache, by warp 0 (with query head 0) / warp 1 (before its query). The new
// K / V rows load with the queries: one L2 round trip, not two, in the block the merge waits for.
template <int HD, int GG>
__device__ __forceinline__ void gqa_stage_new(const AttnGqaParams& p, float (&qs)[8][128], float* knew, float* vnew, int kvh, u32 pos, bool has_new, const LaneRope& rp, const float (&qn)[4], const float (&kn)[4], float qmul = 1.f) {
    int hd = HD ? HD : p.head_dim, G = GG ? GG : p.n_head / p.n_kv_head;
    int kv_dim = p.n_kv_head * hd, q_dim = p.n_head * hd;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* qkv = (const float*)p.qkv;
    float qv[4], nv[4];
    if (warp < G) lane_head(qkv + (kvh * G + warp) * hd, hd, qv);
    if (has_new && warp < 2) lane_head(qkv + q_dim + warp * kv_dim + kvh * hd, hd, nv);
    if (warp < G) tl_mark_after(TL_IN, qv[0]);
    if (warp == 1 && has_new) {  // the new V first: it waits for no reduction
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (j < hd >> 5) {
                int d = lane + 32 * j;
                vnew[d] = nv[j];
                ((kv_t*)p.v_cache)[(u64)pos * kv_dim + kvh * hd + d] = kv_put(nv[j]);
            }
    }
    if (warp == 0 && has_new) {
        // Query head 0 and the new K together: their two warp sums interleaved, not one after
        // the other on the warp the block's barrier waits for.
        float sq = lane_ss(qv), sk = lane_ss(nv);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            sq += __shfl_xor_sync(0xffffffff, sq, o);
            sk += __shfl_xor_sync(0xffffffff, sk, o);
        }
        gqa_scale_rope(qv, qn, qs[0], hd, rp, head_rms(sq, hd, p.eps) * qmul);
        gqa_scale_rope(nv, kn, knew, hd, rp, head_rms(sk, hd, p.eps));
    } else if (warp < G) gqa_scale_rope(qv, qn, qs[warp], hd, rp, head_rms(warp_sum(lane_ss(qv)), hd, p.eps) * qmul);
    else for (int d = lane; d < 128; d += 32) qs[warp][d] = 0.f;
    if (hd < 128) for (int d = hd + lane; d < 128; d += 32) qs[warp][d] = 0.f;
    if (!has_new) return;
    if (warp == 0) {
        __syncwarp();  // knew, from the branch above
        for (int d = lane; d < hd; d += 32) ((kv_t*)p.k_cache)[(u64)pos * kv_dim + kvh * hd + d] = kv_put(knew[d]);
    }
}

// grid (n_kv_head, blocks), 256 threads; block u.y holds the `span` chunks from chunk u.y * span
// (callers skip blocks past the positions: the merges read active blocks only). A chunk's
// scores and P V are folded into running per-head sums (maximum, l, acc rescaled when the
// maximum rises), so span 1 computes exactly the one-chunk partial. The first chunk's K/V rows
// (written by earlier steps, so immutable now) load before pdl_wait; each later
// chunk's load is issued before the chunk ahead of it is computed. HD / GG: head_dim and the
// group size as constants (0: read from p). `direct`: the block holds all of the KV head's
// positions, so it writes the heads' outputs (acc / l, what the merge of one partial gives bit
// for bit) instead of a partial.
template <int HD = 0, int GG = 0>
__device__ __forceinline__ void attn_gqa_unit(const AttnGqaParams& p, GqaSmem& sm, Unit u, int span, bool direct = false) {
    float (&qs)[8][128] = sm.qs;
    float* knew = sm.knew;
    float* vnew = sm.vnew;
    float (&ml)[8][2] = sm.ml;
    float (&red)[8][8][128] = sm.red;
    int kvh = u.x, s = u.y, hd = HD ? HD : p.head_dim;
    int G = GG ? GG : p.n_head / p.n_kv_head, kv_dim = p.n_kv_head * hd;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Read before pdl_wait: from L2 (ld.cg), never a line an earlier kernel left in L1.
    u32 pos = __ldcg(&((const StepState*)p.state)->pos);
    int len = (int)pos + 1;
    int first = s * span * ATT_CHUNK, last = min(first + span * ATT_CHUNK, len);
    int n_chunk = (last - first + ATT_CHUNK - 1) / ATT_CHUNK;
    // The first chunk's K and V rows load first: they do not depend on this step's projections,
    // so their DRAM latency overlaps the query norm + RoPE below.
    const kv_t* kc = (const kv_t*)p.k_cache + kvh * hd;
    const kv_t* vc = (const kv_t*)p.v_cache + kvh * hd;
    const int NP = ATT_CHUNK / 8;
    kv4 kr[NP], vr[NP];
    gqa_load_kv<NP>(kc, vc, kv_dim, hd, first, min(first + ATT_CHUNK, len), pos, kr, vr);
    LaneRope rp = lane_rope(hd, pos, p.theta);
    float qn[4], kn[4];
    lane_norm((const float*)p.q_norm, hd, qn);
    lane_norm((const float*)p.k_norm, hd, kn);
    pdl_start();
    bool has_new = (int)pos >= first && (int)pos < last;
    gqa_stage_new<HD, GG>(p, qs, knew, vnew, kvh, pos, has_new, rp, qn, kn);
#pragma unroll
    for (int g = 0; g < 8; g++) *(float4*)&red[warp][g][lane * 4] = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();
    float m_run = -INFINITY, l_run = 0.f;  // warp g's head g
#pragma unroll 1
    for (int c = 0; c < n_chunk; c++) {
        int start = first + c * ATT_CHUNK, end = min(start + ATT_CHUNK, len);
        kv4 kx[NP], vx[NP];  // the next chunk's rows, in flight while this one is computed
        if (c + 1 < n_chunk) gqa_load_kv<NP>(kc, vc, kv_dim, hd, start + ATT_CHUNK, min(start + 2 * ATT_CHUNK, len), pos, kx, vx);
        gqa_chunk(p, sm, kr, vr, start, end, pos, hd, G, m_run, l_run);
        if (c + 1 < n_chunk) {
#pragma unroll
            for (int i = 0; i < NP; i++) { kr[i] = kx[i]; vr[i] = vx[i]; }
            __syncthreads();  // sc and fac are rewritten by the next chunk
        }
    }
    if (lane == 0) { ml[warp][0] = m_run; ml[warp][1] = l_run; }
    __syncthreads();
    for (int o = threadIdx.x; o < G * hd; o += blockDim.x) {
        int g = o / hd, d = o - g * hd;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < 8; w++) v += red[w][g][d];
        if (direct) {
            ((float*)p.out)[(kvh * G + g) * hd + d] = v / ml[g][1];
            continue;
        }
        float* part = (float*)p.part + ((u64)(kvh * G + g) * p.n_split + s) * (hd + 2);
        part[2 + d] = v;
        if (d == 0) { part[0] = ml[g][0]; part[1] = ml[g][1]; }
    }
}

// Run by every block after its chunk's partials are written: each head's chunk maximum goes
// into an atomic maximum, and the block whose count completes the KV head's active chunks
// merges them with attn_combine's arithmetic per output (the same maximum, then l and acc summed
// in chunk order), warp g on head g, 4 dims a lane, so one pass of chunk loads serves 4 outputs
// and 16 chunks' loads are in flight at once. Counts and maxima return to 0 for the next launch.
// True in the merging block (its warps g < G wrote their heads' outputs).
template <int HD, int GG>
__device__ __forceinline__ bool attn_gqa_merge(const AttnGqaParams& p, const float (&ml)[8][2], int kvh, int n_act) {
    __shared__ int last;
    int G = GG ? GG : p.n_head / p.n_kv_head, hd = HD ? HD : p.head_dim, g = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32* cnt = (u32*)p.done + kvh;
    u32* mk = (u32*)p.done + p.n_kv_head + kvh * G;  // [G] maximum keys of this group's heads
    if (threadIdx.x < G) atomicMax(mk + threadIdx.x, float_key(ml[threadIdx.x][0]));
    if (!last_to_arrive(cnt, n_act, &last)) return false;  // this block's partials and maxima are visible to the last
    if (g >= G) return true;
    int h = kvh * G + g;
    const float* base = (const float*)p.part + (u64)h * p.n_split * (hd + 2);
    float m = key_float(__ldcg(mk + g));
    float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 16
    for (int s = 0; s < n_act; s++) {
        const float* pt = base + s * (hd + 2);
        float f = expf(__ldcg(pt) - m);
        l += f * __ldcg(pt + 1);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (lane + 32 * j < hd) acc[j] += f * __ldcg(pt + 2 + lane + 32 * j);
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (lane + 32 * j < hd) ((float*)p.out)[h * hd + lane + 32 * j] = acc[j] / l;
    __syncwarp();
    if (lane == 0) mk[g] = 0;
    return true;
}

// Chunks a block walks (span) and the blocks a KV head that hold positions (n_act): the grid's
// rows past n_act exit (a launch for fewer positions than it has rows to give them would lose
// positions silently: it traps instead).
struct GqaSpan {
    int span, n_act;
};
__device__ __forceinline__ GqaSpan gqa_span(const AttnGqaParams& p) {
    int len = (int)__ldcg(&((const StepState*)p.state)->pos) + 1;
    int n_chunk = (len + ATT_CHUNK - 1) / ATT_CHUNK;
    int fit = p.stage > 0 ? (1 + p.stage) * 8 * 16 / ATT_CHUNK : 0;  // chunks one block loads early
    int span = n_chunk <= fit ? n_chunk : max((n_chunk + p.max_blocks - 1) / p.max_blocks, p.min_span);
    int n_act = (n_chunk + span - 1) / span;
    if (n_act > (int)gridDim.y) __trap();  // the host sizes the grid for its positions (step/attention.rs att_grid)
    return GqaSpan{span, n_act};
}

template <int HD, int GG>
__device__ __forceinline__ void attn_gqa_blocks(const AttnGqaParams& p) {
    __shared__ GqaSmem sm;
    Unit u = this_unit();
    GqaSpan w = gqa_span(p);
    if (u.y >= w.n_act) return;  // no position here; the merge reads active blocks only
    // One block a KV head: no partial, fence, count or reload on the way to o_proj.
    attn_gqa_unit<HD, GG>(p, sm, u, w.span, w.n_act == 1);
    if (w.n_act > 1) attn_gqa_merge<HD, GG>(p, sm.ml, u.x, w.n_act);
}

extern "C" __global__ void attn_gqa(const AttnGqaParams p) { attn_gqa_blocks<0, 0>(p); }

// Qwen3-MoE's shape (head_dim 128, 8 query heads a KV head) as constants: no predicates on
// the dims, shifts for the divisions, fixed trip counts (the host picks it for that shape).
extern "C" __global__ void attn_gqa_128_8(const AttnGqaParams p) { attn_gqa_blocks<128, 8>(p); }
