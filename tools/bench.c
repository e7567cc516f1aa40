/*
 * bench.c - the bodies of `comet bench` and `comet bandwidth`, run on every rank.
 *
 * bench: for each case, synthetic weights and inputs (hash-generated on the GPU, so
 * the host can rebuild any element), a float64 check of sample tokens, warm-up, then
 * timed calls with inputs rotated across sets larger than L2. Times are CUDA events
 * between phases; each phase's median is taken per rank and the slowest rank's is
 * reported. Rank 0 prints one row per implementation and writes JSON on request.
 *
 * bandwidth: every rank copies to the next rank's symmetric window at once (push:
 * remote stores) or from it (pull: remote loads), for several block counts.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "../src/internal.h"
#include "../src/baseline/baseline.h"
#include "../src/layer0.h"
#include "../src/layer1.h"
#include "../src/timeline.h"
#include "../src/tune.h"
#include "tool.h"

#define NSETS 3 /* input sets rotated between calls, so they do not sit in L2 */


static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static float median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof(float), cmp_float);
    return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

/* Seeds of the synthetic tensors; element indices are global, so any rank can rebuild
 * any element. */
typedef struct seeds {
    uint64_t gate_up, down, x[NSETS], routing[NSETS];
} seeds_t;

static seeds_t make_seeds(uint64_t seed)
{
    seeds_t s;
    s.gate_up = seed * 31 + 1;
    s.down = seed * 31 + 2;
    for (int i = 0; i < NSETS; i++) {
        s.x[i] = seed * 31 + 10 + i;
        s.routing[i] = seed * 31 + 20 + i;
    }
    return s;
}

/* y[t] for token t of `rank` in input set 0, in float64, rebuilding inputs and weights
 * element by element from their hashes. */
static void reference_token(const comet_moe_config_t *c, const seeds_t *s, int rank, int t, const int32_t *ids,
                            const float *w, double *y)
{
    const int H = c->hidden, F = c->ffn, M = c->max_tokens;
    const float sx = 1.0f, sgu = (float)(1.0 / sqrt(H)), sdn = (float)(1.0 / sqrt(F));
    double *x = malloc(sizeof(double) * H), *act = malloc(sizeof(double) * F);
    for (int h = 0; h < H; h++) x[h] = cometi_bf16_to_float(cometi_hash_bf16(s->x[0], ((uint64_t)rank * M + t) * H + h, sx));
    for (int h = 0; h < H; h++) y[h] = 0;
    for (int j = 0; j < c->top_k; j++) {
        const uint64_t e = (uint64_t)ids[(size_t)t * c->top_k + j];
        for (int f = 0; f < F; f++) {
            double g = 0, u = 0;
            const uint64_t gi = (e * 2 * F + f) * H, ui = (e * 2 * F + F + f) * H;
            for (int h = 0; h < H; h++) {
                g += cometi_bf16_to_float(cometi_hash_bf16(s->gate_up, gi + h, sgu)) * x[h];
                u += cometi_bf16_to_float(cometi_hash_bf16(s->gate_up, ui + h, sgu)) * x[h];
            }
            act[f] = cometi_swiglu(g, u);
        }
        for (int h = 0; h < H; h++) {
            double o = 0;
            const uint64_t di = (e * H + h) * F;
            for (int f = 0; f < F; f++) o += cometi_bf16_to_float(cometi_hash_bf16(s->down, di + f, sdn)) * act[f];
            y[h] += w[(size_t)t * c->top_k + j] * o;
        }
    }
    free(x);
    free(act);
}

static const char *routing_name(cometi_routing_t r)
{
    return r == COMETI_ROUTING_BALANCED ? "balanced" : r == COMETI_ROUTING_RANDOM ? "random" : "skewed";
}

enum { P_TOTAL, P_ROUTE, P_A2A_OUT, P_EXPERTS, P_A2A_BACK, P_COMBINE, P_LAYER0, P_LAYER1, P_COUNT };
static const char *phase_json[P_COUNT] = {"total", "route", "dispatch_a2a", "experts", "combine_a2a", "combine",
                                          "layer0_part", "layer1_part"};

#define SWEEP_MAX 16
typedef struct case_result {
    float ms[P_COUNT]; /* medians, slowest rank */
    double tflops;     /* expert GEMMs, per GPU */
    double check;      /* worst relative error of the sample tokens, -1 if not checked */
    /* The fused layer0, when run: */
    int l0_runs, l0_best;
    cometi_layer0_knobs_t l0_knobs[SWEEP_MAX];
    float l0_ms[SWEEP_MAX], l0_gemm_alone_ms, l0_route_ms;
    float l0_alone_each[2], l1_alone_each[2]; /* each GEMM alone on the static split, then the shared counter */
    float l0_paired_ms; /* the best knobs again, timed in turns with the GEMM alone */
    double l0_diff;    /* activations against the baseline's, sampled rows */
    /* The fused layer1, when run: */
    int l1_runs, l1_best;
    cometi_layer1_knobs_t l1_knobs[SWEEP_MAX];
    float l1_ms[SWEEP_MAX], l1_gemm_alone_ms, l1_paired_ms;
    float push_sum_ms; /* the push's owner's sum phase (its wait for the peers' rows included), 0 if not timed */
    float copy_gbs;    /* this GPU's copy rate on every SM (bytes copied per second: half its traffic) */
    double l1_diff;    /* y against the baseline's, every token */
    float whole_ms;    /* the whole fused layer (route, layer0, layer1) with the best knobs of each */
    float public_ms;   /* comet_moe_forward on the fused path, its default knobs */
    float tuned_turns_ms, model_turns_ms; /* the whole layer, sweeps' best against the model's, in turns */
    cometi_knobs_t model_knobs;
    float bound_cublas_ms; /* suite: the baseline's cuBLAS expert phase, in turns with the two below */
    float bound_baseline_ms; /* suite: the whole baseline, in turns with the same */
    float bound_whole_ms, bound_gemms_ms; /* suite: the whole layer (model's knobs) and our GEMM0 +
                                           * GEMM1 alone, in turns */
    double public_check; /* its y against the baseline's (input set 0), every token */
} case_result_t;

/* Max (or sum) over ranks of a few floats, through NCCL. */
static int allreduce(comet_comm_t comm, float *v, int n, ncclRedOp_t op)
{
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, sizeof(float) * n));
    CUDA_OK(cudaMemcpy(d, v, sizeof(float) * n, cudaMemcpyHostToDevice));
    ncclResult_t r = ncclAllReduce(d, d, n, ncclFloat32, op, comet_comm_nccl(comm), 0);
    FAIL_IF(r != ncclSuccess, "ncclAllReduce: %s", ncclGetErrorString(r));
    CUDA_OK(cudaMemcpy(v, d, sizeof(float) * n, cudaMemcpyDeviceToHost));
    cudaFree(d);
    return 0;
}

static const char *dispatch_mode_name(int mode) { return mode == COMETI_DISPATCH_STORES ? "stores" : "bulk"; }

/* ||got - want|| / ||want|| over n bf16 values on the device (infinite if got has a NaN
 * or Inf), the worst over ranks. */
