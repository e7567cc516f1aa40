/*
 * test_gemm.c - the grouped GEMM's run-time choices (every row of its table runs in
 * test_gemm_variants.c): the tile width, which row tiles go first and the last wave's cut,
 * planned on the CPU (known answers and random inputs), then on a GPU (skipping without
 * one) the GEMM against float64 over n, grids, tile orders, schedules and the shared tile
 * counter, the last wave cut along k, and the SwiGLU epilogues' inputs (gate and up in one
 * tensor or two, a half-full last tile, gate and up kept through TMA or from registers),
 * row scales and scatter.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/launch.h"
#include "comm/plan.h"
#include "gemm/gemm.h"
#include "gemm/args.h"
#include "gemm/schedule.h"
#include "../harness/timeline.h"
#include "testutil.h"
#include "gpu_util.h"

/* The column tile width by waste: 256 on its grid and where its partial last tile wastes
 * at most 1/8 more columns than 128-wide tiles would (qwen2-moe's 1408, gpt-oss's 2880),
 * else 128. */
int test_gemm_tile_width(void)
{
    const int want[][2] = {{4096, 256}, {14336, 256}, {1408, 256}, {2880, 256}, {1344, 256}, {1152, 256},
                           {192, 256},  {896, 128},   {576, 128},  {320, 128},  {64, 128}};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        if (cometi_gemm_tile_n(want[i][0]) != want[i][1]) printf("n = %d\n", want[i][0]);
        CHECK_EQ(cometi_gemm_tile_n(want[i][0]), want[i][1]);
    }
    return 0;
}

/* The row tiles a group puts first: the whole tiles of its local rows, and all of them,
 * a partial last one too, when every row is local (world 1). */
int test_gemm_local_row_tiles(void)
{
    const int want[][5] = {
        /* rows, local, mt, tm: first-phase tiles */
        {1024, 1024, 8, 128, 8}, /* whole tiles, all local */
        {1000, 1000, 8, 128, 8}, /* all local: the partial last tile too */
        {1000, 600, 8, 128, 4},  /* remote rows after 600 local: 4 whole tiles */
        {1000, 0, 8, 128, 0},    /* nothing local */
        {100, 100, 1, 128, 1},   /* one partial tile, local */
        {100, 99, 1, 128, 0},    /* one partial tile with a remote row */
        {0, 0, 0, 128, 0},       /* an empty group */
        {1000, 1000, 4, 256, 4}, /* E4M3's 256-row tiles */
        {300, 300, 2, 256, 2},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        const int *w = want[i], got = cometi_gemm_local_row_tiles(w[0], w[1], w[2], w[3]);
        if (got != w[4]) printf("case %zu\n", i);
        CHECK_EQ(got, w[4]);
    }
    /* On random groups: never more tiles than the group has, only tiles made of local rows
     * unless every row is local, and every tile then. */
    uint64_t rng = test_seed();
    for (int it = 0; it < 100000; it++) {
        const int tm = cometi_rand_next(&rng) % 2 ? 128 : 256, rows = (int)(cometi_rand_next(&rng) % 5000),
                  local = rows ? (int)(cometi_rand_next(&rng) % (rows + 1)) : 0, mt = (rows + tm - 1) / tm;
        const int got = cometi_gemm_local_row_tiles(rows, local, mt, tm);
        CHECK(got >= 0 && got <= mt);
        if (local == rows) CHECK_EQ(got, mt);
        else CHECK_EQ(got, local / tm);
    }
    return 0;
}

/* The last wave's cut: known answers (skewed mixtral's GEMM1 on the hot rank: 416 tiles on
 * 132 blocks; balanced mixtral's: 2048), the cases that cut nothing, and on random inputs
 * the plan's promises against every other choice of parts. */
