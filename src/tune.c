/*
 * tune.c - the fused path's settings: the cost model, the tuning file, and the rules for
 * the first wave and the head. See tune.h.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tune.h"

/* Rates measured on H200 (2026-11-29): our grouped GEMM at 650-790 TFLOP/s
 * on the presets; dispatch blocks copy about 8 GB/s per SM beside the GEMM (the fewest
 * blocks that kept layer0 within noise of its best); the combine on every SM after GEMM1
 * reads its output at about 0.7 TB/s (134 MB in 188-290 us). */
#define MODEL_GEMM_FLOPS 700e12
#define MODEL_DISPATCH_BYTES_PER_SM 8e9
#define MODEL_TAIL_BYTES 0.7e12
/* The push (rows sent home from GEMM1's epilogue, summed by the owner after) beat the tail
 * where the tail reaches 0.39 and 0.71 of GEMM1 (qwen2-57b-a14b even, qwen2-moe-2.7b by
 * 1.47x), and it beat every setting with combine blocks beside the GEMM. Once its epilogue
 * sent whole parts as tensor stores it won at 0.16 too (phi-3.5-moe, 2%), and once the
 * other parts were stored from registers at 0.07 (mixtral-8x7b: 1.6% on the whole layer,
 * timed in turns). The threshold keeps the tail for shapes with even less to send. */
#define MODEL_PUSH_SHARE 0.05

static int clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

void cometi_model_knobs(const comet_moe_config_t *cfg, int world, int sm_count, cometi_knobs_t *out)
{
    memset(out, 0, sizeof(*out));
    const int tp = cfg->tp_size > 1 ? cfg->tp_size : 1;
    /* Per rank, balanced: tp x M x k rows of ffn / tp columns each (the same FLOPs as EP),
     * and each of this rank's M x k rows copied to the tp ranks of its group. */
    const double H = cfg->hidden, F = (double)cfg->ffn / tp, rows = (double)cfg->max_tokens * cfg->top_k * tp;
    const double remote = world > 1 ? (double)(world - 1) / world : 0;
    /* Layer0: rows pushed to peers against GEMM0's time (gate and up: 2F columns). */
    const double gemm0_s = 2.0 * rows * 2 * F * H / MODEL_GEMM_FLOPS;
    /* With TP the dispatch blocks copy every row to tp ranks, the local copy included: a TP
     * rank after the group's first has no local rows at the head of its segments, so its
     * first tiles wait for the copies too (2 x H200, EP 1 x TP 2: the best counts were 6-8
     * blocks on mixtral-8x7b and 16 or more on phi-3.5-moe and qwen2-57b-a14b). */
    const double push_bytes = rows * (tp > 1 ? 1.0 : remote) * H * 2;
    int blocks = (int)ceil(push_bytes / (gemm0_s * MODEL_DISPATCH_BYTES_PER_SM));
    blocks = clamp(blocks + (blocks & 1), 4, 24); /* even; the measured range */
    out->l0.dispatch_blocks = clamp(blocks, 1, sm_count > 1 ? sm_count / 4 : 1);
    out->l0.dispatch_mode = COMETI_DISPATCH_BULK;
    /* Layer1: the tail (reading GEMM1's output back) against GEMM1: the push where the tail
     * would be long, else GEMM1 on every SM, then the combine on every SM. */
    const double gemm1_s = 2.0 * rows * F * H / MODEL_GEMM_FLOPS, tail_s = rows * H * 2 / MODEL_TAIL_BYTES;
    out->l1.dynamic_tiles = 1;
    out->l1.combine_blocks = 0;
    out->l1.n_splits = 1;
    /* With TP only the push can sum the partial rows (tune.h, cometi_combine_knobs_t). */
    out->l1.push = tp > 1 || (world > 1 && tail_s > MODEL_PUSH_SHARE * gemm1_s);
    out->l1.tail = !out->l1.push;
}

/* One field of a tuning line: an int >= lo, or one of two words (0 or 1). */
static int parse_int(const char *tok, int lo, int *v)
{
    char *end;
    errno = 0;
    long x = tok ? strtol(tok, &end, 10) : 0;
    if (!tok || *end || errno || x < lo || x > 1 << 30) return -1;
    *v = (int)x;
    return 0;
}

static int parse_word(const char *tok, const char *zero, const char *one, int *v)
{
    if (tok && !strcmp(tok, zero)) return *v = 0, 0;
    if (tok && !strcmp(tok, one)) return *v = 1, 0;
    return -1;
}

