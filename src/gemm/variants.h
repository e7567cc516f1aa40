/*
 * variants.h - every variant of the grouped GEMM that is built, as one table, and what
 * follows from a row of it. A variant is the set of choices the kernel is compiled for:
 * the operands' number formats and layouts, the epilogue, how C leaves the registers,
 * the schedule, the tile width and the roles it can take. Everything else (shapes,
 * pointers, the grid, the tile order, row scales and indices, the last wave's cut) is a
 * run-time argument.
 *
 * From this one table come:
 *   - the kernels: kernel.cuh is grouped_gemm_kernel<V> for row V; gemm_forward.cu,
 *     gemm_dgrad.cu and gemm_wgrad.cu compile their family's rows, and the launch switch
 *     is a case per row;
 *   - the host checks: cometi_gemm_prepare (prepare.c) resolves a description (gemm.h) to
 *     the row with exactly its choices, or refuses it naming the choices no row has;
 *   - the tests: test_gemm_variants.c runs every row against float64.
 * Adding a number format or a layout is a row here plus the mainloop and epilogue code
 * its new values need (docs/ARCHITECTURE.md, "How to add a GEMM variant").
 *
 * Plain C and C++ (constexpr there), no CUDA header: host C, kernels and tests share it.
 */
#ifndef COMET_GEMM_VARIANTS_H
#define COMET_GEMM_VARIANTS_H

#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Operand number formats. */
enum {
    COMETI_GEMM_BF16 = 0, /* bf16 values, fp32 accumulation */
    COMETI_GEMM_E4M3 = 1  /* block-scaled FP8: E4M3 values and an FP32 scale per block (A: 1 x 128
                           * along k, B: 128 x 128), each 128-wide k block's sums scaled and
                           * added in fp32 (never accumulated across blocks in the tensor core) */
};

/* Where an operand's k runs: along its rows' contiguous elements (K-major, nn.Linear's
 * [out][in] read as B of x W^T), or down its rows (MN-major: a weight read as B of dy W, or
 * a weight gradient's operands). */
enum {
    COMETI_GEMM_K_MAJOR = 0,
    COMETI_GEMM_MN_MAJOR = 1
};

/* What the groups (experts) split: A's rows (the forward and the dgrad GEMMs: group g's
 * rows of A and C are its segment), or the contraction (the weight gradients: group g's
 * rows of A and B are its k, and C holds one [m_out][n] matrix per group). */
enum {
    COMETI_GEMM_GROUPS_ALONG_M = 0,
    COMETI_GEMM_GROUPS_ALONG_K = 1
};

/* What the epilogue makes of a tile's fp32 sums. */
enum {
    COMETI_GEMM_EPI_STORE = 0,     /* C = the sums in bf16 (times a row scale, to a row index, when
                                    * the description gives them) */
    COMETI_GEMM_EPI_SWIGLU = 1,    /* C = silu(A B_gate^T) * (A B_up^T): gate and up columns of one
                                    * expert meet in a tile of 128 + 128 columns */
    COMETI_GEMM_EPI_SWIGLU_GU = 2, /* SwiGLU, and each row's gate and up kept (training) */
    COMETI_GEMM_EPI_PUSH = 3,      /* each row to its token owner's slot, over NVLink (GEMM -> combine) */
    COMETI_GEMM_EPI_ADD_FP32 = 4,  /* C (fp32) += the sums: gradient accumulation (main_grad) */
    COMETI_GEMM_EPI_SWIGLU_E4M3 = 5, /* SwiGLU, C quantized: E4M3 values and a scale per row per 128
                                      * columns (the next FP8 GEMM's A) */
    COMETI_GEMM_EPI_SWIGLU_E4M3_GU = 6, /* the quantizing SwiGLU, and each row's gate and up kept in
                                         * bf16 (FP8 training) */
    COMETI_GEMM_EPI_SWIGLU_E4M3_GU8 = 7 /* the same with gate and up kept in E4M3 too, quantized as the
                                         * activation is (1 x 128 blocks, MN-major scales) */
};

