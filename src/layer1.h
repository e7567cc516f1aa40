/*
 * layer1.h - the second half of the fused MoE layer (COMET's layer1): one persistent
 * kernel in which GEMM blocks run GEMM1 (the down projection) over layer0's activations
 * column split by column split, while combine blocks send each finished split home,
 * summed per token on this rank and weighted by the top-k weights, and sum what comes
 * home into y (fp32, a fixed order: the same inputs give the same bits).
 */
#ifndef COMET_LAYER1_H
#define COMET_LAYER1_H

#include "layer0.h"

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
                                       * alone (kernels/gemm.h) */
    cudaEvent_t *push_marks;          /* [4] or NULL (benchmarks): recorded before the push's
                                       * destinations, its GEMM, its sum, and after the sum */
    int hidden, slots_per_token;
    int tp;                           /* the push's slots hold tp partial rows per choice */
} cometi_layer1_t;

/* The run-time choices of one layer1 call; n_splits must be the same on every rank. */
typedef struct cometi_layer1_knobs {
    int combine_blocks; /* SMs that combine beside the GEMM; the rest compute. 0: none, the
                         * tail kernel combines every split after the GEMM (no overlap) */
    int n_splits;       /* column splits of GEMM1 (divides hidden / 128 or hidden / 256) */
    int dynamic_tiles;  /* GEMM tiles from a shared counter, else the static split */
    int tail;           /* the last split's combine runs after the GEMM on every SM, not on
                         * the combine blocks (implied by combine_blocks = 0) */
    int push;           /* GEMM1's epilogue sends each finished tile's rows to their token
                         * owners (every choice its own slot, no pre-sum), and the owner sums
                         * them after: the communication rides in the GEMM on no SM of its
                         * own. Needs combine_blocks = 0 and n_splits = 1, and the same value
                         * on every rank (comet_moe_forward's ranks compare their settings).
                         * The only ending with TP > 1 (the others pre-sum per rank; they
                         * return COMET_NOT_SUPPORTED, after layer0 has been enqueued: the
                         * tuning file and the cost model never pick them with TP). Its sum
                         * order (by choice) differs from the combine's (by rank), so its
                         * bits do too. */
} cometi_layer1_knobs_t;

/* Collective. Needs top_k <= COMETI_COMBINE_MAX_TOP_K and the layer0 of the same config. */
comet_status_t cometi_layer1_create(comet_comm_t comm, const comet_moe_config_t *cfg, const cometi_layer0_t *l0,
                                    cometi_layer1_t *l);
void cometi_layer1_destroy(comet_comm_t comm, cometi_layer1_t *l);

/* Collective, no host sync, after cometi_layer0_run of the same args on the same stream
 * (its route, rows and activations): y = sum over each token's choices of weight x GEMM1.
 * One launch, or two with a tail. A peer that never sends gives COMET_TIMEOUT through
 * comet_comm_get_async_error(). Running layer1 again without a layer0 in between needs a
 * cometi_barrier() first: the route exchange is what orders the slots' reuse. */
comet_status_t cometi_layer1_run(comet_comm_t comm, cometi_layer1_t *l, cometi_layer0_t *l0,
                                 const comet_moe_args_t *a, const cometi_layer1_knobs_t *knobs, cudaStream_t stream);

/* GEMM1 alone on layer0's activations into `out`, every SM, one split, no combine: the
 * term "our GEMM1 alone" of the overlap bound. */
comet_status_t cometi_layer1_gemm_only(comet_comm_t comm, cometi_layer1_t *l, cometi_layer0_t *l0,
                                       const comet_moe_args_t *a, int dynamic_tiles, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_LAYER1_H */
