// The greedy choices fused into other work or taken for many rows at once: the output head with
// the arg-max in its tail (the single-stream step), and the batched step's arg-max a row a
// block. Beside sample.cu (argmax_final_unit, block_argmax), after it in the module as they were.

// The output head with the greedy choice in its tail (step/sample.rs tail: greedy without penalties):
// the walking head (mv_staged LOOP) with each warp's lane 0 keeping the best of the logits it
// writes, then each block's best into the partials and the last block to finish merges them as
// argmax_final does. The same choice as argmax_partial + argmax_final over the same logits
// (which it still writes), two dependent launches and a re-read of the logits fewer.
struct HeadArgmaxParams {
    MatvecParams mv;  // the head's (one matrix, walking)
    ArgmaxParams am;  // part_v / part_i [gridDim.x], state, publish; n_blocks = gridDim.x
    u64 counter;      // u32, 0 between launches (the last block resets it)
};
SIZE_IS(HeadArgmaxParams, 208); FIELD_AT(HeadArgmaxParams, mv, 0); FIELD_AT(HeadArgmaxParams, am, 152);
FIELD_AT(HeadArgmaxParams, counter, 200);

template <int NR, class Rows>
__device__ __forceinline__ void head_argmax(const HeadArgmaxParams& p) {
    extern __shared__ __align__(16) float head_smem[];  // as MV_KERNEL_AT's
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int last;
    ArgBest best{-INFINITY, 0x7fffffff};
    mv_staged<NR, Rows, Rows, -1, true>(p.mv, head_smem + 36, head_smem, this_unit(), nullptr, &best);
    block_argmax(best.v, best.i, sv, si);
    if (threadIdx.x == 0) { ((float*)p.am.part_v)[blockIdx.x] = best.v; ((int*)p.am.part_i)[blockIdx.x] = best.i; }
    if (!last_to_arrive((u32*)p.counter, gridDim.x, &last)) return;
    argmax_final_unit(p.am, sv, si);
}
#define MV_HEAD_ARGMAX(sfx, NR, ...) \
    extern "C" __global__ void __launch_bounds__(256, 2) matvec_##sfx##_loop_argmax(const HeadArgmaxParams p) { head_argmax<NR, __VA_ARGS__>(p); }
STAGED_MODES(MV_HEAD_ARGMAX)

// The batched decode step's greedy choice (batch.rs): one block a row, the row's arg-max as
// sampling::argmax takes it (the lowest index among equal maxima), or BT_NON_FINITE where the
// row holds a NaN or an infinity (the host reports the row's position).
struct BtArgmaxParams {
    u64 logits;  // const float* [rows][n]
    u64 tokens;  // u32* [rows]
    int n;
    int pad;
};
SIZE_IS(BtArgmaxParams, 24); FIELD_AT(BtArgmaxParams, logits, 0); FIELD_AT(BtArgmaxParams, tokens, 8);
FIELD_AT(BtArgmaxParams, n, 16); FIELD_AT(BtArgmaxParams, pad, 20);
#define BT_NON_FINITE 0xffffffffu
#define BTA_UNROLL 8

extern "C" __global__ void __launch_bounds__(1024) bt_argmax(const BtArgmaxParams p) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int bad;
    pdl_start();  // the head's logits are complete and visible only past this
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    const float* lg = (const float*)p.logits + (size_t)blockIdx.x * p.n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    bool seen_bad = false;
    // Rows of whole float4s (n % 4 == 0) in BTA_UNROLL loads a thread at once: a plain strided
    // loop waited one L2 round trip per value, ~150 in a row of 151,936 (62 us a launch, H200
    // eager, against the ~5 us its 600 KB take). `better` is a total order, so the order in
    // which a thread meets the values changes no choice.
    int n4 = p.n % 4 == 0 ? p.n / 4 : 0;
    const float4* l4 = (const float4*)lg;
    for (int i0 = threadIdx.x; i0 < n4; i0 += BTA_UNROLL * blockDim.x) {
        float4 v[BTA_UNROLL];
#pragma unroll
        for (int u = 0; u < BTA_UNROLL; u++) {
            int i = i0 + u * blockDim.x;
            if (i < n4) v[u] = __ldcg(l4 + i);
        }
#pragma unroll
        for (int u = 0; u < BTA_UNROLL; u++) {
            int i = i0 + u * blockDim.x;
            if (i >= n4) break;
            float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int c = 0; c < 4; c++) {
                if (isfinite(e[c])) better(bv, bi, e[c], 4 * i + c); else seen_bad = true;
            }
        }
    }
    for (int i = 4 * n4 + threadIdx.x; i < p.n; i += blockDim.x) {
        float v = lg[i];
        if (isfinite(v)) better(bv, bi, v, i); else seen_bad = true;
    }
    if (seen_bad) bad = 1;  // every writer writes 1; read after block_argmax's barrier
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) ((u32*)p.tokens)[blockIdx.x] = bad ? BT_NON_FINITE : (u32)bi;
}
