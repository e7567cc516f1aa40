/*
 * baseline.cu - the small kernels of the sequential baseline path (what Megatron-LM
 * runs around its all-to-alls and expert GEMMs): the permutation of token rows into the
 * send buffer, SwiGLU, and the weighted top-k sum; for the backward, the routing weights
 * to and from the send order, d topk_weights gathered home, and SwiGLU's backward with
 * <s, a> beside it.
 * Routing counts come from route.cu, the GEMMs from cuBLAS and the transfers from NCCL
 * (src/baseline/).
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "../internal.h"
#include "../baseline/baseline.h"

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

/* The grid of a kernel over every local segment's rows (blockIdx.y the segment), 256
 * threads a block, `per_row` items a row, at most 1024 blocks a segment. */
static dim3 segments_grid(int num_segs, int max_rows, int per_row)
{
    const long long work = (long long)max_rows * per_row;
    const long long blocks = (work + 255) / 256;
    return dim3((unsigned int)(blocks < 1024 ? blocks : 1024), (unsigned int)num_segs);
}

extern "C" cudaError_t cometi_launch_swiglu(const void *h, void *act, int ffn, const cometi_segment_t *segs,
                                            int num_segs, int max_rows, cudaStream_t stream)
{
    if (num_segs == 0 || max_rows == 0) return cudaSuccess;
    swiglu_kernel<<<segments_grid(num_segs, max_rows, ffn / 8), 256, 0, stream>>>((const __nv_bfloat16 *)h,
                                                                                 (__nv_bfloat16 *)act, ffn, segs);
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

/* The routing weights in the send order: out[send_pos[i]] = w[i] (send_pos -1: a choice
 * with no row, left out). */
static __global__ void weights_to_send_order_kernel(const float *w, const int32_t *send_pos, int n, float *out)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (send_pos[i] >= 0) out[send_pos[i]] = w[i];
}

extern "C" cudaError_t cometi_launch_weights_to_send_order(const float *w, const int32_t *send_pos, int n, float *out,
                                                           cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    weights_to_send_order_kernel<<<(n + 255) / 256, 256, 0, stream>>>(w, send_pos, n, out);
    return cudaGetLastError();
}

/* d topk_weights[i] = sum over the tp partials c of rows[c c_stride + send_pos[i] pos_stride]
 * in fp32, c in order (the same bits every run); 0 for a choice with no row. */
static __global__ void gather_weight_grads_kernel(const float *rows, int tp, size_t c_stride, int pos_stride,
                                                  const int32_t *send_pos, int n, float *dw)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float sum = 0.0f;
        if (send_pos[i] >= 0)
            for (int c = 0; c < tp; c++) sum += rows[c * c_stride + (size_t)send_pos[i] * pos_stride];
        dw[i] = sum;
    }
}

extern "C" cudaError_t cometi_launch_gather_weight_grads(const float *rows, int tp, size_t c_stride, int pos_stride,
                                                         const int32_t *send_pos, int n, float *dw,
                                                         cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    gather_weight_grads_kernel<<<(n + 255) / 256, 256, 0, stream>>>(rows, tp, c_stride, pos_stride, send_pos, n, dw);
    return cudaGetLastError();
}

/* SwiGLU's backward and the routing weight's gradient, one block per row of each expert's
 * segment (blockIdx.y the local expert), from h = [g u] (GEMM0's output), sa = s = dy W2
 * (dy unweighted) and the row's weight w:
 *   a = silu(g) u,  dw = <s, a> (fp32, this rank's ffn columns; a fixed order: the same
 *   bits every run),  da = w s,  dh = [da u silu'(g), da silu(g)],
 * and sa overwritten with w a, so that dW2 = dy^T (w a). silu'(g) = sig(g) (1 + g (1 - sig(g))). */
