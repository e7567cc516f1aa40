"""comet as Megatron-Core's MoE layer: CometMoELayer takes Megatron's TransformerConfig
and process groups, keeps Megatron's own router (TopKRouter: its score function, top-k,
scaling and auxiliary losses as configured) and runs the routed experts through comet
(dispatch, SwiGLU experts, combine; forward and backward) in place of Megatron's token
dispatcher and experts. Its expert weights load and save under the names of Megatron's
SequentialMLP experts, so a checkpoint moves between the two.

    from comet_moe.megatron import CometMoELayer
    layer = CometMoELayer(config, max_tokens=seq_length * micro_batch_size, pg_collection=pgs)
    output, bias = layer(hidden_states)        # [s, b, h] -> [s, b, h], None; as MoELayer's

What it takes from the config (moe_config_from_megatron): num_moe_experts, moe_router_topk,
hidden_size, moe_ffn_hidden_size (else ffn_hidden_size), expert_model_parallel_size and
expert_tensor_parallel_size (comet's ep_size and tp_size). What it refuses, naming the
field (check_megatron_config): experts other than SwiGLU without biases
(gated_linear_unit, activation_func silu, add_bias_linear), shared experts, token
dropping (moe_expert_capacity_factor), latent projections, fp4, and fp8 other than
block-scaled E4M3 (fp8 "e4m3" with fp8_recipe "blockwise", which it trains in FP8, as it
does with fp8=True where Megatron-Core cannot build such a config without Transformer
Engine): the bf16 weights stay the parameters, their FP8 copies made by comet on each
iteration's first micro-batch, which Megatron marks with config.fp8 set (with fp8=True
alone, on every forward: Megatron's optimizers update the weights unseen by their version
counters). Its scales follow Transformer Engine's blockwise recipe (Float8BlockScaling):
powers of two, or amax / 448 where NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1, as that recipe
reads it; the keyword fp8_pow2_scales chooses instead. With config.fp8_param the expert
weights stay bf16 parameters all the same (their FP8 copies beside them).

The communicator spans the expert tensor-and-model-parallel group (pg_collection.tp_ep),
in its rank order: expert-TP rank fastest, as comet's rank r = ep_rank x tp + tp_rank.
The expert weights are parameters of this rank's experts with `allreduce = False`, as
Megatron marks expert parameters (their gradients reduce over the expert-data-parallel
group). By default (grad_accumulation="main_grad") the layer adds their gradients to
each weight's fp32 `main_grad`, which Megatron's DDP attaches, and a weight without one
is refused by the training forward (ValueError); grad_accumulation="grad" gives bf16
`.grad` instead. The layer runs under torch.compile (fullgraph=True) where Megatron's
router does: comet's calls are torch custom operators (ops.py).

Layers of one shape share one communicator and one comet layer handle (share_handle=True,
the default): the weights come with each call and the handle's buffers are workspaces
between calls, so a model of many MoE layers pays for them once, and every layer's calls
run on the current stream in the model's order, as Megatron runs them. The shared handles
live until release_shared_handles() (collective) or the end of the process.

The config mapping and the checks need no torch; the layer needs torch and megatron-core.
"""
from __future__ import annotations

import os
import re

_EXPERT_KEY = re.compile(r"experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|_extra_state)")


def _field(config, name, default=None):
    return getattr(config, name, default)


