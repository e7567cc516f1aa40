/*
 * rank.c - what every rank body of the tool does first: take its GPU and open its
 * communicator, telling "no usable GPU or NCCL" (exit code 3) apart from a run that
 * failed (1), so a machine without a driver reads "no GPU found", not a CUDA call's
 * error string. See tool.h.
 */
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "tool.h"

/* Print the failure as FAIL_IF does, and hand it to the launcher; returns `code`. */
static int failed(int code, const char *why)
{
    fprintf(stderr, "%s\n", why);
    cometi_rank_reason("%s", why);
    return code;
}

int rank_device(const cometi_rank_ctx_t *ctx)
{
    const cudaError_t e = cudaSetDevice(ctx->local_rank);
    if (e == cudaSuccess) return 0;
    char why[400];
    int visible = 0;
    if (cometi_no_gpu(e, why, sizeof(why))) return failed(TOOL_EXIT_NO_GPU, why);
    if (e == cudaErrorInvalidDevice && cudaGetDeviceCount(&visible) == cudaSuccess) {
        snprintf(why, sizeof(why), "no GPU found for rank %d: its local rank is %d, but %d GPU%s visible", ctx->rank,
                 ctx->local_rank, visible, visible == 1 ? " is" : "s are");
        return failed(TOOL_EXIT_NO_GPU, why);
    }
    snprintf(why, sizeof(why), "cudaSetDevice(%d): %s", ctx->local_rank, cudaGetErrorString(e));
    return failed(TOOL_EXIT_FAILED, why);
}

int rank_comm(const cometi_rank_ctx_t *ctx, int timeout_ms, comet_comm_t *comm)
{
    comet_comm_config_t cc = COMET_COMM_CONFIG_INIT;
    cc.timeout_ms = timeout_ms;
    const comet_status_t st = comet_comm_create_from_id(&ctx->id, ctx->nranks, ctx->rank, &cc, comm);
    if (st == COMET_SUCCESS) return 0;
    char why[COMETI_ERR_LEN + 64];
    snprintf(why, sizeof(why), "comet_comm_create_from_id: %s", comet_last_create_error());
    /* COMET_NOT_SUPPORTED from the create: an NCCL older than 2.28, or another release than
     * the headers comet was built with (its device API must match). */
    return failed(st == COMET_NOT_SUPPORTED ? TOOL_EXIT_NO_GPU : TOOL_EXIT_FAILED, why);
}
