"""test_torch_cpu.py - the tests that need torch, on the CPU against a stand-in for the
comet layer: the router, CometSparseMoeBlock's state dict (this rank's experts, this TP
rank's slice, Hugging Face names) and its forward against HF Mixtral written out. They
skip, saying so, when torch is not installed.
"""
from __future__ import annotations

import comet_moe
from comet_moe import _capi, checks
from helpers import check, check_eq, need_torch, note, raises


# ---- with torch (on the CPU; skipped without it) ----

class FakeComm:
    def __init__(self, torch):
        self.device = torch.device("cpu")
        self.device_index = None


class FakeMoe:
    """Stands in for comet_moe.Moe on the CPU: checks its arguments as Moe.forward does,
    computes what comet_moe_forward computes, from the packed layout comet.h describes,
    in float32, and counts its calls. With tp_size > 1 it gives this TP rank's partial
    sum only (comet adds the other TP ranks' to it)."""

    def __init__(self, torch, cfg, first_expert, experts_per_rank, tp_size=1, tp_rank=0):
        self.torch, self.config, self.comm, self._device = torch, cfg, FakeComm(torch), "cpu"
        self.first_expert, self.experts_per_rank, self.calls = first_expert, experts_per_rank, []
        self.tp_size, self.tp_rank, self.ffn_local = tp_size, tp_rank, int(cfg.ffn) // tp_size

    def forward(self, x, topk_ids, topk_weights, *, gate_up=None, gate=None, up=None, down=None, out=None, impl=0):
        torch, Fd = self.torch, self.ffn_local
        checks.check_forward_args(self.config, self.experts_per_rank, "cpu", x, topk_ids, topk_weights, gate_up, gate,
                                  up, down, out, ffn_local=self.ffn_local, tp_size=self.tp_size)
        if gate_up is None:
            gate_up = torch.cat([gate, up], dim=1)
        self.calls.append((tuple(x.shape), impl))
        y = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                le = int(topk_ids[t, j]) - self.first_expert
                g = gate_up[le, :Fd].float() @ x[t].float()   # rows 0..F-1: gate
                u = gate_up[le, Fd:].float() @ x[t].float()   # rows F..2F-1: up
                y[t] += float(topk_weights[t, j]) * (down[le].float() @ (torch.nn.functional.silu(g) * u))
        y = y.to(torch.bfloat16)
        if out is not None:
            out.copy_(y)
            return out
        return y

    def close(self):
        pass


def hf_state_dict(torch, E, H, Fd, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {"gate.weight": (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16)}
    for i in range(E):
        sd[f"experts.{i}.w1.weight"] = (torch.randn(Fd, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        sd[f"experts.{i}.w3.weight"] = (torch.randn(Fd, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        sd[f"experts.{i}.w2.weight"] = (torch.randn(H, Fd, generator=g) / Fd ** 0.5).to(torch.bfloat16)
    return sd


def hf_mixtral_reference(torch, sd, x, top_k):
    """Hugging Face's MixtralSparseMoeBlock, written out in float32 from the full state dict."""
    F_ = torch.nn.functional
    logits = F_.linear(x, sd["gate.weight"])
    probs = F_.softmax(logits, dim=1, dtype=torch.float)
    w, sel = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(sel[t, j])
            xf = x[t].float()
            h = F_.silu(sd[f"experts.{e}.w1.weight"].float() @ xf) * (sd[f"experts.{e}.w3.weight"].float() @ xf)
            y[t] += w[t, j] * (sd[f"experts.{e}.w2.weight"].float() @ h)
    return y, logits


def rel_err(got, want):
    return float(((got.float() - want).norm() / want.norm()).item())


def test_torch_mixtral_route():
    torch = need_torch()
    from comet_moe import mixtral_route
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.5, 0.25, 0.0]], dtype=torch.bfloat16)
    ids, w = mixtral_route(logits, 2)
    check_eq((ids.dtype, w.dtype, ids.is_contiguous(), w.is_contiguous()),
             (torch.int32, torch.float32, True, True), "dtypes and layout")
    check_eq(ids.tolist(), [[3, 2], [0, 1]], "ids, largest first")
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), 0)
    want = torch.stack([p[3], p[2]]) / (p[3] + p[2])
    check(torch.allclose(w[0], want, atol=1e-6), f"weights {w[0].tolist()} vs {want.tolist()}")
    check(torch.allclose(w.sum(1), torch.ones(2)), "each token's weights sum to 1")


