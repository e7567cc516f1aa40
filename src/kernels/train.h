/*
 * train.h - the fused training path's row kernels (train.cu): the rows a training
 * forward keeps, and the padding the backward's weight gradients need zeroed.
 */
#ifndef COMET_TRAIN_KERNELS_H
#define COMET_TRAIN_KERNELS_H

#include <stdint.h>
#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of each segment (in the receive layout: segments start at multiples of 128) copied
 * from src to dst at the same row, [.][hidden] bf16, the padding after each segment up to
 * the next 128 rows zeroed, rows at or past cap_rows left alone; and when any EP group's
 * rows (the sum of seg_rows [num_groups x groups], device: the route's unpadded rows per
 * expert, the same on every rank) pass `bound` (the saved state's max_recv_rows; its
 * cap_rows adds the padding), COMET_INVALID_ARGUMENT is recorded in err
 * (COMETI_SITE_SAVED_BOUND, sticky) on every rank alike, as the sequential path refuses
 * the same call. dst NULL: the check alone (a layer that resends x keeps no rows). */
cudaError_t cometi_launch_keep_rows(const void *src, void *dst, int hidden, const cometi_segment_t *segs, int groups,
                                    int64_t cap_rows, int64_t bound, const int32_t *seg_rows, int num_groups,
                                    cometi_async_error_t *err, int sm_count, cudaStream_t stream);

/* The rows the push brought home, in choice order: back[c][i] (copy_stride elements between
 * TP ranks c) = slots[(send_offset[e] + pos[i]) x tp + c] for choice i = t x top_k + j of
 * expert e = ids[i]; zeros for an id out of range. send_offset: this rank's row of the
 * route's table. */
cudaError_t cometi_launch_keep_choices(const void *slots, void *back, const int32_t *ids, const int32_t *pos,
                                       const int32_t *send_offset, int n, int num_experts, int tp, int hidden,
                                       size_t copy_stride, int sm_count, cudaStream_t stream);

/* Buffers in the receive layout whose padding rows (after each segment, up to the next 128,
 * below cap_rows) are zeroed: the weight gradients sum whole 64-row blocks. */
#define COMETI_PADDED_BUFFERS 4
typedef struct cometi_padded_rows {
    void *rows[COMETI_PADDED_BUFFERS]; /* NULL: none */
    int row_bytes[COMETI_PADDED_BUFFERS]; /* multiples of 16 */
} cometi_padded_rows_t;
cudaError_t cometi_launch_zero_padding(const cometi_padded_rows_t *bufs, const cometi_segment_t *segs, int groups,
                                       int64_t cap_rows, int sm_count, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_TRAIN_KERNELS_H */
