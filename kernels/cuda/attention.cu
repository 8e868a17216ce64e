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

// ---------------------------------------------------------------------------------
// Tensor-core flash attention (FlashAttention-2 order) for the training shapes:
// head dims d = dv in {32, 64, 128}. Same layouts, masking, dropout mask, lse and
// accumulate rules as the kernels above, which serve every other shape. Products run
// on `mma.sync.m16n8k16` (bf16 in, fp32 accumulate); P and dS are rounded to bf16
// for their products, as FlashAttention does.
//
// Forward: a block is 4 warps x 16 query rows of one (batch, query head); keys come
// FA_BC at a time through shared memory (K and V rows padded by 8 elements so the
// fragment loads hit distinct banks). Q stays in registers as A fragments; S = Q K^T
// and the online softmax (exp2 domain) live in the accumulator layout, which is
// repacked in registers as the A operand of P V.
//
// Backward: a block owns FA_BC keys of one (batch, kv head) and walks every query
// head of the group and every query tile that can see its keys: S^T = K Q^T and
// dP^T = V dO^T per warp (16 keys each), dV += (P Z)^T dO and dK += dS^T Q in
// registers, dS through shared memory for dQ = dS K, added to the fp32 accumulator
// by atomics. dK and dV are added to the bf16 gradients once, at the end: no other
// block touches those keys.

#define FA_BR 64        // queries per backward tile
#define FA_BC 64        // keys per tile
#define FA_WARPS 4      // backward block: 16 keys per warp
#define FA_FWD_WARPS 8  // forward block: 16 queries per warp, 128 per block

// c += a (16x16, row-major) * b (16x8, column-major), bf16 in, fp32 accumulate.
// Fragments (g = lane / 4, t = lane % 4): a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
// (g+8, 2t+8..)}, b = {(k 2t..2t+1, n g), (k 2t+8.., n g)}, c = {(g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1)}; the lower half of a register holds the lower index.
__device__ __forceinline__ void mma_bf16_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// c0 and c1 += a times the two n-tiles of one ldmatrix.x4 of B (b[0..1], b[2..3]).
__device__ __forceinline__ void mma_pair(float c0[4], float c1[4], const u32 a[4],
                                         const u32 b[4]) {
    mma_bf16_16816(c0, a, b[0], b[1]);
    mma_bf16_16816(c1, a, b[2], b[3]);
}

