/*
 * prepare.c - the grouped GEMM's host side: a description (gemm.h) resolved to its row of
 * variants.h's table, checked field by field (the problem, the operands, the output, then
 * each role), its tensor maps encoded and the kernel's arguments laid out (args.h); and
 * the launch, by the row's family. Plain C: no kernel here.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gemm/gemm.h"

_Static_assert(sizeof(cometi_gemm_plan_t) <= sizeof(cometi_gemm_prepared_t), "cometi_gemm_prepared_t is too small");
_Static_assert(_Alignof(cometi_gemm_plan_t) <= 128, "cometi_gemm_prepared_t is under-aligned");

static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled(void)
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    if (!fn) {
        /* Through the runtime, so nothing links libcuda: the tests must start where no
         * driver is installed. */
        void *p = NULL;
        enum cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
    }
    return fn;
}

/* A tensor of bf16 (elem_bytes 2) or E4M3 bytes (1) of `rank` (2 or 3) dimensions,
 * innermost first, with the outer ones' strides in elements, in boxes of `box` with
 * 128-byte swizzle (128 bytes innermost). Boxes past an extent read zeros and store
 * nothing there. */
static comet_status_t encode_map(char *err, CUtensorMap *map, const void *base, int elem_bytes, int rank,
                                 const uint64_t *dims, const uint64_t *stride_elems, const uint32_t *box,
                                 const char *what)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
    if (!encode) return cometi_fail(err, COMET_CUDA_ERROR, "cuTensorMapEncodeTiled is not available from the driver");
    cuuint64_t d[3] = {dims[0], dims[1], rank > 2 ? dims[2] : 1}, strides[2] = {stride_elems[0] * elem_bytes, 0};
    cuuint32_t b[3] = {box[0], box[1], rank > 2 ? box[2] : 1}, elem[3] = {1, 1, 1};
    if (rank > 2) strides[1] = stride_elems[1] * elem_bytes;
    const CUtensorMapDataType type = elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUresult r = encode(map, type, (cuuint32_t)rank, (void *)base, d, strides, b, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return cometi_fail(err, COMET_CUDA_ERROR, "cuTensorMapEncodeTiled(%s: %llu x %llu x %llu, box %u x %u x %u) "
                           "failed: error %d", what, (unsigned long long)d[2], (unsigned long long)d[1],
                           (unsigned long long)d[0], b[2], b[1], b[0], (int)r);
    return COMET_SUCCESS;
}

/* A tensor [outer2][outer][inner] of bf16 (elem_bytes 2) or E4M3 (1) with rows `row_elems`
 * and matrices `mat_elems` elements apart (mat_elems 0: a 2D tensor [outer][inner];
 * otherwise 3D even when outer2 is 1, since the kernel's loads from it are 3D), in boxes of
 * box_outer rows x 128 bytes. */
static comet_status_t make_map_3d(char *err, CUtensorMap *map, const void *base, int elem_bytes, uint64_t inner,
                                  uint64_t outer, uint64_t outer2, uint64_t row_elems, uint64_t mat_elems,
                                  uint32_t box_outer, const char *what)
{
    const uint64_t dims[3] = {inner, outer, outer2}, strides[2] = {row_elems, mat_elems};
    const uint32_t box[3] = {128u / (uint32_t)elem_bytes, box_outer, 1};
    return encode_map(err, map, base, elem_bytes, mat_elems ? 3 : 2, dims, strides, box, what);
}

static comet_status_t make_map(char *err, CUtensorMap *map, const void *base, int elem_bytes, uint64_t inner,
                               uint64_t outer, uint32_t box_outer, const char *what)
{
    return make_map_3d(err, map, base, elem_bytes, inner, outer, 1, inner, 0, box_outer, what); /* 2D */
}

comet_status_t cometi_gemm_push_maps_create(char *err, void *const *peer_slots, int world, int tp,
                                                       int t_rank, int64_t slot_rows, int hidden, void **maps)
{
    *maps = NULL;
    if (world < 1 || world > COMETI_MAX_RANKS || tp < 1 || t_rank < 0 || t_rank >= tp || slot_rows < 1 ||
        hidden < 64 || hidden % 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "push maps: world %d (1..%d), tp %d, TP rank %d, %lld slot "
                           "rows, hidden %d (a multiple of 64)", world, COMETI_MAX_RANKS, tp, t_rank,
                           (long long)slot_rows, hidden);
    CUtensorMap table[COMETI_MAX_RANKS];
    for (int p = 0; p < world; p++) /* this TP rank's column of each choice's tp partial rows */
        COMETI_TRY(make_map_3d(err, &table[p], (const char *)peer_slots[p] + (size_t)t_rank * hidden * 2, 2,
                               (uint64_t)hidden, (uint64_t)slot_rows, 1, (uint64_t)tp * hidden, 0, 64, "push slots"));
    void *dev = NULL;
    COMETI_TRY(cometi_cuda(err, cudaMalloc(&dev, sizeof(CUtensorMap) * world), "cudaMalloc(push tensor maps)"));
    comet_status_t st = cometi_cuda(err, cudaMemcpy(dev, table, sizeof(CUtensorMap) * world, cudaMemcpyHostToDevice),
                                    "copy push tensor maps");
    if (st != COMET_SUCCESS) {
        cudaFree(dev);
        return st;
    }
    *maps = dev;
    return COMET_SUCCESS;
}

/* ---- the variant ---- */

