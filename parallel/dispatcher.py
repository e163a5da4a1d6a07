"""Expert-parallel dispatcher: tokens travel to their expert's rank by all-to-all, and back.

Legend: T tokens, D model dim, K slots per token, P = T·K pairs, E experts, G ranks of the
expert-parallel group, L = E / G experts per rank, S pairs this rank keeps and sends, R rows it
receives for its L experts.

``dispatch``:
1. ``plan.order_P`` lists the kept pairs sorted by expert, hence by destination rank (rank g holds
   experts ``[g·L, (g+1)·L)``), then the dropped pairs: pair (t, k)'s place in that list is its
   send position.
2. Per-expert counts go out with one small all-to-all (E int64 per rank), and both the sent and
   received counts come to the host in ONE device->host copy: ``all_to_all_single`` takes its
   split sizes as Python lists, so this is the one host sync of the layer's dispatch. The rows
   for the other ranks are packed (one pass over the tokens, :mod:`parallel.pair_rows`) while
   that copy is in flight.
3. Those rows move with one variable-split ``all_to_all_single`` in which this rank's own chunk is
   empty: the rows for its own experts are written straight into the experts' input while the
   exchange runs (no NCCL self copy, and that pass is off the critical path). The experts' rows
   are [own rows; rows from each other source rank], each block ordered by local expert: the
   grouped GEMM takes them as G·L row segments, segment ``b·L + l`` multiplied by local expert
   l's weights (see ``moe.kernels.grouped_mm``), with no regrouping pass.

``combine`` sends the other ranks' expert outputs back with the reverse exchange and sums each
token's K rows, from the received buffer or straight from the own rows, with the combine weights
in one pass. The backward of each is the other's forward with the roles swapped: the dispatch
backward is a reverse exchange plus one summing pass, the combine backward packs ``w · dout``
for the remote pairs, exchanges it and writes the own pairs' rows during the exchange.
History, measured on 2×H200 (bench/all_to_all.py, 2026-11-22): regrouping by expert and
un-permuting into pair order reached 0.41–0.65× the raw exchange's bandwidth at 4k–32k tokens;
the version with a gather (K reads of each token row) before the exchange and a fused combine
after it, both on the critical path, reached 0.22–0.81×.

Opt-in timing (``time_comm=True`` or a :class:`CommTimer` set as ``comm_timer``): the counts
exchange and both row exchanges, forward and backward, add their spans to the timer, which the
training loop reads once per log window (see :class:`CommTimer`).
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.capacity import RoutingPlan
from moe.dispatch import LocalDispatcher, LocalDispatchMeta
from parallel.all_to_all import all_reduce_sum
from parallel.pair_rows import gather_pairs_sum, scatter_pairs


@dataclass(frozen=True)
class AllToAllMeta:
    """What ``combine`` needs from ``dispatch``.

    route: where each pair's row went (send positions, destination ranks' bounds, the group).
    send_splits, recv_splits: rows sent to / received from each group rank, this rank's own rows
        included (they are moved locally, not by the exchange).
    empty_rows_RD: when R = 0, the (0, D) rows handed to the experts (see :func:`_keep_in_graph`).
    """

    route: "_Route"
    send_splits: list[int]
    recv_splits: list[int]
    empty_rows_RD: torch.Tensor | None


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


def _timed_all_to_all(out_ND, in_ND, out_splits, in_splits, group, timer: "CommTimer | None") -> None:
    """``all_to_all_single`` on the current stream, its span added to ``timer`` when there is one
    (synchronous op: since torch 2.8 NCCL then runs on the caller's stream with no event
    handshakes; ``async_op=True`` goes through an internal stream and, measured on 2×H200,
    doubled the time of a 4k-token dispatch + combine)."""
    begin = timer.start(in_ND.device) if timer is not None else None
    dist.all_to_all_single(out_ND, in_ND, out_splits, in_splits, group=group)
    if begin is not None:
        timer.stop(begin)


def _exchange(out_ND, in_ND, out_splits, in_splits, route: "_Route") -> None:
    """:func:`_timed_all_to_all` over the route's group and timer."""
    _timed_all_to_all(out_ND, in_ND, out_splits, in_splits, route.group, route.timer)


def _exchange_beside(route: "_Route", out_ND, in_ND, out_splits, in_splits, fn) -> None:
    """:func:`_exchange` on the current stream while ``fn`` runs on the side stream; both start
    after the work enqueued so far, and the current stream waits for both.

    The exchange is enqueued first, so its start does not wait for the host to launch ``fn``.
    Every tensor ``fn`` touches is referenced until the join, so the caching allocator cannot hand
    its memory to later work on the current stream too early. On CPU: the two run one after the
    other.
    """
    if route.stream is None:
        _exchange(out_ND, in_ND, out_splits, in_splits, route)
        fn()
        return
    ready = torch.cuda.current_stream().record_event()
    _exchange(out_ND, in_ND, out_splits, in_splits, route)
    route.stream.wait_event(ready)
    with torch.cuda.stream(route.stream):
        fn()
    torch.cuda.current_stream().wait_event(route.stream.record_event())


