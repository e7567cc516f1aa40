/*
 * train_fused.c - training on the fused path: the forward's two operators keep what the
 * backward needs, and the backward is the same two operators again:
 *
 * forward   dispatch -> GEMM0 + SwiGLU, its epilogue keeping [g u]; x rows kept (unless the
 *           config resends x); GEMM1 -> combine as the inference forward's; each choice's
 *           place in the send order kept.
 * backward  1. at home: the routing weights into this rank's window, in the send order;
 *           2. dispatch -> GEMM: dy's rows to their experts over the forward's routing, as
 *              x went (route again from the kept ids, with the forward's call id, which
 *              every rank's must match), into s = dy W2 (B read MN-major); where the config
 *              resends x, x's rows beside them (the forward kept none);
 *           3. at the experts: each received row's weight w from its source's window;
 *              SwiGLU's backward in place with d topk_weights' part <s, a> ([g u] becomes
 *              dh = [dg du] of da = w s, s becomes w a); each row's <s, a> into its
 *              source's window; the padding rows zeroed for the weight gradients;
 *           4. GEMM -> combine: dx rows = dh W13 (B MN-major) home, each token's choices
 *              summed (the route's weights are 1); once they are home, so are the <s, a>
 *              (sent before), and d topk_weights sums each choice's TP partials;
 *           5. the weight gradients, groups along K: dW2 = dy^T (w a), dW13 = dh^T x;
 *              with the push, enqueued between 4's GEMM and its sum at home, so that they
 *              compute while the dx rows of peers are on their way (DESIGN: the work that
 *              fills the SMs while rows are in flight).
 * d topk_weights is <s, a> rather than <dy, o>: the forward keeps no expert outputs (a
 * row of hidden per choice) and needs no pass over them, and the backward's dy goes per
 * token, unweighted. The backward consumes the saved state ([g u] becomes dh).
 *
 * In block-scaled FP8 the same steps, with every GEMM in E4M3 (DeepSeek-V3's recipe):
 * the forward keeps x's rows as they arrived (E4M3 and their 1 x 128 scales) and [g u] in
 * bf16 (or, as the saved state asks, in E4M3 with 1 x 128 scales) from GEMM0's quantizing
 * epilogue; dy is quantized once per token before it is dispatched; the dgrad GEMMs read
 * W^T's E4M3 copies (FP8 MMAs read k-major operands only);
 * SwiGLU's backward writes its FP8 operands directly (dh 1 x 128 for dx = dh W13, w a and
 * dh in 128 x 1 blocks along the tokens per expert segment for the weight gradients), and
 * dy and x are requantized the same way from their E4M3 rows.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer/fused.h"
#include "baseline/baseline.h"
#include "pointwise/pointwise.h"
#include "layer/train_rows.h"

#define BF16 2

void cometi_fp8_train_free(struct cometi_fused *f)
{
    cometi_fp8_train_t *t = f->fp8;
    if (!t) return;
    void *bufs[] = {t->s, t->dh_scales, t->dot_parts};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaFree(bufs[i]);
    cometi_fp8_wgrad_operands_free(&t->wg);
    cometi_blaslt_fp8_destroy(t->lt);
    cudaFreeHost(t->segs_host);
    if (t->segs_copied) cudaEventDestroy(t->segs_copied);
    free(t);
    f->fp8 = NULL;
}

/* config.fp8_wgrad_cublaslt's: the cuBLASLt handle, the segments' host copy and its event
 * (on failure t is left for cometi_fp8_train_free). */
static comet_status_t lt_alloc(comet_moe_t moe, int per, cometi_fp8_train_t *t)
{
    COMETI_TRY(cometi_blaslt_fp8_create(moe->err, &t->lt));
    COMETI_TRY(cometi_cuda(moe->err, cudaMallocHost((void **)&t->segs_host, sizeof(cometi_segment_t) * per),
                           "FP8 training: cudaMallocHost(the experts' segments)"));
    return cometi_cuda(moe->err, cudaEventCreateWithFlags(&t->segs_copied, cudaEventDisableTiming),
                       "FP8 training: cudaEventCreate");
}