static const char *epilogue_name(int e)
{
    static const char *names[] = {"store", "swiglu", "swiglu keeping g and u", "push", "fp32 add",
                                  "swiglu quantized to e4m3", "swiglu quantized to e4m3 keeping g and u",
                                  "swiglu quantized to e4m3 keeping g and u in e4m3"};
    return e >= 0 && e < (int)(sizeof(names) / sizeof(names[0])) ? names[e] : "?";
}

static const char *format_name(int t)
{
    return t == COMETI_GEMM_BF16 ? "bf16" : t == COMETI_GEMM_E4M3 ? "e4m3" : "?";
}

/* The choices of a variant in words, for messages and tests. */
void cometi_gemm_variant_text(const cometi_gemm_variant_t *v, char *out, size_t len)
{
    snprintf(out, len, "%s x %s, A %s-major, B %s-major, groups along %s, epilogue %s, %s store, %s, block_n %d, "
             "roles %s", format_name(v->a_type), format_name(v->b_type),
             v->a_major == COMETI_GEMM_MN_MAJOR ? "MN" : "K", v->b_major == COMETI_GEMM_MN_MAJOR ? "MN" : "K",
             v->along == COMETI_GEMM_GROUPS_ALONG_K ? "K" : "M", epilogue_name(v->epilogue),
             v->store == COMETI_GEMM_STORE_DIRECT ? "direct" : v->store == COMETI_GEMM_STORE_TMA ? "TMA" : "any",
             v->schedule == COMETI_GEMM_PINGPONG ? "ping-pong" : "cooperative", v->block_n,
             v->roles == (COMETI_GEMM_ROLE_DISPATCH | COMETI_GEMM_ROLE_SPLITS) ? "dispatch and splits"
             : v->roles == COMETI_GEMM_ROLE_DISPATCH                           ? "dispatch"
             : v->roles == COMETI_GEMM_ROLE_SPLITS                             ? "splits"
                                                                               : "none");
}

/* Bytes of an element of C: E4M3 out of the quantizing SwiGLU, else bf16 (fp32 adds never
 * leave by TMA). */
static int out_bytes(const cometi_gemm_t *g) { return cometi_gemm_quantizes(g->out.epilogue) ? 1 : 2; }

/* Whether C can leave through the TMA store: 16-byte rows, a 16-byte aligned C, and rows in
 * place (no index). The push stores through its owners' maps, not C's. */
static int tma_store_ok(const cometi_gemm_t *g)
{
    return g->out.epilogue == COMETI_GEMM_EPI_PUSH ||
           ((int64_t)g->out.ldc * out_bytes(g) % 16 == 0 && (uintptr_t)g->out.c % 16 == 0 && !g->out.row_index);
}

/* The row of the table with the description's choices: its formats, layouts, epilogue,
 * schedule (0: cooperative) and roles exactly; its store as asked (0: TMA where
 * tma_store_ok, else direct); its width as asked (0: cometi_gemm_tile_n's where a row has
 * it, else the row's). COMET_NOT_SUPPORTED names the choices no row has. */
static comet_status_t resolve_variant(char *err, const cometi_gemm_t *g, int *out)
{
    cometi_gemm_variant_t want;
    memset(&want, 0, sizeof(want));
    want.a_type = g->a.type, want.b_type = g->b.type;
    want.a_major = g->a.major, want.b_major = g->b.major;
    want.along = g->problem.along;
    want.epilogue = g->out.epilogue;
    want.store = g->out.store;
    want.schedule = g->launch.schedule ? g->launch.schedule : COMETI_GEMM_COOPERATIVE;
    want.block_n = g->launch.block_n;
    want.roles = (g->roles.dispatch ? COMETI_GEMM_ROLE_DISPATCH : 0) | (g->roles.splits ? COMETI_GEMM_ROLE_SPLITS : 0);
    if (want.store == COMETI_GEMM_STORE_TMA && !tma_store_ok(g))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm store TMA: ldc = %d must be a multiple of %d, c "
                           "16-byte aligned and row_index NULL", g->out.ldc, 16 / out_bytes(g));
    const int tile_n = cometi_gemm_tile_n(g->problem.n);
    int best = -1, best_score = -1;
    for (int i = 0; i < COMETI_GEMM_NUM_VARIANTS; i++) {
        const cometi_gemm_variant_t *v = &cometi_gemm_variants[i];
        if (v->a_type != want.a_type || v->b_type != want.b_type || v->a_major != want.a_major ||
            v->b_major != want.b_major || v->along != want.along || v->epilogue != want.epilogue ||
            v->schedule != want.schedule || v->roles != want.roles)
            continue;
        if (want.store ? v->store != want.store : v->store == COMETI_GEMM_STORE_TMA && !tma_store_ok(g)) continue;
        if (want.block_n && v->block_n != want.block_n) continue;
        /* Among the rest: the TMA store before the direct one, then the width tile_n asks. */
        const int score = 2 * (v->store == COMETI_GEMM_STORE_TMA) + (v->block_n == tile_n);
        if (score > best_score) best = i, best_score = score;
    }
    if (best < 0) {
        /* Left to choose where C cannot leave by TMA, the store asked for is the direct one. */
        const int direct_only = !want.store && !tma_store_ok(g);
        if (direct_only) want.store = COMETI_GEMM_STORE_DIRECT;
        char text[256];
        cometi_gemm_variant_text(&want, text, sizeof(text));
        return cometi_fail(err, COMET_NOT_SUPPORTED, "gemm: no variant is built for %s%s%s (src/gemm/variants.h lists "
                           "those that are)", text, want.block_n ? "" : " (any block_n)",
                           direct_only ? "; the TMA store needs 16-byte rows of C (ldc), c 16-byte aligned and no "
                                         "row index"
                                       : "");
    }
    *out = best;
    return COMET_SUCCESS;
}

