/*
 * baseline.c - the sequential baseline's host side. Like Megatron-LM, it learns the
 * routing counts on the host (one stream sync per call) to size its NCCL transfers
 * and its per-expert cuBLAS GEMMs. Rows travel straight into the expert-major,
 * BLOCK_M-padded receive layout of plan.h (one NCCL message per (rank, expert) chunk),
 * so no reordering kernel is needed on either side. With TP > 1 (Megatron-LM's expert
 * tensor parallelism): every chunk goes to each TP rank of its expert's group, which runs
 * its ffn / tp columns; each sends its partial output rows back, and the source sums the
 * tp partials of a choice in the weighted top-k sum.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>

#include "baseline/baseline.h"
#include "baseline/rows.h"
#include "comm/route.h"
#include "layer/layer.h"
#include "pointwise/pointwise.h"

/* A rank's message in the count exchange: its rows per expert, its first bad id's index
 * (or -1), its call id. */
#define COUNT_WORDS(E) ((E) + 2)

void cometi_baseline_buffers(const cometi_baseline_t *b, const void **recv, const void **act)
{
    *recv = b->io_recv;
    *act = b->act;
}

static comet_status_t cublas_status(char *err, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return COMET_SUCCESS;
    return cometi_fail(err, s == CUBLAS_STATUS_ALLOC_FAILED ? COMET_OUT_OF_MEMORY : COMET_CUDA_ERROR, "%s: %s",
                       what, cublasGetStatusString(s));
}

void cometi_baseline_destroy(cometi_baseline_t *b)
{
    if (!b) return;
    if (b->cublas) cublasDestroy(b->cublas);
    void *dev[] = {b->counts, b->counts_all, b->pos, b->route_scratch, b->send_pos, b->send_base, b->segs,
                   b->send, b->recv, b->h, b->act, b->out, b->back, b->w_send, b->w_recv, b->dw_recv, b->dw_back};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) cudaFree(dev[i]);
    void *host[] = {b->counts_host, b->send_base_host, b->segs_host};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) cudaFreeHost(host[i]);
    free(b->sends);
    free(b->recvs);
    free(b);
}

comet_status_t cometi_baseline_create(comet_moe_t moe, cometi_baseline_t **out)
{
    char *err = moe->err;
    const comet_moe_config_t *c = &moe->cfg;
    const int W = moe->comm->size, E = c->num_experts, H = c->hidden, F = moe->ffn_local, tp = moe->tp;
    const size_t rows_out = (size_t)c->max_tokens * c->top_k, rows_in = (size_t)moe->max_recv_rows;
    cometi_baseline_t *b = calloc(1, sizeof(*b));
    if (!b) return cometi_fail(err, COMET_OUT_OF_MEMORY, "baseline: out of host memory");
    comet_status_t st;
    struct { void **p; size_t bytes; const char *what; } dev[] = {
        {(void **)&b->counts, sizeof(int32_t) * COUNT_WORDS(E), "counts"},
        {(void **)&b->counts_all, sizeof(int32_t) * W * COUNT_WORDS(E), "counts of all ranks"},
        {(void **)&b->pos, sizeof(int32_t) * rows_out, "positions"},
        {(void **)&b->route_scratch, sizeof(int32_t) * E * cometi_route_chunks((int)rows_out), "route scratch"},
        {(void **)&b->send_pos, sizeof(int32_t) * rows_out, "send positions"},
        {(void **)&b->send_base, sizeof(int32_t) * E, "send offsets"},
        {(void **)&b->segs, sizeof(cometi_segment_t) * moe->experts_per_rank, "segments"},
        {&b->send, 2 * rows_out * H, "send buffer"},
        {&b->recv, 2 * rows_in * H, "receive buffer"},
        {&b->h, 2 * rows_in * 2 * F, "GEMM0 output"},
        {&b->act, 2 * rows_in * F, "SwiGLU output"},
        {&b->out, 2 * rows_in * H, "GEMM1 output"},
        {&b->back, 2 * rows_out * H * tp, "returned rows"},
        {(void **)&b->w_send, sizeof(float) * rows_out, "weights in the send order"},
        {(void **)&b->w_recv, sizeof(float) * rows_in, "received rows' weights"},
        {(void **)&b->dw_recv, sizeof(float) * rows_in, "received rows' weight gradients"},
        {(void **)&b->dw_back, sizeof(float) * rows_out * tp, "returned weight gradients"},
    };
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) {
        char what[96];
        snprintf(what, sizeof(what), "baseline: cudaMalloc(%s, %zu bytes)", dev[i].what, dev[i].bytes);
        COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMalloc(dev[i].p, dev[i].bytes ? dev[i].bytes : 1), what), fail);
    }
    b->sends = malloc(sizeof(cometi_a2a_msg_t) * tp * E);
    b->recvs = malloc(sizeof(cometi_a2a_msg_t) * W * moe->experts_per_rank);
    if (!b->sends || !b->recvs) {
        st = cometi_fail(err, COMET_OUT_OF_MEMORY, "baseline: out of host memory");
        goto fail;
    }
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMallocHost((void **)&b->counts_host, sizeof(int32_t) * W * COUNT_WORDS(E)),
                                    "baseline: cudaMallocHost(counts)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMallocHost((void **)&b->send_base_host, sizeof(int32_t) * E),
                                    "baseline: cudaMallocHost(send offsets)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMallocHost((void **)&b->segs_host,
                                                        sizeof(cometi_segment_t) * moe->experts_per_rank),
                                    "baseline: cudaMallocHost(segments)"), fail);
    COMETI_TRY_GOTO(st, cublas_status(err, cublasCreate(&b->cublas), "cublasCreate"), fail);
    b->io_recv = b->recv, b->io_h = b->h, b->io_send_pos = b->send_pos;
    *out = b;
    return COMET_SUCCESS;
