#!/usr/bin/env python3
"""test_torch_gpu.py - the comet_moe package on GPUs: a communicator made from a
torch.distributed process group, CometSparseMoeBlock against a plain-PyTorch Mixtral
block written out here (float32, from the same bf16 weights) on random, skewed and
one-expert routing, with both of comet's paths (baseline and fused, and auto), outputs
poisoned with NaN before every call, also with tensor parallelism inside the experts
(tp_size 2: each rank holds ffn / 2 columns of its experts); training under autograd, every
gradient against torch's (gpu_train.py); Megatron's CometMoELayer against Megatron's own
MoELayer (gpu_megatron.py); torch.compile(fullgraph=True) of training steps against eager,
bit for bit, and opcheck of comet's custom operators (gpu_compile.py); block-scaled FP8:
comet's quantizers byte for byte against torch's, the FP8 block against the bf16 block on
the dequantized weights, an FP8 checkpoint loaded, FP8 training from bf16 master weights (gpu_fp8.py; `-v fp8`
runs these alone); and the error paths:
wrong dtype, device, size or layout raise in Python before anything is launched, and an
expert id out of range or a bad config raise CometError with comet's own message.

    torchrun --nproc-per-node N python/tests/test_torch_gpu.py [-v] [SUBSTRING...]    (N >= 1; N = 2 runs all)

Needs N Hopper GPUs on one NVLink node, torch (>= 2.4; torch.compile's tests are written
for 2.11), and build/libcomet.so (`make`); megatron-core for the Megatron tests; without
torch or GPUs every test prints SKIP and says why, a library that does not load fails the
run, and at one rank the tests that need two print SKIP (each says "needs 2 ranks").
Rank 0 prints PASS/FAIL/SKIP per test (a test passes when it passed on every rank) and
ends with "N passed, N failed, N skipped"; every rank exits 1 when anything failed. A
test that hangs is reported and the run stopped after its time limit.

Under pytest (`pytest python/tests`), this file's one test, test_gpu_suite_under_torchrun,
runs this suite through torchrun on every visible GPU, and skips where there is none.
"""
import os

# Before anything can initialise NCCL: NVLink multicast off. comet never uses it
# (src/comm/symmetric.cu), and on a host whose GPUs are shared it can take them down.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import gc  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from gpu_train import check, raises  # noqa: E402 - the checks every GPU test module shares

H, FFN, E, TOP_K, MAX_TOKENS = 512, 256, 8, 2, 512  # a shape on the 128-column grid
IMPLS = ("baseline", "fused", "auto")
TEST_TIMEOUT_S = 180
TESTS = []


def gpu_test(fn):
    TESTS.append(fn)
    return fn


class Skip(Exception):
    """Raised by a test that cannot run at this world size (the same on every rank)."""


