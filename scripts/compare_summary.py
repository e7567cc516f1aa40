#!/usr/bin/env python3
"""compare_summary.py STEP OUT ROUNDS - the tables scripts/compare-builds.sh prints last: an
old and a new build timed in turns, ROUNDS rounds each, their logs and JSON in OUT; each
figure is the median over the rounds.

    gemm   `comet gemm`: every table (the forward's GEMMs, GEMM0 with SwiGLU, the backward's
           dgrad GEMMs and weight gradients), ours at its best tile width, old and new, with
           the same run's cuBLAS
    bench  `comet bench --preset all`: the layer, and each fused half over its GEMM alone
    train  `comet bench --ranks 1 --preset all --train`: comet's training step, forward and
           backward, old and new, beside the baseline's step
    fp8    `comet bench --fp8 --preset all`: the bf16 and FP8 layers, old and new, per preset
           and token count
    fp8train `comet bench --fp8 --train`: the bf16 and FP8 training steps and the FP8 forward
           and backward, old and new, per preset
"""
import json
import re
import statistics
import sys

# comet gemm's tables start with these lines; rows before the first belong to the forward's.
SECTIONS = (("GEMM0 with SwiGLU", "swiglu"), ("The backward's dgrad", "dgrad"), ("The backward's weight", "wgrad"))
# A table row: a name, four sizes, then TFLOP/s columns (blank where one is not measured),
# best/cuBLAS and the diff, maybe WRONG.
ROW = re.compile(r"^(\S.*?)\s+\d+\s+\d+\s+\d+\s+\d+\s+([\d.\se+-]+?)(?: WRONG)?$")