// Two adjacent accumulator tiles (columns 0-7, 8-15) as one A fragment, in bf16.
__device__ __forceinline__ void acc_to_a(u32 a[4], const float c0[4], const float c1[4]) {
    a[0] = pack_bf16x2(c0[0], c0[1]);
    a[1] = pack_bf16x2(c0[2], c0[3]);
    a[2] = pack_bf16x2(c1[0], c1[1]);
    a[3] = pack_bf16x2(c1[2], c1[3]);
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 bf16 matrices from shared memory, lane l giving the address of a row of
// matrix l / 8; lane t receives row t / 4, columns 2 (t % 4) and + 1 of each
// (`trans`: column t / 4, rows 2 (t % 4) and + 1).
__device__ __forceinline__ void ldsm_x4(u32 r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// An A fragment from a row-major shared tile: rows r0..r0+15, columns c0..c0+15.
__device__ __forceinline__ void load_a(u32 a[4], const bf16* t, int stride, int r0, int c0) {
    const int lane = threadIdx.x % WARP;
    ldsm_x4(a, t + (r0 + lane % 16) * stride + c0 + (lane / 16) * 8);
}

// B fragments of n-tiles n0 and n0 + 8 (b[0], b[1] and b[2], b[3]) over k0..k0+15,
// where B[k][n] = t[n][k] (a tile whose rows are B's columns: K for Q K^T).
__device__ __forceinline__ void load_b_rows_n(u32 b[4], const bf16* t, int stride, int n0,
                                              int k0) {
    const int lane = threadIdx.x % WARP;
    ldsm_x4(b, t + (n0 + lane % 8 + (lane / 16) * 8) * stride + k0 + ((lane / 8) % 2) * 8);
}

// The same where B[k][n] = t[k][n] (a tile whose rows are B's rows: V for P V).
__device__ __forceinline__ void load_b_rows_k(u32 b[4], const bf16* t, int stride, int k0,
                                              int n0) {
    const int lane = threadIdx.x % WARP;
    ldsm_x4_trans(b, t + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * stride + n0 + (lane / 16) * 8);
}

// p[0] += a, p[1] += b (p 8-byte aligned): one vector reduction on sm_90, two
// atomics before it.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// 16 bytes from global to shared memory without passing through registers
// (`cp.async`), zeros when !pred; completes at cp_async_wait.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most one committed group is still in flight; until none is.
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;"); }

// Starts copying rows [row0, row0 + 64) of one head (row stride `rs` elements) into
// a shared tile of stride D + 8, zeros past `rows`.
template <int D>
__device__ __forceinline__ void load_tile(bf16* t, const bf16* src, i64 rs, int row0, int rows) {
    for (int idx = threadIdx.x; idx < FA_BC * D / 8; idx += blockDim.x) {
        const int r = idx / (D / 8);
        const int c = (idx % (D / 8)) * 8;
        const bool in = row0 + r < rows;
        cp_async16(t + r * (D + 8) + c, src + (in ? (i64)(row0 + r) * rs + c : 0), in);
    }
}

template <int D>
__device__ __forceinline__ void flash_fwd_impl(const bf16* q, const bf16* k, const bf16* v,
                                               int sq, int sk, int hq, int hkv, int q_pos0,
                                               int k_pos0, int causal, float scale,
                                               DropoutArgs drop, bf16* out, float* lse) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int S = D + 8;
    constexpr int TILE = FA_BC * S;
    bf16* KV = (bf16*)fa_smem;  // two buffers of [K tile][V tile], each [FA_BC][S]
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int g = h / (hq / hkv);
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int gr = lane / 4;
    const int t2 = 2 * (lane % 4);
    const int blk0 = blockIdx.x * (FA_FWD_WARPS * 16);
    const int r0 = blk0 + warp * 16 + gr;  // this thread's two query rows: r0, r0 + 8
    const int r1 = r0 + 8;
    const i64 qrs = (i64)hq * D;
    const i64 krs = (i64)hkv * D;
    const bf16* qh = q + (i64)b * sq * qrs + (i64)h * D;
    const bf16* kh = k + (i64)b * sk * krs + (i64)g * D;
    const bf16* vh = v + (i64)b * sk * krs + (i64)g * D;

    u32 qf[D / 16][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const int c = kc * 16 + t2;
        qf[kc][0] = r0 < sq ? *(const u32*)(qh + r0 * qrs + c) : 0u;
        qf[kc][1] = r1 < sq ? *(const u32*)(qh + r1 * qrs + c) : 0u;
        qf[kc][2] = r0 < sq ? *(const u32*)(qh + r0 * qrs + c + 8) : 0u;
        qf[kc][3] = r1 < sq ? *(const u32*)(qh + r1 * qrs + c + 8) : 0u;
    }
    const int qp0 = q_pos0 + r0;
    const int qp1 = q_pos0 + r1;
    const u64 dbase = drop.on ? dropout_base(drop, drop.site ^ ((drop.pos0 + (u64)h) << 40)) : 0;
    const float sl2 = scale * LOG2E;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

    // Keys any row of the block can see, and the last this warp's rows can.
    const int last = min(sq, blk0 + FA_FWD_WARPS * 16) - 1;
    int nk = sk;
    if (causal) nk = max(0, min(sk, q_pos0 + last - k_pos0 + 1));
    const int warp_last = q_pos0 + min(sq - 1, blk0 + warp * 16 + 15) - k_pos0;

    // Tile t + 1 is copied while tile t is used.
    const int tiles = (nk + FA_BC - 1) / FA_BC;
    if (tiles > 0) {
        load_tile<D>(KV, kh, krs, 0, nk);
        load_tile<D>(KV + TILE, vh, krs, 0, nk);
    }
    cp_async_commit();
    for (int t = 0; t < tiles; ++t) {
        const int j0 = t * FA_BC;
        if (t + 1 < tiles) {
            bf16* nxt = KV + ((t + 1) % 2) * 2 * TILE;
            load_tile<D>(nxt, kh, krs, j0 + FA_BC, nk);
            load_tile<D>(nxt + TILE, vh, krs, j0 + FA_BC, nk);
        }
        cp_async_commit();
        cp_async_wait1();
        __syncthreads();  // tile t is in shared memory for every thread
        const bf16* Ks = KV + (t % 2) * 2 * TILE;
        const bf16* Vs = Ks + TILE;
        // Under a causal mask a warp whose rows all precede the tile skips it.
        if (causal && warp_last < j0) {
            __syncthreads();
            continue;
        }

        float s[FA_BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_BC / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
            for (int nt = 0; nt < FA_BC / 8; nt += 2) {
                u32 kb[4];
                load_b_rows_n(kb, Ks, S, nt * 8, kc * 16);
                mma_pair(s[nt], s[nt + 1], qf[kc], kb);
            }
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < FA_BC / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = j0 + nt * 8 + t2 + e;
                const int kp = k_pos0 + key;
                const bool ok = key < nk;
                const bool v0 = ok && r0 < sq && (!causal || kp <= qp0);
                const bool v1 = ok && r1 < sq && (!causal || kp <= qp1);
                s[nt][e] = v0 ? s[nt][e] * sl2 : NEG_INF;
                s[nt][2 + e] = v1 ? s[nt][2 + e] * sl2 : NEG_INF;
                mx0 = fmaxf(mx0, s[nt][e]);
                mx1 = fmaxf(mx1, s[nt][2 + e]);
            }
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, off));
        }
        // A row that has seen no key keeps m = -inf and p = 0.
        const float a0 = mx0 == NEG_INF ? 1.0f : exp2f(m0 - mx0);
        const float a1 = mx1 == NEG_INF ? 1.0f : exp2f(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        u32 pf[FA_BC / 16][4];
        float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < FA_BC / 8; ++nt) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float mm = e < 2 ? m0 : m1;
                p[e] = s[nt][e] == NEG_INF ? 0.0f : exp2f(s[nt][e] - mm);
            }
            rs0 += p[0] + p[1];
            rs1 += p[2] + p[3];
            if (drop.on) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (p[e] != 0.0f) {
                        const int kp = k_pos0 + j0 + nt * 8 + t2 + (e & 1);
                        p[e] *= dropout_factor(drop, dbase, drop.sample0 + b, e < 2 ? qp0 : qp1, kp);
                    }
                }
            }
            pf[nt / 2][(nt % 2) * 2] = pack_bf16x2(p[0], p[1]);
            pf[nt / 2][(nt % 2) * 2 + 1] = pack_bf16x2(p[2], p[3]);
        }
        l0 = l0 * a0 + rs0;
        l1 = l1 * a1 + rs1;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            o[nt][0] *= a0;
            o[nt][1] *= a0;
            o[nt][2] *= a1;
            o[nt][3] *= a1;
        }
