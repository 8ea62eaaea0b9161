// Greedy token choice on the device: per-block arg-max, then one block merges the partials in
// order, writes the next token into the step state and advances the position.
struct ArgmaxParams {
    u64 logits;   // const float* [n]
    u64 part_v;   // float* [n_blocks]
    u64 part_i;   // int* [n_blocks]
    u64 state;    // StepState*
    u64 publish;  // host-mapped StepState [STATE_RING] or 0 (finish_step)
    int n;
    int n_blocks;
};
SIZE_IS(ArgmaxParams, 48); FIELD_AT(ArgmaxParams, logits, 0); FIELD_AT(ArgmaxParams, part_v, 8);
FIELD_AT(ArgmaxParams, part_i, 16); FIELD_AT(ArgmaxParams, state, 24); FIELD_AT(ArgmaxParams, publish, 32);
FIELD_AT(ArgmaxParams, n, 40); FIELD_AT(ArgmaxParams, n_blocks, 44);


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

// The logits of the ids a constraint does not allow (bit id % 32 of mask[id / 32] clear) to
// -inf, as the host's TokenMask::mask does, before the choice (the arg-max or the sampler,
// which then see what the host's would): a constrained decode chooses on the device and only
// its token comes back. grid ceil(n / 256), 256 threads.
struct MaskLogitsParams {
    u64 logits;  // float* [n]
    u64 mask;    // const u32* [ceil(n / 32)]
    int n;
    int pad;
};
SIZE_IS(MaskLogitsParams, 24); FIELD_AT(MaskLogitsParams, logits, 0); FIELD_AT(MaskLogitsParams, mask, 8);
FIELD_AT(MaskLogitsParams, n, 16); FIELD_AT(MaskLogitsParams, pad, 20);

extern "C" __global__ void mask_logits(const MaskLogitsParams p) {
    pdl_start();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n && !(((const u32*)p.mask)[i >> 5] >> (i & 31) & 1)) ((float*)p.logits)[i] = -INFINITY;
}

__device__ __forceinline__ void argmax_final_unit(const ArgmaxParams& p, float* sv, int* si) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    // Through L2 (ld.cg): in head_argmax other blocks of the same grid wrote them.
    for (int i = threadIdx.x; i < p.n_blocks; i += blockDim.x)
        better(bv, bi, __ldcg((const float*)p.part_v + i), __ldcg((const int*)p.part_i + i));
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) finish_step((StepState*)p.state, bi == 0x7fffffff ? 0u : (u32)bi, p.publish);  // all NaN: token 0, like sampling::argmax
}

extern "C" __global__ void argmax_final(const ArgmaxParams p) {
    __shared__ float sv[32];
    __shared__ int si[32];
    pdl_start();
    argmax_final_unit(p, sv, si);
}

// ---- Sampling on the device: temperature + top-k (1..=1024) + top-p + min-p, top-p without
// top-k (the nucleus), or no cut at all (the vocabulary-order walk), SplitMix64 draw. Four
// launches: sample_partial's blocks each take a SAMPLE_CHUNK of the logits, count its finite
// ones, note their maximum and keep its k best; sample_walk's blocks (no cut, nucleus) weigh the
// vocabulary and sum the walk's chunks, or the nucleus's buckets; sample_edge's blocks (nucleus)
// gather the bucket the cut falls in; sample_topk's one block selects the k best of the
// candidates and draws, or finds the nucleus's cut and walks it, or walks the chunk sums. Why:
// one block reading the 152k logits 7 times (radix passes, gather) took ~0.32 ms a token, 19%
// of a sampled token, and its walk ~0.16 ms (docs/performance.md).
// Mirrors q4moe_model::Sampler step for step: the k largest of logit / temperature (ties: lower
// id first), sorted; probabilities exp(v - max) summed in sorted order and normalised; top-p and
// min-p cut in sorted order; r = u * kept mass walked in sorted order. exp is evaluated in double
// and rounded, so it agrees with the host's correctly rounded expf except in rare ties.
struct SampleConfig {
    float temperature;  // > 0 (unread by the greedy path's penalties)
    int top_k;          // 1..=SAMPLE_MAX_K, or 0 (off)
    float top_p;        // (0, 1]; 1 = off
    float min_p;        // [0, 1]; 0 = off
    float repetition;   // > 0; 1 = off
    float presence;     // 0 = off
    float frequency;    // 0 = off
    int pad;
};
SIZE_IS(SampleConfig, 32); FIELD_AT(SampleConfig, temperature, 0); FIELD_AT(SampleConfig, top_k, 4);
FIELD_AT(SampleConfig, top_p, 8); FIELD_AT(SampleConfig, min_p, 12); FIELD_AT(SampleConfig, repetition, 16);
FIELD_AT(SampleConfig, presence, 20); FIELD_AT(SampleConfig, frequency, 24); FIELD_AT(SampleConfig, pad, 28);

