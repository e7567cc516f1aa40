/*
 * combine.cuh - layer1's combine (COMET's layer1 communication), as device functions:
 * run by the combine blocks of the fused GEMM1 kernel (gemm/kernel.cuh) and by the tail kernel
 * on every SM after it (combine.cu). GEMM1's rows are finished column split by column
 * split; the combine blocks send each finished split home, summed per token on this
 * rank, and sum what came home into y, while the GEMM blocks compute the next split. The
 * last split can only start once the GEMM is done, so it goes to the tail kernel, where
 * every SM shares it (on a few combine blocks it was the whole overhead).
 * See cometi_combine_t.
 *
 * Both sums (a token's rows on this rank, weighted; an owner's slots) are "row sums": the
 * warp reads the descriptions of 32 of them at once (one per lane: these reads are the
 * latency, so they go in parallel), then moves the rows through its ring of shared-memory
 * slots with bulk copies issued ahead of the sums, so many KB per SM are in flight (a
 * warp that loaded a row, summed and stored it before the next was bandwidth-starved:
 * 1.25-2.8x GEMM1 alone).
 *
 * Ordering: the GEMM counts a split's rows in split_done with a GPU-scope release once
 * they are in C; one thread acquires, a block barrier follows, and the issuing lane fences
 * generic writes before its bulk (async-proxy) reads. A block's writes to an owner's slots
 * are counted after a block barrier by one thread, with a system-scope fence and release,
 * once per (split, owner); the owner acquires the count the same way before reading.
 */
#ifndef COMET_COMBINE_CUH
#define COMET_COMBINE_CUH

#include <cuda_bf16.h>
#include "comm/combine.h"
#include "base/ptx.cuh"

#define COMBINE_SLOT_BYTES 2048  /* 1024 columns: longer rows go in pieces */
#define COMBINE_MAX_SLOTS 16     /* input slots per warp */
#define COMBINE_OUT_SLOTS 2      /* output slots per warp: a sum is stored from one while the
                                  * next is written into the other */
#define COMBINE_TABLES_BYTES 16384 /* group table, counts and ring barriers, before the rings */
#define FULL_MASK 0xffffffffu

/* Spin (acquire, GPU scope) until *p >= target: the combine blocks' meeting point after
 * the record pull. All of them are resident, so only a bug can make this time out. */
static __device__ void combine_wait_u32(const unsigned int *p, unsigned int target, cometi_async_error_t *err,
                                        unsigned long long timeout_ns)
{
    unsigned long long start = cometi_globaltimer_ns(), next_poll = 0;
    for (;;) {
        unsigned int v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        if (v >= target) return;
        const unsigned long long waited = cometi_globaltimer_ns() - start;
        if (waited > timeout_ns) {
            cometi_record_error(err, COMETI_ASYNC_INTERNAL_ERROR, COMETI_SITE_COMBINE, -1, -1, target, v, waited);
            return;
        }
        if (cometi_other_wait_failed(err, waited, &next_poll)) return;
        __nanosleep(64);
    }
}

/* The i-th received row (rows of all local experts, padding left out): row index in C.
 * `g` only moves forward, so a thread walking i upwards finds its group in O(1) steps. */
static __device__ __forceinline__ int combine_row(const int *first, const int *start, int i, int *g)
{
    while (first[*g + 1] <= i) (*g)++;
    return start[*g] + (i - first[*g]);
}

/* One lane's row sum: dst = sum over j < n of w[j] * src[j], bf16 rows of the same length
 * (n = 0 writes zeros). */
typedef struct row_sum {
    const unsigned char *src[COMETI_COMBINE_MAX_TOP_K];
    float w[COMETI_COMBINE_MAX_TOP_K];
    unsigned char *dst;
    int n;
} row_sum_t;

/* A warp's ring: input slots filled in order by bulk loads (lane 0) and read in the same
 * order; sums leave from the output slots by bulk stores (lane 0's bulk groups). */
typedef struct sum_ring {
    unsigned char *slots;
    uint64_t *full;      /* one mbarrier per input slot */
    int count;           /* input slots, >= the longest row sum */
    int head, tail;      /* next slot to fill, next to read */
    uint32_t parity;     /* bit s: the phase slot s waits for next */
    unsigned char *out;  /* COMBINE_OUT_SLOTS slots */
    int out_next;
} sum_ring_t;

static __device__ __forceinline__ void add_bf16x8(float *acc, uint4 v, float w)
{
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] += w * f.x;
        acc[2 * i + 1] += w * f.y;
    }
}