int test_gemm_tail_plan(void)
{
    cometi_tail_plan_t s = cometi_gemm_tail_plan(416, 132, 224, 1);
    CHECK_EQ(s.first, 396);
    CHECK_EQ(s.parts, 4);
    CHECK_EQ(s.units, 396 + 20 * 4);
    s = cometi_gemm_tail_plan(14, 6, 32, 1); /* 2 left over on 6 blocks: 3 parts each */
    CHECK_EQ(s.first, 12);
    CHECK_EQ(s.parts, 3);
    CHECK_EQ(s.units, 18);
    s = cometi_gemm_tail_plan(5, 132, 16, 1); /* under one wave; k allows 2 parts */
    CHECK_EQ(s.first, 0);
    CHECK_EQ(s.parts, 2);
    CHECK_EQ(s.units, 10);
    s = cometi_gemm_tail_plan(2048, 132, 224, 1); /* 68 left over: 204 thirds in 2 rounds */
    CHECK_EQ(s.first, 1980);
    CHECK_EQ(s.parts, 3);
    CHECK_EQ(s.units, 1980 + 68 * 3);
    s = cometi_gemm_tail_plan(14336, 132, 64, 1); /* mixtral's GEMM0: 80 left over, in thirds */
    CHECK_EQ(s.first, 14256);
    CHECK_EQ(s.parts, 3);
    CHECK_EQ(s.units, 14256 + 80 * 3);
    const int none[][4] = {{130, 132, 224, 1},  /* nearly full: no count of parts shortens it */
                           {95, 132, 224, 1},   /* 0.72 full: quarters need 285 partials, 264 slots */
                           {264, 132, 224, 1},  /* whole waves */
                           {5, 132, 8, 1},      /* k too short for two parts of 8 steps */
                           {100, 132, 16, 1},   /* 2 parts, the most k allows, take 2 rounds */
                           {416, 132, 224, 0},  /* off */
                           {0, 132, 224, 1},    {7, 0, 224, 1}};
    for (size_t i = 0; i < sizeof(none) / sizeof(none[0]); i++) {
        s = cometi_gemm_tail_plan(none[i][0], none[i][1], none[i][2], none[i][3]);
        CHECK_EQ(s.parts, 1);
        CHECK_EQ(s.first, none[i][0]);
        CHECK_EQ(s.units, none[i][0]);
    }
    uint64_t rng = test_seed();
    for (int it = 0; it < 100000; it++) {
        const int total = (int)(cometi_rand_next(&rng) % 5000), takers = 1 + (int)(cometi_rand_next(&rng) % 200),
                  k_blocks = 1 + (int)(cometi_rand_next(&rng) % 300), rest = total % takers;
        s = cometi_gemm_tail_plan(total, takers, k_blocks, 1);
        CHECK(s.parts >= 1 && s.parts <= COMETI_TAIL_MAX_PARTS);
        CHECK_EQ(s.units, s.first + (total - s.first) * s.parts);
        /* Every feasible count of parts (1: no cut) and the last wave's length in tiles. */
        double best = 1.0;
        for (int p = 2; p <= COMETI_TAIL_MAX_PARTS; p++)
            if (rest && p * COMETI_TAIL_MIN_KBLOCKS <= k_blocks && (size_t)rest * (p - 1) <= COMETI_GEMM_TAIL_SLOTS(takers)) {
                const double len = (double)((rest * p + takers - 1) / takers) / p;
                if (len < best) best = len;
            }
        if (s.parts == 1) {
            CHECK_EQ(s.first, total);
            CHECK(best == 1.0); /* nothing would have been shorter */
            continue;
        }
        CHECK_EQ(s.first % takers, 0);                               /* whole waves before the cut */
        CHECK_EQ(total - s.first, rest);
        CHECK(s.parts * COMETI_TAIL_MIN_KBLOCKS <= k_blocks);         /* every part long enough */
        CHECK((size_t)rest * (s.parts - 1) <= COMETI_GEMM_TAIL_SLOTS(takers)); /* partials fit */
        const int rounds = (rest * s.parts + takers - 1) / takers;
        CHECK(fabs((double)rounds / s.parts - best) < 1e-12);         /* the shortest */
        if (2 * rest <= takers) CHECK_EQ(rounds, 1);                  /* a wave at most half full: one round */
    }
    return 0;
}

/* ---- the grouped GEMM against float64 ---- */