struct SampleParams {
    u64 logits;  // const float* [n]
    u64 state;   // StepState*: token written, pos advanced
    u64 publish; // host-mapped StepState [STATE_RING] or 0 (finish_step)
    u64 cfg;     // const SampleConfig*
    u64 rng;     // u64* SplitMix64 state (advanced once per draw)
    u64 work;    // with a cut, sample_partial's candidates: u32 [n_blocks * kc] keys, then u32
                 // [n_blocks * kc] ids, block b's at b * kc (kc = min(top_k, SAMPLE_MAX_K)) in id
                 // order, key 0 past them; without, sample_walk's (which runs after sample_partial
                 // and takes the same memory): f32 [n] weights, f32 [WALK_CHUNKS] chunk sums, u32
                 // [WALK_CHUNKS] each chunk's last weighted id
    u64 finite;  // u32 [n_blocks]: finite logits of each block's chunk, then f32 [n_blocks] their
                 // maxima of logit / temperature (-inf: none)
    u64 nucleus; // top-p without top-k: u64 [256] fixed-point weights a bucket, then u32 the
                 // edge's length (sample_partial zeroes them); the weights and the edge's weight
                 // bits and ids are in `work`: f32 [n], u32 [n], u32 [n]
    u64 counts;  // u32 [n]: each id's count in the request's history and draws (penalties)
    int n;
    int n_blocks;  // ceil(n / SAMPLE_CHUNK)
    int walk_cpb;  // chunks a sample_walk block sums
};
SIZE_IS(SampleParams, 88); FIELD_AT(SampleParams, logits, 0); FIELD_AT(SampleParams, state, 8);
FIELD_AT(SampleParams, publish, 16); FIELD_AT(SampleParams, cfg, 24); FIELD_AT(SampleParams, rng, 32);
FIELD_AT(SampleParams, work, 40); FIELD_AT(SampleParams, finite, 48); FIELD_AT(SampleParams, nucleus, 56);
FIELD_AT(SampleParams, counts, 64); FIELD_AT(SampleParams, n, 72); FIELD_AT(SampleParams, n_blocks, 76);
FIELD_AT(SampleParams, walk_cpb, 80);

#define SAMPLE_MAX_K 1024
#define SAMPLE_CHUNK 4096  // logits a sample_partial block takes: 4 a thread
#define WALK_CHUNKS 1024   // the no-cut walk's chunks (q4moe_model::sampling::WALK_CHUNKS)

__device__ __forceinline__ float next_f32(u64* state) {
    u64 z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) / 16777216.f;
}

struct SampleSmem {
    u32 hist[256];
    u64 whist[256];  // the nucleus: fixed-point weights a bin
    u32 key[SAMPLE_MAX_K];
    u32 idx[SAMPLE_MAX_K];
    float pr[SAMPLE_MAX_K];
    u32 scan[SAMPLE_MAX_K];
    u32 scan_in[SAMPLE_MAX_K];
    u32 bin, before, n_finite, tok;
    u64 wbefore;
};

// Where select_kth and gather find candidates: n slots in id order, key(i) the order-preserving
// key of slot i's logit / temperature, or 0 (never a finite logit's key) for no candidate.
// The logits of one chunk (ids from `base`), non-finite ones no candidates:
struct LogitSrc {
    const float* lg;
    int n, base;
    float t;
    __device__ __forceinline__ u32 key(int i) const {
        float x = lg[i];
        return isfinite(x) ? float_key(x / t) : 0u;
    }
    __device__ __forceinline__ u32 id(int i) const { return (u32)(base + i); }
};
// sample_partial's candidates (SampleParams::work), read through L2 (another grid wrote them):
struct CandSrc {
    const u32* keys;
    const u32* ids;
    int n;
    __device__ __forceinline__ u32 key(int i) const { return __ldcg(keys + i); }
    __device__ __forceinline__ u32 id(int i) const { return __ldcg(ids + i); }
};

