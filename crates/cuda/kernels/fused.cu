// The whole decode step as ONE persistent grid. The op list is exactly the launches the eager
// path makes (embed, per layer qkv .. moe_down, head, arg-max), in order; here every resident
// block loops over each op's units (what a standalone launch's blocks would be) and a grid-wide
// barrier separates the ops. Why: a graph of ~340 dependent kernels pays launch + block
// scheduling + grid drain per kernel. The units run the same device functions as the
// standalone kernels with the same unit geometry, so results are bit-identical.
// Opt-in and slower than the graph today (NOTES.md v7): a block runs its units one after
// another with nothing in flight between them, the barrier costs ~1.5-2 us, and the units spill
// 2-2.5 KB of stack here. The next version must pipeline loads across units and barriers.
//
// Requires every block to be resident at once: the host sizes the grid with the occupancy API.

#define FK_EMBED 0
#define FK_MATVEC 1
#define FK_ATTN_GQA 2
#define FK_ATTN_COMBINE 3
#define FK_ROUTER_TOPK 4
#define FK_GATE_UP 5
#define FK_DOWN 6
#define FK_ARGMAX_PARTIAL 7
#define FK_ARGMAX_FINAL 8

// Largest params struct of any op, in 8-byte words (host asserts it).
#define FUSED_PARAM_WORDS 32

// One op: a header and its params inline, so a block stages the whole record with one
// independent load per thread (no header -> params dependency).
struct FusedOp {
    int kind;    // FK_*
    int nx, ny;  // unit grid (the standalone launch's grid)
    int pad;
    u64 params[FUSED_PARAM_WORDS];
};
#define FUSED_OP_WORDS (2 + FUSED_PARAM_WORDS)

// Self-resetting barrier: `count` is back to 0 after every barrier; `gen` counts barriers.
struct GridBar {
    u32 count;
    u32 gen;
};

struct FusedParams {
    u64 ops;     // const FusedOp* [n_ops]
    u64 bar;     // GridBar*, zeroed once
    u64 stamps;  // u64* [n_ops]: %globaltimer when block 0 starts each op (0 = off)
    int n_ops;
};

// Release/acquire at GPU scope (no full fences): thread 0's release after bar.sync publishes
// the block's writes; the waiters' acquire + bar.sync makes them visible to their blocks.
__device__ __forceinline__ void grid_barrier(GridBar* b) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 g, old, cur;
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(&b->gen) : "memory");
        asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(&b->count) : "memory");
        if (old == gridDim.x - 1) {
            asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" :: "l"(&b->count) : "memory");
            asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(&b->gen), "r"(g + 1) : "memory");
        } else {
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(cur) : "l"(&b->gen) : "memory");
            } while (cur == g);
        }
    }
    __syncthreads();
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One out-of-line function per op kind keeps the dispatch small (inlined, the switch spilled
// just as much).
#define FUSED_UNIT(name, P, call) \
    __device__ __noinline__ void name(const void* prm, float* smem, Unit u) { const P& p = *(const P*)prm; call; }
FUSED_UNIT(fu_embed, EmbedParams, embed_unit(p, u))
FUSED_UNIT(fu_matvec, MatvecParams, matvec_unit(p, smem, u, false))
FUSED_UNIT(fu_attn_gqa, AttnGqaParams, attn_gqa_unit(p, *(GqaSmem*)smem, u))
FUSED_UNIT(fu_attn_combine, AttnParams, attn_combine_unit(p, u))
FUSED_UNIT(fu_router_topk, RouterParams, router_topk_unit(p, smem, u, false))
FUSED_UNIT(fu_gate_up, GateUpParams, gate_up_unit(p, smem, u))
FUSED_UNIT(fu_down, DownParams, down_unit(p, smem, u))
FUSED_UNIT(fu_argmax_partial, ArgmaxParams, argmax_partial_unit(p, smem, (int*)(smem + 32), u))
FUSED_UNIT(fu_argmax_final, ArgmaxParams, argmax_final_unit(p, smem, (int*)(smem + 32)))

__device__ __forceinline__ void run_unit(int kind, const void* prm, float* smem, Unit u) {
    switch (kind) {
        case FK_EMBED: fu_embed(prm, smem, u); break;
        case FK_MATVEC: fu_matvec(prm, smem, u); break;
        case FK_ATTN_GQA: fu_attn_gqa(prm, smem, u); break;
        case FK_ATTN_COMBINE: fu_attn_combine(prm, smem, u); break;
        case FK_ROUTER_TOPK: fu_router_topk(prm, smem, u); break;
        case FK_GATE_UP: fu_gate_up(prm, smem, u); break;
        case FK_DOWN: fu_down(prm, smem, u); break;
        case FK_ARGMAX_PARTIAL: fu_argmax_partial(prm, smem, u); break;
        default: fu_argmax_final(prm, smem, u); break;
    }
}

__device__ __forceinline__ void stage_op(FusedOp* dst, const FusedOp* src) {
    if (threadIdx.x < FUSED_OP_WORDS) ((u64*)dst)[threadIdx.x] = ((const u64*)src)[threadIdx.x];
}

// grid = resident blocks (all co-resident), 256 threads, dynamic smem = the largest op's need.
// Op i+1's record is staged (double buffer) while op i runs: it is immutable.
__device__ __forceinline__ void fused_step(const FusedParams& fp, float* smem) {
    __shared__ __align__(16) FusedOp op[2];
    const FusedOp* ops = (const FusedOp*)fp.ops;
    GridBar* bar = (GridBar*)fp.bar;
    stage_op(&op[0], ops);
    __syncthreads();
    for (int i = 0; i < fp.n_ops; i++) {
        if (i > 0) grid_barrier(bar);
        if (fp.stamps && blockIdx.x == 0 && threadIdx.x == 0) ((u64*)fp.stamps)[i] = global_ns();
        const FusedOp& o = op[i & 1];
        if (i + 1 < fp.n_ops) stage_op(&op[(i + 1) & 1], ops + i + 1);
        int n = o.nx * o.ny;
        for (int t = blockIdx.x; t < n; t += gridDim.x) {
            run_unit(o.kind, o.params, smem, Unit{t % o.nx, t / o.nx, o.nx});
            __syncthreads();  // shared memory is reused by the next unit
        }
    }
}

// Two register budgets: one block per SM with up to 255 registers, or two with up to 128 (more
// warps in flight); the host picks one (Q4MOE_CUDA_FUSED_BLOCKS=2 selects the second).
extern "C" __global__ void __launch_bounds__(256, 1) step_fused(const FusedParams fp) {
    extern __shared__ __align__(16) float smem[];
    fused_step(fp, smem);
}
extern "C" __global__ void __launch_bounds__(256, 2) step_fused_2(const FusedParams fp) {
    extern __shared__ __align__(16) float smem[];
    fused_step(fp, smem);
}
