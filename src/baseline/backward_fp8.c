/*
 * backward_fp8.c - the sequential path's backward in block-scaled FP8 (DeepSeek-V3's
 * recipe), the yardstick of the fused FP8 backward: the steps of backward.c, with every
 * GEMM a cuBLASLt block-scaled one, as Transformer Engine runs its blockwise recipe:
 *   0. x's rows cast along the tokens, from the E4M3 rows the forward kept (an FP8 layer
 *      always keeps them: config.resend_x is refused there);
 *   1. dy quantized once per token (1 x 128), its rows and scales to their send places,
 *      the routing weights beside them;
 *   2. the forward's dispatch messages, values, scales and weights;
 *   3. per local expert, one cuBLASLt call each: s = dy W2 (dy's 1 x 128 scales by W2^T's
 *      128 x 128 ones, W^T's E4M3 copy: FP8 MMAs read k-major operands only); SwiGLU's FP8
 *      backward, which writes dh's rows 1 x 128 and (w a)^T, dh^T along the tokens; dx rows
 *      = dh W13 (on W13^T's copy); dy cast along the tokens; then dW2 = dy^T (w a) and
 *      dW13 = dh^T x with both operands 1 x 128 along the tokens (128 x 1 in the forward's
 *      orientation), k each expert's tokens.
 * Step 4, the return and the sums at home, is backward.c's, in bf16 as the fused path's.
 * The pointwise kernels are the fused path's own (pointwise/), so the two differ in their
 * GEMMs alone: where they accumulate and in what order.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline/baseline.h"
#include "baseline/rows.h"
#include "layer/layer.h"
#include "pointwise/pointwise.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void cometi_baseline_fp8_train_free(cometi_baseline_t *b)
{
    cometi_baseline_fp8_train_t *t = b->fp8_train;
    if (!t) return;
    void *bufs[] = {t->dh_scales, t->dh_packed, t->wt_down_scales, t->wt_gate_up_scales};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaFree(bufs[i]);
    cometi_fp8_wgrad_operands_free(&t->wg);
    free(t);
    b->fp8_train = NULL;
}

/* This rank's workspaces: 0, or the failure with its message in moe->err. About
 * (2 H + 3 F) bytes per row of the receive bound for the cast operands, and their scales. */
static comet_status_t fp8_train_alloc(comet_moe_t moe, cometi_baseline_t *b)
{
    cometi_baseline_fp8_train_t *t = calloc(1, sizeof(*t));
    const int per = moe->experts_per_rank;
    b->fp8_train = t;
    if (!t) return cometi_fail(moe->err, COMET_OUT_OF_MEMORY, "FP8 training (sequential): out of host memory");
    const int64_t R = moe->max_recv_rows, H = moe->cfg.hidden, F = moe->ffn_local, L2 = 2 * F / 128;
    comet_status_t st = cometi_fp8_wgrad_operands_alloc(moe->err, "FP8 training (sequential)", R, H, F, per, &t->wg);
    if (st != COMET_SUCCESS) { /* freed before the ranks agree: the agreement allocates too */
        cometi_baseline_fp8_train_free(b);
        return st;
    }
    struct { void **p; size_t bytes; } a[] = {
        {(void **)&t->dh_scales, sizeof(float) * L2 * R},
        {(void **)&t->dh_packed, sizeof(float) * L2 * R},
        {(void **)&t->wt_down_scales, sizeof(float) * per * (F / 128) * cometi_blaslt_fp8_b_scale_ld((int)H)},
        {(void **)&t->wt_gate_up_scales,
         sizeof(float) * per * ceil_div(H, 128) * cometi_blaslt_fp8_b_scale_ld((int)(2 * F))},
    };
    for (size_t i = 0; i < sizeof(a) / sizeof(a[0]); i++) {
        char what[96];
        snprintf(what, sizeof(what), "FP8 training (sequential): cudaMalloc(%zu bytes)", a[i].bytes);
        st = cometi_cuda(moe->err, cudaMalloc(a[i].p, a[i].bytes ? a[i].bytes : 1), what);
        if (st != COMET_SUCCESS) { /* freed before the ranks agree: the agreement allocates too */
            cometi_baseline_fp8_train_free(b);
            return st;
        }
    }
    return COMET_SUCCESS;
}

