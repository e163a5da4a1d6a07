"""Where a training step's time goes: a ``torch.profiler`` trace of whole steps, each GPU kernel
put in one category, summarised as a table.

    torchrun --standalone --nproc_per_node=2 bench/step_profile.py --config configs/olmoe_bench.yaml \
        --label "before" --out bench/results/step_profile.md [--warm 8] [--steps 3] [--timed 10] \
        [--section.key=value ...]

How a kernel gets its category. The script (not the library) marks regions of the forward with
``record_function`` ranges from module hooks and wrappers: each :class:`attention.Attention`,
each ``RMSNorm``, the router, the routing plan (capacity bookkeeping and the pair sort), the
dispatcher's ``dispatch`` and ``combine``, the grouped experts, dense MLPs, the LM head + loss
(from the final norm to the loss), and the gradient sync, clipping and optimizer step of
:meth:`train.trainer.Trainer.train_step`. A forward kernel takes the innermost range around the
CPU op that launched it; a backward kernel is launched by an autograd node whose sequence number
is that of the forward op that made it, and takes that op's range (so the backward of the
attention counts as attention). NCCL kernels go by their collective: all-to-all and send/recv
are the expert-parallel exchange (the P2P dispatcher's copy-engine mode: its memcpys and their
signal, :func:`claim_exchange`), the rest in the optimizer phase is gradient sync. What is left
(residual adds, the embedding, casts) is "elementwise, other".

What the columns mean. ``GPU ms``: the summed durations of the category's kernels per step (on
several streams they may overlap, so the column can sum past the step). ``exposed``: the part
of the category's kernel time during which no kernel of another category runs; for the
all-to-all that is the communication nobody hides. ``idle``: step time with no kernel running
(host work, launch gaps, waits). Rank 0's trace; the step time is the mean over the profiled
steps of the slowest rank's time. Every rank's own summary gives the per-rank table: a rank
waiting for a slower peer shows that wait inside its exchange kernels (P2P's spin, NCCL's
kernels), so the exchange's own exposed cost is read on the rank with the most other work (the
one the others wait for); the closing SUMMARY line gives both rank 0's all-to-all and that rank's
exchange. The profiler inflates a host-bound step (the NCCL EP 2 step:
420 profiled against 327 ms), so ``--timed N`` then times N steps without it, and the headline
tokens/s and MFU come from those. Its CPU-side recording also lengthens the ranks' host work
unevenly, and the rank that falls behind shows up as the other's wait in the exchange: so the
same number of steps is profiled again with the GPU's activity alone (no ranges there: a kernel
counts as the exchange's by its name, if most of its time in the full profile was), and the
per-rank table of that low-overhead profile gives the exposed exchange of the SUMMARY's last
column but one.

With ``--train.cuda_graph=true`` the micro-batches replay a CUDA graph: their kernels run under
no range (the hooks ran once, at the capture). The launch's first step is eager, so it is
profiled too, and each replayed kernel that no range claims takes the category its name spent
most of its time in there (cuBLAS kernels serve several categories and go to the one that used
them most: an approximation of the split, not of the exchange, whose kernels are its own).
"""

import argparse
import bisect
import collections
import datetime
import gzip
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

import moe.layer  # noqa: E402
import train.trainer  # noqa: E402
from attention import Attention  # noqa: E402
from common import bench_trainer, timed_steps, trainer_mfu  # noqa: E402
from moe import DenseMLP, GroupedExperts, MoELayer, Router  # noqa: E402
from train.flops import param_counts  # noqa: E402
from train.trainer import planned_gc  # noqa: E402

