/*
 * tune.c - the fused path's settings: the cost model, the tuning file, and the rules for
 * the first wave and the head. See tune.h.
 */
#define _POSIX_C_SOURCE 200809L /* fdopen, strtok_r */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "patterns/tune.h"
#include "patterns/dispatch_gemm.h"
#include "base/params.h"
#include "gemm/gemm.h"

static int clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static int cfg_tp(const comet_moe_config_t *cfg) { return cfg->tp_size > 1 ? cfg->tp_size : 1; }

/* Layer0's dispatch blocks (tune.h). Per row of this rank: both GEMM0's time and the bytes
 * to copy grow with the rows alike, so the count does not depend on the token count. */
static int model_dispatch_blocks(const comet_moe_config_t *cfg, int world, int sm_count)
{
    const int tp = cfg_tp(cfg);
    const double H = cfg->hidden, F = (double)cfg->ffn / tp;
    /* The copy's share of the rows (tune.h): the remote ones, or on one GPU every row at the
     * local copy's faster rate. */
    const double share = world > 1 ? (double)(world - 1) / world : 1.0 / COMETI_MODEL_LOCAL_COPY_SPEEDUP;
    /* GEMM0 is gate and up: 2F columns. With TP the dispatch blocks copy every row to the
     * tp ranks of its group, the local copy included: a TP rank after the group's first has
     * no local rows at the head of its segments, so its first tiles wait for the copies too
     * (2 x H200, EP 1 x TP 2: the best counts were 6-8 blocks on mixtral-8x7b and 16 or
     * more on phi-3.5-moe and qwen2-57b-a14b). */
    const int fp8 = cfg->dtype == COMET_DTYPE_FP8_BLOCK;
    const double gemm0_s = 2.0 * 2 * F * H / (COMETI_MODEL_GEMM_FLOPS * (fp8 ? COMETI_MODEL_FP8_GEMM_SPEEDUP : 1.0));
    const double copy_bytes = (tp > 1 ? 1.0 : share) * (fp8 ? cometi_fp8_row_bytes(cfg->hidden) : H * 2);
    int blocks = (int)ceil(copy_bytes / (gemm0_s * COMETI_MODEL_DISPATCH_BYTES_PER_SM));
    blocks = clamp(blocks + (blocks & 1), COMETI_MODEL_MIN_DISPATCH, COMETI_MODEL_MAX_DISPATCH);
    /* Small GPUs keep most SMs for GEMM0; at least 1 block, which 2 SMs can give. */
    const int cap = sm_count / 4 > 1 ? sm_count / 4 : 1;
    return blocks < cap ? blocks : cap;
}

/* Layer1: is the tail (GEMM1's output read back at COMETI_MODEL_TAIL_BYTES) longer than
 * COMETI_MODEL_PUSH_SHARE of GEMM1? Per row, like the dispatch blocks. */
static int model_tail_is_long(const comet_moe_config_t *cfg)
{
    const double H = cfg->hidden, F = (double)cfg->ffn / cfg_tp(cfg);
    const double speed = cfg->dtype == COMET_DTYPE_FP8_BLOCK ? COMETI_MODEL_FP8_GEMM_SPEEDUP : 1.0;
    const double gemm1_s = 2.0 * F * H / (COMETI_MODEL_GEMM_FLOPS * speed), tail_s = H * 2 / COMETI_MODEL_TAIL_BYTES;
    return tail_s > COMETI_MODEL_PUSH_SHARE * gemm1_s;
}

void cometi_model_knobs(const comet_moe_config_t *cfg, int world, int sm_count, cometi_knobs_t *out)
{
    memset(out, 0, sizeof(*out));
    out->l0.dispatch_blocks = model_dispatch_blocks(cfg, world, sm_count);
    out->l0.dispatch_mode = COMETI_DISPATCH_BULK;
    out->l1.dynamic_tiles = 1;
    out->l1.combine_blocks = 0;
    out->l1.n_splits = 1;
    /* With TP only the push can sum the partial rows (tune.h, cometi_combine_knobs_t); it
     * reaches COMETI_PUSH_MAX_RANKS (with TP and more ranks the fused path is not taken). */
    out->l1.push = world <= COMETI_PUSH_MAX_RANKS && (cfg_tp(cfg) > 1 || model_tail_is_long(cfg));
    out->l1.tail = !out->l1.push;
}

