"""Every Triton kernel the packages launch compiles for sm_90, on CPU, with the argument types and
constexprs it is launched with (tests/kernel_specs.py says how).

Triton's interpreter, which runs the kernels in the CPU tests, does not type-check: a kernel that
reassigned a loop-carried variable with another type passed every interpreter test and failed to
compile on the GPU. These tests compile what the interpreter runs, and what a GPU would launch
from the same calls, in a child process without TRITON_INTERPRET: 23 kernels, ~150 binaries, in
~20 s on 2 cores (8 s the interpreter running the calls, the rest ~10 s of compiles through TTGIR
and the child's start). KERNEL_COMPILE_STAGE=cubin also runs LLVM and ptxas (~65 s). On a GPU
they skip: the GPU tests compile the real kernels there.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from tests import kernel_specs

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="records launches through Triton's interpreter (CPU runs); on a GPU the GPU tests compile the kernels")

STAGE = os.environ.get("KERNEL_COMPILE_STAGE", "ttgir")


def _compile(launches, tmp_path, replay: bool) -> dict:
    """The child's report for ``launches`` (and, with ``replay``, the GPU's launches of
    kernel_specs.exercise)."""
    path, out = tmp_path / "launches.json", tmp_path / "report.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MOE_AUTOTUNE"] = "0"
    run = subprocess.run([sys.executable, "-m", "tests.kernel_specs", str(path), "--stage", STAGE, "--out", str(out),
                          *(["--replay"] if replay else [])],
                         env=env, cwd=kernel_specs.ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"the compile child failed:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    return json.loads(out.read_text())


def _failures(report) -> str:
    return "\n\n".join(f"{f['kernel']} ({f['source']}) {f['what']}:\n{f['error'][-1500:]}" for f in report["failures"])


def test_launched_kernels_are_found():
    """The scan finds the launched kernels (a grid subscript or cached_launch, in any module of
    the packages) and leaves out the device functions they call or take as constexprs."""
    launched = kernel_specs.launched_kernels()
    for name in ("moe.kernels.grouped_mm_fwd.grouped_mm_kernel", "attention.flash_attn._attn_bwd_delta_kernel",
                 "kernel_floor.gather_sum._gather_sum_kernel", "parallel.p2p_rows._push_back_kernel",
                 "train.lm_loss._softmax_xent_kernel", *kernel_specs.GPU_ONLY):
        assert name in launched, name
    for name in ("kernel_floor.runtime.band_swizzle", "moe.kernels.combine._locate_row", "parallel.p2p_rows._wait",
                 "moe.kernels.activation.gelu_tanh", "attention.flash_attn_hopper._producer"):
        assert name not in launched, name


@pytest.mark.slow
@needs_interpreter
def test_every_launched_kernel_compiles_for_sm90(tmp_path):
    """Each launch of kernel_specs.exercise, as the interpreter ran it and as a GPU would launch
    it, bound by Triton's own specialization and compiled for sm_90 through STAGE: one compile per
    distinct binary. Every launched kernel of the packages must be among them (but GPU_ONLY's,
    each with its reason)."""
    launches = []
    with kernel_specs.record_interpreter_launches(launches):
        kernel_specs.exercise()
    report = _compile(launches, tmp_path, replay=True)

    launched = kernel_specs.launched_kernels()
    stale = sorted(set(kernel_specs.GPU_ONLY) - set(launched))
    assert not stale, f"GPU_ONLY names kernels that no module launches any more: {stale}"
    for source in ("interpreter", "gpu-replay"):
        missing = sorted(name for name in set(launched) - set(kernel_specs.GPU_ONLY)
                         if source not in report["kernels"].get(name, {}).get("sources", ()))
        assert not missing, (
            f"launched kernels that kernel_specs.exercise() did not launch ({source}): add a call that "
            f"launches each, or list it in kernel_specs.GPU_ONLY with the reason:\n  " + "\n  ".join(
                f"{name} ({launched[name]})" for name in missing))
    assert not report["failures"], (
        f"{len(report['failures'])} of the kernels' binaries do not compile for sm_90 ({STAGE}):\n\n"
        + _failures(report))
    summary = {name: entry["binaries"] for name, entry in sorted(report["kernels"].items())}
    print(f"{len(summary)} kernels, {sum(summary.values())} binaries compiled for sm_90 through {STAGE} "
          f"in {report['seconds']} s: {summary}")


# ---- the check can fail ------------------------------------------------------------------------
# Two scratch kernels that the interpreter runs alike; the second reassigns its loop-carried
# `first`, a (BLOCK, BLOCK) int64 block, with a (1,) int1 block, the bug class that reached a GPU.

@triton.jit
def _loop_keeps_its_type(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tile = offs[:, None] * BLOCK + offs[None, :]
    first = tl.load(x_ptr + tile)
    for i in range(n):
        first = tl.where(first > i, first, 0)
    tl.store(out_ptr + tile, first)


@triton.jit
def _loop_retypes_first(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tile = offs[:, None] * BLOCK + offs[None, :]
    first = tl.load(x_ptr + tile)
    for i in range(n):
        first = tl.arange(0, 1) < i  # int1 of shape (1,) where the loop carries (BLOCK, BLOCK) int64
    tl.store(out_ptr + tile, first.to(tl.int64))


@pytest.mark.slow
@needs_interpreter
def test_compile_check_catches_a_loop_carried_retype(tmp_path):
    """The interpreter runs both scratch kernels without complaint; the compile check passes the
    first and reports the second with Triton's loop-carried type error."""
    x = torch.arange(64, dtype=torch.int64)
    launches = []
    with kernel_specs.record_interpreter_launches(launches):
        for kernel in (_loop_keeps_its_type, _loop_retypes_first):
            out = torch.empty_like(x)
            kernel[(1,)](x, out, 3, BLOCK=8)  # runs: the interpreter does not type-check
    assert [launch["kernel"] for launch in launches] == [f"{__name__}._loop_keeps_its_type",
                                                         f"{__name__}._loop_retypes_first"]
    report = _compile(launches, tmp_path, replay=False)
    assert report["kernels"][f"{__name__}._loop_keeps_its_type"]["binaries"] == 1
    assert [f["kernel"] for f in report["failures"]] == [f"{__name__}._loop_retypes_first"], _failures(report)
    error = report["failures"][0]["error"]
    assert "Loop-carried variable first has initial type <['8', '8'], int64> but is re-assigned to <['1'], int1>" \
        in error, error