static __device__ __forceinline__ uint4 pack_bf16x8(const float *acc)
{
    uint4 v;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return v;
}

/*
 * The row sums of the lanes in `mask`, each `bytes` long (a multiple of 16), in pieces of
 * at most one slot. Warp-uniform: every lane calls it. Loads run ahead of the sums by as
 * many rows as the ring holds; a piece is summed in fp32 in the order j = 0, 1, ... (the
 * same bits every run), packed into an output slot and stored by the copy engine (stores
 * from registers to a peer ran at 17-35 GB/s per SM: too few in flight). The stores may
 * still be in flight on return: warp_row_sums_landed() waits for them.
 */
static __device__ __forceinline__ void warp_row_sums(sum_ring_t *ring, const row_sum_t *mine, unsigned int mask, int bytes,
                                     cometi_async_error_t *err, unsigned long long timeout_ns)
{
    const int lane = threadIdx.x % 32, pieces = (bytes + COMBINE_SLOT_BYTES - 1) / COMBINE_SLOT_BYTES;
    unsigned int to_issue = mask, to_sum = mask;
    int issue_piece = 0, sum_piece = 0, free_slots = ring->count;
    /* Generic writes this block acquired (rows, slots) before the copy engine reads them. */
    if (lane == 0) asm volatile("fence.proxy.async.global;" ::: "memory");
    while (to_sum) {
        /* Issue every piece whose rows fit in the free slots. */
        while (to_issue) {
            const int L = __ffs(to_issue) - 1, n = __shfl_sync(FULL_MASK, mine->n, L);
            if (n > free_slots) break;
            const int off = issue_piece * COMBINE_SLOT_BYTES, len = min(COMBINE_SLOT_BYTES, bytes - off);
#pragma unroll
            for (int j = 0; j < COMETI_COMBINE_MAX_TOP_K; j++) {
                if (j >= n) break;
                const unsigned char *src = (const unsigned char *)__shfl_sync(FULL_MASK, (uintptr_t)mine->src[j], L);
                const int s = (ring->head + j) % ring->count;
                if (lane == 0) {
                    mbar_expect_tx(&ring->full[s], (uint32_t)len);
                    bulk_load(ring->slots + (size_t)s * COMBINE_SLOT_BYTES, src + off, (uint32_t)len, &ring->full[s]);
                }
            }
            ring->head = (ring->head + n) % ring->count;
            free_slots -= n;
            if (++issue_piece == pieces) issue_piece = 0, to_issue &= to_issue - 1;
        }
        /* Sum the oldest piece: each lane takes 16-byte vectors lane, lane + 32, ... */
        const int L = __ffs(to_sum) - 1, n = __shfl_sync(FULL_MASK, mine->n, L);
        unsigned char *dst = (unsigned char *)__shfl_sync(FULL_MASK, (uintptr_t)mine->dst, L);
        const int off = sum_piece * COMBINE_SLOT_BYTES, vecs = min(COMBINE_SLOT_BYTES, bytes - off) / 16;
        float acc[COMBINE_SLOT_BYTES / 512][8];
#pragma unroll
        for (int u = 0; u < COMBINE_SLOT_BYTES / 512; u++)
#pragma unroll
            for (int q = 0; q < 8; q++) acc[u][q] = 0.0f;
#pragma unroll
        for (int j = 0; j < COMETI_COMBINE_MAX_TOP_K; j++) {
            if (j >= n) break;
            const float w = __shfl_sync(FULL_MASK, mine->w[j], L);
            const int s = (ring->tail + j) % ring->count;
            mbar_wait(&ring->full[s], ring->parity >> s & 1, err, timeout_ns);
            ring->parity ^= 1u << s;
            const uint4 *slot = (const uint4 *)(ring->slots + (size_t)s * COMBINE_SLOT_BYTES);
#pragma unroll
            for (int u = 0; u < COMBINE_SLOT_BYTES / 512; u++)
                if (lane + 32 * u < vecs) add_bf16x8(acc[u], slot[lane + 32 * u], w);
        }
        /* The store that last used this output slot has read it (one newer may still be). */
        if (lane == 0) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(COMBINE_OUT_SLOTS - 1) : "memory");
        __syncwarp();
        uint4 *out = (uint4 *)(ring->out + (size_t)ring->out_next * COMBINE_SLOT_BYTES);
#pragma unroll
        for (int u = 0; u < COMBINE_SLOT_BYTES / 512; u++)
            if (lane + 32 * u < vecs) out[lane + 32 * u] = pack_bf16x8(acc[u]);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* generic writes -> bulk store reads */
        __syncwarp(); /* every lane has read the input slots and written the output slot */
        if (lane == 0) {
            bulk_store(dst + off, out, (uint32_t)vecs * 16);
            bulk_commit();
        }
        ring->out_next = (ring->out_next + 1) % COMBINE_OUT_SLOTS;
        ring->tail = (ring->tail + n) % ring->count;
        free_slots += n;
        if (++sum_piece == pieces) sum_piece = 0, to_sum &= to_sum - 1;
    }
}

