/*
 * dswiglu.cuh - one element of SwiGLU's backward, the one definition swiglu.cu's bf16
 * backward and swiglu_fp8.cu's FP8 kernels share (so their values agree bit for bit).
 */
#ifndef COMET_POINTWISE_DSWIGLU_CUH
#define COMET_POINTWISE_DSWIGLU_CUH

#include <cuda_bf16.h>
#include <stdint.h>

/* From g, u, s = (dy W2) and the row's weight w: dg and du (dh = [dg du] of da = w s), w a,
 * and a = silu(g) u for <s, a>. silu'(g) = sig(g) (1 + g (1 - sig(g))). sig(g) takes the
 * fast exp and divide (2 ulp each, far below the bf16 rounding of every output): the IEEE
 * expf and division, with their range checks and slow-path calls, were most of these
 * kernels' instructions. Below g = -87.3 the denominator passes 2^126 and sig is 0 (the
 * true value is under 1e-38). */
typedef struct dswiglu {
    float dg, du, wa, a;
} dswiglu_t;

static __device__ __forceinline__ dswiglu_t dswiglu(float g, float u, float s, float w)
{
    const float sg = __fdividef(1.0f, 1.0f + __expf(-g));
    const float silu = g * sg, a = silu * u, da = w * s;
    dswiglu_t r;
    r.dg = da * u * sg * (1.0f + g * (1.0f - sg));
    r.du = da * silu;
    r.wa = w * a;
    r.a = a;
    return r;
}

/* Two floats rounded to bf16, as one word (the first in the low half). */
static __device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi)
{
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(const uint32_t *)&v;
}

#endif /* COMET_POINTWISE_DSWIGLU_CUH */
