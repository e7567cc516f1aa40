/*
 * gpu.h - what tests and benchmarks run on the GPU beside the library's own calls: flag
 * waits and raises in a communicator's control window, a copy kernel for bandwidth, and
 * each fused operator's GEMM alone (the term "our GEMMs alone" of the overlap bound).
 */
#ifndef COMET_HARNESS_GPU_H
#define COMET_HARNESS_GPU_H

#include "layer/layer.h"
#include "patterns/gemm_combine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Wait on the device until this rank's control flag `slot` reaches `expected`. */
comet_status_t cometi_wait_flag(comet_comm_t comm, int slot, unsigned long long expected, cudaStream_t stream);
/* Raise `peer`'s control flag `slot` to `value` with a system-scope release store. */
comet_status_t cometi_set_flag(comet_comm_t comm, int peer, int slot, unsigned long long value,
                               cudaStream_t stream);
/* Copy `bytes` (multiple of 16, 16-byte aligned) with `blocks` blocks of 16-byte stores;
 * either side may be a peer's window. */
comet_status_t cometi_copy(char *err, void *dst, const void *src, size_t bytes, int blocks, cudaStream_t stream);

/* GEMM0 + SwiGLU alone on the rows the last dispatch -> GEMM call left in the receive
 * buffer, every SM, no waits. `dynamic_tiles`: tiles from the shared counter (the fused
 * kernel's schedule), else the static split. */
comet_status_t cometi_dispatch_gemm_alone(comet_comm_t comm, cometi_dispatch_gemm_t *l, const comet_moe_args_t *a,
                                          int dynamic_tiles, cudaStream_t stream);
/* GEMM1 alone on layer0's activations into the GEMM's output, every SM, one split. */
comet_status_t cometi_gemm_combine_alone(comet_comm_t comm, cometi_gemm_combine_t *l, cometi_dispatch_gemm_t *l0,
                                         const comet_moe_args_t *a, int dynamic_tiles, cudaStream_t stream);

/* The GPU's own E4M3 conversion (cvt.rn.satfinite.e4m3x2.f32, base/fp8.h's wrapper that the
 * quantize kernels call) of the floats whose bits are first .. first + count - 1: out[i]
 * for the bits first + i (e4m3_cvt.cu). The tests hold it against cometi_e4m3_encode. */
cudaError_t cometi_e4m3_cvt_range(uint32_t first, uint32_t count, uint8_t *out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_HARNESS_GPU_H */
