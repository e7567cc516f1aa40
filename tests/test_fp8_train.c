/*
 * test_fp8_train.c - training in block-scaled FP8 through comet.h (config.dtype
 * COMET_DTYPE_FP8_BLOCK) on the fused path, at any world size.
 *
 * Every rank makes every expert's bf16 weights from the seed, quantizes them once with
 * comet_quantize_fp8_weights_transposed (W for the forward, W^T for the backward, power-of-
 * two scales) and dequantizes W back: with power-of-two scales every dequantized value is
 * a bf16 value exactly, so a bf16 layer runs on the very weights the FP8 layer sees (x too:
 * it is put on the E4M3 grid first). dy is random bf16. Per case:
 *   - the FP8 training forward's y equals the FP8 inference forward's, bit for bit;
 *   - two FP8 steps give the same bits (y, dx, d topk_weights, the weight gradients), and
 *     so does the step captured in a CUDA graph and replayed;
 *   - each FP8 tensor against the bf16 layer's on the same operands (the step's FP8
 *     roundings are what differ: dy, dh and the weight gradients' operands along the
 *     tokens, each within 2^-4 of its value): DeepGEMM's measure 1 - 2 sum(xy) /
 *     sum(x^2 + y^2) < 1e-3 per tensor (DeepGEMM's bar; one E4M3 rounding of uniform
 *     relative error costs about 3e-4), and element by element within 2^-3 of the element
 *     (two roundings) plus half its group's RMS (a group: a dx row, all of d topk_weights,
 *     one expert's gate, up or down gradient; a term sum's FP8 error is a few percent of
 *     the RMS, a wrong or unwritten element about 100%), and each group's own measure
 *     < 1e-2 (a misplaced row scores about 1); never NaN; outputs poisoned first;
 *   - fp32 accumulation: the gradients added to a known start equal the bf16 ones within
 *     bf16's rounding;
 *   - the refusals: missing or misaligned W^T, FP8 fields on a bf16 layer; the saved
 *     state's bytes (x's rows in E4M3 with their scales);
 *   - [g u] kept in E4M3 (gate_up_e4m3_case): its bytes, the same y, and the gradients'
 *     measures against the bf16 layer's printed and held < 2e-3;
 *   - the sequential FP8 step, the yardstick (sequential_case): repeatable, against the
 *     fused step element by element and by measure, against the bf16 layer;
 *   - config.fp8_wgrad_cublaslt (wgrad_cublaslt_case): the same y, dx and d topk_weights
 *     bits, the weight gradients within the sequential step's bars of comet's, fp32
 *     accumulation, the refusal under CUDA-graph capture.
 * And 1000 steps of random sizes and routings (fp8_soak_rank) on any bf16 x: every 50th
 * repeated bit for bit, and against the bf16 layer with a measure < 2e-3 per tensor of 256
 * values or more (< 1e-2 below: a mean of few squared errors scatters) and
 * the looser element bound OFF_GRID (x's own roundings join in, and an expert may have
 * three rows); memory flat.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "base/fp8.h"
#include "../harness/launch.h"
#include "testutil.h"
#include "gpu_util.h"

#define E 8
#define H 320
#define F 256
#define MAX_TOKENS 300

/* Device copies of a quantization: q, scales, qt, scales_t. */
typedef struct fp8_weight {
    void *q, *qt;
    float *s, *st;
    size_t n, ns;
} fp8_weight_t;

/* Quantize w (mats x rows x cols bf16 on the device) both ways and dequantize W back into
 * host floats `out` (bf16 values exactly, with pow2 scales). */
static int quantize_both(const void *w, int mats, int rows, int cols, fp8_weight_t *o, float *out)
{
    o->n = (size_t)mats * rows * cols;
    o->ns = (size_t)mats * ((rows + 127) / 128) * ((cols + 127) / 128);
    CUDA_OK(cudaMalloc(&o->q, o->n));
    CUDA_OK(cudaMalloc(&o->qt, o->n));
    CUDA_OK(cudaMalloc((void **)&o->s, o->ns * 4));
    CUDA_OK(cudaMalloc((void **)&o->st, o->ns * 4));
    CHECK_EQ(comet_quantize_fp8_weights_transposed(w, mats, rows, cols, 1, o->q, o->s, o->qt, o->st, 0),
             COMET_SUCCESS);
    uint8_t *hq = malloc(o->n);
    float *hs = malloc(o->ns * 4);
    CUDA_OK(cudaMemcpy(hq, o->q, o->n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hs, o->s, o->ns * 4, cudaMemcpyDeviceToHost));
    const int sr = (rows + 127) / 128, sc = (cols + 127) / 128;
    for (int m = 0; m < mats; m++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                const size_t i = ((size_t)m * rows + r) * cols + c;
                out[i] = cometi_e4m3_decode(hq[i]) * hs[((size_t)m * sr + r / 128) * sc + c / 128];
            }
    free(hq), free(hs);
    return 0;
}

/* One step's outputs on the host. */
typedef struct step_out {
    uint16_t *y, *dx, *g13, *g2;
    float *dw;
} step_out_t;

typedef struct fp8_fixture {
    comet_comm_t comm;
    cudaStream_t st; /* every call of the case's layers (a layer's calls keep one stream) */
    int me, per, first, m;
    void *x, *dy, *y, *dx, *g13, *g2;
    int32_t *ids;
    float *w, *dw;
    size_t ny, nw, n13, n2; /* this rank's element counts */
} fp8_fixture_t;

/* A step's outputs poisoned on fx's stream (the weight gradients where written in bf16). */
static int poison_outputs(fp8_fixture_t *fx, int grads)
{
    CUDA_OK(cudaMemsetAsync(fx->y, 0xff, fx->ny * 2, fx->st));
    CUDA_OK(cudaMemsetAsync(fx->dx, 0xff, fx->ny * 2, fx->st));
    CUDA_OK(cudaMemsetAsync(fx->dw, 0xff, fx->nw * 4, fx->st));
    if (grads) {
        CUDA_OK(cudaMemsetAsync(fx->g13, 0xff, fx->n13 * 2, fx->st));
        CUDA_OK(cudaMemsetAsync(fx->g2, 0xff, fx->n2 * 2, fx->st));
    }
    return 0;
}

