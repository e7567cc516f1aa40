"""CometSparseMoeBlock: a Mixtral-style sparse MoE block (router, top-k, SwiGLU experts)
whose experts run through comet across the ranks of a communicator, trainable.

    block = CometSparseMoeBlock(comm, MoeConfig.preset("mixtral-8x7b", max_tokens=8192))
    block.load_state_dict(full_state_dict)          # HF names, all experts; keeps this rank's
    y, router_logits = block(hidden_states)         # [..., H] bf16 -> same shape, [T, E]
    loss(y).backward()                              # router, experts and input get gradients

Training: the router (gate.weight) is an ordinary parameter; its gradient flows through
torch's softmax and top-k into comet's gradient at the routing weights. The block runs
under torch.compile (fullgraph=True: comet's calls are torch custom operators, ops.py),
forward and backward, with the same bits as eager. The packed
expert weights w13 and w2 are parameters of this rank's experts only (expert
parallelism): reduce their gradients over the ranks that hold the same experts (the
expert-data-parallel group, as Megatron-LM does), never over the whole world. Under
torch.no_grad() or inference mode nothing is saved for a backward.

Names follow Hugging Face's MixtralSparseMoeBlock: gate.weight [E, H], experts.{i}.w1.weight
[F, H] (gate projection), experts.{i}.w3.weight [F, H] (up), experts.{i}.w2.weight [H, F]
(down), i the global expert id. Rank r is TP rank t = r % TP of EP group g = r // TP
(EP x TP = world size; TP = config.tp_size, 1 by default); group g holds experts
[g * E/EP, (g + 1) * E/EP) (comet.h), and each of its ranks holds the ffn columns
[t * Fl, (t + 1) * Fl) of them, Fl = F / TP (F itself when TP is 1). load_state_dict
takes a state dict with all experts (or only this rank's), full HF shapes, and copies
this rank's share into two packed buffers, the layout comet_moe_forward reads:
w13 [E_local, 2Fl, H] (rows 0..Fl-1 w1 rows t*Fl.., Fl..2Fl-1 the same rows of w3) and
w2 [E_local, H, Fl] (columns t*Fl.. of w2). With TP 1, state_dict() gives back the
router and this rank's experts under the same names; with TP > 1 it raises
NotImplementedError (a rank holds only a slice of each expert, which the HF names and
shapes cannot carry; keep the full state dict it was loaded from).

FP8 (a config with dtype "fp8"): inference only. The experts are buffers, not
parameters: float8_e4m3fn w13 [E_local, 2Fl, H] with w13_scale_inv [E_local, 2Fl / 128,
ceil(H / 128)] float32 (one scale per 128 x 128 block) where Fl is a multiple of 128, else
w1 and w3 [E_local, Fl, H] apart, each with its scales; w2 [E_local, H, Fl] with
w2_scale_inv. load_state_dict takes an HF FP8 checkpoint's experts (`.weight` float8 with
`.weight_scale_inv`) under Mixtral's names or Qwen3-MoE's / DeepSeek-V3's (gate_proj,
up_proj, down_proj), or bf16 weights, which it quantizes (checkpoint.py says what it
takes and refuses); state_dict() gives them back under Mixtral's names. The forward under
autograd raises NotImplementedError; call it under torch.no_grad() or inference mode.
"""
from __future__ import annotations

import re

from ._torch import torch  # ImportError that says what to install, without torch or with an old one
import torch.nn as nn
import torch.nn.functional as F

from . import ops
from .checks import BF16, check_tensor
from ._capi import IMPL_NAMES as _IMPL_NAMES
from .checkpoint import Layout, Problems, empty_weights, load_experts
from .fp8 import BLOCK, quantize_fp8_weights
from .moe import Moe, parse_impl

_EXPERT_KEY = re.compile(r"experts\.(\d+)\.(w1|w2|w3)\.weight")


# An FP8 block's buffers, by Moe.forward's keywords (HF Mixtral's w1, w3, w2; vLLM's w13).
_FP8_BUFFERS = {"gate_up": "w13", "gate_up_scale": "w13_scale_inv", "gate": "w1", "gate_scale": "w1_scale_inv",
                "up": "w3", "up_scale": "w3_scale_inv", "down": "w2", "down_scale": "w2_scale_inv"}


def _tp_slice(name: str, value: torch.Tensor, tp_rank: int, ffn_local: int) -> torch.Tensor:
    """The part of one expert's full HF weight that TP rank `tp_rank` holds (a view):
    rows tp_rank*ffn_local..(tp_rank+1)*ffn_local-1 of w1 or w3 ([F, H]), those columns of
    w2 ([H, F]). With one TP rank (ffn_local = F) the whole weight."""
    lo, hi = tp_rank * ffn_local, (tp_rank + 1) * ffn_local
    return value[:, lo:hi] if name == "w2" else value[lo:hi]


