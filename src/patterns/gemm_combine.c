/*
 * gemm_combine.c - the host side of GEMM -> combine (the forward's layer1): the slots and
 * counters in symmetric memory, the table of every rank's windows, and the launches of
 * one call. See gemm_combine.h.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "patterns/gemm_combine.h"

comet_status_t cometi_gemm_combine_create(comet_comm_t comm, const comet_moe_config_t *cfg, const cometi_dispatch_gemm_t *l0,
                                    cometi_gemm_combine_t *l)
{
    memset(l, 0, sizeof(*l));
    if (cfg->top_k > COMETI_COMBINE_MAX_TOP_K)
        return cometi_fail(comm->err, COMET_NOT_SUPPORTED, "config.top_k = %d: the fused combine sums at most %d "
                           "choices per token and rank", cfg->top_k, COMETI_COMBINE_MAX_TOP_K);
    const int W = comm->size;
    if (l0->tp > 1 && W > COMETI_PUSH_MAX_RANKS)
        return cometi_fail(comm->err, COMET_NOT_SUPPORTED, "tp_size = %d on %d ranks: the fused layer1 with TP (the "
                           "push) reaches at most %d ranks", l0->tp, W, COMETI_PUSH_MAX_RANKS);
    l->hidden = cfg->hidden;
    l->slots_per_token = cfg->top_k < W ? cfg->top_k : W;
    const size_t rows = (size_t)l0->max_recv_rows;
    comet_status_t st;
    /* top_k x tp slots per token: the push's; the combine uses the first slots_per_token. */
    l->tp = l0->tp;
    COMETI_TRY_GOTO(st, cometi_window_create(comm, (size_t)cfg->max_tokens * cfg->top_k * l->tp * cfg->hidden * 2 + 16,
                                             &l->slots), fail);
    COMETI_TRY_GOTO(st, cometi_window_create(comm, sizeof(unsigned long long) * (COMETI_MAX_SPLITS + 1), &l->arrive),
                    fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(l->arrive.local, 0, l->arrive.bytes), "clear layer1 arrivals"),
                    fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc(&l->out, rows * cfg->hidden * 2), "cudaMalloc(GEMM1 output)"),
                    fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&l->meta, rows * sizeof(cometi_row_meta_t)),
                                    "cudaMalloc(layer1 row records)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc(&l->push_dest, rows * 8), "cudaMalloc(push destinations)"),
                    fail);
    /* Counters: split_done, expected (two halves), the push's expected, then the kernel's
     * words and the push sum's. */
    const size_t counter_bytes = sizeof(unsigned long long) * (3 * COMETI_MAX_SPLITS + 1) +
                                 sizeof(unsigned int) * (COMETI_GEMM_SCHED_WORDS + 1);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&l->split_done, counter_bytes),
                                    "cudaMalloc(layer1 counters)"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(l->split_done, 0, counter_bytes), "clear layer1 counters"),
                    fail);
    l->expected = l->split_done + COMETI_MAX_SPLITS;
    l->push_expected = l->expected + 2 * COMETI_MAX_SPLITS;
    l->sched = (unsigned int *)(l->push_expected + 1);
    l->push_done = l->sched + COMETI_GEMM_SCHED_WORDS;
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&l->trace, sizeof(unsigned long long) *
                                                          COMETI_COMBINE_TRACE * 2 * comm->sm_count),
                                    "cudaMalloc(layer1 trace)"), fail);
    {
        cometi_combine_peer_t table[COMETI_MAX_RANKS];
        for (int p = 0; p < W; p++) {
            table[p].meta = (const cometi_row_meta_t *)l0->route.meta.peer[p];
            table[p].slots = l->slots.peer[p];
            table[p].arrive = (unsigned long long *)l->arrive.peer[p];
        }
        COMETI_TRY_GOTO(st, cometi_gemm_push_maps_create(comm->err, l->slots.peer, W, l->tp, comm->rank % l->tp,
                                                         (int64_t)cfg->max_tokens * cfg->top_k, cfg->hidden,
                                                         &l->push_maps), fail);
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&l->peers, sizeof(table[0]) * W),
                                        "cudaMalloc(layer1 peer table)"), fail);
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemcpy(l->peers, table, sizeof(table[0]) * W,
                                                              cudaMemcpyHostToDevice), "copy layer1 peer table"),
                        fail);
    }
    /* Every rank's arrival counters are zero before any rank adds to them. */
    COMETI_TRY_GOTO(st, cometi_barrier_sync(comm, "layer1 counters cleared on every rank"), fail);
    return COMET_SUCCESS;
