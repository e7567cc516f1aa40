"""test_compile_cpu.py - comet's custom operators (comet_moe/ops.py) on the CPU: their
schemas, torch.library.opcheck, their fake implementations under FakeTensorMode, the
saved states' lifetime and the backward's refusals, and torch.compile(fullgraph=True) of
a training step with CometSparseMoeBlock against eager, bit for bit. comet's own C calls
are computed on the CPU by standin.CpuMoe (what comet computes, in float32); everything
between the model and those calls is the package's code. The same checks against the
real kernels are in gpu_compile.py. Every test here needs torch and skips without it.
"""
from __future__ import annotations

import gc
import shutil

import comet_moe
from helpers import check, check_eq, need_torch, note, raises, skip

H, FFN, E, TOP_K, MAX_TOKENS = 64, 64, 4, 2, 32


def setup(grad_accumulation="grad", **changes):
    """(torch, ops, a CpuMoe layer of the test shape)."""
    torch = need_torch()
    from comet_moe import ops
    from standin import CpuMoe
    cfg = comet_moe.MoeConfig(hidden=H, ffn=FFN, num_experts=E, top_k=TOP_K, max_tokens=MAX_TOKENS, **changes)
    return torch, ops, CpuMoe(torch, cfg, grad_accumulation=grad_accumulation)