/* How C leaves the registers (0 is a description's "choose", gemm.h). */
enum {
    COMETI_GEMM_STORE_TMA = 1,   /* through swizzled shared memory and an asynchronous tensor store
                                  * (whole tiles; a group's last partial tile goes direct) */
    COMETI_GEMM_STORE_DIRECT = 2 /* straight from the registers, 4 bytes at a time */
};

/* How the two consumer warpgroups share tiles (0 is a description's "choose": cooperative). */
enum {
    COMETI_GEMM_COOPERATIVE = 1, /* both on one 128-row tile */
    COMETI_GEMM_PINGPONG = 2     /* each on its own 64-row tile, taking turns at the mainloop */
};

/* Roles a variant can take (a mask): blocks or counts beside the GEMM that make it one of
 * COMET's two patterns. A variant takes exactly the roles of its row. */
#define COMETI_GEMM_ROLE_NONE 0     /* none */
#define COMETI_GEMM_ROLE_DISPATCH 1 /* dispatch -> GEMM: rows copied into A over NVLink, tiles wait */
#define COMETI_GEMM_ROLE_SPLITS 2   /* GEMM -> combine: column splits counted, combine blocks */

#define COMETI_GEMM_VARIANT_NAME_MAX 32

typedef struct cometi_gemm_variant {
    char name[COMETI_GEMM_VARIANT_NAME_MAX];
    int a_type, b_type;   /* COMETI_GEMM_BF16, COMETI_GEMM_E4M3 */
    int a_major, b_major; /* COMETI_GEMM_K_MAJOR, COMETI_GEMM_MN_MAJOR */
    int along;            /* COMETI_GEMM_GROUPS_ALONG_* */
    int epilogue;         /* COMETI_GEMM_EPI_* */
    int store;            /* COMETI_GEMM_STORE_* */
    int schedule;         /* COMETI_GEMM_COOPERATIVE, COMETI_GEMM_PINGPONG */
    int block_n;          /* rows of B per tile: 128 or 256 (SwiGLU: 128 gate + 128 up) */
    int roles;            /* COMETI_GEMM_ROLE_* */
} cometi_gemm_variant_t;

/*
 * The table. Columns: name, A's and B's format, A's and B's majorness, what the groups
 * split, epilogue, store, schedule, tile width, roles. Rows are what the layer runs (the
 * forward's GEMM0 and GEMM1, the backward's dgrad GEMMs and weight gradients, each alone
 * and with the role its pattern gives it), what `comet gemm` compares, and the plain
 * forms their epilogues and stores fall back to. Names are the variant's choices, short.
 */