fail:
    cometi_baseline_destroy(b);
    return st;
}

/* All row-major; in cuBLAS's column-major terms C^T = W^T(op T) * A^T: the "TN" case. */
comet_status_t cometi_cublas_rows(cublasHandle_t h, char *err, int rows, int n, int k, const void *a, const void *w,
                                  void *c, int ldc)
{
    const float one = 1.0f, zero = 0.0f;
    return cublas_status(err, cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &one, w, CUDA_R_16BF, k,
                                           a, CUDA_R_16BF, k, &zero, c, CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT),
                         "cublasGemmEx");
}

/* The count exchange, the host's one sync per call: every rank's message (b->counts, E + 2
 * words; the caller wrote the counts and the bad id's index) into b->counts_host, this
 * rank's call id (types.h's COMETI_CALL_*) added here. Forwards and backwards alike
 * make it first, so ranks in different calls meet in the same collective, see it, and
 * all refuse (COMET_INVALID_ARGUMENT) before anything is sent. */
comet_status_t cometi_baseline_exchange(comet_moe_t moe, cometi_baseline_t *b, unsigned int call, cudaStream_t stream)
{
    char *err = moe->err;
    const int W = moe->comm->size, E = moe->cfg.num_experts, words = COUNT_WORDS(E);
    /* Pageable: staged at once, so the local may go out of scope. */
    COMETI_TRY(cometi_cuda(err, cudaMemcpyAsync(b->counts + E + 1, &call, sizeof(call), cudaMemcpyHostToDevice, stream),
                           "copy the call id"));
    COMETI_TRY(cometi_nccl(err, ncclAllGather(b->counts, b->counts_all, words, ncclInt32, moe->comm->nccl, stream),
                           "ncclAllGather(routing counts)"));
    COMETI_TRY(cometi_cuda(err, cudaMemcpyAsync(b->counts_host, b->counts_all, sizeof(int32_t) * W * words,
                                                cudaMemcpyDeviceToHost, stream), "copy counts to host"));
    COMETI_TRY(cometi_cuda(err, cudaStreamSynchronize(stream), "baseline: sync for routing counts"));
    for (int r = 0; r < W; r++) {
        const unsigned int theirs = (unsigned int)b->counts_host[(size_t)r * words + E + 1];
        if (theirs == call) continue;
        char there[96], here[96];
        cometi_call_text(theirs, there, sizeof(there));
        cometi_call_text(call, here, sizeof(here));
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "rank %d: the routing-count exchange found rank %d in another "
                           "call: %s there, %s here. Every rank makes the same calls in the same order: the "
                           "backward of the same forward call (the same layer's, the same step's saved state), "
                           "saved states of the same max_recv_rows. Nothing was sent; every rank refused this call",
                           moe->comm->rank, r, there, here);
    }
    return COMET_SUCCESS;
}

