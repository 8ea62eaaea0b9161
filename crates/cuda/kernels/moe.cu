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

// One warp. Picks the largest probability n_used times (lowest index wins ties).
extern "C" __global__ void moe_topk(const TopkParams p) {
    __shared__ float pr[4096];
    int lane = threadIdx.x;
    const float* lg = (const float*)p.logits;
    float m = -INFINITY;
    for (int i = lane; i < p.n_expert; i += 32) m = fmaxf(m, lg[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    float s = 0.f;
    for (int i = lane; i < p.n_expert; i += 32) { float e = expf(lg[i] - m); pr[i] = e; s += e; }
    s = warp_sum(s);
    __syncwarp();
    float chosen_sum = 0.f;
    for (int k = 0; k < p.n_used; k++) {
        float bv = -1.f;
        int bi = 0x7fffffff;
        for (int i = lane; i < p.n_expert; i += 32)
            if (pr[i] > bv) { bv = pr[i]; bi = i; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffff, bv, o);
            int oi = __shfl_xor_sync(0xffffffff, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) {
            ((int*)p.ids)[k] = bi;
            ((float*)p.weights)[k] = bv / s;
            pr[bi] = -2.f;
        }
        chosen_sum += bv / s;
        __syncwarp();
    }
    if (p.norm_topk && lane < p.n_used) ((float*)p.weights)[lane] /= chosen_sum;
}

struct GateUpParams {
    QW gate;     // rows of all experts: expert e's row r is row e*d_ff + r
    QW up;
    u64 xn;      // const float* [d_model], already normalised
    u64 ids;     // const int* [n_used]
    u64 h;       // float* [n_used, d_ff]
    int d_ff;
    int rows_per_warp;
};

// grid (ceil(d_ff / rows per block), n_used).
extern "C" __global__ void moe_gate_up(const GateUpParams p) {
    extern __shared__ float smem[];
    float* xs = smem;
    load_x(xs, (const float*)p.xn, p.gate.k, 0, 0.f, 0);
    int slot = blockIdx.y, e = ((const int*)p.ids)[slot];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int first = (blockIdx.x * nwarps + warp) * p.rows_per_warp;
    for (int r = first; r < first + p.rows_per_warp && r < p.d_ff; r++) {
        u64 row = (u64)e * p.d_ff + r;
        float g = row_dot(p.gate, row, xs, lane);
        float u = row_dot(p.up, row, xs, lane);
        if (lane == 0) ((float*)p.h)[slot * p.d_ff + r] = g / (1.f + expf(-g)) * u;
    }
}

struct DownParams {
    QW down;     // expert e's row r is row e*d_model + r; k = d_ff
    u64 h;       // const float* [n_used, d_ff]
    u64 ids;     // const int* [n_used]
    u64 weights; // const float* [n_used]
    u64 x;       // float* [d_model], residual stream (+=)
    int d_model;
    int n_used;
    int rows_per_warp;
};

// grid ceil(d_model / rows per block). The slots are summed in order for determinism.
extern "C" __global__ void moe_down(const DownParams p) {
    extern __shared__ float smem[];
    int dff = p.down.k, plen = padded_len(dff) - 33;  // d_ff is a multiple of 32
    for (int s = 0; s < p.n_used; s++)
        for (int i = threadIdx.x; i < dff; i += blockDim.x)
            smem[s * plen + pad_idx(i)] = ((const float*)p.h)[s * dff + i];
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int first = (blockIdx.x * nwarps + warp) * p.rows_per_warp;
    for (int r = first; r < first + p.rows_per_warp && r < p.d_model; r++) {
        float acc = 0.f;
        for (int s = 0; s < p.n_used; s++) {
            int e = ((const int*)p.ids)[s];
            acc += ((const float*)p.weights)[s] * row_dot(p.down, (u64)e * p.d_model + r, smem + s * plen, lane);
        }
        if (lane == 0) ((float*)p.x)[r] += acc;
    }
}
