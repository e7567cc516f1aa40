/*
 * dispatch_gemm.c - the host side of dispatch -> GEMM (the forward's layer0): buffers in
 * symmetric memory, and the launches of one call (the device route; the fused dispatch +
 * GEMM0 + SwiGLU; beside the route, the first wave). See dispatch_gemm.h.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "patterns/dispatch_gemm.h"
#include "base/params.h"
#include "pointwise/pointwise.h"

comet_status_t cometi_dispatch_gemm_create(comet_comm_t comm, const comet_moe_config_t *cfg, cometi_dispatch_gemm_t *l)
{
    memset(l, 0, sizeof(*l));
    const int W = comm->size, tp = cfg->tp_size > 0 ? cfg->tp_size : 1, per = cfg->num_experts / (W / tp);
    if (cfg->ffn % (64 * tp)) /* config validation already says so */
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "config.ffn = %d: must be a multiple of 64 x tp_size "
                           "= %d", cfg->ffn, 64 * tp);
    l->hidden = cfg->hidden;
    l->ffn = cfg->ffn / tp;
    l->tp = tp;
    l->experts_per_group = per;
    l->num_experts = cfg->num_experts;
    l->top_k = cfg->top_k;
    l->max_tokens = cfg->max_tokens;
    l->max_recv_rows = cometi_route_max_recv_rows(W, cfg->max_tokens, cfg->top_k, per, COMETI_BLOCK_M);
    l->fp8 = cfg->dtype == COMET_DTYPE_FP8_BLOCK;
    l->pow2_scales = cfg->fp8_pow2_scales;
    l->row_bytes = l->fp8 ? cometi_fp8_row_bytes(cfg->hidden) : cfg->hidden * 2;
    comet_status_t st;
    COMETI_TRY_GOTO(st, cometi_route_dev_create(comm, cfg->num_experts, tp, cfg->max_tokens * cfg->top_k,
                                                l->max_recv_rows, COMETI_BLOCK_M, &l->route), fail);
    /* With resend_x, twice the rows: the backward's x rows follow dy's. */
    const size_t rows_bytes = (size_t)l->max_recv_rows * l->row_bytes;
    COMETI_TRY_GOTO(st, cometi_window_create(comm, rows_bytes * (cfg->resend_x ? 2 : 1), &l->recv), fail);
    l->x_rows = cfg->resend_x ? (char *)l->recv.local + rows_bytes : NULL;
    COMETI_TRY_GOTO(st, cometi_window_create(comm, sizeof(unsigned long long) * l->route.max_blocks, &l->arrive),
                    fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(l->arrive.local, 0, l->arrive.bytes), "clear arrivals"),
                    fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc(&l->act, (size_t)l->max_recv_rows * l->ffn * (l->fp8 ? 1 : 2)),
                                    "cudaMalloc(layer0 activations)"), fail);
    if (l->fp8) {
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc(&l->x_q, (size_t)cfg->max_tokens * l->row_bytes),
                                        "cudaMalloc(FP8 tokens)"), fail);
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&l->act_scales, (size_t)l->max_recv_rows *
                                                              ((l->ffn + 127) / 128) * sizeof(float)),
                                        "cudaMalloc(FP8 activation scales)"), fail);
    }
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&l->sched, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)),
                                    "cudaMalloc(tile counter)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(l->sched, 0, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)), "clear tile counter"),
                    fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc(&l->tail_ws, COMETI_GEMM_TAIL_BYTES(comm->sm_count)),
                                    "cudaMalloc(GEMM last-wave workspace)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(l->tail_ws, 0, COMETI_GEMM_TAIL_COUNTERS * 8),
                                    "clear GEMM last-wave counters"), fail);
    {
        /* The highest priority: the block scheduler should place the first wave's GEMM
         * blocks before the fused kernel's, which can wait for SMs. */
        int least = 0, greatest = 0;
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaDeviceGetStreamPriorityRange(&least, &greatest),
                                        "cudaDeviceGetStreamPriorityRange"), fail);
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaStreamCreateWithPriority(&l->side, cudaStreamNonBlocking,
                                                                                greatest),
                                        "create the first wave's stream"), fail);
    }
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaEventCreateWithFlags(&l->ranks_done, cudaEventDisableTiming),
                                    "create an event"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaEventCreateWithFlags(&l->wave_done, cudaEventDisableTiming),
                                    "create an event"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&l->wave_seg, sizeof(cometi_segment_t)),
                                    "cudaMalloc(first wave segment)"), fail);
    /* Every rank's counters are zero before any rank adds to them. */
    COMETI_TRY_GOTO(st, cometi_barrier_sync(comm, "arrival counters cleared on every rank"), fail);
    return COMET_SUCCESS;
