// Flash-style causal attention with GQA: the GPU twin of `cpu/attention.rs`
// (same layouts, global positions, masking and dropout mask).
//
// Layouts: q [batch, sq, hq, d], k [batch, sk, hkv, d], v [batch, sk, hkv, dv],
// out [batch, sq, hq, dv] (bf16), lse [batch, hq, sq] (fp32, natural log-sum-exp of
// the scaled scores). Query head h reads kv head h / (hq / hkv). Query i sits at
// global position q_pos0 + i, key j at k_pos0 + j; `causal` masks keys after the
// query. A row that sees no key gets out = 0 and lse = -inf.
//
// Keys are processed ATT_BC = 32 at a time (one per lane) from shared memory, with
// an online softmax in the exp2 domain: no [sq, sk] matrix exists anywhere. A block
// serves one (batch, kv head) and a run of "rows" rho = i * group + (h - g * group),
// so the query heads that share a kv head share its K/V tiles.
//
// Forward: 4 warps x ATT_RPW rows; per key tile each lane scores its key against the
// warp's rows, the rows' max and sum are warp reductions, and P V accumulates in
// registers (lane owns output columns lane, lane + 32, ...).
//
// Backward (FlashAttention-2 order): `attention_bwd_delta` computes
// D = rowsum(dO * O) per row; then one block per (key tile, kv head, batch) walks
// every row that can see its keys, 4 rows at a time (one per warp) recomputing
// P = exp(S - lse), dP = dO V^T, dS = P (dP - D); dQ goes to an fp32 accumulator by
// atomics, dK and dV stay in registers (lane = key, each warp a quarter of the
// columns) and are added to the bf16 gradients once at the end: no other block
// touches those keys.
//
// Dropout (`drop.on`): the normaliser counts every entry and only P V sees the mask
// Z, drawn per (global sample, global head, query position, key position) as in
// cpu/dropout.rs; the backward recomputes Z: dV takes P Z, and dP is scaled by Z
// before dS (D = rowsum(dO O) still holds).
//
// Shared memory is dynamic (sized from d, dv by the launcher); K and V rows are
// padded to an odd stride so the lanes' column walks hit distinct banks.

