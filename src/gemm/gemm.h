/*
 * gemm.h - comet's grouped GEMM for Hopper, as the host describes one call. Per group g
 * (an expert), C_g = A_g B_g^T with groups along A's rows (the forward: A [rows][k] holds
 * the groups' segments one after another, B [groups][n][k] in nn.Linear's [out][in]
 * layout), C_g = A_g B_g (a dgrad GEMM: B [groups][k][n], MN-major), or C_g = A_g^T B_g with
 * groups along K (a weight gradient: A [rows][m_out] and B [rows][n], group g's k its
 * segment's rows, C [groups][m_out][n]; E4M3: A^T [m_out][rows] and B^T [n][rows], the
 * tokens contiguous). Operands bf16, or E4M3 with block scales (1 x 128 along k for A, and
 * for B along K; 128 x 128 for B along M), fp32 accumulation. The groups' rows are read by the kernel from device
 * memory, so no host sync is needed.
 *
 * A description (cometi_gemm_t) has the problem, each operand with its layout, the output
 * with its epilogue, the launch, and the roles that make it one of COMET's two patterns:
 *   dispatch  dispatch -> GEMM: blocks beside the GEMM copy rows into A over NVLink and
 *             count their arrival per 128-row block; a tile starts once its rows are in;
 *   splits    GEMM -> combine: tiles go column split by column split, each split's rows
 *             counted, and combine blocks send each finished split home;
 * (the push, GEMM -> combine from the epilogue, is an epilogue: out.push).
 * cometi_gemm_prepare resolves it to the one row of variants.h's table with exactly its
 * choices (or refuses it, naming them), checks the shapes and each role, builds the tensor
 * maps and the kernel's arguments (prepare.c); cometi_gemm_launch enqueues that row's
 * kernel (kernel.cuh: scheduler, mainloop, epilogue).
 */
#ifndef COMET_GEMM_H
#define COMET_GEMM_H

#include "base/host.h"
#include "gemm/args.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A description's "choose" for out.store (variants.h's COMETI_GEMM_STORE_*: the TMA store
 * where C's alignment allows it and a row has it, else the direct one) and for
 * launch.schedule (cooperative). */
#define COMETI_GEMM_STORE_AUTO 0
#define COMETI_GEMM_SCHEDULE_AUTO 0

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

/* The push (GEMM -> combine from the epilogue, layer1): no C; each finished tile's rows go
 * straight to their token owners, row r of A to combine.peers[dest[r].x].slots at row
 * dest[r].y (a choice (t, j) of rank s's tokens: its index in s's send order, times tp plus
 * this rank's TP rank; x < 0: padding, not sent), over NVLink for other ranks, and
 * combine.peers[s].arrive[COMETI_PUSH_COUNTER] grows by the rows once they have landed
 * (system-scope release, at each block's end): by rows x column tiles per call.
 * cometi_launch_push_dest fills `dest`; cometi_launch_push_sum sums. A warpgroup's 64 rows
 * that all go to one owner's consecutive slots (one (source, expert) chunk: most of them)
 * leave as tensor stores through `maps`; other parts are stored by every thread straight
 * from its accumulator fragments (4-byte stores), keeping small copies off the SM's TMA
 * unit. The TMA store; no row index or other role. */
typedef struct cometi_gemm_push {
    const void *dest;         /* [a rows] int2 (owner, slot row) */
    const void *maps;         /* cometi_gemm_push_maps_create's maps, 64-byte aligned */
    cometi_combine_t combine; /* peers, rank, world, tp, experts: where rows go */
} cometi_gemm_push_t;

/* One call of the grouped GEMM. Zero-initialised fields are the forward's plain GEMM:
 * groups along M, both operands K-major bf16, C stored as it is, the store and schedule
 * chosen, every SM. */
