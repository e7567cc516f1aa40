/*
 * e4m3_tile.cuh - what the FP8 pointwise kernels share (quantize.cu, swiglu_fp8.cu): the
 * NaN-propagating amax of bf16 pairs, eight values to E4M3 with their scales' inverses,
 * E4M3 back to fp32, and the 128 x 128 tile a block of 256 threads quantizes along its
 * columns and writes transposed through a swizzled staging.
 */
#ifndef COMET_POINTWISE_E4M3_TILE_CUH
#define COMET_POINTWISE_E4M3_TILE_CUH

#include <stdint.h>

#include "base/fp8.h"
#include "base/types.h"

#define QUANTIZE_THREADS 256
/* Blocks an SM the transposing kernels keep (their __launch_bounds__): left to itself,
 * ptxas holds staged_pieces4's 16 words beside the tile's values and goes past the
 * registers of 3 blocks (quantize.cu's, 72-80 registers) or 2 (SwiGLU's FP8 tile kernel,
 * 128 and a 36-byte spill instead of 174). */
#define QUANTIZE_T_BLOCKS 3
#define DSWIGLU_T_BLOCKS 2
#define QUANTIZE_WARPS (QUANTIZE_THREADS / 32)

/* The NaN-propagating max of two pairs of bf16, half by half (bf16 max is exact: the
 * values are floats' top halves). A NaN gives bf16's canonical NaN, which the float max
 * after it turns into fp32's (base/fp8.h's cometi_fp8_max). */
static __device__ __forceinline__ uint32_t max_nan_bf16x2(uint32_t a, uint32_t b)
{
    uint32_t d;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/* m (two running maxima, bf16x2) folded with the |x| of eight bf16 (one 16-byte load). */
static __device__ __forceinline__ uint32_t amax8(uint4 v, uint32_t m)
{
    m = max_nan_bf16x2(m, v.x & 0x7fff7fffu);
    m = max_nan_bf16x2(m, v.y & 0x7fff7fffu);
    m = max_nan_bf16x2(m, v.z & 0x7fff7fffu);
    return max_nan_bf16x2(m, v.w & 0x7fff7fffu);
}

/* The larger of the two running maxima, as a float. */
static __device__ __forceinline__ float amax_float(uint32_t m)
{
    return cometi_fp8_max(cometi_f32_from_bits(m << 16), cometi_f32_from_bits(m & 0xffff0000u));
}

/* Eight values to E4M3, e4m3(x[c] x inv[c]) for column c: 8 bytes, the first column's
 * lowest. */
static __device__ __forceinline__ uint2 quantize8_floats(const float *x, const float *inv)
{
    uint32_t pair[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
        pair[k] = cometi_e4m3x2_cvt(cometi_fp8_mul(x[2 * k], inv[2 * k]), cometi_fp8_mul(x[2 * k + 1], inv[2 * k + 1]));
    return make_uint2(pair[0] | pair[1] << 16, pair[2] | pair[3] << 16);
}

/* Eight bf16 (the first column in the low half of .x) to E4M3 with a scale each (column c's
 * inverse inv[c]). */
static __device__ __forceinline__ uint2 quantize8_cols(uint4 v, const float *inv)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    float x[8];
#pragma unroll
    for (int k = 0; k < 4; k++)
        x[2 * k] = cometi_f32_from_bits(w[k] << 16), x[2 * k + 1] = cometi_f32_from_bits(w[k] & 0xffff0000u);
    return quantize8_floats(x, inv);
}

/* The same with one scale for the eight (a row's or a weight tile's block). */
static __device__ __forceinline__ uint2 quantize8(uint4 v, float inv)
{
    const float invs[8] = {inv, inv, inv, inv, inv, inv, inv, inv};
    return quantize8_cols(v, invs);
}

/* A tile of 128 rows x 128 columns among 256 threads: thread t takes columns 8 (t % 16) ..
 * 8 (t % 16) + 7 of rows t / 16, t / 16 + 16, ..., t / 16 + 112 (a pass each). */
#define TILE_ROWS_PER_PASS (QUANTIZE_THREADS / 16)
#define TILE_PASSES (COMETI_FP8_BLOCK / TILE_ROWS_PER_PASS)
#define TILE_PIECES (COMETI_FP8_BLOCK * COMETI_FP8_BLOCK / 16) /* 16-byte pieces of qt a tile */
static __device__ __forceinline__ int staged_at(int row, int col)
{
    return row * COMETI_FP8_BLOCK + (((col / 4) ^ (row / 16 * 4)) * 4 | (col % 4));
}

/* Rows 16 piece .. 16 piece + 15 of the staged tile's columns 4 w .. 4 w + 3: a 16-byte
 * piece of each of four qt rows. Each row's word of those four columns is read once (16
 * loads), and each 4 x 4 block of bytes transposed with byte permutes (8 a block), where
 * gathering a byte at a time took 64 loads and as many shifts. Across a warp (w: 4 values,
 * piece: 8) the words fall in 32 different banks. */
static __device__ __forceinline__ void staged_pieces4(const uint8_t *staged, int piece, int w, uint4 *out)
{
    uint32_t col[4][4]; /* [column][4-row group]: rows 4 g .. 4 g + 3 of the piece, first lowest */
#pragma unroll
    for (int g = 0; g < 4; g++) {
        uint32_t r[4];
#pragma unroll
        for (int k = 0; k < 4; k++) r[k] = *(const uint32_t *)(staged + staged_at(piece * 16 + g * 4 + k, w * 4));
        const uint32_t lo01 = __byte_perm(r[0], r[1], 0x5140), lo23 = __byte_perm(r[2], r[3], 0x5140);
        const uint32_t hi01 = __byte_perm(r[0], r[1], 0x7362), hi23 = __byte_perm(r[2], r[3], 0x7362);
        col[0][g] = __byte_perm(lo01, lo23, 0x5410), col[1][g] = __byte_perm(lo01, lo23, 0x7632);
        col[2][g] = __byte_perm(hi01, hi23, 0x5410), col[3][g] = __byte_perm(hi01, hi23, 0x7632);
    }
#pragma unroll
    for (int c = 0; c < 4; c++) out[c] = make_uint4(col[c][0], col[c][1], col[c][2], col[c][3]);
}

/* Eight E4M3 values (8 bytes, the first column lowest) times their row's scale: exact
 * decoding (E4M3 is a subset of f16), then one rounded fp32 product each, as the host's
 * cometi_fp8_mul(cometi_e4m3_decode(q), s). */
static __device__ __forceinline__ void dequantize8(uint2 b, float s, float *out)
{
    const uint32_t w[2] = {b.x, b.y};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint16_t pair = (uint16_t)(w[k / 2] >> (16 * (k % 2)));
        uint32_t h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
        float lo, hi;
        asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((uint16_t)(h2 & 0xffffu)));
        asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((uint16_t)(h2 >> 16)));
        out[2 * k] = cometi_fp8_mul(lo, s), out[2 * k + 1] = cometi_fp8_mul(hi, s);
    }
}

