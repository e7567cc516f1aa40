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
#include "../internal.h"
#include "../kernels/gemm.h"
#include "../kernels/route.h"

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

typedef struct cometi_baseline cometi_baseline_t;

comet_status_t cometi_baseline_create(comet_moe_t moe, cometi_baseline_t **out);
void cometi_baseline_destroy(cometi_baseline_t *b);
/* The baseline's receive buffer and SwiGLU output (tests compare the fused path with them). */
void cometi_baseline_buffers(const cometi_baseline_t *b, const void **recv, const void **act);
comet_status_t cometi_baseline_forward(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       cudaStream_t stream);
/* The forward's expert phase alone (cuBLAS GEMM0, SwiGLU, cuBLAS GEMM1), again on the rows
 * the last forward call received: the bench times it against our GEMMs on the same rows. */
comet_status_t cometi_baseline_experts(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       cudaStream_t stream);

/* C[rows][n] = A[rows][k] * W[n][k]^T through cuBLAS (bf16, fp32 accumulation), on the
 * handle's stream: what the baseline runs per expert. */
comet_status_t cometi_cublas_rows(cublasHandle_t h, char *err, int rows, int n, int k, const void *a, const void *w,
                                  void *c, int ldc);

/* ---- kernels (baseline.cu) ---- */
cudaError_t cometi_launch_permute(const void *x, const int32_t *ids, const int32_t *pos, const int32_t *send_base,
                                  int n, int k, int hidden, void *send, int32_t *send_pos, cudaStream_t stream);
cudaError_t cometi_launch_swiglu(const void *h, void *act, int ffn, const cometi_segment_t *segs, int num_segs,
                                 int max_rows, cudaStream_t stream);
/* y[t] = sum_j w[t][j] * sum_c back[c][send_pos[t][j]] over the tp copies c (each TP rank's
 * partial rows, copy_stride elements apart), fp32, in order. */
cudaError_t cometi_launch_combine(const void *back, int tp, size_t copy_stride, const int32_t *send_pos,
                                  const float *w, int m, int k, int hidden, void *y, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASELINE_H */