def check_megatron_config(config) -> None:
    """Raise ValueError naming the field when the layer cannot serve this config."""
    if not _field(config, "num_moe_experts"):
        raise ValueError("config.num_moe_experts is not set: the layer is a mixture of experts")
    if not _field(config, "gated_linear_unit", False):
        raise ValueError("config.gated_linear_unit = False: comet's experts are SwiGLU (gated_linear_unit=True, "
                         "activation_func=torch.nn.functional.silu)")
    act = _field(config, "activation_func")
    if act is not None and getattr(act, "__name__", "") != "silu":
        raise ValueError(f"config.activation_func = {getattr(act, '__name__', act)!r}: comet's experts are SwiGLU "
                         f"(torch.nn.functional.silu)")
    if _field(config, "add_bias_linear", False):
        raise ValueError("config.add_bias_linear = True: comet's experts have no biases")
    if _field(config, "moe_shared_expert_intermediate_size"):
        raise ValueError("config.moe_shared_expert_intermediate_size is set: shared experts are not served")
    if _field(config, "moe_expert_capacity_factor") is not None:
        raise ValueError("config.moe_expert_capacity_factor is set: comet drops no tokens (leave it None)")
    if _field(config, "moe_latent_size"):
        raise ValueError("config.moe_latent_size is set: latent projections are not served")
    if _field(config, "fp4"):
        raise ValueError("config.fp4 is set: comet runs bf16 or block-scaled FP8")
    fp8, recipe = _field(config, "fp8"), _field(config, "fp8_recipe")
    if fp8 and (fp8 != "e4m3" or recipe != "blockwise"):
        raise ValueError(f"config.fp8 = {fp8!r} with fp8_recipe = {recipe!r}: comet's FP8 is block-scaled E4M3 "
                         f"throughout (fp8 'e4m3', fp8_recipe 'blockwise': DeepSeek-V3's recipe)")


def blockwise_pow2_scales() -> bool:
    """Whether Transformer Engine's blockwise recipe (Float8BlockScaling) makes power-of-two
    scales: its default, unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES is "1"."""
    return os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1"


def moe_config_from_megatron(config, max_tokens: int, fp8: bool = False, fp8_wgrad_cublaslt: bool = False,
                             fp8_pow2_scales=None):
    """comet's MoeConfig for a Megatron TransformerConfig (checked first), max_tokens the
    most tokens one rank passes in a call (sequence length x micro-batch size, divided by
    the tensor-parallel size under sequence parallelism): block-scaled FP8 where the config
    says fp8 'e4m3' with fp8_recipe 'blockwise', or `fp8`; else bf16. fp8_wgrad_cublaslt
    and fp8_pow2_scales: comet_moe_config_t's (FP8 only: comet refuses either on bf16,
    naming the field); fp8_pow2_scales None: in FP8 the blockwise recipe's rule
    (blockwise_pow2_scales), in bf16 off."""
    from .config import MoeConfig
    check_megatron_config(config)
    dtype = "fp8" if fp8 or _field(config, "fp8") else "bf16"
    if fp8_pow2_scales is None:
        fp8_pow2_scales = dtype == "fp8" and blockwise_pow2_scales()
    ffn = _field(config, "moe_ffn_hidden_size") or _field(config, "ffn_hidden_size")
    etp = _field(config, "expert_tensor_parallel_size")
    if etp is None:  # Megatron's default: the tensor-parallel size
        etp = _field(config, "tensor_model_parallel_size", 1) or 1
    return MoeConfig(hidden=int(config.hidden_size), ffn=int(ffn), num_experts=int(config.num_moe_experts),
                     top_k=int(config.moe_router_topk), max_tokens=max_tokens,
                     ep_size=int(_field(config, "expert_model_parallel_size", 1) or 1), tp_size=int(etp),
                     dtype=dtype, fp8_pow2_scales=fp8_pow2_scales,
                     fp8_wgrad_cublaslt=bool(fp8_wgrad_cublaslt))


# (process group or Comm, the handle's settings, Comm, Moe, whether the Comm was made here)
# of the layers made so far: one handle per shape and communicator. Held until
# release_shared_handles(): a weak hold would let each rank's garbage collector decide
# when a handle goes, and ranks that decided apart would use different handles.
_SHARED = []


def _shared_handle(source, settings, make):
    """The (Comm, Moe) made for `source` (a process group or a Comm) with these settings,
    else make() -> (Comm, Moe, made_comm) once and remember it."""
    for owner, known, comm, moe, _ in _SHARED:
        if owner is source and known == settings and not getattr(moe, "closed", False):
            return comm, moe
    comm, moe, made_comm = make()
    _SHARED.append((source, settings, comm, moe, made_comm))
    return comm, moe


