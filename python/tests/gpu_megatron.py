"""gpu_megatron.py - comet_moe.megatron's CometMoELayer against Megatron-Core's own MoELayer
(alltoall dispatcher, SequentialMLP experts, SwiGLU) on the same weights and tokens, run
by test_torch_gpu.py (its runner, its Ctx `c`): the output, and the gradients at the input,
the router weight and every local expert weight; and the layer in block-scaled FP8
against it in bf16. Skips where megatron-core is not installed. Tolerances twice
gpu_train.py's: Megatron's layer, the reference here, runs in bf16 too, with its own
roundings (compare_grad's ref_bf16); FP8's are gpu_fp8.py's (the test's note).
"""
from gpu_train import check, compare_grad

TESTS = []


def gpu_test(fn):
    TESTS.append(fn)
    return fn


E, K, H, FFN, S, B = 8, 2, 512, 256, 64, 2  # FFN and H multiples of 128: FP8 training's


def megatron_config(c):
    """Megatron's TransformerConfig for these tests and its process groups (skips where
    megatron-core is not installed), the model-parallel state initialised once."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        c.skip(f"megatron-core is not installed ({e})")
    torch = c.torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=c.world)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)  # Megatron's weight init forks these RNG states
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=8,
                               num_moe_experts=E, moe_router_topk=K, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, moe_token_dispatcher_type="alltoall", bf16=True,
                               params_dtype=torch.bfloat16, expert_model_parallel_size=c.world,
                               moe_router_load_balancing_type="none")
    return config, get_default_pg_collection()


def step(c, layer, x, dy):
    """The layer's output and its gradients at x, the router weight and the expert weights
    (Megatron's SequentialMLP's stacked as comet's), float32."""
    xg = x.clone().requires_grad_(True)
    y, _ = layer(xg)
    y.backward(dy)
    c.torch.cuda.synchronize()
    grads = {"y": y.detach().float(), "dx": xg.grad.float(), "router": layer.router.weight.grad.float()}
    if hasattr(layer, "experts"):
        fc1 = c.torch.stack([m.linear_fc1.weight.grad for m in layer.experts.local_experts])
        fc2 = c.torch.stack([m.linear_fc2.weight.grad for m in layer.experts.local_experts])
    else:
        fc1, fc2 = layer.w13.grad, layer.w2.grad
    grads["w13"], grads["w2"] = fc1.float(), fc2.float()
    return grads


@gpu_test
def megatron_layer_matches_megatron_moelayer(c):
    config, pgs = megatron_config(c)
    torch = c.torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from comet_moe.megatron import CometMoELayer
    experts = lambda *a, **kw: SequentialMLP(*a, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,  # noqa
                                                                          linear_fc2=RowParallelLinear), **kw)
    theirs = MoELayer(config, MoESubmodules(router=TopKRouter, experts=experts), pg_collection=pgs).cuda()
    mine = CometMoELayer(config, max_tokens=S * B, pg_collection=pgs, comm=c.comm, grad_accumulation="grad")
    result = mine.load_state_dict(theirs.state_dict(), strict=False)
    check_keys = [key for key in result.missing_keys + result.unexpected_keys if "experts" in key or "router" in key]
    if check_keys:
        c.failures.append(f"state dict keys not matched: {check_keys}")
    x = torch.randn(S, B, H, device=c.device, generator=c.gen).to(torch.bfloat16)
    dy = torch.randn(S, B, H, device=c.device, generator=c.gen).to(torch.bfloat16)
    outs = {name: step(c, layer, x, dy) for name, layer in (("megatron", theirs), ("comet", mine))}
    for key in ("y", "dx", "router", "w13", "w2"):
        compare_grad(c, f"CometMoELayer against Megatron's MoELayer: {key}", outs["comet"][key], outs["megatron"][key],
                     ref_bf16=True)
    # A second layer of the shape shares the handle; its step between this layer's forward
    # and backward (a model's order) leaves this layer's output and gradients bit-equal.
    other = CometMoELayer(config, max_tokens=S * B, pg_collection=pgs, comm=c.comm, grad_accumulation="grad")
    if other.moe is not mine.moe:
        c.failures.append("a second CometMoELayer of the same shape made a handle of its own")
    for p in list(mine.parameters()) + list(other.parameters()):
        p.grad = None
    xg = x.clone().requires_grad_(True)
    y, _ = mine(xg)
    x2 = torch.randn(S, B, H, device=c.device, generator=c.gen).to(torch.bfloat16).requires_grad_(True)
    y2, _ = other(x2)
    y2.backward(torch.randn(S, B, H, device=c.device, generator=c.gen).to(torch.bfloat16))
    y.backward(dy)
    torch.cuda.synchronize()
    again = {"y": y.detach().float(), "dx": xg.grad.float(), "router": mine.router.weight.grad.float(),
             "w13": mine.w13.grad.float(), "w2": mine.w2.grad.float()}
    for key, value in again.items():
        if not torch.equal(value, outs["comet"][key]):
            c.failures.append(f"CometMoELayer {key} with another layer's step inside its own: not bit-equal to it alone")


