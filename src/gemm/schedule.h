/*
 * schedule.h - the part of the GEMM's tile schedule that is plain arithmetic on
 * counts, shared by the kernel (schedule.cuh) and the CPU tests: which row tiles of a
 * group go first, and how a last wave that would leave SMs idle is cut along k.
 */
#ifndef COMET_GEMM_SCHEDULE_H
#define COMET_GEMM_SCHEDULE_H

#include "gemm/args.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A group's row tiles in the first phase (COMET's rescheduling: tiles made only of local
 * rows first), of its mt tiles of tm rows: `rows` rows, the first `local` of them local.
 * Those are the whole tiles of local rows, and every tile when all rows are local: a
 * partial last tile of local rows alone, put in the second phase, would read the group's
 * weights again after every other group's (at world 1, with rows per expert not a
 * multiple of tm, a second pass over all the weights). */
static inline COMETI_HD int cometi_gemm_local_row_tiles(int rows, int local, int mt, int tm)
{
    if (local >= rows) return mt;
    return local / tm < mt ? local / tm : mt;
}

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

static inline COMETI_HD cometi_tail_plan_t cometi_gemm_tail_plan(int total, int takers, int k_blocks, int on)
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

#ifdef __cplusplus
}
#endif

#endif /* COMET_GEMM_SCHEDULE_H */