/* The FP8 backward's workspaces on this rank: 0, or the failure with its message. */
static comet_status_t fp8_train_alloc(comet_moe_t moe, struct cometi_fused *f)
{
    cometi_fp8_train_t *t = calloc(1, sizeof(*t));
    if (!t) return cometi_fail(moe->err, COMET_OUT_OF_MEMORY, "FP8 training: out of host memory");
    f->fp8 = t;
    const int64_t R = f->l0.max_recv_rows, H = moe->cfg.hidden, F = moe->ffn_local;
    comet_status_t st = cometi_fp8_wgrad_operands_alloc(moe->err, "FP8 training", R, H, F, f->l0.experts_per_group,
                                                        &t->wg);
    if (st != COMET_SUCCESS) {
        cometi_fp8_train_free(f);
        return st;
    }
    struct { void **p; size_t bytes; } a[] = {
        {&t->s, (size_t)R * F * BF16},
        {(void **)&t->dh_scales, sizeof(float) * (size_t)(2 * F / 128) * R},
        {(void **)&t->dot_parts, sizeof(float) * (size_t)(F / 128) * R},
    };
    for (size_t i = 0; i < sizeof(a) / sizeof(a[0]); i++) {
        char what[96];
        snprintf(what, sizeof(what), "FP8 training: cudaMalloc(%zu bytes)", a[i].bytes);
        st = cometi_cuda(moe->err, cudaMalloc(a[i].p, a[i].bytes), what);
        if (st != COMET_SUCCESS) {
            cometi_fp8_train_free(f);
            return st;
        }
    }
    return moe->cfg.fp8_wgrad_cublaslt ? lt_alloc(moe, f->l0.experts_per_group, t) : COMET_SUCCESS;
}

/* The FP8 backward's workspaces, made once per handle by its first FP8 training forward
 * (an inference-only FP8 layer never pays for them): about (5 ffn / tp + 2 hidden) bytes
 * per row of the receive bound (and ffn / tp / 32 for the dot's parts). Collective there,
 * host-blocking once: the ranks agree on the allocation before any row moves, so where
 * one rank cannot make them every rank refuses the call (that rank COMET_OUT_OF_MEMORY,
 * the others COMET_REMOTE_ERROR) and the next training forward tries again, instead of
 * peers waiting for rows that never come. */
static comet_status_t fp8_train_get(comet_moe_t moe, struct cometi_fused *f, cometi_fp8_train_t **out)
{
    if (f->fp8) {
        *out = f->fp8;
        return COMET_SUCCESS;
    }
    const comet_status_t st = cometi_moe_agree(moe, fp8_train_alloc(moe, f), "FP8 training",
                                               "make its FP8 backward workspaces");
    if (st != COMET_SUCCESS) {
        cometi_fp8_train_free(f); /* every rank alike: the next call tries again */
        return st;
    }
    *out = f->fp8;
    return COMET_SUCCESS;
}

comet_status_t cometi_fused_train_supported(comet_moe_t moe, const comet_moe_weights_t *w)
{
    if (moe->fused_unsupported)
        return cometi_fail(moe->err, COMET_NOT_SUPPORTED, "the fused path does not run this config (see "
                           "comet_moe_forward with COMET_IMPL_FUSED)");
    if (!w->gate_up)
        return cometi_fail(moe->err, COMET_NOT_SUPPORTED, "weights.gate and weights.up apart: the fused backward "
                           "reads gate_up, [E_local][2F][H] in one tensor");
    return COMET_SUCCESS;
}

/* The saved rows the layer's buffers hold (dy's rows, the activation, dh's scales:
 * max_recv_rows each); the saved bound cap_rows may be larger. */
static int64_t held_rows(comet_moe_saved_t sv, const cometi_dispatch_gemm_t *l0)
{
    return sv->cap_rows < l0->max_recv_rows ? sv->cap_rows : l0->max_recv_rows;
}

/* The weight gradient of one weight: C_g = A_g^T B_g over each expert's rows. */
static cometi_gemm_t wgrad_gemm(comet_comm_t comm, const cometi_dispatch_gemm_t *l0, const void *a, int m_out,
                                const void *b, int n, int64_t rows, void *c, int fp32)
{
    cometi_gemm_t g;
    memset(&g, 0, sizeof(g));
    g.problem.along = COMETI_GEMM_GROUPS_ALONG_K;
    g.problem.groups = l0->experts_per_group;
    g.problem.n = n;
    g.problem.m_out = m_out;
    g.problem.segs = l0->route.plan.local_segs;
    g.a.ptr = a;
    g.a.rows = rows;
    g.a.major = COMETI_GEMM_MN_MAJOR;
    g.b.ptr = b;
    g.b.major = COMETI_GEMM_MN_MAJOR;
    g.out.epilogue = fp32 ? COMETI_GEMM_EPI_ADD_FP32 : COMETI_GEMM_EPI_STORE;
    g.out.c = c;
    g.out.ldc = n;
    g.err = comm->async_dev;
    g.timeout_ns = (unsigned long long)comm->timeout_ms * 1000000ull;
    return g;
}

