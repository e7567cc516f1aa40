/*
 * moe.c - the MoE layer handle: config checks, the plan's sizes, and the forward
 * call that checks its arguments and hands them to a path: the fused tile-level path
 * (route, layer0, layer1), or the sequential baseline.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer/layer.h"
#include "baseline/baseline.h"
#include "layer/fused.h"
#include "base/params.h"
#include "patterns/tune.h"


/* The settings: the tuning file's line for this layer ($COMET_TUNING_FILE), else the
 * cost model's (tune.h). A file that cannot be read or parsed is an error, not ignored.
 * Collective: the ranks compare what they picked before anything else collective, so a
 * rank whose file differs (or failed) stops every rank instead of leaving them waiting. */
static comet_status_t pick_knobs(comet_moe_t moe, struct cometi_fused *f)
{
    comet_comm_t comm = moe->comm;
    cometi_knobs_t k;
    cometi_model_knobs(&moe->cfg, comm->size, comm->sm_count, &k);
    /* The tuning file's lines are bf16 layers' settings (comet tune times bf16): an FP8
     * layer takes the model's, which know its rows and GEMMs. */
    const char *path = moe->cfg.dtype == COMET_DTYPE_FP8_BLOCK ? "" : cometi_param_str(COMETI_PARAM_TUNING_FILE);
    int failed = 0;
    if (*path) {
        char err[COMETI_ERR_LEN];
        if (cometi_tuning_lookup(path, &moe->cfg, comm->size, comm->sm_count, &k, err, sizeof(err)) < 0) {
            cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "$COMET_TUNING_FILE: %.440s", err);
            failed = 1;
        }
    }
    enum { N = 8 };
    const int mine[N] = {failed, k.l0.dispatch_blocks, k.l0.dispatch_mode, k.l1.combine_blocks, k.l1.n_splits,
                         k.l1.dynamic_tiles, k.l1.tail, k.l1.push};
    int *all = malloc(sizeof(mine) * comm->size);
    if (!all) return cometi_fail(moe->err, COMET_OUT_OF_MEMORY, "fused path: out of host memory");
    comet_status_t st = cometi_allgather_ints(comm, mine, N, all);
    if (st != COMET_SUCCESS) snprintf(moe->err, COMETI_ERR_LEN, "fused path: %.480s", comm->err);
    for (int r = 0; st == COMET_SUCCESS && r < comm->size; r++) {
        if (failed) st = COMET_INVALID_ARGUMENT; /* message already written */
        else if (all[r * N])
            st = cometi_fail(moe->err, COMET_REMOTE_ERROR, "fused path: rank %d could not read its tuning file "
                             "($COMET_TUNING_FILE)", r);
        else if (memcmp(all + r * N, mine, sizeof(mine)))
            st = cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "fused path: rank %d picked other settings than rank "
                             "%d (dispatch %d, combine %d x %d splits, push %d against %d, %d x %d, push %d): give "
                             "every rank the same $COMET_TUNING_FILE", r, comm->rank, all[r * N + 1], all[r * N + 3],
                             all[r * N + 4], all[r * N + 7], mine[1], mine[3], mine[4], mine[7]);
    }
    free(all);
    f->k0 = k.l0;
    f->k1 = k.l1;
    return st;
}

/* Collective, at a path's first call on the handle: every rank's layer config is this
 * rank's. A rank with another would size, route or send rows as its peers do not expect
 * (resend_x apart: rows past a peer's receive buffer). */
