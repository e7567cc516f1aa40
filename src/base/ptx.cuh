/*
 * ptx.cuh - the PTX wrappers comet's kernels share: system-scope acquire and release
 * for flags another GPU touches, the global timer, the timed wait every kernel uses
 * instead of a bare spin, and shared-memory barriers and bulk copies. All as asm
 * volatile with a "memory" clobber so the compiler neither caches nor reorders them; and
 * the GEMM's tensor copies, named barriers and wgmma bookkeeping.
 */
#ifndef COMET_PTX_CUH
#define COMET_PTX_CUH

#include <cuda.h>

#include "base/types.h"

static __device__ __forceinline__ unsigned long long cometi_ld_acquire_sys(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void cometi_st_release_sys(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ void cometi_red_release_sys_add(unsigned long long *p, unsigned long long v)
{
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* For readers on this GPU only (another block of this kernel, or a later kernel). */
static __device__ __forceinline__ void cometi_red_release_gpu_add(unsigned long long *p, unsigned long long v)
{
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Programmatic dependent launch: a kernel launched with programmatic stream serialization
 * may start before the kernel ahead of it ends; cometi_grid_wait() returns once that kernel
 * has ended and its writes are visible, and cometi_grid_launch_dependents() lets the next
 * such kernel start. Both are no-ops for a kernel launched the ordinary way. */
static __device__ __forceinline__ void cometi_grid_wait(void) { asm volatile("griddepcontrol.wait;" ::: "memory"); }
static __device__ __forceinline__ void cometi_grid_launch_dependents(void)
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

static __device__ __forceinline__ unsigned long long cometi_globaltimer_ns(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}

/* Record the first device-side failure of this communicator; later ones are dropped.
 * Fields are written before the status, so a host that sees the status sees them. */
static __device__ void cometi_record_error(cometi_async_error_t *err, int status, int site, int peer,
                                           int slot, unsigned long long expected, unsigned long long seen,
                                           unsigned long long waited_ns)
{
    if (atomicCAS(&err->claim, 0, 1) != 0) return;
    err->site = site;
    err->peer = peer;
    err->slot = slot;
    err->expected = expected;
    err->seen = seen;
    err->waited_ns = waited_ns;
    __threadfence_system();
    *(volatile int *)&err->status = status;
    __threadfence_system();
}

/* Whether another wait of this communicator has already failed. The word is in host
 * memory, so it is read only once a wait has lasted 1 ms, and then once per ms: polling
 * it over PCIe from many SMs slowed the whole pipeline 700-fold. *next_poll_ns starts at 0. */
static __device__ __forceinline__ int cometi_other_wait_failed(const cometi_async_error_t *err,
                                                               unsigned long long waited_ns,
                                                               unsigned long long *next_poll_ns)
{
    if (waited_ns < 1000000 || waited_ns < *next_poll_ns) return 0;
    *next_poll_ns = waited_ns + 1000000;
    return *(const volatile int *)&err->status != 0;
}

/*
 * Spin on a 64-bit word (acquire, system scope), backing off with nanosleep, until it
 * is met: with tag_high 0, word >= expected (a counter or flag); with tag_high 1, the
 * word's high 32 bits equal expected (a value and the call it belongs to, written whole by
 * one 8-byte release store, so no flag follows it). Gives up, records COMET_TIMEOUT
 * (seen: the word, or its tag) and returns 0 after timeout_ns, or soon after another wait
 * of this communicator has failed (so one dead peer costs one timeout, not one per
 * waiting block; see cometi_other_wait_failed). Returns 1 with the word in *word (if not
 * NULL) when it was met.
 */
static __device__ __forceinline__ int cometi_wait_word(const unsigned long long *p, unsigned long long expected,
                                                       int tag_high, unsigned long long timeout_ns,
                                                       cometi_async_error_t *err, int site, int peer, int slot,
                                                       unsigned long long *word)
{
    unsigned long long start = cometi_globaltimer_ns(), next_poll = 0;
    unsigned int backoff = 32;
    for (;;) {
        const unsigned long long v = cometi_ld_acquire_sys(p), seen = tag_high ? v >> 32 : v;
        if (tag_high ? seen == expected : seen >= expected) {
            if (word) *word = v;
            return 1;
        }
        unsigned long long waited = cometi_globaltimer_ns() - start;
        if (cometi_other_wait_failed(err, waited, &next_poll)) return 0;
        if (waited > timeout_ns) {
            cometi_record_error(err, COMETI_ASYNC_TIMEOUT, site, peer, slot, expected, seen, waited);
            return 0;
        }
        __nanosleep(backoff);
        if (backoff < 256) backoff *= 2;
    }
}

/* Spin until *flag >= expected (cometi_wait_word). Returns 1 when it arrived, else 0. */
static __device__ int cometi_wait_geq(const unsigned long long *flag, unsigned long long expected,
                                      unsigned long long timeout_ns, cometi_async_error_t *err, int site, int peer,
                                      int slot)
{
    return cometi_wait_word(flag, expected, 0, timeout_ns, err, site, peer, slot, NULL);
}

/* Spin until the word's high 32 bits equal tag (cometi_wait_word). Returns 1 with the
 * word in *word, or 0. */
static __device__ int cometi_wait_tag(const unsigned long long *p, unsigned int tag, unsigned long long timeout_ns,
                                      cometi_async_error_t *err, int site, int peer, int slot,
                                      unsigned long long *word)
{
    return cometi_wait_word(p, tag, 1, timeout_ns, err, site, peer, slot, word);
}

/* ---- shared-memory barriers and bulk copies (the GEMM's pipeline, dispatch, combine) ---- */

static __device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
/* A float of shared memory through a generic pointer the compiler cannot place (a struct's
 * field): ld/st.shared, not the slower generic access. */
static __device__ __forceinline__ float lds_f32(const float *p)
{
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_u32(p)) : "memory");
    return v;
}
static __device__ __forceinline__ float4 lds_f32x4(const float *p) /* p 16-byte aligned */
{
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(smem_u32(p))
                 : "memory");
    return v;
}
static __device__ __forceinline__ void sts_f32(float *p, float v)
{
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(smem_u32(p)), "f"(v) : "memory");
}

