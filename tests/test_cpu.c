/*
 * test_cpu.c - tests that need no GPU: status strings, config validation, the
 * routing plan (known answers and random invariants), bf16 rounding, synthetic
 * routing, the float64 reference, the fused path's settings (cost model, tuning file),
 * the launcher, and argument checks at the API.
 */
#define _GNU_SOURCE
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "comet.h"
#include "../src/internal.h"
#include "../src/launch.h"
#include "../src/plan.h"
#include "../src/timeline.h"
#include "../src/kernels/gemm.h"
#include "../src/tune.h"
#include "testutil.h"

int test_status_strings(void)
{
    for (int s = COMET_SUCCESS; s <= COMET_INTERNAL_ERROR; s++) {
        const char *str = comet_status_string((comet_status_t)s);
        CHECK(strncmp(str, "COMET_", 6) == 0);
        for (int q = COMET_SUCCESS; q < s; q++) CHECK(strcmp(str, comet_status_string((comet_status_t)q)) != 0);
    }
    CHECK_CONTAINS(comet_status_string((comet_status_t)1234), "unknown");
    CHECK_CONTAINS(comet_status_string(COMET_TIMEOUT), "COMET_TIMEOUT");
    CHECK_CONTAINS(comet_version_string(), "NCCL 2.");
    return 0;
}

int test_config_presets(void)
{
    struct { const char *name; int e, k, h, f; } want[] = {
        {"mixtral-8x7b", 8, 2, 4096, 14336}, {"phi-3.5-moe", 16, 2, 4096, 6400},
        {"qwen2-57b-a14b", 64, 8, 3584, 2560}, {"qwen2-moe-2.7b", 64, 4, 2048, 1408}, {"tiny", 8, 2, 256, 192}};
    int n = 0;
    while (comet_moe_preset_name(n)) n++;
    CHECK_EQ(n, 5);
    for (int i = 0; i < 5; i++) {
        comet_moe_config_t c;
        CHECK_EQ(comet_moe_config_preset(want[i].name, 8192, &c), COMET_SUCCESS);
        CHECK_EQ(c.num_experts, want[i].e);
        CHECK_EQ(c.top_k, want[i].k);
        CHECK_EQ(c.hidden, want[i].h);
        CHECK_EQ(c.ffn, want[i].f);
        CHECK_EQ(c.max_tokens, 8192);
        for (int world = 1; world <= 8; world *= 2) {
            char msg[256];
            CHECK_EQ(comet_moe_config_validate(&c, world, msg, sizeof(msg)), COMET_SUCCESS);
        }
    }
    comet_moe_config_t c;
    CHECK_EQ(comet_moe_config_preset("mixtral", 8192, &c), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "unknown preset \"mixtral\"");
    CHECK_CONTAINS(comet_last_create_error(), "qwen2-moe-2.7b");
    return 0;
}

