/*
 * backward.c - the sequential path's backward, step after step as Megatron-LM runs an
 * unfused expert-parallel layer, over the routing its training forward saved:
 *   0. where the config resends x, x's rows again: permuted and sent as in the forward;
 *   1. each choice's dy row to where its x row went, and its routing weight beside it;
 *   2. the dispatch's all-to-all, the same messages as the forward's, for both;
 *   3. per local expert: s = dy W2 (cuBLAS); SwiGLU's backward with d topk_weights' part
 *      <s, a> (dh = [dg du] of da = w s, and w a); the weight gradients dW2 = dy^T (w a),
 *      dW13 = dh^T x (cuBLAS, K the expert's rows), and dx rows = dh W13;
 *   4. the return all-to-all of dx rows and of <s, a>, each token's dx summed over its
 *      choices (and TP ranks' partials) in a fixed order, and d topk_weights over the TP
 *      partials: the fused path's arithmetic, so the two give the same bits.
 * The forward's buffers are the workspaces: send (x or dy rows), recv (dy received), act
 * (s, then w a), h (dh), out (x rows received again, then dx rows), back (dx rows home).
 * In block-scaled FP8, steps 0-3 are backward_fp8.c's (act holds s, then dh in E4M3; its
 * own workspaces the operands along the tokens); step 4 is the same.
 */
#include <stdio.h>
#include <string.h>

#include <cublas_v2.h>

#include "baseline/baseline.h"
#include "baseline/rows.h"
#include "comm/route.h"
#include "layer/layer.h"
#include "pointwise/pointwise.h"

#define BF16 2

static comet_status_t cublas_ok(char *err, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return COMET_SUCCESS;
    return cometi_fail(err, s == CUBLAS_STATUS_ALLOC_FAILED ? COMET_OUT_OF_MEMORY : COMET_CUDA_ERROR, "%s: %s", what,
                       cublasGetStatusString(s));
}

/* Row-major C[m][n] (ldc) = op(A) op(B) + beta C with bf16 A and B, fp32 accumulation,
 * C bf16 or fp32. trans_a: A is stored [k][m] (lda) and used transposed; else [m][k].
 * B is stored [k][n] (ldb). In cuBLAS's column-major terms C^T = B^T op(A)^T. */
static comet_status_t gemm(cublasHandle_t h, char *err, int m, int n, int k, const void *a, int lda, int trans_a,
                           const void *b, int ldb, void *c, int ldc, int c_fp32, float beta, const char *what)
{
    const float one = 1.0f;
    return cublas_ok(err, cublasGemmEx(h, CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &one, b,
                                       CUDA_R_16BF, ldb, a, CUDA_R_16BF, lda, &beta, c,
                                       c_fp32 ? CUDA_R_32F : CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT),
                     what);
}

/* One expert's weight gradient of `rows` rows: written (bf16) or added (fp32), or, with
 * no rows, zeros written (nothing added). C[m][n] = A^T B, A [rows][m], B [rows][n]. */
static comet_status_t weight_grad(cometi_baseline_t *b, char *err, int m, int n, int rows, const void *a, int lda,
                                  const void *bm, int ldb, void *c, int fp32, cudaStream_t stream, const char *what)
{
    if (rows == 0)
        return fp32 ? COMET_SUCCESS
                    : cometi_cuda(err, cudaMemsetAsync(c, 0, (size_t)m * n * BF16, stream), "zero a weight gradient");
    return gemm(b->cublas, err, m, n, rows, a, lda, 1, bm, ldb, c, n, fp32, fp32 ? 1.0f : 0.0f, what);
}

/* The dispatch's all-to-all as the forward's messages: send (in send order) -> recv
 * (each expert's segment), rows of H bf16 and, with w_send, each row's weight beside it
 * (w_send -> w_recv, one float a row). */
static comet_status_t dispatch_rows(comet_moe_t moe, const comet_moe_saved_t sv, const void *send, void *recv,
                                    const float *w_send, float *w_recv, cudaStream_t stream, const char *what)
{
    const cometi_row_part_t parts[2] = {{send, recv, (size_t)moe->cfg.hidden, BF16, ncclBfloat16},
                                        {w_send, w_recv, 1, 4, ncclFloat32}};
    return cometi_baseline_dispatch(moe, sv->sends, sv->n_sends, sv->recvs, sv->n_recvs, parts, w_send ? 2 : 1,
                                    stream, what);
}

/* 3 of the backward: at the experts, s = dy W2, SwiGLU's backward, the weight gradients
 * and the dx rows (into b->out), each expert's rows by cuBLAS. */
