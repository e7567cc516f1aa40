/*
 * quantize.cu - block-scaled FP8 (E4M3): bf16 token rows in 1 x 128 blocks, weights in
 * 128 x 128 blocks, and the weight gradients' operands in 128 x 1 blocks along the tokens
 * (transposed), each block's amax, scale and bytes by base/fp8.h's arithmetic, the
 * conversion itself by the hardware's cvt (the bits of cometi_e4m3_encode, which the GPU
 * test holds it to). Both kernels are memory-bound: every element is read once in 16-byte
 * loads, and its byte written once.
 */
#include <stdint.h>

#include "base/fp8.h"
#include "base/types.h"
#include "pointwise/pointwise.h"
#include "pointwise/e4m3_tile.cuh"

#define QUANTIZE_MAX_GRID (1 << 20) /* blocks; past this each loops over more work */

/* Rows: a warp takes an item, four neighbouring 128-column blocks of one row, 8 lanes
 * each: lane l of the 8 takes columns 16l .. 16l + 15 of its block (two 16-byte loads, one
 * 16-byte store), and the block's amax is a shuffle reduction among its 8 lanes. cols is
 * a multiple of 16, so a lane's columns are all in the row or all past it; lanes past the
 * row (its last item's) join the shuffles with zeros and store nothing. Items go row by
 * row (a row's blocks side by side in memory), each warp two items an iteration with both
 * items' loads issued first; (row, item in the row) advance by additions, no division. */
#define ROWS_LANES_PER_BLOCK 8
#define ROWS_BLOCKS_PER_ITEM (32 / ROWS_LANES_PER_BLOCK)
#define ROWS_ITEMS_IN_FLIGHT 2
static __global__ void __launch_bounds__(QUANTIZE_THREADS)
quantize_rows_kernel(const uint16_t *__restrict__ x, long long rows, int cols, long long ldx, uint8_t *__restrict__ q,
                     long long ldq, float *__restrict__ scales, long long scale_row_stride,
                     long long scale_block_stride, int pow2, int nblocks)
{
    const int lane = threadIdx.x % 32, sub = lane % ROWS_LANES_PER_BLOCK, group = lane / ROWS_LANES_PER_BLOCK;
    const int per_row = (nblocks + ROWS_BLOCKS_PER_ITEM - 1) / ROWS_BLOCKS_PER_ITEM; /* items */
    /* Item i is (row i / per_row, i % per_row); this warp takes i = its index + j x warps. */
    const long long warps = (long long)gridDim.x * QUANTIZE_WARPS;
    const long long first = (long long)blockIdx.x * QUANTIZE_WARPS + threadIdx.x / 32;
    const long long step_rows = warps / per_row;
    const int step_items = (int)(warps % per_row);
    long long row = first / per_row;
    int item = (int)(first % per_row);
    while (row < rows) {
        long long r[ROWS_ITEMS_IN_FLIGHT];
        int blk[ROWS_ITEMS_IN_FLIGHT];
        uint4 v[ROWS_ITEMS_IN_FLIGHT][2];
#pragma unroll
        for (int k = 0; k < ROWS_ITEMS_IN_FLIGHT; k++) {
            r[k] = row;
            blk[k] = item * ROWS_BLOCKS_PER_ITEM + group;
            const int c = blk[k] * COMETI_FP8_BLOCK + sub * 16;
            v[k][0] = v[k][1] = make_uint4(0, 0, 0, 0);
            if (row < rows && c < cols) {
                const uint4 *p = (const uint4 *)(x + row * ldx + c);
                v[k][0] = p[0];
                v[k][1] = p[1];
            }
            row += step_rows, item += step_items;
            if (item >= per_row) item -= per_row, row++;
        }
#pragma unroll
        for (int k = 0; k < ROWS_ITEMS_IN_FLIGHT; k++) {
            if (r[k] >= rows) break; /* the whole warp alike: one row */
            float amax = amax_float(amax8(v[k][1], amax8(v[k][0], 0)));
#pragma unroll
            for (int off = ROWS_LANES_PER_BLOCK / 2; off > 0; off /= 2)
                amax = cometi_fp8_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
            const float scale = cometi_fp8_scale(amax, pow2), inv = cometi_fp8_inverse(scale);
            const int c = blk[k] * COMETI_FP8_BLOCK + sub * 16;
            if (c < cols) {
                const uint2 lo = quantize8(v[k][0], inv), hi = quantize8(v[k][1], inv);
                *(uint4 *)(q + r[k] * ldq + c) = make_uint4(lo.x, lo.y, hi.x, hi.y);
            }
            if (sub == 0 && blk[k] < nblocks) scales[r[k] * scale_row_stride + blk[k] * scale_block_stride] = scale;
        }
    }
}

