// Matrix-vector products over quantised rows: QKV (3 matrices, one launch), o_proj with the
// residual add, the router and the output head. A warp owns whole rows, so each output is
// reduced in one fixed order (deterministic, no atomics).
// Modes (chosen on the host, step/modes.rs mv_mode; a kernel each): matvec_generic goes row by row
// (L2 prefetch before pdl_wait); the others stage NR rows' weights in registers before
// pdl_wait (weights are immutable), so the loads overlap the predecessor kernel; groups of NR
// rows never span two matrices (host checks). At most 4 staged pieces per lane (rows x
// pieces): the unrolled code of more pieces is what the warps waited on (instruction fetch,
// Nsight Compute on the H200), not the weights.
struct MatvecParams {
    QW w[3];          // up to three matrices whose rows are concatenated in the output space
    u64 out[3];       // float* per matrix
    u64 in;           // const float* [k]
    u64 norm;         // const float* [k] RMSNorm weight, or 0 for none
    u64 xn_out;       // float* [k]: block 0 stores the normalised input here (0 = don't)
    int rows[3];
    int n_w;
    int k;
    int accumulate;   // out += result (residual add) instead of out = result; the staged modes
                      // read out before pdl_wait, so it must have been written two or more
                      // launches back (o_proj: the residual, last written by moe_down)
    int rows_per_warp;
    float eps;
};
SIZE_IS(MatvecParams, 152); FIELD_AT(MatvecParams, w, 0); FIELD_AT(MatvecParams, out, 72);
FIELD_AT(MatvecParams, in, 96); FIELD_AT(MatvecParams, norm, 104); FIELD_AT(MatvecParams, xn_out, 112);
FIELD_AT(MatvecParams, rows, 120); FIELD_AT(MatvecParams, n_w, 132); FIELD_AT(MatvecParams, k, 136);
FIELD_AT(MatvecParams, accumulate, 140); FIELD_AT(MatvecParams, rows_per_warp, 144);
FIELD_AT(MatvecParams, eps, 148);

__device__ __forceinline__ void mv_input(const MatvecParams& p, float* xs, float* red, Unit u) {
    load_x(xs, (const float*)p.in, p.k, (const float*)p.norm, p.eps, red);
    if (p.xn_out && u.x == 0)
        for (int i = threadIdx.x; i < p.k; i += blockDim.x) ((float*)p.xn_out)[i] = xs[pad_idx(i)];
}

// NR rows a warp staged as `Rows`; with TYPE_B >= 0, warps whose matrix has type TYPE_B stage
// theirs as `RowsB` (QKV of mixed types), the choice uniform per warp and the barriers of
// the input's load outside it. The input is quantised (QXW groups: integer dots); the host
// gives these modes k % 32 == 0, k <= 4096 and no xn_out (step/modes.rs mv_mode).
// LOOP (one matrix, no accumulate: the output head): the grid is what the SMs hold at once and a
// warp walks units of NR rows grid-wide, the next unit's weights in flight during this one's dot.
// Why: a block a unit (9,496 blocks for Qwen3's head) quantised the same input in every block,
// about as many instructions as its dots, and the head was issue-bound.
// `resid` (accumulate only): the old outputs are read there instead of from the outputs (o_proj
// with the folded router, whose router rows read the residual while o_proj writes the new one).
// `best` (LOOP only: the head with the greedy choice, sample.cu head_argmax): lane 0 of each warp
// keeps the best of the outputs it writes (better's order).
template <int NR, class Rows, class RowsB = Rows, int TYPE_B = -1, bool LOOP = false>
__device__ __forceinline__ void mv_staged(const MatvecParams& p, float* xs, float* red, Unit u, const float* resid = nullptr, ArgBest* best = nullptr) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int total = p.rows[0] + p.rows[1] + p.rows[2];
    int first = (u.x * nwarps + warp) * NR, stride = u.nx * nwarps * NR;
    int m = 0, r0 = first;
    while (m < p.n_w - 1 && r0 >= p.rows[m]) { r0 -= p.rows[m]; m++; }
    QW w = p.w[m];
    long long rows[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) rows[i] = first + i < total ? (long long)(r0 + i) : -1;
    bool as_b = TYPE_B >= 0 && w.type == TYPE_B;
    Rows R;
    RowsB RB;
    if (as_b) RB.load(w, rows, lane);
    else R.load(w, rows, lane);
    float* out = (float*)p.out[m];
    float prev[NR];  // accumulate: the outputs' old values, loaded early (see accumulate)
