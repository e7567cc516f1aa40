"""test_megatron_cpu.py - the Megatron-Core adapter (comet_moe.megatron) on the CPU: the
config mapping and its refusals (no torch needed), and, with torch and megatron-core
installed, the layer's glue against Megatron's own modules: the same router (TopKRouter),
the expert weights loaded under SequentialMLP's names from a SequentialMLP built by
Megatron, and the output against that router's choices through those experts; and the
layer under torch.compile(fullgraph=True), forward and backward, against eager, bit for
bit. The experts' compute is comet's on a GPU; here a stand-in computes what
comet_moe_forward does, in float32, so the tests check what the adapter adds: routing
conversion, weight layout and names, reshapes, and comet's custom operators in the graph.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

from helpers import check, check_eq, note, raises, skip


def megatron_config(**changes):
    """What the adapter reads of a TransformerConfig, as a plain object."""
    import math
    c = SimpleNamespace(num_moe_experts=8, moe_router_topk=2, hidden_size=256, ffn_hidden_size=1024,
                        moe_ffn_hidden_size=512, expert_model_parallel_size=2, expert_tensor_parallel_size=None,
                        tensor_model_parallel_size=1, gated_linear_unit=True,
                        activation_func=SimpleNamespace(__name__="silu"), add_bias_linear=False,
                        moe_shared_expert_intermediate_size=None, moe_expert_capacity_factor=None,
                        moe_latent_size=None, fp8=None, fp8_recipe="delayed", fp4=None, sqrt=math.sqrt)
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def test_megatron_config_mapping():
    from comet_moe.megatron import moe_config_from_megatron
    cfg = moe_config_from_megatron(megatron_config(), max_tokens=4096)
    got = (cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k, cfg.max_tokens, cfg.ep_size, cfg.tp_size)
    check_eq(got, (256, 512, 8, 2, 4096, 2, 1), "moe_ffn_hidden_size, EP 2, expert TP from tensor_model_parallel_size")
    cfg = moe_config_from_megatron(megatron_config(moe_ffn_hidden_size=None, expert_tensor_parallel_size=2,
                                                   tensor_model_parallel_size=4), max_tokens=128)
    check_eq((cfg.ffn, cfg.tp_size), (1024, 2), "ffn_hidden_size when moe_ffn_hidden_size is unset; expert TP given")
    cfg = moe_config_from_megatron(megatron_config(expert_tensor_parallel_size=None, tensor_model_parallel_size=2),
                                   max_tokens=128)
    check_eq(cfg.tp_size, 2, "expert TP defaults to the tensor-parallel size, as Megatron's")
    # Block-scaled FP8: Megatron's blockwise E4M3 recipe, or the adapter's keyword.
    check_eq(cfg.dtype_name, "bf16", "bf16 without fp8")
    cfg = moe_config_from_megatron(megatron_config(fp8="e4m3", fp8_recipe="blockwise"), max_tokens=128)
    check_eq(cfg.dtype_name, "fp8", "fp8 'e4m3' with fp8_recipe 'blockwise'")
    check_eq(moe_config_from_megatron(megatron_config(), max_tokens=128, fp8=True).dtype_name, "fp8", "fp8=True")
    # cuBLASLt's FP8 weight gradients: an FP8 layer's setting, refused by comet on bf16.
    cfg = moe_config_from_megatron(megatron_config(), max_tokens=128, fp8=True, fp8_wgrad_cublaslt=True)
    check_eq((cfg.dtype_name, cfg.fp8_wgrad_cublaslt), ("fp8", 1), "fp8_wgrad_cublaslt=True")
    check_eq(moe_config_from_megatron(megatron_config(), max_tokens=128, fp8=True).fp8_wgrad_cublaslt, 0,
             "comet's weight gradients by default")
    from comet_moe import CometInvalidArgumentError
    raises(CometInvalidArgumentError,
           lambda: moe_config_from_megatron(megatron_config(), max_tokens=128, fp8_wgrad_cublaslt=True),
           "config.fp8_wgrad_cublaslt = 1 is for config.dtype COMET_DTYPE_FP8_BLOCK")


def test_megatron_fp8_scales_follow_the_blockwise_recipe():
    """Transformer Engine's blockwise recipe makes power-of-two scales unless
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1; the keyword chooses instead; bf16 has none."""
    from comet_moe import CometInvalidArgumentError
    from comet_moe.megatron import moe_config_from_megatron
    name, before = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES", os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    blockwise = megatron_config(fp8="e4m3", fp8_recipe="blockwise")

    def pow2(config, **kw):
        return moe_config_from_megatron(config, max_tokens=128, **kw).fp8_pow2_scales
    try:
        for value, want in ((None, 1), ("0", 1), ("1", 0), ("yes", 1)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
            check_eq(pow2(blockwise), want, f"blockwise scales with {name}={value}")
            check_eq(pow2(megatron_config(), fp8=True), want, f"fp8=True with {name}={value}")
            check_eq(pow2(megatron_config()), 0, f"bf16 with {name}={value}")
        os.environ[name] = "1"
        check_eq(pow2(blockwise, fp8_pow2_scales=True), 1, "fp8_pow2_scales=True over the variable")
        os.environ.pop(name)
        check_eq(pow2(blockwise, fp8_pow2_scales=False), 0, "fp8_pow2_scales=False over the default")
        check_eq(pow2(megatron_config(), fp8_pow2_scales=False), 0, "fp8_pow2_scales=False on bf16")
        raises(CometInvalidArgumentError, lambda: pow2(megatron_config(), fp8_pow2_scales=True),
               "config.fp8_pow2_scales = 1 is for config.dtype COMET_DTYPE_FP8_BLOCK")
        raises(ValueError, lambda: pow2(blockwise, fp8_pow2_scales=2), "MoeConfig.fp8_pow2_scales = 2")
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def test_megatron_config_refusals_name_the_field():
    from comet_moe.megatron import moe_config_from_megatron
    cases = [(dict(num_moe_experts=None), "config.num_moe_experts"),
             (dict(gated_linear_unit=False), "config.gated_linear_unit = False"),
             (dict(activation_func=SimpleNamespace(__name__="gelu")), "config.activation_func = 'gelu'"),
             (dict(add_bias_linear=True), "config.add_bias_linear = True"),
             (dict(moe_shared_expert_intermediate_size=512), "config.moe_shared_expert_intermediate_size"),
             (dict(moe_expert_capacity_factor=1.0), "config.moe_expert_capacity_factor"),
             (dict(moe_latent_size=64), "config.moe_latent_size"),
             (dict(fp8="hybrid", fp8_recipe="blockwise"), "config.fp8 = 'hybrid'"),
             (dict(fp8="e4m3", fp8_recipe="delayed"), "fp8_recipe = 'delayed'"),
             (dict(fp4="nvfp4"), "config.fp4")]
    for change, words in cases:
        raises(ValueError, lambda c=change: moe_config_from_megatron(megatron_config(**c), 128), words)


class StandInMoe:
    """comet_moe.Moe's forward as comet computes it, float32 on the CPU (the packed layout of
    comet.h: w13 rows 0..F-1 gate, F..2F-1 up), for the adapter's glue."""

    def __init__(self, torch, cfg):
        self.torch, self.config = torch, cfg
        self.experts_per_rank, self.ffn_local, self.first_expert = int(cfg.num_experts), int(cfg.ffn), 0
        self.calls = []

    def forward(self, x, topk_ids, topk_weights, *, gate_up=None, down=None, impl="auto", **_):
        torch, F = self.torch, self.ffn_local
        self.calls.append((tuple(x.shape), str(topk_ids.dtype), str(topk_weights.dtype)))
        y = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                e = int(topk_ids[t, j])
                g = gate_up[e, :F].float() @ x[t].float()
                u = gate_up[e, F:].float() @ x[t].float()
                y[t] += topk_weights[t, j] * (down[e].float() @ (torch.nn.functional.silu(g) * u))
        return y.to(torch.bfloat16)


