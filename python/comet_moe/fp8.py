"""Block-scaled FP8 (E4M3), comet.h's format: each element one float8_e4m3fn byte q, each
block one float32 scale s, an element standing for q x s (HF's `weight_scale_inv`
multiplies too, despite its name). Weights are cut into 128 x 128 blocks (scales
[..., ceil(rows / 128), ceil(cols / 128)]), token rows into 1 x 128 (scales
[..., ceil(cols / 128)]).

    q, s = quantize_fp8_weights(w)       # w bf16 [..., rows, cols] on a GPU: comet's kernel
    q, s = quantize_fp8_rows(x)          # x bf16 [..., cols]
    w32 = dequantize_fp8(q, s)           # plain torch, any device: q x s in float32

The quantizers check their arguments here (TypeError, ValueError naming the argument),
then call comet (comet_quantize_fp8_weights[_transposed], comet_quantize_fp8_rows) through
a torch custom operator each (ops.py: comet_moe::quantize_fp8_*), on torch's current
stream of the tensor's device: torch.compile(fullgraph=True) traces them as one operator.
comet.h states their arithmetic: s = amax / 448 (or, with pow2_scales, the power of two
at or above it), q = x x (1 / s) rounded to nearest even and saturated at +-448.
"""
from __future__ import annotations

import ctypes

from . import _capi
from ._torch import torch
from .checks import INT_MAX
from .errors import check
from . import ops  # noqa: E402 (ops imports this module back: it reads its names only when called)

BLOCK = 128  # a scale block's side: 1 x 128 (rows), 128 x 128 (weights)


def blocks(n: int) -> int:
    """The 128-wide blocks that cover n elements (a partial last block counts)."""
    return (n + BLOCK - 1) // BLOCK


def _pow2(call: str, value) -> int:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return int(value)
    raise TypeError(f"{call}: pow2_scales = {value!r}: expected a bool")


def _check_bf16_cuda(call: str, name: str, t, min_dims: int, what: str) -> None:
    """What comet's quantizers need of their input: a contiguous bf16 CUDA tensor of at
    least `min_dims` dimensions, its rows a multiple of 16 elements (its address, 16-byte
    aligned, is checked where the operator runs: torch.compile traces no address)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{call}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{call}: {name}.dtype = {t.dtype}: expected torch.bfloat16 (convert with "
                        f"{name}.to(torch.bfloat16))")
    if t.dim() < min_dims:
        raise ValueError(f"{call}: {name}.shape = {tuple(t.shape)}: expected {what}")
    cols = int(t.shape[-1])
    if cols < 16 or cols % 16 or cols > INT_MAX:
        raise ValueError(f"{call}: {name}.shape = {tuple(t.shape)}: the last dimension must be a positive multiple of "
                         f"16 (comet moves 16 bytes of a row at a time), at most {INT_MAX}")
    if not t.is_contiguous():
        raise ValueError(f"{call}: {name} is not contiguous (shape {tuple(t.shape)}, strides {tuple(t.stride())}): "
                         f"pass {name}.contiguous()")
    if t.device.type != "cuda":
        raise ValueError(f"{call}: {name} is on {t.device}: comet quantizes on the GPU (pass {name}.cuda())")


def _check_aligned(call: str, name: str, t) -> None:
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{call}: {name}.data_ptr() = {t.data_ptr():#x}: must be 16-byte aligned: pass "
                         f"{name}.clone()")


def quantize_fp8_weights(w, pow2_scales: bool = False):
    """w bf16 [..., rows, cols] (nn.Linear's [out, in] per matrix; leading dimensions stack
    matrices, such as experts), contiguous, on a GPU -> (q float8_e4m3fn of w's shape,
    scales float32 [..., ceil(rows / 128), ceil(cols / 128)]): one scale per 128 x 128 block
    of each matrix, an HF FP8 checkpoint's `weight` and `weight_scale_inv`. cols a multiple
    of 16. pow2_scales: scales rounded up to powers of two (DeepSeek-V3.1's UE8M0)."""
    call = "quantize_fp8_weights"
    pow2 = _pow2(call, pow2_scales)
    _check_bf16_cuda(call, "w", w, 2, "[..., rows, cols]: a matrix, or a stack of them")
    rows = int(w.shape[-2])
    if rows > INT_MAX:
        raise ValueError(f"{call}: w.shape = {tuple(w.shape)}: rows = {rows}: at most {INT_MAX}")
    return ops.quantize_fp8_weights(w, bool(pow2))


def quantize_fp8_weights_transposed(w, pow2_scales: bool = False):
    """As quantize_fp8_weights, with W^T in the same blocks too: (q, scales, qt, scales_t),
    qt float8_e4m3fn [..., cols, rows] equal to q.transpose(-1, -2) byte for byte and
    scales_t [..., ceil(cols / 128), ceil(rows / 128)] equal to scales.transpose(-1, -2),
    from one pass over w (what a backward's data-gradient GEMMs read: FP8 tensor-core MMAs
    take both operands along k only). rows a multiple of 16 as well."""
    call = "quantize_fp8_weights_transposed"
    pow2 = _pow2(call, pow2_scales)
    if isinstance(w, torch.Tensor) and w.dim() >= 2:  # the shape first: it is wrong wherever w is
        rows = int(w.shape[-2])
        if rows < 16 or rows % 16 or rows > INT_MAX:
            raise ValueError(f"{call}: w.shape = {tuple(w.shape)}: rows = {rows}: must be a positive multiple of 16 "
                             f"(the transpose's rows are its k), at most {INT_MAX}")
    _check_bf16_cuda(call, "w", w, 2, "[..., rows, cols]: a matrix, or a stack of them")
    return ops.quantize_fp8_weights_transposed(w, bool(pow2))


def quantize_fp8_rows(x, pow2_scales: bool = False):
    """x bf16 [..., cols] (token rows), contiguous, on a GPU -> (q float8_e4m3fn of x's
    shape, scales float32 [..., ceil(cols / 128)]): one scale per row per 128 columns
    (DeepEP's layout; what Moe.forward takes as x with x_scales). cols a multiple of 16."""
    call = "quantize_fp8_rows"
    pow2 = _pow2(call, pow2_scales)
    _check_bf16_cuda(call, "x", x, 1, "[..., cols]")
    return ops.quantize_fp8_rows(x, bool(pow2))


# ---- what the operators (ops.py) run: their outputs' shapes, and comet's calls ----

def weights_outputs(w, transposed: bool):
    """Empty (q, scales) of w [..., rows, cols], with (qt, scales_t) when transposed."""
    rows, cols = int(w.shape[-2]), int(w.shape[-1])
    lead = tuple(w.shape[:-2])
    out = [w.new_empty(w.shape, dtype=torch.float8_e4m3fn),
           w.new_empty(lead + (blocks(rows), blocks(cols)), dtype=torch.float32)]
    if transposed:
        out += [w.new_empty(lead + (cols, rows), dtype=torch.float8_e4m3fn),
                w.new_empty(lead + (blocks(cols), blocks(rows)), dtype=torch.float32)]
    return tuple(out)


def rows_outputs(x):
    """Empty (q, scales) of x [..., cols]."""
    cols = int(x.shape[-1])
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(tuple(x.shape[:-1]) + (blocks(cols),), dtype=torch.float32))


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def run_weights(w, pow2: bool, transposed: bool):
    """comet_quantize_fp8_weights[_transposed] on torch's current stream of w's device."""
    call = "quantize_fp8_weights_transposed" if transposed else "quantize_fp8_weights"
    _check_aligned(call, "w", w)
    out = weights_outputs(w, transposed)
    if w.numel() == 0:  # no matrix, or matrices of no rows: nothing to quantize
        return out
    rows, cols = int(w.shape[-2]), int(w.shape[-1])
    lib = _capi.load()
    with torch.cuda.device(w.device):
        stream = ctypes.c_void_p(torch.cuda.current_stream(w.device).cuda_stream)
        # The same arguments, then (q, scales) or (q, scales, qt, scales_t), then the stream.
        st = getattr(lib, "comet_" + call)(_ptr(w), w.numel() // (rows * cols), rows, cols, int(pow2),
                                           *map(_ptr, out), stream)
    check(st, "comet_" + call, lambda: _capi.text(lib.comet_last_create_error()))
    return out


