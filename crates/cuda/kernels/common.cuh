// Shared by every kernel family: integer types, the weight descriptor and step state, f16
// decode, programmatic dependent launch (and the launch timeline's probe behind it), block and
// warp reductions, asynchronous copies. NVRTC compiles all .cu files as one program with this
// file in front, then quant.cuh (the quantised dots).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define INFINITY __int_as_float(0x7f800000)

// ggml type ids (GgmlType discriminants).
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q6_K 14

// Params structs' layouts: each struct shared with Rust (src/params.rs, #[repr(C)]) is followed
// by its size and every field's offset, which params.rs asserts for its mirror too
// (dev/params_layout.py writes both sides), so a field changed on one side only fails the build.
#define SIZE_IS(S, n) static_assert(sizeof(S) == n, #S ": size differs from src/params.rs")
// Field offsets are checked where the compiler has __builtin_offsetof: dev/cuda-tools/nvrtc_check.py
// defines Q4MOE_LAYOUT_CHECK (NVRTC 13.5 has it); the runtime compile does not, since NVRTC 13.0
// (driver 580) rejects it. src/params.rs checks the same offsets on the Rust side in every build.
#ifdef Q4MOE_LAYOUT_CHECK
#define FIELD_AT(S, f, off) static_assert(__builtin_offsetof(S, f) == off, #S "." #f ": offset differs from src/params.rs")
#else
#define FIELD_AT(S, f, off) static_assert(true, "")
#endif

// A weight matrix on the device. The split types (Q4_0, Q4_K, Q6_K) are repacked at load
// (src/repack.rs): `data` = [blocks][16] nibbles, `scales` = the aux plane (split_aux), so a
// lane loads one 32-weight block with aligned vector loads. Every other type keeps ggml's
// block bytes at `data` (rows contiguous), `scales` unused.
struct QW {
    u64 data;
    u64 scales;
    int type;
    int k;  // row length (elements)
};
SIZE_IS(QW, 24); FIELD_AT(QW, data, 0); FIELD_AT(QW, scales, 8); FIELD_AT(QW, type, 16); FIELD_AT(QW, k, 20);

// Per-token values, advanced by the step's own kernels so a replayed graph needs no upload.
struct StepState {
    u32 token;  // token fed to the next step
    u32 pos;    // position it is written at
};
SIZE_IS(StepState, 8); FIELD_AT(StepState, token, 0); FIELD_AT(StepState, pos, 4);

// Slots of the host's step-state ring (pipeline.rs): a step at position pos is read back
// from slot pos % STATE_RING.
#define STATE_RING 32

// The step's token choice: the next token into the state and the position advanced, and, with
// `publish` (the host-mapped StepState ring of pipeline.rs; 0: none), the new state into the
// slot of the step's position as one 8-byte store, so no copy after the step has to read it
// back. One thread calls it.
__device__ __forceinline__ void finish_step(StepState* st, u32 token, u64 publish) {
    u32 pos = st->pos;
    st->token = token;
    st->pos = pos + 1;
    if (publish) ((volatile unsigned long long*)publish)[pos & (STATE_RING - 1)] = (unsigned long long)token | (unsigned long long)(pos + 1) << 32;
}

// A block's place in its op's grid, apart from blockIdx: a walking block takes its later units
// (moe.cu gate_up_staged) and a launch of two ops hands each its own range (o_proj_router).
struct Unit {
    int x, y;  // this unit
    int nx;    // units along x (grid-stride loops)
};
__device__ __forceinline__ Unit this_unit() { return Unit{(int)blockIdx.x, (int)blockIdx.y, (int)gridDim.x}; }

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

