"""The NCCL expert-parallel dispatcher: tokens travel to their expert's rank by all-to-all, and back.

Legend: T tokens, D model dim, K experts per token (top-k), P = T·K pairs, E experts, G ranks of
the expert-parallel group, L = E / G experts per rank, M rows of a send/return buffer (the pairs
this rank keeps and sends), R rows it receives for its L experts.

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
Measured on 2×H200 (bench/all_to_all.py; bench/results/all_to_all.md): regrouping by expert and
un-permuting into pair order reached 0.41–0.65× the raw exchange's bandwidth at 4k–32k tokens;
the version with a gather (K reads of each token row) before the exchange and a fused combine
after it, both on the critical path, reached 0.22–0.81×.

Opt-in timing (``time_comm=True`` or a :class:`~parallel.comm.CommTimer` set as ``comm_timer``):
the counts exchange and both row exchanges, forward and backward, add their spans to the timer,
which the training loop reads once per log window.

The groups, the one-rank fallback, the autograd rule for ranks that receive nothing and the
global reductions are :class:`~parallel.ep_dispatcher.ExpertParallelDispatcher`'s.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.capacity import RoutingPlan
from parallel import flight
from parallel.comm import CommTimer, SideStreams, run_beside
from parallel.ep_dispatcher import ExpertParallelDispatcher, ExpertParallelMeta
from parallel.pair_rows import gather_pairs_sum, scatter_pairs


@dataclass(frozen=True)
class AllToAllMeta(ExpertParallelMeta):
    """What ``combine`` needs from ``dispatch``.

    route: where each pair's row went (send positions, destination ranks' bounds, the group).
    send_splits, recv_splits: rows sent to / received from each group rank, this rank's own rows
        included (they are moved locally, not by the exchange).
    """

    route: "_Route"
    send_splits: list[int]
    recv_splits: list[int]


def _timed_all_to_all(out_MD, in_MD, out_splits, in_splits, group, timer: "CommTimer | None", what: str,
                      layer: str | None = None) -> None:
    """``all_to_all_single`` on the current stream, its span added to ``timer`` when there is one
    (synchronous op: since torch 2.8 NCCL then runs on the caller's stream with no event
    handshakes; ``async_op=True`` goes through an internal stream and, measured on 2×H200,
    doubled the time of a 4k-token dispatch + combine). Recorded as ``all_to_all <what>`` of
    ``layer`` (None: the current one) for :mod:`parallel.flight`."""
    flight.record(f"all_to_all {what}", group, layer)
    begin = timer.start(in_MD.device) if timer is not None else None
    dist.all_to_all_single(out_MD, in_MD, out_splits, in_splits, group=group)
    if begin is not None:
        timer.stop(begin)


def _exchange(out_MD, in_MD, out_splits, in_splits, route: "_Route", what: str) -> None:
    """:func:`_timed_all_to_all` over the route's group and timer, recorded as the route's layer's."""
    _timed_all_to_all(out_MD, in_MD, out_splits, in_splits, route.group, route.timer, what, route.layer)


def _exchange_beside(route: "_Route", out_MD, in_MD, out_splits, in_splits, fn, what: str) -> None:
    """:func:`_exchange` on the current stream while ``fn`` runs on the route's side stream (see
    :func:`~parallel.comm.run_beside`)."""
    run_beside(route.stream, lambda: _exchange(out_MD, in_MD, out_splits, in_splits, route, what), fn)


@dataclass(frozen=True)
class _Route:
    """Where each pair's row goes (see :mod:`parallel.pair_rows`) and who moves it.

    pos_TK: (T, K) int64 send position of each pair (>= M: dropped); ends_G: (G,) int64 cumulative
    end of each destination rank's positions; me: this rank in the group; stream: the side stream
    for the own rows' pass (None on CPU); layer: the module that dispatched, for the backward's
    records (:mod:`parallel.flight`).
    """

    pos_TK: torch.Tensor
    ends_G: torch.Tensor
    me: int
    group: object
    timer: "CommTimer | None"
    stream: "torch.cuda.Stream | None"
    layer: str


@dataclass(frozen=True)
class _Counts:
    """One dispatch's counts from :meth:`AllToAllDispatcher._prepare`: recv_E (E,) int64 pairs
    each expert of the group receives from this rank's peers, on the device (by source rank,
    then local expert); host_2E (2, E) the sent and received counts on the host, valid once
    ``copied`` (None: a CPU run, already valid) has completed."""

    recv_E: torch.Tensor
    host_2E: torch.Tensor
    copied: "torch.cuda.Event | None"


def _send_positions(order_P: torch.Tensor) -> torch.Tensor:
    """(P,) int64 inverse of the permutation ``order_P``: each pair's place in the send order."""
    positions = torch.arange(order_P.numel(), device=order_P.device)
    return torch.empty_like(order_P).scatter_(0, order_P, positions)


