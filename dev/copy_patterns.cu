/*
 * copy_patterns.cu - what limits one SM's row copies: the dispatch's way (a bulk load per
 * row, a bulk store per 4 rows), its loads alone, its stores alone, and a token-major way
 * that loads each token's row once and stores it to each of its k places (the dispatch
 * reads x once per (token, choice) today). Also the 16-byte load/store path both ways.
 * Standalone (no NCCL): destination on this GPU or, with peer access, on GPU 1.
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a dev/copy_patterns.cu -lcublas -o build/copy_patterns
 *   build/copy_patterns [row_bytes]
 *
 * Prints, per pattern, destination and block count, the GB/s each block delivers (rows x
 * row bytes it wrote, or read for the loads-only pattern), median of 9 runs; alone, then
 * beside cuBLAS GEMMs (8192^3 bf16) on every GPU, the copy on a higher-priority stream so
 * its blocks take SMs as the GEMM's free up. Times are the blocks' own (global timer), so
 * a block that waited for an SM is not charged for it.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/base/row_copy.cuh"

#define CK(x)                                                                                                \
    do {                                                                                                     \
        cudaError_t e_ = (x);                                                                                \
        if (e_ != cudaSuccess) {                                                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));              \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

enum { P_BULK, P_BULK_LOADS, P_BULK_STORES, P_BULK_SYS, P_BULK_GPU, P_BULK_TOKENS, P_LSU, P_LSU_TOKENS, P_COUNT };
static const char *pattern_name[P_COUNT] = {"bulk rows (today)", "  its loads alone", "  its stores alone",
                                            "  + claim, sys count", "  + claim, gpu count", "bulk by token",
                                            "16-byte rows", "16-byte by token"};

#define SLOTS 12
#define GROUP 4
#define GROUPS (SLOTS / GROUP)
#define PIECE 128 /* rows between drains, as the dispatch's pieces */
#define WORKERS 2
#define THREADS 384
#define MAX_BLOCKS 16

typedef struct job {
    const unsigned char *x; /* tokens x row_bytes */
    unsigned char *dst;     /* rows x row_bytes */
    const int *src_of;      /* row -> token, rows in destination order */
    const int *pos;         /* token x k -> destination row */
    int rows, tokens, k, row_bytes;
    unsigned int *claims;         /* P_BULK_SYS / GPU: a counter every piece claims from, as the dispatch's */
    unsigned long long *arrive;   /* and 1024 counters beside the destination, one counted per piece */
} job_t;