#define COMETI_GEMM_VARIANTS(X)                                                                      \
    /* the forward: x W^T, A and B K-major */                                                        \
    X(swiglu,             BF16, BF16, K,  K,  M, SWIGLU,    TMA,    COOPERATIVE, 256, NONE)          \
    X(swiglu_direct,      BF16, BF16, K,  K,  M, SWIGLU,    DIRECT, COOPERATIVE, 256, NONE)          \
    X(swiglu_pingpong,    BF16, BF16, K,  K,  M, SWIGLU,    TMA,    PINGPONG,    256, NONE)          \
    X(swiglu_dispatch,    BF16, BF16, K,  K,  M, SWIGLU,    TMA,    COOPERATIVE, 256, DISPATCH)      \
    X(swiglu_gu,          BF16, BF16, K,  K,  M, SWIGLU_GU, TMA,    COOPERATIVE, 256, NONE)          \
    X(swiglu_gu_dispatch, BF16, BF16, K,  K,  M, SWIGLU_GU, TMA,    COOPERATIVE, 256, DISPATCH)      \
    X(nt_256,             BF16, BF16, K,  K,  M, STORE,     TMA,    COOPERATIVE, 256, NONE)          \
    X(nt_128,             BF16, BF16, K,  K,  M, STORE,     TMA,    COOPERATIVE, 128, NONE)          \
    X(nt_256_direct,      BF16, BF16, K,  K,  M, STORE,     DIRECT, COOPERATIVE, 256, NONE)          \
    X(nt_128_direct,      BF16, BF16, K,  K,  M, STORE,     DIRECT, COOPERATIVE, 128, NONE)          \
    X(nt_pingpong,        BF16, BF16, K,  K,  M, STORE,     TMA,    PINGPONG,    256, NONE)          \
    X(nt_pingpong_direct, BF16, BF16, K,  K,  M, STORE,     DIRECT, PINGPONG,    256, NONE)          \
    X(nt_256_splits,      BF16, BF16, K,  K,  M, STORE,     TMA,    COOPERATIVE, 256, SPLITS)        \
    X(nt_128_splits,      BF16, BF16, K,  K,  M, STORE,     TMA,    COOPERATIVE, 128, SPLITS)        \
    X(nt_256_push,        BF16, BF16, K,  K,  M, PUSH,      TMA,    COOPERATIVE, 256, NONE)          \
    X(nt_128_push,        BF16, BF16, K,  K,  M, PUSH,      TMA,    COOPERATIVE, 128, NONE)          \
    /* the forward's small batches (cometi_model_pingpong): ping-pong with the layer's roles */    \
    X(swiglu_pingpong_dispatch, BF16, BF16, K, K, M, SWIGLU, TMA,   PINGPONG,    256, DISPATCH)      \
    X(nt_pingpong_splits, BF16, BF16, K,  K,  M, STORE,     TMA,    PINGPONG,    256, SPLITS)        \
    X(nt_pingpong_push,   BF16, BF16, K,  K,  M, PUSH,      TMA,    PINGPONG,    256, NONE)          \
    /* the dgrad GEMMs: dy W, B MN-major (a weight as the forward keeps it) */                       \
    X(nn_256,             BF16, BF16, K,  MN, M, STORE,     TMA,    COOPERATIVE, 256, NONE)          \
    X(nn_128,             BF16, BF16, K,  MN, M, STORE,     TMA,    COOPERATIVE, 128, NONE)          \
    X(nn_256_direct,      BF16, BF16, K,  MN, M, STORE,     DIRECT, COOPERATIVE, 256, NONE)          \
    X(nn_128_direct,      BF16, BF16, K,  MN, M, STORE,     DIRECT, COOPERATIVE, 128, NONE)          \
    X(nn_256_dispatch,    BF16, BF16, K,  MN, M, STORE,     TMA,    COOPERATIVE, 256, DISPATCH)      \
    X(nn_128_dispatch,    BF16, BF16, K,  MN, M, STORE,     TMA,    COOPERATIVE, 128, DISPATCH)      \
    X(nn_256_splits,      BF16, BF16, K,  MN, M, STORE,     TMA,    COOPERATIVE, 256, SPLITS)        \
    X(nn_128_splits,      BF16, BF16, K,  MN, M, STORE,     TMA,    COOPERATIVE, 128, SPLITS)        \
    X(nn_256_push,        BF16, BF16, K,  MN, M, PUSH,      TMA,    COOPERATIVE, 256, NONE)          \
    X(nn_128_push,        BF16, BF16, K,  MN, M, PUSH,      TMA,    COOPERATIVE, 128, NONE)          \
    /* the weight gradients: A^T B, groups along K, both MN-major */                                 \
    X(wgrad_256,          BF16, BF16, MN, MN, K, STORE,     TMA,    COOPERATIVE, 256, NONE)          \
    X(wgrad_128,          BF16, BF16, MN, MN, K, STORE,     TMA,    COOPERATIVE, 128, NONE)          \
    X(wgrad_256_direct,   BF16, BF16, MN, MN, K, STORE,     DIRECT, COOPERATIVE, 256, NONE)          \
    X(wgrad_128_direct,   BF16, BF16, MN, MN, K, STORE,     DIRECT, COOPERATIVE, 128, NONE)          \
    X(wgrad_256_add,      BF16, BF16, MN, MN, K, ADD_FP32,  DIRECT, COOPERATIVE, 256, NONE)          \
    X(wgrad_128_add,      BF16, BF16, MN, MN, K, ADD_FP32,  DIRECT, COOPERATIVE, 128, NONE)          \
    /* the FP8 forward: x W^T in E4M3 with block scales, A and B K-major */                         \
    X(fp8_swiglu,         E4M3, E4M3, K,  K,  M, SWIGLU_E4M3, TMA,    COOPERATIVE, 256, NONE)        \
    X(fp8_swiglu_direct,  E4M3, E4M3, K,  K,  M, SWIGLU_E4M3, DIRECT, COOPERATIVE, 256, NONE)        \
    X(fp8_swiglu_dispatch, E4M3, E4M3, K, K,  M, SWIGLU_E4M3, TMA,    COOPERATIVE, 256, DISPATCH)    \
    X(fp8_swiglu_gu,      E4M3, E4M3, K,  K,  M, SWIGLU_E4M3_GU, TMA, COOPERATIVE, 256, NONE)        \
    X(fp8_swiglu_gu_dispatch, E4M3, E4M3, K, K, M, SWIGLU_E4M3_GU, TMA, COOPERATIVE, 256, DISPATCH)  \
    X(fp8_swiglu_gu8,     E4M3, E4M3, K,  K,  M, SWIGLU_E4M3_GU8, TMA, COOPERATIVE, 256, NONE)       \
    X(fp8_swiglu_gu8_dispatch, E4M3, E4M3, K, K, M, SWIGLU_E4M3_GU8, TMA, COOPERATIVE, 256, DISPATCH) \
    X(fp8_nt_256,         E4M3, E4M3, K,  K,  M, STORE,     TMA,    COOPERATIVE, 256, NONE)          \
    X(fp8_nt_128,         E4M3, E4M3, K,  K,  M, STORE,     TMA,    COOPERATIVE, 128, NONE)          \
    X(fp8_nt_256_direct,  E4M3, E4M3, K,  K,  M, STORE,     DIRECT, COOPERATIVE, 256, NONE)          \
    X(fp8_nt_128_direct,  E4M3, E4M3, K,  K,  M, STORE,     DIRECT, COOPERATIVE, 128, NONE)          \
    X(fp8_swiglu_pingpong, E4M3, E4M3, K, K,  M, SWIGLU_E4M3, TMA,    PINGPONG,    256, NONE)        \
    X(fp8_nt_pingpong,    E4M3, E4M3, K,  K,  M, STORE,     TMA,    PINGPONG,    256, NONE)          \
    X(fp8_swiglu_pingpong_dispatch, E4M3, E4M3, K, K, M, SWIGLU_E4M3, TMA, PINGPONG, 256, DISPATCH) \
    /* GEMM1 with its roles, and the backward's data-gradient GEMM of W2 (dy dispatched) */         \
    X(fp8_nt_256_dispatch, E4M3, E4M3, K, K,  M, STORE,     TMA,    COOPERATIVE, 256, DISPATCH)      \
    X(fp8_nt_128_dispatch, E4M3, E4M3, K, K,  M, STORE,     TMA,    COOPERATIVE, 128, DISPATCH)      \
    X(fp8_nt_256_splits,  E4M3, E4M3, K,  K,  M, STORE,     TMA,    COOPERATIVE, 256, SPLITS)        \
    X(fp8_nt_128_splits,  E4M3, E4M3, K,  K,  M, STORE,     TMA,    COOPERATIVE, 128, SPLITS)        \
    X(fp8_nt_256_push,    E4M3, E4M3, K,  K,  M, PUSH,      TMA,    COOPERATIVE, 256, NONE)          \
    X(fp8_nt_128_push,    E4M3, E4M3, K,  K,  M, PUSH,      TMA,    COOPERATIVE, 128, NONE)          \
    X(fp8_nt_pingpong_splits, E4M3, E4M3, K, K, M, STORE,   TMA,    PINGPONG,    256, SPLITS)        \
    X(fp8_nt_pingpong_push, E4M3, E4M3, K, K,   M, PUSH,      TMA,    PINGPONG,    256, NONE)          \
    /* the FP8 weight gradients: A^T B with groups along K, both operands token-major (each   \
     * row of A^T and B^T runs along the tokens) with 1 x 128 scales along them */              \
    X(fp8_wgrad_256,      E4M3, E4M3, K,  K,  K, STORE,     TMA,    COOPERATIVE, 256, NONE)          \
    X(fp8_wgrad_128,      E4M3, E4M3, K,  K,  K, STORE,     TMA,    COOPERATIVE, 128, NONE)          \
    X(fp8_wgrad_256_direct, E4M3, E4M3, K, K, K, STORE,     DIRECT, COOPERATIVE, 256, NONE)          \
    X(fp8_wgrad_128_direct, E4M3, E4M3, K, K, K, STORE,     DIRECT, COOPERATIVE, 128, NONE)          \
    X(fp8_wgrad_256_add,  E4M3, E4M3, K,  K,  K, ADD_FP32,  DIRECT, COOPERATIVE, 256, NONE)          \
    X(fp8_wgrad_128_add,  E4M3, E4M3, K,  K,  K, ADD_FP32,  DIRECT, COOPERATIVE, 128, NONE)