#ifdef Q4MOE_TIMELINE
// The GPU's nanosecond clock (the launch timeline).
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// The launch timeline (the `timeline` feature of q4moe-cuda, timeline.rs): a slot a launch, emptied by the host
// before each recorded step (a graph's replays repeat its launches' %gridid), where thread 0 of
// a block records reaching and passing pdl_wait. Only the first and the last 64 blocks of a grid record
// (the blocks dispatched first and last, whose times the summary uses): every block's atomics on
// one slot would queue at one L2 slice and perturb what is measured. Minima are kept as the
// maximum of the complement, so zeroed memory is the empty table; the atomics return nothing.
// A launch's slot is its %gridid modulo the table (a step's ~245 launches have consecutive
// ids), so finding it takes no load: a round trip on a late block's way to pdl_wait delayed its
// pass and everything after it (the slot was once found through a shared base id).
// Marks inside the hot kernels (tl_mark) keep the latest recorder block's time at a point:
// TL_IN once every warp has its first input values (tl_mark_after, by each warp's lane 0: the
// slowest warp's), TL_X once the block's input is staged (its barrier passed), TL_MID at a
// kernel's own midpoint (attention: its warps' tiles done, tl_mark_warps; moe_gate_up: its
// first unit done; the matvecs with a norm: the slowest warp's preloaded weights landed),
// TL_END after its last store, so a launch's step splits into the input's
// round trip, its staging, its work and the release of the next launch.
#define TL_SLOTS 1024
__device__ unsigned long long tl_val[TL_SLOTS][10];   // gridid + 1, !first ready, last ready, !first pass, shape, x, end, last pass, in, mid
__device__ __forceinline__ bool tl_recorder_block() {
    unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned n = gridDim.x * gridDim.y * gridDim.z;
    return b < 64 || b + 64 >= n;
}
__device__ __forceinline__ bool tl_recorder() { return threadIdx.x + threadIdx.y + threadIdx.z == 0 && tl_recorder_block(); }
// Lane 0 of each warp of a recorder block (tl_mark_warps, tl_mark_after).
__device__ __forceinline__ bool tl_warp_recorder() { return (threadIdx.x & 31) == 0 && tl_recorder_block(); }
// This launch's slot; `key` its %gridid + 1.
__device__ __forceinline__ unsigned long long* tl_slot(unsigned long long& key) {
    unsigned long long g;
    asm("mov.u64 %0, %%gridid;" : "=l"(g));
    key = g + 1;
    return tl_val[g & (TL_SLOTS - 1)];
}
__device__ __forceinline__ void tl_record(unsigned long long ready, unsigned long long pass) {
    unsigned long long key, *v = tl_slot(key);
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    v[0] = key;
    atomicMax(v + 1, ~ready);
    atomicMax(v + 2, ready);
    atomicMax(v + 3, ~pass);
    atomicMax(v + 7, pass);
    // timeline.rs `shape`: grid blocks, block threads, dynamic shared memory.
    v[4] = (unsigned long long)(gridDim.x * gridDim.y * gridDim.z) << 40 | (unsigned long long)(blockDim.x * blockDim.y * blockDim.z) << 24 | dyn;
}
#endif
// The launch timeline's marks `field` (TL_IN, TL_X, TL_MID, TL_END: tl_val's fields).
// tl_mark: by the recorder blocks' thread 0; tl_mark_warps: by each of their warps' lane 0 (the
// slowest warp's time); tl_mark_after: tl_mark_warps once `dep` (a loaded value) has arrived.
// Without the probe they are macros of nothing, their arguments not even evaluated, so the
// product's kernels hold no trace of them.
#define TL_X 5
#define TL_END 6
#define TL_IN 8
#define TL_MID 9
#ifdef Q4MOE_TIMELINE
// A probe mark's dependency, not computed without the probe (its expression moved registers).
#define TL_DEP(x) (x)
__device__ __forceinline__ void tl_put(int field) {
#if __CUDA_ARCH__ >= 900
    unsigned long long key, *v = tl_slot(key);  // a global address: a red the warp need not wait for
    asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(v + field), "l"(global_ns()) : "memory");
#endif
}
__device__ __forceinline__ void tl_mark(int field) {
    if (tl_recorder()) tl_put(field);
}
__device__ __forceinline__ void tl_mark_warps(int field) {
    if (tl_warp_recorder()) tl_put(field);
}
// A branch on `dep` comes first, so the clock is read after the load's wait.
__device__ __forceinline__ void tl_mark_after(int field, float dep) {
#if __CUDA_ARCH__ >= 900
    if (!tl_warp_recorder()) return;
    if (__float_as_uint(dep) == 0x7fc0dead) asm volatile("trap;");
    tl_put(field);
#endif
}
#else
#define TL_DEP(x) 0.f
#define tl_mark(field) ((void)0)
#define tl_mark_warps(field) ((void)0)
#define tl_mark_after(field, dep) ((void)0)
#endif
// Programmatic dependent launch (sm_90+): the step's kernels are launched with programmatic
// stream serialisation, so a kernel may start while its predecessor finishes. Everything before
// pdl_wait() may only read immutable data (weights); pdl_wait() returns once every predecessor
// grid has completed and its writes are visible. pdl_launch() lets the successor be scheduled.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
#ifdef Q4MOE_TIMELINE
    unsigned long long ready = global_ns();
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef Q4MOE_TIMELINE
    if (tl_recorder()) tl_record(ready, global_ns());
