/*
 * fill.cu - synthetic bf16 tensors for benchmarks and tests, element i being
 * cometi_hash_bf16(seed, index0 + i, scale): random-looking, never zeros (which run
 * faster than real data), and reproducible on the host element by element.
 */
#include <stdint.h>

#include "data.h"

/* dst[r * cols + c] = hash(index0 + r * src_stride + c): rows of a larger tensor. */
static __global__ void fill_hash_kernel(uint16_t *dst, size_t n, size_t cols, size_t src_stride, uint64_t seed,
                                        uint64_t index0, float scale)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = cometi_hash_bf16(seed, index0 + i / cols * src_stride + i % cols, scale);
}

extern "C" cudaError_t cometi_fill_hash_bf16_rows(void *dst, size_t rows, size_t cols, size_t src_stride,
                                                  uint64_t seed, uint64_t index0, float scale, cudaStream_t stream)
{
    if (rows == 0 || cols == 0) return cudaSuccess;
    fill_hash_kernel<<<1024, 256, 0, stream>>>((uint16_t *)dst, rows * cols, cols, src_stride, seed, index0, scale);
    return cudaGetLastError();
}

extern "C" cudaError_t cometi_fill_hash_bf16(void *dst, size_t n, uint64_t seed, uint64_t index0, float scale,
                                             cudaStream_t stream)
{
    return cometi_fill_hash_bf16_rows(dst, 1, n, n, seed, index0, scale, stream);
}