def test_megatron_layers_share_one_handle_per_shape():
    from comet_moe import megatron
    made, closed = [], []

    class Handle:
        def __init__(self, name):
            self.name, self.closed = name, False

        def close(self):
            self.closed = True
            closed.append(self.name)

    def make(made_comm=True):
        def f():
            made.append(Handle(f"moe {len(made) + 1}"))
            return Handle(f"comm {len(made)}"), made[-1], made_comm
        return f
    group, other_group = object(), object()
    settings = ((512, 256, 8, 2, 128, 1, 1, 0), 0, "main_grad")
    kept = list(megatron._SHARED)
    megatron._SHARED.clear()
    try:
        first = megatron._shared_handle(group, settings, make())
        check(megatron._shared_handle(group, settings, make())[1] is first[1], "a second layer of the shape shares it")
        check_eq(len(made), 1, "handles made for two layers of one shape")
        megatron._shared_handle(other_group, settings, make())
        megatron._shared_handle(group, (settings[0], 4096, "main_grad"), make())
        megatron._shared_handle(group, (settings[0], 0, "grad"), make(made_comm=False))
        check_eq(len(made), 4, "another group, bound or gradient mode: a handle of its own")
        first[1].closed = True
        check(megatron._shared_handle(group, settings, make())[1] is made[-1] and len(made) == 5,
              "a closed handle is replaced, not reused")
        del first
        import gc
        gc.collect()
        check(megatron._shared_handle(group, settings, make())[1] is made[-1] and len(made) == 5,
              "held until released, not by each rank's garbage collector")
        closed.clear()
        megatron.release_shared_handles()
        check_eq(megatron._SHARED, [], "released")
        check_eq(sorted(closed), ["comm 1", "comm 2", "comm 3", "comm 5", "moe 1", "moe 2", "moe 3", "moe 4", "moe 5"],
                 "every shared handle closed, and the communicators made for them (not one the caller gave)")
    finally:
        megatron._SHARED[:] = kept


