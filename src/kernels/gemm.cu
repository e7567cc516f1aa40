/*
 * gemm.cu - the persistent, warp-specialized grouped GEMM (sm_90a).
 *
 * One block per SM, 384 threads: warpgroup 0 is the producer (one thread issues TMA
 * loads of A and B tiles into a ring of shared-memory stages, completing on mbarriers);
 * warpgroups 1 and 2 are consumers. Cooperative schedule: both split each 128-row tile
 * (64 rows each). Ping-pong schedule: each takes every other 64-row tile, so one's
 * epilogue runs while the other multiplies. Either way they multiply with wgmma.mma_async, accumulating in registers, then store bf16 to C: either
 * straight from registers, or (the TMA epilogue) into swizzled shared memory that one
 * thread hands to an asynchronous TMA store, so the next tile's MMAs start at once.
 * Tiles are walked group by group; inside a group, group_m row tiles at a time with the
 * row tile fastest, so the blocks running at once share B tiles and A tiles in L2.
 * The group table (rows per expert) is read on the device: no host sync.
 *
 * Epilogue options: SwiGLU (gate and up columns of one expert meet in one 128x256 tile,
 * so GEMM0's output is the activation itself, F wide), a per-row scale (the top-k
 * weight), and rows stored to an index (scatter).
 *
 * Checklist followed (shared/KERNELS.md): 128B-swizzled K-major tiles of 64 bf16, stages
 * 1024-byte aligned, full[s] count 1 with expect_tx, empty[s] count 2 (one arrive per
 * consumer warpgroup), wgmma fence / commit / wait before touching accumulators or
 * releasing a stage, setmaxnreg 40 / 232.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "ptx.cuh"
#include "wgmma.cuh"
#include "combine.cuh"
#include "row_copy.cuh"

#define BM 128
#define BK 64
#define THREADS 384
#define TICKETS 4 /* tiles the producer may announce ahead of the consumers (dynamic schedule) */

/* With dispatch blocks, in the last two rounds of tiles, how many k-steps before a tile's
 * last load its block takes its next ticket: early enough that the atomic's round trip
 * hides behind the stages still to compute, late enough that the ticket is not held while
 * other blocks go idle (the fused qwen2-57b layer0's tail: 40-45 us per SM with the ticket
 * taken a tile ahead, 25-29 with 8 steps; docs/PERF.md Z2). Taken late on every tile, it
 * left qwen2-moe-2.7b's layer0 1.5% slower (Z6). */
#define LATE_CLAIM_KBLOCKS 8

/* The epilogue's staging in shared memory for 128 rows of `on` columns: the TMA store's
 * swizzled boxes (C's, or the push's whole parts), 64 rows per consumer warpgroup. */
static __host__ __device__ constexpr uint32_t c_stage_bytes(int on) { return BM * on * 2; }

/* Where 16-byte chunk j (8 columns) of staged row r goes among the TMA store's boxes of 64
 * rows x 128 bytes, 128B-swizzled: the chunk index XOR the row's low 3 bits (conflict-free,
 * and the layout the store reads). */
static __device__ __forceinline__ uint32_t swizzled_chunk(int j, int r)
{
    return (uint32_t)((j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) << 4));
}

/* ---- PTX: TMA tensor copies, wgmma bookkeeping (barriers and bulk copies: ptx.cuh) ---- */

static __device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, int inner, int outer, uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(smem_u32(bar))
                 : "memory");
}

/* A box of a 3D tensor [outer2][outer][inner]: rows past `outer` come back as zeros. */
static __device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map, int inner, int outer, int outer2,
                                                   uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(outer2), "r"(smem_u32(bar))
                 : "memory");
}

static __device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, const void *src, int inner, int outer)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"((uint64_t)map), "r"(inner), "r"(outer), "r"(smem_u32(src))
                 : "memory");
}