extern "C" cudaError_t cometi_quantize_rows_e4m3(const void *x, int64_t rows, int cols, int64_t ldx, void *q,
                                                 int64_t ldq, float *scales, int64_t scale_row_stride,
                                                 int64_t scale_block_stride, int pow2, cudaStream_t stream)
{
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    const int nblocks = (cols + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK;
    const long long items = (long long)rows * ((nblocks + ROWS_BLOCKS_PER_ITEM - 1) / ROWS_BLOCKS_PER_ITEM);
    const long long per_block = (long long)QUANTIZE_WARPS * ROWS_ITEMS_IN_FLIGHT;
    const long long blocks = (items + per_block - 1) / per_block;
    quantize_rows_kernel<<<(unsigned int)(blocks < QUANTIZE_MAX_GRID ? blocks : QUANTIZE_MAX_GRID), QUANTIZE_THREADS,
                           0, stream>>>((const uint16_t *)x, rows, cols, ldx, (uint8_t *)q, ldq, scales,
                                        scale_row_stride, scale_block_stride, pow2, nblocks);
    return cudaGetLastError();
}

/* Weights: a thread block takes a 128 x 128 tile. Half-warp h of the 16 takes rows h,
 * h + 16, ..., h + 112 of the tile, lane l of it columns 8l .. 8l + 7 of each: 8 loads of
 * 16 bytes a thread, all issued before any is used and kept in registers (32 KB of bf16
 * a tile), so the tile is read once. The amax: each thread's 64 values, a shuffle
 * reduction in each warp, the 8 warps' through shared memory (each thread folds them in
 * the same order). Rows and columns past the matrix's (a partial tile) load nothing and
 * count as zeros.
 *
 * TRANSPOSED: the tile's bytes also go through shared memory to qt, W^T's rows (a column
 * of the tile is 128 bytes of a qt row). The staging is 128 rows of 128 bytes whose 4-byte
 * words are swizzled by row / 16 (word ^ 4 (row / 16)), so the transposing reads, 16 rows
 * apart, fall in different banks. A lane gathers 16 rows of four columns (staged_pieces4:
 * a 16-byte piece of four qt rows); 8 lanes side by side write a qt row's 128 bytes. */
template <bool TRANSPOSED>
static __global__ void __launch_bounds__(QUANTIZE_THREADS, QUANTIZE_T_BLOCKS)
quantize_blocks_kernel(const uint16_t *__restrict__ w, long long mats, int rows, int cols, uint8_t *__restrict__ q,
                       float *__restrict__ scales, uint8_t *__restrict__ qt, float *__restrict__ scales_t, int pow2,
                       int row_tiles, int col_tiles)
{
    __shared__ float warp_amax[QUANTIZE_WARPS];
    __shared__ __align__(16) uint8_t staged[TRANSPOSED ? COMETI_FP8_BLOCK * COMETI_FP8_BLOCK : 16];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int tile_row = threadIdx.x / 16, col_in = (threadIdx.x % 16) * 8;
    const long long per_mat = (long long)row_tiles * col_tiles, tiles = mats * per_mat;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        const long long m = t / per_mat;
        const int rt = (int)((t - m * per_mat) / col_tiles), ct = (int)((t - m * per_mat) % col_tiles);
        const int c = ct * COMETI_FP8_BLOCK + col_in;
        const long long base = m * rows * (long long)cols;
        uint4 v[TILE_PASSES];
#pragma unroll
        for (int p = 0; p < TILE_PASSES; p++) {
            const int r = rt * COMETI_FP8_BLOCK + p * TILE_ROWS_PER_PASS + tile_row;
            v[p] = make_uint4(0, 0, 0, 0);
            if (r < rows && c < cols) v[p] = *(const uint4 *)(w + base + (long long)r * cols + c);
        }
        uint32_t pairs = 0;
#pragma unroll
        for (int p = 0; p < TILE_PASSES; p++) pairs = amax8(v[p], pairs);
        float amax = amax_float(pairs);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) amax = cometi_fp8_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        if (lane == 0) warp_amax[warp] = amax;
        __syncthreads();
        amax = warp_amax[0];
#pragma unroll
        for (int i = 1; i < QUANTIZE_WARPS; i++) amax = cometi_fp8_max(amax, warp_amax[i]);
        __syncthreads(); /* every thread has read warp_amax before the next tile writes it */
        const float scale = cometi_fp8_scale(amax, pow2), inv = cometi_fp8_inverse(scale);
#pragma unroll
        for (int p = 0; p < TILE_PASSES; p++) {
            const int tr = p * TILE_ROWS_PER_PASS + tile_row, r = rt * COMETI_FP8_BLOCK + tr;
            const uint2 bytes = quantize8(v[p], inv);
            if (q && r < rows && c < cols) *(uint2 *)(q + base + (long long)r * cols + c) = bytes;
            if (TRANSPOSED) *(uint2 *)(staged + staged_at(tr, col_in)) = bytes; /* col_in % 8 == 0: 8 bytes in */
        }
        if (q && threadIdx.x == 0) scales[t] = scale; /* [mats][row_tiles][col_tiles]: tile t's */
        if (TRANSPOSED) { /* W^T's rows are w's columns, rows bytes long */
            const int r0 = rt * COMETI_FP8_BLOCK, pieces = rows - r0 < COMETI_FP8_BLOCK ? (rows - r0) / 16 : 8;
            tile_store_t(staged, qt + base, rows, ct * COMETI_FP8_BLOCK, cols, r0, pieces);
            if (threadIdx.x == 0) scales_t[(m * col_tiles + ct) * row_tiles + rt] = scale; /* [mats][col_tiles][row_tiles] */
        }
    }
}

