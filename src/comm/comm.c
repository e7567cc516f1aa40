/*
 * comm.c - the communicator: a caller's NCCL communicator (or one made from a unique
 * id), the control window in symmetric memory, and the host-mapped word where kernels
 * report a wait that timed out.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "base/params.h"

/* The driver's current-context calls, through the runtime (nothing links libcuda: the
 * tests must start where no driver is installed). */
static PFN_cuCtxGetCurrent_v4000 ctx_get;
static PFN_cuCtxSetCurrent_v4000 ctx_set;
static pthread_once_t ctx_calls_once = PTHREAD_ONCE_INIT;

static void load_ctx_calls_once(void)
{
    void *get = NULL, *set = NULL;
    enum cudaDriverEntryPointQueryResult q1, q2;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 4000, cudaEnableDefault, &q1) == cudaSuccess &&
        q1 == cudaDriverEntryPointSuccess &&
        cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 4000, cudaEnableDefault, &q2) == cudaSuccess &&
        q2 == cudaDriverEntryPointSuccess) {
        ctx_get = (PFN_cuCtxGetCurrent_v4000)get;
        ctx_set = (PFN_cuCtxSetCurrent_v4000)set;
    }
}

static comet_status_t load_ctx_calls(char *err)
{
    pthread_once(&ctx_calls_once, load_ctx_calls_once);
    if (!ctx_get || !ctx_set)
        return cometi_fail(err, COMET_CUDA_ERROR, "cuCtxGetCurrent and cuCtxSetCurrent are not available from the "
                           "driver");
    return COMET_SUCCESS;
}

comet_status_t cometi_context_enter(void *ctx, char *err, cometi_context_t *prev)
{
    CUcontext cur = NULL;
    prev->ctx = NULL, prev->bound = 0;
    CUresult r = ctx_get(&cur);
    if (r != CUDA_SUCCESS) return cometi_fail(err, COMET_CUDA_ERROR, "cuCtxGetCurrent failed: error %d", (int)r);
    if (cur == (CUcontext)ctx) return COMET_SUCCESS;
    r = ctx_set((CUcontext)ctx);
    if (r != CUDA_SUCCESS)
        return cometi_fail(err, COMET_CUDA_ERROR, "cuCtxSetCurrent(the communicator's context) failed: error %d",
                           (int)r);
    prev->ctx = cur, prev->bound = 1;
    return COMET_SUCCESS;
}

void cometi_context_leave(const cometi_context_t *prev)
{
    if (prev->bound) ctx_set((CUcontext)prev->ctx); /* NULL where the thread had none */
}

/* The config, and the environment (params.h): a malformed variable stops the create. */
static comet_status_t check_comm_config(const comet_comm_config_t *c, char *err)
{
    COMETI_TRY(cometi_params_load(err));
    if (!c) return COMET_SUCCESS;
    if (c->size != sizeof(comet_comm_config_t) || c->magic != COMET_STRUCT_MAGIC)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "comm config.size = %zu, config.magic = 0x%x: initialise "
                           "it with COMET_COMM_CONFIG_INIT", c->size, c->magic);
    if (c->version < 1 || c->version > COMET_API_VERSION)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "comm config.version = %u: this library knows 1..%d",
                           c->version, COMET_API_VERSION);
    if (c->timeout_ms < 0 || c->timeout_ms > 3600000) /* $COMET_TIMEOUT_MS's range too */
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "comm config.timeout_ms = %d: must be 0..3600000 (an hour; "
                           "0: the default, %d ms)", c->timeout_ms, COMETI_DEFAULT_TIMEOUT_MS);
    return COMET_SUCCESS;
}

/* A host-side barrier through NCCL: a one-element all-reduce, then a stream sync. */
static comet_status_t nccl_host_barrier(comet_comm_t comm)
{
    int *one = NULL;
    comet_status_t st;
    COMETI_TRY(cometi_cuda(comm->err, cudaMalloc((void **)&one, sizeof(int)), "cudaMalloc(barrier word)"));
    COMETI_TRY_GOTO(st, cometi_nccl(comm->err, ncclAllReduce(one, one, 1, ncclInt32, ncclSum, comm->nccl, 0),
                                    "ncclAllReduce (host barrier)"), out);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaStreamSynchronize(0), "host barrier sync"), out);
