/*
 * comm.h - the communicator (comm.c) and its symmetric memory (symmetric.cu): NCCL, the
 * windows every rank loads from and stores to, the device barrier, the record of a failed
 * device-side wait.
 */
#ifndef COMET_COMM_COMM_H
#define COMET_COMM_COMM_H

#include "base/host.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Memory every rank allocates alike and every rank can load from and store to. */
typedef struct cometi_window {
    void *local;                   /* this rank's part (device pointer) */
    size_t bytes;                  /* size of each rank's part */
    ncclWindow_t nccl_win;         /* NCCL registration */
    void *peer[COMETI_MAX_RANKS];  /* rank r's part as mapped into this process */
} cometi_window_t;

/* Layout of the control window, in 64-bit slots. */
#define COMETI_CTRL_BARRIER 0                          /* [world]: slot p, raised by rank p */
#define COMETI_CTRL_FLAGS (COMETI_MAX_RANKS)           /* [64] general flags, for tests */
#define COMETI_CTRL_NFLAGS 64
#define COMETI_CTRL_SLOTS (COMETI_CTRL_FLAGS + COMETI_CTRL_NFLAGS)

struct comet_comm {
    ncclComm_t nccl;
    int owns_nccl;
    int rank, size, device, sm_count;
    void *ctx;                        /* CUcontext current at create (the device's primary one
                                       * unless the caller made its own), bound by each call */
    int timeout_ms;
    char err[COMETI_ERR_LEN];
    void *devcomm;                    /* ncclDevComm_t, owned by symmetric.cu */
    cometi_window_t ctrl;             /* barrier and flag slots */
    unsigned long long barrier_seq;   /* monotonic: never reset, so no reset kernel */
    cometi_async_error_t *async_host; /* pinned, mapped */
    cometi_async_error_t *async_dev;  /* the same memory as the device sees it */
    int peers_lost;                   /* a teardown found a peer gone: windows are no longer
                                       * deregistered (a collective that would hang); the
                                       * communicator's abort drops them */
    void **abandoned;                 /* the memory of those windows (ncclMemAlloc), freed
                                       * once our own communicator is aborted */
    int n_abandoned, cap_abandoned;
};

/* Create NCCL's device communicator and check that every rank is load/store reachable. */
comet_status_t cometi_devcomm_create(comet_comm_t comm);
void cometi_devcomm_destroy(comet_comm_t comm);
/* Collective: allocate `bytes` on every rank, register it, resolve every peer's address. */
comet_status_t cometi_window_create(comet_comm_t comm, size_t bytes, cometi_window_t *win);
void cometi_window_destroy(comet_comm_t comm, cometi_window_t *win);
/* Every rank waits until all have arrived; a missing peer gives COMET_TIMEOUT (async). */
comet_status_t cometi_barrier(comet_comm_t comm, cudaStream_t stream);
/* Host-blocking: finish this device's work, then wait until every rank has too (device
 * barrier). For set-up steps such as "every peer's window is cleared before anyone
 * writes into it". A missing peer gives COMET_TIMEOUT. */
comet_status_t cometi_barrier_sync(comet_comm_t comm, const char *what);
/* ---- comm.c ---- */
/* Collective, host-blocking: all[r * n + i] = rank r's mine[i]. For set-up agreements. */
comet_status_t cometi_allgather_ints(comet_comm_t comm, const int *mine, int n, int *all);
/* Turn a recorded device-side failure into a status and a message in comm->err. */
comet_status_t cometi_check_async(comet_comm_t comm);
/* The same for the sticky failures alone (a failed wait, a saved bound exceeded), leaving
 * an expert id's one-time report to comet_comm_get_async_error: collective calls refuse
 * only on what every rank's later calls refuse too, or one rank would step out alone. */
comet_status_t cometi_check_sticky(comet_comm_t comm);

#ifdef __cplusplus
}
#endif

#endif /* COMET_COMM_COMM_H */
