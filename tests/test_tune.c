/*
 * test_tune.c - the fused path's settings (no GPU needed): the cost model's picks on the
 * presets and the limits it keeps on any shape, and the tuning file (lookup, update, and
 * errors that name the line and the field).
 */
#define _GNU_SOURCE
#include <unistd.h>

#include "comet.h"
#include "../src/internal.h"
#include "../src/plan.h"
#include "../src/kernels/gemm.h"
#include "../src/tune.h"
#include "testutil.h"

/* The cost model picks, on 2 x H200 (132 SMs) at 8192 tokens, settings the bench's sweeps
 * found best or within noise of it (the push on every preset); on any shape, settings the
 * layers accept. */
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
    /* EP 1 x TP 2: every row copied to both ranks, the push always (the sweeps' best counts:
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

/* The first wave and the head, the rules the dispatch -> GEMM operator follows (tune.h):
 * on 132 SMs with 8 dispatch blocks, qwen2-57b-a14b's 20 column tiles give 5 row blocks
 * and qwen2-moe-2.7b's 11 give 9; phi-3.5-moe's 50 would give 2 and mixtral-8x7b's 112
 * none, under the 4 where a wave pays. */
int test_first_wave_and_head_rules(void)
{
    CHECK_EQ(cometi_first_wave_blocks(0, 1, 1, 132, 8, 20), 5);
    CHECK_EQ(cometi_first_wave_blocks(0, 1, 1, 132, 8, 11), 9);
    CHECK_EQ(cometi_first_wave_blocks(0, 1, 1, 132, 8, 50), 0);
    CHECK_EQ(cometi_first_wave_blocks(0, 1, 1, 132, 8, 112), 0);
    CHECK_EQ(cometi_first_wave_blocks(2, 1, 1, 132, 8, 112), 2);   /* asked for: taken */
    CHECK_EQ(cometi_first_wave_blocks(-1, 1, 1, 132, 8, 20), 0);   /* none */
    CHECK_EQ(cometi_first_wave_blocks(0, 0, 1, 132, 8, 20), 0);    /* COMET_FIRST_WAVE=0 */
    CHECK_EQ(cometi_first_wave_blocks(3, 0, 1, 132, 8, 20), 0);
    CHECK_EQ(cometi_first_wave_blocks(0, 1, 2, 132, 8, 20), 0);    /* TP: none */
    CHECK_EQ(cometi_first_wave_blocks(0, 1, 1, 40, 8, 1), 0);      /* no SM left for it */
    CHECK_EQ(cometi_first_wave_blocks(0, 1, 1, 41, 8, 1), 9);
    /* The head: the rows of two waves of tiles, 2 x (group_m + ceil(blocks / column tiles)). */
    CHECK_EQ(cometi_head_pieces(1, 8, 124, 20), 2 * (8 + 7));
    CHECK_EQ(cometi_head_pieces(1, 8, 124, 112), 2 * (8 + 2));
    CHECK_EQ(cometi_head_pieces(1, 8, 124, 1), COMETI_DISPATCH_HEAD_MAX_PIECES);
    CHECK_EQ(cometi_head_pieces(2, 8, 124, 20), 0);
    for (int tiles = 1; tiles < 300; tiles++)
        for (int blocks = 1; blocks <= 132; blocks += 13) {
            const int h = cometi_head_pieces(1, 8, blocks, tiles);
            CHECK(h >= 2 && h <= COMETI_DISPATCH_HEAD_MAX_PIECES);
        }
    return 0;
}