CATEGORIES = (
    "attention", "expert GEMMs", "all-to-all", "dispatch/combine", "router + routing plan", "dense MLP",
    "norms", "LM head + loss", "elementwise, other", "gradient sync", "optimizer + clip",
)
OTHER = "elementwise, other"  # what no range claims
ALL_TO_ALL = "all-to-all"
# the exchange's categories: NCCL's kernels and the P2P copy-engine mode's memcpys are the all-to-all,
# the P2P kernels (whose peer stores run inside them) and the row kernels dispatch/combine
EXCHANGE = (ALL_TO_ALL, "dispatch/combine")
EXCHANGE_ROW = "(the exchange: all-to-all + dispatch/combine)"
IDLE = "idle (no kernel running)"
# kernels that under expert parallelism serve the exchange alone, whatever range launched them: the
# P2P kernels and the row kernels of both transports (kernel_floor's gather_sum and scatter_rows:
# under EP only the dispatcher's combine, its backward and the way back call them). The ranges
# alone mis-filed them: on 2×H200 (2026-11-28, P2P, graphed) `_push_back_kernel` and
# `_expand_rows_kernel` took "router + routing plan", a backward node carrying the sequence
# number of a forward op outside the dispatcher's range, so the exchange read 6.5 % where its
# kernels took ≥ 11 % of the step.
EP_EXCHANGE_KERNELS = frozenset({
    "_dispatch_rows_kernel", "_push_back_kernel", "_expand_rows_kernel", "_gather_sum_kernel",
    "_scatter_rows_kernel", "_headers_kernel", "_locate_pairs_kernel", "_expert_rows_kernel", "_signal_peers_kernel",
    "_wait_flag_kernel", "_exchange_counts_kernel",
})


class Ranges:
    """``record_function`` ranges opened and closed from hooks, named ``cat::<category>``."""

    def __init__(self):
        self.open = []

    def enter(self, category: str) -> None:
        self.open.append(torch.ops.profiler._record_function_enter_new(f"cat::{category}", None))

    def exit(self) -> None:
        torch.ops.profiler._record_function_exit._RecordFunction(self.open.pop())

    def wrap(self, fn, category: str):
        def wrapped(*args, **kwargs):
            self.enter(category)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()
        return wrapped

    def around_module(self, module: nn.Module, category: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.enter(category))
        module.register_forward_hook(lambda *_: self.exit())


def instrument(trainer) -> Ranges:
    """Mark the regions of ``trainer``'s step (see the module docstring)."""
    ranges = Ranges()
    model = trainer.model
    for mod in model.modules():
        if isinstance(mod, MoELayer):  # what the inner ranges leave: stats, aux losses, counts, weights
            ranges.around_module(mod, "router + routing plan")
        elif isinstance(mod, Attention):
            ranges.around_module(mod, "attention")
        elif isinstance(mod, nn.RMSNorm) and mod is not model.norm:
            ranges.around_module(mod, "norms")
        elif isinstance(mod, Router):
            ranges.around_module(mod, "router + routing plan")
        elif isinstance(mod, GroupedExperts):
            ranges.around_module(mod, "expert GEMMs")
        elif isinstance(mod, DenseMLP):
            ranges.around_module(mod, "dense MLP")
    # the LM head + loss: from the final norm's start to the end of the micro-batch's loss
    model.norm.register_forward_pre_hook(lambda *_: ranges.enter("LM head + loss"))
    loss = trainer._loss

    def micro_batch_loss(*batch):
        depth = len(ranges.open)
        try:
            return loss(*batch)
        finally:
            while len(ranges.open) > depth:
                ranges.exit()
    trainer._loss = micro_batch_loss
    moe.layer.plan_routing = ranges.wrap(moe.layer.plan_routing, "router + routing plan")
    # one dispatcher serves every layer under EP; without EP each layer has its own
    for d in {id(m.dispatcher): m.dispatcher for m in model.modules() if isinstance(m, MoELayer)}.values():
        d.dispatch = ranges.wrap(d.dispatch, "dispatch/combine")
        d.combine = ranges.wrap(d.combine, "dispatch/combine")
    train.trainer.reduce_gradients = ranges.wrap(train.trainer.reduce_gradients, "gradient sync")
    train.trainer.clip_grad_norm_ = ranges.wrap(train.trainer.clip_grad_norm_, "optimizer + clip")
    trainer.optimizer.step = ranges.wrap(trainer.optimizer.step, "optimizer + clip")
    trainer.optimizer.zero_grad = ranges.wrap(trainer.optimizer.zero_grad, "optimizer + clip")
    return ranges


