// Fused cross-entropy over unsharded logits: the GPU twin of `cpu/loss.rs`
// composed for one shard (`ce_row_max`, `ce_row_sumexp`, `ce_target_logit`,
// `ce_loss`, then `ce_bwd` with vocab_start = 0). One block per row: one pass keeps
// each thread's online (max, sum of exp) and merges them over the block, a second
// pass writes the gradient. The logits are read twice and never materialised in
// fp32.

#define CE_THREADS 512

// loss[r] = max + ln(sumexp) - logits[r, labels[r]] (the target term is 0 for a
// label outside [0, vocab), as the CPU's shard that does not own it);
// dlogits[r, j] = scale * (softmax[r, j] - [j == labels[r]]), written (not added).
extern "C" __global__ void __launch_bounds__(CE_THREADS)
    ce_fused_bf16(const bf16* logits, const u32* labels, int rows, int vocab, float scale,
                  float* loss, bf16* dlogits) {
    __shared__ float sm[WARP];
    __shared__ float ss[WARP];
    const int r = blockIdx.x;
    const bf16* lr = logits + (i64)r * vocab;
    float m = NEG_INF;
    float s = 0.0f;
    if (aligned8(lr, vocab)) {
        const bf16x8* v8 = (const bf16x8*)lr;
        for (int i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
            float e[8];
            unpack8(v8[i], e);
            float cm = e[0];
#pragma unroll
            for (int j = 1; j < 8; ++j) cm = fmaxf(cm, e[j]);
            const float mx = fmaxf(m, cm);
            float cs = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) cs += __expf(e[j] - mx);
            s = s * __expf(m - mx) + cs;
            m = mx;
        }
    } else {
        for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
            const float v = bf16_to_f32(lr[c]);
            const float mx = fmaxf(m, v);
            s = s * __expf(m - mx) + __expf(v - mx);
            m = mx;
        }
    }
    warp_softmax_merge(m, s);
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    if (lane == 0) {
        sm[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    const int nwarps = blockDim.x / WARP;
    m = lane < nwarps ? sm[lane] : NEG_INF;
    s = lane < nwarps ? ss[lane] : 0.0f;
    warp_softmax_merge(m, s);
    const u32 label = labels[r];
    const bool in_range = label < (u32)vocab;
    if (threadIdx.x == 0) {
        const float target = in_range ? bf16_to_f32(lr[label]) : 0.0f;
        loss[r] = m + logf(s) - target;
    }
    const float inv = 1.0f / s;
    bf16* dr = dlogits + (i64)r * vocab;
    row_for_each(lr, vocab, [&](int c, float v) {
        float g = __expf(v - m) * inv;
        if (in_range && c == (int)label) g -= 1.0f;
        dr[c] = f32_to_bf16(scale * g);
    });
}
