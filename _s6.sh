#!/usr/bin/env bash
# session 9, call 6: the last wave's cut (branch wip/tail-split): GEMM tests, skewed mixtral 1024 with timelines, sweep, layer tests
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_HOME=$(python3 -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])")
L=$OUT/log.txt
grep -q "$NCCL_HOME" build/nccl.mk 2>/dev/null || make clean > /dev/null
make -j32 > $OUT/build.txt 2>&1 || { tail -20 $OUT/build.txt; exit 1; }
timeout 60 build/comet_tests -v gemm_tail_plan gpu_gemm > $OUT/tests1.txt 2>&1
grep -E "^(PASS|FAIL|[0-9]+ passed)|units|stalled|CHECK" $OUT/tests1.txt | head -30 >> $L
COMET_TRACE=1 timeout 60 build/comet bench --preset mixtral-8x7b,qwen2-moe-2.7b --tokens 1024 --routing skewed --no-check > $OUT/bench_1024s.txt 2>&1
grep -E "comet   |layer0 \(|layer1 \(|timeline, rank" $OUT/bench_1024s.txt | cut -c1-300 >> $L
CUDA_VISIBLE_DEVICES=0 COMET_GEMM_SWEEP=1 timeout 60 build/comet gemm --preset mixtral-8x7b,qwen2-57b-a14b > $OUT/sweep.txt 2>&1
grep -E "GEMM1 .*splits 1 (cut|no cut) *:|^(mixtral|qwen)" $OUT/sweep.txt | grep -E "static  splits 1 |dynamic splits 1 |^(mixtral|qwen)" >> $L
timeout 200 build/comet_tests gpu_layer0 gpu_layer1 gpu_forward > $OUT/tests2.txt 2>&1
grep -E "^(PASS|FAIL|[0-9]+ passed)" $OUT/tests2.txt >> $L
cat $L
