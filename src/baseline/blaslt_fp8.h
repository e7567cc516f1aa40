/*
 * blaslt_fp8.h - the FP8 yardstick GEMM: D_g = dequant(A_g) dequant(B_g)^T per group
 * through cuBLASLt's block scales on Hopper (DeepSeek-V3's recipe: E4M3 values, FP32
 * scales, dequantized = q * scale; A's scales per row and 128 columns of k, B's per
 * 128 x 128 block). The sequential baseline's FP8 path and `comet gemm --fp8` time
 * comet's FP8 GEMMs against it.
 *
 * What cuBLASLt takes (cuBLAS 13 docs, section 3.1.4.5 "128-element 1D and 128x128 2D
 * Block Scaling For FP8 Data Types", and cublasLtMatmul(); the facts and their sources
 * are in docs/ARCHITECTURE.md, "The FP8 yardstick GEMM"):
 *   - CUDA >= 12.9 (cuBLASLt 12.9.0 added VEC128_32F and BLK128x128_32F) on compute
 *     capability 9.0 only; FP8 on Hopper runs only the "TN" form, so in cuBLAS's
 *     column-major terms its A is our B (the weight, [n][k] = op T of a k x n matrix) with
 *     BLK128x128_32F and its B is our A (the rows, [rows][k] = a k x rows matrix) with
 *     VEC128_32F; D is n x rows column-major, our [rows][ldd] row-major;
 *   - compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, D bf16 (FP8 D is not
 *     offered with these modes), fast accumulation off (the partial sums are promoted
 *     to FP32 per block);
 *   - 16-byte aligned operands and rows (k a multiple of 16, ldd of 8), scale tensors
 *     starting 16-byte aligned, and the GEMM's M and N multiples of 4: a group's rows are
 *     computed in multiples of COMETI_BLASLT_FP8_ROWS (below);
 *   - k need not be a multiple of 128: the last scale block covers what is left
 *     (L = ceil(k / 128) blocks).
 */
#ifndef COMET_BASELINE_BLASLT_FP8_H
#define COMET_BASELINE_BLASLT_FP8_H

#include <stdint.h>

#include "base/fp8.h"
#include "base/host.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Each group's rows are computed in multiples of this many (its padding rows included):
 * cuBLASLt's block-scaled GEMMs need N (here a group's rows) a multiple of 4 (cuBLAS
 * docs), and Transformer Engine, which calls them, refuses a 1D-scaled operand whose
 * rows are not a multiple of 8 (an observed requirement, in its words). Raising it is
 * safe: the layouts below follow it. */
#define COMETI_BLASLT_FP8_ROWS 8

/* A handle: a cuBLASLt handle, its matmul descriptor, a workspace, and the layouts and
 * algorithm chosen per shape (n, k, a group's padded rows, ldd, the operands' alignment),
 * so a repeated call costs a table lookup per group. Not for two threads at once. */
typedef struct cometi_blaslt_fp8 cometi_blaslt_fp8_t;

/* On the current device; COMET_NOT_SUPPORTED where cuBLASLt is older than 12.9 or the
 * device is not compute capability 9.0. */
comet_status_t cometi_blaslt_fp8_create(char *err, cometi_blaslt_fp8_t **out);
void cometi_blaslt_fp8_destroy(cometi_blaslt_fp8_t *lt);

/* ---- the layouts (plain C, no device) ----
 *
 * L = ceil(k / 128) scale blocks along k; R_g = rows[g] rounded up to COMETI_BLASLT_FP8_ROWS
 * (0 for a group without rows).
 *
 * A's scales, "packed by group": group g's are one [L][R_g] array (row-major: the R_g
 * rows' scales of k block 0, then of block 1, ...), the groups' arrays one after another
 * in group order, groups without rows taking none. Scale (row r of group g, block b) is at
 *     a_scales[offset[g] + b * R_g + r],   offset[g] = L * (R_0 + ... + R_{g-1}).
 * This is cuBLASLt's VEC128_32F layout for a GEMM of N = R_g rows: "N-major with shape
 * N x L", one array per GEMM (its stride is N, and no attribute sets another), which is
 * why the groups cannot share one [L][all rows] array. A row quantizer that writes scale
 * (r, b) at scales[r * row_stride + b * block_stride] produces it for group g when given
 * scales + offset[g], the group's own row index r, row_stride 1 and block_stride R_g. The
 * entries of the padding rows (r >= rows[g]) are read; any finite value does (their
 * products land in padding rows of D), zero is the tidy choice.
 *
 * B's scales: [groups][ceil(n / 128)][L4], L4 = L rounded up to 4 (cometi_blaslt_fp8_b_scale_ld):
 * block (n block j, k block b) of group g at b_scales[(g * ceil(n / 128) + j) * L4 + b]. This
 * is the HF checkpoints' weight_scale_inv [ceil(n/128)][ceil(k/128)] with each row
 * padded to a multiple of 4 scales (cuBLASLt's BLK128x128_32F: "K-major, the stride between
 * consecutive columns a multiple of 4"); when L is a multiple of 4 the two are the same
 * bytes, else cometi_blaslt_fp8_pad_b_scales makes one from the other (once per weight
 * load, not per call). */

