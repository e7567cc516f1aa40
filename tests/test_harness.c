/*
 * test_harness.c - what the tests and the bench stand on (no GPU needed): the tile
 * timeline's accounting, the synthetic routing generators and the float64 reference (the
 * launcher's tests are test_launch.c).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include "comet.h"
#include "layer/layer.h"
#include "comm/plan.h"
#include "../harness/timeline.h"
#include "gemm/gemm.h"
#include "testutil.h"

/* A tile timeline made by hand: a dispatch block that waits for rows, a GEMM block with
 * launch skew and a tail, a row left zero (a combine block); the parts add up to the span
 * on every block, a block past the recorded tiles is counted, a bad row is named. */
int test_timeline_accounting(void)
{
    enum { W = COMETI_TILE_TRACE_WORDS };
    unsigned long long *t = calloc(3 * W, sizeof(unsigned long long));
    CHECK(t);
    /* block 0: starts at 1000, dispatches until 5000; tile 7 ready at once, done at 9000;
     * tile 9 taken at 6000, its rows ready at 12000, done at 15000; ends at 15100. */
    unsigned long long b0[] = {1000, 5000, 2, 15100, 7, 5000, 5000, 9000, 9, 6000, 12000, 15000};
    /* block 1: starts at 1200, three tiles of 4000 us, the first one's rows at 1300. */
    unsigned long long b1[] = {1200, 0, 3, 13400, 0, 1200, 1300, 5300, 2, 5000, 5000, 9300, 4, 9000, 9300, 13300};
    memcpy(t, b0, sizeof(b0));
    memcpy(t + W, b1, sizeof(b1));
    char err[COMETI_ERR_LEN] = "";
    cometi_timeline_t s;
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_SUCCESS);
    CHECK_EQ(s.blocks, 2);
    CHECK_EQ(s.tiles, 5);
    CHECK_EQ(s.truncated, 0);
    CHECK_NEAR(s.span_us, 14.1, 1e-9);
    CHECK_NEAR(s.launch_us, 0.1, 1e-9);   /* (0 + 200) / 2 ns */
    CHECK_NEAR(s.dispatch_us, 2.0, 1e-9); /* (4000 + 0) / 2 */
    CHECK_NEAR(s.wait_us, 1.55, 1e-9);    /* (3000 + 100) / 2 */
    CHECK_NEAR(s.first_wait_us, 0.05, 1e-9); /* (0 + 100) / 2 */
    CHECK_NEAR(s.tiles_us, 9.5, 1e-9);    /* (7000 + 12000) / 2 */
    CHECK_NEAR(s.tail_us, 0.95, 1e-9);    /* (100 + 1800) / 2 */
    CHECK_NEAR(s.launch_us + s.dispatch_us + s.wait_us + s.tiles_us + s.tail_us, s.span_us, 1e-9);
    CHECK_NEAR(s.tile_us, 3.8, 1e-9);
    CHECK_NEAR(s.first_tile_us, 4.0, 1e-9);        /* tiles 7 and 0: 4000 ns each */
    CHECK_NEAR(s.later_tile_us, 11.0 / 3, 1e-9);   /* tile 9 from its rows, 3000; tiles 2 and 4, 4000 */
    /* Block 1 took more tiles than its row holds: the rest, to its end, counts as tiles. */
    t[W + 2] = COMETI_TILE_TRACE_TILES + 5;
    for (int i = 3; i < COMETI_TILE_TRACE_TILES; i++) { /* tiles 3.. of 100 ns each, from 13300 */
        t[W + 4 + 4 * i + 2] = 13300 + 100ull * (i - 3);
        t[W + 4 + 4 * i + 3] = 13300 + 100ull * (i - 2);
    }
    t[W + 3] = 13300 + 100ull * (COMETI_TILE_TRACE_TILES - 3) + 500; /* 5 untraced tiles */
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_SUCCESS);
    CHECK_EQ(s.truncated, 1);
    CHECK_EQ(s.tiles, 2 + COMETI_TILE_TRACE_TILES + 5);
    CHECK_NEAR(s.launch_us + s.dispatch_us + s.wait_us + s.tiles_us + s.tail_us, s.span_us, 1e-9);
    /* A tile that ends before its rows were ready. */
    t[W + 2] = 3;
    t[W + 3] = 13400;
    t[W + 4 + 3] = 1250;
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "block 1's tile 0");
    memset(t, 0, 3 * W * sizeof(unsigned long long));
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "no block");
    free(t);
    return 0;
}

