"""The same expert-parallel MoE layer the plain-PyTorch way, as a user runs it today:
route, all_to_all_single of the token rows, torch._grouped_mm for the expert GEMMs,
SwiGLU, grouped GEMM down, all_to_all_single back, weighted index_add_. Times each
phase with CUDA events and prints the columns `comet bench` prints, so comet's speed
is a ratio measured on the same GPUs in the same sitting.

    torchrun --nproc-per-node 2 bench/torch_peer.py --preset all --tokens 8192
    torchrun --nproc-per-node 2 bench/torch_peer.py --suite --json bench/suite-torch.json

--suite runs every preset (or those of --preset) at 1024..16384 tokens per GPU with
balanced and skewed routing, as `comet bench --suite` does; --json writes records in
the format of comet bench's baseline records (impl "torch"), for bench/plot_suite.py.

    torchrun --nproc-per-node 2 bench/torch_peer.py --train --preset all --tokens 8192
    torchrun --nproc-per-node 2 bench/torch_peer.py --train --check
    python3 bench/torch_peer.py --train --check --cpu     # no GPU: CPU, world 1, no dist

--train also times the layer under autograd (x, the routing weights, w13, w2 requiring
grad; y.backward(dy)): a row "torch-train" per case with the forward, the backward, the
step, and the six grouped GEMMs alone on the same rows and offsets (forward, dgrad, wgrad:
two each), medians, slowest rank; --json adds records of impl "torch-train" with
forward_ms, backward_ms, step_ms, gemms_ms. The backward is torch._grouped_mm's own where
this torch has one (probed at start), else GroupedMM's (--explicit-grad forces it).
--check compares y, dx, d weights, dW13, dW2 at a small shape with a float64 reference of
plain matmuls, prints the max relative errors and exits (1 if one is over tolerance); on
the CPU (no CUDA, or --cpu; under torchrun through gloo) _grouped_mm is a loop of matmuls.

    torchrun --nproc-per-node 2 bench/torch_peer.py --fp8 --preset all --tokens 8192

--fp8 also times the forward with FP8 experts, a row "torch-fp8" under each case's "torch"
row (and records of impl "torch-fp8"), to set beside `comet bench --fp8`: both expert GEMMs
through torch._scaled_grouped_mm with rowwise scales (what PyTorch offers on Hopper: E4M3
rows with one FP32 scale each; E4M3 weights, quantized once outside the timing, with one
FP32 scale per output column), the received x rows and the SwiGLU activation quantized on
the fly, where the GEMM reads them, as torchao's float8 rowwise MoE path does (amax per
row, scale 448 / amax, saturate, .to(torch.float8_e4m3fn)); rows still travel in bf16.
Routing, exchanges and combine are the bf16 layer's. Each case then prints how far the FP8
layer's y is from the bf16 layer's on the same inputs, 1 - 2 sum(xy) / sum(x^2 + y^2)
(DeepGEMM's measure; rowwise E4M3 of random normal data gives about 1e-3). Rows per expert
need no padding: the forward's kernel asserts 16-byte alignment along K and N only.

    torchrun --nproc-per-node 1 bench/torch_peer.py --train --fp8 --preset all --tokens 8192

--train --fp8 also times the training step with FP8 experts, a row "torch-fp8-train" (and
records of that impl), as torchao's float8 rowwise MoE training runs on Hopper: each expert
GEMM through torch._scaled_grouped_mm under autograd (FP8GroupedMM); the forward and dgrad
on rows quantized along K where the GEMM reads them; the weight gradients as 2-D x 2-D
grouped GEMMs along the tokens, dout^T and a^T quantized per expert along the tokens (one
scale per column per expert); the weights' E4M3 copies (W per output row, W^T per input
row) made once outside the timing, as comet's are once per optimizer step. The casts are
eager torch (torchao fuses its own in Triton), so the row also gives the six FP8 GEMMs
alone on the same rows: no FP8 layer built on them is faster than that. Each case prints
how far its y, dx and weight gradients are from the bf16 autograd layer's (the measure
above). Each expert's rows must be a multiple of 16 (the FP8 weight-gradient kernel's
alignment along K): balanced routing at these token counts is.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

PRESETS = {  # name: (experts, top_k, hidden, ffn), as in src/layer/config.c
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "phi-3.5-moe": (16, 2, 4096, 6400),
    "qwen2-57b-a14b": (64, 8, 3584, 2560),
    "qwen2-moe-2.7b": (64, 4, 2048, 1408),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}
NSETS = 3  # input sets rotated between calls, so they do not sit in L2


def routing(kind, skew, m, k, E, rank, gen):
    """Balanced: token g picks experts (g*k + j) mod E, as comet bench does; random and
    skewed draw k distinct experts (skewed: weight skew^(-e/(E-1)))."""
    if kind == "balanced":
        g = torch.arange(rank * m, rank * m + m, device="cuda").unsqueeze(1)
        ids = (g * k + torch.arange(k, device="cuda")) % E
    else:
        w = torch.ones(E, device="cuda")
        if kind == "skewed" and E > 1:
            w = skew ** (-torch.arange(E, device="cuda", dtype=torch.float32) / (E - 1))
        ids = torch.multinomial(w.expand(m, E), k, replacement=False, generator=gen)
    weights = torch.rand(m, k, device="cuda", generator=gen) + 0.1
    return ids.to(torch.int64), weights / weights.sum(1, keepdim=True)


E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quant_rows(t):
    """E4M3 rows and their FP32 dequantization scales (value = q * scale), one per row
    (the last dimension's amax), as torchao's float8 rowwise recipe quantizes."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    q = (t.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (amax / E4M3_MAX).squeeze(-1)


def expert_gemm(a, w, offs, wq=None):
    """a_g W_g^T per expert (w [E][N][K], nn.Linear's [out][in]): torch._grouped_mm in bf16,
    or with wq = quant_rows(w) (E4M3 [E][N][K], a scale per output column [E][N])
    torch._scaled_grouped_mm on a's rows quantized here, bf16 out."""
    if wq is None:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    q, scale = quant_rows(a)
    return torch._scaled_grouped_mm(q, wq[0].transpose(-2, -1), scale, wq[1], offs=offs, out_dtype=torch.bfloat16)


def quant_groups_t(t, lengths):
    """t [R][C] transposed and quantized per expert along the tokens: E4M3 [C][R] (row
    major) and FP32 scales [G][C] flattened, one per column per group of rows (lengths),
    as torch._scaled_grouped_mm's 2-D x 2-D form reads them."""
    amax = torch.segment_reduce(t.abs(), "max", lengths=lengths, axis=0).float().clamp(min=1e-12)  # [G][C]
    inv = (E4M3_MAX / amax).repeat_interleave(lengths, dim=0, output_size=t.shape[0])
    q = (t.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.t().contiguous(), (amax / E4M3_MAX).flatten()


def fp8_copies(w):
    """A weight's E4M3 copies (w [E][N][K]): rows of W (the forward) and of W^T (dgrad)."""
    return quant_rows(w), quant_rows(w.transpose(-2, -1).contiguous())


class FP8GroupedMM(torch.autograd.Function):
    """out = a_g W_g^T per group (a [R][K] bf16, w [E][N][K] the bf16 master, offs), all
    three GEMMs in FP8 through torch._scaled_grouped_mm, rowwise scales (the file's
    header); wq, wq_t = fp8_copies(w), made outside."""
    @staticmethod
    def forward(ctx, a, w, offs, wq, wq_t):
        ctx.save_for_backward(a, offs, wq_t[0], wq_t[1])
        return expert_gemm(a, w, offs, wq)

    @staticmethod
    def backward(ctx, dout):
        a, offs, q_t, s_t = ctx.saved_tensors
        dout = dout.contiguous()
        qd, sd = quant_rows(dout)
        da = torch._scaled_grouped_mm(qd, q_t.transpose(-2, -1), sd, s_t, offs=offs, out_dtype=torch.bfloat16)
        lengths = torch.diff(offs, prepend=offs.new_zeros(1)).long()
        qdt, sdt = quant_groups_t(dout, lengths)  # [N][R]
        qat, sat = quant_groups_t(a, lengths)     # [K][R]
        dw = torch._scaled_grouped_mm(qdt, qat.t(), sdt, sat, offs=offs, out_dtype=torch.bfloat16)
        return da, dw, None, None, None


def moe_layer(x, ids, weights, w13, w2, E, world, marks, fp8=None):
    """The layer's forward; fp8 = (quant_rows(w13), quant_rows(w2)) runs its experts in FP8."""
    m, k = ids.shape
    per = E // world
    marks[0].record()
    # Route: rows per expert, exchanged so each rank knows what it receives (host sync).
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=E)
    counts_all = torch.empty(world * E, dtype=counts.dtype, device="cuda")
    dist.all_to_all_single(counts_all, counts.repeat(world).contiguous())
    # counts_all[s*E + e]: rows rank s sends to expert e, for all e (we need our experts).
    counts_all = counts_all.view(world, E)
    rank = dist.get_rank()
    recv_counts = counts_all[:, rank * per:(rank + 1) * per]  # [src][local expert]
    send_splits = counts.view(world, per).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    order = torch.argsort(flat, stable=True)
    send = x.index_select(0, order // k)
    marks[1].record()
    recv = torch.empty(sum(recv_splits), x.shape[1], dtype=x.dtype, device="cuda")
    dist.all_to_all_single(recv, send, recv_splits, send_splits)
    marks[2].record()
    # Received rows are [src][expert]; the grouped GEMM wants [expert][src].
    chunk = recv_counts.flatten()
    chunk_start = torch.cumsum(chunk, 0) - chunk
    by_expert = recv_counts.t().flatten()
    idx = torch.repeat_interleave(chunk_start.view(world, per).t().flatten(), by_expert)
    within = torch.arange(idx.numel(), device="cuda") - torch.repeat_interleave(
        torch.cumsum(by_expert, 0) - by_expert, by_expert)
    perm = idx + within
    rows = recv.index_select(0, perm)
    offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)
    w13q, w2q = fp8 or (None, None)
    h = expert_gemm(rows, w13, offs, w13q)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = expert_gemm(act, w2, offs, w2q)
    back_rows = torch.empty_like(out)
    back_rows[perm] = out
    marks[3].record()
    back = torch.empty(send.shape, dtype=x.dtype, device="cuda")
    dist.all_to_all_single(back, back_rows, send_splits, recv_splits)
    marks[4].record()
    y = torch.zeros(m, x.shape[1], dtype=torch.float32, device="cuda")
    y.index_add_(0, order // k, back.float() * weights.flatten()[order].unsqueeze(1))
    y = y.to(x.dtype)
    marks[5].record()
    return y, int(offs[-1].item()) if offs.numel() else 0

# ---- --train: the same layer under autograd ----

def loop_gmm(a, b, offs):
    """torch._grouped_mm by a loop of matmuls (any device, dtype, torch): 2-D x 3-D gives
    rows [R][N] (group g's rows times b[g]); 2-D x 2-D is grouped along K, [G][M][N]."""
    spans = list(zip([0] + offs.tolist()[:-1], offs.tolist()))
    if b.dim() == 3:
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(spans)])
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in spans])


