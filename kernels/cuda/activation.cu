// Pointwise ops: GELU (tanh approximation), SwiGLU, residual add. The GPU twins of
// `cpu/activation.rs`; grid-stride loops, 16-byte loads where every pointer allows.

#define SQRT_2_OVER_PI 0.7978845608f
#define GELU_C 0.044715f

__device__ __forceinline__ float gelu(float v) {
    const float t = tanhf(SQRT_2_OVER_PI * (v + GELU_C * v * v * v));
    return 0.5f * v * (1.0f + t);
}

__device__ __forceinline__ float gelu_grad(float v) {
    const float t = tanhf(SQRT_2_OVER_PI * (v + GELU_C * v * v * v));
    const float dt = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * v * v);
    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * dt;
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// Aligned 8-wide chunks first (`vec(i8)` for elements 8*i8 .. 8*i8 + 8), then the
// scalar tail (`scalar(i)`), which is everything when a pointer is not 16-byte
// aligned.
template <typename V, typename S>
__device__ __forceinline__ void vec_or_scalar(i64 n, bool aligned, V vec, S scalar) {
    const i64 n8 = aligned ? n / 8 : 0;
    GRID_STRIDE(i8, n8) { vec(i8); }
    GRID_STRIDE(j, n - n8 * 8) { scalar(n8 * 8 + j); }
}

__device__ __forceinline__ bool al16(const void* p) { return (((u64)p) & 15u) == 0; }

extern "C" __global__ void gelu_fwd_bf16(const bf16* x, i64 n, bf16* y) {
    vec_or_scalar(n, al16(x) && al16(y),
        [&](i64 i8) {
            float v[8];
            unpack8(((const bf16x8*)x)[i8], v);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = gelu(v[e]);
            ((bf16x8*)y)[i8] = pack8(v);
        },
        [&](i64 i) { y[i] = f32_to_bf16(gelu(bf16_to_f32(x[i]))); });
}

// dx += dy * gelu'(x)
extern "C" __global__ void gelu_bwd_bf16(const bf16* x, const bf16* dy, i64 n, bf16* dx) {
    vec_or_scalar(n, al16(x) && al16(dy) && al16(dx),
        [&](i64 i8) {
            float xv[8], g[8], d[8];
            unpack8(((const bf16x8*)x)[i8], xv);
            unpack8(((const bf16x8*)dy)[i8], g);
            unpack8(((const bf16x8*)dx)[i8], d);
#pragma unroll
            for (int e = 0; e < 8; ++e) d[e] += g[e] * gelu_grad(xv[e]);
            ((bf16x8*)dx)[i8] = pack8(d);
        },
        [&](i64 i) { bf16_add(dx + i, bf16_to_f32(dy[i]) * gelu_grad(bf16_to_f32(x[i]))); });
}

// x [rows, 2f] = [gate | up] per row; y [rows, f] = silu(gate) * up.
extern "C" __global__ void swiglu_fwd_bf16(const bf16* x, int rows, int f, bf16* y) {
    GRID_STRIDE(e, (i64)rows * f) {
        const i64 r = e / f;
        const i64 c = e - r * f;
        const float g = bf16_to_f32(x[r * 2 * f + c]);
        const float u = bf16_to_f32(x[r * 2 * f + f + c]);
        y[e] = f32_to_bf16(g * sigmoid(g) * u);
    }
}

// dx [rows, 2f] += ([d_gate | d_up]) from dy [rows, f].
extern "C" __global__ void swiglu_bwd_bf16(const bf16* x, const bf16* dy, int rows, int f, bf16* dx) {
    GRID_STRIDE(e, (i64)rows * f) {
        const i64 r = e / f;
        const i64 c = e - r * f;
        const i64 gi = r * 2 * f + c;
        const float g = bf16_to_f32(x[gi]);
        const float u = bf16_to_f32(x[gi + f]);
        const float d = bf16_to_f32(dy[e]);
        const float s = sigmoid(g);
        bf16_add(dx + gi, d * u * s * (1.0f + g * (1.0f - s)));
        bf16_add(dx + gi + f, d * g * s);
    }
}

// out = a + b
extern "C" __global__ void add_bf16(const bf16* a, const bf16* b, i64 n, bf16* out) {
    vec_or_scalar(n, al16(a) && al16(b) && al16(out),
        [&](i64 i8) {
            float va[8], vb[8];
            unpack8(((const bf16x8*)a)[i8], va);
            unpack8(((const bf16x8*)b)[i8], vb);
#pragma unroll
            for (int e = 0; e < 8; ++e) va[e] += vb[e];
            ((bf16x8*)out)[i8] = pack8(va);
        },
        [&](i64 i) { out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i])); });
}

// da += d_out, db += d_out
extern "C" __global__ void add_bwd_bf16(const bf16* d_out, i64 n, bf16* da, bf16* db) {
    vec_or_scalar(n, al16(d_out) && al16(da) && al16(db),
        [&](i64 i8) {
            float g[8], va[8], vb[8];
            unpack8(((const bf16x8*)d_out)[i8], g);
            unpack8(((const bf16x8*)da)[i8], va);
            unpack8(((const bf16x8*)db)[i8], vb);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                va[e] += g[e];
                vb[e] += g[e];
            }
            ((bf16x8*)da)[i8] = pack8(va);
            ((bf16x8*)db)[i8] = pack8(vb);
        },
        [&](i64 i) {
            const float g = bf16_to_f32(d_out[i]);
            bf16_add(da + i, g);
            bf16_add(db + i, g);
        });
}

// Dropout over sequence-major rows [rows, width]: y = x * mask, row r being sample
// sample0 + r % mbs at position pos0 + r / mbs (cpu/dropout.rs `dropout_rows`).
// The backward runs the same kernel on the output's gradient.
extern "C" __global__ void dropout_bf16(const bf16* x, int rows, int width, DropoutArgs a,
                                        bf16* y) {
    const u64 base = dropout_base(a, a.site);
    const i64 n = (i64)rows * width;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / width;
        const u64 col = (u64)(i - r * width);
        const u64 sample = a.sample0 + (u64)(r % a.mbs);
        const u64 pos = a.pos0 + (u64)(r / a.mbs);
        y[i] = f32_to_bf16(bf16_to_f32(x[i]) * dropout_factor(a, base, sample, pos, col));
    }
}
