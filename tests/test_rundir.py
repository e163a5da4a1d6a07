"""A second launch into an earlier run's directory (issue #19): it resumes when there is a
checkpoint of the same model, and otherwise refuses with one line naming the ways out; a
checkpoint of another model is one error naming the first tensor that does not fit."""

import json
import os

import pytest

from tests.test_train import SMALL, _losses, _run_inprocess
from train.checkpoint import list_checkpoints
from train.config import ConfigError

STEPS = ["--train.steps=4", "--parallel.ep=1"]


def _run(tmp_path, *extra):
    return _run_inprocess(SMALL + STEPS + [f"--log.dir={tmp_path}", "--log.run_name=r", *extra])


def test_a_rerun_without_a_checkpoint_refuses_and_names_the_ways_out(tmp_path):
    _run(tmp_path)
    before = open(tmp_path / "r" / "metrics.jsonl").read()
    with pytest.raises(ConfigError, match=r"log\.run_name: .*r already holds a run and no checkpoint to resume .*"
                                          r"checkpoint\.every=0.*--log\.run_name.*--log\.overwrite=true"):
        _run(tmp_path)
    assert open(tmp_path / "r" / "metrics.jsonl").read() == before  # nothing touched


def test_overwrite_replaces_the_earlier_run(tmp_path):
    _run(tmp_path, "--checkpoint.every=2")
    (tmp_path / "r" / "stale.txt").write_text("from the first run")
    _run(tmp_path, "--checkpoint.every=2", "--log.overwrite=true", "--train.steps=3")  # else: resume at step 4
    assert sorted(_losses(str(tmp_path / "r"))) == [1, 2, 3]
    assert not (tmp_path / "r" / "stale.txt").exists()
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path / "r" / "checkpoints"))] == ["step_00000002"]


def test_a_rerun_with_a_checkpoint_resumes_and_names_what_changed(tmp_path, capsys):
    _run(tmp_path, "--checkpoint.every=2", "--checkpoint.stop_after=2")
    capsys.readouterr()
    _run(tmp_path, "--checkpoint.every=2", "--optim.lr=1e-3")
    out = capsys.readouterr().out
    assert "resumed from" in out and "changed since the run began: optim.lr 0.003 -> 0.001" in out, out
    assert sorted(_losses(str(tmp_path / "r"))) == [1, 2, 3, 4]


def test_a_rerun_with_another_model_refuses_naming_the_key(tmp_path):
    _run(tmp_path, "--checkpoint.every=2")
    with pytest.raises(ConfigError, match=r"model\.dim=96, but the run in .* was trained with model\.dim=64.*"
                                          r"--log\.run_name.*--log\.overwrite=true"):
        _run(tmp_path, "--checkpoint.every=2", "--model.dim=96")


def test_a_checkpoint_of_another_model_names_the_first_tensor_and_stays_intact(tmp_path):
    _run(tmp_path, "--checkpoint.every=2")
    ckpt = list_checkpoints(str(tmp_path / "r" / "checkpoints"))[-1]
    with pytest.raises(ConfigError, match=r"does not fit this model: blocks\.0\.ffn\.experts\.w1_LDU is \(8, 64, 128\) "
                                          r"there and \(8, 64, 192\) here; the model\.\* and moe\.\* keys"):
        _run_inprocess(SMALL + STEPS + [f"--log.dir={tmp_path}", "--log.run_name=other", f"--checkpoint.resume={ckpt}",
                                        "--moe.hidden_dim=96"])
    with open(os.path.join(ckpt, "meta.json")) as f:
        assert json.load(f)["step"] == 4  # not set aside as corrupt
