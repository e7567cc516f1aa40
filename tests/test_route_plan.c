/*
 * test_route_plan.c - the routing plan on the CPU (no GPU needed): bf16 rounding, the
 * plan's known answers and random invariants over EP x TP layouts, the dispatch as NCCL
 * messages, layer1's push slots, route counts that reject bad ids, and the per-token
 * choice slots.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include "comet.h"
#include "layer/layer.h"
#include "comm/plan.h"
#include "testutil.h"

int test_bf16_rounding(void)
{
    CHECK_EQ(cometi_float_to_bf16(1.0f), 0x3f80);
    CHECK_EQ(cometi_float_to_bf16(-2.0f), 0xc000);
    CHECK_EQ(cometi_float_to_bf16(0.0f), 0x0000);
    /* 1 + 2^-8 lies halfway between two bf16 values: ties go to the even one (1.0). */
    CHECK_EQ(cometi_float_to_bf16(1.0f + 0x1.0p-8f), 0x3f80);
    /* 1 + 3 * 2^-8 is halfway too: even is 1 + 2^-6. */
    CHECK_EQ(cometi_float_to_bf16(1.0f + 3 * 0x1.0p-8f), 0x3f82);
    CHECK_EQ(cometi_float_to_bf16(1.0f + 0x1.8p-8f), 0x3f81); /* above halfway rounds up */
    CHECK(isnan(cometi_bf16_to_float(cometi_float_to_bf16(NAN))));
    CHECK(isinf(cometi_bf16_to_float(cometi_float_to_bf16(INFINITY))));
    CHECK_NEAR(cometi_bf16_to_float(cometi_float_to_bf16(3.14159f)), 3.140625, 0);
    return 0;
}

