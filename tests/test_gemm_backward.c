/*
 * test_gemm_backward.c - the grouped GEMM's backward forms on one GPU, against float64
 * element by element: B MN-major (the dgrad GEMMs read the weights as the forward keeps
 * them) and the weight gradient (groups along K, both operands MN-major).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "gemm/gemm.h"
#include "testutil.h"
#include "gpu_util.h"

/* A and B on the device, room for C (nc bf16) and a zeroed shared tile counter. */
static int upload_operands(const uint16_t *a16, size_t na, const uint16_t *b16, size_t nb, size_t nc, void **a,
                           void **b, void **c, unsigned int **sched)
{
    CUDA_OK(cudaMalloc(a, na * 2));
    CUDA_OK(cudaMalloc(b, nb * 2));
    CUDA_OK(cudaMalloc(c, nc * 2));
    CUDA_OK(cudaMalloc((void **)sched, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    CUDA_OK(cudaMemset(*sched, 0, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    CUDA_OK(cudaMemcpy(*a, a16, na * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(*b, b16, nb * 2, cudaMemcpyHostToDevice));
    return 0;
}

/* B MN-major (b_mn_major: B_g stored [k][n], as a dgrad GEMM reads a weight kept
 * [in][out]) against float64, element by element: C[r][j] = sum_k A[r][k] B_g[k][j] over
 * ragged groups (0, 1, 129, 300 and 77 rows), both tile widths, both epilogues, static
 * and shared-counter tiles, poisoned C. bf16 inputs, fp32 sums of k = 320 products, one
 * bf16 rounding of the result (2^-9): each element within 2^-8 of itself plus 1e-2 of its
 * row's RMS (its terms cancel), which a wrong column or k row misses by about 100%. */
static int gemm_b_mn_case(uint64_t rng, cometi_async_error_t *err_host, cometi_async_error_t *err_dev, int n)
{
    const int groups = 5, sizes[5] = {0, 1, 129, 300, 77}, k = 320;
    cometi_segment_t segs_host[5];
    const int rows = padded_segments(sizes, groups, segs_host) + 128;
    cometi_segment_t *segs;
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    const size_t na = (size_t)rows * k, nb = (size_t)groups * k * n, nc = (size_t)rows * n;
    uint16_t *a16 = malloc(na * 2), *b16 = malloc(nb * 2), *c16 = malloc(nc * 2);
    float *af = malloc(na * 4), *bf = malloc(nb * 4);
    double *ref = malloc(nc * sizeof(double));
    fill_bf16(af, a16, na, 1.0, &rng);
    fill_bf16(bf, b16, nb, 0.1, &rng);
    for (int g = 0; g < groups; g++)
        for (int r = segs_host[g].start; r < segs_host[g].start + segs_host[g].rows; r++)
            for (int j = 0; j < n; j++) {
                double acc = 0;
                for (int q = 0; q < k; q++) acc += (double)af[(size_t)r * k + q] * bf[((size_t)g * k + q) * n + j];
                ref[(size_t)r * n + j] = acc;
            }
    void *a, *b, *c;
    unsigned int *sched;
    if (upload_operands(a16, na, b16, nb, nc, &a, &b, &c, &sched)) return 1;
    for (int v = 0; v < 8; v++) {
        const int block_n = v & 1 ? 128 : 256, epilogue = v & 2 ? COMETI_EPILOGUE_DIRECT : COMETI_EPILOGUE_TMA,
                  dynamic = (v & 4) != 0;
        CUDA_OK(cudaMemset(c, 0xff, nc * 2)); /* poison: bf16 NaN */
        cometi_gemm_t g = {.a = a, .a_rows = rows, .b = b, .b_mn_major = 1, .c = c, .ldc = n, .segs = segs,
                           .groups = groups, .n = n, .k = k, .block_n = block_n, .epilogue = epilogue,
                           .sched = dynamic ? sched : NULL, .err = err_dev};
        char err[COMETI_ERR_LEN];
        if (cometi_gemm_run(err, &g, 0) != COMET_SUCCESS) {
            printf("cometi_gemm_run: %s\n", err);
            return 1;
        }
        CUDA_OK(cudaDeviceSynchronize());
        CHECK_EQ(err_host->status, 0);
        CUDA_OK(cudaMemcpy(c16, c, nc * 2, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (int gi = 0; gi < groups; gi++)
            for (int r = segs_host[gi].start; r < segs_host[gi].start + segs_host[gi].rows; r++) {
                double ss = 0;
                for (int j = 0; j < n; j++) ss += ref[(size_t)r * n + j] * ref[(size_t)r * n + j];
                const double rms = sqrt(ss / n);
                for (int j = 0; j < n; j++) {
                    const double got = cometi_bf16_to_float(c16[(size_t)r * n + j]), want = ref[(size_t)r * n + j];
                    const double limit = fabs(want) / 256 + 1e-2 * rms;
                    if (!(fabs(got - want) <= limit)) {
                        printf("block_n %d %s %s: C[%d][%d] = %.6g, float64 %.6g (limit %.3g)\n", block_n,
                               epilogue == COMETI_EPILOGUE_TMA ? "TMA" : "direct", dynamic ? "shared" : "static", r,
                               j, got, want, limit);
                        return 1;
                    }
                    if (fabs(got - want) / (rms + 1e-30) > worst) worst = fabs(got - want) / (rms + 1e-30);
                }
            }
        printf("B MN-major, n %d, block_n %d, %s epilogue, %s tiles: worst |error| / row RMS %.2e\n", n, block_n,
               epilogue == COMETI_EPILOGUE_TMA ? "TMA" : "direct", dynamic ? "shared-counter" : "static", worst);
    }
    /* Refused where it is not built: with SwiGLU, with ping-pong. */
    cometi_gemm_t bad = {.a = a, .a_rows = rows, .b = b, .b_mn_major = 1, .c = c, .ldc = n, .segs = segs,
                         .groups = groups, .n = n, .k = k, .swiglu = 1, .err = err_dev};
    char err[COMETI_ERR_LEN];
    CHECK_EQ(cometi_gemm_run(err, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "b_mn_major");
    bad.swiglu = 0, bad.schedule = COMETI_SCHEDULE_PINGPONG, bad.block_n = 256; /* ping-pong's one width */
    CHECK_EQ(cometi_gemm_run(err, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "b_mn_major");
    free(a16), free(b16), free(c16), free(af), free(bf), free(ref);
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(sched), cudaFree(segs);
    return 0;
}

/* n = 512, then 576 (4.5 x 128, 2.25 x 256: a partial last column tile at both widths). */
static int gemm_b_mn_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t rng = *(uint64_t *)arg;
    cometi_async_error_t *err_host, *err_dev;
    if (gemm_setup(ctx, &err_host, &err_dev)) return 1;
    for (int n = 512; n <= 576; n += 64)
        if (gemm_b_mn_case(rng + (uint64_t)n, err_host, err_dev, n)) return 1;
    return 0;
}

int test_gpu_gemm_b_mn_major(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, gemm_b_mn_rank, &seed, 110);
}

/* A weight gradient (wgrad: groups along K) against float64, element by element: per group
 * g, C_g [m_out][n] = A_g^T B_g over its rows of A [rows][m_out] and B [rows][n], ragged
 * groups (0, 1, 129, 300, 77 rows; padding rows zero, as the layout must give them), both
 * tile widths and epilogues, static and shared-counter tiles, poisoned C (the empty group
 * must come out zero). Sums of up to 300 products: each element within 2^-8 of itself
 * plus 1e-2 of its group's RMS. */
static int gemm_wgrad_case(uint64_t rng, cometi_async_error_t *err_host, cometi_async_error_t *err_dev, int m_out,
                           int n)
{
    const int groups = 5, sizes[5] = {0, 1, 129, 300, 77};
    cometi_segment_t segs_host[5];
    const int rows = padded_segments(sizes, groups, segs_host) + 128;
    cometi_segment_t *segs;
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    const size_t na = (size_t)rows * m_out, nb = (size_t)rows * n, nc = (size_t)groups * m_out * n;
    uint16_t *a16 = calloc(na, 2), *b16 = calloc(nb, 2), *c16 = malloc(nc * 2);
    float *af = calloc(na, 4), *bf = calloc(nb, 4);
    double *ref = calloc(nc, sizeof(double));
    for (int g = 0; g < groups; g++) { /* only the segments' rows: padding stays zero */
        const size_t r0 = (size_t)segs_host[g].start, r1 = r0 + segs_host[g].rows;
        fill_bf16(af + r0 * m_out, a16 + r0 * m_out, (r1 - r0) * m_out, 1.0, &rng);
        fill_bf16(bf + r0 * n, b16 + r0 * n, (r1 - r0) * n, 0.5, &rng);
        for (size_t r = r0; r < r1; r++)
            for (int i = 0; i < m_out; i++) {
                const double av = af[r * m_out + i];
                double *out = ref + ((size_t)g * m_out + i) * n;
                for (int j = 0; j < n; j++) out[j] += av * bf[r * n + j];
            }
    }
    void *a, *b, *c;
    unsigned int *sched;
    if (upload_operands(a16, na, b16, nb, nc, &a, &b, &c, &sched)) return 1;
    for (int v = 0; v < 8; v++) {
        const int block_n = v & 1 ? 128 : 256, epilogue = v & 2 ? COMETI_EPILOGUE_DIRECT : COMETI_EPILOGUE_TMA,
                  dynamic = (v & 4) != 0;
        CUDA_OK(cudaMemset(c, 0xff, nc * 2)); /* poison: bf16 NaN */
        cometi_gemm_t g = {.a = a, .a_rows = rows, .b = b, .wgrad = 1, .m_out = m_out, .c = c, .ldc = n,
                           .segs = segs, .groups = groups, .n = n, .block_n = block_n, .epilogue = epilogue,
                           .sched = dynamic ? sched : NULL, .err = err_dev};
        char err[COMETI_ERR_LEN];
        if (cometi_gemm_run(err, &g, 0) != COMET_SUCCESS) {
            printf("cometi_gemm_run: %s\n", err);
            return 1;
        }
        CUDA_OK(cudaDeviceSynchronize());
        CHECK_EQ(err_host->status, 0);
        CUDA_OK(cudaMemcpy(c16, c, nc * 2, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (int gi = 0; gi < groups; gi++) {
            const size_t c0 = (size_t)gi * m_out * n, cn = (size_t)m_out * n;
            double ss = 0;
            for (size_t i = 0; i < cn; i++) ss += ref[c0 + i] * ref[c0 + i];
            const double rms = sqrt(ss / (double)cn);
            for (size_t i = 0; i < cn; i++) {
                const double got = cometi_bf16_to_float(c16[c0 + i]), want = ref[c0 + i];
                const double limit = fabs(want) / 256 + 1e-2 * rms;
                if (!(fabs(got - want) <= limit)) {
                    printf("m_out %d n %d block_n %d %s %s: group %d C[%zu][%zu] = %.6g, float64 %.6g (limit "
                           "%.3g)\n", m_out, n, block_n, epilogue == COMETI_EPILOGUE_TMA ? "TMA" : "direct",
                           dynamic ? "shared" : "static", gi, i / n, i % n, got, want, limit);
                    return 1;
                }
                if (rms > 0 && fabs(got - want) / rms > worst) worst = fabs(got - want) / rms;
            }
        }
        printf("wgrad, m_out %d, n %d, block_n %d, %s epilogue, %s tiles: worst |error| / group RMS %.2e\n", m_out,
               n, block_n, epilogue == COMETI_EPILOGUE_TMA ? "TMA" : "direct", dynamic ? "shared-counter" : "static",
               worst);
    }
    cometi_gemm_t bad = {.a = a, .a_rows = rows, .b = b, .wgrad = 1, .m_out = 100, .c = c, .ldc = n, .segs = segs,
                         .groups = groups, .n = n, .err = err_dev};
    char err[COMETI_ERR_LEN];
    CHECK_EQ(cometi_gemm_run(err, &bad, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "m_out = 100");
    free(a16), free(b16), free(c16), free(af), free(bf), free(ref);
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(sched), cudaFree(segs);
    return 0;
}

/* m_out 256 and n 512, then m_out 192 (a partial last row tile) and n 576 (a partial last
 * column tile at both widths). */
static int gemm_wgrad_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t rng = *(uint64_t *)arg;
    cometi_async_error_t *err_host, *err_dev;
    if (gemm_setup(ctx, &err_host, &err_dev)) return 1;
    if (gemm_wgrad_case(rng, err_host, err_dev, 256, 512)) return 1;
    return gemm_wgrad_case(rng + 1, err_host, err_dev, 192, 576);
}

int test_gpu_gemm_wgrad(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, gemm_wgrad_rank, &seed, 110);
}
