/*
 * test_fp8.c - block-scaled FP8 (E4M3): on the CPU, base/fp8.h's rounding against an
 * independent reference (E4M3's values from the format's definition, the nearest found by
 * search in double, ties to even), its scales, the NaN and infinity policy comet.h states,
 * and every refusal of comet.h's two quantize calls; on a GPU, the hardware's conversion
 * against the host's for every float, and both kernels against the host reference byte by
 * byte on fresh random inputs with zeros, tiny and huge values, NaN and infinities planted.
 */
#define _GNU_SOURCE
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "base/fp8.h"
#include "pointwise/pointwise.h"
#include "testutil.h"
#include "gpu_util.h"

/* ---- an independent E4M3 reference ---- */

/* The value of non-negative code c (0..126) from the format's definition: exponent e =
 * c >> 3 with bias 7, mantissa m = c & 7; e = 0 is subnormal. */
static double e4m3_value(int c)
{
    const int e = c >> 3, m = c & 7;
    return e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m, -9);
}

/* The nearest finite E4M3 value to x by search in double (exact: every float and every
 * E4M3 value is a double), ties to the even code (the even mantissa); past 448 the
 * nearest finite value is 448 (saturation); NaN 0x7F; the sign kept, zero's too. */
static uint8_t e4m3_reference(float x)
{
    if (isnan(x)) return 0x7f;
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    const double a = fabs((double)x);
    int lo = 0; /* the largest code whose value is <= a */
    for (int step = 64; step > 0; step /= 2)
        if (lo + step <= 126 && e4m3_value(lo + step) <= a) lo += step;
    int c = lo;
    if (lo < 126) {
        const double below = a - e4m3_value(lo), above = e4m3_value(lo + 1) - a;
        if (above < below || (above == below && (lo & 1))) c = lo + 1;
    }
    return (uint8_t)(sign | c);
}

