/*
 * dispatch.h - what the dispatch blocks of a dispatch -> GEMM kernel copy (COMET's
 * layer0 communication): this rank's rows, in pieces that each fill part of one 128-row
 * block of their expert owner's receive buffer, local experts first, every piece counted
 * with one system-scope release per receiver. The device code is dispatch.cuh; the GEMM
 * that waits for the counts is gemm.h's, with its dispatch role.
 */
#ifndef COMET_DISPATCH_H
#define COMET_DISPATCH_H

#include "comm/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How dispatch workers copy a piece of rows. */
enum {
    COMETI_DISPATCH_BULK = 0,  /* one thread per warp, whole rows with bulk copies through shared memory */
    COMETI_DISPATCH_STORES = 1 /* every lane, 16-byte loads and stores */
};

/* The most pieces the GEMM blocks copy at the kernel's start (the head, see head_pieces). */
#define COMETI_DISPATCH_HEAD_MAX_PIECES 64

typedef struct cometi_dispatch {
    const void *x;                  /* [tokens][row_bytes]: the forward's x (bf16 rows, or E4M3 rows
                                     * with their scales after them), the backward's dy ((t, j) index
                                     * / top_k = its row) */
    const void *x2;                 /* NULL, or a second source, [tokens][row_bytes] (the backward
                                     * sending x again, config.resend_x): each piece's rows of it go
                                     * x2_offset bytes past the piece's place in the receive buffer,
                                     * before the piece is counted */
    size_t x2_offset;
    int row_bytes;                  /* a row's bytes, a multiple of 16 */
    const int32_t *src_of;          /* [n] send order -> (t, j) index */
    cometi_route_tables_t plan;     /* the route's tables (counts, send_offset, seg_start, recv_offset) */
    int num_experts, top_k, experts_per_group, tp, rank; /* rank r is TP rank r % tp of group r / tp */
    int mode;                       /* COMETI_DISPATCH_*; x must be 16-byte aligned */
    int head_pieces;                /* tp 1: the first pieces of this rank's rows for its own experts,
                                     * which every GEMM block copies a share of at the kernel's start
                                     * (the first tiles' rows); workers take the rest. 0: none;
                                     * at most COMETI_DISPATCH_HEAD_MAX_PIECES */
    int wave_blocks;                /* tp 1: the first-wave kernel copied and computes the first
                                     * min(own rows / 128, wave_blocks) row blocks of this rank's
                                     * first expert (cometi_first_rows): their pieces are skipped */
    void *recv[COMETI_MAX_RANKS];                 /* every rank's receive buffer, mapped here */
    unsigned long long *arrive[COMETI_MAX_RANKS]; /* every rank's arrival counters, mapped here */
} cometi_dispatch_t;

#ifdef __cplusplus
}
#endif

#endif /* COMET_DISPATCH_H */
