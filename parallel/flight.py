"""What a rank was doing when a collective hung: a record of the collectives it issued, and a
watchdog that stops the run naming the one it waits in.

A collective that one rank never joins blocks the others until the process group's timeout, and
the messages of that timeout name no layer: gloo's says "Timed out waiting 600000ms for recv
operation", NCCL's watchdog names an op type and a sequence number. Here every collective this
library issues is recorded first (:func:`record`: what, over which group, in which phase and
layer; a deque append on the host and, on a GPU, one CUDA event), and :class:`Watchdog` (a
daemon thread) watches the record: when ``timeout_s`` passes with no new entry, it prints one
error naming the collective waited in (on a CPU the last one issued; on a GPU, whose host runs
ahead, the first one the stream has not passed: :meth:`FlightRecorder.stuck_entry`) and where
the main thread stands (its innermost frames in this library and in ``torch.distributed``, which
also names collectives issued inside torch, e.g. FSDP's all-gathers), then ends the process
(:data:`REPORT_WAIT_S` later, so the other ranks' reports are printed too).
torchrun then stops the other ranks (and restarts the job from its last checkpoint under
``--max-restarts``), so a hang costs ``timeout_s``, not forever.

The process group's own timeout is set a little longer (:data:`GRACE_S`), so the watchdog's
message comes first; that timeout stays as the backstop. The watchdog cannot tell a hang from
a legitimately long gap between collectives: ``timeout_s`` must exceed the longest one (a
checkpoint write, the first step's kernel autotuning).
"""

import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

GRACE_S = 60.0  # the process group's timeout is the watchdog's plus this
# after printing its report, a watchdog waits this long before ending the process: the ranks stop
# making progress together, so their watchdogs fire within about a poll of each other, and
# torchrun stops every rank as soon as the first one exits. Without the wait, on 2×H200 the waiting
# rank's report came alone: the stalled rank, the one the others wait for, was stopped before its
# own report (tests/test_faults.py, the stall test on CUDA). Every rank waits, whichever fires
# first. Meanwhile a rank outside any collective may go on with host work; no collective can
# complete.
REPORT_WAIT_S = 3.0
EXIT_CODE = 3  # a collective timed out (torchrun reports it; 1 is an ordinary error)
_OURS = tuple(os.sep + p + os.sep for p in ("moe", "parallel", "train", "attention", "kernel_floor"))


@dataclass(frozen=True)
class Entry:
    seq: int  # 1, 2, ... on this rank
    time: float  # time.monotonic() when issued
    op: str  # e.g. "all_to_all dispatch rows (backward)"
    group: str  # the ranks it spans, e.g. "ranks [0, 1]"
    context: str  # the phase the trainer set, e.g. "step 12: forward"
    layer: str  # the module the forward was in when the phase began, "" if none
    # CUDA: an event on the current stream just before the collective was enqueued (the host runs
    # ahead of a GPU, so the last one issued is not the one the GPU waits in: see stuck_entry)
    marker: "torch.cuda.Event | None" = None
    stream: "torch.cuda.Stream | None" = None  # the stream the marker is on

    def describe(self) -> str:
        where = f"{self.context}, {self.layer}" if self.layer else self.context
        return f"#{self.seq} {self.op} over {self.group} ({where or 'outside the training loop'})"


class FlightRecorder:
    """The last ``size`` collectives this process issued (one per process: :data:`RECORDER`)."""

    def __init__(self, size: int = 32):
        self.entries: deque[Entry] = deque(maxlen=size)
        self.context = ""
        self.layer = ""
        self.seq = 0
        self.last_progress = time.monotonic()

    def record(self, op: str, group=None, layer: str | None = None) -> None:
        """Note a collective about to be issued over ``group`` (a process group, None: the
        world; ``layer``: its own, else the current one)."""
        self.seq += 1
        self.last_progress = time.monotonic()
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        if stream is not None and torch.cuda.is_current_stream_capturing():
            # a CUDA graph's capture (train/step_graph.py): an event recorded there cannot be
            # queried ("invalid argument", H200), and the replays record nothing
            stream = None
        self.entries.append(Entry(self.seq, self.last_progress, op, _ranks(group), self.context,
                                  self.layer if layer is None else layer,
                                  stream.record_event() if stream is not None else None, stream))

    def stuck_entry(self) -> tuple["Entry | None", bool]:
        """The collective this rank waits in, and whether the device says so. On a GPU: the first
        entry the stream has not passed (the marker of the entry after it has not completed), or
        the last one if the stream still has work queued after it (no kernel of a step runs for
        ``timeout_s``), True. Otherwise (a CPU, where a collective returns only once done, or an
        idle GPU) the last one issued, False."""
        entries = list(self.entries)
        for entry, after in zip(entries, entries[1:]):
            if after.marker is not None and not after.marker.query():
                return entry, True
        if not entries:
            return None, False
        last = entries[-1]
        return last, last.marker is not None and not last.stream.query()

    def phase(self, context: str) -> None:
        """Begin a phase (``"step 12: forward"``, ``"checkpoint save"``): counts as progress."""
        self.context, self.layer = context, ""
        self.last_progress = time.monotonic()


