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
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

PRESETS = {  # name: (experts, top_k, hidden, ffn), as in src/config.c
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "phi-3.5-moe": (16, 2, 4096, 6400),
    "qwen2-57b-a14b": (64, 8, 3584, 2560),
    "qwen2-moe-2.7b": (64, 4, 2048, 1408),
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


def moe_layer(x, ids, weights, w13, w2, E, world, marks):
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
    h = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
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
    a = p.parse_args()
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
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        phases = {n: [] for n in ("total", "route", "a2a_out", "experts", "a2a_back", "combine")}
        rows = 0
        for it in range(-a.warmup, a.iters):
            x, ids, weights = sets[(it + a.warmup) % NSETS]
            _, rows = moe_layer(x, ids, weights, w13, w2, E, world, marks)
            if it < 0:
                continue
            marks[5].synchronize()
            t = [marks[i].elapsed_time(marks[i + 1]) for i in range(5)]
            for key, v in zip(("route", "a2a_out", "experts", "a2a_back", "combine"), t):
                phases[key].append(v)
            phases["total"].append(marks[0].elapsed_time(marks[5]))
        med = torch.tensor([statistics.median(phases[n]) for n in phases], device="cuda")
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # slowest rank, as comet bench reports
        flops = torch.tensor([rows * 6.0 * H * Fd], device="cuda", dtype=torch.float64)
        dist.all_reduce(flops)
        total, route, a2a_out, experts, a2a_back, combine = med.tolist()
        if rank == 0:
            print(f"\n{name}: E={E} top-k={k} H={H} F={Fd}, {m} tokens per GPU, {world} x "
                  f"{torch.cuda.get_device_name()} (EP={world}), routing {routing_kind}, torch {torch.__version__}, "
                  f"median of {a.iters} calls, slowest rank")
            print(f"{'case':16} {'impl':9} {'tokens':>6} {'total ms':>9} {'dispatch':>9} {'experts':>9} "
                  f"{'combine':>9} {'comm alone':>10} {'GEMM alone':>10} {'TFLOP/s':>8}")
            tflops = flops.item() / world / (experts * 1e-3) / 1e12
            print(f"{name:16} {'torch':9} {m:6d} {total:9.3f} {route + a2a_out:9.3f} {experts:9.3f} "
                  f"{a2a_back + combine:9.3f} {a2a_out + a2a_back:10.3f} {experts:10.3f} {tflops:8.0f}", flush=True)
            records.append({"case": name, "impl": "torch", "gpu": torch.cuda.get_device_name(), "ranks": world,
                            "experts": E, "top_k": k, "hidden": H, "ffn": Fd, "tokens_per_rank": m,
                            "routing": routing_kind, "skew": a.skew, "iters": a.iters, "torch": torch.__version__,
                            "median_ms": {"total": total, "route": route, "dispatch_a2a": a2a_out,
                                          "experts": experts, "combine_a2a": a2a_back, "combine": combine}})
        del w13, w2, sets
        torch.cuda.empty_cache()
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