void cometi_gemm_tiling(const cometi_gemm_t *g, int *band_rows, int *col_tiles)
{
    char err[COMETI_ERR_LEN];
    int vi;
    *band_rows = *col_tiles = 0;
    if (resolve_variant(err, g, &vi) != COMET_SUCCESS) return;
    const cometi_gemm_variant_t v = cometi_gemm_variants[vi];
    const int cols = cometi_gemm_out_cols(v);
    *band_rows = cometi_gemm_band_rows(g, v.block_n);
    *col_tiles = (g->problem.n + cols - 1) / cols;
}

/* ---- the checks ---- */

/* The block scales: E4M3 operands need theirs, in range; bf16 ones take none. */
static comet_status_t check_scales(char *err, const cometi_gemm_t *g, const cometi_gemm_variant_t *v)
{
    const int e4m3 = v->a_type == COMETI_GEMM_E4M3, quant = cometi_gemm_quantizes(v->epilogue);
    if (!e4m3) {
        if (g->a.scale || g->b.scale || g->b.up_scale || g->b.scale16 || g->out.c_scale || g->out.pow2_scales)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: block scales (a.scale, b.scale, b.up_scale, "
                               "b.scale16, out.c_scale, out.pow2_scales) are for E4M3 operands; these are %s",
                               format_name(v->a_type));
        return COMET_SUCCESS;
    }
    const int along_k = v->along == COMETI_GEMM_GROUPS_ALONG_K;
    if (!g->a.scale || (uintptr_t)g->a.scale % 4 || g->a.scale_row < 1 || g->a.scale_block < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm E4M3: a.scale = %p (4-byte aligned) with strides "
                           "scale_row = %lld and scale_block = %lld (>= 1) must be set", (const void *)g->a.scale,
                           (long long)g->a.scale_row, (long long)g->a.scale_block);
    /* B's scales along K are per row, bf16 (scale16; a pair of rows' one word), along M fp32
     * per 128 x 128 block (laid out). */
    if (along_k ? !g->b.scale16 || (uintptr_t)g->b.scale16 % 4 || g->b.scale || g->b.up || g->b.up_scale
                : !g->b.scale || (uintptr_t)g->b.scale % 4 || g->b.scale16 ||
                      (g->b.up && (!g->b.up_scale || (uintptr_t)g->b.up_scale % 4)) || (!g->b.up && g->b.up_scale))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm E4M3: b.scale = %p, b.scale16 = %p, b.up_scale = %p: "
                           "%s", (const void *)g->b.scale, (const void *)g->b.scale16, (const void *)g->b.up_scale,
                           along_k ? "groups along K take b.scale16 alone (4-byte aligned)"
                                   : "b.scale must be set (4-byte aligned), b.scale16 not, and b.up_scale exactly "
                                     "when b.up is");
    if (along_k ? g->b.scale_row != 1 || g->b.scale_block < 2 || g->b.scale_block % 2
                : g->b.scale_row || g->b.scale_block)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm E4M3: b.scale_row = %lld and b.scale_block = %lld: "
                           "%s", (long long)g->b.scale_row, (long long)g->b.scale_block,
                           along_k ? "groups along K scale each row of B^T: scale_row 1 and scale_block even (>= 2), "
                                     "so two rows' bf16 scales are one word"
                                   : "0 with groups along M (B's 128 x 128 blocks are laid out)");
    /* Gate and up rows in one tensor share its 128-row blocks: a block must not hold both. */
    if (cometi_gemm_is_swiglu(v->epilogue) && !g->b.up && g->problem.n % COMETI_GEMM_SCALE_BLOCK)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm E4M3 SwiGLU: n = %d with gate and up in one tensor "
                           "must be a multiple of %d (its 128 x 128 blocks would hold gate and up rows); give up "
                           "apart (b.up, b.up_scale)", g->problem.n, COMETI_GEMM_SCALE_BLOCK);
    if (quant != (g->out.c_scale != NULL) ||
        (quant && ((uintptr_t)g->out.c_scale % 4 || g->out.c_scale_row < 1 || g->out.c_scale_block < 1)))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: out.c_scale = %p (4-byte aligned, strides c_scale_row "
                           "= %lld and c_scale_block = %lld >= 1) is for the quantizing SwiGLU alone, which needs it",
                           (void *)g->out.c_scale, (long long)g->out.c_scale_row, (long long)g->out.c_scale_block);
    if (g->out.pow2_scales != 0 && g->out.pow2_scales != 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm out.pow2_scales = %d: must be 0 or 1",
                           g->out.pow2_scales);
    return COMET_SUCCESS;
}