#define ATT_BC 32
#define ATT_WARPS 4
#define ATT_RPW 4
#define ATT_ROWS (ATT_WARPS * ATT_RPW)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// NU = output columns per lane (dv <= 32 * NU).
template <int NU>
__device__ __forceinline__ void attention_fwd_impl(const bf16* q, const bf16* k, const bf16* v,
                                                   int sq, int sk, int hq, int hkv, int d, int dv,
                                                   int q_pos0, int k_pos0, int causal,
                                                   float scale, DropoutArgs drop, bf16* out,
                                                   float* lse) {
    extern __shared__ float smem[];
    const int group = hq / hkv;
    const int g = blockIdx.y;
    const int b = blockIdx.z;
    const int rho0 = blockIdx.x * ATT_ROWS;
    const int nrows = sq * group;
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int kst = d | 1;
    float* Qs = smem;                  // [ATT_ROWS][d], pre-scaled by scale * log2(e)
    float* Ks = Qs + ATT_ROWS * d;     // [ATT_BC][kst]
    float* Vs = Ks + ATT_BC * kst;     // [ATT_BC][dv]
    float* Ps = Vs + ATT_BC * dv;      // [ATT_ROWS][ATT_BC]

    const float qscale = scale * LOG2E;
    for (int idx = threadIdx.x; idx < ATT_ROWS * d; idx += blockDim.x) {
        const int r = idx / d;
        const int c = idx - r * d;
        const int rho = rho0 + r;
        float val = 0.0f;
        if (rho < nrows) {
            const int i = rho / group;
            const int h = g * group + rho % group;
            val = bf16_to_f32(q[(((i64)b * sq + i) * hq + h) * d + c]) * qscale;
        }
        Qs[idx] = val;
    }

    float m[ATT_RPW], l[ATT_RPW], acc[ATT_RPW][NU];
    int qpos[ATT_RPW];
    bool valid[ATT_RPW];
    u64 dbase[ATT_RPW];  // each row's dropout hash state (its global head's site)
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        const int rho = rho0 + warp * ATT_RPW + rr;
        valid[rr] = rho < nrows;
        qpos[rr] = q_pos0 + (valid[rr] ? rho / group : 0);
        const u64 head = drop.pos0 + (u64)(g * group + (valid[rr] ? rho % group : 0));
        dbase[rr] = drop.on ? dropout_base(drop, drop.site ^ (head << 40)) : 0;
        m[rr] = NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int u = 0; u < NU; ++u) acc[rr][u] = 0.0f;
    }
    // Keys any row of the block can see: those up to the last row's query.
    const int last = min(rho0 + ATT_ROWS, nrows) - 1;
    int nk = sk;
    if (causal) nk = max(0, min(sk, q_pos0 + last / group - k_pos0 + 1));

    for (int j0 = 0; j0 < nk; j0 += ATT_BC) {
        __syncthreads();  // the previous tile is consumed (and Qs written, the first time)
        for (int idx = threadIdx.x; idx < ATT_BC * d; idx += blockDim.x) {
            const int j = idx / d;
            const int c = idx - j * d;
            const int key = j0 + j;
            Ks[j * kst + c] =
                key < nk ? bf16_to_f32(k[(((i64)b * sk + key) * hkv + g) * d + c]) : 0.0f;
        }
        for (int idx = threadIdx.x; idx < ATT_BC * dv; idx += blockDim.x) {
            const int j = idx / dv;
            const int c = idx - j * dv;
            const int key = j0 + j;
            Vs[idx] = key < nk ? bf16_to_f32(v[(((i64)b * sk + key) * hkv + g) * dv + c]) : 0.0f;
        }
        __syncthreads();

        const int key = j0 + lane;
        const int kpos = k_pos0 + key;
        float s[ATT_RPW];
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; ++rr) s[rr] = 0.0f;
        const float* qw = Qs + warp * ATT_RPW * d;
        for (int c = 0; c < d; ++c) {
            const float kv = Ks[lane * kst + c];
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; ++rr) s[rr] += qw[rr * d + c] * kv;
        }
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; ++rr) {
            const bool vis = valid[rr] && key < nk && (!causal || kpos <= qpos[rr]);
            const float sc = vis ? s[rr] : NEG_INF;
            const float mnew = fmaxf(m[rr], warp_max(sc));
            float p = 0.0f;
            float alpha = 1.0f;
            if (mnew != NEG_INF) {
                p = vis ? exp2f(sc - mnew) : 0.0f;
                alpha = exp2f(m[rr] - mnew);  // 0 on the row's first visible tile
            }
            l[rr] = l[rr] * alpha + warp_sum(p);
            m[rr] = mnew;
#pragma unroll
            for (int u = 0; u < NU; ++u) acc[rr][u] *= alpha;
            if (drop.on && p != 0.0f) {
                p *= dropout_factor(drop, dbase[rr], drop.sample0 + b, qpos[rr], kpos);
            }
            Ps[(warp * ATT_RPW + rr) * ATT_BC + lane] = p;
        }
        __syncwarp();
        const int jn = min(ATT_BC, nk - j0);
        for (int j = 0; j < jn; ++j) {
            float vv[NU];
#pragma unroll
            for (int u = 0; u < NU; ++u) {
                const int c = lane + WARP * u;
                vv[u] = c < dv ? Vs[j * dv + c] : 0.0f;
            }
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; ++rr) {
                const float pj = Ps[(warp * ATT_RPW + rr) * ATT_BC + j];
#pragma unroll
                for (int u = 0; u < NU; ++u) acc[rr][u] += pj * vv[u];
            }
        }
        __syncwarp();
    }

#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        if (!valid[rr]) continue;
        const int rho = rho0 + warp * ATT_RPW + rr;
        const int i = rho / group;
        const int h = g * group + rho % group;
        bf16* orow = out + (((i64)b * sq + i) * hq + h) * dv;
        const bool seen = l[rr] > 0.0f;
        const float inv = seen ? 1.0f / l[rr] : 0.0f;
