/*
 * swiglu_fp8.cu - SwiGLU's backward in FP8 training, straight into the FP8 operands the
 * GEMMs after it read, so no bf16 dh or w a ever goes to memory:
 *   swiglu_backward_t_kernel     the weight gradients' operands, (w a)^T and dh^T, each
 *                                quantized along the tokens (128 x 1 blocks); in the fused
 *                                path's form (ROWS) also dh's rows quantized 1 x 128, left
 *                                in [g u]'s own bytes, and each tile's part of <s, a>
 *                                (swiglu_dot_sum_kernel sums them): one pass over [g u]
 *                                and s;
 *   swiglu_backward_rows_kernel  the sequential path's second kernel: dh's rows quantized
 *                                1 x 128 over s's bytes (its cuBLASLt GEMM reads them
 *                                contiguous), and <s, a>.
 * All compute the same values as swiglu.cu's bf16 backward (dswiglu.cuh, each value
 * rounded to bf16 as that kernel stores it; <s, a> in its order), then quantize them as
 * quantize.cu's kernels quantize bf16 rows: the FP8 operands are those the bf16 backward
 * and the casts would make, bit for bit, in less than half the traffic (the four kernels
 * they replace also wrote and read dh and w a in bf16). [g u] is kept in bf16, or in E4M3
 * (each value dequantized and rounded to bf16 first: the same bits as the bf16 backward
 * on those values).
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "base/fp8.h"
#include "pointwise/pointwise.h"
#include "pointwise/dswiglu.cuh"
#include "pointwise/e4m3_tile.cuh"

/* Where dh's rows go: row r's k block b (128 E4M3 bytes: gate's blocks, then up's) at
 * rows + r x row_bytes + b x block_bytes, its scale at scales[r + b x scale_block], and the
 * row's <s, a> over 128-column tile t at dot_parts[r x dot_row + t x dot_tile]. The
 * one-kernel backward (cometi_launch_swiglu_backward_e4m3_in_place): [g u]'s own bytes,
 * the parts in a workspace; the row kernel: s's bytes, the parts in shared memory. */
typedef struct dh_rows_out {
    uint8_t *rows;
    long long row_bytes;
    int block_bytes;
    float *scales;
    long long scale_block;
    float *dot_parts;
    long long dot_row, dot_tile;
} dh_rows_out_t;

/* One row's two 1 x 128 blocks of dh in tile column ct (dg's block ct and du's block
 * ffn / 128 + ct), held by the 16 lanes of a half-warp, 8 columns each (col_in the first):
 * each block's amax across them, its scale and bytes out, and the tile's part of <s, a>
 * (dot_block). Every lane takes part (the shuffles); rows past
 * their segment (`in` false) write nothing. */
static __device__ __forceinline__ void dh_row_blocks(const dh_rows_out_t &o, uint4 dg4, uint4 du4, float part,
                                                     long long row, bool in, int ct, int blocks, int col_in,
                                                     int pow2)
{
    const float dot = dot_block(part);
    float amax_g = amax_float(amax8(dg4, 0)), amax_u = amax_float(amax8(du4, 0));
#pragma unroll
    for (int off = 8; off > 0; off /= 2) {
        amax_g = cometi_fp8_max(amax_g, __shfl_xor_sync(0xffffffffu, amax_g, off));
        amax_u = cometi_fp8_max(amax_u, __shfl_xor_sync(0xffffffffu, amax_u, off));
    }
    if (!in) return;
    const float sg = cometi_fp8_scale(amax_g, pow2), su = cometi_fp8_scale(amax_u, pow2);
    uint8_t *q = o.rows + row * o.row_bytes + col_in;
    *(uint2 *)(q + (long long)ct * o.block_bytes) = quantize8(dg4, cometi_fp8_inverse(sg));
    *(uint2 *)(q + (long long)(blocks + ct) * o.block_bytes) = quantize8(du4, cometi_fp8_inverse(su));
    if (col_in == 0) {
        o.scales[row + (long long)ct * o.scale_block] = sg;
        o.scales[row + (long long)(blocks + ct) * o.scale_block] = su;
        o.dot_parts[row * o.dot_row + (long long)ct * o.dot_tile] = dot;
    }
}

/* Eight columns of a kept gate or up row from `h` at element (row, col): bf16 (h_scales
 * NULL: the 16 bytes as they are), or E4M3 (GU8: 1 x 128 blocks, block b's scale of row r
 * at h_scales[b x ld + r]: the 8 bytes and the scale's bits, dequantized by gu_bf16 where
 * they are used, so that loads stay in flight ahead of the math). */