/* The fields of a tuning line, in order, with what each takes (for the messages). */
enum { F_WORLD, F_EXPERTS, F_TOP_K, F_HIDDEN, F_FFN, F_MAX_TOKENS, F_DISPATCH, F_COPY, F_COMBINE, F_SPLITS,
       F_TILES, F_LAYER1, N_FIELDS };
static const struct {
    const char *name, *takes;
} fields[N_FIELDS] = {
    {"world[tpT]", "W, or WtpT with T dividing W"}, {"experts", "a whole number >= 1"},
    {"top_k", "a whole number >= 1"},               {"hidden", "a whole number >= 1"},
    {"ffn", "a whole number >= 1"},                 {"max_tokens", "a whole number >= 1"},
    {"dispatch_blocks", "a whole number"},          {"copy", "bulk or stores"},
    {"combine_blocks", "a whole number"},           {"splits", "a whole number"},
    {"tiles", "static or dynamic"},                 {"layer1", "tail, notail or push"},
};

/* One line, parsed: the fields as numbers (the words as 0 and 1, push as 2), and the tp of
 * the world field. */
typedef struct tuning_line {
    int v[N_FIELDS];
    int tp;
} tuning_line_t;

/* A whole number in [lo, 2^30] (a bound that keeps the arithmetic on it in int). */
static int parse_int(const char *tok, int lo, int *v)
{
    char *end;
    errno = 0;
    long x = strtol(tok, &end, 10);
    if (end == tok || *end || errno || x < lo || x > 1 << 30) return -1;
    *v = (int)x;
    return 0;
}

static int parse_word(const char *tok, const char *zero, const char *one, int *v)
{
    if (!strcmp(tok, zero)) return *v = 0, 0;
    if (!strcmp(tok, one)) return *v = 1, 0;
    return -1;
}

/* The world field: "W" (TP 1) or "WtpT" (W ranks, T per EP group; T divides W, as the
 * config requires). */
static int parse_world(const char *tok, int *world, int *tp)
{
    char *end;
    errno = 0;
    long w = strtol(tok, &end, 10), t = 1;
    if (end == tok || errno || w < 1 || w > 1 << 20) return -1;
    if (!strncmp(end, "tp", 2)) {
        const char *t0 = end + 2;
        t = strtol(t0, &end, 10);
        if (end == t0 || t < 1 || t > w || w % t) return -1;
    }
    if (*end) return -1;
    *world = (int)w;
    *tp = (int)t;
    return 0;
}

/* How layer1 ends: 0 notail, 1 tail, 2 push. */
static int parse_layer1_word(const char *tok, int *v)
{
    if (!strcmp(tok, "push")) return *v = 2, 0;
    return parse_word(tok, "notail", "tail", v);
}

/* "field N (name) = " and the rest; returns -1. */
__attribute__((format(printf, 4, 5))) static int field_error(char *why, size_t len, int i, const char *fmt, ...)
{
    const int n = snprintf(why, len, "field %d (%s) = ", i + 1, fields[i].name);
    va_list ap;
    va_start(ap, fmt);
    if (n >= 0 && (size_t)n < len) vsnprintf(why + n, len - n, fmt, ap);
    va_end(ap);
    return -1;
}

static int parse_fields(char **tok, tuning_line_t *l, char *why, size_t len)
{
    for (int i = 0; i < N_FIELDS; i++) {
        int *v = &l->v[i];
        /* The settings' numbers are only read here; check_settings gives their limits. */
        const int bad = i == F_WORLD    ? parse_world(tok[i], v, &l->tp)
                        : i == F_COPY   ? parse_word(tok[i], "bulk", "stores", v)
                        : i == F_TILES  ? parse_word(tok[i], "static", "dynamic", v)
                        : i == F_LAYER1 ? parse_layer1_word(tok[i], v)
                                        : parse_int(tok[i], i < F_DISPATCH ? 1 : -(1 << 30), v);
        if (bad) return field_error(why, len, i, "'%s': must be %s", tok[i], fields[i].takes);
    }
    return 0;
}

