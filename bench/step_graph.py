"""Training step time with ``train.cuda_graph`` (each micro-batch one replay of a captured CUDA
graph, train/step_graph.py) against the eager step, two trainers in one process, alternated.

    python bench/step_graph.py --rounds 5 [--append] -- --model.n_layers=4 --parallel.ep=1 --train.grad_accum=8

Both trainers are ``configs/olmoe_bench.yaml`` with the overrides given and the same seed; the
graph one captures in its second step. Rounds alternate ``--steps`` timed optimizer steps of
the eager trainer (the anchor) and the graphed one; the claim is the median over rounds of eager
/ graphed step time, the A-vs-A column the eager trainer's round-to-round ratio. The loss of
one more step of each is printed side by side (the two runs see the same batches, so they
agree bit for bit: tests/test_step_graph.py). ``resident GB``: each trainer's growth in
allocated / reserved memory while it was built and ran its first two steps; the allocated
growth is the one to compare (the graph one keeps its gradients and the experts' bf16 copies
between steps), the reserved one depends on the build order (the second trainer reuses blocks
the first one's cache freed).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bench_trainer, header, step_cells, timed_steps, write_row  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/olmoe_bench.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per round and trainer")
    ap.add_argument("--append", action="store_true", help="add the row to an existing --out table")
    ap.add_argument("--out", default="bench/results/step_graph.md")
    args, extra = ap.parse_known_args()
    extra = [e for e in extra if e != "--"]
    md = header("Training step: captured CUDA graph per micro-batch vs eager", "bench/step_graph.py",
                f"model: {args.config} with the row's overrides",
                f"{args.rounds} rounds alternating eager / graphed, {args.steps} timed optimizer steps each (one "
                "untimed step before), two trainers in one process; ratio = median over rounds of eager / graphed step time "
                "(> 1: the graph faster)")
    md += ["| overrides | tokens/step | eager ms/step | graphed ms/step | eager / graphed | A-vs-A (eager) | "
           "graphed tokens/s | graphed MFU | resident GB eager | resident GB graphed |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    trainers, resident = {}, {}
    for name, options in (("eager", []), ("graphed", ["--train.cuda_graph=true"])):
        before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        trainers[name] = bench_trainer(args.config, 1_000_000, [*extra, *options, f"--log.run_name={name}"])
        for _ in range(2):  # autotuning, the allocator's warm-up, the capture
            trainers[name].train_step()
        torch.cuda.synchronize()
        resident[name] = "/".join(f"{(now - was) / 1e9:.1f}" for now, was in
                                  zip((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()), before))
    times = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            times[name].append(timed_steps(trainer, args.steps) / 1e3)
    losses = {name: float(t.train_step().losses[0]) for name, t in trainers.items()}
    print(f"the next step's loss: eager {losses['eager']!r}, graphed {losses['graphed']!r}", flush=True)
    graphed = trainers["graphed"]
    c = step_cells(graphed, times["eager"], times["graphed"])
    row = (f"| `{' '.join(extra)}` | {graphed.tokens_per_step:,} | {c['anchor']} | {c['ours']} | {c['ratio']} | "
           f"{c['a_vs_a']} | {c['tokens_s']} | {c['mfu']} | {resident['eager']} | {resident['graphed']} |")
    write_row(args.out, md, row, args.append)
    for trainer in trainers.values():
        trainer.close()


if __name__ == "__main__":
    main()
