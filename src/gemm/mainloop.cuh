/*
 * mainloop.cuh - the GEMM kernel's mainloop, both sides of its shared-memory ring
 * of stages: the producer thread's TMA loads of one unit's A and B tiles (k-steps
 * [kb0, kb1)), and a consumer warpgroup's wgmma over them, accumulating in registers. B is
 * K-major ([n][k], nn.Linear's [out][in]) or, for a dgrad GEMM, MN-major ([k][n]: the
 * instruction's B transpose reads it as it lies). E4M3 rows have their own consumer
 * (consume_unit_e4m3: block scales, fp32 promotion per k block).
 *
 * Checklist followed (Hopper's TMA and wgmma rules): 128B-swizzled K-major tiles of 64
 * bf16, stages 1024-byte aligned, full[s] count 1 with expect_tx (E4M3: 33, the scale
 * warp's lanes too), empty[s] one arrive per consumer warpgroup of the stage, each warp's
 * reads of a stage before that arrival, wgmma fence / commit / wait before touching
 * accumulators or releasing a stage.
 */
#ifndef COMET_GEMM_MAINLOOP_CUH
#define COMET_GEMM_MAINLOOP_CUH

#include "gemm/args.h"
#include "base/ptx.cuh"
#include "gemm/wgmma.cuh"

/* Where a block's shared memory is (kernel.cuh lays it out). */
typedef struct gemm_smem {
    unsigned char *a, *b, *c;   /* the stages of A and of B, the epilogue's staging */
    float *scales;              /* E4M3: per stage, its k block's scales (variants.h's slot) */
    uint64_t *full, *empty;     /* per stage: loaded, released by its consumers */
    uint64_t *turn;             /* ping-pong: [2] each warpgroup's turn at the mainloop */
    uint64_t *ticket_full, *ticket_empty; /* the ring of tickets (dynamic schedule) */
    int *first_tile, *tickets;
    cometi_tail_plan_t *tail;   /* the last wave's cut */
} gemm_smem_t;

/* A ring position: the stage and the parity its barriers are at. */
typedef struct ring_pos {
    int stage;
    uint32_t phase;
} ring_pos_t;

/* With dispatch blocks, in the last two rounds of tiles, how many k-steps before a tile's
 * last load its block takes its next ticket: early enough that the atomic's round trip
 * hides behind the stages still to compute, late enough that the ticket is not held while
 * other blocks go idle (on qwen2-57b's fused layer0 the last round cost 40-45 us per SM
 * with the ticket taken a whole tile ahead, 25-29 with 8 steps). Taking it late on every
 * tile left qwen2-moe-2.7b's layer0 1.5% slower, hence only the last two rounds. */
#define LATE_CLAIM_KBLOCKS 8

/* The producer's loads of k-steps [kb0, kb1) of tile `tl` into the ring. With a late claim
 * pending (!*claimed), the next ticket is taken LATE_CLAIM_KBLOCKS steps before the end.
 * a_row: A's first row (a weight gradient: the group's first row, where its k starts). */
