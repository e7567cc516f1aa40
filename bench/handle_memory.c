/*
 * handle_memory.c - the device memory a layer handle takes on one GPU, per preset at 8192
 * tokens: after comet_moe_create, after the first fused call, after the first baseline
 * call (cudaMemGetInfo around each, the device idle), and a saved state's size
 * (comet_moe_saved_bytes). The first call of a path also loads its kernels, a few MiB.
 *
 *   make build/handle_memory && build/handle_memory mixtral-8x7b phi-3.5-moe ...
 */
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "comet.h"

#define TOKENS 8192
#define MIB (1024.0 * 1024.0)

static long long device_used(void)
{
    size_t free_b = 0, total = 0;
    if (cudaDeviceSynchronize() != cudaSuccess || cudaMemGetInfo(&free_b, &total) != cudaSuccess) return -1;
    return (long long)(total - free_b);
}

/* One preset's row; 0, or 1 with the reason printed. */
static int measure(comet_comm_t comm, const char *preset)
{
    comet_moe_config_t c = COMET_MOE_CONFIG_INIT;
    if (comet_moe_config_preset(preset, TOKENS, &c) != COMET_SUCCESS) {
        printf("%s: %s\n", preset, comet_last_create_error());
        return 1;
    }
    const int H = c.hidden, F = c.ffn, E = c.num_experts, k = c.top_k, M = TOKENS;
    void *x = NULL, *y = NULL, *gate_up = NULL, *down = NULL;
    int32_t *ids = NULL;
    float *w = NULL;
    int32_t *ids_h = malloc(sizeof(int32_t) * M * k);
    float *w_h = malloc(sizeof(float) * M * k);
    /* Each token's k distinct experts, spread over all of them; weights and x zero. */
    for (int t = 0; t < M; t++)
        for (int j = 0; j < k; j++) ids_h[t * k + j] = (t * 7 + j) % E, w_h[t * k + j] = 1.0f / k;
    int failed = !ids_h || !w_h || cudaMalloc(&x, (size_t)M * H * 2) || cudaMalloc(&y, (size_t)M * H * 2) ||
                 cudaMalloc(&gate_up, (size_t)E * 2 * F * H * 2) || cudaMalloc(&down, (size_t)E * H * F * 2) ||
                 cudaMalloc((void **)&ids, sizeof(int32_t) * M * k) || cudaMalloc((void **)&w, sizeof(float) * M * k);
    failed = failed || cudaMemset(x, 0, (size_t)M * H * 2) || cudaMemset(gate_up, 0, (size_t)E * 2 * F * H * 2) ||
             cudaMemset(down, 0, (size_t)E * H * F * 2) ||
             cudaMemcpy(ids, ids_h, sizeof(int32_t) * M * k, cudaMemcpyHostToDevice) ||
             cudaMemcpy(w, w_h, sizeof(float) * M * k, cudaMemcpyHostToDevice);
    comet_moe_t moe = NULL;
    long long at[4] = {device_used(), 0, 0, 0};
    if (!failed && comet_moe_create(comm, &c, &moe) != COMET_SUCCESS) {
        printf("%s: comet_moe_create: %s\n", preset, comet_last_create_error());
        failed = 1;
    }
    at[1] = device_used();
    comet_moe_args_t a = COMET_MOE_ARGS_INIT;
    a.num_tokens = M, a.x = x, a.topk_ids = ids, a.topk_weights = w, a.y = y;
    a.weights.gate_up = gate_up, a.weights.down = down;
    for (int p = 0; p < 2 && !failed; p++) {
        a.impl = p ? COMET_IMPL_BASELINE : COMET_IMPL_FUSED;
        if (comet_moe_forward(moe, &a, 0) != COMET_SUCCESS) {
            printf("%s: comet_moe_forward (%s): %s\n", preset, p ? "baseline" : "fused", comet_moe_last_error(moe));
            failed = 1;
        }
        at[2 + p] = device_used();
    }
    size_t saved = 0;
    if (!failed && comet_moe_saved_bytes(moe, NULL, &saved) != COMET_SUCCESS) failed = 1;
    if (!failed)
        printf("| %s | %.0f | %.0f | %.0f | %.0f |\n", preset, (at[1] - at[0]) / MIB, (at[2] - at[1]) / MIB,
               (at[3] - at[2]) / MIB, saved / MIB);
    comet_moe_destroy(moe);
    cudaFree(x), cudaFree(y), cudaFree(gate_up), cudaFree(down), cudaFree(ids), cudaFree(w);
    free(ids_h), free(w_h);
    return failed;
}

int main(int argc, char **argv)
{
    int dev = 0;
    ncclComm_t nccl;
    comet_comm_t comm;
    if (ncclCommInitAll(&nccl, 1, &dev) != ncclSuccess) {
        printf("ncclCommInitAll failed\n");
        return 1;
    }
    if (comet_comm_create(nccl, NULL, &comm) != COMET_SUCCESS) {
        printf("comet_comm_create: %s\n", comet_last_create_error());
        return 1;
    }
    printf("| preset | handle created MiB | + fused path MiB | + sequential path MiB | a saved state MiB |\n"
           "|---|---:|---:|---:|---:|\n");
    int failed = 0;
    for (int i = 1; i < argc; i++) failed |= measure(comm, argv[i]);
    comet_comm_destroy(comm);
    ncclCommDestroy(nccl);
    return failed;
}
