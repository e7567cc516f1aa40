/*
 * blaslt_fp8.c - the FP8 yardstick GEMM through cuBLASLt's block scales (blaslt_fp8.h
 * says what cuBLASLt takes and where that is written down). One matmul descriptor serves
 * every call: its types, transposes and scale modes never change, only the scale
 * pointers, set before each group's call. The layouts and the algorithm depend on the
 * shape, so they are kept per (n, k, padded rows, ldd, alignments) in a small table:
 * routing changes a group's rows from call to call, but the counts repeat, and a
 * heuristic query costs tens of microseconds of host time a lookup does not.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>

#include "baseline/blaslt_fp8.h"
#include "pointwise/pointwise.h"

/* cuBLAS's recommendation for Hopper (cublasSetWorkspace()): 32 MiB. */
#define WORKSPACE_BYTES ((size_t)32 << 20)
/* Shapes remembered; past this many the oldest is replaced. */
#define CACHE_SLOTS 256

typedef struct shape {
    int n, k, ldd;
    int64_t rows;                   /* the group's padded rows (weight gradients: D's rows): the GEMM's N */
    int64_t lda, ldb;               /* our A's and B's row strides (k in the forward's form) */
    int wgrad, d_fp32;              /* the weight-gradient form (1D x 1D); D in fp32 */
    uint32_t align_a, align_b, align_d; /* the operands' alignment classes (16..256 bytes) */
} shape_t;

typedef struct entry {
    shape_t key;
    int used;
    cublasLtMatrixLayout_t a, b, d; /* cuBLAS's A (our B, the weight), B (our A), D */
    cublasLtMatmulAlgo_t algo;
} entry_t;

struct cometi_blaslt_fp8 {
    cublasLtHandle_t handle;
    cublasLtMatmulDesc_t desc;       /* the forward's form: B's scales 128 x 128, A's 1 x 128 */
    cublasLtMatmulDesc_t desc_wgrad; /* the weight gradients': both operands 1 x 128 along k */
    void *workspace;
    entry_t cache[CACHE_SLOTS];
    int next;           /* the slot the next new shape takes */
    const entry_t *last; /* the shape the last GEMM ran, for cometi_blaslt_fp8_algo_text */
};

static comet_status_t lt_status(char *err, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return COMET_SUCCESS;
    comet_status_t st = COMET_CUDA_ERROR;
    if (s == CUBLAS_STATUS_ALLOC_FAILED) st = COMET_OUT_OF_MEMORY;
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_ARCH_MISMATCH) st = COMET_NOT_SUPPORTED;
    return cometi_fail(err, st, "%s: %s", what, cublasLtGetStatusString(s));
}

/* ---- the layouts ---- */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t cometi_blaslt_fp8_group_rows(int64_t rows)
{
    return rows <= 0 ? 0 : ceil_div(rows, COMETI_BLASLT_FP8_ROWS) * COMETI_BLASLT_FP8_ROWS;
}

int64_t cometi_blaslt_fp8_a_scales_layout(int groups, const int64_t *rows, int k, int64_t *offset)
{
    const int64_t L = ceil_div(k, 128);
    int64_t total = 0;
    for (int g = 0; g < groups; g++) {
        if (offset) offset[g] = total;
        total += L * cometi_blaslt_fp8_group_rows(rows[g]);
    }
    return total;
}

int cometi_blaslt_fp8_b_scale_ld(int k) { return (int)(ceil_div(ceil_div(k, 128), 4) * 4); }

comet_status_t cometi_blaslt_fp8_pad_b_scales(char *err, int groups, int n, int k, const float *src, float *dst,
                                              cudaStream_t stream)
{
    if (groups < 0 || n <= 0 || k <= 0)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: pad_b_scales groups = %d, n = %d, k = %d: "
                           "groups must be >= 0 and n, k > 0", groups, n, k);
    if (!src || !dst || src == dst)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: pad_b_scales src = %p, dst = %p: both needed, "
                           "and apart (the copy cannot pad in place)", (const void *)src, (void *)dst);
    const size_t L = (size_t)ceil_div(k, 128), L4 = (size_t)cometi_blaslt_fp8_b_scale_ld(k);
    const size_t rows = (size_t)groups * (size_t)ceil_div(n, 128);
    if (rows == 0) return COMET_SUCCESS;
    if (L4 != L)
        COMETI_TRY(cometi_cuda(err, cudaMemsetAsync(dst, 0, rows * L4 * sizeof(float), stream),
                               "blaslt fp8: cudaMemsetAsync(B's padded scales)"));
    return cometi_cuda(err, cudaMemcpy2DAsync(dst, L4 * sizeof(float), src, L * sizeof(float), L * sizeof(float),
                                              rows, cudaMemcpyDeviceToDevice, stream),
                       "blaslt fp8: cudaMemcpy2DAsync(B's scales into rows of L4)");
}

