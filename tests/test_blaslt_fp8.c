/*
 * test_blaslt_fp8.c - the FP8 yardstick GEMM (src/baseline/blaslt_fp8.h): its layouts
 * and refusals on the CPU (known answers), then on a GPU (skipping without one) cuBLASLt's
 * block-scaled GEMM per group against a float64 reference on the dequantized operands.
 *
 * The GPU cases: random finite E4M3 bytes and random positive scales, fresh for each call;
 * groups with ragged rows (0, 1, and counts that are multiples of neither 4, 16 nor 128)
 * placed with gaps in A and D, as the MoE layout's padded segments are; n and k off the
 * 128 grid (k = 2880 leaves a 64-wide last scale block, k = 64 a single partial one);
 * B's scales given in the HF layout and padded by cometi_blaslt_fp8_pad_b_scales; D
 * poisoned (bf16 NaN) before each call. Every element of every group's rows is checked
 * against the bound below; every row outside the groups' padded extents and every column
 * past n must still hold the poison. Each case runs twice on one handle (the second
 * call finds its shapes in the handle's table). The weight gradients' form (1 x 128 by
 * 1 x 128, k the tokens) the same way, written in bf16 and accumulated in fp32
 * (check_wgrad).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "baseline/blaslt_fp8.h"
#include "testutil.h"
#include "gpu_util.h"

/* ---- on the CPU ---- */

/* Layouts by hand: k = 2880 has L = 23 blocks (L4 = 24), rows 37, 0, 128, 1 pad to 40, 0,
 * 128, 8. The checks name the field, its value and the limit. */
