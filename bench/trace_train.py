"""Where one training step's time goes, kernel by kernel: comet's training forward and
backward (through comet_moe's autograd) run under torch.profiler, and each of the
step's kernels, in launch order, is printed with its median duration over the steps,
then the forward's and the backward's spans on the GPU (first kernel's start to last
kernel's end) and the time between their kernels. The grouped GEMMs are numbered in
launch order within each phase: the forward's GEMM0 and GEMM1 (gemm#1, gemm#2; gemm#2
and gemm#3 where the settings start with a small GEMM of the first local tiles), the
backward's dgrad W2, dgrad W13, dW2 and dW13 (gemm#1 to gemm#4). The steps run back to
back, after warm-up steps, so the GPU runs as warm as in training.

    torchrun --nproc-per-node 1 bench/trace_train.py
    torchrun --nproc-per-node 1 bench/trace_train.py --preset mixtral-8x7b --tokens 8192
    torchrun --nproc-per-node 1 bench/trace_train.py --fp8 --preset qwen2-57b-a14b
    torchrun --nproc-per-node 1 bench/trace_train.py --fp8 --impl baseline --preset mixtral-8x7b

--fp8: the block-scaled FP8 layer, trained from the same bf16 masters (its FP8 copies
made once, by the first step). --impl: comet's path, as Moe.forward takes it (auto, fused,
or baseline: the sequential step, the yardstick).

Needs build/libcomet.so. Routing: balanced (token g picks experts (g*k + j) mod E), as
comet bench does.
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


def short_name(name):
    """A kernel's function name without namespace, return type or template arguments."""
    name = re.sub(r"<.*", "", name.replace("(anonymous namespace)::", "").split("(")[0])
    return name.split()[-1].split("::")[-1] if name.split() else name


def layer(comm, preset, tokens, device, rank, fp8=False):
    cfg = comet_moe.MoeConfig.preset(preset, max_tokens=tokens, dtype="fp8" if fp8 else "bf16")
    moe = comet_moe.Moe(comm, cfg)
    E, El, H, F, k = cfg.num_experts, moe.experts_per_rank, cfg.hidden, moe.ffn_local, cfg.top_k
    g = torch.Generator(device=device).manual_seed(11 + rank)
    w13 = (torch.randn(El, 2 * F, H, device=device, generator=g) / H ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(El, H, F, device=device, generator=g) / F ** 0.5).bfloat16().requires_grad_()
    x = torch.randn(tokens, H, device=device, generator=g).bfloat16().requires_grad_()
    tok = torch.arange(tokens, device=device).unsqueeze(1) + rank * tokens
    ids = ((tok * k + torch.arange(k, device=device)) % E).to(torch.int32).contiguous()
    w = torch.softmax(torch.randn(tokens, k, device=device, generator=g), 1).requires_grad_()
    dy = torch.randn(tokens, H, device=device, generator=g).bfloat16()
    return moe, (x, ids, w, w13, w2, dy)


def trace(moe, tensors, steps, warmup, impl):
    """Kernels of `steps` training steps run back to back (after `warmup` more, so the GPU
    is as warm as in training), split by a marker kernel launched before each forward
    and each backward: {phase: ([(label, median us)], median span us)}."""
    x, ids, w, w13, w2, dy = tensors

    def step():
        torch.cuda._sleep(100)  # the marker: a kernel of torch's own (spin_kernel)
        y = moe.forward(x, ids, w, gate_up=w13, down=w2, impl=impl)
        torch.cuda._sleep(100)
        y.backward(dy)
        x.grad = w.grad = w13.grad = w2.grad = None

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            events = json.load(fh)["traceEvents"]
    return phase_medians(events)


def phase_medians(events):
    """{phase: ([(label, median us)], median span us)} from a chrome trace's events, the
    phases split at the marker kernels (spin_kernel) launched before each of them."""
    # Split by start time at the markers; within a phase, kernels in launch order (the
    # correlation id): kernels of two streams may start in either order.
    kernels = sorted((e["ts"], e["dur"], e.get("name", ""), e.get("args", {}).get("correlation", 0))
                     for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    phases, current = {"forward": [], "backward": []}, None
    for ts, dur, name, corr in kernels:
        if "spin_kernel" in name:
            current = "backward" if current == "forward" else "forward"
            phases[current].append([])
        elif current:
            phases[current][-1].append((ts, dur, name, corr))
    out = {}
    for name, per_step in phases.items():
        per_step = [sorted(s, key=lambda k: k[3]) for s in per_step if s]
        # Medians by position need the same kernels in the same order in every step.
        names = [[short_name(k[2]) for k in s] for s in per_step]
        if any(n != names[0] for n in names):
            raise RuntimeError(f"{name}: the steps ran different kernel sequences: {names[0]} / "
                               f"{next(n for n in names if n != names[0])}")
        rows, gemm = [], 0
        for i, label in enumerate(names[0]):
            if "grouped_gemm" in label:
                gemm += 1
                label = f"gemm#{gemm}"
            rows.append((label, statistics.median(s[i][1] for s in per_step)))
        spans = [max(k[0] + k[1] for k in s) - min(k[0] for k in s) for s in per_step]
        out[name] = (rows, statistics.median(spans))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", default=["mixtral-8x7b", "phi-3.5-moe", "qwen2-57b-a14b",
                                                   "qwen2-moe-2.7b", "gpt-oss-120b"])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--fp8", action="store_true", help="the block-scaled FP8 layer")
    p.add_argument("--impl", default="auto", choices=["auto", "fused", "baseline"],
                   help="comet's path (baseline: the sequential step)")
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0 or a.tokens < 1:
        p.error(f"--steps {a.steps} must be >= 1, --warmup {a.warmup} >= 0 and --tokens {a.tokens} >= 1")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    device = torch.device("cuda", local)
    comm = comet_moe.Comm.from_process_group()
    lines = []
    for preset in a.preset:
        moe, tensors = layer(comm, preset, a.tokens, device, rank, a.fp8)
        out = trace(moe, tensors, a.steps, a.warmup, a.impl)
        for phase, (rows, span) in out.items():
            busy = sum(d for _, d in rows)
            lines.append(f"{preset} {a.tokens} {a.impl} rank {rank} {phase}: "
                         + ", ".join(f"{label} {d:.0f}" for label, d in rows)
                         + f" | span {span:.0f}, kernels {busy:.0f}, between {span - busy:.0f} us")
        moe.close()
        del tensors
    comm.check_async_error(synchronize=True)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines)
    if rank == 0:
        print(f"median us per kernel over {a.steps} steps back to back, balanced routing, {torch.cuda.get_device_name()}, "
              f"comet {comet_moe.version()}")
        for i in range(len(lines)):
            for r in range(len(gathered)):
                print(gathered[r][i])
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