/* ---- the checks ---- */

static int misaligned(const void *p) { return ((uintptr_t)p & 15) != 0; }

comet_status_t cometi_blaslt_fp8_check(char *err, int groups, const int64_t *row_start, const int64_t *rows, int n,
                                       int k, const void *a, const float *a_scales, const void *b,
                                       const float *b_scales, const void *d, int ldd)
{
    if (groups < 0)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: groups = %d must be >= 0", groups);
    if (groups > 0 && (!row_start || !rows))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: row_start = %p, rows = %p: both host arrays "
                           "of %d groups are needed", (const void *)row_start, (const void *)rows, groups);
    if (n <= 0 || k <= 0)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: n = %d, k = %d must be > 0", n, k);
    if (k % 16)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "blaslt fp8: k = %d must be a multiple of 16 (cuBLASLt's FP8 "
                           "GEMMs need 16-byte aligned rows of E4M3)", k);
    if (n % 8)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "blaslt fp8: n = %d must be a multiple of 8 (cuBLASLt's block-"
                           "scaled GEMMs need M a multiple of 4; 16-byte rows of D take 8)", n);
    if (ldd < n || ldd % 8)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: ldd = %d must be >= n = %d and a multiple of 8 "
                           "(16-byte aligned rows of bf16 D)", ldd, n);
    int any = 0;
    int64_t end = 0; /* the previous group's padded end */
    int prev = -1;
    for (int g = 0; g < groups; g++) {
        if (rows[g] < 0 || row_start[g] < 0)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: group %d has rows = %lld, row_start = %lld: "
                               "both must be >= 0", g, (long long)rows[g], (long long)row_start[g]);
        if (rows[g] == 0) continue;
        if (rows[g] > INT32_MAX - COMETI_BLASLT_FP8_ROWS)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: group %d has rows = %lld, above the %d "
                               "one GEMM takes", g, (long long)rows[g], INT32_MAX - COMETI_BLASLT_FP8_ROWS);
        if (prev >= 0 && row_start[g] < end)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: group %d starts at row_start = %lld, before "
                               "group %d's padded end %lld (groups go in order, each over its rows rounded up to %d)",
                               g, (long long)row_start[g], prev, (long long)end, COMETI_BLASLT_FP8_ROWS);
        end = row_start[g] + cometi_blaslt_fp8_group_rows(rows[g]);
        prev = g;
        any = 1;
    }
    if (!any) return COMET_SUCCESS;
    const struct { const void *p; const char *name; } ptr[] = {
        {a, "a"}, {a_scales, "a_scales"}, {b, "b"}, {b_scales, "b_scales"}, {d, "d"}};
    for (size_t i = 0; i < sizeof(ptr) / sizeof(ptr[0]); i++)
        if (!ptr[i].p || misaligned(ptr[i].p))
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8: %s = %p must be a 16-byte aligned device "
                               "pointer (cuBLASLt's FP8 operands and scale tensors)", ptr[i].name, ptr[i].p);
    return COMET_SUCCESS;
}

/* ---- the handle ---- */

void cometi_blaslt_fp8_destroy(cometi_blaslt_fp8_t *lt)
{
    if (!lt) return;
    for (int i = 0; i < CACHE_SLOTS; i++) {
        entry_t *e = &lt->cache[i];
        if (e->a) cublasLtMatrixLayoutDestroy(e->a);
        if (e->b) cublasLtMatrixLayoutDestroy(e->b);
        if (e->d) cublasLtMatrixLayoutDestroy(e->d);
    }
    if (lt->desc) cublasLtMatmulDescDestroy(lt->desc);
    if (lt->desc_wgrad) cublasLtMatmulDescDestroy(lt->desc_wgrad);
    if (lt->handle) cublasLtDestroy(lt->handle);
    cudaFree(lt->workspace);
    free(lt);
}