int test_blaslt_fp8_layouts_and_checks(void)
{
    CHECK_EQ(cometi_blaslt_fp8_group_rows(0), 0);
    CHECK_EQ(cometi_blaslt_fp8_group_rows(1), COMETI_BLASLT_FP8_ROWS);
    CHECK_EQ(cometi_blaslt_fp8_group_rows(37), (37 + COMETI_BLASLT_FP8_ROWS - 1) / COMETI_BLASLT_FP8_ROWS *
                                                   COMETI_BLASLT_FP8_ROWS);
    CHECK_EQ(cometi_blaslt_fp8_group_rows(128), 128);
    CHECK_EQ(cometi_blaslt_fp8_b_scale_ld(2880), 24);
    CHECK_EQ(cometi_blaslt_fp8_b_scale_ld(7168), 56);
    CHECK_EQ(cometi_blaslt_fp8_b_scale_ld(16), 4);
    CHECK_EQ(cometi_blaslt_fp8_b_scale_ld(512), 4);
    const int64_t rows[4] = {37, 0, 128, 1};
    int64_t off[4];
    const int64_t r0 = cometi_blaslt_fp8_group_rows(37), r3 = cometi_blaslt_fp8_group_rows(1);
    CHECK_EQ(cometi_blaslt_fp8_a_scales_layout(4, rows, 2880, off), 23 * (r0 + 128 + r3));
    CHECK_EQ(off[0], 0);
    CHECK_EQ(off[1], 23 * r0);
    CHECK_EQ(off[2], 23 * r0);
    CHECK_EQ(off[3], 23 * (r0 + 128));
    if (COMETI_BLASLT_FP8_ROWS == 8) CHECK_EQ(cometi_blaslt_fp8_a_scales_layout(4, rows, 2880, NULL), 23 * 176);

    /* Stand-ins: 256-byte aligned addresses the checks never read. */
    static unsigned long long words[64] __attribute__((aligned(256)));
    void *p = words;
    const float *f = (const float *)words;
    char err[COMETI_ERR_LEN];
    const int64_t start[4] = {0, r0, r0, r0 + 128};
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1408, 2880, p, f, p, f, p, 1408), COMET_SUCCESS);
    CHECK_EQ(cometi_blaslt_fp8_check(err, 0, NULL, NULL, 1408, 2880, NULL, NULL, NULL, NULL, NULL, 1408),
             COMET_SUCCESS);
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1408, 2872, p, f, p, f, p, 1408), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "k = 2872 must be a multiple of 16");
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1404, 2880, p, f, p, f, p, 1408), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "n = 1404 must be a multiple of 8");
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1408, 2880, p, f, p, f, p, 1412), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "ldd = 1412 must be >= n = 1408 and a multiple of 8");
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1408, 2880, p, f, p, f, p, 1400), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "ldd = 1400");
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1408, 2880, (char *)p + 8, f, p, f, p, 1408),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a = ");
    CHECK_CONTAINS(err, "16-byte aligned");
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1408, 2880, p, f + 1, p, f, p, 1408),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a_scales = ");
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, rows, 1408, 2880, p, f, p, NULL, p, 1408), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "b_scales = ");
    const int64_t bad_rows[4] = {37, -1, 128, 1};
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, start, bad_rows, 1408, 2880, p, f, p, f, p, 1408),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "group 1 has rows = -1");
    /* Group 2 starting inside group 0's padding (its 37 rows compute as r0). */
    const int64_t early[4] = {0, r0, r0 - 1, 300};
    CHECK_EQ(cometi_blaslt_fp8_check(err, 4, early, rows, 1408, 2880, p, f, p, f, p, 1408), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "group 2 starts at row_start");
    CHECK_CONTAINS(err, "before group 0's padded end");
    /* The handle's absence is a usage error, checked first. */
    CHECK_EQ(cometi_blaslt_fp8_grouped(err, NULL, 4, start, rows, 1408, 2880, p, f, p, f, p, 1408, 0),
             COMET_INVALID_USAGE);

    /* The weight gradients' form: groups on whole 128-column blocks within lda and ldb. */
    const int64_t ks[3] = {0, 256, 256}, kl[3] = {256, 0, 384};
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 3, ks, kl, 4096, 1408, p, 768, f, p, 640, f, p), COMET_SUCCESS);
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 0, NULL, NULL, 4096, 1408, NULL, 16, NULL, NULL, 16, NULL, NULL),
             COMET_SUCCESS);
    const int64_t none[2] = {0, 0}; /* no tokens: only d is written (zeros) */
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 2, none, none, 64, 64, NULL, 16, NULL, NULL, 16, NULL, p),
             COMET_SUCCESS);
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 3, ks, kl, 4092, 1408, p, 768, f, p, 768, f, p), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "m = 4092");
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 3, ks, kl, 4096, 1408, p, 760, f, p, 768, f, p),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "lda = 760");
    const int64_t off_grid[3] = {0, 200, 256};
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 3, off_grid, kl, 4096, 1408, p, 768, f, p, 768, f, p),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "k_start = 200");
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 3, ks, kl, 4096, 1408, p, 768, f, p, 512, f, p),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "past lda = 768 or ldb = 512");
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 3, ks, kl, 4096, 1408, p, 768, f + 2, p, 768, f, p),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a_scales");
    CHECK_EQ(cometi_blaslt_fp8_wgrad_check(err, 3, NULL, kl, 4096, 1408, p, 768, f, p, 768, f, p),
             COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "host arrays");
    CHECK_EQ(cometi_blaslt_fp8_wgrad(err, NULL, 3, ks, kl, 4096, 1408, p, 768, f, p, 768, f, p, 0, 0, 0),
             COMET_INVALID_USAGE);
    /* No handle, or no GEMM run yet: no algorithm to describe. */
    char algo[64] = "stale";
    cometi_blaslt_fp8_algo_text(NULL, algo, sizeof(algo));
    CHECK(algo[0] == '\0');
    return 0;
}

/* ---- on a GPU ---- */

/* E4M3 (fn: bias 7, no infinities, S.1111.111 the NaN) to its value. */
static double e4m3_value(uint8_t q)
{
    const int sign = q >> 7, e = (q >> 3) & 15, m = q & 7;
    const double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return sign ? -v : v;
}

/* A random finite E4M3 code: any byte but the two NaNs. */
static uint8_t random_e4m3(uint64_t *rng)
{
    for (;;) {
        const uint8_t q = (uint8_t)cometi_rand_next(rng);
        if ((q & 0x7f) != 0x7f) return q;
    }
}

/* A random positive scale, 2^-10 .. 2^-1 times 1 .. 2. */
static float random_scale(uint64_t *rng)
{
    return (float)ldexp(1.0 + cometi_rand_unit(rng), -(int)(1 + cometi_rand_next(rng) % 10));
}

#define MAX_GROUPS 8
typedef struct blaslt_case {
    int n, k, groups;
    int64_t rows[MAX_GROUPS];
} blaslt_case_t;