def _stacks(ops: list[dict]):
    """Per thread, ``at(pid, tid, ts) -> [ops enclosing ts, innermost first]``. Ops nest per
    thread, so each gets its parent from one sweep; the innermost op around ``ts`` is then the
    last op starting before ``ts`` or one of its ancestors."""
    tables = {}
    by_tid = collections.defaultdict(list)
    for e in ops:
        by_tid[(e["pid"], e["tid"])].append(e)
    for key, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        parent, open_ = [], []
        for i, e in enumerate(evs):
            while open_ and evs[open_[-1]]["ts"] + evs[open_[-1]]["dur"] < e["ts"]:
                open_.pop()
            parent.append(open_[-1] if open_ else -1)
            open_.append(i)
        tables[key] = (evs, [e["ts"] for e in evs], parent)

    def at(pid, tid, ts):
        evs, starts, parent = tables.get((pid, tid), ([], [], []))
        i = bisect.bisect_right(starts, ts) - 1
        while i >= 0 and evs[i]["ts"] + evs[i]["dur"] < ts:
            i = parent[i]
        out = []
        while i >= 0:
            out.append(evs[i])
            i = parent[i]
        return out
    return at


def _range_of(stack: list[dict]) -> str | None:
    """The innermost ``cat::`` range in ``stack`` (innermost first)."""
    for e in stack:
        if e["name"].startswith("cat::"):
            return e["name"][5:]
    return None


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def host_syncs(events: list[dict], at) -> collections.Counter:
    """Where the host waits for the GPU: ``(range, innermost op) -> count`` over the trace. The
    profiler's own step-end synchronize has no op around it and is left out."""
    out = collections.Counter()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNCS:
            stack = at(e["pid"], e["tid"], e["ts"])
            ops = [x["name"] for x in stack if x.get("cat") == "cpu_op"]
            if ops:
                out[(_range_of(stack) or "-", ops[0][:60])] += 1
    return out


def classify(events: list[dict]) -> tuple[list[tuple[float, float, str, str]], collections.Counter]:
    """(start µs, end µs, category, kernel name) of every GPU kernel, memset and memcpy in the
    trace's complete events, and the :func:`host_syncs`."""
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    at = _stacks(ops)
    # the range of each forward op that records a sequence number, for the backward node that
    # carries the same number (autograd::engine::evaluate_function: <Node>)
    seq_range = {}
    for e in ops:
        seq = e.get("args", {}).get("Sequence number")
        if seq is None:
            continue
        stack = at(e["pid"], e["tid"], e["ts"])
        if any(x["name"].startswith("autograd::engine") for x in stack):
            continue  # an op of a backward carries its node's number too: not the forward's
        cat = _range_of(stack)
        if cat is not None:
            seq_range.setdefault(seq, cat)
    out = []
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        stack = at(launch["pid"], launch["tid"], launch["ts"]) if launch is not None else []
        cat = _range_of(stack)
        if cat is None:  # a backward kernel: the range of the forward op its node came from
            for e in stack:
                seq = e.get("args", {}).get("Sequence number")
                if e["name"].startswith("autograd::engine") and seq in seq_range:
                    cat = seq_range[seq]
                    break
        if k["name"].startswith("nccl"):
            if "SendRecv" in k["name"] or "AllToAll" in k["name"]:
                cat = ALL_TO_ALL
            elif cat in (None, "optimizer + clip"):  # an all-reduce in a layer (counts, aux inputs) keeps its range
                cat = "gradient sync"
        out.append((k["ts"], k["ts"] + k["dur"], cat or OTHER, k["name"]))
    return out, host_syncs(events, at)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) not covered by union(b)."""
    a, b = _union(a), _union(b)
    total, j = 0.0, 0
    for s, e in a:
        covered = 0.0
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
        total += (e - s) - covered
    return total


def _busy_ms(intervals, steps: int) -> float:
    """ms a step during which at least one of ``intervals`` (µs) runs."""
    return sum(e - s for s, e in _union(intervals)) / 1e3 / steps


def summarise(kernels, step_ms: float, steps: int) -> list[tuple[str, float, float]]:
    """(category, GPU ms per step, exposed ms per step) in CATEGORIES order, then the exchange's
    categories as one (its exposed time: while no kernel of another category runs, so an
    all-to-all beside a dispatch/combine kernel counts once, not zero times), idle."""
    rows = []
    for cats in [(cat,) for cat in CATEGORIES] + [EXCHANGE]:
        mine = [(s, e) for s, e, c, _ in kernels if c in cats]
        others = [(s, e) for s, e, c, _ in kernels if c not in cats]
        busy = sum(e - s for s, e in mine) / 1e3 / steps
        exposed = _minus(mine, others) / 1e3 / steps
        rows.append((cats[0] if len(cats) == 1 else EXCHANGE_ROW, busy, exposed))
    lo = min(s for s, _, _, _ in kernels)
    hi = max(e for _, e, _, _ in kernels)
    covered = _busy_ms([(s, e) for s, e, _, _ in kernels], steps)
    rows.append((IDLE, max(step_ms - covered, 0.0), max(step_ms - covered, 0.0)))
    rows.append(("(trace span per step)", (hi - lo) / 1e3 / steps, float("nan")))
    return rows


def top_kernels(kernels, steps: int, n: int = 12) -> list[tuple[str, str, float]]:
    """The ``n`` (kernel, category) pairs of most GPU time, ms per step."""
    total = collections.Counter()
    for s, e, c, name in kernels:
        total[(name, c)] += (e - s) / 1e3 / steps
    return [(name[:90], c, ms) for (name, c), ms in total.most_common(n)]


def routing_at_end(trainer) -> list[float]:
    """Every MoE layer's load max/mean (over the world) in the latest micro-batch (collective)."""
    unused = dict.fromkeys(trainer.moe_layers, 0.0)  # the aux-loss columns, not read here
    metrics, _, _ = train.trainer.moe_metrics(trainer.model, trainer.rt, unused, unused)
    return [metrics[f"moe/layer{i}/load_imbalance"] for i in range(len(trainer.moe_layers))]


