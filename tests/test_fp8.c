/*
 * test_fp8.c - block-scaled FP8 (E4M3) on the CPU: base/fp8.h's rounding against an
 * independent reference (E4M3's values from the format's definition, the nearest found by
 * search in double, ties to even), its scales, the NaN and infinity policy comet.h states,
 * and every refusal of comet.h's two quantize calls.
 */
#define _GNU_SOURCE
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "comet.h"
#include "base/fp8.h"
#include "testutil.h"

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
 * float's double-rounding bound, 2 x 24 + 2 bits), or the power of two 2^k with
 * 448 x 2^(k-1) < amax <= 448 x 2^k, compared exactly; at least 2^-126; 1 for 0. */
static float scale_reference(float amax, int pow2)
{
    if (isnan(amax) || isinf(amax)) return amax;
    if (amax == 0.0f) return 1.0f;
    if (!pow2) {
        const float s = (float)((double)amax / 448.0);
        return s < FLT_MIN ? FLT_MIN : s;
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
    for (int pow2 = 0; pow2 < 2; pow2++) {
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
    /* Random amaxes over float's whole range against the reference. */
    for (int i = 0; i < 200000; i++) {
        const float a = f32((uint32_t)cometi_rand_next(&rng) & 0x7f7fffffu); /* positive, finite */
        CHECK_SCALE(a, 0, scale_reference(a, 0));
        CHECK_SCALE(a, 1, scale_reference(a, 1));
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
    return 0;
}