class Ctx:
    """What every test gets: torch, the process group's ranks, the communicator, the
    full (all experts) state dict on every rank, and a log of notes."""

    def __init__(self, torch, dist, comet_moe, rank, world, local):
        self.torch, self.dist, self.cm = torch, dist, comet_moe
        self.rank, self.world, self.local = rank, world, local
        self.device = torch.device("cuda", local)
        self.notes, self.failures = [], []
        self.comm = None
        self.block = None
        g = torch.Generator().manual_seed(1234)  # the same weights on every rank
        sd = {"gate.weight": (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16)}
        for e in range(E):
            sd[f"experts.{e}.w1.weight"] = (torch.randn(FFN, H, generator=g) / H ** 0.5).to(torch.bfloat16)
            sd[f"experts.{e}.w3.weight"] = (torch.randn(FFN, H, generator=g) / H ** 0.5).to(torch.bfloat16)
            sd[f"experts.{e}.w2.weight"] = (torch.randn(H, FFN, generator=g) / FFN ** 0.5).to(torch.bfloat16)
        self.full_sd = sd
        # float32 copies on the GPU for the reference
        self.ref_w = {k: v.to(self.device).float() for k, v in sd.items()}
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(99 + rank)

    def note(self, msg):
        self.notes.append(f"rank {self.rank}: {msg}")

    def skip(self, reason):
        """For tests in other modules: this test cannot run here (the same on every rank)."""
        raise Skip(reason)

    def config(self, **changes):
        cfg = self.cm.MoeConfig(hidden=H, ffn=FFN, num_experts=E, top_k=TOP_K, max_tokens=MAX_TOKENS)
        for k, v in changes.items():
            setattr(cfg, k, v)
        return cfg

    # ---- inputs ----

    def tokens(self, m):
        return self.torch.randn(m, H, device=self.device, dtype=self.torch.bfloat16, generator=self.gen)

    def routing(self, m, kind, skew=16.0, expert=0):
        """(topk_ids int32, topk_weights float32): 'random' (k distinct experts, uniform),
        'skewed' (expert e drawn with weight skew^(-e/(E-1))) or 'one' (choice 0 is
        `expert` for every token, the rest distinct and random)."""
        torch = self.torch
        w = torch.ones(E, device=self.device)
        if kind == "skewed":
            w = skew ** (-torch.arange(E, device=self.device, dtype=torch.float32) / (E - 1))
        if m == 0:
            ids = torch.empty(0, TOP_K, dtype=torch.int64, device=self.device)
        elif kind == "one":
            w[expert] = 0
            rest = torch.multinomial(w.expand(m, E), TOP_K - 1, replacement=False, generator=self.gen)
            ids = torch.cat([torch.full((m, 1), expert, device=self.device, dtype=torch.int64), rest], 1)
        else:
            ids = torch.multinomial(w.expand(m, E), TOP_K, replacement=False, generator=self.gen)
        weights = torch.rand(m, TOP_K, device=self.device, generator=self.gen) + 0.1
        return ids.to(torch.int32).contiguous(), (weights / weights.sum(1, keepdim=True)).contiguous()

    def poisoned(self, m):
        return self.torch.full((m, H), float("nan"), dtype=self.torch.bfloat16, device=self.device)

    # ---- the plain-PyTorch reference ----

    def reference_route(self, x, logits):
        """Hugging Face Mixtral's router, written out. The top-k runs on the block's own
        logits (bf16 ties would otherwise let two GEMMs pick different experts); the
        logits are checked against F.linear's apart."""
        torch, F = self.torch, self.torch.nn.functional
        want = F.linear(x, self.full_sd["gate.weight"].to(self.device))
        check(torch.allclose(logits.float(), want.float(), rtol=1e-2, atol=1e-2),
              "router logits differ from F.linear(x, gate.weight)")
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        w, ids = torch.topk(probs, TOP_K, dim=-1)
        return ids, w / w.sum(dim=-1, keepdim=True)

    def reference_experts(self, x, ids, weights, ref_w=None):
        """y[t] = sum_j w[t, j] * W2_e (silu(W1_e x) * (W3_e x)), e = ids[t, j], in float32
        with every expert's weights (no expert parallelism, no communication): self.ref_w,
        or `ref_w` in its form ({"experts.{e}.w1.weight": float32 on the GPU, ...})."""
        torch, F, ref_w = self.torch, self.torch.nn.functional, self.ref_w if ref_w is None else ref_w
        xf = x.float()
        y = torch.zeros_like(xf)
        for e in range(E):
            tok, slot = (ids.long() == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = F.silu(xf[tok] @ ref_w[f"experts.{e}.w1.weight"].T) * (xf[tok] @ ref_w[f"experts.{e}.w3.weight"].T)
            y.index_add_(0, tok, (h @ ref_w[f"experts.{e}.w2.weight"].T) * weights[tok, slot].float().unsqueeze(1))
        return y

    def compare(self, what, y, ref):
        """No NaN (the poison is gone), relative error (L2) under 1e-2 over the call and
        under 3e-2 on every row, as the C tests require. A miss is recorded, not raised,
        so this rank goes on making the same collective calls as the others; the test
        fails when it ends. Returns the relative error."""
        torch = self.torch
        if torch.isnan(y).any().item():
            self.failures.append(f"{what}: NaN in the output (poison left, or computed)")
            return float("inf")
        if y.shape[0] == 0:
            self.note(f"{what}: no tokens")
            return 0.0
        d = y.float() - ref
        err = (d.norm() / ref.norm()).item()
        rows = (d.norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30))
        worst, where = rows.max(0)
        if not err < 1e-2:
            self.failures.append(f"{what}: relative error {err:.3g} (limit 1e-2)")
        elif not worst.item() < 3e-2:
            self.failures.append(f"{what}: row {where.item()} relative error {worst.item():.3g} (limit 3e-2)")
        self.note(f"{what}: {y.shape[0]} tokens, relative error {err:.2e}, worst row {worst.item():.2e}")
        return err


# ---- the tests, in the order they run (each rank runs each, in step) ----

@gpu_test
def comm_from_process_group(c):
    cm = c.cm
    c.comm = cm.Comm.from_process_group(timeout_ms=10000)
    check(c.comm.rank == c.rank and c.comm.size == c.world, f"comm rank/size {c.comm.rank}/{c.comm.size}, "
          f"process group {c.rank}/{c.world}")
    check(c.comm.device_index == c.local, f"comm on cuda:{c.comm.device_index}, current device cuda:{c.local}")
    c.note(f"{c.comm!r}, {cm.version()}, NCCL {cm.nccl_version()}, library {cm.library_path()}")


@gpu_test
def block_loads_this_ranks_experts(c):
    torch = c.torch
    c.block = c.cm.CometSparseMoeBlock(c.comm, c.config())
    result = c.block.load_state_dict(c.full_sd)
    check(not result.missing_keys and not result.unexpected_keys, f"load_state_dict: {result}")
    per = E // c.world
    check(list(c.block.local_experts) == list(range(c.rank * per, (c.rank + 1) * per)),
          f"local experts {list(c.block.local_experts)}")
    for le, e in enumerate(c.block.local_experts):
        check(torch.equal(c.block.w13[le, :FFN].cpu(), c.full_sd[f"experts.{e}.w1.weight"]), f"expert {e} w1")
        check(torch.equal(c.block.w13[le, FFN:].cpu(), c.full_sd[f"experts.{e}.w3.weight"]), f"expert {e} w3")
        check(torch.equal(c.block.w2[le].cpu(), c.full_sd[f"experts.{e}.w2.weight"]), f"expert {e} w2")


