"""Training step time with the experts' master-weight step (``moe.master_weight_step``: the fp32
weights cast once per optimizer step, gradients added into ``.grad`` in one pass or, for the
SwiGLU MLP on Hopper, in the wgrad kernel's epilogue) against the plain per-micro-batch
``w.to(bf16)``, in one trainer, alternated; ``two-pass``: the master-weight step without that
epilogue (the 16-bit weight gradient written, then added by a second pass); ``tma-fp32``: the
epilogue always in the Triton TMA kernel (``grouped_mm_wgrad_gluon.FP32_ROUTED`` off), where
``wgrad_gluon_ok`` would route it to the Gluon one.

    torchrun --standalone --nproc_per_node=1 bench/master_weights.py --accum 16 --rounds 5 [--append] \
        --model.n_layers=6 --parallel.ep=1 --data.tokenizer=bytes

One process builds the trainer once (``configs/olmoe_bench.yaml`` plus the overrides given, with
``--accum`` micro-batches a step) and alternates rounds of ``--steps`` timed optimizer steps with
the anchor (the trainer's loop with ``master_weight_step`` replaced by a no-op), two-pass and ours. Timed
without the profiler, which inflates a host-bound step (bench/step_profile.py's idle column). The
claim is the median over rounds of anchor / ours; the A-vs-A column is the anchor's round-to-round
ratio. MFU as the trainer logs it (train/flops.py). ``--append`` adds the row to the table a run
with another ``--accum`` wrote (its header keeps that run's command).
"""

import argparse
import contextlib
import functools
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import train.trainer as trainer_module  # noqa: E402
from moe import master_weight_step  # noqa: E402

# the module, not the function moe.kernels re-exports under the same name
grouped_mm_module = importlib.import_module("moe.kernels.grouped_mm")
wgrad_gluon_module = importlib.import_module("moe.kernels.grouped_mm_wgrad_gluon")


@contextlib.contextmanager
def patched_step(module, name, value, model, keep_copies=False):
    """``master_weight_step`` with ``module.name`` set to ``value`` inside (a variant's switch)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        with master_weight_step(model, keep_copies=keep_copies):
            yield
    finally:
        setattr(module, name, saved)


# Each is called as the trainer calls master_weight_step (train/trainer.py: keep_copies given).
VARIANTS = {
    "anchor": lambda model, keep_copies=False: contextlib.nullcontext(),
    # the SwiGLU MLP's weight gradients rounded to 16 bits, then added by a second pass
    "two_pass": functools.partial(patched_step, grouped_mm_module, "master_of", lambda copy: None),
    # the fp32 master-gradient epilogue kept in the Triton TMA kernel
    "tma_fp32": functools.partial(patched_step, wgrad_gluon_module, "FP32_ROUTED", False),
    "ours": master_weight_step,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/olmoe_bench.yaml")
    ap.add_argument("--accum", type=int, default=16, help="micro-batches per optimizer step")
    ap.add_argument("--append", action="store_true", help="add the row to an existing --out table")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per round and variant")
    ap.add_argument("--out", default="bench/results/master_weights.md")
    args, extra = ap.parse_known_args()
    from common import bench_trainer, header, step_cells, timed_steps, write_row

    md = header("Experts' master-weight step vs the per-micro-batch cast, training steps", "bench/master_weights.py",
                f"model: {args.config} with {' '.join(extra) or 'no overrides'}",
                f"{args.rounds} rounds alternating anchor / two-pass / tma-fp32 / ours, {args.steps} timed optimizer steps each (one "
                "untimed step before), one trainer; ratio = median over rounds of the other's / ours step time (> 1: "
                "ours faster)")
    md += ["| grad accum | tokens/step | anchor ms/step | two-pass ms/step | tma-fp32 ms/step | ours ms/step | anchor / ours "
           "| two-pass / ours | tma-fp32 / ours | A-vs-A | ours tokens/s | ours MFU | peak GB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    trainer = bench_trainer(args.config, 1_000_000, [f"--train.grad_accum={args.accum}", *extra])
    for _ in range(2):  # autotuning and allocator warm-up
        trainer.train_step()
    torch.cuda.reset_peak_memory_stats()
    times = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, step_context in VARIANTS.items():
            trainer_module.master_weight_step = step_context
            times[name].append(timed_steps(trainer, args.steps) / 1e3)
    c = step_cells(trainer, times["anchor"], times["ours"])
    two_pass = step_cells(trainer, times["two_pass"], times["ours"])
    tma_fp32 = step_cells(trainer, times["tma_fp32"], times["ours"])
    row = (f"| {args.accum} | {trainer.tokens_per_step:,} | {c['anchor']} | {two_pass['anchor']} | {tma_fp32['anchor']} | "
           f"{c['ours']} | {c['ratio']} | {two_pass['ratio']} | {tma_fp32['ratio']} | {c['a_vs_a']} | {c['tokens_s']} | {c['mfu']} | "
           f"{torch.cuda.max_memory_allocated() / 1e9:.1f} |")
    write_row(args.out, md, row, args.append)


if __name__ == "__main__":
    main()
