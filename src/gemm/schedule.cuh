/*
 * schedule.cuh - the GEMM kernel's tile order: which tile (group, row tile, column
 * tile) a ticket stands for, local tiles first (COMET's rescheduling), column split by
 * column split when there are splits, and the last wave's tiles cut along k into parts
 * (cometi_gemm_tail_plan, gemm/schedule.h).
 */
#ifndef COMET_GEMM_SCHEDULE_CUH
#define COMET_GEMM_SCHEDULE_CUH

#include "gemm/schedule.h"

typedef struct tile {
    int group, m, n; /* row tile inside the group, column tile */
} tile_t;

/* Tiles come in two phases (COMET's rescheduling): phase 0 holds the row tiles made only
 * of local rows (cometi_gemm_local_row_tiles), phase 1 the rest. Entry i = phase * groups
 * + g; first_tile[i] is its first tile, first_tile[2 * groups] the total. Entry i has
 * (first_tile[i + 1] - first_tile[i]) / n_tiles row tiles; phase 1's start after phase 0's. */
static __device__ __forceinline__ tile_t decode_tile(int t, const int *first_tile, int groups, int n_tiles,
                                                     int group_m)
{
    int lo = 0, hi = 2 * groups - 1; /* the last entry whose first tile is <= t */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first_tile[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int g = lo % groups, mt = (first_tile[lo + 1] - first_tile[lo]) / n_tiles;
    const int m_first = lo >= groups ? (first_tile[g + 1] - first_tile[g]) / n_tiles : 0;
    int local = t - first_tile[lo];
    /* Bands of group_m row tiles; inside a band the row tile runs fastest. */
    int band = local / (group_m * n_tiles), band_rows = min(group_m, mt - band * group_m);
    int in_band = local - band * group_m * n_tiles;
    tile_t r;
    r.group = g;
    r.m = m_first + band * group_m + in_band % band_rows;
    r.n = in_band / band_rows;
    return r;
}

/* The last wave cut along k (tail_ws set, cooperative schedule). When the tiles leave a
 * last wave that would hold some blocks idle, each of its tiles may become a few units
 * (cometi_gemm_tail_plan), so the wave's idle SMs share its work: on skewed mixtral GEMM1
 * the last of 3.15 waves of 166 us tiles held every other SM idle for a fifth of the
 * kernel. Units are tickets:
 * first the whole tiles, then each cut tile's parts in order. A part other than the
 * last stores its fp32 accumulators to the workspace and counts itself; the last part,
 * taken after the others (tickets go in order, and on the static split a block's
 * tickets grow), waits for them, adds their partials in part order (the same bits every
 * run) and runs the tile's epilogue. No deadlock, by induction on tickets: every block
 * is resident (one per SM, the grid within the SMs) and takes its tickets in increasing
 * order, a last part waits only for parts with smaller tickets, whose blocks reach them
 * after only smaller tickets (over several rounds too), and nothing else a block waits on
 * (stages, tickets, rows from the dispatch) depends on a larger ticket. The plan is
 * cometi_gemm_tail_plan (gemm.h). */
typedef struct unit {
    int tile, kb0, kb1; /* the tile, its k-blocks [kb0, kb1) */
    int part;           /* -1: the whole tile; else which of the cut tile's parts */
} unit_t;

static __device__ __forceinline__ unit_t decode_unit(int u, const cometi_tail_plan_t *s, int k_blocks)
{
    unit_t r = {u, 0, k_blocks, -1};
    if (u < s->first) return r;
    const int x = (u - s->first) / s->parts, part = (u - s->first) - x * s->parts;
    r.tile = s->first + x;
    r.kb0 = part * k_blocks / s->parts;
    r.kb1 = (part + 1) * k_blocks / s->parts;
    r.part = part;
    return r;
}

/* With n_splits > 1 the tiles go split by split (COMET's layer1 order: a column split is
 * finished for every row before the next starts); inside a split, the order above over
 * the split's columns. `per_split` tiles a split. */
static __device__ __forceinline__ tile_t split_tile(int t, int per_split, const int *first_tile, int groups,
                                                    int split_tiles, int group_m)
{
    const int split = t / per_split;
    tile_t r = decode_tile(t - split * per_split, first_tile, groups, split_tiles, group_m);
    r.n += split * split_tiles;
    return r;
}

/* The tile table (see decode_tile), by the whole block: each group's tile counts loaded by
 * a thread each (thread 0 walking the groups' global sizes one after another took a few us
 * before the first tile), then summed in shared memory by thread 0, which returns the
 * total; the caller's barrier publishes the table. fixed_mt > 0: every group has that
 * many row tiles (a weight gradient's output rows). */
static __device__ __forceinline__ int build_tile_table(int *first_tile, const cometi_segment_t *segs,
                                                       const int32_t *local_rows, int groups, int tm, int split_tiles,
                                                       int fixed_mt)
{
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        /* Row tiles: the group's rows, or (a weight gradient's output) the same for all. */
        const int mt = fixed_mt ? fixed_mt : (segs[g].rows + tm - 1) / tm;
        const int local = local_rows ? cometi_gemm_local_row_tiles(segs[g].rows, local_rows[g], mt, tm) : 0;
        first_tile[g + 1] = local * split_tiles;
        first_tile[groups + g + 1] = (mt - local) * split_tiles;
    }
    __syncthreads();
    int total = 0;
    if (threadIdx.x == 0) {
        first_tile[0] = 0;
        for (int i = 1; i <= 2 * groups; i++) first_tile[i] = total += first_tile[i];
    }
    return total;
}

#endif /* COMET_GEMM_SCHEDULE_CUH */
