"""FP8 experts from a Hugging Face state dict: this rank's experts (expert parallelism) and
its ffn slice of them (tensor parallelism), stacked into the tensors an FP8 layer takes.

    weights = stack_fp8_experts(state_dict, config, world_size=8, rank=r,
                                prefix="model.layers.3.mlp.", device="cuda")
    y = moe.forward(x, topk_ids, topk_weights, **weights)       # under torch.no_grad()

Names. Per expert e, either Mixtral's `experts.{e}.w1` (gate), `w3` (up), `w2` (down), or
Qwen3-MoE's and DeepSeek-V3's `experts.{e}.gate_proj`, `up_proj`, `down_proj`, never both
in one state dict; each `.weight` [out, in] and, for float8_e4m3fn weights,
`.weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)] (one scale per 128 x 128
block; it multiplies, despite its name). A bfloat16 `.weight` without a scale is quantized
as it is loaded (fp8.quantize_fp8_weights on the target device, with the config's
fp8_pow2_scales), this rank's slice alone, so any tensor-parallel slice is fine; an FP8
weight's slice must fall on its 128 x 128 blocks (ffn / tp_size a multiple of 128),
since its scales cannot be cut inside a block.

What comes out: gate_up [E_local, 2Fl, H] with gate_up_scale, where ffn / tp_size = Fl is a
multiple of 128 (a block must not hold rows of both), else gate and up [E_local, Fl, H]
apart with gate_scale and up_scale; down [E_local, H, Fl] with down_scale: the names of
Moe.forward's keywords. Everything is read and sliced where the state dict lies (any
device); only this rank's share is copied to `device`.

Refused, each problem naming its key (ValueError, all problems in one message): a weight
or scale missing, a shape or dtype other than these, a scale beside a bf16 weight, names
of both schemes, an FP8 slice that cuts a block.
"""
from __future__ import annotations

import re
from collections import namedtuple

from ._torch import torch
from .checks import check_int
from .fp8 import BLOCK, blocks

_KEY = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)")
# The two naming schemes: each maps gate, up and down to its name.
SCHEMES = {
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
    "proj": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}
_SCHEME_OF = {name: scheme for scheme, names in SCHEMES.items() for name in names.values()}
_SCHEME_WORDS = {"mixtral": "Mixtral's w1 / w3 / w2", "proj": "gate_proj / up_proj / down_proj"}

# Where a rank sits (moe._rank_layout's fields, and the shape).
Layout = namedtuple("Layout", "hidden ffn num_experts first_expert experts_per_rank tp_size tp_rank ffn_local")


def layout_of(config, world_size: int = 1, rank: int = 0) -> Layout:
    """The rank's place as comet_moe_create resolves it (see moe._rank_layout)."""
    from .moe import _rank_layout
    r = _rank_layout(config, world_size, rank)
    return Layout(int(config.hidden), int(config.ffn), int(config.num_experts), r["first_expert"],
                  r["experts_per_rank"], r["tp_size"], r["tp_rank"], r["ffn_local"])


def packs_gate_up(lay: Layout) -> bool:
    """Whether gate and up travel in one tensor: where no 128-row block holds both."""
    return lay.ffn_local % BLOCK == 0


def empty_weights(lay: Layout, device, packed=None) -> dict:
    """Zeroed FP8 weights and scales of this rank's experts, by Moe.forward's keywords."""
    E, H, Fl = lay.experts_per_rank, lay.hidden, lay.ffn_local
    packed = packs_gate_up(lay) if packed is None else packed
    fp8, f32 = torch.float8_e4m3fn, torch.float32
    out = {}
    for name, rows in ((("gate_up", 2 * Fl),) if packed else (("gate", Fl), ("up", Fl))):
        out[name] = torch.zeros(E, rows, H, dtype=fp8, device=device)
        out[name + "_scale"] = torch.zeros(E, blocks(rows), blocks(H), dtype=f32, device=device)
    out["down"] = torch.zeros(E, H, Fl, dtype=fp8, device=device)
    out["down_scale"] = torch.zeros(E, blocks(H), blocks(Fl), dtype=f32, device=device)
    return out


