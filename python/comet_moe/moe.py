"""The MoE layer (comet_moe_t): y = MoE(x) for this rank's tokens, with this rank's
experts' weights (with tp_size > 1, its ffn / tp_size slice of its group's experts),
enqueued on the current torch CUDA stream.

    moe = Moe(comm, MoeConfig.preset("mixtral-8x7b", max_tokens=8192))   # collective
    y = moe.forward(x, topk_ids, topk_weights, gate_up=w13, down=w2)     # collective
    moe.close()                                                           # before comm.close()

Every rank calls forward the same number of times with the same impl, each with its own
tokens (0 is fine). Tensors are passed by data_ptr(); forward checks them first (see
checks.py) and raises TypeError / ValueError before anything is launched. A failure
comet reports raises a CometError subclass with comet's message.
"""
from __future__ import annotations

import ctypes

from . import _capi
from .checks import PTR_MAX, check_forward_args, check_int
from .comm import Comm, _Box, _Handle, _destroy_moe
from .config import MoeConfig
from .errors import check

_IMPLS = {"auto": _capi.IMPL_AUTO, "baseline": _capi.IMPL_BASELINE, "fused": _capi.IMPL_FUSED}


def parse_impl(impl) -> int:
    """"auto" | "baseline" | "fused", or the COMET_IMPL_* value, as comet_impl_t."""
    if isinstance(impl, str) and impl.lower() in _IMPLS:
        return _IMPLS[impl.lower()]
    if isinstance(impl, int) and not isinstance(impl, bool) and impl in _capi.IMPL_NAMES:
        return impl
    raise ValueError(f"impl = {impl!r}: expected 'auto', 'baseline' or 'fused' (or IMPL_AUTO, IMPL_BASELINE, "
                     f"IMPL_FUSED)")


def _ptr(t):
    return None if t is None else t.data_ptr()


def _records_grad(*tensors) -> bool:
    """Whether autograd records this call: grad enabled and an input requires grad."""
    if not any(getattr(t, "requires_grad", False) for t in tensors if t is not None):
        return False
    import torch
    return torch.is_grad_enabled()


