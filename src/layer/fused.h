/*
 * fused.h - the fused path of a layer: COMET's two operators with the knobs they run with
 * (moe.c), and what its training calls add (train_fused.c).
 */
#ifndef COMET_FUSED_H
#define COMET_FUSED_H

#include "baseline/blaslt_fp8.h"
#include "layer/layer.h"
#include "patterns/gemm_combine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The FP8 backward's workspaces (config.dtype COMET_DTYPE_FP8_BLOCK), made by the first
 * training forward, rows of the layer's receive bound R (l0.max_recv_rows): */
typedef struct cometi_fp8_train {
    void *s;            /* [R][F] bf16: s = dy W2 (SwiGLU's backward leaves dh quantized 1 x 128
                         * in the saved state's [g u] bytes: the A of dx = dh W13) */
    float *dh_scales;   /* [2F / 128][R]: dh's scales, MN-major */
    float *dot_parts;   /* [F / 128][R]: each row's <s, a> per 128 columns, summed in order */
    /* The weight gradients' operands (ld: R rounded up to 128): */
    cometi_fp8_wgrad_operands_t wg;
    /* config.fp8_wgrad_cublaslt: cuBLASLt's GEMMs for the weight gradients, with each
     * expert's segment copied to the host once the backward's route has made it: */
    cometi_blaslt_fp8_t *lt;
    cometi_segment_t *segs_host;  /* [experts_per_group], pinned */
    cudaEvent_t segs_copied;
} cometi_fp8_train_t;

struct cometi_fused {
    cometi_dispatch_gemm_t l0;   /* dispatch -> GEMM: x into GEMM0 + SwiGLU; in the backward,
                                  * dy into the dgrad of W2 */
    cometi_gemm_combine_t l1;    /* GEMM -> combine: GEMM1, its rows home; in the backward, the
                                  * dgrad of W13, dx home */
    cometi_dispatch_knobs_t k0;
    cometi_combine_knobs_t k1;
    /* The backward's: */
    float *ones;                 /* [max_tokens x top_k]: the weights its route is given (dx sums
                                  * a token's choices unweighted) */
    cometi_window_t weights;     /* the routing weights in this rank's send order, then their
                                  * gradients from the experts' ranks (train_rows.h's
                                  * cometi_weight_windows_t) */
    float *w_rows, *dw_rows;     /* [max_recv_rows]: each received row's routing weight, and its
                                  * part of that weight's gradient */
    cometi_fp8_train_t *fp8;     /* FP8 training's workspaces, or NULL (none made yet) */
    comet_status_t unusable;     /* not 0: the first call could not make the backward's route
                                  * weights on this rank; every later call is refused (the
                                  * operators stay, to be destroyed with the layer, collectively) */
};

/* The layer's fused path, created by the first call (collective: picks the knobs,
 * allocates the operators' symmetric buffers). */
comet_status_t cometi_fused_get(comet_moe_t moe, struct cometi_fused **out);

/* Whether the fused path trains this layer with these weights (train_fused.c): 0, or
 * COMET_NOT_SUPPORTED with the reason in moe->err. */
comet_status_t cometi_fused_train_supported(comet_moe_t moe, const comet_moe_weights_t *w);
/* The training forward and the backward on the fused path (arguments checked by train.c). */
comet_status_t cometi_fused_forward_train(comet_moe_t moe, const comet_moe_args_t *a, comet_moe_saved_t saved,
                                          cudaStream_t stream);
comet_status_t cometi_fused_backward(comet_moe_t moe, const comet_moe_backward_args_t *args, cudaStream_t stream);
/* Free the FP8 training workspaces (the layer's destroy). */
void cometi_fp8_train_free(struct cometi_fused *f);

#ifdef __cplusplus
}
#endif

#endif /* COMET_FUSED_H */
