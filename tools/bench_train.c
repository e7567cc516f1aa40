/*
 * bench_train.c - `comet bench --train`: after a case's forward rows, its training calls
 * on each impl, the baseline's then comet's (COMET_IMPL_FUSED): comet_moe_forward_train
 * into a saved state, comet_moe_backward (bf16 weight gradients), the two back to back (the
 * step), and for comet its backward's GEMMs alone (every SM, no communication). Timed as
 * the forward is (bench_timing.c): inputs rotated over NSETS sets, each with its own dy
 * and saved state; a device barrier before each call; medians, the slowest rank's; comet's
 * step against the baseline's from the two timed in turns. Before the timing, comet's dx
 * against the baseline's on input set 0. A call an impl does not serve (COMET_NOT_SUPPORTED)
 * is "n/a" in its row, and the rest go on.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "bench.h"
#include "alloc.h"
#include "tool.h"

/* Comet's dx against the baseline's, each element over its row's RMS: twice
 * tests/test_backward.c's limit of each against float64 (5e-2 of the row's RMS), since
 * here both sides carry their bf16 roundings. An element from a wrong row, or left
 * unwritten, is off by about 1 or more. */
#define DX_LIMIT 1e-1

static const comet_impl_t impls[TRAIN_IMPLS] = {COMET_IMPL_BASELINE, COMET_IMPL_FUSED};
static const char *const impl_names[TRAIN_IMPLS] = {"baseline", "comet"};

/* A case's buffers beyond the forward's: what the timed calls take (per input set a saved
 * state and a dy; the backward's outputs), and each impl's dx, kept for the check. */
typedef struct train_case {
    train_bufs_t tr;
    void *dx[TRAIN_IMPLS];
    size_t dx_bytes, dw_bytes, gate_up_bytes, down_bytes;
} train_case_t;

static int train_alloc(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_moe_t moe,
                       const comet_moe_config_t *cfg, const comet_moe_args_t *a, train_case_t *tc)
{
    const int tp = cfg->tp_size > 0 ? cfg->tp_size : 1, per = cfg->num_experts / (ctx->nranks / tp),
              Fl = cfg->ffn / tp, H = cfg->hidden, M = cfg->max_tokens;
    memset(tc, 0, sizeof(*tc));
    tc->dx_bytes = (size_t)M * H * 2;
    tc->dw_bytes = sizeof(float) * M * cfg->top_k;
    tc->gate_up_bytes = (size_t)per * 2 * Fl * H * 2;
    tc->down_bytes = (size_t)per * H * Fl * 2;
    comet_moe_backward_args_t *b = &tc->tr.b;
    *b = (comet_moe_backward_args_t)COMET_MOE_BACKWARD_ARGS_INIT;
    b->weights = a->weights;
    b->grads.mode = COMET_GRAD_WRITE_BF16;
    for (int i = 0; i < TRAIN_IMPLS; i++) CUDA_OK(cudaMalloc(&tc->dx[i], tc->dx_bytes + 16));
    CUDA_OK(cudaMalloc((void **)&b->d_topk_weights, tc->dw_bytes + 16));
    CUDA_OK(cudaMalloc(&b->grads.gate_up, tc->gate_up_bytes + 16));
    CUDA_OK(cudaMalloc(&b->grads.down, tc->down_bytes + 16));
    for (int set = 0; set < NSETS; set++) {
        /* dy as x is made (bench_case.c): hashed bf16 in [-1, 1), its own seed per set. */
        CUDA_OK(cudaMalloc(&tc->tr.dy[set], tc->dx_bytes + 16));
        CUDA_OK(cometi_fill_hash_bf16(tc->tr.dy[set], (size_t)M * H, o->seed * 31 + 30 + set,
                                      (uint64_t)ctx->rank * M * H, 1.0f, 0));
        const comet_status_t st = comet_moe_saved_create(moe, NULL, &tc->tr.saved[set]);
        FAIL_IF(st != COMET_SUCCESS, "comet_moe_saved_create: %s", comet_last_create_error());
    }
    return 0;
}

static void train_free(train_case_t *tc)
{
    for (int set = 0; set < NSETS; set++) comet_moe_saved_destroy(tc->tr.saved[set]), cudaFree(tc->tr.dy[set]);
    for (int i = 0; i < TRAIN_IMPLS; i++) cudaFree(tc->dx[i]);
    cudaFree(tc->tr.b.d_topk_weights), cudaFree(tc->tr.b.grads.gate_up), cudaFree(tc->tr.b.grads.down);
}

