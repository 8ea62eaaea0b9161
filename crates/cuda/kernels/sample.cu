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

// ---- Sampling on the device: temperature + top-k (1..=1024) + top-p + min-p, or no cut at all
// (the vocabulary-order walk), SplitMix64 draw.
// Mirrors q4moe_model::Sampler step for step: the k largest of logit / temperature (ties: lower
// id first), sorted; probabilities exp(v - max) summed in sorted order and normalised; top-p and
// min-p cut in sorted order; r = u * kept mass walked in sorted order. exp is evaluated in double
// and rounded, so it agrees with the host's correctly rounded expf except in rare ties.
struct SampleConfig {
    float temperature;  // > 0
    int top_k;          // 1..=SAMPLE_MAX_K, or 0 (off) with top_p = 1
    float top_p;        // (0, 1]; 1 = off
    float min_p;        // [0, 1]; 0 = off
};

struct SampleParams {
    u64 logits;  // const float* [n]
    u64 state;   // StepState*: token written, pos advanced
    u64 cfg;     // const SampleConfig*
    u64 rng;     // u64* SplitMix64 state (advanced once per draw)
    int n;
};

#define SAMPLE_MAX_K 1024

// Order-preserving key: a larger float (total order, -0 < +0) gives a larger key.
__device__ __forceinline__ u32 fkey(float v) {
    u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float next_f32(u64* state) {
    u64 z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) / 16777216.f;
}

struct SampleSmem {
    u32 hist[256];
    u32 key[SAMPLE_MAX_K];
    u32 idx[SAMPLE_MAX_K];
    float pr[SAMPLE_MAX_K];
    u32 scan[SAMPLE_MAX_K];
    u32 prefix, want, count, n_finite;
};

// The logits loops are unrolled so 8 loads per thread are in flight (a rolled loop waits one L2
// round trip per element: ~150 of them over the full vocabulary).
// Key of the k-th largest candidate (radix select, 8 bits a pass) and how many candidates equal
// to it are taken (the lowest ids). Needs k <= the number of finite candidates.
__device__ void select_kth(const float* lg, int n, float t, int k, SampleSmem& s, u32& thr, u32& take) {
    u32 prefix = 0, mask = 0, want = (u32)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (threadIdx.x < 256) s.hist[threadIdx.x] = 0;
        __syncthreads();
#pragma unroll 8
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            float x = lg[i];
            if (!isfinite(x)) continue;
            u32 key = fkey(x / t);
            if ((key & mask) == prefix) atomicAdd(&s.hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 acc = 0;
            int b = 255;
            while (b > 0 && acc + s.hist[b] < want) acc += s.hist[b--];
            s.prefix = prefix | ((u32)b << shift);
            s.want = want - acc;
        }
        __syncthreads();
        prefix = s.prefix;
        want = s.want;
        mask |= 255u << shift;
        __syncthreads();
    }
    thr = prefix;
    take = want;
}

