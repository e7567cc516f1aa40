/*
 * cmd_gemm_fp8.c - `comet gemm --fp8`: comet's block-scaled FP8 forward GEMMs on every
 * preset's expert shapes (rows per expert as balanced routing of --tokens over --ep ranks
 * gives, --ep 1 by default: one GPU's rows), beside
 *   cuBLASLt's block-scaled FP8 GEMM per expert (VEC128 scales for the rows, 128 x 128 for
 *   the weights): the sequential baseline's GEMM; for GEMM0 also with what the baseline
 *   runs after it (SwiGLU, then the activation quantized for GEMM1), and
 *   comet's bf16 GEMM on the operands before quantization.
 * GEMM0 is x W13^T with the quantizing SwiGLU (E4M3 activation and its 1 x 128 scales out),
 * GEMM1 act W2^T (bf16 out), ours in both formats on the schedule the layer takes for those
 * rows (ping-pong at small batches, cometi_model_pingpong). Operands are hash-filled bf16,
 * quantized once by comet's quantizers (not timed). Checks, on poisoned outputs before
 * timing: ours against cuBLASLt on the same FP8 operands (GEMM1: ||ours - cuBLASLt|| /
 * ||cuBLASLt||; GEMM0: the dequantized activations), and against the bf16 GEMM with
 * DeepGEMM's measure 1 - 2 sum(xy) / sum(x^2 + y^2) (what FP8 costs in accuracy).
 * Then the backward's weight gradients (dW2 = dy^T a, dW13 = dh^T x, groups along K): our
 * FP8 GEMM on operands cast-transposed in 128 x 1 blocks along the tokens, beside our bf16
 * one, alone and with the two cast-transposes it needs (timed too), and beside cuBLASLt's
 * 1 x 128 by 1 x 128 GEMM per expert on the same operands (the sequential FP8 backward's),
 * with the same measures; and the data gradients (s = dy W2, dx = dh W13): our FP8 GEMM
 * on W^T's copy (its chosen width, then 128-wide tiles) beside cuBLASLt's per expert on
 * the same operands and our bf16 one reading W as the forward keeps it. Under each row,
 * what cuBLASLt's heuristic chose (its tile, stages, cluster). --gemms picks the tables.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "base/fp8.h"
#include "baseline/blaslt_fp8.h"
#include "gemm/gemm.h"
#include "patterns/tune.h"
#include "pointwise/pointwise.h"
#include "alloc.h"
#include "tool.h"
#include "../harness/timeline.h"

/* One preset's forward operands, bf16 and FP8 alike. */
typedef struct fp8_case {
    int groups, rows, pad_rows, H, F; /* rows per expert; each expert's rows start pad_rows apart */
    int apart;                        /* gate and up in tensors of their own (F not a multiple of 128) */
    int schedule;                     /* the forward's, as the layer picks it (cometi_model_pingpong) */
    int64_t total;                    /* A's rows: groups x pad_rows */
    cometi_segment_t *segs;
    int64_t *row_start, *row_count;   /* host, for cuBLASLt */
    /* bf16 */
    void *x, *w13, *act, *w2;         /* x [total][H], w13 [groups][2F][H], act [total][F], w2 [groups][H][F] */
    /* FP8: comet's layouts */
    void *xq, *w13q, *upq, *actq, *w2q;
    float *xs, *w13s, *ups, *acts, *w2s;   /* x, act: [k blocks][total]; weights [groups][rows/128][k/128] */
    /* FP8: cuBLASLt's scale layouts */
    float *xs_lt, *acts_lt, *w13s_lt, *ups_lt, *w2s_lt;
    /* outputs */
    void *h, *act_ref, *actq_out, *y, *y_ref, *act_lt_q;
    float *acts_out, *acts_lt_out;
} fp8_case_t;

typedef struct fp8_run {
    fp8_case_t *c;
    cometi_blaslt_fp8_t *lt;
    cometi_gemm_t g;
    int which;                        /* 0: GEMM0, 1: GEMM1 */
    char err[COMETI_ERR_LEN];
} fp8_run_t;

static int run_ours(void *p, cudaStream_t s)
{
    fp8_run_t *r = p;
    return cometi_gemm_run(r->err, &r->g, s) != COMET_SUCCESS;
}

/* cuBLASLt's GEMM0: h = x W13^T per expert (gate and up in one call, or one each). */
static int run_lt_gemm0(void *p, cudaStream_t s)
{
    fp8_run_t *r = p;
    fp8_case_t *c = r->c;
    if (!c->apart)
        return cometi_blaslt_fp8_grouped(r->err, r->lt, c->groups, c->row_start, c->row_count, 2 * c->F, c->H, c->xq,
                                         c->xs_lt, c->w13q, c->w13s_lt, c->h, 2 * c->F, s) != COMET_SUCCESS;
    return cometi_blaslt_fp8_grouped(r->err, r->lt, c->groups, c->row_start, c->row_count, c->F, c->H, c->xq, c->xs_lt,
                                     c->w13q, c->w13s_lt, c->h, 2 * c->F, s) != COMET_SUCCESS ||
           cometi_blaslt_fp8_grouped(r->err, r->lt, c->groups, c->row_start, c->row_count, c->F, c->H, c->xq, c->xs_lt,
                                     c->upq, c->ups_lt, (char *)c->h + (size_t)c->F * 2, 2 * c->F, s) != COMET_SUCCESS;
}

/* The activation quantized for cuBLASLt's GEMM1: each expert's rows with its packed scales. */
static int quantize_act_lt(fp8_case_t *c, const void *act, void *q, float *scales, cudaStream_t s)
{
    int64_t offset = 0;
    for (int g = 0; g < c->groups; g++) {
        const int64_t rg = cometi_blaslt_fp8_group_rows(c->row_count[g]);
        if (!rg) continue;
        const size_t r0 = (size_t)c->row_start[g];
        if (cometi_quantize_rows_e4m3((const char *)act + r0 * c->F * 2, c->row_count[g], c->F, c->F,
                                      (char *)q + r0 * c->F, c->F, scales + offset, 1, rg, 0, s) != cudaSuccess)
            return 1;
        offset += rg * ((c->F + 127) / 128);
    }
    return 0;
}

/* What the sequential FP8 baseline runs for GEMM0: cuBLASLt, SwiGLU, the activation quantized. */
static int run_lt_gemm0_swiglu(void *p, cudaStream_t s)
{
    fp8_run_t *r = p;
    fp8_case_t *c = r->c;
    if (run_lt_gemm0(p, s)) return 1;
    if (cometi_launch_swiglu(c->h, c->act_ref, c->F, c->segs, c->groups, c->rows, s) != cudaSuccess) return 1;
    return quantize_act_lt(c, c->act_ref, c->act_lt_q, c->acts_lt_out, s);
}

static int run_lt_gemm1(void *p, cudaStream_t s)
{
    fp8_run_t *r = p;
    fp8_case_t *c = r->c;
    return cometi_blaslt_fp8_grouped(r->err, r->lt, c->groups, c->row_start, c->row_count, c->H, c->F, c->actq,
                                     c->acts_lt, c->w2q, c->w2s_lt, c->y_ref, c->H, s) != COMET_SUCCESS;
}

