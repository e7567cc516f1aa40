/*
 * tool.h - what the `comet` tool's files share: the parsed options and the bodies
 * that run on every rank.
 */
#ifndef COMET_TOOL_H
#define COMET_TOOL_H

#include <stdint.h>
#include <stdio.h>

#include "../harness/data.h"
#include "../harness/gpu.h"
#include "../harness/launch.h"
#include "../harness/reference.h"
#include "comm/plan.h"

#define TOOL_MAX_PRESETS 8

/* The tool's exit codes (main.c's header comment and `comet help` list them). */
enum {
    TOOL_EXIT_FAILED = 1, /* the run failed: a rank, a check (marked ! in its row) */
    TOOL_EXIT_USAGE = 2,  /* refused before the run: a flag, a value, a COMET_* variable */
    TOOL_EXIT_NO_GPU = 3  /* no usable GPU or NCCL: no driver, no Hopper GPU, too few, an NCCL comet cannot use */
};

/* In a rank's body: print the failure, hand it to the launcher as this rank's reason,
 * and return 1. */
#define FAIL_IF(cond, ...)                                                                        \
    do {                                                                                           \
        if (cond) {                                                                                \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            cometi_rank_reason(__VA_ARGS__);                                                       \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)
#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        FAIL_IF(e_ != cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                       \
    } while (0)

/* comet gemm's tables (--gemms): the forward's GEMMs, the backward's data gradients, its
 * weight gradients. */
enum { TOOL_GEMMS_FORWARD = 1, TOOL_GEMMS_DGRAD = 2, TOOL_GEMMS_WGRAD = 4, TOOL_GEMMS_ALL = 7 };

typedef struct tool_options {
    /* bench */
    const char *presets[TOOL_MAX_PRESETS]; /* names; explicit sizes when npresets == 0 */
    int npresets;
    int hidden, ffn, experts, top_k; /* explicit sizes */
    int tokens;                      /* per rank */
    int ep, tp;                      /* parallel layout; 0: EP = ranks, TP = 1 */
    cometi_routing_t routing;
    double skew;
    int run_baseline, run_comet;
    int suite;                       /* every preset x token count x routing, no sweeps */
    int warmup, iters;
    int check;                       /* float64 check of sample tokens */
    int trace;                       /* --trace: where the fused kernels' time goes, per SM */
    int train;                       /* --train: forward_train, backward and the step, per impl */
    int wgrad_cublaslt;              /* --fp8-wgrad-cublaslt: the FP8 layer's config.fp8_wgrad_cublaslt */
    const char *json;
    const char *tune_out;            /* comet tune: the tuning file the best settings go to */
    uint64_t seed;
    /* bandwidth */
    int mib;
    /* gemm */
    int sweep;                       /* --sweep: every variant of ours, a line each */
    int fp8;                         /* --fp8: the block-scaled FP8 forward GEMMs instead */
    unsigned gemms;                  /* --gemms: the tables timed, TOOL_GEMMS_* bits */
    /* both */
    int timeout_ms;
} tool_options_t;

/* rank.c: a rank body's first steps. Its GPU (cudaSetDevice(local_rank)), then its
 * communicator; 0, or the exit code to return, the failure printed and handed to the
 * launcher: TOOL_EXIT_NO_GPU where the GPU or the NCCL is not usable (cometi_no_gpu's
 * sentence, or comet_comm_create's COMET_NOT_SUPPORTED: an NCCL comet cannot use), else
 * TOOL_EXIT_FAILED. */
int rank_device(const cometi_rank_ctx_t *ctx);
int rank_comm(const cometi_rank_ctx_t *ctx, int timeout_ms, comet_comm_t *comm);

int bench_rank(const cometi_rank_ctx_t *ctx, void *arg);
int bandwidth_rank(const cometi_rank_ctx_t *ctx, void *arg);
int gemm_rank(const cometi_rank_ctx_t *ctx, void *arg);
int gemm_fp8_rank(const cometi_rank_ctx_t *ctx, void *arg);

/* cmd_gemm.c's measures, for its FP8 table (cmd_gemm_fp8.c) too: a GEMM run (0: done),
 * the median milliseconds of `iters` runs after `warmup` (the fastest and slowest where
 * lo, hi are given; *failed set by a failed run), and ||x - y|| / ||y|| over bf16 values. */
typedef int (*runner_t)(void *ctx, cudaStream_t s);
float gemm_time_ms(runner_t fn, void *ctx, int warmup, int iters, int *failed, float *lo, float *hi);
double gemm_rel_diff(const uint16_t *x, const uint16_t *y, size_t n);

#endif /* COMET_TOOL_H */