extern "C" cudaError_t cometi_quantize_blocks_e4m3(const void *w, int64_t mats, int rows, int cols, void *q,
                                                   float *scales, void *qt, float *scales_t, int pow2,
                                                   cudaStream_t stream)
{
    if (mats <= 0 || rows <= 0 || cols <= 0) return cudaSuccess;
    const int row_tiles = (rows + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK;
    const int col_tiles = (cols + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK;
    const long long tiles = (long long)mats * row_tiles * col_tiles;
    const unsigned int grid = (unsigned int)(tiles < QUANTIZE_MAX_GRID ? tiles : QUANTIZE_MAX_GRID);
    if (qt)
        quantize_blocks_kernel<true><<<grid, QUANTIZE_THREADS, 0, stream>>>(
            (const uint16_t *)w, mats, rows, cols, (uint8_t *)q, scales, (uint8_t *)qt, scales_t, pow2, row_tiles,
            col_tiles);
    else
        quantize_blocks_kernel<false><<<grid, QUANTIZE_THREADS, 0, stream>>>(
            (const uint16_t *)w, mats, rows, cols, (uint8_t *)q, scales, NULL, NULL, pow2, row_tiles, col_tiles);
    return cudaGetLastError();
}

/* Token rows, transposed per 128-row block of a segment (the weight gradients' operands):
 * a thread block takes 128 rows x 128 columns, laid out among its threads as the weights'
 * tile is (8 loads a thread, kept in registers), but each column is a block of its own: its
 * amax is each thread's max over its 8 rows, a shuffle across the warp's two row groups,
 * and the 8 warps' through shared memory. Rows of the block past its segment's rows load
 * nothing and quantize to zeros (the GEMM sums up to the next 128 rows); a block in no
 * segment is left as it is. The bytes go to qt through the swizzled staging, as the
 * weights' transpose does. E4M3_IN: the rows are E4M3 with a scale per row per 128
 * columns (as the dispatch delivers them, or the forward keeps them), dequantized in fp32
 * first (DeepSeek-V3's 1 x 128 to 128 x 1 requantization); else bf16. */
template <bool E4M3_IN>
static __global__ void __launch_bounds__(QUANTIZE_THREADS, QUANTIZE_T_BLOCKS)
quantize_segments_t_kernel(const void *__restrict__ x, long long ldx, const float *__restrict__ x_scales,
                           long long xs_row, long long xs_block, int cols, const cometi_segment_t *segs, int groups,
                           uint8_t *__restrict__ qt, long long ldq, float *__restrict__ scales,
                           long long scale_row_stride, long long scale_block_stride, int pow2, long long rows,
                           int row_blocks, int col_tiles)
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
        /* The thread's 8 rows of 8 columns as loaded: bf16 pairs, or E4M3 bytes and their rows'
         * scales (dequantized twice, for the amax and for the bytes: the same bits, and a
         * third of the registers that 64 floats would hold, so more blocks keep loads in
         * flight). */
        uint4 v[E4M3_IN ? 1 : TILE_PASSES];
        uint2 v8[E4M3_IN ? TILE_PASSES : 1];
        float rs[E4M3_IN ? TILE_PASSES : 1];
        float amax[8];
#pragma unroll
        for (int p = 0; p < TILE_PASSES; p++) {
            const int tr = p * TILE_ROWS_PER_PASS + tile_row;
            const bool in = tr < valid && c < cols;
            if constexpr (E4M3_IN) {
                v8[p] = in ? *(const uint2 *)((const uint8_t *)x + (r0 + tr) * ldx + c) : make_uint2(0, 0);
                rs[p] = in ? x_scales[(r0 + tr) * xs_row + ct * xs_block] : 0.0f;
            } else {
                v[p] = in ? *(const uint4 *)((const uint16_t *)x + (r0 + tr) * ldx + c) : make_uint4(0, 0, 0, 0);
            }
        }
        if constexpr (E4M3_IN) {
#pragma unroll
            for (int k = 0; k < 8; k++) amax[k] = 0.0f;
#pragma unroll
            for (int p = 0; p < TILE_PASSES; p++) {
                float f[8];
                dequantize8(v8[p], rs[p], f);
#pragma unroll
                for (int k = 0; k < 8; k++) amax[k] = cometi_fp8_max(amax[k], cometi_fp8_abs(f[k]));
            }
        } else { /* each column's max over the thread's rows, bf16 pairs, then floats */
            tile_amax_bf16(v, amax);
        }
        float inv[8];
        tile_column_scales(amax, warp_amax, c, cols, scales + rb * scale_block_stride, scale_row_stride, pow2, inv);
#pragma unroll
        for (int p = 0; p < TILE_PASSES; p++) {
            const int tr = p * TILE_ROWS_PER_PASS + tile_row;
            uint2 bytes;
            if constexpr (E4M3_IN) {
                float f[8];
                dequantize8(v8[p], rs[p], f);
                bytes = quantize8_floats(f, inv);
            } else {
                bytes = quantize8_cols(v[p], inv);
            }
            *(uint2 *)(staged + staged_at(tr, col_in)) = bytes;
        }
        tile_store_t(staged, qt, ldq, ct * COMETI_FP8_BLOCK, cols, r0, 8);
    }
}

