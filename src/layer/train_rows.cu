/*
 * train_rows.cu - the fused training path's row kernels (train_fused.c): what a training
 * forward keeps of the rows it received and of its choices' places, the routing weights
 * and their gradients between each row's source and its expert's rank, and the padding
 * the backward's weight gradients need zeroed. The arithmetic (SwiGLU's backward with
 * the weights' gradient beside it) is the sequential path's (pointwise/swiglu.cu).
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "base/launch.h"
#include "base/ptx.cuh"
#include "base/row_copy.cuh"
#include "layer/train_rows.h"

/* Where segment s ends with its padding to the next 128 rows. */
static __device__ long long padded_end(cometi_segment_t s)
{
    return s.start + ((long long)s.rows + COMETI_BLOCK_M - 1) / COMETI_BLOCK_M * COMETI_BLOCK_M;
}

/* The segment holding row `row` with its padding, or -1. The receive layout puts the padded
 * segments one after another (starts never decrease; an empty one starts where the next
 * does), so the last segment starting at or before the row is the only one that can hold
 * it: a binary search, not a walk over up to 1024 experts per row. */
static __device__ int segment_of(const cometi_segment_t *segs, int groups, long long row, cometi_segment_t *out)
{
    int lo = 0, hi = groups - 1, g = -1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        if (segs[mid].start <= row) g = mid, lo = mid + 1;
        else hi = mid - 1;
    }
    if (g < 0 || row >= padded_end(segs[g])) return -1;
    *out = segs[g];
    return g;
}

/* The rows worth visiting: below cap_rows and the last segment's padded end (the worst
 * case the buffers are sized for is often far past the rows this call received). */
static __device__ long long rows_to_visit(const cometi_segment_t *segs, int groups, long long cap_rows)
{
    const long long end = groups > 0 ? padded_end(segs[groups - 1]) : 0;
    return end < cap_rows ? end : cap_rows;
}

/* One warp per row of [0, cap_rows): a segment's row copied, its padding zeroed. The first
 * thread checks every group's received rows against the bound: the plan is the same on
 * every rank, so every rank records the same error (none computes on alone). */
static __global__ void keep_rows_kernel(const uint4 *src, uint4 *dst, int row_vecs, const cometi_segment_t *segs,
                                        int groups, long long cap_rows, long long bound, const int32_t *seg_rows,
                                        int num_groups, cometi_async_error_t *err)
{
    if (blockIdx.x == 0 && threadIdx.x == 0)
        for (int g = 0; g < num_groups; g++) {
            long long rows = 0;
            for (int e = 0; e < groups; e++) rows += seg_rows[g * groups + e];
            if (rows > bound) {
                cometi_record_error(err, COMETI_ASYNC_INVALID_ARGUMENT, COMETI_SITE_SAVED_BOUND, g, 0,
                                    (unsigned long long)bound, (unsigned long long)rows, 0);
                break;
            }
        }
    if (!dst) return; /* the check alone: the rows are not kept (config.resend_x) */
    const int warps = blockDim.x / 32;
    const long long visit = rows_to_visit(segs, groups, cap_rows);
    for (long long row = (long long)blockIdx.x * warps + threadIdx.x / 32; row < visit;
         row += (long long)gridDim.x * warps) {
        cometi_segment_t s;
        if (segment_of(segs, groups, row, &s) < 0) continue;
        uint4 *out = dst + row * row_vecs;
        if (row < s.start + s.rows) {
            cometi_warp_copy_row(out, src + row * row_vecs, row_vecs);
        } else {
            for (int v = threadIdx.x % 32; v < row_vecs; v += 32) out[v] = make_uint4(0, 0, 0, 0);
        }
    }
}

extern "C" cudaError_t cometi_launch_keep_rows(const void *src, void *dst, int row_bytes, const cometi_segment_t *segs,
                                               int groups, int64_t cap_rows, int64_t bound, const int32_t *seg_rows,
                                               int num_groups, cometi_async_error_t *err, int sm_count,
                                               cudaStream_t stream)
{
    if (cap_rows == 0) return cudaSuccess;
    keep_rows_kernel<<<dst ? sm_count * 4 : 1, dst ? 256 : 32, 0, stream>>>((const uint4 *)src, (uint4 *)dst,
                                                                            row_bytes / 16, segs, groups,
                                                       (long long)cap_rows, (long long)bound, seg_rows, num_groups,
                                                       err);
    return cudaGetLastError();
}

static __global__ void keep_send_pos_kernel(const int32_t *ids, const int32_t *pos, const int32_t *send_offset,
                                            int n, int num_experts, int32_t *send_pos)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int e = ids[i];
        send_pos[i] = e < 0 || e >= num_experts ? -1 : send_offset[e] + pos[i];
    }
}