static comet_status_t config_agrees(comet_moe_t moe, const char *path)
{
    enum { N = 11 };
    const comet_moe_config_t *c = &moe->cfg;
    const int mine[N] = {c->hidden, c->ffn, c->num_experts, c->top_k, c->max_tokens, c->ep_size, c->tp_size,
                         c->resend_x, (int)c->dtype, c->fp8_pow2_scales, c->fp8_wgrad_cublaslt};
    static const char *const names[N] = {"hidden", "ffn", "num_experts", "top_k", "max_tokens", "ep_size",
                                         "tp_size", "resend_x", "dtype", "fp8_pow2_scales", "fp8_wgrad_cublaslt"};
    /* Every int field of the config after its header (size, magic, version): a field added
     * to comet_moe_config_t without a place here fails to compile. */
    _Static_assert(sizeof(comet_moe_config_t) ==
                       (offsetof(comet_moe_config_t, hidden) + N * sizeof(int) + _Alignof(comet_moe_config_t) - 1) /
                           _Alignof(comet_moe_config_t) * _Alignof(comet_moe_config_t),
                   "config_agrees compares every field of comet_moe_config_t");
    comet_comm_t comm = moe->comm;
    int *all = malloc(sizeof(mine) * comm->size);
    if (!all) return cometi_fail(moe->err, COMET_OUT_OF_MEMORY, "%s: out of host memory", path);
    comet_status_t st = cometi_allgather_ints(comm, mine, N, all);
    if (st != COMET_SUCCESS) snprintf(moe->err, COMETI_ERR_LEN, "%s: %.480s", path, comm->err);
    for (int r = 0; st == COMET_SUCCESS && r < comm->size; r++)
        for (int i = 0; i < N; i++)
            if (all[r * N + i] != mine[i]) {
                st = cometi_fail(moe->err, COMET_INVALID_ARGUMENT, "%s: rank %d's layer has config.%s = %d, this "
                                 "rank's (%d) has %d: create the layer with the same config on every rank", path, r,
                                 names[i], all[r * N + i], comm->rank, mine[i]);
                break;
            }
    free(all);
    return st;
}

/* Collective, on the first fused call: every rank makes the same choice (same config). */
static comet_status_t fused_create(comet_moe_t moe)
{
    COMETI_TRY(config_agrees(moe, "fused path"));
    struct cometi_fused *f = calloc(1, sizeof(*f));
    if (!f) return cometi_fail(moe->err, COMET_OUT_OF_MEMORY, "fused path: out of host memory");
    comet_status_t st = pick_knobs(moe, f);
    if (st != COMET_SUCCESS) {
        free(f);
        return st;
    }
    const size_t choices = (size_t)moe->cfg.max_tokens * moe->cfg.top_k;
    st = cometi_dispatch_gemm_create(moe->comm, &moe->cfg, &f->l0);
    if (st == COMET_SUCCESS) {
        st = cometi_gemm_combine_create(moe->comm, &moe->cfg, &f->l0, &f->l1);
        if (st != COMET_SUCCESS) cometi_dispatch_gemm_destroy(moe->comm, &f->l0);
    }
    if (st == COMET_SUCCESS) { /* the backward's routing weights and their gradients, by send place */
        st = cometi_window_create(moe->comm, choices * (1 + moe->tp) * sizeof(float), &f->weights);
        if (st != COMET_SUCCESS) {
            cometi_gemm_combine_destroy(moe->comm, &f->l1);
            cometi_dispatch_gemm_destroy(moe->comm, &f->l0);
        }
    }
    if (st != COMET_SUCCESS) {
        snprintf(moe->err, COMETI_ERR_LEN, "fused path: %.480s", moe->comm->err);
        free(f);
        if (st == COMET_NOT_SUPPORTED) moe->fused_unsupported = 1;
        return st;
    }
    /* The backward's route weights (its dx sums a token's choices unweighted) and its rows'
     * routing weights, made here where every rank allocates alike, so no backward allocates
     * on one rank alone. */
    float *ones = malloc(choices * sizeof(float) + 4);
    st = ones ? COMET_SUCCESS : cometi_fail(moe->err, COMET_OUT_OF_MEMORY, "fused path: out of host memory");
    for (size_t i = 0; ones && i < choices; i++) ones[i] = 1.0f;
    if (st == COMET_SUCCESS)
        st = cometi_cuda(moe->err, cudaMalloc((void **)&f->ones, choices * sizeof(float) + 4),
                         "cudaMalloc(the backward's route weights)");
    if (st == COMET_SUCCESS)
        st = cometi_cuda(moe->err, cudaMemcpy(f->ones, ones, choices * sizeof(float), cudaMemcpyHostToDevice),
                         "copy the backward's route weights");
    free(ones);
    const size_t row_floats = (size_t)f->l0.max_recv_rows * sizeof(float) + 4;
    if (st == COMET_SUCCESS)
        st = cometi_cuda(moe->err, cudaMalloc((void **)&f->w_rows, row_floats), "cudaMalloc(the rows' weights)");
    if (st == COMET_SUCCESS)
        st = cometi_cuda(moe->err, cudaMalloc((void **)&f->dw_rows, row_floats),
                         "cudaMalloc(the rows' weight gradients)");
    /* Published either way: the operators are collective and go with the layer; a failure
     * here leaves the path refusing every call rather than running without its weights. */
    if (st != COMET_SUCCESS) {
        cudaFree(f->ones), cudaFree(f->w_rows), cudaFree(f->dw_rows);
        f->ones = f->w_rows = f->dw_rows = NULL;
        f->unusable = st;
    }
    moe->fused = f;
    return st;
}