template <bool GU8>
static __device__ __forceinline__ uint4 load_gu(const void *h, const float *h_scales, long long ld, int ffn,
                                                long long row, int col)
{
    if (!GU8) return *(const uint4 *)((const uint16_t *)h + row * 2 * ffn + col);
    const uint2 q = *(const uint2 *)((const uint8_t *)h + row * 2 * ffn + col);
    return make_uint4(q.x, q.y, __float_as_uint(h_scales[(long long)(col / COMETI_FP8_BLOCK) * ld + row]), 0u);
}

/* load_gu's eight values in bf16: E4M3 ones dequantized and each rounded to bf16, so that
 * the rest is the bf16 backward on those values, bit for bit. */
template <bool GU8>
static __device__ __forceinline__ uint4 gu_bf16(uint4 v)
{
    if (!GU8) return v;
    float f[8];
    dequantize8(make_uint2(v.x, v.y), __uint_as_float(v.z), f);
    uint4 r;
    __nv_bfloat162 *b = (__nv_bfloat162 *)&r;
#pragma unroll
    for (int k = 0; k < 4; k++) b[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
    return r;
}

/* The weight gradients' operands: a block takes 128 rows of a segment (a 128-row block) x
 * 128 columns f of [g u] and s, laid out among its threads as quantize.cu's tiles are (8
 * passes of 16 rows), computes dg, du and w a for all of them in registers, then for each
 * of the three in turn each column's amax over the 128 rows, its scale, and its bytes
 * through the swizzled staging to the transposed rows: (w a)^T row f, dh^T rows f (gate)
 * and ffn + f (up). Rows of the block past its segment's end (or past `rows`) are zeros;
 * a block in no segment is not written (quantize_segments_t_kernel's contract). ROWS: each
 * pass's row also leaves its dh blocks and its part of <s, a> (dh_row_blocks, rows_out),
 * so h is not __restrict__: those bytes are written over. */
template <bool GU8, bool ROWS>
static __global__ void __launch_bounds__(QUANTIZE_THREADS, DSWIGLU_T_BLOCKS)
swiglu_backward_t_kernel(const void *h, const float *__restrict__ h_scales, long long h_ld,
                         const uint16_t *__restrict__ s,
                         const float *__restrict__ w_rows, int ffn, const cometi_segment_t *segs, int groups,
                         long long rows, uint8_t *__restrict__ wa_t, float *__restrict__ wa_scales,
                         uint8_t *__restrict__ dh_t, float *__restrict__ dh_scales, long long ldq, int pow2,
                         int row_blocks, int col_tiles, dh_rows_out_t rows_out)
{
    __shared__ __align__(16) float warp_amax[QUANTIZE_WARPS][COMETI_FP8_BLOCK]; /* read as float4s */
    __shared__ __align__(16) uint8_t staged[COMETI_FP8_BLOCK * COMETI_FP8_BLOCK];
    const int tile_row = threadIdx.x / 16, col_in = (threadIdx.x % 16) * 8;
    const long long tiles = (long long)row_blocks * col_tiles;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int rb = (int)(t / col_tiles), ct = (int)(t % col_tiles);
        const long long r0 = (long long)rb * COMETI_FP8_BLOCK;
        const int valid = block_rows_in_segment(segs, groups, r0, rows);
        if (valid < 0) continue; /* the whole block alike */
        const int c = ct * COMETI_FP8_BLOCK + col_in;
        /* out[0]: w a, out[1]: dg, out[2]: du; 8 bf16 a pass. The next pass's loads are issued
         * before this one's math (two passes in flight, beside the 96 registers of out). */
        uint4 out[3][TILE_PASSES], in[2][3];
        float w[2];
#pragma unroll
        for (int p = -1; p < TILE_PASSES; p++) {
            const int tr = (p + 1) * TILE_ROWS_PER_PASS + tile_row;
            if (p + 1 < TILE_PASSES) {
                uint4 *x = in[(p + 1) % 2];
                x[0] = x[1] = x[2] = make_uint4(0, 0, 0, 0);
                w[(p + 1) % 2] = 0.0f;
                if (tr < valid) {
                    const long long row = r0 + tr;
                    x[0] = load_gu<GU8>(h, h_scales, h_ld, ffn, row, c);
                    x[1] = load_gu<GU8>(h, h_scales, h_ld, ffn, row, ffn + c);
                    x[2] = *(const uint4 *)(s + row * ffn + c);
                    w[(p + 1) % 2] = w_rows[row];
                }
            }
            if (p >= 0) { /* rows past the segment: zeros in, zeros out */
                const uint4 *x = in[p % 2];
                float part;
                dswiglu8(gu_bf16<GU8>(x[0]), gu_bf16<GU8>(x[1]), x[2], w[p % 2], &out[1][p], &out[2][p], &out[0][p],
                         &part);
                /* The row's dh blocks over the bytes of [g u] this half-warp has just read
                 * (its stores wait on every lane's values, through the shuffles). */
                const int tr_p = p * TILE_ROWS_PER_PASS + tile_row;
                if (ROWS)
                    dh_row_blocks(rows_out, out[1][p], out[2][p], part, r0 + tr_p, tr_p < valid, ct, col_tiles,
                                  col_in, pow2);
            }
        }
#pragma unroll
        for (int o = 0; o < 3; o++) { /* (w a)^T's rows f; dh^T's f (gate), then ffn + f (up) */
            const int first = o == 2 ? ffn : 0, out_rows = o == 0 ? ffn : 2 * ffn;
            float amax[8], inv[8];
            tile_amax_bf16(out[o], amax);
            tile_column_scales(amax, warp_amax, first + c, out_rows,
                               (o == 0 ? wa_scales : dh_scales) + (long long)rb * out_rows, 1, pow2, inv);
#pragma unroll
            for (int p = 0; p < TILE_PASSES; p++)
                *(uint2 *)(staged + staged_at(p * TILE_ROWS_PER_PASS + tile_row, col_in)) = quantize8_cols(out[o][p], inv);
            tile_store_t(staged, o == 0 ? wa_t : dh_t, ldq, first + ct * COMETI_FP8_BLOCK, out_rows, r0, 8);
        }
    }
}

