/*
 * rows.cu - the sequential path's own kernels around its all-to-alls and cuBLAS GEMMs
 * (what Megatron-LM runs there): the permutation of token rows into the send buffer, and
 * the weighted top-k sum of the rows that came back; with block-scaled FP8, the permutation
 * of E4M3 rows with their scales and the relayout of the received rows' scales into what
 * cuBLASLt reads (baseline/blaslt_fp8.h). Routing counts come from the route kernels
 * (comm/route_kernels.cu), SwiGLU, its backward and the FP8 quantizer from pointwise/, the
 * transfers from NCCL (baseline.c, backward.c).
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "baseline/rows.h"

/* One block per (token, choice): copy the token's row to its place in the send
 * buffer, and remember that place for the combine; with no ids, to the place send_pos
 * already holds (a backward sending x again). */
static __global__ void permute_kernel(const uint4 *x, const int32_t *ids, const int32_t *pos,
                                      const int32_t *send_base, int k, int row_vecs, uint4 *send,
                                      int32_t *send_pos)
{
    const int i = blockIdx.x, t = i / k;
    const int dst = ids ? send_base[ids[i]] + pos[i] : send_pos[i];
    if (ids && threadIdx.x == 0) send_pos[i] = dst;
    const uint4 *src = x + (size_t)t * row_vecs;
    uint4 *out = send + (size_t)dst * row_vecs;
    for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) out[v] = src[v];
}

extern "C" cudaError_t cometi_launch_permute(const void *x, const int32_t *ids, const int32_t *pos,
                                             const int32_t *send_base, int n, int k, int hidden, void *send,
                                             int32_t *send_pos, cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    permute_kernel<<<n, 128, 0, stream>>>((const uint4 *)x, ids, pos, send_base, k, hidden / 8, (uint4 *)send,
                                          send_pos);
    return cudaGetLastError();
}

/* The same for FP8 rows: one block per (token, choice) copies the token's E4M3 row and its
 * scales to the row's send place (with no ids, the place send_pos holds: a backward's dy,
 * or x sent again). The scales travel in their own buffer (their own NCCL
 * message per chunk), so the values arrive as the contiguous rows the GEMM reads. */
static __global__ void permute_fp8_kernel(const uint4 *xq, const float *xs, const int32_t *ids, const int32_t *pos,
                                          const int32_t *send_base, int k, int row_vecs, int blocks, uint4 *send_q,
                                          float *send_s, int32_t *send_pos)
{
    const int i = blockIdx.x, t = i / k;
    const int dst = ids ? send_base[ids[i]] + pos[i] : send_pos[i];
    if (ids && threadIdx.x == 0) send_pos[i] = dst;
    const uint4 *src = xq + (size_t)t * row_vecs;
    uint4 *out = send_q + (size_t)dst * row_vecs;
    for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) out[v] = src[v];
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) send_s[(size_t)dst * blocks + b] = xs[(size_t)t * blocks + b];
}

extern "C" cudaError_t cometi_launch_permute_fp8(const void *xq, const float *xs, const int32_t *ids,
                                                 const int32_t *pos, const int32_t *send_base, int n, int k,
                                                 int hidden, int blocks, void *send_q, float *send_s,
                                                 int32_t *send_pos, cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    permute_fp8_kernel<<<n, 128, 0, stream>>>((const uint4 *)xq, xs, ids, pos, send_base, k, hidden / 16, blocks,
                                              (uint4 *)send_q, send_s, send_pos);
    return cudaGetLastError();
}

/* blockIdx.y is the group. Its packed scales [blocks][padded] are walked in their own
 * order: entry i is row i % padded of block i / padded, so the stores are contiguous and
 * the loads (K-major: a row's blocks side by side) are strided, which at blocks floats a
 * row is the cheap side (MN-major sources load contiguously too). Then its padding rows' values, 16 bytes a thread. */