static comet_status_t mark(comet_moe_t moe, int which, cudaStream_t stream)
{
    if (!moe->marks) return COMET_SUCCESS;
    return cometi_cuda(moe->err, cudaEventRecord(moe->marks[which], stream), "cudaEventRecord(phase mark)");
}

#define BF16 2

/* GEMM0 (gate and up), SwiGLU, GEMM1: one cuBLAS call per expert and matrix, on the
 * segments of the last forward call (the ACTIVATED mark between SwiGLU and GEMM1). */
comet_status_t cometi_baseline_experts(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       cudaStream_t stream)
{
    char *err = moe->err;
    const int per = moe->experts_per_rank, H = moe->cfg.hidden, F = moe->ffn_local;
    COMETI_TRY(cublas_status(err, cublasSetStream(b->cublas, stream), "cublasSetStream"));
    for (int le = 0; le < per; le++) {
        const int rows = b->segs_host[le].rows;
        if (!rows) continue;
        const char *a = (const char *)b->io_recv + (size_t)b->segs_host[le].start * H * BF16;
        char *h = (char *)b->io_h + (size_t)b->segs_host[le].start * 2 * F * BF16;
        if (args->weights.gate_up) {
            const char *w = (const char *)args->weights.gate_up + (size_t)le * 2 * F * H * BF16;
            COMETI_TRY(cometi_cublas_rows(b->cublas, err, rows, 2 * F, H, a, w, h, 2 * F));
        } else {
            const char *wg = (const char *)args->weights.gate + (size_t)le * F * H * BF16;
            const char *wu = (const char *)args->weights.up + (size_t)le * F * H * BF16;
            COMETI_TRY(cometi_cublas_rows(b->cublas, err, rows, F, H, a, wg, h, 2 * F));
            COMETI_TRY(cometi_cublas_rows(b->cublas, err, rows, F, H, a, wu, h + (size_t)F * BF16, 2 * F));
        }
    }
    COMETI_TRY(cometi_cuda(err, cometi_launch_swiglu(b->io_h, b->act, F, b->segs, per, b->max_seg_rows, stream),
                           "launch swiglu_kernel"));
    COMETI_TRY(mark(moe, COMETI_MARK_ACTIVATED, stream));
    for (int le = 0; le < per; le++) {
        const int rows = b->segs_host[le].rows;
        if (!rows) continue;
        const char *a = (const char *)b->act + (size_t)b->segs_host[le].start * F * BF16;
        const char *w = (const char *)args->weights.down + (size_t)le * H * F * BF16;
        char *o = (char *)b->out + (size_t)b->segs_host[le].start * H * BF16;
        COMETI_TRY(cometi_cublas_rows(b->cublas, err, rows, H, F, a, w, o, H));
    }
    return COMET_SUCCESS;
}

/* The rest of what the backward needs, once the forward's rows are in `saved`: the
 * routing (its messages and segments, each choice's place) and the routing weights. */
static comet_status_t save_routing(comet_moe_t moe, const cometi_baseline_t *b, const comet_moe_args_t *args,
                                   comet_moe_saved_t saved, int n_sends, int n_recvs, cudaStream_t stream)
{
    const int n = args->num_tokens * moe->cfg.top_k, per = moe->experts_per_rank;
    if (n)
        COMETI_TRY(cometi_cuda(moe->err, cudaMemcpyAsync(saved->weights, args->topk_weights, sizeof(float) * n,
                                                         cudaMemcpyDeviceToDevice, stream), "save topk_weights"));
    COMETI_TRY(cometi_cuda(moe->err, cudaMemcpyAsync(saved->segs, b->segs, sizeof(cometi_segment_t) * per,
                                                     cudaMemcpyDeviceToDevice, stream), "save segments"));
    memcpy(saved->segs_host, b->segs_host, sizeof(cometi_segment_t) * per);
    memcpy(saved->sends, b->sends, sizeof(cometi_a2a_msg_t) * n_sends);
    memcpy(saved->recvs, b->recvs, sizeof(cometi_a2a_msg_t) * n_recvs);
    saved->n_sends = n_sends;
    saved->n_recvs = n_recvs;
    saved->max_seg_rows = b->max_seg_rows;
    saved->num_tokens = args->num_tokens;
    saved->path = COMETI_SAVED_SEQUENTIAL;
    saved->filled = 1;
    return COMET_SUCCESS;
}

