/*
 * comet.h - the one public header of libcomet.
 *
 * libcomet runs the expert layers of a Mixture-of-Experts model across the GPUs of
 * a node, one process per GPU, over a caller's NCCL communicator. Host code is C11;
 * this header is C and C++ safe.
 *
 * Usage in four calls:
 *
 *   comet_comm_t comm;   comet_comm_create(nccl_comm, NULL, &comm);
 *   comet_moe_t  moe;    comet_moe_create(comm, &config, &moe);
 *   comet_moe_forward(moe, &args, stream);      // as often as you like
 *   comet_moe_destroy(moe); comet_comm_destroy(comm);
 *
 * Training adds a saved state, comet_moe_forward_train and comet_moe_backward (below).
 *
 * Functions that can fail return a comet_status_t; the others (names, version, rank,
 * size, the NCCL handle, messages) return their value directly and never fail. On
 * failure, comet_comm_last_error() or comet_moe_last_error() gives a sentence naming the
 * field, the value and the limit (comet_last_create_error() when there is no handle).
 * Errors found on the GPU after a call returned (a peer that never answered) are
 * reported by comet_comm_get_async_error().
 *
 * Collective calls (create, destroy, forward, forward_train, backward) must be made by
 * every rank of the communicator, in the same order: each layer call the same number of
 * times, with the same impl and the same weight layout (gate_up, or gate and up: the
 * layout picks the training path), on the same stream, at most max_tokens tokens each (0
 * is fine), the backwards in the same order. A call refused on one rank alone before it
 * reaches the others (a bad argument) leaves them waiting: on the fused path until the
 * timeout (COMET_TIMEOUT), on the sequential one inside NCCL, as any NCCL collective.
 * A communicator and its layers are not thread-safe (use them from one thread at a
 * time), but any thread may make a call
 * (a framework's backward thread, say): each call that touches the GPU binds the
 * communicator's CUDA context (the one current at its create) and gives the thread's own
 * (or none) back before it returns.
 * Calls that are not collective (configs, presets, saved-state sizes, messages, FP8
 * quantization) are thread-safe. Strings returned by the library live until the next call on the same
 * handle (messages), or forever (names, version). Device pointers passed to the layer must
 * be 16-byte aligned (topk_ids and topk_weights 4-byte): the kernels move rows 16 bytes
 * at a time.
 *
 * Environment variables, read once, at the first comet_comm_create (a malformed value
 * fails it with COMET_INVALID_ARGUMENT naming the variable); unset or empty: the default.
 *   COMET_TIMEOUT_MS   1..3600000, default 5000: a device-side wait's limit, where the
 *                      comm config's timeout_ms is 0
 *   COMET_TUNING_FILE  a readable regular file, default none: the fused path's settings
 *                      for bf16 layers (an FP8 layer takes the cost model's); its lines are
 *                      parsed and checked then too (the limits that need the GPU's SM count
 *                      at the layer's first read of it)
 *   COMET_PDL          0 or 1, default 1. 0: launch every kernel the ordinary way, not with
 *                      programmatic dependent launch
 *   COMET_FIRST_WAVE   0 or 1, default 1. 0: no first wave (layer0's first row blocks on
 *                      a second stream beside the route, at tp_size 1)
 *
 * Settings. The fused path's settings (the SMs that dispatch rows in layer0; how layer1
 * sends rows home: pushed from GEMM1's epilogue, or by combine blocks over column splits)
 * come from a cost model, or from the line of $COMET_TUNING_FILE for the layer's shape
 * (`comet tune` measures them and writes it). One line per shape and token count, '#'
 * starts a comment, e.g.:
 *   # world[tpT] experts top_k hidden ffn max_tokens : dispatch_blocks bulk|stores combine_blocks splits static|dynamic tail|notail|push
 *   2 64 4 2048 1408 8192 : 12 bulk 0 1 dynamic push
 * (world 2 at tp_size 2 is "2tp2"). A layer takes the line of its world, tp, experts,
 * top_k, hidden and ffn whose max_tokens is closest to its own. The fused path's first
 * call reads the file again: a line that could not run on this GPU fails it
 * (COMET_INVALID_ARGUMENT naming the line and the field), and ranks whose settings differ
 * are refused on every rank.
 */
#ifndef COMET_H
#define COMET_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What libcomet exports: the functions of this header and nothing else (the library is
 * built with hidden visibility). */
#if defined(__GNUC__)
#define COMET_API __attribute__((visibility("default")))
#else
#define COMET_API
#endif

#define COMET_VERSION_MAJOR 0
#define COMET_VERSION_MINOR 1
#define COMET_VERSION_PATCH 0
/* Version of the config and argument structs below; bumped when a field is added (2:
 * block-scaled FP8: the config's COMET_DTYPE_FP8_BLOCK and fp8_pow2_scales, the forward
 * args' scales, the backward args' weights_t and weight_t_scales, the saved config's
 * gate_up_e4m3; 3: the config's fp8_wgrad_cublaslt). A struct stamped with an older
 * version must leave the later fields 0 (its caller does not know them); one that sets
 * them is refused. */
#define COMET_API_VERSION 3
/* Stamped into every struct by its initializer, so an uninitialised struct is caught. */
#define COMET_STRUCT_MAGIC 0xC0E7u