out:
    cudaFree(one);
    return st;
}

comet_status_t cometi_allgather_ints(comet_comm_t comm, const int *mine, int n, int *all)
{
    int *d = NULL;
    comet_status_t st;
    COMETI_TRY(cometi_cuda(comm->err, cudaMalloc((void **)&d, sizeof(int) * n * (comm->size + 1)),
                           "cudaMalloc(all-gather words)"));
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemcpy(d, mine, sizeof(int) * n, cudaMemcpyHostToDevice),
                                    "copy all-gather words"), out);
    COMETI_TRY_GOTO(st, cometi_nccl(comm->err, ncclAllGather(d, d + n, (size_t)n, ncclInt32, comm->nccl, 0),
                                    "ncclAllGather (host words)"), out);
    COMETI_TRY_GOTO(st, cometi_cuda(comm->err, cudaMemcpy(all, d + n, sizeof(int) * n * comm->size,
                                                          cudaMemcpyDeviceToHost), "copy all-gathered words"), out);
out:
    cudaFree(d);
    return st;
}

static void comm_free(comet_comm_t comm)
{
    if (comm->ctrl.local) cometi_window_destroy(comm, &comm->ctrl);
    cometi_devcomm_destroy(comm);
    if (comm->async_host) cudaFreeHost(comm->async_host);
    if (comm->owns_nccl && comm->nccl) ncclCommDestroy(comm->nccl);
    free(comm->abandoned); /* what is left in it is registered in the caller's communicator */
    free(comm);
}

static comet_status_t comm_init(comet_comm_t comm, const comet_comm_config_t *config)
{
    char *err = comm->err;
    int version = 0;
    COMETI_TRY(cometi_nccl(err, ncclGetVersion(&version), "ncclGetVersion"));
    if (version < 22800)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "NCCL %d.%d.%d is loaded; comet needs 2.28 or newer "
                           "(symmetric windows and the device API)", version / 10000, version / 100 % 100,
                           version % 100);
    COMETI_TRY(cometi_nccl(err, ncclCommUserRank(comm->nccl, &comm->rank), "ncclCommUserRank"));
    COMETI_TRY(cometi_nccl(err, ncclCommCount(comm->nccl, &comm->size), "ncclCommCount"));
    if (comm->size > COMETI_MAX_RANKS)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "%d ranks: comet runs inside one NVLink domain of at most %d",
                           comm->size, COMETI_MAX_RANKS);
    int nccl_dev = -1;
    COMETI_TRY(cometi_nccl(err, ncclCommCuDevice(comm->nccl, &nccl_dev), "ncclCommCuDevice"));
    COMETI_TRY(cometi_cuda(err, cudaGetDevice(&comm->device), "cudaGetDevice"));
    if (nccl_dev != comm->device)
        return cometi_fail(err, COMET_INVALID_USAGE, "the current CUDA device is %d but the NCCL communicator "
                           "lives on device %d; call cudaSetDevice(%d) first", comm->device, nccl_dev, nccl_dev);
    /* The context every call binds: the caller's current one (the device's primary one
     * unless it made its own). */
    COMETI_TRY(load_ctx_calls(err));
    CUresult cr = ctx_get((CUcontext *)&comm->ctx);
    if (cr == CUDA_SUCCESS && !comm->ctx) { /* none bound yet: the device's primary one */
        COMETI_TRY(cometi_cuda(err, cudaSetDevice(comm->device), "cudaSetDevice"));
        cr = ctx_get((CUcontext *)&comm->ctx);
    }
    if (cr != CUDA_SUCCESS || !comm->ctx)
        return cometi_fail(err, COMET_CUDA_ERROR, "cuCtxGetCurrent on device %d: error %d", comm->device, (int)cr);
    COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&comm->sm_count, cudaDevAttrMultiProcessorCount, comm->device),
                           "cudaDeviceGetAttribute(SM count)"));
    comm->timeout_ms = config && config->timeout_ms ? config->timeout_ms
                                                    : (int)cometi_param_int(COMETI_PARAM_TIMEOUT_MS);
    COMETI_TRY(cometi_cuda(err, cudaHostAlloc((void **)&comm->async_host, sizeof(cometi_async_error_t),
                                              cudaHostAllocMapped), "cudaHostAlloc(async error word)"));
    memset(comm->async_host, 0, sizeof(cometi_async_error_t));
    COMETI_TRY(cometi_cuda(err, cudaHostGetDevicePointer((void **)&comm->async_dev, comm->async_host, 0),
                           "cudaHostGetDevicePointer(async error word)"));
    /* NCCL's device API is compiled into comet's kernels: its structures change between
     * releases (2.28.3 headers against a 2.28.9 library fail in ncclDevCommCreate). A
     * process can load another libnccl.so.2 first, PyTorch's for one. */
    int nccl_runtime = 0;
    COMETI_TRY(cometi_nccl(err, ncclGetVersion(&nccl_runtime), "ncclGetVersion"));
    if (nccl_runtime != NCCL_VERSION_CODE)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "NCCL %d.%d.%d is loaded in this process, but comet was built "
                           "against NCCL %d.%d.%d headers, and its device API must match: rebuild comet against "
                           "the NCCL the process loads (make clean; make: where PyTorch is installed the build "
                           "takes the NCCL it loads; else make NCCL_HOME=<that NCCL>)",
                           nccl_runtime / 10000, nccl_runtime / 100 % 100, nccl_runtime % 100, NCCL_MAJOR, NCCL_MINOR,
                           NCCL_PATCH);
    COMETI_TRY(cometi_devcomm_create(comm));
    COMETI_TRY(cometi_window_create(comm, COMETI_CTRL_SLOTS * sizeof(unsigned long long), &comm->ctrl));
    COMETI_TRY(cometi_cuda(err, cudaMemset(comm->ctrl.local, 0, comm->ctrl.bytes), "clear control window"));
    COMETI_TRY(cometi_cuda(err, cudaDeviceSynchronize(), "clear control window"));
    /* No rank may raise a peer's flag before that peer has cleared its window. */
    return nccl_host_barrier(comm);
}

