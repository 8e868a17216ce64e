// Vocabulary-parallel embedding: the GPU twin of `cpu/embedding.rs`. A rank holds
// rows [vocab_start, vocab_start + vocab_local) of the table; other ids give zero
// rows (forward) and contribute nothing (backward).

// out[t, :] = table[ids[t] - vocab_start, :] (bf16), one block per token.
extern "C" __global__ void embedding_fwd_bf16(const u32* ids, const bf16* table, int vocab_start,
                                              int vocab_local, int dim, bf16* out) {
    const int t = blockIdx.x;
    const i64 r = (i64)ids[t] - vocab_start;
    const bool own = r >= 0 && r < vocab_local;
    bf16* o = out + (i64)t * dim;
    const bf16* src = table + (own ? r : 0) * dim;
    if (aligned8(o, dim) && aligned8(table, dim)) {
        const bf16x8* s8 = (const bf16x8*)src;
        bf16x8* o8 = (bf16x8*)o;
        for (int i = threadIdx.x; i < dim / 8; i += blockDim.x) {
            bf16x8 v;
            if (own) {
                v = s8[i];
            } else {
                v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
            }
            o8[i] = v;
        }
    } else {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = own ? src[c] : (bf16)0;
    }
}

// d_table[ids[t] - vocab_start, :] += d_out[t, :] (fp32 table gradient), one block
// per token. Repeated ids meet in atomics, so the summation order is not fixed.
extern "C" __global__ void embedding_bwd_bf16(const u32* ids, const bf16* d_out, int vocab_start,
                                              int vocab_local, int dim, float* d_table) {
    const int t = blockIdx.x;
    const i64 r = (i64)ids[t] - vocab_start;
    if (r < 0 || r >= vocab_local) return;
    float* dst = d_table + r * dim;
    row_for_each(d_out + (i64)t * dim, dim, [&](int c, float g) { atomicAdd(dst + c, g); });
}
