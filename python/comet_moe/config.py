"""The MoE layer's shape: comet_moe_config_t with its presets and validation.

    cfg = MoeConfig.preset("mixtral-8x7b", max_tokens=8192)
    cfg = MoeConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2, max_tokens=8192)
    cfg.validate(world_size=2)   # CometInvalidArgumentError naming the field, value, limit

Every field is checked as it is set (constructor, preset overrides, `cfg.field = v`): an
int that fits its C type, else TypeError / ValueError, since ctypes would keep only the
low bits of a wider one. A config that is made (MoeConfig(...), MoeConfig.preset) is then
checked by comet as a whole for what is wrong at any world size (sizes 0 or negative, a
hidden or ffn that is not a multiple of 64, top_k above num_experts, a negative ep_size or
tp_size, ...): CometInvalidArgumentError with comet's sentence naming the field, the value
and the limit. What depends on the world size, and fields assigned after the config was
made, comet checks in validate() and comet_moe_create.

The experts' number format is `dtype`: "bf16" (the default) or "fp8" (block-scaled E4M3
weights with FP32 scales per 128 x 128 block, comet.h's COMET_DTYPE_FP8_BLOCK: the
inference forward on FP8 weights, training from bf16 master weights), with `fp8_pow2_scales` (the scales comet makes for the token
rows and the activation: amax / 448, or True: the power of two at or above it). A name
other than these two is refused as it is set (ValueError); the field itself holds
comet_dtype_t's int, its name is `dtype_name`.
"""
from __future__ import annotations

import ctypes

from . import _capi
from .checks import INT_MAX, c_range, check_int
from .errors import check

_FIELDS = ("hidden", "ffn", "num_experts", "top_k", "max_tokens", "ep_size", "tp_size", "resend_x", "dtype",
           "fp8_pow2_scales", "fp8_wgrad_cublaslt")
# Every field of comet_moe_config_t (size, magic, version and dtype too) with its range.
_LIMITS = {name: c_range(ctype) for name, ctype in _capi.MoeConfigStruct._fields_}
_DTYPES = {name: code for code, name in _capi.DTYPE_NAMES.items()}  # "bf16" -> COMET_DTYPE_BF16, ...


def parse_dtype(value) -> int:
    """"bf16" | "fp8", or the DTYPE_* value (COMET_DTYPE_BF16, COMET_DTYPE_FP8_BLOCK), as
    comet_dtype_t; anything else raises, naming what is taken."""
    known = "'bf16' or 'fp8' (or DTYPE_BF16 = 0, DTYPE_FP8_BLOCK = 1)"
    if isinstance(value, str):
        if value.lower() not in _DTYPES:
            raise ValueError(f"MoeConfig.dtype = {value!r}: expected {known}")
        return _DTYPES[value.lower()]
    lo, hi, ctype = _LIMITS["dtype"]
    code = check_int("MoeConfig.dtype", value, lo, hi, ctype)
    if code not in _capi.DTYPE_NAMES:
        raise ValueError(f"MoeConfig.dtype = {code}: expected {known}")
    return code


_SWITCHES = {"fp8_pow2_scales": "False / 0 (scales amax / 448) or True / 1 (the power of two at or above it)",
             "fp8_wgrad_cublaslt": "False / 0 (comet's weight-gradient GEMM) or True / 1 (cuBLASLt's, per expert)"}


def _parse_switch(name, value) -> int:
    """fp8_pow2_scales, fp8_wgrad_cublaslt: a bool, or 0 / 1."""
    if isinstance(value, bool):
        return int(value)
    lo, hi, ctype = _LIMITS[name]
    v = check_int(f"MoeConfig.{name}", value, lo, hi, ctype)
    if v not in (0, 1):
        raise ValueError(f"MoeConfig.{name} = {v}: expected {_SWITCHES[name]}")
    return v


def presets() -> list:
    """The names comet knows for MoeConfig.preset(), from the library."""
    lib = _capi.load()
    names, i = [], 0
    while True:
        name = lib.comet_moe_preset_name(i)
        if name is None:
            return names
        names.append(_capi.text(name))
        i += 1