def _remote(splits: list[int], me: int) -> list[int]:
    """The split sizes without this rank's own chunk (its rows never enter the exchange)."""
    return [0 if g == me else n for g, n in enumerate(splits)]


class _DispatchFn(torch.autograd.Function):
    """x_TD (T, D) -> rows_RD (R, D) in row_dtype: [own rows for the local experts; rows received, by source].

    Forward: pack the remote pairs (before the host waits for the counts), exchange them, and
    write the own pairs straight into rows_RD while the exchange runs. Backward: the reverse
    exchange of the remote rows' gradients, then one pass summing each token's K pair gradients
    from both buffers.
    """

    @staticmethod
    def forward(ctx, x_TD, route: _Route, counts_2GL: torch.Tensor, copied, row_dtype: torch.dtype):
        T, D = x_TD.shape
        K, me = route.pos_TK.shape[1], route.me
        x_TD = x_TD.contiguous()
        ctx.x_dtype = x_TD.dtype
        send_MD = x_TD.new_empty((T * K, D), dtype=row_dtype)  # upper bound: M is not on the host yet
        scatter_pairs(x_TD, route.pos_TK, route.ends_G, me, send_MD, local=False)
        if copied is not None:
            copied.synchronize()
        splits_2G = counts_2GL.sum(-1)
        send_splits, recv_splits = splits_2G.tolist()
        num_own = send_splits[me]
        remote_send, remote_recv = _remote(send_splits, me), _remote(recv_splits, me)
        rows_RD = x_TD.new_empty((sum(recv_splits), D), dtype=row_dtype)
        _exchange_beside(route, rows_RD[num_own:], send_MD[:sum(remote_send)], remote_recv, remote_send,
                         lambda: scatter_pairs(x_TD, route.pos_TK, route.ends_G, me, rows_RD[:num_own], local=True),
                         "dispatch rows")
        ctx.route, ctx.splits, ctx.num_own = route, (remote_send, remote_recv), num_own
        ctx.mark_non_differentiable(splits_2G)
        return rows_RD, splits_2G

    @staticmethod
    def backward(ctx, grad_RD, _):
        route, (remote_send, remote_recv), num_own = ctx.route, ctx.splits, ctx.num_own
        grad_RD = grad_RD.contiguous()
        back_MD = grad_RD.new_empty((sum(remote_send), grad_RD.shape[1]))
        _exchange(back_MD, grad_RD[num_own:], remote_send, remote_recv, route, "dispatch rows (backward)")
        grad_TD = gather_pairs_sum(back_MD, grad_RD[:num_own], route.pos_TK, route.ends_G, route.me,
                                   out_dtype=ctx.x_dtype)
        return grad_TD, None, None, None, None