/* dh's rows and <s, a>: a block takes a row at a time of each expert's segment (blockIdx.y
 * the expert), as swiglu_backward_kernel does. s's row is copied into shared memory first,
 * since dh's E4M3 bytes (2 ffn a row: gate, then up) overwrite s's bf16 ones. A thread
 * takes 8 columns a pass; the 16 threads of a half-warp hold one 128-column block of dg and
 * one of du, whose amax is a shuffle among them. <s, a> is summed as every SwiGLU backward
 * sums it (dswiglu.cuh's order: the same bits). */
#define DSWIGLU_THREADS 256
template <bool GU8>
static __global__ void __launch_bounds__(DSWIGLU_THREADS)
swiglu_backward_rows_kernel(const void *__restrict__ h, const float *__restrict__ h_scales, long long h_ld,
                            uint16_t *s_dh, int ffn, const cometi_segment_t *segs,
                            long long row_limit, const float *__restrict__ w_rows, float *__restrict__ dw_rows,
                            float *__restrict__ dh_scales, long long scale_block_stride, int pow2)
{
    extern __shared__ uint4 s_row[]; /* ffn / 8, then block_sums: ffn / 128 floats */
    float *block_sums = (float *)(s_row + ffn / 8);
    const cometi_segment_t seg = segs[blockIdx.y];
    const int vecs = ffn / 8, blocks = ffn / COMETI_FP8_BLOCK;
    const long long rows = cometi_segment_rows_below(seg, row_limit);
    /* dh's rows over s's (2 ffn bytes a row), the blocks' parts of <s, a> in block_sums */
    const dh_rows_out_t out = {(uint8_t *)s_dh, 2LL * ffn, COMETI_FP8_BLOCK, dh_scales, scale_block_stride,
                               block_sums, 0, 1};
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long row = seg.start + r;
        const float w = w_rows[row];
        for (int v = threadIdx.x; v < vecs; v += blockDim.x) s_row[v] = *(const uint4 *)(s_dh + row * ffn + v * 8);
        __syncthreads(); /* s's row is read before any dh byte lands on it */
        /* Every lane through every pass (vecs is a multiple of 16): the shuffles need all. */
        for (int v0 = 0; v0 < vecs; v0 += blockDim.x) {
            const int v = v0 + (int)threadIdx.x, f = v * 8;
            const bool in = v < vecs;
            uint4 dg4 = make_uint4(0, 0, 0, 0), du4 = dg4;
            float part = 0.0f;
            if (in) {
                const uint4 g4 = gu_bf16<GU8>(load_gu<GU8>(h, h_scales, h_ld, ffn, row, f)),
                            u4 = gu_bf16<GU8>(load_gu<GU8>(h, h_scales, h_ld, ffn, row, ffn + f));
                uint4 wa4; /* not kept: the tile kernel writes (w a)^T */
                dswiglu8(g4, u4, s_row[v], w, &dg4, &du4, &wa4, &part);
            }
            dh_row_blocks(out, dg4, du4, part, row, in, v / 16, blocks, f % COMETI_FP8_BLOCK, pow2);
        }
        __syncthreads();
        if (threadIdx.x == 0) dw_rows[row] = dot_blocks_sum(block_sums, blocks, 1);
        __syncthreads(); /* block_sums and s_row free for the next row */
    }
}

