/*
 * reference.h - the MoE layer in float64 on the CPU, for small shapes: the yardstick every
 * GPU path is checked against, and the error measure the checks use.
 */
#ifndef COMET_HARNESS_REFERENCE_H
#define COMET_HARNESS_REFERENCE_H

#include "comm/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One rank's tokens and all experts' weights, as floats (already rounded through bf16
 * when they stand for bf16 tensors). Weight layouts as in comet.h, for all E experts. */
typedef struct cometi_ref_problem {
    int hidden, ffn, num_experts, top_k, num_tokens;
    const float *x;            /* [M][H] */
    const int32_t *topk_ids;   /* [M][k] */
    const float *topk_weights; /* [M][k] */
    const float *gate_up;      /* [E][2F][H], gate rows first */
    const float *down;         /* [E][H][F] */
} cometi_ref_problem_t;

/* y[t] = sum_j w[t][j] * down_e(silu(gate_e x_t) * (up_e x_t)), in float64. */
void cometi_reference_moe(const cometi_ref_problem_t *p, double *y);

/* The layer's gradients in float64, given dy [M][H] (the loss's gradient at y): dx [M][H],
 * d topk_weights [M][k], and every expert's weight gradients dgate_up [E][2F][H] (gate rows
 * first) and ddown [E][H][F], in the weights' layouts. Any output may be NULL. For token t,
 * choice j (expert e, weight w), with g = gate_e x_t, u = up_e x_t, a = silu(g) u,
 * o = down_e a: dw_tj = <dy_t, o>; s = down_e^T dy_t; da = w s; dg = da u silu'(g),
 * du = da silu(g); dx_t += gate_e^T dg + up_e^T du; ddown_e += w dy_t a^T; dgate_e += dg
 * x_t^T, dup_e += du x_t^T. */
void cometi_reference_moe_backward(const cometi_ref_problem_t *p, const float *dy, double *dx, double *dw,
                                   double *dgate_up, double *ddown);

/* silu(g) * u, the SwiGLU activation, in float64. */
double cometi_swiglu(double gate, double up);

/* ||out - ref|| / ||ref|| over n values; NaN or Inf anywhere in `out` gives +inf. */
double cometi_rel_error(const float *out, const double *ref, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* COMET_HARNESS_REFERENCE_H */
