/*
 * launch.h - how the library's CUDA files launch their kernels: with programmatic
 * dependent launch where it is on. Needs the CUDA runtime's header alone.
 */
#ifndef COMET_BASE_LAUNCH_H
#define COMET_BASE_LAUNCH_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Launch settings for a kernel that may start before the kernel ahead of it in the stream
 * has ended (programmatic dependent launch): it must call cometi_grid_wait() (ptx.cuh)
 * before it reads what that kernel wrote. attr: room for one attribute. COMET_PDL=0 in
 * the environment (params.h) launches such kernels the ordinary way. */
int cometi_pdl_enabled(void);
static inline cudaLaunchConfig_t cometi_pdl_config(unsigned int grid, unsigned int block, size_t smem,
                                                   cudaStream_t stream, cudaLaunchAttribute *attr)
{
    cudaLaunchConfig_t cfg; /* every field set below */
    cfg.gridDim.x = grid, cfg.gridDim.y = cfg.gridDim.z = 1;
    cfg.blockDim.x = block, cfg.blockDim.y = cfg.blockDim.z = 1;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cometi_pdl_enabled() ? 1 : 0;
    return cfg;
}

#ifdef __cplusplus
}
#endif

#endif /* COMET_BASE_LAUNCH_H */
