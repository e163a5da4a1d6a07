"""Run logging, rank 0 only: wandb, a JSON-lines metrics file, a progress bar, a console line
per logged step, and at the end the run summary ``report.png`` and one line saying where
everything is.

wandb mode: ``log.wandb_mode`` if set, else the ``WANDB_MODE`` environment variable, else
``online`` when ``WANDB_API_KEY`` is set and ``offline`` otherwise (offline never touches the
network; ``wandb sync`` uploads the run later). Without the wandb package the run goes on with
the metrics file and the console only.

``metrics.jsonl`` is strict JSON, one record per line: a NaN or infinite value is written as
``null`` (a bare ``NaN`` is not JSON; jq and JavaScript reject the whole file);
``train.plots.read_metrics`` reads it back as NaN.

The console line (fields that were not logged are left out)::

    step 120/400 | loss 1.2345 val 1.7160 | lr 3.00e-04 gnorm 0.512 | 12,345 tok/s mfu 18.7% | mem 1.23 GiB
    | drop 0.0120/0.0310@L3 max/mean 1.92@L3 util 0.95@L0 ent 1.98@L2 aux 0.0203

``drop`` is the dropped fraction over all MoE layers / of the worst layer; ``max/mean`` (load
imbalance), ``util`` (tile utilization) and ``ent`` (router entropy) are the worst layer's
value (highest imbalance, lowest utilization and entropy) and ``@L<i>`` that layer, the
``moe/layer<i>/...`` of the metrics and the heatmap's row ``L<i>``; ``aux`` is the aux losses'
sum (coefficients applied). ``mem`` is the GPU's peak allocation, ``rss`` the host process's
peak resident memory (CPU runs).

The expert-load heatmap (``train.plots.expert_load_figure``) is written under
``<run dir>/heatmaps/`` and logged to wandb as an image.
"""

import importlib.util
import json
import math
import os
import sys
import time

import numpy as np

from train import plots

try:
    import wandb
except ImportError:  # without wandb: metrics file + console only
    wandb = None

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


def resolve_wandb_mode(configured: str | None) -> str:
    if wandb is None:
        return "disabled"
    if configured is not None:
        return configured
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _worst_layer(m: dict, name: str, pick) -> tuple[float, int] | None:
    """(value, i) of the MoE layer whose ``moe/layer<i>/<name>`` is worst under ``pick`` (max or
    min), a NaN counting as the worst (a non-finite stat is news); None when none is logged."""
    values = []
    while f"moe/layer{len(values)}/{name}" in m:
        values.append(m[f"moe/layer{len(values)}/{name}"])
    if not values:
        return None
    i = pick(range(len(values)), key=lambda i: (math.isnan(values[i]) == (pick is max), values[i]))
    return values[i], i


def format_line(step: int, total: int, m: dict) -> str:
    """The console line of one logged step (see the module docstring); a field that is not in
    ``m`` is left out, a NaN or inf is shown as such."""

    def field(label: str, key: str, fmt: str) -> str | None:
        return None if m.get(key) is None else label.format(format(m[key], fmt))

    def worst(label: str, name: str, fmt: str, pick) -> str | None:
        found = _worst_layer(m, name, pick)
        return None if found is None else f"{label} {format(found[0], fmt)}@L{found[1]}"

    drop = _worst_layer(m, "dropped_fraction", max)
    groups = [
        [f"step {step}/{total}"],
        [field("loss {}", "train/loss", ".4f"), field("val {}", "val/loss", ".4f")],
        [field("lr {}", "train/lr", ".2e"), field("gnorm {}", "train/grad_norm", ".3f")],
        [field("{} tok/s", "perf/tokens_per_s", ",.0f"), field("mfu {}", "perf/mfu", ".1%")],
        [field("mem {} GiB", "perf/max_mem_gb", ".2f"), field("rss {} GiB", "perf/max_rss_gb", ".2f")],
        [
            None if drop is None else f"drop {m.get('moe/dropped_fraction', math.nan):.4f}/{drop[0]:.4f}@L{drop[1]}",
            worst("max/mean", "load_imbalance", ".2f", max), worst("util", "tile_utilization", ".2f", min),
            worst("ent", "router_entropy", ".2f", min), field("aux {}", "train/aux_loss", ".4f"),
        ],
    ]
    return " | ".join(" ".join(f for f in g if f) for g in groups if any(g))