class MoeConfig(_capi.MoeConfigStruct):
    """comet_moe_config_t. Fields: hidden (H, a multiple of 64), ffn (F, one expert's FFN
    size, a multiple of 64 x tp_size), num_experts (E, all ranks together, divisible by
    ep_size), top_k (1..min(num_experts, 32)), max_tokens (the most tokens one rank passes
    in one call), ep_size and tp_size (expert- and tensor-parallel ranks, ep_size x tp_size
    = the world size; tp_size 0 means 1, ep_size 0 means world size / tp_size; tp_size must
    divide the world size), resend_x (training: 1 keeps no x rows between forward and
    backward and sends x again in the backward, for memory; 0 keeps them), dtype ("bf16",
    or "fp8": block-scaled E4M3 experts, for inference and for training from bf16 master
    weights; read back as comet_dtype_t's int, dtype_name gives the name) and
    fp8_pow2_scales (FP8: the scales comet makes, for x's rows and the activation, and in
    training dy's rows, [g u] kept in E4M3 and the weight gradients' operands, rounded up
    to powers of two) and fp8_wgrad_cublaslt (FP8 training: the weight gradients as
    cuBLASLt's GEMM per expert, faster on large experts, for a host wait in each backward,
    which then cannot be captured in a CUDA graph; comet.h says more). size, magic and
    version are set as COMET_MOE_CONFIG_INIT sets them.

    Made with its sizes (MoeConfig(hidden=..., ...)) or from a preset, a config is checked
    at once for what no world size makes right (see the module's note); MoeConfig() with
    no sizes is refused for the same reason."""

    def __init__(self, hidden: int = 0, ffn: int = 0, num_experts: int = 0, top_k: int = 0,
                 max_tokens: int = 0, ep_size: int = 0, tp_size: int = 0, resend_x: int = 0, dtype="bf16",
                 fp8_pow2_scales=False, fp8_wgrad_cublaslt=False):
        super().__init__(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k, max_tokens=max_tokens,
                         ep_size=ep_size, tp_size=tp_size, resend_x=resend_x, dtype=dtype,
                         fp8_pow2_scales=fp8_pow2_scales,
                         fp8_wgrad_cublaslt=fp8_wgrad_cublaslt)  # each through __setattr__'s check
        self._check_any_world()

    @classmethod
    def _blank(cls) -> "MoeConfig":
        """A config holding COMET_MOE_CONFIG_INIT (all sizes 0), not checked: for a copy or
        a preset to be written into."""
        cfg = cls.__new__(cls)
        _capi.MoeConfigStruct.__init__(cfg)
        return cfg

    def _check_any_world(self) -> None:
        """What is wrong whatever the world size, in comet's own words: comet's validate at
        the smallest world size this config allows (ep_size x tp_size, each 0 read as 1).
        The checks that depend on the world size pass there wherever they pass anywhere
        (ep_size x tp_size ranks is a world the config takes; the row bound grows with the
        world), so what fails there fails at every world size."""
        ep, tp = int(self.ep_size), int(self.tp_size)
        world = max(ep, 1) * max(tp, 1) if ep >= 0 and tp >= 0 else 1
        lib = _capi.load()
        msg = ctypes.create_string_buffer(512)
        st = lib.comet_moe_config_validate(ctypes.byref(self), min(world, INT_MAX), msg, len(msg))
        where = "" if world == 1 else f" (checked at world size {world} = ep_size x tp_size, the least they allow)"
        check(st, "MoeConfig", lambda: _capi.text(msg.value) + where)

    def __setattr__(self, name, value):
        if name not in _LIMITS:  # a misspelt field would otherwise become a plain attribute
            raise AttributeError(f"MoeConfig has no field {name!r}; fields: {', '.join(_FIELDS)}")
        if name == "dtype":
            value = parse_dtype(value)
        elif name in _SWITCHES:
            value = _parse_switch(name, value)
        lo, hi, ctype = _LIMITS[name]
        super().__setattr__(name, check_int(f"MoeConfig.{name}", value, lo, hi, ctype))

    @property
    def dtype_name(self) -> str:
        """The experts' number format by name: "bf16" or "fp8"."""
        return _capi.DTYPE_NAMES.get(int(self.dtype), f"unknown dtype {int(self.dtype)}")

    @property
    def is_fp8(self) -> bool:
        return int(self.dtype) == _capi.DTYPE_FP8_BLOCK

    @classmethod
    def preset(cls, name: str, max_tokens: int, **overrides) -> "MoeConfig":
        """A named model's shape (see presets()), with max_tokens and any field of
        `overrides` set, checked as MoeConfig(...) is. Unknown name:
        CometInvalidArgumentError listing the known ones."""
        if not isinstance(name, str):
            raise TypeError(f"MoeConfig.preset: name = {name!r}: expected a str (see presets())")
        if "\0" in name:  # C would read the name only up to the NUL
            raise ValueError(f"MoeConfig.preset: name = {name!r}: contains a NUL character")
        max_tokens = check_int("MoeConfig.max_tokens", max_tokens)
        for field in overrides:
            if field not in _FIELDS:
                raise TypeError(f"MoeConfig.preset: unknown field {field!r}; fields: {', '.join(_FIELDS)}")
        lib = _capi.load()
        cfg = cls._blank()
        st = lib.comet_moe_config_preset(name.encode(), max_tokens, ctypes.byref(cfg))
        check(st, "comet_moe_config_preset", lambda: _capi.text(lib.comet_last_create_error()))
        for field, value in overrides.items():
            setattr(cfg, field, value)
        cfg._check_any_world()
        return cfg

    def validate(self, world_size: int) -> "MoeConfig":
        """Check the config against a world size without creating anything (no GPU
        needed). Raises CometInvalidArgumentError (or CometNotSupportedError) with
        comet's sentence naming the field, its value and the limit; returns self. A
        world_size that is not an int in 1..2^31-1 raises TypeError / ValueError."""
        world_size = check_int("MoeConfig.validate: world_size", world_size, 1, INT_MAX)
        lib = _capi.load()
        msg = ctypes.create_string_buffer(512)
        st = lib.comet_moe_config_validate(ctypes.byref(self), world_size, msg, len(msg))
        check(st, "comet_moe_config_validate", lambda: _capi.text(msg.value))
        return self

    def copy(self) -> "MoeConfig":
        other = MoeConfig._blank()
        ctypes.memmove(ctypes.byref(other), ctypes.byref(self), ctypes.sizeof(self))
        return other

    def as_dict(self) -> dict:
        """The fields MoeConfig(...) takes, as it takes them (dtype by name)."""
        d = {f: int(getattr(self, f)) for f in _FIELDS}
        d["dtype"] = self.dtype_name
        return d

    def __eq__(self, other):
        return isinstance(other, _capi.MoeConfigStruct) and bytes(self) == bytes(other)

    __hash__ = None

    def __repr__(self):
        return "MoeConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"
