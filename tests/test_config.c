/*
 * test_config.c - the public API's checks that need no GPU: status strings, the model
 * presets, config validation (each bad field named in its message), and argument checks
 * at the API before anything touches a GPU; the FP8 forward's argument checks on a layer
 * handle made by hand (they read its config alone, so no GPU is needed).
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "comet.h"
#include "layer/layer.h"
#include "testutil.h"

int test_status_strings(void)
{
    for (int s = COMET_SUCCESS; s <= COMET_INTERNAL_ERROR; s++) {
        const char *str = comet_status_string((comet_status_t)s);
        CHECK(strncmp(str, "COMET_", 6) == 0);
        for (int q = COMET_SUCCESS; q < s; q++) CHECK(strcmp(str, comet_status_string((comet_status_t)q)) != 0);
    }
    CHECK_CONTAINS(comet_status_string((comet_status_t)1234), "unknown");
    CHECK_CONTAINS(comet_status_string(COMET_TIMEOUT), "COMET_TIMEOUT");
    CHECK_CONTAINS(comet_version_string(), "NCCL 2.");
    return 0;
}

int test_config_presets(void)
{
    struct { const char *name; int e, k, h, f; } want[] = {
        {"mixtral-8x7b", 8, 2, 4096, 14336}, {"phi-3.5-moe", 16, 2, 4096, 6400},
        {"qwen2-57b-a14b", 64, 8, 3584, 2560}, {"qwen2-moe-2.7b", 64, 4, 2048, 1408},
        {"gpt-oss-120b", 128, 4, 2880, 2880}, {"tiny", 8, 2, 256, 192}};
    int n = 0;
    while (comet_moe_preset_name(n)) n++;
    CHECK_EQ(n, 6);
    for (int i = 0; i < 6; i++) {
        comet_moe_config_t c;
        CHECK_EQ(comet_moe_config_preset(want[i].name, 8192, &c), COMET_SUCCESS);
        CHECK_EQ(c.num_experts, want[i].e);
        CHECK_EQ(c.top_k, want[i].k);
        CHECK_EQ(c.hidden, want[i].h);
        CHECK_EQ(c.ffn, want[i].f);
        CHECK_EQ(c.max_tokens, 8192);
        for (int world = 1; world <= 8; world *= 2) {
            char msg[256];
            CHECK_EQ(comet_moe_config_validate(&c, world, msg, sizeof(msg)), COMET_SUCCESS);
        }
    }
    comet_moe_config_t c;
    CHECK_EQ(comet_moe_config_preset("mixtral", 8192, &c), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "unknown preset \"mixtral\"");
    CHECK_CONTAINS(comet_last_create_error(), "qwen2-moe-2.7b");
    return 0;
}

int test_config_validation(void)
{
    comet_moe_config_t base;
    CHECK_EQ(comet_moe_config_preset("tiny", 512, &base), COMET_SUCCESS);
    struct {
        const char *field;
        int value, world;
        comet_status_t status;
        const char *message;
    } cases[] = {
        {"hidden", 100, 2, COMET_INVALID_ARGUMENT, "config.hidden = 100"},
        {"hidden", 0, 2, COMET_INVALID_ARGUMENT, "config.hidden = 0"},
        {"ffn", -64, 2, COMET_INVALID_ARGUMENT, "config.ffn = -64"},
        {"num_experts", 7, 2, COMET_INVALID_ARGUMENT, "config.num_experts = 7: must be divisible by ep_size = 2"},
        {"num_experts", 5000, 2, COMET_INVALID_ARGUMENT, "config.num_experts = 5000"},
        {"top_k", 9, 2, COMET_INVALID_ARGUMENT, "config.top_k = 9: must be 1..min(num_experts = 8"},
        {"top_k", 0, 2, COMET_INVALID_ARGUMENT, "config.top_k = 0"},
        {"max_tokens", 0, 2, COMET_INVALID_ARGUMENT, "config.max_tokens = 0"},
        {"ep_size", 3, 2, COMET_INVALID_ARGUMENT, "config.ep_size = 3 x tp_size = 1 = 3: must equal the world size 2"},
        {"tp_size", 3, 2, COMET_INVALID_ARGUMENT, "config.tp_size = 3: must divide the world size 2"},
        {"tp_size", 2, 2, COMET_INVALID_ARGUMENT, "config.ffn = 192: must be a multiple of 64 x tp_size = 128"},
        {"dtype", 5, 2, COMET_INVALID_ARGUMENT, "config.dtype = 5"},
        {"dtype", COMET_DTYPE_FP8_BLOCK, 2, COMET_SUCCESS, ""},
        {"fp8_pow2_scales", 1, 2, COMET_INVALID_ARGUMENT, "config.fp8_pow2_scales = 1 is for config.dtype "
                                                          "COMET_DTYPE_FP8_BLOCK (dtype is 0)"},
        {"fp8 pow2", 1, 2, COMET_SUCCESS, ""},
        {"fp8 pow2", 2, 2, COMET_INVALID_ARGUMENT, "config.fp8_pow2_scales = 2: must be 0"},
        {"fp8 pow2", -1, 2, COMET_INVALID_ARGUMENT, "config.fp8_pow2_scales = -1"},
        {"fp8_wgrad_cublaslt", 1, 2, COMET_INVALID_ARGUMENT, "config.fp8_wgrad_cublaslt = 1 is for config.dtype "
                                                             "COMET_DTYPE_FP8_BLOCK (dtype is 0)"},
        {"fp8 wgrad_cublaslt", 1, 2, COMET_SUCCESS, ""},
        {"fp8 wgrad_cublaslt", 2, 2, COMET_INVALID_ARGUMENT, "config.fp8_wgrad_cublaslt = 2: must be 0"},
        {"fp8 wgrad_cublaslt", -1, 2, COMET_INVALID_ARGUMENT, "config.fp8_wgrad_cublaslt = -1"},
        {"fp8 resend_x", 1, 2, COMET_INVALID_ARGUMENT, "config.resend_x = 1 with config.dtype "
                                                       "COMET_DTYPE_FP8_BLOCK"},
        {"fp8 resend_x", 0, 2, COMET_SUCCESS, ""},
        {"fp8 resend_x", 2, 2, COMET_INVALID_ARGUMENT, "config.resend_x = 2: must be 0"},
        {"resend_x", 2, 2, COMET_INVALID_ARGUMENT, "config.resend_x = 2: must be 0"},
        {"resend_x", -1, 2, COMET_INVALID_ARGUMENT, "config.resend_x = -1"},
        {"resend_x", 1, 2, COMET_SUCCESS, ""},
        {"version", 0, 2, COMET_INVALID_ARGUMENT, "config.version = 0: this library knows versions 1..3"},
        {"version", 4, 2, COMET_INVALID_ARGUMENT, "config.version = 4"},
        {"v1 fp8", 1, 2, COMET_INVALID_ARGUMENT, "config.version = 1 with config.dtype = 1, fp8_pow2_scales = 0: "
                                                 "FP8 came in version 2"},
        {"v1 fp8", 2, 2, COMET_SUCCESS, ""},
        {"wgrad_cublaslt version", 2, 2, COMET_INVALID_ARGUMENT, "config.version = 2 with "
                                                                 "config.fp8_wgrad_cublaslt = 1: the field came in "
                                                                 "version 3"},
        {"wgrad_cublaslt version", 3, 2, COMET_SUCCESS, ""},
        {"world", 0, 0, COMET_INVALID_ARGUMENT, "world size 0"},
        {"size", 3, 2, COMET_INVALID_ARGUMENT, "COMET_MOE_CONFIG_INIT"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        comet_moe_config_t c = base;
        const char *f = cases[i].field;
        int v = cases[i].value;
        if (!strcmp(f, "hidden")) c.hidden = v;
        else if (!strcmp(f, "ffn")) c.ffn = v;
        else if (!strcmp(f, "num_experts")) c.num_experts = v;
        else if (!strcmp(f, "top_k")) c.top_k = v;
        else if (!strcmp(f, "max_tokens")) c.max_tokens = v;
        else if (!strcmp(f, "ep_size")) c.ep_size = v;
        else if (!strcmp(f, "tp_size")) c.tp_size = v;
        else if (!strcmp(f, "dtype")) c.dtype = (comet_dtype_t)v;
        else if (!strcmp(f, "fp8_pow2_scales")) c.fp8_pow2_scales = v;
        else if (!strcmp(f, "fp8 pow2")) c.dtype = COMET_DTYPE_FP8_BLOCK, c.fp8_pow2_scales = v;
        else if (!strcmp(f, "fp8_wgrad_cublaslt")) c.fp8_wgrad_cublaslt = v;
        else if (!strcmp(f, "fp8 wgrad_cublaslt")) c.dtype = COMET_DTYPE_FP8_BLOCK, c.fp8_wgrad_cublaslt = v;
        else if (!strcmp(f, "fp8 resend_x")) c.dtype = COMET_DTYPE_FP8_BLOCK, c.resend_x = v;
        else if (!strcmp(f, "resend_x")) c.resend_x = v;
        else if (!strcmp(f, "size")) c.size = (size_t)v;
        else if (!strcmp(f, "version")) c.version = (unsigned int)v;
        else if (!strcmp(f, "v1 fp8")) c.version = (unsigned int)v, c.dtype = COMET_DTYPE_FP8_BLOCK;
        else if (!strcmp(f, "wgrad_cublaslt version"))
            c.version = (unsigned int)v, c.dtype = COMET_DTYPE_FP8_BLOCK, c.fp8_wgrad_cublaslt = 1;
        char msg[512] = "";
        comet_status_t st = comet_moe_config_validate(&c, cases[i].world, msg, sizeof(msg));
        if (st != cases[i].status) printf("case %zu (%s = %d): %s\n", i, f, v, msg);
        CHECK_EQ(st, cases[i].status);
        CHECK_CONTAINS(msg, cases[i].message);
    }
    char msg[64];
    CHECK_EQ(comet_moe_config_validate(NULL, 2, msg, sizeof(msg)), COMET_INVALID_ARGUMENT);
    /* EP x TP layouts the world allows: 1 x 2, and 2 x 2 of 4 (ffn 256: 128 columns per TP rank). */
    comet_moe_config_t tp2 = base;
    tp2.ffn = 256;
    tp2.tp_size = 2;
    CHECK_EQ(comet_moe_config_validate(&tp2, 2, msg, sizeof(msg)), COMET_SUCCESS);
    CHECK_EQ(comet_moe_config_validate(&tp2, 4, msg, sizeof(msg)), COMET_SUCCESS);
    tp2.ep_size = 2;
    CHECK_EQ(comet_moe_config_validate(&tp2, 2, msg, sizeof(msg)), COMET_INVALID_ARGUMENT);
    /* A huge max_tokens with many ranks and a large top_k overflows the row index. */
    comet_moe_config_t c = base;
    c.max_tokens = 1 << 20;
    c.num_experts = 72;
    c.top_k = 32;
    char big[512];
    CHECK_EQ(comet_moe_config_validate(&c, 72, big, sizeof(big)), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(big, "config.max_tokens = 1048576");
    return 0;
}