typedef enum comet_status {
    COMET_SUCCESS = 0,
    COMET_INVALID_ARGUMENT = 1, /* a field or argument is out of range; the message names it */
    COMET_INVALID_USAGE = 2,    /* calls in the wrong order, or a handle used wrongly */
    COMET_CUDA_ERROR = 3,       /* a CUDA runtime, driver or cuBLAS call failed */
    COMET_NCCL_ERROR = 4,       /* an NCCL call failed */
    COMET_OUT_OF_MEMORY = 5,    /* host or device allocation failed */
    COMET_TIMEOUT = 6,          /* a device-side wait for a peer ran past the timeout */
    COMET_REMOTE_ERROR = 7,     /* another rank reported a failure */
    COMET_NOT_SUPPORTED = 8,    /* a valid request this build cannot serve yet */
    COMET_INTERNAL_ERROR = 9    /* a bug in comet: please report it */
} comet_status_t;

/* A static string naming the status, e.g. "COMET_TIMEOUT: a device-side wait for a peer timed
 * out". */
COMET_API const char *comet_status_string(comet_status_t status);

/* "0.1.0 (NCCL 2.28.9 at build time)". Static string. */
COMET_API const char *comet_version_string(void);

/* ------------------------------------------------------------------------------------ */
/* Communicator: NCCL plus the symmetric memory comet's kernels read and write directly. */

typedef struct comet_comm *comet_comm_t;

typedef struct comet_comm_config {
    size_t size;          /* sizeof(comet_comm_config_t) */
    unsigned int magic;   /* COMET_STRUCT_MAGIC */
    unsigned int version; /* COMET_API_VERSION */
    /* Longest a device-side wait on a peer may spin before it gives up and reports
     * COMET_TIMEOUT, in milliseconds. 0: the default, 5000, or $COMET_TIMEOUT_MS. */
    int timeout_ms;
} comet_comm_config_t;

#define COMET_COMM_CONFIG_INIT {sizeof(comet_comm_config_t), COMET_STRUCT_MAGIC, COMET_API_VERSION, 0}

/*
 * Wrap a caller's NCCL communicator (NCCL >= 2.28, every rank on one NVLink node, at
 * most 72 ranks).
 * Collective: every rank of `nccl` calls it. The caller keeps ownership of `nccl`
 * and must keep it alive until comet_comm_destroy(). The current CUDA device must be
 * the one `nccl` was created on. `config` may be NULL for defaults.
 * Errors: COMET_INVALID_ARGUMENT (NULL out, bad config, a malformed environment
 * variable), COMET_INVALID_USAGE (the current device is not the communicator's),
 * COMET_NOT_SUPPORTED (NCCL too old, more than 72 ranks, ranks not all reachable by NVLink
 * loads and stores), COMET_NCCL_ERROR, COMET_CUDA_ERROR,
 * COMET_OUT_OF_MEMORY. On failure *out is NULL; the message is
 * available from comet_last_create_error().
 */
COMET_API comet_status_t comet_comm_create(ncclComm_t nccl, const comet_comm_config_t *config,
                                 comet_comm_t *out);

/*
 * Create the NCCL communicator too, from an id made by ncclGetUniqueId() on one rank
 * and handed to all: `nranks` processes call this with their own `rank` in
 * [0, nranks). The calling thread's current CUDA device is used. comet owns the NCCL
 * communicator and destroys it in comet_comm_destroy().
 */
COMET_API comet_status_t comet_comm_create_from_id(const ncclUniqueId *id, int nranks, int rank,
                                         const comet_comm_config_t *config, comet_comm_t *out);

/*
 * Collective. Frees everything comet allocated. NULL is a no-op. Waits for the device,
 * then for every rank, within the timeout: when a peer is gone or an error is stored (a
 * wait that timed out, a call mismatch, a saved state's bound) it does not wait, aborts
 * the NCCL communicator comet created, frees the symmetric memory the layers left to it,
 * and returns the error: COMET_TIMEOUT, COMET_REMOTE_ERROR (a layer's destroy found a
 * peer gone), or the stored error's code (COMET_INVALID_ARGUMENT for a mismatch).
 * A caller's communicator is left to the caller to abort; that symmetric memory stays
 * registered in it and allocated (freeing it before the abort would be unsafe). The
 * handle is freed whatever it returns; its message moves to comet_last_create_error().
 */
COMET_API comet_status_t comet_comm_destroy(comet_comm_t comm);

/* This rank and the number of ranks; -1 for a NULL comm. */
COMET_API int comet_comm_rank(comet_comm_t comm);
COMET_API int comet_comm_size(comet_comm_t comm);
/* The NCCL communicator underneath (the caller's, or the one comet created); NULL for a
 * NULL comm. */
COMET_API ncclComm_t comet_comm_nccl(comet_comm_t comm);

/* Detail of the last failure of a call on this communicator; "" if none. Valid until the
 * next call on it. */
COMET_API const char *comet_comm_last_error(comet_comm_t comm);

/* The message of the last failed *_create call on this thread (the handle is NULL), of
 * the last failed *_destroy call (the handle is gone), or of the last failed call that
 * takes no handle (the saved-state calls and the comet_quantize_fp8_* calls). */
