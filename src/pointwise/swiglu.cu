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
 *   a = silu(g) u,  dw = <s, a> (fp32, this rank's ffn columns; a fixed order: the same
 *   bits every run),  da = w s,  dh = [da u silu'(g), da silu(g)],
 * and sa overwritten with w a, so that dW2 = dy^T (w a) (each element: dswiglu.cuh). */
#define DSWIGLU_THREADS 256
static __global__ void __launch_bounds__(DSWIGLU_THREADS)
swiglu_backward_kernel(const __nv_bfloat16 *h, __nv_bfloat16 *sa, __nv_bfloat16 *dh, int ffn,
                       const cometi_segment_t *segs, long long row_limit, const float *w_rows, float *dw_rows)
{
    __shared__ float warp_sums[DSWIGLU_THREADS / 32];
    const cometi_segment_t seg = segs[blockIdx.y];
    const int vecs = ffn / 8; /* 16-byte loads and stores: 8 columns at a time */
    const long long rows = cometi_segment_rows_below(seg, row_limit);
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
            uint32_t dg[4], du[4], wa[4]; /* words, so each goes out as one 16-byte store */
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float2 gf = __bfloat1622float2(g[q]), uf = __bfloat1622float2(u[q]), sf = __bfloat1622float2(s[q]);
                const dswiglu_t x = dswiglu(gf.x, uf.x, sf.x, w), y = dswiglu(gf.y, uf.y, sf.y, w);
                dot += sf.x * x.a + sf.y * y.a;
                dg[q] = bf16x2_bits(x.dg, y.dg);
                du[q] = bf16x2_bits(x.du, y.du);
                wa[q] = bf16x2_bits(x.wa, y.wa);
            }
            const uint4 dg4 = make_uint4(dg[0], dg[1], dg[2], dg[3]), du4 = make_uint4(du[0], du[1], du[2], du[3]),
                        a4 = make_uint4(wa[0], wa[1], wa[2], wa[3]);
            /* Read before written, element by element: h and dh may be one buffer (the fused path's). */
            ((uint4 *)dh)[(row * 2 * ffn + f) / 8] = dg4;
            ((uint4 *)dh)[(row * 2 * ffn + ffn + f) / 8] = du4;
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
