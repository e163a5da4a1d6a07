"""The host's time per training step, apart from the GPU's: a config's step at tiny dims.

Why: on 2×H200 the olmoe_bench step (EP 2, P2P, 8 micro-batches) is host-bound on one rank or
the other (bench/results/step_profile.md: the late rank's GPU idles in hundreds of 0.1-1 ms
gaps and the other waits in the exchange). Its host time cannot be read off that step, where
the host also waits for a full launch queue. The same model at tiny widths (the same layers,
experts, top-k, tokens and micro-batches, so the same launches and Python; ``--model.dim``
256, 2 heads of 128, experts 128 wide by default) leaves the GPU idle most of the time, so
its step time is the host's.

Prints, per rank, the step time (mean of ``--timed`` steps, the slowest rank), the wall and
process CPU time of 3 more steps, and with ``--profile N`` cProfile's N functions of most own
time over 2 steps (to ``--out-dir``/host_profile_rank<r>.txt); the last line is a ``SUMMARY`` row
for a driver's table.

    torchrun --standalone --nproc_per_node=2 bench/host_step.py --config configs/olmoe_bench.yaml \\
        --label "this tree" -- --parallel.dispatcher=p2p --parallel.data_parallel=replicate --train.grad_accum=8
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import bench_trainer, timed_steps  # noqa: E402
from train.trainer import planned_gc  # noqa: E402

TINY = ["--model.dim=256", "--model.n_heads=2", "--moe.hidden_dim=128"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--timed", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's N functions of most own time")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--full", action="store_true", help="the config's own dims (the host then also waits for the GPU)")
    args, extra = ap.parse_known_args()
    extra = [e for e in extra if e != "--"]
    trainer = bench_trainer(args.config, args.warm + args.timed + 6, (TINY if not args.full else []) + extra)
    rt = trainer.rt
    for _ in range(args.warm):
        trainer.train_step()
    step_ms = timed_steps(trainer, args.timed)
    with planned_gc(trainer.cfg.train.gc_every):
        torch.cuda.synchronize()
        if rt.distributed:
            dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(3):
            trainer.train_step()
            trainer.collect_garbage()
        wall, cpu = ((time.perf_counter() - wall) / 3 * 1e3, (time.process_time() - cpu) / 3 * 1e3)
        torch.cuda.synchronize()
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(2):
                trainer.train_step()
                trainer.collect_garbage()
            torch.cuda.synchronize()
            profile.disable()
            text = io.StringIO()
            text.write(f"rank {rt.rank} {args.label}: cProfile of 2 steps\n")
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile)
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, f"host_profile_rank{rt.rank}.txt"), "w") as f:
                f.write(text.getvalue())
    print(f"rank {rt.rank}: step {step_ms:.1f} ms (slowest rank), own wall {wall:.1f} ms, process CPU {cpu:.1f} ms",
          flush=True)
    if rt.rank == 0:
        dims = "full" if args.full else "tiny"
        print(f"SUMMARY | {args.label} | {dims} | {step_ms:.1f} | {wall:.1f} | {cpu:.1f} |", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
