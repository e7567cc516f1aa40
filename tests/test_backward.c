/*
 * test_backward.c - training through comet.h on the GPU: a training forward and its
 * backward against the float64 reference (harness/reference.h), every gradient element by
 * element: dx, d topk_weights, and this rank's experts' weight gradients, written as bf16
 * and accumulated into fp32; random and skewed routing, odd token counts, a rank with no
 * tokens, top-1 to top-8; the same bits twice; and the refusals (another layer's or an
 * empty saved state, a missing or misaligned buffer, a bound too small); a peer gone. Runs at any world
 * size (one GPU: world 1), and at TP 2 on two GPUs: each rank rebuilds every rank's inputs
 * from the seed, since an expert's weight gradient sums the rows of every rank routed to it.
 *
 * Tolerances: train_util.h derives them from bf16.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "baseline/baseline.h"
#include "layer/fused.h"
#include "testutil.h"
#include "gpu_util.h"
#include "train_util.h"


typedef struct bwd_case {
    const char *name;
    cometi_routing_t routing;
    double skew;
    int tokens[2];     /* per rank (rank r takes tokens[r % 2]) */
    int top_k;         /* 0: the preset's */
    int separate;      /* weights and gradients as gate and up, not gate_up */
    int fp32;          /* gradients accumulated into fp32 buffers (twice, from a known start) */
    int resend_x;      /* the layer's config.resend_x: the backward sends x again */
} bwd_case_t;

static const bwd_case_t bwd_cases[] = {
    {"random", COMETI_ROUTING_RANDOM, 1, {256, 200}, 0, 0, 0, 0},
    {"skewed x16, odd counts", COMETI_ROUTING_SKEWED, 16, {301, 77}, 0, 1, 0, 0},
    {"top-1", COMETI_ROUTING_RANDOM, 1, {129, 130}, 1, 0, 1, 0},
    {"top-8, fp32 accumulate", COMETI_ROUTING_RANDOM, 1, {100, 60}, 8, 1, 1, 0},
    {"top-4, a rank with no tokens", COMETI_ROUTING_RANDOM, 1, {0, 150}, 4, 0, 0, 0},
    {"every token to expert 5", COMETI_ROUTING_ONE_EXPERT, 5, {64, 96}, 0, 0, 1, 0},
    {"skewed x16, gate_up", COMETI_ROUTING_SKEWED, 16, {301, 129}, 0, 0, 0, 0},
    {"random, x sent again", COMETI_ROUTING_RANDOM, 1, {256, 200}, 0, 0, 0, 1},
    {"top-4, a rank with no tokens, fp32, x sent again", COMETI_ROUTING_RANDOM, 1, {0, 150}, 4, 0, 1, 1},
    {"skewed x16, gate and up apart, x sent again", COMETI_ROUTING_SKEWED, 16, {301, 77}, 0, 1, 0, 1},
};

/* Rank r's inputs of a case, the same on every rank: x, ids, weights, dy. */
typedef struct inputs {
    int m;
    float *x, *w, *dy;
    uint16_t *x16, *dy16;
    int32_t *ids;
} inputs_t;

static void make_inputs(const comet_moe_config_t *cfg, const bwd_case_t *c, uint64_t seed, int r, inputs_t *in)
{
    const int H = cfg->hidden, k = cfg->top_k;
    in->m = c->tokens[r % 2];
    const size_t mh = (size_t)in->m * H + 1, mk = (size_t)in->m * k + 1;
    in->x = malloc(sizeof(float) * mh), in->dy = malloc(sizeof(float) * mh);
    in->x16 = malloc(2 * mh), in->dy16 = malloc(2 * mh);
    in->w = malloc(sizeof(float) * mk);
    in->ids = malloc(sizeof(int32_t) * mk);
    uint64_t rng = seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(r + 11));
    fill_bf16(in->x, in->x16, (size_t)in->m * H, 1.0, &rng);
    fill_bf16(in->dy, in->dy16, (size_t)in->m * H, 1.0, &rng);
    cometi_make_routing(c->routing, c->skew, in->m, k, cfg->num_experts, seed, r, in->ids, in->w);
}

static void free_inputs(inputs_t *in)
{
    free(in->x), free(in->dy), free(in->x16), free(in->dy16), free(in->w), free(in->ids);
}

static void bf16_to_float(const uint16_t *h, float *f, size_t n)
{
    for (size_t i = 0; i < n; i++) f[i] = cometi_bf16_to_float(h[i]);
}

