// Layout kernels of the device interpreter (executor/src/device): what the host
// interpreter does with plain loops between kernels, done where the buffers live so
// that no activation goes through the host. The GPU twins of `split_qkv`,
// `join_qkv`, `bshd_to_sbhd` / `sbhd_to_bshd` and `rope_qkv_host` in
// executor/src/train.rs and of `HostDevice`'s bias and accumulate methods. All
// bf16 values are copied bit for bit except where fp32 arithmetic is named.

// dst[0, n) = src[0, n) by the block's threads, 16 bytes at a time when both rows
// allow it.
__device__ __forceinline__ void copy_row(const bf16* src, bf16* dst, int n) {
    if (aligned8(src, n) && aligned8(dst, n)) {
        const bf16x8* s = (const bf16x8*)src;
        bf16x8* d = (bf16x8*)dst;
        for (int i = threadIdx.x; i < n / 8; i += blockDim.x) d[i] = s[i];
    } else {
        for (int c = threadIdx.x; c < n; c += blockDim.x) dst[c] = src[c];
    }
}

// Where fused row r of x [s, b, (hq d | hkv d | hkv dv)] lives: r = si * b + bi
// holds token t = bi * s + si of q [b, s, hq, d], k [b, s, hkv, d] and
// v [b, s, hkv, dv], part p (q, k, v) at columns col[p] of the row and element
// part[p] of its own buffer, width[p] wide.
struct QkvRow {
    i64 row;
    int col[3];
    i64 part[3];
    int width[3];
};

__device__ __forceinline__ QkvRow qkv_row(int r, int b, int s, int hq, int hkv, int d, int dv) {
    const i64 t = (i64)(r % b) * s + r / b;
    QkvRow at;
    at.width[0] = hq * d;
    at.width[1] = hkv * d;
    at.width[2] = hkv * dv;
    at.row = (i64)r * (at.width[0] + at.width[1] + at.width[2]);
    at.col[0] = 0;
    at.col[1] = at.width[0];
    at.col[2] = at.width[0] + at.width[1];
#pragma unroll
    for (int p = 0; p < 3; ++p) at.part[p] = t * at.width[p];
    return at;
}

// q, k, v (written) from the fused rows x. One block per fused row.
extern "C" __global__ void split_qkv_bf16(const bf16* x, int b, int s, int hq, int hkv, int d,
                                          int dv, bf16* q, bf16* k, bf16* v) {
    const QkvRow at = qkv_row(blockIdx.x, b, s, hq, hkv, d, dv);
    bf16* dst[3] = {q, k, v};
#pragma unroll
    for (int p = 0; p < 3; ++p) copy_row(x + at.row + at.col[p], dst[p] + at.part[p], at.width[p]);
}

// The fused rows x (written) from q, k, v. One block per fused row.
extern "C" __global__ void join_qkv_bf16(const bf16* q, const bf16* k, const bf16* v, int b, int s,
                                         int hq, int hkv, int d, int dv, bf16* x) {
    const QkvRow at = qkv_row(blockIdx.x, b, s, hq, hkv, d, dv);
    const bf16* src[3] = {q, k, v};
#pragma unroll
    for (int p = 0; p < 3; ++p) copy_row(src[p] + at.part[p], x + at.row + at.col[p], at.width[p]);
}

// y [s, b, w] from x [b, s, w] (to_sbhd != 0), or y [b, s, w] from x [s, b, w]
// (written). One block per row of y.
extern "C" __global__ void transpose_bs_bf16(const bf16* x, int b, int s, int w, int to_sbhd,
                                             bf16* y) {
    const int r = blockIdx.x;
    const int src = to_sbhd ? (r % b) * s + r / b : (r % s) * b + r / s;
    copy_row(x + (i64)src * w, y + (i64)r * w, w);
}

