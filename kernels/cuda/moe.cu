// Mixture-of-experts routing, dispatch and combine: the GPU twins of `cpu/moe.rs`.
//
// Routing: one warp per token (experts <= 1024, lane l holding experts l, l + 32,
// ...): softmax over all experts, then k rounds of a warp arg-max over the experts
// not yet taken (ties to the lower index, so the same order as the CPU).
// Dispatch: a stable sort by expert without atomics (the same `perm` and `counts`
// as the CPU): `moe_count` counts each expert's assignments, `moe_perm` (one block
// per expert) places them in token order with a block-wide ballot scan,
// `moe_gather_bf16` copies the rows. Combine and the dispatch backward use the
// inverse permutation (`moe_invert_perm`) so each token sums its own k slots
// without atomics. Indices out of range are skipped, never dereferenced.

#define MOE_WARPS 4

// Is (v2, i2) a better top-k candidate than (v, i)? i = -1 means none.
__device__ __forceinline__ bool moe_better(float v2, int i2, float v, int i) {
    if (i2 < 0) return false;
    if (i < 0) return true;
    return v2 > v || (v2 == v && i2 < i);
}

extern "C" __global__ void moe_route_fwd_f32(const float* logits, int tokens, int experts, int k,
                                             int renormalize, float* probs, u32* expert_idx,
                                             float* weights) {
    const int lane = threadIdx.x % WARP;
    const int t = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    if (t >= tokens) return;  // whole warps leave together
    const float* lr = logits + (i64)t * experts;
    float* pr = probs + (i64)t * experts;
    float mx = NEG_INF;
    for (int e = lane; e < experts; e += WARP) mx = fmaxf(mx, lr[e]);
    mx = warp_max(mx);
    float z = 0.0f;
    for (int e = lane; e < experts; e += WARP) z += expf(lr[e] - mx);
    z = warp_sum(z);
    const float inv = 1.0f / z;
    for (int e = lane; e < experts; e += WARP) pr[e] = expf(lr[e] - mx) * inv;
    u32 taken = 0;  // bit u: expert lane + 32 u taken
    float sel_sum = 0.0f;
    for (int j = 0; j < k; ++j) {
        float bv = 0.0f;
        int bi = -1;
        for (int u = 0, e = lane; e < experts; ++u, e += WARP) {
            if (!(taken & (1u << u)) && moe_better(lr[e], e, bv, bi)) {
                bv = lr[e];
                bi = e;
            }
        }
#pragma unroll
        for (int o = WARP / 2; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(FULL_MASK, bv, o);
            const int i2 = __shfl_xor_sync(FULL_MASK, bi, o);
            if (moe_better(v2, i2, bv, bi)) {
                bv = v2;
                bi = i2;
            }
        }
        // Every lane now holds the winner; its owner marks it taken.
        if (bi >= 0 && bi % WARP == lane) taken |= 1u << (bi / WARP);
        const float p = expf(lr[bi] - mx) * inv;
        sel_sum += p;
        if (lane == 0) {
            expert_idx[(i64)t * k + j] = (u32)bi;
            weights[(i64)t * k + j] = p;
        }
    }
    if (renormalize) {
        // One expert's weight is 1 exactly (see cpu/moe.rs): its router gets no
        // rounding noise for a gradient.
        const float s = 1.0f / sel_sum;
        for (int j = lane; j < k; j += WARP) weights[(i64)t * k + j] = k == 1 ? 1.0f : weights[(i64)t * k + j] * s;
    }
}

// d_logits [tokens, experts] += gradient of the routing weights (see cpu/moe.rs).
extern "C" __global__ void moe_route_bwd_f32(const float* probs, const u32* expert_idx,
                                             const float* weights, const float* d_weights,
                                             int tokens, int experts, int k, int renormalize,
                                             float* d_logits) {
    const int lane = threadIdx.x % WARP;
    const int t = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    if (t >= tokens) return;
    const u32* idx = expert_idx + (i64)t * k;
    const float* w = weights + (i64)t * k;
    const float* dw = d_weights + (i64)t * k;
    float* dl = d_logits + (i64)t * experts;
    float wdw = 0.0f;
    for (int j = lane; j < k; j += WARP) wdw += w[j] * dw[j];
    wdw = warp_sum(wdw);
    if (renormalize) {
        for (int j = lane; j < k; j += WARP) {
            if (idx[j] < (u32)experts) dl[idx[j]] += w[j] * (dw[j] - wdw);
        }
    } else {
        const float* pr = probs + (i64)t * experts;
        for (int e = lane; e < experts; e += WARP) dl[e] -= pr[e] * wdw;
        __syncwarp();
        for (int j = lane; j < k; j += WARP) {
            const u32 e = idx[j];
            if (e < (u32)experts) dl[e] += pr[e] * dw[j];
        }
    }
}