/* The same in FP8: A^T [m_out][ld] and B^T [n][ld] E4M3, the tokens contiguous, with
 * their 128 x 1 scales [ld / 128][m_out] and [ld / 128][n]. */
static cometi_gemm_t wgrad_gemm_e4m3(comet_comm_t comm, const cometi_dispatch_gemm_t *l0, const void *at,
                                     const float *at_scales, int m_out, const void *bt, const uint16_t *bt_scales16,
                                     int n, int64_t ld, void *c, int fp32)
{
    cometi_gemm_t g = wgrad_gemm(comm, l0, at, m_out, bt, n, ld, c, fp32);
    g.a.type = g.b.type = COMETI_GEMM_E4M3;
    g.a.major = g.b.major = COMETI_GEMM_K_MAJOR;
    g.a.ld = ld;
    g.a.scale = at_scales, g.a.scale_row = 1, g.a.scale_block = m_out;
    g.b.scale16 = bt_scales16, g.b.scale_row = 1, g.b.scale_block = n;
    return g;
}

/* The backward's GEMMs: s = dy W2 on the received rows, dx rows = dh W13, and the two
 * weight gradients. */
typedef struct backward_gemms {
    cometi_gemm_t dgrad_down, dgrad_gate_up, wgrad_down, wgrad_gate_up;
} backward_gemms_t;

static backward_gemms_t describe_backward(comet_moe_t moe, struct cometi_fused *f, const comet_moe_args_t *a,
                                          const comet_moe_backward_args_t *ba)
{
    comet_comm_t comm = moe->comm;
    const comet_moe_saved_t sv = ba->saved;
    const int H = moe->cfg.hidden, F = moe->ffn_local, fp32 = ba->grads.mode == COMET_GRAD_ACCUMULATE_FP32;
    backward_gemms_t b;
    b.dgrad_down = cometi_dispatch_gemm_gemm(comm, &f->l0, a);
    b.dgrad_down.problem.n = F;
    b.dgrad_down.problem.k = H;
    b.dgrad_down.b.ptr = ba->weights.down; /* [E][H][F]: k = H rows of n = F */
    b.dgrad_down.b.up = NULL;
    b.dgrad_down.b.major = COMETI_GEMM_MN_MAJOR;
    b.dgrad_down.out.epilogue = COMETI_GEMM_EPI_STORE;
    b.dgrad_down.out.c = f->l0.act;
    b.dgrad_down.out.ldc = F;
    b.dgrad_gate_up = cometi_gemm_combine_gemm(comm, &f->l1, &f->l0, a);
    b.dgrad_gate_up.problem.k = 2 * F;
    b.dgrad_gate_up.a.ptr = sv->h; /* dh, once SwiGLU's backward has run */
    b.dgrad_gate_up.a.rows = sv->cap_rows;
    b.dgrad_gate_up.b.ptr = ba->weights.gate_up; /* [E][2F][H]: k = 2F rows of n = H */
    b.dgrad_gate_up.b.major = COMETI_GEMM_MN_MAJOR;
    const int64_t layer_rows = held_rows(sv, &f->l0);
    b.wgrad_down = wgrad_gemm(comm, &f->l0, f->l0.recv.local, H, f->l0.act, F, layer_rows, ba->grads.down, fp32);
    if (f->l0.x_rows) /* x sent again into the layer's rows */
        b.wgrad_gate_up = wgrad_gemm(comm, &f->l0, sv->h, 2 * F, f->l0.x_rows, H, layer_rows, ba->grads.gate_up, fp32);
    else
        b.wgrad_gate_up = wgrad_gemm(comm, &f->l0, sv->h, 2 * F, sv->recv, H, sv->cap_rows, ba->grads.gate_up, fp32);
    return b;
}