#pragma unroll
        for (int kc = 0; kc < FA_BC / 16; ++kc) {
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                u32 vb[4];
                load_b_rows_k(vb, Vs, S, kc * 16, nt * 8);
                mma_pair(o[nt], o[nt + 1], pf[kc], vb);
            }
        }
        __syncthreads();  // tile t is consumed before its buffer is refilled
    }
    cp_async_wait_all();  // no copy outlives the block
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l0 += __shfl_xor_sync(FULL_MASK, l0, off);
        l1 += __shfl_xor_sync(FULL_MASK, l1, off);
    }
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    bf16* oh = out + (i64)b * sq * qrs + (i64)h * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int c = nt * 8 + t2;
        if (r0 < sq) *(u32*)(oh + r0 * qrs + c) = pack_bf16x2(o[nt][0] * inv0, o[nt][1] * inv0);
        if (r1 < sq) *(u32*)(oh + r1 * qrs + c) = pack_bf16x2(o[nt][2] * inv1, o[nt][3] * inv1);
    }
    if (t2 == 0) {
        float* lh = lse + ((i64)b * hq + h) * sq;
        if (r0 < sq) lh[r0] = l0 > 0.0f ? (m0 + log2f(l0)) * LN2 : NEG_INF;
        if (r1 < sq) lh[r1] = l1 > 0.0f ? (m1 + log2f(l1)) * LN2 : NEG_INF;
    }
}

