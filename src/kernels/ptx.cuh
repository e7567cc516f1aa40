/*
 * ptx.cuh - the PTX wrappers comet's kernels share: system-scope acquire and release
 * for flags another GPU touches, the global timer, and the timed wait every kernel
 * uses instead of a bare spin. All as asm volatile with a "memory" clobber so the
 * compiler neither caches nor reorders them.
 */
#ifndef COMET_PTX_CUH
#define COMET_PTX_CUH

#include "../internal.h"

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

/*
 * Spin until *flag >= expected (acquire, system scope), backing off with nanosleep.
 * Gives up, records COMET_TIMEOUT and returns 0 after timeout_ns, or soon after another
 * wait of this communicator has failed (so one dead peer costs one timeout, not one per
 * waiting block). The failure word is in host memory, so it is read only once a wait
 * has lasted 1 ms: polling it over PCIe from many SMs slows everything (docs/PERF.md).
 * Returns 1 when the flag arrived.
 */
static __device__ int cometi_wait_geq(const unsigned long long *flag, unsigned long long expected,
                                      unsigned long long timeout_ns, cometi_async_error_t *err,
                                      int site, int peer, int slot)
{
    unsigned long long start = cometi_globaltimer_ns();
    unsigned int backoff = 32;
    for (;;) {
        unsigned long long v = cometi_ld_acquire_sys(flag);
        if (v >= expected) return 1;
        unsigned long long waited = cometi_globaltimer_ns() - start;
        if (waited > 1000000 && *(volatile int *)&err->status != 0) return 0;
        if (waited > timeout_ns) {
            cometi_record_error(err, COMET_TIMEOUT, site, peer, slot, expected, v, waited);
            return 0;
        }
        __nanosleep(backoff);
        if (backoff < 2048) backoff *= 2;
    }
}

#endif /* COMET_PTX_CUH */