static int y_error(comet_comm_t comm, const void *got_dev, const void *want_dev, size_t n, double *out)
{
    uint16_t *want = malloc(2 * n + 2), *got = malloc(2 * n + 2);
    CUDA_OK(cudaMemcpy(want, want_dev, 2 * n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got, got_dev, 2 * n, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double u = cometi_bf16_to_float(want[i]), v = cometi_bf16_to_float(got[i]);
        num += isfinite(v) ? (v - u) * (v - u) : INFINITY;
        den += u * u;
    }
    free(want), free(got);
    float diff = den > 0 ? (float)sqrt(num / den) : 0;
    if (!isfinite(diff)) diff = INFINITY;
    if (allreduce(comm, &diff, 1, ncclMax)) return 1;
    *out = diff;
    return 0;
}

/* What one timed call runs. */
enum {
    L0_FUSED, L0_GEMM_ALONE, L0_GEMM_ALONE_DYNAMIC, L0_ROUTE_ALONE, /* on the inputs, rotating */
    L1_FUSED, L1_GEMM_ALONE, L1_GEMM_ALONE_DYNAMIC,                 /* on what layer0 left */
    WHOLE_BEST,   /* route, layer0 and layer1 with the given knobs, inputs rotating */
    WHOLE_MODEL,  /* the same with the cost model's knobs (`model`) */
    WHOLE_PUBLIC, /* comet_moe_forward on the fused path, inputs rotating */
    BASE_WHOLE,   /* comet_moe_forward on the baseline path, inputs rotating */
    BASE_EXPERTS  /* the baseline's cuBLAS GEMM0, SwiGLU and GEMM1 on its last call's rows */
};

typedef struct timed_call {
    int what;
    comet_comm_t comm;
    comet_moe_t moe;
    cometi_layer0_t *l0;
    cometi_layer1_t *l1;
    comet_moe_args_t *a;
    void **x;
    int32_t **ids;
    float **w;
    const cometi_layer0_knobs_t *k0;
    const cometi_layer1_knobs_t *k1;
    const cometi_knobs_t *model; /* WHOLE_MODEL's knobs */
} timed_call_t;

/* Call number n (from 0, warm-up included). */
static comet_status_t run_timed_call(const timed_call_t *c, int n)
{
    comet_moe_args_t *a = c->a;
    if (c->what < L1_FUSED || (c->what >= WHOLE_BEST && c->what != BASE_EXPERTS)) {
        const int set = n % NSETS;
        a->x = c->x[set], a->topk_ids = c->ids[set], a->topk_weights = c->w[set];
    }
    switch (c->what) {
    case L0_FUSED: return cometi_layer0_run(c->comm, c->l0, a, c->k0, 0);
    case L0_GEMM_ALONE:
    case L0_GEMM_ALONE_DYNAMIC: return cometi_layer0_gemm_only(c->comm, c->l0, a, c->what == L0_GEMM_ALONE_DYNAMIC, 0);
    case L0_ROUTE_ALONE:
        return cometi_route_dev_run(c->comm, &c->l0->route, a->topk_ids, a->topk_weights, a->num_tokens,
                                    c->l0->top_k, 0, NULL, 0);
    case L1_FUSED: return cometi_layer1_run(c->comm, c->l1, c->l0, a, c->k1, 0);
    case L1_GEMM_ALONE:
    case L1_GEMM_ALONE_DYNAMIC:
        return cometi_layer1_gemm_only(c->comm, c->l1, c->l0, a, c->what == L1_GEMM_ALONE_DYNAMIC, 0);
    case BASE_EXPERTS: return cometi_baseline_experts(c->moe, c->moe->baseline, a, 0);
    case BASE_WHOLE: {
        comet_moe_args_t b = *a;
        b.impl = COMET_IMPL_BASELINE;
        comet_status_t st = comet_moe_forward(c->moe, &b, 0);
        if (st != COMET_SUCCESS) fprintf(stderr, "comet_moe_forward (baseline): %s\n", comet_moe_last_error(c->moe));
        return st;
    }
    case WHOLE_BEST: {
        comet_status_t st = cometi_layer0_run(c->comm, c->l0, a, c->k0, 0);
        return st != COMET_SUCCESS ? st : cometi_layer1_run(c->comm, c->l1, c->l0, a, c->k1, 0);
    }
    case WHOLE_MODEL: {
        comet_status_t st = cometi_layer0_run(c->comm, c->l0, a, &c->model->l0, 0);
        return st != COMET_SUCCESS ? st : cometi_layer1_run(c->comm, c->l1, c->l0, a, &c->model->l1, 0);
    }
    default: {
        comet_status_t st = comet_moe_forward(c->moe, a, 0);
        if (st != COMET_SUCCESS) fprintf(stderr, "comet_moe_forward: %s\n", comet_moe_last_error(c->moe));
        return st;
    }
    }
}

/* Median ms of `iters` calls after `warmup` more, each after a device barrier (launch skew
 * is not the layer's; for layer1 run again on one route, it is also what orders the
 * slots' reuse), then the device-side failure check. */
static int time_calls(const timed_call_t *c, int warmup, int iters, float *out)
{
    cudaEvent_t e0, e1;
    float *t = malloc(sizeof(float) * iters);
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int it = -warmup; it < iters; it++) {
        FAIL_IF(cometi_barrier(c->comm, 0) != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(c->comm));
        cudaEventRecord(e0, 0);
        const comet_status_t st = run_timed_call(c, it + warmup);
        cudaEventRecord(e1, 0);
        FAIL_IF(st != COMET_SUCCESS, "timed call %d: %s", c->what, comet_comm_last_error(c->comm));
        cudaEventSynchronize(e1);
        if (it >= 0) cudaEventElapsedTime(&t[it], e0, e1);
    }
    *out = median(t, iters);
    free(t);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    const comet_status_t st = comet_comm_get_async_error(c->comm);
    FAIL_IF(st != COMET_SUCCESS, "timed call %d: %s", c->what, comet_comm_last_error(c->comm));
    return 0;
}

/* The calls `whats` (on `base`'s objects, input set 0) taken in turns `rounds` times, so
 * that clock drift over the run (a few percent: docs/PERF.md) falls on all of them alike;
 * med[i] is the slowest rank's median of whats[i]. Each round takes them in a shuffled
 * order, the same on every rank (the calls are collective): a call's clocks depend on the
 * call before it (one that waits on NVLink lets the GPU cool), and a fixed order would
 * give each call the same predecessor every round. */
#define TURNS_MAX 8

static int time_in_turns(const timed_call_t *base, const int *whats, int n, int rounds, float *med)
{
    FAIL_IF(n < 1 || n > TURNS_MAX, "time_in_turns: %d calls (1..%d)", n, TURNS_MAX);
    float *t = malloc(sizeof(float) * n * rounds);
    uint64_t rng = 0x636f6d6574ull; /* the same seed on every rank */
    for (int i = 0; i < rounds; i++) {
        int order[TURNS_MAX];
        for (int j = 0; j < n; j++) order[j] = j;
        for (int j = n - 1; j > 0; j--) { /* Fisher-Yates */
            const int r = (int)(cometi_rand_next(&rng) % (uint64_t)(j + 1)), tmp = order[j];
            order[j] = order[r];
            order[r] = tmp;
        }
        for (int j = 0; j < n; j++) {
            const int v = order[j];
            timed_call_t c = *base;
            c.what = whats[v];
            if (time_calls(&c, 0, 1, &t[v * rounds + i])) {
                free(t);
                return 1;
            }
        }
    }
    for (int v = 0; v < n; v++) med[v] = median(t + v * rounds, rounds);
    free(t);
    return allreduce(base->comm, med, n, ncclMax);
}

/* A fused call against our GEMM alone, in turns; the GEMM alone on the faster of its two
 * schedules (the static split is up to 4% faster on some shapes; the fused kernels take
 * tiles from the shared counter). `fused->what` is L0_FUSED or L1_FUSED; the two after it
 * are that GEMM alone on each schedule, whose times go to each[0] (static) and each[1]. */
static int fused_vs_alone(const timed_call_t *fused, int rounds, float *fused_ms, float *alone_ms, float *each)
{
    const int whats[3] = {fused->what, fused->what + 1, fused->what + 2};
    float med[3];
    if (time_in_turns(fused, whats, 3, rounds, med)) return 1;
    *fused_ms = med[0];
    *alone_ms = med[1] < med[2] ? med[1] : med[2];
    each[0] = med[1], each[1] = med[2];
    return 0;
}

/* A sweep's calls run back to back, each setting at the clocks its own power draw allows
 * (the GPUs run at their power limit), so its order can be off (docs/PERF.md V4, Y8): the
 * sweep's two best settings and the cost model's are timed again, each in turns with the
 * GEMM alone, and the lowest ratio wins. `runs` and `ms` are the sweep's, `model` the
 * cost model's run in it (or -1); `calls[i]` times run i. Returns the winning run, -1 on
 * failure; its times in *fused_ms, *alone_ms and each[2] (maxima over ranks, so every
 * rank picks the same). */
static int best_in_turns(const timed_call_t *calls, const float *ms, int runs, int model, int rounds, float *fused_ms,
                         float *alone_ms, float *each)
{
    int cand[3] = {-1, -1, model}, win = -1;
    for (int i = 0; i < runs; i++) { /* the two fastest back to back */
        if (cand[0] < 0 || ms[i] < ms[cand[0]]) cand[1] = cand[0], cand[0] = i;
        else if (cand[1] < 0 || ms[i] < ms[cand[1]]) cand[1] = i;
    }
    for (int c = 0; c < 3; c++) {
        const int r = cand[c];
        if (r < 0 || (c == 2 && (r == cand[0] || r == cand[1]))) continue;
        float f, al, e[2];
        if (fused_vs_alone(&calls[r], rounds, &f, &al, e)) return -1;
        if (win >= 0 && f / al >= *fused_ms / *alone_ms) continue;
        win = r, *fused_ms = f, *alone_ms = al, each[0] = e[0], each[1] = e[1];
    }
    return win;
}

static int time_layer0(comet_comm_t comm, cometi_layer0_t *l0, comet_moe_args_t *a, void **x, int32_t **ids,
                       float **w, const cometi_layer0_knobs_t *knobs, int warmup, int iters, int what,
                       float *out)
{
    const timed_call_t c = {what, comm, NULL, l0, NULL, a, x, ids, w, knobs, NULL, NULL};
    return time_calls(&c, warmup, iters, out);
}

/* Layer1 (or GEMM1 alone) on what layer0 left, or with WHOLE_BEST the whole fused layer
 * (layer0 with `k0`, then layer1). */
static int time_layer1(comet_comm_t comm, cometi_layer0_t *l0, cometi_layer1_t *l1, comet_moe_args_t *a, void **x,
                       int32_t **ids, float **w, const cometi_layer0_knobs_t *k0, const cometi_layer1_knobs_t *k1,
                       int warmup, int iters, int what, float *out)
{
    const timed_call_t c = {what, comm, NULL, l0, l1, a, x, ids, w, k0, k1, NULL};
    return time_calls(&c, warmup, iters, out);
}

/* A layer1 setting as the sweep line names it: "push" (or "push-static"), else combine
 * blocks x splits, "t" when the last split's combine runs after the GEMM on every SM. */
static const char *layer1_name(const cometi_layer1_knobs_t *k, char *buf, size_t len)
{
    if (k->push) snprintf(buf, len, "%s", k->dynamic_tiles ? "push" : "push-static");
    else snprintf(buf, len, "%dx%d%s", k->combine_blocks, k->n_splits, k->tail || !k->combine_blocks ? "t" : "");
    return buf;
}

/* COMET_TRACE=1: the last layer1 call's combine timeline on this rank, in us from the
 * first combine block's start (or the tail kernel's, with no combine blocks), median over
 * the blocks: the combine blocks' splits, then the tail kernel's. */
