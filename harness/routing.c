/*
 * routing.c - synthetic routing for tests and benchmarks: balanced, uniform
 * random, skewed expert load, and everything-to-one-expert; deterministic per seed.
 */
#include <math.h>
#include <stdlib.h>

#include "data.h"

static int already_chosen(const int32_t *ids, int j, int e)
{
    for (int q = 0; q < j; q++)
        if (ids[q] == e) return 1;
    return 0;
}

/* One expert drawn from the cumulative weights cdf[E] (cdf[E-1] = total). */
static int draw(const double *cdf, int num_experts, uint64_t *state)
{
    double u = cometi_rand_unit(state) * cdf[num_experts - 1];
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (cdf[mid] > u) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

void cometi_make_routing(cometi_routing_t kind, double skew, int m, int k, int num_experts, uint64_t seed,
                         int rank, int32_t *ids, float *weights)
{
    const int E = num_experts;
    uint64_t state = seed ^ (0x5851f42d4c957f2dull * (uint64_t)(rank + 1));
    double *cdf = malloc(sizeof(double) * (size_t)E);
    if (!cdf) abort(); /* E doubles: nothing sensible to do without them */
    double total = 0.0;
    for (int e = 0; e < E; e++) {
        double w = 1.0;
        if (kind == COMETI_ROUTING_SKEWED && E > 1 && skew > 1.0) w = pow(skew, -(double)e / (E - 1));
        total += w;
        cdf[e] = total;
    }
    for (int t = 0; t < m; t++) {
        int32_t *row = ids + (size_t)t * k;
        int64_t g = (int64_t)rank * m + t;
        for (int j = 0; j < k; j++) {
            int e;
            if (kind == COMETI_ROUTING_BALANCED) {
                e = (int)((g * k + j) % E);
            } else if (kind == COMETI_ROUTING_ONE_EXPERT && j == 0) {
                e = (int)skew % E;
            } else {
                /* k distinct experts; past E choices there are none left: repeats */
                do e = draw(cdf, E, &state);
                while (j < E && already_chosen(row, j, e));
            }
            row[j] = e;
        }
        double sum = 0.0;
        for (int j = 0; j < k; j++) {
            weights[(size_t)t * k + j] = (float)(0.1 + cometi_rand_unit(&state));
            sum += weights[(size_t)t * k + j];
        }
        for (int j = 0; j < k; j++) weights[(size_t)t * k + j] = (float)(weights[(size_t)t * k + j] / sum);
    }
    free(cdf);
}
