/*
 * prepare.c - the grouped GEMM's host side: a description (gemm.h) checked field by
 * field, the core first and then each role, its tensor maps encoded, and the kernel's
 * arguments laid out (gemm/args.h) for cometi_gemm_launch (gemm.cu). Plain C: no kernel
 * here, and nothing is enqueued.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>
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

/* A bf16 tensor of `rank` (2 or 3) dimensions, innermost first, with the outer ones'
 * strides in elements, in boxes of `box` with 128-byte swizzle (64 elements innermost).
 * Boxes past an extent read zeros and store nothing there. */
static comet_status_t encode_map(char *err, CUtensorMap *map, const void *base, int rank, const uint64_t *dims,
                                 const uint64_t *stride_elems, const uint32_t *box, const char *what)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
    if (!encode) return cometi_fail(err, COMET_CUDA_ERROR, "cuTensorMapEncodeTiled is not available from the driver");
    cuuint64_t d[3] = {dims[0], dims[1], rank > 2 ? dims[2] : 1}, strides[2] = {stride_elems[0] * 2, 0};
    cuuint32_t b[3] = {box[0], box[1], rank > 2 ? box[2] : 1}, elem[3] = {1, 1, 1};
    if (rank > 2) strides[1] = stride_elems[1] * 2;
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)base, d, strides, b, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return cometi_fail(err, COMET_CUDA_ERROR, "cuTensorMapEncodeTiled(%s: %llu x %llu x %llu, box %u x %u x %u) "
                           "failed: error %d", what, (unsigned long long)d[2], (unsigned long long)d[1],
                           (unsigned long long)d[0], b[2], b[1], b[0], (int)r);
    return COMET_SUCCESS;
}

/* A bf16 tensor [outer2][outer][inner] with rows `row_elems` and matrices `mat_elems`
 * elements apart (mat_elems 0: a 2D tensor [outer][inner]; otherwise 3D even when
 * outer2 is 1, since the kernel's loads from it are 3D), in boxes of box_outer x 64. */
static comet_status_t make_map_3d(char *err, CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                                  uint64_t outer2, uint64_t row_elems, uint64_t mat_elems, uint32_t box_outer,
                                  const char *what)
{
    const uint64_t dims[3] = {inner, outer, outer2}, strides[2] = {row_elems, mat_elems};
    const uint32_t box[3] = {COMETI_GEMM_BK, box_outer, 1};
    return encode_map(err, map, base, mat_elems ? 3 : 2, dims, strides, box, what);
}