// Where a 256-bin histogram's running sum, from the top bin down (`desc`) or from bin 0 up,
// reaches `want` (>= 1, at most the total): that bin into *bin and the sum of the bins before it
// into *before, by the one lane that finds it. Warp 0, lane l holding the bins 8l .. 8l + 7 of
// that order: a scan of the lanes' sums finds the lane (a thread walking 256 bins in order took
// ~5 us a pass). T: u32 counts or u64 fixed-point weights.
template <class T>
__device__ __forceinline__ void crossing(const T* hist, bool desc, T want, u32* bin, T* before) {
    int lane = threadIdx.x;
    T h[8], own = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) own += h[j] = hist[desc ? 255 - 8 * lane - j : 8 * lane + j];
    T upto = own;  // inclusive: this lane's bins and every earlier one
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        T v = __shfl_up_sync(0xffffffff, upto, o);
        if (lane >= o) upto += v;
    }
    T acc = upto - own;
    if (acc >= want || upto < want) return;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (acc + h[j] >= want) {
            *bin = desc ? 255 - 8 * lane - j : 8 * lane + j;
            *before = acc;
            return;
        }
        acc += h[j];
    }
}

// One 8-bit pass of a radix select (every thread calls it): `fill` adds each candidate to the
// zeroed 256-bin histogram `hist` (its digit at `shift`, when its higher digits match `prefix`
// under `mask`), then the bin where the running sum from the top bin (`desc`) or from bin 0
// reaches `want` joins `prefix`, and what the bins before it hold leaves `want`. T: u32 counts
// (before: &s.before) or u64 fixed-point weights (&s.wbefore).
template <class T, class Fill>
__device__ __forceinline__ void radix_pass(T* hist, T* before, bool desc, int shift, u32& prefix, u32& mask, T& want,
                                           SampleSmem& s, Fill fill) {
    if (threadIdx.x < 256) hist[threadIdx.x] = 0;
    __syncthreads();
    fill();
    __syncthreads();
    if (threadIdx.x < 32) crossing(hist, desc, want, &s.bin, before);
    __syncthreads();
    prefix |= s.bin << shift;
    want -= *before;
    mask |= 255u << shift;
    __syncthreads();
}

// The loops over the logits are unrolled so several loads per thread are in flight (a rolled
// loop waits one L2 round trip per element).
// Key of the k-th largest candidate (radix select, 8 bits a pass) and how many candidates equal
// to it are taken (the lowest ids). Needs k <= the number of candidates.
template <class Src>
__device__ void select_kth(const Src& src, int k, SampleSmem& s, u32& thr, u32& take) {
    u32 prefix = 0, mask = 0, want = (u32)k;
    for (int shift = 24; shift >= 0; shift -= 8)
        radix_pass(s.hist, &s.before, true, shift, prefix, mask, want, s, [&] {
#pragma unroll 4
            for (int base = 0; base < src.n; base += blockDim.x) {  // whole warps: match_any
                int i = base + threadIdx.x;
                u32 key = i < src.n ? src.key(i) : 0u;
                // One atomic a warp and bin: the first passes' keys crowd into a few bins.
                u32 bin = key != 0 && (key & mask) == prefix ? (key >> shift) & 255 : 256;
                unsigned peers = __match_any_sync(0xffffffff, bin);
                if (bin < 256 && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&s.hist[bin], (u32)__popc(peers));
            }
        });
    thr = prefix;
    take = want;
}

// Exclusive prefix sum of v over the block's threads (v[threadIdx.x] is this thread's value;
// blockDim.x <= SAMPLE_MAX_K), returned; v is left holding the inclusive sums.
__device__ u32 block_scan(u32* v) {
    u32 own = v[threadIdx.x];
    __syncthreads();
    for (int o = 1; o < (int)blockDim.x; o <<= 1) {  // inclusive Hillis-Steele scan
        u32 a = threadIdx.x >= o ? v[threadIdx.x - o] : 0;
        __syncthreads();
        v[threadIdx.x] += a;
        __syncthreads();
    }
    return v[threadIdx.x] - own;
}

