/*
 * baseline.c - the sequential baseline's host side. Like Megatron-LM, it learns the
 * routing counts on the host (one stream sync per call) to size its NCCL transfers
 * and its per-expert cuBLAS GEMMs. Rows travel straight into the expert-major,
 * BLOCK_M-padded receive layout of plan.h (one NCCL message per (rank, expert) chunk),
 * so no reordering kernel is needed on either side. With TP > 1 (Megatron-LM's expert
 * tensor parallelism): every chunk goes to each TP rank of its expert's group, which runs
 * its ffn / tp columns; each sends its partial output rows back, and the source sums the
 * tp partials of a choice in the weighted top-k sum.
 *
 * With block-scaled FP8 (config.dtype COMET_DTYPE_FP8_BLOCK, the inference forward) the
 * same steps move and multiply E4M3 rows: x quantized once per token (1 x 128 blocks) where
 * it comes in bf16, each row's values and scales permuted into the send order and sent as
 * two messages per chunk, the received scales relaid into the packed-by-group layout
 * cuBLASLt reads (blaslt_fp8.h), cuBLASLt's block-scaled GEMM0 (bf16 out), SwiGLU, the
 * activation quantized per expert straight into that layout, cuBLASLt's GEMM1 (bf16 out),
 * and from there on the bf16 path's return and sum.
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
    cometi_baseline_fp8_train_free(b);
    if (b->cublas) cublasDestroy(b->cublas);
    cometi_blaslt_fp8_destroy(b->lt);
    void *dev[] = {b->counts, b->counts_all, b->pos, b->route_scratch, b->send_pos, b->send_base, b->segs,
                   b->send, b->recv, b->h, b->act, b->out, b->back, b->w_send, b->w_recv, b->dw_recv, b->dw_back,
                   b->xq, b->xs, b->send_q, b->send_s, b->recv_q, b->recv_s, b->a0_scales, b->act_q,
                   b->a1_scales, b->w0_scales, b->w1_scales, b->groups};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) cudaFree(dev[i]);
    void *host[] = {b->counts_host, b->send_base_host, b->segs_host, b->groups_host};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) cudaFreeHost(host[i]);
    free(b->sends);
    free(b->recvs);
    free(b->lt_start);
    free(b->lt_rows);
    free(b);
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/*
 * The buffers of the config's dtype (baseline.h), sized for the worst routing. With
 * rows_out = max_tokens x top_k, rows_in = max_recv_rows, F = ffn / tp, every dtype holds
 * h 4F rows_in, act 2F rows_in, out 2H rows_in and back 2H tp rows_out bytes, the
 * backward's routing weights 4 (1 + tp) rows_out + 8 rows_in, and
 *   bf16:  send 2H rows_out + recv 2H rows_in, and cuBLAS's handle;
 *   FP8:   (H + 4 L0)(max_tokens + rows_out + rows_in) for x quantized, sent and received,
 *          4 L0 rows_in + (F + 4 L1) rows_in for GEMM0's A scales and the activation
 *          quantized with its scales (L0 = ceil(H / 128), L1 = ceil(F / 128); the packed
 *          scales' padded rows never outnumber the receive layout's), the weights' padded
 *          scales 4 E_local (2 ceil(F / 128) L4(H) + ceil(H / 128) L4(F)), and cuBLASLt's
 *          handle with its 32 MiB workspace.
 * Per row received, FP8 thus holds about 3H + 7F bytes against bf16's 4H + 6F (the bf16
 * h and act stay: cuBLASLt's block-scaled GEMMs write bf16 alone), and sends H + 4 L0
 * bytes per row where bf16 sends 2H.
 */
