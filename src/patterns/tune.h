/*
 * tune.h - the fused path's settings and every heuristic that picks one: the settings of
 * the two fused operators (what `comet tune` sweeps), the cost model that picks them from
 * the layer's sizes and rates measured on H200, the tuning file that overrides it
 * ($COMET_TUNING_FILE), and the smaller rules the operators follow (the first wave, the
 * head). The operators execute what these pick. Host code only, no CUDA calls: the CPU
 * tests cover it.
 */
#ifndef COMET_TUNE_H
#define COMET_TUNE_H

#include "base/host.h"
#include "comm/dispatch.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The settings of one dispatch -> GEMM call (layer0). */
typedef struct cometi_dispatch_knobs {
    int dispatch_blocks; /* SMs that copy rows; the rest compute */
    int dispatch_mode;   /* COMETI_DISPATCH_* (comm/dispatch.h) */
    int first_wave;      /* tp 1: the first wave's row blocks: 0 automatic (cometi_first_wave_blocks),
                          * -1 none, n > 0 exactly n (tests) */
} cometi_dispatch_knobs_t;

/* The settings of one GEMM -> combine call (layer1); n_splits must be the same on every rank. */
typedef struct cometi_combine_knobs {
    int combine_blocks; /* SMs that combine beside the GEMM; the rest compute. 0: none, the
                         * tail kernel combines every split after the GEMM (no overlap) */
    int n_splits;       /* column splits of GEMM1: divides its column tiles, 1 where hidden is not a
                         * multiple of the tile (cometi_gemm_tile_n) */
    int dynamic_tiles;  /* GEMM tiles from a shared counter, else the static split */
    int tail;           /* the last split's combine runs after the GEMM on every SM, not on
                         * the combine blocks (implied by combine_blocks = 0) */
    int push;           /* GEMM1's epilogue sends each finished tile's rows to their token
                         * owners (every choice its own slot, no pre-sum), and the owner sums
                         * them after: the communication rides in the GEMM on no SM of its
                         * own. Needs combine_blocks = 0 and n_splits = 1, and the same value
                         * on every rank (comet_moe_forward's ranks compare their settings).
                         * The only ending with TP > 1 (the others pre-sum per rank; they
                         * return COMET_NOT_SUPPORTED: the tuning file and the cost model never
                         * pick them with TP). Its sum order (by choice) differs from the
                         * combine's (by rank), so its bits do too. */
} cometi_combine_knobs_t;

typedef struct cometi_knobs {
    cometi_dispatch_knobs_t l0;
    cometi_combine_knobs_t l1;
} cometi_knobs_t;

/* Rates measured by `comet bench`'s sweeps on 2 x H200 (EP 2, the presets at 8192 tokens
 * per GPU): our grouped GEMM at 650-790 TFLOP/s; dispatch blocks copy about 8 GB/s per SM
 * beside the GEMM (the fewest blocks that kept layer0 within noise of its best); the
 * combine on every SM after GEMM1 reads its output at about 0.7 TB/s (134 MB in 188-290
 * us). */
#define COMETI_MODEL_GEMM_FLOPS 700e12
/* The FP8 GEMMs' speed over bf16's (comet gemm --fp8, one H200: 1.19-1.46x); an FP8 row is
 * hidden bytes and its scales (cometi_fp8_row_bytes) instead of 2 x hidden. */
#define COMETI_MODEL_FP8_GEMM_SPEEDUP 1.35
#define COMETI_MODEL_DISPATCH_BYTES_PER_SM 8e9
#define COMETI_MODEL_TAIL_BYTES 0.7e12
/* The push (rows sent home from GEMM1's epilogue, summed by the owner after) beat the tail
 * where the tail reaches 0.39 and 0.71 of GEMM1 (qwen2-57b-a14b even, qwen2-moe-2.7b by
 * 1.47x), and it beat every setting with combine blocks beside the GEMM. Once its epilogue
 * sent whole parts as tensor stores it won at 0.16 too (phi-3.5-moe, 2%), and once the
 * other parts were stored from registers at 0.07 (mixtral-8x7b: 1.6% on the whole layer,
 * timed in turns). The threshold keeps the tail for shapes with even less to send. */
