/*
 * test_gemm_variants.c - every row of the grouped GEMM's table (src/gemm/variants.h):
 * on the CPU, the table's promises (each row's stages fit its shared memory, no two rows
 * alike) and that a description with a row's choices resolves to that row and is checked
 * against it; on a GPU, every row against float64, element by element, with the role its
 * row takes: a new row is tested here without a new test.
 *
 * The problem (groups along M): tokens routed to 4 experts by a random routing (one
 * expert gets none), each expert's rows a segment of A padded to 128, as the route lays
 * them out on one rank; A holds each row's token. Groups along K: the same segments as
 * each expert's k, padding rows zero. Per row:
 *   store, swiglu   C (bf16) against float64, padding rows and columns past n untouched;
 *   swiglu_gu       the kept gate and up too (E4M3's too, in bf16 or E4M3 with their
 *                   scales; rows past gu_rows untouched);
 *   push            the rows in their owners' slots (one rank: its own), the count raised;
 *   fp32 add        C = C0 + the sums;
 *   dispatch        A filled by the dispatch blocks from the tokens (A poisoned first);
 *   splits          two column splits, each split's rows counted.
 * E4M3 rows: A and B random codes with random block scales, against float64 on the
 * dequantized operands (run_row_e4m3).
 * Each row runs on a small static grid (many tiles a block) and on the shared tile counter
 * (every SM), poisoned outputs before each.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "layer/layer.h"
#include "gemm/gemm.h"
#include "gemm/schedule.h"
#include "base/fp8.h"
#include "testutil.h"
#include "gpu_util.h"

/* ---- the table ---- */

/* Along K, B's column scales (cometi_gemm_col_scale_pos, in words): each column pair's two
 * bf16 scales in one word of the slot; a thread's pairs j (columns h 128 + 8 j + 2 q, q =
 * t % 4) j words apart from its half's first, which is 16-byte aligned; a warp's 16-byte
 * loads (four runs) and the scale warp's copies of 32 consecutive pairs each free of bank
 * conflicts. */
static int check_col_scale_layout(cometi_gemm_variant_t v)
{
    const int words = 4 * cometi_gemm_col_scale_run(v);
    unsigned char seen[4 * (256 / 8 + 8)] = {0};
    CHECK(words <= (int)sizeof(seen));
    for (int c = 0; c < v.block_n; c += 2) {
        const int pos = cometi_gemm_col_scale_pos(v, c);
        CHECK(pos >= 0 && pos < words && !seen[pos]);
        seen[pos] = 1;
        CHECK_EQ(cometi_gemm_col_scale_pos(v, c + 1), pos); /* the pair's word */
        const int h = c / 128, q = (c % 8) / 2, j = (c % 128) / 8, first = cometi_gemm_col_scale_pos(v, h * 128 + 2 * q);
        CHECK_EQ(pos, first + j);
        CHECK((COMETI_GEMM_BM + first) % 4 == 0);
        CHECK_EQ(pos, cometi_gemm_col_scale_pos(v, c % 64) + 8 * (c / 64)); /* the scale warp's copies */
    }
    for (int i = 0; i < v.block_n / 32; i++) { /* load i of the four runs: 16 words in 16 banks */
        unsigned banks = 0;
        for (int q = 0; q < 4; q++)
            for (int f = 0; f < 4; f++) {
                const unsigned bank = 1u << ((COMETI_GEMM_BM + cometi_gemm_col_scale_pos(v, 2 * q) + 4 * i + f) % 32);
                CHECK(!(banks & bank));
                banks |= bank;
            }
    }
    for (int c0 = 0; c0 < v.block_n; c0 += 64) { /* the scale warp's 32 copies of 32 pairs */
        unsigned banks = 0;
        for (int lane = 0; lane < 32; lane++)
            banks |= 1u << ((COMETI_GEMM_BM + cometi_gemm_col_scale_pos(v, c0 + 2 * lane)) % 32);
        CHECK(banks == 0xffffffffu);
    }
    return 0;
}

/* Every row: a known format and tile width, stages that fit (the most that do, up to the
 * cap), the choices a kernel needs together, and no two rows alike. */
int test_gemm_variant_table(void)
{
    for (int i = 0; i < COMETI_GEMM_NUM_VARIANTS; i++) {
        const cometi_gemm_variant_t v = cometi_gemm_variants[i];
        const int stages = cometi_gemm_stages(v), smem = cometi_gemm_smem_bytes(v);
        printf("%-20s %d stages, %6d bytes of shared memory\n", v.name, stages, smem);
        CHECK(cometi_gemm_element_bytes(v.a_type) > 0 && cometi_gemm_element_bytes(v.b_type) > 0);
        CHECK(v.block_n == 128 || v.block_n == 256);
        CHECK(stages >= 2 && smem <= COMETI_GEMM_SMEM_LIMIT);
        CHECK(stages == COMETI_GEMM_MAX_STAGES ||
              cometi_gemm_fixed_bytes(stages + 1) + cometi_gemm_staging_bytes(v) +
                      (stages + 1) * (cometi_gemm_stage_bytes(v) + cometi_gemm_scale_slot_bytes(v)) >
                  COMETI_GEMM_SMEM_LIMIT);
        /* E4M3's stages carry their scales' slot (A's 128 rows, B's blocks or, along K, its
         * rows), whose size keeps the mbarriers after the slots 8-byte aligned. */
        const int swiglu = cometi_gemm_is_swiglu(v.epilogue);
        const int along_k = v.along == COMETI_GEMM_GROUPS_ALONG_K, e4m3 = v.a_type == COMETI_GEMM_E4M3;
        CHECK_EQ(cometi_gemm_scale_slot_bytes(v),
                 !e4m3 ? 0 : along_k ? (COMETI_GEMM_BM + v.block_n / 2 + 32) * 4 : (COMETI_GEMM_BM + 4) * 4);
        CHECK(cometi_gemm_scale_slot_bytes(v) % 16 == 0);
        if (e4m3 && along_k) CHECK(check_col_scale_layout(v) == 0);
        /* SwiGLU tiles hold 128 gate and 128 up columns of one expert. */
        CHECK(!swiglu || (v.block_n == 256 && v.b_major == COMETI_GEMM_K_MAJOR && !along_k));
        /* The push stages its parts like C's boxes; fp32 adds go from the registers. */
        CHECK(v.epilogue != COMETI_GEMM_EPI_PUSH || v.store == COMETI_GEMM_STORE_TMA);
        CHECK(v.epilogue != COMETI_GEMM_EPI_ADD_FP32 || (v.store == COMETI_GEMM_STORE_DIRECT && along_k));
        /* Groups along K: both operands MN-major (bf16) or K-major (E4M3), cooperative, no
         * role (k is per group). */
        const int operands_major = e4m3 ? COMETI_GEMM_K_MAJOR : COMETI_GEMM_MN_MAJOR;
        CHECK(!along_k || (v.a_major == operands_major && v.b_major == operands_major &&
                           v.schedule == COMETI_GEMM_COOPERATIVE && !v.roles));
        CHECK(along_k || v.a_major == COMETI_GEMM_K_MAJOR);
        /* Ping-pong: 64-row tiles of the forward's layout, 256 wide. */
        CHECK(v.schedule != COMETI_GEMM_PINGPONG || (v.block_n == 256 && v.b_major == COMETI_GEMM_K_MAJOR && !along_k));
        /* A role is one pattern: dispatch -> GEMM or GEMM -> combine, never both, never
         * beside the push (which is GEMM -> combine already). */
        CHECK(v.roles != (COMETI_GEMM_ROLE_DISPATCH | COMETI_GEMM_ROLE_SPLITS));
        CHECK(v.epilogue != COMETI_GEMM_EPI_PUSH || !v.roles);
        /* Every row that pushes or counts compiles the push and the split counts in; the other
         * E4M3 rows (plain, dispatch) compile them out, beside the promotion's registers. */
        const int pushes_or_counts = v.epilogue == COMETI_GEMM_EPI_PUSH || (v.roles & COMETI_GEMM_ROLE_SPLITS);
        CHECK(!pushes_or_counts || cometi_gemm_keeps_push(v));
        CHECK(!e4m3 || pushes_or_counts || !cometi_gemm_keeps_push(v));
        /* E4M3: both operands K-major (8-bit wgmma reads K-major alone); the quantizing
         * SwiGLU is E4M3's. */
        CHECK(v.b_type == v.a_type);
        CHECK(!e4m3 || (v.a_major == COMETI_GEMM_K_MAJOR && v.b_major == COMETI_GEMM_K_MAJOR));
        /* E4M3's roles: the dispatch with the quantizing SwiGLU (GEMM0) and with the store
         * (the backward's dy W2); the splits and the push with the store (GEMM1). */
        CHECK(!e4m3 || (cometi_gemm_quantizes(v.epilogue) ? v.roles != COMETI_GEMM_ROLE_SPLITS
                        : v.epilogue == COMETI_GEMM_EPI_STORE                                  ? 1
                        : v.epilogue == COMETI_GEMM_EPI_PUSH || v.epilogue == COMETI_GEMM_EPI_ADD_FP32
                            ? v.roles == COMETI_GEMM_ROLE_NONE
                            : 0));
        CHECK(e4m3 || !cometi_gemm_quantizes(v.epilogue));
        CHECK(cometi_gemm_stage_bytes(v) == (cometi_gemm_tile_rows(v) + v.block_n) * 128);
        /* The TMA store's staging: E4M3 bytes of the whole tile (quantizing), or bf16 boxes
         * of 64 x 64, all of a warpgroup's at once or, where that would cost E4M3's long-k
         * rows (along M) their fourth stage, one a round. */
        const int boxes = cometi_gemm_store_boxes(v), all_boxes = cometi_gemm_out_cols(v) / 64;
        CHECK(boxes >= 1 && all_boxes % boxes == 0);
        CHECK_EQ(cometi_gemm_staging_bytes(v), v.store != COMETI_GEMM_STORE_TMA ? 0
                                               : cometi_gemm_quantizes(v.epilogue)
                                                   ? COMETI_GEMM_BM * cometi_gemm_out_cols(v)
                                                   : COMETI_GEMM_BM * 64 * boxes * 2);
        CHECK(boxes == all_boxes || (e4m3 && !along_k));
        if (e4m3 && !along_k) CHECK_EQ(stages, COMETI_GEMM_MAX_STAGES);
        for (int j = 0; j < i; j++) {
            cometi_gemm_variant_t w = cometi_gemm_variants[j];
            CHECK(strcmp(w.name, v.name) != 0);
            memcpy(w.name, v.name, sizeof(w.name));
            CHECK(memcmp(&w, &v, sizeof(v)) != 0); /* two rows alike: one kernel twice */
        }
    }
    return 0;
}

/* ---- a description of a row's choices ---- */

/* The buffers a description points at (device memory on a GPU; aligned stand-ins on the
 * CPU, where only the checks read them). */
typedef struct problem {
    int groups, n, k, m_out, ldc;
    int64_t a_rows;
    const cometi_segment_t *segs;
    void *a, *b, *c, *gu;
    void *up;                          /* E4M3 SwiGLU with up apart, or NULL */
    float *a_scale, *b_scale, *up_scale, *c_scale; /* E4M3 */
    uint16_t *b_scale16;               /* E4M3 along K: B's scales as bf16, in place of b_scale */
    int64_t a_scale_row, a_scale_block, c_scale_row, c_scale_block;
    int64_t b_scale_row, b_scale_block; /* E4M3 along K: B^T's rows' */
    int64_t a_ld;
    int pow2;
    int64_t gu_rows;
    float *gu_scale;                   /* SWIGLU_E4M3_GU8: [2n / 128][gu_rows] */
    cometi_async_error_t *err;
    unsigned int *sched;
    cometi_gemm_dispatch_t dispatch;
    cometi_gemm_splits_t splits;
    cometi_gemm_push_t push;
} problem_t;

/* n per row: SwiGLU 192 (a half-full last tile of 128 outputs), the push 320 (its slots'
 * width), splits 512 (two splits of whole tiles at both widths), the rest 320 (a partial
 * last tile at both widths), C 64 columns wider where the store allows (a store past n
 * would show there). */
static int row_n(const cometi_gemm_variant_t *v)
{
    if (cometi_gemm_quantizes(v->epilogue)) return 256; /* gate and up in one tensor: whole blocks */
    if (cometi_gemm_is_swiglu(v->epilogue)) return 192;
    return v->roles & COMETI_GEMM_ROLE_SPLITS ? 512 : 320;
}

