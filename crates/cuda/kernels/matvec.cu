// Matrix-vector products over quantised rows: QKV (3 matrices, one launch), o_proj with the
// residual add, the router and the output head. A warp owns whole rows, so each output is
// reduced in one fixed order (deterministic, no atomics).
struct MatvecParams {
    QW w[3];          // up to three matrices whose rows are concatenated in the output space
    u64 out[3];       // float* per matrix
    u64 in;           // const float* [k]
    u64 norm;         // const float* [k] RMSNorm weight, or 0 for none
    u64 xn_out;       // float* [k]: block 0 stores the normalised input here (0 = don't)
    int rows[3];
    int n_w;
    int k;
    int accumulate;   // out += result (residual add) instead of out = result
    int rows_per_warp;
    float eps;
};

extern "C" __global__ void matvec(const MatvecParams p) {
    extern __shared__ float smem[];
    float* red = smem;            // [33]
    float* xs = smem + 33;        // padded [k]
    load_x(xs, (const float*)p.in, p.k, (const float*)p.norm, p.eps, red);
    if (p.xn_out && blockIdx.x == 0)
        for (int i = threadIdx.x; i < p.k; i += blockDim.x) ((float*)p.xn_out)[i] = xs[pad_idx(i)];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int total = p.rows[0] + p.rows[1] + p.rows[2];
    int first = (blockIdx.x * nwarps + warp) * p.rows_per_warp;
    for (int r = first; r < first + p.rows_per_warp && r < total; r++) {
        int m = 0, rr = r;
        while (m < p.n_w - 1 && rr >= p.rows[m]) { rr -= p.rows[m]; m++; }
        float v = row_dot(p.w[m], (u64)rr, xs, lane);
        if (lane == 0) {
            float* o = (float*)p.out[m] + rr;
            *o = p.accumulate ? *o + v : v;
        }
    }
}

// Embedding look-up of the step's token: x = row `state.token` of the embedding matrix.
struct EmbedParams {
    QW w;
    u64 state;  // StepState*
    u64 x;      // float* [k]
};

extern "C" __global__ void embed(const EmbedParams p) {
    u32 tok = ((const StepState*)p.state)->token;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.w.k; i += gridDim.x * blockDim.x)
        ((float*)p.x)[i] = weight_at(p.w, (u64)tok, i);
}