static comet_status_t backward_experts(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_backward_args_t *args,
                                       const void *x_rows, cudaStream_t stream)
{
    char *err = moe->err;
    const comet_moe_saved_t sv = args->saved;
    const int H = moe->cfg.hidden, F = moe->ffn_local, per = moe->experts_per_rank;
    const int fp32 = args->grads.mode == COMET_GRAD_ACCUMULATE_FP32;
    const size_t gsize = fp32 ? 4 : BF16;
    COMETI_TRY(cometi_baseline_injected_failure(moe, b));
    const comet_moe_weights_t *w = &args->weights;
    const comet_moe_weight_grads_t *gr = &args->grads;
    for (int le = 0; le < per; le++) { /* s = dy W2 */
        const int rows = sv->segs_host[le].rows, start = sv->segs_host[le].start;
        if (!rows) continue;
        COMETI_TRY(gemm(b->cublas, err, rows, F, H, (const char *)b->recv + (size_t)start * H * BF16, H, 0,
                        (const char *)w->down + (size_t)le * H * F * BF16, F, (char *)b->act + (size_t)start * F * BF16,
                        F, 0, 0.0f, "cublasGemmEx(s = dy W2)"));
    }
    COMETI_TRY(cometi_cuda(err, cometi_launch_swiglu_backward(sv->h, b->act, b->h, F, sv->segs, per, sv->max_seg_rows,
                                                              sv->cap_rows, b->w_recv, b->dw_recv, stream),
                           "launch swiglu_backward_kernel"));
    for (int le = 0; le < per; le++) {
        const int rows = sv->segs_host[le].rows, start = sv->segs_host[le].start;
        const char *dh = (const char *)b->h + (size_t)start * 2 * F * BF16;
        const char *dyr = (const char *)b->recv + (size_t)start * H * BF16;
        const char *act = (const char *)b->act + (size_t)start * F * BF16;
        const char *x = (const char *)x_rows + (size_t)start * H * BF16;
        char *dxr = (char *)b->out + (size_t)start * H * BF16;
        /* dW2 [H][F] = dy^T (w a); dW13 [2F][H] = dh^T x. */
        COMETI_TRY(weight_grad(b, err, H, F, rows, dyr, H, act, F, (char *)gr->down + (size_t)le * H * F * gsize, fp32,
                               stream, "cublasGemmEx(dW2 = dy^T (w a))"));
        if (gr->gate_up) {
            COMETI_TRY(weight_grad(b, err, 2 * F, H, rows, dh, 2 * F, x, H,
                                   (char *)gr->gate_up + (size_t)le * 2 * F * H * gsize, fp32, stream,
                                   "cublasGemmEx(dW13 = dh^T x)"));
        } else {
            COMETI_TRY(weight_grad(b, err, F, H, rows, dh, 2 * F, x, H, (char *)gr->gate + (size_t)le * F * H * gsize,
                                   fp32, stream, "cublasGemmEx(dWgate = dg^T x)"));
            COMETI_TRY(weight_grad(b, err, F, H, rows, dh + (size_t)F * BF16, 2 * F, x, H,
                                   (char *)gr->up + (size_t)le * F * H * gsize, fp32, stream,
                                   "cublasGemmEx(dWup = du^T x)"));
        }
        if (rows) { /* dx rows = dg Wgate + du Wup */
            if (w->gate_up) {
                COMETI_TRY(gemm(b->cublas, err, rows, H, 2 * F, dh, 2 * F, 0,
                                (const char *)w->gate_up + (size_t)le * 2 * F * H * BF16, H, dxr, H, 0, 0.0f,
                                "cublasGemmEx(dx = dh W13)"));
            } else {
                COMETI_TRY(gemm(b->cublas, err, rows, H, F, dh, 2 * F, 0,
                                (const char *)w->gate + (size_t)le * F * H * BF16, H, dxr, H, 0, 0.0f,
                                "cublasGemmEx(dx = dg Wgate)"));
                COMETI_TRY(gemm(b->cublas, err, rows, H, F, dh + (size_t)F * BF16, 2 * F, 0,
                                (const char *)w->up + (size_t)le * F * H * BF16, H, dxr, H, 0, 1.0f,
                                "cublasGemmEx(dx += du Wup)"));
            }
        }
    }

    return COMET_SUCCESS;
}