def _exchange_ms(rows) -> float:
    """Exposed ms a step of the exchange's categories (all-to-all, dispatch/combine) together."""
    return next(x for c, _, x in rows if c == EXCHANGE_ROW)


def _compute_ms(rows) -> float:
    """Exposed ms a step of everything but the exchange and idle: the rank's own work."""
    return sum(x for c, _, x in rows if c in CATEGORIES and c not in EXCHANGE)


def _busiest(rank_rows) -> int:
    """The rank with the most own work: the one the others wait for, whose exchange is the
    exchange's own cost (the others' add their wait for it)."""
    return max(range(len(rank_rows)), key=lambda r: _compute_ms(rank_rows[r]))


def per_rank_table(rank_rows, step_ms: float) -> list[str]:
    """Markdown lines: per rank, its own work, its exposed exchange and its idle time (ms a step and
    % of the step), the busiest rank (:func:`_busiest`) marked."""
    busiest = _busiest(rank_rows)
    lines = ["Per rank (exposed ms a step; the busiest rank, marked *, is the one the others wait for):", "",
             "| rank | own work | exchange (all-to-all + dispatch/combine) | idle |", "|---|---|---|---|"]
    for r, rows in enumerate(rank_rows):
        idle = next(x for c, _, x in rows if c == IDLE)
        cells = [f"{v:.1f} ({100 * v / step_ms:.1f} %)" for v in (_compute_ms(rows), _exchange_ms(rows), idle)]
        lines.append(f"| {r}{' *' if r == busiest else ''} | " + " | ".join(cells) + " |")
    return lines + [""]


