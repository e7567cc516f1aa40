/*
 * bench_case.c - one case of `comet bench`: synthetic weights and inputs (hash-generated
 * on the GPU, so the host can rebuild any element), a float64 check of sample tokens,
 * warm-up, then timed calls of the baseline with inputs rotated across sets larger than
 * L2; then comet beside it: the fused layers' sweeps, comet_moe_forward as a user calls
 * it, and (in the suite) the whole layer against our GEMMs alone and cuBLAS's; with --train,
 * the training calls last (bench_train.c).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "baseline/baseline.h"
#include "patterns/dispatch_gemm.h"
#include "patterns/gemm_combine.h"
#include "patterns/tune.h"
#include "bench.h"
#include "alloc.h"
#include "tool.h"

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
    double *x = TOOL_MALLOC(sizeof(double) * H), *act = TOOL_MALLOC(sizeof(double) * F);
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

/* ||got - want|| / ||want|| over n bf16 values on the device (infinite if got has a NaN
 * or Inf), the worst over ranks. */
static int y_error(comet_comm_t comm, const void *got_dev, const void *want_dev, size_t n, double *out)
{
    uint16_t *want = TOOL_MALLOC(2 * n + 2), *got = TOOL_MALLOC(2 * n + 2);
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

static int time_layer0(comet_comm_t comm, cometi_dispatch_gemm_t *l0, comet_moe_args_t *a, void **x, int32_t **ids,
                       float **w, const cometi_dispatch_knobs_t *knobs, int warmup, int iters, int what,
                       float *out)
{
    const timed_call_t c = {what, comm, NULL, l0, NULL, a, x, ids, w, knobs, NULL, NULL, NULL};
    return time_calls(&c, warmup, iters, out);
}

/* Layer1 (or GEMM1 alone) on what layer0 left. */
static int time_layer1(comet_comm_t comm, cometi_dispatch_gemm_t *l0, cometi_gemm_combine_t *l1, comet_moe_args_t *a, void **x,
                       int32_t **ids, float **w, const cometi_combine_knobs_t *k1, int warmup, int iters, int what,
                       float *out)
{
    const timed_call_t c = {what, comm, NULL, l0, l1, a, x, ids, w, NULL, k1, NULL, NULL};
    return time_calls(&c, warmup, iters, out);
}

/* The fused layer1 on the rows layer0 left (input set 0, whose baseline output is in
 * a->y): a sweep of combine blocks x column splits, our GEMM1 alone in turns with the
 * best, y against the baseline's on every token; then the whole layer with the best
 * settings of both sweeps, in turns with the cost model's and the baseline. */
static int run_layer1(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm, comet_moe_t moe,
                      const comet_moe_config_t *cfg, const char *label, comet_moe_args_t *a, cometi_dispatch_gemm_t *l0,
                      void **x, int32_t **ids, float **w, case_result_t *res)
{
    /* {combine blocks, splits, dynamic tiles, tail, push}: first the GEMM then the combine on
     * every SM (no overlap), then the push (rows sent home from GEMM1's epilogue, on either
     * tile schedule), then combine blocks beside the GEMM with the last split's combine on
     * every SM after it, then a few without that tail. */
    static const cometi_combine_knobs_t sweep[] = {
        {0, 1, 1, 1, 0},  {0, 1, 1, 0, 1},  {0, 1, 0, 0, 1},  {4, 2, 1, 1, 0},  {4, 4, 1, 1, 0},
        {8, 2, 1, 1, 0},  {8, 4, 1, 1, 0},  {16, 2, 1, 1, 0}, {16, 4, 1, 1, 0}, {24, 2, 1, 1, 0},
        {24, 4, 1, 1, 0}, {8, 4, 1, 0, 0},  {16, 2, 1, 0, 0}, {24, 2, 1, 0, 0}};
    /* Splits divide the column tiles, and need whole ones (a partial last tile: 1 split). */
    const int H = cfg->hidden, M = cfg->max_tokens, tile = cometi_gemm_tile_n(H), tiles = H % tile ? 1 : H / tile;
    cometi_gemm_combine_t l1;
    comet_status_t st = cometi_gemm_combine_create(comm, cfg, l0, &l1);
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
        const cometi_combine_knobs_t *k = i < listed ? &sweep[i] : &model.l1;
        if (i == listed && model_run >= 0) break;
        if (tiles % k->n_splits) continue;
        if (cfg->tp_size > 1 && !k->push) continue; /* only the push sums TP partials */
        if (k->push && ctx->nranks > COMETI_PUSH_MAX_RANKS) continue; /* past the push's reach */
        if (!memcmp(k, &model.l1, sizeof(*k))) model_run = res->l1_runs;
        float ms;
        if (time_layer1(comm, l0, &l1, a, x, ids, w, k, o->warmup, o->iters, L1_FUSED, &ms)) return 1;
        if (allreduce(comm, &ms, 1, ncclMax)) return 1;
        res->l1_knobs[res->l1_runs] = *k;
        res->l1_ms[res->l1_runs] = ms;
        if (ms < res->l1_ms[res->l1_best]) res->l1_best = res->l1_runs;
        res->l1_runs++;
    }
    timed_call_t calls[SWEEP_MAX];
    for (int i = 0; i < res->l1_runs; i++)
        calls[i] = (timed_call_t){L1_FUSED, comm, NULL, l0, &l1, a, x, ids, w, NULL, &res->l1_knobs[i], NULL, NULL};
    res->l1_best = best_in_turns(calls, res->l1_ms, res->l1_runs, model_run, o->iters, &res->l1_paired_ms,
                                 &res->l1_gemm_alone_ms, res->l1_alone_each);
    if (res->l1_best < 0) return 1;
    const cometi_combine_knobs_t *best = &res->l1_knobs[res->l1_best];
    if (!o->suite && ctx->nranks <= COMETI_PUSH_MAX_RANKS &&
        print_push_phases(ctx, comm, l0, &l1, a, o->iters, res->l1_gemm_alone_ms, &res->push_sum_ms))
        return 1;
    if (!o->suite && copy_rate(comm, &res->copy_gbs)) return 1;
    if (o->trace && print_tile_timelines(ctx, &calls[res->l1_best], &l1.tile_trace, "layer1", "GEMM1")) return 1;
    /* y on poisoned output against the baseline's, every token. */
    CUDA_OK(cudaMemset(y, 0xff, (size_t)M * H * 2));
    FAIL_IF(cometi_barrier(comm, 0) != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(comm));
    st = cometi_gemm_combine_run(comm, &l1, l0, a, best, 0);
    FAIL_IF(st != COMET_SUCCESS, "layer1 (%s): %s", label, comet_comm_last_error(comm));
    CUDA_OK(cudaDeviceSynchronize());
    st = comet_comm_get_async_error(comm);
    FAIL_IF(st != COMET_SUCCESS, "layer1 (%s): %s", label, comet_comm_last_error(comm));
    if (o->trace && !best->push && ctx->rank == 0 && print_layer1_trace(comm, &l1, best)) return 1;
    if (y_error(comm, y, y_base, (size_t)M * H, &res->l1_diff)) return 1;
    /* The whole layer, each call one measurement from the route to layer1's end, in turns on
     * input set 0: what `comet tune` writes (the sweeps' best of each layer), what the cost
     * model picks, and the whole baseline, so the three share the run's clocks (each timed
     * back to back would run at its own). */
    if (ctx->rank == 0) fprintf(stderr, "[bench] %s: the whole layer in turns\n", label);
    const timed_call_t turns = {WHOLE_BEST, comm, moe, l0, &l1, a, x, ids, w, &res->l0_knobs[res->l0_best], best,
                                &model, NULL};
    const int whats[3] = {WHOLE_BEST, WHOLE_MODEL, BASE_WHOLE};
    float med[3];
    if (time_in_turns(&turns, whats, 3, o->iters, med)) return 1;
    res->tuned_turns_ms = med[0], res->model_turns_ms = med[1], res->baseline_turns_ms = med[2];
    res->model_knobs = model;
    a->y = y_base;
    cudaFree(y);
    cometi_gemm_combine_destroy(comm, &l1);
    return 0;
}