COMET_API const char *comet_last_create_error(void);

/*
 * Errors found by kernels after the launching call had returned: a device-side wait
 * that ran past timeout_ms gives COMET_TIMEOUT and a message naming the wait and the
 * peer; a fused training forward that received more rows than its saved state holds
 * gives COMET_INVALID_ARGUMENT, as does a fused call whose ranks were in different calls
 * (the message names the rank and both calls). These are sticky: every later call on the
 * communicator returns them, and it must be destroyed. An expert id out of range on the fused path is
 * reported once (COMET_INVALID_ARGUMENT; that row was left out) and the communicator
 * stays usable. Does not synchronize; call it after synchronizing the stream to be sure.
 */
COMET_API comet_status_t comet_comm_get_async_error(comet_comm_t comm);

/* ------------------------------------------------------------------------------------ */
/* The MoE layer. */

/* The experts' number format. */
typedef enum comet_dtype {
    COMET_DTYPE_BF16 = 0,     /* bf16 weights and activations, fp32 sums */
    COMET_DTYPE_FP8_BLOCK = 1 /* block-scaled FP8 (the format of comet_quantize_fp8_weights, below):
                               * E4M3 weights with an FP32 scale per 128 x 128 block, the token
                               * rows and the activation quantized per row per 128 columns, each
                               * 128-wide k block's sums scaled into fp32; x bf16 (comet quantizes
                               * each token once, before it is sent: its rows travel as E4M3 and
                               * scales, about half the bytes) or already E4M3 with its scales
                               * (args.x_scales); y bf16. Gate and up in one tensor need ffn /
                               * tp_size a multiple of 128 (a block must not hold both).
                               * Training in FP8 needs ffn / tp_size a multiple of 128 and
                               * config.resend_x 0 (the fused path: gate_up in one tensor): the
                               * training forward keeps x's rows in E4M3 with their scales and
                               * [g u] in bf16 (or E4M3), the backward runs its four GEMMs in
                               * FP8 (comet_moe_backward_args_t.weights_t). COMET_IMPL_BASELINE
                               * trains on the sequential path with cuBLASLt's block-scaled
                               * GEMMs, the yardstick. */
} comet_dtype_t;

typedef struct comet_moe_config {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int hidden;      /* H: model hidden size. Multiple of 64. */
    int ffn;         /* F: one expert's FFN size (SwiGLU: W1 is H -> 2F, W2 is F -> H). Multiple of 64. */
    int num_experts; /* E: experts in the whole model. Divisible by ep_size. */
    int top_k;       /* experts per token, 1..min(num_experts, 32) */
    int max_tokens;  /* the most tokens one rank passes in one forward call */
    int ep_size;     /* expert-parallel ranks; 0: world size / tp_size */
    int tp_size;     /* tensor-parallel ranks inside an expert; 0: 1. Rank r is TP rank r % tp_size
                      * of EP group r / tp_size; ffn must be a multiple of 64 x tp_size. */
    comet_dtype_t dtype; /* the experts' number format (above) */
    int resend_x;    /* training, 0 or 1 (bf16 layers). 0: a saved state keeps the x rows this rank received
                      * (hidden x 2 bytes per row). 1: it keeps none, and the backward sends
                      * x again from the caller's x (comet_moe_backward_args_t.x, the forward's
                      * x unchanged): less memory per layer in flight, for a second dispatch
                      * of x in the backward (PERF.md measures both); the handle's fused
                      * receive buffer doubles to hold those rows (once per handle). */
    int fp8_pow2_scales; /* COMET_DTYPE_FP8_BLOCK, 0 or 1: the scales the layer makes (x's rows,
                          * the activation; in training also dy's rows, [g u] kept in E4M3 and
                          * the weight gradients' operands) amax / 448, or (1) the power of
                          * two at or above it (DeepSeek-V3.1's UE8M0 scales). With 0, what
                          * SwiGLU's backward makes (dh, (w a)^T) and x cast along the tokens
                          * take amax / 448 rounded up to 8 significant bits (at most 2^-7
                          * coarser), exact in bf16, which the weight gradients read */
    int fp8_wgrad_cublaslt; /* COMET_DTYPE_FP8_BLOCK training on the fused path, 0 or 1. 0: the
                          * weight gradients run as comet's grouped GEMM, and the backward never
                          * waits for the host. 1: as cuBLASLt's block-scaled GEMM per expert
                          * (1 x 128 by 1 x 128, the sequential path's), faster where experts are
                          * large (docs/PERF.md), which takes each expert's rows on the host: the
                          * backward waits on the host, once its route has run, for those counts
                          * (the GPU meanwhile runs the dgrad GEMMs), so it cannot be captured in
                          * a CUDA graph (refused under capture, COMET_INVALID_ARGUMENT), and the
                          * layer holds a cuBLASLt handle and its 32 MiB workspace (made with the
                          * FP8 backward's workspaces; COMET_NOT_SUPPORTED there where cuBLASLt is
                          * older than 12.9). The gradients differ from 0's in the last bits (the
                          * sums' order), both within bf16's rounding of the same products. */
} comet_moe_config_t;

