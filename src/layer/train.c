/*
 * train.c - training through comet.h: the saved state a training forward fills, the
 * training forward, and the backward, each with its arguments checked before anything is
 * launched. Each runs the fused path (train_fused.c) where it trains the layer, else the
 * sequential one (src/baseline/).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer/layer.h"
#include "base/fp8.h"
#include "baseline/baseline.h"
#include "layer/fused.h"

/* The bound (rows received, unpadded), the rows allocated for it, and whether [g u] is
 * kept in E4M3. */
static comet_status_t saved_rows(comet_moe_t moe, const comet_moe_saved_config_t *c, int64_t *bound, int64_t *cap,
                                 int *gu8)
{
    char *cerr = cometi_create_error_buffer();
    /* A token's choices are distinct experts: at most min(top_k, experts here) land here. */
    const int per_token = moe->cfg.top_k < moe->experts_per_rank ? moe->cfg.top_k : moe->experts_per_rank;
    const int64_t worst = (int64_t)moe->comm->size * moe->cfg.max_tokens * per_token;
    if (c && (c->size != sizeof(comet_moe_saved_config_t) || c->magic != COMET_STRUCT_MAGIC))
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "saved config.size = %zu, config.magic = 0x%x: initialise "
                           "it with COMET_MOE_SAVED_CONFIG_INIT", c->size, c->magic);
    if (c && (c->version < 1 || c->version > COMET_API_VERSION))
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "saved config.version = %u: this library knows 1..%d",
                           c->version, COMET_API_VERSION);
    if (c && c->version < 2 && c->gate_up_e4m3)
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "saved config.version = %u with gate_up_e4m3 = %d: the "
                           "field came in version 2; a version-1 config leaves it 0", c->version, c->gate_up_e4m3);
    if (c && (c->max_recv_rows < 0 || c->max_recv_rows > worst))
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "saved config.max_recv_rows = %lld: must be 0 (the worst "
                           "case) .. world x max_tokens x min(top_k, experts per rank) = %lld",
                           (long long)c->max_recv_rows, (long long)worst);
    if (c && c->gate_up_e4m3 != 0 && c->gate_up_e4m3 != 1)
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "saved config.gate_up_e4m3 = %d: must be 0 (bf16) or 1 "
                           "(E4M3)", c->gate_up_e4m3);
    if (c && c->gate_up_e4m3 && moe->cfg.dtype != COMET_DTYPE_FP8_BLOCK)
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "saved config.gate_up_e4m3 = 1 is for layers of dtype "
                           "COMET_DTYPE_FP8_BLOCK (this one's is %d)", (int)moe->cfg.dtype);
    *gu8 = c ? c->gate_up_e4m3 : 0;
    *bound = c && c->max_recv_rows ? c->max_recv_rows : worst;
    *cap = *bound + (int64_t)moe->experts_per_rank * COMETI_BLOCK_M;
    return COMET_SUCCESS;
}

/* The saved state's device parts, each starting on a 256-byte boundary of one block. */
#define SAVED_ALIGN 256
#define SAVED_PARTS 7
static size_t saved_layout(comet_moe_t moe, int64_t cap, int gu8, size_t offset[SAVED_PARTS])
{
    const size_t gu_values = (size_t)cap * 2 * moe->ffn_local;
    const size_t choices = (size_t)moe->cfg.max_tokens * moe->cfg.top_k, H = (size_t)moe->cfg.hidden;
    /* No expert outputs: d topk_weights is <s, a>, from rows the backward has anyway. */
    /* x's rows as they arrive: bf16, or FP8 (E4M3 then the row's scales, dispatch_gemm.h). */
    const size_t x_row = moe->cfg.dtype == COMET_DTYPE_FP8_BLOCK ? (size_t)cometi_fp8_row_bytes((int)H) : H * 2;
    const size_t size[SAVED_PARTS] = {
        moe->cfg.resend_x ? 0 : (size_t)cap * x_row, /* recv: x rows, unless the backward sends x again */
        gu_values * (gu8 ? 1 : 2),                  /* h: gate and up, bf16 or E4M3 */
        choices * sizeof(int32_t),                  /* send_pos */
        choices * sizeof(int32_t),                  /* ids */
        choices * sizeof(float),                    /* weights */
        sizeof(cometi_segment_t) * (size_t)moe->experts_per_rank, /* segs */
        gu8 ? gu_values / COMETI_FP8_BLOCK * sizeof(float) : 0,   /* h_scales: [2 Fl / 128][cap] */
    };
    size_t at = 0;
    for (int i = 0; i < SAVED_PARTS; i++) {
        offset[i] = at;
        at += (size[i] + SAVED_ALIGN - 1) / SAVED_ALIGN * SAVED_ALIGN;
    }
    return at;
}