comet_status_t cometi_baseline_forward(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       comet_moe_saved_t saved, cudaStream_t stream)
{
    char *err = moe->err;
    const comet_moe_config_t *c = &moe->cfg;
    const int W = moe->comm->size, me = moe->comm->rank, E = c->num_experts, per = moe->experts_per_rank;
    const int H = c->hidden, k = c->top_k, m = args->num_tokens, n = m * k;
    ncclComm_t nccl = moe->comm->nccl;
    comet_status_t st;

    b->io_recv = saved && saved->recv ? saved->recv : b->recv; /* none kept where the config resends x */
    b->io_h = saved ? saved->h : b->h;
    b->io_send_pos = saved ? saved->send_pos : b->send_pos;
    if (saved) saved->filled = 0; /* until this call has enqueued all of its work */
    COMETI_TRY(mark(moe, COMETI_MARK_START, stream));
    /* 1. Route: counts per expert and stable positions; every rank learns all counts,
     * and whether any rank passed a bad expert id, so all of them stop together. */
    COMETI_TRY(cometi_cuda(err, cometi_launch_route(args->topk_ids, n, E, b->counts, b->pos,
                                                    (unsigned int *)(b->counts + E), b->route_scratch, stream),
                           "launch route_kernel"));
    const unsigned int call = saved ? COMETI_CALL_TRAIN_FORWARD | (unsigned int)(saved->max_recv_rows %
                                                                                 COMETI_CALL_TRAIN_FORWARD) : 0;
    COMETI_TRY(cometi_baseline_exchange(moe, b, call, stream));
    for (int r = 0; r < W; r++) {
        int32_t first_bad = b->counts_host[(size_t)r * COUNT_WORDS(E) + E];
        if (first_bad < 0) continue;
        if (r != me)
            return cometi_fail(err, COMET_REMOTE_ERROR, "rank %d passed an expert id out of [0, %d) "
                               "(topk_ids[%d][%d]); no rank ran the layer", r, E, first_bad / k, first_bad % k);
        int32_t bad_id = 0;
        COMETI_TRY(cometi_cuda(err, cudaMemcpy(&bad_id, args->topk_ids + first_bad, sizeof(int32_t),
                                               cudaMemcpyDeviceToHost), "read the bad expert id"));
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "topk_ids[%d][%d] = %d on rank %d: expert ids must be in "
                           "[0, num_experts = %d)", first_bad / k, first_bad % k, bad_id, me, E);
    }
    int64_t *counts = malloc(sizeof(int64_t) * W * E);
    if (!counts) return cometi_fail(err, COMET_OUT_OF_MEMORY, "baseline: out of host memory");
    for (int r = 0; r < W; r++)
        for (int e = 0; e < E; e++) counts[(size_t)r * E + e] = b->counts_host[(size_t)r * COUNT_WORDS(E) + e];
    cometi_route_plan_t plan;
    int bad = cometi_route_plan_build(&plan, counts, W, moe->tp, E, COMETI_BLOCK_M, err, COMETI_ERR_LEN);
    free(counts);
    if (bad) return COMET_INTERNAL_ERROR;
    if (saved) { /* every rank sees every group's rows, so all refuse together */
        for (int g = 0; g < plan.groups; g++) {
            int64_t rows = 0;
            for (int le = 0; le < per; le++) rows += plan.seg_rows[(size_t)g * per + le];
            if (rows > saved->max_recv_rows) {
                st = cometi_fail(err, COMET_INVALID_ARGUMENT, "this call routes %lld rows to the ranks of EP group %d: "
                                 "more than the saved state's max_recv_rows = %lld; create it with a larger bound "
                                 "(0: the worst case)", (long long)rows, g, (long long)saved->max_recv_rows);
                goto out;
            }
        }
    }
    int max_seg_rows = 0;
    for (int e = 0; e < E; e++) b->send_base_host[e] = (int32_t)plan.send_offset[(size_t)me * E + e];
    for (int le = 0; le < per; le++) {
        int e = moe->first_expert + le;
        b->segs_host[le].start = (int)plan.seg_start[e];
        b->segs_host[le].rows = (int)plan.seg_rows[e];
        if (plan.seg_rows[e] > max_seg_rows) max_seg_rows = (int)plan.seg_rows[e];
    }
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMemcpyAsync(b->send_base, b->send_base_host, sizeof(int32_t) * E,
                                                         cudaMemcpyHostToDevice, stream), "copy send offsets"), out);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMemcpyAsync(b->segs, b->segs_host, sizeof(cometi_segment_t) * per,
                                                         cudaMemcpyHostToDevice, stream), "copy segments"), out);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cometi_launch_permute(args->x, args->topk_ids, b->pos, b->send_base, n, k,
                                                               H, b->send, b->io_send_pos, stream),
                                    "launch permute_kernel"), out);
    COMETI_TRY_GOTO(st, mark(moe, COMETI_MARK_ROUTED, stream), out);

    /* 2. Dispatch: one message per (peer, expert) chunk, straight into the padded
     * expert-major layout, each chunk to every TP rank of its group. Both sides post a
     * pair's chunks in expert order, which is how NCCL matches them (plan.h). */
    int n_sends, n_recvs;
    cometi_route_dispatch_messages(&plan, me, b->sends, &n_sends, b->recvs, &n_recvs);
    const size_t back_stride = (size_t)c->max_tokens * k * H; /* elements between TP ranks' copies */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_sends && r == ncclSuccess; i++)
        r = ncclSend((char *)b->send + b->sends[i].offset * H * BF16, (size_t)b->sends[i].rows * H,
                     ncclBfloat16, b->sends[i].peer, nccl, stream);
    for (int i = 0; i < n_recvs && r == ncclSuccess; i++)
        r = ncclRecv((char *)b->io_recv + b->recvs[i].offset * H * BF16, (size_t)b->recvs[i].rows * H,
                     ncclBfloat16, b->recvs[i].peer, nccl, stream);
    ncclResult_t end = ncclGroupEnd(); /* always close the group, even after a failed post */
    COMETI_TRY_GOTO(st, cometi_nccl(err, r != ncclSuccess ? r : end, "dispatch all-to-all"), out);
    COMETI_TRY_GOTO(st, mark(moe, COMETI_MARK_DISPATCHED, stream), out);

    /* 3. Experts. */
    b->max_seg_rows = max_seg_rows;
    COMETI_TRY_GOTO(st, cometi_baseline_experts(moe, b, args, stream), out);
    COMETI_TRY_GOTO(st, mark(moe, COMETI_MARK_COMPUTED, stream), out);

    /* 4. Return: the same messages the other way; each chunk lands where it left from, in
     * the copy of the TP rank that computed it. */
    r = ncclGroupStart();
    for (int i = 0; i < n_recvs && r == ncclSuccess; i++)
        r = ncclSend((char *)b->out + b->recvs[i].offset * H * BF16, (size_t)b->recvs[i].rows * H,
                     ncclBfloat16, b->recvs[i].peer, nccl, stream);
    for (int i = 0; i < n_sends && r == ncclSuccess; i++)
        r = ncclRecv((char *)b->back + ((size_t)(b->sends[i].peer % moe->tp) * back_stride +
                                        (size_t)b->sends[i].offset * H) * BF16,
                     (size_t)b->sends[i].rows * H, ncclBfloat16, b->sends[i].peer, nccl, stream);
    end = ncclGroupEnd();
    COMETI_TRY_GOTO(st, cometi_nccl(err, r != ncclSuccess ? r : end, "combine all-to-all"), out);
    COMETI_TRY_GOTO(st, mark(moe, COMETI_MARK_RETURNED, stream), out);

    /* 5. Weighted top-k sum. */
    COMETI_TRY_GOTO(st, cometi_cuda(err, cometi_launch_combine(b->back, moe->tp, back_stride, b->io_send_pos,
                                                               args->topk_weights, m, k, H, args->y, stream), "launch combine_kernel"), out);
    COMETI_TRY_GOTO(st, mark(moe, COMETI_MARK_END, stream), out);
    if (saved) COMETI_TRY_GOTO(st, save_routing(moe, b, args, saved, n_sends, n_recvs, stream), out);
out:
    cometi_route_plan_free(&plan);
    return st;
}