static int print_layer1_trace(comet_comm_t comm, const cometi_layer1_t *l1, const cometi_layer1_knobs_t *k)
{
    const int sms = comm->sm_count, n = COMETI_COMBINE_TRACE, cb = k->combine_blocks;
    const int kernel_splits = cb ? k->n_splits - (k->tail != 0) : 0;
    unsigned long long *t = malloc(sizeof(unsigned long long) * n * 2 * sms), t0 = ~0ull;
    CUDA_OK(cudaMemcpy(t, l1->trace, sizeof(unsigned long long) * n * 2 * sms, cudaMemcpyDeviceToHost));
    const unsigned long long *tail = t + (size_t)n * sms;
    for (int b = 0; b < (cb ? cb : sms); b++) t0 = (cb ? t : tail)[b * n] < t0 ? (cb ? t : tail)[b * n] : t0;
    float *v = malloc(sizeof(float) * sms);
#define EVENT_US(rows, blocks, e) \
    (({ for (int b = 0; b < (blocks); b++) v[b] = (float)((rows)[b * n + (e)] - t0) / 1e3f; }), median(v, (blocks)))
    printf("  layer1 timeline, us (rank 0, medians over blocks):");
    if (cb) printf(" %d combine blocks: records pulled %.0f", cb, EVENT_US(t, cb, 1));
    for (int s = 0; s < kernel_splits && s < 8; s++)
        printf(" | split %d: in C %.0f, sent %.0f, home %.0f, summed %.0f", s, EVENT_US(t, cb, 2 + 4 * s),
               EVENT_US(t, cb, 3 + 4 * s), EVENT_US(t, cb, 4 + 4 * s), EVENT_US(t, cb, 5 + 4 * s));
    if (cb) printf(" | end %.0f", EVENT_US(t, cb, n - 1));
    if (kernel_splits < k->n_splits) {
        printf(" || tail kernel on %d SMs: start %.0f", sms, EVENT_US(tail, sms, 0));
        for (int s = kernel_splits; s < k->n_splits && s < 8; s++)
            printf(" | split %d: sent %.0f, home %.0f, summed %.0f", s, EVENT_US(tail, sms, 3 + 4 * s),
                   EVENT_US(tail, sms, 4 + 4 * s), EVENT_US(tail, sms, 5 + 4 * s));
        printf(" | end %.0f", EVENT_US(tail, sms, n - 1));
    }
    printf("\n");
#undef EVENT_US
    free(t), free(v);
    return 0;
}

/* GB/s of the median of `reps` copies of `bytes`, each after a device barrier: by `blocks`
 * SMs (cometi_copy), or with blocks 0 by the copy engine (cudaMemcpyAsync, no SM). */
static int timed_copy(comet_comm_t comm, void *dst, const void *src, size_t bytes, int blocks, int reps,
                      cudaEvent_t e0, cudaEvent_t e1, float *gbs)
{
    float t[16];
    FAIL_IF(reps < 1 || reps > 16, "timed_copy: %d repetitions (1..16)", reps);
    for (int r = 0; r < reps; r++) {
        comet_status_t st = cometi_barrier(comm, 0);
        FAIL_IF(st != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(comm));
        CUDA_OK(cudaEventRecord(e0, 0));
        if (blocks) {
            st = cometi_copy(comm->err, dst, src, bytes, blocks, 0);
            FAIL_IF(st != COMET_SUCCESS, "copy: %s", comm->err);
        } else {
            CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0));
        }
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        CUDA_OK(cudaEventElapsedTime(&t[r], e0, e1));
    }
    *gbs = (float)(bytes / (median(t, reps) * 1e-3) / 1e9);
    return 0;
}

/* This GPU's memory rate: 256 MiB copied on every SM, median of 5, the slowest rank's. A
 * floor for the memory-bound kernels beside the GEMMs (the owner's sum). */
static int copy_rate(comet_comm_t comm, float *gbs)
{
    const size_t bytes = (size_t)256 << 20;
    void *buf;
    CUDA_OK(cudaMalloc(&buf, 2 * bytes));
    CUDA_OK(cudaMemset(buf, 0, 2 * bytes));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    const int failed = timed_copy(comm, (char *)buf + bytes, buf, bytes, comm->sm_count, 5, e0, e1, gbs);
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaFree(buf);
    if (failed) return 1;
    float neg = -*gbs;
    if (allreduce(comm, &neg, 1, ncclMax)) return 1;
    *gbs = -neg;
    return 0;
}

/* Where the push's time goes: its destinations kernel, GEMM1 with the push epilogue (beside
 * GEMM1 alone, timed in turns before), the owner's sum; medians of `iters` calls, the
 * slowest rank's. */
static int print_push_phases(const cometi_rank_ctx_t *ctx, comet_comm_t comm, cometi_layer0_t *l0, cometi_layer1_t *l1,
                             comet_moe_args_t *a, int iters, float gemm_alone_ms, float *sum_ms)
{
    const cometi_layer1_knobs_t push = {0, 1, 1, 0, 1};
    cudaEvent_t marks[4];
    float *t[3], med[3];
    for (int i = 0; i < 4; i++) CUDA_OK(cudaEventCreate(&marks[i]));
    for (int i = 0; i < 3; i++) t[i] = malloc(sizeof(float) * iters);
    l1->push_marks = marks;
    for (int it = 0; it < iters; it++) {
        FAIL_IF(cometi_barrier(comm, 0) != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(comm));
        comet_status_t st = cometi_layer1_run(comm, l1, l0, a, &push, 0);
        FAIL_IF(st != COMET_SUCCESS, "layer1 push: %s", comet_comm_last_error(comm));
        CUDA_OK(cudaEventSynchronize(marks[3]));
        for (int i = 0; i < 3; i++) CUDA_OK(cudaEventElapsedTime(&t[i][it], marks[i], marks[i + 1]));
    }
    l1->push_marks = NULL;
    FAIL_IF(comet_comm_get_async_error(comm) != COMET_SUCCESS, "layer1 push: %s", comet_comm_last_error(comm));
    for (int i = 0; i < 3; i++) med[i] = median(t[i], iters), free(t[i]);
    for (int i = 0; i < 4; i++) cudaEventDestroy(marks[i]);
    if (allreduce(comm, med, 3, ncclMax)) return 1;
    *sum_ms = med[2];
    if (ctx->rank == 0)
        printf("  push phases (median ms, slowest rank): destinations %.3f, GEMM1 with the push epilogue %.3f (GEMM1 "
               "alone %.3f, in turns), the owner's sum with its wait for the peers' rows %.3f\n", med[0], med[1], gemm_alone_ms, med[2]);
    return 0;
}

/* COMET_TRACE=1: where the fused kernel's time goes against our GEMM alone's (on the
 * fused kernel's schedule, the shared counter): each the last of three calls with the
 * GEMM kernel's tile timeline on (`*trace_slot`: layer0's or layer1's), cut per SM into
 * launch, dispatch, row waits, tiles and tail (src/timeline.h). Every rank prints its own
 * line: the ranks' routes differ. */
static int print_tile_timelines(const cometi_rank_ctx_t *ctx, const timed_call_t *fused,
                                unsigned long long **trace_slot, const char *layer, const char *gemm)
{
    const int sms = fused->comm->sm_count;
    const size_t bytes = sizeof(unsigned long long) * COMETI_TILE_TRACE_WORDS * sms;
    unsigned long long *dev, *host = malloc(bytes);
    FAIL_IF(!host, "out of host memory");
    CUDA_OK(cudaMalloc((void **)&dev, bytes));
    cometi_timeline_t s[2];
    for (int i = 0; i < 2; i++) {
        timed_call_t c = *fused;
        c.what = i ? fused->what + 2 : fused->what; /* L0/L1_GEMM_ALONE_DYNAMIC */
        float ms;
        CUDA_OK(cudaMemset(dev, 0, bytes));
        *trace_slot = dev;
        const int failed = time_calls(&c, 2, 1, &ms);
        *trace_slot = NULL;
        if (failed) return 1;
        CUDA_OK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
        char err[COMETI_ERR_LEN];
        FAIL_IF(cometi_timeline_summarize(err, host, sms, &s[i]) != COMET_SUCCESS, "%s tile timeline: %s", layer, err);
    }
    printf("  %s timeline, rank %d, us per SM: fused kernel %.0f = launch %.1f + dispatch %.1f + row waits %.1f "
           "(first tile %.1f) + tiles %.0f (%lld, %.2f each) + tail %.1f | %s alone %.0f = launch %.1f + tiles %.0f (%lld, %.2f each) + "
           "tail %.1f%s\n", layer, ctx->rank, s[0].span_us, s[0].launch_us, s[0].dispatch_us, s[0].wait_us,
           s[0].first_wait_us, s[0].tiles_us, s[0].tiles, s[0].tile_us, s[0].tail_us, gemm, s[1].span_us, s[1].launch_us,
           s[1].tiles_us, s[1].tiles, s[1].tile_us, s[1].tail_us,
           s[0].truncated || s[1].truncated ? " (some blocks took more tiles than their rows hold)" : "");
    fflush(stdout);
    cudaFree(dev);
    free(host);
    return 0;
}

/* The fused layer1 on the rows layer0 left (input set 0, whose baseline output is in
 * a->y): a sweep of combine blocks x column splits, our GEMM1 alone in turns with the
 * best, y against the baseline's on every token; then the whole fused layer. */