static int gemm_reference_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg;
    cometi_async_error_t *err_host, *err_dev;
    if (gemm_setup(ctx, &err_host, &err_dev)) return 1;
    /* Group sizes 0, 1, a tile and one, not a multiple of anything, a full tile; each
     * segment starts on a 128-row boundary as the MoE layout pads them. */
    const int groups = 6, sizes[6] = {0, 1, 129, 300, 128, 77}, k = 192;
    /* n = 320: a partial last column tile at both widths (2.5 x 128, 1.25 x 256), with C's
     * rows 64 columns wider than n so a store past n would show in the gap. */
    const int ns[3] = {256, 512, 320};
    cometi_segment_t segs_host[6];
    int rows = padded_segments(sizes, groups, segs_host) + 128; /* slack after the last segment */
    cometi_segment_t *segs;
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    for (int ni = 0; ni < 3; ni++) {
        const int n = ns[ni], ldc = n % 256 ? n + 64 : n;
        size_t na = (size_t)rows * k, nb = (size_t)groups * n * k, nc = (size_t)rows * ldc;
        uint16_t *a16 = malloc(na * 2), *b16 = malloc(nb * 2), *c16 = malloc(nc * 2);
        float *af = malloc(na * 4), *bf = malloc(nb * 4);
        fill_bf16(af, a16, na, 1.0, &rng);
        fill_bf16(bf, b16, nb, 0.1, &rng);
        void *a, *b, *c;
        CUDA_OK(cudaMalloc(&a, na * 2));
        CUDA_OK(cudaMalloc(&b, nb * 2));
        CUDA_OK(cudaMalloc(&c, nc * 2));
        CUDA_OK(cudaMemcpy(a, a16, na * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(b, b16, nb * 2, cudaMemcpyHostToDevice));
        unsigned int *sched;
        CUDA_OK(cudaMalloc((void **)&sched, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
        CUDA_OK(cudaMemset(sched, 0, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
        for (int variant = 0; variant < 16; variant++) {
            /* Both tile widths, both stores, few blocks (many tiles each, one row tile per
             * band of the tile order) and all; then the ping-pong schedule (128x256 only);
             * then tiles from the shared counter, twice in a row (the kernel must leave the
             * counter zeroed). (Every row of the table, splits and roles too, runs in
             * test_gemm_variants.c; this test varies the run-time choices over n.) */
            const int dynamic = variant >= 12;
            const int pingpong = variant >= 8 && (!dynamic || variant & 1);
            const int block_n = pingpong || variant & 1 ? 256 : 128, sms = variant & 2 ? 132 : 3;
            const int store = variant & 4 || (pingpong && variant & 1) ? COMETI_GEMM_STORE_TMA
                                                                       : COMETI_GEMM_STORE_DIRECT;
            for (int call = 0; call < (dynamic ? 2 : 1); call++) {
                CUDA_OK(cudaMemset(c, 0xff, nc * 2)); /* poison: bf16 NaN */
                cometi_gemm_t g = {.problem = {.groups = groups, .n = n, .k = k, .segs = segs},
                                   .a = {.ptr = a, .rows = rows},
                                   .b = {.ptr = b},
                                   .out = {.store = store, .c = c, .ldc = ldc},
                                   .launch = {.sms = sms, .block_n = block_n, .group_m = sms == 3 ? 1 : 0,
                                              .schedule = pingpong ? COMETI_GEMM_PINGPONG : COMETI_GEMM_COOPERATIVE,
                                              .sched = dynamic ? sched : NULL},
                                   .err = err_dev};
                char err[COMETI_ERR_LEN];
                comet_status_t st = cometi_gemm_run(err, &g, 0);
                if (st != COMET_SUCCESS) printf("cometi_gemm_run: %s\n", err);
                CHECK_EQ(st, COMET_SUCCESS);
                CUDA_OK(cudaDeviceSynchronize());
                CHECK_EQ(err_host->status, 0);
                CUDA_OK(cudaMemcpy(c16, c, nc * 2, cudaMemcpyDeviceToHost));
                double worst = 0;
                for (int gi = 0; gi < groups; gi++) {
                    for (int r = 0; r < (sizes[gi] + 127) / 128 * 128; r++) {
                        const size_t row = (size_t)segs_host[gi].start + r;
                        if (r >= sizes[gi]) { /* padding rows stay untouched */
                            for (int j = 0; j < ldc; j++) CHECK_EQ(c16[row * ldc + j], 0xffff);
                            continue;
                        }
                        for (int j = n; j < ldc; j++) CHECK_EQ(c16[row * ldc + j], 0xffff); /* past n */
                        double num = 0, den = 0;
                        for (int j = 0; j < n; j++) {
                            double ref = 0;
                            for (int q = 0; q < k; q++) ref += (double)af[row * k + q] * bf[((size_t)gi * n + j) * k + q];
                            double d = cometi_bf16_to_float(c16[row * ldc + j]) - ref;
                            if (!isfinite(d)) d = INFINITY;
                            num += d * d;
                            den += ref * ref;
                        }
                        double e = sqrt(num / den);
                        if (!(e <= worst)) worst = e;
                    }
                }
                printf("n %d block_n %d blocks %d %s store %s%s: worst row relative error %.2e\n", n, block_n, sms,
                       store == COMETI_GEMM_STORE_TMA ? "TMA" : "direct", pingpong ? "ping-pong" : "cooperative",
                       dynamic ? (call ? " shared counter, 2nd call" : " shared counter") : "", worst);
                CHECK(worst < 1e-2);
            }
        }
        free(a16), free(b16), free(c16), free(af), free(bf);
        cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(sched);
    }
    /* Every group empty: no tiles, nothing written, no hang. */
    cometi_segment_t empty[2] = {{0, 0}, {128, 0}};
    CUDA_OK(cudaMemcpy(segs, empty, sizeof(empty), cudaMemcpyHostToDevice));
    void *a, *b, *c;
    CUDA_OK(cudaMalloc(&a, 256 * 64 * 2));
    CUDA_OK(cudaMalloc(&b, 2 * 128 * 64 * 2));
    CUDA_OK(cudaMalloc(&c, 256 * 128 * 2));
    cometi_gemm_t g = {.problem = {.groups = 2, .n = 128, .k = 64, .segs = segs},
                       .a = {.ptr = a, .rows = 256},
                       .b = {.ptr = b},
                       .out = {.c = c, .ldc = 128},
                       .launch = {.block_n = 128},
                       .err = err_dev};
    char err[COMETI_ERR_LEN];
    CHECK_EQ(cometi_gemm_run(err, &g, 0), COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(err_host->status, 0);
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(segs);
    return 0;
}

int test_gpu_gemm_vs_reference(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, gemm_reference_rank, &seed, 110);
}

/* The last wave cut along k (tail_ws): shapes whose last wave is not full, on the static split
 * (6, 9, 11 and 40 blocks) and the shared counter (every SM), plain and SwiGLU, both epilogues.
 * Each run is checked against float64, run again for the same bits (the parts add in a
 * fixed order), timed by the tile timeline to count the units the plan promised (so a
 * cut that silently did not happen fails), and leaves the workspace's counters at zero. */
static int gemm_cut_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg;
    cometi_async_error_t *err_host, *err_dev;
    if (gemm_setup(ctx, &err_host, &err_dev)) return 1;
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx->local_rank));
    const int groups = 4, sizes[4] = {300, 129, 0, 256}, k = 2048, n = 256; /* n: output columns */
    cometi_segment_t segs_host[4];
    const int rows = padded_segments(sizes, groups, segs_host);
    cometi_segment_t *segs;
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    /* B: [groups][2n][k], gate rows then up rows (SwiGLU); the plain GEMM uses the first n
     * rows of each group through a [groups][n][k] copy. */
    const size_t na = (size_t)rows * k, nb = (size_t)groups * 2 * n * k, nc = (size_t)rows * n;
    uint16_t *a16 = malloc(na * 2), *b16 = malloc(nb * 2), *gate16 = malloc(nb), *c16 = malloc(nc * 2),
             *again16 = malloc(nc * 2);
    float *af = malloc(na * 4), *bf = malloc(nb * 4);
    double *gate_ref = malloc(sizeof(double) * nc), *up_ref = malloc(sizeof(double) * nc);
    fill_bf16(af, a16, na, 1.0, &rng);
    fill_bf16(bf, b16, nb, 1.0 / 32, &rng);
    for (int g = 0; g < groups; g++) memcpy(gate16 + (size_t)g * n * k, b16 + (size_t)g * 2 * n * k, (size_t)n * k * 2);
    for (int g = 0; g < groups; g++)
        for (int r = 0; r < sizes[g]; r++) {
            const size_t row = (size_t)segs_host[g].start + r;
            for (int j = 0; j < n; j++) {
                double gs = 0, us = 0;
                const float *wg = bf + ((size_t)g * 2 * n + j) * k, *wu = wg + (size_t)n * k;
                for (int q = 0; q < k; q++) gs += (double)af[row * k + q] * wg[q], us += (double)af[row * k + q] * wu[q];
                gate_ref[row * n + j] = gs;
                up_ref[row * n + j] = us;
            }
        }
    void *a, *b, *gate, *c, *ws;
    unsigned int *sched;
    unsigned long long *trace;
    CUDA_OK(cudaMalloc(&a, na * 2));
    CUDA_OK(cudaMalloc(&b, nb * 2));
    CUDA_OK(cudaMalloc(&gate, nb));
    CUDA_OK(cudaMalloc(&c, nc * 2));
    CUDA_OK(cudaMalloc(&ws, COMETI_GEMM_TAIL_BYTES(sms)));
    CUDA_OK(cudaMemset(ws, 0, COMETI_GEMM_TAIL_COUNTERS * 8));
    CUDA_OK(cudaMalloc((void **)&sched, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    CUDA_OK(cudaMemset(sched, 0, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    CUDA_OK(cudaMalloc((void **)&trace, (size_t)sms * COMETI_TILE_TRACE_WORDS * 8));
    CUDA_OK(cudaMemcpy(a, a16, na * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b, b16, nb * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(gate, gate16, nb, cudaMemcpyHostToDevice));
    /* {swiglu, block_n, blocks (0: every SM, shared counter), epilogue} */
    /* 7 tiles (plain, block_n 256) or 14: on 6 blocks 1 or 2 left over, on 40 and every SM
     * under one wave; on 11 and 9 blocks a last wave more than half full (7 of 11, 5 of 9),
     * cut in thirds that take two rounds. */
    enum { T = COMETI_GEMM_STORE_TMA, D = COMETI_GEMM_STORE_DIRECT };
    const int variants[][4] = {{0, 256, 6, T},  {0, 128, 6, D}, {0, 256, 40, D}, {0, 256, 0, T}, {1, 256, 6, T},
                               {1, 256, 40, D}, {1, 256, 0, T}, {0, 256, 11, T}, {0, 128, 9, D}, {1, 256, 9, T}};
    for (size_t v = 0; v < sizeof(variants) / sizeof(variants[0]); v++) {
        const int swiglu = variants[v][0], block_n = variants[v][1], blocks = variants[v][2];
        cometi_gemm_t g = {.problem = {.groups = groups, .n = n, .k = k, .segs = segs},
                           .a = {.ptr = a, .rows = rows},
                           .b = {.ptr = swiglu ? b : gate},
                           .out = {.epilogue = swiglu ? COMETI_GEMM_EPI_SWIGLU : COMETI_GEMM_EPI_STORE,
                                   .store = variants[v][3], .c = c, .ldc = n},
                           .launch = {.sms = blocks, .block_n = block_n, .schedule = COMETI_GEMM_COOPERATIVE,
                                      .sched = blocks ? NULL : sched, .tail_ws = ws},
                           .err = err_dev,
                           .roles = {.tile_trace = trace}};
        /* What the plan promises: tiles = row tiles x column tiles (SwiGLU: 128 output columns). */
        int m_tiles = 0;
        for (int gi = 0; gi < groups; gi++) m_tiles += (sizes[gi] + 127) / 128;
        const int tiles = m_tiles * (n / (swiglu ? 128 : block_n));
        const cometi_tail_plan_t plan = cometi_gemm_tail_plan(tiles, blocks ? blocks : sms, k / 64, 1);
        CHECK(plan.parts > 1); /* every variant is meant to cut */
        for (int run = 0; run < 2; run++) {
            CUDA_OK(cudaMemset(c, 0xff, nc * 2));
            CUDA_OK(cudaMemset(trace, 0, (size_t)sms * COMETI_TILE_TRACE_WORDS * 8));
            char err[COMETI_ERR_LEN];
            comet_status_t st = cometi_gemm_run(err, &g, 0);
            if (st != COMET_SUCCESS) printf("variant %zu: %s\n", v, err);
            CHECK_EQ(st, COMET_SUCCESS);
            CUDA_OK(cudaDeviceSynchronize());
            CHECK_EQ(err_host->status, 0);
            CUDA_OK(cudaMemcpy(run ? again16 : c16, c, nc * 2, cudaMemcpyDeviceToHost));
            char what[32];
            snprintf(what, sizeof(what), "variant %zu", v);
            if (check_cut_units(trace, sms, ws, plan.units, what)) return 1;
        }
        CHECK(memcmp(c16, again16, nc * 2) == 0); /* the same bits */
        double worst = 0;
        for (int gi = 0; gi < groups; gi++)
            for (int r = 0; r < (sizes[gi] + 127) / 128 * 128; r++) {
                const size_t row = (size_t)segs_host[gi].start + r;
                if (r >= sizes[gi]) { /* padding rows: untouched */
                    for (int j = 0; j < n; j++) CHECK_EQ(c16[row * n + j], 0xffff);
                    continue;
                }
                double num = 0, den = 0;
                for (int j = 0; j < n; j++) {
                    const double ref = swiglu ? cometi_swiglu(gate_ref[row * n + j], up_ref[row * n + j])
                                              : gate_ref[row * n + j];
                    double d = cometi_bf16_to_float(c16[row * n + j]) - ref;
                    if (!isfinite(d)) d = INFINITY;
                    num += d * d;
                    den += ref * ref;
                }
                const double e = sqrt(num / den);
                if (!(e <= worst)) worst = e;
            }
        printf("%s block_n %d, %d blocks%s, %s store: %d tiles -> %d units (%d parts of the last %d), worst row "
               "relative error %.2e\n", swiglu ? "swiglu" : "plain", block_n, blocks ? blocks : sms,
               blocks ? "" : " (shared counter)", variants[v][3] == COMETI_GEMM_STORE_TMA ? "TMA" : "direct", tiles,
               plan.units, plan.parts, tiles - plan.first, worst);
        CHECK(worst < 1e-2);
    }
    /* A grid past the SMs (the workspace holds a part per SM) runs without the cut. */
    cometi_gemm_t too_many = {.problem = {.groups = groups, .n = n, .k = k, .segs = segs},
                              .a = {.ptr = a, .rows = rows},
                              .b = {.ptr = gate},
                              .out = {.c = c, .ldc = n},
                              .launch = {.sms = sms + 1, .block_n = 256, .tail_ws = ws},
                              .err = err_dev};
    char err[COMETI_ERR_LEN];
    comet_status_t st = cometi_gemm_run(err, &too_many, 0);
    if (st != COMET_SUCCESS) printf("%d blocks: %s\n", sms + 1, err);
    CHECK_EQ(st, COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(err_host->status, 0);
    free(a16), free(b16), free(gate16), free(c16), free(again16), free(af), free(bf), free(gate_ref), free(up_ref);
    cudaFree(a), cudaFree(b), cudaFree(gate), cudaFree(c), cudaFree(ws), cudaFree(sched), cudaFree(trace);
    cudaFree(segs);
    return 0;
}

int test_gpu_gemm_last_wave_cut(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, gemm_cut_rank, &seed, 110);
}

/* SwiGLU (gate and up fused in one tensor, or two), a per-row scale, and rows stored
 * to an index, each against float64 with both epilogues. */
static int gemm_epilogue_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg;
    cometi_async_error_t *err_host, *err_dev;
    if (gemm_setup(ctx, &err_host, &err_dev)) return 1;
    const int groups = 4, sizes[4] = {200, 0, 128, 45}, k = 256, n = 256; /* n: output columns */
    cometi_segment_t segs_host[4];
    const int rows = padded_segments(sizes, groups, segs_host);
    cometi_segment_t *segs;
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    /* B holds 2n rows per group: gate then up (for SwiGLU), or the first n alone. */
    size_t na = (size_t)rows * k, nb = (size_t)groups * 2 * n * k, nc = (size_t)rows * n;
    uint16_t *a16 = malloc(na * 2), *b16 = malloc(nb * 2), *c16 = malloc(nc * 2), *gate16 = malloc(nb),
             *up16 = malloc(nb);
    float *af = malloc(na * 4), *bf = malloc(nb * 4), *scale = malloc(sizeof(float) * rows);
    int32_t *index = malloc(sizeof(int32_t) * rows);
    fill_bf16(af, a16, na, 1.0, &rng);
    fill_bf16(bf, b16, nb, 1.0 / 16, &rng);
    for (int g = 0; g < groups; g++) { /* the same weights as two tensors */
        memcpy(gate16 + (size_t)g * n * k, b16 + (size_t)g * 2 * n * k, (size_t)n * k * 2);
        memcpy(up16 + (size_t)g * n * k, b16 + ((size_t)g * 2 + 1) * n * k, (size_t)n * k * 2);
    }
    /* SwiGLU with n = 192 (a half-full last tile of 128 columns): each group's first 192
     * gate rows, then its first 192 up rows. */
    const int n_ragged = 192;
    uint16_t *ragged16 = malloc((size_t)groups * 2 * n_ragged * k * 2);
    for (int g = 0; g < groups; g++)
        for (int half = 0; half < 2; half++)
            memcpy(ragged16 + ((size_t)g * 2 + half) * n_ragged * k, b16 + ((size_t)g * 2 * n + (size_t)half * n) * k,
                   (size_t)n_ragged * k * 2);
    for (int r = 0; r < rows; r++) scale[r] = (float)(0.25 + cometi_rand_unit(&rng));
    /* Scatter: reverse the rows; every third row dropped. */
    for (int r = 0; r < rows; r++) index[r] = r % 3 == 2 ? -1 : rows - 1 - r;
    void *a, *b, *c, *gate, *up, *ragged;
    float *d_scale;
    int32_t *d_index;
    CUDA_OK(cudaMalloc(&a, na * 2));
    CUDA_OK(cudaMalloc(&b, nb * 2));
    CUDA_OK(cudaMalloc(&gate, nb));
    CUDA_OK(cudaMalloc(&up, nb));
    CUDA_OK(cudaMalloc(&c, nc * 2));
    CUDA_OK(cudaMalloc(&ragged, (size_t)groups * 2 * n_ragged * k * 2));
    CUDA_OK(cudaMemcpy(ragged, ragged16, (size_t)groups * 2 * n_ragged * k * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&d_scale, sizeof(float) * rows));
    CUDA_OK(cudaMalloc((void **)&d_index, sizeof(int32_t) * rows));
    CUDA_OK(cudaMemcpy(a, a16, na * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b, b16, nb * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(gate, gate16, nb, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(up, up16, nb, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_scale, scale, sizeof(float) * rows, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_index, index, sizeof(int32_t) * rows, cudaMemcpyHostToDevice));
    const char *names[6] = {"swiglu, fused gate_up", "swiglu, gate and up apart", "row scale", "scatter",
                            "swiglu, n 192 in ldc 256", "swiglu, one group"};
    /* The cooperative runs also record their tile timeline (comet bench --trace). */
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx->local_rank));
    const size_t trace_words = (size_t)sms * COMETI_TILE_TRACE_WORDS;
    unsigned long long *trace, *trace_host = malloc(trace_words * sizeof(unsigned long long));
    CUDA_OK(cudaMalloc((void **)&trace, trace_words * sizeof(unsigned long long)));
    /* SwiGLU's gate and up kept (training), [gu_rows][2 n_out]: rows from gu_rows on are not
     * kept (a full tile of group 2 straddles it). TMA epilogue: full tiles by TMA stores
     * (gu 16-byte aligned), except in mode 5, where gu sits 4 bytes past that and the TMA
     * epilogue's kernel stores g and u from registers; direct epilogue: gu 4 bytes past,
     * every row from registers. Which way the prepared GEMM goes is checked too. */
    const int gu_rows = 300;
    uint16_t *gu16 = malloc((size_t)rows * 2 * n * 2);
    unsigned char *gu_mem;
    CUDA_OK(cudaMalloc((void **)&gu_mem, (size_t)rows * 2 * n * 2 + 16));
    for (int mode = 0; mode < 6; mode++) {
        const int n_out = mode == 4 ? n_ragged : n; /* columns computed; C rows stay n apart */
        const int used_groups = mode == 5 ? 1 : groups; /* one expert per rank (EP = E) */
        for (int variant = 0; variant < 4; variant++) {
            /* SwiGLU: keeping g and u (the TMA store), then the direct store, ping-pong, and the
             * TMA store; a row scale: the TMA and direct stores, cooperative and ping-pong; the
             * scatter: the direct store (rows to an index leave from the registers). */
            const int swiglu = mode <= 1 || mode >= 4, keep = swiglu && variant == 0;
            const int pingpong = variant == 2 || (!swiglu && variant == 3);
            const int store = swiglu ? (variant == 1 ? COMETI_GEMM_STORE_DIRECT
                                        : variant == 0 ? COMETI_GEMM_STORE_AUTO : COMETI_GEMM_STORE_TMA)
                                     : (variant & 1 ? COMETI_GEMM_STORE_DIRECT : COMETI_GEMM_STORE_TMA);
            if (mode == 3 && variant != 1) continue;
            cometi_gemm_t g = {.problem = {.groups = used_groups, .n = n_out, .k = k, .segs = segs},
                               .a = {.ptr = a, .rows = rows},
                               .b = {.ptr = b},
                               .out = {.epilogue = keep     ? COMETI_GEMM_EPI_SWIGLU_GU
                                                   : swiglu ? COMETI_GEMM_EPI_SWIGLU
                                                            : COMETI_GEMM_EPI_STORE,
                                       .store = store, .c = c, .ldc = n},
                               .launch = {.schedule = pingpong ? COMETI_GEMM_PINGPONG : COMETI_GEMM_COOPERATIVE},
                               .err = err_dev};
            if (mode == 1) g.b.ptr = gate, g.b.up = up;
            if (mode == 2) g.out.row_scale = d_scale, g.launch.block_n = 256;
            if (mode == 3) g.out.row_index = d_index, g.launch.block_n = 128;
            if (mode == 4) g.b.ptr = ragged;
            /* Without SwiGLU, B's groups are n rows apart: view the first n of each 2n as
             * a tensor of its own by using the gate copy. */
            if (mode == 2 || mode == 3) g.b.ptr = gate;
            if (!pingpong) g.roles.tile_trace = trace;
            const int gu_tma = mode != 5;
            uint16_t *gu = (uint16_t *)(gu_mem + (gu_tma ? 0 : 4));
            if (keep) {
                g.out.gu = gu, g.out.gu_rows = gu_rows;
                cometi_gemm_prepared_t prepared;
                char perr[COMETI_ERR_LEN];
                CHECK_EQ(cometi_gemm_prepare(perr, &g, &prepared), COMET_SUCCESS);
                CHECK_EQ(((const cometi_gemm_plan_t *)prepared.bytes)->args.gu_tma, gu_tma);
            }
            CUDA_OK(cudaMemset(gu_mem, 0xff, (size_t)rows * 2 * n * 2 + 16));
            CUDA_OK(cudaMemset(trace, 0, trace_words * sizeof(unsigned long long)));
            CUDA_OK(cudaMemset(c, 0xff, nc * 2));
            char err[COMETI_ERR_LEN];
            comet_status_t st = cometi_gemm_run(err, &g, 0);
            if (st != COMET_SUCCESS) printf("%s: %s\n", names[mode], err);
            CHECK_EQ(st, COMET_SUCCESS);
            CUDA_OK(cudaDeviceSynchronize());
            CHECK_EQ(err_host->status, 0);
            if (!pingpong) { /* every block has a consistent row, and every tile is in one */
                CUDA_OK(cudaMemcpy(trace_host, trace, trace_words * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
                cometi_timeline_t tl;
                st = cometi_timeline_summarize(err, trace_host, sms, &tl);
                if (st != COMET_SUCCESS) printf("%s timeline: %s\n", names[mode], err);
                CHECK_EQ(st, COMET_SUCCESS);
                CHECK_EQ(tl.blocks, sms);
                CHECK_EQ(tl.truncated, 0);
                CHECK(tl.tiles > 0);
                char *seen = calloc((size_t)tl.tiles, 1);
                for (int blk = 0; blk < sms; blk++) {
                    const unsigned long long *row = trace_host + (size_t)blk * COMETI_TILE_TRACE_WORDS;
                    for (unsigned long long i = 0; i < row[2]; i++) {
                        const unsigned long long tile = row[4 + 4 * i];
                        CHECK(tile < (unsigned long long)tl.tiles && !seen[tile]);
                        seen[tile] = 1;
                    }
                }
                free(seen);
            }
            CUDA_OK(cudaMemcpy(c16, c, nc * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(gu16, gu, (size_t)rows * 2 * n_out * 2, cudaMemcpyDeviceToHost));
            /* A kept g or u is its fp32 sum rounded to bf16 once: within 2^-8 of the float64
             * sum, relative, plus the fp32 sum's own error (k = 256 products under 1/16). */
            int gu_bad = 0;
            char *kept = calloc((size_t)rows, 1);
            double worst = 0;
            char *written = calloc((size_t)rows, 1);
            for (int gi = 0; gi < used_groups; gi++) {
                for (int r = 0; r < sizes[gi]; r++) {
                    const int src = segs_host[gi].start + r;
                    const int dst = mode == 3 ? index[src] : src;
                    if (dst < 0) continue;
                    written[dst] = 1;
                    double num = 0, den = 0;
                    for (int j = 0; j < n_out; j++) {
                        double gsum = 0, usum = 0;
                        const float *wg = bf + ((size_t)gi * 2 * n + j) * k, *wu = wg + (size_t)n * k;
                        for (int q = 0; q < k; q++) {
                            gsum += (double)af[(size_t)src * k + q] * wg[q];
                            usum += (double)af[(size_t)src * k + q] * wu[q];
                        }
                        if (keep && src < gu_rows) {
                            const double kg = cometi_bf16_to_float(gu16[(size_t)src * 2 * n_out + j]),
                                         ku = cometi_bf16_to_float(gu16[(size_t)src * 2 * n_out + n_out + j]);
                            if (!(fabs(kg - gsum) <= 0x1p-8 * fabs(gsum) + 1e-4) ||
                                !(fabs(ku - usum) <= 0x1p-8 * fabs(usum) + 1e-4))
                                gu_bad++;
                            kept[src] = 1;
                        }
                        double ref = mode <= 1 || mode >= 4 ? cometi_swiglu(gsum, usum)
                                     : mode == 2             ? scale[src] * gsum
                                                             : gsum;
                        double d = cometi_bf16_to_float(c16[(size_t)dst * n + j]) - ref;
                        if (!isfinite(d)) d = INFINITY;
                        num += d * d;
                        den += ref * ref;
                    }
                    double e = sqrt(num / den);
                    if (!(e <= worst)) worst = e;
                    for (int j = n_out; j < n; j++) CHECK_EQ(c16[(size_t)dst * n + j], 0xffff); /* past n: untouched */
                }
            }
            /* Rows nobody stores to (padding, dropped) keep their poison. */
            for (int r = 0; r < rows; r++)
                if (!written[r])
                    for (int j = 0; j < n; j++) CHECK_EQ(c16[(size_t)r * n + j], 0xffff);
            free(written);
            /* Rows not kept (padding, past gu_rows) keep their poison. */
            int gu_poison_lost = 0;
            if (keep)
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < 2 * n_out && !kept[r]; j++)
                        gu_poison_lost += gu16[(size_t)r * 2 * n_out + j] != 0xffff;
            free(kept);
            printf("%-26s %-6s store %-11s: worst row relative error %.2e%s\n", names[mode],
                   store == COMETI_GEMM_STORE_DIRECT ? "direct" : "TMA", pingpong ? "ping-pong" : "cooperative", worst,
                   keep ? ", gate and up kept" : "");
            CHECK(worst < 1e-2);
            CHECK_EQ(gu_bad, 0);
            CHECK_EQ(gu_poison_lost, 0);
        }
    }
    free(a16), free(b16), free(c16), free(gate16), free(up16), free(af), free(bf), free(scale), free(index);
    free(ragged16), free(trace_host), free(gu16);
    cudaFree(a), cudaFree(b), cudaFree(gate), cudaFree(up), cudaFree(c), cudaFree(d_scale), cudaFree(d_index);
    cudaFree(ragged), cudaFree(trace), cudaFree(gu_mem);
    cudaFree(segs);
    return 0;
}

int test_gpu_gemm_epilogues(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, gemm_epilogue_rank, &seed, 110);
}