class _CombineFn(torch.autograd.Function):
    """y_RD (R, D) in dispatch order, w_TK (T, K) fp32 -> out_TD = Σ_k w[t, k] · y[row of (t, k)].

    Forward: the reverse exchange of the remote rows, then one pass over both buffers. Backward:
    ``dy = w · dout`` packed for the remote pairs, exchanged, and written for the own pairs while
    the exchange runs; ``dw = <dout, y>`` in the same passes. For dw the received rows and a copy
    of the own rows (made while the forward exchange runs) are kept, M rows in all.
    """

    @staticmethod
    def forward(ctx, y_RD, w_TK, route: _Route, splits: tuple, out_dtype):
        remote_send, remote_recv, num_own = splits
        y_RD = y_RD.contiguous()
        back_MD = y_RD.new_empty((sum(remote_send), y_RD.shape[1]))
        if ctx.needs_input_grad[1]:
            own_MD = y_RD.new_empty((num_own, y_RD.shape[1]))
            _exchange_beside(route, back_MD, y_RD[num_own:], remote_send, remote_recv,
                             lambda: own_MD.copy_(y_RD[:num_own]), "combine rows")
        else:
            own_MD = None
            _exchange(back_MD, y_RD[num_own:], remote_send, remote_recv, route, "combine rows")
        out_TD = gather_pairs_sum(back_MD, y_RD[:num_own], route.pos_TK, route.ends_G, route.me, w_TK, out_dtype)
        ctx.route, ctx.splits, ctx.rows = route, splits, y_RD.shape[0]
        ctx.y_dtype = y_RD.dtype
        if own_MD is not None:
            ctx.save_for_backward(w_TK, back_MD, own_MD)
        else:
            ctx.save_for_backward(w_TK)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        route, (remote_send, remote_recv, num_own) = ctx.route, ctx.splits
        w_TK, *kept = ctx.saved_tensors
        back_MD, own_MD = kept if kept else (None, None)
        dout_TD = dout_TD.contiguous()
        dw_TK = torch.empty_like(w_TK) if back_MD is not None else None  # both passes write all of it
        dy_RD = dout_TD.new_empty((ctx.rows, dout_TD.shape[1]), dtype=ctx.y_dtype)
        send_MD = dy_RD.new_empty((sum(remote_send), dout_TD.shape[1]))
        scatter_pairs(dout_TD, route.pos_TK, route.ends_G, route.me, send_MD, local=False, w_TK=w_TK,
                      y_MD=back_MD, dw_TK=dw_TK)
        _exchange_beside(route, dy_RD[num_own:], send_MD, remote_recv, remote_send,
                         lambda: scatter_pairs(dout_TD, route.pos_TK, route.ends_G, route.me, dy_RD[:num_own],
                                               local=True, w_TK=w_TK, y_MD=own_MD, dw_TK=dw_TK),
                         "combine rows (backward)")
        return dy_RD, dw_TK, None, None, None


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Dispatcher for :class:`moe.MoELayer` over an expert-parallel process group, the rows moved
    by NCCL all-to-all (see the module docstring).

    Args:
        ep_group, world_group: as for :class:`~parallel.ep_dispatcher.ExpertParallelDispatcher`.
        time_comm: time the all-to-alls into ``self.comm_timer`` (a :class:`~parallel.CommTimer`;
            None when off). Setting ``comm_timer`` later turns timing on or off.

    Keeps no state between ``dispatch`` and ``combine`` (the timer only accumulates durations).
    """

    def __init__(self, ep_group=None, world_group=None, time_comm: bool = False, overlap_chunks: int = 1):
        super().__init__(ep_group, world_group, overlap_chunks)
        self.comm_timer = CommTimer() if time_comm else None
        self._side_streams = SideStreams()

    def _prepare(self, kept_NE: torch.Tensor) -> list["_Counts"]:
        """The per-expert counts of N dispatches in one small all-to-all (N·E int64 per rank), and
        the sent and received counts on their way to the host in one copy: the one host sync of a
        layer's dispatches, taken by the first of them (in :class:`_DispatchFn`)."""
        N, E = kept_NE.shape
        G = self.ep_size
        send_GNL = kept_NE.view(N, G, E // G).transpose(0, 1).contiguous()  # by destination rank
        recv_GNL = torch.empty_like(send_GNL)  # by source rank
        _timed_all_to_all(recv_GNL, send_GNL, None, None, self.ep_group, self.comm_timer, "dispatch counts")
        recv_NE = recv_GNL.transpose(0, 1).reshape(N, E)
        host_2NE = torch.stack([kept_NE, recv_NE]).to("cpu", non_blocking=True)
        copied = torch.cuda.Event() if kept_NE.is_cuda else None
        if copied is not None:
            copied.record()
        return [_Counts(recv_NE[n], host_2NE[:, n], copied) for n in range(N)]

    def _dispatch_ep(self, x_TD: torch.Tensor, plan: RoutingPlan, num_experts: int, prepared: "_Counts",
                     row_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, AllToAllMeta]:
        """x_TD (T, D) -> rows_RD (R, D) in blocks [own rows; each other source rank's rows], each
        block by local expert; offsets_J (G·L,) int32 cumulative segment ends (segment b·L + l:
        block b, local expert l); and the metadata for :meth:`combine`."""
        G, me = self.ep_size, self.ep_rank
        L = num_experts // G
        T, K = plan.kept_TK.shape
        send_counts_E, recv_counts_E = plan.kept_per_expert_E, prepared.recv_E
        counts_2GL = prepared.host_2E.view(2, G, L)
        # Everything that does not need the counts on the host is enqueued before the host waits
        # (in _DispatchFn, after the remote rows are packed): it runs while the counts travel.
        route = _Route(
            pos_TK=_send_positions(plan.order_P).view(T, K),
            ends_G=send_counts_E.view(G, L).sum(-1).cumsum(0),
            me=me, group=self.ep_group, timer=self.comm_timer, stream=self._side_streams.get(x_TD.device),
            layer=flight.RECORDER.layer,
        )
        # segments: own rows first, then each other source rank's; local expert l within each
        recv_GL = recv_counts_E.view(G, L)
        blocks_GL = recv_GL if me == 0 else torch.cat([recv_GL[me:me + 1], recv_GL[:me], recv_GL[me + 1:]])
        offsets_J = blocks_GL.flatten().cumsum(0, dtype=torch.int32)
        rows_RD, splits_2G = _DispatchFn.apply(x_TD, route, counts_2GL, prepared.copied, row_dtype)
        send_splits, recv_splits = splits_2G.tolist()
        return rows_RD, offsets_J, AllToAllMeta(route=route, send_splits=send_splits, recv_splits=recv_splits)

    def _combine_ep(self, y_RD: torch.Tensor, meta: AllToAllMeta, w_TK: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
        me = meta.route.me
        splits = (_remote(meta.send_splits, me), _remote(meta.recv_splits, me), meta.send_splits[me])
        return _CombineFn.apply(y_RD, w_TK, meta.route, splits, out_dtype)
