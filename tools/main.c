/*
 * main.c - the command-line tool: parses a subcommand and its flags, then runs it
 * on one process per GPU (forked here, before any CUDA call) or, under an external
 * launcher, on this process as one rank.
 *
 *   comet bench      the MoE layer: comet beside the sequential baseline
 *   comet bandwidth  push and pull bandwidth between GPUs over NVLink (and a local copy)
 *   comet gemm       comet's grouped GEMM beside cuBLAS on the presets' expert shapes
 *   comet presets    the model shapes comet knows
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comet.h"
#include "tool.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: comet <command> [flags]\n"
            "\n"
            "commands:\n"
            "  bench       time the MoE layer: comet beside the sequential baseline (default: mixtral-8x7b,\n"
            "              8192 tokens per GPU, every visible GPU)\n"
            "  tune        bench's sweeps, and the best settings of each case written into a tuning file\n"
            "              (--out FILE, [comet-tuning.txt]; bench's flags); comet_moe_forward loads it when\n"
            "              COMET_TUNING_FILE names it\n"
            "  bandwidth   push (stores) and pull (loads) bandwidth between GPUs through symmetric memory, the\n"
            "              same copy in local memory, and the copy engine's push\n"
            "  gemm        comet's grouped GEMM beside cuBLAS on one GPU: every preset's expert GEMMs\n"
            "              (rows as balanced EP=2 routing of --tokens gives) and 8192^3; --preset, --iters, --sweep\n"
            "  presets     list the model presets\n"
            "  version     print the version\n"
            "\n"
            "bench flags:\n"
            "  --preset NAME[,NAME...]  model shapes, or 'all' (see comet presets)    [mixtral-8x7b]\n"
            "  --hidden H --ffn F --experts E --top-k K   explicit shape instead of a preset\n"
            "  --tokens M               tokens per GPU                                  [8192]\n"
            "  --ep N --tp N            expert- and tensor-parallel sizes, EP x TP = ranks [ranks, 1]\n"
            "  --routing KIND           balanced | random | skewed                      [balanced]\n"
            "  --skew S                 skewed: most / least loaded expert's expected load [8]\n"
            "  --impl WHICH             baseline | comet | all                          [all]\n"
            "  --warmup N --iters N     untimed and timed calls                         [5, 20]\n"
            "  --no-check               skip the float64 check of sample tokens\n"
            "  --suite                  every preset (or those of --preset) x 1024..16384 tokens x balanced and\n"
            "                           skewed routing, comet's default settings, no sweeps; ends with a table\n"
            "  --json FILE              also write the results as JSON\n"
            "  --seed S                 inputs' seed                                    [from the clock]\n"
            "  --trace                  also print, on every rank, where the fused kernels' time goes per SM against\n"
            "                           our GEMM alone's (launch, dispatch, waits for rows, tiles, tail), and with\n"
            "                           combine blocks layer1's combine timeline\n"
            "  --train                  also time training, each case's last, the baseline's then comet's:\n"
            "                           comet_moe_forward_train, comet_moe_backward (bf16 weight gradients), the\n"
            "                           two as one step, comet's backward GEMMs alone; comet's step vs the\n"
            "                           baseline's in turns and its dx vs the baseline's; n/a where an impl does\n"
            "                           not serve a call (bench only; with --suite too)\n"
            "bandwidth flags:\n"
            "  --mib N                  bytes per transfer, MiB                         [256]\n"
            "gemm flags:\n"
            "  --sweep                  also every variant of ours, a line each: epilogues, tile orders, grid sizes,\n"
            "                           the shared tile counter, two column splits, no cut of the last wave\n"
            "common flags:\n"
            "  --ranks N                processes, one per GPU                          [every visible GPU]\n"
            "  --timeout-ms T           device-side wait limit                          [5000]\n"
            "  --id-file PATH           run as one rank under an external launcher (torchrun, mpirun,\n"
            "                           srun) that sets RANK, WORLD_SIZE and LOCAL_RANK; rank 0 writes the\n"
            "                           NCCL id to PATH (which must not exist yet), the others read it\n");
}

static int parse_int(const char *flag, const char *v, int lo, int hi, int *out)
{
    char *end;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || *end || x < lo || x > hi) {
        fprintf(stderr, "comet: %s %s: expected a whole number in %d..%d\n", flag, v ? v : "(missing)", lo, hi);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int parse_presets(char *list, tool_options_t *o)
{
    o->npresets = 0;
    if (!strcmp(list, "all")) {
        for (int i = 0; comet_moe_preset_name(i) && o->npresets < TOOL_MAX_PRESETS; i++)
            if (strcmp(comet_moe_preset_name(i), "tiny")) o->presets[o->npresets++] = comet_moe_preset_name(i);
        return 0;
    }
    for (char *name = strtok(list, ","); name; name = strtok(NULL, ",")) {
        comet_moe_config_t c;
        if (comet_moe_config_preset(name, 1, &c) != COMET_SUCCESS) {
            fprintf(stderr, "comet: --preset: %s\n", comet_last_create_error());
            return -1;
        }
        if (o->npresets == TOOL_MAX_PRESETS) {
            fprintf(stderr, "comet: --preset: at most %d presets\n", TOOL_MAX_PRESETS);
            return -1;
        }
        o->presets[o->npresets++] = name;
    }
    return 0;
}

int main(int argc, char **argv)
{
    /* Never NVLink multicast: it can take a shared host's GPUs out of service. */
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "version")) {
        printf("comet %s\n", comet_version_string());
        return 0;
    }
    if (!strcmp(cmd, "presets")) {
        printf("%-16s %8s %6s %8s %8s\n", "preset", "experts", "top-k", "hidden", "ffn");
        for (int i = 0; comet_moe_preset_name(i); i++) {
            comet_moe_config_t c;
            comet_moe_config_preset(comet_moe_preset_name(i), 1, &c);
            printf("%-16s %8d %6d %8d %8d\n", comet_moe_preset_name(i), c.num_experts, c.top_k, c.hidden, c.ffn);
        }
        return 0;
    }
    int is_bench = !strcmp(cmd, "bench") || !strcmp(cmd, "tune"), is_bw = !strcmp(cmd, "bandwidth"),
        is_gemm = !strcmp(cmd, "gemm");
    if (!is_bench && !is_bw && !is_gemm) {
        fprintf(stderr, "comet: unknown command \"%s\"\n\n", cmd);
        usage(stderr);
        return 2;
    }
    static char preset_default[] = "mixtral-8x7b";
    tool_options_t o;
    memset(&o, 0, sizeof(o));
    o.tokens = 8192;
    o.routing = COMETI_ROUTING_BALANCED;
    o.skew = 8;
    o.run_baseline = o.run_comet = 1;
    o.warmup = 5;
    o.iters = 20;
    o.check = 1;
    o.mib = 256;
    o.seed = ((uint64_t)time(NULL) << 16) ^ (uint64_t)getpid();
    int ranks = 0;
    const char *id_file = NULL;
    char *preset_arg = NULL;
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int used = 1, bad = 0;
        if (!strcmp(f, "--preset")) preset_arg = (char *)v;
        else if (!strcmp(f, "--hidden")) bad = parse_int(f, v, 64, 65536, &o.hidden);
        else if (!strcmp(f, "--ffn")) bad = parse_int(f, v, 64, 65536, &o.ffn);
        else if (!strcmp(f, "--experts")) bad = parse_int(f, v, 1, 1024, &o.experts);
        else if (!strcmp(f, "--top-k")) bad = parse_int(f, v, 1, 32, &o.top_k);
        else if (!strcmp(f, "--tokens")) bad = parse_int(f, v, 1, 1 << 20, &o.tokens);
        else if (!strcmp(f, "--ep")) bad = parse_int(f, v, 1, 72, &o.ep);
        else if (!strcmp(f, "--tp")) bad = parse_int(f, v, 1, 72, &o.tp);
        else if (!strcmp(f, "--warmup")) bad = parse_int(f, v, 0, 10000, &o.warmup);
        else if (!strcmp(f, "--iters")) bad = parse_int(f, v, 1, 100000, &o.iters);
        else if (!strcmp(f, "--ranks")) bad = parse_int(f, v, 1, 72, &ranks);
        else if (!strcmp(f, "--mib")) bad = parse_int(f, v, 1, 16384, &o.mib);
        else if (!strcmp(f, "--timeout-ms")) bad = parse_int(f, v, 1, 3600000, &o.timeout_ms);
        else if (!strcmp(f, "--json")) o.json = v;
        else if (!strcmp(f, "--out") && !strcmp(cmd, "tune")) o.tune_out = v;
        else if (!strcmp(f, "--id-file")) id_file = v;
        else if (!strcmp(f, "--seed")) o.seed = v ? strtoull(v, NULL, 0) : 0;
        else if (!strcmp(f, "--skew")) {
            o.skew = v ? atof(v) : 0;
            if (!(o.skew >= 1)) {
                fprintf(stderr, "comet: --skew %s: expected a number >= 1\n", v ? v : "(missing)");
                bad = 1;
            }
        } else if (!strcmp(f, "--routing")) {
            if (v && !strcmp(v, "balanced")) o.routing = COMETI_ROUTING_BALANCED;
            else if (v && !strcmp(v, "random")) o.routing = COMETI_ROUTING_RANDOM;
            else if (v && !strcmp(v, "skewed")) o.routing = COMETI_ROUTING_SKEWED;
            else {
                fprintf(stderr, "comet: --routing %s: expected balanced, random or skewed\n", v ? v : "(missing)");
                bad = 1;
            }
        } else if (!strcmp(f, "--impl")) {
            if (v && !strcmp(v, "baseline")) o.run_comet = 0;
            else if (v && !strcmp(v, "comet")) o.run_baseline = 0;
            else if (!v || strcmp(v, "all")) {
                fprintf(stderr, "comet: --impl %s: expected baseline, comet or all\n", v ? v : "(missing)");
                bad = 1;
            }
        } else if (!strcmp(f, "--no-check")) {
            o.check = 0;
            used = 0;
        } else if (!strcmp(f, "--suite")) {
            o.suite = 1;
            used = 0;
        } else if (!strcmp(f, "--train") && !strcmp(cmd, "bench")) {
            o.train = 1;
            used = 0;
        } else if (!strcmp(f, "--trace") && is_bench) {
            o.trace = 1;
            used = 0;
        } else if (!strcmp(f, "--sweep") && is_gemm) {
            o.sweep = 1;
            used = 0;
        } else {
            fprintf(stderr, "comet: unknown flag \"%s\" (comet help lists them)\n", f);
            return 2;
        }
        if (bad) return 2;
        if (used && !v) {
            fprintf(stderr, "comet: %s needs a value\n", f);
            return 2;
        }
        i += used;
    }
    int explicit_shape = o.hidden || o.ffn || o.experts || o.top_k;
    if (explicit_shape && preset_arg) {
        fprintf(stderr, "comet: give --preset or --hidden/--ffn/--experts/--top-k, not both\n");
        return 2;
    }
    if (explicit_shape && !(o.hidden && o.ffn && o.experts && o.top_k)) {
        fprintf(stderr, "comet: an explicit shape needs all of --hidden, --ffn, --experts and --top-k\n");
        return 2;
    }
    static char all_presets[] = "all";
    if (!strcmp(cmd, "tune")) {
        if (o.suite || !o.run_baseline || !o.run_comet) {
            fprintf(stderr, "comet tune: runs the sweeps beside the baseline: leave out --suite and --impl\n");
            return 2;
        }
        if (!o.tune_out) o.tune_out = "comet-tuning.txt";
    }
    for (int i = 2; o.suite && i < argc; i++)
        if (!strcmp(argv[i], "--tokens") || !strcmp(argv[i], "--routing") || explicit_shape) {
            fprintf(stderr, "comet: --suite runs 1024 to 16384 tokens, both routings, on presets: leave out %s\n",
                    explicit_shape ? "--hidden/--ffn/--experts/--top-k" : argv[i]);
            return 2;
        }
    if (!explicit_shape && parse_presets(preset_arg ? preset_arg : is_gemm || o.suite ? all_presets : preset_default, &o))
        return 2;
    if (is_gemm) {
        if (explicit_shape) {
            fprintf(stderr, "comet gemm: takes presets only (--preset)\n");
            return 2;
        }
        if (o.iters > 64) o.iters = 64;
        ranks = 1; /* one GPU */
    }

    cometi_rank_main_t body = is_bench ? bench_rank : is_bw ? bandwidth_rank : gemm_rank;
    char report[600];
    if (id_file) {
        int rc = cometi_launch_external(id_file, body, &o, 0, report, sizeof(report));
        if (rc) fprintf(stderr, "comet: %s\n", report[0] ? report : "this rank failed");
        return rc;
    }
    char why[256];
    int gpus = cometi_probe_gpus(why, sizeof(why));
    if (gpus == 0) {
        fprintf(stderr, "comet: no CUDA GPU is visible (%s); comet %s needs at least one Hopper GPU\n", why, cmd);
        return 2;
    }
    if (ranks == 0) ranks = gpus;
    if (ranks > gpus) {
        fprintf(stderr, "comet: --ranks %d: only %d GPU%s visible\n", ranks, gpus, gpus > 1 ? "s are" : " is");
        return 2;
    }
    int rc = cometi_launch_local(ranks, body, &o, 0, report, sizeof(report));
    if (rc) fprintf(stderr, "comet: %s\n", report);
    return rc;
}
