/*
 * test_fp8_layer.c - the public comet_moe_forward in block-scaled FP8 (config.dtype
 * COMET_DTYPE_FP8_BLOCK) on the fused path, one rank per GPU up to two.
 *
 * The weights are random bf16 quantized by comet_quantize_fp8_weights and x is random bf16
 * quantized by comet_quantize_fp8_rows, both with power-of-two scales (the config's
 * fp8_pow2_scales too): then every dequantized value is a bf16 value exactly, so a bf16
 * layer can run on the very operands the FP8 layer sees (x quantized again by the FP8
 * layer gives its own bits back). Checked per shape (gate and up in one tensor with ffn
 * 256, apart with ffn 192: a half-full last SwiGLU tile and scale block; hidden 320: a
 * partial last k block; the second shape with every token's first choice on expert 0, so
 * that a rank's own rows of it fill two 128-row blocks, which the first wave copies and
 * computes beside the route):
 *   - y against float64 on those operands with the activation quantized as the layer does,
 *     element by element: |dy| <= sum over the token's choices of w times sum_f |W2| (2^-3
 *     |a_f| + 2^-9 s_f + e_a) (the GPU's activation may round to the neighbouring E4M3 step
 *     of float64's: one step, 2^-3 of |a|, plus subnormal steps; e_a the FP8 sums' 2^-6 of
 *     their |products| through SwiGLU), plus 2^-6 of GEMM1's |products| and bf16's 2^-8;
 *   - y against the bf16 layer on the same operands: DeepGEMM's measure 1 - 2 sum(xy) /
 *     sum(x^2 + y^2) < 1e-3 (only the activation's quantization and the sums' order differ);
 *   - the sequential path in FP8 (cuBLASLt's block-scaled GEMMs) within the same bound of
 *     float64, element by element;
 *   - bitwise the same on a second call, and with x given as E4M3 and its scales;
 *   - poisoned y before each call.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "base/fp8.h"
#include "../harness/launch.h"
#include "testutil.h"
#include "gpu_util.h"

#define E 8
#define TOP_K 2
#define H 320
#define TOKENS 300

/* Copy a device E4M3 tensor and its block scales (rows x cols per matrix, mats of them; the
 * scale blocks br x 128 rows by 128 columns) to the host, dequantized into `out`. */
static int dequantize_back(const void *q, const float *s, int mats, int rows, int cols, int br, float *out)
{
    const size_t n = (size_t)mats * rows * cols;
    const int sr = (rows + br - 1) / br, sc = (cols + 127) / 128;
    uint8_t *hq = malloc(n);
    float *hs = malloc(sizeof(float) * mats * sr * sc);
    CUDA_OK(cudaMemcpy(hq, q, n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hs, s, sizeof(float) * mats * sr * sc, cudaMemcpyDeviceToHost));
    for (int m = 0; m < mats; m++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                const size_t i = ((size_t)m * rows + r) * cols + c;
                out[i] = cometi_e4m3_decode(hq[i]) * hs[((size_t)m * sr + r / br) * sc + c / 128];
            }
    free(hq), free(hs);
    return 0;
}

/* bf16 bits of floats that are bf16 values exactly. */
static void to_bf16(const float *f, uint16_t *h, size_t n)
{
    for (size_t i = 0; i < n; i++) h[i] = cometi_float_to_bf16(f[i]);
}