/* The rows' ids, COMETI_GEMM_V_<name>, in table order. */
#define COMETI_GEMM_VARIANT_ID(name, at, bt, am, bm, along, epi, store, sched, bn, roles) COMETI_GEMM_V_##name,
enum { COMETI_GEMM_VARIANTS(COMETI_GEMM_VARIANT_ID) COMETI_GEMM_NUM_VARIANTS };
#undef COMETI_GEMM_VARIANT_ID

/* The rows as data: a constexpr table in C++ (the kernels read it at compile time), a
 * const one in C. */
#ifdef __cplusplus
#define COMETI_GEMM_TABLE_CONST constexpr
#else
#define COMETI_GEMM_TABLE_CONST const
#endif
#define COMETI_GEMM_VARIANT_ROW(name, at, bt, am, bm, along, epi, store, sched, bn, roles)                     \
    {#name, COMETI_GEMM_##at, COMETI_GEMM_##bt, COMETI_GEMM_##am##_MAJOR, COMETI_GEMM_##bm##_MAJOR,             \
     COMETI_GEMM_GROUPS_ALONG_##along, COMETI_GEMM_EPI_##epi, COMETI_GEMM_STORE_##store, COMETI_GEMM_##sched, \
     bn, COMETI_GEMM_ROLE_##roles},
static COMETI_GEMM_TABLE_CONST cometi_gemm_variant_t cometi_gemm_variants[COMETI_GEMM_NUM_VARIANTS] = {
    COMETI_GEMM_VARIANTS(COMETI_GEMM_VARIANT_ROW)};
#undef COMETI_GEMM_VARIANT_ROW

#ifdef __cplusplus
}
#endif

