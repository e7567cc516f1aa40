/*
 * gemm_forward.cu - the kernels of one family of variants.h's rows: the forward's GEMMs: x W^T, A and B K-major, groups along A's rows (GEMM0 with its
 * SwiGLU epilogues, GEMM1 with its push and splits).
 * Each family compiles in a file of its own, so the three build side by side.
 */
#include "gemm/kernel.cuh"

extern "C" cudaError_t cometi_gemm_launch_forward(const cometi_gemm_plan_t *plan, cudaStream_t stream)
{
    return launch_family<COMETI_GEMM_FAMILY_FORWARD>(plan, stream);
}