comet_status_t cometi_baseline_backward(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_backward_args_t *args,
                                        cudaStream_t stream)
{
    char *err = moe->err;
    const comet_moe_saved_t sv = args->saved;
    const int k = moe->cfg.top_k, H = moe->cfg.hidden;
    const int m = sv->num_tokens, n = m * k, tp = moe->tp;
    const size_t stride = (size_t)moe->cfg.max_tokens * k * H; /* elements between TP ranks' returned copies */
    ncclComm_t nccl = moe->comm->nccl;
    if (b->cublas) COMETI_TRY(cublas_ok(err, cublasSetStream(b->cublas, stream), "cublasSetStream"));
    /* The count exchange with no counts, only the call id: ranks in the backward of another
     * forward (or in a forward) refuse with this rank, before anything is sent, and the
     * saved state stays filled. */
    const int E = moe->cfg.num_experts;
    COMETI_TRY(cometi_cuda(err, cudaMemsetAsync(b->counts, 0, sizeof(int32_t) * E, stream), "clear the counts"));
    COMETI_TRY(cometi_cuda(err, cudaMemsetAsync(b->counts + E, 0xff, sizeof(int32_t), stream), "no bad id"));
    COMETI_TRY(cometi_baseline_exchange(moe, b, sv->call, stream));
    sv->filled = 0; /* consumed from here on, as the fused path's is */

    comet_status_t experts;
    if (moe->cfg.dtype == COMET_DTYPE_FP8_BLOCK) {
        COMETI_TRY(cometi_baseline_fp8_send(moe, b, args, stream));
        experts = cometi_baseline_fp8_experts(moe, b, args, stream);
    } else {
        /* 0. Where the config resends x: its rows again, into the dx rows' buffer, which
         * holds them until each expert's dW13 has read them (dx rows are written after). */
        const void *x_rows = sv->recv;
        if (!x_rows) {
            COMETI_TRY(cometi_cuda(err, cometi_launch_permute(args->x, NULL, NULL, NULL, n, k, H, b->send,
                                                              sv->send_pos, stream), "launch permute_kernel (x again)"));
            COMETI_TRY(dispatch_rows(moe, sv, b->send, b->out, NULL, NULL, stream, "backward all-to-all of x again"));
            x_rows = b->out;
        }
        /* 1. dy rows to their send places, the weights beside them. */
        COMETI_TRY(cometi_cuda(err, cometi_launch_permute(args->dy, NULL, NULL, NULL, n, k, H, b->send, sv->send_pos,
                                                          stream), "launch permute_kernel (dy)"));
        COMETI_TRY(cometi_cuda(err, cometi_launch_weights_to_send_order(sv->weights, sv->send_pos, n, b->w_send,
                                                                        stream),
                               "launch weights_to_send_order_kernel"));
        /* 2. Dispatch, as the forward's. */
        COMETI_TRY(dispatch_rows(moe, sv, b->send, b->recv, b->w_send, b->w_recv, stream,
                                 "backward dispatch all-to-all"));
        /* 3. The experts; a failure still takes part in step 4, with poisoned rows. */
        experts = backward_experts(moe, b, args, x_rows, stream);
    }
    char kept[COMETI_ERR_LEN];
    if (experts != COMET_SUCCESS) {
        void *const bufs[2] = {b->out, b->dw_recv};
        const size_t bytes[2] = {(size_t)moe->max_recv_rows * H * BF16, sizeof(float) * (size_t)moe->max_recv_rows};
        cometi_baseline_poison_returned(moe, bufs, bytes, 2, kept, stream);
    }

    /* 4. Home, each token's choices summed (and the TP ranks' partials), and d topk_weights. */
    const size_t choices = (size_t)moe->cfg.max_tokens * k;
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < sv->n_recvs && r == ncclSuccess; i++) {
        r = ncclSend((char *)b->out + sv->recvs[i].offset * H * BF16, (size_t)sv->recvs[i].rows * H, ncclBfloat16,
                     sv->recvs[i].peer, nccl, stream);
        if (r == ncclSuccess)
            r = ncclSend(b->dw_recv + sv->recvs[i].offset, (size_t)sv->recvs[i].rows, ncclFloat32, sv->recvs[i].peer,
                         nccl, stream);
    }
    for (int i = 0; i < sv->n_sends && r == ncclSuccess; i++) {
        const int c = sv->sends[i].peer % tp;
        r = ncclRecv((char *)b->back + ((size_t)c * stride + (size_t)sv->sends[i].offset * H) * BF16,
                     (size_t)sv->sends[i].rows * H, ncclBfloat16, sv->sends[i].peer, nccl, stream);
        if (r == ncclSuccess)
            r = ncclRecv(b->dw_back + (size_t)c * choices + sv->sends[i].offset, (size_t)sv->sends[i].rows,
                         ncclFloat32, sv->sends[i].peer, nccl, stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (experts != COMET_SUCCESS) return cometi_baseline_failed_after_return(moe, experts, kept);
    COMETI_TRY(cometi_nccl(err, r != ncclSuccess ? r : end, "backward combine all-to-all"));
    COMETI_TRY(cometi_cuda(err, cometi_launch_gather_weight_grads(b->dw_back, tp, choices, 1, sv->send_pos, n,
                                                                  args->d_topk_weights, stream),
                           "launch gather_weight_grads_kernel"));
    return cometi_cuda(err, cometi_launch_combine(b->back, tp, stride, sv->send_pos, NULL, m, k, H, args->dx, stream),
                       "launch combine_kernel (dx)");
}
