#!/usr/bin/env python3
"""check-tree.py - the rules the tree's layout promises (docs/ARCHITECTURE.md), checked on
the sources alone (no compiler, no GPU):

1. Layers: a folder of src/ includes only its own files and those of the folders below it:
       base  <  comm  <  gemm, pointwise  <  patterns  <  layer, baseline
   (layer/ and baseline/ are the layer's two sides: the handle and the fused path, and the
   sequential path that runs on the same handle; gemm/ and pointwise/ do not include each
   other).
2. Kernels see device types only: no CUDA file of src/ (.cu, .cuh) reaches include/comet.h,
   base/host.h or NCCL's headers through its includes, except the files that call NCCL
   themselves (comm/symmetric.cu).
3. No include cycles between files.

Prints a PASS or FAIL line per rule and ends with "N passed, N failed, N skipped", as the
other test runners do; exit status 1 when a rule fails.
"""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
RANK = {"base": 0, "comm": 1, "gemm": 2, "pointwise": 2, "patterns": 3, "layer": 4, "baseline": 4}
SAME_LEVEL_OK = {("layer", "baseline"), ("baseline", "layer")}
CALLS_NCCL = {"comm/symmetric.cu"}
HOST_ONLY = {"include/comet.h", "src/base/host.h"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def resolve(name, where):
    """The repository path of a quoted include, or None for one outside the repository."""
    for base in (where.parent, SRC, REPO / "include"):
        p = (base / name).resolve()
        if p.is_file() and REPO in p.parents:
            return p
    return None


def includes(path):
    quoted, system = [], []
    for kind, name in INCLUDE.findall(path.read_text()):
        if kind == "<":
            system.append(name)
        else:
            target = resolve(name, path)
            if target is None:
                raise SystemExit(f"{path.relative_to(REPO)}: cannot find \"{name}\"")
            quoted.append(target)
    return quoted, system


def main():
    files = sorted(p for p in SRC.rglob("*") if p.suffix in (".c", ".h", ".cu", ".cuh"))
    graph, system = {}, {}
    for f in files + [REPO / "include" / "comet.h"]:
        graph[f], system[f] = includes(f)
    rel = lambda p: str(p.relative_to(REPO))  # noqa: E731
    results = []

    bad = []
    for f in files:
        top = f.relative_to(SRC).parts[0]
        for g in graph[f]:
            if SRC not in g.parents:
                continue
            other = g.relative_to(SRC).parts[0]
            if other == top or (top, other) in SAME_LEVEL_OK:
                continue
            if top not in RANK or other not in RANK or RANK[other] >= RANK[top]:
                bad.append(f"{rel(f)} includes {rel(g)}")
    results.append(("folders include only the folders below them", bad))

    bad = []
    for f in files:
        if f.suffix not in (".cu", ".cuh") or str(f.relative_to(SRC)) in CALLS_NCCL:
            continue
        seen, todo, path = set(), [f], {f: [f]}
        while todo:
            cur = todo.pop()
            reached = [s for s in system[cur] if s.startswith("nccl")]
            if rel(cur) in HOST_ONLY or reached:
                what = rel(cur) if rel(cur) in HOST_ONLY else f"<{reached[0]}>"
                bad.append(f"{rel(f)} reaches {what} via " + " -> ".join(rel(p) for p in path[cur]))
                break
            for g in graph.get(cur, []):
                if g not in seen:
                    seen.add(g)
                    path[g] = path[cur] + [g]
                    todo.append(g)
    results.append(("CUDA files include device types only (no comet.h, host.h or nccl.h)", bad))

    bad, state = [], {}

    def visit(f, stack):
        state[f] = 1
        for g in graph.get(f, []):
            if state.get(g) == 1:
                bad.append(" -> ".join(rel(p) for p in stack[stack.index(g):] + [g]) if g in stack else rel(g))
            elif g in graph and not state.get(g):
                visit(g, stack + [g])
        state[f] = 2

    for f in graph:
        if not state.get(f):
            visit(f, [f])
    results.append(("no include cycles", bad))

    failed = 0
    for name, problems in results:
        if problems:
            failed += 1
            print(f"FAIL {name}:")
            for p in problems:
                print(f"     {p}")
        else:
            print(f"PASS {name}")
    print(f"{len(results) - failed} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
