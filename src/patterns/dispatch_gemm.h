/*
 * dispatch_gemm.h - COMET's first pattern, dispatch -> GEMM: rows go to their expert's
 * ranks over NVLink while the grouped GEMM eats the rows already there. One persistent
 * kernel: dispatch blocks copy each row into its expert owner's receive buffer (local
 * rows first) and count arrivals per 128-row block; GEMM blocks start each tile as soon
 * as its rows have all arrived, tiles made only of local rows first. The forward runs it
 * as layer0: the device route, then x dispatched into GEMM0 with SwiGLU in the epilogue.
 */
#ifndef COMET_DISPATCH_GEMM_H
#define COMET_DISPATCH_GEMM_H

#include "comm/comm.h"
#include "patterns/tune.h"
#include "gemm/gemm.h"
#include "comm/route.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The bytes of an FP8 row as the dispatch sends it: its hidden E4M3 values, then its
 * ceil(hidden / 128) FP32 scales, padded to 16 bytes. */
static inline int cometi_fp8_row_bytes(int hidden) { return hidden + ((hidden + 127) / 128 * 4 + 15) / 16 * 16; }

typedef struct cometi_dispatch_gemm {
    cometi_route_dev_t route;
    cometi_window_t recv;   /* [max_recv_rows][row_bytes]: rows pushed here by every rank */
    cometi_window_t arrive; /* [max_recv_rows / 128] u64: rows arrived per block, over all calls */
    void *x_rows;           /* config.resend_x: [max_recv_rows][hidden] bf16, recv's second half:
                             * where the backward sends x again; else NULL */
    void *act;              /* [max_recv_rows][ffn] bf16 (FP8: E4M3): SwiGLU(GEMM0), expert-major, padded */
    /* Block-scaled FP8 (config.dtype COMET_DTYPE_FP8_BLOCK): a row is sent as its hidden E4M3
     * bytes and then its ceil(hidden / 128) scales, padded to 16 bytes, so one copy moves
     * both (row_bytes; bf16: hidden x 2); each token is quantized once, before the route,
     * into x_q, [max_tokens][row_bytes]. GEMM0's epilogue quantizes the activation, its
     * scales MN-major in act_scales [ceil(ffn / 128)][max_recv_rows] for GEMM1. */
    int fp8, pow2_scales, row_bytes;
    void *x_q;
    float *act_scales;
    unsigned int *sched;    /* the kernels' tile and piece counters, zero between calls */
    void *tail_ws;          /* the GEMMs' last-wave workspace (gemm/gemm.h), layer1's too */
    unsigned long long *tile_trace; /* NULL, or (benchmarks) where the GEMM kernel writes its
                                     * tile timeline (gemm/gemm.h), fused or alone */
    int hidden, num_experts, top_k, max_tokens;
    int ffn;                /* this rank's columns of each expert: config.ffn / tp */
    int tp, experts_per_group; /* EP x TP: rank r is TP rank r % tp of group r / tp (plan.h) */
    int64_t max_recv_rows;
    /* The first wave on a stream of its own (tp 1): the rank's first expert's first row
     * blocks, copied and computed while the route's exchange runs (cometi_first_rows). */
    cudaStream_t side;
    cudaEvent_t ranks_done, wave_done;
    cometi_segment_t *wave_seg; /* device: {0, rows} of the first-wave GEMM */
} cometi_dispatch_gemm_t;

/* Collective. The config must be valid (ffn / tp a multiple of 64: GEMM0's last SwiGLU
 * tile of 128 activation columns may be half full), its tp_size resolved (>= 1). With
 * TP > 1 a row goes to every rank of its expert's group, and each computes its ffn / tp
 * columns. */
comet_status_t cometi_dispatch_gemm_create(comet_comm_t comm, const comet_moe_config_t *cfg,
                                           cometi_dispatch_gemm_t *l);
void cometi_dispatch_gemm_destroy(comet_comm_t comm, cometi_dispatch_gemm_t *l);

/* Collective, no host sync: the route, then the fused kernel with `knobs->dispatch_blocks`
 * of the GPU's SMs copying rows and the rest computing GEMM0 + SwiGLU into `act`.
 * Failures on the device (a peer that never arrives) come back through
 * comet_comm_get_async_error(). */
comet_status_t cometi_dispatch_gemm_run(comet_comm_t comm, cometi_dispatch_gemm_t *l, const comet_moe_args_t *a,
                                        const cometi_dispatch_knobs_t *knobs, cudaStream_t stream);

/* What kind of call a training call is (NULL: an inference forward). */
typedef struct cometi_dispatch_call {
    int backward;        /* a->x is dy, [tokens][hidden], a row per token as x's (no first
                          * wave) */
    const void *x_again; /* a backward's: NULL, or (config.resend_x) the forward's x,
                          * [tokens][hidden], whose rows go into x_rows beside a->x's */
    unsigned int call;   /* the call's id (types.h's COMETI_CALL_TRAIN_FORWARD): every rank
                          * must pass the same, or the route refuses the call on every rank */
} cometi_dispatch_call_t;

/* The same with another GEMM on the received rows (`core`: A the receive buffer, the
 * segments of this call's route; the backward's dgrad of W2), for a call of `kind`. */
comet_status_t cometi_dispatch_gemm_run_core(comet_comm_t comm, cometi_dispatch_gemm_t *l, const comet_moe_args_t *a,
                                             const cometi_gemm_t *core, const cometi_dispatch_call_t *kind,
                                             const cometi_dispatch_knobs_t *knobs, cudaStream_t stream);

/* The GEMM of a call alone (GEMM0 + SwiGLU on the receive buffer into `act`, every SM, no
 * roles), as the fused run describes it: benchmarks time it against the fused call. */
cometi_gemm_t cometi_dispatch_gemm_gemm(comet_comm_t comm, const cometi_dispatch_gemm_t *l,
                                        const comet_moe_args_t *a);

#ifdef __cplusplus
}
#endif

#endif /* COMET_DISPATCH_GEMM_H */
