/*
 * route_kernels.cu - the routing kernels: stable per-expert positions and counts (chunk_rank_kernel,
 * chunk_offset_kernel), and the device route (exchange_plan_kernel, place_rows_kernel),
 * which swaps counts with every peer through symmetric memory and builds the routing
 * plan of plan.h on the GPU. The plan must match cometi_route_plan_build exactly; a GPU
 * test compares them.
 */
#include <stdint.h>
#include <string.h>

#include "comm/route_kernels.h"
#include "base/launch.h"
#include "base/ptx.cuh"

#define ROUTE_THREADS 1024

/*
 * Stable positions in two steps, over the chunks of COMETI_ROUTE_CHUNK rows.
 * chunk_rank_kernel, block c: each row of chunk c gets its rank among the chunk's rows of
 * its expert (token order), and chunk_counts[e][c] the chunk's count of expert e. Warp w
 * takes RANK_ROUNDS x 32 consecutive rows, all their ids loaded at once; in each round
 * __match_any_sync finds the lanes with the same expert, and the warp's running count per
 * expert (shared memory) gives the rows before. Then the warps' counts become their
 * starts. (Block (e, c) per expert, each walking the chunk for its one expert, took
 * 15 us at 64 experts x 65536 rows.) Rows with an id outside [0, E) get no position;
 * the first one's index goes to first_bad.
 */
#define RANK_THREADS 256
#define RANK_WARPS (RANK_THREADS / 32)
#define RANK_ROUNDS (COMETI_ROUTE_CHUNK / RANK_THREADS) /* rows per lane */
static_assert(COMETI_ROUTE_CHUNK % RANK_THREADS == 0 && RANK_WARPS * COMETI_MAX_EXPERTS * 4 <= 48 * 1024,
              "a chunk is whole rounds; the warps' counts fit the default shared memory");

static __global__ void __launch_bounds__(RANK_THREADS)
chunk_rank_kernel(const int32_t *ids, int n, int num_experts, int chunks, int32_t *chunk_counts, int32_t *pos,
                  unsigned int *first_bad)
{
    extern __shared__ int warp_count[]; /* [RANK_WARPS][E]: the warp's rows of each expert so far */
    const int c = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, E = num_experts;
    cometi_grid_launch_dependents(); /* the exchange may start: it waits for this kernel's end */
    for (int i = threadIdx.x; i < RANK_WARPS * E; i += RANK_THREADS) warp_count[i] = 0;
    const int base = c * COMETI_ROUTE_CHUNK + warp * 32 * RANK_ROUNDS + lane; /* this lane's first row */
    int id[RANK_ROUNDS], before[RANK_ROUNDS];
#pragma unroll
    for (int r = 0; r < RANK_ROUNDS; r++) id[r] = base + 32 * r < n ? ids[base + 32 * r] : -1;
    __syncthreads();
    int *mine = warp_count + warp * E;
#pragma unroll
    for (int r = 0; r < RANK_ROUNDS; r++) {
        const bool ok = id[r] >= 0 && id[r] < E;
        if (!ok && base + 32 * r < n) atomicMin(first_bad, (unsigned int)(base + 32 * r));
        const unsigned int same = __match_any_sync(0xffffffffu, id[r]);
        const int seen = ok ? mine[id[r]] : 0;
        before[r] = seen + __popc(same & ((1u << lane) - 1u));
        __syncwarp();
        if (ok && lane == __ffs(same) - 1) mine[id[r]] = seen + __popc(same);
        __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += RANK_THREADS) { /* warps' counts -> their starts */
        int sum = 0;
        for (int w = 0; w < RANK_WARPS; w++) {
            const int t = warp_count[w * E + e];
            warp_count[w * E + e] = sum;
            sum += t;
        }
        chunk_counts[(size_t)e * chunks + c] = sum;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < RANK_ROUNDS; r++)
        if (id[r] >= 0 && id[r] < E) pos[base + 32 * r] = before[r] + mine[id[r]];
}

/* Block c: adds to each of its rows the rows of the same expert in earlier chunks; the
 * last block also writes the totals. */
