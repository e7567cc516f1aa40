/*
 * route.c - the device route's host side: its buffers and symmetric count table (made
 * collectively), and each call's three launches (route_kernels.cu) with no host sync;
 * the first wave's rows (first_wave.cu).
 */
#include <stdint.h>
#include <string.h>

#include "comm/route.h"

comet_status_t cometi_route_dev_create(comet_comm_t comm, int num_experts, int tp, int max_rows,
                                                  int64_t max_recv_rows, int block_m, cometi_route_dev_t *r)
{
    memset(r, 0, sizeof(*r));
    const int W = comm->size, E = num_experts;
    if (E < 1 || E > COMETI_MAX_EXPERTS)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "route: %d experts (1..%d)", E, COMETI_MAX_EXPERTS);
    if (tp < 1 || W % tp || E % (W / tp))
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "route: tp %d must divide the world %d, and the "
                           "groups the experts (%d)", tp, W, E);
    const int per = E / (W / tp);
    r->tp = tp;
    r->max_blocks = (int)((max_recv_rows + block_m - 1) / block_m);
    r->world = W;
    r->num_experts = E;
    r->max_rows = max_rows;
    r->block_m = block_m;
    /* The exchange's padded segment sizes live in shared memory, and the counts too where
     * they fit beside them and this rank's totals in the default 48 KB (world x E <=
     * 11248 - E). */
    r->counts_in_smem =
        sizeof(int32_t) * ((size_t)W * E + E + COMETI_MAX_EXPERTS) <= 48 * 1024 - 64;
    size_t table_bytes = sizeof(unsigned long long) * 2 * W * (E + 1); /* [2][world][E + 1] tagged words */
    COMETI_TRY(cometi_window_create(comm, table_bytes, &r->table));
    comet_status_t st;
    COMETI_TRY_GOTO(st, cometi_window_create(comm, sizeof(cometi_row_meta_t) * (size_t)(max_rows > 0 ? max_rows : 1),
                                             &r->meta), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(r->table.local, 0, r->table.bytes), "clear route table"),
                    fail);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&r->local_counts, sizeof(int32_t) * (E + 1)),
                                    "cudaMalloc(route counts)"), fail);
    /* No bad id yet: each call's exchange resets it after reading it. */
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(r->local_counts + E, 0xff, sizeof(int32_t)),
                                    "clear route first bad id"), fail);
    {
        /* 64-bit counters first (alignment), then segments, then the int32 arrays. */
        size_t ints = 2 + (size_t)r->max_blocks * 2 + (size_t)per * 3 + (size_t)W * E * 3 + (size_t)E * 2 + W +
                      (size_t)max_rows * 4 + (size_t)E * cometi_route_chunks(max_rows) * 2 + (size_t)per * 3 + 1;
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMalloc((void **)&r->arena, sizeof(int32_t) * ints),
                                        "cudaMalloc(route plan)"), fail);
        COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemset(r->arena, 0, sizeof(int32_t) * ints),
                                        "clear route plan"), fail);
        int32_t *p = r->arena;
        r->seq = (unsigned long long *)p, p += 2;
        r->plan.expected = (unsigned long long *)p, p += (size_t)r->max_blocks * 2;
        r->plan.local_segs = (cometi_segment_t *)p, p += (size_t)per * 2;
        r->plan.local_rows = p, p += per;
        r->plan.counts = p, p += (size_t)W * E;
        r->plan.send_offset = p, p += (size_t)W * E;
        r->plan.seg_start = p, p += E;
        r->plan.seg_rows = p, p += E;
        r->plan.recv_offset = p, p += (size_t)W * E;
        r->plan.recv_rows = p, p += W;
        r->plan.recv_pos = p, p += max_rows;
        r->plan.pos = p, p += max_rows;
        r->plan.src_of = p, p += max_rows;
        r->chunk_pos = p, p += max_rows;
        r->chunk_counts = p, p += (size_t)E * cometi_route_chunks(max_rows);
        r->chunk_prefix = p, p += (size_t)E * cometi_route_chunks(max_rows);
        r->plan.fused_segs = (cometi_segment_t *)p, p += (size_t)per * 2;
        r->plan.fused_local_rows = p, p += per;
        r->plan.failed = p;
    }
    /* Every table cleared before any peer writes into it. */
    COMETI_TRY_GOTO(st, cometi_barrier_sync(comm, "route table cleared on every rank"), fail);
    return COMET_SUCCESS;
fail:
    cometi_route_dev_destroy(comm, r);
    return st;
}

void cometi_route_dev_destroy(comet_comm_t comm, cometi_route_dev_t *r)
{
    if (r->table.local) cometi_window_destroy(comm, &r->table);
    if (r->meta.local) cometi_window_destroy(comm, &r->meta);
    cudaFree(r->local_counts);
    cudaFree(r->arena);
    memset(r, 0, sizeof(*r));
}