/* The error bound, per element of D (i, j), with T = sum over l of |a_il b_jl| on the
 * dequantized operands and L = ceil(k / 128):
 *   |d - ref| <= 2^-8 |ref| + (2^-9 + (L + 1) 2^-23) T.
 * Why: the reference is float64 on exact values (an E4M3 product has 8 significant bits, a
 * product of two FP32 scales 48: sums of them lose nothing that matters at 2^-53). cuBLASLt
 * (fast accumulation off) sums each 128-wide k block on the tensor cores, whose FP8
 * accumulation keeps about 14 bits (DeepSeek-V3's report, section 3.3.2: the reason the
 * recipe promotes every 128 elements), over 4 k32 steps: at most 8 roundings of 2^-13 of
 * the block's sum of |products|, 2^-10 of it, doubled for an internal order we cannot
 * see: 2^-9 T. The block sums scaled and added in FP32, L + 1 roundings of 2^-24 each
 * (2^-23 with margin) of at most T. The bf16 output rounds once, to nearest: 2^-8 |ref|
 * (8 significant bits), the FP32 value's own error rounded along with it being covered by
 * the margins above. A wrong scale block, row or group breaks this by whole blocks'
 * contributions, and the norm-wise check (2^-7 of ||ref||, where rounding alone gives
 * about 2^-9) catches what a loose element bound could miss. */