#define COMET_MOE_CONFIG_INIT \
    {sizeof(comet_moe_config_t), COMET_STRUCT_MAGIC, COMET_API_VERSION, 0, 0, 0, 0, 0, 0, 0, COMET_DTYPE_BF16, 0, 0, 0}

/*
 * Fill *out with a named model's shape: "mixtral-8x7b", "phi-3.5-moe", "qwen2-57b-a14b",
 * "qwen2-moe-2.7b" (the COMET paper's), "gpt-oss-120b" (its shape; its clamped SwiGLU and
 * biases are not modelled), "tiny" (for tests). max_tokens is set to
 * `max_tokens`; ep_size and tp_size are left 0 (choose from the world size).
 * Errors: COMET_INVALID_ARGUMENT for an unknown name (the message lists the known ones).
 */
COMET_API comet_status_t comet_moe_config_preset(const char *name, int max_tokens, comet_moe_config_t *out);
/* The i-th preset's name, i from 0; NULL past the last. */
COMET_API const char *comet_moe_preset_name(int i);

/*
 * Check a config against a world size without creating anything. On
 * COMET_INVALID_ARGUMENT, `msg` (if not NULL, `msg_len` bytes) gets a sentence naming
 * the field, its value and the limit.
 */
COMET_API comet_status_t comet_moe_config_validate(const comet_moe_config_t *config, int world_size,
                                         char *msg, size_t msg_len);

typedef struct comet_moe *comet_moe_t;

/*
 * Plan the layer. Collective. Each path allocates its buffers at its first call on the
 * handle (the fused path's collectively), sized for max_tokens per rank with the worst
 * routing (every row of every rank sent to this rank); a handle that only runs fused never
 * pays for the sequential path's. That first call also compares the ranks' configs and
 * refuses on every rank (COMET_INVALID_ARGUMENT naming the field) where they differ. One handle serves every layer of its config: the weights
 * come with each call, and between calls its buffers hold nothing a later call reads (a
 * training forward keeps what its backward needs in its own saved state), so a model of
 * many MoE layers of one shape needs one handle, its calls in the model's order on one
 * stream. Errors: COMET_INVALID_ARGUMENT (config), COMET_OUT_OF_MEMORY.
 */
COMET_API comet_status_t comet_moe_create(comet_comm_t comm, const comet_moe_config_t *config,
                                comet_moe_t *out);
/*
 * Collective (the fused path's symmetric memory is deregistered on every rank together).
 * NULL is a no-op. Waits for the device, then (a layer that ran the fused path) for every
 * rank within the timeout: with a peer gone, or an error stored by an earlier call (but an
 * expert id out of range), it frees only this rank's own memory, leaves the symmetric
 * memory to comet_comm_destroy and returns that error (COMET_TIMEOUT for a peer that did
 * not answer) instead of hanging; after another layer's destroy found a peer gone it does
 * the same and returns COMET_SUCCESS.
 * The handle is freed whatever it returns; its message moves to comet_last_create_error().
 * Ranks must reach it within timeout_ms of each other: one later than that is taken for
 * gone (and one that passed the barrier before the late one gave up would then wait on it
 * in the deregistration). Call before comet_comm_destroy().
 */
COMET_API comet_status_t comet_moe_destroy(comet_moe_t moe);
/* Detail of the last failure of a call on this layer; "" if none. Valid until the next
 * call on it. */
COMET_API const char *comet_moe_last_error(comet_moe_t moe);

/*
 * This rank's experts' weights, bf16, in the layout frameworks hold (nn.Linear's
 * [out][in], row-major, contiguous). This rank owns global experts
 * [ep_rank * E_local, (ep_rank + 1) * E_local), E_local = num_experts / ep_size,
 * ep_rank = rank / tp_size. With tp_size > 1 it holds Fl = ffn / tp_size of each expert's
 * ffn columns, [tp_rank * Fl, (tp_rank + 1) * Fl), tp_rank = rank % tp_size (Megatron-LM's
 * expert tensor parallelism): those rows of gate and of up, those columns of down; F below
 * is then Fl. Give either gate_up, or both gate and up.
 */
typedef struct comet_moe_weights {
    const void *gate_up; /* [E_local][2F][H]: rows 0..F-1 gate, rows F..2F-1 up (vLLM's w13) */
    const void *gate;    /* [E_local][F][H] (HF Mixtral's w1), when gate_up is NULL */
    const void *up;      /* [E_local][F][H] (HF Mixtral's w3), when gate_up is NULL */
    const void *down;    /* [E_local][H][F] (HF Mixtral's w2) */
} comet_moe_weights_t;

/* The FP32 block scales of FP8 weights (config.dtype COMET_DTYPE_FP8_BLOCK), one beside
 * each weight given, one per 128 x 128 block of each expert's matrix, rounded up: an HF FP8
 * checkpoint's `weight_scale_inv` per expert, stacked. 16-byte aligned. */
typedef struct comet_moe_weight_scales {
    const float *gate_up; /* [E_local][2F / 128][ceil(H / 128)] (F a multiple of 128) */
    const float *gate;    /* [E_local][ceil(F / 128)][ceil(H / 128)] */
    const float *up;      /* [E_local][ceil(F / 128)][ceil(H / 128)] */
    const float *down;    /* [E_local][ceil(H / 128)][ceil(F / 128)] */
} comet_moe_weight_scales_t;

