/*
 * main.c - the command-line tool: parses a subcommand and its flags, then runs it
 * on one process per GPU (forked here, before any CUDA call) or, under an external
 * launcher, on this process as one rank.
 *
 *   comet bench      the MoE layer: comet beside the sequential baseline
 *   comet tune       bench's sweeps, the best settings written into a tuning file
 *   comet bandwidth  push and pull bandwidth between GPUs over NVLink (and a local copy)
 *   comet gemm       comet's grouped GEMM beside cuBLAS on the presets' expert shapes
 *   comet presets    the model shapes comet knows
 *
 * Every flag is one row of flags[]: its name, its value's name, the commands that take
 * it, its parser and its help line. The usage texts, the parsing and the refusals all
 * come from that table, so a command's --help lists exactly what it accepts; a flag given
 * twice is refused, not overwritten. Whatever can be checked before a process forks is
 * checked here: each value, each flag's fit with the command, each case's config (by the
 * library's own comet_moe_config_validate), the files the run will write and the
 * library's environment variables (by its own table, src/params.h); a run that cannot
 * succeed stops with exit 2 before it touches a GPU or NCCL.
 *
 * Exit codes (tool.h; `comet help` lists them too): 0 success; 1 the run failed (a rank, or
 * a check marked !); 2 usage: a flag, a value or a COMET_* variable refused before the run;
 * 3 no usable GPU or NCCL: no driver, no Hopper GPU visible, fewer than the ranks need, or
 * an NCCL comet cannot use. NCCL_NVLS_ENABLE is set to 0 unless the user set it: NVLink
 * multicast is not used by comet and can take a shared host's GPUs out of service.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comet.h"
#include "layer/layer.h"
#include "base/params.h"
#include "tool.h"

#define STR_(x) #x
#define STR(x) STR_(x)

/* The suite's largest token count (cmd_bench.c's suite_tokens): its configs are checked there. */
#define SUITE_MAX_TOKENS 16384
/* comet gemm times the expert GEMMs of balanced routing over EP = 2 ranks. */
#define GEMM_EP 2 /* comet gemm's default --ep */

/* ------------------------------------------------------------------------------------ */
/* The commands. */

enum { CMD_BENCH = 1, CMD_TUNE = 2, CMD_BANDWIDTH = 4, CMD_GEMM = 8, CMD_PRESETS = 16, CMD_VERSION = 32 };

typedef struct command {
    const char *name;
    unsigned bit;
    const char *summary;
} command_t;

static const command_t commands[] = {
    {"bench", CMD_BENCH, "time the MoE layer: comet beside the sequential baseline (default: mixtral-8x7b, 8192 "
                         "tokens per GPU, every visible GPU)"},
    {"tune", CMD_TUNE, "bench's sweeps, and the best settings of each case written into a tuning file (--out); "
                       "comet_moe_forward loads it when COMET_TUNING_FILE names it"},
    {"bandwidth", CMD_BANDWIDTH, "push (stores) and pull (loads) bandwidth between GPUs through symmetric memory, "
                                 "the same copy in local memory, and the copy engine's push"},
    {"gemm", CMD_GEMM, "comet's grouped GEMM beside cuBLAS on one GPU: every preset's expert GEMMs (rows as "
                       "balanced routing of --tokens over --ep ranks gives), their backward's, and 8192^3"},
    {"presets", CMD_PRESETS, "list the model presets"},
    {"version", CMD_VERSION, "print the version"},
};
#define NCOMMANDS ((int)(sizeof(commands) / sizeof(commands[0])))

