/*
 * bench_timing.c - how `comet bench` times: calls each after a device barrier, medians,
 * the slowest rank's through NCCL, calls taken in turns so clock drift falls on all of
 * them alike, a sweep's pick made in turns with the GEMM alone; and where the time goes
 * (the --trace timelines, the push's phases, this GPU's copy rate).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "baseline/baseline.h"
#include "patterns/dispatch_gemm.h"
#include "patterns/gemm_combine.h"
#include "../harness/timeline.h"
#include "bench.h"
#include "alloc.h"
#include "tool.h"

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

float median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof(float), cmp_float);
    return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

/* Max (or sum) over ranks of a few floats, through NCCL. */
int allreduce(comet_comm_t comm, float *v, int n, ncclRedOp_t op)
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

/* A training forward into the saved state in c->tr->b, then (with `backward`) its
 * backward, both on `impl`. A refusal (COMET_NOT_SUPPORTED) is try_call's to report. */
static comet_status_t run_train_call(const timed_call_t *c, comet_impl_t impl, int forward, int backward)
{
    comet_moe_args_t a = *c->a;
    comet_moe_backward_args_t b = c->tr->b;
    a.impl = b.impl = impl;
    const char *what = "comet_moe_forward_train";
    comet_status_t st = forward ? comet_moe_forward_train(c->moe, &a, b.saved, 0) : COMET_SUCCESS;
    if (st == COMET_SUCCESS && backward) what = "comet_moe_backward", st = comet_moe_backward(c->moe, &b, 0);
    if (st != COMET_SUCCESS && st != COMET_NOT_SUPPORTED)
        fprintf(stderr, "%s (%s): %s\n", what, impl == COMET_IMPL_FUSED ? "fused" : "baseline",
                comet_moe_last_error(c->moe));
    return st;
}

/* A fused step on the twin handle that sends x again: its saved state of the set, the
 * set's x given to the backward. */
static comet_status_t run_resend_step(const timed_call_t *c, int set)
{
    timed_call_t t = *c;
    train_bufs_t tr = *c->tr;
    tr.b.saved = tr.resend_saved[set];
    tr.b.x = c->a->x;
    t.moe = tr.resend_moe;
    t.tr = &tr;
    return run_train_call(&t, COMET_IMPL_FUSED, 1, 1);
}

/* Any failure here makes the column "n/a": its reason printed on rank 0 alone. */
static comet_status_t run_backward_gemms(const timed_call_t *c)
{
    comet_status_t st = cometi_moe_backward_gemms(c->moe, &c->tr->b, c->tr->gemm_mask, 0);
    if (st != COMET_SUCCESS && c->comm->rank == 0)
        fprintf(stderr, "[bench] cometi_moe_backward_gemms: %s\n", comet_moe_last_error(c->moe));
    return st;
}

/* Call number n (from 0, warm-up included). */
static comet_status_t run_timed_call(const timed_call_t *c, int n)
{
    comet_moe_args_t *a = c->a;
    const int set = n % NSETS;
    if (c->what < L1_FUSED || (c->what >= WHOLE_BEST && c->what != BASE_EXPERTS))
        a->x = c->x[set], a->topk_ids = c->ids[set], a->topk_weights = c->w[set];
    if (c->what >= TRAIN_FORWARD) c->tr->b.saved = c->tr->saved[set], c->tr->b.dy = c->tr->dy[set];
    switch (c->what) {
    case L0_FUSED: return cometi_dispatch_gemm_run(c->comm, c->l0, a, c->k0, 0);
    case L0_GEMM_ALONE:
    case L0_GEMM_ALONE_DYNAMIC: return cometi_dispatch_gemm_alone(c->comm, c->l0, a, c->what == L0_GEMM_ALONE_DYNAMIC, 0);
    case L0_ROUTE_ALONE:
        return cometi_route_dev_run(c->comm, &c->l0->route, a->topk_ids, a->topk_weights, a->num_tokens,
                                    c->l0->top_k, 0, 0, NULL, 0);
    case L1_FUSED: return cometi_gemm_combine_run(c->comm, c->l1, c->l0, a, c->k1, 0);
    case L1_GEMM_ALONE:
    case L1_GEMM_ALONE_DYNAMIC:
        return cometi_gemm_combine_alone(c->comm, c->l1, c->l0, a, c->what == L1_GEMM_ALONE_DYNAMIC, 0);
    case BASE_EXPERTS: {
        struct cometi_baseline *b;
        COMETI_TRY(cometi_moe_baseline(c->moe, &b));
        return cometi_baseline_experts(c->moe, b, a, 0);
    }
    case BASE_WHOLE: {
        comet_moe_args_t b = *a;
        b.impl = COMET_IMPL_BASELINE;
        comet_status_t st = comet_moe_forward(c->moe, &b, 0);
        if (st != COMET_SUCCESS) fprintf(stderr, "comet_moe_forward (baseline): %s\n", comet_moe_last_error(c->moe));
        return st;
    }
    case TRAIN_FORWARD: return run_train_call(c, a->impl, 1, 0);
    case TRAIN_BACKWARD: return run_train_call(c, a->impl, 0, 1);
    case TRAIN_STEP: return run_train_call(c, a->impl, 1, 1);
    case BASE_TRAIN_STEP: return run_train_call(c, COMET_IMPL_BASELINE, 1, 1);
    case BACKWARD_GEMMS: return run_backward_gemms(c);
    case RESEND_TRAIN_STEP: return run_resend_step(c, set);
    case WHOLE_BEST: {
        comet_status_t st = cometi_dispatch_gemm_run(c->comm, c->l0, a, c->k0, 0);
        return st != COMET_SUCCESS ? st : cometi_gemm_combine_run(c->comm, c->l1, c->l0, a, c->k1, 0);
    }
    case WHOLE_MODEL: {
        comet_status_t st = cometi_dispatch_gemm_run(c->comm, c->l0, a, &c->model->l0, 0);
        return st != COMET_SUCCESS ? st : cometi_gemm_combine_run(c->comm, c->l1, c->l0, a, &c->model->l1, 0);
    }
    default: {
        comet_status_t st = comet_moe_forward(c->moe, a, 0);
        if (st != COMET_SUCCESS) fprintf(stderr, "comet_moe_forward: %s\n", comet_moe_last_error(c->moe));
        return st;
    }
    }
}