/* ---- what follows from a row: the kernel's shape and its shared memory ---- */

#ifdef __cplusplus
#define COMETI_GEMM_FN constexpr COMETI_HD inline
#else
#define COMETI_GEMM_FN static inline
#endif

/* Rows of an A tile (and of the arrival counters' blocks), k per pipeline stage of bf16
 * (128 bytes of a row: one 128B-swizzled box; E4M3 takes 128 k, one scale block, in the
 * same bytes: cometi_gemm_bk), and the ring's depth at most. The stages a variant gets are
 * the most that fit its shared memory (cometi_gemm_stages), up to this: 4, measured
 * against 3 where a 256-wide tile's staging leaves room for 3 (cometi_gemm_store_boxes);
 * the 128-wide tiles would fit 5 or 6. */
#define COMETI_GEMM_BM COMETI_BLOCK_M
#define COMETI_GEMM_BK 64
/* The rows and columns of a block scale (E4M3): a row operand's 1 x 128, a weight's 128 x 128. */
#define COMETI_GEMM_SCALE_BLOCK 128
#define COMETI_GEMM_MAX_STAGES 4
/* Dynamic shared memory a block may have on sm_90 (227 KB), what the stages are fit into. */
#define COMETI_GEMM_SMEM_LIMIT (227 * 1024)
/* Tickets the producer may announce ahead of the consumers (dynamic schedule). */
#define COMETI_GEMM_TICKETS 4
#define COMETI_GEMM_MAX_GROUPS 1024

