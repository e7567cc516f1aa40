"""The backward's grouped GEMMs the PyTorch way (torch._grouped_mm, bf16), on the shapes
`comet gemm` prints in its dgrad and weight-gradient tables, so ours can be compared with
torch's on the same GPU: the rows balanced routing of --tokens tokens per GPU over --ep ranks
gives each of a rank's E / ep experts (--ep 1: the rows one GPU trains on).

    python3 bench/torch_gemm.py [--tokens 8192] [--ep 2] [--iters 20] [--fp8]

dgrad:  s = dy W2 (dy [rows][H], W2 [E][H][F]) and dx = dh W13 (dh [rows][2F], W13 [E][2F][H]),
        offsets along the rows;
wgrad:  dW2 = dy^T act and dW13 = dh^T x, offsets along K (each expert's rows), the form
        autograd uses for a grouped GEMM's weight gradient.
TFLOP/s = 2 m n k / the median time of --iters calls after 3 warm-ups.

--fp8 adds a table of the forward's grouped GEMMs, GEMM0 x W13^T (n = 2F, k = H) and GEMM1
act W2^T (n = H, k = F), in bf16 (torch._grouped_mm) and in FP8 (torch._scaled_grouped_mm
with rowwise scales, what PyTorch offers on Hopper: A E4M3 [rows][K] row-major with one FP32
scale per row, 1-D [rows]; B E4M3 [E][N][K] passed transposed, so column-major [E][K][N],
with one FP32 scale per output column, [E][N]; offs int32 group ends; out bf16). "fp8" is
the GEMM alone on rows already quantized; "fp8+quant" adds the rows' quantization done the
PyTorch way (torchao's float8 rowwise recipe: amax over each row, scale 448 / amax, saturate,
.to(torch.float8_e4m3fn)); the weights are quantized once, outside the timing. Rows per
group are rounded up to a multiple of 16: the forward's kernel asserts 16-byte alignment
only along K and N (K % 16 for E4M3, N % 8 for the bf16 output), but older torch asserted
each group's rows % 16 and torchao pads its token groups to 16 for FP8, so the table is
valid on either (balanced routing gives multiples of 16 on every preset at 8192 tokens).
"""
import argparse

import torch

from torch_peer import quant_rows  # the rowwise quantization the PyTorch FP8 layer runs

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


def forward_fp8(args, dev, bf):
    """The forward's two grouped GEMMs per preset: bf16, FP8 alone, FP8 with the rows'
    quantization."""
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}: the forward's grouped GEMMs, "
          f"torch._grouped_mm (bf16) and torch._scaled_grouped_mm (FP8 rowwise), TFLOP/s")
    print(f"{'shape':28s} {'groups':>6s} {'rows':>6s} {'m':>6s} {'n':>6s} {'k':>6s} {'bf16':>8s} {'fp8':>8s} "
          f"{'fp8+quant':>9s}")
    sgmm = torch._scaled_grouped_mm
    for name, (E, k, H, F) in PRESETS.items():
        groups = E // args.ep
        rows = (args.tokens * k * args.ep // E + 15) // 16 * 16
        offs = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * rows
        total = groups * rows
        x = torch.randn(total, H, device=dev, dtype=bf)
        act = torch.randn(total, F, device=dev, dtype=bf)
        w13 = torch.randn(groups, 2 * F, H, device=dev, dtype=bf) / H ** 0.5  # nn.Linear's [out][in]
        w2 = torch.randn(groups, H, F, device=dev, dtype=bf) / F ** 0.5
        for what, a, w in (("GEMM0 x W13^T", x, w13), ("GEMM1 act W2^T", act, w2)):
            n, kk = w.shape[1], w.shape[2]
            wq, ws = quant_rows(w)  # [G][N][K] E4M3, [G][N] per output column
            aq, a_scale = quant_rows(a)

            def quantized():  # the rows' quantization, then the GEMM
                q, q_scale = quant_rows(a)
                return sgmm(q, wq.transpose(-2, -1), q_scale, ws, offs=offs, out_dtype=bf)

            cases = [lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs),
                     lambda: sgmm(aq, wq.transpose(-2, -1), a_scale, ws, offs=offs, out_dtype=bf),
                     quantized]
            tf = []
            for fn in cases:
                try:
                    tf.append(f"{2.0 * total * n * kk / (median_ms(fn, args.iters) * 1e-3) / 1e12:8.0f}")
                except (RuntimeError, TypeError) as e:
                    tf.append(f"{'-':>8s}")
                    print(f"{name + ' ' + what:28s} not run: {type(e).__name__}: {str(e)[:120]}")
            print(f"{name + ' ' + what:28s} {groups:6d} {rows:6d} {total:6d} {n:6d} {kk:6d} {tf[0]} {tf[1]} "
                  f"{tf[2]:>9s}")
        del x, act, w13, w2
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--fp8", action="store_true", help="also the forward's GEMMs, bf16 and FP8 rowwise")
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
    if args.fp8:
        forward_fp8(args, dev, bf)


if __name__ == "__main__":
    main()