static __global__ void __launch_bounds__(ROUTE_THREADS)
chunk_offset_kernel(const int32_t *ids, int n, int num_experts, int chunks, const int32_t *chunk_counts,
                    int32_t *pos, int32_t *counts)
{
    extern __shared__ int before[]; /* [num_experts] */
    const int c = blockIdx.x;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        int sum = 0;
        for (int q = 0; q < c; q++) sum += chunk_counts[(size_t)e * chunks + q];
        before[e] = sum;
        if (c == chunks - 1) counts[e] = sum + chunk_counts[(size_t)e * chunks + c];
    }
    __syncthreads();
    const int end = min(n, (c + 1) * COMETI_ROUTE_CHUNK);
    for (int i = c * COMETI_ROUTE_CHUNK + threadIdx.x; i < end; i += blockDim.x) {
        const int e = ids[i];
        if (e >= 0 && e < num_experts) pos[i] += before[e];
    }
}

/* The chunks' ranks alone; chunk_offset_kernel, or the device route, adds the offsets.
 * Callers check num_experts (1..COMETI_MAX_EXPERTS: the ranks' shared memory). */
static cudaError_t launch_chunk_ranks(const int32_t *ids, int n, int num_experts, int32_t *pos,
                                      unsigned int *first_bad, int32_t *chunk_counts, cudaStream_t stream)
{
    chunk_rank_kernel<<<cometi_route_chunks(n), RANK_THREADS, sizeof(int) * RANK_WARPS * num_experts, stream>>>(
        ids, n, num_experts, cometi_route_chunks(n), chunk_counts, pos, first_bad);
    return cudaGetLastError();
}

extern "C" cudaError_t cometi_launch_route(const int32_t *ids, int n, int num_experts, int32_t *counts,
                                           int32_t *pos, unsigned int *first_bad, int32_t *chunk_counts,
                                           cudaStream_t stream)
{
    if (num_experts < 1 || num_experts > COMETI_MAX_EXPERTS) return cudaErrorInvalidValue;
    cudaError_t e = cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned int), stream);
    if (e == cudaSuccess) e = launch_chunk_ranks(ids, n, num_experts, pos, first_bad, chunk_counts, stream);
    if (e != cudaSuccess) return e;
    const int chunks = cometi_route_chunks(n);
    chunk_offset_kernel<<<chunks, ROUTE_THREADS, sizeof(int) * num_experts, stream>>>(ids, n, num_experts, chunks,
                                                                                     chunk_counts, pos, counts);
    return cudaGetLastError();
}

/* Peer tables as mapped here, passed by value. */
typedef struct peer_tables {
    int32_t *base[COMETI_MAX_RANKS];
} peer_tables_t;

#define PLAN_THREADS 1024

/*
 * One block. 1) Push this rank's counts into slot [me] of every peer's table (the half
 *    for this call's parity, so a peer one call ahead cannot overwrite what is read),
 *    each as one 8-byte word tagged with this call (release, system): the call number is
 *    one more than the last call's, kept in device memory (*seq). After the counts, one
 *    more word: the caller's `call` (types.h's COMETI_CALL_TRAIN_FORWARD).
 * 2) Wait for every peer's words of this call (acquire, timeout); meanwhile the last
 *    threads write the chunk prefixes. Every rank sees every rank's `call`: where they
 *    differ (ranks running the backwards of different forward calls, or a forward beside a
 *    backward), every rank records the error and empties its plan, as for a timeout.
 * 3) Build the plan of plan.h for tp ranks per group, with no serial walk: one thread per
 *    expert sums its segment over the sources (in the group's order) and pads it; then one
 *    warp per source scans that source's counts into its send offsets, and one warp per
 *    group scans its padded segments into their starts. Rows are placed by
 *    place_rows_kernel. The counts come from shared memory when world x E fits beside the
 *    padded sizes (counts_in_smem). The serial walks this replaced ran at one warp's
 *    latency (the receive side's with two integer divisions per step): the kernel took
 *    16-19 us at 64 experts, 7-8 after.
 */
