// The quantised weights' side of the dots, compiled right after common.cuh: the split types'
// layouts (Q4_0 / Q4_K / Q6_K as repacked, src/repack.rs), their 32-weight pieces (loads, L2
// prefetch, unpacking, the float and integer dot against a group of activations), the staged
// BlockRows the matvec / moe / prefill kernels build on, the unsplit types' row dots (Q8_0,
// F16, F32), and the activations those dots take: padded floats or 16-bit quantised groups
// (QXW), staged by load_x / XgIn.

// Nibble byte k (0..3) of w as an exact float minus `off`, without an int->float conversion
// (quarter rate on sm_90): 0x4B0000nn is 2^23 + nn.
__device__ __forceinline__ float nib(u32 w, int k, float off) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540u + k)) - off;
}

// float4s of a row a thread loads at once in load_x_fast / XgIn (moe.cu stage_slots: twice that).
#define LOAD_V 4

// Why every loader below issues all of a thread's loads before using any: a plain strided loop
// `xs[i] = src[i]` waits one L2 round trip (~0.5 us) per iteration, n / blockDim of them in a
// row (16 for n = 4096 at 256 threads) -- that chain, not the weights, was most of each kernel.

// Activations for the integer dots (every staged mode): each group of 32 values x is held as
// 16-bit integers q with the group's scale s (x ~ s * q, |q| <= 32767: the error is 1/65534 of
// the group's largest |x|, well inside the 2e-3 parity bound), q split into a signed high byte
// and an unsigned low byte (q = 256 hi + lo), so dp4a multiplies four weights by four values in
// one instruction with exact integer sums. Why: the float dots took three instructions a weight
// (nibble to float, offset, fma) and the kernels' post-wait arithmetic is on the step's critical
// path; the integer dot takes about one. A group is QXW words: for weight word w (0..3) of a
// block, [4w] high bytes of values 4w..4w+3, [4w+1] their low bytes, [4w+2] / [4w+3] the same
// of values 16+4w..; then [16] the scale, [17] / [18] the sums of q over values 0..15 / 16..31;
// 20 words so 8 lanes' 16-byte loads of consecutive groups hit distinct banks.
#define QXW 20

// x * inv rounded to the nearest integer (|x * inv| < 2^22) without F2I, which runs at a quarter
// of the fma rate: 1.5 * 2^23 + t has an ulp of 1, so one fma leaves round(t) in the low bits.
__device__ __forceinline__ int round_small(float x, float inv) {
    return __float_as_int(fmaf(x, inv, 12582912.f)) - 0x4B400000;
}

// Stores the float4 of values 4 * i4 .. 4 * i4 + 3 (held by lane i4 & 7 of an aligned group of
// 8 lanes: all 32 lanes call it, `valid` false for values past the end) into its quantised group
// at qx + (i4 >> 3) * QXW. The group's maximum |x| is taken on the bits of |x|, so a NaN makes
// the scale NaN (and an infinity gives s * 0 = NaN): non-finite inputs are never hidden.
__device__ __forceinline__ void quant_store(u32* qx, int i4, float4 v, bool valid) {
    u32 a = max(max(__float_as_uint(v.x) & 0x7fffffffu, __float_as_uint(v.y) & 0x7fffffffu),
                max(__float_as_uint(v.z) & 0x7fffffffu, __float_as_uint(v.w) & 0x7fffffffu));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) a = max(a, __shfl_xor_sync(0xffffffff, a, o));
    // __fdividef's 2 ulp keep amax * inv below 32767.5; an infinite amax gives inv 0.
    float amax = __uint_as_float(a), inv = amax > 0.f ? __fdividef(32767.f, amax) : 0.f;
    int q0 = round_small(v.x, inv), q1 = round_small(v.y, inv);
    int q2 = round_small(v.z, inv), q3 = round_small(v.w, inv);
    int sq = q0 + q1 + q2 + q3;  // summed over this half (values 0..15 or 16..31) of the group
    sq += __shfl_xor_sync(0xffffffff, sq, 1);
    sq += __shfl_xor_sync(0xffffffff, sq, 2);
    u32 hi = __byte_perm(__byte_perm(q0 >> 8, q1 >> 8, 0x0040), __byte_perm(q2 >> 8, q3 >> 8, 0x0040), 0x5410);
    u32 lo = __byte_perm(__byte_perm(q0, q1, 0x0040), __byte_perm(q2, q3, 0x0040), 0x5410);
    int k = i4 & 7;
    if (!valid) return;
    u32* g = qx + (i4 >> 3) * QXW;
    *(uint2*)(g + 4 * (k & 3) + 2 * (k >> 2)) = make_uint2(hi, lo);
    if (k == 0) g[16] = __float_as_uint(amax * (1.f / 32767.f));
    if ((k & 3) == 0) g[17 + (k >> 2)] = (u32)sq;
}