/* The warp's bulk stores have landed, ordered before the generic release that counts them. */
static __device__ __forceinline__ void warp_row_sums_landed(void)
{
    if (threadIdx.x % 32 == 0) {
        bulk_wait();
        asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    __syncwarp();
}

/* What a combine block keeps between phases. */
typedef struct combine_block {
    int *first, *start;          /* shared: the compact index of each group's first row, its first row in C */
    unsigned int *owner_rows;    /* shared [world]: rows summed for each owner in this split */
    unsigned int *sent_total;    /* shared [1]: rows this rank sent in layer0 (home again in layer1) */
    unsigned long long *trace;   /* this block's timeline, or NULL */
    sum_ring_t ring;
    int workers, received, blocks, gwarp, gwarps;
} combine_block_t;

static __device__ __forceinline__ void combine_trace(const combine_block_t *b, int event)
{
    if (b->trace && threadIdx.x == 0 && event < COMETI_COMBINE_TRACE) b->trace[event] = cometi_globaltimer_ns();
}

/* Tables and rings in shared memory (group table and per-owner counts, the rings'
 * barriers, then one ring per worker warp). `blocks`: the blocks combining together.
 * Returns 0 (reported) when the rings do not fit: never with the kernels' sizes. */
static __device__ int combine_setup(const cometi_combine_t *c, const cometi_segment_t *segs, int groups, int blocks,
                                    unsigned char *smem, cometi_async_error_t *err, combine_block_t *b)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, E = c->num_experts, me = c->rank;
    b->first = (int *)smem;
    b->start = b->first + groups + 1;
    b->owner_rows = (unsigned int *)(b->start + groups);
    b->sent_total = b->owner_rows + c->world;
    b->trace = c->trace ? c->trace + (size_t)blockIdx.x * COMETI_COMBINE_TRACE : NULL;
    uint64_t *bars = (uint64_t *)(smem + COMBINE_TABLES_BYTES - 12 * COMBINE_MAX_SLOTS * 8);
    /* Worker warps: as many as hold a ring of at least top-k input slots (a token's rows on
     * one rank are summed at once; at least 4 to keep loads ahead) and the output slots,
     * up to 12. */
    uint32_t smem_size;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_size));
    const int ring_space = (int)smem_size - 1024 - COMBINE_TABLES_BYTES;
    const int need = max(c->top_k, 4) + COMBINE_OUT_SLOTS;
    b->workers = min(12, min((int)blockDim.x / 32, ring_space / (need * COMBINE_SLOT_BYTES)));
    if (b->workers < 1) {
        if (threadIdx.x == 0)
            cometi_record_error(err, COMETI_ASYNC_INTERNAL_ERROR, COMETI_SITE_COMBINE, -1, -1, 0, smem_size, 0);
        return 0;
    }
    const int per_warp = min(COMBINE_MAX_SLOTS + COMBINE_OUT_SLOTS, ring_space / b->workers / COMBINE_SLOT_BYTES);
    sum_ring_t *ring = &b->ring;
    ring->count = per_warp - COMBINE_OUT_SLOTS;
    ring->slots = smem + COMBINE_TABLES_BYTES + (size_t)warp * per_warp * COMBINE_SLOT_BYTES;
    ring->out = ring->slots + (size_t)ring->count * COMBINE_SLOT_BYTES;
    ring->out_next = 0;
    ring->full = bars + warp * COMBINE_MAX_SLOTS;
    ring->head = ring->tail = 0;
    ring->parity = 0;
    if (warp < b->workers && lane == 0) {
        for (int s = 0; s < ring->count; s++) mbar_init(&ring->full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (threadIdx.x == 0) {
        int n = 0;
        for (int g = 0; g < groups; g++) {
            b->first[g] = n;
            b->start[g] = segs[g].start;
            n += segs[g].rows;
        }
        b->first[groups] = n;
        *b->sent_total = 0;
    }
    if (threadIdx.x < c->world) b->owner_rows[threadIdx.x] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) atomicAdd(b->sent_total, (unsigned int)c->plan.counts[me * E + e]);
    __syncthreads();
    b->received = b->first[groups];
    b->blocks = blocks;
    b->gwarp = blockIdx.x * b->workers + warp;
    b->gwarps = blocks * b->workers;
    combine_trace(b, 0);
    return 1;
}

