/*
 * cmd_bandwidth.c - the body of `comet bandwidth`, run on every rank: every rank copies
 * to the next rank's symmetric window at once (push: remote stores) or from it (pull:
 * remote loads), for several block counts, beside the same copy in local memory and the
 * copy engine's push.
 */
#define _GNU_SOURCE
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "bench.h"
#include "alloc.h"
#include "tool.h"

/* GB/s of the median of `reps` copies of `bytes`, each after a device barrier: by `blocks`
 * SMs (cometi_copy), or with blocks 0 by the copy engine (cudaMemcpyAsync, no SM). */
int timed_copy(comet_comm_t comm, void *dst, const void *src, size_t bytes, int blocks, int reps,
               cudaEvent_t e0, cudaEvent_t e1, float *gbs)
{
    float t[16];
    FAIL_IF(reps < 1 || reps > 16, "timed_copy: %d repetitions (1..16)", reps);
    for (int r = 0; r < reps; r++) {
        comet_status_t st = cometi_barrier(comm, 0);
        FAIL_IF(st != COMET_SUCCESS, "barrier: %s", comet_comm_last_error(comm));
        CUDA_OK(cudaEventRecord(e0, 0));
        if (blocks) {
            st = cometi_copy(comm->err, dst, src, bytes, blocks, 0);
            FAIL_IF(st != COMET_SUCCESS, "copy: %s", comm->err);
        } else {
            CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0));
        }
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        CUDA_OK(cudaEventElapsedTime(&t[r], e0, e1));
    }
    *gbs = (float)(bytes / (median(t, reps) * 1e-3) / 1e9);
    return 0;
}

int bandwidth_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const tool_options_t *o = arg;
    comet_comm_t comm;
    int code = rank_device(ctx);
    if (code || (code = rank_comm(ctx, o->timeout_ms, &comm))) return code;
    const size_t bytes = (size_t)o->mib << 20;
    const int peer = (ctx->rank + 1) % ctx->nranks, reps = 10;
    cometi_window_t win;
    comet_status_t st = cometi_window_create(comm, 2 * bytes, &win); /* [0, bytes): source, [bytes, 2 bytes): target */
    FAIL_IF(st != COMET_SUCCESS, "window: %s", comet_comm_last_error(comm));
    CUDA_OK(cometi_fill_hash_bf16(win.local, bytes / 2, 7, 0, 1.0f, 0));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    if (ctx->rank == 0)
        printf("%d x %s: each rank copies %d MiB to (push: remote stores) or from (pull: remote loads) rank+1, all "
               "at once (local: the same copy inside the rank's own memory); GB/s per rank, median of %d, slowest "
               "rank\n%8s %10s %10s %11s\n",
               ctx->nranks, "GPU", o->mib, reps, "blocks", "push GB/s", "pull GB/s", "local GB/s");
    const int block_counts[] = {1, 2, 4, 8, 16, 32, 66, 132};
    for (size_t bi = 0; bi < sizeof(block_counts) / sizeof(block_counts[0]); bi++) {
        float gbs[3];
        for (int dir = 0; dir < 3; dir++) { /* push, pull, local */
            void *dst = dir == 0 ? (char *)win.peer[peer] + bytes : (char *)win.local + bytes;
            const void *src = dir == 1 ? win.peer[peer] : win.local;
            if (timed_copy(comm, dst, src, bytes, block_counts[bi], reps, e0, e1, &gbs[dir])) return 1;
        }
        /* The slowest rank: min over ranks of GB/s. */
        float neg[3] = {-gbs[0], -gbs[1], -gbs[2]};
        if (allreduce(comm, neg, 3, ncclMax)) return 1;
        if (ctx->rank == 0) printf("%8d %10.1f %10.1f %11.1f\n", block_counts[bi], -neg[0], -neg[1], -neg[2]);
    }
    /* The push again through the copy engine (into the peer's window): no SM. */
    float ce;
    if (timed_copy(comm, (char *)win.peer[peer] + bytes, win.local, bytes, 0, reps, e0, e1, &ce)) return 1;
    float neg_ce = -ce;
    if (allreduce(comm, &neg_ce, 1, ncclMax)) return 1;
    if (ctx->rank == 0) printf("%8s %10.1f (the copy engine: cudaMemcpyAsync into the peer's window)\n", "-", -neg_ce);
    st = cometi_barrier(comm, 0);
    CUDA_OK(cudaDeviceSynchronize());
    st = comet_comm_get_async_error(comm);
    FAIL_IF(st != COMET_SUCCESS, "%s", comet_comm_last_error(comm));
    cometi_window_destroy(comm, &win);
    comet_comm_destroy(comm);
    return 0;
}