def _metrics_line(record: dict) -> str:
    """One line of metrics.jsonl: strict JSON, a non-finite float written as null."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite, allow_nan=False) + "\n"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes}m{sec:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class RunLogger:
    """No-op on ranks other than 0."""

    def __init__(self, cfg, rank: int, run_dir: str, total_steps: int, start_step: int = 0):
        self.active = rank == 0
        self.run_dir = run_dir
        self.total = total_steps
        self.start_step = start_step
        self.started = time.perf_counter()  # the final line's elapsed time
        self.last = {"step": None, "train/loss": None, "val/loss": None}  # for the final line
        self.run = None
        self.bar = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        # a fresh run starts a fresh file; a resumed one keeps the records up to its start step
        # and appends: the steps it recomputes would otherwise appear twice, and a line torn by
        # the crash would break every reader of the file (read_metrics skips it); the kept
        # records are written again, so a file of an older version loses its bare NaNs too
        kept = []
        if start_step and os.path.isfile(self.metrics_path):
            kept = [r for r in plots.read_metrics(self.metrics_path) if r["step"] <= start_step]
        with open(self.metrics_path + ".tmp", "w") as f:  # replaced in one step: a crash now loses nothing
            f.writelines(map(_metrics_line, kept))
        os.replace(self.metrics_path + ".tmp", self.metrics_path)
        self.mode = resolve_wandb_mode(cfg.log.wandb_mode)
        if self.mode != "disabled":
            # a resumed run continues the same wandb run (its id is kept in the run directory)
            id_path = os.path.join(run_dir, "wandb_id")
            run_id = None
            if start_step and os.path.isfile(id_path):
                with open(id_path) as f:
                    run_id = f.read().strip() or None
            self.run = wandb.init(
                project=cfg.log.project, name=cfg.log.run_name, dir=run_dir, mode=self.mode,
                config=cfg.to_dict(), id=run_id, resume="allow" if run_id else None,
            )
            with open(id_path, "w") as f:
                f.write(self.run.id)
        if cfg.log.progress and tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr)
        self.print(f"run dir {run_dir} | wandb {self.mode}" + (f" ({self.run.dir})" if self.run else ""))
        # matplotlib is a dependency, but a GPU image may lack it: the run must not fail at its end
        self.plots = importlib.util.find_spec("matplotlib") is not None
        if not self.plots:
            self.print("plots off: matplotlib is not installed (pip install matplotlib): no heatmaps/, no report.png")

    def print(self, line: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        if not self.active:
            return
        with open(self.metrics_path, "a") as f:
            f.write(_metrics_line({"step": step, "time": time.time(), **metrics}))
        self.last.update({k: v for k, v in metrics.items() if k in self.last}, step=step)
        if self.run is not None:
            self.run.log(metrics, step=step)
        if console:
            self.print(format_line(step, self.total, metrics))

    def log_experts(self, step: int, layer_names: list[str], stats: list) -> None:
        """The expert-load heatmap (``heatmaps/step_<step>.png``, and wandb) and the per-expert
        table (wandb) of the latest step."""
        if not self.active:
            return
        kept_LE = np.stack([s.tokens_per_expert.detach().cpu().numpy() for s in stats])
        path = os.path.join(self.run_dir, "heatmaps", f"step_{step:06d}.png")
        if self.plots:
            plots.save_figure(plots.expert_load_figure(kept_LE, layer_names, step), path)
        if self.run is not None:
            columns = ["layer", "expert", "routed", "kept_tokens", "tiles", "padded_slots", "dropped"]
            rows = []
            for name, s in zip(layer_names, stats):
                routed = s.routed_per_expert.cpu().tolist()
                kept = s.tokens_per_expert.cpu().tolist()
                tiles = s.tiles_per_expert.cpu().tolist()
                padded = s.padded_slots_per_expert.cpu().tolist()
                for e in range(len(kept)):
                    rows.append([name, e, routed[e], kept[e], tiles[e], padded[e], routed[e] - kept[e]])
            images = {"moe/expert_load_heatmap": wandb.Image(path, caption="MoE layers × experts, kept pairs / layer mean")}
            self.run.log({**(images if self.plots else {}), "moe/experts_table": wandb.Table(columns=columns, data=rows)},
                         step=step)

    def finish(self, ckpt_dir: str | None = None) -> None:
        """End of the run: draw ``report.png`` (and log it to wandb), close wandb and the progress
        bar, and print the final line (:meth:`_final_line`; ``ckpt_dir`` is named there when it
        holds anything)."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        report = plots.run_summary(self.run_dir) if self.plots else None
        wandb_where = None
        if self.run is not None:
            if report is not None:
                self.run.log({"run/report": wandb.Image(report, caption="run summary")}, step=self.last["step"])
            # read before finish(): a finished run's attributes are no longer served
            wandb_where = f"upload: wandb sync {self.run.settings.sync_dir}" if self.mode == "offline" else f"wandb {self.run.url}"
            self.run.finish()
        has_ckpt = ckpt_dir is not None and os.path.isdir(ckpt_dir) and bool(os.listdir(ckpt_dir))
        self.print(self._final_line(report, ckpt_dir if has_ckpt else None, wandb_where))

    def _final_line(self, report: str | None, ckpt_dir: str | None, wandb_where: str | None) -> str:
        """``done in <elapsed>: steps <start>→<last> of <total> | loss .. val .. | <where things are>``;
        the elapsed time runs from this logger's start (the model built, the checkpoint restored)."""
        last = self.last

        def loss(key: str) -> str:
            return "-" if last[key] is None else f"{last[key]:.4f}"

        parts = [
            f"done in {_duration(time.perf_counter() - self.started)}: steps {self.start_step}→"
            f"{'-' if last['step'] is None else last['step']} of {self.total}",
            f"loss {loss('train/loss')} val {loss('val/loss')}",
            f"run dir {self.run_dir}: " + (f"{os.path.basename(report)}, " if report else "") + os.path.basename(self.metrics_path)
            + (", heatmaps/" if os.path.isdir(os.path.join(self.run_dir, "heatmaps")) else ""),
        ]
        parts += [where for where in (ckpt_dir and f"checkpoints {ckpt_dir}", wandb_where) if where]
        return " | ".join(parts)