/* Pull the record of every received row from its source (the rank whose rows hold that
 * part of the segment: local first, then me + 1, ...), then meet: a token's chain can
 * cross into rows another block pulled. */
static __device__ void combine_pull(const cometi_combine_t *c, const combine_block_t *b, unsigned int *meet,
                                    cometi_async_error_t *err, unsigned long long timeout_ns)
{
    const int W = c->world, E = c->num_experts, me = c->rank, per = c->experts_per_group;
    const int thread = blockIdx.x * blockDim.x + threadIdx.x, threads = b->blocks * blockDim.x;
    int g = 0;
    for (int i = thread; i < b->received; i += threads) {
        const int r = combine_row(b->first, b->start, i, &g), e = me * per + g, q = r - b->start[g];
        int s = me, at = 0;
        for (int u = 0; u < W; u++) {
            s = (me + u) % W;
            const int off = c->plan.recv_offset[s * E + e];
            if (q < off + c->plan.counts[s * E + e]) {
                at = c->plan.send_offset[s * E + e] + q - off;
                break;
            }
        }
        uint4 v = __ldcg((const uint4 *)(c->peers[s].meta + at));
        v.w = (unsigned int)s;
        ((uint4 *)c->meta)[r] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(meet, 1u);
        combine_wait_u32(meet, (unsigned int)b->blocks, err, timeout_ns);
    }
    __syncthreads();
    combine_trace(b, 1);
}

/*
 * One column split: once every row of it is in C (rows: GEMM1's C; each column tile adds
 * a split's rows to split_done once), each warp takes units of 32 received rows x one
 * slot of columns (small units, so every warp has a share: with whole rows, a tail
 * kernel left two thirds of its warps idle), and a lane whose row leads its token on this
 * rank sums the token's rows here (weighted) into the owner's slot; the rows per owner
 * are counted (once, with the first columns); then, as owner, once every row of this
 * rank's tokens is home, units of 32 tokens' slots x columns are summed into y.
 */
