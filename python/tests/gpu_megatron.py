"""gpu_megatron.py - comet_moe.megatron's CometMoELayer against Megatron-Core's own MoELayer
(alltoall dispatcher, SequentialMLP experts, SwiGLU) on the same weights and tokens, run
by test_torch_gpu.py (its runner, its Ctx `c`): the output, and the gradients at the input,
the router weight and every local expert weight. Skips where megatron-core is not
installed. Tolerances twice gpu_train.py's: Megatron's layer, the reference here, runs in
bf16 too, with its own roundings (compare_grad's ref_bf16).
"""
from gpu_train import compare_grad

TESTS = []


def gpu_test(fn):
    TESTS.append(fn)
    return fn


@gpu_test
def megatron_layer_matches_megatron_moelayer(c):
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        c.skip(f"megatron-core is not installed ({e})")
    torch = c.torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    from comet_moe.megatron import CometMoELayer
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=c.world)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)  # Megatron's weight init forks these RNG states
    E, k, H, Fd, s, b = 8, 2, 512, 256, 64, 2
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=Fd, num_attention_heads=8,
                               num_moe_experts=E, moe_router_topk=k, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, moe_token_dispatcher_type="alltoall", bf16=True,
                               params_dtype=torch.bfloat16, expert_model_parallel_size=c.world,
                               moe_router_load_balancing_type="none")
    pgs = get_default_pg_collection()
    experts = lambda *a, **kw: SequentialMLP(*a, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,  # noqa
                                                                          linear_fc2=RowParallelLinear), **kw)
    theirs = MoELayer(config, MoESubmodules(router=TopKRouter, experts=experts), pg_collection=pgs).cuda()
    mine = CometMoELayer(config, max_tokens=s * b, pg_collection=pgs, comm=c.comm, grad_accumulation="grad")
    result = mine.load_state_dict(theirs.state_dict(), strict=False)
    check_keys = [key for key in result.missing_keys + result.unexpected_keys if "experts" in key or "router" in key]
    if check_keys:
        c.failures.append(f"state dict keys not matched: {check_keys}")
    x = torch.randn(s, b, H, device=c.device, generator=c.gen).to(torch.bfloat16)
    dy = torch.randn(s, b, H, device=c.device, generator=c.gen).to(torch.bfloat16)
    outs = {}
    for name, layer in (("megatron", theirs), ("comet", mine)):
        xg = x.clone().requires_grad_(True)
        y, _ = layer(xg)
        y.backward(dy)
        torch.cuda.synchronize()
        grads = {"y": y.detach().float(), "dx": xg.grad.float(), "router": layer.router.weight.grad.float()}
        if name == "megatron":
            fc1 = torch.stack([m.linear_fc1.weight.grad for m in layer.experts.local_experts])
            fc2 = torch.stack([m.linear_fc2.weight.grad for m in layer.experts.local_experts])
        else:
            fc1, fc2 = layer.w13.grad, layer.w2.grad
        grads["w13"], grads["w2"] = fc1.float(), fc2.float()
        outs[name] = grads
    for key in ("y", "dx", "router", "w13", "w2"):
        compare_grad(c, f"CometMoELayer against Megatron's MoELayer: {key}", outs["comet"][key], outs["megatron"][key],
                     ref_bf16=True)
    # A second layer of the shape shares the handle; its step between this layer's forward
    # and backward (a model's order) leaves this layer's output and gradients bit-equal.
    other = CometMoELayer(config, max_tokens=s * b, pg_collection=pgs, comm=c.comm, grad_accumulation="grad")
    if other.moe is not mine.moe:
        c.failures.append("a second CometMoELayer of the same shape made a handle of its own")
    for p in list(mine.parameters()) + list(other.parameters()):
        p.grad = None
    xg = x.clone().requires_grad_(True)
    y, _ = mine(xg)
    x2 = torch.randn(s, b, H, device=c.device, generator=c.gen).to(torch.bfloat16).requires_grad_(True)
    y2, _ = other(x2)
    y2.backward(torch.randn(s, b, H, device=c.device, generator=c.gen).to(torch.bfloat16))
    y.backward(dy)
    torch.cuda.synchronize()
    again = {"y": y.detach().float(), "dx": xg.grad.float(), "router": mine.router.weight.grad.float(),
             "w13": mine.w13.grad.float(), "w2": mine.w2.grad.float()}
    for key, value in again.items():
        if not torch.equal(value, outs["comet"][key]):
            c.failures.append(f"CometMoELayer {key} with another layer's step inside its own: not bit-equal to it alone")
