// Fused AdamW (decoupled weight decay, as torch.optim.AdamW): the GPU twin of
// `cpu/adamw.rs`. fp32 master weights, gradients and moments updated in place; the
// bf16 copy the next forward reads is written in the same pass. The bias
// corrections come from the host (computed in f64 there, as on the CPU):
// step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr * wd.

__device__ __forceinline__ void adamw_one(float& p, float g, float& m, float& v, float beta1,
                                          float beta2, float eps, float step_size, float bc2_sqrt,
                                          float decay) {
    const float mi = beta1 * m + (1.0f - beta1) * g;
    const float vi = beta2 * v + (1.0f - beta2) * g * g;
    m = mi;
    v = vi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p = p * decay - step_size * mi / denom;
}

extern "C" __global__ void adamw_f32(float* param, const float* grad, float* m, float* v,
                                     bf16* param_bf16, i64 n, float beta1, float beta2, float eps,
                                     float step_size, float bc2_sqrt, float decay) {
    const bool vec = ((((u64)param) | ((u64)grad) | ((u64)m) | ((u64)v)) & 15u) == 0 &&
                     (((u64)param_bf16) & 7u) == 0;
    const i64 n4 = vec ? n / 4 : 0;
    GRID_STRIDE(i4, n4) {
        float4 p = ((float4*)param)[i4];
        const float4 g = ((const float4*)grad)[i4];
        float4 mm = ((float4*)m)[i4];
        float4 vv = ((float4*)v)[i4];
        adamw_one(p.x, g.x, mm.x, vv.x, beta1, beta2, eps, step_size, bc2_sqrt, decay);
        adamw_one(p.y, g.y, mm.y, vv.y, beta1, beta2, eps, step_size, bc2_sqrt, decay);
        adamw_one(p.z, g.z, mm.z, vv.z, beta1, beta2, eps, step_size, bc2_sqrt, decay);
        adamw_one(p.w, g.w, mm.w, vv.w, beta1, beta2, eps, step_size, bc2_sqrt, decay);
        ((float4*)param)[i4] = p;
        ((float4*)m)[i4] = mm;
        ((float4*)v)[i4] = vv;
        uint2 b;
        b.x = (u32)f32_to_bf16(p.x) | ((u32)f32_to_bf16(p.y) << 16);
        b.y = (u32)f32_to_bf16(p.z) | ((u32)f32_to_bf16(p.w) << 16);
        ((uint2*)param_bf16)[i4] = b;
    }
    GRID_STRIDE(j, n - n4 * 4) {
        const i64 i = n4 * 4 + j;
        float p = param[i];
        float mm = m[i];
        float vv = v[i];
        adamw_one(p, grad[i], mm, vv, beta1, beta2, eps, step_size, bc2_sqrt, decay);
        param[i] = p;
        m[i] = mm;
        v[i] = vv;
        param_bf16[i] = f32_to_bf16(p);
    }
}
