#!/usr/bin/env bash
# device-run.sh - what one run on a GPU machine does: build there (against
# PyTorch's NCCL when torch is installed, so the Python package runs too: its device API
# must match the NCCL the process loads), then the chosen steps. Logs land in $OUT (or
# ./out); each step prints its summary last.
# Usage: scripts/device-run.sh [STEP]...   (default: tests python bench)
#   tests      the C test suite, GPU tests included (~4 min)
#   python     the Python package's GPU tests (torchrun, a rank per GPU) and its example at TP 1
#              and 2 (2 ranks)
#   bench      comet bench --preset all: sweeps, layer0/layer1 in turns, tuned vs model
#   suite      comet bench --suite and the plain-PyTorch suite beside it (JSON in $OUT;
#              then locally: python3 bench/plot_suite.py suite.json suite-torch.json)
#   gemm       our grouped GEMM against cuBLAS on one GPU, and the backward's GEMMs beside torch's on
#              the rows one GPU trains on (--ep 1)
#   train      comet bench --train (forward_train, backward, step against the baseline), the
#              PyTorch autograd peer, every preset, and bench/trace_train.py (each step's kernels)
#   megatron   the Megatron-Core GPU test and bench/megatron_peer.py; needs the megatron-core wheel
#              for the machine's Python in wheels/ (the GPU machine has no network: on a machine
#              with one, `pip download --no-deps --python-version 3.12 --only-binary=:all:
#              -d wheels megatron-core==0.19.2`, and copy wheels/ there with the tree)
#   bandwidth  NVLink push and pull
#   tune       comet tune --preset all into $OUT/tuning.txt
#   fp8        PERF.md's FP8 tables in one call: comet bench --fp8 (the layers), comet gemm --fp8
#              around bench/torch_gemm.py --fp8 --ep 1 (so torch sits between two of ours), the
#              FP8 training step of four presets, and the torch FP8 layer (bench/torch_peer.py)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
steps=${*:-tests python bench}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpus.txt" 2>&1
torch_nccl=$(python3 -c "import torch, nvidia.nccl; print(list(nvidia.nccl.__path__)[0])" 2>/dev/null)
if [ -n "$torch_nccl" ] && [ -z "${NCCL_HOME:-}" ]; then
    export NCCL_HOME=$torch_nccl
    grep -q "$torch_nccl" build/nccl.mk 2>/dev/null || make clean > /dev/null