int test_config_validation(void)
{
    comet_moe_config_t base;
    CHECK_EQ(comet_moe_config_preset("tiny", 512, &base), COMET_SUCCESS);
    struct {
        const char *field;
        int value, world;
        comet_status_t status;
        const char *message;
    } cases[] = {
        {"hidden", 100, 2, COMET_INVALID_ARGUMENT, "config.hidden = 100"},
        {"hidden", 0, 2, COMET_INVALID_ARGUMENT, "config.hidden = 0"},
        {"ffn", -64, 2, COMET_INVALID_ARGUMENT, "config.ffn = -64"},
        {"num_experts", 7, 2, COMET_INVALID_ARGUMENT, "config.num_experts = 7: must be divisible by ep_size = 2"},
        {"num_experts", 5000, 2, COMET_INVALID_ARGUMENT, "config.num_experts = 5000"},
        {"top_k", 9, 2, COMET_INVALID_ARGUMENT, "config.top_k = 9: must be 1..min(num_experts = 8"},
        {"top_k", 0, 2, COMET_INVALID_ARGUMENT, "config.top_k = 0"},
        {"max_tokens", 0, 2, COMET_INVALID_ARGUMENT, "config.max_tokens = 0"},
        {"ep_size", 3, 2, COMET_INVALID_ARGUMENT, "config.ep_size = 3 x tp_size = 1 = 3: must equal the world size 2"},
        {"tp_size", 3, 2, COMET_INVALID_ARGUMENT, "config.tp_size = 3: must divide the world size 2"},
        {"tp_size", 2, 2, COMET_INVALID_ARGUMENT, "config.ffn = 192: must be a multiple of 64 x tp_size = 128"},
        {"dtype", 5, 2, COMET_INVALID_ARGUMENT, "config.dtype = 5"},
        {"world", 0, 0, COMET_INVALID_ARGUMENT, "world size 0"},
        {"size", 3, 2, COMET_INVALID_ARGUMENT, "COMET_MOE_CONFIG_INIT"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        comet_moe_config_t c = base;
        const char *f = cases[i].field;
        int v = cases[i].value;
        if (!strcmp(f, "hidden")) c.hidden = v;
        else if (!strcmp(f, "ffn")) c.ffn = v;
        else if (!strcmp(f, "num_experts")) c.num_experts = v;
        else if (!strcmp(f, "top_k")) c.top_k = v;
        else if (!strcmp(f, "max_tokens")) c.max_tokens = v;
        else if (!strcmp(f, "ep_size")) c.ep_size = v;
        else if (!strcmp(f, "tp_size")) c.tp_size = v;
        else if (!strcmp(f, "dtype")) c.dtype = (comet_dtype_t)v;
        else if (!strcmp(f, "size")) c.size = (size_t)v;
        char msg[512] = "";
        comet_status_t st = comet_moe_config_validate(&c, cases[i].world, msg, sizeof(msg));
        if (st != cases[i].status) printf("case %zu (%s = %d): %s\n", i, f, v, msg);
        CHECK_EQ(st, cases[i].status);
        CHECK_CONTAINS(msg, cases[i].message);
    }
    char msg[64];
    CHECK_EQ(comet_moe_config_validate(NULL, 2, msg, sizeof(msg)), COMET_INVALID_ARGUMENT);
    /* EP x TP layouts the world allows: 1 x 2, and 2 x 2 of 4 (ffn 256: 128 columns per TP rank). */
    comet_moe_config_t tp2 = base;
    tp2.ffn = 256;
    tp2.tp_size = 2;
    CHECK_EQ(comet_moe_config_validate(&tp2, 2, msg, sizeof(msg)), COMET_SUCCESS);
    CHECK_EQ(comet_moe_config_validate(&tp2, 4, msg, sizeof(msg)), COMET_SUCCESS);
    tp2.ep_size = 2;
    CHECK_EQ(comet_moe_config_validate(&tp2, 2, msg, sizeof(msg)), COMET_INVALID_ARGUMENT);
    /* A huge max_tokens with many ranks and a large top_k overflows the row index. */
    comet_moe_config_t c = base;
    c.max_tokens = 1 << 20;
    c.num_experts = 72;
    c.top_k = 32;
    char big[512];
    CHECK_EQ(comet_moe_config_validate(&c, 72, big, sizeof(big)), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(big, "config.max_tokens = 1048576");
    return 0;
}

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

/* The cost model picks, on 2 x H200 (132 SMs) at 8192 tokens, settings the sweeps of
 * docs/PERF.md (runs L6-L8; U3 for phi's push, V4 for mixtral's) found best or within
 * noise of it; on any shape, settings the layers accept. */
int test_cost_model_knobs(void)
{
    static const struct {
        const char *preset;
        int dispatch, combine, splits, tail, push;
    } want[] = {{"mixtral-8x7b", 4, 0, 1, 0, 1},
                {"phi-3.5-moe", 4, 0, 1, 0, 1},
                {"qwen2-57b-a14b", 10, 0, 1, 0, 1},
                {"qwen2-moe-2.7b", 16, 0, 1, 0, 1}};
    for (int i = 0; i < 4; i++) {
        comet_moe_config_t cfg;
        CHECK_EQ(comet_moe_config_preset(want[i].preset, 8192, &cfg), COMET_SUCCESS);
        cometi_knobs_t k;
        cometi_model_knobs(&cfg, 2, 132, &k);
        printf("%-16s dispatch %d %s, combine %d x %d splits%s%s\n", want[i].preset, k.l0.dispatch_blocks,
               k.l0.dispatch_mode == COMETI_DISPATCH_BULK ? "bulk" : "stores", k.l1.combine_blocks, k.l1.n_splits,
               k.l1.tail ? ", tail" : "", k.l1.push ? ", push" : "");
        CHECK_EQ(k.l0.dispatch_blocks, want[i].dispatch);
        CHECK_EQ(k.l0.dispatch_mode, COMETI_DISPATCH_BULK);
        CHECK_EQ(k.l1.combine_blocks, want[i].combine);
        CHECK_EQ(k.l1.n_splits, want[i].splits);
        CHECK_EQ(k.l1.tail, want[i].tail);
        CHECK_EQ(k.l1.push, want[i].push);
    }
    /* EP 1 x TP 2: every row copied to both ranks, the push always (run T3's best counts:
     * mixtral 6-8, phi and qwen2-57b 16 or more, the most the sweep tried). */
    static const struct { const char *preset; int dispatch; } want_tp[] = {
        {"mixtral-8x7b", 8}, {"phi-3.5-moe", 14}, {"qwen2-57b-a14b", 24}};
    for (int i = 0; i < 3; i++) {
        comet_moe_config_t cfg;
        CHECK_EQ(comet_moe_config_preset(want_tp[i].preset, 8192, &cfg), COMET_SUCCESS);
        cfg.tp_size = 2;
        cometi_knobs_t k;
        cometi_model_knobs(&cfg, 2, 132, &k);
        printf("%-16s TP 2: dispatch %d, push %d\n", want_tp[i].preset, k.l0.dispatch_blocks, k.l1.push);
        CHECK_EQ(k.l0.dispatch_blocks, want_tp[i].dispatch);
        CHECK_EQ(k.l1.push, 1);
    }
    uint64_t rng = test_seed();
    for (int it = 0; it < 10000; it++) {
        comet_moe_config_t cfg = COMET_MOE_CONFIG_INIT;
        cfg.hidden = 128 * (1 + (int)(cometi_rand_next(&rng) % 64));
        cfg.ffn = 128 * (1 + (int)(cometi_rand_next(&rng) % 128));
        cfg.num_experts = 8 << (cometi_rand_next(&rng) % 5);
        cfg.top_k = 1 + (int)(cometi_rand_next(&rng) % 8);
        cfg.max_tokens = 1 + (int)(cometi_rand_next(&rng) % 65536);
        const int world = 1 << (cometi_rand_next(&rng) % 4), sms = 16 + (int)(cometi_rand_next(&rng) % 132);
        cfg.tp_size = 1 << (cometi_rand_next(&rng) % 4);
        if (cfg.tp_size > world) cfg.tp_size = world;
        cometi_knobs_t k;
        cometi_model_knobs(&cfg, world, sms, &k);
        const int tiles = cfg.hidden / cometi_gemm_tile_n(cfg.hidden);
        CHECK(k.l0.dispatch_blocks >= 1 && k.l0.dispatch_blocks < sms);
        CHECK(k.l1.combine_blocks >= 0 && k.l1.combine_blocks < sms);
        CHECK(k.l1.n_splits >= 1 && k.l1.n_splits <= COMETI_MAX_SPLITS && tiles % k.l1.n_splits == 0);
        CHECK(k.l1.combine_blocks > 0 || k.l1.tail || k.l1.push);
        CHECK(!k.l1.push || (k.l1.combine_blocks == 0 && k.l1.n_splits == 1 && world > 1));
        CHECK(cfg.tp_size == 1 || k.l1.push); /* only the push sums TP partials */
    }
    return 0;
}

/* The tuning file: the matching line with the closest max_tokens, a round trip through
 * cometi_tuning_line, no match, and errors that name the line and the field. */
int test_tuning_file(void)
{
    char path[64], err[256];
    snprintf(path, sizeof(path), "/tmp/comet_test_tuning_%d", (int)getpid());
    comet_moe_config_t cfg;
    CHECK_EQ(comet_moe_config_preset("qwen2-moe-2.7b", 8192, &cfg), COMET_SUCCESS);
    cometi_knobs_t k, back;
    cometi_model_knobs(&cfg, 2, 132, &k);
    k.l0.dispatch_blocks = 12;
    char line[160];
    cometi_tuning_line(&cfg, 2, &k, line, sizeof(line));
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fprintf(f, "# comet tuning file\n\n2 64 4 2048 1408 2048 : 6 stores 0 1 static tail  # fewer tokens\n%s\n"
               "2 64 4 2048 1408 65536 : 20 bulk 8 4 dynamic notail\n4 64 4 2048 1408 8192 : 9 bulk 0 1 dynamic tail\n",
            line);
    fclose(f);
    memset(&back, 0, sizeof(back));
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), 1);
    CHECK(memcmp(&k, &back, sizeof(k)) == 0); /* 8192 is closest to 8192 */
    cfg.max_tokens = 3000;                      /* closest: 2048 */
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), 1);
    CHECK_EQ(back.l0.dispatch_blocks, 6);
    CHECK_EQ(back.l0.dispatch_mode, COMETI_DISPATCH_STORES);
    CHECK_EQ(back.l1.dynamic_tiles, 0);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 8, &back, err, sizeof(err)), 0); /* no line for 8 GPUs */
    f = fopen(path, "a");
    fprintf(f, "2 64 4 2048 1408 8192 : 12 bulk -1 2 dynamic notail\n");
    fclose(f);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "line 7: field 9 (combine_blocks) = '-1'");
    f = fopen(path, "w");
    fprintf(f, "2 64 4 2048 1408 8192 : 12 bulk 24 2 dynamic\n");
    fclose(f);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "line 1: 11 fields, want 12");
    unlink(path);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "No such file");
    /* Updates: a new file, a second shape, then the first shape again: replaced, not added. */
    cfg.max_tokens = 8192;
    CHECK_EQ(cometi_tuning_update(path, &cfg, 2, &k, err, sizeof(err)), 0);
    comet_moe_config_t other = cfg;
    other.max_tokens = 1024;
    cometi_knobs_t k2 = k;
    k2.l0.dispatch_blocks = 2;
    CHECK_EQ(cometi_tuning_update(path, &other, 2, &k2, err, sizeof(err)), 0);
    k.l0.dispatch_blocks = 20;
    CHECK_EQ(cometi_tuning_update(path, &cfg, 2, &k, err, sizeof(err)), 0);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), 1);
    CHECK(memcmp(&k, &back, sizeof(k)) == 0);
    CHECK_EQ(cometi_tuning_lookup(path, &other, 2, &back, err, sizeof(err)), 1);
    CHECK_EQ(back.l0.dispatch_blocks, 2);
    f = fopen(path, "r");
    int lines = 0, comments = 0;
    while (fgets(line, sizeof(line), f)) lines++, comments += line[0] == '#';
    fclose(f);
    CHECK_EQ(lines, 3); /* the header, one line per shape */
    CHECK_EQ(comments, 1);
    /* Layer1's push is a word of its own in the last field, and comes back as written. */
    cometi_knobs_t kp = k;
    kp.l1.combine_blocks = 0, kp.l1.n_splits = 1, kp.l1.tail = 0, kp.l1.push = 1;
    comet_moe_config_t third = cfg;
    third.max_tokens = 4096;
    cometi_tuning_line(&third, 2, &kp, line, sizeof(line));
    CHECK_CONTAINS(line, ": 20 bulk 0 1 dynamic push");
    CHECK_EQ(cometi_tuning_update(path, &third, 2, &kp, err, sizeof(err)), 0);
    memset(&back, 0, sizeof(back));
    CHECK_EQ(cometi_tuning_lookup(path, &third, 2, &back, err, sizeof(err)), 1);
    CHECK(memcmp(&kp, &back, sizeof(kp)) == 0);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), 1);
    CHECK(memcmp(&k, &back, sizeof(k)) == 0); /* the other shape keeps its own line */
    /* TP: the world field carries it ("2tp2"); a TP line is its own key, next to EP's. */
    comet_moe_config_t tp2 = cfg;
    tp2.tp_size = 2;
    cometi_knobs_t kt = kp;
    kt.l0.dispatch_blocks = 14;
    cometi_tuning_line(&tp2, 2, &kt, line, sizeof(line));
    CHECK_CONTAINS(line, "2tp2 64 4 2048 1408 8192 : 14 bulk");
    CHECK_EQ(cometi_tuning_update(path, &tp2, 2, &kt, err, sizeof(err)), 0);
    CHECK_EQ(cometi_tuning_lookup(path, &tp2, 2, &back, err, sizeof(err)), 1);
    CHECK(memcmp(&kt, &back, sizeof(kt)) == 0);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), 1);
    CHECK(memcmp(&k, &back, sizeof(k)) == 0); /* EP's line untouched */
    tp2.tp_size = 1; /* resolved 1 is the plain key */
    CHECK_EQ(cometi_tuning_lookup(path, &tp2, 2, &back, err, sizeof(err)), 1);
    CHECK(memcmp(&k, &back, sizeof(k)) == 0);
    f = fopen(path, "a");
    fprintf(f, "2tp3 64 4 2048 1408 8192 : 12 bulk 0 1 dynamic push\n");
    fclose(f);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "field 1 (world[tpT]) = '2tp3'");
    /* Settings layer1 would refuse after layer0 had run: refused when the file is read. */
    f = fopen(path, "w");
    fprintf(f, "2tp2 64 4 2048 1408 8192 : 12 bulk 0 1 dynamic tail\n");
    fclose(f);
    tp2.tp_size = 2;
    CHECK_EQ(cometi_tuning_lookup(path, &tp2, 2, &back, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "line 1: tp 2 with layer1 'tail': only the push");
    f = fopen(path, "w");
    fprintf(f, "2 64 4 2048 1408 8192 : 12 bulk 8 2 dynamic push\n");
    fclose(f);
    CHECK_EQ(cometi_tuning_lookup(path, &cfg, 2, &back, err, sizeof(err)), -1);
    CHECK_CONTAINS(err, "line 1: push with 8 combine blocks and 2 splits");
    unlink(path);
    return 0;
}

