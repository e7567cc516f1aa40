/*
 * dispatch.cuh - the dispatch blocks of a dispatch -> GEMM kernel (dispatch.h): this
 * rank's rows copied into their expert owners' receive buffers over NVLink, piece by
 * piece, each piece counted with one system-scope release; and the head, the first
 * pieces of this rank's own rows, which every GEMM block copies a share of at the
 * kernel's start. Run by the GEMM kernel (gemm/kernel.cuh) in the rows with the dispatch role.
 */
#ifndef COMET_DISPATCH_CUH
#define COMET_DISPATCH_CUH

#include "comm/dispatch.h"
#include "base/ptx.cuh"
#include "base/row_copy.cuh"

/* Dispatch. This rank's rows for expert e form one contiguous run of its owner's
 * receive buffer; cut at the owner's 128-row block boundaries, each run gives pieces of
 * at most 128 rows. A worker (a warp) copies one piece, then adds the piece's row count
 * to the owner's counter for that block with one release at system scope, which orders
 * the piece's writes before the count: one fence per piece, not per row. Pieces for
 * local experts go first, so local tiles can start at once. Workers take pieces
 * round-robin. Two ways to copy a piece (COMETI_DISPATCH_*): */

/* Stores: the warp's lanes load and store 16 bytes at a time (row_copy.cuh). A piece's
 * source, x or x2, holds a row of row_bytes per token: (t, j) reads row t. */
static __device__ void copy_piece_stores(const void *x, int row_bytes, int top_k, const int32_t *src_of, int n_rows,
                                         uint4 *out)
{
    const int vecs = row_bytes / 16;
    for (int q = 0; q < n_rows; q++)
        cometi_warp_copy_row(out + (size_t)q * vecs, (const uint4 *)x + (size_t)(src_of[q] / top_k) * vecs, vecs);
    __syncwarp();
}

/* Bulk: one thread moves whole rows with the copy engine, through a ring of shared-memory
 * slots in BULK_GROUPS groups of BULK_GROUP consecutive slots: the rows of a group of the
 * piece are bulk-loaded one by one into a ring group (completing on its mbarrier), and
 * BULK_LAG_GROUPS groups later stored to the owner with one bulk store, since the piece's
 * receive rows are consecutive. Neither ring depth nor workers per block moved a block's
 * 35 GB/s, which implies about 95 ns per copy for 4 and 7 KB rows alike:
 * the SM's copy engine takes them one at a time. Fewer copies per row copy faster: 1.25
 * here against 2 with a store per row made the dispatch-bound counts 3-12% faster.
 * A ring group is loaded again only once the store that last used it has read it. At the
 * end of the piece every store must have landed (wait_group 0, then the proxy fence:
 * async writes before the generic release). */
#define BULK_SLOTS 12
#define BULK_GROUP 4
#define BULK_GROUPS (BULK_SLOTS / BULK_GROUP)
#define BULK_LAG_GROUPS 1

typedef struct bulk_ring {
    unsigned char *slots; /* BULK_SLOTS rows of the wider source */
    uint64_t *full;       /* BULK_GROUPS mbarriers */
    uint32_t parity;      /* bit s: the phase ring group s waits for next */
} bulk_ring_t;

static __device__ void copy_piece_bulk(bulk_ring_t *ring, const void *from, uint32_t rb, int top_k,
                                       const int32_t *src_of, int n_rows, unsigned char *out,
                                       cometi_async_error_t *err, unsigned long long timeout_ns)
{
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
                              (const unsigned char *)from + (size_t)(src[i] / top_k) * rb, rb, &ring->full[s]);
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
    return d->plan.seg_start[e] + d->plan.recv_offset[d->rank * d->num_experts + e];
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
    const int e = lo, j = i - t[e], first = piece_first_row(d, e), head = COMETI_BLOCK_M - first % COMETI_BLOCK_M;
    const int r0 = j == 0 ? 0 : head + (j - 1) * COMETI_BLOCK_M, row = first + r0;
    piece_t pc = {e, row, min(d->plan.counts[d->rank * E + e] - r0, COMETI_BLOCK_M - row % COMETI_BLOCK_M), d->plan.send_offset[d->rank * E + e] + r0};
    return pc;
}