/* DeepGEMM's accuracy measure: 1 - 2 sum(xy) / sum(x^2 + y^2) (0 when equal). */
static double deepgemm_diff(const double *sums)
{
    return sums[1] > 0 ? 1.0 - 2.0 * sums[0] / sums[1] : 0.0;
}

static void add_pair(double *sums, double x, double y)
{
    sums[0] += x * y;
    sums[1] += x * x + y * y;
}

/* n bf16 values of `got` against `want` into DeepGEMM's sums, got's non-finite ones counted. */
static void add_bf16_pairs(const uint16_t *got, const uint16_t *want, size_t n, double *sums, int *nonfinite)
{
    for (size_t i = 0; i < n; i++) {
        const double x = cometi_bf16_to_float(got[i]);
        *nonfinite += !isfinite(x);
        add_pair(sums, x, cometi_bf16_to_float(want[i]));
    }
}

/* The same over the experts' rows of two host [total][n] bf16 outputs (padding rows hold
 * nothing of either). */
static void add_expert_rows(const fp8_case_t *c, const uint16_t *got, const uint16_t *want, int n, double *sums,
                            int *nonfinite)
{
    for (int e = 0; e < c->groups; e++) {
        const size_t at = (size_t)c->row_start[e] * n;
        add_bf16_pairs(got + at, want + at, (size_t)c->row_count[e] * n, sums, nonfinite);
    }
}

/* Quantize rows of `src` [total][k] bf16 into comet's layout (scales [k blocks][total]) and
 * cuBLASLt's (packed per expert). */
static int quantize_rows_both(fp8_case_t *c, const void *src, int k, void *q, float *scales, float *scales_lt)
{
    CUDA_OK(cometi_quantize_rows_e4m3(src, c->total, k, k, q, k, scales, 1, c->total, 0, 0));
    int64_t offset = 0;
    for (int g = 0; g < c->groups; g++) {
        const int64_t rg = cometi_blaslt_fp8_group_rows(c->row_count[g]);
        const size_t r0 = (size_t)c->row_start[g];
        CUDA_OK(cometi_quantize_rows_e4m3((const char *)src + r0 * k * 2, c->row_count[g], k, k, (char *)q + r0 * k,
                                          k, scales_lt + offset, 1, rg, 0, 0));
        offset += rg * ((k + 127) / 128);
    }
    return 0;
}

/* Weights [mats][rows][k] to E4M3 with 128 x 128 scales, and cuBLASLt's padded copy of them. */
static int quantize_weights(const void *w, int mats, int rows, int k, void **q, float **s, float **s_lt)
{
    const size_t blocks = (size_t)mats * ((rows + 127) / 128);
    CUDA_OK(cudaMalloc(q, (size_t)mats * rows * k));
    CUDA_OK(cudaMalloc((void **)s, blocks * ((k + 127) / 128) * 4));
    CUDA_OK(cudaMalloc((void **)s_lt, blocks * cometi_blaslt_fp8_b_scale_ld(k) * 4));
    CUDA_OK(cometi_quantize_blocks_e4m3(w, mats, rows, k, *q, *s, NULL, NULL, 0, 0));
    char err[COMETI_ERR_LEN];
    FAIL_IF(cometi_blaslt_fp8_pad_b_scales(err, mats, rows, k, *s, *s_lt, 0) != COMET_SUCCESS, "%s", err);
    return 0;
}

static int case_open(const tool_options_t *o, const comet_moe_config_t *cfg, int ep, int si, fp8_case_t *c)
{
    memset(c, 0, sizeof(*c));
    c->groups = cfg->num_experts / ep;
    c->rows = (int)((int64_t)o->tokens * cfg->top_k * ep / cfg->num_experts);
    c->schedule = cometi_model_pingpong(o->tokens, ep, cfg->top_k, cfg->num_experts) ? COMETI_GEMM_PINGPONG : 0;
    c->pad_rows = (c->rows + 127) / 128 * 128;
    c->H = cfg->hidden, c->F = cfg->ffn;
    c->apart = c->F % 128 != 0;
    c->total = (int64_t)c->groups * c->pad_rows;
    const int H = c->H, F = c->F, G = c->groups;
    const size_t T = (size_t)c->total;
    cometi_segment_t *segs = TOOL_MALLOC(sizeof(cometi_segment_t) * G);
    c->row_start = TOOL_MALLOC(sizeof(int64_t) * G);
    c->row_count = TOOL_MALLOC(sizeof(int64_t) * G);
    for (int g = 0; g < G; g++) {
        segs[g] = (cometi_segment_t){g * c->pad_rows, c->rows};
        c->row_start[g] = (int64_t)g * c->pad_rows, c->row_count[g] = c->rows;
    }
    CUDA_OK(cudaMalloc((void **)&c->segs, sizeof(cometi_segment_t) * G));
    CUDA_OK(cudaMemcpy(c->segs, segs, sizeof(cometi_segment_t) * G, cudaMemcpyHostToDevice));
    free(segs);
    CUDA_OK(cudaMalloc(&c->x, T * H * 2));
    CUDA_OK(cudaMalloc(&c->act, T * F * 2));
    CUDA_OK(cudaMalloc(&c->w13, (size_t)G * 2 * F * H * 2));
    CUDA_OK(cudaMalloc(&c->w2, (size_t)G * H * F * 2));
    CUDA_OK(cometi_fill_hash_bf16(c->x, T * H, o->seed + 4 * si, 0, 1.0f, 0));
    CUDA_OK(cometi_fill_hash_bf16(c->act, T * F, o->seed + 4 * si + 1, 0, 1.0f, 0));
    CUDA_OK(cometi_fill_hash_bf16(c->w13, (size_t)G * 2 * F * H, o->seed + 4 * si + 2, 0, (float)(1.0 / sqrt(H)), 0));
    CUDA_OK(cometi_fill_hash_bf16(c->w2, (size_t)G * H * F, o->seed + 4 * si + 3, 0, (float)(1.0 / sqrt(F)), 0));
    /* The padding rows of x and act are zero (the layer's are): cuBLASLt reads up to 8 of them. */
    for (int g = 0; g < G; g++) {
        const size_t r = (size_t)g * c->pad_rows + c->rows, n = (size_t)(c->pad_rows - c->rows);
        CUDA_OK(cudaMemset((char *)c->x + r * H * 2, 0, n * H * 2));
        CUDA_OK(cudaMemset((char *)c->act + r * F * 2, 0, n * F * 2));
    }
    /* FP8 copies. Rows: comet's scales [k blocks][T], cuBLASLt's packed per expert. */
    const int64_t lt_x = cometi_blaslt_fp8_a_scales_layout(G, c->row_count, H, NULL),
                  lt_act = cometi_blaslt_fp8_a_scales_layout(G, c->row_count, F, NULL);
    CUDA_OK(cudaMalloc(&c->xq, T * H));
    CUDA_OK(cudaMalloc(&c->actq, T * F));
    CUDA_OK(cudaMalloc((void **)&c->xs, T * ((H + 127) / 128) * 4));
    CUDA_OK(cudaMalloc((void **)&c->acts, T * ((F + 127) / 128) * 4));
    CUDA_OK(cudaMalloc((void **)&c->xs_lt, (size_t)lt_x * 4));
    CUDA_OK(cudaMalloc((void **)&c->acts_lt, (size_t)lt_act * 4));
    if (quantize_rows_both(c, c->x, H, c->xq, c->xs, c->xs_lt)) return 1;
    if (quantize_rows_both(c, c->act, F, c->actq, c->acts, c->acts_lt)) return 1;
    if (c->apart) {
        /* gate and up as tensors of their own: the gate rows of each expert, then the up rows. */
        void *gate, *up;
        CUDA_OK(cudaMalloc(&gate, (size_t)G * F * H * 2));
        CUDA_OK(cudaMalloc(&up, (size_t)G * F * H * 2));
        CUDA_OK(cudaMemcpy2D(gate, (size_t)F * H * 2, c->w13, (size_t)2 * F * H * 2, (size_t)F * H * 2, G,
                             cudaMemcpyDeviceToDevice));
        CUDA_OK(cudaMemcpy2D(up, (size_t)F * H * 2, (char *)c->w13 + (size_t)F * H * 2, (size_t)2 * F * H * 2,
                             (size_t)F * H * 2, G, cudaMemcpyDeviceToDevice));
        if (quantize_weights(gate, G, F, H, &c->w13q, &c->w13s, &c->w13s_lt)) return 1;
        if (quantize_weights(up, G, F, H, &c->upq, &c->ups, &c->ups_lt)) return 1;
        cudaFree(gate), cudaFree(up);
    } else if (quantize_weights(c->w13, G, 2 * F, H, &c->w13q, &c->w13s, &c->w13s_lt)) {
        return 1;
    }
    if (quantize_weights(c->w2, G, H, F, &c->w2q, &c->w2s, &c->w2s_lt)) return 1;
    /* Outputs. */
    CUDA_OK(cudaMalloc(&c->h, T * 2 * F * 2));
    CUDA_OK(cudaMalloc(&c->act_ref, T * F * 2));
    CUDA_OK(cudaMalloc(&c->act_lt_q, T * F));
    CUDA_OK(cudaMalloc((void **)&c->acts_lt_out, (size_t)lt_act * 4));
    CUDA_OK(cudaMalloc(&c->actq_out, T * F));
    CUDA_OK(cudaMalloc((void **)&c->acts_out, T * ((F + 127) / 128) * 4));
    CUDA_OK(cudaMalloc(&c->y, T * H * 2));
    CUDA_OK(cudaMalloc(&c->y_ref, T * H * 2));
    CUDA_OK(cudaMemset(c->h, 0, T * 2 * F * 2));
    CUDA_OK(cudaMemset(c->act_ref, 0, T * F * 2));
    CUDA_OK(cudaMemset(c->y_ref, 0, T * H * 2));
    return 0;
}

