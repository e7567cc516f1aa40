/*
 * gemm_fp8.cu - the kernels of one family of variants.h's rows: the block-scaled FP8
 * (E4M3) GEMMs, A and B K-major, groups along A's rows (GEMM0 with its quantizing SwiGLU
 * epilogue, GEMM1). Each family compiles in a file of its own, so the four build side by
 * side.
 */
#include "gemm/kernel.cuh"

extern "C" cudaError_t cometi_gemm_launch_fp8(const cometi_gemm_plan_t *plan, cudaStream_t stream)
{
    return launch_family<COMETI_GEMM_FAMILY_FP8>(plan, stream);
}