template <int V>
static __device__ __forceinline__ void produce_unit(const cometi_gemm_args_t &p, const gemm_smem_t &sm,
                                                    const CUtensorMap *map_a, const CUtensorMap *map_b,
                                                    const CUtensorMap *map_up, tile_t tl, int a_row, int kb0, int kb1,
                                                    ring_pos_t *pos, bool *claimed, int *next)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int BN = T.block_n, STAGES = cometi_gemm_stages(T), TM = cometi_gemm_tile_rows(T),
                  ON = cometi_gemm_out_cols(T);
    constexpr bool SWIGLU = ON != BN, WGRAD = T.along == COMETI_GEMM_GROUPS_ALONG_K,
                   B_MN = !WGRAD && T.b_major == COMETI_GEMM_MN_MAJOR;
    /* k per stage: 64 bf16 or 128 E4M3, 128 bytes of a row either way (a box is one
     * 128B-swizzled span; the SwiGLU up rows start ON rows of 128 bytes in). */
    constexpr int BK = cometi_gemm_bk(T);
    const uint32_t A_BYTES = TM * 128, B_BYTES = BN * 128;
    const int b_row = tl.group * p.b_group_rows + tl.n * ON;
    for (int kb = kb0; kb < kb1; kb++) {
        if (!*claimed && kb >= kb1 - LATE_CLAIM_KBLOCKS) *next = (int)atomicAdd(&p.sched[0], 1u), *claimed = true;
        const int stage = pos->stage;
        mbar_wait(&sm.empty[stage], pos->phase ^ 1, p.err, p.timeout_ns);
        mbar_expect_tx(&sm.full[stage], A_BYTES + B_BYTES);
        if (WGRAD && T.a_major == COMETI_GEMM_K_MAJOR) {
            /* E4M3: A^T [m][tokens] and B^T [n][tokens], k along the rows: one box of each. */
            tma_load_2d(sm.a + stage * A_BYTES, map_a, a_row + kb * BK, tl.m * TM, &sm.full[stage]);
            tma_load_2d(sm.b + stage * B_BYTES, map_b, a_row + kb * BK, tl.n * BN, &sm.full[stage]);
            if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
            continue;
        }
        if (WGRAD) {
            /* A [rows][m] and B [rows][n], K down the rows: boxes of 64 columns x 64 rows, 8 KB
             * apart (A: TM / 64 of them, one per consumer warpgroup; B: BN / 64). */
            const int k_row = a_row + kb * BK;
#pragma unroll
            for (int j = 0; j < TM / 64; j++)
                tma_load_2d(sm.a + stage * A_BYTES + j * 8192, map_a, tl.m * TM + j * 64, k_row, &sm.full[stage]);
#pragma unroll
            for (int j = 0; j < BN / 64; j++)
                tma_load_2d(sm.b + stage * B_BYTES + j * 8192, map_b, tl.n * ON + j * 64, k_row, &sm.full[stage]);
            if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
            continue;
        }
        if (T.a_type == COMETI_GEMM_E4M3 && p.a_kb_strided) /* [rows][k blocks][128 bytes] */
            tma_load_3d(sm.a + stage * A_BYTES, map_a, 0, kb, a_row, &sm.full[stage]);
        else
            tma_load_2d(sm.a + stage * A_BYTES, map_a, kb * BK, a_row, &sm.full[stage]);
        if (B_MN) {
            /* B MN-major ([groups][k][n]): BN / 64 boxes of 64 k rows x 64 columns, 8 KB apart. */
#pragma unroll
            for (int j = 0; j < BN / 64; j++)
                tma_load_3d(sm.b + stage * B_BYTES + j * 8192, map_b, tl.n * ON + j * 64, kb * BK, tl.group,
                            &sm.full[stage]);
        } else if (SWIGLU) {
            /* Gate rows, then the matching up rows in the second half of the B tile,
             * each from a [groups][n][k] view, so a ragged last tile reads zeros. */
            tma_load_3d(sm.b + stage * B_BYTES, map_b, kb * BK, tl.n * ON, tl.group, &sm.full[stage]);
            tma_load_3d(sm.b + stage * B_BYTES + ON * 128, map_up, kb * BK, tl.n * ON, tl.group, &sm.full[stage]);
        } else {
            tma_load_2d(sm.b + stage * B_BYTES, map_b, kb * BK, b_row, &sm.full[stage]);
        }
        if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
    }
}

/* A consumer warpgroup's MMAs over k-steps [kb0, kb1): its 64 rows of the stage's A tile
 * (`a_off` bytes in) against the whole B tile, into acc. Each stage is released once the
 * MMAs that read it are done, the last one once all are. Ping-pong: the mainloop is handed
 * to the other warpgroup (`hand_over`) as soon as this one's MMAs are issued. */
