/*
 * pointwise.h - the kernels both paths run on rows between the expert GEMMs: SwiGLU and
 * its backward (swiglu.cu; in FP8 training swiglu_fp8.cu), the routing weights to and
 * from the send order (routing_weights.cu), and block-scaled FP8 quantization
 * (quantize.cu). Device types alone.
 */
#ifndef COMET_POINTWISE_H
#define COMET_POINTWISE_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* act = silu(g) u over each expert's segment of h [rows][2 ffn] = [g u] (padding rows
 * skipped); max_rows: the largest segment's rows. */
cudaError_t cometi_launch_swiglu(const void *h, void *act, int ffn, const cometi_segment_t *segs, int num_segs,
                                 int max_rows, cudaStream_t stream);
/* The backward's routing weights: out[send_pos[i]] = w[i] for each (token, choice) i of n
 * with a row (send_pos -1: none), the weights in the send order. */
cudaError_t cometi_launch_weights_to_send_order(const float *w, const int32_t *send_pos, int n, float *out,
                                                cudaStream_t stream);
/* d topk_weights: dw[i] = sum over c < tp of rows[c x c_stride + send_pos[i] x pos_stride]
 * (each TP rank's partial <s, a> of the choice's row), fp32, c in order; 0 where send_pos
 * is -1. */
cudaError_t cometi_launch_gather_weight_grads(const float *rows, int tp, size_t c_stride, int pos_stride,
                                              const int32_t *send_pos, int n, float *dw, cudaStream_t stream);
/* SwiGLU's backward over the segments, with d topk_weights' part: from h [rows][2 ffn] =
 * [g u], sa [rows][ffn] = s = dy W2 (dy unweighted) and w_rows [rows] (each row's routing
 * weight): dh [rows][2 ffn] = [dg du] of da = w s, dw_rows[row] = <s, silu(g) u> (fp32),
 * and sa overwritten with w silu(g) u (what dW2 = dy^T (w a) reads); rows at or past
 * row_limit (the buffers' rows) are left alone. max_rows: the largest segment's rows. */
cudaError_t cometi_launch_swiglu_backward(const void *h, void *sa, void *dh, int ffn, const cometi_segment_t *segs,
                                          int num_segs, int max_rows, int64_t row_limit, const float *w_rows,
                                          float *dw_rows, cudaStream_t stream);
/* The same in FP8 training, straight into the FP8 operands of the GEMMs after it (the
 * values cometi_launch_swiglu_backward computes, each rounded to bf16, then quantized as
 * the functions below quantize bf16: the same bytes and scales): (w a)^T into wa_t
 * [ffn][ldq] and dh^T into dh_t [2 ffn][ldq] along the tokens, as
 * cometi_quantize_segments_t_e4m3 writes them (scales [rows / 128][ffn] and [rows /
 * 128][2 ffn]; a segment's tokens past its end or at or past `rows` as zeros, blocks in no
 * segment not written); then, for each segment's rows below `rows`, dh's row 1 x 128 over
 * s's bytes (s_dh: s [rows][ffn] bf16 in, dh [rows][2 ffn] E4M3 out, row r's block b's
 * scale at dh_scales[r + b x dh_scale_block]) and dw_rows[r]. Rows in no segment keep s's
 * bytes and get no scale (the dgrad GEMM stores nothing for them). ffn a multiple of 128
 * (2 ffn bytes of shared memory within the device's most); h, s_dh, wa_t and dh_t 16-byte
 * aligned; ldq a multiple of 16 >= rows rounded up to 128; dh_scale_block >= rows: else
 * cudaErrorInvalidValue and nothing launched. h is [g u] in bf16 (h_scales NULL), or in
 * E4M3 [rows][2 ffn] with 1 x 128 block scales, row r's block b's at h_scales[b x h_ld +
 * r] (h_ld >= rows), each value dequantized and rounded to bf16 before the rest. */
cudaError_t cometi_launch_swiglu_backward_e4m3(const void *h, const float *h_scales, int64_t h_ld, void *s_dh,
                                               int ffn, const cometi_segment_t *segs,
                                               int groups, int max_rows, int64_t rows, const float *w_rows,
                                               float *dw_rows, float *dh_scales, int64_t dh_scale_block, void *wa_t,
                                               float *wa_t_scales, void *dh_t, float *dh_t_scales, int64_t ldq,
                                               int pow2, cudaStream_t stream);

/* The same in one kernel, with dh's rows left in [g u]'s own bytes instead (the fused
 * path's: [g u] is not read again, and s stays as it is): each tile of 128 rows x 128
 * columns writes the 1 x 128 blocks of dh made from it over the bytes it read them from.
 * E4M3 [g u] (h_scales given): dh [rows][2 ffn] E4M3 in its place. bf16: row r's block b
 * (b < ffn / 128 gate's, then up's; 128 bytes) at byte r x 4 ffn + 256 b of h, the first
 * half of its 128 values' bytes (a GEMM reads it with a.ld 4 ffn, a.kb_stride 256). Their
 * scales at dh_scales[r + b x dh_scale_block] as above, and dw_rows[r] summed in the same
 * order from each tile's part, dot_parts[t x dh_scale_block + r] (t < ffn / 128, a
 * workspace). Bytes of rows in no segment are left alone. Segments start at multiples of
 * 128 (as the transposed operands need; the route lays them out so): a block's rows and
 * parts are written by the tile that holds them. The same checks, dot_parts set. */