// Where load_x_fast puts the values: plain floats, padded floats (pad_idx), or
// quantised groups (quant_store).
#define X_PLAIN 0
#define X_PAD 1
#define X_QUANT 2

// load_x for n % 4 == 0 and n <= 16 * blockDim (X_QUANT: n % 32 == 0): x (and the norm
// weights) as float4 in one go, into `dst` in layout OUT. Returns false (nothing done) for other
// shapes.
template <int OUT>
__device__ __forceinline__ bool load_x_fast(void* dst, const float* src, int n, const float* norm, float eps, float* red) {
    int nv = n >> 2;
    if ((n & (OUT == X_QUANT ? 31 : 3)) != 0 || nv > LOAD_V * (int)blockDim.x) return false;
    float4 v[LOAD_V], w[LOAD_V];
#pragma unroll
    for (int j = 0; j < LOAD_V; j++) {
        int i = threadIdx.x + j * blockDim.x;
        v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < nv) {
            v[j] = ((const float4*)src)[i];
            if (norm) w[j] = ((const float4*)norm)[i];
        }
    }
    tl_mark_after(TL_IN, v[0].x);
    float r = 1.f;
    if (norm) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < LOAD_V; j++)
            if (threadIdx.x + j * blockDim.x < nv) ss += dot4(v[j], v[j]);
        r = rsqrtf(block_sum(ss, red) / (float)n + eps);
    }
#pragma unroll
    for (int j = 0; j < LOAD_V; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (OUT == X_QUANT && (j * (int)blockDim.x) >= nv) break;  // no lane has values here
        float4 o = v[j];
        if (norm && i < nv) o = make_float4(o.x * r * w[j].x, o.y * r * w[j].y, o.z * r * w[j].z, o.w * r * w[j].w);
        if (OUT == X_QUANT) quant_store((u32*)dst, i, o, i < nv);
        else if (i < nv) *(float4*)((float*)dst + (OUT == X_PAD ? pad_idx(4 * i) : 4 * i)) = o;
    }
    __syncthreads();
    return true;
}