/* The problem, the operands and the output, once the variant v is known. */
static comet_status_t check_core(char *err, const cometi_gemm_t *g, const cometi_gemm_variant_t *v)
{
    const int along_k = v->along == COMETI_GEMM_GROUPS_ALONG_K, epi = v->epilogue;
    const int swiglu = cometi_gemm_is_swiglu(epi), e4m3 = v->a_type == COMETI_GEMM_E4M3;
    /* The last column tile may be partial (the ffn of a TP rank, say 1408 / 2, or
     * gpt-oss's 2880): its loads past n read zeros or columns no store keeps, and every
     * store stops at n. */
    if (g->problem.n <= 0 || g->problem.n % 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n = %d: must be a positive multiple of 64",
                           g->problem.n);
    if (along_k && (g->problem.m_out <= 0 || g->problem.m_out % 64 || g->out.ldc != g->problem.n))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm groups along K: m_out = %d must be a positive "
                           "multiple of 64, and ldc = %d equal to n = %d", g->problem.m_out, g->out.ldc,
                           g->problem.n);
    /* E4M3 rows are 16-byte multiples (TMA strides); the last 128-wide k block reads zeros past
     * k. bf16 k steps are whole. */
    const int k_multiple = e4m3 ? 16 : COMETI_GEMM_BK;
    if (!along_k && (g->problem.k <= 0 || g->problem.k % k_multiple))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm k = %d: must be a positive multiple of %d",
                           g->problem.k, k_multiple);
    if (g->problem.groups < 1 || g->problem.groups > COMETI_GEMM_MAX_GROUPS)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm groups = %d: must be 1..%d", g->problem.groups,
                           COMETI_GEMM_MAX_GROUPS);
    if (!g->err || !g->problem.segs)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: err (the failure report word) and problem.segs "
                           "must be set");
    if (!g->a.ptr || !g->b.ptr || g->a.rows < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: a = %p with %lld rows (>= 1) and b = %p must be set",
                           g->a.ptr, (long long)g->a.rows, g->b.ptr);
    if ((uintptr_t)g->a.ptr % 16 || (uintptr_t)g->b.ptr % 16 || (uintptr_t)g->b.up % 16)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: a, b and b.up must be 16-byte aligned");
    const int ea = cometi_gemm_element_bytes(v->a_type);
    if (along_k && e4m3) {
        /* A^T and B^T: rows of the tokens' bytes, TMA strides of 16 bytes. */
        if (g->a.rows % 16 || (g->a.ld && (g->a.ld < g->a.rows || g->a.ld % 16)))
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm E4M3 along K: a.rows = %lld (the tokens) must be "
                               "a multiple of 16 and a.ld = %lld 0 or a multiple of 16 >= rows",
                               (long long)g->a.rows, (long long)g->a.ld);
    } else if (g->a.ld && (along_k || g->a.ld < g->problem.k || g->a.ld * ea % 16))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm a.ld = %lld: along M, >= k = %d and rows of 16-byte "
                           "multiples (0: k)", (long long)g->a.ld, g->problem.k);
    if (g->a.kb_stride) {
        const int64_t blocks = g->problem.k / COMETI_GEMM_SCALE_BLOCK, ld = g->a.ld ? g->a.ld : g->problem.k;
        if (!e4m3 || along_k || g->roles.dispatch)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm a.kb_stride = %lld: for E4M3 rows along M without "
                               "the dispatch role only (0 otherwise)", (long long)g->a.kb_stride);
        /* A row holds its blocks whole, so the tensor map's strides nest (row >= blocks x block). */
        if (g->a.kb_stride < COMETI_GEMM_SCALE_BLOCK || g->a.kb_stride % 16 || g->problem.k % COMETI_GEMM_SCALE_BLOCK ||
            blocks * g->a.kb_stride > ld)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm a.kb_stride = %lld: must be a multiple of 16 >= %d, "
                               "with k = %d a multiple of %d and a.ld = %lld >= k / %d x kb_stride",
                               (long long)g->a.kb_stride, COMETI_GEMM_SCALE_BLOCK, g->problem.k,
                               COMETI_GEMM_SCALE_BLOCK, (long long)ld, COMETI_GEMM_SCALE_BLOCK);
    }
    if (g->b.up && !swiglu)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: b.up is for the SwiGLU epilogues only");
    if (epi != COMETI_GEMM_EPI_PUSH) {
        /* A thread stores two columns at once: 4 bytes of bf16, 2 of E4M3, 8 of fp32. */
        const int align = epi == COMETI_GEMM_EPI_ADD_FP32 ? 8 : cometi_gemm_quantizes(epi) ? 2 : 4;
        if (!g->out.c || g->out.ldc < g->problem.n || g->out.ldc % 2)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: c = %p must be set, ldc = %d even and >= n = %d",
                               g->out.c, g->out.ldc, g->problem.n);
        if ((uintptr_t)g->out.c % align)
            return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: c must be %d-byte aligned", align);
    }
    if ((g->out.row_scale || g->out.row_index) && (along_k || (epi != COMETI_GEMM_EPI_STORE && !swiglu)))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: a row scale or index is for the store and SwiGLU "
                           "epilogues with groups along M (epilogue %s here)", epilogue_name(epi));
    if (g->out.row_index && cometi_gemm_quantizes(epi))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: the quantizing SwiGLU takes no row index (its "
                           "scales are laid out by A's rows)");
    COMETI_TRY(check_scales(err, g, v));
    if (cometi_gemm_keeps_gu(epi) ? !g->out.gu || g->out.gu_rows <= 0 || (uintptr_t)g->out.gu % 4
                                         : g->out.gu != NULL)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm gu = %p, %lld rows: the epilogue keeping g and u "
                           "needs them (rows > 0, 4-byte aligned), the others take none", g->out.gu,
                           (long long)g->out.gu_rows);
    if (epi == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8 ? !g->out.gu_scale || (uintptr_t)g->out.gu % 16 ||
                                                    g->problem.n % COMETI_GEMM_SCALE_BLOCK
                                                  : g->out.gu_scale != NULL)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm gu_scale = %p, gu = %p, n = %d: gate and up kept in "
                           "E4M3 need their scales, gu 16-byte aligned and n a multiple of %d; the other epilogues "
                           "take no gu_scale", (void *)g->out.gu_scale, g->out.gu, g->problem.n,
                           COMETI_GEMM_SCALE_BLOCK);
    if ((epi == COMETI_GEMM_EPI_PUSH) != (g->out.push != NULL))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm push = %p: the push epilogue needs where its rows go, "
                           "the others take none", (const void *)g->out.push);
    if (g->launch.group_m < 0 || g->launch.group_m > 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm group_m = %d: must be 0..64 (0: the format's default)",
                           g->launch.group_m);
    return COMET_SUCCESS;
}

