/*
 * baseline.h - the sequential baseline: route, NCCL all-to-all, cuBLAS expert GEMMs,
 * SwiGLU, cuBLAS down projection, NCCL all-to-all back, weighted top-k sum; each step
 * after the last, as Megatron-LM runs an expert-parallel MoE layer. It is the yardstick
 * every comet speedup is measured against, in the same binary and the same run.
 */
#ifndef COMET_BASELINE_H
#define COMET_BASELINE_H

#include <stdint.h>
#include <cublas_v2.h>
#include <nccl.h>
#include "base/host.h"
#include "baseline/blaslt_fp8.h"
#include "baseline/rows.h"
#include "comm/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Events between phases, recorded when the caller asks (benchmarks). */
enum {
    COMETI_MARK_START,
    COMETI_MARK_ROUTED,     /* counts exchanged, plan made, rows permuted */
    COMETI_MARK_DISPATCHED, /* all-to-all of rows done */
    COMETI_MARK_ACTIVATED,  /* GEMM0 + SwiGLU done (the end of what layer0 replaces) */
    COMETI_MARK_COMPUTED,   /* GEMM1 done */
    COMETI_MARK_RETURNED,   /* all-to-all back done */
    COMETI_MARK_END,        /* weighted top-k sum done */
    COMETI_NUM_MARKS
};

/* The sequential FP8 backward's own workspaces (backward_fp8.c), made by the first FP8
 * training forward on this path (an inference-only layer never pays for them). With
 * R = max_recv_rows, ld = R rounded up to 128, F = ffn / tp, L2 = 2F / 128: */
typedef struct cometi_baseline_fp8_train {
    float *dh_scales;     /* [L2][R]: dh's 1 x 128 scales, as SwiGLU's FP8 backward writes them */
    float *dh_packed;     /* [R x L2] at most: the same packed by group (blaslt_fp8.h) */
    cometi_fp8_wgrad_operands_t wg; /* the weight gradients' operands (blaslt_fp8.h) */
    float *wt_down_scales;    /* [E_local][F / 128][L4(H)]: down^T's scales padded for cuBLASLt */
    float *wt_gate_up_scales; /* [E_local][ceil(H / 128)][L4(2F)]: gate_up^T's */
} cometi_baseline_fp8_train_t;

/* The sequential path's buffers; the forward's receive, GEMM0, act, GEMM1 and return
 * buffers are the backward's workspaces too (dy rows, s and act, dh, dx rows, dx rows home).
 * A config of one dtype gets the buffers of that dtype alone: bf16 the cuBLAS handle and
 * the bf16 send and receive rows; block-scaled FP8 the cuBLASLt handle and the E4M3 rows
 * and scales below, NULL in a bf16 config (and fp8_train, made by the first FP8 training
 * forward). */