/* Barrier for the 128 threads of one warpgroup (ids 1 and 2; 0 is __syncthreads). */
static __device__ __forceinline__ void warpgroup_sync(int id)
{
    asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

/* A named barrier for one warp (ids 3..10: consumer warp 0..7), a synchronizing operation
 * in PTX's memory model, which __syncwarp is not stated to be. */
static __device__ __forceinline__ void warp_bar_sync(int id) { asm volatile("bar.sync %0, 32;" ::"r"(id) : "memory"); }
/* Both consumer warpgroups of a cooperative tile (barrier 11: 1-2 are the warpgroups',
 * 3-10 the warps'). */
static __device__ __forceinline__ void consumers_sync(void) { asm volatile("bar.sync 11, 256;" ::: "memory"); }

/* Shared-memory matrix descriptor for a K-major tile with 128-byte swizzle: rows of 128
 * bytes, 8-row groups 1024 bytes apart (SBO), leading offset unused (1). */
static __device__ __forceinline__ uint64_t smem_desc(const void *p)
{
    uint64_t addr = smem_u32(p);
    return ((addr & 0x3ffff) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

static __device__ __forceinline__ void wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> static __device__ __forceinline__ void wgmma_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* silu(x) = x / (1 + exp(-x)) with the fast divide (an RCP and a multiply, 2 ulp): the IEEE
 * division's Newton steps and range check cost 64 values x ~8 instructions per thread in
 * an epilogue the cooperative schedule does not overlap with MMAs. Below x = -87.3 the
 * denominator passes 2^126, where __fdividef gives 0 (and x / inf = -0 below -88.7): the
 * true value is under 1e-36. (tanh.approx would save the second MUFU op too, but its
 * 2^-11 error turns into 0.5% of silu for x near -3.) */
static __device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }


/* ---- tile schedule ---- */

typedef struct gemm_args {
    const cometi_segment_t *segs;
    int groups, n, k, ldc, group_m;
    int b_group_rows;                 /* B rows per group (without SwiGLU) */
    const float *row_scale;
    const int32_t *row_index;
    const int32_t *local_rows;
    const unsigned long long *arrive, *expected;
    int gemm_blocks;
    unsigned int *sched; /* tiles taken, blocks done, pieces taken; NULL: static */
    int n_splits;                        /* column splits, tiles split-major (1: one split) */
    const int2 *push_dest;               /* rows to their owners' slots (layer1 push; see gemm.h) */
    const CUtensorMap *push_maps;        /* [world] each owner's slots, in global memory */
    unsigned long long *split_done;      /* [n_splits] rows finished per split, or NULL */
    cometi_dispatch_t dispatch;
    int combine_blocks;                  /* the first blocks combine instead (they never compute) */
    cometi_combine_t combine;
    __nv_bfloat16 *c;
    cometi_async_error_t *err;
    unsigned long long timeout_ns;         /* pipeline waits */
    unsigned long long arrival_timeout_ns; /* waits for rows from peers (shorter: a missing
                                            * peer is reported as such, not as a stuck pipeline) */
    unsigned long long *tile_trace;        /* see gemm.h, or NULL */
    unsigned long long *tail_ws;           /* see gemm.h, or NULL */
} gemm_args_t;

typedef struct tile {
    int group, m, n; /* row tile inside the group, column tile */
} tile_t;

/* Tiles come in two phases (COMET's rescheduling): phase 0 holds the row tiles made only
 * of local rows (the head of each group), phase 1 the rest. Entry i = phase * groups + g;
 * first_tile[i] is its first tile, first_tile[2 * groups] the total. Entry i has
 * (first_tile[i + 1] - first_tile[i]) / n_tiles row tiles; phase 1's start after phase 0's. */
static __device__ __forceinline__ tile_t decode_tile(int t, const int *first_tile, int groups, int n_tiles,
                                                     int group_m)
{
    int lo = 0, hi = 2 * groups - 1; /* the last entry whose first tile is <= t */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first_tile[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int g = lo % groups, mt = (first_tile[lo + 1] - first_tile[lo]) / n_tiles;
    const int m_first = lo >= groups ? (first_tile[g + 1] - first_tile[g]) / n_tiles : 0;
    int local = t - first_tile[lo];
    /* Bands of group_m row tiles; inside a band the row tile runs fastest. */
    int band = local / (group_m * n_tiles), band_rows = min(group_m, mt - band * group_m);
    int in_band = local - band * group_m * n_tiles;
    tile_t r;
    r.group = g;
    r.m = m_first + band * group_m + in_band % band_rows;
    r.n = in_band / band_rows;
    return r;
}

/* The last wave cut along k (tail_ws set, cooperative schedule). When the tiles leave a
 * last wave that would hold some blocks idle, each of its tiles may become a few units
 * (cometi_gemm_tail_plan), so the wave's idle SMs share its work: on skewed mixtral GEMM1
 * the last of 3.15 waves of 166 us tiles held every other SM idle for a fifth of the
 * kernel (docs/PERF.md X2). Units are tickets:
 * first the whole tiles, then each cut tile's parts in order. A part other than the
 * last stores its fp32 accumulators to the workspace and counts itself; the last part,
 * taken after the others (tickets go in order, and on the static split a block's
 * tickets grow), waits for them, adds their partials in part order (the same bits every
 * run) and runs the tile's epilogue. No deadlock, by induction on tickets: every block
 * is resident (one per SM, the grid within the SMs) and takes its tickets in increasing
 * order, a last part waits only for parts with smaller tickets, whose blocks reach them
 * after only smaller tickets (over several rounds too), and nothing else a block waits on
 * (stages, tickets, rows from the dispatch) depends on a larger ticket. The plan is
 * cometi_gemm_tail_plan (gemm.h). */
typedef struct unit {
    int tile, kb0, kb1; /* the tile, its k-blocks [kb0, kb1) */
    int part;           /* -1: the whole tile; else which of the cut tile's parts */
} unit_t;

static __device__ __forceinline__ unit_t decode_unit(int u, const cometi_tail_plan_t *s, int k_blocks)
{
    unit_t r = {u, 0, k_blocks, -1};
    if (u < s->first) return r;
    const int x = (u - s->first) / s->parts, part = (u - s->first) - x * s->parts;
    r.tile = s->first + x;
    r.kb0 = part * k_blocks / s->parts;
    r.kb1 = (part + 1) * k_blocks / s->parts;
    r.part = part;
    return r;
}

/* With n_splits > 1 the tiles go split by split (COMET's layer1 order: a column split is
 * finished for every row before the next starts); inside a split, the order above over
 * the split's columns. `per_split` tiles a split. */
static __device__ __forceinline__ tile_t split_tile(int t, int per_split, const int *first_tile, int groups,
                                                    int split_tiles, int group_m)
{
    const int split = t / per_split;
    tile_t r = decode_tile(t - split * per_split, first_tile, groups, split_tiles, group_m);
    r.n += split * split_tiles;
    return r;
}

/* Dispatch. This rank's rows for expert e form one contiguous run of its owner's
 * receive buffer; cut at the owner's 128-row block boundaries, each run gives pieces of
 * at most 128 rows. A worker (a warp) copies one piece, then adds the piece's row count
 * to the owner's counter for that block with one release at system scope, which orders
 * the piece's writes before the count: one fence per piece, not per row. Pieces for
 * local experts go first, so local tiles can start at once. Workers take pieces
 * round-robin. Two ways to copy a piece (COMETI_DISPATCH_*): */

/* Stores: the warp's lanes load and store 16 bytes at a time (row_copy.cuh). */
static __device__ void copy_piece_stores(const cometi_dispatch_t *d, const int32_t *src_of, int n_rows, uint4 *out)
{
    const int vecs = d->hidden / 8;
    for (int q = 0; q < n_rows; q++)
        cometi_warp_copy_row(out + (size_t)q * vecs, (const uint4 *)d->x + (size_t)(src_of[q] / d->top_k) * vecs, vecs);
    __syncwarp();
}

/* Bulk: one thread moves whole rows with the copy engine, through a ring of shared-memory
 * slots in BULK_GROUPS groups of BULK_GROUP consecutive slots: the rows of a group of the
 * piece are bulk-loaded one by one into a ring group (completing on its mbarrier), and
 * BULK_LAG_GROUPS groups later stored to the owner with one bulk store, since the piece's
 * receive rows are consecutive. Neither ring depth nor workers per block moved a block's
 * 35 GB/s (docs/PERF.md X3), which implies about 95 ns per copy for 4 and 7 KB rows alike:
 * the SM's copy engine takes them one at a time. Fewer copies per row copy faster: 1.25
 * here against 2 with a store per row made the dispatch-bound counts 3-12% faster (X8).
 * A ring group is loaded again only once the store that last used it has read it. At the
 * end of the piece every store must have landed (wait_group 0, then the proxy fence:
 * async writes before the generic release). */
#define BULK_SLOTS 12
#define BULK_GROUP 4
#define BULK_GROUPS (BULK_SLOTS / BULK_GROUP)
#define BULK_LAG_GROUPS 1

typedef struct bulk_ring {
    unsigned char *slots; /* BULK_SLOTS rows */
    uint64_t *full;       /* BULK_GROUPS mbarriers */
    uint32_t parity;      /* bit s: the phase ring group s waits for next */
    uint32_t row_bytes;
} bulk_ring_t;

static __device__ void copy_piece_bulk(const cometi_dispatch_t *d, bulk_ring_t *ring, const int32_t *src_of, int n_rows,
                                       unsigned char *out, cometi_async_error_t *err, unsigned long long timeout_ns)
{
    const uint32_t rb = ring->row_bytes;
    const int groups = (n_rows + BULK_GROUP - 1) / BULK_GROUP;
    /* The rows' token indices come a group at a time, the next group's loads in flight
     * while this one's rows are issued: one load per row ahead of its copy made every row
     * wait for a trip to L2, about 4 KB per microsecond per worker. */
    int src[BULK_GROUP], next[BULK_GROUP];
#pragma unroll
    for (int i = 0; i < BULK_GROUP; i++) src[i] = i < n_rows ? src_of[i] : 0;
    for (int g = 0; g < groups + BULK_LAG_GROUPS; g++) {
        const int q0 = g * BULK_GROUP;
#pragma unroll
        for (int i = 0; i < BULK_GROUP; i++) next[i] = q0 + BULK_GROUP + i < n_rows ? src_of[q0 + BULK_GROUP + i] : 0;
        if (g < groups) {
            const int s = g % BULK_GROUPS, rows = min(BULK_GROUP, n_rows - q0);
            /* Stores issued so far: groups < g - LAG. The one that used ring group s (group
             * g - GROUPS) has read it once at most GROUPS - LAG - 1 newer ones are reading. */
            asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(BULK_GROUPS - BULK_LAG_GROUPS - 1) : "memory");
            mbar_expect_tx(&ring->full[s], rows * rb);
#pragma unroll
            for (int i = 0; i < BULK_GROUP; i++)
                if (i < rows)
                    bulk_load(ring->slots + (size_t)(s * BULK_GROUP + i) * rb,
                              (const unsigned char *)d->x + (size_t)(src[i] / d->top_k) * rb, rb, &ring->full[s]);
        }
        const int r = g - BULK_LAG_GROUPS;
        if (r >= 0) {
            const int s = r % BULK_GROUPS, rows = min(BULK_GROUP, n_rows - r * BULK_GROUP);
            mbar_wait(&ring->full[s], ring->parity >> s & 1, err, timeout_ns);
            ring->parity ^= 1u << s;
            bulk_store(out + (size_t)r * BULK_GROUP * rb, ring->slots + (size_t)s * BULK_GROUP * rb, rows * rb);
            bulk_commit();
        }
#pragma unroll
        for (int i = 0; i < BULK_GROUP; i++) src[i] = next[i];
    }
    bulk_wait();
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* Pieces: each (source rank, expert) chunk of rows, cut where the receiver's 128-row
 * blocks end (a block counts its arrivals). Two lists, in expert order: 0, the pieces to
 * experts this rank's group owns (the first GEMM tiles need those rows), 1, the others.
 * piece_table[list][e] (in shared memory) is the number of the list's pieces before
 * expert e, built once per block, so a worker finds its claimed piece by a binary search
 * (walking the plan from its last piece took a few dependent loads per piece passed, and
 * the other workers' pieces lie between). */
#define PIECE_TABLE_BYTES (2 * (COMETI_MAX_EXPERTS + 1) * 4 + 120) /* 8320: keeps the rings 128-byte aligned */

static __device__ __forceinline__ int piece_first_row(const cometi_dispatch_t *d, int e)
{
    return d->seg_start[e] + d->recv_offset[d->rank * d->num_experts + e];
}

/* Piece i of a list (table: that list's prefix counts): its expert, first receive row,
 * rows, and the offset of its first row in this rank's send order. */
typedef struct piece {
    int e, row, n_rows, send;
} piece_t;

static __device__ piece_t find_piece(const cometi_dispatch_t *d, const int *t, int i)
{
    const int E = d->num_experts;
    int lo = 0, hi = E - 1; /* the last expert whose first piece is <= i: it has piece i */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (t[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    const int e = lo, j = i - t[e], first = piece_first_row(d, e), head = BM - first % BM;
    const int r0 = j == 0 ? 0 : head + (j - 1) * BM, row = first + r0;
    piece_t pc = {e, row, min(d->counts[d->rank * E + e] - r0, BM - row % BM), d->send_offset[d->rank * E + e] + r0};
    return pc;
}

/* List 0's leading pieces that the first-wave kernel has (cometi_first_rows): whole
 * 128-row blocks of own rows at the head of this rank's first expert, which lead list 0
 * and start at row 0 of this rank's receive buffer (tp 1), one piece per block. */
static __device__ __forceinline__ int wave_pieces(const cometi_dispatch_t *d)
{
    if (!d->wave_blocks) return 0;
    const int e0 = d->rank * d->experts_per_group; /* tp 1: the group is this rank */
    return min(d->counts[d->rank * d->num_experts + e0] / BM, d->wave_blocks);
}

static __device__ void build_piece_table(const cometi_dispatch_t *d, int *table)
{
    const int E = d->num_experts, me = d->rank;
    for (int e = threadIdx.x; e < E; e += blockDim.x) { /* pieces of expert e, for now */
        const int rows = d->counts[me * E + e], head = BM - piece_first_row(d, e) % BM;
        const int n = rows == 0 ? 0 : 1 + (max(0, rows - head) + BM - 1) / BM;
        const int remote = e / d->experts_per_group != me / d->tp;
        table[remote * (E + 1) + e + 1] = n;
        table[(1 - remote) * (E + 1) + e + 1] = 0;
    }
    __syncthreads();
    if (threadIdx.x < 2) { /* prefix sums, one list each */
        int *t = table + threadIdx.x * (E + 1), sum = 0;
        t[0] = 0;
        for (int e = 1; e <= E; e++) t[e] = sum += t[e];
    }
    __syncthreads();
}

/* Claim pieces from one shared counter: piece i is list 0's piece i, or past that list's
 * end list 1's piece i - (list 0's pieces). Copies with the bulk ring if there is one,
 * else with the warp's stores (then every lane takes part and lane 0 claims). */
static __device__ void copy_pieces(const cometi_dispatch_t *d, const int *table, bulk_ring_t *ring,
                                   unsigned int *counter, cometi_async_error_t *err, unsigned long long timeout_ns)
{
    const int lane = threadIdx.x % 32, E = d->num_experts, me = d->rank;
    const uint32_t row_bytes = (uint32_t)d->hidden * 2, mask = ring ? 1u : 0xffffffffu;
    /* The first-wave kernel has the first pieces, the GEMM blocks copy the head after them. */
    const int local_pieces = table[E], head = min(wave_pieces(d) + d->head_pieces, local_pieces);
    for (;;) {
        int i = 0;
        if (lane == 0) i = head + (int)atomicAdd(counter, 1u);
        i = __shfl_sync(mask, i, 0);
        const int list = i >= local_pieces;
        const int *t = table + list * (E + 1);
        if (list) i -= local_pieces;
        if (i >= t[E]) break;
        const piece_t pc = find_piece(d, t, i);
        const int row = pc.row, n_rows = pc.n_rows, group = pc.e / d->experts_per_group;
        const int32_t *src_of = d->src_of + pc.send;
        /* To every TP rank of the group (the same rows, the same place), this rank first. */
        for (int u = 0; u < d->tp; u++) {
            const int dst = group * d->tp + (me + u) % d->tp;
            unsigned char *out = (unsigned char *)d->recv[dst] + (size_t)row * row_bytes;
            if (ring) copy_piece_bulk(d, ring, src_of, n_rows, out, err, timeout_ns);
            else copy_piece_stores(d, src_of, n_rows, (uint4 *)out);
            if (lane == 0) cometi_red_release_sys_add(d->arrive[dst] + row / BM, (unsigned long long)n_rows);
        }
    }
}

static __device__ void dispatch_rows(const cometi_dispatch_t *d, unsigned char *smem, unsigned int *counter,
                                     cometi_async_error_t *err, unsigned long long timeout_ns)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t row_bytes = (uint32_t)d->hidden * 2;
    /* Bulk workers: as many warps as the block's shared memory holds rings for (barriers
     * in the first 1 KB, then the piece table); none means rows too wide for a ring: copy
     * with stores. */
    uint32_t smem_size;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_size));
    int *table = (int *)(smem + 1024);
    build_piece_table(d, table); /* every thread of the block */
    const int ring_bytes = BULK_SLOTS * row_bytes, usable = (int)smem_size - 2048 - PIECE_TABLE_BYTES;
    const int bulk = d->mode != COMETI_DISPATCH_STORES && usable >= ring_bytes;
    const int workers = bulk ? min(min((int)(blockDim.x / 32), 1024 / (8 * BULK_GROUPS)), usable / ring_bytes)
                             : blockDim.x / 32;
    /* A bulk worker is one thread; the warp's other lanes wait for it at the end. */
    if (warp >= workers) return;
    if (bulk && lane != 0) {
        __syncwarp();
        return;
    }
    bulk_ring_t ring;
    if (bulk) {
        ring.slots = smem + 1024 + PIECE_TABLE_BYTES + (size_t)warp * ring_bytes;
        ring.full = (uint64_t *)smem + warp * BULK_GROUPS;
        ring.parity = 0;
        ring.row_bytes = row_bytes;
        for (int s = 0; s < BULK_GROUPS; s++) mbar_init(&ring.full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    copy_pieces(d, table, bulk ? &ring : NULL, counter, err, timeout_ns);
    /* The ring's shared memory may become GEMM stages next. */
    if (bulk) {
        for (int s = 0; s < BULK_GROUPS; s++)
            asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(&ring.full[s])) : "memory");
        __syncwarp();
    }
}

/* The head of the dispatch: its first `head_pieces` pieces of list 0 (this rank's own rows
 * for the tiles that go first), copied by every GEMM block at the kernel's start, each a
 * share of the rows, with its warps' stores: a few dispatch workers took about 60 us to
 * copy them while the whole GPU waited (docs/PERF.md X2, X4). Each block then counts its rows
 * per 128-row block with one release each (after the block's barrier, which orders its
 * threads' stores before the release). Needs tp 1: the rows go to this rank alone. */
#define HEAD_MAX_PIECES 64

static __device__ void copy_head(const cometi_dispatch_t *d, int gemm_block, int gemm_blocks, unsigned char *smem)
{
    int *table = (int *)(smem + 1024);
    int4 *desc = (int4 *)(smem + 1024 + PIECE_TABLE_BYTES); /* receive row, rows, send offset, rows before */
    int *total = (int *)(desc + HEAD_MAX_PIECES);
    build_piece_table(d, table); /* every thread of the block */
    const int E = d->num_experts, me = d->rank, skip = min(wave_pieces(d), table[E]),
              head = min(d->head_pieces, table[E] - skip);
    if ((int)threadIdx.x < head) {
        const piece_t pc = find_piece(d, table, skip + threadIdx.x);
        desc[threadIdx.x] = make_int4(pc.row, pc.n_rows, pc.send, 0);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int j = 0; j < head; j++) desc[j].w = sum, sum += desc[j].y;
        *total = sum;
    }
    __syncthreads();
    const int rows = *total, lo = (int)((long long)rows * gemm_block / gemm_blocks),
              hi = (int)((long long)rows * (gemm_block + 1) / gemm_blocks);
    const size_t row_bytes = (size_t)d->hidden * 2;
    for (int q = lo + (int)threadIdx.x / 32; q < hi; q += blockDim.x / 32) {
        int j = 0;
        while (j + 1 < head && desc[j + 1].w <= q) j++;
        const int r = q - desc[j].w;
        copy_piece_stores(d, d->src_of + desc[j].z + r, 1,
                          (uint4 *)((unsigned char *)d->recv[me] + (size_t)(desc[j].x + r) * row_bytes));
    }
    __syncthreads();
    if ((int)threadIdx.x < head) {
        const int4 pc = desc[threadIdx.x];
        const int a = max(lo, pc.w), b = min(hi, pc.w + pc.y);
        if (b > a) cometi_red_release_sys_add(d->arrive[me] + pc.x / BM, (unsigned long long)(b - a));
    }
    /* The table's generic writes, before the GEMM's tensor loads reuse the space. */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
}

/* ---- the kernel ---- */

template <int BN, int STAGES, bool TMA_EPILOGUE, bool SWIGLU, bool PINGPONG>
static __global__ void __launch_bounds__(THREADS, 1)
grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_up, const __grid_constant__ CUtensorMap map_c,
                    gemm_args_t p)
{
    /* Output columns per tile: SwiGLU pairs gate column c with up column c + BN/2. */
    const int ON = SWIGLU ? BN / 2 : BN;
    /* Rows per tile: 128 shared by both consumers, or 64 for one (ping-pong). */
    const int TM = PINGPONG ? 64 : BM;
    const uint32_t A_BYTES = TM * BK * 2, B_BYTES = BN * BK * 2, C_BYTES = TMA_EPILOGUE ? c_stage_bytes(ON) : 0;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *sa = smem, *sb = smem + STAGES * A_BYTES, *sc = sb + STAGES * B_BYTES;
    uint64_t *full = (uint64_t *)(sc + C_BYTES), *empty = full + STAGES, *turn = empty + STAGES;
    uint64_t *ticket_full = turn + 2, *ticket_empty = ticket_full + TICKETS;
    int *first_tile = (int *)(ticket_empty + TICKETS), *tickets = first_tile + 2 * COMETI_GEMM_MAX_GROUPS + 1;
    /* The last wave's cut, read from shared memory where needed (registers are short in
     * the producer's 40). */
    cometi_tail_plan_t *tail_smem = (cometi_tail_plan_t *)(tickets + TICKETS);
    /* SwiGLU's last column tile may be half full (n a multiple of 64): its B rows past n
     * load as zeros, and its columns past n are never stored. */
    const int wg = threadIdx.x / 128, n_tiles = (p.n + ON - 1) / ON, k_blocks = p.k / BK,
              split_tiles = n_tiles / p.n_splits;

    /* Dispatch or combine blocks come first: blocks start in index order, so if an SM is
     * busy it is a GEMM block (which waits on nobody's behalf) that starts late, not a
     * block the others wait for. */
    const int dispatch_blocks = gridDim.x - p.gemm_blocks;
    /* The tile timeline's row of this block (gemm.h), when asked for. */
    unsigned long long *trace = p.tile_trace ? p.tile_trace + (size_t)blockIdx.x * COMETI_TILE_TRACE_WORDS : NULL;
    const unsigned long long t_entry = trace ? cometi_globaltimer_ns() : 0;
    cometi_grid_wait(); /* the route's plan, the inputs, the tile counters */
    if (p.combine_blocks && (int)blockIdx.x < p.combine_blocks) {
        combine_rows(&p.combine, p.c, p.n, p.segs, p.groups, p.n_splits, split_tiles, p.split_done, p.combine_blocks,
                     smem, p.err, p.arrival_timeout_ns);
        return;
    }
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
    if (trace && threadIdx.x == 0) trace[0] = t_entry;
    const int block = blockIdx.x - dispatch_blocks; /* among the GEMM blocks (static schedule) */
    /* The tile table: each group's tile counts loaded by a thread each (thread 0 walking
     * the groups' global sizes one after another took a few us before the first tile),
     * then summed in shared memory by thread 0. */
    for (int g = threadIdx.x; g < p.groups; g += blockDim.x) {
        const int mt = (p.segs[g].rows + TM - 1) / TM;
        const int local = p.local_rows ? min(mt, p.local_rows[g] / TM) : 0;
        first_tile[g + 1] = local * split_tiles;
        first_tile[p.groups + g + 1] = (mt - local) * split_tiles;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        first_tile[0] = 0;
        for (int i = 1; i <= 2 * p.groups; i++) first_tile[i] = total += first_tile[i];
        /* Blocks that take tiles: every non-combine block on the shared counter (dispatch
         * blocks join once done), the GEMM blocks on the static split. */
        *tail_smem = cometi_gemm_tail_plan(total * p.n_splits,
                                           p.sched ? (int)gridDim.x - p.combine_blocks : p.gemm_blocks, k_blocks,
                                           !PINGPONG && p.tail_ws);
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], PINGPONG ? 1 : 2); /* one arrive per consumer of the stage */
        }
        mbar_init(&turn[0], 1);
        mbar_init(&turn[1], 1);
        for (int s = 0; s < TICKETS; s++) {
            mbar_init(&ticket_full[s], 1);
            mbar_init(&ticket_empty[s], 256); /* every consumer thread has read the ticket */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_a) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_b) : "memory");
        if (TMA_EPILOGUE) asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_c) : "memory");
        if (SWIGLU) asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_up) : "memory");
    }
    __syncthreads();
    const int per_split = first_tile[2 * p.groups];
    const cometi_tail_plan_t *tail = tail_smem;

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 0) return;
        int stage = 0;
        uint32_t phase = 0;
        /* Dynamic schedule: take a ticket (the next tile of the whole grid) one tile ahead,
         * so the atomic's latency hides behind this tile's loads, and pass each to the
         * consumers through the ticket ring; the ticket past the end tells them to stop.
         * Where blocks run out of phase (dispatch blocks join as they finish), a ticket held
         * for a whole tile keeps the last tiles from the blocks that are free first: there,
         * in the last two rounds, the ticket is taken LATE_CLAIM_KBLOCKS steps before this
         * tile's last load. */
        const bool staggered = p.sched && !p.combine_blocks && dispatch_blocks > 0;
        const int late_from = tail->units - 2 * ((int)gridDim.x - p.combine_blocks);
        int t = p.sched ? (int)atomicAdd(&p.sched[0], 1u) : block;
        for (int ordinal = 0;; ordinal++) {
            int next = t;
            bool claimed = !p.sched || t >= tail->units;
            if (!claimed && !(staggered && t >= late_from)) next = (int)atomicAdd(&p.sched[0], 1u), claimed = true;
            if (p.sched) {
                const int s = ordinal % TICKETS;
                mbar_wait(&ticket_empty[s], (ordinal / TICKETS & 1) ^ 1, p.err, p.timeout_ns);
                tickets[s] = t;
                mbar_arrive(&ticket_full[s]);
            }
            if (t >= tail->units) break;
            unsigned long long *rec = trace && ordinal < COMETI_TILE_TRACE_TILES ? trace + 4 + 4 * ordinal : NULL;
            if (rec) rec[0] = (unsigned long long)t, rec[1] = rec[2] = cometi_globaltimer_ns();
            const unit_t un = decode_unit(t, tail, k_blocks);
            tile_t tl = split_tile(un.tile, per_split, first_tile, p.groups, split_tiles, p.group_m);
            const int a_row = p.segs[tl.group].start + tl.m * TM;
            const int b_row = tl.group * p.b_group_rows + tl.n * ON;
            if (p.arrive) {
                /* Every row of this 128-row block has arrived (from any rank); the rows were
                 * written by ordinary stores, so order them before the TMA's async reads. */
                const int blk = a_row / BM;
                cometi_wait_geq(p.arrive + blk, p.expected[blk], p.arrival_timeout_ns, p.err, COMETI_SITE_ARRIVAL, -1,
                                blk);
                asm volatile("fence.proxy.async.global;" ::: "memory");
                if (rec) rec[2] = cometi_globaltimer_ns();
            }
            for (int kb = un.kb0; kb < un.kb1; kb++) {
                if (!claimed && kb >= un.kb1 - LATE_CLAIM_KBLOCKS) next = (int)atomicAdd(&p.sched[0], 1u), claimed = true;
                mbar_wait(&empty[stage], phase ^ 1, p.err, p.timeout_ns);
                mbar_expect_tx(&full[stage], A_BYTES + B_BYTES);
                tma_load_2d(sa + stage * A_BYTES, &map_a, kb * BK, a_row, &full[stage]);
                if (SWIGLU) {
                    /* Gate rows, then the matching up rows in the second half of the B tile,
                     * each from a [groups][n][k] view, so a ragged last tile reads zeros. */
                    tma_load_3d(sb + stage * B_BYTES, &map_b, kb * BK, tl.n * ON, tl.group, &full[stage]);
                    tma_load_3d(sb + stage * B_BYTES + ON * 128, &map_up, kb * BK, tl.n * ON, tl.group, &full[stage]);
                } else {
                    tma_load_2d(sb + stage * B_BYTES, &map_b, kb * BK, b_row, &full[stage]);
                }
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
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

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, half = wg - 1;
    if (TMA_EPILOGUE && p.push_dest && threadIdx.x % 128 == 0) {
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
    int stage = 0;
    uint32_t phase = 0, turn_phase = 0;
    int pending_split = -1; /* TMA epilogue: the split of this warpgroup's last store, not yet counted */
    unsigned int push_sent = 0; /* push: lane s of each warp, rows that warp sent to rank s */
    /* Timeline: one thread per tile notes when its epilogue is issued (at the top of the
     * next turn, since the epilogue has several ways out). */
    const bool recorder = trace && threadIdx.x % 128 == 0 && (PINGPONG || half == 0);
    int traced = -1; /* this recorder's tile whose end is not noted yet */
    for (int ordinal = 0;; ordinal++) {
        if (traced >= 0) trace[4 + 4 * traced + 3] = cometi_globaltimer_ns(), traced = -1;
        int t = block + ordinal * p.gemm_blocks;
        if (p.sched) {
            const int s = ordinal % TICKETS;
            mbar_wait(&ticket_full[s], ordinal / TICKETS & 1, p.err, p.timeout_ns);
            t = tickets[s];
            mbar_arrive(&ticket_empty[s]);
        }
        if (t >= tail->units) break;
        if (PINGPONG && (ordinal & 1) != half) {
            /* The other consumer's tile: step over its stages in the ring. */
            int next = stage + k_blocks;
            phase ^= (uint32_t)(next / STAGES) & 1;
            stage = next % STAGES;
            continue;
        }
        /* Ping-pong: mainloops take turns. Waiting for the other warpgroup to have issued
         * its tile's MMAs means it has seen every fill of that tile's stages, so the
         * parity this warpgroup waits for next cannot be a fill two phases old. */
        if (PINGPONG && ordinal > 0) {
            mbar_wait(&turn[half], turn_phase, p.err, p.timeout_ns);
            turn_phase ^= 1;
        }
        if (recorder && ordinal < COMETI_TILE_TRACE_TILES) traced = ordinal;
        const unit_t un = decode_unit(t, tail, k_blocks);
        tile_t tl = split_tile(un.tile, per_split, first_tile, p.groups, split_tiles, p.group_m);
        /* The push's destinations of this warpgroup's rows, loaded before the mainloop so
         * the epilogue does not start with a trip to L2: both ends of the part (is it one
         * chunk?) and this thread's two fragment rows. */
        int2 push_first = make_int2(-1, 0), push_last = push_first, push_row[2] = {push_first, push_first};
        if (TMA_EPILOGUE && p.push_dest) {
            const cometi_segment_t sg = p.segs[tl.group];
            const int part = tl.m * TM + (PINGPONG ? 0 : half * 64), r_lo = warp * 16 + lane / 4;
            if (part + 64 <= sg.rows) {
                push_first = p.push_dest[sg.start + part];
                push_last = p.push_dest[sg.start + part + 63];
            }
#pragma unroll
            for (int h = 0; h < 2; h++)
                if (part + r_lo + 8 * h < sg.rows) push_row[h] = p.push_dest[sg.start + part + r_lo + 8 * h];
        }
        int prev = -1;
        for (int kb = un.kb0; kb < un.kb1; kb++) {
            mbar_wait(&full[stage], phase, p.err, p.timeout_ns);
            const unsigned char *a = sa + stage * A_BYTES + (PINGPONG ? 0 : half * 64 * 128), *b = sb + stage * B_BYTES;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                const int accumulate = (kb - un.kb0) | kk;
                if (BN == 256) cometi_wgmma_m64n256k16(acc, smem_desc(a + kk * 32), smem_desc(b + kk * 32), accumulate);
                else cometi_wgmma_m64n128k16(acc, smem_desc(a + kk * 32), smem_desc(b + kk * 32), accumulate);
            }
            wgmma_commit();
            /* The previous step's MMAs are done once at most this one is in flight. */
            wgmma_wait<1>();
            if (prev >= 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[prev]);
            prev = stage;
            if (++stage == STAGES) stage = 0, phase ^= 1;
        }
        if (PINGPONG && threadIdx.x % 128 == 0) mbar_arrive(&turn[half ^ 1]); /* the other's turn */
        wgmma_wait<0>();
        if (prev >= 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[prev]);
        if (!PINGPONG && t >= tail->first) {
            /* A part of a cut tile (see cometi_gemm_tail_plan): partials are [cut tile]
             * [part][BN/8][256 threads] float4, so each store and load instruction is
             * coalesced. (Decoded again from t: fewer registers live across the mainloop.) */
            const unit_t cut = decode_unit(t, tail, k_blocks);
            const int x = cut.tile - tail->first, tid = threadIdx.x - 128;
            unsigned long long *count = p.tail_ws + x;
            float4 *parts = (float4 *)(p.tail_ws + COMETI_GEMM_TAIL_COUNTERS) + (size_t)x * (tail->parts - 1) * (BN * 32);
            if (cut.part < tail->parts - 1) {
                float4 *mine = parts + (size_t)cut.part * (BN * 32);
#pragma unroll
                for (int i = 0; i < BN / 8; i++)
                    __stcg(&mine[i * 256 + tid], make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
                __threadfence();
                consumers_sync(); /* every thread's partials, then one count */
                if (threadIdx.x == 128) cometi_red_release_gpu_add(count, 1ull);
                continue;
            }
            /* Zeroed for the next call once every other part has counted (after a failed
             * wait it stays: the error is reported, and the workspace must be cleared). */
            if (threadIdx.x == 128 && cometi_wait_geq(count, (unsigned long long)(tail->parts - 1), p.timeout_ns, p.err,
                                                      COMETI_SITE_GEMM, -1, x))
                *count = 0;
            consumers_sync();
            for (int q = 0; q < tail->parts - 1; q++) {
                const float4 *theirs = parts + (size_t)q * (BN * 32);
#pragma unroll
                for (int i = 0; i < BN / 8; i++) {
                    const float4 v = __ldcg(&theirs[i * 256 + tid]);
                    acc[4 * i] += v.x, acc[4 * i + 1] += v.y, acc[4 * i + 2] += v.z, acc[4 * i + 3] += v.w;
                }
            }
        }

        /* Epilogue: fragment (j, q) of this thread is row warp*16 + lane/4 (+8 for q >= 2),
         * column j*8 + (lane%4)*2 (+1 for odd q) of this warpgroup's 64 x BN part. out(j, h, e)
         * is output column j*8 + (lane%4)*2 + e of row r_lo + 8h, after SwiGLU and scaling. */
        const cometi_segment_t seg = p.segs[tl.group];
        const int part = tl.m * TM + (PINGPONG ? 0 : half * 64); /* first row of this warpgroup's part */
        const int r_lo = warp * 16 + lane / 4, row0 = part + r_lo;
        const bool lo_ok = row0 < seg.rows, hi_ok = row0 + 8 < seg.rows;
        float scale[2] = {1.0f, 1.0f};
        if (p.row_scale) {
            if (lo_ok) scale[0] = p.row_scale[seg.start + row0];
            if (hi_ok) scale[1] = p.row_scale[seg.start + row0 + 8];
        }
#define OUT(j, h, e)                                                                                           \
    (SWIGLU ? scale[h] * silu(acc[(j) * 4 + 2 * (h) + (e)]) * acc[((j) + BN / 16) * 4 + 2 * (h) + (e)]             \
            : scale[h] * acc[(j) * 4 + 2 * (h) + (e)])
        /* Layer1's push: the tile's rows go straight to their token owners' slots (see
         * gemm.h), over NVLink for other ranks. If this warpgroup's 64 rows all go to
         * consecutive slots of one owner (one chunk: one owner at both ends of a full part,
         * since a segment holds one chunk per source rank), they leave like C's boxes,
         * through that owner's map (below); otherwise (two chunks meet, or a group's last
         * rows) every thread stores its fragments straight to their rows, keeping the
         * copies off the SM's TMA unit (64 small bulk copies there held the next tile's
         * loads back). The rows are counted once, at the block's end (the owner sums after
         * the whole GEMM anyway), so no tile waits for its stores to land. */
        const bool push_whole = TMA_EPILOGUE && p.push_dest && push_first.x >= 0 && push_last.x == push_first.x &&
                                push_last.y - push_first.y == 63 * p.combine.tp;
        if (TMA_EPILOGUE && p.push_dest && !push_whole) {
            const cometi_combine_t *cb = &p.combine;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int2 d = push_row[h];
                if (d.x >= 0) {
                    __nv_bfloat16 *c = (__nv_bfloat16 *)cb->peers[d.x].slots + (size_t)d.y * p.n + tl.n * ON +
                                       (lane % 4) * 2;
#pragma unroll
                    for (int j = 0; j < ON / 8; j++)
                        *(__nv_bfloat162 *)(c + j * 8) = __floats2bfloat162_rn(OUT(j, h, 0), OUT(j, h, 1));
                }
                for (int s = 0; s < cb->world; s++) { /* a row is four lanes' */
                    const unsigned int n = __popc(__ballot_sync(0xffffffffu, lane % 4 == 0 && d.x == s));
                    if (lane == s) push_sent += n;
                }
            }
            continue;
        }
        if (push_whole || (TMA_EPILOGUE && !p.push_dest && !p.row_index && tl.m * TM + TM <= seg.rows)) {
            /* Into shared memory as ON/64 swizzled boxes (swizzled_chunk), then one thread
             * stores the boxes asynchronously: to C, or to a push part's owner. */
            unsigned char *stage_c = sc + half * (64 * ON * 2);
            if (threadIdx.x % 128 == 0) bulk_wait_read(); /* the previous tile's store has read it */
            warpgroup_sync(1 + half);
#pragma unroll
            for (int j = 0; j < ON / 8; j++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = r_lo + 8 * h;
                    __nv_bfloat162 v = __floats2bfloat162_rn(OUT(j, h, 0), OUT(j, h, 1));
                    unsigned char *dst = stage_c + swizzled_chunk(j, r) + (lane % 4) * 4;
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(dst)), "r"(*(uint32_t *)&v) : "memory");
                }
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* generic writes -> TMA reads */
            warpgroup_sync(1 + half);
            if (threadIdx.x % 128 == 0) {
                const int t_rank = p.combine.rank % p.combine.tp;
                const CUtensorMap *map = push_whole ? &p.push_maps[push_first.x] : &map_c;
                const int row = push_whole ? (push_first.y - t_rank) / p.combine.tp /* in the map's rows */
                                           : seg.start + part;
#pragma unroll
                for (int box = 0; box < ON / 64; box++)
                    tma_store_2d(map, stage_c + box * 8192, tl.n * ON + box * 64, row);
                bulk_commit();
                if (p.split_done) {
                    /* The split's readers load these rows with ordinary loads: a store must
                     * have landed, and the async proxy's writes be ordered before its count.
                     * Count each store one tile late (wait for all but the newest), so the
                     * next tile's MMAs never wait for a store to land; at a split's end, wait
                     * for all, so a finished split is not held back by a tile. (TMA stores
                     * are whole tiles: this warpgroup's 64 rows are all real.) */
                    const int split = tl.n / split_tiles;
                    if (pending_split >= 0 && pending_split != split) bulk_wait();
                    else asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");
                    asm volatile("fence.proxy.async.global;" ::: "memory");
                    if (pending_split >= 0) cometi_red_release_gpu_add(&p.split_done[pending_split], 64ull);
                    pending_split = split;
                }
            }
            if (push_whole && warp == 0 && lane == push_first.x) push_sent += 64; /* thread 0 sent them */
            continue;
        }
        /* Straight from registers; rows past the group's end are padding, rows whose index
         * is negative are dropped. */
        long long dst_row[2] = {seg.start + row0, seg.start + row0 + 8};
        bool ok[2] = {lo_ok, hi_ok};
        if (p.row_index) {
            if (lo_ok) dst_row[0] = p.row_index[seg.start + row0];
            if (hi_ok) dst_row[1] = p.row_index[seg.start + row0 + 8];
            ok[0] = ok[0] && dst_row[0] >= 0;
            ok[1] = ok[1] && dst_row[1] >= 0;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            __nv_bfloat16 *c = p.c + dst_row[h] * p.ldc + tl.n * ON + (lane % 4) * 2;
            const int col0 = tl.n * ON + (lane % 4) * 2; /* a pair never straddles n (a multiple of 64) */
#pragma unroll
            for (int j = 0; j < ON / 8; j++)
                if (ok[h] && (!SWIGLU || col0 + j * 8 < p.n))
                    *(__nv_bfloat162 *)(c + j * 8) = __floats2bfloat162_rn(OUT(j, h, 0), OUT(j, h, 1));
        }
#undef OUT
        if (p.split_done) {
            /* Every thread's stores, then one count for the warpgroup's rows. */
            __threadfence();
            warpgroup_sync(1 + half);
            const int valid = min(64, seg.rows - part);
            if (threadIdx.x % 128 == 0 && valid > 0)
                cometi_red_release_gpu_add(&p.split_done[tl.n / split_tiles], (unsigned long long)valid);
        }
    }
    if (recorder) trace[3] = cometi_globaltimer_ns();
    if (TMA_EPILOGUE && p.push_dest) {
        /* Every tensor store of this thread has landed (and shared memory outlived them),
         * and the warp's own stores are before its barrier; then lane s releases the warp's
         * count for owner s at system scope. */
        bulk_wait();
        asm volatile("fence.proxy.async.global;" ::: "memory");
        warp_bar_sync(3 + half * 4 + warp);
        if (push_sent) cometi_red_release_sys_add(p.combine.peers[lane].arrive + COMETI_PUSH_COUNTER, push_sent);
    }
    if (TMA_EPILOGUE && threadIdx.x % 128 == 0) {
        bulk_wait(); /* shared memory must outlive the stores */
        if (pending_split >= 0) {
            asm volatile("fence.proxy.async.global;" ::: "memory");
            cometi_red_release_gpu_add(&p.split_done[pending_split], 64ull);
        }
    }
}