static int backward_case(fixture_t *fx, const bwd_case_t *c, uint64_t seed, comet_impl_t impl)
{
    const char *path = impl == COMET_IMPL_FUSED ? "fused" : "sequential";
    const cometi_rank_ctx_t *ctx = fx->ctx;
    const int me = ctx->rank, W = ctx->nranks, H = fx->cfg.hidden, F = fx->cfg.ffn, E = fx->cfg.num_experts,
              k = fx->cfg.top_k, per = fx->per;
    /* This rank's ffn columns (TP: F / tp of each expert, from t0). */
    const int tp = fx->cfg.tp_size > 0 ? fx->cfg.tp_size : 1, Fl = F / tp, t0 = me % tp * Fl;
    inputs_t *all = calloc((size_t)W, sizeof(inputs_t));
    for (int r = 0; r < W; r++) make_inputs(&fx->cfg, c, seed, r, &all[r]);
    const inputs_t *in = &all[me];
    const int m = in->m;
    /* The reference: this rank's dx and dw, and the weight gradients summed over every rank. */
    double *dx_ref = malloc(sizeof(double) * ((size_t)m * H + 1)), *dw_ref = malloc(sizeof(double) * ((size_t)m * k + 1));
    const size_t n_gu = (size_t)E * 2 * F * H, n_dn = (size_t)E * H * F;
    double *dgu_ref = calloc(n_gu, sizeof(double)), *ddn_ref = calloc(n_dn, sizeof(double));
    double *dgu_r = malloc(sizeof(double) * n_gu), *ddn_r = malloc(sizeof(double) * n_dn);
    for (int r = 0; r < W; r++) {
        cometi_ref_problem_t p = {H, F, E, k, all[r].m, all[r].x, all[r].ids, all[r].w, fx->gate_up, fx->down};
        cometi_reference_moe_backward(&p, all[r].dy, r == me ? dx_ref : NULL, r == me ? dw_ref : NULL, dgu_r, ddn_r);
        for (size_t i = 0; i < n_gu; i++) dgu_ref[i] += dgu_r[i];
        for (size_t i = 0; i < n_dn; i++) ddn_ref[i] += ddn_r[i];
    }
    /* Device inputs and outputs, outputs poisoned (bf16 and fp32 NaN). */
    void *d_dy, *d_dx, *d_ggu, *d_gdn;
    float *d_dw;
    const size_t gsz = c->fp32 ? 4 : 2, n_ggu = (size_t)per * 2 * Fl * H, n_gdn = (size_t)per * H * Fl;
    CUDA_OK(cudaMalloc(&d_dy, (size_t)fx->cfg.max_tokens * H * 2));
    CUDA_OK(cudaMalloc(&d_dx, (size_t)fx->cfg.max_tokens * H * 2));
    CUDA_OK(cudaMalloc((void **)&d_dw, sizeof(float) * fx->cfg.max_tokens * k));
    CUDA_OK(cudaMalloc(&d_ggu, n_ggu * gsz));
    CUDA_OK(cudaMalloc(&d_gdn, n_gdn * gsz));
    CUDA_OK(cudaMemcpy(fx->d_x, in->x16, (size_t)m * H * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_dy, in->dy16, (size_t)m * H * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx->d_ids, in->ids, sizeof(int32_t) * m * k, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx->d_w, in->w, sizeof(float) * m * k, cudaMemcpyHostToDevice));
    /* fp32 accumulate starts from a known value in every element: 0.25. */
    float *start = NULL;
    if (c->fp32) {
        start = malloc(sizeof(float) * n_ggu);
        for (size_t i = 0; i < n_ggu; i++) start[i] = 0.25f;
        CUDA_OK(cudaMemcpy(d_ggu, start, n_ggu * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_gdn, start, n_gdn * 4, cudaMemcpyHostToDevice));
    } else {
        CUDA_OK(cudaMemset(d_ggu, 0xff, n_ggu * 2));
        CUDA_OK(cudaMemset(d_gdn, 0xff, n_gdn * 2));
    }
    comet_moe_saved_t saved;
    if (comet_moe_saved_create(fx->moe, NULL, &saved) != COMET_SUCCESS) {
        printf("comet_moe_saved_create: %s\n", comet_last_create_error());
        return 1;
    }
    comet_moe_args_t a = fused_args(fx, &(moe_case_t){c->name, c->routing, c->skew, {c->tokens[0], c->tokens[1]},
                                                      c->separate, 0});
    a.impl = impl;
    /* The training forward's y is the inference forward's: bit for bit on the sequential
     * path; on the fused one, whose training forward sends every choice's row home (the
     * push), within the tolerances (the roundings differ). */
    uint16_t *y_inf = malloc(2 * ((size_t)m * H + 1)), *y_tr = malloc(2 * ((size_t)m * H + 1));
    COMET_OK(comet_moe_forward(fx->moe, &a, 0), fx->comm);
    CUDA_OK(cudaMemcpy(y_inf, fx->d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
    comet_status_t st;
    comet_moe_backward_args_t b = COMET_MOE_BACKWARD_ARGS_INIT;
    b.saved = saved;
    b.dy = d_dy;
    b.weights = a.weights;
    b.dx = d_dx;
    b.d_topk_weights = d_dw;
    b.grads.down = d_gdn;
    if (c->separate) b.grads.gate = d_ggu, b.grads.up = (char *)d_ggu + (size_t)per * F * H * gsz;
    else b.grads.gate_up = d_ggu;
    b.grads.mode = c->fp32 ? COMET_GRAD_ACCUMULATE_FP32 : COMET_GRAD_WRITE_BF16;
    b.x = c->resend_x ? fx->d_x : NULL; /* the forward's x, read only when the layer sends it again */
    const int calls = 2; /* fp32: accumulates twice; bf16: the same bits twice */
    uint16_t *first_dx = malloc(2 * ((size_t)m * H + 1));
    float *first_dw = malloc(sizeof(float) * ((size_t)m * k + 1));
    for (int call = 0; call < calls; call++) {
        /* A backward consumes its saved state: a training forward before each. */
        CUDA_OK(cudaMemset(fx->d_y, 0xff, (size_t)fx->cfg.max_tokens * H * 2));
        st = comet_moe_forward_train(fx->moe, &a, saved, 0);
        if (st != COMET_SUCCESS) printf("comet_moe_forward_train: %s\n", comet_moe_last_error(fx->moe));
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaMemcpy(y_tr, fx->d_y, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        if (impl == COMET_IMPL_BASELINE) {
            CHECK(memcmp(y_inf, y_tr, (size_t)m * H * 2) == 0);
        } else if (m) {
            float *yt = malloc(sizeof(float) * m * H);
            double *yi = malloc(sizeof(double) * m * H);
            for (size_t i = 0; i < (size_t)m * H; i++)
                yt[i] = cometi_bf16_to_float(y_tr[i]), yi[i] = cometi_bf16_to_float(y_inf[i]);
            char what[96];
            snprintf(what, sizeof(what), "%s, %s: training y", c->name, path);
            const int bad = compare(what, yt, yi, (size_t)m * H, H, me);
            free(yt), free(yi);
            if (bad) return 1;
        }
        CUDA_OK(cudaMemset(d_dx, 0xff, (size_t)fx->cfg.max_tokens * H * 2));
        CUDA_OK(cudaMemset(d_dw, 0xff, sizeof(float) * fx->cfg.max_tokens * k));
        if (c->resend_x && m && call == 0) { /* x missing or misaligned: refused, the saved state kept */
            comet_moe_backward_args_t bad = b;
            bad.x = NULL;
            CHECK_EQ(comet_moe_backward(fx->moe, &bad, 0), COMET_INVALID_ARGUMENT);
            CHECK_CONTAINS(comet_moe_last_error(fx->moe), "args.x is NULL");
            CHECK_CONTAINS(comet_moe_last_error(fx->moe), "config.resend_x");
            bad.x = (const char *)fx->d_x + 8;
            CHECK_EQ(comet_moe_backward(fx->moe, &bad, 0), COMET_INVALID_ARGUMENT);
            CHECK_CONTAINS(comet_moe_last_error(fx->moe), "args.x");
            CHECK_CONTAINS(comet_moe_last_error(fx->moe), "16-byte aligned");
        }
        st = comet_moe_backward(fx->moe, &b, 0);
        if (st != COMET_SUCCESS) printf("comet_moe_backward: %s\n", comet_moe_last_error(fx->moe));
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaDeviceSynchronize());
        uint16_t *dx16 = malloc(2 * ((size_t)m * H + 1));
        float *dx = malloc(sizeof(float) * ((size_t)m * H + 1)), *dw = malloc(sizeof(float) * ((size_t)m * k + 1));
        CUDA_OK(cudaMemcpy(dx16, d_dx, (size_t)m * H * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dw, d_dw, sizeof(float) * m * k, cudaMemcpyDeviceToHost));
        bf16_to_float(dx16, dx, (size_t)m * H);
        char what[96];
        snprintf(what, sizeof(what), "%s, %s, call %d: dx", c->name, path, call);
        if (m && compare(what, dx, dx_ref, (size_t)m * H, H, me)) return 1;
        snprintf(what, sizeof(what), "%s, %s, call %d: d topk_weights", c->name, path, call);
        if (m && compare(what, dw, dw_ref, (size_t)m * k, (size_t)m * k, me)) return 1;
        if (call == 0) {
            memcpy(first_dx, dx16, (size_t)m * H * 2);
            memcpy(first_dw, dw, sizeof(float) * m * k);
        } else { /* fixed-order sums: the same bits */
            CHECK(memcmp(first_dx, dx16, (size_t)m * H * 2) == 0);
            CHECK(memcmp(first_dw, dw, sizeof(float) * m * k) == 0);
        }
        free(dx16), free(dx), free(dw);
        if (c->fp32 && call == 0) continue; /* checked after the second accumulation */
        /* This rank's experts' weight gradients (TP: its ffn columns) against the reference,
         * fp32: start + calls x the gradient. */
        float *g = malloc(sizeof(float) * (n_ggu > n_gdn ? n_ggu : n_gdn));
        double *want = malloc(sizeof(double) * (n_ggu > n_gdn ? n_ggu : n_gdn));
        void *raw = malloc((n_ggu > n_gdn ? n_ggu : n_gdn) * gsz);
        const double times = c->fp32 ? calls : 1, base = c->fp32 ? 0.25 : 0;
        for (int which = 0; which < 2; which++) { /* gate_up, down */
            const size_t n = which ? n_gdn : n_ggu;
            CUDA_OK(cudaMemcpy(raw, which ? d_gdn : d_ggu, n * gsz, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < n; i++) g[i] = c->fp32 ? ((float *)raw)[i] : cometi_bf16_to_float(((uint16_t *)raw)[i]);
            for (int le = 0; le < per; le++) {
                const int e = fx->first + le;
                if (which) { /* down [H][Fl] from [H][F] */
                    for (int h = 0; h < H; h++)
                        for (int f = 0; f < Fl; f++)
                            want[((size_t)le * H + h) * Fl + f] = base + times * ddn_ref[((size_t)e * H + h) * F + t0 + f];
                } else if (c->separate) { /* gate [E_local][Fl][H], then up [E_local][Fl][H] */
                    for (int f = 0; f < Fl; f++)
                        for (int h = 0; h < H; h++) {
                            want[((size_t)le * Fl + f) * H + h] = base + times * dgu_ref[((size_t)e * 2 * F + t0 + f) * H + h];
                            want[((size_t)(per + le) * Fl + f) * H + h] =
                                base + times * dgu_ref[((size_t)e * 2 * F + F + t0 + f) * H + h];
                        }
                } else { /* gate_up [E_local][2Fl][H] */
                    for (int f = 0; f < Fl; f++)
                        for (int h = 0; h < H; h++) {
                            want[((size_t)le * 2 * Fl + f) * H + h] = base + times * dgu_ref[((size_t)e * 2 * F + t0 + f) * H + h];
                            want[((size_t)le * 2 * Fl + Fl + f) * H + h] =
                                base + times * dgu_ref[((size_t)e * 2 * F + F + t0 + f) * H + h];
                        }
                }
            }
            if (c->fp32) /* compare the gradient itself, not the start it was added to */
                for (size_t i = 0; i < n; i++) g[i] -= 0.25f, want[i] -= base;
            snprintf(what, sizeof(what), "%s, %s: %s", c->name, path, which ? "ddown" : c->separate ? "dgate, dup" : "dgate_up");
            /* Each expert's gradient (or its gate or up half) against its own RMS: an expert
             * that took few rows has a small gradient, and one that took none has zeros. */
            if (compare(what, g, want, n, (size_t)H * Fl, me)) return 1;
        }
        free(g), free(want), free(raw);
    }
    COMET_OK(comet_moe_saved_destroy(saved), fx->comm);
    cudaFree(d_dy), cudaFree(d_dx), cudaFree(d_dw), cudaFree(d_ggu), cudaFree(d_gdn);
    for (int r = 0; r < W; r++) free_inputs(&all[r]);
    free(all), free(dx_ref), free(dw_ref), free(dgu_ref), free(ddn_ref), free(dgu_r), free(ddn_r), free(start);
    free(y_inf), free(y_tr), free(first_dx), free(first_dw);
    return 0;
}

/* Every case of bwd_cases on the tiny preset changed by `shape`. */
static int backward_cases_rank(const cometi_rank_ctx_t *ctx, uint64_t seed, const fixture_shape_t *shape)
{
    /* One communicator for every case (its id serves one init); the fixture's buffers for
     * top-8, and a layer of each case's top-k made on it. */
    fixture_t fx;
    if (fixture_open(&fx, ctx, seed, shape)) return 1;
    for (size_t i = 0; i < sizeof(bwd_cases) / sizeof(bwd_cases[0]); i++) {
        CHECK_EQ(comet_moe_destroy(fx.moe), COMET_SUCCESS);
        fx.cfg.top_k = bwd_cases[i].top_k ? bwd_cases[i].top_k : 2;
        fx.cfg.resend_x = bwd_cases[i].resend_x;
        if (comet_moe_create(fx.comm, &fx.cfg, &fx.moe) != COMET_SUCCESS) {
            printf("comet_moe_create: %s\n", comet_last_create_error());
            return 1;
        }
        { /* comet.h's size: per received row (hidden unless resend_x + 2 ffn) x 2, per choice
           * 12 bytes, per local expert a 128-row block and 8 bytes, each part 256-aligned */
            const int k = fx.cfg.top_k, here = k < fx.per ? k : fx.per;
            const size_t cap = (size_t)ctx->nranks * fx.cfg.max_tokens * here + (size_t)fx.per * 128,
                         choices = (size_t)fx.cfg.max_tokens * k;
#define ALIGN256(b) (((b) + 255) / 256 * 256)
            const size_t want = (fx.cfg.resend_x ? 0 : ALIGN256(cap * fx.cfg.hidden * 2)) +
                                ALIGN256(cap * 2 * (fx.cfg.ffn / (fx.cfg.tp_size > 0 ? fx.cfg.tp_size : 1)) * 2) +
                                3 * ALIGN256(choices * 4) +
                                ALIGN256((size_t)fx.per * 8);
#undef ALIGN256
            size_t bytes = 0;
            CHECK_EQ(comet_moe_saved_bytes(fx.moe, NULL, &bytes), COMET_SUCCESS);
            CHECK_EQ(bytes, want);
        }
        if (fx.cfg.resend_x) { /* its saved state keeps no x rows: cap_rows x hidden x 2 bytes fewer */
            comet_moe_config_t keep = fx.cfg;
            keep.resend_x = 0;
            comet_moe_t twin;
            CHECK_EQ(comet_moe_create(fx.comm, &keep, &twin), COMET_SUCCESS);
            size_t with_x = 0, without_x = 0;
            CHECK_EQ(comet_moe_saved_bytes(twin, NULL, &with_x), COMET_SUCCESS);
            CHECK_EQ(comet_moe_saved_bytes(fx.moe, NULL, &without_x), COMET_SUCCESS);
            const int k = fx.cfg.top_k, here = k < fx.per ? k : fx.per;
            const size_t cap = (size_t)ctx->nranks * fx.cfg.max_tokens * here + (size_t)fx.per * 128;
            CHECK_EQ(with_x - without_x, (cap * fx.cfg.hidden * 2 + 255) / 256 * 256);
            CHECK_EQ(comet_moe_destroy(twin), COMET_SUCCESS);
        }
        if (backward_case(&fx, &bwd_cases[i], seed + 100 * i, COMET_IMPL_BASELINE)) return 1;
        /* The fused path trains with gate_up in one tensor (separate gate and up: refused). */
        if (!bwd_cases[i].separate && backward_case(&fx, &bwd_cases[i], seed + 100 * i + 50, COMET_IMPL_FUSED))
            return 1;
    }
    fixture_close(&fx);
    return 0;
}

static int backward_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    /* ffn 192 and hidden 320: every GEMM of the backward ends in a partial column tile. */
    const fixture_shape_t shape = {192, 320, 8, 0, 0};
    return backward_cases_rank(ctx, *(const uint64_t *)arg, &shape);
}

int test_gpu_backward_matches_reference(void) { return launch_seeded(backward_rank, 280); }

/* TP 2 (two ranks, one EP group): dy goes to both TP ranks of the group, each runs its
 * ffn / 2 columns, and a token's dx sums both ranks' partial rows. */
static int backward_tp_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const fixture_shape_t shape = {256, 320, 8, 0, 2}; /* 128 ffn columns a TP rank */
    return backward_cases_rank(ctx, *(const uint64_t *)arg, &shape);
}

int test_gpu_backward_tp2_matches_reference(void) { return launch_two_seeded(backward_tp_rank, 280); }

/* Refusals, each before anything is launched, naming what is wrong; and a bound too
 * small refused on every rank before any row moves. */
static int backward_refusals_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(const uint64_t *)arg;
    fixture_t fx;
    if (fixture_open(&fx, ctx, seed, NULL)) return 1;
    const moe_case_t c = {"refusals", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    comet_status_t st;
    double rel;
    fx.skip_reference = 1;
    if (run_case(&fx, &c, seed, 0, &st, &rel)) return 1; /* inputs in place */
    comet_moe_args_t a = fused_args(&fx, &c);
    comet_moe_saved_t saved, other_saved;
    CHECK_EQ(comet_moe_saved_create(fx.moe, NULL, &saved), COMET_SUCCESS);
    comet_moe_t other;
    CHECK_EQ(comet_moe_create(fx.comm, &fx.cfg, &other), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_create(other, NULL, &other_saved), COMET_SUCCESS);
    void *buf;
    CUDA_OK(cudaMalloc(&buf, (size_t)1 << 24));
    comet_moe_backward_args_t b = COMET_MOE_BACKWARD_ARGS_INIT;
    b.saved = saved;
    b.dy = buf;
    b.dx = (char *)buf + (1 << 20);
    b.d_topk_weights = (float *)((char *)buf + (2 << 20));
    b.weights = a.weights;
    b.grads.gate_up = (char *)buf + (4 << 20);
    b.grads.down = (char *)buf + (8 << 20);
    /* Empty: no forward filled it yet. */
    CHECK_EQ(comet_moe_backward(fx.moe, &b, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "args.saved holds no forward");
    /* Another layer's. */
    CHECK_EQ(comet_moe_forward_train(fx.moe, &a, other_saved, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "saved belongs to another layer");
    comet_moe_args_t seq = a;
    seq.impl = COMET_IMPL_BASELINE; /* the sequential path, asked for */
    CHECK_EQ(comet_moe_forward_train(fx.moe, &seq, saved, 0), COMET_SUCCESS);
    b.saved = other_saved;
    CHECK_EQ(comet_moe_backward(fx.moe, &b, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "args.saved belongs to another layer");
    b.saved = saved;
    /* Missing, misaligned, mismatched, the fused path. */
    comet_moe_backward_args_t bad = b;
    bad.dx = NULL;
    CHECK_EQ(comet_moe_backward(fx.moe, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "args.dx is NULL");
    bad = b;
    bad.dy = (char *)buf + 2;
    CHECK_EQ(comet_moe_backward(fx.moe, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "args.dy");
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "16-byte aligned");
    bad = b;
    bad.grads.down = NULL;
    CHECK_EQ(comet_moe_backward(fx.moe, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "args.grads.down is NULL");
    bad = b;
    bad.grads.gate_up = NULL, bad.grads.gate = bad.grads.up = (char *)buf + (4 << 20);
    CHECK_EQ(comet_moe_backward(fx.moe, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "give gate_up alone, as args.weights does");
    bad = b;
    bad.grads.mode = (comet_grad_mode_t)7;
    CHECK_EQ(comet_moe_backward(fx.moe, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "args.grads.mode = 7");
    bad = b;
    bad.impl = COMET_IMPL_FUSED; /* the forward ran the sequential path */
    CHECK_EQ(comet_moe_backward(fx.moe, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "filled on the sequential path");
    bad = b;
    bad.size = 8;
    CHECK_EQ(comet_moe_backward(fx.moe, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "COMET_MOE_BACKWARD_ARGS_INIT");
    /* The fused path cannot train gate and up apart: said up front, nothing launched. */
    comet_moe_args_t fa = a;
    fa.impl = COMET_IMPL_FUSED;
    fa.weights.gate_up = NULL, fa.weights.gate = fx.d_gate, fa.weights.up = fx.d_up;
    CHECK_EQ(comet_moe_forward_train(fx.moe, &fa, other_saved, 0), COMET_INVALID_ARGUMENT); /* another layer's first */
    comet_moe_saved_t mine2;
    CHECK_EQ(comet_moe_saved_create(fx.moe, NULL, &mine2), COMET_SUCCESS);
    CHECK_EQ(comet_moe_forward_train(fx.moe, &fa, mine2, 0), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "weights.gate and weights.up apart");
    CHECK_EQ(comet_moe_saved_destroy(mine2), COMET_SUCCESS);
    /* A backward consumes its saved state: a second one is refused. */
    CHECK_EQ(comet_moe_backward(fx.moe, &b, 0), COMET_SUCCESS);
    CHECK_EQ(comet_moe_backward(fx.moe, &b, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "a backward consumes it");
    CUDA_OK(cudaDeviceSynchronize());
    /* The backward's expert phase failing on rank 0 after its dispatch (injected, as a
     * cuBLAS call without an algorithm would): every rank still takes part in the return,
     * so none hangs; rank 0 reports it by name; the next forward and backward run. */
    CHECK_EQ(comet_moe_forward_train(fx.moe, &seq, saved, 0), COMET_SUCCESS);
    if (ctx->rank == 0) fx.moe->baseline->fail_experts = 1;
    st = comet_moe_backward(fx.moe, &b, 0);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(st, ctx->rank == 0 ? COMET_CUDA_ERROR : COMET_SUCCESS);
    if (ctx->rank == 0) CHECK_CONTAINS(comet_moe_last_error(fx.moe), "the expert phase failed (injected by a test)");
    CHECK_EQ(comet_moe_forward_train(fx.moe, &seq, saved, 0), COMET_SUCCESS);
    CHECK_EQ(comet_moe_backward(fx.moe, &b, 0), COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    /* A bound the routing exceeds, on the sequential path: refused by every rank (each
     * sees every group's rows), and the state left empty. */
    comet_moe_saved_config_t sc = COMET_MOE_SAVED_CONFIG_INIT;
    sc.max_recv_rows = 10;
    comet_moe_saved_t small;
    CHECK_EQ(comet_moe_saved_create(fx.moe, &sc, &small), COMET_SUCCESS);
    size_t small_bytes = 0, worst_bytes = 0;
    CHECK_EQ(comet_moe_saved_bytes(fx.moe, &sc, &small_bytes), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_bytes(fx.moe, NULL, &worst_bytes), COMET_SUCCESS);
    CHECK(small_bytes < worst_bytes);
    CHECK_EQ(comet_moe_forward_train(fx.moe, &seq, small, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "more than the saved state's max_recv_rows = 10");
    b.saved = small;
    CHECK_EQ(comet_moe_backward(fx.moe, &b, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "holds no forward");
    sc.max_recv_rows = -1;
    CHECK_EQ(comet_moe_saved_create(fx.moe, &sc, &small), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "max_recv_rows = -1");
    sc.max_recv_rows = 0, sc.gate_up_e4m3 = 1; /* [g u] in E4M3 is for FP8 layers */
    CHECK_EQ(comet_moe_saved_bytes(fx.moe, &sc, &small_bytes), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "gate_up_e4m3 = 1 is for layers of dtype COMET_DTYPE_FP8_BLOCK");
    sc.gate_up_e4m3 = 2;
    CHECK_EQ(comet_moe_saved_create(fx.moe, &sc, &small), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "gate_up_e4m3 = 2");
    sc.gate_up_e4m3 = 0;
    CHECK_EQ(comet_moe_saved_destroy(b.saved), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_destroy(saved), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_destroy(other_saved), COMET_SUCCESS);
    CHECK_EQ(comet_moe_saved_destroy(NULL), COMET_SUCCESS);
    CHECK_EQ(comet_moe_destroy(other), COMET_SUCCESS);
    /* The same bound on the fused path, which never waits for the host: the forward runs,
     * keeps only the rows under the bound, and the communicator reports the excess on
     * every rank; it is unusable after that, so this comes last. */
    sc.max_recv_rows = 10;
    CHECK_EQ(comet_moe_saved_create(fx.moe, &sc, &small), COMET_SUCCESS);
    comet_moe_args_t fused = a;
    fused.impl = COMET_IMPL_FUSED;
    CHECK_EQ(comet_moe_forward_train(fx.moe, &fused, small, 0), COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_comm_last_error(fx.comm), "more than the saved state's max_recv_rows = 10");
    CHECK(comet_moe_forward_train(fx.moe, &fused, small, 0) != COMET_SUCCESS); /* sticky */
    CHECK_EQ(comet_moe_saved_destroy(small), COMET_SUCCESS);
    cudaFree(buf);
    printf("rank %d: every refusal named its argument; the fused path's excess rows reported: %s\n", ctx->rank,
           comet_comm_last_error(fx.comm));
    fixture_close(&fx);
    return 0;
}

int test_gpu_backward_refusals(void) { return launch_seeded(backward_refusals_rank, 120); }

/* A layer that sends x again keeps no x rows, but its fused training forward checks the
 * bound all the same: an exceeded one is reported on every rank (the communicator is
 * unusable after it, hence a test of its own). */
static int resend_x_bound_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(const uint64_t *)arg;
    fixture_t fx;
    const fixture_shape_t shape = {256, 0, 0, 0, 0};
    if (fixture_open(&fx, ctx, seed, &shape)) return 1;
    CHECK_EQ(comet_moe_destroy(fx.moe), COMET_SUCCESS);
    fx.cfg.resend_x = 1;
    COMET_OK(comet_moe_create(fx.comm, &fx.cfg, &fx.moe), fx.comm);
    const moe_case_t c = {"resend_x bound", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    fx.skip_reference = 1;
    comet_status_t st;
    double rel;
    if (run_case(&fx, &c, seed, 0, &st, &rel)) return 1; /* inputs in place */
    comet_moe_args_t a = fused_args(&fx, &c);
    a.impl = COMET_IMPL_FUSED;
    comet_moe_saved_config_t sc = COMET_MOE_SAVED_CONFIG_INIT;
    sc.max_recv_rows = 10;
    comet_moe_saved_t small;
    CHECK_EQ(comet_moe_saved_create(fx.moe, &sc, &small), COMET_SUCCESS);
    CHECK_EQ(comet_moe_forward_train(fx.moe, &a, small, 0), COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_comm_last_error(fx.comm), "more than the saved state's max_recv_rows = 10");
    CHECK_EQ(comet_moe_saved_destroy(small), COMET_SUCCESS);
    fixture_close(&fx);
    return 0;
}

int test_gpu_resend_x_bound_reported(void) { return launch_seeded(resend_x_bound_rank, 60); }

/* ---- two-rank failures of the backward ---- */

/* The backward's arguments for the two-rank tests (fixture_open_timed's layer, a's
 * weights): dy zeros, its outputs and bf16 gradients allocated; saved left to the test.
 * Their memory goes with the process (the communicator of these tests ends unusable). */
static int peer_backward_args(const fixture_t *fx, const comet_moe_args_t *a, comet_moe_backward_args_t *b)
{
    const int H = fx->cfg.hidden, F = fx->cfg.ffn, M = fx->cfg.max_tokens, k = fx->cfg.top_k, per = fx->per;
    *b = (comet_moe_backward_args_t)COMET_MOE_BACKWARD_ARGS_INIT;
    void *dy, *dx, *g_gu, *g_dn;
    float *dw;
    CUDA_OK(cudaMalloc(&dy, (size_t)M * H * 2));
    CUDA_OK(cudaMemset(dy, 0, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc(&dx, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc((void **)&dw, sizeof(float) * M * k));
    CUDA_OK(cudaMalloc(&g_gu, (size_t)per * 2 * F * H * 2));
    CUDA_OK(cudaMalloc(&g_dn, (size_t)per * H * F * 2));
    b->dy = dy, b->weights = a->weights, b->dx = dx, b->d_topk_weights = dw;
    b->grads.gate_up = g_gu, b->grads.down = g_dn;
    return 0;
}

/* ---- a peer gone in the backward: COMET_TIMEOUT, not a hang (two GPUs) ---- */

static int backward_missing_peer_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const moe_case_t c = {"missing peer", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    comet_moe_args_t a;
    if (fixture_open_timed(&fx, ctx, seed, &c, &a)) return 1;
    comet_moe_backward_args_t b;
    if (peer_backward_args(&fx, &a, &b)) return 1;
    comet_moe_saved_t saved;
    CHECK_EQ(comet_moe_saved_create(fx.moe, NULL, &saved), COMET_SUCCESS);
    COMET_OK(comet_moe_forward_train(fx.moe, &a, saved, 0), fx.comm);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    b.saved = saved;
    const double t0 = now_s();
    if (ctx->rank == 0) COMET_OK(comet_moe_backward(fx.moe, &b, 0), fx.comm); /* rank 1 never calls it */
    else COMET_OK(cometi_wait_flag(fx.comm, 3, 1, 0), fx.comm);
    CUDA_OK(cudaDeviceSynchronize());
    const double took = now_s() - t0;
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_TIMEOUT);
    printf("rank %d: %.3f s: %s\n", ctx->rank, took, comet_comm_last_error(fx.comm));
    CHECK(took < 5.0);
    /* The communicator is unusable now; destroying it aborts NCCL. */
    comet_comm_destroy(fx.comm);
    fx.comm = NULL;
    return 0;
}

int test_gpu_backward_missing_peer_times_out(void) { return launch_two_seeded(backward_missing_peer_rank, 100); }

/* ---- ranks in the backwards of different forward calls: refused on every rank (two GPUs) ---- */

/* Two training forwards of a's tokens, each into a saved state of its own. */
static int two_training_forwards(const fixture_t *fx, const comet_moe_args_t *a, comet_moe_saved_t saved[2])
{
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(comet_moe_saved_create(fx->moe, NULL, &saved[i]), COMET_SUCCESS);
        COMET_OK(comet_moe_forward_train(fx->moe, a, saved[i], 0), fx->comm);
    }
    return 0;
}

/* Two training forwards, then rank 0 runs the backward of the first and rank 1 of the
 * second (as with layers run out of order): the route's exchange finds the call ids apart,
 * so every rank gets COMET_INVALID_ARGUMENT naming the other, nothing moves, no hang. */
static int backward_other_call_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const moe_case_t c = {"another call", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    comet_moe_args_t a;
    if (fixture_open_timed(&fx, ctx, seed, &c, &a)) return 1;
    comet_moe_backward_args_t b;
    if (peer_backward_args(&fx, &a, &b)) return 1;
    comet_moe_saved_t saved[2];
    if (two_training_forwards(&fx, &a, saved)) return 1;
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    b.saved = saved[ctx->rank % 2];
    const double t0 = now_s();
    COMET_OK(comet_moe_backward(fx.moe, &b, 0), fx.comm);
    CUDA_OK(cudaDeviceSynchronize());
    const double took = now_s() - t0;
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_INVALID_ARGUMENT);
    printf("rank %d: %.3f s: %s\n", ctx->rank, took, comet_comm_last_error(fx.comm));
    CHECK_CONTAINS(comet_comm_last_error(fx.comm), "in another call");
    CHECK(took < 1.0); /* refused at the exchange, not after a timeout */
    comet_comm_destroy(fx.comm);
    fx.comm = NULL;
    return 0;
}

int test_gpu_backward_of_another_call_refused(void) { return launch_two_seeded(backward_other_call_rank, 100); }

/* The sequential path: the backward of another forward call, and a training forward
 * beside an inference forward, are refused on every rank at the count exchange (on the
 * host, before any row moves), the saved states left filled; the communicator stays
 * usable, and the backwards in the right order then run. */
static int sequential_other_call_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const moe_case_t c = {"sequential, another call", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    comet_moe_args_t a;
    if (fixture_open_timed(&fx, ctx, seed, &c, &a)) return 1;
    a.impl = COMET_IMPL_BASELINE;
    comet_moe_backward_args_t b;
    if (peer_backward_args(&fx, &a, &b)) return 1;
    comet_moe_saved_t saved[2];
    if (two_training_forwards(&fx, &a, saved)) return 1;
    b.saved = saved[ctx->rank % 2];
    const size_t dx_bytes = (size_t)a.num_tokens * fx.cfg.hidden * 2;
    CUDA_OK(cudaMemset(b.dx, 0xff, dx_bytes)); /* poison: a refused call writes nothing */
    CHECK_EQ(comet_moe_backward(fx.moe, &b, 0), COMET_INVALID_ARGUMENT);
    printf("rank %d: %s\n", ctx->rank, comet_moe_last_error(fx.moe));
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), "in another call: the backward of training forward");
    CUDA_OK(cudaDeviceSynchronize());
    unsigned char *dx = malloc(dx_bytes);
    CUDA_OK(cudaMemcpy(dx, b.dx, dx_bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < dx_bytes; i++) CHECK_EQ(dx[i], 0xff);
    free(dx);
    for (int i = 1; i >= 0; i--) { /* the right order: both refused states are still whole */
        b.saved = saved[i];
        COMET_OK(comet_moe_backward(fx.moe, &b, 0), fx.comm);
    }
    CHECK_EQ(comet_moe_forward_train(fx.moe, &a, saved[0], 0), COMET_SUCCESS);
    const comet_status_t st = ctx->rank == 0 ? comet_moe_backward(fx.moe, &b, 0) : comet_moe_forward(fx.moe, &a, 0);
    CHECK_EQ(st, COMET_INVALID_ARGUMENT);
    printf("rank %d: %s\n", ctx->rank, comet_moe_last_error(fx.moe));
    CHECK_CONTAINS(comet_moe_last_error(fx.moe), ctx->rank == 0 ? "an inference forward there"
                                                                  : "the backward of training forward");
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    for (int i = 0; i < 2; i++) CHECK_EQ(comet_moe_saved_destroy(saved[i]), COMET_SUCCESS);
    fixture_close(&fx);
    return 0;
}

int test_gpu_sequential_other_call_refused(void) { return launch_two_seeded(sequential_other_call_rank, 100); }

/* Saved states of different bounds on the two ranks: the training forward is refused on
 * both at the route (its call id carries the bound), nothing sent, no wait. */
static int forward_other_bound_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const moe_case_t c = {"another bound", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    comet_moe_args_t a;
    if (fixture_open_timed(&fx, ctx, seed, &c, &a)) return 1;
    comet_moe_saved_config_t sc = COMET_MOE_SAVED_CONFIG_INIT;
    sc.max_recv_rows = 1000 + ctx->rank; /* each above the 128 rows a rank receives here */
    comet_moe_saved_t saved;
    CHECK_EQ(comet_moe_saved_create(fx.moe, &sc, &saved), COMET_SUCCESS);
    const double t0 = now_s();
    COMET_OK(comet_moe_forward_train(fx.moe, &a, saved, 0), fx.comm);
    CUDA_OK(cudaDeviceSynchronize());
    const double took = now_s() - t0;
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_INVALID_ARGUMENT);
    printf("rank %d: %.3f s: %s\n", ctx->rank, took, comet_comm_last_error(fx.comm));
    char want[96];
    snprintf(want, sizeof(want), "a training forward with max_recv_rows = %d (mod 2^31) there", 1001 - ctx->rank);
    CHECK_CONTAINS(comet_comm_last_error(fx.comm), want);
    CHECK(took < 1.0);
    comet_comm_destroy(fx.comm);
    fx.comm = NULL;
    return 0;
}

int test_gpu_training_forward_of_other_bounds_refused(void)
{
    return launch_two_seeded(forward_other_bound_rank, 100);
}

/* Layers of different configs on the two ranks (resend_x 0 and 1): each path's first call
 * compares them and refuses on both ranks, naming the field, before any row moves. */
static int configs_differ_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    fixture_t fx;
    const moe_case_t c = {"configs differ", COMETI_ROUTING_RANDOM, 1, {64, 64}, 0, 0};
    comet_moe_args_t a;
    if (fixture_open_timed(&fx, ctx, seed, &c, &a)) return 1;
    comet_moe_config_t cfg = fx.cfg;
    cfg.resend_x = ctx->rank % 2;
    comet_moe_t other;
    COMET_OK(comet_moe_create(fx.comm, &cfg, &other), fx.comm);
    for (int p = 0; p < 2; p++) {
        a.impl = p ? COMET_IMPL_BASELINE : COMET_IMPL_FUSED;
        CHECK_EQ(comet_moe_forward(other, &a, 0), COMET_INVALID_ARGUMENT);
        printf("rank %d: %s\n", ctx->rank, comet_moe_last_error(other));
        CHECK_CONTAINS(comet_moe_last_error(other), p ? "baseline path: rank" : "fused path: rank");
        CHECK_CONTAINS(comet_moe_last_error(other), "config.resend_x = ");
    }
    CHECK_EQ(comet_moe_destroy(other), COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx.comm), COMET_SUCCESS);
    fixture_close(&fx);
    return 0;
}

int test_gpu_layer_configs_differ_refused(void) { return launch_two_seeded(configs_differ_rank, 100); }