#define DESC_SET(st, desc, attr, value, label)                                                      \
    COMETI_TRY_GOTO(st, lt_status(err, cublasLtMatmulDescSetAttribute(desc, attr, &(value), sizeof(value)),   \
                                  "blaslt fp8: cublasLtMatmulDescSetAttribute(" #attr ")"), label)

comet_status_t cometi_blaslt_fp8_create(char *err, cometi_blaslt_fp8_t **out)
{
    *out = NULL;
#if CUBLAS_VERSION < 120900
    return cometi_fail(err, COMET_NOT_SUPPORTED, "blaslt fp8: built against cuBLAS %d; block-scaled FP8 "
                       "(VEC128_32F, BLK128x128_32F) needs cuBLAS 12.9 (CUDA 12.9) or later", CUBLAS_VERSION);
#else
    const size_t version = cublasLtGetVersion();
    if (version < 120900)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "blaslt fp8: cuBLASLt %zu is loaded; block-scaled FP8 needs "
                           "12.9 (CUDA 12.9) or later", version);
    int dev = 0, major = 0, minor = 0;
    COMETI_TRY(cometi_cuda(err, cudaGetDevice(&dev), "blaslt fp8: cudaGetDevice"));
    COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
                           "blaslt fp8: cudaDeviceGetAttribute(compute capability)"));
    COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev),
                           "blaslt fp8: cudaDeviceGetAttribute(compute capability)"));
    if (major != 9 || minor != 0)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "blaslt fp8: device %d is compute capability %d.%d; cuBLASLt's "
                           "VEC128_32F and BLK128x128_32F scale modes run on 9.0 (Hopper) alone", dev, major, minor);
    cometi_blaslt_fp8_t *lt = calloc(1, sizeof(*lt));
    if (!lt) return cometi_fail(err, COMET_OUT_OF_MEMORY, "blaslt fp8: out of host memory");
    comet_status_t st;
    COMETI_TRY_GOTO(st, lt_status(err, cublasLtCreate(&lt->handle), "blaslt fp8: cublasLtCreate"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMalloc(&lt->workspace, WORKSPACE_BYTES),
                                    "blaslt fp8: cudaMalloc(workspace, 32 MiB)"), fail);
    /* TN: cuBLAS's A is the weight (k x n, transposed), its B the rows (k x rows). The
     * weight gradients' form is the same with 1 x 128 scales on both operands, as
     * Transformer Engine's blockwise recipe runs its weight gradients (only 2D x 2D is
     * refused on Hopper). */
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    const int8_t fast_accum = 0; /* promote to FP32 per block (PyTorch refuses fast accumulation here too) */
    const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    cublasLtMatmulDesc_t *descs[2] = {&lt->desc, &lt->desc_wgrad};
    for (int i = 0; i < 2; i++) {
        COMETI_TRY_GOTO(st, lt_status(err, cublasLtMatmulDescCreate(descs[i], CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                      "blaslt fp8: cublasLtMatmulDescCreate"), fail);
        const int32_t mode_a = i ? vec : blk;
        DESC_SET(st, *descs[i], CUBLASLT_MATMUL_DESC_TRANSA, trans_a, fail);
        DESC_SET(st, *descs[i], CUBLASLT_MATMUL_DESC_TRANSB, trans_b, fail);
        DESC_SET(st, *descs[i], CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum, fail);
        DESC_SET(st, *descs[i], CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode_a, fail);
        DESC_SET(st, *descs[i], CUBLASLT_MATMUL_DESC_B_SCALE_MODE, vec, fail);
    }
    *out = lt;
    return COMET_SUCCESS;
fail:
    cometi_blaslt_fp8_destroy(lt);
    return st;
#endif
}

/* ---- the GEMM ---- */

/* The largest power of two up to 256 that divides the address: the heuristic may pick
 * kernels that need what the operands have, and no more. */
static uint32_t align_class(const void *p)
{
    const uintptr_t v = (uintptr_t)p;
    uint32_t a = 256;
    while (a > 16 && (v & (a - 1))) a >>= 1;
    return a;
}

