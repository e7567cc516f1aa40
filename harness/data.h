/*
 * data.h - synthetic inputs for tests and benchmarks: a seedable generator, bf16 tensors
 * whose every element the host can rebuild (the GPU fill gives the same bits), and
 * routings (balanced, random, skewed, all to one expert), deterministic per seed.
 */
#ifndef COMET_HARNESS_DATA_H
#define COMET_HARNESS_DATA_H

#include "layer/layer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cometi_routing {
    COMETI_ROUTING_BALANCED = 0, /* token g picks experts (g*k + j) mod E: every expert equally loaded */
    COMETI_ROUTING_RANDOM = 1,   /* k distinct experts, uniform */
    COMETI_ROUTING_SKEWED = 2,   /* k distinct experts, expert e drawn with weight skew^(-e/(E-1)) */
    COMETI_ROUTING_ONE_EXPERT = 3 /* choice 0 of every token is expert `skew` (as an int); the rest uniform */
} cometi_routing_t;

/* Fill ids[m][k] and weights[m][k] (positive, each token's summing to 1) for rank
 * `rank` from `seed`; the same arguments give the same routing, and a token's experts
 * are distinct while k <= E. For SKEWED, `skew` is the ratio of the most to the least
 * loaded expert's expected load (>= 1). */
void cometi_make_routing(cometi_routing_t kind, double skew, int m, int k, int num_experts, uint64_t seed,
                         int rank, int32_t *ids, float *weights);

/* splitmix64: a small, good, seedable generator for test and benchmark data. */
static inline COMETI_HD uint64_t cometi_rand_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* Uniform in [0, 1). */
static inline double cometi_rand_unit(uint64_t *state) { return (cometi_rand_next(state) >> 11) * 0x1.0p-53; }

/* Element `index` of a synthetic tensor: uniform in [-scale, scale), rounded to bf16.
 * The GPU fill (fill.cu) gives the same bits, so the host can rebuild any element of
 * a full-size benchmark tensor to check results without copying the tensor back. */
static inline COMETI_HD uint16_t cometi_hash_bf16(uint64_t seed, uint64_t index, float scale)
{
    uint64_t state = seed ^ (index * 0xd1b54a32d192ed03ull);
    double u = (double)(cometi_rand_next(&state) >> 11) * (1.0 / 9007199254740992.0);
    return cometi_float_to_bf16((float)((2.0 * u - 1.0) * scale));
}

/* dst[i] = cometi_hash_bf16(seed, index0 + i, scale) for i < n (bf16 elements). */
cudaError_t cometi_fill_hash_bf16(void *dst, size_t n, uint64_t seed, uint64_t index0, float scale,
                                  cudaStream_t stream);
/* The rows of a bigger tensor: dst[r][c] = cometi_hash_bf16(seed, index0 + r * src_stride + c,
 * scale) for r < rows, c < cols (a TP rank's columns of a weight, say). */
cudaError_t cometi_fill_hash_bf16_rows(void *dst, size_t rows, size_t cols, size_t src_stride, uint64_t seed,
                                       uint64_t index0, float scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_HARNESS_DATA_H */
