/*
 * cmd_gemm.c - `comet gemm`: comet's grouped GEMM beside cuBLAS on one GPU, on every
 * preset's expert shapes (GEMM0: n = 2F, k = H; GEMM1: n = H, k = F; rows per expert as
 * balanced EP = 2 routing of 8192 tokens per GPU gives) and on 8192^3. Each variant's
 * output is checked against cuBLAS's on poisoned memory before it is timed. Ours cuts a
 * short last wave along k (tail_ws), as the fused layers do, unless a variant says not.
 * Then the backward's GEMMs: the data gradients and the weight gradients. --gemms picks
 * the tables.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "baseline/baseline.h"
#include "pointwise/pointwise.h"
#include "layer/layer.h"
#include "gemm/gemm.h"
#include "alloc.h"
#include "tool.h"


typedef struct shape {
    char name[48];
    int groups, rows, n, k; /* rows per group */
    int b_mn;               /* B_g stored [k][n] (a dgrad GEMM's weight), else [n][k] */
    int wgrad;              /* a weight gradient: C_g [k][n] = A_g^T B_g over the group's `rows`
                             * rows of A [rows][k] and B [rows][n] (k plays m_out) */
} shape_t;

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* ||x - y|| / ||y|| over n bf16 values; any non-finite x gives +inf. */
double gemm_rel_diff(const uint16_t *x, const uint16_t *y, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double a = cometi_bf16_to_float(x[i]), b = cometi_bf16_to_float(y[i]);
        if (!isfinite(a)) return INFINITY;
        num += (a - b) * (a - b);
        den += b * b;
    }
    return den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0);
}

typedef struct run_ctx {
    cometi_gemm_t g;
    cometi_gemm_splits_t splits; /* g.roles.splits points here when set */
    cublasHandle_t cublas;
    const shape_t *sh;
    const void *a, *b;
    void *c;
    char err[COMETI_ERR_LEN];
} run_ctx_t;

static int run_ours(void *p, cudaStream_t s)
{
    run_ctx_t *r = p;
    return cometi_gemm_run(r->err, &r->g, s) != COMET_SUCCESS;
}

static int run_cublas(void *p, cudaStream_t s)
{
    run_ctx_t *r = p;
    const shape_t *sh = r->sh;
    (void)s;
    const float one = 1.0f, zero = 0.0f;
    for (int g = 0; g < sh->groups; g++) {
        const char *a = (const char *)r->a + (size_t)g * sh->rows * sh->k * 2;
        const char *b = (const char *)r->b + (size_t)g * sh->n * sh->k * 2;
        char *c = (char *)r->c + (size_t)g * sh->rows * sh->n * 2;
        if (sh->wgrad) { /* row-major C_g [k][n] = A_g^T B_g, A_g [rows][k], B_g [rows][n] */
            if (cublasGemmEx(r->cublas, CUBLAS_OP_N, CUBLAS_OP_T, sh->n, sh->k, sh->rows, &one,
                             (const char *)r->b + (size_t)g * sh->rows * sh->n * 2, CUDA_R_16BF, sh->n,
                             (const char *)r->a + (size_t)g * sh->rows * sh->k * 2, CUDA_R_16BF, sh->k, &zero,
                             (char *)r->c + (size_t)g * sh->k * sh->n * 2, CUDA_R_16BF, sh->n, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
                snprintf(r->err, sizeof(r->err), "cublasGemmEx (wgrad) failed");
                return 1;
            }
        } else if (sh->b_mn) { /* row-major C = A B, B [k][n]: cuBLAS's "NN" */
            if (cublasGemmEx(r->cublas, CUBLAS_OP_N, CUBLAS_OP_N, sh->n, sh->rows, sh->k, &one, b, CUDA_R_16BF, sh->n,
                             a, CUDA_R_16BF, sh->k, &zero, c, CUDA_R_16BF, sh->n, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
                snprintf(r->err, sizeof(r->err), "cublasGemmEx (NN) failed");
                return 1;
            }
        } else if (cometi_cublas_rows(r->cublas, r->err, sh->rows, sh->n, sh->k, a, b, c, sh->n) != COMET_SUCCESS) {
            return 1;
        }
    }
    return 0;
}

/* Median milliseconds of `iters` runs after `warmup`; the fastest and slowest too. */
float gemm_time_ms(runner_t fn, void *ctx, int warmup, int iters, int *failed, float *lo, float *hi)
{
    cudaEvent_t e0, e1;
    float t[64], ms = 0;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < warmup; i++) *failed |= fn(ctx, 0);
    for (int i = 0; i < iters; i++) {
        cudaEventRecord(e0, 0);
        *failed |= fn(ctx, 0);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&t[i], e0, e1);
    }
    qsort(t, (size_t)iters, sizeof(float), cmp_float);
    ms = t[iters / 2];
    if (lo) *lo = t[0];
    if (hi) *hi = t[iters - 1];
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ms;
}