static int same_shape(const shape_t *x, const shape_t *y)
{
    return x->n == y->n && x->k == y->k && x->ldd == y->ldd && x->rows == y->rows && x->lda == y->lda &&
           x->ldb == y->ldb && x->wgrad == y->wgrad && x->d_fp32 == y->d_fp32 && x->align_a == y->align_a &&
           x->align_b == y->align_b && x->align_d == y->align_d;
}

static void entry_clear(entry_t *e)
{
    if (e->a) cublasLtMatrixLayoutDestroy(e->a);
    if (e->b) cublasLtMatrixLayoutDestroy(e->b);
    if (e->d) cublasLtMatrixLayoutDestroy(e->d);
    memset(e, 0, sizeof(*e));
}

/* The layouts and algorithm of a shape: from the table, or made now (the matmul
 * descriptor's scale pointers already set: the heuristic wants them). */
static comet_status_t shape_entry(char *err, cometi_blaslt_fp8_t *lt, const shape_t *key, const entry_t **out)
{
    for (int i = 0; i < CACHE_SLOTS; i++)
        if (lt->cache[i].used && same_shape(&lt->cache[i].key, key)) {
            *out = &lt->cache[i];
            return COMET_SUCCESS;
        }
    entry_t *e = &lt->cache[lt->next];
    lt->next = (lt->next + 1) % CACHE_SLOTS;
    entry_clear(e);
    e->key = *key;
    comet_status_t st;
    cublasLtMatmulPreference_t pref = NULL;
    COMETI_TRY_GOTO(st, lt_status(err, cublasLtMatrixLayoutCreate(&e->a, CUDA_R_8F_E4M3, key->k, key->n, key->ldb),
                                  "blaslt fp8: cublasLtMatrixLayoutCreate(B as cuBLAS's A)"), fail);
    COMETI_TRY_GOTO(st, lt_status(err, cublasLtMatrixLayoutCreate(&e->b, CUDA_R_8F_E4M3, key->k, key->rows, key->lda),
                                  "blaslt fp8: cublasLtMatrixLayoutCreate(A as cuBLAS's B)"), fail);
    COMETI_TRY_GOTO(st, lt_status(err, cublasLtMatrixLayoutCreate(&e->d, key->d_fp32 ? CUDA_R_32F : CUDA_R_16BF, key->n,
                                                                  key->rows, key->ldd),
                                  "blaslt fp8: cublasLtMatrixLayoutCreate(D)"), fail);
    COMETI_TRY_GOTO(st, lt_status(err, cublasLtMatmulPreferenceCreate(&pref), "blaslt fp8: cublasLtMatmulPreferenceCreate"),
                    fail);
    const uint64_t ws = WORKSPACE_BYTES;
    const struct { cublasLtMatmulPreferenceAttributes_t attr; const void *v; size_t size; } prefs[] = {
        {CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key->align_b, sizeof(uint32_t)}, /* cuBLAS's A: our B */
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key->align_a, sizeof(uint32_t)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key->align_d, sizeof(uint32_t)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key->align_d, sizeof(uint32_t)},
    };
    for (size_t i = 0; i < sizeof(prefs) / sizeof(prefs[0]); i++)
        COMETI_TRY_GOTO(st, lt_status(err, cublasLtMatmulPreferenceSetAttribute(pref, prefs[i].attr, prefs[i].v,
                                                                                 prefs[i].size),
                                      "blaslt fp8: cublasLtMatmulPreferenceSetAttribute"), fail);
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    memset(&result, 0, sizeof(result));
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt->handle, key->wgrad ? lt->desc_wgrad : lt->desc, e->a,
                                                             e->b, e->d, e->d, pref, 1, &result, &found);
    if (hs != CUBLAS_STATUS_SUCCESS || found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
        const cublasStatus_t why = hs != CUBLAS_STATUS_SUCCESS ? hs : result.state;
        st = cometi_fail(err, COMET_NOT_SUPPORTED, "blaslt fp8: cuBLASLt has no block-scaled FP8 algorithm (%s) for "
                         "n = %d, k = %d, rows = %lld (padded), ldd = %d, lda = %lld, ldb = %lld, D %s, alignments "
                         "%u/%u/%u bytes (%d found: %s)", key->wgrad ? "1 x 128 by 1 x 128" : "1 x 128 by 128 x 128",
                         key->n, key->k, (long long)key->rows, key->ldd, (long long)key->lda, (long long)key->ldb,
                         key->d_fp32 ? "fp32" : "bf16", key->align_a, key->align_b, key->align_d, found,
                         cublasLtGetStatusString(why));
        goto fail;
    }
    e->algo = result.algo;
    e->used = 1;
    cublasLtMatmulPreferenceDestroy(pref);
    *out = e;
    return COMET_SUCCESS;
