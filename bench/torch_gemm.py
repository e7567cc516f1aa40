"""The backward's grouped GEMMs the PyTorch way (torch._grouped_mm, bf16), on the shapes
`comet gemm` prints in its dgrad and weight-gradient tables, so ours can be compared with
torch's on the same GPU: the rows balanced routing of --tokens tokens per GPU over --ep ranks
gives each of a rank's E / ep experts (--ep 1: the rows one GPU trains on).

    python3 bench/torch_gemm.py [--tokens 8192] [--ep 2] [--iters 20]

dgrad:  s = dy W2 (dy [rows][H], W2 [E][H][F]) and dx = dh W13 (dh [rows][2F], W13 [E][2F][H]),
        offsets along the rows;
wgrad:  dW2 = dy^T act and dW13 = dh^T x, offsets along K (each expert's rows), the form
        autograd uses for a grouped GEMM's weight gradient.
TFLOP/s = 2 m n k / the median time of --iters calls after 3 warm-ups.
"""
import argparse

import torch

PRESETS = {  # name: (experts, top_k, hidden, ffn), as in src/layer/config.c
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "phi-3.5-moe": (16, 2, 4096, 6400),
    "qwen2-57b-a14b": (64, 8, 3584, 2560),
    "qwen2-moe-2.7b": (64, 4, 2048, 1408),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}


def median_ms(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ep", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: torch._grouped_mm, TFLOP/s")
    print(f"{'shape':28s} {'groups':>6s} {'rows':>6s} {'m':>6s} {'n':>6s} {'k':>6s} {'TFLOP/s':>8s}")
    for name, (E, k, H, F) in PRESETS.items():
        groups, rows = E // args.ep, args.tokens * k * args.ep // E
        offs = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * rows
        total = groups * rows
        dy = torch.randn(total, H, device=dev, dtype=bf)
        act = torch.randn(total, F, device=dev, dtype=bf)
        dh = torch.randn(total, 2 * F, device=dev, dtype=bf)
        x = torch.randn(total, H, device=dev, dtype=bf)
        w2 = torch.randn(groups, H, F, device=dev, dtype=bf) / H ** 0.5
        w13 = torch.randn(groups, 2 * F, H, device=dev, dtype=bf) / (2 * F) ** 0.5
        cases = [
            ("dgrad W2", lambda: torch._grouped_mm(dy, w2, offs=offs), total, F, H),
            ("dgrad W13", lambda: torch._grouped_mm(dh, w13, offs=offs), total, H, 2 * F),
            ("dW2", lambda: torch._grouped_mm(dy.t(), act, offs=offs), H * groups, F, rows),
            ("dW13", lambda: torch._grouped_mm(dh.t(), x, offs=offs), 2 * F * groups, H, rows),
        ]
        for what, fn, m, n, kk in cases:
            try:
                ms = median_ms(fn, args.iters)
                tf = 2.0 * m * n * kk / (ms * 1e-3) / 1e12
                print(f"{name + ' ' + what:28s} {groups:6d} {rows:6d} {m // (groups if what.startswith('dW') else 1):6d} "
                      f"{n:6d} {kk:6d} {tf:8.0f}")
            except (RuntimeError, TypeError) as e:
                print(f"{name + ' ' + what:28s} not run: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