template <int V>
static __device__ __forceinline__ void consume_unit(float *acc, const cometi_gemm_args_t &p, const gemm_smem_t &sm,
                                                    int a_off, int kb0, int kb1, ring_pos_t *pos, uint64_t *hand_over)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int BN = T.block_n, STAGES = cometi_gemm_stages(T), TM = cometi_gemm_tile_rows(T);
    constexpr bool PINGPONG = T.schedule == COMETI_GEMM_PINGPONG, WGRAD = T.along == COMETI_GEMM_GROUPS_ALONG_K,
                   B_MN = !WGRAD && T.b_major == COMETI_GEMM_MN_MAJOR;
    static_assert(T.a_type == COMETI_GEMM_BF16, "E4M3 rows take consume_unit_e4m3");
    const uint32_t A_BYTES = TM * COMETI_GEMM_BK * 2, B_BYTES = BN * COMETI_GEMM_BK * 2;
    /* Descriptors of stage 0 at k16 0, made once: a stage or a k16 step moves only the start
     * address (bits 0-13, in 16-byte units; no shared-memory address here carries out of
     * them), so each is an add to the low word. Made per k16 from the pointer, they cost
     * about 60 of a k-step's 97 instructions. k16 is 32 bytes further along a K-major row,
     * 16 rows of 128 bytes further in an MN-major tile. */
    const uint32_t a0 = WGRAD ? smem_desc_mn_lo(sm.a + a_off, 8192) : smem_desc_lo(sm.a + a_off);
    const uint32_t b0 = WGRAD || B_MN ? smem_desc_mn_lo(sm.b, 8192) : smem_desc_lo(sm.b);
    const uint32_t a_k16 = (WGRAD ? 2048 : 32) >> 4, b_k16 = (WGRAD || B_MN ? 2048 : 32) >> 4;
    int prev = -1;
    for (int kb = kb0; kb < kb1; kb++) {
        mbar_wait(&sm.full[pos->stage], pos->phase, p.err, p.timeout_ns);
        const uint32_t a = a0 + (uint32_t)pos->stage * (A_BYTES >> 4), b = b0 + (uint32_t)pos->stage * (B_BYTES >> 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < COMETI_GEMM_BK / 16; kk++) {
            const int accumulate = (kb - kb0) | kk;
            const uint64_t da = smem_desc_at(a + kk * a_k16), db = smem_desc_at(b + kk * b_k16);
            if (WGRAD) { /* both MN-major */
                if (BN == 256) cometi_wgmma_m64n256k16_amn_bmn(acc, da, db, accumulate);
                else cometi_wgmma_m64n128k16_amn_bmn(acc, da, db, accumulate);
            } else if (B_MN) {
                if (BN == 256) cometi_wgmma_m64n256k16_bmn(acc, da, db, accumulate);
                else cometi_wgmma_m64n128k16_bmn(acc, da, db, accumulate);
            } else if (BN == 256) {
                cometi_wgmma_m64n256k16(acc, da, db, accumulate);
            } else {
                cometi_wgmma_m64n128k16(acc, da, db, accumulate);
            }
        }
        wgmma_commit();
        /* The previous step's MMAs are done once at most this one is in flight. */
        wgmma_wait<1>();
        if (prev >= 0 && threadIdx.x % 128 == 0) mbar_arrive(&sm.empty[prev]);
        prev = pos->stage;
        if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
    }
    if (PINGPONG && threadIdx.x % 128 == 0) mbar_arrive(hand_over); /* the other's turn */
    wgmma_wait<0>();
    if (prev >= 0 && threadIdx.x % 128 == 0) mbar_arrive(&sm.empty[prev]);
}

/* E4M3: the producer's scale warp (a warp of warpgroup 0), over k-steps [kb0, kb1) of tile
 * `tl` (A's first row a_row; a weight gradient: its group's first token row, a multiple of
 * 128): for each k block, once its stage is released, the A tile's rows' scales (128, or
 * ping-pong's 64) and B's (groups along M: each half's block, SwiGLU's gate and up blocks
 * of column tile tl.n or a plain tile's 128-row blocks; along K: each of the tile's B
 * rows') copied into the stage's slot by cp.async, each lane's arrival on the stage's full
 * barrier (beside the TMA thread's with the bytes) coming once its copies have landed. The
 * warp holds no values, so it runs as many stages ahead as the ring has, like the TMA
 * thread: loaded into registers one or two blocks ahead instead, a stage's scales come an
 * L2 round trip after the previous one's, which under the GEMM's own traffic holds the
 * consumers back (the weight gradients most). A scale that does not exist is 0 (a row
 * past A, an n block past B: their products are never stored). Copies never pass the
 * unit, whose rows the dispatch role has seen arrive (an acquire: what L1 held of them
 * before is not read). */
