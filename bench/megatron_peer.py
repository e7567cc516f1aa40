#!/usr/bin/env python3
"""Megatron-Core's MoE layer beside comet's on the preset shapes: Megatron's own MoELayer
(alltoall token dispatcher, SequentialMLP experts, SwiGLU, bf16) and comet_moe.megatron's
CometMoELayer on the same config, weights and tokens, each timed forward + backward
(y.backward(dy)) with CUDA events, in turns, medians of the slowest rank.

    torchrun --nproc-per-node N bench/megatron_peer.py [--preset all] [--tokens 8192] [--iters 10]
    torchrun --nproc-per-node N bench/megatron_peer.py --suite --json bench/suite-megatron.json

Needs megatron-core (0.19: its MoELayer builds without Transformer Engine) and
build/libcomet.so built against torch's NCCL. Expert parallel over every rank (EP = N,
TP 1); routing by Megatron's router on random tokens. --suite runs `comet bench --suite`'s
token counts (1024..16384) on every preset; --json writes one record per case (impl
"megatron-train" and "comet-megatron-train", with step_ms).
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PRESETS = {  # name: (experts, top_k, hidden, ffn), as in src/layer/config.c
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "phi-3.5-moe": (16, 2, 4096, 6400),
    "qwen2-57b-a14b": (64, 8, 3584, 2560),
    "qwen2-moe-2.7b": (64, 4, 2048, 1408),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}
SUITE_TOKENS = (1024, 2048, 4096, 8192, 16384)


def build(preset, tokens, world, comm):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    from comet_moe.megatron import CometMoELayer
    E, k, H, Fd = PRESETS[preset]
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=Fd, num_attention_heads=8,
                               num_moe_experts=E, moe_router_topk=k, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, moe_token_dispatcher_type="alltoall", bf16=True,
                               params_dtype=torch.bfloat16, expert_model_parallel_size=world,
                               moe_router_load_balancing_type="none")
    pgs = get_default_pg_collection()
    experts = lambda *a, **kw: SequentialMLP(*a, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,  # noqa
                                                                          linear_fc2=RowParallelLinear), **kw)
    theirs = MoELayer(config, MoESubmodules(router=TopKRouter, experts=experts), pg_collection=pgs).cuda()
    mine = CometMoELayer(config, max_tokens=tokens, pg_collection=pgs, comm=comm, grad_accumulation="grad")
    mine.load_state_dict(theirs.state_dict(), strict=False)
    return theirs, mine


def step(layer, x, dy):
    xg = x.detach().requires_grad_(True)
    y, _ = layer(xg)
    y.backward(dy)
    for p in layer.parameters():
        p.grad = None


def time_in_turns(layers, x, dy, iters):
    times = {name: [] for name in layers}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for name, layer in layers.items():  # warm-up
        for _ in range(3):
            step(layer, x, dy)
    for _ in range(iters):
        for name, layer in layers.items():
            dist.barrier()
            ev[0].record()
            step(layer, x, dy)
            ev[1].record()
            ev[1].synchronize()
            times[name].append(ev[0].elapsed_time(ev[1]))
    med = torch.tensor([statistics.median(times[n]) for n in layers], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's
    return dict(zip(layers, med.tolist()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="all")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--suite", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import parallel_state
    from comet_moe import Comm
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(1234)  # Megatron's weight init forks these RNG states
    comm = Comm.from_process_group()
    names = list(PRESETS) if args.preset == "all" else args.preset.split(",")
    token_counts = SUITE_TOKENS if args.suite else (args.tokens,)
    records = []
    if rank == 0:
        print(f"{'case':16} {'tokens':>6} {'megatron step ms':>17} {'comet step ms':>14} {'comet vs megatron':>18}")
    for preset in names:
        for tokens in token_counts:
            theirs, mine = build(preset, tokens, world, comm)
            H = PRESETS[preset][2]
            s = tokens // 8
            g = torch.Generator(device="cuda").manual_seed(1 + rank)
            x = torch.randn(s, 8, H, device="cuda", generator=g).to(torch.bfloat16)
            dy = torch.randn(s, 8, H, device="cuda", generator=g).to(torch.bfloat16)
            ms = time_in_turns({"megatron": theirs, "comet": mine}, x, dy, args.iters)
            if rank == 0:
                print(f"{preset:16} {tokens:6d} {ms['megatron']:17.3f} {ms['comet']:14.3f} "
                      f"{ms['megatron'] / ms['comet']:17.2f}x", flush=True)
            for impl, key in (("megatron-train", "megatron"), ("comet-megatron-train", "comet")):
                records.append({"case": preset, "impl": impl, "ranks": world, "tokens_per_rank": tokens,
                                "step_ms": ms[key], "iters": args.iters})
            mine.moe.close()
            del theirs, mine
    if rank == 0 and args.json:
        json.dump(records, open(args.json, "w"), indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