#endif
#endif
}
__device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_start() { pdl_wait(); pdl_launch(); }

// silu(g) * u, the experts' activation: one expression for every kernel that forms it, so the
// single-stream step, the batched prefill and the batched step's fused form agree bit for bit.
__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.f + expf(-g)) * u; }

// Larger wins; on equal values the lower index wins; NaN never wins.
__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}
// A running arg-max (the head's fused choice: sample.cu head_argmax).
struct ArgBest {
    float v;
    int i;
};

// Whether this block is the last of `n` to arrive at `counter` (0 between launches: the last
// resets it). The block's writes before the call are visible to the last block's reads after
// it: thread 0 arrives with a release-acquire add, the barriers either side carry the other
// threads' writes and reads. Why not __threadfence around a relaxed atomicAdd: those are
// sequentially consistent fences (MEMBAR.SC.GPU), on the chain of every router's top-k and
// attention's merge.
__device__ __forceinline__ bool last_to_arrive(u32* counter, u32 n, int* flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        *flag = old == n - 1;
        if (old == n - 1) *counter = 0;
    }
    __syncthreads();
    return *flag;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// a.x b.x + a.y b.y + a.z b.z + a.w b.w, summed left to right.
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
__device__ __forceinline__ float4 mul4(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Activations live in shared memory in groups of 32 floats padded to XS = 36: each group is
// 16-byte aligned (float4 reads) and 8 lanes reading different groups hit different banks.
#define XS 36
__device__ __forceinline__ int pad_idx(int i) { return (i >> 5) * XS + (i & 31); }
__device__ __forceinline__ int padded_len(int n) { return (n >> 5) * XS + XS; }

// f / d for 0 <= f < 2^20 and d >= 1 as floor((f + 0.5) * inv_d), inv_d = __fdividef(1, d) (2
// ulp): the product is within (f + 0.5) / d * 2^-21 < 0.5 / d of (f + 0.5) / d, which is at least
// 0.5 / d from an integer. Why not f / d: an integer division by a value known only at run time
// is ~20 dependent instructions, on the chain where moe_down issues its weight loads and where
// the router's ranking starts.
__device__ __forceinline__ int floor_div_small(int f, float inv_d) { return (int)(((float)f + 0.5f) * inv_d); }

// Block-wide sum in a fixed order (deterministic): warp butterflies, then warp 0 over warps.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = 0.f;
    if (w == 0) {
        t = lane < nw ? red[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) red[32] = t;
    }
    __syncthreads();
    return red[32];
}

// Orders floats as unsigned integers: a larger float (total order, -0 < +0) gives a larger key,
// 0 below every float's (atomicMax, radix selection); key_float inverts it.
__device__ __forceinline__ u32 float_key(float f) {
    u32 b = __float_as_uint(f);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float key_float(u32 k) {
    return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

// Asynchronous copies to shared memory (sm_80+): 16 bytes (zeros where !in), 8 or 4.
__device__ __forceinline__ void cp_async16(uint4* dst, const void* src, bool in) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(in ? 16 : 0));
}
// cp_async16 through L1 (.ca): copies that many blocks of an SM make of the same lines.
__device__ __forceinline__ void cp_async16_ca(uint4* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}

// The block-wide RMS factor in two halves around a barrier the caller has anyway: each warp's
// partial sum of squares into red[warp], then (after that barrier) rsqrt(mean + eps) over the
// partials in warp order.
__device__ __forceinline__ void warp_partial(float ss, float* red) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
}
// The warps' partials red[0..warps) summed in warp order. STRAIGHT, at 8 warps: two 16-byte
// loads and straight-line adds, not a loop (red is 16-byte aligned) -- for the router rows'
// logits, whose sum is all that is left before the store. rms_factor keeps the loop: its factor
// is needed only after the dots, and the straight-line form, which ptxas schedules ahead of
// them, measured -1% on Q4_0 in moe_gate_up and the matvec (docs/performance.md).
template <bool STRAIGHT = false>
__device__ __forceinline__ float partials_sum(const float* red) {
    if (STRAIGHT && blockDim.x == 256) {
        float4 a = ((const float4*)red)[0], b = ((const float4*)red)[1];
        return ((((((a.x + a.y) + a.z) + a.w) + b.x) + b.y) + b.z) + b.w;
    }
    float t = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) t += red[w];
    return t;
}
__device__ __forceinline__ float rms_factor(const float* red, int n, float eps) {
    return rsqrtf(__fdividef(partials_sum(red), (float)n) + eps);  // no division slow path on the critical path
}
