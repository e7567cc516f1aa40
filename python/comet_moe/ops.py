"""comet's calls as torch custom operators (torch.library): the one path Moe.forward takes
to comet under torch, eager and under torch.compile alike.

    comet_moe::forward        y = MoE(x), nothing saved (inference, or under no_grad)
    comet_moe::forward_out    the same, written into `out` (mutated)
    comet_moe::forward_fp8    an FP8 layer's: float8_e4m3fn weights with their block scales,
                              x bf16 or float8_e4m3fn with x_scales; y bf16
    comet_moe::forward_fp8_out  the same, written into `out` (mutated)
    comet_moe::quantize_fp8_weights, quantize_fp8_weights_transposed, quantize_fp8_rows
                              comet's quantizers (fp8.py checks their arguments first)
    comet_moe::forward_train  (y, saved): the training forward and the state its backward reads
    comet_moe::backward       (dx, d_topk_weights, d_gate_up, d_gate, d_up, d_down); with
                              main_grads given, the weight gradients are added to them
                              (mutated) and those four outputs are empty
    comet_moe::forward_train_fp8, backward_fp8
                              the same for an FP8 layer trained from bf16 master weights: the
                              forward takes the masters (unread: autograd routes their
                              gradients) and their FP8 copies W and W^T with scales, the
                              backward the W^T copies; gate_up in one tensor

forward_train's autograd formula (register_autograd) calls backward, so torch.compile
traces a training step through comet, forward and backward, with no graph break, and
eager runs the same operators. Each operator has a fake implementation (register_fake)
that gives its outputs' shapes and dtypes from its inputs' and the layer's config (the
saved state's size from comet_moe_saved_bytes, a host call): FakeTensorMode and
torch.compile trace them without running comet.

An operator names its layer by an int, the layer's _op_id in moe.py's table of open
layers: a compiled graph holds ints, not Python objects. The stream is torch's current
one (forward and forward_out take a raw cudaStream_t too, as a signed 64-bit int).

The saved state is a uint8 tensor from torch's allocator (comet_moe_saved_bytes of them)
with comet's handle over it (comet_moe_saved_create_in). The handle carries host state
from the forward to its backward (the routing's counts), which no tensor can, so it is
kept in a table under the tensor's address, where backward finds it. backward consumes
it: the handle is destroyed once the backward is enqueued, so a second backward through
the same graph (retain_graph=True) raises CometInvalidArgumentError. The tensor is a
saved tensor of forward_train's autograd node, which autograd (and a compiled backward)
frees as soon as that backward has run, so its memory goes back to torch's allocator then
(which hands it out again only after the work already enqueued on the stream), not when
the graph goes; with retain_graph=True it lives as long as the graph. A forward whose
backward never runs has its handle destroyed when the tensor goes.

With grad_accumulation="main_grad" the weights' fp32 main_grad tensors (Megatron-LM's
convention) are inputs of forward_train, unread there, so that its autograd formula can
hand them to backward, which adds the gradients into them; the weights then get no
gradient through autograd, except a placeholder where the weight carries Megatron's
`grad_added_to_main_grad` (set True by the forward; the placeholder is zeros where
`zero_out_wgrad` is set, uninitialised otherwise, as Megatron's hooks expect).
"""
import inspect
import weakref
from typing import List, Optional, Tuple

from . import _capi, fp8
from ._torch import torch
from .checks import check_pointers
from .errors import error_for
from .moe import layer_by_id

Tensor = torch.Tensor

_WEIGHTS = ("gate_up", "gate", "up", "down")
_MAIN_GRADS = tuple(f"{name}_main_grad" for name in _WEIGHTS)
# A placeholder gradient for a weight whose gradient went into its main_grad.
NO_PLACEHOLDER, EMPTY_PLACEHOLDER, ZERO_PLACEHOLDER = 0, 1, 2
_U64 = 2**64

