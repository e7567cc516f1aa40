/*
 * train_util.c - the training tests' shared step and checks (train_util.h).
 */
#include <math.h>
#include <stdio.h>

#include "comm/plan.h"
#include "../harness/reference.h"
#include "train_util.h"

comet_status_t train_step(fixture_t *fx, comet_moe_saved_t saved, comet_impl_t impl, int m, void *d_dy, void *d_dx,
                          float *d_dw, void *g_gu, void *g_dn)
{
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = m;
    a.x = fx->d_x, a.topk_ids = fx->d_ids, a.topk_weights = fx->d_w, a.y = fx->d_y;
    a.weights.gate_up = fx->d_gate_up, a.weights.down = fx->d_down;
    a.impl = impl;
    comet_status_t st = comet_moe_forward_train(fx->moe, &a, saved, 0);
    if (st != COMET_SUCCESS) return st;
    comet_moe_backward_args_t b = COMET_MOE_BACKWARD_ARGS_INIT;
    b.saved = saved, b.dy = d_dy, b.weights = a.weights, b.dx = d_dx, b.d_topk_weights = d_dw;
    b.grads.gate_up = g_gu, b.grads.down = g_dn;
    b.impl = impl;
    return comet_moe_backward(fx->moe, &b, 0);
}

int compare(const char *what, const float *got, const double *ref, size_t n, size_t group, int rank)
{
    const double rel = cometi_rel_error(got, ref, n);
    if (!(rel <= NORM_TOL)) {
        printf("rank %d %s: relative error %.3g over %zu values (limit %g)\n", rank, what, rel, n, NORM_TOL);
        return 1;
    }
    for (size_t g0 = 0; g0 < n; g0 += group) {
        const size_t g1 = g0 + group < n ? g0 + group : n;
        double ss = 0;
        for (size_t i = g0; i < g1; i++) ss += ref[i] * ref[i];
        const double rms = sqrt(ss / (double)(g1 - g0));
        for (size_t i = g0; i < g1; i++) {
            const double limit = SELF_TOL * fabs(ref[i]) + ELEM_TOL * rms + 1e-30;
            if (!(fabs(got[i] - ref[i]) <= limit)) {
                size_t over = 0;
                for (size_t q = g0; q < g1; q++)
                    if (!(fabs(got[q] - ref[q]) <= SELF_TOL * fabs(ref[q]) + ELEM_TOL * rms + 1e-30) && over++ < 12)
                        printf("    [%zu] = %.6g, float64 %.6g\n", q, got[q], ref[q]);
                printf("rank %d %s[%zu] = %.6g, float64 %.6g (limit %.3g: %g of itself and %g of its group's RMS "
                       "%.3g); %zu of the group's %zu elements over\n", rank, what, i, got[i], ref[i], limit,
                       SELF_TOL, ELEM_TOL, rms, over, g1 - g0);
                return 1;
            }
        }
    }
    printf("rank %d %-40s relative error %.2e\n", rank, what, rel);
    return 0;
}

int compare_grads(const char *who, const uint16_t *got, const uint16_t *want, size_t n_gu, size_t n, size_t *equal,
                  double *worst)
{
    for (int part = 0; part < 2; part++) { /* gate_up, down: each against its own RMS */
        const size_t lo = part ? n_gu : 0, hi = part ? n : n_gu;
        double ss = 0;
        for (size_t i = lo; i < hi; i++) {
            const double b = cometi_bf16_to_float(want[i]);
            ss += b * b;
        }
        const double rms = sqrt(ss / (double)(hi - lo)) + 1e-30;
        for (size_t i = lo; i < hi; i++) {
            const double a = cometi_bf16_to_float(got[i]), b = cometi_bf16_to_float(want[i]);
            *equal += got[i] == want[i];
            const double d = a != a ? INFINITY : fabs(a - b) / rms;
            if (d > *worst) *worst = d;
            if (!(fabs(a - b) <= SELF_TOL * fabs(b) + ELEM_TOL * rms)) {
                printf("%s: %s gradient [%zu] = %.6g, against %.6g (RMS %.3g)\n", who, part ? "down" : "gate_up",
                       i - lo, a, b, rms);
                return 1;
            }
        }
    }
    return 0;
}
