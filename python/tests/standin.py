"""standin.py - comet_moe.Moe with comet's C calls computed on the CPU, for the CPU tests of
what lies between a model and comet: the custom operators (comet_moe::forward,
forward_out, forward_train, backward, and FP8's), their fake implementations and autograd formula,
the saved states' table, main_grad accumulation, and torch.compile over all of it. Only
the calls into libcomet (Moe._comet_*) are replaced; everything above them is the
package's own code.

The stand-in computes what comet_moe_forward and comet_moe_backward compute, from the
layouts of comet.h (gate_up [E_local, 2F, H]: rows 0..F-1 gate, F..2F-1 up, or gate and up
apart; down [E_local, H, F]), in float32 with the results rounded to bf16 (d_topk_weights
stays float32; with accumulation the weight gradients are added in float32), one rank
holding every expert; an FP8 layer's weights (and x, when it comes in FP8) are
dequantized first (comet also rounds x and the activation to E4M3, which the stand-in
does not), and an FP8 layer's master weights are quantized by the tests' torch reference of
comet's quantizer. Its saved state keeps the routing and, unless the config resends x,
the x rows, in a Python object; the bytes it asks for are a fixed size, since what those
bytes hold is comet's business (the GPU tests compare the operators' sizes with comet's).
"""
from __future__ import annotations

from types import SimpleNamespace

import comet_moe
from comet_moe.comm import _Box
from comet_moe.moe import _LAYERS, _rank_layout

SAVED_BYTES = 4096


class CpuComm:
    """What a layer reads of its communicator."""

    def __init__(self, torch):
        self.device, self.device_index, self.rank, self.size = torch.device("cpu"), None, 0, 1