@gpu_test
def block_matches_torch_random_routing(c):
    torch = c.torch
    m = (300, 77)[c.rank % 2]  # not multiples of 128, different on each rank
    for impl in IMPLS:
        c.block.impl = impl
        x = c.tokens(m)
        out = c.poisoned(m)
        with torch.inference_mode():
            y, logits = c.block(x, out=out)
        torch.cuda.synchronize()
        c.comm.check_async_error()
        check(tuple(logits.shape) == (m, E) and logits.dtype == torch.bfloat16, f"{impl}: router logits "
              f"{tuple(logits.shape)} {logits.dtype}")
        ids, w = c.reference_route(x, logits)
        check(y.data_ptr() == out.data_ptr(), f"{impl}: y is not the out tensor")
        c.compare(f"{impl}, router's routing", y, c.reference_experts(x, ids, w))
        # A 3-D batch is flattened and given back in its shape.
        x3 = c.tokens(2 * 24).view(2, 24, H)
        with torch.inference_mode():
            y3, logits3 = c.block(x3)
        torch.cuda.synchronize()
        ids, w = c.reference_route(x3.view(-1, H), logits3)
        check(tuple(y3.shape) == (2, 24, H), f"{impl}: 3-D output shape {tuple(y3.shape)}")
        c.compare(f"{impl}, [2, 24, H] batch", y3.reshape(-1, H), c.reference_experts(x3.view(-1, H), ids, w))


@gpu_test
def block_matches_torch_skewed_routing(c):
    torch = c.torch
    cases = [("skewed x16", (200, 129), dict(kind="skewed", skew=16.0)),
             (f"every token to expert 6 (rank {6 // (E // c.world)}'s)", (128, 300), dict(kind="one", expert=6)),
             ("every token to expert 0 (rank 0's)", (64, 64), dict(kind="one", expert=0)),
             ("a rank without tokens", (0, 200), dict(kind="random")),
             ("max_tokens on every rank", (MAX_TOKENS, MAX_TOKENS), dict(kind="random"))]
    for impl in IMPLS:
        c.block.impl = impl
        for name, ms, kw in cases:
            m = ms[c.rank % 2]
            x = c.tokens(m)
            ids, w = c.routing(m, **kw)
            out = c.poisoned(m)
            with torch.inference_mode():
                y = c.block.forward_routed(x, ids, w, out=out)
            torch.cuda.synchronize()
            c.comm.check_async_error()
            c.compare(f"{impl}, {name}", y, c.reference_experts(x, ids, w))


@gpu_test
def many_calls_with_changing_token_counts(c):
    torch = c.torch
    g = torch.Generator().manual_seed(7)  # the same impl sequence on every rank
    worst = 0.0
    for i in range(30):
        impl = IMPLS[int(torch.randint(0, 3, (1,), generator=g))]
        c.block.impl = impl
        m = int(torch.randint(0, MAX_TOKENS + 1, (1,), generator=c.gen, device=c.device).item())
        x = c.tokens(m)
        ids, w = c.routing(m, "skewed" if i % 2 else "random", skew=4.0)
        out = c.poisoned(m)
        with torch.inference_mode():
            y = c.block.forward_routed(x, ids, w, out=out)
        torch.cuda.synchronize()
        c.comm.check_async_error()
        before = len(c.notes)
        worst = max(worst, c.compare(f"call {i} ({impl}, {m} tokens)", y, c.reference_experts(x, ids, w)))
        del c.notes[before:]  # one line for all 30 below
    c.note(f"30 calls, impls mixed, 0..{MAX_TOKENS} tokens: worst relative error {worst:.2e}")


@gpu_test
def block_replays_in_a_cuda_graph(c):
    """The fused layer captured in a torch CUDA graph (torch.cuda.graph, its default
    capture mode) and replayed on new inputs copied into the captured tensors: the
    experts alone (routing made elsewhere), each replay against the reference and against
    an eager call on the same inputs, bit for bit; then the whole block, router included."""
    torch = c.torch
    impl, c.block.impl = c.block.impl, "fused"
    m = (200, 77)[c.rank % 2]
    x, out = c.tokens(m), c.poisoned(m)
    ids, w = c.routing(m, "random")
    with torch.inference_mode():
        c.block.forward_routed(x, ids, w, out=out)  # warm-up: the fused path's buffers
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        c.block.forward_routed(x, ids, w, out=out)
    worst, same = 0.0, 0
    for replay in range(4):
        new_ids, new_w = c.routing(m, "skewed" if replay % 2 else "random", skew=8.0)
        x.copy_(c.tokens(m))
        ids.copy_(new_ids)
        w.copy_(new_w)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        c.comm.check_async_error()
        before = len(c.notes)
        worst = max(worst, c.compare(f"replay {replay}", out, c.reference_experts(x, ids, w)))
        del c.notes[before:]
        eager = c.poisoned(m)
        with torch.inference_mode():
            c.block.forward_routed(x, ids, w, out=eager)
        torch.cuda.synchronize()
        if torch.equal(eager.view(torch.int16), out.view(torch.int16)):
            same += 1
        else:
            c.failures.append(f"replay {replay}: y differs from an eager call's on the same inputs")
    c.note(f"4 replays of the captured experts ({m} tokens): worst relative error {worst:.2e}, {same} of 4 "
           f"equal to an eager call bit for bit")
    # The whole block: router (F.linear, softmax, top-k) and experts in one graph.
    xb, yb = c.tokens(m), c.poisoned(m)
    with torch.inference_mode():
        c.block(xb, out=yb)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        _, logits = c.block(xb, out=yb)
    for replay in range(2):
        xb.copy_(c.tokens(m))
        yb.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        c.comm.check_async_error()
        rids, rw = c.reference_route(xb, logits)
        c.compare(f"the whole block, replay {replay}", yb, c.reference_experts(xb, rids, rw))
    del graph
    c.block.impl = impl


