/*
 * alone.c - each fused operator's GEMM on its own (gpu.h): the operator's own description
 * of its GEMM, with every role off, on every SM.
 */
#include "gpu.h"

comet_status_t cometi_dispatch_gemm_alone(comet_comm_t comm, cometi_dispatch_gemm_t *l, const comet_moe_args_t *a,
                                          int dynamic_tiles, cudaStream_t stream)
{
    cometi_gemm_t g = cometi_dispatch_gemm_gemm(comm, l, a);
    g.launch.sched = dynamic_tiles ? l->sched : NULL;
    return cometi_gemm_run(comm->err, &g, stream);
}

comet_status_t cometi_gemm_combine_alone(comet_comm_t comm, cometi_gemm_combine_t *l, cometi_dispatch_gemm_t *l0,
                                         const comet_moe_args_t *a, int dynamic_tiles, cudaStream_t stream)
{
    cometi_gemm_t g = cometi_gemm_combine_gemm(comm, l, l0, a);
    g.launch.sched = dynamic_tiles ? l->sched : NULL;
    return cometi_gemm_run(comm->err, &g, stream);
}