fail:
    cometi_dispatch_gemm_destroy(comm, l);
    return st;
}

void cometi_dispatch_gemm_destroy(comet_comm_t comm, cometi_dispatch_gemm_t *l)
{
    cometi_route_dev_destroy(comm, &l->route);
    if (l->recv.local) cometi_window_destroy(comm, &l->recv);
    if (l->arrive.local) cometi_window_destroy(comm, &l->arrive);
    cudaFree(l->act);
    cudaFree(l->x_q);
    cudaFree(l->act_scales);
    cudaFree(l->sched);
    cudaFree(l->tail_ws);
    if (l->side) cudaStreamDestroy(l->side);
    if (l->ranks_done) cudaEventDestroy(l->ranks_done);
    if (l->wave_done) cudaEventDestroy(l->wave_done);
    cudaFree(l->wave_seg);
    memset(l, 0, sizeof(*l));
}

/* FP8: this call's tokens as the dispatch sends them, each row's E4M3 values then its
 * scales (x_q): quantized from bf16 x, once per token whatever its top_k, or copied from an
 * E4M3 x and its [M][ceil(H / 128)] scales. */
static comet_status_t fp8_tokens(comet_comm_t comm, const cometi_dispatch_gemm_t *l, const comet_moe_args_t *a,
                                 cudaStream_t stream)
{
    const int H = l->hidden, blocks = (H + 127) / 128;
    if (!a->num_tokens) return COMET_SUCCESS;
    float *scales = (float *)((char *)l->x_q + H);
    if (!a->x_scales)
        return cometi_cuda(comm->err, cometi_quantize_rows_e4m3(a->x, a->num_tokens, H, H, l->x_q, l->row_bytes, scales,
                                                                l->row_bytes / 4, 1, l->pow2_scales, stream),
                           "quantize the tokens to FP8");
    COMETI_TRY(cometi_cuda(comm->err, cudaMemcpy2DAsync(l->x_q, l->row_bytes, a->x, H, H, a->num_tokens,
                                                        cudaMemcpyDeviceToDevice, stream), "copy the FP8 tokens"));
    return cometi_cuda(comm->err, cudaMemcpy2DAsync(scales, l->row_bytes, a->x_scales, blocks * sizeof(float),
                                                    blocks * sizeof(float), a->num_tokens, cudaMemcpyDeviceToDevice,
                                                    stream), "copy the FP8 tokens' scales");
}

cometi_gemm_t cometi_dispatch_gemm_gemm(comet_comm_t comm, const cometi_dispatch_gemm_t *l, const comet_moe_args_t *a)
{
    cometi_gemm_t g;
    memset(&g, 0, sizeof(g));
    g.problem.groups = l->experts_per_group;
    g.problem.n = l->ffn;
    g.problem.k = l->hidden;
    g.problem.segs = l->route.plan.local_segs;
    g.problem.local_rows = l->route.plan.local_rows; /* the fused run's tile order */
    g.a.ptr = l->recv.local;
    g.a.rows = l->max_recv_rows;
    g.b.ptr = a->weights.gate_up ? a->weights.gate_up : a->weights.gate;
    g.b.up = a->weights.gate_up ? NULL : a->weights.up;
    g.out.epilogue = COMETI_GEMM_EPI_SWIGLU;
    g.out.c = l->act;
    g.out.ldc = l->ffn;
    if (l->fp8) {
        /* E4M3 rows with their scales after them; the activation E4M3, its scales MN-major. */
        g.a.type = g.b.type = COMETI_GEMM_E4M3;
        g.a.ld = l->row_bytes;
        g.a.scale = (const float *)((const char *)l->recv.local + l->hidden);
        g.a.scale_row = l->row_bytes / 4, g.a.scale_block = 1;
        g.b.scale = a->weights.gate_up ? a->weight_scales.gate_up : a->weight_scales.gate;
        g.b.up_scale = a->weights.gate_up ? NULL : a->weight_scales.up;
        g.out.epilogue = COMETI_GEMM_EPI_SWIGLU_E4M3;
        g.out.c_scale = l->act_scales;
        g.out.c_scale_row = 1, g.out.c_scale_block = l->max_recv_rows;
        g.out.pow2_scales = l->pow2_scales;
    }
    g.launch.tail_ws = l->tail_ws;
    g.err = comm->async_dev;
    g.timeout_ns = (unsigned long long)comm->timeout_ms * 1000000ull;
    g.roles.tile_trace = l->tile_trace;
    return g;
}