/* The fused layer0 on the same inputs: a sweep of dispatch-block counts, our GEMM0 alone
 * on the same rows, and its activations against the baseline's on sampled rows. */
static int run_layer0(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm, comet_moe_t moe,
                      const comet_moe_config_t *cfg, const char *label, comet_moe_args_t *a, void **x,
                      int32_t **ids, float **w, case_result_t *res)
{
    /* Bulk copies from 2 to 24 blocks (TP copies every row twice); the store copy only at 4
     * and 8 blocks, where it did best in earlier sweeps (it never beat the bulk copy at equal
     * blocks, so it stays a mode). */
    static const cometi_dispatch_knobs_t sweep[] = {
        {2, COMETI_DISPATCH_BULK, 0},  {3, COMETI_DISPATCH_BULK, 0},  {4, COMETI_DISPATCH_BULK, 0},
        {6, COMETI_DISPATCH_BULK, 0},  {8, COMETI_DISPATCH_BULK, 0},  {12, COMETI_DISPATCH_BULK, 0},
        {16, COMETI_DISPATCH_BULK, 0}, {20, COMETI_DISPATCH_BULK, 0}, {24, COMETI_DISPATCH_BULK, 0},
        {4, COMETI_DISPATCH_STORES, 0}, {8, COMETI_DISPATCH_STORES, 0}};
    cometi_dispatch_gemm_t l0;
    comet_status_t st = cometi_dispatch_gemm_create(comm, cfg, &l0);
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
        const cometi_dispatch_knobs_t *k = i < listed ? &sweep[i] : &model.l0;
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
        calls[i] = (timed_call_t){L0_FUSED, comm, NULL, &l0, NULL, a, x, ids, w, &res->l0_knobs[i], NULL, NULL, NULL};
    res->l0_best = best_in_turns(calls, res->l0_ms, res->l0_runs, model_run, o->iters, &res->l0_paired_ms,
                                 &res->l0_gemm_alone_ms, res->l0_alone_each);
    if (res->l0_best < 0) return 1;
    if (o->trace && print_tile_timelines(ctx, &calls[res->l0_best], &l0.tile_trace, "layer0", "GEMM0")) return 1;
    /* Same inputs through both paths; compare up to 64 rows at each end of every segment. */
    a->x = x[0], a->topk_ids = ids[0], a->topk_weights = w[0];
    st = comet_moe_forward(moe, a, 0);
    FAIL_IF(st != COMET_SUCCESS, "forward (%s): %s", label, comet_moe_last_error(moe));
    st = cometi_dispatch_gemm_run(comm, &l0, a, &res->l0_knobs[res->l0_best], 0);
    FAIL_IF(st != COMET_SUCCESS, "layer0 (%s): %s", label, comet_comm_last_error(comm));
    CUDA_OK(cudaDeviceSynchronize());
    const void *b_recv, *b_act;
    struct cometi_baseline *base;
    st = cometi_moe_baseline(moe, &base);
    FAIL_IF(st != COMET_SUCCESS, "baseline buffers: %s", comet_moe_last_error(moe));
    cometi_baseline_buffers(base, &b_recv, &b_act);
    const int per = l0.experts_per_group, F = l0.ffn;
    cometi_segment_t *segs = TOOL_MALLOC(sizeof(cometi_segment_t) * per);
    CUDA_OK(cudaMemcpy(segs, l0.route.plan.local_segs, sizeof(cometi_segment_t) * per, cudaMemcpyDeviceToHost));
    uint16_t *want = TOOL_MALLOC((size_t)64 * F * 2), *got = TOOL_MALLOC((size_t)64 * F * 2);
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
    if (run_layer1(ctx, o, comm, moe, cfg, label, a, &l0, x, ids, w, res)) return 1;
    /* The route alone, last: it raises the arrival totals the next fused call would wait for,
     * with no rows behind them, so no fused call may follow on this layer0. */
    if (time_layer0(comm, &l0, a, x, ids, w, NULL, o->warmup, o->iters, L0_ROUTE_ALONE, &res->l0_route_ms))
        return 1;
    if (allreduce(comm, &res->l0_route_ms, 1, ncclMax)) return 1;
    free(segs), free(want), free(got);
    cometi_dispatch_gemm_destroy(comm, &l0);
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
    const timed_call_t c = {WHOLE_PUBLIC, comm, moe, NULL, NULL, &f, x, ids, w, NULL, NULL, NULL, NULL};
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
 * clocks (the GPUs are power-limited; back to back, the whole baseline came out faster
 * than its own cuBLAS expert phase timed in turns), in turns the drift falls on all alike. */
static int run_overlap_bound(const cometi_rank_ctx_t *ctx, comet_comm_t comm, comet_moe_t moe,
                             const comet_moe_config_t *cfg, const char *label, comet_moe_args_t *a, void **x,
                             int32_t **ids, float **w, int rounds, case_result_t *res)
{
    cometi_dispatch_gemm_t l0;
    cometi_gemm_combine_t l1;
    comet_status_t st = cometi_dispatch_gemm_create(comm, cfg, &l0);
    FAIL_IF(st != COMET_SUCCESS, "layer0 (%s): %s", label, comet_comm_last_error(comm));
    st = cometi_gemm_combine_create(comm, cfg, &l0, &l1);
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
    const timed_call_t base = {WHOLE_BEST, comm, moe, &l0, &l1, a, x, ids, w, &k.l0, &k.l1, NULL, NULL};
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
    cometi_gemm_combine_destroy(comm, &l1);
    cometi_dispatch_gemm_destroy(comm, &l0);
    return 0;
}

int run_baseline_case(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm,
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
    int32_t *ids_host = TOOL_MALLOC(sizeof(int32_t) * ((size_t)M * k + 1));
    float *w_host = TOOL_MALLOC(sizeof(float) * ((size_t)M * k + 1)), *w0_host = TOOL_MALLOC(sizeof(float) * ((size_t)M * k + 1));
    int32_t *ids0_host = TOOL_MALLOC(sizeof(int32_t) * ((size_t)M * k + 1));
    double rows_in = 0;
    for (int set = 0; set < NSETS; set++) {
        CUDA_OK(cudaMalloc(&x[set], (size_t)M * H * 2 + 16));
        CUDA_OK(cudaMalloc((void **)&ids[set], sizeof(int32_t) * ((size_t)M * k + 1)));
        CUDA_OK(cudaMalloc((void **)&w[set], sizeof(float) * ((size_t)M * k + 1)));
        CUDA_OK(cometi_fill_hash_bf16(x[set], (size_t)M * H, s.x[set], (uint64_t)me * M * H, 1.0f, 0));
        for (int r = 0; r < R; r++) {
            cometi_make_routing(o->routing, o->skew, M, k, E, s.routing[set], r, ids_host, w_host);
            int64_t *counts = TOOL_CALLOC((size_t)E, sizeof(int64_t));
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
        uint16_t *row = TOOL_MALLOC((size_t)H * 2);
        float *rowf = TOOL_MALLOC(sizeof(float) * H);
        double *ref = TOOL_MALLOC(sizeof(double) * H), worst = 0;
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
    for (int p = 0; p < P_COUNT; p++) times[p] = TOOL_MALLOC(sizeof(float) * o->iters);
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
    if (o->train && run_train(ctx, o, comm, moe, cfg, label, &a, x, ids, w, &res->train)) return 1;
    for (int set = 0; set < NSETS; set++) cudaFree(x[set]), cudaFree(ids[set]), cudaFree(w[set]);
    cudaFree(gate_up), cudaFree(down), cudaFree(y);
    comet_moe_destroy(moe);
    return 0;
}
