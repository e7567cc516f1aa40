/*
 * pointwise.h - the kernels both paths run on rows between the expert GEMMs: SwiGLU and
 * its backward (swiglu.cu), the routing weights to and from the send order
 * (routing_weights.cu). Device types alone.
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

#ifdef __cplusplus
}
#endif

#endif /* COMET_POINTWISE_H */