comet_status_t comet_moe_saved_bytes(comet_moe_t moe, const comet_moe_saved_config_t *config, size_t *bytes)
{
    char *cerr = cometi_create_error_buffer();
    if (!moe || !bytes) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_moe_saved_bytes: %s is NULL",
                                           !moe ? "moe" : "bytes");
    int64_t bound, cap;
    int gu8;
    COMETI_TRY(saved_rows(moe, config, &bound, &cap, &gu8));
    size_t offset[SAVED_PARTS];
    *bytes = saved_layout(moe, cap, gu8, offset);
    return COMET_SUCCESS;
}

static comet_status_t saved_destroy(comet_moe_saved_t s)
{
    comet_status_t st = COMET_SUCCESS;
    if (s->owned) { /* the device may still read it */
        st = cometi_cuda(cometi_create_error_buffer(), cudaDeviceSynchronize(), "comet_moe_saved_destroy: device sync");
        cudaFree(s->memory);
    }
    free(s->segs_host);
    free(s->sends);
    free(s->recvs);
    free(s);
    return st;
}

comet_status_t comet_moe_saved_destroy(comet_moe_saved_t s)
{
    if (!s) return COMET_SUCCESS;
    /* The caller's memory: nothing on the device, and its layer may be gone already. */
    cometi_context_t prev = {NULL, 0};
    if (s->owned) cometi_context_enter(s->ctx, cometi_create_error_buffer(), &prev); /* freed whatever it says */
    comet_status_t st = saved_destroy(s);
    cometi_context_leave(&prev);
    return st;
}

/* A saved state over `memory` (NULL: allocated here, freed by destroy), the layer's
 * context current where it allocates. */
static comet_status_t saved_create_on(comet_moe_t moe, const comet_moe_saved_config_t *config, void *memory,
                                      size_t memory_bytes, comet_moe_saved_t *out)
{
    char *cerr = cometi_create_error_buffer();
    int64_t bound, cap;
    int gu8;
    COMETI_TRY(saved_rows(moe, config, &bound, &cap, &gu8));
    size_t offset[SAVED_PARTS];
    const size_t bytes = saved_layout(moe, cap, gu8, offset);
    if (memory && memory_bytes < bytes)
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_moe_saved_create_in: bytes = %zu: the saved state "
                           "needs %zu (comet_moe_saved_bytes)", memory_bytes, bytes);
    if (memory && (uintptr_t)memory % SAVED_ALIGN)
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_moe_saved_create_in: memory = %p: must be %d-byte "
                           "aligned", memory, SAVED_ALIGN);
    comet_moe_saved_t s = calloc(1, sizeof(*s));
    if (!s) return cometi_fail(cerr, COMET_OUT_OF_MEMORY, "comet_moe_saved_create: out of host memory");
    s->moe = moe;
    s->ctx = moe->comm->ctx;
    s->max_recv_rows = bound;
    s->cap_rows = cap;
    s->owned = memory == NULL;
    comet_status_t st = COMET_SUCCESS;
    if (s->owned) {
        char what[96];
        snprintf(what, sizeof(what), "comet_moe_saved_create: cudaMalloc(%zu bytes)", bytes);
        st = cometi_cuda(cerr, cudaMalloc(&memory, bytes), what);
    }
    s->memory = memory;
    if (st == COMET_SUCCESS) {
        char *m = memory;
        s->recv = moe->cfg.resend_x ? NULL : m + offset[0];
        s->h = m + offset[1];
        s->send_pos = (int32_t *)(m + offset[2]);
        s->ids = (int32_t *)(m + offset[3]);
        s->weights = (float *)(m + offset[4]);
        s->segs = (cometi_segment_t *)(m + offset[5]);
        s->h_scales = gu8 ? (float *)(m + offset[6]) : NULL;
    }
    const int per = moe->experts_per_rank, W = moe->comm->size;
    s->segs_host = malloc(per * sizeof(cometi_segment_t));
    s->sends = malloc(sizeof(cometi_a2a_msg_t) * moe->tp * moe->cfg.num_experts);
    s->recvs = malloc(sizeof(cometi_a2a_msg_t) * W * per);
    if (st == COMET_SUCCESS && (!s->segs_host || !s->sends || !s->recvs))
        st = cometi_fail(cerr, COMET_OUT_OF_MEMORY, "comet_moe_saved_create: out of host memory");
    if (st != COMET_SUCCESS) {
        char keep[COMETI_ERR_LEN];
        snprintf(keep, sizeof(keep), "%s", cerr);
        saved_destroy(s);
        snprintf(cerr, COMETI_ERR_LEN, "%s", keep);
        return st;
    }
    *out = s;
    return COMET_SUCCESS;
}

