/*
 * test_training.c - training steps through comet.h on the GPU, the fused path against the
 * sequential one: 1,000 steps with changing routing and token counts (no drift, no
 * growth), and gpt-oss-120b's shape (hidden = ffn = 2880, off the 256 grid, 128 experts,
 * top-4) at full size. Any world size (one GPU: world 1). Tolerances: train_util.h. And,
 * on the CPU, which layers the fused path trains.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "layer/fused.h"
#include "../harness/data.h"
#include "testutil.h"
#include "gpu_util.h"
#include "train_util.h"

/* ---- which layers the fused path trains (no GPU: the handles are only read) ---- */

/* gate_up in one tensor, at any world the fused forward runs (the training forward keeps
 * no expert outputs, so it needs no push): else COMET_NOT_SUPPORTED (COMET_IMPL_AUTO then
 * trains on the sequential path) with the reason. */
int test_fused_training_layers(void)
{
    struct comet_comm comm;
    struct comet_moe moe;
    memset(&comm, 0, sizeof(comm));
    memset(&moe, 0, sizeof(moe));
    moe.comm = &comm;
    comet_moe_weights_t w;
    memset(&w, 0, sizeof(w));
    w.gate_up = w.down = (void *)(uintptr_t)4096;
    comm.size = COMETI_PUSH_MAX_RANKS + 1;
    CHECK_EQ(cometi_fused_train_supported(&moe, &w), COMET_SUCCESS);
    comm.size = 2;
    w.gate_up = NULL, w.gate = w.up = (void *)(uintptr_t)4096;
    CHECK_EQ(cometi_fused_train_supported(&moe, &w), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(moe.err, "weights.gate and weights.up apart");
    return 0;
}

/* ---- 1,000 training steps: changing routing and token counts, no drift, no growth ---- */

static int training_steps_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    uint64_t rng = seed * 13 + 3;
    fixture_t fx;
    const fixture_shape_t shape = {256, 512, 0, 0, 0}; /* dW2 of 4 row tiles */
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    const int H = fx.cfg.hidden, F = fx.cfg.ffn, M = fx.cfg.max_tokens, k = fx.cfg.top_k, E = fx.cfg.num_experts,
              per = fx.per, me = ctx->rank;
    const size_t n_grads = (size_t)per * 3 * F * H; /* gate_up, then down */
    uint16_t *g_fused = malloc(n_grads * 2), *g_seq = malloc(n_grads * 2);
    size_t grads_equal = 0, grads_compared = 0;
    double grads_worst = 0;
    int32_t *ids = malloc(sizeof(int32_t) * M * k);
    float *w = malloc(sizeof(float) * M * k);
    uint16_t *want = malloc((size_t)M * H * 2), *got = malloc((size_t)M * H * 2);
    void *d_dy, *d_dx, *d_dx_seq, *g_gu, *g_dn;
    float *d_dw, *d_dw_seq, *dw_fused = malloc(sizeof(float) * M * k), *dw_seq = malloc(sizeof(float) * M * k);
    size_t dw_equal = 0, dw_compared = 0;
    double dw_worst = 0;
    CUDA_OK(cudaMalloc(&d_dy, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc(&d_dx, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc(&d_dx_seq, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc((void **)&d_dw, sizeof(float) * M * k));
    CUDA_OK(cudaMalloc((void **)&d_dw_seq, sizeof(float) * M * k));
    CUDA_OK(cudaMalloc(&g_gu, n_grads * 2));
    g_dn = (char *)g_gu + (size_t)per * 2 * F * H * 2;
    void *g_seq_dev;
    CUDA_OK(cudaMalloc(&g_seq_dev, n_grads * 2));
    /* The fused steps' saved state over memory of the test's own (a framework's allocator). */
    comet_moe_saved_t saved, saved_seq;
    size_t bytes = 0;
    CHECK_EQ(comet_moe_saved_bytes(fx.moe, NULL, &bytes), COMET_SUCCESS);
    void *memory;
    CUDA_OK(cudaMalloc(&memory, bytes));
    CHECK_EQ(comet_moe_saved_create_in(fx.moe, NULL, memory, bytes - 1, &saved), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "comet_moe_saved_bytes");
    CHECK_EQ(comet_moe_saved_create_in(fx.moe, NULL, (char *)memory + 16, bytes, &saved), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "256-byte aligned");
    CHECK_EQ(comet_moe_saved_create_in(fx.moe, NULL, NULL, bytes, &saved), COMET_INVALID_ARGUMENT);
    CHECK_EQ(comet_moe_saved_create_in(fx.moe, NULL, memory, bytes, &saved), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_create(fx.moe, NULL, &saved_seq), COMET_SUCCESS);
    /* Growth is summed over the stretches where only the fused path ran (the sequential
     * checks load cuBLAS kernels lazily, shape by shape). The fused path allocates nothing
     * per call, so its device memory may not grow at all; host pages may float by glibc's
     * trim threshold (128 KiB) twice over, which a leak of 300 bytes a step would pass. */
    const int steps = 1000, every = 50;
    memory_mark_t stretch = {0, 0}, now;
    long long dev_growth = 0;
    long page_growth = 0;
    double worst = 0;
    for (int step = 0; step < steps; step++) {
        const int tokens[2] = {(int)(cometi_rand_next(&rng) % (M + 1)), (int)(cometi_rand_next(&rng) % (M + 1))};
        const cometi_routing_t kind = (cometi_routing_t)(cometi_rand_next(&rng) % 4);
        const int m = tokens[me % 2];
        cometi_make_routing(kind, kind == COMETI_ROUTING_ONE_EXPERT ? (double)(step % E) : 8.0, m, k, E, seed + step,
                            me, ids, w);
        CUDA_OK(cudaMemcpy(fx.d_ids, ids, sizeof(int32_t) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(fx.d_w, w, sizeof(float) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cometi_fill_hash_bf16(fx.d_x, (size_t)m * H, seed + step, (uint64_t)me * M * H, 1.0f, 0));
        CUDA_OK(cometi_fill_hash_bf16(d_dy, (size_t)m * H, seed + step + 7777, (uint64_t)me * M * H, 1.0f, 0));
        const int check = step % every == every - 1;
        if (check) CUDA_OK(cudaMemset(d_dx, 0xff, (size_t)M * H * 2));
        comet_status_t st = train_step(&fx, saved, COMET_IMPL_FUSED, m, d_dy, d_dx, d_dw, g_gu, g_dn);
        if (st != COMET_SUCCESS) printf("step %d: %s\n", step, comet_moe_last_error(fx.moe));
        CHECK_EQ(st, COMET_SUCCESS);
        if (!check) continue;
        if (step > every) {
            CHECK_EQ(memory_mark(&now), 0);
            dev_growth += now.device_used - stretch.device_used;
            page_growth += now.host_pages - stretch.host_pages;
        }
        CHECK_EQ(train_step(&fx, saved_seq, COMET_IMPL_BASELINE, m, d_dy, d_dx_seq, d_dw_seq, g_seq_dev,
                            (char *)g_seq_dev + (size_t)per * 2 * F * H * 2), COMET_SUCCESS);
        CUDA_OK(cudaDeviceSynchronize());
        CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
        /* The weight gradients too, element by element (the fused path's GEMMs sum in the
         * order cuBLAS does here, so most come out bit-equal). */
        CUDA_OK(cudaMemcpy(g_fused, g_gu, n_grads * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(g_seq, g_seq_dev, n_grads * 2, cudaMemcpyDeviceToHost));
        char who[96];
        snprintf(who, sizeof(who), "step %d (%d tokens, routing %d), fused against sequential", step, m, (int)kind);
        if (compare_grads(who, g_fused, g_seq, (size_t)per * 2 * F * H, n_grads, &grads_equal, &grads_worst)) return 1;
        grads_compared += n_grads;
        CUDA_OK(cudaMemcpy(want, d_dx_seq, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(got, d_dx, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0, row = 0;
        add_error(got, want, NULL, (size_t)m, H, &num, &den, &row);
        const double e = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(e <= worst)) worst = e;
        if (!(e < NORM_TOL) || !(row < 3e-2)) {
            printf("step %d (%d tokens, routing %d): fused dx against the sequential %.3g (worst row %.3g)\n", step,
                   m, (int)kind, e, row);
            return 1;
        }
        /* d topk_weights, element by element: SELF_TOL of itself and ELEM_TOL of the RMS
         * (the two paths run the same arithmetic, so most come out bit-equal on one GPU). */
        CUDA_OK(cudaMemcpy(dw_fused, d_dw, sizeof(float) * m * k, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dw_seq, d_dw_seq, sizeof(float) * m * k, cudaMemcpyDeviceToHost));
        double ss = 0;
        for (int i = 0; i < m * k; i++) ss += (double)dw_seq[i] * dw_seq[i];
        const double rms = m ? sqrt(ss / (m * k)) : 0;
        for (int i = 0; i < m * k; i++) {
            const double d = fabs((double)dw_fused[i] - dw_seq[i]);
            if (!(d <= SELF_TOL * fabs(dw_seq[i]) + ELEM_TOL * rms)) {
                printf("step %d (%d tokens, routing %d): d topk_weights[%d] fused %g, sequential %g\n", step, m,
                       (int)kind, i, dw_fused[i], dw_seq[i]);
                return 1;
            }
            if (rms > 0 && d / rms > dw_worst) dw_worst = d / rms;
            dw_equal += memcmp(&dw_fused[i], &dw_seq[i], sizeof(float)) == 0;
        }
        dw_compared += (size_t)m * k;
        CHECK_EQ(memory_mark(&stretch), 0);
    }
    const long page_kb = sysconf(_SC_PAGESIZE) / 1024;
    printf("rank %d: %d fused training steps, against the sequential path every %dth: dx worst %.2e, weight "
           "gradients worst |diff| / RMS %.2e (%zu of %zu elements bit-equal), d topk_weights worst %.2e (%zu of "
           "%zu bit-equal); growth over the fused stretches after step %d: device %lld bytes, host resident %ld "
           "KiB\n", me, steps, every, worst, grads_worst, grads_equal, grads_compared, dw_worst, dw_equal,
           dw_compared, every, dev_growth, page_growth * page_kb);
    CHECK(dev_growth == 0);
    CHECK(page_growth * page_kb <= 256);
    CHECK_EQ(comet_moe_saved_destroy(saved), COMET_SUCCESS);
    CUDA_OK(cudaFree(memory)); /* the caller's: destroy left it */
    CHECK_EQ(comet_moe_saved_destroy(saved_seq), COMET_SUCCESS);
    free(ids), free(w), free(want), free(got), free(g_fused), free(g_seq), free(dw_fused), free(dw_seq);
    cudaFree(d_dy), cudaFree(d_dx), cudaFree(d_dx_seq), cudaFree(d_dw), cudaFree(d_dw_seq), cudaFree(g_gu),
        cudaFree(g_seq_dev);
    fixture_close(&fx);
    return 0;
}

int test_gpu_training_1000_steps(void) { return launch_seeded(training_steps_rank, 280); }

/* ---- one layer handle for several model layers of its shape ---- */

/* A model layer's tensors on one rank: its expert weights, a step's inputs, its outputs. */
typedef struct model_layer {
    void *gate_up, *down, *x, *dy, *y, *dx, *g_gu, *g_dn;
    int32_t *ids;
    float *w, *dw;
    comet_moe_saved_t saved;
    size_t n_y, n_dw, n_g; /* bytes of y (and dx), d topk_weights, the weight gradients */
} model_layer_t;

static comet_moe_args_t layer_args(const model_layer_t *L, int m, comet_impl_t impl)
{
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = m;
    a.x = L->x, a.topk_ids = L->ids, a.topk_weights = L->w, a.y = L->y;
    a.weights.gate_up = L->gate_up, a.weights.down = L->down;
    a.impl = impl;
    return a;
}

static comet_moe_backward_args_t layer_backward_args(const model_layer_t *L, comet_impl_t impl)
{
    comet_moe_backward_args_t b = COMET_MOE_BACKWARD_ARGS_INIT;
    b.saved = L->saved, b.dy = L->dy, b.dx = L->dx, b.d_topk_weights = L->dw;
    b.weights.gate_up = L->gate_up, b.weights.down = L->down;
    b.grads.gate_up = L->g_gu, b.grads.down = L->g_dn;
    b.impl = impl;
    return b;
}

/* y, dx, d topk_weights and the weight gradients of a layer, copied to the host after the
 * device is idle, each poisoned again for the next run. */
static int layer_outputs(const model_layer_t *L, unsigned char *host)
{
    CUDA_OK(cudaDeviceSynchronize());
    void *dev[4] = {L->y, L->dx, L->dw, L->g_gu};
    const size_t n[4] = {L->n_y, L->n_y, L->n_dw, L->n_g};
    for (int i = 0; i < 4; i++) {
        CUDA_OK(cudaMemcpy(host, dev[i], n[i], cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemset(dev[i], 0xff, n[i]));
        host += n[i];
    }
    return 0;
}

/* Bytes layer_outputs copies: y, dx, d topk_weights, the weight gradients. */
static size_t layer_bytes(const model_layer_t *L) { return L->n_y * 2 + L->n_dw + L->n_g; }

/* A model layer of fx's shape with m tokens on this rank: its weights, inputs and routing
 * from seed s, its outputs poisoned, its saved state of fx's handle. */
static int layer_open(model_layer_t *L, const fixture_t *fx, int m, uint64_t s, cometi_routing_t routing)
{
    const int H = fx->cfg.hidden, F = fx->cfg.ffn, M = fx->cfg.max_tokens, k = fx->cfg.top_k,
              E = fx->cfg.num_experts, per = fx->per, me = fx->ctx->rank;
    L->n_y = (size_t)m * H * 2, L->n_dw = sizeof(float) * m * k, L->n_g = (size_t)per * 3 * F * H * 2;
    void **bufs[] = {&L->gate_up, &L->down, &L->x, &L->dy, &L->y, &L->dx, &L->g_gu, (void **)&L->ids,
                     (void **)&L->w, (void **)&L->dw};
    const size_t sizes[] = {(size_t)per * 2 * F * H * 2, (size_t)per * H * F * 2, L->n_y, L->n_y, L->n_y, L->n_y,
                            L->n_g, sizeof(int32_t) * m * k, L->n_dw, L->n_dw};
    for (int i = 0; i < 10; i++) CUDA_OK(cudaMalloc(bufs[i], sizes[i]));
    L->g_dn = (char *)L->g_gu + (size_t)per * 2 * F * H * 2;
    CUDA_OK(cometi_fill_hash_bf16(L->gate_up, (size_t)per * 2 * F * H, s, 0, (float)(1.0 / sqrt(H)), 0));
    CUDA_OK(cometi_fill_hash_bf16(L->down, (size_t)per * H * F, s + 1, 0, (float)(1.0 / sqrt(F)), 0));
    CUDA_OK(cometi_fill_hash_bf16(L->x, (size_t)m * H, s + 2, (uint64_t)me * M * H, 1.0f, 0));
    CUDA_OK(cometi_fill_hash_bf16(L->dy, (size_t)m * H, s + 3, (uint64_t)me * M * H, 1.0f, 0));
    int32_t *ids = malloc(sizeof(int32_t) * m * k);
    float *w = malloc(sizeof(float) * m * k);
    cometi_make_routing(routing, 8.0, m, k, E, s, me, ids, w);
    CUDA_OK(cudaMemcpy(L->ids, ids, sizeof(int32_t) * m * k, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(L->w, w, sizeof(float) * m * k, cudaMemcpyHostToDevice));
    free(ids), free(w);
    void *outs[] = {L->y, L->dx, L->dw, L->g_gu};
    const size_t n_outs[] = {L->n_y, L->n_y, L->n_dw, L->n_g};
    for (int i = 0; i < 4; i++) CUDA_OK(cudaMemset(outs[i], 0xff, n_outs[i]));
    CHECK_EQ(comet_moe_saved_create(fx->moe, NULL, &L->saved), COMET_SUCCESS);
    return 0;
}

static int layer_close(model_layer_t *L)
{
    CHECK_EQ(comet_moe_saved_destroy(L->saved), COMET_SUCCESS);
    void *bufs[] = {L->gate_up, L->down, L->x, L->dy, L->y, L->dx, L->g_gu, L->ids, L->w, L->dw};
    for (int i = 0; i < 10; i++) cudaFree(bufs[i]);
    return 0;
}

/* Two model layers of one shape, with their own weights, inputs and saved states, through
 * one comet_moe_t in a model's order (forward A, forward B, backward B, backward A): every
 * output and gradient bit-equal to a step of that layer alone, on both paths. Weights come
 * with each call and the handle's buffers are workspaces that no later call reads from. */
static int shared_handle_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 320, 0, 0, 0};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    const int me = ctx->rank;
    const int m = fx.cfg.max_tokens - 3 * me - 1; /* odd, and the ranks' counts differ */
    model_layer_t layers[2];
    size_t total = 0;
    for (int l = 0; l < 2; l++) {
        if (layer_open(&layers[l], &fx, m, seed + 1000 * (uint64_t)(l + 1),
                       l ? COMETI_ROUTING_SKEWED : COMETI_ROUTING_RANDOM))
            return 1;
        total = layer_bytes(&layers[l]);
    }
    unsigned char *together = malloc(2 * total), *alone = malloc(2 * total);
    const comet_impl_t impls[2] = {COMET_IMPL_FUSED, COMET_IMPL_BASELINE};
    for (int p = 0; p < 2; p++) {
        const comet_impl_t impl = impls[p];
        /* The model's order, twice (the second time over the first's buffers). */
        for (int round = 0; round < 2; round++) {
            for (int l = 0; l < 2; l++) {
                const comet_moe_args_t a = layer_args(&layers[l], m, impl);
                COMET_OK(comet_moe_forward_train(fx.moe, &a, layers[l].saved, 0), fx.comm);
            }
            for (int l = 1; l >= 0; l--) {
                const comet_moe_backward_args_t b = layer_backward_args(&layers[l], impl);
                COMET_OK(comet_moe_backward(fx.moe, &b, 0), fx.comm);
            }
            for (int l = 0; l < 2; l++)
                if (layer_outputs(&layers[l], together + l * total)) return 1;
        }
        /* Each layer alone. */
        for (int l = 0; l < 2; l++) {
            const comet_moe_args_t a = layer_args(&layers[l], m, impl);
            const comet_moe_backward_args_t b = layer_backward_args(&layers[l], impl);
            COMET_OK(comet_moe_forward_train(fx.moe, &a, layers[l].saved, 0), fx.comm);
            COMET_OK(comet_moe_backward(fx.moe, &b, 0), fx.comm);
            if (layer_outputs(&layers[l], alone + l * total)) return 1;
        }
        CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
        for (int l = 0; l < 2; l++) {
            const char *names[4] = {"y", "dx", "d topk_weights", "weight gradients"};
            const model_layer_t *L = &layers[l];
            const size_t n[4] = {L->n_y, L->n_y, L->n_dw, L->n_g};
            size_t at = (size_t)l * total;
            for (int i = 0; i < 4; i++) {
                if (memcmp(together + at, alone + at, n[i])) {
                    printf("rank %d, %s path, layer %d: %s through the shared handle differ from the layer alone\n",
                           me, p ? "sequential" : "fused", l, names[i]);
                    return 1;
                }
                at += n[i];
            }
        }
        /* The two layers' gradients are not each other's (the check above would pass if
         * both were left poisoned or equal). */
        CHECK(memcmp(alone, alone + total, total) != 0);
        printf("rank %d, %s path: two layers through one handle, bit-equal to each alone (%zu bytes each)\n", me,
               p ? "sequential" : "fused", total);
    }
    for (int l = 0; l < 2; l++)
        if (layer_close(&layers[l])) return 1;
    free(together), free(alone);
    fixture_close(&fx);
    return 0;
}

int test_gpu_layers_share_a_handle(void) { return launch_seeded(shared_handle_rank, 120); }

/* ---- calls from threads that are not the one that made the handle ---- */

/* The driver calls the test needs, through the runtime (nothing links libcuda). */
static void *driver_call(const char *name, int version)
{
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
        return NULL;
    return p;
}

typedef struct thread_step {
    const fixture_t *fx;
    model_layer_t *L;
    int m, device;
    comet_impl_t impl;
    int own_context;      /* make and bind a context of the thread's own before the calls */
    comet_status_t st;    /* the first call that failed, or success */
    int given_back;       /* the thread's context (its own, or none) is current again after the calls */
    char err[160];
} thread_step_t;

/* A training step in a thread that made no CUDA call before (so no context is bound, as in
 * torch's autograd threads), or that bound its own context: comet's calls must run in the
 * handle's context and give the thread's back. */
static void *thread_step_main(void *arg)
{
    thread_step_t *t = arg;
    PFN_cuCtxCreate_v3020 create = (PFN_cuCtxCreate_v3020)driver_call("cuCtxCreate", 3020);
    PFN_cuCtxDestroy_v4000 destroy = (PFN_cuCtxDestroy_v4000)driver_call("cuCtxDestroy", 4000);
    PFN_cuCtxGetCurrent_v4000 get = (PFN_cuCtxGetCurrent_v4000)driver_call("cuCtxGetCurrent", 4000);
    PFN_cuDeviceGet_v2000 device_get = (PFN_cuDeviceGet_v2000)driver_call("cuDeviceGet", 2000);
    CUcontext mine = NULL, after = NULL;
    CUdevice dev;
    t->st = COMET_SUCCESS;
    if (t->own_context && (!create || !destroy || !get || !device_get || device_get(&dev, t->device) != CUDA_SUCCESS ||
                           create(&mine, 0, dev) != CUDA_SUCCESS)) {
        t->st = COMET_CUDA_ERROR;
        snprintf(t->err, sizeof(t->err), "could not make a context of the thread's own");
        return NULL;
    }
    comet_moe_saved_t old = t->L->saved;
    const comet_moe_args_t a = layer_args(t->L, t->m, t->impl);
    comet_status_t st = comet_moe_saved_create(t->fx->moe, NULL, &t->L->saved);
    if (st == COMET_SUCCESS) st = comet_moe_forward_train(t->fx->moe, &a, t->L->saved, 0);
    if (st == COMET_SUCCESS) {
        const comet_moe_backward_args_t b = layer_backward_args(t->L, t->impl);
        st = comet_moe_backward(t->fx->moe, &b, 0);
    }
    if (st != COMET_SUCCESS) snprintf(t->err, sizeof(t->err), "%s", comet_moe_last_error(t->fx->moe));
    if (st == COMET_SUCCESS) st = comet_moe_saved_destroy(t->L->saved);
    t->L->saved = old;
    t->st = st;
    t->given_back = get && get(&after) == CUDA_SUCCESS && after == mine;
    if (mine) destroy(mine);
    return NULL;
}

/* The same training step from the calling thread, from a fresh thread with no context,
 * and from one with a context of its own: the same bits, on both paths. */
static int other_threads_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 320, 0, 0, 0};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    const int m = fx.cfg.max_tokens - 2 * ctx->rank - 1;
    int device;
    CUDA_OK(cudaGetDevice(&device));
    model_layer_t L;
    if (layer_open(&L, &fx, m, seed + 7, COMETI_ROUTING_RANDOM)) return 1;
    const size_t total = layer_bytes(&L);
    unsigned char *here = malloc(total), *there = malloc(total);
    const comet_impl_t impls[2] = {COMET_IMPL_FUSED, COMET_IMPL_BASELINE};
    for (int p = 0; p < 2; p++) {
        const comet_moe_args_t a = layer_args(&L, m, impls[p]);
        const comet_moe_backward_args_t b = layer_backward_args(&L, impls[p]);
        COMET_OK(comet_moe_forward_train(fx.moe, &a, L.saved, 0), fx.comm);
        COMET_OK(comet_moe_backward(fx.moe, &b, 0), fx.comm);
        if (layer_outputs(&L, here)) return 1;
        for (int own = 0; own < 2; own++) {
            thread_step_t t = {&fx, &L, m, device, impls[p], own, COMET_SUCCESS, 0, ""};
            pthread_t th;
            CHECK_EQ(pthread_create(&th, NULL, thread_step_main, &t), 0);
            CHECK_EQ(pthread_join(th, NULL), 0);
            if (t.st != COMET_SUCCESS) {
                printf("rank %d, %s path, a thread with %s: %s: %s\n", ctx->rank, p ? "sequential" : "fused",
                       own ? "its own context" : "no context", comet_status_string(t.st), t.err);
                return 1;
            }
            if (!t.given_back) {
                printf("rank %d: after comet's calls the thread's %s was not current again\n", ctx->rank,
                       own ? "own context" : "lack of a context");
                return 1;
            }
            if (layer_outputs(&L, there)) return 1;
            if (memcmp(here, there, total)) {
                printf("rank %d, %s path: the step from a thread with %s differs from the calling thread's\n",
                       ctx->rank, p ? "sequential" : "fused", own ? "its own context" : "no context");
                return 1;
            }
        }
        printf("rank %d, %s path: a step from a thread with no context and from one with its own, bit-equal "
               "(%zu bytes)\n", ctx->rank, p ? "sequential" : "fused", total);
    }
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    if (layer_close(&L)) return 1;
    free(here), free(there);
    fixture_close(&fx);
    return 0;
}

int test_gpu_calls_from_other_threads(void) { return launch_seeded(other_threads_rank, 120); }

/* ---- a training step captured in a CUDA graph and replayed ---- */

/* The fused training forward and its backward captured once in a CUDA graph (after an
 * eager step: no allocation may be captured), then for each of three new sets of x, dy
 * and weights in the same buffers (the token count and routing fixed in the graph): an
 * eager step, then the graph replayed; y, dx, d topk_weights and the weight gradients
 * bit-equal, each output poisoned before each run. */
static int graph_step_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 320, 0, 0, 0};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    const int m = fx.cfg.max_tokens - 2 * ctx->rank - 5, H = fx.cfg.hidden, F = fx.cfg.ffn, per = fx.per;
    model_layer_t L;
    if (layer_open(&L, &fx, m, seed + 21, COMETI_ROUTING_SKEWED)) return 1;
    const size_t total = layer_bytes(&L);
    unsigned char *eager = malloc(total), *replayed = malloc(total);
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const comet_moe_args_t a = layer_args(&L, m, COMET_IMPL_FUSED);
    const comet_moe_backward_args_t b = layer_backward_args(&L, COMET_IMPL_FUSED);
    /* s does not wait for the legacy stream, where the fills and poisons run: the device is
     * idle before each run on s. */
    CUDA_OK(cudaDeviceSynchronize());
    COMET_OK(comet_moe_forward_train(fx.moe, &a, L.saved, s), fx.comm);
    COMET_OK(comet_moe_backward(fx.moe, &b, s), fx.comm);
    if (layer_outputs(&L, eager)) return 1;
    CUDA_OK(cudaDeviceSynchronize());
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    comet_status_t st = comet_moe_forward_train(fx.moe, &a, L.saved, s);
    if (st == COMET_SUCCESS) st = comet_moe_backward(fx.moe, &b, s);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    if (st != COMET_SUCCESS) printf("rank %d, the captured step: %s\n", ctx->rank, comet_moe_last_error(fx.moe));
    CHECK_EQ(st, COMET_SUCCESS);
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; r++) {
        const uint64_t t = seed + 100 * (uint64_t)(r + 1);
        CUDA_OK(cometi_fill_hash_bf16(L.x, (size_t)m * H, t, (uint64_t)ctx->rank * fx.cfg.max_tokens * H, 1.0f, 0));
        CUDA_OK(cometi_fill_hash_bf16(L.dy, (size_t)m * H, t + 1, (uint64_t)ctx->rank * fx.cfg.max_tokens * H, 1.0f,
                                      0));
        CUDA_OK(cometi_fill_hash_bf16(L.down, (size_t)per * H * F, t + 2, 0, (float)(1.0 / sqrt(F)), 0));
        CUDA_OK(cudaDeviceSynchronize());
        COMET_OK(comet_moe_forward_train(fx.moe, &a, L.saved, s), fx.comm);
        COMET_OK(comet_moe_backward(fx.moe, &b, s), fx.comm);
        if (layer_outputs(&L, eager)) return 1;
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
        if (layer_outputs(&L, replayed)) return 1;
        if (memcmp(eager, replayed, total)) {
            printf("rank %d, replay %d: the graph's step differs from the eager one\n", ctx->rank, r);
            return 1;
        }
    }
    printf("rank %d, %d tokens: 3 replays of a captured training step (forward_train, backward), bit-equal to "
           "eager steps on new inputs (%zu bytes each)\n", ctx->rank, m, total);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    free(eager), free(replayed);
    if (layer_close(&L)) return 1;
    fixture_close(&fx);
    return 0;
}

int test_gpu_training_graph_replay(void) { return launch_seeded(graph_step_rank, 100); }

/* ---- gpt-oss-120b's shape: hidden = ffn = 2880, off the 256 grid, 128 experts, top-4 ---- */

/* The preset itself at 2048 tokens a rank (weights filled on the device: 128 experts of
 * 3 x 2880 x 2880 are 6.4 GB), the fused path against the sequential one on the same
 * inputs: the forward's y, then a training step's dx, d topk_weights and weight gradients,
 * element by element (bounds as training_steps_rank's), on random and skewed routing. */
static int gpt_oss_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    memset(&fx, 0, sizeof(fx));
    fx.ctx = ctx;
    if (open_comm(ctx, 20000, &fx.comm)) return 1;
    CHECK_EQ(comet_moe_config_preset("gpt-oss-120b", 2048, &fx.cfg), COMET_SUCCESS);
    COMET_OK(comet_moe_create(fx.comm, &fx.cfg, &fx.moe), fx.comm);
    const int W = ctx->nranks, me = ctx->rank, H = fx.cfg.hidden, F = fx.cfg.ffn, M = fx.cfg.max_tokens,
              k = fx.cfg.top_k, E = fx.cfg.num_experts, per = E / W;
    const size_t n_grads = (size_t)per * 3 * F * H, n_gu = (size_t)per * 2 * F * H;
    CUDA_OK(cudaMalloc(&fx.d_gate_up, n_gu * 2));
    CUDA_OK(cudaMalloc(&fx.d_down, (size_t)per * F * H * 2));
    CUDA_OK(cudaMalloc(&fx.d_x, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc(&fx.d_y, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc((void **)&fx.d_ids, sizeof(int32_t) * M * k));
    CUDA_OK(cudaMalloc((void **)&fx.d_w, sizeof(float) * M * k));
    /* Weights uniform in +-1/sqrt(fan-in) scaled so activations stay O(1). */
    CUDA_OK(cometi_fill_hash_bf16(fx.d_gate_up, n_gu, seed, (uint64_t)me * n_grads, 1.7f / sqrtf((float)H), 0));
    CUDA_OK(cometi_fill_hash_bf16(fx.d_down, (size_t)per * F * H, seed + 1, (uint64_t)me * n_grads,
                                  1.7f / sqrtf((float)F), 0));
    void *d_dy, *d_dx[2], *g[2];
    float *d_dw[2];
    uint16_t *y[2], *h_dx[2], *h_g[2];
    float *h_dw[2];
    CUDA_OK(cudaMalloc(&d_dy, (size_t)M * H * 2));
    for (int i = 0; i < 2; i++) {
        CUDA_OK(cudaMalloc(&d_dx[i], (size_t)M * H * 2));
        CUDA_OK(cudaMalloc((void **)&d_dw[i], sizeof(float) * M * k));
        CUDA_OK(cudaMalloc(&g[i], n_grads * 2));
        y[i] = malloc((size_t)M * H * 2), h_dx[i] = malloc((size_t)M * H * 2), h_g[i] = malloc(n_grads * 2);
        h_dw[i] = malloc(sizeof(float) * M * k);
    }
    int32_t *ids = malloc(sizeof(int32_t) * M * k);
    float *w = malloc(sizeof(float) * M * k);
    comet_moe_saved_t saved[2];
    CHECK_EQ(comet_moe_saved_create(fx.moe, NULL, &saved[0]), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_create(fx.moe, NULL, &saved[1]), COMET_SUCCESS);
    const comet_impl_t impls[2] = {COMET_IMPL_FUSED, COMET_IMPL_BASELINE};
    for (int c = 0; c < 2; c++) {
        const cometi_routing_t kind = c ? COMETI_ROUTING_SKEWED : COMETI_ROUTING_RANDOM;
        const int m = c ? M : M - 77 * (me + 1); /* odd counts, different on each rank */
        cometi_make_routing(kind, 8.0, m, k, E, seed + c, me, ids, w);
        CUDA_OK(cudaMemcpy(fx.d_ids, ids, sizeof(int32_t) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(fx.d_w, w, sizeof(float) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cometi_fill_hash_bf16(fx.d_x, (size_t)m * H, seed + 10 + c, (uint64_t)me * M * H, 1.0f, 0));
        CUDA_OK(cometi_fill_hash_bf16(d_dy, (size_t)m * H, seed + 20 + c, (uint64_t)me * M * H, 1.0f, 0));
        for (int i = 0; i < 2; i++) {
            comet_moe_args_t a = COMET_MOE_ARGS_INIT;
            a.num_tokens = m, a.x = fx.d_x, a.topk_ids = fx.d_ids, a.topk_weights = fx.d_w, a.y = fx.d_y;
            a.weights.gate_up = fx.d_gate_up, a.weights.down = fx.d_down, a.impl = impls[i];
            CUDA_OK(cudaMemset(fx.d_y, 0xff, (size_t)M * H * 2));
            COMET_OK(comet_moe_forward(fx.moe, &a, 0), fx.comm);
            CUDA_OK(cudaMemcpy(y[i], fx.d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemset(d_dx[i], 0xff, (size_t)M * H * 2));
            CUDA_OK(cudaMemset(d_dw[i], 0xff, sizeof(float) * M * k));
            CUDA_OK(cudaMemset(g[i], 0xff, n_grads * 2));
            const comet_status_t st = train_step(&fx, saved[i], impls[i], m, d_dy, d_dx[i], d_dw[i], g[i],
                                                 (char *)g[i] + n_gu * 2);
            if (st != COMET_SUCCESS) printf("rank %d, %s: %s\n", me, i ? "sequential" : "fused",
                                            comet_moe_last_error(fx.moe));
            CHECK_EQ(st, COMET_SUCCESS);
            CUDA_OK(cudaDeviceSynchronize());
            CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
            CUDA_OK(cudaMemcpy(h_dx[i], d_dx[i], (size_t)m * H * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(h_dw[i], d_dw[i], sizeof(float) * m * k, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(h_g[i], g[i], n_grads * 2, cudaMemcpyDeviceToHost));
        }
        double num = 0, den = 0, y_row = 0, dx_row = 0;
        add_error(y[0], y[1], NULL, (size_t)m, H, &num, &den, &y_row);
        const double y_err = sqrt(num / den);
        num = den = 0;
        add_error(h_dx[0], h_dx[1], NULL, (size_t)m, H, &num, &den, &dx_row);
        const double dx_err = sqrt(num / den);
        if (!(y_err < NORM_TOL) || !(y_row < 3e-2) || !(dx_err < NORM_TOL) || !(dx_row < 3e-2)) {
            printf("rank %d case %d: fused against sequential: y %.3g (worst row %.3g), dx %.3g (worst row %.3g)\n",
                   me, c, y_err, y_row, dx_err, dx_row);
            return 1;
        }
        double *dw_seq = malloc(sizeof(double) * m * k + 8);
        for (size_t i = 0; i < (size_t)m * k; i++) dw_seq[i] = h_dw[1][i];
        if (compare("d topk_weights, fused against sequential", h_dw[0], dw_seq, (size_t)m * k, (size_t)m * k, me))
            return 1;
        free(dw_seq);
        size_t equal = 0;
        double worst_grad = 0;
        char who[64];
        snprintf(who, sizeof(who), "rank %d case %d, fused against sequential", me, c);
        if (compare_grads(who, h_g[0], h_g[1], n_gu, n_grads, &equal, &worst_grad)) return 1;
        printf("rank %d, gpt-oss-120b, %s routing, %d tokens: fused against sequential: y %.2e, dx %.2e (worst "
               "rows %.2e, %.2e); weight gradients %zu of %zu elements bit-equal\n", me, c ? "skewed" : "random", m,
               y_err, dx_err, y_row, dx_row, equal, n_grads);
    }
    CHECK_EQ(comet_moe_saved_destroy(saved[0]), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_destroy(saved[1]), COMET_SUCCESS);
    for (int i = 0; i < 2; i++) {
        cudaFree(d_dx[i]), cudaFree(d_dw[i]), cudaFree(g[i]);
        free(y[i]), free(h_dx[i]), free(h_g[i]), free(h_dw[i]);
    }
    cudaFree(d_dy), free(ids), free(w);
    fixture_close(&fx);
    return 0;
}

int test_gpu_gpt_oss_shape(void) { return launch_seeded(gpt_oss_rank, 200); }
