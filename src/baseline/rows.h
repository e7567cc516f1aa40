/*
 * rows.h - the sequential path's row kernels (rows.cu): device types alone.
 */
#ifndef COMET_BASELINE_ROWS_H
#define COMET_BASELINE_ROWS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Each (token, choice) row of x to its send place, send_base[id] + pos (recorded in
 * send_pos); ids NULL: to the place send_pos holds. */
cudaError_t cometi_launch_permute(const void *x, const int32_t *ids, const int32_t *pos, const int32_t *send_base,
                                  int n, int k, int hidden, void *send, int32_t *send_pos, cudaStream_t stream);
/* Block-scaled FP8 rows (config.dtype COMET_DTYPE_FP8_BLOCK): each (token, choice)'s E4M3
 * row of xq [m][hidden] and its scales xs [m][blocks] (DeepEP's layout) to its send place
 * send_base[id] + pos, recorded in send_pos (ids NULL: to the place send_pos holds): the
 * values into send_q [..][hidden], the scales into send_s [..][blocks]. hidden a multiple
 * of 16, xq and send_q 16-byte aligned. */
cudaError_t cometi_launch_permute_fp8(const void *xq, const float *xs, const int32_t *ids, const int32_t *pos,
                                      const int32_t *send_base, int n, int k, int hidden, int blocks, void *send_q,
                                      float *send_s, int32_t *send_pos, cudaStream_t stream);
/* y[t] = sum_j w[t][j] * sum_c back[c][send_pos[t][j]] over the tp copies c (each TP rank's
 * partial rows, copy_stride elements apart), fp32, in order; w NULL weighs each choice 1. */
cudaError_t cometi_launch_combine(const void *back, int tp, size_t copy_stride, const int32_t *send_pos,
                                  const float *w, int m, int k, int hidden, void *y, cudaStream_t stream);

/* One local expert's rows as an FP8 GEMM of blaslt_fp8.h reads them: its first row in the
 * receive layout, its rows, the rows the GEMM computes (rows rounded up, blaslt_fp8.h's
 * R_g; 0 without rows) and the computed rows of the groups before it, so that its A scales
 * packed by group start at blocks x before. */
typedef struct cometi_fp8_group {
    int32_t start, rows, padded, unused;
    int64_t before;
} cometi_fp8_group_t;

/* For each group with rows: its A scales packed by group ([blocks][padded] from
 * scales + blocks x before), each of its rows' taken from src_scales (row r's block b at
 * src_scales[r x src_row + b x src_block], r in the receive layout's rows: K-major
 * [row][blocks] is (blocks, 1), MN-major [blocks][ld] is (1, ld)) or, src_scales NULL,
 * left as the quantizer wrote them;
 * its padding rows' (rows .. padded - 1) scales set to 0 and their values, cols bytes each
 * of q [..][cols], zeroed, so the GEMM reads no stale bytes there (an E4M3 NaN would make
 * its padding rows NaN). cols a multiple of 16, q 16-byte aligned; max_padded: the
 * largest group's padded rows. */
cudaError_t cometi_launch_fp8_pack_groups(const cometi_fp8_group_t *groups, int num_groups, int max_padded,
                                          const float *src_scales, int64_t src_row, int64_t src_block, int blocks,
                                          void *q, int cols, float *scales, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASELINE_ROWS_H */