def release_shared_handles() -> None:
    """Close the comet handles CometMoELayer shares, and the communicators it made for
    them. Collective: every rank calls it at the same point, after the last call of the
    layers that use them (a layer called after it raises, its handle closed)."""
    while _SHARED:
        _, _, comm, moe, made_comm = _SHARED.pop()
        moe.close()
        if made_comm:
            comm.close()


def _layer_class():
    from ._torch import torch

    class CometMoELayer(torch.nn.Module):
        """Megatron-Core's MoELayer with comet's dispatcher and experts (see the module's
        note). comm, moe: an existing comet Comm / Moe instead of ones made here (moe
        serves tests with a stand-in layer). share_handle: reuse the Comm and Moe an
        earlier layer of the same shape, group and settings made (False: make its own).
        resend_x: keep no x rows between the forward and the backward, which sends x
        again (comet_moe_config_t.resend_x): less memory per layer in flight, for a
        receive buffer that grows once per handle (it pays from two layers in flight).
        fp8_gate_up: in FP8, "e4m3" keeps each row's gate and up in E4M3 between the
        forward and the backward (comet_moe.Moe's fp8_gate_up): about half the memory.
        fp8_wgrad_cublaslt: in FP8, the weight gradients as cuBLASLt's GEMM per expert
        (comet_moe_config_t.fp8_wgrad_cublaslt): faster on large experts, for a host wait
        in each backward, which then cannot be captured in a CUDA graph.
        fp8_pow2_scales: in FP8, the scales comet makes rounded up to powers of two (True)
        or amax / 448 (False); None follows Transformer Engine's blockwise recipe
        (blockwise_pow2_scales)."""

        def __init__(self, config, max_tokens: int, pg_collection=None, layer_number=None, *, comm=None,
                     moe=None, impl="auto", max_recv_rows: int = 0, grad_accumulation: str = "main_grad",
                     share_handle: bool = True, resend_x: bool = False, fp8: bool = False,
                     fp8_gate_up: str = "bf16", fp8_wgrad_cublaslt: bool = False, fp8_pow2_scales=None):
            super().__init__()
            from megatron.core.transformer.moe.router import TopKRouter
            cfg = moe_config_from_megatron(config, max_tokens, fp8, fp8_wgrad_cublaslt, fp8_pow2_scales)
            cfg.resend_x = int(bool(resend_x))
            self.config, self.layer_number, self.impl = config, layer_number, impl
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
                pg_collection = get_default_pg_collection()
            self.router = TopKRouter(config=config, pg_collection=pg_collection)
            if moe is None:
                from .comm import Comm
                from .moe import Moe

                def make():
                    c = comm or Comm.from_process_group(group=pg_collection.tp_ep)
                    return c, Moe(c, cfg, max_recv_rows=max_recv_rows, grad_accumulation=grad_accumulation,
                                  fp8_gate_up=fp8_gate_up), comm is None
                if share_handle:  # the same on every rank: the layers are built in the same order
                    comm, moe = _shared_handle(comm or pg_collection.tp_ep,
                                               (bytes(cfg), max_recv_rows, grad_accumulation, fp8_gate_up), make)
                else:
                    comm, moe, _ = make()
            self.moe = moe
            # FP8: Megatron's optimizers update the weights through buffers their version
            # counters do not see, so the FP8 copies are renewed on each iteration's first
            # micro-batch, which Megatron marks (set_is_first_microbatch, with config.fp8
            # set); with fp8=True and no such config, on every forward.
            self.fp8, self.is_first_microbatch = cfg.dtype_name == "fp8", True
            self._fp8_marked = bool(_field(config, "fp8"))
            self.top_k, self.hidden = int(cfg.top_k), int(cfg.hidden)
            E, Fl, H = int(moe.experts_per_rank), int(moe.ffn_local), int(cfg.hidden)
            device = getattr(getattr(moe, "comm", None), "device", None)
            self.w13 = torch.nn.Parameter(torch.empty(E, 2 * Fl, H, dtype=torch.bfloat16, device=device))
            self.w2 = torch.nn.Parameter(torch.empty(E, H, Fl, dtype=torch.bfloat16, device=device))
            for p in (self.w13, self.w2):
                p.allreduce = False  # Megatron's mark of an expert parameter
            with torch.no_grad():  # per expert, as Megatron's linear_fc1 and linear_fc2 initialise
                for e in range(E):
                    config.init_method(self.w13[e])
                    config.output_layer_init_method(self.w2[e])

        def set_layer_number(self, layer_number: int):
            self.layer_number = layer_number
            self.router.set_layer_number(layer_number)

        def forward(self, hidden_states, padding_mask=None):
            """hidden_states [s, b, h] -> (output [s, b, h], None), as Megatron's MoELayer."""
            shape = hidden_states.shape
            probs, routing_map = self.router(hidden_states, padding_mask) if padding_mask is not None \
                else self.router(hidden_states)
            # The router's k choices per token: routing_map holds exactly k (no token dropping).
            ids = torch.topk(routing_map.to(torch.int8), self.top_k, dim=-1).indices
            weights = probs.gather(1, ids).float().contiguous()
            x = hidden_states.reshape(-1, self.hidden).to(torch.bfloat16).contiguous()
            if self.fp8 and (self.is_first_microbatch or not self._fp8_marked):
                self.moe.refresh_fp8_weights((self.w13, self.w2))
                self.is_first_microbatch = False
            y = self.moe.forward(x, ids.to(torch.int32).contiguous(), weights, gate_up=self.w13, down=self.w2,
                                 impl=self.impl)
            return y.view(shape).to(hidden_states.dtype), None

        # ---- Megatron's SequentialMLP names outside, packed parameters inside ----

        def _save_to_state_dict(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            for name in ("w13", "w2"):
                destination.pop(prefix + name, None)
            w13 = self.w13 if keep_vars else self.w13.detach()
            w2 = self.w2 if keep_vars else self.w2.detach()
            for e in range(w13.shape[0]):
                destination[f"{prefix}experts.local_experts.{e}.linear_fc1.weight"] = w13[e]
                destination[f"{prefix}experts.local_experts.{e}.linear_fc2.weight"] = w2[e]
                # Megatron's linears save an extra state (None without Transformer Engine)
                # and, loading strictly, expect one.
                destination[f"{prefix}experts.local_experts.{e}.linear_fc1._extra_state"] = None
                destination[f"{prefix}experts.local_experts.{e}.linear_fc2._extra_state"] = None

        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                  error_msgs):
            rest, found = {}, set()
            for key, value in state_dict.items():
                m = _EXPERT_KEY.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
                if m is None:
                    rest[key] = value
                    continue
                e, name = int(m[1]), m[2]
                target = self.w13 if name == "linear_fc1" else self.w2
                if m[3] == "_extra_state":  # Transformer Engine's fp8 metadata at most: a bf16 layer has none
                    if e >= target.shape[0]:
                        unexpected_keys.append(key)
                    continue
                if e >= target.shape[0] or tuple(value.shape) != tuple(target.shape[1:]):
                    error_msgs.append(f"{key}: shape {tuple(value.shape)} for local expert {e}; this rank holds "
                                      f"{target.shape[0]} experts of {tuple(target.shape[1:])}")
                    continue
                with torch.no_grad():
                    target[e].copy_(value)
                found.add((e, name))
            if strict:
                for e in range(self.w13.shape[0]):
                    for name in ("linear_fc1", "linear_fc2"):
                        if (e, name) not in found:
                            missing_keys.append(f"{prefix}experts.local_experts.{e}.{name}.weight")
            super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            for name in ("w13", "w2"):
                if prefix + name in missing_keys:
                    missing_keys.remove(prefix + name)

    return CometMoELayer


def __getattr__(name):
    # torch and megatron-core are imported on first use, so the config mapping needs neither.
    if name == "CometMoELayer":
        cls = _layer_class()
        globals()["CometMoELayer"] = cls
        return cls
    raise AttributeError(f"module 'comet_moe.megatron' has no attribute {name!r}")