static int run_layer1(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm,
                      const comet_moe_config_t *cfg, const char *label, comet_moe_args_t *a, cometi_layer0_t *l0,
                      void **x, int32_t **ids, float **w, case_result_t *res)
{
    /* {combine blocks, splits, dynamic tiles, tail, push}: first the GEMM then the combine on
     * every SM (no overlap), then the push (rows sent home from GEMM1's epilogue, on either
     * tile schedule), then combine blocks beside the GEMM with the last split's combine on
     * every SM after it, then a few without that tail. */
    static const cometi_layer1_knobs_t sweep[] = {
        {0, 1, 1, 1, 0},  {0, 1, 1, 0, 1},  {0, 1, 0, 0, 1},  {4, 2, 1, 1, 0},  {4, 4, 1, 1, 0},
        {8, 2, 1, 1, 0},  {8, 4, 1, 1, 0},  {16, 2, 1, 1, 0}, {16, 4, 1, 1, 0}, {24, 2, 1, 1, 0},
        {24, 4, 1, 1, 0}, {8, 4, 1, 0, 0},  {16, 2, 1, 0, 0}, {24, 2, 1, 0, 0}};
    const int H = cfg->hidden, M = cfg->max_tokens, tiles = H / cometi_gemm_tile_n(H);
    cometi_layer1_t l1;
    comet_status_t st = cometi_layer1_create(comm, cfg, l0, &l1);
    FAIL_IF(st != COMET_SUCCESS, "layer1 (%s): %s", label, comet_comm_last_error(comm));
    void *y_base = a->y, *y;
    CUDA_OK(cudaMalloc(&y, (size_t)M * H * 2 + 16));
    a->y = y;
    if (ctx->rank == 0) fprintf(stderr, "[bench] %s: fused layer1, combine blocks x splits sweep\n", label);
    res->l1_runs = 0;
    res->l1_best = 0;
    /* The sweep, then the cost model's setting if the sweep lacks it. */
    cometi_knobs_t model;
    cometi_model_knobs(cfg, ctx->nranks, comm->sm_count, &model);
    const size_t listed = sizeof(sweep) / sizeof(sweep[0]);
    int model_run = -1;
    for (size_t i = 0; i <= listed && res->l1_runs < SWEEP_MAX; i++) {
        const cometi_layer1_knobs_t *k = i < listed ? &sweep[i] : &model.l1;
        if (i == listed && model_run >= 0) break;
        if (tiles % k->n_splits) continue;
        if (cfg->tp_size > 1 && !k->push) continue; /* only the push sums TP partials */
        if (!memcmp(k, &model.l1, sizeof(*k))) model_run = res->l1_runs;
        float ms;
        if (time_layer1(comm, l0, &l1, a, x, ids, w, NULL, k, o->warmup, o->iters, L1_FUSED, &ms)) return 1;
        if (allreduce(comm, &ms, 1, ncclMax)) return 1;
        res->l1_knobs[res->l1_runs] = *k;
        res->l1_ms[res->l1_runs] = ms;
        if (ms < res->l1_ms[res->l1_best]) res->l1_best = res->l1_runs;
        res->l1_runs++;
    }
    timed_call_t calls[SWEEP_MAX];
    for (int i = 0; i < res->l1_runs; i++)
        calls[i] = (timed_call_t){L1_FUSED, comm, NULL, l0, &l1, a, x, ids, w, NULL, &res->l1_knobs[i], NULL};
    res->l1_best = best_in_turns(calls, res->l1_ms, res->l1_runs, model_run, o->iters, &res->l1_paired_ms,
                                 &res->l1_gemm_alone_ms, res->l1_alone_each);
    if (res->l1_best < 0) return 1;
    const cometi_layer1_knobs_t *best = &res->l1_knobs[res->l1_best];
    if (!o->suite && print_push_phases(ctx, comm, l0, &l1, a, o->iters, res->l1_gemm_alone_ms, &res->push_sum_ms))
        return 1;
    if (!o->suite && copy_rate(comm, &res->copy_gbs)) return 1;
    if (getenv("COMET_TRACE") &&
        print_tile_timelines(ctx, &calls[res->l1_best], &l1.tile_trace, "layer1", "GEMM1"))
        return 1;
    /* y on poisoned output against the baseline's, every token. */
    CUDA_OK(cudaMemset(y, 0xff, (size_t)M * H * 2));
    FAIL_IF(cometi_barrier(comm, 0) != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(comm));
    st = cometi_layer1_run(comm, &l1, l0, a, best, 0);
    FAIL_IF(st != COMET_SUCCESS, "layer1 (%s): %s", label, comet_comm_last_error(comm));
    CUDA_OK(cudaDeviceSynchronize());
    st = comet_comm_get_async_error(comm);
    FAIL_IF(st != COMET_SUCCESS, "layer1 (%s): %s", label, comet_comm_last_error(comm));
    if (getenv("COMET_TRACE") && !best->push && ctx->rank == 0 && print_layer1_trace(comm, &l1, best)) return 1;
    if (y_error(comm, y, y_base, (size_t)M * H, &res->l1_diff)) return 1;
    /* The whole fused layer, inputs rotating as in the baseline's timing. */
    if (ctx->rank == 0) fprintf(stderr, "[bench] %s: the whole fused layer\n", label);
    if (time_layer1(comm, l0, &l1, a, x, ids, w, &res->l0_knobs[res->l0_best], best, o->warmup, o->iters, WHOLE_BEST,
                    &res->whole_ms))
        return 1;
    if (allreduce(comm, &res->whole_ms, 1, ncclMax)) return 1;
    /* What `comet tune` writes against what the cost model picks, in turns on one input set. */
    const timed_call_t pair = {WHOLE_BEST, comm, NULL, l0, &l1, a, x, ids, w, &res->l0_knobs[res->l0_best], best,
                               &model};
    const int whats[2] = {WHOLE_BEST, WHOLE_MODEL};
    float med[2];
    if (time_in_turns(&pair, whats, 2, o->iters, med)) return 1;
    res->tuned_turns_ms = med[0], res->model_turns_ms = med[1];
    res->model_knobs = model;
    a->y = y_base;
    cudaFree(y);
    cometi_layer1_destroy(comm, &l1);
    return 0;
}

/* The fused layer0 on the same inputs: a sweep of dispatch-block counts, our GEMM0 alone
 * on the same rows, and its activations against the baseline's on sampled rows. */