#pragma unroll
        for (int u = 0; u < NU; ++u) {
            const int c = lane + WARP * u;
            if (c < dv) orow[c] = f32_to_bf16(acc[rr][u] * inv);
        }
        if (lane == 0) {
            lse[((i64)b * hq + h) * sq + i] = seen ? (m[rr] + log2f(l[rr])) * LN2 : NEG_INF;
        }
    }
}

// grid (ceil(sq * group / ATT_ROWS), hkv, batch), block ATT_WARPS * 32, dynamic
// shared memory (ATT_ROWS * d + ATT_BC * (d | 1) + ATT_BC * dv + ATT_ROWS * ATT_BC) * 4.
// `_128`: dv <= 128; `_256`: dv <= 256.
#define ATT_FWD_ARGS                                                                       \
    const bf16 *q, const bf16 *k, const bf16 *v, int sq, int sk, int hq, int hkv, int d, \
        int dv, int q_pos0, int k_pos0, int causal, float scale, DropoutArgs drop, bf16 *out, \
        float *lse
#define ATT_FWD_CALL \
    q, k, v, sq, sk, hq, hkv, d, dv, q_pos0, k_pos0, causal, scale, drop, out, lse

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP) attention_fwd_bf16_128(ATT_FWD_ARGS) {
    attention_fwd_impl<4>(ATT_FWD_CALL);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP) attention_fwd_bf16_256(ATT_FWD_ARGS) {
    attention_fwd_impl<8>(ATT_FWD_CALL);
}

// delta[b, h, i] = sum_c d_o[b, i, h, c] * o[b, i, h, c]; one warp per (b, i, h),
// rows = batch * sq * hq numbered in the o layout.
extern "C" __global__ void attention_bwd_delta(const bf16* o, const bf16* d_o, int batch, int sq,
                                               int hq, int dv, float* delta) {
    const i64 row = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= (i64)batch * sq * hq) return;  // whole warps leave together
    const bf16* orow = o + row * dv;
    const bf16* grow = d_o + row * dv;
    float s = 0.0f;
    for (int c = lane; c < dv; c += WARP) s += bf16_to_f32(orow[c]) * bf16_to_f32(grow[c]);
    s = warp_sum(s);
    if (lane == 0) {
        const int h = (int)(row % hq);
        const i64 bi = row / hq;
        const int i = (int)(bi % sq);
        const int b = (int)(bi / sq);
        delta[((i64)b * hq + h) * sq + i] = s;
    }
}

