#!/usr/bin/env python3
"""Plot `comet bench --suite --json FILE` results: two PNGs beside FILE, and the headline
table (markdown) on stdout.

  FILE-speedup.png    comet's speedup over the sequential baseline (and over plain PyTorch,
                      given its records), per preset and token count, balanced and skewed
                      routing side by side
  FILE-breakdown.png  per case: the baseline's time, comet's, and comet's again timed in
                      turns with our two GEMMs alone on the same rows (what a perfect
                      overlap would take), in ms
  FILE-train.png      with `--train` records: comet's training step (forward_train and
                      backward) against the baseline's, the two timed in turns, per preset
                      and token count

Usage: python3 bench/plot_suite.py suite.json [suite-torch.json]
(needs matplotlib: pip install matplotlib; the second file from
`torchrun --nproc-per-node N bench/torch_peer.py --suite --json suite-torch.json`)
"""
import json
import sys
from collections import defaultdict


def load(path, torch_path=None):
    """Cases keyed by (preset, tokens, routing) with the baseline's, comet's and (if given)
    plain PyTorch's figures; and the `--train` records' steps, keyed alike."""
    with open(path) as f:
        records = json.load(f)
    if torch_path:
        with open(torch_path) as f:
            records += json.load(f)
    cases, train = defaultdict(dict), defaultdict(dict)
    gpu, ranks, tp = "", 0, 1
    for r in records:
        if r.get("impl") in ("baseline-train", "comet-train"):
            key = (r["case"], r["tokens_per_rank"], r["routing"])
            impl = r["impl"].split("-")[0]
            train[key][impl + "_step_turns_ms"] = r.get("step_in_turns_ms")
        elif r.get("impl") == "baseline":
            key = (r["case"], r["tokens_per_rank"], r["routing"])
            cases[key]["baseline_ms"] = r["median_ms"]["total"]
            gpu, ranks, tp = r.get("gpu", gpu), r.get("ranks", ranks), r.get("tp", tp)
        elif r.get("impl") == "comet" and "tokens_per_rank" in r:
            key = (r["case"], r["tokens_per_rank"], r["routing"])
            cases[key]["comet_ms"] = r["total_ms"]
            # The overlap ratio comes from the pair timed in turns (the same clocks for both).
            cases[key]["whole_turns_ms"] = r.get("whole_in_turns_ms", 0)
            cases[key]["gemms_ms"] = r.get("gemms_alone_in_turns_ms", 0)
            cases[key]["cublas_ms"] = r.get("cublas_experts_in_turns_ms", 0)
            cases[key]["baseline_turns_ms"] = r.get("baseline_in_turns_ms", 0)
        elif r.get("impl") == "torch":
            cases[(r["case"], r["tokens_per_rank"], r["routing"])]["torch_ms"] = r["median_ms"]["total"]
    complete = {k: v for k, v in cases.items() if "baseline_ms" in v and v.get("comet_ms", 0) > 0}
    if not complete:
        sys.exit(f"{path}: no case has both a baseline and a comet record (was it written by comet bench --suite?)")
    steps = {k: v for k, v in train.items() if v.get("baseline_step_turns_ms") and v.get("comet_step_turns_ms")}
    return complete, steps, gpu, ranks, tp