/* A tile timeline made by hand: a dispatch block that waits for rows, a GEMM block with
 * launch skew and a tail, a row left zero (a combine block); the parts add up to the span
 * on every block, a block past the recorded tiles is counted, a bad row is named. */
int test_timeline_accounting(void)
{
    enum { W = COMETI_TILE_TRACE_WORDS };
    unsigned long long *t = calloc(3 * W, sizeof(unsigned long long));
    CHECK(t);
    /* block 0: starts at 1000, dispatches until 5000; tile 7 ready at once, done at 9000;
     * tile 9 taken at 6000, its rows ready at 12000, done at 15000; ends at 15100. */
    unsigned long long b0[] = {1000, 5000, 2, 15100, 7, 5000, 5000, 9000, 9, 6000, 12000, 15000};
    /* block 1: starts at 1200, three tiles of 4000 us, the first one's rows at 1300. */
    unsigned long long b1[] = {1200, 0, 3, 13400, 0, 1200, 1300, 5300, 2, 5000, 5000, 9300, 4, 9000, 9300, 13300};
    memcpy(t, b0, sizeof(b0));
    memcpy(t + W, b1, sizeof(b1));
    char err[COMETI_ERR_LEN] = "";
    cometi_timeline_t s;
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_SUCCESS);
    CHECK_EQ(s.blocks, 2);
    CHECK_EQ(s.tiles, 5);
    CHECK_EQ(s.truncated, 0);
    CHECK_NEAR(s.span_us, 14.1, 1e-9);
    CHECK_NEAR(s.launch_us, 0.1, 1e-9);   /* (0 + 200) / 2 ns */
    CHECK_NEAR(s.dispatch_us, 2.0, 1e-9); /* (4000 + 0) / 2 */
    CHECK_NEAR(s.wait_us, 1.55, 1e-9);    /* (3000 + 100) / 2 */
    CHECK_NEAR(s.first_wait_us, 0.05, 1e-9); /* (0 + 100) / 2 */
    CHECK_NEAR(s.tiles_us, 9.5, 1e-9);    /* (7000 + 12000) / 2 */
    CHECK_NEAR(s.tail_us, 0.95, 1e-9);    /* (100 + 1800) / 2 */
    CHECK_NEAR(s.launch_us + s.dispatch_us + s.wait_us + s.tiles_us + s.tail_us, s.span_us, 1e-9);
    CHECK_NEAR(s.tile_us, 3.8, 1e-9);
    /* Block 1 took more tiles than its row holds: the rest, to its end, counts as tiles. */
    t[W + 2] = COMETI_TILE_TRACE_TILES + 5;
    for (int i = 3; i < COMETI_TILE_TRACE_TILES; i++) { /* tiles 3.. of 100 ns each, from 13300 */
        t[W + 4 + 4 * i + 2] = 13300 + 100ull * (i - 3);
        t[W + 4 + 4 * i + 3] = 13300 + 100ull * (i - 2);
    }
    t[W + 3] = 13300 + 100ull * (COMETI_TILE_TRACE_TILES - 3) + 500; /* 5 untraced tiles */
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_SUCCESS);
    CHECK_EQ(s.truncated, 1);
    CHECK_EQ(s.tiles, 2 + COMETI_TILE_TRACE_TILES + 5);
    CHECK_NEAR(s.launch_us + s.dispatch_us + s.wait_us + s.tiles_us + s.tail_us, s.span_us, 1e-9);
    /* A tile that ends before its rows were ready. */
    t[W + 2] = 3;
    t[W + 3] = 13400;
    t[W + 4 + 3] = 1250;
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "block 1's tile 0");
    memset(t, 0, 3 * W * sizeof(unsigned long long));
    CHECK_EQ(cometi_timeline_summarize(err, t, 3, &s), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "no block");
    free(t);
    return 0;
}

