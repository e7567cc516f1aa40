/*
 * timeline.c - a GEMM kernel's tile timeline cut into what each block was doing. See
 * timeline.h.
 */
#include <string.h>

#include "timeline.h"
#include "gemm/gemm.h"

comet_status_t cometi_timeline_summarize(char *err, const unsigned long long *trace, int blocks,
                                         cometi_timeline_t *out)
{
    memset(out, 0, sizeof(*out));
    if (!trace || blocks < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "timeline: trace %p with %d blocks (need rows, >= 1)",
                           (const void *)trace, blocks);
    unsigned long long first = ~0ull, last = 0;
    for (int b = 0; b < blocks; b++) {
        const unsigned long long *row = trace + (size_t)b * COMETI_TILE_TRACE_WORDS;
        if (!row[0]) continue;
        if (row[3] < row[0])
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "timeline: block %d ends at %llu ns, before its start "
                               "%llu", b, row[3], row[0]);
        if (row[0] < first) first = row[0];
        if (row[3] > last) last = row[3];
    }
    double launch = 0, dispatch = 0, wait = 0, first_wait = 0, tiles = 0, tail = 0, first_tiles = 0, later_tiles = 0;
    long long firsts = 0, laters = 0;
    for (int b = 0; b < blocks; b++) {
        const unsigned long long *row = trace + (size_t)b * COMETI_TILE_TRACE_WORDS;
        if (!row[0]) continue;
        const unsigned long long start = row[0], gemm_start = row[1] ? row[1] : start, n = row[2], end = row[3];
        if (gemm_start < start || gemm_start > end)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "timeline: block %d's dispatch ends at %llu ns, outside "
                               "its run %llu..%llu", b, gemm_start, start, end);
        unsigned long long prev = gemm_start;
        const int recorded = n < COMETI_TILE_TRACE_TILES ? (int)n : COMETI_TILE_TRACE_TILES;
        for (int i = 0; i < recorded; i++) {
            const unsigned long long ready = row[4 + 4 * i + 2], done = row[4 + 4 * i + 3];
            if (done < ready || done < prev || done > end)
                return cometi_fail(err, COMET_INVALID_ARGUMENT, "timeline: block %d's tile %d (of %llu) ends at %llu "
                                   "ns: before its rows were ready (%llu), its previous tile's end (%llu), or after "
                                   "the block's end (%llu)", b, i, n, done, ready, prev, end);
            wait += ready > prev ? (double)(ready - prev) : 0;
            if (i == 0) first_wait += ready > prev ? (double)(ready - prev) : 0;
            const double tile = (double)(done - (ready > prev ? ready : prev));
            tiles += tile;
            if (i == 0) first_tiles += tile, firsts++;
            else later_tiles += tile, laters++;
            prev = done;
        }
        if (n > COMETI_TILE_TRACE_TILES) { /* the untraced tiles */
            out->truncated++;
            tiles += (double)(end - prev);
            prev = end;
        }
        launch += (double)(start - first);
        dispatch += (double)(gemm_start - start);
        tail += (double)(last - prev);
        out->blocks++;
        out->tiles += (long long)n;
    }
    if (!out->blocks) return cometi_fail(err, COMET_INVALID_ARGUMENT, "timeline: no block left a row");
    const double per = 1e3 * out->blocks; /* ns summed over blocks -> us per block */
    out->span_us = (double)(last - first) / 1e3;
    out->launch_us = launch / per;
    out->dispatch_us = dispatch / per;
    out->wait_us = wait / per;
    out->first_wait_us = first_wait / per;
    out->tiles_us = tiles / per;
    out->tail_us = tail / per;
    out->tile_us = out->tiles ? tiles / 1e3 / (double)out->tiles : 0;
    out->first_tile_us = firsts ? first_tiles / 1e3 / (double)firsts : 0;
    out->later_tile_us = laters ? later_tiles / 1e3 / (double)laters : 0;
    return COMET_SUCCESS;
}
