/*
 * combine.cu - layer1's tail kernel: the combine of the last column splits on every SM,
 * once the fused GEMM1 kernel is done (see combine.cuh). With nothing left to overlap,
 * the splits the GEMM finishes last are spread over the whole GPU instead of a few
 * combine blocks. And the push's owner side: the GEMM's epilogue sent every row home, the
 * owner sums each token's rows into y.
 */
#include <cuda_bf16.h>

#include "comm/combine.h"
#include "base/ptx.cuh"
#include "comm/combine.cuh"

#define TAIL_THREADS 384

static __global__ void __launch_bounds__(TAIL_THREADS, 1)
combine_tail_kernel(const cometi_combine_t c, const __nv_bfloat16 *rows, int hidden, const cometi_segment_t *segs,
                    int groups, int n_splits, int tiles_per_split, const unsigned long long *split_done, int pull,
                    cometi_async_error_t *err, unsigned long long timeout_ns)
{
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    combine_block_t b;
    if (!combine_setup(&c, segs, groups, gridDim.x, smem, err, &b)) return;
    if (pull) combine_pull(&c, &b, &c.sync[0], err, timeout_ns);
    for (int split = c.kernel_splits; split < n_splits; split++)
        combine_split(&c, &b, rows, hidden, n_splits, split, tiles_per_split, split_done, err, timeout_ns);
    combine_finish(&c, &b, c.sync, c.kernel_splits, n_splits, tiles_per_split);
}