/* Point the calls at impl i: its path, its dx. */
static void use_impl(comet_moe_args_t *a, train_case_t *tc, int i)
{
    a->impl = impls[i];
    tc->tr.b.impl = impls[i];
    tc->tr.b.dx = tc->dx[i];
}

/* Every output of impl i's backward poisoned (bf16 and fp32 NaN). */
static int poison_outputs(train_case_t *tc, int i)
{
    CUDA_OK(cudaMemset(tc->dx[i], 0xff, tc->dx_bytes));
    CUDA_OK(cudaMemset(tc->tr.b.d_topk_weights, 0xff, tc->dw_bytes));
    CUDA_OK(cudaMemset(tc->tr.b.grads.gate_up, 0xff, tc->gate_up_bytes));
    CUDA_OK(cudaMemset(tc->tr.b.grads.down, 0xff, tc->down_bytes));
    return 0;
}

/* Each impl's training forward and backward once on input set 0, the backward's outputs
 * poisoned first: served[i][0] whether impl i serves the forward, served[i][1] the
 * backward (tried after a served forward: it reads a forward's saved state). Impl i's dx
 * stays in dx[i]. */
static int first_calls(const timed_call_t *base, train_case_t *tc, int nimpl, int served[][2])
{
    for (int i = 0; i < nimpl; i++) {
        timed_call_t c = *base;
        use_impl(c.a, tc, i);
        if (poison_outputs(tc, i)) return 1;
        served[i][1] = 0;
        c.what = TRAIN_FORWARD;
        if (try_call(&c, &served[i][0])) return 1;
        c.what = TRAIN_BACKWARD;
        if (served[i][0] && try_call(&c, &served[i][1])) return 1;
    }
    return 0;
}

/* The worst |got - want| over ranks, each element over the RMS of its row of `want` (m
 * rows of H bf16 on the device); infinite where got holds a NaN or Inf (an element left
 * poisoned). */