static __device__ __forceinline__ uint32_t su32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
static __device__ __forceinline__ void mb_init(uint64_t *b)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su32(b)) : "memory");
}
static __device__ __forceinline__ void mb_expect(uint64_t *b, uint32_t n)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(b)), "r"(n) : "memory");
}
static __device__ __forceinline__ void mb_wait(uint64_t *b, uint32_t parity)
{
    uint32_t ok = 0;
    while (!ok)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok) : "r"(su32(b)), "r"(parity) : "memory");
}
static __device__ __forceinline__ void bload(void *d, const void *s, uint32_t n, uint64_t *b)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(su32(d)), "l"((uint64_t)s), "r"(n), "r"(su32(b)) : "memory");
}
static __device__ __forceinline__ void bstore(void *d, const void *s, uint32_t n)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"((uint64_t)d), "r"(su32(s)), "r"(n) : "memory");
}
static __device__ __forceinline__ void bcommit(void) { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> static __device__ __forceinline__ void bwait_read(void)
{
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
static __device__ __forceinline__ void bdrain(void)
{
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* Rows [lo, hi) in destination order, pieces of PIECE rows drained at their end, as
 * copy_piece_bulk does (loads: a group of GROUP rows into ring group g % GROUPS; its store
 * one group later). */
template <int P>
static __device__ void bulk_rows(const job_t *j, unsigned char *ring, uint64_t *full, uint32_t *parity, int lo, int hi)
{
    const uint32_t rb = j->row_bytes;
    for (int p0 = lo; p0 < hi; p0 += PIECE) {
        const int n = min(PIECE, hi - p0), groups = (n + GROUP - 1) / GROUP;
        for (int g = 0; g < groups + 1; g++) {
            if (g < groups) {
                const int s = g % GROUPS, rows = min(GROUP, n - g * GROUP);
                bwait_read<GROUPS - 2>();
                if (P != P_BULK_STORES) {
                    mb_expect(&full[s], rows * rb);
                    for (int i = 0; i < rows; i++)
                        bload(ring + (size_t)(s * GROUP + i) * rb, j->x + (size_t)j->src_of[p0 + g * GROUP + i] * rb, rb,
                              &full[s]);
                }
            }
            const int r = g - 1;
            if (r >= 0) {
                const int s = r % GROUPS, rows = min(GROUP, n - r * GROUP);
                if (P != P_BULK_STORES) {
                    mb_wait(&full[s], *parity >> s & 1);
                    *parity ^= 1u << s;
                }
                if (P != P_BULK_LOADS) {
                    bstore(j->dst + (size_t)(p0 + r * GROUP) * rb, ring + (size_t)s * GROUP * rb, rows * rb);
                    bcommit();
                }
            }
        }
        bdrain();
        if (P == P_BULK_SYS || P == P_BULK_GPU) {
            /* What the dispatch does per piece besides copying: claim the next one (its
             * index feeds the next piece's lookups), count this one's rows with a release. */
            const unsigned int c = atomicAdd(j->claims, 1u);
            unsigned long long *a = j->arrive + (p0 / PIECE + c) % 1024;
            const unsigned long long rows = (unsigned long long)n;
            if (P == P_BULK_SYS) asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(a), "l"(rows) : "memory");
            else asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(a), "l"(rows) : "memory");
        }
    }
}

/* Tokens [lo, hi): each row loaded once, then stored to its k places; drained every
 * PIECE / k tokens (as many rows between drains as bulk_rows). */
static __device__ void bulk_tokens(const job_t *j, unsigned char *ring, uint64_t *full, uint32_t *parity, int lo, int hi)
{
    const uint32_t rb = j->row_bytes;
    const int per_piece = max(1, PIECE / j->k);
    for (int t0 = lo; t0 < hi; t0 += per_piece) {
        const int n = min(per_piece, hi - t0), groups = (n + GROUP - 1) / GROUP;
        for (int g = 0; g < groups + 1; g++) {
            if (g < groups) {
                const int s = g % GROUPS, rows = min(GROUP, n - g * GROUP);
                bwait_read<GROUPS - 2>();
                mb_expect(&full[s], rows * rb);
                for (int i = 0; i < rows; i++)
                    bload(ring + (size_t)(s * GROUP + i) * rb, j->x + (size_t)(t0 + g * GROUP + i) * rb, rb, &full[s]);
            }
            const int r = g - 1;
            if (r >= 0) {
                const int s = r % GROUPS, rows = min(GROUP, n - r * GROUP);
                mb_wait(&full[s], *parity >> s & 1);
                *parity ^= 1u << s;
                for (int i = 0; i < rows; i++) {
                    const int t = t0 + r * GROUP + i;
                    for (int c = 0; c < j->k; c++)
                        bstore(j->dst + (size_t)j->pos[t * j->k + c] * rb, ring + (size_t)(s * GROUP + i) * rb, rb);
                }
                bcommit();
            }
        }
        bdrain();
    }
}

/* A warp per row, the dispatch's own 16-byte copy (copy_piece_stores). */
static __device__ void lsu_rows(const job_t *j, int lo, int hi, int warp, int warps)
{
    const int vecs = j->row_bytes / 16;
    for (int q = lo + warp; q < hi; q += warps)
        cometi_warp_copy_row((uint4 *)(j->dst + (size_t)q * j->row_bytes),
                             (const uint4 *)(j->x + (size_t)j->src_of[q] * j->row_bytes), vecs);
}

/* A warp per token: its row into registers once (up to 16 x 16 bytes per lane), then k stores. */
static __device__ void lsu_tokens(const job_t *j, int lo, int hi, int warp, int warps)
{
    const int lane = threadIdx.x % 32, vecs = j->row_bytes / 16;
    for (int t = lo + warp; t < hi; t += warps) {
        const uint4 *src = (const uint4 *)(j->x + (size_t)t * j->row_bytes);
        uint4 r[16];
#pragma unroll
        for (int u = 0; u < 16; u++) r[u] = src[min(lane + 32 * u, vecs - 1)];
        for (int c = 0; c < j->k; c++) {
            uint4 *o = (uint4 *)(j->dst + (size_t)j->pos[t * j->k + c] * j->row_bytes);
#pragma unroll
            for (int u = 0; u < 16; u++)
                if (lane + 32 * u < vecs) o[lane + 32 * u] = r[u];
        }
    }
}

static __device__ __forceinline__ unsigned long long now_ns(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}

template <int P> static __device__ void copy_body(job_t j);

/* Each block notes its start and end in stamps[4 * block]: global timer, then SM clock. */
template <int P> static __global__ void __launch_bounds__(THREADS, 1) copy_kernel(job_t j, unsigned long long *stamps)
{
    const long long c0 = clock64();
    if (threadIdx.x == 0) stamps[4 * blockIdx.x] = now_ns();
    copy_body<P>(j);
    __syncthreads();
    if (threadIdx.x == 0) {
        stamps[4 * blockIdx.x + 1] = now_ns();
        stamps[4 * blockIdx.x + 2] = (unsigned long long)(clock64() - c0);
    }
}

template <int P> static __device__ void copy_body(job_t j)
{
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    /* Every block gets the same share whatever their count: a sixteenth of the items. */
    const int by_token = P == P_BULK_TOKENS || P == P_LSU_TOKENS,
              n = (int)((long long)(by_token ? j.tokens : j.rows) * gridDim.x / MAX_BLOCKS);
    const int lo = (int)((long long)n * blockIdx.x / gridDim.x), hi = (int)((long long)n * (blockIdx.x + 1) / gridDim.x);
    if (P == P_LSU) return lsu_rows(&j, lo, hi, warp, THREADS / 32);
    if (P == P_LSU_TOKENS) return lsu_tokens(&j, lo, hi, warp, THREADS / 32);
    if (warp >= WORKERS || lane) return;
    uint64_t *full = (uint64_t *)smem + warp * GROUPS;
    unsigned char *ring = smem + 1024 + (size_t)warp * SLOTS * j.row_bytes;
    for (int s = 0; s < GROUPS; s++) mb_init(&full[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    uint32_t parity = 0;
    const int wlo = lo + (hi - lo) * warp / WORKERS, whi = lo + (hi - lo) * (warp + 1) / WORKERS;
    if (P == P_BULK_TOKENS) bulk_tokens(&j, ring, full, &parity, wlo, whi);
    else bulk_rows<P>(&j, ring, full, &parity, wlo, whi);
}

typedef void (*kernel_t)(job_t, unsigned long long *);
static kernel_t kernels[P_COUNT] = {copy_kernel<P_BULK>,     copy_kernel<P_BULK_LOADS>,  copy_kernel<P_BULK_STORES>,
                                    copy_kernel<P_BULK_SYS>, copy_kernel<P_BULK_GPU>,    copy_kernel<P_BULK_TOKENS>,
                                    copy_kernel<P_LSU>,      copy_kernel<P_LSU_TOKENS>};

static uint64_t rng = 88172645463325252ull;
static uint32_t next_u32(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t)rng; }

/* Random top-k routing of `tokens` over E experts: the rows in expert-major order (tokens
 * in order within an expert) and each (token, choice)'s row, as the receive buffer has them. */
static void route(int tokens, int E, int k, int *src_of, int *pos)
{
    int *ex = (int *)malloc(sizeof(int) * tokens * k), *start = (int *)calloc(E + 1, sizeof(int));
    for (int t = 0; t < tokens; t++)
        for (int c = 0; c < k; c++) {
            int e, dup;
            do {
                e = (int)(next_u32() % E), dup = 0;
                for (int d = 0; d < c; d++) dup |= ex[t * k + d] == e;
            } while (dup);
            ex[t * k + c] = e, start[e + 1]++;
        }
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    for (int t = 0; t < tokens; t++)
        for (int c = 0; c < k; c++) {
            const int row = start[ex[t * k + c]]++;
            pos[t * k + c] = row, src_of[row] = t;
        }
    free(ex), free(start);
}

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    const int row_bytes = argc > 1 ? atoi(argv[1]) : 7168, rows = 65536;
    if (row_bytes % 16 || row_bytes > 16 * 16 * 32 || row_bytes * SLOTS * WORKERS + 1024 > 227 * 1024) {
        fprintf(stderr, "row_bytes %d: a multiple of 16, at most 8192 (the token path's registers, the rings)\n", row_bytes);
        return 2;
    }
    int gpus = 0;
    CK(cudaGetDeviceCount(&gpus));
    int peer_ok = 0;
    if (gpus > 1) CK(cudaDeviceCanAccessPeer(&peer_ok, 0, 1));
    unsigned char *dst_peer = NULL;
    if (peer_ok) {
        CK(cudaSetDevice(1));
        CK(cudaMalloc(&dst_peer, (size_t)rows * row_bytes));
        CK(cudaSetDevice(0));
        CK(cudaDeviceEnablePeerAccess(1, 0));
    }
    const size_t smem = 1024 + (size_t)WORKERS * SLOTS * row_bytes;
    for (int p = 0; p < P_COUNT; p++) CK(cudaFuncSetAttribute(kernels[p], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int ks[2] = {8, 4}; /* every choice of a top-8 token; the 4 that go to one rank of two */
    unsigned char *x, *dst_local;
    int *src_of_d[2], *pos_d[2];
    CK(cudaMalloc(&x, (size_t)8192 * 2 * row_bytes));
    CK(cudaMemset(x, 1, (size_t)8192 * 2 * row_bytes));
    CK(cudaMalloc(&dst_local, (size_t)rows * row_bytes));
    for (int i = 0; i < 2; i++) {
        const int k = ks[i], tokens = rows / k;
        int *src_of = (int *)malloc(sizeof(int) * rows), *pos = (int *)malloc(sizeof(int) * rows);
        route(tokens, k == 8 ? 64 : 32, k, src_of, pos);
        CK(cudaMalloc(&src_of_d[i], sizeof(int) * rows));
        CK(cudaMalloc(&pos_d[i], sizeof(int) * rows));
        CK(cudaMemcpy(src_of_d[i], src_of, sizeof(int) * rows, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(pos_d[i], pos, sizeof(int) * rows, cudaMemcpyHostToDevice));
        free(src_of), free(pos);
    }
    unsigned long long *stamps_d, stamps[4 * MAX_BLOCKS];
    unsigned int *claims;
    unsigned long long *arrive[2] = {NULL, NULL};
    CK(cudaMalloc(&claims, sizeof(unsigned int)));
    CK(cudaMalloc(&arrive[0], 1024 * 8));
    if (peer_ok) {
        CK(cudaSetDevice(1));
        CK(cudaMalloc(&arrive[1], 1024 * 8));
        CK(cudaSetDevice(0));
    }
    CK(cudaMalloc(&stamps_d, sizeof(stamps)));
    /* The GEMMs beside: one handle and stream per GPU, C = A B on 8192^3 bf16 (garbage in). */
    const int G = 8192, gemms = 8;
    cublasHandle_t h[2];
    cudaStream_t gs[2], cs;
    void *ga[2], *gb[2], *gc[2];
    for (int g = 0; g < (peer_ok ? 2 : 1); g++) {
        CK(cudaSetDevice(g));
        CK(cudaStreamCreateWithFlags(&gs[g], cudaStreamNonBlocking));
        CK(cudaMalloc(&ga[g], (size_t)G * G * 2));
        CK(cudaMalloc(&gb[g], (size_t)G * G * 2));
        CK(cudaMalloc(&gc[g], (size_t)G * G * 2));
        CK(cudaMemset(ga[g], 0, (size_t)G * G * 2));
        CK(cudaMemset(gb[g], 0, (size_t)G * G * 2));
        if (cublasCreate(&h[g]) != CUBLAS_STATUS_SUCCESS || cublasSetStream(h[g], gs[g]) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublas setup failed\n");
            return 1;
        }
    }
    CK(cudaSetDevice(0));
    int lo_prio, hi_prio;
    CK(cudaDeviceGetStreamPriorityRange(&lo_prio, &hi_prio));
    CK(cudaStreamCreateWithPriority(&cs, cudaStreamNonBlocking, hi_prio));
    const float one = 1.0f, zero = 0.0f;
    const int block_counts[3] = {1, 8, MAX_BLOCKS};
    printf("row %d B, %d rows (65536 (token, choice) rows of 8192 tokens at k 8, 16384 at k 4); GB/s per block, median of 9;\n"
           "last column: bytes per SM clock at 8 blocks (clock64 over the block's span)\n",
           row_bytes, rows);
    for (int beside = 0; beside < 2; beside++) {
        printf("%s\n%-20s %-6s %2s %10s %10s %10s %10s\n", beside ? "beside cuBLAS GEMMs on every GPU:" : "alone:", "pattern",
               "dest", "k", "1 block", "8 blocks", "16 blocks", "B/clk (8)");
        for (int d = 0; d < (peer_ok ? 2 : 1); d++)
            for (int p = 0; p < P_COUNT; p++)
                for (int i = 0; i < 2; i++) {
                    const int by_token = p == P_BULK_TOKENS || p == P_LSU_TOKENS;
                    if (!by_token && i) continue; /* the row patterns do not depend on k */
                    job_t j = {x,     d ? dst_peer : dst_local, src_of_d[i], pos_d[i], rows, rows / ks[i], ks[i], row_bytes,
                               claims, arrive[d]};
                    float per_clock = 0;
                    printf("%-20s %-6s %2s", pattern_name[p], d ? "peer" : "local", by_token ? (i ? "4" : "8") : "-");
                    for (int bc = 0; bc < 3; bc++) {
                        const int blocks = block_counts[bc];
                        float gbs[9], bpc[9];
                        for (int it = -2; it < 9; it++) {
                            if (beside)
                                for (int g = 0; g < (peer_ok ? 2 : 1); g++) {
                                    CK(cudaSetDevice(g));
                                    for (int q = 0; q < gemms; q++)
                                        if (cublasGemmEx(h[g], CUBLAS_OP_N, CUBLAS_OP_N, G, G, G, &one, ga[g], CUDA_R_16BF, G,
                                                         gb[g], CUDA_R_16BF, G, &zero, gc[g], CUDA_R_16BF, G,
                                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
                                            fprintf(stderr, "cublasGemmEx failed\n");
                                            return 1;
                                        }
                                }
                            CK(cudaSetDevice(0));
                            if (beside) usleep(2000); /* the first GEMM under way */
                            kernels[p]<<<blocks, THREADS, smem, cs>>>(j, stamps_d);
                            CK(cudaGetLastError());
                            CK(cudaDeviceSynchronize());
                            if (peer_ok) {
                                CK(cudaSetDevice(1));
                                CK(cudaDeviceSynchronize());
                                CK(cudaSetDevice(0));
                            }
                            CK(cudaMemcpy(stamps, stamps_d, sizeof(stamps), cudaMemcpyDeviceToHost));
                            double sum = 0, sum_c = 0;
                            const double share = (double)rows / MAX_BLOCKS * row_bytes;
                            for (int q = 0; q < blocks; q++) {
                                sum += share / (double)(stamps[4 * q + 1] - stamps[4 * q]);
                                sum_c += share / (double)stamps[4 * q + 2];
                            }
                            if (it >= 0) gbs[it] = (float)(sum / blocks), bpc[it] = (float)(sum_c / blocks);
                        }
                        qsort(gbs, 9, sizeof(float), cmp_float);
                        qsort(bpc, 9, sizeof(float), cmp_float);
                        printf(" %10.1f", gbs[4]);
                        if (blocks == 8) per_clock = bpc[4];
                    }
                    printf(" %10.1f\n", per_clock);
                    fflush(stdout);
                }
    }
    return 0;
}
