/*
 * layer.h - the MoE layer's handle (moe.c) and a training forward's saved state (train.c):
 * what each path keeps, made by its first call.
 */
#ifndef COMET_LAYER_LAYER_H
#define COMET_LAYER_LAYER_H

#include "comm/comm.h"
#include "comm/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

struct cometi_baseline;
struct cometi_fused;

struct comet_moe {
    comet_comm_t comm;
    comet_moe_config_t cfg;
    int ep, tp, experts_per_rank, first_expert;
    int ffn_local;                    /* ffn / tp: the columns of each expert this rank holds */
    int64_t max_recv_rows;            /* worst-case padded rows landing on this rank */
    char err[COMETI_ERR_LEN];
    struct cometi_baseline *baseline; /* the sequential path's buffers, made by its first call, or NULL */
    struct cometi_fused *fused;       /* layer0 + layer1, made by the first fused call, or NULL */
    int fused_unsupported;            /* the config cannot run fused (AUTO runs the baseline) */
    unsigned int train_calls;         /* training forwards so far, 1 .. 2^31 - 1 once one ran: each
                                       * saved state's call id, the same on every rank */
    cudaEvent_t *marks;               /* COMETI_NUM_MARKS events, or NULL: phase timing */
};

/* What a training forward keeps for its backward (comet.h's comet_moe_saved_t); the
 * sequential path fills it and reads it. */
enum { COMETI_SAVED_SEQUENTIAL = 1, COMETI_SAVED_FUSED = 2 };

struct comet_moe_saved {
    comet_moe_t moe;
    void *ctx;                   /* its layer's CUDA context (destroy may come after the layer's) */
    int64_t max_recv_rows;       /* the bound: (token, choice) rows received, padding excluded */
    int64_t cap_rows;            /* rows allocated: the bound and a 128-row block of padding per local expert */
    int filled;                  /* a training forward filled it, nothing failed after, and no
                                  * backward has consumed it */
    int path;                    /* COMETI_SAVED_*: the path that filled it (its backward runs it) */
    void *memory;                /* the one device block the arrays below are carved from */
    int owned;                   /* allocated by comet_moe_saved_create (else the caller's) */
    int num_tokens;
    unsigned int call;           /* its forward's number (comet_moe.train_calls), the backward's
                                  * call id, which every rank's must match */
    void *recv;                  /* [cap_rows][H] bf16: x rows received, in the plan's layout; NULL
                                  * where the config resends x (the backward sends it again) */
    void *h;                     /* [cap_rows][2 Fl] bf16: their gate and up projections (the fused
                                  * backward turns them into their gradients in place); E4M3 where
                                  * h_scales is set (FP8, saved config gate_up_e4m3) */
    float *h_scales;             /* [2 Fl / 128][cap_rows]: h's 1 x 128 scales, or NULL (bf16) */
    int32_t *send_pos;           /* [max_tokens x k] each choice's place in the send order (-1: an
                                  * expert id out of range, no row) */
    int32_t *ids;                /* [max_tokens x k] the forward's topk_ids (fused: its route again) */
    float *weights;              /* [max_tokens x k] the forward's topk_weights */
    cometi_segment_t *segs;      /* [E_local] device: this rank's segments */
    cometi_segment_t *segs_host; /* [E_local] */
    int max_seg_rows;
    cometi_a2a_msg_t *sends, *recvs; /* the dispatch's NCCL messages (host); the return trip swaps them */
    int n_sends, n_recvs;
};

/* The sequential path's buffers and cuBLAS handle, allocated by the first call that runs
 * it on this layer (moe.c), after the ranks compare their configs (collective): a layer
 * that only runs fused never pays for them. */
comet_status_t cometi_moe_baseline(comet_moe_t moe, struct cometi_baseline **out);

/* Every rank's outcome of a local step (an allocation) before anything collective is
 * enqueued, so that where one rank failed all refuse together instead of peers waiting
 * for rows that never come: COMET_SUCCESS where every rank's `mine` is; else this rank's
 * own failure (its message already in moe->err), or COMET_REMOTE_ERROR naming the rank
 * that could not `what`, every message prefixed by `who`. Collective, host-blocking. */
comet_status_t cometi_moe_agree(comet_moe_t moe, comet_status_t mine, const char *who, const char *what);

/* Whether an FP8 layer trains (train.c): ffn / tp_size a multiple of 128, the same on
 * every rank and on either path; COMET_NOT_SUPPORTED saying so, before anything else of a
 * training forward is checked or enqueued. */
comet_status_t cometi_fp8_train_supported(comet_moe_t moe);

/* A forward's arguments checked (moe.c): COMET_INVALID_ARGUMENT naming the field. */
comet_status_t cometi_moe_check_args(comet_moe_t moe, const comet_moe_args_t *args);
/* A backward's arguments checked (train.c), the saved state's agreement with them
 * included: COMET_INVALID_ARGUMENT naming the field. */
comet_status_t cometi_moe_check_backward_args(comet_moe_t moe, const comet_moe_backward_args_t *args);

/* Benchmarks: record the baseline's phase boundaries into `marks` (NULL: stop). */
void cometi_moe_set_marks(comet_moe_t moe, cudaEvent_t *marks);

/* Benchmarks: the fused backward's grouped GEMMs alone, every SM, no communication, on the
 * rows args->saved holds (a fused training forward's; COMET_INVALID_ARGUMENT for another):
 * those of `mask` (0: all), bit 0 the dgrad of W2, 1 the dgrad of W13, 2 dW2, 3 dW13.
 * Outputs go to the backward's workspaces and args->grads. */
comet_status_t cometi_moe_backward_gemms(comet_moe_t moe, const comet_moe_backward_args_t *args, int mask,
                                         cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_LAYER_LAYER_H */