static comet_status_t comm_create(ncclComm_t nccl, int owns, const comet_comm_config_t *config,
                                  comet_comm_t *out)
{
    char *cerr = cometi_create_error_buffer();
    cerr[0] = '\0';
    comet_comm_t comm = calloc(1, sizeof(*comm));
    if (!comm) {
        if (owns) ncclCommDestroy(nccl);
        return cometi_fail(cerr, COMET_OUT_OF_MEMORY, "comet_comm_create: out of host memory");
    }
    comm->nccl = nccl;
    comm->owns_nccl = owns;
    comet_status_t st = comm_init(comm, config);
    if (st != COMET_SUCCESS) {
        snprintf(cerr, COMETI_ERR_LEN, "%s", comm->err);
        comm_free(comm);
        return st;
    }
    *out = comm;
    return COMET_SUCCESS;
}

comet_status_t comet_comm_create(ncclComm_t nccl, const comet_comm_config_t *config, comet_comm_t *out)
{
    char *cerr = cometi_create_error_buffer();
    if (!out) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_comm_create: out is NULL");
    *out = NULL;
    if (!nccl) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_comm_create: nccl communicator is NULL");
    COMETI_TRY(check_comm_config(config, cerr));
    return comm_create(nccl, 0, config, out);
}

comet_status_t comet_comm_create_from_id(const ncclUniqueId *id, int nranks, int rank,
                                         const comet_comm_config_t *config, comet_comm_t *out)
{
    char *cerr = cometi_create_error_buffer();
    if (!out) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_comm_create_from_id: out is NULL");
    *out = NULL;
    if (!id) return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "comet_comm_create_from_id: id is NULL");
    if (nranks < 1 || nranks > COMETI_MAX_RANKS)
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "nranks = %d: must be 1..%d", nranks, COMETI_MAX_RANKS);
    if (rank < 0 || rank >= nranks)
        return cometi_fail(cerr, COMET_INVALID_ARGUMENT, "rank = %d: must be 0..nranks-1 = %d", rank, nranks - 1);
    COMETI_TRY(check_comm_config(config, cerr));
    ncclComm_t nccl = NULL;
    ncclResult_t r = ncclCommInitRank(&nccl, nranks, *id, rank);
    if (r != ncclSuccess)
        return cometi_fail(cerr, COMET_NCCL_ERROR, "ncclCommInitRank(rank %d of %d): %s", rank, nranks,
                           ncclGetErrorString(r));
    return comm_create(nccl, 1, config, out);
}

