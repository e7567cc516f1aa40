/*
 * test_baseline_fp8.c - the sequential baseline's block-scaled FP8 inference forward
 * (config.dtype COMET_DTYPE_FP8_BLOCK, COMET_IMPL_BASELINE) on one GPU, skipping without
 * one.
 *
 * Each case draws fresh bf16 weights and tokens in which every block (1 x 128 of a token
 * row, 128 x 128 of a weight) has its own magnitude, up to 2^3 apart, so a scale taken from
 * the wrong block, row or expert shows; quantizes the weights on the GPU
 * (comet_quantize_fp8_weights) and x on the host (base/fp8.h: the bytes the GPU makes,
 * which gpu_quantize_fp8 holds it to), passing x as bf16 or as E4M3 with its scales; routes
 * at random with expert 3 given no rows; poisons y (bf16 NaN) and runs the layer twice,
 * which must give the same bytes. Shapes: hidden 256 and 320 (a 64-wide last scale
 * block), ffn 256 and 192 (a partial block; gate and up apart there, as comet.h asks),
 * gate_up in one tensor and apart, power-of-two scales on and off.
 *
 * The checks, all against float64 on the dequantized operands:
 *   1. stage by stage, on the layer's own buffers (baseline.h): every E4M3 byte received
 *      and every scale GEMM0 reads (packed by group) is the host's, padding rows zero;
 *      the bf16 activation within its bound of float64's (below); its quantization the
 *      host's byte for byte; y within GEMM1's bound of float64 on that quantized activation;
 *   2. end to end, y against the reference that quantizes float64's own activation,
 *      element by element with a bound that covers any activation byte a step away from
 *      the reference's, and norm-wise;
 *   3. DeepGEMM's measure 1 - 2 sum(xy) / sum(x^2 + y^2) of y against the bf16 baseline
 *      on the same dequantized weights (rounded to bf16) and x before its quantization,
 *      beside the value the quantization alone gives in float64.
 *
 * The bounds. L0 = ceil(H / 128), L1 = ceil(F / 128); c(L) = 2^-9 + (L + 1) 2^-23 is
 * cuBLASLt's accumulation bound per unit of sum |products| (test_blaslt_fp8.c derives it);
 * u = 2^-8 is bf16's rounding (8 significant bits, to nearest).
 *   activation: g, u exact on the dequantized x and weights, T_g = sum_h |x_h W_gh| (T_u
 *     alike); the GPU's bf16 g is within e_g = c(L0) T_g + u (|g| + c(L0) T_g) (u alike);
 *     silu is 1.1-Lipschitz (its slope peaks at 1.0998), so silu(g') u' is within
 *     d = 1.1 e_g (|u| + e_u) + |silu(g)| e_u of a = silu(g) u; SwiGLU's fp32 arithmetic
 *     (__expf's few ulps) and its bf16 output add (u + 2^-13)(|a| + d): delta.
 *   a byte a step off: the GPU quantizes its own activation a' (|a' - a| <= delta) with its
 *     own block scale s' (at most the scale of the block's largest |a| + delta), so its
 *     value is within |a'| / 16 + s' / 1024 of a' (comet.h's bound) and the reference's is
 *     |aq - a| from a: D = |aq - a| + delta + (|a| + delta) / 16 + s' / 1024 per element.
 *     Summed against down's weights that covers every byte differing, which makes the
 *     element bound sum_f D |W2| loose (most bytes agree); the norm-wise check is the
 *     sharp one there: a byte differs where a' and a straddle a rounding point, a few
 *     percent of them (|a' - a| ~ 2^-8 |a| against steps of 2^-3.5 |a|), each by a step,
 *     so ||y - ref|| / ||ref|| comes to about 2%; 2^-4 is allowed (a scale from the
 *     wrong block or a lost choice costs tens of percent), and 2^-2 per token row (a row
 *     that a few large activations dominate averages fewer flips: up to 8% was seen in an
 *     emulation of these cases on the host; a lost or foreign choice costs over 50%).
 *   GEMM1 and the sum: each choice's row o within c(L1) T_1 + u (|o| + c(L1) T_1) (T_1 =
 *     sum_f |a_f W2_hf| on the quantized activation), the weighted sum of the top_k rows in
 *     fp32 (2^-20 of sum w |o|, generously), then y's bf16 rounding u (|y| + that).
 *   DeepGEMM's measure: quantizing x, then the activation (1 x 128 E4M3 blocks, about
 *     2.5% relative error each) leaves about 3 x 2.5%^2 / 2 ~ 1e-3 where DeepGEMM's own
 *     test (x and the weight quantized) expects under 1e-3; the float64 value of this
 *     data is printed beside it, and the GPU's must stay within twice it and under 2e-3.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "base/fp8.h"
#include "baseline/baseline.h"
#include "layer/layer.h"
#include "testutil.h"
#include "gpu_util.h"

#define NE 8           /* experts, all on the one rank */
#define TOPK 2
#define MAXT 256       /* config.max_tokens */
#define EMPTY_EXPERT 3 /* routed no rows */
#define U8 0x1p-8      /* bf16's rounding, to nearest */

