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
    if (aligned8(lr, vocab) && aligned8(dr, vocab)) {
        // 16-byte stores: the gradient row is as wide as the logits'.
        const bf16x8* v8 = (const bf16x8*)lr;
        for (int i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
            float e[8];
            unpack8(v8[i], e);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float g = __expf(e[j] - m) * inv;
                if (in_range && i * 8 + j == (int)label) g -= 1.0f;
                e[j] = scale * g;
            }
            ((bf16x8*)dr)[i] = pack8(e);
        }
        return;
    }
    row_for_each(lr, vocab, [&](int c, float v) {
        float g = __expf(v - m) * inv;
        if (in_range && c == (int)label) g -= 1.0f;
        dr[c] = f32_to_bf16(scale * g);
    });
}

// Vocabulary-parallel cross-entropy, one shard `logits [rows, v_local]` per rank:
// the GPU twins of `ce_row_max`, `ce_row_sumexp` with `ce_target_logit`, and
// `ce_loss` with `ce_bwd` (cpu/loss.rs), between which the program sums the rows'
// statistics over the tensor ranks. One block per row.

// max[r] = the row's largest logit of this shard.
extern "C" __global__ void __launch_bounds__(CE_THREADS)
    ce_row_max_bf16(const bf16* logits, int rows, int v_local, float* max) {
    __shared__ float sm[WARP];
    const int r = blockIdx.x;
    float m = NEG_INF;
    row_for_each(logits + (i64)r * v_local, v_local, [&](int, float v) { m = fmaxf(m, v); });
    m = warp_max(m);
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    if (lane == 0) sm[warp] = m;
    __syncthreads();
    m = lane < (int)(blockDim.x / WARP) ? sm[lane] : NEG_INF;
    m = warp_max(m);
    if (threadIdx.x == 0) max[r] = m;
}

// sumexp[r] = sum over this shard of exp(logit - max[r]); target[r] = the logit of
// the row's label when this shard (columns vocab_start..vocab_start + v_local)
// holds it, else 0.
extern "C" __global__ void __launch_bounds__(CE_THREADS)
    ce_sumexp_target_bf16(const bf16* logits, const u32* labels, int rows, int v_local,
                          int vocab_start, const float* max, float* sumexp, float* target) {
    __shared__ float scratch[WARP];
    const int r = blockIdx.x;
    const bf16* lr = logits + (i64)r * v_local;
    const float m = max[r];
    float s = 0.0f;
    row_for_each(lr, v_local, [&](int, float v) { s += __expf(v - m); });
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) {
        const i64 c = (i64)labels[r] - vocab_start;
        sumexp[r] = s;
        target[r] = (c >= 0 && c < v_local) ? bf16_to_f32(lr[c]) : 0.0f;
    }
}

// loss[r] = max[r] + ln(sumexp[r]) - target[r] from the sums over every shard, and
// this shard's dlogits[r, c] = scale * (softmax - [c is the label]), written.
extern "C" __global__ void __launch_bounds__(CE_THREADS)
    ce_finish_bf16(const bf16* logits, const u32* labels, int rows, int v_local,
                   int vocab_start, float scale, const float* max, const float* sumexp,
                   const float* target, float* loss, bf16* dlogits) {
    const int r = blockIdx.x;
    const float m = max[r];
    const float inv = 1.0f / sumexp[r];
    if (threadIdx.x == 0) loss[r] = m + logf(sumexp[r]) - target[r];
    const i64 label = (i64)labels[r] - vocab_start;
    bf16* dr = dlogits + (i64)r * v_local;
    row_for_each(logits + (i64)r * v_local, v_local, [&](int c, float v) {
        float g = __expf(v - m) * inv;
        if (c == label) g -= 1.0f;
        dr[c] = f32_to_bf16(scale * g);
    });
}

// Column g of row r of logits gathered [parts, rows, cols] (g a global column).
__device__ __forceinline__ float logit_at(const float* x, int rows, int cols, int r, int g) {
    return x[((i64)(g / cols) * rows + r) * cols + g % cols];
}

// Greedy decoding: tokens[r] = the global column of row r's largest logit, the first
// of equal ones, over columns 0..limit of a row split into shards of `cols` laid out
// [parts, rows, cols] (cpu/loss.rs `argmax_parts`). A NaN never wins, and a row whose
// first logit is NaN picks 0, as the CPU's left-to-right scan does. One block per row.
extern "C" __global__ void __launch_bounds__(CE_THREADS)
    argmax_parts_f32(const float* x, int rows, int cols, int limit, u32* tokens) {
    __shared__ float sv[CE_THREADS];
    __shared__ int si[CE_THREADS];
    const int r = blockIdx.x;
    const int t = threadIdx.x;
    float bv = NEG_INF;
    int bi = limit;
    for (int g = t; g < limit; g += blockDim.x) {
        const float v = logit_at(x, rows, cols, r, g);
        // Columns rise within a thread: a tie keeps the earlier one, except the
        // sentinel's.
        if (v > bv || (v == bv && bi == limit)) {
            bv = v;
            bi = g;
        }
    }
    sv[t] = bv;
    si[t] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            const float v = sv[t + s];
            const int i = si[t + s];
            if (v > sv[t] || (v == sv[t] && i < si[t])) {
                sv[t] = v;
                si[t] = i;
            }
        }
        __syncthreads();
    }
    if (t == 0) {
        const float first = logit_at(x, rows, cols, r, 0);
        tokens[r] = (si[0] >= limit || first != first) ? 0u : (u32)si[0];
    }
}

