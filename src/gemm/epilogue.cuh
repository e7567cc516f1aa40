/*
 * epilogue.cuh - what a consumer warpgroup does with its 64 x BN accumulators once a
 * unit's MMAs are done: a part of a tile cut along k hands its fp32 partials to the last
 * part (which adds them in part order); then the tile's rows, after SwiGLU (gate and up
 * columns of one expert meet in one 128 x 256 tile, so GEMM0's output is the activation
 * itself) and a per-row scale, leave one of three ways:
 *   the push      straight to their token owners' slots (the push role);
 *   a TMA store   staged in swizzled shared memory, one thread stores asynchronously;
 *   registers     straight to global memory (partial tiles, a row index).
 * With column splits, every stored row is counted in its split's split_done. The FP8
 * SwiGLU quantizes its rows first (store_tile_e4m3).
 */
#ifndef COMET_GEMM_EPILOGUE_CUH
#define COMET_GEMM_EPILOGUE_CUH

#include <cuda_bf16.h>

#include "gemm/args.h"
#include "gemm/schedule.cuh"
#include "base/fp8.h"
#include "base/ptx.cuh"

/* Where 16-byte chunk j (8 columns) of staged row r goes among the TMA store's boxes of 64
 * rows x 128 bytes, 128B-swizzled: the chunk index XOR the row's low 3 bits (conflict-free,
 * and the layout the store reads). */
static __device__ __forceinline__ uint32_t swizzled_chunk(int j, int r)
{
    return (uint32_t)((j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) << 4));
}

/* silu(x) = x / (1 + exp(-x)) with the fast divide (an RCP and a multiply, 2 ulp): the IEEE
 * division's Newton steps and range check cost 64 values x ~8 instructions per thread in
 * an epilogue the cooperative schedule does not overlap with MMAs. Below x = -87.3 the
 * denominator passes 2^126, where __fdividef gives 0 (and x / inf = -0 below -88.7): the
 * true value is under 1e-36. (tanh.approx would save the second MUFU op too, but its
 * 2^-11 error turns into 0.5% of silu for x near -3.) */
static __device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

/* silu's bits in 3 instructions fewer, for the quantizing SwiGLU: exp(-x) as 2^(x x -log2
 * e) by one ex2.approx.ftz, the MUFU.EX2 that __expf wraps in a range check and two
 * multiplies for results under 2^-126 (x above 87.3), where 1 + e rounds to 1 either way.
 * (The bf16 SwiGLU rows keep silu: this one shifts their register allocation into a
 * spill.) */
static __device__ __forceinline__ float silu_ex2(float x)
{
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -0x1.715476p+0f)); /* float(log2 e) */
    return __fdividef(x, 1.0f + e);
}

/* A consumer thread's state across its tiles. */
typedef struct epilogue_state {
    int pending_split;      /* TMA epilogue: the split of this warpgroup's last store, not yet counted */
    unsigned int push_sent; /* push: lane s of each warp, rows that warp sent to rank s */
} epilogue_state_t;

/* The push's destinations of this warpgroup's rows, loaded before the mainloop so the
 * epilogue does not start with a trip to L2: both ends of the part (is it one chunk?) and
 * this thread's two fragment rows. x = -1: none. */
typedef struct push_rows {
    int2 first, last, row[2];
} push_rows_t;

static __device__ __forceinline__ push_rows_t load_push_rows(const cometi_gemm_args_t &p, tile_t tl, int part,
                                                              int r_lo)
{
    push_rows_t r;
    r.first = make_int2(-1, 0), r.last = r.first, r.row[0] = r.row[1] = r.first;
    const int2 *dest = (const int2 *)p.push_dest;
    const cometi_segment_t sg = p.segs[tl.group];
    if (part + 64 <= sg.rows) {
        r.first = dest[sg.start + part];
        r.last = dest[sg.start + part + 63];
    }
#pragma unroll
    for (int h = 0; h < 2; h++)
        if (part + r_lo + 8 * h < sg.rows) r.row[h] = dest[sg.start + part + r_lo + 8 * h];
    return r;
}