fail:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    entry_clear(e);
    return st;
}

/* One group's GEMM in the form its key names: the scale pointers set on that form's
 * descriptor (sa: cuBLAS's A's, our B's; sb: its B's, our A's), the shape's layouts and
 * algorithm found or made, then D = A B^T (+ D with beta 1). */
static comet_status_t run_group(char *err, cometi_blaslt_fp8_t *lt, int g, const shape_t *key, const float *sa,
                                const float *sb, const void *ag, const void *bg, void *dg, float beta,
                                cudaStream_t stream)
{
    const char *form = key->wgrad ? "blaslt fp8 wgrad" : "blaslt fp8";
    cublasLtMatmulDesc_t desc = key->wgrad ? lt->desc_wgrad : lt->desc;
    const struct { cublasLtMatmulDescAttributes_t attr; const float *p; const char *name; } ptrs[2] = {
        {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa, "A_SCALE_POINTER"},
        {CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb, "B_SCALE_POINTER"}};
    for (int i = 0; i < 2; i++) {
        char what[96];
        snprintf(what, sizeof(what), "%s: cublasLtMatmulDescSetAttribute(%s)", form, ptrs[i].name);
        COMETI_TRY(lt_status(err, cublasLtMatmulDescSetAttribute(desc, ptrs[i].attr, &ptrs[i].p, sizeof(ptrs[i].p)),
                             what));
    }
    const entry_t *e = NULL;
    COMETI_TRY(shape_entry(err, lt, key, &e));
    lt->last = e;
    const float one = 1.0f;
    const cublasStatus_t s = cublasLtMatmul(lt->handle, desc, &one, bg, e->a, ag, e->b, &beta, dg, e->d, dg, e->d,
                                            &e->algo, lt->workspace, WORKSPACE_BYTES, stream);
    if (s == CUBLAS_STATUS_SUCCESS) return COMET_SUCCESS;
    char what[160];
    snprintf(what, sizeof(what), "%s: cublasLtMatmul(group %d: %lld rows, n = %d, k = %d)", form, g,
             (long long)key->rows, key->n, key->k);
    return lt_status(err, s, what);
}

comet_status_t cometi_blaslt_fp8_grouped(char *err, cometi_blaslt_fp8_t *lt, int groups, const int64_t *row_start,
                                         const int64_t *rows, int n, int k, const void *a, const float *a_scales,
                                         const void *b, const float *b_scales, void *d, int ldd, cudaStream_t stream)
{
    if (!lt) return cometi_fail(err, COMET_INVALID_USAGE, "blaslt fp8: no handle (lt = NULL)");
    COMETI_TRY(cometi_blaslt_fp8_check(err, groups, row_start, rows, n, k, a, a_scales, b, b_scales, d, ldd));
    const int64_t L = ceil_div(k, 128);
    const size_t b_group = (size_t)n * k, b_scale_group = (size_t)ceil_div(n, 128) * cometi_blaslt_fp8_b_scale_ld(k);
    int64_t a_scale_offset = 0;
    for (int g = 0; g < groups; g++) {
        if (rows[g] == 0) continue;
        const int64_t padded = cometi_blaslt_fp8_group_rows(rows[g]);
        const void *ag = (const uint8_t *)a + row_start[g] * (int64_t)k;
        const void *bg = (const uint8_t *)b + (size_t)g * b_group;
        void *dg = (uint16_t *)d + row_start[g] * (int64_t)ldd;
        /* cuBLAS's A scales are the weight's, its B scales the rows'. */
        const float *sa = b_scales + (size_t)g * b_scale_group, *sb = a_scales + a_scale_offset;
        a_scale_offset += L * padded;
        const shape_t key = {n, k, ldd, padded, k, k, 0, 0, align_class(ag), align_class(bg), align_class(dg)};
        COMETI_TRY(run_group(err, lt, g, &key, sa, sb, ag, bg, dg, 0.0f, stream));
    }
    return COMET_SUCCESS;
}