/* Exclusive prefix sums of in[0..n) into out[0..n) (may be in) by one warp; the total. */
static __device__ __forceinline__ int warp_exclusive_scan(const int32_t *in, int32_t *out, int n)
{
    const int lane = threadIdx.x % 32;
    int carry = 0;
    for (int base = 0; base < n; base += 32) {
        const int i = base + lane, v = i < n ? in[i] : 0;
        int incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        if (i < n) out[i] = carry + incl - v;
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    return carry;
}

/* Step 4 of the exchange, by the whole block, once every count of this call is in cnt
 * ([world][E], shared or global memory) and in plan.counts, and a barrier passed:
 * seg_start_s is shared scratch of E ints. Ends with no barrier after the expected[]
 * additions (nothing in the block reads them). */
static __device__ void build_plan(const int32_t *cnt, int32_t *seg_start_s, int me, int world, int tp, int E,
                                  int block_m, cometi_route_dev_plan_t plan)
{
    const int groups = world / tp, per = E / groups;
    for (int e = threadIdx.x; e < E; e += blockDim.x) { /* expert e's segment, sources from its group's first rank */
        const int first = e / per * tp;
        int in_seg = 0;
        for (int i = 0; i < world; i++) {
            const int s = first + i < world ? first + i : first + i - world;
            plan.recv_offset[s * E + e] = in_seg;
            in_seg += cnt[s * E + e];
        }
        plan.seg_rows[e] = in_seg;
        seg_start_s[e] = (in_seg + block_m - 1) / block_m * block_m;
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int job = warp; job < world + groups; job += blockDim.x / 32) {
        if (job < world) { /* send side of rank s: destination-major = expert order */
            warp_exclusive_scan(cnt + job * E, plan.send_offset + job * E, E);
        } else { /* receive side of group d: padded segments one after another */
            const int d = job - world;
            const int rows = warp_exclusive_scan(seg_start_s + d * per, seg_start_s + d * per, per);
            __syncwarp();
            for (int i = lane; i < per; i += 32) plan.seg_start[d * per + i] = seg_start_s[d * per + i];
            if (lane == 0) plan.recv_rows[d] = rows;
        }
    }
    __syncthreads();
    /* This rank as a receiver: its segments, its own rows in each, and how many rows each
     * 128-row block receives in this call (added to the running totals), `sub` threads per
     * segment taking every sub-th block. */
    const int sub = per < (int)blockDim.x ? (int)blockDim.x / per : 1;
    for (int i = threadIdx.x; i < per * sub; i += blockDim.x) {
        const int le = i / sub, u = i % sub;
        const int e = me / tp * per + le, start = seg_start_s[e], rows = plan.seg_rows[e];
        if (u == 0) {
            plan.local_segs[le].start = start;
            plan.local_segs[le].rows = rows;
            /* This rank's own rows lead the segment unless, with TP, an earlier rank of the
             * group sent some (the layout is the group's; those rows arrive over NVLink). */
            const int own = plan.recv_offset[me * E + e] == 0 ? cnt[me * E + e] : 0;
            plan.local_rows[le] = own;
            /* The fused GEMM's view: without the first-wave kernel's row blocks (segment 0's
             * first min(own / block_m, wave_blocks), all own rows: cometi_first_rows). */
            if (plan.fused_segs) { /* NULL in a plan that only a test reads */
                const int skip = le == 0 && tp == 1 ? min(own / block_m, plan.wave_blocks) * block_m : 0;
                plan.fused_segs[le].start = start + skip;
                plan.fused_segs[le].rows = rows - skip;
                plan.fused_local_rows[le] = own - skip;
            }
        }
        for (int r = u * block_m; r < rows; r += sub * block_m)
            plan.expected[(start + r) / block_m] += min(block_m, rows - r);
    }
}

/* One expert's chunk counts summed, eight loads in flight (loads after a store to a
 * maybe-aliased array would each wait for the store before them); with prefix, each
 * chunk's rows of the expert in earlier chunks too. */
static __device__ __forceinline__ int sum_chunks(const int32_t *cnt, int chunks, int32_t *prefix)
{
    int sum = 0;
    for (int c0 = 0; c0 < chunks; c0 += 8) {
        int v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = c0 + u < chunks ? cnt[c0 + u] : 0;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            if (prefix && c0 + u < chunks) prefix[c0 + u] = sum;
            sum += v[u];
        }
    }
    return sum;
}