/* A part of a tile cut along k (see cometi_gemm_tail_plan): partials are [cut tile][part]
 * [BN/8][256 threads] float4, so each store and load instruction is coalesced. A part
 * other than the last stores its partials, counts itself and returns true (no epilogue).
 * The last waits for the others' counts and adds their partials into acc, in part order
 * (the same bits every run). Both consumer warpgroups call it (cooperative schedule).
 * SWAP (E4M3 rows): each float4 holds its four sums as pairs swapped, (1, 0, 3, 2), on
 * both sides. A 16-byte store's source is four consecutive registers, so storing acc in
 * order made ptxas put sum j in the register bank of the MMA's fresh sum j, and every
 * promotion FFMA (acc[j] += part[j] x scale) read two or three operands from one bank:
 * 49-64 of each row's 128 with all three. Swapped, the sums sit in the other bank (none
 * left; cuobjdump -sass), as on the ping-pong rows, which have no cut. */
template <int BN, bool SWAP>
static __device__ __forceinline__ bool exchange_cut_partials(float *acc, const cometi_gemm_args_t &p,
                                                             const cometi_tail_plan_t *tail, int t, int k_blocks)
{
    constexpr int S = SWAP ? 1 : 0; /* sum 4 i + (j ^ S) is the float4's component j */
    /* Decoded again from t: fewer registers live across the mainloop. */
    const unit_t cut = decode_unit(t, tail, k_blocks);
    const int x = cut.tile - tail->first, tid = threadIdx.x - 128;
    unsigned long long *count = p.tail_ws + x;
    float4 *parts = (float4 *)(p.tail_ws + COMETI_GEMM_TAIL_COUNTERS) + (size_t)x * (tail->parts - 1) * (BN * 32);
    if (cut.part < tail->parts - 1) {
        float4 *mine = parts + (size_t)cut.part * (BN * 32);
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
            __stcg(&mine[i * 256 + tid],
                   make_float4(acc[4 * i + S], acc[4 * i + (1 ^ S)], acc[4 * i + (2 ^ S)], acc[4 * i + (3 ^ S)]));
        __threadfence();
        consumers_sync(); /* every thread's partials, then one count */
        if (threadIdx.x == 128) cometi_red_release_gpu_add(count, 1ull);
        return true;
    }
    /* Zeroed for the next call once every other part has counted (after a failed wait it
     * stays: the error is reported, and the workspace must be cleared). */
    if (threadIdx.x == 128 &&
        cometi_wait_geq(count, (unsigned long long)(tail->parts - 1), p.timeout_ns, p.err, COMETI_SITE_GEMM, -1, x))
        *count = 0;
    consumers_sync();
    for (int q = 0; q < tail->parts - 1; q++) {
        const float4 *theirs = parts + (size_t)q * (BN * 32);
#pragma unroll
        for (int i = 0; i < BN / 8; i++) {
            const float4 v = __ldcg(&theirs[i * 256 + tid]);
            acc[4 * i + S] += v.x, acc[4 * i + (1 ^ S)] += v.y;
            acc[4 * i + (2 ^ S)] += v.z, acc[4 * i + (3 ^ S)] += v.w;
        }
    }
    return false;
}

/* Training: each row's gate and up projections kept in bf16 beside the activation (gu,
 * [gu_rows][2n]: gate columns, then up). A full tile's (`tma`) leave like C's boxes through
 * this warpgroup's `stage`, BOXES boxes of 64 rows x 64 columns a round, gate's rounds then
 * up's, each into the gu map's matching half (a box past n or gu_rows is clipped): the bf16
 * SwiGLU stages a half's ON columns at once, the quantizing one, whose staging is sized for
 * E4M3, 64 at a time. Other tiles' go straight from registers, rows at or past gu_rows not
 * kept. Both are the same bf16 values. row0, lo_ok, hi_ok, col0, pairs: store_tile's. */
