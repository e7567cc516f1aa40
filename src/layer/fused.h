/*
 * fused.h - the fused path of a layer: COMET's two operators with the knobs they run with
 * (moe.c), and what its training calls add (train_fused.c).
 */
#ifndef COMET_FUSED_H
#define COMET_FUSED_H

#include "layer/layer.h"
#include "patterns/gemm_combine.h"

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
    float *ones;                 /* [max_tokens x top_k]: the weights its route is given (dx sums
                                  * a token's choices unweighted) */
    cometi_window_t weights;     /* the routing weights in this rank's send order, then their
                                  * gradients from the experts' ranks (train_rows.h's
                                  * cometi_weight_windows_t) */
    float *w_rows, *dw_rows;     /* [max_recv_rows]: each received row's routing weight, and its
                                  * part of that weight's gradient */
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

#ifdef __cplusplus
}
#endif

#endif /* COMET_FUSED_H */
