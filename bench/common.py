"""What the GPU benchmarks share: the results-file header and the alternating timing protocol
(used by bench/attention.py, bench/lm_loss.py, bench/moe_layer.py, bench/rope.py and
bench/master_weights.py; bench/grouped_gemm.py and bench/combine.py still write their own header
and average ours before and after the anchor), and the in-process trainer that
bench/step_profile.py and bench/master_weights.py time.

Protocol: per row, ``rounds`` rounds; each round
times every implementation once with ``triton.testing.do_bench(warmup, rep)`` (median), in the
same order, so slow drifts of clock or temperature hit all of them alike. A claim is the median
over rounds of ``t_anchor / t_ours`` (> 1: ours faster); ``ours_again`` (ours timed a second time
in the same round) gives the A-vs-A row, the noise floor of such a ratio.
"""

import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import sdpa_kernel


def header(title: str, script: str, *notes: str) -> list[str]:
    """Markdown lines: the title, then device, versions, today's date and the command line."""
    props = torch.cuda.get_device_properties(0)
    return [
        f"# {title}",
        "",
        f"- device: {props.name} ({props.multi_processor_count} SMs)",
        f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}, Python {platform.python_version()}",
        f"- date: {datetime.date.today().isoformat()}; command: `python {script} {' '.join(sys.argv[1:])}`",
        *(f"- {n}" for n in notes),
        "",
    ]


def alternate(fns: dict, rounds: int, warmup: int = 100, rep: int = 200) -> dict[str, list[float]]:
    """``{name: [ms per round]}``: each round runs every ``fns[name]`` through do_bench in order."""
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            times[n].append(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return times


def median_ratio(anchor_ms: list[float], ours_ms: list[float]) -> float:
    """Median over rounds of anchor / ours (> 1: ours faster)."""
    return statistics.median(a / o for a, o in zip(anchor_ms, ours_ms))


def round_to_round(times: list[float]) -> list[float]:
    """The A-vs-A ratios of one variant's rounds: each round's time over the round before."""
    return [x / y for x, y in zip(times[1:], times[:-1])]


def attention_flops(B, H, S, Hd, causal, mode):
    """An attention row's FLOPs: 4·B·H·S²·Hd forward (half when causal), 3.5× that fwd+bwd."""
    f = 4 * B * H * S * S * Hd / (2 if causal else 1)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def sdpa(backend):
    """``F.scaled_dot_product_attention`` held to one backend, as an attention implementation."""
    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def attention_runner(impl, q, k, v, do, causal, mode):
    """The call an attention row times: ``impl``'s forward, or forward and the q, k, v gradients."""
    if mode == "fwd":
        return lambda: impl(q, k, v, causal)
    return lambda: torch.autograd.grad(impl(q, k, v, causal), (q, k, v), do)


def write_results(path: str, md: str) -> None:
    """Write a results table (making its folder) and echo it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(md)
    print(md)


def write_row(path: str, md: list[str], row: str, append: bool) -> None:
    """Write the table ``md`` (header lines) with ``row``; ``append``: add ``row`` to the table
    already at ``path`` instead (its header keeps the command of the run that wrote it)."""
    if append and os.path.exists(path):
        with open(path) as f:
            md = f.read().rstrip("\n").split("\n")
        rules = [line for line in md if line.startswith("|---") or line.startswith("| ---")]
        if not rules or rules[-1].count("|") != row.count("|"):
            raise ValueError(f"--append: the last table in {path} has "
                             f"{rules[-1].count('|') - 1 if rules else 0} columns, this row "
                             f"{row.count('|') - 1}; write a new table (no --append) or another --out")
    write_results(path, "\n".join([*md, row]) + "\n")


def trainer_mfu(trainer, step_s: float) -> float:
    """The model FLOPs utilisation of ``trainer``'s steps at ``step_s`` seconds a step (train/flops.py)."""
    return trainer.tokens_per_step / step_s * trainer.flops_per_token / (trainer.rt.world_size * trainer.peak)


def step_cells(trainer, anchor_s: list[float], ours_s: list[float]) -> dict[str, str]:
    """A step benchmark's table cells from each round's seconds a step of the anchor and ours:
    their medians in ms, the median per-round ratio (bold), the anchor's A-vs-A ratios, and
    ours' tokens/s and MFU."""
    ours = statistics.median(ours_s)
    return {
        "anchor": f"{statistics.median(anchor_s) * 1e3:.1f}", "ours": f"{ours * 1e3:.1f}",
        "ratio": f"**{median_ratio(anchor_s, ours_s):.3f}**",
        "a_vs_a": ", ".join(f"{r:.3f}" for r in round_to_round(anchor_s)),
        "tokens_s": f"{trainer.tokens_per_step / ours:,.0f}", "mfu": f"{100 * trainer_mfu(trainer, ours):.1f}%",
    }


def _job_id() -> str:
    """The same string on every rank of one job and a different one for another job, so that the
    ranks agree on the run folder (the trainer checks that they agree on the config) and two jobs
    never clear each other's: torchrun's run id (``--standalone`` draws one; a plain torchrun's is
    "none"), else the rendezvous port, else this process's id (no torchrun)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return run_id
    return f"port{os.environ['MASTER_PORT']}" if "MASTER_PORT" in os.environ else f"pid{os.getpid()}"


def timed_steps(trainer, steps: int) -> float:
    """Milliseconds per optimizer step over ``steps`` steps after one untimed step, the slowest
    rank's, without the profiler."""
    import torch.distributed as dist

    from train.trainer import planned_gc

    with planned_gc(trainer.cfg.train.gc_every):  # the garbage collection as the training loop does it
        trainer.train_step()  # (its first full collection, on entry, is not timed)
        if trainer.rt.distributed:
            dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
            trainer.collect_garbage()
        torch.cuda.synchronize()
    ms = torch.tensor((time.perf_counter() - t0) / steps * 1e3, device=trainer.rt.device)
    if trainer.rt.distributed:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def bench_trainer(config: str, steps: int, extra: list[str]):
    """A :class:`train.trainer.Trainer` built in this process to be timed: ``config`` with the
    ``extra`` overrides and ``train.steps=steps``, no logged windows, validation, checkpoints or
    wandb, its run folder in the temporary directory, one per job (:func:`_job_id`). Call with the
    project root on ``sys.path`` (the kernel benchmarks that use this module never load the
    training stack)."""
    from train.config import load_config
    from train.trainer import Trainer

    log_dir = os.path.join(tempfile.gettempdir(), f"bench_trainer_{_job_id()}")
    argv = ["--config", config, f"--train.steps={steps}", "--log.wandb_mode=disabled", "--log.progress=false",
            "--log.every=1000000", "--train.eval_every=0", "--checkpoint.every=0", f"--log.dir={log_dir}",
            "--log.overwrite=true", *extra]
    return Trainer(load_config(argv, int(os.environ.get("WORLD_SIZE", "1"))), argv)