typedef struct cometi_gemm {
    /* The problem. */
    struct {
        int along;                    /* COMETI_GEMM_GROUPS_ALONG_M or _K (variants.h) */
        int groups;                   /* 1..COMETI_GEMM_MAX_GROUPS */
        int n;                        /* C's columns, a multiple of 64: a last column tile past n
                                       * computes columns from zeros or other rows and stores none
                                       * of them (column splits need whole tiles) */
        int k;                        /* along M: a multiple of 64 (E4M3: of 16, the last 128-wide
                                       * block partial); along K: unused (each group's
                                       * rows are its k, summed up to the next 64, so padding rows
                                       * of A and B must be zero) */
        int m_out;                    /* along K: C's rows per group, a multiple of 64 (the last
                                       * row tile may be partial) */
        const cometi_segment_t *segs; /* [groups], device memory: each group's rows of A (and, along
                                       * M, of C) */
        const int32_t *local_rows;    /* [groups] rows at the head of each group that are local:
                                       * tiles made only of them go first (COMET's rescheduling),
                                       * or NULL */
    } problem;
    /* A: along M [rows][k]; along K [rows][m_out] (bf16, MN-major) or [m_out][ld] (E4M3,
     * K-major: row m of A^T holds the `rows` tokens' values). */
    struct {
        const void *ptr;
        int64_t rows;                 /* rows allocated (TMA reads past a group's rows stay inside);
                                       * along K, E4M3: the tokens, a multiple of 16 */
        int type;                     /* COMETI_GEMM_BF16 or COMETI_GEMM_E4M3 */
        int major;                    /* COMETI_GEMM_K_MAJOR, or along K: MN_MAJOR (bf16) or
                                       * K_MAJOR (E4M3) */
        int64_t ld;                   /* along M: elements from a row to the next (0: k); along K,
                                       * E4M3: of A^T and B^T (0: rows); rows of 16-byte multiples */
        const float *scale;           /* E4M3: row r's scale of k block b (128 wide, the last partial
                                       * where k is) at scale[r * scale_row + b * scale_block]: MN-major
                                       * (scale_row 1: a tile's rows contiguous) or K-major (a row's
                                       * scales after its values, as the dispatch sends them). Along
                                       * K, row m of A^T, and b is the token block (row / 128): each
                                       * segment starts at a multiple of 128 (else the kernel reports
                                       * COMETI_SITE_WGRAD_SEGMENT) and its padding to the next 128 is
                                       * zero in A^T and B^T */
        int64_t scale_row, scale_block;
        int64_t kb_stride;            /* E4M3 along M, no dispatch role: bytes from one 128-wide k
                                       * block of a row to the next (0: 128, the row contiguous); a
                                       * multiple of 16, with k a multiple of 128 and ld at least
                                       * k / 128 x kb_stride: rows whose k blocks lie
                                       * apart, as SwiGLU's FP8 backward leaves dh in [g u]'s bytes */
    } a;
    /* B: K-major [groups][n][k] (SwiGLU: [groups][2n][k], gate rows then up rows, or the gate
     * rows alone with `up` beside them); MN-major [groups][k][n] along M, [rows][n] along K. */
    struct {
        const void *ptr;
        const void *up;               /* SwiGLU: the up rows [groups][n][k] in a tensor of their own,
                                       * or NULL */
        int type;                     /* COMETI_GEMM_BF16 or COMETI_GEMM_E4M3 */
        int major;                    /* COMETI_GEMM_K_MAJOR or COMETI_GEMM_MN_MAJOR */
        const float *scale;           /* E4M3 along M: one per 128 x 128 block of each group's rows,
                                       * [groups][ceil(rows / 128)][ceil(k / 128)] (HF checkpoints'
                                       * weight_scale_inv); gate and up in one tensor need n a
                                       * multiple of 128 (a block never holds both) */
        const float *up_scale;        /* E4M3 with `up`: the up rows' own, [groups][ceil(n / 128)][..] */
        int64_t scale_row, scale_block; /* E4M3 along K: row n's scale of token block b (1 x 128) at
                                       * scale16[n * scale_row + b * scale_block]; else 0 */
        const uint16_t *scale16;      /* E4M3 along K, in place of `scale` (NULL there): the scales
                                       * as bf16, so exact in 16 bits (COMETI_FP8_SCALE_BF16 or
                                       * powers of two; cometi_launch_scales_bf16 makes them from
                                       * fp32), scale_row 1 and scale_block even (a row pair's two
                                       * scales one 4-byte word) */
    } b;
    /* The output. */
    struct {
        int epilogue;                 /* COMETI_GEMM_EPI_* (variants.h) */
        int store;                    /* COMETI_GEMM_STORE_AUTO, _TMA or _DIRECT */
        void *c;                      /* along M [a rows][ldc] bf16, only the groups' rows written;
                                       * along K [groups][m_out][n] (ldc = n), fp32 with ADD_FP32 (the
                                       * tile added to it; a group without rows adds 0, or writes
                                       * zeros in bf16); unused by the push */
        int ldc;                      /* elements, even */
        const float *row_scale;       /* STORE, SWIGLU: C row r scaled by row_scale[r] (A's
                                       * numbering), or NULL */
        const int32_t *row_index;     /* STORE, SWIGLU: A row r stored to C row row_index[r] (< 0:
                                       * dropped), or NULL; rows then go straight from registers */
        void *gu;                     /* SWIGLU_GU: each row's gate and up projections kept, bf16
                                       * [gu_rows][2n] (gate columns, then up): full tiles' by TMA
                                       * stores where C leaves that way and gu is 16-byte aligned,
                                       * the rest straight from registers; rows at or past gu_rows
                                       * are not kept; SWIGLU_E4M3_GU8: E4M3 bytes [gu_rows][2n]
                                       * (n a multiple of 128), 16-byte aligned */
        int64_t gu_rows;
        float *gu_scale;              /* SWIGLU_E4M3_GU8: block b's scale of kept row r at
                                       * gu_scale[b x gu_rows + r], b < 2n / 128 (gate's blocks,
                                       * then up's); NULL for the others */
        const struct cometi_gemm_push *push; /* PUSH: where the rows go */
        float *c_scale;               /* SWIGLU_E4M3: C holds E4M3 bytes (ldc bytes a row) and row r's
                                       * scale of column block b (128 wide) goes to c_scale[r *
                                       * c_scale_row + b * c_scale_block]: the next GEMM's A.scale */
        int64_t c_scale_row, c_scale_block;
        int pow2_scales;              /* SWIGLU_E4M3: 1: each scale the power of two at or above
                                       * amax / 448, 0: amax / 448 (base/fp8.h) */
    } out;
    /* The launch. */
    struct {
        int sms;                      /* persistent GEMM blocks, one per SM; 0: every SM the roles
                                       * leave */
        int block_n;                  /* 128 or 256; 0: the row's width nearest cometi_gemm_tile_n */
        int group_m;                  /* row tiles per band of the tile order (L2 reuse); 0:
                                       * cometi_gemm_band_rows's */
        int schedule;                 /* COMETI_GEMM_SCHEDULE_AUTO, COMETI_GEMM_COOPERATIVE or
                                       * COMETI_GEMM_PINGPONG */
        unsigned int *sched;          /* [COMETI_GEMM_SCHED_WORDS] zeroed device words: tiles then come
                                       * from a counter shared by the grid (dispatch blocks join in
                                       * when done; they need it) and the last block zeroes them
                                       * again; NULL: each GEMM block takes every gemm_blocks-th tile */
        void *tail_ws;                /* COMETI_GEMM_TAIL_BYTES(SMs), counters zeroed once, or NULL:
                                       * with it, a last wave that would leave blocks idle may be cut
                                       * along k into up to 4 parts per tile (cooperative schedule,
                                       * groups along M, grid within the SMs; schedule.h). The same
                                       * bits every run, but which tiles are cut, so their fp32 sums'
                                       * order, depends on the blocks that take tiles and on the tile
                                       * order (splits). After a reported pipeline error the counters
                                       * must be zeroed again. */
    } launch;
    /* Failures. */
    cometi_async_error_t *err;        /* where a stuck pipeline reports (host-mapped) */
    unsigned long long timeout_ns;    /* rows from peers must arrive within this; a pipeline wait
                                       * twice as long is a bug: report, leave (0: 10 s) */
    /* Roles, each NULL when off: the variant takes exactly these (variants.h). */
    struct {
        const struct cometi_gemm_dispatch *dispatch;
        const struct cometi_gemm_splits *splits;
        unsigned long long *tile_trace; /* [blocks][COMETI_TILE_TRACE_WORDS] the call's tile timeline
                                         * (cooperative schedule; combine blocks leave their rows
                                         * alone), or NULL: any variant */
    } roles;
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

/* Row tiles per band of the tile order for tiles `block_n` wide: group_m, or when 0, 16
 * for E4M3's 256-wide tiles with groups along M, else 8. On H100 bands of 16 kept
 * mixtral-8x7b's GEMM0 and data gradient of W13 at their faster level (runs with 8 fell
 * 7% below it at times) and cost the 128-wide tiles 3-5% there. The dispatch's head
 * follows the bands (cometi_head_pieces). */
static inline int cometi_gemm_band_rows(const cometi_gemm_t *g, int block_n)
{
    if (g->launch.group_m) return g->launch.group_m;
    return g->a.type == COMETI_GEMM_E4M3 && g->problem.along == COMETI_GEMM_GROUPS_ALONG_M && block_n == 256 ? 16 : 8;
}

/* The tiling of the row the description resolves to (cometi_gemm_check's): its band of row
 * tiles (cometi_gemm_band_rows) and its output's column tiles (n over the tile's output
 * columns: SwiGLU's 256-wide tiles give 128); both 0 where no row is built. Before the
 * roles' fields are filled, for what sizes itself by the tiles (the dispatch's head). */
void cometi_gemm_tiling(const cometi_gemm_t *g, int *band_rows, int *col_tiles);

/* A checked GEMM with its tensor maps built, ready to launch (opaque; args.h). */
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

/* The row of variants.h's table the description asks for (COMET_NOT_SUPPORTED naming the
 * choices where there is none), and every field and role checked against it: no CUDA call,
 * so the CPU tests cover it. */
comet_status_t cometi_gemm_check(char *err, const cometi_gemm_t *g, int *variant);
/* Check every field and build the tensor maps; nothing is enqueued. Errors name the
 * field and the limit. Lets a caller fail before it starts work other ranks depend on. */
comet_status_t cometi_gemm_prepare(char *err, const cometi_gemm_t *g, cometi_gemm_prepared_t *out);
/* Enqueue a prepared GEMM on `stream`. */
comet_status_t cometi_gemm_launch(char *err, const cometi_gemm_prepared_t *p, cudaStream_t stream);
/* Prepare and launch. */
comet_status_t cometi_gemm_run(char *err, const cometi_gemm_t *g, cudaStream_t stream);
/* A variant's choices in words ("bf16 x bf16, A K-major, ..."), for messages and tests. */
void cometi_gemm_variant_text(const cometi_gemm_variant_t *v, char *out, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* COMET_GEMM_H */
