#!/usr/bin/env bash
# compare-builds.sh - on a GPU machine: build this tree and an older one (OLD, a plain
# source tree: `git archive REV | tar -x -C DIR`), both against PyTorch's NCCL where torch
# is installed, then run the chosen steps. Old and new binaries are timed in the same call,
# in turns (old, new, old, new ...), so clock drift falls on both. Logs in $OUT; each step
# prints its summary last.
# Usage: scripts/compare-builds.sh OLD STEP...
#   tests   this tree's C tests (GPU tests at the world the visible GPUs allow) and the
#           Python package's tests (CPU ones with torch, GPU ones under torchrun)
#   gemm    `comet gemm`, old and new in turns, ROUNDS rounds (default 2)
#   bench   `comet bench --preset all --no-check` on every visible GPU, in turns, ROUNDS
#           rounds, then the new binary once with the float64 check
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
old=$1
shift
OUT=${OUT:-out}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
torch_nccl=$(python3 -c "import torch, nvidia.nccl; print(list(nvidia.nccl.__path__)[0])" 2>/dev/null)
[ -n "$torch_nccl" ] && [ -z "${NCCL_HOME:-}" ] && export NCCL_HOME=$torch_nccl
build() { # build DIR LOG
    (cd "$1" && { grep -q "${NCCL_HOME:-none}" build/nccl.mk 2>/dev/null || make clean > /dev/null; } &&
        make -j16 > "$2" 2>&1) || { tail -30 "$2"; exit 1; }
}
build . "$OUT/build-new.log" &
build "$old" "$OUT/build-old.log" &
wait
grep NCCL_VERSION build/nccl.mk
echo "$gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
for step in "$@"; do
    case $step in
    tests)
        timeout 420 build/comet_tests -v > "$OUT/tests.log" 2>&1
        grep -E "^(FAIL|SKIP gpu|[0-9]+ passed)|growth|worst" "$OUT/tests.log" | cut -c1-200
        python3 python/tests/run_cpu.py > "$OUT/python-cpu.log" 2>&1
        grep -E "^(FAIL|[0-9]+ passed)" "$OUT/python-cpu.log"
        timeout 200 torchrun --nproc-per-node "$gpus" python/tests/test_torch_gpu.py -v > "$OUT/python-gpu.log" 2>&1
        echo "python GPU tests (exit $?):"
        grep -E "^(FAIL|SKIP|[0-9]+ passed)" "$OUT/python-gpu.log" ;;
    gemm)
        for r in $(seq "$ROUNDS"); do
            for which in old new; do
                dir=.; [ $which = old ] && dir=$old
                CUDA_VISIBLE_DEVICES=0 timeout 200 "$dir/build/comet" gemm > "$OUT/gemm-$which-$r.log" 2>&1 ||
                    { echo "comet gemm ($which) failed"; tail -5 "$OUT/gemm-$which-$r.log"; }
            done
        done
        python3 - "$OUT" "$ROUNDS" <<'EOF'
import re, sys, statistics
out, rounds = sys.argv[1], int(sys.argv[2])
def table(path):  # shape -> (ours best TFLOP/s, cuBLAS TFLOP/s) from the first table
    rows = {}
    for line in open(path):
        if line.startswith("GEMM0 with SwiGLU"): break
        m = re.match(r"^(\S+(?: GEMM[01])?)\s+\d+\s+\d+\s+\d+\s+\d+\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)", line)
        if m: rows[m[1]] = (max(int(m[3]), int(m[4]), int(m[5])), int(m[2]))
    return rows
res = {w: [table(f"{out}/gemm-{w}-{r}.log") for r in range(1, rounds + 1)] for w in ("old", "new")}
print(f"{'shape':24s} {'old TFLOP/s':>12s} {'new TFLOP/s':>12s} {'new/old':>8s} {'cuBLAS':>8s}")
for shape in res["new"][0]:
    o = statistics.median(t[shape][0] for t in res["old"]); n = statistics.median(t[shape][0] for t in res["new"])
    c = statistics.median(t[shape][1] for t in res["new"] + res["old"])
    print(f"{shape:24s} {o:12.0f} {n:12.0f} {n / o:8.3f} {c:8.0f}")
EOF
        ;;
    bench)
        for r in $(seq "$ROUNDS"); do
            for which in old new; do
                dir=.; [ $which = old ] && dir=$old
                timeout 280 "$dir/build/comet" bench --preset all --no-check --json "$OUT/bench-$which-$r.json" \
                    > "$OUT/bench-$which-$r.log" 2>&1 || { echo "comet bench ($which) failed"; tail -5 "$OUT/bench-$which-$r.log"; }
            done
        done
        python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, sys, statistics
out, rounds = sys.argv[1], int(sys.argv[2])
def load(w, r):
    rows = {}
    for e in json.load(open(f"{out}/bench-{w}-{r}.json")):
        rows[(e["case"], e["impl"])] = e
    return rows
runs = {w: [load(w, r) for r in range(1, rounds + 1)] for w in ("old", "new")}
def med(w, case, impl, key):
    v = [run[(case, impl)][key] for run in runs[w] if (case, impl) in run and key in run[(case, impl)]]
    return statistics.median(v) if v else float("nan")
cases = sorted({c for (c, i) in runs["new"][0]})
print(f"{'preset':16s} {'baseline ms':>11s} {'old comet':>10s} {'new comet':>10s} {'new/old':>8s} "
      f"{'old L0/G0':>10s} {'new L0/G0':>10s} {'old L1/G1':>10s} {'new L1/G1':>10s}")
for c in cases:
    b = med("new", c, "comet", "baseline_total_ms")
    o, n = med("old", c, "comet", "total_ms"), med("new", c, "comet", "total_ms")
    r0 = [med(w, c, "layer0", "fused_in_turns_ms") / med(w, c, "layer0", "gemm0_alone_in_turns_ms") for w in ("old", "new")]
    r1 = [med(w, c, "layer1", "fused_in_turns_ms") / med(w, c, "layer1", "gemm1_alone_in_turns_ms") for w in ("old", "new")]
    print(f"{c:16s} {b:11.3f} {o:10.3f} {n:10.3f} {n / o:8.3f} {r0[0]:10.3f} {r0[1]:10.3f} {r1[0]:10.3f} {r1[1]:10.3f}")
EOF
        timeout 250 build/comet bench --preset all > "$OUT/bench-check.log" 2>&1
        echo "float64 check (new, exit $?):"; grep -E "^[a-z0-9.-]+ +(baseline|comet) " "$OUT/bench-check.log" | cut -c1-160 ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