static comet_status_t saved_create(comet_moe_t moe, const comet_moe_saved_config_t *config, void *memory,
                                   size_t memory_bytes, comet_moe_saved_t *out)
{
    char *cerr = cometi_create_error_buffer();
    cerr[0] = '\0';
    if (!out) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_moe_saved_create: out is NULL");
    *out = NULL;
    if (!moe) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_moe_saved_create: moe is NULL");
    cometi_context_t prev = {NULL, 0};
    if (!memory) COMETI_TRY(cometi_context_enter(moe->comm->ctx, cerr, &prev));
    const comet_status_t st = saved_create_on(moe, config, memory, memory_bytes, out);
    cometi_context_leave(&prev);
    return st;
}

comet_status_t comet_moe_saved_create(comet_moe_t moe, const comet_moe_saved_config_t *config,
                                      comet_moe_saved_t *out)
{
    return saved_create(moe, config, NULL, 0, out);
}

comet_status_t comet_moe_saved_create_in(comet_moe_t moe, const comet_moe_saved_config_t *config, void *memory,
                                         size_t bytes, comet_moe_saved_t *out)
{
    if (!memory) {
        if (out) *out = NULL;
        return cometi_fail(cometi_create_error_buffer(), COMET_INVALID_ARGUMENT, "comet_moe_saved_create_in: memory "
                           "is NULL (comet_moe_saved_create allocates its own)");
    }
    return saved_create(moe, config, memory, bytes, out);
}

comet_status_t cometi_fp8_train_supported(comet_moe_t moe)
{
    const int F = moe->ffn_local;
    if (moe->cfg.dtype == COMET_DTYPE_FP8_BLOCK && F % 128)
        return cometi_fail(moe->err, COMET_NOT_SUPPORTED, "FP8 training: ffn / tp_size = %d must be a multiple of "
                           "128 (W13^T's 128 x 128 blocks would hold columns of both gate and up, and SwiGLU's FP8 "
                           "backward takes whole blocks); this layer runs the FP8 inference forward (gate and up "
                           "apart) or trains in bf16", F);
    return COMET_SUCCESS;
}

/* The path a training forward takes: the fused one where it trains this layer (AUTO
 * falls back to the sequential one), or the one asked for. */
static comet_status_t training_path(comet_moe_t moe, const comet_moe_args_t *a, int *path)
{
    if (a->impl == COMET_IMPL_BASELINE) {
        *path = COMETI_SAVED_SEQUENTIAL;
        return COMET_SUCCESS;
    }
    comet_status_t st = cometi_fused_train_supported(moe, &a->weights);
    struct cometi_fused *f;
    if (st == COMET_SUCCESS) st = cometi_fused_get(moe, &f); /* collective: every rank decides alike */
    if (st == COMET_SUCCESS) {
        *path = COMETI_SAVED_FUSED;
        return COMET_SUCCESS;
    }
    if (a->impl == COMET_IMPL_FUSED || st != COMET_NOT_SUPPORTED) return st; /* the reason is in moe->err */
    moe->err[0] = '\0';
    *path = COMETI_SAVED_SEQUENTIAL;
    return COMET_SUCCESS;
}