template <int BN, int ON, int BOXES>
static __device__ __forceinline__ void keep_gate_up(const float *acc, const cometi_gemm_args_t &p,
                                                    const CUtensorMap *map_gu, unsigned char *stage, tile_t tl,
                                                    cometi_segment_t seg, int part, int half, bool tma, int row0,
                                                    bool lo_ok, bool hi_ok, int col0, int pairs)
{
    constexpr int ROUNDS = ON / (64 * BOXES); /* a half's rounds */
    const int lane = threadIdx.x % 32, r_lo = ((threadIdx.x % 128) / 32) * 16 + lane / 4;
    if (tma) {
#pragma unroll
        for (int round = 0; round < 2 * ROUNDS; round++) {
            const int which = round / ROUNDS, c0 = (round % ROUNDS) * BOXES * 8; /* 0: gate, 1: up; its first chunk */
            if (threadIdx.x % 128 == 0) bulk_wait_read(); /* the last store has read the staging */
            warpgroup_sync(1 + half);
#pragma unroll
            for (int j = 0; j < BOXES * 8; j++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float *v = &acc[(c0 + j + which * (BN / 16)) * 4 + 2 * h];
                    __nv_bfloat162 x = __floats2bfloat162_rn(v[0], v[1]);
                    unsigned char *dst = stage + swizzled_chunk(j, r_lo + 8 * h) + (lane % 4) * 4;
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(dst)), "r"(*(uint32_t *)&x) : "memory");
                }
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* generic writes -> TMA reads */
            warpgroup_sync(1 + half);
            if (threadIdx.x % 128 == 0) {
#pragma unroll
                for (int box = 0; box < BOXES; box++)
                    tma_store_3d(map_gu, stage + box * 8192, tl.n * ON + c0 * 8 + box * 64, which,
                                 (int)(seg.start + part));
                bulk_commit();
            }
        }
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long long row = seg.start + row0 + 8 * h;
        if (!(h ? hi_ok : lo_ok) || row >= p.gu_rows) continue;
        __nv_bfloat16 *gate = (__nv_bfloat16 *)p.gu + row * 2 * p.n + col0, *up = gate + p.n;
#pragma unroll
        for (int j = 0; j < ON / 8; j++)
            if (j < pairs) {
                *(__nv_bfloat162 *)(gate + j * 8) = __floats2bfloat162_rn(acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1]);
                *(__nv_bfloat162 *)(up + j * 8) =
                    __floats2bfloat162_rn(acc[(j + BN / 16) * 4 + 2 * h], acc[(j + BN / 16) * 4 + 2 * h + 1]);
            }
    }
}

/* The tile's rows out. Fragment (j, q) of this thread is row warp*16 + lane/4 (+8 for
 * q >= 2), column j*8 + (lane%4)*2 (+1 for odd q) of this warpgroup's 64 x BN part `part`
 * (its first row in the group). OUT(j, h, e) is output column j*8 + (lane%4)*2 + e of row
 * r_lo + 8h, after SwiGLU and scaling. `seg`: the rows of C this tile's group owns (A's
 * segment; a weight gradient's, its m_out rows); `sc`: this block's staging;
 * `split_tiles`: column tiles per split; `empty` (with MAY_BE_EMPTY): the tile had no k. */
