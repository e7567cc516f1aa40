"""test_fp8_cpu.py - block-scaled FP8 in the comet_moe package, on the CPU (torch's CPU build
is enough; every test skips, saying so, without torch): the tests' own quantizer
(fp8_reference.py, which gpu_fp8.py holds comet's kernels to byte for byte) and
dequantize_fp8 on values worked out by hand; the quantizers' argument checks, made
before comet is called.
"""
from __future__ import annotations

import fp8_reference as ref
from helpers import check, check_eq, need_torch, note, raises

# E4M3 bytes and their values (sign, 4 exponent bits with bias 7, 3 mantissa bits).
E4M3 = {0x00: 0.0, 0x80: -0.0, 0x01: 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0, 0x39: 1.125, 0x3A: 1.25, 0x40: 2.0,
        0xB8: -1.0, 0x7E: 448.0, 0xFE: -448.0}


def fp8_bytes(torch, t):
    return t.view(torch.uint8)


def from_bytes(torch, values, shape):
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e4m3fn).view(shape)


# ---- the tests' quantizer, by hand ----

def test_reference_quantizer_on_known_values():
    torch = need_torch()
    w = torch.zeros(130, 144)  # blocks [2, 2]: rows 128..129 and columns 128..143 are partial blocks
    w[0, 0] = 448.0            # block (0, 0): amax 448, scale 1
    w[0, 1], w[0, 2], w[0, 3] = 1.0625, 1.1875, -0.0  # ties: to the even mantissa (1.0, 1.25)
    w[1, 0], w[1, 1], w[1, 2] = 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10  # E4M3 subnormals: 1 step, a tie to 0, to 2
    w[0, 130] = -896.0         # block (0, 1): amax 896 over its 16 columns alone, scale 2
    w[1, 130] = 3.0            # 3 / 2 = 1.5, exact
    w[129, 5] = 1e-40          # block (1, 0): amax under 448 x 2^-126, scale 2^-126
    # block (1, 1) stays zero: scale 1
    q, s = ref.quantize_weights(torch, w.to(torch.bfloat16))
    check_eq((q.dtype, tuple(q.shape), s.dtype, tuple(s.shape)),
             (torch.float8_e4m3fn, (130, 144), torch.float32, (2, 2)), "dtypes and shapes")
    check_eq(s.tolist(), [[1.0, 2.0], [2.0 ** -126, 1.0]], "scales")
    b = fp8_bytes(torch, q)
    check_eq([int(v) for v in b[0, :4]], [0x7E, 0x38, 0x3A, 0x80], "448, ties to even, -0")
    check_eq([int(v) for v in b[1, :3]], [0x01, 0x00, 0x02], "subnormals")
    check_eq([int(b[0, 130]), int(b[1, 130])], [0xFE, 0x3C], "-896 / 2 = -448, 3 / 2 = 1.5")
    # bf16 rounds 1e-40 to its nearest; the scale 2^-126 brings it back over 2^-9, where E4M3 resolves it.
    x = float(torch.tensor(1e-40).to(torch.bfloat16).float()) * 2.0 ** 126
    check_eq(float(q[129, 5].float()), float(torch.tensor(x).to(torch.float8_e4m3fn).float()), "a tiny block")
    # Powers of two: the scale rounds up to one; an exact one stays.
    p = torch.zeros(2, 256)
    p[0, 0], p[1, 0], p[1, 128] = 500.0, 224.0, 448.0
    _, s2 = ref.quantize_rows(torch, p.to(torch.bfloat16), pow2=True)
    check_eq(s2.tolist(), [[2.0, 1.0], [0.5, 1.0]], "pow2 row scales: 500 / 448 -> 2, 224 / 448 = 0.5 exactly")
    _, s1 = ref.quantize_rows(torch, p.to(torch.bfloat16))
    f32_quotient = float(torch.tensor(500.0) / torch.tensor(448.0))  # the float32 division
    check_eq(s1.tolist(), [[f32_quotient, 1.0], [0.5, 1.0]], "row scales amax / 448")
    # A NaN poisons its block: scale NaN, every byte NaN (torch keeps a NaN's sign; comet writes 0x7F).
    n = torch.ones(1, 32)
    n[0, 3] = float("nan")
    qn, sn = ref.quantize_rows(torch, n.to(torch.bfloat16))
    check(bool(torch.isnan(sn).all()) and all(int(v) & 0x7F == 0x7F for v in fp8_bytes(torch, qn)[0]), "NaN block")


