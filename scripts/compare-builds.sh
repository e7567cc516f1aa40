#!/usr/bin/env bash
# compare-builds.sh - on a GPU machine: build this tree and an older one (OLD, a plain
# source tree: `git archive REV | tar -x -C DIR`), both against PyTorch's NCCL where torch
# is installed, then run the chosen steps. Old and new binaries are timed in the same call,
# in turns (old, new, old, new ...), so clock drift falls on both. Logs in $OUT; each step
# prints its summary last. PREBUILT=1: nothing is built; OLD and this tree already hold
# build/comet and build/comet_tests (and build/libcomet.so for the tests step), built for
# sm_90a on another machine, and the NCCL they load is PyTorch's where torch is installed.
# Usage: scripts/compare-builds.sh OLD STEP...
#   tests   this tree's C tests (GPU tests at the world the visible GPUs allow) and the
#           Python package's tests (CPU ones with torch, GPU ones under torchrun)
#   gemm    `comet gemm`, old and new in turns, ROUNDS rounds (default 2): every table (the
#           forward's GEMMs, GEMM0 with SwiGLU, the backward's dgrad GEMMs and weight
#           gradients)
#   bench   `comet bench --preset all --no-check` on every visible GPU, in turns, ROUNDS
#           rounds, then the new binary once with the float64 check
#   train   `comet bench --ranks 1 --preset all --train --no-check` in turns, ROUNDS rounds:
#           comet's training step (forward_train, backward) beside the baseline's
#   fp8     `comet bench --fp8 --preset all --no-check --routing ROUTING` (default balanced;
#           random gives experts rows that are not whole tiles) in turns, ROUNDS rounds: the
#           FP8 and bf16 layers at the bench's tokens and at 1, 16 and 128
#   fp8train `comet bench --fp8 --train --no-check --iters 10` on PRESETS (default mixtral-8x7b,
#           phi-3.5-moe, qwen2-57b-a14b, qwen2-moe-2.7b) in turns, ROUNDS rounds: the bf16 and FP8
#           training steps, the FP8 forward and backward; and SwiGLU's FP8 backward kernels
#           alone on mixtral's rows (gpu_swiglu_backward_fp8's timing), in turns
# The tables come from scripts/compare_summary.py.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
old=$1
shift
OUT=${OUT:-out}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd) # the old tree is built from its own folder, its log still here
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
torch_nccl=$(python3 -c "import torch, nvidia.nccl; print(list(nvidia.nccl.__path__)[0])" 2>/dev/null)
[ -n "$torch_nccl" ] && [ -z "${NCCL_HOME:-}" ] && export NCCL_HOME=$torch_nccl
build() { # build DIR LOG
    (cd "$1" && { grep -q "${NCCL_HOME:-none}" build/nccl.mk 2>/dev/null || make clean > /dev/null; } &&
        make -j16 > "$2" 2>&1) || { tail -30 "$2"; return 1; }
}
if [ -n "${PREBUILT:-}" ]; then
    for dir in . "$old"; do
        for bin in comet comet_tests; do
            [ -x "$dir/build/$bin" ] || { echo "PREBUILT: $dir/build/$bin is missing"; exit 2; }
        done
    done
    [ -n "$torch_nccl" ] && export LD_LIBRARY_PATH="$torch_nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "prebuilt binaries; NCCL from ${torch_nccl:-their own path}"
else
    build . "$OUT/build-new.log" &
    new_pid=$!
    build "$old" "$OUT/build-old.log" &
    old_pid=$!
    wait "$new_pid" || { echo "the new tree did not build"; exit 1; }
    wait "$old_pid" || { echo "the old tree ($old) did not build"; exit 1; }
    grep NCCL_VERSION build/nccl.mk
fi
echo "$gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
# in_turns FN: FN DIR WHICH R for the old build and the new one in turns, ROUNDS rounds (the
# tree, old or new, the round), so clock drift falls on both.
in_turns() {
    local r which
    for r in $(seq "$ROUNDS"); do
        for which in old new; do
            if [ "$which" = old ]; then "$1" "$old" old "$r"; else "$1" . new "$r"; fi
        done
    done
}
# comet_logged LOG SECONDS DIR ARGS...: DIR's `comet ARGS` into $OUT/LOG.log, its tail where
# it fails.
comet_logged() {
    local log=$1 limit=$2 dir=$3
    shift 3
    timeout "$limit" "$dir/build/comet" "$@" > "$OUT/$log.log" 2>&1 ||
        { echo "comet $1 ($log) failed"; tail -5 "$OUT/$log.log"; }
}
# Each step's run of one build (DIR WHICH R), its log named after the step.
gemm_turn() { CUDA_VISIBLE_DEVICES=0 comet_logged "gemm-$2-$3" 200 "$1" gemm; }
bench_turn() { comet_logged "bench-$2-$3" 280 "$1" bench --preset all --no-check --json "$OUT/bench-$2-$3.json"; }
train_turn() {
    comet_logged "train-$2-$3" 280 "$1" bench --ranks 1 --preset all --train --no-check --json "$OUT/train-$2-$3.json"
}
fp8_turn() { comet_logged "fp8-$2-$3" 200 "$1" bench --fp8 --preset all --no-check --routing "${ROUTING:-balanced}"; }
fp8train_turn() {
    comet_logged "fp8train-$2-$3" 200 "$1" bench --fp8 --train --no-check --iters 10 \
        --preset "${PRESETS:-mixtral-8x7b,phi-3.5-moe,qwen2-57b-a14b,qwen2-moe-2.7b}"
    timeout 100 "$1/build/comet_tests" gpu_swiglu_backward_fp8 -v > "$OUT/swiglu-$2-$3.log" 2>&1
    echo "$2, round $3, SwiGLU's FP8 backward alone (exit $?):"
    grep -E "^ *(mixtral|in one kernel)" "$OUT/swiglu-$2-$3.log" | sed 's/^ */  /' | cut -c1-180
}
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
    gemm|train|fp8|fp8train)
        in_turns "${step}_turn"
        python3 scripts/compare_summary.py "$step" "$OUT" "$ROUNDS" ;;
    bench)
        in_turns bench_turn
        python3 scripts/compare_summary.py bench "$OUT" "$ROUNDS"
        timeout 250 build/comet bench --preset all > "$OUT/bench-check.log" 2>&1
        echo "float64 check (new, exit $?):"; grep -E "^[a-z0-9.-]+ +(baseline|comet) " "$OUT/bench-check.log" | cut -c1-160 ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
