/*
 * gemm_dgrad.cu - the kernels of one family of variants.h's rows: the backward's dgrad GEMMs: dy W, B MN-major (a weight as the forward keeps it),
 * groups along A's rows.
 * Each family compiles in a file of its own, so the three build side by side.
 */
#include "gemm/kernel.cuh"

extern "C" cudaError_t cometi_gemm_launch_dgrad(const cometi_gemm_plan_t *plan, cudaStream_t stream)
{
    return launch_family<COMETI_GEMM_FAMILY_DGRAD>(plan, stream);
}