comet_status_t cometi_baseline_create(comet_moe_t moe, cometi_baseline_t **out)
{
    char *err = moe->err;
    const comet_moe_config_t *c = &moe->cfg;
    const int W = moe->comm->size, E = c->num_experts, H = c->hidden, F = moe->ffn_local, tp = moe->tp;
    const int per = moe->experts_per_rank, fp8 = c->dtype == COMET_DTYPE_FP8_BLOCK, bf16 = !fp8;
    const size_t rows_out = (size_t)c->max_tokens * c->top_k, rows_in = (size_t)moe->max_recv_rows;
    const size_t L0 = (size_t)ceil_div(H, 128), L1 = (size_t)ceil_div(F, 128);
    cometi_baseline_t *b = calloc(1, sizeof(*b));
    if (!b) return cometi_fail(err, COMET_OUT_OF_MEMORY, "baseline: out of host memory");
    comet_status_t st;
    /* `use` 0: not this dtype's; left NULL. */
    struct { void **p; size_t bytes; int use; const char *what; } dev[] = {
        {(void **)&b->counts, sizeof(int32_t) * COUNT_WORDS(E), 1, "counts"},
        {(void **)&b->counts_all, sizeof(int32_t) * W * COUNT_WORDS(E), 1, "counts of all ranks"},
        {(void **)&b->pos, sizeof(int32_t) * rows_out, 1, "positions"},
        {(void **)&b->route_scratch, sizeof(int32_t) * E * cometi_route_chunks((int)rows_out), 1, "route scratch"},
        {(void **)&b->send_pos, sizeof(int32_t) * rows_out, 1, "send positions"},
        {(void **)&b->send_base, sizeof(int32_t) * E, 1, "send offsets"},
        {(void **)&b->segs, sizeof(cometi_segment_t) * per, 1, "segments"},
        {&b->send, 2 * rows_out * H, bf16, "send buffer"},
        {&b->recv, 2 * rows_in * H, bf16, "receive buffer"},
        {&b->h, 2 * rows_in * 2 * F, 1, "GEMM0 output"},
        {&b->act, 2 * rows_in * F, 1, "SwiGLU output"},
        {&b->out, 2 * rows_in * H, 1, "GEMM1 output"},
        {&b->back, 2 * rows_out * H * tp, 1, "returned rows"},
        {(void **)&b->w_send, sizeof(float) * rows_out, 1, "weights in the send order"},
        {(void **)&b->w_recv, sizeof(float) * rows_in, 1, "received rows' weights"},
        {(void **)&b->dw_recv, sizeof(float) * rows_in, 1, "received rows' weight gradients"},
        {(void **)&b->dw_back, sizeof(float) * rows_out * tp, 1, "returned weight gradients"},
        {&b->xq, (size_t)c->max_tokens * H, fp8, "x in FP8"},
        {(void **)&b->xs, sizeof(float) * c->max_tokens * L0, fp8, "x's scales"},
        {&b->send_q, rows_out * H, fp8, "FP8 send buffer"},
        {(void **)&b->send_s, sizeof(float) * rows_out * L0, fp8, "sent scales"},
        {&b->recv_q, rows_in * H, fp8, "FP8 receive buffer"},
        {(void **)&b->recv_s, sizeof(float) * rows_in * L0, fp8, "received scales"},
        {(void **)&b->a0_scales, sizeof(float) * rows_in * L0, fp8, "GEMM0's packed scales"},
        {&b->act_q, rows_in * F, fp8, "SwiGLU output in FP8"},
        {(void **)&b->a1_scales, sizeof(float) * rows_in * L1, fp8, "GEMM1's packed scales"},
        {(void **)&b->w0_scales, sizeof(float) * per * 2 * ceil_div(F, 128) * cometi_blaslt_fp8_b_scale_ld(H), fp8,
         "gate and up's padded scales"},
        {(void **)&b->w1_scales, sizeof(float) * per * ceil_div(H, 128) * cometi_blaslt_fp8_b_scale_ld(F), fp8,
         "down's padded scales"},
        {(void **)&b->groups, sizeof(cometi_fp8_group_t) * per, fp8, "FP8 groups"},
    };
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) {
        if (!dev[i].use) continue;
        char what[96];
        snprintf(what, sizeof(what), "baseline: cudaMalloc(%s, %zu bytes)", dev[i].what, dev[i].bytes);
        COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMalloc(dev[i].p, dev[i].bytes ? dev[i].bytes : 1), what), fail);
    }
    b->sends = malloc(sizeof(cometi_a2a_msg_t) * tp * E);
    b->recvs = malloc(sizeof(cometi_a2a_msg_t) * W * per);
    if (fp8) {
        b->lt_start = malloc(sizeof(int64_t) * (per + 1));
        b->lt_rows = malloc(sizeof(int64_t) * (per + 1));
    }
    if (!b->sends || !b->recvs || (fp8 && (!b->lt_start || !b->lt_rows))) {
        st = cometi_fail(err, COMET_OUT_OF_MEMORY, "baseline: out of host memory");
        goto fail;
    }
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMallocHost((void **)&b->counts_host, sizeof(int32_t) * W * COUNT_WORDS(E)),
                                    "baseline: cudaMallocHost(counts)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMallocHost((void **)&b->send_base_host, sizeof(int32_t) * E),
                                    "baseline: cudaMallocHost(send offsets)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMallocHost((void **)&b->segs_host, sizeof(cometi_segment_t) * per),
                                    "baseline: cudaMallocHost(segments)"), fail);
    if (fp8) {
        COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMallocHost((void **)&b->groups_host, sizeof(cometi_fp8_group_t) * per),
                                        "baseline: cudaMallocHost(FP8 groups)"), fail);
        /* COMET_NOT_SUPPORTED off Hopper or before cuBLAS 12.9: on every rank alike, before
         * any rank has sent anything. */
        COMETI_TRY_GOTO(st, cometi_blaslt_fp8_create(err, &b->lt), fail);
    } else {
        COMETI_TRY_GOTO(st, cublas_status(err, cublasCreate(&b->cublas), "cublasCreate"), fail);
    }
    b->io_recv = fp8 ? b->recv_q : b->recv, b->io_recv_s = b->recv_s, b->io_h = b->h, b->io_send_pos = b->send_pos;
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

