/*
 * fill.cu - synthetic bf16 tensors for benchmarks and tests, element i being
 * cometi_hash_bf16(seed, index0 + i, scale): random-looking, never zeros (which run
 * faster than real data), and reproducible on the host element by element.
 */
#include <stdint.h>

#include "../internal.h"

static __global__ void fill_hash_kernel(uint16_t *dst, size_t n, uint64_t seed, uint64_t index0, float scale)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = cometi_hash_bf16(seed, index0 + i, scale);
}

extern "C" cudaError_t cometi_fill_hash_bf16(void *dst, size_t n, uint64_t seed, uint64_t index0, float scale,
                                             cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    fill_hash_kernel<<<1024, 256, 0, stream>>>((uint16_t *)dst, n, seed, index0, scale);
    return cudaGetLastError();
}