/* A finished step's outputs to the host (the weight gradients where written in bf16). */
static int copy_outputs(const fp8_fixture_t *fx, step_out_t *out, int grads)
{
    CUDA_OK(cudaMemcpy(out->y, fx->y, fx->ny * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out->dx, fx->dx, fx->ny * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out->dw, fx->dw, fx->nw * 4, cudaMemcpyDeviceToHost));
    if (grads) {
        CUDA_OK(cudaMemcpy(out->g13, fx->g13, fx->n13 * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(out->g2, fx->g2, fx->n2 * 2, cudaMemcpyDeviceToHost));
    }
    return 0;
}

/* One training step into the saved state sv, outputs poisoned first; out: where its
 * outputs go on the host (NULL: left on the device). */
static int step_in(fp8_fixture_t *fx, comet_moe_t moe, const comet_moe_args_t *a, comet_moe_backward_args_t *b,
                   comet_moe_saved_t sv, step_out_t *out)
{
    const int grads = b->grads.mode == COMET_GRAD_WRITE_BF16;
    if (poison_outputs(fx, grads)) return 1;
    comet_status_t st = comet_moe_forward_train(moe, a, sv, fx->st);
    if (st != COMET_SUCCESS) printf("rank %d forward_train: %s\n", fx->me, comet_moe_last_error(moe));
    CHECK_EQ(st, COMET_SUCCESS);
    b->saved = sv;
    st = comet_moe_backward(moe, b, fx->st);
    if (st != COMET_SUCCESS) printf("rank %d backward: %s\n", fx->me, comet_moe_last_error(moe));
    CHECK_EQ(st, COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(comet_comm_get_async_error(fx->comm), COMET_SUCCESS);
    return out ? copy_outputs(fx, out, grads) : 0;
}

/* The same into a saved state of its own. */
static int step(fp8_fixture_t *fx, comet_moe_t moe, const comet_moe_args_t *a, comet_moe_backward_args_t *b,
                step_out_t *out)
{
    comet_moe_saved_t sv;
    COMET_OK(comet_moe_saved_create(moe, NULL, &sv), fx->comm);
    if (step_in(fx, moe, a, b, sv, out)) return 1;
    COMET_OK(comet_moe_saved_destroy(sv), fx->comm);
    return 0;
}

static void alloc_out(const fp8_fixture_t *fx, step_out_t *o)
{
    o->y = malloc(fx->ny * 2 + 2), o->dx = malloc(fx->ny * 2 + 2), o->dw = malloc(fx->nw * 4 + 4);
    o->g13 = malloc(fx->n13 * 2), o->g2 = malloc(fx->n2 * 2);
}

static void free_out(step_out_t *o) { free(o->y), free(o->dx), free(o->dw), free(o->g13), free(o->g2); }

static int same_bits(const fp8_fixture_t *fx, const step_out_t *a, const step_out_t *b)
{
    CHECK(memcmp(a->y, b->y, fx->ny * 2) == 0);
    CHECK(memcmp(a->dx, b->dx, fx->ny * 2) == 0);
    CHECK(memcmp(a->dw, b->dw, fx->nw * 4) == 0);
    CHECK(memcmp(a->g13, b->g13, fx->n13 * 2) == 0);
    CHECK(memcmp(a->g2, b->g2, fx->n2 * 2) == 0);
    return 0;
}

/* Two steps into `out` and `again` (allocated here) that must give the same bits. */
static int repeatable_step(fp8_fixture_t *fx, comet_moe_t moe, const comet_moe_args_t *a,
                           comet_moe_backward_args_t *b, step_out_t *out, step_out_t *again)
{
    alloc_out(fx, out), alloc_out(fx, again);
    return step(fx, moe, a, b, out) || step(fx, moe, a, b, again) || same_bits(fx, out, again);
}

/* An element's bound against the bf16 layer's: `self` of the element plus `of_rms` of its
 * group's RMS. */
typedef struct elem_bound {
    double self, of_rms;
} elem_bound_t;

/* The step's operands on the E4M3 grid (gpu_fp8_training): two roundings of the element,
 * half the group's RMS (the file's header). */
static const elem_bound_t ON_GRID = {0x1p-3, 0.5};

/* The soak's x is any bf16, so x's two roundings (its rows, then along the tokens) join
 * the others: a weight gradient's term passes through up to four roundings of its factors
 * ((1 + 2^-4)^4 - 1 = 27% of itself), and an element is at most that of the sum of its
 * terms' sizes, which, with a handful of rows that cancel, is several times the element
 * and up to about the group's RMS. So the soak's element bound catches gross errors only
 * (a NaN, a value of the wrong size or sign); a misplaced row or an unwritten tile fails
 * the group measure (about 1 and 0.05 or more), and single elements are held tightly by
 * gpu_fp8_training, on the grid. */
static const elem_bound_t OFF_GRID = {0.3, 1.0};

/* The soak's tensor measure bound (2e-3) holds for tensors of at least this many values;
 * smaller ones are held to the groups' 1e-2. */
#define SOAK_MEASURE_MIN 256

/* FP8 values (n, in groups of `group`) against the bf16 layer's within `b`; the tensor's
 * measure into *measure, and the largest |difference| / bound seen raised into *used.
 * 0, or 1 with the first failure printed. */
static int against_bf16(const char *what, int rank, const float *got, const float *want, size_t n, size_t group,
                        elem_bound_t b, double *measure, double *used)
{
    double xy = 0, xx = 0;
    for (size_t g0 = 0; g0 < n; g0 += group) {
        const size_t g1 = g0 + group < n ? g0 + group : n;
        double ss = 0, gxy = 0, gxx = 0;
        for (size_t i = g0; i < g1; i++) ss += (double)want[i] * want[i];
        const double rms = sqrt(ss / (double)(g1 - g0));
        for (size_t i = g0; i < g1; i++) {
            const double d = fabs((double)got[i] - want[i]), bound = b.self * fabs(want[i]) + b.of_rms * rms;
            if (!(d <= bound)) {
                printf("rank %d %s[%zu] = %.6g, bf16 layer %.6g (group RMS %.3g, bound %.3g)\n", rank, what, i,
                       got[i], want[i], rms, bound);
                return 1;
            }
            if (bound > 0 && d / bound > *used) *used = d / bound;
            gxy += (double)got[i] * want[i], gxx += (double)got[i] * got[i] + (double)want[i] * want[i];
        }
        if (gxx > 0 && !(1 - 2 * gxy / gxx < 1e-2)) {
            printf("rank %d %s: group at %zu measures %.3g against the bf16 layer\n", rank, what, g0, 1 - 2 * gxy / gxx);
            return 1;
        }
        xy += gxy, xx += gxx;
    }
    *measure = xx > 0 ? 1 - 2 * xy / xx : 0;
    return 0;
}

static float *bf16_floats(const uint16_t *h, size_t n)
{
    float *f = malloc(sizeof(float) * n + 4);
    for (size_t i = 0; i < n; i++) f[i] = cometi_bf16_to_float(h[i]);
    return f;
}

/* Both layers of the file's shape (top_k given), FP8 and bf16, on the same weights: every
 * rank makes every expert's bf16 weights from rng, quantizes them both ways (power-of-two
 * scales) and gives the bf16 layer the dequantized ones (bf16 values exactly). fx gets its
 * communicator, stream and buffers for max_tokens (fp32 room for the weight gradients); the
 * args hold this rank's experts' weights and fx's buffers, the token count is the caller's. */
typedef struct fp8_layers {
    comet_moe_t moe8, moe16;
    fp8_weight_t q13, q2;     /* every expert's, FP8 both ways */
    void *d13, *d2;           /* the same dequantized, bf16: the bf16 layer's */
    comet_moe_args_t a8, a16;
    comet_moe_backward_args_t b8, b16;
} fp8_layers_t;

static int fp8_layers_open(const cometi_rank_ctx_t *ctx, comet_comm_t comm, int top_k, uint64_t *rng,
                           fp8_fixture_t *fx, fp8_layers_t *L)
{
    const int W = ctx->nranks, me = ctx->rank;
    memset(L, 0, sizeof(*L));
    comet_moe_config_t cfg = COMET_MOE_CONFIG_INIT, cfg16;
    cfg.hidden = H, cfg.ffn = F, cfg.num_experts = E, cfg.top_k = top_k, cfg.max_tokens = MAX_TOKENS;
    cfg.dtype = COMET_DTYPE_FP8_BLOCK, cfg.fp8_pow2_scales = 1;
    cfg16 = cfg;
    cfg16.dtype = COMET_DTYPE_BF16, cfg16.fp8_pow2_scales = 0;
    COMET_OK(comet_moe_create(comm, &cfg, &L->moe8), comm);
    COMET_OK(comet_moe_create(comm, &cfg16, &L->moe16), comm);
    memset(fx, 0, sizeof(*fx));
    fx->comm = comm, fx->me = me, fx->per = E / W, fx->first = me * fx->per;
    CUDA_OK(cudaStreamCreateWithFlags(&fx->st, cudaStreamNonBlocking));
    const size_t n13 = (size_t)E * 2 * F * H, n2 = (size_t)E * H * F;
    float *w13 = malloc(n13 * 4), *w2 = malloc(n2 * 4);
    uint16_t *h13 = malloc(n13 * 2), *h2 = malloc(n2 * 2);
    fill_bf16(w13, h13, n13, 1.0 / sqrt(H), rng);
    fill_bf16(w2, h2, n2, 1.0 / sqrt(F), rng);
    CUDA_OK(cudaMalloc(&L->d13, n13 * 2));
    CUDA_OK(cudaMalloc(&L->d2, n2 * 2));
    CUDA_OK(cudaMemcpy(L->d13, h13, n13 * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(L->d2, h2, n2 * 2, cudaMemcpyHostToDevice));
    if (quantize_both(L->d13, E, 2 * F, H, &L->q13, w13) || quantize_both(L->d2, E, H, F, &L->q2, w2)) return 1;
    for (size_t i = 0; i < n13; i++) h13[i] = cometi_float_to_bf16(w13[i]);
    for (size_t i = 0; i < n2; i++) h2[i] = cometi_float_to_bf16(w2[i]);
    CUDA_OK(cudaMemcpy(L->d13, h13, n13 * 2, cudaMemcpyHostToDevice)); /* the bf16 layer's: dequantized */
    CUDA_OK(cudaMemcpy(L->d2, h2, n2 * 2, cudaMemcpyHostToDevice));
    free(w13), free(w2), free(h13), free(h2);
    fx->n13 = (size_t)fx->per * 2 * F * H, fx->n2 = (size_t)fx->per * H * F;
    const size_t rows = (size_t)MAX_TOKENS * H, choices = (size_t)MAX_TOKENS * top_k;
    CUDA_OK(cudaMalloc(&fx->x, rows * 2 + 16));
    CUDA_OK(cudaMalloc(&fx->dy, rows * 2 + 16));
    CUDA_OK(cudaMalloc(&fx->y, rows * 2 + 16));
    CUDA_OK(cudaMalloc(&fx->dx, rows * 2 + 16));
    CUDA_OK(cudaMalloc((void **)&fx->w, choices * 4 + 16));
    CUDA_OK(cudaMalloc((void **)&fx->dw, choices * 4 + 16));
    CUDA_OK(cudaMalloc((void **)&fx->ids, choices * 4 + 16));
    CUDA_OK(cudaMalloc(&fx->g13, fx->n13 * 4));
    CUDA_OK(cudaMalloc(&fx->g2, fx->n2 * 4));
    /* This rank's experts, FP8: W for the forward, W^T for the backward. */
    const int kb = (H + 127) / 128;
    const size_t s13 = (size_t)(2 * F / 128) * kb, s2 = (size_t)kb * (F / 128);
    comet_moe_args_t *a = &L->a8;
    *a = (comet_moe_args_t)COMET_MOE_ARGS_INIT;
    a->x = fx->x, a->topk_ids = fx->ids, a->topk_weights = fx->w, a->y = fx->y;
    a->weights.gate_up = (char *)L->q13.q + (size_t)fx->first * 2 * F * H;
    a->weights.down = (char *)L->q2.q + (size_t)fx->first * H * F;
    a->weight_scales.gate_up = L->q13.s + fx->first * s13, a->weight_scales.down = L->q2.s + fx->first * s2;
    comet_moe_backward_args_t *b = &L->b8;
    *b = (comet_moe_backward_args_t)COMET_MOE_BACKWARD_ARGS_INIT;
    b->dy = fx->dy, b->dx = fx->dx, b->d_topk_weights = fx->dw, b->grads.gate_up = fx->g13, b->grads.down = fx->g2;
    b->weights_t.gate_up = (char *)L->q13.qt + (size_t)fx->first * 2 * F * H;
    b->weights_t.down = (char *)L->q2.qt + (size_t)fx->first * H * F;
    b->weight_t_scales.gate_up = L->q13.st + fx->first * s13, b->weight_t_scales.down = L->q2.st + fx->first * s2;
    /* bf16: the dequantized weights. */
    L->a16 = L->a8;
    L->a16.weights.gate_up = (char *)L->d13 + (size_t)fx->first * 2 * F * H * 2;
    L->a16.weights.down = (char *)L->d2 + (size_t)fx->first * H * F * 2;
    memset(&L->a16.weight_scales, 0, sizeof(L->a16.weight_scales));
    L->b16 = L->b8;
    L->b16.weights = L->a16.weights;
    memset(&L->b16.weights_t, 0, sizeof(L->b16.weights_t));
    memset(&L->b16.weight_t_scales, 0, sizeof(L->b16.weight_t_scales));
    return 0;
}

static int fp8_layers_close(comet_comm_t comm, fp8_fixture_t *fx, fp8_layers_t *L)
{
    fp8_weight_t *qs[2] = {&L->q13, &L->q2};
    for (int i = 0; i < 2; i++) cudaFree(qs[i]->q), cudaFree(qs[i]->qt), cudaFree(qs[i]->s), cudaFree(qs[i]->st);
    cudaFree(L->d13), cudaFree(L->d2), cudaFree(fx->x), cudaFree(fx->dy), cudaFree(fx->y), cudaFree(fx->dx);
    cudaFree(fx->w), cudaFree(fx->dw), cudaFree(fx->ids), cudaFree(fx->g13), cudaFree(fx->g2);
    COMET_OK(comet_moe_destroy(L->moe16), comm);
    COMET_OK(comet_moe_destroy(L->moe8), comm);
    cudaStreamDestroy(fx->st);
    return 0;
}

/* The saved state keeping [g u] in E4M3 (saved config gate_up_e4m3): comet.h's bytes (h
 * E4M3, its scales [2F / 128][cap] after the other parts); the same forward, bit for bit
 * (o8's y); repeatable; and every tensor against the bf16 layer's (o16) with one more
 * E4M3 rounding of g and u in the backward: DeepGEMM's measure < 2e-3 per tensor (each
 * measure printed: what keeping [g u] in E4M3 costs), the elements within GU8_BOUND. Each
 * term of a weight gradient's sum then carries two more roundings of 2^-4, so over the
 * hundreds of thousands of elements of d gate_up and d down the largest error reaches
 * about 0.6 of its group's RMS (one seed: d down 0.099 at an RMS of 0.16), past ON_GRID's
 * half; the group and tensor measures still catch a misplaced row or an unwritten tile. */
static const elem_bound_t GU8_BOUND = {0x1p-2, 1.0};
static int gate_up_e4m3_case(fp8_fixture_t *fx, comet_moe_t moe8, const comet_moe_args_t *a,
                             comet_moe_backward_args_t *b, const step_out_t *o8, const step_out_t *o16, size_t bytes8,
                             size_t bytes16, int top_k)
{
    comet_comm_t comm = fx->comm;
    comet_moe_saved_config_t sc = COMET_MOE_SAVED_CONFIG_INIT;
    sc.gate_up_e4m3 = 1;
    size_t bytes = 0;
    COMET_OK(comet_moe_saved_bytes(moe8, &sc, &bytes), comm);
    const int world = comet_comm_size(comm), here = top_k < fx->per ? top_k : fx->per;
    const size_t cap = (size_t)world * MAX_TOKENS * here + (size_t)fx->per * 128;
#define ALIGN256(x) (((x) + 255) / 256 * 256)
    CHECK_EQ(bytes8 - bytes, ALIGN256(cap * 2 * F * 2) - ALIGN256(cap * 2 * F) - ALIGN256(cap * 2 * F / 128 * 4));
#undef ALIGN256
    comet_moe_saved_t sv;
    COMET_OK(comet_moe_saved_create(moe8, &sc, &sv), comm);
    step_out_t o, again;
    alloc_out(fx, &o), alloc_out(fx, &again);
    if (step_in(fx, moe8, a, b, sv, &o) || step_in(fx, moe8, a, b, sv, &again) || same_bits(fx, &o, &again)) return 1;
    CHECK(memcmp(o.y, o8->y, fx->ny * 2) == 0);
    struct { const char *name; const uint16_t *got, *want; size_t n, group; } t[] = {
        {"dx", o.dx, o16->dx, fx->ny, H},
        {"d gate_up", o.g13, o16->g13, fx->n13, (size_t)F * H}, {"d down", o.g2, o16->g2, fx->n2, (size_t)H * F},
    };
    double measure[4] = {0}, used = 0;
    for (int i = 0; i < 3; i++) {
        float *g = bf16_floats(t[i].got, t[i].n), *w = bf16_floats(t[i].want, t[i].n);
        const int failed = t[i].n && against_bf16(t[i].name, fx->me, g, w, t[i].n, t[i].group, GU8_BOUND, &measure[i],
                                                  &used);
        free(g), free(w);
        if (failed) return 1;
    }
    if (fx->nw && against_bf16("d topk_weights", fx->me, o.dw, o16->dw, fx->nw, fx->nw, GU8_BOUND, &measure[3], &used))
        return 1;
    printf("rank %d: [g u] kept in E4M3: saved state %.2fx the bf16 one's (%.2fx with [g u] in bf16); against the "
           "bf16 layer: dx %.2e, d topk_weights %.2e, d gate_up %.2e, d down %.2e, elements at most %.0f%% of their "
           "bound\n", fx->me, (double)bytes / (double)bytes16, (double)bytes8 / (double)bytes16, measure[0],
           measure[3], measure[1], measure[2], 100 * used);
    for (int i = 0; i < 4; i++) CHECK(measure[i] < 2e-3);
    free_out(&o), free_out(&again);
    COMET_OK(comet_moe_saved_destroy(sv), comm);
    return 0;
}

/* Tensor by tensor, a step's outputs against another's (`ref`): each tensor's measure into
 * measure[] (y, dx, d gate_up, d down, d topk_weights), elements within `bound`, the largest
 * fraction of its bound any element used raised into *used. */
static int step_against(const fp8_fixture_t *fx, const char *what, const step_out_t *got, const step_out_t *ref,
                        elem_bound_t bound, double measure[5], double *used)
{
    struct { const char *name; const uint16_t *got, *want; size_t n, group; } t[] = {
        {"y", got->y, ref->y, fx->ny, H}, {"dx", got->dx, ref->dx, fx->ny, H},
        {"d gate_up", got->g13, ref->g13, fx->n13, (size_t)F * H}, {"d down", got->g2, ref->g2, fx->n2, (size_t)H * F},
    };
    for (int i = 0; i < 4; i++) {
        measure[i] = 0;
        float *g = bf16_floats(t[i].got, t[i].n), *w = bf16_floats(t[i].want, t[i].n);
        const int failed = t[i].n && against_bf16(t[i].name, fx->me, g, w, t[i].n, t[i].group, bound, &measure[i],
                                                  used);
        free(g), free(w);
        if (failed) return printf("rank %d: %s\n", fx->me, what), 1;
    }
    measure[4] = 0;
    if (fx->nw && against_bf16("d topk_weights", fx->me, got->dw, ref->dw, fx->nw, fx->nw, bound, &measure[4], used))
        return printf("rank %d: %s\n", fx->me, what), 1;
    return 0;
}

/* The sequential FP8 step (COMET_IMPL_BASELINE: quantize, NCCL, cuBLASLt's block-scaled
 * GEMMs, the fused path's pointwise kernels), the fused one's yardstick:
 *   - two steps give the same bits, and its training forward's y is its inference's;
 *   - against the fused FP8 step (o8), tensor by tensor, elements within ON_GRID. y: the
 *     fused forward applies SwiGLU to GEMM0's FP32 sums, the sequential one to the bf16 h
 *     cuBLASLt writes, so g and u differ by up to 2^-9 of themselves, a by about 2^-8, and
 *     about 2^-8 / 2^-3.5 = 4% of the activation's elements round to the neighbouring E4M3
 *     value (a step of about 2^-3.5 of the element): y's squared error is about 4% x
 *     2^-7 = 3e-4 of its square, a measure of 1.7e-4; held < 5e-4. The backward: both
 *     read the same kept [g u] and the same E4M3 dy, and differ only where their GEMMs sum
 *     in other orders (a 2^-9 rounding of a bf16 output now and then, and the E4M3
 *     roundings of dh it tips, at most 2^-5 of those elements by 2^-3 of themselves):
 *     measure < 1e-4 (on this grid, with power-of-two scales, the block sums are exact
 *     and the two give the same bits);
 *   - against the bf16 layer (o16): the fused step's bars (measure < 1e-3, ON_GRID);
 *   - [g u] kept in E4M3: the same y, bit for bit, and the measures of gate_up_e4m3_case;
 *   - a sequential saved state refused by COMET_IMPL_FUSED's backward. */
static int sequential_case(fp8_fixture_t *fx, const fp8_layers_t *L,
                           const comet_moe_args_t *a8, const comet_moe_backward_args_t *b8, const step_out_t *o8,
                           const step_out_t *o16, int top_k)
{
    comet_comm_t comm = fx->comm;
    comet_moe_t moe8 = L->moe8;
    comet_moe_args_t a = *a8;
    comet_moe_backward_args_t b = *b8;
    a.impl = COMET_IMPL_BASELINE;
    step_out_t s, again;
    if (repeatable_step(fx, moe8, &a, &b, &s, &again)) return 1;
    CUDA_OK(cudaMemsetAsync(fx->y, 0xff, fx->ny * 2, fx->st));
    COMET_OK(comet_moe_forward(moe8, &a, fx->st), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(again.y, fx->y, fx->ny * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(again.y, s.y, fx->ny * 2) == 0);
    double fused[5], bf16[5], used_fused = 0, used_bf16 = 0;
    if (step_against(fx, "sequential FP8 against fused FP8", &s, o8, ON_GRID, fused, &used_fused) ||
        step_against(fx, "sequential FP8 against bf16", &s, o16, ON_GRID, bf16, &used_bf16))
        return 1;
    printf("rank %d: sequential FP8 step, top-%d: against the fused FP8 step y %.2e, dx %.2e, d topk_weights %.2e, "
           "d gate_up %.2e, d down %.2e (elements at most %.0f%% of their bound); against the bf16 layer y %.2e, dx "
           "%.2e, d topk_weights %.2e, d gate_up %.2e, d down %.2e\n", fx->me, top_k, fused[0], fused[1], fused[4],
           fused[2], fused[3], 100 * used_fused, bf16[0], bf16[1], bf16[4], bf16[2], bf16[3]);
    CHECK(fused[0] < 5e-4);
    for (int i = 0; i < 5; i++) {
        if (i) CHECK(fused[i] < 1e-4);
        CHECK(bf16[i] < 1e-3);
    }
    /* [g u] in E4M3. */
    comet_moe_saved_config_t sc = COMET_MOE_SAVED_CONFIG_INIT;
    sc.gate_up_e4m3 = 1;
    comet_moe_saved_t sv;
    COMET_OK(comet_moe_saved_create(moe8, &sc, &sv), comm);
    if (step_in(fx, moe8, &a, &b, sv, &again)) return 1;
    CHECK(memcmp(again.y, s.y, fx->ny * 2) == 0);
    double gu8[5], used_gu8 = 0;
    if (step_against(fx, "sequential FP8, [g u] in E4M3, against bf16", &again, o16, GU8_BOUND, gu8, &used_gu8))
        return 1;
    for (int i = 0; i < 5; i++) CHECK(gu8[i] < 2e-3);
    /* The fused backward refuses the sequential forward's state, which stays filled. */
    COMET_OK(comet_moe_forward_train(moe8, &a, sv, fx->st), comm);
    b.saved = sv, b.impl = COMET_IMPL_FUSED;
    CHECK_EQ(comet_moe_backward(moe8, &b, fx->st), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(moe8), "sequential path");
    b.impl = COMET_IMPL_AUTO;
    if (poison_outputs(fx, 1)) return 1;
    COMET_OK(comet_moe_backward(moe8, &b, fx->st), comm);
    CUDA_OK(cudaDeviceSynchronize());
    COMET_OK(comet_moe_saved_destroy(sv), comm);
    free_out(&s), free_out(&again);
    return 0;
}

/* fp32 accumulation into a known start (random, per element): the gradients added equal
 * the bf16 ones this layer wrote (`written`) within bf16's rounding of them (2^-8 of the
 * value) and fp32's of the start. b's mode is left COMET_GRAD_ACCUMULATE_FP32. */
static int accumulate_case(fp8_fixture_t *fx, comet_moe_t moe, const comet_moe_args_t *a, comet_moe_backward_args_t *b,
                           const step_out_t *written, uint64_t *rng)
{
    float *start13 = malloc(fx->n13 * 4), *start2 = malloc(fx->n2 * 4), *acc13 = malloc(fx->n13 * 4),
          *acc2 = malloc(fx->n2 * 4);
    for (size_t i = 0; i < fx->n13; i++) start13[i] = (float)(cometi_rand_unit(rng) - 0.5);
    for (size_t i = 0; i < fx->n2; i++) start2[i] = (float)(cometi_rand_unit(rng) - 0.5);
    CUDA_OK(cudaMemcpy(fx->g13, start13, fx->n13 * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx->g2, start2, fx->n2 * 4, cudaMemcpyHostToDevice));
    b->grads.mode = COMET_GRAD_ACCUMULATE_FP32;
    step_out_t out;
    alloc_out(fx, &out);
    if (step(fx, moe, a, b, &out)) return 1;
    CUDA_OK(cudaMemcpy(acc13, fx->g13, fx->n13 * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(acc2, fx->g2, fx->n2 * 4, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (size_t i = 0; i < fx->n13 + fx->n2 && bad < 5; i++) {
        const int gu = i < fx->n13;
        const size_t j = gu ? i : i - fx->n13;
        const double got = gu ? acc13[j] - start13[j] : acc2[j] - start2[j];
        const double want = cometi_bf16_to_float(gu ? written->g13[j] : written->g2[j]);
        if (!(fabs(got - want) <= 0x1p-8 * fabs(want) + 0x1p-23)) /* bf16's rounding; fp32's of the start */
            bad++, printf("rank %d %s[%zu]: fp32 accumulated %.8g, bf16 written %.8g\n", fx->me,
                          gu ? "d gate_up" : "d down", j, got, want);
    }
    CHECK_EQ(bad, 0);
    free(start13), free(start2), free(acc13), free(acc2);
    free_out(&out);
    return 0;
}

/* Another FP8 layer of the file's shape beside the fixture's, with the given fp8_pow2_scales
 * and fp8_wgrad_cublaslt. */
static int open_fp8_layer(comet_comm_t comm, int top_k, int pow2, int wgrad_cublaslt, comet_moe_t *moe)
{
    comet_moe_config_t cfg = COMET_MOE_CONFIG_INIT;
    cfg.hidden = H, cfg.ffn = F, cfg.num_experts = E, cfg.top_k = top_k, cfg.max_tokens = MAX_TOKENS;
    cfg.dtype = COMET_DTYPE_FP8_BLOCK, cfg.fp8_pow2_scales = pow2, cfg.fp8_wgrad_cublaslt = wgrad_cublaslt;
    COMET_OK(comet_moe_create(comm, &cfg, moe), comm);
    return 0;
}

/* The layer made with config.fp8_wgrad_cublaslt = 1 (cuBLASLt's weight gradients, per
 * expert, on counts the backward reads on the host), on o8's inputs and weights:
 *   - y, dx and d topk_weights are o8's bits (the weight gradients' engine touches none of
 *     them), and two steps give the same bits;
 *   - the weight gradients against o8's: the same E4M3 operands, summed in another order,
 *     so measure < 1e-4 and elements within ON_GRID (as the sequential step, whose weight
 *     gradients are these GEMMs, is held to);
 *   - fp32 accumulation as accumulate_case checks it;
 *   - under CUDA-graph capture the backward is refused, naming the field, with nothing
 *     enqueued: the captured forward, replayed, then an eager backward on its saved state
 *     gives the eager step's bits. */
static int wgrad_cublaslt_case(fp8_fixture_t *fx, const comet_moe_args_t *a8, const comet_moe_backward_args_t *b8,
                               const step_out_t *o8, int top_k)
{
    comet_comm_t comm = fx->comm;
    comet_moe_t moe;
    if (open_fp8_layer(comm, top_k, 1, 1, &moe)) return 1;
    comet_moe_args_t a = *a8;
    comet_moe_backward_args_t b = *b8;
    b.grads.mode = COMET_GRAD_WRITE_BF16;
    step_out_t lt, again;
    if (repeatable_step(fx, moe, &a, &b, &lt, &again)) return 1;
    CHECK(memcmp(lt.y, o8->y, fx->ny * 2) == 0);
    CHECK(memcmp(lt.dx, o8->dx, fx->ny * 2) == 0);
    CHECK(memcmp(lt.dw, o8->dw, fx->nw * 4) == 0);
    double m[5], used = 0;
    if (step_against(fx, "cuBLASLt's weight gradients against comet's", &lt, o8, ON_GRID, m, &used)) return 1;
    printf("rank %d: fp8_wgrad_cublaslt, top-%d: against comet's weight gradients d gate_up %.2e, d down %.2e "
           "(elements at most %.0f%% of their bound); y, dx, d topk_weights the same bits\n", fx->me, top_k, m[2],
           m[3], 100 * used);
    CHECK(m[2] < 1e-4);
    CHECK(m[3] < 1e-4);
    uint64_t rng = 0x5eed1234ull + (uint64_t)top_k;
    if (accumulate_case(fx, moe, &a, &b, &lt, &rng)) return 1;
    b.grads.mode = COMET_GRAD_WRITE_BF16;
    /* Capture: the forward is taken, the backward refused before anything is enqueued. */
    comet_moe_saved_t sv;
    COMET_OK(comet_moe_saved_create(moe, NULL, &sv), comm);
    if (poison_outputs(fx, 1)) return 1;
    CUDA_OK(cudaDeviceSynchronize());
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(fx->st, cudaStreamCaptureModeThreadLocal));
    const comet_status_t f_st = comet_moe_forward_train(moe, &a, sv, fx->st);
    b.saved = sv;
    const comet_status_t b_st = comet_moe_backward(moe, &b, fx->st);
    CUDA_OK(cudaStreamEndCapture(fx->st, &graph));
    CHECK_EQ(f_st, COMET_SUCCESS);
    CHECK_EQ(b_st, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(moe), "fp8_wgrad_cublaslt = 1");
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, fx->st));
    COMET_OK(comet_moe_backward(moe, &b, fx->st), comm);
    CUDA_OK(cudaStreamSynchronize(fx->st));
    CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
    if (copy_outputs(fx, &again, 1) || same_bits(fx, &lt, &again)) return 1;
    cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
    COMET_OK(comet_moe_saved_destroy(sv), comm);
    free_out(&lt), free_out(&again);
    COMET_OK(comet_moe_destroy(moe), comm);
    return 0;
}

/* The layer made with config.fp8_pow2_scales = 0 (scales amax / 448; what SwiGLU's backward
 * makes and x cast along the tokens, the weight gradients' B operands, rounded up to 8
 * significant bits, which comet's weight-gradient GEMM reads as bf16), on o16's inputs and
 * weights:
 *   - two fused steps give the same bits;
 *   - the sequential step, whose casts take the same rules and whose weight gradients run
 *     through cuBLASLt on fp32 copies of the same scales: sequential_case's bars (y
 *     measure < 5e-4, the rest < 1e-4, elements within ON_GRID);
 *   - both against the bf16 layer: x lies on the power-of-two E4M3 grid, which amax / 448
 *     scales round again (in its rows, then along the tokens), so the soak's bars for x
 *     off the grid (measure < 2e-3, elements within OFF_GRID). */
static int exact_scales_case(fp8_fixture_t *fx, const comet_moe_args_t *a8, const comet_moe_backward_args_t *b8,
                             const step_out_t *o16, int top_k)
{
    comet_comm_t comm = fx->comm;
    comet_moe_t moe;
    if (open_fp8_layer(comm, top_k, 0, 0, &moe)) return 1;
    comet_moe_args_t a = *a8;
    comet_moe_backward_args_t b = *b8;
    b.grads.mode = COMET_GRAD_WRITE_BF16;
    step_out_t fused, again, seq;
    alloc_out(fx, &seq);
    if (repeatable_step(fx, moe, &a, &b, &fused, &again)) return 1;
    a.impl = COMET_IMPL_BASELINE;
    if (step(fx, moe, &a, &b, &seq)) return 1;
    double m_seq[5], m_fused16[5], m_seq16[5], used_seq = 0, used16 = 0;
    if (step_against(fx, "amax / 448 scales: sequential against fused", &seq, &fused, ON_GRID, m_seq, &used_seq) ||
        step_against(fx, "amax / 448 scales: fused against bf16", &fused, o16, OFF_GRID, m_fused16, &used16) ||
        step_against(fx, "amax / 448 scales: sequential against bf16", &seq, o16, OFF_GRID, m_seq16, &used16))
        return 1;
    printf("rank %d: fp8_pow2_scales = 0, top-%d: sequential against fused y %.2e, dx %.2e, d topk_weights %.2e, d "
           "gate_up %.2e, d down %.2e; fused against the bf16 layer y %.2e, dx %.2e, d topk_weights %.2e, d gate_up "
           "%.2e, d down %.2e\n", fx->me, top_k, m_seq[0], m_seq[1], m_seq[4], m_seq[2], m_seq[3], m_fused16[0],
           m_fused16[1], m_fused16[4], m_fused16[2], m_fused16[3]);
    CHECK(m_seq[0] < 5e-4);
    for (int i = 0; i < 5; i++) {
        if (i) CHECK(m_seq[i] < 1e-4);
        CHECK(m_fused16[i] < 2e-3);
        CHECK(m_seq16[i] < 2e-3);
    }
    free_out(&fused), free_out(&again), free_out(&seq);
    COMET_OK(comet_moe_destroy(moe), comm);
    return 0;
}

static int fp8_train_case(const cometi_rank_ctx_t *ctx, comet_comm_t comm, uint64_t seed, int top_k)
{
    const int me = ctx->rank;
    uint64_t rng = seed ^ 0x7f8e9dull;
    fp8_fixture_t fx;
    fp8_layers_t L;
    if (fp8_layers_open(ctx, comm, top_k, &rng, &fx, &L)) return 1;
    comet_moe_t moe8 = L.moe8, moe16 = L.moe16;
    /* This rank's tokens: x on the E4M3 grid (quantized and dequantized), dy random. */
    fx.m = MAX_TOKENS - 41 * me;
    fx.ny = (size_t)fx.m * H, fx.nw = (size_t)fx.m * top_k;
    float *xf = malloc(fx.ny * 4 + 4), *dyf = malloc(fx.ny * 4 + 4), *wts = malloc(fx.nw * 4 + 4);
    uint16_t *xh = malloc(fx.ny * 2 + 2), *dyh = malloc(fx.ny * 2 + 2);
    int32_t *ids = malloc(fx.nw * 4 + 4);
    fill_bf16(xf, xh, fx.ny, 1.0, &rng);
    fill_bf16(dyf, dyh, fx.ny, 1.0, &rng);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, fx.m, top_k, E, seed, me, ids, wts);
    const int kb = (H + 127) / 128;
    void *xq;
    float *xs;
    CUDA_OK(cudaMalloc(&xq, fx.ny + 16));
    CUDA_OK(cudaMalloc((void **)&xs, sizeof(float) * fx.m * kb + 16));
    CUDA_OK(cudaMemcpy(fx.x, xh, fx.ny * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx.dy, dyh, fx.ny * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx.w, wts, fx.nw * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(fx.ids, ids, fx.nw * 4, cudaMemcpyHostToDevice));
    if (fx.m > 0) {
        CHECK_EQ(comet_quantize_fp8_rows(fx.x, fx.m, H, 1, xq, xs, 0), COMET_SUCCESS);
        uint8_t *hq = malloc(fx.ny);
        float *hs = malloc(sizeof(float) * fx.m * kb);
        CUDA_OK(cudaMemcpy(hq, xq, fx.ny, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(hs, xs, sizeof(float) * fx.m * kb, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < fx.ny; i++) xh[i] = cometi_float_to_bf16(cometi_e4m3_decode(hq[i]) * hs[i / H * kb + i % H / 128]);
        CUDA_OK(cudaMemcpy(fx.x, xh, fx.ny * 2, cudaMemcpyHostToDevice));
        free(hq), free(hs);
    }
    comet_moe_args_t a = L.a8;
    comet_moe_backward_args_t b = L.b8;
    a.num_tokens = fx.m;
    comet_moe_saved_t sv;
    COMET_OK(comet_moe_saved_create(moe8, NULL, &sv), comm);
    /* Saved bytes: x's rows in E4M3 with their scales (hidden + 16 here), [g u] in bf16. */
    size_t bytes8 = 0, bytes16 = 0;
    COMET_OK(comet_moe_saved_bytes(moe8, NULL, &bytes8), comm);
    COMET_OK(comet_moe_saved_bytes(moe16, NULL, &bytes16), comm);
    CHECK(bytes8 < bytes16);
    /* Steps: FP8 twice, then the bf16 layer on the same operands. */
    step_out_t o8, again, o16;
    alloc_out(&fx, &o8), alloc_out(&fx, &again), alloc_out(&fx, &o16);
    if (step(&fx, moe8, &a, &b, &o8) || step(&fx, moe8, &a, &b, &again)) return 1;
    if (same_bits(&fx, &o8, &again)) return 1;
    /* The step captured in a CUDA graph and replayed: the eager bits. */
    {
        comet_moe_saved_t gsv;
        COMET_OK(comet_moe_saved_create(moe8, NULL, &gsv), comm);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_OK(cudaStreamBeginCapture(fx.st, cudaStreamCaptureModeThreadLocal));
        const comet_status_t f_st = comet_moe_forward_train(moe8, &a, gsv, fx.st);
        b.saved = gsv;
        const comet_status_t b_st = comet_moe_backward(moe8, &b, fx.st);
        CUDA_OK(cudaStreamEndCapture(fx.st, &graph));
        if (f_st != COMET_SUCCESS || b_st != COMET_SUCCESS) printf("rank %d capture: %s\n", me, comet_moe_last_error(moe8));
        CHECK_EQ(f_st, COMET_SUCCESS);
        CHECK_EQ(b_st, COMET_SUCCESS);
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        if (poison_outputs(&fx, 1)) return 1;
        CUDA_OK(cudaGraphLaunch(exec, fx.st));
        CUDA_OK(cudaStreamSynchronize(fx.st));
        CHECK_EQ(comet_comm_get_async_error(comm), COMET_SUCCESS);
        if (copy_outputs(&fx, &again, 1) || same_bits(&fx, &o8, &again)) return 1;
        cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
        COMET_OK(comet_moe_saved_destroy(gsv), comm);
    }
    /* The backward's refusals, on a filled saved state (which they leave filled). */
    CUDA_OK(cudaMemsetAsync(fx.y, 0xff, fx.ny * 2, fx.st));
    COMET_OK(comet_moe_forward_train(moe8, &a, sv, fx.st), comm);
    b.saved = sv;
    const void *keep = b.weights_t.down;
    b.weights_t.down = NULL;
    CHECK_EQ(comet_moe_backward(moe8, &b, fx.st), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(moe8), "weights_t.down is NULL");
    b.weights_t.down = (const char *)keep + 8;
    CHECK_EQ(comet_moe_backward(moe8, &b, fx.st), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(moe8), "16-byte aligned");
    b.weights_t.down = keep;
    CUDA_OK(cudaDeviceSynchronize());
    /* The training forward's y is the inference forward's. */
    uint16_t *y_inf = malloc(fx.ny * 2 + 2);
    CUDA_OK(cudaMemsetAsync(fx.y, 0xff, fx.ny * 2, fx.st));
    COMET_OK(comet_moe_forward(moe8, &a, fx.st), comm);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(y_inf, fx.y, fx.ny * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(y_inf, o8.y, fx.ny * 2) == 0);
    /* The bf16 layer. */
    comet_moe_args_t a16 = L.a16;
    comet_moe_backward_args_t b16 = L.b16;
    a16.num_tokens = fx.m;
    /* FP8 fields on a bf16 layer are refused. */
    comet_moe_saved_t sv16;
    COMET_OK(comet_moe_saved_create(moe16, NULL, &sv16), comm);
    COMET_OK(comet_moe_forward_train(moe16, &a16, sv16, fx.st), comm);
    b16.saved = sv16, b16.weights_t.down = b.weights_t.down;
    CHECK_EQ(comet_moe_backward(moe16, &b16, fx.st), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_moe_last_error(moe16), "weights_t.down");
    b16.weights_t.down = NULL;
    CUDA_OK(cudaDeviceSynchronize());
    COMET_OK(comet_moe_saved_destroy(sv16), comm);
    if (step(&fx, moe16, &a16, &b16, &o16)) return 1;
    /* Against the bf16 layer, tensor by tensor. */
    struct { const char *name; const uint16_t *got, *want; size_t n, group; } t16[] = {
        {"y", o8.y, o16.y, fx.ny, H}, {"dx", o8.dx, o16.dx, fx.ny, H},
        {"d gate_up", o8.g13, o16.g13, fx.n13, (size_t)F * H}, {"d down", o8.g2, o16.g2, fx.n2, (size_t)H * F},
    };
    double measure[5] = {0}, used = 0;
    for (int i = 0; i < 4; i++) {
        float *g = bf16_floats(t16[i].got, t16[i].n), *w = bf16_floats(t16[i].want, t16[i].n);
        const int failed = t16[i].n && against_bf16(t16[i].name, me, g, w, t16[i].n, t16[i].group, ON_GRID,
                                                    &measure[i], &used);
        free(g), free(w);
        if (failed) return 1;
    }
    if (fx.nw && against_bf16("d topk_weights", me, o8.dw, o16.dw, fx.nw, fx.nw, ON_GRID, &measure[4], &used))
        return 1;
    printf("rank %d: FP8 training step, top-%d, %d tokens, against the bf16 layer on the same operands, 1 - "
           "2xy/(x^2+y^2): y %.2e, dx %.2e, d topk_weights %.2e, d gate_up %.2e, d down %.2e, elements at most "
           "%.0f%% of their bound; bitwise repeatable; saved state %.2fx the bf16 one's\n", me, top_k, fx.m,
           measure[0], measure[1], measure[4], measure[2], measure[3], 100 * used, (double)bytes8 / (double)bytes16);
    for (int i = 0; i < 5; i++) CHECK(measure[i] < 1e-3);
    if (gate_up_e4m3_case(&fx, moe8, &a, &b, &o8, &o16, bytes8, bytes16, top_k)) return 1;
    if (sequential_case(&fx, &L, &a, &b, &o8, &o16, top_k)) return 1;
    if (accumulate_case(&fx, moe8, &a, &b, &o8, &rng)) return 1;
    if (wgrad_cublaslt_case(&fx, &a, &b, &o8, top_k)) return 1;
    if (exact_scales_case(&fx, &a, &b, &o16, top_k)) return 1;
    free(y_inf);
    free_out(&o8), free_out(&again), free_out(&o16);
    COMET_OK(comet_moe_saved_destroy(sv), comm);
    free(xf), free(dyf), free(wts), free(xh), free(dyh), free(ids);
    cudaFree(xq), cudaFree(xs);
    return fp8_layers_close(comm, &fx, &L);
}

static int fp8_train_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 20000, &comm)) return 1;
    if (fp8_train_case(ctx, comm, seed, 2) || fp8_train_case(ctx, comm, seed + 1, 4)) return 1;
    COMET_OK(comet_comm_destroy(comm), comm);
    return 0;
}

int test_gpu_fp8_training(void) { return launch_seeded(fp8_train_rank, 240); }

/* ---- 1000 FP8 training steps ---- */

/* Steps of random token counts (0 included) and routings (random, skewed, every token's
 * first choice one expert, balanced) on fresh random x and dy (x not on the E4M3 grid:
 * the FP8 layer's rounding of x counts too, so the bf16 comparison allows 2e-3 of the
 * measure per tensor, its element bounds as test_gpu_fp8_training's). Every 50th step:
 * the same step again, bit for bit, and the bf16 layer on the same inputs and weights.
 * The device memory of the FP8-only stretches after the first does not grow (the FP8
 * workspaces come with the first training forward), nor the host's past glibc's trim
 * threshold twice over; no step fails. */
static int fp8_soak_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    const uint64_t seed = *(uint64_t *)arg;
    comet_comm_t comm;
    if (open_comm(ctx, 20000, &comm)) return 1;
    const int me = ctx->rank, k = 2;
    uint64_t rng = seed ^ 0x50a450a4ull;
    fp8_fixture_t fx;
    fp8_layers_t L;
    if (fp8_layers_open(ctx, comm, k, &rng, &fx, &L)) return 1;
    comet_moe_t moe8 = L.moe8, moe16 = L.moe16;
    comet_moe_args_t a = L.a8, a16 = L.a16;
    comet_moe_backward_args_t b = L.b8, b16 = L.b16;
    const size_t rows = (size_t)MAX_TOKENS * H, choices = (size_t)MAX_TOKENS * k;
    comet_moe_saved_t sv, sv16;
    COMET_OK(comet_moe_saved_create(moe8, NULL, &sv), comm);
    COMET_OK(comet_moe_saved_create(moe16, NULL, &sv16), comm);
    int32_t *ids = malloc(choices * 4);
    float *wts = malloc(choices * 4);
    fx.ny = rows, fx.nw = choices; /* the outputs' room, for alloc_out */
    step_out_t o8, again, o16;
    alloc_out(&fx, &o8), alloc_out(&fx, &again), alloc_out(&fx, &o16);
    const int steps = 1000, every = 50;
    memory_mark_t stretch = {0, 0}, now;
    long long dev_growth = 0;
    long page_growth = 0;
    double worst[5] = {0}, used = 0;
    for (int s = 0; s < steps; s++) {
        const int m = (int)(cometi_rand_next(&rng) % (MAX_TOKENS + 1));
        const cometi_routing_t kind = (cometi_routing_t)(cometi_rand_next(&rng) % 4);
        cometi_make_routing(kind, kind == COMETI_ROUTING_ONE_EXPERT ? (double)(s % E) : 8.0, m, k, E, seed + s, me,
                            ids, wts);
        CUDA_OK(cudaMemcpy(fx.ids, ids, sizeof(int32_t) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(fx.w, wts, sizeof(float) * m * k, cudaMemcpyHostToDevice));
        CUDA_OK(cometi_fill_hash_bf16(fx.x, (size_t)m * H, seed + s, (uint64_t)me * rows, 1.0f, 0));
        CUDA_OK(cometi_fill_hash_bf16(fx.dy, (size_t)m * H, seed + s + 7777, (uint64_t)me * rows, 1.0f, 0));
        CUDA_OK(cudaDeviceSynchronize()); /* the fills ran on the legacy stream */
        fx.m = m, fx.ny = (size_t)m * H, fx.nw = (size_t)m * k;
        a.num_tokens = a16.num_tokens = m;
        const int check = s % every == every - 1;
        if (step_in(&fx, moe8, &a, &b, sv, check ? &o8 : NULL)) {
            printf("rank %d: FP8 step %d (%d tokens, routing %d) failed\n", me, s, m, (int)kind);
            return 1;
        }
        if (!check) continue;
        if (s > every) {
            CHECK_EQ(memory_mark(&now), 0);
            dev_growth += now.device_used - stretch.device_used;
            page_growth += now.host_pages - stretch.host_pages;
        }
        if (step_in(&fx, moe8, &a, &b, sv, &again) || same_bits(&fx, &o8, &again)) {
            printf("rank %d: FP8 step %d (%d tokens, routing %d) not repeatable\n", me, s, m, (int)kind);
            return 1;
        }
        if (step_in(&fx, moe16, &a16, &b16, sv16, &o16)) return 1;
        const uint16_t *got[4] = {o8.y, o8.dx, o8.g13, o8.g2}, *want[4] = {o16.y, o16.dx, o16.g13, o16.g2};
        const size_t n[4] = {fx.ny, fx.ny, fx.n13, fx.n2}, group[4] = {H, H, (size_t)F * H, (size_t)H * F};
        static const char *const names[5] = {"y", "dx", "d gate_up", "d down", "d topk_weights"};
        for (int i = 0; i < 5; i++) {
            double measure = 0;
            int failed;
            if (i < 4) {
                float *g = bf16_floats(got[i], n[i]), *w = bf16_floats(want[i], n[i]);
                failed = n[i] && against_bf16(names[i], me, g, w, n[i], group[i], OFF_GRID, &measure, &used);
                free(g), free(w);
            } else {
                failed = fx.nw && against_bf16(names[i], me, o8.dw, o16.dw, fx.nw, fx.nw, OFF_GRID, &measure, &used);
            }
            /* The measure is a mean of squared relative errors: over a few values (d topk_weights
             * of 9 tokens is 18) it scatters widely, so there the groups' bound holds. */
            const size_t count = i < 4 ? n[i] : fx.nw;
            const double bound = count >= SOAK_MEASURE_MIN ? 2e-3 : 1e-2;
            if (failed || !(measure < bound)) {
                printf("rank %d: step %d (%d tokens, routing %d): %s measures %.3g against the bf16 layer (bound "
                       "%.0e)\n", me, s, m, (int)kind, names[i], measure, bound);
                return 1;
            }
            if (count >= SOAK_MEASURE_MIN && measure > worst[i]) worst[i] = measure;
        }
        CHECK_EQ(memory_mark(&stretch), 0);
    }
    const long page_kb = sysconf(_SC_PAGESIZE) / 1024;
    printf("rank %d: %d FP8 training steps; every %dth bitwise repeated, and against the bf16 layer worst 1 - "
           "2xy/(x^2+y^2): y %.2e, dx %.2e, d gate_up %.2e, d down %.2e, d topk_weights %.2e, elements at most "
           "%.0f%% of their bound; growth over the FP8 stretches after step %d: device %lld bytes, host resident "
           "%ld KiB\n", me, steps, every, worst[0], worst[1], worst[2], worst[3], worst[4], 100 * used, every,
           dev_growth, page_growth * page_kb);
    CHECK(dev_growth == 0);
    CHECK(page_growth * page_kb <= 256);
    free_out(&o8), free_out(&again), free_out(&o16);
    free(ids), free(wts);
    COMET_OK(comet_moe_saved_destroy(sv), comm);
    COMET_OK(comet_moe_saved_destroy(sv16), comm);
    if (fp8_layers_close(comm, &fx, &L)) return 1;
    COMET_OK(comet_comm_destroy(comm), comm);
    return 0;
}

int test_gpu_fp8_training_1000_steps(void) { return launch_seeded(fp8_soak_rank, 280); }