extern "C" cudaError_t cometi_launch_keep_send_pos(const int32_t *ids, const int32_t *pos, const int32_t *send_offset,
                                                   int n, int num_experts, int32_t *send_pos, cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    keep_send_pos_kernel<<<(n + 255) / 256, 256, 0, stream>>>(ids, pos, send_offset, n, num_experts, send_pos);
    return cudaGetLastError();
}

/* A thread per row of the segments below cap_rows: its source and slot, or {-1, .} for
 * padding (and rows outside every segment). */
static __device__ int2 row_home(const int2 *dest, const cometi_segment_t *segs, int groups, long long row)
{
    cometi_segment_t s;
    if (segment_of(segs, groups, row, &s) < 0 || row >= s.start + s.rows) return make_int2(-1, 0);
    return dest[row];
}

static __global__ void pull_weights_kernel(cometi_weight_windows_t win, const int2 *dest, const cometi_segment_t *segs,
                                           int groups, long long cap_rows, int tp, float *w_rows)
{
    const long long visit = rows_to_visit(segs, groups, cap_rows);
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < visit;
         row += (long long)gridDim.x * blockDim.x) {
        const int2 d = row_home(dest, segs, groups, row);
        w_rows[row] = d.x < 0 ? 0.0f : win.peer[d.x][d.y / tp];
    }
}

extern "C" cudaError_t cometi_launch_pull_weights(const cometi_weight_windows_t *win, const void *dest,
                                                  const cometi_segment_t *segs, int groups, int64_t cap_rows, int tp,
                                                  float *w_rows, int sm_count, cudaStream_t stream)
{
    if (cap_rows == 0) return cudaSuccess;
    pull_weights_kernel<<<sm_count, 256, 0, stream>>>(*win, (const int2 *)dest, segs, groups, (long long)cap_rows, tp,
                                                      w_rows);
    return cudaGetLastError();
}

static __global__ void send_weight_grads_kernel(cometi_weight_windows_t win, const int2 *dest,
                                                const cometi_segment_t *segs, int groups, long long cap_rows,
                                                const float *dw_rows)
{
    const long long visit = rows_to_visit(segs, groups, cap_rows);
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < visit;
         row += (long long)gridDim.x * blockDim.x) {
        const int2 d = row_home(dest, segs, groups, row);
        if (d.x >= 0) win.peer[d.x][win.grads_at + d.y] = dw_rows[row];
    }
    __threadfence_system(); /* before the dx rows' release, which the owner acquires */
}

extern "C" cudaError_t cometi_launch_send_weight_grads(const cometi_weight_windows_t *win, const void *dest,
                                                       const cometi_segment_t *segs, int groups, int64_t cap_rows,
                                                       const float *dw_rows, int sm_count, cudaStream_t stream)
{
    if (cap_rows == 0) return cudaSuccess;
    send_weight_grads_kernel<<<sm_count, 256, 0, stream>>>(*win, (const int2 *)dest, segs, groups,
                                                           (long long)cap_rows, dw_rows);
    return cudaGetLastError();
}

/* One warp per row of [0, cap_rows) that pads a segment: zero in each buffer. */
static __global__ void zero_padding_kernel(cometi_padded_rows_t bufs, const cometi_segment_t *segs, int groups,
                                           long long cap_rows)
{
    const int warps = blockDim.x / 32;
    const long long visit = rows_to_visit(segs, groups, cap_rows);
    for (long long row = (long long)blockIdx.x * warps + threadIdx.x / 32; row < visit;
         row += (long long)gridDim.x * warps) {
        cometi_segment_t s;
        if (segment_of(segs, groups, row, &s) < 0 || row < s.start + s.rows) continue;
        for (int b = 0; b < COMETI_PADDED_BUFFERS; b++) {
            if (!bufs.rows[b]) continue;
            uint4 *out = (uint4 *)bufs.rows[b] + row * (bufs.row_bytes[b] / 16);
            for (int v = threadIdx.x % 32; v < bufs.row_bytes[b] / 16; v += 32) out[v] = make_uint4(0, 0, 0, 0);
        }
    }
}

extern "C" cudaError_t cometi_launch_zero_padding(const cometi_padded_rows_t *bufs, const cometi_segment_t *segs,
                                                  int groups, int64_t cap_rows, int sm_count, cudaStream_t stream)
{
    if (cap_rows == 0) return cudaSuccess;
    zero_padding_kernel<<<sm_count * 2, 256, 0, stream>>>(*bufs, segs, groups, (long long)cap_rows);
    return cudaGetLastError();
}