// x * g of the residual x as quantised groups at qx (n % 32 == 0, n <= 4 * LOAD_V * blockDim),
// g at gs, and the RMS factor s = rsqrt(mean(x^2) + eps) returned apart: a
// group's integers do not depend on s (only its scale would), so the dots take x * g and are
// multiplied by s after, and the sum of x^2 needs no barrier of its own (its warp partials in
// red[0..warps) ride on the barrier that publishes qx). Why: a block-wide sum before the
// quantisation sat on the experts' and qkv's critical paths (two barriers and a warp's
// reduction); moe_gate_up stages g in shared memory (its norm weights in registers beside the
// staged rows spilled, Q4_K).
// G_EARLY: g's loads issue with x's (g in global memory: the matvec's norm weights), not in
// the quantisation loop (g in shared memory: moe_gate_up's staged copy).
// XgIn: the loads (x's, and g's with G_EARLY) apart from the quantisation, so a kernel can
// issue them ahead of its weight loads (moe_gate_up: the chain input before the bulk loads).
// PIN_G (with G_EARLY): the sum of x^2 also waits for g, adding +0 exactly (the mask keeps the
// factor finite), so ptxas cannot sink g's loads below the sum's shuffles, where they were a
// second L2 round trip on the chain (matvec_k_mixed: Q4_K_M's QKV with a Q6_K v). Only where
// ptxas sank them: elsewhere the pin costs registers (matvec_q4_0_2 72 -> 78).
template <bool G_EARLY = false, bool PIN_G = false>
struct XgIn {
    float4 v[LOAD_V], ge[G_EARLY ? LOAD_V : 1];
    __device__ __forceinline__ void load(const float* x, const float* gs, int n) {
        int nv = n >> 2;
#pragma unroll
        for (int j = 0; j < LOAD_V; j++) {
            int i = threadIdx.x + j * blockDim.x;
            v[j] = i < nv ? ((const float4*)x)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            if (G_EARLY) ge[G_EARLY ? j : 0] = i < nv ? ((const float4*)gs)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    // The lane's own sum of x^2 (it waits for x's loads).
    __device__ __forceinline__ float own_sum() const {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < LOAD_V; j++) ss += dot4(v[j], v[j]);
        if (G_EARLY && PIN_G) {
            u32 any = 0;
#pragma unroll
            for (int j = 0; j < LOAD_V; j++) any |= __float_as_uint(ge[G_EARLY ? j : 0].x);
            ss = fmaf(0.f, __uint_as_float(any & 0x3f800000u), ss);
        }
        return ss;
    }
    __device__ __forceinline__ float quant(u32* qx, const float* gs, int n, float eps, float* red) {
        tl_mark_after(TL_IN, v[0].x);
        warp_partial(own_sum(), red);
        int nv = n >> 2;
#pragma unroll
        for (int j = 0; j < LOAD_V; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (j * (int)blockDim.x >= nv) break;  // no lane has values here
            float4 g = G_EARLY ? ge[G_EARLY ? j : 0] : i < nv ? ((const float4*)gs)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            quant_store(qx, i, mul4(v[j], g), i < nv);
        }
        __syncthreads();
        return rms_factor(red, n, eps);
    }
};
// x * g quantised (XgIn); the probe marks TL_MID once `dep` has arrived, after x's loads issue.
template <bool G_EARLY = false, bool PIN_G = false>
__device__ __forceinline__ float load_xg_quant(u32* qx, const float* x, const float* gs, int n, float eps, float* red, float dep) {
    XgIn<G_EARLY, PIN_G> in;
    in.load(x, gs, n);
    tl_mark_after(TL_MID, dep);
    return in.quant(qx, gs, n, eps, red);
}

// Loads n floats of `src` into padded shared memory; with `norm` set, applies RMSNorm:
// x * rsqrt(mean(x^2) + eps) * norm. Every block computes the same sum in the same order.
__device__ void load_x(float* xs, const float* src, int n, const float* norm, float eps, float* red) {
    if (load_x_fast<X_PAD>(xs, src, n, norm, eps, red)) return;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = src[i];
        xs[pad_idx(i)] = v;
        ss += v * v;
    }
    if (norm) {
        float tot = block_sum(ss, red);
        float r = rsqrtf(tot / (float)n + eps);
        for (int i = threadIdx.x; i < n; i += blockDim.x) xs[pad_idx(i)] = xs[pad_idx(i)] * r * norm[i];
    }
    __syncthreads();
}

// Bytes of a row of a type kept in ggml's bytes (not the split types below).
__device__ __forceinline__ u64 row_bytes(int type, int k) {
    switch (type) {
        case T_F32: return (u64)k * 4;
        case T_F16: return (u64)k * 2;
        default: return (u64)(k / 32) * 34;  // Q8_0
    }
}

// Q4_K's aux bytes a super-block of 8 blocks (Q4_KPieceT).
#define Q4_K_AUX 20
// Split types (repacked at load, src/repack.rs): a nibble plane at `data`, 16 bytes a 32-weight
// block, and an aux plane at `scales` of this many bytes 8 blocks (0: not a split type);
// aux_bytes: of `blocks` blocks (a K-quant's in whole super-blocks).
__device__ __forceinline__ int split_aux(int type) {
    return type == T_Q4_0 ? 16 : type == T_Q4_K ? Q4_K_AUX : type == T_Q6_K ? 96 : 0;
}
__device__ __forceinline__ u64 aux_bytes(int type, u64 blocks) { return blocks * (u64)split_aux(type) >> 3; }

