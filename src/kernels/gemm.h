/*
 * gemm.h - comet's grouped GEMM for Hopper: C[rows][n] = A[rows][k] * B_g[n][k]^T per
 * group g (an expert), bf16 in, fp32 accumulate, bf16 out. A is expert-major: group g's
 * rows are A rows [start_g, start_g + rows_g), read from device memory by the kernel so
 * no host sync is needed; B holds the groups one after another, [groups][n][k], in
 * nn.Linear's [out][in] layout.
 */
#ifndef COMET_GEMM_H
#define COMET_GEMM_H

#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One group's rows in A (and C). */
typedef struct cometi_segment {
    int start, rows;
} cometi_segment_t;

#define COMETI_GEMM_MAX_GROUPS 1024
/* tiles taken, blocks done, dispatch pieces taken, combine blocks past their setup, combine
 * blocks done */
#define COMETI_GEMM_SCHED_WORDS 5
/* Column splits of a layer1 call (split_done and the combine's counters are this long). */
#define COMETI_MAX_SPLITS 32
/* Layer1's arrival counters: one per split, then this one, the rows pushed (see `push`). */
#define COMETI_PUSH_COUNTER COMETI_MAX_SPLITS
/* Choices of one token that the combine sums on one rank before sending (registers). */
#define COMETI_COMBINE_MAX_TOP_K 8
/* Timeline of a combine block: start, records pulled, then per split (the first 8): rows
 * ready in C, sent, this rank's rows home, summed into y; then the end. */
#define COMETI_COMBINE_TRACE 36
/* Tile timeline of a GEMM block (`tile_trace`), global-timer ns: [0] the block's start,
 * [1] its dispatch done (dispatch blocks; GEMM blocks: their share of the head copied, see
 * head_copy; else 0), [2] tiles it took, [3] its end; then
 * for each of its first COMETI_TILE_TRACE_TILES tiles: the tile's index, when the
 * producer took it, when its rows were ready (the arrival wait passed; the take time when
 * there is none), and when the consumers had issued its epilogue. src/timeline.h reads it. */
/* The last wave's cut (tail_ws): a count per cut tile (at most one per block), then fp32
 * partials, 128 x 256 per part other than the last (at most two per block). */
#define COMETI_GEMM_TAIL_COUNTERS 1024
#define COMETI_GEMM_TAIL_SLOTS(sms) (2 * (size_t)(sms))
#define COMETI_GEMM_TAIL_BYTES(sms) (COMETI_GEMM_TAIL_COUNTERS * 8 + COMETI_GEMM_TAIL_SLOTS(sms) * 128 * 256 * 4)
#define COMETI_TILE_TRACE_TILES 240
#define COMETI_TILE_TRACE_WORDS (4 + 4 * COMETI_TILE_TRACE_TILES)

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

/* How dispatch workers copy a piece of rows. */
enum {
    COMETI_DISPATCH_BULK = 0,  /* one thread per warp, whole rows with bulk copies through shared memory */
    COMETI_DISPATCH_STORES = 1 /* every lane, 16-byte loads and stores */
};

/* Dispatch blocks of the fused layer0 kernel: copy this rank's token rows into the
 * receive buffers of every rank of their expert's group (local rows first), in pieces that
 * each fill part of one 128-row block, counting each piece's rows with one system-scope
 * release per receiver. Plan arrays are the device route's. */