/* Checks encode(x) against the reference and, where want >= 0, against a known byte. */
#define CHECK_ENCODE(x, want)                                                                      \
    do {                                                                                           \
        const float x_ = (x);                                                                      \
        const int got_ = cometi_e4m3_encode(x_), ref_ = e4m3_reference(x_), want_ = (want);        \
        if (got_ != ref_ || (want_ >= 0 && got_ != want_)) {                                       \
            printf("%s:%d: e4m3(%a = %.9g, bits 0x%08x) = 0x%02x, reference 0x%02x, expected 0x%02x\n", \
                   __FILE__, __LINE__, x_, x_, cometi_f32_bits(x_), got_, ref_, want_ & 0xff);     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static float f32(uint32_t bits) { return cometi_f32_from_bits(bits); }

int test_fp8_e4m3_rounding(void)
{
    uint64_t rng = test_seed();
    /* Every code: its value, its sign, and back. */
    for (int v = 0; v < 256; v++) {
        const float f = cometi_e4m3_decode((uint8_t)v);
        if ((v & 0x7f) == 0x7f) {
            CHECK(isnan(f));
            continue;
        }
        CHECK_NEAR(fabs((double)f), e4m3_value(v & 0x7f), 0);
        CHECK_EQ(!!signbit(f), v >> 7); /* 0x80 is -0 */
        CHECK_EQ(cometi_e4m3_encode(f), v);
    }
    CHECK(cometi_e4m3_decode(0x7e) == 448.0f && cometi_e4m3_decode(0x38) == 1.0f);
    CHECK(cometi_e4m3_decode(0x01) == 0x1p-9f && cometi_e4m3_decode(0x08) == 0x1p-6f);
    /* Every bf16 value (what the kernels' inputs are). */
    for (uint32_t h = 0; h < 65536; h++) CHECK_ENCODE(cometi_bf16_to_float((uint16_t)h), -1);
    /* Between each two neighbours: the midpoint (a tie: the even code), the floats just
     * below and above it, both signs. Midpoints need 5 significant bits: exact in float. */
    for (int c = 0; c < 126; c++)
        for (int s = 0; s < 2; s++) {
            const float sign = s ? -1.0f : 1.0f, mid = sign * (float)((e4m3_value(c) + e4m3_value(c + 1)) / 2);
            CHECK_ENCODE(mid, (s << 7) | (c % 2 ? c + 1 : c));
            CHECK_ENCODE(nextafterf(mid, 0.0f), (s << 7) | c);
            CHECK_ENCODE(nextafterf(mid, sign * INFINITY), (s << 7) | (c + 1));
            CHECK_ENCODE(sign * (float)e4m3_value(c), (s << 7) | c);
        }
    /* Saturation: everything from 448 up, infinities too, is +-448. */
    const float big[] = {448.0f, 449.0f, 464.0f, nextafterf(464.0f, INFINITY), 480.0f, 1e6f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
        CHECK_ENCODE(big[i], 0x7e);
        CHECK_ENCODE(-big[i], 0xfe);
    }
    CHECK_ENCODE(nextafterf(448.0f, 0.0f), 0x7e); /* 448 - 2^-15: far nearer 448 than 416 */
    CHECK_ENCODE(432.0f, 0x7e);                   /* the midpoint 416..448: even is 448 (1.75 x 2^8) */
    CHECK_ENCODE(424.0f, 0x7d);                   /* nearer 416 (1.625 x 2^8) */
    CHECK_ENCODE(400.0f, 0x7c);                   /* the midpoint 384..416: even is 384 */
    /* NaN, any sign or payload: 0x7F. */
    const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu};
    for (size_t i = 0; i < sizeof(nans) / sizeof(nans[0]); i++) CHECK_ENCODE(f32(nans[i]), 0x7f);
    /* Subnormals (steps of 2^-9 below 2^-6) and what rounds to zero, sign kept. */
    CHECK_ENCODE(0x1p-9f, 0x01);
    CHECK_ENCODE(0x1p-10f, 0x00);                     /* half the smallest: a tie, to 0 */
    CHECK_ENCODE(-0x1p-10f, 0x80);
    CHECK_ENCODE(nextafterf(0x1p-10f, 1.0f), 0x01);
    CHECK_ENCODE(0x3p-10f, 0x02);                     /* 1.5 steps: a tie, to 2 */
    CHECK_ENCODE(0x7p-9f, 0x07);
    CHECK_ENCODE(0xfp-10f, 0x08);                     /* 7.5 steps: a tie, to 8 = 2^-6 */
    CHECK_ENCODE(0x1p-6f, 0x08);
    CHECK_ENCODE(1e-40f, 0x00);                       /* float subnormals */
    CHECK_ENCODE(-1e-40f, 0x80);
    CHECK_ENCODE(0.0f, 0x00);
    CHECK_ENCODE(-0.0f, 0x80);
    CHECK_ENCODE(1.0f, 0x38);
    CHECK_ENCODE(-2.0f, 0xc0);
    CHECK_ENCODE(0x1.1p0f, 0x38);                     /* 1 + 1/16: a tie between 1 and 1.125 */
    CHECK_ENCODE(0x1.3p0f, 0x3a);                     /* 1 + 3/16: a tie between 1.125 and 1.25 */
    /* Random bit patterns: all of float, and the binades where E4M3 is not 0 or 448. */
    for (int i = 0; i < 2000000; i++) {
        const uint32_t u = (uint32_t)cometi_rand_next(&rng);
        CHECK_ENCODE(f32(u), -1);
        CHECK_ENCODE(f32((u & 0x807fffffu) | (uint32_t)(114 + u % 24) << 23), -1); /* 2^-13 .. 2^10 */
    }
    return 0;
}

/* ---- scales ---- */

/* The reference scale: amax / 448 rounded once (double holds the quotient to well past
 * float's double-rounding bound, 2 x 24 + 2 bits); with rule COMETI_FP8_SCALE_BF16 that
 * float, if it has more than 8 significant bits, plus one step of 2^(e - 7) after its
 * last 8 (e its exponent: the next float of 8 bits up); or the power of two 2^k with
 * 448 x 2^(k-1) < amax <= 448 x 2^k, compared exactly; at least 2^-126; 1 for 0. */
static float scale_reference(float amax, int pow2)
{
    if (isnan(amax) || isinf(amax)) return amax;
    if (amax == 0.0f) return 1.0f;
    if (pow2 != COMETI_FP8_SCALE_POW2) {
        float s = (float)((double)amax / 448.0);
        if (s < FLT_MIN) s = FLT_MIN;
        if (pow2 == COMETI_FP8_SCALE_BF16) {
            int e;
            const double m = frexp((double)s, &e);                  /* s = m 2^e, 0.5 <= m < 1 */
            const double top = floor(ldexp(m, 8)), step = ldexp(1.0, e - 8); /* 8 bits: 1.xxxxxxx */
            if (top * step < (double)s) return (float)((top + 1) * step);
        }
        return s;
    }
    int k = -200;
    while (448.0 * ldexp(1.0, k) < amax) k++;
    return k < -126 ? FLT_MIN : (float)ldexp(1.0, k);
}

#define CHECK_SCALE(amax, pow2, want)                                                              \
    do {                                                                                           \
        const float a_ = (amax), got_ = cometi_fp8_scale(a_, (pow2)), w_ = (want);                 \
        if (cometi_f32_bits(got_) != cometi_f32_bits(w_) && !(isnan(got_) && isnan(w_))) {         \
            printf("%s:%d: scale(%a, pow2 %d) = %a, want %a\n", __FILE__, __LINE__, a_, (pow2), got_, w_); \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

int test_fp8_scales(void)
{
    uint64_t rng = test_seed();
    for (int pow2 = 0; pow2 < 3; pow2++) {
        CHECK_SCALE(0.0f, pow2, 1.0f);
        CHECK_SCALE(NAN, pow2, NAN);
        CHECK_SCALE(f32(0x7fffffffu), pow2, NAN);
        CHECK_SCALE(INFINITY, pow2, INFINITY);
        CHECK_SCALE(448.0f, pow2, 1.0f);
        /* Tiny blocks: the scale stops at 2^-126, so 1 / scale (2^126) stays finite. */
        CHECK_SCALE(0x1p-133f, pow2, FLT_MIN);          /* bf16's smallest subnormal */
        CHECK_SCALE(448.0f * FLT_MIN, pow2, FLT_MIN);
        CHECK_SCALE(nextafterf(448.0f * FLT_MIN, 0.0f), pow2, FLT_MIN);
        /* 1 / 2^-126 = 2^126: 2^-133 becomes 2^-7 = 4 steps of 2^-9 (exact), 0 stays 0. */
        CHECK(cometi_fp8_inverse(cometi_fp8_scale(0x1p-133f, pow2)) == 0x1p126f);
        CHECK_EQ(cometi_fp8_quantize(0x1p-133f, 0x1p126f), 0x04);
        CHECK_EQ(cometi_fp8_quantize(0.0f, 0x1p126f), 0x00);
    }
    CHECK_SCALE(1.0f, 0, 1.0f / 448.0f);
    CHECK_SCALE(FLT_MAX, 0, (float)((double)FLT_MAX / 448));
    /* Powers of two: 448 x 2^k maps to 2^k, the float above it to 2^(k+1), the one below to 2^k. */
    for (int k = -126; k <= 119; k++) {
        const float a = ldexpf(448.0f, k), p = ldexpf(1.0f, k);
        CHECK_SCALE(a, 1, p);
        CHECK_SCALE(nextafterf(a, INFINITY), 1, 2 * p);
        CHECK_SCALE(nextafterf(a, 0.0f), 1, k > -126 ? p : FLT_MIN);
        CHECK_SCALE(a, 0, p); /* amax / 448 exact */
    }
    CHECK_SCALE(FLT_MAX, 1, 0x1p120f);
    /* Exact in bf16: 8 significant bits kept, the next 8-bit float up otherwise, a carry
     * into the next binade included; never below amax / 448. */
    CHECK_SCALE(448.0f * 1.5f, COMETI_FP8_SCALE_BF16, 1.5f);
    CHECK_SCALE(1.0f, COMETI_FP8_SCALE_BF16, f32(0x3b130000u)); /* 1 / 448 = 0x3b124925 */
    CHECK_SCALE(nextafterf(448.0f, 0.0f), COMETI_FP8_SCALE_BF16, 1.0f);
    CHECK_SCALE(FLT_MAX, COMETI_FP8_SCALE_BF16, f32((cometi_f32_bits((float)((double)FLT_MAX / 448)) + 0xffffu) &
                                                    0xffff0000u));
    /* Random amaxes over float's whole range against the reference. */
    for (int i = 0; i < 200000; i++) {
        const float a = f32((uint32_t)cometi_rand_next(&rng) & 0x7f7fffffu); /* positive, finite */
        CHECK_SCALE(a, 0, scale_reference(a, 0));
        CHECK_SCALE(a, 1, scale_reference(a, 1));
        CHECK_SCALE(a, COMETI_FP8_SCALE_BF16, scale_reference(a, COMETI_FP8_SCALE_BF16));
        const float s = cometi_fp8_scale(a, COMETI_FP8_SCALE_BF16);
        CHECK((cometi_f32_bits(s) & 0xffffu) == 0 && s >= scale_reference(a, 0) &&
              (double)s <= (double)scale_reference(a, 0) * (1 + 0x1p-7));
    }
    /* The round trip of comet.h, |q s - x| <= |x| / 16 + s / 1024 (q s exact, in double), on
     * random blocks: values over 1..2^30 of range below their amax. */
    for (int i = 0; i < 20000; i++) {
        const int pow2 = i % 2;
        const float amax = ldexpf((float)(1.0 + cometi_rand_unit(&rng)), (int)(cometi_rand_next(&rng) % 200) - 100);
        const float s = cometi_fp8_scale(amax, pow2), inv = cometi_fp8_inverse(s);
        for (int j = 0; j < 64; j++) {
            const float below = ldexpf((float)(2 * cometi_rand_unit(&rng) - 1), -(int)(cometi_rand_next(&rng) % 31));
            const float x = j == 0 ? amax : below * amax;
            const double back = (double)cometi_e4m3_decode(cometi_fp8_quantize(x, inv)) * s;
            if (!(fabs(back - x) <= fabs(x) / 16 + s / 1024.0)) {
                printf("round trip: x %a, amax %a, pow2 %d: q s = %a\n", x, amax, pow2, back);
                return 1;
            }
        }
    }
    /* NaN and infinity (comet.h): a block holding a NaN has scale NaN and every byte 0x7F;
     * one holding an infinity scale +Inf, 1 / scale 0, bytes +-0 or 0x7F; every element
     * of either dequantizes (q x s in fp32) to NaN. */
    const float block[] = {1.0f, -3.5f, 0.0f, -0.0f, 1e-30f, 448.0f, 1e30f};
    for (int pow2 = 0; pow2 < 2; pow2++)
        for (int special = 0; special < 3; special++) {
            const float planted = special == 0 ? NAN : special == 1 ? INFINITY : -INFINITY;
            float amax = cometi_fp8_abs(planted);
            for (size_t j = 0; j < sizeof(block) / sizeof(block[0]); j++) amax = cometi_fp8_max(amax, cometi_fp8_abs(block[j]));
            const float s = cometi_fp8_scale(amax, pow2), inv = cometi_fp8_inverse(s);
            CHECK(special == 0 ? isnan(s) : s == INFINITY);
            CHECK(special == 0 ? isnan(inv) : inv == 0.0f);
            CHECK_EQ(cometi_fp8_quantize(planted, inv), 0x7f);
            CHECK(isnan(cometi_e4m3_decode(cometi_fp8_quantize(planted, inv)) * s));
            for (size_t j = 0; j < sizeof(block) / sizeof(block[0]); j++) {
                const uint8_t q = cometi_fp8_quantize(block[j], inv);
                CHECK(special == 0 ? q == 0x7f : (q & 0x7f) == 0);
                CHECK(isnan(cometi_e4m3_decode(q) * s));
            }
        }
    /* The max: NaN wins from either side. */
    CHECK(isnan(cometi_fp8_max(NAN, 1.0f)) && isnan(cometi_fp8_max(1.0f, NAN)) && isnan(cometi_fp8_max(INFINITY, NAN)));
    CHECK_EQ(cometi_f32_bits(cometi_fp8_max(2.0f, NAN)), 0x7fffffffu);
    CHECK(cometi_fp8_max(2.0f, 3.0f) == 3.0f && cometi_fp8_max(INFINITY, 3.0f) == INFINITY);
    /* comet.h's one exception: with pow2 scales the largest bf16 values round to q = 256 at
     * s = 2^120, and 256 x 2^120 = 2^128 is past fp32's range; amax / 448 scales keep
     * q <= 448 and q x s finite. */
    const float bf16_max = cometi_bf16_to_float(0x7f7f), edge = cometi_bf16_to_float(0x7f78); /* 248 x 2^120 */
    CHECK(edge == 0x1.fp127f);
    CHECK_SCALE(bf16_max, 1, 0x1p120f);
    CHECK_EQ(cometi_fp8_quantize(bf16_max, cometi_fp8_inverse(0x1p120f)), 0x78); /* 256 */
    CHECK_EQ(cometi_fp8_quantize(edge, cometi_fp8_inverse(0x1p120f)), 0x78);    /* 248: a tie, to 256 */
    CHECK_EQ(cometi_fp8_quantize(cometi_bf16_to_float(0x7f77), cometi_fp8_inverse(0x1p120f)), 0x77); /* 247: 240 */
    CHECK(isinf(cometi_e4m3_decode(0x78) * 0x1p120f));
    const float s_max = cometi_fp8_scale(bf16_max, 0);
    CHECK(isfinite(cometi_e4m3_decode(cometi_fp8_quantize(bf16_max, cometi_fp8_inverse(s_max))) * s_max));
    return 0;
}

/* ---- comet.h's calls: the refusals, all before any CUDA call (none happens here) ---- */

#define CHECK_REFUSED(call, words)                                                                 \
    do {                                                                                           \
        CHECK_EQ((call), COMET_INVALID_ARGUMENT);                                                  \
        CHECK_CONTAINS(comet_last_create_error(), (words));                                        \
    } while (0)

/* The cast-transposes refuse a layout their vector accesses cannot take, before any CUDA
 * call (so on the CPU too): cudaErrorInvalidValue, nothing launched. */
int test_fp8_segments_t_refusals(void)
{
    const cometi_segment_t *segs = (const cometi_segment_t *)(uintptr_t)0x40000;
    void *const x = (void *)(uintptr_t)0x10000, *const qt = (void *)(uintptr_t)0x20000;
    float *const sc = (float *)(uintptr_t)0x30000;
    /* Accepted shapes with nothing to do: no rows, no columns, no groups. */
    CHECK_EQ(cometi_quantize_segments_t_e4m3(x, 128, 128, 0, segs, 1, qt, 128, sc, 1, 128, 0, 0), cudaSuccess);
    CHECK_EQ(cometi_quantize_segments_t_e4m3(x, 128, 128, 256, segs, 0, qt, 256, sc, 1, 128, 0, 0), cudaSuccess);
    /* bf16: cols not of 16, ldx under cols or not of 8, x or qt misaligned, ldq not of 16 or
     * under the rows' blocks (200 rows: 256), no segments or scales. */
    const struct { int cols; int64_t ldx, ldq; uintptr_t x_off, q_off; int no_segs, no_scales; } bad[] = {
        {120, 128, 256, 0, 0, 0, 0}, {128, 120, 256, 0, 0, 0, 0}, {128, 132, 256, 0, 0, 0, 0},
        {128, 128, 256, 8, 0, 0, 0}, {128, 128, 256, 0, 8, 0, 0}, {128, 128, 264, 0, 0, 0, 0},
        {128, 128, 240, 0, 0, 0, 0}, {128, 128, 256, 0, 0, 1, 0}, {128, 128, 256, 0, 0, 0, 1}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK_EQ(cometi_quantize_segments_t_e4m3((char *)x + bad[i].x_off, bad[i].ldx, bad[i].cols, 200,
                                                 bad[i].no_segs ? NULL : segs, 1, (char *)qt + bad[i].q_off,
                                                 bad[i].ldq, bad[i].no_scales ? NULL : sc, 1, 128, 0, 0),
                 cudaErrorInvalidValue);
    /* E4M3 rows (8-byte rows and alignment): rows not of 8 bytes, x off 8 bytes, no scales. */
    CHECK_EQ(cometi_requantize_segments_t_e4m3(x, 132, sc, 2, 1, 128, 200, segs, 1, qt, 256, sc, 1, 128, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_requantize_segments_t_e4m3((char *)x + 4, 136, sc, 2, 1, 128, 200, segs, 1, qt, 256, sc, 1, 128,
                                               0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_requantize_segments_t_e4m3(x, 136, NULL, 2, 1, 128, 200, segs, 1, qt, 256, sc, 1, 128, 0, 0),
             cudaErrorInvalidValue);
    return 0;
}

int test_fp8_quantize_api_refusals(void)
{
    /* Addresses that are never read: every call below is refused before a launch, or (rows
     * 0) does nothing. */
    void *const in = (void *)(uintptr_t)0x10000, *const q = (void *)(uintptr_t)0x20000;
    float *const sc = (float *)(uintptr_t)0x30000;
    const cudaStream_t st = 0;

    /* Rows. */
    CHECK_REFUSED(comet_quantize_fp8_rows(in, -1, 128, 0, q, sc, st), "comet_quantize_fp8_rows: rows = -1: must be >= 0");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 0, 0, q, sc, st), "cols = 0: must be a positive multiple of 16");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 8, 0, q, sc, st), "cols = 8: must be a positive multiple of 16");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 100, 0, q, sc, st), "cols = 100: must be a positive multiple of 16");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, -16, 0, q, sc, st), "cols = -16");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 128, 2, q, sc, st), "pow2_scales = 2: must be 0 or 1");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 128, -1, q, sc, st), "pow2_scales = -1: must be 0 or 1");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, ((int64_t)1 << 61) / 16 + 1, 16, 0, q, sc, st),
                  "rows = 144115188075855873 x cols = 16: more than 2^61 elements");
    CHECK_REFUSED(comet_quantize_fp8_rows(NULL, 4, 128, 0, q, sc, st), "comet_quantize_fp8_rows: x is NULL");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 128, 0, NULL, sc, st), "q is NULL");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 128, 0, q, NULL, st), "scales is NULL");
    CHECK_REFUSED(comet_quantize_fp8_rows((char *)in + 8, 4, 128, 0, q, sc, st), "x = 0x10008: must be 16-byte aligned");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 128, 0, (char *)q + 4, sc, st), "q = 0x20004: must be 16-byte aligned");
    CHECK_REFUSED(comet_quantize_fp8_rows(in, 4, 128, 0, q, (float *)((char *)sc + 2), st),
                  "scales = 0x30002: must be 4-byte aligned");
    /* rows 0: nothing to do, NULL pointers (an empty tensor's) welcome; cols still checked. */
    CHECK_EQ(comet_quantize_fp8_rows(NULL, 0, 128, 1, NULL, NULL, st), COMET_SUCCESS);
    CHECK_REFUSED(comet_quantize_fp8_rows(NULL, 0, 40, 0, NULL, NULL, st), "cols = 40");

    /* Weights. */
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 0, 128, 128, 0, q, sc, st),
                  "comet_quantize_fp8_weights: mats = 0: must be >= 1");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, -3, 128, 128, 0, q, sc, st), "mats = -3: must be >= 1");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, 0, 128, 0, q, sc, st), "rows = 0: must be >= 1");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, -5, 128, 0, q, sc, st), "rows = -5: must be >= 1");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, 128, 17, 0, q, sc, st), "cols = 17: must be a positive multiple of 16");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, 128, 128, 7, q, sc, st), "pow2_scales = 7: must be 0 or 1");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, INT64_MAX, 2, 16, 0, q, sc, st),
                  "mats = 9223372036854775807 x rows = 2: more than 2^61 elements");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, (int64_t)1 << 40, 1 << 20, 16, 0, q, sc, st),
                  "mats x rows = 1152921504606846976 x cols = 16: more than 2^61 elements");
    CHECK_REFUSED(comet_quantize_fp8_weights(NULL, 2, 128, 128, 0, q, sc, st), "comet_quantize_fp8_weights: w is NULL");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, 128, 128, 0, NULL, sc, st), "q is NULL");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, 128, 128, 0, q, NULL, st), "scales is NULL");
    CHECK_REFUSED(comet_quantize_fp8_weights((char *)in + 2, 2, 128, 128, 0, q, sc, st), "w = 0x10002: must be 16-byte aligned");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, 128, 128, 0, (char *)q + 8, sc, st), "q = 0x20008: must be 16-byte aligned");
    CHECK_REFUSED(comet_quantize_fp8_weights(in, 2, 128, 128, 0, q, (float *)((char *)sc + 1), st),
                  "scales = 0x30001: must be 4-byte aligned");

    /* Weights with their transpose: rows are the transpose's k. */
    void *const qt = (void *)(uintptr_t)0x40000;
    float *const sct = (float *)(uintptr_t)0x50000;
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 0, 128, 128, 0, q, sc, qt, sct, st),
                  "comet_quantize_fp8_weights_transposed: mats = 0: must be >= 1");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 200, 128, 0, q, sc, qt, sct, st),
                  "rows = 200: must be a positive multiple of 16");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 0, 128, 0, q, sc, qt, sct, st),
                  "rows = 0: must be a positive multiple of 16");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 40, 0, q, sc, qt, sct, st),
                  "cols = 40: must be a positive multiple of 16");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 3, q, sc, qt, sct, st),
                  "pow2_scales = 3: must be 0 or 1");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, INT64_MAX, 16, 16, 0, q, sc, qt, sct, st),
                  "mats = 9223372036854775807 x rows = 16: more than 2^61 elements");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 0, q, sc, NULL, sct, st), "qt is NULL");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 0, q, sc, qt, NULL, st), "scales_t is NULL");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 0, q, sc, (char *)qt + 8, sct, st),
                  "qt = 0x40008: must be 16-byte aligned");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 0, q, sc, qt, (float *)((char *)sct + 2), st),
                  "scales_t = 0x50002: must be 4-byte aligned");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 0, q, NULL, qt, sct, st),
                  "scales = (nil): give both");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 0, NULL, sc, qt, sct, st),
                  "q = (nil) and scales = 0x30000: give both");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(in, 2, 128, 128, 0, (char *)q + 4, sc, qt, sct, st),
                  "q = 0x20004: must be 16-byte aligned");
    CHECK_REFUSED(comet_quantize_fp8_weights_transposed(NULL, 2, 128, 128, 0, q, sc, qt, sct, st), "w is NULL");
    return 0;
}