// QM = columns per warp quarter held in registers (d, dv <= 4 * QM).
template <int QM>
__device__ __forceinline__ void attention_bwd_impl(const bf16* q, const bf16* k, const bf16* v,
                                                   const float* lse, const float* delta,
                                                   const bf16* d_o, int sq, int sk, int hq,
                                                   int hkv, int d, int dv, int q_pos0, int k_pos0,
                                                   int causal, float scale, DropoutArgs drop,
                                                   float* dq_acc, bf16* dk, bf16* dvg) {
    extern __shared__ float smem[];
    const int group = hq / hkv;
    const int g = blockIdx.y;
    const int b = blockIdx.z;
    const int j0 = blockIdx.x * ATT_BC;
    const int nrows = sq * group;
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int kst = d | 1;
    const int vst = dv | 1;
    float* Ks = smem;                    // [ATT_BC][kst]
    float* Vs = Ks + ATT_BC * kst;       // [ATT_BC][vst]
    float* Qr = Vs + ATT_BC * vst;       // [ATT_WARPS][d]
    float* Gr = Qr + ATT_WARPS * d;      // [ATT_WARPS][dv] (dO rows)
    float* Pr = Gr + ATT_WARPS * dv;     // [ATT_WARPS][ATT_BC]
    float* Sr = Pr + ATT_WARPS * ATT_BC; // [ATT_WARPS][ATT_BC] (dS)

    for (int idx = threadIdx.x; idx < ATT_BC * d; idx += blockDim.x) {
        const int j = idx / d;
        const int c = idx - j * d;
        const int key = j0 + j;
        Ks[j * kst + c] = key < sk ? bf16_to_f32(k[(((i64)b * sk + key) * hkv + g) * d + c]) : 0.0f;
    }
    for (int idx = threadIdx.x; idx < ATT_BC * dv; idx += blockDim.x) {
        const int j = idx / dv;
        const int c = idx - j * dv;
        const int key = j0 + j;
        Vs[j * vst + c] =
            key < sk ? bf16_to_f32(v[(((i64)b * sk + key) * hkv + g) * dv + c]) : 0.0f;
    }

    const int key = j0 + lane;
    const bool kvalid = key < sk;
    const int kpos = k_pos0 + key;
    // This warp's quarter of the dK and dV columns.
    const int qd = (d + ATT_WARPS - 1) / ATT_WARPS;
    const int qv = (dv + ATT_WARPS - 1) / ATT_WARPS;
    float ak[QM], av[QM];
#pragma unroll
    for (int u = 0; u < QM; ++u) {
        ak[u] = 0.0f;
        av[u] = 0.0f;
    }
    // The first query that can see the tile's first key.
    const int i_start = causal ? min(sq, max(0, k_pos0 + j0 - q_pos0)) : 0;
    const float l2scale = scale * LOG2E;

    for (int base = i_start * group; base < nrows; base += ATT_WARPS) {
        __syncthreads();  // the previous rows are consumed (and K/V written, the first time)
        for (int idx = threadIdx.x; idx < ATT_WARPS * d; idx += blockDim.x) {
            const int r = idx / d;
            const int c = idx - r * d;
            const int rho = base + r;
            float val = 0.0f;
            if (rho < nrows) {
                const int i = rho / group;
                const int h = g * group + rho % group;
                val = bf16_to_f32(q[(((i64)b * sq + i) * hq + h) * d + c]);
            }
            Qr[idx] = val;
        }
        for (int idx = threadIdx.x; idx < ATT_WARPS * dv; idx += blockDim.x) {
            const int r = idx / dv;
            const int c = idx - r * dv;
            const int rho = base + r;
            float val = 0.0f;
            if (rho < nrows) {
                const int i = rho / group;
                const int h = g * group + rho % group;
                val = bf16_to_f32(d_o[(((i64)b * sq + i) * hq + h) * dv + c]);
            }
            Gr[idx] = val;
        }
        __syncthreads();

        // Warp `warp` takes row base + warp: P and dS for its 32 keys, then dQ.
        {
            const int rho = base + warp;
            const bool valid = rho < nrows;
            const int i = valid ? rho / group : 0;
            const int h = g * group + (valid ? rho % group : 0);
            const float L = valid ? lse[((i64)b * hq + h) * sq + i] : NEG_INF;
            const float D = valid ? delta[((i64)b * hq + h) * sq + i] : 0.0f;
            const bool vis = valid && kvalid && L != NEG_INF && (!causal || kpos <= q_pos0 + i);
            const float* qr = Qr + warp * d;
            const float* gr = Gr + warp * dv;
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s += qr[c] * Ks[lane * kst + c];
            float dp = 0.0f;
            for (int c = 0; c < dv; ++c) dp += gr[c] * Vs[lane * vst + c];
            const float p = vis ? exp2f(s * l2scale - L * LOG2E) : 0.0f;
            float z = 1.0f;
            if (drop.on && p != 0.0f) {
                const u64 head = drop.pos0 + (u64)h;
                z = dropout_factor(drop, dropout_base(drop, drop.site ^ (head << 40)),
                                   drop.sample0 + b, q_pos0 + i, kpos);
            }
            const float ds = p * (dp * z - D);
            Pr[warp * ATT_BC + lane] = p * z;
            Sr[warp * ATT_BC + lane] = ds;
            __syncwarp();
            if (__any_sync(FULL_MASK, ds != 0.0f)) {
                float* dqr = dq_acc + (((i64)b * sq + i) * hq + h) * d;
                const float* sr = Sr + warp * ATT_BC;
                for (int c = lane; c < d; c += WARP) {
                    float a = 0.0f;
                    for (int j = 0; j < ATT_BC; ++j) a += sr[j] * Ks[j * kst + c];
                    atomicAdd(dqr + c, a * scale);
                }
            }
        }
        __syncthreads();

        // dV += P^T dO and dK += dS^T Q over the 4 rows, on this warp's columns.
#pragma unroll
        for (int r = 0; r < ATT_WARPS; ++r) {
            const float p = Pr[r * ATT_BC + lane];
            const float ds = Sr[r * ATT_BC + lane];
            const float* gr = Gr + r * dv;
            const float* qr = Qr + r * d;
#pragma unroll
            for (int u = 0; u < QM; ++u) {
                const int cv = warp * qv + u;
                if (u < qv && cv < dv) av[u] += p * gr[cv];
                const int ck = warp * qd + u;
                if (u < qd && ck < d) ak[u] += ds * qr[ck];
            }
        }
    }

    if (!kvalid) return;
    bf16* dkr = dk + (((i64)b * sk + key) * hkv + g) * d;
    bf16* dvr = dvg + (((i64)b * sk + key) * hkv + g) * dv;
#pragma unroll
    for (int u = 0; u < QM; ++u) {
        const int cv = warp * qv + u;
        if (u < qv && cv < dv) bf16_add(dvr + cv, av[u]);
        const int ck = warp * qd + u;
        if (u < qd && ck < d) bf16_add(dkr + ck, ak[u] * scale);
    }
}