/* A [groups * rows][k] and B [groups][n][k], hash-filled from the shape's seeds, and the
 * group table (group g is A rows [g * rows, (g + 1) * rows)) on the device. */
static int make_operands(const tool_options_t *o, const shape_t *sh, int si, void **a, void **b,
                         cometi_segment_t **segs)
{
    /* B: [groups][n][k] (or [k][n]); a weight gradient's [groups x rows][n]. */
    const size_t na = (size_t)sh->groups * sh->rows * sh->k,
                 nb = (size_t)sh->groups * sh->n * (sh->wgrad ? sh->rows : sh->k);
    cometi_segment_t *host = TOOL_MALLOC(sizeof(cometi_segment_t) * sh->groups);
    FAIL_IF(!host, "out of host memory");
    for (int g = 0; g < sh->groups; g++) host[g] = (cometi_segment_t){g * sh->rows, sh->rows};
    CUDA_OK(cudaMalloc(a, na * 2));
    CUDA_OK(cudaMalloc(b, nb * 2));
    CUDA_OK(cudaMalloc((void **)segs, sizeof(cometi_segment_t) * sh->groups));
    CUDA_OK(cudaMemcpy(*segs, host, sizeof(cometi_segment_t) * sh->groups, cudaMemcpyHostToDevice));
    free(host);
    CUDA_OK(cometi_fill_hash_bf16(*a, na, o->seed + 2 * si, 0, 1.0f, 0));
    CUDA_OK(cometi_fill_hash_bf16(*b, nb, o->seed + 2 * si + 1, 0, (float)(1.0 / sqrt(sh->wgrad ? sh->rows : sh->k)),
                                  0));
    return 0;
}

typedef struct swiglu_ctx {
    run_ctx_t gemm;         /* cuBLAS GEMM0 into h */
    void *h, *act;
    const cometi_segment_t *segs;
    int ffn, groups, rows;
} swiglu_ctx_t;

/* What the baseline runs: cuBLAS GEMM0 per expert into h [rows][2F], then SwiGLU. */
static int run_cublas_swiglu(void *p, cudaStream_t s)
{
    swiglu_ctx_t *x = p;
    if (run_cublas(&x->gemm, s)) return 1;
    return cometi_launch_swiglu(x->h, x->act, x->ffn, x->segs, x->groups, x->rows, s) != cudaSuccess;
}

