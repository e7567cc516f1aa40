"""gpu_train.py - training through comet_moe under torch autograd, run by test_torch_gpu.py
(its runner, its Ctx `c`): CometSparseMoeBlock's every gradient (the input, the router
weight, every local expert weight, and the routing weights when they are a leaf) against
torch autograd on a plain-PyTorch Mixtral block written out here in float32 from the same
bf16 weights; both of comet's paths; random and skewed routing; gradients accumulated over
micro-batches (.grad) and into fp32 main_grad; nothing saved under no_grad; a second
backward through the same graph refused.

Tolerances, from bf16 (as tests/test_backward.c derives them): comet's gradients pass
through up to ten bf16 roundings of 2^-9 each, so the norm-wise relative error stays
under 2e-2; element by element within 2e-2 of the element plus 5% of its tensor's RMS (a
sum whose terms cancel errs by its terms' roundings, not its own). An element from the
wrong row or left unwritten is off by about 100%.
"""

H, FFN, E, TOP_K, MAX_TOKENS = 512, 256, 8, 2, 512  # as test_torch_gpu.py's
NORM_TOL, SELF_TOL, RMS_TOL = 2e-2, 2e-2, 5e-2
TESTS = []


def gpu_test(fn):
    TESTS.append(fn)
    return fn


