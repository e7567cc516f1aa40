"""fp8_reference.py - block-scaled FP8 (E4M3) written out in plain torch, for the tests: the
arithmetic of src/base/fp8.h (comet.h's "Block-scaled FP8" section), op for op, so that
comet's quantizers can be compared with it byte for byte (gpu_fp8.py), and the CPU tests
can quantize where comet's CUDA quantizer cannot run (test_fp8_cpu.py, which also checks
it on values worked out by hand).

    scale = amax / 448 (fp32 division); at least 2^-126; 1 where amax is 0; with pow2, the
            power of two at or above it (the float's exponent rounded up)
    q     = e4m3(x * (1 / scale)) (fp32 division and product), rounded to nearest even and
            saturated at +-448

Every division divides by a tensor: torch on CUDA turns a division by a CPU scalar into a
product with the scalar's inverse, which can differ in the last bit.

torch's .to(torch.float8_e4m3fn) rounds to nearest even but does not saturate: past 464
it gives NaN (0x7F, 0xFF). The product is clamped to +-448 first, which is what
saturation gives (clamp keeps a NaN a NaN). Where comet writes every NaN as 0x7F, torch
keeps the NaN's sign (0xFF for a negative one): the tests compare NaN bytes apart.
"""
from __future__ import annotations

E4M3_MAX = 448.0
BLOCK = 128
FLT_MIN = 2.0 ** -126


def scales_from_amax(torch, amax, pow2: bool):
    """fp8.h's cometi_fp8_scale over a tensor of float32 amaxes."""
    s = amax / torch.full_like(amax, E4M3_MAX)  # a tensor: divided by a CPU scalar, CUDA multiplies by its inverse
    s = torch.where(s < FLT_MIN, torch.full_like(s, FLT_MIN), s)  # false for NaN: it stays
    if pow2:
        bits = s.view(torch.int32)
        finite = (bits & 0x7F800000) != 0x7F800000
        inexact = (bits & 0x007FFFFF) != 0
        up = (bits & -0x800000) + 0x800000  # the exponent's bits, plus one
        s = torch.where(finite & inexact, up, bits).view(torch.float32)
    return torch.where(amax == 0, torch.ones_like(s), s)


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def quantize_weights(torch, w, pow2: bool = False):
    """w [..., rows, cols] (any float dtype, read as float32) -> (q float8_e4m3fn of w's
    shape, scales float32 [..., ceil(rows / 128), ceil(cols / 128)]), on w's device."""
    rows, cols = w.shape[-2], w.shape[-1]
    lead = tuple(w.shape[:-2])
    br, bc = _blocks(rows), _blocks(cols)
    x = w.float().reshape(-1, rows, cols)
    pad = torch.nn.functional.pad(x.abs(), (0, bc * BLOCK - cols, 0, br * BLOCK - rows))
    amax = pad.view(-1, br, BLOCK, bc, BLOCK).amax(dim=(2, 4))  # NaN propagates
    s = scales_from_amax(torch, amax, pow2)
    inv = torch.ones_like(s) / s
    full = inv.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :rows, :cols]
    q = (x * full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(w.shape), s.view(lead + (br, bc))


def quantize_rows(torch, x, pow2: bool = False):
    """x [..., cols] -> (q float8_e4m3fn of x's shape, scales float32 [..., ceil(cols / 128)]):
    one scale per row per 128 columns."""
    cols = x.shape[-1]
    q, s = quantize_weights(torch, x.reshape(-1, 1, cols), pow2)
    return q.view(x.shape), s.view(tuple(x.shape[:-1]) + (_blocks(cols),))
