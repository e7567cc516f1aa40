/*
 * routing_weights.cu - the backward's routing weights between a token's choices and the
 * send order: each choice's weight to its row's place, and each row's part of the
 * weight's gradient gathered home (both paths).
 */
#include <stdint.h>

#include "pointwise/pointwise.h"

/* The routing weights in the send order: out[send_pos[i]] = w[i] (send_pos -1: a choice
 * with no row, left out). */
static __global__ void weights_to_send_order_kernel(const float *w, const int32_t *send_pos, int n, float *out)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (send_pos[i] >= 0) out[send_pos[i]] = w[i];
}

extern "C" cudaError_t cometi_launch_weights_to_send_order(const float *w, const int32_t *send_pos, int n, float *out,
                                                           cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    weights_to_send_order_kernel<<<(n + 255) / 256, 256, 0, stream>>>(w, send_pos, n, out);
    return cudaGetLastError();
}

/* d topk_weights[i] = sum over the tp partials c of rows[c c_stride + send_pos[i] pos_stride]
 * in fp32, c in order (the same bits every run); 0 for a choice with no row. */
static __global__ void gather_weight_grads_kernel(const float *rows, int tp, size_t c_stride, int pos_stride,
                                                  const int32_t *send_pos, int n, float *dw)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float sum = 0.0f;
        if (send_pos[i] >= 0)
            for (int c = 0; c < tp; c++) sum += rows[c * c_stride + (size_t)send_pos[i] * pos_stride];
        dw[i] = sum;
    }
}

extern "C" cudaError_t cometi_launch_gather_weight_grads(const float *rows, int tp, size_t c_stride, int pos_stride,
                                                         const int32_t *send_pos, int n, float *dw,
                                                         cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    gather_weight_grads_kernel<<<(n + 255) / 256, 256, 0, stream>>>(rows, tp, c_stride, pos_stride, send_pos, n, dw);
    return cudaGetLastError();
}