comet_status_t cometi_fused_get(comet_moe_t moe, struct cometi_fused **out)
{
    if (!moe->fused) COMETI_TRY(fused_create(moe));
    if (moe->fused->unusable)
        return cometi_fail(moe->err, moe->fused->unusable, "fused path: its first call could not allocate the "
                           "backward's routing-weight buffers on this rank (%s); destroy the layer",
                           comet_status_string(moe->fused->unusable));
    *out = moe->fused;
    return COMET_SUCCESS;
}

static void fused_destroy(comet_moe_t moe)
{
    if (!moe->fused) return;
    cudaFree(moe->fused->ones), cudaFree(moe->fused->w_rows), cudaFree(moe->fused->dw_rows);
    cometi_fp8_train_free(moe->fused);
    cometi_window_destroy(moe->comm, &moe->fused->weights);
    cometi_gemm_combine_destroy(moe->comm, &moe->fused->l1);
    cometi_dispatch_gemm_destroy(moe->comm, &moe->fused->l0);
    free(moe->fused);
    moe->fused = NULL;
}

static comet_status_t fused_forward(comet_moe_t moe, const comet_moe_args_t *a, cudaStream_t stream)
{
    struct cometi_fused *f;
    COMETI_TRY(cometi_fused_get(moe, &f));
    comet_status_t st = cometi_dispatch_gemm_run(moe->comm, &f->l0, a, &f->k0, stream);
    if (st == COMET_SUCCESS) st = cometi_gemm_combine_run(moe->comm, &f->l1, &f->l0, a, &f->k1, stream);
    if (st != COMET_SUCCESS) snprintf(moe->err, COMETI_ERR_LEN, "%.500s", moe->comm->err);
    return st;
}

comet_status_t cometi_moe_baseline(comet_moe_t moe, struct cometi_baseline **out)
{
    if (!moe->baseline) {
        COMETI_TRY(config_agrees(moe, "baseline path"));
        COMETI_TRY(cometi_baseline_create(moe, &moe->baseline));
    }
    *out = moe->baseline;
    return COMET_SUCCESS;
}

comet_status_t comet_moe_create(comet_comm_t comm, const comet_moe_config_t *config, comet_moe_t *out)
{
    char *cerr = cometi_create_error_buffer();
    cerr[0] = '\0';
    if (!out) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_moe_create: out is NULL");
    *out = NULL;
    if (!comm) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_moe_create: comm is NULL");
    comet_status_t st = comet_moe_config_validate(config, comm->size, cerr, COMETI_ERR_LEN);
    if (st != COMET_SUCCESS) return st;
    comet_moe_t moe = calloc(1, sizeof(*moe));
    if (!moe) return cometi_fail(cerr, COMET_OUT_OF_MEMORY, "comet_moe_create: out of host memory");
    moe->comm = comm;
    moe->cfg = *config;
    moe->tp = config->tp_size ? config->tp_size : 1;
    moe->ep = config->ep_size ? config->ep_size : comm->size / moe->tp;
    moe->cfg.tp_size = moe->tp;
    moe->cfg.ep_size = moe->ep;
    moe->experts_per_rank = config->num_experts / moe->ep;
    moe->first_expert = comm->rank / moe->tp * moe->experts_per_rank;
    moe->ffn_local = config->ffn / moe->tp;
    moe->max_recv_rows = cometi_route_max_recv_rows(comm->size, config->max_tokens, config->top_k,
                                                    moe->experts_per_rank, COMETI_BLOCK_M);
    *out = moe;
    return COMET_SUCCESS;
}

