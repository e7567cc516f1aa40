"""test_args.py - the forward call's argument checks, on small stand-in tensors (no torch
needed), what Moe.forward passes to C through torch's custom operators (a stand-in of
libcomet records it; with torch, on the CPU), and the rank layout under tensor
parallelism.
"""
from __future__ import annotations

import comet_moe
from comet_moe import checks
from comet_moe.checks import PTR_MAX
from helpers import check, check_eq, need_torch, raises


# ---- the forward call's checks, on stand-in tensors ----

class FakeTensor:
    """What checks.py reads of a tensor."""

    def __init__(self, shape, dtype=checks.BF16, device="cuda:0", ptr=0x7F0000000000, contiguous=True, itemsize=None):
        self.shape, self.dtype, self.device, self._ptr, self._contig = tuple(shape), dtype, device, ptr, contiguous
        self._itemsize = itemsize or {checks.BF16: 2, checks.INT32: 4, checks.FLOAT32: 4, checks.FP8: 1}.get(dtype, 8)

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._contig

    def stride(self):
        s, out = 1, []
        for d in reversed(self.shape):
            out.insert(0, s)
            s *= d
        return tuple(out) if self._contig else tuple(reversed(out))

    def element_size(self):
        return self._itemsize


class ArgSet:
    """A valid set of forward arguments for MoeConfig(H=256, F=128, E=8, k=2,
    max_tokens=64) on rank 0 of 2 (4 local experts), each at its own address. tp=2:
    the config has tp_size 2 and the weights are one TP rank's ffn / 2 = 64 columns
    (on rank 0 of 4: EP 2 x TP 2, still 4 local experts)."""
    H, F, K, E_LOCAL, M = 256, 128, 2, 4, 40

    def __init__(self, m=M, tp=1, **changes):
        H, K, E = self.H, self.K, self.E_LOCAL
        self.tp = tp
        F = self.F // tp
        base = iter(range(0x10000000, 0x10000000 * 100, 0x10000000))
        self.kw = dict(
            x=FakeTensor((m, H), ptr=next(base)),
            topk_ids=FakeTensor((m, K), checks.INT32, ptr=next(base)),
            topk_weights=FakeTensor((m, K), checks.FLOAT32, ptr=next(base)),
            gate_up=FakeTensor((E, 2 * F, H), ptr=next(base)),
            gate=None, up=None,
            down=FakeTensor((E, H, F), ptr=next(base)),
            out=FakeTensor((m, H), ptr=next(base)),
        )
        self.kw.update(changes)

    def run(self, **resolved):
        cfg = comet_moe.MoeConfig(hidden=self.H, ffn=self.F, num_experts=8, top_k=self.K, max_tokens=64,
                                  tp_size=0 if self.tp == 1 else self.tp)
        return checks.check_forward_args(cfg, self.E_LOCAL, "cuda:0", **self.kw, **resolved)


def _nbytes(t):
    """The bytes a stand-in tensor spans."""
    n = t.element_size()
    for d in t.shape:
        n *= d
    return n


def args_cfg():
    """ArgSet's config with tp_size 1."""
    return comet_moe.MoeConfig(hidden=ArgSet.H, ffn=ArgSet.F, num_experts=8, top_k=ArgSet.K, max_tokens=64)


def test_forward_checks_accept_valid_arguments():
    check_eq(ArgSet().run(), ArgSet.M, "num_tokens of a valid call")
    check_eq(ArgSet(m=64).run(), 64, "exactly max_tokens")
    check_eq(ArgSet(m=0, x=FakeTensor((0, 256), ptr=0), out=None).run(), 0, "no tokens (null data pointers)")
    H, F = ArgSet.H, ArgSet.F
    split = ArgSet(gate_up=None, gate=FakeTensor((4, F, H), ptr=0x90000000), up=FakeTensor((4, F, H), ptr=0xA0000000))
    check_eq(split.run(), ArgSet.M, "gate and up apart")
    check_eq(ArgSet(out=None).run(), ArgSet.M, "out allocated by forward")