typedef struct cometi_dispatch {
    const void *x;                  /* [tokens][hidden] bf16 */
    const int32_t *src_of;          /* [n] send order -> (t, j) index */
    const int32_t *counts;          /* [world][E] rows per (source, expert) */
    const int32_t *send_offset;     /* [world][E] */
    const int32_t *seg_start;       /* [E] */
    const int32_t *recv_offset;     /* [world][E] */
    int num_experts, top_k, hidden, experts_per_group, tp, rank; /* rank r is TP rank r % tp of group r / tp */
    int mode;                       /* COMETI_DISPATCH_*; x must be 16-byte aligned */
    int head_pieces;                /* set by cometi_gemm_prepare (head_copy): the first pieces of
                                     * this rank's rows for its own experts, which the GEMM
                                     * blocks copy at the kernel's start; workers take the rest */
    int wave_blocks;                /* tp 1: the first-wave kernel copied and computes the first
                                     * min(own rows / 128, wave_blocks) row blocks of this rank's
                                     * first expert (cometi_first_rows): their pieces are skipped */
    void *recv[COMETI_MAX_RANKS];                 /* every rank's receive buffer, mapped here */
    unsigned long long *arrive[COMETI_MAX_RANKS]; /* every rank's arrival counters, mapped here */
} cometi_dispatch_t;

/* What layer1 needs to know of one (token, choice) row, written in send order by the
 * source rank's route and pulled by the row's receiver (16 bytes). */
typedef struct cometi_row_meta {
    int32_t slot;  /* for the token's first choice on that receiver (its lead): the owner's slot,
                    * t * slots_per_token + (distinct receivers among earlier choices); else -1 */
    int32_t next;  /* the receive row of the token's next choice on the same receiver, or -1 */
    float weight;  /* the choice's top-k weight */
    int32_t src;   /* the source rank (filled in by the receiver) */
} cometi_row_meta_t;

/* One rank's windows the combine blocks reach, as mapped here (a device-memory table). */
typedef struct cometi_combine_peer {
    const cometi_row_meta_t *meta; /* its rows' records, in its send order */
    void *slots;                   /* [max_tokens][slots_per_token][hidden] bf16; the push puts
                                    * [max_tokens * top_k][hidden] there instead */
    unsigned long long *arrive;    /* [COMETI_MAX_SPLITS + 1] rows summed into its slots, per split,
                                    * then rows pushed there (COMETI_PUSH_COUNTER) */
} cometi_combine_peer_t;

/* Combine blocks of the fused layer1 kernel: they do not compute. First they pull the
 * records of every row received (from each row's source), then for each column split,
 * once the GEMM has finished it for every row: sum each token's rows on this rank,
 * weighted (the lead row and its `next` chain, fp32), write the sum to the token owner's
 * slot, count the rows per owner with one system-scope release; then, as owner, wait
 * until every row of its own tokens is in and sum the slots (fp32, in slot order: the
 * same bits every run) into y. Each split's combine runs while the GEMM computes the
 * next split. */
typedef struct cometi_combine {
    const cometi_combine_peer_t *peers;  /* [world], device memory */
    cometi_row_meta_t *meta;             /* [a_rows] records of the received rows */
    const int32_t *counts, *send_offset, *recv_offset; /* the route plan ([world][E]) */
    const int32_t *topk_ids;             /* [num_tokens][top_k] this rank's tokens */
    void *y;                             /* [num_tokens][hidden] bf16 */
    unsigned long long *expected;        /* [2][COMETI_MAX_SPLITS] running totals the waits aim at:
                                          * split_done, then this rank's arrive; the last combine
                                          * block advances them */
    unsigned int *sync;                  /* [2] zeroed words (blocks past the pull, blocks done);
                                          * zero again after the call */
    unsigned long long *trace;           /* [blocks][COMETI_COMBINE_TRACE] global-timer ns at each
                                          * phase (see combine.cuh), or NULL */
    int kernel_splits;                   /* splits the GEMM kernel's combine blocks send (0 ..
                                          * n_splits); cometi_launch_combine_tail does the rest */
    int num_tokens, num_experts, experts_per_group, top_k, slots_per_token, rank, world;
    int tp;                              /* ranks per EP group; the combine blocks and the tail need
                                          * 1, the push any (each TP rank sends its partial rows) */
} cometi_combine_t;