fail:
    cometi_gemm_combine_destroy(comm, l);
    return st;
}

void cometi_gemm_combine_destroy(comet_comm_t comm, cometi_gemm_combine_t *l)
{
    if (l->slots.local) cometi_window_destroy(comm, &l->slots);
    if (l->arrive.local) cometi_window_destroy(comm, &l->arrive);
    cudaFree(l->out);
    cudaFree(l->meta);
    cudaFree(l->push_dest);
    cudaFree(l->push_maps);
    cudaFree(l->split_done);
    cudaFree(l->peers);
    cudaFree(l->trace);
    memset(l, 0, sizeof(*l));
}

cometi_gemm_t cometi_gemm_combine_gemm(comet_comm_t comm, const cometi_gemm_combine_t *l,
                                       const cometi_dispatch_gemm_t *l0, const comet_moe_args_t *a)
{
    cometi_gemm_t g;
    memset(&g, 0, sizeof(g));
    g.problem.groups = l0->experts_per_group;
    g.problem.n = l->hidden;
    g.problem.k = l0->ffn;
    g.problem.segs = l0->route.plan.local_segs;
    g.a.ptr = l0->act;
    g.a.rows = l0->max_recv_rows;
    g.b.ptr = a->weights.down;
    if (l0->fp8) { /* the activation E4M3 with its MN-major scales, W2 E4M3 with its blocks' */
        g.a.type = g.b.type = COMETI_GEMM_E4M3;
        g.a.scale = l0->act_scales;
        g.a.scale_row = 1, g.a.scale_block = l0->max_recv_rows;
        g.b.scale = a->weight_scales.down;
    }
    g.out.c = l->out;
    g.out.ldc = l->hidden;
    g.err = comm->async_dev;
    g.timeout_ns = (unsigned long long)comm->timeout_ms * 1000000ull;
    g.roles.tile_trace = l->tile_trace;
    /* The last wave's cut (the kernels share a stream and never overlap). Which tiles it
     * cuts depends on the blocks that take tiles and on the tile order, so the combine
     * path, whose bits must not depend on its knobs (combine blocks, splits), goes
     * without it: cometi_gemm_combine_run clears it on that path. */
    g.launch.tail_ws = l0->tail_ws;
    return g;
}

/* What both ways of sending rows home read: the windows of every rank, the route plan,
 * this call's tokens. */
static void combine_tables(comet_comm_t comm, const cometi_gemm_combine_t *l, const cometi_dispatch_gemm_t *l0,
                           const comet_moe_args_t *a, cometi_combine_t *c)
{
    c->peers = l->peers;
    c->meta = l->meta;
    c->plan = cometi_route_tables(&l0->route.plan);
    c->topk_ids = a->topk_ids;
    c->y = a->y;
    c->num_tokens = a->num_tokens;
    c->num_experts = l0->num_experts;
    c->experts_per_group = l0->experts_per_group;
    c->tp = l0->tp;
    c->top_k = l0->top_k;
    c->slots_per_token = l->slots_per_token;
    c->rank = comm->rank;
    c->world = comm->size;
}

static comet_status_t push_mark(comet_comm_t comm, const cometi_gemm_combine_t *l, int which, cudaStream_t stream)
{
    if (!l->push_marks) return COMET_SUCCESS;
    return cometi_cuda(comm->err, cudaEventRecord(l->push_marks[which], stream), "cudaEventRecord(push mark)");
}

comet_status_t cometi_gemm_combine_row_homes(comet_comm_t comm, cometi_gemm_combine_t *l,
                                             const cometi_dispatch_gemm_t *l0, const comet_moe_args_t *a,
                                             cudaStream_t stream)
{
    cometi_combine_t c;
    memset(&c, 0, sizeof(c));
    combine_tables(comm, l, l0, a, &c);
    return cometi_cuda(comm->err,
                       cometi_launch_push_dest(&c, l0->route.plan.local_segs, l0->experts_per_group,
                                               l0->max_recv_rows, l0->route.plan.recv_rows + comm->rank / l0->tp,
                                               l->push_dest, stream),
                       "launch push_dest_kernel");
}

/* Column tiles of layer1's GEMM `g` as prepared (a partial last one counts: it stores its
 * rows too). */