#define DSWIGLU_THREADS 256
static __global__ void __launch_bounds__(DSWIGLU_THREADS)
swiglu_backward_kernel(const __nv_bfloat16 *h, __nv_bfloat16 *sa, __nv_bfloat16 *dh, int ffn,
                       const cometi_segment_t *segs, long long row_limit, const float *w_rows, float *dw_rows)
{
    __shared__ float warp_sums[DSWIGLU_THREADS / 32];
    const cometi_segment_t seg = segs[blockIdx.y];
    const int vecs = ffn / 8; /* 16-byte loads and stores: 8 columns at a time */
    const long long rows = seg.start + (long long)seg.rows <= row_limit ? seg.rows
                           : seg.start < row_limit                   ? row_limit - seg.start
                                                                     : 0;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long row = seg.start + r;
        const float w = w_rows[row];
        float dot = 0.0f;
        for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
            const int f = v * 8;
            const uint4 g4 = *(const uint4 *)(h + row * 2 * ffn + f), u4 = *(const uint4 *)(h + row * 2 * ffn + ffn + f);
            const uint4 s4 = *(const uint4 *)(sa + row * ffn + f);
            const __nv_bfloat162 *g = (const __nv_bfloat162 *)&g4, *u = (const __nv_bfloat162 *)&u4,
                                 *s = (const __nv_bfloat162 *)&s4;
            uint4 dg4, du4, a4;
            __nv_bfloat162 *dg = (__nv_bfloat162 *)&dg4, *du = (__nv_bfloat162 *)&du4, *wa = (__nv_bfloat162 *)&a4;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float2 gf = __bfloat1622float2(g[q]), uf = __bfloat1622float2(u[q]), sf = __bfloat1622float2(s[q]);
                const float sx = 1.0f / (1.0f + expf(-gf.x)), sy = 1.0f / (1.0f + expf(-gf.y));
                const float silu_x = gf.x * sx, silu_y = gf.y * sy, ax = silu_x * uf.x, ay = silu_y * uf.y;
                const float dax = w * sf.x, day = w * sf.y;
                dot += sf.x * ax + sf.y * ay;
                dg[q] = __floats2bfloat162_rn(dax * uf.x * sx * (1.0f + gf.x * (1.0f - sx)),
                                              day * uf.y * sy * (1.0f + gf.y * (1.0f - sy)));
                du[q] = __floats2bfloat162_rn(dax * silu_x, day * silu_y);
                wa[q] = __floats2bfloat162_rn(w * ax, w * ay);
            }
            /* Read before written, element by element: h and dh may be one buffer (the fused path's). */
            *(uint4 *)(dh + row * 2 * ffn + f) = dg4;
            *(uint4 *)(dh + row * 2 * ffn + ffn + f) = du4;
            *(uint4 *)(sa + row * ffn + f) = a4;
        }
        for (int off = 16; off > 0; off /= 2) dot += __shfl_down_sync(0xffffffffu, dot, off);
        if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dot;
        __syncthreads();
        if (threadIdx.x == 0) {
            float sum = 0.0f;
            for (int q = 0; q < (int)blockDim.x / 32; q++) sum += warp_sums[q];
            dw_rows[row] = sum;
        }
        __syncthreads(); /* warp_sums free for the next row */
    }
}

extern "C" cudaError_t cometi_launch_swiglu_backward(const void *h, void *sa, void *dh, int ffn,
                                                     const cometi_segment_t *segs, int num_segs, int max_rows,
                                                     int64_t row_limit, const float *w_rows, float *dw_rows,
                                                     cudaStream_t stream)
{
    if (num_segs == 0 || max_rows == 0) return cudaSuccess;
    const int vecs = ffn / 8, threads = vecs >= DSWIGLU_THREADS ? DSWIGLU_THREADS : (vecs + 31) / 32 * 32;
    const dim3 grid((unsigned int)(max_rows < 1024 ? max_rows : 1024), (unsigned int)num_segs);
    swiglu_backward_kernel<<<grid, threads, 0, stream>>>((const __nv_bfloat16 *)h, (__nv_bfloat16 *)sa,
                                                         (__nv_bfloat16 *)dh, ffn, segs, (long long)row_limit, w_rows,
                                                         dw_rows);
    return cudaGetLastError();
}