typedef struct cometi_gemm {
    const void *a;                 /* [a_rows][k] bf16 */
    int64_t a_rows;                /* rows allocated in A (TMA reads past a group's rows stay inside) */
    const void *b;                 /* [groups][n][k] bf16; with swiglu, [groups][2n][k] (gate rows,
                                    * then up rows), or the gate rows [groups][n][k] when b_up is set */
    const void *b_up;              /* swiglu only: up rows [groups][n][k] in a tensor of their own */
    void *c;                       /* [a_rows][ldc] bf16; only the groups' rows are written */
    int ldc;                       /* elements, even */
    const cometi_segment_t *segs;  /* [groups], device memory */
    int groups, n, k;              /* n a multiple of block_n (with swiglu, of 64: the last tile's
                                    * columns past n are not computed from real rows, nor stored);
                                    * k a multiple of 64 */
    int sms;                       /* persistent blocks, one per SM; 0: every SM */
    int block_n;                   /* 128 or 256; 0: 256 where n allows */
    int group_m;                   /* row tiles per band of the tile order (L2 reuse); 0: 8 */
    int epilogue;                  /* COMETI_EPILOGUE_*: how C tiles are stored */
    int schedule;                  /* COMETI_SCHEDULE_*: how the consumer warpgroups share tiles */
    int swiglu;                    /* C = silu(A Bgate^T) * (A Bup^T), n = F columns (128-wide tiles) */
    const float *row_scale;        /* C row r scaled by row_scale[r] (A row numbering), or NULL */
    const int32_t *row_index;      /* A row r stored to C row row_index[r] (< 0: dropped), or NULL;
                                    * rows then go straight from registers */
    /* Fused with dispatch (layer0); all NULL / 0 for a plain GEMM: */
    const int32_t *local_rows;            /* [groups] rows at the head of each group that are local:
                                           * tiles made only of them go first (COMET's rescheduling) */
    const unsigned long long *arrive;     /* [a_rows / 128] arrival counters: a tile reads its A rows
                                           * only once arrive[b] >= expected[b] (acquire, system) */
    const unsigned long long *expected;   /* [a_rows / 128] */
    /* Column splits (layer1): tiles go split by split, every row of split s before any of
     * split s + 1, and split_done[s] (if set) grows by the rows finished in it: after
     * one call, by rows x (column tiles per split), released at GPU scope once the rows
     * are in C. Never reset: readers wait for running totals. */
    int n_splits;                          /* 0 or 1: one split; must divide n / tile width */
    unsigned long long *split_done;        /* [n_splits], or NULL */
    /* Layer1's push epilogue: no C; each finished tile's rows go straight to their token
     * owners, row r of A to combine.peers[push_dest[r].x].slots at row push_dest[r].y (a
     * choice (t, j) of rank s's tokens: its index in s's send order, times tp plus this
     * rank's TP rank; x < 0: padding, not sent), over NVLink for other ranks, and combine.peers[s].arrive[COMETI_PUSH_COUNTER]
     * grows by the rows once they have landed (system-scope release, at each block's end):
     * by rows x column tiles per call. cometi_launch_push_dest fills push_dest. Needs the
     * TMA epilogue, one split, no combine blocks, and the combine's peers table, rank and
     * world. cometi_launch_push_sum sums. A warpgroup's 64 rows that all go to one owner's
     * consecutive slots (one (source, expert) chunk: most of them) leave as tensor stores
     * through push_maps; other parts are stored by every thread straight from its
     * accumulator fragments (4-byte stores), keeping small copies off the SM's TMA unit. */
    const void *push_dest; /* [a_rows] int2 (owner, slot row), or NULL */
    const void *push_maps; /* with push_dest: cometi_gemm_push_maps_create's maps */
    int dispatch_blocks;                  /* blocks before the GEMM's that run `dispatch` */
    int head_copy;                        /* with dispatch and tp 1: every GEMM block first copies a
                                           * share of the rows the first two waves of tiles need
                                           * (this rank's own, at the head of its segments), so
                                           * those tiles do not wait for a few dispatch workers */
    int combine_blocks;                   /* blocks before the GEMM's that run `combine` (needs
                                           * split_done; not with dispatch) */
    unsigned int *sched;                  /* [COMETI_GEMM_SCHED_WORDS] zeroed device words: tiles
                                           * then come from a counter shared by the grid (dispatch
                                           * blocks join in when done; they need it) and the last
                                           * block zeroes them again; NULL: each GEMM block takes
                                           * every gemm_blocks-th tile */
    cometi_dispatch_t dispatch;
    cometi_combine_t combine;
    cometi_async_error_t *err;     /* where a stuck pipeline reports (host-mapped) */
    unsigned long long timeout_ns; /* rows from peers must arrive within this; a pipeline wait
                                    * twice as long is a bug: report, leave (0: 10 s) */
    void *tail_ws;                  /* COMETI_GEMM_TAIL_BYTES(SMs), counters zeroed once, or NULL:
                                     * with it, a last wave that would leave blocks idle may
                                     * be cut along k into up to 4 parts per tile (cooperative
                                     * schedule, grid within the SMs; gemm.cu). The same bits
                                     * every run, but which tiles are cut, so their fp32 sums'
                                     * order, depends on the blocks that take tiles and on the
                                     * tile order (splits). After a reported pipeline error
                                     * the counters must be zeroed again. */
    unsigned long long *tile_trace; /* [blocks][COMETI_TILE_TRACE_WORDS] the call's tile timeline
                                     * (cooperative schedule; combine blocks leave their rows
                                     * alone), or NULL */
} cometi_gemm_t;