class Problems:
    """What a load found wrong: missing keys, unexpected keys and error messages, as
    nn.Module's loading collects them."""

    def __init__(self):
        self.missing, self.unexpected, self.errors = [], [], []

    def raise_if_any(self, what: str) -> None:
        lines = [f"missing key {k}" for k in self.missing] + self.errors
        if lines:
            raise ValueError(f"{what}: {len(lines)} problem(s) in the state dict:\n  " + "\n  ".join(lines))


def scheme_of(state_dict, prefix: str, problems: Problems, num_experts: int) -> str:
    """The naming scheme the experts' keys under `prefix` use ("mixtral" where there are
    none); names of both schemes, an expert id out of range or a key of no scheme are
    reported to `problems` (errors, unexpected)."""
    first = {}
    head = prefix + "experts."
    for key in state_dict:
        if not key.startswith(head):
            continue
        m = _KEY.fullmatch(key[len(prefix):])
        if m is None or int(m[1]) >= num_experts:
            problems.unexpected.append(key)
            continue
        first.setdefault(_SCHEME_OF[m[2]], key)
    if len(first) > 1:
        problems.errors.append(f"the experts' names mix two schemes: {first['mixtral']} ({_SCHEME_WORDS['mixtral']}) "
                               f"and {first['proj']} ({_SCHEME_WORDS['proj']}); give one")
    return "proj" if set(first) == {"proj"} else "mixtral"


def _full_shape(part: str, lay: Layout):
    return (lay.hidden, lay.ffn) if part == "down" else (lay.ffn, lay.hidden)


def _ffn_slice(lay: Layout):
    lo = lay.tp_rank * lay.ffn_local
    return lo, lo + lay.ffn_local


def _cut(part: str, t, lo: int, hi: int):
    """Rows lo..hi-1 of gate or up ([F, ...]), columns of down ([..., F])."""
    return t[:, lo:hi] if part == "down" else t[lo:hi]


