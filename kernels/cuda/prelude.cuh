// Shared helpers for every kernel module: prepended to each `.cu` file by the Rust
// side (`KernelModule::source`), so NVRTC needs no include path and no CUDA header.
//
// bf16 values travel as their bit pattern (`bf16`, an unsigned short) and are
// converted here: the header-free forms work on every NVRTC, and on sm_80+ the
// float -> bf16 rounding is the hardware `cvt.rn.bf16.f32`.
//
// Conventions (the GPU twins of `kernels/src/cpu`):
// - compute activations and weights are bf16, accumulation fp32; master weights,
//   optimizer moments, parameter gradients, statistics and losses are fp32;
// - forward kernels overwrite their outputs; backward kernels accumulate (`+=`)
//   into every gradient, bf16 ones included (read, add in fp32, round once);
// - sizes are `int` (the wrappers check that they fit) and offsets `long long`.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define WARP 32
#define FULL_MASK 0xffffffffu
// An index naming no row (cpu::NO_ROW).
#define NO_ROW 0xffffffffu
// -inf without <math.h>.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16 h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        // NaN: keep the sign, force a quiet NaN.
        return (bf16)((u >> 16) | 0x0040u);
    }
    // Round to nearest, ties to even.
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
#endif
}

// Eight bf16 values as one 16-byte load/store.
struct __align__(16) bf16x8 {
    u32 w[4];
};

__device__ __forceinline__ void unpack8(const bf16x8 v, float out[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(v.w[i] << 16);
        out[2 * i + 1] = __uint_as_float(v.w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ bf16x8 pack8(const float in[8]) {
    bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v.w[i] = (u32)f32_to_bf16(in[2 * i]) | ((u32)f32_to_bf16(in[2 * i + 1]) << 16);
    }
    return v;
}

// Whether rows of `n` bf16 starting at these pointers can be read 8 at a time.
__device__ __forceinline__ bool aligned8(const void* p, int n) {
    return (n % 8 == 0) && ((((u64)p) & 15u) == 0);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). `scratch` holds
// 32 floats of shared memory; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    const int nwarps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Online softmax state (running max `m` and sum of exp(x - m)) merged across
// threads: the pair for the union of two sets.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    if (mx == NEG_INF) return;  // both empty
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
    m = mx;
}

__device__ __forceinline__ void warp_softmax_merge(float& m, float& s) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(FULL_MASK, m, o);
        const float s2 = __shfl_xor_sync(FULL_MASK, s, o);
        softmax_merge(m, s, m2, s2);
    }
}

// Grid-stride loop over `n` elements.
#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)gridDim.x * blockDim.x)

// Calls `f(c, value)` for every element of a bf16 row of `dim` values, threads
// `first`, `first + step`, ... taking its 8-value chunks (16-byte loads when the row
// allows them) or its values. A thread sees the same columns for every row of the
// same length and alignment.
template <typename F>
__device__ __forceinline__ void row_for_each_strided(const bf16* row, int dim, int first,
                                                     int step, F f) {
    if (aligned8(row, dim)) {
        const bf16x8* v = (const bf16x8*)row;
        for (int i = first; i < dim / 8; i += step) {
            float e[8];
            unpack8(v[i], e);
#pragma unroll
            for (int j = 0; j < 8; ++j) f(i * 8 + j, e[j]);
        }
    } else {
        for (int c = first; c < dim; c += step) f(c, bf16_to_f32(row[c]));
    }
}

// The block's threads striding over a row.
template <typename F>
__device__ __forceinline__ void row_for_each(const bf16* row, int dim, F f) {
    row_for_each_strided(row, dim, threadIdx.x, blockDim.x, f);
}

// One warp striding over a row alone.
template <typename F>
__device__ __forceinline__ void warp_row_for_each(const bf16* row, int dim, F f) {
    row_for_each_strided(row, dim, threadIdx.x % WARP, WARP, f);
}

// Walks three rows of `dim` bf16 together, one warp: f(c, a[c], b[c], w[c]) (16-byte
// loads when all three allow them).
template <typename F>
__device__ __forceinline__ void warp_rows3_for_each(const bf16* a, const bf16* b, const bf16* w,
                                                    int dim, F f) {
    const int lane = threadIdx.x % WARP;
    if (aligned8(a, dim) && aligned8(b, dim) && aligned8(w, dim)) {
        for (int i = lane; i < dim / 8; i += WARP) {
            float av[8], bv[8], wv[8];
            unpack8(((const bf16x8*)a)[i], av);
            unpack8(((const bf16x8*)b)[i], bv);
            unpack8(((const bf16x8*)w)[i], wv);
#pragma unroll
            for (int j = 0; j < 8; ++j) f(i * 8 + j, av[j], bv[j], wv[j]);
        }
    } else {
        for (int c = lane; c < dim; c += WARP) {
            f(c, bf16_to_f32(a[c]), bf16_to_f32(b[c]), bf16_to_f32(w[c]));
        }
    }
}

