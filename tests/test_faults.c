/*
 * test_faults.c - the fault group: what a bad call does to comet_moe_forward, on both
 * paths, at any world size (one rank per GPU, up to two):
 *   non-finite x      NaN in one token's row, Inf in another's: the call succeeds, no
 *                     hang, those tokens' rows of y are non-finite and every other row has
 *                     the bits of a clean call; the next clean call is clean again;
 *   0 tokens          every rank with none: success, y untouched, the next call right;
 *   max_tokens        num_tokens past config.max_tokens: COMET_INVALID_ARGUMENT naming
 *                     args.num_tokens, nothing launched;
 *   misaligned        x, y or topk_ids off their alignment: COMET_INVALID_ARGUMENT naming
 *                     the field, nothing launched;
 *   expert failure    the sequential path's expert phase failing on one rank after the
 *                     dispatch: no hang, the failure reported there, NaN rows elsewhere.
 * A peer gone mid-call is gpu_layer1_*missing_peer*, gpu_backward_missing_peer_times_out
 * and gpu_moe_destroy_missing_peer (two GPUs).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "baseline/baseline.h"
#include "testutil.h"
#include "gpu_util.h"

#define BF16_NAN 0x7fc0
#define BF16_INF 0x7f80
#define POISON 0xffff /* what cudaMemset(0xff) leaves: a bf16 NaN no kernel writes */

static int bf16_finite(uint16_t v) { return (v & 0x7f80) != 0x7f80; }

/* y poisoned, one call, the device drained: its status, the async error checked, y
 * copied to `out` (m rows of H). */
static int call(fixture_t *fx, const comet_moe_args_t *a, int m, uint16_t *out, comet_status_t *st)
{
    const int H = fx->cfg.hidden, M = fx->cfg.max_tokens;
    CUDA_OK(cudaMemset(fx->d_y, 0xff, (size_t)M * H * 2));
    *st = comet_moe_forward(fx->moe, a, 0);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx->comm), COMET_SUCCESS);
    CUDA_OK(cudaMemcpy(out, fx->d_y, (size_t)(m > 0 ? m : 1) * H * 2, cudaMemcpyDeviceToHost));
    return 0;
}

/* A refused call: `st` COMET_INVALID_ARGUMENT, the message naming `field`, y untouched. */
static int refused(fixture_t *fx, const comet_moe_args_t *a, uint16_t *y, const char *field)
{
    const int H = fx->cfg.hidden, M = fx->cfg.max_tokens;
    comet_status_t st;
    if (call(fx, a, M, y, &st)) return 1;
    if (st != COMET_INVALID_ARGUMENT) printf("expected a refusal naming %s: %s\n", field, comet_status_string(st));
    CHECK_EQ(st, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx->moe), field);
    for (size_t i = 0; i < (size_t)M * H; i++) CHECK_EQ(y[i], POISON);
    return 0;
}

/* The sequential path's expert phase failing on rank 0 after the dispatch (injected, as a
 * cuBLAS call with no algorithm for its shape would fail): every rank still takes part in
 * the return, so none hangs; rank 0 reports the failure by name, and its peers' tokens
 * with a choice there get NaN rows (the poisoned rows it returns), every other row the
 * clean bits; then a clean call again on every rank gives the clean bits. */
static int expert_failure(fixture_t *fx, const comet_moe_args_t *a, int m, const uint16_t *clean, uint16_t *got)
{
    const int H = fx->cfg.hidden, me = fx->ctx->rank;
    comet_status_t st;
    if (me == 0) fx->moe->baseline->fail_experts = 1;
    if (call(fx, a, m, got, &st)) return 1;
    int nan_rows = 0;
    if (me == 0) {
        CHECK_EQ(st, COMET_CUDA_ERROR);
        CHECK_CONTAINS(comet_moe_last_error(fx->moe), "the expert phase failed (injected by a test)");
    } else {
        CHECK_EQ(st, COMET_SUCCESS);
        for (int t = 0; t < m; t++) {
            const uint16_t *row = got + (size_t)t * H;
            if (!memcmp(row, clean + (size_t)t * H, (size_t)H * 2)) continue;
            for (int h = 0; h < H; h++) CHECK(!bf16_finite(row[h]));
            nan_rows++;
        }
    }
    if (call(fx, a, m, got, &st)) return 1;
    CHECK_EQ(st, COMET_SUCCESS);
    CHECK(memcmp(got, clean, (size_t)m * H * 2) == 0);
    printf("rank %d baseline: an expert phase failing on rank 0 after the dispatch: %s, no hang%s; the next call "
           "bit-equal\n", me, me == 0 ? "reported by name" : "this rank's call returned", me == 0 ? "" :
           nan_rows ? " with NaN rows for the tokens routed there" : "");
    return 0;
}

