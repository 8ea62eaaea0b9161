// Per-head RMSNorm + RoPE (NeoX, rotate-half) + KV append, then flash-decoding attention:
// the KV sequence is split in fixed chunks across blocks, each writing (max, sum, acc), and a
// combine kernel merges the chunks in order.
struct RopeParams {
    u64 qkv;      // const float* [q_dim + 2*kv_dim]
    u64 q_out;    // float* [q_dim]
    u64 q_norm;   // const float* [head_dim]
    u64 k_norm;   // const float* [head_dim]
    u64 k_cache;  // float* [capacity, kv_dim] (this layer)
    u64 v_cache;  // float* [capacity, kv_dim]
    u64 state;    // const StepState*
    int n_head;
    int n_kv_head;
    int head_dim;
    float eps;
    float theta;
};

// grid = n_head + n_kv_head blocks, head_dim threads.
extern "C" __global__ void qk_norm_rope(const RopeParams p) {
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
    float r = rsqrtf(ss / (float)hd + p.eps);
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
        ((float*)p.k_cache)[off] = o;
        ((float*)p.v_cache)[off] = src[kv_dim + t];
    }
}

// Small chunks: each block's loop over positions is latency-bound, so many short blocks win.
#define ATT_CHUNK 64
struct AttnParams {
    u64 q;        // const float* [q_dim]
    u64 k_cache;  // const float* [capacity, kv_dim]
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

// grid (n_head, n_split), 128 threads. Chunks past the sequence write an empty partial.
extern "C" __global__ void attn_split(const AttnParams p) {
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
    const float* kc = (const float*)p.k_cache + kvh * hd;
    for (int t = start + warp; t < end; t += nw) {
        const float* kr = kc + (u64)t * kv_dim;
        float a = 0.f;
        for (int d = lane; d < hd; d += 32) a += qs[d] * kr[d];
        a = warp_sum(a);
        if (lane == 0) sc[t - start] = a * p.scale;
    }
    __syncthreads();
    int n = end - start;
    // Max in a fixed order by warp 0 (deterministic), then exponentials.
    if (warp == 0) {
        float m = -INFINITY;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, sc[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        if (lane == 0) red[0] = m;
    }
    __syncthreads();
    float m = red[0];
    __syncthreads();
    float l = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float e = expf(sc[i] - m); sc[i] = e; l += e; }
    l = block_sum(l, red);
    const float* vc = (const float*)p.v_cache + kvh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int i = 0; i < n; i++) acc += sc[i] * vc[(u64)(start + i) * kv_dim + d];
        part[2 + d] = acc;
    }
    if (threadIdx.x == 0) { part[0] = m; part[1] = l; }
}

// grid n_head, head_dim threads: merges the chunks that hold positions, in index order.
extern "C" __global__ void attn_combine(const AttnParams p) {
    int h = blockIdx.x, d = threadIdx.x, hd = p.head_dim;
    int len = (int)((const StepState*)p.state)->pos + 1;
    int n_active = min(p.n_split, (len + ATT_CHUNK - 1) / ATT_CHUNK);
    const float* base = (const float*)p.part + (u64)h * p.n_split * (hd + 2);
    float m = -INFINITY;
    for (int s = 0; s < n_active; s++) m = fmaxf(m, base[s * (hd + 2)]);
    float l = 0.f, acc = 0.f;
    for (int s = 0; s < n_active; s++) {
        const float* pt = base + s * (hd + 2);
        float f = expf(pt[0] - m);
        l += f * pt[1];
        acc += f * pt[2 + d];
    }
    ((float*)p.out)[h * hd + d] = acc / l;
}
