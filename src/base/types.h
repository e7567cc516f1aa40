/*
 * types.h - what host code and kernels share, and nothing that needs comet.h, NCCL or
 * a CUDA header: the limits, a grouped GEMM's segments, the record a failed device-side
 * wait leaves for the host, the routes' call ids, and bf16 conversion. Kernels include
 * this (with launch.h and ptx.cuh); host code reaches it through host.h.
 */
#ifndef COMET_BASE_TYPES_H
#define COMET_BASE_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The few helpers below also run in kernels (same bits on both sides). */
#ifdef __CUDACC__
#define COMETI_HD __host__ __device__
#else
#define COMETI_HD
#endif

/* One NVLink node: NVL72 is the largest domain where every rank is load/store reachable. */
#define COMETI_MAX_RANKS 72
#define COMETI_MAX_EXPERTS 1024 /* config.num_experts (the dispatch's piece table holds this many) */

/* Rows of a GEMM tile along M: each expert's receive segment is padded to this, so a
 * tile never spans two experts. */
#define COMETI_BLOCK_M 128

/* One group's rows (an expert's segment) in a grouped GEMM's A and C. */
typedef struct cometi_segment {
    int start, rows;
} cometi_segment_t;

/* A segment's rows below `limit` (a buffer's rows): all, its first limit - start, or none. */
static inline COMETI_HD long long cometi_segment_rows_below(cometi_segment_t seg, long long limit)
{
    return seg.start + (long long)seg.rows <= limit ? seg.rows : seg.start < limit ? limit - seg.start : 0;
}

/* Where a device-side wait gave up; the first failure wins, later ones are dropped. */
typedef enum cometi_wait_site {
    COMETI_SITE_NONE = 0,
    COMETI_SITE_BARRIER = 1,   /* cross-rank barrier: a peer did not arrive */
    COMETI_SITE_FLAG = 2,      /* a flag in symmetric memory was never raised */
    COMETI_SITE_GEMM = 3,      /* a GEMM pipeline stage never filled or drained (a bug) */
    COMETI_SITE_ROUTE = 4,     /* the routing-count exchange: a peer's counts never came */
    COMETI_SITE_ARRIVAL = 5,   /* a GEMM tile's token rows never all arrived */
    COMETI_SITE_COMBINE = 6,   /* layer1: a column split's rows never all came home */
    COMETI_SITE_PUSH = 7,      /* layer1's push: its tokens' rows never all came home */
    COMETI_SITE_SAVED_BOUND = 8, /* a fused training forward routed more rows to an EP group
                                  * than its saved state's bound (expected: max_recv_rows,
                                  * seen: the rows, peer: the group) */
    COMETI_SITE_CALL_MISMATCH = 9, /* the route found ranks in different calls: a backward of
                                    * another forward call, or a forward beside a backward
                                    * (expected: this rank's call id, seen: rank peer's) */
    COMETI_SITE_WGRAD_SEGMENT = 10, /* an FP8 weight gradient's group starts at a row that is not
                                     * a multiple of 128, where its token blocks' scales are not
                                     * (seen: the row, peer: the group) */
} cometi_wait_site_t;

/* Written by kernels into host-mapped memory, read by the host without a sync. status is
 * a comet_status_t (comet.h), set last. */
typedef struct cometi_async_error {
    int status; /* comet_status_t; 0 while nothing failed; written last */
    int claim;  /* taken by the first failing thread */
    int site;   /* cometi_wait_site_t */
    int peer;   /* rank waited on, -1 if not one rank */
    int slot;   /* which flag */
    unsigned long long expected, seen, waited_ns;
    /* An expert id out of range: reported once by the next check, then cleared (not fatal:
     * that row is left out and the communicator stays usable). */
    int id_reported, id_claim, id_rank, id_index;
    long long id_value, id_limit;
} cometi_async_error_t;

/* The statuses kernels record (comet.h's values, which kernels do not include). */
#define COMETI_ASYNC_INVALID_ARGUMENT 1 /* COMET_INVALID_ARGUMENT */
#define COMETI_ASYNC_TIMEOUT 6          /* COMET_TIMEOUT */
#define COMETI_ASYNC_INTERNAL_ERROR 9   /* COMET_INTERNAL_ERROR */

/* The route's call ids (cometi_route_dev_run), which every rank of a call must share: 0 an
 * inference forward; COMETI_CALL_TRAIN_FORWARD + (the saved state's max_recv_rows mod
 * 2^31) a training forward; 1 .. 2^31 - 1 the backward of the training forward of that
 * number (comet_moe.train_calls). */
#define COMETI_CALL_TRAIN_FORWARD 0x80000000u

/* ---- bf16 ---- */
static inline COMETI_HD float cometi_bf16_to_float(uint16_t h)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* Round to nearest even, as the GPU's __float2bfloat16 does; NaN stays NaN. */
static inline COMETI_HD uint16_t cometi_float_to_bf16(float f)
{
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x007fffffu)) return (uint16_t)((v.u >> 16) | 0x40);
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASE_TYPES_H */