static int faults_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 0, 0, 0, 0};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    const int H = fx.cfg.hidden, M = fx.cfg.max_tokens, me = ctx->rank;
    const moe_case_t c = {"faults", COMETI_ROUTING_RANDOM, 1, {300, 211}, 0, 0};
    comet_status_t st;
    double rel;
    fx.skip_reference = 1;
    if (run_case(&fx, &c, seed, 0, &st, &rel)) return 1; /* inputs in place */
    const int m = c.tokens[me % 2], bad_rows[2] = {3, 7};
    uint16_t *clean = malloc((size_t)M * H * 2), *got = malloc((size_t)M * H * 2), *bad = malloc((size_t)H * 2);
    for (int impl = 0; impl < 2; impl++) {
        comet_moe_args_t a = fused_args(&fx, &c);
        a.impl = impl ? COMET_IMPL_BASELINE : COMET_IMPL_FUSED;
        const char *path = impl ? "baseline" : "fused";
        if (call(&fx, &a, m, clean, &st)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);

        /* ---- NaN in row 3 of x, +Inf in row 7 ---- */
        for (int b = 0; b < 2; b++) {
            for (int h = 0; h < H; h++) bad[h] = (uint16_t)(b ? BF16_INF : BF16_NAN);
            CUDA_OK(cudaMemcpy((uint16_t *)fx.d_x + (size_t)bad_rows[b] * H, bad, (size_t)H * 2,
                               cudaMemcpyHostToDevice));
        }
        if (call(&fx, &a, m, got, &st)) return 1;
        if (st != COMET_SUCCESS) printf("%s with NaN and Inf in x: %s\n", path, comet_moe_last_error(fx.moe));
        CHECK_EQ(st, COMET_SUCCESS);
        int nonfinite[2] = {0, 0};
        for (int t = 0; t < m; t++) {
            const int which = t == bad_rows[0] ? 0 : t == bad_rows[1] ? 1 : -1;
            const uint16_t *row = got + (size_t)t * H;
            if (which >= 0) {
                for (int h = 0; h < H; h++) nonfinite[which] += !bf16_finite(row[h]);
                continue;
            }
            if (memcmp(row, clean + (size_t)t * H, (size_t)H * 2)) {
                printf("%s: token %d's row changed when only tokens 3 and 7 were non-finite\n", path, t);
                return 1;
            }
        }
        printf("rank %d %s: NaN and Inf rows of x: %d and %d of their %d outputs non-finite, the other %d rows "
               "bit-equal to the clean call\n", me, path, nonfinite[0], nonfinite[1], H, m - 2);
        CHECK_EQ(nonfinite[0], H); /* NaN spreads over the whole row */
        CHECK(nonfinite[1] > 0);   /* Inf times weights of both signs sums to NaN */
        /* The clean inputs again (run_case rewrites them from the seed): the clean bits. */
        if (run_case(&fx, &c, seed, 0, &st, &rel)) return 1;
        if (call(&fx, &a, m, got, &st)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);
        CHECK(memcmp(got, clean, (size_t)m * H * 2) == 0);

        /* ---- every rank with 0 tokens ---- */
        comet_moe_args_t zero = a;
        zero.num_tokens = 0;
        if (call(&fx, &zero, M, got, &st)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);
        for (size_t i = 0; i < (size_t)M * H; i++) CHECK_EQ(got[i], POISON);
        if (call(&fx, &a, m, got, &st)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);
        CHECK(memcmp(got, clean, (size_t)m * H * 2) == 0);

        /* ---- refused before anything is launched ---- */
        comet_moe_args_t over = a;
        over.num_tokens = M + 1;
        if (refused(&fx, &over, got, "args.num_tokens = 513")) return 1;
        comet_moe_args_t mis = a;
        mis.x = (char *)fx.d_x + 2;
        if (refused(&fx, &mis, got, "args.x")) return 1;
        mis = a;
        mis.y = (char *)fx.d_y + 8;
        if (refused(&fx, &mis, got, "args.y")) return 1;
        mis = a;
        mis.topk_ids = (int32_t *)((char *)fx.d_ids + 2);
        if (refused(&fx, &mis, got, "topk_ids")) return 1;
        /* After the refusals, a call is right: nothing half-done was left. */
        if (call(&fx, &a, m, got, &st)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);
        CHECK(memcmp(got, clean, (size_t)m * H * 2) == 0);
        printf("rank %d %s: 0 tokens everywhere left y untouched; num_tokens past max_tokens and misaligned x, y "
               "and topk_ids refused with nothing launched; the next calls bit-equal\n", me, path);
        if (impl && expert_failure(&fx, &a, m, clean, got)) return 1;
    }
    free(clean), free(got), free(bad);
    fixture_close(&fx);
    return 0;
}

int test_gpu_faults(void) { return launch_seeded(faults_rank, 120); }
