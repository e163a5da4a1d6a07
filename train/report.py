"""Markdown summary of training runs from their ``run_info.json`` and ``metrics.jsonl``.

    python -m train.report RUN_DIR [RUN_DIR ...] --out bench/results/training.md --skip-steps 10

Throughput and MFU are the medians over the log windows that end after ``--skip-steps`` (the
first windows include Triton autotuning and the CUDA caching allocator's warm-up).

Runs logged with ``log.time_comm`` add the all-to-all time per step and its share of the step
time. ``--baseline RUN`` (a run directory's name) adds tokens/s per GPU and the weak-scaling
efficiency of every run: its tokens/s per GPU / the baseline's.
"""

import argparse
import json
import os
import statistics

from train.plots import read_metrics


def summarize(run_dir: str, skip_steps: int) -> dict:
    with open(os.path.join(run_dir, "run_info.json")) as f:
        info = json.load(f)
    recs = read_metrics(os.path.join(run_dir, "metrics.jsonl"))  # a null (non-finite) value read as NaN
    train = [r for r in recs if "train/loss" in r]
    val = [r for r in recs if "val/loss" in r]
    steady = [r for r in train if r["step"] > skip_steps] or train

    def med(key):
        vals = [r[key] for r in steady if key in r]
        return statistics.median(vals) if vals else float("nan")

    mem = [r.get("perf/max_mem_gb", r.get("perf/max_rss_gb", float("nan"))) for r in train]
    return {
        "run": os.path.basename(os.path.normpath(run_dir)), "info": info,
        "steps": train[-1]["step"] if train else 0, "windows": len(steady),
        "tokens_per_s": med("perf/tokens_per_s"), "mfu": med("perf/mfu"), "step_time_s": med("perf/step_time_s"),
        "max_mem_gb": max(mem) if mem else float("nan"),
        "loss_first": train[0]["train/loss"] if train else float("nan"),
        "loss_last": train[-1]["train/loss"] if train else float("nan"),
        "val_first": val[0]["val/loss"] if val else float("nan"),
        "val_last": val[-1]["val/loss"] if val else float("nan"),
        "dropped": train[-1].get("moe/dropped_fraction", float("nan")) if train else float("nan"),
        "tile_util": train[-1].get("moe/tile_utilization", float("nan")) if train else float("nan"),
        "imbalance": train[-1].get("moe/load_imbalance", float("nan")) if train else float("nan"),
        "a2a_ms": med("time/all_to_all_ms"), "a2a_fraction": med("time/all_to_all_fraction"),
    }


def _extra_columns(runs: list[dict], baseline: str | None) -> list[tuple[str, object]]:
    """(header, run -> cell) of the optional columns: weak scaling, all-to-all time."""
    cols = []
    if baseline is not None:
        base = [r for r in runs if r["run"] == baseline]
        if not base:
            raise ValueError(f"--baseline {baseline!r} is none of the runs {[r['run'] for r in runs]}")
        base_per_gpu = base[0]["tokens_per_s"] / base[0]["info"]["world_size"]
        cols.append(("tokens/s per GPU", lambda r: f"{r['tokens_per_s'] / r['info']['world_size']:,.0f}"))
        cols.append((f"weak scaling vs {baseline}",
                     lambda r: f"{r['tokens_per_s'] / r['info']['world_size'] / base_per_gpu:.1%}"))
    if any(r["a2a_ms"] == r["a2a_ms"] for r in runs):  # NaN != NaN: a run without the timing
        cols.append(("all-to-all ms/step", lambda r: f"{r['a2a_ms']:.1f}"))
        cols.append(("all-to-all share of step", lambda r: f"{r['a2a_fraction']:.1%}"))
    return cols


def to_markdown(runs: list[dict], command: str | None, skip_steps: int, title: str = "Training runs",
                baseline: str | None = None) -> str:
    first = runs[0]["info"]
    extra = _extra_columns(runs, baseline)
    lines = [
        f"# {title}",
        "",
        f"Device: {first['device']} × {first['world_size']} | torch {first['torch']} | triton {first['triton']} | "
        f"Python {first['python']} | {first['date']}",
        "",
    ]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += [
        f"tokens/s and MFU: medians over the log windows ending after step {skip_steps}. MFU = tokens/s × "
        "training FLOPs per token (3 × forward, active parameters incl. causal attention scores, see "
        "train/flops.py) / (GPUs × peak dense bf16 FLOP/s).",
        "",
        "| run | world / EP | params total / active | tokens/step | steps | tokens/s (all GPUs) | step s | MFU | max mem GB/GPU | train loss first → last | val loss first → last | dropped | tile util | load max/mean |"
        + "".join(f" {h} |" for h, _ in extra),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra),
    ]
    for r in runs:
        i = r["info"]
        lines.append(
            f"| {r['run']} | {i['world_size']} / {i['ep']} | {i['params_total'] / 1e9:.2f}B / {i['params_active'] / 1e9:.2f}B | "
            f"{i['tokens_per_step']} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['step_time_s']:.3f} | {r['mfu']:.3f} | "
            f"{r['max_mem_gb']:.1f} | {r['loss_first']:.3f} → {r['loss_last']:.3f} | {r['val_first']:.3f} → {r['val_last']:.3f} | "
            f"{r['dropped']:.4f} | {r['tile_util']:.3f} | {r['imbalance']:.2f} |"
            + "".join(f" {cell(r)} |" for _, cell in extra)
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--skip-steps", type=int, default=10)
    p.add_argument("--command", default=None)
    p.add_argument("--title", default="Training runs")
    p.add_argument("--baseline", default=None, help="run name for tokens/s per GPU and weak-scaling efficiency")
    args = p.parse_args()
    runs = [summarize(r, args.skip_steps) for r in args.runs]
    md = to_markdown(runs, args.command, args.skip_steps, args.title, args.baseline)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