/* The same in FP8: the dgrad GEMMs on W^T's E4M3 copies, dy's rows as they arrived (E4M3,
 * scales after each row's values) and dh quantized into the saved [g u]'s bytes (E4M3 [g
 * u]: in its place; bf16: each 128-byte k block in the first half of the 256 bytes it came
 * from); the weight gradients on the cast operands. */
static backward_gemms_t describe_backward_e4m3(comet_moe_t moe, struct cometi_fused *f, const cometi_fp8_train_t *t,
                                               const comet_moe_args_t *a, const comet_moe_backward_args_t *ba)
{
    comet_comm_t comm = moe->comm;
    const int H = moe->cfg.hidden, F = moe->ffn_local, fp32 = ba->grads.mode == COMET_GRAD_ACCUMULATE_FP32;
    const int64_t R = f->l0.max_recv_rows;
    backward_gemms_t b;
    b.dgrad_down = cometi_dispatch_gemm_gemm(comm, &f->l0, a); /* A: the received rows, E4M3 */
    b.dgrad_down.problem.n = F;
    b.dgrad_down.problem.k = H;
    b.dgrad_down.b.ptr = ba->weights_t.down; /* [E][F][H]: n = F rows of k = H */
    b.dgrad_down.b.up = NULL;
    b.dgrad_down.b.scale = ba->weight_t_scales.down;
    b.dgrad_down.b.up_scale = NULL;
    b.dgrad_down.out.epilogue = COMETI_GEMM_EPI_STORE;
    b.dgrad_down.out.c = t->s;
    b.dgrad_down.out.ldc = F;
    b.dgrad_down.out.c_scale = NULL;
    b.dgrad_down.out.c_scale_row = b.dgrad_down.out.c_scale_block = 0;
    b.dgrad_down.out.pow2_scales = 0;
    b.dgrad_gate_up = cometi_gemm_combine_gemm(comm, &f->l1, &f->l0, a);
    b.dgrad_gate_up.problem.k = 2 * F;
    const int gu8 = ba->saved->h_scales != NULL;
    b.dgrad_gate_up.a.ptr = ba->saved->h; /* dh in E4M3, once SwiGLU's backward has run */
    b.dgrad_gate_up.a.rows = held_rows(ba->saved, &f->l0); /* dh_scales' rows: R */
    b.dgrad_gate_up.a.ld = (int64_t)(gu8 ? 2 : 4) * F; /* bytes: a row of [g u] */
    b.dgrad_gate_up.a.kb_stride = gu8 ? 0 : 256;
    b.dgrad_gate_up.a.scale = t->dh_scales;
    b.dgrad_gate_up.a.scale_row = 1, b.dgrad_gate_up.a.scale_block = R;
    b.dgrad_gate_up.b.ptr = ba->weights_t.gate_up; /* [E][H][2F]: n = H rows of k = 2F */
    b.dgrad_gate_up.b.scale = ba->weight_t_scales.gate_up;
    b.wgrad_down = wgrad_gemm_e4m3(comm, &f->l0, t->wg.dy_t, t->wg.dy_t_scales, H, t->wg.wa_t,
                                   t->wg.wa_t_scales16, F, t->wg.ld, ba->grads.down, fp32);
    b.wgrad_gate_up = wgrad_gemm_e4m3(comm, &f->l0, t->wg.dh_t, t->wg.dh_t_scales, 2 * F, t->wg.x_t,
                                      t->wg.x_t_scales16, H, t->wg.ld, ba->grads.gate_up, fp32);
    return b;
}

/* The backward's GEMMs for this layer's format into *g (FP8: its workspaces, made by the
 * training forward that filled the saved state). */
static comet_status_t describe_backward_for(comet_moe_t moe, struct cometi_fused *f, const comet_moe_args_t *a,
                                            const comet_moe_backward_args_t *ba, backward_gemms_t *g)
{
    if (!f->l0.fp8) {
        *g = describe_backward(moe, f, a, ba);
        return COMET_SUCCESS;
    }
    if (!f->fp8) return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "FP8 backward: the layer has no FP8 workspaces");
    *g = describe_backward_e4m3(moe, f, f->fp8, a, ba);
    return COMET_SUCCESS;
}