// ---- Register-staged row pieces: the loads of several rows (and experts) are issued first,
// the arithmetic follows, so many 16-byte loads are in flight per lane.

// Sum over a block's 32 weights (nibble plane order: byte j holds weight j low, j + 16 high) of
// (nibble - off + 2^23) * x against 32 padded activations; with SX also the sum of x into sx.
template <bool SX>
__device__ __forceinline__ float nibble_dot(uint4 q, const float* x, float off, float& sx) {
    const float4* x4 = (const float4*)x;
    u32 words[4] = {q.x, q.y, q.z, q.w};
    // Two fma chains (low / high nibbles): one instruction a weight after the dequant, where
    // `s += a * x + b * y` took three for two.
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        u32 lo = words[w] & 0x0F0F0F0Fu, hi = (words[w] >> 4) & 0x0F0F0F0Fu;
        float4 xa = x4[w], xb = x4[w + 4];  // weights 4w.. (low nibbles), 16+4w.. (high)
        s0 = fmaf(nib(lo, 0, off), xa.x, s0);
        s1 = fmaf(nib(hi, 0, off), xb.x, s1);
        s0 = fmaf(nib(lo, 1, off), xa.y, s0);
        s1 = fmaf(nib(hi, 1, off), xb.y, s1);
        s0 = fmaf(nib(lo, 2, off), xa.z, s0);
        s1 = fmaf(nib(hi, 2, off), xb.z, s1);
        s0 = fmaf(nib(lo, 3, off), xa.w, s0);
        s1 = fmaf(nib(hi, 3, off), xb.w, s1);
        if (SX) sx += (xa.x + xb.x) + (xa.y + xb.y) + (xa.z + xb.z) + (xa.w + xb.w);
    }
    return s0 + s1;
}

// Integer sums of a block's 32 weight bytes against a quantised group g (see QXW): weight word w
// (bytes of weights 4w.. in `lo[w]`, of 16+4w.. in `hi[w]`, each byte < 128) times q, over
// weights 0..15 into s0 and 16..31 into s1. dp4a's high-byte and low-byte sums recombine exactly
// (|sum| < 2^31 for 6-bit weights).
__device__ __forceinline__ void byte_idot(const u32 (&lo)[4], const u32 (&hi)[4], const u32* g, int& s0, int& s1) {
    const uint4* g4 = (const uint4*)g;
    int h0 = 0, h1 = 0, l0 = 0, l1 = 0;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        uint4 x = g4[w];
        asm("dp4a.s32.s32 %0, %1, %2, %0;" : "+r"(h0) : "r"(lo[w]), "r"(x.x));
        asm("dp4a.s32.u32 %0, %1, %2, %0;" : "+r"(l0) : "r"(lo[w]), "r"(x.y));
        asm("dp4a.s32.s32 %0, %1, %2, %0;" : "+r"(h1) : "r"(hi[w]), "r"(x.z));
        asm("dp4a.s32.u32 %0, %1, %2, %0;" : "+r"(l1) : "r"(hi[w]), "r"(x.w));
    }
    s0 = h0 * 256 + l0;
    s1 = h1 * 256 + l1;
}
// The nibble plane's bytes (weight j low, j + 16 high) as byte_idot's words.
__device__ __forceinline__ void nibble_bytes(uint4 q, u32 (&lo)[4], u32 (&hi)[4]) {
#pragma unroll
    for (int w = 0; w < 4; w++) {
        u32 v = (&q.x)[w];
        lo[w] = v & 0x0F0F0F0Fu;
        hi[w] = (v >> 4) & 0x0F0F0F0Fu;
    }
}
// byte_idot of the nibble plane: integer sums of nibbles x q over weights 0..15 / 16..31.
__device__ __forceinline__ void nibble_idot(uint4 q, const u32* g, int& s0, int& s1) {
    u32 lo[4], hi[4];
    nibble_bytes(q, lo, hi);
    byte_idot(lo, hi, g, s0, s1);
}
__device__ __forceinline__ float group_scale(const u32* g) { return __uint_as_float(g[16]); }
// Sum of q over values 0..15 (half 0) or 16..31 (half 1) of a group, and over all 32.
__device__ __forceinline__ int group_half_qsum(const u32* g, int half) { return (int)g[17 + half]; }
__device__ __forceinline__ int group_qsum(const u32* g) { return group_half_qsum(g, 0) + group_half_qsum(g, 1); }

