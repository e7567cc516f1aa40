"""gpu_compile.py - comet's custom operators (comet_moe/ops.py) with comet's kernels, run by
test_torch_gpu.py (its runner, its Ctx `c`): torch.compile(fullgraph=True) of a training
step (forward, backward, an SGD step, three steps on token counts that change) against
eager, bit for bit, for a model holding CometSparseMoeBlock (router included, both of
comet's paths, .grad and fp32 main_grad) and for Megatron's CometMoELayer where
megatron-core is installed; the same under inductor for the experts with routing given;
torch.library.opcheck of the operators; and the fake implementations' sizes against the
real calls (the saved state's against comet_moe_saved_bytes).

Why two backends: aot_eager (Dynamo and AOTAutograd, torch's eager kernels) keeps every
torch operation's bits, so the whole step must equal eager's; inductor compiles the
router's softmax into a kernel of its own whose last bits may differ from eager's, so
with the router inside only closeness is asked, and bits where comet's inputs come from
outside the graph. comet's own outputs are deterministic: the same inputs give the same
bits, compiled or not.

Compiling takes each rank its own time before its first call into comet, a collective:
the tests run on a communicator of their own whose device waits allow minutes
(timeout_ms 600000), where the suite's allows 10 s.
"""
from gpu_train import check

H, FFN, E, TOP_K, MAX_TOKENS = 512, 256, 8, 2, 512  # as test_torch_gpu.py's
TIMEOUT_MS = 600000
TEST_TIMEOUT_S = 900  # compiling takes minutes where the suite's tests take seconds
TESTS = []


def gpu_test(fn):
    fn.timeout_s = TEST_TIMEOUT_S
    TESTS.append(fn)
    return fn