static int gemm_col_tiles(const cometi_gemm_t *g, const cometi_gemm_prepared_t *prepared)
{
    const int tile_n = cometi_gemm_variants[((const cometi_gemm_plan_t *)prepared->bytes)->variant].block_n;
    return (g->problem.n + tile_n - 1) / tile_n;
}

/* The push: GEMM1 on every SM, each tile's rows sent home from its epilogue, then the
 * owner's sum. */
static comet_status_t run_push(comet_comm_t comm, cometi_gemm_combine_t *l, cometi_dispatch_gemm_t *l0,
                               const comet_moe_args_t *a, const cometi_gemm_t *core,
                               const cometi_combine_knobs_t *knobs, const cometi_combine_between_t *between,
                               cudaStream_t stream)
{
    cometi_gemm_t g = *core;
    g.launch.sched = knobs->dynamic_tiles ? l->sched : NULL;
    g.out.epilogue = COMETI_GEMM_EPI_PUSH;
    g.out.store = COMETI_GEMM_STORE_TMA;
    cometi_gemm_push_t push;
    memset(&push, 0, sizeof(push));
    push.dest = l->push_dest;
    push.maps = l->push_maps;
    cometi_combine_t *c = &push.combine;
    combine_tables(comm, l, l0, a, c);
    g.out.push = &push;
    cometi_push_sum_t s;
    memset(&s, 0, sizeof(s));
    s.slots = l->slots.local;
    s.arrive = (const unsigned long long *)l->arrive.local + COMETI_PUSH_COUNTER;
    s.expected = l->push_expected;
    s.done = l->push_done;
    s.topk_ids = a->topk_ids;
    s.pos = l0->route.plan.pos;
    s.plan = cometi_route_tables(&l0->route.plan);
    s.weights = a->topk_weights;
    s.y = a->y;
    s.num_tokens = a->num_tokens;
    s.top_k = l0->top_k;
    s.hidden = l->hidden;
    s.num_experts = l0->num_experts;
    s.rank = comm->rank;
    s.tp = l0->tp;
    /* Everything checked before anything is enqueued: peers count what this GEMM sends. */
    cometi_gemm_prepared_t prepared;
    unsigned int sum_blocks;
    COMETI_TRY(cometi_gemm_prepare(comm->err, &g, &prepared));
    s.col_tiles = gemm_col_tiles(&g, &prepared);
    if (s.hidden % 8 || s.top_k < 1 || s.top_k > COMETI_COMBINE_MAX_TOP_K || s.num_tokens < 0 || s.col_tiles < 1 ||
        s.tp < 1 || (uintptr_t)s.y % 16 || (uintptr_t)s.slots % 16)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "push sum: hidden %d (a multiple of 8), top_k %d "
                           "(1..%d), tokens %d, column tiles %d, tp %d (>= 1), y and slots 16-byte aligned", s.hidden,
                           s.top_k, COMETI_COMBINE_MAX_TOP_K, s.num_tokens, s.col_tiles, s.tp);
    cometi_push_sum_plan(&s, comm->sm_count, &sum_blocks);
    COMETI_TRY(push_mark(comm, l, 0, stream));
    /* Every row this call received gets its destination: rows past another A's end (the
     * backward's dh, bounded by its saved state) would keep an earlier call's. */
    COMETI_TRY(cometi_cuda(comm->err,
                           cometi_launch_push_dest(c, g.problem.segs, g.problem.groups, l0->max_recv_rows,
                                                   l0->route.plan.recv_rows + comm->rank / l0->tp, l->push_dest,
                                                   stream),
                           "launch push_dest_kernel"));
    COMETI_TRY(push_mark(comm, l, 1, stream));
    COMETI_TRY(cometi_gemm_launch(comm->err, &prepared, stream));
    COMETI_TRY(push_mark(comm, l, 2, stream));
    /* The sum is enqueued whatever `between` returns: it advances the running totals the
     * next call's sum waits for (left behind, that sum would read slots before their rows). */
    const comet_status_t between_st = between ? between->run(between->ctx, stream) : COMET_SUCCESS;
    COMETI_TRY(cometi_cuda(comm->err, cometi_launch_push_sum(&s, sum_blocks, comm->async_dev, g.timeout_ns, stream),
                           "launch push_sum_kernel"));
    COMETI_TRY(between_st);
    return push_mark(comm, l, 3, stream);
}

