/*
 * test_swiglu_fp8.c - SwiGLU's backward in FP8 training (swiglu_fp8.cu) against the chain
 * it replaces: the bf16 backward (swiglu.cu's kernel: dh and w a in bf16) followed by the
 * casts (quantize.cu: (w a)^T and dh^T along the tokens, dh's rows 1 x 128). On fresh
 * random rows in ragged segments (an empty one, one of a single row, one cut by the
 * buffers' rows, a block in none), with a NaN planted, both scale modes, at three ffn
 * (one pass of a row, passes with a half-warp idle, s's row past 48 KB): every byte and
 * scale of the three FP8 operands and every <s, a> equal bit for bit, nothing written
 * past the segments, and s's bytes past the segments' rows left alone. With [g u] kept in
 * E4M3 (1 x 128 scales) the same, the chain given [g u] dequantized and rounded to bf16.
 * The one-kernel form (dh's rows left in [g u]'s bytes) the same, its rows gathered from
 * there, rows in no segment left alone. Then all timed at mixtral-8x7b's size, for the
 * record. On the CPU: the launchers' refusals.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/fp8.h"
#include "pointwise/pointwise.h"
#include "testutil.h"
#include "gpu_util.h"

#define POISON 0xa5
#define F 384 /* the refusals' ffn */
#define R 768 /* the buffers' rows (ldq: R) */

int test_swiglu_fp8_refusals(void)
{
    const cometi_segment_t *segs = (const cometi_segment_t *)(uintptr_t)256; /* never read */
    char *p = (char *)(uintptr_t)4096;                                       /* any 16-byte aligned address */
    float *f = (float *)(uintptr_t)8192;
    /* Nothing to do: success, nothing launched. */
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, F, segs, 1, 1, 0, f, f, f, R, p, f, p, f, R, 0, 0), cudaSuccess);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, F, segs, 0, 1, 10, f, f, f, R, p, f, p, f, R, 0, 0), cudaSuccess);
    /* ffn not a multiple of 128, misaligned buffers, ldq short or not a multiple of 16, a
     * missing pointer. */
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, 320, segs, 1, 1, 10, f, f, f, R, p, f, p, f, R, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p + 8, NULL, 0, p, F, segs, 1, 1, 10, f, f, f, R, p, f, p, f, R, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, F, segs, 1, 1, 10, f, f, f, R, p + 8, f, p, f, R, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, F, segs, 1, 1, 200, f, f, f, R, p, f, p, f, 128, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, F, segs, 1, 1, 10, f, f, f, R, p, f, p, f, R + 8, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, F, segs, 1, 1, 10, f, NULL, f, R, p, f, p, f, R, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, NULL, 0, p, F, segs, 1, 1, 200, f, f, f, 199, p, f, p, f, R, 0, 0),
             cudaErrorInvalidValue); /* dh's scale blocks would overlap */
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3(p, f, 199, p, F, segs, 1, 1, 200, f, f, f, R, p, f, p, f, R, 0, 0),
             cudaErrorInvalidValue); /* E4M3 [g u]: its scale blocks would overlap */
    /* The one kernel: the same checks, and its workspace for the dot's parts. */
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3_in_place(p, NULL, 0, p, F, segs, 1, 1, 0, f, f, NULL, f, R, p, f, p, f, R,
                                                         0, 0),
             cudaSuccess);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3_in_place(p, NULL, 0, p, F, segs, 1, 1, 10, f, f, NULL, f, R, p, f, p, f,
                                                         R, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3_in_place(p, NULL, 0, p + 8, F, segs, 1, 1, 10, f, f, f, f, R, p, f, p, f,
                                                         R, 0, 0),
             cudaErrorInvalidValue);
    CHECK_EQ(cometi_launch_swiglu_backward_e4m3_in_place(p, NULL, 0, p, 320, segs, 1, 1, 10, f, f, f, f, R, p, f, p, f,
                                                         R, 0, 0),
             cudaErrorInvalidValue);
    return 0;
}

/* Host copies of a device buffer. */
static void *fetch(const void *d, size_t bytes)
{
    void *h = malloc(bytes + 16);
    if (h && cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        free(h);
        return NULL;
    }
    return h;
}

