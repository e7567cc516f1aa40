/*
 * bench.h - what the files of `comet bench` (and `comet tune`, `comet bandwidth`) share:
 * the input sets, the phases a case reports, a case's results, the calls the timing
 * runs, and the functions one file calls in another.
 */
#ifndef COMET_TOOLS_BENCH_H
#define COMET_TOOLS_BENCH_H

#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "patterns/dispatch_gemm.h"
#include "patterns/gemm_combine.h"
#include "patterns/tune.h"
#include "tool.h"

#define NSETS 3 /* input sets rotated between calls, so they do not sit in L2 */

enum { P_TOTAL, P_ROUTE, P_A2A_OUT, P_EXPERTS, P_A2A_BACK, P_COMBINE, P_LAYER0, P_LAYER1, P_COUNT };

/* --train (bench_train.c): each impl's training calls, medians of the slowest rank, in ms;
 * -1 where the impl does not serve the call ("n/a"). Index 0 the baseline, 1 comet. */
enum { TRAIN_BASE, TRAIN_COMET, TRAIN_IMPLS };
typedef struct train_result {
    int ran; /* --train, with the baseline run */
    float forward_ms[TRAIN_IMPLS], backward_ms[TRAIN_IMPLS], step_ms[TRAIN_IMPLS];
    float gemms_ms;                   /* comet's backward GEMMs alone (cometi_moe_backward_gemms) */
    float gemm_each_ms[4];            /* each alone: dgrad of W2, of W13, dW2, dW13 */
    float step_turns_ms[TRAIN_IMPLS]; /* the two steps timed in turns; 0 unless both ran */
    double check; /* comet's dx against the baseline's, the worst element over its row's RMS (input
                   * set 0); -1 if not compared */
    /* comet's step keeping x rows, and on a twin handle whose config resends x, in turns (0
     * unless both ran); a saved state's bytes each way; the twin's dW13 bit-equal to comet's
     * (1), or not (0), or not compared (-1). */
    float resend_turns_ms[2];
    size_t saved_bytes[2];
    int resend_grads_equal;
} train_result_t;

#define SWEEP_MAX 16
typedef struct case_result {
    float ms[P_COUNT]; /* medians, slowest rank */
    double tflops;     /* expert GEMMs, per GPU */
    double check;      /* worst relative error of the sample tokens, -1 if not checked */
    /* The fused layer0, when run: */
    int l0_runs, l0_best;
    cometi_dispatch_knobs_t l0_knobs[SWEEP_MAX];
    float l0_ms[SWEEP_MAX], l0_gemm_alone_ms, l0_route_ms;
    float l0_alone_each[2], l1_alone_each[2]; /* each GEMM alone on the static split, then the shared counter */
    float l0_paired_ms; /* the best knobs again, timed in turns with the GEMM alone */
    double l0_diff;    /* activations against the baseline's, sampled rows */
    /* The fused layer1, when run: */
    int l1_runs, l1_best;
    cometi_combine_knobs_t l1_knobs[SWEEP_MAX];
    float l1_ms[SWEEP_MAX], l1_gemm_alone_ms, l1_paired_ms;
    float push_sum_ms; /* the push's owner's sum phase (its wait for the peers' rows included), 0 if not timed */
    float copy_gbs;    /* this GPU's copy rate on every SM (bytes copied per second: half its traffic) */
    double l1_diff;    /* y against the baseline's, every token */
    float public_ms;   /* comet_moe_forward on the fused path, its default knobs */
    /* The whole layer, each call one measurement (route, layer0, layer1), in turns on input
     * set 0: the sweeps' best settings of each layer, the cost model's, and the baseline. */
    float tuned_turns_ms, model_turns_ms, baseline_turns_ms;
    cometi_knobs_t model_knobs;
    float bound_cublas_ms; /* suite: the baseline's cuBLAS expert phase, in turns with the two below */
    float bound_baseline_ms; /* suite: the whole baseline, in turns with the same */
    float bound_whole_ms, bound_gemms_ms; /* suite: the whole layer (model's knobs) and our GEMM0 +
                                           * GEMM1 alone, in turns */
    double public_check; /* its y against the baseline's (input set 0), every token */
    train_result_t train; /* --train */
} case_result_t;

