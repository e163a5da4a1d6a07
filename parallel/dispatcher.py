"""The NCCL expert-parallel dispatcher: tokens travel to their experts' rank by all-to-all, and back.

Legend: T tokens, D model dim, K experts per token (top-k), E experts, G ranks of the
expert-parallel group, L = E / G experts per rank, S = K + G slots of a token, U unique rows (one
per token and remote rank it has a kept pair on), R rows for the local experts, C = D + X columns
of a row with its tail of X columns.

A token crosses to a rank once, however many of its pairs go there (:mod:`parallel.token_rows`
says why and names the tables); the experts apply the combine weights, so the way back carries
one summed row per token and rank too.

``dispatch``:
1. The route (:meth:`AllToAllDispatcher._route`): each pair's destination rank and place among
   the pairs that rank receives from this one (the kept pairs by expert, as ``plan.order_P``
   sorts them), and the slot table: own pairs' rows, and one send row per (token, remote rank).
2. Per destination rank, its L experts' pair counts and the unique rows go out in one small
   all-to-all, and both the sent and received counts come to the host in ONE device->host copy:
   ``all_to_all_single`` takes its split sizes as Python lists, so this is the one host sync of
   a layer's dispatches. The send buffer is packed while that copy is in flight: each unique row
   is the token's row followed by a tail of X columns holding, per slot k, the place of the
   token's pair k among the destination's rows from this rank (int32, -1: not there) and its
   combine weight (fp32), bit-cast into the row dtype.
3. The rows move with one variable-split ``all_to_all_single`` in which this rank's own chunk is
   empty: the own pairs' rows are written straight into the experts' input while the exchange
   runs. The receiver then copies each received row into the pair rows its tail names. The
   experts' input is [own rows; rows from each other source rank], each block ordered by local
   expert: the grouped GEMM takes them as G·L row segments, segment ``b·L + l`` multiplied by
   local expert l's weights (see ``moe.kernels.grouped_mm``), with no regrouping pass. The
   weights come out as ``w_R``, one per row, for the experts to apply.

``combine``: the receiver sums each received token's pair outputs into one row, sends those back
with the reverse exchange, and the sender adds them to its own pairs' outputs, in fp32.

The backward of each is the other's forward with the roles swapped: the dispatch backward sums
each received token's pair gradients into one row, its tail carrying the weights' gradients,
sends them back and adds them to the own pairs'; the combine backward sends ``dout`` once per
token and rank and the receiver copies it into the token's pair rows (the own pairs' rows
written during the exchange).

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
from parallel.token_rows import gather_slots, scatter_slots


@dataclass(frozen=True)
class _Route:
    """Where this rank's pairs go (the sender's side), from :meth:`AllToAllDispatcher._route`.

    slot_TS: (T, K + G) int64 slot table (:mod:`parallel.token_rows`); dest_TK: (T, K) int64
    destination rank of each pair (G: dropped); unique_G: (G,) int64 unique rows sent to each rank
    (0 to this one); me: this rank in the group; stream: the side stream for the own rows' pass
    (None on CPU); layer: the module that dispatched, for the backward's records
    (:mod:`parallel.flight`). Kept until the backward, so only what the backward reads.
    """

    slot_TS: torch.Tensor
    dest_TK: torch.Tensor
    unique_G: torch.Tensor
    me: int
    group: object
    timer: "CommTimer | None"
    stream: "torch.cuda.Stream | None"
    layer: str


@dataclass(frozen=True)
class _Counts:
    """One dispatch's route and counts from :meth:`AllToAllDispatcher._prepare`.

    place_TK: (T, K) int64 each pair's place among the pairs its destination receives from this
    rank (the headers' places; read by the dispatch forward only); recv_GC: (G, C) int64 on the device, per source rank: the pairs it sends to each local expert
    (L columns), then its unique rows (last column); host_2GC: (2, G, C) the sent (per destination)
    and received counts on the host, valid once ``copied`` (None: a CPU run, already valid) has
    completed.
    """

    route: _Route
    place_TK: torch.Tensor
    recv_GC: torch.Tensor
    host_2GC: torch.Tensor
    copied: "torch.cuda.Event | None"


@dataclass(frozen=True)
class AllToAllMeta(ExpertParallelMeta):
    """What ``combine`` needs from ``dispatch``.

    route: where this rank's pairs went; row_UK: (U, K) int64 row table of the received unique
    rows (:mod:`parallel.token_rows`); send_unique, recv_unique: unique rows sent to / received
    from each group rank (0 for this one); num_rows: R, the rows of the experts' input.
    """

    route: _Route
    row_UK: torch.Tensor
    send_unique: list[int]
    recv_unique: list[int]
    num_rows: int


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


def _exchange(out_MD, in_MD, out_splits, in_splits, route: _Route, what: str) -> None:
    """:func:`_timed_all_to_all` over the route's group and timer, recorded as the route's layer's."""
    _timed_all_to_all(out_MD, in_MD, out_splits, in_splits, route.group, route.timer, what, route.layer)


def _exchange_beside(route: _Route, out_MD, in_MD, out_splits, in_splits, fn, what: str) -> None:
    """:func:`_exchange` on the current stream while ``fn`` runs on the route's side stream (see
    :func:`~parallel.comm.run_beside`)."""
    run_beside(route.stream, lambda: _exchange(out_MD, in_MD, out_splits, in_splits, route, what), fn)


def _send_positions(order_P: torch.Tensor) -> torch.Tensor:
    """(P,) int64 inverse of the permutation ``order_P``: each pair's place in the send order."""
    positions = torch.arange(order_P.numel(), device=order_P.device)
    return torch.empty_like(order_P).scatter_(0, order_P, positions)


def _header_columns(K: int, D: int, dtype: torch.dtype) -> int:
    """X: the columns of ``dtype`` before a unique row's D that hold its K int32 places and K fp32
    weights (8·K bytes), rounded so that the header and the whole row are 16-byte multiples (the
    row kernels' vector loads, and the int32 view of every row's header)."""
    X = -(-8 * K // dtype.itemsize)
    return X + (-(X + D) * dtype.itemsize) % 16 // dtype.itemsize


def _headers(buf_UC: torch.Tensor, X: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the unique rows' headers: (U, K) int32 places and (U, K) fp32 weights."""
    head = buf_UC[:, :X].view(torch.int32)
    return head[:, :K], head[:, K:2 * K].view(torch.float32)


def _remote_rows(route: _Route, sink: int) -> torch.Tensor:
    """(T, K) int64: the send row of each pair's unique row, ``sink`` for own and dropped pairs."""
    K, G = route.dest_TK.shape[1], route.unique_G.numel()
    remote = (route.dest_TK != route.me) & (route.dest_TK < G)
    return torch.where(remote, route.slot_TS.gather(1, K + route.dest_TK.clamp(max=G - 1)), sink)


def _splits(host_2GC: torch.Tensor, me: int) -> tuple[list[int], list[int], int, int]:
    """From the host counts: unique rows sent to and received from each rank, this rank's own
    pairs and R, the rows of its experts' input."""
    (send_pairs, recv_pairs), (send_unique, recv_unique) = host_2GC[..., :-1].sum(-1).tolist(), host_2GC[..., -1].tolist()
    return send_unique, recv_unique, send_pairs[me], sum(recv_pairs)


def _receiver_rows(place_UK: torch.Tensor, recv_GC: torch.Tensor, num_unique: int, me: int) -> torch.Tensor:
    """(U, K) int64 row table of the received unique rows: each header's places, which count from
    the start of its source's block of the experts' input ([own rows; each other source's rows]),
    turned into rows of that input."""
    pairs_G = recv_GC[:, :-1].sum(-1)
    others_G = pairs_G.clone()
    others_G[me] = 0
    start_G = pairs_G[me] + others_G.cumsum(0) - others_G
    start_U = torch.repeat_interleave(start_G, recv_GC[:, -1], output_size=num_unique)
    place_UK = place_UK.to(torch.int64)
    return torch.where(place_UK >= 0, place_UK + start_U[:, None], -1)


class _DispatchFn(torch.autograd.Function):
    """x_TD (T, D), w_TK (T, K) fp32 -> rows_RD (R, D) in row_dtype ([own rows for the local
    experts; rows received, by source]), w_R (R,) fp32 their combine weights, and the received
    rows' row table (see the module docstring).

    Backward: each received token's pair gradients summed into one row, whose header carries the
    pairs' weight gradients, sent home and added to the own pairs' gradients.
    """

    @staticmethod
    def forward(ctx, x_TD, w_TK, counts: _Counts, row_dtype: torch.dtype):
        route = counts.route
        T, D = x_TD.shape
        K, G, me = route.dest_TK.shape[1], route.unique_G.numel(), route.me
        X = _header_columns(K, D, row_dtype)
        x_TD = x_TD.contiguous()
        # unique rows and headers, packed while the counts travel: at most T rows per remote rank
        # (U is not on the host yet), plus a sink row for the headers of pairs sent nowhere
        send_UC = x_TD.new_empty((T * (G - 1) + 1, X + D), dtype=row_dtype)
        scatter_slots(x_TD, route.slot_TS, K, send_UC[:, X:], "b")
        place_UK, weight_UK = _headers(send_UC, X, K)
        place_UK.fill_(-1)
        sent_TK, slot_TK = _remote_rows(route, send_UC.shape[0] - 1), torch.arange(K, device=x_TD.device).expand(T, K)
        place_UK.index_put_((sent_TK, slot_TK), counts.place_TK.to(torch.int32))
        weight_UK.index_put_((sent_TK, slot_TK), w_TK)
        if counts.copied is not None:
            counts.copied.synchronize()
        send_unique, recv_unique, num_own, R = _splits(counts.host_2GC, me)
        rows_RD = x_TD.new_empty((R, D), dtype=row_dtype)
        recv_UC = x_TD.new_empty((sum(recv_unique), X + D), dtype=row_dtype)
        _exchange_beside(route, recv_UC, send_UC[:sum(send_unique)], recv_unique, send_unique,
                         lambda: scatter_slots(x_TD, route.slot_TS, K, rows_RD, "a"), "dispatch rows")
        place_UK, weight_UK = _headers(recv_UC, X, K)
        row_UK = _receiver_rows(place_UK, counts.recv_GC, recv_UC.shape[0], me)
        scatter_slots(recv_UC[:, X:], row_UK, K, rows_RD, "a")
        w_R = w_TK.new_empty(R + 1)  # the last entry: a sink for slots that name no row
        own_TK = route.slot_TS[:, :K]
        w_R.index_put_((torch.where(own_TK >= 0, own_TK, R),), w_TK)
        w_R.index_put_((torch.where(row_UK >= 0, row_UK, R),), weight_UK)
        ctx.route, ctx.row_UK, ctx.splits, ctx.header = route, row_UK, (send_unique, recv_unique), X
        ctx.x_dtype = x_TD.dtype
        ctx.mark_non_differentiable(row_UK)
        return rows_RD, w_R[:R], row_UK

    @staticmethod
    def backward(ctx, grad_RD, dw_R, _):
        route, row_UK, (send_unique, recv_unique), X = ctx.route, ctx.row_UK, ctx.splits, ctx.header
        (R, D), K = grad_RD.shape, row_UK.shape[1]
        grad_RD = grad_RD.contiguous()
        back_UC = grad_RD.new_empty((sum(recv_unique), X + D))
        gather_slots(grad_RD, None, row_UK, K, out_TD=back_UC[:, X:])
        dw_R = torch.cat([dw_R.float(), dw_R.new_zeros(1, dtype=torch.float32)])  # the sink: slots with no row
        _headers(back_UC, X, K)[1].copy_(dw_R[torch.where(row_UK >= 0, row_UK, R)])
        home_UC = grad_RD.new_empty((sum(send_unique), X + D))
        _exchange(home_UC, back_UC, send_unique, recv_unique, route, "dispatch rows (backward)")
        grad_TD = gather_slots(grad_RD, home_UC[:, X:], route.slot_TS, K, out_dtype=ctx.x_dtype)
        if not ctx.needs_input_grad[1]:
            return grad_TD, None, None, None
        dw_home_UK = _headers(home_UC, X, K)[1]
        dw_home_UK = torch.cat([dw_home_UK, dw_home_UK.new_zeros(1, K)])  # the sink row: own and dropped pairs
        T = route.slot_TS.shape[0]
        remote_TK = dw_home_UK[_remote_rows(route, home_UC.shape[0]), torch.arange(K, device=grad_RD.device).expand(T, K)]
        own_TK = route.slot_TS[:, :K]
        dw_TK = torch.where(own_TK >= 0, dw_R[own_TK.clamp(min=0)], remote_TK)
        return grad_TD, dw_TK, None, None


class _CombineFn(torch.autograd.Function):
    """y_RD (R, D) expert outputs, weighted already, in dispatch order -> out_TD = Σ_k y[row of (t, k)].

    Forward: each received token's rows summed into one, sent home by the reverse exchange and
    added to the own pairs' rows. Backward: ``dout`` sent once per token and remote rank, copied
    into the received tokens' pair rows; the own pairs' rows written during the exchange.
    """

    @staticmethod
    def forward(ctx, y_RD, meta: AllToAllMeta, out_dtype):
        route, row_UK = meta.route, meta.row_UK
        K = row_UK.shape[1]
        y_RD = y_RD.contiguous()
        sums_UD = gather_slots(y_RD, None, row_UK, K)
        home_UD = y_RD.new_empty((sum(meta.send_unique), y_RD.shape[1]))
        _exchange(home_UD, sums_UD, meta.send_unique, meta.recv_unique, route, "combine rows")
        ctx.meta, ctx.y_dtype = meta, y_RD.dtype
        return gather_slots(y_RD, home_UD, route.slot_TS, K, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, dout_TD):
        meta = ctx.meta
        route, K, D = meta.route, meta.row_UK.shape[1], dout_TD.shape[1]
        dout_TD = dout_TD.contiguous()
        send_UD = dout_TD.new_empty((sum(meta.send_unique), D), dtype=ctx.y_dtype)
        scatter_slots(dout_TD, route.slot_TS, K, send_UD, "b")
        dy_RD = dout_TD.new_empty((meta.num_rows, D), dtype=ctx.y_dtype)
        recv_UD = dout_TD.new_empty((sum(meta.recv_unique), D), dtype=ctx.y_dtype)
        _exchange_beside(route, recv_UD, send_UD, meta.recv_unique, meta.send_unique,
                         lambda: scatter_slots(dout_TD, route.slot_TS, K, dy_RD, "a"), "combine rows (backward)")
        scatter_slots(recv_UD, meta.row_UK, K, dy_RD, "a")
        return dy_RD, None, None


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

    def _route(self, plan: RoutingPlan) -> tuple[_Route, torch.Tensor]:
        """The route (each pair's destination rank, the slot table: module docstring) and
        place_TK (T, K), each pair's place among the pairs its destination receives from here."""
        G, me = self.ep_size, self.ep_rank
        T, K = plan.kept_TK.shape
        device = plan.order_P.device
        per_rank_G = plan.kept_per_expert_E.view(G, -1).sum(-1)
        ends_G = per_rank_G.cumsum(0)
        pos_TK = _send_positions(plan.order_P).view(T, K)  # kept pairs by expert, hence by rank
        dest_TK = torch.searchsorted(ends_G, pos_TK, right=True)  # G: past every rank's pairs, dropped
        place_TK = pos_TK - (ends_G - per_rank_G)[dest_TK.clamp(max=G - 1)]
        own_TK = dest_TK == me
        remote_TK = ~own_TK & (dest_TK < G)
        has_TG = torch.zeros((T, G + 1), dtype=torch.int64, device=device)
        has_TG = has_TG.scatter_(1, torch.where(remote_TK, dest_TK, G), 1)[:, :G]
        send_row_GT = has_TG.t().flatten().cumsum(0).view(G, T) - 1  # by destination rank, then token
        slot_TS = torch.cat([torch.where(own_TK, place_TK, -1), torch.where(has_TG > 0, send_row_GT.t(), -1)], 1)
        route = _Route(slot_TS=slot_TS, dest_TK=dest_TK, unique_G=has_TG.sum(0), me=me, group=self.ep_group,
                       timer=self.comm_timer, stream=self._side_streams.get(device), layer=flight.RECORDER.layer)
        return route, place_TK

    def _prepare(self, plans: list[RoutingPlan]) -> list[_Counts]:
        """The routes of N dispatches, and their counts in one small all-to-all (per destination
        rank: its L experts' pair counts and the unique rows, N·G·(L + 1) int64 per rank), on their
        way to the host in one copy: the one host sync of a layer's dispatches, taken by the first
        of them (in :class:`_DispatchFn`)."""
        G = self.ep_size
        routes = [self._route(plan) for plan in plans]
        send_GNC = torch.stack([torch.cat([plan.kept_per_expert_E.view(G, -1), route.unique_G[:, None]], 1)
                                for plan, (route, _) in zip(plans, routes)], 1)
        recv_GNC = torch.empty_like(send_GNC)  # by source rank
        _timed_all_to_all(recv_GNC, send_GNC, None, None, self.ep_group, self.comm_timer, "dispatch counts")
        host_2GNC = torch.stack([send_GNC, recv_GNC]).to("cpu", non_blocking=True)
        copied = torch.cuda.Event() if send_GNC.is_cuda else None
        if copied is not None:
            copied.record()
        return [_Counts(route, place_TK, recv_GNC[:, n], host_2GNC[:, :, n], copied)
                for n, (route, place_TK) in enumerate(routes)]

    def _dispatch_ep(self, x_TD: torch.Tensor, plan: RoutingPlan, w_TK: torch.Tensor, num_experts: int,
                     prepared: _Counts, row_dtype: torch.dtype):
        """x_TD (T, D) -> rows_RD (R, D) in blocks [own rows; each other source rank's rows], each
        block by local expert; offsets_J (G·L,) int32 cumulative segment ends (segment b·L + l:
        block b, local expert l); w_R (R,) the rows' combine weights; and the metadata for
        :meth:`combine`."""
        me = self.ep_rank
        # enqueued before the host waits for the counts (in _DispatchFn): it runs while they travel
        recv_GL = prepared.recv_GC[:, :-1]
        blocks_GL = recv_GL if me == 0 else torch.cat([recv_GL[me:me + 1], recv_GL[:me], recv_GL[me + 1:]])
        offsets_J = blocks_GL.flatten().cumsum(0, dtype=torch.int32)
        rows_RD, w_R, row_UK = _DispatchFn.apply(x_TD, w_TK, prepared, row_dtype)
        send_unique, recv_unique, _, R = _splits(prepared.host_2GC, me)
        meta = AllToAllMeta(route=prepared.route, row_UK=row_UK, send_unique=send_unique, recv_unique=recv_unique,
                            num_rows=R)
        return rows_RD, offsets_J, w_R, meta

    def _combine_ep(self, y_RD: torch.Tensor, meta: AllToAllMeta, out_dtype: torch.dtype) -> torch.Tensor:
        return _CombineFn.apply(y_RD, meta, out_dtype)