// One Q4_0 block (16 nibble bytes, f16 scale bits) against 32 padded activations.
__device__ __forceinline__ float q4_0_item(uint4 q, u16 dbits, const float* x) {
    float unused, s = nibble_dot<false>(q, x, 8388616.f, unused);  // nibble - 8
    return h2f(dbits) * s;
}
// The same against a quantised group: d * s * (sum(nibble q) - 8 sum(q)).
__device__ __forceinline__ float q4_0_item(uint4 q, u16 dbits, const u32* g) {
    int s0, s1;
    nibble_idot(q, g, s0, s1);
    return h2f(dbits) * (group_scale(g) * (float)(s0 + s1 - 8 * group_qsum(g)));
}

// A Q6_K block as repacked (src/repack.rs): low 4 bits as Q4_0's nibbles, high-bit words
// g.x (weights 0..15) and g.y (16..31) with weight 4w + b's 2 bits at bits 8b + 2w, and the
// scale word d (f16) | sub-scale of weights 0..15 (i8) << 16 | of weights 16..31 << 24.
// q6_k_bytes: its 6-bit values (0..63) as byte_idot's words.
__device__ __forceinline__ void q6_k_bytes(uint4 q, uint2 g, u32 (&lo)[4], u32 (&hi)[4]) {
    nibble_bytes(q, lo, hi);
#pragma unroll
    for (int w = 0; w < 4; w++) {
        lo[w] |= ((g.x >> (2 * w)) & 0x03030303u) << 4;
        hi[w] |= ((g.y >> (2 * w)) & 0x03030303u) << 4;
    }
}
// One Q6_K block against 32 padded activations.
__device__ __forceinline__ float q6_k_item(uint4 q, uint2 g, u32 sw, const float* x) {
    const float4* x4 = (const float4*)x;
    u32 lw[4], hw[4];
    q6_k_bytes(q, g, lw, hw);
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        u32 lo = lw[w], hi = hw[w];
        float4 xa = x4[w], xb = x4[w + 4];
        // q - 32 as an exact float without I2F (2^23 + q - (2^23 + 32))
#pragma unroll
        for (int b = 0; b < 4; b++) {
            s0 = fmaf(nib(lo, b, 8388640.f), (&xa.x)[b], s0);
            s1 = fmaf(nib(hi, b, 8388640.f), (&xb.x)[b], s1);
        }
    }
    return h2f((u16)(sw & 0xffff)) * ((float)(signed char)(sw >> 16) * s0 + (float)(signed char)(sw >> 24) * s1);
}
// The same against a quantised group: each half's sum(q6 q) - 32 sum(q) times its sub-scale.
__device__ __forceinline__ float q6_k_item(uint4 q, uint2 g, u32 sw, const u32* x) {
    u32 lo[4], hi[4];
    int s0, s1;
    q6_k_bytes(q, g, lo, hi);
    byte_idot(lo, hi, x, s0, s1);
    float a = (float)(signed char)(sw >> 16) * (float)(s0 - 32 * group_half_qsum(x, 0));
    float b = (float)(signed char)(sw >> 24) * (float)(s1 - 32 * group_half_qsum(x, 1));
    return h2f((u16)(sw & 0xffff)) * (group_scale(x) * (a + b));
}

// One Q4_K block as repacked: nibbles as Q4_0's (values 0..15), ds = d * scale and
// dm = dmin * min of the block: ds * sum(q x) - dm * sum(x), ggml's (d * sc) * q - dmin * m.
__device__ __forceinline__ float q4_k_item(uint4 q, float ds, float dm, const float* x) {
    float sx = 0.f;
    float s = nibble_dot<true>(q, x, 8388608.f, sx);
    return ds * s - dm * sx;
}
// The same against a quantised group: s * (ds sum(nibble q) - dm sum(q)).
__device__ __forceinline__ float q4_k_item(uint4 q, float ds, float dm, const u32* g) {
    int s0, s1;
    nibble_idot(q, g, s0, s1);
    return group_scale(g) * (ds * (float)(s0 + s1) - dm * (float)group_qsum(g));
}