/* GEMM0 with SwiGLU fused into the epilogue, against cuBLAS GEMM0 + the SwiGLU kernel. */
static int time_swiglu(const tool_options_t *o, const shape_t *sh, cublasHandle_t cublas,
                       cometi_async_error_t *err_host, cometi_async_error_t *err_dev, int si, void *tail_ws)
{
    const int F = sh->n / 2;
    const size_t rows = (size_t)sh->groups * sh->rows;
    void *a, *b, *h, *act_ref, *act;
    cometi_segment_t *segs;
    if (make_operands(o, sh, si, &a, &b, &segs)) return 1;
    CUDA_OK(cudaMalloc(&h, rows * sh->n * 2));
    CUDA_OK(cudaMalloc(&act_ref, rows * F * 2));
    CUDA_OK(cudaMalloc(&act, rows * F * 2));
    swiglu_ctx_t x;
    memset(&x, 0, sizeof(x));
    x.gemm.cublas = cublas;
    x.gemm.sh = sh;
    x.gemm.a = a;
    x.gemm.b = b;
    x.gemm.c = h;
    x.h = h;
    x.act = act_ref;
    x.segs = segs;
    x.ffn = F;
    x.groups = sh->groups;
    x.rows = sh->rows;
    int failed = 0;
    float t_ref = gemm_time_ms(run_cublas_swiglu, &x, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s: cuBLAS + SwiGLU: %s", sh->name, x.gemm.err);
    run_ctx_t r;
    memset(&r, 0, sizeof(r));
    r.g = (cometi_gemm_t){.problem = {.groups = sh->groups, .n = F, .k = sh->k, .segs = segs},
                          .a = {.ptr = a, .rows = (int64_t)rows},
                          .b = {.ptr = b},
                          .out = {.epilogue = COMETI_GEMM_EPI_SWIGLU, .c = act, .ldc = F},
                          .launch = {.tail_ws = tail_ws},
                          .err = err_dev};
    CUDA_OK(cudaMemset(act, 0xff, rows * F * 2));
    FAIL_IF(run_ours(&r, 0), "%s: ours with SwiGLU: %s", sh->name, r.err);
    CUDA_OK(cudaDeviceSynchronize());
    FAIL_IF(err_host->status, "%s: ours with SwiGLU: the GEMM pipeline stalled", sh->name);
    uint16_t *want = TOOL_MALLOC(rows * F * 2), *got = TOOL_MALLOC(rows * F * 2);
    CUDA_OK(cudaMemcpy(want, act_ref, rows * F * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got, act, rows * F * 2, cudaMemcpyDeviceToHost));
    double d = gemm_rel_diff(got, want, rows * F);
    float t_ours = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s: ours with SwiGLU: %s", sh->name, r.err);
    r.g.launch.schedule = COMETI_GEMM_PINGPONG;
    CUDA_OK(cudaMemset(act, 0xff, rows * F * 2));
    FAIL_IF(run_ours(&r, 0), "%s: ours with SwiGLU, ping-pong: %s", sh->name, r.err);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(got, act, rows * F * 2, cudaMemcpyDeviceToHost));
    double d_pp = gemm_rel_diff(got, want, rows * F);
    if (d_pp > d) d = d_pp;
    float t_pp = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s: ours with SwiGLU, ping-pong: %s", sh->name, r.err);
    double flop = 2.0 * rows * sh->n * sh->k;
    float t_best = t_ours < t_pp ? t_ours : t_pp;
    printf("%-24s %6d %6d %6d %6d %9.0f %9.0f %9.0f %9s %8.3f %9.1e%s\n", sh->name, sh->groups, sh->rows, sh->n, sh->k,
           flop / (t_ref * 1e-3) / 1e12, flop / (t_ours * 1e-3) / 1e12, flop / (t_pp * 1e-3) / 1e12, "",
           t_ref / t_best, d, d > 1e-2 ? " WRONG" : "");
    free(want), free(got);
    cudaFree(a), cudaFree(b), cudaFree(h), cudaFree(act_ref), cudaFree(act), cudaFree(segs);
    return d > 1e-2;
}

/* One of the backward's GEMMs of shape `sh`: a dgrad GEMM (B MN-major) or a weight
 * gradient (sh->wgrad). Ours, cooperative at both tile widths (256 with a partial last tile
 * where it does not divide n), against cuBLAS per expert, checked on poisoned C before it is
 * timed; with --sweep also 128x256 tiles with the registers' epilogue and other tile
 * orders (group_m), each on a line of its own. */