comet_status_t cometi_gemm_combine_run(comet_comm_t comm, cometi_gemm_combine_t *l, cometi_dispatch_gemm_t *l0,
                                       const comet_moe_args_t *a, const cometi_combine_knobs_t *knobs,
                                       cudaStream_t stream)
{
    cometi_gemm_t core = cometi_gemm_combine_gemm(comm, l, l0, a);
    if (cometi_model_pingpong(a->num_tokens, comm->size, l0->top_k, l0->num_experts))
        core.launch.schedule = COMETI_GEMM_PINGPONG;
    return cometi_gemm_combine_run_core(comm, l, l0, a, &core, knobs, NULL, stream);
}

comet_status_t cometi_gemm_combine_run_core(comet_comm_t comm, cometi_gemm_combine_t *l, cometi_dispatch_gemm_t *l0,
                                            const comet_moe_args_t *a, const cometi_gemm_t *core,
                                            const cometi_combine_knobs_t *knobs,
                                            const cometi_combine_between_t *between, cudaStream_t stream)
{
    if (knobs->combine_blocks < 0 || knobs->combine_blocks >= comm->sm_count)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "combine blocks = %d: must be 0..%d (the rest of the "
                           "%d SMs compute)", knobs->combine_blocks, comm->sm_count - 1, comm->sm_count);
    if (knobs->n_splits < 1 || knobs->n_splits > COMETI_MAX_SPLITS)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "column splits = %d: must be 1..%d", knobs->n_splits,
                           COMETI_MAX_SPLITS);
    if ((uintptr_t)a->y % 16)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "y = %p: the fused layer needs 16-byte aligned rows",
                           a->y);
    if (knobs->push && (knobs->combine_blocks || knobs->n_splits != 1))
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "push with %d combine blocks and %d splits: the push "
                           "needs 0 combine blocks and 1 split", knobs->combine_blocks, knobs->n_splits);
    if (core->out.c != l->out || core->problem.n != l->hidden)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "GEMM -> combine: the GEMM must write its %d columns "
                           "into the layer's output rows (the combine reads them there)", l->hidden);
    if (knobs->push) return run_push(comm, l, l0, a, core, knobs, between, stream);
    if (l->tp > 1)
        return cometi_fail(comm->err, COMET_NOT_SUPPORTED, "GEMM -> combine with tp_size = %d: only the push sends partial "
                           "rows home (the combine blocks and the tail pre-sum per rank, which TP does not allow)",
                           l->tp);
    cometi_gemm_t g = *core;
    g.launch.tail_ws = NULL; /* the same bits whatever the knobs (cometi_gemm_combine_gemm) */
    g.launch.sms = comm->sm_count - knobs->combine_blocks;
    g.launch.sched = knobs->dynamic_tiles ? l->sched : NULL;
    cometi_gemm_splits_t splits;
    memset(&splits, 0, sizeof(splits));
    splits.n_splits = knobs->n_splits;
    splits.split_done = l->split_done;
    splits.combine_blocks = knobs->combine_blocks;
    cometi_combine_t *c = &splits.combine;
    combine_tables(comm, l, l0, a, c);
    g.roles.splits = &splits;
    c->kernel_splits = knobs->combine_blocks ? knobs->n_splits - (knobs->tail != 0) : 0;
    c->expected = l->expected;
    c->sync = l->sched + 3; /* the kernel's words 3 and 4, used on either schedule */
    c->trace = l->trace;
    cometi_gemm_prepared_t prepared;
    COMETI_TRY(cometi_gemm_prepare(comm->err, &g, &prepared));
    COMETI_TRY(cometi_gemm_launch(comm->err, &prepared, stream));
    /* Here the tail sends rows too (the last split's, or all of them with no combine
     * blocks): `between` goes after it, since before it no row would be on its way. */
    if (c->kernel_splits < knobs->n_splits) {
        const int tiles_per_split = gemm_col_tiles(&g, &prepared) / knobs->n_splits; /* as the GEMM's split_tiles */
        c->trace = l->trace + (size_t)COMETI_COMBINE_TRACE * comm->sm_count; /* the tail's own rows */
        COMETI_TRY(cometi_cuda(comm->err,
                               cometi_launch_combine_tail(c, l->out, l->hidden, g.problem.segs, g.problem.groups,
                                                          knobs->n_splits,
                                                          tiles_per_split, l->split_done, knobs->combine_blocks == 0,
                                                          comm->async_dev, g.timeout_ns, stream),
                               "launch combine_tail_kernel"));
    }
    return between ? between->run(between->ctx, stream) : COMET_SUCCESS;
}