comet_status_t cometi_fused_forward_train(comet_moe_t moe, const comet_moe_args_t *a, comet_moe_saved_t sv,
                                          cudaStream_t stream)
{
    comet_comm_t comm = moe->comm;
    struct cometi_fused *f;
    COMETI_TRY(cometi_fused_get(moe, &f));
    const int k = moe->cfg.top_k, n = a->num_tokens * k;
    cometi_dispatch_gemm_t *l0 = &f->l0;
    const cometi_route_dev_plan_t *plan = &l0->route.plan;
    cometi_fp8_train_t *t;
    if (l0->fp8) COMETI_TRY(fp8_train_get(moe, f, &t)); /* the backward's, made before anything is enqueued */
    /* GEMM0's epilogue keeps [g u] beside the activation (FP8: beside its E4M3 bytes). */
    cometi_gemm_t core0 = cometi_dispatch_gemm_gemm(comm, l0, a);
    core0.out.epilogue = !l0->fp8      ? COMETI_GEMM_EPI_SWIGLU_GU
                         : sv->h_scales ? COMETI_GEMM_EPI_SWIGLU_E4M3_GU8
                                        : COMETI_GEMM_EPI_SWIGLU_E4M3_GU;
    core0.out.gu = sv->h;
    core0.out.gu_rows = sv->cap_rows;
    core0.out.gu_scale = sv->h_scales;
    /* The route's call id of a training forward: its bound, which every rank must share. */
    const cometi_dispatch_call_t kind = {0, NULL, COMETI_CALL_TRAIN_FORWARD | (unsigned int)(sv->max_recv_rows %
                                                                                             COMETI_CALL_TRAIN_FORWARD)};
    comet_status_t st = cometi_dispatch_gemm_run_core(comm, l0, a, &core0, &kind, &f->k0, stream);
    if (st == COMET_SUCCESS) /* sv->recv NULL where the backward sends x again: the bound's check alone */
        st = cometi_cuda(comm->err, cometi_launch_keep_rows(l0->recv.local, sv->recv, l0->row_bytes, plan->local_segs,
                                                            l0->experts_per_group, sv->cap_rows, sv->max_recv_rows,
                                                            plan->seg_rows, comm->size / moe->tp, comm->async_dev,
                                                            comm->sm_count, stream), "launch keep_rows_kernel");
    if (st == COMET_SUCCESS) st = cometi_gemm_combine_run(comm, &f->l1, l0, a, &f->k1, stream);
    if (st == COMET_SUCCESS)
        st = cometi_cuda(comm->err, cometi_launch_keep_send_pos(a->topk_ids, plan->pos,
                                                                plan->send_offset + (size_t)comm->rank *
                                                                                        moe->cfg.num_experts,
                                                                n, moe->cfg.num_experts, sv->send_pos, stream),
                         "launch keep_send_pos_kernel");
    if (st == COMET_SUCCESS && n > 0)
        st = cometi_cuda(comm->err, cudaMemcpyAsync(sv->ids, a->topk_ids, (size_t)n * 4, cudaMemcpyDeviceToDevice,
                                                    stream), "keep topk_ids");
    if (st == COMET_SUCCESS && n > 0)
        st = cometi_cuda(comm->err, cudaMemcpyAsync(sv->weights, a->topk_weights, (size_t)n * 4,
                                                    cudaMemcpyDeviceToDevice, stream), "keep topk_weights");
    if (st != COMET_SUCCESS) {
        snprintf(moe->err, COMETI_ERR_LEN, "%.500s", comm->err);
        return st;
    }
    sv->num_tokens = a->num_tokens;
    sv->path = COMETI_SAVED_FUSED;
    sv->filled = 1;
    return COMET_SUCCESS;
}

/* The operators' arguments for the backward: rows are dy's, per token as x's were, the
 * route is the forward's ids with weights of 1, and the combine's y is dx. */
static comet_moe_args_t backward_args(const struct cometi_fused *f, const comet_moe_backward_args_t *ba)
{
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = ba->saved->num_tokens;
    a.x = ba->dy;
    a.topk_ids = ba->saved->ids;
    a.topk_weights = f->ones;
    a.y = ba->dx;
    a.weights = ba->weights;
    a.impl = COMET_IMPL_FUSED;
    return a;
}

/* config.fp8_wgrad_cublaslt: the route's segments to the host, for cuBLASLt's per-expert
 * GEMMs (lt_weight_grads waits for them). */