/* The world field: "W" (TP 1) or "WtpT" (W ranks, T per EP group). */
static int parse_world(const char *tok, int *world, int *tp)
{
    char *end;
    errno = 0;
    long w = tok ? strtol(tok, &end, 10) : 0, t = 1;
    if (!tok || errno || w < 1 || w > 1 << 20) return -1;
    if (!strncmp(end, "tp", 2)) {
        const char *t0 = end + 2;
        t = strtol(t0, &end, 10);
        if (end == t0 || t < 1 || t > w) return -1;
    }
    if (*end) return -1;
    *world = (int)w;
    *tp = (int)t;
    return 0;
}

static int cfg_tp(const comet_moe_config_t *cfg) { return cfg->tp_size > 1 ? cfg->tp_size : 1; }

/* How layer1 ends: 0 notail, 1 tail, 2 push. */
static int parse_layer1_word(const char *tok, int *v)
{
    if (tok && !strcmp(tok, "push")) return *v = 2, 0;
    return parse_word(tok, "notail", "tail", v);
}

int cometi_tuning_lookup(const char *path, const comet_moe_config_t *cfg, int world, cometi_knobs_t *out, char *err,
                         size_t err_len)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, err_len, "tuning file %s: %s", path, strerror(errno));
        return -1;
    }
    static const char *names[12] = {"world[tpT]",      "experts", "top_k",          "hidden",
                                    "ffn",             "max_tokens", "dispatch_blocks", "copy (bulk|stores)",
                                    "combine_blocks",  "splits",  "tiles (static|dynamic)", "layer1 (tail|notail|push)"};
    char line[512];
    int lineno = 0, found = 0;
    double best = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        char *tok[13];
        int n = 0;
        for (char *t = strtok(line, " \t\r\n:"); t; t = strtok(NULL, " \t\r\n:")) {
            if (n == 13) break;
            tok[n++] = t;
        }
        if (n == 0) continue;
        if (n != 12) {
            snprintf(err, err_len, "tuning file %s line %d: %d fields, want 12 (world experts top_k hidden ffn "
                     "max_tokens : dispatch_blocks bulk|stores combine_blocks splits static|dynamic tail|notail|push)",
                     path, lineno, n);
            fclose(f);
            return -1;
        }
        int v[12], tp = 1;
        for (int i = 0; i < 12; i++) {
            const int bad = i == 0    ? parse_world(tok[i], &v[i], &tp)
                            : i == 7  ? parse_word(tok[i], "bulk", "stores", &v[i])
                            : i == 10 ? parse_word(tok[i], "static", "dynamic", &v[i])
                            : i == 11 ? parse_layer1_word(tok[i], &v[i])
                                      : parse_int(tok[i], i == 8 ? 0 : 1, &v[i]);
            if (bad) {
                snprintf(err, err_len, "tuning file %s line %d: field %d (%s) = '%s' is not valid", path, lineno,
                         i + 1, names[i], tok[i]);
                fclose(f);
                return -1;
            }
        }
        if (v[0] != world || tp != cfg_tp(cfg) || v[1] != cfg->num_experts || v[2] != cfg->top_k || v[3] != cfg->hidden ||
            v[4] != cfg->ffn)
            continue;
        /* Settings layer1 would refuse only after layer0's collective work: refused here. */
        if (v[11] == 2 && (v[8] || v[9] != 1)) {
            snprintf(err, err_len, "tuning file %s line %d: push with %d combine blocks and %d splits: the push "
                     "needs 0 and 1", path, lineno, v[8], v[9]);
            fclose(f);
            return -1;
        }
        if (tp > 1 && v[11] != 2) {
            snprintf(err, err_len, "tuning file %s line %d: tp %d with layer1 '%s': only the push sums the TP "
                     "ranks' partial rows", path, lineno, tp, tok[11]);
            fclose(f);
            return -1;
        }
        const double distance = fabs(log((double)v[5] / (cfg->max_tokens > 0 ? cfg->max_tokens : 1)));
        if (found && distance >= best) continue;
        found = 1;
        best = distance;
        out->l0.dispatch_blocks = v[6];
        out->l0.dispatch_mode = v[7] ? COMETI_DISPATCH_STORES : COMETI_DISPATCH_BULK;
        out->l1.combine_blocks = v[8];
        out->l1.n_splits = v[9];
        out->l1.dynamic_tiles = v[10];
        out->l1.tail = v[11] == 1;
        out->l1.push = v[11] == 2;
    }
    fclose(f);
    return found;
}

