/*
 * first_wave.cu - the first wave's rows (tp 1): while the route's exchange waits for the
 * peers' counts, this rank's own rows of its first expert (bf16, or E4M3 with their
 * scales: the rows as the dispatch sends them) are copied into its receive buffer in
 * whole 128-row blocks, so a GEMM on a side stream can start on them
 * (patterns/dispatch_gemm.c runs it; route.c's cometi_first_rows launches this).
 */
#include <stdint.h>

#include "comm/route_kernels.h"
#include "base/row_copy.cuh"

/* The first-wave kernel's rows (cometi_first_rows). Every thread looks at a row; a warp
 * copies each of its lanes' rows of expert e0 whose place is below the limit. The limit
 * is whole 128-row blocks of own rows, so each such block gets exactly 128 rows this
 * call: block 0 adds them to the arrival totals at once (nothing in this call waits on
 * those blocks; a later call's waits come after this stream has been joined). If the
 * exchange fails (a timeout), the plan is emptied and these additions have no expected
 * rows behind them: the totals run 128 ahead per block, harmless only because a timeout
 * leaves the communicator unusable (docs/ARCHITECTURE.md). */
#define FIRST_ROWS_THREADS 1024
static __global__ void __launch_bounds__(FIRST_ROWS_THREADS)
first_rows_kernel(const int32_t *ids, int n, int k, int e0, const int32_t *chunk_pos, const int32_t *chunk_counts,
                  int chunks, int wave_blocks, const uint4 *x, int vecs, uint4 *recv, unsigned long long *arrive,
                  cometi_segment_t *seg)
{
    __shared__ int before_s[COMETI_FIRST_ROWS_MAX_CHUNKS], limit_s;
    if (threadIdx.x == 0) { /* e0's own rows in earlier chunks, and the rows to copy */
        int sum = 0;
        for (int c = 0; c < chunks; c++) {
            before_s[c] = sum;
            sum += chunk_counts[(size_t)e0 * chunks + c];
        }
        limit_s = min(sum / COMETI_BLOCK_M, wave_blocks) * COMETI_BLOCK_M;
        if (blockIdx.x == 0) seg->start = 0, seg->rows = limit_s;
    }
    __syncthreads();
    const int limit = limit_s;
    if (blockIdx.x == 0 && (int)threadIdx.x < limit / COMETI_BLOCK_M)
        atomicAdd(arrive + threadIdx.x, (unsigned long long)COMETI_BLOCK_M);
    for (int base = blockIdx.x * blockDim.x; base < n; base += gridDim.x * blockDim.x) {
        const int i = base + threadIdx.x;
        int pos = -1;
        if (i < n && ids[i] == e0) {
            pos = chunk_pos[i] + before_s[i / COMETI_ROUTE_CHUNK];
            if (pos >= limit) pos = -1;
        }
        for (unsigned int want = __ballot_sync(0xffffffffu, pos >= 0); want; want &= want - 1) {
            const int from = __ffs(want) - 1, p = __shfl_sync(0xffffffffu, pos, from),
                      row = __shfl_sync(0xffffffffu, i, from);
            cometi_warp_copy_row(recv + (size_t)p * vecs, x + (size_t)(row / k) * vecs, vecs);
        }
    }
}

extern "C" cudaError_t cometi_launch_first_rows(const int32_t *ids, int n, int k, int e0, const int32_t *chunk_pos,
                                               const int32_t *chunk_counts, int chunks, int wave_blocks, const void *x,
                                               int row_bytes, void *recv, unsigned long long *arrive,
                                               cometi_segment_t *seg, int max_blocks, cudaStream_t stream)
{
    if (chunks > COMETI_FIRST_ROWS_MAX_CHUNKS || row_bytes % 16) return cudaErrorInvalidValue;
    /* A thread per id (a warp copies its lanes' rows), the blocks capped. */
    int blocks = n > 0 ? (n + FIRST_ROWS_THREADS - 1) / FIRST_ROWS_THREADS : 1;
    if (blocks > max_blocks) blocks = max_blocks;
    first_rows_kernel<<<blocks, FIRST_ROWS_THREADS, 0, stream>>>(ids, n, k, e0, chunk_pos, chunk_counts, chunks,
                                                                 wave_blocks, (const uint4 *)x, row_bytes / 16,
                                                                 (uint4 *)recv, arrive, seg);
    return cudaGetLastError();
}