int test_route_plan_known_answer(void)
{
    const int64_t counts[2 * 4] = {3, 0, 2, 5, /* rank 1 */ 1, 4, 0, 2};
    cometi_route_plan_t p;
    char err[256];
    CHECK_EQ(cometi_route_plan_build(&p, counts, 2, 1, 4, 4, err, sizeof(err)), 0);
    const int64_t send_offset[8] = {0, 3, 3, 5, 0, 1, 5, 5};
    const int64_t pair_rows[4] = {3, 7, 5, 2};
    const int64_t seg_start[4] = {0, 4, 0, 4}, seg_rows[4] = {4, 4, 2, 7};
    /* On rank 1 the local rows (source 1) come first: source 0's rows of expert 3 start at 2. */
    const int64_t recv_offset[8] = {0, 0, 0, 2, 3, 0, 0, 0};
    for (int i = 0; i < 8; i++) CHECK_EQ(p.send_offset[i], send_offset[i]);
    for (int i = 0; i < 4; i++) CHECK_EQ(p.pair_rows[i], pair_rows[i]);
    for (int e = 0; e < 4; e++) CHECK_EQ(p.seg_start[e], seg_start[e]);
    for (int e = 0; e < 4; e++) CHECK_EQ(p.seg_rows[e], seg_rows[e]);
    for (int i = 0; i < 8; i++) CHECK_EQ(p.recv_offset[i], recv_offset[i]);
    CHECK_EQ(p.send_rows[0], 10);
    CHECK_EQ(p.send_rows[1], 7);
    CHECK_EQ(p.recv_rows[0], 8);
    CHECK_EQ(p.recv_rows[1], 12);
    /* Rank 0's tokens that produce counts[0]. */
    const int32_t ids[10] = {0, 3, 3, 2, 0, 3, 3, 2, 0, 3};
    int64_t c0[4] = {0};
    CHECK_EQ(cometi_route_count(ids, 5, 2, 4, c0), -1);
    for (int e = 0; e < 4; e++) CHECK_EQ(c0[e], counts[e]);
    int64_t send_pos[10], recv_pos[10];
    cometi_route_positions(&p, 0, ids, 5, 2, send_pos, recv_pos);
    const int64_t want_send[10] = {0, 5, 6, 3, 1, 7, 8, 4, 2, 9};
    const int64_t want_recv[10] = {0, 6, 7, 0, 1, 8, 9, 1, 2, 10};
    for (int i = 0; i < 10; i++) CHECK_EQ(send_pos[i], want_send[i]);
    for (int i = 0; i < 10; i++) CHECK_EQ(recv_pos[i], want_recv[i]);
    cometi_route_plan_free(&p);
    /* The same counts as one group of two TP ranks: every expert on both ranks, one
     * receive layout for the two, sources from the group's first rank. */
    CHECK_EQ(cometi_route_plan_build(&p, counts, 2, 2, 4, 4, err, sizeof(err)), 0);
    CHECK_EQ(p.groups, 1);
    CHECK_EQ(p.experts_per_group, 4);
    const int64_t tp_seg_start[4] = {0, 4, 8, 12}, tp_seg_rows[4] = {4, 4, 2, 7};
    const int64_t tp_recv_offset[8] = {0, 0, 0, 0, 3, 0, 2, 5};
    for (int i = 0; i < 8; i++) CHECK_EQ(p.send_offset[i], send_offset[i]);
    CHECK_EQ(p.pair_rows[0], 10);
    CHECK_EQ(p.pair_rows[1], 7);
    for (int e = 0; e < 4; e++) CHECK_EQ(p.seg_start[e], tp_seg_start[e]);
    for (int e = 0; e < 4; e++) CHECK_EQ(p.seg_rows[e], tp_seg_rows[e]);
    for (int i = 0; i < 8; i++) CHECK_EQ(p.recv_offset[i], tp_recv_offset[i]);
    CHECK_EQ(p.recv_rows[0], 20);
    cometi_route_plan_free(&p);
    int64_t bad[2] = {1, -1};
    CHECK_EQ(cometi_route_plan_build(&p, bad, 1, 1, 2, 4, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "counts[0][1] = -1");
    CHECK_EQ(cometi_route_plan_build(&p, bad, 2, 1, 3, 4, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "num_experts 3");
    CHECK_EQ(cometi_route_plan_build(&p, bad, 4, 3, 4, 4, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "tp 3");
    return 0;
}

/* Every (rank, token, choice) lands on a distinct row of its expert's segment on the
 * owner group, the group's first rank's rows first (with TP = 1: local rows first);
 * segments are aligned and disjoint; send rows are a permutation of 0..send_rows-1
 * grouped by destination group. Over EP x TP layouts: 1x1, 2x1, 3x1, 4x1, 8x1, 1x2, 2x2,
 * 4x2, 1x4, 2x4, 1x8. */
int test_route_plan_random_invariants(void)
{
    uint64_t rng = test_seed();
    const int layouts[][2] = {{1, 1}, {2, 1}, {3, 1}, {4, 1}, {8, 1}, {2, 2}, {4, 2}, {8, 2}, {4, 4}, {8, 4}, {8, 8}};
    for (int li = 0; li < (int)(sizeof(layouts) / sizeof(layouts[0])); li++) {
        for (int trial = 0; trial < 20; trial++) {
            const int W = layouts[li][0], tp = layouts[li][1], G = W / tp;
            const int per = 1 + (int)(cometi_rand_next(&rng) % 4), E = G * per;
            const int k = 1 + (int)(cometi_rand_next(&rng) % (E < 4 ? E : 4));
            const int block_m = (trial & 1) ? 128 : 8;
            int m[8];
            int32_t *ids[8];
            float *w[8];
            int64_t *counts = calloc((size_t)W * E, sizeof(int64_t));
            for (int s = 0; s < W; s++) {
                m[s] = (int)(cometi_rand_next(&rng) % 300);
                ids[s] = malloc(sizeof(int32_t) * (m[s] * k + 1));
                w[s] = malloc(sizeof(float) * (m[s] * k + 1));
                cometi_make_routing((cometi_routing_t)(trial % 3), 8.0, m[s], k, E, rng, s, ids[s], w[s]);
                CHECK_EQ(cometi_route_count(ids[s], m[s], k, E, counts + (size_t)s * E), -1);
            }
            cometi_route_plan_t p;
            char err[256];
            CHECK_EQ(cometi_route_plan_build(&p, counts, W, tp, E, block_m, err, sizeof(err)), 0);
            CHECK_EQ(p.groups, G);
            for (int d = 0; d < G; d++) {
                int64_t used = 0;
                for (int le = 0; le < per; le++) {
                    int e = d * per + le;
                    CHECK_EQ(p.seg_start[e] % block_m, 0);
                    CHECK_EQ(p.seg_start[e], used);
                    used += (p.seg_rows[e] + block_m - 1) / block_m * block_m;
                    CHECK_EQ(p.recv_offset[(size_t)d * tp * E + e], 0); /* the group's first rank first */
                }
                CHECK_EQ(p.recv_rows[d], used);
                CHECK(used <= cometi_route_max_recv_rows(W, 300, k, per, block_m));
            }
            /* Mark every receive row (per group) and every send row once. */
            char *recv_seen[8], *send_seen[8];
            for (int d = 0; d < G; d++) recv_seen[d] = calloc((size_t)p.recv_rows[d] + 1, 1);
            for (int s = 0; s < W; s++) {
                send_seen[s] = calloc((size_t)p.send_rows[s] + 1, 1);
                int64_t *sp = malloc(sizeof(int64_t) * (m[s] * k + 1)), *rp = malloc(sizeof(int64_t) * (m[s] * k + 1));
                cometi_route_positions(&p, s, ids[s], m[s], k, sp, rp);
                for (int i = 0; i < m[s] * k; i++) {
                    int e = ids[s][i], d = e / per;
                    CHECK(sp[i] >= 0 && sp[i] < p.send_rows[s]);
                    CHECK(!send_seen[s][sp[i]]);
                    send_seen[s][sp[i]] = 1;
                    CHECK(rp[i] >= p.seg_start[e] && rp[i] < p.seg_start[e] + p.seg_rows[e]);
                    CHECK(!recv_seen[d][rp[i]]);
                    recv_seen[d][rp[i]] = 1;
                    if (s == d * tp) CHECK(rp[i] < p.seg_start[e] + counts[(size_t)s * E + e]);
                    /* Rows to group d sit between the rows to d-1 and d+1. */
                    int64_t lo = p.send_offset[(size_t)s * E + d * per];
                    CHECK(sp[i] >= lo && sp[i] < lo + p.pair_rows[(size_t)s * G + d]);
                }
                free(sp);
                free(rp);
            }
            for (int d = 0; d < G; d++) {
                int64_t marked = 0, want = 0;
                for (int64_t r = 0; r < p.recv_rows[d]; r++) marked += recv_seen[d][r];
                for (int le = 0; le < per; le++) want += p.seg_rows[d * per + le];
                CHECK_EQ(marked, want);
                free(recv_seen[d]);
            }
            for (int s = 0; s < W; s++) {
                for (int64_t r = 0; r < p.send_rows[s]; r++) CHECK(send_seen[s][r]);
                free(send_seen[s]);
                free(ids[s]);
                free(w[s]);
            }
            cometi_route_plan_free(&p);
            free(counts);
        }
    }
    return 0;
}

/* The dispatch as NCCL messages, over EP x TP layouts: between every two ranks the sends
 * of one and the receives of the other come in the same order with the same experts and
 * row counts (how NCCL pairs them); each chunk goes to every rank of its expert's group;
 * the receives tile each segment of the group's layout exactly, the sends each chunk of
 * the sender's buffer. */
int test_route_dispatch_messages_match(void)
{
    uint64_t rng = test_seed();
    const int layouts[][2] = {{1, 1}, {2, 1}, {4, 1}, {8, 1}, {2, 2}, {4, 2}, {8, 2}, {8, 4}, {8, 8}};
    for (int li = 0; li < (int)(sizeof(layouts) / sizeof(layouts[0])); li++) {
        for (int trial = 0; trial < 30; trial++) {
            const int W = layouts[li][0], tp = layouts[li][1], G = W / tp;
            const int per = 1 + (int)(cometi_rand_next(&rng) % 4), E = G * per;
            int64_t *counts = calloc((size_t)W * E, sizeof(int64_t));
            for (int i = 0; i < W * E; i++) /* some chunks empty */
                counts[i] = cometi_rand_next(&rng) % 3 == 0 ? 0 : (int64_t)(cometi_rand_next(&rng) % 200);
            cometi_route_plan_t p;
            char err[256];
            CHECK_EQ(cometi_route_plan_build(&p, counts, W, tp, E, 128, err, sizeof(err)), 0);
            cometi_a2a_msg_t *sends[8], *recvs[8];
            int ns[8], nr[8];
            for (int r = 0; r < W; r++) {
                sends[r] = malloc(sizeof(cometi_a2a_msg_t) * (size_t)(tp * E));
                recvs[r] = malloc(sizeof(cometi_a2a_msg_t) * (size_t)(W * per));
                cometi_route_dispatch_messages(&p, r, sends[r], &ns[r], recvs[r], &nr[r]);
                /* Sends: each non-empty chunk tp times, to the ranks of its group, at its offset. */
                int64_t sent = 0;
                for (int i = 0; i < ns[r]; i++) {
                    const cometi_a2a_msg_t *m = &sends[r][i];
                    CHECK_EQ(m->peer / tp, m->expert / per);
                    CHECK_EQ(m->offset, p.send_offset[(size_t)r * E + m->expert]);
                    CHECK_EQ(m->rows, counts[(size_t)r * E + m->expert]);
                    CHECK(m->rows > 0);
                    sent += m->rows;
                }
                CHECK_EQ(sent, p.send_rows[r] * tp);
                /* Receives: inside the segments of this rank's group, disjoint, covering them. */
                int64_t *covered = calloc((size_t)E, sizeof(int64_t));
                for (int i = 0; i < nr[r]; i++) {
                    const cometi_a2a_msg_t *m = &recvs[r][i];
                    CHECK_EQ(m->expert / per, r / tp);
                    CHECK_EQ(m->offset, p.seg_start[m->expert] + p.recv_offset[(size_t)m->peer * E + m->expert]);
                    CHECK(m->offset + m->rows <= p.seg_start[m->expert] + p.seg_rows[m->expert]);
                    covered[m->expert] += m->rows;
                }
                for (int le = 0; le < per; le++) CHECK_EQ(covered[(r / tp) * per + le], p.seg_rows[(r / tp) * per + le]);
                free(covered);
            }
            /* Every ordered pair: a's sends to b, in order, are b's receives from a, in order. */
            for (int a = 0; a < W; a++) {
                for (int b = 0; b < W; b++) {
                    int i = 0, j = 0;
                    for (;;) {
                        while (i < ns[a] && sends[a][i].peer != b) i++;
                        while (j < nr[b] && recvs[b][j].peer != a) j++;
                        if (i == ns[a] || j == nr[b]) break;
                        CHECK_EQ(sends[a][i].expert, recvs[b][j].expert);
                        CHECK_EQ(sends[a][i].rows, recvs[b][j].rows);
                        i++, j++;
                    }
                    while (i < ns[a] && sends[a][i].peer != b) i++;
                    while (j < nr[b] && recvs[b][j].peer != a) j++;
                    CHECK(i == ns[a] && j == nr[b]); /* neither side has a message left over */
                }
            }
            for (int r = 0; r < W; r++) free(sends[r]), free(recvs[r]);
            cometi_route_plan_free(&p);
            free(counts);
        }
    }
    return 0;
}

/* The push epilogue's shortcut: a full 64-row part with one owner at both ends and slots
 * 63 x tp apart is sent as tensor stores to 64 consecutive rows of that owner's map. True
 * only if every row of the part goes there; the map row must lie inside the owner's send
 * rows. Returns the number of such parts, or -1. */
static int64_t whole_parts_checked(const cometi_route_plan_t *p, const int32_t *c32, const int32_t *so32,
                                   const int32_t *ro32, int W, int tp, int E, int per, const int *m, int kk)
{
    int64_t wholes = 0;
    for (int r = 0; r < W; r++) {
        const int g = r / tp, t_rank = r % tp;
        for (int le = 0; le < per; le++) {
            const int e = g * per + le;
            for (int64_t part = 0; part + 64 <= p->seg_rows[e]; part += 64) {
                int dx[64];
                int64_t dy[64];
                for (int q = 0; q < 64; q++)
                    dx[q] = cometi_push_slot(c32, so32, ro32, W, E, e, part + q, tp, t_rank, r, &dy[q]);
                if (!(dx[0] >= 0 && dx[63] == dx[0] && dy[63] - dy[0] == 63 * tp)) continue;
                wholes++;
                for (int q = 0; q < 64; q++)
                    if (dx[q] != dx[0] || dy[q] != dy[0] + q * tp) return -1;
                if ((dy[0] - t_rank) % tp || (dy[0] - t_rank) / tp + 63 >= (int64_t)m[dx[0]] * kk) return -1;
            }
        }
    }
    return wholes;
}

/* Layer1's push slots (cometi_push_slot, what push_dest_kernel runs) over EP x TP layouts
 * up to 8 ranks: every row received by every TP rank of a group goes to the source that
 * sent it, at (its send position) x tp + the TP rank, so each owner's slots are hit once
 * each, by every (row, TP rank); padding goes nowhere; and the epilogue's whole parts
 * (whole_parts_checked) are what they claim, on plans that have some. */
int test_push_slots_cover_every_partial(void)
{
    uint64_t rng = test_seed();
    int64_t wholes = 0;
    const int layouts[][2] = {{1, 1}, {2, 1}, {4, 1}, {8, 1}, {2, 2}, {4, 2}, {8, 2}, {8, 4}, {8, 8}};
    for (int li = 0; li < (int)(sizeof(layouts) / sizeof(layouts[0])); li++) {
        for (int trial = 0; trial < 10; trial++) {
            const int W = layouts[li][0], tp = layouts[li][1], G = W / tp, k = 1 + (int)(cometi_rand_next(&rng) % 4);
            const int per = 1 + (int)(cometi_rand_next(&rng) % 4), E = G * per, kk = k < E ? k : E;
            int32_t *ids[8];
            int m[8];
            int64_t *counts = calloc((size_t)W * E, sizeof(int64_t));
            for (int r = 0; r < W; r++) {
                m[r] = (int)(cometi_rand_next(&rng) % 300);
                ids[r] = malloc(sizeof(int32_t) * ((size_t)m[r] * kk + 1));
                float *w = malloc(sizeof(float) * ((size_t)m[r] * kk + 1));
                cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m[r], kk, E, rng + trial, r, ids[r], w);
                free(w);
                cometi_route_count(ids[r], m[r], kk, E, counts + (size_t)r * E);
            }
            cometi_route_plan_t p;
            char err[256];
            CHECK_EQ(cometi_route_plan_build(&p, counts, W, tp, E, 128, err, sizeof(err)), 0);
            int32_t *c32 = malloc(sizeof(int32_t) * W * E), *so32 = malloc(sizeof(int32_t) * W * E),
                    *ro32 = malloc(sizeof(int32_t) * W * E);
            for (int i = 0; i < W * E; i++)
                c32[i] = (int32_t)p.counts[i], so32[i] = (int32_t)p.send_offset[i], ro32[i] = (int32_t)p.recv_offset[i];
            /* hits[s][slot]: how often the owner s's slot was written this call */
            unsigned char *hits[8];
            for (int s = 0; s < W; s++) hits[s] = calloc((size_t)m[s] * kk * tp + 1, 1);
            for (int s = 0; s < W; s++) {
                int64_t *send_pos = malloc(sizeof(int64_t) * ((size_t)m[s] * kk + 1));
                int64_t *recv_pos = malloc(sizeof(int64_t) * ((size_t)m[s] * kk + 1));
                cometi_route_positions(&p, s, ids[s], m[s], kk, send_pos, recv_pos);
                for (int i = 0; i < m[s] * kk; i++) {
                    const int e = ids[s][i], g = e / per;
                    for (int t = 0; t < tp; t++) { /* every rank of the group, each from its own rank first */
                        const int r = g * tp + t;
                        int64_t slot = -1;
                        const int src = cometi_push_slot(c32, so32, ro32, W, E, e, recv_pos[i] - p.seg_start[e], tp,
                                                         t, r, &slot);
                        CHECK_EQ(src, s);
                        CHECK_EQ(slot, send_pos[i] * tp + t);
                        CHECK(slot >= 0 && slot < (int64_t)m[s] * kk * tp);
                        hits[s][slot]++;
                    }
                }
                free(send_pos), free(recv_pos);
            }
            for (int s = 0; s < W; s++)
                for (int64_t i = 0; i < (int64_t)m[s] * kk * tp; i++) CHECK_EQ(hits[s][i], 1);
            /* Padding rows of a segment (past its rows, before the next 128-row boundary) go nowhere. */
            for (int e = 0; e < E; e++) {
                int64_t slot;
                const int64_t padded = (p.seg_rows[e] + 127) / 128 * 128;
                for (int64_t q = p.seg_rows[e]; q < padded; q++)
                    CHECK_EQ(cometi_push_slot(c32, so32, ro32, W, E, e, q, tp, 0, 0, &slot), -1);
            }
            const int64_t w = whole_parts_checked(&p, c32, so32, ro32, W, tp, E, per, m, kk);
            if (w < 0) printf("layout %d x tp %d, trial %d: a whole part is not one chunk\n", W / tp, tp, trial);
            CHECK(w >= 0);
            wholes += w;
            for (int s = 0; s < W; s++) free(hits[s]), free(ids[s]);
            free(c32), free(so32), free(ro32), free(counts);
            cometi_route_plan_free(&p);
        }
    }
    CHECK(wholes > 0); /* the shortcut was exercised */
    return 0;
}

int test_route_count_rejects_bad_ids(void)
{
    const int32_t ids[6] = {0, 1, 2, 8, -1, 3};
    int64_t counts[8] = {0};
    CHECK_EQ(cometi_route_count(ids, 3, 2, 8, counts), 3);
    CHECK_EQ(counts[0] + counts[1] + counts[2] + counts[3], 4);
    return 0;
}

/* Layer1's per-token slots: known answers, then on random routings every valid choice is
 * in exactly one lead's chain, and the leads' slots are 0..(distinct ranks - 1). */
int test_choice_slots(void)
{
    int next;
    /* E = 8 on 2 ranks (4 each): choices on ranks 1, 0, 1, 0. */
    const int32_t a[4] = {5, 1, 6, 2};
    CHECK_EQ(cometi_choice_slot(a, 4, 0, 8, 4, &next), 0);
    CHECK_EQ(next, 2);
    CHECK_EQ(cometi_choice_slot(a, 4, 1, 8, 4, &next), 1);
    CHECK_EQ(next, 3);
    CHECK_EQ(cometi_choice_slot(a, 4, 2, 8, 4, &next), -1);
    CHECK_EQ(next, -1);
    CHECK_EQ(cometi_choice_slot(a, 4, 3, 8, 4, &next), -1);
    /* An invalid id takes no part: ranks -, 0, 1, 0. */
    const int32_t b[4] = {9, 3, 4, 0};
    CHECK_EQ(cometi_choice_slot(b, 4, 1, 8, 4, &next), 0);
    CHECK_EQ(next, 3);
    CHECK_EQ(cometi_choice_slot(b, 4, 2, 8, 4, &next), 1);
    CHECK_EQ(next, -1);
    CHECK_EQ(cometi_choice_slot(b, 4, 3, 8, 4, &next), -1);
    /* Ranks past 128 (one expert per rank): the slow path of the seen set. Ranks 200, 130,
     * 200, 5, 130. */
    const int32_t c[5] = {200, 130, 200, 5, 130};
    CHECK_EQ(cometi_choice_slot(c, 5, 0, 300, 1, &next), 0);
    CHECK_EQ(next, 2);
    CHECK_EQ(cometi_choice_slot(c, 5, 1, 300, 1, &next), 1);
    CHECK_EQ(next, 4);
    CHECK_EQ(cometi_choice_slot(c, 5, 2, 300, 1, &next), -1);
    CHECK_EQ(cometi_choice_slot(c, 5, 3, 300, 1, &next), 2);
    CHECK_EQ(next, -1);
    CHECK_EQ(cometi_choice_slot(c, 5, 4, 300, 1, &next), -1);
    uint64_t rng = test_seed();
    for (int it = 0; it < 20000; it++) { /* a quarter with ranks on both sides of 128 */
        const int world = it % 4 ? 1 + (int)(cometi_rand_next(&rng) % 8) : 100 + (int)(cometi_rand_next(&rng) % 100);
        const int per = 1 + (int)(cometi_rand_next(&rng) % 4);
        const int E = world * per, k = 1 + (int)(cometi_rand_next(&rng) % 8);
        int32_t ids[8];
        for (int j = 0; j < k; j++) ids[j] = (int32_t)(cometi_rand_next(&rng) % (uint64_t)(E + 1)); /* E: invalid */
        int reached[8] = {0}, slot_seen[8] = {0}, leads = 0, distinct = 0;
        for (int j = 0; j < k; j++) {
            if (ids[j] >= E) continue;
            int first = 1;
            for (int i = 0; i < j; i++) first &= !(ids[i] < E && ids[i] / per == ids[j] / per);
            distinct += first;
            const int slot = cometi_choice_slot(ids, k, j, E, per, &next);
            if (slot < 0) continue;
            leads++;
            CHECK_EQ(slot, distinct - 1); /* the order of the ranks' first choices */
            CHECK(slot < (k < world ? k : world) && !slot_seen[slot]);
            slot_seen[slot] = 1;
            for (int c = j; c >= 0; cometi_choice_slot(ids, k, c, E, per, &next), c = next) {
                CHECK(ids[c] < E && ids[c] / per == ids[j] / per && !reached[c]);
                reached[c] = 1;
            }
        }
        CHECK_EQ(leads, distinct);
        CHECK_EQ(cometi_token_ranks(ids, k, E, per), distinct);
        for (int j = 0; j < k; j++) CHECK_EQ(reached[j], ids[j] < E);
    }
    return 0;
}