static cudaError_t launch_segments_t(bool e4m3_in, const void *x, int64_t ldx, const float *x_scales, int64_t xs_row,
                                     int64_t xs_block, int cols, int64_t rows, const cometi_segment_t *segs,
                                     int groups, void *qt, int64_t ldq, float *scales, int64_t scale_row_stride,
                                     int64_t scale_block_stride, int pow2, cudaStream_t stream)
{
    if (rows <= 0 || cols <= 0 || groups <= 0) return cudaSuccess;
    const int row_blocks = (int)((rows + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK);
    /* The layout the kernel's vector accesses assume (pointwise.h): refused, not corrupted. */
    const int64_t x_align = e4m3_in ? 8 : 16;
    if (cols % 16 || ldx < cols || (ldx * (e4m3_in ? 1 : 2)) % x_align || (uintptr_t)x % x_align || ldq % 16 ||
        ldq < (int64_t)row_blocks * COMETI_FP8_BLOCK || (uintptr_t)qt % 16 || !segs || !scales ||
        (e4m3_in && !x_scales))
        return cudaErrorInvalidValue;
    const int col_tiles = (cols + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK;
    const long long tiles = (long long)row_blocks * col_tiles;
    const unsigned int grid = (unsigned int)(tiles < QUANTIZE_MAX_GRID ? tiles : QUANTIZE_MAX_GRID);
    if (e4m3_in)
        quantize_segments_t_kernel<true><<<grid, QUANTIZE_THREADS, 0, stream>>>(
            x, ldx, x_scales, xs_row, xs_block, cols, segs, groups, (uint8_t *)qt, ldq, scales, scale_row_stride,
            scale_block_stride, pow2, (long long)rows, row_blocks, col_tiles);
    else
        quantize_segments_t_kernel<false><<<grid, QUANTIZE_THREADS, 0, stream>>>(
            x, ldx, NULL, 0, 0, cols, segs, groups, (uint8_t *)qt, ldq, scales, scale_row_stride, scale_block_stride,
            pow2, (long long)rows, row_blocks, col_tiles);
    return cudaGetLastError();
}

extern "C" cudaError_t cometi_quantize_segments_t_e4m3(const void *x, int64_t ldx, int cols, int64_t rows,
                                                       const cometi_segment_t *segs, int groups, void *qt,
                                                       int64_t ldq, float *scales, int64_t scale_row_stride,
                                                       int64_t scale_block_stride, int pow2, cudaStream_t stream)
{
    return launch_segments_t(false, x, ldx, NULL, 0, 0, cols, rows, segs, groups, qt, ldq, scales, scale_row_stride,
                             scale_block_stride, pow2, stream);
}

extern "C" cudaError_t cometi_requantize_segments_t_e4m3(const void *x, int64_t ldx, const float *x_scales,
                                                         int64_t x_scale_row, int64_t x_scale_block, int cols,
                                                         int64_t rows, const cometi_segment_t *segs, int groups,
                                                         void *qt, int64_t ldq, float *scales,
                                                         int64_t scale_row_stride, int64_t scale_block_stride,
                                                         int pow2, cudaStream_t stream)
{
    return launch_segments_t(true, x, ldx, x_scales, x_scale_row, x_scale_block, cols, rows, segs, groups, qt, ldq,
                             scales, scale_row_stride, scale_block_stride, pow2, stream);
}

static __global__ void scales_bf16_kernel(const uint32_t *__restrict__ s, uint16_t *__restrict__ out, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = (uint16_t)(s[i] >> 16);
}

extern "C" cudaError_t cometi_launch_scales_bf16(const float *s, uint16_t *out, int64_t n, cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    const int64_t blocks = (n + 255) / 256;
    scales_bf16_kernel<<<(unsigned int)(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>((const uint32_t *)s, out,
                                                                                          n);
    return cudaGetLastError();
}
