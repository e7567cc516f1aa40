/*
 * route_kernels.h - the routing kernels (route_kernels.cu, first_wave.cu) as the host
 * launches them, with device types alone. cometi_launch_route gives each (token, choice)
 * its stable rank among this rank's rows of its expert, and the per-expert counts (the
 * sequential path uses it and then syncs the host). The device route (route.h, route.c)
 * runs three launches: the chunks' ranks, the exchange of counts with every peer through
 * symmetric memory with the plan of plan.h built on the GPU, identical on every rank, and
 * each row's place in its expert owner's receive buffer.
 */
#ifndef COMET_COMM_ROUTE_KERNELS_H
#define COMET_COMM_ROUTE_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "comm/combine.h"
#include "comm/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows a block of the route ranks at once; the scratch holds E x chunks counts. */
#define COMETI_ROUTE_CHUNK 2048
static inline int cometi_route_chunks(int max_rows)
{
    return max_rows > 0 ? (max_rows + COMETI_ROUTE_CHUNK - 1) / COMETI_ROUTE_CHUNK : 1;
}

/* counts [E], pos [n], first_bad: the first index with an id outside [0, E), or ~0;
 * chunk_counts: scratch of E x cometi_route_chunks(n) ints. */
cudaError_t cometi_launch_route(const int32_t *ids, int n, int num_experts, int32_t *counts, int32_t *pos,
                                unsigned int *first_bad, int32_t *chunk_counts, cudaStream_t stream);

/* The plan on the device, int32, the arrays of cometi_route_plan_t in the same layout. */
typedef struct cometi_route_dev_plan {
    int32_t *counts;      /* [world][E] */
    int32_t *send_offset; /* [world][E] */
    int32_t *seg_start;   /* [E] */
    int32_t *seg_rows;    /* [E] */
    int32_t *recv_offset; /* [world][E] */
    int32_t *recv_rows;   /* [groups] */
    int32_t *recv_pos;    /* [max_rows] this rank's row (t, j) in its owner's receive buffer; -1: bad id */
    int32_t *pos;         /* [max_rows] rank of (t, j) among this rank's rows of its expert */
    int32_t *src_of;      /* [max_rows] send order (destination, expert, token) -> (t, j) index */
    int32_t *failed;      /* [1] this call's exchange timed out: nothing placed or sent */
    /* This rank as a receiver, for the fused GEMM: */
    cometi_segment_t *local_segs;   /* [E / groups] its group's experts' segments */
    int32_t *local_rows;            /* [E / groups] rows at the head of each that come from this rank
                                     * itself (0 where another rank's rows lead: TP ranks after the first) */
    /* The first-wave kernel (tp 1, layer0.c) computes the first min(own rows / 128,
     * wave_blocks) row blocks of segment 0 on a stream of its own; the fused GEMM sees the
     * segments without them. wave_blocks 0: none (fused_* equal local_*). */
    int wave_blocks;
    cometi_segment_t *fused_segs;   /* [E / groups] */
    int32_t *fused_local_rows;      /* [E / groups] */
    unsigned long long *expected;   /* [max_recv_rows / 128] rows each 128-row block of the receive
                                     * buffer has received over all calls so far, this one included:
                                     * arrival counters reach it when the block is complete */
} cometi_route_dev_plan_t;

/* The tables the dispatch, the combine and the push read. */
static inline cometi_route_tables_t cometi_route_tables(const cometi_route_dev_plan_t *p)
{
    cometi_route_tables_t t = {p->counts, p->send_offset, p->seg_start, p->recv_offset};
    return t;
}

/* Test support: the plan of rank `me` that the exchange would build from counts
 * [world][E] (device memory), with no exchange, into `plan`'s arrays (counts, send_offset,
 * seg_start, seg_rows, recv_offset, recv_rows, local_segs, local_rows, and expected, which
 * it adds to). counts_in_smem as in cometi_route_dev_t; cudaErrorInvalidValue for a layout
 * the plan does not allow or counts that do not fit shared memory. The device plan is
 * int32: the counts' sums must fit (a route's always do). */
cudaError_t cometi_route_plan_from_counts(const int32_t *counts, int me, int world, int tp, int E, int block_m,
                                          const cometi_route_dev_plan_t *plan, int counts_in_smem,
                                          cudaStream_t stream);

/* The device route's launches, in order (route.c): the chunks' ranks (the first bad id's
 * index into first_bad, which the exchange reads and resets), the exchange with the plan,
 * and the rows' places (with `meta`, each row's layer1 record too). */
cudaError_t cometi_route_launch_chunk_ranks(const int32_t *ids, int n, int num_experts, int32_t *pos,
                                            unsigned int *first_bad, int32_t *chunk_counts, cudaStream_t stream);

typedef struct cometi_route_exchange {
    int32_t *peer_tables[COMETI_MAX_RANKS]; /* every rank's count table, mapped here */
    unsigned long long *mine;               /* this rank's table */
    int me, world, tp, num_experts, block_m;
    unsigned long long *seq;                /* the calls so far (device) */
    int32_t *local_counts;                  /* [E + 1] this rank's counts, then the first bad id */
    const int32_t *chunk_counts;            /* [E][chunks] */
    int32_t *chunk_prefix;                  /* [E][chunks] */
    int chunks;
    const int32_t *ids;                     /* [n] this call's expert ids */
    int n;
    cometi_route_dev_plan_t plan;
    int counts_in_smem;                     /* world x E counts kept in shared memory */
    unsigned int call;                      /* the call's id (types.h): every rank's must match */
    unsigned long long timeout_ns;
    cometi_async_error_t *err;
} cometi_route_exchange_t;
cudaError_t cometi_route_launch_exchange(const cometi_route_exchange_t *x, cudaStream_t stream);

cudaError_t cometi_route_launch_place_rows(const int32_t *ids, const float *weights, int n, int k, int E, int me,
                                           int world, int tp, const int32_t *chunk_pos, const int32_t *chunk_prefix,
                                           int chunks, const cometi_route_dev_plan_t *plan, cometi_row_meta_t *meta,
                                           cudaStream_t stream);

/* The first wave's rows (first_wave.cu; route.c's cometi_first_rows says what it copies):
 * ids [n], e0 this rank's first expert, the chunks' ranks and counts of this call, at
 * most COMETI_FIRST_ROWS_MAX_CHUNKS chunks; rows of row_bytes, a multiple of 16; at most
 * max_blocks blocks. */
#define COMETI_FIRST_ROWS_MAX_CHUNKS 256
cudaError_t cometi_launch_first_rows(const int32_t *ids, int n, int k, int e0, const int32_t *chunk_pos,
                                     const int32_t *chunk_counts, int chunks, int wave_blocks, const void *x,
                                     int row_bytes, void *recv, unsigned long long *arrive, cometi_segment_t *seg,
                                     int max_blocks, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_COMM_ROUTE_KERNELS_H */