def inputs(torch, m, seed=0, split=False):
    """x, topk_ids, topk_weights, (gate_up, gate, up, down) for m tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)]).to(torch.int32).reshape(m, TOP_K)
    w = torch.rand(m, TOP_K, generator=g) + 0.1
    gate_up = (torch.randn(E, 2 * FFN, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, FFN, generator=g) / FFN ** 0.5).to(torch.bfloat16)
    weights = (None, gate_up[:, :FFN].contiguous(), gate_up[:, FFN:].contiguous(), down) if split else \
        (gate_up, None, None, down)
    return x, ids, w, weights


def test_ops_schemas_declare_what_they_mutate():
    torch, ops, moe = setup()
    schemas = {name: getattr(torch.ops.comet_moe, name).default._schema
               for name in ("forward", "forward_out", "forward_train", "backward", "forward_fp8", "forward_fp8_out",
                            "forward_train_fp8", "backward_fp8", "quantize_fp8_weights",
                            "quantize_fp8_weights_transposed", "quantize_fp8_rows")}
    mutated = {name: sorted(a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write)
               for name, s in schemas.items()}
    check_eq(mutated, {"forward": [], "forward_out": ["out"], "forward_train": [],
                       "backward": ["down_main_grad", "gate_main_grad", "gate_up_main_grad", "up_main_grad"],
                       "forward_fp8": [], "forward_fp8_out": ["out"], "forward_train_fp8": [],
                       "backward_fp8": ["down_main_grad", "gate_up_main_grad"], "quantize_fp8_weights": [],
                       "quantize_fp8_weights_transposed": [], "quantize_fp8_rows": []},
             "mutated arguments")
    check_eq([str(r.type) for r in schemas["forward_train"].returns], ["Tensor", "Tensor"], "forward_train: y, saved")
    check_eq(len(schemas["backward"].returns), 6, "backward: dx, d_topk_weights and four weight gradients")
    check(all(r.alias_info is None for s in schemas.values() for r in s.returns), "a return aliases an input")
    unsafe = getattr(torch._C.Tag, "cudagraph_unsafe", None)
    if unsafe is not None and ops._HOST_STATE:
        for name in ("forward_train", "backward", "forward_train_fp8", "backward_fp8"):
            check(unsafe in getattr(torch.ops.comet_moe, name).default.tags, f"{name} is not marked cudagraph_unsafe")
        check(unsafe not in torch.ops.comet_moe.forward.default.tags, "forward (capturable) marked cudagraph_unsafe")
    for name, s in schemas.items():
        note(f"{s}")
    moe.close()


def test_opcheck_forward_operators():
    """torch.library.opcheck (schema, autograd registration, fake against real, AOT
    dispatch with dynamic shapes) of forward, forward_out and forward_train, on gate_up
    and on gate and up apart, and forward_train with main_grads. backward is not opchecked:
    it consumes its saved state, and opcheck calls an operator several times on the same
    arguments; test_backward_fake_matches_real and the compiled training steps cover it."""
    torch, ops, moe = setup()
    for split in (False, True):
        x, ids, w, weights = inputs(torch, 6, split=split)
        args = (moe._op_id, x, ids, w, *weights, 0, None)
        for op, extra in ((torch.ops.comet_moe.forward.default, ()),
                          (torch.ops.comet_moe.forward_out.default, (torch.empty(6, H, dtype=torch.bfloat16),))):
            result = torch.library.opcheck(op, args + extra)
            check(all(v == "SUCCESS" for v in result.values()), f"{op} (split {split}): {result}")
        grad = [t.requires_grad_(True) if t is not None else None for t in (x, w) + weights]
        main_grads = tuple(None if t is None else torch.zeros(t.shape) for t in weights)
        for mg in ((None,) * 4, main_grads):
            targs = (moe._op_id, grad[0], ids, grad[1], *grad[2:], *mg, 0, [0, 0, 0, 0])
            result = torch.library.opcheck(torch.ops.comet_moe.forward_train.default, targs)
            check(all(v == "SUCCESS" for v in result.values()), f"forward_train (split {split}): {result}")
    note(f"opcheck: {sorted(result)} for forward, forward_out and forward_train")
    moe.close()


OPCHECK_WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_fp8_forward_operators():
    """opcheck of forward_fp8 and forward_fp8_out (an FP8 layer's inference forward): gate_up
    and gate and up apart, x in bf16 and in FP8 with its scales; their result is the
    stand-in's bf16 forward on the dequantized weights (pow2 scales: exact in bf16).
    opcheck's test_schema is left out: torch's SchemaCheckMode compares the inputs before
    and after with allclose, which has no float8 kernel; the bytes of every input are
    compared here instead, and the schemas' mutations by test_ops_schemas_declare_what_they_mutate."""
    torch, ops, moe = setup(dtype="fp8")
    _, _, bf16_moe = setup()
    from comet_moe import dequantize_fp8
    from fp8_reference import quantize_rows, quantize_weights
    for split in (False, True):
        x, ids, w, weights = inputs(torch, 6, split=split)
        q = [None if t is None else quantize_weights(torch, t, pow2=True) for t in weights]
        fp8 = tuple(None if t is None else t[0] for t in q)
        scales = tuple(None if t is None else t[1] for t in q)
        xq, xs = quantize_rows(torch, x, pow2=True)
        for x_in, x_scales in ((x, None), (xq, xs)):
            args = (moe._op_id, x_in, x_scales, ids, w, *fp8, *scales, 0, None)
            for op, extra in ((torch.ops.comet_moe.forward_fp8.default, ()),
                              (torch.ops.comet_moe.forward_fp8_out.default,
                               (torch.empty(6, H, dtype=torch.bfloat16),))):
                before = [a.view(torch.uint8).clone() for a in args if isinstance(a, torch.Tensor)]
                result = torch.library.opcheck(op, args + extra, test_utils=OPCHECK_WITHOUT_SCHEMA)
                check(all(v == "SUCCESS" for v in result.values()), f"{op} (split {split}): {result}")
                after = [a.view(torch.uint8) for a in args if isinstance(a, torch.Tensor)]
                check(all(torch.equal(b, a) for b, a in zip(before, after)), f"{op} changed an input")
            y = torch.ops.comet_moe.forward_fp8(*args)
            deq = tuple(None if t is None else dequantize_fp8(*t, dtype=torch.bfloat16) for t in q)
            x_ref = x if x_scales is None else dequantize_fp8(xq, xs, dtype=torch.bfloat16)
            want = torch.ops.comet_moe.forward(bf16_moe._op_id, x_ref, ids, w, *deq, 0, None)
            check(torch.equal(y, want), f"split {split}, x FP8 {x_scales is not None}: y differs from the bf16 "
                  f"forward on the dequantized weights")
    note(f"opcheck: {sorted(result)} for forward_fp8 and forward_fp8_out")
    moe.close()
    bf16_moe.close()


def test_fp8_training_from_masters_through_the_operators():
    """An FP8 layer given bf16 master weights trains through forward_train_fp8 and
    backward_fp8: y and every gradient equal the bf16 layer's on the same (dequantized)
    weights bit for bit (the stand-in computes both from the same float32 values; power-of-
    two scales make the dequantized weights bf16 values); each master is quantized once per
    version (an in-place update makes its copies again, micro-batches do not); main_grad
    accumulation adds the same gradients; opcheck of forward_train_fp8."""
    torch = need_torch()
    from comet_moe import dequantize_fp8
    from standin import CpuMoe
    from fp8_reference import quantize_weights
    F8, bf = 128, torch.bfloat16  # FP8 with gate_up in one tensor: ffn a multiple of 128

    def config(**changes):
        return comet_moe.MoeConfig(hidden=H, ffn=F8, num_experts=E, top_k=TOP_K, max_tokens=MAX_TOKENS, **changes)

    m8, m16 = CpuMoe(torch, config(dtype="fp8", fp8_pow2_scales=1)), CpuMoe(torch, config())
    mg = CpuMoe(torch, config(dtype="fp8", fp8_pow2_scales=1), grad_accumulation="main_grad")
    g = torch.Generator().manual_seed(5)
    on_grid = lambda w: dequantize_fp8(*quantize_weights(torch, w, pow2=True), dtype=bf)  # noqa: E731
    gate_up = on_grid((torch.randn(E, 2 * F8, H, generator=g) / H ** 0.5).to(bf))
    down = on_grid((torch.randn(E, H, F8, generator=g) / F8 ** 0.5).to(bf))
    x, ids, w, _ = inputs(torch, 9, seed=6)
    dy = torch.randn(9, H, generator=g).to(bf)

    def step(layer):
        gu, dn = torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = layer(xi, ids, wi, gate_up=gu, down=dn)
        y.backward(dy)
        return (y.detach(), xi.grad.clone(), wi.grad.clone(), gu.grad.clone(), dn.grad.clone()), (gu, dn)

    (r8, (gu, dn)), (r16, _) = step(m8), step(m16)
    for name, a, b in zip(("y", "dx", "d topk_weights", "d gate_up", "d down"), r8, r16):
        check(a is not None and torch.equal(a, b), f"{name}: the FP8 layer's differs from the bf16 layer's")
    check_eq([c[0] for c in m8.calls], ["quantize", "quantize", "forward_train", "backward"],
             "each master quantized once, then the training forward and its backward")
    m8.calls.clear()
    with torch.no_grad():
        m8(x, ids, w, gate_up=gu, down=dn)
        check_eq([c[0] for c in m8.calls], ["forward"], "unchanged masters: their copies kept")
        gu.add_(1.0)
        m8.calls.clear()
        m8(x, ids, w, gate_up=gu, down=dn)
    check_eq([c[0] for c in m8.calls], ["quantize", "forward"], "gate_up updated in place: its copies made again")
    # Through .data the version counter does not move (Megatron's optimizers write so):
    # the copies stay until refresh_fp8_weights drops them.
    m8.calls.clear()
    with torch.no_grad():
        gu.data.add_(1.0)
        m8(x, ids, w, gate_up=gu, down=dn)
        check_eq([c[0] for c in m8.calls], ["forward"], "an update through .data is not seen")
        m8.refresh_fp8_weights((gu,))
        m8(x, ids, w, gate_up=gu, down=dn)
    check_eq([c[0] for c in m8.calls], ["forward", "quantize", "forward"], "refresh_fp8_weights: gate_up's again")
    # Under inference mode a changed master is quantized and not kept (inference tensors
    # cannot be saved for a backward): the training step after it makes its own.
    with torch.no_grad():
        gu.add_(1.0)
    m8.calls.clear()
    with torch.inference_mode():
        m8(x, ids, w, gate_up=gu, down=dn)
    xi = x.clone().requires_grad_(True)
    m8(xi, ids, w, gate_up=gu, down=dn).backward(dy)
    check_eq([c[0] for c in m8.calls], ["quantize", "forward", "quantize", "forward_train", "backward"],
             "copies made under inference mode are not kept")
    # main_grad: the gradients added in float32 to a known start.
    gu_m, dn_m = torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())
    gu_m.main_grad, dn_m.main_grad = torch.full(gate_up.shape, 0.5), torch.full(down.shape, 0.5)
    mg(x.clone().requires_grad_(True), ids, w.clone().requires_grad_(True), gate_up=gu_m, down=dn_m).backward(dy)
    for name, acc, grad in (("gate_up", gu_m.main_grad, r8[3]), ("down", dn_m.main_grad, r8[4])):
        err = ((acc - 0.5 - grad.float()).abs() - 2.0 ** -8 * grad.float().abs() - 2.0 ** -24).max().item()
        check(err <= 0, f"{name}.main_grad: the gradient added differs from .grad past bf16's rounding")
    check(gu_m.grad is None and dn_m.grad is None, "main_grad accumulation left a .grad")
    # opcheck (its schema part left out: float8 inputs have no allclose kernel).
    copies = m8._quantize_both(gate_up) + m8._quantize_both(down)
    args = (m8._op_id, x, ids, w, gate_up, down, *copies, None, None, 0, [0, 0])
    result = torch.library.opcheck(torch.ops.comet_moe.forward_train_fp8.default, args,
                                   test_utils=OPCHECK_WITHOUT_SCHEMA)
    check(all(v == "SUCCESS" for v in result.values()), f"forward_train_fp8: {result}")
    note(f"opcheck: {sorted(result)} for forward_train_fp8")
    for layer in (m8, m16, mg):
        layer.close()