/* ---- the weight gradients' form ---- */

comet_status_t cometi_blaslt_fp8_wgrad_check(char *err, int groups, const int64_t *k_start, const int64_t *k_len,
                                             int m, int n, const void *a, int64_t lda, const float *a_scales,
                                             const void *b, int64_t ldb, const float *b_scales, const void *d)
{
    if (groups < 0)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8 wgrad: groups = %d must be >= 0", groups);
    if (groups > 0 && (!k_start || !k_len))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8 wgrad: k_start = %p, k_len = %p: both host arrays "
                           "of %d groups are needed", (const void *)k_start, (const void *)k_len, groups);
    if (m <= 0 || n <= 0 || m % 8 || n % 8)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "blaslt fp8 wgrad: m = %d, n = %d must be positive multiples of 8 "
                           "(cuBLASLt's block-scaled GEMMs need M and N multiples of 4, 16-byte rows of D 8)", m, n);
    if (lda <= 0 || ldb <= 0 || lda % 16 || ldb % 16)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8 wgrad: lda = %lld, ldb = %lld must be positive "
                           "multiples of 16 (16-byte aligned rows of E4M3)", (long long)lda, (long long)ldb);
    int any = 0;
    for (int g = 0; g < groups; g++) {
        if (k_start[g] < 0 || k_len[g] < 0 || k_start[g] % 128 || k_len[g] % 128)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8 wgrad: group %d has k_start = %lld, k_len = "
                               "%lld: both must be multiples of 128 and >= 0 (whole 1 x 128 scale blocks)", g,
                               (long long)k_start[g], (long long)k_len[g]);
        if (k_start[g] + k_len[g] > lda || k_start[g] + k_len[g] > ldb)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8 wgrad: group %d ends at column %lld, past lda = "
                               "%lld or ldb = %lld", g, (long long)(k_start[g] + k_len[g]), (long long)lda,
                               (long long)ldb);
        if (k_len[g] > INT32_MAX)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8 wgrad: group %d has k_len = %lld, above the %d "
                               "one GEMM takes", g, (long long)k_len[g], INT32_MAX);
        any |= k_len[g] > 0;
    }
    const struct { const void *p; const char *name; int used; } ptr[] = {
        {a, "a", any}, {a_scales, "a_scales", any}, {b, "b", any}, {b_scales, "b_scales", any}, {d, "d", groups > 0}};
    for (size_t i = 0; i < sizeof(ptr) / sizeof(ptr[0]); i++)
        if (ptr[i].used && (!ptr[i].p || misaligned(ptr[i].p)))
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "blaslt fp8 wgrad: %s = %p must be a 16-byte aligned device "
                               "pointer (cuBLASLt's FP8 operands and scale tensors)", ptr[i].name, ptr[i].p);
    return COMET_SUCCESS;
}

comet_status_t cometi_blaslt_fp8_wgrad(char *err, cometi_blaslt_fp8_t *lt, int groups, const int64_t *k_start,
                                       const int64_t *k_len, int m, int n, const void *a, int64_t lda,
                                       const float *a_scales, const void *b, int64_t ldb, const float *b_scales,
                                       void *d, int d_fp32, int accumulate, cudaStream_t stream)
{
    if (!lt) return cometi_fail(err, COMET_INVALID_USAGE, "blaslt fp8 wgrad: no handle (lt = NULL)");
    COMETI_TRY(cometi_blaslt_fp8_wgrad_check(err, groups, k_start, k_len, m, n, a, lda, a_scales, b, ldb, b_scales,
                                             d));
    const size_t d_group = (size_t)m * n * (d_fp32 ? 4 : 2);
    for (int g = 0; g < groups; g++) {
        void *dg = (char *)d + (size_t)g * d_group;
        if (k_len[g] == 0) { /* no tokens: a zero gradient, or nothing to add */
            if (!accumulate)
                COMETI_TRY(cometi_cuda(err, cudaMemsetAsync(dg, 0, d_group, stream),
                                       "blaslt fp8 wgrad: zero an expert's gradient"));
            continue;
        }
        const int64_t blocks_before = k_start[g] / 128;
        const void *ag = (const uint8_t *)a + k_start[g], *bg = (const uint8_t *)b + k_start[g];
        /* cuBLAS's A scales are our B's, its B scales our A's: MN-major, one block row at a time. */
        const float *sa = b_scales + blocks_before * n, *sb = a_scales + blocks_before * m;
        const shape_t key = {n, (int)k_len[g], n, m, lda, ldb, 1, d_fp32, align_class(ag), align_class(bg),
                             align_class(dg)};
        COMETI_TRY(run_group(err, lt, g, &key, sa, sb, ag, bg, dg, accumulate ? 1.0f : 0.0f, stream));
    }
    return COMET_SUCCESS;
}