def test_forward_checks_refuse_wrong_dtypes():
    raises(TypeError, lambda: ArgSet(x=FakeTensor((40, 256), "torch.float16")).run(),
           "x.dtype = torch.float16", "expected torch.bfloat16", "x.to(torch.bfloat16)")
    raises(TypeError, lambda: ArgSet(topk_ids=FakeTensor((40, 2), "torch.int64")).run(),
           "topk_ids.dtype = torch.int64", "expected torch.int32", "topk_ids.to(torch.int32)")
    raises(TypeError, lambda: ArgSet(topk_weights=FakeTensor((40, 2), checks.BF16)).run(),
           "topk_weights.dtype = torch.bfloat16", "expected torch.float32")
    raises(TypeError, lambda: ArgSet(down=FakeTensor((4, 256, 128), checks.FLOAT32)).run(), "down.dtype")
    raises(TypeError, lambda: ArgSet(out=FakeTensor((40, 256), checks.FLOAT32)).run(), "out.dtype")
    raises(TypeError, lambda: ArgSet(x=[[0.0] * 256] * 40).run(), "x: expected a torch.Tensor, got list")
    raises(TypeError, lambda: ArgSet(topk_ids=None).run(), "topk_ids: expected a torch.Tensor, got NoneType")


def test_forward_checks_refuse_wrong_shapes_and_sizes():
    raises(ValueError, lambda: ArgSet(m=65).run(), "x.shape[0] = 65 tokens", "config.max_tokens = 64")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 255))).run(), "x.shape = (40, 255)", "hidden = 256")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((2, 20, 256))).run(), "x.shape = (2, 20, 256)", "reshape(-1, 256)")
    raises(ValueError, lambda: ArgSet(topk_ids=FakeTensor((40, 3), checks.INT32)).run(),
           "topk_ids.shape = (40, 3)", "num_tokens = 40, top_k = 2")
    raises(ValueError, lambda: ArgSet(topk_weights=FakeTensor((39, 2), checks.FLOAT32)).run(),
           "topk_weights.shape = (39, 2)")
    raises(ValueError, lambda: ArgSet(gate_up=FakeTensor((8, 256, 256))).run(),
           "gate_up.shape = (8, 256, 256)", "local experts = 4")
    raises(ValueError, lambda: ArgSet(down=FakeTensor((4, 128, 256))).run(), "down.shape = (4, 128, 256)",
           "hidden = 256, ffn = 128")
    raises(ValueError, lambda: ArgSet(out=FakeTensor((41, 256))).run(), "out.shape = (41, 256)")
    raises(ValueError, lambda: ArgSet(gate=FakeTensor((4, 128, 256))).run(), "gate_up, or gate and up, not both")
    raises(ValueError, lambda: ArgSet(gate_up=None, gate=FakeTensor((4, 128, 256))).run(), "up is None")
    raises(ValueError, lambda: ArgSet(down=None).run(), "down is None")


def test_forward_checks_refuse_wrong_devices_and_layouts():
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 256), device="cpu")).run(),
           "x is on cpu", "expected cuda:0, the communicator's device")
    raises(ValueError, lambda: ArgSet(topk_weights=FakeTensor((40, 2), checks.FLOAT32, device="cuda:1")).run(),
           "topk_weights is on cuda:1")
    raises(ValueError, lambda: ArgSet(gate_up=FakeTensor((4, 256, 256), device="cuda:1")).run(), "gate_up is on cuda:1")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 256), contiguous=False)).run(),
           "x is not contiguous", "x.contiguous()")
    raises(ValueError, lambda: ArgSet(down=FakeTensor((4, 256, 128), contiguous=False)).run(), "down is not contiguous")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 256), ptr=0x10000008)).run(),
           "x.data_ptr() = 0x10000008", "16-byte aligned")
    raises(ValueError, lambda: ArgSet(topk_ids=FakeTensor((40, 2), checks.INT32, ptr=0x20000002)).run(),
           "4-byte aligned")
    x = FakeTensor((40, 256), ptr=0x10000000)
    raises(ValueError, lambda: ArgSet(x=x, out=FakeTensor((40, 256), ptr=0x10000000 + 256 * 2 * 8)).run(),
           "out overlaps x")


