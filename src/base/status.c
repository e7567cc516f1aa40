/*
 * status.c - status names, the error-message helpers every host file uses, and the
 * version string.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/host.h"
#include "base/params.h"

const char *comet_status_string(comet_status_t status)
{
    switch (status) {
    case COMET_SUCCESS: return "COMET_SUCCESS: no error";
    case COMET_INVALID_ARGUMENT: return "COMET_INVALID_ARGUMENT: an argument or config field is out of range";
    case COMET_INVALID_USAGE: return "COMET_INVALID_USAGE: a call made in the wrong order or on the wrong handle";
    case COMET_CUDA_ERROR: return "COMET_CUDA_ERROR: a CUDA or cuBLAS call failed";
    case COMET_NCCL_ERROR: return "COMET_NCCL_ERROR: an NCCL call failed";
    case COMET_OUT_OF_MEMORY: return "COMET_OUT_OF_MEMORY: a host or device allocation failed";
    case COMET_TIMEOUT: return "COMET_TIMEOUT: a device-side wait for a peer timed out";
    case COMET_REMOTE_ERROR: return "COMET_REMOTE_ERROR: another rank failed";
    case COMET_NOT_SUPPORTED: return "COMET_NOT_SUPPORTED: valid, but this build cannot do it yet";
    case COMET_INTERNAL_ERROR: return "COMET_INTERNAL_ERROR: a bug in comet";
    }
    return "unknown comet_status_t value";
}

static _Thread_local char create_error[COMETI_ERR_LEN];
const char *comet_last_create_error(void) { return create_error; }
char *cometi_create_error_buffer(void) { return create_error; }

#define STR2(x) #x
#define STR(x) STR2(x)
const char *comet_version_string(void)
{
    return STR(COMET_VERSION_MAJOR) "." STR(COMET_VERSION_MINOR) "." STR(COMET_VERSION_PATCH)
        " (NCCL " STR(NCCL_MAJOR) "." STR(NCCL_MINOR) "." STR(NCCL_PATCH) " at build time)";
}

comet_status_t cometi_fail(char *err, comet_status_t status, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, COMETI_ERR_LEN, fmt, ap);
        va_end(ap);
    }
    return status;
}

comet_status_t cometi_cuda(char *err, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return COMET_SUCCESS;
    comet_status_t st = e == cudaErrorMemoryAllocation ? COMET_OUT_OF_MEMORY : COMET_CUDA_ERROR;
    return cometi_fail(err, st, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

comet_status_t cometi_nccl(char *err, ncclResult_t r, const char *what)
{
    if (r == ncclSuccess) return COMET_SUCCESS;
    return cometi_fail(err, COMET_NCCL_ERROR, "%s: %s", what, ncclGetErrorString(r));
}

int cometi_pdl_enabled(void) { return cometi_param_int(COMETI_PARAM_PDL) != 0; }