static __device__ __forceinline__ void mbar_init(uint64_t *bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

static __device__ __forceinline__ int mbar_try_wait(uint32_t bar, uint32_t parity)
{
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return (int)ok;
}

/* Wait for the phase with this parity. A pipeline wait has no outside dependency, so
 * one that lasts past the timeout is a bug: report it and stop waiting, here and (once
 * the report is out) everywhere else, so the kernel ends quickly with garbage instead of
 * hanging. (Leaving with `exit` instead would make ptxas serialize the wgmmas.) */
static __device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity, cometi_async_error_t *err,
                                                 unsigned long long timeout_ns)
{
    uint32_t b = smem_u32(bar);
    if (mbar_try_wait(b, parity)) return;
    unsigned long long start = cometi_globaltimer_ns(), next_poll = 0;
    while (!mbar_try_wait(b, parity)) {
        unsigned long long waited = cometi_globaltimer_ns() - start;
        if (cometi_other_wait_failed(err, waited, &next_poll)) return;
        if (waited > timeout_ns) {
            cometi_record_error(err, COMETI_ASYNC_INTERNAL_ERROR, COMETI_SITE_GEMM, -1, (int)blockIdx.x, parity, 0, waited);
            return;
        }
    }
}

static __device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

static __device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

/* 4 bytes global to shared, asynchronously (cp.async through L1), zero where !ok (src is
 * then not read); and the arrival on an mbarrier, counted in its init, once this thread's
 * copies so far have landed: a producer warp stays stages ahead without holding the values
 * in registers. */