typedef struct fp8_case {
    const char *name;
    int hidden, ffn;
    int gate_up; /* 1: one gate_up tensor; 0: gate and up apart */
    int x_fp8;   /* 1: x given as E4M3 with its scales (args.x_scales) */
    int pow2;    /* config.fp8_pow2_scales (the weights' too) */
    int tokens;
} fp8_case_t;

static const fp8_case_t fp8_cases[] = {
    {"H 256, F 256, gate_up, x bf16", 256, 256, 1, 0, 0, 200},
    {"H 256, F 256, gate and up, x E4M3, pow2", 256, 256, 0, 1, 1, 197},
    {"H 320, F 192, gate and up, x bf16, pow2", 320, 192, 0, 0, 1, 203},
    {"H 320, F 192, gate and up, x E4M3", 320, 192, 0, 1, 0, 211},
    {"H 320, F 256, gate_up, x E4M3, pow2", 320, 256, 1, 1, 1, 190},
};

static int cdiv(int a, int b) { return (a + b - 1) / b; }
static double cbound(int blocks) { return 0x1p-9 + (blocks + 1) * 0x1p-23; }

/* bf16 [mats][rows][cols], uniform in +-scale times a power of two from 2^-spread to
 * 2^spread drawn for each block of block_rows x 128 (1 for token rows, 128 for weights). */
static void fill_blocks(uint16_t *h, int mats, int rows, int cols, int block_rows, double scale, int spread,
                        uint64_t *rng)
{
    for (int m = 0; m < mats; m++)
        for (int r0 = 0; r0 < rows; r0 += block_rows)
            for (int c0 = 0; c0 < cols; c0 += 128) {
                const double mag = ldexp(scale, (int)(cometi_rand_next(rng) % (uint64_t)(2 * spread + 1)) - spread);
                for (int r = r0; r < rows && r < r0 + block_rows; r++)
                    for (int c = c0; c < cols && c < c0 + 128; c++)
                        h[((size_t)m * rows + r) * cols + c] =
                            cometi_float_to_bf16((float)((2 * cometi_rand_unit(rng) - 1) * mag));
            }
}

/* Rows of floats quantized as the layer's kernel does them (base/fp8.h): q [rows][cols],
 * scales [rows][ceil(cols / 128)], and (deq not NULL) their values q x scale. */
static void quantize_rows(const float *x, int rows, int cols, int pow2, uint8_t *q, float *s, double *deq)
{
    const int L = cdiv(cols, 128);
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < L; b++) {
            const int c0 = b * 128, c1 = c0 + 128 < cols ? c0 + 128 : cols;
            float amax = 0.0f;
            for (int c = c0; c < c1; c++) amax = cometi_fp8_max(amax, cometi_fp8_abs(x[(size_t)r * cols + c]));
            const float scale = cometi_fp8_scale(amax, pow2), inv = cometi_fp8_inverse(scale);
            s[(size_t)r * L + b] = scale;
            for (int c = c0; c < c1; c++) {
                const size_t i = (size_t)r * cols + c;
                q[i] = cometi_fp8_quantize(x[i], inv);
                if (deq) deq[i] = (double)cometi_e4m3_decode(q[i]) * scale;
            }
        }
}

/* What one case holds: the host's inputs and dequantized weights, the device arguments. */
typedef struct fp8_data {
    int H, F, m, L0, L1, pow2;
    uint16_t *x16;          /* [m][H] bf16 */
    float *xf;              /* [m][H] its values */
    uint8_t *xq;            /* [m][H] x in E4M3 (the host's quantization) */
    float *xs;              /* [m][L0] its scales */
    double *xd;             /* [m][H] xq x xs */
    int32_t *ids;           /* [m][k], expert EMPTY_EXPERT never */
    float *w;               /* [m][k] */
    double *wg, *wu, *wd;   /* dequantized gate, up [NE][F][H], down [NE][H][F] */
    void *dev[32];          /* every device allocation, freed together */
    int ndev;
    comet_moe_args_t fp8, bf16; /* the two layers' arguments (y apart) */
    void *d_y;              /* [MAXT][H] bf16 */
} fp8_data_t;