static __global__ void __launch_bounds__(PLAN_THREADS, 1)
exchange_plan_kernel(peer_tables_t peers, unsigned long long *mine, int me, int world, int tp, int E, int block_m,
                     unsigned long long *seq_counter, int32_t *local_counts, const int32_t *chunk_counts,
                     int32_t *chunk_prefix, int chunks,
                     const int32_t *ids, int n, cometi_route_dev_plan_t plan, int counts_in_smem,
                     unsigned int call, unsigned long long timeout_ns, cometi_async_error_t *err)
{
    cometi_grid_wait(); /* chunk_rank_kernel's counts */
    /* place_rows_kernel may start now, unless the first wave is on: its blocks would sit
     * on SMs the first-wave GEMM needs until the peers' counts arrive. */
    if (!plan.wave_blocks) cometi_grid_launch_dependents();
    /* This rank's counts: each expert's chunk counts summed. */
    __shared__ int32_t total_s[COMETI_MAX_EXPERTS];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int sum = sum_chunks(chunk_counts + (size_t)e * chunks, chunks, NULL);
        total_s[e] = sum;
        local_counts[e] = sum;
    }
    /* [world * E] counts when counts_in_smem, then [E] padded segment sizes -> starts */
    extern __shared__ int32_t counts_s[];
    __shared__ int failed;
    __shared__ unsigned long long seq_shared;
    if (threadIdx.x == 0) {
        failed = 0;
        seq_shared = *seq_counter + 1;
    }
    __syncthreads();
    const unsigned long long seq = seq_shared;
    const int half = (int)(seq & 1);
    /* Each count goes to every peer as one 8-byte word tagged with the call (never 0, and
     * different from the last call that used this half), so a peer takes it as soon as it
     * lands: no flag after the counts, so no wait for them to land before raising it. The
     * release orders this rank's earlier work (its last call's reads of its receive
     * buffer) before the count, as the flag did: a peer writes rows only after it. */
    const unsigned int tag = (unsigned int)(seq % 0xffffffffull) + 1u;
    const int row = E + 1; /* a rank's words: its counts, then its call */
    for (int i = threadIdx.x; i < world * row; i += blockDim.x) {
        const int p = i / row, e = i % row;
        unsigned long long *table = (unsigned long long *)peers.base[p];
        cometi_st_release_sys(table + (size_t)half * world * row + (size_t)me * row + e,
                              (unsigned long long)tag << 32 | (e < E ? (unsigned int)total_s[e] : call));
    }
    /* While the peers' words cross NVLink, the last threads turn each chunk's count into
     * the rows of its expert in earlier chunks, which place_rows_kernel adds to the chunk's
     * ranks (what chunk_offset_kernel does for the baseline, one launch fewer). */
    for (int e = (int)(blockDim.x - 1 - threadIdx.x); e < E; e += blockDim.x)
        sum_chunks(chunk_counts + (size_t)e * chunks, chunks, chunk_prefix + (size_t)e * chunks);
    /* The peers' counts of this call, as their words arrive. */
    const unsigned long long *words = mine + (size_t)half * world * row;
    bool dead = false; /* once a wait of this thread has failed, the rest are not waited for */
    for (int i = threadIdx.x; i < world * row; i += blockDim.x) {
        const int p = i / row, e = i % row;
        unsigned long long w = 0;
        if (!dead && !cometi_wait_tag(words + i, tag, timeout_ns, err, COMETI_SITE_ROUTE, p, e, &w))
            dead = true, failed = 1;
        const unsigned int v = (unsigned int)w;
        if (e == E) { /* rank p's call */
            if (!dead && v != call) {
                cometi_record_error(err, COMETI_ASYNC_INVALID_ARGUMENT, COMETI_SITE_CALL_MISMATCH, p, me, call, v, 0);
                failed = 1;
            }
            continue;
        }
        plan.counts[p * E + e] = (int32_t)v;
        if (counts_in_smem) counts_s[p * E + e] = (int32_t)v;
    }
    __syncthreads();
    /* Without every peer's counts of this call the plan would be stale: make it empty, so
     * this rank sends nothing and computes nothing, and peers time out cleanly instead of
     * receiving rows in wrong places. The timeout is already recorded. */
    if (failed) {
        for (int i = threadIdx.x; i < world * E; i += blockDim.x) {
            plan.counts[i] = 0;
            if (counts_in_smem) counts_s[i] = 0;
        }
    }
    __syncthreads();
    build_plan(counts_in_smem ? counts_s : plan.counts, counts_s + (counts_in_smem ? world * E : 0), me, world, tp, E,
               block_m, plan);
    if (threadIdx.x == 0) {
        *plan.failed = failed;
        *seq_counter = seq; /* read only by the next call's kernel, after this one ends */
    }
    if (threadIdx.x == 0) {
        const int first_bad = local_counts[E];
        if (first_bad != -1 && atomicCAS(&err->id_claim, 0, 1) == 0) {
            err->id_rank = me;
            err->id_index = first_bad;
            err->id_value = ids[first_bad];
            err->id_limit = E;
            __threadfence_system();
            *(volatile int *)&err->id_reported = 1;
        }
        local_counts[E] = -1; /* for the next call's ranks (set so at create): no memset launch */
    }
}