static int time_backward_gemm(const tool_options_t *o, const shape_t *sh, cublasHandle_t cublas,
                              cometi_async_error_t *err_host, cometi_async_error_t *err_dev, int si, void *tail_ws)
{
    const size_t rows = (size_t)sh->groups * sh->rows, nc = sh->wgrad ? (size_t)sh->groups * sh->k * sh->n : rows * sh->n;
    void *a, *b, *c_ref, *c;
    cometi_segment_t *segs;
    if (make_operands(o, sh, si, &a, &b, &segs)) return 1;
    CUDA_OK(cudaMalloc(&c_ref, nc * 2));
    CUDA_OK(cudaMalloc(&c, nc * 2));
    run_ctx_t r;
    memset(&r, 0, sizeof(r));
    r.cublas = cublas, r.sh = sh, r.a = a, r.b = b, r.c = c_ref;
    int failed = 0;
    const float t_cublas = gemm_time_ms(run_cublas, &r, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s: cuBLAS: %s", sh->name, r.err);
    uint16_t *ref = TOOL_MALLOC(nc * 2), *got = TOOL_MALLOC(nc * 2);
    CUDA_OK(cudaMemcpy(ref, c_ref, nc * 2, cudaMemcpyDeviceToHost));
    /* {block_n, group_m, epilogue}: the two defaults first. */
    enum { A = COMETI_GEMM_STORE_AUTO, D = COMETI_GEMM_STORE_DIRECT };
    static const int variants[][3] = {{256, 8, A}, {128, 8, A}, {256, 8, D}, {256, 1, A},
                                      {256, 4, A}, {256, 16, A}, {256, 64, A}};
    const int nvariants = o->sweep ? (int)(sizeof(variants) / sizeof(variants[0])) : 2;
    const double flop = 2.0 * rows * sh->n * sh->k;
    float t[sizeof(variants) / sizeof(variants[0])];
    double worst = 0;
    for (int v = 0; v < nvariants; v++) {
        r.g = (cometi_gemm_t){
            .problem = {.along = sh->wgrad ? COMETI_GEMM_GROUPS_ALONG_K : COMETI_GEMM_GROUPS_ALONG_M,
                        .groups = sh->groups, .n = sh->n, .k = sh->wgrad ? 0 : sh->k, .m_out = sh->wgrad ? sh->k : 0,
                        .segs = segs},
            .a = {.ptr = a, .rows = (int64_t)rows, .major = sh->wgrad ? COMETI_GEMM_MN_MAJOR : COMETI_GEMM_K_MAJOR},
            .b = {.ptr = b, .major = COMETI_GEMM_MN_MAJOR},
            .out = {.store = variants[v][2], .c = c, .ldc = sh->n},
            .launch = {.block_n = variants[v][0], /* 256: a partial last tile where it does not divide n */
                       .group_m = variants[v][1], .tail_ws = sh->wgrad ? NULL : tail_ws},
            .err = err_dev};
        CUDA_OK(cudaMemset(c, 0xff, nc * 2)); /* poison: bf16 NaN */
        FAIL_IF(run_ours(&r, 0), "%s: ours: %s", sh->name, r.err);
        CUDA_OK(cudaDeviceSynchronize());
        FAIL_IF(err_host->status, "%s: ours: the GEMM pipeline stalled", sh->name);
        CUDA_OK(cudaMemcpy(got, c, nc * 2, cudaMemcpyDeviceToHost));
        const double d = gemm_rel_diff(got, ref, nc);
        if (!(d <= worst)) worst = d;
        t[v] = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
        FAIL_IF(failed, "%s: ours: %s", sh->name, r.err);
        if (o->sweep)
            printf("  %-22s block_n %3d group_m %2d %-6s: %6.0f TFLOP/s, diff %.1e\n", sh->name, variants[v][0],
                   variants[v][1], variants[v][2] == COMETI_GEMM_STORE_DIRECT ? "direct" : "auto",
                   flop / (t[v] * 1e-3) / 1e12, d);
    }
    const float best = t[0] < t[1] ? t[0] : t[1];
    printf("%-24s %6d %6d %6d %6d %9.0f %9.0f %9s %9.0f %8.3f %9.1e%s\n", sh->name, sh->groups, sh->rows,
           sh->wgrad ? sh->k : sh->n, sh->wgrad ? sh->n : sh->k, flop / (t_cublas * 1e-3) / 1e12,
           flop / (t[0] * 1e-3) / 1e12, "", flop / (t[1] * 1e-3) / 1e12, t_cublas / best, worst,
           worst > 1e-2 ? " WRONG" : "");
    free(ref), free(got);
    cudaFree(a), cudaFree(b), cudaFree(c_ref), cudaFree(c), cudaFree(segs);
    return !(worst <= 1e-2);
}

/* The backward's two GEMMs of W2 and of W13 on every preset: the dgrad GEMMs (B MN-major)
 * or, with `wgrad`, the weight gradients, on the rows balanced routing over --ep ranks gives
 * each of a rank's experts. */
static int time_backward_table(const tool_options_t *o, int wgrad, cublasHandle_t cublas,
                               cometi_async_error_t *err_host, cometi_async_error_t *err_dev, void *tail_ws)
{
    int bad = 0;
    for (int i = 0; i < o->npresets; i++) {
        comet_moe_config_t cfg;
        comet_moe_config_preset(o->presets[i], o->tokens, &cfg);
        const int ep = o->ep ? o->ep : 2, per = cfg.num_experts / ep,
                  rows = (int)((int64_t)o->tokens * cfg.top_k * ep / cfg.num_experts);
        shape_t sh[2] = {{"", per, rows, cfg.ffn, cfg.hidden, !wgrad, wgrad},
                         {"", per, rows, cfg.hidden, 2 * cfg.ffn, !wgrad, wgrad}};
        snprintf(sh[0].name, 48, "%s %s", o->presets[i], wgrad ? "dW2" : "dgrad W2");
        snprintf(sh[1].name, 48, "%s %s", o->presets[i], wgrad ? "dW13" : "dgrad W13");
        for (int d = 0; d < 2; d++)
            bad |= time_backward_gemm(o, &sh[d], cublas, err_host, err_dev, (wgrad ? 200 : 100) + 2 * i + d, tail_ws);
    }
    return bad;
}

int gemm_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const tool_options_t *o = arg;
    if (o->fp8) return gemm_fp8_rank(ctx, arg);
    const int code = rank_device(ctx);
    if (code) return code;
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, ctx->local_rank));
    shape_t shapes[2 * TOOL_MAX_PRESETS + 1];
    int nshapes = 0; /* the forward's shapes, where its tables are asked for */
    for (int i = 0; i < o->npresets && (o->gemms & TOOL_GEMMS_FORWARD); i++) {
        comet_moe_config_t c;
        comet_moe_config_preset(o->presets[i], o->tokens, &c);
        const int ep = o->ep ? o->ep : 2, per = c.num_experts / ep,
                  rows = (int)((int64_t)o->tokens * c.top_k * ep / c.num_experts);
        shapes[nshapes++] = (shape_t){"", per, rows, 2 * c.ffn, c.hidden, 0, 0};
        snprintf(shapes[nshapes - 1].name, 48, "%s GEMM0", o->presets[i]);
        shapes[nshapes++] = (shape_t){"", per, rows, c.hidden, c.ffn, 0, 0};
        snprintf(shapes[nshapes - 1].name, 48, "%s GEMM1", o->presets[i]);
    }
    if (o->gemms & TOOL_GEMMS_FORWARD) shapes[nshapes++] = (shape_t){"8192^3", 1, 8192, 8192, 8192, 0, 0};

    cometi_async_error_t *err_host, *err_dev;
    CUDA_OK(cudaHostAlloc((void **)&err_host, sizeof(*err_host), cudaHostAllocMapped));
    memset(err_host, 0, sizeof(*err_host));
    CUDA_OK(cudaHostGetDevicePointer((void **)&err_dev, err_host, 0));
    cublasHandle_t cublas;
    FAIL_IF(cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS, "cublasCreate failed");
    printf("%s, %d SMs; TFLOP/s = 2 rows n k / median time of %d calls; diff = ||ours - cuBLAS|| / ||cuBLAS||\n",
           prop.name, prop.multiProcessorCount, o->iters);
    if (nshapes)
        printf("%-24s %6s %6s %6s %6s %9s %9s %9s %9s %8s %9s\n", "shape", "groups", "rows", "n", "k", "cuBLAS",
               "coop-256", "pp-256", "coop-128", "best/cuB", "diff");
    int bad = 0;
    const int sweep = o->sweep;
    unsigned int *sched;                /* the shared tile counter's words, zero between calls */
    unsigned long long *split_done;     /* running row counts of two column splits */
    CUDA_OK(cudaMalloc((void **)&sched, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    CUDA_OK(cudaMemset(sched, 0, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    CUDA_OK(cudaMalloc((void **)&split_done, 2 * sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(split_done, 0, 2 * sizeof(unsigned long long)));
    void *tail_ws;                      /* the last wave's cut: counters zero between calls */
    CUDA_OK(cudaMalloc(&tail_ws, COMETI_GEMM_TAIL_BYTES(prop.multiProcessorCount)));
    CUDA_OK(cudaMemset(tail_ws, 0, COMETI_GEMM_TAIL_COUNTERS * 8));
    for (int si = 0; si < nshapes; si++) {
        const shape_t *sh = &shapes[si];
        const size_t rows = (size_t)sh->groups * sh->rows, nc = rows * sh->n;
        void *a, *b, *c_ref, *c;
        cometi_segment_t *segs;
        if (make_operands(o, sh, si, &a, &b, &segs)) return 1;
        CUDA_OK(cudaMalloc(&c_ref, nc * 2));
        CUDA_OK(cudaMalloc(&c, nc * 2));
        run_ctx_t r;
        memset(&r, 0, sizeof(r));
        r.cublas = cublas;
        r.sh = sh;
        r.a = a;
        r.b = b;
        r.c = c_ref;
        int failed = 0;
        float t_cublas = gemm_time_ms(run_cublas, &r, 3, o->iters, &failed, NULL, NULL);
        FAIL_IF(failed, "%s: cuBLAS: %s", sh->name, r.err);
        uint16_t *ref = TOOL_MALLOC(nc * 2), *got = TOOL_MALLOC(nc * 2);
        CUDA_OK(cudaMemcpy(ref, c_ref, nc * 2, cudaMemcpyDeviceToHost));
        /* Variants {block_n, group_m, sms, epilogue, schedule, dynamic, splits, no cut}:
         * cooperative 128x256, ping-pong 64x256 and cooperative 128x128 with the default
         * epilogue; with --sweep also epilogues, tile orders, grid sizes, the
         * shared tile counter (layer0's schedule), two column splits with their counts
         * (layer1's order), and the first without the last wave's cut. */
        enum { A = COMETI_GEMM_STORE_AUTO, D = COMETI_GEMM_STORE_DIRECT, C = COMETI_GEMM_COOPERATIVE,
               P = COMETI_GEMM_PINGPONG };
        static const int variants[][8] = {{256, 8, 0, A, C, 0, 0, 0},   {256, 8, 0, A, P, 0, 0, 0},
                                          {128, 8, 0, A, C, 0, 0, 0},   {256, 8, 0, D, C, 0, 0, 0},
                                          {128, 8, 0, D, C, 0, 0, 0},   {256, 8, 0, D, P, 0, 0, 0},
                                          {256, 16, 0, A, C, 0, 0, 0},  {256, 8, 128, A, C, 0, 0, 0},
                                          {256, 8, 128, A, P, 0, 0, 0}, {256, 8, 0, A, C, 1, 0, 0},
                                          {256, 8, 0, A, C, 1, 2, 0},   {256, 8, 0, A, C, 0, 0, 1}};
        enum { NVARIANTS = sizeof(variants) / sizeof(variants[0]) };
        const int ndefault = 3, nvariants = sweep ? NVARIANTS : ndefault;
        float t_best = 1e30f, t_v[NVARIANTS];
        double worst = 0;
        for (int v = 0; v < nvariants; v++) {
            if (variants[v][6] && sh->n % (variants[v][0] * variants[v][6])) continue; /* whole tiles */
            r.g = (cometi_gemm_t){.problem = {.groups = sh->groups, .n = sh->n, .k = sh->k, .segs = segs},
                                  .a = {.ptr = a, .rows = (int64_t)rows},
                                  .b = {.ptr = b},
                                  .out = {.store = variants[v][3], .c = c, .ldc = sh->n},
                                  .launch = {.sms = variants[v][2], .block_n = variants[v][0],
                                             .group_m = variants[v][1], .schedule = variants[v][4],
                                             .sched = variants[v][5] ? sched : NULL,
                                             .tail_ws = variants[v][7] ? NULL : tail_ws},
                                  .err = err_dev};
            r.splits = (cometi_gemm_splits_t){.n_splits = variants[v][6], .split_done = split_done};
            if (variants[v][6]) r.g.roles.splits = &r.splits;
            CUDA_OK(cudaMemset(c, 0xff, nc * 2)); /* poison: bf16 NaN */
            FAIL_IF(run_ours(&r, 0), "%s: ours-%d: %s", sh->name, variants[v][0], r.err);
            CUDA_OK(cudaDeviceSynchronize());
            FAIL_IF(err_host->status, "%s: ours-%d: the GEMM pipeline stalled (block %d)", sh->name, variants[v][0],
                    err_host->slot);
            CUDA_OK(cudaMemcpy(got, c, nc * 2, cudaMemcpyDeviceToHost));
            double d = gemm_rel_diff(got, ref, nc);
            if (!(d <= worst)) worst = d;
            float lo, hi;
            t_v[v] = gemm_time_ms(run_ours, &r, 3, sweep ? 5 : o->iters, &failed, &lo, &hi);
            FAIL_IF(failed, "%s: ours-%d: %s", sh->name, variants[v][0], r.err);
            FAIL_IF(err_host->status, "%s: ours-%d: the GEMM pipeline stalled while timed", sh->name, variants[v][0]);
            if (v < ndefault && t_v[v] < t_best) t_best = t_v[v];
            if (sweep)
                printf("  %-22s block_n %3d group_m %2d sms %3d %-6s %-9s %-7s splits %d %-6s: %6.0f TFLOP/s (min "
                       "%.3f, max %.3f ms), diff %.1e\n", sh->name, variants[v][0], variants[v][1], variants[v][2],
                       variants[v][3] == COMETI_GEMM_STORE_DIRECT ? "direct" : "auto",
                       variants[v][4] == COMETI_GEMM_PINGPONG ? "ping-pong" : "coop",
                       variants[v][5] ? "dynamic" : "static", variants[v][6] ? variants[v][6] : 1,
                       variants[v][7] ? "no cut" : "cut",
                       2.0 * rows * sh->n * sh->k / (t_v[v] * 1e-3) / 1e12, lo, hi, d);
        }
        double flop = 2.0 * rows * sh->n * sh->k;
        double tf_c = flop / (t_cublas * 1e-3) / 1e12;
        printf("%-24s %6d %6d %6d %6d %9.0f %9.0f %9.0f %9.0f %8.3f %9.1e%s\n", sh->name, sh->groups, sh->rows, sh->n,
               sh->k, tf_c, flop / (t_v[0] * 1e-3) / 1e12, flop / (t_v[1] * 1e-3) / 1e12,
               flop / (t_v[2] * 1e-3) / 1e12, t_cublas / t_best, worst, worst > 1e-2 ? " WRONG" : "");
        if (!(worst <= 1e-2)) bad = 1;
        free(ref), free(got);
        cudaFree(a), cudaFree(b), cudaFree(c_ref), cudaFree(c), cudaFree(segs);
    }
    if (nshapes) {
        printf("\nGEMM0 with SwiGLU: cuBLAS GEMM0 + the baseline's SwiGLU kernel, against ours with SwiGLU in the "
               "epilogue\n(TFLOP/s counts the GEMM's flops; diff against the cuBLAS path, which rounds h to bf16 "
               "first)\n");
        printf("%-24s %6s %6s %6s %6s %9s %9s %9s %9s %8s %9s\n", "shape", "groups", "rows", "n", "k", "cuB+act",
               "coop-256", "pp-256", "", "best/cuB", "diff");
    }
    for (int si = 0; si < nshapes; si++)
        if (strstr(shapes[si].name, "GEMM0")) bad |= time_swiglu(o, &shapes[si], cublas, err_host, err_dev, si, tail_ws);
    /* The backward's tables: the data gradients, then the weight gradients. */
    static const char *const backward_title[2] = {
        "\nThe backward's dgrad GEMMs: B MN-major, the weights as the forward keeps them (s = dy W2: n = F, k = H;\n"
        "dx = dh W13: n = H, k = 2F), ours against cuBLAS's NN GEMM per expert\n",
        "\nThe backward's weight gradients: groups along K (each expert's rows), both operands MN-major\n"
        "(dW2 = dy^T act: m = H, n = F; dW13 = dh^T x: m = 2F, n = H), ours against cuBLAS per expert\n"};
    for (int wgrad = 0; wgrad < 2; wgrad++) {
        if (!(o->gemms & (wgrad ? TOOL_GEMMS_WGRAD : TOOL_GEMMS_DGRAD))) continue;
        printf("%s%-24s %6s %6s %6s %6s %9s %9s %9s %9s %8s %9s\n", backward_title[wgrad], "shape", "groups", "rows",
               wgrad ? "m" : "n", wgrad ? "n" : "k", "cuBLAS", "coop-256", "", "coop-128", "best/cuB", "diff");
        bad |= time_backward_table(o, wgrad, cublas, err_host, err_dev, tail_ws);
    }
    cublasDestroy(cublas);
    cudaFree(sched), cudaFree(split_done), cudaFree(tail_ws);
    FAIL_IF(bad, "an output differed from cuBLAS by more than 1e-2 (marked WRONG)");
    return 0;
}
