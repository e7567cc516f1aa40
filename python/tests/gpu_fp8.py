"""gpu_fp8.py - block-scaled FP8 in comet_moe on GPUs, run by test_torch_gpu.py (its runner,
its Ctx `c`; `test_torch_gpu.py -v fp8` runs these alone):

- comet's quantizers (quantize_fp8_weights[_transposed], quantize_fp8_rows) against the tests' own,
  written out in torch from base/fp8.h (fp8_reference.py), byte for byte, on data spread
  over many binades with partial, zero, tiny, huge, NaN and infinite blocks; on torch's
  current stream;
- the FP8 CometSparseMoeBlock against the bf16 block holding the dequantized weights,
  every path, expert and tensor parallel, gate_up packed and gate and up apart, with
  DeepGEMM's measure of difference, 1 - 2 sum(x y) / sum(x^2 + y^2);
- an FP8 checkpoint (Qwen3's names, a prefix) written to a file, read back and loaded,
  against stack_fp8_experts, and a bf16 one quantized as it loads;
- an FP8 Moe trained from bf16 master weights against the bf16 Moe on the same operands,
  its FP8 copies cached by the masters' version counters, fused and sequential (impl
  "baseline") against each other; the FP8 block's training refused;
  opcheck of the FP8 operators.

The measure's limits. Against the bf16 block fed x as comet quantizes it (dequantized),
what differs is the activation's rounding to E4M3 between the GEMMs: about 3e-4 on these
shapes in a float32 emulation, under DeepGEMM's 1e-3. Against the bf16 block fed x itself,
x's own rounding adds as much again (about 1e-3 in the emulation): the limit there is 2e-3.
"""

from gpu_train import check, raises

H, FFN, E, TOP_K, MAX_TOKENS = 512, 256, 8, 2, 512  # as test_torch_gpu.py's
DIFF_LIMIT, DIFF_LIMIT_RAW_X = 1e-3, 2e-3
IMPLS = ("baseline", "fused", "auto")
OPCHECK_WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
TESTS = []


def gpu_test(fn):
    TESTS.append(fn)
    return fn


