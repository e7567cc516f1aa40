/*
 * timeline.h - where a GEMM kernel's time went, from its tile timeline (gemm/gemm.h,
 * `tile_trace`): every block's time from the first block's start to the last block's
 * end, cut into what the block was doing. Plain C, so the CPU tests check it.
 */
#ifndef COMET_TIMELINE_H
#define COMET_TIMELINE_H

#include "layer/layer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Means over the blocks that ran, in us. Per block, the parts add up to the span:
 * launch (its start after the first block's), dispatch (a dispatch block's copying, or a
 * GEMM block's share of the head: comm/dispatch.h, head_pieces),
 * row waits (its consumers done with the last tile, the next tile's rows not all there
 * yet), tiles (from a tile's rows being ready, or the last tile's end if later, to its
 * epilogue issued: loads, MMAs, epilogue, a ticket's wait), tail (its last tile done,
 * the kernel not). */
typedef struct cometi_timeline {
    int blocks;            /* blocks with a row (combine blocks and unlaunched ones have none) */
    long long tiles;       /* tiles taken, all blocks (each part of a tile cut along k counts) */
    int truncated;         /* blocks that took more tiles than their rows hold: the time past
                            * their last recorded tile counts as tiles */
    double span_us, launch_us, dispatch_us, wait_us, tiles_us, tail_us;
    double first_wait_us;  /* the part of wait_us before each block's first tile */
    double tile_us;        /* one tile's mean time: tiles_us x blocks / tiles */
    double first_tile_us;  /* a block's first recorded tile, mean over blocks (its weights come
                            * cold: the pipeline starts empty) */
    double later_tile_us;  /* the recorded tiles after each block's first, mean */
} cometi_timeline_t;

/* trace: [blocks][COMETI_TILE_TRACE_WORDS] as the kernel left it, rows zeroed before the
 * call. COMET_INVALID_ARGUMENT (and a message naming the block) if a row is inconsistent:
 * a tile ending before its rows were ready, a block ending before its last tile. */
comet_status_t cometi_timeline_summarize(char *err, const unsigned long long *trace, int blocks,
                                         cometi_timeline_t *out);

#ifdef __cplusplus
}
#endif

#endif /* COMET_TIMELINE_H */