// Sum of an int over the block; `scratch` holds 32 ints.
__device__ __forceinline__ int block_sum_int(int v, int* scratch) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / WARP) ? scratch[lane] : 0;
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// counts[e] = number of assignments a < n with expert_idx[a] == e; one block per expert.
extern "C" __global__ void moe_count(const u32* expert_idx, int n, int experts, u32* counts) {
    __shared__ int scratch[WARP];
    const u32 e = blockIdx.x;
    int c = 0;
    for (int a = threadIdx.x; a < n; a += blockDim.x) c += expert_idx[a] == e;
    c = block_sum_int(c, scratch);
    if (threadIdx.x == 0) counts[e] = (u32)c;
}

// Where expert e's slots start: counts[0] + ... + counts[e - 1], in every thread.
__device__ __forceinline__ int expert_start(const u32* counts, u32 e, int* scratch) {
    int st = 0;
    for (int i = threadIdx.x; i < (int)e; i += blockDim.x) st += (int)counts[i];
    return block_sum_int(st, scratch);
}

// Of the block's threads for which `mine` holds: how many come before this one (in
// thread order), and how many there are. Every thread of the block calls it;
// `warp_base` holds 32 ints.
struct BlockRank {
    int before;
    int total;
};
__device__ __forceinline__ BlockRank block_rank(bool mine, int* warp_base) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    const u32 ballot = __ballot_sync(FULL_MASK, mine);
    __syncthreads();  // warp_base of the previous call fully read
    if (lane == 0) warp_base[warp] = __popc(ballot);
    __syncthreads();
    BlockRank r = {__popc(ballot & ((1u << lane) - 1u)), 0};
    for (int w = 0; w < (int)(blockDim.x / WARP); ++w) {
        r.before += w < warp ? warp_base[w] : 0;
        r.total += warp_base[w];
    }
    return r;
}

// perm[start_e + rank] = a for the assignments of expert e = blockIdx.x in order of a,
// start_e = counts[0] + ... + counts[e - 1].
extern "C" __global__ void moe_perm(const u32* expert_idx, const u32* counts, int n, int experts,
                                    u32* perm) {
    __shared__ int scratch[WARP];
    __shared__ int warp_base[WARP];
    const u32 e = blockIdx.x;
    int base = expert_start(counts, e, scratch);
    for (int a0 = 0; a0 < n; a0 += blockDim.x) {
        const int a = a0 + threadIdx.x;
        const bool mine = a < n && expert_idx[a] == e;
        const BlockRank r = block_rank(mine, warp_base);
        if (mine) perm[base + r.before] = (u32)a;
        base += r.total;
    }
}

