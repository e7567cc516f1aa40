"""test_fp8_cpu.py - block-scaled FP8 in the comet_moe package, on the CPU (torch's CPU build
is enough; every test skips, saying so, without torch): the tests' own quantizer
(fp8_reference.py, which gpu_fp8.py holds comet's kernels to byte for byte) and
dequantize_fp8 on values worked out by hand; the quantizers' argument checks, made
before comet is called.
"""
from __future__ import annotations

import fp8_reference as ref
from helpers import check, check_eq, need_torch, raises

# E4M3 bytes and their values (sign, 4 exponent bits with bias 7, 3 mantissa bits).
E4M3 = {0x00: 0.0, 0x80: -0.0, 0x01: 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0, 0x39: 1.125, 0x3A: 1.25, 0x40: 2.0,
        0xB8: -1.0, 0x7E: 448.0, 0xFE: -448.0}


def fp8_bytes(torch, t):
    return t.view(torch.uint8)


def from_bytes(torch, values, shape):
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e4m3fn).view(shape)


# ---- the tests' quantizer, by hand ----

def test_reference_quantizer_on_known_values():
    torch = need_torch()
    w = torch.zeros(130, 144)  # blocks [2, 2]: rows 128..129 and columns 128..143 are partial blocks
    w[0, 0] = 448.0            # block (0, 0): amax 448, scale 1
    w[0, 1], w[0, 2], w[0, 3] = 1.0625, 1.1875, -0.0  # ties: to the even mantissa (1.0, 1.25)
    w[1, 0], w[1, 1], w[1, 2] = 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10  # E4M3 subnormals: 1 step, a tie to 0, to 2
    w[0, 130] = -896.0         # block (0, 1): amax 896 over its 16 columns alone, scale 2
    w[1, 130] = 3.0            # 3 / 2 = 1.5, exact
    w[129, 5] = 1e-40          # block (1, 0): amax under 448 x 2^-126, scale 2^-126
    # block (1, 1) stays zero: scale 1
    q, s = ref.quantize_weights(torch, w.to(torch.bfloat16))
    check_eq((q.dtype, tuple(q.shape), s.dtype, tuple(s.shape)),
             (torch.float8_e4m3fn, (130, 144), torch.float32, (2, 2)), "dtypes and shapes")
    check_eq(s.tolist(), [[1.0, 2.0], [2.0 ** -126, 1.0]], "scales")
    b = fp8_bytes(torch, q)
    check_eq([int(v) for v in b[0, :4]], [0x7E, 0x38, 0x3A, 0x80], "448, ties to even, -0")
    check_eq([int(v) for v in b[1, :3]], [0x01, 0x00, 0x02], "subnormals")
    check_eq([int(b[0, 130]), int(b[1, 130])], [0xFE, 0x3C], "-896 / 2 = -448, 3 / 2 = 1.5")
    # bf16 rounds 1e-40 to its nearest; the scale 2^-126 brings it back over 2^-9, where E4M3 resolves it.
    x = float(torch.tensor(1e-40).to(torch.bfloat16).float()) * 2.0 ** 126
    check_eq(float(q[129, 5].float()), float(torch.tensor(x).to(torch.float8_e4m3fn).float()), "a tiny block")
    # Powers of two: the scale rounds up to one; an exact one stays.
    p = torch.zeros(2, 256)
    p[0, 0], p[1, 0], p[1, 128] = 500.0, 224.0, 448.0
    _, s2 = ref.quantize_rows(torch, p.to(torch.bfloat16), pow2=True)
    check_eq(s2.tolist(), [[2.0, 1.0], [0.5, 1.0]], "pow2 row scales: 500 / 448 -> 2, 224 / 448 = 0.5 exactly")
    _, s1 = ref.quantize_rows(torch, p.to(torch.bfloat16))
    f32_quotient = float(torch.tensor(500.0) / torch.tensor(448.0))  # the float32 division
    check_eq(s1.tolist(), [[f32_quotient, 1.0], [0.5, 1.0]], "row scales amax / 448")
    # A NaN poisons its block: scale NaN, every byte NaN (torch keeps a NaN's sign; comet writes 0x7F).
    n = torch.ones(1, 32)
    n[0, 3] = float("nan")
    qn, sn = ref.quantize_rows(torch, n.to(torch.bfloat16))
    check(bool(torch.isnan(sn).all()) and all(int(v) & 0x7F == 0x7F for v in fp8_bytes(torch, qn)[0]), "NaN block")