def test_dequantize_fp8_on_known_values():
    torch = need_torch()
    from comet_moe import dequantize_fp8
    codes = list(E4M3)
    # A weight [130, 260]: blocks [2, 3]; each element by its own block's scale.
    q = from_bytes(torch, [codes[i % len(codes)] for i in range(130 * 260)], (130, 260))
    scales = torch.tensor([[1.0, 2.0, 0.5], [4.0, 0.25, 8.0]])
    got = dequantize_fp8(q, scales)
    check_eq((got.dtype, tuple(got.shape)), (torch.float32, (130, 260)), "float32 of q's shape")
    for r, c in ((0, 0), (0, 127), (127, 128), (5, 259), (128, 0), (129, 130), (129, 259), (64, 200)):
        want = E4M3[codes[(r * 260 + c) % len(codes)]] * float(scales[r // 128, c // 128])
        check_eq(float(got[r, c]), want, f"element [{r}, {c}]")
    # Stacked: [2, 130, 260] with [2, 2, 3] scales; and token rows: [130, 260] with [130, 3].
    both = dequantize_fp8(torch.stack([q, q]), torch.stack([scales, 2 * scales]))
    check(torch.equal(both[0], got) and torch.equal(both[1], 2 * got), "a stack of matrices")
    row_scales = torch.arange(1, 131, dtype=torch.float32)[:, None].expand(130, 3).contiguous()
    row_scales[:, 2] = 0.5
    rows = dequantize_fp8(q, row_scales)
    check_eq((float(rows[7, 3]), float(rows[7, 259])),
             (E4M3[codes[(7 * 260 + 3) % len(codes)]] * 8.0, E4M3[codes[(7 * 260 + 259) % len(codes)]] * 0.5),
             "token rows' scales, one per row per 128 columns")
    check_eq(dequantize_fp8(q, scales, dtype=torch.bfloat16).dtype, torch.bfloat16, "dtype=")
    check_eq(tuple(dequantize_fp8(q[0], row_scales[0]).shape), (260,), "one row")
    # What it refuses, naming the argument and the shapes it takes.
    raises(ValueError, lambda: dequantize_fp8(q, scales[:, :2]), "scales.shape = (2, 2) for q.shape = (130, 260)",
           "(130, 3) (token rows)", "(2, 3) (a weight's blocks)")
    raises(TypeError, lambda: dequantize_fp8(q.float(), scales), "q.dtype = torch.float32", "float8_e4m3fn")
    raises(TypeError, lambda: dequantize_fp8(q, scales.double()), "scales.dtype = torch.float64")
    raises(TypeError, lambda: dequantize_fp8([1], scales), "q: expected a torch.Tensor, got list")


def test_dequantize_fp8_undoes_the_reference_quantizer():
    """Within comet.h's bound: |q s - x| <= |x| / 16 + s / 1024, every element."""
    torch = need_torch()
    from comet_moe import dequantize_fp8
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3, 200, 272, generator=g) * torch.logspace(-3, 3, 272)).to(torch.bfloat16)
    for pow2 in (False, True):
        q, s = ref.quantize_weights(torch, w, pow2)
        back = dequantize_fp8(q, s)
        x = w.float()
        bound = x.abs() / 16 + dequantize_fp8(torch.ones_like(q, dtype=torch.float32).to(torch.float8_e4m3fn), s) / 1024
        check(bool(((back - x).abs() <= bound).all()), f"pow2 {pow2}: an element past the bound")


# ---- the quantizers' argument checks (all made before comet is called) ----

