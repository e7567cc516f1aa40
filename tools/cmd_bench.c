/*
 * cmd_bench.c - the body of `comet bench` (and `comet tune`), run on every rank: the
 * cases (a preset or an explicit shape; with --suite every preset x token count x
 * routing), each run by bench_case.c (its training calls, with --train, by bench_train.c),
 * its rows printed on rank 0 and its records written as JSON on request; the suite's table
 * at the end. Times are CUDA events between phases; each phase's median is taken per rank
 * and the slowest rank's is reported.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "patterns/dispatch_gemm.h"
#include "patterns/gemm_combine.h"
#include "patterns/tune.h"
#include "bench.h"
#include "alloc.h"
#include "tool.h"

static const char *routing_name(cometi_routing_t r)
{
    return r == COMETI_ROUTING_BALANCED ? "balanced" : r == COMETI_ROUTING_RANDOM ? "random" : "skewed";
}

static const char *phase_json[P_COUNT] = {"total", "route", "dispatch_a2a", "experts", "combine_a2a", "combine",
                                          "layer0_part", "layer1_part"};

static const char *dispatch_mode_name(int mode) { return mode == COMETI_DISPATCH_STORES ? "stores" : "bulk"; }

/* A layer1 setting as the sweep line names it: "push" (or "push-static"), else combine
 * blocks x splits, "t" when the last split's combine runs after the GEMM on every SM. */
static const char *layer1_name(const cometi_combine_knobs_t *k, char *buf, size_t len)
{
    if (k->push) snprintf(buf, len, "%s", k->dynamic_tiles ? "push" : "push-static");
    else snprintf(buf, len, "%dx%d%s", k->combine_blocks, k->n_splits, k->tail || !k->combine_blocks ? "t" : "");
    return buf;
}

/* A case's fields as every record of its JSON carries them (after "case" and "impl"). */
void json_case_fields(FILE *json, const char *gpu, int ranks, const comet_moe_config_t *cfg, const tool_options_t *o)
{
    fprintf(json, "\"gpu\": \"%s\", \"ranks\": %d, \"tp\": %d, \"experts\": %d, \"top_k\": %d, \"hidden\": %d, "
            "\"ffn\": %d, \"tokens_per_rank\": %d, \"routing\": \"%s\", \"skew\": %g, \"iters\": %d, \"seed\": %llu",
            gpu, ranks, cfg->tp_size > 0 ? cfg->tp_size : 1, cfg->num_experts, cfg->top_k, cfg->hidden, cfg->ffn,
            cfg->max_tokens, routing_name(o->routing), o->skew, o->iters, (unsigned long long)o->seed);
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
                fprintf(json, "%s  {\"case\": \"%s\", \"impl\": \"baseline\", ", (*records)++ ? ",\n" : "", label);
                json_case_fields(json, prop->name, ctx->nranks, cfg, o);
                fprintf(json, ", \"median_ms\": {");
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
            /* Back to back as the baseline's row; the sweeps' best settings are timed below,
             * in turns with the baseline, each whole layer one measurement. */
            printf("%-16s %-9s %6d %9.3f   %.2fx the baseline, default knobs; y vs baseline %.1e%s\n", label, "comet",
                   cfg->max_tokens, base.public_ms, base.ms[P_TOTAL] / base.public_ms, base.public_check,
                   base.public_check > 1e-2 ? "!" : "");
            if (base.bound_gemms_ms > 0)
                printf("  in turns: the whole layer %.3f ms, our GEMM0 + GEMM1 alone %.3f ms (whole / GEMMs %.3f), "
                       "the baseline's cuBLAS experts %.3f ms (our GEMMs / cuBLAS %.3f), the whole baseline %.3f ms "
                       "(the whole layer %.2fx faster)\n", base.bound_whole_ms, base.bound_gemms_ms, base.bound_whole_ms / base.bound_gemms_ms,
                       base.bound_cublas_ms, base.bound_gemms_ms / base.bound_cublas_ms, base.bound_baseline_ms,
                       base.bound_baseline_ms / base.bound_whole_ms);
            if (json)
                fprintf(json, ",\n  {\"case\": \"%s\", \"impl\": \"comet\", \"tokens_per_rank\": %d, "
                        "\"routing\": \"%s\", \"total_ms\": %.4f, \"baseline_total_ms\": %.4f, "
                        "\"whole_in_turns_ms\": %.4f, \"gemms_alone_in_turns_ms\": %.4f, "
                        "\"cublas_experts_in_turns_ms\": %.4f, \"baseline_in_turns_ms\": %.4f, "
                        "\"diff_vs_baseline\": %.3g}", label, cfg->max_tokens, routing_name(o->routing), base.public_ms,
                        base.ms[P_TOTAL], base.bound_whole_ms, base.bound_gemms_ms, base.bound_cublas_ms,
                        base.bound_baseline_ms, base.public_check);
        }
        if (o->run_baseline && base.l0_runs) {
            const float l0 = base.l0_ms[base.l0_best];
            const cometi_dispatch_knobs_t *best = &base.l0_knobs[base.l0_best];
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
                const cometi_combine_knobs_t *k1 = &base.l1_knobs[base.l1_best];
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
                printf("  the whole layer in turns, each call timed whole (input set 0): these settings %.3f ms "
                       "(%.2fx the baseline's %.3f ms), the cost model's (%s) %.3f ms (tuned / model %.3f)\n",
                       base.tuned_turns_ms, base.baseline_turns_ms / base.tuned_turns_ms, base.baseline_turns_ms,
                       model_knobs, base.model_turns_ms, base.tuned_turns_ms / base.model_turns_ms);
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
                            "\"whole_model_in_turns_ms\": %.4f, \"whole_baseline_in_turns_ms\": %.4f, "
                            "\"push_owner_sum_ms\": %.4f}", label,
                            base.ms[P_LAYER1], l1, k1->combine_blocks, k1->n_splits, k1->push, base.l1_paired_ms,
                            base.l1_gemm_alone_ms, base.l1_alone_each[0], base.l1_alone_each[1], base.l1_diff,
                            base.tuned_turns_ms, base.model_turns_ms, base.baseline_turns_ms, base.push_sum_ms);
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
    report_train(ctx, o, prop, cfg, label, &base.train, json, records, failed_check);
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
    comet_comm_t comm;
    int code = rank_device(ctx);
    if (code || (code = rank_comm(ctx, o->timeout_ms, &comm))) return code;
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
    suite_row_t *rows = TOOL_CALLOC((size_t)ntokens * nroutings * ncases, sizeof(*rows));
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
                const comet_status_t st = comet_moe_config_validate(&cfg, ctx->nranks, msg, sizeof(msg));
                FAIL_IF(st != COMET_SUCCESS, "%s: %s", label, msg);
                case_result_t base;
                if (oc.fp8) { /* the FP8 layer beside the bf16 one (bench_fp8.c) */
                    if (bench_fp8_case(ctx, &oc, comm, &cfg, label)) return 1;
                    continue;
                }
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
    FAIL_IF(failed_check, "a check failed (marked ! in its row)");
    return 0;
}
