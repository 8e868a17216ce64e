// LayerNorm and RMSNorm over the last dimension: the GPU twins of `cpu/norm.rs`.
// One warp per row (NORM_WARPS rows per block), so a row's sums are warp
// reductions with no block barrier. Forward: statistics in fp32 (two passes for the
// variance, as the CPU kernel), `mean`/`rstd` saved per row; grid
// ceil(rows / NORM_WARPS). Backward: `dx` one warp per row likewise; the parameter
// gradients by `*_param_grads`, a thread per column (LayerNorm's: per 8 columns when
// rows allow 16-byte loads) summing a chunk of rows, so a warp reads consecutive
// columns; then `colsum_add_f32` adds the chunks' partials into the fp32 gradients
// in a fixed order (deterministic, no atomics).

#define NORM_WARPS 8

extern "C" __global__ void layernorm_fwd_bf16(const bf16* x, const bf16* weight, const bf16* bias,
                                              int rows, int dim, float eps, bf16* y, float* mean,
                                              float* rstd) {
    const int r = blockIdx.x * NORM_WARPS + threadIdx.x / WARP;
    if (r >= rows) return;  // whole warps leave together
    const bf16* xr = x + (i64)r * dim;
    float s = 0.0f;
    warp_row_for_each(xr, dim, [&](int, float v) { s += v; });
    const float mu = warp_sum(s) / (float)dim;
    float q = 0.0f;
    warp_row_for_each(xr, dim, [&](int, float v) { q += (v - mu) * (v - mu); });
    const float var = warp_sum(q) / (float)dim;
    const float rs = 1.0f / sqrtf(var + eps);
    if (threadIdx.x % WARP == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
    warp_rows3_out<false>(xr, weight, bias, y + (i64)r * dim, dim,
                          [&](int, float v, float wv, float bv) { return (v - mu) * rs * wv + bv; });
}

extern "C" __global__ void layernorm_bwd_bf16(const bf16* x, const bf16* weight, const float* mean,
                                              const float* rstd, const bf16* dy, int rows, int dim,
                                              bf16* dx) {
    const int r = blockIdx.x * NORM_WARPS + threadIdx.x / WARP;
    if (r >= rows) return;  // whole warps leave together
    const bf16* xr = x + (i64)r * dim;
    const bf16* dyr = dy + (i64)r * dim;
    const float mu = mean[r];
    const float rs = rstd[r];
    const float inv = 1.0f / (float)dim;
    float sg = 0.0f, sgx = 0.0f;
    warp_rows3_for_each(xr, dyr, weight, dim, [&](int, float xv, float g, float wv) {
        const float gw = g * wv;
        sg += gw;
        sgx += gw * (xv - mu) * rs;
    });
    const float mg = warp_sum(sg) * inv;
    const float mgx = warp_sum(sgx) * inv;
    warp_rows3_out<true>(xr, dyr, weight, dx + (i64)r * dim, dim, [&](int, float xv, float g, float wv) {
        return rs * (g * wv - mg - (xv - mu) * rs * mgx);
    });
}

// The parameter gradients' partial sums over `chunk` rows: partial[y][0][c] =
// sum dy * xhat, partial[y][1][c] = sum dy over rows [y * chunk, (y + 1) * chunk),
// y = blockIdx.y. `vec`: a thread takes 8 adjacent columns (16-byte loads; rows
// 16-byte aligned, dim % 8 == 0), else one.
extern "C" __global__ void layernorm_param_grads(const bf16* x, const float* mean,
                                                 const float* rstd, const bf16* dy, int rows,
                                                 int dim, int chunk, int vec, float* partial) {
    const int r0 = blockIdx.y * chunk;
    const int r1 = min(rows, r0 + chunk);
    float* p = partial + (i64)blockIdx.y * 2 * dim;
    if (vec) {
        const int c8 = blockIdx.x * blockDim.x + threadIdx.x;
        if (c8 >= dim / 8) return;
        float aw[8], ab[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) aw[j] = ab[j] = 0.0f;
        for (int r = r0; r < r1; ++r) {
            float xv[8], gv[8];
            unpack8(((const bf16x8*)(x + (i64)r * dim))[c8], xv);
            unpack8(((const bf16x8*)(dy + (i64)r * dim))[c8], gv);
            const float mu = mean[r];
            const float rs = rstd[r];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                aw[j] += gv[j] * (xv[j] - mu) * rs;
                ab[j] += gv[j];
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            p[c8 * 8 + j] = aw[j];
            p[dim + c8 * 8 + j] = ab[j];
        }
        return;
    }
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    float aw = 0.0f, ab = 0.0f;
    for (int r = r0; r < r1; ++r) {
        const float g = bf16_to_f32(dy[(i64)r * dim + c]);
        aw += g * (bf16_to_f32(x[(i64)r * dim + c]) - mean[r]) * rstd[r];
        ab += g;
    }
    p[c] = aw;
    p[dim + c] = ab;
}

extern "C" __global__ void rmsnorm_fwd_bf16(const bf16* x, const bf16* weight, int rows, int dim,
                                            float eps, bf16* y, float* rstd) {
    const int r = blockIdx.x * NORM_WARPS + threadIdx.x / WARP;
    if (r >= rows) return;  // whole warps leave together
    const bf16* xr = x + (i64)r * dim;
    float q = 0.0f;
    warp_row_for_each(xr, dim, [&](int, float v) { q += v * v; });
    const float ms = warp_sum(q) / (float)dim;
    const float rs = 1.0f / sqrtf(ms + eps);
    if (threadIdx.x % WARP == 0) rstd[r] = rs;
    // (The weight stands in as the unused third row.)
    warp_rows3_out<false>(xr, weight, weight, y + (i64)r * dim, dim,
                          [&](int, float v, float wv, float) { return v * rs * wv; });
}

extern "C" __global__ void rmsnorm_bwd_bf16(const bf16* x, const bf16* weight, const float* rstd,
                                            const bf16* dy, int rows, int dim, bf16* dx) {
    const int r = blockIdx.x * NORM_WARPS + threadIdx.x / WARP;
    if (r >= rows) return;  // whole warps leave together
    const bf16* xr = x + (i64)r * dim;
    const bf16* dyr = dy + (i64)r * dim;
    const float rs = rstd[r];
    const float inv = 1.0f / (float)dim;
    float sgx = 0.0f;
    warp_rows3_for_each(xr, dyr, weight, dim,
                        [&](int, float xv, float g, float wv) { sgx += g * wv * xv * rs; });
    const float mgx = warp_sum(sgx) * inv;
    warp_rows3_out<true>(xr, dyr, weight, dx + (i64)r * dim, dim, [&](int, float xv, float g, float wv) {
        return rs * (g * wv - xv * rs * mgx);
    });
}

// partial[y][c] = sum over rows [y * chunk, (y + 1) * chunk) of dy * x * rstd.
extern "C" __global__ void rmsnorm_param_grads(const bf16* x, const float* rstd, const bf16* dy,
                                               int rows, int dim, int chunk, float* partial) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    const int r0 = blockIdx.y * chunk;
    const int r1 = min(rows, r0 + chunk);
    float aw = 0.0f;
    for (int r = r0; r < r1; ++r) {
        aw += bf16_to_f32(dy[(i64)r * dim + c]) * bf16_to_f32(x[(i64)r * dim + c]) * rstd[r];
    }
    partial[(i64)blockIdx.y * dim + c] = aw;
}

// out[c] += sum over b < nblocks of partial[b * stride + c] (c < width), in order
// of b.
extern "C" __global__ void colsum_add_f32(const float* partial, int nblocks, int width, int stride,
                                          float* out) {
    GRID_STRIDE(c, width) {
        float s = 0.0f;
        for (int b = 0; b < nblocks; ++b) s += partial[(i64)b * stride + c];
        out[c] += s;
    }
}