// Expert capacity (cpu::moe_capacity), one block per expert e = blockIdx.x: of e's
// slots perm[start_e .. start_e + counts[e]) (token order), the first `cap` of each
// group of `group` tokens keep padded row e * per_expert + (kept slots of e before
// them). at[s] is that row or NO_ROW; pad[row] = s, and the rows past e's kept ones
// NO_ROW; kept[e] their count.
extern "C" __global__ void moe_capacity(const u32* perm, const u32* counts, int k, int group,
                                        int cap, int per_expert, u32* at, u32* pad, u32* kept) {
    __shared__ int scratch[WARP];
    __shared__ int warp_base[WARP];
    const u32 e = blockIdx.x;
    const int start = expert_start(counts, e, scratch);
    const int n = (int)counts[e];
    const u32 per_group = (u32)k * (u32)group;
    int base = 0;
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
        const bool live = i0 + (int)threadIdx.x < n;
        const int s = start + i0 + threadIdx.x;
        bool keep = false;
        if (live) {
            // Groups never decrease along an expert's slots: the first slot of this
            // one by bisection.
            const u32 g = perm[s] / per_group;
            int lo = start, hi = s;
            while (lo < hi) {
                const int mid = lo + (hi - lo) / 2;
                if (perm[mid] / per_group < g) {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            keep = s - lo < cap;
        }
        const BlockRank r = block_rank(keep, warp_base);
        if (live) {
            const u32 row = e * (u32)per_expert + (u32)(base + r.before);
            at[s] = keep ? row : NO_ROW;
            if (keep) pad[row] = (u32)s;
        }
        base += r.total;
    }
    for (int r = base + threadIdx.x; r < per_expert; r += blockDim.x)
        pad[(i64)e * per_expert + r] = NO_ROW;
    if (threadIdx.x == 0) kept[e] = (u32)base;
}

// out[s, :] = x[perm[s] / k, :], one block per slot.
extern "C" __global__ void moe_gather_bf16(const bf16* x, const u32* perm, int n, int k, int dim,
                                           int tokens, bf16* out) {
    const int s = blockIdx.x;
    const u32 t = perm[s] / (u32)k;
    if (t >= (u32)tokens) return;
    const bf16* src = x + (i64)t * dim;
    bf16* dst = out + (i64)s * dim;
    if (aligned8(src, dim) && aligned8(dst, dim)) {
        for (int i = threadIdx.x; i < dim / 8; i += blockDim.x)
            ((bf16x8*)dst)[i] = ((const bf16x8*)src)[i];
    } else {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = src[c];
    }
}

// inv[perm[s]] = s
extern "C" __global__ void moe_invert_perm(const u32* perm, int n, u32* inv) {
    GRID_STRIDE(s, n) {
        const u32 a = perm[s];
        if (a < (u32)n) inv[a] = (u32)s;
    }
}

// dx[t, :] += sum over j < k of d_out[inv[t * k + j], :], one block per token.
extern "C" __global__ void moe_dispatch_bwd_bf16(const bf16* d_out, const u32* inv, int tokens,
                                                 int k, int dim, bf16* dx) {
    const int t = blockIdx.x;
    const int n = tokens * k;
    bf16* dst = dx + (i64)t * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float acc = bf16_to_f32(dst[c]);
        for (int j = 0; j < k; ++j) {
            const u32 s = inv[(i64)t * k + j];
            if (s < (u32)n) acc += bf16_to_f32(d_out[(i64)s * dim + c]);
        }
        dst[c] = f32_to_bf16(acc);
    }
}

// out[t, :] = sum over j < k of weights[t * k + j] * y[inv[t * k + j], :], one block
// per token (written, not added).
extern "C" __global__ void moe_combine_fwd_bf16(const bf16* y, const u32* inv, const float* weights,
                                                int tokens, int k, int dim, bf16* out) {
    const int t = blockIdx.x;
    const int n = tokens * k;
    bf16* dst = out + (i64)t * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            const u32 s = inv[(i64)t * k + j];
            if (s < (u32)n) acc += weights[(i64)t * k + j] * bf16_to_f32(y[(i64)s * dim + c]);
        }
        dst[c] = f32_to_bf16(acc);
    }
}

// One block per slot s (assignment a = perm[s], token t = a / k):
// d_y[s, :] += weights[a] * d_out[t, :]; d_weights[a] += d_out[t, :] . y[s, :].
extern "C" __global__ void moe_combine_bwd_bf16(const bf16* d_out, const bf16* y, const u32* perm,
                                                const float* weights, int tokens, int k, int dim,
                                                bf16* d_y, float* d_weights) {
    __shared__ float scratch[WARP];
    const int s = blockIdx.x;
    const u32 a = perm[s];
    if (a >= (u32)(tokens * k)) return;  // uniform over the block
    const i64 t = a / (u32)k;
    const float w = weights[a];
    const bf16* g = d_out + t * dim;
    const bf16* yr = y + (i64)s * dim;
    bf16* dyr = d_y + (i64)s * dim;
    float dot = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float gv = bf16_to_f32(g[c]);
        bf16_add(dyr + c, w * gv);
        dot += gv * bf16_to_f32(yr[c]);
    }
    dot = block_sum(dot, scratch);
    if (threadIdx.x == 0) d_weights[a] += dot;
}

// out[r, :] = src[idx[r], :], or zeros where idx[r] is NO_ROW (0xffffffff) or past
// the source's rows (cpu/moe.rs `gather_rows`); one block per output row.
extern "C" __global__ void gather_rows_bf16(const bf16* src, int src_rows, const u32* idx,
                                            int rows, int dim, bf16* out) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const u32 i = idx[r];
    bf16* o = out + (i64)r * dim;
    if (i == NO_ROW || i >= (u32)src_rows) {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = 0;
        return;
    }
    const bf16* s = src + (i64)i * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = s[c];
}