// Temperature and nucleus sampling of each row of fp32 logits gathered
// [parts, rows, cols] (cpu/loss.rs `sample_parts`) on the same integer weights,
// round(exp((x - max) / t) * 2^40), whose sums are exact in any order, so that it
// draws the CPU's token. One block per row. Instead of sorting, a radix select on
// the weights' bits finds the nucleus's last weight and then the drawn token's.

// The largest digit of a 48-bit weight: 2^40 (the row's largest logit) has bit 40.
#define SAMPLE_TOP_SHIFT 40

__device__ __forceinline__ u64 sample_weight(float v, float m, double t) {
    if (v != v) return 0ull;
    return (u64)round(exp(((double)v - (double)m) / t) * 1099511627776.0);
}

// The block's sum of each thread's `v` (blockDim.x a power of two), for every thread.
__device__ u64 block_sum_u64(u64 v, u64* sh) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    const u64 out = sh[0];
    __syncthreads();
    return out;
}

// The largest weight w of row r with S(>= w) >= need (S(>= w): the sum of the
// weights at least w; need at most the row's total) into sel[0], and S(> w) into
// sel[1]: digit by digit from the top, the largest digit whose weights, with all
// heavier ones, still reach `need`.
__device__ void select_weight(const float* x, int rows, int cols, int limit, int r, float m,
                              double t, u64 need, u64* hist, u64* sel) {
    u64 prefix = 0, above = 0;
    for (int shift = SAMPLE_TOP_SHIFT; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int g = threadIdx.x; g < limit; g += blockDim.x) {
            const u64 q = sample_weight(logit_at(x, rows, cols, r, g), m, t);
            if ((q >> (shift + 8)) == prefix) atomicAdd(&hist[(q >> shift) & 255], q);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            u64 acc = above;
            for (; d > 0; --d) {
                if (acc + hist[d] >= need) break;
                acc += hist[d];
            }
            sel[0] = (prefix << 8) | (u64)d;
            sel[1] = acc;
        }
        __syncthreads();
        prefix = sel[0];
        above = sel[1];
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(CE_THREADS)
    sample_parts_f32(const float* x, int rows, int cols, int limit, const u32* requests,
                     float temperature, float top_p, u64 seed, u64 step, u32* tokens) {
    __shared__ u64 sh[CE_THREADS];
    __shared__ float sm[CE_THREADS];
    __shared__ u64 hist[256];
    __shared__ u64 sel[2];
    const int r = blockIdx.x;
    const int t = threadIdx.x;
    float m = NEG_INF;
    for (int g = t; g < limit; g += blockDim.x) m = fmaxf(m, logit_at(x, rows, cols, r, g));
    sm[t] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sm[t] = fmaxf(sm[t], sm[t + s]);
        __syncthreads();
    }
    m = sm[0];
    if (!isfinite(m)) {
        // The first column holding the infinite largest logit; 0 for a row of NaNs.
        u64 first = (u64)limit;
        for (int g = t; g < limit; g += blockDim.x) {
            if (logit_at(x, rows, cols, r, g) == m) {
                first = (u64)g;
                break;
            }
        }
        sh[t] = first;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (t < s && sh[t + s] < sh[t]) sh[t] = sh[t + s];
            __syncthreads();
        }
        if (t == 0) tokens[r] = sh[0] >= (u64)limit ? 0u : (u32)sh[0];
        return;
    }
    const double tt = (double)temperature;
    u64 z = 0;
    for (int g = t; g < limit; g += blockDim.x) z += sample_weight(logit_at(x, rows, cols, r, g), m, tt);
    z = block_sum_u64(z, sh);
    u64 need = (u64)ceil((double)top_p * (double)z);
    need = need < 1 ? 1 : (need > z ? z : need);
    // The nucleus: every weight above w1, then the first k columns of weight w1.
    select_weight(x, rows, cols, limit, r, m, tt, need, hist, sel);
    const u64 w1 = sel[0], above1 = sel[1];
    const u64 k = (need - above1 + w1 - 1) / w1;
    const u64 mass = above1 + k * w1;
    const u64 key = splitmix(seed ^ splitmix((u64)requests[r] * 0x9e3779b9ull + step));
    const double u = (double)(key >> 11) / 9007199254740992.0;
    u64 at = (u64)(u * (double)mass);
    if (at >= mass) at = mass - 1;
    // The token: the first whose running weight exceeds `at`, the j-th column of
    // weight w2 (w2 >= w1, and j < k where w2 == w1).
    select_weight(x, rows, cols, limit, r, m, tt, at + 1, hist, sel);
    const u64 w2 = sel[0], above2 = sel[1];
    const u64 j = (at - above2) / w2;
    const int chunk = (limit + blockDim.x - 1) / blockDim.x;
    const int a = min(t * chunk, limit);
    const int b = min(a + chunk, limit);
    u64 c = 0;
    for (int g = a; g < b; ++g) c += sample_weight(logit_at(x, rows, cols, r, g), m, tt) == w2;
    sh[t] = c;
    __syncthreads();
    if (t == 0) {
        u64 acc = 0;
        for (int i = 0; i < blockDim.x; ++i) {
            const u64 ci = sh[i];
            sh[i] = acc;
            acc += ci;
        }
    }
    __syncthreads();
    u64 n = sh[t];
    if (j >= n && j < n + c) {
        for (int g = a; g < b; ++g) {
            if (sample_weight(logit_at(x, rows, cols, r, g), m, tt) != w2) continue;
            if (n == j) {
                tokens[r] = (u32)g;
                break;
            }
            ++n;
        }
    }
}