// Stores the k candidates select_kth chose -- every key above thr, and the `take` lowest ids
// equal to it -- in id order at out_key / out_id (per-thread contiguous ranges and two
// exclusive scans give both the ties' ranks and the stores' places). Ends with a barrier.
template <class Src>
__device__ void gather(const Src& src, u32 thr, u32 take, SampleSmem& s, u32* out_key, u32* out_id) {
    int chunk = (src.n + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk, hi = min(src.n, lo + chunk);
    u32 eq = 0, gt = 0;
#pragma unroll 4
    for (int i = lo; i < hi; i++) {
        u32 key = src.key(i);
        eq += key == thr;  // thr is a candidate's key, never 0
        gt += key > thr;
    }
    s.scan[threadIdx.x] = eq;
    u32 rank = block_scan(s.scan);  // ties before this thread's range
    u32 mine = rank >= take ? 0 : min(eq, take - rank);
    s.scan_in[threadIdx.x] = gt + mine;
    u32 at = block_scan(s.scan_in);
    for (int i = lo; i < hi; i++) {
        u32 key = src.key(i);
        if (key == 0 || key < thr || (key == thr && rank++ >= take)) continue;
        out_key[at] = key;
        out_id[at] = src.id(i);
        at++;
    }
    __syncthreads();
}

// Bitonic sort of the first `count` (<= SAMPLE_MAX_K) candidates (key desc, id asc), padded to
// a power of two with slots that sort last.
__device__ void sort_candidates(SampleSmem& s, int count) {
    int t = threadIdx.x, n2 = 2;
    while (n2 < count) n2 <<= 1;
    if (t >= count) { s.key[t] = 0; s.idx[t] = 0xffffffffu; }
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            int j = t ^ stride;
            if (j > t && j < n2) {
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

// The block's sum of the threads' v, to every thread (barriers).
__device__ u32 block_total(u32 v, SampleSmem& s) {
    if (threadIdx.x == 0) s.n_finite = 0;
    __syncthreads();
    atomicAdd(&s.n_finite, v);
    __syncthreads();
    return s.n_finite;
}

// The block's maximum of the threads' m, to every thread (barriers; exact in any order).
// `part`: 32 floats of shared memory.
__device__ float block_max(float m, float* part) {
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, part[w]);
    __syncthreads();
    return m;
}

// What the partials say (every thread of the block gets it): the finite logits, and the
// maximum of logit / temperature over them.
struct Finite {
    u32 n;
    float max;
};
__device__ Finite read_finite(const SampleParams& p, SampleSmem& s) {
    u32 fin = 0;
    float m = -INFINITY;
    const u32* f = (const u32*)p.finite;
    for (int b = threadIdx.x; b < p.n_blocks; b += blockDim.x) {
        fin += __ldcg(f + b);
        m = fmaxf(m, __ldcg((const float*)f + p.n_blocks + b));
    }
    return Finite{block_total(fin, s), block_max(m, s.pr)};
}

// What the draw does, as the host's sample_stochastic picks: the vocabulary-order walk (no
// top-k cut, no top-p), the nucleus (top-p without top-k), or the top-k candidates.
enum SampleMode { MODE_TOPK, MODE_WALK, MODE_NUCLEUS };
__device__ __forceinline__ SampleMode sample_mode(const SampleConfig& c, u32 n_finite) {
    if (c.top_p >= 1.f && (c.top_k == 0 || c.top_k >= (int)n_finite)) return MODE_WALK;
    return c.top_k == 0 ? MODE_NUCLEUS : MODE_TOPK;
}

// The nucleus as the host's sample_nucleus finds it: weights in [0, 1] in fixed point
// (q4moe_model::sampling::nucleus_fixed: integers, so the sums agree in any order) over 256
// quarter-octave buckets (bucket 0 holds the best), the target top_p of their total
// (nucleus_target), the bucket where the running sum reaches it, then within that bucket (the
// edge) the token, best first and ties by id, where it does.
__device__ __forceinline__ u32 nuc_bucket(float w) { return min((0x3f800000u - __float_as_uint(w)) >> 21, 255u); }
__device__ __forceinline__ u64 nuc_fixed(float w) { return __float2ull_rz(w * 1099511627776.f); }

// Adds v to hist[bin] with one atomic a warp and bin (bin 256: nothing), the whole warp
// calling: integers, so the order does not matter.
__device__ __forceinline__ void warp_add(u64* hist, u32 bin, u64 v) {
    unsigned peers = __match_any_sync(0xffffffff, bin);
    u64 sum = 0;
    for (int j = 0; j < 32; j++) {
        u64 o = __shfl_sync(0xffffffff, v, j);
        if (peers >> j & 1) sum += o;
    }
    if (bin < 256 && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd((unsigned long long*)hist + bin, (unsigned long long)sum);
}

// The edge: the bucket the nucleus's cut falls in, and what its tokens must still add (>= 1).
struct NucEdge {
    u32 bucket;
    u64 rest;
};
__device__ NucEdge nucleus_edge(const SampleParams& p, const SampleConfig& c, SampleSmem& s) {
    const u64* h = (const u64*)p.nucleus;
    if (threadIdx.x < 256) s.whist[threadIdx.x] = __ldcg((const unsigned long long*)h + threadIdx.x);
    __syncthreads();
    if (threadIdx.x < 32) {
        u64 total = 0;
        for (int j = 0; j < 8; j++) total += s.whist[8 * threadIdx.x + j];
        total = warp_sum(total);
        u64 t = __double2ull_rz((double)c.top_p * __ull2double_rn(total));  // nucleus_target
        t = min(max(t, 1ull), max(total, 1ull));
        s.bin = 255;  // the host's last bucket when no running sum reaches the target
        s.wbefore = t;
        __syncwarp();
        crossing(s.whist, false, t, &s.bin, &s.wbefore);
        __syncwarp();
        if (threadIdx.x == 0) s.wbefore = t - s.wbefore;
    }
    __syncthreads();
    NucEdge e{s.bin, s.wbefore};
    __syncthreads();
    return e;
}

// The nucleus's weights (before the min-p floor, which applies after the cut) of ids [i0, i1)
// into SampleParams::work, and their fixed-point sums a bucket into the global buckets.
__device__ void nucleus_weights(const SampleParams& p, const SampleConfig& c, float max, int i0, int i1, SampleSmem& s) {
    if (threadIdx.x < 256) s.whist[threadIdx.x] = 0;
    __syncthreads();
    const float* lg = (const float*)p.logits;
    for (int base = i0; base < i1; base += blockDim.x) {  // whole warps: warp_add
        int i = base + threadIdx.x;
        float v = i < i1 ? vocab_weight(lg, i, c.temperature, max, 0.f) : 0.f;
        if (i < i1) ((float*)p.work)[i] = v;
        warp_add(s.whist, v > 0.f ? nuc_bucket(v) : 256u, nuc_fixed(v));
    }
    __syncthreads();
    if (threadIdx.x < 256 && s.whist[threadIdx.x] != 0)
        atomicAdd((unsigned long long*)p.nucleus + threadIdx.x, (unsigned long long)s.whist[threadIdx.x]);
}

// The no-cut walk's chunks (the host's walk_unsorted): WALK_CHUNKS of len = ceil(n /
// WALK_CHUNKS) ids, each summed in id order. Block b of ceil(WALK_CHUNKS / cpb) (cpb chunks a
// block, dynamic smem cpb * len floats) writes its ids' weights exp(v / t - max) (0: non-finite
// or under the min-p floor) to SampleParams::work and to shared memory, then thread j sums chunk
// b * cpb + j and notes its last weighted id. The nucleus: the same ids' weights and bucket sums
// (nucleus_weights). Nothing to do with a top-k cut.
extern "C" __global__ void sample_walk(const SampleParams p) {
    extern __shared__ float ws[];
    __shared__ SampleSmem s;
    pdl_start();
    const SampleConfig c = *(const SampleConfig*)p.cfg;
    Finite f = read_finite(p, s);
    SampleMode mode = f.n == 0 ? MODE_TOPK : sample_mode(c, f.n);  // none: arg-max
    int len = (p.n + WALK_CHUNKS - 1) / WALK_CHUNKS, cpb = p.walk_cpb, c0 = blockIdx.x * cpb;
    int i0 = c0 * len, i1 = min(p.n, i0 + cpb * len);
    if (mode == MODE_NUCLEUS) return nucleus_weights(p, c, f.max, i0, i1, s);
    if (mode != MODE_WALK) return;
    float t = c.temperature, floor = fmaxf(c.min_p, 0.f);
    float* w = (float*)p.work;
    const float* lg = (const float*)p.logits;
#pragma unroll 4
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        float v = vocab_weight(lg, i, t, f.max, floor);
        w[i] = v;
        ws[i - i0] = v;
    }
    __syncthreads();
    int j = threadIdx.x, ch = c0 + j;
    if (j >= cpb || ch >= WALK_CHUNKS) return;
    float sum = 0.f;
    u32 last = 0;
    for (int i = ch * len; i < min(p.n, (ch + 1) * len); i++) {
        float v = ws[i - i0];
        if (v > 0.f) { sum += v; last = (u32)i; }
    }
    w[p.n + ch] = sum;
    ((u32*)w)[p.n + WALK_CHUNKS + ch] = last;
}

// The walk's draw over chunk sums in s.pr and last weighted ids in s.idx (WALK_CHUNKS, staged
// by the caller, who ends with a barrier): thread 0 sums the chunk sums in order, draws, skips
// every chunk the remainder covers; the block stages the chunk it falls in (`weight(i)`: id i's
// weight); thread 0 walks it. The same numbers added in the same order as the host's
// walk_unsorted. Thread 0 returns the token.
template <class W>
__device__ u32 walk_draw(const SampleParams& p, SampleSmem& s, const W& weight) {
    int len = (p.n + WALK_CHUNKS - 1) / WALK_CHUNKS;
    __shared__ float rest;
    __shared__ int at;
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int k = 0; k < WALK_CHUNKS; k++) total += s.pr[k];
        float r = next_f32((u64*)p.rng) * total;
        u32 tok = 0;
        at = -1;
        for (int k = 0; k < WALK_CHUNKS; k++) {
            float ck = s.pr[k];
            if (ck == 0.f) continue;
            if (r >= ck) { r -= ck; tok = s.idx[k]; continue; }
            at = k;
            break;
        }
        rest = r;
        s.tok = tok;  // where rounding never reaches a chunk
    }
    __syncthreads();
    if (at < 0) return s.tok;
    int i0 = at * len, n = min(p.n - i0, len), staged = min(n, SAMPLE_MAX_K);
    for (int i = threadIdx.x; i < staged; i += blockDim.x) s.scan[i] = __float_as_uint(weight(i0 + i));
    __syncthreads();
    if (threadIdx.x != 0) return 0;
    float r = rest;
    u32 tok = s.tok;
    for (int i = 0; i < n; i++) {  // past `staged` (vocabularies over a million): unstaged
        float v = i < staged ? __uint_as_float(s.scan[i]) : weight(i0 + i);
        if (v > 0.f) {
            tok = (u32)(i0 + i);
            r -= v;
            if (r < 0.f) return tok;
        }
    }
    return tok;
}