static void *dev_alloc(fp8_data_t *d, size_t bytes)
{
    void *p = NULL;
    if (d->ndev == (int)(sizeof(d->dev) / sizeof(d->dev[0])) || cudaMalloc(&p, bytes ? bytes : 16) != cudaSuccess)
        return NULL;
    return d->dev[d->ndev++] = p;
}

static void *dev_upload(fp8_data_t *d, const void *host, size_t bytes)
{
    void *p = dev_alloc(d, bytes);
    if (p && bytes && cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
    return p;
}

/* w bf16 [mats][rows][cols] quantized on the GPU (comet_quantize_fp8_weights): the device
 * bytes and scales in *q and *s, their values on the host in deq. */
static int quantize_weights(fp8_data_t *d, const uint16_t *w, int mats, int rows, int cols, void **q, float **s,
                            double *deq)
{
    const int rb = cdiv(rows, 128), cb = cdiv(cols, 128);
    const size_t n = (size_t)mats * rows * cols, ns = (size_t)mats * rb * cb;
    void *dw = dev_upload(d, w, 2 * n);
    *q = dev_alloc(d, n);
    *s = dev_alloc(d, sizeof(float) * ns);
    CHECK(dw && *q && *s);
    const comet_status_t st = comet_quantize_fp8_weights(dw, mats, rows, cols, d->pow2, *q, *s, 0);
    if (st != COMET_SUCCESS) printf("comet_quantize_fp8_weights: %s\n", comet_last_create_error());
    CHECK_EQ(st, COMET_SUCCESS);
    uint8_t *qh = malloc(n);
    float *sh = malloc(sizeof(float) * ns);
    CHECK(qh && sh);
    CUDA_OK(cudaMemcpy(qh, *q, n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sh, *s, sizeof(float) * ns, cudaMemcpyDeviceToHost));
    for (int m = 0; m < mats; m++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                const size_t i = ((size_t)m * rows + r) * cols + c;
                deq[i] = (double)cometi_e4m3_decode(qh[i]) * sh[((size_t)m * rb + r / 128) * cb + c / 128];
            }
    free(qh), free(sh);
    return 0;
}

/* Fresh weights for every expert, the FP8 layer's in the case's layout and the bf16
 * layer's the same dequantized values rounded to bf16 (gate_up in one tensor). */
static int make_weights(fp8_data_t *d, const fp8_case_t *c, uint64_t *rng)
{
    const int H = d->H, F = d->F;
    const size_t nf = (size_t)NE * F * H; /* elements of gate, of up, of down */
    uint16_t *g16 = malloc(2 * nf), *u16 = malloc(2 * nf), *d16 = malloc(2 * nf), *gu16 = malloc(4 * nf);
    d->wg = malloc(sizeof(double) * nf), d->wu = malloc(sizeof(double) * nf), d->wd = malloc(sizeof(double) * nf);
    double *gu = malloc(sizeof(double) * 2 * nf);
    CHECK(g16 && u16 && d16 && gu16 && d->wg && d->wu && d->wd && gu);
    fill_blocks(g16, NE, F, H, 128, 1 / sqrt(H), 2, rng);
    fill_blocks(u16, NE, F, H, 128, 1 / sqrt(H), 2, rng);
    fill_blocks(d16, NE, H, F, 128, 1 / sqrt(F), 2, rng);
    const size_t mat = (size_t)F * H;
    if (c->gate_up) {
        for (int e = 0; e < NE; e++) {
            memcpy(gu16 + 2 * mat * e, g16 + mat * e, 2 * mat);
            memcpy(gu16 + 2 * mat * e + mat, u16 + mat * e, 2 * mat);
        }
        void *q;
        float *s;
        if (quantize_weights(d, gu16, NE, 2 * F, H, &q, &s, gu)) return 1;
        for (int e = 0; e < NE; e++) {
            memcpy(d->wg + mat * e, gu + 2 * mat * e, sizeof(double) * mat);
            memcpy(d->wu + mat * e, gu + 2 * mat * e + mat, sizeof(double) * mat);
        }
        d->fp8.weights.gate_up = q, d->fp8.weight_scales.gate_up = s;
    } else {
        void *qg, *qu;
        float *sg, *su;
        if (quantize_weights(d, g16, NE, F, H, &qg, &sg, d->wg)) return 1;
        if (quantize_weights(d, u16, NE, F, H, &qu, &su, d->wu)) return 1;
        d->fp8.weights.gate = qg, d->fp8.weights.up = qu;
        d->fp8.weight_scales.gate = sg, d->fp8.weight_scales.up = su;
    }
    void *qd;
    float *sd;
    if (quantize_weights(d, d16, NE, H, F, &qd, &sd, d->wd)) return 1;
    d->fp8.weights.down = qd, d->fp8.weight_scales.down = sd;
    /* The bf16 layer: the dequantized weights rounded to bf16. */
    for (int e = 0; e < NE; e++)
        for (size_t i = 0; i < mat; i++) {
            gu16[2 * mat * e + i] = cometi_float_to_bf16((float)d->wg[mat * e + i]);
            gu16[2 * mat * e + mat + i] = cometi_float_to_bf16((float)d->wu[mat * e + i]);
        }
    for (size_t i = 0; i < nf; i++) d16[i] = cometi_float_to_bf16((float)d->wd[i]);
    d->bf16.weights.gate_up = dev_upload(d, gu16, 4 * nf);
    d->bf16.weights.down = dev_upload(d, d16, 2 * nf);
    CHECK(d->bf16.weights.gate_up && d->bf16.weights.down);
    free(g16), free(u16), free(d16), free(gu16), free(gu);
    return 0;
}

/* Fresh tokens and their routing (random, expert EMPTY_EXPERT left out), uploaded; x
 * quantized on the host, which the FP8 layer gets where the case gives it E4M3. */
static int make_tokens(fp8_data_t *d, const fp8_case_t *c, uint64_t seed, uint64_t *rng)
{
    const int m = d->m, H = d->H, k = TOPK;
    d->x16 = malloc(2 * (size_t)m * H), d->xf = malloc(sizeof(float) * m * H), d->xq = malloc((size_t)m * H);
    d->xs = malloc(sizeof(float) * m * d->L0), d->xd = malloc(sizeof(double) * m * H);
    d->ids = malloc(sizeof(int32_t) * m * k), d->w = malloc(sizeof(float) * m * k);
    CHECK(d->x16 && d->xf && d->xq && d->xs && d->xd && d->ids && d->w);
    fill_blocks(d->x16, 1, m, H, 1, 1.0, 3, rng);
    for (size_t i = 0; i < (size_t)m * H; i++) d->xf[i] = cometi_bf16_to_float(d->x16[i]);
    quantize_rows(d->xf, m, H, d->pow2, d->xq, d->xs, d->xd);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, NE - 1, seed, 0, d->ids, d->w);
    for (int i = 0; i < m * k; i++) d->ids[i] += d->ids[i] >= EMPTY_EXPERT;
    void *x16 = dev_upload(d, d->x16, 2 * (size_t)m * H), *xq = dev_upload(d, d->xq, (size_t)m * H);
    float *xs = dev_upload(d, d->xs, sizeof(float) * m * d->L0);
    int32_t *ids = dev_upload(d, d->ids, sizeof(int32_t) * m * k);
    float *w = dev_upload(d, d->w, sizeof(float) * m * k);
    d->d_y = dev_alloc(d, 2 * (size_t)MAXT * H);
    CHECK(x16 && xq && xs && ids && w && d->d_y);
    comet_moe_args_t *a[2] = {&d->fp8, &d->bf16};
    for (int i = 0; i < 2; i++) {
        a[i]->num_tokens = m, a[i]->topk_ids = ids, a[i]->topk_weights = w, a[i]->y = d->d_y;
        a[i]->impl = COMET_IMPL_BASELINE;
        a[i]->x = x16;
    }
    if (c->x_fp8) d->fp8.x = xq, d->fp8.x_scales = xs;
    return 0;
}