def read_matrix(state_dict, key: str, part: str, lay: Layout, problems: Problems):
    """This rank's slice of one expert matrix (`key` its `.weight`): (weight, scales) for an
    FP8 weight, (weight, None) for a bf16 one to quantize, or None with the problem
    reported. Views of the state dict's tensors, where they lie."""
    if key not in state_dict:
        problems.missing.append(key)
        return None
    w, scale_key = state_dict[key], key + "_scale_inv"
    want = _full_shape(part, lay)
    if not isinstance(w, torch.Tensor):
        problems.errors.append(f"{key}: expected a torch.Tensor, got {type(w).__name__}")
        return None
    if tuple(w.shape) != want:
        tp = (f"; every rank loads the whole expert and keeps its ffn / tp_size = {lay.ffn_local} columns"
              if lay.tp_size > 1 else "")
        problems.errors.append(f"size mismatch for {key}: shape {tuple(w.shape)}, expected {want} (hidden = "
                               f"{lay.hidden}, ffn = {lay.ffn}{tp})")
        return None
    lo, hi = _ffn_slice(lay)
    if w.dtype == torch.bfloat16:
        if scale_key in state_dict:
            problems.errors.append(f"{scale_key} beside a bfloat16 {key}: scales belong to float8_e4m3fn weights")
            return None
        return _cut(part, w, lo, hi), None
    if w.dtype != torch.float8_e4m3fn:
        problems.errors.append(f"{key}.dtype = {w.dtype}: expected torch.float8_e4m3fn (with {scale_key}) or "
                               f"torch.bfloat16 (quantized when loaded)")
        return None
    if scale_key not in state_dict:
        if key + "_scale" in state_dict:  # compressed-tensors' name: one scale per tensor or per channel
            problems.errors.append(f"{scale_key} is missing, and {key}_scale is there: a per-tensor or per-channel "
                                   f"FP8 checkpoint, not block-scaled (128 x 128) as comet takes")
        else:
            problems.missing.append(scale_key)
        return None
    s = state_dict[scale_key]
    want_s = (blocks(want[0]), blocks(want[1]))
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        got = s.dtype if isinstance(s, torch.Tensor) else type(s).__name__
        problems.errors.append(f"{scale_key}.dtype = {got}: expected torch.float32 (one scale per 128 x 128 block)")
        return None
    if tuple(s.shape) != want_s:
        problems.errors.append(f"size mismatch for {scale_key}: shape {tuple(s.shape)}, expected {want_s} (one scale "
                               f"per 128 x 128 block of {key} {want}, rounded up)")
        return None
    if lay.tp_size > 1 and (lo % BLOCK or (hi % BLOCK and hi != lay.ffn)):
        what = "columns" if part == "down" else "rows"
        problems.errors.append(
            f"{key}: tp_size = {lay.tp_size}: this rank's {what} {lo}..{hi - 1} of ffn = {lay.ffn} cut through the "
            f"128 x 128 blocks of {scale_key} (ffn / tp_size = {lay.ffn_local} is not a multiple of 128): load a bf16 "
            f"checkpoint (each rank's slice is quantized on its own), or take a tp_size that makes ffn / tp_size a "
            f"multiple of 128")
        return None
    return _cut(part, w, lo, hi), _cut(part, s, lo // BLOCK, blocks(hi))


def load_experts(state_dict, prefix: str, lay: Layout, out: dict, problems: Problems, quantize, pow2: bool) -> set:
    """Copy this rank's experts from `state_dict` into `out` (empty_weights' tensors, on
    their device), reporting what is wrong to `problems`; returns the (expert, part) pairs
    loaded. quantize(w, pow2) -> (q, scales) makes a bf16 slice FP8 on out's device."""
    scheme = scheme_of(state_dict, prefix, problems, lay.num_experts)
    loaded = set()
    if problems.errors:  # the names cannot be trusted
        return loaded
    names = SCHEMES[scheme]
    packed = "gate_up" in out
    Fl, device = lay.ffn_local, out["down"].device
    for e in range(lay.first_expert, lay.first_expert + lay.experts_per_rank):
        le = e - lay.first_expert
        for part in ("gate", "up", "down"):
            key = f"{prefix}experts.{e}.{names[part]}.weight"
            got = read_matrix(state_dict, key, part, lay, problems)
            if got is None:
                continue
            w, s = got
            if s is None:
                w, s = quantize(w.to(device).contiguous(), pow2)
            if packed and part != "down":
                rows, srows = (slice(0, Fl), slice(0, Fl // BLOCK)) if part == "gate" else \
                    (slice(Fl, 2 * Fl), slice(Fl // BLOCK, 2 * Fl // BLOCK))
                out["gate_up"][le, rows].copy_(w)
                out["gate_up_scale"][le, srows].copy_(s)
            else:
                out[part][le].copy_(w)
                out[part + "_scale"][le].copy_(s)
            loaded.add((e, part))
    return loaded


def stack_fp8_experts(state_dict, config, *, world_size: int = 1, rank: int = 0, prefix: str = "", device=None,
                      quantize=None) -> dict:
    """This rank's FP8 experts from a state dict of HF names (see the module's note), for
    the layer `config` makes on `rank` of `world_size` ranks: a dict of Moe.forward's
    keywords (gate_up and gate_up_scale, or gate, gate_scale, up and up_scale; down and
    down_scale) on `device` (default: where the state dict's tensors are). Keys outside
    `prefix` + "experts." are left alone, and so are other ranks' experts. quantize(w,
    pow2_scales) -> (q, scales) makes a bf16 weight FP8 (default
    comet_moe.quantize_fp8_weights, which needs `device` to be a GPU). ValueError listing
    every problem, each naming its key."""
    if not isinstance(prefix, str):
        raise TypeError(f"stack_fp8_experts: prefix = {prefix!r}: expected a str")
    config.validate(world_size)  # the layout comet makes at this world size, or comet's sentence why not
    rank = check_int("stack_fp8_experts: rank", rank, 0, world_size - 1, f"a rank of world_size = {world_size}")
    lay = layout_of(config, world_size, rank)
    if device is None:
        first = next((v for v in state_dict.values() if isinstance(v, torch.Tensor)), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    if quantize is None:
        quantize = _quantizer(device)
    out = empty_weights(lay, device)
    problems = Problems()
    load_experts(state_dict, prefix, lay, out, problems, quantize, bool(config.fp8_pow2_scales))
    problems.raise_if_any("stack_fp8_experts")
    return out


def _quantizer(device):
    """comet's quantizer where `device` is a GPU; elsewhere one that says what to do."""
    if device.type == "cuda":
        from .fp8 import quantize_fp8_weights
        return quantize_fp8_weights

    def refuse(w, pow2_scales):
        raise ValueError(f"a bfloat16 weight is quantized as it is loaded, on the GPU: pass device='cuda' (here "
                         f"{device}), or quantize=... for another quantizer")
    return refuse