def test_quantizer_operators_trace_and_match_their_fakes():
    """comet's quantizers as operators: the public functions on fake CUDA tensors give the
    outputs' shapes and dtypes with no GPU (what torch.compile sees) and trace into one
    graph with no break; with the tests'
    reference quantizer as the operators' CPU kernel, opcheck passes (fake against real,
    AOT dispatch) and torch.compile(fullgraph=True) of a function that quantizes and
    dequantizes gives eager's bits."""
    torch, ops, moe = setup()
    moe.close()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fp8_reference import quantize_rows, quantize_weights
    bf16, e4m3, f32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
    with FakeTensorMode():
        w = torch.empty(3, 272, 400, dtype=bf16, device="cuda")
        got = [(tuple(t.shape), t.dtype) for t in comet_moe.quantize_fp8_weights_transposed(w, pow2_scales=True)]
        check_eq(got, [((3, 272, 400), e4m3), ((3, 3, 4), f32), ((3, 400, 272), e4m3), ((3, 4, 3), f32)],
                 "quantize_fp8_weights_transposed on a fake tensor")
        got = [(tuple(t.shape), t.dtype) for t in comet_moe.quantize_fp8_weights(w)]
        check_eq(got, [((3, 272, 400), e4m3), ((3, 3, 4), f32)], "quantize_fp8_weights on a fake tensor")
        x = torch.empty(5, 0, 2880, dtype=bf16, device="cuda")
        got = [(tuple(t.shape), t.dtype) for t in comet_moe.quantize_fp8_rows(x)]
        check_eq(got, [((5, 0, 2880), e4m3), ((5, 0, 23), f32)], "quantize_fp8_rows on an empty fake tensor")

    # The public functions as torch.compile(fullgraph=True) needs them: dynamo traces them
    # (on fake CUDA tensors, no GPU) into one graph with no break.
    def public(w, x):
        return (*comet_moe.quantize_fp8_weights(w), *comet_moe.quantize_fp8_weights_transposed(w, pow2_scales=True),
                *comet_moe.quantize_fp8_rows(x))

    with FakeTensorMode(allow_non_fake_inputs=True):
        fw = torch.empty(2, 256, 128, dtype=bf16, device="cuda")
        fx = torch.empty(10, 256, dtype=bf16, device="cuda")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(public)(fw, fx)
    check_eq((explained.graph_count, explained.graph_break_count), (1, 0),
             f"the quantizers traced: graphs and breaks ({explained.break_reasons})")

    def weights(w, pow2):
        return quantize_weights(torch, w, pow2)

    def transposed(w, pow2):
        q, s = quantize_weights(torch, w, pow2)
        return q, s, q.transpose(-1, -2).contiguous(), s.transpose(-1, -2).contiguous()

    def rows(x, pow2):
        return quantize_rows(torch, x, pow2)

    kernels = {"quantize_fp8_weights": weights, "quantize_fp8_weights_transposed": transposed,
               "quantize_fp8_rows": rows}
    handles = [torch.library.register_kernel(f"comet_moe::{name}", "cpu", fn) for name, fn in kernels.items()]
    try:
        g = torch.Generator().manual_seed(5)
        w = (torch.randn(2, 144, 272, generator=g) * 3).to(bf16)
        x = torch.randn(7, 400, generator=g).to(bf16)
        for name, arg in (("quantize_fp8_weights", w), ("quantize_fp8_weights_transposed", w),
                          ("quantize_fp8_rows", x)):
            for pow2 in (False, True):
                op = getattr(torch.ops.comet_moe, name).default
                result = torch.library.opcheck(op, (arg, pow2), test_utils=OPCHECK_WITHOUT_SCHEMA)
                check(all(v == "SUCCESS" for v in result.values()), f"{name}, pow2 {pow2}: {result}")

        def step(w, x):  # W^T dequantized, and x's round trip
            from comet_moe import dequantize_fp8
            _, _, qt, st = torch.ops.comet_moe.quantize_fp8_weights_transposed(w, True)
            q, s = torch.ops.comet_moe.quantize_fp8_rows(x, False)
            return dequantize_fp8(qt, st), dequantize_fp8(q, s)

        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        for got, want in zip(compiled(w, x), step(w, x)):
            check(torch.equal(got, want), "compiled quantize and dequantize against eager")
    finally:
        for h in handles:
            if hasattr(h, "destroy"):
                h.destroy()