@gpu_test
def megatron_fp8_layer_matches_the_bf16_layer(c):
    """CometMoELayer(fp8=True) against the bf16 CometMoELayer (the test above holds that
    one to Megatron's MoELayer) on the same router, weights and tokens, expert weights and
    x on the E4M3 grid of power-of-two scales as gpu_fp8.py's training tests take them: y
    and the gradients at x and at every expert weight by DeepGEMM's measure under
    gpu_fp8.py's 1e-3; the router weight's, a linear map of d topk_weights whose
    cancellations may double the measure, under 2e-3; none NaN. Its scales are Transformer
    Engine's blockwise recipe's (powers of two; NVTE_FP8_BLOCK_SCALING_FP32_SCALES as set
    here). Megatron marks no micro-batch here (config.fp8 unset), so the FP8 copies are made
    again on every forward: with W2 halved through .data (which no version counter sees), y
    halves bit for bit (a power of two moves the scales alone, on either scale rule)."""
    config, pgs = megatron_config(c)
    torch = c.torch
    from gpu_fp8 import DIFF_LIMIT, calc_diff, on_e4m3_grid
    from comet_moe.megatron import CometMoELayer, blockwise_pow2_scales
    layers = {name: CometMoELayer(config, max_tokens=S * B, pg_collection=pgs, comm=c.comm, grad_accumulation="grad",
                                  fp8=name == "fp8") for name in ("bf16", "fp8")}
    eight, sixteen = layers["fp8"], layers["bf16"]
    check(eight.moe.config.fp8_pow2_scales == int(blockwise_pow2_scales()),
          f"CometMoELayer(fp8=True): fp8_pow2_scales {eight.moe.config.fp8_pow2_scales}, not the blockwise recipe's")
    check(sixteen.moe.config.fp8_pow2_scales == 0, "the bf16 CometMoELayer has fp8_pow2_scales set")
    with torch.no_grad():
        sixteen.w13.copy_(on_e4m3_grid(c, sixteen.w13))
        sixteen.w2.copy_(on_e4m3_grid(c, sixteen.w2))
    eight.load_state_dict(sixteen.state_dict())
    x = torch.randn(S * B, H, device=c.device, generator=c.gen).to(torch.bfloat16)
    x = on_e4m3_grid(c, x, rows_only=True).view(S, B, H)
    dy = torch.randn(S, B, H, device=c.device, generator=c.gen).to(torch.bfloat16)
    outs = {name: step(c, layer, x, dy) for name, layer in layers.items()}
    for key in ("y", "dx", "router", "w13", "w2"):
        got, want = outs["fp8"][key], outs["bf16"][key]
        if not torch.isfinite(got).all().item():
            c.failures.append(f"CometMoELayer(fp8=True): NaN or Inf in {key}")
            continue
        limit = 2e-3 if key == "router" else DIFF_LIMIT
        d = calc_diff(got, want)
        check(d < limit, f"CometMoELayer(fp8=True): {key} measures {d:.3g} against bf16's (limit {limit})")
        c.note(f"CometMoELayer(fp8=True): {key} {d:.2e} against the bf16 layer")
    with torch.no_grad():
        before, _ = eight(x)
        eight.w2.data.mul_(0.5)
        after, _ = eight(x)
        eight.w2.data.mul_(2.0)
    torch.cuda.synchronize()
    check(torch.equal(after, before * 0.5), "CometMoELayer(fp8=True): y with W2 halved through .data is not half of y "
                                            "(the FP8 copies were not made again)")