typedef struct cometi_baseline {
    cublasHandle_t cublas;
    cometi_blaslt_fp8_t *lt;
    /* device */
    int32_t *counts;      /* [E + 2] this rank's message of the count exchange (exchange_counts):
                           * rows per expert, its first bad id index (or -1), its call id */
    int32_t *counts_all;  /* [world][E + 2] */
    int32_t *pos;         /* [max_tokens * k] rank of (t, j) among this rank's rows of its expert */
    int32_t *route_scratch; /* the route's per-chunk counts */
    int32_t *send_pos;    /* [max_tokens * k] row of (t, j) in the send (and returned) buffer */
    int32_t *send_base;   /* [E] first send row of each expert's chunk */
    cometi_segment_t *segs; /* [E_local] */
    void *send, *recv, *h, *act, *out;
    void *back;           /* [tp][max_tokens * k][hidden]: the rows returned by each TP rank */
    float *w_send;        /* [max_tokens * k] the backward's routing weights in the send order */
    float *w_recv, *dw_recv; /* [max_recv_rows] each received row's weight, and its gradient's part */
    float *dw_back;       /* [tp][max_tokens * k] those parts home, in the send order */
    /* Block-scaled FP8, L0 = ceil(H / 128), L1 = ceil(F / 128) (F = ffn / tp). A row travels as
     * H E4M3 bytes and its L0 FP32 scales, in two NCCL messages per chunk: the values land as
     * the contiguous rows cuBLASLt reads, the scales beside them in the same row order. */
    void *xq;             /* [max_tokens][H] E4M3: x quantized, where it comes in bf16 */
    float *xs;            /* [max_tokens][L0] its scales (DeepEP's layout) */
    void *send_q;         /* [max_tokens * k][H] E4M3 rows in the send order */
    float *send_s;        /* [max_tokens * k][L0] their scales */
    void *recv_q;         /* [max_recv_rows][H] E4M3 rows received, the plan's padded layout */
    float *recv_s;        /* [max_recv_rows][L0] their scales, row for row */
    float *a0_scales;     /* GEMM0's A scales packed by group (blaslt_fp8.h): [L0][padded] each */
    void *act_q;          /* [max_recv_rows][F] E4M3: the SwiGLU output quantized */
    float *a1_scales;     /* GEMM1's A scales packed by group: [L1][padded] each */
    float *w0_scales;     /* [E_local][2 ceil(F / 128)][L4(H)]: gate_up's (or gate's, then up's)
                           * scales with rows padded to 4 (cuBLASLt's), when L0 % 4 != 0 */
    float *w1_scales;     /* [E_local][ceil(H / 128)][L4(F)]: down's, when L1 % 4 != 0 */
    cometi_fp8_group_t *groups; /* [E_local] device: the local experts as the FP8 GEMMs read them */
    cometi_fp8_group_t *groups_host; /* [E_local] pinned */
    int64_t *lt_start, *lt_rows; /* [E_local] host: the groups' first rows and rows, blaslt's arrays */
    cometi_a2a_msg_t *sends, *recvs; /* the dispatch's NCCL messages (host) */
    /* pinned host */
    int32_t *counts_host; /* [world][E + 2] */
    int32_t *send_base_host;
    cometi_segment_t *segs_host;
    int max_seg_rows;     /* the last call's largest local segment */
    cometi_baseline_fp8_train_t *fp8_train; /* FP8 training's workspaces, or NULL */
    /* Where the last forward put its received rows (FP8: their values, and their scales in
     * io_recv_s), GEMM0 output and send positions: the buffers above, or a training
     * forward's saved state. keep_h: an FP8 training forward whose saved state holds [g u]
     * in E4M3 (GEMM0 writes h, and each row is quantized from there), else NULL. */
    void *io_recv, *io_h;
    float *io_recv_s;
    int32_t *io_send_pos;
    void *keep_h;
    float *keep_h_scales;
    int64_t keep_h_ld;
    int fail_experts;     /* tests: the next expert phase fails (as a cuBLAS call with no algorithm
                           * for its shape would), once */
} cometi_baseline_t;

comet_status_t cometi_baseline_create(comet_moe_t moe, cometi_baseline_t **out);
void cometi_baseline_destroy(cometi_baseline_t *b);
/* The baseline's receive buffer and SwiGLU output (tests compare the fused path with them);
 * with FP8 the received E4M3 rows and the bf16 SwiGLU output before its quantization. */
void cometi_baseline_buffers(const cometi_baseline_t *b, const void **recv, const void **act);
/* The forward; with `saved` (a training forward) the rows the backward needs go into it
 * (its bound checked on every rank before any row moves) and it is marked filled. With
 * config.dtype COMET_DTYPE_FP8_BLOCK it runs in block-scaled FP8: x quantized once per
 * token where it comes in bf16, E4M3 rows and their scales sent, cuBLASLt's block-scaled
 * GEMMs, the activation quantized per row; a training forward keeps the E4M3 rows and
 * their scales as they arrived (values [cap_rows][H], then scales [cap_rows][ceil(H / 128)],
 * in saved->recv's bytes) and [g u] in bf16 or, as the saved state asks, in E4M3. */
comet_status_t cometi_baseline_forward(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       comet_moe_saved_t saved, cudaStream_t stream);
/* One part of every row a dispatch moves: the rows' `per_row` elements of `type` (`elem`
 * bytes each) at send, in the send order, and at recv, in each expert's segment. */
typedef struct cometi_row_part {
    const void *send;
    void *recv;
    size_t per_row, elem;
    ncclDataType_t type;
} cometi_row_part_t;
/* One all-to-all of rows (baseline.c): for each chunk of `sends` and of `recvs`, a message
 * per part, in the parts' order on both sides (NCCL matches a pair's messages in order),
 * in one NCCL group; a failure names `what`. */
comet_status_t cometi_baseline_dispatch(comet_moe_t moe, const cometi_a2a_msg_t *sends, int n_sends,
                                        const cometi_a2a_msg_t *recvs, int n_recvs, const cometi_row_part_t *parts,
                                        int nparts, cudaStream_t stream, const char *what);
/* The count exchange every call of the path makes first (baseline.c); a backward's
 * message carries no counts, only its call id. */