def test_forward_checks_refuse_out_over_any_input():
    # comet reads every input, the weights too, while it writes out: no byte may be shared.
    H, F, E = ArgSet.H, ArgSet.F, ArgSet.E_LOCAL
    args = ArgSet(gate_up=None, gate=FakeTensor((E, F, H), ptr=0x90000000), up=FakeTensor((E, F, H), ptr=0xA0000000))
    for name in ("x", "topk_ids", "topk_weights", "gate", "up", "down"):
        t = args.kw[name]
        inside = t.data_ptr() + (_nbytes(t) // 2) // 16 * 16  # out starts in the middle of it
        bad = dict(args.kw, out=FakeTensor((40, H), ptr=inside))
        raises(ValueError, lambda: checks.check_forward_args(args_cfg(), E, "cuda:0", **bad),
               f"out overlaps {name}", f"{name}'s [{t.data_ptr():#x}, {t.data_ptr() + _nbytes(t):#x})",
               f"out's bytes [{inside:#x}")
    w = ArgSet().kw["gate_up"]
    raises(ValueError, lambda: ArgSet(out=FakeTensor((40, H), ptr=w.data_ptr())).run(), "out overlaps gate_up")
    # out ending inside down's first bytes, and down ending inside out's first bytes.
    d = ArgSet().kw["down"]
    raises(ValueError, lambda: ArgSet(out=FakeTensor((40, H), ptr=d.data_ptr() - 40 * H * 2 + 16)).run(),
           "out overlaps down")
    raises(ValueError, lambda: ArgSet(out=FakeTensor((40, H), ptr=d.data_ptr() + _nbytes(d) - 16)).run(),
           "out overlaps down")
    # Touching is not overlapping: out right before and right after down is fine.
    check_eq(ArgSet(out=FakeTensor((40, H), ptr=d.data_ptr() - 40 * H * 2)).run(), ArgSet.M, "out just before down")
    check_eq(ArgSet(out=FakeTensor((40, H), ptr=d.data_ptr() + _nbytes(d))).run(), ArgSet.M, "out just after down")
    # No tokens: out holds no bytes, wherever it points.
    check_eq(ArgSet(m=0, x=FakeTensor((0, H), ptr=0), out=FakeTensor((0, H), ptr=d.data_ptr() + 64)).run(), 0,
             "an empty out inside down")


# ---- what forward passes to C, through a stand-in of libcomet ----

class StubLib:
    """The CUDA and comet calls Moe.forward makes, recorded; nothing runs."""

    def __init__(self):
        self.calls = []

    def cudaGetDevice(self, ref):
        return 0

    def cudaSetDevice(self, index):
        return 0

    def comet_moe_forward(self, ptr, args, stream):
        self.calls.append((args._obj.num_tokens, args._obj.impl, stream.value))
        return 0


def stub_layer(device="cuda:0", lib=None, cfg=None):
    """A Moe on rank 0 of 2 over StubLib (or `lib`), with ArgSet's config (or `cfg`), built
    without comet; its tensors live on `device`."""
    from comet_moe.comm import _Box
    lib = StubLib() if lib is None else lib
    comm = comet_moe.Comm.__new__(comet_moe.Comm)
    comm._box, comm._lib, comm._moe_boxes, comm.device_index = None, lib, [], 0
    layer = comet_moe.Moe.__new__(comet_moe.Moe)
    layer._box, layer._lib, layer.comm, layer.config = _Box(0x1234), lib, comm, args_cfg() if cfg is None else cfg
    layer.experts_per_rank, layer.ffn_local, layer.tp_size, layer.grad_accumulation = ArgSet.E_LOCAL, ArgSet.F, 1, "grad"
    layer._register(device)
    return layer, lib


# ---- an FP8 layer's checks ----

class Fp8ArgSet(ArgSet):
    """ArgSet for an FP8 layer (dtype "fp8"): float8_e4m3fn weights with float32 scales,
    one per 128 x 128 block (ffn 128: gate_up's 256 rows are 2 blocks, hidden 256 is 2)."""

    def __init__(self, m=ArgSet.M, tp=1, **changes):
        H, E = self.H, self.E_LOCAL
        F = self.F // tp
        base = iter(range(0x10000000, 0x10000000 * 100, 0x10000000))
        kw = dict(
            x=FakeTensor((m, H), ptr=next(base)),
            topk_ids=FakeTensor((m, self.K), checks.INT32, ptr=next(base)),
            topk_weights=FakeTensor((m, self.K), checks.FLOAT32, ptr=next(base)),
            gate_up=FakeTensor((E, 2 * F, H), checks.FP8, ptr=next(base)),
            gate=None, up=None,
            down=FakeTensor((E, H, F), checks.FP8, ptr=next(base)),
            out=FakeTensor((m, H), ptr=next(base)),
        )
        self.scales = dict(gate_up=FakeTensor((E, 2 * F // 128, 2), checks.FLOAT32, ptr=next(base)), gate=None,
                           up=None, down=FakeTensor((E, 2, (F + 127) // 128), checks.FLOAT32, ptr=next(base)))
        self.x_scales = None
        for name in ("gate_up", "gate", "up", "down"):
            if name + "_scale" in changes:
                self.scales[name] = changes.pop(name + "_scale")
        self.x_scales = changes.pop("x_scales", None)
        super().__init__(m, tp)
        self.kw = dict(kw, **changes)

    def run(self, fp8=True, **resolved):
        cfg = comet_moe.MoeConfig(hidden=self.H, ffn=self.F, num_experts=8, top_k=self.K, max_tokens=64,
                                  tp_size=0 if self.tp == 1 else self.tp, dtype="fp8" if fp8 else "bf16")
        scales = tuple(self.scales[n] for n in ("gate_up", "gate", "up", "down"))
        return checks.check_forward_args(cfg, self.E_LOCAL, "cuda:0", **self.kw, **resolved, fp8=fp8, scales=scales,
                                         x_scales=self.x_scales)


def test_fp8_forward_checks_take_weights_with_their_scales():
    H, E, M = ArgSet.H, ArgSet.E_LOCAL, ArgSet.M
    f32 = checks.FLOAT32
    check_eq(Fp8ArgSet().run(), M, "gate_up [4, 256, 256] with [4, 2, 2] scales, down [4, 256, 128] with [4, 2, 1]")
    apart = dict(gate_up=None, gate=FakeTensor((E, 64, H), checks.FP8, ptr=0x90000000),
                 up=FakeTensor((E, 64, H), checks.FP8, ptr=0xA0000000), gate_up_scale=None,
                 gate_scale=FakeTensor((E, 1, 2), f32, ptr=0xB0000000),
                 up_scale=FakeTensor((E, 1, 2), f32, ptr=0xC0000000))
    check_eq(Fp8ArgSet(tp=2, **apart).run(), M, "tp 2: ffn / tp_size = 64, gate and up apart, a partial block each")
    x8 = FakeTensor((M, H), checks.FP8, ptr=0xD0000000)
    check_eq(Fp8ArgSet(x=x8, x_scales=FakeTensor((M, 2), f32, ptr=0xE0000000)).run(), M, "x in FP8 with its scales")
    check_eq(Fp8ArgSet(m=0, x=FakeTensor((0, H), ptr=0), out=None).run(), 0, "no tokens")
    # bf16 weights on an FP8 layer, and the other way round.
    raises(TypeError, lambda: Fp8ArgSet(gate_up=FakeTensor((E, 256, H))).run(), "gate_up.dtype = torch.bfloat16",
           "expected torch.float8_e4m3fn", "comet_moe.quantize_fp8_weights(gate_up in bf16)")
    raises(TypeError, lambda: ArgSet(gate_up=FakeTensor((E, 256, H), checks.FP8)).run(),
           "gate_up.dtype = torch.float8_e4m3fn", "expected torch.bfloat16")
    raises(ValueError, lambda: Fp8ArgSet(gate_up=FakeTensor((E, 256, H), ptr=0x30000000)).run(fp8=False),
           "gate_up_scale is given, but this layer is bf16", "dtype='fp8'")
    # Scales: each beside its weight, float32, one per block.
    raises(ValueError, lambda: Fp8ArgSet(down_scale=None).run(), "down_scale is None", "weight_scale_inv")
    raises(ValueError, lambda: Fp8ArgSet(gate_scale=FakeTensor((E, 1, 2), f32)).run(),
           "gate_scale is given without gate")
    raises(ValueError, lambda: Fp8ArgSet(gate_up_scale=FakeTensor((E, 1, 2), f32)).run(),
           "gate_up_scale.shape = (4, 1, 2)", "2 * ffn / 128 = 2", "ceil(hidden / 128) = 2")
    raises(ValueError, lambda: Fp8ArgSet(down_scale=FakeTensor((E, 2, 2), f32)).run(),
           "down_scale.shape = (4, 2, 2)", "ceil(hidden / 128) = 2, ceil(ffn / 128) = 1")
    raises(TypeError, lambda: Fp8ArgSet(down_scale=FakeTensor((E, 2, 1), checks.BF16)).run(),
           "down_scale.dtype = torch.bfloat16", "expected torch.float32", "down_scale.float()")
    raises(ValueError, lambda: Fp8ArgSet(down_scale=FakeTensor((E, 2, 1), f32, device="cuda:1")).run(),
           "down_scale is on cuda:1")
    raises(ValueError, lambda: Fp8ArgSet(gate_up_scale=FakeTensor((E, 2, 2), f32, ptr=0x70000004)).run(),
           "gate_up_scale.data_ptr() = 0x70000004", "16-byte aligned")
    # gate and up in one tensor need 128-row blocks that hold one of them alone.
    raises(ValueError, lambda: Fp8ArgSet(tp=2, gate_up_scale=FakeTensor((E, 1, 2), f32)).run(),
           "gate_up with FP8 weights and ffn / tp_size = 64", "give gate and up apart")
    # x: bf16, or FP8 with x_scales [M, ceil(H / 128)].
    raises(ValueError, lambda: Fp8ArgSet(x=x8).run(), "x is torch.float8_e4m3fn: give its x_scales",
           "ceil(hidden / 128) = 2", "quantize_fp8_rows")
    raises(ValueError, lambda: Fp8ArgSet(x=x8, x_scales=FakeTensor((M, 1), f32)).run(), "x_scales.shape = (40, 1)")
    raises(ValueError, lambda: Fp8ArgSet(x_scales=FakeTensor((M, 2), f32)).run(),
           "x_scales is given with a torch.bfloat16 x")
    raises(ValueError, lambda: Fp8ArgSet(gate_up_scale=None, down_scale=None, x_scales=FakeTensor((M, 2), f32)).run(
        fp8=False), "x_scales is given, but this layer is bf16")
    # out overlapping a scale: comet reads the scales while it writes out.
    d = Fp8ArgSet().scales["down"]
    raises(ValueError, lambda: Fp8ArgSet(out=FakeTensor((M, H), ptr=d.data_ptr())).run(), "out overlaps down_scale")


def test_forward_refuses_a_stream_ctypes_would_truncate():
    # Each would reach C as its low 64 bits (2**64 + 0x5000 as 0x5000), or as a rounded
    # int; refused in Python before torch is imported or anything is called.
    layer, lib = stub_layer()
    try:
        kw = ArgSet().kw
        raises(ValueError, lambda: layer.forward(**kw, stream=2**64 + 0x5000), "stream = 18446744073709572096",
               f"0..{PTR_MAX}", "cudaStream_t")
        raises(ValueError, lambda: layer.forward(**kw, stream=-1), "stream = -1")
        raises(TypeError, lambda: layer.forward(**kw, stream=0x5000 + 0.5), "stream = 20480.5", "expected an int")
        raises(TypeError, lambda: layer.forward(**kw, stream=True), "stream = True")

        class FakeStream:
            cuda_stream = 2**70

        raises(ValueError, lambda: layer.forward(**kw, stream=FakeStream()), "stream = 1180591620717411303424")
        raises(ValueError, lambda: layer.forward(**kw, impl=2**32 + 2, stream=0x5000), "impl = 4294967298")
        check_eq(lib.calls, [], "calls that reached comet_moe_forward after a refused argument")
    finally:
        layer._box = None  # no comet_moe_destroy on the stand-in


def test_forward_passes_comet_what_it_was_given():
    """Through the custom operators (comet_moe::forward and forward_out) to the C call:
    the token count, the impl and the stream, the widest stream included; the addresses
    checked on the way (an out over a weight is refused before the call)."""
    torch = need_torch()
    layer, lib = stub_layer("cpu")
    try:
        H, F, K, E, M = ArgSet.H, ArgSet.F, ArgSet.K, ArgSet.E_LOCAL, ArgSet.M
        bf16 = torch.bfloat16
        kw = dict(topk_ids=torch.zeros(M, K, dtype=torch.int32), topk_weights=torch.zeros(M, K),
                  gate_up=torch.zeros(E, 2 * F, H, dtype=bf16), down=torch.zeros(E, H, F, dtype=bf16))
        x, out = torch.zeros(M, H, dtype=bf16), torch.zeros(M, H, dtype=bf16)
        check(layer.forward(x, **kw, out=out, stream=0x5000) is out, "forward returns out")
        check(layer.forward(x, **kw, stream=PTR_MAX, impl="fused").shape == (M, H), "y allocated by the operator")
        check_eq(lib.calls, [(M, 0, 0x5000), (M, 2, PTR_MAX)], "what reached comet_moe_forward")
        lib.calls.clear()
        inside = kw["down"].view(-1)[:M * H].view(M, H)
        raises(ValueError, lambda: layer.forward(x, **kw, out=inside, stream=0x5000), "out overlaps down")
        raises(ValueError, lambda: layer.forward(x.view(-1)[4:4 + M * H // 2].view(M // 2, H), **dict(
            kw, topk_ids=kw["topk_ids"][:M // 2], topk_weights=kw["topk_weights"][:M // 2]), stream=1),
            "x.data_ptr()", "16-byte aligned")
        check_eq(lib.calls, [], "calls that reached comet_moe_forward after a refused argument")
    finally:
        layer._box = None


def test_forward_checks_take_the_tp_slice():
    H, F = ArgSet.H, ArgSet.F  # tp 2: Fl = 64
    check_eq(ArgSet(tp=2).run(), ArgSet.M, "tp 2: gate_up [4, 128, 256], down [4, 256, 64]")
    check_eq(ArgSet(tp=2).run(ffn_local=64, tp_size=2), ArgSet.M, "tp 2, as Moe passes it resolved")
    split = ArgSet(tp=2, gate_up=None, gate=FakeTensor((4, 64, H), ptr=0x90000000),
                   up=FakeTensor((4, 64, H), ptr=0xA0000000))
    check_eq(split.run(), ArgSet.M, "tp 2: gate and up [4, 64, 256] apart")
    # The whole expert (full F) is refused, naming the dimension as ffn / tp_size.
    raises(ValueError, lambda: ArgSet(tp=2, gate_up=FakeTensor((4, 2 * F, H))).run(),
           "gate_up.shape = (4, 256, 256)", "2 * ffn / tp_size = 128", "tp_size = 2", "ffn = 128")
    raises(ValueError, lambda: ArgSet(tp=2, down=FakeTensor((4, H, F))).run(),
           "down.shape = (4, 256, 128)", "hidden = 256, ffn / tp_size = 64]")
    raises(ValueError, lambda: ArgSet(tp=2, gate_up=None, gate=FakeTensor((4, F, H), ptr=0x90000000),
                                      up=FakeTensor((4, 64, H), ptr=0xA0000000)).run(),
           "gate.shape = (4, 128, 256)", "ffn / tp_size = 64")
    raises(ValueError, lambda: ArgSet(tp=2, gate_up=None, gate=FakeTensor((4, 64, H))).run(), "up is None",
           "[E_local, F/tp, H]")
    raises(ValueError, lambda: ArgSet(tp=2, down=None).run(), "down is None", "[E_local, H, F/tp]")
    # A config with tp_size 0 read as 1; the resolved values Moe passes win over the config.
    e = raises(ValueError, lambda: ArgSet().run(tp_size=2, ffn_local=64), "2 * ffn / tp_size = 128")
    check("tp_size" in str(e), "resolved tp_size named")
    # tp_size 1 keeps the messages without tensor parallelism.
    e = raises(ValueError, lambda: ArgSet(down=FakeTensor((4, H, 64))).run(), "hidden = 256, ffn = 128]")
    check("tp_size" not in str(e), f"tp 1 message mentions tp_size: {e}")


def test_rank_layout_under_tensor_parallelism():
    from comet_moe.moe import _rank_layout
    cfg = comet_moe.MoeConfig(hidden=256, ffn=512, num_experts=8, top_k=2, max_tokens=64, tp_size=2)
    got = [_rank_layout(cfg, 4, r) for r in range(4)]
    check_eq([(g["ep_size"], g["tp_size"], g["ep_rank"], g["tp_rank"], g["experts_per_rank"], g["first_expert"],
               g["ffn_local"]) for g in got],
             [(2, 2, 0, 0, 4, 0, 256), (2, 2, 0, 1, 4, 0, 256), (2, 2, 1, 0, 4, 4, 256), (2, 2, 1, 1, 4, 4, 256)],
             "EP 2 x TP 2 on 4 ranks")
    cfg.tp_size = 0
    check_eq(_rank_layout(cfg, 2, 1), dict(tp_size=1, ep_size=2, ep_rank=1, tp_rank=0, experts_per_rank=4,
                                           first_expert=4, ffn_local=512), "tp_size 0: EP only")
    cfg.tp_size = 2
    check_eq(_rank_layout(cfg, 2, 1), dict(tp_size=2, ep_size=1, ep_rank=0, tp_rank=1, experts_per_rank=8,
                                           first_expert=0, ffn_local=256), "EP 1 x TP 2")


def test_fp8_layer_given_bf16_masters_checks_them():
    """An FP8 layer given bf16 master weights (which it quantizes and trains in FP8) takes
    gate and up in one tensor, and ffn_local a multiple of 128 (a scale block must not hold
    gate and up rows): both refused before anything is quantized or reaches comet."""
    torch = need_torch()
    H, F, K, E, M = ArgSet.H, ArgSet.F, ArgSet.K, ArgSet.E_LOCAL, 8
    bf = torch.bfloat16
    ids, tw, x = torch.zeros(M, K, dtype=torch.int32), torch.zeros(M, K), torch.zeros(M, H, dtype=bf)
    for tp in (1, 2):  # ffn_local 128, then 64
        cfg = comet_moe.MoeConfig(hidden=H, ffn=F, num_experts=8, top_k=K, max_tokens=64, dtype="fp8", tp_size=tp)
        layer, lib = stub_layer("cpu", StubLib(), cfg)
        layer.ffn_local, layer.tp_size = F // tp, tp
        try:
            fl = layer.ffn_local
            gate, up, down = torch.zeros(E, fl, H, dtype=bf), torch.zeros(E, fl, H, dtype=bf), torch.zeros(E, H, fl, dtype=bf)
            raises(ValueError, lambda: layer.forward(x, ids, tw, gate=gate, up=up, down=down), "one tensor")
            if fl % 128:
                raises(ValueError, lambda: layer.forward(x, ids, tw, gate_up=torch.zeros(E, 2 * fl, H, dtype=bf),
                                                         down=down), f"ffn_local = {fl}", "multiple of 128")
            check_eq(lib.calls, [], "nothing reached comet")
        finally:
            layer._box = None


def test_fp8_forward_passes_comet_its_scales():
    """An FP8 layer's call through comet_moe::forward_fp8 and forward_fp8_out: each weight's
    scales in comet_moe_weight_scales_t beside it, x_scales where x is FP8 (NULL where it
    is bf16), y bf16; under autograd, NotImplementedError before anything is called."""
    torch = need_torch()

    class ScalesLib(StubLib):
        def comet_moe_forward(self, ptr, args, stream):
            a = args._obj
            sc = a.weight_scales
            self.calls.append((a.num_tokens, a.weights.gate_up, a.weights.gate, a.weights.up, a.weights.down,
                               sc.gate_up, sc.gate, sc.up, sc.down, a.x_scales, a.y))
            return 0

    H, F, K, E, M = ArgSet.H, ArgSet.F, ArgSet.K, ArgSet.E_LOCAL, 8
    cfg = comet_moe.MoeConfig(hidden=H, ffn=F, num_experts=8, top_k=K, max_tokens=64, dtype="fp8")
    layer, lib = stub_layer("cpu", ScalesLib(), cfg)
    try:
        f8, f32 = torch.float8_e4m3fn, torch.float32
        ids, tw = torch.zeros(M, K, dtype=torch.int32), torch.zeros(M, K)
        gate, up = torch.zeros(E, F, H, dtype=f8), torch.zeros(E, F, H, dtype=f8)
        down = torch.zeros(E, H, F, dtype=f8)
        gs, us, ds = torch.zeros(E, 1, 2, dtype=f32), torch.zeros(E, 1, 2, dtype=f32), torch.zeros(E, 2, 1, dtype=f32)
        x = torch.zeros(M, H, dtype=torch.bfloat16)
        w = dict(gate=gate, up=up, down=down, gate_scale=gs, up_scale=us, down_scale=ds)
        y = layer.forward(x, ids, tw, **w, stream=0x5000)
        check_eq((y.dtype, tuple(y.shape)), (torch.bfloat16, (M, H)), "y")
        p = lambda t: t.data_ptr()  # noqa: E731
        check_eq(lib.calls, [(M, None, p(gate), p(up), p(down), None, p(gs), p(us), p(ds), None, p(y))],
                 "gate and up apart, x bf16: the scales beside their weights, no x_scales")
        lib.calls.clear()
        x8, xs = torch.zeros(M, H, dtype=f8), torch.zeros(M, 2, dtype=f32)
        gate_up, gus = torch.zeros(E, 2 * F, H, dtype=f8), torch.zeros(E, 2, 2, dtype=f32)
        out = torch.empty(M, H, dtype=torch.bfloat16)
        check(layer.forward(x8, ids, tw, gate_up=gate_up, gate_up_scale=gus, down=down, down_scale=ds, x_scales=xs,
                            out=out, stream=1) is out, "out= is written")
        check_eq(lib.calls, [(M, p(gate_up), None, None, p(down), p(gus), None, None, p(ds), p(xs), p(out))],
                 "gate_up, x in FP8 with its scales, into out")
        lib.calls.clear()
        # Training in FP8 is not built: refused before anything reaches comet.
        raises(NotImplementedError, lambda: layer.forward(x.clone().requires_grad_(True), ids, tw, **w),
               "training in FP8 is not built", "torch.no_grad()")
        raises(NotImplementedError, lambda: layer.forward(x, ids, tw.clone().requires_grad_(True), **w),
               "training in FP8 is not built")
        with torch.no_grad():
            layer.forward(x.clone().requires_grad_(True), ids, tw, **w, stream=1)
        check_eq(len(lib.calls), 1, "under no_grad an input that requires grad runs the inference forward")
    finally:
        layer._box = None