/* ---- what cuBLASLt chose ---- */

/* cublasLt.h's names for the tiles and cluster shapes Hopper's FP8 kernels use. */
typedef struct id_name {
    uint32_t id;
    const char *name;
} id_name_t;

static const id_name_t TILES[] = {
    {CUBLASLT_MATMUL_TILE_64x64, "64x64"},     {CUBLASLT_MATMUL_TILE_64x128, "64x128"},
    {CUBLASLT_MATMUL_TILE_128x64, "128x64"},   {CUBLASLT_MATMUL_TILE_64x256, "64x256"},
    {CUBLASLT_MATMUL_TILE_128x128, "128x128"}, {CUBLASLT_MATMUL_TILE_256x64, "256x64"},
    {CUBLASLT_MATMUL_TILE_128x256, "128x256"}, {CUBLASLT_MATMUL_TILE_256x128, "256x128"},
    {0, NULL}};
static const id_name_t CLUSTERS[] = {
    {CUBLASLT_CLUSTER_SHAPE_1x1x1, "1x1"}, {CUBLASLT_CLUSTER_SHAPE_2x1x1, "2x1"},
    {CUBLASLT_CLUSTER_SHAPE_1x2x1, "1x2"}, {CUBLASLT_CLUSTER_SHAPE_2x2x1, "2x2"},
    {CUBLASLT_CLUSTER_SHAPE_4x1x1, "4x1"}, {CUBLASLT_CLUSTER_SHAPE_1x4x1, "1x4"},
    {0, NULL}};

/* id's name from a NULL-ended table into out, or "#id" where it has none. */
static void id_text(const id_name_t *table, uint32_t id, char *out, size_t len)
{
    for (; table->name; table++)
        if (table->id == id) {
            snprintf(out, len, "%s", table->name);
            return;
        }
    snprintf(out, len, "#%u", id);
}

void cometi_blaslt_fp8_algo_text(const cometi_blaslt_fp8_t *lt, char *buf, size_t len)
{
    if (!len) return;
    buf[0] = '\0';
    if (!lt || !lt->last || !lt->last->used) return;
    const cublasLtMatmulAlgo_t *algo = &lt->last->algo;
    static const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
        CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
        CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION};
    uint32_t v[7] = {0};
    for (int i = 0; i < 7; i++) { /* 32 bits each but the cluster shape's 16 (cublasLt.h) */
        size_t written = 0;
        uint32_t word = 0;
        uint16_t half = 0;
        const int narrow = attrs[i] == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID;
        if (cublasLtMatmulAlgoConfigGetAttribute(algo, attrs[i], narrow ? (void *)&half : (void *)&word,
                                                 narrow ? sizeof(half) : sizeof(word), &written) ==
            CUBLAS_STATUS_SUCCESS)
            v[i] = narrow ? half : word;
    }
    char tile[16], cluster[16];
    id_text(TILES, v[1], tile, sizeof(tile));
    id_text(CLUSTERS, v[3], cluster, sizeof(cluster));
    /* cuBLASLt's tile is D's rows x cols in its column-major terms: our n x rows. */
    snprintf(buf, len, "algo %u, tile %s (n x rows), stages #%u, cluster %s, split-k %u, swizzle %u, option %u", v[0],
             tile, v[2], cluster, v[4], v[5], v[6]);
}