template <int V>
static __device__ __forceinline__ void produce_scales_unit(const cometi_gemm_args_t &p, const gemm_smem_t &sm,
                                                           tile_t tl, long long a_row, int kb0, int kb1,
                                                           ring_pos_t *pos)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int BN = T.block_n, STAGES = cometi_gemm_stages(T), ON = cometi_gemm_out_cols(T), HALVES = BN / 128,
                  SLOT = cometi_gemm_scale_slot_floats(T);
    constexpr bool WGRAD = T.along == COMETI_GEMM_GROUPS_ALONG_K;
    constexpr int TM = cometi_gemm_tile_rows(T);
    static_assert(TM % 32 == 0 && TM <= COMETI_GEMM_BM, "a lane copies TM / 32 rows' scales of the tile");
    const int lane = threadIdx.x % 32;
    /* Along K: rows m of A^T and n of B^T, the token block a_row / 128 + kb. */
    if (WGRAD && a_row % COMETI_GEMM_SCALE_BLOCK && lane == 0) /* reported; the sums are wrong */
        cometi_record_error(p.err, COMETI_ASYNC_INVALID_ARGUMENT, COMETI_SITE_WGRAD_SEGMENT, tl.group, 0,
                            COMETI_GEMM_SCALE_BLOCK, (unsigned long long)a_row, 0);
    const long long row0 = WGRAD ? (long long)tl.m * 128 : a_row, rows = WGRAD ? p.m_out : p.a_rows,
                    kb_first = WGRAD ? a_row / COMETI_GEMM_SCALE_BLOCK : 0;
    const float *sb = p.a_scale; /* along M: this lane's half's B block (lane < HALVES) */
    bool sb_ok = false;
    if (!WGRAD && lane < HALVES) {
        const int nb = ON != BN ? tl.n : tl.n * HALVES + lane;
        sb = (ON != BN && lane ? p.b_up_scale : p.b_scale) + (long long)tl.group * p.b_scale_group +
             (long long)nb * p.b_scale_kb;
        sb_ok = nb < p.b_scale_blocks;
    }
    for (int kb = kb0; kb < kb1; kb++) {
        mbar_wait(&sm.empty[pos->stage], pos->phase ^ 1, p.err, p.timeout_ns);
        float *slot = sm.scales + pos->stage * SLOT;
        const long long blk = kb_first + kb;
#pragma unroll
        for (int j = 0; j < TM / 32; j++) {
            const long long r = row0 + lane + 32 * j;
            cp_async_f32(slot + lane + 32 * j, p.a_scale + (r < rows ? r * p.a_scale_row + blk * p.a_scale_block : 0),
                         r < rows);
        }
        if constexpr (WGRAD) {
#pragma unroll
            for (int j = 0; j < BN / 64; j++) { /* the word of columns 2 (lane + 32 j) and the next, 8 j past lane's */
                const int n = tl.n * BN + 2 * (lane + 32 * j); /* n even, p.n a multiple of 64: both or neither */
                cp_async_f32(slot + COMETI_GEMM_BM + cometi_gemm_col_scale_pos(T, 2 * lane) + 8 * j,
                             (const float *)(p.b_scale16 + (n < p.n ? n + blk * p.b_scale_block : 0)), n < p.n);
            }
        } else if (lane < HALVES) {
            cp_async_f32(slot + COMETI_GEMM_BM + lane, sb_ok ? sb + kb : sb, sb_ok);
        }
        cp_async_mbar_arrive(&sm.full[pos->stage]); /* each lane's, once its copies have landed */
        if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
    }
}

/* A stage's scale slot, and this thread's scales in it: its two rows' (fragment rows r and
 * r + 8 of the tile) and each half's B scale. */
template <int V>
static __device__ __forceinline__ const float *stage_slot(const gemm_smem_t &sm, int stage)
{
    return sm.scales + stage * cometi_gemm_scale_slot_floats(cometi_gemm_variants[V]);
}
typedef struct e4m3_scales {
    float a0, a1;
} e4m3_scales_t;
static __device__ __forceinline__ e4m3_scales_t stage_row_scales(const float *slot, int row)
{
    e4m3_scales_t s = {lds_f32(slot + row), lds_f32(slot + row + 8)};
    return s;
}
static __device__ __forceinline__ float stage_b_scale(const float *slot, int h)
{
    return lds_f32(slot + COMETI_GEMM_BM + h);
}

