/*
 * config.c - MoE configuration: the model presets and the validation that names the
 * field, its value and the limit. No CUDA calls: the CPU tests cover it.
 */
#include <stdio.h>
#include <string.h>

#include "base/host.h"
#include "comm/plan.h"

typedef struct preset {
    const char *name;
    int num_experts, top_k, hidden, ffn;
} preset_t;

/* Shapes from the models' published configs; "tiny" is for tests. */
static const preset_t presets[] = {
    {"mixtral-8x7b", 8, 2, 4096, 14336},
    {"phi-3.5-moe", 16, 2, 4096, 6400},
    {"qwen2-57b-a14b", 64, 8, 3584, 2560},
    {"qwen2-moe-2.7b", 64, 4, 2048, 1408},
    {"gpt-oss-120b", 128, 4, 2880, 2880}, /* the shape; its clamped SwiGLU and biases are not modelled */
    {"tiny", 8, 2, 256, 192},
};
#define NPRESETS ((int)(sizeof(presets) / sizeof(presets[0])))

const char *comet_moe_preset_name(int i) { return i >= 0 && i < NPRESETS ? presets[i].name : NULL; }


comet_status_t comet_moe_config_preset(const char *name, int max_tokens, comet_moe_config_t *out)
{
    if (!out)
        return cometi_fail(cometi_create_error_buffer(), COMET_INVALID_ARGUMENT, "comet_moe_config_preset: out is NULL");
    for (int i = 0; name && i < NPRESETS; i++) {
        if (strcmp(name, presets[i].name) != 0) continue;
        comet_moe_config_t c = COMET_MOE_CONFIG_INIT;
        c.num_experts = presets[i].num_experts;
        c.top_k = presets[i].top_k;
        c.hidden = presets[i].hidden;
        c.ffn = presets[i].ffn;
        c.max_tokens = max_tokens;
        *out = c;
        return COMET_SUCCESS;
    }
    char known[256] = "";
    for (int i = 0; i < NPRESETS; i++) {
        strncat(known, presets[i].name, sizeof(known) - strlen(known) - 1);
        if (i + 1 < NPRESETS) strncat(known, ", ", sizeof(known) - strlen(known) - 1);
    }
    return cometi_fail(cometi_create_error_buffer(), COMET_INVALID_ARGUMENT, "unknown preset \"%s\"; known presets: %s",
                       name ? name : "(null)", known);
}

/* Writes the message into msg (which may be NULL) and returns the status. */
static comet_status_t bad(char *msg, size_t len, comet_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static comet_status_t bad(char *msg, size_t len, comet_status_t st, const char *fmt, ...)
{
    if (msg && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, len, fmt, ap);
        va_end(ap);
    }
    return st;
}

#define MAX_DIM 65536
#define MAX_EXPERTS COMETI_MAX_EXPERTS
#define MAX_TOP_K 32
#define MAX_TOKENS (1 << 20)

