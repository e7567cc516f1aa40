/*
 * test_layer1.c - the fused layer1 against the baseline's GEMM1 + all-to-all + combine
 * (and float64): on one rank per GPU, up to two (skipping without a GPU), 1000 calls over
 * combine blocks, splits, schedules and the push, the same bits whatever the knobs; on two
 * GPUs (skipping with fewer), a bad expert id left out and reported while the other rank
 * goes on, and a missing peer that times out (combine, push, and TP push).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/launch.h"
#include "patterns/dispatch_gemm.h"
#include "patterns/gemm_combine.h"
#include "testutil.h"
#include "gpu_util.h"

/* Layer0 then layer1 on the fused args, with the outputs and every receiving buffer
 * poisoned first (and every rank's poison in place before any rank runs). */
static int run_fused(fixture_t *fx, cometi_dispatch_gemm_t *l0, cometi_gemm_combine_t *l1, const comet_moe_args_t *a,
                     const cometi_dispatch_knobs_t *k0, const cometi_combine_knobs_t *k1)
{
    CUDA_OK(cudaMemset(fx->d_y, 0xff, (size_t)fx->cfg.max_tokens * fx->cfg.hidden * 2));
    CUDA_OK(cudaMemset(l0->act, 0xff, (size_t)l0->max_recv_rows * l0->ffn * 2));
    CUDA_OK(cudaMemset(l1->out, 0xff, (size_t)l0->max_recv_rows * l1->hidden * 2));
    CUDA_OK(cudaMemset(l1->slots.local, 0xff, l1->slots.bytes));
    CUDA_OK(cudaMemset(l1->meta, 0xff, sizeof(cometi_row_meta_t) * (size_t)l0->max_recv_rows));
    COMET_OK(cometi_barrier_sync(fx->comm, "fused buffers poisoned"), fx->comm);
    COMET_OK(cometi_dispatch_gemm_run(fx->comm, l0, a, k0, 0), fx->comm);
    COMET_OK(cometi_gemm_combine_run(fx->comm, l1, l0, a, k1, 0), fx->comm);
    CUDA_OK(cudaDeviceSynchronize());
    if (comet_comm_get_async_error(fx->comm) != COMET_SUCCESS) {
        printf("rank %d: %s\n", fx->ctx->rank, comet_comm_last_error(fx->comm));
        return 1;
    }
    return 0;
}

/* The layer1 runs: four column tiles (splits 1, 2, 4) and top-4 (up to four choices summed
 * on one rank), 1000 calls; then partial last tiles (one split) at both widths the tile
 * rule picks: hidden 320, 2.5 tiles of 128, and 1344, 5.25 tiles of 256, 200 calls each.
 * Chosen before the ranks fork. */
static const struct {
    fixture_shape_t shape;
    int calls, split_kinds;
} layer1_setups[3] = {{{256, 1024, 4, 0, 1}, 1000, 3}, {{256, 320, 4, 0, 1}, 200, 1}, {{256, 1344, 4, 0, 1}, 200, 1}};
static int layer1_setup;