// The no-cut draw over sample_walk's chunk sums.
__device__ u32 walk_chunks(const SampleParams& p, SampleSmem& s) {
    const float* w = (const float*)p.work;
    for (int ch = threadIdx.x; ch < WALK_CHUNKS; ch += blockDim.x) {
        s.pr[ch] = __ldcg(w + p.n + ch);
        s.idx[ch] = __ldcg((const u32*)w + p.n + WALK_CHUNKS + ch);
    }
    __syncthreads();
    return walk_draw(p, s, [w](int i) { return __ldcg(w + i); });
}

// The nucleus's cut in its edge (sample_edge's list of weight bits and ids): a radix select over
// the weight bits, best first, weighted by the fixed-point weights, finds the cut's weight and
// what its ties must still add; the ties go by id, so a count select over their ids finds the
// last one taken. Every thread gets (weight bits, id).
__device__ uint2 nucleus_cut(const SampleParams& p, NucEdge e, SampleSmem& s) {
    const u32* ek = (const u32*)p.work + p.n;
    const u32* ei = ek + p.n;
    u32 n = __ldcg((const u32*)((const u64*)p.nucleus + 256));
    u32 prefix = 0, mask = 0;
    u64 want = e.rest;
    for (int shift = 24; shift >= 0; shift -= 8)
        radix_pass(s.whist, &s.wbefore, true, shift, prefix, mask, want, s, [&] {
            for (int base = 0; base < (int)n; base += blockDim.x) {  // whole warps: warp_add
                int i = base + threadIdx.x;
                u32 key = i < (int)n ? __ldcg(ek + i) : 0u;
                bool in = i < (int)n && (key & mask) == prefix;
                warp_add(s.whist, in ? (key >> shift) & 255 : 256u, nuc_fixed(__uint_as_float(key)));
            }
        });
    u64 q = nuc_fixed(__uint_as_float(prefix));  // > 0: the cut adds to the running sum
    u32 ties = (u32)((want + q - 1) / q), id = 0, imask = 0;
    for (int shift = 24; shift >= 0; shift -= 8)
        radix_pass(s.hist, &s.before, false, shift, id, imask, ties, s, [&] {
            for (int i = threadIdx.x; i < (int)n; i += blockDim.x) {
                u32 d = __ldcg(ei + i);
                if (__ldcg(ek + i) == prefix && (d & imask) == id) atomicAdd(&s.hist[(d >> shift) & 255], 1u);
            }
        });
    return make_uint2(prefix, id);
}