CPU_AND_CUDA = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def profiled_steps(trainer, steps: int, activities) -> tuple[float, float, list[dict], torch.profiler.profile]:
    """Profile ``steps`` training steps, each started together on every rank: (the slowest rank's
    mean step ms, this rank's own summed step ms, this rank's trace as complete events, the
    profiler)."""
    rt = trainer.rt
    torch.cuda.synchronize()
    times = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            if rt.distributed:
                dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            trainer.collect_garbage()
    step_s = torch.tensor(times, device=rt.device)
    if rt.distributed:
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    trace = os.path.join(tempfile.mkdtemp(), f"trace{rt.rank}.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    return float(step_s.mean()) * 1e3, sum(times) * 1e3, events, prof


def claim_exchange(kernels, copies: bool = False):
    """``kernels`` (start, end, category, name) with those of :data:`EP_EXCHANGE_KERNELS` in the
    exchange's "dispatch/combine" (for a run under expert parallelism). With ``copies`` (the P2P
    dispatcher's copy-engine mode) the transfer is its own: the peer memcpys that move the rows
    and the one-program signal after them go to "all-to-all", the role NCCL's kernels have, so the
    rows' transfer reads apart from the local expand and sums that a single GPU's layer runs too
    (the waits for the other rank are the one-program wait kernels, still "dispatch/combine"). A
    rank's own block is not copied (the dispatcher reads it in place), so no within-device memcpy
    is the exchange's (the gradient buckets' and the LM loss's are not)."""
    def claimed(n, c):
        if copies and (n.startswith("Memcpy PtoP") or n == "_signal_peers_kernel"):
            return ALL_TO_ALL
        return "dispatch/combine" if n in EP_EXCHANGE_KERNELS else c
    return [(s, e, claimed(n, c), n) for s, e, c, n in kernels]


def name_categories(kernels) -> dict[str, str]:
    """Each kernel name's category: the one it spent most of its time in."""
    time = collections.defaultdict(collections.Counter)
    for s, e, c, name in kernels:
        time[name][c] += e - s
    return {name: t.most_common(1)[0][0] for name, t in time.items()}


def recategorise(kernels, names: dict[str, str]):
    """``kernels`` with those that no range claimed ("elementwise, other": a CUDA graph's replays)
    in the category ``names`` gives their name."""
    return [(s, e, names.get(n, c) if c == OTHER else c, n) for s, e, c, n in kernels]


def exchange_kernels(kernels) -> set[str]:
    """The kernel names that spend most of their time in the exchange's categories in the full
    profile: how a GPU-only trace, which has no ranges, tells the exchange's kernels apart."""
    total, exch = collections.Counter(), collections.Counter()
    for s, e, c, name in kernels:
        total[name] += e - s
        if c in EXCHANGE:
            exch[name] += e - s
    return {n for n in total if exch[n] > total[n] / 2}


def light_kernels(events: list[dict], own_ms: float) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of a GPU-only trace's kernels, memsets and memcpys in the last
    ``own_ms`` before its last kernel's end: the profiled steps (each ends with a synchronize).
    A trace can hold more (on 2026-11-28 one rank's held 2.0x a step's kernels: work of the
    profile before it, delivered late)."""
    kernels = [(k["ts"], k["ts"] + k["dur"], k["name"]) for k in events
               if k.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    end = max(e for _, e, _ in kernels)
    return [k for k in kernels if k[0] >= end - own_ms * 1e3]


def light_split(kernels, exchange: set[str], step_ms: float, steps: int) -> tuple[float, float, float]:
    """From :func:`light_kernels`: (own work, exposed exchange, idle) in ms a step of
    ``step_ms``, the kernels named in ``exchange`` against all others."""
    mine = [(s, e) for s, e, n in kernels if n in exchange]
    others = [(s, e) for s, e, n in kernels if n not in exchange]
    exposed = _minus(mine, others) / 1e3 / steps
    covered = _busy_ms([(s, e) for s, e, _ in kernels], steps)
    return _busy_ms(others, steps), exposed, max(step_ms - covered, 0.0)


# the exchange's kernels that can wait for another rank: NCCL's, and the P2P kernels that spin on a
# flag (the one-program waits: the counts' exchange, and the way back's before its sum)
WAITING_P2P_KERNELS = frozenset({"_exchange_counts_kernel", "_wait_flag_kernel"})


def can_wait(name: str) -> bool:
    return name.startswith("nccl") or name in WAITING_P2P_KERNELS


def exchange_launches(kernels, exchange: set[str]) -> dict[str, list[tuple[float, float]]]:
    """Per exchange kernel name that can wait (:func:`can_wait`), its launches' (start µs, end
    µs) in order: what :func:`wait_split` matches across ranks (a kernel that does not wait, e.g.
    a copy, started early does no waiting)."""
    out = collections.defaultdict(list)
    for s, e, n in sorted(kernels):
        if n in exchange and can_wait(n):
            out[n].append((s, e))
    return dict(out)


def wait_split(rank_launches, steps: int) -> tuple[list[float], float]:
    """Split each rank's exchange kernel time into waiting for a later rank and the rest.

    Every rank launches the exchange's kernels in the same order, so the i-th launch of a name
    is the same exchange on every rank (the lists are aligned at their ends: the clipped start
    of a trace may hold fewer). A launch that starts before the latest rank's waits (spins) until
    that rank starts: wait = min(latest start - own start, own duration); the rest moves and
    sums rows. The GPUs' timestamps are the host's clock (one host), so starts compare across
    ranks. Returns (each rank's wait ms a step, the median end-time spread µs of the matched
    launches: small if the clocks agree, since a kernel that waits for a peer ends soon after
    it)."""
    waits = [0.0] * len(rank_launches)
    spreads = []
    for name in set.intersection(*(set(r) for r in rank_launches)):
        n = min(len(r[name]) for r in rank_launches)
        tails = [r[name][-n:] for r in rank_launches]
        for i in range(n):
            latest = max(t[i][0] for t in tails)
            for r, t in enumerate(tails):
                s, e = t[i]
                waits[r] += min(max(latest - s, 0.0), e - s)
            ends = [t[i][1] for t in tails]
            spreads.append(max(ends) - min(ends))
    spreads.sort()
    return [w / 1e3 / steps for w in waits], spreads[len(spreads) // 2] if spreads else float("nan")


GAP_BUCKETS_US = (10.0, 100.0, 1e3, 1e4)  # the idle gaps' length buckets: ≤ 10 µs, ≤ 100 µs, ... > 10 ms


def idle_gaps(kernels, steps: int, longest: int = 3):
    """From :func:`light_kernels`: the GPU's idle gaps (no kernel running), to tell a host that is
    slow everywhere (many short gaps: each launch late) from one that stalls (a few long ones:
    a collection, an allocation, a wait; the profiled steps' boundaries, a barrier and a
    synchronize each, are among them). Returns (count and ms a step per bucket of
    :data:`GAP_BUCKETS_US`, the last bucket open; the ``longest`` gaps as (ms, ms from the
    trace's first kernel, the kernel before, the kernel after))."""
    ks = sorted(kernels)
    gaps, (end, last) = [], (ks[0][1], ks[0][2]) if ks else (0.0, "")
    for s, e, n in ks[1:]:
        if s > end:
            gaps.append((s - end, end, last, n))
        if e > end:
            end, last = e, n
    buckets = [[0, 0.0] for _ in range(len(GAP_BUCKETS_US) + 1)]
    for g, *_ in gaps:
        b = buckets[sum(g > edge for edge in GAP_BUCKETS_US)]
        b[0] += 1
        b[1] += g
    per_step = [(c / steps, us / 1e3 / steps) for c, us in buckets]
    first = ks[0][0] if ks else 0.0
    top = [(g / 1e3, (at - first) / 1e3, before, after) for g, at, before, after in sorted(gaps, reverse=True)[:longest]]
    return per_step, top


def gap_table(rank_gaps) -> list[str]:
    """Markdown lines of :func:`idle_gaps` per rank."""
    edges = ["≤ 10 µs", "10–100 µs", "0.1–1 ms", "1–10 ms", "> 10 ms"]
    lines = ["Idle gaps of the GPU-only profile (count / ms a step by length; many short gaps: every launch late, "
             "a few long ones: the host stalled):", "",
             "| rank | " + " | ".join(edges) + " | longest (ms, at ms, between) |", "|---" * (len(edges) + 2) + "|"]
    for r, (per_step, top) in enumerate(rank_gaps):
        longest = "; ".join(f"{g:.2f} at {at:.1f}: `{a[:30]}` → `{b[:30]}`" for g, at, a, b in top)
        lines.append(f"| {r} | " + " | ".join(f"{c:,.0f} / {ms:.1f}" for c, ms in per_step) + f" | {longest} |")
    return lines + [""]


def light_table(rank_light, step_ms: float, busiest: int, waits: list[float], spread_us: float) -> list[str]:
    """Markdown lines of :func:`light_split` per rank (of a ``step_ms`` step) with
    :func:`wait_split`'s wait, the rank with the most own work (``busiest``) marked."""
    lines = ["GPU activity alone (the profiler's low-overhead mode; ms a step and % of that profile's step, "
             f"{step_ms:.1f} ms; the rank with the most own work marked *; the exchange kernels' wait "
             f"for a later rank from the launches' starts, median end spread of matched launches {spread_us:.0f} µs):",
             "", "| rank | own work (busy) | exposed exchange | of which waiting for a later rank | idle |",
             "|---|---|---|---|---|"]
    for r, (own, exch, idle) in enumerate(rank_light):
        cells = [f"{v:.1f} ({100 * v / step_ms:.1f} %)" for v in (own, exch, waits[r], idle)]
        lines.append(f"| {r}{' *' if r == busiest else ''} | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--label", default="", help="what this run is (a before/after name), for the table")
    ap.add_argument("--warm", type=int, default=8, help="steps before the profiled ones (autotuning, warm-up)")
    ap.add_argument("--steps", type=int, default=3, help="steps profiled")
    ap.add_argument("--out", help="append the table to this markdown file (rank 0)")
    ap.add_argument("--keep-trace", help="write rank 0's trace (complete events only) here, gzipped JSON")
    ap.add_argument("--timed", type=int, default=0,
                    help="then time this many steps (after one more untimed) without the profiler, which inflates "
                         "a host-bound step: the tokens/s and MFU of the headline come from them")
    ap.add_argument("--host-table", type=int, default=0, metavar="N",
                    help="also print rank 0's N CPU ops of most self time in the profiled steps (where a "
                         "host-bound step's host time goes)")
    args, extra = ap.parse_known_args()
    trainer = bench_trainer(args.config, args.warm + 2 * args.steps + args.timed + 2, extra)
    cfg, rt = trainer.cfg, trainer.rt
    instrument(trainer)
    graphed = trainer.graph is not None
    with planned_gc(cfg.train.gc_every):  # the garbage collection as the training loop does it
        if graphed:  # the launch's eager first step: where the replayed kernels' names get their categories
            names = name_categories(classify(profiled_steps(trainer, 1, CPU_AND_CUDA)[2])[0])
        for _ in range(args.warm - graphed):
            trainer.train_step()
            trainer.collect_garbage()
        step_ms, _, events, prof = profiled_steps(trainer, args.steps, CPU_AND_CUDA)
        # the same steps with the GPU's activity alone: little host overhead (the full profile
        # lengthens a step by hundreds of ms, unevenly across ranks, and a rank that falls behind
        # shows up as the other's wait in its exchange kernels)
        light_ms, light_own_ms, light_events, _ = profiled_steps(trainer, args.steps, [torch.profiler.ProfilerActivity.CUDA])
    timed_ms = timed_steps(trainer, args.timed) if args.timed else step_ms
    routing = routing_at_end(trainer)
    peak_gb = torch.cuda.max_memory_allocated() / 1e9
    # every rank summarises its own trace: a rank that waits for a slower peer shows the wait
    # inside its exchange kernels, the slower one (the critical path) shows the exchange itself
    kernels, syncs = classify(events)
    if graphed:
        kernels = recategorise(kernels, names)
    if rt.ep > 1:
        kernels = claim_exchange(kernels, cfg.parallel.dispatcher == "p2p" and cfg.parallel.p2p_copy == "copy_engine")
    rows = summarise(kernels, step_ms, args.steps)
    # the host's load: each kernel, memset and memcpy is one launch (the step is host-bound where
    # a rank's host falls behind: step_profile.md, 2026-11-28)
    launches = collections.Counter(c for _, _, c, _ in kernels)
    launches["(trace span per step)"] = len(kernels)
    exchange = exchange_kernels(kernels)
    light = light_kernels(light_events, light_own_ms)
    mine = (rows, light_split(light, exchange, light_ms, args.steps), exchange_launches(light, exchange),
            idle_gaps(light, args.steps))
    gathered = [mine]
    if rt.distributed:
        gathered = [None] * rt.world_size
        dist.all_gather_object(gathered, mine)
    rank_rows, rank_light, rank_launches, rank_gaps = (list(x) for x in zip(*gathered))
    waits, spread_us = wait_split(rank_launches, args.steps)
    lbusy = max(range(len(rank_light)), key=lambda r: rank_light[r][0])  # the most own work
    if rt.rank == 0:
        if args.keep_trace:
            with gzip.open(args.keep_trace, "wt") as f:
                json.dump({"traceEvents": events}, f)
        tokens = trainer.tokens_per_step
        mfu = trainer_mfu(trainer, step_ms / 1e3)
        timed_mfu = mfu * step_ms / timed_ms
        counts = param_counts(trainer.model, cfg, rt.ep)
        lines = [
            f"## {args.label or args.config}",
            "",
            f"- device: {torch.cuda.get_device_name(0)} × {rt.world_size} (EP {rt.ep}); torch {torch.__version__}; "
            f"Python {platform.python_version()}; {datetime.datetime.now():%Y-%m-%d %H:%M}",
            f"- command: `torchrun --nproc_per_node={rt.world_size} bench/step_profile.py --config {args.config} "
            f"--warm {args.warm} --steps {args.steps} --timed {args.timed}{''.join(' ' + x for x in extra)}`",
            f"- {counts['params_total'] / 1e9:.2f}B params, {counts['params_active'] / 1e9:.2f}B active; "
            f"{tokens:,} tokens/step; step {step_ms:.1f} ms (mean of {args.steps}, slowest rank); "
            f"{tokens / (step_ms / 1e3):,.0f} tokens/s; MFU {mfu:.1%}; peak memory rank 0 {peak_gb:.1f} GB",
            *([f"- without the profiler: step {timed_ms:.1f} ms (mean of {args.timed}, slowest rank); "
               f"**{tokens / (timed_ms / 1e3):,.0f} tokens/s; MFU {timed_mfu:.1%}**"] if args.timed else []),
            f"- load max/mean per MoE layer at the last step (world): {' '.join(f'{r:.1f}' for r in routing)}",
            "",
            "| category | GPU ms/step | % of step | exposed ms/step | exposed % | launches/step |",
            "|---|---|---|---|---|---|",
            *[f"| {c} | {b:.1f} | {100 * b / step_ms:.1f} | {x:.1f} | {100 * x / step_ms:.1f} | "
              f"{launches[c] / args.steps:,.0f} |" for c, b, x in rows],
            "",
            *per_rank_table(rank_rows, step_ms),
            *light_table(rank_light, light_ms, lbusy, waits, spread_us),
            *gap_table(rank_gaps),
            "Top kernels (rank 0, ms/step):",
            "",
            "| kernel | category | ms/step |",
            "|---|---|---|",
            *[f"| `{n}` | {c} | {ms:.2f} |" for n, c, ms in top_kernels(kernels, args.steps)],
            "",
            f"Host syncs per step (the host waits for the GPU; {sum(syncs.values()) / args.steps:g} in all):",
            "",
            "| range | op | per step |",
            "|---|---|---|",
            *[f"| {r} | `{op}` | {n / args.steps:g} |" for (r, op), n in syncs.most_common()],
            "",
        ]
        text = "\n".join(lines)
        print(text, flush=True)
        if args.host_table:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.host_table), flush=True)
        a2a = next(x for c, _, x in rows if c == ALL_TO_ALL)
        busiest = rank_rows[_busiest(rank_rows)]
        lexch = rank_light[lbusy][1]
        # one line per run for a driver script's closing table
        print(f"SUMMARY | {args.label} | {timed_ms:.1f} | {tokens / (timed_ms / 1e3):,.0f} | {timed_mfu:.1%} | "
              f"{peak_gb:.1f} | {100 * a2a / step_ms:.1f} | {100 * _exchange_ms(busiest) / step_ms:.1f} | "
              f"{100 * lexch / light_ms:.1f} | {100 * (lexch - waits[lbusy]) / light_ms:.1f} | {max(routing, default=float('nan')):.1f} |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    trainer.close()


if __name__ == "__main__":
    main()