def mixtral_route(router_logits: torch.Tensor, top_k: int):
    """Hugging Face Mixtral's routing: softmax over all experts in float32, the top_k
    largest, renormalised to sum to 1 per token. Returns (topk_ids int32, topk_weights
    float32), contiguous, as comet takes them (HF rounds the weights to the activation
    dtype; here they stay float32)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32).contiguous(), weights.contiguous()


class CometSparseMoeBlock(nn.Module):
    """Mixtral's sparse MoE block over comet (bf16, trainable).

    CometSparseMoeBlock(comm, config) creates the comet layer (collective: every rank
    of `comm` constructs its block at the same point); CometSparseMoeBlock(moe=layer)
    wraps an existing comet_moe.Moe. impl: "auto" (default), "baseline" or "fused",
    the same on every rank. Calls are collective: every rank calls forward the same
    number of times, each with its own tokens (zero tokens is fine), at most
    config.max_tokens per call. Under tensor parallelism (config.tp_size > 1) every
    rank still gets its own tokens' complete output; tp_size, tp_rank and ffn_local
    (ffn // tp_size) say which slice of its experts this rank holds. With an FP8 config
    the experts are float8_e4m3fn buffers with their scales (see the module's note) and
    the block runs inference only."""

    def __init__(self, comm=None, config=None, *, moe=None, impl="auto", max_recv_rows: int = 0,
                 grad_accumulation: str = "grad"):
        super().__init__()
        if (moe is None) == (comm is None or config is None):
            raise TypeError("CometSparseMoeBlock: give comm and config, or moe (an existing comet_moe.Moe)")
        self._owns_moe = moe is None
        self.moe = Moe(comm, config, max_recv_rows=max_recv_rows, grad_accumulation=grad_accumulation) \
            if moe is None else moe
        cfg = self.moe.config
        self.hidden_dim, self.ffn_dim = int(cfg.hidden), int(cfg.ffn)
        self.num_experts, self.top_k = int(cfg.num_experts), int(cfg.top_k)
        self.max_tokens = int(cfg.max_tokens)
        self.first_expert, self.experts_per_rank = int(self.moe.first_expert), int(self.moe.experts_per_rank)
        self.tp_size = int(getattr(self.moe, "tp_size", 1))
        self.tp_rank = int(getattr(self.moe, "tp_rank", 0))
        self.ffn_local = int(getattr(self.moe, "ffn_local", self.ffn_dim // self.tp_size))
        self.impl = impl
        device = self.moe.comm.device
        H, Fl, E_local = self.hidden_dim, self.ffn_local, self.experts_per_rank
        self.gate = nn.Linear(H, self.num_experts, bias=False, device=device, dtype=torch.bfloat16)
        self.fp8 = bool(getattr(self.moe, "fp8", False))
        self.fp8_pow2_scales = bool(cfg.fp8_pow2_scales)
        # Packed as comet reads them (this TP rank's ffn_local columns of each local
        # expert); state_dict() names them the HF way instead.
        if self.fp8:  # buffers: FP8 weights take no gradient (Moe trains FP8 from bf16 masters)
            for name, t in empty_weights(self._layout(), device).items():
                self.register_buffer(_FP8_BUFFERS[name], t)
        else:
            self.w13 = nn.Parameter(torch.zeros(E_local, 2 * Fl, H, device=device, dtype=torch.bfloat16))
            self.w2 = nn.Parameter(torch.zeros(E_local, H, Fl, device=device, dtype=torch.bfloat16))

    def _apply(self, fn, recurse=True):
        """What Module.to, .cuda, .bfloat16, .half and the like run. An FP8 block's expert
        buffers keep their dtypes (float8_e4m3fn values, float32 scales: what comet reads;
        a cast would lose the scales' bits) and follow only the device moves; the router is
        cast as asked."""
        if not self.fp8:
            return super()._apply(fn, recurse)
        held = {name: self._buffers[name] for name in _FP8_BUFFERS.values() if self._buffers.get(name) is not None}
        for name in held:
            self._buffers[name] = None  # skipped by Module._apply, kept in place
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in held.items():
                device = fn(torch.empty(0, device=t.device)).device  # where fn sends a tensor
                self._buffers[name] = t if device == t.device else \
                    torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        return self

    def _layout(self) -> Layout:
        return Layout(self.hidden_dim, self.ffn_dim, self.num_experts, self.first_expert, self.experts_per_rank,
                      self.tp_size, self.tp_rank, self.ffn_local)

    # The quantizer of bf16 weights loaded into an FP8 block: (w, pow2_scales) -> (q, scales).
    _quantize = staticmethod(quantize_fp8_weights)

    def fp8_weights(self) -> dict:
        """An FP8 block's expert buffers by Moe.forward's keywords (gate_up, gate_up_scale
        or gate, gate_scale, up, up_scale; down, down_scale)."""
        return {kw: self._buffers[name] for kw, name in _FP8_BUFFERS.items() if name in self._buffers}

    @property
    def impl(self) -> str:
        """The path comet runs: "auto", "baseline" or "fused" (settable; the same on
        every rank)."""
        return _IMPL_NAMES[self._impl]

    @impl.setter
    def impl(self, value):
        self._impl = parse_impl(value)

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds (whole, or its TP slice of them)."""
        return range(self.first_expert, self.first_expert + self.experts_per_rank)

    # ---- forward ----

    def forward(self, hidden_states: torch.Tensor, out=None):
        """hidden_states [..., H] bf16, contiguous, on the communicator's device, at most
        max_tokens rows in all. Returns (y of the same shape, router_logits [T, E] bf16),
        as HF's MixtralSparseMoeBlock does. `out`: where to write y (same shape)."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
        H = self.hidden_dim
        shape = tuple(hidden_states.shape)
        if len(shape) < 1 or shape[-1] != H:
            raise ValueError(f"hidden_states.shape = {shape}: expected [..., hidden = {H}]")
        tokens = hidden_states.numel() // H
        if tokens > self.max_tokens:
            raise ValueError(f"hidden_states has {tokens} tokens ({' x '.join(map(str, shape[:-1]))}): more than "
                             f"config.max_tokens = {self.max_tokens}; create the layer with a larger max_tokens, "
                             f"or split the batch (every rank must then make the same number of calls)")
        dims = [(None, f"dim {i}") for i in range(len(shape) - 1)] + [(H, "hidden")]
        device = self.moe._device
        pointers = ops.has_address(hidden_states)  # else the operator checks the addresses when it runs
        check_tensor("hidden_states", hidden_states, BF16, dims, device, 16, pointers=pointers)
        if out is not None:
            check_tensor("out", out, BF16, [(d, f"dim {i}") for i, d in enumerate(shape[:-1])] + [(H, "hidden")],
                         device, 16, pointers=pointers)
            out = out.view(tokens, H)
        x = hidden_states.view(tokens, H)
        router_logits = self.gate(x)
        topk_ids, topk_weights = mixtral_route(router_logits, self.top_k)
        y = self.forward_routed(x, topk_ids, topk_weights, out=out)
        return y.view(shape), router_logits

    def forward_routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out=None):
        """The experts alone, for routing made elsewhere: x [M, H] bf16, topk_ids
        [M, top_k] int32 global expert ids, topk_weights [M, top_k] float32. Returns y
        [M, H] bf16 (written into `out` when given; not under autograd)."""
        if self.fp8:
            return self.moe.forward(x, topk_ids, topk_weights, out=out, impl=self._impl, **self.fp8_weights())
        return self.moe.forward(x, topk_ids, topk_weights, gate_up=self.w13, down=self.w2, out=out,
                                impl=self._impl)

    # ---- state dict: HF names outside, packed buffers inside ----

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.tp_size > 1:
            raise NotImplementedError(
                f"CometSparseMoeBlock.state_dict() with tp_size = {self.tp_size}: this rank holds only ffn columns "
                f"{self.tp_rank * self.ffn_local}..{(self.tp_rank + 1) * self.ffn_local - 1} of each expert, which "
                f"the HF names and shapes cannot carry; keep the full state dict the block was loaded from "
                f"(w13 and w2 are this rank's packed slices)")
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in ("w13", "w2") + tuple(_FP8_BUFFERS.values()):  # packed: saved under the HF names below
            destination.pop(prefix + name, None)
        if self.fp8:
            self._save_fp8(destination, prefix, keep_vars)
            return
        Fd = self.ffn_dim
        w13 = self.w13 if keep_vars else self.w13.detach()
        w2 = self.w2 if keep_vars else self.w2.detach()
        for le, e in enumerate(self.local_experts):
            destination[f"{prefix}experts.{e}.w1.weight"] = w13[le, :Fd]
            destination[f"{prefix}experts.{e}.w3.weight"] = w13[le, Fd:]
            destination[f"{prefix}experts.{e}.w2.weight"] = w2[le]

    def _save_fp8(self, destination, prefix, keep_vars):
        """An FP8 block's experts under HF Mixtral's names, `.weight` and `.weight_scale_inv`."""
        w = {kw: t if keep_vars else t.detach() for kw, t in self.fp8_weights().items()}
        Fd, Fb = self.ffn_dim, self.ffn_dim // BLOCK
        for le, e in enumerate(self.local_experts):
            if "gate_up" in w:
                parts = {"w1": (w["gate_up"][le, :Fd], w["gate_up_scale"][le, :Fb]),
                         "w3": (w["gate_up"][le, Fd:], w["gate_up_scale"][le, Fb:])}
            else:
                parts = {"w1": (w["gate"][le], w["gate_scale"][le]), "w3": (w["up"][le], w["up_scale"][le])}
            parts["w2"] = (w["down"][le], w["down_scale"][le])
            for name, (weight, scale) in parts.items():
                destination[f"{prefix}experts.{e}.{name}.weight"] = weight
                destination[f"{prefix}experts.{e}.{name}.weight_scale_inv"] = scale

    def _load_fp8(self, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs):
        """An FP8 block's experts from HF names (checkpoint.py); the other keys are the
        caller's."""
        problems = Problems()
        with torch.no_grad():
            load_experts(state_dict, prefix, self._layout(), self.fp8_weights(), problems, self._quantize,
                         self.fp8_pow2_scales)
        if strict:
            missing_keys.extend(problems.missing)
            unexpected_keys.extend(problems.unexpected)
        error_msgs.extend(problems.errors)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.fp8:
            self._load_fp8(state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)
            rest = {k: v for k, v in state_dict.items() if not k.startswith(prefix + "experts.")}
            super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            for name in _FP8_BUFFERS.values():  # loaded from the HF names above
                if prefix + name in missing_keys:
                    missing_keys.remove(prefix + name)
            return
        H, Fd, Fl, t = self.hidden_dim, self.ffn_dim, self.ffn_local, self.tp_rank
        rest, found = {}, set()
        for key, value in state_dict.items():
            if not key.startswith(prefix + "experts."):
                rest[key] = value
                continue
            m = _EXPERT_KEY.fullmatch(key[len(prefix):])
            if m is None or int(m[1]) >= self.num_experts:
                if strict:
                    unexpected_keys.append(key)
                continue
            e, name = int(m[1]), m[2]
            le = e - self.first_expert
            if not 0 <= le < self.experts_per_rank:
                continue  # another rank's expert
            want = (H, Fd) if name == "w2" else (Fd, H)  # the full expert, also under tensor parallelism
            if tuple(value.shape) != want:
                tp = (f"; every rank loads the whole expert and keeps its ffn / tp_size = {Fl} columns"
                      if self.tp_size > 1 else "")
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                  f"the shape in CometSparseMoeBlock is {want} (hidden = {H}, ffn = {Fd}{tp})")
                continue
            if value.dtype == torch.float8_e4m3fn:  # a copy would drop its scales
                error_msgs.append(f"{key} is float8_e4m3fn: this block is bf16; make it with MoeConfig(..., "
                                  f"dtype='fp8') to load FP8 experts, or dequantize them first "
                                  f"(comet_moe.dequantize_fp8)")
                continue
            part = _tp_slice(name, value, t, Fl)
            with torch.no_grad():
                if name == "w1":
                    self.w13[le, :Fl].copy_(part)
                elif name == "w3":
                    self.w13[le, Fl:].copy_(part)
                else:
                    self.w2[le].copy_(part)
            found.add((e, name))
        if strict:
            for e in self.local_experts:
                for name in ("w1", "w2", "w3"):
                    if (e, name) not in found:
                        missing_keys.append(f"{prefix}experts.{e}.{name}.weight")
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name in ("w13", "w2"):  # loaded from the HF names above
            if prefix + name in missing_keys:
                missing_keys.remove(prefix + name)

    def load_full_state_dict(self, state_dict, prefix: str = "", strict: bool = True):
        """load_state_dict for the keys under `prefix` (e.g. "model.layers.0.block_sparse_moe."),
        other keys ignored: all experts' weights may be there, this rank keeps its own
        (its TP slice of them when tp_size > 1)."""
        sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        return self.load_state_dict(sub, strict=strict)

    # ---- lifetime ----

    def close(self) -> None:
        """Destroy the comet layer this block created (collective; before the
        communicator's close()). Idempotent."""
        if self._owns_moe:
            self.moe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def extra_repr(self) -> str:
        tp = ""
        if self.tp_size > 1:
            lo = self.tp_rank * self.ffn_local
            tp = f"tp={self.tp_size} (tp rank {self.tp_rank}: ffn columns {lo}..{lo + self.ffn_local - 1}), "
        fp8 = (", dtype=fp8" + (" (pow2 scales)" if self.fp8_pow2_scales else "")) if self.fp8 else ""
        return (f"hidden={self.hidden_dim}, ffn={self.ffn_dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"local experts {self.first_expert}..{self.first_expert + self.experts_per_rank - 1}, {tp}"
                f"max_tokens={self.max_tokens}, impl={self.impl}{fp8}")