def test_backward_fake_matches_real():
    """backward's fake implementation against the real call (shapes, dtypes, strides),
    what it mutates (the main_grads it is given, nothing else), and its refusal of a
    consumed saved state."""
    torch, ops, moe = setup()
    from torch._subclasses.fake_tensor import FakeTensorMode
    for split in (False, True):
        for accumulate in (False, True):
            x, ids, w, weights = inputs(torch, 7, seed=3, split=split)
            main_grads = tuple(None if t is None else torch.full(t.shape, 0.25) if accumulate else None
                               for t in weights)
            y, saved = torch.ops.comet_moe.forward_train(moe._op_id, x, ids, w, *weights, *(None,) * 4, 0, [0] * 4)
            check_eq((saved.dtype, tuple(saved.shape)), (torch.uint8, (moe._comet_saved_bytes(),)), "saved state")
            dy = torch.randn(7, H).to(torch.bfloat16)
            before = [t.clone() for t in (saved, dy, *weights) if t is not None]
            args = (moe._op_id, saved, dy, None, *weights, *main_grads, 0)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
                fake = torch.ops.comet_moe.backward(*fake_args)
            real = torch.ops.comet_moe.backward(*args)
            what = f"split {split}, accumulate {accumulate}"
            check_eq([(f.dtype, tuple(f.shape), f.stride()) for f in fake],
                     [(r.dtype, tuple(r.shape), r.stride()) for r in real], f"{what}: fake against real outputs")
            check_eq(tuple(real[1].shape), (7, TOP_K), f"{what}: d_topk_weights")
            for i, t in enumerate(t for t in (saved, dy, *weights) if t is not None):
                check(torch.equal(t, before[i]), f"{what}: backward changed an input it does not declare")
            if accumulate:
                check(all(g.numel() == 0 for g in real[2:]), f"{what}: weight gradients returned and accumulated")
                check(any(not torch.equal(g, torch.full(g.shape, 0.25)) for g in main_grads if g is not None),
                      f"{what}: main_grads unchanged")
            else:
                check_eq([tuple(g.shape) for g in real[2:]], [(0,) if t is None else tuple(t.shape) for t in weights],
                         f"{what}: weight gradients")
            raises(comet_moe.CometInvalidArgumentError, lambda: torch.ops.comet_moe.backward(*args),
                   "comet_moe_backward", "consumes")
    moe.close()


