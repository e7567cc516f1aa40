"""The MoE layer (comet_moe_t): y = MoE(x) for this rank's tokens, with this rank's
experts' weights (with tp_size > 1, its ffn / tp_size slice of its group's experts),
enqueued on the current torch CUDA stream.

    moe = Moe(comm, MoeConfig.preset("mixtral-8x7b", max_tokens=8192))   # collective
    y = moe.forward(x, topk_ids, topk_weights, gate_up=w13, down=w2)     # collective
    moe.close()                                                           # before comm.close()

Every rank calls forward the same number of times with the same impl, each with its own
tokens (0 is fine). An FP8 layer (MoeConfig(..., dtype="fp8")) takes float8_e4m3fn
weights with their block scales (gate_up_scale=..., down_scale=...; fp8.py makes them)
for the inference forward, or bf16 master weights, which it quantizes itself and
trains in FP8 under autograd (see forward). forward checks its arguments first (see checks.py) and raises
TypeError / ValueError before anything is launched, then calls comet through torch's
custom operators (ops.py), which torch.compile traces; comet gets the tensors by
data_ptr(). A failure comet reports raises a CometError subclass with comet's message.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import weakref

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


def _bf16(t) -> bool:
    """Whether t is a bf16 tensor (an FP8 layer's master weight)."""
    return hasattr(t, "dtype") and str(t.dtype) == "torch.bfloat16"


def _ptr(t):
    return None if t is None else t.data_ptr()


# A layer's config as plain ints, which torch.compile reads where it cannot read a ctypes field.
_Shape = collections.namedtuple("_Shape", "hidden ffn num_experts top_k max_tokens ep_size tp_size resend_x dtype "
                                          "fp8_pow2_scales fp8_wgrad_cublaslt")


# The open layers by id. torch's custom operators (ops.py) name their layer by this int:
# a compiled graph holds ints, not Python objects. Held weakly, so dropping the last
# reference to a layer still closes it.
_LAYERS = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def layer_by_id(layer_id: int) -> "Moe":
    """The open layer whose _op_id is `layer_id`; RuntimeError when it was closed or dropped."""
    layer = _LAYERS.get(layer_id)
    if layer is None or layer.closed:
        raise RuntimeError(f"comet_moe.Moe: layer {layer_id} used after close() (or after its Comm was closed, "
                           f"or after the last reference to it was dropped)")
    return layer


def _rank_layout(config, world: int, rank: int) -> dict:
    """Where `rank` of `world` sits, as comet_moe_create resolves it (src/layer/moe.c): tp_size
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

    def __init__(self, comm: Comm, config: MoeConfig, *, max_recv_rows: int = 0, grad_accumulation: str = "grad",
                 fp8_gate_up: str = "bf16"):
        """comet_moe_create (collective): plans the layer and allocates its buffers for
        max_tokens per rank. A bad config raises CometInvalidArgumentError with comet's
        message. Training (forward under autograd): max_recv_rows bounds the rows a call
        may route to this rank, which sizes what each forward keeps for its backward (0:
        the worst case, world x max_tokens x min(top_k, experts per rank); see
        comet_moe_saved_config_t), the same
        on every rank; grad_accumulation "grad" gives the expert weights bf16 gradients
        through autograd (.grad), "main_grad" adds them in fp32 to each weight's
        `main_grad` tensor (Megatron-LM's convention) where every weight has one. FP8
        layers: fp8_gate_up "e4m3" keeps each received row's gate and up projections in
        E4M3 with 1 x 128 scales between the forward and the backward (about half the
        memory of "bf16", for one more E4M3 rounding of them; comet_moe_saved_config_t)."""
        self._box = None
        if isinstance(max_recv_rows, bool) or not isinstance(max_recv_rows, int) or not 0 <= max_recv_rows < 2**62:
            raise ValueError(f"max_recv_rows = {max_recv_rows!r}: expected an int >= 0 (0: the worst case)")
        if grad_accumulation not in ("grad", "main_grad"):
            raise ValueError(f"grad_accumulation = {grad_accumulation!r}: expected 'grad' or 'main_grad'")
        if fp8_gate_up not in ("bf16", "e4m3"):
            raise ValueError(f"fp8_gate_up = {fp8_gate_up!r}: expected 'bf16' or 'e4m3'")
        if fp8_gate_up == "e4m3" and getattr(config, "dtype", None) != _capi.DTYPE_FP8_BLOCK:
            raise ValueError("fp8_gate_up = 'e4m3' is for FP8 layers (MoeConfig dtype 'fp8'); this config's dtype is "
                             f"{getattr(config, 'dtype', None)!r}")
        self.max_recv_rows = max_recv_rows
        self.grad_accumulation = grad_accumulation
        self.fp8_gate_up = fp8_gate_up
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
        # As comet_moe_create resolves them (src/layer/moe.c).
        layout = _rank_layout(self.config, comm.size, comm.rank)
        self.tp_size = layout["tp_size"]
        self.tp_rank = layout["tp_rank"]
        self.ffn_local = layout["ffn_local"]
        self.ep_size = layout["ep_size"]
        self.ep_rank = layout["ep_rank"]
        self.experts_per_rank = layout["experts_per_rank"]
        self.first_expert = layout["first_expert"]
        self._register(f"cuda:{comm.device_index}")

    def _register(self, device: str) -> None:
        """Enter this layer in the table the custom operators read (its _op_id); `device`
        is where its tensors must be, as str(torch.device) writes it."""
        self._device = device
        self._shape = _Shape(**self.config.as_dict())
        self.fp8 = int(self.config.dtype) == _capi.DTYPE_FP8_BLOCK
        self._fp8_cache = {}  # FP8: id of a master weight -> (its weakref, its version, its FP8 copies)
        self._op_id = next(_NEXT_ID)
        _LAYERS[self._op_id] = self

    @property
    def local_experts(self) -> range:
        """The global ids of the experts whose weights (whole, or this TP rank's
        ffn_local columns of them) this rank passes."""
        return range(self.first_expert, self.first_expert + self.experts_per_rank)

    @property
    def closed(self) -> bool:
        return self._box is None or self._box.ptr is None

    def forward(self, x, topk_ids, topk_weights, *, gate_up=None, gate=None, up=None, down=None, out=None,
                impl="auto", stream=None, gate_up_scale=None, gate_scale=None, up_scale=None, down_scale=None,
                x_scales=None):
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
        call is a training forward (ops.py): its backward gives x, topk_weights and
        the weights their gradients; out and stream are then not taken (the current
        stream is used, as autograd's backward does). Otherwise nothing is saved. With
        grad_accumulation="main_grad" every weight must carry an fp32 `main_grad` of its
        shape (ValueError here, before anything is launched).

        FP8 layer (config dtype "fp8"): the weights are float8_e4m3fn in the same layouts,
        each with its float32 scales, one per 128 x 128 block of each expert's matrix
        (gate_up_scale [E_local, 2Fl / 128, ceil(H / 128)], needing Fl a multiple of 128;
        gate_scale and up_scale [E_local, ceil(Fl / 128), ceil(H / 128)]; down_scale
        [E_local, ceil(H / 128), ceil(Fl / 128)]: an HF checkpoint's weight_scale_inv,
        stacked; fp8.quantize_fp8_weights gives both). x is bf16 (comet quantizes it), or
        float8_e4m3fn with x_scales [M, ceil(H / 128)] float32 (fp8.quantize_fp8_rows); out
        and y are bf16. Such FP8 weights are for inference: under autograd (grad enabled and
        x or topk_weights requiring grad) they raise NotImplementedError. To train, pass the
        bf16 master weights instead (gate_up and down, no scales): comet makes their FP8
        copies, W for the forward and W^T for the backward (fp8.quantize_fp8_weights_
        transposed), again only when a weight or its version counter changed (torch.optim's
        in-place update; every call under torch.compile or CUDA-graph capture; an update the
        counter does not see needs refresh_fp8_weights), and runs the layer in FP8,
        training under autograd with the gradients in the masters' .grad (bf16) or their
        main_grad, inference otherwise."""
        if self.closed:
            raise RuntimeError("comet_moe.Moe: used after close() (or after its Comm was closed)")
        code = parse_impl(impl)
        # The pointers (alignment, out overlapping an input) are checked by the operator,
        # where the tensors are real also under torch.compile.
        scales = (gate_up_scale, gate_scale, up_scale, down_scale)
        if self.fp8 and all(s is None for s in scales) and x_scales is None and \
                _bf16(gate_up if gate_up is not None else gate if gate is not None else down):
            # bf16 master weights of an FP8 layer: comet quantizes them (see above).
            if gate_up is None or gate is not None or up is not None:
                raise ValueError("an FP8 layer given bf16 master weights takes gate and up in one tensor: pass "
                                 "gate_up [E_local, 2 * ffn_local, hidden] and down")
            check_forward_args(self._shape, self.experts_per_rank, self._device, x, topk_ids, topk_weights, gate_up,
                               None, None, down, out, ffn_local=self.ffn_local, tp_size=self.tp_size, pointers=False)
            if self.ffn_local % 128:
                raise ValueError(f"an FP8 layer with gate_up in one tensor needs ffn_local = {self.ffn_local} a "
                                 f"multiple of 128 (a 128 x 128 scale block must not hold gate and up rows)")
            from . import ops
            return ops.moe_forward_fp8_masters(self, code, x, topk_ids, topk_weights, gate_up, down, out,
                                               self._stream_arg(stream))
        check_forward_args(self._shape, self.experts_per_rank, self._device, x, topk_ids, topk_weights, gate_up,
                           gate, up, down, out, ffn_local=self.ffn_local, tp_size=self.tp_size, pointers=False,
                           fp8=self.fp8, scales=scales, x_scales=x_scales)
        stream = self._stream_arg(stream)
        from . import ops
        if self.fp8:
            return ops.moe_forward_fp8(self, code, x, x_scales, topk_ids, topk_weights, (gate_up, gate, up, down),
                                       scales, out, stream)
        return ops.moe_forward(self, code, x, topk_ids, topk_weights, (gate_up, gate, up, down), out, stream)

    __call__ = forward

    @staticmethod
    def _stream_arg(stream):
        """forward's stream argument as an int (None stays None)."""
        if stream is None:
            return None
        raw = stream.cuda_stream if hasattr(stream, "cuda_stream") else stream  # ctypes would truncate a wider int
        return check_int("stream", raw, 0, PTR_MAX, "a cudaStream_t: a torch.cuda.Stream or its .cuda_stream")

    def _quantize_both(self, w):
        """(q, scales, qt, scales_t): comet's quantizer on a master weight, both ways."""
        from .fp8 import quantize_fp8_weights_transposed
        return quantize_fp8_weights_transposed(w, bool(self.config.fp8_pow2_scales))

    def refresh_fp8_weights(self, weights=None) -> None:
        """Drop the FP8 copies kept of these bf16 master weights (None: of every master): the
        next forward makes them again. Call it after updating masters in a way their version
        counter does not see (through `.data`, by a fused optimizer's own kernels, as
        Megatron-LM's optimizers do); in-place updates through autograd's view (torch.optim)
        renew them by themselves."""
        if weights is None:
            self._fp8_cache.clear()
            return
        for w in weights:
            self._fp8_cache.pop(id(w), None)

    def _fp8_copies(self, gate_up, down):
        """(q, scales, qt, scales_t) of gate_up, then of down: each bf16 master weight's FP8
        copies for the forward and the backward, kept per master (a shared handle serves
        many layers) while it lives, made again only where its version counter moved
        (refresh_fp8_weights drops them). Made and not kept while torch.compile traces, while
        a CUDA graph is captured (each replay quantizes again: its weights may have changed)
        and under inference mode (its tensors cannot be saved for a later backward)."""
        import torch
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        fresh = torch.compiler.is_compiling() or capturing
        keep = not fresh and not torch.is_inference_mode_enabled()
        out = []
        for w in (gate_up, down):
            entry = None if fresh else self._fp8_cache.get(id(w))
            if entry is not None and entry[0]() is w and entry[1] == w._version:
                out.extend(entry[2])
                continue
            with torch.no_grad():
                copies = self._quantize_both(w.detach())
            if keep:
                cache, key = self._fp8_cache, id(w)
                cache[key] = (weakref.ref(w, lambda _, c=cache, k=key: c.pop(k, None)), w._version, copies)
            out.extend(copies)
        return tuple(out)

    # ---- the C calls of the custom operators (ops.py): tensors checked there, ints here ----

    def _stream(self, stream):
        if stream is not None:
            return stream
        import torch
        return torch.cuda.current_stream(self.comm.device_index).cuda_stream

    def _args(self, x, topk_ids, topk_weights, weights, y, impl, scales=None, x_scales=None):
        args = _capi.MoeArgsStruct()
        args.num_tokens = int(x.shape[0])
        args.x, args.topk_ids, args.topk_weights, args.y = _ptr(x), _ptr(topk_ids), _ptr(topk_weights), _ptr(y)
        args.weights.gate_up, args.weights.gate, args.weights.up, args.weights.down = map(_ptr, weights)
        args.impl = impl
        if scales is not None:  # an FP8 call
            sc = args.weight_scales
            sc.gate_up, sc.gate, sc.up, sc.down = map(_ptr, scales)
        args.x_scales = _ptr(x_scales)
        return args

    def _comet_forward(self, x, topk_ids, topk_weights, weights, y, impl, stream=None, scales=None, x_scales=None):
        """comet_moe_forward into y, on `stream` (None: torch's current stream); scales and
        x_scales for an FP8 layer (see forward)."""
        args = self._args(x, topk_ids, topk_weights, weights, y, impl, scales, x_scales)
        ptr = self._box.ptr
        with self.comm._on_device():
            st = self._lib.comet_moe_forward(ptr, ctypes.byref(args), ctypes.c_void_p(self._stream(stream)))
        check(st, "comet_moe_forward", lambda: _capi.text(self._lib.comet_moe_last_error(ptr)))

    def _saved_config(self):
        return _capi.MoeSavedConfigStruct(int(self.max_recv_rows), int(self.fp8_gate_up == "e4m3"))

    def _comet_saved_bytes(self) -> int:
        """comet_moe_saved_bytes for this layer's bound (a host call: no GPU work)."""
        nbytes = ctypes.c_size_t()
        cfg = self._saved_config()
        st = self._lib.comet_moe_saved_bytes(self._box.ptr, ctypes.byref(cfg), ctypes.byref(nbytes))
        check(st, "comet_moe_saved_bytes", lambda: _capi.text(self._lib.comet_last_create_error()))
        return int(nbytes.value)

    def _comet_saved_create_in(self, memory) -> int:
        """A saved state over `memory` (a uint8 tensor from torch's allocator, whose blocks
        start 512-byte aligned; comet needs 256): comet_moe_saved_create_in's handle."""
        handle = ctypes.c_void_p()
        cfg = self._saved_config()
        st = self._lib.comet_moe_saved_create_in(self._box.ptr, ctypes.byref(cfg), ctypes.c_void_p(memory.data_ptr()),
                                                 ctypes.c_size_t(memory.numel()), ctypes.byref(handle))
        check(st, "comet_moe_saved_create_in", lambda: _capi.text(self._lib.comet_last_create_error()))
        return handle.value

    def _comet_saved_destroy(self, handle) -> None:
        """comet_moe_saved_destroy: host memory only (the device memory is torch's); it
        may come after the layer's close()."""
        self._lib.comet_moe_saved_destroy(ctypes.c_void_p(handle))

    def _comet_forward_train(self, x, topk_ids, topk_weights, weights, y, saved, impl, scales=None):
        """comet_moe_forward_train into y and the saved state `saved`, on the current stream
        (scales: an FP8 layer's weights' scales)."""
        args = self._args(x, topk_ids, topk_weights, weights, y, impl, scales)
        ptr = self._box.ptr
        with self.comm._on_device():
            st = self._lib.comet_moe_forward_train(ptr, ctypes.byref(args), ctypes.c_void_p(saved),
                                                   ctypes.c_void_p(self._stream(None)))
        check(st, "comet_moe_forward_train", lambda: _capi.text(self._lib.comet_moe_last_error(ptr)))

    def _comet_backward(self, saved, dy, x, weights, dx, d_topk_weights, grads, accumulate, impl, weights_t=None,
                        weight_t_scales=None):
        """comet_moe_backward of the forward that filled `saved`: dx, d_topk_weights, and the
        weights' gradients written into `grads` (bf16) or added to them (fp32, accumulate),
        on the current stream. An FP8 layer's: weights_t and weight_t_scales, (gate_up,
        down) transposed in E4M3 and their scales."""
        b = _capi.MoeBackwardArgsStruct()
        b.saved = saved
        b.dy, b.x, b.dx, b.d_topk_weights = _ptr(dy), _ptr(x), _ptr(dx), _ptr(d_topk_weights)
        b.weights.gate_up, b.weights.gate, b.weights.up, b.weights.down = map(_ptr, weights)
        b.grads.gate_up, b.grads.gate, b.grads.up, b.grads.down = map(_ptr, grads)
        b.grads.mode = _capi.GRAD_ACCUMULATE_FP32 if accumulate else _capi.GRAD_WRITE_BF16
        b.impl = impl
        if weights_t is not None:
            b.weights_t.gate_up, b.weights_t.down = map(_ptr, weights_t)
            b.weight_t_scales.gate_up, b.weight_t_scales.down = map(_ptr, weight_t_scales)
        ptr = self._box.ptr
        with self.comm._on_device():
            st = self._lib.comet_moe_backward(ptr, ctypes.byref(b), ctypes.c_void_p(self._stream(None)))
        check(st, "comet_moe_backward", lambda: _capi.text(self._lib.comet_moe_last_error(ptr)))

    def close(self) -> None:
        """comet_moe_destroy (waits for the device). Collective: every rank closes the
        layer at the same point (the fused path's NCCL windows are deregistered together),
        before the communicator's close(); Comm.close() closes layers still open.
        Idempotent. Dropping the last reference closes it too, which is only safe where
        every rank drops it at the same point (not in a reference cycle, which the garbage
        collector breaks at a different time on each rank)."""
        if self.closed:
            return
        _LAYERS.pop(getattr(self, "_op_id", None), None)
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