/* ---- on a GPU: the hardware's conversion against the host's, every float ---- */

static int cvt_sweep_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    const uint32_t chunk = 1u << 26;
    uint8_t *dev, *host = malloc(chunk);
    CHECK(host != NULL);
    CUDA_OK(cudaMalloc((void **)&dev, chunk));
    /* What the hardware makes of the special values (for the record, and checked below). */
    const uint32_t special[] = {0x7fc00000u, 0xffc00000u, 0xff800001u, 0x7f800000u, 0xff800000u, 0x00000000u,
                                0x80000000u, 0x43e80000u /* 464 */, 0xb9800000u /* -2^-12 */};
    const int n_special = (int)(sizeof(special) / sizeof(special[0]));
    printf("cvt.rn.satfinite.e4m3x2.f32:");
    for (int i = 0; i < n_special; i++) {
        CUDA_OK(cometi_e4m3_cvt_range(special[i], 1, dev, 0));
        CUDA_OK(cudaMemcpy(host, dev, 1, cudaMemcpyDeviceToHost));
        printf(" %g (0x%08x) -> 0x%02x%s", f32(special[i]), special[i], host[0], i + 1 < n_special ? "," : "\n");
    }
    unsigned long long bad = 0;
    for (uint64_t first = 0; first < (1ull << 32); first += chunk) {
        CUDA_OK(cudaMemset(dev, 0xa5, chunk));
        CUDA_OK(cometi_e4m3_cvt_range((uint32_t)first, chunk, dev, 0));
        CUDA_OK(cudaMemcpy(host, dev, chunk, cudaMemcpyDeviceToHost));
        for (uint32_t i = 0; i < chunk; i++) {
            const uint32_t bits = (uint32_t)first + i;
            const uint8_t want = cometi_e4m3_encode(f32(bits));
            if (host[i] == want) continue;
            if (bad++ < 10) printf("float 0x%08x (%g): cvt 0x%02x, cometi_e4m3_encode 0x%02x\n", bits, f32(bits), host[i], want);
        }
    }
    printf("%llu of 2^32 floats differ\n", bad);
    cudaFree(dev);
    free(host);
    return bad != 0;
}