// Gathers the k candidates (unsorted): every key above thr, and the `take` lowest ids equal to it
// (per-thread contiguous ranges + an exclusive scan give the ids' order).
__device__ void gather(const float* lg, int n, float t, u32 thr, u32 take, SampleSmem& s) {
    int chunk = (n + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk, hi = min(n, lo + chunk);
    u32 eq = 0;
#pragma unroll 8
    for (int i = lo; i < hi; i++) {
        float x = lg[i];
        eq += isfinite(x) && fkey(x / t) == thr;
    }
    s.scan[threadIdx.x] = eq;
    if (threadIdx.x == 0) s.count = 0;
    __syncthreads();
    for (int o = 1; o < (int)blockDim.x; o <<= 1) {  // inclusive Hillis-Steele scan
        u32 v = threadIdx.x >= o ? s.scan[threadIdx.x - o] : 0;
        __syncthreads();
        s.scan[threadIdx.x] += v;
        __syncthreads();
    }
    u32 rank = s.scan[threadIdx.x] - eq;
#pragma unroll 8
    for (int i = lo; i < hi; i++) {
        float x = lg[i];
        if (!isfinite(x)) continue;
        u32 key = fkey(x / t);
        bool in = key > thr || (key == thr && rank++ < take);
        if (in) {
            u32 at = atomicAdd(&s.count, 1u);
            s.key[at] = key;
            s.idx[at] = (u32)i;
        }
    }
    __syncthreads();
}

// Bitonic sort of SAMPLE_MAX_K (key desc, id asc); slots past `count` are padding that sorts last.
__device__ void sort_candidates(SampleSmem& s) {
    int t = threadIdx.x;
    if (t >= (int)s.count) { s.key[t] = 0; s.idx[t] = 0xffffffffu; }
    __syncthreads();
    for (int size = 2; size <= SAMPLE_MAX_K; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            int j = t ^ stride;
            if (j > t) {
                // "before(a, b)": a comes first in the final order
                bool jb = s.key[j] > s.key[t] || (s.key[j] == s.key[t] && s.idx[j] < s.idx[t]);
                bool up = (t & size) == 0;
                if (up == jb) {
                    u32 k = s.key[t], i = s.idx[t];
                    s.key[t] = s.key[j]; s.idx[t] = s.idx[j];
                    s.key[j] = k; s.idx[j] = i;
                }
            }
            __syncthreads();
        }
}

// Weight of id i in the no-cut walk: exp(v / t - mx), 0 for a non-finite logit or below the
// min-p floor.
__device__ __forceinline__ float vocab_weight(const float* lg, int i, float t, float mx, float floor) {
    float x = lg[i];
    if (!isfinite(x)) return 0.f;
    float w = (float)exp((double)(x / t - mx));
    return w >= floor ? w : 0.f;
}

// No top-k or top-p cut: the host's sample_unsorted / walk_unsorted (q4moe_model::sampling). Thread
// c sums chunk c of ceil(n / blockDim) ids in id order (WALK_CHUNKS = blockDim = 1024), thread 0
// sums the chunk sums in order, draws, skips every chunk the remainder covers and walks the one
// it falls in -- the same numbers added in the same order as the host.
__device__ u32 walk_vocab(const float* lg, int n, const SampleConfig& c, SampleSmem& s, u64* rng) {
    float t = c.temperature, floor = fmaxf(c.min_p, 0.f);
    float m = -INFINITY;
#pragma unroll 8
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float x = lg[i];
        if (isfinite(x)) m = fmaxf(m, x / t);
    }
    s.pr[threadIdx.x] = m;
    __syncthreads();
    for (int o = blockDim.x >> 1; o > 0; o >>= 1) {  // a maximum: exact in any order
        if ((int)threadIdx.x < o) s.pr[threadIdx.x] = fmaxf(s.pr[threadIdx.x], s.pr[threadIdx.x + o]);
        __syncthreads();
    }
    float mx = s.pr[0];
    __syncthreads();
    int len = (n + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * len, hi = min(n, lo + len);
    float sum = 0.f;
    u32 last = 0;
#pragma unroll 8
    for (int i = lo; i < hi; i++) {
        float w = vocab_weight(lg, i, t, mx, floor);
        if (w > 0.f) { sum += w; last = (u32)i; }
    }
    s.pr[threadIdx.x] = sum;
    s.idx[threadIdx.x] = last;
    __syncthreads();
    if (threadIdx.x != 0) return 0;
    float total = 0.f;
    for (int k = 0; k < (int)blockDim.x; k++) total += s.pr[k];
    float r = next_f32(rng) * total;
    u32 tok = 0;
    for (int k = 0; k < (int)blockDim.x; k++) {
        float ck = s.pr[k];
        if (ck == 0.f) continue;
        if (r >= ck) { r -= ck; tok = s.idx[k]; continue; }
        for (int i = k * len; i < min(n, (k + 1) * len); i++) {
            float w = vocab_weight(lg, i, t, mx, floor);
            if (w > 0.f) {
                tok = (u32)i;
                r -= w;
                if (r < 0.f) return tok;
            }
        }
    }
    return tok;
}

// One block of SAMPLE_MAX_K threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_MAX_K) sample_topk(const SampleParams p) {
    __shared__ SampleSmem s;
    pdl_start();
    const SampleConfig c = *(const SampleConfig*)p.cfg;
    const float* lg = (const float*)p.logits;
    u32 fin = 0;
#pragma unroll 8
    for (int i = threadIdx.x; i < p.n; i += blockDim.x) fin += isfinite(lg[i]);
    if (threadIdx.x == 0) s.n_finite = 0;
    __syncthreads();
    atomicAdd(&s.n_finite, fin);
    __syncthreads();
    StepState* st = (StepState*)p.state;
    if (s.n_finite == 0) {  // like the host: arg-max of the raw logits (+inf wins, NaN never)
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < p.n; i += blockDim.x)
            if (lg[i] == lg[i]) better(bv, bi, lg[i], i);
        block_argmax(bv, bi, s.pr, (int*)s.scan);
        if (threadIdx.x == 0) {
            st->token = bi == 0x7fffffff ? 0u : (u32)bi;
            st->pos += 1;
        }
        return;
    }
    if (c.top_p >= 1.f && (c.top_k == 0 || c.top_k >= (int)s.n_finite)) {
        u32 tok = walk_vocab(lg, p.n, c, s, (u64*)p.rng);
        if (threadIdx.x == 0) {
            st->token = tok;
            st->pos += 1;
        }
        return;
    }
    int k = min(min(c.top_k, SAMPLE_MAX_K), (int)s.n_finite);
    u32 thr, take;
    select_kth(lg, p.n, c.temperature, k, s, thr, take);
    gather(lg, p.n, c.temperature, thr, take, s);
    sort_candidates(s);
    int t = threadIdx.x;
    float mx = lg[s.idx[0]] / c.temperature;
    if (t < k) s.pr[t] = (float)exp((double)(lg[s.idx[t]] / c.temperature - mx));
    __syncthreads();
    if (t != 0) return;
    // Sequential in sorted order, exactly as the host sums and walks.
    float sum = 0.f;
    for (int i = 0; i < k; i++) sum += s.pr[i];
    for (int i = 0; i < k; i++) s.pr[i] /= sum;
    int keep = k;
    if (c.top_p < 1.f) {
        float acc = 0.f;
        for (int i = 0; i < k; i++) {
            acc += s.pr[i];
            if (acc >= c.top_p) { keep = i + 1; break; }
        }
    }
    if (c.min_p > 0.f) {
        float floor = s.pr[0] * c.min_p;
        int n = 0;
        while (n < k && s.pr[n] >= floor) n++;
        keep = min(keep, max(n, 1));
    }
    float total = 0.f;
    for (int i = 0; i < keep; i++) total += s.pr[i];
    float r = next_f32((u64*)p.rng) * total;
    u32 tok = s.idx[keep - 1];
    for (int i = 0; i < keep; i++) {
        r -= s.pr[i];
        if (r < 0.f) { tok = s.idx[i]; break; }
    }
    st->token = tok;
    st->pos += 1;
}