typedef enum comet_impl {
    COMET_IMPL_AUTO = 0,     /* the fused path where the config allows it (top_k <= 8; with
                              * tp_size > 1, at most 32 ranks), else the baseline */
    COMET_IMPL_BASELINE = 1, /* sequential: NCCL all-to-all + cuBLAS, as Megatron-LM runs it */
    COMET_IMPL_FUSED = 2     /* tile-level overlap in persistent kernels (COMET_NOT_SUPPORTED
                              * where the config does not allow it) */
} comet_impl_t;

typedef struct comet_moe_args {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int num_tokens;            /* M for this call, 0..config.max_tokens */
    const void *x;             /* [M][H] bf16 input rows */
    const int32_t *topk_ids;   /* [M][top_k] global expert ids in [0, E) */
    const float *topk_weights; /* [M][top_k] fp32 routing weights */
    comet_moe_weights_t weights;
    void *y;                   /* [M][H] bf16 output: sum_j w[t][j] * expert_j(x[t]) */
    comet_impl_t impl;
    /* Block-scaled FP8 (config.dtype COMET_DTYPE_FP8_BLOCK; NULL otherwise): the weights
     * above are E4M3 bytes in the same layouts, each with its scales here; x is bf16, or
     * E4M3 with x_scales. */
    comet_moe_weight_scales_t weight_scales;
    const float *x_scales;     /* NULL: x is bf16 [M][H], quantized by comet; else x is E4M3 [M][H]
                                * with these FP32 scales [M][ceil(H / 128)] (DeepEP's layout),
                                * 16-byte aligned */
} comet_moe_args_t;

#define COMET_MOE_ARGS_INIT \
    {sizeof(comet_moe_args_t), COMET_STRUCT_MAGIC, COMET_API_VERSION, 0, NULL, NULL, NULL, \
     {NULL, NULL, NULL, NULL}, NULL, COMET_IMPL_AUTO, {NULL, NULL, NULL, NULL}, NULL}

/*
 * y = MoE(x), enqueued on `stream`. Collective: every rank calls it, each with its own
 * tokens (num_tokens may differ between ranks) and the same impl. All pointers are
 * device pointers. After its first call the fused path never synchronizes the host; that call allocates
 * its buffers (collective), as the baseline path's first call allocates its own. After that first call, a fused call can be captured in a CUDA
 * graph and replayed (the token count and pointers are fixed in the graph; the data in
 * them may change between replays; every rank replays alike). The baseline path synchronizes the host with `stream` once
 * per call (to size its NCCL transfers, as Megatron-LM does). Consecutive calls must use
 * the same stream. Errors: COMET_INVALID_ARGUMENT (a field, or an expert id out of
 * range: the message names the token; or, on every rank, ranks on this path in different
 * calls, a training forward or a backward beside this one: returned by the call on the
 * sequential path, by comet_comm_get_async_error() on the fused one, whose communicator is
 * unusable then), COMET_NOT_SUPPORTED (an impl the config does not
 * allow), COMET_TIMEOUT (fused: a peer that stopped calling, reported by this call or
 * comet_comm_get_async_error()), COMET_REMOTE_ERROR (another rank refused the call: its
 * expert id out of range, or its $COMET_TUNING_FILE unreadable; tuning files that pick
 * different settings: COMET_INVALID_ARGUMENT on every rank), COMET_OUT_OF_MEMORY (a path's
 * first call allocates), COMET_NCCL_ERROR, COMET_CUDA_ERROR. On the sequential path a rank
 * whose experts fail after the dispatch (a cuBLAS error) still joins the return, sending
 * NaN rows, and reports the error after it: no peer waits for good, and a peer's call
 * returns COMET_SUCCESS with NaN in the rows of its tokens that went there (the same in
 * comet_moe_backward: dx and d topk_weights).
 */
COMET_API comet_status_t comet_moe_forward(comet_moe_t moe, const comet_moe_args_t *args, cudaStream_t stream);

/* ------------------------------------------------------------------------------------ */
/* Training: a forward that keeps what its backward needs, and the backward.
 *
 *   comet_moe_saved_t s;  comet_moe_saved_create(moe, NULL, &s);   // one per layer in flight
 *   comet_moe_forward_train(moe, &args, s, stream);               // y, and s filled
 *   ...                                                           // later layers, the loss
 *   comet_moe_backward(moe, &bargs, stream);                      // bargs.saved = s
 *   comet_moe_saved_destroy(s);
 *
 * The fused path trains with COMET's two patterns again (dispatch -> GEMM for dy into the
 * dgrad GEMM of W2, GEMM -> combine for the dgrad GEMM of W13 with dx sent home, the weight
 * gradients as grouped GEMMs along K). It needs gate_up in one tensor, and runs wherever
 * the fused forward does; COMET_IMPL_AUTO takes it where it can and the sequential path
 * (NCCL all-to-all + cuBLAS, as Megatron-LM runs an expert-parallel layer unfused)
 * elsewhere. The backward runs the path its forward ran. An inference forward
 * (comet_moe_forward) saves nothing and costs nothing extra. */

