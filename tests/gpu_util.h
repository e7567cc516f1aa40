/*
 * gpu_util.h - what the GPU tests share (defined in gpu_util.c): skipping without GPUs,
 * launching ranks, the CUDA_OK / COMET_OK checks, opening a communicator, and the MoE
 * fixture (the tiny preset with weights every rank can rebuild, the cases it runs, the
 * baseline's run checked against the float64 reference) with the error measure the fused
 * path is judged by.
 */
#ifndef COMET_GPU_UTIL_H
#define COMET_GPU_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/gpu.h"
#include "../harness/launch.h"
#include "testutil.h"

/* Skip (returning 0) unless `n` Hopper GPUs are visible. */
int have_gpus(int n);

/* cometi_launch_local, printing the launcher's report when a rank failed. */
int launch(int nranks, cometi_rank_main_t fn, void *arg, int timeout_s);

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            printf("%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));          \
            cometi_rank_reason("%s: %s", #call, cudaGetErrorString(e_));                           \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

#define COMET_OK(call, comm)                                                                       \
    do {                                                                                           \
        comet_status_t s_ = (call);                                                                \
        if (s_ != COMET_SUCCESS) {                                                                 \
            printf("%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, comet_status_string(s_),      \
                   comet_comm_last_error(comm));                                                   \
            cometi_rank_reason("%s: %s", #call, comet_comm_last_error(comm));                      \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Two ranks with the run's seed as their argument; a skip (saying why) without 2 GPUs.
 * For tests that need a second rank (a peer's error or absence, TP 2). */
int launch_two_seeded(cometi_rank_main_t fn, int timeout_s);

/* min(2, visible Hopper GPUs) ranks with the run's seed as their argument; a skip (saying
 * why) only without any GPU. For tests whose rank body holds at any world size. */
int launch_seeded(cometi_rank_main_t fn, int timeout_s);

/* Seconds on the monotonic clock. */
double now_s(void);

/* qsort's order of floats (timings, for their median). */
int cmp_float(const void *a, const void *b);

/* Whether two floats are the same bits, or both NaN (a scale or sum compared exactly). */
int same_float(float a, float b);

/* This rank's GPU and a communicator with the given timeout; prints why it failed. */
int open_comm(const cometi_rank_ctx_t *ctx, int timeout_ms, comet_comm_t *comm);

/* ---- the MoE fixture ---- */

typedef struct fixture {
    const cometi_rank_ctx_t *ctx;
    comet_comm_t comm;
    comet_moe_t moe;
    comet_moe_config_t cfg;
    int per, first;
    uint64_t seed;
    float *gate_up, *down;             /* all experts, host, bf16-rounded */
    void *d_gate_up, *d_gate, *d_up, *d_down;
    void *d_x, *d_y;
    int32_t *d_ids;
    float *d_w;
    double *ref;                       /* [max_tokens][hidden]: run_case's float64 reference */
    int skip_reference;                /* run_case: the baseline only, no reference */
} fixture_t;

/* Changes to the tiny preset (0: keep). */
typedef struct fixture_shape {
    int ffn, hidden, top_k, timeout_ms, tp;
} fixture_shape_t;

/* n random values in [-scale, scale), rounded to bf16: the bits in h, their values in f. */
void fill_bf16(float *f, uint16_t *h, size_t n, double scale, uint64_t *rng);

/* The tiny preset, with the changes of `shape` (NULL: none). */
int fixture_open(fixture_t *fx, const cometi_rank_ctx_t *ctx, uint64_t seed, const fixture_shape_t *shape);
void fixture_close(fixture_t *fx);


typedef struct moe_case {
    const char *name;
    cometi_routing_t routing;
    double skew;
    int tokens[2];       /* per rank */
    int separate_gate_up; /* weights as gate + up instead of the fused gate_up */
    int few_experts;     /* route only to experts 0, 1, 5 and 6 (top-k <= 4): the rest get no rows */
} moe_case_t;

/* Runs one case on this rank (the baseline) and checks it against the reference, unless
 * fx->skip_reference; plant_bad_id puts an id out of range at token 5, choice 1. */
int run_case(fixture_t *fx, const moe_case_t *c, uint64_t case_seed, int plant_bad_id,
             comet_status_t *status, double *rel_err);

/* The cases every MoE test runs (gpu_util.c; the size here lets tests count them). */
extern const moe_case_t cases[8];

/* The arguments run_case gave the baseline, for the fused path. */
comet_moe_args_t fused_args(const fixture_t *fx, const moe_case_t *c);

/* Device memory in use and host pages resident, read after the device is idle (soak
 * tests' growth). memory_mark: 0, or 1 when the device could not be read. */
typedef struct memory_mark {
    long long device_used;
    long host_pages;
} memory_mark_t;
int memory_mark(memory_mark_t *m);

/* The start of a missing-peer test: the fixture with ffn 256 (the fused path trains it)
 * and a 2 s timeout, one call's inputs in place for `c`, and that call's arguments on
 * the fused path in *a. */
int fixture_open_timed(fixture_t *fx, const cometi_rank_ctx_t *ctx, uint64_t seed, const moe_case_t *c,
                       comet_moe_args_t *a);

/* Squared error and norm of `got` (bf16 rows x cols) against `want` (bf16) or `ref`
 * (float64), added to *num and *den; the worst row's relative error raises *worst_row.
 * NaN or Inf in `got`, or an element past its bf16-derived bound (gpu_util.c), makes the
 * row's error infinite. */
void add_error(const uint16_t *got, const uint16_t *want, const double *ref, size_t rows, int cols,
               double *num, double *den, double *worst_row);
/* The same with the element's own share of its bound, elem_rel, stated by the caller
 * (add_error's is 2^-7). */
void add_error_rel(const uint16_t *got, const uint16_t *want, const double *ref, size_t rows, int cols,
                   double elem_rel, double *num, double *den, double *worst_row);

/* ---- the grouped GEMM's tests ---- */

/* This rank's GPU, and the host-mapped word where a stuck GEMM pipeline reports. */
int gemm_setup(const cometi_rank_ctx_t *ctx, cometi_async_error_t **host, cometi_async_error_t **dev);
/* After a GEMM run with the last wave's cut (tail_ws) and a tile timeline (`trace`, sms
 * rows on the device): its blocks took the plan's units, and the workspace's counters are
 * back at zero. 0, or 1 with the failure printed (`what` names the run). */
int check_cut_units(const unsigned long long *trace, int sms, const void *ws, int plan_units, const char *what);
/* Segments of the given sizes, each starting on a 128-row boundary as the MoE layout pads
 * them; returns the rows they span. */
int padded_segments(const int *sizes, int groups, cometi_segment_t *segs);

#endif /* COMET_GPU_UTIL_H */