#ifdef __CUDACC__
#define COMETI_HOST_DEVICE __host__ __device__
#else
#define COMETI_HOST_DEVICE
#endif

/* The last wave's cut (tail_ws): `total` tiles taken by `takers` blocks, k_blocks steps of
 * 64 each. The last wave's `rest` tiles may each become `parts` units (at most
 * COMETI_TAIL_MAX_PARTS, each of at least COMETI_TAIL_MIN_KBLOCKS steps, their partials
 * within the workspace's slots): its rest x parts units then take ceil(rest x parts /
 * takers) rounds of 1/parts of a tile. The plan takes the shortest, the fewest parts on a
 * tie, and cuts only if that is shorter than one whole tile: a wave at most half full
 * goes in one round (2-4 parts), 68 tiles on 132 blocks in 2 rounds of thirds. Tiles
 * [0, first) whole, then the cut tiles' parts, `units` tickets in all. parts 1: nothing
 * cut. */
#define COMETI_TAIL_MAX_PARTS 4
#define COMETI_TAIL_MIN_KBLOCKS 8

typedef struct cometi_tail_plan {
    int first, parts, units;
} cometi_tail_plan_t;

static inline COMETI_HOST_DEVICE cometi_tail_plan_t cometi_gemm_tail_plan(int total, int takers, int k_blocks, int on)
{
    cometi_tail_plan_t s = {total, 1, total};
    if (!on || total <= 0 || takers <= 0) return s;
    const int rest = total % takers; /* the last wave's tiles (all of them below one wave) */
    if (rest == 0) return s;
    int best_rounds = 1, best_parts = 1; /* the last wave lasts best_rounds / best_parts of a tile */
    for (int parts = 2; parts <= COMETI_TAIL_MAX_PARTS; parts++) {
        if (parts * COMETI_TAIL_MIN_KBLOCKS > k_blocks ||
            (size_t)rest * (parts - 1) > COMETI_GEMM_TAIL_SLOTS(takers))
            break;
        const int rounds = (rest * parts + takers - 1) / takers;
        if (rounds * best_parts < best_rounds * parts) best_rounds = rounds, best_parts = parts;
    }
    if (best_parts == 1) return s;
    s.first = total - rest;
    s.parts = best_parts;
    s.units = s.first + rest * best_parts;
    return s;
}