/* ---- host side ---- */

static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled(void)
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    if (!fn) {
        /* Through the runtime, so nothing links libcuda: the tests must start where no
         * driver is installed. */
        void *p = NULL;
        enum cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
    }
    return fn;
}

/* A bf16 tensor [outer2][outer][inner] with rows `row_elems` and matrices `mat_elems`
 * elements apart (mat_elems 0: a 2D tensor [outer][inner]; otherwise 3D even when
 * outer2 is 1, since the kernel's loads from it are 3D), in boxes of box_outer x 64 with
 * 128-byte swizzle. Boxes past `inner` or `outer` read zeros and store nothing there. */
static comet_status_t make_map_3d(char *err, CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                                  uint64_t outer2, uint64_t row_elems, uint64_t mat_elems, uint32_t box_outer,
                                  const char *what)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
    if (!encode) return cometi_fail(err, COMET_CUDA_ERROR, "cuTensorMapEncodeTiled is not available from the driver");
    const cuuint32_t rank = mat_elems ? 3 : 2;
    cuuint64_t dims[3] = {inner, outer, outer2}, strides[2] = {row_elems * 2, mat_elems * 2};
    cuuint32_t box[3] = {BK, box_outer, 1}, elem[3] = {1, 1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, (void *)base, dims, strides, box, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return cometi_fail(err, COMET_CUDA_ERROR, "cuTensorMapEncodeTiled(%s: %llu x %llu x %llu, box %u x %d) failed: "
                           "error %d", what, (unsigned long long)outer2, (unsigned long long)outer,
                           (unsigned long long)inner, box_outer, BK, (int)r);
    return COMET_SUCCESS;
}