/* What call number n needs first, untimed: a backward consumes the saved state its
 * training forward filled (the fused one computes its gradients in place), so each
 * TRAIN_BACKWARD and BACKWARD_GEMMS call gets a fresh training forward on its input set. */
static comet_status_t prepare_timed_call(const timed_call_t *c, int n)
{
    if (c->what != TRAIN_BACKWARD && c->what != BACKWARD_GEMMS) return COMET_SUCCESS;
    timed_call_t f = *c;
    f.what = TRAIN_FORWARD;
    const comet_status_t st = run_timed_call(&f, n);
    if (st != COMET_SUCCESS) fprintf(stderr, "the training forward before call %d: %s\n", c->what,
                                     comet_moe_last_error(c->moe));
    return st;
}

/* Median ms of `iters` calls after `warmup` more, each after a device barrier (launch skew
 * is not the layer's; for layer1 run again on one route, it is also what orders the
 * slots' reuse) and what it needs first, then the device-side failure check. */
int time_calls(const timed_call_t *c, int warmup, int iters, float *out)
{
    cudaEvent_t e0, e1;
    float *t = TOOL_MALLOC(sizeof(float) * iters);
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int it = -warmup; it < iters; it++) {
        FAIL_IF(prepare_timed_call(c, it + warmup) != COMET_SUCCESS, "timed call %d: %s", c->what,
                comet_comm_last_error(c->comm));
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

/* One call on input set 0 after a device barrier, for a call the impl may not serve:
 * *served is 1 if it succeeded on every rank, 0 if it returned COMET_NOT_SUPPORTED on
 * any (nothing launched; the reason printed on rank 0) or, for BACKWARD_GEMMS, any other
 * status. Any other failure is the run's: returns 1. */
int try_call(const timed_call_t *c, int *served)
{
    FAIL_IF(prepare_timed_call(c, 0) != COMET_SUCCESS, "call %d: %s", c->what, comet_comm_last_error(c->comm));
    FAIL_IF(cometi_barrier(c->comm, 0) != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(c->comm));
    const comet_status_t st = run_timed_call(c, 0);
    FAIL_IF(st != COMET_SUCCESS && st != COMET_NOT_SUPPORTED && c->what != BACKWARD_GEMMS, "call %d: %s", c->what,
            comet_status_string(st));
    if (st == COMET_NOT_SUPPORTED && c->what != BACKWARD_GEMMS && c->comm->rank == 0)
        fprintf(stderr, "[bench] n/a: %s\n", comet_moe_last_error(c->moe));
    CUDA_OK(cudaDeviceSynchronize());
    FAIL_IF(comet_comm_get_async_error(c->comm) != COMET_SUCCESS, "call %d: %s", c->what,
            comet_comm_last_error(c->comm));
    float refused = st != COMET_SUCCESS;
    if (allreduce(c->comm, &refused, 1, ncclMax)) return 1;
    *served = refused == 0;
    return 0;
}

/* The calls `whats` (on `base`'s objects, input set 0) taken in turns `rounds` times, so
 * that clock drift over the run (a few percent: the GPUs run at their power limit) falls
 * on all of them alike; med[i] is the slowest rank's median of whats[i]. Each round takes
 * them in a shuffled order, the same on every rank (the calls are collective): a call's
 * clocks depend on the call before it (one that waits on NVLink lets the GPU cool), and
 * a fixed order would give each call the same predecessor every round. */
#define TURNS_MAX 8

int time_in_turns(const timed_call_t *base, const int *whats, int n, int rounds, float *med)
{
    FAIL_IF(n < 1 || n > TURNS_MAX, "time_in_turns: %d calls (1..%d)", n, TURNS_MAX);
    float *t = TOOL_MALLOC(sizeof(float) * n * rounds);
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
 * (the GPUs run at their power limit), so its order can be off: a setting that computes
 * less lets its GEMM clock higher and looks faster than it is beside the others, and the
 * sweep's two best back to back can leave out the setting that is best in turns. So the
 * sweep's two best settings and the cost model's are timed again, each in turns with the
 * GEMM alone, and the lowest ratio wins. `runs` and `ms` are the sweep's, `model` the
 * cost model's run in it (or -1); `calls[i]` times run i. Returns the winning run, -1 on
 * failure; its times in *fused_ms, *alone_ms and each[2] (maxima over ranks, so every
 * rank picks the same). */
int best_in_turns(const timed_call_t *calls, const float *ms, int runs, int model, int rounds, float *fused_ms,
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

/* --trace: the last layer1 call's combine timeline on this rank, in us from the
 * first combine block's start (or the tail kernel's, with no combine blocks), median over
 * the blocks: the combine blocks' splits, then the tail kernel's. */
int print_layer1_trace(comet_comm_t comm, const cometi_gemm_combine_t *l1, const cometi_combine_knobs_t *k)
{
    const int sms = comm->sm_count, n = COMETI_COMBINE_TRACE, cb = k->combine_blocks;
    const int kernel_splits = cb ? k->n_splits - (k->tail != 0) : 0;
    unsigned long long *t = TOOL_MALLOC(sizeof(unsigned long long) * n * 2 * sms), t0 = ~0ull;
    CUDA_OK(cudaMemcpy(t, l1->trace, sizeof(unsigned long long) * n * 2 * sms, cudaMemcpyDeviceToHost));
    const unsigned long long *tail = t + (size_t)n * sms;
    for (int b = 0; b < (cb ? cb : sms); b++) t0 = (cb ? t : tail)[b * n] < t0 ? (cb ? t : tail)[b * n] : t0;
    float *v = TOOL_MALLOC(sizeof(float) * sms);
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

/* This GPU's memory rate: 256 MiB copied on every SM, median of 5, the slowest rank's. A
 * floor for the memory-bound kernels beside the GEMMs (the owner's sum). */
int copy_rate(comet_comm_t comm, float *gbs)
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
/* The push's calls with its phase marks recorded into t[phase][call]. */
static int push_phase_calls(comet_comm_t comm, cometi_dispatch_gemm_t *l0, cometi_gemm_combine_t *l1,
                            comet_moe_args_t *a, const cudaEvent_t *marks, float *const *t, int iters)
{
    const cometi_combine_knobs_t push = {0, 1, 1, 0, 1};
    for (int it = 0; it < iters; it++) {
        FAIL_IF(cometi_barrier(comm, 0) != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(comm));
        comet_status_t st = cometi_gemm_combine_run(comm, l1, l0, a, &push, 0);
        FAIL_IF(st != COMET_SUCCESS, "layer1 push: %s", comet_comm_last_error(comm));
        CUDA_OK(cudaEventSynchronize(marks[3]));
        for (int i = 0; i < 3; i++) CUDA_OK(cudaEventElapsedTime(&t[i][it], marks[i], marks[i + 1]));
    }
    return 0;
}

int print_push_phases(const cometi_rank_ctx_t *ctx, comet_comm_t comm, cometi_dispatch_gemm_t *l0, cometi_gemm_combine_t *l1,
                      comet_moe_args_t *a, int iters, float gemm_alone_ms, float *sum_ms)
{
    cudaEvent_t marks[4];
    float *t[3], med[3];
    for (int i = 0; i < 4; i++) CUDA_OK(cudaEventCreate(&marks[i]));
    for (int i = 0; i < 3; i++) t[i] = TOOL_MALLOC(sizeof(float) * iters);
    l1->push_marks = marks; /* this function's array: unset on every way out */
    const int failed = push_phase_calls(comm, l0, l1, a, marks, t, iters);
    l1->push_marks = NULL;
    if (failed) return 1;
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

/* --trace: where the fused kernel's time goes against our GEMM alone's (on the
 * fused kernel's schedule, the shared counter): each the last of three calls with the
 * GEMM kernel's tile timeline on (`*trace_slot`: layer0's or layer1's), cut per SM into
 * launch, dispatch, row waits, tiles and tail (harness/timeline.h). Every rank prints its own
 * line: the ranks' routes differ. */
int print_tile_timelines(const cometi_rank_ctx_t *ctx, const timed_call_t *fused,
                         unsigned long long **trace_slot, const char *layer, const char *gemm)
{
    const int sms = fused->comm->sm_count;
    const size_t bytes = sizeof(unsigned long long) * COMETI_TILE_TRACE_WORDS * sms;
    unsigned long long *dev, *host = TOOL_MALLOC(bytes);
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