/* Before the fused path's windows are deregistered (collective): every rank here, within
 * the timeout. A failure (or one already recorded) marks the peers lost, so teardown
 * frees only what is this rank's own and returns the reason instead of hanging. */
static comet_status_t fused_teardown_ready(comet_moe_t moe, comet_status_t st)
{
    comet_comm_t comm = moe->comm;
    if (st == COMET_SUCCESS) st = cometi_check_sticky(comm); /* a bad expert id is no reason to stop */
    if (st == COMET_SUCCESS && !comm->peers_lost)
        st = cometi_barrier_sync(comm, "comet_moe_destroy: every rank here");
    if (st == COMET_SUCCESS) return COMET_SUCCESS;
    comm->peers_lost = 1;
    snprintf(moe->err, COMETI_ERR_LEN, "comet_moe_destroy: %.300s; the layer's symmetric memory is left to "
             "comet_comm_destroy, which cannot wait for the peers either", comm->err);
    return st;
}

static comet_status_t moe_destroy(comet_moe_t moe)
{
    comet_status_t st = cometi_cuda(moe->err, cudaDeviceSynchronize(), "comet_moe_destroy: device sync");
    if (moe->fused) st = fused_teardown_ready(moe, st);
    fused_destroy(moe);
    cometi_baseline_destroy(moe->baseline);
    /* The handle goes now: a failure's message moves to where comet_last_create_error() reads. */
    if (st != COMET_SUCCESS) snprintf(cometi_create_error_buffer(), COMETI_ERR_LEN, "%s", moe->err);
    free(moe);
    return st;
}

comet_status_t comet_moe_destroy(comet_moe_t moe)
{
    if (!moe) return COMET_SUCCESS;
    cometi_context_t prev; /* if it cannot be bound, the destroy's own CUDA calls say so; it frees anyway */
    cometi_context_enter(moe->comm->ctx, moe->err, &prev);
    comet_status_t st = moe_destroy(moe);
    cometi_context_leave(&prev);
    return st;
}

const char *comet_moe_last_error(comet_moe_t moe) { return moe ? moe->err : "moe is NULL"; }

void cometi_moe_set_marks(comet_moe_t moe, cudaEvent_t *marks) { moe->marks = marks; }

/* The FP8 fields: each weight's scales beside it where the config is FP8, none where it is
 * bf16; x's scales, where given, aligned. */