def test_torch_block_keeps_local_experts_and_names_them_the_hf_way():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    E, H, Fd = 8, 64, 128
    cfg = comet_moe.MoeConfig(hidden=H, ffn=Fd, num_experts=E, top_k=2, max_tokens=16)
    block = CometSparseMoeBlock(moe=FakeMoe(torch, cfg, first_expert=4, experts_per_rank=2))  # rank 2 of 4
    sd = hf_state_dict(torch, E, H, Fd)
    result = block.load_state_dict(sd)
    check_eq((result.missing_keys, result.unexpected_keys), ([], []), "load of a full state dict")
    check_eq(list(block.local_experts), [4, 5], "local experts")
    for le, e in enumerate((4, 5)):
        check(torch.equal(block.w13[le, :Fd], sd[f"experts.{e}.w1.weight"]), f"w13[{le}] rows 0..F-1 = expert {e} w1")
        check(torch.equal(block.w13[le, Fd:], sd[f"experts.{e}.w3.weight"]), f"w13[{le}] rows F..2F-1 = expert {e} w3")
        check(torch.equal(block.w2[le], sd[f"experts.{e}.w2.weight"]), f"w2[{le}] = expert {e} w2")
    check(torch.equal(block.gate.weight, sd["gate.weight"]), "gate.weight")
    own = block.state_dict()
    check_eq(sorted(own), sorted(["gate.weight"] + [f"experts.{e}.{w}.weight" for e in (4, 5) for w in ("w1", "w2", "w3")]),
             "state_dict keys: the router and this rank's experts")
    for k, v in own.items():
        check(torch.equal(v, sd[k]), f"state_dict()[{k!r}] round trip")
    # Loading its own state dict back works (only local experts present).
    check_eq(block.load_state_dict(own).missing_keys, [], "reload of its own state dict")
    # A local expert missing is named; another rank's missing is fine.
    partial = {k: v for k, v in sd.items() if k != "experts.5.w3.weight" and k != "experts.0.w1.weight"}
    e = raises(RuntimeError, lambda: block.load_state_dict(partial), "Missing key(s)", "experts.5.w3.weight")
    check("experts.0.w1.weight" not in str(e), "another rank's expert reported missing")
    check_eq(block.load_state_dict(partial, strict=False).missing_keys, ["experts.5.w3.weight"], "strict=False")
    bad = dict(sd)
    bad["experts.9.w1.weight"] = sd["experts.0.w1.weight"]
    raises(RuntimeError, lambda: block.load_state_dict(bad), "Unexpected key(s)", "experts.9.w1.weight")
    wrong = dict(sd)
    wrong["experts.4.w2.weight"] = sd["experts.4.w1.weight"]  # [F, H] where [H, F] belongs
    raises(RuntimeError, lambda: block.load_state_dict(wrong), "size mismatch for experts.4.w2.weight", "(128, 64)")
    prefixed = {"model.layers.3.block_sparse_moe." + k: v for k, v in sd.items()}
    prefixed["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(1)
    check_eq(block.load_full_state_dict(prefixed, prefix="model.layers.3.block_sparse_moe.").missing_keys, [],
             "load_full_state_dict with a prefix")


def test_torch_block_keeps_this_tp_ranks_slice():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    from comet_moe.block import _tp_slice
    w = torch.arange(6 * 4).view(6, 4)  # [F = 6, H = 4]
    check_eq(_tp_slice("w1", w, 1, 3).tolist(), w[3:].tolist(), "_tp_slice of w1: rows")
    check_eq(_tp_slice("w3", w, 0, 6).tolist(), w.tolist(), "_tp_slice with one TP rank: all")
    w = torch.arange(4 * 6).view(4, 6)  # [H = 4, F = 6]
    check_eq(_tp_slice("w2", w, 1, 3).tolist(), w[:, 3:].tolist(), "_tp_slice of w2: columns")
    E, H, Fd, k, tp = 4, 64, 128, 2, 2
    Fl = Fd // tp
    cfg = comet_moe.MoeConfig(hidden=H, ffn=Fd, num_experts=E, top_k=k, max_tokens=16, tp_size=tp)
    sd = hf_state_dict(torch, E, H, Fd, seed=3)
    blocks = []
    for t in range(tp):  # EP 1 x TP 2: both ranks hold every expert, half of ffn each
        block = CometSparseMoeBlock(moe=FakeMoe(torch, cfg, 0, E, tp_size=tp, tp_rank=t), impl="fused")
        result = block.load_state_dict(sd)
        check_eq((result.missing_keys, result.unexpected_keys), ([], []), f"tp rank {t}: load of a full state dict")
        check_eq((block.tp_size, block.tp_rank, block.ffn_local), (tp, t, Fl), f"tp rank {t}: attributes")
        check_eq((tuple(block.w13.shape), tuple(block.w2.shape)), ((E, 2 * Fl, H), (E, H, Fl)), "packed shapes")
        cols = slice(t * Fl, (t + 1) * Fl)
        for e in range(E):
            check(torch.equal(block.w13[e, :Fl], sd[f"experts.{e}.w1.weight"][cols]), f"tp {t}: expert {e} w1 rows")
            check(torch.equal(block.w13[e, Fl:], sd[f"experts.{e}.w3.weight"][cols]), f"tp {t}: expert {e} w3 rows")
            check(torch.equal(block.w2[e], sd[f"experts.{e}.w2.weight"][:, cols]), f"tp {t}: expert {e} w2 columns")
        r = repr(block)
        check(f"tp=2 (tp rank {t}: ffn columns {t * Fl}..{(t + 1) * Fl - 1})" in r, f"repr: {r}")
        blocks.append(block)
    check("tp=" not in repr(CometSparseMoeBlock(moe=FakeMoe(torch, cfg, 0, E))), "repr with tp 1 names no tp")
    # The TP ranks' partial sums add up to HF Mixtral's output.
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        parts = [b(x)[0].float() for b in blocks]
    want, _ = hf_mixtral_reference(torch, sd, x, k)
    err = rel_err(parts[0] + parts[1], want)
    check(err < 1e-2, f"sum of the TP partials against HF Mixtral written out: {err:.3g}")
    note(f"EP 1 x TP 2, partials summed vs HF Mixtral (float32): relative error {err:.2e}")
    # The layer's checks want the slice: the whole expert is refused, naming the dim.
    ids, tw = comet_moe.mixtral_route(blocks[0].gate(x), k)
    whole = torch.zeros(E, 2 * Fd, H, dtype=torch.bfloat16)
    raises(ValueError, lambda: blocks[0].moe.forward(x, ids, tw, gate_up=whole, down=blocks[0].w2),
           "gate_up.shape = (4, 256, 64)", "2 * ffn / tp_size = 128")
    # The full HF shapes are still what load_state_dict takes: a slice is refused.
    wrong = dict(sd)
    wrong["experts.1.w1.weight"] = sd["experts.1.w1.weight"][:Fl]
    raises(RuntimeError, lambda: blocks[1].load_state_dict(wrong), "size mismatch for experts.1.w1.weight",
           "(64, 64)", "(128, 64)", "ffn / tp_size = 64")
    # state_dict() cannot name a slice the HF way.
    raises(NotImplementedError, lambda: blocks[0].state_dict(), "tp_size = 2", "ffn columns 0..63")
    # EP 2 x TP 2 on 4 ranks: rank 3 holds experts 2..3, columns Fl..F-1.
    block = CometSparseMoeBlock(moe=FakeMoe(torch, cfg, 2, 2, tp_size=tp, tp_rank=1))
    check_eq(block.load_state_dict(sd).missing_keys, [], "rank 3 of EP 2 x TP 2: load")
    check_eq(list(block.local_experts), [2, 3], "rank 3 of EP 2 x TP 2: local experts")
    for le, e in enumerate((2, 3)):
        check(torch.equal(block.w13[le, Fl:], sd[f"experts.{e}.w3.weight"][Fl:]), f"rank 3: expert {e} w3 rows")
        check(torch.equal(block.w2[le], sd[f"experts.{e}.w2.weight"][:, Fl:]), f"rank 3: expert {e} w2 columns")


def test_torch_block_forward_matches_hf_mixtral():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    E, H, Fd, k = 4, 64, 64, 2
    cfg = comet_moe.MoeConfig(hidden=H, ffn=Fd, num_experts=E, top_k=k, max_tokens=16)
    fake = FakeMoe(torch, cfg, first_expert=0, experts_per_rank=E)  # one rank holds all
    block = CometSparseMoeBlock(moe=fake, impl="baseline")
    sd = hf_state_dict(torch, E, H, Fd, seed=1)
    block.load_state_dict(sd)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        y, logits = block(x)
    want, want_logits = hf_mixtral_reference(torch, sd, x.view(-1, H), k)
    check_eq((tuple(y.shape), y.dtype, tuple(logits.shape)), ((2, 6, H), torch.bfloat16, (12, E)), "output shapes")
    check(torch.equal(logits, want_logits), "router logits")
    err = rel_err(y.view(-1, H), want)
    check(err < 1e-2, f"relative error against HF Mixtral written out: {err:.3g}")
    check_eq(fake.calls, [((12, H), _capi.IMPL_BASELINE)], "one call to the layer, flattened tokens, impl")
    out = torch.full((2, 6, H), float("nan"), dtype=torch.bfloat16)
    with torch.no_grad():
        y2, _ = block(x, out=out)
    check(y2.data_ptr() == out.data_ptr() and torch.equal(y2, y), "out= is written")
    note(f"block vs HF Mixtral (float32): relative error {err:.2e}")


def test_torch_block_refuses_before_launching():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    cfg = comet_moe.MoeConfig(hidden=64, ffn=64, num_experts=4, top_k=2, max_tokens=16)
    fake = FakeMoe(torch, cfg, 0, 4)
    block = CometSparseMoeBlock(moe=fake)
    x = torch.zeros(17, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        raises(ValueError, lambda: block(x), "17 tokens", "config.max_tokens = 16")
        raises(TypeError, lambda: block(torch.zeros(4, 64)), "hidden_states.dtype = torch.float32")
        raises(ValueError, lambda: block(torch.zeros(4, 63, dtype=torch.bfloat16)), "hidden = 64")
        raises(ValueError, lambda: block(torch.zeros(64, 8, dtype=torch.bfloat16).t()), "not contiguous")
        raises(ValueError, lambda: block(torch.zeros(4, 64, dtype=torch.bfloat16), out=torch.zeros(5, 64, dtype=torch.bfloat16)),
               "out.shape = (5, 64)")
    check_eq(fake.calls, [], "nothing reached the layer")
    # Trainable: the router and the packed experts are parameters, saved under the HF names only.
    names = [n for n, p in block.named_parameters() if p.requires_grad]
    check_eq(sorted(names), ["gate.weight", "w13", "w2"], "trainable parameters")
    check("w13" not in block.state_dict() and "w2" not in block.state_dict(), "state_dict: HF names, not w13/w2")
    raises(TypeError, lambda: CometSparseMoeBlock(), "give comm and config, or moe")