def run_rows(x, pow2: bool):
    """comet_quantize_fp8_rows on torch's current stream of x's device."""
    _check_aligned("quantize_fp8_rows", "x", x)
    out = rows_outputs(x)
    if x.numel() == 0:
        return out
    cols = int(x.shape[-1])
    lib = _capi.load()
    with torch.cuda.device(x.device):
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        st = lib.comet_quantize_fp8_rows(_ptr(x), x.numel() // cols, cols, int(pow2), *map(_ptr, out), stream)
    check(st, "comet_quantize_fp8_rows", lambda: _capi.text(lib.comet_last_create_error()))
    return out


def dequantize_fp8(q, scales, dtype=None):
    """q x scale, each element by its block's scale, in float32 (then `dtype` when given):
    plain torch on any device, for tests and for checking a checkpoint. q float8_e4m3fn
    [..., rows, cols] with weights' scales [..., ceil(rows / 128), ceil(cols / 128)], or
    token rows' scales [..., rows, ceil(cols / 128)] (told apart by their shape; where
    both fit, rows is 1 and they agree)."""
    call = "dequantize_fp8"
    for name, t, want in (("q", q, torch.float8_e4m3fn), ("scales", scales, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{call}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != want:
            raise TypeError(f"{call}: {name}.dtype = {t.dtype}: expected {want}")
    if q.dim() < 1:
        raise ValueError(f"{call}: q is a scalar: expected [..., cols]")
    if scales.device != q.device:
        raise ValueError(f"{call}: scales is on {scales.device}, q on {q.device}: expected one device")
    shape, cols = tuple(q.shape), int(q.shape[-1])
    as_rows = shape[:-1] + (blocks(cols),)
    as_weights = shape[:-2] + (blocks(shape[-2]), blocks(cols)) if q.dim() >= 2 else None
    s = scales.repeat_interleave(BLOCK, -1)[..., :cols]
    if tuple(scales.shape) == as_rows:
        pass
    elif tuple(scales.shape) == as_weights:
        s = s.repeat_interleave(BLOCK, -2)[..., :shape[-2], :]
    else:
        weights = f" or [..., ceil(rows / 128), ceil(cols / 128)] = {as_weights} (a weight's blocks)" if as_weights \
            else ""
        raise ValueError(f"{call}: scales.shape = {tuple(scales.shape)} for q.shape = {shape}: expected "
                         f"[..., ceil(cols / 128)] = {as_rows} (token rows){weights}")
    out = q.float() * s
    return out if dtype is None else out.to(dtype)