#define COMETI_MODEL_PUSH_SHARE 0.05
/* One GPU alone copies every row into its receive buffer, locally: the best counts of
 * `comet bench --ranks 1`'s sweeps on one H200 at 8192 tokens (4-8 blocks on mixtral-8x7b,
 * qwen2-57b-a14b and gpt-oss-120b, 6-16 on qwen2-moe-2.7b, where 4 lost 20%) fit a local
 * copy at twice the per-SM rate of a copy to a peer. */
#define COMETI_MODEL_LOCAL_COPY_SPEEDUP 2.0
/* The dispatch block counts the model picks from: even, in the range the sweeps measured. */
#define COMETI_MODEL_MIN_DISPATCH 4
#define COMETI_MODEL_MAX_DISPATCH 24

/*
 * The cost model: settings for `cfg` on `world` GPUs of `sm_count` SMs, balanced routing
 * assumed. Per rank, with tp = max(cfg->tp_size, 1), F = ffn / tp, H = hidden and
 * rows = max_tokens x top_k x tp (the same FLOPs as EP), bf16 rows of 2H bytes:
 *   GEMM0 (gate and up)  2 x rows x 2F x H / COMETI_MODEL_GEMM_FLOPS seconds
 *   the dispatch copy    rows x share x 2H bytes, at COMETI_MODEL_DISPATCH_BYTES_PER_SM per
 *                        dispatch block; share = (world - 1) / world (the remote rows), 1
 *                        with TP (every row goes to the tp ranks of its group), and on one
 *                        GPU 1 / COMETI_MODEL_LOCAL_COPY_SPEEDUP (every row, copied locally)
 *   GEMM1 (down)         2 x rows x F x H / COMETI_MODEL_GEMM_FLOPS seconds
 *   the tail             rows x 2H bytes read back at COMETI_MODEL_TAIL_BYTES
 * Layer0, copy mode bulk: the fewest even dispatch blocks in COMETI_MODEL_MIN_DISPATCH..
 * COMETI_MODEL_MAX_DISPATCH whose copy takes no longer than GEMM0 (the largest where none
 * does), at most sm_count / 4 (at least 1). Layer1, dynamic tiles, no combine blocks, 1
 * split: the push where tp > 1 (only it sums TP partials), or where the tail would take
 * more than COMETI_MODEL_PUSH_SHARE of GEMM1; else the tail on every SM. On one GPU the
 * push sends nothing, but its epilogue still stores each row to its owner's slot once,
 * where the tail reads GEMM1's output back (world-1 sweeps: the push 1.6-25% faster on
 * four presets, 0.4% slower on qwen2-57b-a14b).
 * Every time grows with rows alike, so the picks do not depend on max_tokens or top_k.
 */
void cometi_model_knobs(const comet_moe_config_t *cfg, int world, int sm_count, cometi_knobs_t *out);

/*
 * Tuning file: text, one setting per line, '#' starts a comment:
 *   world[tpT] experts top_k hidden ffn max_tokens : dispatch_blocks bulk|stores combine_blocks splits static|dynamic tail|notail|push
 * (the first field: the world size, with "tpT" after it for T > 1 tensor-parallel ranks
 * per group, e.g. "2tp2"; the last: how layer1 ends, see cometi_combine_knobs_t; what
 * `comet bench` prints as "tuning line" for the best of its sweeps). A layer takes the
 * line of its world, tp, experts, top_k, hidden and ffn whose max_tokens is closest to
 * its own. Every line is checked when the file is read, whichever layer it is for, against
 * what the operators accept on a GPU of `sm_count` SMs (dispatch blocks 1..SMs-1, combine
 * blocks 0..SMs-1, splits 1..COMETI_MAX_SPLITS dividing the column tiles of its hidden, the
 * push with 0 combine blocks and 1 split, only the push with tp > 1): a file is written by
 * `comet bench` for the GPU it ran on, and a line that could not run there is a mistake to
 * report now, not mid-call. Returns 1 and fills *out when a line matches, 0 when none
 * does, -1 with `err` naming the file, the line, the field, its value and its limit when a
 * line is wrong, or the path and why when it is not a readable regular file. With `cfg`
 * NULL no line matches and every line is only checked, and with `sm_count` 0 the limits
 * that need the GPU's SM count are left out: how the environment's check (params.h) reads
 * the file before any GPU is known.
 */
