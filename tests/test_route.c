/*
 * test_route.c - the device route on GPUs (skipping without them) against the C routing
 * plan: many calls with changing routing and token counts over EP and TP layouts, the
 * first wave's rows, the plan built from given counts at world sizes no machine here has,
 * a missing peer that times out, and a bad expert id reported once.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/launch.h"
#include "comm/plan.h"
#include "gemm/gemm.h"
#include "comm/route.h"
#include "testutil.h"
#include "gpu_util.h"

#define ROUTE_E 16
#define ROUTE_MAX_M 10000 /* up to 20000 rows at top-2: several of the route's 2048-row chunks */
#define ROUTE_MAX_GROUP_EXPERTS COMETI_MAX_EXPERTS /* experts of one group */

/* `calls` calls of the device route with E experts, top-k and tp ranks per group against
 * the C plan. */
static int route_check(const cometi_rank_ctx_t *ctx, comet_comm_t comm, uint64_t seed, int tp, int E, int k,
                       int calls, int global_counts)
{
    const int W = ctx->nranks, me = ctx->rank;
    const int groups = W / tp, per = E / groups;
    cometi_route_dev_t r;
    COMET_OK(cometi_route_dev_create(comm, E, tp, ROUTE_MAX_M * k,
                                     cometi_route_max_recv_rows(W, ROUTE_MAX_M, k, per, COMETI_BLOCK_M),
                                     COMETI_BLOCK_M, &r), comm);
    if (global_counts) r.counts_in_smem = 0; /* the path of world x E too large for shared memory */
    int32_t *ids[COMETI_MAX_RANKS], *d_ids;
    float *w = malloc(sizeof(float) * ROUTE_MAX_M * k), *my_w = malloc(sizeof(float) * ROUTE_MAX_M * k), *d_w;
    for (int s = 0; s < W; s++) ids[s] = malloc(sizeof(int32_t) * ROUTE_MAX_M * k);
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(int32_t) * ROUTE_MAX_M * k));
    CUDA_OK(cudaMalloc((void **)&d_w, sizeof(float) * ROUTE_MAX_M * k));
    int64_t *want_send = malloc(sizeof(int64_t) * ROUTE_MAX_M * k);
    cometi_row_meta_t *meta = malloc(sizeof(cometi_row_meta_t) * ROUTE_MAX_M * k);
    int32_t *got = malloc(sizeof(int32_t) * (W * E * 3 + E * 2 + W + ROUTE_MAX_M * k));
    int64_t *counts = malloc(sizeof(int64_t) * W * E), *want_pos = malloc(sizeof(int64_t) * ROUTE_MAX_M * k);
    uint64_t *expected = calloc((size_t)r.max_blocks, sizeof(uint64_t)), *got_expected = malloc(8 * (size_t)r.max_blocks);
    /* The first wave's rows (tp 1): rows of 8 bf16 (one 16-byte vector) tagged with rank,
     * token and call, copied into a receive buffer of the most wave rows (3 blocks). */
    enum { WAVE_MAX = 3, WAVE_ROWS = WAVE_MAX * COMETI_BLOCK_M };
    int32_t(*x_rows)[4] = malloc(sizeof(*x_rows) * ROUTE_MAX_M), (*wave_got)[4] = malloc(sizeof(*wave_got) * WAVE_ROWS);
    void *d_x, *d_wave_recv;
    unsigned long long *d_wave_arrive, wave_arrive[WAVE_MAX + 1];
    cometi_segment_t *d_wave_seg, wave_seg;
    CUDA_OK(cudaMalloc(&d_x, sizeof(*x_rows) * ROUTE_MAX_M));
    CUDA_OK(cudaMalloc(&d_wave_recv, sizeof(*wave_got) * WAVE_ROWS));
    CUDA_OK(cudaMalloc((void **)&d_wave_arrive, sizeof(wave_arrive)));
    CUDA_OK(cudaMalloc((void **)&d_wave_seg, sizeof(wave_seg)));
    int wave_calls = 0;
    for (int call = 0; call < calls; call++) {
        /* Every rank draws every rank's routing, so each can build the whole plan. */
        uint64_t rng = seed + 7919 * (uint64_t)call;
        int m[COMETI_MAX_RANKS];
        memset(counts, 0, sizeof(int64_t) * W * E);
        for (int s = 0; s < W; s++) {
            m[s] = (int)(cometi_rand_next(&rng) % (ROUTE_MAX_M + 1));
            cometi_make_routing((cometi_routing_t)(call % 4), call % 4 == 3 ? call % E : 8.0, m[s], k, E,
                                seed + call, s, ids[s], w);
            cometi_route_count(ids[s], m[s], k, E, counts + (size_t)s * E);
            if (s == me) memcpy(my_w, w, sizeof(float) * m[s] * k);
        }
        CUDA_OK(cudaMemcpy(d_ids, ids[me], sizeof(int32_t) * m[me] * k, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_w, my_w, sizeof(float) * m[me] * k, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(r.plan.recv_pos, 0xff, sizeof(int32_t) * ROUTE_MAX_M * k)); /* poison */
        CUDA_OK(cudaMemset(r.meta.local, 0xff, r.meta.bytes));
        CUDA_OK(cudaMemset(r.plan.fused_segs, 0xff, sizeof(cometi_segment_t) * per));
        CUDA_OK(cudaMemset(r.plan.fused_local_rows, 0xff, sizeof(int32_t) * per));
        /* Every other call without weights: then the records are not written. With tp 1,
         * 0-3 first-wave row blocks (changing apart from the routing kind, call % 4): the
         * fused GEMM's segments leave them out. */
        /* A call id the same on every rank (0, a forward's, every third call) passes. */
        COMET_OK(cometi_route_dev_run(comm, &r, d_ids, call % 2 ? NULL : d_w, m[me], k, tp == 1 ? call / 4 % 4 : 0,
                                      (unsigned int)(call % 3) * 0x9e3779b9u, NULL, 0), comm);
        CUDA_OK(cudaDeviceSynchronize());
        CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
        cometi_route_plan_t p;
        char err[256];
        CHECK_EQ(cometi_route_plan_build(&p, counts, W, tp, E, COMETI_BLOCK_M, err, sizeof(err)), 0);
        cometi_route_positions(&p, me, ids[me], m[me], k, want_send, want_pos);
        /* Layer1's records, in send order: the token's slot if the choice leads on its
         * rank, the receive row of the next choice there, the weight, this rank. */
        CUDA_OK(cudaMemcpy(meta, r.meta.local, sizeof(cometi_row_meta_t) * m[me] * k, cudaMemcpyDeviceToHost));
        for (int i = 0; i < m[me] * k && call % 2 == 0 && tp == 1; i++) { /* the combine's: EP only */
            const int t = i / k, kw = k < W ? k : W;
            int next;
            const int slot = cometi_choice_slot(ids[me] + (size_t)t * k, k, i % k, E, E / W, &next);
            const cometi_row_meta_t *g = &meta[want_send[i]];
            const int want_next = next >= 0 ? (int)want_pos[(size_t)t * k + next] : -1;
            if (g->slot != (slot >= 0 ? t * kw + slot : -1) || g->next != want_next || g->weight != my_w[i] ||
                g->src != me) {
                printf("rank %d call %d: row (%d, %d) record {%d, %d, %g, %d}, want {%d, %d, %g, %d}\n", me, call, t,
                       i % k, g->slot, g->next, g->weight, g->src, slot >= 0 ? t * kw + slot : -1, want_next, my_w[i],
                       me);
                return 1;
            }
        }
        struct { const char *name; int32_t *dev; int64_t *host; int n; } arrays[] = {
            {"counts", r.plan.counts, p.counts, W * E},        {"send_offset", r.plan.send_offset, p.send_offset, W * E},
            {"seg_start", r.plan.seg_start, p.seg_start, E},   {"seg_rows", r.plan.seg_rows, p.seg_rows, E},
            {"recv_offset", r.plan.recv_offset, p.recv_offset, W * E}, {"recv_rows", r.plan.recv_rows, p.recv_rows, groups},
            {"recv_pos", r.plan.recv_pos, want_pos, m[me] * k}};
        for (int a = 0; a < 7; a++) {
            CUDA_OK(cudaMemcpy(got, arrays[a].dev, sizeof(int32_t) * arrays[a].n, cudaMemcpyDeviceToHost));
            for (int i = 0; i < arrays[a].n; i++) {
                if (got[i] != arrays[a].host[i]) {
                    printf("rank %d call %d: %s[%d] = %d on the GPU, %lld in the C plan\n", me, call, arrays[a].name, i,
                           got[i], (long long)arrays[a].host[i]);
                    return 1;
                }
            }
        }
        /* Each row's rank among this rank's rows of its expert (layer1's push reads it) and
         * the send order (the dispatch reads it): the C plan's send position is the two. */
        CUDA_OK(cudaMemcpy(got, r.plan.pos, sizeof(int32_t) * m[me] * k, cudaMemcpyDeviceToHost));
        for (int i = 0; i < m[me] * k; i++) {
            const int64_t want = want_send[i] - p.send_offset[(size_t)me * E + ids[me][i]];
            if (got[i] != want) {
                printf("rank %d call %d: pos[%d] = %d on the GPU, %lld in the C plan\n", me, call, i, got[i],
                       (long long)want);
                return 1;
            }
        }
        CUDA_OK(cudaMemcpy(got, r.plan.src_of, sizeof(int32_t) * m[me] * k, cudaMemcpyDeviceToHost));
        for (int i = 0; i < m[me] * k; i++) {
            if (got[want_send[i]] != i) {
                printf("rank %d call %d: src_of[%lld] = %d on the GPU, want %d\n", me, call, (long long)want_send[i],
                       got[want_send[i]], i);
                return 1;
            }
        }
        /* Arrival totals per 128-row block of this rank's receive buffer, over all calls. */
        for (int le = 0; le < per; le++) {
            const int e = me / tp * per + le;
            for (int64_t row = 0; row < p.seg_rows[e]; row += COMETI_BLOCK_M)
                expected[(p.seg_start[e] + row) / COMETI_BLOCK_M] +=
                    p.seg_rows[e] - row < COMETI_BLOCK_M ? (uint64_t)(p.seg_rows[e] - row) : COMETI_BLOCK_M;
        }
        CUDA_OK(cudaMemcpy(got_expected, r.plan.expected, 8 * (size_t)r.max_blocks, cudaMemcpyDeviceToHost));
        for (int b = 0; b < r.max_blocks; b++)
            if (got_expected[b] != expected[b]) {
                printf("rank %d call %d: expected[%d] = %llu on the GPU, %llu from the C plan\n", me, call, b,
                       (unsigned long long)got_expected[b], (unsigned long long)expected[b]);
                return 1;
            }
        /* The fused GEMM's segments: segment 0 without min(own rows / 128, wave_blocks)
         * whole row blocks of this rank's own rows, which lead it; the others as they are. */
        cometi_segment_t fused[ROUTE_MAX_GROUP_EXPERTS];
        int32_t fused_local[ROUTE_MAX_GROUP_EXPERTS];
        CHECK(per <= ROUTE_MAX_GROUP_EXPERTS);
        CUDA_OK(cudaMemcpy(fused, r.plan.fused_segs, sizeof(cometi_segment_t) * per, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(fused_local, r.plan.fused_local_rows, sizeof(int32_t) * per, cudaMemcpyDeviceToHost));
        for (int le = 0; le < per; le++) {
            const int e = me / tp * per + le;
            const int64_t own = p.recv_offset[(size_t)me * E + e] == 0 ? p.counts[(size_t)me * E + e] : 0;
            const int64_t blocks = own / COMETI_BLOCK_M < r.plan.wave_blocks ? own / COMETI_BLOCK_M : r.plan.wave_blocks;
            const int64_t skip = le == 0 ? blocks * COMETI_BLOCK_M : 0;
            if (fused[le].start != p.seg_start[e] + skip || fused[le].rows != p.seg_rows[e] - skip ||
                fused_local[le] != own - skip) {
                printf("rank %d call %d, %d wave blocks: fused segment %d = {%d, %d}, %d own rows on the GPU; want "
                       "{%lld, %lld}, %lld\n", me, call, r.plan.wave_blocks, le, fused[le].start, fused[le].rows,
                       fused_local[le], (long long)(p.seg_start[e] + skip), (long long)(p.seg_rows[e] - skip),
                       (long long)(own - skip));
                return 1;
            }
        }
        const int wave = r.plan.wave_blocks;
        if (wave) { /* tp 1 */
            CHECK(wave <= WAVE_MAX);
            for (int t = 0; t < m[me]; t++)
                x_rows[t][0] = me + 1, x_rows[t][1] = t, x_rows[t][2] = call, x_rows[t][3] = 0x5eed;
            CUDA_OK(cudaMemcpy(d_x, x_rows, sizeof(*x_rows) * m[me], cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemset(d_wave_recv, 0xff, sizeof(*wave_got) * WAVE_ROWS)); /* poison */
            CUDA_OK(cudaMemset(d_wave_arrive, 0, sizeof(wave_arrive)));
            CUDA_OK(cudaMemset(d_wave_seg, 0xff, sizeof(wave_seg)));
            const int row_bytes = (int)sizeof(*x_rows); /* the rows the dispatch would send */
            CHECK(cometi_first_rows_allowed(&r, wave, m[me], k, d_x, row_bytes));
            COMET_OK(cometi_first_rows(comm, &r, d_ids, m[me], k, d_x, row_bytes, d_wave_recv, d_wave_arrive,
                                       d_wave_seg, 0),
                     comm);
            CUDA_OK(cudaMemcpy(wave_got, d_wave_recv, sizeof(*wave_got) * WAVE_ROWS, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(wave_arrive, d_wave_arrive, sizeof(wave_arrive), cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(&wave_seg, d_wave_seg, sizeof(wave_seg), cudaMemcpyDeviceToHost));
            /* Whole blocks of this rank's own rows of its first expert, which lead its segment
             * (tp 1: the group is this rank), each at its place in the plan; the rest untouched. */
            const int e0 = me * per;
            const int64_t own = p.counts[(size_t)me * E + e0];
            const int limit = (int)((own / COMETI_BLOCK_M < wave ? own / COMETI_BLOCK_M : wave) * COMETI_BLOCK_M);
            if (wave_seg.start != 0 || wave_seg.rows != limit) {
                printf("rank %d call %d, %d wave blocks, %lld own rows: the wave segment {%d, %d}, want {0, %d}\n",
                       me, call, wave, (long long)own, wave_seg.start, wave_seg.rows, limit);
                return 1;
            }
            for (int b = 0; b <= WAVE_MAX; b++)
                if (wave_arrive[b] != (b * COMETI_BLOCK_M < limit ? COMETI_BLOCK_M : 0u)) {
                    printf("rank %d call %d: wave arrival counter %d = %llu with %d wave rows\n", me, call, b,
                           wave_arrive[b], limit);
                    return 1;
                }
            int copied = 0;
            for (int i = 0; i < m[me] * k; i++) {
                if (ids[me][i] != e0 || want_pos[i] >= limit) continue;
                copied++;
                if (memcmp(wave_got[want_pos[i]], x_rows[i / k], sizeof(*x_rows))) {
                    printf("rank %d call %d: wave row %lld = {%d, %d, %d, %x}, want token %d's row\n", me, call,
                           (long long)want_pos[i], wave_got[want_pos[i]][0], wave_got[want_pos[i]][1],
                           wave_got[want_pos[i]][2], wave_got[want_pos[i]][3], i / k);
                    return 1;
                }
            }
            CHECK_EQ(copied, limit);
            for (int row = limit; row < WAVE_ROWS; row++)
                if (wave_got[row][0] != -1 || wave_got[row][3] != -1) {
                    printf("rank %d call %d: wave row %d past the %d wave rows was written\n", me, call, row, limit);
                    return 1;
                }
            wave_calls++;
        }
        cometi_route_plan_free(&p);
    }
    free(x_rows), free(wave_got);
    cudaFree(d_x), cudaFree(d_wave_recv), cudaFree(d_wave_arrive), cudaFree(d_wave_seg);
    free(expected), free(got_expected);
    printf("rank %d, tp %d, %d experts, top-%d, counts in %s memory: %d calls with changing routing and token counts, "
           "device plan equal to the C plan; %d with a first wave, its rows in place\n", me, tp, E, k,
           global_counts ? "global" : "shared", calls, wave_calls);
    for (int s = 0; s < W; s++) free(ids[s]);
    free(w), free(my_w), free(got), free(counts), free(want_pos), free(want_send), free(meta);
    cudaFree(d_ids);
    cudaFree(d_w);
    cometi_route_dev_destroy(comm, &r);
    return 0;
}

static int route_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 10000, &comm)) return 1;
    /* EP only, then every rank in one TP group (EP = 1, TP = world), then the most experts
     * a config may have (most of them with a few rows or none: many distinct ids per warp
     * round in the rank kernel), then the exchange reading the counts from global memory
     * (where world x E is too large for shared memory: more ranks than here).
     * Top-2 and top-8 take the records' warp path (k divides 32), top-3 the per-row one. */
    if (ctx->nranks == 1)
        printf("world 1: the two layouts with every rank in one TP group run as TP 1 (EP only); the route with "
               "TP is checked at world 2\n");
    if (route_check(ctx, comm, seed, 1, ROUTE_E, 2, 300, 0) ||
        route_check(ctx, comm, seed + 1, ctx->nranks, ROUTE_E, 2, 300, 0) ||
        route_check(ctx, comm, seed + 2, 1, COMETI_MAX_EXPERTS, 2, 40, 0) ||
        route_check(ctx, comm, seed + 3, 1, ROUTE_E, 2, 100, 1) ||
        route_check(ctx, comm, seed + 4, ctx->nranks, COMETI_MAX_EXPERTS, 2, 20, 1) ||
        route_check(ctx, comm, seed + 5, 1, ROUTE_E, 8, 60, 0) || route_check(ctx, comm, seed + 6, 1, ROUTE_E, 3, 60, 0))
        return 1;
    COMET_OK(comet_comm_destroy(comm), comm);
    return 0;
}

int test_gpu_route_matches_plan(void) { return launch_seeded(route_rank, 170); }

/* The device plan from given counts (cometi_route_plan_from_counts: the exchange's own
 * build, without the exchange) against the C plan, on one GPU, at world sizes beyond the
 * machine's GPUs: up to COMETI_MAX_RANKS ranks, more sources and groups than the block has
 * warps, several TP splits, up to COMETI_MAX_EXPERTS experts, counts in shared and in global
 * memory. Counts are random, a quarter of them zero. */
static int plan_any_world_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)ctx;
    uint64_t rng = *(uint64_t *)arg;
    static const int layouts[][3] = { /* world, tp, experts */
        {1, 1, 8},   {3, 1, 6},   {3, 3, 7},     {4, 2, 64},  {8, 1, 64},    {8, 4, 16},
        {16, 2, 1024}, {40, 1, 80}, {64, 2, 1024}, {72, 1, 144}, {72, 8, 27}, {72, 72, 1024}};
    const int block_m = COMETI_BLOCK_M;
    int checked = 0;
    for (size_t li = 0; li < sizeof(layouts) / sizeof(layouts[0]); li++) {
        const int W = layouts[li][0], tp = layouts[li][1], E = layouts[li][2], groups = W / tp, per = E / groups;
        int64_t *counts = malloc(sizeof(int64_t) * W * E);
        int32_t *counts32 = malloc(sizeof(int32_t) * W * E), *got = malloc(sizeof(int32_t) * W * E);
        for (int i = 0; i < W * E; i++) {
            const uint64_t r = cometi_rand_next(&rng);
            counts[i] = r % 4 == 0 ? 0 : (int64_t)(r >> 8) % 300;
            counts32[i] = (int32_t)counts[i];
        }
        cometi_route_plan_t p;
        char err[256];
        CHECK_EQ(cometi_route_plan_build(&p, counts, W, tp, E, block_m, err, sizeof(err)), 0);
        int64_t most = 0;
        for (int g = 0; g < groups; g++) most = p.recv_rows[g] > most ? p.recv_rows[g] : most;
        const int max_blocks = (int)(most / block_m) + 1;
        cometi_route_dev_plan_t d;
        memset(&d, 0, sizeof(d));
        int32_t *d_counts;
        CUDA_OK(cudaMalloc((void **)&d_counts, sizeof(int32_t) * W * E));
        CUDA_OK(cudaMemcpy(d_counts, counts32, sizeof(int32_t) * W * E, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMalloc((void **)&d.counts, sizeof(int32_t) * W * E));
        CUDA_OK(cudaMalloc((void **)&d.send_offset, sizeof(int32_t) * W * E));
        CUDA_OK(cudaMalloc((void **)&d.recv_offset, sizeof(int32_t) * W * E));
        CUDA_OK(cudaMalloc((void **)&d.seg_start, sizeof(int32_t) * E));
        CUDA_OK(cudaMalloc((void **)&d.seg_rows, sizeof(int32_t) * E));
        CUDA_OK(cudaMalloc((void **)&d.recv_rows, sizeof(int32_t) * groups));
        CUDA_OK(cudaMalloc((void **)&d.local_segs, sizeof(cometi_segment_t) * per));
        CUDA_OK(cudaMalloc((void **)&d.local_rows, sizeof(int32_t) * per));
        CUDA_OK(cudaMalloc((void **)&d.expected, sizeof(unsigned long long) * max_blocks));
        cometi_segment_t *segs = malloc(sizeof(cometi_segment_t) * per);
        uint64_t *expected = malloc(8 * (size_t)max_blocks), *got_expected = malloc(8 * (size_t)max_blocks);
        const int smem_fits = sizeof(int32_t) * ((size_t)W * E + E) <= 48 * 1024 - 64;
        const int mes[3] = {0, W - 1, (int)(cometi_rand_next(&rng) % (uint64_t)W)};
        for (int in_smem = 0; in_smem <= smem_fits; in_smem++) {
            for (int mi = 0; mi < 3; mi++) {
                const int me = mes[mi];
                /* Poison what the kernel writes; expected[] is added to, so it starts at zero. */
                CUDA_OK(cudaMemset(d.counts, 0xff, sizeof(int32_t) * W * E));
                CUDA_OK(cudaMemset(d.send_offset, 0xff, sizeof(int32_t) * W * E));
                CUDA_OK(cudaMemset(d.recv_offset, 0xff, sizeof(int32_t) * W * E));
                CUDA_OK(cudaMemset(d.seg_start, 0xff, sizeof(int32_t) * E));
                CUDA_OK(cudaMemset(d.seg_rows, 0xff, sizeof(int32_t) * E));
                CUDA_OK(cudaMemset(d.recv_rows, 0xff, sizeof(int32_t) * groups));
                CUDA_OK(cudaMemset(d.local_segs, 0xff, sizeof(cometi_segment_t) * per));
                CUDA_OK(cudaMemset(d.local_rows, 0xff, sizeof(int32_t) * per));
                CUDA_OK(cudaMemset(d.expected, 0, sizeof(unsigned long long) * max_blocks));
                CUDA_OK(cometi_route_plan_from_counts(d_counts, me, W, tp, E, block_m, &d, in_smem, 0));
                CUDA_OK(cudaDeviceSynchronize());
                struct { const char *name; int32_t *dev; int64_t *host; int n; } arrays[] = {
                    {"counts", d.counts, p.counts, W * E},           {"send_offset", d.send_offset, p.send_offset, W * E},
                    {"seg_start", d.seg_start, p.seg_start, E},      {"seg_rows", d.seg_rows, p.seg_rows, E},
                    {"recv_offset", d.recv_offset, p.recv_offset, W * E}, {"recv_rows", d.recv_rows, p.recv_rows, groups}};
                for (int a = 0; a < 6; a++) {
                    CUDA_OK(cudaMemcpy(got, arrays[a].dev, sizeof(int32_t) * arrays[a].n, cudaMemcpyDeviceToHost));
                    for (int i = 0; i < arrays[a].n; i++) {
                        if (got[i] != arrays[a].host[i]) {
                            printf("world %d tp %d E %d, rank %d, counts in %s memory: %s[%d] = %d on the GPU, %lld in "
                                   "the C plan\n", W, tp, E, me, in_smem ? "shared" : "global", arrays[a].name, i,
                                   got[i], (long long)arrays[a].host[i]);
                            return 1;
                        }
                    }
                }
                /* This rank as a receiver: its segments, its own leading rows, and the rows
                 * each 128-row block of its buffer receives. */
                CUDA_OK(cudaMemcpy(segs, d.local_segs, sizeof(cometi_segment_t) * per, cudaMemcpyDeviceToHost));
                CUDA_OK(cudaMemcpy(got, d.local_rows, sizeof(int32_t) * per, cudaMemcpyDeviceToHost));
                memset(expected, 0, 8 * (size_t)max_blocks);
                for (int le = 0; le < per; le++) {
                    const int e = me / tp * per + le;
                    const int64_t own = p.recv_offset[(size_t)me * E + e] == 0 ? p.counts[(size_t)me * E + e] : 0;
                    if (segs[le].start != p.seg_start[e] || segs[le].rows != p.seg_rows[e] || got[le] != own) {
                        printf("world %d tp %d E %d, rank %d: local segment %d = {%d, %d}, own rows %d; the C plan "
                               "{%lld, %lld}, %lld\n", W, tp, E, me, le, segs[le].start, segs[le].rows, got[le],
                               (long long)p.seg_start[e], (long long)p.seg_rows[e], (long long)own);
                        return 1;
                    }
                    for (int64_t row = 0; row < p.seg_rows[e]; row += block_m)
                        expected[(p.seg_start[e] + row) / block_m] +=
                            p.seg_rows[e] - row < block_m ? (uint64_t)(p.seg_rows[e] - row) : (uint64_t)block_m;
                }
                CUDA_OK(cudaMemcpy(got_expected, d.expected, 8 * (size_t)max_blocks, cudaMemcpyDeviceToHost));
                for (int b = 0; b < max_blocks; b++) {
                    if (got_expected[b] != expected[b]) {
                        printf("world %d tp %d E %d, rank %d: expected[%d] = %llu on the GPU, %llu from the C plan\n",
                               W, tp, E, me, b, (unsigned long long)got_expected[b], (unsigned long long)expected[b]);
                        return 1;
                    }
                }
                checked++;
            }
        }
        printf("world %d, tp %d, %d experts: the device plan equals the C plan on ranks %d, %d, %d (counts in %s)\n",
               W, tp, E, mes[0], mes[1], mes[2], smem_fits ? "shared and global memory" : "global memory");
        cometi_route_plan_free(&p);
        free(counts), free(counts32), free(got), free(segs), free(expected), free(got_expected);
        cudaFree(d_counts), cudaFree(d.counts), cudaFree(d.send_offset), cudaFree(d.recv_offset);
        cudaFree(d.seg_start), cudaFree(d.seg_rows), cudaFree(d.recv_rows), cudaFree(d.local_segs);
        cudaFree(d.local_rows), cudaFree(d.expected);
    }
    /* A layout the plan does not allow is refused, not run. */
    cometi_route_dev_plan_t none;
    memset(&none, 0, sizeof(none));
    CHECK_EQ(cometi_route_plan_from_counts(NULL, 0, 4, 3, 8, block_m, &none, 0, 0), cudaErrorInvalidValue);
    CHECK_EQ(cometi_route_plan_from_counts(NULL, 0, 4, 1, 6, block_m, &none, 0, 0), cudaErrorInvalidValue);
    CHECK_EQ(cometi_route_plan_from_counts(NULL, 0, 72, 1, 1024, block_m, &none, 1, 0), cudaErrorInvalidValue);
    printf("%d plans checked\n", checked);
    return 0;
}

