#!/usr/bin/env python3
"""What the Python package adds to a training step: comet's MoE layer forward + backward
under torch autograd (comet_moe.Moe with the routing weights and the expert weights
requiring grad, y.backward(dy)), against the same two C calls made straight through
ctypes with no autograd (comet_moe_forward_train, comet_moe_backward), in turns, on the
preset shapes at one rank.

    torchrun --nproc-per-node 1 bench/torch_block.py [--preset all] [--tokens 8192] [--iters 20]

Prints per preset: both medians and their difference in microseconds per step.
"""
import argparse
import ctypes
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from comet_moe import Comm, Moe, MoeConfig, _capi  # noqa: E402
from comet_moe.errors import check  # noqa: E402

PRESETS = ("mixtral-8x7b", "phi-3.5-moe", "qwen2-57b-a14b", "qwen2-moe-2.7b", "gpt-oss-120b")


def raw_step(moe, x, ids, w, w13, w2, dy, out):
    """comet_moe_forward_train then comet_moe_backward, no autograd (what MoeFunction calls)."""
    lib, ptr, m = moe._lib, moe._box.ptr, x.shape[0]
    memory = torch.empty(moe._comet_saved_bytes(), dtype=torch.uint8, device=x.device)
    handle = moe._comet_saved_create_in(memory)
    try:
        _raw_calls(lib, ptr, m, handle, x, ids, w, w13, w2, dy, out)
    finally:
        moe._comet_saved_destroy(handle)


def _raw_calls(lib, ptr, m, handle, x, ids, w, w13, w2, dy, out):
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    a = _capi.MoeArgsStruct()
    a.num_tokens, a.x, a.topk_ids, a.topk_weights, a.y = m, x.data_ptr(), ids.data_ptr(), w.data_ptr(), out["y"].data_ptr()
    a.weights.gate_up, a.weights.down = w13.data_ptr(), w2.data_ptr()
    check(lib.comet_moe_forward_train(ptr, ctypes.byref(a), ctypes.c_void_p(handle), stream),
          "comet_moe_forward_train", lambda: _capi.text(lib.comet_moe_last_error(ptr)))
    b = _capi.MoeBackwardArgsStruct()
    b.saved, b.dy, b.dx, b.d_topk_weights = handle, dy.data_ptr(), out["dx"].data_ptr(), out["dw"].data_ptr()
    b.weights.gate_up, b.weights.down = w13.data_ptr(), w2.data_ptr()
    b.grads.gate_up, b.grads.down = out["g13"].data_ptr(), out["g2"].data_ptr()
    check(lib.comet_moe_backward(ptr, ctypes.byref(b), stream), "comet_moe_backward",
          lambda: _capi.text(lib.comet_moe_last_error(ptr)))


def autograd_step(moe, x, ids, w, w13, w2, dy):
    y = moe.forward(x, ids, w, gate_up=w13, down=w2)
    y.backward(dy)
    w13.grad = w2.grad = w.grad = None


def timed(fn, iters):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="all")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    comm = Comm.from_process_group()
    names = PRESETS if args.preset == "all" else args.preset.split(",")
    print(f"{'case':16} {'tokens':>6} {'C calls ms':>11} {'autograd ms':>12} {'added us':>9}")
    for name in names:
        cfg = MoeConfig.preset(name, max_tokens=args.tokens)
        moe = Moe(comm, cfg)
        H, Fl, E, k, m = int(cfg.hidden), moe.ffn_local, moe.experts_per_rank, int(cfg.top_k), args.tokens
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
        ids = (torch.arange(m * k, device="cuda") % int(cfg.num_experts)).view(m, k).to(torch.int32)  # balanced
        w = torch.full((m, k), 1.0 / k, device="cuda").requires_grad_(True)
        w13 = (torch.randn(E, 2 * Fl, H, device="cuda", generator=g) / H ** 0.5).to(torch.bfloat16).requires_grad_(True)
        w2 = (torch.randn(E, H, Fl, device="cuda", generator=g) / Fl ** 0.5).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
        out = {"y": torch.empty(m, H, dtype=torch.bfloat16, device="cuda"), "dx": torch.empty_like(x),
               "dw": torch.empty(m, k, device="cuda"), "g13": torch.empty_like(w13), "g2": torch.empty_like(w2)}
        raw = lambda: raw_step(moe, x, ids, w.detach(), w13.detach(), w2.detach(), dy, out)  # noqa: E731
        auto = lambda: autograd_step(moe, x, ids, w, w13, w2, dy)  # noqa: E731
        for _ in range(3):
            raw(), auto()
        t = {"raw": [], "auto": []}
        for _ in range(args.iters):  # in turns: clocks drift on both alike
            t["raw"].append(timed(raw, 1))
            t["auto"].append(timed(auto, 1))
        r, a = statistics.median(t["raw"]), statistics.median(t["auto"])
        print(f"{name:16} {m:6d} {r:11.3f} {a:12.3f} {(a - r) * 1e3:9.0f}", flush=True)
        moe.close()
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