class Failed(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise Failed(msg)


def raises(exc_type, fn, *contains):
    """fn() must raise exc_type whose message holds every string of `contains`; returns it."""
    try:
        fn()
    except exc_type as e:
        for s in contains:
            check(s in str(e), f"{type(e).__name__} message {str(e)!r} lacks {s!r}")
        return e
    except Exception as e:
        raise Failed(f"expected {exc_type.__name__}, got {type(e).__name__}: {e}") from None
    raise Failed(f"expected {exc_type.__name__}, nothing was raised")


def compare_grad(c, what, got, ref, ref_bf16=False):
    """got against the reference (float32 unless ref_bf16): no NaN, norm-wise and element by element (see
    the module's note). ref_bf16: the reference is itself a bf16 computation with roundings
    of its own, as many as comet's, so the difference may reach the sum of both errors:
    every tolerance doubles. A miss is recorded (the rank goes on with the collective
    calls)."""
    torch = c.torch
    if got is None:
        c.failures.append(f"{what}: no gradient")
        return
    got, ref = got.float(), ref.float()
    if not torch.isfinite(got).all().item():
        c.failures.append(f"{what}: NaN or Inf in the gradient")
        return
    if ref.numel() == 0:
        return
    d = (got - ref).abs()
    rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    rms = ref.pow(2).mean().sqrt()
    scale = 2 if ref_bf16 else 1
    limit = scale * (SELF_TOL * ref.abs() + RMS_TOL * rms)
    worst = (d - limit).flatten().argmax()
    if not rel <= scale * NORM_TOL:
        c.failures.append(f"{what}: relative error {rel:.3g} (limit {scale * NORM_TOL})")
    elif (d > limit).any().item():
        i = worst.item()
        over = (d > limit).flatten().nonzero().flatten()
        where = ", ".join(f"[{j}] {got.flatten()[j].item():.4g} vs {ref.flatten()[j].item():.4g}"
                          for j in over[:8].tolist())
        c.failures.append(f"{what}[{i}] = {got.flatten()[i].item():.6g}, reference {ref.flatten()[i].item():.6g} "
                          f"(limit {limit.flatten()[i].item():.3g}); {over.numel()} of {d.numel()} over the "
                          f"limit: {where}; RMS {rms.item():.4g}, the error's RMS "
                          f"{(got - ref).pow(2).mean().sqrt().item():.3g}")
    c.note(f"{what}: relative error {rel:.2e}")


class Reference:
    """The plain-PyTorch block in float32 with autograd: every expert's weights (float32
    leaves), the router weight, on this rank's tokens."""

    def __init__(self, c):
        torch = c.torch
        sd = c.full_sd
        leaf = lambda t: t.to(c.device).float().requires_grad_(True)  # noqa: E731
        self.gate = leaf(sd["gate.weight"])
        self.w1 = leaf(torch.stack([sd[f"experts.{e}.w1.weight"] for e in range(E)]))
        self.w3 = leaf(torch.stack([sd[f"experts.{e}.w3.weight"] for e in range(E)]))
        self.w2 = leaf(torch.stack([sd[f"experts.{e}.w2.weight"] for e in range(E)]))
        self.torch, self.c = torch, c

    def experts(self, x, ids, weights):
        torch, F = self.torch, self.torch.nn.functional
        y = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (ids.long() == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = F.silu(x[tok] @ self.w1[e].T) * (x[tok] @ self.w3[e].T)
            y = y.index_add(0, tok, (h @ self.w2[e].T) * weights[tok, slot].unsqueeze(1))
        return y

    def block(self, x, ids):
        """The router on x (float32), with the experts comet's block picked (bf16 logits
        may tie differently), weights renormalised over them."""
        F = self.torch.nn.functional
        probs = F.softmax(x @ self.gate.T, dim=-1)
        w = probs.gather(1, ids.long())
        return self.experts(x, ids, w / w.sum(-1, keepdim=True))

    def expert_grads(self, block):
        """The reference's expert gradients summed over every rank (an expert's gradient
        sums the rows of every rank routed to it), this rank's experts, packed as comet's
        block keeps them (w13 [E_local, 2F, H], w2 [E_local, H, F])."""
        torch = self.torch
        g = [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in (self.w1, self.w3, self.w2)]
        if self.c.world > 1:
            for t in g:
                self.c.dist.all_reduce(t)
        lo, hi = block.first_expert, block.first_expert + block.experts_per_rank
        return torch.cat([g[0][lo:hi], g[1][lo:hi]], dim=1), g[2][lo:hi]


def new_block(c, **kw):
    block = c.cm.CometSparseMoeBlock(c.comm, c.config(), **kw)
    block.load_state_dict(c.full_sd)
    return block


def router_ids(c, block, x):
    with c.torch.no_grad():
        _, ids = c.torch.topk(block.gate(x).float().softmax(-1), TOP_K, dim=-1)
    return ids


def run_block(c, impl, x, dy):
    """The whole block (router included) under autograd: its output and gradients."""
    block = new_block(c, impl=impl)
    xg = x.clone().requires_grad_(True)
    y, _ = block(xg)
    y.backward(dy)
    c.torch.cuda.synchronize()
    c.comm.check_async_error()
    out = dict(y=y.detach(), dx=xg.grad, router=block.gate.weight.grad, w13=block.w13.grad, w2=block.w2.grad)
    ids = router_ids(c, block, x)
    block.close()
    return out, ids


@gpu_test
def block_gradients_match_torch_autograd(c):
    """Both paths on the same tokens, each against the float32 reference and against
    each other."""
    torch = c.torch
    m = (300, 77)[c.rank % 2]
    x = c.tokens(m)
    dy = torch.randn((m, H), device=c.device, generator=c.gen).to(torch.bfloat16)
    got = {}
    for impl in ("fused", "baseline"):
        got[impl], ids = run_block(c, impl, x, dy)
        ref = Reference(c)
        xr = x.float().requires_grad_(True)
        ref.block(xr, ids).backward(dy.float())
        g13, g2 = ref.expert_grads(ref_block(c))
        want = dict(dx=xr.grad, router=ref.gate.grad, w13=g13, w2=g2)
        for name, w in want.items():
            compare_grad(c, f"{impl}: {name}", got[impl][name], w)
    for name in ("y", "dx", "router", "w13", "w2"):
        compare_grad(c, f"fused against baseline: {name}", got["fused"][name], got["baseline"][name])


def ref_block(c):
    """What Reference.expert_grads needs of a block: this rank's experts."""
    class Experts:
        per = E // (c.world // 1)
        first_expert = c.rank * per
        experts_per_rank = per
    return Experts


@gpu_test
def routed_gradients_match_torch_skewed(c):
    """forward_routed with a skewed routing and the routing weights a leaf: their gradient
    too, and a rank with no tokens; both paths on the same inputs."""
    torch = c.torch
    for name, ms, kw in (("skewed x16", (200, 129), dict(kind="skewed", skew=16.0)),
                         ("a rank with no tokens", (0, 150), dict(kind="random"))):
        m = ms[c.rank % 2]
        x = c.tokens(m)
        ids, w = c.routing(m, **kw)
        dy = torch.randn((m, H), device=c.device, generator=c.gen).to(torch.bfloat16)
        ref = Reference(c)
        xr, wr = x.float().requires_grad_(True), w.clone().requires_grad_(True)
        if m:  # no tokens: every reference gradient is 0
            ref.experts(xr, ids, wr).backward(dy.float())
        g13, g2 = ref.expert_grads(ref_block(c))
        got = {}
        for impl in ("fused", "baseline"):
            block = new_block(c, impl=impl)
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            block.forward_routed(xg, ids, wg).backward(dy)
            torch.cuda.synchronize()
            got[impl] = dict(dx=xg.grad, dw=wg.grad, w13=block.w13.grad, w2=block.w2.grad)
            if m:
                compare_grad(c, f"{impl}, {name}: dx", xg.grad, xr.grad)
                compare_grad(c, f"{impl}, {name}: d topk_weights", wg.grad, wr.grad)
            compare_grad(c, f"{impl}, {name}: w13", block.w13.grad, g13)
            compare_grad(c, f"{impl}, {name}: w2", block.w2.grad, g2)
            block.close()
        for part in ("w13", "w2") + (("dx", "dw") if m else ()):
            compare_grad(c, f"{name}: fused against baseline: {part}", got["fused"][part], got["baseline"][part])


@gpu_test
def gradients_accumulate_over_micro_batches(c):
    """Two micro-batches: .grad holds the sum (autograd adds comet's bf16 gradients);
    with grad_accumulation="main_grad" the fp32 main_grad does, and .grad stays None."""
    torch = c.torch
    for mode in ("grad", "main_grad"):
        block = new_block(c, grad_accumulation=mode)
        if mode == "main_grad":
            for p in (block.w13, block.w2):
                p.main_grad = torch.full(p.shape, 0.5, dtype=torch.float32, device=c.device)
        ref = Reference(c)
        for step in range(2):
            m = (160, 96)[(c.rank + step) % 2]
            x = c.tokens(m).requires_grad_(True)
            ids, w = c.routing(m, "random")
            y = block.forward_routed(x, ids, w)
            dy = torch.randn(y.shape, device=c.device, generator=c.gen).to(torch.bfloat16)
            y.backward(dy)
            ref.experts(x.detach().float(), ids, w).backward(dy.float())
        torch.cuda.synchronize()
        g13, g2 = ref.expert_grads(block)
        if mode == "grad":
            compare_grad(c, "two micro-batches: w13.grad", block.w13.grad, g13)
            compare_grad(c, "two micro-batches: w2.grad", block.w2.grad, g2)
        else:
            check(block.w13.grad is None and block.w2.grad is None, "main_grad: .grad was set too")
            compare_grad(c, "two micro-batches: w13.main_grad - 0.5", block.w13.main_grad - 0.5, g13)
            compare_grad(c, "two micro-batches: w2.main_grad - 0.5", block.w2.main_grad - 0.5, g2)
        block.close()


@gpu_test
def resend_x_gives_the_same_gradients(c):
    """A layer whose config resends x (its saved states keep no x rows; the backward sends
    the forward's x again) against one that keeps them: the same output and gradients, bit
    for bit, on both paths."""
    torch = c.torch
    m = (300, 77)[c.rank % 2]
    x = c.tokens(m)
    dy = torch.randn((m, H), device=c.device, generator=c.gen).to(torch.bfloat16)
    for impl in ("fused", "baseline"):
        outs = []
        for resend in (0, 1):
            block = c.cm.CometSparseMoeBlock(c.comm, c.config(resend_x=resend), impl=impl)
            block.load_state_dict(c.full_sd)
            xg = x.clone().requires_grad_(True)
            y, _ = block(xg)
            y.backward(dy)
            torch.cuda.synchronize()
            c.comm.check_async_error()
            outs.append(dict(y=y.detach(), dx=xg.grad, router=block.gate.weight.grad, w13=block.w13.grad,
                             w2=block.w2.grad))
            block.close()
        for name, kept in outs[0].items():
            check(torch.equal(kept, outs[1][name]), f"{impl}: {name} with x sent again differs from x kept")


@gpu_test
def no_grad_saves_nothing_and_backward_runs_once(c):
    torch = c.torch
    block = new_block(c)
    x = c.tokens(64)
    with torch.no_grad():
        y, _ = block(x)
    check(not y.requires_grad, "under no_grad the output requires grad")
    x.requires_grad_(True)
    y, _ = block(x)
    check(y.requires_grad and y.grad_fn is not None, "under autograd the output has no grad_fn")
    loss = y.float().square().sum()
    loss.backward(retain_graph=True)
    torch.cuda.synchronize()
    try:
        loss.backward()
        raise Failed("a second backward through the same graph was not refused")
    except c.cm.CometInvalidArgumentError as e:
        check("consumes" in str(e), f"the refusal does not say why: {e}")
    # out= cannot be taken under autograd: refused before anything is launched.
    try:
        block(x, out=torch.empty_like(x))
        raise Failed("out= under autograd was taken")
    except ValueError as e:
        check("under autograd" in str(e), f"message: {e}")
    block.close()
