/*
 * gpu_util.c - the helpers the GPU tests share (declared in gpu_util.h): skipping without
 * GPUs, launching ranks, opening a communicator, and the MoE fixture with its cases, the
 * baseline's run checked against the float64 reference, and the error measure.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/launch.h"
#include "testutil.h"
#include "gpu_util.h"

/* Skip (returning 0) unless `n` Hopper GPUs are visible. */
int have_gpus(int n)
{
    char why[256];
    int found = cometi_probe_gpus(why, sizeof(why));
    if (found >= n) return 1;
    printf("needs %d Hopper GPU%s, found %d%s%s\n", n, n > 1 ? "s" : "", found, why[0] ? ": " : "", why);
    return 0;
}

int launch(int nranks, cometi_rank_main_t fn, void *arg, int timeout_s)
{
    char report[600];
    int rc = cometi_launch_local(nranks, fn, arg, timeout_s, report, sizeof(report));
    if (rc) printf("launcher: %s\n", report);
    return rc;
}

/* Two ranks with the run's seed as their argument; a skip (saying why) without 2 GPUs. */
int launch_two_seeded(cometi_rank_main_t fn, int timeout_s)
{
    if (!have_gpus(2)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(2, fn, &seed, timeout_s);
}

/* min(2, visible Hopper GPUs) ranks with the run's seed as their argument; a skip (saying
 * why) only without any GPU. */
int launch_seeded(cometi_rank_main_t fn, int timeout_s)
{
    char why[256];
    const int found = cometi_probe_gpus(why, sizeof(why));
    if (found < 1) {
        printf("needs a Hopper GPU, found none%s%s\n", why[0] ? ": " : "", why);
        return TEST_SKIP;
    }
    const int nranks = found < 2 ? found : 2;
    if (nranks == 1) printf("1 Hopper GPU visible%s%s: running at world 1\n", why[0] ? "; " : "", why);
    uint64_t seed = test_seed();
    return launch(nranks, fn, &seed, timeout_s);
}

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

int same_float(float a, float b)
{
    uint32_t x, y;
    memcpy(&x, &a, 4), memcpy(&y, &b, 4);
    return x == y || (isnan(a) && isnan(b));
}

int open_comm(const cometi_rank_ctx_t *ctx, int timeout_ms, comet_comm_t *comm)
{
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    comet_comm_config_t cfg = COMET_COMM_CONFIG_INIT;
    cfg.timeout_ms = timeout_ms;
    comet_status_t st = comet_comm_create_from_id(&ctx->id, ctx->nranks, ctx->rank, &cfg, comm);
    if (st != COMET_SUCCESS) {
        printf("rank %d: comet_comm_create_from_id: %s: %s\n", ctx->rank, comet_status_string(st),
               comet_last_create_error());
        cometi_rank_reason("comet_comm_create_from_id: %s", comet_last_create_error());
        return 1;
    }
    return 0;
}

void fill_bf16(float *f, uint16_t *h, size_t n, double scale, uint64_t *rng)
{
    for (size_t i = 0; i < n; i++) {
        h[i] = cometi_float_to_bf16((float)((2 * cometi_rand_unit(rng) - 1) * scale));
        f[i] = cometi_bf16_to_float(h[i]);
    }
}

/* The tiny preset, with the changes of `shape` (NULL: none). */
int fixture_open(fixture_t *fx, const cometi_rank_ctx_t *ctx, uint64_t seed, const fixture_shape_t *shape)
{
    memset(fx, 0, sizeof(*fx));
    fx->ctx = ctx;
    fx->seed = seed;
    if (open_comm(ctx, shape && shape->timeout_ms ? shape->timeout_ms : 10000, &fx->comm)) return 1;
    CHECK_EQ(comet_moe_config_preset("tiny", 512, &fx->cfg), COMET_SUCCESS);
    if (shape && shape->ffn) fx->cfg.ffn = shape->ffn;
    if (shape && shape->hidden) fx->cfg.hidden = shape->hidden;
    if (shape && shape->top_k) fx->cfg.top_k = shape->top_k;
    if (shape && shape->tp) fx->cfg.tp_size = shape->tp;
    comet_status_t st = comet_moe_create(fx->comm, &fx->cfg, &fx->moe);
    if (st != COMET_SUCCESS) {
        printf("comet_moe_create: %s\n", comet_last_create_error());
        return 1;
    }
    const int E = fx->cfg.num_experts, H = fx->cfg.hidden, F = fx->cfg.ffn, M = fx->cfg.max_tokens,
              k = fx->cfg.top_k;
    const int tp = fx->cfg.tp_size > 0 ? fx->cfg.tp_size : 1, t_rank = ctx->rank % tp, Fl = F / tp;
    fx->per = E / (ctx->nranks / tp);
    fx->first = ctx->rank / tp * fx->per;
    /* Every rank draws all experts' weights from the same seed, so each can compute the
     * reference for its own tokens; it uploads only its own experts, and with TP only its
     * ffn columns [t_rank * F / tp, (t_rank + 1) * F / tp): those rows of gate and of up,
     * those columns of down. */
    uint64_t rng = seed;
    size_t n_gu = (size_t)E * 2 * F * H, n_dn = (size_t)E * H * F;
    fx->gate_up = malloc(sizeof(float) * n_gu);
    fx->down = malloc(sizeof(float) * n_dn);
    uint16_t *gu16 = malloc(2 * n_gu), *dn16 = malloc(2 * n_dn);
    fill_bf16(fx->gate_up, gu16, n_gu, 1.0 / sqrt(H), &rng);
    fill_bf16(fx->down, dn16, n_dn, 1.0 / sqrt(F), &rng);
    const size_t slice = (size_t)Fl * H; /* elements of one expert's gate (or up, or down) slice */
    uint16_t *gu_mine = malloc(2 * 2 * slice * fx->per), *dn_mine = malloc(2 * slice * fx->per);
    for (int le = 0; le < fx->per; le++) {
        const uint16_t *g = gu16 + (size_t)2 * F * H * (fx->first + le), *d = dn16 + (size_t)H * F * (fx->first + le);
        memcpy(gu_mine + 2 * slice * le, g + (size_t)t_rank * Fl * H, 2 * slice);
        memcpy(gu_mine + 2 * slice * le + slice, g + ((size_t)F + (size_t)t_rank * Fl) * H, 2 * slice);
        for (int h = 0; h < H; h++)
            memcpy(dn_mine + slice * le + (size_t)h * Fl, d + (size_t)h * F + (size_t)t_rank * Fl, 2 * (size_t)Fl);
    }
    CUDA_OK(cudaMalloc(&fx->d_gate_up, 2 * 2 * slice * fx->per));
    CUDA_OK(cudaMalloc(&fx->d_gate, 2 * slice * fx->per));
    CUDA_OK(cudaMalloc(&fx->d_up, 2 * slice * fx->per));
    CUDA_OK(cudaMalloc(&fx->d_down, 2 * slice * fx->per));
    CUDA_OK(cudaMemcpy(fx->d_gate_up, gu_mine, 2 * 2 * slice * fx->per, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx->d_down, dn_mine, 2 * slice * fx->per, cudaMemcpyHostToDevice));
    /* The same weights as two tensors: gate rows and up rows of each expert. */
    for (int le = 0; le < fx->per; le++) {
        const uint16_t *g = gu_mine + 2 * slice * le;
        CUDA_OK(cudaMemcpy((char *)fx->d_gate + 2 * slice * le, g, 2 * slice, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy((char *)fx->d_up + 2 * slice * le, g + slice, 2 * slice, cudaMemcpyHostToDevice));
    }
    free(gu16), free(dn16), free(gu_mine), free(dn_mine);
    CUDA_OK(cudaMalloc(&fx->d_x, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc(&fx->d_y, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc((void **)&fx->d_ids, sizeof(int32_t) * M * k));
    CUDA_OK(cudaMalloc((void **)&fx->d_w, sizeof(float) * M * k));
    fx->ref = malloc(sizeof(double) * (size_t)M * H);
    return 0;
}

void fixture_close(fixture_t *fx)
{
    comet_moe_destroy(fx->moe);
    void *d[] = {fx->d_gate_up, fx->d_gate, fx->d_up, fx->d_down, fx->d_x, fx->d_y, fx->d_ids, fx->d_w};
    for (int i = 0; i < 8; i++) cudaFree(d[i]);
    comet_comm_destroy(fx->comm);
    free(fx->gate_up);
    free(fx->down);
    free(fx->ref);
}

/* Runs one case on this rank and checks it against the reference. *bad_expert >= 0
 * plants that id at token 5, choice 1 (to test the error path); returns the status. */
int run_case(fixture_t *fx, const moe_case_t *c, uint64_t case_seed, int plant_bad_id,
                    comet_status_t *status, double *rel_err)
{
    const int me = fx->ctx->rank, H = fx->cfg.hidden, F = fx->cfg.ffn, E = fx->cfg.num_experts,
              k = fx->cfg.top_k;
    const int m = c->tokens[me % 2];
    uint64_t rng = case_seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(me + 7));
    float *x = malloc(sizeof(float) * ((size_t)m * H + 1));
    uint16_t *x16 = malloc(2 * ((size_t)m * H + 1));
    fill_bf16(x, x16, (size_t)m * H, 1.0, &rng);
    int32_t *ids = malloc(sizeof(int32_t) * (m * k + 1));
    float *w = malloc(sizeof(float) * (m * k + 1));
    if (c->few_experts) {
        static const int32_t keep[4] = {0, 1, 5, 6};
        cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, 4, case_seed, me, ids, w);
        for (int i = 0; i < m * k; i++) ids[i] = keep[ids[i]];
    } else {
        cometi_make_routing(c->routing, c->skew, m, k, E, case_seed, me, ids, w);
    }
    if (plant_bad_id && m > 5) ids[5 * k + 1] = E;
    CUDA_OK(cudaMemcpy(fx->d_x, x16, (size_t)m * H * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx->d_ids, ids, sizeof(int32_t) * m * k, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx->d_w, w, sizeof(float) * m * k, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(fx->d_y, 0xff, (size_t)fx->cfg.max_tokens * H * 2)); /* poison: bf16 NaN */
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = m;
    a.x = fx->d_x;
    a.topk_ids = fx->d_ids;
    a.topk_weights = fx->d_w;
    a.y = fx->d_y;
    a.impl = COMET_IMPL_BASELINE;
    a.weights.down = fx->d_down;
    if (c->separate_gate_up) {
        a.weights.gate = fx->d_gate;
        a.weights.up = fx->d_up;
    } else {
        a.weights.gate_up = fx->d_gate_up;
    }
    *status = comet_moe_forward(fx->moe, &a, 0);
    CUDA_OK(cudaDeviceSynchronize());
    *rel_err = 0;
    if (*status == COMET_SUCCESS && m > 0 && !fx->skip_reference) {
        uint16_t *y16 = malloc(2 * (size_t)m * H);
        float *y = malloc(sizeof(float) * (size_t)m * H);
        double *ref = fx->ref;
        CUDA_OK(cudaMemcpy(y16, fx->d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < (size_t)m * H; i++) y[i] = cometi_bf16_to_float(y16[i]);
        cometi_ref_problem_t p = {H, F, E, k, m, x, ids, w, fx->gate_up, fx->down};
        cometi_reference_moe(&p, ref);
        *rel_err = cometi_rel_error(y, ref, (size_t)m * H);
        /* Row by row too, so one wrong row cannot hide in the norm. */
        for (int t = 0; t < m; t++) {
            double row = cometi_rel_error(y + (size_t)t * H, ref + (size_t)t * H, H);
            if (row > 3e-2) {
                printf("%s: rank %d token %d: row relative error %.3g\n", c->name, me, t, row);
                *rel_err = row > *rel_err ? row : *rel_err;
                break;
            }
        }
        free(y16), free(y);
    }
    free(x), free(x16), free(ids), free(w);
    return 0;
}

const moe_case_t cases[] = {
    {"balanced", COMETI_ROUTING_BALANCED, 1, {256, 256}, 0, 0},
    {"random, M not a multiple of 128", COMETI_ROUTING_RANDOM, 1, {300, 77}, 1, 0},
    {"skewed x16", COMETI_ROUTING_SKEWED, 16, {200, 129}, 0, 0},
    {"every token to expert 3", COMETI_ROUTING_ONE_EXPERT, 3, {128, 128}, 0, 0},
    {"every token to expert 6", COMETI_ROUTING_ONE_EXPERT, 6, {64, 300}, 1, 0},
    {"experts without rows", COMETI_ROUTING_RANDOM, 1, {250, 250}, 0, 1},
    {"a rank with no tokens", COMETI_ROUTING_RANDOM, 1, {0, 200}, 0, 0},
    {"max tokens", COMETI_ROUTING_RANDOM, 1, {512, 512}, 1, 0},
};

/* The arguments run_case gave the baseline, for the fused path. */
comet_moe_args_t fused_args(const fixture_t *fx, const moe_case_t *c)
{
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = c->tokens[fx->ctx->rank % 2];
    a.x = fx->d_x;
    a.topk_ids = fx->d_ids;
    a.topk_weights = fx->d_w;
    a.y = fx->d_y;
    a.weights.down = fx->d_down;
    if (c->separate_gate_up) a.weights.gate = fx->d_gate, a.weights.up = fx->d_up;
    else a.weights.gate_up = fx->d_gate_up;
    return a;
}

/* Squared error and norm of `got` (bf16 rows x cols) against `want` (bf16) or `ref`
 * (float64), added to *num and *den; the worst row's relative error raises *worst_row.
 * NaN or Inf in `got`, or one element past its own bound, makes the row's error infinite
 * (and prints the element), so every caller's row check is element-wise too.
 *
 * The element bound, from bf16: a layer's output sums F products of values rounded to bf16
 * (2^-9 relative) up to three times on the way (the activation, the expert's output row,
 * a rank's partial sum); summed over F terms of both signs those roundings err like a
 * random walk, about 2^-8 of the row's RMS per element, so the worst of 10^6 elements
 * (5 standard deviations) stays under 2%; ELEM_RMS allows 5%. The output's own two
 * roundings add 2^-8 of the element itself (ELEM_REL 2^-7). An element from a wrong
 * weight row, a lost or doubled choice or a stale slot errs by the order of the RMS: 20
 * times the bound. Rows whose reference is all zero keep the row check alone. */
#define ELEM_RMS 0.05
#define ELEM_REL (1.0 / 128)

void add_error(const uint16_t *got, const uint16_t *want, const double *ref, size_t rows, int cols,
               double *num, double *den, double *worst_row)
{
    add_error_rel(got, want, ref, rows, cols, ELEM_REL, num, den, worst_row);
}

void add_error_rel(const uint16_t *got, const uint16_t *want, const double *ref, size_t rows, int cols,
                   double elem_rel, double *num, double *den, double *worst_row)
{
    for (size_t r = 0; r < rows; r++) {
        double rn = 0, rd = 0;
        for (int f = 0; f < cols; f++) {
            const size_t i = r * cols + f;
            const double w = want ? cometi_bf16_to_float(want[i]) : ref[i], v = cometi_bf16_to_float(got[i]);
            if (!isfinite(v)) rn = INFINITY;
            rn += (v - w) * (v - w);
            rd += w * w;
        }
        const double rms = sqrt(rd / cols);
        for (int f = 0; f < cols && rms > 0 && isfinite(rn); f++) {
            const size_t i = r * cols + f;
            const double w = want ? cometi_bf16_to_float(want[i]) : ref[i], v = cometi_bf16_to_float(got[i]);
            const double bound = elem_rel * fabs(w) + ELEM_RMS * rms;
            if (!(fabs(v - w) <= bound)) {
                printf("row %zu, column %d: %.6g against %.6g, |error| %.3g past its bound %.3g (%.2f of the "
                       "row's RMS %.3g)\n", r, f, v, w, fabs(v - w), bound, fabs(v - w) / rms, rms);
                rn = INFINITY;
            }
        }
        const double e = rd > 0 ? sqrt(rn / rd) : sqrt(rn);
        if (!(e <= *worst_row)) *worst_row = e;
        *num += rn;
        *den += rd;
    }
}

/* The GPU, and the host-mapped word where a stuck GEMM pipeline reports. */
int gemm_setup(const cometi_rank_ctx_t *ctx, cometi_async_error_t **host, cometi_async_error_t **dev)
{
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    CUDA_OK(cudaHostAlloc((void **)host, sizeof(**host), cudaHostAllocMapped));
    memset(*host, 0, sizeof(**host));
    CUDA_OK(cudaHostGetDevicePointer((void **)dev, *host, 0));
    return 0;
}

int check_cut_units(const unsigned long long *trace, int sms, const void *ws, int plan_units, const char *what)
{
    unsigned long long *rows = malloc((size_t)sms * COMETI_TILE_TRACE_WORDS * 8);
    CHECK(rows != NULL);
    CUDA_OK(cudaMemcpy(rows, trace, (size_t)sms * COMETI_TILE_TRACE_WORDS * 8, cudaMemcpyDeviceToHost));
    long long units = 0;
    for (int blk = 0; blk < sms; blk++) units += (long long)rows[(size_t)blk * COMETI_TILE_TRACE_WORDS + 2];
    free(rows);
    if (units != plan_units) printf("%s: %lld units taken, the plan has %d\n", what, units, plan_units);
    CHECK_EQ(units, plan_units);
    unsigned long long counters[COMETI_GEMM_TAIL_COUNTERS];
    CUDA_OK(cudaMemcpy(counters, ws, sizeof(counters), cudaMemcpyDeviceToHost));
    for (int i = 0; i < COMETI_GEMM_TAIL_COUNTERS; i++) CHECK_EQ(counters[i], 0);
    return 0;
}

/* Segments of the given sizes, each starting on a 128-row boundary as the MoE layout
 * pads them; returns the rows they span. */
int padded_segments(const int *sizes, int groups, cometi_segment_t *segs)
{
    int rows = 0;
    for (int g = 0; g < groups; g++) {
        segs[g] = (cometi_segment_t){rows, sizes[g]};
        rows += (sizes[g] + 127) / 128 * 128;
    }
    return rows;
}

int fixture_open_timed(fixture_t *fx, const cometi_rank_ctx_t *ctx, uint64_t seed, const moe_case_t *c,
                       comet_moe_args_t *a)
{
    const fixture_shape_t shape = {256, 0, 0, 2000, 0};
    if (fixture_open(fx, ctx, seed, &shape)) return 1;
    comet_status_t st;
    double rel;
    fx->skip_reference = 1;
    if (run_case(fx, c, seed, 0, &st, &rel)) return 1; /* inputs in place */
    *a = fused_args(fx, c);
    a->impl = COMET_IMPL_FUSED;
    return 0;
}

static long host_rss_pages(void)
{
    long size = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld", &size, &resident) != 2) resident = 0;
        fclose(f);
    }
    return resident;
}

int memory_mark(memory_mark_t *m)
{
    size_t free_b = 0, total = 0;
    if (cudaDeviceSynchronize() != cudaSuccess || cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 1;
    m->device_used = (long long)(total - free_b);
    m->host_pages = host_rss_pages();
    return 0;
}