#pragma unroll
    for (int i = 0; i < NR; i++) prev[i] = p.accumulate && lane == 0 && rows[i] >= 0 ? __ldcg((resid ? resid : out) + rows[i]) : 0.f;
    pdl_start();
    u32* qx = (u32*)xs;
    // With a norm (qkv, the head): x * norm quantised, its RMS factor applied to the sums
    // (load_xg_quant: one barrier, not load_x_fast's three, on the chain after the wait).
    float r = 1.f;
    // The probe's mid: the slowest warp's preloaded weights landed (marked after x's loads issue).
    if (p.norm) r = load_xg_quant<true, (TYPE_B >= 0)>(qx, (const float*)p.in, (const float*)p.norm, p.k, p.eps, red, TL_DEP(as_b ? RB.last_word() : R.last_word()));
    else load_x_fast<X_QUANT>(qx, (const float*)p.in, p.k, nullptr, p.eps, red);
    tl_mark(TL_X);
    const u32* xp[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) xp[i] = qx;
    while (true) {
        Rows next;
        long long next_rows[NR];
        if (LOOP) {
#pragma unroll
            for (int i = 0; i < NR; i++) next_rows[i] = first + stride + i < total ? (long long)(first + stride + i) : -1;
            next.load(w, next_rows, lane);
        }
        float acc[NR];
#pragma unroll
        for (int i = 0; i < NR; i++) acc[i] = 0.f;
        if (as_b) RB.dot(w, rows, xp, lane, acc);
        else R.dot(w, rows, xp, lane, acc);
#pragma unroll
        for (int i = 0; i < NR; i++) {
            float v = warp_sum(acc[i]) * r;
            if (lane == 0 && rows[i] >= 0) out[rows[i]] = p.accumulate ? prev[i] + v : v;
            if (best && lane == 0 && rows[i] >= 0 && v == v) better(best->v, best->i, v, (int)rows[i]);
        }
        first += stride;
        if (!LOOP || first >= total) break;
        R = next;
#pragma unroll
        for (int i = 0; i < NR; i++) rows[i] = next_rows[i];
    }
    tl_mark(TL_END);
}

// Row by row (any type), L2 prefetch of the rows before pdl_wait.
__device__ __forceinline__ void mv_generic(const MatvecParams& p, float* xs, float* red, Unit u) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int total = p.rows[0] + p.rows[1] + p.rows[2];
    int first = (u.x * nwarps + warp) * p.rows_per_warp;
    for (int r = first; r < first + p.rows_per_warp && r < total; r++) {
        int m = 0, rr = r;
        while (m < p.n_w - 1 && rr >= p.rows[m]) { rr -= p.rows[m]; m++; }
        prefetch_row(p.w[m], (u64)rr, lane);
    }
    pdl_start();
    mv_input(p, xs, red, u);
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

// One kernel per staged mode (kernel.rs MatvecMode names it), so a kernel holds only the
// code it runs: the layer kernels' warps waited on instruction fetch (Nsight Compute), and
// splitting the kernels by weight type measured +4% / +8% (Q4_0 / Q4_K_M). Shared memory: red
// [33], then the input's quantised groups, 16-byte aligned (sized by the host as the padded
// float input, which is larger). Held to 3 blocks an SM (MV_KERNEL).
#define MV_KERNEL_AT(blocks_per_sm, name, NR, ...)                                          \
    extern "C" __global__ void __launch_bounds__(256, blocks_per_sm) name(const MatvecParams p) { \
        extern __shared__ __align__(16) float smem[];                                           \
        mv_staged<NR, __VA_ARGS__>(p, smem + 36, smem, this_unit());                            \
    }