comet_status_t cometi_baseline_exchange(comet_moe_t moe, cometi_baseline_t *b, unsigned int call, cudaStream_t stream);
/* The backward of the training forward that filled args->saved (checked by the caller). */
comet_status_t cometi_baseline_backward(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_backward_args_t *args,
                                        cudaStream_t stream);

/* FP8 training on this path (backward_fp8.c; what it needs of the config,
 * cometi_fp8_train_supported, is checked by every training forward first). */
/* Its workspaces, made once per handle; collective (cometi_moe_agree), before any row moves. */
comet_status_t cometi_baseline_fp8_train_get(comet_moe_t moe, cometi_baseline_t *b);
void cometi_baseline_fp8_train_free(cometi_baseline_t *b);
/* Steps 0-2 of the backward (backward.c) in FP8: the kept x rows cast along the tokens,
 * dy quantized per token, its E4M3 rows, scales and routing weights dispatched as the
 * forward's x went. It fails before the dispatch only on a launch error (its arguments
 * are the forward's, valid on every rank), as the bf16 steps 0-2 do. */
comet_status_t cometi_baseline_fp8_send(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_backward_args_t *args,
                                        cudaStream_t stream);
/* Step 3 in FP8: s = dy W2 (cuBLASLt 1 x 128 by 128 x 128 on W2^T's copy), SwiGLU's FP8
 * backward, dx rows = dh W13 (on W13^T's copy), dy cast along the tokens, and the weight
 * gradients dW2 = dy^T (w a), dW13 = dh^T x (cuBLASLt 1 x 128 by 1 x 128, k the tokens). */
comet_status_t cometi_baseline_fp8_experts(comet_moe_t moe, cometi_baseline_t *b,
                                           const comet_moe_backward_args_t *args, cudaStream_t stream);
/* The segments as cuBLASLt's FP8 groups (b->groups_host, b->lt_start, b->lt_rows, copied
 * to b->groups; the largest group's padded rows into *max_padded), and the received E4M3
 * rows q [..][H] made ready for a GEMM: their K-major scales ([row][ceil(H / 128)])
 * packed by group into b->a0_scales, the groups' padding rows zeroed. */
comet_status_t cometi_baseline_fp8_groups(comet_moe_t moe, cometi_baseline_t *b, const cometi_segment_t *segs_host,
                                          void *q, const float *scales, int *max_padded, cudaStream_t stream);
/* W's 128 x 128 scales as cuBLASLt reads them (rows of k blocks padded to 4, baseline.c). */
comet_status_t cometi_baseline_weight_scales(comet_moe_t moe, int n, int k, const float *given, float *room,
                                             const float **out, cudaStream_t stream);
/* The forward's expert phase alone (cuBLAS GEMM0, SwiGLU, cuBLAS GEMM1; with FP8 the
 * scales' relayout, cuBLASLt GEMM0, SwiGLU, its quantization, cuBLASLt GEMM1), again on the
 * rows the last forward call received: the bench times it against our GEMMs on the same rows. */
comet_status_t cometi_baseline_experts(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       cudaStream_t stream);

/* An expert phase that failed after the dispatch (its message in moe->err): peers still
 * wait for this rank's rows in the return all-to-all, so the return runs anyway (a rank
 * that skipped it would hang them in NCCL), with the rows it sends poisoned (0xff: NaN in
 * bf16 and fp32, never taken for a result). Poisons `bufs` (n of them, bytes[i] each) on
 * `stream` and keeps the failure's message in `kept` (COMETI_ERR_LEN) for
 * cometi_baseline_failed_after_return. */
void cometi_baseline_poison_returned(comet_moe_t moe, void *const *bufs, const size_t *bytes, int n, char *kept,
                                     cudaStream_t stream);
/* After the return: the expert phase's failure st with its message back in moe->err (the
 * return's own failure, if any, is dropped: the first cause is reported). */
comet_status_t cometi_baseline_failed_after_return(comet_moe_t moe, comet_status_t st, const char *kept);
/* The injected failure (fail_experts), if armed: COMET_CUDA_ERROR, else 0. */
comet_status_t cometi_baseline_injected_failure(comet_moe_t moe, cometi_baseline_t *b);

/* C[rows][n] = A[rows][k] * W[n][k]^T through cuBLAS (bf16, fp32 accumulation), on the
 * handle's stream: what the baseline runs per expert. */
comet_status_t cometi_cublas_rows(cublasHandle_t h, char *err, int rows, int n, int k, const void *a, const void *w,
                                  void *c, int ldc);

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASELINE_H */
