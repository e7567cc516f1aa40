/*
 * rows.cu - the sequential path's own kernels around its all-to-alls and cuBLAS GEMMs
 * (what Megatron-LM runs there): the permutation of token rows into the send buffer, and
 * the weighted top-k sum of the rows that came back. Routing counts come from the route
 * kernels (comm/route_kernels.cu), SwiGLU and its backward from pointwise/, the transfers from
 * NCCL (baseline.c, backward.c).
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