static comet_status_t copy_segments(char *err, const cometi_fp8_train_t *t, const cometi_segment_t *segs, int per,
                                    cudaStream_t stream)
{
    COMETI_TRY(cometi_cuda(err, cudaMemcpyAsync(t->segs_host, segs, sizeof(cometi_segment_t) * per,
                                                cudaMemcpyDeviceToHost, stream),
                           "copy the experts' segments to the host"));
    return cometi_cuda(err, cudaEventRecord(t->segs_copied, stream), "record the segments' copy");
}

/* The weight gradients as cuBLASLt's 1 x 128 by 1 x 128 GEMM per expert on the same E4M3
 * operands (the sequential path's), once the copy above has landed: the host waits here,
 * while the GPU runs what was enqueued before. */
static comet_status_t lt_weight_grads(char *err, cometi_fp8_train_t *t, int per, int H, int F,
                                      const comet_moe_weight_grads_t *grads, cudaStream_t stream)
{
    COMETI_TRY(cometi_cuda(err, cudaEventSynchronize(t->segs_copied), "wait for the experts' segments"));
    return cometi_blaslt_fp8_weight_grads(err, t->lt, per, t->segs_host, &t->wg, H, F, grads, stream);
}

/* FP8, between the dgrad GEMM of W2 and that of W13: SwiGLU's backward straight into its
 * FP8 outputs in one kernel ((w a)^T and dh^T along the tokens, dh's rows in the saved
 * [g u]'s bytes, and <s, a>), then dy and x cast along the tokens from their E4M3 rows.
 * Rows past R are in no segment. */
static comet_status_t backward_fp8_operands(comet_moe_t moe, struct cometi_fused *f, const cometi_fp8_train_t *t,
                                            const comet_moe_saved_t sv, cudaStream_t stream)
{
    comet_comm_t comm = moe->comm;
    const cometi_dispatch_gemm_t *l0 = &f->l0;
    const int H = moe->cfg.hidden, F = moe->ffn_local, per = l0->experts_per_group, pow2 = l0->pow2_scales;
    const int b_rule = cometi_wgrad_b_scale_rule(pow2);
    const int64_t R = l0->max_recv_rows, rows = held_rows(sv, l0), rb = l0->row_bytes;
    const cometi_segment_t *segs = l0->route.plan.local_segs;
    COMETI_TRY(cometi_cuda(comm->err, cometi_launch_swiglu_backward_e4m3_in_place(
                                          sv->h, sv->h_scales, sv->cap_rows, t->s, F, segs, per, (int)rows, rows,
                                          f->w_rows, f->dw_rows, t->dot_parts, t->dh_scales, R, t->wg.wa_t,
                                          t->wg.wa_t_scales, t->wg.dh_t, t->wg.dh_t_scales, t->wg.ld, b_rule, stream),
                           "launch SwiGLU's FP8 backward"));
    /* dy's rows as the dispatch delivered them, x's as the forward kept them: E4M3, each
     * row's scales after its hidden bytes. x^T is a weight gradient's B operand. */
    const struct { const void *rows; int64_t n; void *qt; float *scales; int rule; const char *what; } e4m3_rows[2] = {
        {l0->recv.local, R, t->wg.dy_t, t->wg.dy_t_scales, pow2, "cast dy^T to FP8 along the tokens"},
        {sv->recv, rows, t->wg.x_t, t->wg.x_t_scales, b_rule, "cast x^T to FP8 along the tokens"},
    };
    for (int i = 0; i < 2; i++)
        COMETI_TRY(cometi_cuda(comm->err, cometi_requantize_segments_t_e4m3(
                                              e4m3_rows[i].rows, rb,
                                              (const float *)((const char *)e4m3_rows[i].rows + H), rb / 4, 1, H,
                                              e4m3_rows[i].n, segs, per, e4m3_rows[i].qt, t->wg.ld, e4m3_rows[i].scales,
                                              1, H, e4m3_rows[i].rule, stream),
                               e4m3_rows[i].what));
    COMETI_TRY(cometi_wgrad_b_scales16(comm->err, &t->wg, H, F, stream));
    return t->lt ? copy_segments(comm->err, t, segs, per, stream) : COMET_SUCCESS;
}

/* The weight gradients, put beside the combine of the dgrad GEMM of W13 (between it and
 * the sum at home, with the push): they need no communication. */