static int dx_error(comet_comm_t comm, const void *got_dev, const void *want_dev, int m, int H, double *out)
{
    const size_t n = (size_t)m * H;
    uint16_t *want = TOOL_MALLOC(2 * n + 2), *got = TOOL_MALLOC(2 * n + 2);
    FAIL_IF(!want || !got, "out of host memory");
    CUDA_OK(cudaMemcpy(want, want_dev, 2 * n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got, got_dev, 2 * n, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (size_t t = 0; t < (size_t)m; t++) {
        const uint16_t *u = want + t * H, *v = got + t * H;
        double ss = 0;
        for (int h = 0; h < H; h++) ss += (double)cometi_bf16_to_float(u[h]) * cometi_bf16_to_float(u[h]);
        const double rms = sqrt(ss / H);
        for (int h = 0; h < H; h++) {
            const double d = fabs((double)cometi_bf16_to_float(v[h]) - cometi_bf16_to_float(u[h]));
            const double e = d == 0 ? 0 : isfinite(d) && rms > 0 ? d / rms : INFINITY;
            if (!(e <= worst)) worst = e;
        }
    }
    free(want), free(got);
    float wf = isfinite(worst) ? (float)worst : INFINITY;
    if (allreduce(comm, &wf, 1, ncclMax)) return 1;
    *out = wf;
    return 0;
}

/* `what` timed as the forward is: the slowest rank's median. */
static int time_slowest(const timed_call_t *base, int what, const tool_options_t *o, float *ms)
{
    timed_call_t c = *base;
    c.what = what;
    if (time_calls(&c, o->warmup, o->iters, ms)) return 1;
    return allreduce(c.comm, ms, 1, ncclMax);
}

/* Our backward GEMMs alone, if the library serves them on these saved states; else -1. */
static int time_backward_gemms(const timed_call_t *base, const tool_options_t *o, float *ms)
{
    timed_call_t c = *base;
    c.what = BACKWARD_GEMMS;
    int served;
    *ms = -1;
    if (try_call(&c, &served)) return 1;
    return served ? time_slowest(&c, BACKWARD_GEMMS, o, ms) : 0;
}

/* Impl i's calls that it serves (served: first_calls'), inputs rotating. */
static int time_impl(const timed_call_t *base, const tool_options_t *o, train_case_t *tc, int i, const int served[2],
                     train_result_t *r)
{
    timed_call_t c = *base;
    use_impl(c.a, tc, i);
    if (!served[0]) return 0;
    if (time_slowest(&c, TRAIN_FORWARD, o, &r->forward_ms[i])) return 1;
    if (served[1] && time_slowest(&c, TRAIN_BACKWARD, o, &r->backward_ms[i])) return 1;
    if (i == TRAIN_COMET) {
        if (time_backward_gemms(&c, o, &r->gemms_ms)) return 1;
        for (int g = 0; g < 4 && r->gemms_ms >= 0; g++) { /* each alone */
            tc->tr.gemm_mask = 1 << g;
            if (time_backward_gemms(&c, o, &r->gemm_each_ms[g])) return 1;
        }
        tc->tr.gemm_mask = 0;
    }
    if (served[1] && time_slowest(&c, TRAIN_STEP, o, &r->step_ms[i])) return 1;
    return 0;
}

/* comet's step against the same on a twin handle whose config resends x (its saved states
 * keep no x rows; the backward sends x again), in turns, after a check that the twin's
 * weight gradients come out bit-equal (the same x rows, the same sums). */
static int time_resend(const timed_call_t *base, const comet_moe_config_t *cfg, train_case_t *tc,
                       const tool_options_t *o, train_result_t *res)
{
    train_bufs_t *tr = base->tr;
    comet_moe_config_t twin = *cfg;
    twin.resend_x = 1;
    FAIL_IF(comet_moe_create(base->comm, &twin, &tr->resend_moe) != COMET_SUCCESS, "comet_moe_create (resend_x): %s",
            comet_last_create_error());
    for (int set = 0; set < NSETS; set++)
        FAIL_IF(comet_moe_saved_create(tr->resend_moe, NULL, &tr->resend_saved[set]) != COMET_SUCCESS,
                "comet_moe_saved_create: %s", comet_last_create_error());
    FAIL_IF(comet_moe_saved_bytes(base->moe, NULL, &res->saved_bytes[0]) != COMET_SUCCESS ||
            comet_moe_saved_bytes(tr->resend_moe, NULL, &res->saved_bytes[1]) != COMET_SUCCESS,
            "comet_moe_saved_bytes failed");
    /* dW13 of input set 0 each way, the buffer poisoned before each. */
    unsigned char *grads[2];
    for (int i = 0; i < 2; i++) {
        grads[i] = TOOL_MALLOC(tc->gate_up_bytes);
        FAIL_IF(!grads[i], "out of host memory");
        timed_call_t c = *base;
        c.what = i ? RESEND_TRAIN_STEP : TRAIN_STEP;
        CUDA_OK(cudaMemset(tr->b.grads.gate_up, 0xff, tc->gate_up_bytes));
        int served = 0;
        if (try_call(&c, &served)) return 1;
        FAIL_IF(!served, "the training step refused (see above)");
        CUDA_OK(cudaMemcpy(grads[i], tr->b.grads.gate_up, tc->gate_up_bytes, cudaMemcpyDeviceToHost));
    }
    float differ = memcmp(grads[0], grads[1], tc->gate_up_bytes) != 0;
    free(grads[0]), free(grads[1]);
    if (allreduce(base->comm, &differ, 1, ncclMax)) return 1;
    res->resend_grads_equal = differ == 0;
    const int whats[2] = {TRAIN_STEP, RESEND_TRAIN_STEP};
    if (time_in_turns(base, whats, 2, o->iters, res->resend_turns_ms)) return 1;
    for (int set = 0; set < NSETS; set++) comet_moe_saved_destroy(tr->resend_saved[set]);
    FAIL_IF(comet_moe_destroy(tr->resend_moe) != COMET_SUCCESS, "comet_moe_destroy (resend_x): %s",
            comet_last_create_error());
    tr->resend_moe = NULL;
    return 0;
}

int run_train(const cometi_rank_ctx_t *ctx, const tool_options_t *o, comet_comm_t comm, comet_moe_t moe,
              const comet_moe_config_t *cfg, const char *label, const comet_moe_args_t *a_fwd, void **x,
              int32_t **ids, float **w, train_result_t *res)
{
    const int nimpl = o->run_comet ? TRAIN_IMPLS : 1;
    for (int i = 0; i < TRAIN_IMPLS; i++) res->forward_ms[i] = res->backward_ms[i] = res->step_ms[i] = -1;
    res->gemms_ms = -1;
    res->check = -1;
    res->resend_turns_ms[0] = res->resend_turns_ms[1] = 0;
    res->resend_grads_equal = -1;
    if (ctx->rank == 0) {
        size_t bytes = 0;
        comet_moe_saved_bytes(moe, NULL, &bytes);
        fprintf(stderr, "[bench] %s: training, %d saved states of %.2f GB; comet's dx against the baseline's\n",
                label, NSETS, bytes / 1e9);
    }
    train_case_t tc;
    if (train_alloc(ctx, o, moe, cfg, a_fwd, &tc)) return 1;
    comet_moe_args_t a = *a_fwd;
    const timed_call_t base = {TRAIN_FORWARD, comm, moe, NULL, NULL, &a, x, ids, w, NULL, NULL, NULL, &tc.tr};
    int served[TRAIN_IMPLS][2] = {{0, 0}, {0, 0}};
    if (first_calls(&base, &tc, nimpl, served)) return 1;
    if (nimpl == TRAIN_IMPLS && served[TRAIN_BASE][1] && served[TRAIN_COMET][1] &&
        dx_error(comm, tc.dx[TRAIN_COMET], tc.dx[TRAIN_BASE], a.num_tokens, cfg->hidden, &res->check))
        return 1;
    for (int i = 0; i < nimpl; i++) {
        if (ctx->rank == 0) fprintf(stderr, "[bench] %s: training on the %s path\n", label, i ? "fused" : "baseline");
        if (time_impl(&base, o, &tc, i, served[i], res)) return 1;
    }
    if (nimpl == TRAIN_IMPLS && res->step_ms[TRAIN_BASE] >= 0 && res->step_ms[TRAIN_COMET] >= 0) {
        timed_call_t c = base;
        use_impl(c.a, &tc, TRAIN_COMET);
        const int whats[TRAIN_IMPLS] = {BASE_TRAIN_STEP, TRAIN_STEP};
        if (time_in_turns(&c, whats, TRAIN_IMPLS, o->iters, res->step_turns_ms)) return 1;
        if (ctx->rank == 0) fprintf(stderr, "[bench] %s: training with x sent again (config.resend_x)\n", label);
        if (time_resend(&c, cfg, &tc, o, res)) return 1;
    }
    train_free(&tc);
    res->ran = 1;
    return 0;
}

/* A time as the row shows it: "n/a" where the impl does not serve the call. */
static const char *ms_text(float ms, char *buf, size_t len)
{
    if (ms < 0) return "n/a";
    snprintf(buf, len, "%.3f", ms);
    return buf;
}

static void train_row(const char *label, int tokens, int i, const train_result_t *r)
{
    char f[16], b[16], s[16], g[16], ratio[16] = "-", check[16] = "-";
    const char *gemms = "-";
    if (i == TRAIN_COMET) {
        gemms = ms_text(r->gemms_ms, g, sizeof(g));
        if (r->step_turns_ms[TRAIN_COMET] > 0)
            snprintf(ratio, sizeof(ratio), "%.2fx", r->step_turns_ms[TRAIN_BASE] / r->step_turns_ms[TRAIN_COMET]);
        else snprintf(ratio, sizeof(ratio), "n/a");
        if (r->check >= 0) snprintf(check, sizeof(check), "%.1e%s", r->check, r->check > DX_LIMIT ? "!" : "");
        else snprintf(check, sizeof(check), "n/a");
    }
    printf("%-16s %-9s %6d %12s %11s %9s %14s %16s %9s\n", label, impl_names[i], tokens,
           ms_text(r->forward_ms[i], f, sizeof(f)), ms_text(r->backward_ms[i], b, sizeof(b)),
           ms_text(r->step_ms[i], s, sizeof(s)), gemms, ratio, check);
}

/* A JSON time: null where the impl does not serve the call (or it was not timed). */
static void json_ms(FILE *json, const char *key, double ms)
{
    if (ms < 0) fprintf(json, ", \"%s\": null", key);
    else fprintf(json, ", \"%s\": %.4f", key, ms);
}

static void train_json(FILE *json, int *records, const cometi_rank_ctx_t *ctx, const tool_options_t *o,
                       const struct cudaDeviceProp *prop, const comet_moe_config_t *cfg, const char *label, int i,
                       const train_result_t *r)
{
    fprintf(json, "%s  {\"case\": \"%s\", \"impl\": \"%s-train\", ", (*records)++ ? ",\n" : "", label, impl_names[i]);
    json_case_fields(json, prop->name, ctx->nranks, cfg, o);
    json_ms(json, "forward_train_ms", r->forward_ms[i]);
    json_ms(json, "backward_ms", r->backward_ms[i]);
    json_ms(json, "step_ms", r->step_ms[i]);
    json_ms(json, "step_in_turns_ms", r->step_turns_ms[i] > 0 ? r->step_turns_ms[i] : -1);
    if (i == TRAIN_COMET) {
        const int turns = r->step_turns_ms[TRAIN_COMET] > 0;
        json_ms(json, "backward_gemms_ms", r->gemms_ms);
        json_ms(json, "baseline_step_in_turns_ms", turns ? r->step_turns_ms[TRAIN_BASE] : -1);
        if (turns) fprintf(json, ", \"step_speedup_in_turns\": %.4f",
                           r->step_turns_ms[TRAIN_BASE] / r->step_turns_ms[TRAIN_COMET]);
        else fprintf(json, ", \"step_speedup_in_turns\": null");
        json_ms(json, "resend_x_step_in_turns_ms", r->resend_turns_ms[1] > 0 ? r->resend_turns_ms[1] : -1);
        json_ms(json, "keep_x_step_in_turns_ms", r->resend_turns_ms[1] > 0 ? r->resend_turns_ms[0] : -1);
        if (r->resend_turns_ms[1] > 0)
            fprintf(json, ", \"saved_bytes\": %zu, \"resend_x_saved_bytes\": %zu, \"resend_x_dw13_bit_equal\": %s",
                    r->saved_bytes[0], r->saved_bytes[1], r->resend_grads_equal == 1 ? "true" : "false");
        if (r->check < 0) fprintf(json, ", \"dx_diff_vs_baseline\": null");
        else if (!isfinite(r->check)) fprintf(json, ", \"dx_diff_vs_baseline\": Infinity"); /* as Python's json */
        else fprintf(json, ", \"dx_diff_vs_baseline\": %.3g", r->check);
    }
    fprintf(json, "}");
}

/* The training rows of a case (rank 0), its JSON records; a dx beyond DX_LIMIT fails the
 * run (on every rank, as the forward's checks do). */
void report_train(const cometi_rank_ctx_t *ctx, const tool_options_t *o, const struct cudaDeviceProp *prop,
                  const comet_moe_config_t *cfg, const char *label, const train_result_t *r, FILE *json,
                  int *records, int *failed_check)
{
    if (!r->ran) return;
    if (r->check >= 0 && !(r->check <= DX_LIMIT)) *failed_check = 1;
    if (r->resend_grads_equal == 0) *failed_check = 1;
    if (ctx->rank != 0) return;
    const int nimpl = o->run_comet ? TRAIN_IMPLS : 1;
    printf("  training: comet_moe_forward_train, comet_moe_backward (bf16 weight gradients), the two back to back "
           "(step), our backward GEMMs alone; median ms, slowest rank; step vs baseline from the two steps in "
           "turns; check: comet's dx vs the baseline's, worst element / its row's RMS\n");
    printf("%-16s %-9s %6s %12s %11s %9s %14s %16s %9s\n", "case", "impl", "tokens", "fwd-train ms", "backward ms",
           "step ms", "GEMMs alone ms", "step vs baseline", "check");
    for (int i = 0; i < nimpl; i++) {
        train_row(label, cfg->max_tokens, i, r);
        if (json) train_json(json, records, ctx, o, prop, cfg, label, i, r);
    }
    if (r->resend_turns_ms[1] > 0)
        printf("  x sent again in the backward (config.resend_x): step %.3f ms against %.3f keeping x rows, in "
               "turns (%.3fx); a saved state %.3f GB against %.3f; dW13 %s\n", r->resend_turns_ms[1],
               r->resend_turns_ms[0], r->resend_turns_ms[0] / r->resend_turns_ms[1], r->saved_bytes[1] / 1e9,
               r->saved_bytes[0] / 1e9, r->resend_grads_equal == 1 ? "bit-equal" : "NOT bit-equal");
    if (nimpl == TRAIN_IMPLS && r->gemms_ms >= 0) {
        /* TFLOP/s on the rows of balanced routing: every rank receives tokens x top_k. */
        const double rows = (double)cfg->max_tokens * cfg->top_k, tp = cfg->tp_size > 0 ? cfg->tp_size : 1;
        const double flop = 2.0 * rows * cfg->hidden * (cfg->ffn / tp), mult[4] = {1, 2, 1, 2};
        const char *names[4] = {"dgrad W2", "dgrad W13", "dW2", "dW13"};
        printf("  our backward GEMMs, each alone (ms, TFLOP/s on balanced rows):");
        for (int g = 0; g < 4; g++)
            printf(" %s %.3f (%.0f)", names[g], r->gemm_each_ms[g], mult[g] * flop / (r->gemm_each_ms[g] * 1e9));
        printf("\n");
    }
}
