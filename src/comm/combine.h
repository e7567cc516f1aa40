/*
 * combine.h - the GEMM -> combine side (COMET's layer1 communication): each finished
 * tile's rows go home to their token's owner, who sums a token's rows in a fixed order
 * (the same bits every run). Two ways: combine blocks beside the GEMM that pre-sum a
 * token's rows on this rank per column split (combine.cuh, run by the GEMM kernel's
 * combine role and by the tail kernel after it), or the push: the GEMM's epilogue sends
 * every row home (the GEMM's push role) and the owner sums after (push_sum_kernel).
 */
#ifndef COMET_COMBINE_H
#define COMET_COMBINE_H

#include <cuda_runtime_api.h>

#include "comm/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Column splits of a layer1 call (split_done and the combine's counters are this long). */
#define COMETI_MAX_SPLITS 32
/* Layer1's arrival counters: one per split, then this one, the rows pushed (see the push). */
#define COMETI_PUSH_COUNTER COMETI_MAX_SPLITS
/* Ranks the push reaches: its epilogue counts the rows sent to each owner in one lane of
 * a warp. */
#define COMETI_PUSH_MAX_RANKS 32
/* Choices of one token that the combine sums on one rank before sending (registers). */
#define COMETI_COMBINE_MAX_TOP_K 8
/* Timeline of a combine block: start, records pulled, then per split (the first 8): rows
 * ready in C, sent, this rank's rows home, summed into y; then the end. */
#define COMETI_COMBINE_TRACE 36

/* What layer1 needs to know of one (token, choice) row, written in send order by the
 * source rank's route and pulled by the row's receiver (16 bytes). */
typedef struct cometi_row_meta {
    int32_t slot;  /* for the token's first choice on that receiver (its lead): the owner's slot,
                    * t * slots_per_token + (distinct receivers among earlier choices); else -1 */
    int32_t next;  /* the receive row of the token's next choice on the same receiver, or -1 */
    float weight;  /* the choice's top-k weight */
    int32_t src;   /* the source rank (filled in by the receiver) */
} cometi_row_meta_t;

/* One rank's windows the combine blocks reach, as mapped here (a device-memory table). */
typedef struct cometi_combine_peer {
    const cometi_row_meta_t *meta; /* its rows' records, in its send order */
    void *slots;                   /* [max_tokens][slots_per_token][hidden] bf16; the push puts
                                    * [max_tokens * top_k][hidden] there instead */
    unsigned long long *arrive;    /* [COMETI_MAX_SPLITS + 1] rows summed into its slots, per split,
                                    * then rows pushed there (COMETI_PUSH_COUNTER) */
} cometi_combine_peer_t;

/* Combine blocks of the fused layer1 kernel: they do not compute. First they pull the
 * records of every row received (from each row's source), then for each column split,
 * once the GEMM has finished it for every row: sum each token's rows on this rank,
 * weighted (the lead row and its `next` chain, fp32), write the sum to the token owner's
 * slot, count the rows per owner with one system-scope release; then, as owner, wait
 * until every row of its own tokens is in and sum the slots (fp32, in slot order: the
 * same bits every run) into y. Each split's combine runs while the GEMM computes the
 * next split. */
typedef struct cometi_combine {
    const cometi_combine_peer_t *peers;  /* [world], device memory */
    cometi_row_meta_t *meta;             /* [a_rows] records of the received rows */
    cometi_route_tables_t plan;          /* the route's tables (counts, send_offset, recv_offset) */
    const int32_t *topk_ids;             /* [num_tokens][top_k] this rank's tokens */
    void *y;                             /* [num_tokens][hidden] bf16 */
    unsigned long long *expected;        /* [2][COMETI_MAX_SPLITS] running totals the waits aim at:
                                          * split_done, then this rank's arrive; the last combine
                                          * block advances them */
    unsigned int *sync;                  /* [2] zeroed words (blocks past the pull, blocks done);
                                          * zero again after the call */
    unsigned long long *trace;           /* [blocks][COMETI_COMBINE_TRACE] global-timer ns at each
                                          * phase (see combine.cuh), or NULL */
    int kernel_splits;                   /* splits the GEMM kernel's combine blocks send (0 ..
                                          * n_splits); cometi_launch_combine_tail does the rest */
    int num_tokens, num_experts, experts_per_group, top_k, slots_per_token, rank, world;
    int tp;                              /* ranks per EP group; the combine blocks and the tail need
                                          * 1, the push any (each TP rank sends its partial rows) */
} cometi_combine_t;

/* The combine of splits [c->kernel_splits, n_splits) on every SM, after the GEMM that
 * wrote `rows` (C, [.][hidden]) on the same stream; `pull`: the records were not pulled
 * yet (the GEMM had no combine blocks). */
/* The combine of splits [c->kernel_splits, n_splits) on every SM, after the GEMM kernel
 * (pull: the records too, where the GEMM had no combine blocks). cudaErrorInvalidDevice
 * past device 63. */
cudaError_t cometi_launch_combine_tail(const cometi_combine_t *c, const void *rows, int hidden,
                                       const cometi_segment_t *segs, int groups, int n_splits, int tiles_per_split,
                                       const unsigned long long *split_done, int pull,
                                       cometi_async_error_t *async_err, unsigned long long timeout_ns,
                                       cudaStream_t stream);

/* Each received row's destination, int2 (owner rank, slot row), x = -1 for padding: the
 * rows of `segs` up to *used_rows (at most `rows`). dest 8-byte aligned; groups and rows
 * >= 1 (cudaErrorInvalidValue otherwise). */
cudaError_t cometi_launch_push_dest(const cometi_combine_t *c, const cometi_segment_t *segs, int groups, int64_t rows,
                                    const int32_t *used_rows, void *dest, cudaStream_t stream);

typedef struct cometi_push_sum {
    const void *slots;                 /* this rank's slots, [.][hidden] bf16 */
    const unsigned long long *arrive;  /* this rank's push counter */
    unsigned long long *expected;      /* [1] running total the wait aims at */
    unsigned int *done;                /* [1] zeroed word */
    const int32_t *topk_ids, *pos;     /* this rank's ids [tokens][top_k]; pos: the route's rank of each
                                        * (t, j) among this rank's rows of its expert */
    cometi_route_tables_t plan;        /* the route's tables (counts, send_offset) */
    const float *weights;
    void *y;
    int num_tokens, top_k, hidden, num_experts, rank, col_tiles;
    int tp;                            /* TP ranks per group: choice (t, j) has tp partial rows, at
                                        * slots slot * tp + c, c the sender's TP rank; summed c by c */
    int step;                          /* tokens a block takes at a time: set by the prepare */
} cometi_push_sum_t;
/* Check `s`, size the grid and set s->step; nothing is enqueued. Call it before the GEMM
 * whose rows the sum waits for: a sum that fails after that GEMM has run would leave the
 * running total behind the counters. */
/* The push sum's launch shape for `sm_count` SMs: s->step (tokens a block takes at a time)
 * and the blocks. The caller checks the fields first: hidden a multiple of 8, top_k
 * 1..COMETI_COMBINE_MAX_TOP_K, tokens >= 0, col_tiles and tp >= 1, y and slots 16-byte
 * aligned. */
void cometi_push_sum_plan(cometi_push_sum_t *s, int sm_count, unsigned int *blocks);
/* cudaErrorInvalidValue for a sum that was not planned. */
cudaError_t cometi_launch_push_sum(const cometi_push_sum_t *s, unsigned int blocks, cometi_async_error_t *async_err,
                                   unsigned long long timeout_ns, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_COMBINE_H */