/* The last wave's cut: known answers (skewed mixtral's GEMM1 on the hot rank: 416 tiles on
 * 132 blocks; balanced mixtral's: 2048), the cases that cut nothing, and on random inputs
 * the plan's promises against every other choice of parts. */
int test_gemm_tail_plan(void)
{
    cometi_tail_plan_t s = cometi_gemm_tail_plan(416, 132, 224, 1);
    CHECK_EQ(s.first, 396);
    CHECK_EQ(s.parts, 4);
    CHECK_EQ(s.units, 396 + 20 * 4);
    s = cometi_gemm_tail_plan(14, 6, 32, 1); /* 2 left over on 6 blocks: 3 parts each */
    CHECK_EQ(s.first, 12);
    CHECK_EQ(s.parts, 3);
    CHECK_EQ(s.units, 18);
    s = cometi_gemm_tail_plan(5, 132, 16, 1); /* under one wave; k allows 2 parts */
    CHECK_EQ(s.first, 0);
    CHECK_EQ(s.parts, 2);
    CHECK_EQ(s.units, 10);
    s = cometi_gemm_tail_plan(2048, 132, 224, 1); /* 68 left over: 204 thirds in 2 rounds */
    CHECK_EQ(s.first, 1980);
    CHECK_EQ(s.parts, 3);
    CHECK_EQ(s.units, 1980 + 68 * 3);
    s = cometi_gemm_tail_plan(14336, 132, 64, 1); /* mixtral's GEMM0: 80 left over, in thirds */
    CHECK_EQ(s.first, 14256);
    CHECK_EQ(s.parts, 3);
    CHECK_EQ(s.units, 14256 + 80 * 3);
    const int none[][4] = {{130, 132, 224, 1},  /* nearly full: no count of parts shortens it */
                           {95, 132, 224, 1},   /* 0.72 full: quarters need 285 partials, 264 slots */
                           {264, 132, 224, 1},  /* whole waves */
                           {5, 132, 8, 1},      /* k too short for two parts of 8 steps */
                           {100, 132, 16, 1},   /* 2 parts, the most k allows, take 2 rounds */
                           {416, 132, 224, 0},  /* off */
                           {0, 132, 224, 1},    {7, 0, 224, 1}};
    for (size_t i = 0; i < sizeof(none) / sizeof(none[0]); i++) {
        s = cometi_gemm_tail_plan(none[i][0], none[i][1], none[i][2], none[i][3]);
        CHECK_EQ(s.parts, 1);
        CHECK_EQ(s.first, none[i][0]);
        CHECK_EQ(s.units, none[i][0]);
    }
    uint64_t rng = test_seed();
    for (int it = 0; it < 100000; it++) {
        const int total = (int)(cometi_rand_next(&rng) % 5000), takers = 1 + (int)(cometi_rand_next(&rng) % 200),
                  k_blocks = 1 + (int)(cometi_rand_next(&rng) % 300), rest = total % takers;
        s = cometi_gemm_tail_plan(total, takers, k_blocks, 1);
        CHECK(s.parts >= 1 && s.parts <= COMETI_TAIL_MAX_PARTS);
        CHECK_EQ(s.units, s.first + (total - s.first) * s.parts);
        /* Every feasible count of parts (1: no cut) and the last wave's length in tiles. */
        double best = 1.0;
        for (int p = 2; p <= COMETI_TAIL_MAX_PARTS; p++)
            if (rest && p * COMETI_TAIL_MIN_KBLOCKS <= k_blocks && (size_t)rest * (p - 1) <= COMETI_GEMM_TAIL_SLOTS(takers)) {
                const double len = (double)((rest * p + takers - 1) / takers) / p;
                if (len < best) best = len;
            }
        if (s.parts == 1) {
            CHECK_EQ(s.first, total);
            CHECK(best == 1.0); /* nothing would have been shorter */
            continue;
        }
        CHECK_EQ(s.first % takers, 0);                               /* whole waves before the cut */
        CHECK_EQ(total - s.first, rest);
        CHECK(s.parts * COMETI_TAIL_MIN_KBLOCKS <= k_blocks);         /* every part long enough */
        CHECK((size_t)rest * (s.parts - 1) <= COMETI_GEMM_TAIL_SLOTS(takers)); /* partials fit */
        const int rounds = (rest * s.parts + takers - 1) / takers;
        CHECK(fabs((double)rounds / s.parts - best) < 1e-12);         /* the shortest */
        if (2 * rest <= takers) CHECK_EQ(rounds, 1);                  /* a wave at most half full: one round */
    }
    return 0;
}