static comet_status_t check_fp8_args(comet_moe_t moe, const comet_moe_args_t *a)
{
    char *err = moe->err;
    const comet_status_t INVAL = COMET_INVALID_ARGUMENT;
    const comet_moe_weights_t *w = &a->weights;
    const comet_moe_weight_scales_t *sc = &a->weight_scales;
    const void *weights[4] = {w->gate_up, w->gate, w->up, w->down};
    const float *scales[4] = {sc->gate_up, sc->gate, sc->up, sc->down};
    static const char *const names[4] = {"gate_up", "gate", "up", "down"};
    if (moe->cfg.dtype != COMET_DTYPE_FP8_BLOCK) {
        for (int i = 0; i < 4; i++)
            if (scales[i])
                return cometi_fail(err, INVAL, "args.weight_scales.%s = %p: scales are for config.dtype "
                                   "COMET_DTYPE_FP8_BLOCK (this layer is bf16)", names[i], (const void *)scales[i]);
        if (a->x_scales)
            return cometi_fail(err, INVAL, "args.x_scales = %p: scales are for config.dtype COMET_DTYPE_FP8_BLOCK "
                               "(this layer is bf16)", (const void *)a->x_scales);
        return COMET_SUCCESS;
    }
    for (int i = 0; i < 4; i++) {
        if (weights[i] && !scales[i])
            return cometi_fail(err, INVAL, "args.weight_scales.%s is NULL: FP8 weights (config.dtype "
                               "COMET_DTYPE_FP8_BLOCK) need their 128 x 128 block scales", names[i]);
        if (!weights[i] && scales[i])
            return cometi_fail(err, INVAL, "args.weight_scales.%s = %p, but args.weights.%s is NULL", names[i],
                               (const void *)scales[i], names[i]);
        if ((uintptr_t)scales[i] % 16)
            return cometi_fail(err, INVAL, "args.weight_scales.%s = %p: must be 16-byte aligned", names[i],
                               (const void *)scales[i]);
    }
    const int fl = moe->cfg.ffn / moe->tp;
    if (w->gate_up && fl % 128)
        return cometi_fail(err, INVAL, "args.weights.gate_up with FP8 and ffn / tp_size = %d: gate and up in one "
                           "tensor need it a multiple of 128 (a 128 x 128 block would hold rows of both); give gate "
                           "and up apart", fl);
    if ((uintptr_t)a->x_scales % 16)
        return cometi_fail(err, INVAL, "args.x_scales = %p: must be 16-byte aligned", (const void *)a->x_scales);
    return COMET_SUCCESS;
}

comet_status_t cometi_moe_agree(comet_moe_t moe, comet_status_t mine, const char *who, const char *what)
{
    comet_comm_t comm = moe->comm;
    const int word = (int)mine;
    int *all = malloc(sizeof(int) * comm->size);
    comet_status_t st = all ? cometi_allgather_ints(comm, &word, 1, all)
                            : cometi_fail(comm->err, COMET_OUT_OF_MEMORY, "out of host memory");
    if (st != COMET_SUCCESS) snprintf(moe->err, COMETI_ERR_LEN, "%s: %.480s", who, comm->err);
    if (st == COMET_SUCCESS && mine != COMET_SUCCESS) st = mine; /* its message is in moe->err */
    for (int r = 0; st == COMET_SUCCESS && r < comm->size; r++)
        if (all[r] != COMET_SUCCESS)
            st = cometi_fail(moe->err, COMET_REMOTE_ERROR, "%s: rank %d could not %s (%s); every rank refuses this "
                             "call", who, r, what, comet_status_string((comet_status_t)all[r]));
    free(all);
    return st;
}