static comet_status_t make_map(char *err, CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                               uint32_t box_outer, const char *what)
{
    return make_map_3d(err, map, base, inner, outer, 1, inner, 0, box_outer, what); /* 2D */
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
        COMETI_TRY(make_map_3d(err, &table[p], (const char *)peer_slots[p] + (size_t)t_rank * hidden * 2,
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

/* The core: operands, shape, tile width, epilogue and schedule. Sets the tile width of
 * the output (*out_n) and of B (*block_n), and whether C leaves through the TMA store. */
static comet_status_t check_core(char *err, const cometi_gemm_t *g, int *block_n_out, int *out_n_out,
                                 int *tma_epilogue_out)
{
    /* SwiGLU tiles are 128 output columns: 128 gate and 128 up columns of B. */
    const int block_n = g->swiglu ? 256 : g->block_n ? g->block_n : cometi_gemm_tile_n(g->n);
    const int out_n = g->swiglu ? block_n / 2 : block_n;
    if (g->swiglu && g->block_n && g->block_n != 256)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm block_n = %d with swiglu: only 256 (128 gate + 128 up "
                           "columns) is built", g->block_n);
    if (block_n != 128 && block_n != 256)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm block_n = %d: must be 128 or 256", block_n);
    /* The last column tile may be partial (the ffn of a TP rank, say 1408 / 2, or
     * gpt-oss's 2880): its loads past n read zeros or columns no store keeps, and every
     * store stops at n. */
    if (g->n <= 0 || g->n % 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n = %d: must be a positive multiple of 64", g->n);
    if (g->wgrad && (g->m_out <= 0 || g->m_out % 64 || g->swiglu || g->b_up || g->row_scale ||
                     g->row_index || g->schedule == COMETI_SCHEDULE_PINGPONG || g->dispatch || g->splits || g->push ||
                     g->ldc != g->n))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm wgrad: m_out = %d must be a positive multiple of 64, "
                           "ldc = %d equal to n = %d, and no SwiGLU, scale, row index, ping-pong or role",
                           g->m_out, g->ldc, g->n);
    if (!g->wgrad && (g->k <= 0 || g->k % COMETI_GEMM_BK))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm k = %d: must be a positive multiple of %d", g->k,
                           COMETI_GEMM_BK);
    if (g->groups < 1 || g->groups > COMETI_GEMM_MAX_GROUPS)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm groups = %d: must be 1..%d", g->groups,
                           COMETI_GEMM_MAX_GROUPS);
    if (g->ldc < g->n || g->ldc % 2)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm ldc = %d: must be even and >= n = %d", g->ldc, g->n);
    if ((uintptr_t)g->a % 16 || (uintptr_t)g->b % 16 || (uintptr_t)g->b_up % 16 || (uintptr_t)g->c % 4)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: a, b and b_up must be 16-byte aligned, c 4-byte aligned");
    if (g->b_up && !g->swiglu)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: b_up is for swiglu only");
    if (g->group_m < 0 || g->group_m > 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm group_m = %d: must be 0..64 (0: 8)", g->group_m);
    if (!g->err || !g->segs)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm: err (the failure report word) and segs must be set");
    if (g->a_rows < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm a_rows = %lld: must be >= 1", (long long)g->a_rows);
    /* A TMA store needs 16-byte rows, a 16-byte aligned C, and rows in place (no index). */
    const int tma_ok = g->ldc % 8 == 0 && (uintptr_t)g->c % 16 == 0 && !g->row_index;
    if (g->epilogue == COMETI_EPILOGUE_TMA && !tma_ok)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm epilogue TMA: ldc = %d must be a multiple of 8, c "
                           "16-byte aligned and row_index NULL", g->ldc);
    if (g->epilogue < COMETI_EPILOGUE_AUTO || g->epilogue > COMETI_EPILOGUE_TMA)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm epilogue = %d: must be 0..2", g->epilogue);
    if (g->schedule < COMETI_SCHEDULE_AUTO || g->schedule > COMETI_SCHEDULE_PINGPONG)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm schedule = %d: must be 0..2", g->schedule);
    if (g->schedule == COMETI_SCHEDULE_PINGPONG && block_n != 256)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm ping-pong schedule: built for block_n 256 only");
    /* (With column splits a tile's TMA stores would be counted one tile late, and the gate
     * and up stores before C's would be waited for with it: not built.) */
    if (g->gu && (!g->swiglu || g->gu_rows <= 0 || (uintptr_t)g->gu % 4 || g->splits))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm gu: needs swiglu, gu_rows = %lld > 0, a 4-byte "
                           "aligned gu and no column splits", (long long)g->gu_rows);
    if (g->c_fp32_add && (!g->wgrad || g->epilogue == COMETI_EPILOGUE_TMA || (uintptr_t)g->c % 8))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm c_fp32_add: for a weight gradient, with the direct "
                           "epilogue and an 8-byte aligned C");
    if (g->b_mn_major && (g->swiglu || g->schedule == COMETI_SCHEDULE_PINGPONG))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm b_mn_major: needs no swiglu and the cooperative "
                           "schedule");
    *block_n_out = block_n;
    *out_n_out = out_n;
    *tma_epilogue_out = !g->c_fp32_add && (g->epilogue == COMETI_EPILOGUE_TMA ||
                                           (g->epilogue == COMETI_EPILOGUE_AUTO && tma_ok));
    return COMET_SUCCESS;
}

