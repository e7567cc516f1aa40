#!/usr/bin/env bash
# device-run.sh - what one call on a lent 2 x H200 machine runs: build there, run the
# whole test suite (GPU tests included), measure NVLink push/pull bandwidth, time our
# grouped GEMM against cuBLAS, time the baseline on every preset, and run the PyTorch
# peer on the same presets. Logs land in
# $OUT (or ./out); the last lines printed are the summary tables.
# Usage: scripts/device-run.sh [tests|bandwidth|gemm|bench|peer]...   (default: all)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
steps=${*:-tests bandwidth gemm bench peer}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpus.txt" 2>&1
make -j16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
for step in $steps; do
    case $step in
    tests) build/comet_tests -v 2>&1 | tee "$OUT/tests.log" | grep -E "^(PASS|FAIL|SKIP|[0-9]+ passed)|^    .*(error|rank [0-9]:)" ;;
    bandwidth) timeout 120 build/comet bandwidth 2>&1 | tee "$OUT/bandwidth.log" ;;
    gemm) timeout 300 build/comet gemm 2>&1 | tee "$OUT/gemm.log" ;;
    sass) cuobjdump --dump-sass build/src/kernels/gemm.o > "$OUT/gemm.sass" 2>&1; grep -c HGMMA "$OUT/gemm.sass" ;;
    bench) timeout 300 build/comet bench --preset all --impl all --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    peer) timeout 240 torchrun --nproc-per-node 2 bench/torch_peer.py --preset all 2>&1 | tee "$OUT/peer.log" | grep -v "^\[" ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