// grid (ceil(sk / ATT_BC), hkv, batch), block ATT_WARPS * 32, dynamic shared memory
// (ATT_BC * ((d | 1) + (dv | 1)) + ATT_WARPS * (d + dv + 2 * ATT_BC)) * 4.
// dq_acc [batch, sq, hq, d] fp32 is added to (zero it first); dk, dv are added to.
// `_128`: d, dv <= 128; `_256`: d, dv <= 256.
#define ATT_BWD_ARGS                                                                        \
    const bf16 *q, const bf16 *k, const bf16 *v, const float *lse, const float *delta,    \
        const bf16 *d_o, int sq, int sk, int hq, int hkv, int d, int dv, int q_pos0,      \
        int k_pos0, int causal, float scale, DropoutArgs drop, float *dq_acc, bf16 *dk,     \
        bf16 *dvg
#define ATT_BWD_CALL                                                                      \
    q, k, v, lse, delta, d_o, sq, sk, hq, hkv, d, dv, q_pos0, k_pos0, causal, scale, drop, \
        dq_acc, dk, dvg

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP) attention_bwd_bf16_128(ATT_BWD_ARGS) {
    attention_bwd_impl<32>(ATT_BWD_CALL);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP) attention_bwd_bf16_256(ATT_BWD_ARGS) {
    attention_bwd_impl<64>(ATT_BWD_CALL);
}

// Ring attention's merge of one key/value block into the running result: the GPU
// twin of `attention_merge` (cpu/attention.rs). One warp per (batch, head, query)
// row: weights from the two log-sum-exps, the row's dv columns blended in fp32,
// stored bf16. A block row that saw no key (-inf) changes nothing; a running row
// that saw none takes the block's.
extern "C" __global__ void attention_merge_bf16(bf16* o_acc, float* lse_acc,
                                                const bf16* o_blk, const float* lse_blk,
                                                int batch, int sq, int hq, int dv) {
    const i64 rows = (i64)batch * hq * sq;
    const i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    // row = (b * hq + h) * sq + i
    const i64 i = row % sq;
    const i64 h = (row / sq) % hq;
    const i64 b = row / ((i64)sq * hq);
    const float la = lse_acc[row];
    const float lb = lse_blk[row];
    if (lb == NEG_INF) return;
    bf16* oa = o_acc + ((b * sq + i) * hq + h) * dv;
    const bf16* ob = o_blk + ((b * sq + i) * hq + h) * dv;
    float lse = lb;
    if (la == NEG_INF) {
        for (int c = lane; c < dv; c += WARP) oa[c] = ob[c];
    } else {
        lse = fmaxf(la, lb) + log1pf(expf(-fabsf(la - lb)));
        const float wa = expf(la - lse);
        const float wb = expf(lb - lse);
        for (int c = lane; c < dv; c += WARP) {
            oa[c] = f32_to_bf16(wa * bf16_to_f32(oa[c]) + wb * bf16_to_f32(ob[c]));
        }
    }
    if (lane == 0) lse_acc[row] = lse;
}
