/*
 * kernel.cuh - the persistent, warp-specialized grouped GEMM (sm_90a), one kernel per row
 * V of variants.h's table, and its launch. The files gemm_forward.cu, gemm_dgrad.cu and
 * gemm_wgrad.cu compile the rows of one family each (launch_family below).
 *
 * One block per SM, 384 threads: warpgroup 0 is the producer (one thread issues TMA loads
 * of A and B tiles into a ring of shared-memory stages, completing on mbarriers; for E4M3
 * rows a second warp, the scale warp, copies each stage's block scales beside it);
 * warpgroups 1 and 2 are consumers. Cooperative schedule: both split each 128-row tile (64
 * rows each). Ping-pong schedule: each takes every other 64-row tile, so one's epilogue
 * runs while the other multiplies. The kernel reads as:
 *   roles     combine blocks combine (combine.cuh); dispatch blocks copy rows
 *             (dispatch.cuh), then compute; GEMM blocks copy their share of the head;
 *   scheduler tickets (a shared counter, or every gemm_blocks-th tile) decoded into tiles,
 *             local tiles first, split by split, the last wave cut (schedule.cuh);
 *   mainloop  TMA loads and wgmma through the ring (mainloop.cuh);
 *   epilogue  the rows out: push, TMA store or registers (epilogue.cuh).
 * The group table (rows per expert) is read on the device: no host sync. The host side
 * (checks, tensor maps, arguments) is gemm/prepare.c.
 */
#ifndef COMET_GEMM_KERNEL_CUH
#define COMET_GEMM_KERNEL_CUH

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include "gemm/args.h"
#include "base/launch.h"
#include "base/ptx.cuh"
#include "gemm/schedule.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/epilogue.cuh"
#include "comm/dispatch.cuh"
#include "comm/combine.cuh"

#define BM COMETI_GEMM_BM
#define THREADS 384
#define TICKETS COMETI_GEMM_TICKETS
static_assert(sizeof(cometi_tail_plan_t) == 3 * 4, "variants.h counts the last wave's plan as 3 ints");

/* Where a unit's loads start and end: A's first row (a weight gradient: its group's first,
 * where its k starts) and the end of its k blocks (a weight gradient's k is its group's
 * rows). The TMA thread and the scale warp load the same. */
template <int V>
static __device__ __forceinline__ int2 unit_loads(const cometi_gemm_args_t &p, tile_t tl, unit_t un)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr bool WGRAD = T.along == COMETI_GEMM_GROUPS_ALONG_K;
    constexpr int TM = cometi_gemm_tile_rows(T), BK = cometi_gemm_bk(T);
    const cometi_segment_t seg = p.segs[tl.group];
    return make_int2(WGRAD ? seg.start : seg.start + tl.m * TM, WGRAD ? (seg.rows + BK - 1) / BK : un.kb1);
}

