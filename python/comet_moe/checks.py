"""The forward call's argument checks, made in Python before anything is launched.

They read only what any tensor has (shape, dtype, device, is_contiguous(), data_ptr(),
element_size(), numel(), stride()), so the CPU tests run them on small stand-in objects
without torch or a GPU. A wrong dtype or a non-tensor raises TypeError; a wrong shape,
device, layout, alignment or size raises ValueError. Each message names the argument,
what it got and what it needs.

The checks of addresses (alignment, out overlapping an input) are apart from the others
(pointers=False leaves them out, check_pointers makes them): under torch.compile a
tensor has no address until the graph runs, so the custom operators make them there
(ops.py), while shapes, dtypes and devices are checked as the graph is traced. Sizes
are compared, never converted to int, so a traced size stays symbolic.

No dtype is converted for the caller: an int64 topk_ids (what torch.topk returns) or a
bf16 topk_weights is refused with the conversion to write, so no hidden copy or cast
costs time on every call.

An FP8 layer (config dtype "fp8") takes float8_e4m3fn weights, each with its float32
scales (one per 128 x 128 block: comet.h's comet_moe_weight_scales_t), and x bf16 or
float8_e4m3fn with x_scales [M, ceil(H / 128)]; a bf16 layer refuses scales.

check_int is the package's one check of a Python int bound for a C int, unsigned int,
size_t or pointer: ctypes keeps only the low bits of an int too wide for its field or
argument (2**32 + 5 becomes 5), so every int goes through it first.
"""
from __future__ import annotations

import ctypes
import operator

BF16, INT32, FLOAT32, FP8 = "torch.bfloat16", "torch.int32", "torch.float32", "torch.float8_e4m3fn"
_WEIGHT_NAMES = ("gate_up", "gate", "up", "down")
SCALE_NAMES = tuple(f"{name}_scale" for name in _WEIGHT_NAMES)  # Moe.forward's keywords

INT_MIN, INT_MAX = -2**31, 2**31 - 1
PTR_MAX = 2**(8 * ctypes.sizeof(ctypes.c_void_p)) - 1  # the largest cudaStream_t (a pointer)


def c_range(ctype) -> tuple:
    """(lo, hi, name) of the values a ctypes integer type holds without truncation."""
    bits = 8 * ctypes.sizeof(ctype)
    signed = ctype(-1).value == -1
    name = {ctypes.c_int: "a C int", ctypes.c_uint: "a C unsigned int",
            ctypes.c_size_t: "a C size_t"}.get(ctype, ctype.__name__)
    return (-2**(bits - 1), 2**(bits - 1) - 1, name) if signed else (0, 2**bits - 1, name)