// RoPE on fused rows x [rows, width]: the first `heads` (query then key heads, each
// `head_dim` wide and contiguous) rotated by R(sign * angle) at positions[r], the
// columns after them copied; y written. One block per row; threads stride over
// pair indices, each pair's rotation computed once and reused over the heads.
extern "C" __global__ void rope_qkv_bf16(const bf16* x, const u32* positions, int heads,
                                         int head_dim, int width, float theta, float factor,
                                         float low_wl, float high_wl, float sign, bf16* y) {
    const int r = blockIdx.x;
    const bf16* xr = x + (i64)r * width;
    bf16* yr = y + (i64)r * width;
    const int rotated = heads * head_dim;
    copy_row(xr + rotated, yr + rotated, width - rotated);
    const int half = head_dim / 2;
    const double pos = (double)positions[r];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, s;
        rope_cos_sin(pos, i, head_dim, theta, factor, low_wl, high_wl, sign, c, s);
        for (int h = 0; h < heads; ++h) {
            const int base = h * head_dim;
            const float x1 = bf16_to_f32(xr[base + i]);
            const float x2 = bf16_to_f32(xr[base + i + half]);
            yr[base + i] = f32_to_bf16(x1 * c - x2 * s);
            yr[base + i + half] = f32_to_bf16(x2 * c + x1 * s);
        }
    }
}

// y [rows, n] += bias [n] broadcast over rows (fp32 add, rounded once).
extern "C" __global__ void bias_add_bf16(const bf16* bias, int rows, int n, bf16* y) {
    if (aligned8(y, n) && aligned8(bias, n)) {
        // Eight columns at a time (one 32-bit modulo per eight, none per element).
        const int n8 = n / 8;
        GRID_STRIDE(e8, (i64)rows * n8) {
            float a[8], b[8];
            unpack8(((const bf16x8*)y)[e8], a);
            unpack8(((const bf16x8*)bias)[(int)(e8 % n8)], b);
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] += b[j];
            ((bf16x8*)y)[e8] = pack8(a);
        }
        return;
    }
    GRID_STRIDE(e, (i64)rows * n) { bf16_add(y + e, bf16_to_f32(bias[e % n])); }
}

// The bias gradient's first pass: partial [gridDim.y, n] (fp32, written), row
// chunk blockIdx.y's column sums of dy [rows, n], rows in order. Threads of a block
// take adjacent columns, so every row read is coalesced; `colsum_add_f32` (norm.cu)
// then adds the chunks into the gradient in order, deterministically.
// `vec`: a thread takes 8 adjacent columns (16-byte loads; n % 8 == 0).
extern "C" __global__ void bias_grad_f32(const bf16* dy, int rows, int n, int rows_per_chunk,
                                         int vec, float* partial) {
    const int r0 = blockIdx.y * rows_per_chunk;
    const int r1 = min(rows, r0 + rows_per_chunk);
    if (vec) {
        const int c8 = blockIdx.x * blockDim.x + threadIdx.x;
        if (c8 >= n / 8) return;
        float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int r = r0; r < r1; ++r) {
            float g[8];
            unpack8(((const bf16x8*)(dy + (i64)r * n))[c8], g);
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] += g[j];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) partial[(i64)blockIdx.y * n + c8 * 8 + j] = a[j];
        return;
    }
    const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float s = 0.0f;
    for (int r = r0; r < r1; ++r) s += bf16_to_f32(dy[(i64)r * n + c]);
    partial[(i64)blockIdx.y * n + c] = s;
}

// acc += x (fp32 add, rounded once); 16-byte accesses when both pointers allow.
extern "C" __global__ void accumulate_bf16(const bf16* x, i64 n, bf16* acc) {
    const bool vec = ((((u64)x) | ((u64)acc)) & 15u) == 0;
    const i64 n8 = vec ? n / 8 : 0;
    GRID_STRIDE(i8, n8) {
        float a[8], b[8];
        unpack8(((const bf16x8*)acc)[i8], a);
        unpack8(((const bf16x8*)x)[i8], b);
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] += b[e];
        ((bf16x8*)acc)[i8] = pack8(a);
    }
    GRID_STRIDE(j, n - n8 * 8) { bf16_add(acc + n8 * 8 + j, bf16_to_f32(x[n8 * 8 + j])); }
}