template <int V>
static __global__ void __launch_bounds__(THREADS, 1)
grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_up, const __grid_constant__ CUtensorMap map_c,
                    const __grid_constant__ CUtensorMap map_gu, cometi_gemm_args_t p)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int BN = T.block_n, STAGES = cometi_gemm_stages(T);
    constexpr bool TMA_EPILOGUE = T.store == COMETI_GEMM_STORE_TMA,
                   SWIGLU = cometi_gemm_is_swiglu(T.epilogue), E4M3 = T.a_type == COMETI_GEMM_E4M3,
                   PINGPONG = T.schedule == COMETI_GEMM_PINGPONG, WGRAD = T.along == COMETI_GEMM_GROUPS_ALONG_K,
                   DISPATCH = T.roles & COMETI_GEMM_ROLE_DISPATCH, SPLITS = T.roles & COMETI_GEMM_ROLE_SPLITS,
                   PUSH_OR_SPLITS = cometi_gemm_keeps_push(T);
    /* Output columns per tile (SwiGLU pairs gate column c with up column c + BN/2), and rows
     * per tile: 128 shared by both consumers, or 64 for one (ping-pong). */
    constexpr int ON = cometi_gemm_out_cols(T), TM = cometi_gemm_tile_rows(T), BK = cometi_gemm_bk(T);
    /* A stage holds 128 bytes of each row of A's and B's tiles (BK elements). */
    constexpr uint32_t A_BYTES = TM * 128, B_BYTES = BN * 128, C_BYTES = cometi_gemm_staging_bytes(T);
    /* The layout below is what variants.h sized the row's shared memory for. */
    static_assert(A_BYTES + B_BYTES == (uint32_t)cometi_gemm_stage_bytes(T) && (C_BYTES > 0) == TMA_EPILOGUE,
                  "the kernel's stages and staging as variants.h counts them");
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    gemm_smem_t sm;
    sm.a = smem, sm.b = smem + STAGES * A_BYTES, sm.c = sm.b + STAGES * B_BYTES;
    sm.scales = (float *)(sm.c + C_BYTES); /* E4M3 only: STAGES slots */
    sm.full = (uint64_t *)(sm.c + C_BYTES + STAGES * cometi_gemm_scale_slot_bytes(T)), sm.empty = sm.full + STAGES,
    sm.turn = sm.empty + STAGES;
    sm.ticket_full = sm.turn + 2, sm.ticket_empty = sm.ticket_full + TICKETS;
    sm.first_tile = (int *)(sm.ticket_empty + TICKETS), sm.tickets = sm.first_tile + 2 * COMETI_GEMM_MAX_GROUPS + 1;
    /* The last wave's cut, read from shared memory where needed (registers are short in
     * the producer's 40). */
    sm.tail = (cometi_tail_plan_t *)(sm.tickets + TICKETS);
    /* The last column tile may be partial (n a multiple of 64): its B columns past n load
     * as zeros (or, K-major, as the next group's rows), and its columns past n are never
     * stored. So may the last k block of E4M3 (k a multiple of 16): the loads past k read
     * zeros. */
    const int wg = threadIdx.x / 128, n_tiles = (p.n + ON - 1) / ON, k_blocks = (p.k + BK - 1) / BK,
              split_tiles = n_tiles / p.n_splits;

    /* ---- roles ---- */
    /* Dispatch or combine blocks come first: blocks start in index order, so if an SM is
     * busy it is a GEMM block (which waits on nobody's behalf) that starts late, not a
     * block the others wait for. */
    const int dispatch_blocks = gridDim.x - p.gemm_blocks;
    /* The tile timeline's row of this block (gemm.h), when asked for. */
    unsigned long long *trace = p.tile_trace ? p.tile_trace + (size_t)blockIdx.x * COMETI_TILE_TRACE_WORDS : NULL;
    const unsigned long long t_entry = trace ? cometi_globaltimer_ns() : 0;
    cometi_grid_wait(); /* the route's plan, the inputs, the tile counters */
    if constexpr (SPLITS) {
        if (p.combine_blocks && (int)blockIdx.x < p.combine_blocks) {
            combine_rows(&p.combine, (const __nv_bfloat16 *)p.c, p.n, p.segs, p.groups, p.n_splits, split_tiles,
                         p.split_done, p.combine_blocks, smem, p.err, p.arrival_timeout_ns);
            return;
        }
    }
    if constexpr (DISPATCH) {
        if ((int)blockIdx.x < dispatch_blocks) {
            /* Pieces are claimed from counter 2; once done, the block computes too. */
            dispatch_rows(&p.dispatch, smem, p.sched + 2, p.err, p.timeout_ns);
            /* The piece table's generic writes, before the GEMM's tensor loads reuse the space. */
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();
            if (trace && threadIdx.x == 0) trace[1] = cometi_globaltimer_ns();
        } else {
            if (p.dispatch.head_pieces) copy_head(&p.dispatch, blockIdx.x - dispatch_blocks, p.gemm_blocks, smem);
            if (trace && threadIdx.x == 0) trace[1] = p.dispatch.head_pieces ? cometi_globaltimer_ns() : 0;
        }
    } else {
        if (trace && threadIdx.x == 0) trace[1] = 0;
    }
    if (trace && threadIdx.x == 0) trace[0] = t_entry;
    const int block = blockIdx.x - dispatch_blocks; /* among the GEMM blocks (static schedule) */

    /* ---- the schedule and the ring ---- */
    const int total = build_tile_table(sm.first_tile, p.segs, p.local_rows, p.groups, TM, split_tiles,
                                       WGRAD ? (p.m_out + TM - 1) / TM : 0);
    if (threadIdx.x == 0) {
        /* Blocks that take tiles: every non-combine block on the shared counter (dispatch
         * blocks join once done), the GEMM blocks on the static split. */
        *sm.tail = cometi_gemm_tail_plan(total * p.n_splits,
                                         p.sched ? (int)gridDim.x - p.combine_blocks : p.gemm_blocks, k_blocks,
                                         !PINGPONG && p.tail_ws);
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&sm.full[s], E4M3 ? 33 : 1); /* the TMA's bytes (and E4M3: each scale lane's) */
            mbar_init(&sm.empty[s], PINGPONG ? 1 : 2); /* one arrive per consumer of the stage */
        }
        mbar_init(&sm.turn[0], 1);
        mbar_init(&sm.turn[1], 1);
        for (int s = 0; s < TICKETS; s++) {
            mbar_init(&sm.ticket_full[s], 1);
            /* every consumer thread has read the ticket (and E4M3: the scale warp) */
            mbar_init(&sm.ticket_empty[s], E4M3 ? 257 : 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_a) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_b) : "memory");
        if (TMA_EPILOGUE) asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_c) : "memory");
        if (SWIGLU) asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_up) : "memory");
        if (cometi_gemm_keeps_gu(T.epilogue) && p.gu_tma) asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_gu) : "memory");
    }
    __syncthreads();
    const int per_split = sm.first_tile[2 * p.groups];
    const cometi_tail_plan_t *tail = sm.tail;

    /* ---- the producer ---- */
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if constexpr (E4M3) {
            if (threadIdx.x / 32 == 1) { /* the scale warp: the same tiles as the TMA thread */
                ring_pos_t pos = {0, 0};
                for (int ordinal = 0;; ordinal++) {
                    int t = block + ordinal * p.gemm_blocks;
                    if (p.sched) {
                        const int s = ordinal % TICKETS;
                        /* lane 0 reads the ticket and releases its slot by its own arrival */
                        if (threadIdx.x % 32 == 0) {
                            mbar_wait(&sm.ticket_full[s], ordinal / TICKETS & 1, p.err, p.timeout_ns);
                            t = sm.tickets[s];
                            mbar_arrive(&sm.ticket_empty[s]);
                        }
                        t = __shfl_sync(0xffffffffu, t, 0);
                    }
                    if (t >= tail->units) break;
                    const unit_t un = decode_unit(t, tail, k_blocks);
                    const tile_t tl = split_tile(un.tile, per_split, sm.first_tile, p.groups, split_tiles, p.group_m);
                    const int2 span = unit_loads<V>(p, tl, un);
                    const int a_row = span.x, kb1 = span.y;
                    if constexpr (DISPATCH) { /* the rows' scales travel with them */
                        const int blk = a_row / BM;
                        cometi_wait_geq(p.arrive + blk, p.expected[blk], p.arrival_timeout_ns, p.err,
                                        COMETI_SITE_ARRIVAL, -1, blk);
                    }
                    produce_scales_unit<V>(p, sm, tl, a_row, un.kb0, kb1, &pos);
                }
                cp_async_wait_all(); /* the last scale copies land before the warp leaves */
            }
        }
        if (threadIdx.x != 0) return;
        ring_pos_t pos = {0, 0};
        /* Dynamic schedule: take a ticket (the next tile of the whole grid) one tile ahead,
         * so the atomic's latency hides behind this tile's loads, and pass each to the
         * consumers through the ticket ring; the ticket past the end tells them to stop.
         * Where blocks run out of phase (dispatch blocks join as they finish), a ticket held
         * for a whole tile keeps the last tiles from the blocks that are free first: there,
         * in the last two rounds, the ticket is taken LATE_CLAIM_KBLOCKS steps before this
         * tile's last load. */
        const bool staggered = DISPATCH && p.sched && dispatch_blocks > 0;
        const int late_from = tail->units - 2 * ((int)gridDim.x - p.combine_blocks);
        int t = p.sched ? (int)atomicAdd(&p.sched[0], 1u) : block;
        for (int ordinal = 0;; ordinal++) {
            int next = t;
            bool claimed = !p.sched || t >= tail->units;
            if (!claimed && !(staggered && t >= late_from)) next = (int)atomicAdd(&p.sched[0], 1u), claimed = true;
            if (p.sched) {
                const int s = ordinal % TICKETS;
                mbar_wait(&sm.ticket_empty[s], (ordinal / TICKETS & 1) ^ 1, p.err, p.timeout_ns);
                sm.tickets[s] = t;
                mbar_arrive(&sm.ticket_full[s]);
            }
            if (t >= tail->units) break;
            unsigned long long *rec = trace && ordinal < COMETI_TILE_TRACE_TILES ? trace + 4 + 4 * ordinal : NULL;
            if (rec) rec[0] = (unsigned long long)t, rec[1] = rec[2] = cometi_globaltimer_ns();
            const unit_t un = decode_unit(t, tail, k_blocks);
            tile_t tl = split_tile(un.tile, per_split, sm.first_tile, p.groups, split_tiles, p.group_m);
            const int2 span = unit_loads<V>(p, tl, un);
            const int a_row = span.x, kb1 = span.y;
            if constexpr (DISPATCH) {
                /* Every row of this 128-row block has arrived (from any rank); the rows were
                 * written by ordinary stores, so order them before the TMA's async reads. */
                const int blk = a_row / BM;
                cometi_wait_geq(p.arrive + blk, p.expected[blk], p.arrival_timeout_ns, p.err, COMETI_SITE_ARRIVAL, -1,
                                blk);
                asm volatile("fence.proxy.async.global;" ::: "memory");
                if (rec) rec[2] = cometi_globaltimer_ns();
            }
            produce_unit<V>(p, sm, &map_a, &map_b, &map_up, tl, a_row, un.kb0, kb1, &pos, &claimed, &next);
            t = p.sched ? next : t + p.gemm_blocks;
            if (trace) trace[2] = (unsigned long long)ordinal + 1;
        }
        /* The last block to finish taking tickets resets the counters for the next call
         * (kernels on one stream do not overlap, so nobody reads them in between). */
        if (p.sched) __threadfence(); /* this block's last ticket before its "done" */
        if (p.sched && atomicAdd(&p.sched[1], 1u) == gridDim.x - p.combine_blocks - 1) {
            for (int i = 0; i < 3; i++) p.sched[i] = 0; /* words 3, 4 are the combine blocks' */
        }
        return;
    }

    /* ---- the consumers ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, half = wg - 1;
    if (TMA_EPILOGUE && PUSH_OR_SPLITS && p.push_dest && threadIdx.x % 128 == 0) {
        /* The push's maps live in global memory, written by the host (cudaMemcpy): the thread
         * that stores through them acquires them into the tensormap proxy first (CUDA
         * programming guide, "tensor map in global memory"). */
        for (int r = 0; r < p.combine.world; r++) {
            asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;" ::"l"((uint64_t)&p.push_maps[r])
                         : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&p.push_maps[r]) : "memory");
        }
    }
    float acc[BN / 2];
    ring_pos_t pos = {0, 0};
    uint32_t turn_phase = 0;
    epilogue_state_t st = {-1, 0};
    /* Timeline: one thread per tile notes when its epilogue is issued (at the top of the
     * next turn, since the epilogue has several ways out). */
    const bool recorder = trace && threadIdx.x % 128 == 0 && (PINGPONG || half == 0);
    int traced = -1; /* this recorder's tile whose end is not noted yet */
    for (int ordinal = 0;; ordinal++) {
        if (traced >= 0) trace[4 + 4 * traced + 3] = cometi_globaltimer_ns(), traced = -1;
        int t = block + ordinal * p.gemm_blocks;
        if (p.sched) {
            const int s = ordinal % TICKETS;
            mbar_wait(&sm.ticket_full[s], ordinal / TICKETS & 1, p.err, p.timeout_ns);
            t = sm.tickets[s];
            mbar_arrive(&sm.ticket_empty[s]);
        }
        if (t >= tail->units) break;
        if (PINGPONG && (ordinal & 1) != half) {
            /* The other consumer's tile: step over its stages in the ring. */
            int next = pos.stage + k_blocks;
            pos.phase ^= (uint32_t)(next / STAGES) & 1;
            pos.stage = next % STAGES;
            continue;
        }
        /* Ping-pong: mainloops take turns. Waiting for the other warpgroup to have issued
         * its tile's MMAs means it has seen every fill of that tile's stages, so the
         * parity this warpgroup waits for next cannot be a fill two phases old. */
        if (PINGPONG && ordinal > 0) {
            mbar_wait(&sm.turn[half], turn_phase, p.err, p.timeout_ns);
            turn_phase ^= 1;
        }
        if (recorder && ordinal < COMETI_TILE_TRACE_TILES) traced = ordinal;
        const unit_t un = decode_unit(t, tail, k_blocks);
        tile_t tl = split_tile(un.tile, per_split, sm.first_tile, p.groups, split_tiles, p.group_m);
        const int part = tl.m * TM + (PINGPONG ? 0 : half * 64); /* first row of this warpgroup's part */
        cometi_segment_t seg = p.segs[tl.group];
        const int kb1 = WGRAD ? (seg.rows + BK - 1) / BK : un.kb1;
        if (WGRAD) seg.start = tl.group * p.m_out, seg.rows = p.m_out; /* the group's rows of C */
        push_rows_t push;
        push.first = make_int2(-1, 0), push.last = push.first, push.row[0] = push.row[1] = push.first;
        if (TMA_EPILOGUE && PUSH_OR_SPLITS && p.push_dest) push = load_push_rows(p, tl, part, warp * 16 + lane / 4);
        if constexpr (E4M3)
            consume_unit_e4m3<V>(acc, p, sm, PINGPONG ? 0 : half * 64 * 128, un.kb0, kb1, &pos, &sm.turn[half ^ 1]);
        else
            consume_unit<V>(acc, p, sm, PINGPONG ? 0 : half * 64 * 128, un.kb0, kb1, &pos, &sm.turn[half ^ 1]);
        if (!PINGPONG && t >= tail->first && exchange_cut_partials<BN, E4M3>(acc, p, tail, t, k_blocks)) continue;
        if constexpr (cometi_gemm_quantizes(T.epilogue))
            store_tile_e4m3<V>(acc, p, &map_c, &map_gu, sm.c, tl, seg, part, half);
        else
            store_tile<V>(acc, p, &map_c, &map_gu, sm.c, tl, seg, part, half, split_tiles, push, &st, kb1 <= un.kb0);
    }
    if (recorder) trace[3] = cometi_globaltimer_ns();
    finish_stores<V>(p, half, &st);
}