/* The speed of each, for the record (not checked against anything): mixtral-8x7b's rows on
 * one GPU (8 experts x 2048 rows, ffn 14336), median of 10 calls each, in turns; the
 * bytes each must move (the chain: [g u] and s read, dh and w a written and read again,
 * the FP8 outputs written; the two kernels: [g u] twice and s twice read, the outputs
 * written; the one kernel: each read once), and each reading [g u] in E4M3. */
static int time_both(void)
{
    enum { ROWS = 16384, FF = 14336, RUNS = 10 };
    const size_t nh = (size_t)ROWS * 2 * FF, ns = (size_t)ROWS * FF;
    void *h, *s, *wa_t, *dh_t;
    float *w, *dw, *sc;
    CUDA_OK(cudaMalloc(&h, nh * 2));
    CUDA_OK(cudaMalloc(&s, ns * 2));
    CUDA_OK(cudaMalloc(&wa_t, ns));
    CUDA_OK(cudaMalloc(&dh_t, nh));
    CUDA_OK(cudaMalloc((void **)&w, sizeof(float) * ROWS));
    CUDA_OK(cudaMalloc((void **)&dw, sizeof(float) * ROWS));
    CUDA_OK(cudaMalloc((void **)&sc, sizeof(float) * (ROWS / 128) * 2 * FF * 4));
    CUDA_OK(cometi_fill_hash_bf16(h, nh, 11, 0, 1.0f, 0));
    CUDA_OK(cometi_fill_hash_bf16(s, ns, 12, 0, 1.0f, 0));
    CUDA_OK(cudaMemset(w, 0, sizeof(float) * ROWS));
    cometi_segment_t segs_host[8], *segs;
    for (int g = 0; g < 8; g++) segs_host[g] = (cometi_segment_t){g * (ROWS / 8), ROWS / 8};
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    float *sc_wa = sc, *sc_dht = sc + (size_t)(ROWS / 128) * FF, *sc_dh = sc_dht + (size_t)(ROWS / 128) * 2 * FF,
          *sc_hq = sc_dh + (size_t)(ROWS / 128) * 2 * FF;
    void *hq, *h_ip, *hq_ip; /* the one kernel's [g u], bf16 and E4M3, which it overwrites */
    float *parts;
    CUDA_OK(cudaMalloc(&hq, nh));
    CUDA_OK(cudaMalloc(&h_ip, nh * 2));
    CUDA_OK(cudaMalloc(&hq_ip, nh));
    CUDA_OK(cudaMalloc((void **)&parts, sizeof(float) * ROWS * (FF / 128)));
    CUDA_OK(cometi_quantize_rows_e4m3(h, ROWS, 2 * FF, 2 * FF, hq, 2 * FF, sc_hq, 1, ROWS, 0, 0));
    CUDA_OK(cudaMemcpy(h_ip, h, nh * 2, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(hq_ip, hq, nh, cudaMemcpyDeviceToDevice));
    cudaEvent_t ev[6];
    for (int i = 0; i < 6; i++) CUDA_OK(cudaEventCreate(&ev[i]));
    float ms[5][RUNS];
    for (int i = -2; i < RUNS; i++) { /* w = 0: s and dh stay finite call after call */
        CUDA_OK(cudaEventRecord(ev[0], 0));
        CUDA_OK(cometi_launch_swiglu_backward(h, s, h, FF, segs, 8, ROWS / 8, ROWS, w, dw, 0));
        CUDA_OK(cometi_quantize_segments_t_e4m3(s, FF, FF, ROWS, segs, 8, wa_t, ROWS, sc_wa, 1, FF, 0, 0));
        CUDA_OK(cometi_quantize_segments_t_e4m3(h, 2 * FF, 2 * FF, ROWS, segs, 8, dh_t, ROWS, sc_dht, 1, 2 * FF, 0, 0));
        CUDA_OK(cometi_quantize_rows_e4m3(h, ROWS, 2 * FF, 2 * FF, s, 2 * FF, sc_dh, 1, ROWS, 0, 0));
        CUDA_OK(cudaEventRecord(ev[1], 0));
        CUDA_OK(cometi_launch_swiglu_backward_e4m3(h, NULL, 0, s, FF, segs, 8, ROWS / 8, ROWS, w, dw, sc_dh, ROWS, wa_t,
                                                   sc_wa, dh_t, sc_dht, ROWS, 0, 0));
        CUDA_OK(cudaEventRecord(ev[2], 0));
        CUDA_OK(cometi_launch_swiglu_backward_e4m3(hq, sc_hq, ROWS, s, FF, segs, 8, ROWS / 8, ROWS, w, dw, sc_dh, ROWS,
                                                   wa_t, sc_wa, dh_t, sc_dht, ROWS, 0, 0));
        CUDA_OK(cudaEventRecord(ev[3], 0));
        CUDA_OK(cometi_launch_swiglu_backward_e4m3_in_place(h_ip, NULL, 0, s, FF, segs, 8, ROWS / 8, ROWS, w, dw, parts,
                                                            sc_dh, ROWS, wa_t, sc_wa, dh_t, sc_dht, ROWS, 0, 0));
        CUDA_OK(cudaEventRecord(ev[4], 0));
        CUDA_OK(cometi_launch_swiglu_backward_e4m3_in_place(hq_ip, sc_hq, ROWS, s, FF, segs, 8, ROWS / 8, ROWS, w, dw,
                                                            parts, sc_dh, ROWS, wa_t, sc_wa, dh_t, sc_dht, ROWS, 0, 0));
        CUDA_OK(cudaEventRecord(ev[5], 0));
        CUDA_OK(cudaEventSynchronize(ev[5]));
        if (i >= 0)
            for (int k = 0; k < 5; k++) CUDA_OK(cudaEventElapsedTime(&ms[k][i], ev[k], ev[k + 1]));
    }
    for (int k = 0; k < 5; k++) qsort(ms[k], RUNS, sizeof(float), cmp_float);
    /* Bytes a row moves, in units of ffn: the chain 12 (SwiGLU's backward: [g u] 4 and s 2 in,
     * dh 4 and w a 2 out) + 3 + 6 + 6 (each cast: its bf16 in, its E4M3 out); the FP8
     * backward 9 (its first kernel: [g u] and s in, (w a)^T and dh^T out) + 8 (its second:
     * [g u] and s in, dh's E4M3 rows out); [g u] in E4M3 reads 2 where bf16 reads 4, in each. */
    const double chain = (double)ns * 27, fused = (double)ns * 17, fused8 = (double)ns * 13;
    printf("mixtral-8x7b's rows (16384 x ffn 14336): the bf16 backward and its casts %.3f ms (%.2f TB/s), the FP8 "
           "backward %.3f ms (%.2f TB/s), %.2fx; with [g u] in E4M3 %.3f ms (%.2f TB/s), %.2fx\n", ms[0][RUNS / 2],
           chain / ms[0][RUNS / 2] / 1e9, ms[1][RUNS / 2], fused / ms[1][RUNS / 2] / 1e9,
           ms[0][RUNS / 2] / ms[1][RUNS / 2], ms[2][RUNS / 2], fused8 / ms[2][RUNS / 2] / 1e9,
           ms[0][RUNS / 2] / ms[2][RUNS / 2]);
    /* The one kernel: [g u] and s read once, (w a)^T, dh^T and dh's rows written: 11 (bf16
     * [g u]) or 9 (E4M3). Its [g u] becomes dh call after call: the values change, not the
     * work. */
    const double one = (double)ns * 11, one8 = (double)ns * 9;
    printf("in one kernel (dh's rows in [g u]'s bytes) %.3f ms (%.2f TB/s), %.2fx; with [g u] in E4M3 %.3f ms "
           "(%.2f TB/s), %.2fx\n", ms[3][RUNS / 2], one / ms[3][RUNS / 2] / 1e9, ms[0][RUNS / 2] / ms[3][RUNS / 2],
           ms[4][RUNS / 2], one8 / ms[4][RUNS / 2] / 1e9, ms[0][RUNS / 2] / ms[4][RUNS / 2]);
    for (int i = 0; i < 6; i++) cudaEventDestroy(ev[i]);
    cudaFree(hq), cudaFree(h_ip), cudaFree(hq_ip), cudaFree(parts);
    cudaFree(h), cudaFree(s), cudaFree(wa_t), cudaFree(dh_t), cudaFree(w), cudaFree(dw), cudaFree(sc), cudaFree(segs);
    return 0;
}

/* [g u] (bf16 [R][2 ffn]) in E4M3 with 1 x 128 scales (q [R][2 ffn], sc [2 ffn / 128][R]),
 * and h replaced by those values dequantized, each rounded to bf16 (what the FP8
 * backward reads them as). */
static void gate_up_to_e4m3(uint16_t *h, int ffn, uint8_t *q, float *sc)
{
    for (int r = 0; r < R; r++)
        for (int b = 0; b < 2 * ffn / 128; b++) {
            uint16_t *x = h + (size_t)r * 2 * ffn + b * 128;
            uint8_t *qx = q + (size_t)r * 2 * ffn + b * 128;
            float amax = 0.0f;
            for (int c = 0; c < 128; c++) amax = cometi_fp8_max(amax, cometi_fp8_abs(cometi_bf16_to_float(x[c])));
            const float scale = cometi_fp8_scale(amax, 0), inv = cometi_fp8_inverse(scale);
            sc[(size_t)b * R + r] = scale;
            for (int c = 0; c < 128; c++) {
                qx[c] = cometi_fp8_quantize(cometi_bf16_to_float(x[c]), inv);
                x[c] = cometi_float_to_bf16(cometi_fp8_mul(cometi_e4m3_decode(qx[c]), scale));
            }
        }
}

/* One ffn: both ways on the same random rows, compared ([g u] in bf16, or gu8: in E4M3). */
static int equal_case(int ffn, int gu8, uint64_t *rng)
{
    /* Starts at multiples of 128, as the route lays segments out; rows 384 .. 511 are in
     * none; the last is cut by rows. */
    const cometi_segment_t segs[5] = {{0, 200}, {256, 0}, {256, 1}, {512, 128}, {640, 100}};
    const int groups = 5, max_rows = 200;
    const int64_t rows = 700; /* the last segment's rows 60 .. 99 are past the buffers' */
    int in_seg[R] = {0};      /* 1: a row of a segment, below rows */
    for (int g = 0; g < groups; g++)
        for (int64_t r = segs[g].start; r < segs[g].start + segs[g].rows && r < rows; r++) in_seg[r] = 1;
    const size_t nh = (size_t)R * 2 * ffn, ns = (size_t)R * ffn;
    uint16_t *h = malloc(nh * 2), *s = malloc(ns * 2);
    float *w = malloc(sizeof(float) * R);
    for (size_t i = 0; i < nh; i++) h[i] = cometi_float_to_bf16((float)(4 * cometi_rand_unit(rng) - 2));
    for (size_t i = 0; i < ns; i++) s[i] = cometi_float_to_bf16((float)ldexp(2 * cometi_rand_unit(rng) - 1,
                                                                            (int)(cometi_rand_next(rng) % 9) - 4));
    for (int r = 0; r < R; r++) {
        w[r] = (float)(0.05 + cometi_rand_unit(rng));
        if (!in_seg[r]) /* never read */
            for (int c = 0; c < 2 * ffn; c++) h[(size_t)r * 2 * ffn + c] = 0x7fc0;
    }
    s[(size_t)(512 + 77) * ffn + 130] = 0x7fc0; /* a NaN in segment 3: its blocks and <s, a> alike */
    uint8_t *hq = gu8 ? malloc(nh) : NULL;
    float *hsc = gu8 ? malloc(sizeof(float) * R * (2 * ffn / 128)) : NULL, *dhsc = NULL;
    void *dhq = NULL;
    if (gu8) {
        gate_up_to_e4m3(h, ffn, hq, hsc);
        CUDA_OK(cudaMalloc(&dhq, nh));
        CUDA_OK(cudaMalloc((void **)&dhsc, sizeof(float) * R * (2 * ffn / 128)));
        CUDA_OK(cudaMemcpy(dhq, hq, nh, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dhsc, hsc, sizeof(float) * R * (2 * ffn / 128), cudaMemcpyHostToDevice));
    }
    cometi_segment_t *dsegs;
    /* Three ways: the chain [0], the two kernels [1] (dh's rows over s), the one kernel [2]
     * (dh's rows in [g u]'s bytes: dh_ip, a copy of [g u] for it, s_ip of s). */
    void *dh, *ds, *dh_old, *ds_old, *dh_ip, *ds_ip, *wa_t[3], *dh_t[3];
    float *dw, *dw_rows[3], *dh_sc[3], *wa_sc[3], *dh_tsc[3], *dot_parts;
    const size_t ip_bytes = gu8 ? nh : nh * 2; /* [g u]'s bytes, E4M3 or bf16 */
    const size_t n_wa_t = (size_t)ffn * R, n_dh_t = (size_t)2 * ffn * R, nb = R / 128;
    CUDA_OK(cudaMalloc((void **)&dsegs, sizeof(segs)));
    CUDA_OK(cudaMalloc(&dh, nh * 2));
    CUDA_OK(cudaMalloc(&dh_old, nh * 2));
    CUDA_OK(cudaMalloc(&ds, ns * 2));
    CUDA_OK(cudaMalloc(&ds_old, ns * 2));
    CUDA_OK(cudaMalloc(&dh_ip, ip_bytes));
    CUDA_OK(cudaMalloc(&ds_ip, ns * 2));
    CUDA_OK(cudaMalloc((void **)&dot_parts, sizeof(float) * R * (ffn / 128)));
    CUDA_OK(cudaMalloc((void **)&dw, sizeof(float) * R));
    for (int i = 0; i < 3; i++) {
        CUDA_OK(cudaMalloc(&wa_t[i], n_wa_t));
        CUDA_OK(cudaMalloc(&dh_t[i], n_dh_t));
        CUDA_OK(cudaMalloc((void **)&dw_rows[i], sizeof(float) * R));
        CUDA_OK(cudaMalloc((void **)&dh_sc[i], sizeof(float) * R * (2 * ffn / 128)));
        CUDA_OK(cudaMalloc((void **)&wa_sc[i], sizeof(float) * nb * ffn));
        CUDA_OK(cudaMalloc((void **)&dh_tsc[i], sizeof(float) * nb * 2 * ffn));
    }
    CUDA_OK(cudaMemcpy(dsegs, segs, sizeof(segs), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dw, w, sizeof(float) * R, cudaMemcpyHostToDevice));
    for (int pow2 = 0; pow2 < 2; pow2++) {
        CUDA_OK(cudaMemcpy(dh, h, nh * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dh_old, h, nh * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(ds, s, ns * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(ds_old, s, ns * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dh_ip, gu8 ? (const void *)hq : (const void *)h, ip_bytes, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(ds_ip, s, ns * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(dot_parts, POISON, sizeof(float) * R * (ffn / 128)));
        for (int i = 0; i < 3; i++) {
            CUDA_OK(cudaMemset(wa_t[i], POISON, n_wa_t));
            CUDA_OK(cudaMemset(dh_t[i], POISON, n_dh_t));
            CUDA_OK(cudaMemset(dw_rows[i], POISON, sizeof(float) * R));
            CUDA_OK(cudaMemset(dh_sc[i], POISON, sizeof(float) * R * (2 * ffn / 128)));
            CUDA_OK(cudaMemset(wa_sc[i], POISON, sizeof(float) * nb * ffn));
            CUDA_OK(cudaMemset(dh_tsc[i], POISON, sizeof(float) * nb * 2 * ffn));
        }
        /* The chain it replaces: dh and w a in bf16 (in place), then the three casts. */
        CUDA_OK(cometi_launch_swiglu_backward(dh_old, ds_old, dh_old, ffn, dsegs, groups, max_rows, rows, dw, dw_rows[0],
                                              0));
        CUDA_OK(cometi_quantize_segments_t_e4m3(ds_old, ffn, ffn, rows, dsegs, groups, wa_t[0], R, wa_sc[0], 1, ffn, pow2,
                                                0));
        CUDA_OK(cometi_quantize_segments_t_e4m3(dh_old, 2 * ffn, 2 * ffn, rows, dsegs, groups, dh_t[0], R, dh_tsc[0], 1,
                                                2 * ffn, pow2, 0));
        CUDA_OK(cometi_quantize_rows_e4m3(dh_old, rows, 2 * ffn, 2 * ffn, ds_old, 2 * ffn, dh_sc[0], 1, R, pow2, 0));
        /* The FP8 backward: dh's rows land over s (ds). */
        CUDA_OK(cometi_launch_swiglu_backward_e4m3(gu8 ? dhq : dh, dhsc, R, ds, ffn, dsegs, groups, max_rows, rows, dw,
                                                   dw_rows[1], dh_sc[1], R, wa_t[1], wa_sc[1], dh_t[1], dh_tsc[1], R,
                                                   pow2, 0));
        /* The one kernel: dh's rows in [g u]'s own bytes. */
        CUDA_OK(cometi_launch_swiglu_backward_e4m3_in_place(dh_ip, dhsc, R, ds_ip, ffn, dsegs, groups, max_rows, rows,
                                                            dw, dw_rows[2], dot_parts, dh_sc[2], R, wa_t[2], wa_sc[2],
                                                            dh_t[2], dh_tsc[2], R, pow2, 0));
        CUDA_OK(cudaDeviceSynchronize());
        uint8_t *q[3] = {fetch(ds_old, ns * 2), fetch(ds, ns * 2), malloc(nh)},
                *wt[3] = {fetch(wa_t[0], n_wa_t), fetch(wa_t[1], n_wa_t), fetch(wa_t[2], n_wa_t)},
                *ht[3] = {fetch(dh_t[0], n_dh_t), fetch(dh_t[1], n_dh_t), fetch(dh_t[2], n_dh_t)},
                *ip = fetch(dh_ip, ip_bytes), *s_ip = fetch(ds_ip, ns * 2);
        float *dws[3], *hs[3], *ws[3], *hts[3];
        for (int i = 0; i < 3; i++) {
            dws[i] = fetch(dw_rows[i], 4 * R), hs[i] = fetch(dh_sc[i], 4 * R * (2 * ffn / 128));
            ws[i] = fetch(wa_sc[i], 4 * nb * ffn), hts[i] = fetch(dh_tsc[i], 4 * nb * 2 * ffn);
            CHECK(q[i] && wt[i] && ht[i] && dws[i] && hs[i] && ws[i] && hts[i]);
        }
        CHECK(ip && s_ip);
        CHECK_EQ(memcmp(s_ip, s, ns * 2), 0); /* the one kernel leaves s as it is */
        /* The one kernel's dh rows gathered from [g u]'s bytes: block b of row r at r x 2 ffn +
         * 128 b (E4M3 [g u]) or r x 4 ffn + 256 b (bf16). */
        const size_t ip_row = (size_t)(gu8 ? 2 : 4) * ffn, ip_block = gu8 ? 128 : 256;
        for (int r = 0; r < R; r++)
            for (int b = 0; b < 2 * ffn / 128; b++)
                memcpy(q[2] + (size_t)r * 2 * ffn + b * 128, ip + r * ip_row + b * ip_block, 128);
        const uint8_t *ip_in = gu8 ? hq : (const uint8_t *)h; /* [g u] as given */
        int bad = 0, nan_rows = 0;
        for (int r = 0; r < R && bad < 8; r++) {
            if (!in_seg[r]) { /* s and [g u] left as they were; nothing else of the row written */
                if (memcmp(q[1] + (size_t)r * 2 * ffn, s + (size_t)r * ffn, 2 * ffn) ||
                    memcmp(ip + r * ip_row, ip_in + r * ip_row, ip_row) || cometi_f32_bits(dws[1][r]) != 0xa5a5a5a5u ||
                    cometi_f32_bits(dws[2][r]) != 0xa5a5a5a5u)
                    printf("row %d, in no segment: written\n", r), bad++;
                continue;
            }
            for (int w = 1; w < 3; w++) {
                const char *way = w == 1 ? "two kernels" : "one kernel";
                if (memcmp(q[0] + (size_t)r * 2 * ffn, q[w] + (size_t)r * 2 * ffn, 2 * ffn))
                    printf("pow2 %d, %s: dh's E4M3 row %d differs\n", pow2, way, r), bad++;
                for (int b = 0; b < 2 * ffn / 128; b++)
                    if (!same_float(hs[0][r + b * R], hs[w][r + b * R]))
                        printf("pow2 %d, %s: dh row %d block %d scale %g, want %g\n", pow2, way, r, b,
                               hs[w][r + b * R], hs[0][r + b * R]), bad++;
                if (!same_float(dws[0][r], dws[w][r]))
                    printf("pow2 %d, %s: <s, a> of row %d = %a, want %a\n", pow2, way, r, dws[w][r], dws[0][r]), bad++;
            }
            nan_rows += isnan(dws[1][r]);
        }
        /* The transposed operands: blocks in a segment equal (rows past the end are zeros in
         * both); blocks in none untouched. */
        for (int w = 1; w < 3; w++)
        for (int rb = 0; rb < (int)nb && bad < 8; rb++) {
            int in = 0;
            for (int g = 0; g < groups; g++) in |= rb * 128 >= segs[g].start && rb * 128 < segs[g].start + segs[g].rows;
            for (int c = 0; c < 2 * ffn && bad < 8; c++) {
                const uint8_t *a = ht[0] + (size_t)c * R + rb * 128, *b = ht[w] + (size_t)c * R + rb * 128;
                const float sa = hts[0][c + rb * 2 * ffn], sb = hts[w][c + rb * 2 * ffn];
                int poisoned = 1;
                for (int k = 0; k < 128; k++) poisoned &= b[k] == POISON;
                if (in ? memcmp(a, b, 128) || !same_float(sa, sb) : !poisoned || cometi_f32_bits(sb) != 0xa5a5a5a5u)
                    printf("pow2 %d: dh^T column %d, rows %d..: %s\n", pow2, c, rb * 128,
                           in ? "differs" : "written in no segment"), bad++;
                if (c >= ffn) continue;
                a = wt[0] + (size_t)c * R + rb * 128, b = wt[w] + (size_t)c * R + rb * 128;
                poisoned = 1;
                for (int k = 0; k < 128; k++) poisoned &= b[k] == POISON;
                if (in ? memcmp(a, b, 128) || !same_float(ws[0][c + rb * ffn], ws[w][c + rb * ffn])
                       : !poisoned || cometi_f32_bits(ws[w][c + rb * ffn]) != 0xa5a5a5a5u)
                    printf("pow2 %d: (w a)^T column %d, rows %d..: %s\n", pow2, c, rb * 128,
                           in ? "differs" : "written in no segment"), bad++;
            }
        }
        for (int i = 0; i < 3; i++) free(q[i]), free(wt[i]), free(ht[i]), free(dws[i]), free(hs[i]), free(ws[i]), free(hts[i]);
        free(ip), free(s_ip);
        CHECK_EQ(bad, 0);
        CHECK_EQ(nan_rows, 1); /* the planted NaN's row */
    }
    printf("ffn %d, [g u] in %s: SwiGLU's FP8 backward, in two kernels and in one (dh's rows in [g u]'s bytes), "
           "equals the bf16 backward and its casts bit for bit: dh's rows, (w a)^T, dh^T, their scales and <s, a>, "
           "over %d segments, both scale modes\n", ffn, gu8 ? "E4M3" : "bf16", groups);
    cudaFree(dhq), cudaFree(dhsc), free(hq), free(hsc);
    cudaFree(dsegs), cudaFree(dh), cudaFree(dh_old), cudaFree(ds), cudaFree(ds_old), cudaFree(dw);
    cudaFree(dh_ip), cudaFree(ds_ip), cudaFree(dot_parts);
    for (int i = 0; i < 3; i++)
        cudaFree(wa_t[i]), cudaFree(dh_t[i]), cudaFree(dw_rows[i]), cudaFree(dh_sc[i]), cudaFree(wa_sc[i]),
            cudaFree(dh_tsc[i]);
    free(h), free(s), free(w);
    return 0;
}

static int swiglu_fp8_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg ^ 0x5a1f9ull;
    CUDA_OK(cudaSetDevice(ctx->local_rank));
    /* One pass of a row (48 columns of 8 a thread: 64 threads), several with a half-warp
     * left (272), and s's row past 48 KB of shared memory (24576). */
    const int ffns[3] = {384, 2176, 24576};
    for (int i = 0; i < 3; i++)
        for (int gu8 = 0; gu8 < 2; gu8++)
            if (equal_case(ffns[i], gu8, &rng)) return 1;
    return time_both();
}

int test_gpu_swiglu_backward_fp8(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, swiglu_fp8_rank, &seed, 60);
}
