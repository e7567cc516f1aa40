/*
 * row_copy.cuh - one warp copies a row with 16-byte loads and stores, eight loads in
 * flight per lane before the stores: a row copy is latency-bound, so depth, not width,
 * sets its speed. The last pass too keeps eight in flight (7 KB rows left six 16-byte
 * round trips one after another): indices past the row repeat its last 16 bytes, stored
 * where they came from. Self-contained, so bench/copy_patterns.cu times this very code.
 */
#ifndef COMET_ROW_COPY_CUH
#define COMET_ROW_COPY_CUH

static __device__ __forceinline__ void cometi_warp_copy_row(uint4 *dst, const uint4 *src, int vecs)
{
    for (int v = (int)(threadIdx.x % 32); v < vecs; v += 256) {
        uint4 t[8];
#pragma unroll
        for (int u = 0; u < 8; u++) t[u] = src[min(v + 32 * u, vecs - 1)];
#pragma unroll
        for (int u = 0; u < 8; u++) dst[min(v + 32 * u, vecs - 1)] = t[u];
    }
}

#endif /* COMET_ROW_COPY_CUH */