/* B's scales as cuBLASLt reads them: the caller's where each row of k blocks is already a
 * multiple of 4 long, else padded into `room` (a few floats per 128 x 128 block: per call). */
comet_status_t cometi_baseline_weight_scales(comet_moe_t moe, int n, int k, const float *given, float *room,
                                             const float **out, cudaStream_t stream)
{
    *out = given;
    if (cometi_blaslt_fp8_b_scale_ld(k) == ceil_div(k, 128)) return COMET_SUCCESS;
    *out = room;
    return cometi_blaslt_fp8_pad_b_scales(moe->err, moe->experts_per_rank, n, k, given, room, stream);
}

comet_status_t cometi_baseline_dispatch(comet_moe_t moe, const cometi_a2a_msg_t *sends, int n_sends,
                                        const cometi_a2a_msg_t *recvs, int n_recvs, const cometi_row_part_t *parts,
                                        int nparts, cudaStream_t stream, const char *what)
{
    ncclComm_t nccl = moe->comm->nccl;
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_sends; i++)
        for (int j = 0; j < nparts && r == ncclSuccess; j++) {
            const cometi_row_part_t *pt = &parts[j];
            r = ncclSend((const char *)pt->send + (size_t)sends[i].offset * pt->per_row * pt->elem,
                         (size_t)sends[i].rows * pt->per_row, pt->type, sends[i].peer, nccl, stream);
        }
    for (int i = 0; i < n_recvs; i++)
        for (int j = 0; j < nparts && r == ncclSuccess; j++) {
            const cometi_row_part_t *pt = &parts[j];
            r = ncclRecv((char *)pt->recv + (size_t)recvs[i].offset * pt->per_row * pt->elem,
                         (size_t)recvs[i].rows * pt->per_row, pt->type, recvs[i].peer, nccl, stream);
        }
    const ncclResult_t end = ncclGroupEnd(); /* always close the group, even after a failed post */
    return cometi_nccl(moe->err, r != ncclSuccess ? r : end, what);
}