static comet_status_t forward_train(comet_moe_t moe, const comet_moe_args_t *args, comet_moe_saved_t saved,
                                    cudaStream_t stream)
{
    /* Before the arguments: an FP8 gate_up of such a layer would be refused as an argument,
     * where no argument makes it train. */
    COMETI_TRY(cometi_fp8_train_supported(moe));
    COMETI_TRY(cometi_moe_check_args(moe, args));
    if (!saved) return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "saved is NULL: a training forward fills one "
                                   "(comet_moe_saved_create)");
    if (saved->moe != moe)
        return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "saved belongs to another layer (comet_moe_saved_create "
                           "was given another comet_moe_t)");
    int path = 0;
    COMETI_TRY(training_path(moe, args, &path));
    comet_status_t async = cometi_check_sticky(moe->comm);
    if (async != COMET_SUCCESS) return cometi_fail(moe->err, async, "%s", moe->comm->err);
    struct cometi_baseline *b = NULL;
    if (path == COMETI_SAVED_SEQUENTIAL) COMETI_TRY(cometi_moe_baseline(moe, &b));
    saved->filled = 0;
    /* Its backward's call id: this forward's number, counted by every rank that goes on to
     * the collective part (whatever fails after), so the ranks' numbers stay together. */
    moe->train_calls = moe->train_calls % (COMETI_CALL_TRAIN_FORWARD - 1) + 1; /* 1 .. 2^31 - 1 */
    saved->call = moe->train_calls;
    comet_status_t st = path == COMETI_SAVED_FUSED ? cometi_fused_forward_train(moe, args, saved, stream)
                                                   : cometi_baseline_forward(moe, b, args, saved, stream);
    if (st == COMET_SUCCESS) st = cometi_cuda(moe->err, cudaGetLastError(), "comet_moe_forward_train");
    if (st != COMET_SUCCESS) saved->filled = 0;
    return st;
}

/* The FP8 fields: the weights transposed with their scales where the layer is FP8
 * (gate_up in one tensor, as the fused path trains), none where it is bf16. */
static comet_status_t check_backward_fp8(comet_moe_t moe, const comet_moe_backward_args_t *a)
{
    const comet_moe_weights_t *wt = &a->weights_t;
    const comet_moe_weight_scales_t *st = &a->weight_t_scales;
    const void *given[] = {wt->gate_up, wt->gate, wt->up, wt->down, st->gate_up, st->gate, st->up, st->down};
    const char *names[] = {"weights_t.gate_up", "weights_t.gate", "weights_t.up", "weights_t.down",
                           "weight_t_scales.gate_up", "weight_t_scales.gate", "weight_t_scales.up",
                           "weight_t_scales.down"};
    if (moe->cfg.dtype != COMET_DTYPE_FP8_BLOCK) {
        for (int i = 0; i < 8; i++)
            if (given[i])
                return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "args.%s = %p: the transposed FP8 weights are "
                                   "for config.dtype COMET_DTYPE_FP8_BLOCK (this layer is bf16)", names[i], given[i]);
        return COMET_SUCCESS;
    }
    static const int apart[4] = {1, 2, 5, 6}, needed[4] = {0, 3, 4, 7}; /* gate, up; gate_up, down (and scales) */
    for (int j = 0; j < 4; j++) {
        const int i = apart[j];
        if (given[i])
            return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "args.%s = %p: the FP8 backward takes gate and up "
                               "in one tensor (weights_t.gate_up, [E_local][H][2F])", names[i], given[i]);
    }
    for (int j = 0; j < 4; j++)
        if (!given[needed[j]])
            return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "args.%s is NULL: the FP8 backward reads W^T in E4M3 "
                               "with its scales (comet_quantize_fp8_weights_transposed)", names[needed[j]]);
    for (int i = 0; i < 8; i++)
        if ((uintptr_t)given[i] % 16)
            return cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "args.%s = %p: must be 16-byte aligned", names[i],
                               given[i]);
    return COMET_SUCCESS;
}