int cometi_tuning_update(const char *path, const comet_moe_config_t *cfg, int world, const cometi_knobs_t *k,
                         char *err, size_t err_len)
{
    char tmp[4096], line[512], mine[160];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    cometi_tuning_line(cfg, world, k, mine, sizeof(mine));
    FILE *out = fopen(tmp, "w");
    if (!out) {
        snprintf(err, err_len, "tuning file %s: %s", tmp, strerror(errno));
        return -1;
    }
    FILE *in = fopen(path, "r");
    if (!in && errno != ENOENT) {
        snprintf(err, err_len, "tuning file %s: %s", path, strerror(errno));
        fclose(out);
        remove(tmp);
        return -1;
    }
    if (!in) fprintf(out, "# comet tuning file: world[tpT] experts top_k hidden ffn max_tokens : dispatch_blocks "
                          "bulk|stores combine_blocks splits static|dynamic tail|notail|push\n");
    while (in && fgets(line, sizeof(line), in)) {
        /* Same key: the first six fields, whatever the spacing. */
        int f[6], tp = 0;
        char sep[2], w[32];
        if (sscanf(line, "%31s %d %d %d %d %d %1[:]", w, &f[1], &f[2], &f[3], &f[4], &f[5], sep) == 7 &&
            !parse_world(w, &f[0], &tp) && tp == cfg_tp(cfg) && f[0] == world && f[1] == cfg->num_experts && f[2] == cfg->top_k && f[3] == cfg->hidden &&
            f[4] == cfg->ffn && f[5] == cfg->max_tokens)
            continue;
        fputs(line, out);
        if (!strchr(line, '\n')) fputc('\n', out);
    }
    fprintf(out, "%s\n", mine);
    if (in) fclose(in);
    if (fclose(out) != 0 || rename(tmp, path) != 0) {
        snprintf(err, err_len, "tuning file %s: %s", path, strerror(errno));
        remove(tmp);
        return -1;
    }
    return 0;
}

void cometi_tuning_line(const comet_moe_config_t *cfg, int world, const cometi_knobs_t *k, char *buf, size_t len)
{
    char w[32];
    if (cfg_tp(cfg) > 1) snprintf(w, sizeof(w), "%dtp%d", world, cfg_tp(cfg));
    else snprintf(w, sizeof(w), "%d", world);
    snprintf(buf, len, "%s %d %d %d %d %d : %d %s %d %d %s %s", w, cfg->num_experts, cfg->top_k, cfg->hidden,
             cfg->ffn, cfg->max_tokens, k->l0.dispatch_blocks,
             k->l0.dispatch_mode == COMETI_DISPATCH_STORES ? "stores" : "bulk", k->l1.combine_blocks, k->l1.n_splits,
             k->l1.dynamic_tiles ? "dynamic" : "static",
             k->l1.push ? "push" : k->l1.tail || !k->l1.combine_blocks ? "tail" : "notail");
}

int cometi_first_wave_blocks(int requested, int enabled, int tp, int sm_count, int dispatch_blocks, int col_tiles)
{
    if (tp != 1 || requested < 0 || !enabled || sm_count <= COMETI_FIRST_WAVE_FREE_SMS + dispatch_blocks ||
        col_tiles < 1)
        return 0;
    if (requested > 0) return requested;
    /* Idle SMs at a call's start cost their whole length, but a wave of a block or two
     * (phi-3.5-moe's 50 column tiles leave room for 2) gave less than its second stream and
     * its launch cost: on 2 x H200 it lost 0.8 point there and gained on 5 and 9 blocks
     * (qwen2-57b-a14b, qwen2-moe-2.7b). */
    const int wave = (sm_count - COMETI_FIRST_WAVE_FREE_SMS) / col_tiles;
    return wave < COMETI_FIRST_WAVE_MIN_BLOCKS ? 0 : wave;
}

int cometi_head_pieces(int tp, int group_m, int gemm_blocks, int col_tiles)
{
    /* With TP the rows go to every rank of the group, which the head (this rank's own
     * receive buffer alone) cannot do. The head follows the first wave's rows when there
     * is one: without a head, the fused kernel's first tiles waited for the few dispatch
     * workers. */
    if (tp != 1 || col_tiles < 1) return 0;
    const int pieces = 2 * (group_m + (gemm_blocks + col_tiles - 1) / col_tiles);
    return pieces < COMETI_DISPATCH_HEAD_MAX_PIECES ? pieces : COMETI_DISPATCH_HEAD_MAX_PIECES;
}
