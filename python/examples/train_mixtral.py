#!/usr/bin/env python3
"""Train a small Mixtral-style decoder with comet's MoE block, beside the same model with
comet's experts in block-scaled FP8 (bf16 master weights, E4M3 GEMMs: DeepSeek-V3's
recipe) and with a plain-PyTorch MoE block (torch._grouped_mm under autograd): same
initial weights, same deterministic synthetic data, same optimizer. Prints the loss
curves and tokens per second, writes them as JSON, and as a PNG where matplotlib is
installed.

    torchrun --nproc-per-node 1 python/examples/train_mixtral.py [--steps 300] [--json F] [--png F]
    python3 python/examples/train_mixtral.py --plot F.json --png F.png     # the PNG from the JSON

The data: sequences from a fixed random Markov chain over the vocabulary (each token has
a few likely successors), so the loss falls from ln(vocab) towards the chain's entropy.
At one rank the three models train; with more ranks comet's two train alone (expert
parallel: each rank holds num_experts / world experts; the other parameters' gradients
are averaged over the ranks, the experts' are not, as Megatron-LM reduces them over the
expert-data-parallel group, here of one rank).
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def plot(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in results["runs"].items():
        label = f"{name} ({run['tokens_per_s'] / 1e3:.0f}k tokens/s)"
        ax.plot(range(1, len(run["loss"]) + 1), run["loss"], label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    title = results["title"]
    cut = title.find(", ", len(title) // 2)  # two lines
    ax.set_title(title if cut < 0 else title[:cut + 1] + "\n" + title[cut + 2:], fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def build(torch, args, comm, moe_kind):
    import torch.nn as nn
    import torch.nn.functional as F
    from comet_moe import CometSparseMoeBlock, Moe, MoeConfig, mixtral_route

    class TorchMoe(nn.Module):
        """The same block in plain PyTorch: rows sorted by expert, torch._grouped_mm."""

        def __init__(self):
            super().__init__()
            H, Fd, E = args.hidden, args.ffn, args.experts
            self.gate = nn.Linear(H, E, bias=False, dtype=torch.bfloat16)
            self.w13 = nn.Parameter(torch.empty(E, 2 * Fd, H, dtype=torch.bfloat16))
            self.w2 = nn.Parameter(torch.empty(E, H, Fd, dtype=torch.bfloat16))

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            logits = self.gate(x)
            ids, w = mixtral_route(logits, args.top_k)
            flat = ids.flatten().long()
            order = flat.argsort(stable=True)
            offs = torch.bincount(flat, minlength=args.experts).cumsum(0).to(torch.int32)
            rows = x[order // args.top_k]
            h = torch._grouped_mm(rows, self.w13.transpose(-2, -1), offs=offs)
            g, u = h.chunk(2, dim=-1)
            o = torch._grouped_mm(F.silu(g) * u, self.w2.transpose(-2, -1), offs=offs)
            o = o * w.flatten()[order].unsqueeze(1).to(o.dtype)
            y = torch.zeros_like(x).index_add(0, order // args.top_k, o)
            return y.view(shape), logits

    class CometFp8Moe(nn.Module):
        """Mixtral's block with comet's experts in FP8: the bf16 w13 and w2 are the trained
        parameters, comet makes their FP8 copies when they change (Moe.forward)."""

        def __init__(self, moe):
            super().__init__()
            H, E = args.hidden, moe.experts_per_rank
            self.moe = moe
            self.gate = nn.Linear(H, args.experts, bias=False, dtype=torch.bfloat16)
            self.w13 = nn.Parameter(torch.empty(E, 2 * args.ffn, H, dtype=torch.bfloat16))
            self.w2 = nn.Parameter(torch.empty(E, H, args.ffn, dtype=torch.bfloat16))

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            logits = self.gate(x)
            ids, w = mixtral_route(logits, args.top_k)
            return self.moe(x, ids, w, gate_up=self.w13, down=self.w2).view(shape), logits

    class Layer(nn.Module):
        def __init__(self, moe):
            super().__init__()
            H = args.hidden
            self.norm1 = nn.RMSNorm(H, dtype=torch.bfloat16)
            self.qkv = nn.Linear(H, 3 * H, bias=False, dtype=torch.bfloat16)
            self.proj = nn.Linear(H, H, bias=False, dtype=torch.bfloat16)
            self.norm2 = nn.RMSNorm(H, dtype=torch.bfloat16)
            self.moe = moe

        def forward(self, x):
            b, s, H = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, args.heads, H // args.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, H))
            y, _ = self.moe(self.norm2(x).contiguous())
            return x + y

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = MoeConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts, top_k=args.top_k,
                            max_tokens=args.batch * args.seq)
            if moe_kind == "comet-fp8":  # one handle for the model's layers of this shape
                fp8 = Moe(comm, MoeConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts,
                                          top_k=args.top_k, max_tokens=args.batch * args.seq, dtype="fp8"))
                make = lambda: CometFp8Moe(fp8)  # noqa: E731
            else:
                make = (lambda: CometSparseMoeBlock(comm, cfg)) if moe_kind == "comet" else TorchMoe
            self.embed = nn.Embedding(args.vocab, args.hidden, dtype=torch.bfloat16)
            self.layers = nn.ModuleList(Layer(make()) for _ in range(args.layers))
            self.norm = nn.RMSNorm(args.hidden, dtype=torch.bfloat16)
            self.head = nn.Linear(args.hidden, args.vocab, bias=False, dtype=torch.bfloat16)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x)).float()

    with torch.device("cuda"):
        return Model()


def init_weights(torch, model, args, rank, world):
    """The same values in both models: every parameter from one seed; expert weights of
    all experts drawn, each rank keeping its own (its experts' rows of w13 and w2)."""
    g = torch.Generator().manual_seed(1234)
    per = args.experts // world
    for name, p in model.named_parameters():
        if name.endswith(("w13", "w2")):
            fan_in = args.hidden if name.endswith("w13") else args.ffn
            full = torch.randn((args.experts,) + tuple(p.shape[1:]), generator=g) / math.sqrt(fan_in)
            if p.shape[0] != args.experts:
                full = full[rank * per:(rank + 1) * per]
            p.data.copy_(full.to(p.dtype))
        elif "norm" in name:
            p.data.fill_(1)
        else:
            p.data.copy_((torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])).to(p.dtype))


