/*
 * fp8.h - the arithmetic of block-scaled FP8 (E4M3 values, FP32 scales, DeepSeek-V3's
 * recipe; comet.h states it for users): E4M3 encoding and decoding, a block's scale from
 * its amax, and the NaN-propagating max that finds the amax. The quantize kernels
 * (pointwise/quantize.cu) and their host reference (the tests) call the same functions,
 * so both sides give the same bits; nothing here depends on a compiler flag (fast math,
 * flushing subnormals): on the device each float operation is one PTX instruction written
 * out, on the host plain float arithmetic (IEEE single precision, round to nearest even,
 * as x86-64 and aarch64 evaluate it).
 *
 * E4M3 ("e4m3fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; NaN
 * is S.1111.111 (0x7F, 0xFF); the largest finite value is 448 (0x7E), the smallest normal
 * 2^-6, the smallest subnormal 2^-9.
 */
#ifndef COMET_BASE_FP8_H
#define COMET_BASE_FP8_H

#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define COMETI_E4M3_MAX 448.0f      /* the largest finite E4M3 value (0x7E) */
#define COMETI_E4M3_NAN 0x7F        /* what every NaN encodes to */
#define COMETI_FP8_BLOCK 128        /* a scale block's side: 1 x 128 (rows), 128 x 128 (weights) */
#define COMETI_FP8_MIN_SCALE 0x1p-126f /* FLT_MIN: the smallest scale (1 / scale stays finite) */

static inline COMETI_HD uint32_t cometi_f32_bits(float f)
{
    union { uint32_t u; float f; } v;
    v.f = f;
    return v.u;
}

static inline COMETI_HD float cometi_f32_from_bits(uint32_t u)
{
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
}

/* |x|: the sign bit cleared (a NaN stays a NaN). */
static inline COMETI_HD float cometi_fp8_abs(float x)
{
    return cometi_f32_from_bits(cometi_f32_bits(x) & 0x7fffffffu);
}

/* The larger of a and b, NaN when either is NaN (the canonical NaN 0x7FFFFFFF, as PTX
 * max.NaN.f32 gives): an amax over |x| values that a NaN anywhere in the block poisons.
 * For amaxes only: a and b are never -0 there (the sign of a zero result is not pinned). */
static inline COMETI_HD float cometi_fp8_max(float a, float b)
{
#ifdef __CUDA_ARCH__
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
#else
    if (a != a || b != b) return cometi_f32_from_bits(0x7fffffffu);
    return a > b ? a : b;
#endif
}

/* a / b and a x b, IEEE single precision, rounded to nearest even, subnormals kept. */
static inline COMETI_HD float cometi_fp8_div(float a, float b)
{
#ifdef __CUDA_ARCH__
    float d;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
#else
    return a / b;
#endif
}

static inline COMETI_HD float cometi_fp8_mul(float a, float b)
{
#ifdef __CUDA_ARCH__
    float d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
#else
    return a * b;
#endif
}

/* x to E4M3, rounded to nearest even, saturating: what PTX cvt.rn.satfinite.e4m3x2.f32
 * gives (gpu_e4m3_cvt_matches_host checks every float against it). |x| >= 448,
 * infinities included, gives +-448 (RNE takes 448 < |x| <= 464 to 448 and anything above
 * past the format, where satfinite stops it at 448 too). Every NaN gives 0x7F, whatever
 * its sign: .satfinite makes a NaN the destination format's NaN, and NVIDIA's host
 * fallback for the same conversion (__nv_cvt_float_to_fp8, cuda_fp8.hpp) makes every NaN
 * positive first. Zero and what rounds to zero keep their sign (-0 is 0x80). */
static inline COMETI_HD uint8_t cometi_e4m3_encode(float x)
{
    const uint32_t u = cometi_f32_bits(x), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7f800000u) return COMETI_E4M3_NAN;
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7e); /* |x| >= 448 */
    const int e = (int)(a >> 23) - 127;                 /* |x| in [2^e, 2^(e+1)); float subnormals: -127 */
    if (e < -11) return sign;                           /* |x| < 2^-11, under half the smallest subnormal */
    const uint32_t sig = (a & 0x7fffffu) | 0x800000u;   /* |x| = sig x 2^(e-23) */
    /* E4M3's step at |x|: 2^(e-3) from 2^-6 up, 2^-9 below (its subnormals). */
    const int step = (e < -6 ? -6 : e) - 3;
    const int shift = step - (e - 23);                  /* bits of sig below the step: 20..25 */
    uint32_t r = sig >> shift;                          /* |x| in steps, truncated */
    const uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    /* |x| ~ r steps of 2^step. Below 2^-6 the code is r itself (0..8; 8 is 2^-6, the
     * smallest normal); from there, binade e's codes are ((e + 6) << 3) + r with r in
     * 8..15, and r = 16 (rounded up) is the next binade's first code. */
    return (uint8_t)(sign | (((step + 9) << 3) + r));
}