/* One k block of a 128-wide E4M3 tile: fresh sums of its four k-32 MMAs into `part`. The
 * descriptors' low words are the same in every lane; taken from lane 0, the compiler knows
 * it and steps them in uniform registers (2 adds an MMA) instead of moving each word from a
 * vector register (4 R2UR and 4 more an MMA): GEMM1 and the data gradients 2-3% faster. */
static __device__ __forceinline__ void issue_e4m3_block(float *part, uint32_t a, uint32_t b)
{
    a = __shfl_sync(0xffffffffu, a, 0), b = __shfl_sync(0xffffffffu, b, 0);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) /* k 32 is 32 bytes further along a K-major row */
        cometi_wgmma_m64n128k32_e4m3(part, smem_desc_at(a + kk * 2), smem_desc_at(b + kk * 2), kk);
    wgmma_commit();
}

/* acc += part x (row scale x block scale), fp32: the promotion of one k block. */
static __device__ __forceinline__ void promote_e4m3(float *acc, const float *part, float s0, float s1)
{
#pragma unroll
    for (int j = 0; j < 16; j++) {
        float *d = &acc[j * 4];
        d[0] = fmaf(part[j * 4], s0, d[0]), d[1] = fmaf(part[j * 4 + 1], s0, d[1]);
        d[2] = fmaf(part[j * 4 + 2], s1, d[2]), d[3] = fmaf(part[j * 4 + 3], s1, d[3]);
    }
}

/* The weight gradients' promotion: acc += part x (row scale x column scale), this thread's
 * column pairs' B scales read from the stage's slot (`b_cols`: its run's 16 words of the
 * half, pair j's two bf16 scales in word j, the even column's in the low half;
 * cometi_gemm_col_scale_pos), four pairs per 16-byte load. Read into registers while the
 * MMAs run instead, as fp32 they cost spills and 5-14% of the GEMM's time
 * (docs/PERF-archive.md). */
static __device__ __forceinline__ void promote_e4m3_cols(float *acc, const float *part, float s0, float s1,
                                                         const float *b_cols)
{
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 w4 = lds_f32x4(b_cols + i * 4);
        const uint32_t w[4] = {__float_as_uint(w4.x), __float_as_uint(w4.y), __float_as_uint(w4.z),
                               __float_as_uint(w4.w)};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float sx = __uint_as_float(w[k] << 16), sy = __uint_as_float(w[k] & 0xffff0000u);
            float *d = &acc[(i * 4 + k) * 4];
            const float *c = &part[(i * 4 + k) * 4];
            d[0] = fmaf(c[0], s0 * sx, d[0]), d[1] = fmaf(c[1], s0 * sy, d[1]);
            d[2] = fmaf(c[2], s1 * sx, d[2]), d[3] = fmaf(c[3], s1 * sy, d[3]);
        }
    }
}

/* A step of the 128-wide E4M3 mainloop: block kb's MMAs are in flight into `done`; block
 * kb + 1's are issued into `next` (once its stage is full, scales included), then kb's are
 * waited for (one group may stay in flight), its stage released and its sums promoted
 * while kb + 1's run. Two sets of fresh registers (64 each beside the 64 accumulators)
 * keep the tensor core fed from one warpgroup. */
typedef struct e4m3_pipe {
    int prev_stage; /* the stage of the block in flight in `done` */
    float s0, s1;   /* its scales: each row's A scale x the block's B scale */
} e4m3_pipe_t;

/* The scales of the block in `stage`, each row's A scale times the block's B scale. */
template <int V>
static __device__ __forceinline__ void pipe_scales(const gemm_smem_t &sm, int stage, int row, float *s0, float *s1)
{
    const float *slot = stage_slot<V>(sm, stage);
    const e4m3_scales_t sa = stage_row_scales(slot, row);
    const float sb = stage_b_scale(slot, 0);
    *s0 = sa.a0 * sb, *s1 = sa.a1 * sb;
}