comet_status_t comet_moe_config_validate(const comet_moe_config_t *c, int world, char *msg, size_t len)
{
    const comet_status_t INVAL = COMET_INVALID_ARGUMENT;
    if (msg && len) msg[0] = '\0';
    if (!c) return bad(msg, len, INVAL, "config is NULL");
    if (c->size != sizeof(comet_moe_config_t) || c->magic != COMET_STRUCT_MAGIC)
        return bad(msg, len, INVAL, "config.size = %zu, config.magic = 0x%x: initialise the struct with "
                   "COMET_MOE_CONFIG_INIT (size %zu, magic 0x%x)", c->size, c->magic,
                   sizeof(comet_moe_config_t), COMET_STRUCT_MAGIC);
    if (c->version < 1 || c->version > COMET_API_VERSION)
        return bad(msg, len, INVAL, "config.version = %u: this library knows versions 1..%d", c->version,
                   COMET_API_VERSION);
    if (c->version < 2 && (c->dtype != COMET_DTYPE_BF16 || c->fp8_pow2_scales))
        return bad(msg, len, INVAL, "config.version = %u with config.dtype = %d, fp8_pow2_scales = %d: FP8 came in "
                   "version 2; a version-1 config is COMET_DTYPE_BF16 with fp8_pow2_scales 0", c->version,
                   (int)c->dtype, c->fp8_pow2_scales);
    if (c->version < 3 && c->fp8_wgrad_cublaslt)
        return bad(msg, len, INVAL, "config.version = %u with config.fp8_wgrad_cublaslt = %d: the field came in "
                   "version 3; an older config leaves it 0", c->version, c->fp8_wgrad_cublaslt);
    if (world < 1 || world > COMETI_MAX_RANKS)
        return bad(msg, len, INVAL, "world size %d: must be 1..%d (one NVLink node)", world, COMETI_MAX_RANKS);
    if (c->hidden <= 0 || c->hidden > MAX_DIM || c->hidden % 64)
        return bad(msg, len, INVAL, "config.hidden = %d: must be a multiple of 64 in 64..%d (a GEMM K or N "
                   "tile is 64 bf16 wide)", c->hidden, MAX_DIM);
    if (c->ffn <= 0 || c->ffn > MAX_DIM || c->ffn % 64)
        return bad(msg, len, INVAL, "config.ffn = %d: must be a multiple of 64 in 64..%d", c->ffn, MAX_DIM);
    if (c->num_experts <= 0 || c->num_experts > MAX_EXPERTS)
        return bad(msg, len, INVAL, "config.num_experts = %d: must be 1..%d", c->num_experts, MAX_EXPERTS);
    if (c->top_k <= 0 || c->top_k > c->num_experts || c->top_k > MAX_TOP_K)
        return bad(msg, len, INVAL, "config.top_k = %d: must be 1..min(num_experts = %d, %d)", c->top_k,
                   c->num_experts, MAX_TOP_K);
    if (c->max_tokens <= 0 || c->max_tokens > MAX_TOKENS)
        return bad(msg, len, INVAL, "config.max_tokens = %d: must be 1..%d", c->max_tokens, MAX_TOKENS);
    if (c->dtype != COMET_DTYPE_BF16 && c->dtype != COMET_DTYPE_FP8_BLOCK)
        return bad(msg, len, INVAL, "config.dtype = %d: must be COMET_DTYPE_BF16 (0) or COMET_DTYPE_FP8_BLOCK (1)",
                   (int)c->dtype);
    if (c->fp8_pow2_scales != 0 && c->fp8_pow2_scales != 1)
        return bad(msg, len, INVAL, "config.fp8_pow2_scales = %d: must be 0 (amax / 448) or 1 (powers of two)",
                   c->fp8_pow2_scales);
    if (c->resend_x != 0 && c->resend_x != 1)
        return bad(msg, len, INVAL, "config.resend_x = %d: must be 0 (the saved state keeps x's rows) or 1 (the "
                   "backward sends x again)", c->resend_x);
    if (c->dtype == COMET_DTYPE_FP8_BLOCK && c->resend_x)
        return bad(msg, len, INVAL, "config.resend_x = 1 with config.dtype COMET_DTYPE_FP8_BLOCK: an FP8 layer keeps "
                   "x's rows in E4M3 for its backward and does not send x again; leave it 0");
    if (c->fp8_pow2_scales && c->dtype != COMET_DTYPE_FP8_BLOCK)
        return bad(msg, len, INVAL, "config.fp8_pow2_scales = 1 is for config.dtype COMET_DTYPE_FP8_BLOCK (dtype "
                   "is %d)", (int)c->dtype);
    if (c->fp8_wgrad_cublaslt != 0 && c->fp8_wgrad_cublaslt != 1)
        return bad(msg, len, INVAL, "config.fp8_wgrad_cublaslt = %d: must be 0 (comet's weight-gradient GEMM) or 1 "
                   "(cuBLASLt's, per expert)", c->fp8_wgrad_cublaslt);
    if (c->fp8_wgrad_cublaslt && c->dtype != COMET_DTYPE_FP8_BLOCK)
        return bad(msg, len, INVAL, "config.fp8_wgrad_cublaslt = 1 is for config.dtype COMET_DTYPE_FP8_BLOCK (dtype "
                   "is %d)", (int)c->dtype);
    if (c->tp_size < 0 || c->ep_size < 0)
        return bad(msg, len, INVAL, "config.ep_size = %d, config.tp_size = %d: must be >= 0 (0: choose)",
                   c->ep_size, c->tp_size);
    int tp = c->tp_size ? c->tp_size : 1;
    if (world % tp)
        return bad(msg, len, INVAL, "config.tp_size = %d: must divide the world size %d", tp, world);
    int ep = c->ep_size ? c->ep_size : world / tp;
    if (ep * tp != world)
        return bad(msg, len, INVAL, "config.ep_size = %d x tp_size = %d = %d: must equal the world size %d",
                   ep, tp, ep * tp, world);
    if (c->num_experts % ep)
        return bad(msg, len, INVAL, "config.num_experts = %d: must be divisible by ep_size = %d", c->num_experts,
                   ep);
    if (c->ffn % (64 * tp))
        return bad(msg, len, INVAL, "config.ffn = %d: must be a multiple of 64 x tp_size = %d (each TP rank "
                   "holds ffn / tp_size columns of every expert of its group)", c->ffn, 64 * tp);
    /* Row indices are int32 on the device: the worst-case receive buffer must fit. */
    int64_t rows = cometi_route_max_recv_rows(world, c->max_tokens, c->top_k, c->num_experts / ep,
                                              COMETI_BLOCK_M);
    if (rows > INT32_MAX / 2)
        return bad(msg, len, INVAL, "config.max_tokens = %d: world %d x max_tokens x top_k %d = %lld rows "
                   "could land on one rank; the limit is %d", c->max_tokens, world, c->top_k,
                   (long long)rows, INT32_MAX / 2);
    return COMET_SUCCESS;
}
