/*
 * reference.c - the MoE layer computed in float64 on the CPU, for small shapes: the
 * yardstick every GPU path is checked against. Written for clarity, not speed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"

double cometi_swiglu(double gate, double up) { return gate / (1.0 + exp(-gate)) * up; }

void cometi_reference_moe(const cometi_ref_problem_t *p, double *y)
{
    const int H = p->hidden, F = p->ffn;
    double *act = malloc(sizeof(double) * (size_t)F);
    if (!act) abort(); /* reference shapes are small; no memory means a broken test host */
    for (int t = 0; t < p->num_tokens; t++) {
        const float *x = p->x + (size_t)t * H;
        double *yt = y + (size_t)t * H;
        for (int h = 0; h < H; h++) yt[h] = 0.0;
        for (int j = 0; j < p->top_k; j++) {
            int e = p->topk_ids[(size_t)t * p->top_k + j];
            double w = p->topk_weights[(size_t)t * p->top_k + j];
            const float *gate = p->gate_up + (size_t)e * 2 * F * H;
            const float *up = gate + (size_t)F * H;
            const float *down = p->down + (size_t)e * H * F;
            for (int f = 0; f < F; f++) {
                double g = 0.0, u = 0.0;
                for (int h = 0; h < H; h++) {
                    g += (double)gate[(size_t)f * H + h] * x[h];
                    u += (double)up[(size_t)f * H + h] * x[h];
                }
                act[f] = cometi_swiglu(g, u);
            }
            for (int h = 0; h < H; h++) {
                double o = 0.0;
                for (int f = 0; f < F; f++) o += (double)down[(size_t)h * F + f] * act[f];
                yt[h] += w * o;
            }
        }
    }
    free(act);
}

void cometi_reference_moe_backward(const cometi_ref_problem_t *p, const float *dy, double *dx, double *dw,
                                   double *dgate_up, double *ddown)
{
    const int H = p->hidden, F = p->ffn, E = p->num_experts, k = p->top_k, M = p->num_tokens;
    if (dx) memset(dx, 0, sizeof(double) * (size_t)M * H);
    if (dgate_up) memset(dgate_up, 0, sizeof(double) * (size_t)E * 2 * F * H);
    if (ddown) memset(ddown, 0, sizeof(double) * (size_t)E * H * F);
    double *g = malloc(sizeof(double) * (size_t)F * 6);
    if (!g) abort(); /* reference shapes are small; no memory means a broken test host */
    double *u = g + F, *a = u + F, *s = a + F, *dg = s + F, *du = dg + F;
    for (int t = 0; t < M; t++) {
        const float *x = p->x + (size_t)t * H, *dyt = dy + (size_t)t * H;
        for (int j = 0; j < k; j++) {
            const int e = p->topk_ids[(size_t)t * k + j];
            const double w = p->topk_weights[(size_t)t * k + j];
            const float *gate = p->gate_up + (size_t)e * 2 * F * H, *up = gate + (size_t)F * H;
            const float *down = p->down + (size_t)e * H * F;
            for (int f = 0; f < F; f++) {
                double gf = 0.0, uf = 0.0;
                for (int h = 0; h < H; h++) {
                    gf += (double)gate[(size_t)f * H + h] * x[h];
                    uf += (double)up[(size_t)f * H + h] * x[h];
                }
                g[f] = gf, u[f] = uf, a[f] = cometi_swiglu(gf, uf);
            }
            /* dw = <dy, o>, o = down a; s = down^T dy. */
            double dwt = 0.0;
            for (int f = 0; f < F; f++) s[f] = 0.0;
            for (int h = 0; h < H; h++) {
                double o = 0.0;
                for (int f = 0; f < F; f++) {
                    o += (double)down[(size_t)h * F + f] * a[f];
                    s[f] += (double)down[(size_t)h * F + f] * dyt[h];
                }
                dwt += dyt[h] * o;
            }
            if (dw) dw[(size_t)t * k + j] = dwt;
            for (int f = 0; f < F; f++) {
                const double sig = 1.0 / (1.0 + exp(-g[f])), silu = g[f] * sig;
                const double da = w * s[f];
                dg[f] = da * u[f] * sig * (1.0 + g[f] * (1.0 - sig)); /* silu'(g) = sig (1 + g (1 - sig)) */
                du[f] = da * silu;
            }
            if (dx)
                for (int h = 0; h < H; h++) {
                    double acc = 0.0;
                    for (int f = 0; f < F; f++)
                        acc += dg[f] * gate[(size_t)f * H + h] + du[f] * up[(size_t)f * H + h];
                    dx[(size_t)t * H + h] += acc;
                }
            if (ddown)
                for (int h = 0; h < H; h++)
                    for (int f = 0; f < F; f++) ddown[((size_t)e * H + h) * F + f] += w * dyt[h] * a[f];
            if (dgate_up)
                for (int f = 0; f < F; f++)
                    for (int h = 0; h < H; h++) {
                        dgate_up[((size_t)e * 2 * F + f) * H + h] += dg[f] * x[h];
                        dgate_up[((size_t)e * 2 * F + F + f) * H + h] += du[f] * x[h];
                    }
        }
    }
    free(g);
}

double cometi_rel_error(const float *out, const double *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(out[i])) return INFINITY;
        double d = (double)out[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
    return sqrt(num / den);
}