template <int V>
static __device__ __forceinline__ void step_e4m3(float *acc, float *done, float *next, const cometi_gemm_args_t &p,
                                                 const gemm_smem_t &sm, uint32_t a0, uint32_t b0, int row, int kb,
                                                 int kb1, ring_pos_t *pos, e4m3_pipe_t *pipe)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int STAGES = cometi_gemm_stages(T), TM = cometi_gemm_tile_rows(T);
    const uint32_t A_BYTES = TM * 128, B_BYTES = T.block_n * 128;
    float n0 = 0.0f, n1 = 0.0f;
    int next_stage = -1;
    if (kb + 1 < kb1) {
        mbar_wait(&sm.full[pos->stage], pos->phase, p.err, p.timeout_ns);
        pipe_scales<V>(sm, pos->stage, row, &n0, &n1);
        issue_e4m3_block(next, a0 + (uint32_t)pos->stage * (A_BYTES >> 4), b0 + (uint32_t)pos->stage * (B_BYTES >> 4));
        next_stage = pos->stage;
        if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
        wgmma_wait<1>();
    } else {
        wgmma_wait<0>();
    }
    if (threadIdx.x % 128 == 0) mbar_arrive(&sm.empty[pipe->prev_stage]);
    promote_e4m3(acc, done, pipe->s0, pipe->s1);
    pipe->prev_stage = next_stage, pipe->s0 = n0, pipe->s1 = n1;
}

/* The 128-wide E4M3 mainloop, pipelined across k blocks (step_e4m3), unrolled by two so
 * the two register sets keep fixed names. */
template <int V>
static __device__ __forceinline__ void consume_e4m3_pipelined(float *acc, const cometi_gemm_args_t &p,
                                                              const gemm_smem_t &sm, uint32_t a0, uint32_t b0,
                                                              int row, int kb0, int kb1, ring_pos_t *pos)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int STAGES = cometi_gemm_stages(T), TM = cometi_gemm_tile_rows(T);
    const uint32_t A_BYTES = TM * 128, B_BYTES = T.block_n * 128;
    if (kb0 >= kb1) return;
    float part0[64], part1[64];
    e4m3_pipe_t pipe;
    mbar_wait(&sm.full[pos->stage], pos->phase, p.err, p.timeout_ns);
    pipe_scales<V>(sm, pos->stage, row, &pipe.s0, &pipe.s1);
    issue_e4m3_block(part0, a0 + (uint32_t)pos->stage * (A_BYTES >> 4), b0 + (uint32_t)pos->stage * (B_BYTES >> 4));
    pipe.prev_stage = pos->stage;
    if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
    for (int kb = kb0; kb < kb1; kb += 2) {
        step_e4m3<V>(acc, part0, part1, p, sm, a0, b0, row, kb, kb1, pos, &pipe);
        if (kb + 1 >= kb1) break;
        step_e4m3<V>(acc, part1, part0, p, sm, a0, b0, row, kb + 1, kb1, pos, &pipe);
    }
}

/* A consumer warpgroup's mainloop over k-steps [kb0, kb1) of an E4M3 row (one stage is one
 * 128-wide k block, its scales in the stage's slot): for each 128-column half of the B
 * tile, four MMAs of k 32 into `part`, fresh each block, then acc += part x (its row's A
 * scale x the half's B scale) in fp32. The promotion keeps the tensor core's FP8 sums
 * (narrower than fp32) within one block, and applies the block scales where they change.
 * The half's MMAs must be done before its promotion reads them; the other consumer
 * warpgroup's MMAs fill the gap. Along K (the weight gradients) each output column has
 * its B row's scale, read from the slot by the promotion, so the stage is released after
 * it, once the whole warpgroup is past it (a named barrier). The 128-wide rows along M
 * pipeline two blocks instead (consume_e4m3_pipelined). Ping-pong (64-row tiles, one per
 * warpgroup): the mainloop is handed to the other warpgroup (`hand_over`) once this one has
 * seen its tile's last stage filled, so the other's MMAs run beside this one's last
 * promotion and its epilogue.
 * `a_off`: this warpgroup's 64 rows, bytes into the stage's A tile. */