static cometi_gemm_t describe(const cometi_gemm_variant_t *v, problem_t *p)
{
    cometi_gemm_t g;
    memset(&g, 0, sizeof(g));
    g.problem.along = v->along;
    g.problem.groups = p->groups;
    g.problem.n = p->n;
    g.problem.k = v->along == COMETI_GEMM_GROUPS_ALONG_K ? 0 : p->k;
    g.problem.m_out = v->along == COMETI_GEMM_GROUPS_ALONG_K ? p->m_out : 0;
    g.problem.segs = p->segs;
    g.a.ptr = p->a;
    g.a.rows = p->a_rows;
    g.a.type = v->a_type;
    g.a.major = v->a_major;
    g.b.ptr = p->b;
    g.b.up = p->up;
    g.b.type = v->b_type;
    g.b.major = v->b_major;
    if (v->a_type == COMETI_GEMM_E4M3) {
        g.a.ld = p->a_ld;
        g.a.scale = p->a_scale, g.a.scale_row = p->a_scale_row, g.a.scale_block = p->a_scale_block;
        g.b.scale = p->b_scale, g.b.up_scale = p->up ? p->up_scale : NULL;
        if (v->along == COMETI_GEMM_GROUPS_ALONG_K)
            g.b.scale = NULL, g.b.scale16 = p->b_scale16, g.b.scale_row = p->b_scale_row,
            g.b.scale_block = p->b_scale_block;
        if (cometi_gemm_quantizes(v->epilogue))
            g.out.c_scale = p->c_scale, g.out.c_scale_row = p->c_scale_row, g.out.c_scale_block = p->c_scale_block,
            g.out.pow2_scales = p->pow2;
    }
    g.out.epilogue = v->epilogue;
    g.out.store = v->store;
    g.out.c = v->epilogue == COMETI_GEMM_EPI_PUSH ? NULL : p->c;
    g.out.ldc = p->ldc;
    if (cometi_gemm_keeps_gu(v->epilogue)) g.out.gu = p->gu, g.out.gu_rows = p->gu_rows;
    if (v->epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8) g.out.gu_scale = p->gu_scale;
    if (v->epilogue == COMETI_GEMM_EPI_PUSH) g.out.push = &p->push;
    g.launch.schedule = v->schedule;
    g.launch.block_n = v->block_n;
    g.launch.sched = p->sched;
    g.err = p->err;
    if (v->roles & COMETI_GEMM_ROLE_DISPATCH) g.roles.dispatch = &p->dispatch;
    if (v->roles & COMETI_GEMM_ROLE_SPLITS) g.roles.splits = &p->splits;
    return g;
}

/* Prepares g and launches it on the default stream, checking first that it resolves to row
 * vi (vi < 0: any row); 1 with the error printed under `what`. */
static int prepare_and_launch(const cometi_gemm_t *g, int vi, const char *what)
{
    char err[COMETI_ERR_LEN];
    cometi_gemm_prepared_t prepared;
    comet_status_t st = cometi_gemm_prepare(err, g, &prepared);
    if (st != COMET_SUCCESS) printf("%s: %s\n", what, err);
    CHECK_EQ(st, COMET_SUCCESS);
    if (vi >= 0) CHECK_EQ(((const cometi_gemm_plan_t *)prepared.bytes)->variant, vi); /* this row's kernel runs */
    st = cometi_gemm_launch(err, &prepared, 0);
    if (st != COMET_SUCCESS) printf("%s: %s\n", what, err);
    CHECK_EQ(st, COMET_SUCCESS);
    return 0;
}

/* Stand-ins for the checks on the CPU: aligned addresses that are never read. */
static void stand_in_problem(const cometi_gemm_variant_t *v, problem_t *p)
{
    static unsigned long long words[64];
    memset(p, 0, sizeof(*p));
    void *any = (void *)(uintptr_t)0x10000;
    p->groups = 4, p->n = row_n(v), p->k = 192, p->m_out = 192;
    p->ldc = v->along == COMETI_GEMM_GROUPS_ALONG_K ? p->n : p->n + 64;
    p->a_rows = 1024;
    p->segs = (const cometi_segment_t *)any;
    p->a = p->b = p->c = p->gu = any;
    p->a_scale = p->b_scale = p->up_scale = p->c_scale = (float *)any;
    p->b_scale16 = (uint16_t *)any;
    p->a_scale_row = p->c_scale_row = p->b_scale_row = 1, p->a_scale_block = p->c_scale_block = 1024;
    p->b_scale_block = 1024;
    p->gu_rows = 1024;
    p->gu_scale = (float *)any;
    p->err = (cometi_async_error_t *)any;
    p->sched = (unsigned int *)words;
    p->dispatch.blocks = 8, p->dispatch.arrive = words, p->dispatch.expected = words;
    p->dispatch.rows.num_experts = 4, p->dispatch.rows.experts_per_group = 4, p->dispatch.rows.tp = 1;
    p->dispatch.rows.top_k = 2, p->dispatch.rows.row_bytes = p->k * cometi_gemm_element_bytes(v->a_type);
    p->splits.n_splits = 2, p->splits.split_done = words;
    cometi_combine_t *c = &p->push.combine;
    p->push.dest = any, p->push.maps = any;
    c->peers = (const cometi_combine_peer_t *)any;
    c->plan.counts = c->plan.send_offset = c->plan.recv_offset = (const int32_t *)any;
    c->world = 1, c->tp = 1, c->num_experts = 4, c->experts_per_group = 4, c->top_k = 2;
}

/* A description with a row's choices resolves to that row; one with choices no row has is
 * refused, naming them; a role's missing piece is named. */
int test_gemm_descriptions_resolve(void)
{
    char err[COMETI_ERR_LEN];
    for (int i = 0; i < COMETI_GEMM_NUM_VARIANTS; i++) {
        const cometi_gemm_variant_t *v = &cometi_gemm_variants[i];
        problem_t p;
        stand_in_problem(v, &p);
        cometi_gemm_t g = describe(v, &p);
        int got = -1;
        comet_status_t st = cometi_gemm_check(err, &g, &got);
        if (st != COMET_SUCCESS || got != i) printf("%s: status %d, row %d: %s\n", v->name, (int)st, got, err);
        CHECK_EQ(st, COMET_SUCCESS);
        CHECK_EQ(got, i);
        /* The tile order's bands: 16 row tiles for E4M3's 256-wide tiles along M, else 8,
         * unless group_m says. */
        const int e4m3_256_m = v->a_type == COMETI_GEMM_E4M3 && v->along == COMETI_GEMM_GROUPS_ALONG_M &&
                               v->block_n == 256;
        int band = -1, across = -1;
        cometi_gemm_tiling(&g, &band, &across);
        CHECK_EQ(band, e4m3_256_m ? 16 : 8);
        CHECK_EQ(across, (g.problem.n + cometi_gemm_out_cols(*v) - 1) / cometi_gemm_out_cols(*v));
        cometi_gemm_t none = g;
        none.out.epilogue = -1; /* no row has it */
        cometi_gemm_tiling(&none, &band, &across);
        CHECK(band == 0 && across == 0);
        CHECK_EQ(cometi_gemm_band_rows(&g, v->block_n), e4m3_256_m ? 16 : 8);
        g.launch.group_m = 5;
        CHECK_EQ(cometi_gemm_band_rows(&g, v->block_n), 5);
        g.launch.group_m = 0;
        /* With the store, schedule and width left to choose, a row of the same choices
         * otherwise: the TMA store where one is built. */
        g.out.store = COMETI_GEMM_STORE_AUTO, g.launch.schedule = 0, g.launch.block_n = 0;
        if (v->schedule == COMETI_GEMM_PINGPONG) g.launch.schedule = COMETI_GEMM_PINGPONG;
        CHECK_EQ(cometi_gemm_check(err, &g, &got), COMET_SUCCESS);
        const cometi_gemm_variant_t *w = &cometi_gemm_variants[got];
        cometi_gemm_tiling(&g, &band, &across); /* the width left to choose, as the check chose it */
        CHECK_EQ(across, (g.problem.n + cometi_gemm_out_cols(*w) - 1) / cometi_gemm_out_cols(*w));
        CHECK_EQ(band, cometi_gemm_band_rows(&g, w->block_n));
        CHECK(w->epilogue == v->epilogue && w->roles == v->roles && w->along == v->along && w->b_major == v->b_major);
        int tma_built = 0;
        for (int j = 0; j < COMETI_GEMM_NUM_VARIANTS; j++) {
            const cometi_gemm_variant_t *u = &cometi_gemm_variants[j];
            tma_built |= u->store == COMETI_GEMM_STORE_TMA && u->epilogue == v->epilogue && u->roles == v->roles &&
                         u->along == v->along && u->b_major == v->b_major && u->schedule == v->schedule;
        }
        CHECK_EQ(w->store == COMETI_GEMM_STORE_TMA, tma_built);
        /* A C whose rows are not 16-byte multiples cannot leave by TMA: the direct row, or a
         * refusal where none is built. */
        if (v->epilogue != COMETI_GEMM_EPI_PUSH && v->along == COMETI_GEMM_GROUPS_ALONG_M) {
            g.out.ldc = p.n + 2;
            st = cometi_gemm_check(err, &g, &got);
            if (st == COMET_SUCCESS) {
                CHECK_EQ(cometi_gemm_variants[got].store, COMETI_GEMM_STORE_DIRECT);
            } else {
                CHECK_EQ(st, COMET_NOT_SUPPORTED);
                CHECK_CONTAINS(err, "direct store");
                CHECK_CONTAINS(err, "the TMA store needs 16-byte rows of C (ldc)");
            }
        }
    }
    /* Choices no row has: named, with COMET_NOT_SUPPORTED. */
    problem_t p;
    stand_in_problem(&cometi_gemm_variants[COMETI_GEMM_V_nn_256], &p);
    cometi_gemm_t g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nn_256], &p);
    g.out.epilogue = COMETI_GEMM_EPI_SWIGLU;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "no variant is built for bf16 x bf16, A K-major, B MN-major, groups along M, epilogue swiglu");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_swiglu], &p);
    g.launch.block_n = 128;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "block_n 128");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_wgrad_256], &p);
    g.launch.schedule = COMETI_GEMM_PINGPONG;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "groups along K, epilogue store, TMA store, ping-pong");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256], &p);
    g.a.type = 3; /* a format no row has */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_NOT_SUPPORTED);
    /* Fields a row's choices need, missing or out of range: named. */
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_swiglu_gu], &p);
    g.out.gu = NULL;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "gu = (nil)");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_swiglu_gu8], &p);
    g.problem.n = 256, g.out.gu_scale = NULL;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "gu_scale = (nil)");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_swiglu_gu], &p);
    g.problem.n = 256, g.out.gu_scale = p.gu_scale; /* bf16 gate and up take none */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "take no gu_scale");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256_push], &p);
    g.out.push = NULL;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "the push epilogue needs where its rows go");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256], &p);
    g.problem.k = 100;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "gemm k = 100");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256], &p);
    g.out.store = COMETI_GEMM_STORE_TMA, g.out.ldc = 330;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "ldc = 330 must be a multiple of 8");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_wgrad_256], &p);
    g.problem.m_out = 100;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "m_out = 100");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256_splits], &p);
    g.problem.n = 320; /* a partial last tile: splits need whole tiles */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "n_splits = 2");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nn_256_dispatch], &p);
    p.dispatch.rows.row_bytes = 2 * p.k + 16; /* rows the GEMM does not read so */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "but A's rows are 384 bytes apart");
    p.dispatch.rows.row_bytes = 2 * p.k;
    g.launch.sched = NULL;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "shared tile counter (sched)");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256], &p);
    g.out.row_scale = (const float *)g.a.ptr, g.out.epilogue = COMETI_GEMM_EPI_PUSH, g.out.push = &p.push;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a row scale or index is for the store and SwiGLU epilogues");
    /* E4M3: the block scales each operand needs, named; bf16 takes none. */
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_nt_256], &p);
    g.a.scale = NULL;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a.scale = (nil)");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_nt_256], &p);
    g.a.scale_block = 0;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "scale_row = 1 and scale_block = 0 (>= 1)");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_nt_256], &p);
    g.a.ld = g.problem.k + 8; /* E4M3 rows of 16-byte multiples */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a.ld = 200");
    g.a.ld = g.problem.k + 16;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_SUCCESS);
    /* E4M3 rows whose k blocks lie apart: whole blocks, 16-byte strides, rows that hold them. */
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_nt_256], &p);
    g.problem.k = 256, g.a.ld = 512, g.a.kb_stride = 256;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_SUCCESS);
    g.a.kb_stride = 264;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a.kb_stride = 264: must be a multiple of 16 >= 128");
    g.a.kb_stride = 272; /* two blocks 272 apart: 544 bytes a row */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a.ld = 512 >= k / 128 x kb_stride");
    g.a.kb_stride = 256, g.problem.k = 208;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "with k = 208 a multiple of 128");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256], &p);
    g.a.kb_stride = 256;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "a.kb_stride = 256: for E4M3 rows along M without the dispatch role only");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_nt_256], &p);
    g.b.scale = NULL;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "b.scale = (nil), b.scale16 = (nil)");
    CHECK_CONTAINS(err, "b.scale must be set");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_nt_256], &p);
    g.problem.k = 200; /* E4M3 rows must be 16-byte multiples */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "gemm k = 200: must be a positive multiple of 16");
    g.problem.k = 208; /* a partial last block is fine */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_SUCCESS);
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_swiglu], &p);
    g.problem.n = 192; /* gate and up in one tensor would share a 128-row block */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "n = 192 with gate and up in one tensor must be a multiple of 128");
    g.b.up = g.b.ptr; /* apart, without its scales */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "b.up_scale = (nil)");
    CHECK_CONTAINS(err, "b.up_scale exactly when b.up is");
    g.b.up_scale = g.b.scale;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_SUCCESS);
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_swiglu], &p);
    g.problem.n = 256, g.out.c_scale = NULL;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "out.c_scale = (nil)");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_swiglu], &p);
    g.problem.n = 256, g.out.pow2_scales = 2;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "pow2_scales = 2");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_swiglu_direct], &p);
    g.problem.n = 256, g.out.row_index = (const int32_t *)g.a.ptr;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "the quantizing SwiGLU takes no row index");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_nt_256], &p);
    g.a.scale = (const float *)g.a.ptr;
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(err, "are for E4M3 operands; these are bf16");
    g = describe(&cometi_gemm_variants[COMETI_GEMM_V_fp8_nt_256], &p);
    g.b.major = COMETI_GEMM_MN_MAJOR; /* 8-bit wgmma has no transpose */
    CHECK_EQ(cometi_gemm_check(err, &g, &(int){0}), COMET_NOT_SUPPORTED);
    CHECK_CONTAINS(err, "no variant is built for e4m3 x e4m3, A K-major, B MN-major");
    return 0;
}

