/*
 * plan.h - host planning in plain C, no CUDA headers: the routing plan (who sends
 * which rows where, and the expert-major receive layout). The CPU
 * tests cover all of it; the GPU route must agree with it exactly.
 */
#ifndef COMET_COMM_PLAN_H
#define COMET_COMM_PLAN_H

#include <stdint.h>
#include <stddef.h>

#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Routing plan for one forward call with EP x TP = world.
 *
 * Rank r is TP rank r % tp of EP group g = r / tp; there are groups = world / tp groups.
 * Expert e lives on group owner(e) = e / experts_per_group, every rank of the group
 * holding 1/tp of its ffn columns: a row for e goes to each of the group's tp ranks,
 * which share one receive layout. With tp = 1 a group is a rank (EP = world).
 *
 * counts[s][e]: rows rank s sends to global expert e (one row per (token, choice)).
 *
 * Send side, on rank s: one contiguous chunk per expert, ordered by destination group
 * and then by expert; inside a chunk the rows keep token order (t, then choice j). The
 * same chunk goes to every rank of the group.
 *
 * Receive side, on every rank of group g: one segment per expert of g, in expert order,
 * each starting at a multiple of block_m; inside a segment the rows of each source rank
 * are contiguous, sources in order from the group's first rank (g * tp, g * tp + 1, ...
 * mod world): with tp = 1, the receiving rank's own rows first, so the GEMM can start on
 * local rows while remote ones are in flight.
 */
typedef struct cometi_route_plan {
    int world, tp, groups, num_experts, experts_per_group, block_m;
    int64_t *counts;      /* [world][E] copy of the input */
    int64_t *send_offset; /* [world][E] on rank s: first row of expert e's chunk */
    int64_t *send_rows;   /* [world]    rows rank s sends in all (to each rank of their group) */
    int64_t *pair_rows;   /* [world][groups] rows from s to (each rank of) group g */
    int64_t *seg_start;   /* [E] on owner(e)'s ranks: first row of e's segment */
    int64_t *seg_rows;    /* [E] rows in e's segment (without padding) */
    int64_t *recv_offset; /* [world][E] on owner(e)'s ranks: first row of source s's rows in e's segment */
    int64_t *recv_rows;   /* [groups]   padded rows each rank of group g receives (its buffer's used size) */
} cometi_route_plan_t;

/* The plan's tables as the device route keeps them (int32, the layout above), read by
 * the kernels that move rows: the dispatch, the combine and the push. */
typedef struct cometi_route_tables {
    const int32_t *counts;      /* [world][E] */
    const int32_t *send_offset; /* [world][E] */
    const int32_t *seg_start;   /* [E] */
    const int32_t *recv_offset; /* [world][E] */
} cometi_route_tables_t;

/* Build the plan from counts[world][num_experts] for tp ranks per group. Returns 0, or
 * -1 with `err` set (bad sizes, negative counts, allocation failure). */
int cometi_route_plan_build(cometi_route_plan_t *plan, const int64_t *counts, int world, int tp,
                            int num_experts, int block_m, char *err, size_t err_len);
void cometi_route_plan_free(cometi_route_plan_t *plan);

/* Worst-case padded receive rows on one rank: every row of every rank comes to its group. */
int64_t cometi_route_max_recv_rows(int world, int max_tokens, int top_k, int experts_per_group,
                                   int block_m);

/* counts[e] += rows of topk_ids[m][k] that go to expert e. Returns the index of the
 * first id out of [0, E), or -1 when all are valid (those are not counted). */
int64_t cometi_route_count(const int32_t *topk_ids, int m, int k, int num_experts,
                           int64_t *counts);

/* For each (t, j) of rank `src`: its row in src's send buffer and its row in the
 * receive buffer of the owner group's ranks. Either output may be NULL. */
void cometi_route_positions(const cometi_route_plan_t *plan, int src, const int32_t *topk_ids,
                            int m, int k, int64_t *send_pos, int64_t *recv_pos);

/*
 * The dispatch all-to-all of rank `me` as NCCL messages (one per non-empty (rank, expert)
 * chunk), in an order that makes every pair's sends and receives match (NCCL pairs a
 * group's sends and receives between two ranks in the order they are posted):
 *   sends: each expert's chunk to every rank of its group, expert by expert; `offset` is
 *          the chunk's first row in me's send buffer;
 *   recvs: from each source rank, its chunks of the group's experts in expert order;
 *          `offset` is the chunk's first row in the receive buffer.
 * The return trip (each receiver's partial rows back to their source) is the same list
 * with directions swapped; with tp > 1 the source takes one copy per TP rank of the
 * group (peer % tp tells which). sends needs room for tp * num_experts entries, recvs
 * for world * experts_per_group; the counts come back in *n_sends and *n_recvs.
 */
