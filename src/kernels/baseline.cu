/*
 * baseline.cu - the small kernels of the sequential baseline path (what Megatron-LM
 * runs around its all-to-alls and expert GEMMs): the permutation of token rows into the
 * send buffer, SwiGLU, and the weighted top-k sum. Routing counts come from route.cu,
 * the GEMMs from cuBLAS and the transfers from NCCL (src/baseline/baseline.c).
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "../internal.h"
#include "../baseline/baseline.h"

/* One block per (token, choice): copy the token's row to its place in the send
 * buffer, and remember that place for the combine. */
static __global__ void permute_kernel(const uint4 *x, const int32_t *ids, const int32_t *pos,
                                      const int32_t *send_base, int k, int row_vecs, uint4 *send,
                                      int32_t *send_pos)
{
    const int i = blockIdx.x, t = i / k;
    const int dst = send_base[ids[i]] + pos[i];
    if (threadIdx.x == 0) send_pos[i] = dst;
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

/* act[r][f] = silu(h[r][f]) * h[r][F + f] over the rows of each expert's segment;
 * blockIdx.y is the local expert, padding rows are skipped. */
static __global__ void swiglu_kernel(const __nv_bfloat16 *h, __nv_bfloat16 *act, int ffn,
                                     const cometi_segment_t *segs)
{
    const cometi_segment_t seg = segs[blockIdx.y];
    const int vecs = ffn / 8;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < (long long)seg.rows * vecs;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long row = seg.start + idx / vecs;
        const int f = (int)(idx % vecs) * 8;
        uint4 g4 = *(const uint4 *)(h + row * 2 * ffn + f);
        uint4 u4 = *(const uint4 *)(h + row * 2 * ffn + ffn + f);
        const __nv_bfloat162 *g = (const __nv_bfloat162 *)&g4, *u = (const __nv_bfloat162 *)&u4;
        uint4 o4;
        __nv_bfloat162 *o = (__nv_bfloat162 *)&o4;
        for (int q = 0; q < 4; q++) {
            float2 gf = __bfloat1622float2(g[q]), uf = __bfloat1622float2(u[q]);
            float a = gf.x / (1.0f + __expf(-gf.x)) * uf.x;
            float b = gf.y / (1.0f + __expf(-gf.y)) * uf.y;
            o[q] = __floats2bfloat162_rn(a, b);
        }
        *(uint4 *)(act + row * ffn + f) = o4;
    }
}

extern "C" cudaError_t cometi_launch_swiglu(const void *h, void *act, int ffn, const cometi_segment_t *segs,
                                            int num_segs, int max_rows, cudaStream_t stream)
{
    if (num_segs == 0 || max_rows == 0) return cudaSuccess;
    long long work = (long long)max_rows * (ffn / 8);
    int blocks = (int)((work + 255) / 256);
    if (blocks > 1024) blocks = 1024;
    dim3 grid(blocks, num_segs);
    swiglu_kernel<<<grid, 256, 0, stream>>>((const __nv_bfloat16 *)h, (__nv_bfloat16 *)act, ffn, segs);
    return cudaGetLastError();
}

/* y[t] = sum_j w[t][j] * (sum_c back[c][send_pos[t][j]]) in fp32, j and c in order: the
 * same bits every run. With tp = 1 there is one copy. */
static __global__ void combine_kernel(const __nv_bfloat16 *back, int tp, size_t copy_stride, const int32_t *send_pos,
                                      const float *w, int k, int hidden, __nv_bfloat16 *y)
{
    const int t = blockIdx.x;
    for (int h = threadIdx.x * 8; h < hidden; h += blockDim.x * 8) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < k; j++) {
            const float wj = w[t * k + j];
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