fi
make -j32 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
grep NCCL_VERSION build/nccl.mk
for step in $steps; do
    case $step in
    tests) timeout 420 build/comet_tests -v > "$OUT/tests.log" 2>&1
           grep -E "^(FAIL|[0-9]+ passed)|growth" "$OUT/tests.log" ;;
    python) timeout 150 torchrun --nproc-per-node "$(nvidia-smi -L | wc -l)" python/tests/test_torch_gpu.py -v \
                > "$OUT/python.log" 2>&1
            grep -E "^(FAIL|[0-9]+ passed)" "$OUT/python.log"
            for tp in 1 2; do
                timeout 60 torchrun --nproc-per-node 2 python/examples/mixtral_block.py --preset mixtral-8x7b \
                    --tokens 4096 --tp $tp 2>&1 | grep -v "^\[\|^W1\|^\*" | tail -4
            done ;;
    bench) timeout 300 build/comet bench --preset all --no-check --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
           grep -E "comet   |layer1 \(|whole layer in turns" "$OUT/bench.log" ;;
    suite) timeout 300 build/comet bench --suite --no-check --json "$OUT/suite.json" > "$OUT/suite.log" 2>&1
           timeout 200 torchrun --nproc-per-node 2 bench/torch_peer.py --suite --json "$OUT/suite-torch.json" \
               > "$OUT/suite-torch.log" 2>&1
           grep -A42 "^suite," "$OUT/suite.log" ;;
    gemm) CUDA_VISIBLE_DEVICES=0 timeout 300 build/comet gemm > "$OUT/gemm.log" 2>&1; grep -v "^\[" "$OUT/gemm.log" | tail -20
          CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/torch_gemm.py --ep 1 > "$OUT/torch-gemm-ep1.log" 2>&1
          CUDA_VISIBLE_DEVICES=0 timeout 300 build/comet gemm --ep 1 > "$OUT/gemm-ep1.log" 2>&1
          grep -E " dW| dgrad" "$OUT/gemm-ep1.log" "$OUT/torch-gemm-ep1.log" ;;
    train) timeout 400 build/comet bench --preset all --train --no-check --json "$OUT/train.json" > "$OUT/train.log" 2>&1
           timeout 200 torchrun --nproc-per-node "$(nvidia-smi -L | wc -l)" bench/torch_peer.py --train --preset all \
               > "$OUT/torch-train.log" 2>&1
           timeout 200 torchrun --nproc-per-node "$(nvidia-smi -L | wc -l)" bench/trace_train.py \
               > "$OUT/trace-train.log" 2>&1
           grep -E "step|GEMMs|x sent again" "$OUT/train.log" | tail -17; tail -6 "$OUT/torch-train.log"
           grep " backward:" "$OUT/trace-train.log" | cut -c1-400 ;;
    megatron) wheel=$(ls wheels/megatron_core-*.whl 2>/dev/null | head -1)
              if [ -z "$wheel" ]; then echo "megatron: no wheels/megatron_core-*.whl (see the header)"; continue; fi
              rm -rf /tmp/comet-mcore && python3 -m zipfile -e "$wheel" /tmp/comet-mcore
              PYTHONPATH=/tmp/comet-mcore timeout 200 torchrun --nproc-per-node "$(nvidia-smi -L | wc -l)" \
                  python/tests/test_torch_gpu.py -v megatron > "$OUT/megatron-test.log" 2>&1
              grep -E "^(FAIL|PASS|SKIP|[0-9]+ passed)" "$OUT/megatron-test.log"
              PYTHONPATH=/tmp/comet-mcore timeout 300 torchrun --nproc-per-node "$(nvidia-smi -L | wc -l)" \
                  bench/megatron_peer.py --preset all --json "$OUT/megatron.json" > "$OUT/megatron.log" 2>&1
              grep -v "^\[\|[Ww]arn" "$OUT/megatron.log" | tail -8 ;;
    bandwidth) timeout 120 build/comet bandwidth 2>&1 | tee "$OUT/bandwidth.log" | tail -8 ;;
    tune) timeout 300 build/comet tune --preset all --no-check --out "$OUT/tuning.txt" > "$OUT/tune.log" 2>&1
          cat "$OUT/tuning.txt" ;;
    fp8) rows="^[a-z0-9.]+-[a-z0-9.-]+ " # a table row: it starts with a preset's name
         timeout 200 build/comet bench --fp8 --preset all > "$OUT/fp8-bench.log" 2>&1
         echo "comet bench --fp8 (exit $?):"; grep -E "$rows" "$OUT/fp8-bench.log" | cut -c1-110
         CUDA_VISIBLE_DEVICES=0 timeout 200 build/comet gemm --fp8 > "$OUT/fp8-gemm.log" 2>&1
         echo "comet gemm --fp8 (exit $?):"; grep -E "$rows" "$OUT/fp8-gemm.log" | cut -c1-140
         CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/torch_gemm.py --fp8 --ep 1 > "$OUT/fp8-torch-gemm.log" 2>&1
         echo "torch_gemm.py --fp8 (exit $?):"; tail -12 "$OUT/fp8-torch-gemm.log"
         CUDA_VISIBLE_DEVICES=0 timeout 100 build/comet gemm --fp8 --gemms forward > "$OUT/fp8-gemm-again.log" 2>&1
         echo "comet gemm --fp8 --gemms forward again (exit $?):"; grep -E "$rows" "$OUT/fp8-gemm-again.log" | cut -c1-140
         timeout 200 build/comet bench --fp8 --train --preset mixtral-8x7b,phi-3.5-moe,qwen2-57b-a14b,qwen2-moe-2.7b \
             --no-check --iters 10 > "$OUT/fp8-train.log" 2>&1
         echo "comet bench --fp8 --train (exit $?):"; grep -E "$rows" "$OUT/fp8-train.log" | cut -c1-160
         timeout 200 torchrun --nproc-per-node 1 bench/torch_peer.py --fp8 --preset all --tokens 8192 \
             > "$OUT/fp8-torch-layer.log" 2>&1
         echo "torch_peer.py --fp8 (exit $?):"; tail -8 "$OUT/fp8-torch-layer.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
