/*
 * route.h - the device route (route.c): routing on the GPU with no host sync. Every rank
 * pushes its counts into every peer's symmetric table, waits for all of theirs (with a
 * timeout), and builds the routing plan of plan.h on the GPU, identical on every rank,
 * plus each row's place in its expert owner's receive buffer (route_kernels.h).
 */
#ifndef COMET_COMM_ROUTE_H
#define COMET_COMM_ROUTE_H

#include "comm/comm.h"
#include "comm/route_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

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

/* Collective, enqueued on `stream`, no host sync. A peer that never arrives gives
 * COMET_TIMEOUT through comet_comm_get_async_error(); an expert id out of range gives
 * COMET_INVALID_ARGUMENT there (its row is left out: recv_pos -1). wave_blocks (tp 1;
 * 0 without a first wave) goes into the plan for this call: the fused GEMM's segments
 * leave out that many of the first expert's own row blocks. ranks_done (or NULL) is
 * recorded once the chunk ranks are launched (cometi_first_rows waits for it). With `weights`
 * ([m][k]), each row's layer1 record is written into `meta` too. call: the call's id
 * (types.h's COMETI_CALL_TRAIN_FORWARD: 0 for an inference forward, a training
 * forward's bound, a backward's forward number); ranks that pass different ids get
 * COMET_INVALID_ARGUMENT through comet_comm_get_async_error(), every one of them, and
 * empty plans (nothing moves). */
comet_status_t cometi_route_dev_run(comet_comm_t comm, cometi_route_dev_t *r, const int32_t *topk_ids,
                                    const float *weights, int m, int k, int wave_blocks, unsigned int call,
                                    cudaEvent_t ranks_done, cudaStream_t stream);

/* The first-wave kernel's rows (tp 1), on the caller's stream once the chunk ranks of
 * this call are done (ranks_done): this rank's own rows of its group's first expert e0,
 * the first min(own / 128, r->plan.wave_blocks) x 128 of them, from x (a token per
 * row_bytes: bf16, or E4M3 and its scales as the dispatch sends them) into row 0.. of its
 * own receive buffer (segment 0 starts at 0 and its own rows lead it whatever the peers
 * send), their 128-row blocks' arrivals counted, and *seg = {0, those rows} for the
 * first-wave GEMM. */
/* Whether cometi_first_rows takes these arguments once the route has run with
 * wave_blocks: checked before the route, so that nothing fails after the side stream has
 * forked. */
int cometi_first_rows_allowed(const cometi_route_dev_t *r, int wave_blocks, int m, int k, const void *x,
                              int row_bytes);
comet_status_t cometi_first_rows(comet_comm_t comm, const cometi_route_dev_t *r, const int32_t *topk_ids, int m,
                                 int k, const void *x, int row_bytes, void *recv, unsigned long long *arrive,
                                 cometi_segment_t *seg, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_COMM_ROUTE_H */