/* What one timed call runs. */
enum {
    L0_FUSED, L0_GEMM_ALONE, L0_GEMM_ALONE_DYNAMIC, L0_ROUTE_ALONE, /* on the inputs, rotating */
    L1_FUSED, L1_GEMM_ALONE, L1_GEMM_ALONE_DYNAMIC,                 /* on what layer0 left */
    WHOLE_BEST,   /* route, layer0 and layer1 with the given knobs, inputs rotating */
    WHOLE_MODEL,  /* the same with the cost model's knobs (`model`) */
    WHOLE_PUBLIC, /* comet_moe_forward on the fused path, inputs rotating */
    BASE_WHOLE,   /* comet_moe_forward on the baseline path, inputs rotating */
    BASE_EXPERTS, /* the baseline's cuBLAS GEMM0, SwiGLU and GEMM1 on its last call's rows */
    /* --train: forward and backward on a->impl; inputs, dy and saved states rotating: */
    TRAIN_FORWARD,   /* comet_moe_forward_train into the input set's saved state */
    TRAIN_BACKWARD,  /* comet_moe_backward of the input set's saved state, on its dy (each call after
                      * an untimed TRAIN_FORWARD: a backward consumes its saved state) */
    TRAIN_STEP,      /* the two back to back */
    BASE_TRAIN_STEP, /* the same on the baseline path (in turns with TRAIN_STEP) */
    BACKWARD_GEMMS,  /* cometi_moe_backward_gemms on the input set's saved state (a fused forward's,
                      * fresh as for TRAIN_BACKWARD) */
    RESEND_TRAIN_STEP /* TRAIN_STEP, fused, on the twin handle whose config resends x (tr->resend_*):
                       * its own saved states, the input set's x given to the backward */
};

/* What the training calls take beside the forward's args: the backward's args (dx,
 * d_topk_weights, bf16 weight gradients; its saved state and dy set per call), and per
 * input set a saved state (set i's training forward fills saved[i]) and a dy. */
typedef struct train_bufs {
    comet_moe_backward_args_t b;
    comet_moe_saved_t saved[NSETS];
    void *dy[NSETS];
    int gemm_mask; /* BACKWARD_GEMMS: which (cometi_moe_backward_gemms), 0 all */
    comet_moe_t resend_moe; /* RESEND_TRAIN_STEP's handle (config.resend_x = 1) and saved states */
    comet_moe_saved_t resend_saved[NSETS];
} train_bufs_t;

typedef struct timed_call {
    int what;
    comet_comm_t comm;
    comet_moe_t moe;
    cometi_dispatch_gemm_t *l0;
    cometi_gemm_combine_t *l1;
    comet_moe_args_t *a;
    void **x;
    int32_t **ids;
    float **w;
    const cometi_dispatch_knobs_t *k0;
    const cometi_combine_knobs_t *k1;
    const cometi_knobs_t *model; /* WHOLE_MODEL's knobs */
    train_bufs_t *tr;            /* the TRAIN_ and BACKWARD_GEMMS calls' */
} timed_call_t;

/* bench_timing.c */
float median(float *v, int n);
/* --fp8 (bench_fp8.c): the block-scaled FP8 layer beside the bf16 one, both fused, in turns,
 * at the case's tokens and 1, 16, 128; rows on rank 0; nonzero on a failure. */
int bench_fp8_case(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm,
                   const comet_moe_config_t *cfg, const char *label);
int allreduce(comet_comm_t comm, float *v, int n, ncclRedOp_t op);
int time_calls(const timed_call_t *c, int warmup, int iters, float *out);
int time_in_turns(const timed_call_t *base, const int *whats, int n, int rounds, float *med);
int try_call(const timed_call_t *c, int *served);
int best_in_turns(const timed_call_t *calls, const float *ms, int runs, int model, int rounds, float *fused_ms,
                  float *alone_ms, float *each);
int print_layer1_trace(comet_comm_t comm, const cometi_gemm_combine_t *l1, const cometi_combine_knobs_t *k);
int copy_rate(comet_comm_t comm, float *gbs);
int print_push_phases(const cometi_rank_ctx_t *ctx, comet_comm_t comm, cometi_dispatch_gemm_t *l0, cometi_gemm_combine_t *l1,
                      comet_moe_args_t *a, int iters, float gemm_alone_ms, float *sum_ms);
int print_tile_timelines(const cometi_rank_ctx_t *ctx, const timed_call_t *fused, unsigned long long **trace_slot,
                         const char *layer, const char *gemm);

/* bench_case.c */
int run_baseline_case(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm,
                      const comet_moe_config_t *cfg, const char *label, case_result_t *res);

/* bench_train.c */
int run_train(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm, comet_moe_t moe,
              const comet_moe_config_t *cfg, const char *label, const comet_moe_args_t *a, void **x,
              int32_t **ids, float **w, train_result_t *res);
void report_train(const cometi_rank_ctx_t *ctx, const tool_options_t *o, const struct cudaDeviceProp *prop,
                  const comet_moe_config_t *cfg, const char *label, const train_result_t *r, FILE *json,
                  int *records, int *failed_check);

/* cmd_bench.c */
void json_case_fields(FILE *json, const char *gpu, int ranks, const comet_moe_config_t *cfg,
                      const tool_options_t *o);

/* cmd_bandwidth.c */
int timed_copy(comet_comm_t comm, void *dst, const void *src, size_t bytes, int blocks, int reps, cudaEvent_t e0,
               cudaEvent_t e1, float *gbs);

#endif /* COMET_TOOLS_BENCH_H */
