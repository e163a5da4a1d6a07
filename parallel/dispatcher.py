"""The NCCL expert-parallel dispatcher: tokens travel to their experts' rank by all-to-all, and back.

Legend: T tokens, D model dim, K experts per token (top-k), E experts, G ranks of the
expert-parallel group, L = E / G experts per rank, R rows for the local experts, M rows of a
buffer of unique rows (one per token and remote rank it has a kept pair on).

A token crosses to a rank once, however many of its pairs go there (:mod:`parallel.token_rows`
says why and names the tables); the experts apply the combine weights, so the way back carries
one summed row per token and rank too.

``dispatch``:
1. The route (:meth:`AllToAllDispatcher._route`): each pair's destination rank and place among
   the pairs that rank receives from this one (the kept pairs by expert, as ``plan.order_P``
   sorts them), and the row tables: the own pairs' places (rows once the counts are in), one send
   row per (token, remote rank).
2. Per destination rank, its L experts' pair counts and the unique rows go out in one small
   all-to-all, and both the sent and received counts come to the host in ONE device->host copy:
   ``all_to_all_single`` takes its split sizes as Python lists, so this is the one host sync of
   a layer's dispatches. The send buffer is packed while that copy is in flight: each unique row
   is a header, the token's row and padding (:func:`_unique_row_layout`); the header holds, per
   slot k, the place of the token's pair k among the destination's rows from this rank (int32,
   -1: not there) and its combine weight (fp32), bit-cast into the row dtype.
3. The rows move with one variable-split ``all_to_all_single`` in which this rank's own chunk is
   empty: the own pairs' rows are written straight into the experts' input while the exchange
   runs. The receiver then copies each received row into the pair rows its header names. The
   experts' input is expert-major (:func:`~parallel.token_rows.expert_rows`: local expert l's
   rows are one segment, the sources' pairs in rank order within it), so the grouped GEMM takes
   L row segments, placed there by the copies themselves with no regrouping pass. The weights
   come out as ``w_R``, one per row, for the experts to apply.

``combine``: the receiver sums each received token's pair outputs into one row (fp32, rounded to
the rows' dtype: one rounding per token and rank that the pair layout did not have), sends those
back with the reverse exchange, and the sender adds them to its own pairs' outputs in fp32. The
dispatch backward's sums cross the same way.

The backward of each is the other's forward with the roles swapped: the dispatch backward sums
each received token's pair gradients into one row, its header carrying the weights' gradients,
sends them back and adds them to the own pairs'; the combine backward sends ``dout`` once per
token and rank and the receiver copies it into the token's pair rows (the own pairs' rows
written during the exchange).

Opt-in timing (``time_comm=True`` or a :class:`~parallel.comm.CommTimer` set as ``comm_timer``):
the counts exchange and both row exchanges, forward and backward, add their spans to the timer,
which the training loop reads once per log window.

The groups, the one-rank fallback, the autograd rule for ranks that receive nothing and the
global reductions are :class:`~parallel.ep_dispatcher.ExpertParallelDispatcher`'s.
"""

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from moe.capacity import RoutingPlan
from parallel import flight
from parallel.comm import CommTimer, SideStreams, run_beside
from parallel.ep_dispatcher import ExpertParallelDispatcher, ExpertParallelMeta
from parallel.token_rows import expert_rows, gather_slots, locate_pairs, scatter_slots, write_headers