// The scalar kernels' arguments (d = dv = the kernel's head dim); grid
// (ceil(sq / 128), hq, batch), block FA_FWD_WARPS * 32, dynamic shared memory
// 4 * FA_BC * (d + 8) * 2 bytes (K and V tiles, double-buffered).
#define FLASH_FWD_CALL q, k, v, sq, sk, hq, hkv, q_pos0, k_pos0, causal, scale, drop, out, lse

extern "C" __global__ void __launch_bounds__(FA_FWD_WARPS * WARP) flash_fwd_bf16_32(ATT_FWD_ARGS) {
    flash_fwd_impl<32>(FLASH_FWD_CALL);
}
extern "C" __global__ void __launch_bounds__(FA_FWD_WARPS * WARP, 2) flash_fwd_bf16_64(ATT_FWD_ARGS) {
    flash_fwd_impl<64>(FLASH_FWD_CALL);
}
extern "C" __global__ void __launch_bounds__(FA_FWD_WARPS * WARP) flash_fwd_bf16_128(ATT_FWD_ARGS) {
    flash_fwd_impl<128>(FLASH_FWD_CALL);
}

template <int D>
__device__ __forceinline__ void flash_bwd_impl(const bf16* q, const bf16* k, const bf16* v,
                                               const float* lse, const float* delta,
                                               const bf16* d_o, int sq, int sk, int hq,
                                               int hkv, int q_pos0, int k_pos0, int causal,
                                               float scale, DropoutArgs drop, float* dq_acc,
                                               bf16* dk, bf16* dvg) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int S = D + 8;
    constexpr int SS = FA_BC + 8;
    constexpr int TILE = FA_BC * S;
    bf16* Ks = (bf16*)fa_smem;    // [FA_BC keys][S]
    bf16* Vs = Ks + TILE;         // [FA_BC keys][S]
    bf16* QG = Vs + TILE;         // two buffers of [Q tile][dO tile], each [FA_BR][S]
    bf16* Ds = QG + 4 * TILE;     // [FA_BR queries][SS] (dS, scaled)
    float* LD = (float*)(Ds + FA_BR * SS);  // two buffers of [lse][delta], each [FA_BR]
    const int g = blockIdx.y;
    const int b = blockIdx.z;
    const int group = hq / hkv;
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int gr = lane / 4;
    const int t2 = 2 * (lane % 4);
    const int j0 = blockIdx.x * FA_BC;
    const int kw = warp * 16;  // this warp's keys within the tile: rows kw + gr, + 8
    const int key0 = j0 + kw + gr;
    const i64 qrs = (i64)hq * D;
    const i64 krs = (i64)hkv * D;
    load_tile<D>(Ks, k + (i64)b * sk * krs + (i64)g * D, krs, j0, sk);
    load_tile<D>(Vs, v + (i64)b * sk * krs + (i64)g * D, krs, j0, sk);
    cp_async_commit();

    float ak[D / 8][4], av[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        ak[nt][0] = ak[nt][1] = ak[nt][2] = ak[nt][3] = 0.0f;
        av[nt][0] = av[nt][1] = av[nt][2] = av[nt][3] = 0.0f;
    }
    // The first query that can see the tile's first key.
    const int i_start = causal ? min(sq, max(0, k_pos0 + j0 - q_pos0)) : 0;
    const float sl2 = scale * LOG2E;

    // Every (query head of the group, query tile) in turn; the next one's Q, dO, lse
    // and delta are copied while this one is used.
    const int qtiles = (sq - i_start + FA_BR - 1) / FA_BR;
    const int steps = group * qtiles;
    auto fetch = [&](int it) {
        const int hh = g * group + it / qtiles;
        const int ii = i_start + (it % qtiles) * FA_BR;
        bf16* qg = QG + (it % 2) * 2 * TILE;
        load_tile<D>(qg, q + (i64)b * sq * qrs + (i64)hh * D, qrs, ii, sq);
        load_tile<D>(qg + TILE, d_o + (i64)b * sq * qrs + (i64)hh * D, qrs, ii, sq);
        float* ld = LD + (it % 2) * 2 * FA_BR;
        const i64 row = ((i64)b * hq + hh) * sq;
        for (int r = threadIdx.x; r < FA_BR; r += blockDim.x) {
            const bool in = ii + r < sq;
            cp_async4(ld + r, lse + (in ? row + ii + r : 0), in);
            cp_async4(ld + FA_BR + r, delta + (in ? row + ii + r : 0), in);
        }
    };
    if (steps > 0) fetch(0);
    cp_async_commit();
    for (int it = 0; it < steps; ++it) {
        const int h = g * group + it / qtiles;
        const int i0 = i_start + (it % qtiles) * FA_BR;
        const u64 dbase =
            drop.on ? dropout_base(drop, drop.site ^ ((drop.pos0 + (u64)h) << 40)) : 0;
        if (it + 1 < steps) fetch(it + 1);
        cp_async_commit();
        cp_async_wait1();
        __syncthreads();  // this step's tiles (and K, V the first time) are in place
        {
            const bf16* Qs = QG + (it % 2) * 2 * TILE;
            const bf16* Gs = Qs + TILE;
            const float* Ls = LD + (it % 2) * 2 * FA_BR;
            const float* Dl = Ls + FA_BR;

            // The tile's queries in two halves of FA_BR / 2 (fewer live registers).
#pragma unroll 1
            for (int half = 0; half < 2; ++half) {
                const int hq0 = half * (FA_BR / 2);
                // S^T and dP^T for this warp's 16 keys against the half's queries.
                float st[FA_BR / 16][4], dpt[FA_BR / 16][4];
#pragma unroll
                for (int nt = 0; nt < FA_BR / 16; ++nt) {
                    st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = 0.0f;
                    dpt[nt][0] = dpt[nt][1] = dpt[nt][2] = dpt[nt][3] = 0.0f;
                }
#pragma unroll
                for (int kc = 0; kc < D / 16; ++kc) {
                    u32 ka[4], va[4];
                    load_a(ka, Ks, S, kw, kc * 16);
                    load_a(va, Vs, S, kw, kc * 16);
#pragma unroll
                    for (int nt = 0; nt < FA_BR / 16; nt += 2) {
                        u32 qb[4], gb[4];
                        load_b_rows_n(qb, Qs, S, hq0 + nt * 8, kc * 16);
                        mma_pair(st[nt], st[nt + 1], ka, qb);
                        load_b_rows_n(gb, Gs, S, hq0 + nt * 8, kc * 16);
                        mma_pair(dpt[nt], dpt[nt + 1], va, gb);
                    }
                }
                // P Z into st, dS * scale into dpt (rows: keys; columns: queries).
#pragma unroll
                for (int nt = 0; nt < FA_BR / 16; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + (e < 2 ? 0 : 8);
                        const int qc = hq0 + nt * 8 + t2 + (e & 1);
                        const int qi = i0 + qc;
                        const float L = Ls[qc];
                        const bool vis = key < sk && qi < sq && L != NEG_INF &&
                                         (!causal || k_pos0 + key <= q_pos0 + qi);
                        const float p = vis ? exp2f(st[nt][e] * sl2 - L * LOG2E) : 0.0f;
                        float z = 1.0f;
                        if (drop.on && p != 0.0f) {
                            z = dropout_factor(drop, dbase, drop.sample0 + b, q_pos0 + qi,
                                               k_pos0 + key);
                        }
                        const float ds = p * (dpt[nt][e] * z - Dl[qc]) * scale;
                        st[nt][e] = p * z;
                        dpt[nt][e] = ds;
                        Ds[qc * SS + kw + gr + (e < 2 ? 0 : 8)] = f32_to_bf16(ds);
                    }
                }
                // dV += (P Z)^T dO and dK += dS^T Q: A from the accumulators, B columns of
                // the shared tiles.
#pragma unroll
                for (int kc = 0; kc < FA_BR / 32; ++kc) {
                    u32 pa[4], da[4];
                    acc_to_a(pa, st[2 * kc], st[2 * kc + 1]);
                    acc_to_a(da, dpt[2 * kc], dpt[2 * kc + 1]);
#pragma unroll
                    for (int nt = 0; nt < D / 8; nt += 2) {
                        u32 gb[4], qb[4];
                        load_b_rows_k(gb, Gs, S, hq0 + kc * 16, nt * 8);
                        mma_pair(av[nt], av[nt + 1], pa, gb);
                        load_b_rows_k(qb, Qs, S, hq0 + kc * 16, nt * 8);
                        mma_pair(ak[nt], ak[nt + 1], da, qb);
                    }
                }
            }
            __syncthreads();  // dS complete

            // dQ (the warp's 16 queries) += dS K, column block by column block.
            const int qw = warp * 16;
            const int qi0 = i0 + qw + gr;
            u32 dsa[FA_BC / 16][4];
#pragma unroll
            for (int kc = 0; kc < FA_BC / 16; ++kc) load_a(dsa[kc], Ds, SS, qw, kc * 16);
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
                for (int kc = 0; kc < FA_BC / 16; ++kc) {
                    u32 kb[4];
                    load_b_rows_k(kb, Ks, S, kc * 16, nt * 8);
                    mma_pair(c[0], c[1], dsa[kc], kb);
                }
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int col = (nt + u) * 8 + t2;
                    if (qi0 < sq) {
                        red_add2(dq_acc + ((i64)b * sq + qi0) * qrs + (i64)h * D + col, c[u][0],
                                 c[u][1]);
                    }
                    if (qi0 + 8 < sq) {
                        red_add2(dq_acc + ((i64)b * sq + qi0 + 8) * qrs + (i64)h * D + col,
                                 c[u][2], c[u][3]);
                    }
                }
            }
        }
    }
    cp_async_wait_all();  // no copy outlives the block