def _ranks(group) -> str:
    if group is None or not dist.is_initialized():
        return "the world"
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == dist.get_world_size():
        return "the world"
    return f"ranks {ranks}" if len(ranks) <= 8 else f"ranks [{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)})"


RECORDER = FlightRecorder()


def record(op: str, group=None, layer: str | None = None) -> None:
    """:meth:`FlightRecorder.record` on this process's :data:`RECORDER`."""
    RECORDER.record(op, group, layer)


def phase(context: str) -> None:
    RECORDER.phase(context)


def enter_layer(name: str) -> None:
    """The forward has entered module ``name`` (a forward pre-hook calls this)."""
    RECORDER.layer = name


def _short(filename: str) -> str:
    """``.../site-packages/torch/x.py`` -> ``torch/x.py``; ``<repo>/train/x.py`` -> ``train/x.py``."""
    for marker in (os.sep + "site-packages" + os.sep,) + _OURS:
        i = filename.rfind(marker)
        if i >= 0:
            return filename[i + len(marker):] if marker.endswith("site-packages" + os.sep) else filename[i + 1:]
    return filename


def _main_thread_stack() -> list[traceback.FrameSummary]:
    frame = sys._current_frames().get(threading.main_thread().ident)
    return traceback.extract_stack(frame) if frame is not None else []


def _in_collective(stack: list[traceback.FrameSummary]) -> bool:
    return any(f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename for f in stack)


def _where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames in this library, then in torch.distributed, else the innermost."""
    ours = [f for f in stack if any(p in f.filename for p in _OURS)]
    torch_dist = [f for f in stack if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename]
    picked = ours[-3:] + (torch_dist[-1:] or stack[-1:])
    return " -> ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in picked) or "(no main thread)"


def timeout_report(rank: int, timeout_s: float, recorder: FlightRecorder = RECORDER,
                   stack: list[traceback.FrameSummary] | None = None) -> str:
    """The error the watchdog prints: the collective waited in (or, when the main thread is in
    none, that this rank is the one the others wait for), the recent collectives, the stack."""
    stack = _main_thread_stack() if stack is None else stack
    stuck, on_device = recorder.stuck_entry()
    last = stuck.describe() if stuck else "no collective yet"
    if on_device or _in_collective(stack):
        head = (f"rank {rank}: collective timeout: no progress for {timeout_s:.0f} s (parallel.timeout_s) in {last}; "
                "another rank of that group never joined it (it failed, hangs, or runs a different schedule)")
    else:
        head = (f"rank {rank}: no progress for {timeout_s:.0f} s (parallel.timeout_s) outside any collective, "
                f"after {last}: the other ranks wait for this one")
    recent = "\n".join("  " + e.describe() for e in list(recorder.entries)[-8:])
    return (f"{head}. Main thread at: {_where(stack)}"
            + ("\nlast collectives issued on this rank:\n" + recent if recent else ""))


class Watchdog:
    """A daemon thread that ends the process when the record makes no progress for
    ``timeout_s`` (see the module docstring); :meth:`stop` before leaving the process group."""

    def __init__(self, timeout_s: float, rank: int, recorder: FlightRecorder = RECORDER):
        self.timeout_s = timeout_s
        self.rank = rank
        self.recorder = recorder
        self._stop = threading.Event()
        recorder.last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="collective-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            if time.monotonic() - self.recorder.last_progress > self.timeout_s:
                print(timeout_report(self.rank, self.timeout_s, self.recorder), file=sys.stderr, flush=True)
                time.sleep(REPORT_WAIT_S)
                os._exit(EXIT_CODE)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