static const command_t *find_command(const char *name)
{
    for (int i = 0; i < NCOMMANDS; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

/* ------------------------------------------------------------------------------------ */
/* What the flags fill in. */

#define MAX_FLAGS 40

typedef struct cli {
    const command_t *cmd;
    tool_options_t o;
    int ranks;                     /* --ranks; 0: EP x TP with --ep, else every visible GPU */
    const char *id_file;           /* --id-file: one rank under an external launcher */
    unsigned char given[MAX_FLAGS]; /* flags[i] was on the command line */
} cli_t;

static void set_defaults(cli_t *c, const command_t *cmd)
{
    memset(c, 0, sizeof(*c));
    c->cmd = cmd;
    tool_options_t *o = &c->o;
    o->tokens = 8192;
    o->routing = COMETI_ROUTING_BALANCED;
    o->skew = 8;
    o->run_baseline = o->run_comet = 1;
    o->warmup = 5;
    o->iters = 20;
    o->gemms = TOOL_GEMMS_ALL;
    o->check = 1;
    o->mib = 256;
    o->seed = ((uint64_t)time(NULL) << 16) ^ (uint64_t)getpid();
}

/* ------------------------------------------------------------------------------------ */
/* The flags: one row each. A flag that means something else to another command (its
 * default, its range) has a row of its own for it. */

typedef struct flag flag_t;
typedef int (*parse_fn)(const flag_t *f, const char *v, cli_t *c);

struct flag {
    const char *name;  /* "--tokens" */
    const char *value; /* the value's name in the help; NULL: a switch, which takes none */
    unsigned cmds;     /* the commands that take it: CMD_* bits */
    parse_fn parse;    /* stores v (NULL for a switch) into the cli_t at `field`; 0 or -1 */
    size_t field;      /* offsetof(cli_t, ...) */
    long lo, hi;       /* parse_int's range; a switch stores lo */
    const char *help;  /* its help line, the default in [brackets] */
};

static int parse_int(const flag_t *f, const char *v, cli_t *c);
static int parse_seed(const flag_t *f, const char *v, cli_t *c);
static int parse_skew(const flag_t *f, const char *v, cli_t *c);
static int parse_presets(const flag_t *f, const char *v, cli_t *c);
static int parse_routing(const flag_t *f, const char *v, cli_t *c);
static int parse_impl(const flag_t *f, const char *v, cli_t *c);
static int parse_gemms(const flag_t *f, const char *v, cli_t *c);
static int parse_path(const flag_t *f, const char *v, cli_t *c);
static int set_switch(const flag_t *f, const char *v, cli_t *c);

#define AT(member) offsetof(cli_t, member)
#define BT (CMD_BENCH | CMD_TUNE)
#define RUNS (CMD_BENCH | CMD_TUNE | CMD_BANDWIDTH)

/* The shape flags' and --tokens' ranges are only "a positive int": comet_moe_config_validate
 * holds the real limits, and check_cases() asks it. */
static const flag_t flags[] = {
    {"--preset", "NAME[,NAME...]", BT, parse_presets, 0, 0, 0,
     "model shapes, or 'all' (comet presets lists them) [mixtral-8x7b; with --suite all]"},
    {"--preset", "NAME[,NAME...]", CMD_GEMM, parse_presets, 0, 0, 0,
     "the presets whose expert GEMMs are timed, or 'all' [all]"},
    {"--hidden", "H", BT, parse_int, AT(o.hidden), 1, INT_MAX,
     "an explicit shape instead of --preset, given by all four of --hidden, --ffn, --experts and --top-k: "
     "the hidden size"},
    {"--ffn", "F", BT, parse_int, AT(o.ffn), 1, INT_MAX, "one expert's FFN size"},
    {"--experts", "E", BT, parse_int, AT(o.experts), 1, INT_MAX, "experts in the model"},
    {"--top-k", "K", BT, parse_int, AT(o.top_k), 1, INT_MAX, "experts per token"},
    {"--tokens", "M", BT, parse_int, AT(o.tokens), 1, INT_MAX, "tokens per GPU [8192]"},
    {"--tokens", "M", CMD_GEMM, parse_int, AT(o.tokens), 1, INT_MAX,
     "tokens per GPU; the GEMMs' rows are what balanced routing of them over --ep ranks gives [8192]"},
    {"--ep", "N", CMD_GEMM, parse_int, AT(o.ep), 1, COMETI_MAX_RANKS,
     "the expert-parallel size whose balanced routing sets the rows: each of a rank's experts / N experts gets "
     "tokens x top-k x N / experts rows (1: the rows one GPU trains on) [2]"},
    {"--ep", "N", BT, parse_int, AT(o.ep), 1, COMETI_MAX_RANKS,
     "expert-parallel size; EP x TP = ranks [ranks / TP]"},
    {"--tp", "N", BT, parse_int, AT(o.tp), 1, COMETI_MAX_RANKS,
     "tensor-parallel size: each expert's ffn split over TP ranks [1]"},
    {"--routing", "KIND", BT, parse_routing, AT(o.routing), 0, 0, "balanced | random | skewed [balanced]"},
    {"--skew", "S", BT, parse_skew, AT(o.skew), 0, 0,
     "with --routing skewed (or --suite): the most loaded expert's expected load over the least loaded's, a "
     "number >= 1 [8]"},
    {"--impl", "WHICH", CMD_BENCH, parse_impl, 0, 0, 0, "baseline | comet | all [all]"},
    {"--warmup", "N", BT, parse_int, AT(o.warmup), 0, 10000, "untimed calls [5]"},
    {"--iters", "N", BT, parse_int, AT(o.iters), 1, 100000, "timed calls [20]"},
    {"--iters", "N", CMD_GEMM, parse_int, AT(o.iters), 1, 64, "timed calls per GEMM, at most 64 [20]"},
    {"--no-check", NULL, BT, set_switch, AT(o.check), 0, 0, "skip the float64 check of sample tokens"},
    {"--suite", NULL, CMD_BENCH, set_switch, AT(o.suite), 1, 0,
     "every preset (or those of --preset) x 1024..16384 tokens x balanced and skewed routing, comet's default "
     "settings, no sweeps; ends with a table"},
    {"--json", "FILE", BT, parse_path, AT(o.json), 0, 0, "also write the results as JSON"},
    {"--out", "FILE", CMD_TUNE, parse_path, AT(o.tune_out), 0, 0,
     "the tuning file each case's best settings go to (its line replaced, or added) [comet-tuning.txt]"},
    {"--seed", "S", BT | CMD_GEMM, parse_seed, AT(o.seed), 0, 0,
     "inputs' seed, decimal or 0x hex [from the clock]"},
    {"--trace", NULL, BT, set_switch, AT(o.trace), 1, 0,
     "also print, on every rank, where the fused kernels' time goes per SM against our GEMM alone's (launch, "
     "dispatch, waits for rows, tiles, tail), and with combine blocks layer1's combine timeline"},
    {"--trace", NULL, CMD_GEMM, set_switch, AT(o.trace), 1, 0,
     "with --fp8, also print where each forward GEMM's time goes per SM, ours in bf16 and in FP8: launch, tiles "
     "(a block's first tile and its later ones apart), the last wave's tail, waits"},
    {"--train", NULL, CMD_BENCH, set_switch, AT(o.train), 1, 0,
     "also time training, each case's last, the baseline's then comet's: comet_moe_forward_train, "
     "comet_moe_backward (bf16 weight gradients), the two as one step, comet's backward GEMMs alone; comet's "
     "step vs the baseline's in turns and its dx vs the baseline's; n/a where an impl does not serve a call"},
    {"--gemms", "WHICH[,WHICH...]", CMD_GEMM, parse_gemms, AT(o.gemms), 0, 0,
     "the tables timed: forward (GEMM0 and GEMM1, with the SwiGLU), dgrad (the backward's data gradients), "
     "wgrad (its weight gradients), or all [all]"},
    {"--sweep", NULL, CMD_GEMM, set_switch, AT(o.sweep), 1, 0,
     "also every variant of ours, a line each: epilogues, tile orders, grid sizes, the shared tile counter, "
     "two column splits, no cut of the last wave (the backward's GEMMs: epilogues and tile orders)"},
    {"--fp8", NULL, CMD_BENCH, set_switch, AT(o.fp8), 1, 0,
     "instead, the block-scaled FP8 layer (E4M3, 128 x 128 weight scales, x quantized per 128 columns) beside "
     "the bf16 layer (both fused) and the FP8 sequential path, in turns, at --tokens and at 1, 16 and 128 "
     "tokens (there the fused layers as CUDA-graph replays); with 1 - 2xy/(x^2+y^2) of the FP8 and bf16 outputs; "
     "with --train, the FP8 training step beside the bf16 one and the FP8 sequential step instead, in turns, "
     "with the FP8 weights' copies, "
     "the saved bytes and 1 - 2xy/(x^2+y^2) of dx and the weight gradients"},
    {"--fp8-wgrad-cublaslt", NULL, CMD_BENCH, set_switch, AT(o.wgrad_cublaslt), 1, 0,
     "with --fp8 --train, the FP8 layer made with config.fp8_wgrad_cublaslt = 1: its weight gradients as "
     "cuBLASLt's GEMM per expert, on counts the backward waits for on the host"},
    {"--fp8", NULL, CMD_GEMM, set_switch, AT(o.fp8), 1, 0,
     "instead, the block-scaled FP8 forward GEMMs (E4M3, 1 x 128 and 128 x 128 scales) beside cuBLASLt's "
     "block-scaled FP8 GEMM per expert and our bf16 GEMM (ours on the schedule the layer picks for those rows: "
     "ping-pong at 64 rows an expert or fewer), then the backward's FP8 GEMMs beside our bf16 ones: the "
     "weight gradients (128 x 1 scales along the tokens) and the data gradients (on W^T's copy); --ep defaults to 1 "
     "(one GPU's rows)"},
    {"--mib", "N", CMD_BANDWIDTH, parse_int, AT(o.mib), 1, 16384, "bytes per transfer, MiB [256]"},
    {"--ranks", "N", RUNS, parse_int, AT(ranks), 1, COMETI_MAX_RANKS,
     "processes, one per GPU [EP x TP with --ep, else every visible GPU]"},
    {"--timeout-ms", "T", RUNS, parse_int, AT(o.timeout_ms), 1, 3600000,
     "device-side wait limit [" STR(COMETI_DEFAULT_TIMEOUT_MS) "]"},
    {"--id-file", "PATH", RUNS, parse_path, AT(id_file), 0, 0,
     "run as one rank under an external launcher (torchrun, mpirun, srun) that sets RANK, WORLD_SIZE and "
     "LOCAL_RANK; rank 0 writes the NCCL id to PATH (which must not exist yet), the others read it"},
};
#define NFLAGS ((int)(sizeof(flags) / sizeof(flags[0])))
_Static_assert(sizeof(flags) / sizeof(flags[0]) <= MAX_FLAGS, "cli_t.given needs room for every flag");

static const flag_t *find_flag(const char *name, unsigned cmd)
{
    for (int i = 0; i < NFLAGS; i++)
        if ((flags[i].cmds & cmd) && !strcmp(flags[i].name, name)) return &flags[i];
    return NULL;
}

/* Whether the command line gave `name`. */
static int given(const cli_t *c, const char *name)
{
    for (int i = 0; i < NFLAGS; i++)
        if (c->given[i] && !strcmp(flags[i].name, name)) return 1;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* The usage texts, all from the tables above. */

#define HELP_WIDTH 110
#define HELP_COLUMN 27

/* Prints `text` word by word from column `col` (where the cursor is), wrapping before
 * HELP_WIDTH with continuation lines indented to `col`. */
static void print_wrapped(FILE *out, int col, const char *text)
{
    int at = col;
    for (const char *w = text; *w;) {
        const int n = (int)strcspn(w, " ");
        if (at > col && at + 1 + n > HELP_WIDTH) at = fprintf(out, "\n%*s", col, "") - 1;
        else if (at > col) at += fprintf(out, " ");
        at += fprintf(out, "%.*s", n, w);
        for (w += n; *w == ' '; w++) {}
    }
    fprintf(out, "\n");
}

static void print_flag(FILE *out, const flag_t *f)
{
    char left[64];
    snprintf(left, sizeof(left), "%s%s%s", f->name, f->value ? " " : "", f->value ? f->value : "");
    fprintf(out, "  %-*s ", HELP_COLUMN - 3, left);
    if ((int)strlen(left) > HELP_COLUMN - 3) fprintf(out, "\n%*s", HELP_COLUMN, "");
    print_wrapped(out, HELP_COLUMN, f->help);
}

static const char *flag_syntax = "--flag VALUE or --flag=VALUE";

/* After the flags of `comet help` and of each command that runs: what it reads and sets in
 * the environment, and its exit codes (tool.h). */
static void usage_notes(FILE *out)
{
    char names[256] = "";
    for (int i = 0; i < COMETI_NUM_PARAMS; i++)
        snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s%s", i == 0 ? "" : i + 1 < COMETI_NUM_PARAMS
                 ? ", " : " and ", cometi_param_name((cometi_param_id_t)i));
    char text[512];
    snprintf(text, sizeof(text), "%s: the library's settings, checked before the run starts", names);
    fprintf(out, "\nenvironment:\n  %-*s ", HELP_COLUMN - 3, "COMET_*");
    print_wrapped(out, HELP_COLUMN, text);
    fprintf(out, "  %-*s ", HELP_COLUMN - 3, "NCCL_NVLS_ENABLE");
    print_wrapped(out, HELP_COLUMN, "set to 0 unless already set: NVLink multicast is not used by comet and can "
                  "take a shared host's GPUs out of service");
    static const char *codes[][2] = {
        {"0", "success"},
        {"1", "the run failed: a rank, or a check (marked ! in its row)"},
        {"2", "usage: a flag, a value or a COMET_* variable refused before the run"},
        {"3", "no usable GPU or NCCL: no driver, no Hopper GPU visible, fewer than the ranks need, or an NCCL "
              "comet cannot use (older than 2.28, or not the release comet was built against)"},
    };
    fprintf(out, "\nexit status:\n");
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
        fprintf(out, "  %-*s ", HELP_COLUMN - 3, codes[i][0]);
        print_wrapped(out, HELP_COLUMN, codes[i][1]);
    }
}

/* `comet CMD --help`: the command's line and its flags alone. */
static void usage_command(FILE *out, const command_t *cmd)
{
    int n = 0;
    for (int i = 0; i < NFLAGS; i++) n += !!(flags[i].cmds & cmd->bit);
    fprintf(out, "usage: comet %s%s\n\n", cmd->name, n ? " [flags]" : "");
    print_wrapped(out, 0, cmd->summary);
    if (!n) {
        fprintf(out, "\ncomet %s takes no flags (-h, --help: this text).\n", cmd->name);
        return;
    }
    fprintf(out, "\nflags (a value as %s; each at most once):\n", flag_syntax);
    for (int i = 0; i < NFLAGS; i++)
        if (flags[i].cmds & cmd->bit) print_flag(out, &flags[i]);
    fprintf(out, "  %-*s this text\n", HELP_COLUMN - 3, "-h, --help");
    if (cmd->bit & (RUNS | CMD_GEMM)) usage_notes(out);
}

/* Under `comet help`: the flags of `cmd` that no earlier command takes, in full; the
 * others by name. */
static void usage_flags_of(FILE *out, const command_t *cmd, unsigned earlier)
{
    char also[600] = "";
    int printed = 0;
    for (int i = 0; i < NFLAGS; i++) {
        if (!(flags[i].cmds & cmd->bit)) continue;
        if (!printed++) fprintf(out, "\n%s flags:\n", cmd->name);
        if (!(flags[i].cmds & earlier)) print_flag(out, &flags[i]);
        else snprintf(also + strlen(also), sizeof(also) - strlen(also), "%s%s", also[0] ? ", " : "", flags[i].name);
    }
    if (!also[0]) return;
    fprintf(out, "  %-*s ", HELP_COLUMN - 3, "and, as above:");
    print_wrapped(out, HELP_COLUMN, also);
}

/* `comet help`: the commands, then every command's flags, each row once: under the first
 * command that takes it, by name under the others. */
static void usage_all(FILE *out)
{
    fprintf(out, "usage: comet <command> [flags]\n       comet <command> --help    that command's flags alone\n"
            "       comet --version           the same as comet version\n"
            "A flag takes its value as %s, and is given at most once.\n\ncommands:\n", flag_syntax);
    for (int i = 0; i < NCOMMANDS; i++) {
        fprintf(out, "  %-10s ", commands[i].name);
        print_wrapped(out, 13, commands[i].summary);
    }
    unsigned earlier = 0;
    for (int i = 0; i < NCOMMANDS; i++) {
        usage_flags_of(out, &commands[i], earlier);
        earlier |= commands[i].bit;
    }
    usage_notes(out);
}

/* `comet help [CMD]`. */
static int help_command(int argc, char **argv)
{
    if (argc <= 2) {
        usage_all(stdout);
        return 0;
    }
    const command_t *cmd = find_command(argv[2]);
    if (!cmd || argc > 3) {
        fprintf(stderr, "comet help: %s \"%s\": give one command (comet help lists them)\n",
                cmd ? "unexpected argument" : "unknown command", argv[cmd ? 3 : 2]);
        return TOOL_EXIT_USAGE;
    }
    usage_command(stdout, cmd);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* The parsers: each takes the whole value or refuses it with a sentence that names the
 * flag, the value and what is allowed. */

static int refuse_value(const cli_t *c, const flag_t *f, const char *v, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int refuse_value(const cli_t *c, const flag_t *f, const char *v, const char *fmt, ...)
{
    fprintf(stderr, "comet %s: %s \"%s\": ", c->cmd->name, f->name, v);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    return -1;
}

/* strtol over the whole string: no blank before it, nothing after it. A number past a
 * long's range comes out as LONG_MAX (LONG_MIN), for the caller's range to refuse. */
static int whole_long(const char *v, long *out)
{
    if (!*v || isspace((unsigned char)*v)) return -1;
    char *end;
    errno = 0;
    const long x = strtol(v, &end, 10);
    if (*end || end == v || (errno && errno != ERANGE)) return -1;
    *out = x;
    return 0;
}

static int parse_int(const flag_t *f, const char *v, cli_t *c)
{
    long x;
    const int number = !whole_long(v, &x);
    if (!number || x < f->lo || x > f->hi) {
        /* The shape flags' upper limits are validate's, told once the config is whole. */
        if (f->hi == INT_MAX && !(number && x > f->hi))
            return refuse_value(c, f, v, "expected a whole number >= %ld", f->lo);
        return refuse_value(c, f, v, "expected a whole number in %ld..%ld", f->lo, f->hi);
    }
    *(int *)((char *)c + f->field) = (int)x;
    return 0;
}

/* Decimal, or hexadecimal after 0x; not strtoull's octal, and no sign (it would wrap). */
static int parse_seed(const flag_t *f, const char *v, cli_t *c)
{
    const int hex = v[0] == '0' && (v[1] == 'x' || v[1] == 'X');
    char *end = NULL;
    errno = 0;
    const unsigned long long x = isdigit((unsigned char)v[0]) ? strtoull(v, &end, hex ? 16 : 10) : 0;
    if (!end || *end || errno || (hex && !v[2]))
        return refuse_value(c, f, v, "expected a whole number in 0..%llu, decimal or 0x hex", ULLONG_MAX);
    *(uint64_t *)((char *)c + f->field) = x;
    return 0;
}

static int parse_skew(const flag_t *f, const char *v, cli_t *c)
{
    char *end = NULL;
    const double x = *v && !isspace((unsigned char)*v) ? strtod(v, &end) : NAN;
    if (!end || *end || !isfinite(x) || x < 1)
        return refuse_value(c, f, v, "expected a finite number >= 1 (1: every expert equally loaded)");
    *(double *)((char *)c + f->field) = x;
    return 0;
}

static int parse_routing(const flag_t *f, const char *v, cli_t *c)
{
    static const char *names[] = {"balanced", "random", "skewed"};
    static const cometi_routing_t kinds[] = {COMETI_ROUTING_BALANCED, COMETI_ROUTING_RANDOM, COMETI_ROUTING_SKEWED};
    for (int i = 0; i < 3; i++)
        if (!strcmp(v, names[i])) {
            *(cometi_routing_t *)((char *)c + f->field) = kinds[i];
            return 0;
        }
    return refuse_value(c, f, v, "expected balanced, random or skewed");
}

static int parse_gemms(const flag_t *f, const char *v, cli_t *c)
{
    static const char *names[] = {"forward", "dgrad", "wgrad", "all"};
    static const unsigned bits[] = {TOOL_GEMMS_FORWARD, TOOL_GEMMS_DGRAD, TOOL_GEMMS_WGRAD, TOOL_GEMMS_ALL};
    unsigned set = 0;
    for (const char *p = v;; p++) {
        const size_t n = strcspn(p, ",");
        int i = 0;
        while (i < 4 && !(strlen(names[i]) == n && !strncmp(p, names[i], n))) i++;
        if (i == 4) return refuse_value(c, f, v, "expected forward, dgrad, wgrad or all, separated by commas");
        set |= bits[i];
        p += n;
        if (!*p) break;
    }
    *(unsigned *)((char *)c + f->field) = set;
    return 0;
}

static int parse_impl(const flag_t *f, const char *v, cli_t *c)
{
    const int baseline = !strcmp(v, "baseline"), comet = !strcmp(v, "comet"), all = !strcmp(v, "all");
    if (!baseline && !comet && !all) return refuse_value(c, f, v, "expected baseline, comet or all");
    c->o.run_baseline = !comet;
    c->o.run_comet = !baseline;
    return 0;
}

static int parse_path(const flag_t *f, const char *v, cli_t *c)
{
    if (!*v) return refuse_value(c, f, v, "expected a path");
    *(const char **)((char *)c + f->field) = v;
    return 0;
}

static int set_switch(const flag_t *f, const char *v, cli_t *c)
{
    (void)v;
    *(int *)((char *)c + f->field) = (int)f->lo;
    return 0;
}

/* Presets are stored as the library's own names (they outlive the command line's). */
static int add_preset(const flag_t *f, const char *list, const char *name, cli_t *c)
{
    comet_moe_config_t cfg;
    if (comet_moe_config_preset(name, 1, &cfg) != COMET_SUCCESS)
        return refuse_value(c, f, list, "%s", comet_last_create_error());
    if (c->o.npresets == TOOL_MAX_PRESETS) return refuse_value(c, f, list, "at most %d presets", TOOL_MAX_PRESETS);
    for (int i = 0; comet_moe_preset_name(i); i++)
        if (!strcmp(comet_moe_preset_name(i), name)) c->o.presets[c->o.npresets++] = comet_moe_preset_name(i);
    return 0;
}

/* "all" (every preset but the tests' "tiny"), or names separated by commas, none empty. */
static int parse_presets(const flag_t *f, const char *v, cli_t *c)
{
    c->o.npresets = 0;
    if (!strcmp(v, "all")) {
        for (int i = 0; comet_moe_preset_name(i) && c->o.npresets < TOOL_MAX_PRESETS; i++)
            if (strcmp(comet_moe_preset_name(i), "tiny")) c->o.presets[c->o.npresets++] = comet_moe_preset_name(i);
        return 0;
    }
    for (const char *p = v;; p++) {
        const size_t n = strcspn(p, ",");
        char name[64];
        if (n == 0)
            return refuse_value(c, f, v, "expected 'all' or preset names separated by commas, none empty "
                                "(comet presets lists them)");
        if (n >= sizeof(name)) return refuse_value(c, f, v, "no preset has a name of %zu characters", n);
        memcpy(name, p, n);
        name[n] = '\0';
        if (add_preset(f, v, name, c)) return -1;
        p += n;
        if (!*p) return 0;
    }
}

/* ------------------------------------------------------------------------------------ */
/* The command line. */

/* An argument the command does not take: exit 2, naming it and who does take it. */
static int refuse_flag(const cli_t *c, const char *arg, const char *name)
{
    const char *cmd = c->cmd->name;
    if (strncmp(arg, "-", 1)) {
        fprintf(stderr, "comet %s: unexpected argument \"%s\" (comet %s --help lists what it takes)\n", cmd, arg, cmd);
        return -1;
    }
    char takers[128] = "";
    for (int ci = 0; ci < NCOMMANDS; ci++)
        for (int i = 0; i < NFLAGS; i++)
            if ((flags[i].cmds & commands[ci].bit) && !strcmp(flags[i].name, name)) {
                snprintf(takers + strlen(takers), sizeof(takers) - strlen(takers), "%s%s", takers[0] ? ", " : "",
                         commands[ci].name);
                break;
            }
    if (takers[0])
        fprintf(stderr, "comet %s: %s is not a flag of comet %s (it is for: %s); comet %s --help lists %s's flags\n",
                cmd, name, cmd, takers, cmd, cmd);
    else
        fprintf(stderr, "comet %s: unknown flag %s; comet %s --help lists its flags\n", cmd, name, cmd);
    return -1;
}

enum { PARSED = 0, PARSE_ERROR = -1, PARSE_HELP = 1 };

/* argv[i] and, for a flag that takes one, its value (after '=' or the next argument).
 * Advances *i past what it used. */
static int parse_arg(int argc, char **argv, int *i, cli_t *c)
{
    const char *arg = argv[*i], *eq = strchr(arg, '=');
    if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) return PARSE_HELP;
    char name[64];
    snprintf(name, sizeof(name), "%.*s", eq && !strncmp(arg, "--", 2) ? (int)(eq - arg) : (int)strlen(arg), arg);
    const flag_t *f = strncmp(arg, "--", 2) ? NULL : find_flag(name, c->cmd->bit);
    if (!f) return refuse_flag(c, arg, name);
    if (c->given[f - flags]) {
        fprintf(stderr, "comet %s: %s given twice: give each flag once\n", c->cmd->name, f->name);
        return PARSE_ERROR;
    }
    const char *v = eq ? eq + 1 : NULL;
    if (!f->value && v) {
        fprintf(stderr, "comet %s: %s takes no value (given \"%s\")\n", c->cmd->name, f->name, v);
        return PARSE_ERROR;
    }
    if (f->value && !v) {
        /* A next argument that is a flag means this one's value was left out. */
        if (*i + 1 >= argc || !strncmp(argv[*i + 1], "--", 2)) {
            fprintf(stderr, "comet %s: %s needs a value (%s %s)\n", c->cmd->name, f->name, f->name, f->value);
            return PARSE_ERROR;
        }
        v = argv[++*i];
    }
    if (f->parse(f, v, c)) return PARSE_ERROR;
    c->given[f - flags] = 1;
    return PARSED;
}

static int parse_args(int argc, char **argv, cli_t *c)
{
    for (int i = 2; i < argc; i++) {
        const int r = parse_arg(argc, argv, &i, c);
        if (r != PARSED) return r;
    }
    return PARSED;
}

/* The rules between flags that the table cannot say. */
static int check_combinations(cli_t *c)
{
    tool_options_t *o = &c->o;
    const char *cmd = c->cmd->name;
    const int shape = o->hidden || o->ffn || o->experts || o->top_k;
    if (shape && given(c, "--preset")) {
        fprintf(stderr, "comet %s: give --preset or --hidden/--ffn/--experts/--top-k, not both\n", cmd);
        return -1;
    }
    if (shape && !(o->hidden && o->ffn && o->experts && o->top_k)) {
        fprintf(stderr, "comet %s: an explicit shape needs all of --hidden, --ffn, --experts and --top-k; "
                "missing:%s%s%s%s\n", cmd, o->hidden ? "" : " --hidden", o->ffn ? "" : " --ffn",
                o->experts ? "" : " --experts", o->top_k ? "" : " --top-k");
        return -1;
    }
    const int gemm = c->cmd->bit == CMD_GEMM;
    if (o->fp8 &&
        (o->suite || o->sweep || given(c, "--impl") || given(c, "--json") || (!gemm && given(c, "--trace")))) {
        fprintf(stderr, "comet %s: --fp8 times its own table: leave out %s\n", cmd,
                o->suite ? "--suite" : o->sweep ? "--sweep" : given(c, "--impl") ? "--impl"
                : given(c, "--json") ? "--json" : "--trace");
        return -1;
    }
    if (o->wgrad_cublaslt && !(o->fp8 && o->train)) {
        fprintf(stderr, "comet bench: --fp8-wgrad-cublaslt sets the FP8 training step's weight gradients: give "
                "--fp8 --train with it\n");
        return -1;
    }
    if (gemm && o->trace && !o->fp8) {
        fprintf(stderr, "comet gemm: --trace prints the FP8 table's forward GEMMs' tile timelines: give --fp8 with "
                "it\n");
        return -1;
    }
    if (o->suite && (shape || given(c, "--tokens") || given(c, "--routing"))) {
        fprintf(stderr, "comet %s: --suite runs 1024 to 16384 tokens, both routings, on presets: leave out %s\n", cmd,
                shape ? "--hidden/--ffn/--experts/--top-k" : given(c, "--tokens") ? "--tokens" : "--routing");
        return -1;
    }
    /* The suite's skewed cases take --skew too. */
    if (given(c, "--skew") && o->routing != COMETI_ROUTING_SKEWED && !o->suite) {
        fprintf(stderr, "comet %s: --skew sets skewed routing's load ratio, but the routing is %s: give --routing "
                "skewed with it, or leave --skew out\n", cmd, o->routing == COMETI_ROUTING_RANDOM ? "random" : "balanced");
        return -1;
    }
    if (c->id_file && c->ranks) {
        fprintf(stderr, "comet %s: --ranks with --id-file: the external launcher's WORLD_SIZE is the number of ranks\n",
                cmd);
        return -1;
    }
    return 0;
}

/* What the flags left to choose: the presets (gemm and the suite: all of them; else
 * mixtral-8x7b) and tune's file. */
static void choose_defaults(cli_t *c)
{
    tool_options_t *o = &c->o;
    const int shape = o->hidden || o->ffn || o->experts || o->top_k;
    if (c->cmd->bit == CMD_TUNE && !o->tune_out) o->tune_out = "comet-tuning.txt";
    if (!shape && !o->npresets && (c->cmd->bit & (BT | CMD_GEMM))) {
        const flag_t *f = find_flag("--preset", c->cmd->bit);
        f->parse(f, c->cmd->bit == CMD_GEMM || o->suite ? "all" : "mixtral-8x7b", c);
    }
}

/* ------------------------------------------------------------------------------------ */
/* The cases' configs, checked by the library's own rules before any rank starts. */

/* Case i's config as the rank bodies build it (cmd_bench.c, cmd_gemm.c): a preset or the
 * explicit shape, at --tokens (the suite: at its largest), with --ep and --tp. */
static comet_moe_config_t case_config(const cli_t *c, int i)
{
    const tool_options_t *o = &c->o;
    const int tokens = o->suite ? SUITE_MAX_TOKENS : o->tokens;
    comet_moe_config_t cfg = COMET_MOE_CONFIG_INIT;
    if (o->npresets) {
        comet_moe_config_preset(o->presets[i], tokens, &cfg);
    } else {
        cfg.hidden = o->hidden, cfg.ffn = o->ffn, cfg.num_experts = o->experts, cfg.top_k = o->top_k;
        cfg.max_tokens = tokens;
    }
    cfg.ep_size = o->ep;
    cfg.tp_size = o->tp;
    return cfg;
}

/* Rewrites the config's field names in validate's message as the flags that set them:
 * "config.hidden = 100: must be ..." reads "--hidden 100: must be ...". */
static void name_flags(const char *msg, char *out, size_t len)
{
    static const char *map[][2] = {
        {"config.hidden", "--hidden"},   {"config.ffn", "--ffn"},           {"config.num_experts", "--experts"},
        {"config.top_k", "--top-k"},     {"config.max_tokens", "--tokens"}, {"config.ep_size", "--ep"},
        {"config.tp_size", "--tp"},      {"num_experts", "--experts"},      {"top_k", "--top-k"},
        {"max_tokens", "--tokens"},      {"ep_size", "--ep"},               {"tp_size", "--tp"},
    };
    const size_t nmap = sizeof(map) / sizeof(map[0]);
    size_t n = 0;
    while (*msg && n + 1 < len) {
        const char **hit = NULL;
        for (size_t k = 0; k < nmap && !hit; k++)
            if (!strncmp(msg, map[k][0], strlen(map[k][0]))) hit = map[k];
        if (!hit) {
            out[n++] = *msg++;
            continue;
        }
        n += snprintf(out + n, len - n, "%s", hit[1]);
        if (n >= len) n = len - 1;
        msg += strlen(hit[0]);
        if (!strncmp(msg, " = ", 3)) msg += 2; /* "--hidden 100", not "--hidden = 100" */
    }
    out[n] = '\0';
}

/* Every case's config against a world of `world` ranks; `world_from` says where that number
 * comes from (NULL: the world is not known yet, and only what holds for any world of `world`
 * x k ranks is meant). Exit 2 with validate's sentence, in flags, on the first refusal. */
static int check_cases(const cli_t *c, int world, const char *world_from)
{
    const int ncases = c->o.npresets ? c->o.npresets : 1;
    for (int i = 0; i < ncases; i++) {
        const comet_moe_config_t cfg = case_config(c, i);
        char msg[COMETI_ERR_LEN], named[COMETI_ERR_LEN + 64];
        if (comet_moe_config_validate(&cfg, world, msg, sizeof(msg)) == COMET_SUCCESS) continue;
        name_flags(msg, named, sizeof(named));
        const int about_world = strstr(named, "world") || strstr(named, "--ep") || strstr(named, "--tp");
        fprintf(stderr, "comet %s: %s%s%s%s%s%s\n", c->cmd->name, c->o.npresets ? "--preset " : "",
                c->o.npresets ? c->o.presets[i] : "", c->o.npresets ? ": " : "", named,
                world_from && about_world ? "; the world: " : "", world_from && about_world ? world_from : "");
        return -1;
    }
    return 0;
}

/* The world the flags name: --ranks, else EP x TP when --ep is given (TP defaults to 1);
 * 0 when only the visible GPUs will tell. */
static int flags_world(const cli_t *c, char *from, size_t len)
{
    if (c->ranks) snprintf(from, len, "--ranks %d", c->ranks);
    else if (c->o.ep) snprintf(from, len, "--ep %d x --tp %d", c->o.ep, c->o.tp ? c->o.tp : 1);
    return c->ranks ? c->ranks : c->o.ep ? c->o.ep * (c->o.tp ? c->o.tp : 1) : 0;
}

/* Before anything forks: with the world the flags name, or else with TP x 1, which checks
 * everything that holds for every world (an EP of 1 divides any expert count). */
static int check_cases_early(const cli_t *c)
{
    if (c->cmd->bit == CMD_GEMM)
        return check_cases(c, c->o.ep ? c->o.ep : c->o.fp8 ? 1 : GEMM_EP,
                           "the EP ranks whose experts' GEMMs comet gemm times");
    if (!(c->cmd->bit & BT)) return 0;
    char from[64];
    const int world = flags_world(c, from, sizeof(from));
    return check_cases(c, world ? world : c->o.tp ? c->o.tp : 1, world ? from : NULL);
}

/* Whether the run will be able to write `path`, found now rather than after the run: it
 * opens for appending (a file that did not exist is removed again), and with `renamed`
 * its directory takes new files too (the tuning file is replaced by renaming PATH.tmp
 * over it). */
static int check_writable(const cli_t *c, const char *flag, const char *path, int renamed)
{
    if (!path) return 0;
    const int existed = access(path, F_OK) == 0;
    FILE *f = fopen(path, "a");
    if (!f) {
        fprintf(stderr, "comet %s: %s %s: cannot be written: %s\n", c->cmd->name, flag, path, strerror(errno));
        return -1;
    }
    fclose(f);
    if (!existed) remove(path);
    char dir[4096] = ".";
    const char *slash = strrchr(path, '/');
    if (slash == path) snprintf(dir, sizeof(dir), "/");
    else if (slash) snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    if (renamed && access(dir, W_OK | X_OK)) {
        fprintf(stderr, "comet %s: %s %s: its directory %s takes no new files: %s\n", c->cmd->name, flag, path, dir,
                strerror(errno));
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Running it. */

static int print_presets(void)
{
    printf("%-16s %8s %6s %8s %8s\n", "preset", "experts", "top-k", "hidden", "ffn");
    for (int i = 0; comet_moe_preset_name(i); i++) {
        comet_moe_config_t c;
        comet_moe_config_preset(comet_moe_preset_name(i), 1, &c);
        printf("%-16s %8d %6d %8d %8d\n", comet_moe_preset_name(i), c.num_experts, c.top_k, c.hidden, c.ffn);
    }
    return 0;
}

static cometi_rank_main_t rank_body(const cli_t *c)
{
    return c->cmd->bit & BT ? bench_rank : c->cmd->bit == CMD_BANDWIDTH ? bandwidth_rank : gemm_rank;
}

/* No usable GPU: the probe's sentence ("no GPU found: no NVIDIA driver is installed", ...). */
static int no_gpu(const cli_t *c, const char *why)
{
    fprintf(stderr, "comet %s: %s; comet %s needs at least one Hopper GPU\n", c->cmd->name, why, c->cmd->name);
    return TOOL_EXIT_NO_GPU;
}

/* This process as one rank of an external launcher's world (WORLD_SIZE). The GPUs are
 * probed first, as for the local launcher, so that a machine without one says so in the
 * same words and rank 0 publishes no id file for a run that cannot start. */
static int launch_external(cli_t *c)
{
    const char *ws = getenv("WORLD_SIZE");
    long world;
    char from[64], why[256];
    const int sized = ws && !whole_long(ws, &world) && world >= 1 && world <= INT_MAX;
    if (sized) {
        snprintf(from, sizeof(from), "WORLD_SIZE=%ld (--id-file)", world);
        if ((c->cmd->bit & BT) && check_cases(c, (int)world, from)) return TOOL_EXIT_USAGE;
    }
    /* Without RANK and WORLD_SIZE the launcher's own refusal (exit 2) comes first. */
    if (sized && getenv("RANK") && cometi_probe_gpus(why, sizeof(why)) == 0) return no_gpu(c, why);
    char report[600];
    const int rc = cometi_launch_external(c->id_file, rank_body(c), &c->o, 0, report, sizeof(report));
    if (rc) fprintf(stderr, "comet %s: %s\n", c->cmd->name, report[0] ? report : "this rank failed");
    return rc;
}

/* One forked rank per GPU: as many as the flags name, or every visible GPU; the cases are
 * checked again with that world before the ranks start. */
static int launch_local(cli_t *c)
{
    char why[256], from[64] = "";
    const int gpus = cometi_probe_gpus(why, sizeof(why));
    if (gpus == 0) return no_gpu(c, why);
    int ranks = c->cmd->bit == CMD_GEMM ? 1 : flags_world(c, from, sizeof(from));
    if (ranks > gpus) {
        fprintf(stderr, "comet %s: %s: %d ranks, but %d Hopper GPU%s visible\n", c->cmd->name, from, ranks, gpus,
                gpus > 1 ? "s are" : " is");
        return TOOL_EXIT_NO_GPU;
    }
    if (ranks == 0) {
        ranks = gpus;
        snprintf(from, sizeof(from), "%d visible GPU%s", gpus, gpus > 1 ? "s" : "");
    }
    if ((c->cmd->bit & BT) && check_cases(c, ranks, from)) return TOOL_EXIT_USAGE;
    char report[600];
    const int rc = cometi_launch_local(ranks, rank_body(c), &c->o, 0, report, sizeof(report));
    if (rc) fprintf(stderr, "comet %s: %s\n", c->cmd->name, report);
    return rc;
}

int main(int argc, char **argv)
{
    /* No NVLink multicast unless the user asks for it: comet does not use it, and it can
     * take a shared host's GPUs out of service (`comet help` says so). */
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        usage_all(stderr);
        return TOOL_EXIT_USAGE;
    }
    if (!strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))
        return help_command(argc, argv);
    const command_t *cmd = find_command(strcmp(argv[1], "--version") ? argv[1] : "version");
    if (!cmd) {
        fprintf(stderr, "comet: unknown command \"%s\"; the commands:", argv[1]);
        for (int i = 0; i < NCOMMANDS; i++) fprintf(stderr, " %s", commands[i].name);
        fprintf(stderr, " (comet help describes them)\n");
        return TOOL_EXIT_USAGE;
    }
    cli_t c;
    set_defaults(&c, cmd);
    const int parsed = parse_args(argc, argv, &c);
    if (parsed == PARSE_HELP) {
        usage_command(stdout, cmd);
        return 0;
    }
    if (parsed != PARSED) return TOOL_EXIT_USAGE;
    if (cmd->bit == CMD_VERSION) {
        printf("comet %s\n", comet_version_string());
        return 0;
    }
    if (cmd->bit == CMD_PRESETS) return print_presets();
    if (check_combinations(&c)) return TOOL_EXIT_USAGE;
    choose_defaults(&c);
    if (check_cases_early(&c) || check_writable(&c, "--out", c.o.tune_out, 1) ||
        check_writable(&c, "--json", c.o.json, 0))
        return TOOL_EXIT_USAGE;
    /* The library's environment variables, checked by the library's own table (params.h)
     * as comet_comm_create will check them, but now, before any GPU or NCCL is touched. */
    char env_err[COMETI_ERR_LEN];
    if (cometi_params_load(env_err) != COMET_SUCCESS) {
        fprintf(stderr, "comet %s: %s\n", cmd->name, env_err);
        return TOOL_EXIT_USAGE;
    }
    return c.id_file ? launch_external(&c) : launch_local(&c);
}
