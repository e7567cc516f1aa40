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
#include "base/host.h"
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

/* The sequential path's buffers; the forward's receive, GEMM0, act, GEMM1 and return
 * buffers are the backward's workspaces too (dy rows, s and act, dh, dx rows, dx rows home). */
typedef struct cometi_baseline {
    cublasHandle_t cublas;
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
    cometi_a2a_msg_t *sends, *recvs; /* the dispatch's NCCL messages (host) */
    /* pinned host */
    int32_t *counts_host; /* [world][E + 2] */
    int32_t *send_base_host;
    cometi_segment_t *segs_host;
    int max_seg_rows;     /* the last call's largest local segment */
    /* Where the last forward put its received rows, GEMM0 output and send positions: the
     * buffers above, or a training forward's saved state. */
    void *io_recv, *io_h;
    int32_t *io_send_pos;
} cometi_baseline_t;

comet_status_t cometi_baseline_create(comet_moe_t moe, cometi_baseline_t **out);
void cometi_baseline_destroy(cometi_baseline_t *b);
/* The baseline's receive buffer and SwiGLU output (tests compare the fused path with them). */
void cometi_baseline_buffers(const cometi_baseline_t *b, const void **recv, const void **act);
/* The forward; with `saved` (a training forward) the rows the backward needs go into it
 * (its bound checked on every rank before any row moves) and it is marked filled. */
comet_status_t cometi_baseline_forward(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       comet_moe_saved_t saved, cudaStream_t stream);
/* The count exchange every call of the path makes first (baseline.c); a backward's
 * message carries no counts, only its call id. */
comet_status_t cometi_baseline_exchange(comet_moe_t moe, cometi_baseline_t *b, unsigned int call, cudaStream_t stream);
/* The backward of the training forward that filled args->saved (checked by the caller). */
comet_status_t cometi_baseline_backward(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_backward_args_t *args,
                                        cudaStream_t stream);
/* The forward's expert phase alone (cuBLAS GEMM0, SwiGLU, cuBLAS GEMM1), again on the rows
 * the last forward call received: the bench times it against our GEMMs on the same rows. */
comet_status_t cometi_baseline_experts(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       cudaStream_t stream);

/* C[rows][n] = A[rows][k] * W[n][k]^T through cuBLAS (bf16, fp32 accumulation), on the
 * handle's stream: what the baseline runs per expert. */
comet_status_t cometi_cublas_rows(cublasHandle_t h, char *err, int rows, int n, int k, const void *a, const void *w,
                                  void *c, int ldc);

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASELINE_H */