template <int V>
static __device__ __forceinline__ void consume_unit_e4m3(float *acc, const cometi_gemm_args_t &p,
                                                         const gemm_smem_t &sm, int a_off, int kb0, int kb1,
                                                         ring_pos_t *pos, uint64_t *hand_over)
{
    constexpr cometi_gemm_variant_t T = cometi_gemm_variants[V];
    constexpr int BN = T.block_n, STAGES = cometi_gemm_stages(T), TM = cometi_gemm_tile_rows(T), HALVES = BN / 128;
    constexpr bool WGRAD = T.along == COMETI_GEMM_GROUPS_ALONG_K;
    constexpr bool PINGPONG = T.schedule == COMETI_GEMM_PINGPONG;
    static_assert(T.a_type == COMETI_GEMM_E4M3 && T.b_type == COMETI_GEMM_E4M3 && T.a_major == COMETI_GEMM_K_MAJOR &&
                      T.b_major == COMETI_GEMM_K_MAJOR && (!PINGPONG || (HALVES == 2 && !WGRAD)),
                  "E4M3 rows: K-major operands; ping-pong 256 wide, groups along M");
    const uint32_t A_BYTES = TM * 128, B_BYTES = BN * 128;
    /* This thread's first fragment row in the tile (the other is 8 further), and its
     * warpgroup's 64 rows (0 or 1: the named barrier 1 + wg_half is the warpgroup's). */
    const int row = a_off / 128 + ((threadIdx.x % 128) / 32) * 16 + (threadIdx.x % 32) / 4, wg_half = a_off / (64 * 128);
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc[i] = 0.0f;
    const uint32_t a0 = smem_desc_lo(sm.a + a_off), b0 = smem_desc_lo(sm.b);
    if constexpr (HALVES == 1 && !WGRAD) {
        consume_e4m3_pipelined<V>(acc, p, sm, a0, b0, row, kb0, kb1, pos);
    } else {
    for (int kb = kb0; kb < kb1; kb++) {
        mbar_wait(&sm.full[pos->stage], pos->phase, p.err, p.timeout_ns);
        if (PINGPONG && kb == kb1 - 1 && threadIdx.x % 128 == 0) mbar_arrive(hand_over); /* the other's turn */
        const float *slot = stage_slot<V>(sm, pos->stage);
        const e4m3_scales_t sa = stage_row_scales(slot, row);
        const uint32_t a = a0 + (uint32_t)pos->stage * (A_BYTES >> 4), b = b0 + (uint32_t)pos->stage * (B_BYTES >> 4);
#pragma unroll
        for (int h = 0; h < HALVES; h++) {
            /* Along M the half's B scale is read before its MMAs: they complete only once every
             * warp has issued them, so each warp's reads of the slot precede the release. */
            const float sb = WGRAD ? 0.0f : stage_b_scale(slot, h);
            float part[64];
            issue_e4m3_block(part, a, b + h * (128 * 128 >> 4)); /* the half's 128 rows of B */
            wgmma_wait<0>();
            if constexpr (WGRAD) {
                promote_e4m3_cols(acc + h * 64, part, sa.a0, sa.a1,
                                  slot + COMETI_GEMM_BM + cometi_gemm_col_scale_pos(T, h * 128 + (threadIdx.x % 4) * 2));
                if (h == HALVES - 1) {
                    /* The promotion read the slot after the wait: every warp of this warpgroup
                     * is past it before the one arrival releases the stage. */
                    warpgroup_sync(1 + wg_half);
                    if (threadIdx.x % 128 == 0) mbar_arrive(&sm.empty[pos->stage]);
                }
            } else {
                if (h == HALVES - 1 && threadIdx.x % 128 == 0) mbar_arrive(&sm.empty[pos->stage]);
                promote_e4m3(acc + h * 64, part, sa.a0 * sb, sa.a1 * sb);
            }
        }
        if (++pos->stage == STAGES) pos->stage = 0, pos->phase ^= 1;
    }
    if (PINGPONG && kb0 >= kb1 && threadIdx.x % 128 == 0) mbar_arrive(hand_over);
    }
}

#endif /* COMET_GEMM_MAINLOOP_CUH */
