/*
 * internal.h - what the library's C files share: the handle structs, error helpers
 * and the entry points of the CUDA files (which are written in C style and export
 * C symbols). Internal non-static names start with cometi_.
 */
#ifndef COMET_INTERNAL_H
#define COMET_INTERNAL_H

#include <stdarg.h>
#include <stdint.h>
#include <stddef.h>

#include "comet.h"
#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

#define COMETI_ERR_LEN 512
/* One NVLink node: NVL72 is the largest domain where every rank is load/store reachable. */
#define COMETI_MAX_RANKS 72
#define COMETI_MAX_EXPERTS 1024 /* config.num_experts (the dispatch's piece table holds this many) */
#define COMETI_DEFAULT_TIMEOUT_MS 5000

/* Record a formatted message in `err` (COMETI_ERR_LEN bytes) and return `status`. */
comet_status_t cometi_fail(char *err, comet_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Same, for a failed CUDA runtime call; cudaSuccess returns COMET_SUCCESS untouched. */
comet_status_t cometi_cuda(char *err, cudaError_t e, const char *what);
comet_status_t cometi_nccl(char *err, ncclResult_t r, const char *what);

/* Launch settings for a kernel that may start before the kernel ahead of it in the stream
 * has ended (programmatic dependent launch): it must call cometi_grid_wait() (ptx.cuh)
 * before it reads what that kernel wrote. attr: room for one attribute. COMET_PDL=0 in
 * the environment (params.h) launches such kernels the ordinary way. */
int cometi_pdl_enabled(void);
static inline cudaLaunchConfig_t cometi_pdl_config(unsigned int grid, unsigned int block, size_t smem,
                                                   cudaStream_t stream, cudaLaunchAttribute *attr)
{
    cudaLaunchConfig_t cfg; /* every field set below */
    cfg.gridDim.x = grid, cfg.gridDim.y = cfg.gridDim.z = 1;
    cfg.blockDim.x = block, cfg.blockDim.y = cfg.blockDim.z = 1;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cometi_pdl_enabled() ? 1 : 0;
    return cfg;
}

/* Pass a failure up, keeping the message already written. */
#define COMETI_TRY(expr)                                                                   \
    do {                                                                                   \
        comet_status_t try_status_ = (expr);                                               \
        if (try_status_ != COMET_SUCCESS) return try_status_;                              \
    } while (0)
/* Pass a failure to a cleanup label; the status is kept in `st`. */
#define COMETI_TRY_GOTO(st, expr, label)                                                   \
    do {                                                                                   \
        (st) = (expr);                                                                     \
        if ((st) != COMET_SUCCESS) goto label;                                             \
    } while (0)

/* Where a device-side wait gave up; the first failure wins, later ones are dropped. */
typedef enum cometi_wait_site {
    COMETI_SITE_NONE = 0,
    COMETI_SITE_BARRIER = 1,   /* cross-rank barrier: a peer did not arrive */
    COMETI_SITE_FLAG = 2,      /* a flag in symmetric memory was never raised */
    COMETI_SITE_GEMM = 3,      /* a GEMM pipeline stage never filled or drained (a bug) */
    COMETI_SITE_ROUTE = 4,     /* the routing-count exchange: a peer's counts never came */
    COMETI_SITE_ARRIVAL = 5,   /* a GEMM tile's token rows never all arrived */
    COMETI_SITE_COMBINE = 6,   /* layer1: a column split's rows never all came home */
    COMETI_SITE_PUSH = 7,      /* layer1's push: its tokens' rows never all came home */
    COMETI_SITE_SAVED_BOUND = 8, /* a fused training forward routed more rows to an EP group
                                  * than its saved state's bound (expected: max_recv_rows,
                                  * seen: the rows, peer: the group) */
    COMETI_SITE_CALL_MISMATCH = 9, /* the route found ranks in different calls: a backward of
                                    * another forward call, or a forward beside a backward
                                    * (expected: this rank's call id, seen: rank peer's) */
} cometi_wait_site_t;

/* The route's call ids (cometi_route_dev_run), which every rank of a call must share: 0 an
 * inference forward; COMETI_CALL_TRAIN_FORWARD + (the saved state's max_recv_rows mod
 * 2^31) a training forward; 1 .. 2^31 - 1 the backward of the training forward of that
 * number (comet_moe.train_calls). */
#define COMETI_CALL_TRAIN_FORWARD 0x80000000u
/* A call id in words ("an inference forward", ...), for the messages of both paths. */
void cometi_call_text(unsigned long long id, char *out, size_t len);

/* Written by kernels into host-mapped memory, read by the host without a sync. */
typedef struct cometi_async_error {
    int status; /* comet_status_t; 0 while nothing failed; written last */
    int claim;  /* taken by the first failing thread */
    int site;   /* cometi_wait_site_t */
    int peer;   /* rank waited on, -1 if not one rank */
    int slot;   /* which flag */
    unsigned long long expected, seen, waited_ns;
    /* An expert id out of range: reported once by the next check, then cleared (not fatal:
     * that row is left out and the communicator stays usable). */
    int id_reported, id_claim, id_rank, id_index;
    long long id_value, id_limit;
} cometi_async_error_t;

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

struct cometi_baseline;
struct cometi_fused;

struct comet_moe {
    comet_comm_t comm;
    comet_moe_config_t cfg;
    int ep, tp, experts_per_rank, first_expert;
    int ffn_local;                    /* ffn / tp: the columns of each expert this rank holds */
    int64_t max_recv_rows;            /* worst-case padded rows landing on this rank */
    char err[COMETI_ERR_LEN];
    struct cometi_baseline *baseline; /* the sequential path's buffers, made by its first call, or NULL */
    struct cometi_fused *fused;       /* layer0 + layer1, made by the first fused call, or NULL */
    int fused_unsupported;            /* the config cannot run fused (AUTO runs the baseline) */
    unsigned int train_calls;         /* training forwards so far, 1 .. 2^31 - 1 once one ran: each
                                       * saved state's call id, the same on every rank */
    cudaEvent_t *marks;               /* COMETI_NUM_MARKS events, or NULL: phase timing */
};

/* What a training forward keeps for its backward (comet.h's comet_moe_saved_t); the
 * sequential path fills it and reads it. */
enum { COMETI_SAVED_SEQUENTIAL = 1, COMETI_SAVED_FUSED = 2 };

struct comet_moe_saved {
    comet_moe_t moe;
    void *ctx;                   /* its layer's CUDA context (destroy may come after the layer's) */
    int64_t max_recv_rows;       /* the bound: (token, choice) rows received, padding excluded */
    int64_t cap_rows;            /* rows allocated: the bound and a 128-row block of padding per local expert */
    int filled;                  /* a training forward filled it, nothing failed after, and no
                                  * backward has consumed it */
    int path;                    /* COMETI_SAVED_*: the path that filled it (its backward runs it) */
    void *memory;                /* the one device block the arrays below are carved from */
    int owned;                   /* allocated by comet_moe_saved_create (else the caller's) */
    int num_tokens;
    unsigned int call;           /* its forward's number (comet_moe.train_calls), the backward's
                                  * call id, which every rank's must match */
    void *recv;                  /* [cap_rows][H] bf16: x rows received, in the plan's layout; NULL
                                  * where the config resends x (the backward sends it again) */
    void *h;                     /* [cap_rows][2 Fl] bf16: their gate and up projections (the fused
                                  * backward turns them into their gradients in place) */
    int32_t *send_pos;           /* [max_tokens x k] each choice's place in the send order (-1: an
                                  * expert id out of range, no row) */
    int32_t *ids;                /* [max_tokens x k] the forward's topk_ids (fused: its route again) */
    float *weights;              /* [max_tokens x k] the forward's topk_weights */
    cometi_segment_t *segs;      /* [E_local] device: this rank's segments */
    cometi_segment_t *segs_host; /* [E_local] */
    int max_seg_rows;
    cometi_a2a_msg_t *sends, *recvs; /* the dispatch's NCCL messages (host); the return trip swaps them */
    int n_sends, n_recvs;
};

/* The sequential path's buffers and cuBLAS handle, allocated by the first call that runs
 * it on this layer (moe.c), after the ranks compare their configs (collective): a layer
 * that only runs fused never pays for them. */
comet_status_t cometi_moe_baseline(comet_moe_t moe, struct cometi_baseline **out);

/* A forward's arguments checked (moe.c): COMET_INVALID_ARGUMENT naming the field. */
comet_status_t cometi_moe_check_args(comet_moe_t moe, const comet_moe_args_t *args);

/* Benchmarks: record the baseline's phase boundaries into `marks` (NULL: stop). */
void cometi_moe_set_marks(comet_moe_t moe, cudaEvent_t *marks);

/* Benchmarks: the fused backward's grouped GEMMs alone, every SM, no communication, on the
 * rows args->saved holds (a fused training forward's; COMET_INVALID_ARGUMENT for another):
 * those of `mask` (0: all), bit 0 the dgrad of W2, 1 the dgrad of W13, 2 dW2, 3 dW13.
 * Outputs go to the backward's workspaces and args->grads. */
comet_status_t cometi_moe_backward_gemms(comet_moe_t moe, const comet_moe_backward_args_t *args, int mask,
                                         cudaStream_t stream);

/* ---- symmetric.cu ---- */
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
/* ---- config.c ---- */
/* The thread's buffer for messages of failed *_create calls (no handle to hold them). */
char *cometi_create_error_buffer(void);

/* ---- comm.c ---- */
/* Collective, host-blocking: all[r * n + i] = rank r's mine[i]. For set-up agreements. */
comet_status_t cometi_allgather_ints(comet_comm_t comm, const int *mine, int n, int *all);
/* Turn a recorded device-side failure into a status and a message in comm->err. */
comet_status_t cometi_check_async(comet_comm_t comm);
/* The same for the sticky failures alone (a failed wait, a saved bound exceeded), leaving
 * an expert id's one-time report to comet_comm_get_async_error: collective calls refuse
 * only on what every rank's later calls refuse too, or one rank would step out alone. */
comet_status_t cometi_check_sticky(comet_comm_t comm);

/* Each public call that touches the device runs with its communicator's context (ctx)
 * current, whatever thread calls it: a framework's worker thread (torch's autograd one)
 * may have none bound, which the driver calls behind the tensor maps need, or another
 * device's. enter binds ctx and notes the thread's own in *prev; leave gives that back
 * (none, where the thread had none). */
typedef struct cometi_context {
    void *ctx; /* the thread's context before enter (NULL: none) */
    int bound; /* enter changed it */
} cometi_context_t;
comet_status_t cometi_context_enter(void *ctx, char *err, cometi_context_t *prev);
void cometi_context_leave(const cometi_context_t *prev);

#ifdef __cplusplus
}
#endif

#endif /* COMET_INTERNAL_H */
