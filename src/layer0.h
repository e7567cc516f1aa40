/*
 * layer0.h - the first half of the fused MoE layer (COMET's layer0): the device route,
 * then one persistent kernel in which dispatch blocks copy each token row into its
 * expert owner's receive buffer over NVLink (local rows first) and count arrivals per
 * 128-row block, while GEMM blocks run GEMM0 with SwiGLU, starting each tile as soon
 * as its rows have all arrived, tiles made only of local rows first.
 */
#ifndef COMET_LAYER0_H
#define COMET_LAYER0_H

#include "internal.h"
#include "kernels/route.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cometi_layer0 {
    cometi_route_dev_t route;
    cometi_window_t recv;   /* [max_recv_rows][hidden] bf16: rows pushed here by every rank */
    cometi_window_t arrive; /* [max_recv_rows / 128] u64: rows arrived per block, over all calls */
    void *act;              /* [max_recv_rows][ffn] bf16: SwiGLU(GEMM0), expert-major, padded */
    unsigned int *sched;    /* the kernels' tile and piece counters, zero between calls */
    void *tail_ws;          /* the GEMMs' last-wave workspace (kernels/gemm.h), layer1's too */
    unsigned long long *tile_trace; /* NULL, or (benchmarks) where the GEMM kernel writes its
                                     * tile timeline (kernels/gemm.h), fused or alone */
    int hidden, num_experts, top_k, max_tokens;
    int ffn;                /* this rank's columns of each expert: config.ffn / tp */
    int tp, experts_per_group; /* EP x TP: rank r is TP rank r % tp of group r / tp (plan.h) */
    int64_t max_recv_rows;
    /* The first wave on a stream of its own (tp 1): the rank's first expert's first row
     * blocks, copied and computed while the route's exchange runs (cometi_first_rows). */
    cudaStream_t side;
    cudaEvent_t ranks_done, wave_done;
    cometi_segment_t *wave_seg; /* device: {0, rows} of the first-wave GEMM */
} cometi_layer0_t;

/* SMs the first-wave GEMM leaves to the route's kernels and the fused kernel's first
 * blocks; it takes (SMs - these) / column tiles row blocks. COMET_FIRST_WAVE=0: none. */
#define COMETI_LAYER0_WAVE_FREE_SMS 32
int cometi_first_wave_enabled(void);

/* The run-time choices of one layer0 call (what the tuner picks). */
typedef struct cometi_layer0_knobs {
    int dispatch_blocks; /* SMs that copy rows; the rest compute */
    int dispatch_mode;   /* COMETI_DISPATCH_* (kernels/gemm.h) */
    int first_wave;      /* tp 1: the first wave's row blocks: 0 automatic (on at 4 or more),
                          * -1 none, n > 0 exactly n (tests) */
} cometi_layer0_knobs_t;

/* Collective. The config must be valid (ffn / tp a multiple of 64: GEMM0's last SwiGLU
 * tile of 128 activation columns may be half full), its tp_size resolved (>= 1). With
 * TP > 1 a row goes to every rank of its expert's group, and each computes its ffn / tp
 * columns. */
comet_status_t cometi_layer0_create(comet_comm_t comm, const comet_moe_config_t *cfg, cometi_layer0_t *l);
void cometi_layer0_destroy(comet_comm_t comm, cometi_layer0_t *l);

/* Collective, no host sync: route, then the fused kernel with `knobs->dispatch_blocks`
 * of the GPU's SMs copying rows and the rest computing. Failures on the device (a peer that
 * never arrives) come back through comet_comm_get_async_error(). */
comet_status_t cometi_layer0_run(comet_comm_t comm, cometi_layer0_t *l, const comet_moe_args_t *a,
                                 const cometi_layer0_knobs_t *knobs, cudaStream_t stream);

/* GEMM0 + SwiGLU alone on the rows the last run left in the receive buffer, with every
 * SM and no waits: the term "our GEMM alone" of the overlap bound. `dynamic_tiles`: tiles
 * from the shared counter (the fused kernel's schedule), else the static split. */
comet_status_t cometi_layer0_gemm_only(comet_comm_t comm, cometi_layer0_t *l, const comet_moe_args_t *a,
                                       int dynamic_tiles, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_LAYER0_H */