#define MV_KERNEL(name, NR, ...) MV_KERNEL_AT(3, name, NR, __VA_ARGS__)
// The staged kernels (kernel.rs Staged::ALL, in this order; step/modes.rs mv_mode picks one):
// name, rows a warp, their pieces. q4_0_1: Q4_0, k <= 1024, 4 rows a warp; q4_0_2: Q4_0,
// k <= 2048, 2 rows; q4_0_4: Q4_0, k <= 4096, 1 row; q4_k_1: Q4_K (as repacked), k <= 2048,
// 2 rows; q4_k_2: Q4_K, k <= 4096, 1 row; q6_k_1: Q6_K (as repacked), k <= 1024, 4 rows;
// q6_k_2: Q6_K, k <= 2048, 2 rows; q6_k_4: Q6_K, k <= 4096, 1 row. The walking kernels (_loop),
// the head with the greedy choice (sample.cu) and o_proj with the folded router (moe.cu) take
// the same list.
#define STAGED_MODES(X)          \
    X(q4_0_1, 4, Q4_0Rows<4, 1>) \
    X(q4_0_2, 2, Q4_0Rows<2, 2>) \
    X(q4_0_4, 1, Q4_0Rows<1, 4>) \
    X(q4_k_1, 2, Q4_KRows<2, 2>) \
    X(q4_k_2, 1, Q4_KRows<1, 4>) \
    X(q6_k_1, 4, Q6_KRows<4, 1>) \
    X(q6_k_2, 2, Q6_KRows<2, 2>) \
    X(q6_k_4, 1, Q6_KRows<1, 4>)
#define MV_STAGED(sfx, NR, ...) MV_KERNEL(matvec_##sfx, NR, __VA_ARGS__)
STAGED_MODES(MV_STAGED)
// MatvecMode::KMixed: Q4_K and Q6_K matrices (Q4_K_M's QKV), k <= 2048, 2 rows
MV_KERNEL(matvec_k_mixed, 2, Q4_KRows<2, 2>, Q6_KRows<2, 2>, T_Q6_K)
// The staged kernels walking rows grid-wide (_loop: the output head, step/matvec.rs looped), 2 blocks
// an SM: two units' weights a warp need more than 3 blocks' 85 registers (spills).
#define MV_LOOP_KERNEL(name, NR, ...) MV_KERNEL_AT(2, name, NR, __VA_ARGS__, __VA_ARGS__, -1, true)
#define MV_STAGED_LOOP(sfx, NR, ...) MV_LOOP_KERNEL(matvec_##sfx##_loop, NR, __VA_ARGS__)
STAGED_MODES(MV_STAGED_LOOP)

// The generic mode, held to 3 blocks per SM (rows of types without a staged mode, e.g. Q8_0).
extern "C" __global__ void __launch_bounds__(256, 3) matvec_generic(const MatvecParams p) {
    extern __shared__ __align__(16) float smem[];
    mv_generic(p, smem + 36, smem, this_unit());
}

// Embedding look-up of the step's token: x = row `state.token` of the embedding matrix.
struct EmbedParams {
    QW w;
    u64 state;  // StepState*
    u64 x;      // float* [k]
};
SIZE_IS(EmbedParams, 40); FIELD_AT(EmbedParams, w, 0); FIELD_AT(EmbedParams, state, 24);
FIELD_AT(EmbedParams, x, 32);

__device__ __forceinline__ void embed_unit(const EmbedParams& p, Unit u) {
    u32 tok = ((const StepState*)p.state)->token;
    for (int i = u.x * blockDim.x + threadIdx.x; i < p.w.k; i += u.nx * blockDim.x)
        ((float*)p.x)[i] = weight_at(p.w, (u64)tok, i);
}

extern "C" __global__ void embed(const EmbedParams p) {
    pdl_start();
    embed_unit(p, this_unit());
}
