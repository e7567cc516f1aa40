/*
 * gemm_wgrad.cu - the kernels of one family of variants.h's rows: the weight gradients: A^T B, groups along K (each expert's rows), both operands
 * MN-major.
 * Each family compiles in a file of its own, so the three build side by side.
 */
#include "gemm/kernel.cuh"

extern "C" cudaError_t cometi_gemm_launch_wgrad(const cometi_gemm_plan_t *plan, cudaStream_t stream)
{
    return launch_family<COMETI_GEMM_FAMILY_WGRAD>(plan, stream);
}