@dataclass(frozen=True)
class _Route:
    """Where this rank's pairs go (the sender's side), from :meth:`AllToAllDispatcher._route`.

    own_TK, sent_TG: (T, K) and (T, G) int64 row tables of the own pairs' rows and of the tokens'
    unique rows in the send buffer (:mod:`parallel.token_rows`; own_TK holds the own pairs'
    places until :meth:`AllToAllDispatcher._dispatch_ep` turns them into rows of the experts'
    input, once the counts are in); dest_TK: (T, K) int64
    destination rank of each pair (G: dropped); unique_G: (G,) int64 unique rows sent to each rank
    (0 to this one); me: this rank in the group; stream: the side stream for the own rows' pass
    (None on CPU); layer: the module that dispatched, for the backward's records
    (:mod:`parallel.flight`). Kept until the backward, so only what the backward reads.
    """

    own_TK: torch.Tensor
    sent_TG: torch.Tensor
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

    place_TK: (T, K) int64 each pair's place among the pairs its destination receives from this rank
    (the headers' places; read by the dispatch forward only); recv_counts: (G, L + 1) int64 on the
    device, per source rank: the pairs it sends to each local expert (L columns), then its unique
    rows (last column). Exact sizes: host_counts (2, G, L + 1), the sent (per destination) and
    received counts on the host, valid once ``copied`` (None: a CPU run, already valid) has
    completed. Padded: ``padded`` = (B, me), blocks of B rows per rank, and ``fixed``, the sizes.
    """

    route: _Route
    place_TK: torch.Tensor
    recv_counts: torch.Tensor
    host_counts: "torch.Tensor | None" = None
    copied: "torch.cuda.Event | None" = None
    padded: "tuple[int, int] | None" = None
    fixed: "tuple[list[int], list[int], int] | None" = None

    def sizes(self) -> tuple[list[int], list[int], int]:
        """Rows sent to and received from each rank, and R, the rows of the experts' input: the
        padded exchange's fixed sizes, or the exact ones from the host counts (waiting for their
        copy: the host sync of the exact sizes)."""
        if self.fixed is not None:
            return self.fixed
        if self.copied is not None:
            self.copied.synchronize()
        send_unique, recv_unique = self.host_counts[..., -1].tolist()
        return send_unique, recv_unique, int(self.host_counts[1, :, :-1].sum())


@dataclass(frozen=True)
class AllToAllMeta(ExpertParallelMeta):
    """What ``combine`` needs from ``dispatch``.

    route: where this rank's pairs went; row_MK: (M, K) int64 row table of the received unique
    rows (:mod:`parallel.token_rows`; -1 rows: the padded exchange's padding); send_splits,
    recv_splits: rows sent to / received from each group rank (0 for this one); num_rows: R, the
    rows of the experts' input.
    """

    route: _Route
    row_MK: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
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


def _unique_row_layout(K: int, D: int, dtype: torch.dtype) -> tuple[int, int]:
    """(head, width): a unique row of ``width`` columns of ``dtype`` is a header of ``head`` columns
    (its K int32 places and K fp32 weights, 8·K bytes, padded to 16), the row's D columns, and
    padding. Both are 16-byte multiples: the header's int32 view needs every row's header 4-byte
    aligned, and the row kernels' vector loads want the row 16-byte aligned (any D, odd ones
    included)."""
    head = -(-8 * K // 16) * 16 // dtype.itemsize
    return head, head + D + (-D * dtype.itemsize) % 16 // dtype.itemsize


def _headers(buf: torch.Tensor, head: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a buffer of unique rows' headers: (M, K) int32 places and (M, K) fp32 weights."""
    header = buf[:, :head].view(torch.int32)
    return header[:, :K], header[:, K:2 * K].view(torch.float32)


def _header_index(route: _Route, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) row and column of each pair's entry among the headers of a buffer of unique rows:
    its token's unique row for its rank (``sink`` for own and dropped pairs) and its slot k."""
    (T, K), G = route.dest_TK.shape, route.unique_G.numel()
    remote = (route.dest_TK != route.me) & (route.dest_TK < G)
    row_TK = torch.where(remote, route.sent_TG.gather(1, route.dest_TK.clamp(max=G - 1)), sink)
    return row_TK, torch.arange(K, device=row_TK.device).expand(T, K)


