/*
 * symmetric.cu - symmetric memory over NCCL windows: NCCL's device communicator,
 * windows whose every rank's part is mapped into this process, and the cross-rank
 * barrier (with a timeout). Peer addresses are resolved once, when a window is made, so
 * later kernels take plain pointers (and TMA maps can be built on them).
 */
#include <string.h>

#include <nccl.h>
#include <nccl_device.h>

#include "comm/comm.h"
#include "base/ptx.cuh"

/* ---- device communicator ---- */

extern "C" comet_status_t cometi_devcomm_create(comet_comm_t comm)
{
    /* NCCL refuses a device communicator for a single rank (invalid usage, seen with
     * 2.28.9); one rank has no peers, so none is needed. */
    if (comm->size == 1) return COMET_SUCCESS;
    ncclTeam_t lsa = ncclTeamLsa(comm->nccl);
    if (lsa.nRanks != comm->size)
        return cometi_fail(comm->err, COMET_NOT_SUPPORTED,
                           "only %d of the %d ranks can load and store each other's memory (NVLink); "
                           "comet needs every rank in one NVLink domain", lsa.nRanks, comm->size);
    ncclDevComm_t *dev = (ncclDevComm_t *)calloc(1, sizeof(ncclDevComm_t));
    if (!dev) return cometi_fail(comm->err, COMET_OUT_OF_MEMORY, "ncclDevComm_t: out of host memory");
    ncclDevCommRequirements_t reqs;
    memset(&reqs, 0, sizeof(reqs));
    reqs.lsaMultimem = false; /* never NVLink multicast: it can take a shared host's GPUs down */
    comet_status_t st = cometi_nccl(comm->err, ncclDevCommCreate(comm->nccl, &reqs, dev), "ncclDevCommCreate");
    if (st != COMET_SUCCESS) {
        free(dev);
        return st;
    }
    comm->devcomm = dev;
    return COMET_SUCCESS;
}

extern "C" void cometi_devcomm_destroy(comet_comm_t comm)
{
    if (!comm->devcomm) return;
    ncclDevCommDestroy(comm->nccl, (ncclDevComm_t *)comm->devcomm);
    free(comm->devcomm);
    comm->devcomm = NULL;
}

/* ---- windows ---- */

/* One thread per rank: where that rank's part of the window is mapped here. The lsa
 * team size is written too, so the host can check the device sees what it expects. */
static __global__ void resolve_peers_kernel(ncclDevComm devcomm, ncclWindow_t win, int nranks, void **out,
                                            int *lsa_ranks)
{
    int p = threadIdx.x;
    if (p < nranks) out[p] = ncclGetPeerPointer(win, 0, p);
    if (p == 0) *lsa_ranks = ncclTeamLsa(devcomm).nRanks;
}

extern "C" comet_status_t cometi_window_create(comet_comm_t comm, size_t bytes, cometi_window_t *win)
{
    char *err = comm->err;
    memset(win, 0, sizeof(*win));
    bytes = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT * NCCL_WIN_REQUIRED_ALIGNMENT;
    if (comm->size == 1) { /* no peers: plain device memory is symmetric with itself */
        COMETI_TRY(cometi_cuda(err, cudaMalloc(&win->local, bytes), "cudaMalloc(single-rank window)"));
        win->bytes = bytes;
        win->peer[0] = win->local;
        return COMET_SUCCESS;
    }
    ncclResult_t r = ncclMemAlloc(&win->local, bytes);
    if (r != ncclSuccess) {
        win->local = NULL;
        return cometi_fail(err, COMET_OUT_OF_MEMORY, "ncclMemAlloc(%zu bytes) for a symmetric window: %s", bytes,
                           ncclGetErrorString(r));
    }
    win->bytes = bytes;
    comet_status_t st;
    void **peers_dev = NULL;
    int *lsa_dev = NULL;
    int lsa_ranks = 0;
    COMETI_TRY_GOTO(st, cometi_nccl(err, ncclCommWindowRegister(comm->nccl, win->local, bytes, &win->nccl_win,
                                                                NCCL_WIN_COLL_SYMMETRIC),
                                    "ncclCommWindowRegister"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMalloc((void **)&peers_dev, sizeof(void *) * comm->size + sizeof(int)),
                                    "cudaMalloc(peer table)"), fail);
    lsa_dev = (int *)(peers_dev + comm->size);
    resolve_peers_kernel<<<1, 96>>>(*(ncclDevComm_t *)comm->devcomm, win->nccl_win, comm->size, peers_dev, lsa_dev);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaGetLastError(), "launch resolve_peers_kernel"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMemcpy(win->peer, peers_dev, sizeof(void *) * comm->size,
                                                    cudaMemcpyDeviceToHost), "read peer table"), fail);
    COMETI_TRY_GOTO(st, cometi_cuda(err, cudaMemcpy(&lsa_ranks, lsa_dev, sizeof(int), cudaMemcpyDeviceToHost),
                                    "read lsa size"), fail);
    /* This rank reaches its own part through its own address, not NCCL's second mapping of
     * it: writes and reads of one location then go through one virtual address (no
     * proxy-alias fence needed). */
    win->peer[comm->rank] = win->local;
    if (lsa_ranks != comm->size) {
        st = cometi_fail(err, COMET_NOT_SUPPORTED, "the device communicator's NVLink team has %d ranks, not %d",
                         lsa_ranks, comm->size);
        goto fail;
    }
    cudaFree(peers_dev);
    return COMET_SUCCESS;