typedef struct weight_grads {
    char *err;
    const cometi_gemm_t *down, *gate_up;
    cometi_fp8_train_t *lt_fp8; /* config.fp8_wgrad_cublaslt: cuBLASLt's instead (the rest below) */
    int per, H, F;
    const comet_moe_weight_grads_t *grads;
} weight_grads_t;

static comet_status_t run_weight_grads(void *ctx, cudaStream_t stream)
{
    const weight_grads_t *w = (const weight_grads_t *)ctx;
    if (w->lt_fp8) return lt_weight_grads(w->err, w->lt_fp8, w->per, w->H, w->F, w->grads, stream);
    COMETI_TRY(cometi_gemm_run(w->err, w->down, stream));
    return cometi_gemm_run(w->err, w->gate_up, stream);
}

/* config.fp8_wgrad_cublaslt's refusal, before anything is enqueued: the host cannot wait
 * for the counts inside a capture. (cuBLASLt's shape limits, m and n multiples of 8, hold
 * for every FP8 training config: hidden is a multiple of 64, ffn / tp of 128.) */
static comet_status_t lt_check(comet_moe_t moe, cudaStream_t stream)
{
    enum cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    COMETI_TRY(cometi_cuda(moe->err, cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing"));
    if (capturing != cudaStreamCaptureStatusNone)
        return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "backward under CUDA-graph capture with config."
                           "fp8_wgrad_cublaslt = 1: cuBLASLt's weight gradients take each expert's rows on the host, "
                           "which a captured graph cannot read; capture a layer made with 0");
    return COMET_SUCCESS;
}

comet_status_t cometi_fused_backward(comet_moe_t moe, const comet_moe_backward_args_t *ba, cudaStream_t stream)
{
    comet_comm_t comm = moe->comm;
    struct cometi_fused *f;
    COMETI_TRY(cometi_fused_get(moe, &f));
    const comet_moe_saved_t sv = ba->saved;
    const int k = moe->cfg.top_k, H = moe->cfg.hidden, F = moe->ffn_local, per = f->l0.experts_per_group;
    const comet_moe_args_t a = backward_args(f, ba);
    const int fp8 = f->l0.fp8;
    cometi_fp8_train_t *t = f->fp8;
    backward_gemms_t g;
    COMETI_TRY(describe_backward_for(moe, f, &a, ba, &g));
    /* Checked before anything is enqueued: once the route has run, peers count on this
     * rank's rows. */
    cometi_gemm_prepared_t check;
    const cometi_gemm_t *later[3] = {&g.dgrad_gate_up, &g.wgrad_down, &g.wgrad_gate_up};
    for (int i = 0; i < 3; i++) COMETI_TRY(cometi_gemm_prepare(moe->err, later[i], &check));
    cometi_fp8_train_t *lt = fp8 && t->lt ? t : NULL;
    if (lt) COMETI_TRY(lt_check(moe, stream));
    cometi_dispatch_knobs_t k0 = f->k0;
    k0.first_wave = -1;
    sv->filled = 0; /* consumed, whatever happens next */
    const int n = sv->num_tokens * k;
    cometi_weight_windows_t win;
    memset(&win, 0, sizeof(win));
    for (int r = 0; r < comm->size; r++) win.peer[r] = f->weights.peer[r];
    win.grads_at = (int64_t)moe->cfg.max_tokens * k;
    /* 1. Read by the experts' ranks once this rank's rows have come (the dispatch's release). */
    COMETI_TRY(cometi_cuda(moe->err, cometi_launch_weights_to_send_order(sv->weights, sv->send_pos, n,
                                                                         (float *)f->weights.local, stream),
                           "launch weights_to_send_order_kernel"));
    /* 2. */
    const cometi_dispatch_call_t kind = {1, f->l0.x_rows ? ba->x : NULL, sv->call};
    comet_status_t st = cometi_dispatch_gemm_run_core(comm, &f->l0, &a, &g.dgrad_down, &kind, &k0, stream);
    /* 3. */
    const cometi_segment_t *segs = f->l0.route.plan.local_segs;
    if (st == COMET_SUCCESS) st = cometi_gemm_combine_row_homes(comm, &f->l1, &f->l0, &a, stream);
    if (st == COMET_SUCCESS)
        st = cometi_cuda(comm->err, cometi_launch_pull_weights(&win, f->l1.push_dest, segs, per, sv->cap_rows, moe->tp,
                                                               f->w_rows, comm->sm_count, stream),
                         "launch pull_weights_kernel");
    if (st == COMET_SUCCESS && fp8)
        st = backward_fp8_operands(moe, f, t, sv, stream);
    else if (st == COMET_SUCCESS)
        st = cometi_cuda(comm->err, cometi_launch_swiglu_backward(sv->h, f->l0.act, sv->h, F, segs, per,
                                                                  (int)sv->cap_rows, sv->cap_rows, f->w_rows,
                                                                  f->dw_rows, stream),
                         "launch swiglu_backward_kernel");
    if (st == COMET_SUCCESS)
        st = cometi_cuda(comm->err, cometi_launch_send_weight_grads(&win, f->l1.push_dest, segs, per, sv->cap_rows,
                                                                    f->dw_rows, comm->sm_count, stream),
                         "launch send_weight_grads_kernel");
    cometi_padded_rows_t pad = {{sv->h, f->l0.act, f->l0.recv.local, f->l0.x_rows},
                                {2 * F * BF16, F * BF16, H * BF16, H * BF16}};
    if (st == COMET_SUCCESS && !fp8) /* FP8: the casts write zeros past each segment's end */
        st = cometi_cuda(comm->err, cometi_launch_zero_padding(&pad, segs, per, sv->cap_rows, comm->sm_count, stream),
                         "launch zero_padding_kernel");
    /* 4 and 5. */
    weight_grads_t wg = {comm->err, &g.wgrad_down, &g.wgrad_gate_up, lt, per, H, F, &ba->grads};
    const cometi_combine_between_t between = {run_weight_grads, &wg};
    if (st == COMET_SUCCESS)
        st = cometi_gemm_combine_run_core(comm, &f->l1, &f->l0, &a, &g.dgrad_gate_up, &f->k1, &between, stream);
    if (st == COMET_SUCCESS)
        st = cometi_cuda(comm->err, cometi_launch_gather_weight_grads((const float *)f->weights.local + win.grads_at,
                                                                      moe->tp, 1, moe->tp, sv->send_pos, n,
                                                                      ba->d_topk_weights, stream),
                         "launch gather_weight_grads_kernel");
    if (st != COMET_SUCCESS) snprintf(moe->err, COMETI_ERR_LEN, "%.500s", comm->err);
    return st;
}

comet_status_t cometi_moe_backward_gemms(comet_moe_t moe, const comet_moe_backward_args_t *ba, int mask,
                                         cudaStream_t stream)
{
    if (!moe || !ba || !ba->saved || ba->saved->moe != moe || ba->saved->path != COMETI_SAVED_FUSED || !moe->fused)
        return moe ? cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "backward GEMMs alone: need a saved state of this "
                                 "layer filled by a fused training forward") : COMET_INVALID_ARGUMENT;
    struct cometi_fused *f = moe->fused;
    const comet_moe_args_t a = backward_args(f, ba);
    backward_gemms_t g;
    COMETI_TRY(describe_backward_for(moe, f, &a, ba, &g));
    /* Alone: every SM, no roles, on the segments of the layer's last route. */
    g.dgrad_down.problem.local_rows = NULL;
    g.dgrad_down.launch.tail_ws = NULL;
    g.dgrad_gate_up.launch.tail_ws = NULL;
    const cometi_gemm_t *all[4] = {&g.dgrad_down, &g.dgrad_gate_up, &g.wgrad_down, &g.wgrad_gate_up};
    cometi_fp8_train_t *t = f->l0.fp8 ? f->fp8 : NULL;
    for (int i = 0; i < 4; i++) {
        if (mask && !(mask & (1 << i))) continue;
        if (i >= 2 && t && t->lt) { /* cuBLASLt's, one weight at a time */
            COMETI_TRY(copy_segments(moe->err, t, f->l0.route.plan.local_segs, f->l0.experts_per_group, stream));
            comet_moe_weight_grads_t one = ba->grads;
            *(i == 2 ? &one.gate_up : &one.down) = NULL;
            COMETI_TRY(lt_weight_grads(moe->err, t, f->l0.experts_per_group, moe->cfg.hidden, moe->ffn_local, &one,
                                       stream));
            continue;
        }
        COMETI_TRY(cometi_gemm_run(moe->err, all[i], stream));
    }
    return COMET_SUCCESS;
}