COMETI_GEMM_FN int cometi_gemm_element_bytes(int type)
{
    return type == COMETI_GEMM_BF16 ? 2 : type == COMETI_GEMM_E4M3 ? 1 : 0;
}
/* k per stage: a 128-byte row of A's box (64 bf16, or 128 E4M3: one scale block). */
COMETI_GEMM_FN int cometi_gemm_bk(cometi_gemm_variant_t v) { return 128 / cometi_gemm_element_bytes(v.a_type); }
COMETI_GEMM_FN int cometi_gemm_is_swiglu(int epilogue)
{
    return epilogue == COMETI_GEMM_EPI_SWIGLU || epilogue == COMETI_GEMM_EPI_SWIGLU_GU ||
           epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3 || epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU ||
           epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8;
}
/* The epilogues that quantize C (E4M3 values and scales), and those that keep gate and up. */
COMETI_GEMM_FN int cometi_gemm_quantizes(int epilogue)
{
    return epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3 || epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU ||
           epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8;
}
COMETI_GEMM_FN int cometi_gemm_keeps_gu(int epilogue)
{
    return epilogue == COMETI_GEMM_EPI_SWIGLU_GU || epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU ||
           epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8;
}
/* Whether a row's epilogue keeps the push and the split counts: every bf16 row, and the
 * E4M3 rows that push or count. The plain E4M3 rows compile them out (the 256-wide E4M3
 * store spilled 112 bytes with them in, beside the promotion's registers); those that
 * keep them pay one 4-byte local load per k block. */
COMETI_GEMM_FN int cometi_gemm_keeps_push(cometi_gemm_variant_t v)
{
    return v.a_type == COMETI_GEMM_BF16 || v.epilogue == COMETI_GEMM_EPI_PUSH || (v.roles & COMETI_GEMM_ROLE_SPLITS);
}
/* Bytes of an output element: bf16, or E4M3 for the quantizing epilogue (fp32 adds go
 * straight from the registers, never staged). */
COMETI_GEMM_FN int cometi_gemm_out_bytes(cometi_gemm_variant_t v) { return cometi_gemm_quantizes(v.epilogue) ? 1 : 2; }
/* Rows of a tile: 128 shared by both consumers, or 64 for one (ping-pong). */
COMETI_GEMM_FN int cometi_gemm_tile_rows(cometi_gemm_variant_t v) { return v.schedule == COMETI_GEMM_PINGPONG ? 64 : 128; }
/* Output columns of a tile: SwiGLU pairs gate column c with up column c + block_n / 2. */
COMETI_GEMM_FN int cometi_gemm_out_cols(cometi_gemm_variant_t v)
{
    return cometi_gemm_is_swiglu(v.epilogue) ? v.block_n / 2 : v.block_n;
}
/* Along K (the weight gradients) B's scales are one per column of the tile, bf16, and the
 * promotion's thread t reads the columns c with (c % 8) / 2 == t % 4 (its fragment's column
 * pairs, 8 apart): a pair's two scales are one 4-byte word. The words lie as four runs,
 * one per t % 4, each pair's word beside the next pair's the same thread reads, so a thread
 * takes four pairs per 16-byte load (a 128-column half's 16 pairs in four loads: half
 * the bytes of fp32 scales, and each 16-byte load costs four wavefronts whatever it
 * broadcasts). A run is block_n / 8 + 8 words from the next: the four runs a warp's load
 * reads start 8 banks apart (no conflict), and the scale warp's 32 copies of a row's 32
 * pairs fall in 32 banks. Positions and runs count 4-byte words. */
