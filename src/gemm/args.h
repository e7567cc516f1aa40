/*
 * args.h - what cometi_gemm_prepare (prepare.c, host C) hands the kernel
 * (kernel.cuh): the kernel's flat arguments, its tensor maps and the launch's shape, laid out
 * inside cometi_gemm_prepared_t. The roles of gemm.h become plain fields here: the kernel
 * reads them from its parameter space, one value each, whatever roles are on.
 */
#ifndef COMET_GEMM_ARGS_H
#define COMET_GEMM_ARGS_H

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "base/types.h"
#include "comm/combine.h"
#include "comm/dispatch.h"
#include "gemm/variants.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shared counters of the dynamic schedule: tiles taken, blocks done, dispatch pieces taken,
 * combine blocks past their setup, combine blocks done. */
#define COMETI_GEMM_SCHED_WORDS 5
/* The last wave's cut (tail_ws): a count per cut tile (at most one per block), then fp32
 * partials, 128 x 256 per part other than the last (at most two per block). */
#define COMETI_GEMM_TAIL_COUNTERS 1024
#define COMETI_GEMM_TAIL_SLOTS(sms) (2 * (size_t)(sms))
#define COMETI_GEMM_TAIL_BYTES(sms) (COMETI_GEMM_TAIL_COUNTERS * 8 + COMETI_GEMM_TAIL_SLOTS(sms) * 128 * 256 * 4)
/* Tile timeline of a GEMM block (`tile_trace`), global-timer ns: [0] the block's start,
 * [1] its dispatch done (dispatch blocks; GEMM blocks: their share of the head copied, see
 * head_pieces; else 0), [2] tiles it took, [3] its end; then for each of its first
 * COMETI_TILE_TRACE_TILES tiles: the tile's index, when the producer took it, when its rows
 * were ready (the arrival wait passed; the take time when there is none), and when the
 * consumers had issued its epilogue. The harness's timeline.h reads it. */
#define COMETI_TILE_TRACE_TILES 240
#define COMETI_TILE_TRACE_WORDS (4 + 4 * COMETI_TILE_TRACE_TILES)

typedef struct cometi_gemm_args {
    const cometi_segment_t *segs;
    int groups, n, k, ldc, group_m;
    int m_out;                        /* wgrad: C's rows per group (0: not a weight gradient) */
    int b_group_rows;                 /* B rows per group (without SwiGLU) */
    const float *row_scale;
    const int32_t *row_index;
    const int32_t *local_rows;
    const unsigned long long *arrive, *expected; /* dispatch role: arrival waits, or NULL */
    /* E4M3 (gemm.h): A's scales (row r, k block b) at a_scale[r * a_scale_row + b *
     * a_scale_block] (rows past a_rows read none), B's [groups][b_scale_group / b_scale_kb]
     * [b_scale_kb] (up's at b_up_scale, the same strides; n blocks past b_scale_blocks read
     * none), and C's (SWIGLU_E4M3) at c_scale[r * c_scale_row + b * c_scale_block]. Along
     * K, A's row m and B's row n of token block b at a_scale[m * a_scale_row + b *
     * a_scale_block] and b_scale16[n + b * b_scale_block] (bf16: rows n and n + 1, n even,
     * one word). */
    const float *a_scale, *b_scale, *b_up_scale;
    const uint16_t *b_scale16;
    long long a_scale_row, a_scale_block, a_rows, b_scale_row, b_scale_block;
    int a_kb_strided;                    /* E4M3 along M: map a is [rows][k / 128][128 bytes] (gemm.h's
                                          * a.kb_stride), loaded a k block at a time */
    int b_scale_group, b_scale_kb, b_scale_blocks;
    float *c_scale;
    long long c_scale_row, c_scale_block;
    int pow2_scales;
    int gemm_blocks;
    unsigned int *sched;                 /* tiles taken, blocks done, pieces taken; NULL: static */
    int n_splits;                        /* column splits, tiles split-major (1: one split) */
    const void *push_dest;               /* int2 per row: to their owners' slots (push role), or NULL */
    const CUtensorMap *push_maps;        /* [world] each owner's slots, in global memory */
    unsigned long long *split_done;      /* [n_splits] rows finished per split, or NULL */
    cometi_dispatch_t dispatch;          /* dispatch role: what its blocks copy */
    int combine_blocks;                  /* the first blocks combine instead (they never compute) */
    cometi_combine_t combine;            /* splits role with combine blocks, or the push role */
    void *c;                             /* bf16; fp32 with the ADD_FP32 epilogue; E4M3 bytes with
                                          * SWIGLU_E4M3 (ldc in bytes then) */
    int c_fp32_add;                      /* the ADD_FP32 epilogue: C += the tile, fp32 */
    void *gu;                            /* swiglu: gate and up kept, [gu_rows][2n] bf16 (GU8: E4M3),
                                          * or NULL */
    int gu_tma;                          /* full tiles' gate and up leave by TMA stores (map gu) */
    long long gu_rows;
    float *gu_scale;                     /* GU8: [2n / 128][gu_rows] */
    cometi_async_error_t *err;
    unsigned long long timeout_ns;         /* pipeline waits */
    unsigned long long arrival_timeout_ns; /* waits for rows from peers (shorter: a missing
                                            * peer is reported as such, not as a stuck pipeline) */
    unsigned long long *tile_trace;        /* see gemm.h, or NULL */
    unsigned long long *tail_ws;           /* see gemm.h, or NULL */
} cometi_gemm_args_t;

typedef struct cometi_gemm_maps {
    CUtensorMap a, b, up, c, gu; /* gu: [gu_rows][2][n], the kept gate and up halves (GU8: [gu_rows][2n] bytes) */
} cometi_gemm_maps_t;

/* What cometi_gemm_prepared_t holds. */
typedef struct cometi_gemm_plan {
    cometi_gemm_maps_t maps;
    cometi_gemm_args_t args;
    int variant; /* its row of variants.h's table */
    int blocks;
} cometi_gemm_plan_t;

/* Launch a prepared GEMM's kernel, by the family of its row (gemm_forward.cu,
 * gemm_dgrad.cu, gemm_wgrad.cu, gemm_fp8.cu): cudaErrorInvalidValue for a row of another family. The
 * C side (prepare.c) picks the family and turns the error into a status. */
cudaError_t cometi_gemm_launch_forward(const cometi_gemm_plan_t *plan, cudaStream_t stream);
cudaError_t cometi_gemm_launch_dgrad(const cometi_gemm_plan_t *plan, cudaStream_t stream);
cudaError_t cometi_gemm_launch_wgrad(const cometi_gemm_plan_t *plan, cudaStream_t stream);
cudaError_t cometi_gemm_launch_fp8(const cometi_gemm_plan_t *plan, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_GEMM_ARGS_H */