static comet_status_t check_dispatch(char *err, const cometi_gemm_t *g, const cometi_gemm_variant_t *v)
{
    const cometi_gemm_dispatch_t *d = g->roles.dispatch;
    /* The dispatch writes rows where the GEMM reads them: its row is A's. */
    const int64_t a_row_bytes = (g->a.ld ? g->a.ld : g->problem.k) * (int64_t)cometi_gemm_element_bytes(v->a_type);
    if (d->rows.row_bytes != a_row_bytes)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: rows of %d bytes, but A's rows are %lld bytes "
                           "apart (a.ld or k, in %s)", d->rows.row_bytes, (long long)a_row_bytes,
                           format_name(v->a_type));
    if (d->blocks < 1 || !d->arrive || !d->expected || !g->launch.sched)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: %d blocks (>= 1), arrival counters and "
                           "their totals, and the shared tile counter (sched) must be set", d->blocks);
    if (d->rows.num_experts < 1 || d->rows.num_experts > COMETI_MAX_EXPERTS)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: %d experts (1..%d: the piece table's size)",
                           d->rows.num_experts, COMETI_MAX_EXPERTS);
    if (d->rows.tp < 1 || d->rows.experts_per_group < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: tp %d and experts per group %d must be >= 1",
                           d->rows.tp, d->rows.experts_per_group);
    if (d->rows.head_pieces < 0 || d->rows.head_pieces > COMETI_DISPATCH_HEAD_MAX_PIECES ||
        (d->rows.head_pieces && d->rows.tp != 1))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: head_pieces = %d: must be 0..%d, and 0 "
                           "with tp %d > 1 (the head goes to this rank alone)", d->rows.head_pieces,
                           COMETI_DISPATCH_HEAD_MAX_PIECES, d->rows.tp);
    if (d->rows.row_bytes < 16 || d->rows.row_bytes % 16)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: rows of %d bytes: must be a positive "
                           "multiple of 16", d->rows.row_bytes);
    if (d->rows.x2 && ((uintptr_t)d->rows.x2 % 16 || d->rows.x2_offset % 16 || d->rows.wave_blocks))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: x2 = %p, %zu bytes on: both 16-byte "
                           "aligned, and no first wave (it copies x alone)", d->rows.x2, d->rows.x2_offset);
    return COMET_SUCCESS;
}

static comet_status_t check_splits(char *err, const cometi_gemm_t *g, int n_tiles, int out_n)
{
    const cometi_gemm_splits_t *s = g->roles.splits;
    if (s->n_splits < 1 || n_tiles % s->n_splits)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n_splits = %d: must divide the %d column tiles of %d "
                           "columns", s->n_splits, n_tiles, out_n);
    /* The combine reads n / n_splits columns per split: equal splits of whole tiles. */
    if (s->n_splits > 1 && g->problem.n % out_n)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n_splits = %d with n = %d: splits need n a multiple "
                           "of the %d-column tile (a partial last tile allows 1 split)", s->n_splits, g->problem.n,
                           out_n);
    if (!s->split_done)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm splits: split_done (the rows finished per split) "
                           "must be set");
    if (s->combine_blocks < 0)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm combine_blocks = %d: must be >= 0", s->combine_blocks);
    if (!s->combine_blocks) return COMET_SUCCESS;
    const cometi_combine_t *c = &s->combine;
    if (s->n_splits > COMETI_MAX_SPLITS)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n_splits = %d with combine: at most %d", s->n_splits,
                           COMETI_MAX_SPLITS);
    if (c->kernel_splits < 0 || c->kernel_splits > s->n_splits)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "combine kernel_splits = %d: must be 0..n_splits = %d",
                           c->kernel_splits, s->n_splits);
    if (c->top_k < 1 || c->top_k > COMETI_COMBINE_MAX_TOP_K)
        return cometi_fail(err, COMET_NOT_SUPPORTED, "combine top_k = %d: 1..%d are built", c->top_k,
                           COMETI_COMBINE_MAX_TOP_K);
    if (c->world < 1 || c->world > COMETI_MAX_RANKS || c->rank < 0 || c->rank >= c->world || c->tp != 1 ||
        c->experts_per_group * c->world != c->num_experts || c->num_tokens < 0 || !c->peers || !c->meta ||
        !c->plan.counts || !c->plan.send_offset || !c->plan.recv_offset || !c->expected || !c->sync ||
        (c->num_tokens && (!c->topk_ids || !c->y)))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm combine: world %d, rank %d, tp %d (must be 1), "
                           "experts %d / %d per rank, tokens %d, or a NULL table", c->world, c->rank, c->tp,
                           c->num_experts, c->experts_per_group, c->num_tokens);
    if ((uintptr_t)c->y % 16 || g->problem.n % 8)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm combine: y must be 16-byte aligned (is %p)", c->y);
    return COMET_SUCCESS;
}

static comet_status_t check_push(char *err, const cometi_gemm_t *g)
{
    const cometi_gemm_push_t *p = g->out.push;
    const cometi_combine_t *c = &p->combine;
    if (g->out.row_index || !p->dest || !p->maps || (uintptr_t)p->maps % 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm push: needs the destinations, the owners' tensor maps "
                           "(64-byte aligned) and no row index");
    if (c->world < 1 || c->world > COMETI_MAX_RANKS || c->world > COMETI_PUSH_MAX_RANKS || c->rank < 0 ||
        c->rank >= c->world || c->tp < 1 || c->world % c->tp ||
        c->experts_per_group * (c->world / c->tp) != c->num_experts ||
        c->experts_per_group != g->problem.groups || !c->peers || !c->plan.counts || !c->plan.send_offset ||
        !c->plan.recv_offset)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm push: world %d, rank %d, tp %d, experts %d / %d per "
                           "group (GEMM groups %d), or a NULL table", c->world, c->rank, c->tp, c->num_experts,
                           c->experts_per_group, g->problem.groups);
    return COMET_SUCCESS;
}