class _DispatchFn(torch.autograd.Function):
    """x_TD (T, D), w_TK (T, K) fp32 -> rows_RD (R, D) in row_dtype (the experts' input, own pairs
    and received ones, expert-major), w_R (R,) fp32 their combine weights, and the received rows'
    row table (see the module docstring).

    Backward: each received token's pair gradients summed into one row, whose header carries the
    pairs' weight gradients, sent home and added to the own pairs' gradients.
    """

    @staticmethod
    def forward(ctx, x_TD, w_TK, counts: _Counts, row_dtype: torch.dtype):
        route = counts.route
        T, D = x_TD.shape
        K, G = route.dest_TK.shape[1], route.unique_G.numel()
        head, width = _unique_row_layout(K, D, row_dtype)
        x_TD = x_TD.contiguous()
        # unique rows and headers, packed while the counts travel: with exact sizes M is not on the
        # host yet, and a token has at most min(K, G - 1) of them
        rows = sum(counts.fixed[0]) if counts.fixed is not None else T * min(K, G - 1)
        send_buf = x_TD.new_empty((rows, width), dtype=row_dtype)
        scatter_slots(x_TD, route.sent_TG, send_buf[:, head:head + D])
        write_headers(counts.place_TK, route.dest_TK, w_TK.contiguous(), route.sent_TG, *_headers(send_buf, head, K))
        send_splits, recv_splits, R = counts.sizes()
        rows_RD = x_TD.new_empty((R, D), dtype=row_dtype)
        recv_buf = x_TD.new_empty((sum(recv_splits), width), dtype=row_dtype)
        _exchange_beside(route, recv_buf, send_buf[:sum(send_splits)], recv_splits, send_splits,
                         lambda: scatter_slots(x_TD, route.own_TK, rows_RD), "dispatch rows")
        place_MK, weight_MK = _headers(recv_buf, head, K)
        row_MK = expert_rows(place_MK, counts.recv_counts, blocks=counts.padded)
        scatter_slots(recv_buf[:, head:head + D], row_MK, rows_RD)
        # the last entry: a sink for slots that name no row; zeros: padded, the rows past the
        # received ones are the experts' padding, whose SwiGLU pass multiplies by these weights
        w_R = w_TK.new_zeros(R + 1)
        w_R.index_put_((torch.where(route.own_TK >= 0, route.own_TK, R),), w_TK)
        w_R.index_put_((torch.where(row_MK >= 0, row_MK, R),), weight_MK)
        ctx.route, ctx.row_MK, ctx.splits, ctx.layout = route, row_MK, (send_splits, recv_splits), (head, width)
        ctx.x_dtype = x_TD.dtype
        w_R = w_R[:R]
        # weights that need no gradient: no w_R gradient for the experts to compute and send home
        ctx.mark_non_differentiable(row_MK, *([] if ctx.needs_input_grad[1] else [w_R]))
        return rows_RD, w_R, row_MK

    @staticmethod
    def backward(ctx, grad_RD, dw_R, _):
        route, row_MK, (send_splits, recv_splits), (head, width) = ctx.route, ctx.row_MK, ctx.splits, ctx.layout
        (R, D), K = grad_RD.shape, row_MK.shape[1]
        grad_RD = grad_RD.contiguous()
        back_buf = grad_RD.new_empty((sum(recv_splits), width))
        gather_slots(grad_RD, row_MK, out_TD=back_buf[:, head:head + D])
        if ctx.needs_input_grad[1]:
            dw_R = torch.cat([dw_R.float(), dw_R.new_zeros(1, dtype=torch.float32)])  # the sink: slots with no row
            _headers(back_buf, head, K)[1].copy_(dw_R[torch.where(row_MK >= 0, row_MK, R)])
        home_buf = grad_RD.new_empty((sum(send_splits), width))
        _exchange(home_buf, back_buf, send_splits, recv_splits, route, "dispatch rows (backward)")
        grad_TD = gather_slots(grad_RD, route.own_TK, home_buf[:, head:head + D], route.sent_TG, ctx.x_dtype)
        if not ctx.needs_input_grad[1]:
            return grad_TD, None, None, None
        dw_home_MK = _headers(home_buf, head, K)[1]
        dw_home_MK = torch.cat([dw_home_MK, dw_home_MK.new_zeros(1, K)])  # the sink row: own and dropped pairs
        remote_TK = dw_home_MK[_header_index(route, home_buf.shape[0])]
        own_TK = route.own_TK
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
        route = meta.route
        y_RD = y_RD.contiguous()
        sums_MD = gather_slots(y_RD, meta.row_MK)
        home_MD = y_RD.new_empty((sum(meta.send_splits), y_RD.shape[1]))
        _exchange(home_MD, sums_MD, meta.send_splits, meta.recv_splits, route, "combine rows")
        ctx.meta, ctx.y_dtype = meta, y_RD.dtype
        return gather_slots(y_RD, route.own_TK, home_MD, route.sent_TG, out_dtype)

    @staticmethod
    def backward(ctx, dout_TD):
        meta = ctx.meta
        route, D = meta.route, dout_TD.shape[1]
        dout_TD = dout_TD.contiguous()
        send_MD = dout_TD.new_empty((sum(meta.send_splits), D), dtype=ctx.y_dtype)
        scatter_slots(dout_TD, route.sent_TG, send_MD)
        dy_RD = dout_TD.new_empty((meta.num_rows, D), dtype=ctx.y_dtype)
        recv_MD = dout_TD.new_empty((sum(meta.recv_splits), D), dtype=ctx.y_dtype)
        _exchange_beside(route, recv_MD, send_MD, meta.recv_splits, meta.send_splits,
                         lambda: scatter_slots(dout_TD, route.own_TK, dy_RD), "combine rows (backward)")
        scatter_slots(recv_MD, meta.row_MK, dy_RD)
        return dy_RD, None, None


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Dispatcher for :class:`moe.MoELayer` over an expert-parallel process group, the rows moved
    by NCCL all-to-all (see the module docstring).

    Args:
        ep_group, world_group, overlap_chunks: as for
            :class:`~parallel.ep_dispatcher.ExpertParallelDispatcher`.
        time_comm: time the all-to-alls into ``self.comm_timer`` (a :class:`~parallel.CommTimer`;
            None when off). Setting ``comm_timer`` later turns timing on or off.
        max_tokens: None (default): exact sizes, read on the host (one host sync a layer). An
            int, the most tokens a rank passes to one MoE layer: the *padded* exchange, with no
            host sync (see below).
        capacity_factor, capacity_groups: padded only, the MoE layers' when they cap: they bound
            the experts' rows as for :class:`~parallel.P2PDispatcher`.

    Padded exchange: every rank sends every other rank a block of B rows (B = max_tokens, or
    its share ``ceil(max_tokens / overlap_chunks)`` per chunk), its unique rows first and padding
    after, so the splits are known on the host without the counts, and the experts' input has
    R_cap rows, the most this rank can receive (``ep · B · top_k`` dropless, less under a
    capacity), of which the rows past ``offsets[-1]`` are padding (the grouped GEMM skips them
    and returns zeros there). What it costs: the padding's bytes on the link (at top-8 of 64
    experts on 2 ranks a token misses the other rank with probability 0.5^8, so about 0.4 %
    of a block) and the experts' activations at R_cap rows instead of R (twice the rows of a
    balanced layer at ep 2, dropless). What it saves: the host's wait for the counts in every
    layer, which drains the GPU's queue and leaves it idle while the host launches the next
    kernels. A layer capped below the capacity it declared here (it could receive more than
    R_cap) fails the process with a device-side assert rather than write past the buffer.

    Keeps no state between ``dispatch`` and ``combine`` (the timer only accumulates durations).
    """

    def __init__(self, ep_group=None, world_group=None, time_comm: bool = False, overlap_chunks: int = 1,
                 max_tokens: int | None = None, capacity_factor: float | None = None, capacity_groups: int = 1):
        super().__init__(ep_group, world_group, overlap_chunks)
        self.comm_timer = CommTimer() if time_comm else None
        self._side_streams = SideStreams()
        if max_tokens is not None:
            self._set_token_bound(max_tokens, capacity_factor, capacity_groups)
        elif capacity_factor is not None or capacity_groups != 1:
            raise ValueError("AllToAllDispatcher: capacity_factor and capacity_groups size the padded exchange: "
                             "give max_tokens too (or neither)")

    def __repr__(self) -> str:
        padded = "" if self.max_tokens is None else f", padded, {self._token_bound_repr()}"
        return f"AllToAllDispatcher(ep_size={self.ep_size}, ep_rank={self.ep_rank}{padded})"

    def _route(self, plan: RoutingPlan) -> tuple[_Route, torch.Tensor]:
        """The route (each pair's destination rank, the row tables: module docstring) and
        place_TK (T, K), each pair's place among the pairs its destination receives from here."""
        G, me = self.ep_size, self.ep_rank
        T, K = plan.kept_TK.shape
        device = plan.order_P.device
        ends_G = plan.kept_per_expert_E.view(G, -1).sum(-1).cumsum(0)
        pos_TK = _send_positions(plan.order_P).view(T, K)  # kept pairs by expert, hence by rank
        dest_TK, place_TK, own_TK, has_GT = locate_pairs(pos_TK, ends_G, me)
        if self.dispatch_tokens:  # the padded exchange: rank g's block is the g-th of the others'
            self._check_dispatch_tokens(T)
            block_G = torch.arange(G, device=device)
            block_G = (block_G - (block_G > me).long()) * self.dispatch_tokens
            send_row_GT = has_GT.cumsum(1) - 1 + block_G[:, None]
        else:
            send_row_GT = has_GT.flatten().cumsum(0).view(G, T) - 1  # by destination rank, then token
        route = _Route(own_TK=own_TK, sent_TG=torch.where(has_GT > 0, send_row_GT, -1).t().contiguous(),
                       dest_TK=dest_TK, unique_G=has_GT.sum(1), me=me, group=self.ep_group, timer=self.comm_timer,
                       stream=self._side_streams.get(device), layer=flight.RECORDER.layer)
        return route, place_TK

    def _prepare(self, plans: list[RoutingPlan]) -> list[_Counts]:
        """The routes of N dispatches, and their counts in one small all-to-all (per destination
        rank: its L experts' pair counts and the unique rows, N·G·(L + 1) int64 per rank). Exact
        sizes: on their way to the host in one copy, the one host sync of a layer's dispatches,
        taken by the first of them (in :class:`_DispatchFn`). Padded: they stay on the device."""
        G = self.ep_size
        routes = [self._route(plan) for plan in plans]
        send_counts = torch.stack([torch.cat([plan.kept_per_expert_E.view(G, -1), route.unique_G[:, None]], 1)
                                   for plan, (route, _) in zip(plans, routes)], 1)
        recv_counts_all = torch.empty_like(send_counts)  # by source rank
        _timed_all_to_all(recv_counts_all, send_counts, None, None, self.ep_group, self.comm_timer, "dispatch counts")
        if self.dispatch_tokens:
            K, E = plans[0].kept_TK.shape[1], plans[0].kept_per_expert_E.numel()
            splits = [0 if g == self.ep_rank else self.dispatch_tokens for g in range(G)]
            fixed = (splits, splits, self._received_rows_bound(E, K, self.dispatch_tokens))
            return [_Counts(route, place_TK, recv_counts_all[:, n].contiguous(),
                            padded=(self.dispatch_tokens, self.ep_rank), fixed=fixed)
                    for n, (route, place_TK) in enumerate(routes)]
        host_counts_all = torch.stack([send_counts, recv_counts_all]).to("cpu", non_blocking=True)
        copied = torch.cuda.Event() if send_counts.is_cuda else None
        if copied is not None:
            copied.record()
        return [_Counts(route, place_TK, recv_counts_all[:, n].contiguous(), host_counts_all[:, :, n], copied)
                for n, (route, place_TK) in enumerate(routes)]

    def _dispatch_ep(self, x_TD: torch.Tensor, plan: RoutingPlan, w_TK: torch.Tensor, num_experts: int,
                     prepared: _Counts, row_dtype: torch.dtype):
        """x_TD (T, D) -> rows_RD (R, D), expert-major (:func:`~parallel.token_rows.expert_rows`);
        offsets_J (L,) int32 cumulative ends of the local experts' rows; w_R (R,) the rows'
        combine weights; and the metadata for :meth:`combine`."""
        # enqueued before the host waits for the counts (in _DispatchFn): they run while the counts travel
        offsets_J = prepared.recv_counts[:, :-1].sum(0).cumsum(0, dtype=torch.int32)
        route = replace(prepared.route, own_TK=expert_rows(prepared.route.own_TK, prepared.recv_counts, self.ep_rank))
        prepared = replace(prepared, route=route)
        if prepared.fixed is not None and self.capacity_factor is not None:
            # past R_cap the received rows' copies would write out of the buffer; dropless never gets there
            torch._assert_async(offsets_J[-1] <= prepared.fixed[2],
                                "AllToAllDispatcher: a layer received more rows than its declared capacity allows")
        rows_RD, w_R, row_MK = _DispatchFn.apply(x_TD, w_TK, prepared, row_dtype)
        send_splits, recv_splits, R = prepared.sizes()  # on the host since the dispatch
        meta = AllToAllMeta(route=route, row_MK=row_MK, send_splits=send_splits, recv_splits=recv_splits, num_rows=R)
        return rows_RD, offsets_J, w_R, meta

    def _combine_ep(self, y_RD: torch.Tensor, meta: AllToAllMeta, out_dtype: torch.dtype) -> torch.Tensor:
        return _CombineFn.apply(y_RD, meta, out_dtype)
