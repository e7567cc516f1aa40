/*
 * gemm.h - comet's grouped GEMM for Hopper: C[rows][n] = A[rows][k] * B_g[n][k]^T per
 * group g (an expert), bf16 in, fp32 accumulate, bf16 out. A is expert-major: group g's
 * rows are A rows [start_g, start_g + rows_g), read from device memory by the kernel so
 * no host sync is needed; B holds the groups one after another, [groups][n][k], in
 * nn.Linear's [out][in] layout.
 *
 * A GEMM is described by its core (the operands, the launch shape, the epilogue's
 * arithmetic) and optional roles that make it one of COMET's two fused patterns:
 *   dispatch  dispatch -> GEMM: blocks beside the GEMM copy rows into A over NVLink and
 *             count their arrival per 128-row block; a tile starts once its rows are in;
 *   splits    GEMM -> combine: tiles go column split by column split, each split's rows
 *             counted, and combine blocks send each finished split home;
 *   push      GEMM -> combine: the epilogue sends each finished tile's rows home.
 * cometi_gemm_prepare checks the core and each role, builds the tensor maps and the
 * kernel's arguments on the host (gemm/prepare.c); cometi_gemm_launch enqueues them
 * (gemm.cu: the kernel reads as scheduler, mainloop, epilogue).
 */
#ifndef COMET_GEMM_H
#define COMET_GEMM_H

#include "base/host.h"
#include "gemm/args.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    COMETI_EPILOGUE_AUTO = 0,   /* TMA where ldc and c allow it */
    COMETI_EPILOGUE_DIRECT = 1, /* registers straight to global memory, 4 bytes at a time */
    COMETI_EPILOGUE_TMA = 2     /* registers to swizzled shared memory, then an async TMA store
                                 * (full 128-row tiles; a group's last partial tile goes direct) */
};

enum {
    COMETI_SCHEDULE_AUTO = 0,        /* cooperative */
    COMETI_SCHEDULE_COOPERATIVE = 1, /* both consumer warpgroups on one 128-row tile */
    COMETI_SCHEDULE_PINGPONG = 2     /* each on its own 64-row tile, alternating (block_n 256) */
};

/* Role: dispatch -> GEMM (layer0). `blocks` blocks before the GEMM's copy this rank's
 * rows (`rows`) into every receiver's A; a tile reads its A rows only once
 * arrive[b] >= expected[b] for its 128-row block b (acquire, system scope). Needs the
 * shared tile counter (sched): dispatch blocks take tiles once done. */
typedef struct cometi_gemm_dispatch {
    int blocks;                         /* >= 1 */
    const unsigned long long *arrive;   /* [a_rows / 128] arrival counters of this rank's A */
    const unsigned long long *expected; /* [a_rows / 128] their running totals once complete */
    cometi_dispatch_t rows;             /* what the dispatch blocks copy (dispatch.h) */
} cometi_gemm_dispatch_t;

/* Role: column splits (layer1's order: every row of split s before any of split s + 1),
 * and split_done[s] grows by the rows finished in it: after one call, by rows x (column
 * tiles per split), released at GPU scope once the rows are in C. Never reset: readers
 * wait for running totals. With combine_blocks > 0 those blocks, before the GEMM's, run
 * `combine` (combine.cuh) and never compute. */
typedef struct cometi_gemm_splits {
    int n_splits;                   /* >= 1; must divide n / tile width */
    unsigned long long *split_done; /* [n_splits] */
    int combine_blocks;             /* 0: none (a tail kernel combines after, or nobody) */
    cometi_combine_t combine;       /* with combine_blocks; tp 1 */
} cometi_gemm_splits_t;

