/*
 * test_forward.c - the public comet_moe_forward on the fused path: against the baseline
 * and float64 with EP, AUTO's choice of path, 100,000 calls with no drift and no growth of
 * memory, and the fused forward captured in a CUDA graph and replayed, on one rank per GPU,
 * up to two (skipping without a GPU); the same with TP 2 (against float64, 2000 calls) on
 * two GPUs (skipping with fewer).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "../harness/launch.h"
#include "testutil.h"
#include "gpu_util.h"

/* ---- the public forward on the fused path ---- */

/* comet_moe_forward with COMET_IMPL_FUSED (and AUTO) against the baseline and float64 on
 * every case; then an ffn whose last SwiGLU tile is half full (192 per rank) against the
 * baseline, with AUTO taking the fused path; then a config the fused path cannot run
 * (top_k 9 > 8): FUSED refused with a message naming the field, AUTO runs the baseline. */
static int forward_vs_baseline(const cometi_rank_ctx_t *ctx, uint64_t seed, int tp)
{
    fixture_t fx;
    const fixture_shape_t shape = {256, 0, 0, 0, tp};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    const int H = fx.cfg.hidden, M = fx.cfg.max_tokens, me = ctx->rank;
    uint16_t *want = malloc((size_t)M * H * 2), *got = malloc((size_t)M * H * 2), *again = malloc((size_t)M * H * 2);
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        comet_status_t st;
        double base_err;
        if (run_case(&fx, &cases[ci], seed + ci, 0, &st, &base_err)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);
        const int m = cases[ci].tokens[me % 2];
        CUDA_OK(cudaMemcpy(want, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        comet_moe_args_t a = fused_args(&fx, &cases[ci]);
        for (int pass = 0; pass < 2; pass++) {
            a.impl = pass ? COMET_IMPL_AUTO : COMET_IMPL_FUSED;
            CUDA_OK(cudaMemset(fx.d_y, 0xff, (size_t)M * H * 2));
            st = comet_moe_forward(fx.moe, &a, 0);
            if (st != COMET_SUCCESS) printf("rank %d %s: %s\n", me, cases[ci].name, comet_moe_last_error(fx.moe));
            CHECK_EQ(st, COMET_SUCCESS);
            CUDA_OK(cudaDeviceSynchronize());
            CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
            CUDA_OK(cudaMemcpy(pass ? again : got, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        }
        CHECK(memcmp(got, again, (size_t)m * H * 2) == 0); /* AUTO took the fused path: the same bits */
        double num = 0, den = 0, row = 0, rnum = 0, rden = 0, rrow = 0;
        add_error(got, want, NULL, (size_t)m, H, &num, &den, &row);
        if (m > 0) add_error(got, NULL, fx.ref, (size_t)m, H, &rnum, &rden, &rrow);
        const double err = den > 0 ? sqrt(num / den) : sqrt(num), ref_err = rden > 0 ? sqrt(rnum / rden) : 0;
        printf("rank %d tp %d %-34s fused against the baseline %.2e, against float64 %.2e (baseline %.2e)\n", me,
               tp, cases[ci].name, err, ref_err, base_err);
        if (!(err < 1e-2) || !(row < 3e-2) || !(ref_err < 1e-2) || !(rrow < 3e-2) || !(base_err < 1e-2)) return 1;
    }
    /* Two more ffns per rank, each on a second layer over the same communicator (an NCCL
     * unique id serves one communicator only), with weights of its own: 192, a half-full
     * last SwiGLU tile; 2048, a GEMM1 long enough along k (32 steps) for its last wave to
     * be cut (gemm/gemm.h, tail_ws). */
    comet_moe_config_t cfg = fx.cfg;
    comet_moe_t moe2;
    comet_moe_args_t a;
    const int per_rank_ffn[2] = {192, 2048};
    for (int fi = 0; fi < 2; fi++) {
        const int f = per_rank_ffn[fi];
        cfg = fx.cfg;
        cfg.ffn = f * tp;
        CHECK_EQ(comet_moe_create(fx.comm, &cfg, &moe2), COMET_SUCCESS);
        a = fused_args(&fx, &cases[1]); /* random routing, 300 and 77 tokens */
        const int m = cases[1].tokens[me % 2];
        void *gu2, *dn2;
        const size_t slice = (size_t)fx.per * f * H;
        CUDA_OK(cudaMalloc(&gu2, 2 * 2 * slice));
        CUDA_OK(cudaMalloc(&dn2, 2 * slice));
        CUDA_OK(cometi_fill_hash_bf16(gu2, 2 * slice, seed ^ 0x51, (uint64_t)me * 2 * slice, (float)(1.0 / sqrt(H)), 0));
        CUDA_OK(cometi_fill_hash_bf16(dn2, slice, seed ^ 0x52, (uint64_t)me * slice, (float)(1.0 / sqrt((double)f)), 0));
        a.weights.gate_up = gu2, a.weights.gate = a.weights.up = NULL, a.weights.down = dn2;
        uint16_t *outs[3] = {want, got, again};
        const comet_impl_t impls[3] = {COMET_IMPL_BASELINE, COMET_IMPL_FUSED, COMET_IMPL_AUTO};
        for (int pass = 0; pass < 3; pass++) {
            a.impl = impls[pass];
            CUDA_OK(cudaMemset(fx.d_y, 0xff, (size_t)M * H * 2));
            comet_status_t st = comet_moe_forward(moe2, &a, 0);
            if (st != COMET_SUCCESS) printf("rank %d ffn %d: %s\n", me, cfg.ffn, comet_moe_last_error(moe2));
            CHECK_EQ(st, COMET_SUCCESS);
            CUDA_OK(cudaDeviceSynchronize());
            CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
            CUDA_OK(cudaMemcpy(outs[pass], fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        }
        CHECK(memcmp(got, again, (size_t)m * H * 2) == 0); /* AUTO took the fused path */
        double num = 0, den = 0, row = 0;
        add_error(got, want, NULL, (size_t)m, H, &num, &den, &row);
        const double err = den > 0 ? sqrt(num / den) : sqrt(num);
        printf("rank %d tp %d: ffn %d (%d per rank%s): fused against the baseline %.2e\n", me, tp, cfg.ffn, f,
               fi ? ", GEMM1's last wave cut" : ", a half-full last SwiGLU tile", err);
        if (!(err < 1e-2) || !(row < 3e-2)) return 1;
        CHECK_EQ(comet_moe_destroy(moe2), COMET_SUCCESS);
        cudaFree(gu2), cudaFree(dn2);
    }
    /* top_k 9 of 16 experts: more choices than the fused combine sums (8). Routing with 9
     * choices, weights again arbitrary (the first layer's buffers read as 16 experts of F
     * 64 x tp per rank: they fit). */
    cfg = fx.cfg;
    cfg.num_experts = 16, cfg.top_k = 9, cfg.ffn = 64 * tp;
    CHECK_EQ(comet_moe_create(fx.comm, &cfg, &moe2), COMET_SUCCESS);
    int32_t *ids9, *h_ids = malloc(sizeof(int32_t) * 64 * 9);
    float *w9, *h_w = malloc(sizeof(float) * 64 * 9);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, 64, 9, 16, seed, me, h_ids, h_w);
    CUDA_OK(cudaMalloc((void **)&ids9, sizeof(int32_t) * 64 * 9));
    CUDA_OK(cudaMalloc((void **)&w9, sizeof(float) * 64 * 9));
    CUDA_OK(cudaMemcpy(ids9, h_ids, sizeof(int32_t) * 64 * 9, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(w9, h_w, sizeof(float) * 64 * 9, cudaMemcpyHostToDevice));
    a = fused_args(&fx, &cases[0]);
    a.num_tokens = 64, a.topk_ids = ids9, a.topk_weights = w9;
    a.impl = COMET_IMPL_FUSED;
    CHECK_EQ(comet_moe_forward(moe2, &a, 0), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(comet_moe_last_error(moe2), "config.top_k = 9");
    char refused[COMETI_ERR_LEN];
    snprintf(refused, sizeof(refused), "%s", comet_moe_last_error(moe2));
    for (int pass = 0; pass < 2; pass++) {
        a.impl = pass ? COMET_IMPL_AUTO : COMET_IMPL_BASELINE;
        CUDA_OK(cudaMemset(fx.d_y, 0xff, (size_t)M * H * 2));
        CHECK_EQ(comet_moe_forward(moe2, &a, 0), COMET_SUCCESS);
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(pass ? again : got, fx.d_y, (size_t)64 * H * 2, cudaMemcpyDeviceToHost));
    }
    CHECK(memcmp(got, again, (size_t)64 * H * 2) == 0); /* AUTO ran the baseline */
    printf("rank %d: top_k 9: FUSED refused (%s); AUTO gave the baseline's bits\n", me, refused);
    CHECK_EQ(comet_moe_destroy(moe2), COMET_SUCCESS);
    cudaFree(ids9), cudaFree(w9), free(h_ids), free(h_w);
    free(want), free(got), free(again);
    fixture_close(&fx);
    return 0;
}

static int forward_fused_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    return forward_vs_baseline(ctx, *(uint64_t *)arg, 1);
}

int test_gpu_forward_fused_matches_baseline(void) { return launch_seeded(forward_fused_rank, 280); }

/* EP = 1, TP = 2: each rank holds half of every expert's ffn columns; both paths
 * against float64 on every case, the fused one against the baseline too. Two ranks: at
 * world 1 TP = world would be TP 1, the EP test again. */
static int forward_tp_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    return forward_vs_baseline(ctx, *(uint64_t *)arg, ctx->nranks);
}

int test_gpu_forward_tp_matches_reference(void) { return launch_two_seeded(forward_tp_rank, 280); }

/* ---- 100,000 calls: changing routing and token counts, no drift, no leaks ---- */

static int forward_calls_tp = 1; /* set before the ranks fork */

static int forward_calls_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    uint64_t rng = seed * 7 + 5;
    fixture_t fx;
    const fixture_shape_t shape = {256, 0, 0, 0, forward_calls_tp};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    fx.skip_reference = 1;
    const int H = fx.cfg.hidden, M = fx.cfg.max_tokens, k = fx.cfg.top_k, E = fx.cfg.num_experts, me = ctx->rank;
    int32_t *ids = malloc(sizeof(int32_t) * M * k);
    float *w = malloc(sizeof(float) * M * k);
    uint16_t *want = malloc((size_t)M * H * 2), *got = malloc((size_t)M * H * 2);
    void *y_fused;
    CUDA_OK(cudaMalloc(&y_fused, (size_t)M * H * 2));
    /* Growth is summed over the stretches where only the fused path ran: the baseline's
     * checks load cuBLAS kernels lazily, shape by shape, which is not the fused path's leak. */
    memory_mark_t stretch = {0, 0}, now;
    long long device_growth = 0;
    long host_growth_pages = 0;
    int measuring = 0;
    double worst = 0;
    const int calls = forward_calls_tp > 1 ? 2000 : 100000;
    for (int call = 0; call < calls; call++) {
        /* Both ranks draw the same token counts and routing kind; each its own routing. */
        const int tokens[2] = {(int)(cometi_rand_next(&rng) % (M + 1)), (int)(cometi_rand_next(&rng) % (M + 1))};
        const cometi_routing_t kind = (cometi_routing_t)(cometi_rand_next(&rng) % 4);
        const int m = tokens[me % 2];
        cometi_make_routing(kind, kind == COMETI_ROUTING_ONE_EXPERT ? (double)(call % E) : 8.0, m, k, E, seed + call,
                            me, ids, w);
        CUDA_OK(cudaMemcpy(fx.d_ids, ids, sizeof(int32_t) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(fx.d_w, w, sizeof(float) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cometi_fill_hash_bf16(fx.d_x, (size_t)m * H, seed + call, (uint64_t)me * M * H, 1.0f, 0));
        comet_moe_args_t a = COMET_MOE_ARGS_INIT;
        a.num_tokens = m;
        a.x = fx.d_x;
        a.topk_ids = fx.d_ids;
        a.topk_weights = fx.d_w;
        a.weights.gate_up = fx.d_gate_up;
        a.weights.down = fx.d_down;
        a.y = y_fused;
        a.impl = COMET_IMPL_FUSED;
        const int check = call % 250 == 249;
        if (check) CUDA_OK(cudaMemset(y_fused, 0xff, (size_t)M * H * 2));
        comet_status_t st = comet_moe_forward(fx.moe, &a, 0);
        if (st != COMET_SUCCESS) printf("call %d: %s\n", call, comet_moe_last_error(fx.moe));
        CHECK_EQ(st, COMET_SUCCESS);
        if (check) {
            if (measuring) { /* close the fused-only stretch before the baseline runs */
                CHECK_EQ(memory_mark(&now), 0);
                device_growth += now.device_used - stretch.device_used;
                host_growth_pages += now.host_pages - stretch.host_pages;
            }
            a.impl = COMET_IMPL_BASELINE;
            a.y = fx.d_y;
            CHECK_EQ(comet_moe_forward(fx.moe, &a, 0), COMET_SUCCESS);
            CUDA_OK(cudaDeviceSynchronize());
            CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
            CUDA_OK(cudaMemcpy(want, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(got, y_fused, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
            double num = 0, den = 0, row = 0;
            add_error(got, want, NULL, (size_t)m, H, &num, &den, &row);
            const double e = den > 0 ? sqrt(num / den) : sqrt(num);
            if (!(e <= worst)) worst = e;
            if (!(e < 1e-2) || !(row < 3e-2)) {
                printf("call %d (%d tokens, routing %d): fused against the baseline %.3g (worst row %.3g)\n", call,
                       m, (int)kind, e, row);
                return 1;
            }
            if (measuring) CHECK_EQ(memory_mark(&stretch), 0);
        }
        if (call == 99) { /* the first calls load the fused kernels: measure from here */
            CHECK_EQ(memory_mark(&stretch), 0);
            measuring = 1;
        }
    }
    CHECK_EQ(memory_mark(&now), 0);
    device_growth += now.device_used - stretch.device_used;
    host_growth_pages += now.host_pages - stretch.host_pages;
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    const long page_kb = sysconf(_SC_PAGESIZE) / 1024;
    printf("rank %d, tp %d: %d calls, fused against the baseline every 250th: worst %.2e; growth over the %d fused "
           "calls after call 100 (baseline checks excluded): device %lld KiB, host resident %ld KiB\n", me,
           forward_calls_tp, calls, worst, calls - 100, device_growth >> 10, host_growth_pages * page_kb);
    /* Nothing may grow with the calls: the fused path allocates nothing per call. The
     * slack is one 2 MiB granule of the driver's device pools and 1 MiB of host heap
     * (malloc's arenas move in 128 KiB steps), while a leak of 32 device bytes or 16 host
     * bytes per call over the 99,900 measured calls would pass 3.0 MiB and 1.5 MiB. */
    CHECK(device_growth <= (2ll << 20));
    CHECK(host_growth_pages * page_kb <= 1024);
    free(ids), free(w), free(want), free(got);
    cudaFree(y_fused);
    fixture_close(&fx);
    return 0;
}

int test_gpu_forward_100000_calls(void)
{
    forward_calls_tp = 1;
    return launch_seeded(forward_calls_rank, 280);
}

/* The same with EP 1 x TP 2, 2000 calls (two ranks: tp_size 2 must divide the world). */
int test_gpu_forward_tp_2000_calls(void)
{
    forward_calls_tp = 2;
    return launch_two_seeded(forward_calls_rank, 280);
}

/* ---- the fused forward captured in a CUDA graph and replayed ---- */

/* One fused call (it creates the buffers: no allocation may be captured), then one call
 * captured and replayed five times with new inputs in the same buffers: each replay's y
 * against the baseline on those inputs. Replays count on the device (the route's call
 * counter is in device memory), so the captured arguments stay right. */
static int graph_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 0, 0, 0, 1};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    fx.skip_reference = 1;
    const int H = fx.cfg.hidden, M = fx.cfg.max_tokens, me = ctx->rank;
    moe_case_t c = cases[1]; /* random routing, token counts not multiples of 128 */
    const int m = c.tokens[me % 2];
    uint16_t *want = malloc((size_t)M * H * 2), *got = malloc((size_t)M * H * 2);
    void *y_fused;
    CUDA_OK(cudaMalloc(&y_fused, (size_t)M * H * 2));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    comet_status_t st;
    double err;
    if (run_case(&fx, &c, seed, 0, &st, &err)) return 1; /* inputs in place */
    comet_moe_args_t a = fused_args(&fx, &c);
    a.y = y_fused;
    a.impl = COMET_IMPL_FUSED;
    COMET_OK(comet_moe_forward(fx.moe, &a, s), fx.comm); /* warm-up: creates the buffers */
    CUDA_OK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    st = comet_moe_forward(fx.moe, &a, s);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    if (st != COMET_SUCCESS) printf("captured call: %s\n", comet_moe_last_error(fx.moe));
    CHECK_EQ(st, COMET_SUCCESS);
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    double worst = 0;
    for (int replay = 0; replay < 5; replay++) {
        /* New inputs (same token counts): the baseline writes its y into fx.d_y. */
        if (run_case(&fx, &c, seed + 1000 + replay, 0, &st, &err)) return 1;
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaMemcpy(want, fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemset(y_fused, 0xff, (size_t)M * H * 2));
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
        CUDA_OK(cudaMemcpy(got, y_fused, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0, row = 0;
        add_error(got, want, NULL, (size_t)m, H, &num, &den, &row);
        const double e = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(e <= worst)) worst = e;
        if (!(e < 1e-2) || !(row < 3e-2)) {
            printf("replay %d: against the baseline %.3g (worst row %.3g)\n", replay, e, row);
            return 1;
        }
    }
    printf("rank %d: 5 replays of a captured fused forward, against the baseline: worst %.2e\n", me, worst);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    cudaFree(y_fused);
    free(want), free(got);
    fixture_close(&fx);
    return 0;
}

int test_gpu_forward_graph_replay(void) { return launch_seeded(graph_rank, 110); }

/* ---- destroy with a peer gone: a status within the timeout, not a hang (two GPUs) ---- */

static int destroy_missing_peer_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const moe_case_t c = {"destroy", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    comet_moe_args_t a; /* the fused path's: its windows' deregistration is collective */
    if (fixture_open_timed(&fx, ctx, seed, &c, &a)) return 1;
    comet_status_t st;
    COMET_OK(comet_moe_forward(fx.moe, &a, 0), fx.comm);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    /* Rank 1 stops answering: it waits on a flag nobody raises (and times out there). */
    if (ctx->rank == 1) {
        COMET_OK(cometi_wait_flag(fx.comm, 3, 1, 0), fx.comm);
        CUDA_OK(cudaDeviceSynchronize());
    }
    const double t0 = now_s();
    st = comet_moe_destroy(fx.moe);
    const double took = now_s() - t0;
    fx.moe = NULL;
    printf("rank %d: comet_moe_destroy gave %s in %.3f s: %s\n", ctx->rank, comet_status_string(st), took,
           comet_last_create_error());
    CHECK(st == COMET_TIMEOUT || st == COMET_REMOTE_ERROR);
    CHECK(took < 5.0);
    st = comet_comm_destroy(fx.comm);
    CHECK(st == COMET_TIMEOUT || st == COMET_REMOTE_ERROR);
    fx.comm = NULL;
    return 0;
}

int test_gpu_moe_destroy_missing_peer(void) { return launch_two_seeded(destroy_missing_peer_rank, 100); }