comet_status_t cometi_baseline_fp8_train_get(comet_moe_t moe, cometi_baseline_t *b)
{
    if (b->fp8_train) return COMET_SUCCESS;
    const comet_status_t st = cometi_moe_agree(moe, fp8_train_alloc(moe, b), "FP8 training (sequential)",
                                               "make its FP8 backward workspaces");
    if (st != COMET_SUCCESS) cometi_baseline_fp8_train_free(b); /* every rank alike: the next call tries again */
    return st;
}

/* A bf16 [m][H] tensor's rows (dy's) quantized per token into b->xq / b->xs and moved to
 * the send places the forward kept. */
static comet_status_t quantize_to_send_order(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_saved_t sv,
                                             const void *rows, const char *what, cudaStream_t stream)
{
    const int H = moe->cfg.hidden, L0 = (int)ceil_div(H, 128), k = moe->cfg.top_k, m = sv->num_tokens;
    COMETI_TRY(cometi_cuda(moe->err, cometi_quantize_rows_e4m3(rows, m, H, H, b->xq, H, b->xs, L0, 1,
                                                               moe->cfg.fp8_pow2_scales, stream), what));
    return cometi_cuda(moe->err, cometi_launch_permute_fp8(b->xq, b->xs, NULL, NULL, NULL, m * k, k, H, L0, b->send_q,
                                                           b->send_s, sv->send_pos, stream),
                       "launch permute_fp8_kernel");
}

/* E4M3 rows [..][H] with K-major scales ([row][L0]) cast along the tokens, per segment, by
 * the scale rule `rule` (cometi_fp8_scale). */
static comet_status_t cast_along_tokens(comet_moe_t moe, const comet_moe_saved_t sv, const void *q, const float *s,
                                        int64_t rows, void *qt, float *qt_scales, int64_t ld, int rule,
                                        const char *what, cudaStream_t stream)
{
    const int H = moe->cfg.hidden, L0 = (int)ceil_div(H, 128);
    return cometi_cuda(moe->err, cometi_requantize_segments_t_e4m3(q, H, s, L0, 1, H, rows, sv->segs,
                                                                   moe->experts_per_rank, qt, ld, qt_scales, 1, H,
                                                                   rule, stream),
                       what);
}

comet_status_t cometi_baseline_fp8_send(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_backward_args_t *args,
                                        cudaStream_t stream)
{
    const comet_moe_saved_t sv = args->saved;
    const cometi_baseline_fp8_train_t *t = b->fp8_train;
    const int H = moe->cfg.hidden, n = sv->num_tokens * moe->cfg.top_k;
    const int64_t R = moe->max_recv_rows, rows = sv->cap_rows < R ? sv->cap_rows : R;
    /* 0. */
    const float *kept_s = (const float *)((const uint8_t *)sv->recv + (size_t)sv->cap_rows * H);
    COMETI_TRY(cast_along_tokens(moe, sv, sv->recv, kept_s, rows, t->wg.x_t, t->wg.x_t_scales, t->wg.ld,
                                 cometi_wgrad_b_scale_rule(moe->cfg.fp8_pow2_scales),
                                 "cast x^T to FP8 along the tokens", stream));
    /* 1. and 2. */
    COMETI_TRY(quantize_to_send_order(moe, b, sv, args->dy, "launch quantize_rows_kernel (dy)", stream));
    COMETI_TRY(cometi_cuda(moe->err, cometi_launch_weights_to_send_order(sv->weights, sv->send_pos, n, b->w_send,
                                                                         stream),
                           "launch weights_to_send_order_kernel"));
    /* Per chunk its E4M3 values, its scales and its routing weights, as the forward's x went. */
    const cometi_row_part_t parts[3] = {{b->send_q, b->recv_q, (size_t)H, 1, ncclUint8},
                                        {b->send_s, b->recv_s, (size_t)ceil_div(H, 128), 4, ncclFloat32},
                                        {b->w_send, b->w_recv, 1, 4, ncclFloat32}};
    return cometi_baseline_dispatch(moe, sv->sends, sv->n_sends, sv->recvs, sv->n_recvs, parts, 3, stream,
                                    "backward dispatch all-to-all");
}