comet_status_t cometi_dispatch_gemm_run(comet_comm_t comm, cometi_dispatch_gemm_t *l, const comet_moe_args_t *a,
                                        const cometi_dispatch_knobs_t *knobs, cudaStream_t stream)
{
    cometi_gemm_t core = cometi_dispatch_gemm_gemm(comm, l, a);
    if (cometi_model_pingpong(a->num_tokens, comm->size, l->top_k, l->num_experts))
        core.launch.schedule = COMETI_GEMM_PINGPONG;
    return cometi_dispatch_gemm_run_core(comm, l, a, &core, NULL, knobs, stream);
}

comet_status_t cometi_dispatch_gemm_run_core(comet_comm_t comm, cometi_dispatch_gemm_t *l, const comet_moe_args_t *a,
                                             const cometi_gemm_t *core, const cometi_dispatch_call_t *kind,
                                             const cometi_dispatch_knobs_t *knobs, cudaStream_t stream)
{
    const int backward = kind && kind->backward;
    const void *x_again = backward ? kind->x_again : NULL;
    if (x_again && !l->x_rows)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "x sent again, but the layer has no room for it "
                           "(config.resend_x = 0)");
    if ((uintptr_t)x_again % 16)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "x = %p: the fused layer needs 16-byte aligned rows",
                           x_again);
    const int dispatch_blocks = knobs->dispatch_blocks;
    if (dispatch_blocks < 1 || dispatch_blocks >= comm->sm_count)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "dispatch blocks = %d: must be 1..%d (the rest of the "
                           "%d SMs compute)", dispatch_blocks, comm->sm_count - 1, comm->sm_count);
    if (knobs->dispatch_mode != COMETI_DISPATCH_BULK && knobs->dispatch_mode != COMETI_DISPATCH_STORES)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "dispatch mode = %d: must be %d (bulk) or %d (stores)",
                           knobs->dispatch_mode, COMETI_DISPATCH_BULK, COMETI_DISPATCH_STORES);
    if ((uintptr_t)a->x % 16)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "x = %p: the fused layer needs 16-byte aligned rows",
                           a->x);
    if (l->fp8 && x_again)
        return cometi_fail(comm->err, COMET_NOT_SUPPORTED, "x sent again in FP8: the FP8 layer keeps x's rows "
                           "(config.resend_x 0)");
    if (knobs->first_wave < -1)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "first wave = %d row blocks: must be -1 (none), 0 "
                           "(automatic) or more", knobs->first_wave);
    /* The first wave (tp 1, tune.h): row blocks of the first expert on the side stream,
     * beside the exchange; the fused GEMM sees the segments without them. It copies the
     * rows the dispatch sends (in FP8, x_q: quantized before the route).
     * cometi_first_rows_allowed says where it cannot run (more route chunks than its table
     * holds, rows not 16-byte vectors): then none. It runs in the forward alone, whose
     * SwiGLU tiles have 128 output columns. */
    const int col_tiles = (l->ffn + 127) / 128, gemm_blocks = comm->sm_count - dispatch_blocks;
    int wave = cometi_first_wave_blocks(knobs->first_wave, (int)cometi_param_int(COMETI_PARAM_FIRST_WAVE), l->tp,
                                        comm->sm_count, dispatch_blocks, col_tiles,
                                        (long long)a->num_tokens * l->top_k);
    const void *rows = l->fp8 ? l->x_q : a->x;
    if (backward ||
        (wave && !cometi_first_rows_allowed(&l->route, wave, a->num_tokens, l->top_k, rows, l->row_bytes)))
        wave = 0; /* nothing may fail once the side stream has forked */
    cometi_gemm_t g = *core;
    g.problem.segs = l->route.plan.fused_segs;
    g.problem.local_rows = l->route.plan.fused_local_rows;
    g.launch.sms = gemm_blocks;
    g.launch.sched = l->sched;
    cometi_gemm_dispatch_t role;
    memset(&role, 0, sizeof(role));
    role.blocks = dispatch_blocks;
    role.arrive = (const unsigned long long *)l->arrive.local;
    role.expected = l->route.plan.expected;
    cometi_dispatch_t *d = &role.rows;
    d->x = rows;
    d->src_of = l->route.plan.src_of;
    d->plan = cometi_route_tables(&l->route.plan);
    d->num_experts = l->num_experts;
    d->top_k = l->top_k;
    d->x2 = x_again;
    d->x2_offset = x_again ? (size_t)((char *)l->x_rows - (char *)l->recv.local) : 0;
    d->row_bytes = l->row_bytes;
    d->experts_per_group = l->experts_per_group;
    d->tp = l->tp;
    d->rank = comm->rank;
    d->mode = knobs->dispatch_mode;
    d->wave_blocks = wave;
    g.roles.dispatch = &role; /* the row with the role, whose tiles set the head */
    int band_rows, tiles_across;
    cometi_gemm_tiling(&g, &band_rows, &tiles_across);
    d->head_pieces = cometi_head_pieces(l->tp, band_rows, gemm_blocks, tiles_across);
    for (int p = 0; p < comm->size; p++) {
        d->recv[p] = l->recv.peer[p];
        d->arrive[p] = (unsigned long long *)l->arrive.peer[p];
    }
    /* Check everything before the route: once it has run, peers expect this rank's rows
     * and its arrival totals have grown, so failing after it would leave them waiting. The
     * plan's arrays are allocated once, so the GEMM can be described before they are filled. */
    cometi_gemm_prepared_t prepared, wave_prepared;
    COMETI_TRY(cometi_gemm_prepare(comm->err, &g, &prepared));
    if (wave) { /* static tiles, no shared counters or workspace: it runs beside the fused kernel */
        cometi_gemm_t w = *core;
        const int free_sms = comm->sm_count - COMETI_FIRST_WAVE_FREE_SMS;
        w.problem.segs = l->wave_seg;
        w.problem.groups = 1;
        w.problem.local_rows = NULL;
        w.launch.sms = wave * col_tiles < free_sms ? wave * col_tiles : free_sms;
        w.launch.tail_ws = NULL;
        w.roles.tile_trace = NULL;
        COMETI_TRY(cometi_gemm_prepare(comm->err, &w, &wave_prepared));
    }
    if (l->fp8) COMETI_TRY(fp8_tokens(comm, l, a, stream));
    COMETI_TRY(cometi_route_dev_run(comm, &l->route, a->topk_ids, a->topk_weights, a->num_tokens, l->top_k, wave,
                                    kind ? kind->call : 0,
                                    wave ? l->ranks_done : NULL, stream));
    if (!wave) return cometi_gemm_launch(comm->err, &prepared, stream);
    /* Forked: whatever fails from here, the side stream is joined before returning (an
     * unjoined fork ends a graph capture with an error, and outside one the next call's
     * route could overwrite what the side stream still reads). */
    comet_status_t st = cometi_cuda(comm->err, cudaStreamWaitEvent(l->side, l->ranks_done, 0), "fork the first wave");
    if (st == COMET_SUCCESS)
        st = cometi_first_rows(comm, &l->route, a->topk_ids, a->num_tokens, l->top_k, rows, l->row_bytes, l->recv.local,
                               (unsigned long long *)l->arrive.local, l->wave_seg, l->side);
    if (st == COMET_SUCCESS) st = cometi_gemm_launch(comm->err, &wave_prepared, l->side);
    const comet_status_t recorded = cometi_cuda(comm->err, cudaEventRecord(l->wave_done, l->side),
                                                "record the first wave");
    if (st == COMET_SUCCESS) st = recorded;
    if (st == COMET_SUCCESS) st = cometi_gemm_launch(comm->err, &prepared, stream);
    const comet_status_t joined = cometi_cuda(comm->err, cudaStreamWaitEvent(stream, l->wave_done, 0),
                                              "join the first wave");
    return st != COMET_SUCCESS ? st : joined;
}
