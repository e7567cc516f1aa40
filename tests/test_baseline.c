/*
 * test_baseline.c - the sequential baseline MoE layer on one rank per GPU, up to two
 * (skipping without a GPU), against the float64 CPU reference: every case, repeated calls
 * with changing routing and token counts, the same bits for the same inputs; and, on two
 * GPUs (skipping with fewer), a bad expert id that every rank learns of without leaving
 * anything half done.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/launch.h"
#include "testutil.h"
#include "gpu_util.h"

static int baseline_reference_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    if (fixture_open(&fx, ctx, seed, NULL)) return 1;
    int rc = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        comet_status_t st;
        double err;
        if (run_case(&fx, &cases[i], seed + i, 0, &st, &err)) return 1;
        if (st != COMET_SUCCESS) {
            printf("rank %d %s: %s: %s\n", ctx->rank, cases[i].name, comet_status_string(st),
                   comet_moe_last_error(fx.moe));
            return 1;
        }
        printf("rank %d %-34s relative error %.2e\n", ctx->rank, cases[i].name, err);
        if (!(err < 1e-2)) rc = 1;
    }
    /* The same inputs give the same bits. */
    uint16_t *a = malloc(512 * 256 * 2), *b = malloc(512 * 256 * 2);
    comet_status_t st;
    double err;
    if (run_case(&fx, &cases[0], seed, 0, &st, &err)) return 1;
    CUDA_OK(cudaMemcpy(a, fx.d_y, 256 * 256 * 2, cudaMemcpyDeviceToHost));
    if (run_case(&fx, &cases[0], seed, 0, &st, &err)) return 1;
    CUDA_OK(cudaMemcpy(b, fx.d_y, 256 * 256 * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(a, b, 256 * 256 * 2) == 0);
    free(a), free(b);
    fixture_close(&fx);
    return rc;
}

int test_gpu_baseline_vs_reference(void) { return launch_seeded(baseline_reference_rank, 280); }

static int baseline_repeat_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t seed = *(uint64_t *)arg, rng = seed;
    fixture_t fx;
    if (fixture_open(&fx, ctx, seed, NULL)) return 1;
    double worst = 0;
    for (int it = 0; it < 40; it++) {
        moe_case_t c = cases[it % 3];
        /* Token counts change every call (both ranks draw the same numbers). */
        c.tokens[0] = (int)(cometi_rand_next(&rng) % 513);
        c.tokens[1] = (int)(cometi_rand_next(&rng) % 513);
        comet_status_t st;
        double err;
        if (run_case(&fx, &c, seed + 1000 + it, 0, &st, &err)) return 1;
        if (st != COMET_SUCCESS) {
            printf("call %d: %s\n", it, comet_moe_last_error(fx.moe));
            return 1;
        }
        if (err > worst) worst = err;
        if (!(err < 1e-2)) {
            printf("call %d (%s, tokens %d/%d): relative error %.3g\n", it, c.name, c.tokens[0], c.tokens[1], err);
            return 1;
        }
    }
    printf("rank %d: 40 calls with changing routing and token counts, worst relative error %.2e\n", ctx->rank,
           worst);
    fixture_close(&fx);
    return 0;
}

int test_gpu_baseline_repeated_calls(void) { return launch_seeded(baseline_repeat_rank, 280); }

/* Two ranks: rank 1 passes the bad id, and rank 0 must learn of it (COMET_REMOTE_ERROR). */
static int bad_id_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    if (fixture_open(&fx, ctx, seed, NULL)) return 1;
    comet_status_t st;
    double err;
    if (run_case(&fx, &cases[1], seed, ctx->rank == 1, &st, &err)) return 1;
    printf("rank %d: %s: %s\n", ctx->rank, comet_status_string(st), comet_moe_last_error(fx.moe));
    if (ctx->rank == 1) {
        CHECK_EQ(st, COMET_INVALID_ARGUMENT);
        CHECK_CONTAINS(comet_moe_last_error(fx.moe), "topk_ids[5][1] = 8 on rank 1");
    } else {
        CHECK_EQ(st, COMET_REMOTE_ERROR);
        CHECK_CONTAINS(comet_moe_last_error(fx.moe), "rank 1 passed an expert id out of [0, 8)");
    }
    /* Nothing was left half done: the next call works. */
    if (run_case(&fx, &cases[1], seed + 1, 0, &st, &err)) return 1;
    CHECK_EQ(st, COMET_SUCCESS);
    CHECK(err < 1e-2);
    fixture_close(&fx);
    return 0;
}

int test_gpu_baseline_bad_expert_id(void) { return launch_two_seeded(bad_id_rank, 100); }