static int check_case(cometi_blaslt_fp8_t *lt, const blaslt_case_t *c, cudaStream_t stream, uint64_t *rng)
{
    const int n = c->n, k = c->k, G = c->groups, L = (k + 127) / 128, L4 = cometi_blaslt_fp8_b_scale_ld(k);
    const int nb = (n + 127) / 128, ldd = n + 8;
    /* Groups placed in order with 0 .. 5 free rows between their padded extents and 3
     * guard rows at each end. */
    int64_t start[MAX_GROUPS], padded[MAX_GROUPS], off[MAX_GROUPS];
    int64_t total = 3;
    for (int g = 0; g < G; g++) {
        start[g] = total;
        padded[g] = cometi_blaslt_fp8_group_rows(c->rows[g]);
        total += padded[g] + (c->rows[g] ? (int64_t)(cometi_rand_next(rng) % 6) : 0);
    }
    total += 3;
    const int64_t a_scale_floats = cometi_blaslt_fp8_a_scales_layout(G, c->rows, k, off);
    const size_t a_bytes = (size_t)total * k, b_bytes = (size_t)G * n * k, d_elems = (size_t)total * ldd;
    const size_t bs_hf = (size_t)G * nb * L, bs_pad = (size_t)G * nb * L4;
    uint8_t *a = malloc(a_bytes), *b = malloc(b_bytes);
    float *as = malloc(sizeof(float) * (a_scale_floats + 1)), *bs = malloc(sizeof(float) * bs_hf);
    float *bs_back = malloc(sizeof(float) * bs_pad);
    uint16_t *d = malloc(sizeof(uint16_t) * d_elems);
    double *av = malloc(sizeof(double) * (size_t)k), *bv = malloc(sizeof(double) * (size_t)n * k);
    CHECK(a && b && as && bs && bs_back && d && av && bv);
    for (size_t i = 0; i < a_bytes; i++) a[i] = random_e4m3(rng); /* gaps and padding rows too */
    for (size_t i = 0; i < b_bytes; i++) b[i] = random_e4m3(rng);
    for (int64_t i = 0; i < a_scale_floats; i++) as[i] = 1.0f; /* the padding rows' */
    for (int g = 0; g < G; g++)
        for (int blk = 0; blk < L; blk++)
            for (int64_t r = 0; r < c->rows[g]; r++) as[off[g] + blk * padded[g] + r] = random_scale(rng);
    for (size_t i = 0; i < bs_hf; i++) bs[i] = random_scale(rng);

    void *da, *db, *dd;
    float *das, *dbs_hf, *dbs;
    CUDA_OK(cudaMalloc(&da, a_bytes));
    CUDA_OK(cudaMalloc(&db, b_bytes));
    CUDA_OK(cudaMalloc(&dd, d_elems * 2));
    CUDA_OK(cudaMalloc((void **)&das, sizeof(float) * (a_scale_floats + 1)));
    CUDA_OK(cudaMalloc((void **)&dbs_hf, sizeof(float) * bs_hf));
    CUDA_OK(cudaMalloc((void **)&dbs, sizeof(float) * bs_pad));
    CUDA_OK(cudaMemcpy(da, a, a_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(db, b, b_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(das, as, sizeof(float) * (a_scale_floats + 1), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dbs_hf, bs, sizeof(float) * bs_hf, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dbs, 0xff, sizeof(float) * bs_pad)); /* NaN: the padding must be written */
    CUDA_OK(cudaMemset(dd, 0xff, d_elems * 2));              /* bf16 NaN everywhere */
    char err[COMETI_ERR_LEN] = "";
    comet_status_t st = cometi_blaslt_fp8_pad_b_scales(err, G, n, k, dbs_hf, dbs, stream);
    if (st != COMET_SUCCESS) printf("pad_b_scales: %s: %s\n", comet_status_string(st), err);
    CHECK_EQ(st, COMET_SUCCESS);
    st = cometi_blaslt_fp8_grouped(err, lt, G, start, c->rows, n, k, da, das, db, dbs, dd, ldd, stream);
    if (st != COMET_SUCCESS) printf("grouped: %s: %s\n", comet_status_string(st), err);
    CHECK_EQ(st, COMET_SUCCESS);
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(d, dd, d_elems * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(bs_back, dbs, sizeof(float) * bs_pad, cudaMemcpyDeviceToHost));
    /* B's scales padded: each HF row at its L4 stride, the padding zero. */
    for (size_t r = 0; r < (size_t)G * nb; r++)
        for (int blk = 0; blk < L4; blk++)
            CHECK(bs_back[r * L4 + blk] == (blk < L ? bs[r * L + blk] : 0.0f));

    /* Each row's owner: its group's index for its rows, -2 for a padding row, -1 else. */
    int *owner = malloc(sizeof(int) * total);
    for (int64_t r = 0; r < total; r++) owner[r] = -1;
    for (int g = 0; g < G; g++)
        for (int64_t r = 0; r < padded[g]; r++) owner[start[g] + r] = r < c->rows[g] ? g : -2;
    double num = 0, den = 0, worst = 0;
    long long checked = 0;
    int decoded = -1; /* the group whose B bv holds */
    for (int64_t r = 0; r < total; r++) {
        const uint16_t *dr = d + (size_t)r * ldd;
        const int g = owner[r];
        for (int j = g == -1 ? 0 : n; j < ldd; j++)
            if (dr[j] != 0xffff) {
                printf("row %lld (%s), column %d: 0x%04x written, poison expected\n", (long long)r,
                       g == -2 ? "padding" : (g >= 0 ? "a group's, past n" : "outside the groups"), j, dr[j]);
                return 1;
            }
        if (g < 0) continue;
        const int64_t lr = r - start[g];
        if (decoded != g)
            for (size_t i = 0; i < (size_t)n * k; i++) bv[i] = e4m3_value(b[(size_t)g * n * k + i]);
        decoded = g;
        for (int q = 0; q < k; q++) av[q] = e4m3_value(a[(size_t)r * k + q]);
        for (int j = 0; j < n; j++) {
            const double *bj = bv + (size_t)j * k;
            double ref = 0, t = 0;
            for (int blk = 0; blk < L; blk++) {
                const double s = (double)as[off[g] + blk * padded[g] + lr] * bs[((size_t)g * nb + j / 128) * L + blk];
                double p = 0, pa = 0;
                for (int q = blk * 128; q < k && q < blk * 128 + 128; q++) {
                    const double x = av[q] * bj[q];
                    p += x, pa += fabs(x);
                }
                ref += s * p, t += s * pa;
            }
            const double got = cometi_bf16_to_float(dr[j]);
            const double bound = ldexp(fabs(ref), -8) + (ldexp(1, -9) + (L + 1) * ldexp(1, -23)) * t;
            const double e = fabs(got - ref);
            if (!(e <= bound)) {
                printf("group %d row %lld column %d: %.9g, want %.9g (|error| %.3g > bound %.3g; sum |ab| %.3g)\n", g,
                       (long long)lr, j, got, ref, e, bound, t);
                return 1;
            }
            if (t > 0 && e / t > worst) worst = e / t;
            num += e * e, den += ref * ref;
            checked++;
        }
    }
    const double rel = den > 0 ? sqrt(num / den) : 0;
    printf("n %4d k %4d groups %d: %lld elements, ||d - ref|| / ||ref|| %.2e, worst |error| / sum |ab| %.2e\n", n, k,
           G, checked, rel, worst);
    CHECK(rel <= ldexp(1, -7));
    free(a), free(b), free(as), free(bs), free(bs_back), free(d), free(av), free(bv), free(owner);
    cudaFree(da), cudaFree(db), cudaFree(dd), cudaFree(das), cudaFree(dbs_hf), cudaFree(dbs);
    return 0;
}

/* The weight gradients' form (cometi_blaslt_fp8_wgrad) on one case: A [m][lda], B [n][ldb]
 * random finite E4M3 with random 1 x 128 scales along k ([lda / 128][m], [ldb / 128][n]);
 * groups on 128-column blocks with gaps between them (and one without tokens); D [G][m][n]
 * once written in bf16 over poison (a group without tokens must come back zero) and once
 * accumulated in fp32 onto random values (that group's left as they were). The bound is
 * check_case's, with T and L over the group's k; fp32 output adds one rounding of the sum
 * (2^-24 of |start + ref|, 2^-23 with margin) in place of bf16's 2^-8 |ref|. */
typedef struct wgrad_case {
    int m, n, groups;
    int64_t lda, ldb, k_start[MAX_GROUPS], k_len[MAX_GROUPS];
} wgrad_case_t;

static int check_wgrad(cometi_blaslt_fp8_t *lt, const wgrad_case_t *c, cudaStream_t stream, uint64_t *rng)
{
    const int m = c->m, n = c->n, G = c->groups;
    const int64_t la = (c->lda + 127) / 128, lb = (c->ldb + 127) / 128;
    const size_t a_bytes = (size_t)m * c->lda, b_bytes = (size_t)n * c->ldb, d_elems = (size_t)G * m * n;
    uint8_t *a = malloc(a_bytes), *b = malloc(b_bytes);
    float *as = malloc(sizeof(float) * la * m), *bs = malloc(sizeof(float) * lb * n);
    float *start = malloc(sizeof(float) * d_elems), *got32 = malloc(sizeof(float) * d_elems);
    uint16_t *got16 = malloc(sizeof(uint16_t) * d_elems);
    CHECK(a && b && as && bs && start && got32 && got16);
    for (size_t i = 0; i < a_bytes; i++) a[i] = random_e4m3(rng);
    for (size_t i = 0; i < b_bytes; i++) b[i] = random_e4m3(rng);
    for (int64_t i = 0; i < la * m; i++) as[i] = random_scale(rng);
    for (int64_t i = 0; i < lb * n; i++) bs[i] = random_scale(rng);
    for (size_t i = 0; i < d_elems; i++) start[i] = (float)(cometi_rand_unit(rng) - 0.5);
    void *da, *db, *dd;
    float *das, *dbs;
    CUDA_OK(cudaMalloc(&da, a_bytes));
    CUDA_OK(cudaMalloc(&db, b_bytes));
    CUDA_OK(cudaMalloc(&dd, d_elems * 4));
    CUDA_OK(cudaMalloc((void **)&das, sizeof(float) * la * m));
    CUDA_OK(cudaMalloc((void **)&dbs, sizeof(float) * lb * n));
    CUDA_OK(cudaMemcpy(da, a, a_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(db, b, b_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(das, as, sizeof(float) * la * m, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dbs, bs, sizeof(float) * lb * n, cudaMemcpyHostToDevice));
    char err[COMETI_ERR_LEN] = "";
    for (int fp32 = 0; fp32 < 2; fp32++) {
        if (fp32) CUDA_OK(cudaMemcpy(dd, start, d_elems * 4, cudaMemcpyHostToDevice));
        else CUDA_OK(cudaMemset(dd, 0xff, d_elems * 2)); /* bf16 NaN */
        const comet_status_t st = cometi_blaslt_fp8_wgrad(err, lt, G, c->k_start, c->k_len, m, n, da, c->lda, das, db,
                                                          c->ldb, dbs, dd, fp32, fp32, stream);
        if (st != COMET_SUCCESS) printf("wgrad (%s): %s: %s\n", fp32 ? "fp32 accumulate" : "bf16", comet_status_string(st),
                                        err);
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaStreamSynchronize(stream));
        if (fp32) CUDA_OK(cudaMemcpy(got32, dd, d_elems * 4, cudaMemcpyDeviceToHost));
        else CUDA_OK(cudaMemcpy(got16, dd, d_elems * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        for (int g = 0; g < G; g++) {
            const int64_t k0 = c->k_start[g], L = c->k_len[g] / 128;
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    double ref = 0, t = 0;
                    for (int64_t blk = k0 / 128; blk < k0 / 128 + L; blk++) {
                        const double s = (double)as[blk * m + i] * bs[blk * n + j];
                        double p = 0, pa = 0;
                        for (int64_t q = blk * 128; q < blk * 128 + 128; q++) {
                            const double x = e4m3_value(a[(size_t)i * c->lda + q]) * e4m3_value(b[(size_t)j * c->ldb + q]);
                            p += x, pa += fabs(x);
                        }
                        ref += s * p, t += s * pa;
                    }
                    const size_t at = ((size_t)g * m + i) * n + j;
                    const double base = fp32 ? start[at] : 0, want = base + ref;
                    const double v = fp32 ? got32[at] : cometi_bf16_to_float(got16[at]);
                    const double bound = (fp32 ? ldexp(fabs(want), -23) : ldexp(fabs(ref), -8)) +
                                         (ldexp(1, -9) + (L + 1) * ldexp(1, -23)) * t;
                    if (!(fabs(v - want) <= bound)) {
                        printf("wgrad %s group %d (k %lld from %lld) d[%d][%d] = %.9g, want %.9g (bound %.3g)\n",
                               fp32 ? "fp32" : "bf16", g, (long long)c->k_len[g], (long long)k0, i, j, v, want, bound);
                        return 1;
                    }
                    num += (v - want) * (v - want), den += want * want;
                }
        }
        const double rel = den > 0 ? sqrt(num / den) : 0;
        printf("wgrad m %d n %d groups %d, %s: ||d - ref|| / ||ref|| %.2e\n", m, n, G, fp32 ? "fp32 accumulate" : "bf16",
               rel);
        CHECK(rel <= ldexp(1, -7));
    }
    free(a), free(b), free(as), free(bs), free(start), free(got32), free(got16);
    cudaFree(da), cudaFree(db), cudaFree(dd), cudaFree(das), cudaFree(dbs);
    return 0;
}

static int blaslt_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg;
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    const blaslt_case_t cases_[] = {
        {1408, 2880, 5, {37, 0, 129, 1, 67}}, /* qwen2-moe's ffn x gpt-oss's hidden: a 64-wide last block */
        {200, 208, 3, {5, 17, 0}},            /* a partial n block and k block */
        {64, 64, 2, {3, 9}},                  /* one partial k block (TE tests k = 64 too) */
        {256, 512, 4, {16, 128, 0, 33}},      /* whole blocks */
        {64, 128, 2, {0, 0}},                 /* no rows: nothing written */
    };
    char err[COMETI_ERR_LEN] = "";
    cometi_blaslt_fp8_t *lt = NULL;
    comet_status_t st = cometi_blaslt_fp8_create(err, &lt);
    if (st != COMET_SUCCESS) printf("create: %s: %s\n", comet_status_string(st), err);
    CHECK_EQ(st, COMET_SUCCESS);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int run = 0; run < 2; run++)
        for (size_t i = 0; i < sizeof(cases_) / sizeof(cases_[0]); i++)
            if (check_case(lt, &cases_[i], stream, &rng)) {
                printf("case %zu (n %d, k %d), call %d failed\n", i, cases_[i].n, cases_[i].k, run + 1);
                return 1;
            }
    const wgrad_case_t wcases[] = {
        {136, 200, 3, 784, 768, {0, 256, 384}, {256, 0, 384}}, /* a group without tokens, lda != ldb */
        {64, 320, 2, 512, 512, {128, 256}, {128, 256}},        /* a gap before the first group */
    };
    for (size_t i = 0; i < sizeof(wcases) / sizeof(wcases[0]); i++)
        if (check_wgrad(lt, &wcases[i], stream, &rng)) {
            printf("wgrad case %zu (m %d, n %d) failed\n", i, wcases[i].m, wcases[i].n);
            return 1;
        }
    /* A refusal through the handle names the field. */
    const int64_t start = 0, rows = 8;
    CHECK_EQ(cometi_blaslt_fp8_grouped(err, lt, 1, &start, &rows, 64, 100, (void *)256, (float *)256, (void *)256,
                                       (float *)256, (void *)256, 64, stream),
             COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "k = 100");
    cudaStreamDestroy(stream);
    cometi_blaslt_fp8_destroy(lt);
    return 0;
}

int test_gpu_blaslt_fp8_grouped(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, blaslt_rank, &seed, 170);
}