/* What the operators accept (cometi_dispatch_gemm_run, cometi_gemm_combine_run and the
 * GEMM's split check), on a GPU of sm_count SMs. They refuse the same, but only mid-call,
 * layer1's after layer0's collective work, and without the line: refused here instead. */
static int check_settings(const tuning_line_t *l, int sm_count, char *why, size_t len)
{
    const int *v = l->v, tile = cometi_gemm_tile_n(v[F_HIDDEN]);
    const int col_tiles = (v[F_HIDDEN] + tile - 1) / tile;
    if (sm_count > 0 && (v[F_DISPATCH] < 1 || v[F_DISPATCH] >= sm_count))
        return field_error(why, len, F_DISPATCH, "%d: must be 1..%d (the rest of the %d SMs compute)",
                           v[F_DISPATCH], sm_count - 1, sm_count);
    if (sm_count > 0 && (v[F_COMBINE] < 0 || v[F_COMBINE] >= sm_count))
        return field_error(why, len, F_COMBINE, "%d: must be 0..%d (the rest of the %d SMs compute)", v[F_COMBINE],
                           sm_count - 1, sm_count);
    /* No GPU known yet (tune.h, cometi_tuning_lookup with sm_count 0): the lower limits alone. */
    if (v[F_DISPATCH] < 1)
        return field_error(why, len, F_DISPATCH, "%d: must be at least 1", v[F_DISPATCH]);
    if (v[F_COMBINE] < 0)
        return field_error(why, len, F_COMBINE, "%d: must be at least 0", v[F_COMBINE]);
    if (v[F_SPLITS] < 1 || v[F_SPLITS] > COMETI_MAX_SPLITS || col_tiles % v[F_SPLITS])
        return field_error(why, len, F_SPLITS, "%d: must be 1..%d and divide the %d column tiles (%d wide) of "
                           "hidden = %d", v[F_SPLITS], COMETI_MAX_SPLITS, col_tiles, tile, v[F_HIDDEN]);
    if (v[F_SPLITS] > 1 && v[F_HIDDEN] % tile)
        return field_error(why, len, F_SPLITS, "%d: hidden = %d is not a multiple of the %d-column tile, so its "
                           "last tile is partial and only 1 split is possible", v[F_SPLITS], v[F_HIDDEN], tile);
    if (v[F_LAYER1] == 2 && (v[F_COMBINE] || v[F_SPLITS] != 1))
        return field_error(why, len, F_LAYER1, "push with %d combine blocks and %d splits: the push needs 0 "
                           "combine blocks and 1 split", v[F_COMBINE], v[F_SPLITS]);
    if (v[F_LAYER1] == 2 && v[F_WORLD] > COMETI_PUSH_MAX_RANKS)
        return field_error(why, len, F_LAYER1, "push on %d ranks: the push reaches at most %d", v[F_WORLD],
                           COMETI_PUSH_MAX_RANKS);
    if (l->tp > 1 && v[F_LAYER1] != 2)
        return field_error(why, len, F_LAYER1, "%s with tp %d: only the push sums the TP ranks' partial rows",
                           v[F_LAYER1] ? "tail" : "notail", l->tp);
    return 0;
}

/* 1 with `l` filled, 0 for a line of blanks and comments, -1 with `why` set. */
static int parse_line(char *text, int sm_count, tuning_line_t *l, char *why, size_t len)
{
    char *hash = strchr(text, '#'), *tok[N_FIELDS + 1], *save = NULL;
    if (hash) *hash = '\0';
    int n = 0;
    for (char *t = strtok_r(text, " \t\r\n:", &save); t && n <= N_FIELDS; t = strtok_r(NULL, " \t\r\n:", &save))
        tok[n++] = t;
    if (n == 0) return 0;
    if (n != N_FIELDS) {
        snprintf(why, len, "%s%d fields, want 12 (world experts top_k hidden ffn max_tokens : dispatch_blocks "
                 "bulk|stores combine_blocks splits static|dynamic tail|notail|push)", n > N_FIELDS ? "more than " : "",
                 n > N_FIELDS ? N_FIELDS : n);
        return -1;
    }
    if (parse_fields(tok, l, why, len)) return -1;
    return check_settings(l, sm_count, why, len) ? -1 : 1;
}