typedef struct cometi_a2a_msg {
    int peer, expert;
    int64_t offset, rows;
} cometi_a2a_msg_t;
void cometi_route_dispatch_messages(const cometi_route_plan_t *plan, int me, cometi_a2a_msg_t *sends, int *n_sends,
                                    cometi_a2a_msg_t *recvs, int *n_recvs);

/*
 * Layer1's sum per token and rank. A token's choices that land on one rank are summed
 * there first and sent home as one row; the owner sums one row per distinct rank, in the
 * order of the token's first choice on each (the same bits every call). For choice j of
 * a token with choices ids[0..k) (ids outside [0, E) take no part): if j is the token's
 * first choice on its rank, returns its place in that order (the owner's slot for it,
 * < min(k, world)); otherwise -1. *next: the next choice on the same rank, or -1.
 */
static inline COMETI_HD int cometi_choice_slot(const int32_t *ids, int k, int j, int num_experts,
                                               int experts_per_rank, int *next)
{
    /* One pass: each earlier choice's rank is set in `seen` (ranks below 128; a larger one,
     * which no node has, is looked for among the earlier choices instead), so the GPU route
     * does k loads and k divisions per row, not k^2. */
    const int rank = ids[j] / experts_per_rank;
    uint64_t seen_lo = 0, seen_hi = 0; /* two scalars, not an array: registers on the GPU, not local memory */
    int slot = 0, lead = 1;
    *next = -1;
    for (int i = 0; i < k; i++) {
        const int e = ids[i];
        if (e < 0 || e >= num_experts || i == j) continue;
        const int r = e / experts_per_rank;
        if (i < j) {
            if (r == rank) lead = 0;
            int was_seen = 0;
            if (r < 128) {
                const uint64_t bit = 1ull << (r & 63);
                was_seen = ((r < 64 ? seen_lo : seen_hi) & bit) != 0;
                if (r < 64) seen_lo |= bit; else seen_hi |= bit;
            } else {
                for (int h = 0; h < i; h++)
                    if (ids[h] >= 0 && ids[h] < num_experts && ids[h] / experts_per_rank == r) was_seen = 1;
            }
            slot += !was_seen; /* a rank counts once, at its first choice */
        } else if (r == rank && *next < 0) {
            *next = i;
        }
    }
    return lead ? slot : -1;
}

/*
 * Layer1's push, for row q of expert e's receive segment on TP rank t_rank of e's group:
 * the source rank whose rows hold it (its return value; -1 when q is past the segment's
 * rows: padding) and, in *slot, the row of the source's slots this rank's partial goes to:
 * (the row's index in the source's send order) x tp + t_rank. Arrays of the plan, int32 as
 * the device route keeps them: counts, send_offset, recv_offset [world][E]; the search
 * starts at first_source (this rank: its own rows lead the segment most often). Shared by
 * push_dest_kernel and the CPU tests.
 */
static inline COMETI_HD int cometi_push_slot(const int32_t *counts, const int32_t *send_offset,
                                             const int32_t *recv_offset, int world, int num_experts, int e,
                                             int64_t q, int tp, int t_rank, int first_source, int64_t *slot)
{
    for (int u = 0; u < world; u++) {
        const int s = (first_source + u) % world;
        const int64_t off = recv_offset[(size_t)s * num_experts + e];
        if (q >= off && q < off + counts[(size_t)s * num_experts + e]) {
            *slot = (send_offset[(size_t)s * num_experts + e] + q - off) * tp + t_rank;
            return s;
        }
    }
    return -1;
}

/* Distinct ranks among a token's valid choices: the slots its owner sums (the leads). */
static inline COMETI_HD int cometi_token_ranks(const int32_t *ids, int k, int num_experts, int experts_per_rank)
{
    int ranks = 0;
    for (int j = 0; j < k; j++) {
        if (ids[j] < 0 || ids[j] >= num_experts) continue;
        int first = 1;
        for (int i = 0; i < j; i++)
            if (ids[i] >= 0 && ids[i] < num_experts && ids[i] / experts_per_rank == ids[j] / experts_per_rank)
                first = 0;
        ranks += first;
    }
    return ranks;
}

#ifdef __cplusplus
}
#endif

#endif /* COMET_COMM_PLAN_H */