static int layer1_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    uint64_t rng = seed * 5 + 3;
    fixture_t fx;
    const int total = layer1_setups[layer1_setup].calls, split_kinds = layer1_setups[layer1_setup].split_kinds;
    if (fixture_open(&fx, ctx, seed, &layer1_setups[layer1_setup].shape)) return 1;
    cometi_dispatch_gemm_t l0;
    cometi_gemm_combine_t l1;
    COMET_OK(cometi_dispatch_gemm_create(fx.comm, &fx.cfg, &l0), fx.comm);
    COMET_OK(cometi_gemm_combine_create(fx.comm, &fx.cfg, &l0, &l1), fx.comm);
    const int H = fx.cfg.hidden, me = ctx->rank, M = fx.cfg.max_tokens;
    const int ncases = (int)(sizeof(cases) / sizeof(cases[0]));
    uint16_t *want = malloc((size_t)M * H * 2), *got = malloc((size_t)M * H * 2), *again = malloc((size_t)M * H * 2);
    /* y sums k bf16 products in fp32 on both paths, but ours rounds once more (each rank's
     * partial sum travels in bf16): each call within 1e-2, no row past 3e-2. */
    double worst = 0, worst_row = 0, worst_ref = 0;
    int calls = 0, repeats = 0;
    for (int rep = 0; calls < total; rep++) {
        for (int ci = 0; ci < ncases && calls < total; ci++, calls++) {
            moe_case_t c = cases[ci];
            if (rep > 0) {
                c.tokens[0] = (int)(cometi_rand_next(&rng) % 513);
                c.tokens[1] = (int)(cometi_rand_next(&rng) % 513);
            }
            fx.skip_reference = rep > 0; /* the float64 reference on the first pass over the cases */
            comet_status_t st;
            double base_err;
            if (run_case(&fx, &c, seed + 100 * rep + ci, 0, &st, &base_err)) return 1;
            if (st != COMET_SUCCESS) printf("baseline: %s\n", comet_moe_last_error(fx.moe));
            CHECK_EQ(st, COMET_SUCCESS);
            const int m = c.tokens[me % 2];
            CUDA_OK(cudaMemcpy(want, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
            const comet_moe_args_t a = fused_args(&fx, &c);
            /* 0-15 combine blocks (0: the tail kernel combines every split), 1, 2 or 4 splits,
             * both tile schedules, the last split on the combine blocks or in the tail; every
             * fifth call the push (rows sent home from GEMM1's epilogue). */
            const cometi_dispatch_knobs_t k0 = {1 + calls % 8, COMETI_DISPATCH_BULK, 0};
            const int push = calls % 5 == 2;
            const cometi_combine_knobs_t k1 = push ? (cometi_combine_knobs_t){0, 1, calls / 48 % 2, 0, 1}
                                                  : (cometi_combine_knobs_t){calls % 16, 1 << (calls / 16 % split_kinds),
                                                                            calls / 48 % 2, calls / 96 % 2, 0};
            if (run_fused(&fx, &l0, &l1, &a, &k0, &k1)) {
                printf("call %d (%s), %d combine blocks, %d splits, push %d\n", calls, c.name, k1.combine_blocks,
                       k1.n_splits, k1.push);
                return 1;
            }
            CUDA_OK(cudaMemcpy(got, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
            double num = 0, den = 0;
            add_error(got, want, NULL, (size_t)m, H, &num, &den, &worst_row);
            const double call_err = den > 0 ? sqrt(num / den) : sqrt(num);
            if (!(call_err <= worst)) worst = call_err;
            if (rep == 0 && m > 0) {
                double rnum = 0, rden = 0, row_ref = 0;
                add_error(got, NULL, fx.ref, (size_t)m, H, &rnum, &rden, &row_ref);
                const double ref_err = sqrt(rnum / rden);
                printf("rank %d %-34s against float64: fused %.2e, baseline %.2e (worst row %.2e)\n", me, c.name,
                       ref_err, base_err, row_ref);
                if (!(ref_err <= worst_ref)) worst_ref = ref_err;
                if (!(ref_err < 1e-2) || !(row_ref < 3e-2)) return 1;
            }
            if (!(worst < 1e-2) || !(worst_row < 3e-2)) {
                printf("call %d (%s, %d combine blocks, %d splits, push %d): y relative error %.3g (worst row "
                       "%.3g)\n", calls, c.name, k1.combine_blocks, k1.n_splits, k1.push, call_err, worst_row);
                return 1;
            }
            /* The same inputs give the same bits, whatever the knobs (the push: whatever the
             * tile schedule; its sum runs by choice, the combine's by rank). */
            if (calls % 10 == 0 || calls % 10 == 7) {
                const cometi_combine_knobs_t k2 = push ? (cometi_combine_knobs_t){0, 1, !k1.dynamic_tiles, 0, 1}
                                                      : (cometi_combine_knobs_t){(calls + 7) % 16,
                                                                                1 << ((calls / 16 + 1) % split_kinds),
                                                                                !k1.dynamic_tiles, !k1.tail, 0};
                if (run_fused(&fx, &l0, &l1, &a, &k0, &k2)) return 1;
                CUDA_OK(cudaMemcpy(again, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
                if (memcmp(got, again, (size_t)m * H * 2)) {
                    printf("call %d (%s): y differs between %d and %d splits (%d, %d combine blocks)\n", calls, c.name,
                           k1.n_splits, k2.n_splits, k1.combine_blocks, k2.combine_blocks);
                    return 1;
                }
                repeats++;
            }
        }
    }
    printf("rank %d, hidden %d: %d calls (%d with the push): y against the baseline's: worst call %.2e, worst row "
           "%.2e; against float64 %.2e; %d repeats bit-identical\n", me, H, calls, calls / 5, worst, worst_row,
           worst_ref, repeats);
    free(want), free(got), free(again);
    cometi_gemm_combine_destroy(fx.comm, &l1);
    cometi_dispatch_gemm_destroy(fx.comm, &l0);
    fixture_close(&fx);
    return 0;
}

int test_gpu_layer1_matches_baseline(void)
{
    layer1_setup = 0;
    return launch_seeded(layer1_rank, 280);
}

int test_gpu_layer1_partial_column_tile(void)
{
    for (layer1_setup = 1; layer1_setup < 3; layer1_setup++) {
        const int rc = launch_seeded(layer1_rank, 100);
        if (rc) return rc;
    }
    return 0;
}

/* A bad expert id on the fused path, with the combine and with the push: the row is left
 * out, the rank that passed it learns so (COMET_INVALID_ARGUMENT), no rank waits for the
 * missing row, and the next call, with the id fixed, matches the baseline. Two ranks: rank
 * 1 passes the id and rank 0 must go on unharmed (and TP 2 needs an even world). */
/* TP ranks per group of the layer1 error tests (set before the ranks fork): 1, or every
 * rank in one group (then only the push, the ending that sums partial rows). */
static int layer1_test_tp = 1;

static int layer1_bad_id_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 1024, 4, 2000, layer1_test_tp};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    fx.skip_reference = 1;
    cometi_dispatch_gemm_t l0;
    cometi_gemm_combine_t l1;
    COMET_OK(cometi_dispatch_gemm_create(fx.comm, &fx.cfg, &l0), fx.comm);
    COMET_OK(cometi_gemm_combine_create(fx.comm, &fx.cfg, &l0, &l1), fx.comm);
    const int H = fx.cfg.hidden, k = fx.cfg.top_k, me = ctx->rank;
    const moe_case_t *c = &cases[0];
    const int m = c->tokens[me % 2];
    uint16_t *want = malloc((size_t)m * H * 2 + 2), *got = malloc((size_t)m * H * 2 + 2);
    for (int push = layer1_test_tp > 1; push < 2; push++) {
        comet_status_t st;
        double err;
        if (run_case(&fx, c, seed + push, 0, &st, &err)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaMemcpy(want, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        const comet_moe_args_t a = fused_args(&fx, c);
        const cometi_dispatch_knobs_t k0 = {4, COMETI_DISPATCH_BULK, 0};
        const cometi_combine_knobs_t k1 = push ? (cometi_combine_knobs_t){0, 1, 1, 0, 1}
                                              : (cometi_combine_knobs_t){0, 1, 1, 1, 0};
        int32_t good = 0;
        const int32_t bad = fx.cfg.num_experts;
        CHECK(m > 5);
        if (me == 1) {
            CUDA_OK(cudaMemcpy(&good, fx.d_ids + 5 * k + 1, sizeof(int32_t), cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(fx.d_ids + 5 * k + 1, &bad, sizeof(int32_t), cudaMemcpyHostToDevice));
        }
        COMET_OK(cometi_barrier_sync(fx.comm, "bad id planted"), fx.comm);
        COMET_OK(cometi_dispatch_gemm_run(fx.comm, &l0, &a, &k0, 0), fx.comm);
        COMET_OK(cometi_gemm_combine_run(fx.comm, &l1, &l0, &a, &k1, 0), fx.comm);
        CUDA_OK(cudaDeviceSynchronize());
        st = comet_comm_get_async_error(fx.comm);
        printf("rank %d, %s: %s\n", me, push ? "push" : "combine",
               st == COMET_SUCCESS ? "no error" : comet_comm_last_error(fx.comm));
        CHECK_EQ(st, me == 1 ? COMET_INVALID_ARGUMENT : COMET_SUCCESS);
        if (me == 1) CHECK_CONTAINS(comet_comm_last_error(fx.comm), "that row was left out");
        if (me == 1) CUDA_OK(cudaMemcpy(fx.d_ids + 5 * k + 1, &good, sizeof(int32_t), cudaMemcpyHostToDevice));
        if (run_fused(&fx, &l0, &l1, &a, &k0, &k1)) return 1;
        CUDA_OK(cudaMemcpy(got, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0, row = 0;
        add_error(got, want, NULL, (size_t)m, H, &num, &den, &row);
        printf("rank %d, %s: the next call against the baseline %.2e (worst row %.2e)\n", me,
               push ? "push" : "combine", sqrt(num / den), row);
        CHECK(sqrt(num / den) < 1e-2 && row < 3e-2);
    }
    free(want), free(got);
    cometi_gemm_combine_destroy(fx.comm, &l1);
    cometi_dispatch_gemm_destroy(fx.comm, &l0);
    fixture_close(&fx);
    return 0;
}

int test_gpu_layer1_bad_expert_id(void)
{
    layer1_test_tp = 1;
    return launch_two_seeded(layer1_bad_id_rank, 100);
}

int test_gpu_layer1_tp_bad_expert_id(void)
{
    layer1_test_tp = 2;
    return launch_two_seeded(layer1_bad_id_rank, 100);
}

/* Rank 1 runs layer0 but never layer1: rank 0's combine (or the push's sum) must give up
 * with COMET_TIMEOUT (rank 1 waits on a flag nobody raises meanwhile, and times out too).
 * Two ranks: the missing peer is the test. */
static int missing_peer_push; /* set before the ranks fork */

static int layer1_missing_peer_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 512, 0, 2000, layer1_test_tp};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    cometi_dispatch_gemm_t l0;
    cometi_gemm_combine_t l1;
    COMET_OK(cometi_dispatch_gemm_create(fx.comm, &fx.cfg, &l0), fx.comm);
    COMET_OK(cometi_gemm_combine_create(fx.comm, &fx.cfg, &l0, &l1), fx.comm);
    fx.skip_reference = 1;
    comet_status_t st;
    double err;
    if (run_case(&fx, &cases[0], seed, 0, &st, &err)) return 1;
    CHECK_EQ(st, COMET_SUCCESS);
    const comet_moe_args_t a = fused_args(&fx, &cases[0]);
    const cometi_dispatch_knobs_t k0 = {4, COMETI_DISPATCH_BULK, 0};
    const cometi_combine_knobs_t k1 = missing_peer_push ? (cometi_combine_knobs_t){0, 1, 1, 0, 1}
                                                       : (cometi_combine_knobs_t){4, 2, 1, 0, 0};
    COMET_OK(cometi_dispatch_gemm_run(fx.comm, &l0, &a, &k0, 0), fx.comm);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    const double t0 = now_s();
    if (ctx->rank == 0) COMET_OK(cometi_gemm_combine_run(fx.comm, &l1, &l0, &a, &k1, 0), fx.comm);
    else COMET_OK(cometi_wait_flag(fx.comm, 3, 1, 0), fx.comm);
    CUDA_OK(cudaDeviceSynchronize());
    const double took = now_s() - t0;
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_TIMEOUT);
    printf("rank %d: %.3f s: %s\n", ctx->rank, took, comet_comm_last_error(fx.comm));
    if (ctx->rank == 0)
        CHECK_CONTAINS(comet_comm_last_error(fx.comm), missing_peer_push ? "the push's sum waiting" : "the combine waiting");
    CHECK(took < 5.0);
    /* The communicator is unusable now; destroying it aborts NCCL. */
    comet_comm_destroy(fx.comm);
    fx.comm = NULL;
    return 0;
}

int test_gpu_layer1_missing_peer_times_out(void)
{
    missing_peer_push = 0, layer1_test_tp = 1;
    return launch_two_seeded(layer1_missing_peer_rank, 100);
}

int test_gpu_layer1_push_missing_peer_times_out(void)
{
    missing_peer_push = 1, layer1_test_tp = 1;
    return launch_two_seeded(layer1_missing_peer_rank, 100);
}

int test_gpu_layer1_tp_push_missing_peer_times_out(void)
{
    missing_peer_push = 1, layer1_test_tp = 2;
    return launch_two_seeded(layer1_missing_peer_rank, 100);
}