comet_status_t cometi_moe_check_args(comet_moe_t moe, const comet_moe_args_t *a)
{
    char *err = moe->err;
    const comet_status_t INVAL = COMET_INVALID_ARGUMENT;
    if (!a) return cometi_fail(err, INVAL, "args is NULL");
    if (a->size != sizeof(comet_moe_args_t) || a->magic != COMET_STRUCT_MAGIC)
        return cometi_fail(err, INVAL, "args.size = %zu, args.magic = 0x%x: initialise the struct with "
                           "COMET_MOE_ARGS_INIT", a->size, a->magic);
    if (a->version < 1 || a->version > COMET_API_VERSION)
        return cometi_fail(err, INVAL, "args.version = %u: this library knows 1..%d", a->version, COMET_API_VERSION);
    const comet_moe_weight_scales_t *ws = &a->weight_scales;
    if (a->version < 2 && (ws->gate_up || ws->gate || ws->up || ws->down || a->x_scales))
        return cometi_fail(err, INVAL, "args.version = %u with args.weight_scales or args.x_scales set: those fields "
                           "came in version 2; a version-1 args struct leaves them NULL", a->version);
    if (a->num_tokens < 0 || a->num_tokens > moe->cfg.max_tokens)
        return cometi_fail(err, INVAL, "args.num_tokens = %d: must be 0..config.max_tokens = %d", a->num_tokens,
                           moe->cfg.max_tokens);
    if (a->num_tokens > 0 && (!a->x || !a->topk_ids || !a->topk_weights || !a->y))
        return cometi_fail(err, INVAL, "args.%s is NULL with num_tokens = %d",
                           !a->x ? "x" : !a->topk_ids ? "topk_ids" : !a->topk_weights ? "topk_weights" : "y",
                           a->num_tokens);
    const comet_moe_weights_t *w = &a->weights;
    if (!w->down) return cometi_fail(err, INVAL, "args.weights.down is NULL");
    if (w->gate_up && (w->gate || w->up))
        return cometi_fail(err, INVAL, "args.weights: give gate_up, or gate and up, not both");
    if (!w->gate_up && (!w->gate || !w->up))
        return cometi_fail(err, INVAL, "args.weights.%s is NULL (and gate_up is NULL too)", !w->gate ? "gate" : "up");
    /* 16-byte rows keep every kernel's vector loads aligned. */
    const void *ptrs[] = {a->x, a->y, w->gate_up, w->gate, w->up, w->down};
    const char *names[] = {"x", "y", "weights.gate_up", "weights.gate", "weights.up", "weights.down"};
    for (int i = 0; i < 6; i++)
        if ((uintptr_t)ptrs[i] % 16)
            return cometi_fail(err, INVAL, "args.%s = %p: must be 16-byte aligned", names[i], ptrs[i]);
    if ((uintptr_t)a->topk_ids % 4 || (uintptr_t)a->topk_weights % 4)
        return cometi_fail(err, INVAL, "args.topk_ids and topk_weights must be 4-byte aligned");
    if (a->impl != COMET_IMPL_AUTO && a->impl != COMET_IMPL_BASELINE && a->impl != COMET_IMPL_FUSED)
        return cometi_fail(err, INVAL, "args.impl = %d: must be COMET_IMPL_AUTO, _BASELINE or _FUSED", (int)a->impl);
    return check_fp8_args(moe, a);
}

static comet_status_t moe_forward(comet_moe_t moe, const comet_moe_args_t *args, cudaStream_t stream)
{
    COMETI_TRY(cometi_moe_check_args(moe, args));
    comet_status_t async = cometi_check_sticky(moe->comm);
    if (async != COMET_SUCCESS) return cometi_fail(moe->err, async, "%s", moe->comm->err);
    comet_status_t st;
    if (args->impl == COMET_IMPL_FUSED || (args->impl == COMET_IMPL_AUTO && !moe->fused_unsupported)) {
        st = fused_forward(moe, args, stream);
        /* AUTO on a config the fused path cannot run: the baseline, from now on. */
        if (st != COMET_NOT_SUPPORTED || args->impl == COMET_IMPL_FUSED) {
            if (st == COMET_SUCCESS) st = cometi_cuda(moe->err, cudaGetLastError(), "comet_moe_forward");
            return st;
        }
        moe->err[0] = '\0';
    }
    struct cometi_baseline *b;
    COMETI_TRY(cometi_moe_baseline(moe, &b));
    st = cometi_baseline_forward(moe, b, args, NULL, stream);
    if (st == COMET_SUCCESS) st = cometi_cuda(moe->err, cudaGetLastError(), "comet_moe_forward");
    return st;
}

comet_status_t comet_moe_forward(comet_moe_t moe, const comet_moe_args_t *args, cudaStream_t stream)
{
    if (!moe)
        return cometi_fail(cometi_create_error_buffer(), COMET_INVALID_ARGUMENT, "comet_moe_forward: moe is NULL");
    moe->err[0] = '\0';
    cometi_context_t prev;
    COMETI_TRY(cometi_context_enter(moe->comm->ctx, moe->err, &prev));
    comet_status_t st = moe_forward(moe, args, stream);
    cometi_context_leave(&prev);
    return st;
}
