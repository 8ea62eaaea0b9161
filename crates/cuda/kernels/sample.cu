// Greedy token choice on the device: per-block arg-max, then one block merges the partials in
// order, writes the next token into the step state and advances the position.
struct ArgmaxParams {
    u64 logits;   // const float* [n]
    u64 part_v;   // float* [n_blocks]
    u64 part_i;   // int* [n_blocks]
    u64 state;    // StepState*
    int n;
    int n_blocks;
};

// Larger wins; on equal values the lower index wins; NaN never wins.
__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

__device__ void block_argmax(float& bv, int& bi, float* sv, int* si) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffff, bv, o);
        int oi = __shfl_xor_sync(0xffffffff, bi, o);
        better(bv, bi, ov, oi);
    }
    if (lane == 0) { sv[w] = bv; si[w] = bi; }
    __syncthreads();
    if (w == 0) {
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffff, bv, o);
            int oi = __shfl_xor_sync(0xffffffff, bi, o);
            better(bv, bi, ov, oi);
        }
    }
}

// `sv`, `si`: 32 floats and 32 ints of shared memory.
__device__ __forceinline__ void argmax_partial_unit(const ArgmaxParams& p, float* sv, int* si, Unit u) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    const float* lg = (const float*)p.logits;
    for (int i = u.x * blockDim.x + threadIdx.x; i < p.n; i += u.nx * blockDim.x) {
        float v = lg[i];
        if (v == v) better(bv, bi, v, i);
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) { ((float*)p.part_v)[u.x] = bv; ((int*)p.part_i)[u.x] = bi; }
}

extern "C" __global__ void argmax_partial(const ArgmaxParams p) {
    __shared__ float sv[32];
    __shared__ int si[32];
    pdl_start();
    argmax_partial_unit(p, sv, si, this_unit());
}

__device__ __forceinline__ void argmax_final_unit(const ArgmaxParams& p, float* sv, int* si) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < p.n_blocks; i += blockDim.x)
        better(bv, bi, ((const float*)p.part_v)[i], ((const int*)p.part_i)[i]);
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        StepState* st = (StepState*)p.state;
        st->token = bi == 0x7fffffff ? 0u : (u32)bi;  // all NaN: token 0, like sampling::argmax
        st->pos += 1;
    }
}

extern "C" __global__ void argmax_final(const ArgmaxParams p) {
    __shared__ float sv[32];
    __shared__ int si[32];
    pdl_start();
    argmax_final_unit(p, sv, si);
}
