/*
 * gpu.cu - device helpers that tests and benchmarks use and the library does not: flag
 * waits and raises in the control window (to test the timed waits), and a copy kernel
 * of 16-byte loads and stores that measures push and pull bandwidth through symmetric
 * memory.
 */
#include <string.h>

#include "gpu.h"
#include "base/ptx.cuh"

static __global__ void wait_flag_kernel(const unsigned long long *flag, unsigned long long expected,
                                        unsigned long long timeout_ns, cometi_async_error_t *err, int slot)
{
    cometi_wait_geq(flag, expected, timeout_ns, err, COMETI_SITE_FLAG, -1, slot);
}

static __global__ void set_flag_kernel(unsigned long long *flag, unsigned long long value)
{
    __threadfence_system();
    cometi_st_release_sys(flag, value);
}

extern "C" comet_status_t cometi_wait_flag(comet_comm_t comm, int slot, unsigned long long expected,
                                           cudaStream_t stream)
{
    if (slot < 0 || slot >= COMETI_CTRL_NFLAGS)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "flag slot %d: must be 0..%d", slot,
                           COMETI_CTRL_NFLAGS - 1);
    const unsigned long long *flag = (const unsigned long long *)comm->ctrl.local + COMETI_CTRL_FLAGS + slot;
    wait_flag_kernel<<<1, 1, 0, stream>>>(flag, expected, (unsigned long long)comm->timeout_ms * 1000000ull, comm->async_dev, slot);
    return cometi_cuda(comm->err, cudaGetLastError(), "launch wait_flag_kernel");
}

extern "C" comet_status_t cometi_set_flag(comet_comm_t comm, int peer, int slot, unsigned long long value,
                                          cudaStream_t stream)
{
    if (slot < 0 || slot >= COMETI_CTRL_NFLAGS || peer < 0 || peer >= comm->size)
        return cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "flag slot %d of rank %d: slot must be 0..%d, "
                           "rank 0..%d", slot, peer, COMETI_CTRL_NFLAGS - 1, comm->size - 1);
    unsigned long long *flag = (unsigned long long *)comm->ctrl.peer[peer] + COMETI_CTRL_FLAGS + slot;
    set_flag_kernel<<<1, 1, 0, stream>>>(flag, value);
    return cometi_cuda(comm->err, cudaGetLastError(), "launch set_flag_kernel");
}

/* ---- copies over NVLink ---- */

/* 16-byte loads and stores, four in flight per thread before the first store. */
static __global__ void __launch_bounds__(1024) copy_kernel(uint4 *dst, const uint4 *src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

extern "C" comet_status_t cometi_copy(char *err, void *dst, const void *src, size_t bytes, int blocks,
                                      cudaStream_t stream)
{
    if (bytes % 16 || (uintptr_t)dst % 16 || (uintptr_t)src % 16 || blocks < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "copy of %zu bytes with %d blocks: bytes and both "
                           "addresses must be multiples of 16, blocks >= 1", bytes, blocks);
    copy_kernel<<<blocks, 1024, 0, stream>>>((uint4 *)dst, (const uint4 *)src, bytes / 16);
    return cometi_cuda(err, cudaGetLastError(), "launch copy_kernel");
}