/* y poisoned (bf16 NaN, all max_tokens rows), one forward, y [MAXT][H] back. */
static int forward(comet_moe_t moe, const comet_moe_args_t *a, int H, uint16_t *y)
{
    const size_t bytes = 2 * (size_t)MAXT * H;
    CUDA_OK(cudaMemset(a->y, 0xff, bytes));
    const comet_status_t st = comet_moe_forward(moe, a, 0);
    if (st != COMET_SUCCESS)
        printf("comet_moe_forward: %s: %s\n", comet_status_string(st), comet_moe_last_error(moe));
    CHECK_EQ(st, COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(y, a->y, bytes, cudaMemcpyDeviceToHost));
    for (size_t i = (size_t)a->num_tokens * H; i < (size_t)MAXT * H; i++) CHECK_EQ(y[i], 0xffff); /* rows past m */
    return 0;
}

/* The float64 reference, per (token, choice) row i = t k + j and column f of the
 * activation, and per token and column h of y (the bounds: the file's opening comment). */
typedef struct fp8_ref {
    double *a, *delta; /* [m k][F] float64's activation, and the bound on the GPU's bf16 one's distance */
    double *amb;       /* [m k][F] D: the bound on |the GPU's quantized activation - aq| */
    double *y, *bound; /* [m][H] y on float64's activation quantized, and the GPU's element bound */
    double *y_exact;   /* [m][H] with neither x nor the activation quantized */
} fp8_ref_t;

