/*
 * combine.cu - layer1's tail kernel: the combine of the last column splits on every SM,
 * once the fused GEMM1 kernel is done (see combine.cuh). With nothing left to overlap,
 * the splits the GEMM finishes last are spread over the whole GPU instead of a few
 * combine blocks.
 */
#include <cuda_bf16.h>

#include "gemm.h"
#include "ptx.cuh"
#include "combine.cuh"

#define TAIL_THREADS 384

static __global__ void __launch_bounds__(TAIL_THREADS, 1)
combine_tail_kernel(const cometi_combine_t c, const __nv_bfloat16 *rows, int hidden, const cometi_segment_t *segs,
                    int groups, int n_splits, int tiles_per_split, const unsigned long long *split_done, int pull,
                    cometi_async_error_t *err, unsigned long long timeout_ns)
{
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    combine_block_t b;
    if (!combine_setup(&c, segs, groups, gridDim.x, smem, err, &b)) return;
    if (pull) combine_pull(&c, &b, &c.sync[0], err, timeout_ns);
    for (int split = c.kernel_splits; split < n_splits; split++)
        combine_split(&c, &b, rows, hidden, n_splits, split, tiles_per_split, split_done, err, timeout_ns);
    combine_finish(&c, &b, c.sync, c.kernel_splits, n_splits, tiles_per_split);
}

extern "C" comet_status_t cometi_launch_combine_tail(char *err, const cometi_combine_t *c, const void *rows, int hidden,
                                                     const cometi_segment_t *segs, int groups, int n_splits,
                                                     int tiles_per_split, const unsigned long long *split_done,
                                                     int pull, cometi_async_error_t *async_err,
                                                     unsigned long long timeout_ns, cudaStream_t stream)
{
    /* Per device, once: its SMs, the most shared memory a block may have, and the kernel
     * set to use it (one block per SM, every one resident: the record pull ends in a
     * meeting). */
    static struct {
        int sm_count, smem;
    } devices[64];
    int dev = 0;
    COMETI_TRY(cometi_cuda(err, cudaGetDevice(&dev), "cudaGetDevice"));
    if (dev >= 64)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "combine tail: device %d: at most 64 devices per process", dev);
    if (!devices[dev].sm_count) {
        int sm_count = 0, smem = 0;
        COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev),
                               "cudaDeviceGetAttribute(SM count)"));
        COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                               "cudaDeviceGetAttribute(shared memory per block)"));
        COMETI_TRY(cometi_cuda(err, cudaFuncSetAttribute(combine_tail_kernel,
                                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                               "cudaFuncSetAttribute(combine tail shared memory)"));
        devices[dev].smem = smem;
        devices[dev].sm_count = sm_count;
    }
    const int sm_count = devices[dev].sm_count, smem = devices[dev].smem;
    combine_tail_kernel<<<sm_count, TAIL_THREADS, smem, stream>>>(*c, (const __nv_bfloat16 *)rows, hidden, segs, groups,
                                                                  n_splits, tiles_per_split, split_done, pull,
                                                                  async_err, timeout_ns);
    return cometi_cuda(err, cudaGetLastError(), "launch combine_tail_kernel");
}