template <int V>
static __device__ __forceinline__ void store_tile(const float *acc, const cometi_gemm_args_t &p,
                                                  const CUtensorMap *map_c, const CUtensorMap *map_gu,
                                                  unsigned char *sc, tile_t tl,
                                                  cometi_segment_t seg, int part, int half, int split_tiles,
                                                  const push_rows_t &push, epilogue_state_t *st, bool empty)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int BN = T.block_n, TM = cometi_gemm_tile_rows(T), ON = cometi_gemm_out_cols(T);
    /* The gate and up kept are compiled into the rows that keep them alone; the push, the
     * fp32 add and the split counts are tested at run time in every bf16 row: compiled out
     * of the rows without them, the 256-wide kernels spilled a register or two (the register
     * allocation shifts with the code around the loop). The E4M3 rows keep the push and the
     * split counts only where they push or count (cometi_gemm_keeps_push). */
    constexpr bool TMA_EPILOGUE = T.store == COMETI_GEMM_STORE_TMA, SWIGLU = ON != BN,
                   GU = T.epilogue == COMETI_GEMM_EPI_SWIGLU_GU, MAY_BE_EMPTY = T.along == COMETI_GEMM_GROUPS_ALONG_K;
    constexpr bool PUSH_OR_SPLITS = cometi_gemm_keeps_push(T);
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int r_lo = warp * 16 + lane / 4, row0 = part + r_lo;
    const bool lo_ok = row0 < seg.rows, hi_ok = row0 + 8 < seg.rows;
    /* This thread's first output column, and how many of its column pairs (8 apart) lie
     * before n: a partial last column tile stores nothing at or past n (a pair never
     * straddles n, a multiple of 64). */
    const int col0 = tl.n * ON + (lane % 4) * 2, pairs = min(ON / 8, (p.n - col0 + 7) / 8);
    float scale[2] = {1.0f, 1.0f};
    if (p.row_scale) {
        if (lo_ok) scale[0] = p.row_scale[seg.start + row0];
        if (hi_ok) scale[1] = p.row_scale[seg.start + row0 + 8];
    }
    /* A tile with no k (a weight gradient's group without rows) had no MMA: its sum is 0,
     * whatever the registers hold (zeroing them before the MMAs would serialize them). */
    const bool zero = MAY_BE_EMPTY && empty;