static int reference(const fp8_data_t *d, fp8_ref_t *r)
{
    const int H = d->H, F = d->F, m = d->m, k = TOPK, n = m * k, L1 = d->L1;
    const double c0 = cbound(d->L0), c1 = cbound(L1);
    r->a = malloc(sizeof(double) * n * F), r->delta = malloc(sizeof(double) * n * F);
    r->amb = malloc(sizeof(double) * n * F);
    r->y = malloc(sizeof(double) * m * H), r->bound = malloc(sizeof(double) * m * H);
    r->y_exact = malloc(sizeof(double) * m * H);
    double *aq = malloc(sizeof(double) * n * F), *ax = malloc(sizeof(double) * n * F);
    float *af = malloc(sizeof(float) * F), *s = malloc(sizeof(float) * L1);
    uint8_t *q = malloc(F);
    CHECK(r->a && r->delta && r->amb && r->y && r->bound && r->y_exact && aq && ax && af && s && q);
    for (int i = 0; i < n; i++) {
        const int t = i / k, e = d->ids[i];
        const double *x = d->xd + (size_t)t * H;
        const float *x0 = d->xf + (size_t)t * H;
        double *a = r->a + (size_t)i * F, *dl = r->delta + (size_t)i * F;
        for (int f = 0; f < F; f++) {
            const double *wg = d->wg + ((size_t)e * F + f) * H, *wu = d->wu + ((size_t)e * F + f) * H;
            double g = 0, u = 0, tg = 0, tu = 0, g0 = 0, u0 = 0;
            for (int h = 0; h < H; h++) {
                g += wg[h] * x[h], tg += fabs(wg[h] * x[h]), g0 += wg[h] * x0[h];
                u += wu[h] * x[h], tu += fabs(wu[h] * x[h]), u0 += wu[h] * x0[h];
            }
            const double eg = c0 * tg + U8 * (fabs(g) + c0 * tg), eu = c0 * tu + U8 * (fabs(u) + c0 * tu);
            a[f] = cometi_swiglu(g, u);
            const double dd = 1.1 * eg * (fabs(u) + eu) + fabs(cometi_swiglu(g, 1.0)) * eu;
            dl[f] = dd + (U8 + 0x1p-13) * (fabs(a[f]) + dd);
            ax[(size_t)i * F + f] = cometi_swiglu(g0, u0);
            af[f] = (float)a[f];
        }
        quantize_rows(af, 1, F, d->pow2, q, s, aq + (size_t)i * F);
        for (int b = 0; b < L1; b++) { /* the largest scale the GPU's block could have */
            const int f0 = b * 128, f1 = f0 + 128 < F ? f0 + 128 : F;
            double top = 0;
            for (int f = f0; f < f1; f++) top = fmax(top, fabs(a[f]) + dl[f]);
            const double smax = cometi_fp8_scale((float)(top * (1 + 0x1p-20)), d->pow2);
            for (int f = f0; f < f1; f++)
                r->amb[(size_t)i * F + f] = fabs(aq[(size_t)i * F + f] - a[f]) + dl[f] + (fabs(a[f]) + dl[f]) / 16 +
                                            smax / 1024;
        }
    }
    for (int t = 0; t < m; t++)
        for (int h = 0; h < H; h++) {
            double y = 0, y0 = 0, B = 0, wo = 0;
            for (int j = 0; j < k; j++) {
                const int i = t * k + j, e = d->ids[i];
                const double *w2 = d->wd + ((size_t)e * H + h) * F, *qa = aq + (size_t)i * F;
                const double *amb = r->amb + (size_t)i * F, *xa = ax + (size_t)i * F;
                double o = 0, A = 0, T1 = 0, o0 = 0;
                for (int f = 0; f < F; f++)
                    o += qa[f] * w2[f], A += amb[f] * fabs(w2[f]), T1 += fabs(qa[f] * w2[f]), o0 += xa[f] * w2[f];
                const double err = A + c1 * (T1 + A) + U8 * (fabs(o) + A + c1 * (T1 + A));
                y += d->w[i] * o, y0 += d->w[i] * o0, B += d->w[i] * err, wo += d->w[i] * fabs(o);
            }
            B = B * (1 + 0x1p-20) + 0x1p-20 * wo;
            r->y[(size_t)t * H + h] = y, r->y_exact[(size_t)t * H + h] = y0;
            r->bound[(size_t)t * H + h] = B + U8 * (fabs(y) + B);
        }
    free(aq), free(ax), free(af), free(s), free(q);
    return 0;
}

static void free_reference(fp8_ref_t *r)
{
    free(r->a), free(r->delta), free(r->amb), free(r->y), free(r->bound), free(r->y_exact);
}

