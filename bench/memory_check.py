"""The memory model against real training runs: predicted (train/memory.py) vs measured peak memory
per GPU, as a markdown table.

    python bench/memory_check.py --gpus 1                       # the 1-GPU cases
    python bench/memory_check.py --gpus 2 --out bench/results/memory.md
    python bench/memory_check.py --gpus 2 --only olmoe_bench olmoe_bench_fsdp --steps 8

Each case trains a few steps through the real trainer (``torchrun -m train``, NCCL, bf16 autocast)
and logs ``perf/max_mem_gb`` (``torch.cuda.max_memory_allocated`` in GiB) every step in
``<runs>/<case>/metrics.jsonl``; the largest value over the run is compared with
:func:`train.memory.predict` for the same config and world. The prediction's P2P symmetric
memory is outside PyTorch's caching allocator, so the compared column leaves it out.

The model assumes balanced routing; these runs train on bytes, whose routing is skewed (a rank's
experts can receive more than T·K rows), so the table also shows the last logged load max/mean
and dropped fraction: a measured value above the prediction with a high imbalance is the routing,
not the formula. The table also gives each case's throughput (median logged tokens/s and MFU of
the steps after the third), so one run answers what a layout costs in memory and in speed.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train import memory  # noqa: E402
from train.config import load_config  # noqa: E402

SMALL = ["--config", "configs/small.yaml"]
OLMOE = ["--config", "configs/olmoe_bench.yaml"]
# name -> (GPUs, overrides); every case runs on one node
CASES = {
    "small": (1, SMALL),
    "small_selective": (1, SMALL + ["--train.activation_checkpointing=selective"]),
    "small_full": (1, SMALL + ["--train.activation_checkpointing=full"]),
    # the OLMoE-shaped model cut to 4 blocks, so its 16 bytes per parameter fit one GPU
    "olmoe4": (1, OLMOE + ["--parallel.ep=1", "--model.n_layers=4"]),
    "olmoe4_selective": (1, OLMOE + ["--parallel.ep=1", "--model.n_layers=4", "--train.activation_checkpointing=selective"]),
    "ep2": (2, ["--config", "configs/ep2.yaml", "--parallel.data_parallel=replicate"]),
    "ep2_fsdp": (2, ["--config", "configs/ep2.yaml", "--parallel.data_parallel=fsdp"]),
    "ep2_p2p": (2, ["--config", "configs/ep2_p2p.yaml"]),
    "olmoe_bench": (2, OLMOE + ["--parallel.data_parallel=replicate"]),
    "olmoe_bench_selective": (2, OLMOE + ["--parallel.data_parallel=replicate", "--train.activation_checkpointing=selective"]),
    "olmoe_bench_fsdp": (2, OLMOE + ["--parallel.data_parallel=fsdp"]),
    "olmoe_bench_fsdp_zero2": (2, OLMOE + ["--parallel.data_parallel=fsdp", "--parallel.reshard_after_forward=false"]),
    "olmoe_bench_fsdp_selective": (2, OLMOE + ["--parallel.data_parallel=fsdp", "--train.activation_checkpointing=selective"]),
    "olmoe_bench_fsdp_full": (2, OLMOE + ["--parallel.data_parallel=fsdp", "--train.activation_checkpointing=full"]),
    # EP 1 × DP 2: replicated, the 6.9B model's fp32 state alone is ~103 GiB per GPU
    "olmoe_ep1_fsdp": (2, OLMOE + ["--parallel.ep=1", "--parallel.data_parallel=fsdp"]),
    "olmoe_ep1_fsdp_selective": (2, OLMOE + ["--parallel.ep=1", "--parallel.data_parallel=fsdp",
                                             "--train.activation_checkpointing=selective"]),
    # the deepest OLMoE-width model at EP 2 on 2×H200, as the memory model predicts it (limits
    # ~31 blocks replicated, ~41 with FSDP and full checkpointing)
    "olmoe30_replicate": (2, OLMOE + ["--model.n_layers=30", "--parallel.data_parallel=replicate"]),
    "olmoe40_fsdp_full": (2, OLMOE + ["--model.n_layers=40", "--parallel.data_parallel=fsdp",
                                      "--train.activation_checkpointing=full"]),
}


def run_case(name: str, gpus: int, overrides: list[str], steps: int, runs: str, timeout: int) -> dict:
    """Train ``steps`` steps of the case; its metrics.jsonl records (empty when the run failed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m", "train",
           *overrides, f"--train.steps={steps}", "--train.eval_every=0", "--data.val_batches=1", "--log.every=1",
           "--log.heatmap_every=0", "--log.wandb_mode=disabled", "--log.progress=false", "--checkpoint.every=0",
           "--checkpoint.resume=none", f"--log.dir={runs}", f"--log.run_name={name}"]
    print("==", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    print(f"   exit {proc.returncode} after {time.perf_counter() - start:.0f} s", flush=True)
    if proc.returncode:
        print(proc.stdout[-2000:] + proc.stderr[-4000:], flush=True)
        return {}
    with open(os.path.join(runs, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if "perf/max_mem_gb" in r]
    last = train[-1] if train else {}
    # throughput: the median step after the first three (autotuning, allocator warm-up)
    steady = sorted(r["perf/tokens_per_s"] for r in train[3:]) or [float("nan")]
    mfu = sorted(r["perf/mfu"] for r in train[3:]) or [float("nan")]
    return {"measured_gib": max((r["perf/max_mem_gb"] for r in train), default=float("nan")),
            "tokens_per_s": steady[len(steady) // 2], "mfu": mfu[len(mfu) // 2],
            "imbalance": last.get("moe/load_imbalance", float("nan")),
            "dropped": last.get("moe/dropped_fraction", float("nan"))}


def predicted(gpus: int, overrides: list[str]) -> memory.Prediction:
    cfg = load_config(overrides, world_size=gpus)
    lay = memory.layout_of(cfg, gpus, cfg.parallel.data_parallel, cfg.train.activation_checkpointing)
    # the numerics of the torch the runs use (2.11's autocast keeps rms_norm in bf16)
    return memory.predict(cfg, lay, num=memory.gpu_numerics(torch.__version__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, choices=(1, 2), required=True, help="run the cases of this many GPUs")
    parser.add_argument("--only", nargs="*", help="these cases only")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", default="/tmp/memory_check_runs", help="run directories")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    import torch

    cases = {n: c for n, c in CASES.items() if c[0] == args.gpus and (not args.only or n in args.only)}
    lines = [
        f"Device: {torch.cuda.get_device_name(0)} × {args.gpus} | torch {torch.__version__} | {args.steps} steps per case",
        "",
        "| case | data parallel | AC | predicted GiB | of it in the allocator | measured GiB | measured / predicted "
        "| predicted peak at | tokens/s | MFU | load max/mean | dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (gpus, overrides) in cases.items():
        pred = predicted(gpus, overrides)
        in_allocator = (pred.peak.total - pred.outside_allocator) / memory.GiB
        got = run_case(name, gpus, overrides, args.steps, args.runs, args.timeout)
        measured = got.get("measured_gib", float("nan"))
        lay = pred.layout
        lines.append(
            f"| {name} | {lay.data_parallel} | {lay.checkpointing} | {pred.peak.total / memory.GiB:.2f} | "
            f"{in_allocator:.2f} | {measured:.2f} | {measured / in_allocator:.3f} | {pred.peak.name} | "
            f"{got.get('tokens_per_s', float('nan')):,.0f} | {100 * got.get('mfu', float('nan')):.1f}% | "
            f"{got.get('imbalance', float('nan')):.2f} | {got.get('dropped', float('nan')):.3f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