static int fp8_shape(const cometi_rank_ctx_t *ctx, comet_comm_t comm, uint64_t seed, int F, int apart)
{
    const int W = ctx->nranks, me = ctx->rank, per = E / W, first = me * per;
    comet_moe_config_t cfg = COMET_MOE_CONFIG_INIT, cfg16;
    cfg.hidden = H, cfg.ffn = F, cfg.num_experts = E, cfg.top_k = TOP_K, cfg.max_tokens = TOKENS;
    cfg.dtype = COMET_DTYPE_FP8_BLOCK, cfg.fp8_pow2_scales = 1;
    cfg16 = cfg;
    cfg16.dtype = COMET_DTYPE_BF16, cfg16.fp8_pow2_scales = 0;
    comet_moe_t moe8, moe16;
    COMET_OK(comet_moe_create(comm, &cfg, &moe8), comm);
    COMET_OK(comet_moe_create(comm, &cfg16, &moe16), comm);
    uint64_t rng = seed ^ 0xf8f8f8f8ull;
    /* Every rank makes every expert's weights (the same seed), quantizes them and keeps its own. */
    const size_t n13 = (size_t)E * 2 * F * H, n2 = (size_t)E * H * F;
    float *w13 = malloc(n13 * 4), *w2 = malloc(n2 * 4);
    uint16_t *h13 = malloc(n13 * 2), *h2 = malloc(n2 * 2);
    fill_bf16(w13, h13, n13, 1.0 / sqrt(H), &rng);
    fill_bf16(w2, h2, n2, 1.0 / sqrt(F), &rng);
    void *d13, *d2, *q13, *q2;
    float *s13, *s2;
    /* gate_up [E][2F][H], or gate and up apart: [2E][F][H] (each expert's gate, then its up, as
     * separate matrices, so the scale blocks never hold both). */
    const int mats13 = apart ? 2 * E : E, rows13 = apart ? F : 2 * F;
    const size_t ns13 = (size_t)mats13 * ((rows13 + 127) / 128) * ((H + 127) / 128),
                 ns2 = (size_t)E * ((H + 127) / 128) * ((F + 127) / 128);
    CUDA_OK(cudaMalloc(&d13, n13 * 2));
    CUDA_OK(cudaMalloc(&d2, n2 * 2));
    CUDA_OK(cudaMalloc(&q13, n13));
    CUDA_OK(cudaMalloc(&q2, n2));
    CUDA_OK(cudaMalloc((void **)&s13, ns13 * 4));
    CUDA_OK(cudaMalloc((void **)&s2, ns2 * 4));
    CUDA_OK(cudaMemcpy(d13, h13, n13 * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d2, h2, n2 * 2, cudaMemcpyHostToDevice));
    CHECK_EQ(comet_quantize_fp8_weights(d13, mats13, rows13, H, 1, q13, s13, 0), COMET_SUCCESS);
    CHECK_EQ(comet_quantize_fp8_weights(d2, E, H, F, 1, q2, s2, 0), COMET_SUCCESS);
    if (dequantize_back(q13, s13, mats13, rows13, H, 128, w13) || dequantize_back(q2, s2, E, H, F, 128, w2)) return 1;
    /* The bf16 layer's weights: the dequantized ones, in the same layout. */
    to_bf16(w13, h13, n13), to_bf16(w2, h2, n2);
    CUDA_OK(cudaMemcpy(d13, h13, n13 * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d2, h2, n2 * 2, cudaMemcpyHostToDevice));
    /* Tokens and routing (each rank its own), x already on the E4M3 grid. */
    const int M = TOKENS - 37 * me;
    float *xf = malloc((size_t)M * H * 4), *wts = malloc(sizeof(float) * M * TOP_K);
    uint16_t *xh = malloc((size_t)M * H * 2);
    int32_t *ids = malloc(sizeof(int32_t) * M * TOP_K);
    fill_bf16(xf, xh, (size_t)M * H, 1.0, &rng);
    if (apart) cometi_make_routing(COMETI_ROUTING_ONE_EXPERT, 0, M, TOP_K, E, seed, me, ids, wts);
    else cometi_make_routing(COMETI_ROUTING_RANDOM, 1, M, TOP_K, E, seed, me, ids, wts);
    void *dx, *dxq, *dy;
    float *dxs, *dw;
    int32_t *did;
    const int kb = (H + 127) / 128;
    CUDA_OK(cudaMalloc(&dx, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc(&dxq, (size_t)M * H));
    CUDA_OK(cudaMalloc((void **)&dxs, sizeof(float) * M * kb));
    CUDA_OK(cudaMalloc(&dy, (size_t)M * H * 2));
    CUDA_OK(cudaMalloc((void **)&dw, sizeof(float) * M * TOP_K));
    CUDA_OK(cudaMalloc((void **)&did, sizeof(int32_t) * M * TOP_K));
    CUDA_OK(cudaMemcpy(dx, xh, (size_t)M * H * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dw, wts, sizeof(float) * M * TOP_K, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(did, ids, sizeof(int32_t) * M * TOP_K, cudaMemcpyHostToDevice));
    CHECK_EQ(comet_quantize_fp8_rows(dx, M, H, 1, dxq, dxs, 0), COMET_SUCCESS);
    if (dequantize_back(dxq, dxs, 1, M, H, 1, xf)) return 1;
    to_bf16(xf, xh, (size_t)M * H);
    CUDA_OK(cudaMemcpy(dx, xh, (size_t)M * H * 2, cudaMemcpyHostToDevice));
    /* The FP8 layer's args: this rank's experts. */
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = M, a.x = dx, a.topk_ids = did, a.topk_weights = dw, a.y = dy, a.impl = COMET_IMPL_FUSED;
    const size_t b13 = (size_t)(apart ? F : 2 * F) * H, bs13 = (size_t)((rows13 + 127) / 128) * kb;
    a.weights.down = (char *)q2 + (size_t)first * H * F;
    a.weight_scales.down = s2 + (size_t)first * ((H + 127) / 128) * ((F + 127) / 128);
    void *gate = NULL, *up = NULL;
    float *gs = NULL, *us = NULL;
    if (apart) {
        /* The gate and up tensors of this rank's experts, [per][F][H] each, from the interleaved matrices. */
        CUDA_OK(cudaMalloc(&gate, (size_t)per * F * H));
        CUDA_OK(cudaMalloc(&up, (size_t)per * F * H));
        CUDA_OK(cudaMalloc((void **)&gs, bs13 * per * 4));
        CUDA_OK(cudaMalloc((void **)&us, bs13 * per * 4));
        for (int e = 0; e < per; e++) {
            const int g = first + e;
            CUDA_OK(cudaMemcpy((char *)gate + (size_t)e * b13, (char *)q13 + (size_t)(2 * g) * b13, b13,
                               cudaMemcpyDeviceToDevice));
            CUDA_OK(cudaMemcpy((char *)up + (size_t)e * b13, (char *)q13 + (size_t)(2 * g + 1) * b13, b13,
                               cudaMemcpyDeviceToDevice));
            CUDA_OK(cudaMemcpy(gs + e * bs13, s13 + (2 * g) * bs13, bs13 * 4, cudaMemcpyDeviceToDevice));
            CUDA_OK(cudaMemcpy(us + e * bs13, s13 + (2 * g + 1) * bs13, bs13 * 4, cudaMemcpyDeviceToDevice));
        }
        a.weights.gate = gate, a.weights.up = up, a.weight_scales.gate = gs, a.weight_scales.up = us;
    } else {
        a.weights.gate_up = (char *)q13 + (size_t)first * b13;
        a.weight_scales.gate_up = s13 + (size_t)first * bs13;
    }
    /* Runs: FP8 twice, FP8 with x given quantized, then bf16. */
    const size_t ny = (size_t)M * H;
    uint16_t *y8 = malloc(ny * 2), *again = malloc(ny * 2), *yq = malloc(ny * 2), *y16 = malloc(ny * 2);
    uint16_t *outs[3] = {y8, again, yq};
    for (int run = 0; run < 3; run++) {
        a.x = run == 2 ? dxq : dx;
        a.x_scales = run == 2 ? dxs : NULL;
        CUDA_OK(cudaMemset(dy, 0xff, ny * 2));
        comet_status_t st = comet_moe_forward(moe8, &a, 0);
        if (st != COMET_SUCCESS) printf("rank %d FP8 forward: %s\n", me, comet_moe_last_error(moe8));
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaDeviceSynchronize());
        CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
        CUDA_OK(cudaMemcpy(outs[run], dy, ny * 2, cudaMemcpyDeviceToHost));
    }
    CHECK(memcmp(y8, again, ny * 2) == 0);
    CHECK(memcmp(y8, yq, ny * 2) == 0);
    /* The sequential path in FP8 (cuBLASLt's block-scaled GEMMs) on the same call. */
    uint16_t *yb = malloc(ny * 2);
    a.x = dx, a.x_scales = NULL, a.impl = COMET_IMPL_BASELINE;
    CUDA_OK(cudaMemset(dy, 0xff, ny * 2));
    COMET_OK(comet_moe_forward(moe8, &a, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(yb, dy, ny * 2, cudaMemcpyDeviceToHost));
    comet_moe_args_t a16 = COMET_MOE_ARGS_INIT;
    a16.num_tokens = M, a16.x = dx, a16.topk_ids = did, a16.topk_weights = dw, a16.y = dy;
    a16.impl = COMET_IMPL_FUSED;
    /* The bf16 layer takes gate and up in one tensor either way: [2E][F][H] is [E][2F][H]. */
    a16.weights.gate_up = (char *)d13 + (size_t)first * 2 * F * H * 2;
    a16.weights.down = (char *)d2 + (size_t)first * H * F * 2;
    CUDA_OK(cudaMemset(dy, 0xff, ny * 2));
    COMET_OK(comet_moe_forward(moe16, &a16, 0), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(y16, dy, ny * 2, cudaMemcpyDeviceToHost));
    /* float64, with the activation quantized per row per 128 columns as the layer does. */
    double xy = 0, xx = 0, worst = 0, dbn = 0, dbd = 0;
    int bad = 0;
    double *act = malloc(sizeof(double) * F), *aq = malloc(sizeof(double) * F), *aerr = malloc(sizeof(double) * F);
    double *y = malloc(sizeof(double) * H), *bound = malloc(sizeof(double) * H);
    for (int t = 0; t < M && bad < 5; t++) {
        for (int h = 0; h < H; h++) y[h] = 0, bound[h] = 0; /* bf16's rounding added below */
        for (int j = 0; j < TOP_K; j++) {
            const int e = ids[t * TOP_K + j];
            const double wj = wts[t * TOP_K + j];
            const float *x = xf + (size_t)t * H;
            /* expert e's gate rows, then its up rows ([2E][F][H] apart is [E][2F][H]) */
            const float *gate_w = w13 + (size_t)e * 2 * F * H, *up_w = gate_w + (size_t)F * H;
            for (int f = 0; f < F; f++) {
                double g = 0, u = 0, gs_ = 0, us_ = 0;
                for (int q = 0; q < H; q++) {
                    g += (double)x[q] * gate_w[(size_t)f * H + q], gs_ += fabs((double)x[q] * gate_w[(size_t)f * H + q]);
                    u += (double)x[q] * up_w[(size_t)f * H + q], us_ += fabs((double)x[q] * up_w[(size_t)f * H + q]);
                }
                act[f] = cometi_swiglu(g, u);
                aerr[f] = 1.1 * fabs(u) * 0x1p-6 * gs_ + (fabs(g) + 0.3) * 0x1p-6 * us_ + 0x1p-12 * gs_ * us_;
            }
            for (int b0 = 0; b0 < F; b0 += 128) { /* the activation's blocks, quantized as the epilogue does */
                float amax = 0;
                for (int f = b0; f < F && f < b0 + 128; f++) amax = cometi_fp8_max(amax, cometi_fp8_abs((float)act[f]));
                const float s = cometi_fp8_scale(amax, 1), inv = cometi_fp8_inverse(s);
                for (int f = b0; f < F && f < b0 + 128; f++) {
                    aq[f] = (double)cometi_e4m3_decode(cometi_fp8_quantize((float)act[f], inv)) * s;
                    aerr[f] += 0x1p-3 * fabs(act[f]) + 0x1p-9 * s;
                }
            }
            const float *down = w2 + (size_t)e * H * F;
            for (int h = 0; h < H; h++) {
                double o = 0, os = 0, ob = 0;
                for (int f = 0; f < F; f++) {
                    o += aq[f] * down[(size_t)h * F + f], os += fabs(aq[f] * down[(size_t)h * F + f]);
                    ob += fabs(down[(size_t)h * F + f]) * aerr[f];
                }
                y[h] += wj * o;
                bound[h] += fabs(wj) * (ob + 0x1p-6 * os);
            }
        }
        for (int h = 0; h < H && bad < 5; h++) {
            const double got = cometi_bf16_to_float(y8[(size_t)t * H + h]), b16 = cometi_bf16_to_float(y16[(size_t)t * H + h]);
            const double lim = bound[h] + 0x1p-8 * fabs(y[h]);
            const double seq = cometi_bf16_to_float(yb[(size_t)t * H + h]);
            if (!(fabs(got - y[h]) <= lim) || !(fabs(seq - y[h]) <= lim))
                bad++, printf("rank %d F %d token %d col %d: fused %.6g, sequential %.6g, float64 %.6g, bound %.3g\n",
                              me, F, t, h, got, seq, y[h], lim);
            dbn += (got - seq) * (got - seq), dbd += seq * seq;
            if (lim > 0 && fabs(got - y[h]) / lim > worst) worst = fabs(got - y[h]) / lim;
            xy += got * b16, xx += got * got + b16 * b16;
        }
    }
    const double measure = xx > 0 ? 1 - 2 * xy / xx : 0;
    printf("rank %d: FP8 ffn %d%s, %d tokens: worst |error| / bound %.3f against float64 (the sequential FP8 path "
           "within it too, ||fused - sequential|| / ||sequential|| %.2e); against bf16 on the same operands 1 - "
           "2xy/(x^2+y^2) = %.2e; bitwise repeatable, and with x given in E4M3\n", me, F,
           apart ? " (gate and up apart)" : "", M, worst, dbd > 0 ? sqrt(dbn / dbd) : 0, measure);
    CHECK_EQ(bad, 0);
    CHECK(measure < 1e-3);
    free(w13), free(w2), free(h13), free(h2), free(xf), free(wts), free(xh), free(ids), free(y8), free(again);
    free(yq), free(yb), free(y16), free(act), free(aq), free(aerr), free(y), free(bound);
    cudaFree(d13), cudaFree(d2), cudaFree(q13), cudaFree(q2), cudaFree(s13), cudaFree(s2), cudaFree(dx);
    cudaFree(dxq), cudaFree(dxs), cudaFree(dy), cudaFree(dw), cudaFree(did), cudaFree(gate), cudaFree(up);
    cudaFree(gs), cudaFree(us);
    COMET_OK(comet_moe_destroy(moe16), comm);
    COMET_OK(comet_moe_destroy(moe8), comm);
    return 0;
}

static int fp8_forward_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 20000, &comm)) return 1;
    if (fp8_shape(ctx, comm, seed, 256, 0) || fp8_shape(ctx, comm, seed + 1, 192, 1)) return 1;
    COMET_OK(comet_comm_destroy(comm), comm);
    return 0;
}

int test_gpu_fp8_forward(void) { return launch_seeded(fp8_forward_rank, 240); }
