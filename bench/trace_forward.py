"""Where one comet_moe_forward's time goes, kernel by kernel, on every rank: the forward
runs under torch.profiler (CUPTI sees libcomet's kernels too), and each kernel's median
duration over the calls is printed, with the route's kernels summed, and the forward's
span on the GPU (first kernel's start to last kernel's end) with the time between its
kernels. Calls are taken one at a time (barrier, call, sync), so each rank's exchange
kernel also holds its wait for the slower rank: the rank with the shorter exchange shows
the route's own cost.

    torchrun --nproc-per-node 2 bench/trace_forward.py
    torchrun --nproc-per-node 2 bench/trace_forward.py --preset qwen2-57b-a14b --tokens 1024 8192
    torchrun --nproc-per-node 2 bench/trace_forward.py --graph    # each call a CUDA graph replay
    torchrun --nproc-per-node 2 bench/trace_forward.py --routing skewed --starts   # kernel@start

Needs build/libcomet.so (`make`, built against PyTorch's NCCL: scripts/device-run.sh
shows how). Routing: the block's router on random activations (about balanced), or
--routing skewed.
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before anything initialises NCCL

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import comet_moe  # noqa: E402
from comet_moe.block import mixtral_route  # noqa: E402

# Kernel name fragments -> short names, in launch order. The grouped GEMM is GEMM0 when its
# SWIGLU template argument (the fourth) is true, else GEMM1.
KERNELS = [("Memset", "memset"), ("chunk_rank", "rank"), ("chunk_offset", "offset"), ("exchange_plan", "exchange"),
           ("place_rows", "place"), ("gemm0", "gemm0"), ("push_dest", "dest"), ("gemm1", "gemm1"),
           ("combine_tail", "tail"), ("push_sum", "sum")]
ROUTE = ("memset", "rank", "offset", "exchange", "place")
GEMM = re.compile(r"grouped_gemm_kernel<\d+, \d+, \w+, (\w+), \w+>")


def kernel_key(name):
    """The fragment KERNELS matches for a kernel's name: gemm0 / gemm1 for the GEMM."""
    m = GEMM.search(name)
    return ("gemm0" if m.group(1) == "true" else "gemm1") if m else name


def random_block(comm, preset, tokens, device):
    cfg = comet_moe.MoeConfig.preset(preset, max_tokens=tokens)
    block = comet_moe.CometSparseMoeBlock(comm, cfg, impl="fused")
    E, H, Fd = cfg.num_experts, cfg.hidden, cfg.ffn
    g = torch.Generator(device=device).manual_seed(7)
    sd = {"gate.weight": torch.randn(E, H, device=device, dtype=torch.bfloat16, generator=g) / H ** 0.5}
    for e in range(E):
        for name, shape in (("w1", (Fd, H)), ("w3", (Fd, H)), ("w2", (H, Fd))):
            sd[f"experts.{e}.{name}.weight"] = torch.randn(*shape, device=device, dtype=torch.bfloat16,
                                                           generator=g) / shape[1] ** 0.5
    block.load_state_dict(sd)
    return block, cfg


def kernel_medians(block, x, ids, w, calls, graph):
    with torch.inference_mode():
        out = block.forward_routed(x, ids, w)
        for _ in range(4):
            block.forward_routed(x, ids, w, out=out)
        torch.cuda.synchronize()
        call = lambda: block.forward_routed(x, ids, w, out=out)  # noqa: E731
        if graph:  # the forward captured once, each call a replay
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                block.forward_routed(x, ids, w, out=out)
            call = g.replay
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                dist.barrier()
                torch.cuda.synchronize()
                call()
                torch.cuda.synchronize()
                time.sleep(0.002)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    durations, ours = {}, []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memset"):
            continue
        key = kernel_key(e.get("name", ""))
        for fragment, short in KERNELS:
            if fragment in key:
                durations.setdefault(short, []).append(e["dur"])
                ours.append((e["ts"], e["ts"] + e["dur"], short))
    med = {short: statistics.median(durations[short]) for _, short in KERNELS if short in durations}
    # One forward's span on the GPU, first kernel's start to last kernel's end: the calls
    # are milliseconds apart, so a gap over 1 ms starts the next call.
    spans, starts, start, end = [], {}, None, None
    for ts, te, short in sorted(ours):
        if start is not None and ts - end > 1000:
            spans.append(end - start)
            start = None
        if start is None:
            start, end = ts, te
        end = max(end, te)
        starts.setdefault(short, []).append(ts - start)
    if start is not None:
        spans.append(end - start)
    med["span"] = statistics.median(spans) if spans else 0.0
    return med, {short: statistics.median(v) for short, v in starts.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", default=["qwen2-moe-2.7b", "qwen2-57b-a14b", "mixtral-8x7b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--graph", action="store_true", help="capture the forward in a CUDA graph; time its replays")
    p.add_argument("--routing", choices=("router", "skewed"), default="router",
                   help="the block's router on random activations, or expert e drawn with weight skew^(-e/(E-1))")
    p.add_argument("--skew", type=float, default=8.0, help="skewed: the first expert's weight over the last's")
    p.add_argument("--starts", action="store_true",
                   help="also each kernel's start, us after the call's first kernel on that rank (kernel@start)")
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    comm = comet_moe.Comm.from_process_group()
    lines = []
    for preset in a.preset:
        for tokens in a.tokens:
            block, cfg = random_block(comm, preset, tokens, device)
            x = torch.randn(tokens, cfg.hidden, device=device, dtype=torch.bfloat16,
                            generator=torch.Generator(device=device).manual_seed(rank))
            if a.routing == "skewed":
                gen = torch.Generator(device=device).manual_seed(100 + rank)
                E = cfg.num_experts
                p_e = a.skew ** (-torch.arange(E, device=device, dtype=torch.float32) / max(E - 1, 1))
                ids = torch.multinomial(p_e.expand(tokens, E), cfg.top_k, replacement=False, generator=gen)
                ids = ids.to(torch.int32).contiguous()
                w = torch.rand(tokens, cfg.top_k, device=device, generator=gen) + 0.1
                w = (w / w.sum(1, keepdim=True)).contiguous()
            else:
                ids, w = mixtral_route(torch.nn.functional.linear(x, block.gate.weight), cfg.top_k)
            med, starts = kernel_medians(block, x, ids, w, a.calls, a.graph)
            route = sum(med.get(k, 0.0) for k in ROUTE)
            span = med.pop("span")
            gaps = span - sum(med.values())
            lines.append(f"{preset:15s} {tokens:6d} rank {rank}: "
                         + " ".join(f"{k} {v:.1f}" + (f"@{starts[k]:.0f}" if a.starts else "") for k, v in med.items())
                         + f" | route {route:.1f}, span {span:.1f}, between kernels {gaps:.1f} us")
            block.close()
    comm.check_async_error(synchronize=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, lines)
    if rank == 0:
        print(f"median us per kernel over {a.calls} calls{' (CUDA graph replays)' if a.graph else ''}, "
              f"{a.routing} routing{f' (skew {a.skew:g})' if a.routing == 'skewed' else ''}, {world} x "
              f"{torch.cuda.get_device_name()}, comet {comet_moe.version()}")
        for i in range(len(lines)):
            for r in range(world):
                print(gathered[r][i])
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