// The nucleus's draw: the cut, then the walk over the kept weights (at least as good as the
// cut, and at or above the min-p floor), each chunk's sum by a thread (blockDim = WALK_CHUNKS).
__device__ u32 nucleus_draw(const SampleParams& p, const SampleConfig& c, SampleSmem& s) {
    uint2 cut = nucleus_cut(p, nucleus_edge(p, c, s), s);
    const float* w = (const float*)p.work;
    float floor = fmaxf(c.min_p, 0.f);
    auto kept = [=](int i) {
        float v = __ldcg(w + i);
        u32 b = __float_as_uint(v);
        bool in = b > cut.x || (b == cut.x && (u32)i <= cut.y);
        return in && v >= floor ? v : 0.f;
    };
    int len = (p.n + WALK_CHUNKS - 1) / WALK_CHUNKS, ch = threadIdx.x;
    float sum = 0.f;
    u32 last = 0;
#pragma unroll 8
    for (int i = ch * len; i < min(p.n, (ch + 1) * len); i++) {  // 8 of its L2 loads in flight
        float v = kept(i);
        if (v > 0.f) { sum += v; last = (u32)i; }
    }
    s.pr[ch] = sum;
    s.idx[ch] = last;
    __syncthreads();
    return walk_draw(p, s, kept);
}