class CpuMoe(comet_moe.Moe):
    """A comet_moe.Moe whose calls into libcomet run on the CPU (see the module's note).
    calls: (what, num_tokens, impl) of each call; saved: every saved state made, each with
    `destroyed` set when the operators gave it back."""

    def __init__(self, torch, config, *, grad_accumulation="grad", max_recv_rows=0, fp8_gate_up="bf16"):  # no C handle
        self.torch, self.config = torch, config.copy()
        self.max_recv_rows, self.grad_accumulation, self.fp8_gate_up = max_recv_rows, grad_accumulation, fp8_gate_up
        self.comm, self._lib, self._box = CpuComm(torch), None, _Box(1)
        for key, value in _rank_layout(self.config, 1, 0).items():
            setattr(self, key, value)
        self.calls, self.saved = [], []
        self._register("cpu")

    def close(self):
        _LAYERS.pop(getattr(self, "_op_id", None), None)
        self._box = None

    # ---- what comet computes ----

    def _split(self, weights):
        gate_up, gate, up, down = weights
        F = self.ffn_local
        if gate_up is not None:
            gate, up = gate_up[:, :F], gate_up[:, F:]
        return gate.float(), up.float(), down.float()

    def _expert_rows(self, topk_ids):
        """For each expert: the (token, choice) pairs routed to it, in token order."""
        ids = topk_ids.long()
        for e in range(self.experts_per_rank):
            tok, slot = (ids == self.first_expert + e).nonzero(as_tuple=True)
            if tok.numel():
                yield e, tok, slot

    def _y(self, x, topk_ids, topk_weights, weights):
        torch, F_ = self.torch, self.torch.nn.functional
        gate, up, down = self._split(weights)
        xf, y = x.float(), torch.zeros(x.shape, dtype=torch.float32)
        for e, tok, slot in self._expert_rows(topk_ids):
            a = F_.silu(xf[tok] @ gate[e].T) * (xf[tok] @ up[e].T)
            y.index_add_(0, tok, (a @ down[e].T) * topk_weights[tok, slot].float().unsqueeze(1))
        return y.to(torch.bfloat16)

    # ---- Moe's calls into libcomet ----

    def _comet_forward(self, x, topk_ids, topk_weights, weights, y, impl, stream=None, scales=None, x_scales=None):
        self.calls.append(("forward", int(x.shape[0]), impl))
        if scales is not None:  # an FP8 layer
            from comet_moe.fp8 import dequantize_fp8
            weights = tuple(None if w is None else dequantize_fp8(w, s) for w, s in zip(weights, scales))
            if x_scales is not None:
                x = dequantize_fp8(x, x_scales)
        y.copy_(self._y(x, topk_ids, topk_weights, weights))

    def _comet_saved_bytes(self):
        return SAVED_BYTES

    def _comet_saved_create_in(self, memory):
        memory.zero_()  # what comet keeps there is its own; here the bytes are at least defined
        state = SimpleNamespace(memory_bytes=memory.numel(), filled=False, destroyed=False)
        self.saved.append(state)
        return state

    def _comet_saved_destroy(self, state):
        state.destroyed = True

    def _quantize_both(self, w):
        """An FP8 layer's master weight both ways, by the tests' torch reference of comet's
        quantizer (fp8_reference.py): W^T the same bytes and scales transposed."""
        from fp8_reference import quantize_weights
        self.calls.append(("quantize", tuple(w.shape), 0))
        q, s = quantize_weights(self.torch, w, pow2=bool(self.config.fp8_pow2_scales))
        return q, s, q.transpose(-1, -2).contiguous(), s.transpose(-1, -2).contiguous()

    def _comet_forward_train(self, x, topk_ids, topk_weights, weights, y, state, impl, scales=None):
        self.calls.append(("forward_train", int(x.shape[0]), impl))
        if scales is not None:  # an FP8 layer: its weights dequantized
            from comet_moe.fp8 import dequantize_fp8
            weights = tuple(None if w is None else dequantize_fp8(w, s) for w, s in zip(weights, scales))
        y.copy_(self._y(x, topk_ids, topk_weights, weights))
        state.x = None if self.config.resend_x else x.clone()
        state.topk_ids, state.topk_weights, state.filled = topk_ids.clone(), topk_weights.clone(), True

    def _comet_backward(self, state, dy, x, weights, dx, d_topk_weights, grads, accumulate, impl, weights_t=None,
                        weight_t_scales=None):
        torch = self.torch
        self.calls.append(("backward", int(dy.shape[0]), impl))
        if weights_t is not None:  # an FP8 layer: W^T dequantized, transposed back
            from comet_moe.fp8 import dequantize_fp8
            gu, dn = (dequantize_fp8(w, s).transpose(-1, -2).contiguous()
                      for w, s in zip(weights_t, weight_t_scales))
            weights = (gu, None, None, dn)
        if not state.filled or (x is not None) != bool(self.config.resend_x):
            raise AssertionError("the backward got a saved state not filled, or x where the config keeps x rows")
        xf = (x if self.config.resend_x else state.x).float()
        gate, up, down = self._split(weights)
        dyf = dy.float()
        dxf = torch.zeros(xf.shape, dtype=torch.float32)
        dtw = torch.zeros(state.topk_weights.shape, dtype=torch.float32)
        dgate, dup, ddown = torch.zeros_like(gate), torch.zeros_like(up), torch.zeros_like(down)
        for e, tok, slot in self._expert_rows(state.topk_ids):
            xe, w = xf[tok], state.topk_weights[tok, slot].float().unsqueeze(1)
            g, u = xe @ gate[e].T, xe @ up[e].T
            s = torch.sigmoid(g)
            a = g * s * u
            dtw[tok, slot] = (dyf[tok] * (a @ down[e].T)).sum(1)
            do = dyf[tok] * w
            ddown[e] += do.T @ a
            da = do @ down[e]
            dg, du = da * u * s * (1 + g * (1 - s)), da * g * s
            dgate[e] += dg.T @ xe
            dup[e] += du.T @ xe
            dxf.index_add_(0, tok, dg @ gate[e] + du @ up[e])
        dx.copy_(dxf.to(torch.bfloat16))
        d_topk_weights.copy_(dtw)
        gate_up, _, _, _ = weights
        parts = ((torch.cat([dgate, dup], dim=1), None, None, ddown) if gate_up is not None else
                 (None, dgate, dup, ddown))
        for target, value in zip(grads, parts):
            if target is None:
                continue
            if accumulate:
                target.add_(value)
            else:
                target.copy_(value.to(torch.bfloat16))
        state.filled = False