static comet_status_t make_map(char *err, CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                               uint32_t box_outer, const char *what)
{
    return make_map_3d(err, map, base, inner, outer, 1, inner, 0, box_outer, what); /* 2D */
}

extern "C" comet_status_t cometi_gemm_push_maps_create(char *err, void *const *peer_slots, int world, int tp,
                                                       int t_rank, int64_t slot_rows, int hidden, void **maps)
{
    *maps = NULL;
    if (world < 1 || world > COMETI_MAX_RANKS || tp < 1 || t_rank < 0 || t_rank >= tp || slot_rows < 1 ||
        hidden < 64 || hidden % 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "push maps: world %d (1..%d), tp %d, TP rank %d, %lld slot "
                           "rows, hidden %d (a multiple of 64)", world, COMETI_MAX_RANKS, tp, t_rank,
                           (long long)slot_rows, hidden);
    CUtensorMap table[COMETI_MAX_RANKS];
    for (int p = 0; p < world; p++) /* this TP rank's column of each choice's tp partial rows */
        COMETI_TRY(make_map_3d(err, &table[p], (const char *)peer_slots[p] + (size_t)t_rank * hidden * 2,
                               (uint64_t)hidden, (uint64_t)slot_rows, 1, (uint64_t)tp * hidden, 0, 64, "push slots"));
    void *dev = NULL;
    COMETI_TRY(cometi_cuda(err, cudaMalloc(&dev, sizeof(CUtensorMap) * world), "cudaMalloc(push tensor maps)"));
    comet_status_t st = cometi_cuda(err, cudaMemcpy(dev, table, sizeof(CUtensorMap) * world, cudaMemcpyHostToDevice),
                                    "copy push tensor maps");
    if (st != COMET_SUCCESS) {
        cudaFree(dev);
        return st;
    }
    *maps = dev;
    return COMET_SUCCESS;
}