/* What one training forward keeps for its backward: the rows this rank received (x, and
 * the gate and up projections) and the routing (each choice's expert, weight and place).
 * The caller owns it; a training forward fills it, its backward consumes it (a second
 * backward on it is refused: run a training forward again), the next training forward
 * into it replaces it. */
typedef struct comet_moe_saved *comet_moe_saved_t;

typedef struct comet_moe_saved_config {
    size_t size;
    unsigned int magic;
    unsigned int version;
    /* The most (token, choice) rows this rank may receive in one call, padding excluded.
     * 0: the worst case, every choice of every rank's max_tokens tokens that can come here
     * routed here (world x max_tokens x min(top_k, experts per rank): a token's choices are
     * distinct experts). Rows are never dropped: on the sequential path a call that routes
     * more here is refused (COMET_INVALID_ARGUMENT on every rank, before any row moves);
     * on the fused path, which never waits for the host, the forward runs and
     * comet_comm_get_async_error() then reports COMET_INVALID_ARGUMENT (the communicator is
     * unusable after it). Give every rank the same bound: a training forward whose ranks'
     * bounds differ is refused on every rank, with nothing sent (by the call on the
     * sequential path; on the fused path through comet_comm_get_async_error(), the
     * communicator unusable after it). */
    int64_t max_recv_rows;
    /* COMET_DTYPE_FP8_BLOCK layers, 0 or 1. 0: each received row's gate and up projections
     * ([g u], 2 x ffn / tp_size values) are kept in bf16. 1: in E4M3 with an FP32 scale per
     * 128 of them, quantized by GEMM0's epilogue as the activation is: about half the
     * saved state, for one more E4M3 rounding of g and u in the backward (docs/PERF.md
     * measures what it costs the gradients). */
    int gate_up_e4m3;
} comet_moe_saved_config_t;

#define COMET_MOE_SAVED_CONFIG_INIT {sizeof(comet_moe_saved_config_t), COMET_STRUCT_MAGIC, COMET_API_VERSION, 0, 0}

/*
 * The device memory a saved state of this layer takes: per received row, (hidden + 2 x
 * ffn / tp_size) x 2 bytes (x, gate and up, bf16; 2 x ffn / tp_size x 2 where the config
 * resends x; FP8: x as hidden E4M3 bytes and its ceil(hidden / 128) scales padded to 16
 * bytes, gate and up in bf16, or with gate_up_e4m3 2 x ffn / tp_size bytes and 2 x ffn /
 * tp_size / 128 scales of 4 bytes); per token, top_k x 12 bytes (each choice's place in the send order, expert
 * id and weight; no expert outputs: d topk_weights is <dy W2, silu(g) u> at the expert,
 * from rows the backward has anyway); plus, per local expert, one 128-row block of
 * padding and 8 bytes (its rows' place), and at most 2 KB of alignment. Rows are
 * allocated for the bound (max_recv_rows). `config` may be NULL (the worst case). Not
 * collective; allocates nothing.
 */
COMET_API comet_status_t comet_moe_saved_bytes(comet_moe_t moe, const comet_moe_saved_config_t *config,
                                               size_t *bytes);
/* Allocate a saved state for this layer (not collective). NULL config: the worst case. */
COMET_API comet_status_t comet_moe_saved_create(comet_moe_t moe, const comet_moe_saved_config_t *config,
                                                comet_moe_saved_t *out);
/* The same over the caller's device memory (a framework's caching allocator): at least
 * comet_moe_saved_bytes bytes, 256-byte aligned, kept alive by the caller until the
 * backward that reads it has run on the device (stream order is enough). Its destroy
 * neither waits for the device nor frees the memory. */
COMET_API comet_status_t comet_moe_saved_create_in(comet_moe_t moe, const comet_moe_saved_config_t *config,
                                                   void *memory, size_t bytes, comet_moe_saved_t *out);
/* NULL is a no-op; it may come after its layer's destroy. One from comet_moe_saved_create
 * waits for the device and frees its memory. The saved-state calls (bytes, create,
 * destroy) leave their messages where comet_last_create_error() reads. */
COMET_API comet_status_t comet_moe_saved_destroy(comet_moe_saved_t saved);

/*
 * y = MoE(x) as comet_moe_forward, and `saved` (of this layer) filled for the backward.
 * Collective. Errors as comet_moe_forward's, COMET_INVALID_ARGUMENT for a saved state of
 * another layer or (sequential path) a call that routes more rows here than its bound,
 * and, on every rank, where ranks are in different calls (a training forward beside an
 * inference forward or a backward, saved states of different bounds: reported by
 * comet_comm_get_async_error() on the fused path, by the call on the sequential one),
 * and COMET_NOT_SUPPORTED for COMET_IMPL_FUSED where the fused path cannot train (the
 * message says why; an FP8 layer whose ffn / tp_size is not a multiple of 128 on either
 * path). An FP8 layer's first training forward on a path allocates that path's backward
 * workspaces on every rank, host-blocking once: where one rank cannot, every rank refuses
 * the call before anything is sent (that rank COMET_OUT_OF_MEMORY, the others
 * COMET_REMOTE_ERROR) and the next training forward tries again.
 */