comet_status_t cometi_route_dev_run(comet_comm_t comm, cometi_route_dev_t *r, const int32_t *topk_ids,
                                               const float *weights, int m, int k, int wave_blocks,
                                               unsigned int call, cudaEvent_t ranks_done, cudaStream_t stream)
{
    const int n = m * k, E = r->num_experts;
    if (n > r->max_rows)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "route: %d tokens x top-k %d = %d rows: the plan "
                           "holds %d", m, k, n, r->max_rows);
    if (wave_blocks < 0 || (wave_blocks && r->tp != 1))
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "route: wave_blocks = %d: must be >= 0, and 0 with "
                           "tp %d > 1", wave_blocks, r->tp);
    r->plan.wave_blocks = wave_blocks; /* every call sets it: no call inherits the last one's */
    /* Three kernels: the chunks' ranks (which note the first bad id; the exchange reads
     * and resets it), the exchange with the plan, and the rows' places. */
    const int chunks = cometi_route_chunks(n);
    COMETI_TRY(cometi_cuda(comm->err, cometi_route_launch_chunk_ranks(topk_ids, n, E, r->chunk_pos,
                                                                      (unsigned int *)(r->local_counts + E),
                                                                      r->chunk_counts, stream),
                           "launch chunk_rank_kernel"));
    if (ranks_done) COMETI_TRY(cometi_cuda(comm->err, cudaEventRecord(ranks_done, stream), "record the ranks' event"));
    cometi_route_exchange_t x;
    memset(&x, 0, sizeof(x));
    for (int p = 0; p < r->world; p++) x.peer_tables[p] = (int32_t *)r->table.peer[p];
    x.mine = (unsigned long long *)r->table.local;
    x.me = comm->rank, x.world = r->world, x.tp = r->tp, x.num_experts = E, x.block_m = r->block_m;
    x.seq = r->seq;
    x.local_counts = r->local_counts;
    x.chunk_counts = r->chunk_counts, x.chunk_prefix = r->chunk_prefix, x.chunks = chunks;
    x.ids = topk_ids, x.n = n;
    x.plan = r->plan;
    x.counts_in_smem = r->counts_in_smem;
    x.call = call;
    x.timeout_ns = (unsigned long long)comm->timeout_ms * 1000000ull;
    x.err = comm->async_dev;
    const cudaError_t launched = cometi_route_launch_exchange(&x, stream);
    if (launched != cudaSuccess) /* the ranks may have noted a bad id that only the exchange resets */
        cudaMemsetAsync(r->local_counts + E, 0xff, sizeof(int32_t), stream);
    COMETI_TRY(cometi_cuda(comm->err, launched, "launch exchange_plan_kernel"));
    if (n == 0) return COMET_SUCCESS;
    return cometi_cuda(comm->err,
                       cometi_route_launch_place_rows(topk_ids, weights, n, k, E, comm->rank, r->world, r->tp,
                                                      r->chunk_pos, r->chunk_prefix, chunks, &r->plan,
                                                      weights ? (cometi_row_meta_t *)r->meta.local : NULL, stream),
                       "launch place_rows_kernel");
}


int cometi_first_rows_allowed(const cometi_route_dev_t *r, int wave_blocks, int m, int k, const void *x,
                              int row_bytes)
{
    return r->tp == 1 && wave_blocks >= 1 && cometi_route_chunks(m * k) <= COMETI_FIRST_ROWS_MAX_CHUNKS &&
           row_bytes % 16 == 0 && (uintptr_t)x % 16 == 0;
}

comet_status_t cometi_first_rows(comet_comm_t comm, const cometi_route_dev_t *r, const int32_t *topk_ids,
                                 int m, int k, const void *x, int row_bytes, void *recv,
                                 unsigned long long *arrive, cometi_segment_t *seg, cudaStream_t stream)
{
    const int n = m * k, chunks = cometi_route_chunks(n);
    if (!cometi_first_rows_allowed(r, r->plan.wave_blocks, m, k, x, row_bytes))
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "first rows: tp %d (must be 1), %d wave blocks (>= 1), "
                           "%d route chunks (<= %d), rows of %d bytes (a multiple of 16), x %p (16-byte aligned)",
                           r->tp, r->plan.wave_blocks, chunks, COMETI_FIRST_ROWS_MAX_CHUNKS, row_bytes, x);
    return cometi_cuda(comm->err,
                       cometi_launch_first_rows(topk_ids, n, k, comm->rank * (r->num_experts / r->world), r->chunk_pos,
                                                r->chunk_counts, chunks, r->plan.wave_blocks, x, row_bytes, recv,
                                                arrive, seg, comm->sm_count, stream),
                       "launch first_rows_kernel");
}