def test_quantizers_refuse_before_calling_comet():
    torch = need_torch()
    from comet_moe import quantize_fp8_rows, quantize_fp8_weights
    bf16 = torch.bfloat16
    w = torch.zeros(2, 64, 128, dtype=bf16)
    call = "quantize_fp8_weights"
    raises(TypeError, lambda: quantize_fp8_weights([1]), f"{call}: w: expected a torch.Tensor")
    raises(TypeError, lambda: quantize_fp8_weights(w.float()), "w.dtype = torch.float32", "w.to(torch.bfloat16)")
    raises(ValueError, lambda: quantize_fp8_weights(w[0, 0]), "w.shape = (128,)", "[..., rows, cols]")
    raises(ValueError, lambda: quantize_fp8_weights(torch.zeros(4, 40, dtype=bf16)), "w.shape = (4, 40)",
           "multiple of 16")
    raises(ValueError, lambda: quantize_fp8_weights(w.transpose(1, 2)), "w is not contiguous", "w.contiguous()")
    raises(ValueError, lambda: quantize_fp8_weights(w), "w is on cpu", "comet quantizes on the GPU", "w.cuda()")
    raises(TypeError, lambda: quantize_fp8_weights(w, pow2_scales="yes"), "pow2_scales = 'yes'", "a bool")
    from comet_moe import quantize_fp8_weights_transposed
    call = "quantize_fp8_weights_transposed"
    raises(TypeError, lambda: quantize_fp8_weights_transposed(w.float()), f"{call}: w.dtype = torch.float32")
    raises(ValueError, lambda: quantize_fp8_weights_transposed(torch.zeros(2, 40, 128, dtype=bf16)),
           "w.shape = (2, 40, 128): rows = 40", "multiple of 16")
    raises(ValueError, lambda: quantize_fp8_weights_transposed(w), "w is on cpu", "comet quantizes on the GPU")
    raises(TypeError, lambda: quantize_fp8_weights_transposed(w, pow2_scales=None), "pow2_scales = None")
    call = "quantize_fp8_rows"
    x = torch.zeros(5, 256, dtype=bf16)
    raises(TypeError, lambda: quantize_fp8_rows(x.half()), f"{call}: x.dtype = torch.float16")
    raises(ValueError, lambda: quantize_fp8_rows(torch.zeros(5, 8, dtype=bf16)), "x.shape = (5, 8)", "multiple of 16")
    raises(ValueError, lambda: quantize_fp8_rows(x[:, :128]), "x is not contiguous")
    raises(ValueError, lambda: quantize_fp8_rows(x), "x is on cpu", "comet quantizes on the GPU")
    raises(TypeError, lambda: quantize_fp8_rows(x, pow2_scales=2), "pow2_scales = 2")


# ---- FP8 checkpoints: a synthetic one, written to a file and read back ----

NAMES = {"mixtral": ("w1", "w3", "w2"), "proj": ("gate_proj", "up_proj", "down_proj")}


