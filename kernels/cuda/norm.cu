// LayerNorm and RMSNorm over the last dimension: the GPU twins of `cpu/norm.rs`.
// Forward: one block per row, statistics in fp32 (two passes for the variance, as
// the CPU kernel), `mean`/`rstd` saved per row. Backward: a grid of blocks, each
// walking rows blockIdx.x, blockIdx.x + gridDim.x, ..., writes `dx` and its own row
// of parameter-gradient partials; `colsum_add_f32` then adds the partials into the
// fp32 gradients in a fixed order (deterministic, no atomics).

extern "C" __global__ void layernorm_fwd_bf16(const bf16* x, const bf16* weight, const bf16* bias,
                                              int rows, int dim, float eps, bf16* y, float* mean,
                                              float* rstd) {
    __shared__ float scratch[WARP];
    const int r = blockIdx.x;
    const bf16* xr = x + (i64)r * dim;
    float s = 0.0f;
    row_for_each(xr, dim, [&](int, float v) { s += v; });
    const float mu = block_sum(s, scratch) / (float)dim;
    float q = 0.0f;
    row_for_each(xr, dim, [&](int, float v) { q += (v - mu) * (v - mu); });
    const float var = block_sum(q, scratch) / (float)dim;
    const float rs = 1.0f / sqrtf(var + eps);
    if (threadIdx.x == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
    bf16* yr = y + (i64)r * dim;
    row_for_each(xr, dim, [&](int c, float v) {
        yr[c] = f32_to_bf16((v - mu) * rs * bf16_to_f32(weight[c]) + bf16_to_f32(bias[c]));
    });
}

// partial: [gridDim.x, 2, dim] fp32 (dweight then dbias partials of each block),
// fully written here.
extern "C" __global__ void layernorm_bwd_bf16(const bf16* x, const bf16* weight, const float* mean,
                                              const float* rstd, const bf16* dy, int rows, int dim,
                                              bf16* dx, float* partial) {
    __shared__ float scratch[WARP];
    float* pw = partial + (i64)blockIdx.x * 2 * dim;
    float* pb = pw + dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        pw[c] = 0.0f;
        pb[c] = 0.0f;
    }
    const float inv = 1.0f / (float)dim;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const bf16* xr = x + (i64)r * dim;
        const bf16* dyr = dy + (i64)r * dim;
        const float mu = mean[r];
        const float rs = rstd[r];
        float sg = 0.0f, sgx = 0.0f;
        row_for_each(dyr, dim, [&](int c, float g) {
            const float xhat = (bf16_to_f32(xr[c]) - mu) * rs;
            const float gw = g * bf16_to_f32(weight[c]);
            sg += gw;
            sgx += gw * xhat;
        });
        const float mg = block_sum(sg, scratch) * inv;
        const float mgx = block_sum(sgx, scratch) * inv;
        bf16* dxr = dx + (i64)r * dim;
        row_for_each(dyr, dim, [&](int c, float g) {
            const float xhat = (bf16_to_f32(xr[c]) - mu) * rs;
            bf16_add(dxr + c, rs * (g * bf16_to_f32(weight[c]) - mg - xhat * mgx));
            pw[c] += g * xhat;
            pb[c] += g;
        });
    }
}

extern "C" __global__ void rmsnorm_fwd_bf16(const bf16* x, const bf16* weight, int rows, int dim,
                                            float eps, bf16* y, float* rstd) {
    __shared__ float scratch[WARP];
    const int r = blockIdx.x;
    const bf16* xr = x + (i64)r * dim;
    float q = 0.0f;
    row_for_each(xr, dim, [&](int, float v) { q += v * v; });
    const float ms = block_sum(q, scratch) / (float)dim;
    const float rs = 1.0f / sqrtf(ms + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    bf16* yr = y + (i64)r * dim;
    row_for_each(xr, dim,
                 [&](int c, float v) { yr[c] = f32_to_bf16(v * rs * bf16_to_f32(weight[c])); });
}

// partial: [gridDim.x, dim] fp32, fully written here.
extern "C" __global__ void rmsnorm_bwd_bf16(const bf16* x, const bf16* weight, const float* rstd,
                                            const bf16* dy, int rows, int dim, bf16* dx,
                                            float* partial) {
    __shared__ float scratch[WARP];
    float* pw = partial + (i64)blockIdx.x * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) pw[c] = 0.0f;
    const float inv = 1.0f / (float)dim;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const bf16* xr = x + (i64)r * dim;
        const bf16* dyr = dy + (i64)r * dim;
        const float rs = rstd[r];
        float sgx = 0.0f;
        row_for_each(dyr, dim, [&](int c, float g) {
            sgx += g * bf16_to_f32(weight[c]) * bf16_to_f32(xr[c]) * rs;
        });
        const float mgx = block_sum(sgx, scratch) * inv;
        bf16* dxr = dx + (i64)r * dim;
        row_for_each(dyr, dim, [&](int c, float g) {
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