COMET_API comet_status_t comet_moe_forward_train(comet_moe_t moe, const comet_moe_args_t *args,
                                                 comet_moe_saved_t saved, cudaStream_t stream);

/* How weight gradients are delivered. */
typedef enum comet_grad_mode {
    COMET_GRAD_WRITE_BF16 = 0,     /* written as bf16: the gradient of this call alone */
    COMET_GRAD_ACCUMULATE_FP32 = 1 /* added to fp32 buffers (Megatron-LM's main_grad): accumulates
                                    * micro-batches */
} comet_grad_mode_t;

/* This rank's experts' weight gradients, in the layouts of comet_moe_weights_t (the same
 * choice of gate_up, or gate and up, as the weights; FP8 layers: gate_up, as weights_t),
 * bf16 or fp32 by `mode`. */
typedef struct comet_moe_weight_grads {
    void *gate_up; /* [E_local][2F][H] */
    void *gate;    /* [E_local][F][H], when gate_up is NULL */
    void *up;      /* [E_local][F][H], when gate_up is NULL */
    void *down;    /* [E_local][H][F] */
    comet_grad_mode_t mode;
} comet_moe_weight_grads_t;

typedef struct comet_moe_backward_args {
    size_t size;
    unsigned int magic;
    unsigned int version;
    comet_moe_saved_t saved;       /* filled by this layer's training forward */
    const void *dy;                /* [M][H] bf16: the loss's gradient at y; M is the forward's num_tokens */
    const void *x;                 /* [M][H] bf16: the forward's x, unchanged since; read (and needed)
                                    * only where the layer's config.resend_x is 1 */
    comet_moe_weights_t weights;   /* the forward's weights */
    void *dx;                      /* [M][H] bf16 out */
    float *d_topk_weights;         /* [M][top_k] fp32 out: the gradient at the forward's topk_weights */
    comet_moe_weight_grads_t grads;
    comet_impl_t impl;
    /* Block-scaled FP8 (config.dtype COMET_DTYPE_FP8_BLOCK; NULL otherwise; `weights` is then
     * not read): the data-gradient GEMMs read each weight transposed, since FP8 tensor-core
     * MMAs read both operands along k. E4M3 with its 128 x 128 scales transposed, as
     * comet_quantize_fp8_weights_transposed makes them (qt, scales_t) from the weights the
     * forward's FP8 copies came from: gate_up [E_local][H][2F] with scales [E_local][ceil(H /
     * 128)][2F / 128], down [E_local][F][H] with scales [E_local][ceil(F / 128)][ceil(H /
     * 128)]; gate and up apart are not taken. 16-byte aligned. */
    comet_moe_weights_t weights_t;
    comet_moe_weight_scales_t weight_t_scales;
} comet_moe_backward_args_t;

#define COMET_MOE_BACKWARD_ARGS_INIT \
    {sizeof(comet_moe_backward_args_t), COMET_STRUCT_MAGIC, COMET_API_VERSION, NULL, NULL, NULL, \
     {NULL, NULL, NULL, NULL}, NULL, NULL, {NULL, NULL, NULL, NULL, COMET_GRAD_WRITE_BF16}, COMET_IMPL_AUTO, \
     {NULL, NULL, NULL, NULL}, {NULL, NULL, NULL, NULL}}

/*
 * The backward of the training forward that filled args->saved: dx, d topk_weights and
 * this rank's expert weight gradients, enqueued on `stream`, on the path that forward
 * ran (impl: COMET_IMPL_AUTO, or that path's). Collective, as the forward: every rank
 * calls it for the same forward call. It consumes args->saved. A token's dx sums its
 * choices in a fixed order (fp32): the same inputs give the same bits. The fused path
 * never waits for the host (capturable in a CUDA graph as its forward), except on a layer
 * made with config.fp8_wgrad_cublaslt (see there: refused under capture); a peer that
 * stops calling gives COMET_TIMEOUT through comet_comm_get_async_error(), and ranks that
 * run the backwards of different forward calls (layers out of order) get
 * COMET_INVALID_ARGUMENT there, every one of them, with nothing sent (its route compares
 * each saved state's forward call across ranks; a training forward's, the bound). The
 * sequential path synchronizes the host once, at a count exchange that makes the same
 * comparison: there every rank's call returns COMET_INVALID_ARGUMENT, the saved state
 * stays filled and the communicator usable. Errors:
 * COMET_INVALID_ARGUMENT (a field; a saved state empty, consumed, of another layer or
 * another path: nothing is launched), COMET_TIMEOUT, COMET_NCCL_ERROR, COMET_CUDA_ERROR,
 * COMET_OUT_OF_MEMORY (the sequential path: cuBLAS's workspace).
 */
COMET_API comet_status_t comet_moe_backward(comet_moe_t moe, const comet_moe_backward_args_t *args,
                                            cudaStream_t stream);