def check_int(name: str, value, lo: int = INT_MIN, hi: int = INT_MAX, why: str = "a C int") -> int:
    """value as a Python int in lo..hi, or TypeError (not an integer; a bool is refused
    too) or ValueError naming `name`, the value and the limit; `why` says what the limit
    is (what C type it fits, or what the value means)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} = {value!r}: expected an int, not a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} = {value!r}: expected an int, got {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name} = {v}: must be in {lo}..{hi} ({why})")
    return v

_CONVERT = {
    INT32: "{name}.to(torch.int32)",
    FLOAT32: "{name}.float()",
    BF16: "{name}.to(torch.bfloat16)",
    FP8: "comet_moe.quantize_fp8_weights({name} in bf16), which gives its scales too",
}


def _blocks(n: int) -> int:
    """128-wide FP8 scale blocks over n elements (fp8.blocks, without torch)."""
    return (n + 127) // 128


def _is_tensor(t) -> bool:
    return all(hasattr(t, a) for a in ("shape", "dtype", "device", "data_ptr", "is_contiguous"))


def _numel(t) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n


def check_tensor(name: str, t, dtype: str, dims, device: str, align: int, hint: str = "",
                 pointers: bool = True) -> None:
    """One tensor: `dims` is a sequence of (size, label) with size None for any size;
    `device` as str(torch.device) writes it ("cuda:0"). `hint` is added to the message
    of a wrong shape. pointers=False leaves out the alignment (see the module's note)."""
    if not _is_tensor(t):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if str(t.dtype) != dtype:
        how = _CONVERT[dtype].format(name=name)
        raise TypeError(f"{name}.dtype = {t.dtype}: expected {dtype} (convert with {how})")
    shape = tuple(t.shape)
    want = tuple(d for d, _ in dims)
    if len(shape) != len(want) or any(w is not None and s != w for s, w in zip(shape, want)):
        labels = ", ".join(label if d is None else f"{label} = {d}" for d, label in dims)
        raise ValueError(f"{name}.shape = {tuple(int(d) for d in shape)}: expected [{labels}]{hint}")
    if str(t.device) != device:
        raise ValueError(f"{name} is on {t.device}: expected {device}, the communicator's device")
    if not t.is_contiguous():
        stride = tuple(t.stride()) if hasattr(t, "stride") else "?"
        raise ValueError(f"{name} is not contiguous (shape {tuple(int(d) for d in shape)}, strides {stride}): pass "
                         f"{name}.contiguous()")
    if pointers:
        check_aligned(name, t, align)


def check_aligned(name: str, t, align: int) -> None:
    """t.data_ptr() a multiple of `align` (an empty tensor's address is not read)."""
    if _numel(t) and t.data_ptr() % align:
        raise ValueError(f"{name}.data_ptr() = {t.data_ptr():#x}: must be {align}-byte aligned (a slice that "
                         f"starts inside a row is not): pass {name}.clone()")


def _span(t):
    start = t.data_ptr()
    return start, start + _numel(t) * t.element_size()


def check_forward_args(cfg, experts_per_rank: int, device: str, x, topk_ids, topk_weights,
                       gate_up, gate, up, down, out, *, ffn_local=None, tp_size=None, pointers=True, fp8=False,
                       scales=None, x_scales=None):
    """Every argument of Moe.forward against the layer's config (hidden, ffn, top_k,
    max_tokens), this rank's expert count and its share of ffn; returns num_tokens.
    `out` may be None; else no byte of it may be a byte of an input, the weights
    included. tp_size: the resolved tensor-parallel size (default
    cfg.tp_size, 0 read as 1); ffn_local: the ffn columns of each expert this rank holds
    (default ffn // tp_size). The weights' ffn dimension is ffn_local: the whole ffn
    when tp_size is 1, ffn / tp_size otherwise (the messages then say so). pointers=False
    leaves out the addresses' checks (check_pointers makes them). fp8: the layer is FP8
    (see the module's note); scales: (gate_up_scale, gate_scale, up_scale, down_scale),
    None for none; x_scales: x's, where x is float8_e4m3fn."""
    H, F, k, E_local = int(cfg.hidden), int(cfg.ffn), int(cfg.top_k), int(experts_per_rank)
    tp = int(tp_size) if tp_size is not None else (int(cfg.tp_size) or 1)
    Fl = int(ffn_local) if ffn_local is not None else F // tp
    if tp == 1:
        f_label, f2_label, f_sym, hint = "ffn", "2 * ffn", "F", ""
    else:
        f_label, f2_label, f_sym = "ffn / tp_size", "2 * ffn / tp_size", "F/tp"
        hint = (f" (tp_size = {tp}: pass this rank's slice, ffn / tp_size = {Fl} of each expert's ffn = {F}: "
                f"those rows of w1 and w3, those columns of w2)")
    if not _is_tensor(x):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if len(x.shape) != 2:
        raise ValueError(f"x.shape = {tuple(int(d) for d in x.shape)}: expected [num_tokens, hidden = {H}] "
                         f"(flatten the batch first: x.reshape(-1, {H}))")
    m = x.shape[0]
    if m > int(cfg.max_tokens):
        raise ValueError(f"x.shape[0] = {m} tokens: more than config.max_tokens = {int(cfg.max_tokens)}; create "
                         f"the layer with a larger max_tokens, or split the batch (every rank must then make "
                         f"the same number of calls)")
    p = pointers
    scales = tuple(scales) if scales is not None else (None,) * 4
    if not fp8:
        given = [n for n, t in zip(SCALE_NAMES + ("x_scales",), scales + (x_scales,)) if t is not None]
        if given:
            raise ValueError(f"{given[0]} is given, but this layer is bf16: scales are for an FP8 layer "
                             f"(MoeConfig(..., dtype='fp8'))")
    x_fp8 = fp8 and _is_tensor(x) and str(x.dtype) == FP8
    check_tensor("x", x, FP8 if x_fp8 else BF16, [(m, "num_tokens"), (H, "hidden")], device, 16, pointers=p)
    if x_fp8:
        if x_scales is None:
            raise ValueError(f"x is {FP8}: give its x_scales [num_tokens, ceil(hidden / 128) = {_blocks(H)}] float32 "
                             f"(comet_moe.quantize_fp8_rows gives both), or pass x in bf16")
        check_tensor("x_scales", x_scales, FLOAT32, [(m, "num_tokens"), (_blocks(H), "ceil(hidden / 128)")], device,
                     16, pointers=p)
    elif x_scales is not None:
        raise ValueError(f"x_scales is given with a {x.dtype} x: scales are for a float8_e4m3fn x (pass x_scales=None "
                         f"for a bf16 x, which comet quantizes itself)")
    wdt = FP8 if fp8 else BF16
    check_tensor("topk_ids", topk_ids, INT32, [(m, "num_tokens"), (k, "top_k")], device, 4, pointers=p)
    check_tensor("topk_weights", topk_weights, FLOAT32, [(m, "num_tokens"), (k, "top_k")], device, 4, pointers=p)
    if gate_up is not None and (gate is not None or up is not None):
        raise ValueError("weights: give gate_up, or gate and up, not both")
    if gate_up is not None:
        if fp8 and Fl % 128:
            raise ValueError(f"gate_up with FP8 weights and {f_label} = {Fl}: gate and up in one tensor need it a "
                             f"multiple of 128 (a 128 x 128 block would hold rows of both); give gate and up apart")
        check_tensor("gate_up", gate_up, wdt, [(E_local, "local experts"), (2 * Fl, f2_label), (H, "hidden")],
                     device, 16, hint, pointers=p)
    elif gate is None or up is None:
        raise ValueError(f"weights: {'gate' if gate is None else 'up'} is None: give gate_up [E_local, 2{f_sym}, H], "
                         f"or both gate and up [E_local, {f_sym}, H]")
    else:
        for name, w in (("gate", gate), ("up", up)):
            check_tensor(name, w, wdt, [(E_local, "local experts"), (Fl, f_label), (H, "hidden")], device, 16, hint,
                         pointers=p)
    if down is None:
        raise ValueError(f"weights: down is None: give down [E_local, H, {f_sym}]")
    check_tensor("down", down, wdt, [(E_local, "local experts"), (H, "hidden"), (Fl, f_label)], device, 16, hint,
                 pointers=p)
    if fp8:
        _check_weight_scales(E_local, H, Fl, f_label, (gate_up, gate, up, down), scales, device, p)
    if out is not None:
        check_tensor("out", out, BF16, [(m, "num_tokens"), (H, "hidden")], device, 16, pointers=p)
    if p:
        check_overlap(out, x, topk_ids, topk_weights, gate_up, gate, up, down, *scales, x_scales)
    return m


def _check_weight_scales(E_local, H, Fl, f_label, weights, scales, device, pointers) -> None:
    """Each FP8 weight's float32 block scales beside it (none beside a weight not given),
    one per 128 x 128 block of each expert's matrix, rounded up."""
    hb, fb = (_blocks(H), "ceil(hidden / 128)"), (_blocks(Fl), f"ceil({f_label} / 128)")
    dims = {"gate_up": [(2 * Fl // 128, f"2 * {f_label} / 128"), hb], "gate": [fb, hb], "up": [fb, hb],
            "down": [hb, fb]}
    for name, w, s in zip(_WEIGHT_NAMES, weights, scales):
        if w is None and s is not None:
            raise ValueError(f"{name}_scale is given without {name}: give each weight's scales beside it")
        if w is not None and s is None:
            raise ValueError(f"{name}_scale is None: FP8 weights need their float32 scales, one per 128 x 128 block "
                             f"(an HF checkpoint's weight_scale_inv; comet_moe.quantize_fp8_weights gives both)")
        if s is not None:
            check_tensor(f"{name}_scale", s, FLOAT32, [(E_local, "local experts")] + dims[name], device, 16,
                         pointers=pointers)


def check_pointers(x, topk_ids, topk_weights, gate_up, gate, up, down, out=None, *, scales=None,
                   x_scales=None) -> None:
    """The addresses of a forward call's tensors, as the call gets them (shapes, dtypes and
    devices were checked before): each contiguous (a compiled graph may lay a buffer out
    otherwise than it was traced) and aligned as comet moves it, and no byte of out a
    byte of an input. scales, x_scales: an FP8 call's (see check_forward_args)."""
    scales = tuple(scales) if scales is not None else (None,) * 4
    named = [("x", x, 16), ("topk_ids", topk_ids, 4), ("topk_weights", topk_weights, 4), ("gate_up", gate_up, 16),
             ("gate", gate, 16), ("up", up, 16), ("down", down, 16), ("out", out, 16)]
    named += [(n, s, 16) for n, s in zip(SCALE_NAMES, scales)] + [("x_scales", x_scales, 16)]
    for name, t, align in named:
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, strides {tuple(t.stride())}): pass "
                             f"{name}.contiguous()")
        check_aligned(name, t, align)
    check_overlap(out, x, topk_ids, topk_weights, gate_up, gate, up, down, *scales, x_scales)


def check_overlap(out, x, topk_ids, topk_weights, gate_up, gate, up, down, gate_up_scale=None, gate_scale=None,
                  up_scale=None, down_scale=None, x_scales=None) -> None:
    """No byte of out (None: nothing to check) a byte of an input, the weights (and an
    FP8 call's scales) included: comet reads its inputs while it writes out."""
    if out is None:
        return
    lo, hi = _span(out)
    inputs = (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("gate_up", gate_up),
              ("gate", gate), ("up", up), ("down", down), ("gate_up_scale", gate_up_scale),
              ("gate_scale", gate_scale), ("up_scale", up_scale), ("down_scale", down_scale), ("x_scales", x_scales))
    for name, t in inputs:
        if t is None:
            continue
        a, b = _span(t)
        if a < b and lo < hi and a < hi and lo < b:  # empty tensors hold no bytes to overlap
            raise ValueError(f"out overlaps {name} (out's bytes [{lo:#x}, {hi:#x}), {name}'s [{a:#x}, {b:#x})): "
                             f"comet reads its inputs while it writes out; pass a separate output tensor")
