/*
 * train_util.h - what the training tests share (test_backward.c, test_training.c): the
 * tolerances, a training step through comet.h, and the element-wise checks.
 */
#ifndef COMET_TESTS_TRAIN_UTIL_H
#define COMET_TESTS_TRAIN_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "comet.h"
#include "gpu_util.h"

/*
 * The training tests' tolerances, from bf16: every rounding to bf16 errs by at most 2^-9 (0.2%) of the value.
 * The backward's dx passes through five roundings after the forward's two (g and u, the
 * activation): s = dy W2, dh, the dx rows, the dx rows home, dx; d topk_weights = <s, a>
 * through two (g and u, s); the weight gradients through three to four. So the norm-wise relative
 * error stays under 1e-2 (5 full roundings). Element by element, an output is a sum whose
 * terms can cancel, so its error is bounded by the roundings of its terms, not of itself:
 * each element within 2e-2 of itself (10 roundings) plus 5% of its group's RMS, the size
 * of a typical term's sum: a row of dx, all of d topk_weights, one expert's weight gradient
 * (or its gate or up half: with skewed routing a whole tensor's RMS mixes experts with
 * thousands of rows and experts with none, whose gradients must be zeros). An element
 * computed from the wrong row or left unwritten is off by about 100%.
 */
#define NORM_TOL 1e-2
#define ELEM_TOL 5e-2 /* of the group's RMS */
#define SELF_TOL 2e-2 /* of the element itself */

/* One training step (forward_train, backward) of `impl` on the fixture's inputs (m tokens,
 * its x, ids, weights and expert weights); dx left in d_dx, d topk_weights in d_dw, the
 * weight gradients in g_gu and g_dn (bf16). */
comet_status_t train_step(fixture_t *fx, comet_moe_saved_t saved, comet_impl_t impl, int m, void *d_dy, void *d_dx,
                          float *d_dw, void *g_gu, void *g_dn);

/* got (n values, float) against ref (float64): norm-wise, and element by element against
 * SELF_TOL of itself plus ELEM_TOL x the RMS of each group of `group` values (a row; or
 * all n). 0, or 1 with what failed printed. */
int compare(const char *what, const float *got, const double *ref, size_t n, size_t group, int rank);

/* Weight gradients (bf16, n values: gate_up's n_gu, then down's) against another path's,
 * element by element: SELF_TOL of the element plus ELEM_TOL of its part's RMS. Adds the
 * bit-equal elements to *equal and raises *worst (|diff| / RMS, infinite for NaN). 0, or
 * 1 with the first element past its bound printed after `who`. */
int compare_grads(const char *who, const uint16_t *got, const uint16_t *want, size_t n_gu, size_t n, size_t *equal,
                  double *worst);

#endif