static int line_matches(const tuning_line_t *l, const comet_moe_config_t *cfg, int world)
{
    const int *v = l->v;
    return v[F_WORLD] == world && l->tp == cfg_tp(cfg) && v[F_EXPERTS] == cfg->num_experts &&
           v[F_TOP_K] == cfg->top_k && v[F_HIDDEN] == cfg->hidden && v[F_FFN] == cfg->ffn;
}

static void line_knobs(const tuning_line_t *l, cometi_knobs_t *k)
{
    const int *v = l->v;
    k->l0.dispatch_blocks = v[F_DISPATCH];
    k->l0.dispatch_mode = v[F_COPY] ? COMETI_DISPATCH_STORES : COMETI_DISPATCH_BULK;
    k->l1.combine_blocks = v[F_COMBINE];
    k->l1.n_splits = v[F_SPLITS];
    k->l1.dynamic_tiles = v[F_TILES];
    k->l1.tail = v[F_LAYER1] == 1;
    k->l1.push = v[F_LAYER1] == 2;
}

/* The file, open for reading, where it is a readable regular file (a directory would read
 * as empty and a fifo would wait for a writer: both looked like "no line matches"). */
static FILE *open_tuning(const char *path, char *err, size_t err_len)
{
    char why[128];
    const int fd = cometi_open_regular(path, why, sizeof(why));
    FILE *f = fd < 0 ? NULL : fdopen(fd, "r");
    if (fd >= 0 && !f) snprintf(why, sizeof(why), "%s", strerror(errno)), close(fd);
    if (!f) snprintf(err, err_len, "tuning file %s: %s", path, why);
    return f;
}

int cometi_tuning_lookup(const char *path, const comet_moe_config_t *cfg, int world, int sm_count,
                         cometi_knobs_t *out, char *err, size_t err_len)
{
    FILE *f = open_tuning(path, err, err_len);
    if (!f) return -1;
    char text[512], why[256];
    int lineno = 0, found = 0, st = 0;
    double best = 0;
    cometi_knobs_t k = *out; /* what the file does not set (the first wave) stays the caller's */
    while (fgets(text, sizeof(text), f)) {
        lineno++;
        tuning_line_t l;
        /* A longer line would come back in pieces, each parsed as a line of its own. */
        const int whole = strchr(text, '\n') || feof(f);
        if (!whole) snprintf(why, sizeof(why), "longer than %zu characters", sizeof(text) - 2);
        const int got = whole ? parse_line(text, sm_count, &l, why, sizeof(why)) : -1;
        if (got < 0) {
            snprintf(err, err_len, "tuning file %s line %d: %s", path, lineno, why);
            st = -1;
            break;
        }
        if (!got || !cfg || !line_matches(&l, cfg, world)) continue;
        const double distance = fabs(log((double)l.v[F_MAX_TOKENS] / (cfg->max_tokens > 0 ? cfg->max_tokens : 1)));
        if (found && distance >= best) continue;
        found = 1;
        best = distance;
        line_knobs(&l, &k);
    }
    if (!st && ferror(f)) {
        snprintf(err, err_len, "tuning file %s: %s", path, strerror(errno));
        st = -1;
    }
    fclose(f);
    if (st) return st;
    if (found) *out = k;
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

int cometi_model_pingpong(int num_tokens, int world, int top_k, int num_experts)
{
    return num_experts > 0 &&
           (long long)num_tokens * world * top_k <= (long long)COMETI_MODEL_PINGPONG_ROWS * num_experts;
}

int cometi_first_wave_blocks(int requested, int enabled, int tp, int sm_count, int dispatch_blocks, int col_tiles,
                             long long rows)
{
    /* Below one row block the wave takes none, and its fork (a side stream, two launches, a
     * join that the next kernel waits on) costs the small batches of every format. */
    if (tp != 1 || requested < 0 || !enabled || sm_count <= COMETI_FIRST_WAVE_FREE_SMS + dispatch_blocks ||
        col_tiles < 1 || rows < COMETI_BLOCK_M)
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

int cometi_tuning_file_check(const char *path, char *why, size_t len)
{
    cometi_knobs_t unused;
    memset(&unused, 0, sizeof(unused));
    return cometi_tuning_lookup(path, NULL, 0, 0, &unused, why, len) < 0 ? -1 : 0;
}