/* A mismatch: counted in `bad`, the first 8 printed. */
#define FAIL_AT(...)                                                                               \
    do {                                                                                           \
        if (bad++ < 8) printf(__VA_ARGS__);                                                        \
    } while (0)

/* Check 1, on the layer's buffers after a call (world 1: every row is this rank's). The
 * receive layout: expert e's segment at the sum of the segments before it rounded up to
 * 128 rows, its rows in (token, choice) order; the packed scales: expert by expert,
 * [L][padded] each (blaslt_fp8.h), padded = rows rounded up to cuBLASLt's multiple. */
static int check_stages(comet_moe_t moe, const fp8_data_t *d, const fp8_ref_t *r, const uint16_t *y)
{
    const cometi_baseline_t *b = moe->baseline;
    const int H = d->H, F = d->F, m = d->m, k = TOPK, n = m * k, L0 = d->L0, L1 = d->L1;
    int cnt[NE] = {0}, start[NE], padded[NE], rows = 0;
    int64_t before[NE], packed = 0;
    int *rank = malloc(sizeof(int) * n);
    CHECK(b && rank);
    for (int i = 0; i < n; i++) rank[i] = cnt[d->ids[i]]++;
    CHECK_EQ(cnt[EMPTY_EXPERT], 0);
    for (int e = 0; e < NE; e++) {
        start[e] = rows, rows += cdiv(cnt[e], 128) * 128;
        padded[e] = (int)cometi_blaslt_fp8_group_rows(cnt[e]), before[e] = packed, packed += padded[e];
    }
    uint8_t *rq = malloc((size_t)rows * H), *aq = malloc((size_t)rows * F), *q = malloc(F);
    uint16_t *act = malloc(2 * (size_t)rows * F);
    float *s0 = malloc(sizeof(float) * packed * L0 + 4), *s1 = malloc(sizeof(float) * packed * L1 + 4);
    float *af = malloc(sizeof(float) * F), *s = malloc(sizeof(float) * L1);
    double *qa = malloc(sizeof(double) * n * F);
    CHECK(rq && aq && q && act && s0 && s1 && af && s && qa);
    CUDA_OK(cudaMemcpy(rq, b->recv_q, (size_t)rows * H, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(act, b->act, 2 * (size_t)rows * F, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(aq, b->act_q, (size_t)rows * F, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(s0, b->a0_scales, sizeof(float) * packed * L0, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(s1, b->a1_scales, sizeof(float) * packed * L1, cudaMemcpyDeviceToHost));
    int bad = 0;
    double worst_act = 0;
    for (int i = 0; i < n; i++) {
        const int t = i / k, e = d->ids[i], row = start[e] + rank[i];
        /* The received row and GEMM0's scales: the host's x, moved. */
        for (int c = 0; c < H; c++)
            if (rq[(size_t)row * H + c] != d->xq[(size_t)t * H + c])
                FAIL_AT("token %d choice %d: received byte %d = 0x%02x, x's 0x%02x\n", t, i % k, c,
                        rq[(size_t)row * H + c], d->xq[(size_t)t * H + c]);
        for (int bl = 0; bl < L0; bl++) {
            const float got = s0[L0 * before[e] + (int64_t)bl * padded[e] + rank[i]], want = d->xs[(size_t)t * L0 + bl];
            if (cometi_f32_bits(got) != cometi_f32_bits(want))
                FAIL_AT("token %d choice %d: GEMM0's scale of block %d = %a, x's %a\n", t, i % k, bl, got, want);
        }
        /* The activation within delta of float64's, and quantized as the host does it. */
        for (int f = 0; f < F; f++) {
            const double got = af[f] = cometi_bf16_to_float(act[(size_t)row * F + f]);
            const double want = r->a[(size_t)i * F + f], dl = r->delta[(size_t)i * F + f];
            if (!(fabs(got - want) <= dl))
                FAIL_AT("token %d choice %d: activation %d = %.9g, float64 %.9g (|error| %.3g > bound %.3g)\n", t,
                        i % k, f, got, want, fabs(got - want), dl);
            if (dl > 0 && fabs(got - want) / dl > worst_act) worst_act = fabs(got - want) / dl;
        }
        quantize_rows(af, 1, F, d->pow2, q, s, NULL);
        for (int f = 0; f < F; f++)
            if (aq[(size_t)row * F + f] != q[f])
                FAIL_AT("token %d choice %d: activation byte %d = 0x%02x, the host's 0x%02x\n", t, i % k, f,
                        aq[(size_t)row * F + f], q[f]);
        for (int bl = 0; bl < L1; bl++) {
            const float got = s1[L1 * before[e] + (int64_t)bl * padded[e] + rank[i]];
            if (cometi_f32_bits(got) != cometi_f32_bits(s[bl]))
                FAIL_AT("token %d choice %d: GEMM1's scale of block %d = %a, the host's %a\n", t, i % k, bl, got,
                        s[bl]);
            for (int f = bl * 128; f < F && f < bl * 128 + 128; f++)
                qa[(size_t)i * F + f] = (double)cometi_e4m3_decode(aq[(size_t)row * F + f]) * got;
        }
    }
    /* Padding rows the GEMMs read: values and scales zero. */
    for (int e = 0; e < NE; e++)
        for (int p = cnt[e]; p < padded[e]; p++) {
            for (int c = 0; c < H; c++)
                if (rq[(size_t)(start[e] + p) * H + c]) FAIL_AT("expert %d padding row %d: received byte %d set\n", e, p, c);
            for (int f = 0; f < F; f++)
                if (aq[(size_t)(start[e] + p) * F + f]) FAIL_AT("expert %d padding row %d: activation byte %d set\n", e, p, f);
            for (int bl = 0; bl < L0; bl++)
                if (s0[L0 * before[e] + (int64_t)bl * padded[e] + p] != 0.0f) FAIL_AT("expert %d padding row %d: GEMM0 scale\n", e, p);
            for (int bl = 0; bl < L1; bl++)
                if (s1[L1 * before[e] + (int64_t)bl * padded[e] + p] != 0.0f) FAIL_AT("expert %d padding row %d: GEMM1 scale\n", e, p);
        }
    /* y against float64 on the GPU's own quantized activation: GEMM1, the return, the sum. */
    const double c1 = cbound(L1);
    double worst_y = 0;
    for (int t = 0; t < m; t++)
        for (int h = 0; h < H; h++) {
            double ref = 0, B = 0, wo = 0;
            for (int j = 0; j < k; j++) {
                const int i = t * k + j, e = d->ids[i];
                const double *w2 = d->wd + ((size_t)e * H + h) * F, *a = qa + (size_t)i * F;
                double o = 0, T1 = 0;
                for (int f = 0; f < F; f++) o += a[f] * w2[f], T1 += fabs(a[f] * w2[f]);
                ref += d->w[i] * o, B += d->w[i] * (c1 * T1 + U8 * (fabs(o) + c1 * T1)), wo += d->w[i] * fabs(o);
            }
            B = B * (1 + 0x1p-20) + 0x1p-20 * wo;
            const double bound = B + U8 * (fabs(ref) + B), got = cometi_bf16_to_float(y[(size_t)t * H + h]);
            if (!(fabs(got - ref) <= bound))
                FAIL_AT("token %d column %d: y %.9g, float64 on the GPU's activation %.9g (|error| %.3g > bound %.3g)\n",
                        t, h, got, ref, fabs(got - ref), bound);
            if (bound > 0 && fabs(got - ref) / bound > worst_y) worst_y = fabs(got - ref) / bound;
        }
    printf("  stages: received rows, scales and padding exact; activation worst |error| / bound %.3f; its bytes "
           "the host's; y on them worst |error| / bound %.3f\n", worst_act, worst_y);
    free(rank), free(rq), free(aq), free(q), free(act), free(s0), free(s1), free(af), free(s), free(qa);
    CHECK_EQ(bad, 0);
    return 0;
}

/* DeepGEMM's calc_diff: 1 - 2 sum(xy) / sum(x^2 + y^2). */
static double deepgemm_diff(const double *x, const double *y, size_t n)
{
    double xy = 0, sq = 0;
    for (size_t i = 0; i < n; i++) xy += x[i] * y[i], sq += x[i] * x[i] + y[i] * y[i];
    return sq > 0 ? 1 - 2 * xy / sq : 0;
}

static int run_fp8_case(comet_comm_t comm, const fp8_case_t *c, uint64_t seed)
{
    uint64_t rng = seed;
    fp8_data_t d;
    memset(&d, 0, sizeof(d));
    d.H = c->hidden, d.F = c->ffn, d.m = c->tokens, d.L0 = cdiv(c->hidden, 128), d.L1 = cdiv(c->ffn, 128);
    d.pow2 = c->pow2;
    const comet_moe_args_t init = COMET_MOE_ARGS_INIT;
    d.fp8 = d.bf16 = init;
    const int H = d.H, m = d.m;
    if (make_weights(&d, c, &rng) || make_tokens(&d, c, seed, &rng)) return 1;
    comet_moe_config_t cfg;
    CHECK_EQ(comet_moe_config_preset("tiny", MAXT, &cfg), COMET_SUCCESS);
    cfg.num_experts = NE, cfg.top_k = TOPK, cfg.hidden = H, cfg.ffn = d.F;
    comet_moe_t moe_bf16 = NULL, moe = NULL;
    CHECK_EQ(comet_moe_create(comm, &cfg, &moe_bf16), COMET_SUCCESS);
    cfg.dtype = COMET_DTYPE_FP8_BLOCK, cfg.fp8_pow2_scales = c->pow2;
    CHECK_EQ(comet_moe_create(comm, &cfg, &moe), COMET_SUCCESS);

    uint16_t *y = malloc(2 * (size_t)MAXT * H), *y2 = malloc(2 * (size_t)MAXT * H), *yb = malloc(2 * (size_t)MAXT * H);
    CHECK(y && y2 && yb);
    if (forward(moe, &d.fp8, H, y)) return 1;
    fp8_ref_t r;
    if (reference(&d, &r)) return 1;
    if (check_stages(moe, &d, &r, y)) return 1;
    /* The same inputs give the same bytes. */
    if (forward(moe, &d.fp8, H, y2)) return 1;
    CHECK(memcmp(y, y2, 2 * (size_t)m * H) == 0);
    if (forward(moe_bf16, &d.bf16, H, yb)) return 1;

    /* End to end against float64's own quantized activation. */
    int bad = 0;
    double num = 0, den = 0, worst_row = 0, worst_elem = 0;
    double *yg = malloc(sizeof(double) * m * H), *ybf = malloc(sizeof(double) * m * H);
    CHECK(yg && ybf);
    for (int t = 0; t < m; t++) {
        double rn = 0, rd = 0;
        for (int h = 0; h < H; h++) {
            const size_t i = (size_t)t * H + h;
            yg[i] = cometi_bf16_to_float(y[i]), ybf[i] = cometi_bf16_to_float(yb[i]);
            const double e = fabs(yg[i] - r.y[i]);
            if (!(e <= r.bound[i]))
                FAIL_AT("token %d column %d: y %.9g, reference %.9g (|error| %.3g > bound %.3g)\n", t, h, yg[i], r.y[i],
                        e, r.bound[i]);
            if (r.bound[i] > 0 && e / r.bound[i] > worst_elem) worst_elem = e / r.bound[i];
            rn += e * e, rd += r.y[i] * r.y[i];
        }
        const double row = rd > 0 ? sqrt(rn / rd) : sqrt(rn);
        if (!(row <= 0x1p-2)) FAIL_AT("token %d: row relative error %.3g > 2^-2\n", t, row);
        if (row > worst_row) worst_row = row;
        num += rn, den += rd;
    }
    const double rel = sqrt(num / den);
    const double diff_gpu = deepgemm_diff(yg, ybf, (size_t)m * H), diff_model = deepgemm_diff(r.y, r.y_exact, (size_t)m * H);
    printf("  end to end: ||y - ref|| / ||ref|| %.2e (worst row %.2e), worst |error| / bound %.3f; DeepGEMM's "
           "measure against bf16 %.2e (float64 model %.2e; DeepGEMM asks < 1e-3 with one quantized operand less)\n",
           rel, worst_row, worst_elem, diff_gpu, diff_model);
    CHECK_EQ(bad, 0);
    CHECK(rel <= 0x1p-4);
    CHECK(diff_gpu <= 2e-3);
    CHECK(diff_gpu <= 2 * diff_model + 1e-4);

    CHECK_EQ(comet_moe_destroy(moe), COMET_SUCCESS);
    CHECK_EQ(comet_moe_destroy(moe_bf16), COMET_SUCCESS);
    free_reference(&r);
    free(y), free(y2), free(yb), free(yg), free(ybf);
    free(d.x16), free(d.xf), free(d.xq), free(d.xs), free(d.xd), free(d.ids), free(d.w);
    free(d.wg), free(d.wu), free(d.wd);
    for (int i = 0; i < d.ndev; i++) cudaFree(d.dev[i]);
    return 0;
}

static int baseline_fp8_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 10000, &comm)) return 1;
    for (size_t i = 0; i < sizeof(fp8_cases) / sizeof(fp8_cases[0]); i++) {
        printf("%s, %d tokens\n", fp8_cases[i].name, fp8_cases[i].tokens);
        if (run_fp8_case(comm, &fp8_cases[i], seed + 7919 * i)) {
            printf("case %zu (%s) failed\n", i, fp8_cases[i].name);
            return 1;
        }
    }
    CHECK_EQ(comet_comm_destroy(comm), COMET_SUCCESS);
    return 0;
}

int test_gpu_baseline_fp8_forward(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, baseline_fp8_rank, &seed, 170);
}