cudaError_t cometi_launch_swiglu_backward_e4m3_in_place(void *h, const float *h_scales, int64_t h_ld, const void *s,
                                                        int ffn, const cometi_segment_t *segs, int groups,
                                                        int max_rows, int64_t rows, const float *w_rows,
                                                        float *dw_rows, float *dot_parts, float *dh_scales,
                                                        int64_t dh_scale_block, void *wa_t, float *wa_t_scales,
                                                        void *dh_t, float *dh_t_scales, int64_t ldq, int pow2,
                                                        cudaStream_t stream);

/* Block-scaled FP8 (E4M3) with base/fp8.h's arithmetic: each block's amax, its scale
 * (`pow2`: cometi_fp8_scale's rule, amax / 448, a power of two, or exact in bf16), q =
 * e4m3(x x (1 / scale)); NaN and infinity as comet.h states.
 * Rows: x bf16 [rows][ldx] in 1 x 128 blocks along its cols -> q E4M3 [rows][ldq], the
 * scale of row r's block b at scales[r x scale_row_stride + b x scale_block_stride]:
 * K-major [rows][ceil(cols / 128)] (row stride ceil(cols / 128), block stride 1, DeepEP's)
 * or MN-major [ceil(cols / 128)][ld] (row stride 1, block stride ld: an FP8 GEMM's A
 * scales). cols a multiple of 16; ldx >= cols a multiple of 8, ldq >= cols a multiple of
 * 16; x and q 16-byte aligned. q's columns past cols are not written; rows 0 launches
 * nothing. */
cudaError_t cometi_quantize_rows_e4m3(const void *x, int64_t rows, int cols, int64_t ldx, void *q, int64_t ldq,
                                      float *scales, int64_t scale_row_stride, int64_t scale_block_stride, int pow2,
                                      cudaStream_t stream);
/* Weights: w bf16 [mats][rows][cols] (contiguous) in 128 x 128 blocks -> q E4M3
 * [mats][rows][cols], scales [mats][ceil(rows / 128)][ceil(cols / 128)] (HF FP8
 * checkpoints' weight_scale_inv), and where qt is not NULL the same bytes transposed, qt
 * [mats][cols][rows] with scales_t [mats][ceil(cols / 128)][ceil(rows / 128)] (then q and
 * scales may be NULL, and rows must be a multiple of 16, qt 16-byte aligned). cols a
 * multiple of 16, w 16-byte and q 8-byte aligned. */
cudaError_t cometi_quantize_blocks_e4m3(const void *w, int64_t mats, int rows, int cols, void *q, float *scales,
                                        void *qt, float *scales_t, int pow2, cudaStream_t stream);
/* The weight gradients' operands: x bf16 [rows][cols] (row pitch ldx) whose rows are the
 * groups' segments (each starting at a multiple of 128, segs in device memory) -> qt E4M3
 * [cols][ldq], column c's tokens in a row (x^T), quantized in 128 x 1 blocks: 128 rows of
 * one column share a scale, at scales[c * scale_row_stride + (row / 128) *
 * scale_block_stride]. A segment's rows past its end up to the next 128 become zeros (their
 * block's scale counts only its rows), and so do rows at or past `rows` (none is read);
 * blocks of rows in no segment are not written. cols a multiple of 16, x 16-byte aligned
 * with ldx >= cols a multiple of 8; qt 16-byte aligned with ldq a multiple of 16, >= rows
 * rounded up to 128: else cudaErrorInvalidValue and nothing launched. */
cudaError_t cometi_quantize_segments_t_e4m3(const void *x, int64_t ldx, int cols, int64_t rows,
                                            const cometi_segment_t *segs, int groups, void *qt, int64_t ldq,
                                            float *scales, int64_t scale_row_stride, int64_t scale_block_stride,
                                            int pow2, cudaStream_t stream);
/* The same from E4M3 rows with 1 x 128 scales (row r's block b at x_scales[r * x_scale_row
 * + b * x_scale_block]), as the dispatch delivers rows: each value dequantized in fp32, then
 * requantized along the tokens (DeepSeek-V3's 1 x 128 to 128 x 1). x 8-byte aligned, its
 * rows ldx bytes apart, ldx >= cols a multiple of 8. */
cudaError_t cometi_requantize_segments_t_e4m3(const void *x, int64_t ldx, const float *x_scales, int64_t x_scale_row,
                                              int64_t x_scale_block, int cols, int64_t rows,
                                              const cometi_segment_t *segs, int groups, void *qt, int64_t ldq,
                                              float *scales, int64_t scale_row_stride, int64_t scale_block_stride,
                                              int pow2, cudaStream_t stream);
/* out[i] = the high 16 bits of s[i] (i < n): scales exact in bf16 (COMETI_FP8_SCALE_BF16,
 * or powers of two) as bf16, for the weight gradients' GEMM. */
cudaError_t cometi_launch_scales_bf16(const float *s, uint16_t *out, int64_t n, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_POINTWISE_H */
