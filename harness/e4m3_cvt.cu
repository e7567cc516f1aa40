/*
 * e4m3_cvt.cu - the GPU's E4M3 conversion of any range of float bit patterns, through the
 * same wrapper as the quantize kernels (base/fp8.h), so a test can hold the host's
 * cometi_e4m3_encode against the hardware float by float.
 */
#include <stdint.h>

#include "base/fp8.h"
#include "gpu.h"

/* Two floats a thread: the pair form of the conversion, as the kernels use it. */
static __global__ void e4m3_cvt_kernel(uint32_t first, uint32_t count, uint8_t *out)
{
    for (uint64_t i = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) * 2; i < count;
         i += (uint64_t)gridDim.x * blockDim.x * 2) {
        const float lo = cometi_f32_from_bits(first + (uint32_t)i), hi = cometi_f32_from_bits(first + (uint32_t)i + 1u);
        const uint16_t pair = cometi_e4m3x2_cvt(lo, hi);
        out[i] = (uint8_t)(pair & 0xffu);
        if (i + 1 < count) out[i + 1] = (uint8_t)(pair >> 8);
    }
}

extern "C" cudaError_t cometi_e4m3_cvt_range(uint32_t first, uint32_t count, uint8_t *out, cudaStream_t stream)
{
    if (count == 0) return cudaSuccess;
    e4m3_cvt_kernel<<<1024, 256, 0, stream>>>(first, count, out);
    return cudaGetLastError();
}
