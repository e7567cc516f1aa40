/*
 * route.h - routing on the GPU. cometi_launch_route gives each (token, choice) its
 * stable rank among this rank's rows of its expert, and the per-expert counts (the
 * baseline uses it and then syncs the host). The device route goes on without the
 * host: every rank pushes its counts into every peer's symmetric table, waits for
 * all of theirs (with a timeout), and builds the routing plan of plan.h on the GPU,
 * identical on every rank, plus each row's place in its expert owner's receive buffer.
 */
#ifndef COMET_ROUTE_H
#define COMET_ROUTE_H

#include <stdint.h>
#include "../internal.h"

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

typedef struct cometi_route_dev {
    int world, tp, num_experts, max_rows, block_m, max_blocks; /* tp ranks per group (plan.h) */
    cometi_window_t table;          /* [2][world][E + 1] u64: each rank's counts, then its call id
                                     * (cometi_route_dev_run), each tagged with the exchange (high 32 bits) */
    cometi_window_t meta;           /* [max_rows] this rank's rows' records for layer1, in send
                                     * order (written when the run is given weights) */
    int32_t *local_counts;          /* [E + 1]: this rank's counts, then the first bad id's index (-1
                                     * between calls: the exchange resets it) */
    int32_t *arena;                 /* backs every array of `plan`, chunk_pos, chunk_counts and chunk_prefix */
    int32_t *chunk_pos;             /* route scratch: [max_rows] each row's rank within its chunk */
    int32_t *chunk_counts;          /* route scratch: [E][cometi_route_chunks(rows)], counts per chunk */
    int32_t *chunk_prefix;          /* route scratch: [E][chunks], rows of each expert in earlier chunks
                                     * (the exchange writes it from chunk_counts; place reads it) */
    cometi_route_dev_plan_t plan;
    unsigned long long *seq;        /* device: calls so far (each call's counts carry it, nothing is reset); kept
                                     * on the device so that a captured CUDA graph counts on replay */
    int counts_in_smem;             /* the exchange keeps world x E counts in shared memory: set at
                                     * create where they fit (a test clears it to run the other
                                     * path; setting it where they do not fit fails the launch) */
} cometi_route_dev_t;

/* Collective (allocates a symmetric window). tp: ranks per EP group; max_rows = max tokens x top-k;
 * max_recv_rows: the most padded rows one rank can receive (cometi_route_max_recv_rows). */
comet_status_t cometi_route_dev_create(comet_comm_t comm, int num_experts, int tp, int max_rows,
                                       int64_t max_recv_rows, int block_m, cometi_route_dev_t *r);
void cometi_route_dev_destroy(comet_comm_t comm, cometi_route_dev_t *r);

/* Test support: the plan of rank `me` that the exchange would build from counts
 * [world][E] (device memory), with no exchange, into `plan`'s arrays (counts, send_offset,
 * seg_start, seg_rows, recv_offset, recv_rows, local_segs, local_rows, and expected, which
 * it adds to). counts_in_smem as in cometi_route_dev_t; cudaErrorInvalidValue for a layout
 * the plan does not allow or counts that do not fit shared memory. The device plan is
 * int32: the counts' sums must fit (a route's always do). */
cudaError_t cometi_route_plan_from_counts(const int32_t *counts, int me, int world, int tp, int E, int block_m,
                                          const cometi_route_dev_plan_t *plan, int counts_in_smem,
                                          cudaStream_t stream);

/* Collective, enqueued on `stream`, no host sync. A peer that never arrives gives
 * COMET_TIMEOUT through comet_comm_get_async_error(); an expert id out of range gives
 * COMET_INVALID_ARGUMENT there (its row is left out: recv_pos -1). wave_blocks (tp 1;
 * 0 without a first wave) goes into the plan for this call: the fused GEMM's segments
 * leave out that many of the first expert's own row blocks. ranks_done (or NULL) is
 * recorded once the chunk ranks are launched (cometi_first_rows waits for it). With `weights`
 * ([m][k]), each row's layer1 record is written into `meta` too. call: the call's id
 * (internal.h's COMETI_CALL_TRAIN_FORWARD: 0 for an inference forward, a training
 * forward's bound, a backward's forward number); ranks that pass different ids get
 * COMET_INVALID_ARGUMENT through comet_comm_get_async_error(), every one of them, and
 * empty plans (nothing moves). */
comet_status_t cometi_route_dev_run(comet_comm_t comm, cometi_route_dev_t *r, const int32_t *topk_ids,
                                    const float *weights, int m, int k, int wave_blocks, unsigned int call,
                                    cudaEvent_t ranks_done, cudaStream_t stream);

/* The first-wave kernel's rows (tp 1), on the caller's stream once the chunk ranks of
 * this call are done (ranks_done): this rank's own rows of its group's first expert e0,
 * the first min(own / 128, r->plan.wave_blocks) x 128 of them, from x into row 0.. of its
 * own receive buffer (segment 0 starts at 0 and its own rows lead it whatever the peers
 * send), their 128-row blocks' arrivals counted, and *seg = {0, those rows} for the
 * first-wave GEMM. */
/* Whether cometi_first_rows takes these arguments once the route has run with
 * wave_blocks: checked before the route, so that nothing fails after the side stream has
 * forked. */
int cometi_first_rows_allowed(const cometi_route_dev_t *r, int wave_blocks, int m, int k, const void *x, int hidden);
comet_status_t cometi_first_rows(comet_comm_t comm, const cometi_route_dev_t *r, const int32_t *topk_ids, int m,
                                 int k, const void *x, int hidden, void *recv, unsigned long long *arrive,
                                 cometi_segment_t *seg, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_ROUTE_H */