template <int BN, int STAGES, bool TMA_EPILOGUE, bool SWIGLU, bool PINGPONG> static size_t smem_bytes(void)
{
    const int on = SWIGLU ? BN / 2 : BN, tm = PINGPONG ? 64 : BM;
    return 1024 + STAGES * (tm * BK * 2 + BN * BK * 2) + (TMA_EPILOGUE ? c_stage_bytes(on) : 0) +
           (2 * STAGES + 2 + 2 * TICKETS) * 8 + (2 * COMETI_GEMM_MAX_GROUPS + 1) * 4 + TICKETS * 4 + sizeof(cometi_tail_plan_t);
}

typedef struct maps {
    CUtensorMap a, b, up, c;
} maps_t;

template <int BN, int STAGES, bool TMA_EPILOGUE, bool SWIGLU, bool PINGPONG>
static comet_status_t launch(char *err, const maps_t *m, const gemm_args_t *args, int blocks, cudaStream_t stream)
{
    /* The shared-memory limit is set per device, once (setting it twice is harmless). */
    static unsigned long long configured;
    int dev = 0;
    COMETI_TRY(cometi_cuda(err, cudaGetDevice(&dev), "cudaGetDevice"));
    size_t smem = smem_bytes<BN, STAGES, TMA_EPILOGUE, SWIGLU, PINGPONG>();
    if (dev >= 64 || !(configured >> dev & 1)) {
        COMETI_TRY(cometi_cuda(err, cudaFuncSetAttribute(grouped_gemm_kernel<BN, STAGES, TMA_EPILOGUE, SWIGLU, PINGPONG>,
                                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                               "cudaFuncSetAttribute(grouped GEMM shared memory)"));
        if (dev < 64) configured |= 1ull << dev;
    }
    cudaLaunchAttribute pdl[1];
    const cudaLaunchConfig_t cfg = cometi_pdl_config(blocks, THREADS, smem, stream, pdl);
    return cometi_cuda(err,
                       cudaLaunchKernelEx(&cfg, grouped_gemm_kernel<BN, STAGES, TMA_EPILOGUE, SWIGLU, PINGPONG>, m->a,
                                          m->b, m->up, m->c, *args),
                       "launch grouped_gemm_kernel");
}

/* What cometi_gemm_prepared_t holds. */
typedef struct prepared {
    maps_t maps;
    gemm_args_t args;
    int blocks, block_n, swiglu, pingpong, tma_epilogue;
} prepared_t;

extern "C" comet_status_t cometi_gemm_prepare(char *err, const cometi_gemm_t *g, cometi_gemm_prepared_t *out)
{
    static_assert(sizeof(prepared_t) <= sizeof(cometi_gemm_prepared_t), "cometi_gemm_prepared_t is too small");
    static_assert(alignof(prepared_t) <= 128, "cometi_gemm_prepared_t is under-aligned");
    /* SwiGLU tiles are 128 output columns: 128 gate and 128 up columns of B. */
    int block_n = g->swiglu ? 256 : g->block_n ? g->block_n : cometi_gemm_tile_n(g->n);
    const int out_n = g->swiglu ? block_n / 2 : block_n;
    if (g->swiglu && g->block_n && g->block_n != 256)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm block_n = %d with swiglu: only 256 (128 gate + 128 up "
                           "columns) is built", g->block_n);
    if (block_n != 128 && block_n != 256)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm block_n = %d: must be 128 or 256", block_n);
    /* SwiGLU takes a half-full last column tile (the ffn of a TP rank, say 1408 / 2). */
    const int n_unit = g->swiglu ? 64 : out_n, n_tiles = (g->n + out_n - 1) / out_n;
    if (g->n <= 0 || g->n % n_unit)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n = %d: must be a positive multiple of %d", g->n, n_unit);
    if (g->k <= 0 || g->k % BK)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm k = %d: must be a positive multiple of %d", g->k, BK);
    if (g->groups < 1 || g->groups > COMETI_GEMM_MAX_GROUPS)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm groups = %d: must be 1..%d", g->groups,
                           COMETI_GEMM_MAX_GROUPS);
    if (g->ldc < g->n || g->ldc % 2)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm ldc = %d: must be even and >= n = %d", g->ldc, g->n);
    if ((uintptr_t)g->a % 16 || (uintptr_t)g->b % 16 || (uintptr_t)g->b_up % 16 || (uintptr_t)g->c % 4)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: a, b and b_up must be 16-byte aligned, c 4-byte aligned");
    if (g->b_up && !g->swiglu)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: b_up is for swiglu only");
    const int n_splits = g->n_splits ? g->n_splits : 1;
    if (n_splits < 1 || n_tiles % n_splits)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n_splits = %d: must divide the %d column tiles of %d "
                           "columns", g->n_splits, n_tiles, out_n);
    if (g->group_m < 0 || g->group_m > 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm group_m = %d: must be 0..64 (0: 8)", g->group_m);
    if (!g->err || !g->segs)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: err (the failure report word) and segs must be set");
    if (g->a_rows < 1) return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm a_rows = %lld: must be >= 1",
                                          (long long)g->a_rows);
    /* A TMA store needs 16-byte rows, a 16-byte aligned C, and rows in place (no index). */
    const int tma_ok = g->ldc % 8 == 0 && (uintptr_t)g->c % 16 == 0 && !g->row_index;
    if (g->epilogue == COMETI_EPILOGUE_TMA && !tma_ok)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm epilogue TMA: ldc = %d must be a multiple of 8, c "
                           "16-byte aligned and row_index NULL", g->ldc);
    if (g->epilogue < COMETI_EPILOGUE_AUTO || g->epilogue > COMETI_EPILOGUE_TMA)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm epilogue = %d: must be 0..2", g->epilogue);
    const int tma_epilogue = g->epilogue == COMETI_EPILOGUE_TMA || (g->epilogue == COMETI_EPILOGUE_AUTO && tma_ok);
    /* B rows per group, and where a group's up rows sit relative to its gate rows. */
    const int fused_up = g->swiglu && !g->b_up;
    const int b_group_rows = fused_up ? 2 * g->n : g->n;
    maps_t m;
    memset(&m, 0, sizeof(m));
    if (g->schedule < COMETI_SCHEDULE_AUTO || g->schedule > COMETI_SCHEDULE_PINGPONG)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm schedule = %d: must be 0..2", g->schedule);
    const int pingpong = g->schedule == COMETI_SCHEDULE_PINGPONG;
    if (pingpong && block_n != 256)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm ping-pong schedule: built for block_n 256 only");
    COMETI_TRY(make_map(err, &m.a, g->a, (uint64_t)g->k, (uint64_t)g->a_rows, pingpong ? 64 : BM, "A"));
    if (g->swiglu) { /* [groups][n][k] views of the gate rows and of the up rows */
        const void *up = g->b_up ? g->b_up : (const char *)g->b + (size_t)g->n * g->k * 2;
        COMETI_TRY(make_map_3d(err, &m.b, g->b, (uint64_t)g->k, (uint64_t)g->n, (uint64_t)g->groups, (uint64_t)g->k,
                               (uint64_t)b_group_rows * g->k, (uint32_t)out_n, "B gate"));
        COMETI_TRY(make_map_3d(err, &m.up, up, (uint64_t)g->k, (uint64_t)g->n, (uint64_t)g->groups, (uint64_t)g->k,
                               (uint64_t)b_group_rows * g->k, (uint32_t)out_n, "B up"));
    } else {
        COMETI_TRY(make_map(err, &m.b, g->b, (uint64_t)g->k, (uint64_t)g->groups * b_group_rows, (uint32_t)out_n,
                            "B"));
    }
    /* C's columns end at n (a ragged last tile stores nothing past it), rows ldc apart. */
    if (tma_epilogue)
        COMETI_TRY(make_map_3d(err, &m.c, g->c, (uint64_t)g->n, (uint64_t)g->a_rows, 1, (uint64_t)g->ldc, 0, 64, "C"));
    gemm_args_t args;
    memset(&args, 0, sizeof(args));
    args.segs = g->segs;
    args.groups = g->groups;
    args.n = g->n;
    args.k = g->k;
    args.ldc = g->ldc;
    args.group_m = g->group_m ? g->group_m : 8;
    args.b_group_rows = b_group_rows;
    args.row_scale = g->row_scale;
    args.row_index = g->row_index;
    args.local_rows = g->local_rows;
    args.arrive = g->arrive;
    args.expected = g->expected;
    args.dispatch = g->dispatch;
    args.sched = g->sched;
    args.n_splits = g->n_splits ? g->n_splits : 1;
    args.split_done = g->split_done;
    args.c = (__nv_bfloat16 *)g->c;
    args.err = g->err;
    args.arrival_timeout_ns = g->timeout_ns ? g->timeout_ns : 10ull * 1000 * 1000 * 1000;
    args.timeout_ns = 2 * args.arrival_timeout_ns;
    args.tile_trace = g->tile_trace;
    args.tail_ws = (unsigned long long *)g->tail_ws;
    int sm_count = 0, dev = 0;
    COMETI_TRY(cometi_cuda(err, cudaGetDevice(&dev), "cudaGetDevice"));
    COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev),
                           "cudaDeviceGetAttribute(SM count)"));
    if (g->dispatch_blocks && (g->dispatch.num_experts < 1 || g->dispatch.num_experts > COMETI_MAX_EXPERTS))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: %d experts (1..%d: the piece table's size)",
                           g->dispatch.num_experts, COMETI_MAX_EXPERTS);
    if (g->dispatch_blocks && (g->dispatch.tp < 1 || g->dispatch.experts_per_group < 1))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: tp %d and experts per group %d must be >= 1",
                           g->dispatch.tp, g->dispatch.experts_per_group);
    if (g->dispatch_blocks < 0 || (g->arrive && !g->expected) || (g->dispatch_blocks && !g->sched))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch_blocks = %d: must be >= 0, and > 0 needs "
                           "sched; arrive needs expected", g->dispatch_blocks);
    if (g->combine_blocks < 0 || (g->combine_blocks && (!g->split_done || g->dispatch_blocks || g->arrive)))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm combine_blocks = %d: must be >= 0, and > 0 needs "
                           "split_done and no dispatch_blocks or arrive", g->combine_blocks);
    if (g->combine_blocks) {
        const cometi_combine_t *c = &g->combine;
        if (args.n_splits > COMETI_MAX_SPLITS)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n_splits = %d with combine: at most %d",
                               args.n_splits, COMETI_MAX_SPLITS);
        if (c->kernel_splits < 0 || c->kernel_splits > args.n_splits)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "combine kernel_splits = %d: must be 0..n_splits = %d",
                               c->kernel_splits, args.n_splits);
        if (c->top_k < 1 || c->top_k > COMETI_COMBINE_MAX_TOP_K)
            return cometi_fail(err, COMET_NOT_SUPPORTED, "combine top_k = %d: 1..%d are built", c->top_k,
                               COMETI_COMBINE_MAX_TOP_K);
        if (c->world < 1 || c->world > COMETI_MAX_RANKS || c->rank < 0 || c->rank >= c->world ||
            c->tp != 1 || c->experts_per_group * c->world != c->num_experts || c->num_tokens < 0 || !c->peers || !c->meta ||
            !c->counts || !c->send_offset || !c->recv_offset || !c->expected || !c->sync || (c->num_tokens && (!c->topk_ids || !c->y)))
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm combine: world %d, rank %d, tp %d (must be 1), "
                               "experts %d / %d per rank, tokens %d, or a NULL table", c->world, c->rank, c->tp, c->num_experts,
                               c->experts_per_group, c->num_tokens);
        if ((uintptr_t)c->y % 16 || g->n % 8)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm combine: y must be 16-byte aligned (is %p)", c->y);
    }
    if (g->push_dest) {
        const cometi_combine_t *c = &g->combine;
        if (!tma_epilogue || g->swiglu || g->row_index || g->combine_blocks || g->split_done || args.n_splits != 1 ||
            g->dispatch_blocks || g->arrive || !g->push_maps || (uintptr_t)g->push_maps % 64)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm push: needs the TMA epilogue, one split, the "
                               "owners' tensor maps (64-byte aligned) and no SwiGLU, row index, combine or dispatch "
                               "blocks, split counters or arrival waits");
        if (c->world < 1 || c->world > COMETI_MAX_RANKS || c->world > 32 || c->rank < 0 || c->rank >= c->world ||
            c->tp < 1 || c->world % c->tp || c->experts_per_group * (c->world / c->tp) != c->num_experts ||
            c->experts_per_group != g->groups || !c->peers ||
            !c->counts || !c->send_offset || !c->recv_offset)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm push: world %d, rank %d, tp %d, experts %d / %d per "
                               "group (GEMM groups %d), or a NULL table", c->world, c->rank, c->tp, c->num_experts,
                               c->experts_per_group, g->groups);
    }
    args.push_dest = (const int2 *)g->push_dest;
    args.push_maps = (const CUtensorMap *)g->push_maps;
    const int side_blocks = g->dispatch_blocks + g->combine_blocks;
    /* GEMM blocks, then dispatch (or combine) blocks. */
    args.gemm_blocks = g->sms > 0 ? g->sms : sm_count - side_blocks;
    args.combine_blocks = g->combine_blocks;
    args.combine = g->combine;
    const int blocks = args.gemm_blocks + side_blocks;
    /* Blocks that wait for others must never keep those off the GPU: one per SM, all resident. */
    if ((g->arrive || g->combine_blocks) && (args.gemm_blocks < 1 || blocks > sm_count))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm with arrival waits or combine: %d GEMM + %d dispatch "
                           "or combine blocks must be 1..%d (one per SM, so every block is resident)",
                           args.gemm_blocks, side_blocks, sm_count);
    if (args.gemm_blocks < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm sms = %d with %d dispatch or combine blocks: no GEMM "
                           "block left", g->sms, side_blocks);
    /* The workspace holds two partials per SM (COMETI_GEMM_TAIL_SLOTS), and the plan's
     * no-deadlock argument needs every block resident: a grid past the SMs goes without
     * the cut. */
    if (blocks > sm_count) args.tail_ws = NULL;
    /* The head: the M blocks of the first two waves of tiles. A wave of gemm_blocks tiles
     * covers a band of group_m row tiles, or more rows where a row has fewer column tiles
     * than the wave (local tiles come first, group by group, row tile fastest). */
    args.dispatch.head_pieces = 0;
    if (g->head_copy && g->dispatch_blocks && g->dispatch.tp == 1) {
        /* With a first wave the head follows its rows: with none, the fused kernel's first
         * tiles waited for the dispatch workers (docs/PERF.md Z18, Z27). */
        args.dispatch.head_pieces = min(HEAD_MAX_PIECES, 2 * (args.group_m + (args.gemm_blocks + n_tiles - 1) / n_tiles));
    }
    prepared_t *pr = (prepared_t *)out->bytes;
    pr->maps = m;
    pr->args = args;
    pr->blocks = blocks;
    pr->block_n = block_n;
    pr->swiglu = g->swiglu != 0;
    pr->pingpong = pingpong;
    pr->tma_epilogue = tma_epilogue;
    return COMET_SUCCESS;
}