/* List 0's leading pieces that the first-wave kernel has (cometi_first_rows): whole
 * 128-row blocks of own rows at the head of this rank's first expert, which lead list 0
 * and start at row 0 of this rank's receive buffer (tp 1), one piece per block. */
static __device__ __forceinline__ int wave_pieces(const cometi_dispatch_t *d)
{
    if (!d->wave_blocks) return 0;
    const int e0 = d->rank * d->experts_per_group; /* tp 1: the group is this rank */
    return min(d->plan.counts[d->rank * d->num_experts + e0] / COMETI_BLOCK_M, d->wave_blocks);
}

static __device__ void build_piece_table(const cometi_dispatch_t *d, int *table)
{
    const int E = d->num_experts, me = d->rank;
    for (int e = threadIdx.x; e < E; e += blockDim.x) { /* pieces of expert e, for now */
        const int rows = d->plan.counts[me * E + e], head = COMETI_BLOCK_M - piece_first_row(d, e) % COMETI_BLOCK_M;
        const int n = rows == 0 ? 0 : 1 + (max(0, rows - head) + COMETI_BLOCK_M - 1) / COMETI_BLOCK_M;
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
    const uint32_t mask = ring ? 1u : 0xffffffffu;
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
        /* To every TP rank of the group (the same rows, the same place), this rank first;
         * x2's rows too before the count. */
        const void *srcs[2] = {d->x, d->x2};
        const uint32_t rb = (uint32_t)d->row_bytes;
        for (int u = 0; u < d->tp; u++) {
            const int dst = group * d->tp + (me + u) % d->tp;
            for (int which = 0; which < (d->x2 ? 2 : 1); which++) {
                unsigned char *out = (unsigned char *)d->recv[dst] + (size_t)row * rb + (which ? d->x2_offset : 0);
                if (ring) copy_piece_bulk(ring, srcs[which], rb, d->top_k, src_of, n_rows, out, err, timeout_ns);
                else copy_piece_stores(srcs[which], rb, d->top_k, src_of, n_rows, (uint4 *)out);
            }
            if (lane == 0) cometi_red_release_sys_add(d->arrive[dst] + row / COMETI_BLOCK_M, (unsigned long long)n_rows);
        }
    }
}

static __device__ void dispatch_rows(const cometi_dispatch_t *d, unsigned char *smem, unsigned int *counter,
                                     cometi_async_error_t *err, unsigned long long timeout_ns)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t row_bytes = (uint32_t)d->row_bytes;
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
 * copy them while the whole GPU waited. Each block then counts its rows
 * per 128-row block with one release each (after the block's barrier, which orders its
 * threads' stores before the release). Needs tp 1: the rows go to this rank alone. */
static __device__ void copy_head(const cometi_dispatch_t *d, int gemm_block, int gemm_blocks, unsigned char *smem)
{
    int *table = (int *)(smem + 1024);
    int4 *desc = (int4 *)(smem + 1024 + PIECE_TABLE_BYTES); /* receive row, rows, send offset, rows before */
    int *total = (int *)(desc + COMETI_DISPATCH_HEAD_MAX_PIECES);
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
    for (int q = lo + (int)threadIdx.x / 32; q < hi; q += blockDim.x / 32) {
        int j = 0;
        while (j + 1 < head && desc[j + 1].w <= q) j++;
        const int r = q - desc[j].w;
        unsigned char *out = (unsigned char *)d->recv[me] + (size_t)(desc[j].x + r) * d->row_bytes;
        const void *srcs[2] = {d->x, d->x2};
        for (int which = 0; which < (d->x2 ? 2 : 1); which++)
            copy_piece_stores(srcs[which], d->row_bytes, d->top_k, d->src_of + desc[j].z + r, 1,
                              (uint4 *)(out + (which ? d->x2_offset : 0)));
    }
    __syncthreads();
    if ((int)threadIdx.x < head) {
        const int4 pc = desc[threadIdx.x];
        const int a = max(lo, pc.w), b = min(hi, pc.w + pc.y);
        if (b > a) cometi_red_release_sys_add(d->arrive[me] + pc.x / COMETI_BLOCK_M, (unsigned long long)(b - a));
    }
    /* The table's generic writes, before the GEMM's tensor loads reuse the space. */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
}

#endif /* COMET_DISPATCH_CUH */
