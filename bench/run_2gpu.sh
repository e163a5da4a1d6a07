#!/usr/bin/env bash
# Everything that needs two GPUs, in one call on a 2×H200 machine:
#   1. GPU tests: NCCL equivalence of N ranks with one process, the whole layer with Triton experts;
#   2. bench/all_to_all.py (dispatch + combine vs raw all_to_all_single), NCCL then P2P;
#   3. bench/train_gpu.sh (configs/ep2.yaml with NCCL, the OLMoE-shaped throughput benchmark).
# Logs and result tables go to $OUT (default /tmp/run_2gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/run_2gpu} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# one kernel config per shape: the NCCL test touches a dozen GEMM shapes in two dtypes, and
# autotuning all of them on a fresh machine ran past 100 s (2×H200)
MOE_AUTOTUNE=0 timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_parallel.py tests/test_moe_layer.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
[ "${ONLY_TESTS:-0}" = 1 ] && exit 0
timeout ${A2A_TIMEOUT:-120} python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/all_to_all.py \
    --out bench/results/all_to_all_nccl.md ${A2A_ARGS:-} > "$OUT/all_to_all_nccl.log" 2>&1; tail -14 "$OUT/all_to_all_nccl.log"
cp bench/results/all_to_all_nccl.md "$OUT/" 2>/dev/null
for flags in "" "--backward"; do  # the P2P (symmetric memory) dispatcher, forward then forward + backward
    timeout ${A2A_TIMEOUT:-120} python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/all_to_all.py \
        --transport p2p $flags --out "$OUT/all_to_all${flags:+_bwd}.md" > "$OUT/all_to_all.log" 2>&1
    tail -10 "$OUT/all_to_all.log"
done
# train_gpu.sh leaves many files; only its log and table come back (the tool returns 8 files)
OUT=/tmp/train_gpu EP2_STEPS=${EP2_STEPS:-60} RUN_TIMEOUT=${RUN_TIMEOUT:-900} bash bench/train_gpu.sh > "$OUT/train_gpu.log" 2>&1; tail -25 "$OUT/train_gpu.log"
cp /tmp/train_gpu/training.md "$OUT/" 2>/dev/null