// The nucleus's edge (every token of the bucket its cut falls in: weight bits and id, in no
// order) after sample_walk's bucket sums; block b takes ids [b * SAMPLE_CHUNK, ..) as
// sample_partial's. Nothing to do otherwise.
extern "C" __global__ void __launch_bounds__(SAMPLE_MAX_K) sample_edge(const SampleParams p) {
    __shared__ SampleSmem s;
    pdl_start();
    const SampleConfig c = *(const SampleConfig*)p.cfg;
    Finite f = read_finite(p, s);
    if (f.n == 0 || sample_mode(c, f.n) != MODE_NUCLEUS) return;
    u32 b = nucleus_edge(p, c, s).bucket;
    int i0 = blockIdx.x * SAMPLE_CHUNK, i1 = min(p.n, i0 + SAMPLE_CHUNK);
    const float* w = (const float*)p.work;
    u32* ek = (u32*)p.work + p.n;
    u32* count = (u32*)((u64*)p.nucleus + 256);
    for (int base = i0; base < i1; base += blockDim.x) {  // whole warps: the ballot
        int i = base + threadIdx.x, lane = threadIdx.x & 31;
        float v = i < i1 ? __ldcg(w + i) : 0.f;
        bool in = v > 0.f && nuc_bucket(v) == b;
        unsigned ballot = __ballot_sync(0xffffffff, in);  // one atomic a warp
        u32 at = 0;
        if (lane == 0 && ballot) at = atomicAdd(count, (u32)__popc(ballot));
        at = __shfl_sync(0xffffffff, at, 0) + __popc(ballot & ((1u << lane) - 1));
        if (!in) continue;
        ek[at] = __float_as_uint(v);
        ek[p.n + at] = (u32)i;
    }
}

// Candidates a block keeps: the top-k of the cut (sample_topk), at most SAMPLE_MAX_K.
__device__ __forceinline__ int cand_stride(const SampleConfig& c) { return min(c.top_k, SAMPLE_MAX_K); }