@gpu_test
def two_blocks_on_one_comm(c):
    """Two MoE layers over one communicator, called in turns, as the layers of a model
    are (the fused path's buffers are per layer; the communicator's are shared)."""
    torch = c.torch
    with c.cm.CometSparseMoeBlock(c.comm, c.config()) as second:
        g = torch.Generator().manual_seed(4321)
        sd2 = {k: (v.float() + torch.randn(v.shape, generator=g) * 0.01).bfloat16() for k, v in c.full_sd.items()}
        second.load_state_dict(sd2)
        ref2 = {k: v.to(c.device).float() for k, v in sd2.items()}
        m = (256, 100)[c.rank % 2]
        for impl in IMPLS:
            c.block.impl = second.impl = impl
            for _ in range(3):
                x = c.tokens(m)
                ids, w = c.routing(m, "random")
                out1, out2 = c.poisoned(m), c.poisoned(m)
                with torch.inference_mode():
                    y1 = c.block.forward_routed(x, ids, w, out=out1)
                    y2 = second.forward_routed(y1, ids, w, out=out2)  # layer 2 reads layer 1's output
                torch.cuda.synchronize()
                c.comm.check_async_error()
                c.compare(f"{impl}, layer 1", y1, c.reference_experts(x, ids, w))
                c.compare(f"{impl}, layer 2", y2, c.reference_experts(y1, ids, w, ref2))


@gpu_test
def layer_takes_gate_and_up_apart(c):
    torch = c.torch
    with c.cm.Moe(c.comm, c.config()) as moe:
        local = list(moe.local_experts)
        sd = c.full_sd
        gate = torch.stack([sd[f"experts.{e}.w1.weight"] for e in local]).to(c.device)
        up = torch.stack([sd[f"experts.{e}.w3.weight"] for e in local]).to(c.device)
        gate_up = torch.cat([gate, up], dim=1).contiguous()
        down = torch.stack([sd[f"experts.{e}.w2.weight"] for e in local]).to(c.device)
        m = (160, 96)[c.rank % 2]
        for impl in IMPLS:
            x = c.tokens(m)
            ids, w = c.routing(m, "random")
            ref = c.reference_experts(x, ids, w)
            for name, kw in (("gate_up", dict(gate_up=gate_up)), ("gate and up", dict(gate=gate, up=up))):
                out = c.poisoned(m)
                y = moe.forward(x, ids, w, down=down, out=out, impl=impl, **kw)
                torch.cuda.synchronize()
                c.compare(f"Moe.forward, {impl}, {name}", y, ref)
            y = moe(x, ids, w, gate_up=gate_up, down=down, impl=impl)  # out allocated
            torch.cuda.synchronize()
            c.compare(f"Moe.__call__, {impl}, out allocated", y, ref)
    check(moe.closed, "a layer used as a context manager is closed after it")