static comet_status_t comm_destroy(comet_comm_t comm)
{
    comet_status_t st = cometi_cuda(comm->err, cudaDeviceSynchronize(), "comet_comm_destroy: device sync");
    /* Windows are deregistered collectively, so first make sure every rank is here, with a
     * device barrier that times out (an NCCL host barrier would wait forever for a rank
     * that failed and aborted). */
    comet_status_t barrier = COMET_SUCCESS;
    if (st == COMET_SUCCESS && comm->async_host->status == 0 && !comm->peers_lost) {
        barrier = cometi_barrier_sync(comm, "comet_comm_destroy: every rank here");
        if (barrier == COMET_SUCCESS) {
            comm_free(comm);
            return COMET_SUCCESS;
        }
    }
    /* A peer did not answer, so a collective here could hang: abort our own NCCL
     * communicator (that frees its windows), or, when the caller owns it, leave the
     * windows to the caller's ncclCommAbort. */
    if (comm->owns_nccl) {
        ncclCommAbort(comm->nccl);
        comm->nccl = NULL;
        /* The windows went with the abort; their memory is ours to free. */
        if (comm->ctrl.local) ncclMemFree(comm->ctrl.local);
        comm->ctrl.local = NULL;
        for (int i = 0; i < comm->n_abandoned; i++) ncclMemFree(comm->abandoned[i]);
        comm->n_abandoned = 0;
        free(comm->devcomm); /* the device side went with the abort */
        comm->devcomm = NULL;
    } else {
        comm->ctrl.local = NULL;
        comm->devcomm = NULL;
    }
    if (st == COMET_SUCCESS) st = cometi_check_async(comm);
    /* A barrier that failed without the device recording why (a launch error) still fails
     * the destroy, with the barrier's own message. */
    if (st == COMET_SUCCESS) st = barrier;
    if (st == COMET_SUCCESS && comm->peers_lost)
        st = cometi_fail(comm->err, COMET_REMOTE_ERROR, "comet_comm_destroy: a layer's destroy found a peer gone");
    /* The handle goes now: its message moves to where comet_last_create_error() reads. */
    snprintf(cometi_create_error_buffer(), COMETI_ERR_LEN, "%s", comm->err);
    comm_free(comm);
    return st;
}

comet_status_t comet_comm_destroy(comet_comm_t comm)
{
    if (!comm) return COMET_SUCCESS;
    cometi_context_t prev; /* if it cannot be bound, the destroy's own CUDA calls say so; it frees anyway */
    cometi_context_enter(comm->ctx, comm->err, &prev);
    comet_status_t st = comm_destroy(comm);
    cometi_context_leave(&prev);
    return st;
}

int comet_comm_rank(comet_comm_t comm) { return comm ? comm->rank : -1; }
int comet_comm_size(comet_comm_t comm) { return comm ? comm->size : -1; }
ncclComm_t comet_comm_nccl(comet_comm_t comm) { return comm ? comm->nccl : NULL; }
const char *comet_comm_last_error(comet_comm_t comm) { return comm ? comm->err : "comm is NULL"; }