#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int col = nt * 8 + t2;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = key0 + 8 * half;
            if (key >= sk) continue;
            bf16* dkr = dk + ((i64)b * sk + key) * krs + (i64)g * D + col;
            bf16* dvr = dvg + ((i64)b * sk + key) * krs + (i64)g * D + col;
            bf16_add(dkr, ak[nt][2 * half]);
            bf16_add(dkr + 1, ak[nt][2 * half + 1]);
            bf16_add(dvr, av[nt][2 * half]);
            bf16_add(dvr + 1, av[nt][2 * half + 1]);
        }
    }
}

// The scalar kernels' arguments (d = dv = the kernel's head dim); grid
// (ceil(sk / FA_BC), hkv, batch), block FA_WARPS * 32, dynamic shared memory
// (6 * 64 * (d + 8) + 64 * 72) * 2 + 4 * 64 * 4 bytes. dq_acc [batch, sq, hq, d] fp32
// is added to (zero it first); dk, dv are added to.
#define FLASH_BWD_CALL                                                                     \
    q, k, v, lse, delta, d_o, sq, sk, hq, hkv, q_pos0, k_pos0, causal, scale, drop, dq_acc, \
        dk, dvg

extern "C" __global__ void __launch_bounds__(FA_WARPS * WARP, 3) flash_bwd_bf16_32(ATT_BWD_ARGS) {
    flash_bwd_impl<32>(FLASH_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(FA_WARPS * WARP, 3) flash_bwd_bf16_64(ATT_BWD_ARGS) {
    flash_bwd_impl<64>(FLASH_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(FA_WARPS * WARP) flash_bwd_bf16_128(ATT_BWD_ARGS) {
    flash_bwd_impl<128>(FLASH_BWD_CALL);
}
