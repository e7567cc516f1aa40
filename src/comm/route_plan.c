/*
 * route_plan.c - the routing plan in plain C: from the per-(rank, expert) row counts
 * of every rank, where each row sits in its sender's send buffer and in its expert
 * owner's receive buffer. The baseline uses it on the host; the GPU route kernel of
 * the fused path must reproduce it exactly (plan.h describes the layout).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/plan.h"

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

void cometi_route_plan_free(cometi_route_plan_t *plan)
{
    if (!plan) return;
    free(plan->counts);
    free(plan->send_offset);
    free(plan->send_rows);
    free(plan->pair_rows);
    free(plan->seg_start);
    free(plan->seg_rows);
    free(plan->recv_offset);
    free(plan->recv_rows);
    memset(plan, 0, sizeof(*plan));
}

int cometi_route_plan_build(cometi_route_plan_t *plan, const int64_t *counts, int world, int tp,
                            int num_experts, int block_m, char *err, size_t err_len)
{
    memset(plan, 0, sizeof(*plan));
    if (world < 1 || tp < 1 || world % tp != 0 || num_experts < 1 || num_experts % (world / tp) != 0 ||
        block_m < 1) {
        snprintf(err, err_len, "route plan: world %d, tp %d, num_experts %d, block_m %d: need tp dividing world, "
                 "num_experts a positive multiple of world / tp, block_m >= 1", world, tp, num_experts, block_m);
        return -1;
    }
    const int W = world, G = world / tp, E = num_experts, per = E / G;
    plan->world = W;
    plan->tp = tp;
    plan->groups = G;
    plan->num_experts = E;
    plan->experts_per_group = per;
    plan->block_m = block_m;
    plan->counts = calloc((size_t)W * E, sizeof(int64_t));
    plan->send_offset = calloc((size_t)W * E, sizeof(int64_t));
    plan->send_rows = calloc((size_t)W, sizeof(int64_t));
    plan->pair_rows = calloc((size_t)W * G, sizeof(int64_t));
    plan->seg_start = calloc((size_t)E, sizeof(int64_t));
    plan->seg_rows = calloc((size_t)E, sizeof(int64_t));
    plan->recv_offset = calloc((size_t)W * E, sizeof(int64_t));
    plan->recv_rows = calloc((size_t)G, sizeof(int64_t));
    if (!plan->counts || !plan->send_offset || !plan->send_rows || !plan->pair_rows ||
        !plan->seg_start || !plan->seg_rows || !plan->recv_offset || !plan->recv_rows) {
        cometi_route_plan_free(plan);
        snprintf(err, err_len, "route plan: out of host memory for world %d, %d experts", W, E);
        return -1;
    }
    for (int s = 0; s < W; s++) {
        for (int e = 0; e < E; e++) {
            int64_t c = counts[(size_t)s * E + e];
            if (c < 0) {
                snprintf(err, err_len, "route plan: counts[%d][%d] = %lld is negative", s, e, (long long)c);
                cometi_route_plan_free(plan);
                return -1;
            }
            plan->counts[(size_t)s * E + e] = c;
        }
    }
    /* Send side: destination-group-major, then expert order. Experts are numbered so
     * that group order and expert order agree: a running sum over e suffices. */
    for (int s = 0; s < W; s++) {
        int64_t off = 0;
        for (int e = 0; e < E; e++) {
            int64_t c = plan->counts[(size_t)s * E + e];
            plan->send_offset[(size_t)s * E + e] = off;
            plan->pair_rows[(size_t)s * G + e / per] += c;
            off += c;
        }
        plan->send_rows[s] = off;
    }
    /* Receive side: expert segments padded to block_m; sources from the group's first
     * rank on (with tp = 1: the receiving rank's own rows first). */
    for (int g = 0; g < G; g++) {
        int64_t row = 0;
        for (int le = 0; le < per; le++) {
            int e = g * per + le;
            plan->seg_start[e] = row;
            int64_t in_seg = 0;
            for (int i = 0; i < W; i++) {
                int s = (g * tp + i) % W;
                plan->recv_offset[(size_t)s * E + e] = in_seg;
                in_seg += plan->counts[(size_t)s * E + e];
            }
            plan->seg_rows[e] = in_seg;
            row += round_up(in_seg, block_m);
        }
        plan->recv_rows[g] = row;
    }
    return 0;
}

int64_t cometi_route_max_recv_rows(int world, int max_tokens, int top_k, int experts_per_group,
                                   int block_m)
{
    /* All rows of all ranks, plus a partial tile of padding per expert of the group. */
    return (int64_t)world * max_tokens * top_k + (int64_t)experts_per_group * (block_m - 1);
}

int64_t cometi_route_count(const int32_t *topk_ids, int m, int k, int num_experts, int64_t *counts)
{
    int64_t first_bad = -1;
    for (int64_t i = 0; i < (int64_t)m * k; i++) {
        int32_t e = topk_ids[i];
        if (e < 0 || e >= num_experts) {
            if (first_bad < 0) first_bad = i;
            continue;
        }
        counts[e]++;
    }
    return first_bad;
}

void cometi_route_dispatch_messages(const cometi_route_plan_t *plan, int me, cometi_a2a_msg_t *sends, int *n_sends,
                                    cometi_a2a_msg_t *recvs, int *n_recvs)
{
    const int W = plan->world, tp = plan->tp, E = plan->num_experts, per = plan->experts_per_group;
    const int g_me = me / tp;
    int ns = 0, nr = 0;
    for (int e = 0; e < E; e++) {
        const int64_t rows = plan->counts[(size_t)me * E + e];
        for (int t = 0; t < tp && rows; t++)
            sends[ns++] = (cometi_a2a_msg_t){(e / per) * tp + t, e, plan->send_offset[(size_t)me * E + e], rows};
    }
    for (int s = 0; s < W; s++) {
        for (int le = 0; le < per; le++) {
            const int e = g_me * per + le;
            const int64_t rows = plan->counts[(size_t)s * E + e];
            if (rows)
                recvs[nr++] = (cometi_a2a_msg_t){s, e, plan->seg_start[e] + plan->recv_offset[(size_t)s * E + e], rows};
        }
    }
    *n_sends = ns;
    *n_recvs = nr;
}

void cometi_route_positions(const cometi_route_plan_t *plan, int src, const int32_t *topk_ids,
                            int m, int k, int64_t *send_pos, int64_t *recv_pos)
{
    const int E = plan->num_experts;
    int64_t *seen = calloc((size_t)E, sizeof(int64_t)); /* rows of expert e placed so far */
    if (!seen) abort(); /* E int64s: a failure here means the process is already lost */
    for (int64_t i = 0; i < (int64_t)m * k; i++) {
        int e = topk_ids[i];
        int64_t r = seen[e]++;
        if (send_pos) send_pos[i] = plan->send_offset[(size_t)src * E + e] + r;
        if (recv_pos) recv_pos[i] = plan->seg_start[e] + plan->recv_offset[(size_t)src * E + e] + r;
    }
    free(seen);
}
