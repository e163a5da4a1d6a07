"""A run's figures, drawn with matplotlib: the expert-load heatmap and the one-page summary
``report.png``; and ``read_metrics``, the reader of the ``metrics.jsonl`` that train/logger.py writes.

    python -m train.plots RUN_DIR        # (re)draw RUN_DIR/report.png from RUN_DIR/metrics.jsonl

matplotlib is imported on first use (about 1.5 s): importing the logger, or this module, stays
cheap. Figures are drawn on an Agg canvas of their own (``Figure`` + ``FigureCanvasAgg``), never
through pyplot: no backend is selected for the process, no figure stays registered over a long
run, and a user's own matplotlib setup in the same process is left alone.

Shapes: L = MoE layers, E = experts, N = logged steps of one metric.
"""

import argparse
import json
import math
import os
import re

import numpy as np

HEATMAP_LABEL = "kept pairs / layer mean\n(1 = balanced)"  # two lines: fits a figure of few layers
_LAYER_KEY = re.compile(r"moe/layer(\d+)/")


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl``, in file order, a null value (written for a NaN or an
    infinity) read back as NaN. A line that does not parse (the last one, torn by a crash) or
    has no integer ``step`` is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append({k: math.nan if v is None else v for k, v in record.items()})
    return records


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path: str, dpi: int = 100) -> str:
    """Write ``fig`` as a PNG at ``path`` (its directory made if missing); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def expert_load_figure(kept_LE: np.ndarray, layer_names: list[str], step: int):
    """The expert-load heatmap: one row per MoE layer (labelled ``L<i> <name>``, the ``L<i>`` of
    the console line and of ``moe/layer<i>/...``), one column per expert, colour = the expert's
    kept (token, slot) pairs / its layer's mean: blue idle, white balanced, red 2× the mean or
    more. Returns the matplotlib Figure (its image data is that ratio, unclipped)."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    kept_LE = np.asarray(kept_LE, dtype=np.float64)
    n_layers, n_experts = kept_LE.shape
    mean_L1 = kept_LE.mean(axis=1, keepdims=True)
    # a layer that kept nothing is shown balanced, not divided by zero
    ratio_LE = np.divide(kept_LE, mean_L1, out=np.ones_like(kept_LE), where=mean_L1 > 0)
    fig = _figure(min(16.0, 3.5 + 0.22 * n_experts), min(12.0, 1.8 + 0.3 * n_layers))
    ax = fig.add_subplot()
    # 0..2 centred at 1, so that idle and overloaded experts are equally far from white;
    # a ratio above 2 takes the end colour (the colour bar's arrow)
    image = ax.imshow(ratio_LE, cmap="RdBu_r", norm=TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=2.0),
                      aspect="auto", interpolation="nearest")
    ax.set_yticks(range(n_layers), [f"L{i} {name}" for i, name in enumerate(layer_names)])
    if n_experts <= 32:
        ax.set_xticks(range(n_experts))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"expert load at step {step}")
    fig.colorbar(image, ax=ax, extend="max", label=HEATMAP_LABEL)
    return fig


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps_N, values_N) of ``key``, by step; a step logged twice (a file that a resume
    appended to without truncating) keeps its later value."""
    by_step = {r["step"]: r[key] for r in records if key in r}
    steps_N = np.array(sorted(by_step), dtype=np.int64)
    return steps_N, np.array([by_step[s] for s in steps_N], dtype=np.float64)


def _plot(ax, records: list[dict], key: str, **style) -> bool:
    steps_N, values_N = _series(records, key)
    if len(steps_N) == 1:  # one point draws no line
        style.setdefault("marker", "o")
    if len(steps_N):
        ax.plot(steps_N, values_N, **style)
    return len(steps_N) > 0


def _panel(ax, title: str, ylabel: str, drew: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if not drew:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
        return
    labels = ax.get_legend_handles_labels()[1]
    if len(labels) > 1:
        ax.legend(fontsize="small", ncols=1 + len(labels) // 9)


def summary_figure(records: list[dict], title: str):
    """The one-page run summary of ``records`` (as read by :func:`read_metrics`): train and val
    loss, tokens/s, the dropped fraction and the load max/mean of every MoE layer, by step.
    Returns the matplotlib Figure."""
    layers = sorted({int(m.group(1)) for r in records for k in r if (m := _LAYER_KEY.match(k))})
    fig = _figure(12.0, 8.0)
    (loss, tok), (drop, load) = fig.subplots(2, 2)

    drew = _plot(loss, records, "train/loss", label="train", linewidth=1)
    drew |= _plot(loss, records, "val/loss", label="val", marker="o", markersize=3)
    _panel(loss, "loss", "cross-entropy (nats/token)", drew)

    _panel(tok, "throughput", "tokens/s (all ranks)", _plot(tok, records, "perf/tokens_per_s", linewidth=1))

    drew = _plot(drop, records, "moe/dropped_fraction", label="all layers", color="black", linestyle="--")
    for i in layers:
        drew |= _plot(drop, records, f"moe/layer{i}/dropped_fraction", label=f"L{i}", linewidth=1)
    _panel(drop, "dropped fraction per MoE layer", "dropped pairs / routed pairs", drew)

    drew = False
    for i in layers:
        drew |= _plot(load, records, f"moe/layer{i}/load_imbalance", label=f"L{i}", linewidth=1)
    if drew:
        load.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")  # every expert equally busy
    _panel(load, "load max/mean per MoE layer", "busiest expert's pairs / mean", drew)

    steps = [r["step"] for r in records]
    fig.suptitle(f"{title}: steps {min(steps)}–{max(steps)}" if steps else f"{title}: nothing logged")
    return fig


def run_summary(run_dir: str) -> str:
    """Draw ``<run_dir>/report.png`` from ``<run_dir>/metrics.jsonl``; returns its path."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    fig = summary_figure(records, os.path.basename(os.path.normpath(run_dir)))
    return save_figure(fig, os.path.join(run_dir, "report.png"))


def main() -> None:
    p = argparse.ArgumentParser(description="Draw RUN_DIR/report.png from RUN_DIR/metrics.jsonl.")
    p.add_argument("run_dir")
    print(run_summary(p.parse_args().run_dir))


if __name__ == "__main__":
    main()