# A row of `comet bench --fp8`'s table: case, tokens, bf16 ms, FP8 ms, bf16/FP8, FP8
# sequential ms, seq/FP8, the measure against bf16 (maybe flagged " !").
FP8_ROW = re.compile(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\S+( !)?$")


def median_or_nan(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def gemm_table(path):
    """(table, shape) -> (ours at its best width, cuBLAS), TFLOP/s."""
    rows, section = {}, "forward"
    for line in open(path):
        for head, name in SECTIONS:
            if line.startswith(head):
                section = name
        m = ROW.match(line.rstrip("\n"))
        if not m:
            continue
        nums = [float(x) for x in m[2].split()]
        if len(nums) >= 5:  # cuBLAS, ours (2-3 columns), best/cuBLAS, diff
            rows[(section, m[1])] = (max(nums[1:-2]), nums[0])
    return rows


def gemm(out, rounds):
    res = {w: [gemm_table(f"{out}/gemm-{w}-{r}.log") for r in range(1, rounds + 1)] for w in ("old", "new")}
    print(f"{'table':8s} {'shape':24s} {'old TFLOP/s':>12s} {'new TFLOP/s':>12s} {'new/old':>8s} {'cuBLAS':>8s}")
    for key in res["new"][0]:
        if not all(key in t for t in res["old"] + res["new"]):
            continue
        o = statistics.median(t[key][0] for t in res["old"])
        n = statistics.median(t[key][0] for t in res["new"])
        c = statistics.median(t[key][1] for t in res["new"] + res["old"])
        print(f"{key[0]:8s} {key[1]:24s} {o:12.0f} {n:12.0f} {n / o:8.3f} {c:8.0f}")


def load_json(path):
    try:
        return {(e["case"], e["impl"]): e for e in json.load(open(path))}
    except (OSError, ValueError):
        return {}


def bench(out, rounds):
    runs = {w: [load_json(f"{out}/bench-{w}-{r}.json") for r in range(1, rounds + 1)] for w in ("old", "new")}

    def med(w, case, impl, key):
        return median_or_nan(run[(case, impl)].get(key) for run in runs[w] if (case, impl) in run)

    cases = sorted({c for run in runs["new"] for (c, i) in run})
    print(f"{'preset':16s} {'baseline ms':>11s} {'old comet':>10s} {'new comet':>10s} {'new/old':>8s} "
          f"{'old L0/G0':>10s} {'new L0/G0':>10s} {'old L1/G1':>10s} {'new L1/G1':>10s}")
    for c in cases:
        b = med("new", c, "comet", "baseline_total_ms")
        o, n = med("old", c, "comet", "total_ms"), med("new", c, "comet", "total_ms")
        r0 = [med(w, c, "layer0", "fused_in_turns_ms") / med(w, c, "layer0", "gemm0_alone_in_turns_ms")
              for w in ("old", "new")]
        r1 = [med(w, c, "layer1", "fused_in_turns_ms") / med(w, c, "layer1", "gemm1_alone_in_turns_ms")
              for w in ("old", "new")]
        print(f"{c:16s} {b:11.3f} {o:10.3f} {n:10.3f} {n / o:8.3f} {r0[0]:10.3f} {r0[1]:10.3f} {r1[0]:10.3f} "
              f"{r1[1]:10.3f}")


def train(out, rounds):
    runs = {w: [load_json(f"{out}/train-{w}-{r}.json") for r in range(1, rounds + 1)] for w in ("old", "new")}

    def med(w, case, impl, key):
        return median_or_nan(run[(case, impl)].get(key) for run in runs[w] if (case, impl) in run)

    cases = sorted({c for run in runs["new"] for (c, i) in run})
    print(f"{'preset':16s} {'old step':>9s} {'new step':>9s} {'new/old':>8s} {'old fwd':>8s} {'new fwd':>8s} "
          f"{'old bwd':>8s} {'new bwd':>8s} {'baseline':>9s}")
    for c in cases:
        o, n = med("old", c, "comet-train", "step_ms"), med("new", c, "comet-train", "step_ms")
        print(f"{c:16s} {o:9.3f} {n:9.3f} {n / o:8.3f} {med('old', c, 'comet-train', 'forward_train_ms'):8.3f} "
              f"{med('new', c, 'comet-train', 'forward_train_ms'):8.3f} "
              f"{med('old', c, 'comet-train', 'backward_ms'):8.3f} {med('new', c, 'comet-train', 'backward_ms'):8.3f} "
              f"{med('new', c, 'baseline-train', 'step_ms'):9.3f}")


def fp8_table(path):
    """(case, tokens) -> (bf16 ms, FP8 ms); empty when the log is missing."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {}
    return {(m[1], int(m[2])): (float(m[3]), float(m[4])) for m in map(FP8_ROW.match, lines) if m}


# `comet bench --fp8 --train`'s row: case, bf16 step ms, FP8 step ms, then the rest; and the
# lines under it, "  fp8 : forward_train F ms, backward B ms; ...".
FP8_TRAIN_ROW = re.compile(r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s")
FP8_TRAIN_SIDE = re.compile(r"^  fp8 : forward_train ([\d.]+) ms, backward ([\d.]+) ms")


def fp8_train_table(path):
    """case -> [bf16 step, FP8 step, FP8 forward, FP8 backward] ms; empty when the log is missing."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {}
    rows, case = {}, None
    for line in lines:
        m = FP8_TRAIN_ROW.match(line)
        if m:
            case = m[1]
            rows[case] = [float(m[2]), float(m[3]), None, None]
            continue
        m = FP8_TRAIN_SIDE.match(line)
        if m and case in rows:
            rows[case][2:] = [float(m[1]), float(m[2])]
    return rows


def fp8train(out, rounds):
    runs = {w: [fp8_train_table(f"{out}/fp8train-{w}-{r}.log") for r in range(1, rounds + 1)] for w in ("old", "new")}

    def med(w, case, i):
        return median_or_nan(run[case][i] if case in run else None for run in runs[w])

    cases = sorted({c for run in runs["new"] for c in run})
    print(f"{'preset':16s} {'old bf16':>9s} {'new bf16':>9s} {'old fp8':>9s} {'new fp8':>9s} {'new/old':>8s} "
          f"{'old fwd':>8s} {'new fwd':>8s} {'old bwd':>8s} {'new bwd':>8s} {'old bf16/fp8':>12s} {'new bf16/fp8':>12s}")
    for c in cases:
        v = {w: [med(w, c, i) for i in range(4)] for w in ("old", "new")}
        o, n = v["old"], v["new"]
        print(f"{c:16s} {o[0]:9.3f} {n[0]:9.3f} {o[1]:9.3f} {n[1]:9.3f} {n[1] / o[1]:8.3f} {o[2]:8.3f} {n[2]:8.3f} "
              f"{o[3]:8.3f} {n[3]:8.3f} {o[0] / o[1]:12.2f} {n[0] / n[1]:12.2f}")


def fp8(out, rounds):
    runs = {w: [fp8_table(f"{out}/fp8-{w}-{r}.log") for r in range(1, rounds + 1)] for w in ("old", "new")}

    def med(w, key, i):
        return median_or_nan(run[key][i] if key in run else None for run in runs[w])

    keys = sorted({k for run in runs["new"] for k in run}, key=lambda k: (k[0], -k[1]))
    print(f"{'preset':16s} {'tokens':>6s} {'old bf16':>9s} {'new bf16':>9s} {'new/old':>8s} {'old fp8':>9s} "
          f"{'new fp8':>9s} {'new/old':>8s} {'old bf16/fp8':>12s} {'new bf16/fp8':>12s}")
    for k in keys:
        ob, nb, of, nf = med("old", k, 0), med("new", k, 0), med("old", k, 1), med("new", k, 1)
        print(f"{k[0]:16s} {k[1]:6d} {ob:9.3f} {nb:9.3f} {nb / ob:8.3f} {of:9.3f} {nf:9.3f} {nf / of:8.3f} "
              f"{ob / of:12.2f} {nb / nf:12.2f}")


if __name__ == "__main__":
    step, out, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"gemm": gemm, "bench": bench, "train": train, "fp8": fp8, "fp8train": fp8train}[step](out, rounds)