static int run_layer0(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm, comet_moe_t moe,
                      const comet_moe_config_t *cfg, const char *label, comet_moe_args_t *a, void **x,
                      int32_t **ids, float **w, case_result_t *res)
{
    /* Bulk copies from 2 to 24 blocks (TP copies every row twice); the store copy where it
     * did best before (docs/PERF.md). */
    static const cometi_layer0_knobs_t sweep[] = {
        {2, COMETI_DISPATCH_BULK, 0},  {3, COMETI_DISPATCH_BULK, 0},  {4, COMETI_DISPATCH_BULK, 0},
        {6, COMETI_DISPATCH_BULK, 0},  {8, COMETI_DISPATCH_BULK, 0},  {12, COMETI_DISPATCH_BULK, 0},
        {16, COMETI_DISPATCH_BULK, 0}, {20, COMETI_DISPATCH_BULK, 0}, {24, COMETI_DISPATCH_BULK, 0},
        {4, COMETI_DISPATCH_STORES, 0}, {8, COMETI_DISPATCH_STORES, 0}};
    cometi_layer0_t l0;
    comet_status_t st = cometi_layer0_create(comm, cfg, &l0);
    FAIL_IF(st != COMET_SUCCESS, "layer0 (%s): %s", label, comet_comm_last_error(comm));
    if (ctx->rank == 0) fprintf(stderr, "[bench] %s: fused layer0, dispatch blocks sweep\n", label);
    res->l0_runs = 0;
    res->l0_best = 0;
    /* The sweep, then the cost model's setting if the sweep lacks it. */
    cometi_knobs_t model;
    cometi_model_knobs(cfg, ctx->nranks, comm->sm_count, &model);
    const size_t listed = sizeof(sweep) / sizeof(sweep[0]);
    int model_run = -1;
    for (size_t i = 0; i <= listed && res->l0_runs < SWEEP_MAX; i++) {
        const cometi_layer0_knobs_t *k = i < listed ? &sweep[i] : &model.l0;
        if (i == listed && model_run >= 0) break;
        if (!memcmp(k, &model.l0, sizeof(*k))) model_run = res->l0_runs;
        float ms;
        if (time_layer0(comm, &l0, a, x, ids, w, k, o->warmup, o->iters, L0_FUSED, &ms)) return 1;
        if (allreduce(comm, &ms, 1, ncclMax)) return 1;
        res->l0_knobs[res->l0_runs] = *k;
        res->l0_ms[res->l0_runs] = ms;
        if (ms < res->l0_ms[res->l0_best]) res->l0_best = res->l0_runs;
        res->l0_runs++;
    }
    /* The ratio that matters, fused against our GEMM alone, from calls taken in turns. */
    timed_call_t calls[SWEEP_MAX];
    for (int i = 0; i < res->l0_runs; i++)
        calls[i] = (timed_call_t){L0_FUSED, comm, NULL, &l0, NULL, a, x, ids, w, &res->l0_knobs[i], NULL, NULL};
    res->l0_best = best_in_turns(calls, res->l0_ms, res->l0_runs, model_run, o->iters, &res->l0_paired_ms,
                                 &res->l0_gemm_alone_ms, res->l0_alone_each);
    if (res->l0_best < 0) return 1;
    if (getenv("COMET_TRACE") &&
        print_tile_timelines(ctx, &calls[res->l0_best], &l0.tile_trace, "layer0", "GEMM0"))
        return 1;
    /* Same inputs through both paths; compare up to 64 rows at each end of every segment. */
    a->x = x[0], a->topk_ids = ids[0], a->topk_weights = w[0];
    st = comet_moe_forward(moe, a, 0);
    FAIL_IF(st != COMET_SUCCESS, "forward (%s): %s", label, comet_moe_last_error(moe));
    st = cometi_layer0_run(comm, &l0, a, &res->l0_knobs[res->l0_best], 0);
    FAIL_IF(st != COMET_SUCCESS, "layer0 (%s): %s", label, comet_comm_last_error(comm));
    CUDA_OK(cudaDeviceSynchronize());
    const void *b_recv, *b_act;
    cometi_baseline_buffers(moe->baseline, &b_recv, &b_act);
    const int per = l0.experts_per_group, F = l0.ffn;
    cometi_segment_t *segs = malloc(sizeof(cometi_segment_t) * per);
    CUDA_OK(cudaMemcpy(segs, l0.route.plan.local_segs, sizeof(cometi_segment_t) * per, cudaMemcpyDeviceToHost));
    uint16_t *want = malloc((size_t)64 * F * 2), *got = malloc((size_t)64 * F * 2);
    double num = 0, den = 0;
    for (int le = 0; le < per; le++) {
        for (int end = 0; end < 2; end++) {
            int rows = segs[le].rows < 64 ? segs[le].rows : 64;
            size_t first = (size_t)segs[le].start + (end ? segs[le].rows - rows : 0);
            CUDA_OK(cudaMemcpy(want, (const char *)b_act + first * F * 2, (size_t)rows * F * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(got, (const char *)l0.act + first * F * 2, (size_t)rows * F * 2, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < (size_t)rows * F; i++) {
                double u = cometi_bf16_to_float(want[i]), v = cometi_bf16_to_float(got[i]);
                num += isfinite(v) ? (v - u) * (v - u) : INFINITY;
                den += u * u;
            }
        }
    }
    float diff = den > 0 ? (float)sqrt(num / den) : 0;
    if (!isfinite(diff)) diff = INFINITY;
    if (allreduce(comm, &diff, 1, ncclMax)) return 1;
    res->l0_diff = diff;
    /* Layer1 on what this layer0 left (set 0), then the whole layer. */
    if (run_layer1(ctx, o, comm, cfg, label, a, &l0, x, ids, w, res)) return 1;
    /* The route alone, last: it raises the arrival totals the next fused call would wait for,
     * with no rows behind them, so no fused call may follow on this layer0. */
    if (time_layer0(comm, &l0, a, x, ids, w, NULL, o->warmup, o->iters, L0_ROUTE_ALONE, &res->l0_route_ms))
        return 1;
    if (allreduce(comm, &res->l0_route_ms, 1, ncclMax)) return 1;
    free(segs), free(want), free(got);
    cometi_layer0_destroy(comm, &l0);
    return 0;
}

/* What a user gets: comet_moe_forward with COMET_IMPL_FUSED and its default knobs, timed
 * as the baseline is (rotating input sets, a device barrier before each call), and its y
 * against the baseline's on input set 0. */
static int run_public_fused(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm,
                            comet_moe_t moe, const comet_moe_config_t *cfg, const char *label, comet_moe_args_t *a,
                            void **x, int32_t **ids, float **w, case_result_t *res)
{
    const int H = cfg->hidden, M = cfg->max_tokens;
    if (ctx->rank == 0) fprintf(stderr, "[bench] %s: comet_moe_forward, fused path\n", label);
    comet_moe_args_t f = *a;
    f.impl = COMET_IMPL_FUSED;
    void *y_base = a->y;
    CUDA_OK(cudaMalloc(&f.y, (size_t)M * H * 2 + 16));
    const timed_call_t c = {WHOLE_PUBLIC, comm, moe, NULL, NULL, &f, x, ids, w, NULL, NULL, NULL};
    if (time_calls(&c, o->warmup, o->iters, &res->public_ms)) return 1;
    if (allreduce(comm, &res->public_ms, 1, ncclMax)) return 1;
    /* y on input set 0, poisoned first, against the baseline's. */
    a->x = x[0], a->topk_ids = ids[0], a->topk_weights = w[0], a->impl = COMET_IMPL_BASELINE;
    comet_status_t st = comet_moe_forward(moe, a, 0);
    FAIL_IF(st != COMET_SUCCESS, "forward (%s): %s", label, comet_moe_last_error(moe));
    f.x = x[0], f.topk_ids = ids[0], f.topk_weights = w[0];
    CUDA_OK(cudaMemset(f.y, 0xff, (size_t)M * H * 2));
    st = comet_moe_forward(moe, &f, 0);
    FAIL_IF(st != COMET_SUCCESS, "forward, fused (%s): %s", label, comet_moe_last_error(moe));
    CUDA_OK(cudaDeviceSynchronize());
    st = comet_comm_get_async_error(comm);
    FAIL_IF(st != COMET_SUCCESS, "forward, fused (%s): %s", label, comet_comm_last_error(comm));
    if (y_error(comm, f.y, y_base, (size_t)M * H, &res->public_check)) return 1;
    cudaFree(f.y);
    return 0;
}

/* The suite's measure of overlap: the whole fused layer with the cost model's settings
 * against our GEMM0 + SwiGLU and GEMM1 alone on the same rows (every SM, no communication:
 * what a perfect overlap would take), against the baseline's cuBLAS expert phase on the
 * same routing (our GEMMs against cuBLAS under the same clocks), and against the whole
 * baseline, taken in turns on input set 0: each timed back to back runs at its own steady
 * clocks (the GPUs are power-limited), in turns the drift falls on all alike (docs/PERF.md
 * W6-W7). */
static int run_overlap_bound(const cometi_rank_ctx_t *ctx, comet_comm_t comm, comet_moe_t moe,
                             const comet_moe_config_t *cfg, const char *label, comet_moe_args_t *a, void **x,
                             int32_t **ids, float **w, int rounds, case_result_t *res)
{
    cometi_layer0_t l0;
    cometi_layer1_t l1;
    comet_status_t st = cometi_layer0_create(comm, cfg, &l0);
    FAIL_IF(st != COMET_SUCCESS, "layer0 (%s): %s", label, comet_comm_last_error(comm));
    st = cometi_layer1_create(comm, cfg, &l0, &l1);
    FAIL_IF(st != COMET_SUCCESS, "layer1 (%s): %s", label, comet_comm_last_error(comm));
    if (ctx->rank == 0) fprintf(stderr, "[bench] %s: the whole layer beside our GEMMs alone and cuBLAS's\n", label);
    cometi_knobs_t k;
    cometi_model_knobs(cfg, ctx->nranks, comm->sm_count, &k);
    void *y_base = a->y;
    CUDA_OK(cudaMalloc(&a->y, (size_t)cfg->max_tokens * cfg->hidden * 2 + 16));
    /* One baseline call on input set 0 leaves its rows for BASE_EXPERTS. */
    a->x = x[0], a->topk_ids = ids[0], a->topk_weights = w[0], a->impl = COMET_IMPL_BASELINE;
    st = comet_moe_forward(moe, a, 0);
    FAIL_IF(st != COMET_SUCCESS, "forward (%s): %s", label, comet_moe_last_error(moe));
    const timed_call_t base = {WHOLE_BEST, comm, moe, &l0, &l1, a, x, ids, w, &k.l0, &k.l1, NULL};
    const int whats[7] = {WHOLE_BEST, L0_GEMM_ALONE, L0_GEMM_ALONE_DYNAMIC, L1_GEMM_ALONE, L1_GEMM_ALONE_DYNAMIC,
                          BASE_EXPERTS, BASE_WHOLE};
    float med[7];
    if (time_in_turns(&base, whats, 7, rounds, med)) return 1;
    res->bound_whole_ms = med[0];
    res->bound_gemms_ms = (med[1] < med[2] ? med[1] : med[2]) + (med[3] < med[4] ? med[3] : med[4]);
    res->bound_cublas_ms = med[5];
    res->bound_baseline_ms = med[6];
    cudaFree(a->y);
    a->y = y_base;
    cometi_layer1_destroy(comm, &l1);
    cometi_layer0_destroy(comm, &l0);
    return 0;
}

static int run_baseline_case(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm,
                             const comet_moe_config_t *cfg, const char *label, case_result_t *res)
{
    const int R = ctx->nranks, me = ctx->rank, E = cfg->num_experts, k = cfg->top_k, H = cfg->hidden,
              F = cfg->ffn, M = cfg->max_tokens;
    /* EP x TP: this rank holds columns [t * Fl, (t + 1) * Fl) of its group's experts. */
    const int tp = cfg->tp_size > 0 ? cfg->tp_size : 1, t = me % tp, Fl = F / tp, per = E / (R / tp),
              first = me / tp * per;
    const seeds_t s = make_seeds(o->seed);
    comet_moe_t moe;
    comet_status_t st = comet_moe_create(comm, cfg, &moe);
    FAIL_IF(st != COMET_SUCCESS, "comet_moe_create(%s): %s", label, comet_last_create_error());

    void *gate_up, *down, *x[NSETS], *y;
    int32_t *ids[NSETS];
    float *w[NSETS];
    CUDA_OK(cudaMalloc(&gate_up, (size_t)per * 2 * Fl * H * 2));
    CUDA_OK(cudaMalloc(&down, (size_t)per * H * Fl * 2));
    CUDA_OK(cudaMalloc(&y, (size_t)M * H * 2 + 16));
    /* The weights are defined by their global index, so any slice is easy to fill and the
     * float64 check rebuilds whole experts. Gate rows, then up rows, of each expert. */
    for (int le = 0; le < per; le++)
        for (int half = 0; half < 2; half++)
            CUDA_OK(cometi_fill_hash_bf16((char *)gate_up + ((size_t)le * 2 + half) * Fl * H * 2, (size_t)Fl * H,
                                          s.gate_up, ((uint64_t)(first + le) * 2 * F + (uint64_t)half * F +
                                                      (uint64_t)t * Fl) * H, (float)(1.0 / sqrt(H)), 0));
    CUDA_OK(cometi_fill_hash_bf16_rows(down, (size_t)per * H, Fl, F, s.down,
                                       (uint64_t)first * H * F + (uint64_t)t * Fl, (float)(1.0 / sqrt(F)), 0));
    /* Routing of every rank, so this rank knows how many rows it receives (for FLOPs). */
    int32_t *ids_host = malloc(sizeof(int32_t) * ((size_t)M * k + 1));
    float *w_host = malloc(sizeof(float) * ((size_t)M * k + 1)), *w0_host = malloc(sizeof(float) * ((size_t)M * k + 1));
    int32_t *ids0_host = malloc(sizeof(int32_t) * ((size_t)M * k + 1));
    double rows_in = 0;
    for (int set = 0; set < NSETS; set++) {
        CUDA_OK(cudaMalloc(&x[set], (size_t)M * H * 2 + 16));
        CUDA_OK(cudaMalloc((void **)&ids[set], sizeof(int32_t) * ((size_t)M * k + 1)));
        CUDA_OK(cudaMalloc((void **)&w[set], sizeof(float) * ((size_t)M * k + 1)));
        CUDA_OK(cometi_fill_hash_bf16(x[set], (size_t)M * H, s.x[set], (uint64_t)me * M * H, 1.0f, 0));
        for (int r = 0; r < R; r++) {
            cometi_make_routing(o->routing, o->skew, M, k, E, s.routing[set], r, ids_host, w_host);
            int64_t *counts = calloc((size_t)E, sizeof(int64_t));
            cometi_route_count(ids_host, M, k, E, counts);
            for (int e = first; e < first + per; e++) rows_in += (double)counts[e] / NSETS;
            free(counts);
            if (r != me) continue;
            CUDA_OK(cudaMemcpy(ids[set], ids_host, sizeof(int32_t) * M * k, cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(w[set], w_host, sizeof(float) * M * k, cudaMemcpyHostToDevice));
            if (set == 0) {
                memcpy(ids0_host, ids_host, sizeof(int32_t) * M * k);
                memcpy(w0_host, w_host, sizeof(float) * M * k);
            }
        }
    }
    free(ids_host);
    free(w_host);
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = M;
    a.weights.gate_up = gate_up;
    a.weights.down = down;
    a.y = y;
    a.impl = COMET_IMPL_BASELINE;

    /* Check first: sample tokens against float64, on poisoned output. */
    res->check = -1;
    if (o->check && M > 0) {
        if (me == 0) fprintf(stderr, "[bench] %s: float64 check of sample tokens\n", label);
        CUDA_OK(cudaMemset(y, 0xff, (size_t)M * H * 2));
        a.x = x[0];
        a.topk_ids = ids[0];
        a.topk_weights = w[0];
        st = comet_moe_forward(moe, &a, 0);
        FAIL_IF(st != COMET_SUCCESS, "forward (%s): %s", label, comet_moe_last_error(moe));
        CUDA_OK(cudaDeviceSynchronize());
        const int samples[2] = {0, M - 1};
        uint16_t *row = malloc((size_t)H * 2);
        float *rowf = malloc(sizeof(float) * H);
        double *ref = malloc(sizeof(double) * H), worst = 0;
        for (int i = 0; i < 2; i++) {
            CUDA_OK(cudaMemcpy(row, (char *)y + (size_t)samples[i] * H * 2, (size_t)H * 2, cudaMemcpyDeviceToHost));
            for (int h = 0; h < H; h++) rowf[h] = cometi_bf16_to_float(row[h]);
            reference_token(cfg, &s, me, samples[i], ids0_host, w0_host, ref);
            double err = cometi_rel_error(rowf, ref, H);
            if (!(err <= worst)) worst = err;
        }
        free(row), free(rowf), free(ref);
        float wf = isfinite(worst) ? (float)worst : INFINITY;
        if (allreduce(comm, &wf, 1, ncclMax)) return 1;
        res->check = wf;
    }
    free(ids0_host);
    free(w0_host);

    cudaEvent_t marks[COMETI_NUM_MARKS];
    for (int i = 0; i < COMETI_NUM_MARKS; i++) CUDA_OK(cudaEventCreate(&marks[i]));
    float *times[P_COUNT];
    for (int p = 0; p < P_COUNT; p++) times[p] = malloc(sizeof(float) * o->iters);
    if (me == 0) fprintf(stderr, "[bench] %s: %d warm-up and %d timed calls\n", label, o->warmup, o->iters);
    for (int it = -o->warmup; it < o->iters; it++) {
        int set = (it + o->warmup) % NSETS;
        a.x = x[set];
        a.topk_ids = ids[set];
        a.topk_weights = w[set];
        cometi_moe_set_marks(moe, it >= 0 ? marks : NULL);
        FAIL_IF(cometi_barrier(comm, 0) != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(comm));
        st = comet_moe_forward(moe, &a, 0);
        FAIL_IF(st != COMET_SUCCESS, "forward (%s): %s", label, comet_moe_last_error(moe));
        if (it < 0) continue;
        CUDA_OK(cudaEventSynchronize(marks[COMETI_MARK_END]));
        float ms[COMETI_NUM_MARKS];
        for (int i = 1; i < COMETI_NUM_MARKS; i++) CUDA_OK(cudaEventElapsedTime(&ms[i], marks[i - 1], marks[i]));
        times[P_ROUTE][it] = ms[COMETI_MARK_ROUTED];
        times[P_A2A_OUT][it] = ms[COMETI_MARK_DISPATCHED];
        times[P_EXPERTS][it] = ms[COMETI_MARK_ACTIVATED] + ms[COMETI_MARK_COMPUTED];
        times[P_A2A_BACK][it] = ms[COMETI_MARK_RETURNED];
        times[P_COMBINE][it] = ms[COMETI_MARK_END];
        CUDA_OK(cudaEventElapsedTime(&times[P_LAYER0][it], marks[COMETI_MARK_START], marks[COMETI_MARK_ACTIVATED]));
        CUDA_OK(cudaEventElapsedTime(&times[P_LAYER1][it], marks[COMETI_MARK_ACTIVATED], marks[COMETI_MARK_END]));
        CUDA_OK(cudaEventElapsedTime(&times[P_TOTAL][it], marks[COMETI_MARK_START], marks[COMETI_MARK_END]));
        if (me == 0 && o->iters >= 50 && (it + 1) % (o->iters / 5) == 0)
            fprintf(stderr, "[bench] %s: %d/%d\n", label, it + 1, o->iters);
    }
    cometi_moe_set_marks(moe, NULL);
    CUDA_OK(cudaDeviceSynchronize());
    for (int p = 0; p < P_COUNT; p++) {
        res->ms[p] = median(times[p], o->iters);
        free(times[p]);
    }
    float flops[2] = {(float)(rows_in * 6.0 * H * Fl), 0};
    if (allreduce(comm, res->ms, P_COUNT, ncclMax)) return 1;
    if (allreduce(comm, flops, 1, ncclSum)) return 1;
    res->tflops = flops[0] / R / (res->ms[P_EXPERTS] * 1e-3) / 1e12;
    for (int i = 0; i < COMETI_NUM_MARKS; i++) cudaEventDestroy(marks[i]);
    if (o->run_comet && !o->suite && run_layer0(ctx, o, comm, moe, cfg, label, &a, x, ids, w, res)) return 1;
    if (o->run_comet && run_public_fused(ctx, o, comm, moe, cfg, label, &a, x, ids, w, res)) return 1;
    if (o->run_comet && o->suite && run_overlap_bound(ctx, comm, moe, cfg, label, &a, x, ids, w, o->iters, res)) return 1;
    for (int set = 0; set < NSETS; set++) cudaFree(x[set]), cudaFree(ids[set]), cudaFree(w[set]);
    cudaFree(gate_up), cudaFree(down), cudaFree(y);
    comet_moe_destroy(moe);
    return 0;
}

static void print_header(void)
{
    printf("%-16s %-9s %6s %9s %9s %9s %9s %10s %10s %8s %9s\n", "case", "impl", "tokens", "total ms", "dispatch",
           "experts", "combine", "comm alone", "GEMM alone", "TFLOP/s", "check");
}

/* One case: the baseline, then comet beside it; its rows on rank 0, its JSON records. */
static int bench_case(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm,
                      const struct cudaDeviceProp *prop, const comet_moe_config_t *cfg, const char *label, FILE *json,
                      int *records, int *failed_check, case_result_t *out)
{
    if (ctx->rank == 0) {
        const int tp = cfg->tp_size > 0 ? cfg->tp_size : 1;
        printf("\n%s: E=%d top-k=%d H=%d F=%d, %d tokens per GPU, %d x %s (EP=%d x TP=%d), routing %s", label,
               cfg->num_experts, cfg->top_k, cfg->hidden, cfg->ffn, cfg->max_tokens, ctx->nranks, prop->name,
               ctx->nranks / tp, tp, routing_name(o->routing));
        if (o->routing == COMETI_ROUTING_SKEWED) printf(" (skew %.3g)", o->skew);
        printf(", median of %d calls, slowest rank\n", o->iters);
        print_header();
    }
    case_result_t base;
    memset(&base, 0, sizeof(base));
    if (!o->run_baseline && o->run_comet && ctx->rank == 0)
        printf("%-16s comet: needs the baseline run beside it in this version (--impl all)\n", label);
    if (o->run_baseline) {
        if (run_baseline_case(ctx, o, comm, cfg, label, &base)) return 1;
        if (base.check > 1e-2 || base.check != base.check) *failed_check = 1;
        if (ctx->rank == 0) {
            char check[32] = "skipped";
            if (base.check >= 0) snprintf(check, sizeof(check), "%.1e%s", base.check, base.check > 1e-2 ? "!" : "");
            printf("%-16s %-9s %6d %9.3f %9.3f %9.3f %9.3f %10.3f %10.3f %8.0f %9s\n", label, "baseline",
                   cfg->max_tokens, base.ms[P_TOTAL], base.ms[P_ROUTE] + base.ms[P_A2A_OUT], base.ms[P_EXPERTS],
                   base.ms[P_A2A_BACK] + base.ms[P_COMBINE], base.ms[P_A2A_OUT] + base.ms[P_A2A_BACK],
                   base.ms[P_EXPERTS], base.tflops, check);
            if (json) {
                fprintf(json, "%s  {\"case\": \"%s\", \"impl\": \"baseline\", \"gpu\": \"%s\", \"ranks\": %d, "
                        "\"tp\": %d, \"experts\": %d, \"top_k\": %d, \"hidden\": %d, \"ffn\": %d, "
                        "\"tokens_per_rank\": %d, \"routing\": \"%s\", \"skew\": %g, \"iters\": %d, \"seed\": %llu, "
                        "\"median_ms\": {",
                        (*records)++ ? ",\n" : "", label, prop->name, ctx->nranks, cfg->tp_size > 0 ? cfg->tp_size : 1,
                        cfg->num_experts, cfg->top_k, cfg->hidden,
                        cfg->ffn, cfg->max_tokens, routing_name(o->routing), o->skew, o->iters,
                        (unsigned long long)o->seed);
                for (int p = 0; p < P_COUNT; p++)
                    fprintf(json, "%s\"%s\": %.4f", p ? ", " : "", phase_json[p], base.ms[p]);
                fprintf(json, "}, \"comm_alone_ms\": %.4f, \"gemm_alone_ms\": %.4f, \"expert_tflops_per_gpu\": "
                        "%.1f, \"check_rel_err\": %.3g}", base.ms[P_A2A_OUT] + base.ms[P_A2A_BACK],
                        base.ms[P_EXPERTS], base.tflops, base.check);
            }
        }
    }
    if (o->run_comet && ctx->rank == 0) {
        if (base.public_ms > 0) {
            printf("%-16s %-9s %6d %9.3f   %.2fx the baseline, default knobs", label, "comet", cfg->max_tokens,
                   base.public_ms, base.ms[P_TOTAL] / base.public_ms);
            if (base.whole_ms > 0)
                printf(" (best knobs of the sweeps below: %.3f ms, %.2fx)", base.whole_ms,
                       base.ms[P_TOTAL] / base.whole_ms);
            printf("; y vs baseline %.1e%s\n", base.public_check, base.public_check > 1e-2 ? "!" : "");
            if (base.bound_gemms_ms > 0)
                printf("  in turns: the whole layer %.3f ms, our GEMM0 + GEMM1 alone %.3f ms (whole / GEMMs %.3f), "
                       "the baseline's cuBLAS experts %.3f ms (our GEMMs / cuBLAS %.3f), the whole baseline %.3f ms "
                       "(the whole layer %.2fx faster)\n", base.bound_whole_ms, base.bound_gemms_ms, base.bound_whole_ms / base.bound_gemms_ms,
                       base.bound_cublas_ms, base.bound_gemms_ms / base.bound_cublas_ms, base.bound_baseline_ms,
                       base.bound_baseline_ms / base.bound_whole_ms);
            if (json)
                fprintf(json, ",\n  {\"case\": \"%s\", \"impl\": \"comet\", \"tokens_per_rank\": %d, "
                        "\"routing\": \"%s\", \"total_ms\": %.4f, \"best_knobs_total_ms\": %.4f, "
                        "\"baseline_total_ms\": %.4f, \"whole_in_turns_ms\": %.4f, \"gemms_alone_in_turns_ms\": "
                        "%.4f, \"cublas_experts_in_turns_ms\": %.4f, \"baseline_in_turns_ms\": %.4f, "
                        "\"diff_vs_baseline\": %.3g}", label, cfg->max_tokens, routing_name(o->routing), base.public_ms,
                        base.whole_ms, base.ms[P_TOTAL], base.bound_whole_ms, base.bound_gemms_ms, base.bound_cublas_ms,
                        base.bound_baseline_ms, base.public_check);
        }
        if (o->run_baseline && base.l0_runs) {
            const float l0 = base.l0_ms[base.l0_best];
            const cometi_layer0_knobs_t *best = &base.l0_knobs[base.l0_best];
            printf("  layer0 (dispatch + GEMM0 + SwiGLU): baseline %.3f ms, fused %.3f ms with %d %s dispatch "
                   "blocks (%.2fx); in turns: fused %.3f ms, our GEMM0 alone %.3f ms (fused / alone %.3f); "
                   "route alone %.3f ms, activations vs baseline %.1e%s\n",
                   base.ms[P_LAYER0], l0, best->dispatch_blocks, dispatch_mode_name(best->dispatch_mode),
                   base.ms[P_LAYER0] / l0, base.l0_paired_ms, base.l0_gemm_alone_ms,
                   base.l0_paired_ms / base.l0_gemm_alone_ms, base.l0_route_ms, base.l0_diff,
                   base.l0_diff > 1e-2 ? "!" : "");
            printf("  layer0 sweep, ms by dispatch blocks:");
            for (int i = 0; i < base.l0_runs; i++)
                printf(" %s %d: %.3f", dispatch_mode_name(base.l0_knobs[i].dispatch_mode),
                       base.l0_knobs[i].dispatch_blocks, base.l0_ms[i]);
            printf("\n");
            if (base.l1_runs) {
                const cometi_layer1_knobs_t *k1 = &base.l1_knobs[base.l1_best];
                const float l1 = base.l1_ms[base.l1_best];
                char name[32];
                printf("  layer1 (GEMM1 + combine): baseline %.3f ms, fused %.3f ms with %s (%.2fx); in turns: fused "
                       "%.3f ms, our GEMM1 alone %.3f ms (fused / alone %.3f), y vs baseline %.1e%s\n",
                       base.ms[P_LAYER1], l1, layer1_name(k1, name, sizeof(name)), base.ms[P_LAYER1] / l1,
                       base.l1_paired_ms, base.l1_gemm_alone_ms, base.l1_paired_ms / base.l1_gemm_alone_ms,
                       base.l1_diff, base.l1_diff > 1e-2 ? "!" : "");
                cometi_knobs_t tuned = {base.l0_knobs[base.l0_best], *k1};
                char tuning[160];
                cometi_tuning_line(cfg, ctx->nranks, &tuned, tuning, sizeof(tuning));
                if (base.copy_gbs > 0) {
                    /* What no setting beats without hiding them: the route before layer0 (timed
                     * alone) and the owner's sum after GEMM1, whose bytes (tp x top-k rows read
                     * per token, one written) take at least their time at the GPU's copy rate
                     * (reads and writes: twice the rate copied). */
                    const int tp = cfg->tp_size > 0 ? cfg->tp_size : 1;
                    const double sum_bytes = (double)cfg->max_tokens * cfg->hidden * 2 * (tp * cfg->top_k + 1);
                    const double sum_ms = sum_bytes / (2.0 * base.copy_gbs * 1e9) * 1e3;
                    const double gemms = base.l0_gemm_alone_ms + base.l1_gemm_alone_ms;
                    printf("  floors unless hidden: the owner's sum reads and writes %.0f MB, at least %.3f ms at "
                           "this GPU's %.0f GB/s copy rate; layer1 with the push / GEMM1 >= %.3f; the whole layer / "
                           "the GEMMs >= (GEMMs + the route alone %.3f + the sum) / GEMMs = %.3f\n", sum_bytes / 1e6,
                           sum_ms, base.copy_gbs, (base.l1_gemm_alone_ms + sum_ms) / base.l1_gemm_alone_ms,
                           base.l0_route_ms, (gemms + base.l0_route_ms + sum_ms) / gemms);
                }
                printf("  tuning line for the best of both sweeps (COMET_TUNING_FILE): %s\n", tuning);
                char model_line[160];
                cometi_tuning_line(cfg, ctx->nranks, &base.model_knobs, model_line, sizeof(model_line));
                const char *model_knobs = strchr(model_line, ':') ? strchr(model_line, ':') + 2 : model_line;
                printf("  the whole layer in turns: these settings %.3f ms, the cost model's (%s) %.3f ms "
                       "(tuned / model %.3f)\n", base.tuned_turns_ms, model_knobs,
                       base.model_turns_ms, base.tuned_turns_ms / base.model_turns_ms);
                char terr[512];
                if (o->tune_out && cometi_tuning_update(o->tune_out, cfg, ctx->nranks, &tuned, terr, sizeof(terr)))
                    FAIL_IF(1, "comet tune: %s", terr);
                if (o->tune_out) printf("  written to %s\n", o->tune_out);
                printf("  layer1 sweep, ms by combine blocks x splits (t: last split on every SM after; push: rows "
                       "sent home from GEMM1's epilogue):");
                for (int i = 0; i < base.l1_runs; i++)
                    printf(" %s: %.3f", layer1_name(&base.l1_knobs[i], name, sizeof(name)), base.l1_ms[i]);
                printf("\n");
                if (json)
                    fprintf(json, ",\n  {\"case\": \"%s\", \"impl\": \"layer1\", \"baseline_layer1_ms\": "
                            "%.4f, \"fused_ms\": %.4f, \"combine_blocks\": %d, \"splits\": %d, \"push\": %d, "
                            "\"fused_in_turns_ms\": %.4f, \"gemm1_alone_in_turns_ms\": %.4f, "
                            "\"gemm1_alone_static_ms\": %.4f, \"gemm1_alone_shared_counter_ms\": %.4f, "
                            "\"diff_vs_baseline\": %.3g, \"whole_tuned_in_turns_ms\": %.4f, "
                            "\"whole_model_in_turns_ms\": %.4f, \"push_owner_sum_ms\": %.4f}", label,
                            base.ms[P_LAYER1], l1, k1->combine_blocks, k1->n_splits, k1->push, base.l1_paired_ms,
                            base.l1_gemm_alone_ms, base.l1_alone_each[0], base.l1_alone_each[1], base.l1_diff,
                            base.tuned_turns_ms, base.model_turns_ms, base.push_sum_ms);
            }
            if (json)
                fprintf(json, ",\n  {\"case\": \"%s\", \"impl\": \"layer0\", \"baseline_layer0_ms\": %.4f, "
                        "\"fused_ms\": %.4f, \"dispatch_blocks\": %d, \"dispatch_mode\": \"%s\", "
                        "\"fused_in_turns_ms\": %.4f, \"gemm0_alone_in_turns_ms\": %.4f, "
                        "\"gemm0_alone_static_ms\": %.4f, \"gemm0_alone_shared_counter_ms\": %.4f, "
                        "\"route_alone_ms\": %.4f, \"diff_vs_baseline\": %.3g}", label, base.ms[P_LAYER0], l0,
                        best->dispatch_blocks, dispatch_mode_name(best->dispatch_mode), base.l0_paired_ms,
                        base.l0_gemm_alone_ms, base.l0_alone_each[0], base.l0_alone_each[1], base.l0_route_ms,
                        base.l0_diff);
        }
    }
    if (base.l0_runs && !(base.l0_diff <= 1e-2)) *failed_check = 1;
    if (base.l1_runs && !(base.l1_diff <= 1e-2)) *failed_check = 1;
    if (base.public_ms > 0 && !(base.public_check <= 1e-2)) *failed_check = 1;
    fflush(stdout);
    *out = base;
    return 0;
}

/* The suite's cases; the headline table is printed from them at the end. */
typedef struct suite_row {
    char label[64];
    int tokens;
    cometi_routing_t routing;
    float baseline_ms, comet_ms, whole_ms, gemms_ms, cublas_ms, baseline_turns_ms;
} suite_row_t;

int bench_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const tool_options_t *o = arg;
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    comet_comm_config_t cc = COMET_COMM_CONFIG_INIT;
    cc.timeout_ms = o->timeout_ms;
    comet_comm_t comm;
    comet_status_t st = comet_comm_create_from_id(&ctx->id, ctx->nranks, ctx->rank, &cc, &comm);
    FAIL_IF(st != COMET_SUCCESS, "comet_comm_create_from_id: %s", comet_last_create_error());
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, ctx->local_rank));
    FILE *json = NULL;
    if (ctx->rank == 0 && o->json) {
        json = fopen(o->json, "w");
        FAIL_IF(!json, "--json %s: cannot open for writing", o->json);
        fprintf(json, "[\n");
    }
    /* The suite: token counts x routings x presets; otherwise the one token count and routing given. */
    static const int suite_tokens[] = {1024, 2048, 4096, 8192, 16384};
    static const cometi_routing_t suite_routings[] = {COMETI_ROUTING_BALANCED, COMETI_ROUTING_SKEWED};
    const int ntokens = o->suite ? 5 : 1, nroutings = o->suite ? 2 : 1, ncases = o->npresets ? o->npresets : 1;
    suite_row_t *rows = calloc((size_t)ntokens * nroutings * ncases, sizeof(*rows));
    int nrows = 0, records = 0, failed_check = 0;
    for (int ri = 0; ri < nroutings; ri++) {
        for (int ti = 0; ti < ntokens; ti++) {
            for (int ci = 0; ci < ncases; ci++) {
                tool_options_t oc = *o;
                if (o->suite) oc.tokens = suite_tokens[ti], oc.routing = suite_routings[ri];
                comet_moe_config_t cfg = COMET_MOE_CONFIG_INIT;
                char label[64];
                if (oc.npresets) {
                    comet_moe_config_preset(oc.presets[ci], oc.tokens, &cfg);
                    snprintf(label, sizeof(label), "%s", oc.presets[ci]);
                } else {
                    cfg.hidden = oc.hidden, cfg.ffn = oc.ffn, cfg.num_experts = oc.experts, cfg.top_k = oc.top_k;
                    cfg.max_tokens = oc.tokens;
                    snprintf(label, sizeof(label), "E%d-k%d-H%d-F%d", oc.experts, oc.top_k, oc.hidden, oc.ffn);
                }
                cfg.ep_size = oc.ep;
                cfg.tp_size = oc.tp;
                char msg[512];
                st = comet_moe_config_validate(&cfg, ctx->nranks, msg, sizeof(msg));
                FAIL_IF(st != COMET_SUCCESS, "%s: %s", label, msg);
                case_result_t base;
                if (bench_case(ctx, &oc, comm, &prop, &cfg, label, json, &records, &failed_check, &base)) return 1;
                suite_row_t *r = &rows[nrows++];
                snprintf(r->label, sizeof(r->label), "%s", label);
                r->tokens = cfg.max_tokens;
                r->routing = oc.routing;
                r->baseline_ms = base.ms[P_TOTAL];
                r->comet_ms = base.public_ms;
                r->whole_ms = base.bound_whole_ms;
                r->gemms_ms = base.bound_gemms_ms;
                r->cublas_ms = base.bound_cublas_ms;
                r->baseline_turns_ms = base.bound_baseline_ms;
            }
        }
    }
    if (o->suite && ctx->rank == 0) {
        printf("\nsuite, %d x %s: comet (comet_moe_forward, default settings) beside the baseline back to back; "
               "in turns, the fused layer with the cost model's settings beside the baseline, our two GEMMs alone, "
               "and the baseline's cuBLAS experts\n", ctx->nranks, prop.name);
        printf("%-16s %6s %-9s %11s %9s %8s %8s %10s %12s %10s %12s\n", "case", "tokens", "routing", "baseline ms",
               "comet ms", "speedup", "in turns", "GEMMs ms", "whole/GEMMs", "cuBLAS ms", "GEMMs/cuBLAS");
        for (int i = 0; i < nrows; i++)
            printf("%-16s %6d %-9s %11.3f %9.3f %7.2fx %7.2fx %10.3f %12.3f %10.3f %12.3f\n", rows[i].label,
                   rows[i].tokens, routing_name(rows[i].routing), rows[i].baseline_ms, rows[i].comet_ms,
                   rows[i].baseline_ms / rows[i].comet_ms, rows[i].baseline_turns_ms / rows[i].whole_ms,
                   rows[i].gemms_ms, rows[i].whole_ms / rows[i].gemms_ms, rows[i].cublas_ms,
                   rows[i].gemms_ms / rows[i].cublas_ms);
    }
    free(rows);
    if (json) {
        fprintf(json, "\n]\n");
        fclose(json);
    }
    comet_comm_destroy(comm);
    FAIL_IF(failed_check, "a float64 check of sample tokens failed (relative error over 1e-2, marked !)");
    return 0;
}

