/*
 * test_symmetric.c - the communicator's symmetric memory on GPUs (skipping, saying why,
 * when there are too few): device waits that time out instead of hanging, memory written
 * by pushes and read by pulls with payloads tagged by rank and row, the barrier and flags.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/launch.h"
#include "testutil.h"
#include "gpu_util.h"

/* ---- device waits that time out ---- */

static int flag_timeout_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 300, &comm)) return 1;
    /* A raised flag is seen at once. */
    COMET_OK(cometi_set_flag(comm, 0, 3, 7, 0), comm);
    COMET_OK(cometi_wait_flag(comm, 3, 7, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
    /* Nobody raises slot 5: the wait gives up after timeout_ms and says so. */
    double t0 = now_s();
    COMET_OK(cometi_wait_flag(comm, 5, 1, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    double took = now_s() - t0;
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_TIMEOUT);
    printf("timed out after %.3f s: %s\n", took, comet_comm_last_error(comm));
    CHECK_CONTAINS(comet_comm_last_error(comm), "a flag wait (slot 5)");
    CHECK_CONTAINS(comet_comm_last_error(comm), "timeout_ms = 300");
    CHECK(took >= 0.29 && took < 2.0);
    comet_comm_destroy(comm);
    return 0;
}

int test_gpu_flag_wait_times_out(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    return launch(1, flag_timeout_rank, NULL, 50);
}

static int missing_peer_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 500, &comm)) return 1;
    double t0 = now_s();
    /* Rank 1 never enters the barrier; it waits on a flag nobody raises instead. */
    if (ctx->rank == 0) COMET_OK(cometi_barrier(comm, 0), comm);
    else COMET_OK(cometi_wait_flag(comm, 2, 1, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    double took = now_s() - t0;
    printf("rank %d: %.3f s: %s\n", ctx->rank, took, comet_comm_last_error(comm));
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_TIMEOUT);
    if (ctx->rank == 0) {
        CHECK_CONTAINS(comet_comm_last_error(comm), "the cross-rank barrier");
        CHECK_CONTAINS(comet_comm_last_error(comm), "on rank 1");
    }
    CHECK(took < 3.0);
    comet_comm_destroy(comm); /* aborts NCCL instead of a collective that could hang */
    return 0;
}

int test_gpu_barrier_missing_peer_times_out(void)
{
    if (!have_gpus(2)) return TEST_SKIP;
    return launch(2, missing_peer_rank, NULL, 100);
}

/* ---- symmetric memory ---- */

#define ROWS 4096
#define WORDS 64 /* 256-byte rows */

/* What rank `src` sends to rank `dst` in word w of row r: unique per (src, dst, r, w). */
static uint32_t tag(int src, int dst, int r, int w)
{
    return ((uint32_t)src << 28) | ((uint32_t)dst << 24) | ((uint32_t)r << 8) | (uint32_t)w;
}

static int check_region(const uint32_t *got, int src, int dst, const char *how)
{
    for (int r = 0; r < ROWS; r++)
        for (int w = 0; w < WORDS; w++) {
            uint32_t want = tag(src, dst, r, w), have = got[(size_t)r * WORDS + w];
            if (have != want) {
                printf("%s: rank %d row %d word %d from rank %d: got 0x%08x, want 0x%08x\n", how, dst, r, w, src,
                       have, want);
                return 1;
            }
        }
    return 0;
}

static int push_pull_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 10000, &comm)) return 1;
    const int W = ctx->nranks, me = ctx->rank;
    const size_t region = (size_t)ROWS * WORDS * sizeof(uint32_t);
    cometi_window_t win;
    COMET_OK(cometi_window_create(comm, 2 * W * region, &win), comm);
    /* Window: outbox[W] (what I send to each rank), then inbox[W] (what each rank pushed to me). */
    uint32_t *host = malloc(W * region);
    for (int d = 0; d < W; d++)
        for (int r = 0; r < ROWS; r++)
            for (int w = 0; w < WORDS; w++) host[((size_t)d * ROWS + r) * WORDS + w] = tag(me, d, r, w);
    CUDA_OK(cudaMemcpy(win.local, host, W * region, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset((char *)win.local + W * region, 0xff, W * region)); /* poison the inbox */
    CUDA_OK(cudaDeviceSynchronize());
    COMET_OK(cometi_barrier(comm, 0), comm); /* every inbox poisoned before anyone pushes */
    const int blocks[] = {1, 3, 8, 33};
    for (int d = 0; d < W; d++) {
        char *src = (char *)win.local + d * region;
        char *dst = (char *)win.peer[d] + (size_t)(W + me) * region;
        COMET_OK(cometi_copy(comm->err, dst, src, region, blocks[(me + d) % 4], 0), comm);
    }
    COMET_OK(cometi_barrier(comm, 0), comm);
    CUDA_OK(cudaMemcpy(host, (char *)win.local + W * region, W * region, cudaMemcpyDeviceToHost));
    for (int s = 0; s < W; s++)
        if (check_region(host + (size_t)s * ROWS * WORDS, s, me, "push")) return 1;
    /* Pull: read what each rank holds for me in its outbox. */
    void *pulled;
    CUDA_OK(cudaMalloc(&pulled, W * region));
    CUDA_OK(cudaMemset(pulled, 0xff, W * region));
    for (int s = 0; s < W; s++)
        COMET_OK(cometi_copy(comm->err, (char *)pulled + s * region, (char *)win.peer[s] + me * region, region,
                             blocks[(me + s + 1) % 4], 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(host, pulled, W * region, cudaMemcpyDeviceToHost));
    for (int s = 0; s < W; s++)
        if (check_region(host + (size_t)s * ROWS * WORDS, s, me, "pull")) return 1;
    COMET_OK(cometi_barrier(comm, 0), comm); /* nobody frees a window a peer still reads */
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
    cudaFree(pulled);
    free(host);
    cometi_window_destroy(comm, &win);
    COMET_OK(comet_comm_destroy(comm), comm);
    printf("rank %d: %d x %d rows of %d bytes pushed and pulled exactly\n", me, W, ROWS, WORDS * 4);
    return 0;
}

int test_gpu_symmetric_push_pull_exact(void)
{
    if (!have_gpus(2)) return TEST_SKIP;
    return launch(2, push_pull_rank, NULL, 100);
}

static int barrier_flags_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 10000, &comm)) return 1;
    const int me = ctx->rank, peer = (me + 1) % ctx->nranks;
    for (unsigned long long i = 1; i <= 200; i++) {
        COMET_OK(cometi_barrier(comm, 0), comm);
        COMET_OK(cometi_set_flag(comm, peer, 1, i, 0), comm);
        COMET_OK(cometi_wait_flag(comm, 1, i, 0), comm);
    }
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
    unsigned long long flag = 0;
    CUDA_OK(cudaMemcpy(&flag, (unsigned long long *)comm->ctrl.local + COMETI_CTRL_FLAGS + 1, sizeof(flag),
                       cudaMemcpyDeviceToHost));
    CHECK(flag >= 200);
    COMET_OK(comet_comm_destroy(comm), comm);
    return 0;
}

int test_gpu_barrier_and_flags(void)
{
    if (!have_gpus(2)) return TEST_SKIP;
    return launch(2, barrier_flags_rank, NULL, 100);
}