#define OUT(j, h, e)                                                                                           \
    (zero ? 0.0f                                                                                               \
          : SWIGLU ? scale[h] * silu(acc[(j) * 4 + 2 * (h) + (e)]) * acc[((j) + BN / 16) * 4 + 2 * (h) + (e)] \
                   : scale[h] * acc[(j) * 4 + 2 * (h) + (e)])
    /* Training: the gate and up projections kept beside the activation, for the backward. */
    const bool full_tile = tl.m * TM + TM <= seg.rows;
    /* The TMA store's boxes a round (cometi_gemm_store_boxes), and this warpgroup's staging. */
    constexpr int BOXES = cometi_gemm_store_boxes(T);
    static_assert(!TMA_EPILOGUE || 2 * BOXES * 8192 <= cometi_gemm_staging_bytes(T), "two warpgroups' boxes fit");
    unsigned char *stage_c = sc + half * (BOXES * 8192);
    if (GU && TMA_EPILOGUE && p.gu_tma && full_tile)
        keep_gate_up<BN, ON, BOXES>(acc, p, map_gu, stage_c, tl, seg, part, half, true, row0, lo_ok, hi_ok, col0,
                                    pairs);
    else if (GU && p.gu)
        keep_gate_up<BN, ON, BOXES>(acc, p, map_gu, NULL, tl, seg, part, half, false, row0, lo_ok, hi_ok, col0, pairs);
    /* The push: the tile's rows go straight to their token owners' slots (gemm.h), over
     * NVLink for other ranks. If this warpgroup's 64 rows all go to consecutive slots of
     * one owner (one chunk: one owner at both ends of a full part, since a segment holds
     * one chunk per source rank), they leave like C's boxes, through that owner's map
     * (below); otherwise (two chunks meet, or a group's last rows) every thread stores its
     * fragments straight to their rows, keeping the copies off the SM's TMA unit (64 small
     * bulk copies there held the next tile's loads back). The rows are counted once, at the
     * block's end (the owner sums after the whole GEMM anyway), so no tile waits for its
     * stores to land. */
    const bool push_whole = TMA_EPILOGUE && (PUSH_OR_SPLITS ? p.push_dest : NULL) && push.first.x >= 0 && push.last.x == push.first.x &&
                            push.last.y - push.first.y == 63 * p.combine.tp;
    if (TMA_EPILOGUE && (PUSH_OR_SPLITS ? p.push_dest : NULL) && !push_whole) {
        const cometi_combine_t *cb = &p.combine;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int2 d = push.row[h];
            if (d.x >= 0) {
                __nv_bfloat16 *c = (__nv_bfloat16 *)cb->peers[d.x].slots + (size_t)d.y * p.n + tl.n * ON +
                                   (lane % 4) * 2;
#pragma unroll
                for (int j = 0; j < ON / 8; j++)
                    if (j < pairs)
                        *(__nv_bfloat162 *)(c + j * 8) = __floats2bfloat162_rn(OUT(j, h, 0), OUT(j, h, 1));
            }
            for (int s = 0; s < cb->world; s++) { /* a row is four lanes' */
                const unsigned int n = __popc(__ballot_sync(0xffffffffu, lane % 4 == 0 && d.x == s));
                if (lane == s) st->push_sent += n;
            }
        }
        return;
    }
    if (push_whole || (TMA_EPILOGUE && !(PUSH_OR_SPLITS ? p.push_dest : NULL) && !p.row_index && full_tile)) {
        /* Into shared memory as swizzled boxes (swizzled_chunk), BOXES at a time, then one
         * thread stores them asynchronously: to C, or to a push part's owner. */
        constexpr int ROUNDS = ON / 64 / BOXES;
#pragma unroll
        for (int round = 0; round < ROUNDS; round++) {
            if (threadIdx.x % 128 == 0) bulk_wait_read(); /* the last store has read the staging */
            warpgroup_sync(1 + half);
#pragma unroll
            for (int j = 0; j < BOXES * 8; j++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = r_lo + 8 * h, jt = round * BOXES * 8 + j; /* jt: the tile's chunk */
                    __nv_bfloat162 v = __floats2bfloat162_rn(OUT(jt, h, 0), OUT(jt, h, 1));
                    unsigned char *dst = stage_c + swizzled_chunk(j, r) + (lane % 4) * 4;
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(dst)), "r"(*(uint32_t *)&v) : "memory");
                }
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* generic writes -> TMA reads */
            warpgroup_sync(1 + half);
            if (threadIdx.x % 128 != 0) continue;
            const int t_rank = p.combine.rank % p.combine.tp;
            const CUtensorMap *map = push_whole ? &p.push_maps[push.first.x] : map_c;
            const int row = push_whole ? (push.first.y - t_rank) / p.combine.tp /* in the map's rows */
                                       : seg.start + part;
            /* (A partial last tile's boxes past n are clipped by the store: the maps end at n.) */
