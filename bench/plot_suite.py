#!/usr/bin/env python3
"""Plot `comet bench --suite --json FILE` results: two PNGs beside FILE.

  FILE-speedup.png    comet's speedup over the sequential baseline, per preset and token
                      count, balanced and skewed routing side by side
  FILE-breakdown.png  per case: the baseline's time, comet's, and our two GEMMs alone on
                      the same rows (what a perfect overlap would take), in ms

Usage: python3 bench/plot_suite.py suite.json   (needs matplotlib: pip install matplotlib)
"""
import json
import sys
from collections import defaultdict


def load(path):
    """Cases keyed by (preset, tokens, routing) with the baseline's and comet's figures."""
    with open(path) as f:
        records = json.load(f)
    cases = defaultdict(dict)
    gpu, ranks = "", 0
    for r in records:
        if r.get("impl") == "baseline":
            key = (r["case"], r["tokens_per_rank"], r["routing"])
            cases[key]["baseline_ms"] = r["median_ms"]["total"]
            gpu, ranks = r.get("gpu", gpu), r.get("ranks", ranks)
        elif r.get("impl") == "comet" and "tokens_per_rank" in r:
            key = (r["case"], r["tokens_per_rank"], r["routing"])
            cases[key]["comet_ms"] = r["total_ms"]
            cases[key]["gemms_ms"] = r.get("gemms_alone_in_turns_ms", 0)
    complete = {k: v for k, v in cases.items() if "baseline_ms" in v and v.get("comet_ms", 0) > 0}
    if not complete:
        sys.exit(f"{path}: no case has both a baseline and a comet record (was it written by comet bench --suite?)")
    return complete, gpu, ranks


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    cases, gpu, ranks = load(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({k[0] for k in cases})
    tokens = sorted({k[1] for k in cases})
    routings = sorted({k[2] for k in cases})
    title = f"{ranks} x {gpu}" if ranks else gpu
    base = path[:-5] if path.endswith(".json") else path

    # Speedup over the baseline: one panel per preset, token counts on x, one bar per routing.
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.6), sharey=True, squeeze=False)
    width = 0.8 / len(routings)
    for ax, preset in zip(axes[0], presets):
        for i, routing in enumerate(routings):
            xs, ys = [], []
            for j, t in enumerate(tokens):
                c = cases.get((preset, t, routing))
                if c:
                    xs.append(j + (i - (len(routings) - 1) / 2) * width)
                    ys.append(c["baseline_ms"] / c["comet_ms"])
            bars = ax.bar(xs, ys, width, label=routing)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_xlabel("tokens per GPU")
        ax.set_title(preset, fontsize=10)
    axes[0][0].set_ylabel("speedup over the baseline")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"comet beside the sequential baseline, {title}", fontsize=11)
    fig.tight_layout()
    fig.savefig(base + "-speedup.png", dpi=120)

    # Breakdown: baseline, comet, our GEMMs alone, per case (balanced and skewed rows).
    fig, axes = plt.subplots(len(routings), len(presets), figsize=(4.2 * len(presets), 3.4 * len(routings)),
                             squeeze=False)
    series = [("baseline_ms", "baseline"), ("comet_ms", "comet"), ("gemms_ms", "our GEMMs alone")]
    width = 0.8 / len(series)
    for row, routing in enumerate(routings):
        for col, preset in enumerate(presets):
            ax = axes[row][col]
            for i, (field, name) in enumerate(series):
                xs, ys = [], []
                for j, t in enumerate(tokens):
                    c = cases.get((preset, t, routing))
                    if c and c.get(field, 0) > 0:
                        xs.append(j + (i - 1) * width)
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
    print(base + "-speedup.png", base + "-breakdown.png")


if __name__ == "__main__":
    main()