extern "C" cudaError_t cometi_launch_combine_tail(const cometi_combine_t *c, const void *rows, int hidden,
                                                  const cometi_segment_t *segs, int groups, int n_splits,
                                                  int tiles_per_split, const unsigned long long *split_done, int pull,
                                                  cometi_async_error_t *async_err, unsigned long long timeout_ns,
                                                  cudaStream_t stream)
{
    /* Per device, once: its SMs, the most shared memory a block may have, and the kernel
     * set to use it (one block per SM, every one resident: the record pull ends in a
     * meeting). */
    static struct {
        int sm_count, smem;
    } devices[64];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev >= 64) return cudaErrorInvalidDevice; /* the table above */
    if (!devices[dev].sm_count) {
        int sm_count = 0, smem = 0;
        if ((e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
            (e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess ||
            (e = cudaFuncSetAttribute(combine_tail_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) !=
                cudaSuccess)
            return e;
        devices[dev].smem = smem;
        devices[dev].sm_count = sm_count;
    }
    const int sm_count = devices[dev].sm_count, smem = devices[dev].smem;
    combine_tail_kernel<<<sm_count, TAIL_THREADS, smem, stream>>>(*c, (const __nv_bfloat16 *)rows, hidden, segs, groups,
                                                                  n_splits, tiles_per_split, split_done, pull,
                                                                  async_err, timeout_ns);
    return cudaGetLastError();
}

/* The push's owner side (see cometi_push_sum_t). A block takes a few tokens at a time:
 * first their choices' slots and weights into shared memory, once per token, then every
 * thread sums two 16-byte column chunks at once with all their loads in flight. (One
 * thread per chunk, each looking up its token's slots itself, ran at 1.1-1.8 TB/s: three
 * dependent loads before each slot's.) A step reads about SUM_READS chunks (k rows per
 * output chunk), so the table's dependent loads and the barriers are paid per 128 KB read
 * whatever top-k is: with a fixed 1024 output chunks per step, top-2 and top-4 steps read
 * only 32-64 KB and ran at 2.4-2.8 TB/s where top-8 ran at 3.8. With TP a
 * step reads tp partial rows per choice: tp x 128 KB. */
#define SUM_THREADS 256
#define SUM_READS 8192     /* 16-byte chunks read per step: 128 KB */
#define SUM_MAX_TOKENS 128 /* the tables' tokens per step */

/* Tokens per step: SUM_READS / top_k output chunks, whole tokens, 1..SUM_MAX_TOKENS. */
static __host__ __device__ inline int sum_step_tokens(int vecs, int top_k)
{
    const int t = SUM_READS / top_k / vecs;
    return t < 1 ? 1 : t > SUM_MAX_TOKENS ? SUM_MAX_TOKENS : t;
}

static __global__ void __launch_bounds__(SUM_THREADS)
push_sum_kernel(const cometi_push_sum_t s, cometi_async_error_t *err, unsigned long long timeout_ns)
{
    __shared__ unsigned long long per_call;
    __shared__ int at_s[SUM_MAX_TOKENS][COMETI_COMBINE_MAX_TOP_K];
    __shared__ float w_s[SUM_MAX_TOKENS][COMETI_COMBINE_MAX_TOP_K];
    /* Rows this rank sent this call (choices with a bad id were left out), each once per
     * column tile and TP rank of the group. */
    if (threadIdx.x == 0) {
        unsigned long long rows = 0;
        for (int e = 0; e < s.num_experts; e++) rows += (unsigned int)s.plan.counts[(size_t)s.rank * s.num_experts + e];
        per_call = rows * s.col_tiles * s.tp; /* every TP rank of the group sends its partial */
        cometi_wait_geq(s.arrive, *s.expected + per_call, timeout_ns, err, COMETI_SITE_PUSH, -1, 0);
    }
    const int vecs = s.hidden / 8, k = s.top_k;
    const int step = s.step;
    const int32_t *send_offset = s.plan.send_offset + (size_t)s.rank * s.num_experts;
    const __nv_bfloat16 *slots = (const __nv_bfloat16 *)s.slots;
    for (int t0 = blockIdx.x * step; t0 < s.num_tokens; t0 += gridDim.x * step) {
        const int nt = min(step, s.num_tokens - t0);
        __syncthreads(); /* the wait above, or the last step's readers of the tables */
        for (int i = threadIdx.x; i < nt * k; i += blockDim.x) {
            const int idx = t0 * k + i, e = s.topk_ids[idx];
            const bool ok = e >= 0 && e < s.num_experts; /* else the row was left out (reported) */
            at_s[i / k][i % k] = ok ? send_offset[e] + s.pos[idx] : -1;
            w_s[i / k][i % k] = ok ? s.weights[idx] : 0.0f;
        }
        __syncthreads();
        const int items = nt * vecs;
        for (int a = threadIdx.x; a < items; a += 2 * blockDim.x) {
            const int b = a + blockDim.x, ta = a / vecs, va = a % vecs, tb = b / vecs, vb = b % vecs;
            const bool two = b < items;
            float acc_a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc_b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            /* With TP, choice j has tp partial rows (slots at * tp + c): summed c by c. */
            for (int c = 0; c < s.tp; c++) {
                uint4 xa[COMETI_COMBINE_MAX_TOP_K], xb[COMETI_COMBINE_MAX_TOP_K];
#pragma unroll
                for (int j = 0; j < COMETI_COMBINE_MAX_TOP_K; j++) {
                    if (j >= k) break;
                    const int at_a = at_s[ta][j], at_b = two ? at_s[tb][j] : -1;
                    xa[j] = at_a >= 0 ? __ldcg((const uint4 *)(slots + ((size_t)at_a * s.tp + c) * s.hidden) + va)
                                      : make_uint4(0, 0, 0, 0);
                    xb[j] = at_b >= 0 ? __ldcg((const uint4 *)(slots + ((size_t)at_b * s.tp + c) * s.hidden) + vb)
                                      : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < COMETI_COMBINE_MAX_TOP_K; j++) {
                    if (j >= k) break;
                    add_bf16x8(acc_a, xa[j], w_s[ta][j]); /* combine.cuh */
                    if (two) add_bf16x8(acc_b, xb[j], w_s[tb][j]);
                }
            }
            ((uint4 *)((__nv_bfloat16 *)s.y + (size_t)(t0 + ta) * s.hidden))[va] = pack_bf16x8(acc_a);
            if (two) ((uint4 *)((__nv_bfloat16 *)s.y + (size_t)(t0 + tb) * s.hidden))[vb] = pack_bf16x8(acc_b);
        }
    }
    /* The last block out advances the total for the next call (every block has read it). */
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(s.done, 1u) == gridDim.x - 1) {
            __threadfence(); /* every block's read of the total is before this write */
            *s.expected += per_call;
            *s.done = 0;
        }
    }
}

