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