int test_gpu_route_plan_any_world(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, plan_any_world_rank, &seed, 110);
}

static int route_missing_peer_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 500, &comm)) return 1;
    cometi_route_dev_t r;
    COMET_OK(cometi_route_dev_create(comm, ROUTE_E, 1, 64, 64 * 2 + 16 * 127, COMETI_BLOCK_M, &r), comm);
    int32_t *d_ids;
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(int32_t) * 64));
    CUDA_OK(cudaMemset(d_ids, 0, sizeof(int32_t) * 64));
    double t0 = now_s();
    /* Rank 1 never routes; it waits on a flag nobody raises instead. */
    if (ctx->rank == 0) COMET_OK(cometi_route_dev_run(comm, &r, d_ids, NULL, 32, 2, 0, 0, NULL, 0), comm);
    else COMET_OK(cometi_wait_flag(comm, 3, 1, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    double took = now_s() - t0;
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_TIMEOUT);
    printf("rank %d: %.3f s: %s\n", ctx->rank, took, comet_comm_last_error(comm));
    if (ctx->rank == 0) {
        CHECK_CONTAINS(comet_comm_last_error(comm), "the routing-count exchange");
        CHECK_CONTAINS(comet_comm_last_error(comm), "on rank 1");
    }
    CHECK(took < 3.0);
    comet_comm_destroy(comm); /* aborts: the windows go with NCCL */
    return 0;
}

