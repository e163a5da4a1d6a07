"""Run logging's figures and lines: the expert-load heatmap, the run summary report.png, strict
JSON in metrics.jsonl, the console line and the final line (CPU, no process group)."""

import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from train import plots
from train.config import Config
from train.logger import RunLogger, format_line
from train.report import summarize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(wandb_mode: str = "disabled") -> Config:
    cfg = Config()
    cfg.log.wandb_mode, cfg.log.progress = wandb_mode, False
    return cfg


def _stats(kept_E: list[int]) -> SimpleNamespace:
    """The MoEStats fields that RunLogger.log_experts reads; every layer routes 2 more pairs than it keeps."""
    kept = torch.tensor(kept_E)
    return SimpleNamespace(tokens_per_expert=kept, routed_per_expert=kept + 2, tiles_per_expert=(kept + 15) // 16,
                           padded_slots_per_expert=(kept + 15) // 16 * 16 - kept)


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def _step_metrics(loss: float, layers: int = 3) -> dict:
    m = {"train/loss": loss, "train/lr": 3e-4, "perf/tokens_per_s": 1000.0, "moe/dropped_fraction": 0.01}
    for i in range(layers):
        m[f"moe/layer{i}/dropped_fraction"] = 0.01 * (i + 1)
        m[f"moe/layer{i}/load_imbalance"] = 1.0 + 0.1 * i
    return m


# ---------------------------------------------------------------- the heatmap


def test_heatmap_figure_is_labelled_and_coloured_by_kept_over_the_layer_mean():
    kept_LE = np.array([[0, 10, 20, 10], [5, 5, 5, 5], [0, 0, 0, 0]])
    fig = plots.expert_load_figure(kept_LE, ["blocks.0.moe", "blocks.1.moe", "blocks.2.moe"], step=7)
    ax, bar = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("expert", "MoE layer", "expert load at step 7")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["L0 blocks.0.moe", "L1 blocks.1.moe", "L2 blocks.2.moe"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    assert bar.get_ylabel() == plots.HEATMAP_LABEL
    image = ax.get_images()[0]
    # kept / the layer's mean; a layer that kept nothing is balanced
    assert np.array_equal(image.get_array(), [[0, 1, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    idle, balanced, double = (np.array(image.cmap(image.norm(v))[:3]) for v in (0.0, 1.0, 2.0))
    assert idle[2] > 0.2 + idle[0] and double[0] > 0.2 + double[2]  # blue, red
    assert balanced.min() > 0.9  # white
    assert np.allclose(image.cmap(image.norm(5.0)), image.cmap(image.norm(2.0)))  # 2× the mean or more: one colour


def test_log_experts_writes_a_png_of_the_heatmap(tmp_path):
    import matplotlib.image

    log = RunLogger(_cfg(), 0, str(tmp_path), 10)
    log.log_experts(5, ["blocks.0.moe", "blocks.1.moe", "blocks.2.moe"],
                    [_stats([0, 10, 20, 10, 0, 10, 20, 10]), _stats([5] * 8), _stats([40, 0, 0, 0, 0, 0, 0, 0])])
    rgba_HW4 = matplotlib.image.imread(tmp_path / "heatmaps" / "step_000005.png")
    height, width, _ = rgba_HW4.shape
    assert 150 <= height < width <= 1600  # inches × 100 dpi: wider than tall for 8 experts × 3 layers
    rgb_P3 = rgba_HW4[..., :3].reshape(-1, 3)
    red, green, blue = rgb_P3.T
    assert ((red > blue + 0.2) & (red > green + 0.2)).sum() > 500  # red cells (2× and 8× the mean)
    assert ((blue > red + 0.2) & (blue > green + 0.1)).sum() > 500  # blue cells (idle experts)
    RunLogger(_cfg(), 1, str(tmp_path / "rank1"), 10).log_experts(5, ["x"], [_stats([1, 2])])
    assert not (tmp_path / "rank1").exists()  # rank 0 only


# ---------------------------------------------------------------- report.png


def test_run_summary_of_a_resumed_run_with_nulls(tmp_path):
    run_dir = str(tmp_path / "myrun")
    first = RunLogger(_cfg(), 0, run_dir, 8)
    first.log(0, {"val/loss": 5.0}, console=False)
    for step in range(1, 7):
        first.log(step, _step_metrics(math.nan if step == 3 else 4.0 - 0.1 * step), console=False)
    first.log(4, {"val/loss": 3.0}, console=False)
    # the crash lost steps 5 and 6; the resumed run recomputes them from the step-4 checkpoint
    resumed = RunLogger(_cfg(), 0, run_dir, 8, start_step=4)
    for step in range(5, 9):
        resumed.log(step, _step_metrics(2.0 - 0.1 * step), console=False)
    resumed.log(8, {"val/loss": 1.5}, console=False)
    # a file that a resume appended to without truncating (older versions): the later value wins
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 8, "val/loss": 1.25}) + "\n")

    path = plots.run_summary(run_dir)
    assert path == os.path.join(run_dir, "report.png") and os.path.getsize(path) > 10_000
    fig = plots.summary_figure(plots.read_metrics(os.path.join(run_dir, "metrics.jsonl")), "myrun")
    assert fig.get_suptitle() == "myrun: steps 0–8"
    by_title = {ax.get_title(): ax for ax in fig.axes}
    assert set(by_title) == {"loss", "throughput", "dropped fraction per MoE layer", "load max/mean per MoE layer"}
    for ax in fig.axes:
        assert ax.get_xlabel() == "step" and ax.get_ylabel()
    loss = by_title["loss"]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["train", "val"]
    train, val = loss.get_lines()
    assert list(train.get_xdata()) == list(range(1, 9))  # each step once
    expect = [4.0 - 0.1 * s for s in (1, 2)] + [math.nan, 3.6] + [2.0 - 0.1 * s for s in (5, 6, 7, 8)]
    assert np.allclose(train.get_ydata(), expect, equal_nan=True)  # a null is a gap; 5, 6 from the resumed run
    assert list(val.get_xdata()) == [0, 4, 8] and list(val.get_ydata()) == [5.0, 3.0, 1.25]
    drop = by_title["dropped fraction per MoE layer"]
    assert [t.get_text() for t in drop.get_legend().get_texts()] == ["all layers", "L0", "L1", "L2"]
    assert len(by_title["load max/mean per MoE layer"].get_lines()) == 4  # 3 layers and the balanced line

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    fig = plots.summary_figure([], "empty")
    assert fig.get_suptitle() == "empty: nothing logged"
    assert all(ax.texts[0].get_text() == "not logged" for ax in fig.axes)
    proc = subprocess.run([sys.executable, "-m", "train.plots", str(empty)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(empty / "report.png"), proc.stderr[-2000:]
    assert (empty / "report.png").stat().st_size > 10_000


# ---------------------------------------------------------------- strict JSON


def test_metrics_jsonl_is_strict_json_with_null_for_non_finite(tmp_path):
    # a file of an older version, with a bare NaN in a record the resumed run keeps
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": NaN}\n{"step": 2, "train/loss": Infinity}\n'
                                            '{"step": 3, "train/loss": 1.0}\n')
    log = RunLogger(_cfg(), 0, str(tmp_path), 10, start_step=2)
    log.log(3, {"train/loss": math.nan, "train/grad_norm": -math.inf, "train/lr": 1e-3}, console=False)
    records = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in records] == [(1, None), (2, None), (3, None)]
    assert records[2]["train/grad_norm"] is None and records[2]["train/lr"] == 1e-3
    back = plots.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert all(math.isnan(r["train/loss"]) for r in back)
    # train.report reads the null back as NaN, as it read the bare NaN before
    (tmp_path / "run_info.json").write_text("{}")
    assert math.isnan(summarize(str(tmp_path), 0)["loss_first"])


# ---------------------------------------------------------------- the console line


def _three_layers(**extra) -> dict:
    m = {"train/loss": 1.23456, "train/lr": 3e-4, "train/grad_norm": 0.5123, "train/aux_loss": 0.0203,
         "perf/tokens_per_s": 12345.6, "moe/dropped_fraction": 0.012}
    for i, (drop, imb, util, ent) in enumerate([(0.01, 1.5, 0.9, 2.0), (0.031, 1.2, 0.8, 1.7), (0.0, 1.9, 0.95, 1.9)]):
        m.update({f"moe/layer{i}/dropped_fraction": drop, f"moe/layer{i}/load_imbalance": imb,
                  f"moe/layer{i}/tile_utilization": util, f"moe/layer{i}/router_entropy": ent,
                  f"moe/layer{i}/aux_loss": 0.01, f"moe/layer{i}/z_loss": 0.001})
    return {**m, **extra}


def test_console_line_shows_memory_and_the_worst_moe_layers():
    cpu = format_line(120, 400, _three_layers(**{"perf/max_rss_gb": 0.5}))
    assert cpu == ("step 120/400 | loss 1.2346 | lr 3.00e-04 gnorm 0.512 | 12,346 tok/s | rss 0.50 GiB | "
                   "drop 0.0120/0.0310@L1 max/mean 1.90@L2 util 0.80@L1 ent 1.70@L1 aux 0.0203")
    gpu = format_line(400, 400, _three_layers(**{"perf/max_mem_gb": 61.25, "perf/mfu": 0.187, "val/loss": 1.716}))
    assert gpu == ("step 400/400 | loss 1.2346 val 1.7160 | lr 3.00e-04 gnorm 0.512 | 12,346 tok/s mfu 18.7% | "
                   "mem 61.25 GiB | drop 0.0120/0.0310@L1 max/mean 1.90@L2 util 0.80@L1 ent 1.70@L1 aux 0.0203")
    assert len(gpu) <= 200
    # a non-finite layer is the worst one, a non-finite loss is shown
    bad = format_line(7, 400, _three_layers(**{"train/loss": math.nan, "moe/layer0/router_entropy": math.nan}))
    assert "loss nan |" in bad and "ent nan@L0" in bad
    assert format_line(0, 400, {"val/loss": 5.218}) == "step 0/400 | val 5.2180"


# ---------------------------------------------------------------- the final line


def test_final_line_says_how_long_and_where_everything_is(tmp_path, capsys):
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    log = RunLogger(_cfg(), 0, str(run_dir), 10, start_step=0)
    log.log(0, {"val/loss": 5.0}, console=False)
    log.log(6, {"train/loss": 1.5}, console=False)
    log.log(6, {"val/loss": 2.0}, console=False)
    log.log_experts(6, ["blocks.0.moe"], [_stats([1, 2, 3, 4])])
    ckpt_dir.mkdir()
    (ckpt_dir / "step_00000006").mkdir()
    capsys.readouterr()
    log.started -= 125  # 2 min 5 s ago, plus the time finish() takes to draw report.png
    log.finish(str(ckpt_dir))
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"done in 2m0[5-9]s: " + re.escape(
        f"steps 0→6 of 10 | loss 1.5000 val 2.0000 | run dir {run_dir}: report.png, metrics.jsonl, heatmaps/ | "
        f"checkpoints {ckpt_dir}"), line), line
    assert (run_dir / "report.png").is_file()

    # a resumed launch that logs nothing before its end, with no checkpoint written
    again = RunLogger(_cfg(), 0, str(run_dir), 10, start_step=6)
    again.finish(str(tmp_path / "none"))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("done in ") and line.endswith(f"steps 6→- of 10 | loss - val - | run dir {run_dir}: "
                                                         "report.png, metrics.jsonl, heatmaps/")


def test_offline_wandb_gets_the_images_and_the_final_line_the_sync_command(tmp_path, capsys):
    pytest.importorskip("wandb")
    log = RunLogger(_cfg("offline"), 0, str(tmp_path), 4)
    log.log(2, _step_metrics(1.0), console=False)
    log.log_experts(2, ["blocks.0.moe", "blocks.1.moe"], [_stats([1, 2, 3, 4]), _stats([4, 3, 2, 1])])
    sync_dir = log.run.settings.sync_dir
    log.finish()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith(f" | upload: wandb sync {sync_dir}") and os.path.isdir(sync_dir)
    media_dir = os.path.join(sync_dir, "files", "media", "images")
    media = [os.path.relpath(os.path.join(d, f), media_dir) for d, _, files in os.walk(media_dir) for f in files]
    assert any(p.startswith("moe/expert_load_heatmap_2_") and p.endswith(".png") for p in media), media
    assert any(p.startswith("run/report_2_") and p.endswith(".png") for p in media), media
