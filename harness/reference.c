/*
 * reference.c - the MoE layer computed in float64 on the CPU, for small shapes: the
 * yardstick every GPU path is checked against. Written for clarity, not speed.
 */
#include <math.h>
#include <stdlib.h>

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