def bf16_experts(torch, E, H, F, seed=0):
    """{(e, part): bf16 weight} in HF's [out, in] shapes, part gate / up / down."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for e in range(E):
        w[e, "gate"] = (torch.randn(F, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        w[e, "up"] = (torch.randn(F, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        w[e, "down"] = (torch.randn(H, F, generator=g) / F ** 0.5).to(torch.bfloat16)
    return w


def hf_state_dict(torch, experts, scheme="mixtral", prefix="", fp8=True, pow2=False):
    """An HF state dict of `experts` under `scheme`'s names: FP8 weights with their
    weight_scale_inv (quantized by fp8_reference), or the bf16 weights as they are."""
    sd = {}
    for (e, part), w in experts.items():
        name = NAMES[scheme][("gate", "up", "down").index(part)]
        key = f"{prefix}experts.{e}.{name}.weight"
        if fp8:
            sd[key], sd[key + "_scale_inv"] = ref.quantize_weights(torch, w, pow2)
        else:
            sd[key] = w
    return sd


def write_and_read(torch, sd, tmp):
    """sd written to a file and read back: safetensors where it is installed, else torch.save.
    Returns (the state dict read back, the format's name)."""
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        path = tmp / "experts.pt"
        torch.save(sd, path)
        return torch.load(path, weights_only=True), "torch.save (safetensors is not installed)"
    path = tmp / "experts.safetensors"
    save_file(sd, str(path))
    return load_file(str(path)), "safetensors"


def config(**changes):
    import comet_moe
    kw = dict(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=32, dtype="fp8")
    kw.update(changes)
    return comet_moe.MoeConfig(**kw)


def check_bytes(torch, got, want, what):
    check(got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape),
          f"{what}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    check(torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), f"{what}: bytes differ")


def test_stack_fp8_experts_takes_this_ranks_experts_and_slice():
    """A synthetic FP8 checkpoint (both naming schemes, under a prefix, beside other keys),
    through a file, stacked for several ranks: each gets its experts and its ffn slice,
    weights and scales byte for byte, packed as gate_up where ffn / tp_size is a multiple
    of 128 and apart otherwise."""
    import tempfile
    from pathlib import Path
    torch = need_torch()
    from comet_moe import dequantize_fp8, stack_fp8_experts
    H, prefix = 256, "model.layers.3.mlp."
    for scheme, F, tp, world, rank in (("mixtral", 256, 1, 2, 1), ("proj", 512, 2, 2, 1), ("mixtral", 512, 2, 4, 2),
                                       ("proj", 192, 1, 1, 0), ("mixtral", 384, 1, 4, 3)):
        experts = bf16_experts(torch, 8, H, F, seed=F + tp)
        sd = hf_state_dict(torch, experts, scheme, prefix)
        sd[prefix + "gate.weight"] = torch.zeros(8, H, dtype=torch.bfloat16)
        sd["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(4, 4)
        with tempfile.TemporaryDirectory() as tmp:
            sd, how = write_and_read(torch, sd, Path(tmp))
        cfg = config(ffn=F, tp_size=tp)
        got = stack_fp8_experts(sd, cfg, world_size=world, rank=rank, prefix=prefix)
        what = f"{scheme}, ffn {F}, rank {rank} of {world} (tp {tp})"
        ep_rank, t, per, Fl = rank // tp, rank % tp, 8 // (world // tp), F // tp
        packed = Fl % 128 == 0
        check_eq(sorted(got), sorted((["gate_up", "gate_up_scale"] if packed else
                                      ["gate", "gate_scale", "up", "up_scale"]) + ["down", "down_scale"]),
                 f"{what}: Moe.forward's keywords")
        cols, blk = slice(t * Fl, (t + 1) * Fl), slice(t * Fl // 128, -(-(t + 1) * Fl // 128))
        for le in range(per):
            e = ep_rank * per + le
            g, u, d = (f"{prefix}experts.{e}.{n}.weight" for n in NAMES[scheme])
            if packed:
                check_bytes(torch, got["gate_up"][le], torch.cat([sd[g][cols], sd[u][cols]]), f"{what}: gate_up[{le}]")
                check_bytes(torch, got["gate_up_scale"][le],
                            torch.cat([sd[g + "_scale_inv"][blk], sd[u + "_scale_inv"][blk]]), f"{what}: scales")
            else:
                check_bytes(torch, got["gate"][le], sd[g][cols], f"{what}: gate[{le}]")
                check_bytes(torch, got["up_scale"][le], sd[u + "_scale_inv"][blk], f"{what}: up_scale[{le}]")
            check_bytes(torch, got["down"][le], sd[d][:, cols], f"{what}: down[{le}]")
            check_bytes(torch, got["down_scale"][le], sd[d + "_scale_inv"][:, blk], f"{what}: down_scale[{le}]")
            # What the slice stands for is the full weight's slice.
            full = dequantize_fp8(sd[d], sd[d + "_scale_inv"])[:, cols]
            check(torch.equal(dequantize_fp8(got["down"][le], got["down_scale"][le]), full), f"{what}: down values")
    note(f"the checkpoint went through {how}")


def test_stack_fp8_experts_quantizes_bf16_weights():
    """A bf16 state dict for an FP8 config: each rank's slice quantized on its own (so any
    tensor-parallel slice works, 128-aligned or not), as the quantizer makes it."""
    torch = need_torch()
    from comet_moe import stack_fp8_experts
    H, F = 256, 384  # tp 2: ffn / tp_size = 192, slices at row 192: inside a 128-row block
    experts = bf16_experts(torch, 4, H, F, seed=7)
    sd = hf_state_dict(torch, experts, "proj", fp8=False)
    cfg = config(ffn=F, num_experts=4, tp_size=2, fp8_pow2_scales=True)
    calls = []

    def quantize(w, pow2_scales):
        calls.append((tuple(w.shape), w.is_contiguous(), pow2_scales))
        return ref.quantize_weights(torch, w, pow2_scales)

    got = stack_fp8_experts(sd, cfg, world_size=2, rank=1, quantize=quantize)
    check_eq(calls[:3], [((192, H), True, True), ((192, H), True, True), ((H, 192), True, True)],
             "one call per matrix: this rank's slice, contiguous, with the config's pow2 scales")
    for e in range(4):
        q, s = ref.quantize_weights(torch, experts[e, "up"][192:], True)
        check_bytes(torch, got["up"][e], q, f"up[{e}]")
        check_bytes(torch, got["up_scale"][e], s, f"up_scale[{e}]")
        q, s = ref.quantize_weights(torch, experts[e, "down"][:, 192:].contiguous(), True)
        check_bytes(torch, got["down"][e], q, f"down[{e}]")
        check_bytes(torch, got["down_scale"][e], s, f"down_scale[{e}]")
    # comet's quantizer runs on a GPU: on the CPU without one given, the message says so.
    raises(ValueError, lambda: stack_fp8_experts(sd, cfg, world_size=2, rank=1),
           "quantized as it is loaded, on the GPU", "device='cuda'")


def test_stack_fp8_experts_refuses_naming_the_key():
    torch = need_torch()
    from comet_moe import stack_fp8_experts
    H, F, p = 256, 256, "layers.0."
    experts = bf16_experts(torch, 2, H, F)
    good = hf_state_dict(torch, experts, "mixtral", p)
    cfg = config(num_experts=2)

    def refused(sd, *words, cfg=cfg, **kw):
        e = raises(ValueError, lambda: stack_fp8_experts(sd, cfg, prefix=p, **kw), "stack_fp8_experts", *words)
        return str(e)

    def without(*keys):
        return {k: v for k, v in good.items() if k not in keys}

    k = p + "experts.1.w3.weight"
    e = refused(without(k), f"missing key {k}")
    check("_scale_inv" not in e, e)
    refused(without(k + "_scale_inv"), f"missing key {k}_scale_inv")
    refused(dict(without(k + "_scale_inv"), **{k + "_scale": torch.ones(())}), f"{k}_scale_inv is missing",
            f"{k}_scale is there", "per-tensor or per-channel")
    refused(dict(good, **{k + "_scale_inv": torch.ones(1, 2)}), f"size mismatch for {k}_scale_inv: shape (1, 2)",
            "expected (2, 2)")
    refused(dict(good, **{k + "_scale_inv": torch.ones(2, 2, dtype=torch.bfloat16)}),
            f"{k}_scale_inv.dtype = torch.bfloat16", "expected torch.float32")
    refused(dict(good, **{k: good[k][:128]}), f"size mismatch for {k}: shape (128, 256)", "expected (256, 256)")
    refused(dict(good, **{k: experts[1, "up"].half()}), f"{k}.dtype = torch.float16", "torch.float8_e4m3fn",
            "torch.bfloat16")
    refused(dict(good, **{k: experts[1, "up"]}), f"{k}_scale_inv beside a bfloat16 {k}")
    refused(dict(good, **{p + "experts.0.up_proj.weight": good[k]}), "mix two schemes", p + "experts.0.w1.weight",
            p + "experts.0.up_proj.weight")
    # An FP8 slice must fall on the 128 x 128 blocks: ffn 384 at tp 2 cuts them at 192.
    wide = hf_state_dict(torch, bf16_experts(torch, 2, H, 384), "mixtral", p)
    refused(wide, "tp_size = 2: this rank's rows 192..383 of ffn = 384 cut through the 128 x 128 blocks",
            "load a bf16 checkpoint", cfg=config(num_experts=2, ffn=384, tp_size=2), world_size=2, rank=1)
    refused(wide, f"{p}experts.0.w2.weight: tp_size = 2: this rank's columns 0..191",
            cfg=config(num_experts=2, ffn=384, tp_size=2), world_size=2)
    # Every problem at once, each named.
    msg = refused(dict(without(k), **{p + "experts.0.w2.weight_scale_inv": torch.ones(3, 3)}), "2 problem(s)")
    check(k in msg and p + "experts.0.w2.weight_scale_inv" in msg, msg)
    # Other ranks' experts, and keys outside the prefix, are not read.
    rank1 = stack_fp8_experts(without(p + "experts.0.w1.weight"), config(num_experts=2, ep_size=2), world_size=2,
                              rank=1, prefix=p)
    check_eq(sorted(rank1), ["down", "down_scale", "gate_up", "gate_up_scale"], "rank 1 of EP 2 does without expert 0")
    # A rank outside the world, or a layout comet would not make, is refused before anything is read.
    raises(ValueError, lambda: stack_fp8_experts(good, cfg, world_size=2, rank=2), "rank = 2", "world_size = 2")
    import comet_moe
    raises(comet_moe.CometInvalidArgumentError, lambda: stack_fp8_experts(good, config(num_experts=2, tp_size=2)),
           "tp_size = 2: must divide the world size 1")


# ---- CometSparseMoeBlock with an FP8 config (comet's calls computed on the CPU: standin.py) ----

def fp8_block(torch, cfg, first_expert=0, experts_per_rank=None, tp=None):
    """A CometSparseMoeBlock over standin.CpuMoe with `cfg`, as rank (first_expert, tp) would
    hold it; bf16 weights it loads are quantized by fp8_reference."""
    from comet_moe import CometSparseMoeBlock
    from standin import CpuMoe
    moe = CpuMoe(torch, cfg)
    moe.first_expert, moe.experts_per_rank = first_expert, experts_per_rank or int(cfg.num_experts)
    if tp is not None:  # (tp_size, tp_rank): this TP rank's slice of each expert
        moe.tp_size, moe.tp_rank = tp
        moe.ffn_local = int(cfg.ffn) // tp[0]
    block = CometSparseMoeBlock(moe=moe)
    block._quantize = lambda w, pow2: ref.quantize_weights(torch, w, pow2)
    return block


def test_fp8_block_loads_a_checkpoint_and_runs():
    """The block's FP8 buffers from an HF FP8 checkpoint through load_state_dict (Mixtral's
    names and gate_proj's, a whole model's under a prefix), its state_dict back under
    Mixtral's names, and its forward against a bf16 block holding the dequantized weights
    (power-of-two scales: dequantized, the weights are exact in bf16, so the two agree in
    bits on the stand-in, which does not round x or the activation)."""
    torch = need_torch()
    import comet_moe
    from comet_moe import CometSparseMoeBlock, dequantize_fp8
    from standin import CpuMoe
    H, E = 256, 8
    for F in (256, 192):  # gate_up packed; gate and up apart (192 is not a multiple of 128)
        cfg = config(ffn=F, fp8_pow2_scales=True)
        experts = bf16_experts(torch, E, H, F, seed=F)
        router = (torch.randn(E, H, generator=torch.Generator().manual_seed(1)) / H ** 0.5).to(torch.bfloat16)
        router[:4], router[:4, 0], router[4:, 0] = 0.0, -1.0, 1.0  # with x[:, 0] = 10: experts 4..7, this rank's
        sd = dict(hf_state_dict(torch, experts, "mixtral", pow2=True), **{"gate.weight": router})
        block = fp8_block(torch, cfg, first_expert=4, experts_per_rank=4)  # rank 1 of EP 2
        result = block.load_state_dict(sd)
        check_eq((result.missing_keys, result.unexpected_keys), ([], []), f"ffn {F}: a full FP8 state dict")
        bufs = {n: tuple(b.shape) for n, b in block.named_buffers()}
        want = ({"w13": (4, 2 * F, H), "w13_scale_inv": (4, 2 * F // 128, 2)} if F % 128 == 0 else
                {"w1": (4, F, H), "w1_scale_inv": (4, 2, 2), "w3": (4, F, H), "w3_scale_inv": (4, 2, 2)})
        want.update(w2=(4, H, F), w2_scale_inv=(4, 2, 2))
        check_eq(bufs, want, f"ffn {F}: buffers")
        check_eq([n for n, _ in block.named_parameters()], ["gate.weight"], "the router is the one parameter")
        check("dtype=fp8 (pow2 scales)" in repr(block), repr(block))
        own = block.state_dict()
        names = [f"experts.{e}.{n}.{s}" for e in range(4, 8) for n in ("w1", "w3", "w2")
                 for s in ("weight", "weight_scale_inv")]
        check_eq(sorted(own), sorted(["gate.weight"] + names), f"ffn {F}: state_dict keys")
        for key in names:
            check_bytes(torch, own[key], sd[key], f"ffn {F}: state_dict()[{key!r}]")
        # The same experts under Qwen3's / DeepSeek's names, a whole model's state dict under a prefix.
        other = fp8_block(torch, cfg, first_expert=4, experts_per_rank=4)
        prefix = "model.layers.0.mlp."
        model = {prefix + k: v for k, v in hf_state_dict(torch, experts, "proj", pow2=True).items()}
        model[prefix + "gate.weight"], model["model.norm.weight"] = router, torch.ones(H)
        check_eq(other.load_full_state_dict(model, prefix=prefix).missing_keys, [], "gate_proj names, prefixed")
        for name, b in block.named_buffers():
            check_bytes(torch, other.get_buffer(name), b, f"ffn {F}: {name} from gate_proj names")
        # A bf16 state dict: quantized as it is loaded, to the same bytes.
        third = fp8_block(torch, cfg, first_expert=4, experts_per_rank=4)
        third.load_state_dict(dict(hf_state_dict(torch, experts, "mixtral", fp8=False), **{"gate.weight": router}))
        for name, b in block.named_buffers():
            check_bytes(torch, third.get_buffer(name), b, f"ffn {F}: {name} quantized from bf16")
        # The forward against a bf16 block on the dequantized weights.
        bf16_moe = CpuMoe(torch, config(ffn=F, dtype="bf16"))
        bf16_moe.first_expert, bf16_moe.experts_per_rank = 4, 4
        bf16 = CometSparseMoeBlock(moe=bf16_moe)
        deq = {"gate.weight": router}
        for key in names[::2]:
            deq[key] = dequantize_fp8(sd[key], sd[key + "_scale_inv"], dtype=torch.bfloat16)
        bf16.load_state_dict(deq)
        x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        x[..., 0] = 10.0  # every token to experts 4..7 (the stand-in holds no others)
        with torch.no_grad():
            y, logits = block(x)
            y_ref, logits_ref = bf16(x)
        check(torch.equal(logits, logits_ref), "router logits")
        check_eq(block.moe.calls[-1][:2], ("forward", 15), "one call of 15 tokens")
        check(torch.equal(y, y_ref) and y.abs().sum() > 0, f"ffn {F}: y differs from the bf16 block's")
        ids, _ = comet_moe.mixtral_route(logits, 2)
        check(bool((ids >= 4).all()), f"routing left this rank's experts: {ids.tolist()}")


def test_fp8_block_casts_keep_the_experts_dtypes():
    """A model's .to(dtype), .half(), .float() or .bfloat16() casts the router alone: the FP8
    block's experts stay float8_e4m3fn and their scales float32, byte for byte, and the
    forward gives the same y after casting the router back."""
    torch = need_torch()
    H, F, E = 256, 192, 4  # gate and up apart: every kind of buffer
    cfg = config(num_experts=E, ffn=F)
    block = fp8_block(torch, cfg)
    block.load_state_dict(dict(hf_state_dict(torch, bf16_experts(torch, E, H, F, seed=3), "mixtral"),
                               **{"gate.weight": torch.randn(E, H).to(torch.bfloat16)}))
    before = {n: b.clone() for n, b in block.named_buffers()}
    check_eq(sorted(before), ["w1", "w1_scale_inv", "w2", "w2_scale_inv", "w3", "w3_scale_inv"], "the buffers")
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        y, _ = block(x)
    casts = {".to(float32)": lambda m: m.to(torch.float32), ".half()": lambda m: m.half(),
             ".float()": lambda m: m.float(), ".to('cpu', bfloat16)": lambda m: m.to("cpu", torch.bfloat16)}
    for what, cast in casts.items():
        check(cast(block) is block, f"{what} returns the block")
        for name, b in block.named_buffers():
            check_bytes(torch, b, before[name], f"{name} after {what}")
    check_eq(block.gate.weight.dtype, torch.bfloat16, "the router, cast back last")
    with torch.no_grad():
        y2, _ = block(x)
    check(torch.equal(y2, y), "y after the casts")


def test_fp8_block_refuses_training_and_wrong_state_dicts():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    from standin import CpuMoe
    H, F, E = 256, 256, 4
    cfg = config(num_experts=E)
    block = fp8_block(torch, cfg)
    experts = bf16_experts(torch, E, H, F)
    sd = dict(hf_state_dict(torch, experts), **{"gate.weight": torch.zeros(E, H, dtype=torch.bfloat16)})
    block.load_state_dict(sd)
    x = torch.randn(4, H).to(torch.bfloat16)
    # Training in FP8 is not built: a forward that autograd records is refused, before comet is called.
    raises(NotImplementedError, lambda: block(x), "training in FP8 is not built", "torch.no_grad()")
    raises(NotImplementedError, lambda: block(x.requires_grad_(True)), "training in FP8 is not built")
    check_eq(block.moe.calls, [], "calls after the refusals")
    with torch.inference_mode():
        block(x)
    check_eq(len(block.moe.calls), 1, "inference mode runs it")
    # What load_state_dict refuses names the key (torch gathers them into one RuntimeError).
    k = "experts.2.w2.weight"
    bad = dict(sd, **{k + "_scale_inv": torch.ones(2, 1)})
    raises(RuntimeError, lambda: block.load_state_dict(bad), f"size mismatch for {k}_scale_inv: shape (2, 1)")
    no_scale = {key: v for key, v in sd.items() if key != k + "_scale_inv"}
    raises(RuntimeError, lambda: block.load_state_dict(no_scale), "Missing key(s)", k + "_scale_inv")
    check_eq(block.load_state_dict(no_scale, strict=False).missing_keys, [k + "_scale_inv"], "strict=False: listed")
    mixed = dict(sd, **{"experts.0.down_proj.weight": sd[k]})
    raises(RuntimeError, lambda: block.load_state_dict(mixed), "mix two schemes")
    raises(RuntimeError, lambda: block.load_state_dict(dict(sd, **{"experts.9.w1.weight": sd[k]})),
           "Unexpected key(s)", "experts.9.w1.weight")
    raises(RuntimeError, lambda: block.load_state_dict(dict(sd, **{"experts.0.w1.input_scale": torch.ones(())})),
           "Unexpected key(s)", "experts.0.w1.input_scale")
    # A bf16 block refuses FP8 weights: a copy into bf16 would drop their scales.
    bf16 = CometSparseMoeBlock(moe=CpuMoe(torch, config(num_experts=E, dtype="bf16")))
    raises(RuntimeError, lambda: bf16.load_state_dict(sd, strict=False), "experts.0.w1.weight is float8_e4m3fn",
           "this block is bf16", "dtype='fp8'")
    # Tensor parallelism: this rank's slice on 128-row blocks; state_dict() cannot name a slice.
    tp_block = fp8_block(torch, config(num_experts=E, ffn=512), tp=(2, 1))
    wide = bf16_experts(torch, E, H, 512, seed=3)
    tp_sd = dict(hf_state_dict(torch, wide), **{"gate.weight": sd["gate.weight"]})
    check_eq(tp_block.load_state_dict(tp_sd).missing_keys, [], "tp rank 1 of 2")
    q, s = tp_sd["experts.3.w3.weight"], tp_sd["experts.3.w3.weight_scale_inv"]
    check_bytes(torch, tp_block.w13[3, 256:], q[256:], "tp rank 1: w3's rows 256..511 in w13's second half")
    check_bytes(torch, tp_block.w13_scale_inv[3, 2:], s[2:], "and their scales")
    raises(NotImplementedError, lambda: tp_block.state_dict(), "tp_size = 2")


def test_fp8_block_compiles_for_inference():
    """torch.compile(fullgraph=True) of an FP8 block's inference forward: no graph break, and
    the bits of eager (aot_eager keeps torch's own kernels)."""
    torch = need_torch()
    import torch._dynamo
    block = fp8_block(torch, config(num_experts=4, ffn=192))
    sd = hf_state_dict(torch, bf16_experts(torch, 4, 256, 192, seed=9))
    sd["gate.weight"] = (torch.randn(4, 256, generator=torch.Generator().manual_seed(3)) / 16).to(torch.bfloat16)
    block.load_state_dict(sd)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for m in (8, 5):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        with torch.no_grad():
            want, _ = block(x)
            got, _ = compiled(x)
        check(torch.equal(got, want), f"{m} tokens: compiled differs from eager")
    check_eq(dict(torch._dynamo.utils.counters["graph_break"]), {}, "graph breaks")
