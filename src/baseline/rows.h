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
/* y[t] = sum_j w[t][j] * sum_c back[c][send_pos[t][j]] over the tp copies c (each TP rank's
 * partial rows, copy_stride elements apart), fp32, in order; w NULL weighs each choice 1. */
cudaError_t cometi_launch_combine(const void *back, int tp, size_t copy_stride, const int32_t *send_pos,
                                  const float *w, int m, int k, int hidden, void *y, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASELINE_ROWS_H */