/* The value of an E4M3 code: exact; 0x7F and 0xFF are NaN. */
static inline COMETI_HD float cometi_e4m3_decode(uint8_t v)
{
    const uint32_t sign = (uint32_t)(v & 0x80u) << 24, e = (v >> 3) & 0xfu, m = v & 7u;
    if ((v & 0x7fu) == 0x7fu) return cometi_f32_from_bits(sign | 0x7fc00000u);
    if (e == 0) return cometi_f32_from_bits(sign | cometi_f32_bits((float)m * 0x1p-9f)); /* m x 2^-9 */
    return cometi_f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));                 /* 1.m x 2^(e-7) */
}

/* The scale rules (cometi_fp8_scale's `pow2`): amax / 448; the power of two at or above it;
 * or it rounded up to 8 significant bits, exact in bf16 (the weight gradients' B operands:
 * their GEMM reads each column's scale as bf16, half the shared-memory bytes). */
#define COMETI_FP8_SCALE_EXACT 0
#define COMETI_FP8_SCALE_POW2 1
#define COMETI_FP8_SCALE_BF16 2

/* A block's scale from its amax (the largest |x|, NaN if any x is NaN): amax / 448, or with
 * pow2 the smallest power of two at or above it (COMETI_FP8_SCALE_BF16: the smallest float
 * of 8 significant bits at or above it, at most 2^-7 coarser); at least 2^-126 (FLT_MIN), so
 * 1 / scale is finite (a block of values under 448 x 2^-126 ~ 5e-36 would otherwise get a
 * subnormal scale whose inverse overflows: its zeros would quantize to NaN (0 x Inf)).
 * amax 0: 1. NaN gives NaN, infinity infinity, pow2 or not. fl(amax / 448) is a power of
 * two only when amax / 448 is one exactly (amax is a float), so rounding the quotient up
 * gives the power of two at or above the exact quotient. */
static inline COMETI_HD float cometi_fp8_scale(float amax, int pow2)
{
    if (amax == 0.0f) return 1.0f;
    float s = cometi_fp8_div(amax, COMETI_E4M3_MAX);
    if (s < COMETI_FP8_MIN_SCALE) s = COMETI_FP8_MIN_SCALE; /* false for NaN: it stays */
    if (pow2) {
        uint32_t u = cometi_f32_bits(s);
        /* A normal float with mantissa bits up to the next binade (2^120 at most: no overflow),
         * or up to the next multiple of 2^16 in its bits (a carry into the exponent is the
         * next binade). */
        if (pow2 == COMETI_FP8_SCALE_BF16) {
            if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xffffu) & 0xffff0000u;
        } else if ((u & 0x7f800000u) != 0x7f800000u && (u & 0x007fffffu)) {
            u = (u & 0xff800000u) + 0x00800000u;
        }
        s = cometi_f32_from_bits(u);
    }
    return s;
}

/* What multiplies each x of a block before it is encoded: 1 / scale (IEEE division; 0
 * for an infinite scale, NaN for a NaN one). */
static inline COMETI_HD float cometi_fp8_inverse(float scale) { return cometi_fp8_div(1.0f, scale); }

/* One element: q = e4m3(x x inverse). */
static inline COMETI_HD uint8_t cometi_fp8_quantize(float x, float inverse)
{
    return cometi_e4m3_encode(cometi_fp8_mul(x, inverse));
}

#ifdef __CUDACC__
/* Two floats to E4M3 by the hardware's conversion (sm_89 and later), with the bits of
 * cometi_e4m3_encode: lo in bits 0-7, hi in bits 8-15 (lo first in memory). */
static __device__ __forceinline__ uint16_t cometi_e4m3x2_cvt(float lo, float hi)
{
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}
#endif

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASE_FP8_H */