static comet_status_t check_dispatch(char *err, const cometi_gemm_t *g)
{
    const cometi_gemm_dispatch_t *d = g->dispatch;
    if (d->blocks < 1 || !d->arrive || !d->expected || !g->sched)
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
    if (d->rows.x2 && ((uintptr_t)d->rows.x2 % 16 || d->rows.x2_offset % 16 || d->rows.wave_blocks))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: x2 = %p, %zu bytes on: both 16-byte "
                           "aligned, and no first wave (it copies x alone)", d->rows.x2, d->rows.x2_offset);
    if (g->splits || g->push)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm dispatch: not with the splits or push role");
    return COMET_SUCCESS;
}

static comet_status_t check_splits(char *err, const cometi_gemm_t *g, int n_tiles, int out_n)
{
    const cometi_gemm_splits_t *s = g->splits;
    if (s->n_splits < 1 || n_tiles % s->n_splits)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n_splits = %d: must divide the %d column tiles of %d "
                           "columns", s->n_splits, n_tiles, out_n);
    /* The combine reads n / n_splits columns per split: equal splits of whole tiles. */
    if (s->n_splits > 1 && g->n % out_n)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm n_splits = %d with n = %d: splits need n a multiple "
                           "of the %d-column tile (a partial last tile allows 1 split)", s->n_splits, g->n, out_n);
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
    if ((uintptr_t)c->y % 16 || g->n % 8)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm combine: y must be 16-byte aligned (is %p)", c->y);
    return COMET_SUCCESS;
}

static comet_status_t check_push(char *err, const cometi_gemm_t *g, int tma_epilogue)
{
    const cometi_gemm_push_t *p = g->push;
    const cometi_combine_t *c = &p->combine;
    if (!tma_epilogue || g->swiglu || g->row_index || g->splits || !p->dest || !p->maps ||
        (uintptr_t)p->maps % 64)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm push: needs the TMA epilogue, the destinations, the "
                           "owners' tensor maps (64-byte aligned) and no SwiGLU, row index or splits role");
    if (c->world < 1 || c->world > COMETI_MAX_RANKS || c->world > COMETI_PUSH_MAX_RANKS || c->rank < 0 ||
        c->rank >= c->world || c->tp < 1 || c->world % c->tp ||
        c->experts_per_group * (c->world / c->tp) != c->num_experts ||
        c->experts_per_group != g->groups || !c->peers || !c->plan.counts || !c->plan.send_offset ||
        !c->plan.recv_offset)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm push: world %d, rank %d, tp %d, experts %d / %d per "
                           "group (GEMM groups %d), or a NULL table", c->world, c->rank, c->tp, c->num_experts,
                           c->experts_per_group, g->groups);
    return COMET_SUCCESS;
}