int test_routing_generators(void)
{
    const int m = 4096, k = 2, E = 8;
    int32_t *ids = malloc(sizeof(int32_t) * m * k);
    float *w = malloc(sizeof(float) * m * k);
    uint64_t seed = test_seed();
    for (int kind = 0; kind < 4; kind++) {
        cometi_make_routing((cometi_routing_t)kind, kind == 3 ? 5 : 16.0, m, k, E, seed, 1, ids, w);
        int64_t counts[8] = {0};
        CHECK_EQ(cometi_route_count(ids, m, k, E, counts), -1);
        for (int t = 0; t < m; t++) {
            CHECK(ids[t * k] != ids[t * k + 1]); /* distinct experts per token */
            CHECK_NEAR(w[t * k] + w[t * k + 1], 1.0, 1e-6);
            CHECK(w[t * k] > 0 && w[t * k + 1] > 0);
        }
        if (kind == COMETI_ROUTING_BALANCED)
            for (int e = 0; e < E; e++) CHECK_EQ(counts[e], m * k / E);
        if (kind == COMETI_ROUTING_SKEWED) CHECK(counts[0] > 4 * counts[E - 1]);
        if (kind == COMETI_ROUTING_ONE_EXPERT) CHECK(counts[5] == m);
    }
    /* Same seed, same routing; another seed, another routing. */
    int32_t *again = malloc(sizeof(int32_t) * m * k);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, E, seed, 0, ids, w);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, E, seed, 0, again, w);
    CHECK(memcmp(ids, again, sizeof(int32_t) * m * k) == 0);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, E, seed + 1, 0, again, w);
    CHECK(memcmp(ids, again, sizeof(int32_t) * m * k) != 0);
    free(again);
    free(ids);
    free(w);
    return 0;
}

int test_reference_known_answer(void)
{
    /* H = 2, F = 1, two experts, computed by hand:
     * expert 0: g = [1 0].x = 1, u = [0 1].x = 2, a = 2 silu(1), out = [a, -a]
     * expert 1: g = [0 .5].x = 1, u = [1 1].x = 3, a = 3 silu(1), out = [2a, 0] */
    const float x[2] = {1, 2};
    const int32_t ids[2] = {0, 1};
    const float w[2] = {0.25f, 0.75f};
    const float gate_up[2 * 2 * 2] = {1, 0, /* up */ 0, 1, /* expert 1 gate */ 0, 0.5f, /* up */ 1, 1};
    const float down[2 * 2 * 1] = {1, -1, /* expert 1 */ 2, 0};
    cometi_ref_problem_t p = {2, 1, 2, 2, 1, x, ids, w, gate_up, down};
    double y[2];
    cometi_reference_moe(&p, y);
    /* silu(1) = e / (1 + e) = 0.7310585786300049 (written out, not computed here): y0 =
     * 0.25 x 2 silu(1) + 0.75 x 2 x 3 silu(1) = 5 silu(1), y1 = -0.25 x 2 silu(1) = -0.5 silu(1). */
    CHECK_NEAR(y[0], 3.655292893150024, 1e-12);
    CHECK_NEAR(y[1], -0.3655292893150024, 1e-12);
    CHECK_NEAR(cometi_swiglu(0.0, 5.0), 0.0, 0);
    return 0;
}

int test_reference_properties(void)
{
    const int H = 64, F = 64, E = 4, k = 2, M = 16;
    uint64_t rng = test_seed();
    float *x = malloc(sizeof(float) * M * H), *gu = malloc(sizeof(float) * E * 2 * F * H),
          *dn = malloc(sizeof(float) * E * H * F), *w = malloc(sizeof(float) * M * k),
          *w2 = malloc(sizeof(float) * M * k);
    int32_t *ids = malloc(sizeof(int32_t) * M * k);
    for (int i = 0; i < M * H; i++) x[i] = (float)(2 * cometi_rand_unit(&rng) - 1);
    for (int i = 0; i < E * 2 * F * H; i++) gu[i] = (float)((2 * cometi_rand_unit(&rng) - 1) / 8);
    for (int i = 0; i < E * H * F; i++) dn[i] = (float)((2 * cometi_rand_unit(&rng) - 1) / 8);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, M, k, E, rng, 0, ids, w);
    double *y = malloc(sizeof(double) * M * H), *y2 = malloc(sizeof(double) * M * H);
    cometi_ref_problem_t p = {H, F, E, k, M, x, ids, w, gu, dn};
    cometi_reference_moe(&p, y);
    /* Linear in the routing weights: doubling them doubles y. */
    for (int i = 0; i < M * k; i++) w2[i] = 2 * w[i];
    p.topk_weights = w2;
    cometi_reference_moe(&p, y2);
    for (int i = 0; i < M * H; i++) CHECK_NEAR(y2[i], 2 * y[i], 1e-12 * (1 + fabs(y[i])));
    /* Each token on its own gives the same row: tokens do not interact. */
    p.topk_weights = w;
    for (int t = 0; t < M; t += 5) {
        cometi_ref_problem_t one = p;
        one.num_tokens = 1;
        one.x = x + (size_t)t * H;
        one.topk_ids = ids + (size_t)t * k;
        one.topk_weights = w + (size_t)t * k;
        cometi_reference_moe(&one, y2);
        for (int h = 0; h < H; h++) CHECK_NEAR(y2[h], y[(size_t)t * H + h], 1e-12);
    }
    /* rel_error: exact is 0, a NaN is infinite. */
    float *yf = malloc(sizeof(float) * M * H);
    for (int i = 0; i < M * H; i++) yf[i] = (float)y[i];
    CHECK(cometi_rel_error(yf, y, (size_t)M * H) < 1e-6);
    yf[7] = NAN;
    CHECK(isinf(cometi_rel_error(yf, y, (size_t)M * H)));
    free(x), free(gu), free(dn), free(w), free(w2), free(ids), free(y), free(y2), free(yf);
    return 0;
}