// out[c] = f(c, a[c], b[c], w[c]) (ADD: out[c] += it, in fp32, rounded once), one
// warp over the row; 16-byte loads and stores when every row allows them.
template <bool ADD, typename F>
__device__ __forceinline__ void warp_rows3_out(const bf16* a, const bf16* b, const bf16* w,
                                               bf16* out, int dim, F f) {
    const int lane = threadIdx.x % WARP;
    if (aligned8(a, dim) && aligned8(b, dim) && aligned8(w, dim) && aligned8(out, dim)) {
        for (int i = lane; i < dim / 8; i += WARP) {
            float av[8], bv[8], wv[8], ov[8];
            unpack8(((const bf16x8*)a)[i], av);
            unpack8(((const bf16x8*)b)[i], bv);
            unpack8(((const bf16x8*)w)[i], wv);
            if (ADD) {
                unpack8(((const bf16x8*)out)[i], ov);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float v = f(i * 8 + j, av[j], bv[j], wv[j]);
                ov[j] = ADD ? ov[j] + v : v;
            }
            ((bf16x8*)out)[i] = pack8(ov);
        }
    } else {
        for (int c = lane; c < dim; c += WARP) {
            const float v = f(c, bf16_to_f32(a[c]), bf16_to_f32(b[c]), bf16_to_f32(w[c]));
            out[c] = f32_to_bf16(ADD ? bf16_to_f32(out[c]) + v : v);
        }
    }
}

// `*p += x` on a bf16 in fp32, rounded once (no other thread writes *p).
__device__ __forceinline__ void bf16_add(bf16* p, float x) {
    *p = f32_to_bf16(bf16_to_f32(*p) + x);
}

// RoPE's rotation for pair `i` of a `head_dim`-wide head at `pos`, by `sign` times
// the angle pos * freq: cosine and sine. freq = theta^(-2i / head_dim), scaled in
// the wavelength form of `cpu::Rope::freq` (kept below high_wl, divided by factor
// above low_wl, blended between; linear scaling is low_wl = high_wl = 0). Angle,
// sine and cosine in fp64 as on the CPU (pos * freq in fp32 loses the angle's
// fraction at long positions), rounded to fp32 once. Shared by every kernel that
// rotates, so they agree bit for bit.
__device__ __forceinline__ void rope_cos_sin(double pos, int i, int head_dim, float theta,
                                             float factor, float low_wl, float high_wl,
                                             float sign, float& c, float& s) {
    double freq = pow((double)theta, -2.0 * (double)i / (double)head_dim);
    const double wl = 2.0 * 3.141592653589793 / freq;
    if (wl >= (double)high_wl) {
        if (wl > (double)low_wl) {
            freq = freq / (double)factor;
        } else {
            const double sm = (1.0 / wl - 1.0 / (double)low_wl) /
                              (1.0 / (double)high_wl - 1.0 / (double)low_wl);
            freq = (1.0 - sm) * freq / (double)factor + sm * freq;
        }
    }
    double sn, cs;
    sincos(pos * freq * (double)sign, &sn, &cs);
    c = (float)cs;
    s = (float)sn;
}

// Dropout masks: the GPU twin of `cpu/dropout.rs` (the same SplitMix64 hash of the
// seed, step, site and coordinates, and the same integer threshold), so an entry
// survives on the GPU exactly when it does on the CPU. Passed by value to kernels;
// the Rust twin is `DropoutArgs` in `cuda/ops.rs` (same field order and sizes).
struct DropoutArgs {
    u64 seed, step, site;
    u64 thr;      // an entry survives when (hash >> 11) >= thr = ceil(p * 2^53)
    u64 sample0;  // the first local sample's global index
    u64 pos0;     // rows: the first row's position; attention: the first global head
    float scale;  // a survivor's factor 1 / (1 - p)
    int mbs;      // rows: samples per micro-batch (rows are sequence-major)
    int on;       // 0: no dropout
    int pad;
};

__device__ __forceinline__ u64 splitmix(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// The hash state of a site before the coordinates are mixed in.
__device__ __forceinline__ u64 dropout_base(const DropoutArgs& a, u64 site) {
    return splitmix(a.seed ^ splitmix(a.step ^ splitmix(site)));
}

// The mask's factor at coordinates (c0, c1, c2): `scale` or 0.
__device__ __forceinline__ float dropout_factor(const DropoutArgs& a, u64 base, u64 c0, u64 c1,
                                                u64 c2) {
    u64 z = splitmix(base ^ c0);
    z = splitmix(z ^ c1);
    z = splitmix(z ^ c2);
    return (z >> 11) >= a.thr ? a.scale : 0.0f;
}