/* R_g: rows rounded up to COMETI_BLASLT_FP8_ROWS. */
int64_t cometi_blaslt_fp8_group_rows(int64_t rows);
/* A's packed scales: each group's offset (floats; NULL to skip) and the total (floats). */
int64_t cometi_blaslt_fp8_a_scales_layout(int groups, const int64_t *rows, int k, int64_t *offset);
/* L4 = ceil(k / 128) rounded up to 4: B's scale row stride, in floats. */
int cometi_blaslt_fp8_b_scale_ld(int k);
/* dst [groups][ceil(n/128)][L4] from src [groups][ceil(n/128)][L] (the HF layout), the
 * padding zeroed, on `stream` (a memset and a 2D copy; src == dst is refused). */
comet_status_t cometi_blaslt_fp8_pad_b_scales(char *err, int groups, int n, int k, const float *src, float *dst,
                                              cudaStream_t stream);

/* ---- the GEMM ---- */

/* D rows of group g = dequant(A rows of g) dequant(B_g)^T, bf16, for each group with
 * rows[g] > 0, one cuBLASLt call each, on `stream`:
 *   a         E4M3 [..][k] row-major, group g's rows from row row_start[g];
 *   a_scales  FP32, packed by group (above);
 *   b         E4M3 [groups][n][k] (nn.Linear's [out][in] per group);
 *   b_scales  FP32 [groups][ceil(n/128)][L4] (above);
 *   d         bf16 [..][ldd] row-major, group g's rows from row row_start[g].
 * Each group is computed over R_g rows: rows row_start[g] + rows[g] .. row_start[g] + R_g - 1
 * of A are read and of D written (its padding rows; their values mean nothing), so both
 * must be the caller's, as the MoE layout's 128-row segment padding is; no other row of
 * D, and no column past n, is written. Groups with rows go in increasing row_start, each
 * starting at or after the previous one's padded end. rows and row_start are host arrays
 * (the baseline learns its counts on the host anyway). Refused, naming the field, the
 * value and the limit: k not a multiple of 16 or n of 8 (COMET_NOT_SUPPORTED: cuBLASLt's
 * FP8 kernels need 16-byte rows), ldd below n or not a multiple of 8, a pointer not
 * 16-byte aligned, a negative count, groups out of order (COMET_INVALID_ARGUMENT). */
comet_status_t cometi_blaslt_fp8_grouped(char *err, cometi_blaslt_fp8_t *lt, int groups, const int64_t *row_start,
                                         const int64_t *rows, int n, int k, const void *a, const float *a_scales,
                                         const void *b, const float *b_scales, void *d, int ldd, cudaStream_t stream);

/* The weight gradients' form (1 x 128 by 1 x 128, VEC128_32F on both operands, as
 * Transformer Engine's blockwise recipe computes its weight gradients): for each group,
 *     D_g [m][n] = dequant(A_g) dequant(B_g)^T  (or D_g += that, accumulate),
 * k running over the group's tokens, columns k_start[g] .. k_start[g] + k_len[g] - 1 of
 *   a         E4M3 [m][lda] (a token-major operand: x^T, dy^T, dh^T ...);
 *   a_scales  FP32 [lda / 128][m]: row r's scale over columns 128 b .. 128 b + 127 at
 *             a_scales[b * m + r] (MN-major, cuBLASLt's VEC128_32F layout: one block
 *             column after another, so a group's start at block k_start / 128 is a pointer);
 *   b, b_scales  the same for B, [n][ldb] and [ldb / 128][n];
 *   d         [groups][m][n] row-major, bf16, or fp32 with d_fp32.
 * k_start and k_len are multiples of 128 (whole scale blocks; the operands' columns past a
 * group's tokens hold zeros, as cometi_quantize_segments_t_e4m3 writes them). A group with
 * k_len 0 gets D_g zeroed, or, accumulating, nothing. Refused, naming the field: m or n not
 * a multiple of 8, lda or ldb not of 16 (COMET_NOT_SUPPORTED for m and n), a group not
 * on 128-column blocks or past lda or ldb, a pointer not 16-byte aligned. */