extern "C" void cometi_push_sum_plan(cometi_push_sum_t *s, int sm_count, unsigned int *blocks_out)
{
    /* Steps of about SUM_READS chunks, but small enough for two blocks per SM where the
     * tokens allow (a few tokens with big steps would leave SMs idle); enough blocks to fill
     * the GPU a few times over, at least one (it advances the total). */
    const int fill = (int)(((int64_t)s->num_tokens + 2 * sm_count - 1) / (2 * sm_count));
    const int step = max(1, min(sum_step_tokens(s->hidden / 8, s->top_k), fill));
    s->step = step;
    size_t blocks = ((size_t)s->num_tokens + step - 1) / step;
    if (blocks > (size_t)sm_count * 4) blocks = (size_t)sm_count * 4;
    if (blocks < 1) blocks = 1;
    *blocks_out = (unsigned int)blocks;
}

extern "C" cudaError_t cometi_launch_push_sum(const cometi_push_sum_t *s, unsigned int blocks,
                                              cometi_async_error_t *async_err, unsigned long long timeout_ns,
                                              cudaStream_t stream)
{
    if (s->step < 1 || s->step > SUM_MAX_TOKENS) return cudaErrorInvalidValue; /* not planned */
    push_sum_kernel<<<blocks, SUM_THREADS, 0, stream>>>(*s, async_err, timeout_ns);
    return cudaGetLastError();
}

/* One thread per received row: the segment that holds it (segments are in row order; an
 * empty one shares its start with the next, and the search takes the last), then the
 * source whose part of the segment holds it (local first, then rank + 1, ...). */
static __global__ void push_dest_kernel(const cometi_combine_t c, const cometi_segment_t *segs, int groups,
                                        int64_t max_rows, const int32_t *used_rows, int2 *dest)
{
    const int E = c.num_experts;
    const int64_t rows = *used_rows < max_rows ? *used_rows : max_rows; /* past them: nothing the GEMM reads */
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x) {
        int lo = 0, hi = groups - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (segs[mid].start <= r) lo = mid;
            else hi = mid - 1;
        }
        int2 d = make_int2(-1, 0);
        const int64_t q = r - segs[lo].start;
        if (q >= 0 && q < segs[lo].rows) {
            const int e = c.rank / c.tp * c.experts_per_group + lo;
            int64_t slot = 0;
            const int s = cometi_push_slot(c.plan.counts, c.plan.send_offset, c.plan.recv_offset, c.world, E, e, q, c.tp,
                                           c.rank % c.tp, c.rank, &slot);
            if (s >= 0) d = make_int2(s, (int)slot); /* this TP rank's partial: its own slot of the choice's tp */
        }
        dest[r] = d;
    }
}

extern "C" cudaError_t cometi_launch_push_dest(const cometi_combine_t *c, const cometi_segment_t *segs, int groups,
                                               int64_t rows, const int32_t *used_rows, void *dest, cudaStream_t stream)
{
    if (groups < 1 || rows < 1 || !used_rows || !dest || (uintptr_t)dest % 8) return cudaErrorInvalidValue;
    const int64_t blocks = (rows + 255) / 256;
    push_dest_kernel<<<(unsigned int)(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(*c, segs, groups, rows,
                                                                                           used_rows, (int2 *)dest);
    return cudaGetLastError();
}