int test_gpu_e4m3_cvt_matches_host(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    return launch(1, cvt_sweep_rank, NULL, 110);
}

/* ---- on a GPU: both kernels against the host reference ---- */

/* Random bf16 inputs, a block at a time (a row's 128 columns): most blocks uniform in
 * +-2^e with e random over -60..60 (every scale differs), some all zeros (-0 among them),
 * some tiny (bf16 subnormals: the 2^-126 floor), some spanning 40 binades (many values
 * under the block's smallest E4M3 step). */
static void fill_blocks(uint16_t *h, int64_t rows, int cols, int64_t ld, uint64_t *rng)
{
    for (int64_t r = 0; r < rows; r++)
        for (int c0 = 0; c0 < cols; c0 += 128) {
            const int kind = (int)(cometi_rand_next(rng) % 20), e = (int)(cometi_rand_next(rng) % 121) - 60;
            for (int c = c0; c < cols && c < c0 + 128; c++) {
                const double u = 2 * cometi_rand_unit(rng) - 1;
                double v = ldexp(u, e);
                if (kind == 0) v = cometi_rand_next(rng) % 2 ? 0.0 : -0.0;
                if (kind == 1) v = ldexp(u, -126 - (int)(cometi_rand_next(rng) % 8));
                if (kind == 2) v = ldexp(u, e - (int)(cometi_rand_next(rng) % 40));
                h[r * ld + c] = cometi_float_to_bf16((float)v);
            }
        }
}

/* NaN (either sign), +-Inf, or 3e38 (near bf16's largest) at a random place in the rows
 * [r0, r1) x columns [c0, c1) of h. */
static void plant(uint16_t *h, int64_t ld, int64_t r0, int64_t r1, int c0, int c1, int what, uint64_t *rng)
{
    static const uint16_t values[] = {0x7fc0, 0xffc1, 0x7f80, 0xff80};
    const int64_t r = r0 + (int64_t)(cometi_rand_next(rng) % (uint64_t)(r1 - r0));
    const int c = c0 + (int)(cometi_rand_next(rng) % (uint64_t)(c1 - c0));
    h[r * ld + c] = what < 4 ? values[what] : cometi_float_to_bf16(cometi_rand_next(rng) % 2 ? 3e38f : -3e38f);
}

/* One block's reference: its amax over the elements given (x[r * ld + c], r in [r0, r1),
 * c in [c0, c1)), scale and inverse, by base/fp8.h's host side. */
static float block_scale(const uint16_t *x, int64_t ld, int64_t r0, int64_t r1, int c0, int c1, int pow2)
{
    float amax = 0.0f;
    for (int64_t r = r0; r < r1; r++)
        for (int c = c0; c < c1; c++) amax = cometi_fp8_max(amax, cometi_fp8_abs(cometi_bf16_to_float(x[r * ld + c])));
    return cometi_fp8_scale(amax, pow2);
}

/* What every checked element must satisfy beyond the reference's bytes: in a finite
 * block, comet.h's bound |q s - x| <= |x| / 16 + s / 1024 (q s in double) and a finite q s
 * in fp32 (no bf16 near the top is planted); in a block with a NaN or an infinity, q s
 * in fp32 is NaN. worst: the largest |q s - x| / (|x| / 16 + s / 1024) seen; print: say
 * what failed. */
static int check_element(float x, uint8_t q, float s, double *worst, int print)
{
    const float back = cometi_e4m3_decode(q) * s;
    if (!isfinite(s)) {
        if (isnan(back)) return 0;
        if (print) printf("x %g, q 0x%02x, scale %g: q s = %g, not NaN\n", x, q, s, back);
        return 1;
    }
    const double err = fabs((double)cometi_e4m3_decode(q) * s - x), bound = fabs((double)x) / 16 + (double)s / 1024;
    if (err / bound > *worst) *worst = err / bound;
    if (err <= bound && isfinite(back)) return 0;
    if (print) printf("x %a, q 0x%02x, scale %a: q s = %a, |q s - x| = %g, bound %g\n", x, q, s, back, err, bound);
    return 1;
}

#define POISON 0xa5 /* q and scales (as bytes) before each call */

/* A mismatch: counted in `bad`, the first 10 printed. */
#define FAIL_AT(...)                                                                               \
    do {                                                                                           \
        if (bad++ < 10) printf(__VA_ARGS__);                                                       \
    } while (0)