/* The plan of rank `me` from counts already known (no exchange), as the exchange builds
 * it: lets one GPU test the device plan at any world size. */
static __global__ void __launch_bounds__(PLAN_THREADS, 1)
plan_from_counts_kernel(const int32_t *counts, int me, int world, int tp, int E, int block_m,
                        cometi_route_dev_plan_t plan, int counts_in_smem)
{
    extern __shared__ int32_t counts_s[]; /* as exchange_plan_kernel's */
    for (int i = threadIdx.x; i < world * E; i += blockDim.x) {
        plan.counts[i] = counts[i];
        if (counts_in_smem) counts_s[i] = counts[i];
    }
    __syncthreads();
    build_plan(counts_in_smem ? counts_s : plan.counts, counts_s + (counts_in_smem ? world * E : 0), me, world, tp, E,
               block_m, plan);
}

extern "C" cudaError_t cometi_route_plan_from_counts(const int32_t *counts, int me, int world, int tp, int E,
                                                     int block_m, const cometi_route_dev_plan_t *plan,
                                                     int counts_in_smem, cudaStream_t stream)
{
    const size_t bytes = sizeof(int32_t) * ((counts_in_smem ? (size_t)world * E : 0) + (size_t)E);
    if (world < 1 || tp < 1 || world % tp || E < 1 || E > COMETI_MAX_EXPERTS || E % (world / tp) || me < 0 ||
        me >= world || block_m < 1 || bytes > 48 * 1024 - 64)
        return cudaErrorInvalidValue;
    plan_from_counts_kernel<<<1, PLAN_THREADS, bytes, stream>>>(counts, me, world, tp, E, block_m, *plan,
                                                                 counts_in_smem);
    return cudaGetLastError();
}

/* Every row's rank among this rank's rows of its expert (its chunk's rank plus the rows
 * of earlier chunks, prefix[e][chunk] from the exchange), its place in its owner's receive
 * buffer and in the send order, over many blocks (one block took 0.06 ms for 65536 rows),
 * and with weights, its record for layer1 (in send order; see cometi_choice_slot).
 * Nothing is placed when the exchange failed. */
static __device__ __forceinline__ int row_rank(const int32_t *chunk_pos, const int32_t *prefix, int chunks, int i,
                                               int e)
{
    return chunk_pos[i] + prefix[(size_t)e * chunks + i / COMETI_ROUTE_CHUNK];
}

/* The token's choices lie in one warp when k divides 32 (blocks and warps start at
 * multiples of 32, so at a token's first choice): each lane then reads the others' ranks
 * and receive rows with shuffles, one division and no loads per choice, where
 * cometi_choice_slot loads and divides k times (its records took 10 of place's 12 us on
 * qwen2-57b). Lanes past n take part with no token. */
static __device__ __forceinline__ cometi_row_meta_t warp_record(int rank, int recv, int j, int k, int t, int world)
{
    const int first = (int)(threadIdx.x % 32) - j;
    uint64_t seen_lo = 0, seen_hi = 0; /* ranks below COMETI_MAX_RANKS (72) */
    int slot = 0, lead = 1, next = -1;
    for (int c = 0; c < k; c++) {
        const int r = __shfl_sync(0xffffffffu, rank, first + c), at = __shfl_sync(0xffffffffu, recv, first + c);
        if (r < 0 || c == j) continue; /* an invalid id, or this choice */
        if (c < j) {
            const uint64_t bit = 1ull << (r & 63);
            const bool was_seen = (r < 64 ? seen_lo : seen_hi) & bit;
            if (r < 64) seen_lo |= bit; else seen_hi |= bit;
            slot += !was_seen; /* a rank counts once, at its first choice */
            if (r == rank) lead = 0;
        } else if (r == rank && next < 0) {
            next = at;
        }
    }
    cometi_row_meta_t m;
    m.slot = lead ? t * min(k, world) + slot : -1;
    m.next = next;
    return m;
}

static_assert(sizeof(cometi_row_meta_t) == 16, "a record is one 16-byte store");