#pragma unroll
            for (int box = 0; box < BOXES; box++)
                tma_store_2d(map, stage_c + box * 8192, tl.n * ON + (round * BOXES + box) * 64, row);
            bulk_commit();
            if (PUSH_OR_SPLITS && p.split_done && round == ROUNDS - 1) {
                /* The split's readers load these rows with ordinary loads: a store must have
                 * landed, and the async proxy's writes be ordered before its count. Count
                 * each tile's stores one tile late (wait for all but this tile's rounds, a
                 * group each), so the next tile's MMAs never wait for a store to land; at a
                 * split's end, wait for all, so a finished split is not held back by a
                 * tile. (TMA stores are whole tiles: this warpgroup's 64 rows are all real.) */
                const int split = tl.n / split_tiles;
                if (st->pending_split >= 0 && st->pending_split != split) bulk_wait();
                else asm volatile("cp.async.bulk.wait_group %0;" ::"n"(ROUNDS) : "memory");
                asm volatile("fence.proxy.async.global;" ::: "memory");
                if (st->pending_split >= 0) cometi_red_release_gpu_add(&p.split_done[st->pending_split], 64ull);
                st->pending_split = split;
            }
        }
        if (push_whole && warp == 0 && lane == push.first.x) st->push_sent += 64; /* thread 0 sent them */
        return;
    }
    /* Straight from registers; rows past the group's end are padding, rows whose index is
     * negative are dropped. */
    long long dst_row[2] = {seg.start + row0, seg.start + row0 + 8};
    bool ok[2] = {lo_ok, hi_ok};
    if (p.row_index) {
        if (lo_ok) dst_row[0] = p.row_index[seg.start + row0];
        if (hi_ok) dst_row[1] = p.row_index[seg.start + row0 + 8];
        ok[0] = ok[0] && dst_row[0] >= 0;
        ok[1] = ok[1] && dst_row[1] >= 0;
    }
    if (MAY_BE_EMPTY && p.c_fp32_add) { /* gradient accumulation: C += the tile, fp32 */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float *c = (float *)p.c + dst_row[h] * p.ldc + col0;
#pragma unroll
            for (int j = 0; j < ON / 8; j++)
                if (ok[h] && j < pairs) {
                    float2 v = *(float2 *)(c + j * 8);
                    v.x += OUT(j, h, 0), v.y += OUT(j, h, 1);
                    *(float2 *)(c + j * 8) = v;
                }
        }
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        __nv_bfloat16 *c = (__nv_bfloat16 *)p.c + dst_row[h] * p.ldc + col0;
#pragma unroll
        for (int j = 0; j < ON / 8; j++)
            if (ok[h] && j < pairs)
                *(__nv_bfloat162 *)(c + j * 8) = __floats2bfloat162_rn(OUT(j, h, 0), OUT(j, h, 1));
    }
#undef OUT
    if (PUSH_OR_SPLITS && p.split_done) {
        /* Every thread's stores, then one count for the warpgroup's rows. */
        __threadfence();
        warpgroup_sync(1 + half);
        const int valid = min(64, seg.rows - part);
        if (threadIdx.x % 128 == 0 && valid > 0)
            cometi_red_release_gpu_add(&p.split_done[tl.n / split_tiles], (unsigned long long)valid);
    }
}

/* One 128-column scale block of this thread's two fragment rows (v: fragment (j, h, e) at
 * v[j * 4 + 2h + e], zeros past n) quantized: each row's amax over its quad (four lanes
 * hold a row's columns; NaN-propagating: a NaN or an infinity makes the scale NaN or Inf
 * and the block dequantizes to NaN, never a silent clamp), its scale, and the values times
 * 1 / scale rounded to E4M3 with saturation (base/fp8.h), two columns a 16-bit pair, the
 * first in the low byte. */
template <int ON>
static __device__ __forceinline__ void quantize_block_rows(const float *v, int pow2, uint16_t (*q)[2],
                                                           float scale[2])
{
    float amax[2] = {0.0f, 0.0f}, inv[2];
#pragma unroll
    for (int j = 0; j < ON / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            amax[h] = cometi_fp8_max(amax[h], cometi_fp8_max(cometi_fp8_abs(v[j * 4 + 2 * h]),
                                                             cometi_fp8_abs(v[j * 4 + 2 * h + 1])));
#pragma unroll
    for (int h = 0; h < 2; h++) {
        amax[h] = cometi_fp8_max(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 1));
        amax[h] = cometi_fp8_max(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 2));
        scale[h] = cometi_fp8_scale(amax[h], pow2);
        inv[h] = cometi_fp8_inverse(scale[h]);
    }
#pragma unroll
    for (int j = 0; j < ON / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            q[j][h] = cometi_e4m3x2_cvt(cometi_fp8_mul(v[j * 4 + 2 * h], inv[h]),
                                        cometi_fp8_mul(v[j * 4 + 2 * h + 1], inv[h]));
}

/* A quantized block's bytes out: a full tile's (`tma`) as one box of 64 rows x 128 bytes
 * per warpgroup through `stage` (128B-swizzled: byte column 8j + 2q is in 16-byte chunk
 * j / 2) and a TMA store at (x, y) of `map` (columns and rows past its ends clipped); other
 * tiles' 2 bytes at a time from the registers to `row[h]` (NULL: not stored) at byte
 * column col0 + 8j, j < pairs. */
