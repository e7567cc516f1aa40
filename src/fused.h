/*
 * fused.h - the fused path of a layer: COMET's two operators with the knobs they run with
 * (moe.c), and what its training calls add (train_fused.c).
 */
#ifndef COMET_FUSED_H
#define COMET_FUSED_H

#include "internal.h"
#include "gemm_combine.h"

#ifdef __cplusplus
extern "C" {
#endif

struct cometi_fused {
    cometi_dispatch_gemm_t l0;   /* dispatch -> GEMM: x into GEMM0 + SwiGLU; in the backward,
                                  * dy into the dgrad of W2 */
    cometi_gemm_combine_t l1;    /* GEMM -> combine: GEMM1, its rows home; in the backward, the
                                  * dgrad of W13, dx home */
    cometi_dispatch_knobs_t k0;
    cometi_combine_knobs_t k1;
    /* The backward's: */
    void *dy_rows;               /* [max_tokens x top_k][hidden] bf16: each choice's dy, weighted;
                                  * layer1's output rows (max_recv_rows >= that), free until the
                                  * backward's dgrad of W13 writes them, after the dispatch read these */
    float *ones;                 /* [max_tokens x top_k]: the weights its route is given (dx sums
                                  * a token's choices unweighted) */
    comet_status_t unusable;     /* not 0: the first call could not make the backward's route
                                  * weights on this rank; every later call is refused (the
                                  * operators stay, to be destroyed with the layer, collectively) */
    int dswiglu_epilogue;        /* SwiGLU's backward in the dgrad of W2's epilogue (direct stores,
                                  * [g u] loaded there) instead of a kernel of its own after it: it
                                  * made that GEMM 1.6x slower on one H200, so 0 (tests run both) */
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

#ifdef __cplusplus
}
#endif

#endif /* COMET_FUSED_H */