/* ---- the launch ---- */

template <int V>
static cudaError_t launch(const cometi_gemm_maps_t *m, const cometi_gemm_args_t *args, int blocks, cudaStream_t stream)
{
    /* The shared-memory limit is set per device, once (setting it twice is harmless). */
    static unsigned long long configured;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const size_t smem = cometi_gemm_smem_bytes(cometi_gemm_variants[V]);
    if (dev >= 64 || !(configured >> dev & 1)) {
        e = cudaFuncSetAttribute(grouped_gemm_kernel<V>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
        if (dev < 64) configured |= 1ull << dev;
    }
    cudaLaunchAttribute pdl[1];
    const cudaLaunchConfig_t cfg = cometi_pdl_config(blocks, THREADS, smem, stream, pdl);
    return cudaLaunchKernelEx(&cfg, grouped_gemm_kernel<V>, m->a,
                              m->b, m->up, m->c, m->gu, *args);
}

/* Row V's kernel where it belongs to FAMILY (variants.h's cometi_gemm_family), else nothing
 * is compiled for it here. */
template <int FAMILY, int V>
static cudaError_t launch_if_in(const cometi_gemm_plan_t *pr, cudaStream_t stream)
{
    if constexpr (cometi_gemm_family(cometi_gemm_variants[V]) == FAMILY)
        return launch<V>(&pr->maps, &pr->args, pr->blocks, stream);
    else
        return cudaErrorInvalidValue;
}

/* A case per row of the table: the launch switch of one family's file. */
template <int FAMILY>
static cudaError_t launch_family(const cometi_gemm_plan_t *pr, cudaStream_t stream)
{
    switch (pr->variant) {
#define LAUNCH_ROW(name, ...)                                                                                  \
    case COMETI_GEMM_V_##name:                                                                                 \
        return launch_if_in<FAMILY, COMETI_GEMM_V_##name>(pr, stream);
        COMETI_GEMM_VARIANTS(LAUNCH_ROW)
#undef LAUNCH_ROW
    }
    return cudaErrorInvalidValue; /* not a row of the table */
}

#endif /* COMET_GEMM_KERNEL_CUH */