comet_status_t cometi_moe_check_backward_args(comet_moe_t moe, const comet_moe_backward_args_t *a)
{
    char *err = moe->err;
    const comet_status_t INVAL = COMET_INVALID_ARGUMENT;
    if (!a) return cometi_fail(err, INVAL, "args is NULL");
    if (a->size != sizeof(comet_moe_backward_args_t) || a->magic != COMET_STRUCT_MAGIC)
        return cometi_fail(err, INVAL, "args.size = %zu, args.magic = 0x%x: initialise the struct with "
                           "COMET_MOE_BACKWARD_ARGS_INIT", a->size, a->magic);
    if (a->version < 1 || a->version > COMET_API_VERSION)
        return cometi_fail(err, INVAL, "args.version = %u: this library knows 1..%d", a->version, COMET_API_VERSION);
    const comet_moe_weights_t *wt = &a->weights_t;
    const comet_moe_weight_scales_t *wts = &a->weight_t_scales;
    if (a->version < 2 && (wt->gate_up || wt->gate || wt->up || wt->down || wts->gate_up || wts->gate || wts->up ||
                           wts->down))
        return cometi_fail(err, INVAL, "args.version = %u with args.weights_t or args.weight_t_scales set: those "
                           "fields came in version 2; a version-1 args struct leaves them NULL", a->version);
    if (!a->saved) return cometi_fail(err, INVAL, "args.saved is NULL: pass the state the training forward filled");
    if (a->saved->moe != moe)
        return cometi_fail(err, INVAL, "args.saved belongs to another layer (comet_moe_saved_create was given another "
                           "comet_moe_t)");
    if (!a->saved->filled)
        return cometi_fail(err, INVAL, "args.saved holds no forward: run comet_moe_forward_train into it first (a "
                           "failed training forward leaves it empty, and a backward consumes it)");
    const int fused = a->saved->path == COMETI_SAVED_FUSED;
    if (a->impl != COMET_IMPL_AUTO && a->impl != COMET_IMPL_BASELINE && a->impl != COMET_IMPL_FUSED)
        return cometi_fail(err, INVAL, "args.impl = %d: must be COMET_IMPL_AUTO, _BASELINE or _FUSED", (int)a->impl);
    if ((a->impl == COMET_IMPL_FUSED && !fused) || (a->impl == COMET_IMPL_BASELINE && fused))
        return cometi_fail(err, INVAL, "args.impl = %s, but args.saved was filled on the %s path: the backward runs "
                           "the path of its forward (COMET_IMPL_AUTO takes it)",
                           a->impl == COMET_IMPL_FUSED ? "COMET_IMPL_FUSED" : "COMET_IMPL_BASELINE",
                           fused ? "fused" : "sequential");
    const int m = a->saved->num_tokens;
    if (m > 0 && (!a->dy || !a->dx || !a->d_topk_weights))
        return cometi_fail(err, INVAL, "args.%s is NULL with %d tokens in the forward",
                           !a->dy ? "dy" : !a->dx ? "dx" : "d_topk_weights", m);
    if (m > 0 && moe->cfg.resend_x && !a->x)
        return cometi_fail(err, INVAL, "args.x is NULL with %d tokens in the forward: this layer's config.resend_x "
                           "is 1, so the backward sends the forward's x again", m);
    const int fp8 = moe->cfg.dtype == COMET_DTYPE_FP8_BLOCK;
    COMETI_TRY(check_backward_fp8(moe, a));
    const comet_moe_weights_t *w = fp8 ? &a->weights_t : &a->weights;
    const comet_moe_weight_grads_t *g = &a->grads;
    if (!fp8 && (!w->down || (!w->gate_up && (!w->gate || !w->up)) || (w->gate_up && (w->gate || w->up))))
        return cometi_fail(err, INVAL, "args.weights: give down and gate_up, or down, gate and up (the forward's)");
    if (!g->down) return cometi_fail(err, INVAL, "args.grads.down is NULL");
    if (w->gate_up ? !g->gate_up || g->gate || g->up : g->gate_up || !g->gate || !g->up)
        return cometi_fail(err, INVAL, "args.grads: gate_up = %p, gate = %p, up = %p: give %s, as args.%s does",
                           g->gate_up, g->gate, g->up, w->gate_up ? "gate_up alone" : "gate and up",
                           fp8 ? "weights_t (FP8: always gate_up)" : "weights");
    if (fused && !w->gate_up)
        return cometi_fail(err, INVAL, "args.weights: gate and up apart, but the training forward ran fused with "
                           "gate_up");
    if (g->mode != COMET_GRAD_WRITE_BF16 && g->mode != COMET_GRAD_ACCUMULATE_FP32)
        return cometi_fail(err, INVAL, "args.grads.mode = %d: must be COMET_GRAD_WRITE_BF16 or "
                           "COMET_GRAD_ACCUMULATE_FP32", (int)g->mode);
    /* 16-byte rows for the kernels' vector loads; cuBLAS's alignment for the rest. */
    const void *ptrs[] = {a->dy, a->dx, w->gate_up, w->gate, w->up, w->down, g->gate_up, g->gate, g->up, g->down,
                          moe->cfg.resend_x ? a->x : NULL};
    const char *names[] = {"dy", "dx", fp8 ? "weights_t.gate_up" : "weights.gate_up", "weights.gate", "weights.up",
                           fp8 ? "weights_t.down" : "weights.down", "grads.gate_up", "grads.gate", "grads.up",
                           "grads.down", "x"};
    for (int i = 0; i < 11; i++)
        if ((uintptr_t)ptrs[i] % 16)
            return cometi_fail(err, INVAL, "args.%s = %p: must be 16-byte aligned", names[i], ptrs[i]);
    if ((uintptr_t)a->d_topk_weights % 4)
        return cometi_fail(err, INVAL, "args.d_topk_weights = %p: must be 4-byte aligned", (void *)a->d_topk_weights);
    return COMET_SUCCESS;
}