/* ---- the tensor maps and the arguments ---- */

comet_status_t cometi_gemm_check(char *err, const cometi_gemm_t *g, int *variant)
{
    if (g->problem.along != COMETI_GEMM_GROUPS_ALONG_M && g->problem.along != COMETI_GEMM_GROUPS_ALONG_K)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm problem.along = %d: must be %d (M) or %d (K)",
                           g->problem.along, COMETI_GEMM_GROUPS_ALONG_M, COMETI_GEMM_GROUPS_ALONG_K);
    if (g->out.epilogue < COMETI_GEMM_EPI_STORE || g->out.epilogue > COMETI_GEMM_EPI_SWIGLU_E4M3_GU8)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm out.epilogue = %d: must be %d..%d", g->out.epilogue,
                           COMETI_GEMM_EPI_STORE, COMETI_GEMM_EPI_SWIGLU_E4M3_GU8);
    if (g->out.store < COMETI_GEMM_STORE_AUTO || g->out.store > COMETI_GEMM_STORE_DIRECT)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm out.store = %d: must be %d (choose), %d (TMA) or %d "
                           "(direct)", g->out.store, COMETI_GEMM_STORE_AUTO, COMETI_GEMM_STORE_TMA,
                           COMETI_GEMM_STORE_DIRECT);
    if (g->launch.schedule < COMETI_GEMM_SCHEDULE_AUTO || g->launch.schedule > COMETI_GEMM_PINGPONG)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm launch.schedule = %d: must be %d (choose), %d "
                           "(cooperative) or %d (ping-pong)", g->launch.schedule, COMETI_GEMM_SCHEDULE_AUTO,
                           COMETI_GEMM_COOPERATIVE, COMETI_GEMM_PINGPONG);
    if (g->launch.block_n && g->launch.block_n != 128 && g->launch.block_n != 256)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm block_n = %d: must be 128, 256 or 0 (choose)",
                           g->launch.block_n);
    int vi = 0;
    COMETI_TRY(resolve_variant(err, g, &vi));
    const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
    COMETI_TRY(check_core(err, g, v));
    const int out_n = cometi_gemm_out_cols(*v), n_tiles = (g->problem.n + out_n - 1) / out_n;
    if (g->roles.dispatch) COMETI_TRY(check_dispatch(err, g, v));
    if (g->roles.splits) COMETI_TRY(check_splits(err, g, n_tiles, out_n));
    if (g->out.push) COMETI_TRY(check_push(err, g));
    *variant = vi;
    return COMET_SUCCESS;
}

