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

check_int is the package's one check of a Python int bound for a C int, unsigned int,
size_t or pointer: ctypes keeps only the low bits of an int too wide for its field or
argument (2**32 + 5 becomes 5), so every int goes through it first.
"""
from __future__ import annotations

import ctypes
import operator

BF16, INT32, FLOAT32 = "torch.bfloat16", "torch.int32", "torch.float32"

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
    INT32: "topk_ids.to(torch.int32)",
    FLOAT32: "topk_weights.float()",
    BF16: ".to(torch.bfloat16)",
}


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
        how = _CONVERT[dtype] if name in ("topk_ids", "topk_weights") else f"{name}{_CONVERT[dtype]}"
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
                       gate_up, gate, up, down, out, *, ffn_local=None, tp_size=None, pointers=True):
    """Every argument of Moe.forward against the layer's config (hidden, ffn, top_k,
    max_tokens), this rank's expert count and its share of ffn; returns num_tokens.
    `out` may be None; else no byte of it may be a byte of an input, the weights
    included. tp_size: the resolved tensor-parallel size (default
    cfg.tp_size, 0 read as 1); ffn_local: the ffn columns of each expert this rank holds
    (default ffn // tp_size). The weights' ffn dimension is ffn_local: the whole ffn
    when tp_size is 1, ffn / tp_size otherwise (the messages then say so). pointers=False
    leaves out the addresses' checks (check_pointers makes them)."""
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
    check_tensor("x", x, BF16, [(m, "num_tokens"), (H, "hidden")], device, 16, pointers=p)
    check_tensor("topk_ids", topk_ids, INT32, [(m, "num_tokens"), (k, "top_k")], device, 4, pointers=p)
    check_tensor("topk_weights", topk_weights, FLOAT32, [(m, "num_tokens"), (k, "top_k")], device, 4, pointers=p)
    if gate_up is not None and (gate is not None or up is not None):
        raise ValueError("weights: give gate_up, or gate and up, not both")
    if gate_up is not None:
        check_tensor("gate_up", gate_up, BF16, [(E_local, "local experts"), (2 * Fl, f2_label), (H, "hidden")],
                     device, 16, hint, pointers=p)
    elif gate is None or up is None:
        raise ValueError(f"weights: {'gate' if gate is None else 'up'} is None: give gate_up [E_local, 2{f_sym}, H], "
                         f"or both gate and up [E_local, {f_sym}, H]")
    else:
        for name, w in (("gate", gate), ("up", up)):
            check_tensor(name, w, BF16, [(E_local, "local experts"), (Fl, f_label), (H, "hidden")], device, 16, hint,
                         pointers=p)
    if down is None:
        raise ValueError(f"weights: down is None: give down [E_local, H, {f_sym}]")
    check_tensor("down", down, BF16, [(E_local, "local experts"), (H, "hidden"), (Fl, f_label)], device, 16, hint,
                 pointers=p)
    if out is not None:
        check_tensor("out", out, BF16, [(m, "num_tokens"), (H, "hidden")], device, 16, pointers=p)
    if p:
        check_overlap(out, x, topk_ids, topk_weights, gate_up, gate, up, down)
    return m


def check_pointers(x, topk_ids, topk_weights, gate_up, gate, up, down, out=None) -> None:
    """The addresses of a forward call's tensors, as the call gets them (shapes, dtypes and
    devices were checked before): each contiguous (a compiled graph may lay a buffer out
    otherwise than it was traced) and aligned as comet moves it, and no byte of out a
    byte of an input."""
    for name, t, align in (("x", x, 16), ("topk_ids", topk_ids, 4), ("topk_weights", topk_weights, 4),
                           ("gate_up", gate_up, 16), ("gate", gate, 16), ("up", up, 16), ("down", down, 16),
                           ("out", out, 16)):
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, strides {tuple(t.stride())}): pass "
                             f"{name}.contiguous()")
        check_aligned(name, t, align)
    check_overlap(out, x, topk_ids, topk_weights, gate_up, gate, up, down)


def check_overlap(out, x, topk_ids, topk_weights, gate_up, gate, up, down) -> None:
    """No byte of out (None: nothing to check) a byte of an input, the weights included:
    comet reads its inputs while it writes out."""
    if out is None:
        return
    lo, hi = _span(out)
    inputs = (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("gate_up", gate_up),
              ("gate", gate), ("up", up), ("down", down))
    for name, t in inputs:
        if t is None:
            continue
        a, b = _span(t)
        if a < b and lo < hi and a < hi and lo < b:  # empty tensors hold no bytes to overlap
            raise ValueError(f"out overlaps {name} (out's bytes [{lo:#x}, {hi:#x}), {name}'s [{a:#x}, {b:#x})): "
                             f"comet reads its inputs while it writes out; pass a separate output tensor")
