"""Around the exchanges: timing them without a host sync, and running work beside them.

:class:`CommTimer` is what ``log.time_comm`` reads; :class:`SideStreams` and :func:`run_beside`
let a pass that does not need the exchange's result run on a second CUDA stream while the
exchange runs on the current one.
"""

import time
from typing import Callable

import torch


class CommTimer:
    """Milliseconds spent in communication calls, accumulated with no host sync per call.

    On CUDA a span records a pair of timing events on the current stream (no wait) around the
    call; the elapsed times are resolved only in :meth:`read_ms`. A span runs from the moment the
    compute stream reaches the collective until the collective has finished on that stream, so it
    includes the wait for the slowest peer. On a CPU (gloo returns once the exchange is done) a
    span is a ``time.perf_counter`` difference.
    """

    def __init__(self):
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_ms = 0.0

    def start(self, device: torch.device):
        if device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            return begin
        return time.perf_counter()

    def stop(self, begin) -> None:
        if isinstance(begin, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((begin, end))
        else:
            self._host_ms += (time.perf_counter() - begin) * 1e3

    def read_ms(self) -> float:
        """Milliseconds of every span since the last read, then reset. Waits for pending events
        (call at log time, when the device has been synchronised anyway)."""
        total = self._host_ms
        for begin, end in self._events:
            end.synchronize()
            total += begin.elapsed_time(end)
        self._events.clear()
        self._host_ms = 0.0
        return total


class SideStreams:
    """One side stream per CUDA device, made at first use and kept: a resource of its owner,
    not per-call state (a stream per call would cost a creation each time)."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def get(self, device: torch.device) -> "torch.cuda.Stream | None":
        """The side stream for ``device``; None off CUDA (then there is nothing to overlap)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def run_beside(stream: "torch.cuda.Stream | None", main: Callable[[], None], side: Callable[[], None]) -> None:
    """``main()`` on the current stream while ``side()`` runs on ``stream``; both start after the
    work enqueued so far, and the current stream waits for both.

    ``main`` is enqueued first, so its start does not wait for the host to launch ``side``. Every
    tensor ``side`` touches is referenced until the join, so the caching allocator cannot hand its
    memory to later work on the current stream too early. With no stream (CPU): the two run one
    after the other.
    """
    if stream is None:
        main()
        side()
        return
    ready = torch.cuda.current_stream().record_event()
    main()
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        side()
    torch.cuda.current_stream().wait_event(stream.record_event())