def megatron_or_skip():
    try:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        skip(f"needs torch and megatron-core ({e})")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    return torch, TransformerConfig


def test_megatron_layer_glue_matches_megatrons_modules():
    torch, TransformerConfig = megatron_or_skip()
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from comet_moe.megatron import CometMoELayer, moe_config_from_megatron
    E, k, H, Fd, s, b = 4, 2, 64, 64, 5, 2
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=Fd, num_attention_heads=4,
                               num_moe_experts=E, moe_router_topk=k, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
                               moe_router_load_balancing_type="none")
    torch.manual_seed(3)
    pgs = get_default_pg_collection()
    stand_in = StandInMoe(torch, moe_config_from_megatron(config, max_tokens=s * b))
    layer = CometMoELayer(config, max_tokens=s * b, pg_collection=pgs, moe=stand_in)
    names = dict(layer.named_parameters())
    check(getattr(names["w13"], "allreduce", True) is False and getattr(names["w2"], "allreduce", True) is False,
          "expert parameters marked allreduce = False")
    check("router.weight" in names, f"Megatron's router weight, named as MoELayer's: {sorted(names)}")
    # Megatron's own experts, and their state dict loaded into the adapter by name.
    mlp = SequentialMLP(E, config, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear), pg_collection=pgs)
    theirs = {f"experts.{key}": v for key, v in mlp.state_dict().items()}
    check(any(key.endswith("._extra_state") for key in theirs), f"SequentialMLP's extra states: {sorted(theirs)}")
    result = layer.load_state_dict(theirs, strict=False)
    check_eq(result.unexpected_keys, [], "every SequentialMLP weight and extra state taken")
    check(not [key for key in result.missing_keys if "experts" in key], f"missing: {result.missing_keys}")
    mine = {key: v for key, v in layer.state_dict().items() if key.startswith("experts.")}
    check_eq(sorted(mine), sorted(theirs), "saved under SequentialMLP's names")
    for key in theirs:
        if key.endswith("._extra_state"):
            check(mine[key] is None, f"{key} saved as Megatron's linears save it (None)")
        else:
            check(torch.equal(mine[key].float(), theirs[key].to(torch.bfloat16).float()), f"{key} round trip")
    mlp.load_state_dict({key[len("experts."):]: v for key, v in mine.items()})  # strict: Megatron takes ours back
    # The output: the router's own choices through Megatron's experts. Megatron's gate moves
    # its weight to the GPU before its linear: on the CPU the same linear runs in place.
    router = layer.router
    router.gating = lambda inp: F.linear(inp, router.weight.to(inp.dtype))
    x = torch.randn(s, b, H)
    with torch.no_grad():
        y, bias = layer(x.to(torch.bfloat16))
        probs, routing_map = layer.router(x.to(torch.bfloat16))
        xs = x.to(torch.bfloat16).float().view(-1, H)
        want = torch.zeros(s * b, H)
        for t in range(s * b):
            for e in routing_map[t].nonzero().flatten().tolist():
                w1 = mlp.local_experts[e].linear_fc1.weight.to(torch.bfloat16).float()
                w2 = mlp.local_experts[e].linear_fc2.weight.to(torch.bfloat16).float()
                h = w1 @ xs[t]
                want[t] += float(probs[t, e]) * (w2 @ (F.silu(h[:Fd]) * h[Fd:]))
    check(bias is None and tuple(y.shape) == (s, b, H), f"output {tuple(y.shape)}, bias {bias}")
    check_eq(stand_in.calls, [((s * b, H), "torch.int32", "torch.float32")], "one call, flattened, int32/float32")
    err = ((y.float().view(-1, H) - want).norm() / want.norm()).item()
    check(err < 1e-2, f"against the router's choices through Megatron's experts: relative error {err:.3g}")
    note(f"adapter vs Megatron's TopKRouter + SequentialMLP (float32 experts): relative error {err:.2e}")


