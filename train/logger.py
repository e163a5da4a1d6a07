"""Run logging, rank 0 only: wandb, a JSON-lines metrics file, a progress bar and a console line.

wandb mode: ``log.wandb_mode`` if set, else the ``WANDB_MODE`` environment variable, else
``online`` when ``WANDB_API_KEY`` is set and ``offline`` otherwise (offline never touches the
network; ``wandb sync`` uploads the run later). Without the wandb package the run goes on with
the metrics file and the console only.

The expert-load heatmap (layers × experts, colour = an expert's kept pairs / the layer's mean:
blue idle, white balanced, red ≥ 2× the mean) is built as a numpy RGB image, so no plotting
library is needed; wandb.Image needs Pillow, so without Pillow the same PNG (encoded here) is
logged as inline HTML and written under ``<run dir>/heatmaps/``.
"""

import base64
import json
import os
import struct
import sys
import time
import zlib

import numpy as np

try:
    import wandb
except ImportError:  # without wandb: metrics file + console only
    wandb = None

try:
    import PIL  # noqa: F401  (wandb.Image needs it)

    HAS_PIL = True
except ImportError:
    HAS_PIL = False

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


def load_heatmap(load_LE: np.ndarray, cell: int = 16) -> np.ndarray:
    """(layers, experts) counts -> (height, width, 3) uint8 image, ``cell`` pixels per entry."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    mean_L1 = load_LE.mean(axis=1, keepdims=True)
    rel = np.divide(load_LE, mean_L1, out=np.ones_like(load_LE), where=mean_L1 > 0)
    t = np.clip(rel, 0.0, 2.0) / 2.0  # 0 idle, 0.5 balanced, 1 twice the mean or more
    anchors = np.array([0.0, 0.5, 1.0])
    colors = np.array([[33, 102, 172], [247, 247, 247], [178, 24, 43]], dtype=np.float64)
    rgb = np.stack([np.interp(t, anchors, colors[:, c]) for c in range(3)], axis=-1)
    return np.repeat(np.repeat(rgb.round().astype(np.uint8), cell, axis=0), cell, axis=1)


def encode_png(rgb: np.ndarray) -> bytes:
    """Minimal PNG encoder (8-bit RGB, no filtering)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def format_line(step: int, total: int, m: dict) -> str:
    def get(key, fmt):
        v = m.get(key)  # absent: "-"; a NaN or inf is shown as such (a non-finite loss is news)
        return "-" if v is None else format(v, fmt)

    return (
        f"step {step}/{total} | loss {get('train/loss', '.4f')} | val {get('val/loss', '.4f')} | "
        f"lr {get('train/lr', '.2e')} | gnorm {get('train/grad_norm', '.3f')} | "
        f"{get('perf/tokens_per_s', ',.0f')} tok/s | mfu {get('perf/mfu', '.3f')} | "
        f"drop {get('moe/dropped_fraction', '.4f')} | load max/mean {get('moe/load_imbalance', '.2f')}"
    )


class RunLogger:
    """No-op on ranks other than 0."""

    def __init__(self, cfg, rank: int, run_dir: str, total_steps: int, start_step: int = 0):
        self.active = rank == 0
        self.run_dir = run_dir
        self.total = total_steps
        self.run = None
        self.bar = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        # a fresh run starts a fresh file; a resumed one keeps the records up to its start step
        # and appends: the steps it recomputes would otherwise appear twice, and a line torn by
        # the crash would break every reader of the file
        kept = []
        if start_step and os.path.isfile(self.metrics_path):
            with open(self.metrics_path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        with open(self.metrics_path + ".tmp", "w") as f:  # replaced in one step: a crash now loses nothing
            f.writelines(kept)
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
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)
        if console:
            self.print(format_line(step, self.total, metrics))

    def log_experts(self, step: int, layer_names: list[str], stats: list) -> None:
        """The expert-load heatmap and the per-expert table of the latest step."""
        if not self.active:
            return
        kept_LE = np.stack([s.tokens_per_expert.detach().cpu().numpy() for s in stats])
        image = load_heatmap(kept_LE, cell=max(4, min(32, 512 // kept_LE.shape[1])))
        payload = {}
        if self.run is not None:
            if HAS_PIL:
                payload["moe/expert_load_heatmap"] = wandb.Image(image, caption="layers × experts, kept / mean")
            else:
                b64 = base64.b64encode(encode_png(image)).decode()
                payload["moe/expert_load_heatmap"] = wandb.Html(f'<img src="data:image/png;base64,{b64}" style="image-rendering:pixelated">')
            columns = ["layer", "expert", "routed", "kept_tokens", "tiles", "padded_slots", "dropped"]
            rows = []
            for name, s in zip(layer_names, stats):
                routed = s.routed_per_expert.cpu().tolist()
                kept = s.tokens_per_expert.cpu().tolist()
                tiles = s.tiles_per_expert.cpu().tolist()
                padded = s.padded_slots_per_expert.cpu().tolist()
                for e in range(len(kept)):
                    rows.append([name, e, routed[e], kept[e], tiles[e], padded[e], routed[e] - kept[e]])
            payload["moe/experts_table"] = wandb.Table(columns=columns, data=rows)
            self.run.log(payload, step=step)
        heat_dir = os.path.join(self.run_dir, "heatmaps")
        os.makedirs(heat_dir, exist_ok=True)
        with open(os.path.join(heat_dir, f"step_{step:06d}.png"), "wb") as f:
            f.write(encode_png(image))

    def finish(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()