template <int ON>
static __device__ __forceinline__ void store_block_e4m3(const uint16_t (*q)[2], const CUtensorMap *map,
                                                        unsigned char *stage, bool tma, int x, int y,
                                                        unsigned char *const row[2], int pairs, int half)
{
    const int lane = threadIdx.x % 32, r_lo = ((threadIdx.x % 128) / 32) * 16 + lane / 4;
    if (tma) {
        if (threadIdx.x % 128 == 0) bulk_wait_read(); /* the previous store has read the staging */
        warpgroup_sync(1 + half);
#pragma unroll
        for (int j = 0; j < ON / 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                unsigned char *dst = stage + swizzled_chunk(j / 2, r_lo + 8 * h) + (j % 2) * 8 + (lane % 4) * 2;
                asm volatile("st.shared.b16 [%0], %1;" ::"r"(smem_u32(dst)), "h"(q[j][h]) : "memory");
            }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* generic writes -> TMA reads */
        warpgroup_sync(1 + half);
        if (threadIdx.x % 128 == 0) {
            tma_store_2d(map, stage, x, y);
            bulk_commit();
        }
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < ON / 8; j++)
            if (row[h] && j < pairs) *(uint16_t *)(row[h] + j * 8) = q[j][h];
}

/* The quantizing SwiGLU (SWIGLU_E4M3): the tile's 128 output columns are one scale block,
 * so each row's block is whole in this thread's quad: quantize_block_rows, then the bytes
 * out (store_block_e4m3) and each row's scale by its quad's first lane. FP8 training keeps
 * each row's gate and up first, rows at or past gu_rows not kept: SWIGLU_E4M3_GU in bf16 (a
 * full tile's by TMA stores through the E4M3 tile's staging, 8 KB a warpgroup: four boxes
 * of 64 rows x 64 columns, one after another, so the ring keeps its four stages; other
 * tiles' straight from the registers), SWIGLU_E4M3_GU8 in E4M3, each a block quantized as
 * the activation is, gate's and up's bytes and scales out the same way as C's. */