@dataclass(frozen=True)
class _Route:
    """Where each pair's row goes (see :mod:`parallel.pair_rows`) and who moves it.

    pos_TK: (T, K) int64 send position of each pair (>= S: dropped); ends_G: (G,) int64 cumulative
    end of each destination rank's positions; me: this rank in the group; stream: the side stream
    for the own rows' pass (None on CPU).
    """

    pos_TK: torch.Tensor
    ends_G: torch.Tensor
    me: int
    group: object
    timer: "CommTimer | None"
    stream: "torch.cuda.Stream | None"


def _send_positions(order_P: torch.Tensor) -> torch.Tensor:
    """(P,) int64 inverse of the permutation ``order_P``: each pair's place in the send order."""
    positions = torch.arange(order_P.numel(), device=order_P.device)
    return torch.empty_like(order_P).scatter_(0, order_P, positions)


def _remote(splits: list[int], me: int) -> list[int]:
    """The split sizes without this rank's own chunk (its rows never enter the exchange)."""
    return [0 if g == me else n for g, n in enumerate(splits)]


class _DispatchFn(torch.autograd.Function):
    """x_TD (T, D) -> rows_RD (R, D): [own rows for the local experts; rows received, by source].

    Forward: pack the remote pairs (before the host waits for the counts), exchange them, and
    write the own pairs straight into rows_RD while the exchange runs. Backward: the reverse
    exchange of the remote rows' gradients, then one pass summing each token's K pair gradients
    from both buffers.
    """

    @staticmethod
    def forward(ctx, x_TD, route: _Route, counts_2GL: torch.Tensor, copied):
        T, D = x_TD.shape
        K, me = route.pos_TK.shape[1], route.me
        x_TD = x_TD.contiguous()
        send_ND = x_TD.new_empty((T * K, D))  # upper bound: S is not on the host yet
        scatter_pairs(x_TD, route.pos_TK, route.ends_G, me, send_ND, local=False)
        if copied is not None:
            copied.synchronize()
        splits_2G = counts_2GL.sum(-1)
        send_splits, recv_splits = splits_2G.tolist()
        num_own = send_splits[me]
        remote_send, remote_recv = _remote(send_splits, me), _remote(recv_splits, me)
        rows_RD = x_TD.new_empty((sum(recv_splits), D))
        _exchange_beside(route, rows_RD[num_own:], send_ND[:sum(remote_send)], remote_recv, remote_send,
                         lambda: scatter_pairs(x_TD, route.pos_TK, route.ends_G, me, rows_RD[:num_own], local=True))
        ctx.route, ctx.splits, ctx.num_own = route, (remote_send, remote_recv), num_own
        ctx.mark_non_differentiable(splits_2G)
        return rows_RD, splits_2G

    @staticmethod
    def backward(ctx, grad_RD, _):
        route, (remote_send, remote_recv), num_own = ctx.route, ctx.splits, ctx.num_own
        grad_RD = grad_RD.contiguous()
        back_ND = grad_RD.new_empty((sum(remote_send), grad_RD.shape[1]))
        _exchange(back_ND, grad_RD[num_own:], remote_send, remote_recv, route)
        grad_TD = gather_pairs_sum(back_ND, grad_RD[:num_own], route.pos_TK, route.ends_G, route.me)
        return grad_TD, None, None, None