typedef struct rows_case {
    int64_t rows;
    int cols;
} rows_case_t;

/* The rows kernel on one shape: x [rows][ldx] with a gap of 8 columns (NaN and random
 * bits, which no block may read), q [rows][ldq] with a gap of 16 (untouched), the scales
 * K-major with a spare column ([rows][nblocks + 1], row stride nblocks + 1) or MN-major
 * ([nblocks][rows + 3]), pow2 off and on; then comet_quantize_fp8_rows on the contiguous
 * tensor (DeepEP's layout). Every q byte and scale against the host, the rest untouched. */
static int rows_case(const rows_case_t *rc, uint64_t *rng, int *nonfinite_blocks)
{
    const int64_t rows = rc->rows, ldx = rc->cols + 8, ldq = rc->cols + 16;
    const int cols = rc->cols, nb = (cols + 127) / 128;
    const size_t nx = (size_t)rows * ldx, nq = (size_t)rows * ldq;
    uint16_t *x = malloc(nx * 2), *xc = malloc((size_t)rows * cols * 2);
    fill_blocks(x, rows, cols, ldx, rng);
    for (int64_t r = 0; r < rows; r++)
        for (int c = cols; c < ldx; c++) x[r * ldx + c] = c == cols ? 0x7fc0 : (uint16_t)cometi_rand_next(rng);
    /* A NaN, an infinity or a huge value in about one block in 16; 3e38 in row 1. */
    for (int64_t r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++)
            if (cometi_rand_next(rng) % 16 == 0)
                plant(x, ldx, r, r + 1, b * 128, b * 128 + 128 < cols ? b * 128 + 128 : cols, (int)(cometi_rand_next(rng) % 5), rng);
    if (rows > 1) plant(x, ldx, 1, 2, 0, cols, 4, rng);
    for (int64_t r = 0; r < rows; r++) memcpy(xc + r * cols, x + r * ldx, (size_t)cols * 2);
    /* The reference's scales, [rows][nb], pow2 off and on. */
    float *want_s[2];
    for (int pow2 = 0; pow2 < 2; pow2++) {
        want_s[pow2] = malloc(sizeof(float) * rows * nb);
        for (int64_t r = 0; r < rows; r++)
            for (int b = 0; b < nb; b++)
                want_s[pow2][r * nb + b] = block_scale(x, ldx, r, r + 1, b * 128, b * 128 + 128 < cols ? b * 128 + 128 : cols, pow2);
    }
    for (int64_t i = 0; i < rows * nb; i++) *nonfinite_blocks += !isfinite(want_s[0][i]);
    const size_t ns = (size_t)nb * (rows + 3) + (size_t)rows * (nb + 1); /* room for either layout */
    void *dx, *dxc, *dq;
    float *ds;
    CUDA_OK(cudaMalloc(&dx, nx * 2));
    CUDA_OK(cudaMalloc(&dxc, (size_t)rows * cols * 2));
    CUDA_OK(cudaMalloc(&dq, nq));
    CUDA_OK(cudaMalloc((void **)&ds, ns * sizeof(float)));
    CUDA_OK(cudaMemcpy(dx, x, nx * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dxc, xc, (size_t)rows * cols * 2, cudaMemcpyHostToDevice));
    uint8_t *q = malloc(nq);
    float *s = malloc(ns * sizeof(float));
    double worst = 0;
    for (int run = 0; run < 5; run++) {
        /* runs 0-3: the kernel, (K-major, MN-major) x (pow2 off, on); run 4: comet.h's call. */
        const int pow2 = run % 2, mn = run / 2 == 1, api = run == 4;
        const int64_t row_stride = mn ? 1 : nb + 1, block_stride = mn ? rows + 3 : 1;
        const int64_t lq = api ? cols : ldq;
        CUDA_OK(cudaMemset(dq, POISON, nq));
        CUDA_OK(cudaMemset(ds, POISON, ns * sizeof(float)));
        if (api) {
            const comet_status_t st = comet_quantize_fp8_rows(dxc, rows, cols, pow2, dq, ds, 0);
            if (st != COMET_SUCCESS) printf("comet_quantize_fp8_rows: %s\n", comet_last_create_error());
            CHECK_EQ(st, COMET_SUCCESS);
        } else {
            CUDA_OK(cometi_quantize_rows_e4m3(dx, rows, cols, ldx, dq, ldq, ds, row_stride, block_stride, pow2, 0));
        }
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(q, dq, nq, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(s, ds, ns * sizeof(float), cudaMemcpyDeviceToHost));
        int bad = 0;
        uint8_t *written = calloc(ns, 1);
        for (int64_t r = 0; r < rows && bad < 10; r++)
            for (int b = 0; b < nb && bad < 10; b++) {
                const int64_t at = api ? r * nb + b : r * row_stride + b * block_stride;
                written[at] = 1;
                const float want = want_s[pow2][r * nb + b], inv = cometi_fp8_inverse(want);
                if (!same_float(s[at], want))
                    FAIL_AT("rows %lld x %d, run %d: scale of row %lld block %d = %a (0x%08x), host %a\n", (long long)rows,
                                  cols, run, (long long)r, b, s[at], cometi_f32_bits(s[at]), want);
                for (int c = b * 128; c < cols && c < b * 128 + 128; c++) {
                    const float xv = cometi_bf16_to_float(x[r * ldx + c]);
                    const uint8_t got = q[r * lq + c], ref = cometi_fp8_quantize(xv, inv);
                    if (got != ref)
                        FAIL_AT("rows %lld x %d, run %d: q[%lld][%d] = 0x%02x, host 0x%02x (x %a, scale %a)\n",
                                      (long long)rows, cols, run, (long long)r, c, got, ref, xv, want);
                    else bad += check_element(xv, got, want, &worst, bad < 10);
                }
            }
        for (size_t i = 0; i < ns && bad < 10; i++) /* scales no block owns: the poison */
            if (!written[i] && cometi_f32_bits(s[i]) != 0xa5a5a5a5u) FAIL_AT("run %d: scales[%zu] written\n", run, i);
        free(written);
        for (size_t i = 0; i < nq && bad < 10; i++) { /* q past cols, or past the rows: the poison */
            const int64_t r = (int64_t)i / lq, c = (int64_t)i % lq;
            if ((r >= rows || c >= cols) && q[i] != POISON) FAIL_AT("run %d: q byte %zu written\n", run, i);
        }
        CHECK_EQ(bad, 0);
    }
    printf("rows %5lld x %4d (%d blocks a row): 4 layouts and the API, every byte and scale as the host's; "
           "worst |q s - x| / bound %.3f\n", (long long)rows, cols, nb, worst);
    free(x), free(xc), free(q), free(s), free(want_s[0]), free(want_s[1]);
    cudaFree(dx), cudaFree(dxc), cudaFree(dq), cudaFree(ds);
    return 0;
}

typedef struct weights_case {
    int64_t mats;
    int rows, cols;
} weights_case_t;

/* comet_quantize_fp8_weights_transposed on the weights dw (w on the host gave q and s
 * through comet_quantize_fp8_weights): q and scales again byte for byte, qt and scales_t
 * their transposes, nothing written past either; once with q and scales, once without. */