@gpu_test
def tensor_parallel_block_matches_torch(c):
    """tp_size 2 (on 2 GPUs: EP 1 x TP 2, every rank holds every expert, ffn / 2 = 128
    columns of each): the block loads its slice from the full HF state dict and every
    rank gets its own tokens' complete output, for each impl, against the same float32
    reference; the layer takes gate and up apart too. Then ffn 384 (ffn / 2 = 192: GEMM0's
    last SwiGLU tile half full): fused, auto and baseline against the reference."""
    torch, cm = c.torch, c.cm
    tp = 2
    if c.world % tp:
        raise Skip(f"needs 2 ranks (tp_size {tp}: an even world size; this one is {c.world})")
    Fl, t, per = FFN // tp, c.rank % tp, E // (c.world // tp)
    first = (c.rank // tp) * per
    cols = slice(t * Fl, (t + 1) * Fl)
    with cm.CometSparseMoeBlock(c.comm, c.config(tp_size=tp)) as block:
        check((block.tp_size, block.tp_rank, block.ffn_local) == (tp, t, Fl),
              f"tp_size, tp_rank, ffn_local = {block.tp_size}, {block.tp_rank}, {block.ffn_local}")
        check(list(block.local_experts) == list(range(first, first + per)),
              f"local experts {list(block.local_experts)}")
        result = block.load_state_dict(c.full_sd)
        check(not result.missing_keys and not result.unexpected_keys, f"load_state_dict: {result}")
        check(tuple(block.w13.shape) == (per, 2 * Fl, H) and tuple(block.w2.shape) == (per, H, Fl),
              f"packed shapes {tuple(block.w13.shape)}, {tuple(block.w2.shape)}")
        for le, e in enumerate(block.local_experts):
            sd = {n: c.full_sd[f"experts.{e}.{n}.weight"] for n in ("w1", "w2", "w3")}
            check(torch.equal(block.w13[le, :Fl].cpu(), sd["w1"][cols]), f"expert {e}: w13 rows 0..Fl-1 = w1 rows")
            check(torch.equal(block.w13[le, Fl:].cpu(), sd["w3"][cols]), f"expert {e}: w13 rows Fl.. = w3 rows")
            check(torch.equal(block.w2[le].cpu(), sd["w2"][:, cols]), f"expert {e}: w2 columns")
        cases = [("router's routing", (300, 77), None),
                 ("skewed x16", (200, 129), dict(kind="skewed", skew=16.0)),
                 ("every token to expert 6", (128, 300), dict(kind="one", expert=6)),
                 ("a rank without tokens", (0, 200), dict(kind="random")),
                 ("max_tokens on every rank", (MAX_TOKENS, MAX_TOKENS), dict(kind="random"))]
        for impl in IMPLS:
            block.impl = impl
            for name, ms, kw in cases:
                m = ms[c.rank % 2]
                x = c.tokens(m)
                out = c.poisoned(m)
                if kw is None:
                    with torch.inference_mode():
                        y, logits = block(x, out=out)
                    torch.cuda.synchronize()
                    ids, w = c.reference_route(x, logits)
                else:
                    ids, w = c.routing(m, **kw)
                    with torch.inference_mode():
                        y = block.forward_routed(x, ids, w, out=out)
                    torch.cuda.synchronize()
                c.comm.check_async_error()
                c.compare(f"tp {tp}, {impl}, {name}", y, c.reference_experts(x, ids, w))
        # The whole expert where this rank's slice belongs: refused before launch, naming the dim.
        x = c.tokens(64)
        ids, w = c.routing(64, "random")
        full = torch.zeros(per, 2 * FFN, H, dtype=torch.bfloat16, device=c.device)
        with torch.inference_mode():
            raises(ValueError, lambda: block.moe.forward(x, ids, w, gate_up=full, down=block.w2),
                   f"gate_up.shape = ({per}, {2 * FFN}, {H})", f"2 * ffn / tp_size = {2 * Fl}")
        raises(NotImplementedError, lambda: block.state_dict(), f"tp_size = {tp}")
        # The layer alone, gate and up apart.
        gate, up = block.w13[:, :Fl].contiguous(), block.w13[:, Fl:].contiguous()
        m = (160, 96)[c.rank % 2]
        for impl in ("baseline", "fused"):
            x = c.tokens(m)
            ids, w = c.routing(m, "random")
            out = c.poisoned(m)
            y = block.moe.forward(x, ids, w, gate=gate, up=up, down=block.w2, out=out, impl=impl)
            torch.cuda.synchronize()
            c.compare(f"tp {tp}, Moe.forward, {impl}, gate and up apart", y, c.reference_experts(x, ids, w))
    # ffn 384: ffn / tp_size = 192, a half-full last tile of 128 activation columns.
    F2 = 384
    Fl2, cols2 = F2 // tp, slice(t * (F2 // tp), (t + 1) * (F2 // tp))
    g = torch.Generator().manual_seed(6)  # the same full weights on every rank
    w1 = (torch.randn(E, F2, H, generator=g) / H ** 0.5).bfloat16()
    w3 = (torch.randn(E, F2, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, F2, generator=g) / F2 ** 0.5).bfloat16()
    with cm.Moe(c.comm, c.config(ffn=F2, tp_size=tp)) as moe:
        check(moe.ffn_local == Fl2, f"ffn_local {moe.ffn_local}")
        mine = slice(first, first + per)
        gate_up = torch.cat([w1[mine, cols2], w3[mine, cols2]], dim=1).contiguous().to(c.device)
        down = w2[mine, :, cols2].contiguous().to(c.device)
        m = 100
        x = c.tokens(m)
        ids, w = c.routing(m, "random")
        ys = {}
        for impl in ("fused", "auto", "baseline"):
            out = c.poisoned(m)
            ys[impl] = moe.forward(x, ids, w, gate_up=gate_up, down=down, out=out, impl=impl)
        torch.cuda.synchronize()
        check(torch.equal(ys["fused"], ys["auto"]), "auto took the fused path: the same bits")
        ref = c.reference_experts(x, ids, w, {f"experts.{e}.{n}.weight": v[e].to(c.device).float()
                                              for n, v in (("w1", w1), ("w3", w3), ("w2", w2)) for e in range(E)})
        for impl, y in ys.items():
            c.compare(f"tp {tp}, {impl} with ffn {F2}", y, ref)


@gpu_test
def wrong_arguments_raise_before_launch(c):
    torch, block = c.torch, c.block
    m = 64
    x = c.tokens(m)
    ids, w = c.routing(m, "random")
    out = c.poisoned(m)
    moe = block.moe
    kw = dict(gate_up=block.w13, down=block.w2, out=out)
    with torch.inference_mode():
        raises(TypeError, lambda: moe.forward(x.half(), ids, w, **kw), "x.dtype = torch.float16",
               "expected torch.bfloat16")
        raises(TypeError, lambda: moe.forward(x, ids.long(), w, **kw), "topk_ids.dtype = torch.int64",
               "expected torch.int32")
        raises(TypeError, lambda: moe.forward(x, ids, w.bfloat16(), **kw), "topk_weights.dtype = torch.bfloat16")
        raises(TypeError, lambda: block(x.float()), "hidden_states.dtype = torch.float32")
        raises(ValueError, lambda: moe.forward(x.cpu(), ids, w, **kw), "x is on cpu", f"expected cuda:{c.local}")
        if torch.cuda.device_count() > 1:
            other = torch.device("cuda", (c.local + 1) % torch.cuda.device_count())
            raises(ValueError, lambda: moe.forward(x, ids.to(other), w, **kw), f"topk_ids is on {other}",
                   f"expected cuda:{c.local}")
            raises(ValueError, lambda: block(x.to(other)), f"hidden_states is on {other}")
        else:
            c.note("one visible GPU per process: the other-GPU check is left out")
        big = c.tokens(MAX_TOKENS + 1)
        raises(ValueError, lambda: block(big), f"{MAX_TOKENS + 1} tokens", f"config.max_tokens = {MAX_TOKENS}")
        big_ids, big_w = c.routing(MAX_TOKENS + 1, "random")
        raises(ValueError, lambda: moe.forward(big, big_ids, big_w, gate_up=block.w13, down=block.w2),
               f"x.shape[0] = {MAX_TOKENS + 1} tokens", f"config.max_tokens = {MAX_TOKENS}")
        strided = torch.empty(H, m, dtype=torch.bfloat16, device=c.device).t()
        raises(ValueError, lambda: moe.forward(strided, ids, w, **kw), "x is not contiguous")
        raises(ValueError, lambda: block(strided), "hidden_states is not contiguous")
        raises(ValueError, lambda: moe.forward(x, ids[:, :1].contiguous(), w, **kw), "topk_ids.shape = (64, 1)")
        raises(ValueError, lambda: moe.forward(x, ids, w, gate_up=block.w13[:1], down=block.w2, out=out),
               "gate_up.shape", f"local experts = {E // c.world}")
        raises(ValueError, lambda: moe.forward(x, ids, w, **{**kw, "impl": "fastest"}), "impl = 'fastest'")
    xg = x.float().requires_grad_(True).bfloat16()
    raises(ValueError, lambda: block(xg, out=out), "not taken under autograd")
    torch.cuda.synchronize()
    check(torch.isnan(out).all().item(), "the output was written by a call that raised")
    # The ranks are still in step: a good call on every rank works.
    with torch.inference_mode():
        y = block.forward_routed(x, ids, w, out=out)
    torch.cuda.synchronize()
    c.compare("a good call after the refused ones", y, c.reference_experts(x, ids, w))


@gpu_test
def bad_config_raises_comets_message(c):
    cm = c.cm
    e = raises(cm.CometInvalidArgumentError, lambda: cm.Moe(c.comm, c.config(hidden=100)), "comet_moe_create",
               "config.hidden = 100", "multiple of 64")
    check(e.status == 1 and e.status_name == "COMET_INVALID_ARGUMENT", f"status {e.status} {e.status_name}")
    raises(cm.CometInvalidArgumentError, lambda: cm.Moe(c.comm, c.config(tp_size=c.world + 1)),
           f"config.tp_size = {c.world + 1}", f"must divide the world size {c.world}")
    if c.world > 1:  # with one rank, every expert count divides by ep_size 1
        raises(cm.CometInvalidArgumentError, lambda: cm.Moe(c.comm, c.config(num_experts=c.world * 4 + 1)),
               f"must be divisible by ep_size = {c.world}")
    if c.world % 2 == 0:  # tp_size 2 needs an even world size
        raises(cm.CometInvalidArgumentError, lambda: cm.Moe(c.comm, c.config(ffn=192, tp_size=2)), "config.ffn = 192",
               "tp_size")


@gpu_test
def fused_path_runs_ffn_not_multiple_of_128(c):
    torch, cm = c.torch, c.cm
    with cm.Moe(c.comm, c.config(ffn=192)) as moe:
        g = torch.Generator().manual_seed(5)
        gate_up = (torch.randn(moe.experts_per_rank, 2 * 192, H, generator=g) / H ** 0.5).bfloat16().to(c.device)
        down = (torch.randn(moe.experts_per_rank, H, 192, generator=g) / 192 ** 0.5).bfloat16().to(c.device)
        m = 100
        x = c.tokens(m)
        ids, w = c.routing(m, "random")
        # ffn 192: GEMM0's last SwiGLU tile of 128 columns is half full. Every rank drew
        # the same weights, so global expert e has the weights of local slot
        # e % experts_per_rank everywhere.
        ys = {}
        for impl in ("fused", "baseline"):
            out = c.poisoned(m)
            ys[impl] = moe.forward(x, ids, w, gate_up=gate_up, down=down, out=out, impl=impl)
        torch.cuda.synchronize()
        per = moe.experts_per_rank
        ref = c.reference_experts(x, ids, w, {f"experts.{e}.{n}.weight": v.float() for e in range(E) for n, v in (
            ("w1", gate_up[e % per, :192]), ("w3", gate_up[e % per, 192:]), ("w2", down[e % per]))})
        for impl, y in ys.items():
            c.compare(f"{impl} with ffn 192", y, ref)


@gpu_test
def expert_id_out_of_range_baseline(c):
    torch, cm, block = c.torch, c.cm, c.block
    block.impl = "baseline"
    m, bad = 64, min(1, c.world - 1)  # rank 1 passes the bad id; with one rank, rank 0 (no other rank to tell)
    x = c.tokens(m)
    ids, w = c.routing(m, "random")
    if c.rank == bad:
        ids[5, 1] = E
    with torch.inference_mode():
        if c.rank == bad:
            e = raises(cm.CometInvalidArgumentError, lambda: block.forward_routed(x, ids, w),
                       "comet_moe_forward", f"topk_ids[5][1] = {E} on rank {bad}", f"[0, num_experts = {E})")
        else:
            e = raises(cm.CometRemoteError, lambda: block.forward_routed(x, ids, w), "COMET_REMOTE_ERROR",
                       f"rank {bad} passed an expert id out of [0, {E})")
        c.note(f"baseline: {e}")
        ids, w = c.routing(m, "random")
        out = c.poisoned(m)
        y = block.forward_routed(x, ids, w, out=out)
    torch.cuda.synchronize()
    c.compare("baseline, the call after the bad id", y, c.reference_experts(x, ids, w))


@gpu_test
def expert_id_out_of_range_fused(c):
    torch, cm, block = c.torch, c.cm, c.block
    block.impl = "fused"
    m, bad = 64, min(1, c.world - 1)  # as in the baseline's test
    x = c.tokens(m)
    ids, w = c.routing(m, "random")
    if c.rank == bad:
        ids[5, 1] = E
    with torch.inference_mode():
        block.forward_routed(x, ids, w)  # the fused path finds bad ids on the device
    torch.cuda.synchronize()
    if c.rank == bad:
        e = raises(cm.CometInvalidArgumentError, lambda: c.comm.check_async_error(), "comet_comm_get_async_error",
                   f"topk_ids entry {5 * TOP_K + 1} (token * top_k + choice) = {E}")
        c.note(f"fused: {e}")
    else:
        c.comm.check_async_error()
    c.comm.check_async_error()  # reported once
    ids, w = c.routing(m, "random")
    out = c.poisoned(m)
    with torch.inference_mode():
        y = block.forward_routed(x, ids, w, out=out)
    torch.cuda.synchronize()
    c.comm.check_async_error()
    c.compare("fused, the call after the bad id", y, c.reference_experts(x, ids, w))


@gpu_test
def comm_over_a_gloo_group(c):
    """A second communicator beside the first, its id broadcast on the CPU through a gloo
    group, closed again at once."""
    cm = c.cm
    gloo = c.dist.new_group(backend="gloo")
    with cm.Comm.from_process_group(gloo, timeout_ms=10000) as other:
        check(other.rank == c.rank and other.size == c.world, "comm over a gloo group: rank/size")
        check(other.device_index == c.local, f"comm over a gloo group on cuda:{other.device_index}")
    check(other.closed, "a comm used as a context manager is closed after it")


# Training under autograd (gpu_train.py), Megatron (gpu_megatron.py), torch.compile
# (gpu_compile.py) and FP8 (gpu_fp8.py), before the tests that close the communicator.
from gpu_train import TESTS as _TRAINING_TESTS  # noqa: E402
from gpu_megatron import TESTS as _MEGATRON_TESTS  # noqa: E402
from gpu_compile import TESTS as _COMPILE_TESTS  # noqa: E402
from gpu_fp8 import TESTS as _FP8_TESTS  # noqa: E402

TESTS.extend(_TRAINING_TESTS + _MEGATRON_TESTS + _COMPILE_TESTS + _FP8_TESTS)


@gpu_test
def closing_order_and_use_after_close(c):
    torch, cm = c.torch, c.cm
    comm = cm.Comm.from_process_group(timeout_ms=10000)
    moe = cm.Moe(comm, c.config(max_tokens=64))
    block = cm.CometSparseMoeBlock(comm, c.config(max_tokens=64))
    block.load_state_dict(c.full_sd)
    x = c.tokens(32)
    with torch.inference_mode():
        y, _ = block(x)
    torch.cuda.synchronize()
    comm.close()  # closes both layers first, then the communicator
    check(moe.closed and block.moe.closed and comm.closed, "comm.close() left a layer open")
    raises(RuntimeError, lambda: moe.forward(x, *c.routing(32, "random"), gate_up=block.w13, down=block.w2),
           "used after close")
    with torch.inference_mode():
        raises(RuntimeError, lambda: block(x), "used after close")
    raises(RuntimeError, lambda: comm.check_async_error(), "used after close")
    moe.close(), block.close(), comm.close()  # closing again does nothing
    # Dropped without close(): __del__ destroys the layer, then the communicator (every
    # rank drops them at the same point).
    dropped_comm = cm.Comm.from_process_group(timeout_ms=10000)
    dropped = cm.Moe(dropped_comm, c.config(max_tokens=64))
    del dropped, dropped_comm
    gc.collect()
    c.note("layers and communicators closed in order, explicitly and by the garbage collector")


@gpu_test
def close_the_shared_communicator(c):
    c.block.close()
    check(c.block.moe.closed, "block.close() left its layer open")
    c.comm.close()
    check(c.comm.closed, "comm.close()")


# ---- the runner ----

def skip_all(reason):
    print("".join(f"SKIP {fn.__name__}: {reason}\n" for fn in TESTS) + f"0 passed, 0 failed, {len(TESTS)} skipped")
    return 0


def main():
    verbose = "-v" in sys.argv[1:]
    is_rank0 = os.environ.get("RANK", "0") == "0"
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return skip_all("torch is not installed") if is_rank0 else 0
    if "RANK" not in os.environ:
        return skip_all("needs torchrun: torchrun --nproc-per-node N python/tests/test_torch_gpu.py (N >= 1)")
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
        return skip_all(f"needs a GPU per rank; found {torch.cuda.device_count()}") if is_rank0 else 0
    if torch.cuda.get_device_capability(local)[0] != 9:
        return skip_all(f"needs Hopper GPUs (sm_90); found {torch.cuda.get_device_name(local)}") if is_rank0 else 0
    try:
        import comet_moe
        comet_moe.version()
    except Exception as e:  # noqa: BLE001 - no library: nothing can run, and that is a failure
        print(f"FAIL rank {os.environ['RANK']}: libcomet cannot be loaded: {type(e).__name__}: {e}", flush=True)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference stays float32
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    results_group = dist.new_group(backend="gloo")  # results travel on the CPU, apart from the GPUs' work
    c = Ctx(torch, dist, comet_moe, rank, world, local)
    count = {"pass": 0, "fail": 0, "skip": 0}
    only = [a for a in sys.argv[1:] if a != "-v"]  # substrings of the tests to run (the first one makes the comm)
    for fn in TESTS:
        name = fn.__name__
        if only and fn is not TESTS[0] and not any(o in name for o in only):
            continue
        c.notes, c.failures = [], []
        limit = getattr(fn, "timeout_s", TEST_TIMEOUT_S)  # compiling takes longer
        timer = threading.Timer(limit, lambda n=name: (
            print(f"FAIL {n}: rank {rank} still running after {limit} s; stopping the run", flush=True),
            os._exit(1)))
        timer.daemon = True
        start = time.monotonic()
        timer.start()
        try:
            fn(c)
            mine = ("pass", "")
        except Skip as e:
            mine = ("skip", str(e))
        except Exception as e:  # noqa: BLE001 - reported as this test's failure
            mine = ("fail", f"rank {rank}: {type(e).__name__}: {e}\n" + traceback.format_exc())
        if c.failures:  # recorded misses come first, and fail a test that raised Skip after them
            mine = ("fail", "".join(f"rank {rank}: {f}\n" for f in c.failures) + mine[1] * (mine[0] == "fail"))
        timer.cancel()
        took = time.monotonic() - start
        everyone = [None] * world
        dist.all_gather_object(everyone, (mine, c.notes), group=results_group)
        states = {r[0][0] for r in everyone}
        state = states.pop() if len(states) == 1 else "fail"  # skipped on some ranks only: a failure
        count[state] += 1
        if rank == 0:
            print(f"SKIP {name}: {everyone[0][0][1]}" if state == "skip" else
                  f"{state.upper()} {name} ({took:.2f} s)", flush=True)
            for r, ((st, msg), notes) in enumerate(everyone):
                why = msg.rstrip().splitlines() if st == "fail" else [f"rank {r} skipped it: {msg}"] if st == "skip" else []
                for line in (why if state == "fail" else []) + (notes if verbose or state == "fail" else []):
                    print("    " + line, flush=True)
    if rank == 0:
        print(f"{count['pass']} passed, {count['fail']} failed, {count['skip']} skipped", flush=True)
    dist.barrier(group=results_group)
    dist.destroy_process_group()
    return 1 if count["fail"] else 0


# ---- under pytest ----

def test_gpu_suite_under_torchrun():
    """This suite through torchrun, one rank per visible GPU: its closing line must count no
    failure. Skips, saying what it needs, where torch or Hopper GPUs are missing."""
    import subprocess

    import pytest
    try:
        import torch
    except ImportError:
        pytest.skip("needs torch and Hopper GPUs (run it on a GPU machine: torchrun --nproc-per-node N "
                    "python/tests/test_torch_gpu.py)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        pytest.skip("needs Hopper GPUs (sm_90); none is visible")
    if any(torch.cuda.get_device_capability(i)[0] != 9 for i in range(gpus)):
        pytest.skip(f"needs Hopper GPUs (sm_90); found {torch.cuda.get_device_name(0)}")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), __file__],
                         capture_output=True, text=True, timeout=3600)
    print(run.stdout[-20000:])
    closing = [line for line in run.stdout.splitlines() if line.endswith(" skipped") and " failed, " in line]
    assert run.returncode == 0 and closing and " 0 failed," in closing[-1], \
        f"torchrun on {gpus} GPUs: exit {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"


if __name__ == "__main__":
    sys.exit(main())