/* ------------------------------------------------------------------------------------ */
/* Block-scaled FP8 (E4M3): DeepSeek-V3's recipe (Transformer Engine's and Megatron-Core's
 * "blockwise" scaling; the layout of HF FP8 checkpoints such as DeepSeek-V3's).
 *
 * A tensor is cut into blocks: 1 x 128 along its rows for activations (one scale per row
 * per 128 columns), 128 x 128 for weights (one scale grid serves W and W^T). A block has
 * one FP32 scale s, each of its elements one E4M3 byte q (sign, 4 exponent bits with bias
 * 7, 3 mantissa bits: finite values up to 448, NaN 0x7F / 0xFF, no infinities), and an
 * element stands for q x s: dequantize by multiplying (HF's `weight_scale_inv`
 * multiplies too, despite its name).
 *   amax  the largest |x| in the block; a partial block (the last 128 columns, or rows,
 *         when cols or rows are not a multiple of 128) takes its own elements' alone.
 *   s     amax / 448 (fp32 division), or with pow2_scales the smallest power of two at or
 *         above amax / 448 (multiplying by it is exact); at least 2^-126 (FLT_MIN) either
 *         way, so 1 / s is finite; 1 where amax is 0.
 *   q     x x (1 / s) (fp32 division and product), rounded to the nearest E4M3 value, ties
 *         to even, saturating at +-448 (the GPU's cvt.rn.satfinite; -0 stays -0).
 * In a finite block every element has |q s - x| <= |x| / 16 + s / 1024 (q s exact): E4M3
 * rounds to within half a step, 2^-4 of |x| with 3 mantissa bits, and at most 2^-10 s
 * below 2^-6 s, where its steps are 2^-9 s (subnormals). One exception, with pow2_scales
 * alone: the 8 largest bf16 magnitudes (>= 248 x 2^120 ~ 3.30e38) get q = 256 at
 * s = 2^120, whose product 2^128 is past fp32's range: q x s computed in fp32 is +-Inf.
 * NaN and infinity are never clamped away. The amax propagates NaN, so a block holding a
 * NaN gets scale NaN and every q of it is 0x7F; a block holding +-Inf (and no NaN) gets
 * scale +Inf, 1 / s = 0, and its q are +-0 (0x00, 0x80) or 0x7F (Inf x 0 is NaN). Either
 * way every element of such a block dequantizes to NaN (NaN x s, 0 x Inf): a NaN or an
 * infinity shows up in the result, never silently made finite. (An E4M3 NaN byte is always
 * 0x7F, whatever the sign of the NaN it came from.)
 *
 * The three calls are enqueued on `stream` (the current device's), are not collective and
 * need no handle. Errors: COMET_INVALID_ARGUMENT for a bad argument (the message, from
 * comet_last_create_error(), names the field, its value and the limit; nothing is
 * launched), COMET_CUDA_ERROR where the launch fails.
 */

/*
 * An expert's (or any layer's) weights: w bf16 [mats][rows][cols] (nn.Linear's [out][in]
 * per matrix, the matrices contiguous) -> q E4M3 [mats][rows][cols], one byte each, and
 * scales FP32 [mats][ceil(rows / 128)][ceil(cols / 128)], one per 128 x 128 block (an HF
 * FP8 checkpoint's `weight` and `weight_scale_inv`). mats >= 1, rows >= 1, cols >= 16 and
 * a multiple of 16, mats x rows x cols <= 2^61; w and q 16-byte aligned, scales 4-byte
 * aligned; pow2_scales 0 or 1. Device pointers.
 */
COMET_API comet_status_t comet_quantize_fp8_weights(const void *w, int64_t mats, int rows, int cols, int pow2_scales,
                                                    void *q, float *scales, cudaStream_t stream);
/*
 * The same quantization, written transposed too: qt E4M3 [mats][cols][rows] and scales_t
 * FP32 [mats][ceil(cols / 128)][ceil(rows / 128)], with qt[m][c][r] = q[m][r][c] and
 * scales_t[m][j][i] = scales[m][i][j] (every byte and scale as comet_quantize_fp8_weights
 * gives them: a block's elements and amax are the same either way). W^T in FP8 is what a
 * backward's data-gradient GEMM reads, since FP8 tensor-core MMAs read both operands along
 * k only: dx = dy W takes W^T's rows. One pass reads w once and writes both copies; q and
 * scales may both be NULL (the transpose alone). As comet_quantize_fp8_weights, and rows a
 * multiple of 16 as well; qt 16-byte aligned, scales_t 4-byte aligned.
 */
COMET_API comet_status_t comet_quantize_fp8_weights_transposed(const void *w, int64_t mats, int rows, int cols,
                                                               int pow2_scales, void *q, float *scales, void *qt,
                                                               float *scales_t, cudaStream_t stream);
/*
 * Token rows (activations): x bf16 [rows][cols] -> q E4M3 [rows][cols] and scales FP32
 * [rows][ceil(cols / 128)], one per row per 128 columns (DeepEP's layout). rows >= 0
 * (0 does nothing: the pointers are not read then and may be NULL, as an empty framework
 * tensor's); cols >= 16 and a multiple of 16, rows x cols <= 2^61; x and q 16-byte aligned,
 * scales 4-byte aligned; pow2_scales 0 or 1. Device pointers.
 */
COMET_API comet_status_t comet_quantize_fp8_rows(const void *x, int64_t rows, int cols, int pow2_scales, void *q,
                                                 float *scales, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_H */