static int transposed_case(const void *dw, int64_t mats, int rows, int cols, int pow2, const uint8_t *q,
                           const float *s, int *done)
{
    const int rt = (rows + 127) / 128, ct = (cols + 127) / 128;
    const size_t n = (size_t)mats * rows * cols, nsc = (size_t)mats * rt * ct, spare = 64;
    void *dq, *dqt;
    float *ds, *dst;
    CUDA_OK(cudaMalloc(&dq, n + spare));
    CUDA_OK(cudaMalloc(&dqt, n + spare));
    CUDA_OK(cudaMalloc((void **)&ds, (nsc + spare) * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dst, (nsc + spare) * sizeof(float)));
    uint8_t *q2 = malloc(n + spare), *qt = malloc(n + spare);
    float *s2 = malloc((nsc + spare) * sizeof(float)), *st = malloc((nsc + spare) * sizeof(float));
    int bad = 0;
    for (int with_q = 1; with_q >= 0; with_q--) {
        CUDA_OK(cudaMemset(dq, POISON, n + spare));
        CUDA_OK(cudaMemset(dqt, POISON, n + spare));
        CUDA_OK(cudaMemset(ds, POISON, (nsc + spare) * sizeof(float)));
        CUDA_OK(cudaMemset(dst, POISON, (nsc + spare) * sizeof(float)));
        const comet_status_t r = comet_quantize_fp8_weights_transposed(dw, mats, rows, cols, pow2, with_q ? dq : NULL,
                                                                       with_q ? ds : NULL, dqt, dst, 0);
        if (r != COMET_SUCCESS) printf("comet_quantize_fp8_weights_transposed: %s\n", comet_last_create_error());
        CHECK_EQ(r, COMET_SUCCESS);
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(q2, dq, n + spare, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(qt, dqt, n + spare, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(s2, ds, (nsc + spare) * sizeof(float), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(st, dst, (nsc + spare) * sizeof(float), cudaMemcpyDeviceToHost));
        for (int64_t m = 0; m < mats && bad < 10; m++)
            for (int r0 = 0; r0 < rows && bad < 10; r0++)
                for (int c = 0; c < cols && bad < 10; c++) {
                    const size_t e = ((size_t)m * rows + r0) * cols + c, et = ((size_t)m * cols + c) * rows + r0;
                    if (qt[et] != q[e])
                        FAIL_AT("transposed %lld x %d x %d, pow2 %d: qt[%lld][%d][%d] = 0x%02x, q's 0x%02x\n",
                                (long long)mats, rows, cols, pow2, (long long)m, c, r0, qt[et], q[e]);
                    if (with_q ? q2[e] != q[e] : q2[e] != POISON)
                        FAIL_AT("transposed, q %s: q[%zu] = 0x%02x, want 0x%02x\n", with_q ? "given" : "NULL", e, q2[e],
                                with_q ? q[e] : POISON);
                }
        for (int64_t m = 0; m < mats && bad < 10; m++)
            for (int i = 0; i < rt && bad < 10; i++)
                for (int j = 0; j < ct && bad < 10; j++) {
                    const size_t at = ((size_t)m * rt + i) * ct + j, att = ((size_t)m * ct + j) * rt + i;
                    if (cometi_f32_bits(st[att]) != cometi_f32_bits(s[at]))
                        FAIL_AT("transposed: scales_t[%lld][%d][%d] = %a, scales' %a\n", (long long)m, j, i, st[att], s[at]);
                    if (with_q && cometi_f32_bits(s2[at]) != cometi_f32_bits(s[at]))
                        FAIL_AT("transposed: scales[%zu] = %a, want %a\n", at, s2[at], s[at]);
                }
        for (size_t i = 0; i < spare && bad < 10; i++) {
            if (qt[n + i] != POISON) FAIL_AT("transposed: qt byte %zu past the tensor written\n", n + i);
            if (cometi_f32_bits(st[nsc + i]) != 0xa5a5a5a5u) FAIL_AT("transposed: scales_t %zu past written\n", nsc + i);
            if (with_q && q2[n + i] != POISON) FAIL_AT("transposed: q byte %zu past the tensor written\n", n + i);
        }
        if (!with_q)
            for (size_t i = 0; i < nsc + spare && bad < 10; i++)
                if (cometi_f32_bits(s2[i]) != 0xa5a5a5a5u) FAIL_AT("transposed, scales NULL: scales[%zu] written\n", i);
    }
    free(q2), free(qt), free(s2), free(st);
    cudaFree(dq), cudaFree(dqt), cudaFree(ds), cudaFree(dst);
    *done = 1;
    return bad;
}

/* comet_quantize_fp8_weights on one shape, pow2 off and on: every q byte and scale
 * against the host, the bytes and scales past the tensors untouched. A NaN, an infinity
 * or a huge value in about one tile in 4. */
static int weights_case(const weights_case_t *wc, uint64_t *rng, int *nonfinite_blocks)
{
    const int64_t mats = wc->mats;
    const int rows = wc->rows, cols = wc->cols, rt = (rows + 127) / 128, ct = (cols + 127) / 128;
    const size_t n = (size_t)mats * rows * cols, nsc = (size_t)mats * rt * ct, spare = 64;
    uint16_t *w = malloc(n * 2);
    fill_blocks(w, mats * rows, cols, cols, rng);
    for (int64_t m = 0; m < mats; m++)
        for (int i = 0; i < rt; i++)
            for (int j = 0; j < ct; j++)
                if (cometi_rand_next(rng) % 4 == 0)
                    plant(w + (size_t)m * rows * cols, cols, i * 128, i * 128 + 128 < rows ? i * 128 + 128 : rows, j * 128,
                          j * 128 + 128 < cols ? j * 128 + 128 : cols, (int)(cometi_rand_next(rng) % 5), rng);
    if (rows > 1) plant(w, cols, 1, 2, 0, cols, 4, rng);
    void *dw, *dq;
    float *ds;
    CUDA_OK(cudaMalloc(&dw, n * 2));
    CUDA_OK(cudaMalloc(&dq, n + spare));
    CUDA_OK(cudaMalloc((void **)&ds, (nsc + spare) * sizeof(float)));
    CUDA_OK(cudaMemcpy(dw, w, n * 2, cudaMemcpyHostToDevice));
    uint8_t *q = malloc(n + spare);
    float *s = malloc((nsc + spare) * sizeof(float));
    double worst = 0;
    int transposed = 0;
    for (int pow2 = 0; pow2 < 2; pow2++) {
        CUDA_OK(cudaMemset(dq, POISON, n + spare));
        CUDA_OK(cudaMemset(ds, POISON, (nsc + spare) * sizeof(float)));
        const comet_status_t st = comet_quantize_fp8_weights(dw, mats, rows, cols, pow2, dq, ds, 0);
        if (st != COMET_SUCCESS) printf("comet_quantize_fp8_weights: %s\n", comet_last_create_error());
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(q, dq, n + spare, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(s, ds, (nsc + spare) * sizeof(float), cudaMemcpyDeviceToHost));
        int bad = 0;
        for (int64_t m = 0; m < mats && bad < 10; m++)
            for (int i = 0; i < rt && bad < 10; i++)
                for (int j = 0; j < ct && bad < 10; j++) {
                    const uint16_t *wm = w + (size_t)m * rows * cols;
                    const int r1 = i * 128 + 128 < rows ? i * 128 + 128 : rows, c1 = j * 128 + 128 < cols ? j * 128 + 128 : cols;
                    const float want = block_scale(wm, cols, i * 128, r1, j * 128, c1, pow2), inv = cometi_fp8_inverse(want);
                    const size_t at = ((size_t)m * rt + i) * ct + j;
                    if (pow2 == 0) *nonfinite_blocks += !isfinite(want);
                    if (!same_float(s[at], want))
                        FAIL_AT("weights %lld x %d x %d, pow2 %d: scale [%lld][%d][%d] = %a, host %a\n", (long long)mats,
                                      rows, cols, pow2, (long long)m, i, j, s[at], want);
                    for (int r = i * 128; r < r1; r++)
                        for (int c = j * 128; c < c1; c++) {
                            const size_t e = ((size_t)m * rows + r) * cols + c;
                            const float xv = cometi_bf16_to_float(w[e]);
                            const uint8_t ref = cometi_fp8_quantize(xv, inv);
                            if (q[e] != ref)
                                FAIL_AT("weights %lld x %d x %d, pow2 %d: q[%lld][%d][%d] = 0x%02x, host 0x%02x (x %a)\n",
                                              (long long)mats, rows, cols, pow2, (long long)m, r, c, q[e], ref, xv);
                            else bad += check_element(xv, q[e], want, &worst, bad < 10);
                        }
                }
        for (size_t i = 0; i < spare && bad < 10; i++) {
            if (q[n + i] != POISON) FAIL_AT("pow2 %d: q byte %zu past the tensor written\n", pow2, n + i);
            if (cometi_f32_bits(s[nsc + i]) != 0xa5a5a5a5u) FAIL_AT("pow2 %d: scale %zu past the grid written\n", pow2, nsc + i);
        }
        CHECK_EQ(bad, 0);
        if (rows % 16 == 0) CHECK_EQ(transposed_case(dw, mats, rows, cols, pow2, q, s, &transposed), 0);
    }
    printf("weights %lld x %4d x %4d (%d x %d tiles a matrix): every byte and scale as the host's; worst |q s - x| / "
           "bound %.3f%s\n", (long long)mats, rows, cols, rt, ct, worst,
           transposed ? "; the transposed copy the same bytes transposed, with and without q" : "");
    free(w), free(q), free(s);
    cudaFree(dw), cudaFree(dq), cudaFree(ds);
    return 0;
}

/* Milliseconds of a launch: the median of 20 timed runs after 3 untimed ones. */
#define TIMED_RUNS 20
typedef struct segments_case {
    int64_t rows; /* x's rows allocated */
    int cols, groups;
    cometi_segment_t segs[4];
} segments_case_t;

/* The weight gradients' cast-transpose on one shape, from bf16 rows or (e4m3_in) from E4M3
 * rows with 1 x 128 scales (finite codes of every binade, scales 2^-20..2^20): x [rows][cols + 16] whose segments start at multiples of 128, NaN in every row
 * past a segment's end (never read: those rows count as zeros) and NaN or an infinity
 * (E4M3: a NaN code) planted in about one column block in 16; qt [cols][ldq] (ldq a 16-byte multiple
 * past the rows) and the scales [row blocks][cols + 3] poisoned first. Each segment's
 * 128-row block of each column against the host (the values as the kernel reads them:
 * bf16, or each code times its scale in fp32): its scale bit for bit, every byte (rows
 * past the segment's end: zeros times the block's inverse), and nothing written for
 * blocks in no segment or past cols; pow2 off and on. */
static int segments_case(const segments_case_t *sc, int e4m3_in, uint64_t *rng, int *nonfinite_blocks)
{
    const int cols = sc->cols, rb_count = (int)((sc->rows + 127) / 128), nb = (cols + 127) / 128;
    const int64_t rows = sc->rows, ldx = cols + 16, ldq = (rows + 127) / 128 * 128 + 16;
    const int64_t sblock = cols + 3, xs_row = nb + 1; /* the scales' row-block stride; x's scales' row stride */
    uint16_t *x = malloc((size_t)rows * ldx * 2);
    uint8_t *x8 = malloc((size_t)rows * ldx);
    float *xs = malloc(sizeof(float) * rows * xs_row), *xf = malloc(sizeof(float) * rows * cols);
    fill_blocks(x, rows, cols, ldx, rng);
    for (int64_t r = 0; r < rows; r++) {
        for (int c = 0; c < ldx; c++) { /* any finite code (NaN ones are planted below) */
            const uint8_t code = (uint8_t)(cometi_rand_next(rng) >> 24);
            x8[r * ldx + c] = (code & 0x7f) == 0x7f ? code ^ 1 : code;
        }
        for (int b = 0; b < xs_row; b++) xs[r * xs_row + b] = ldexpf(1.0f + (float)cometi_rand_unit(rng),
                                                                     (int)(cometi_rand_next(rng) % 40) - 20);
    }
    int *in_seg = calloc((size_t)rb_count, sizeof(int)); /* block -> 1 + its segment, 0: none */
    for (int g = 0; g < sc->groups; g++) {
        const cometi_segment_t sg = sc->segs[g];
        CHECK(sg.start % 128 == 0);
        for (int64_t r = sg.start; r < sg.start + (sg.rows + 127) / 128 * 128; r++) {
            in_seg[r / 128] = g + 1;
            if (r >= sg.start + sg.rows) { /* past the segment: never read */
                for (int c = 0; c < cols; c++) x[r * ldx + c] = 0x7fc0, x8[r * ldx + c] = COMETI_E4M3_NAN;
                for (int b = 0; b < xs_row; b++) xs[r * xs_row + b] = NAN;
            }
        }
        for (int64_t r0 = sg.start; r0 < sg.start + sg.rows; r0 += 128)
            for (int c = 0; c < cols; c++)
                if (cometi_rand_next(rng) % (16 * 128) == 0) {
                    const int64_t r1 = r0 + 128 < sg.start + sg.rows ? r0 + 128 : sg.start + sg.rows;
                    plant(x, ldx, r0, r1, c, c + 1, (int)(cometi_rand_next(rng) % 5), rng);
                    x8[(r0 + (int64_t)(cometi_rand_next(rng) % (uint64_t)(r1 - r0))) * ldx + c] = COMETI_E4M3_NAN;
                }
    }
    for (int64_t r = 0; r < rows; r++) { /* the columns past cols: NaN; the values the kernel reads */
        for (int c = cols; c < ldx; c++) x[r * ldx + c] = 0x7fc0, x8[r * ldx + c] = COMETI_E4M3_NAN;
        for (int c = 0; c < cols; c++)
            xf[r * cols + c] = e4m3_in ? cometi_fp8_mul(cometi_e4m3_decode(x8[r * ldx + c]), xs[r * xs_row + c / 128])
                                       : cometi_bf16_to_float(x[r * ldx + c]);
    }
    cometi_segment_t *dsegs;
    void *dx, *dq;
    float *ds, *dxs;
    const size_t nq = (size_t)cols * ldq, ns = (size_t)rb_count * sblock;
    CUDA_OK(cudaMalloc((void **)&dsegs, sizeof(sc->segs)));
    CUDA_OK(cudaMalloc(&dx, (size_t)rows * ldx * 2));
    CUDA_OK(cudaMalloc((void **)&dxs, sizeof(float) * rows * xs_row));
    CUDA_OK(cudaMalloc(&dq, nq));
    CUDA_OK(cudaMalloc((void **)&ds, ns * sizeof(float)));
    CUDA_OK(cudaMemcpy(dsegs, sc->segs, sizeof(sc->segs), cudaMemcpyHostToDevice));
    if (e4m3_in) CUDA_OK(cudaMemcpy(dx, x8, (size_t)rows * ldx, cudaMemcpyHostToDevice));
    else CUDA_OK(cudaMemcpy(dx, x, (size_t)rows * ldx * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dxs, xs, sizeof(float) * rows * xs_row, cudaMemcpyHostToDevice));
    uint8_t *q = malloc(nq);
    float *s = malloc(ns * sizeof(float));
    double worst = 0;
    for (int pow2 = 0; pow2 < 2; pow2++) {
        CUDA_OK(cudaMemset(dq, POISON, nq));
        CUDA_OK(cudaMemset(ds, POISON, ns * sizeof(float)));
        if (e4m3_in)
            CUDA_OK(cometi_requantize_segments_t_e4m3(dx, ldx, dxs, xs_row, 1, cols, rows, dsegs, sc->groups, dq, ldq,
                                                      ds, 1, sblock, pow2, 0));
        else
            CUDA_OK(cometi_quantize_segments_t_e4m3(dx, ldx, cols, rows, dsegs, sc->groups, dq, ldq, ds, 1, sblock,
                                                    pow2, 0));
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(q, dq, nq, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(s, ds, ns * sizeof(float), cudaMemcpyDeviceToHost));
        int bad = 0;
        for (int rb = 0; rb < rb_count && bad < 10; rb++) {
            const int64_t r0 = (int64_t)rb * 128;
            for (int c = 0; c < (int)sblock && bad < 10; c++) {
                const float got_s = s[(size_t)rb * sblock + c];
                if (!in_seg[rb] || c >= cols) {
                    if (cometi_f32_bits(got_s) != 0xa5a5a5a5u) FAIL_AT("block %d column %d: scale written\n", rb, c);
                    for (int64_t r = r0; r < r0 + 128 && c < cols; r++)
                        if (q[(size_t)c * ldq + r] != POISON) FAIL_AT("qt[%d][%lld] written\n", c, (long long)r);
                    continue;
                }
                const cometi_segment_t sg = sc->segs[in_seg[rb] - 1];
                const int64_t r1 = r0 + 128 < sg.start + sg.rows ? r0 + 128 : sg.start + sg.rows;
                float amax = 0.0f;
                for (int64_t r = r0; r < r1; r++) amax = cometi_fp8_max(amax, cometi_fp8_abs(xf[r * cols + c]));
                const float want = cometi_fp8_scale(amax, pow2), inv = cometi_fp8_inverse(want);
                if (pow2 == 0) *nonfinite_blocks += !isfinite(want);
                if (!same_float(got_s, want))
                    FAIL_AT("rows %lld x %d: scale of block %d column %d = %a, host %a\n", (long long)rows, cols, rb, c,
                            got_s, want);
                for (int64_t r = r0; r < r0 + 128; r++) {
                    const float xv = r < r1 ? xf[r * cols + c] : 0.0f;
                    const uint8_t got = q[(size_t)c * ldq + r], ref = cometi_fp8_quantize(xv, inv);
                    if (got != ref)
                        FAIL_AT("rows %lld x %d: qt[%d][%lld] = 0x%02x, host 0x%02x (x %a, scale %a)\n",
                                (long long)rows, cols, c, (long long)r, got, ref, xv, want);
                    else if (r < r1) bad += check_element(xv, got, want, &worst, bad < 10);
                }
            }
        }
        for (size_t i = 0; i < nq && bad < 10; i++) /* qt's rows' tails past the blocks */
            if ((int64_t)(i % ldq) >= (int64_t)rb_count * 128 && q[i] != POISON) FAIL_AT("qt byte %zu written\n", i);
        CHECK_EQ(bad, 0);
    }
    printf("segments %lld x %4d (%d groups) from %s rows, transposed in 128 x 1 blocks: every byte and scale as the "
           "host's; worst |q s - x| / bound %.3f\n", (long long)rows, cols, sc->groups, e4m3_in ? "E4M3" : "bf16",
           worst);
    free(x), free(x8), free(xs), free(xf), free(in_seg), free(q), free(s);
    cudaFree(dsegs), cudaFree(dx), cudaFree(dxs), cudaFree(dq), cudaFree(ds);
    return 0;
}

/* The kernels' speed, for the record (not checked against anything): the bytes each moves
 * to and from HBM (bf16 in; E4M3 bytes and FP32 scales out) over its median time, on
 * tensors far larger than L2 (H200: 4.8 TB/s on paper). */
static int time_kernels(void)
{
    const int64_t rows = 16384, mats = 8;
    const int cols = 7168, wrows = 4096;
    const size_t n = (size_t)mats * wrows * cols; /* the larger of the two */
    void *x, *q;
    float *sc;
    CUDA_OK(cudaMalloc(&x, n * 2));
    CUDA_OK(cudaMalloc(&q, n));
    CUDA_OK(cudaMalloc((void **)&sc, n / 128 * sizeof(float)));
    CUDA_OK(cometi_fill_hash_bf16(x, n, 7, 0, 1.0f, 0));
    cudaEvent_t ev[2];
    CUDA_OK(cudaEventCreate(&ev[0]));
    CUDA_OK(cudaEventCreate(&ev[1]));
    void *qt;
    CUDA_OK(cudaMalloc(&qt, n));
    cometi_segment_t segs_host[8], *segs;
    for (int g = 0; g < 8; g++) segs_host[g] = (cometi_segment_t){g * (int)(rows / 8), (int)(rows / 8)};
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    for (int which = 0; which < 5; which++) {
        float ms[TIMED_RUNS];
        /* The requantization's input: x's rows in E4M3 (the kernels before wrote q and sc). */
        if (which == 4) CUDA_OK(cometi_quantize_rows_e4m3(x, rows, cols, cols, q, cols, sc, 1, rows, 0, 0));
        for (int i = -3; i < TIMED_RUNS; i++) {
            CUDA_OK(cudaEventRecord(ev[0], 0));
            if (which == 0) CUDA_OK(cometi_quantize_rows_e4m3(x, rows, cols, cols, q, cols, sc, 1, rows, 0, 0));
            else if (which == 1) CUDA_OK(cometi_quantize_blocks_e4m3(x, mats, wrows, cols, q, sc, NULL, NULL, 0, 0));
            else if (which == 2) CUDA_OK(cometi_quantize_blocks_e4m3(x, mats, wrows, cols, q, sc, qt, sc + n / 256, 0, 0));
            else if (which == 3) CUDA_OK(cometi_quantize_segments_t_e4m3(x, cols, cols, rows, segs, 8, qt, rows, sc, 1, cols, 0, 0));
            else CUDA_OK(cometi_requantize_segments_t_e4m3(q, cols, sc, 1, rows, cols, rows, segs, 8, qt, rows,
                                                           sc + n / 128 / 2, 1, cols, 0, 0));
            CUDA_OK(cudaEventRecord(ev[1], 0));
            CUDA_OK(cudaEventSynchronize(ev[1]));
            if (i >= 0) CUDA_OK(cudaEventElapsedTime(&ms[i], ev[0], ev[1]));
        }
        qsort(ms, TIMED_RUNS, sizeof(float), cmp_float);
        const double elems = which == 1 || which == 2 ? (double)n : (double)rows * cols;
        const double blocks = which == 1 || which == 2 ? (double)mats * (wrows / 128) * (cols / 128)
                                                       : (double)rows * (cols / 128);
        const double copies = which == 2 ? 2 : 1, in_bytes = which == 4 ? 1 : 2, in_blocks = which == 4 ? 1 : 0;
        const double bytes = elems * (in_bytes + copies) + blocks * 4 * (copies + in_blocks), med = ms[TIMED_RUNS / 2];
        printf("%s: median %.3f ms, %.2f TB/s (%.0f MB moved)\n",
               which == 0   ? "rows 16384 x 7168 (MN-major scales)"
               : which == 1 ? "weights 8 x 4096 x 7168"
               : which == 2 ? "weights 8 x 4096 x 7168 and their transpose"
               : which == 3 ? "rows 16384 x 7168 in 8 segments, transposed in 128 x 1 blocks"
                            : "E4M3 rows 16384 x 7168 (1 x 128) in 8 segments, requantized transposed",
               med, bytes / med / 1e9, bytes / 1e6);
    }
    cudaFree(qt), cudaFree(segs);
    cudaEventDestroy(ev[0]), cudaEventDestroy(ev[1]);
    cudaFree(x), cudaFree(q), cudaFree(sc);
    return 0;
}

static int quantize_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg;
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    /* Columns not a multiple of 128 (2880: 22.5 blocks; 200 x 48: one partial block), nor
     * of 512 (a warp's four blocks), 16 (the least), and rows past a 128 boundary. */
    const rows_case_t rcs[] = {{300, 2880}, {257, 1408}, {200, 48}, {3, 16}, {130, 7168}, {1, 2048}, {64, 400}};
    int nonfinite = 0;
    for (size_t i = 0; i < sizeof(rcs) / sizeof(rcs[0]); i++)
        if (rows_case(&rcs[i], &rng, &nonfinite)) return 1;
    const weights_case_t wcs[] = {{3, 200, 2880}, {2, 256, 1408}, {1, 200, 48}, {5, 1, 16}, {2, 384, 7168}, {4, 130, 400},
                                  {3, 272, 400}, {2, 2880, 144}, {1, 16, 2880}};
    for (size_t i = 0; i < sizeof(wcs) / sizeof(wcs[0]); i++)
        if (weights_case(&wcs[i], &rng, &nonfinite)) return 1;
    /* Segments as the layer lays them: ragged, one empty, one of a single row, a block in none. */
    const segments_case_t scs[] = {{768, 2880, 4, {{0, 300}, {384, 0}, {384, 128}, {512, 1}}},
                                   {1024, 1408, 2, {{128, 257}, {512, 384}}},
                                   {256, 16, 1, {{0, 200}}}};
    for (size_t i = 0; i < sizeof(scs) / sizeof(scs[0]); i++)
        for (int e4m3_in = 0; e4m3_in < 2; e4m3_in++)
            if (segments_case(&scs[i], e4m3_in, &rng, &nonfinite)) return 1;
    printf("%d blocks held a NaN or an infinity; each dequantized to NaN in every element\n", nonfinite);
    CHECK(nonfinite > 0);
    /* rows 0: nothing launched, nothing written. */
    uint8_t *dq;
    CUDA_OK(cudaMalloc((void **)&dq, 256));
    CUDA_OK(cudaMemset(dq, POISON, 256));
    CUDA_OK(cometi_quantize_rows_e4m3(NULL, 0, 128, 128, dq, 128, (float *)(dq + 128), 1, 1, 0, 0));
    CHECK_EQ(comet_quantize_fp8_rows(NULL, 0, 128, 0, NULL, NULL, 0), COMET_SUCCESS);
    uint8_t back[256];
    CUDA_OK(cudaMemcpy(back, dq, 256, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 256; i++) CHECK_EQ(back[i], POISON);
    cudaFree(dq);
    return time_kernels();
}

int test_gpu_quantize_fp8(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, quantize_rank, &seed, 110);
}