comet_status_t cometi_blaslt_fp8_wgrad(char *err, cometi_blaslt_fp8_t *lt, int groups, const int64_t *k_start,
                                       const int64_t *k_len, int m, int n, const void *a, int64_t lda,
                                       const float *a_scales, const void *b, int64_t ldb, const float *b_scales,
                                       void *d, int d_fp32, int accumulate, cudaStream_t stream);

/* grouped's checks alone, no device touched (the CPU tests run them). */
comet_status_t cometi_blaslt_fp8_check(char *err, int groups, const int64_t *row_start, const int64_t *rows, int n,
                                       int k, const void *a, const float *a_scales, const void *b,
                                       const float *b_scales, const void *d, int ldd);

/* What cuBLASLt's heuristic chose for the last GEMM the handle ran (its algorithm id,
 * tile, stages, cluster shape, split-k, swizzle, custom option), as one line of text; ""
 * before any. For the tools: cuBLASLt's configuration beside ours where it is faster. */
void cometi_blaslt_fp8_algo_text(const cometi_blaslt_fp8_t *lt, char *buf, size_t len);

/* An FP8 layer's weight-gradient operands, cast along the tokens per expert segment (both
 * paths make them so): E4M3 [cols][ld] (cols H, F, 2F, H), each column's tokens in a row,
 * zeros past each segment's end, scales [ld / 128][cols] (wgrad's MN-major layout); the B
 * operands' (w a)^T and x^T scales exact in bf16 (COMETI_FP8_SCALE_BF16 unless powers of
 * two), with a bf16 copy for comet's GEMM (the `16` arrays); k_start and k_len host
 * scratch of one entry per local expert. */
typedef struct cometi_fp8_wgrad_operands {
    void *dy_t, *wa_t, *dh_t, *x_t;
    float *dy_t_scales, *wa_t_scales, *dh_t_scales, *x_t_scales;
    uint16_t *wa_t_scales16, *x_t_scales16;
    int64_t ld;
    int64_t *k_start, *k_len;
} cometi_fp8_wgrad_operands_t;

/* *o's buffers for `rows` rows (ld: rows rounded up to 128), hidden H, ffn F (per rank),
 * `experts` local experts; *o zeroed before. 0, or the failure in err (`who` starts its
 * message), what was made left for cometi_fp8_wgrad_operands_free: about (2 H + 3 F)
 * bytes a row, and their scales. */
comet_status_t cometi_fp8_wgrad_operands_alloc(char *err, const char *who, int64_t rows, int64_t H, int64_t F,
                                               int experts, cometi_fp8_wgrad_operands_t *o);
void cometi_fp8_wgrad_operands_free(cometi_fp8_wgrad_operands_t *o);
/* The scale rule (cometi_fp8_scale) of what SwiGLU's FP8 backward and the casts of x make
 * for the weight gradients, both paths alike: powers of two with the layer's pow2, else
 * exact in bf16, which comet's weight-gradient GEMM reads (the `16` copies). */
static inline int cometi_wgrad_b_scale_rule(int pow2) { return pow2 ? COMETI_FP8_SCALE_POW2 : COMETI_FP8_SCALE_BF16; }
/* The bf16 copies of o's (w a)^T and x^T scales (all ld / 128 blocks), enqueued on stream. */
comet_status_t cometi_wgrad_b_scales16(char *err, const cometi_fp8_wgrad_operands_t *o, int64_t H, int64_t F,
                                       cudaStream_t stream);

/* The layer's weight gradients through wgrad: dW2 = dy^T (w a) into grads->down ([experts][H]
 * [F]) and dW13 = dh^T x into grads->gate_up ([experts][2F][H]), each skipped where NULL,
 * bf16 written or fp32 added as grads->mode says; expert e's k its segment's rows (segs,
 * host) in whole 128-token blocks. */
comet_status_t cometi_blaslt_fp8_weight_grads(char *err, cometi_blaslt_fp8_t *lt, int experts,
                                              const cometi_segment_t *segs, const cometi_fp8_wgrad_operands_t *o,
                                              int H, int F, const comet_moe_weight_grads_t *grads,
                                              cudaStream_t stream);

/* wgrad's checks alone. */
comet_status_t cometi_blaslt_fp8_wgrad_check(char *err, int groups, const int64_t *k_start, const int64_t *k_len,
                                             int m, int n, const void *a, int64_t lda, const float *a_scales,
                                             const void *b, int64_t ldb, const float *b_scales, const void *d);

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASELINE_BLASLT_FP8_H */