/* The rows of the 128-row block at r0 in its segment (a segment starts at a multiple of
 * 128; rows at or past `rows` count as none of it; the first segment holding r0 where
 * several would), or -1 where the block is in no segment. Called by whole warps: each lane
 * looks at every 32nd segment and a ballot picks the first hit, so 64 experts cost two
 * loads a lane, not 64 in a row. */
static __device__ __forceinline__ int block_rows_in_segment(const cometi_segment_t *segs, int groups, long long r0,
                                                            long long rows)
{
    const int lane = threadIdx.x % 32;
    for (int g0 = 0; g0 < groups; g0 += 32) {
        cometi_segment_t sg = {0, 0};
        if (g0 + lane < groups) sg = segs[g0 + lane];
        const unsigned int hits = __ballot_sync(0xffffffffu, r0 >= sg.start && r0 < sg.start + sg.rows);
        if (!hits) continue;
        const int first = __ffs((int)hits) - 1;
        const long long start = __shfl_sync(0xffffffffu, sg.start, first),
                        end_seg = start + __shfl_sync(0xffffffffu, sg.rows, first);
        const long long end = end_seg < rows ? end_seg : rows;
        return end <= r0 ? 0 : (int)(end - r0 < COMETI_FP8_BLOCK ? end - r0 : COMETI_FP8_BLOCK);
    }
    return -1;
}