int test_routing_generators(void)
{
    const int m = 4096, k = 2, E = 8;
    int32_t *ids = malloc(sizeof(int32_t) * m * k);
    float *w = malloc(sizeof(float) * m * k);
    uint64_t seed = test_seed();
    for (int kind = 0; kind < 4; kind++) {
        cometi_make_routing((cometi_routing_t)kind, kind == 3 ? 5 : 16.0, m, k, E, seed, 1, ids, w);
        int64_t counts[8] = {0};
        CHECK_EQ(cometi_route_count(ids, m, k, E, counts), -1);
        for (int t = 0; t < m; t++) {
            CHECK(ids[t * k] != ids[t * k + 1]); /* distinct experts per token */
            CHECK_NEAR(w[t * k] + w[t * k + 1], 1.0, 1e-6);
            CHECK(w[t * k] > 0 && w[t * k + 1] > 0);
        }
        if (kind == COMETI_ROUTING_BALANCED)
            for (int e = 0; e < E; e++) CHECK_EQ(counts[e], m * k / E);
        if (kind == COMETI_ROUTING_SKEWED) CHECK(counts[0] > 4 * counts[E - 1]);
        if (kind == COMETI_ROUTING_ONE_EXPERT) CHECK(counts[5] == m);
    }
    /* Same seed, same routing; another seed, another routing. */
    int32_t *again = malloc(sizeof(int32_t) * m * k);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, E, seed, 0, ids, w);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, E, seed, 0, again, w);
    CHECK(memcmp(ids, again, sizeof(int32_t) * m * k) == 0);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, m, k, E, seed + 1, 0, again, w);
    CHECK(memcmp(ids, again, sizeof(int32_t) * m * k) != 0);
    free(again);
    free(ids);
    free(w);
    return 0;
}