// Weight j (0..31) of a block's nibble plane: byte j & 15, low nibble for j < 16, high after.
__device__ __forceinline__ u32 nibble(const uint4& q, int j) {
    u32 word = (&q.x)[(j & 15) >> 2], byte = (word >> (8 * (j & 3))) & 0xff;
    return j < 16 ? byte & 15 : byte >> 4;
}

// One 32-weight block of a split type in registers: load(w, block index), then dot(x) against
// its 32 padded activations (weight(j): one weight, for the embedding look-up).
struct Q4_0Piece {
    uint4 q;
    u16 d;
    __device__ __forceinline__ void load(const QW& w, u64 bi) {
        q = ((const uint4*)w.data)[bi];
        d = ((const u16*)w.scales)[bi];
    }
    __device__ __forceinline__ static void prefetch(const QW& w, u64 bi) {
        prefetch_l2((const uint4*)w.data + bi);
        prefetch_l2((const u16*)w.scales + bi);
    }
    template <class X>
    __device__ __forceinline__ float dot(const X* x) const { return q4_0_item(q, d, x); }
    __device__ __forceinline__ float weight(int j) const { return h2f(d) * (float)((int)nibble(q, j) - 8); }
};
// Q4_K aux: per super-block (8 blocks, Q4_K_AUX bytes) d | dmin << 16, then (scale, min) byte
// pairs.
// AUX32: the aux offset in 32 bits (weights.rs refuses Q4_K tensors past Q4_K_AUX32_BLOCKS),
// which shortens the address math between the expert id and the loads. The expert kernels take
// it: +0.8% on Q4_K_M in moe_gate_up_q4_k (its order pinned, moe.cu XOrder), +0.4% in
// moe_down's; the matvec's measured 0 (docs/performance.md).
template <bool AUX32>
struct Q4_KPieceT {
    uint4 q;
    u32 dm;  // d | dmin << 16 (f16 bits)
    u32 sm;  // scale | min << 8
    __device__ __forceinline__ void load(const QW& w, u64 bi) {
        q = ((const uint4*)w.data)[bi];
        u32 b32 = (u32)bi;
        const u8* a = (const u8*)w.scales + (AUX32 ? (u64)((b32 >> 3) * (u32)Q4_K_AUX) : (bi >> 3) * Q4_K_AUX);
        dm = *(const u32*)a;
        sm = *(const u16*)(a + 4 + (AUX32 ? b32 & 7 : bi & 7) * 2);
    }
    __device__ __forceinline__ static void prefetch(const QW& w, u64 bi) {
        prefetch_l2((const uint4*)w.data + bi);
        prefetch_l2((const u8*)w.scales + (AUX32 ? (u64)(((u32)bi >> 3) * (u32)Q4_K_AUX) : (bi >> 3) * Q4_K_AUX));
    }
    // d * scale and dmin * min of the block (ggml's association)
    __device__ __forceinline__ float scale() const { return h2f((u16)(dm & 0xffff)) * (float)(sm & 0xff); }
    __device__ __forceinline__ float offset() const { return h2f((u16)(dm >> 16)) * (float)(sm >> 8); }
    template <class X>
    __device__ __forceinline__ float dot(const X* x) const { return q4_k_item(q, scale(), offset(), x); }
    __device__ __forceinline__ float weight(int j) const { return scale() * (float)nibble(q, j) - offset(); }
};
using Q4_KPiece = Q4_KPieceT<false>;
// Q6_K aux: per super-block (8 blocks) 8 high-bit word pairs, then 8 scale words.
struct Q6_KPiece {
    uint4 q;
    uint2 g;
    u32 s;
    __device__ __forceinline__ void load(const QW& w, u64 bi) {
        q = ((const uint4*)w.data)[bi];
        const u8* a = (const u8*)w.scales + (bi >> 3) * 96;
        g = *(const uint2*)(a + (bi & 7) * 8);
        s = *(const u32*)(a + 64 + (bi & 7) * 4);
    }
    template <class X>
    __device__ __forceinline__ float dot(const X* x) const { return q6_k_item(q, g, s, x); }
    __device__ __forceinline__ float weight(int j) const {
        int m = j & 15;
        u32 hi = ((j < 16 ? g.x : g.y) >> (8 * (m & 3) + 2 * (m >> 2))) & 3;
        int v = (int)(nibble(q, j) | (hi << 4)) - 32;
        return h2f((u16)(s & 0xffff)) * (float)(signed char)(s >> (j < 16 ? 16 : 24)) * (float)v;
    }
};