int bandwidth_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const tool_options_t *o = arg;
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    comet_comm_config_t cc = COMET_COMM_CONFIG_INIT;
    cc.timeout_ms = o->timeout_ms;
    comet_comm_t comm;
    comet_status_t st = comet_comm_create_from_id(&ctx->id, ctx->nranks, ctx->rank, &cc, &comm);
    FAIL_IF(st != COMET_SUCCESS, "comet_comm_create_from_id: %s", comet_last_create_error());
    const size_t bytes = (size_t)o->mib << 20;
    const int peer = (ctx->rank + 1) % ctx->nranks, reps = 10;
    cometi_window_t win;
    st = cometi_window_create(comm, 2 * bytes, &win); /* [0, bytes): source, [bytes, 2 bytes): target */
    FAIL_IF(st != COMET_SUCCESS, "window: %s", comet_comm_last_error(comm));
    CUDA_OK(cometi_fill_hash_bf16(win.local, bytes / 2, 7, 0, 1.0f, 0));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    if (ctx->rank == 0)
        printf("%d x %s: each rank copies %d MiB to (push: remote stores) or from (pull: remote loads) rank+1, all "
               "at once (local: the same copy inside the rank's own memory); GB/s per rank, median of %d, slowest "
               "rank\n%8s %10s %10s %11s\n",
               ctx->nranks, "GPU", o->mib, reps, "blocks", "push GB/s", "pull GB/s", "local GB/s");
    const int block_counts[] = {1, 2, 4, 8, 16, 32, 66, 132};
    for (size_t bi = 0; bi < sizeof(block_counts) / sizeof(block_counts[0]); bi++) {
        float gbs[3];
        for (int dir = 0; dir < 3; dir++) { /* push, pull, local */
            void *dst = dir == 0 ? (char *)win.peer[peer] + bytes : (char *)win.local + bytes;
            const void *src = dir == 1 ? win.peer[peer] : win.local;
            if (timed_copy(comm, dst, src, bytes, block_counts[bi], reps, e0, e1, &gbs[dir])) return 1;
        }
        /* The slowest rank: min over ranks of GB/s. */
        float neg[3] = {-gbs[0], -gbs[1], -gbs[2]};
        if (allreduce(comm, neg, 3, ncclMax)) return 1;
        if (ctx->rank == 0) printf("%8d %10.1f %10.1f %11.1f\n", block_counts[bi], -neg[0], -neg[1], -neg[2]);
    }
    /* The push again through the copy engine (into the peer's window): no SM. */
    float ce;
    if (timed_copy(comm, (char *)win.peer[peer] + bytes, win.local, bytes, 0, reps, e0, e1, &ce)) return 1;
    float neg_ce = -ce;
    if (allreduce(comm, &neg_ce, 1, ncclMax)) return 1;
    if (ctx->rank == 0) printf("%8s %10.1f (the copy engine: cudaMemcpyAsync into the peer's window)\n", "-", -neg_ce);
    st = cometi_barrier(comm, 0);
    CUDA_OK(cudaDeviceSynchronize());
    st = comet_comm_get_async_error(comm);
    FAIL_IF(st != COMET_SUCCESS, "%s", comet_comm_last_error(comm));
    cometi_window_destroy(comm, &win);
    comet_comm_destroy(comm);
    return 0;
}