int test_reference_known_answer(void)
{
    /* H = 2, F = 1, two experts, computed by hand:
     * expert 0: g = [1 0].x = 1, u = [0 1].x = 2, a = 2 silu(1), out = [a, -a]
     * expert 1: g = [0 .5].x = 1, u = [1 1].x = 3, a = 3 silu(1), out = [2a, 0] */
    const float x[2] = {1, 2};
    const int32_t ids[2] = {0, 1};
    const float w[2] = {0.25f, 0.75f};
    const float gate_up[2 * 2 * 2] = {1, 0, /* up */ 0, 1, /* expert 1 gate */ 0, 0.5f, /* up */ 1, 1};
    const float down[2 * 2 * 1] = {1, -1, /* expert 1 */ 2, 0};
    cometi_ref_problem_t p = {2, 1, 2, 2, 1, x, ids, w, gate_up, down};
    double y[2];
    cometi_reference_moe(&p, y);
    const double silu1 = 1.0 / (1.0 + exp(-1.0));
    CHECK_NEAR(silu1, 0.7310585786300049, 1e-15);
    CHECK_NEAR(y[0], 0.25 * 2 * silu1 + 0.75 * 2 * 3 * silu1, 1e-12);
    CHECK_NEAR(y[0], 3.655292893150024, 1e-12);
    CHECK_NEAR(y[1], -0.3655292893150024, 1e-12);
    CHECK_NEAR(cometi_swiglu(0.0, 5.0), 0.0, 0);
    return 0;
}