fail:
    cudaFree(peers_dev);
    cometi_window_destroy(comm, win);
    return st;
}

extern "C" void cometi_window_destroy(comet_comm_t comm, cometi_window_t *win)
{
    /* Deregistering is collective: with a peer gone it would wait forever. The window is
     * then left to the communicator's abort, and its memory kept to free after it
     * (comet_comm_destroy); if even the list cannot grow, the memory stays allocated. */
    if (comm->peers_lost && comm->size > 1) {
        if (win->local && comm->n_abandoned == comm->cap_abandoned) {
            const int cap = comm->cap_abandoned ? 2 * comm->cap_abandoned : 8;
            void **grown = (void **)realloc(comm->abandoned, (size_t)cap * sizeof(void *));
            if (grown) comm->abandoned = grown, comm->cap_abandoned = cap;
        }
        if (win->local && comm->n_abandoned < comm->cap_abandoned) comm->abandoned[comm->n_abandoned++] = win->local;
        memset(win, 0, sizeof(*win));
        return;
    }
    if (win->nccl_win) {
        const ncclResult_t r = ncclCommWindowDeregister(comm->nccl, win->nccl_win);
        if (r != ncclSuccess) /* nothing to return: teardown goes on, the reason is kept */
            snprintf(comm->err, COMETI_ERR_LEN, "ncclCommWindowDeregister: %s", ncclGetErrorString(r));
    }
    if (win->local && comm->size == 1) cudaFree(win->local);
    else if (win->local) ncclMemFree(win->local);
    memset(win, 0, sizeof(*win));
}

/* ---- the barrier ---- */

typedef struct peer_slots {
    unsigned long long *ctrl[COMETI_MAX_RANKS]; /* each rank's control window, as mapped here */
} peer_slots_t;

/* Thread p tells rank p that this rank arrived, then waits until rank p has too. */
static __global__ void barrier_kernel(peer_slots_t peers, unsigned long long *mine, int rank, int nranks,
                                      unsigned long long seq, unsigned long long timeout_ns,
                                      cometi_async_error_t *err)
{
    int p = threadIdx.x;
    if (p >= nranks) return;
    __threadfence_system(); /* what this stream wrote before the barrier is visible to all first */
    cometi_st_release_sys(peers.ctrl[p] + COMETI_CTRL_BARRIER + rank, seq);
    cometi_wait_geq(mine + COMETI_CTRL_BARRIER + p, seq, timeout_ns, err, COMETI_SITE_BARRIER, p, p);
}

static unsigned long long timeout_ns(comet_comm_t comm) { return (unsigned long long)comm->timeout_ms * 1000000ull; }

extern "C" comet_status_t cometi_barrier(comet_comm_t comm, cudaStream_t stream)
{
    peer_slots_t peers;
    memset(&peers, 0, sizeof(peers));
    for (int p = 0; p < comm->size; p++) peers.ctrl[p] = (unsigned long long *)comm->ctrl.peer[p];
    unsigned long long seq = ++comm->barrier_seq;
    barrier_kernel<<<1, 96, 0, stream>>>(peers, (unsigned long long *)comm->ctrl.local, comm->rank, comm->size, seq,
                                         timeout_ns(comm), comm->async_dev);
    return cometi_cuda(comm->err, cudaGetLastError(), "launch barrier_kernel");
}

extern "C" comet_status_t cometi_barrier_sync(comet_comm_t comm, const char *what)
{
    COMETI_TRY(cometi_cuda(comm->err, cudaDeviceSynchronize(), what));
    COMETI_TRY(cometi_barrier(comm, 0));
    COMETI_TRY(cometi_cuda(comm->err, cudaDeviceSynchronize(), what));
    return cometi_check_sticky(comm); /* an expert id's report is no barrier failure */
}
