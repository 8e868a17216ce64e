// LayerNorm and RMSNorm over the last dimension: the GPU twins of `cpu/norm.rs`.
// One warp per row (NORM_WARPS rows per block), so a row's sums are warp
// reductions with no block barrier. Forward: statistics in fp32 (two passes for the
// variance, as the CPU kernel), `mean`/`rstd` saved per row; grid
// ceil(rows / NORM_WARPS). Backward: each warp walks rows w, w + W, ... (w its index
// in the grid, W the grid's warps), writes `dx` and its own row of
// parameter-gradient partials; `colsum_add_f32` then adds the partials into the
// fp32 gradients in a fixed order (deterministic, no atomics).

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
    bf16* yr = y + (i64)r * dim;
    warp_row_for_each(xr, dim, [&](int c, float v) {
        yr[c] = f32_to_bf16((v - mu) * rs * bf16_to_f32(weight[c]) + bf16_to_f32(bias[c]));
    });
}

// partial: [gridDim.x * NORM_WARPS, 2, dim] fp32 (dweight then dbias partials of
// each warp), fully written here.
extern "C" __global__ void layernorm_bwd_bf16(const bf16* x, const bf16* weight, const float* mean,
                                              const float* rstd, const bf16* dy, int rows, int dim,
                                              bf16* dx, float* partial) {
    const int w = blockIdx.x * NORM_WARPS + threadIdx.x / WARP;
    const int nw = gridDim.x * NORM_WARPS;
    float* pw = partial + (i64)w * 2 * dim;
    float* pb = pw + dim;
    for (int c = threadIdx.x % WARP; c < dim; c += WARP) {
        pw[c] = 0.0f;
        pb[c] = 0.0f;
    }
    __syncwarp();  // lanes accumulate into columns another lane zeroed
    const float inv = 1.0f / (float)dim;
    for (int r = w; r < rows; r += nw) {
        const bf16* xr = x + (i64)r * dim;
        const bf16* dyr = dy + (i64)r * dim;
        const float mu = mean[r];
        const float rs = rstd[r];
        float sg = 0.0f, sgx = 0.0f;
        warp_row_for_each(dyr, dim, [&](int c, float g) {
            const float xhat = (bf16_to_f32(xr[c]) - mu) * rs;
            const float gw = g * bf16_to_f32(weight[c]);
            sg += gw;
            sgx += gw * xhat;
        });
        const float mg = warp_sum(sg) * inv;
        const float mgx = warp_sum(sgx) * inv;
        bf16* dxr = dx + (i64)r * dim;
        warp_row_for_each(dyr, dim, [&](int c, float g) {
            const float xhat = (bf16_to_f32(xr[c]) - mu) * rs;
            bf16_add(dxr + c, rs * (g * bf16_to_f32(weight[c]) - mg - xhat * mgx));
            pw[c] += g * xhat;
            pb[c] += g;
        });
    }
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
    bf16* yr = y + (i64)r * dim;
    warp_row_for_each(xr, dim,
                 [&](int c, float v) { yr[c] = f32_to_bf16(v * rs * bf16_to_f32(weight[c])); });
}

// partial: [gridDim.x * NORM_WARPS, dim] fp32, fully written here.
extern "C" __global__ void rmsnorm_bwd_bf16(const bf16* x, const bf16* weight, const float* rstd,
                                            const bf16* dy, int rows, int dim, bf16* dx,
                                            float* partial) {
    const int w = blockIdx.x * NORM_WARPS + threadIdx.x / WARP;
    const int nw = gridDim.x * NORM_WARPS;
    float* pw = partial + (i64)w * dim;
    for (int c = threadIdx.x % WARP; c < dim; c += WARP) pw[c] = 0.0f;
    __syncwarp();  // lanes accumulate into columns another lane zeroed
    const float inv = 1.0f / (float)dim;
    for (int r = w; r < rows; r += nw) {
        const bf16* xr = x + (i64)r * dim;
        const bf16* dyr = dy + (i64)r * dim;
        const float rs = rstd[r];
        float sgx = 0.0f;
        warp_row_for_each(dyr, dim, [&](int c, float g) {
            sgx += g * bf16_to_f32(weight[c]) * bf16_to_f32(xr[c]) * rs;
        });
        const float mgx = warp_sum(sgx) * inv;
        bf16* dxr = dx + (i64)r * dim;
        warp_row_for_each(dyr, dim, [&](int c, float g) {
            const float xv = bf16_to_f32(xr[c]);
            bf16_add(dxr + c, rs * (g * bf16_to_f32(weight[c]) - xv * rs * mgx));
            pw[c] += g * xv * rs;
        });
    }
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