class Model:
    """What the training tests step: CometSparseMoeBlock over the CPU stand-in, its
    weights drawn from a seed."""

    def __init__(self, torch, grad_accumulation="grad", megatron_attrs=False, **changes):
        from comet_moe import CometSparseMoeBlock
        self.torch, self.ops, self.moe = setup(grad_accumulation, **changes)
        self.block = CometSparseMoeBlock(moe=self.moe)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in self.block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        self.experts = (self.block.w13, self.block.w2)
        if grad_accumulation == "main_grad":
            for p in self.experts:
                p.main_grad = torch.zeros(p.shape)
                if megatron_attrs:
                    p.grad_added_to_main_grad, p.zero_out_wgrad = False, True

    def steps(self, forward, n=3):
        """n training steps of SGD on token counts that change: for each, what it gave."""
        torch = self.torch
        opt = torch.optim.SGD(self.block.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(5)
        out = []
        for step in range(n):
            x = torch.randn(2, 7 - step, H, generator=g).to(torch.bfloat16).requires_grad_(True)
            y, logits = forward(x)
            loss = (y.float() ** 2).sum() + logits.float().square().mean()
            loss.backward()
            states = self.moe.saved[-1:]
            check(states and states[0].destroyed, f"step {step}: the saved state outlived its backward")
            got = dict(y=y.detach().clone(), logits=logits.detach().clone(), loss=loss.detach().clone(),
                       dx=x.grad.clone())
            for name, p in self.block.named_parameters():
                if getattr(p, "main_grad", None) is not None:
                    got[f"{name}.main_grad"] = p.main_grad.clone()
                    if hasattr(p, "grad_added_to_main_grad"):
                        check(p.grad_added_to_main_grad is True, f"{name}.grad_added_to_main_grad not set")
                        check(torch.equal(p.grad, torch.zeros_like(p)), f"{name}: placeholder not zeros")
                    else:
                        check(p.grad is None, f"{name}: a gradient beside its main_grad")
                else:
                    got[f"{name}.grad"] = p.grad.clone()
            opt.step()
            opt.zero_grad()
            out.append(got)
        out.append({name: p.detach().clone() for name, p in self.block.named_parameters()})
        return out


def compare_bits(torch, eager, compiled, what):
    for step, (a, b) in enumerate(zip(eager, compiled)):
        check_eq(sorted(a), sorted(b), f"{what}, step {step}: what was recorded")
        for key in a:
            check(torch.equal(a[key], b[key]), f"{what}, step {step}: {key} differs from eager's bits")


def test_compiled_training_step_matches_eager_bits():
    """torch.compile(block, fullgraph=True) (Dynamo and AOTAutograd, eager kernels:
    backend aot_eager) against eager, three SGD steps on changing token counts: y, the
    router logits, the loss, dx and every gradient (.grad, or main_grad with and without
    Megatron's placeholder attributes), and the parameters after each step, bit for bit;
    every saved state given back right after its backward."""
    torch = need_torch()
    import torch._dynamo
    from comet_moe import ops
    for mode, attrs, changes in (("grad", False, {}), ("grad", False, {"resend_x": 1}), ("main_grad", False, {}),
                                 ("main_grad", True, {})):
        what = f"{mode}{' with Megatron attributes' if attrs else ''}{', resend_x' if changes else ''}"
        eager = Model(torch, mode, attrs, **changes)
        want = eager.steps(eager.block)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = Model(torch, mode, attrs, **changes)
        got = model.steps(torch.compile(model.block, fullgraph=True, backend="aot_eager"))
        compare_bits(torch, want, got, what)
        check_eq(torch._dynamo.utils.counters["graph_break"], {}, f"{what}: graph breaks")
        check_eq([c[0] for c in model.moe.calls], ["forward_train", "backward"] * 3, f"{what}: comet's calls")
        eager.moe.close()
        model.moe.close()
    gc.collect()
    check_eq(ops._SAVED, {}, "saved states left in the table")


def test_compiled_routed_training_with_inductor_matches_eager_bits():
    """The default backend (inductor) over the experts with routing given
    (forward_routed): y, the loss, dx, d topk_weights, the expert gradients and the
    parameters after each step equal eager's bits. (With the router inside, inductor's own
    softmax kernel may differ from eager's in the last bit, which is torch's, not comet's.)"""
    torch = need_torch()
    if shutil.which("g++") is None and shutil.which("c++") is None:
        skip("inductor on the CPU needs a C++ compiler (g++)")
    import torch._dynamo

    def run(compiled):
        model = Model(torch)
        block = model.block

        def routed(x, ids, w):
            return block.forward_routed(x, ids, w)
        f = torch.compile(routed, fullgraph=True) if compiled else routed
        opt = torch.optim.SGD([block.w13, block.w2], lr=0.05)
        out = []
        for step in range(3):
            x, ids, w, _ = inputs(torch, 12 - 2 * step, seed=20 + step)
            x.requires_grad_(True)
            w.requires_grad_(True)
            y = f(x, ids, w)
            loss = (y.float() ** 2).sum()
            loss.backward()
            out.append(dict(y=y.detach().clone(), loss=loss.detach(), dx=x.grad.clone(), dw=w.grad.clone(),
                            w13=block.w13.grad.clone(), w2=block.w2.grad.clone()))
            opt.step()
            opt.zero_grad()
        out.append(dict(w13=block.w13.detach().clone(), w2=block.w2.detach().clone()))
        model.moe.close()
        return out

    want = run(False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compare_bits(torch, want, run(True), "inductor")
    check_eq(torch._dynamo.utils.counters["graph_break"], {}, "graph breaks")


def test_fake_tensor_mode_traces_a_training_step():
    """Under FakeTensorMode nothing runs, yet a training step of the block gives every
    output and gradient its shape and dtype; the saved state's size is the layer's
    comet_moe_saved_bytes (here the stand-in's)."""
    torch = need_torch()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from comet_moe import ops
    with FakeTensorMode():
        model = Model(torch, "main_grad")
        x = torch.randn(3, 5, H).to(torch.bfloat16).requires_grad_(True)
        y, logits = model.block(x)
        _, ids, w, _ = inputs(torch, 15)
        y2, saved = torch.ops.comet_moe.forward_train(model.moe._op_id, x.view(15, H), ids, w, model.block.w13, None,
                                                      None, model.block.w2, None, None, None, None, 0, [0] * 4)
        (y.float().sum() + logits.float().sum()).backward()
    check_eq((tuple(y.shape), y.dtype, tuple(logits.shape)), ((3, 5, H), torch.bfloat16, (15, E)), "y, logits")
    check_eq((tuple(saved.shape), saved.dtype), ((model.moe._comet_saved_bytes(),), torch.uint8), "saved state")
    check_eq((tuple(x.grad.shape), x.grad.dtype), ((3, 5, H), torch.bfloat16), "dx")
    check_eq(tuple(model.block.gate.weight.grad.shape), (E, H), "router gradient")
    check_eq(model.moe.calls, [], "comet's calls under FakeTensorMode")
    check_eq(ops._SAVED, {}, "saved states kept for fake tensors")
    model.moe.close()


def test_backward_runs_once_and_saved_states_go_back():
    """A second backward through the same graph (retain_graph=True) raises
    CometInvalidArgumentError, eager and compiled; each saved state is destroyed right
    after its backward, and one whose backward never runs when its graph goes."""
    torch = need_torch()
    import torch._dynamo
    from comet_moe import ops
    for compiled in (False, True):
        model = Model(torch)
        torch._dynamo.reset()
        f = torch.compile(model.block, fullgraph=True, backend="aot_eager") if compiled else model.block
        x = torch.randn(9, H).to(torch.bfloat16).requires_grad_(True)
        y, _ = f(x)
        loss = y.float().square().sum()
        loss.backward(retain_graph=True)
        check(model.moe.saved[-1].destroyed, f"compiled {compiled}: state not destroyed after its backward")
        raises(comet_moe.CometInvalidArgumentError, lambda: loss.backward(), "comet_moe_backward", "consumes")
        held = [f(x)]  # a forward whose backward never runs
        check(not model.moe.saved[-1].destroyed and len(ops._SAVED) == 1, "the state of a forward not kept")
        held.clear()  # y and, compiled, the router logits hold the graph
        loss = None
        gc.collect()
        check(model.moe.saved[-1].destroyed and ops._SAVED == {}, f"compiled {compiled}: state outlived its graph")
        check_eq(len(model.moe.saved), 2, "saved states made")
        model.moe.close()


def test_backward_writes_no_zeros_for_the_saved_state():
    """The saved state (the training forward's second output, uint8) never gets a
    gradient: the backward must not start by writing zeros its size for it, as autograd
    does for an undefined output gradient unless told not to (0.3 ms a step on mixtral).
    Every uint8 tensor the backward zeroes or fills is recorded, bf16 and FP8 layers."""
    torch = need_torch()
    from torch.utils._python_dispatch import TorchDispatchMode
    from standin import CpuMoe

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if ("zero" in name or "fill" in name or "full" in name) and isinstance(out, torch.Tensor) \
                    and out.dtype == torch.uint8:
                self.seen.append((name, tuple(out.shape)))
            return out

    F8, bf = 128, torch.bfloat16
    for dtype in ("bf16", "fp8"):
        layer = CpuMoe(torch, comet_moe.MoeConfig(hidden=H, ffn=F8, num_experts=E, top_k=TOP_K, max_tokens=MAX_TOKENS,
                                                  dtype=dtype))
        g = torch.Generator().manual_seed(7)
        gate_up = torch.nn.Parameter((torch.randn(E, 2 * F8, H, generator=g) / H ** 0.5).to(bf))
        down = torch.nn.Parameter((torch.randn(E, H, F8, generator=g) / F8 ** 0.5).to(bf))
        x, ids, w, _ = inputs(torch, 9, seed=8)
        y = layer(x.requires_grad_(True), ids, w, gate_up=gate_up, down=down)
        with Fills() as fills:
            y.backward(torch.randn(y.shape, generator=g).to(bf))
        check(x.grad is not None and gate_up.grad is not None, f"{dtype}: the backward gave no gradients")
        check_eq(fills.seen, [], f"{dtype}: uint8 tensors zeroed or filled during the backward")
        layer.close()


def test_training_forward_refuses_before_launch():
    """main_grad mode: a weight without an fp32 main_grad of its shape is refused by the
    forward (ValueError naming it) before anything runs; out= and stream= are not taken
    under autograd; a closed layer raises."""
    torch = need_torch()
    model = Model(torch, "main_grad")
    x = torch.randn(4, H).to(torch.bfloat16).requires_grad_(True)
    del model.block.w2.main_grad
    raises(ValueError, lambda: model.block(x), "grad_accumulation='main_grad'", "down (shape (4, 64, 64))",
           "no main_grad")
    model.block.w2.main_grad = torch.zeros(model.block.w2.shape, dtype=torch.bfloat16)
    raises(ValueError, lambda: model.block(x), "down.main_grad", "float32", "torch.bfloat16")
    model.block.w2.main_grad = torch.zeros(4, H)
    raises(ValueError, lambda: model.block(x), "down.main_grad", "(4, 64, 64)", "(4, 64)")
    model.block.w2.main_grad = torch.zeros(model.block.w2.shape)
    raises(ValueError, lambda: model.block(x, out=torch.empty(4, H, dtype=torch.bfloat16)), "under autograd")
    check_eq(model.moe.calls, [], "calls after refused arguments")
    y, _ = model.block(x)
    check_eq([c[0] for c in model.moe.calls], ["forward_train"], "a good call after them")
    model.moe.close()
    raises(RuntimeError, lambda: y.float().sum().backward(), "used after close")
    raises(RuntimeError, lambda: model.block(x), "used after close")