comet_status_t cometi_baseline_fp8_groups(comet_moe_t moe, cometi_baseline_t *b, const cometi_segment_t *segs_host,
                                          void *q, const float *scales, int *max_padded, cudaStream_t stream)
{
    int64_t before = 0;
    *max_padded = 0;
    for (int le = 0; le < moe->experts_per_rank; le++) {
        const cometi_segment_t seg = segs_host[le];
        const int padded = (int)cometi_blaslt_fp8_group_rows(seg.rows);
        b->groups_host[le] = (cometi_fp8_group_t){seg.start, seg.rows, padded, 0, before};
        b->lt_start[le] = seg.start, b->lt_rows[le] = seg.rows;
        before += padded;
        if (padded > *max_padded) *max_padded = padded;
    }
    COMETI_TRY(cometi_cuda(moe->err, cudaMemcpyAsync(b->groups, b->groups_host,
                                                     sizeof(cometi_fp8_group_t) * moe->experts_per_rank,
                                                     cudaMemcpyHostToDevice, stream), "copy the FP8 groups"));
    const int H = moe->cfg.hidden, L0 = (int)ceil_div(H, 128);
    return cometi_cuda(moe->err, cometi_launch_fp8_pack_groups(b->groups, moe->experts_per_rank, *max_padded, scales,
                                                               L0, 1, L0, q, H, b->a0_scales, stream),
                       "launch fp8_pack_groups_kernel (the received rows' scales)");
}

/* The FP8 expert phase on the last forward's segments: the received scales packed by group
 * (the padding rows' values and scales zeroed), cuBLASLt GEMM0 per expert into h (bf16;
 * gate and up apart: two GEMMs into h's halves), SwiGLU, the activation quantized per
 * expert into GEMM1's packed layout (row stride 1, block stride the group's padded rows:
 * blaslt_fp8.h), cuBLASLt GEMM1 into out (bf16). */
static comet_status_t experts_fp8(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                  cudaStream_t stream)
{
    char *err = moe->err;
    const int per = moe->experts_per_rank, H = moe->cfg.hidden, F = moe->ffn_local;
    const int L1 = (int)ceil_div(F, 128), pow2 = moe->cfg.fp8_pow2_scales;
    const comet_moe_weights_t *w = &args->weights;
    const comet_moe_weight_scales_t *ws = &args->weight_scales;
    int max_padded = 0;
    COMETI_TRY(cometi_baseline_fp8_groups(moe, b, b->segs_host, b->io_recv, b->io_recv_s, &max_padded, stream));
    const float *s0, *s1;
    if (w->gate_up) {
        COMETI_TRY(cometi_baseline_weight_scales(moe, 2 * F, H, ws->gate_up, b->w0_scales, &s0, stream));
        COMETI_TRY(cometi_blaslt_fp8_grouped(err, b->lt, per, b->lt_start, b->lt_rows, 2 * F, H, b->io_recv,
                                             b->a0_scales, w->gate_up, s0, b->io_h, 2 * F, stream));
    } else {
        const size_t half = (size_t)per * ceil_div(F, 128) * cometi_blaslt_fp8_b_scale_ld(H);
        COMETI_TRY(cometi_baseline_weight_scales(moe, F, H, ws->gate, b->w0_scales, &s0, stream));
        COMETI_TRY(cometi_baseline_weight_scales(moe, F, H, ws->up, b->w0_scales + half, &s1, stream));
        COMETI_TRY(cometi_blaslt_fp8_grouped(err, b->lt, per, b->lt_start, b->lt_rows, F, H, b->io_recv,
                                             b->a0_scales, w->gate, s0, b->io_h, 2 * F, stream));
        COMETI_TRY(cometi_blaslt_fp8_grouped(err, b->lt, per, b->lt_start, b->lt_rows, F, H, b->io_recv,
                                             b->a0_scales, w->up, s1, (uint16_t *)b->io_h + F, 2 * F, stream));
    }
    /* A training forward keeping [g u] in E4M3: each row 1 x 128, scales MN-major (row r's
     * block c at keep_h_scales[c x keep_h_ld + r]), as the fused epilogue keeps them. */
    for (int le = 0; b->keep_h && le < per; le++) {
        const cometi_fp8_group_t g = b->groups_host[le];
        if (!g.rows) continue;
        COMETI_TRY(cometi_cuda(err, cometi_quantize_rows_e4m3((const uint16_t *)b->io_h + (size_t)g.start * 2 * F,
                                                              g.rows, 2 * F, 2 * F,
                                                              (uint8_t *)b->keep_h + (size_t)g.start * 2 * F, 2 * F,
                                                              b->keep_h_scales + g.start, 1, b->keep_h_ld, pow2,
                                                              stream),
                               "launch quantize_rows_kernel ([g u] kept in E4M3)"));
    }
    COMETI_TRY(cometi_cuda(err, cometi_launch_swiglu(b->io_h, b->act, F, b->segs, per, b->max_seg_rows, stream),
                           "launch swiglu_kernel"));
    for (int le = 0; le < per; le++) {
        const cometi_fp8_group_t g = b->groups_host[le];
        if (!g.rows) continue;
        COMETI_TRY(cometi_cuda(err, cometi_quantize_rows_e4m3((const uint16_t *)b->act + (size_t)g.start * F, g.rows, F,
                                                              F, (uint8_t *)b->act_q + (size_t)g.start * F, F,
                                                              b->a1_scales + g.before * L1, 1, g.padded, pow2, stream),
                               "launch quantize_rows_kernel (the activation)"));
    }
    COMETI_TRY(cometi_cuda(err, cometi_launch_fp8_pack_groups(b->groups, per, max_padded, NULL, 0, 0, L1, b->act_q, F,
                                                              b->a1_scales, stream), "launch fp8_pack_groups_kernel"));
    COMETI_TRY(mark(moe, COMETI_MARK_ACTIVATED, stream));
    COMETI_TRY(cometi_baseline_weight_scales(moe, H, F, ws->down, b->w1_scales, &s1, stream));
    return cometi_blaslt_fp8_grouped(err, b->lt, per, b->lt_start, b->lt_rows, H, F, b->act_q, b->a1_scales, w->down,
                                     s1, b->out, H, stream);
}

