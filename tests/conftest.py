"""Test setup shared by every test module.

Triton runs on a CPU only through its interpreter, and ``TRITON_INTERPRET`` is read when a
``@triton.jit`` function is decorated, so it must be set before any project module is imported.
It is set only when no GPU is present: on a GPU the same tests run the compiled kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_GPU = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU)")
    config.addinivalue_line("markers", "multigpu: needs 2 or more CUDA GPUs")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")
    config.addinivalue_line("markers", "extended: multi-process runs that repeat what faster tests prove; deselected by default (pytest -m extended)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs 2 or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def ep2_uninterrupted(tmp_path_factory):
    """``run(options, env)``: the uninterrupted run that the 2-rank resume and restart tests compare
    against, launched once a session per option list: train/train.py under torchrun on 2 gloo ranks
    at EP 2, tests/test_train.py's SMALL model plus ``options``, EP2_RUN (6 steps, a checkpoint
    every 2). Returns its run directory (metrics.jsonl, checkpoints/; read it, never write to it)
    and the launch's stdout."""
    runs = {}

    def run(options=(), env=None):
        key = tuple(options)
        if key not in runs:
            from tests.test_train import EP2_RUN, SMALL, _torchrun

            log_dir = tmp_path_factory.mktemp("ep2_uninterrupted")
            proc = _torchrun(2, SMALL + list(options) + EP2_RUN + [f"--log.dir={log_dir}", "--log.run_name=full"],
                             env=env)
            runs[key] = (log_dir / "full", proc.stdout)
        return runs[key]

    return run