int test_reference_properties(void)
{
    const int H = 64, F = 64, E = 4, k = 2, M = 16;
    uint64_t rng = test_seed();
    float *x = malloc(sizeof(float) * M * H), *gu = malloc(sizeof(float) * E * 2 * F * H),
          *dn = malloc(sizeof(float) * E * H * F), *w = malloc(sizeof(float) * M * k),
          *w2 = malloc(sizeof(float) * M * k);
    int32_t *ids = malloc(sizeof(int32_t) * M * k);
    for (int i = 0; i < M * H; i++) x[i] = (float)(2 * cometi_rand_unit(&rng) - 1);
    for (int i = 0; i < E * 2 * F * H; i++) gu[i] = (float)((2 * cometi_rand_unit(&rng) - 1) / 8);
    for (int i = 0; i < E * H * F; i++) dn[i] = (float)((2 * cometi_rand_unit(&rng) - 1) / 8);
    cometi_make_routing(COMETI_ROUTING_RANDOM, 1, M, k, E, rng, 0, ids, w);
    double *y = malloc(sizeof(double) * M * H), *y2 = malloc(sizeof(double) * M * H);
    cometi_ref_problem_t p = {H, F, E, k, M, x, ids, w, gu, dn};
    cometi_reference_moe(&p, y);
    /* Linear in the routing weights: doubling them doubles y. */
    for (int i = 0; i < M * k; i++) w2[i] = 2 * w[i];
    p.topk_weights = w2;
    cometi_reference_moe(&p, y2);
    for (int i = 0; i < M * H; i++) CHECK_NEAR(y2[i], 2 * y[i], 1e-12 * (1 + fabs(y[i])));
    /* Each token on its own gives the same row: tokens do not interact. */
    p.topk_weights = w;
    for (int t = 0; t < M; t += 5) {
        cometi_ref_problem_t one = p;
        one.num_tokens = 1;
        one.x = x + (size_t)t * H;
        one.topk_ids = ids + (size_t)t * k;
        one.topk_weights = w + (size_t)t * k;
        cometi_reference_moe(&one, y2);
        for (int h = 0; h < H; h++) CHECK_NEAR(y2[h], y[(size_t)t * H + h], 1e-12);
    }
    /* rel_error: exact is 0, a NaN is infinite. */
    float *yf = malloc(sizeof(float) * M * H);
    for (int i = 0; i < M * H; i++) yf[i] = (float)y[i];
    CHECK(cometi_rel_error(yf, y, (size_t)M * H) < 1e-6);
    yf[7] = NAN;
    CHECK(isinf(cometi_rel_error(yf, y, (size_t)M * H)));
    free(x), free(gu), free(dn), free(w), free(w2), free(ids), free(y), free(y2), free(yf);
    return 0;
}

/* ---- launcher ---- */

typedef struct launch_probe {
    int rank_seen[8];
    int nranks_seen[8];
    unsigned char id[8][sizeof(ncclUniqueId)];
} launch_probe_t;

static int record_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    launch_probe_t *p = arg;
    p->rank_seen[ctx->rank] = ctx->rank + 100;
    p->nranks_seen[ctx->rank] = ctx->nranks;
    memcpy(p->id[ctx->rank], &ctx->id, sizeof(ncclUniqueId));
    return 0;
}