static __global__ void fp8_pack_groups_kernel(const cometi_fp8_group_t *groups, const float *src_scales,
                                              long long src_row, long long src_block, int blocks, uint4 *q,
                                              int row_vecs, float *scales)
{
    const cometi_fp8_group_t g = groups[blockIdx.y];
    if (g.padded == 0) return;
    const long long stride = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float *dst = scales + g.before * blocks;
    const long long entries = (long long)g.padded * blocks;
    for (long long i = first; i < entries; i += stride) {
        const int r = (int)(i % g.padded), b = (int)(i / g.padded);
        if (r >= g.rows) dst[i] = 0.0f;
        else if (src_scales) dst[i] = src_scales[((long long)g.start + r) * src_row + b * src_block];
    }
    const long long pad_vecs = (long long)(g.padded - g.rows) * row_vecs;
    uint4 *pad = q + ((long long)g.start + g.rows) * row_vecs;
    for (long long i = first; i < pad_vecs; i += stride) pad[i] = make_uint4(0, 0, 0, 0);
}

extern "C" cudaError_t cometi_launch_fp8_pack_groups(const cometi_fp8_group_t *groups, int num_groups, int max_padded,
                                                     const float *src_scales, int64_t src_row, int64_t src_block,
                                                     int blocks, void *q, int cols, float *scales, cudaStream_t stream)
{
    if (num_groups == 0 || max_padded == 0) return cudaSuccess;
    const long long work = (long long)max_padded * blocks, per_block = 256;
    const long long grid = (work + per_block - 1) / per_block;
    fp8_pack_groups_kernel<<<dim3((unsigned int)(grid < 1024 ? grid : 1024), (unsigned int)num_groups), 256, 0,
                             stream>>>(groups, src_scales, src_row, src_block, blocks, (uint4 *)q, cols / 16,
                                       scales);
    return cudaGetLastError();
}

/* y[t] = sum_j w[t][j] * (sum_c back[c][send_pos[t][j]]) in fp32, j and c in order: the
 * same bits every run. With tp = 1 there is one copy; w NULL weighs every choice 1. */
static __global__ void combine_kernel(const __nv_bfloat16 *back, int tp, size_t copy_stride, const int32_t *send_pos,
                                      const float *w, int k, int hidden, __nv_bfloat16 *y)
{
    const int t = blockIdx.x;
    for (int h = threadIdx.x * 8; h < hidden; h += blockDim.x * 8) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < k; j++) {
            const float wj = w ? w[t * k + j] : 1.0f;
            float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int c = 0; c < tp; c++) {
                uint4 v4 = *(const uint4 *)(back + c * copy_stride + (size_t)send_pos[t * k + j] * hidden + h);
                const __nv_bfloat162 *v = (const __nv_bfloat162 *)&v4;
                for (int q = 0; q < 4; q++) {
                    float2 f = __bfloat1622float2(v[q]);
                    part[2 * q] += f.x;
                    part[2 * q + 1] += f.y;
                }
            }
            for (int q = 0; q < 8; q++) acc[q] += wj * part[q];
        }
        uint4 o4;
        __nv_bfloat162 *o = (__nv_bfloat162 *)&o4;
        for (int q = 0; q < 4; q++) o[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
        *(uint4 *)(y + (size_t)t * hidden + h) = o4;
    }
}

extern "C" cudaError_t cometi_launch_combine(const void *back, int tp, size_t copy_stride, const int32_t *send_pos,
                                             const float *w, int m, int k, int hidden, void *y, cudaStream_t stream)
{
    if (m == 0) return cudaSuccess;
    int threads = hidden / 8 < 256 ? hidden / 8 : 256;
    combine_kernel<<<m, threads, 0, stream>>>((const __nv_bfloat16 *)back, tp, copy_stride, send_pos, w, k, hidden,
                                              (__nv_bfloat16 *)y);
    return cudaGetLastError();
}
