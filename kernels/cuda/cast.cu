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

// found = min(found, tag) when x holds a NaN or an infinity (exponent bits all
// ones): run once per tensor of a set with its own tag, then one read of `found`
// names the first tensor that went non-finite.
extern "C" __global__ void non_finite_f32(const float* x, i64 n, u32 tag, u32* found) {
    GRID_STRIDE(i, n) {
        if ((__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u) {
            atomicMin(found, tag);
            return;
        }
    }
}
