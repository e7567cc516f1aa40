"""Where one comet_moe_forward's time goes, kernel by kernel, on every rank: the forward
runs under torch.profiler (CUPTI sees libcomet's kernels too), and each kernel's median
duration over the calls is printed (the grouped GEMMs as gemm#1, GEMM0, and gemm#2,
GEMM1, in launch order), with the route's kernels summed, and the forward's span on the
GPU (from the end of a marker kernel the call queues behind to its last kernel's end)
with the time between its kernels. Calls are taken one at a time (barrier, call, sync),
so each rank's exchange kernel also holds its wait for the slower rank: the rank with the
shorter exchange shows the route's own cost.

    torchrun --nproc-per-node 2 bench/trace_forward.py
    torchrun --nproc-per-node 2 bench/trace_forward.py --preset qwen2-57b-a14b --tokens 1024 8192
    torchrun --nproc-per-node 2 bench/trace_forward.py --graph    # each call a CUDA graph replay
    torchrun --nproc-per-node 2 bench/trace_forward.py --routing skewed --starts   # kernel@start
    torchrun --nproc-per-node 1 bench/trace_forward.py --fp8 --graph --tokens 16 128   # the FP8 layer

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
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before anything initialises NCCL

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import comet_moe  # noqa: E402
from comet_moe.block import mixtral_route  # noqa: E402

ROUTE = ("chunk_rank", "chunk_offset", "exchange_plan", "place_rows")


def short_name(name):
    """A kernel's function name without namespace, return type, template arguments or
    "_kernel"; the grouped GEMMs are told apart by launch order in the call (kernel_medians)."""
    name = re.sub(r"<.*", "", name.replace("(anonymous namespace)::", "").split("(")[0])
    name = name.split()[-1].split("::")[-1] if name.split() else name
    return name[:-len("_kernel")] if name.endswith("_kernel") and name != "grouped_gemm_kernel" else name


def random_block(comm, preset, tokens, device, fp8):
    cfg = comet_moe.MoeConfig.preset(preset, max_tokens=tokens, dtype="fp8" if fp8 else "bf16")
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
                # The marker: a kernel of torch's own (spin_kernel) that the call's kernels
                # queue behind, so the call starts on the GPU as soon as the marker ends.
                torch.cuda._sleep(100000)
                call()
                torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    # One call's kernels: comet's after a marker, timed from the marker's end (the next
    # barrier's kernels, NCCL's and torch's, are not the call's).
    calls_seen = []
    for ts, dur, name in sorted((e["ts"], e["dur"], e.get("name", "")) for e in events
                                if e.get("cat") in ("kernel", "gpu_memset")):
        if "spin_kernel" in name:
            calls_seen.append([(ts + dur, 0.0, "marker")])
        elif calls_seen and "nccl" not in name.lower() and "at::native" not in name:  # not the barrier's
            calls_seen[-1].append((ts, dur, short_name(name)))
    calls_seen = [c for c in calls_seen if len(c) > 1]
    # Per call, each kernel's label: its name, the grouped GEMMs numbered in launch order
    # (gemm#1 is GEMM0), a name's later launches in the call numbered too; medians per label.
    per_label, starts = {}, {}
    for c in calls_seen:
        seen = {}
        for ts, dur, name in c[1:]:
            n = seen[name] = seen.get(name, 0) + 1
            if name == "grouped_gemm_kernel":
                label = f"gemm#{n}"
            else:
                label = name if n == 1 else f"{name}#{n}"
            per_label.setdefault(label, []).append(dur)
            starts.setdefault(label, []).append(ts - c[0][0])
    order = sorted(per_label, key=lambda k: statistics.median(starts[k]))
    med = {k: statistics.median(per_label[k]) for k in order}
    starts = {k: statistics.median(starts[k]) for k in order}
    med["span"] = statistics.median(max(k[0] + k[1] for k in c) - c[0][0] for c in calls_seen)
    return med, starts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", default=["qwen2-moe-2.7b", "qwen2-57b-a14b", "mixtral-8x7b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--graph", action="store_true", help="capture the forward in a CUDA graph; time its replays")
    p.add_argument("--routing", choices=("router", "skewed"), default="router",
                   help="the block's router on random activations, or expert e drawn with weight skew^(-e/(E-1))")
    p.add_argument("--skew", type=float, default=8.0, help="skewed: the first expert's weight over the last's")
    p.add_argument("--fp8", action="store_true", help="the block-scaled FP8 layer (x quantized by the layer)")
    p.add_argument("--starts", action="store_true",
                   help="also each kernel's start, us after the call's marker on that rank (kernel@start)")
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
            block, cfg = random_block(comm, preset, tokens, device, a.fp8)
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
        print(f"{'FP8' if a.fp8 else 'bf16'} layer, median us per kernel over {a.calls} calls"
              f"{' (CUDA graph replays)' if a.graph else ''}, "
              f"{a.routing} routing{f' (skew {a.skew:g})' if a.routing == 'skewed' else ''}, {world} x "
              f"{torch.cuda.get_device_name()}, comet {comet_moe.version()}")
        for i in range(len(lines)):
            for r in range(world):
                print(gathered[r][i])
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