template <int V>
static __device__ __forceinline__ void store_tile_e4m3(const float *acc, const cometi_gemm_args_t &p,
                                                       const CUtensorMap *map_c, const CUtensorMap *map_gu,
                                                       unsigned char *sc, tile_t tl, cometi_segment_t seg, int part,
                                                       int half)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int BN = T.block_n, TM = cometi_gemm_tile_rows(T), ON = cometi_gemm_out_cols(T);
    constexpr bool TMA_EPILOGUE = T.store == COMETI_GEMM_STORE_TMA;
    static_assert(ON == COMETI_GEMM_SCALE_BLOCK, "a tile's output columns are one scale block");
    static_assert(!TMA_EPILOGUE || (2 * 64 * ON <= cometi_gemm_staging_bytes(T) && 2 * 8192 <= cometi_gemm_staging_bytes(T)),
                  "two warpgroups' E4M3 rows, or bf16 boxes of the kept gate and up, fit the staging");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int r_lo = warp * 16 + lane / 4, row0 = part + r_lo;
    const bool ok[2] = {row0 < seg.rows, row0 + 8 < seg.rows};
    const int col0 = tl.n * ON + (lane % 4) * 2, pairs = min(ON / 8, (p.n - col0 + 7) / 8);
    const bool full_tile = tl.m * TM + TM <= seg.rows;
    unsigned char *stage = sc + half * (64 * ON);
    float rs[2] = {1.0f, 1.0f};
    if (p.row_scale) {
        if (ok[0]) rs[0] = p.row_scale[seg.start + row0];
        if (ok[1]) rs[1] = p.row_scale[seg.start + row0 + 8];
    }
    if (T.epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU) /* gu is given (prepare.c) */
        keep_gate_up<BN, ON, 1>(acc, p, map_gu, stage, tl, seg, part, half, TMA_EPILOGUE && p.gu_tma && full_tile,
                                row0, ok[0], ok[1], col0, pairs);
    float v[ON / 2], scale[2];
    uint16_t q[ON / 8][2];
    if (T.epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8) { /* gate's block, then up's */
#pragma unroll
        for (int which = 0; which < 2; which++) {
#pragma unroll
            for (int j = 0; j < ON / 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) v[j * 4 + i] = j < pairs ? acc[(j + which * (BN / 16)) * 4 + i] : 0.0f;
            quantize_block_rows<ON>(v, p.pow2_scales, q, scale);
            unsigned char *row[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const long long r = seg.start + row0 + 8 * h;
                const bool kept = ok[h] && r < p.gu_rows;
                row[h] = kept ? (unsigned char *)p.gu + r * 2 * p.n + which * p.n + col0 : NULL;
                if (kept && lane % 4 == 0) p.gu_scale[(long long)(which * (p.n / ON) + tl.n) * p.gu_rows + r] = scale[h];
            }
            store_block_e4m3<ON>(q, map_gu, stage, TMA_EPILOGUE && p.gu_tma && full_tile, which * p.n + tl.n * ON,
                                 seg.start + part, row, pairs, half);
        }
    }
    if (pairs == ON / 8 && !p.row_scale) {
        /* A whole column tile with no row scale (the layer's GEMM0): no guard or product per
         * value, so the values' chains interleave. */
#pragma unroll
        for (int i = 0; i < ON / 2; i++) v[i] = silu_ex2(acc[i]) * acc[i + BN / 4];
    } else {
#pragma unroll
        for (int j = 0; j < ON / 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    v[j * 4 + 2 * h + e] =
                        j < pairs ? rs[h] * silu_ex2(acc[j * 4 + 2 * h + e]) * acc[(j + BN / 16) * 4 + 2 * h + e]
                                  : 0.0f;
    }
    quantize_block_rows<ON>(v, p.pow2_scales, q, scale);
    unsigned char *row[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        row[h] = ok[h] ? (unsigned char *)p.c + (long long)(seg.start + row0 + 8 * h) * p.ldc + col0 : NULL;
        if (ok[h] && lane % 4 == 0)
            p.c_scale[(long long)(seg.start + row0 + 8 * h) * p.c_scale_row + (long long)tl.n * p.c_scale_block] =
                scale[h];
    }
    store_block_e4m3<ON>(q, map_c, stage, TMA_EPILOGUE && full_tile, tl.n * ON, seg.start + part, row, pairs, half);
}

/* After a warpgroup's last tile: its stores have landed before anyone is told. The push:
 * every tensor store of this thread has landed (and shared memory outlived them), the
 * warp's own stores are before its barrier, then lane s releases the warp's count for
 * owner s at system scope. The TMA epilogue: the last store counted in its split. */
template <int V>
static __device__ __forceinline__ void finish_stores(const cometi_gemm_args_t &p, int half,
                                                     const epilogue_state_t *st)
{
    constexpr bool TMA_EPILOGUE = cometi_gemm_variants[V].store == COMETI_GEMM_STORE_TMA;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    if (TMA_EPILOGUE && p.push_dest) {
        bulk_wait();
        asm volatile("fence.proxy.async.global;" ::: "memory");
        warp_bar_sync(3 + half * 4 + warp);
        if (st->push_sent)
            cometi_red_release_sys_add(p.combine.peers[lane].arrive + COMETI_PUSH_COUNTER, st->push_sent);
    }
    if (TMA_EPILOGUE && threadIdx.x % 128 == 0) {
        bulk_wait(); /* shared memory must outlive the stores */
        if (st->pending_split >= 0) {
            asm volatile("fence.proxy.async.global;" ::: "memory");
            cometi_red_release_gpu_add(&p.split_done[st->pending_split], 64ull);
        }
    }
}

#endif /* COMET_GEMM_EPILOGUE_CUH */