int test_gpu_route_missing_peer_times_out(void)
{
    if (!have_gpus(2)) return TEST_SKIP;
    return launch(2, route_missing_peer_rank, NULL, 100);
}

/* Ranks in different calls (rank 0 the backward of call 5, rank 1 of call 6): every rank
 * records COMET_INVALID_ARGUMENT naming the other, and places nothing. */
static int route_call_mismatch_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 2000, &comm)) return 1;
    cometi_route_dev_t r;
    COMET_OK(cometi_route_dev_create(comm, 8, 1, 64, 2 * 64 + 4 * 127, COMETI_BLOCK_M, &r), comm);
    int32_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7}, *d_ids;
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(ids)));
    CUDA_OK(cudaMemcpy(d_ids, ids, sizeof(ids), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(r.plan.recv_rows, 0xff, sizeof(int32_t) * ctx->nranks));
    COMET_OK(cometi_route_dev_run(comm, &r, d_ids, NULL, 4, 2, 0, 5u + (unsigned int)ctx->rank, NULL, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_INVALID_ARGUMENT);
    printf("rank %d: %s\n", ctx->rank, comet_comm_last_error(comm));
    char want[160];
    snprintf(want, sizeof(want), "found rank %d in another call: the backward of training forward %d there, the "
             "backward of training forward %d here", 1 - ctx->rank, 6 - ctx->rank, 5 + ctx->rank);
    CHECK_CONTAINS(comet_comm_last_error(comm), want);
    int32_t rows[2];
    CUDA_OK(cudaMemcpy(rows, r.plan.recv_rows, sizeof(rows), cudaMemcpyDeviceToHost));
    CHECK_EQ(rows[0], 0); /* the plan emptied: nothing received, so nothing sent */
    CHECK_EQ(rows[1], 0);
    comet_comm_destroy(comm);
    return 0;
}

int test_gpu_route_call_mismatch_refused(void)
{
    if (!have_gpus(2)) return TEST_SKIP;
    return launch(2, route_call_mismatch_rank, NULL, 100);
}

static int route_bad_id_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 2000, &comm)) return 1;
    cometi_route_dev_t r;
    COMET_OK(cometi_route_dev_create(comm, 8, 1, 64, 64 + 8 * 127, COMETI_BLOCK_M, &r), comm);
    int32_t ids[8] = {0, 1, 2, 3, 4, 9, 6, 7}, *d_ids;
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(ids)));
    CUDA_OK(cudaMemcpy(d_ids, ids, sizeof(ids), cudaMemcpyHostToDevice));
    COMET_OK(cometi_route_dev_run(comm, &r, d_ids, NULL, 4, 2, 0, 0, NULL, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_INVALID_ARGUMENT);
    printf("%s\n", comet_comm_last_error(comm));
    CHECK_CONTAINS(comet_comm_last_error(comm), "topk_ids entry 5 (token * top_k + choice) = 9");
    int32_t pos[8];
    CUDA_OK(cudaMemcpy(pos, r.plan.recv_pos, sizeof(pos), cudaMemcpyDeviceToHost));
    CHECK_EQ(pos[5], -1);
    CHECK(pos[4] >= 0);
    /* Reported once, and not fatal: the next call routes normally. */
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
    ids[5] = 5;
    CUDA_OK(cudaMemcpy(d_ids, ids, sizeof(ids), cudaMemcpyHostToDevice));
    COMET_OK(cometi_route_dev_run(comm, &r, d_ids, NULL, 4, 2, 0, 0, NULL, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
    CUDA_OK(cudaMemcpy(pos, r.plan.recv_pos, sizeof(pos), cudaMemcpyDeviceToHost));
    CHECK(pos[5] >= 0);
    cometi_route_dev_destroy(comm, &r);
    COMET_OK(comet_comm_destroy(comm), comm);
    return 0;
}

int test_gpu_route_reports_bad_expert_id(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    return launch(1, route_bad_id_rank, NULL, 50);
}