static __global__ void place_rows_kernel(const int32_t *ids, const float *weights, int n, int k, int E, int me,
                                         int world, int tp, const int32_t *chunk_pos, const int32_t *prefix,
                                         int chunks, cometi_route_dev_plan_t plan, cometi_row_meta_t *meta)
{
    cometi_grid_wait(); /* the exchange's plan */
    cometi_grid_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x, per = E / (world / tp);
    const bool in = i < n, warp_records = meta && 32 % k == 0;
    if (!in && !warp_records) return;
    const int e = in ? ids[i] : -1;
    const bool valid = e >= 0 && e < E, ok = valid && !*plan.failed;
    const int pos = valid ? row_rank(chunk_pos, prefix, chunks, i, e) : 0;
    if (valid) plan.pos[i] = pos;
    const int recv = ok ? plan.seg_start[e] + plan.recv_offset[me * E + e] + pos : -1;
    if (in) plan.recv_pos[i] = recv;
    const int at = ok ? plan.send_offset[me * E + e] + pos : -1;
    if (ok) plan.src_of[at] = i;
    if (!meta) return;
    const int t = i / k, j = i % k;
    cometi_row_meta_t m;
    if (warp_records) {
        /* Every lane to the end: the shuffles need the whole warp. With ok false on one
         * lane of a valid id, the exchange failed and no lane writes. */
        m = warp_record(valid ? e / per : -1, recv, j, k, t, world);
    } else {
        if (!ok) return;
        int next;
        const int slot = cometi_choice_slot(ids + (size_t)t * k, k, j, E, per, &next);
        m.slot = slot >= 0 ? t * min(k, world) + slot : -1;
        if (next >= 0) { /* where the next choice lands: the same formula as recv_pos */
            const int en = ids[(size_t)t * k + next];
            m.next = plan.seg_start[en] + plan.recv_offset[me * E + en] +
                     row_rank(chunk_pos, prefix, chunks, t * k + next, en);
        } else {
            m.next = -1;
        }
    }
    if (!ok) return;
    /* One 16-byte store (the window and the records are 16-byte aligned), not four. */
    *(int4 *)&meta[at] = make_int4(m.slot, m.next, __float_as_int(weights[i]), me);
}

extern "C" cudaError_t cometi_route_launch_chunk_ranks(const int32_t *ids, int n, int num_experts, int32_t *pos,
                                                       unsigned int *first_bad, int32_t *chunk_counts,
                                                       cudaStream_t stream)
{
    return launch_chunk_ranks(ids, n, num_experts, pos, first_bad, chunk_counts, stream);
}

extern "C" cudaError_t cometi_route_launch_exchange(const cometi_route_exchange_t *x, cudaStream_t stream)
{
    peer_tables_t peers;
    memset(&peers, 0, sizeof(peers));
    for (int p = 0; p < x->world; p++) peers.base[p] = x->peer_tables[p];
    const size_t counts_bytes = sizeof(int32_t) * (size_t)x->world * x->num_experts,
                 sizes_bytes = sizeof(int32_t) * (size_t)x->num_experts;
    cudaLaunchAttribute pdl[1];
    const cudaLaunchConfig_t cfg =
        cometi_pdl_config(1, PLAN_THREADS, (x->counts_in_smem ? counts_bytes : 0) + sizes_bytes, stream, pdl);
    return cudaLaunchKernelEx(&cfg, exchange_plan_kernel, peers, x->mine, x->me, x->world, x->tp, x->num_experts,
                              x->block_m, x->seq, x->local_counts, x->chunk_counts, x->chunk_prefix, x->chunks, x->ids,
                              x->n, x->plan, x->counts_in_smem, x->call, x->timeout_ns, x->err);
}

extern "C" cudaError_t cometi_route_launch_place_rows(const int32_t *ids, const float *weights, int n, int k, int E,
                                                      int me, int world, int tp, const int32_t *chunk_pos,
                                                      const int32_t *chunk_prefix, int chunks,
                                                      const cometi_route_dev_plan_t *plan, cometi_row_meta_t *meta,
                                                      cudaStream_t stream)
{
    cudaLaunchAttribute pdl[1];
    const cudaLaunchConfig_t cfg = cometi_pdl_config((n + 255) / 256, 256, 0, stream, pdl);
    return cudaLaunchKernelEx(&cfg, place_rows_kernel, ids, weights, n, k, E, me, world, tp, chunk_pos, chunk_prefix,
                              chunks, *plan, meta);
}
