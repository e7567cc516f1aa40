/*
 * tune.h - how the fused path picks its run-time settings: a cost model from the layer's
 * sizes and rates measured on H200 (docs/PERF.md), or a tuning file that overrides it
 * ($COMET_TUNING_FILE). Host code only, no CUDA calls: the CPU tests cover it.
 */
#ifndef COMET_TUNE_H
#define COMET_TUNE_H

#include "layer1.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cometi_knobs {
    cometi_layer0_knobs_t l0;
    cometi_layer1_knobs_t l1;
} cometi_knobs_t;

/* The cost model: settings for `cfg` on `world` GPUs of `sm_count` SMs, balanced routing
 * assumed. Layer0: enough dispatch blocks to push this rank's remote rows within GEMM0's
 * time at the copy rate dispatch blocks reach beside the GEMM. Layer1: the combine after
 * GEMM1 on every SM, unless that tail would be long against GEMM1 (then the push). */
void cometi_model_knobs(const comet_moe_config_t *cfg, int world, int sm_count, cometi_knobs_t *out);

/*
 * Tuning file: text, one setting per line, '#' starts a comment:
 *   world[tpT] experts top_k hidden ffn max_tokens : dispatch_blocks bulk|stores combine_blocks splits static|dynamic tail|notail|push
 * (the first field: the world size, with "tpT" after it for T > 1 tensor-parallel ranks
 * per group, e.g. "2tp2"; the last: how layer1 ends, see cometi_layer1_knobs_t; what
 * `comet bench` prints as "tuning line" for the best of its sweeps). A layer takes the
 * line of its world, tp, experts, top_k, hidden and ffn whose max_tokens is closest to
 * its own. Returns 1 and fills *out when a line matches, 0 when none does, -1 with `err`
 * naming the line and field when the file cannot be read or a line is malformed.
 */
int cometi_tuning_lookup(const char *path, const comet_moe_config_t *cfg, int world, cometi_knobs_t *out, char *err,
                         size_t err_len);

/* Write the line for these settings into the tuning file at `path` (made if missing): it
 * replaces the line of the same world, tp, experts, top_k, hidden, ffn and max_tokens, and
 * every other line (comments included) is kept. The file is replaced in one rename, so a
 * reader never sees half of it. 0, or -1 with `err` set. */
int cometi_tuning_update(const char *path, const comet_moe_config_t *cfg, int world, const cometi_knobs_t *k,
                         char *err, size_t err_len);

/* The tuning line for these settings (no newline); `buf` of at least 160 bytes. */
void cometi_tuning_line(const comet_moe_config_t *cfg, int world, const cometi_knobs_t *k, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* COMET_TUNE_H */