/* Argument checks that run before anything touches a GPU. */
int test_api_rejects_bad_arguments(void)
{
    comet_comm_t comm = (comet_comm_t)0x1;
    CHECK_EQ(comet_comm_create(NULL, NULL, &comm), COMET_INVALID_ARGUMENT);
    CHECK(comm == NULL);
    CHECK_CONTAINS(comet_last_create_error(), "nccl communicator is NULL");
    CHECK_EQ(comet_comm_create((ncclComm_t)0x1, NULL, NULL), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "out is NULL");
    comet_comm_config_t bad = COMET_COMM_CONFIG_INIT;
    bad.timeout_ms = -5;
    CHECK_EQ(comet_comm_create((ncclComm_t)0x1, &bad, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "timeout_ms = -5");
    bad.timeout_ms = 3600001; /* past an hour: $COMET_TIMEOUT_MS's limit too */
    CHECK_EQ(comet_comm_create((ncclComm_t)0x1, &bad, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "timeout_ms = 3600001: must be 0..3600000");
    comet_comm_config_t raw;
    memset(&raw, 0, sizeof(raw));
    CHECK_EQ(comet_comm_create((ncclComm_t)0x1, &raw, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "COMET_COMM_CONFIG_INIT");
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    CHECK_EQ(comet_comm_create_from_id(&id, 2, 5, NULL, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "rank = 5: must be 0..nranks-1 = 1");
    CHECK_EQ(comet_comm_create_from_id(&id, 0, 0, NULL, &comm), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "nranks = 0");
    comet_moe_t moe = (comet_moe_t)0x1;
    comet_moe_config_t c = COMET_MOE_CONFIG_INIT;
    CHECK_EQ(comet_moe_create(NULL, &c, &moe), COMET_INVALID_ARGUMENT);
    CHECK(moe == NULL);
    CHECK_CONTAINS(comet_last_create_error(), "comm is NULL");
    CHECK_EQ(comet_moe_forward(NULL, NULL, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "comet_moe_forward: moe is NULL");
    CHECK_EQ(comet_moe_forward_train(NULL, NULL, NULL, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "comet_moe_forward_train: moe is NULL");
    CHECK_EQ(comet_moe_backward(NULL, NULL, 0), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "comet_moe_backward: moe is NULL");
    CHECK_EQ(comet_comm_destroy(NULL), COMET_SUCCESS);
    CHECK_EQ(comet_moe_destroy(NULL), COMET_SUCCESS);
    CHECK_EQ(comet_comm_get_async_error(NULL), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(comet_last_create_error(), "comet_comm_get_async_error: comm is NULL");
    return 0;
}

/* A layer handle as comet_moe_create would make it on one rank of `world`, with no GPU,
 * its config the "tiny" preset at 512 tokens: for the checks that read only its config,
 * world and message buffer. */
static struct comet_moe *hand_made_moe(struct comet_comm *comm, int world)
{
    memset(comm, 0, sizeof(*comm));
    comm->size = world;
    struct comet_moe *moe = calloc(1, sizeof(*moe));
    if (moe) moe->comm = comm;
    if (moe && comet_moe_config_preset("tiny", 512, &moe->cfg) != COMET_SUCCESS) {
        free(moe);
        return NULL;
    }
    return moe;
}

/* The FP8 forward's argument checks (layer/moe.c) and the sequential path's refusal of an
 * FP8 training forward, before anything is enqueued: on a handle made by hand, as
 * comet_moe_create would make it on one rank of `world` (the checks read its config, TP
 * size and message buffer alone, so no GPU is touched). Pointers are stand-ins that are
 * never read, 256-byte aligned unless a case misaligns one. */
typedef struct fp8_args_case {
    const char *name;
    int dtype, ffn, tp;
    int gate_up;       /* 1: gate_up, 0: gate and up apart */
    int scales;        /* bit 0: the weights' scales given, bit 1: x_scales given */
    int misalign;      /* 0: none; 1: weight_scales.down, 2: x_scales, 3: a scale without its weight;
                        * 4: none, but the struct stamped version 1 (before FP8) */
    comet_status_t status;
    const char *message;
} fp8_args_case_t;

int test_fp8_forward_args_refusals(void)
{
    static unsigned long long words[64] __attribute__((aligned(256)));
    char *p = (char *)words;
    const float *f = (const float *)(p + 256);
    const fp8_args_case_t cases[] = {
        {"FP8, gate_up with scales", COMET_DTYPE_FP8_BLOCK, 256, 1, 1, 3, 0, COMET_SUCCESS, ""},
        {"FP8, gate and up apart, ffn 192", COMET_DTYPE_FP8_BLOCK, 192, 1, 0, 1, 0, COMET_SUCCESS, ""},
        {"FP8, no scales", COMET_DTYPE_FP8_BLOCK, 256, 1, 1, 0, 0, COMET_INVALID_ARGUMENT,
         "args.weight_scales.gate_up is NULL: FP8 weights"},
        {"FP8, a scale without its weight", COMET_DTYPE_FP8_BLOCK, 256, 1, 1, 1, 3, COMET_INVALID_ARGUMENT,
         "but args.weights.gate is NULL"},
        {"FP8, down's scales misaligned", COMET_DTYPE_FP8_BLOCK, 256, 1, 1, 1, 1, COMET_INVALID_ARGUMENT,
         "args.weight_scales.down = "},
        {"FP8, x_scales misaligned", COMET_DTYPE_FP8_BLOCK, 256, 1, 1, 3, 2, COMET_INVALID_ARGUMENT,
         "args.x_scales = "},
        {"FP8, gate_up with ffn 192", COMET_DTYPE_FP8_BLOCK, 192, 1, 1, 1, 0, COMET_INVALID_ARGUMENT,
         "ffn / tp_size = 192: gate and up in one tensor need it a multiple of 128"},
        {"FP8, gate_up with ffn / tp 192", COMET_DTYPE_FP8_BLOCK, 384, 2, 1, 1, 0, COMET_INVALID_ARGUMENT,
         "ffn / tp_size = 192"},
        {"FP8, gate_up with ffn / tp 128", COMET_DTYPE_FP8_BLOCK, 256, 2, 1, 1, 0, COMET_SUCCESS, ""},
        {"FP8 scales in a version-1 args struct", COMET_DTYPE_FP8_BLOCK, 256, 1, 1, 1, 4, COMET_INVALID_ARGUMENT,
         "args.version = 1 with args.weight_scales or args.x_scales set"},
        {"bf16 with weight scales", COMET_DTYPE_BF16, 256, 1, 1, 1, 0, COMET_INVALID_ARGUMENT,
         "args.weight_scales.gate_up = "},
        {"bf16 with x_scales", COMET_DTYPE_BF16, 256, 1, 1, 2, 0, COMET_INVALID_ARGUMENT,
         "args.x_scales = "},
    };
    struct comet_comm comm;
    struct comet_moe *moe = hand_made_moe(&comm, 2);
    CHECK(moe != NULL);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const fp8_args_case_t *c = &cases[i];
        CHECK_EQ(comet_moe_config_preset("tiny", 512, &moe->cfg), COMET_SUCCESS);
        moe->cfg.dtype = (comet_dtype_t)c->dtype;
        moe->cfg.ffn = c->ffn;
        moe->cfg.tp_size = moe->tp = c->tp;
        moe->cfg.ep_size = moe->ep = comm.size / c->tp;
        char msg[512];
        CHECK_EQ(comet_moe_config_validate(&moe->cfg, comm.size, msg, sizeof(msg)), COMET_SUCCESS);
        moe->experts_per_rank = moe->cfg.num_experts / moe->ep;
        moe->ffn_local = c->ffn / c->tp;
        moe->err[0] = '\0';
        comet_moe_args_t a = COMET_MOE_ARGS_INIT;
        a.impl = COMET_IMPL_BASELINE;
        a.weights.down = p;
        if (c->gate_up) a.weights.gate_up = p;
        else a.weights.gate = a.weights.up = p;
        if (c->scales & 1) {
            a.weight_scales.down = c->misalign == 1 ? f + 1 : f;
            if (c->gate_up) a.weight_scales.gate_up = f;
            else a.weight_scales.gate = a.weight_scales.up = f;
            if (c->misalign == 3) a.weight_scales.gate = f;
        }
        if (c->scales & 2) a.x_scales = c->misalign == 2 ? f + 2 : f;
        if (c->misalign == 4) a.version = 1;
        const comet_status_t st = cometi_moe_check_args(moe, &a);
        if (st != c->status) printf("case %zu (%s): %s: %s\n", i, c->name, comet_status_string(st), moe->err);
        CHECK_EQ(st, c->status);
        CHECK_CONTAINS(moe->err, c->message);
    }
    /* An FP8 layer trains where SwiGLU's FP8 backward takes the ffn columns (whole 128-wide
     * blocks), on either path, and a training forward says why not before anything else. */
    moe->cfg.dtype = COMET_DTYPE_FP8_BLOCK, moe->ffn_local = 192;
    CHECK_EQ(cometi_fp8_train_supported(moe), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(moe->err, "ffn / tp_size = 192 must be a multiple of 128");
    moe->ffn_local = 256;
    CHECK_EQ(cometi_fp8_train_supported(moe), COMET_SUCCESS);
    moe->cfg.dtype = COMET_DTYPE_BF16, moe->ffn_local = 192; /* bf16 trains at any ffn */
    CHECK_EQ(cometi_fp8_train_supported(moe), COMET_SUCCESS);
    free(moe);
    return 0;
}

/* The FP8 backward's refusals of its weights (cometi_moe_check_backward_args), on a handle
 * and a saved state made by hand: a sequential forward of no tokens, so dy, dx and x are
 * not asked for and the weights' checks decide. Pointers are stand-ins, never read. First
 * of all, a struct stamped version 1 (before FP8) may not set weights_t or
 * weight_t_scales. */
int test_backward_fp8_args_refusals(void)
{
    struct comet_comm comm;
    struct comet_moe *moe = hand_made_moe(&comm, 2);
    CHECK(moe != NULL);
    struct comet_moe_saved saved;
    memset(&saved, 0, sizeof(saved));
    saved.moe = moe, saved.filled = 1, saved.path = COMETI_SAVED_SEQUENTIAL;
    static _Alignas(256) float p[64]; /* never read */
    const char *cases[][2] = {
        /* case, the message's part (empty: accepted) */
        {"all given", ""},
        {"gate apart", "args.weights_t.gate = "},
        {"up scales apart", "args.weight_t_scales.up = "},
        {"no down", "args.weights_t.down is NULL: the FP8 backward reads W^T in E4M3"},
        {"no gate_up scales", "args.weight_t_scales.gate_up is NULL"},
        {"down misaligned", "args.weights_t.down = "},
        {"grads apart", "give gate_up alone, as args.weights_t (FP8: always gate_up) does"},
        {"bf16 layer", "args.weights_t.gate_up = "},
        {"version 1", "args.version = 1 with args.weights_t or args.weight_t_scales set"},
        {"version 1, scales alone", "args.version = 1 with args.weights_t or args.weight_t_scales set"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const char *c = cases[i][0];
        moe->cfg.dtype = strcmp(c, "bf16 layer") ? COMET_DTYPE_FP8_BLOCK : COMET_DTYPE_BF16;
        comet_moe_backward_args_t a = COMET_MOE_BACKWARD_ARGS_INIT;
        a.saved = &saved;
        a.weights.gate_up = a.weights.down = p; /* the bf16 layer's (an FP8 one reads weights_t) */
        a.weights_t.gate_up = a.weights_t.down = p;
        a.weight_t_scales.gate_up = a.weight_t_scales.down = p;
        a.grads.gate_up = a.grads.down = p;
        if (!strcmp(c, "gate apart")) a.weights_t.gate = p;
        if (!strcmp(c, "up scales apart")) a.weight_t_scales.up = p;
        if (!strcmp(c, "no down")) a.weights_t.down = NULL;
        if (!strcmp(c, "no gate_up scales")) a.weight_t_scales.gate_up = NULL;
        if (!strcmp(c, "down misaligned")) a.weights_t.down = (const char *)p + 8;
        if (!strcmp(c, "grads apart")) a.grads.gate_up = NULL, a.grads.gate = a.grads.up = p;
        if (!strncmp(c, "version 1", 9)) a.version = 1;
        if (!strcmp(c, "version 1, scales alone")) a.weights_t.gate_up = a.weights_t.down = NULL;
        moe->err[0] = '\0';
        const comet_status_t st = cometi_moe_check_backward_args(moe, &a);
        const comet_status_t want = cases[i][1][0] ? COMET_INVALID_ARGUMENT : COMET_SUCCESS;
        if (st != want) printf("case %s: %s: %s\n", c, comet_status_string(st), moe->err);
        CHECK_EQ(st, want);
        CHECK_CONTAINS(moe->err, cases[i][1]);
    }
    free(moe);
    return 0;
}

/* comet_moe_saved_bytes' checks of the saved config, on a handle made by hand as above
 * (they read the layer's config, world and experts per rank; sizing touches no GPU). */
int test_saved_config_refusals(void)
{
    struct comet_comm comm;
    struct comet_moe *moe = hand_made_moe(&comm, 2);
    CHECK(moe != NULL);
    moe->cfg.dtype = COMET_DTYPE_FP8_BLOCK, moe->cfg.ffn = 256;
    moe->ep = 2, moe->tp = 1, moe->experts_per_rank = moe->cfg.num_experts / 2, moe->ffn_local = 256;
    const int64_t worst = 2LL * 512 * (moe->cfg.top_k < moe->experts_per_rank ? moe->cfg.top_k : moe->experts_per_rank);
    struct {
        const char *name;
        unsigned int version;
        int64_t max_recv_rows;
        int gate_up_e4m3, bf16_layer;
        comet_status_t status;
        const char *message;
    } cases[] = {
        {"defaults", COMET_API_VERSION, 0, 0, 0, COMET_SUCCESS, ""},
        {"[g u] in E4M3", COMET_API_VERSION, 0, 1, 0, COMET_SUCCESS, ""},
        {"a bound", COMET_API_VERSION, 1000, 1, 0, COMET_SUCCESS, ""},
        {"version 0", 0, 0, 0, 0, COMET_INVALID_ARGUMENT, "saved config.version = 0: this library knows 1..3"},
        {"version 1 with [g u] in E4M3", 1, 0, 1, 0, COMET_INVALID_ARGUMENT,
         "saved config.version = 1 with gate_up_e4m3 = 1: the field came in version 2"},
        {"version 1, bf16 [g u]", 1, 0, 0, 0, COMET_SUCCESS, ""},
        {"gate_up_e4m3 2", COMET_API_VERSION, 0, 2, 0, COMET_INVALID_ARGUMENT, "saved config.gate_up_e4m3 = 2"},
        {"E4M3 [g u] on bf16", COMET_API_VERSION, 0, 1, 1, COMET_INVALID_ARGUMENT,
         "gate_up_e4m3 = 1 is for layers of dtype COMET_DTYPE_FP8_BLOCK (this one's is 0)"},
        {"bound below 0", COMET_API_VERSION, -1, 0, 0, COMET_INVALID_ARGUMENT, "max_recv_rows = -1: must be 0"},
        {"bound past the worst case", COMET_API_VERSION, worst + 1, 0, 0, COMET_INVALID_ARGUMENT,
         "max_tokens x min(top_k, experts per rank)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        comet_moe_saved_config_t c = COMET_MOE_SAVED_CONFIG_INIT;
        c.version = cases[i].version, c.max_recv_rows = cases[i].max_recv_rows;
        c.gate_up_e4m3 = cases[i].gate_up_e4m3;
        moe->cfg.dtype = cases[i].bf16_layer ? COMET_DTYPE_BF16 : COMET_DTYPE_FP8_BLOCK;
        size_t bytes = 0;
        const comet_status_t st = comet_moe_saved_bytes(moe, &c, &bytes);
        if (st != cases[i].status) printf("case %zu (%s): %s\n", i, cases[i].name, comet_last_create_error());
        CHECK_EQ(st, cases[i].status);
        if (st == COMET_SUCCESS) CHECK(bytes > 0);
        else CHECK_CONTAINS(comet_last_create_error(), cases[i].message);
    }
    free(moe);
    return 0;
}
