// Rotary position embedding, rotate-half (Llama / Hugging Face) pairs: the GPU
// twin of `cpu/rope.rs`. The rotation (`rope_cos_sin` in the prelude, fp64) once
// per (token, pair) and reused over the heads.

// One block per token; threads stride over pair indices i < head_dim / 2.
// out = R(sign * angle) x, written (accumulate == 0) or added (accumulate != 0).
extern "C" __global__ void rope_bf16(const bf16* x, const u32* positions, int tokens, int heads,
                                     int head_dim, float theta, float factor, float low_wl,
                                     float high_wl, float sign, int accumulate, bf16* out) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const double pos = (double)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, s;
        rope_cos_sin(pos, i, head_dim, theta, factor, low_wl, high_wl, sign, c, s);
        for (int h = 0; h < heads; ++h) {
            const i64 base = ((i64)t * heads + h) * head_dim;
            const float x1 = bf16_to_f32(x[base + i]);
            const float x2 = bf16_to_f32(x[base + i + half]);
            const float y1 = x1 * c - x2 * s;
            const float y2 = x2 * c + x1 * s;
            if (accumulate) {
                bf16_add(out + base + i, y1);
                bf16_add(out + base + i + half, y2);
            } else {
                out[base + i] = f32_to_bf16(y1);
                out[base + i + half] = f32_to_bf16(y2);
            }
        }
    }
}