extern "C" comet_status_t cometi_gemm_launch(char *err, const cometi_gemm_prepared_t *prep, cudaStream_t stream)
{
    const prepared_t *pr = (const prepared_t *)prep->bytes;
    const maps_t *m = &pr->maps;
    const gemm_args_t *args = &pr->args;
    const int blocks = pr->blocks;
    /* The TMA epilogue's 64 KB staging of boxes leaves room for 3 stages at 128x256; ping-pong's
     * 64-row A tiles make stages smaller (40 KB). */
    if (pr->pingpong) {
        if (pr->swiglu)
            return pr->tma_epilogue ? launch<256, 3, true, true, true>(err, m, args, blocks, stream)
                                    : launch<256, 4, false, true, true>(err, m, args, blocks, stream);
        return pr->tma_epilogue ? launch<256, 3, true, false, true>(err, m, args, blocks, stream)
                                : launch<256, 4, false, false, true>(err, m, args, blocks, stream);
    }
    if (pr->swiglu)
        return pr->tma_epilogue ? launch<256, 3, true, true, false>(err, m, args, blocks, stream)
                                : launch<256, 4, false, true, false>(err, m, args, blocks, stream);
    if (pr->block_n == 256)
        return pr->tma_epilogue ? launch<256, 3, true, false, false>(err, m, args, blocks, stream)
                                : launch<256, 4, false, false, false>(err, m, args, blocks, stream);
    return pr->tma_epilogue ? launch<128, 4, true, false, false>(err, m, args, blocks, stream)
                            : launch<128, 4, false, false, false>(err, m, args, blocks, stream);
}

extern "C" comet_status_t cometi_gemm_run(char *err, const cometi_gemm_t *g, cudaStream_t stream)
{
    cometi_gemm_prepared_t p;
    COMETI_TRY(cometi_gemm_prepare(err, g, &p));
    return cometi_gemm_launch(err, &p, stream);
}