comet_status_t cometi_gemm_prepare(char *err, const cometi_gemm_t *g, cometi_gemm_prepared_t *out)
{
    int block_n = 0, out_n = 0, tma_epilogue = 0;
    COMETI_TRY(check_core(err, g, &block_n, &out_n, &tma_epilogue));
    const int n_tiles = (g->n + out_n - 1) / out_n, pingpong = g->schedule == COMETI_SCHEDULE_PINGPONG;
    if (g->dispatch) COMETI_TRY(check_dispatch(err, g));
    if (g->splits) COMETI_TRY(check_splits(err, g, n_tiles, out_n));
    if (g->push) COMETI_TRY(check_push(err, g, tma_epilogue));
    const int dispatch_blocks = g->dispatch ? g->dispatch->blocks : 0;
    const int combine_blocks = g->splits ? g->splits->combine_blocks : 0;
    /* B rows per group, and where a group's up rows sit relative to its gate rows. */
    const int fused_up = g->swiglu && !g->b_up;
    const int b_group_rows = fused_up ? 2 * g->n : g->n;
    cometi_gemm_maps_t m;
    memset(&m, 0, sizeof(m));
    if (g->wgrad) /* A [a_rows][m_out]: boxes of 64 rows of m x 64 k rows */
        COMETI_TRY(make_map(err, &m.a, g->a, (uint64_t)g->m_out, (uint64_t)g->a_rows, COMETI_GEMM_BK, "A (wgrad)"));
    else
        COMETI_TRY(make_map(err, &m.a, g->a, (uint64_t)g->k, (uint64_t)g->a_rows, pingpong ? 64 : COMETI_GEMM_BM,
                            "A"));
    if (g->wgrad) { /* B [a_rows][n]: boxes of 64 columns x 64 k rows */
        COMETI_TRY(make_map(err, &m.b, g->b, (uint64_t)g->n, (uint64_t)g->a_rows, COMETI_GEMM_BK, "B (wgrad)"));
    } else if (g->swiglu) { /* [groups][n][k] views of the gate rows and of the up rows */
        const void *up = g->b_up ? g->b_up : (const char *)g->b + (size_t)g->n * g->k * 2;
        COMETI_TRY(make_map_3d(err, &m.b, g->b, (uint64_t)g->k, (uint64_t)g->n, (uint64_t)g->groups, (uint64_t)g->k,
                               (uint64_t)b_group_rows * g->k, (uint32_t)out_n, "B gate"));
        COMETI_TRY(make_map_3d(err, &m.up, up, (uint64_t)g->k, (uint64_t)g->n, (uint64_t)g->groups, (uint64_t)g->k,
                               (uint64_t)b_group_rows * g->k, (uint32_t)out_n, "B up"));
    } else if (g->b_mn_major) { /* [groups][k][n]: boxes of 64 columns x 64 k rows */
        COMETI_TRY(make_map_3d(err, &m.b, g->b, (uint64_t)g->n, (uint64_t)g->k, (uint64_t)g->groups, (uint64_t)g->n,
                               (uint64_t)g->k * g->n, COMETI_GEMM_BK, "B (MN-major)"));
    } else {
        COMETI_TRY(make_map(err, &m.b, g->b, (uint64_t)g->k, (uint64_t)g->groups * b_group_rows, (uint32_t)out_n,
                            "B"));
    }
    /* C's columns end at n (a ragged last tile stores nothing past it), rows ldc apart. */
    const uint64_t c_rows = g->wgrad ? (uint64_t)g->groups * g->m_out : (uint64_t)g->a_rows;
    if (tma_epilogue)
        COMETI_TRY(make_map_3d(err, &m.c, g->c, (uint64_t)g->n, c_rows, 1, (uint64_t)g->ldc, 0, 64, "C"));
    /* The kept gate and up, [gu_rows][2n] seen as [gu_rows][2][n]: a box of 64 rows x 64
     * columns of one half, stored like C's (rows past gu_rows clipped). */
    const int gu_tma = g->gu && tma_epilogue && (uintptr_t)g->gu % 16 == 0;
    if (gu_tma) {
        const uint64_t dims[3] = {(uint64_t)g->n, 2, (uint64_t)g->gu_rows}, strides[2] = {(uint64_t)g->n,
                                                                                         2 * (uint64_t)g->n};
        const uint32_t box[3] = {64, 1, 64};
        COMETI_TRY(encode_map(err, &m.gu, g->gu, 3, dims, strides, box, "gu"));
    }
    cometi_gemm_args_t args;
    memset(&args, 0, sizeof(args));
    args.segs = g->segs;
    args.groups = g->groups;
    args.n = g->n;
    args.k = g->wgrad ? COMETI_GEMM_BK : g->k; /* wgrad: each group's own rows set its k */
    args.ldc = g->ldc;
    args.m_out = g->wgrad ? g->m_out : 0;
    args.group_m = g->group_m ? g->group_m : 8;
    args.b_group_rows = b_group_rows;
    args.row_scale = g->row_scale;
    args.row_index = g->row_index;
    args.local_rows = g->local_rows;
    args.sched = g->sched;
    args.n_splits = g->splits ? g->splits->n_splits : 1;
    args.c = g->c;
    args.c_fp32_add = g->c_fp32_add;
    args.gu = g->gu;
    args.gu_rows = g->gu_rows;
    args.gu_tma = gu_tma;
    args.err = g->err;
    args.arrival_timeout_ns = g->timeout_ns ? g->timeout_ns : 10ull * 1000 * 1000 * 1000;
    args.timeout_ns = 2 * args.arrival_timeout_ns;
    args.tile_trace = g->tile_trace;
    args.tail_ws = g->wgrad ? NULL : (unsigned long long *)g->tail_ws;
    if (g->dispatch) {
        args.arrive = g->dispatch->arrive;
        args.expected = g->dispatch->expected;
        args.dispatch = g->dispatch->rows;
    }
    if (g->splits) {
        args.split_done = g->splits->split_done;
        args.combine_blocks = combine_blocks;
        args.combine = g->splits->combine;
    }
    if (g->push) {
        args.push_dest = g->push->dest;
        args.push_maps = (const CUtensorMap *)g->push->maps;
        args.combine = g->push->combine;
    }
    int sm_count = 0, dev = 0;
    COMETI_TRY(cometi_cuda(err, cudaGetDevice(&dev), "cudaGetDevice"));
    COMETI_TRY(cometi_cuda(err, cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev),
                           "cudaDeviceGetAttribute(SM count)"));
    const int side_blocks = dispatch_blocks + combine_blocks;
    /* GEMM blocks, then dispatch (or combine) blocks. */
    args.gemm_blocks = g->sms > 0 ? g->sms : sm_count - side_blocks;
    const int blocks = args.gemm_blocks + side_blocks;
    /* Blocks that wait for others must never keep those off the GPU: one per SM, all resident. */
    if ((g->dispatch || combine_blocks) && (args.gemm_blocks < 1 || blocks > sm_count))
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm with arrival waits or combine: %d GEMM + %d dispatch "
                           "or combine blocks must be 1..%d (one per SM, so every block is resident)",
                           args.gemm_blocks, side_blocks, sm_count);
    if (args.gemm_blocks < 1)
        return cometi_fail(err, COMET_INVALID_ARGUMENT, "gemm sms = %d with %d dispatch or combine blocks: no GEMM "
                           "block left", g->sms, side_blocks);
    /* The workspace holds two partials per SM (COMETI_GEMM_TAIL_SLOTS), and the plan's
     * no-deadlock argument needs every block resident: a grid past the SMs goes without
     * the cut. */
    if (blocks > sm_count) args.tail_ws = NULL;
    cometi_gemm_plan_t *pr = (cometi_gemm_plan_t *)out->bytes;
    pr->maps = m;
    pr->args = args;
    pr->blocks = blocks;
    pr->block_n = block_n;
    pr->swiglu = g->swiglu != 0;
    pr->pingpong = pingpong;
    pr->tma_epilogue = tma_epilogue;
    pr->b_mn_major = g->b_mn_major != 0;
    pr->wgrad = g->wgrad != 0;
    return COMET_SUCCESS;
}

comet_status_t cometi_gemm_launch(char *err, const cometi_gemm_prepared_t *p, cudaStream_t stream)
{
    return cometi_cuda(err, cometi_gemm_kernel_launch((const cometi_gemm_plan_t *)p->bytes, stream),
                       "launch grouped_gemm_kernel");
}

comet_status_t cometi_gemm_run(char *err, const cometi_gemm_t *g, cudaStream_t stream)
{
    cometi_gemm_prepared_t p;
    COMETI_TRY(cometi_gemm_prepare(err, g, &p));
    return cometi_gemm_launch(err, &p, stream);
}
