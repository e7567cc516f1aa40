/*
 * gemm_combine.h - COMET's second pattern, GEMM -> combine: each finished tile's rows go
 * home and their owner sums a token's rows in a fixed order (fp32: the same inputs give
 * the same bits). The forward runs it as layer1, GEMM1 (the down projection) over
 * layer0's activations, ending one of two ways (cometi_combine_knobs_t): the push, where
 * GEMM1's epilogue sends every row home and the owner sums after; or combine blocks
 * beside the GEMM that send each finished column split home, summed per token on this
 * rank and weighted by the top-k weights, with the last splits' combine on every SM after.
 */
#ifndef COMET_GEMM_COMBINE_H
#define COMET_GEMM_COMBINE_H

#include "patterns/dispatch_gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cometi_layer1 {
    cometi_window_t slots;            /* [max_tokens][slots_per_token][hidden] bf16: this rank's tokens'
                                       * rows, one per rank that computed some of its choices; with
                                       * the push, [max_tokens * top_k * tp][hidden], one per choice and TP rank */
    cometi_window_t arrive;           /* [COMETI_MAX_SPLITS + 1] u64: rows summed into the slots per
                                       * split, then rows pushed, over all calls */
    cometi_combine_peer_t *peers;     /* [world] device table of every rank's windows */
    void *out;                        /* [max_recv_rows][hidden] bf16: GEMM1's output */
    cometi_row_meta_t *meta;          /* [max_recv_rows] records of the received rows */
    void *push_dest;                  /* [max_recv_rows] int2: where the push sends each row */
    void *push_maps;                  /* [world] tensor maps of every rank's slots (the push's stores) */
    unsigned long long *split_done;   /* [COMETI_MAX_SPLITS] GEMM1 rows finished per split, over all calls */
    unsigned long long *expected;     /* [2][COMETI_MAX_SPLITS] what the combine waits for next */
    unsigned long long *push_expected; /* [1] what the push's sum waits for next */
    unsigned int *push_done;          /* [1] the push sum's blocks out, zero between calls */
    unsigned int *sched;              /* the kernel's counters, zero between calls */
    unsigned long long *trace;        /* [2][SMs][COMETI_COMBINE_TRACE]: the last call's combine timeline,
                                       * combine blocks then the tail kernel's blocks */
    unsigned long long *tile_trace;   /* NULL, or (benchmarks) GEMM1's tile timeline, fused or
                                       * alone (gemm/gemm.h) */
    cudaEvent_t *push_marks;          /* [4] or NULL (benchmarks): recorded before the push's
                                       * destinations, its GEMM, its sum, and after the sum */
    int hidden, slots_per_token;
    int tp;                           /* the push's slots hold tp partial rows per choice */
} cometi_gemm_combine_t;

/* Collective. Needs top_k <= COMETI_COMBINE_MAX_TOP_K and the layer0 of the same config. */
comet_status_t cometi_gemm_combine_create(comet_comm_t comm, const comet_moe_config_t *cfg, const cometi_dispatch_gemm_t *l0,
                                    cometi_gemm_combine_t *l);
void cometi_gemm_combine_destroy(comet_comm_t comm, cometi_gemm_combine_t *l);

/* Collective, no host sync, after cometi_dispatch_gemm_run of the same args on the same stream
 * (its route, rows and activations): y = sum over each token's choices of weight x GEMM1.
 * One launch, or two with a tail. A peer that never sends gives COMET_TIMEOUT through
 * comet_comm_get_async_error(). Running layer1 again without a layer0 in between needs a
 * cometi_barrier() first: the route exchange is what orders the slots' reuse. */
comet_status_t cometi_gemm_combine_run(comet_comm_t comm, cometi_gemm_combine_t *l, cometi_dispatch_gemm_t *l0,
                                 const comet_moe_args_t *a, const cometi_combine_knobs_t *knobs, cudaStream_t stream);

/* Work a caller puts beside the combine (the backward's weight gradients, which need no
 * communication): with the push, between the GEMM and the owner's sum, so it runs while
 * the peers' rows are still on their way; with combine blocks or the tail, after the
 * combine's end (the tail sends rows itself: before it, none would be on their way). */
typedef struct cometi_combine_between {
    comet_status_t (*run)(void *ctx, cudaStream_t stream); /* enqueues on `stream`; an error
                                                            * there leaves the combine unended */
    void *ctx;
} cometi_combine_between_t;

/* The same with another GEMM whose rows go home (`core`: the segments of layer0's route,
 * n = hidden columns into `out`; the backward's dgrad of W13, its rows summed unweighted
 * when the route was given weights of 1), and `between` (or NULL) enqueued as its comment
 * says; the combine is enqueued whole even when `between` fails. */
comet_status_t cometi_gemm_combine_run_core(comet_comm_t comm, cometi_gemm_combine_t *l, cometi_dispatch_gemm_t *l0,
                                            const comet_moe_args_t *a, const cometi_gemm_t *core,
                                            const cometi_combine_knobs_t *knobs,
                                            const cometi_combine_between_t *between, cudaStream_t stream);

/* Where each row this rank received in layer0's last route goes home (its source rank and
 * slot, cometi_launch_push_dest) into l->push_dest, on `stream`: the backward sends each
 * row's routing-weight gradient there. */
comet_status_t cometi_gemm_combine_row_homes(comet_comm_t comm, cometi_gemm_combine_t *l,
                                             const cometi_dispatch_gemm_t *l0, const comet_moe_args_t *a,
                                             cudaStream_t stream);

/* The GEMM of a call alone (GEMM1 on layer0's activations into `out`, every SM, one
 * split, no roles), as the fused run describes it: benchmarks time it against the fused
 * call. */
cometi_gemm_t cometi_gemm_combine_gemm(comet_comm_t comm, const cometi_gemm_combine_t *l,
                                       const cometi_dispatch_gemm_t *l0, const comet_moe_args_t *a);

#ifdef __cplusplus
}
#endif

#endif /* COMET_GEMM_COMBINE_H */
