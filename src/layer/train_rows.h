/*
 * train_rows.h - the fused training path's row kernels (train_rows.cu): the rows and send places a
 * training forward keeps, the routing weights and their gradients between each row's
 * source and its expert's rank (the weight windows), and the padding the backward's weight
 * gradients need zeroed.
 */
#ifndef COMET_TRAIN_KERNELS_H
#define COMET_TRAIN_KERNELS_H

#include <stdint.h>
#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of each segment (in the receive layout: segments start at multiples of 128) copied
 * from src to dst at the same row, row_bytes each (a multiple of 16: bf16 x's, or an FP8
 * row with its scales), the padding after each segment up to
 * the next 128 rows zeroed, rows at or past cap_rows left alone; and when any EP group's
 * rows (the sum of seg_rows [num_groups x groups], device: the route's unpadded rows per
 * expert, the same on every rank) pass `bound` (the saved state's max_recv_rows; its
 * cap_rows adds the padding), COMET_INVALID_ARGUMENT is recorded in err
 * (COMETI_SITE_SAVED_BOUND, sticky) on every rank alike, as the sequential path refuses
 * the same call. dst NULL: the check alone (a layer that resends x keeps no rows). */
cudaError_t cometi_launch_keep_rows(const void *src, void *dst, int row_bytes, const cometi_segment_t *segs, int groups,
                                    int64_t cap_rows, int64_t bound, const int32_t *seg_rows, int num_groups,
                                    cometi_async_error_t *err, int sm_count, cudaStream_t stream);

/* Each choice's place in this rank's send order, kept for the backward: send_pos[i] =
 * send_offset[e] + pos[i] for choice i of expert e = ids[i], -1 for an id out of range.
 * send_offset: this rank's row of the route's table. */
cudaError_t cometi_launch_keep_send_pos(const int32_t *ids, const int32_t *pos, const int32_t *send_offset, int n,
                                        int num_experts, int32_t *send_pos, cudaStream_t stream);

/* Every rank's window of the backward's routing weights and their gradients
 * (cometi_fused.weights): [max_tokens x top_k] weights in the send order, then
 * [max_tokens x top_k x tp] gradients, at send place x tp + the sender's TP rank. */
typedef struct cometi_weight_windows {
    float *peer[COMETI_MAX_RANKS]; /* rank r's window as mapped here */
    int64_t grads_at;              /* floats from a window's start to its gradients */
} cometi_weight_windows_t;

/* For each row received (the rows of the `groups` segments below cap_rows), from `dest`
 * (cometi_launch_push_dest's: its source rank and slot = send place x tp + this rank's
 * TP rank; -1 for padding): w_rows[row] = the source's weight of that choice, read from its
 * window. */
cudaError_t cometi_launch_pull_weights(const cometi_weight_windows_t *win, const void *dest,
                                       const cometi_segment_t *segs, int groups, int64_t cap_rows, int tp,
                                       float *w_rows, int sm_count, cudaStream_t stream);

/* The other way: each received row's dw_rows[row] into its source's window at its slot,
 * then a system-scope fence, so that what this rank releases later (its dx rows) carries
 * them. */
cudaError_t cometi_launch_send_weight_grads(const cometi_weight_windows_t *win, const void *dest,
                                            const cometi_segment_t *segs, int groups, int64_t cap_rows,
                                            const float *dw_rows, int sm_count, cudaStream_t stream);

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