def fresh_compile(c):
    """torch._dynamo reset, and its graph-break counter cleared."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch._dynamo.utils.counters


def no_graph_breaks(c, counters, what):
    if counters["graph_break"]:
        c.failures.append(f"{what}: graph breaks {dict(counters['graph_break'])}")


def compare_bits(c, what, want, got):
    """Every entry of each step's record equal in bits, recorded as misses (the rank goes
    on with the collective calls)."""
    torch = c.torch
    for step, (a, b) in enumerate(zip(want, got)):
        for key in a:
            if not torch.equal(a[key], b[key]):
                d = (a[key].float() - b[key].float()).abs().max().item()
                c.failures.append(f"{what}, step {step}: {key} differs from eager's bits (largest difference {d:.3g})")


def block_steps(c, block, forward, mode, steps=3):
    """`steps` SGD steps of `block` through `forward` (the block, or it compiled) on this
    rank's tokens, fresh each step, the same for every call of this function: what each
    step gave (y, router logits, loss, dx, every gradient), then the parameters."""
    torch = c.torch
    g = torch.Generator(device=c.device)
    g.manual_seed(500 + c.rank)
    opt = torch.optim.SGD(block.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        m = (300, 77)[c.rank % 2] - 20 * step
        x = torch.randn(m, H, device=c.device, generator=g).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(m, H, device=c.device, generator=g)
        y, logits = forward(x)
        loss = (y.float() * dy).sum() + logits.float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        c.comm_compile.check_async_error()
        got = dict(y=y.detach().clone(), logits=logits.detach().clone(), loss=loss.detach().clone(),
                   dx=x.grad.clone())
        for name, p in block.named_parameters():
            if mode == "main_grad" and name in ("w13", "w2"):
                got[f"{name}.main_grad"] = p.main_grad.clone()
                if p.grad is not None:
                    c.failures.append(f"{name}: a .grad beside its main_grad")
            else:
                got[f"{name}.grad"] = p.grad.clone()
        opt.step()
        opt.zero_grad()
        out.append(got)
    out.append({name: p.detach().clone() for name, p in block.named_parameters()})
    return out


def compile_comm(c):
    """The tests' communicator (see the module's note), made once, closed by the last test."""
    if getattr(c, "comm_compile", None) is None:
        c.comm_compile = c.cm.Comm.from_process_group(timeout_ms=TIMEOUT_MS)
    return c.comm_compile


def new_block(c, moe, mode):
    block = c.cm.CometSparseMoeBlock(moe=moe)
    block.load_state_dict(c.full_sd)
    if mode == "main_grad":
        for p in (block.w13, block.w2):
            p.main_grad = c.torch.zeros(p.shape, dtype=c.torch.float32, device=c.device)
    return block


@gpu_test
def compiled_block_training_matches_eager_bits(c):
    """CometSparseMoeBlock (router included) compiled with fullgraph=True, backend
    aot_eager, against eager: y, the router logits, the loss, dx, every gradient (.grad, or
    the experts' fp32 main_grad) and the parameters after each SGD step, bit for bit, on
    the fused and the baseline path; no graph break."""
    torch, cm = c.torch, c.cm
    comm = compile_comm(c)
    for impl in ("fused", "baseline"):
        for mode in ("grad", "main_grad"):
            what = f"{impl}, {mode}"
            moe = cm.Moe(comm, c.config(), grad_accumulation=mode)  # shared by both blocks, as a model's layers
            block = new_block(c, moe, mode)
            block.impl = impl
            want = block_steps(c, block, block, mode)
            counters = fresh_compile(c)
            block = new_block(c, moe, mode)
            block.impl = impl
            got = block_steps(c, block, torch.compile(block, fullgraph=True, backend="aot_eager"), mode)
            compare_bits(c, what, want, got)
            no_graph_breaks(c, counters, what)
            moe.close()
    c.note("aot_eager: 3 steps x {fused, baseline} x {grad, main_grad}: every output and gradient equal eager's bits")


@gpu_test
def compiled_training_with_inductor(c):
    """The default backend (inductor), fullgraph=True: the experts with routing given
    (forward_routed; topk_weights a leaf) equal eager's bits (y, the loss, dx, d
    topk_weights, the expert gradients, the parameters after each step); the whole block,
    router included, runs a step with no graph break and within 2e-2 of eager (its
    softmax is inductor's kernel, whose last bits may differ)."""
    torch, cm = c.torch, c.cm
    comm = compile_comm(c)
    moe = cm.Moe(comm, c.config())

    def routed_steps(compiled):
        block = new_block(c, moe, "grad")
        block.impl = "fused"

        def routed(x, ids, w):
            return block.forward_routed(x, ids, w)
        f = torch.compile(routed, fullgraph=True) if compiled else routed
        g = torch.Generator(device=c.device)
        g.manual_seed(700 + c.rank)
        opt = torch.optim.SGD([block.w13, block.w2], lr=0.05)
        out = []
        for step in range(3):
            m = (256, 100)[c.rank % 2] - 16 * step
            x = torch.randn(m, H, device=c.device, generator=g).to(torch.bfloat16).requires_grad_(True)
            ids = torch.multinomial(torch.ones(m, E, device=c.device), TOP_K, generator=g).to(torch.int32)
            w = (torch.rand(m, TOP_K, device=c.device, generator=g) + 0.1).requires_grad_(True)
            dy = torch.randn(m, H, device=c.device, generator=g)
            y = f(x, ids, w)
            loss = (y.float() * dy).sum()
            loss.backward()
            torch.cuda.synchronize()
            out.append(dict(y=y.detach().clone(), loss=loss.detach(), dx=x.grad.clone(), dw=w.grad.clone(),
                            w13=block.w13.grad.clone(), w2=block.w2.grad.clone()))
            opt.step()
            opt.zero_grad()
        out.append(dict(w13=block.w13.detach().clone(), w2=block.w2.detach().clone()))
        return out

    want = routed_steps(False)
    counters = fresh_compile(c)
    compare_bits(c, "inductor, routing given", want, routed_steps(True))
    no_graph_breaks(c, counters, "inductor, routing given")
    # The whole block under inductor: close to eager, no graph break. One step: after an
    # optimizer step on gradients that differ in their last bits, a token whose two best
    # experts nearly tie may pick another, which changes its row wholly.
    block = new_block(c, moe, "grad")
    want = block_steps(c, block, block, "grad", steps=1)
    counters = fresh_compile(c)
    block = new_block(c, moe, "grad")
    got = block_steps(c, block, torch.compile(block, fullgraph=True), "grad", steps=1)
    no_graph_breaks(c, counters, "inductor, the whole block")
    worst, same = 0.0, 0
    for a, b in zip(want, got):
        for key in a:
            ref = a[key].float()
            err = ((b[key].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            worst = max(worst, err)
            same += int(torch.equal(a[key], b[key]))
            if not err < 2e-2:
                c.failures.append(f"inductor, the whole block: {key} relative error {err:.3g} (limit 2e-2)")
    c.note(f"inductor, the whole block: worst relative error {worst:.2e} against eager; "
           f"{same} of {sum(len(a) for a in want)} tensors equal in bits")
    moe.close()


@gpu_test
def compiled_megatron_layer_matches_eager_bits(c):
    """Megatron's CometMoELayer (its TopKRouter, comet's experts) compiled with
    fullgraph=True, backend aot_eager, against eager over two micro-batches: the output,
    the loss, dx, the router's gradient and the experts' gradients (.grad, and fp32
    main_grad with Megatron's grad_added_to_main_grad), bit for bit; no graph break."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        c.skip(f"megatron-core is not installed ({e})")
    torch = c.torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from comet_moe.megatron import CometMoELayer
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=c.world)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)
    comm = compile_comm(c)
    s, b = 64, 2
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=8,
                               num_moe_experts=E, moe_router_topk=TOP_K, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, moe_token_dispatcher_type="alltoall",
                               bf16=True, params_dtype=torch.bfloat16, expert_model_parallel_size=c.world,
                               moe_router_load_balancing_type="none")
    pgs = get_default_pg_collection()
    for mode in ("grad", "main_grad"):
        layers = [CometMoELayer(config, max_tokens=s * b, pg_collection=pgs, comm=comm, grad_accumulation=mode,
                                share_handle=False) for _ in range(2)]
        with torch.no_grad():  # the same weights in both (Megatron's initialisation draws from forked RNG states)
            for mine, theirs in zip(layers[1].parameters(), layers[0].parameters()):
                mine.copy_(theirs)
        # Megatron's router keeps its weight on the CPU until its first forward moves it
        # there (a .data assignment, which Dynamo cannot trace): the layers go to the GPU
        # first, as a model does before it is compiled.
        for layer in layers:
            layer.cuda()

        def run(layer, compiled):
            if mode == "main_grad":
                for p in (layer.w13, layer.w2):
                    p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape, device=c.device), False
            f = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
            g = torch.Generator(device=c.device)
            g.manual_seed(900 + c.rank)
            out = []
            for _ in range(2):
                x = torch.randn(s, b, H, device=c.device, generator=g).to(torch.bfloat16).requires_grad_(True)
                dy = torch.randn(s, b, H, device=c.device, generator=g)
                y, _ = f(x)
                loss = (y.float() * dy).sum()
                loss.backward()
                torch.cuda.synchronize()
                comm.check_async_error()
                got = dict(y=y.detach().clone(), loss=loss.detach(), dx=x.grad.clone(),
                           router=layer.router.weight.grad.clone())
                for name, p in (("w13", layer.w13), ("w2", layer.w2)):
                    if mode == "main_grad":
                        if p.grad_added_to_main_grad is not True:
                            c.failures.append(f"{mode}: {name}.grad_added_to_main_grad not set")
                        got[name] = p.main_grad.clone()
                        p.grad = None  # as Megatron's DDP hook does
                    else:
                        got[name] = p.grad.clone()
                out.append(got)
            layer.moe.close()
            return out
        want = run(layers[0], False)
        counters = fresh_compile(c)
        compare_bits(c, f"CometMoELayer, {mode}", want, run(layers[1], True))
        no_graph_breaks(c, counters, f"CometMoELayer, {mode}")


@gpu_test
def operators_pass_opcheck_and_fakes_match(c):
    """torch.library.opcheck with comet's kernels: forward and forward_out every part;
    forward_train its schema, autograd registration and fake-against-real parts (its AOT
    part compares the saved state's bytes, which comet leaves partly unwritten: rows past
    those received; the compiled training tests stand for it). Under FakeTensorMode the
    saved state's size is comet_moe_saved_bytes, the size of the real one."""
    torch, cm = c.torch, c.cm
    from torch._subclasses.fake_tensor import FakeTensorMode
    comm = compile_comm(c)
    with cm.Moe(comm, c.config(), max_recv_rows=1000) as moe:  # a bound under the worst case at any world size
        block = new_block(c, moe, "grad")
        m = (120, 64)[c.rank % 2]
        x = c.tokens(m)
        ids, w = c.routing(m, "random")
        weights = (block.w13.detach(), None, None, block.w2.detach())
        for impl in (cm.IMPL_FUSED, cm.IMPL_BASELINE):
            args = (moe._op_id, x, ids, w, *weights, impl, None)
            for op, extra in ((torch.ops.comet_moe.forward.default, ()),
                              (torch.ops.comet_moe.forward_out.default, (c.poisoned(m),))):
                result = torch.library.opcheck(op, args + extra, raise_exception=False)
                bad = {k: v for k, v in result.items() if v != "SUCCESS"}
                if bad:
                    c.failures.append(f"opcheck {op} (impl {impl}): {bad}")
            targs = (moe._op_id, x.clone().requires_grad_(True), ids, w.clone().requires_grad_(True),
                     block.w13, None, None, block.w2, None, None, None, None, impl, [0, 0, 0, 0])
            result = torch.library.opcheck(torch.ops.comet_moe.forward_train.default, targs, raise_exception=False,
                                           test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
            bad = {k: v for k, v in result.items() if v != "SUCCESS"}
            if bad:
                c.failures.append(f"opcheck forward_train (impl {impl}): {bad}")
        torch.cuda.synchronize()
        comm.check_async_error()
        y, saved = torch.ops.comet_moe.forward_train(moe._op_id, x, ids, w, *weights, None, None, None, None,
                                                     cm.IMPL_AUTO, [0, 0, 0, 0])
        with FakeTensorMode(allow_non_fake_inputs=True):
            fy, fsaved = torch.ops.comet_moe.forward_train(moe._op_id, x, ids, w, *weights, None, None, None, None,
                                                           cm.IMPL_AUTO, [0, 0, 0, 0])
        want = moe._comet_saved_bytes()
        check((saved.numel(), fsaved.numel()) == (want, want) and saved.dtype == fsaved.dtype == torch.uint8,
              f"saved state: real {saved.numel()}, fake {fsaved.numel()}, comet_moe_saved_bytes {want}")
        check((fy.shape, fy.dtype, fy.stride()) == (y.shape, y.dtype, y.stride()), "y: fake against real")
        dx, dw, *dweights = torch.ops.comet_moe.backward(moe._op_id, saved, torch.ones_like(y), None, *weights,
                                                         None, None, None, None, cm.IMPL_AUTO)
        torch.cuda.synchronize()
        check(tuple(dx.shape) == (m, H) and tuple(dw.shape) == (m, TOP_K) and dweights[0].shape == block.w13.shape,
              "backward's outputs")
        c.note(f"saved state {want} bytes (max_recv_rows 1000), fake and real alike")


@gpu_test
def close_the_compile_comm(c):
    if getattr(c, "comm_compile", None) is not None:
        c.comm_compile.close()
        c.comm_compile = None