static __device__ __forceinline__ void cp_async_f32(float *dst, const float *src, bool ok)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"((uint64_t)src),
                 "r"(ok ? 4 : 0)
                 : "memory");
}
static __device__ __forceinline__ void cp_async_mbar_arrive(uint64_t *bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
static __device__ __forceinline__ void cp_async_wait_all(void) { asm volatile("cp.async.wait_all;" ::: "memory"); }

/* Whole rows: global to shared, completing on an mbarrier; shared to global, in a bulk group. */
static __device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"((uint64_t)src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

static __device__ __forceinline__ void bulk_store(void *dst, const void *src, uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"((uint64_t)dst), "r"(smem_u32(src)), "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void bulk_commit(void) { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
/* The stores issued so far have read their shared memory (it may be reused). */
static __device__ __forceinline__ void bulk_wait_read(void) { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
/* The stores issued so far are complete in global memory. */
static __device__ __forceinline__ void bulk_wait(void) { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

/* ---- tensor copies (TMA), named barriers, wgmma bookkeeping (the GEMM) ---- */

static __device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, int inner, int outer, uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(smem_u32(bar))
                 : "memory");
}

/* A box of a 3D tensor [outer2][outer][inner]: rows past `outer` come back as zeros. */
static __device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map, int inner, int outer, int outer2,
                                                   uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(outer2), "r"(smem_u32(bar))
                 : "memory");
}

static __device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, const void *src, int inner, int outer)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"((uint64_t)map), "r"(inner), "r"(outer), "r"(smem_u32(src))
                 : "memory");
}

/* A box into a 3D tensor; parts past its extents are not stored. */
static __device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, const void *src, int inner, int outer,
                                                    int outer2)
{
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];"
                 ::"l"((uint64_t)map), "r"(inner), "r"(outer), "r"(outer2), "r"(smem_u32(src))
                 : "memory");
}

/* Barrier for the 128 threads of one warpgroup (ids 1 and 2; 0 is __syncthreads). */
static __device__ __forceinline__ void warpgroup_sync(int id)
{
    asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

/* A named barrier for one warp (ids 3..10: consumer warp 0..7), a synchronizing operation
 * in PTX's memory model, which __syncwarp is not stated to be. */
static __device__ __forceinline__ void warp_bar_sync(int id) { asm volatile("bar.sync %0, 32;" ::"r"(id) : "memory"); }
/* Both consumer warpgroups of a cooperative tile (barrier 11: 1-2 are the warpgroups',
 * 3-10 the warps'). */
static __device__ __forceinline__ void consumers_sync(void) { asm volatile("bar.sync 11, 256;" ::: "memory"); }

/* Shared-memory matrix descriptors for 128-byte swizzled tiles, as a low word (the start
 * address in 16-byte units, bits 0-13, and the leading offset, bits 16-29) under a high
 * word that is the same for every tile here (8-row groups 1024 bytes apart, the SBO, and
 * the 128-byte swizzle). Moving a descriptor along its tile is an add to the low word: no
 * shared-memory address (under 228 KB) carries out of its 14 bits. */
#define COMETI_SMEM_DESC_HI (((uint32_t)(1024 >> 4)) | (1u << 30))
static __device__ __forceinline__ uint64_t smem_desc_at(uint32_t lo)
{
    return ((uint64_t)COMETI_SMEM_DESC_HI << 32) | lo;
}

/* The low word for a K-major tile: rows of 128 bytes, leading offset unused (1). */
static __device__ __forceinline__ uint32_t smem_desc_lo(const void *p)
{
    return (smem_u32(p) & 0x3ffff) >> 4 | 1u << 16;
}

/* The low word for an MN-major tile: rows of 128 bytes (64 elements of N) along K, and each
 * next 64 elements of N in a box of its own, `box_bytes` further (the leading offset). */
static __device__ __forceinline__ uint32_t smem_desc_mn_lo(const void *p, uint32_t box_bytes)
{
    return (smem_u32(p) & 0x3ffff) >> 4 | (box_bytes >> 4) << 16;
}

static __device__ __forceinline__ void wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> static __device__ __forceinline__ void wgmma_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#endif /* COMET_PTX_CUH */