def markov_batches(torch, args, rank):
    """Token batches [steps, batch, seq + 1] from a fixed random chain, made once and fed to
    both models; each rank its own sequences."""
    g = torch.Generator().manual_seed(7)
    succ = torch.randint(0, args.vocab, (args.vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.12, 0.08])
    gen = torch.Generator().manual_seed(100 + rank)
    n = args.steps * args.batch
    seq = torch.empty(n, args.seq + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, args.vocab, (n,), generator=gen)
    picks = torch.multinomial(probs, n * args.seq, replacement=True, generator=gen).view(n, args.seq)
    for t in range(args.seq):
        seq[:, t + 1] = succ[seq[:, t], picks[:, t]]
    return seq.view(args.steps, args.batch, args.seq + 1).cuda()


def train(torch, dist, args, comm, moe_kind, rank, world, batches):
    model = build(torch, args, comm, moe_kind)
    init_weights(torch, model, args, rank, world)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    shared = [p for n, p in model.named_parameters() if not n.endswith(("w13", "w2"))]
    losses, times = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step, seq in enumerate(batches):
        start.record()
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.view(-1, args.vocab), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:  # data parallel for all but the experts (each rank its own)
            for p in shared:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        value = loss.detach()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
        if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"{moe_kind:>9} step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    for layer in model.layers:
        if hasattr(layer.moe, "close"):
            layer.moe.close()
        elif hasattr(layer.moe, "moe"):  # the FP8 layers' shared handle (closing twice is a no-op)
            layer.moe.moe.close()
    timed = sorted(times[10:]) if len(times) > 20 else sorted(times)
    ms = timed[len(timed) // 2]
    return {"loss": losses, "step_ms": ms, "tokens_per_s": args.batch * args.seq * world / (ms * 1e-3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", help="write both runs' losses and speeds here")
    ap.add_argument("--png", help="plot the loss curves here (needs matplotlib)")
    ap.add_argument("--plot", metavar="JSON", help="only plot a --json file into --png")
    args = ap.parse_args()
    if args.plot:
        if not args.png:
            ap.error("--plot needs --png")
        plot(json.load(open(args.plot)), args.png)
        return 0
    import torch
    import torch.distributed as dist
    from comet_moe import Comm
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm.from_process_group()
    results = {"title": f"{args.layers}-layer Mixtral-style decoder, H={args.hidden}, F={args.ffn}, "
                        f"{args.experts} experts top-{args.top_k}, {args.batch}x{args.seq} tokens per rank, "
                        f"{world} x {torch.cuda.get_device_name()}", "runs": {}}
    kinds = ("comet", "comet-fp8", "torch") if world == 1 else ("comet", "comet-fp8")
    batches = markov_batches(torch, args, rank)
    for kind in kinds:
        results["runs"][kind] = train(torch, dist, args, comm, kind, rank, world, batches)
    comm.close()
    if rank == 0:
        for kind, run in results["runs"].items():
            print(f"{kind:>9}: final loss {run['loss'][-1]:.4f}, {run['step_ms']:.2f} ms per step, "
                  f"{run['tokens_per_s']:.0f} tokens/s")
        a, b = results["runs"]["comet"]["loss"], results["runs"]["comet-fp8"]["loss"]
        tail = range(len(a) - 50, len(a)) if len(a) > 50 else range(len(a))
        mean_a, mean_b = sum(a[i] for i in tail) / len(tail), sum(b[i] for i in tail) / len(tail)
        results["fp8_last_steps"] = {"steps": len(tail), "bf16_mean": mean_a, "fp8_mean": mean_b,
                                     "relative_gap": (mean_b - mean_a) / mean_a}
        print(f"last {len(tail)} steps: mean loss FP8 {mean_b:.4f} against bf16 {mean_a:.4f} "
              f"({100 * (mean_b - mean_a) / mean_a:+.2f}%)")
        if "torch" in results["runs"]:
            a, b = results["runs"]["comet"]["loss"], results["runs"]["torch"]["loss"]
            tail = range(len(a) - 50, len(a)) if len(a) > 50 else range(len(a))
            gap = max(abs(a[i] - b[i]) for i in tail)
            mean_a, mean_b = sum(a[i] for i in tail) / len(tail), sum(b[i] for i in tail) / len(tail)
            results["last_steps"] = {"steps": len(tail), "comet_mean": mean_a, "torch_mean": mean_b,
                                     "max_abs_gap": gap}
            print(f"last {len(tail)} steps: mean loss comet {mean_a:.4f}, torch {mean_b:.4f}, largest gap {gap:.4f}; "
                  f"comet {results['runs']['torch']['step_ms'] / results['runs']['comet']['step_ms']:.2f}x "
                  f"torch's step")
        if args.json:
            json.dump(results, open(args.json, "w"), indent=1)
            print(f"wrote {args.json}")
        if args.png:
            try:
                plot(results, args.png)
            except ImportError:
                print("matplotlib is not installed: no PNG (plot later with --plot)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