comet_status_t cometi_gemm_prepare(char *err, const cometi_gemm_t *g, cometi_gemm_prepared_t *out)
{
    int vi = 0;
    COMETI_TRY(cometi_gemm_check(err, g, &vi));
    const cometi_gemm_variant_t *v = &cometi_gemm_variants[vi];
    const int out_n = cometi_gemm_out_cols(*v);
    const int pingpong = v->schedule == COMETI_GEMM_PINGPONG, along_k = v->along == COMETI_GEMM_GROUPS_ALONG_K;
    const int swiglu = out_n != v->block_n, tma_store = v->store == COMETI_GEMM_STORE_TMA;
    const int ea = cometi_gemm_element_bytes(v->a_type), eb = cometi_gemm_element_bytes(v->b_type);
    const int b_mn = !along_k && v->b_major == COMETI_GEMM_MN_MAJOR;
    const int dispatch_blocks = g->roles.dispatch ? g->roles.dispatch->blocks : 0;
    const int combine_blocks = g->roles.splits ? g->roles.splits->combine_blocks : 0;
    const int n = g->problem.n, k = g->problem.k, groups = g->problem.groups, m_out = g->problem.m_out;
    /* B rows per group, and where a group's up rows sit relative to its gate rows. */
    const int fused_up = swiglu && !g->b.up;
    const int b_group_rows = fused_up ? 2 * n : n;
    cometi_gemm_maps_t m;
    memset(&m, 0, sizeof(m));
    const uint64_t t_ld = (uint64_t)(g->a.ld ? g->a.ld : g->a.rows); /* E4M3 along K: A^T's and B^T's */
    if (along_k && v->a_type == COMETI_GEMM_E4M3) { /* A^T [m_out][tokens], B^T [n][tokens] */
        COMETI_TRY(make_map_3d(err, &m.a, g->a.ptr, 1, (uint64_t)g->a.rows, (uint64_t)m_out, 1, t_ld, 0,
                               COMETI_GEMM_BM, "A^T (along K)"));
        COMETI_TRY(make_map_3d(err, &m.b, g->b.ptr, 1, (uint64_t)g->a.rows, (uint64_t)n, 1, t_ld, 0,
                               (uint32_t)v->block_n, "B^T (along K)"));
    } else if (along_k) /* A [rows][m_out]: boxes of 64 rows of m x 64 k rows */
        COMETI_TRY(make_map(err, &m.a, g->a.ptr, ea, (uint64_t)m_out, (uint64_t)g->a.rows, COMETI_GEMM_BK,
                            "A (along K)"));
    else if (g->a.kb_stride) { /* [rows][k / 128][128 bytes]: a box is one k block of 128 rows */
        const uint64_t dims[3] = {COMETI_GEMM_SCALE_BLOCK, (uint64_t)k / COMETI_GEMM_SCALE_BLOCK, (uint64_t)g->a.rows},
                       strides[2] = {(uint64_t)g->a.kb_stride, (uint64_t)(g->a.ld ? g->a.ld : k)};
        const uint32_t box[3] = {COMETI_GEMM_SCALE_BLOCK, 1, pingpong ? 64 : COMETI_GEMM_BM};
        COMETI_TRY(encode_map(err, &m.a, g->a.ptr, 1, 3, dims, strides, box, "A (k blocks apart)"));
    } else
        COMETI_TRY(make_map_3d(err, &m.a, g->a.ptr, ea, (uint64_t)k, (uint64_t)g->a.rows, 1,
                               (uint64_t)(g->a.ld ? g->a.ld : k), 0, pingpong ? 64 : COMETI_GEMM_BM, "A"));
    if (along_k && v->a_type == COMETI_GEMM_E4M3) {
        /* made above */
    } else if (along_k) { /* B [rows][n]: boxes of 64 columns x 64 k rows */
        COMETI_TRY(make_map(err, &m.b, g->b.ptr, eb, (uint64_t)n, (uint64_t)g->a.rows, COMETI_GEMM_BK,
                            "B (along K)"));
    } else if (swiglu) { /* [groups][n][k] views of the gate rows and of the up rows */
        const void *up = g->b.up ? g->b.up : (const char *)g->b.ptr + (size_t)n * k * eb;
        COMETI_TRY(make_map_3d(err, &m.b, g->b.ptr, eb, (uint64_t)k, (uint64_t)n, (uint64_t)groups, (uint64_t)k,
                               (uint64_t)b_group_rows * k, (uint32_t)out_n, "B gate"));
        COMETI_TRY(make_map_3d(err, &m.up, up, eb, (uint64_t)k, (uint64_t)n, (uint64_t)groups, (uint64_t)k,
                               (uint64_t)b_group_rows * k, (uint32_t)out_n, "B up"));
    } else if (b_mn) { /* [groups][k][n]: boxes of 64 columns x 64 k rows */
        COMETI_TRY(make_map_3d(err, &m.b, g->b.ptr, eb, (uint64_t)n, (uint64_t)k, (uint64_t)groups, (uint64_t)n,
                               (uint64_t)k * n, COMETI_GEMM_BK, "B (MN-major)"));
    } else {
        COMETI_TRY(make_map(err, &m.b, g->b.ptr, eb, (uint64_t)k, (uint64_t)groups * b_group_rows,
                            (uint32_t)out_n, "B"));
    }
    /* C's columns end at n (a ragged last tile stores nothing past it), rows ldc apart: boxes
     * of 64 rows x 128 bytes. */
    const uint64_t c_rows = along_k ? (uint64_t)groups * m_out : (uint64_t)g->a.rows;
    if (tma_store && v->epilogue != COMETI_GEMM_EPI_PUSH)
        COMETI_TRY(make_map_3d(err, &m.c, g->out.c, out_bytes(g), (uint64_t)n, c_rows, 1, (uint64_t)g->out.ldc, 0,
                               64, "C"));
    /* The kept gate and up, [gu_rows][2n] seen as [gu_rows][2][n]: a box of 64 rows x 64
     * columns of one half, stored like C's (rows past gu_rows clipped). */
    const int gu_tma = cometi_gemm_keeps_gu(v->epilogue) && tma_store && (uintptr_t)g->out.gu % 16 == 0;
    if (gu_tma && v->epilogue == COMETI_GEMM_EPI_SWIGLU_E4M3_GU8) /* a box of 64 rows x 128 bytes */
        COMETI_TRY(make_map_3d(err, &m.gu, g->out.gu, 1, 2 * (uint64_t)n, (uint64_t)g->out.gu_rows, 1,
                               2 * (uint64_t)n, 0, 64, "gu (E4M3)"));
    else if (gu_tma) {
        const uint64_t dims[3] = {(uint64_t)n, 2, (uint64_t)g->out.gu_rows}, strides[2] = {(uint64_t)n,
                                                                                           2 * (uint64_t)n};
        const uint32_t box[3] = {64, 1, 64};
        COMETI_TRY(encode_map(err, &m.gu, g->out.gu, 2, 3, dims, strides, box, "gu"));
    }
    cometi_gemm_args_t args;
    memset(&args, 0, sizeof(args));
    args.segs = g->problem.segs;
    args.groups = groups;
    args.n = n;
    args.k = along_k ? cometi_gemm_bk(*v) : k; /* along K: each group's own rows set its k */
    args.ldc = g->out.ldc;
    args.m_out = along_k ? m_out : 0;
    args.group_m = cometi_gemm_band_rows(g, v->block_n);
    args.b_group_rows = b_group_rows;
    args.row_scale = g->out.row_scale;
    args.row_index = g->out.row_index;
    args.local_rows = g->problem.local_rows;
    args.sched = g->launch.sched;
    args.n_splits = g->roles.splits ? g->roles.splits->n_splits : 1;
    args.c = g->out.c;
    args.c_fp32_add = v->epilogue == COMETI_GEMM_EPI_ADD_FP32;
    args.gu = g->out.gu;
    args.gu_rows = g->out.gu_rows;
    args.gu_tma = gu_tma;
    args.gu_scale = g->out.gu_scale;
    args.err = g->err;
    args.arrival_timeout_ns = g->timeout_ns ? g->timeout_ns : 10ull * 1000 * 1000 * 1000;
    args.timeout_ns = 2 * args.arrival_timeout_ns;
    args.tile_trace = g->roles.tile_trace;
    args.tail_ws = along_k ? NULL : (unsigned long long *)g->launch.tail_ws;
    if (v->a_type == COMETI_GEMM_E4M3) {
        /* B's scale blocks: [groups][rows / 128][k / 128], rounded up; gate and up in one
         * tensor: the up rows' blocks start n / 128 blocks in. */
        const int kbs = (k + COMETI_GEMM_SCALE_BLOCK - 1) / COMETI_GEMM_SCALE_BLOCK;
        const int n_blocks = (n + COMETI_GEMM_SCALE_BLOCK - 1) / COMETI_GEMM_SCALE_BLOCK;
        args.a_scale = g->a.scale;
        args.a_scale_row = g->a.scale_row;
        args.a_scale_block = g->a.scale_block;
        args.a_rows = g->a.rows;
        args.a_kb_strided = g->a.kb_stride != 0;
        args.b_scale = g->b.scale;
        args.b_scale16 = g->b.scale16;
        args.b_scale_row = g->b.scale_row;
        args.b_scale_block = g->b.scale_block;
        args.b_scale_kb = kbs;
        args.b_scale_blocks = n_blocks;
        args.b_scale_group = (fused_up ? 2 * n / COMETI_GEMM_SCALE_BLOCK : n_blocks) * kbs;
        args.b_up_scale = !swiglu  ? NULL
                          : g->b.up ? g->b.up_scale
                                    : g->b.scale + (size_t)(n / COMETI_GEMM_SCALE_BLOCK) * kbs;
        args.c_scale = g->out.c_scale;
        args.c_scale_row = g->out.c_scale_row;
        args.c_scale_block = g->out.c_scale_block;
        args.pow2_scales = g->out.pow2_scales;
    }
    if (g->roles.dispatch) {
        args.arrive = g->roles.dispatch->arrive;
        args.expected = g->roles.dispatch->expected;
        args.dispatch = g->roles.dispatch->rows;
    }
    if (g->roles.splits) {
        args.split_done = g->roles.splits->split_done;
        args.combine_blocks = combine_blocks;
        args.combine = g->roles.splits->combine;
    }
    if (g->out.push) {
        args.push_dest = g->out.push->dest;
        args.push_maps = (const CUtensorMap *)g->out.push->maps;
        args.combine = g->out.push->combine;
    }
    int sm_count = 0, dev = 0;
    COMETI_TRY(cometi_cuda(err, cudaGetDevice(&dev), "cudaGetDevice"));
    COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev),
                           "cudaDeviceGetAttribute(SM count)"));
    const int side_blocks = dispatch_blocks + combine_blocks;
    /* GEMM blocks, then dispatch (or combine) blocks. */
    args.gemm_blocks = g->launch.sms > 0 ? g->launch.sms : sm_count - side_blocks;
    const int blocks = args.gemm_blocks + side_blocks;
    /* Blocks that wait for others must never keep those off the GPU: one per SM, all resident. */
    if ((g->roles.dispatch || combine_blocks) && (args.gemm_blocks < 1 || blocks > sm_count))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm with arrival waits or combine: %d GEMM + %d dispatch "
                           "or combine blocks must be 1..%d (one per SM, so every block is resident)",
                           args.gemm_blocks, side_blocks, sm_count);
    if (args.gemm_blocks < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm sms = %d with %d dispatch or combine blocks: no GEMM "
                           "block left", g->launch.sms, side_blocks);
    /* The workspace holds two partials per SM (COMETI_GEMM_TAIL_SLOTS), and the plan's
     * no-deadlock argument needs every block resident: a grid past the SMs goes without
     * the cut. */
    if (blocks > sm_count) args.tail_ws = NULL;
    cometi_gemm_plan_t *pr = (cometi_gemm_plan_t *)out->bytes;
    pr->maps = m;
    pr->args = args;
    pr->variant = vi;
    pr->blocks = blocks;
    return COMET_SUCCESS;
}