class _CombineFn(torch.autograd.Function):
    """y_RD (R, D) in dispatch order, w_TK (T, K) fp32 -> out_TD = Σ_k w[t, k] · y[row of (t, k)].

    Forward: the reverse exchange of the remote rows, then one pass over both buffers. Backward:
    ``dy = w · dout`` packed for the remote pairs, exchanged, and written for the own pairs while
    the exchange runs; ``dw = <dout, y>`` in the same passes. For dw the received rows and a copy
    of the own rows (made while the forward exchange runs) are kept, S rows in all.
    """

    @staticmethod
    def forward(ctx, y_RD, w_TK, route: _Route, splits: tuple, out_dtype):
        remote_send, remote_recv, num_own = splits
        y_RD = y_RD.contiguous()
        back_ND = y_RD.new_empty((sum(remote_send), y_RD.shape[1]))
        if ctx.needs_input_grad[1]:
            own_ND = y_RD.new_empty((num_own, y_RD.shape[1]))
            _exchange_beside(route, back_ND, y_RD[num_own:], remote_send, remote_recv,
                             lambda: own_ND.copy_(y_RD[:num_own]))
        else:
            own_ND = None
            _exchange(back_ND, y_RD[num_own:], remote_send, remote_recv, route)
        out_TD = gather_pairs_sum(back_ND, y_RD[:num_own], route.pos_TK, route.ends_G, route.me, w_TK, out_dtype)
        ctx.route, ctx.splits, ctx.rows = route, splits, y_RD.shape[0]
        ctx.y_dtype = y_RD.dtype
        if own_ND is not None:
            ctx.save_for_backward(w_TK, back_ND, own_ND)
        else:
            ctx.save_for_backward(w_TK)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        route, (remote_send, remote_recv, num_own) = ctx.route, ctx.splits
        w_TK, *kept = ctx.saved_tensors
        back_ND, own_ND = kept if kept else (None, None)
        dout_TD = dout_TD.contiguous()
        dw_TK = torch.empty_like(w_TK) if back_ND is not None else None  # both passes write all of it
        dy_RD = dout_TD.new_empty((ctx.rows, dout_TD.shape[1]), dtype=ctx.y_dtype)
        send_ND = dy_RD.new_empty((sum(remote_send), dout_TD.shape[1]))
        scatter_pairs(dout_TD, route.pos_TK, route.ends_G, route.me, send_ND, local=False, w_TK=w_TK,
                      y_ND=back_ND, dw_TK=dw_TK)
        _exchange_beside(route, dy_RD[num_own:], send_ND, remote_recv, remote_send,
                         lambda: scatter_pairs(dout_TD, route.pos_TK, route.ends_G, route.me, dy_RD[:num_own],
                                               local=True, w_TK=w_TK, y_ND=own_ND, dw_TK=dw_TK))
        return dy_RD, dw_TK, None, None, None