static void case_close(fp8_case_t *c)
{
    void *all[] = {c->segs, c->x, c->w13, c->act, c->w2, c->xq, c->w13q, c->upq, c->actq, c->w2q, c->xs, c->w13s,
                   c->ups, c->acts, c->w2s, c->xs_lt, c->acts_lt, c->w13s_lt, c->ups_lt, c->w2s_lt, c->h, c->act_ref,
                   c->actq_out, c->y, c->y_ref, c->act_lt_q, c->acts_out, c->acts_lt_out};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) cudaFree(all[i]);
    free(c->row_start), free(c->row_count);
}

/* Our GEMMs' descriptions: FP8 GEMM0 (quantizing SwiGLU), FP8 GEMM1, and their bf16 twins. */
static cometi_gemm_t describe(const fp8_case_t *c, int which, int fp8, cometi_async_error_t *err, void *tail_ws)
{
    cometi_gemm_t g;
    memset(&g, 0, sizeof(g));
    g.problem.groups = c->groups;
    g.problem.segs = c->segs;
    g.a.rows = c->total;
    g.launch.tail_ws = tail_ws;
    g.err = err;
    g.launch.schedule = c->schedule;
    g.problem.n = which ? c->H : c->F;
    g.problem.k = which ? c->F : c->H;
    g.out.epilogue = which ? COMETI_GEMM_EPI_STORE : fp8 ? COMETI_GEMM_EPI_SWIGLU_E4M3 : COMETI_GEMM_EPI_SWIGLU;
    g.out.ldc = which ? c->H : c->F;
    if (!fp8) {
        g.a.ptr = which ? c->act : c->x;
        g.b.ptr = which ? c->w2 : c->w13;
        g.out.c = which ? c->y : c->act_ref; /* the bf16 run's output lands where nothing else reads it then */
        return g;
    }
    g.a.type = g.b.type = COMETI_GEMM_E4M3;
    g.a.ptr = which ? c->actq : c->xq;
    g.a.scale = which ? c->acts : c->xs;
    g.a.scale_row = 1, g.a.scale_block = c->total; /* MN-major */
    g.b.ptr = which ? c->w2q : c->w13q;
    g.b.scale = which ? c->w2s : c->w13s;
    if (!which && c->apart) g.b.up = c->upq, g.b.up_scale = c->ups;
    if (which) {
        g.out.c = c->y;
    } else {
        g.out.c = c->actq_out;
        g.out.c_scale = c->acts_out;
        g.out.c_scale_row = 1, g.out.c_scale_block = c->total;
    }
    return g;
}

/* GEMM0: ours (FP8, quantizing SwiGLU) against cuBLASLt + SwiGLU + quantization, and the
 * activations of both (dequantized) against each other and against bf16's. */