comet_status_t cometi_baseline_injected_failure(comet_moe_t moe, cometi_baseline_t *b)
{
    if (!b->fail_experts) return COMET_SUCCESS;
    b->fail_experts = 0;
    return cometi_fail(moe->err, COMET_CUDA_ERROR, "baseline: the expert phase failed (injected by a test)");
}

void cometi_baseline_poison_returned(comet_moe_t moe, void *const *bufs, const size_t *bytes, int n, char *kept,
                                     cudaStream_t stream)
{
    snprintf(kept, COMETI_ERR_LEN, "%s", moe->err);
    for (int i = 0; i < n; i++)
        if (bufs[i] && bytes[i]) cudaMemsetAsync(bufs[i], 0xff, bytes[i], stream); /* a failure here shows after */
}

comet_status_t cometi_baseline_failed_after_return(comet_moe_t moe, comet_status_t st, const char *kept)
{
    snprintf(moe->err, COMETI_ERR_LEN, "%s", kept);
    return st;
}

/* GEMM0 (gate and up), SwiGLU, GEMM1: one cuBLAS call per expert and matrix, on the
 * segments of the last forward call (the ACTIVATED mark between SwiGLU and GEMM1); FP8
 * configs run experts_fp8. */
comet_status_t cometi_baseline_experts(comet_moe_t moe, cometi_baseline_t *b, const comet_moe_args_t *args,
                                       cudaStream_t stream)
{
    COMETI_TRY(cometi_baseline_injected_failure(moe, b));
    if (moe->cfg.dtype == COMET_DTYPE_FP8_BLOCK) return experts_fp8(moe, b, args, stream);
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

    const int fp8 = c->dtype == COMET_DTYPE_FP8_BLOCK, L0 = (int)ceil_div(H, 128); /* FP8: scales per row */
    if (saved && fp8) { /* the backward's workspaces, agreed on by every rank before any row moves */
        COMETI_TRY(cometi_baseline_fp8_train_get(moe, b));
    }
    b->io_recv = saved && saved->recv ? saved->recv : fp8 ? b->recv_q : b->recv; /* none kept where the config resends x */
    /* FP8 rows kept: their values, then their scales, in the saved state's row bytes. */
    b->io_recv_s = saved && saved->recv && fp8 ? (float *)((uint8_t *)saved->recv + (size_t)saved->cap_rows * H)
                                               : b->recv_s;
    const int keep_e4m3 = saved && saved->h_scales; /* [g u] kept in E4M3: GEMM0 writes bf16 h first */
    b->io_h = saved && !keep_e4m3 ? saved->h : b->h;
    b->keep_h = keep_e4m3 ? saved->h : NULL;
    b->keep_h_scales = keep_e4m3 ? saved->h_scales : NULL;
    b->keep_h_ld = keep_e4m3 ? saved->cap_rows : 0;
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
    if (fp8) { /* each token quantized once, where it comes in bf16; then its rows and scales permuted */
        const void *xq = args->x;
        const float *xs = args->x_scales;
        if (!xs) {
            COMETI_TRY_GOTO(st, cometi_cuda(err, cometi_quantize_rows_e4m3(args->x, m, H, H, b->xq, H, b->xs, L0, 1,
                                                                           c->fp8_pow2_scales, stream),
                                            "launch quantize_rows_kernel (x)"), out);
            xq = b->xq, xs = b->xs;
        }
        COMETI_TRY_GOTO(st, cometi_cuda(err, cometi_launch_permute_fp8(xq, xs, args->topk_ids, b->pos, b->send_base, n,
                                                                       k, H, L0, b->send_q, b->send_s, b->io_send_pos,
                                                                       stream),
                                        "launch permute_fp8_kernel"), out);
    } else {
        COMETI_TRY_GOTO(st, cometi_cuda(err, cometi_launch_permute(args->x, args->topk_ids, b->pos, b->send_base, n, k,
                                                                   H, b->send, b->io_send_pos, stream),
                                        "launch permute_kernel"), out);
    }
    COMETI_TRY_GOTO(st, mark(moe, COMETI_MARK_ROUTED, stream), out);

    /* 2. Dispatch: one message per (peer, expert) chunk, straight into the padded
     * expert-major layout, each chunk to every TP rank of its group. Both sides post a
     * pair's chunks in expert order, which is how NCCL matches them (plan.h). FP8: two
     * messages per chunk, its E4M3 rows and then their scales, both sides in that order. */
    int n_sends, n_recvs;
    cometi_route_dispatch_messages(&plan, me, b->sends, &n_sends, b->recvs, &n_recvs);
    const size_t back_stride = (size_t)c->max_tokens * k * H; /* elements between TP ranks' copies */
    const cometi_row_part_t rows_bf16[1] = {{b->send, b->io_recv, (size_t)H, BF16, ncclBfloat16}},
                            rows_fp8[2] = {{b->send_q, b->io_recv, (size_t)H, 1, ncclUint8},
                                           {b->send_s, b->io_recv_s, (size_t)L0, 4, ncclFloat32}};
    COMETI_TRY_GOTO(st, cometi_baseline_dispatch(moe, b->sends, n_sends, b->recvs, n_recvs, fp8 ? rows_fp8 : rows_bf16,
                                                 fp8 ? 2 : 1, stream, "dispatch all-to-all"), out);
    COMETI_TRY_GOTO(st, mark(moe, COMETI_MARK_DISPATCHED, stream), out);

    /* 3. Experts. A failure here still takes part in the return, with poisoned rows. */
    b->max_seg_rows = max_seg_rows;
    comet_status_t experts = cometi_baseline_experts(moe, b, args, stream);
    if (experts == COMET_SUCCESS) experts = mark(moe, COMETI_MARK_COMPUTED, stream);
    char kept[COMETI_ERR_LEN];
    if (experts != COMET_SUCCESS) {
        void *const bufs[1] = {b->out};
        const size_t bytes[1] = {(size_t)moe->max_recv_rows * H * BF16};
        cometi_baseline_poison_returned(moe, bufs, bytes, 1, kept, stream);
    }

    /* 4. Return: the same messages the other way; each chunk lands where it left from, in
     * the copy of the TP rank that computed it. */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_recvs && r == ncclSuccess; i++)
        r = ncclSend((char *)b->out + b->recvs[i].offset * H * BF16, (size_t)b->recvs[i].rows * H,
                     ncclBfloat16, b->recvs[i].peer, nccl, stream);
    for (int i = 0; i < n_sends && r == ncclSuccess; i++)
        r = ncclRecv((char *)b->back + ((size_t)(b->sends[i].peer % moe->tp) * back_stride +
                                        (size_t)b->sends[i].offset * H) * BF16,
                     (size_t)b->sends[i].rows * H, ncclBfloat16, b->sends[i].peer, nccl, stream);
    const ncclResult_t end = ncclGroupEnd();
    if (experts != COMET_SUCCESS) {
        st = cometi_baseline_failed_after_return(moe, experts, kept);
        goto out;
    }
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