def calc_diff(x, y):
    """DeepGEMM's measure: 1 - 2 sum(x y) / sum(x^2 + y^2), in float64 (0 for equal tensors)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def bf16_state_dict(c, ffn, seed):
    """A Mixtral state dict (router and every expert, bf16, on the CPU), the same on every rank."""
    torch = c.torch
    if ffn == FFN:
        return c.full_sd
    g = torch.Generator().manual_seed(seed)
    sd = {"gate.weight": c.full_sd["gate.weight"]}
    for e in range(E):
        sd[f"experts.{e}.w1.weight"] = (torch.randn(ffn, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        sd[f"experts.{e}.w3.weight"] = (torch.randn(ffn, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        sd[f"experts.{e}.w2.weight"] = (torch.randn(H, ffn, generator=g) / ffn ** 0.5).to(torch.bfloat16)
    return sd


def fp8_state_dict(c, sd, pow2=False, names=("w1", "w3", "w2"), prefix=""):
    """sd's experts as an HF FP8 checkpoint holds them (quantized by comet on the GPU, kept on
    the CPU): `.weight` float8_e4m3fn and `.weight_scale_inv` float32, under `names` (for
    Mixtral's w1, w3, w2) after `prefix`; the router as it is."""
    cm = c.cm
    out = {prefix + "gate.weight": sd["gate.weight"]}
    for e in range(E):
        for mixtral, name in zip(("w1", "w3", "w2"), names):
            q, s = cm.quantize_fp8_weights(sd[f"experts.{e}.{mixtral}.weight"].to(c.device), pow2)
            key = f"{prefix}experts.{e}.{name}.weight"
            out[key], out[key + "_scale_inv"] = q.cpu(), s.cpu()
    return out


def dequantized(c, sd8):
    """An FP8 Mixtral state dict's experts dequantized to bf16 (what the bf16 block loads)."""
    torch, cm = c.torch, c.cm
    return {k: v if not k.endswith(".weight") or v.dtype != torch.float8_e4m3fn else
            cm.dequantize_fp8(v, sd8[k + "_scale_inv"], dtype=torch.bfloat16)
            for k, v in sd8.items() if not k.endswith("_scale_inv")}


def same_bytes(c, what, got, want):
    """Byte for byte (NaN bytes compared apart: comet writes every NaN as 0x7F, torch keeps
    its sign), recorded as a miss (the rank goes on with the collective calls)."""
    torch = c.torch
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        c.failures.append(f"{what}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
        return
    if got.dtype == torch.float8_e4m3fn:
        g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
        nan_g, nan_w = (g & 0x7F) == 0x7F, (w & 0x7F) == 0x7F
        bad = ((g != w) & ~(nan_g & nan_w)).nonzero()
        if nan_g.any() and (g[nan_g] != 0x7F).any():
            c.failures.append(f"{what}: a NaN byte other than 0x7F")
    else:  # float32 scales: the same bits, or NaN on both sides
        g, w = got.view(torch.int32), want.view(torch.int32)
        bad = ((g != w) & ~(torch.isnan(got) & torch.isnan(want))).nonzero()
    if bad.numel():
        first = ", ".join(f"{tuple(i)}: {int(g[tuple(i)]):#x} vs {int(w[tuple(i)]):#x}" for i in bad[:6].tolist())
        c.failures.append(f"{what}: {bad.shape[0]} of {g.numel()} differ; {first}")


def spread(c, shape, gen):
    """Random values whose magnitude changes by 2^-20..2^20 from column to column, bf16."""
    torch = c.torch
    x = torch.randn(shape, generator=gen, device=c.device)
    exp = torch.randint(-20, 21, (shape[-1],), generator=gen, device=c.device).float()
    return (x * torch.exp2(exp)).to(torch.bfloat16)


@gpu_test
def fp8_quantizers_match_torch_byte_for_byte(c):
    torch, cm = c.torch, c.cm
    from fp8_reference import quantize_rows, quantize_weights
    gen = torch.Generator(device=c.device)
    gen.manual_seed(7 + c.rank)
    # Blocks a random draw would not give: zero, tiny (the scale's floor 2^-126), the largest
    # bf16 values (with pow2 scales, 2^120), bf16 subnormals, NaN and infinity.
    special = spread(c, (3, 256, 256), gen)
    special[0, :128, :128] = 0
    special[0, :128, 128:] *= 1e-38
    special[0, 128:, :128] = torch.finfo(torch.bfloat16).max
    special[0, 128:, 128:] = 2.0 ** -133
    special[1, 5, 7] = float("nan")
    special[1, 200, 200] = float("inf")
    special[2, 130, 3] = -float("inf")
    special[2, 140, 250] = -float("nan")
    weights = [spread(c, s, gen) for s in ((3, 300, 272), (128, 128), (2, 64, 16), (1, 1, 4096))] + [special]
    rows = [spread(c, s, gen) for s in ((5, 7, 272), (1000, 4096), (0, 256))] + [special[1]]
    for pow2 in (False, True):
        for w in weights:
            rq, rs = quantize_weights(torch, w, pow2)
            # The transposed copy where its k (rows) is a multiple of 16.
            calls = (("quantize_fp8_weights", cm.quantize_fp8_weights),) + (
                (("quantize_fp8_weights_transposed", cm.quantize_fp8_weights_transposed),)
                if w.shape[-2] % 16 == 0 else ())
            for name, quantize in calls:
                got = quantize(w, pow2_scales=pow2)
                what = f"{name} {tuple(w.shape)}, pow2 {pow2}"
                same_bytes(c, what + ": q", got[0], rq)
                same_bytes(c, what + ": scales", got[1], rs)
                if len(got) == 4:
                    same_bytes(c, what + ": qt", got[2], rq.transpose(-1, -2).contiguous())
                    same_bytes(c, what + ": scales_t", got[3], rs.transpose(-1, -2).contiguous())
        for x in rows:
            q, s = cm.quantize_fp8_rows(x, pow2_scales=pow2)
            rq, rs = quantize_rows(torch, x, pow2)
            what = f"quantize_fp8_rows {tuple(x.shape)}, pow2 {pow2}"
            same_bytes(c, what + ": q", q, rq)
            same_bytes(c, what + ": scales", s, rs)
    # torch's current stream: w is written on a side stream after a wait there, then quantized
    # on it; quantized on another stream, the old w would be read.
    w = weights[0]
    new = spread(c, tuple(w.shape), gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # about 25 ms at 2 GHz
        w.copy_(new)
        q, s = cm.quantize_fp8_weights(w)
    side.synchronize()
    rq, rs = quantize_weights(torch, new)
    same_bytes(c, "quantize_fp8_weights on a side stream", q, rq)
    # Refused before comet is called: a view that starts inside a row.
    inside = torch.zeros(4 * 64 + 8, dtype=torch.bfloat16, device=c.device)[4:4 + 4 * 64].view(4, 64)  # 8 bytes in
    raises(ValueError, lambda: cm.quantize_fp8_weights(inside), "w.data_ptr()", "16-byte aligned")
    raises(ValueError, lambda: cm.quantize_fp8_rows(inside), "x.data_ptr()", "16-byte aligned")
    # Under torch.compile(fullgraph=True): each quantizer one operator, the same bytes as eager.

    def quantize_all(w, x):
        return (*cm.quantize_fp8_weights(w), *cm.quantize_fp8_weights_transposed(w, pow2_scales=True),
                *cm.quantize_fp8_rows(x))

    torch._dynamo.reset()
    compiled = torch.compile(quantize_all, fullgraph=True)
    w, x = weights[1], rows[1]
    for i, (got, want) in enumerate(zip(compiled(w, x), quantize_all(w, x))):
        same_bytes(c, f"compiled quantizers: output {i}", got, want)


def fp8_cases(c):
    """(name, config changes, ffn, pow2): EP over every rank (gate_up packed), with pow2
    scales, ffn 192 (gate and up apart), and TP 2 where the world size is even."""
    cases = [("EP", {}, FFN, False), ("EP, pow2 scales", dict(fp8_pow2_scales=True), FFN, True),
             ("EP, ffn 192 (gate and up apart)", dict(ffn=192), 192, False)]
    if c.world % 2 == 0:
        cases.append(("TP 2", dict(tp_size=2), FFN, False))  # ffn / tp_size = 128: on the blocks
    return cases


@gpu_test
def fp8_block_matches_bf16_block_on_dequantized_weights(c):
    torch, cm = c.torch, c.cm
    for name, changes, ffn, pow2 in fp8_cases(c):
        sd8 = fp8_state_dict(c, bf16_state_dict(c, ffn, seed=11), pow2)
        bf16_changes = {k: v for k, v in changes.items() if k != "fp8_pow2_scales"}  # an FP8 field
        with cm.CometSparseMoeBlock(c.comm, c.config(dtype="fp8", **changes)) as b8, \
                cm.CometSparseMoeBlock(c.comm, c.config(**bf16_changes)) as b16:
            result = b8.load_state_dict(sd8)
            check(not result.missing_keys and not result.unexpected_keys, f"{name}: load_state_dict: {result}")
            b16.load_state_dict(dequantized(c, sd8))
            buffers = [n for n, _ in b8.named_buffers()]
            check(("w13" in buffers) == (b8.ffn_local % 128 == 0), f"{name}: buffers {buffers}")
            for impl in IMPLS:
                b8.impl = b16.impl = impl
                m = (300, 77)[c.rank % 2]
                x = c.tokens(m)
                out = c.poisoned(m)
                with torch.inference_mode():
                    y8, logits = b8(x, out=out)
                    ids, w = cm.mixtral_route(logits, TOP_K)
                    xq, xs = cm.quantize_fp8_rows(x, pow2_scales=pow2)
                    y16q = b16.forward_routed(cm.dequantize_fp8(xq, xs, dtype=torch.bfloat16), ids, w)
                    y16 = b16.forward_routed(x, ids, w)
                    y8x = b8.moe.forward(xq, ids, w, x_scales=xs, impl=impl, **b8.fp8_weights())
                torch.cuda.synchronize()
                c.comm.check_async_error()
                what = f"{name}, {impl}"
                if torch.isnan(y8).any().item() or y8.data_ptr() != out.data_ptr():
                    c.failures.append(f"{what}: NaN in y (the poison left), or y is not out")
                    continue
                d, d_raw, d_x8 = calc_diff(y8, y16q), calc_diff(y8, y16), calc_diff(y8x, y8)
                if not d < DIFF_LIMIT:
                    c.failures.append(f"{what}: against the bf16 block on x as comet quantizes it: diff {d:.3g} "
                                      f"(limit {DIFF_LIMIT})")
                if not d_raw < DIFF_LIMIT_RAW_X:
                    c.failures.append(f"{what}: against the bf16 block on x: diff {d_raw:.3g} (limit "
                                      f"{DIFF_LIMIT_RAW_X})")
                if not d_x8 < 1e-5:
                    c.failures.append(f"{what}: x given in FP8 against x quantized by comet: diff {d_x8:.3g}")
                c.note(f"{what}: {m} tokens, diff {d:.2e} (x quantized alike), {d_raw:.2e} (x bf16); x given in "
                       f"FP8: {'the same bits' if torch.equal(y8x, y8) else f'diff {d_x8:.2e}'}")


@gpu_test
def fp8_block_loads_a_checkpoint_file_and_runs(c):
    """A synthetic FP8 checkpoint under Qwen3-MoE's names and a model's prefix, beside other
    keys, written to a file (safetensors where installed, else torch.save) and read back;
    the block loads it (its buffers those stack_fp8_experts gives), and a bf16 checkpoint
    into an FP8 block is quantized to the same bytes; the block runs every path."""
    import tempfile
    from pathlib import Path
    torch, cm = c.torch, c.cm
    prefix = "model.layers.1.mlp."
    sd = fp8_state_dict(c, c.full_sd, names=("gate_proj", "up_proj", "down_proj"), prefix=prefix)
    sd["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(H, H, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            from safetensors.torch import load_file, save_file
            path = str(Path(tmp) / "model.safetensors")
            save_file(sd, path)
            sd, how = load_file(path), "safetensors"
        except ImportError:
            path = Path(tmp) / "model.pt"
            torch.save(sd, path)
            sd, how = torch.load(path, weights_only=True), "torch.save"
    cfg = c.config(dtype="fp8")
    with cm.CometSparseMoeBlock(c.comm, cfg) as block, cm.CometSparseMoeBlock(c.comm, cfg) as from_bf16:
        result = block.load_full_state_dict(sd, prefix=prefix)
        check(not result.missing_keys and not result.unexpected_keys, f"load_full_state_dict: {result}")
        stacked = cm.stack_fp8_experts(sd, cfg, world_size=c.world, rank=c.rank, prefix=prefix, device=c.device)
        check(sorted(stacked) == sorted(block.fp8_weights()), f"keys {sorted(stacked)}")
        for kw, t in block.fp8_weights().items():
            same_bytes(c, f"block's {kw} against stack_fp8_experts'", t, stacked[kw])
        from_bf16.load_state_dict(c.full_sd)  # quantized by comet as it loads: the bytes of the whole matrices'
        for kw, t in block.fp8_weights().items():
            same_bytes(c, f"{kw} quantized from bf16 as it loads", from_bf16.fp8_weights()[kw], t)
        own = block.state_dict()
        for e in block.local_experts:
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                for suffix in ("weight", "weight_scale_inv"):
                    same_bytes(c, f"state_dict()['experts.{e}.{ours}.{suffix}']", own[f"experts.{e}.{ours}.{suffix}"],
                               sd[f"{prefix}experts.{e}.{theirs}.{suffix}"].to(c.device))
        ref_w = {k: v.to(c.device).float() for k, v in dequantized(c, fp8_state_dict(c, c.full_sd)).items()}
        for impl in IMPLS:
            block.impl = impl
            m = (129, 300)[c.rank % 2]
            x = c.tokens(m)
            out = c.poisoned(m)
            with torch.inference_mode():
                y, logits = block(x, out=out)
            torch.cuda.synchronize()
            c.comm.check_async_error()
            ids, w = c.reference_route(x, logits)
            ref = c.reference_experts(x, ids, w, ref_w)
            d = calc_diff(y, ref) if not torch.isnan(y).any().item() else float("nan")
            if not d < DIFF_LIMIT_RAW_X:
                c.failures.append(f"{impl}: against float32 on the dequantized weights: diff {d:.3g} (limit "
                                  f"{DIFF_LIMIT_RAW_X})")
            c.note(f"{impl}: {m} tokens, diff {d:.2e} against float32 on the dequantized weights")
    c.note(f"the checkpoint went through {how}")


@gpu_test
def fp8_block_training_is_refused(c):
    """Under autograd the FP8 block, which holds FP8 buffers and no master weights, refuses
    (NotImplementedError) before anything is launched; an inference call after works."""
    torch, cm = c.torch, c.cm
    with cm.CometSparseMoeBlock(c.comm, c.config(dtype="fp8")) as block:
        block.load_state_dict(c.full_sd)
        m = 64
        x = c.tokens(m)
        raises(NotImplementedError, lambda: block(x), "training in FP8 is not built", "torch.no_grad()")
        raises(NotImplementedError, lambda: block(x.clone().requires_grad_(True)), "training in FP8 is not built")
        ids, w = c.routing(m, "random")
        out = c.poisoned(m)
        with torch.inference_mode():
            y = block.forward_routed(x, ids, w, out=out)
        torch.cuda.synchronize()
        check(not torch.isnan(y).any().item(), "the inference call after the refusals left NaN")


def on_e4m3_grid(c, t, rows_only=False):
    """t with every value on the E4M3 grid of power-of-two scales (quantized by comet, then
    dequantized: the same bf16 values an FP8 layer quantizing it again sees)."""
    cm, torch = c.cm, c.torch
    q, s = cm.quantize_fp8_rows(t, True) if rows_only else cm.quantize_fp8_weights(t, True)
    return cm.dequantize_fp8(q, s, dtype=torch.bfloat16)


def masters_on_grid(c, moe, m):
    """The training tests' operands: this rank's bf16 masters (gate_up, down) and m tokens of
    x on the E4M3 grid of power-of-two scales, random routing, and dy."""
    torch, sd = c.torch, c.full_sd
    experts = list(moe.local_experts)
    gate_up = torch.stack([torch.cat([sd[f"experts.{e}.w1.weight"], sd[f"experts.{e}.w3.weight"]])
                           for e in experts]).to(c.device)
    down = torch.stack([sd[f"experts.{e}.w2.weight"] for e in experts]).to(c.device)
    x = on_e4m3_grid(c, c.tokens(m), rows_only=True)
    ids, tw = c.routing(m, "random")
    return on_e4m3_grid(c, gate_up), on_e4m3_grid(c, down), x, ids, tw, c.tokens(m)


@gpu_test
def fp8_moe_trains_from_bf16_masters(c):
    """An FP8 Moe given bf16 master weights trains under autograd: y and every gradient (x,
    the routing weights, both masters) against the bf16 Moe's on the same operands (masters
    and x on the E4M3 grid of power-of-two scales) by DeepGEMM's measure < 1e-3, none NaN;
    the FP8 copies made once per version of a master (an in-place update makes them again);
    main_grad accumulation equal to .grad within bf16's rounding; gate and up apart refused.
    With fp8_gate_up="e4m3": y bit for bit the same, every gradient < 2e-3 against bf16's
    (one more E4M3 rounding of g and u)."""
    torch, cm = c.torch, c.cm
    with cm.Moe(c.comm, c.config(dtype="fp8", fp8_pow2_scales=1)) as m8, cm.Moe(c.comm, c.config()) as m16, \
            cm.Moe(c.comm, c.config(dtype="fp8", fp8_pow2_scales=1), grad_accumulation="main_grad") as mg, \
            cm.Moe(c.comm, c.config(dtype="fp8", fp8_pow2_scales=1), fp8_gate_up="e4m3") as m8e:
        gate_up, down, x, ids, tw, dy = masters_on_grid(c, m8, 200)
        runs = {}
        for name, layer in (("fp8", m8), ("bf16", m16), ("fp8, [g u] e4m3", m8e)):
            gu, dn = torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())
            xi, twi = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
            y = layer(xi, ids, twi, gate_up=gu, down=dn)
            y.backward(dy)
            runs[name] = (y.detach(), xi.grad, twi.grad, gu.grad, dn.grad, gu, dn)
        torch.cuda.synchronize()
        for i, what in enumerate(("y", "dx", "d topk_weights", "d gate_up", "d down")):
            got, want = runs["fp8"][i], runs["bf16"][i]
            if got is None or torch.isnan(got).any().item():
                c.failures.append(f"FP8 training from masters: {what} is {'None' if got is None else 'NaN'}")
                continue
            d = calc_diff(got.float(), want.float())
            check(d < DIFF_LIMIT, f"FP8 training from masters: {what} measures {d:.3g} against bf16 (limit "
                                  f"{DIFF_LIMIT})")
            c.note(f"FP8 training from bf16 masters: {what} {d:.2e} against the bf16 layer")
            got = runs["fp8, [g u] e4m3"][i]
            if i == 0:
                check(torch.equal(got, runs["fp8"][0]), "fp8_gate_up='e4m3': y differs from the FP8 layer's")
                continue
            d = calc_diff(got.float(), want.float())
            check(d < 2e-3, f"FP8 training, [g u] in E4M3: {what} measures {d:.3g} against bf16 (limit 2e-3)")
            c.note(f"FP8 training, [g u] in E4M3: {what} {d:.2e} against the bf16 layer")
        # The copies: kept while the master is unchanged, made again after an in-place update.
        gu, dn = runs["fp8"][5], runs["fp8"][6]
        first = m8._fp8_cache[id(gu)][2]
        with torch.no_grad():
            m8(x, ids, tw, gate_up=gu, down=dn)
            check(m8._fp8_cache[id(gu)][2] is first, "the FP8 copies were made again for an unchanged master")
            gu.mul_(2.0)
            y2 = m8(x, ids, tw, gate_up=gu, down=dn)
        check(m8._fp8_cache[id(gu)][2] is not first, "an in-place update of the master did not renew its copies")
        d = calc_diff(y2.float(), runs["fp8"][0].float())
        check(d > 1e-3, f"the forward after doubling gate_up matches the one before (measure {d:.3g})")
        # main_grad: the same gradients, added in fp32.
        gu_m, dn_m = torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())
        gu_m.main_grad = torch.zeros(gate_up.shape, dtype=torch.float32, device=c.device)
        dn_m.main_grad = torch.zeros(down.shape, dtype=torch.float32, device=c.device)
        mg(x.clone().requires_grad_(True), ids, tw.clone().requires_grad_(True), gate_up=gu_m, down=dn_m).backward(dy)
        torch.cuda.synchronize()
        for what, got, want in (("gate_up", gu_m.main_grad, runs["fp8"][3]), ("down", dn_m.main_grad, runs["fp8"][4])):
            err = ((got - want.float()).abs() - 2.0 ** -8 * want.float().abs()).max().item()
            check(err <= 1e-30, f"{what}.main_grad differs from the bf16 .grad past bf16's rounding ({err:.3g})")
        half = gate_up.shape[1] // 2
        raises(ValueError, lambda: m8(x, ids, tw, gate=torch.nn.Parameter(gate_up[:, :half].contiguous()),
                                      up=torch.nn.Parameter(gate_up[:, half:].contiguous()), down=dn),
               "one tensor")


@gpu_test
def fp8_moe_trains_sequentially(c):
    """impl="baseline" trains an FP8 Moe from bf16 masters too (the sequential FP8 step:
    NCCL exchanges, cuBLASLt's block-scaled GEMMs): y and every gradient against the fused
    FP8 step's on the same operands (masters and x on the E4M3 grid) by DeepGEMM's measure
    < 5e-4 (the C test's bound on y: fused, SwiGLU reads the fp32 sums; here bf16 h, so a few
    of the activation's E4M3 roundings tip, and the gradients follow), against the bf16
    Moe's < 1e-3, and with fp8_gate_up="e4m3" < 2e-3 against bf16; none NaN; the same bits
    when run twice."""
    torch, cm = c.torch, c.cm
    with cm.Moe(c.comm, c.config(dtype="fp8", fp8_pow2_scales=1)) as m8, cm.Moe(c.comm, c.config()) as m16, \
            cm.Moe(c.comm, c.config(dtype="fp8", fp8_pow2_scales=1), fp8_gate_up="e4m3") as m8e:
        gate_up, down, x, ids, tw, dy = masters_on_grid(c, m8, 200)
        runs = {}
        for name, layer, impl in (("fused", m8, "fused"), ("sequential", m8, "baseline"),
                                  ("sequential again", m8, "baseline"), ("bf16", m16, "auto"),
                                  ("sequential, [g u] e4m3", m8e, "baseline")):
            gu, dn = torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())
            xi, twi = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
            y = layer(xi, ids, twi, gate_up=gu, down=dn, impl=impl)
            y.backward(dy)
            runs[name] = (y.detach(), xi.grad, twi.grad, gu.grad, dn.grad)
        torch.cuda.synchronize()
        for i, what in enumerate(("y", "dx", "d topk_weights", "d gate_up", "d down")):
            got = runs["sequential"][i]
            if got is None or torch.isnan(got).any().item():
                c.failures.append(f"sequential FP8 training: {what} is {'None' if got is None else 'NaN'}")
                continue
            check(torch.equal(got, runs["sequential again"][i]), f"sequential FP8 training: {what} differs run to run")
            for against, limit, mine in (("fused", 5e-4, "sequential"), ("bf16", DIFF_LIMIT, "sequential"),
                                         ("bf16", 2e-3, "sequential, [g u] e4m3")):
                d = calc_diff(runs[mine][i].float(), runs[against][i].float())
                check(d < limit, f"{mine} FP8 training: {what} measures {d:.3g} against {against} (limit {limit})")
                c.note(f"{mine} FP8 training: {what} {d:.2e} against {against}")


@gpu_test
def fp8_operators_pass_opcheck(c):
    """torch.library.opcheck of forward_fp8 and forward_fp8_out with comet's kernels (its
    schema part left out: torch's SchemaCheckMode compares inputs with allclose, which has
    no float8 kernel; the inputs' bytes are compared here), on a communicator whose waits
    allow the minutes compiling takes."""
    torch, cm = c.torch, c.cm
    with cm.Comm.from_process_group(timeout_ms=600000) as comm, cm.Moe(comm, c.config(dtype="fp8", ffn=192)) as moe:
        g = torch.Generator().manual_seed(5)
        per = moe.experts_per_rank
        w = {name: (torch.randn(per, *shape, generator=g) / 16).to(torch.bfloat16).to(c.device)
             for name, shape in (("gate", (192, H)), ("up", (192, H)), ("down", (H, 192)))}
        q = {name: cm.quantize_fp8_weights(t) for name, t in w.items()}
        m = (120, 64)[c.rank % 2]
        x = c.tokens(m)
        ids, tw = c.routing(m, "random")
        xq, xs = cm.quantize_fp8_rows(x)
        for impl in (cm.IMPL_FUSED, cm.IMPL_BASELINE):
            for x_in, x_scales in ((x, None), (xq, xs)):
                args = (moe._op_id, x_in, x_scales, ids, tw, None, q["gate"][0], q["up"][0], q["down"][0], None,
                        q["gate"][1], q["up"][1], q["down"][1], impl, None)
                for op, extra in ((torch.ops.comet_moe.forward_fp8.default, ()),
                                  (torch.ops.comet_moe.forward_fp8_out.default, (c.poisoned(m),))):
                    before = [a.view(torch.uint8).clone() for a in args if isinstance(a, torch.Tensor)]
                    result = torch.library.opcheck(op, args + extra, raise_exception=False,
                                                   test_utils=OPCHECK_WITHOUT_SCHEMA)
                    bad = {k: v for k, v in result.items() if v != "SUCCESS"}
                    if bad:
                        c.failures.append(f"opcheck {op} (impl {impl}, x FP8 {x_scales is not None}): {bad}")
                    after = [a.view(torch.uint8) for a in args if isinstance(a, torch.Tensor)]
                    if not all(torch.equal(b, a) for b, a in zip(before, after)):
                        c.failures.append(f"{op} changed an input")
        torch.cuda.synchronize()
        comm.check_async_error()


fp8_operators_pass_opcheck.timeout_s = 900  # opcheck compiles