/* Role: the push epilogue (layer1). No C: each finished tile's rows go straight to their
 * token owners, row r of A to combine.peers[dest[r].x].slots at row dest[r].y (a choice
 * (t, j) of rank s's tokens: its index in s's send order, times tp plus this rank's TP
 * rank; x < 0: padding, not sent), over NVLink for other ranks, and
 * combine.peers[s].arrive[COMETI_PUSH_COUNTER] grows by the rows once they have landed
 * (system-scope release, at each block's end): by rows x column tiles per call.
 * cometi_launch_push_dest fills `dest`; cometi_launch_push_sum sums. A warpgroup's 64 rows
 * that all go to one owner's consecutive slots (one (source, expert) chunk: most of them)
 * leave as tensor stores through `maps`; other parts are stored by every thread straight
 * from its accumulator fragments (4-byte stores), keeping small copies off the SM's TMA
 * unit. Needs the TMA epilogue, no SwiGLU, row index or other role. */
typedef struct cometi_gemm_push {
    const void *dest;         /* [a_rows] int2 (owner, slot row) */
    const void *maps;         /* cometi_gemm_push_maps_create's maps, 64-byte aligned */
    cometi_combine_t combine; /* peers, rank, world, tp, experts: where rows go */
} cometi_gemm_push_t;

typedef struct cometi_gemm {
    /* The grouped GEMM. */
    const void *a;                 /* [a_rows][k] bf16 */
    int64_t a_rows;                /* rows allocated in A (TMA reads past a group's rows stay inside) */
    const void *b;                 /* [groups][n][k] bf16; with swiglu, [groups][2n][k] (gate rows,
                                    * then up rows), or the gate rows [groups][n][k] when b_up is set */
    const void *b_up;              /* swiglu only: up rows [groups][n][k] in a tensor of their own */
    int b_mn_major;                /* B is [groups][k][n] (n contiguous), as a dgrad GEMM reads a weight
                                    * kept [in][out]: C = A B_g. Not with swiglu; the cooperative
                                    * schedule */
    int wgrad;                     /* a weight gradient, groups along K: C_g [m_out][n] = A_g^T B_g, with
                                    * A_g and B_g group g's rows of A [a_rows][m_out] and B [a_rows][n]
                                    * (both MN-major: K runs down their rows); C is [groups][m_out][n]
                                    * (ldc = n). The rows of a segment are summed up to the next 64, so
                                    * padding rows there must be zero in A and B (finite in both). A
                                    * group with no rows writes zeros. k is unused; no roles, SwiGLU,
                                    * scale, row index or last-wave cut; the cooperative schedule */
    int m_out;                     /* wgrad: C's rows per group, a multiple of 64 (the last row tile
                                    * may be partial) */
    void *c;                       /* [a_rows][ldc] bf16; only the groups' rows are written */
    int ldc;                       /* elements, even */
    const cometi_segment_t *segs;  /* [groups], device memory */
    int groups, n, k;              /* n a multiple of 64: a last column tile past n computes columns
                                    * from zeros or other rows and stores none of them (column
                                    * splits need whole tiles); k a multiple of 64 */
    const int32_t *local_rows;     /* [groups] rows at the head of each group that are local: tiles
                                    * made only of them go first (COMET's rescheduling), or NULL */
    /* The launch. */
    int sms;                       /* persistent GEMM blocks, one per SM; 0: every SM the roles leave */
    int block_n;                   /* 128 or 256; 0: 256 where n allows */
    int group_m;                   /* row tiles per band of the tile order (L2 reuse); 0: 8 */
    int schedule;                  /* COMETI_SCHEDULE_*: how the consumer warpgroups share tiles */
    unsigned int *sched;           /* [COMETI_GEMM_SCHED_WORDS] zeroed device words: tiles then come
                                    * from a counter shared by the grid (dispatch blocks join in when
                                    * done; they need it) and the last block zeroes them again; NULL:
                                    * each GEMM block takes every gemm_blocks-th tile */
    void *tail_ws;                 /* COMETI_GEMM_TAIL_BYTES(SMs), counters zeroed once, or NULL:
                                    * with it, a last wave that would leave blocks idle may be cut
                                    * along k into up to 4 parts per tile (cooperative schedule, grid
                                    * within the SMs; gemm/schedule.h). The same bits every run, but
                                    * which tiles are cut, so their fp32 sums' order, depends on the
                                    * blocks that take tiles and on the tile order (splits). After a
                                    * reported pipeline error the counters must be zeroed again. */
    /* The epilogue. */
    int epilogue;                  /* COMETI_EPILOGUE_*: how C tiles are stored */
    int swiglu;                    /* C = silu(A Bgate^T) * (A Bup^T), n = F columns (128-wide tiles) */
    const float *row_scale;        /* C row r scaled by row_scale[r] (A row numbering), or NULL */
    void *gu;                      /* swiglu, training: each row's gate and up projections kept too,
                                    * bf16 [gu_rows][2n] (gate columns, then up): full tiles' by TMA
                                    * stores where C leaves that way and gu is 16-byte aligned, the
                                    * rest straight from registers; rows at or past gu_rows are not
                                    * kept. Not with column splits. NULL: not kept */
    int64_t gu_rows;
    int c_fp32_add;                /* wgrad: C is fp32 and the tile is added to it (gradient
                                    * accumulation); the direct epilogue. A group without rows adds 0 */
    const int32_t *row_index;      /* A row r stored to C row row_index[r] (< 0: dropped), or NULL;
                                    * rows then go straight from registers */
    /* Failures. */
    cometi_async_error_t *err;     /* where a stuck pipeline reports (host-mapped) */
    unsigned long long timeout_ns; /* rows from peers must arrive within this; a pipeline wait
                                    * twice as long is a bug: report, leave (0: 10 s) */
    /* Roles, each NULL when off. */
    const cometi_gemm_dispatch_t *dispatch;
    const cometi_gemm_splits_t *splits;
    const cometi_gemm_push_t *push;
    unsigned long long *tile_trace; /* [blocks][COMETI_TILE_TRACE_WORDS] the call's tile timeline
                                     * (cooperative schedule; combine blocks leave their rows
                                     * alone), or NULL */
} cometi_gemm_t;