// Block b (SAMPLE_MAX_K threads) of ceil(n / SAMPLE_CHUNK): its chunk's finite count, and its
// min(kc, finite) best logits as candidates (SampleParams::work), in id order, and its maximum
// of logit / temperature (the no-cut walk's). The global k
// best are among them: a logit outside its chunk's kc best has kc better ones.
extern "C" __global__ void __launch_bounds__(SAMPLE_MAX_K) sample_partial(const SampleParams p) {
    __shared__ SampleSmem s;
    pdl_start();
    const SampleConfig c = *(const SampleConfig*)p.cfg;
    int b = blockIdx.x, i0 = b * SAMPLE_CHUNK, i1 = min(p.n, i0 + SAMPLE_CHUNK);
    const float* lg = (const float*)p.logits;
    u32 fin = 0;
    float m = -INFINITY;
#pragma unroll 4
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        float x = lg[i];
        if (isfinite(x)) {
            fin++;
            m = fmaxf(m, x / c.temperature);
        }
    }
    m = block_max(m, s.pr);
    fin = block_total(fin, s);
    if (b == 0 && threadIdx.x <= 256) ((u64*)p.nucleus)[threadIdx.x] = 0;  // buckets, edge length
    if (threadIdx.x == 0) {
        ((u32*)p.finite)[b] = fin;
        ((float*)p.finite)[p.n_blocks + b] = m;
    }
    if (c.top_k <= 0) return;  // no top-k cut: the walk or the nucleus
    int kc = cand_stride(c), k = min(kc, (int)fin);
    u32* keys = (u32*)p.work + b * kc;
    u32* ids = (u32*)p.work + p.n_blocks * kc + b * kc;
    for (int j = k + threadIdx.x; j < kc; j += blockDim.x) keys[j] = 0;  // no candidate
    if (k == 0) return;
    LogitSrc src{lg + i0, i1 - i0, i0, c.temperature};
    u32 thr, take;
    select_kth(src, k, s, thr, take);
    gather(src, thr, take, s, keys, ids);
}

// One block of SAMPLE_MAX_K threads, after sample_partial.
extern "C" __global__ void __launch_bounds__(SAMPLE_MAX_K) sample_topk(const SampleParams p) {
    __shared__ SampleSmem s;
    pdl_start();
    const SampleConfig c = *(const SampleConfig*)p.cfg;
    const float* lg = (const float*)p.logits;
    u32 n_finite = read_finite(p, s).n;
    StepState* st = (StepState*)p.state;
    if (n_finite == 0) {  // like the host: arg-max of the raw logits (+inf wins, NaN never)
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < p.n; i += blockDim.x)
            if (lg[i] == lg[i]) better(bv, bi, lg[i], i);
        block_argmax(bv, bi, s.pr, (int*)s.scan);
        if (threadIdx.x == 0) finish_step(st, bi == 0x7fffffff ? 0u : (u32)bi, p.publish);
        return;
    }
    SampleMode mode = sample_mode(c, n_finite);
    if (mode != MODE_TOPK) {
        u32 tok = mode == MODE_WALK ? walk_chunks(p, s) : nucleus_draw(p, c, s);
        if (threadIdx.x == 0) finish_step(st, tok, p.publish);
        return;
    }
    int kc = cand_stride(c), k = min(kc, (int)n_finite);
    const u32* cand = (const u32*)p.work;
    CandSrc src{cand, cand + p.n_blocks * kc, p.n_blocks * kc};
    u32 thr, take;
    select_kth(src, k, s, thr, take);
    gather(src, thr, take, s, s.key, s.idx);
    sort_candidates(s, k);
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
    finish_step(st, tok, p.publish);
}

// The host sampler's penalties (q4moe_model::sampling::Sampler::apply_penalties) on the logits,
// in place, before the step's choice: each id the history or an earlier draw holds (counts > 0)
// has its logit divided (positive) or multiplied by the repetition penalty, then the presence
// penalty plus the frequency penalty times its count subtracted. Each logit on its own, in the
// host's order and rounding (no contraction into fma), so the choice sees the host's floats.
extern "C" __global__ void sample_penalize(const SampleParams p) {
    pdl_start();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n) return;
    u32 k = __ldcg((const u32*)p.counts + i);
    if (k == 0) return;
    const SampleConfig c = *(const SampleConfig*)p.cfg;
    float* lg = (float*)p.logits;
    float l = lg[i];
    if (c.repetition != 1.f) l = l > 0.f ? __fdiv_rn(l, c.repetition) : __fmul_rn(l, c.repetition);
    lg[i] = __fsub_rn(l, __fadd_rn(c.presence, __fmul_rn(c.frequency, (float)k)));
}

// The step's choice counted (after it), for the next step's penalties.
extern "C" __global__ void sample_count(const SampleParams p) {
    pdl_start();
    if (threadIdx.x == 0) ((u32*)p.counts)[((const StepState*)p.state)->token] += 1;
}