def test_dequantize_fp8_on_known_values():
    torch = need_torch()
    from comet_moe import dequantize_fp8
    codes = list(E4M3)
    # A weight [130, 260]: blocks [2, 3]; each element by its own block's scale.
    q = from_bytes(torch, [codes[i % len(codes)] for i in range(130 * 260)], (130, 260))
    scales = torch.tensor([[1.0, 2.0, 0.5], [4.0, 0.25, 8.0]])
    got = dequantize_fp8(q, scales)
    check_eq((got.dtype, tuple(got.shape)), (torch.float32, (130, 260)), "float32 of q's shape")
    for r, c in ((0, 0), (0, 127), (127, 128), (5, 259), (128, 0), (129, 130), (129, 259), (64, 200)):
        want = E4M3[codes[(r * 260 + c) % len(codes)]] * float(scales[r // 128, c // 128])
        check_eq(float(got[r, c]), want, f"element [{r}, {c}]")
    # Stacked: [2, 130, 260] with [2, 2, 3] scales; and token rows: [130, 260] with [130, 3].
    both = dequantize_fp8(torch.stack([q, q]), torch.stack([scales, 2 * scales]))
    check(torch.equal(both[0], got) and torch.equal(both[1], 2 * got), "a stack of matrices")
    row_scales = torch.arange(1, 131, dtype=torch.float32)[:, None].expand(130, 3).contiguous()
    row_scales[:, 2] = 0.5
    rows = dequantize_fp8(q, row_scales)
    check_eq((float(rows[7, 3]), float(rows[7, 259])),
             (E4M3[codes[(7 * 260 + 3) % len(codes)]] * 8.0, E4M3[codes[(7 * 260 + 259) % len(codes)]] * 0.5),
             "token rows' scales, one per row per 128 columns")
    check_eq(dequantize_fp8(q, scales, dtype=torch.bfloat16).dtype, torch.bfloat16, "dtype=")
    check_eq(tuple(dequantize_fp8(q[0], row_scales[0]).shape), (260,), "one row")
    # What it refuses, naming the argument and the shapes it takes.
    raises(ValueError, lambda: dequantize_fp8(q, scales[:, :2]), "scales.shape = (2, 2) for q.shape = (130, 260)",
           "(130, 3) (token rows)", "(2, 3) (a weight's blocks)")
    raises(TypeError, lambda: dequantize_fp8(q.float(), scales), "q.dtype = torch.float32", "float8_e4m3fn")
    raises(TypeError, lambda: dequantize_fp8(q, scales.double()), "scales.dtype = torch.float64")
    raises(TypeError, lambda: dequantize_fp8([1], scales), "q: expected a torch.Tensor, got list")


def test_dequantize_fp8_undoes_the_reference_quantizer():
    """Within comet.h's bound: |q s - x| <= |x| / 16 + s / 1024, every element."""
    torch = need_torch()
    from comet_moe import dequantize_fp8
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3, 200, 272, generator=g) * torch.logspace(-3, 3, 272)).to(torch.bfloat16)
    for pow2 in (False, True):
        q, s = ref.quantize_weights(torch, w, pow2)
        back = dequantize_fp8(q, s)
        x = w.float()
        bound = x.abs() / 16 + dequantize_fp8(torch.ones_like(q, dtype=torch.float32).to(torch.float8_e4m3fn), s) / 1024
        check(bool(((back - x).abs() <= bound).all()), f"pow2 {pow2}: an element past the bound")


# ---- the quantizers' argument checks (all made before comet is called) ----

def test_quantizers_refuse_before_calling_comet():
    torch = need_torch()
    from comet_moe import quantize_fp8_rows, quantize_fp8_weights
    bf16 = torch.bfloat16
    w = torch.zeros(2, 64, 128, dtype=bf16)
    call = "quantize_fp8_weights"
    raises(TypeError, lambda: quantize_fp8_weights([1]), f"{call}: w: expected a torch.Tensor")
    raises(TypeError, lambda: quantize_fp8_weights(w.float()), "w.dtype = torch.float32", "w.to(torch.bfloat16)")
    raises(ValueError, lambda: quantize_fp8_weights(w[0, 0]), "w.shape = (128,)", "[..., rows, cols]")
    raises(ValueError, lambda: quantize_fp8_weights(torch.zeros(4, 40, dtype=bf16)), "w.shape = (4, 40)",
           "multiple of 16")
    raises(ValueError, lambda: quantize_fp8_weights(w.transpose(1, 2)), "w is not contiguous", "w.contiguous()")
    raises(ValueError, lambda: quantize_fp8_weights(w), "w is on cpu", "comet quantizes on the GPU", "w.cuda()")
    raises(TypeError, lambda: quantize_fp8_weights(w, pow2_scales="yes"), "pow2_scales = 'yes'", "a bool")
    call = "quantize_fp8_rows"
    x = torch.zeros(5, 256, dtype=bf16)
    raises(TypeError, lambda: quantize_fp8_rows(x.half()), f"{call}: x.dtype = torch.float16")
    raises(ValueError, lambda: quantize_fp8_rows(torch.zeros(5, 8, dtype=bf16)), "x.shape = (5, 8)", "multiple of 16")
    raises(ValueError, lambda: quantize_fp8_rows(x[:, :128]), "x is not contiguous")
    raises(ValueError, lambda: quantize_fp8_rows(x), "x is on cpu", "comet quantizes on the GPU")
    raises(TypeError, lambda: quantize_fp8_rows(x, pow2_scales=2), "pow2_scales = 2")
