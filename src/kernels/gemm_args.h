/*
 * gemm_args.h - what cometi_gemm_prepare (gemm_prepare.c, host C) hands the kernel
 * (gemm.cu): the kernel's flat arguments, its tensor maps and the launch's shape, laid out
 * inside cometi_gemm_prepared_t. The roles of gemm.h become plain fields here: the kernel
 * reads them from its parameter space, one value each, whatever roles are on.
 */
#ifndef COMET_GEMM_ARGS_H
#define COMET_GEMM_ARGS_H

#include <cuda.h>

#include "gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of an A tile (and of the arrival counters' blocks), and k per pipeline stage. */
#define COMETI_GEMM_BM COMETI_BLOCK_M
#define COMETI_GEMM_BK 64

typedef struct cometi_gemm_args {
    const cometi_segment_t *segs;
    int groups, n, k, ldc, group_m;
    int m_out;                        /* wgrad: C's rows per group (0: not a weight gradient) */
    int b_group_rows;                 /* B rows per group (without SwiGLU) */
    const float *row_scale;
    const int32_t *row_index;
    const int32_t *local_rows;
    const unsigned long long *arrive, *expected; /* dispatch role: arrival waits, or NULL */
    int gemm_blocks;
    unsigned int *sched;                 /* tiles taken, blocks done, pieces taken; NULL: static */
    int n_splits;                        /* column splits, tiles split-major (1: one split) */
    const void *push_dest;               /* int2 per row: to their owners' slots (push role), or NULL */
    const CUtensorMap *push_maps;        /* [world] each owner's slots, in global memory */
    unsigned long long *split_done;      /* [n_splits] rows finished per split, or NULL */
    cometi_dispatch_t dispatch;          /* dispatch role: what its blocks copy */
    int combine_blocks;                  /* the first blocks combine instead (they never compute) */
    cometi_combine_t combine;            /* splits role with combine blocks, or the push role */
    void *c;                             /* bf16; fp32 with c_fp32_add */
    int c_fp32_add;                      /* wgrad: C += the tile, fp32 */
    void *gu;                            /* swiglu: gate and up kept, [gu_rows][2n] bf16, or NULL */
    int gu_tma;                          /* full tiles' gate and up leave by TMA stores (map gu) */
    long long gu_rows;
    cometi_async_error_t *err;
    unsigned long long timeout_ns;         /* pipeline waits */
    unsigned long long arrival_timeout_ns; /* waits for rows from peers (shorter: a missing
                                            * peer is reported as such, not as a stuck pipeline) */
    unsigned long long *tile_trace;        /* see gemm.h, or NULL */
    unsigned long long *tail_ws;           /* see gemm.h, or NULL */
} cometi_gemm_args_t;

typedef struct cometi_gemm_maps {
    CUtensorMap a, b, up, c, gu; /* gu: [gu_rows][2][n], the kept gate and up halves */
} cometi_gemm_maps_t;

/* What cometi_gemm_prepared_t holds. */
typedef struct cometi_gemm_plan {
    cometi_gemm_maps_t maps;
    cometi_gemm_args_t args;
    int blocks, block_n, swiglu, pingpong, tma_epilogue, b_mn_major, wgrad;
} cometi_gemm_plan_t;

#ifdef __cplusplus
}
#endif

#endif /* COMET_GEMM_ARGS_H */