/* Each column's max over this thread's 8 passes of bf16 pairs (v[p]: 8 columns), as floats. */
static __device__ __forceinline__ void tile_amax_bf16(const uint4 *v, float *amax)
{
    uint32_t m[4] = {0, 0, 0, 0};
#pragma unroll
    for (int p = 0; p < TILE_PASSES; p++) {
        m[0] = max_nan_bf16x2(m[0], v[p].x & 0x7fff7fffu), m[1] = max_nan_bf16x2(m[1], v[p].y & 0x7fff7fffu);
        m[2] = max_nan_bf16x2(m[2], v[p].z & 0x7fff7fffu), m[3] = max_nan_bf16x2(m[3], v[p].w & 0x7fff7fffu);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        amax[2 * k] = cometi_f32_from_bits(m[k] << 16);
        amax[2 * k + 1] = cometi_f32_from_bits(m[k] & 0xffff0000u);
    }
}

/* The tile's columns along the tokens, from each thread's amax of its 8 columns over its
 * rows: a shuffle across the warp's two row groups, the 8 warps' through shared memory;
 * then thread t < 128 folds column t's 8 warps in order, computes its scale (stored at
 * scales[col] where col < cols; c is this thread's first column, so the tile's is c minus
 * its offset) and the inverse, and leaves the inverse in warp_amax[0][t] (no other thread
 * reads that column), whence every thread takes its 8. Each column's two IEEE divisions
 * and 8 loads are made once, where the 16 threads sharing a column each made them (64
 * loads and 16 divisions a thread). Block barriers inside: every thread calls it. */
static __device__ __forceinline__ void tile_column_scales(float *amax, float (*warp_amax)[COMETI_FP8_BLOCK], int c,
                                                          int cols, float *scales, long long scale_row_stride,
                                                          int pow2, float *inv)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, col_in = (threadIdx.x % 16) * 8;
#pragma unroll
    for (int k = 0; k < 8; k++) amax[k] = cometi_fp8_max(amax[k], __shfl_xor_sync(0xffffffffu, amax[k], 16));
    if (lane < 16) {
#pragma unroll
        for (int k = 0; k < 8; k++) warp_amax[warp][col_in + k] = amax[k];
    }
    __syncthreads();
    if (threadIdx.x < COMETI_FP8_BLOCK) {
        const int t = threadIdx.x, col = c - col_in + t;
        float a = warp_amax[0][t];
#pragma unroll
        for (int w = 1; w < QUANTIZE_WARPS; w++) a = cometi_fp8_max(a, warp_amax[w][t]);
        const float scale = cometi_fp8_scale(a, pow2);
        if (col < cols) scales[(long long)col * scale_row_stride] = scale;
        warp_amax[0][t] = cometi_fp8_inverse(scale);
    }
    __syncthreads();
    const float4 lo = *(const float4 *)&warp_amax[0][col_in], hi = *(const float4 *)&warp_amax[0][col_in + 4];
    inv[0] = lo.x, inv[1] = lo.y, inv[2] = lo.z, inv[3] = lo.w, inv[4] = hi.x, inv[5] = hi.y, inv[6] = hi.z,
    inv[7] = hi.w;
}

/* The staged tile out, transposed: column tc's 128 rows to qt row first_col + tc, from
 * column r0 on (columns at or past cols: none), the first `pieces` 16-row pieces of them
 * (8 but in a weight's last row tile, whose rows are a multiple of 16). A thread takes
 * rows 16 (t % 8) .. + 15 of columns 4 (t / 8) .. + 3, so 8 lanes side by side write 128
 * bytes of a qt row. Barriers on both sides: the staging is whole before it is read, and
 * read before the next tile writes it (and warp_amax too). */
static_assert(TILE_PIECES == 4 * QUANTIZE_THREADS, "a thread stores four pieces of the tile");
static __device__ __forceinline__ void tile_store_t(const uint8_t *staged, uint8_t *qt, long long ldq, int first_col,
                                                    int cols, long long r0, int pieces)
{
    __syncthreads();
    const int piece = threadIdx.x % 8, w = threadIdx.x / 8;
    uint4 out[4];
    staged_pieces4(staged, piece, w, out);
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const int row = first_col + 4 * w + c; /* qt's */
        if (row < cols && piece < pieces) *(uint4 *)(qt + (long long)row * ldq + r0 + piece * 16) = out[c];
    }
    __syncthreads();
}

#endif /* COMET_POINTWISE_E4M3_TILE_CUH */