/* L = <dy, y>, in float64 from float inputs that are multiples of 2^-10, so x +- 2^-12 is
 * exact in float: the central difference (L(v + eps) - L(v - eps)) / 2 eps then differs
 * from dL/dv only by eps^2 / 6 x L''' (the sums are float64), far under the 1e-7 of the
 * gradients' scale allowed below. */
static double loss_of(const cometi_ref_problem_t *p, const float *dy, double *y)
{
    cometi_reference_moe(p, y);
    double l = 0.0;
    for (size_t i = 0; i < (size_t)p->num_tokens * p->hidden; i++) l += dy[i] * y[i];
    return l;
}

static int check_by_differences(cometi_ref_problem_t *p, const float *dy, float *v, size_t n, const double *grad,
                                const char *what)
{
    const float eps = 1.0f / 4096;
    double *y = malloc(sizeof(double) * (size_t)p->num_tokens * p->hidden), worst = 0, scale = 1e-30;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(grad[i]));
    for (size_t i = 0; i < n; i++) {
        const float keep = v[i];
        v[i] = keep + eps;
        const double hi = loss_of(p, dy, y);
        v[i] = keep - eps;
        const double lo = loss_of(p, dy, y);
        v[i] = keep;
        const double diff = fabs((hi - lo) / (2.0 * eps) - grad[i]);
        if (diff > worst) worst = diff;
        if (!(diff <= 1e-7 * scale)) {
            printf("%s[%zu]: difference quotient %.12g, gradient %.12g\n", what, i, (hi - lo) / (2.0 * eps), grad[i]);
            free(y);
            return 1;
        }
    }
    printf("%s: %zu elements, worst |difference - gradient| %.3g (scale %.3g)\n", what, n, worst, scale);
    free(y);
    return 0;
}

int test_reference_backward_matches_differences(void)
{
    const int H = 8, F = 4, E = 3, k = 2, M = 3;
    uint64_t rng = test_seed();
    /* Multiples of 2^-10 in (-1, 1) (see loss_of); weights renormalised then rounded alike. */
#define Q(scale) ((float)(floor((2 * cometi_rand_unit(&rng) - 1) * 1024 * (scale)) / 1024))
    float x[M * H], gu[E * 2 * F * H], dn[E * H * F], w[M * k], dy[M * H];
    int32_t ids[M * k];
    for (int i = 0; i < M * H; i++) x[i] = Q(1);
    for (int i = 0; i < E * 2 * F * H; i++) gu[i] = Q(0.5);
    for (int i = 0; i < E * H * F; i++) dn[i] = Q(0.5);
    for (int i = 0; i < M * H; i++) dy[i] = Q(1);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, M, k, E, rng, 0, ids, w);
    for (int i = 0; i < M * k; i++) w[i] = (float)(floor(w[i] * 1024) / 1024);
    ids[k] = ids[0]; /* token 1 shares an expert with token 0 (its weight gradient sums two rows) */
    if (ids[k + 1] == ids[k]) ids[k + 1] = (ids[k] + 1) % E;
#undef Q
    cometi_ref_problem_t p = {H, F, E, k, M, x, ids, w, gu, dn};
    double dx[M * H], dw[M * k], dgu[E * 2 * F * H], ddn[E * H * F];
    cometi_reference_moe_backward(&p, dy, dx, dw, dgu, ddn);
    if (check_by_differences(&p, dy, x, M * H, dx, "dx") ||
        check_by_differences(&p, dy, w, M * k, dw, "d topk_weights") ||
        check_by_differences(&p, dy, gu, E * 2 * F * H, dgu, "dgate_up") ||
        check_by_differences(&p, dy, dn, E * H * F, ddn, "ddown"))
        return 1;
    /* Outputs may be NULL, and the ones given are the same. */
    double dx2[M * H];
    cometi_reference_moe_backward(&p, dy, dx2, NULL, NULL, NULL);
    for (int i = 0; i < M * H; i++) CHECK(dx2[i] == dx[i]);
    return 0;
}