static const char *site_name(int site)
{
    switch (site) {
    case COMETI_SITE_BARRIER: return "the cross-rank barrier";
    case COMETI_SITE_FLAG: return "a flag wait";
    case COMETI_SITE_ROUTE: return "the routing-count exchange";
    case COMETI_SITE_ARRIVAL: return "a GEMM tile waiting for its token rows";
    case COMETI_SITE_COMBINE: return "the combine waiting for its tokens' rows of a column split";
    case COMETI_SITE_PUSH: return "the push's sum waiting for its tokens' rows to come home";
    case COMETI_SITE_GEMM: return "a GEMM pipeline wait (a bug in comet)";
    default: return "a device wait";
    }
}

void cometi_call_text(unsigned long long id, char *out, size_t len)
{
    if (id == 0) snprintf(out, len, "an inference forward");
    else if (id >= COMETI_CALL_TRAIN_FORWARD)
        snprintf(out, len, "a training forward with max_recv_rows = %llu (mod 2^31)", id - COMETI_CALL_TRAIN_FORWARD);
    else snprintf(out, len, "the backward of training forward %llu", id);
}

comet_status_t cometi_check_async(comet_comm_t comm)
{
    volatile cometi_async_error_t *e = comm->async_host;
    int status = e->status;
    if (status == 0 && e->id_reported) {
        comet_status_t st = cometi_fail(comm->err, COMET_INVALID_ARGUMENT, "rank %d: topk_ids entry %d (token * top_k "
                                        "+ choice) = %lld: expert ids must be in [0, num_experts = %lld); that row was "
                                        "left out", e->id_rank, e->id_index, e->id_value, e->id_limit);
        e->id_reported = 0; /* reported once; the next bad id is reported again */
        e->id_claim = 0;
        return st;
    }
    if (status == 0) return COMET_SUCCESS;
    if (e->site == COMETI_SITE_SAVED_BOUND)
        return cometi_fail(comm->err, (comet_status_t)status, "rank %d: a training forward routed %llu rows to the "
                           "ranks of EP group %d, more than the saved state's max_recv_rows = %llu, so it may not "
                           "have kept them all (the sequential path refuses such a call). Create saved states with "
                           "a larger bound (0: the worst case). The communicator is unusable now: destroy it",
                           comm->rank, e->seen, e->peer, e->expected);
    if (e->site == COMETI_SITE_CALL_MISMATCH) {
        char there[96], here[96];
        cometi_call_text(e->seen, there, sizeof(there));
        cometi_call_text(e->expected, here, sizeof(here));
        return cometi_fail(comm->err, (comet_status_t)status, "rank %d: the routing-count exchange found rank %d in "
                           "another call: %s there, %s here. Every rank makes the same calls in the same order: "
                           "the backward of the same forward call (the same layer's, the same step's saved state), "
                           "saved states of the same max_recv_rows. Nothing was sent. The communicator is unusable "
                           "now: destroy it", comm->rank, e->peer, there, here);
    }
    if (e->site == COMETI_SITE_WGRAD_SEGMENT)
        return cometi_fail(comm->err, (comet_status_t)status, "rank %d: an FP8 weight-gradient GEMM's group %d starts "
                           "at row %llu, not a multiple of %llu: its token blocks' scales do not line up, so its sums "
                           "are wrong (a bug in comet)", comm->rank, e->peer, e->seen, e->expected);
    char who[48] = "";
    if (e->peer >= 0) snprintf(who, sizeof(who), " on rank %d", e->peer);
    return cometi_fail(comm->err, (comet_status_t)status,
                       "rank %d: %s (slot %d) waited %.1f ms%s for value %llu and saw %llu; the limit is "
                       "timeout_ms = %d. The communicator is unusable now: destroy it",
                       comm->rank, site_name(e->site), e->slot, e->waited_ns / 1e6, who, e->expected, e->seen,
                       comm->timeout_ms);
}

comet_status_t cometi_check_sticky(comet_comm_t comm)
{
    return comm->async_host->status != 0 ? cometi_check_async(comm) : COMET_SUCCESS;
}

comet_status_t comet_comm_get_async_error(comet_comm_t comm)
{
    if (!comm)
        return cometi_fail(cometi_create_error_buffer(), COMET_INVALID_ARGUMENT,
                           "comet_comm_get_async_error: comm is NULL");
    return cometi_check_async(comm);
}