// Split types: lane per 32-weight block, blocks lane, lane + 32, .. in order (the
// staged BlockRows use the same order, so both give the same bits).
template <class P>
__device__ float dot_blocks(const QW& w, u64 row, const float* xs, int lane) {
    int nb = w.k >> 5;
    u64 b0 = row * (u64)nb;
    float acc = 0.f;
    for (int b = lane; b < nb; b += 32) {
        P piece;
        piece.load(w, b0 + b);
        acc += piece.dot(xs + b * XS);
    }
    return acc;
}

// The unsplit types' dots: this lane's part, blocks or values lane, lane + step, ..
__device__ float dot_q8_0(const QW& w, u64 row, const float* xs, int lane, int step = 32) {
    int nb = w.k >> 5;
    const u8* base = (const u8*)w.data + row * (u64)nb * 34;
    float acc = 0.f;
    for (int b = lane; b < nb; b += step) {
        const u16* p = (const u16*)(base + (u64)b * 34);
        float d = h2f(p[0]);
        const float* x = xs + b * XS;
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u16 two = p[1 + j];
            s += (float)(signed char)(two & 0xff) * x[2 * j] + (float)(signed char)(two >> 8) * x[2 * j + 1];
        }
        acc += d * s;
    }
    return acc;
}

__device__ float dot_f32(const QW& w, u64 row, const float* xs, int lane, int step = 32) {
    const float* p = (const float*)w.data + row * (u64)w.k;
    float acc = 0.f;
#pragma unroll 8
    for (int i = lane; i < w.k; i += step) acc += p[i] * xs[pad_idx(i)];
    return acc;
}

__device__ float dot_f16(const QW& w, u64 row, const float* xs, int lane, int step = 32) {
    const u16* p = (const u16*)w.data + row * (u64)w.k;
    float acc = 0.f;
    for (int i = lane; i < w.k; i += step) acc += h2f(p[i]) * xs[pad_idx(i)];
    return acc;
}

// Elements from one 32-value group of activations to the next: padded floats, quantised words.
__device__ __forceinline__ int group_stride(const float*) { return XS; }
__device__ __forceinline__ int group_stride(const u32*) { return QXW; }

// Split-type rows: lane piece j is block lane + 32j. NR rows (row < 0: skipped), NBL pieces
// per lane.
template <int NR, int NBL, class P>
struct BlockRows {
    P piece[NR][NBL];
    // The last piece's last data word, the warp's last weight load (the timeline probe's mark
    // of when the preloaded weights have landed).
    __device__ __forceinline__ float last_word() const { return __uint_as_float(piece[NR - 1][NBL - 1].q.w); }
    // f(i, j, block index) for each piece (i, j) of a row in range (the lane's blocks of the
    // rows, lane + 32 j) where `on`.
    template <class F>
    __device__ __forceinline__ static void each_piece(const QW& w, const long long* rows, int lane, bool on, F f) {
        int nb = w.k >> 5;
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int j = 0; j < NBL; j++) {
                int b = lane + 32 * j;
                if (on && rows[i] >= 0 && b < nb) f(i, j, (u64)rows[i] * (u64)nb + b);
            }
    }
    __device__ __forceinline__ void load(const QW& w, const long long* rows, int lane) {
        each_piece(w, rows, lane, true, [&](int i, int j, u64 bi) { piece[i][j].load(w, bi); });
    }
    // The rows' lines into L2 (prefetch.global.L2), no registers kept: one lane in 8 (a
    // 128-byte line holds 8 blocks' 16-byte data) prefetches its pieces' data and aux lines.
    // P::prefetch(w, block index): the lines P::load reads.
    __device__ __forceinline__ static void prefetch(const QW& w, const long long* rows, int lane) {
        each_piece(w, rows, lane, (lane & 7) == 0, [&](int, int, u64 bi) { P::prefetch(w, bi); });
    }
    // acc[i] += lane's partial of row i against xs[i] (one activation vector per row): padded
    // floats or quantised groups (group_stride).
    template <class X>
    __device__ __forceinline__ void dot(const QW& w, const long long* rows, const X* const* xs, int lane, float* acc) {
        int nb = w.k >> 5;
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int j = 0; j < NBL; j++) {
                int b = lane + 32 * j;
                if (rows[i] >= 0 && b < nb) acc[i] += piece[i][j].dot(xs[i] + b * group_stride(xs[i]));
            }
    }
};
template <int NR, int NBL> using Q4_0Rows = BlockRows<NR, NBL, Q4_0Piece>;
template <int NR, int NBL> using Q4_KRows = BlockRows<NR, NBL, Q4_KPiece>;
template <int NR, int NBL> using Q4_KRowsAux32 = BlockRows<NR, NBL, Q4_KPieceT<true>>;
template <int NR, int NBL> using Q6_KRows = BlockRows<NR, NBL, Q6_KPiece>;