int cometi_tuning_lookup(const char *path, const comet_moe_config_t *cfg, int world, int sm_count,
                         cometi_knobs_t *out, char *err, size_t err_len);

/* Write the line for these settings into the tuning file at `path` (made if missing): it
 * replaces the line of the same world, tp, experts, top_k, hidden, ffn and max_tokens, and
 * every other line (comments included) is kept. The file is replaced in one rename, so a
 * reader never sees half of it. 0, or -1 with `err` set. */
int cometi_tuning_update(const char *path, const comet_moe_config_t *cfg, int world, const cometi_knobs_t *k,
                         char *err, size_t err_len);

/* The tuning line for these settings (no newline); `buf` of at least 160 bytes. */
void cometi_tuning_line(const comet_moe_config_t *cfg, int world, const cometi_knobs_t *k, char *buf, size_t len);

/* The forward's small batches: where a balanced expert's rows (tokens x world x top_k /
 * experts) are at most this, the layer's GEMMs run the ping-pong schedule (64-row tiles,
 * each consumer warpgroup its own, one's epilogue beside the other's MMAs) instead of two
 * warpgroups on a 128-row tile, half of it empty. comet gemm --fp8 on one H100, each GEMM
 * alone: at 1-32 rows an expert ping-pong took 5-12% less time in FP8 and 2-7% in bf16
 * (qwen2-moe-2.7b, mixtral-8x7b, gpt-oss-120b), at 64 (gpt-oss-120b) 4-8% less; at 128
 * it was level (qwen2-moe-2.7b) or 5-10% slower (mixtral-8x7b), and at 512 slower by 30%
 * and more, its MMAs no longer beside the other warpgroup's promotion or epilogue. */
#define COMETI_MODEL_PINGPONG_ROWS 64

/* Whether the forward's GEMMs of a call of `num_tokens` tokens per rank on `world` ranks
 * take the ping-pong schedule (COMETI_MODEL_PINGPONG_ROWS). */
int cometi_model_pingpong(int num_tokens, int world, int top_k, int num_experts);

/* SMs the first-wave GEMM leaves to the route's kernels and the fused kernel's first
 * blocks; it takes (SMs - these) / column tiles row blocks. */
#define COMETI_FIRST_WAVE_FREE_SMS 32
/* The fewest row blocks for which the first wave pays. */
#define COMETI_FIRST_WAVE_MIN_BLOCKS 4

/* The first wave of a dispatch -> GEMM call at tp 1 (layer0): this rank's own rows of its
 * first expert, `return` whole 128-row blocks of them, copied and computed on a stream of
 * its own while the route exchanges counts (0: none). `requested` is the knob (0
 * automatic, -1 none, n > 0 exactly n); `enabled` is $COMET_FIRST_WAVE. Automatic: what
 * (SMs - COMETI_FIRST_WAVE_FREE_SMS) take at once, on only from COMETI_FIRST_WAVE_MIN_BLOCKS
 * blocks. None, asked for or not, where the call's rows (tokens x top-k, this rank's rows
 * of its first expert at most) make no whole block: the fork would be all it adds. */
int cometi_first_wave_blocks(int requested, int enabled, int tp, int sm_count, int dispatch_blocks, int col_tiles,
                             long long rows);

/* The head of a dispatch -> GEMM call at tp 1: the pieces of this rank's own rows that
 * every GEMM block copies a share of at the kernel's start (the rows the first two waves
 * of tiles need: a wave of gemm_blocks tiles covers a band of group_m row tiles, or more
 * rows where a row has fewer column tiles than the wave), at most
 * COMETI_DISPATCH_HEAD_MAX_PIECES. 0 with tp > 1. */
int cometi_head_pieces(int tp, int group_m, int gemm_blocks, int col_tiles);

#ifdef __cplusplus
}
#endif

#endif /* COMET_TUNE_H */