def table(cases, title):
    """The headline table, markdown: one row per case."""
    has_torch = any("torch_ms" in c for c in cases.values())
    print(f"comet on {title}: `comet_moe_forward` with its default settings\n")
    head = "| preset | tokens per GPU | routing | baseline ms | comet ms | vs baseline |"
    rule = "|---|---:|---|---:|---:|---:|"
    if has_torch:
        head += " PyTorch ms | vs PyTorch |"
        rule += "---:|---:|"
    has_cublas = any(c.get("cublas_ms", 0) > 0 for c in cases.values())
    has_base_turns = any(c.get("baseline_turns_ms", 0) > 0 for c in cases.values())
    head += " in turns: comet ms |"
    rule += "---:|"
    if has_base_turns:
        head += " in turns: baseline ms | in turns: vs baseline |"
        rule += "---:|---:|"
    head += " our GEMMs alone ms | comet / GEMMs |"
    rule += "---:|---:|"
    if has_cublas:
        head += " cuBLAS experts ms | our GEMMs / cuBLAS |"
        rule += "---:|---:|"
    print(head)
    print(rule)
    for (preset, tokens, routing), c in sorted(cases.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        row = f"| {preset} | {tokens} | {routing} | {c['baseline_ms']:.3f} | {c['comet_ms']:.3f} | " \
              f"{c['baseline_ms'] / c['comet_ms']:.2f}x |"
        if has_torch:
            t = c.get("torch_ms")
            row += f" {t:.3f} | {t / c['comet_ms']:.2f}x |" if t else " | |"
        g, whole = c.get("gemms_ms", 0), c.get("whole_turns_ms", 0)
        row += f" {whole:.3f} |" if whole > 0 else " |"
        if has_base_turns:
            b = c.get("baseline_turns_ms", 0)
            row += f" {b:.3f} | {b / whole:.2f}x |" if b > 0 and whole > 0 else " | |"
        row += f" {g:.3f} | {whole / g:.3f} |" if g > 0 and whole > 0 else " | |"
        if has_cublas:
            cb = c.get("cublas_ms", 0)
            row += f" {cb:.3f} | {g / cb:.3f} |" if cb > 0 and g > 0 else " | |"
        print(row)


def plot_train(plt, steps, title, path):
    """comet's training step against the baseline's, timed in turns: one panel per preset,
    token counts on x, one bar per routing."""
    presets = sorted({k[0] for k in steps})
    tokens = sorted({k[1] for k in steps})
    routings = sorted({k[2] for k in steps})
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.6), sharey=True, squeeze=False)
    width = 0.8 / len(routings)
    for ax, preset in zip(axes[0], presets):
        for i, routing in enumerate(routings):
            xs, ys = [], []
            for j, t in enumerate(tokens):
                c = steps.get((preset, t, routing))
                if c:
                    xs.append(j + (i - (len(routings) - 1) / 2) * width)
                    ys.append(c["baseline_step_turns_ms"] / c["comet_step_turns_ms"])
            bars = ax.bar(xs, ys, width, label=routing)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_xlim(-0.5, len(tokens) - 0.5)
        ax.set_title(preset, fontsize=10)
        ax.set_xlabel("tokens per GPU")
    axes[0][0].set_ylabel("training step: speedup over the baseline")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"comet's training step (forward_train + backward) over the baseline's, in turns, {title}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    if len(sys.argv) not in (2, 3) or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    path = sys.argv[1]
    cases, steps, gpu, ranks, tp = load(path, sys.argv[2] if len(sys.argv) == 3 else None)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({k[0] for k in cases})
    tokens = sorted({k[1] for k in cases})
    routings = sorted({k[2] for k in cases})
    title = f"{ranks} x {gpu}" if ranks else gpu
    if tp > 1:
        title += f" (EP {ranks // tp} x TP {tp})"
    base = path[:-5] if path.endswith(".json") else path

    # Speedup over the baseline (and over PyTorch): one panel per preset, token counts on x,
    # one bar per routing.
    against = [("baseline_ms", "the baseline")]
    if any("torch_ms" in c for c in cases.values()):
        against.append(("torch_ms", "plain PyTorch"))
    fig, axes = plt.subplots(len(against), len(presets), figsize=(4.2 * len(presets), 3.6 * len(against)),
                             sharey="row", squeeze=False)
    width = 0.8 / len(routings)
    for row, (field, name) in enumerate(against):
        for ax, preset in zip(axes[row], presets):
            for i, routing in enumerate(routings):
                xs, ys = [], []
                for j, t in enumerate(tokens):
                    c = cases.get((preset, t, routing))
                    if c and c.get(field):
                        xs.append(j + (i - (len(routings) - 1) / 2) * width)
                        ys.append(c[field] / c["comet_ms"])
                bars = ax.bar(xs, ys, width, label=routing)
                ax.bar_label(bars, fmt="%.2f", fontsize=7)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
            ax.set_title(preset, fontsize=10)
            if row == len(against) - 1:
                ax.set_xlabel("tokens per GPU")
        axes[row][0].set_ylabel(f"speedup over {name}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"comet's speedup over {' and over '.join(n for _, n in against)}, {title}", fontsize=11)
    fig.tight_layout()
    fig.savefig(base + "-speedup.png", dpi=120)

    # Breakdown: baseline, comet, our GEMMs alone, per case (balanced and skewed rows).
    fig, axes = plt.subplots(len(routings), len(presets), figsize=(4.2 * len(presets), 3.4 * len(routings)),
                             squeeze=False)
    series = [("baseline_ms", "baseline"), ("comet_ms", "comet"), ("whole_turns_ms", "comet, in turns"),
              ("gemms_ms", "our GEMMs alone, in turns")]
    width = 0.8 / len(series)
    for row, routing in enumerate(routings):
        for col, preset in enumerate(presets):
            ax = axes[row][col]
            for i, (field, name) in enumerate(series):
                xs, ys = [], []
                for j, t in enumerate(tokens):
                    c = cases.get((preset, t, routing))
                    if c and c.get(field, 0) > 0:
                        xs.append(j + (i - (len(series) - 1) / 2) * width)
                        ys.append(c[field])
                ax.bar(xs, ys, width, label=name)
            ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
            ax.set_title(f"{preset}, {routing}", fontsize=9)
            if col == 0:
                ax.set_ylabel("ms per layer")
            if row == len(routings) - 1:
                ax.set_xlabel("tokens per GPU")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"time per MoE layer, {title}", fontsize=11)
    fig.tight_layout()
    fig.savefig(base + "-breakdown.png", dpi=120)
    table(cases, title)
    plots = f"{base}-speedup.png {base}-breakdown.png"
    if steps:
        plot_train(plt, steps, title, base + "-train.png")
        plots += f" {base}-train.png"
    print(f"\nplots: {plots}")


if __name__ == "__main__":
    main()