// Warms L2 with one row's bytes (generic types, before pdl_wait()).
__device__ __forceinline__ void prefetch_row(const QW& w, u64 row, int lane) {
    if (split_aux(w.type)) {
        int nb = w.k >> 5;
        const u8* q = (const u8*)w.data + row * (u64)nb * 16;
        for (int off = lane * 128; off < nb * 16; off += 32 * 128) prefetch_l2(q + off);
        const u8* a = (const u8*)w.scales + aux_bytes(w.type, row * (u64)nb);
        for (int off = lane * 128; off < (int)aux_bytes(w.type, nb); off += 32 * 128) prefetch_l2(a + off);
        return;
    }
    u64 rb = row_bytes(w.type, w.k);
    const u8* base = (const u8*)w.data + row * rb;
    for (u64 off = (u64)lane * 128; off < rb; off += 32 * 128) prefetch_l2(base + off);
}

// Full dot product of row `row` with the padded activations; every lane gets the total.
__device__ __forceinline__ float row_dot(const QW& w, u64 row, const float* xs, int lane) {
    float a;
    switch (w.type) {
        case T_Q4_0: a = dot_blocks<Q4_0Piece>(w, row, xs, lane); break;
        case T_Q4_K: a = dot_blocks<Q4_KPiece>(w, row, xs, lane); break;
        case T_Q6_K: a = dot_blocks<Q6_KPiece>(w, row, xs, lane); break;
        case T_Q8_0: a = dot_q8_0(w, row, xs, lane); break;
        case T_F16: a = dot_f16(w, row, xs, lane); break;
        default: a = dot_f32(w, row, xs, lane); break;
    }
    return warp_sum(a);
}

// Weight i of a split type's row through its piece (the aux layouts stay in the Piece types).
template <class P>
__device__ __forceinline__ float piece_weight(const QW& w, u64 row, int i) {
    P piece;
    piece.load(w, row * (u64)(w.k >> 5) + (i >> 5));
    return piece.weight(i & 31);
}

// One weight of a row (embedding look-up); slow but touches one row per token.
__device__ float weight_at(const QW& w, u64 row, int i) {
    const u8* base = (const u8*)w.data + row * row_bytes(w.type, w.k);
    switch (w.type) {
        case T_Q4_0: return piece_weight<Q4_0Piece>(w, row, i);
        case T_Q4_K: return piece_weight<Q4_KPiece>(w, row, i);
        case T_Q6_K: return piece_weight<Q6_KPiece>(w, row, i);
        case T_Q8_0: {
            const u8* bp = base + (u64)(i >> 5) * 34;
            return h2f((u16)bp[0] | ((u16)bp[1] << 8)) * (float)(signed char)bp[2 + (i & 31)];
        }
        case T_F16: return h2f(((const u16*)base)[i]);
        default: return ((const float*)base)[i];
    }
}
