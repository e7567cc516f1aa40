"""Training through comet under torch autograd: a torch.autograd.Function whose forward
is comet_moe_forward_train and whose backward is comet_moe_backward (include/comet.h).

Moe.forward takes this path by itself when autograd records (grad enabled and x,
topk_weights or a weight requires grad). The state the forward keeps for its backward
lives in one uint8 tensor from torch's caching allocator (comet_moe_saved_create_in),
held by the graph and freed with it. The backward gives dx, the gradient at
topk_weights (so the router's gradient flows through torch's softmax and top-k), and
the expert weights' gradients: as bf16 tensors that autograd adds into .grad, or, when the
layer was made with grad_accumulation="main_grad", added in fp32 to each weight's
`main_grad` (Megatron-LM's convention: a weight with a `grad_added_to_main_grad`
attribute gets it set and a placeholder gradient its hooks look for; others get none).
The saved state's memory goes back to torch as soon as the backward is enqueued.

Collective, like the forward: every rank's backward must run for every forward. A
backward consumes its saved state: backward through the same graph twice
(retain_graph=True) raises CometInvalidArgumentError.
"""
from __future__ import annotations

import ctypes

import torch
from torch.autograd.function import once_differentiable

from . import _capi
from .errors import check, error_for

_WEIGHTS = ("gate_up", "gate", "up", "down")


class _Saved:
    """A saved state over torch memory; destroyed (host side only) with the graph."""

    def __init__(self, moe, device):
        self.handle = None  # __del__ must find it, whatever fails below
        lib = moe._lib
        cfg = _capi.MoeSavedConfigStruct(int(moe.max_recv_rows))
        nbytes = ctypes.c_size_t()
        ptr = moe._box.ptr
        st = lib.comet_moe_saved_bytes(ptr, ctypes.byref(cfg), ctypes.byref(nbytes))
        check(st, "comet_moe_saved_bytes", lambda: _capi.text(lib.comet_last_create_error()))
        # The caching allocator's blocks start 512-byte aligned; comet needs 256.
        self.memory = torch.empty(int(nbytes.value), dtype=torch.uint8, device=device)
        handle = ctypes.c_void_p()
        st = lib.comet_moe_saved_create_in(ptr, ctypes.byref(cfg), ctypes.c_void_p(self.memory.data_ptr()),
                                           ctypes.c_size_t(int(nbytes.value)), ctypes.byref(handle))
        check(st, "comet_moe_saved_create_in", lambda: _capi.text(lib.comet_last_create_error()))
        self._lib = lib
        self.handle = handle.value

    def close(self):
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._lib.comet_moe_saved_destroy(ctypes.c_void_p(handle))  # neither syncs nor frees: torch's memory
        self.memory = None

    def __del__(self):
        self.close()


def _weight_args(args, weights):
    for name, w in zip(_WEIGHTS, weights):
        setattr(args.weights, name, None if w is None else w.data_ptr())


