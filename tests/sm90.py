"""What the sm_90 compile checks share: tests/test_attention.py and tests/test_grouped_mm.py run
them in a child process (``run_child``), which compiles for real (no TRITON_INTERPRET, no GPU
needed), with Triton's bundled ptxas and cuobjdump."""

import contextlib
import io
import multiprocessing
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget

BIN_DIR = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -c script argv…`` from the repository root, compiling for real: without the
    TRITON_INTERPRET that tests/conftest.py sets on a machine with no GPU. A child still running
    after ``timeout`` seconds fails the test with what it wrote to stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        return subprocess.run([sys.executable, "-c", script, *argv], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # (its stderr is bytes, text=True or not)
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        raise AssertionError(f"the child ran past {timeout} s; its stderr ends:\n{stderr[-3000:]}") from None


def _tool(name, *args) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN_DIR, name), *args], capture_output=True, text=True, check=True)


def compile_sm90(source, options: dict):
    """``(kernel, log)``: ``source`` compiled for sm_90 with ``options``, and what Triton's own
    ptxas run printed (empty for a binary served from Triton's cache: see ``ptxas_log``)."""
    knobs.nvidia.dump_ptxas_log = True  # Triton prints the log of each ptxas run
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel, log.getvalue()


def ptxas_log(kernel, log: str) -> str:
    """ptxas's log of ``kernel`` (its warnings: C7515): ``log`` from ``compile_sm90``, or, where
    the binary came from the cache and ptxas did not run, that of compiling its PTX once more."""
    if "ptxas info" in log:
        return log
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        run = _tool("ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin"))
    return run.stdout + run.stderr


def cuobjdump(kernel, flag: str) -> str:
    """What ``cuobjdump flag`` prints for the kernel's cubin (``-sass``, ``--dump-resource-usage``)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return _tool("cuobjdump", flag, cubin).stdout


def map_cases(fn, cases: list) -> list:
    """``[fn(case) for case in cases]``, the cases side by side on up to two processes: each compile
    is one Python thread and then ptxas, and the tests' CI machine has two cores (the attention
    kernels' 25 binaries: 94 s one after the other with a cold Triton cache, 42 s on two). A worker
    that dies (an abort in LLVM) raises at once, where ``multiprocessing.Pool.map`` would wait for
    it until the child's timeout."""
    with ProcessPoolExecutor(min(2, os.cpu_count() or 1), mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(fn, cases))