class _TieFn(torch.autograd.Function):
    """Returns ``y``; gives ``anchor`` a zero gradient, so backward reaches whatever made it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, anchor: torch.Tensor):
        ctx.anchor_shape = anchor.shape
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(ctx.anchor_shape)


def _keep_in_graph(y_RD: torch.Tensor, empty_rows_RD: torch.Tensor | None) -> torch.Tensor:
    """Make both all-to-all backwards run on every rank, whatever this rank received.

    The backward exchanges are collectives: if one rank's autograd graph skipped them, the other
    ranks would wait forever. A rank that received no rows (R = 0) has experts that compute
    nothing, so its expert output does not depend on the received rows nor on the weights. Two
    rules make the graph the same on every rank:
    - the dispatch exchange's backward exists iff ``x_TD`` requires grad (the same on every
      rank); when R = 0 the (empty) received rows are tied to the output with a zero gradient, so
      the backward reaches that exchange (costs nothing: the tensors have 0 rows);
    - the combine exchange's backward exists iff grad mode is on: an output that does not require
      grad is made a leaf that does (frozen experts then still run the exchange, with zeros).
    """
    if not torch.is_grad_enabled():
        return y_RD
    if empty_rows_RD is not None and empty_rows_RD.requires_grad:
        return _TieFn.apply(y_RD, empty_rows_RD)
    if not y_RD.requires_grad:
        return y_RD.detach().requires_grad_()
    return y_RD


class AllToAllDispatcher:
    """Dispatcher for :class:`moe.MoELayer` over an expert-parallel process group.

    Args:
        ep_group: the expert-parallel group (this rank holds experts ``[r·L, (r+1)·L)`` where r
            is its rank in the group).
        world_group: every rank holding part of the batch; the load-balancing loss's inputs are
            summed over it. Default: the default (world) group.
        time_comm: time the all-to-alls into ``self.comm_timer`` (a :class:`CommTimer`; None
            when off). Setting ``comm_timer`` later turns timing on or off.

    With a group of one rank it runs the local gather/scatter (no host sync) and only the
    loss inputs are reduced. Keeps no state between ``dispatch`` and ``combine`` (the timer only
    accumulates durations).
    """

    def __init__(self, ep_group=None, world_group=None, time_comm: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("AllToAllDispatcher needs torch.distributed.init_process_group() first")
        self.ep_group = ep_group
        self.world_group = world_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        self._local = LocalDispatcher()
        self.comm_timer = CommTimer() if time_comm else None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # a resource, not per-call state

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream | None":
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep_size={self.ep_size}, ep_rank={self.ep_rank})"

    def _num_experts(self, plan: RoutingPlan) -> int:
        """The plan's expert count E; raises unless the ep ranks hold E / ep each."""
        num_experts = plan.kept_per_expert_E.numel()
        if num_experts % self.ep_size:
            raise ValueError(f"{type(self).__name__}: {num_experts} experts do not split over {self.ep_size} ranks")
        return num_experts

    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, AllToAllMeta]:
        """x_TD (T, D) -> rows_RD (R, D) in blocks [own rows; each other source rank's rows], each
        block by local expert; offsets_GL (G·L,) int32 cumulative segment ends (segment b·L + l:
        block b, local expert l); and the metadata for :meth:`combine`."""
        if self.ep_size == 1:
            return self._local.dispatch(x_TD, plan)
        G, me = self.ep_size, self.ep_rank
        num_experts = self._num_experts(plan)
        L = num_experts // G
        T, K = plan.kept_TK.shape
        send_counts_E = plan.kept_per_expert_E.contiguous()
        recv_counts_E = torch.empty_like(send_counts_E)
        _timed_all_to_all(recv_counts_E, send_counts_E, None, None, self.ep_group, self.comm_timer)
        counts_2GL = torch.cat([send_counts_E, recv_counts_E]).to("cpu", non_blocking=True).view(2, G, L)
        copied = torch.cuda.Event() if send_counts_E.is_cuda else None
        if copied is not None:
            copied.record()
        # Everything that does not need the counts on the host is enqueued before the host waits
        # (in _DispatchFn, after the remote rows are packed): it runs while the counts travel.
        route = _Route(
            pos_TK=_send_positions(plan.order_P).view(T, K),
            ends_G=send_counts_E.view(G, L).sum(-1).cumsum(0),
            me=me, group=self.ep_group, timer=self.comm_timer, stream=self._side_stream(x_TD.device),
        )
        # segments: own rows first, then each other source rank's; local expert l within each
        recv_GL = recv_counts_E.view(G, L)
        blocks_GL = recv_GL if me == 0 else torch.cat([recv_GL[me:me + 1], recv_GL[:me], recv_GL[me + 1:]])
        offsets_GL = blocks_GL.flatten().cumsum(0, dtype=torch.int32)
        rows_RD, splits_2G = _DispatchFn.apply(x_TD, route, counts_2GL, copied)
        send_splits, recv_splits = splits_2G.tolist()
        meta = AllToAllMeta(
            route=route,
            send_splits=send_splits,
            recv_splits=recv_splits,
            empty_rows_RD=rows_RD if rows_RD.shape[0] == 0 else None,
        )
        return rows_RD, offsets_GL, meta

    def combine(self, y_RD: torch.Tensor, meta: AllToAllMeta, w_TK: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y_RD (R, D) expert outputs in dispatch order, w_TK (T, K) fp32 combine weights ->
        out_TD (T, D) ``Σ_k w[t, k] · y[(t, k)]`` in fp32, cast to ``out_dtype`` (default y's);
        dropped pairs contribute zero."""
        if isinstance(meta, LocalDispatchMeta):
            return self._local.combine(y_RD, meta, w_TK, out_dtype)
        y_RD = _keep_in_graph(y_RD, meta.empty_rows_RD)
        me = meta.route.me
        splits = (_remote(meta.send_splits, me), _remote(meta.recv_splits, me), meta.send_splits[me])
        return _CombineFn.apply(y_RD, w_TK, meta.route, splits, out_dtype or y_RD.dtype)

    def reduce_aux_inputs(self, routed_E: torch.Tensor, prob_sum_E: torch.Tensor, num_tokens: int):
        """Sum the load-balancing loss's inputs over the world in one all-reduce.

        routed_E (E,) int64, prob_sum_E (E,) fp32 (differentiable: the backward sums the
        gradients over the world, see :class:`~parallel.all_to_all.AllReduceSumFn`), num_tokens
        T. Packed in fp64 (exact for counts below 2^53). The global token count stays a (0-d)
        device tensor, so the loss needs no host sync.
        """
        num_experts = routed_E.numel()
        packed = torch.cat([
            prob_sum_E.to(torch.float64),
            routed_E.detach().to(torch.float64),
            prob_sum_E.new_full((1,), num_tokens, dtype=torch.float64),
        ])
        total = all_reduce_sum(packed, self.world_group)
        prob_sum = total[:num_experts].to(prob_sum_E.dtype)
        routed = total[num_experts:2 * num_experts].detach().round().to(routed_E.dtype)
        return routed, prob_sum, total[-1].detach().to(prob_sum_E.dtype)

    def reduce_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """(..., E) per-expert counts summed over the expert-parallel group (no gradient)."""
        if self.ep_size == 1:
            return counts_E
        total = counts_E.detach().clone()
        dist.all_reduce(total, group=self.ep_group)
        return total