static __device__ void combine_split(const cometi_combine_t *c, combine_block_t *b, const __nv_bfloat16 *rows,
                                     int hidden, int n_splits, int split, int tiles_per_split,
                                     const unsigned long long *split_done, cometi_async_error_t *err,
                                     unsigned long long timeout_ns)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, me = c->rank;
    const int cols = hidden / n_splits, bytes = cols * 2, c0 = split * cols, ev = 2 + 4 * split;
    const int chunks = (bytes + COMBINE_SLOT_BYTES - 1) / COMBINE_SLOT_BYTES;
    const bool worker = warp < b->workers;
    if (threadIdx.x == 0)
        cometi_wait_geq(&split_done[split], c->expected[split] + (unsigned long long)b->received * tiles_per_split,
                        2 * timeout_ns, err, COMETI_SITE_COMBINE, me, split);
    __syncthreads();
    combine_trace(b, ev);
    int g = 0;
    const int row_units = (b->received + 31) / 32 * chunks;
    for (int unit = b->gwarp; worker && unit < row_units; unit += b->gwarps) {
        const int i = unit / chunks * 32 + lane, chunk = unit % chunks, off = chunk * COMBINE_SLOT_BYTES;
        const int len = min(COMBINE_SLOT_BYTES, bytes - off);
        row_sum_t mine;
        mine.n = 0;
        int lead = 0;
        /* Every lane walks its group pointer, so all stay in step. */
        const int r = combine_row(b->first, b->start, min(i, b->received - 1), &g);
        if (i < b->received) {
            const uint4 m = __ldcg((const uint4 *)(c->meta + r));
            lead = (int)m.x >= 0;
            if (lead) {
                mine.dst = (unsigned char *)((__nv_bfloat16 *)c->peers[m.w].slots + (size_t)m.x * hidden + c0) + off;
                int next = (int)m.y, row = r;
                float w = __uint_as_float(m.z);
#pragma unroll
                for (int j = 0; j < COMETI_COMBINE_MAX_TOP_K; j++) {
                    if (row < 0) break;
                    mine.src[j] = (const unsigned char *)(rows + (size_t)row * hidden + c0) + off;
                    mine.w[j] = w;
                    mine.n = j + 1;
                    row = next;
                    if (row >= 0) {
                        const uint4 mn = __ldcg((const uint4 *)(c->meta + row));
                        next = (int)mn.y;
                        w = __uint_as_float(mn.z);
                    }
                }
                if (chunk == 0) atomicAdd(&b->owner_rows[m.w], (unsigned int)mine.n);
            }
        }
        warp_row_sums(&b->ring, &mine, __ballot_sync(FULL_MASK, lead), len, err, timeout_ns);
    }
    if (worker) warp_row_sums_landed();
    __syncthreads();
    combine_trace(b, ev + 1);
    if (threadIdx.x < c->world && b->owner_rows[threadIdx.x]) {
        __threadfence_system();
        cometi_red_release_sys_add(c->peers[threadIdx.x].arrive + split, b->owner_rows[threadIdx.x]);
        b->owner_rows[threadIdx.x] = 0;
    }

    if (threadIdx.x == 0)
        cometi_wait_geq(c->peers[me].arrive + split, c->expected[COMETI_MAX_SPLITS + split] + *b->sent_total,
                        timeout_ns, err, COMETI_SITE_COMBINE, -1, split);
    __syncthreads();
    combine_trace(b, ev + 2);
    const __nv_bfloat16 *my_slots = (const __nv_bfloat16 *)c->peers[me].slots;
    const int token_units = (c->num_tokens + 31) / 32 * chunks;
    for (int unit = b->gwarp; worker && unit < token_units; unit += b->gwarps) {
        const int t = unit / chunks * 32 + lane, chunk = unit % chunks, off = chunk * COMBINE_SLOT_BYTES;
        row_sum_t mine;
        mine.n = t < c->num_tokens ? cometi_token_ranks(c->topk_ids + (size_t)t * c->top_k, c->top_k, c->num_experts,
                                                        c->experts_per_group)
                                   : 0;
        mine.dst = (unsigned char *)((__nv_bfloat16 *)c->y + (size_t)t * hidden + c0) + off;
#pragma unroll
        for (int o = 0; o < COMETI_COMBINE_MAX_TOP_K; o++) {
            mine.src[o] =
                (const unsigned char *)(my_slots + ((size_t)t * c->slots_per_token + o) * hidden + c0) + off;
            mine.w[o] = 1.0f;
        }
        warp_row_sums(&b->ring, &mine, __ballot_sync(FULL_MASK, t < c->num_tokens),
                      min(COMBINE_SLOT_BYTES, bytes - off), err, timeout_ns);
    }
    __syncthreads();
    combine_trace(b, ev + 3);
}

/* The end: y's stores have landed (the output slots must outlive them), and the last
 * block out advances the running totals of splits [first, last) for the next call and
 * clears the words (every block has read the totals by now). */
static __device__ void combine_finish(const cometi_combine_t *c, combine_block_t *b, unsigned int *sync, int first,
                                      int last, int tiles_per_split)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < b->workers) {
        warp_row_sums_landed();
        if (lane == 0)
            for (int s = 0; s < b->ring.count; s++)
                asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(&b->ring.full[s])) : "memory");
    }
    __syncthreads();
    combine_trace(b, COMETI_COMBINE_TRACE - 1);
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&sync[1], 1u) == (unsigned int)b->blocks - 1) {
            for (int s = first; s < last; s++) {
                c->expected[s] += (unsigned long long)b->received * tiles_per_split;
                c->expected[COMETI_MAX_SPLITS + s] += *b->sent_total;
            }
            sync[0] = 0;
            sync[1] = 0;
        }
    }
}

/* The combine blocks of the fused kernel: pull, then the splits the kernel keeps (the
 * rest go to the tail kernel, on every SM, after it). */
static __device__ void combine_rows(const cometi_combine_t *c, const __nv_bfloat16 *rows, int hidden,
                                    const cometi_segment_t *segs, int groups, int n_splits, int tiles_per_split,
                                    const unsigned long long *split_done, int combine_blocks, unsigned char *smem,
                                    cometi_async_error_t *err, unsigned long long timeout_ns)
{
    combine_block_t b;
    if (!combine_setup(c, segs, groups, combine_blocks, smem, err, &b)) return;
    combine_pull(c, &b, &c->sync[0], err, timeout_ns);
    for (int split = 0; split < c->kernel_splits; split++)
        combine_split(c, &b, rows, hidden, n_splits, split, tiles_per_split, split_done, err, timeout_ns);
    combine_finish(c, &b, c->sync, 0, c->kernel_splits, tiles_per_split);
}

#endif /* COMET_COMBINE_CUH */