/* Each row's <s, a> from its tiles' parts (the one-kernel backward's), the tiles in turn:
 * dswiglu.cuh's order. A thread a row of blockIdx.y's segment. */
static __global__ void swiglu_dot_sum_kernel(const float *__restrict__ parts, long long ld, int tiles,
                                             const cometi_segment_t *segs, long long row_limit, float *dw_rows)
{
    const cometi_segment_t seg = segs[blockIdx.y];
    const long long rows = cometi_segment_rows_below(seg, row_limit);
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (long long)gridDim.x * blockDim.x) {
        const long long row = seg.start + r;
        dw_rows[row] = dot_blocks_sum(parts + row, tiles, ld);
    }
}

/* What both launchers take alike, checked before either launches anything. */
static bool swiglu_e4m3_args_ok(const void *h, const float *h_scales, int64_t h_ld, const void *s, int ffn,
                                const cometi_segment_t *segs, int64_t rows, const float *w_rows,
                                const float *dw_rows, const float *dh_scales, int64_t dh_scale_block,
                                const void *wa_t, const float *wa_t_scales, const void *dh_t,
                                const float *dh_t_scales, int64_t ldq)
{
    const int64_t row_blocks = (rows + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK;
    return ffn > 0 && ffn % COMETI_FP8_BLOCK == 0 && (uintptr_t)h % 16 == 0 && (uintptr_t)s % 16 == 0 &&
           (uintptr_t)wa_t % 16 == 0 && (uintptr_t)dh_t % 16 == 0 && ldq % 16 == 0 &&
           ldq >= row_blocks * COMETI_FP8_BLOCK && dh_scale_block >= rows && segs && w_rows && dw_rows && dh_scales &&
           wa_t_scales && dh_t_scales && (!h_scales || h_ld >= rows);
}

static void launch_t_kernel(bool gu8, bool in_place, const void *h, const float *h_scales, int64_t h_ld,
                            const void *s, int ffn, const cometi_segment_t *segs, int groups, int64_t rows,
                            const float *w_rows, void *wa_t, float *wa_t_scales, void *dh_t, float *dh_t_scales,
                            int64_t ldq, int pow2, dh_rows_out_t rows_out, cudaStream_t stream)
{
    const int row_blocks = (int)((rows + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK), col_tiles = ffn / COMETI_FP8_BLOCK;
    const long long tiles = (long long)row_blocks * col_tiles;
    const unsigned int grid = (unsigned int)(tiles < (1 << 20) ? tiles : (1 << 20));
    void (*kernel)(const void *, const float *, long long, const uint16_t *, const float *, int,
                   const cometi_segment_t *, int, long long, uint8_t *, float *, uint8_t *, float *, long long, int,
                   int, int, dh_rows_out_t) =
        gu8 ? (in_place ? swiglu_backward_t_kernel<true, true> : swiglu_backward_t_kernel<true, false>)
            : (in_place ? swiglu_backward_t_kernel<false, true> : swiglu_backward_t_kernel<false, false>);
    kernel<<<grid, QUANTIZE_THREADS, 0, stream>>>(h, h_scales, (long long)h_ld, (const uint16_t *)s, w_rows, ffn, segs,
                                                  groups, (long long)rows, (uint8_t *)wa_t, wa_t_scales,
                                                  (uint8_t *)dh_t, dh_t_scales, (long long)ldq, pow2, row_blocks,
                                                  col_tiles, rows_out);
}

extern "C" cudaError_t cometi_launch_swiglu_backward_e4m3(const void *h, const float *h_scales, int64_t h_ld,
                                                          void *s_dh, int ffn,
                                                          const cometi_segment_t *segs, int groups, int max_rows,
                                                          int64_t rows, const float *w_rows, float *dw_rows,
                                                          float *dh_scales, int64_t dh_scale_block, void *wa_t,
                                                          float *wa_t_scales, void *dh_t, float *dh_t_scales,
                                                          int64_t ldq, int pow2, cudaStream_t stream)
{
    if (rows <= 0 || groups <= 0 || max_rows <= 0) return cudaSuccess;
    if (!swiglu_e4m3_args_ok(h, h_scales, h_ld, s_dh, ffn, segs, rows, w_rows, dw_rows, dh_scales, dh_scale_block,
                             wa_t, wa_t_scales, dh_t, dh_t_scales, ldq))
        return cudaErrorInvalidValue;
    const bool gu8 = h_scales != NULL;
    /* The row kernel keeps s's row and a float per 128 columns (block_sums) in shared
     * memory: past the default 48 KB it must ask for more, and past the device's most it
     * cannot run. Both checked before either kernel is launched. */
    const int vecs = ffn / 8, threads = vecs >= DSWIGLU_THREADS ? DSWIGLU_THREADS : (vecs + 31) / 32 * 32;
    const size_t smem = (size_t)ffn * 2 + sizeof(float) * (size_t)(ffn / COMETI_FP8_BLOCK);
    if (smem > 48 * 1024) {
        int dev = 0, most = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e != cudaSuccess) return e;
        if (smem > (size_t)most) return cudaErrorInvalidValue;
        e = cudaFuncSetAttribute(gu8 ? swiglu_backward_rows_kernel<true> : swiglu_backward_rows_kernel<false>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    const dh_rows_out_t none = {NULL, 0, 0, NULL, 0, NULL, 0, 0}; /* the row kernel writes them */
    launch_t_kernel(gu8, false, h, h_scales, h_ld, s_dh, ffn, segs, groups, rows, w_rows, wa_t, wa_t_scales, dh_t,
                    dh_t_scales, ldq, pow2, none, stream);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned int)(max_rows < 1024 ? max_rows : 1024), (unsigned int)groups);
    (gu8 ? swiglu_backward_rows_kernel<true> : swiglu_backward_rows_kernel<false>)<<<grid, threads, smem, stream>>>(
        h, h_scales, (long long)h_ld, (uint16_t *)s_dh, ffn, segs, (long long)rows, w_rows, dw_rows, dh_scales,
        (long long)dh_scale_block, pow2);
    return cudaGetLastError();
}

extern "C" cudaError_t cometi_launch_swiglu_backward_e4m3_in_place(void *h, const float *h_scales, int64_t h_ld,
                                                                   const void *s, int ffn,
                                                                   const cometi_segment_t *segs, int groups,
                                                                   int max_rows, int64_t rows, const float *w_rows,
                                                                   float *dw_rows, float *dot_parts, float *dh_scales,
                                                                   int64_t dh_scale_block, void *wa_t,
                                                                   float *wa_t_scales, void *dh_t, float *dh_t_scales,
                                                                   int64_t ldq, int pow2, cudaStream_t stream)
{
    if (rows <= 0 || groups <= 0 || max_rows <= 0) return cudaSuccess;
    if (!dot_parts || !swiglu_e4m3_args_ok(h, h_scales, h_ld, s, ffn, segs, rows, w_rows, dw_rows, dh_scales,
                                           dh_scale_block, wa_t, wa_t_scales, dh_t, dh_t_scales, ldq))
        return cudaErrorInvalidValue;
    const bool gu8 = h_scales != NULL;
    dh_rows_out_t out;
    out.rows = (uint8_t *)h;
    out.row_bytes = (long long)ffn * (gu8 ? 2 : 4);     /* a row of [g u] */
    out.block_bytes = gu8 ? COMETI_FP8_BLOCK : 2 * COMETI_FP8_BLOCK; /* the bytes of 128 of its values */
    out.scales = dh_scales;
    out.scale_block = (long long)dh_scale_block;
    out.dot_parts = dot_parts;
    out.dot_row = 1, out.dot_tile = (long long)dh_scale_block;
    launch_t_kernel(gu8, true, h, h_scales, h_ld, s, ffn, segs, groups, rows, w_rows, wa_t, wa_t_scales, dh_t,
                    dh_t_scales, ldq, pow2, out, stream);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    const int per_block = 256, blocks = (max_rows + per_block - 1) / per_block;
    const dim3 grid((unsigned int)(blocks < 1024 ? blocks : 1024), (unsigned int)groups);
    swiglu_dot_sum_kernel<<<grid, per_block, 0, stream>>>(dot_parts, (long long)dh_scale_block, ffn / COMETI_FP8_BLOCK,
                                                          segs, (long long)rows, dw_rows);
    return cudaGetLastError();
}
