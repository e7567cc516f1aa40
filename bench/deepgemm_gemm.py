"""DeepGEMM's SM90 FP8 grouped GEMM on the forward shapes `comet gemm --fp8` prints, so ours can
be compared with the strongest public FP8 kernel on the same GPU. DeepGEMM is not part of
comet: build it beside comet from its own repository (github.com/deepseek-ai/DeepGEMM, with
its third-party cutlass and fmt), then point --deepgemm at that checkout.

    python3 bench/deepgemm_gemm.py --deepgemm ../DeepGEMM [--tokens 8192] [--preset NAME,...]

The GEMM is deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous (its "1D2D" kernel on Hopper: E4M3,
FP32 scales per 1 x 128 of a row and per 128 x 128 of a weight, as comet's; bf16 out), rows
grouped by expert, each expert's rows as balanced routing of --tokens tokens on one GPU gives
(a multiple of 128, as its contiguous layout asks). GEMM0 is x W13^T alone (comet's GEMM0 also
runs the SwiGLU and quantizes the activation), GEMM1 act W2^T. Operands are random bf16,
quantized by DeepGEMM's own test helpers; each output is checked against the bf16 product
with DeepGEMM's measure 1 - 2 sum(xy) / sum(x^2 + y^2) (its tests' bound: 1e-3), after the
output is poisoned with NaN. TFLOP/s = 2 rows n k / the median of 20 CUDA-event intervals
after 3 warm-ups; DeepGEMM picks its own tile and cluster per shape (its JIT compiles each
on first use, before the timing).

--wgrad times its k-grouped weight-gradient GEMM instead (deep_gemm.k_grouped_fp8_gemm_nt_contiguous,
its "1D1D" kernel: both operands E4M3 with FP32 scales per 128 tokens of each row, K-major, the
groups along K; FP32 out, added to C): dW2 (m = hidden, n = ffn) and dW13 (m = 2 ffn, n =
hidden), each expert's K its rows, beside `comet gemm --fp8`'s weight-gradient table (ours
writes bf16 there; its FP32-adding variant is what the layer runs into main_grad).
Building DeepGEMM's extension where the default C++ compiler links its own libstdc++
statically (a toolchain under /opt, say): build it with the system compiler (CXX=/usr/bin/g++),
or the process holds two libstdc++ and the first GEMM segfaults in its host code (std::regex,
an ostream of an integer).
"""
import argparse
import os
import sys

import torch

from torch_gemm import PRESETS, median_ms  # the presets' shapes, the timing torch's GEMMs get


def measure(x, y):
    """DeepGEMM's accuracy measure: 0 for equal tensors, 1e-3 its tests' bound."""
    x, y = x.double(), y.double()
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def row(name, experts, rows, dims, tflops, diff):
    """One line of the table; returns whether the output was wrong (measure not under 1e-3)."""
    wrong = not diff < 1e-3
    print(f"{name:24s} {experts:6d} {rows:6d} {dims[0]:6d} {dims[1]:6d} {tflops:8.0f} {diff:9.1e}"
          f"{'  WRONG' if wrong else ''}", flush=True)
    return wrong


def forward_rows(deep_gemm, gen, name, experts, rows, hidden, ffn, iters):
    """GEMM0 (x W13^T) and GEMM1 (act W2^T) on contiguous expert rows; whether one was wrong."""
    bad = False
    for which, (n, k) in (("GEMM0", (2 * ffn, hidden)), ("GEMM1", (hidden, ffn))):
        m = experts * rows
        a = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
        b = torch.randn((experts, n, k), device="cuda", dtype=torch.bfloat16)
        layout = torch.arange(experts, device="cuda", dtype=torch.int32).repeat_interleave(rows)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        a8 = gen.cast_fp8_fp4_with_major(a, gen.MajorTypeAB.KMajor, 128, False, False)
        b8 = gen.grouped_cast_fp8_fp4_with_major(b, gen.MajorTypeAB.KMajor, 128, False, False,
                                                 use_block_cast_for_fp8=True)

        def run():
            deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous(a8, b8, d, layout, disable_ue8m0_cast=True,
                                                           ensure_zero_padding=False)
        run()
        torch.cuda.synchronize()
        ref = torch.cat([a[g * rows:(g + 1) * rows] @ b[g].t() for g in range(experts)])
        tflops = 2 * m * n * k / (median_ms(run, iters) * 1e-3) / 1e12
        bad |= row(f"{name} {which}", experts, rows, (n, k), tflops, measure(d, ref))
    return bad


def wgrad_rows(deep_gemm, gen, name, experts, rows, hidden, ffn, iters):
    """dW2 (m = hidden, n = ffn) and dW13 (m = 2 ffn, n = hidden), each expert's K its rows;
    whether one was wrong."""
    bad = False
    for which, (m, n) in (("dW2", (hidden, ffn)), ("dW13", (2 * ffn, hidden))):
        ks = [rows] * experts
        _, a8, b8, c, d, ref, layout, _ = gen.generate_k_grouped_contiguous(
            experts, m, n, gen.MajorTypeAB.KMajor, gen.MajorTypeAB.KMajor, ks)
        ref -= c  # its reference adds C; d is C, and each call adds the product to it
        d.zero_()

        def run():
            deep_gemm.k_grouped_fp8_gemm_nt_contiguous(a8, b8, d, ks, layout, d, recipe=(1, 1, 128))
        run()
        torch.cuda.synchronize()
        diff = measure(d, ref)
        tflops = 2 * m * n * rows * experts / (median_ms(run, iters) * 1e-3) / 1e12
        bad |= row(f"{name} {which}", experts, rows, (m, n), tflops, diff)
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepgemm", required=True, help="DeepGEMM's checkout, its extension built")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--preset", default="all", help="names separated by commas, or all")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--wgrad", action="store_true", help="the weight gradients' k-grouped GEMM instead")
    args = ap.parse_args()
    names = list(PRESETS) if args.preset == "all" else args.preset.split(",")
    for name in names:
        if name not in PRESETS:
            sys.exit(f"--preset {name}: not one of {', '.join(PRESETS)}")
    root = os.path.abspath(args.deepgemm)
    sys.path[:0] = [root, os.path.join(root, "tests")]
    import deep_gemm
    import generators as gen  # DeepGEMM's test helpers: its own quantization and k-grouped inputs

    align = deep_gemm.get_theoretical_mk_alignment_for_contiguous_layout()
    deep_gemm.set_mk_alignment_for_contiguous_layout(align)
    print(f"{torch.cuda.get_device_name()}, DeepGEMM {deep_gemm.__version__}, {deep_gemm.get_num_sms()} SMs; "
          f"{args.tokens} tokens, balanced, rows per expert rounded up to {align}")
    dims = ("m", "n") if args.wgrad else ("n", "k")
    print(f"{'shape':24s} {'groups':>6s} {'rows':>6s} {dims[0]:>6s} {dims[1]:>6s} {'TFLOP/s':>8s} {'vs bf16':>9s}")
    torch.manual_seed(0)
    table = wgrad_rows if args.wgrad else forward_rows
    bad = False
    for name in names:
        experts, top_k, hidden, ffn = PRESETS[name]
        rows = (args.tokens * top_k // experts + align - 1) // align * align
        bad |= table(deep_gemm, gen, name, experts, rows, hidden, ffn, args.iters)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