def test_megatron_layer_compiles_with_no_graph_break():
    """CometMoELayer (Megatron's TopKRouter, comet's operators over the CPU stand-in)
    under torch.compile(fullgraph=True, backend aot_eager) against eager, two micro-batches:
    the output, the loss, dx, the router's gradient and the experts' gradients (.grad, or
    fp32 main_grad with Megatron's grad_added_to_main_grad), bit for bit. Megatron's gate
    moves its weight to the GPU first: on the CPU the same linear runs in its place."""
    torch, TransformerConfig = megatron_or_skip()
    import torch._dynamo
    import torch.nn.functional as F
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from comet_moe.megatron import CometMoELayer, moe_config_from_megatron
    from standin import CpuMoe
    E, k, H, Fd, s, b = 4, 2, 64, 64, 5, 2
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=Fd, num_attention_heads=4,
                               num_moe_experts=E, moe_router_topk=k, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
                               moe_router_load_balancing_type="none")

    def run(mode, compiled):
        torch.manual_seed(3)
        moe = CpuMoe(torch, moe_config_from_megatron(config, s * b), grad_accumulation=mode)
        layer = CometMoELayer(config, max_tokens=s * b, pg_collection=get_default_pg_collection(), moe=moe)
        router = layer.router
        router.gating = lambda inp: F.linear(inp, router.weight.to(inp.dtype))
        if mode == "main_grad":
            for p in (layer.w13, layer.w2):
                p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape), False
        torch._dynamo.reset()
        f = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        g, out = torch.Generator().manual_seed(5), []
        for _ in range(2):
            x = torch.randn(s, b, H, generator=g).to(torch.bfloat16).requires_grad_(True)
            y, bias = f(x)
            loss = (y.float() ** 2).sum()
            loss.backward()
            got = dict(y=y.detach(), loss=loss.detach(), dx=x.grad, router=layer.router.weight.grad.clone())
            for name, p in (("w13", layer.w13), ("w2", layer.w2)):
                if mode == "main_grad":
                    check(p.grad_added_to_main_grad is True, f"{name}.grad_added_to_main_grad not set")
                    got[name] = p.main_grad.clone()
                    p.grad = None  # as Megatron's hook does
                else:
                    got[name] = p.grad.clone()
            out.append(got)
        check(bias is None and [c[0] for c in moe.calls] == ["forward_train", "backward"] * 2, f"calls {moe.calls}")
        return out

    for mode in ("grad", "main_grad"):
        want = run(mode, False)
        torch._dynamo.utils.counters.clear()
        got = run(mode, True)
        check_eq(torch._dynamo.utils.counters["graph_break"], {}, f"{mode}: graph breaks")
        for step, (a, c) in enumerate(zip(want, got)):
            for key in a:
                check(torch.equal(a[key], c[key]), f"{mode}, micro-batch {step}: {key} differs from eager's bits")
    note("CometMoELayer compiled (fullgraph, aot_eager): output and gradients equal eager's bits, grad and main_grad")
