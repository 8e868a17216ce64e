// Rotary position embedding, rotate-half (Llama / Hugging Face) pairs: the GPU
// twin of `cpu/rope.rs`. Angles, sine and cosine in fp64 as on the CPU (pos * freq
// in fp32 loses the angle's fraction at long positions), once per (token, pair)
// and reused over the heads.

// One block per token; threads stride over pair indices i < head_dim / 2.
// out = R(sign * angle) x, written (accumulate == 0) or added (accumulate != 0).
extern "C" __global__ void rope_bf16(const bf16* x, const u32* positions, int tokens, int heads,
                                     int head_dim, float theta, float sign, int accumulate,
                                     bf16* out) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const double pos = (double)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double freq = pow((double)theta, -2.0 * (double)i / (double)head_dim);
        double sn, cs;
        sincos(pos * freq * (double)sign, &sn, &cs);
        const float c = (float)cs;
        const float s = (float)sn;
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