def _rank_layout(config, world: int, rank: int) -> dict:
    """Where `rank` of `world` sits, as comet_moe_create resolves it (src/moe.c): tp_size
    (0 read as 1), ep_size (0: world // tp_size), ep_rank = rank // tp_size (its EP group),
    tp_rank = rank % tp_size, experts_per_rank = num_experts // ep_size, first_expert =
    ep_rank * experts_per_rank and ffn_local = ffn // tp_size."""
    tp = int(config.tp_size) or 1
    ep = int(config.ep_size) or world // tp
    per = int(config.num_experts) // ep
    return dict(tp_size=tp, ep_size=ep, ep_rank=rank // tp, tp_rank=rank % tp, experts_per_rank=per,
                first_expert=(rank // tp) * per, ffn_local=int(config.ffn) // tp)


class Moe(_Handle):
    """comet_moe_t on a Comm. With tp_size ranks per expert group (tensor parallelism
    inside the experts; ep_size x tp_size = world size), rank r is TP rank
    tp_rank = r % tp_size of EP group ep_rank = r // tp_size. The group holds global
    experts [first_expert, first_expert + experts_per_rank), first_expert =
    ep_rank * experts_per_rank, experts_per_rank = num_experts // ep_size; each rank of
    the group holds ffn columns [tp_rank * ffn_local, (tp_rank + 1) * ffn_local) of each
    of them, ffn_local = ffn // tp_size (comet.h). With tp_size 1 (the default) a rank
    holds its experts whole."""

    def __init__(self, comm: Comm, config: MoeConfig, *, max_recv_rows: int = 0, grad_accumulation: str = "grad"):
        """comet_moe_create (collective): plans the layer and allocates its buffers for
        max_tokens per rank. A bad config raises CometInvalidArgumentError with comet's
        message. Training (forward under autograd): max_recv_rows bounds the rows a call
        may route to this rank, which sizes what each forward keeps for its backward (0:
        the worst case, world x max_tokens x min(top_k, experts per rank); see
        comet_moe_saved_config_t), the same
        on every rank; grad_accumulation "grad" gives the expert weights bf16 gradients
        through autograd (.grad), "main_grad" adds them in fp32 to each weight's
        `main_grad` tensor (Megatron-LM's convention) where every weight has one."""
        self._box = None
        if isinstance(max_recv_rows, bool) or not isinstance(max_recv_rows, int) or not 0 <= max_recv_rows < 2**62:
            raise ValueError(f"max_recv_rows = {max_recv_rows!r}: expected an int >= 0 (0: the worst case)")
        if grad_accumulation not in ("grad", "main_grad"):
            raise ValueError(f"grad_accumulation = {grad_accumulation!r}: expected 'grad' or 'main_grad'")
        self.max_recv_rows = max_recv_rows
        self.grad_accumulation = grad_accumulation
        if not isinstance(comm, Comm):
            raise TypeError(f"comm: expected a comet_moe.Comm, got {type(comm).__name__}")
        if not isinstance(config, _capi.MoeConfigStruct):
            raise TypeError(f"config: expected a comet_moe.MoeConfig, got {type(config).__name__}")
        lib = _capi.load()
        self.config = MoeConfig._blank()
        ctypes.memmove(ctypes.byref(self.config), ctypes.byref(config), ctypes.sizeof(config))
        handle = ctypes.c_void_p()
        ptr = comm._require()
        with comm._on_device():
            st = lib.comet_moe_create(ptr, ctypes.byref(self.config), ctypes.byref(handle))
        check(st, "comet_moe_create", lambda: _capi.text(lib.comet_last_create_error()))
        self.comm = comm  # kept alive while this layer is
        self._lib = lib
        self._box = _Box(handle.value)
        comm._moe_boxes.append(self._box)
        # As comet_moe_create resolves them (src/moe.c).
        layout = _rank_layout(self.config, comm.size, comm.rank)
        self.tp_size = layout["tp_size"]
        self.tp_rank = layout["tp_rank"]
        self.ffn_local = layout["ffn_local"]
        self.ep_size = layout["ep_size"]
        self.ep_rank = layout["ep_rank"]
        self.experts_per_rank = layout["experts_per_rank"]
        self.first_expert = layout["first_expert"]

    @property
    def local_experts(self) -> range:
        """The global ids of the experts whose weights (whole, or this TP rank's
        ffn_local columns of them) this rank passes."""
        return range(self.first_expert, self.first_expert + self.experts_per_rank)

    @property
    def closed(self) -> bool:
        return self._box is None or self._box.ptr is None

    def forward(self, x, topk_ids, topk_weights, *, gate_up=None, gate=None, up=None, down=None, out=None,
                impl="auto", stream=None):
        """y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), SwiGLU experts.

        x: [M, H] bf16, M <= config.max_tokens. topk_ids: [M, top_k] int32 global expert
        ids in [0, num_experts). topk_weights: [M, top_k] float32. Weights of this rank's
        experts, bf16, nn.Linear's [out, in] layout, contiguous, with Fl = ffn_local (F
        when tp_size is 1): gate_up [E_local, 2Fl, H] (rows 0..Fl-1 gate = HF w1, Fl..2Fl-1
        up = HF w3) or gate and up [E_local, Fl, H]; down [E_local, H, Fl] (HF w2). With
        tp_size > 1 these are this TP rank's slice: rows tp_rank*Fl..(tp_rank+1)*Fl-1 of
        w1 and w3, those columns of w2. out: [M, H] bf16 (allocated when None), the full
        y of this rank's tokens (comet sums the TP ranks' partial results). All on the
        communicator's device. impl: "auto" (fused where the config allows: top_k <= 8
        and, with tp_size > 1, at most 32 ranks; else the baseline), "baseline" or "fused"; every
        rank must pass the same. stream: a torch.cuda.Stream or raw cudaStream_t (int);
        default torch.cuda.current_stream(); consecutive calls must use the same stream.
        Returns out.

        Under autograd (grad enabled, and x, topk_weights or a weight requires grad) the
        call is a training forward (autograd.py): its backward gives x, topk_weights and
        the weights their gradients; out and stream are then not taken (the current
        stream is used, as autograd's backward does). Otherwise nothing is saved."""
        if self.closed:
            raise RuntimeError("comet_moe.Moe: used after close() (or after its Comm was closed)")
        code = parse_impl(impl)
        m = check_forward_args(self.config, self.experts_per_rank, f"cuda:{self.comm.device_index}", x, topk_ids,
                               topk_weights, gate_up, gate, up, down, out, ffn_local=self.ffn_local,
                               tp_size=self.tp_size)
        if _records_grad(x, topk_weights, gate_up, gate, up, down):
            if out is not None or stream is not None:
                raise ValueError("out and stream are not taken under autograd (a training forward allocates y "
                                 "and runs on the current stream); call it under torch.no_grad() to pass them")
            from .autograd import MoeFunction
            return MoeFunction.apply(self, code, self.grad_accumulation == "main_grad", topk_ids, x, topk_weights,
                                     gate_up, gate, up, down)
        if stream is None:
            import torch
            stream = torch.cuda.current_stream(self.comm.device_index).cuda_stream
        else:  # a torch.cuda.Stream or a raw cudaStream_t; ctypes would truncate a wider int
            raw = stream.cuda_stream if hasattr(stream, "cuda_stream") else stream
            stream = check_int("stream", raw, 0, PTR_MAX, "a cudaStream_t: a torch.cuda.Stream or its .cuda_stream")
        if out is None:
            out = x.new_empty((m, int(self.config.hidden)))
        args = _capi.MoeArgsStruct()
        args.num_tokens = m
        args.x = _ptr(x)
        args.topk_ids = _ptr(topk_ids)
        args.topk_weights = _ptr(topk_weights)
        args.weights.gate_up = _ptr(gate_up)
        args.weights.gate = _ptr(gate)
        args.weights.up = _ptr(up)
        args.weights.down = _ptr(down)
        args.y = _ptr(out)
        args.impl = code
        ptr = self._box.ptr
        with self.comm._on_device():
            st = self._lib.comet_moe_forward(ptr, ctypes.byref(args), ctypes.c_void_p(stream))
        check(st, "comet_moe_forward", lambda: _capi.text(self._lib.comet_moe_last_error(ptr)))
        return out

    __call__ = forward

    def close(self) -> None:
        """comet_moe_destroy (waits for the device). Collective: every rank closes the
        layer at the same point (the fused path's NCCL windows are deregistered together),
        before the communicator's close(); Comm.close() closes layers still open.
        Idempotent. Dropping the last reference closes it too, which is only safe where
        every rank drops it at the same point (not in a reference cycle, which the garbage
        collector breaks at a different time on each rank)."""
        if self.closed:
            return
        box = self._box
        try:
            self.comm._moe_boxes.remove(box)
        except ValueError:
            pass
        _destroy_moe(self.comm, box)

    def __repr__(self):
        if self.closed:
            state = "closed"
        else:
            state = f"experts {self.first_expert}..{self.first_expert + self.experts_per_rank - 1} here"
            if self.tp_size > 1:
                lo = self.tp_rank * self.ffn_local
                state += f", tp rank {self.tp_rank} of {self.tp_size}: ffn columns {lo}..{lo + self.ffn_local - 1}"
        return f"comet_moe.Moe({self.config!r}, {state})"
