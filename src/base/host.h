/*
 * host.h - what the library's host C files share: comet.h, the types kernels share too
 * (types.h), error helpers that write a message naming the field, the value and the
 * limit, and the calling thread's CUDA context. Internal non-static names start with
 * cometi_. The communicator is comm/comm.h's, the layer layer/layer.h's.
 */
#ifndef COMET_BASE_HOST_H
#define COMET_BASE_HOST_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "comet.h"
#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define COMETI_ERR_LEN 512
#define COMETI_DEFAULT_TIMEOUT_MS 5000

/* Kernels record comet.h's statuses under names of their own (types.h). */
#ifdef __cplusplus
#define COMETI_STATIC_ASSERT static_assert
#else
#define COMETI_STATIC_ASSERT _Static_assert
#endif
COMETI_STATIC_ASSERT(COMETI_ASYNC_INVALID_ARGUMENT == COMET_INVALID_ARGUMENT, "types.h's status values");
COMETI_STATIC_ASSERT(COMETI_ASYNC_TIMEOUT == COMET_TIMEOUT, "types.h's status values");
COMETI_STATIC_ASSERT(COMETI_ASYNC_INTERNAL_ERROR == COMET_INTERNAL_ERROR, "types.h's status values");

/* Record a formatted message in `err` (COMETI_ERR_LEN bytes) and return `status`. */
comet_status_t cometi_fail(char *err, comet_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Same, for a failed CUDA runtime call; cudaSuccess returns COMET_SUCCESS untouched. */
comet_status_t cometi_cuda(char *err, cudaError_t e, const char *what);
comet_status_t cometi_nccl(char *err, ncclResult_t r, const char *what);

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

/* A call id in words ("an inference forward", ...), for the messages of both paths. */
void cometi_call_text(unsigned long long id, char *out, size_t len);

/* The thread's buffer for messages of failed *_create calls (no handle to hold them). */
char *cometi_create_error_buffer(void);

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

#endif /* COMET_BASE_HOST_H */