comet_status_t cometi_fp8_wgrad_operands_alloc(char *err, const char *who, int64_t rows, int64_t H, int64_t F,
                                               int experts, cometi_fp8_wgrad_operands_t *o)
{
    o->k_start = malloc(sizeof(int64_t) * experts);
    o->k_len = malloc(sizeof(int64_t) * experts);
    if (!o->k_start || !o->k_len) return cometi_fail(err, COMET_OUT_OF_MEMORY, "%s: out of host memory", who);
    o->ld = (rows + 127) / 128 * 128;
    const int64_t blocks = o->ld / 128;
    struct { void **p; size_t bytes; } a[] = {
        {&o->dy_t, (size_t)(H * o->ld)}, {&o->wa_t, (size_t)(F * o->ld)},
        {&o->dh_t, (size_t)(2 * F * o->ld)}, {&o->x_t, (size_t)(H * o->ld)},
        {(void **)&o->dy_t_scales, sizeof(float) * (size_t)(blocks * H)},
        {(void **)&o->wa_t_scales, sizeof(float) * (size_t)(blocks * F)},
        {(void **)&o->dh_t_scales, sizeof(float) * (size_t)(blocks * 2 * F)},
        {(void **)&o->x_t_scales, sizeof(float) * (size_t)(blocks * H)},
        {(void **)&o->wa_t_scales16, sizeof(uint16_t) * (size_t)(blocks * F)},
        {(void **)&o->x_t_scales16, sizeof(uint16_t) * (size_t)(blocks * H)},
    };
    for (size_t i = 0; i < sizeof(a) / sizeof(a[0]); i++) {
        char what[128];
        snprintf(what, sizeof(what), "%s: cudaMalloc(%zu bytes)", who, a[i].bytes);
        COMETI_TRY(cometi_cuda(err, cudaMalloc(a[i].p, a[i].bytes ? a[i].bytes : 1), what));
    }
    /* The bf16 copies convert every block, those no segment writes too: zeros, not garbage. */
    COMETI_TRY(cometi_cuda(err, cudaMemset(o->wa_t_scales, 0, sizeof(float) * (size_t)(blocks * F)),
                           "zero the (w a)^T scales"));
    return cometi_cuda(err, cudaMemset(o->x_t_scales, 0, sizeof(float) * (size_t)(blocks * H)), "zero the x^T scales");
}

void cometi_fp8_wgrad_operands_free(cometi_fp8_wgrad_operands_t *o)
{
    void *bufs[] = {o->dy_t,        o->wa_t,        o->dh_t,          o->x_t,         o->dy_t_scales,
                    o->wa_t_scales, o->dh_t_scales, o->x_t_scales,    o->wa_t_scales16, o->x_t_scales16};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaFree(bufs[i]);
    free(o->k_start);
    free(o->k_len);
    memset(o, 0, sizeof(*o));
}

comet_status_t cometi_wgrad_b_scales16(char *err, const cometi_fp8_wgrad_operands_t *o, int64_t H, int64_t F,
                                       cudaStream_t stream)
{
    const int64_t blocks = o->ld / 128;
    COMETI_TRY(cometi_cuda(err, cometi_launch_scales_bf16(o->wa_t_scales, o->wa_t_scales16, blocks * F, stream),
                           "launch scales_bf16_kernel ((w a)^T)"));
    return cometi_cuda(err, cometi_launch_scales_bf16(o->x_t_scales, o->x_t_scales16, blocks * H, stream),
                       "launch scales_bf16_kernel (x^T)");
}

comet_status_t cometi_blaslt_fp8_weight_grads(char *err, cometi_blaslt_fp8_t *lt, int experts,
                                              const cometi_segment_t *segs, const cometi_fp8_wgrad_operands_t *o,
                                              int H, int F, const comet_moe_weight_grads_t *grads,
                                              cudaStream_t stream)
{
    for (int e = 0; e < experts; e++) {
        o->k_start[e] = segs[e].start;
        o->k_len[e] = ((int64_t)segs[e].rows + 127) / 128 * 128;
    }
    const int fp32 = grads->mode == COMET_GRAD_ACCUMULATE_FP32;
    if (grads->down)
        COMETI_TRY(cometi_blaslt_fp8_wgrad(err, lt, experts, o->k_start, o->k_len, H, F, o->dy_t, o->ld,
                                           o->dy_t_scales, o->wa_t, o->ld, o->wa_t_scales, grads->down, fp32, fp32,
                                           stream));
    if (!grads->gate_up) return COMET_SUCCESS;
    return cometi_blaslt_fp8_wgrad(err, lt, experts, o->k_start, o->k_len, 2 * F, H, o->dh_t, o->ld, o->dh_t_scales,
                                   o->x_t, o->ld, o->x_t_scales, grads->gate_up, fp32, fp32, stream);
}