def raw_gmm(a, b, offs):  # what GroupedMM and the GEMMs alone call
    return torch._grouped_mm(a, b, offs=offs) if a.is_cuda else loop_gmm(a, b, offs)


class GroupedMM(torch.autograd.Function):
    """out = a_g @ b[g] per group (a [R][K], rows grouped by offs; b [G][K][N]) for a torch
    whose _grouped_mm has no backward: dgrad da_g = dout_g @ b[g]^T, and wgrad
    db[g] = a_g^T dout_g, a 2-D x 2-D grouped GEMM along K."""
    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return raw_gmm(a, b, offs)

    @staticmethod
    def backward(ctx, dout):
        (a, b, offs), dout = ctx.saved_tensors, dout.contiguous()
        da = raw_gmm(dout, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
        return da, raw_gmm(a.t(), dout, offs) if ctx.needs_input_grad[1] else None, None


def has_grouped_mm(device, dtype, backward=True):
    """Whether torch._grouped_mm runs here (and has a backward: else GroupedMM is used)."""
    try:
        a = torch.ones(16, 8, device=device, dtype=dtype, requires_grad=backward)
        b = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=backward)
        out = torch._grouped_mm(a, b, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
        if backward:
            out.backward(torch.ones_like(out))
        return not backward or (a.grad is not None and b.grad is not None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def grouped(native):
    return (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs)) if native else GroupedMM.apply


def grad_name(native, cuda=True):
    return "torch._grouped_mm's autograd" if native else \
        "GroupedMM over " + ("torch._grouped_mm" if cuda else "a loop of matmuls")


class A2A(torch.autograd.Function):
    """all_to_all_single of rows whose backward is the reverse exchange (torch's own, in
    torch.distributed.nn.functional, is deprecated in newer torch)."""
    @staticmethod
    def forward(ctx, t, out_splits, in_splits):
        ctx.splits, out = (in_splits, out_splits), t.new_empty(sum(out_splits), *t.shape[1:])
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        return A2A.apply(grad, *ctx.splits), None, None


def a2a(t, out_splits, in_splits):  # the identity without a process group (CPU check, world 1)
    return A2A.apply(t, out_splits, in_splits) if dist.is_available() and dist.is_initialized() else t


def plan(ids, E, world, rank):
    """moe_layer's route: token-choice order, splits, the [src][expert] -> [expert][src]
    row permutation and its inverse, the grouped GEMMs' offsets."""
    per, dev, flat = E // world, ids.device, ids.flatten()
    counts = counts_all = torch.bincount(flat, minlength=E)
    if dist.is_available() and dist.is_initialized():
        counts_all = torch.empty(world * E, dtype=counts.dtype, device=dev)
        dist.all_to_all_single(counts_all, counts.repeat(world).contiguous())
    recv_counts = counts_all.view(world, E)[:, rank * per:(rank + 1) * per]  # [src][local expert]
    chunk = recv_counts.flatten()
    chunk_start = torch.cumsum(chunk, 0) - chunk
    by_expert = recv_counts.t().flatten()
    idx = torch.repeat_interleave(chunk_start.view(world, per).t().flatten(), by_expert)
    perm = idx + torch.arange(idx.numel(), device=dev) - torch.repeat_interleave(
        torch.cumsum(by_expert, 0) - by_expert, by_expert)
    return (torch.argsort(flat, stable=True), counts.view(world, per).sum(1).tolist(),
            recv_counts.sum(1).tolist(), perm, torch.argsort(perm),
            torch.cumsum(recv_counts.sum(0), 0).to(torch.int32))


def moe_train(x, ids, weights, w13, w2, E, world, rank, gmm, fp8=None):
    """moe_layer's math with every step differentiable (no in-place writes); fp8 =
    (fp8_copies(w13), fp8_copies(w2)) runs the expert GEMMs through FP8GroupedMM."""
    (m, k), H = ids.shape, x.shape[1]
    order, send_splits, recv_splits, perm, inv, offs = plan(ids, E, world, rank)
    rows = a2a(x.index_select(0, order // k), recv_splits, send_splits).index_select(0, perm)
    if fp8:
        gate, up = FP8GroupedMM.apply(rows, w13, offs, *fp8[0]).chunk(2, dim=-1)
        out = FP8GroupedMM.apply(F.silu(gate) * up, w2, offs, *fp8[1])
    else:
        gate, up = gmm(rows, w13.transpose(-2, -1), offs).chunk(2, dim=-1)
        out = gmm(F.silu(gate) * up, w2.transpose(-2, -1), offs)
    back = a2a(out.index_select(0, inv), send_splits, recv_splits)
    acc = torch.promote_types(x.dtype, torch.float32)  # bf16 sums in float32, as moe_layer's
    y = torch.zeros(m, H, dtype=acc, device=x.device).index_add(
        0, order // k, back.to(acc) * weights.flatten()[order].unsqueeze(1).to(acc))
    return y.to(x.dtype)


def reference(x, ids, weights, w13, w2):
    """Plain matmuls, all experts: y_t = sum_j w_tj (silu(x_t W1_e^T) * x_t W3_e^T) W2_e^T."""
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[t] @ w13[e].t()).chunk(2, dim=-1)
        y = y.index_add(0, t, (F.silu(gate) * up) @ w2[e].t() * weights[t, j].unsqueeze(1))
    return y


def check(device, dtype, native, world=1, rank=0):
    """moe_train's y and gradients against reference()'s in float64 at a small shape: every
    rank draws the same global problem and compares its tokens and its experts."""
    per, k, H, Fd, m = 3, 2, 64, 32, 40
    E, M, g = per * world, m * world, torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=g)
    X, DY, W13, W2 = rnd(M, H), rnd(M, H), rnd(E, 2 * Fd, H) / H ** 0.5, rnd(E, H, Fd) / Fd ** 0.5
    ids = torch.rand(M, E - 1, generator=g).argsort(1)[:, :k]  # expert E-1 gets no rows
    W = torch.rand(M, k, dtype=torch.float64, generator=g) + 0.1
    W /= W.sum(1, keepdim=True)
    ref = [t.clone().requires_grad_() for t in (X, W, W13, W2)]
    reference(ref[0], ids, *ref[1:]).backward(DY)
    Y = reference(X, ids, W, W13, W2)
    tok, exp = slice(rank * m, rank * m + m), slice(rank * per, rank * per + per)
    leaf = lambda t, dt=dtype: t.to(device, dt).requires_grad_()
    x, w13, w2 = leaf(X[tok]), leaf(W13[exp]), leaf(W2[exp])
    w = leaf(W[tok], torch.promote_types(dtype, torch.float32))  # routing weights: float32 at least
    y = moe_train(x, ids[tok].to(device), w, w13, w2, E, world, rank, grouped(native))
    y.backward(DY[tok].to(device, dtype))
    pairs = {"y": (y, Y[tok]), "dx": (x.grad, ref[0].grad[tok]), "d weights": (w.grad, ref[1].grad[tok]),
             "dW13": (w13.grad, ref[2].grad[exp]), "dW2": (w2.grad, ref[3].grad[exp])}
    err = torch.tensor([float((a.detach().double().cpu() - b).abs().max() / b.abs().max())
                        for a, b in pairs.values()], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 3e-2)
    if rank == 0:
        print(f"check ({grad_name(native, x.is_cuda)}, {str(dtype)[6:]} on {device}, world {world}, {E} experts, "
              f"top-{k}, H={H} F={Fd}, {m} tokens per rank): max relative error " + ", ".join(
                  f"{n} {e:.2e}" for n, e in zip(pairs, err.tolist()))
              + f" (tolerance {tol:.0e}): " + ("ok" if (err <= tol).all() else "FAIL"), flush=True)
    return bool((err <= tol).all())


def median_events(fn, warmup, iters, n):
    """fn(it, marks) warmup + iters times: medians of the spans between its n marks, then of
    the whole."""
    marks, spans = [torch.cuda.Event(enable_timing=True) for _ in range(n)], [[] for _ in range(n)]
    for it in range(-warmup, iters):
        fn(it, marks)
        if it >= 0:
            marks[-1].synchronize()
            for i in range(n - 1):
                spans[i].append(marks[i].elapsed_time(marks[i + 1]))
            spans[-1].append(marks[0].elapsed_time(marks[-1]))
    return [statistics.median(s) for s in spans]


def train_case(sets, w13, w2, E, world, rank, native, warmup, iters, fp8=None):
    """This rank's medians: the forward under autograd, the backward, the step; the six
    grouped GEMMs alone, in turns, on set 0's rows and offsets (forward, dgrad, wgrad, all
    six); and set 0's received rows. fp8 = (fp8_copies(w13), fp8_copies(w2)): the FP8
    layer, and its GEMMs alone on operands quantized outside the timing."""
    gmm, w13, w2 = grouped(native), torch.nn.Parameter(w13.detach()), torch.nn.Parameter(w2.detach())
    tsets = [(x.detach().requires_grad_(), ids, w.detach().requires_grad_(), torch.randn_like(x))
             for x, ids, w in sets]

    def step(it, marks):
        x, ids, w, dy = tsets[(it + warmup) % len(tsets)]
        x.grad = w.grad = w13.grad = w2.grad = None  # fresh gradients each step
        marks[0].record()
        y = moe_train(x, ids, w, w13, w2, E, world, rank, gmm, fp8)
        marks[1].record()
        y.backward(dy)
        marks[2].record()

    offs = plan(sets[0][1], E, world, rank)[5]
    R, (_, F2, H) = (int(offs[-1]) if offs.numel() else 0), w13.shape
    rnd = lambda n: torch.randn(R, n, device=w13.device, dtype=w13.dtype)
    rows, d_out, act, d_h, W13, W2 = rnd(H), rnd(H), rnd(F2 // 2), rnd(F2), w13.detach(), w2.detach()
    if fp8:
        sgmm = lambda q, b: torch._scaled_grouped_mm(q[0], b[0], q[1], b[1], offs=offs, out_dtype=torch.bfloat16)
        lengths = torch.diff(offs, prepend=offs.new_zeros(1)).long()
        (q13, q13t), (q2, q2t) = fp8
        b13, b2 = (q13[0].transpose(-2, -1), q13[1]), (q2[0].transpose(-2, -1), q2[1])
        b13t, b2t = (q13t[0].transpose(-2, -1), q13t[1]), (q2t[0].transpose(-2, -1), q2t[1])
        q_rows, q_act, q_dout, q_dh = quant_rows(rows), quant_rows(act), quant_rows(d_out), quant_rows(d_h)
        t_dout, t_act, t_dh, t_rows = (quant_groups_t(t, lengths) for t in (d_out, act, d_h, rows))
        t_act, t_rows = (t_act[0].t(), t_act[1]), (t_rows[0].t(), t_rows[1])

        def gemms(it, marks):
            marks[0].record()
            sgmm(q_rows, b13), sgmm(q_act, b2)
            marks[1].record()
            sgmm(q_dout, b2t), sgmm(q_dh, b13t)                          # dgrad
            marks[2].record()
            sgmm(t_dout, t_act), sgmm(t_dh, t_rows)                      # wgrad
            marks[3].record()
    else:
        def gemms(it, marks):
            marks[0].record()
            raw_gmm(rows, W13.transpose(-2, -1), offs), raw_gmm(act, W2.transpose(-2, -1), offs)
            marks[1].record()
            raw_gmm(d_out, W2, offs), raw_gmm(d_h, W13, offs)                # dgrad
            marks[2].record()
            raw_gmm(d_out.t(), act, offs), raw_gmm(d_h.t(), rows, offs)      # wgrad
            marks[3].record()

    return median_events(step, warmup, iters, 3) + median_events(gemms, warmup, iters, 4), R


def train_distance(sets, w13, w2, E, world, rank, native, fp8):
    """The FP8 training step's y, dx, dW13 and dW2 against the bf16 autograd layer's on set
    0: 1 - 2 sum(xy) / sum(x^2 + y^2) each, summed over ranks."""
    x0, ids, w0 = sets[0]
    dy = torch.randn(x0.shape, device=x0.device, dtype=x0.dtype, generator=torch.Generator(x0.device).manual_seed(5))
    outs = []
    for q in (fp8, None):
        x, w = x0.detach().requires_grad_(), w0.detach()
        p13, p2 = w13.detach().requires_grad_(), w2.detach().requires_grad_()
        y = moe_train(x, ids, w, p13, p2, E, world, rank, grouped(native), q)
        y.backward(dy)
        outs.append([t.detach().double() for t in (y, x.grad, p13.grad, p2.grad)])
    d = torch.stack([torch.stack([2 * (a * b).sum(), (a * a + b * b).sum()]) for a, b in zip(*outs)])
    dist.all_reduce(d)
    return [1 - n / m if m > 0 else 0.0 for n, m in d.tolist()]


def time_layer(sets, w13, w2, E, world, warmup, iters, fp8=None):
    """moe_layer's medians over iters calls after warmup, the input sets in turn: total,
    route, dispatch all-to-all, experts, return all-to-all, combine (ms, the slowest
    rank's); and the rows this rank's experts got in the last call."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    phases = {n: [] for n in ("total", "route", "a2a_out", "experts", "a2a_back", "combine")}
    rows = 0
    for it in range(-warmup, iters):
        x, ids, weights = sets[(it + warmup) % len(sets)]
        _, rows = moe_layer(x, ids, weights, w13, w2, E, world, marks, fp8)
        if it < 0:
            continue
        marks[5].synchronize()
        t = [marks[i].elapsed_time(marks[i + 1]) for i in range(5)]
        for key, v in zip(("route", "a2a_out", "experts", "a2a_back", "combine"), t):
            phases[key].append(v)
        phases["total"].append(marks[0].elapsed_time(marks[5]))
    med = torch.tensor([statistics.median(phases[n]) for n in phases], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # slowest rank, as comet bench reports
    return med.tolist(), rows


def fp8_distance(sets, w13, w2, E, world, fp8):
    """1 - 2 sum(xy) / sum(x^2 + y^2) of the FP8 layer's y (x) against the bf16 layer's (y)
    on the first input set, the largest over ranks."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    x, ids, weights = sets[0]
    y8 = moe_layer(x, ids, weights, w13, w2, E, world, marks, fp8)[0].double()
    y = moe_layer(x, ids, weights, w13, w2, E, world, marks)[0].double()
    d = torch.stack([2 * (y8 * y).sum(), (y8 * y8 + y * y).sum()])
    dist.all_reduce(d)  # sums over every rank's tokens
    return 1 - (d[0] / d[1]).item() if d[1] > 0 else 0.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", help="name, comma list, or all [mixtral-8x7b; with --suite, all]")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--routing", default="balanced", choices=["balanced", "random", "skewed"])
    p.add_argument("--skew", type=float, default=8.0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--suite", action="store_true", help="1024..16384 tokens x balanced, skewed")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--train", action="store_true", help="also time forward + backward under autograd")
    p.add_argument("--explicit-grad", action="store_true", help="GroupedMM even where _grouped_mm has autograd")
    p.add_argument("--check", action="store_true", help="with --train: check the gradients, small shape, and exit")
    p.add_argument("--cpu", action="store_true", help="with --check: on the CPU, world 1, no torchrun")
    p.add_argument("--fp8", action="store_true", help="also FP8 experts (_scaled_grouped_mm): the forward, and "
                   "with --train the training step")
    a = p.parse_args()
    if (a.check or a.explicit_grad) and not a.train:
        p.error("--check and --explicit-grad go with --train")
    if a.fp8 and a.check:
        p.error("--fp8 times the forward on GPUs; --check checks the bf16 training layer")
    if a.check and (a.cpu or not torch.cuda.is_available()):  # under torchrun: gloo, any world
        rank, world = 0, 1
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
            rank, world = dist.get_rank(), dist.get_world_size()
        # float64 through GroupedMM's loop; float32 through _grouped_mm's autograd where the CPU has it
        native = not a.explicit_grad and has_grouped_mm("cpu", torch.float32)
        ok = all([check("cpu", torch.float64, False, world, rank)]
                 + [check("cpu", torch.float32, True, world, rank)] * native)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    if a.suite and (a.tokens != 8192 or a.routing != "balanced"):
        p.error("--suite runs 1024 to 16384 tokens and both routings: leave out --tokens and --routing")
    preset = a.preset or ("all" if a.suite else "mixtral-8x7b")
    names = list(PRESETS) if preset == "all" else preset.split(",")
    for name in names:
        if name not in PRESETS:
            p.error(f"--preset {name}: expected one of {', '.join(PRESETS)} or all")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    native = a.train and not a.explicit_grad and has_grouped_mm("cuda", torch.bfloat16)
    if a.check:  # float32 where this torch's _grouped_mm takes it on the GPU, else bf16
        dtype = torch.float32 if has_grouped_mm("cuda", torch.float32, backward=False) else torch.bfloat16
        ok = all([check("cuda", dtype, nat, world, rank) for nat in [False] + [True] * native])
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234 + rank)
    cases = [(r, t, n) for r in ("balanced", "skewed") for t in (1024, 2048, 4096, 8192, 16384) for n in names] \
        if a.suite else [(a.routing, a.tokens, n) for n in names]
    records = []
    for routing_kind, tokens, name in cases:
        E, k, H, Fd = PRESETS[name]
        per, m = E // world, tokens
        w13 = torch.randn(per, 2 * Fd, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H ** 0.5
        w2 = torch.randn(per, H, Fd, device="cuda", dtype=torch.bfloat16, generator=gen) / Fd ** 0.5
        sets = []
        for _ in range(NSETS):
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            ids, weights = routing(routing_kind, a.skew, m, k, E, rank, gen)
            sets.append((x, ids, weights))
        fp8 = (quant_rows(w13), quant_rows(w2)) if a.fp8 else None  # once, outside the timing
        base = None
        for impl, q in [("torch", None)] + [("torch-fp8", fp8)] * a.fp8:
            (total, route, a2a_out, experts, a2a_back, combine), rows = time_layer(
                sets, w13, w2, E, world, a.warmup, a.iters, q)
            flops = torch.tensor([rows * 6.0 * H * Fd], device="cuda", dtype=torch.float64)
            dist.all_reduce(flops)
            distance = fp8_distance(sets, w13, w2, E, world, q) if q else None
            if rank != 0:
                continue
            if q is None:
                print(f"\n{name}: E={E} top-k={k} H={H} F={Fd}, {m} tokens per GPU, {world} x "
                      f"{torch.cuda.get_device_name()} (EP={world}), routing {routing_kind}, "
                      f"torch {torch.__version__}, median of {a.iters} calls, slowest rank")
                print(f"{'case':16} {'impl':9} {'tokens':>6} {'total ms':>9} {'dispatch':>9} {'experts':>9} "
                      f"{'combine':>9} {'comm alone':>10} {'GEMM alone':>10} {'TFLOP/s':>8}")
            tflops = flops.item() / world / (experts * 1e-3) / 1e12
            print(f"{name:16} {impl:9} {m:6d} {total:9.3f} {route + a2a_out:9.3f} {experts:9.3f} "
                  f"{a2a_back + combine:9.3f} {a2a_out + a2a_back:10.3f} {experts:10.3f} {tflops:8.0f}", flush=True)
            record = {"case": name, "impl": impl, "gpu": torch.cuda.get_device_name(), "ranks": world,
                      "experts": E, "top_k": k, "hidden": H, "ffn": Fd, "tokens_per_rank": m,
                      "routing": routing_kind, "skew": a.skew, "iters": a.iters, "torch": torch.__version__,
                      "median_ms": {"total": total, "route": route, "dispatch_a2a": a2a_out,
                                    "experts": experts, "combine_a2a": a2a_back, "combine": combine}}
            if q is None:
                base = record
            else:
                record["fp8_vs_bf16"] = distance
                print(f"{'':16} torch-fp8's y against torch's: 1 - 2 sum(xy) / sum(x^2 + y^2) = {distance:.2e}",
                      flush=True)
            records.append(record)
        if a.train:
            res, rows = train_case(sets, w13, w2, E, world, rank, native, a.warmup, a.iters)
            dist.all_reduce(med := torch.tensor(res, device="cuda"), op=dist.ReduceOp.MAX)
            fwd, bwd, step, g_fwd, g_dgrad, g_wgrad, gemms = med.tolist()
            # The step's FLOPs: the forward's two GEMMs, dgrad's two, wgrad's two.
            dist.all_reduce(flops := torch.tensor([rows * 18.0 * H * Fd], device="cuda", dtype=torch.float64))
            if rank == 0:
                grad = grad_name(native)
                print(f"{'case':16} {'impl':11} {'tokens':>6} {'forward ms':>10} {'backward ms':>11} "
                      f"{'step ms':>9} {'GEMMs alone':>11} {'step TFLOP/s':>12}   (backward by {grad}; "
                      f"GEMMs alone: forward {g_fwd:.3f} + dgrad {g_dgrad:.3f} + wgrad {g_wgrad:.3f} ms)")
                print(f"{name:16} {'torch-train':11} {m:6d} {fwd:10.3f} {bwd:11.3f} {step:9.3f} {gemms:11.3f} "
                      f"{flops.item() / world / (step * 1e-3) / 1e12:12.0f}", flush=True)
                records.append(dict(base, impl="torch-train", grad=grad, forward_ms=fwd, backward_ms=bwd,
                                    step_ms=step, gemms_ms=gemms, median_ms={
                                        "forward": fwd, "backward": bwd, "step": step, "gemms": gemms,
                                        "gemms_forward": g_fwd, "gemms_dgrad": g_dgrad, "gemms_wgrad": g_wgrad}))
            if a.fp8:
                copies = (fp8_copies(w13), fp8_copies(w2))  # once per optimizer step, outside the timing
                res, _ = train_case(sets, w13, w2, E, world, rank, native, a.warmup, a.iters, copies)
                dist.all_reduce(med := torch.tensor(res, device="cuda"), op=dist.ReduceOp.MAX)
                fwd8, bwd8, step8, g8_fwd, g8_dgrad, g8_wgrad, gemms8 = med.tolist()
                far = train_distance(sets, w13, w2, E, world, rank, native, copies)
                if rank == 0:
                    print(f"{name:16} {'torch-fp8-train':11} {m:6d} {fwd8:10.3f} {bwd8:11.3f} {step8:9.3f} "
                          f"{gemms8:11.3f} {flops.item() / world / (step8 * 1e-3) / 1e12:12.0f}   (FP8 GEMMs alone: "
                          f"forward {g8_fwd:.3f} + dgrad {g8_dgrad:.3f} + wgrad {g8_wgrad:.3f} ms)")
                    print(f"{'':16} torch-fp8-train against torch-train, 1 - 2 sum(xy) / sum(x^2 + y^2): "
                          + ", ".join(f"{n} {v:.2e}" for n, v in zip(("y", "dx", "dW13", "dW2"), far)), flush=True)
                    records.append(dict(base, impl="torch-fp8-train", grad="FP8GroupedMM", forward_ms=fwd8,
                                        backward_ms=bwd8, step_ms=step8, gemms_ms=gemms8,
                                        fp8_vs_bf16=dict(zip(("y", "dx", "dW13", "dW2"), far)), median_ms={
                                            "forward": fwd8, "backward": bwd8, "step": step8, "gemms": gemms8,
                                            "gemms_forward": g8_fwd, "gemms_dgrad": g8_dgrad,
                                            "gemms_wgrad": g8_wgrad}))
        del w13, w2, sets, fp8
        torch.cuda.empty_cache()
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