static int check_gemm0(fp8_case_t *c, double *diff_lt, double *diff_bf16, const void *act_bf16)
{
    const int F = c->F, kb = (F + 127) / 128;
    const size_t T = (size_t)c->total;
    uint8_t *ours = TOOL_MALLOC(T * F), *theirs = TOOL_MALLOC(T * F);
    float *s_ours = TOOL_MALLOC(T * kb * 4), *s_lt = TOOL_MALLOC((size_t)cometi_blaslt_fp8_a_scales_layout(
                                                                   c->groups, c->row_count, F, NULL) * 4);
    uint16_t *bf = TOOL_MALLOC(T * F * 2);
    CUDA_OK(cudaMemcpy(ours, c->actq_out, T * F, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(theirs, c->act_lt_q, T * F, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(s_ours, c->acts_out, T * kb * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(s_lt, c->acts_lt_out,
                       (size_t)cometi_blaslt_fp8_a_scales_layout(c->groups, c->row_count, F, NULL) * 4,
                       cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(bf, act_bf16, T * F * 2, cudaMemcpyDeviceToHost));
    double lt[2] = {0, 0}, b16[2] = {0, 0};
    int64_t offset = 0;
    for (int g = 0; g < c->groups; g++) {
        const int64_t rg = cometi_blaslt_fp8_group_rows(c->row_count[g]);
        for (int64_t i = 0; i < c->row_count[g]; i += 3) { /* every third row: the host's share of the time */
            const size_t r = (size_t)(c->row_start[g] + i);
            for (int j = 0; j < F; j++) {
                const double x = (double)cometi_e4m3_decode(ours[r * F + j]) * s_ours[(size_t)(j / 128) * T + r];
                const double y = (double)cometi_e4m3_decode(theirs[r * F + j]) * s_lt[offset + (j / 128) * rg + i];
                add_pair(lt, x, y);
                add_pair(b16, x, cometi_bf16_to_float(bf[r * F + j]));
            }
        }
        offset += rg * kb;
    }
    *diff_lt = deepgemm_diff(lt), *diff_bf16 = deepgemm_diff(b16);
    free(ours), free(theirs), free(s_ours), free(s_lt), free(bf);
    return 0;
}

/* GEMM1: ours against cuBLASLt (same FP8 operands), and against bf16's output. */
static int check_gemm1(fp8_case_t *c, double *diff_lt, double *diff_bf16, const void *y_bf16)
{
    const size_t T = (size_t)c->total, n = T * c->H;
    uint16_t *ours = TOOL_MALLOC(n * 2), *theirs = TOOL_MALLOC(n * 2), *bf = TOOL_MALLOC(n * 2);
    CUDA_OK(cudaMemcpy(ours, c->y, n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(theirs, c->y_ref, n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(bf, y_bf16, n * 2, cudaMemcpyDeviceToHost));
    double b16[2] = {0, 0};
    int nonfinite = 0; /* unused: a non-finite value makes the distance to cuBLASLt below infinite */
    add_expert_rows(c, ours, bf, c->H, b16, &nonfinite);
    /* Rows of the experts alone (padding rows hold nothing of either). */
    double num = 0, den = 0;
    for (int g = 0; g < c->groups; g++)
        for (int64_t i = 0; i < c->row_count[g]; i++)
            for (int j = 0; j < c->H; j++) {
                const size_t at = (size_t)(c->row_start[g] + i) * c->H + j;
                const double a = cometi_bf16_to_float(ours[at]), b = cometi_bf16_to_float(theirs[at]);
                if (!isfinite(a)) num = INFINITY;
                num += (a - b) * (a - b), den += b * b;
            }
    *diff_lt = den > 0 ? sqrt(num / den) : INFINITY;
    *diff_bf16 = deepgemm_diff(b16);
    free(ours), free(theirs), free(bf);
    return 0;
}

/* The two operands of a weight gradient cast-transposed (the FP8 GEMM's inputs), B's scales
 * exact in bf16 as the layer makes them (COMETI_FP8_SCALE_BF16) and copied as bf16. */
typedef struct wgrad_run {
    fp8_case_t *c;
    const void *a, *b;        /* bf16 [total][m_out], [total][n] */
    int m_out, n;
    void *at, *bt;            /* E4M3 [m_out][total], [n][total] */
    float *as, *bs;           /* [total / 128][m_out], [total / 128][n] (B's exact in bf16) */
    uint16_t *bs16;           /* bs in bf16, what our GEMM reads */
    cometi_gemm_t g;
    cometi_blaslt_fp8_t *lt;
    int64_t *k_start, *k_len; /* host: each expert's tokens in whole 128-token blocks (cuBLASLt's k) */
    void *c_lt;               /* cuBLASLt's output, bf16 [groups][m_out][n] */
    char err[COMETI_ERR_LEN];
} wgrad_run_t;

static int run_wgrad_quantize(void *p, cudaStream_t s)
{
    wgrad_run_t *w = p;
    fp8_case_t *c = w->c;
    return cometi_quantize_segments_t_e4m3(w->a, w->m_out, w->m_out, c->total, c->segs, c->groups, w->at, c->total,
                                           w->as, 1, w->m_out, 0, s) != cudaSuccess ||
           cometi_quantize_segments_t_e4m3(w->b, w->n, w->n, c->total, c->segs, c->groups, w->bt, c->total, w->bs, 1,
                                           w->n, COMETI_FP8_SCALE_BF16, s) != cudaSuccess ||
           cometi_launch_scales_bf16(w->bs, w->bs16, c->total / 128 * w->n, s) != cudaSuccess;
}

static int run_wgrad_gemm(void *p, cudaStream_t s)
{
    wgrad_run_t *w = p;
    return cometi_gemm_run(w->err, &w->g, s) != COMET_SUCCESS;
}

static int run_wgrad_both(void *p, cudaStream_t s) { return run_wgrad_quantize(p, s) || run_wgrad_gemm(p, s); }

static int run_wgrad_lt(void *p, cudaStream_t s)
{
    wgrad_run_t *w = p;
    const int64_t T = w->c->total;
    return cometi_blaslt_fp8_wgrad(w->err, w->lt, w->c->groups, w->k_start, w->k_len, w->m_out, w->n, w->at, T, w->as,
                                   w->bt, T, w->bs, w->c_lt, 0, 0, s) != COMET_SUCCESS;
}

/* One weight gradient, C [groups][m_out][n] = A_g^T B_g: bf16, FP8 alone, FP8 with its
 * cast-transposes; prints a row, returns 1 on a failure (2: a wrong answer). */
static int wgrad_row(const tool_options_t *o, fp8_case_t *c, cometi_blaslt_fp8_t *lt, const char *name, const void *a,
                     int m_out, const void *b, int n, cometi_async_error_t *err_host, cometi_async_error_t *err_dev)
{
    wgrad_run_t w;
    memset(&w, 0, sizeof(w));
    w.c = c, w.a = a, w.b = b, w.m_out = m_out, w.n = n, w.lt = lt;
    const size_t T = (size_t)c->total, out = (size_t)c->groups * m_out * n;
    void *c16 = NULL, *c8 = NULL;
    CUDA_OK(cudaMalloc(&w.at, (size_t)m_out * T));
    CUDA_OK(cudaMalloc(&w.bt, (size_t)n * T));
    CUDA_OK(cudaMalloc((void **)&w.as, T / 128 * m_out * 4));
    CUDA_OK(cudaMalloc((void **)&w.bs, T / 128 * n * 4));
    CUDA_OK(cudaMalloc((void **)&w.bs16, T / 128 * n * 2));
    CUDA_OK(cudaMalloc(&c16, out * 2));
    CUDA_OK(cudaMalloc(&c8, out * 2));
    cometi_gemm_t *g = &w.g;
    g->problem.along = COMETI_GEMM_GROUPS_ALONG_K;
    g->problem.groups = c->groups, g->problem.segs = c->segs, g->problem.n = n, g->problem.m_out = m_out;
    g->a.ptr = a, g->a.rows = c->total, g->a.major = COMETI_GEMM_MN_MAJOR;
    g->b.ptr = b, g->b.major = COMETI_GEMM_MN_MAJOR;
    g->out.epilogue = COMETI_GEMM_EPI_STORE, g->out.c = c16, g->out.ldc = n;
    g->err = err_dev;
    int failed = 0;
    const float t_bf16 = gemm_time_ms(run_wgrad_gemm, &w, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s bf16: %s", name, w.err);
    g->a.ptr = w.at, g->a.type = COMETI_GEMM_E4M3, g->a.major = COMETI_GEMM_K_MAJOR;
    g->a.scale = w.as, g->a.scale_row = 1, g->a.scale_block = m_out;
    g->b.ptr = w.bt, g->b.type = COMETI_GEMM_E4M3, g->b.major = COMETI_GEMM_K_MAJOR;
    g->b.scale16 = w.bs16, g->b.scale_row = 1, g->b.scale_block = n;
    g->out.c = c8;
    uint16_t *h8 = TOOL_MALLOC(out * 2), *h16 = TOOL_MALLOC(out * 2);
    CUDA_OK(cudaMemcpy(h16, c16, out * 2, cudaMemcpyDeviceToHost));
    /* The tile width and store the description chooses, the direct store, then 128-wide
     * tiles: each checked on poisoned operands and output, then timed. */
    float t_fp8[3], t_both = 0;
    double diff = 0;
    int nonfinite = 0;
    for (int wi = 0; wi < 3; wi++) {
        g->launch.block_n = wi == 2 ? 128 : 0;
        g->out.store = wi == 1 ? COMETI_GEMM_STORE_DIRECT : COMETI_GEMM_STORE_AUTO;
        CUDA_OK(cudaMemset(w.at, 0xff, (size_t)m_out * T));
        CUDA_OK(cudaMemset(w.bt, 0xff, (size_t)n * T));
        CUDA_OK(cudaMemset(c8, 0xff, out * 2));
        FAIL_IF(run_wgrad_both(&w, 0), "%s fp8: %s", name, w.err);
        CUDA_OK(cudaDeviceSynchronize());
        FAIL_IF(err_host->status, "%s fp8: the GEMM pipeline stalled", name);
        CUDA_OK(cudaMemcpy(h8, c8, out * 2, cudaMemcpyDeviceToHost));
        double sums[2] = {0, 0};
        add_bf16_pairs(h8, h16, out, sums, &nonfinite);
        if (deepgemm_diff(sums) > diff) diff = deepgemm_diff(sums);
        t_fp8[wi] = gemm_time_ms(run_wgrad_gemm, &w, 3, o->iters, &failed, NULL, NULL);
        if (!wi) t_both = gemm_time_ms(run_wgrad_both, &w, 3, o->iters, &failed, NULL, NULL);
        FAIL_IF(failed, "%s fp8: %s", name, w.err);
    }
    const float t_q = gemm_time_ms(run_wgrad_quantize, &w, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s cast-transposes: %s", name, w.err);
    /* cuBLASLt on the same operands (the last cast's), its output poisoned first, against
     * ours as the last check read it (h8; h16 takes cuBLASLt's). */
    w.k_start = TOOL_MALLOC(sizeof(int64_t) * c->groups), w.k_len = TOOL_MALLOC(sizeof(int64_t) * c->groups);
    for (int g = 0; g < c->groups; g++) w.k_start[g] = c->row_start[g], w.k_len[g] = (c->row_count[g] + 127) / 128 * 128;
    CUDA_OK(cudaMalloc(&w.c_lt, out * 2));
    CUDA_OK(cudaMemset(w.c_lt, 0xff, out * 2));
    FAIL_IF(run_wgrad_lt(&w, 0), "%s cuBLASLt: %s", name, w.err);
    CUDA_OK(cudaMemcpy(h16, w.c_lt, out * 2, cudaMemcpyDeviceToHost));
    double lt_sums[2] = {0, 0};
    add_bf16_pairs(h16, h8, out, lt_sums, &nonfinite);
    const double d_lt = deepgemm_diff(lt_sums);
    free(h8), free(h16);
    const float t_lt = gemm_time_ms(run_wgrad_lt, &w, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s cuBLASLt: %s", name, w.err);
    char lt_algo[192];
    cometi_blaslt_fp8_algo_text(lt, lt_algo, sizeof(lt_algo));
    free(w.k_start), free(w.k_len), cudaFree(w.c_lt);
    /* Both operands rounded to E4M3 once: about 6e-4 of the measure on these operands (the
     * forward's GEMM1 has the same two roundings); 1e-3 flags a wrong one. Against cuBLASLt
     * on the same operands only the FP32 sums' order and the bf16 rounding differ (about
     * (2^-9)^2 = 4e-6): 1e-4 flags a wrong one. */
    const int wrong = nonfinite || !(diff <= 1e-3) || !(d_lt <= 1e-4);
    const double flop = 2.0 * c->groups * c->rows * (double)m_out * n;
#define TF(ms) (flop / ((ms) * 1e-3) / 1e12)
    printf("%-24s %6d %6d %6d %6d %8.0f %8.0f %8.0f %8.0f %8.0f %8.3f %8.2f %8.2f %9.2f %9.1e %9.1e%s\n", name,
           c->groups, c->rows, m_out, n, TF(t_bf16), TF(t_lt), TF(t_fp8[0]), TF(t_fp8[1]), TF(t_fp8[2]), t_q,
           t_bf16 / t_fp8[0], t_bf16 / t_both, t_lt / t_fp8[0], d_lt, diff, wrong ? " WRONG" : "");
    printf("  cuBLASLt: %s\n", lt_algo);
#undef TF
    fflush(stdout);
    cudaFree(w.at), cudaFree(w.bt), cudaFree(w.as), cudaFree(w.bs), cudaFree(w.bs16), cudaFree(c16), cudaFree(c8);
    return wrong ? 2 : 0;
}

/* A data-gradient GEMM, C [total][n] = A W per expert (k = W's rows): ours in bf16 (W as
 * the forward keeps it, read MN-major) and in FP8 (A's rows 1 x 128, W^T's 128 x 128
 * copy, K-major: FP8 wgmma reads k-major operands only), the FP8 result against bf16's
 * by DeepGEMM's measure; prints a row, returns 1 on a failure (2: a wrong answer). */
typedef struct dgrad_lt {
    fp8_run_t *r;
    int n, k;
    const void *aq, *wt;
    const float *as_lt, *wts_lt;
    void *c_lt;
} dgrad_lt_t;

static int run_dgrad_lt(void *p, cudaStream_t s)
{
    dgrad_lt_t *d = p;
    const fp8_case_t *c = d->r->c;
    return cometi_blaslt_fp8_grouped(d->r->err, d->r->lt, c->groups, c->row_start, c->row_count, d->n, d->k, d->aq,
                                     d->as_lt, d->wt, d->wts_lt, d->c_lt, d->n, s) != COMET_SUCCESS;
}

static int dgrad_row(const tool_options_t *o, fp8_case_t *c, cometi_blaslt_fp8_t *lt, const char *name, const void *a,
                     int k, const void *w, int n, cometi_async_error_t *err_host, cometi_async_error_t *err_dev)
{
    const size_t T = (size_t)c->total, out = T * n, kb = (size_t)(k + 127) / 128;
    const int G = c->groups;
    const size_t nb = (size_t)G * ((n + 127) / 128);
    const int64_t lt_scales = cometi_blaslt_fp8_a_scales_layout(G, c->row_count, k, NULL);
    void *aq = NULL, *wt = NULL, *c16 = NULL, *c8 = NULL, *c_lt = NULL;
    float *as = NULL, *wts = NULL, *as_lt = NULL, *wts_lt = NULL;
    CUDA_OK(cudaMalloc(&aq, T * k));
    CUDA_OK(cudaMalloc((void **)&as, T * kb * 4));
    CUDA_OK(cudaMalloc((void **)&as_lt, (size_t)lt_scales * 4 + 16));
    CUDA_OK(cudaMalloc(&wt, (size_t)G * n * k));
    CUDA_OK(cudaMalloc((void **)&wts, nb * kb * 4));
    CUDA_OK(cudaMalloc((void **)&wts_lt, nb * cometi_blaslt_fp8_b_scale_ld(k) * 4));
    CUDA_OK(cudaMalloc(&c16, out * 2));
    CUDA_OK(cudaMalloc(&c8, out * 2));
    CUDA_OK(cudaMalloc(&c_lt, out * 2));
    CUDA_OK(cudaMemset(as_lt, 0, (size_t)lt_scales * 4 + 16)); /* the padding rows' scales */
    if (quantize_rows_both(c, a, k, aq, as, as_lt)) return 1;
    CUDA_OK(cometi_quantize_blocks_e4m3(w, G, k, n, NULL, NULL, wt, wts, 0, 0)); /* W^T [G][n][k] */
    char lt_err[COMETI_ERR_LEN];
    FAIL_IF(cometi_blaslt_fp8_pad_b_scales(lt_err, G, n, k, wts, wts_lt, 0) != COMET_SUCCESS, "%s", lt_err);
    fp8_run_t r;
    memset(&r, 0, sizeof(r));
    r.c = c, r.lt = lt;
    cometi_gemm_t *g = &r.g;
    g->problem.groups = G, g->problem.segs = c->segs, g->problem.n = n, g->problem.k = k;
    g->a.ptr = a, g->a.rows = c->total;
    g->b.ptr = w, g->b.major = COMETI_GEMM_MN_MAJOR;
    g->out.epilogue = COMETI_GEMM_EPI_STORE, g->out.c = c16, g->out.ldc = n;
    g->err = err_dev;
    int failed = 0;
    const float t_bf16 = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s bf16: %s", name, r.err);
    g->a.ptr = aq, g->a.type = COMETI_GEMM_E4M3, g->a.scale = as, g->a.scale_row = 1, g->a.scale_block = c->total;
    g->b.ptr = wt, g->b.type = COMETI_GEMM_E4M3, g->b.major = COMETI_GEMM_K_MAJOR, g->b.scale = wts;
    g->out.c = c8;
    /* Ours at its chosen width, then with 128-wide tiles, each checked against bf16 on a
     * poisoned output, then timed. */
    uint16_t *h8 = TOOL_MALLOC(out * 2), *h16 = TOOL_MALLOC(out * 2);
    CUDA_OK(cudaMemcpy(h16, c16, out * 2, cudaMemcpyDeviceToHost));
    double sums[2][2] = {{0, 0}, {0, 0}};
    float t_fp8[2];
    int nonfinite = 0;
    for (int wi = 0; wi < 2; wi++) {
        const char *form = wi ? "fp8 128" : "fp8";
        g->launch.block_n = wi ? 128 : 0;
        CUDA_OK(cudaMemset(c8, 0xff, out * 2));
        FAIL_IF(run_ours(&r, 0), "%s %s: %s", name, form, r.err);
        CUDA_OK(cudaDeviceSynchronize());
        FAIL_IF(err_host->status, "%s %s: the GEMM pipeline stalled", name, form);
        CUDA_OK(cudaMemcpy(h8, c8, out * 2, cudaMemcpyDeviceToHost)); /* cuBLASLt's rows go against the last */
        add_expert_rows(c, h8, h16, n, sums[wi], &nonfinite);
        t_fp8[wi] = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
        FAIL_IF(failed, "%s %s: %s", name, form, r.err);
    }
    g->launch.block_n = 0;
    /* cuBLASLt per expert on the same E4M3 operands, poisoned output first; the experts' rows
     * against ours. */
    dgrad_lt_t d = {&r, n, k, aq, wt, as_lt, wts_lt, c_lt};
    CUDA_OK(cudaMemset(c_lt, 0xff, out * 2));
    FAIL_IF(run_dgrad_lt(&d, 0), "%s cuBLASLt: %s", name, r.err);
    CUDA_OK(cudaDeviceSynchronize());
    uint16_t *hl = TOOL_MALLOC(out * 2);
    CUDA_OK(cudaMemcpy(hl, c_lt, out * 2, cudaMemcpyDeviceToHost));
    double lsums[2] = {0, 0};
    add_expert_rows(c, hl, h8, n, lsums, &nonfinite);
    free(h8), free(h16), free(hl);
    const float t_lt = gemm_time_ms(run_dgrad_lt, &d, 3, o->iters, &failed, NULL, NULL);
    FAIL_IF(failed, "%s cuBLASLt: %s", name, r.err);
    char lt_algo[192];
    cometi_blaslt_fp8_algo_text(lt, lt_algo, sizeof(lt_algo));
    const double diff = deepgemm_diff(sums[0]), d_lt = deepgemm_diff(lsums), diff_128 = deepgemm_diff(sums[1]);
    /* Two E4M3 roundings, as GEMM1's; against cuBLASLt, as the weight gradients'. */
    const int wrong = nonfinite || !(diff <= 1e-3) || !(diff_128 <= 1e-3) || !(d_lt <= 1e-4);
    const double flop = 2.0 * G * c->rows * (double)n * k;
#define TF(ms) (flop / ((ms) * 1e-3) / 1e12)
    printf("%-24s %6d %6d %6d %6d %8.0f %8.0f %8.0f %8.2f %9.2f %9.1e %9.1e%s\n", name, G, c->rows, n, k, TF(t_bf16),
           TF(t_lt), TF(t_fp8[0]), t_bf16 / t_fp8[0], t_lt / t_fp8[0], d_lt, diff, wrong ? " WRONG" : "");
    printf("%-24s %6s %6s %6s %6s %8s %8s %8.0f %8.2f %9.2f %9s %9.1e  (128-wide tiles)\n", "", "", "", "", "", "", "",
           TF(t_fp8[1]), t_bf16 / t_fp8[1], t_lt / t_fp8[1], "", diff_128);
    printf("  cuBLASLt: %s\n", lt_algo);
#undef TF
    fflush(stdout);
    cudaFree(aq), cudaFree(as), cudaFree(as_lt), cudaFree(wt), cudaFree(wts), cudaFree(wts_lt), cudaFree(c16);
    cudaFree(c8), cudaFree(c_lt);
    return wrong ? 2 : 0;
}

/* The backward's GEMMs on every preset: the weight gradients (dW2 = dy^T a, dW13 = dh^T x)
 * or the data gradients (s = dy W2, dx = dh W13); dy takes x's values, dh is hash-filled
 * [total][2F] with zero padding rows (as the layer's). 1: a failure; *bad |= a wrong row. */
static int backward_table(const tool_options_t *o, cometi_blaslt_fp8_t *lt, int ep, int dgrad,
                          cometi_async_error_t *err_host, cometi_async_error_t *err_dev, int *bad)
{
    for (int i = 0; i < o->npresets; i++) {
        comet_moe_config_t cfg;
        comet_moe_config_preset(o->presets[i], o->tokens, &cfg);
        fp8_case_t c;
        if (case_open(o, &cfg, ep, i, &c)) return 1;
        CUDA_OK(cometi_fill_hash_bf16(c.h, (size_t)c.total * 2 * c.F, o->seed + 4 * i + 5 + dgrad, 0, 1.0f, 0));
        for (int g = 0; g < c.groups; g++)
            CUDA_OK(cudaMemset((char *)c.h + ((size_t)g * c.pad_rows + c.rows) * 2 * c.F * 2, 0,
                               (size_t)(c.pad_rows - c.rows) * 2 * c.F * 2));
        for (int which = 0; which < 2; which++) { /* W2's, then W13's */
            char name[48];
            snprintf(name, sizeof(name), "%s %s%s", o->presets[i], dgrad ? "dgrad " : "d", which ? "W13" : "W2");
            const int st = dgrad ? (which ? dgrad_row(o, &c, lt, name, c.h, 2 * c.F, c.w13, c.H, err_host, err_dev)
                                          : dgrad_row(o, &c, lt, name, c.x, c.H, c.w2, c.F, err_host, err_dev))
                                 : (which ? wgrad_row(o, &c, lt, name, c.h, 2 * c.F, c.x, c.H, err_host, err_dev)
                                          : wgrad_row(o, &c, lt, name, c.x, c.H, c.act, c.F, err_host, err_dev));
            if (st == 1) return 1;
            *bad |= st != 0;
        }
        case_close(&c);
    }
    return 0;
}

/* --trace: one more call of r->g with the tile timeline (gemm.h's tile_trace) and where
 * its time went, per SM. */
static int print_timeline(fp8_run_t *r, int sms, const char *label)
{
    const size_t bytes = sizeof(unsigned long long) * COMETI_TILE_TRACE_WORDS * sms;
    unsigned long long *dev, *host = TOOL_MALLOC(bytes);
    FAIL_IF(!host, "out of host memory");
    CUDA_OK(cudaMalloc((void **)&dev, bytes));
    CUDA_OK(cudaMemset(dev, 0, bytes));
    r->g.roles.tile_trace = dev;
    const int failed = run_ours(r, 0);
    r->g.roles.tile_trace = NULL;
    FAIL_IF(failed, "%s traced: %s", label, r->err);
    CUDA_OK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
    cudaFree(dev);
    char err[COMETI_ERR_LEN];
    cometi_timeline_t s;
    FAIL_IF(cometi_timeline_summarize(err, host, sms, &s) != COMET_SUCCESS, "%s tile timeline: %s", label, err);
    free(host);
    printf("  %-4s timeline, us per SM: %.1f = launch %.1f + tiles %.1f (%lld, %.2f each; a block's first %.2f, later "
           "%.2f) + tail %.1f + waits %.1f%s\n", label, s.span_us, s.launch_us, s.tiles_us, s.tiles, s.tile_us,
           s.first_tile_us, s.later_tile_us, s.tail_us, s.wait_us,
           s.truncated ? " (some blocks took more tiles than their rows hold)" : "");
    return 0;
}

int gemm_fp8_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const tool_options_t *o = arg;
    const int code = rank_device(ctx);
    if (code) return code;
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, ctx->local_rank));
    cometi_async_error_t *err_host, *err_dev;
    CUDA_OK(cudaHostAlloc((void **)&err_host, sizeof(*err_host), cudaHostAllocMapped));
    memset(err_host, 0, sizeof(*err_host));
    CUDA_OK(cudaHostGetDevicePointer((void **)&err_dev, err_host, 0));
    void *tail_ws;
    CUDA_OK(cudaMalloc(&tail_ws, COMETI_GEMM_TAIL_BYTES(prop.multiProcessorCount)));
    CUDA_OK(cudaMemset(tail_ws, 0, COMETI_GEMM_TAIL_COUNTERS * 8));
    fp8_run_t r;
    memset(&r, 0, sizeof(r));
    FAIL_IF(cometi_blaslt_fp8_create(r.err, &r.lt) != COMET_SUCCESS, "%s", r.err);
    const int ep = o->ep ? o->ep : 1;
    printf("%s, %d SMs; block-scaled FP8 (E4M3, 1 x 128 and 128 x 128 FP32 scales); rows per expert: %d tokens over "
           "EP %d, balanced; TFLOP/s = 2 rows n k / median time of %d calls\n", prop.name, prop.multiProcessorCount,
           o->tokens, ep, o->iters);
    const int forward = o->gemms & TOOL_GEMMS_FORWARD;
    if (forward) {
        printf("GEMM0 = x W13^T, ours with the quantizing SwiGLU; \"+SwiGLU\": cuBLASLt, then SwiGLU and the "
               "activation quantized (the baseline's GEMM0)\n");
        printf("vs lt: ||ours - cuBLASLt|| / ||cuBLASLt|| (GEMM1), 1 - 2xy/(x^2+y^2) of the activations (GEMM0); vs "
               "bf16: 1 - 2xy/(x^2+y^2) against our bf16 GEMM\n");
        printf("%-24s %6s %6s %6s %6s %8s %8s %8s %8s %8s %8s %8s %9s %9s\n", "shape", "groups", "rows", "n", "k",
               "bf16", "cuBLASLt", "+SwiGLU", "fp8", "/bf16", "/cuBLASLt", "/+SwiGLU", "vs lt", "vs bf16");
    }
    int bad = 0;
    for (int i = 0; forward && i < o->npresets; i++) {
        comet_moe_config_t cfg;
        comet_moe_config_preset(o->presets[i], o->tokens, &cfg);
        fp8_case_t c;
        if (case_open(o, &cfg, ep, i, &c)) return 1;
        r.c = &c;
        for (int which = 0; which < 2; which++) {
            int failed = 0;
            /* Ours in bf16, then its output kept for the accuracy check. */
            r.g = describe(&c, which, 0, err_dev, tail_ws);
            const float t_bf16 = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
            FAIL_IF(failed, "%s GEMM%d bf16: %s", o->presets[i], which, r.err);
            const cometi_gemm_t g_bf16 = r.g; /* --trace: its timeline after the row */
            const size_t out_bytes = (size_t)c.total * (which ? c.H : c.F) * 2;
            void *bf16_out = NULL;
            CUDA_OK(cudaMalloc(&bf16_out, out_bytes));
            CUDA_OK(cudaMemcpy(bf16_out, which ? c.y : c.act_ref, out_bytes, cudaMemcpyDeviceToDevice));
            /* cuBLASLt, poisoned outputs first. */
            CUDA_OK(cudaMemset(which ? c.y_ref : c.act_lt_q, 0xff, (size_t)c.total * (which ? c.H * 2 : c.F)));
            const float t_lt = gemm_time_ms(which ? run_lt_gemm1 : run_lt_gemm0, &r, 3, o->iters, &failed, NULL, NULL);
            FAIL_IF(failed, "%s GEMM%d cuBLASLt: %s", o->presets[i], which, r.err);
            char lt_algo[192];
            cometi_blaslt_fp8_algo_text(r.lt, lt_algo, sizeof(lt_algo));
            float t_lt_all = t_lt;
            if (!which) {
                t_lt_all = gemm_time_ms(run_lt_gemm0_swiglu, &r, 3, o->iters, &failed, NULL, NULL);
                FAIL_IF(failed, "%s GEMM0 cuBLASLt + SwiGLU: %s", o->presets[i], r.err);
            }
            /* Ours in FP8: checked on poisoned outputs, then timed. */
            r.g = describe(&c, which, 1, err_dev, tail_ws);
            CUDA_OK(cudaMemset(which ? c.y : c.actq_out, 0xff, (size_t)c.total * (which ? c.H * 2 : c.F)));
            FAIL_IF(run_ours(&r, 0), "%s GEMM%d fp8: %s", o->presets[i], which, r.err);
            CUDA_OK(cudaDeviceSynchronize());
            FAIL_IF(err_host->status, "%s GEMM%d fp8: the GEMM pipeline stalled", o->presets[i], which);
            double d_lt = 0, d_bf16 = 0;
            if (which ? check_gemm1(&c, &d_lt, &d_bf16, bf16_out) : check_gemm0(&c, &d_lt, &d_bf16, bf16_out)) return 1;
            const float t_fp8 = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
            FAIL_IF(failed, "%s GEMM%d fp8: %s", o->presets[i], which, r.err);
            const cometi_gemm_t g_fp8 = r.g; /* --trace: its timeline after the row */
            /* GEMM1 with 128-wide tiles too (the layer's, with the push or splits), checked the same way. */
            float t_128 = 0;
            double d_128 = 0, d_128_bf16 = 0;
            if (which) {
                r.g.launch.block_n = 128, r.g.launch.schedule = 0; /* 128 wide: cooperative */
                CUDA_OK(cudaMemset(c.y, 0xff, (size_t)c.total * c.H * 2));
                FAIL_IF(run_ours(&r, 0), "%s GEMM1 fp8 128: %s", o->presets[i], r.err);
                CUDA_OK(cudaDeviceSynchronize());
                if (check_gemm1(&c, &d_128, &d_128_bf16, bf16_out)) return 1;
                t_128 = gemm_time_ms(run_ours, &r, 3, o->iters, &failed, NULL, NULL);
                FAIL_IF(failed, "%s GEMM1 fp8 128: %s", o->presets[i], r.err);
                if (d_128 > d_lt) d_lt = d_128;
            }
            cudaFree(bf16_out);
            const int n = which ? c.H : 2 * c.F, k = which ? c.F : c.H;
            const double flop = 2.0 * c.groups * c.rows * (double)n * k;
            /* Same operands: ours and cuBLASLt differ by the fp32 sums' order and one rounding
             * (1e-2 is a wrong answer). Against bf16, FP8's own error: each E4M3 rounding costs
             * about 2.4% RMS of a value on these random operands (3 mantissa bits), so two
             * (GEMM1's x and W) give about 6e-4 of DeepGEMM's measure (its bound is 1e-3), and
             * GEMM0's third, the activation's own, about 1.5e-3: 3e-3 flags a wrong one. */
            const int wrong = !(d_lt <= (which ? 1e-2 : 1e-3)) || !(d_bf16 <= (which ? 1e-3 : 3e-3));
            bad |= wrong;
            char name[48];
            snprintf(name, sizeof(name), "%s GEMM%d", o->presets[i], which);
#define TF(ms) (flop / ((ms) * 1e-3) / 1e12)
            printf("%-24s %6d %6d %6d %6d %8.1f %8.1f %8s %8.1f %8.2f %8.2f %8s %9.1e %9.1e%s\n", name, c.groups,
                   c.rows, n, k, TF(t_bf16), TF(t_lt), "", TF(t_fp8), t_bf16 / t_fp8, t_lt / t_fp8, "", d_lt, d_bf16,
                   wrong ? " WRONG" : "");
            if (!which)
                printf("%-24s %6s %6s %6s %6s %8s %8s %8.1f %8s %8s %8s %8.2f\n", "", "", "", "", "", "", "",
                       TF(t_lt_all), "", "", "", t_lt_all / t_fp8);
            else
                printf("%-24s %6s %6s %6s %6s %8s %8s %8s %8.1f %8.2f %8.2f %8s %9.1e  (128-wide tiles)\n", "", "", "",
                       "", "", "", "", "", TF(t_128), t_bf16 / t_128, t_lt / t_128, "", d_128);
            printf("  cuBLASLt: %s\n", lt_algo);
#undef TF
            if (o->trace) {
                r.g = g_bf16;
                if (print_timeline(&r, prop.multiProcessorCount, "bf16")) return 1;
                r.g = g_fp8;
                if (print_timeline(&r, prop.multiProcessorCount, "fp8")) return 1;
            }
            fflush(stdout);
        }
        case_close(&c);
    }
    if (o->gemms & TOOL_GEMMS_WGRAD) {
        printf("\nweight gradients (groups along K): dW2 = dy^T a, dW13 = dh^T x; fp8: our GEMM on operands "
               "cast-transposed in 128 x 1 blocks along the tokens (its chosen tile width and store, the direct store, "
               "128 wide); cuBLASLt: its 1 x 128 by 1 x 128 GEMM per expert on the same operands; quant: both "
               "cast-transposes, ms; +quant: bf16 / (quant + fp8); vs lt, vs bf16: 1 - 2xy/(x^2+y^2)\n");
        printf("%-24s %6s %6s %6s %6s %8s %8s %8s %8s %8s %8s %8s %8s %9s %9s %9s\n", "shape", "groups", "rows", "m",
               "n", "bf16", "cuBLASLt", "fp8", "direct", "fp8 128", "quant", "/bf16", "+quant", "/cuBLASLt", "vs lt",
               "vs bf16");
        if (backward_table(o, r.lt, ep, 0, err_host, err_dev, &bad)) return 1;
    }
    if (o->gemms & TOOL_GEMMS_DGRAD) {
        printf("\ndata gradients: s = dy W2 (k = hidden), dx = dh W13 (k = 2 ffn); bf16: W read MN-major as the "
               "forward keeps it; fp8: dy and dh rows 1 x 128 (quantized before, not timed), W^T's 128 x 128 copy (its "
               "chosen tile width, then 128 wide); cuBLASLt: per expert on the same operands; vs lt, vs bf16: "
               "1 - 2xy/(x^2+y^2)\n");
        printf("%-24s %6s %6s %6s %6s %8s %8s %8s %8s %9s %9s %9s\n", "shape", "groups", "rows", "n", "k", "bf16",
               "cuBLASLt", "fp8", "/bf16", "/cuBLASLt", "vs lt", "vs bf16");
        if (backward_table(o, r.lt, ep, 1, err_host, err_dev, &bad)) return 1;
    }
    cometi_blaslt_fp8_destroy(r.lt);
    cudaFree(tail_ws);
    cudaFreeHost(err_host);
    return bad;
}
