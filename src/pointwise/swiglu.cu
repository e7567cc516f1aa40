/*
 * swiglu.cu - SwiGLU between the two expert GEMMs where it does not run in GEMM0's
 * epilogue (the sequential path), and its backward with the routing weight's gradient
 * <s, a> beside it (both paths run it after the dgrad GEMM of W2).
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "pointwise/pointwise.h"
#include "pointwise/dswiglu.cuh"

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

/* SwiGLU's backward and the routing weight's gradient, one block per row of each expert's
 * segment (blockIdx.y the local expert), from h = [g u] (GEMM0's output), sa = s = dy W2
 * (dy unweighted) and the row's weight w:
 *   a = silu(g) u,  dw = <s, a> (fp32, this rank's ffn columns, in dswiglu.cuh's order: the
 *   same bits every run and on every path),  da = w s,  dh = [da u silu'(g), da silu(g)],
 * and sa overwritten with w a, so that dW2 = dy^T (w a) (each element: dswiglu.cuh). A
 * thread takes 8 columns a pass, so a half-warp holds one 128-column block; the blocks'
 * sums wait in shared memory (block_sums, ceil(ffn / 128) of them) for the row's. */
#define DSWIGLU_THREADS 256
static __global__ void __launch_bounds__(DSWIGLU_THREADS)
swiglu_backward_kernel(const __nv_bfloat16 *h, __nv_bfloat16 *sa, __nv_bfloat16 *dh, int ffn,
                       const cometi_segment_t *segs, long long row_limit, const float *w_rows, float *dw_rows)
{
    extern __shared__ float block_sums[];
    const cometi_segment_t seg = segs[blockIdx.y];
    const int vecs = ffn / 8; /* 16-byte loads and stores: 8 columns at a time */
    const long long rows = cometi_segment_rows_below(seg, row_limit);
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long row = seg.start + r;
        const float w = w_rows[row];
        /* Every lane through every pass: the blocks' sums are shuffles among all. */
        for (int v0 = 0; v0 < vecs; v0 += blockDim.x) {
            const int v = v0 + (int)threadIdx.x, f = v * 8;
            float part = 0.0f;
            if (v < vecs) {
                const uint4 g4 = *(const uint4 *)(h + row * 2 * ffn + f), u4 = *(const uint4 *)(h + row * 2 * ffn + ffn + f);
                const uint4 s4 = *(const uint4 *)(sa + row * ffn + f);
                uint4 dg4, du4, a4;
                dswiglu8(g4, u4, s4, w, &dg4, &du4, &a4, &part);
                /* Read before written, element by element: h and dh may be one buffer (the fused path's). */
                ((uint4 *)dh)[(row * 2 * ffn + f) / 8] = dg4; /* indexed: nvcc then stores 16 bytes, not 4 x 4 */
                ((uint4 *)dh)[(row * 2 * ffn + ffn + f) / 8] = du4;
                *(uint4 *)(sa + row * ffn + f) = a4;
            }
            part = dot_block(part);
            if (threadIdx.x % 16 == 0 && v < vecs) block_sums[v / 16] = part;
        }
        __syncthreads();
        if (threadIdx.x == 0) dw_rows[row] = dot_blocks_sum(block_sums, (vecs + 15) / 16, 1);
        __syncthreads(); /* block_sums free for the next row */
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
    const size_t smem = sizeof(float) * (size_t)((vecs + 15) / 16); /* a float per 128 columns */
    swiglu_backward_kernel<<<grid, threads, smem, stream>>>((const __nv_bfloat16 *)h, (__nv_bfloat16 *)sa,
                                                         (__nv_bfloat16 *)dh, ffn, segs, (long long)row_limit, w_rows,
                                                         dw_rows);
    return cudaGetLastError();
}
