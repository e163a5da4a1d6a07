"""Run a test function on W local processes: start, init, collect, tear down.

A rank that raises reports its traceback; the parent raises with every rank's report. Nothing
hangs: collectives time out (``timeout_s``), the parent waits at most ``timeout_s`` plus start-up
for all results, then kills whatever is left.
"""

import datetime
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# The processes fork from one fresh server process (multiprocessing's "forkserver", started by
# the first call) that has imported torch and the project once, instead of each process being
# spawned and importing them again: on a 2-core CPU machine a 4-rank call spent about 8 s of its
# start-up in imports. The server never runs a test, so every process starts from that clean,
# just-imported state, as a spawned one does; it gets the caller's environment as of the call.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo",  # the last: imported by the first optimizer built
           "tests.distributed", "moe", "parallel", "train.model", "train.parallelize", "train.checkpoint", "train.train"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, once per test session
    return ctx


def _worker(rank: int, world_size: int, backend: str, init_file: str, timeout_s: float, fn, args, results,
            environ: dict[str, str]) -> None:
    try:
        os.environ.clear()
        os.environ.update(environ)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` new processes; returns the results
    by rank. ``fn`` must be importable (module level) and its result picklable.

    backend ``"gloo"`` (CPU) or ``"nccl"`` (rank r on GPU r). Raises RuntimeError with the
    tracebacks if any rank fails, and on timeout.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, backend, init_file, timeout_s, fn, args, results, dict(os.environ)),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[bool, object]] = {}
        wait_s = timeout_s + 60.0  # start-up: every process imports torch
        try:
            while len(outcomes) < world_size:
                try:
                    rank, ok, value = results.get(timeout=wait_s)
                except queue.Empty:
                    if any(not ok for ok, _ in outcomes.values()):
                        break  # the others wait on a collective with a failed rank
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise RuntimeError(f"run_distributed: ranks {missing} gave no result within {wait_s:.0f} s") from None
                outcomes[rank] = (ok, value)
                if not ok:
                    wait_s = 3.0  # collect the other ranks' reports that come soon, then stop
        finally:
            for p in procs:
                p.join(timeout=5.0 if len(outcomes) == world_size else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise RuntimeError(f"run_distributed: {len(failures)} rank(s) failed\n{report}")
    return [outcomes[r][1] for r in range(world_size)]