/* ---- every row on a GPU ---- */

#define GROUPS 4
#define K 192     /* along M: A's columns */
#define M_OUT 192 /* along K: C's rows per group (a partial last row tile at both widths) */
#define N_K 320   /* along K: B's columns (the rows' n) */
#define TOP_K 2

/* What every row shares: the routing, the segments, the tokens and A (along M), A and B
 * along K, and the report word. */
typedef struct shared {
    cometi_async_error_t *err_host, *err_dev;
    int tokens, rows, a_rows;          /* (token, choice) rows; A's rows with padding */
    cometi_segment_t segs_host[GROUPS];
    cometi_segment_t *segs;
    int32_t *src_of_host;              /* [a_rows] A row r's (t, j) index, -1 for padding */
    int32_t *slot_of_host;             /* [a_rows] its place in the send order (the push's slot) */
    uint16_t *x16, *a16;               /* tokens [tokens][K]; A [a_rows][K] as the route lays them */
    float *xf;
    void *x, *a;
    /* The dispatch's tables for one rank, int32 on the device. */
    int32_t *counts, *send_offset, *seg_start, *recv_offset, *src_of;
    unsigned long long *arrive, *expected;
    unsigned int *sched;
    /* Along K: A [a_rows][M_OUT] and B [a_rows][N_K] with zero padding rows. */
    uint16_t *ka16, *kb16;
    float *kaf, *kbf;
    void *ka, *kb;
} shared_t;

