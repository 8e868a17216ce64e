// Conversions between the fp32 and bf16 copies of a tensor.

extern "C" __global__ void cast_f32_to_bf16(const float* x, i64 n, bf16* y) {
    GRID_STRIDE(i, n) { y[i] = f32_to_bf16(x[i]); }
}

extern "C" __global__ void cast_bf16_to_f32(const bf16* x, i64 n, float* y) {
    GRID_STRIDE(i, n) { y[i] = bf16_to_f32(x[i]); }
}

// y += x: an fp32 accumulator (e.g. attention's dQ) added into a bf16 gradient.
extern "C" __global__ void add_f32_into_bf16(const float* x, i64 n, bf16* y) {
    GRID_STRIDE(i, n) { y[i] = f32_to_bf16(bf16_to_f32(y[i]) + x[i]); }
}

// x *= a.
extern "C" __global__ void scale_f32(float* x, i64 n, float a) {
    GRID_STRIDE(i, n) { x[i] *= a; }
}

// acc += x.
extern "C" __global__ void add_f32(const float* x, i64 n, float* acc) {
    GRID_STRIDE(i, n) { acc[i] += x[i]; }
}