int test_launch_all_ranks_succeed(void)
{
    launch_probe_t *p = mmap(NULL, sizeof(*p), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    memset(p, 0, sizeof(*p));
    char report[512];
    int rc = cometi_launch_local(3, record_rank, p, 20, report, sizeof(report));
    if (rc) printf("report: %s\n", report);
    CHECK_EQ(rc, 0);
    for (int r = 0; r < 3; r++) {
        CHECK_EQ(p->rank_seen[r], r + 100);
        CHECK_EQ(p->nranks_seen[r], 3);
        CHECK(memcmp(p->id[r], p->id[0], sizeof(ncclUniqueId)) == 0);
    }
    static const unsigned char zero[sizeof(ncclUniqueId)];
    CHECK(memcmp(p->id[0], zero, sizeof(zero)) != 0);
    return 0;
}

static int rank1_fails(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    if (ctx->rank == 1) {
        cometi_rank_reason("boom: the test made rank 1 fail");
        return 3;
    }
    sleep(60); /* would hang the test if the launcher did not stop it */
    return 0;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int test_launch_failed_rank_stops_others(void)
{
    char report[512];
    double t0 = mono_s();
    int rc = cometi_launch_local(4, rank1_fails, NULL, 0, report, sizeof(report));
    double took = mono_s() - t0;
    printf("report: %s (%.2f s)\n", report, took);
    CHECK(rc != 0);
    CHECK_CONTAINS(report, "rank 1 of 4 failed (exit code 3): boom: the test made rank 1 fail");
    CHECK(took < 10);
    return 0;
}

static int rank2_crashes(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    if (ctx->rank == 2) raise(SIGSEGV);
    sleep(60);
    return 0;
}

int test_launch_crashed_rank_is_reported(void)
{
    char report[512];
    int rc = cometi_launch_local(3, rank2_crashes, NULL, 0, report, sizeof(report));
    printf("report: %s\n", report);
    CHECK(rc != 0);
    CHECK_CONTAINS(report, "rank 2 of 3 failed (killed by signal 11");
    return 0;
}

static int sleeps(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)ctx, (void)arg;
    sleep(60);
    return 0;
}

int test_launch_timeout_stops_ranks(void)
{
    char report[512];
    double t0 = mono_s();
    int rc = cometi_launch_local(2, sleeps, NULL, 1, report, sizeof(report));
    CHECK(rc != 0);
    CHECK_CONTAINS(report, "did not finish within 1 s");
    CHECK(mono_s() - t0 < 10);
    return 0;
}

static int returns_rank_plus_40(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    return 40 + ctx->rank + 10 * ctx->local_rank;
}

int test_launch_external_env(void)
{
    char report[512], path[256];
    unsetenv("RANK");
    setenv("WORLD_SIZE", "2", 1);
    CHECK_EQ(cometi_launch_external("/tmp/x", returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    CHECK_CONTAINS(report, "RANK=unset");
    snprintf(path, sizeof(path), "/tmp/comet_test_id_%d", (int)getpid());
    unlink(path);
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("LOCAL_RANK", "0", 1);
    CHECK_EQ(cometi_launch_external(NULL, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    CHECK_CONTAINS(report, "--id-file");
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 40);
    /* The id file is there now: a second rank 0 refuses to reuse it, a rank 1 reads it. */
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    CHECK_CONTAINS(report, "exists already");
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("LOCAL_RANK", "1", 1);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 51);
    unlink(path);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 1, report, sizeof(report)), 1);
    CHECK_CONTAINS(report, "did not appear within 1 s");
    /* A file from another run (another run id) is never taken for this run's. */
    setenv("RANK", "0", 1);
    setenv("LOCAL_RANK", "0", 1);
    setenv("COMET_RUN_ID", "run-a", 1);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 40);
    setenv("RANK", "1", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("COMET_RUN_ID", "run-b", 1);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 1, report, sizeof(report)), 1);
    CHECK_CONTAINS(report, "is from another run (its tag \"COMET_RUN_ID=run-a\", ours \"COMET_RUN_ID=run-b\")");
    setenv("COMET_RUN_ID", "run-a", 1);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 51);
    unlink(path);
    unsetenv("COMET_RUN_ID");
    return 0;
}

/* Argument checks that run before anything touches a GPU. */
int test_api_rejects_bad_arguments(void)
{
    comet_comm_t comm = (comet_comm_t)0x1;
    CHECK_EQ(comet_comm_create(NULL, NULL, &comm), COMET_INVALID_ARGUMENT);
    CHECK(comm == NULL);
    CHECK_CONTAINS(comet_last_create_error(), "nccl communicator is NULL");
    CHECK_EQ(comet_comm_create((ncclComm_t)0x1, NULL, NULL), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "out is NULL");
    comet_comm_config_t bad = COMET_COMM_CONFIG_INIT;
    bad.timeout_ms = -5;
    CHECK_EQ(comet_comm_create((ncclComm_t)0x1, &bad, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "timeout_ms = -5");
    comet_comm_config_t raw;
    memset(&raw, 0, sizeof(raw));
    CHECK_EQ(comet_comm_create((ncclComm_t)0x1, &raw, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "COMET_COMM_CONFIG_INIT");
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    CHECK_EQ(comet_comm_create_from_id(&id, 2, 5, NULL, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "rank = 5: must be 0..nranks-1 = 1");
    CHECK_EQ(comet_comm_create_from_id(&id, 0, 0, NULL, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "nranks = 0");
    comet_moe_t moe = (comet_moe_t)0x1;
    comet_moe_config_t c = COMET_MOE_CONFIG_INIT;
    CHECK_EQ(comet_moe_create(NULL, &c, &moe), COMET_INVALID_ARGUMENT);
    CHECK(moe == NULL);
    CHECK_CONTAINS(comet_last_create_error(), "comm is NULL");
    CHECK_EQ(comet_moe_forward(NULL, NULL, 0), COMET_INVALID_ARGUMENT);
    CHECK_EQ(comet_comm_destroy(NULL), COMET_SUCCESS);
    CHECK_EQ(comet_moe_destroy(NULL), COMET_SUCCESS);
    CHECK_EQ(comet_comm_get_async_error(NULL), COMET_INVALID_ARGUMENT);
    return 0;
}