comet_status_t cometi_gemm_launch(char *err, const cometi_gemm_prepared_t *p, cudaStream_t stream)
{
    const cometi_gemm_plan_t *plan = (const cometi_gemm_plan_t *)p->bytes;
    if (plan->variant < 0 || plan->variant >= COMETI_GEMM_NUM_VARIANTS)
        return cometi_fail(err, COMET_INTERNAL_ERROR, "gemm: variant %d is not a row of the table", plan->variant);
    cudaError_t e;
    switch (cometi_gemm_family(cometi_gemm_variants[plan->variant])) {
    case COMETI_GEMM_FAMILY_WGRAD: e = cometi_gemm_launch_wgrad(plan, stream); break;
    case COMETI_GEMM_FAMILY_DGRAD: e = cometi_gemm_launch_dgrad(plan, stream); break;
    case COMETI_GEMM_FAMILY_FP8: e = cometi_gemm_launch_fp8(plan, stream); break;
    default: e = cometi_gemm_launch_forward(plan, stream); break;
    }
    if (e == cudaSuccess) return COMET_SUCCESS;
    char what[96];
    snprintf(what, sizeof(what), "launch grouped_gemm_kernel (%s)", cometi_gemm_variants[plan->variant].name);
    return cometi_cuda(err, e, what);
}

comet_status_t cometi_gemm_run(char *err, const cometi_gemm_t *g, cudaStream_t stream)
{
    cometi_gemm_prepared_t p;
    COMETI_TRY(cometi_gemm_prepare(err, g, &p));
    return cometi_gemm_launch(err, &p, stream);
}
