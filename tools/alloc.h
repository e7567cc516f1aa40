/*
 * alloc.h - the tool's host allocations. Out of host memory ends the rank with a reason
 * the launcher reports (a tool has no caller to hand the failure back to), naming the
 * bytes and the function that asked.
 */
#ifndef COMET_TOOL_ALLOC_H
#define COMET_TOOL_ALLOC_H

#include <stdio.h>
#include <stdlib.h>

#include "../harness/launch.h"

static inline void *tool_alloc(size_t bytes, int zeroed, const char *where)
{
    void *p = zeroed ? calloc(1, bytes ? bytes : 1) : malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "comet: out of host memory: %zu bytes in %s\n", bytes, where);
        cometi_rank_reason("out of host memory: %zu bytes in %s", bytes, where);
        exit(1);
    }
    return p;
}

#define TOOL_MALLOC(bytes) tool_alloc((bytes), 0, __func__)
#define TOOL_CALLOC(n, size) tool_alloc((size_t)(n) * (size), 1, __func__)

#endif /* COMET_TOOL_ALLOC_H */