/* The routing and everything built from it (one rank, so every row is local). */
static int shared_open(shared_t *s, uint64_t *rng)
{
    s->tokens = 180;
    const int n = s->tokens * TOP_K;
    int32_t *ids = malloc(sizeof(int32_t) * n);
    for (int t = 0; t < s->tokens; t++) { /* two distinct experts of 0, 2, 3: expert 1 gets no row */
        const int e0 = (int)(cometi_rand_next(rng) % 3), e1 = (e0 + 1 + (int)(cometi_rand_next(rng) % 2)) % 3;
        ids[t * TOP_K] = e0 ? e0 + 1 : 0;
        ids[t * TOP_K + 1] = e1 ? e1 + 1 : 0;
    }
    int64_t counts[GROUPS] = {0};
    CHECK_EQ(cometi_route_count(ids, s->tokens, TOP_K, GROUPS, counts), -1);
    cometi_route_plan_t plan;
    char why[256];
    CHECK_EQ(cometi_route_plan_build(&plan, counts, 1, 1, GROUPS, COMETI_BLOCK_M, why, sizeof(why)), 0);
    int64_t *send_pos = malloc(sizeof(int64_t) * n), *recv_pos = malloc(sizeof(int64_t) * n);
    cometi_route_positions(&plan, 0, ids, s->tokens, TOP_K, send_pos, recv_pos);
    s->rows = n;
    s->a_rows = (int)plan.recv_rows[0] + 128; /* slack: no load reads past A */
    for (int g = 0; g < GROUPS; g++) s->segs_host[g] = (cometi_segment_t){(int)plan.seg_start[g], (int)plan.seg_rows[g]};
    CHECK_EQ(s->segs_host[1].rows, 0);
    s->src_of_host = malloc(sizeof(int32_t) * s->a_rows);
    s->slot_of_host = malloc(sizeof(int32_t) * s->a_rows);
    for (int r = 0; r < s->a_rows; r++) s->src_of_host[r] = s->slot_of_host[r] = -1;
    int32_t *src_of_send = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++)
        s->src_of_host[recv_pos[i]] = i, s->slot_of_host[recv_pos[i]] = (int32_t)send_pos[i], src_of_send[send_pos[i]] = i;
    s->x16 = malloc((size_t)s->tokens * K * 2), s->xf = malloc((size_t)s->tokens * K * 4);
    fill_bf16(s->xf, s->x16, (size_t)s->tokens * K, 1.0, rng);
    s->a16 = calloc((size_t)s->a_rows * K, 2);
    for (int r = 0; r < s->a_rows; r++)
        if (s->src_of_host[r] >= 0) memcpy(s->a16 + (size_t)r * K, s->x16 + (size_t)(s->src_of_host[r] / TOP_K) * K, K * 2);
    CUDA_OK(cudaMalloc(&s->x, (size_t)s->tokens * K * 2));
    CUDA_OK(cudaMalloc(&s->a, (size_t)s->a_rows * K * 2));
    CUDA_OK(cudaMemcpy(s->x, s->x16, (size_t)s->tokens * K * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&s->segs, sizeof(s->segs_host)));
    CUDA_OK(cudaMemcpy(s->segs, s->segs_host, sizeof(s->segs_host), cudaMemcpyHostToDevice));
    /* The plan's tables as the device route keeps them (int32). */
    int32_t t32[4][GROUPS];
    for (int e = 0; e < GROUPS; e++)
        t32[0][e] = (int32_t)plan.counts[e], t32[1][e] = (int32_t)plan.send_offset[e],
        t32[2][e] = (int32_t)plan.seg_start[e], t32[3][e] = (int32_t)plan.recv_offset[e];
    int32_t **dst[4] = {&s->counts, &s->send_offset, &s->seg_start, &s->recv_offset};
    for (int q = 0; q < 4; q++) {
        CUDA_OK(cudaMalloc((void **)dst[q], sizeof(t32[q])));
        CUDA_OK(cudaMemcpy(*dst[q], t32[q], sizeof(t32[q]), cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaMalloc((void **)&s->src_of, sizeof(int32_t) * n));
    CUDA_OK(cudaMemcpy(s->src_of, src_of_send, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
    const int blocks = s->a_rows / 128 + 1;
    CUDA_OK(cudaMalloc((void **)&s->arrive, sizeof(unsigned long long) * blocks));
    CUDA_OK(cudaMalloc((void **)&s->expected, sizeof(unsigned long long) * blocks));
    CUDA_OK(cudaMalloc((void **)&s->sched, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    CUDA_OK(cudaMemset(s->sched, 0, COMETI_GEMM_SCHED_WORDS * sizeof(unsigned int)));
    /* Along K: each group's k is its segment's rows; padding rows zero in both operands. */
    s->ka16 = calloc((size_t)s->a_rows * M_OUT, 2), s->kaf = calloc((size_t)s->a_rows * M_OUT, 4);
    s->kb16 = calloc((size_t)s->a_rows * N_K, 2), s->kbf = calloc((size_t)s->a_rows * N_K, 4);
    for (int g = 0; g < GROUPS; g++) {
        const size_t r0 = (size_t)s->segs_host[g].start, nr = (size_t)s->segs_host[g].rows;
        fill_bf16(s->kaf + r0 * M_OUT, s->ka16 + r0 * M_OUT, nr * M_OUT, 1.0, rng);
        fill_bf16(s->kbf + r0 * N_K, s->kb16 + r0 * N_K, nr * N_K, 0.5, rng);
    }
    CUDA_OK(cudaMalloc(&s->ka, (size_t)s->a_rows * M_OUT * 2));
    CUDA_OK(cudaMalloc(&s->kb, (size_t)s->a_rows * N_K * 2));
    CUDA_OK(cudaMemcpy(s->ka, s->ka16, (size_t)s->a_rows * M_OUT * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(s->kb, s->kb16, (size_t)s->a_rows * N_K * 2, cudaMemcpyHostToDevice));
    free(ids), free(send_pos), free(recv_pos), free(src_of_send);
    cometi_route_plan_free(&plan);
    return 0;
}

/* The dispatch role of one rank: its rows copied into A, each 128-row block's arrivals
 * counted against this call's totals (counters zeroed first). */
static int dispatch_role(shared_t *s, void *a, cometi_gemm_dispatch_t *d)
{
    const int blocks = s->a_rows / 128 + 1;
    unsigned long long *want = calloc(blocks, sizeof(unsigned long long));
    for (int g = 0; g < GROUPS; g++)
        for (int r = 0; r < s->segs_host[g].rows; r++) want[(s->segs_host[g].start + r) / 128]++;
    CUDA_OK(cudaMemcpy(s->expected, want, sizeof(unsigned long long) * blocks, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(s->arrive, 0, sizeof(unsigned long long) * blocks));
    free(want);
    memset(d, 0, sizeof(*d));
    d->blocks = 8;
    d->arrive = s->arrive;
    d->expected = s->expected;
    cometi_dispatch_t *r = &d->rows;
    r->x = s->x;
    r->src_of = s->src_of;
    r->plan = (cometi_route_tables_t){s->counts, s->send_offset, s->seg_start, s->recv_offset};
    r->num_experts = GROUPS, r->top_k = TOP_K, r->row_bytes = K * 2, r->experts_per_group = GROUPS, r->tp = 1;
    r->rank = 0;
    r->mode = COMETI_DISPATCH_BULK;
    r->recv[0] = a;
    r->arrive[0] = s->arrive;
    return 0;
}

/* One rank's push: row r of A to its place in the send order, as the layer's push sends it
 * (a whole 64-row part of one expert's rows then goes as tensor stores), into slots of n
 * bf16 columns, counted in the owner's counter. */
static int push_role(shared_t *s, int n, problem_t *p, void **slots, void **dest, void **maps,
                     cometi_combine_peer_t **peers, unsigned long long **peer_arrive)
{
    CUDA_OK(cudaMalloc(slots, (size_t)s->rows * n * 2));
    CUDA_OK(cudaMalloc((void **)peer_arrive, (COMETI_PUSH_COUNTER + 1) * sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(*peer_arrive, 0, (COMETI_PUSH_COUNTER + 1) * sizeof(unsigned long long)));
    int2 *dest_host = malloc(sizeof(int2) * s->a_rows);
    for (int r = 0; r < s->a_rows; r++) dest_host[r] = (int2){s->slot_of_host[r] >= 0 ? 0 : -1, s->slot_of_host[r]};
    CUDA_OK(cudaMalloc(dest, sizeof(int2) * s->a_rows));
    CUDA_OK(cudaMemcpy(*dest, dest_host, sizeof(int2) * s->a_rows, cudaMemcpyHostToDevice));
    free(dest_host);
    cometi_combine_peer_t peer = {NULL, *slots, *peer_arrive};
    CUDA_OK(cudaMalloc((void **)peers, sizeof(peer)));
    CUDA_OK(cudaMemcpy(*peers, &peer, sizeof(peer), cudaMemcpyHostToDevice));
    char err[COMETI_ERR_LEN];
    comet_status_t st = cometi_gemm_push_maps_create(err, slots, 1, 1, 0, s->rows, n, maps);
    if (st != COMET_SUCCESS) printf("push maps: %s\n", err);
    CHECK_EQ(st, COMET_SUCCESS);
    p->push.dest = *dest, p->push.maps = *maps;
    cometi_combine_t *cb = &p->push.combine;
    cb->peers = *peers;
    cb->plan = (cometi_route_tables_t){s->counts, s->send_offset, s->seg_start, s->recv_offset};
    cb->num_experts = GROUPS, cb->experts_per_group = GROUPS, cb->top_k = TOP_K, cb->world = 1, cb->tp = 1;
    return 0;
}

/* Two column splits, each split's rows counted in split_done (zeroed). */
static int splits_role(problem_t *p, unsigned long long **split_done)
{
    CUDA_OK(cudaMalloc((void **)split_done, 2 * sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(*split_done, 0, 2 * sizeof(unsigned long long)));
    p->splits.n_splits = 2, p->splits.split_done = *split_done;
    return 0;
}

/* The roles' running totals after call `run` (from 0): every row once per column tile of
 * its split, and pushed once per column tile, per call. */
static int check_role_counts(const shared_t *s, const unsigned long long *split_done,
                             const unsigned long long *peer_arrive, int tiles_n, int run)
{
    if (split_done) {
        unsigned long long done[2], want = (unsigned long long)s->rows * (tiles_n / 2) * (run + 1);
        CUDA_OK(cudaMemcpy(done, split_done, sizeof(done), cudaMemcpyDeviceToHost));
        CHECK_EQ(done[0], want);
        CHECK_EQ(done[1], want);
    }
    if (peer_arrive) {
        unsigned long long pushed;
        CUDA_OK(cudaMemcpy(&pushed, peer_arrive + COMETI_PUSH_COUNTER, sizeof(pushed), cudaMemcpyDeviceToHost));
        CHECK_EQ(pushed, (unsigned long long)s->rows * tiles_n * (run + 1));
    }
    return 0;
}

/* |got - want| within 2^-8 of want plus 1e-2 of the RMS of its row (bf16 output: one
 * rounding, 2^-9, over fp32 sums of at most 300 products). */
static int within(double got, double want, double rms) { return fabs(got - want) <= fabs(want) / 256 + 1e-2 * rms; }

/* One row of the table on this GPU, twice: on 5 blocks (static tiles) and on every SM
 * (the shared counter); with the dispatch role, on every SM with 8 dispatch blocks. */
static int run_row(shared_t *s, int vi, uint64_t *rng)
{
    const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
    const int along_k = v->along == COMETI_GEMM_GROUPS_ALONG_K, epi = v->epilogue;
    const int swiglu = epi == COMETI_GEMM_EPI_SWIGLU || epi == COMETI_GEMM_EPI_SWIGLU_GU;
    const int n = row_n(v), ldc = along_k ? n : n + 64;
    CHECK(!along_k || n == N_K);
    const int b_rows = along_k ? 0 : (swiglu ? 2 * n : n); /* B's rows per group */
    /* B: K-major [groups][b_rows][K], MN-major [groups][K][n] (along K: the shared kb). */
    const size_t nb = along_k ? 0 : (size_t)GROUPS * b_rows * K;
    uint16_t *b16 = malloc(nb * 2 + 2);
    float *bf = malloc(nb * 4 + 4);
    fill_bf16(bf, b16, nb, 1.0 / 16, rng);
    void *b = NULL;
    if (!along_k) {
        CUDA_OK(cudaMalloc(&b, nb * 2));
        CUDA_OK(cudaMemcpy(b, b16, nb * 2, cudaMemcpyHostToDevice));
    }
    /* B_g(k, j), the operand of output column j (SwiGLU: gate j, up j + n). */
#define B_AT(g, q, j) (v->b_major == COMETI_GEMM_MN_MAJOR ? bf[((size_t)(g) * K + (q)) * n + (j)] \
                                                          : bf[((size_t)(g) * b_rows + (j)) * K + (q)])
    /* The reference, float64: C rows (along M: a_rows x n; along K: groups x M_OUT x n), and
     * SwiGLU's gate and up. */
    const size_t c_rows = along_k ? (size_t)GROUPS * M_OUT : (size_t)s->a_rows;
    double *ref = calloc(c_rows * n, sizeof(double)), *ref_g = NULL, *ref_u = NULL;
    if (swiglu) ref_g = calloc(c_rows * n, sizeof(double)), ref_u = calloc(c_rows * n, sizeof(double));
    for (int g = 0; g < GROUPS; g++) {
        const cometi_segment_t sg = s->segs_host[g];
        if (along_k) {
            for (int r = sg.start; r < sg.start + sg.rows; r++)
                for (int i = 0; i < M_OUT; i++) {
                    const double av = s->kaf[(size_t)r * M_OUT + i];
                    double *out = ref + ((size_t)g * M_OUT + i) * n;
                    for (int j = 0; j < n; j++) out[j] += av * s->kbf[(size_t)r * N_K + j];
                }
            continue;
        }
        for (int r = sg.start; r < sg.start + sg.rows; r++) {
            const float *x = s->xf + (size_t)(s->src_of_host[r] / TOP_K) * K;
            for (int j = 0; j < n; j++) {
                double acc = 0, up = 0;
                for (int q = 0; q < K; q++) {
                    acc += (double)x[q] * B_AT(g, q, j);
                    if (swiglu) up += (double)x[q] * B_AT(g, q, j + n);
                }
                if (swiglu) ref_g[(size_t)r * n + j] = acc, ref_u[(size_t)r * n + j] = up;
                ref[(size_t)r * n + j] = swiglu ? cometi_swiglu(acc, up) : acc;
            }
        }
    }
#undef B_AT
    /* Outputs: C (bf16, or fp32 with a random start for the fp32 add), gu, the push's
     * slots and counters, the splits' counters, and A again for the dispatch. */
    const size_t nc = c_rows * ldc, c_bytes = nc * (epi == COMETI_GEMM_EPI_ADD_FP32 ? 4 : 2);
    void *c, *gu = NULL, *a = s->a;
    CUDA_OK(cudaMalloc(&c, c_bytes));
    float *c0 = NULL;
    if (epi == COMETI_GEMM_EPI_ADD_FP32) {
        c0 = malloc(c_bytes);
        for (size_t i = 0; i < nc; i++) c0[i] = (float)(cometi_rand_unit(rng) - 0.5);
    }
    if (epi == COMETI_GEMM_EPI_SWIGLU_GU) CUDA_OK(cudaMalloc(&gu, (size_t)s->a_rows * 2 * n * 2));
    if (v->roles & COMETI_GEMM_ROLE_DISPATCH) CUDA_OK(cudaMalloc(&a, (size_t)s->a_rows * K * 2));
    problem_t p;
    memset(&p, 0, sizeof(p));
    p.groups = GROUPS, p.n = n, p.k = K, p.m_out = M_OUT, p.ldc = ldc;
    p.a_rows = s->a_rows, p.segs = s->segs;
    p.a = along_k ? s->ka : a;
    p.b = along_k ? s->kb : b;
    p.c = c, p.gu = gu, p.gu_rows = s->a_rows;
    p.err = s->err_dev;
    unsigned long long *split_done = NULL, *peer_arrive = NULL;
    void *slots = NULL, *dest = NULL, *maps = NULL;
    cometi_combine_peer_t *peers = NULL;
    if ((v->roles & COMETI_GEMM_ROLE_SPLITS) && splits_role(&p, &split_done)) return 1;
    if (epi == COMETI_GEMM_EPI_PUSH && push_role(s, n, &p, &slots, &dest, &maps, &peers, &peer_arrive)) return 1;
    const int tiles_n = (n + cometi_gemm_out_cols(*v) - 1) / cometi_gemm_out_cols(*v);
    uint16_t *c16 = malloc(c_bytes), *gu16 = gu ? malloc((size_t)s->a_rows * 2 * n * 2) : NULL;
    uint16_t *slots16 = slots ? malloc((size_t)s->rows * n * 2) : NULL;
    float *c32 = (float *)c16;
    for (int run = 0; run < 2; run++) {
        const int dynamic = run == 1 || (v->roles & COMETI_GEMM_ROLE_DISPATCH);
        if (run == 1 && (v->roles & COMETI_GEMM_ROLE_DISPATCH)) break; /* it needs the shared counter: once */
        if (c0) CUDA_OK(cudaMemcpy(c, c0, c_bytes, cudaMemcpyHostToDevice));
        else CUDA_OK(cudaMemset(c, 0xff, c_bytes)); /* poison: bf16 NaN */
        if (gu) CUDA_OK(cudaMemset(gu, 0xff, (size_t)s->a_rows * 2 * n * 2));
        if (slots) CUDA_OK(cudaMemset(slots, 0xff, (size_t)s->rows * n * 2));
        if (v->roles & COMETI_GEMM_ROLE_DISPATCH) {
            CUDA_OK(cudaMemset(a, 0xff, (size_t)s->a_rows * K * 2)); /* every row must come from x */
            if (dispatch_role(s, a, &p.dispatch)) return 1;
        } else if (!along_k) {
            CUDA_OK(cudaMemcpy(a, s->a16, (size_t)s->a_rows * K * 2, cudaMemcpyHostToDevice));
        }
        p.sched = dynamic ? s->sched : NULL;
        cometi_gemm_t g = describe(v, &p);
        g.launch.sms = dynamic ? 0 : 5;
        if (prepare_and_launch(&g, vi, v->name)) return 1;
        CUDA_OK(cudaDeviceSynchronize());
        if (s->err_host->status) printf("%s: the pipeline reported site %d\n", v->name, s->err_host->site);
        CHECK_EQ(s->err_host->status, 0);
        CUDA_OK(cudaMemcpy(c16, c, c_bytes, cudaMemcpyDeviceToHost));
        if (gu) CUDA_OK(cudaMemcpy(gu16, gu, (size_t)s->a_rows * 2 * n * 2, cudaMemcpyDeviceToHost));
        if (slots) CUDA_OK(cudaMemcpy(slots16, slots, (size_t)s->rows * n * 2, cudaMemcpyDeviceToHost));
        /* Every output element of every row against float64; what no row owns untouched. */
        int bad = 0;
        double worst = 0;
        for (size_t r = 0; r < c_rows && bad < 5; r++) {
            int owned = along_k;
            int64_t slot = -1;
            if (!along_k) owned = s->src_of_host[r] >= 0, slot = s->slot_of_host[r];
            double ss = 0;
            for (int j = 0; j < n; j++) ss += ref[r * n + j] * ref[r * n + j];
            const double rms = sqrt(ss / n);
            for (int j = 0; j < ldc && bad < 5; j++) {
                const size_t at = r * ldc + j;
                if (epi == COMETI_GEMM_EPI_PUSH) {
                    if (j >= n || !owned) continue;
                    const double got = cometi_bf16_to_float(slots16[(size_t)slot * n + j]);
                    if (!within(got, ref[r * n + j], rms)) bad++, printf("%s: slot %lld col %d = %g, float64 %g\n",
                                                                         v->name, (long long)slot, j, got, ref[r * n + j]);
                    if (rms > 0 && fabs(got - ref[r * n + j]) / rms > worst) worst = fabs(got - ref[r * n + j]) / rms;
                    continue;
                }
                if (epi == COMETI_GEMM_EPI_ADD_FP32) {
                    const double want = c0[at] + ref[r * n + j];
                    if (!(fabs(c32[at] - want) <= 1e-5 * fabs(want) + 1e-4 * rms))
                        bad++, printf("%s: C[%zu][%d] = %g, want %g\n", v->name, r, j, c32[at], want);
                    if (rms > 0 && fabs(c32[at] - want) / rms > worst) worst = fabs(c32[at] - want) / rms;
                    continue;
                }
                if (j >= n || !owned) { /* past n, or padding: the poison stays */
                    if (c16[at] != 0xffff) bad++, printf("%s: C[%zu][%d] written (row owned %d)\n", v->name, r, j, owned);
                    continue;
                }
                const double got = cometi_bf16_to_float(c16[at]), want = ref[r * n + j];
                if (!within(got, want, rms)) bad++, printf("%s: C[%zu][%d] = %g, float64 %g\n", v->name, r, j, got, want);
                if (rms > 0 && fabs(got - want) / rms > worst) worst = fabs(got - want) / rms;
            }
            /* The kept gate and up: each its fp32 sum rounded to bf16 once. */
            for (int j = 0; gu && j < n && bad < 5; j++) {
                const double kg = cometi_bf16_to_float(gu16[r * 2 * n + j]), ku = cometi_bf16_to_float(gu16[r * 2 * n + n + j]);
                if (!owned) {
                    if (gu16[r * 2 * n + j] != 0xffff || gu16[r * 2 * n + n + j] != 0xffff) bad++;
                    continue;
                }
                const double wg = ref_g[r * n + j], wu = ref_u[r * n + j];
                if (!(fabs(kg - wg) <= 0x1p-8 * fabs(wg) + 1e-4) || !(fabs(ku - wu) <= 0x1p-8 * fabs(wu) + 1e-4))
                    bad++, printf("%s: kept g, u of row %zu col %d = %g, %g; float64 %g, %g\n", v->name, r, j, kg, ku, wg, wu);
            }
        }
        CHECK_EQ(bad, 0);
        if (check_role_counts(s, split_done, peer_arrive, tiles_n, run)) return 1;
        printf("%-20s %s: n %d, worst |error| / row RMS %.2e\n", v->name, dynamic ? "every SM, shared counter" :
               "5 blocks, static tiles  ", n, worst);
    }
    free(b16), free(bf), free(ref), free(ref_g), free(ref_u), free(c0), free(c16), free(gu16), free(slots16);
    cudaFree(b), cudaFree(c), cudaFree(gu), cudaFree(split_done), cudaFree(peer_arrive), cudaFree(slots);
    cudaFree(dest), cudaFree(maps), cudaFree(peers);
    if (a != s->a) cudaFree(a);
    return 0;
}

/* ---- the E4M3 rows ---- */

/* A random finite E4M3 code (0x7F and 0xFF are NaN); `exact`: 0 or +-0.5, 1, 2 (0x30,
 * 0x38, 0x40), whose block sums are multiples of 1/4 below 2^9: exact in any accumulator
 * of 11 bits or more. */
static uint8_t random_e4m3(uint64_t *rng, int exact)
{
    if (exact) {
        const uint64_t x = cometi_rand_next(rng) >> 20;
        static const uint8_t codes[4] = {0x00, 0x30, 0x38, 0x40};
        return (uint8_t)(codes[x % 4] | ((x >> 2 & 1) << 7));
    }
    for (;;) {
        const uint8_t c = (uint8_t)(cometi_rand_next(rng) >> 24);
        if ((c & 0x7f) != 0x7f) return c;
    }
}

/* A positive scale, 2^[-8, -2) times [1, 2): operands of several binades. */
static float random_scale(uint64_t *rng)
{
    return (float)(ldexp(1.0, -8 + (int)(cometi_rand_next(rng) % 6)) * (1.0 + cometi_rand_unit(rng)));
}

/* A block's scale against its values (float64, each within err of the GPU's): the 128
 * from `from` (below n) have amax / 448 = *want, which the scale matches within the errors
 * (/ 448), or, pow2, a power of two with *want in (scale / 2, scale]. */
static int block_scale_ok(const double *vals, const double *err, int from, int n, float scale, int pow2, double *want)
{
    double amax = 0, slack = 0;
    for (int c = from; c < from + 128 && c < n; c++) {
        amax = fmax(amax, fabs(vals[c]));
        slack = fmax(slack, 1.07 * err[c]);
    }
    *want = amax / 448;
    const double tol = slack / 448 + 1e-6 * *want;
    return pow2 ? scale > 0 && frexpf(scale, &(int){0}) == 0.5f && *want <= scale + tol && scale / 2 < *want + tol
                : fabs(scale - *want) <= tol;
}

/* An E4M3 row of the table against float64 on the dequantized operands: A [a_rows][K] of
 * random codes with scales per row per 128 columns (K = 192: a partial last block), laid
 * out MN-major apart (`kmajor` 0; C's scales too) or K-major after each row's values, as
 * the dispatch sends rows (`kmajor` 1: A's rows K + 16 bytes apart; C's scales K-major),
 * B per group [rows][K] with 128 x 128 block scales (gate and up in one tensor, or up
 * apart: `up_apart`), n columns (a partial last column tile or scale block where n is
 * not a multiple of the tile). The error allowed in a block's sum, e below, is a part of
 * S, the block's sum of |products| scaled: with `exact` codes (random_e4m3) every block
 * sum is exact in the tensor core and only the fp32 promotion rounds (2^-20 of S: a
 * misplaced scale or row shows as an error of the value's size); with any codes, the FP8
 * MMA's accumulator keeps about 14 bits (DeepSeek-V3, section 3.3.2): 128 additions each
 * truncated by at most 2^-13 of a partial sum (<= S) give 2^-6 of S. Store: bf16 output
 * (2^-8 of |C|) on top. Quantizing SwiGLU: the E4M3 rounding (2^-4 of |value|,
 * subnormals 2^-10 of the scale) on top of SwiGLU's propagation of the sums' errors, the
 * row's scale its amax / 448 (or, pow2, the power of two at or above it) within that
 * error; every row's block written once, padding rows and columns past n untouched. */
static int run_row_e4m3(shared_t *s, int vi, int n, int up_apart, int pow2, int exact, int kmajor, uint64_t *rng)
{
    const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
    const int quant = cometi_gemm_quantizes(v->epilogue), keep = cometi_gemm_keeps_gu(v->epilogue);
    const int kbs = (K + 127) / 128;
    const int64_t ld = s->a_rows + 8; /* the MN-major scales' ld: not A's rows */
    const int b_rows = quant && !up_apart ? 2 * n : n, b_blocks = (b_rows + 127) / 128, n_blocks = (n + 127) / 128;
    const int ldc = quant ? n + 32 : n + 64; /* E4M3 rows of bytes; bf16 elements */
    const int a_ld = kmajor ? K + 16 : K;    /* K-major: each row's 2 scales (16 bytes with padding) after it */
    /* A's scale (r, b) at sa[r * sa_row + b * sa_block], from sa, or from A's rows themselves. */
    const int64_t sa_row = kmajor ? a_ld / 4 : 1, sa_block = kmajor ? 1 : ld;
    const int64_t sc_row = kmajor ? n_blocks : 1, sc_block = kmajor ? 1 : ld;
    /* Operands. */
    uint8_t *a8 = malloc((size_t)s->a_rows * a_ld), *b8 = malloc((size_t)GROUPS * b_rows * K),
            *u8 = malloc((size_t)GROUPS * n * K);
    float *sa_apart = malloc(sizeof(float) * kbs * ld), *sb = malloc(sizeof(float) * GROUPS * b_blocks * kbs),
          *su = malloc(sizeof(float) * GROUPS * n_blocks * kbs);
    for (int r = 0; r < s->a_rows; r++) {
        for (int q = 0; q < K; q++) a8[(size_t)r * a_ld + q] = random_e4m3(rng, exact);
        for (int q = K; q < a_ld; q++) a8[(size_t)r * a_ld + q] = 0;
    }
    for (size_t i = 0; i < (size_t)GROUPS * b_rows * K; i++) b8[i] = random_e4m3(rng, exact);
    for (size_t i = 0; i < (size_t)GROUPS * n * K; i++) u8[i] = random_e4m3(rng, exact);
    const double acc_rel = exact ? 0x1p-20 : 0x1p-6;
    for (int r = 0; r < s->a_rows; r++)
        for (int b = 0; b < kbs; b++) {
            const float x = random_scale(rng);
            if (kmajor) memcpy(a8 + (size_t)r * a_ld + K + 4 * b, &x, 4);
            else sa_apart[(size_t)b * ld + r] = x;
        }
    /* K-major: the rows as the dispatch sends them, a token's row (values, then scales) in each
     * of its choices' rows of A. */
    uint8_t *x8 = malloc((size_t)s->tokens * a_ld);
    if (kmajor) {
        for (int t = 0; t < s->tokens; t++) memcpy(x8 + (size_t)t * a_ld, a8 + (size_t)t * a_ld, a_ld);
        for (int r = 0; r < s->a_rows; r++)
            if (s->src_of_host[r] >= 0)
                memcpy(a8 + (size_t)r * a_ld, x8 + (size_t)(s->src_of_host[r] / TOP_K) * a_ld, a_ld);
    }
    float *sa = kmajor ? malloc(sizeof(float) * s->a_rows * sa_row) : sa_apart;
    if (kmajor) memcpy(sa, a8, (size_t)s->a_rows * a_ld); /* the same bytes, read as floats */
    const size_t sa_first = kmajor ? K / 4 : 0;            /* where scale (0, 0) is in sa */
    for (size_t i = 0; i < (size_t)GROUPS * b_blocks * kbs; i++) sb[i] = random_scale(rng);
    for (size_t i = 0; i < (size_t)GROUPS * n_blocks * kbs; i++) su[i] = random_scale(rng);
    /* Output column j's B row: gate j (and up j + n, or j of the up tensor). */
#define A_AT(r, q) ((double)cometi_e4m3_decode(a8[(size_t)(r) * a_ld + (q)]) * \
                    sa[sa_first + (size_t)(r) * sa_row + (size_t)((q) / 128) * sa_block])
#define B_AT(g, j, q) ((double)cometi_e4m3_decode(b8[((size_t)(g) * b_rows + (j)) * K + (q)]) * \
                       sb[((size_t)(g) * b_blocks + (j) / 128) * kbs + (q) / 128])
#define U_AT(g, j, q) (up_apart ? (double)cometi_e4m3_decode(u8[((size_t)(g) * n + (j)) * K + (q)]) * \
                                      su[((size_t)(g) * n_blocks + (j) / 128) * kbs + (q) / 128]       \
                                : B_AT(g, (j) + n, q))
    const size_t nc = (size_t)s->a_rows * n;
    double *ref = calloc(nc, sizeof(double)), *err_bound = calloc(nc, sizeof(double));
    /* SWIGLU_E4M3_GU: the gate and up sums kept, and their errors. */
    double *ref_g = calloc(nc, sizeof(double)), *ref_u = calloc(nc, sizeof(double)), *ref_eg = calloc(nc, sizeof(double)),
           *ref_eu = calloc(nc, sizeof(double));
    for (int g = 0; g < GROUPS; g++) {
        const cometi_segment_t sg = s->segs_host[g];
        for (int r = sg.start; r < sg.start + sg.rows; r++)
            for (int j = 0; j < n; j++) {
                double c = 0, cs = 0, u = 0, us = 0;
                for (int q = 0; q < K; q++) {
                    const double x = A_AT(r, q), bg = B_AT(g, j, q);
                    c += x * bg, cs += fabs(x * bg);
                    if (quant) {
                        const double bu = U_AT(g, j, q);
                        u += x * bu, us += fabs(x * bu);
                    }
                }
                const double ec = acc_rel * cs, eu = acc_rel * us;
                ref[(size_t)r * n + j] = quant ? cometi_swiglu(c, u) : c;
                ref_g[(size_t)r * n + j] = c, ref_u[(size_t)r * n + j] = u;
                ref_eg[(size_t)r * n + j] = ec, ref_eu[(size_t)r * n + j] = eu;
                /* silu'(x) <= 1.1 and |silu(x)| <= |x| + 0.3: the sums' errors through SwiGLU. */
                err_bound[(size_t)r * n + j] = quant ? 1.1 * fabs(u) * ec + (fabs(c) + 0.3) * eu + ec * eu : ec;
            }
    }
#undef A_AT
#undef B_AT
#undef U_AT
    void *a = NULL, *b = NULL, *up = NULL, *c = NULL;
    float *dsa = NULL, *dsb = NULL, *dsu = NULL, *dsc = NULL;
    const size_t c_bytes = (size_t)s->a_rows * ldc * (quant ? 1 : 2), sc_bytes = sizeof(float) * n_blocks * ld;
    CUDA_OK(cudaMalloc(&a, (size_t)s->a_rows * a_ld));
    CUDA_OK(cudaMalloc(&b, (size_t)GROUPS * b_rows * K));
    CUDA_OK(cudaMalloc(&up, (size_t)GROUPS * n * K));
    CUDA_OK(cudaMalloc(&c, c_bytes));
    CUDA_OK(cudaMalloc((void **)&dsa, sizeof(float) * kbs * ld));
    CUDA_OK(cudaMalloc((void **)&dsb, sizeof(float) * GROUPS * b_blocks * kbs));
    CUDA_OK(cudaMalloc((void **)&dsu, sizeof(float) * GROUPS * n_blocks * kbs));
    CUDA_OK(cudaMalloc((void **)&dsc, sc_bytes));
    CUDA_OK(cudaMemcpy(a, a8, (size_t)s->a_rows * a_ld, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b, b8, (size_t)GROUPS * b_rows * K, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(up, u8, (size_t)GROUPS * n * K, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsa, sa_apart, sizeof(float) * kbs * ld, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsb, sb, sizeof(float) * GROUPS * b_blocks * kbs, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsu, su, sizeof(float) * GROUPS * n_blocks * kbs, cudaMemcpyHostToDevice));
    problem_t p;
    memset(&p, 0, sizeof(p));
    p.groups = GROUPS, p.n = n, p.k = K, p.ldc = ldc;
    p.a_rows = s->a_rows, p.segs = s->segs;
    p.a = a, p.b = b, p.up = quant && up_apart ? up : NULL, p.c = c;
    p.a_scale = kmajor ? (float *)((char *)a + K) : dsa, p.b_scale = dsb, p.up_scale = dsu, p.c_scale = dsc;
    p.a_ld = kmajor ? a_ld : 0, p.pow2 = pow2;
    p.a_scale_row = sa_row, p.a_scale_block = sa_block, p.c_scale_row = sc_row, p.c_scale_block = sc_block;
    p.err = s->err_dev;
    /* The kept gate and up (bf16, or GU8: E4M3 and scales): rows past gu_rows (the last 64
     * of A) must stay untouched. */
    const int gu8 = v->epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8;
    void *gu = NULL;
    float *dgs = NULL;
    p.gu_rows = s->a_rows - 64;
    const size_t gu_bytes = (size_t)s->a_rows * 2 * n * (gu8 ? 1 : 2), gs_bytes = sizeof(float) * (2 * n / 128) *
                                                                                     (size_t)p.gu_rows;
    if (keep) CUDA_OK(cudaMalloc(&gu, gu_bytes));
    if (gu8) CUDA_OK(cudaMalloc((void **)&dgs, gs_bytes));
    p.gu = gu, p.gu_scale = dgs;
    uint16_t *gu16 = keep ? malloc(gu_bytes) : NULL;
    uint8_t *gu8s = (uint8_t *)gu16;
    float *gscales = gu8 ? malloc(gs_bytes) : NULL;
    /* Roles: the dispatch (A filled from the tokens), the split counts, the push. */
    const int dispatch = v->roles & COMETI_GEMM_ROLE_DISPATCH, push = v->epilogue == COMETI_GEMM_EPI_PUSH;
    CHECK(!dispatch || kmajor);
    void *x_dev = NULL, *slots = NULL, *dest = NULL, *maps = NULL;
    unsigned long long *split_done = NULL, *peer_arrive = NULL;
    cometi_combine_peer_t *peers = NULL;
    if (dispatch) {
        CUDA_OK(cudaMalloc(&x_dev, (size_t)s->tokens * a_ld));
        CUDA_OK(cudaMemcpy(x_dev, x8, (size_t)s->tokens * a_ld, cudaMemcpyHostToDevice));
    }
    if ((v->roles & COMETI_GEMM_ROLE_SPLITS) && splits_role(&p, &split_done)) return 1;
    if (push && push_role(s, n, &p, &slots, &dest, &maps, &peers, &peer_arrive)) return 1;
    uint16_t *slots16 = push ? malloc((size_t)s->rows * n * 2) : NULL;
    const int tiles_n = (n + cometi_gemm_out_cols(*v) - 1) / cometi_gemm_out_cols(*v);
    uint8_t *c8 = malloc(c_bytes);
    uint16_t *c16 = (uint16_t *)c8;
    float *scales = malloc(sc_bytes);
    for (int run = 0; run < 2; run++) {
        const int dynamic = run == 1 || dispatch;
        if (run == 1 && dispatch) break; /* it needs the shared counter: once */
        CUDA_OK(cudaMemset(c, 0xff, c_bytes)); /* poison: NaN in E4M3 and bf16 */
        CUDA_OK(cudaMemset(dsc, 0xff, sc_bytes));
        if (gu) CUDA_OK(cudaMemset(gu, 0xff, gu_bytes));
        if (dgs) CUDA_OK(cudaMemset(dgs, 0xff, gs_bytes));
        if (slots) CUDA_OK(cudaMemset(slots, 0xff, (size_t)s->rows * n * 2));
        if (dispatch) {
            CUDA_OK(cudaMemset(a, 0xff, (size_t)s->a_rows * a_ld)); /* every row must come from the tokens */
            if (dispatch_role(s, a, &p.dispatch)) return 1;
            p.dispatch.rows.x = x_dev, p.dispatch.rows.row_bytes = a_ld;
        }
        p.sched = dynamic ? s->sched : NULL;
        cometi_gemm_t g = describe(v, &p);
        g.launch.sms = dynamic ? 0 : 5;
        if (prepare_and_launch(&g, vi, v->name)) return 1;
        CUDA_OK(cudaDeviceSynchronize());
        if (s->err_host->status) printf("%s: the pipeline reported site %d\n", v->name, s->err_host->site);
        CHECK_EQ(s->err_host->status, 0);
        CUDA_OK(cudaMemcpy(c8, c, c_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(scales, dsc, sc_bytes, cudaMemcpyDeviceToHost));
        if (gu) CUDA_OK(cudaMemcpy(gu16, gu, gu_bytes, cudaMemcpyDeviceToHost));
        if (dgs) CUDA_OK(cudaMemcpy(gscales, dgs, gs_bytes, cudaMemcpyDeviceToHost));
        if (slots) CUDA_OK(cudaMemcpy(slots16, slots, (size_t)s->rows * n * 2, cudaMemcpyDeviceToHost));
        int bad = 0;
        double worst = 0; /* |error| / its bound */
        for (int r = 0; r < s->a_rows && bad < 5; r++) {
            const int owned = s->src_of_host[r] >= 0;
            for (int j = 0; j < ldc && bad < 5; j++) {
                const size_t at = (size_t)r * ldc + j;
                const int poisoned = quant ? c8[at] == 0xff : c16[at] == 0xffff;
                if (push && !(owned && j < n)) continue; /* the push writes the slots alone */
                if (j >= n || !owned) {
                    if (!poisoned) bad++, printf("%s: C[%d][%d] written (row owned %d)\n", v->name, r, j, owned);
                    continue;
                }
                const double want = ref[(size_t)r * n + j];
                double got, bound = err_bound[(size_t)r * n + j];
                if (quant) {
                    const float scale = scales[(size_t)r * sc_row + (size_t)(j / 128) * sc_block];
                    got = (double)cometi_e4m3_decode(c8[at]) * scale;
                    bound = 0x1p-4 * fabs(want) + 0x1p-10 * scale + 1.07 * bound;
                } else {
                    /* The push: the row in its slot (its place in the send order). */
                    got = cometi_bf16_to_float(push ? slots16[(size_t)s->slot_of_host[r] * n + j] : c16[at]);
                    bound = 0x1p-8 * fabs(want) + 1.01 * bound;
                }
                if (!(fabs(got - want) <= bound))
                    bad++, printf("%s: C[%d][%d] = %.9g, float64 %.9g, bound %.3g\n", v->name, r, j, got, want, bound);
                if (bound > 0 && fabs(got - want) / bound > worst) worst = fabs(got - want) / bound;
            }
            /* GU8: each kept sum quantized to E4M3 with its row's block scale (its amax / 448, or
             * the power of two at or above it, within the sums' errors), rows past gu_rows and
             * their scales left. */
            for (int j = 0; gu8 && j < 2 * n && bad < 5; j++) {
                const size_t gi = (size_t)r * 2 * n + j;
                const int blk = j / 128;
                if (!owned || r >= p.gu_rows) {
                    if (gu8s[gi] != 0xff || (r < p.gu_rows && cometi_f32_bits(gscales[(size_t)blk * p.gu_rows + r]) !=
                                                                  0xffffffffu))
                        bad++, printf("%s: kept g, u of row %d written (owned %d)\n", v->name, r, owned);
                    continue;
                }
                const double *ref_gu = j < n ? ref_g : ref_u, *ref_e = j < n ? ref_eg : ref_eu;
                const size_t at = (size_t)r * n + j % n;
                const float scale = gscales[(size_t)blk * p.gu_rows + r];
                const double got = (double)cometi_e4m3_decode(gu8s[gi]) * scale, want = ref_gu[at];
                if (!(fabs(got - want) <= 0x1p-4 * fabs(want) + 0x1p-10 * scale + 1.07 * ref_e[at]))
                    bad++, printf("%s: kept %s of row %d col %d = %g (scale %g), float64 %g\n", v->name,
                                  j < n ? "g" : "u", r, j % n, got, scale, want);
                if (j % 128) continue;
                double ws;
                if (!block_scale_ok(ref_gu + (size_t)r * n, ref_e + (size_t)r * n, j % n, n, scale, pow2, &ws))
                    bad++, printf("%s: kept row %d block %d scale %.9g, amax / 448 = %.9g\n", v->name, r, blk, scale,
                                  ws);
            }
            /* The kept gate and up in bf16: each sum rounded to bf16 once, rows past gu_rows left. */
            for (int j = 0; gu && !gu8 && j < n && bad < 5; j++) {
                const size_t gi = (size_t)r * 2 * n + j, ui = gi + n;
                if (!owned || r >= p.gu_rows) {
                    if (gu16[gi] != 0xffff || gu16[ui] != 0xffff)
                        bad++, printf("%s: kept g, u of row %d written (owned %d)\n", v->name, r, owned);
                    continue;
                }
                const double kg = cometi_bf16_to_float(gu16[gi]), ku = cometi_bf16_to_float(gu16[ui]);
                const double wg = ref_g[(size_t)r * n + j], wu = ref_u[(size_t)r * n + j];
                if (!(fabs(kg - wg) <= 0x1p-8 * fabs(wg) + 1.01 * ref_eg[(size_t)r * n + j]) ||
                    !(fabs(ku - wu) <= 0x1p-8 * fabs(wu) + 1.01 * ref_eu[(size_t)r * n + j]))
                    bad++, printf("%s: kept g, u of row %d col %d = %g, %g; float64 %g, %g\n", v->name, r, j, kg, ku,
                                  wg, wu);
            }
            if (!quant) continue;
            /* The row's scales: its amax / 448 within the sums' errors, or a power of two
             * with amax / 448 in (scale / 2, scale]; blocks past n, and padding rows, left. */
            for (int blk = 0; blk < n_blocks && bad < 5; blk++) {
                const float scale = scales[(size_t)r * sc_row + (size_t)blk * sc_block];
                if (!owned) {
                    if (cometi_f32_bits(scale) != 0xffffffffu) bad++, printf("%s: scale of padding row %d written\n",
                                                                           v->name, r);
                    continue;
                }
                double want;
                if (!block_scale_ok(ref + (size_t)r * n, err_bound + (size_t)r * n, blk * 128, n, scale, pow2, &want))
                    bad++, printf("%s: row %d block %d scale %.9g, amax / 448 = %.9g (pow2 %d)\n", v->name, r,
                                  blk, scale, want, pow2);
            }
        }
        CHECK_EQ(bad, 0);
        if (check_role_counts(s, split_done, peer_arrive, tiles_n, run)) return 1;
        printf("%-20s %s: n %d%s%s%s%s, worst |error| / bound %.2f\n", v->name,
               dynamic ? "every SM, shared counter" : "5 blocks, static tiles  ", n, quant && up_apart ? ", up apart" : "",
               pow2 ? ", pow2 scales" : "", exact ? ", exact sums" : ", any codes",
               kmajor ? ", K-major scales" : ", MN-major scales", worst);
    }
    if (kmajor) free(sa);
    free(a8), free(x8), free(b8), free(u8), free(sa_apart), free(sb), free(su), free(ref), free(err_bound), free(c8),
        free(scales), free(slots16), free(ref_g), free(ref_u), free(ref_eg), free(ref_eu), free(gu16), free(gscales);
    cudaFree(gu), cudaFree(dgs);
    cudaFree(x_dev), cudaFree(split_done), cudaFree(peer_arrive), cudaFree(slots), cudaFree(dest), cudaFree(maps);
    cudaFree(peers);
    cudaFree(a), cudaFree(b), cudaFree(up), cudaFree(c), cudaFree(dsa), cudaFree(dsb), cudaFree(dsu), cudaFree(dsc);
    return 0;
}

/* An E4M3 weight-gradient row (groups along K) against float64 on the dequantized
 * operands: A^T [M_OUT][ld] and B^T [N_K][ld] (ld = A's rows + 16: not the tokens) of
 * random codes in each group's segment's token columns, zeros in the padding, with random
 * scales per row per 128 tokens laid out [token block][row]. C_g = A_g^T B_g over the
 * group's rows; a group without rows stores zeros (or adds nothing). The bound per
 * element is run_row_e4m3's: acc_rel of the scaled |products| summed (exact codes: the
 * fp32 promotion alone), then the bf16 store's 2^-8, or fp32's rounding of the add
 * (C starts at random values). Then a group starting off the 128-row grid: the report
 * word names it (COMETI_SITE_WGRAD_SEGMENT). */
/* The segments a weight-gradient row runs on: the shared routing's (one k block a group),
 * or long ones (5 and 8 k blocks, more than the ring's stages, an odd and an even count for
 * the pipelined 128-wide loop's two drains, and one of a single row). */
typedef struct wgrad_segs {
    const cometi_segment_t *host;
    cometi_segment_t *dev;
    int a_rows;    /* the tokens allocated */
    int row_major; /* A's scales [row][token block] rather than [token block][row] */
} wgrad_segs_t;

static int run_row_e4m3_wgrad(shared_t *s, const wgrad_segs_t *ws, int vi, int exact, uint64_t *rng)
{
    const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
    const int add = v->epilogue == COMETI_GEMM_EPI_ADD_FP32, n = N_K;
    const int64_t ld = ws->a_rows + 16, kbs = (ws->a_rows + 127) / 128;
    /* A's scales' layout: [token block][row], or [row][token block] (row_major); B's are bf16
     * (exact: drawn so), [token block][row], a row pair's in one word. */
    const int64_t sa_row = ws->row_major ? kbs : 1, sa_block = ws->row_major ? 1 : M_OUT;
    const int64_t sb_row = 1, sb_block = N_K;
    uint8_t *at = calloc((size_t)M_OUT * ld, 1), *bt = calloc((size_t)n * ld, 1);
    float *sa = malloc(sizeof(float) * kbs * M_OUT), *sb = malloc(sizeof(float) * kbs * n);
    for (int g = 0; g < GROUPS; g++)
        for (int r = ws->host[g].start; r < ws->host[g].start + ws->host[g].rows; r++) {
            for (int m = 0; m < M_OUT; m++) at[(size_t)m * ld + r] = random_e4m3(rng, exact);
            for (int j = 0; j < n; j++) bt[(size_t)j * ld + r] = random_e4m3(rng, exact);
        }
    for (int64_t i = 0; i < kbs * M_OUT; i++) sa[i] = random_scale(rng);
    uint16_t *sb16 = malloc(sizeof(uint16_t) * kbs * n);
    for (int64_t i = 0; i < kbs * n; i++) {
        sb16[i] = (uint16_t)(cometi_f32_bits(random_scale(rng)) >> 16);
        sb[i] = cometi_f32_from_bits((uint32_t)sb16[i] << 16);
    }
    const size_t nc = (size_t)GROUPS * M_OUT * n;
    double *ref = calloc(nc, sizeof(double)), *err_bound = calloc(nc, sizeof(double));
    float *c0 = malloc(sizeof(float) * nc);
    for (size_t i = 0; i < nc; i++) c0[i] = add ? (float)(cometi_rand_unit(rng) - 0.5) : 0.0f;
    const double acc_rel = exact ? 0x1p-20 : 0x1p-6;
    for (int g = 0; g < GROUPS; g++) {
        const cometi_segment_t sg = ws->host[g];
        for (int m = 0; m < M_OUT; m++)
            for (int j = 0; j < n; j++) {
                double c = 0, cs = 0;
                for (int r = sg.start; r < sg.start + sg.rows; r++) {
                    const double x = (double)cometi_e4m3_decode(at[(size_t)m * ld + r]) *
                                     sa[m * sa_row + (r / 128) * sa_block],
                                 y = (double)cometi_e4m3_decode(bt[(size_t)j * ld + r]) *
                                     sb[j * sb_row + (r / 128) * sb_block];
                    c += x * y, cs += fabs(x * y);
                }
                const size_t i = ((size_t)g * M_OUT + m) * n + j;
                ref[i] = c0[i] + c;
                err_bound[i] = add ? acc_rel * cs + 0x1p-22 * (fabs(c0[i]) + fabs(c)) : 0x1p-8 * fabs(c) + 1.01 * acc_rel * cs;
            }
    }
    void *a = NULL, *b = NULL, *c = NULL;
    float *dsa = NULL;
    uint16_t *dsb = NULL;
    const size_t c_bytes = nc * (add ? 4 : 2);
    CUDA_OK(cudaMalloc(&a, (size_t)M_OUT * ld));
    CUDA_OK(cudaMalloc(&b, (size_t)n * ld));
    CUDA_OK(cudaMalloc(&c, c_bytes));
    CUDA_OK(cudaMalloc((void **)&dsa, sizeof(float) * kbs * M_OUT));
    CUDA_OK(cudaMalloc((void **)&dsb, sizeof(uint16_t) * kbs * n));
    CUDA_OK(cudaMemcpy(a, at, (size_t)M_OUT * ld, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b, bt, (size_t)n * ld, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsa, sa, sizeof(float) * kbs * M_OUT, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsb, sb16, sizeof(uint16_t) * kbs * n, cudaMemcpyHostToDevice));
    problem_t p;
    memset(&p, 0, sizeof(p));
    p.groups = GROUPS, p.n = n, p.m_out = M_OUT, p.ldc = n;
    p.a_rows = ws->a_rows, p.segs = ws->dev, p.a_ld = ld;
    p.a = a, p.b = b, p.c = c;
    p.a_scale = dsa, p.a_scale_row = sa_row, p.a_scale_block = sa_block;
    p.b_scale16 = dsb, p.b_scale_row = sb_row, p.b_scale_block = sb_block;
    p.err = s->err_dev;
    unsigned char *got_bytes = malloc(c_bytes);
    for (int run = 0; run < 2; run++) {
        const int dynamic = run == 1;
        if (add) CUDA_OK(cudaMemcpy(c, c0, c_bytes, cudaMemcpyHostToDevice));
        else CUDA_OK(cudaMemset(c, 0xff, c_bytes)); /* poison: NaN in bf16 */
        p.sched = dynamic ? s->sched : NULL;
        cometi_gemm_t g = describe(v, &p);
        g.launch.sms = dynamic ? 0 : 5;
        char err[COMETI_ERR_LEN];
        comet_status_t st = cometi_gemm_run(err, &g, 0);
        if (st != COMET_SUCCESS) printf("%s: %s\n", v->name, err);
        CHECK_EQ(st, COMET_SUCCESS);
        CUDA_OK(cudaDeviceSynchronize());
        if (s->err_host->status) printf("%s: the pipeline reported site %d\n", v->name, s->err_host->site);
        CHECK_EQ(s->err_host->status, 0);
        CUDA_OK(cudaMemcpy(got_bytes, c, c_bytes, cudaMemcpyDeviceToHost));
        int bad = 0;
        double worst = 0;
        for (size_t i = 0; i < nc && bad < 5; i++) {
            const double got = add ? (double)((const float *)got_bytes)[i]
                                   : (double)cometi_bf16_to_float(((const uint16_t *)got_bytes)[i]);
            if (!(fabs(got - ref[i]) <= err_bound[i]))
                bad++, printf("%s: C[%zu][%zu][%zu] = %.9g, float64 %.9g, bound %.3g\n", v->name,
                              i / ((size_t)M_OUT * n), i / n % M_OUT, i % n, got, ref[i], err_bound[i]);
            if (err_bound[i] > 0 && fabs(got - ref[i]) / err_bound[i] > worst) worst = fabs(got - ref[i]) / err_bound[i];
        }
        CHECK_EQ(bad, 0);
        printf("%-20s %s: m_out %d, n %d, %d token rows%s%s, worst |error| / bound %.2f\n", v->name,
               dynamic ? "every SM, shared counter" : "5 blocks, static tiles  ", M_OUT, n, ws->a_rows,
               exact ? ", exact sums" : ", any codes", ws->row_major ? ", A's scales row-major" : "", worst);
    }
    /* A group off the 128-row grid of the token blocks is reported, not summed silently. */
    cometi_segment_t off_grid[GROUPS], *off_dev = NULL;
    memcpy(off_grid, ws->host, sizeof(off_grid));
    off_grid[0].start += 64, off_grid[0].rows = 32;
    CUDA_OK(cudaMalloc((void **)&off_dev, sizeof(off_grid)));
    CUDA_OK(cudaMemcpy(off_dev, off_grid, sizeof(off_grid), cudaMemcpyHostToDevice));
    p.segs = off_dev, p.sched = NULL;
    cometi_gemm_t g = describe(v, &p);
    g.launch.sms = 5;
    char err[COMETI_ERR_LEN];
    CHECK_EQ(cometi_gemm_run(err, &g, 0), COMET_SUCCESS);
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_EQ(s->err_host->status, COMET_INVALID_ARGUMENT);
    CHECK_EQ(s->err_host->site, COMETI_SITE_WGRAD_SEGMENT);
    CHECK_EQ(s->err_host->peer, 0);
    CHECK_EQ(s->err_host->seen, (unsigned long long)off_grid[0].start);
    memset(s->err_host, 0, sizeof(*s->err_host)); /* the next row starts clean */
    free(at), free(bt), free(sa), free(sb), free(sb16), free(ref), free(err_bound), free(c0), free(got_bytes);
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(dsa), cudaFree(dsb), cudaFree(off_dev);
    return 0;
}

/* E4M3 rows whose k blocks lie apart (a.kb_stride): the row's GEMM on A laid out
 * contiguous, then on the same bytes with each 128-byte k block 256 bytes from the next and
 * the gaps NaN codes (0x7f), the same scales: C equal bit for bit, every row of a segment
 * written. K is 256 here (whole blocks, which the layout needs). The store rows without
 * roles: the A loads are the same code in every row along M (the layer's push row is
 * covered by gpu_fp8_training). */
static int run_row_e4m3_blocks_apart(shared_t *s, int vi, uint64_t *rng)
{
    const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
    enum { KA = 256, STRIDE = 256, LDA = 2 * 256 };
    const int n = row_n(v), ldc = n, n_blocks = (n + 127) / 128, kbs = KA / 128;
    const size_t a_bytes = (size_t)s->a_rows * LDA, c_bytes = (size_t)s->a_rows * ldc * 2;
    uint8_t *a_host = malloc(a_bytes), *b_host = malloc((size_t)GROUPS * n * KA);
    float *sa = malloc(sizeof(float) * kbs * s->a_rows), *sb = malloc(sizeof(float) * GROUPS * n_blocks * kbs);
    memset(a_host, 0x7f, a_bytes);
    for (int r = 0; r < s->a_rows; r++)
        for (int q = 0; q < KA; q++) a_host[(size_t)r * LDA + (q / 128) * STRIDE + q % 128] = random_e4m3(rng, 0);
    for (size_t i = 0; i < (size_t)GROUPS * n * KA; i++) b_host[i] = random_e4m3(rng, 0);
    for (int i = 0; i < kbs * s->a_rows; i++) sa[i] = random_scale(rng);
    for (int i = 0; i < GROUPS * n_blocks * kbs; i++) sb[i] = random_scale(rng);
    uint8_t *packed = malloc((size_t)s->a_rows * KA); /* the same rows, contiguous */
    for (int r = 0; r < s->a_rows; r++)
        for (int b = 0; b < kbs; b++) memcpy(packed + (size_t)r * KA + b * 128, a_host + (size_t)r * LDA + b * STRIDE, 128);
    void *a_apart = NULL, *a_packed = NULL, *b = NULL, *c = NULL;
    float *dsa = NULL, *dsb = NULL;
    CUDA_OK(cudaMalloc(&a_apart, a_bytes));
    CUDA_OK(cudaMalloc(&a_packed, (size_t)s->a_rows * KA));
    CUDA_OK(cudaMalloc(&b, (size_t)GROUPS * n * KA));
    CUDA_OK(cudaMalloc(&c, c_bytes));
    CUDA_OK(cudaMalloc((void **)&dsa, sizeof(float) * kbs * s->a_rows));
    CUDA_OK(cudaMalloc((void **)&dsb, sizeof(float) * GROUPS * n_blocks * kbs));
    CUDA_OK(cudaMemcpy(a_apart, a_host, a_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(a_packed, packed, (size_t)s->a_rows * KA, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b, b_host, (size_t)GROUPS * n * KA, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsa, sa, sizeof(float) * kbs * s->a_rows, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsb, sb, sizeof(float) * GROUPS * n_blocks * kbs, cudaMemcpyHostToDevice));
    uint16_t *out[2] = {malloc(c_bytes), malloc(c_bytes)};
    for (int apart = 0; apart < 2; apart++) {
        problem_t p;
        memset(&p, 0, sizeof(p));
        p.groups = GROUPS, p.n = n, p.k = KA, p.ldc = ldc, p.a_rows = s->a_rows, p.segs = s->segs;
        p.a = apart ? a_apart : a_packed, p.b = b, p.c = c;
        p.a_scale = dsa, p.b_scale = dsb, p.a_scale_row = 1, p.a_scale_block = s->a_rows;
        p.a_ld = apart ? LDA : 0, p.err = s->err_dev;
        cometi_gemm_t g = describe(v, &p);
        g.a.kb_stride = apart ? STRIDE : 0;
        g.launch.sms = 5;
        CUDA_OK(cudaMemset(c, 0xff, c_bytes)); /* poison: NaN */
        char what[96];
        snprintf(what, sizeof(what), "%.60s, k blocks apart %d", v->name, apart);
        if (prepare_and_launch(&g, -1, what)) return 1;
        CUDA_OK(cudaDeviceSynchronize());
        CHECK_EQ(s->err_host->status, 0);
        CUDA_OK(cudaMemcpy(out[apart], c, c_bytes, cudaMemcpyDeviceToHost));
    }
    int bad = 0;
    for (int gi = 0; gi < GROUPS && bad < 5; gi++)
        for (int r = s->segs_host[gi].start; r < s->segs_host[gi].start + s->segs_host[gi].rows && bad < 5; r++)
            for (int j = 0; j < n && bad < 5; j++) {
                const uint16_t x = out[0][(size_t)r * ldc + j], y = out[1][(size_t)r * ldc + j];
                if (x != y || (x & 0x7fff) > 0x7f80)
                    bad++, printf("%s: C[%d][%d] = %#x with k blocks apart, %#x contiguous\n", v->name, r, j, y, x);
            }
    free(a_host), free(b_host), free(sa), free(sb), free(packed), free(out[0]), free(out[1]);
    cudaFree(a_apart), cudaFree(a_packed), cudaFree(b), cudaFree(c), cudaFree(dsa), cudaFree(dsb);
    return bad != 0;
}

/* An E4M3 row with the last wave cut along k (tail_ws), as the layer's large batches run
 * it (the bf16 rows have gpu_gemm_last_wave_cut): fp8_nt_256, k = 2048 (16 blocks a tile, so
 * halves), 4 groups of {300, 129, 0, 256} rows (7 tiles of 128 rows, 1 left on 6 blocks),
 * exact codes with random block scales. Against float64 as run_row_e4m3 checks its rows,
 * padding rows untouched, run twice for the same bits, with the units the plan promised
 * taken (the tile timeline) and the workspace's counters back at zero. */
static int e4m3_cut_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg;
    cometi_async_error_t *err_host, *err_dev;
    if (gemm_setup(ctx, &err_host, &err_dev)) return 1;
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx->local_rank));
    enum { G = 4, KC = 2048, KBS = KC / 128, NC = 256, BLOCKS = 6 };
    const int vi = COMETI_GEMM_V_fp8_nt_256, sizes[G] = {300, 129, 0, 256};
    const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
    cometi_segment_t segs_host[G];
    const int rows = padded_segments(sizes, G, segs_host);
    const int64_t ld = rows + 8; /* A's MN-major scales' ld */
    /* A [rows][k], scales [KBS][ld]; B [G][NC][k], scales [G][NC / 128][KBS]. */
    uint8_t *a8 = malloc((size_t)rows * KC), *b8 = malloc((size_t)G * NC * KC);
    float *sa = malloc(sizeof(float) * KBS * ld), *sb = malloc(sizeof(float) * G * 2 * KBS);
    for (size_t i = 0; i < (size_t)rows * KC; i++) a8[i] = random_e4m3(&rng, 1);
    for (size_t i = 0; i < (size_t)G * NC * KC; i++) b8[i] = random_e4m3(&rng, 1);
    for (size_t i = 0; i < (size_t)KBS * ld; i++) sa[i] = random_scale(&rng);
    for (int i = 0; i < G * 2 * KBS; i++) sb[i] = random_scale(&rng);
    /* float64 sums on the dequantized operands and their bounds (exact codes: 2^-20 of the
     * scaled |products|). */
    const size_t nc = (size_t)rows * NC;
    double *want = calloc(nc, 8), *bound = calloc(nc, 8);
    for (int g = 0; g < G; g++)
        for (int r = segs_host[g].start; r < segs_host[g].start + segs_host[g].rows; r++)
            for (int j = 0; j < NC; j++) {
                double c = 0, cs = 0;
                for (int q = 0; q < KC; q++) {
                    const double x =
                        (double)cometi_e4m3_decode(a8[(size_t)r * KC + q]) * sa[(size_t)(q / 128) * ld + r];
                    const double w = (double)cometi_e4m3_decode(b8[((size_t)g * NC + j) * KC + q]) *
                                     sb[((size_t)g * 2 + j / 128) * KBS + q / 128];
                    c += x * w, cs += fabs(x * w);
                }
                want[(size_t)r * NC + j] = c;
                bound[(size_t)r * NC + j] = 0x1p-8 * fabs(c) + 1.01 * 0x1p-20 * cs; /* bf16 out */
            }
    void *a, *b, *c, *ws;
    float *dsa, *dsb;
    unsigned long long *trace;
    cometi_segment_t *segs;
    CUDA_OK(cudaMalloc(&a, (size_t)rows * KC));
    CUDA_OK(cudaMalloc(&b, (size_t)G * NC * KC));
    CUDA_OK(cudaMalloc(&c, nc * 2));
    CUDA_OK(cudaMalloc((void **)&dsa, sizeof(float) * KBS * ld));
    CUDA_OK(cudaMalloc((void **)&dsb, sizeof(float) * G * 2 * KBS));
    CUDA_OK(cudaMalloc(&ws, COMETI_GEMM_TAIL_BYTES(sms)));
    CUDA_OK(cudaMemset(ws, 0, COMETI_GEMM_TAIL_COUNTERS * 8));
    CUDA_OK(cudaMalloc((void **)&trace, (size_t)sms * COMETI_TILE_TRACE_WORDS * 8));
    CUDA_OK(cudaMalloc((void **)&segs, sizeof(segs_host)));
    CUDA_OK(cudaMemcpy(segs, segs_host, sizeof(segs_host), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(a, a8, (size_t)rows * KC, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b, b8, (size_t)G * NC * KC, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsa, sa, sizeof(float) * KBS * ld, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsb, sb, sizeof(float) * G * 2 * KBS, cudaMemcpyHostToDevice));
    problem_t p;
    memset(&p, 0, sizeof(p));
    p.groups = G, p.n = NC, p.k = KC, p.ldc = NC, p.a_rows = rows, p.segs = segs;
    p.a = a, p.b = b, p.c = c, p.a_scale = dsa, p.b_scale = dsb;
    p.a_scale_row = 1, p.a_scale_block = ld;
    p.err = err_dev;
    cometi_gemm_t g = describe(v, &p);
    g.launch.sms = BLOCKS;
    g.launch.tail_ws = ws;
    g.roles.tile_trace = trace;
    int m_tiles = 0;
    for (int gi = 0; gi < G; gi++) m_tiles += (sizes[gi] + 127) / 128;
    const int tiles = m_tiles * (NC / v->block_n);
    const cometi_tail_plan_t plan = cometi_gemm_tail_plan(tiles, BLOCKS, KBS, 1);
    CHECK(plan.parts > 1); /* meant to cut */
    uint16_t *got = malloc(nc * 2), *again = malloc(nc * 2);
    for (int run = 0; run < 2; run++) {
        CUDA_OK(cudaMemset(c, 0xff, nc * 2));
        CUDA_OK(cudaMemset(trace, 0, (size_t)sms * COMETI_TILE_TRACE_WORDS * 8));
        if (prepare_and_launch(&g, vi, v->name)) return 1;
        CUDA_OK(cudaDeviceSynchronize());
        CHECK_EQ(err_host->status, 0);
        CUDA_OK(cudaMemcpy(run ? again : got, c, nc * 2, cudaMemcpyDeviceToHost));
        if (check_cut_units(trace, sms, ws, plan.units, v->name)) return 1;
    }
    CHECK(memcmp(got, again, nc * 2) == 0); /* the same bits */
    int bad = 0;
    double worst = 0; /* |error| / its bound */
    for (int gi = 0; gi < G; gi++)
        for (int r = segs_host[gi].start; r < segs_host[gi].start + (sizes[gi] + 127) / 128 * 128 && bad < 5; r++)
            for (int j = 0; j < NC && bad < 5; j++) {
                const size_t at = (size_t)r * NC + j;
                if (r >= segs_host[gi].start + sizes[gi]) { /* padding rows: untouched */
                    if (got[at] != 0xffff) bad++, printf("%s: padding row %d written\n", v->name, r);
                    continue;
                }
                const double val = cometi_bf16_to_float(got[at]);
                if (!(fabs(val - want[at]) <= bound[at]))
                    bad++, printf("%s: C[%d][%d] = %.9g, float64 %.9g, bound %.3g\n", v->name, r, j, val, want[at],
                                  bound[at]);
                if (bound[at] > 0 && fabs(val - want[at]) / bound[at] > worst) worst = fabs(val - want[at]) / bound[at];
            }
    printf("%s, %d blocks: %d tiles -> %d units (%d parts of the last %d), worst |error| / bound %.2f\n", v->name,
           BLOCKS, tiles, plan.units, plan.parts, tiles - plan.first, worst);
    CHECK_EQ(bad, 0);
    free(a8), free(b8), free(sa), free(sb), free(want), free(bound), free(got), free(again);
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(dsa), cudaFree(dsb), cudaFree(ws), cudaFree(trace), cudaFree(segs);
    return 0;
}

int test_gpu_gemm_e4m3_last_wave_cut(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, e4m3_cut_rank, &seed, 120);
}

static int every_variant_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    uint64_t rng = *(uint64_t *)arg;
    shared_t s;
    memset(&s, 0, sizeof(s));
    if (gemm_setup(ctx, &s.err_host, &s.err_dev)) return 1;
    if (shared_open(&s, &rng)) return 1;
    const wgrad_segs_t short_segs = {s.segs_host, s.segs, s.a_rows, 0};
    static const cometi_segment_t long_host[GROUPS] = {{0, 600}, {768, 0}, {768, 1000}, {1792, 1}};
    wgrad_segs_t long_segs = {long_host, NULL, 1920, 1};
    CUDA_OK(cudaMalloc((void **)&long_segs.dev, sizeof(long_host)));
    CUDA_OK(cudaMemcpy(long_segs.dev, long_host, sizeof(long_host), cudaMemcpyHostToDevice));
    for (int vi = 0; vi < COMETI_GEMM_NUM_VARIANTS; vi++) {
        const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
        /* Up apart: n = 192 (partial blocks), but 256 where gate and up are kept in E4M3
         * (their rows hold whole blocks). */
        const int n_apart = v->epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8 ? 256 : 192;
        int failed;
        if (v->a_type != COMETI_GEMM_E4M3) failed = run_row(&s, vi, &rng);
        else if (v->along == COMETI_GEMM_GROUPS_ALONG_K)
            failed = run_row_e4m3_wgrad(&s, &short_segs, vi, 1, &rng) ||
                     run_row_e4m3_wgrad(&s, &short_segs, vi, 0, &rng) ||
                     run_row_e4m3_wgrad(&s, &long_segs, vi, 1, &rng) || run_row_e4m3_wgrad(&s, &long_segs, vi, 0, &rng);
        else if (v->roles & COMETI_GEMM_ROLE_DISPATCH) /* rows sent with their scales after them: K-major */
            failed = run_row_e4m3(&s, vi, 256, 0, 0, 1, 1, &rng) || run_row_e4m3(&s, vi, n_apart, 1, 1, 0, 1, &rng);
        else if (!cometi_gemm_quantizes(v->epilogue))
            failed = run_row_e4m3(&s, vi, row_n(v), 0, 0, 1, 0, &rng) ||
                     run_row_e4m3(&s, vi, row_n(v), 0, 0, 1, 1, &rng) ||
                     run_row_e4m3(&s, vi, row_n(v), 0, 0, 0, 0, &rng) ||
                     (v->epilogue == COMETI_GEMM_EPI_STORE && !v->roles && run_row_e4m3_blocks_apart(&s, vi, &rng));
        else /* gate and up in one tensor (n of whole blocks), and up apart */
            failed = run_row_e4m3(&s, vi, 256, 0, 0, 1, 0, &rng) || run_row_e4m3(&s, vi, n_apart, 1, 1, 1, 1, &rng) ||
                     run_row_e4m3(&s, vi, 256, 0, 0, 0, 0, &rng);
        if (failed) {
            printf("variant %s failed\n", v->name);
            return 1;
        }
    }
    cudaFree(long_segs.dev);
    return 0;
}

int test_gpu_gemm_every_variant(void)
{
    if (!have_gpus(1)) return TEST_SKIP;
    uint64_t seed = test_seed();
    return launch(1, every_variant_rank, &seed, 240);
}