# forward_train and backward keep host state in tables between calls, which a CUDA graph
# replay would skip: torch.compile's cudagraphs (mode="reduce-overhead") must leave them out.
_UNSAFE = getattr(torch._C.Tag, "cudagraph_unsafe", None)
_HOST_STATE = ({"tags": (_UNSAFE,)} if _UNSAFE is not None and
               "tags" in inspect.signature(torch.library.custom_op).parameters else {})


def has_address(t) -> bool:
    """Whether t.data_ptr() means something: not while torch.compile traces the caller,
    nor for a fake or meta tensor (the operators check the addresses when they run)."""
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    return not isinstance(t, FakeTensor) and t.device.type != "meta"


def _stream_i64(stream):
    """A cudaStream_t (0..2^64-1) as the signed 64-bit int an operator takes, and back."""
    return None if stream is None else (stream - _U64 if stream >= _U64 // 2 else stream)


def _stream_u64(stream):
    return None if stream is None else stream % _U64


# ---- inference ----

@torch.library.custom_op("comet_moe::forward", mutates_args=())
def forward(layer: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Optional[Tensor],
            gate: Optional[Tensor], up: Optional[Tensor], down: Tensor, impl: int, stream: Optional[int]) -> Tensor:
    """comet_moe_forward: y [M, H] bf16 for x [M, H]; nothing saved."""
    moe = layer_by_id(layer)
    check_pointers(x, topk_ids, topk_weights, gate_up, gate, up, down)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    moe._comet_forward(x, topk_ids, topk_weights, (gate_up, gate, up, down), y, impl, _stream_u64(stream))
    return y


@forward.register_fake
def _forward_fake(layer, x, topk_ids, topk_weights, gate_up, gate, up, down, impl, stream):
    return x.new_empty(x.shape)


@torch.library.custom_op("comet_moe::forward_out", mutates_args=("out",))
def forward_out(layer: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Optional[Tensor],
                gate: Optional[Tensor], up: Optional[Tensor], down: Tensor, impl: int, stream: Optional[int],
                out: Tensor) -> None:
    """comet_moe_forward into `out` [M, H] bf16, which no input may overlap."""
    moe = layer_by_id(layer)
    check_pointers(x, topk_ids, topk_weights, gate_up, gate, up, down, out)
    moe._comet_forward(x, topk_ids, topk_weights, (gate_up, gate, up, down), out, impl, _stream_u64(stream))


@forward_out.register_fake
def _forward_out_fake(layer, x, topk_ids, topk_weights, gate_up, gate, up, down, impl, stream, out):
    return None


# ---- block-scaled FP8 quantization (fp8.py's quantizers, their arguments checked there) ----

@torch.library.custom_op("comet_moe::quantize_fp8_weights", mutates_args=())
def quantize_fp8_weights(w: Tensor, pow2_scales: bool) -> Tuple[Tensor, Tensor]:
    """comet_quantize_fp8_weights: (q, scales) of w bf16 [..., rows, cols], 128 x 128 blocks."""
    return fp8.run_weights(w, pow2_scales, False)


@quantize_fp8_weights.register_fake
def _quantize_fp8_weights_fake(w, pow2_scales):
    return fp8.weights_outputs(w, False)


@torch.library.custom_op("comet_moe::quantize_fp8_weights_transposed", mutates_args=())
def quantize_fp8_weights_transposed(w: Tensor, pow2_scales: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """comet_quantize_fp8_weights_transposed: (q, scales, qt, scales_t), W and W^T."""
    return fp8.run_weights(w, pow2_scales, True)


@quantize_fp8_weights_transposed.register_fake
def _quantize_fp8_weights_transposed_fake(w, pow2_scales):
    return fp8.weights_outputs(w, True)


@torch.library.custom_op("comet_moe::quantize_fp8_rows", mutates_args=())
def quantize_fp8_rows(x: Tensor, pow2_scales: bool) -> Tuple[Tensor, Tensor]:
    """comet_quantize_fp8_rows: (q, scales) of x bf16 [..., cols], 1 x 128 blocks."""
    return fp8.run_rows(x, pow2_scales)


@quantize_fp8_rows.register_fake
def _quantize_fp8_rows_fake(x, pow2_scales):
    return fp8.rows_outputs(x)


# ---- inference in FP8 on FP8 weights (no autograd: they take no gradient) ----

@torch.library.custom_op("comet_moe::forward_fp8", mutates_args=())
def forward_fp8(layer: int, x: Tensor, x_scales: Optional[Tensor], topk_ids: Tensor, topk_weights: Tensor,
                gate_up: Optional[Tensor], gate: Optional[Tensor], up: Optional[Tensor], down: Tensor,
                gate_up_scale: Optional[Tensor], gate_scale: Optional[Tensor], up_scale: Optional[Tensor],
                down_scale: Tensor, impl: int, stream: Optional[int]) -> Tensor:
    """comet_moe_forward of an FP8 layer: y [M, H] bf16 for x [M, H] (bf16, or float8_e4m3fn
    with x_scales); the weights float8_e4m3fn, each with its float32 block scales."""
    moe = layer_by_id(layer)
    scales = (gate_up_scale, gate_scale, up_scale, down_scale)
    check_pointers(x, topk_ids, topk_weights, gate_up, gate, up, down, scales=scales, x_scales=x_scales)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    moe._comet_forward(x, topk_ids, topk_weights, (gate_up, gate, up, down), y, impl, _stream_u64(stream), scales,
                       x_scales)
    return y


@forward_fp8.register_fake
def _forward_fp8_fake(layer, x, x_scales, topk_ids, topk_weights, gate_up, gate, up, down, gate_up_scale, gate_scale,
                      up_scale, down_scale, impl, stream):
    return x.new_empty(x.shape, dtype=torch.bfloat16)


@torch.library.custom_op("comet_moe::forward_fp8_out", mutates_args=("out",))
def forward_fp8_out(layer: int, x: Tensor, x_scales: Optional[Tensor], topk_ids: Tensor, topk_weights: Tensor,
                    gate_up: Optional[Tensor], gate: Optional[Tensor], up: Optional[Tensor], down: Tensor,
                    gate_up_scale: Optional[Tensor], gate_scale: Optional[Tensor], up_scale: Optional[Tensor],
                    down_scale: Tensor, impl: int, stream: Optional[int], out: Tensor) -> None:
    """forward_fp8 into `out` [M, H] bf16, which no input may overlap."""
    moe = layer_by_id(layer)
    scales = (gate_up_scale, gate_scale, up_scale, down_scale)
    check_pointers(x, topk_ids, topk_weights, gate_up, gate, up, down, out, scales=scales, x_scales=x_scales)
    moe._comet_forward(x, topk_ids, topk_weights, (gate_up, gate, up, down), out, impl, _stream_u64(stream), scales,
                       x_scales)


@forward_fp8_out.register_fake
def _forward_fp8_out_fake(layer, x, x_scales, topk_ids, topk_weights, gate_up, gate, up, down, gate_up_scale,
                          gate_scale, up_scale, down_scale, impl, stream, out):
    return None


# ---- training: the saved states' table ----

_SAVED = {}  # (device, address) -> (token, handle, destroy) of each saved state not consumed yet


def _saved_key(saved: Tensor):
    return str(saved.device), saved.data_ptr()


def _keep_saved(saved: Tensor, handle, destroy) -> None:
    key, token = _saved_key(saved), object()  # the token tells this state from a later one at the address
    _SAVED[key] = (token, handle, destroy)
    weakref.finalize(saved, _drop_saved, key, token)


def _drop_saved(key, token) -> None:
    """The tensor of a saved state went (its backward never ran, or already did)."""
    entry = _SAVED.get(key)
    if entry is not None and entry[0] is token:
        del _SAVED[key]
        entry[2](entry[1])


def _consume_saved(saved: Tensor):
    """The (key, handle, destroy) of the state `saved` holds, or CometInvalidArgumentError."""
    key = _saved_key(saved)
    entry = _SAVED.get(key)
    if entry is None:
        raise error_for(_capi.INVALID_ARGUMENT, "comet_moe_backward", "args.saved holds no forward: a backward "
                        "consumes it (backward through this graph once, or run the forward again)")
    return key, entry[1], entry[2]


def _forward_train_into_saved(moe, x, run):
    """A training forward: a saved state (torch's memory, comet's handle over it) and y
    [M, H] bf16, filled by run(y, handle); the handle kept for the backward, or destroyed
    when run raises. Returns (y, saved)."""
    saved = torch.empty(moe._comet_saved_bytes(), dtype=torch.uint8, device=x.device)
    handle = moe._comet_saved_create_in(saved)
    try:
        y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        run(y, handle)
    except BaseException:
        moe._comet_saved_destroy(handle)
        raise
    _keep_saved(saved, handle, moe._comet_saved_destroy)
    return y, saved


# ---- training: the operators ----

@torch.library.custom_op("comet_moe::forward_train", mutates_args=(), **_HOST_STATE)
def forward_train(layer: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Optional[Tensor],
                  gate: Optional[Tensor], up: Optional[Tensor], down: Tensor, gate_up_main_grad: Optional[Tensor],
                  gate_main_grad: Optional[Tensor], up_main_grad: Optional[Tensor], down_main_grad: Optional[Tensor],
                  impl: int, placeholders: List[int]) -> Tuple[Tensor, Tensor]:
    """comet_moe_forward_train: (y [M, H] bf16, the saved state [comet_moe_saved_bytes] uint8).
    The main_grads and placeholders are for the autograd formula (see the module's note)."""
    moe = layer_by_id(layer)
    check_pointers(x, topk_ids, topk_weights, gate_up, gate, up, down)
    return _forward_train_into_saved(moe, x, lambda y, handle: moe._comet_forward_train(
        x, topk_ids, topk_weights, (gate_up, gate, up, down), y, handle, impl))


@forward_train.register_fake
def _forward_train_fake(layer, x, topk_ids, topk_weights, gate_up, gate, up, down, gate_up_main_grad,
                        gate_main_grad, up_main_grad, down_main_grad, impl, placeholders):
    return x.new_empty(x.shape), x.new_empty((layer_by_id(layer)._comet_saved_bytes(),), dtype=torch.uint8)


@torch.library.custom_op("comet_moe::backward", mutates_args=_MAIN_GRADS, **_HOST_STATE)
def backward(layer: int, saved: Tensor, dy: Tensor, x: Optional[Tensor], gate_up: Optional[Tensor],
             gate: Optional[Tensor], up: Optional[Tensor], down: Tensor, gate_up_main_grad: Optional[Tensor],
             gate_main_grad: Optional[Tensor], up_main_grad: Optional[Tensor], down_main_grad: Optional[Tensor],
             impl: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """comet_moe_backward of the forward that filled `saved` (which it consumes): dx [M, H]
    bf16, d_topk_weights [M, top_k] fp32 and the weights' bf16 gradients (empty for a
    weight not given); with main_grads given (one per weight), the gradients are added to
    them instead and the four are empty. dy [M, H] bf16, contiguous; x the forward's
    where the layer's config resends x (else None)."""
    moe = layer_by_id(layer)
    key, handle, destroy = _consume_saved(saved)
    if dy.data_ptr() % 16:  # a view that starts inside a row: comet moves rows 16 bytes at a time
        dy = dy.clone()
    weights = (gate_up, gate, up, down)
    main_grads = (gate_up_main_grad, gate_main_grad, up_main_grad, down_main_grad)
    accumulate = any(g is not None for g in main_grads)
    m, k = dy.shape[0], int(moe.config.top_k)
    dx = torch.empty(dy.shape, dtype=torch.bfloat16, device=dy.device)
    d_topk_weights = torch.empty((m, k), dtype=torch.float32, device=dy.device)
    grads = main_grads if accumulate else tuple(None if w is None else torch.empty_like(w) for w in weights)
    moe._comet_backward(handle, dy, x, weights, dx, d_topk_weights, grads, accumulate, impl)
    # Consumed (after the call: one comet refused stays filled for another try).
    _SAVED.pop(key, None)
    destroy(handle)
    outs = tuple(dy.new_empty((0,)) if accumulate or g is None else g for g in grads)  # outputs alias nothing
    return (dx, d_topk_weights) + outs


@backward.register_fake
def _backward_fake(layer, saved, dy, x, gate_up, gate, up, down, gate_up_main_grad, gate_main_grad, up_main_grad,
                   down_main_grad, impl):
    k = int(layer_by_id(layer).config.top_k)
    accumulate = any(g is not None for g in (gate_up_main_grad, gate_main_grad, up_main_grad, down_main_grad))
    outs = tuple(dy.new_empty((0,)) if accumulate or w is None else w.new_empty(w.shape)
                 for w in (gate_up, gate, up, down))
    return (dy.new_empty(dy.shape), dy.new_empty((dy.shape[0], k), dtype=torch.float32)) + outs


@torch.library.custom_op("comet_moe::forward_train_fp8", mutates_args=(), **_HOST_STATE)
def forward_train_fp8(layer: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
                      gate_up_q: Tensor, gate_up_scale: Tensor, gate_up_t: Tensor, gate_up_t_scale: Tensor,
                      down_q: Tensor, down_scale: Tensor, down_t: Tensor, down_t_scale: Tensor,
                      gate_up_main_grad: Optional[Tensor], down_main_grad: Optional[Tensor], impl: int,
                      placeholders: List[int]) -> Tuple[Tensor, Tensor]:
    """comet_moe_forward_train of an FP8 layer on the FP8 copies (gate_up_q, down_q and their
    scales): (y [M, H] bf16, the saved state). gate_up and down, the bf16 masters, and the
    W^T copies are unread here: the autograd formula takes them."""
    moe = layer_by_id(layer)
    check_pointers(x, topk_ids, topk_weights, gate_up_q, None, None, down_q,
                   scales=(gate_up_scale, None, None, down_scale))
    return _forward_train_into_saved(moe, x, lambda y, handle: moe._comet_forward_train(
        x, topk_ids, topk_weights, (gate_up_q, None, None, down_q), y, handle, impl,
        (gate_up_scale, None, None, down_scale)))


@forward_train_fp8.register_fake
def _forward_train_fp8_fake(layer, x, topk_ids, topk_weights, gate_up, down, gate_up_q, gate_up_scale, gate_up_t,
                            gate_up_t_scale, down_q, down_scale, down_t, down_t_scale, gate_up_main_grad,
                            down_main_grad, impl, placeholders):
    return (x.new_empty(x.shape, dtype=torch.bfloat16),
            x.new_empty((layer_by_id(layer)._comet_saved_bytes(),), dtype=torch.uint8))


@torch.library.custom_op("comet_moe::backward_fp8", mutates_args=("gate_up_main_grad", "down_main_grad"),
                         **_HOST_STATE)
def backward_fp8(layer: int, saved: Tensor, dy: Tensor, gate_up_t: Tensor, gate_up_t_scale: Tensor, down_t: Tensor,
                 down_t_scale: Tensor, gate_up_main_grad: Optional[Tensor], down_main_grad: Optional[Tensor],
                 impl: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """comet_moe_backward of an FP8 layer's training forward (consuming `saved`): dx,
    d_topk_weights and the masters' bf16 gradients d_gate_up [E, 2F, H] and d_down [E, H, F]
    (empty where main_grads are given: the gradients are added to them instead). The data
    gradients read W^T's FP8 copies."""
    moe = layer_by_id(layer)
    key, handle, destroy = _consume_saved(saved)
    if dy.data_ptr() % 16:
        dy = dy.clone()
    accumulate = gate_up_main_grad is not None or down_main_grad is not None
    m, k = dy.shape[0], int(moe.config.top_k)
    dx = torch.empty(dy.shape, dtype=torch.bfloat16, device=dy.device)
    d_topk_weights = torch.empty((m, k), dtype=torch.float32, device=dy.device)
    e, h, f2 = gate_up_t.shape  # W13^T [E, H, 2F]: the master [E, 2F, H]
    if accumulate:
        grads = (gate_up_main_grad, down_main_grad)
    else:
        grads = (torch.empty((e, f2, h), dtype=torch.bfloat16, device=dy.device),
                 torch.empty((e, h, f2 // 2), dtype=torch.bfloat16, device=dy.device))
    moe._comet_backward(handle, dy, None, (None,) * 4, dx, d_topk_weights, (grads[0], None, None, grads[1]),
                        accumulate, impl, (gate_up_t, down_t), (gate_up_t_scale, down_t_scale))
    _SAVED.pop(key, None)
    destroy(handle)
    outs = tuple(dy.new_empty((0,)) if accumulate else g for g in grads)
    return (dx, d_topk_weights) + outs


@backward_fp8.register_fake
def _backward_fp8_fake(layer, saved, dy, gate_up_t, gate_up_t_scale, down_t, down_t_scale, gate_up_main_grad,
                       down_main_grad, impl):
    k = int(layer_by_id(layer).config.top_k)
    e, h, f2 = gate_up_t.shape
    if gate_up_main_grad is not None or down_main_grad is not None:
        outs = (dy.new_empty((0,)), dy.new_empty((0,)))
    else:
        outs = (dy.new_empty((e, f2, h), dtype=torch.bfloat16), dy.new_empty((e, h, f2 // 2), dtype=torch.bfloat16))
    return (dy.new_empty(dy.shape, dtype=torch.bfloat16), dy.new_empty((dy.shape[0], k), dtype=torch.float32)) + outs


# ---- forward_train's autograd formula ----

def _placeholder_grads(weights, kinds):
    """The gradients autograd hands the weights whose gradients went into their main_grad:
    None, or the placeholder Megatron's hooks expect (zeros, or uninitialised)."""
    return [None if w is None or kind == NO_PLACEHOLDER else
            torch.zeros_like(w) if kind == ZERO_PLACEHOLDER else torch.empty_like(w)
            for w, kind in zip(weights, kinds)]


def _setup_context(ctx, inputs, output):
    layer, x, _, _, gate_up, gate, up, down, *main_grads, impl, placeholders = inputs
    ctx.layer, ctx.impl, ctx.placeholders = layer, impl, list(placeholders)
    # Attributes, not saved tensors: other calls add to the same main_grads between this
    # forward and its backward (micro-batches), which autograd's version check would refuse.
    ctx.main_grads = tuple(main_grads)
    # Where the config resends x, the backward sends the forward's x again: autograd keeps
    # it (and refuses a backward after it was changed in place).
    resend = bool(layer_by_id(layer).config.resend_x)
    ctx.save_for_backward(output[1], gate_up, gate, up, down, x if resend else None)
    _no_zero_grads(ctx)


def _no_zero_grads(ctx):
    """The saved state (the second output) never gets a gradient: left to autograd, a
    tensor of zeros its size (hundreds of MB) is written for it before every backward
    (0.3 ms on mixtral). Undefined gradients come as None instead. y's is always defined:
    the saved state is not handed out, so the backward runs only for y's gradient."""
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, dy, _d_saved):
    saved, gate_up, gate, up, down, x = ctx.saved_tensors
    dy = dy.to(torch.bfloat16).contiguous()
    dx, d_topk_weights, *d_weights = torch.ops.comet_moe.backward(ctx.layer, saved, dy, x, gate_up, gate, up, down,
                                                                  *ctx.main_grads, ctx.impl)
    weights = (gate_up, gate, up, down)
    if any(g is not None for g in ctx.main_grads):
        d_weights = _placeholder_grads(weights, ctx.placeholders)
    else:
        d_weights = [None if w is None else g for w, g in zip(weights, d_weights)]
    need = ctx.needs_input_grad
    return ((None, dx if need[1] else None, None, d_topk_weights if need[3] else None) +
            tuple(g if need[4 + i] else None for i, g in enumerate(d_weights)) + (None,) * 6)


forward_train.register_autograd(_backward_formula, setup_context=_setup_context)


def _setup_context_fp8(ctx, inputs, output):
    (layer, x, _, _, gate_up, down, _, _, gate_up_t, gate_up_t_scale, _, _, down_t, down_t_scale,
     gate_up_main_grad, down_main_grad, impl, placeholders) = inputs
    ctx.layer, ctx.impl, ctx.placeholders = layer, impl, list(placeholders)
    ctx.main_grads = (gate_up_main_grad, down_main_grad)  # attributes, as forward_train's
    ctx.save_for_backward(output[1], gate_up_t, gate_up_t_scale, down_t, down_t_scale, gate_up, down)
    _no_zero_grads(ctx)


def _backward_formula_fp8(ctx, dy, _d_saved):
    saved, gate_up_t, gate_up_t_scale, down_t, down_t_scale, gate_up, down = ctx.saved_tensors
    dy = dy.to(torch.bfloat16).contiguous()
    dx, d_topk_weights, d_gate_up, d_down = torch.ops.comet_moe.backward_fp8(
        ctx.layer, saved, dy, gate_up_t, gate_up_t_scale, down_t, down_t_scale, *ctx.main_grads, ctx.impl)
    if any(g is not None for g in ctx.main_grads):
        d_gate_up, d_down = _placeholder_grads((gate_up, down), ctx.placeholders)
    need = ctx.needs_input_grad
    return ((None, dx if need[1] else None, None, d_topk_weights if need[3] else None,
             d_gate_up if need[4] else None, d_down if need[5] else None) + (None,) * 12)


forward_train_fp8.register_autograd(_backward_formula_fp8, setup_context=_setup_context_fp8)


# ---- what Moe.forward calls ----

def _records_grad(*tensors) -> bool:
    """Whether autograd records this call: grad enabled and an input requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _main_grads(moe, weights):
    """(main_grads, placeholders, the weights whose grad_added_to_main_grad to set) for
    forward_train: Nones unless the layer accumulates into main_grad, where every weight
    given must carry a contiguous fp32 main_grad of its shape (ValueError)."""
    if moe.grad_accumulation != "main_grad":
        return (None,) * 4, [NO_PLACEHOLDER] * 4, ()
    main_grads, placeholders, flagged = [], [], []
    for name, w in zip(_WEIGHTS, weights):
        if w is None:
            main_grads.append(None)
            placeholders.append(NO_PLACEHOLDER)
            continue
        g = getattr(w, "main_grad", None)
        if g is None:
            raise ValueError(f"grad_accumulation='main_grad', but {name} (shape {tuple(w.shape)}) has no main_grad: "
                             f"attach an fp32 main_grad to every expert weight")
        if g.dtype != torch.float32 or g.shape != w.shape or not g.is_contiguous() or g.device != w.device:
            raise ValueError(f"{name}.main_grad: expected a contiguous float32 tensor of shape {tuple(w.shape)} on "
                             f"{w.device}, got {g.dtype} {tuple(g.shape)} on {g.device}")
        main_grads.append(g)
        if hasattr(w, "grad_added_to_main_grad"):
            placeholders.append(ZERO_PLACEHOLDER if getattr(w, "zero_out_wgrad", False) else EMPTY_PLACEHOLDER)
            flagged.append(w)
        else:
            placeholders.append(NO_PLACEHOLDER)
    return tuple(main_grads), placeholders, flagged


def moe_forward_fp8(moe, impl: int, x, x_scales, topk_ids, topk_weights, weights, scales, out, stream):
    """Moe.forward of an FP8 layer after its checks: the inference forward (into `out` when
    given, on `stream` when given); under autograd, NotImplementedError before anything
    runs."""
    if _records_grad(x, topk_weights, *weights, *scales):
        raise NotImplementedError(
            "comet_moe: training in FP8 is not built for FP8 weights given with their scales (they have no "
            "gradient to take): call the layer under torch.no_grad() or torch.inference_mode(), or pass the bf16 "
            "master weights (gate_up and down, no scales), which an FP8 layer quantizes and trains in FP8")
    args = (moe._op_id, x, x_scales, topk_ids, topk_weights, *weights, *scales, impl, _stream_i64(stream))
    if out is None:
        return torch.ops.comet_moe.forward_fp8(*args)
    torch.ops.comet_moe.forward_fp8_out(*args, out)
    return out


def moe_forward_fp8_masters(moe, impl: int, x, topk_ids, topk_weights, gate_up, down, out, stream):
    """Moe.forward of an FP8 layer given bf16 master weights (gate_up and down), after its
    checks: their FP8 copies (cached, Moe._fp8_copies), then the training forward under
    autograd, else the inference forward."""
    copies = moe._fp8_copies(gate_up, down)
    gu_q, gu_s, gu_qt, gu_st, dn_q, dn_s, dn_qt, dn_st = copies
    if not _records_grad(x, topk_weights, gate_up, down):
        return moe_forward_fp8(moe, impl, x, None, topk_ids, topk_weights, (gu_q, None, None, dn_q),
                               (gu_s, None, None, dn_s), out, stream)
    if out is not None or stream is not None:
        raise ValueError("out and stream are not taken under autograd (a training forward allocates y "
                         "and runs on the current stream); call it under torch.no_grad() to pass them")
    main_grads, placeholders, flagged = _main_grads(moe, (gate_up, None, None, down))
    y, _ = torch.ops.comet_moe.forward_train_fp8(moe._op_id, x, topk_ids, topk_weights, gate_up, down, *copies,
                                                 main_grads[0], main_grads[3], impl,
                                                 [placeholders[0], placeholders[3]])
    for w in flagged:
        w.grad_added_to_main_grad = True
    return y


def moe_forward(moe, impl: int, x, topk_ids, topk_weights, weights, out, stream):
    """Moe.forward after its checks: the training forward under autograd, else the
    inference forward (into `out` when given, on `stream` when given)."""
    if _records_grad(x, topk_weights, *weights):
        if out is not None or stream is not None:
            raise ValueError("out and stream are not taken under autograd (a training forward allocates y "
                             "and runs on the current stream); call it under torch.no_grad() to pass them")
        main_grads, placeholders, flagged = _main_grads(moe, weights)
        y, _ = torch.ops.comet_moe.forward_train(moe._op_id, x, topk_ids, topk_weights, *weights, *main_grads, impl,
                                                 placeholders)
        for w in flagged:  # Megatron's hooks then leave the placeholder out of main_grad
            w.grad_added_to_main_grad = True
        return y
    if out is None:
        return torch.ops.comet_moe.forward(moe._op_id, x, topk_ids, topk_weights, *weights, impl, _stream_i64(stream))
    torch.ops.comet_moe.forward_out(moe._op_id, x, topk_ids, topk_weights, *weights, impl, _stream_i64(stream), out)
    return out