static comet_status_t backward(comet_moe_t moe, const comet_moe_backward_args_t *args, cudaStream_t stream)
{
    COMETI_TRY(cometi_moe_check_backward_args(moe, args));
    comet_status_t async = cometi_check_sticky(moe->comm);
    if (async != COMET_SUCCESS) return cometi_fail(moe->err, async, "%s", moe->comm->err);
    comet_status_t st;
    if (args->saved->path == COMETI_SAVED_FUSED) {
        st = cometi_fused_backward(moe, args, stream);
    } else {
        struct cometi_baseline *b;
        COMETI_TRY(cometi_moe_baseline(moe, &b)); /* made by the forward that filled args->saved */
        st = cometi_baseline_backward(moe, b, args, stream);
    }
    if (st == COMET_SUCCESS) st = cometi_cuda(moe->err, cudaGetLastError(), "comet_moe_backward");
    return st;
}

comet_status_t comet_moe_forward_train(comet_moe_t moe, const comet_moe_args_t *args, comet_moe_saved_t saved,
                                       cudaStream_t stream)
{
    if (!moe)
        return cometi_fail(cometi_create_error_buffer(), COMET_INVALID_ARGUMENT,
                           "comet_moe_forward_train: moe is NULL");
    moe->err[0] = '\0';
    cometi_context_t prev;
    COMETI_TRY(cometi_context_enter(moe->comm->ctx, moe->err, &prev));
    comet_status_t st = forward_train(moe, args, saved, stream);
    cometi_context_leave(&prev);
    return st;
}

comet_status_t comet_moe_backward(comet_moe_t moe, const comet_moe_backward_args_t *args, cudaStream_t stream)
{
    if (!moe)
        return cometi_fail(cometi_create_error_buffer(), COMET_INVALID_ARGUMENT, "comet_moe_backward: moe is NULL");
    moe->err[0] = '\0';
    cometi_context_t prev;
    COMETI_TRY(cometi_context_enter(moe->comm->ctx, moe->err, &prev));
    comet_status_t st = backward(moe, args, stream);
    cometi_context_leave(&prev);
    return st;
}