COMETI_GEMM_FN int cometi_gemm_col_scale_run(cometi_gemm_variant_t v) { return v.block_n / 8 + 8; }
COMETI_GEMM_FN int cometi_gemm_col_scale_pos(cometi_gemm_variant_t v, int c)
{
    return (c % 8) / 2 * cometi_gemm_col_scale_run(v) + c / 8;
}
/* E4M3: a stage's scales beside its boxes, in their own slot (kernel.cuh): room for the A
 * tile's 128 rows' scales of the stage's k block (ping-pong fills 64), then B's: with
 * groups along M a block per 128 rows of B (gate and up, or the two 128-row blocks of a
 * 256-wide tile), padded to 16 bytes; along K one bf16 per row of B (the weight
 * gradients: both operands scaled 1 x 128 along the tokens), in four runs of words
 * (cometi_gemm_col_scale_pos). Loaded by a warp of the producer, so the consumers read
 * them from shared memory, not at L2's latency in their mainloop. */
COMETI_GEMM_FN int cometi_gemm_scale_slot_floats(cometi_gemm_variant_t v)
{
    return v.a_type != COMETI_GEMM_E4M3             ? 0
           : v.along == COMETI_GEMM_GROUPS_ALONG_K ? COMETI_GEMM_BM + 4 * cometi_gemm_col_scale_run(v)
                                                   : COMETI_GEMM_BM + 4;
}
COMETI_GEMM_FN int cometi_gemm_scale_slot_bytes(cometi_gemm_variant_t v) { return cometi_gemm_scale_slot_floats(v) * 4; }
/* One stage of the ring: A's and B's boxes of one k-step. */
COMETI_GEMM_FN int cometi_gemm_stage_bytes(cometi_gemm_variant_t v)
{
    return (cometi_gemm_tile_rows(v) * cometi_gemm_element_bytes(v.a_type) +
            v.block_n * cometi_gemm_element_bytes(v.b_type)) * cometi_gemm_bk(v);
}
/* Everything but the stages' boxes: the 1 KB alignment of the stages, the mbarriers (full
 * and empty per stage, the two ping-pong turns, the ticket ring's), the group table
 * (first_tile), the tickets and the last wave's plan (kernel.cuh lays them out). */
