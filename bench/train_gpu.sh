#!/usr/bin/env bash
# Training on 2 GPUs with NCCL: configs/ep2.yaml (EP=2, a short run) and the OLMoE-shaped
# throughput benchmark configs/olmoe_bench.yaml (EP=2), then bench/results/training.md from
# their logs (tokens/s, MFU, memory, losses, MoE health).
#
#   bash bench/train_gpu.sh     # on a 2-GPU machine; logs under $OUT (default /tmp/train_gpu)
# (python3 -m torch.distributed.run is torchrun, spelled so it needs no venv bin/ on PATH)
#
# Nothing needs a network: wandb is used offline when installed, skipped when not.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/train_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# run directories (checkpoints are GBs) stay off $OUT; only their logs are copied there at the end
RUNS=${RUNS:-/tmp/train_gpu_runs}
rm -rf "$RUNS"
python3 -c 'import torch; print("GPUs:", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'

# EP2_STEPS, BENCH_ARGS (extra --section.key=value overrides) and RUN_TIMEOUT (seconds per run)
# shorten the runs when device time is short
EP2_STEPS=${EP2_STEPS:-60}
EP2_CMD="python3 -m torch.distributed.run --standalone --nproc_per_node=2 train/train.py --config configs/ep2.yaml --train.steps=$EP2_STEPS --train.eval_every=$((EP2_STEPS / 2)) --checkpoint.every=$((EP2_STEPS / 2)) --log.dir=$RUNS"
echo "== $EP2_CMD"
timeout "${RUN_TIMEOUT:-900}" $EP2_CMD 2>&1 | tee "$OUT/ep2.log"

BENCH_CMD="python3 -m torch.distributed.run --standalone --nproc_per_node=2 train/train.py --config configs/olmoe_bench.yaml --log.dir=$RUNS ${BENCH_ARGS:-}"
echo "== $BENCH_CMD"
if ! timeout "${RUN_TIMEOUT:-900}" $BENCH_CMD 2>&1 | tee "$OUT/olmoe_bench.log"; then
    if grep -q "OutOfMemoryError\|CUDA out of memory" "$OUT/olmoe_bench.log"; then
        BENCH_CMD="$BENCH_CMD --data.batch_size=2"
        echo "== out of memory at 4 sequences per GPU; retrying: $BENCH_CMD"
        timeout "${RUN_TIMEOUT:-900}" $BENCH_CMD 2>&1 | tee "$OUT/olmoe_bench_b2.log"
    else
        exit 1
    fi
fi

python3 -m train.report "$RUNS/ep2" "$RUNS/olmoe_bench" --skip-steps 10 \
    --command "bash bench/train_gpu.sh  # runs: $EP2_CMD ; $BENCH_CMD" \
    --out bench/results/training.md | tee "$OUT/training.md"
for run in ep2 olmoe_bench; do
    mkdir -p "$OUT/runs/$run"
    cp -r "$RUNS/$run"/{metrics.jsonl,run_info.json,config.yaml,heatmaps} "$OUT/runs/$run/" 2>/dev/null || true
done
ls -la "$RUNS/ep2/checkpoints" || true