comet_status_t cometi_baseline_fp8_experts(comet_moe_t moe, cometi_baseline_t *b,
                                           const comet_moe_backward_args_t *args, cudaStream_t stream)
{
    char *err = moe->err;
    const comet_moe_saved_t sv = args->saved;
    const cometi_baseline_fp8_train_t *t = b->fp8_train;
    const int per = moe->experts_per_rank, H = moe->cfg.hidden, F = moe->ffn_local, pow2 = moe->cfg.fp8_pow2_scales;
    const int L2 = 2 * F / 128;
    const int64_t R = moe->max_recv_rows, rows = sv->cap_rows < R ? sv->cap_rows : R;
    const comet_moe_weights_t *wt = &args->weights_t;
    const comet_moe_weight_scales_t *wts = &args->weight_t_scales;
    COMETI_TRY(cometi_baseline_injected_failure(moe, b));
    /* s = dy W2: dy's scales packed by group, W2^T [F][H] by its 128 x 128 scales. */
    int max_padded = 0;
    COMETI_TRY(cometi_baseline_fp8_groups(moe, b, sv->segs_host, b->recv_q, b->recv_s, &max_padded, stream));
    const float *s_down, *s_gate_up;
    COMETI_TRY(cometi_baseline_weight_scales(moe, F, H, wts->down, t->wt_down_scales, &s_down, stream));
    COMETI_TRY(cometi_blaslt_fp8_grouped(err, b->lt, per, b->lt_start, b->lt_rows, F, H, b->recv_q, b->a0_scales,
                                         wt->down, s_down, b->act, F, stream));
    /* SwiGLU's backward: dh's E4M3 rows over s's bytes, (w a)^T and dh^T along the tokens,
     * and each row's <s, a>. */
    COMETI_TRY(cometi_cuda(err, cometi_launch_swiglu_backward_e4m3(sv->h, sv->h_scales, sv->cap_rows, b->act, F,
                                                                   sv->segs, per, sv->max_seg_rows, rows, b->w_recv,
                                                                   b->dw_recv, t->dh_scales, R, t->wg.wa_t,
                                                                   t->wg.wa_t_scales, t->wg.dh_t, t->wg.dh_t_scales,
                                                                   t->wg.ld, cometi_wgrad_b_scale_rule(pow2), stream),
                           "launch SwiGLU's FP8 backward"));
    /* dx rows = dh W13: dh's scales (MN-major, [L2][R]) packed by group, W13^T [H][2F]. */
    COMETI_TRY(cometi_cuda(err, cometi_launch_fp8_pack_groups(b->groups, per, max_padded, t->dh_scales, 1, R, L2,
                                                              b->act, 2 * F, t->dh_packed, stream),
                           "launch fp8_pack_groups_kernel (dh)"));
    COMETI_TRY(cometi_baseline_weight_scales(moe, H, 2 * F, wts->gate_up, t->wt_gate_up_scales, &s_gate_up, stream));
    COMETI_TRY(cometi_blaslt_fp8_grouped(err, b->lt, per, b->lt_start, b->lt_rows, H, 2 * F, b->act, t->dh_packed,
                                         wt->gate_up, s_gate_up, b->out, H, stream));
    /* The weight gradients, k each expert's tokens in whole 128-token blocks (the casts wrote
     * zeros past each segment's end). */
    COMETI_TRY(cast_along_tokens(moe, sv, b->recv_q, b->recv_s, R, t->wg.dy_t, t->wg.dy_t_scales, t->wg.ld, pow2,
                                 "cast dy^T to FP8 along the tokens", stream));
    return cometi_blaslt_fp8_weight_grads(err, b->lt, per, sv->segs_host, &t->wg, H, F, &args->grads, stream);
}