class MoeFunction(torch.autograd.Function):
    """y = MoE(x) with its backward through comet. apply(moe, impl, main_grad, topk_ids,
    x, topk_weights, gate_up, gate, up, down); arguments checked by Moe.forward."""

    @staticmethod
    def forward(ctx, moe, impl, main_grad, topk_ids, x, topk_weights, gate_up, gate, up, down):
        m, H = int(x.shape[0]), int(moe.config.hidden)
        saved = _Saved(moe, x.device)
        y = x.new_empty((m, H))
        args = _capi.MoeArgsStruct()
        args.num_tokens = m
        args.x, args.topk_ids, args.topk_weights, args.y = x.data_ptr(), topk_ids.data_ptr(), \
            topk_weights.data_ptr(), y.data_ptr()
        weights = (gate_up, gate, up, down)
        _weight_args(args, weights)
        args.impl = impl
        stream = torch.cuda.current_stream(x.device).cuda_stream
        ptr = moe._box.ptr
        with moe.comm._on_device():
            st = moe._lib.comet_moe_forward_train(ptr, ctypes.byref(args), ctypes.c_void_p(saved.handle),
                                                  ctypes.c_void_p(stream))
        check(st, "comet_moe_forward_train", lambda: _capi.text(moe._lib.comet_moe_last_error(ptr)))
        ctx.moe, ctx.impl, ctx.main_grad, ctx.saved_state, ctx.m = moe, impl, main_grad, saved, m
        # Where the config resends x, the backward sends the forward's x again: autograd
        # keeps it (and refuses a backward after it was changed in place).
        ctx.save_for_backward(*weights, x if moe.config.resend_x else None)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        moe, m = ctx.moe, ctx.m
        if ctx.saved_state is None:  # released by the first backward (the same on every rank)
            raise error_for(_capi.INVALID_ARGUMENT, "comet_moe_backward", "args.saved holds no forward: a backward "
                            "consumes it (backward through this graph once, or run the forward again)")
        *weights, x = ctx.saved_tensors
        H, k = int(moe.config.hidden), int(moe.config.top_k)
        if dy is None:
            dy = torch.zeros((m, H), dtype=torch.bfloat16, device=weights[3].device)
        dy = dy.to(torch.bfloat16).contiguous()
        if dy.data_ptr() % 16:  # a view that starts inside a row: comet moves rows 16 bytes at a time
            dy = dy.clone()
        dx = torch.empty((m, H), dtype=torch.bfloat16, device=dy.device)
        d_weights = torch.empty((m, k), dtype=torch.float32, device=dy.device)
        # fp32 accumulation into each weight's main_grad when asked; else bf16 .grad.
        present = [w for w in weights if w is not None]
        accumulate = ctx.main_grad
        for w in present if accumulate else ():
            if getattr(w, "main_grad", None) is None:
                raise ValueError(f"grad_accumulation='main_grad', but a weight of shape {tuple(w.shape)} has no "
                                 f"main_grad: attach an fp32 main_grad to every expert weight")
        if accumulate:
            grads = [None if w is None else w.main_grad for w in weights]
            for g, w in zip(grads, weights):
                if g is not None and (g.dtype != torch.float32 or g.shape != w.shape or not g.is_contiguous()):
                    raise ValueError(f"main_grad: expected a contiguous float32 tensor of shape {tuple(w.shape)}, "
                                     f"got {g.dtype} {tuple(g.shape)}")
        else:
            grads = [None if w is None else torch.empty_like(w) for w in weights]
        b = _capi.MoeBackwardArgsStruct()
        b.saved = ctx.saved_state.handle
        b.dy, b.dx, b.d_topk_weights = dy.data_ptr(), dx.data_ptr(), d_weights.data_ptr()
        b.x = None if x is None else x.data_ptr()
        _weight_args(b, weights)
        for name, g in zip(_WEIGHTS, grads):
            setattr(b.grads, name, None if g is None else g.data_ptr())
        b.grads.mode = _capi.GRAD_ACCUMULATE_FP32 if accumulate else _capi.GRAD_WRITE_BF16
        b.impl = ctx.impl
        stream = torch.cuda.current_stream(dy.device).cuda_stream
        ptr = moe._box.ptr
        with moe.comm._on_device():
            st = moe._lib.comet_moe_backward(ptr, ctypes.byref(b), ctypes.c_void_p(stream))
        check(st, "comet_moe_backward", lambda: _capi.text(moe._lib.comet_moe_last_error(ptr)))
        # Consumed: its memory goes back to torch now, not when the graph goes (which can be
        # after the next forward). The backward was enqueued on this stream, where the
        # caching allocator hands the block out again only after it.
        ctx.saved_state.close()
        ctx.saved_state = None
        if accumulate:  # Megatron-LM's convention: a placeholder where its hooks look for one
            grads = [None if w is None or not hasattr(w, "grad_added_to_main_grad") else
                     (torch.zeros_like(w) if getattr(w, "zero_out_wgrad", False) else torch.empty_like(w))
                     for w in weights]
            for w in present:
                if hasattr(w, "grad_added_to_main_grad"):
                    w.grad_added_to_main_grad = True
        need = ctx.needs_input_grad
        wgrads = [g if need[6 + i] else None for i, g in enumerate(grads)]
        return (None, None, None, None, dx if need[4] else None, d_weights if need[5] else None, *wgrads)
