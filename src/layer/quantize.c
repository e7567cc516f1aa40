/*
 * quantize.c - comet.h's block-scaled FP8 calls: every argument checked before anything
 * touches CUDA (the calls take no handle, so a refusal's message goes where
 * comet_last_create_error() reads), then one launch of pointwise/quantize.cu's kernels.
 */
#include <stdint.h>

#include "base/host.h"
#include "base/fp8.h"
#include "pointwise/pointwise.h"

/* The most elements one call takes: offsets into x, 2 bytes an element, stay under 2^62,
 * far from int64's end. */
#define MAX_ELEMENTS ((int64_t)1 << 61)

/* What both calls check: cols, pow2_scales, and the elements outer x cols (outer = mats
 * x rows, or rows). */
static comet_status_t check_shape(char *err, const char *call, const char *outer_name, int64_t outer, int cols,
                                  int pow2_scales)
{
    if (cols < 16 || cols % 16 != 0)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: cols = %d: must be a positive multiple of 16", call, cols);
    if (pow2_scales != 0 && pow2_scales != 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: pow2_scales = %d: must be 0 or 1", call, pow2_scales);
    if (outer > MAX_ELEMENTS / cols)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: %s = %lld x cols = %d: more than 2^61 elements", call,
                           outer_name, (long long)outer, cols);
    return COMET_SUCCESS;
}

/* A weights call's shape: mats and rows (with `transposed`, rows a multiple of 16: they are
 * the transpose's k, read 16 bytes at a time), then what check_shape checks. */
static comet_status_t check_weights_shape(char *err, const char *call, int64_t mats, int rows, int transposed,
                                          int cols, int pow2_scales)
{
    if (mats < 1) return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: mats = %lld: must be >= 1", call, (long long)mats);
    if (!transposed && rows < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: rows = %d: must be >= 1", call, rows);
    if (transposed && (rows < 16 || rows % 16 != 0))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: rows = %d: must be a positive multiple of 16 (the "
                           "transpose's rows are its k, read 16 bytes at a time)", call, rows);
    /* mats x rows first, so that the product below cannot overflow. */
    if (mats > MAX_ELEMENTS / rows)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: mats = %lld x rows = %d: more than 2^61 elements", call,
                           (long long)mats, rows);
    return check_shape(err, call, "mats x rows", mats * rows, cols, pow2_scales);
}

/* The three device pointers: not NULL, the tensors 16-byte aligned (the kernels move 16
 * bytes at a time), the scales 4-byte aligned. */
static comet_status_t check_pointers(char *err, const char *call, const char *in_name, const void *in,
                                     const char *q_name, const void *q, const char *scales_name, const float *scales)
{
    const struct { const char *name; const void *p; unsigned int align; } ptr[3] = {
        {in_name, in, 16}, {q_name, q, 16}, {scales_name, scales, 4}};
    for (int i = 0; i < 3; i++) {
        if (!ptr[i].p) return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: %s is NULL", call, ptr[i].name);
        if ((uintptr_t)ptr[i].p % ptr[i].align != 0)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: %s = %p: must be %u-byte aligned", call, ptr[i].name,
                               ptr[i].p, ptr[i].align);
    }
    return COMET_SUCCESS;
}

comet_status_t comet_quantize_fp8_weights(const void *w, int64_t mats, int rows, int cols, int pow2_scales, void *q,
                                          float *scales, cudaStream_t stream)
{
    static const char call[] = "comet_quantize_fp8_weights";
    char *err = cometi_create_error_buffer();
    COMETI_TRY(check_weights_shape(err, call, mats, rows, 0, cols, pow2_scales));
    COMETI_TRY(check_pointers(err, call, "w", w, "q", q, "scales", scales));
    return cometi_cuda(err, cometi_quantize_blocks_e4m3(w, mats, rows, cols, q, scales, NULL, NULL, pow2_scales, stream),
                       "comet_quantize_fp8_weights: the kernel's launch");
}

comet_status_t comet_quantize_fp8_weights_transposed(const void *w, int64_t mats, int rows, int cols,
                                                     int pow2_scales, void *q, float *scales, void *qt,
                                                     float *scales_t, cudaStream_t stream)
{
    static const char call[] = "comet_quantize_fp8_weights_transposed";
    char *err = cometi_create_error_buffer();
    COMETI_TRY(check_weights_shape(err, call, mats, rows, 1, cols, pow2_scales));
    COMETI_TRY(check_pointers(err, call, "w", w, "qt", qt, "scales_t", scales_t));
    if (!q != !scales)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: q = %p and scales = %p: give both (the untransposed copy "
                           "too) or neither", call, q, (const void *)scales);
    if (q) COMETI_TRY(check_pointers(err, call, "w", w, "q", q, "scales", scales));
    return cometi_cuda(err, cometi_quantize_blocks_e4m3(w, mats, rows, cols, q, scales, qt, scales_t, pow2_scales,
                                                        stream),
                       "comet_quantize_fp8_weights_transposed: the kernel's launch");
}

comet_status_t comet_quantize_fp8_rows(const void *x, int64_t rows, int cols, int pow2_scales, void *q, float *scales,
                                       cudaStream_t stream)
{
    static const char call[] = "comet_quantize_fp8_rows";
    char *err = cometi_create_error_buffer();
    if (rows < 0) return cometi_fail(err, COMET_INVALID_ARGUMENT, "%s: rows = %lld: must be >= 0", call, (long long)rows);
    COMETI_TRY(check_shape(err, call, "rows", rows, cols, pow2_scales));
    if (rows == 0) return COMET_SUCCESS; /* nothing to read or write: the pointers may be NULL */
    COMETI_TRY(check_pointers(err, call, "x", x, "q", q, "scales", scales));
    const int64_t nblocks = (cols + COMETI_FP8_BLOCK - 1) / COMETI_FP8_BLOCK;
    /* DeepEP's layout: [rows][nblocks], a row's scales side by side. */
    return cometi_cuda(err, cometi_quantize_rows_e4m3(x, rows, cols, cols, q, cols, scales, nblocks, 1, pow2_scales,
                                                      stream),
                       "comet_quantize_fp8_rows: the kernel's launch");
}