/* Column tile width of a plain GEMM (no SwiGLU) with n columns when block_n is 0: 256
 * unless its last tile wastes more than 1/8 of the columns 128-wide tiles compute (n up
 * to 896 off the 256 grid). 256-wide tiles ran 16% faster on H200 at n = 1408 and 2880
 * (partial last tiles) than 128-wide ones. Layer1's split counts and the cost model use
 * it too. */
static inline int cometi_gemm_tile_n(int n)
{
    const int cols256 = (n + 255) / 256 * 256, cols128 = (n + 127) / 128 * 128;
    return 8 * cols256 <= 9 * cols128 ? 256 : 128;
}

/* A checked GEMM with its tensor maps built, ready to launch (opaque; gemm/args.h). */
#ifdef __cplusplus
#define COMETI_ALIGN128 alignas(128)
#else
#define COMETI_ALIGN128 _Alignas(128)
#endif
typedef struct cometi_gemm_prepared {
    COMETI_ALIGN128 unsigned char bytes[4096]; /* tensor maps need 128-byte alignment */
} cometi_gemm_prepared_t;

/* The push's tensor maps, one per owner rank p: its slots as mapped here (peer_slots[p]),
 * seen as `slot_rows` rows of `hidden` bf16 that hold this rank's partials, t_rank's
 * column of every tp (rows tp x hidden apart). Device memory in *maps (cudaFree it);
 * collective nowhere, encoded on the host and copied once. */
comet_status_t cometi_gemm_push_maps_create(char *err, void *const *peer_slots, int world, int tp, int t_rank,
                                            int64_t slot_rows, int hidden, void **maps);

/* Check every field and build the tensor maps; nothing is enqueued. Errors name the
 * field and the limit. Lets a caller fail before it starts work other ranks depend on. */
comet_status_t cometi_gemm_prepare(char *err, const cometi_gemm_t *g, cometi_gemm_prepared_t *out);
/* Enqueue a prepared GEMM on `stream`. */
comet_status_t cometi_gemm_launch(char *err, const cometi_gemm_prepared_t *p, cudaStream_t stream);
/* Prepare and launch. */
comet_status_t cometi_gemm_run(char *err, const cometi_gemm_t *g, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_GEMM_H */
