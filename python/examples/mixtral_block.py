#!/usr/bin/env python3
"""mixtral_block.py - a Mixtral sparse MoE block through comet, beside the same block in
plain PyTorch, on every GPU of the launch.

    torchrun --nproc-per-node 2 python/examples/mixtral_block.py
    torchrun --nproc-per-node 8 python/examples/mixtral_block.py --preset qwen2-moe-2.7b --tokens 8192
    torchrun --nproc-per-node 2 python/examples/mixtral_block.py --tp 2   # tensor-parallel experts

Each rank builds CometSparseMoeBlock on a communicator made from the torch.distributed
process group, loads random weights given as a full Hugging Face-style state dict (every
expert; the block keeps its own rank's, or with --tp its slice of its group's), runs it on its own tokens, and compares y with a
plain-PyTorch Mixtral block that holds every expert on each GPU (bf16, no communication:
the simplest correct reference, not a fast expert-parallel one; bench/torch_peer.py is
that). Prints the time per call of both (median, slowest rank).
Needs build/libcomet.so (`make`) or $COMET_LIBRARY, and Hopper GPUs on one NVLink node.
"""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before anything initialises NCCL

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # python/, when not pip-installed
import comet_moe  # noqa: E402


def random_state_dict(E, H, Fd, device, seed):
    """A full MixtralSparseMoeBlock state dict (HF names), the same on every rank."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, fan_in):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g) / fan_in ** 0.5

    sd = {"gate.weight": rand(E, H, fan_in=H)}
    for e in range(E):
        sd[f"experts.{e}.w1.weight"] = rand(Fd, H, fan_in=H)
        sd[f"experts.{e}.w3.weight"] = rand(Fd, H, fan_in=H)
        sd[f"experts.{e}.w2.weight"] = rand(H, Fd, fan_in=Fd)
    return sd


def torch_mixtral_block(x, sd, E, top_k):
    """Hugging Face's MixtralSparseMoeBlock written out: every expert here, bf16."""
    logits = F.linear(x, sd["gate.weight"])
    probs = F.softmax(logits, dim=1, dtype=torch.float)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            h = F.silu(x[tok] @ sd[f"experts.{e}.w1.weight"].T) * (x[tok] @ sd[f"experts.{e}.w3.weight"].T)
            y.index_add_(0, tok, (h @ sd[f"experts.{e}.w2.weight"].T).float() * w[tok, slot].unsqueeze(1))
    return y.to(x.dtype)


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mixtral-8x7b", help=f"one of {', '.join(comet_moe.presets())}")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per call")
    p.add_argument("--impl", default="auto", choices=["auto", "baseline", "fused"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per expert (EP = GPUs / tp)")
    a = p.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)

    config = comet_moe.MoeConfig.preset(a.preset, max_tokens=a.tokens)
    config.tp_size = a.tp
    config.validate(world)  # CometInvalidArgumentError naming the field, e.g. experts not divisible by world
    E, H, Fd, k = config.num_experts, config.hidden, config.ffn, config.top_k
    comm = comet_moe.Comm.from_process_group()
    block = comet_moe.CometSparseMoeBlock(comm, config, impl=a.impl)
    sd = random_state_dict(E, H, Fd, device, seed=2024)
    block.load_state_dict(sd)  # keeps its EP group's experts (and with TP its ffn columns of them)

    x = torch.randn(a.tokens, H, device=device, dtype=torch.bfloat16,
                    generator=torch.Generator(device=device).manual_seed(rank))
    with torch.inference_mode():
        y, _ = block(x)
        want = torch_mixtral_block(x, sd, E, k)
        err = ((y.float() - want.float()).norm() / want.float().norm()).item()
        comet_ms = median_ms(lambda: block(x), 3, a.iters)
        torch_ms = median_ms(lambda: torch_mixtral_block(x, sd, E, k), 3, a.iters)
    comm.check_async_error(synchronize=True)
    stats = torch.tensor([comet_ms, torch_ms, err], device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank, the worst error
    comet_ms, torch_ms, err = stats.tolist()
    if rank == 0:
        print(f"{a.preset}: E={E} top-k={k} H={H} F={Fd}, {a.tokens} tokens per GPU, {world} x "
              f"{torch.cuda.get_device_name()} (EP {world // a.tp} x TP {a.tp}), comet {comet_moe.version()}, "
              f"torch {torch.__version__}")
        print(f"comet block (impl {block.impl}):           {comet_ms:8.3f} ms per call (median of {a.iters}, "
              f"slowest rank)")
        print(f"plain PyTorch, every expert on each GPU: {torch_ms:8.3f} ms per call")
        print(f"y against plain PyTorch: relative error {err:.2e} ({'ok' if err < 2e-2 else 'TOO LARGE'}, "
              f"limit 2e-2: both sides are bf16)")
    block.close()
    comm.close()
    dist.destroy_process_group()
    return 0 if err < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
