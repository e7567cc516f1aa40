/*
 * dswiglu.cuh - SwiGLU's backward on one element and on eight columns of a row, and the
 * order <s, a> is summed in: the one definition swiglu.cu's bf16 backward and
 * swiglu_fp8.cu's FP8 kernels share, so their values agree bit for bit.
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

/* <s, a> of a row is summed in one order by every SwiGLU backward (the bf16 kernel, the FP8
 * kernels, both paths), so d topk_weights has the same bits whichever runs: each chunk of 8
 * columns from 0, its column pairs in turn (dot_pair); a 128-column block's 16 chunks by a
 * xor tree across the 16 lanes that hold them (dot_block: every lane gets the block's sum);
 * the blocks from 0, first to last. Every rounding is explicit, so no kernel's compilation
 * can contract it differently. Chunks past ffn add 0. */
static __device__ __forceinline__ float dot_pair(float acc, float s0, float a0, float s1, float a1)
{
    return __fadd_rn(acc, __fadd_rn(__fmul_rn(s0, a0), __fmul_rn(s1, a1)));
}

/* The 128-column block's sum of its 16 chunks: lanes 16 h .. 16 h + 15 of the warp hold one
 * block (each its chunk's `part`), all 32 lanes take part. */
static __device__ __forceinline__ float dot_block(float part)
{
#pragma unroll
    for (int off = 8; off > 0; off /= 2) part = __fadd_rn(part, __shfl_xor_sync(0xffffffffu, part, off));
    return part;
}

/* A row's <s, a> from its 128-column blocks' sums (block b's at parts[b x stride]), the
 * blocks from first to last. */
static __device__ __forceinline__ float dot_blocks_sum(const float *parts, int blocks, long long stride)
{
    float sum = 0.0f;
    for (int b = 0; b < blocks; b++) sum = __fadd_rn(sum, parts[b * stride]);
    return sum;
}

/* Eight columns of one row (16-byte loads of g, u and s) -> dg, du and w a, eight bf16 each
 * (the first column in the low half of .x), and their chunk's part of <s, a> (dot_pair's
 * order). */
static __device__ __forceinline__ void dswiglu8(uint4 g4, uint4 u4, uint4 s4, float w, uint4 *dg4, uint4 *du4,
                                                uint4 *wa4, float *dot)
{
    const __nv_bfloat162 *g = (const __nv_bfloat162 *)&g4, *u = (const __nv_bfloat162 *)&u4,
                         *s = (const __nv_bfloat162 *)&s4;
    __nv_bfloat162 *dg = (__nv_bfloat162 *)dg4, *du = (__nv_bfloat162 *)du4, *wa = (__nv_bfloat162 *)wa4;
    float part = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const float2 gf = __bfloat1622float2(g[q]), uf = __bfloat1622float2(u[q]), sf = __bfloat1622float2(s[q]);
        const dswiglu_t x = dswiglu(gf.x, uf.x, sf.x, w), y = dswiglu(gf.y, uf.y, sf.y, w);
        part = dot_pair(part, sf.x, x.a, sf.y, y.a);
        dg[q] = __floats2bfloat162_rn(x.dg, y.dg);
        du[q] = __floats2bfloat162_rn(x.du, y.du);
        wa[q] = __floats2bfloat162_rn(x.wa, y.wa);
    }
    *dot = part;
}

#endif /* COMET_POINTWISE_DSWIGLU_CUH */