/* Column tile width of a plain GEMM (no SwiGLU) with n columns when block_n is 0: 256
 * where it divides n, else 128. Layer1's split counts and the cost model use it too. */
static inline int cometi_gemm_tile_n(int n) { return n % 256 == 0 ? 256 : 128; }

/* A checked GEMM with its tensor maps built, ready to launch (opaque). */
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
/* The combine of splits [c->kernel_splits, n_splits) on every SM, after the GEMM that
 * wrote `rows` (C, [.][hidden]) on the same stream; `pull`: the records were not pulled
 * yet (the GEMM had no combine blocks). */
comet_status_t cometi_launch_combine_tail(char *err, const cometi_combine_t *c, const void *rows, int hidden,
                                          const cometi_segment_t *segs, int groups, int n_splits,
                                          int tiles_per_split, const unsigned long long *split_done, int pull,
                                          cometi_async_error_t *async_err, unsigned long long timeout_ns,
                                          cudaStream_t stream);

/* Where each row received goes home (see push_dest): for the rows of this rank's `groups`
 * local segments, their source rank and slot: index in its send order x tp + this rank's
 * TP rank (every TP rank of the group sends its partial row), from the route plan; -1 for
 * the padding. dest: [rows] int2 in device memory, rows >= every segment's end;
 * only the first *used_rows (device: this call's padded receive rows) are written. */
comet_status_t cometi_launch_push_dest(char *err, const cometi_combine_t *c, const cometi_segment_t *segs,
                                       int groups, int64_t rows, const int32_t *used_rows, void *dest,
                                       cudaStream_t stream);

/* The owner's side of the push: once every row of this rank's tokens has arrived
 * (arrive[COMETI_PUSH_COUNTER] reaching *expected + rows sent x col_tiles x tp, rows sent
 * being the route's counts[rank][.]: a choice with a bad expert id was left out), y[t] =
 * sum over TP ranks c, then choices j, of weights[t][j] x slot (at * tp + c) of (t, j), in
 * fp32, in that order (the same bits every run), on every SM; the last block advances
 * *expected and zeroes *done. `at` of (t, j) is send_offset[rank][e] + pos[t * top_k + j],
 * e = topk_ids[t][j] (the route plan). */
typedef struct cometi_push_sum {
    const void *slots;                 /* this rank's slots, [.][hidden] bf16 */
    const unsigned long long *arrive;  /* this rank's push counter */
    unsigned long long *expected;      /* [1] running total the wait aims at */
    unsigned int *done;                /* [1] zeroed word */
    const int32_t *topk_ids, *pos, *send_offset, *counts; /* plan arrays; counts, send_offset [world][E] */
    const float *weights;
    void *y;
    int num_tokens, top_k, hidden, num_experts, rank, col_tiles;
    int tp;                            /* TP ranks per group: choice (t, j) has tp partial rows, at
                                        * slots slot * tp + c, c the sender's TP rank; summed c by c */
    int step;                          /* tokens a block takes at a time: set by the prepare */
} cometi_push_sum_t;
/* Check `s`, size the grid and set s->step; nothing is enqueued. Call it before the GEMM
 * whose rows the sum waits for: a sum that fails after that GEMM has run would leave the
 * running total behind the counters. */
comet_status_t cometi_push_sum_prepare(char *err, cometi_push_sum_t *s, unsigned int *blocks);
comet_status_t cometi_launch_push_sum(char *err, const cometi_push_sum_t *s, unsigned int blocks,
                                      cometi_async_error_t *async_err, unsigned long long timeout_ns,
                                      cudaStream_t stream);

/* Enqueue a prepared GEMM on `stream`. */
comet_status_t cometi_gemm_launch(char *err, const cometi_gemm_prepared_t *p, cudaStream_t stream);
/* Prepare and launch. */
comet_status_t cometi_gemm_run(char *err, const cometi_gemm_t *g, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_GEMM_H */