COMETI_GEMM_FN int cometi_gemm_fixed_bytes(int stages)
{
    return 1024 + (2 * stages + 2 + 2 * COMETI_GEMM_TICKETS) * 8 + (2 * COMETI_GEMM_MAX_GROUPS + 1) * 4 +
           COMETI_GEMM_TICKETS * 4 + 3 * 4;
}
/* Whether `stages` stages fit beside `staging` bytes of the epilogue's staging. */
COMETI_GEMM_FN int cometi_gemm_ring_fits(cometi_gemm_variant_t v, int stages, int staging)
{
    return cometi_gemm_fixed_bytes(stages) + staging +
               stages * (cometi_gemm_stage_bytes(v) + cometi_gemm_scale_slot_bytes(v)) <=
           COMETI_GEMM_SMEM_LIMIT;
}
/* 128 rows of `boxes` boxes of 64 output columns: the staging a round of them takes. */
COMETI_GEMM_FN int cometi_gemm_boxes_bytes(cometi_gemm_variant_t v, int boxes)
{
    return COMETI_GEMM_BM * 64 * boxes * cometi_gemm_out_bytes(v);
}
/* The bf16 TMA store's boxes of 64 rows x 64 columns (8 KB) a consumer warpgroup stages at
 * a time: all its out_cols / 64 at once, except in E4M3's 256-wide tiles with groups along
 * M, where their 64 KB would cost the ring its last stage: there one box a round, 16 KB in
 * all. Their long k gains from the fourth stage (mixtral-8x7b's GEMM1 +2% on H100) what
 * three rounds' waits for the store to read its box cost a short one (qwen2-moe-2.7b's
 * data gradients 1%); the weight gradients' k, each expert's rows, lost 10% there, and
 * bf16's cooperative 256-wide tiles gained nothing (its ping-pong ones gained 35% but
 * stayed behind them). (The quantizing epilogue stages E4M3 bytes, a tile's 16 KB at
 * once.) */
COMETI_GEMM_FN int cometi_gemm_store_boxes(cometi_gemm_variant_t v)
{
    const int all = cometi_gemm_out_cols(v) / 64;
    return v.a_type != COMETI_GEMM_E4M3 || v.along != COMETI_GEMM_GROUPS_ALONG_M || cometi_gemm_quantizes(v.epilogue) ||
                   cometi_gemm_ring_fits(v, COMETI_GEMM_MAX_STAGES, cometi_gemm_boxes_bytes(v, all))
               ? all
               : 1;
}
/* The TMA store's staging: 128 rows of a round's boxes (all the tile's output columns but
 * where cometi_gemm_store_boxes takes one at a time). */
COMETI_GEMM_FN int cometi_gemm_staging_bytes(cometi_gemm_variant_t v)
{
    return v.store != COMETI_GEMM_STORE_TMA ? 0 : cometi_gemm_boxes_bytes(v, cometi_gemm_store_boxes(v));
}
/* The ring's depth: the most stages that fit beside the staging, at most MAX_STAGES. */
COMETI_GEMM_FN int cometi_gemm_stages(cometi_gemm_variant_t v)
{
    int stages = COMETI_GEMM_MAX_STAGES;
    while (stages > 1 && !cometi_gemm_ring_fits(v, stages, cometi_gemm_staging_bytes(v))) stages--;
    return stages;
}
/* The file a row's kernel is compiled in (gemm_forward.cu, gemm_dgrad.cu, gemm_wgrad.cu,
 * gemm_fp8.cu): its format, then its layout. */
enum {
    COMETI_GEMM_FAMILY_FORWARD = 0,
    COMETI_GEMM_FAMILY_DGRAD = 1,
    COMETI_GEMM_FAMILY_WGRAD = 2,
    COMETI_GEMM_FAMILY_FP8 = 3
};
COMETI_GEMM_FN int cometi_gemm_family(cometi_gemm_variant_t v)
{
    return v.a_type == COMETI_GEMM_E4M3            ? COMETI_GEMM_FAMILY_FP8
           : v.along == COMETI_GEMM_GROUPS_ALONG_K ? COMETI_GEMM_FAMILY_WGRAD
           : v.b_major == COMETI_GEMM_MN_MAJOR     ? COMETI_GEMM_FAMILY_DGRAD
                                                   : COMETI_GEMM_FAMILY_FORWARD;
}
/* The dynamic shared memory a block of the variant asks for. */
COMETI_GEMM_FN int cometi_gemm_smem_bytes(cometi_gemm_variant_t v)
{
    const int stages = cometi_gemm_stages(v);
    return cometi_gemm_fixed_bytes(stages) + cometi_gemm_staging_bytes(v) +
           stages * (cometi_gemm_stage_bytes(v) + cometi_gemm_scale_slot_bytes(v));
}

#endif /* COMET_GEMM_VARIANTS_H */
