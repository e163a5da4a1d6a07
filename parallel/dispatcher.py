"""Expert-parallel dispatcher: tokens travel to their expert's rank by all-to-all, and back.

Legend: T tokens, D model dim, K slots per token, P = T·K pairs, E experts, G ranks of the
expert-parallel group, L = E / G experts per rank, S pairs this rank keeps and sends, R rows it
receives for its L experts.

``dispatch``:
1. ``plan.order_P`` lists the kept pairs sorted by expert, hence by destination rank (rank g holds
   experts ``[g·L, (g+1)·L)``), then the dropped pairs: the first S entries are the send order.
2. Per-expert counts go out with one small all-to-all (E int64 per rank), and both the sent and
   received counts come to the host in ONE device->host copy: ``all_to_all_single`` takes its
   split sizes as Python lists, so this is the one host sync of the layer's dispatch. The token
   rows are gathered while that copy is in flight.
3. The S rows move with one variable-split :func:`~parallel.all_to_all.all_to_all`; they arrive
   ordered (source rank, local expert) and stay in that order: the grouped GEMM takes them as
   G·L row segments, segment ``g·L + l`` multiplied by local expert l's weights (see
   ``moe.kernels.grouped_mm``). Rows of one expert are thus processed in global-batch order
   (source rank, then pair), as in one process, with no regrouping pass.

``combine`` sends the expert outputs back with the reverse all-to-all (they arrive in send
order) and hands them to :func:`~moe.kernels.combine.weighted_combine`, which gathers each
token's K rows and sums them with the combine weights in one pass (pairs not sent weigh zero).
Measured on 2×H200 (bench/all_to_all.py, 2026-11-22), the version that regrouped by expert
and un-permuted into pair order made four more passes over the rows than the raw exchange and
reached 0.41–0.65× its bandwidth. The backward of each step is the reverse of its forward.

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
from moe.kernels.combine import row_of_pair, weighted_combine
from parallel.all_to_all import AllToAllFn, all_reduce_sum, all_to_all
from parallel.permute import gather_pairs


@dataclass(frozen=True)
class AllToAllMeta:
    """What ``combine`` needs from ``dispatch``.

    kept_idx_S: (S,) int64 pair index of each sent row, in send order.
    row_of_pair_P: (P,) int64 send position of each pair (positions >= S: dropped, not sent).
    send_splits, recv_splits: rows sent to / received from each group rank.
    empty_rows_RD: when R = 0, the (0, D) rows handed to the experts (see :func:`_keep_in_graph`).
    """

    kept_idx_S: torch.Tensor
    row_of_pair_P: torch.Tensor
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


class _TimedAllToAllFn(torch.autograd.Function):
    """:class:`~parallel.all_to_all.AllToAllFn` with its forward and backward exchange timed."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, out_splits: list[int], in_splits: list[int], group, timer: CommTimer):
        ctx.timer = timer
        begin = timer.start(x_RD.device)
        out = AllToAllFn.forward(ctx, x_RD, out_splits, in_splits, group)
        timer.stop(begin)
        return out

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        begin = ctx.timer.start(grad_RD.device)
        grads = AllToAllFn.backward(ctx, grad_RD)
        ctx.timer.stop(begin)
        return *grads, None


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

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep_size={self.ep_size}, ep_rank={self.ep_rank})"

    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, AllToAllMeta]:
        """x_TD (T, D) -> rows_RD (R, D) ordered (source rank, local expert), offsets_GL (G·L,)
        int32 cumulative segment ends (segment g·L + l: local expert l), and the metadata for
        :meth:`combine`."""
        if self.ep_size == 1:
            return self._local.dispatch(x_TD, plan)
        G = self.ep_size
        num_experts = plan.kept_per_expert_E.numel()
        if num_experts % G:
            raise ValueError(f"AllToAllDispatcher: {num_experts} experts do not split over {G} ranks")
        L = num_experts // G
        T, K = plan.kept_TK.shape
        send_counts_E = plan.kept_per_expert_E.contiguous()
        recv_counts_E = torch.empty_like(send_counts_E)
        begin = self.comm_timer.start(send_counts_E.device) if self.comm_timer is not None else None
        dist.all_to_all_single(recv_counts_E, send_counts_E, group=self.ep_group)
        if begin is not None:
            self.comm_timer.stop(begin)
        counts_host = torch.cat([send_counts_E, recv_counts_E]).to("cpu", non_blocking=True)
        copied = torch.cuda.Event() if send_counts_E.is_cuda else None
        if copied is not None:
            copied.record()
        # Everything that does not need the counts on the host is enqueued before the host waits:
        # every pair's row (dropped pairs are cut below), the combine's inverse index and the
        # segment offsets run while the counts travel to the host.
        send_PD = gather_pairs(x_TD, plan.order_P, K)
        row_of_pair_P = row_of_pair(plan.order_P, T * K)
        # segment g·L + l: rows from source g for local expert l (weights w[l], see module doc)
        offsets_GL = torch.cumsum(recv_counts_E, 0).to(torch.int32)
        if copied is not None:
            copied.synchronize()
        send_splits, recv_splits = counts_host.view(2, G, L).sum(-1).tolist()
        num_sent, num_recv = sum(send_splits), sum(recv_splits)
        # dropless sends every row; slicing off dropped pairs costs a zero-fill in backward
        send_SD = send_PD if num_sent == T * K else send_PD[:num_sent]
        rows_RD = self._exchange(send_SD, recv_splits, send_splits)
        meta = AllToAllMeta(
            kept_idx_S=plan.order_P[:num_sent],
            row_of_pair_P=row_of_pair_P,
            send_splits=send_splits,
            recv_splits=recv_splits,
            empty_rows_RD=rows_RD if num_recv == 0 else None,
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
        y_SD = self._exchange(y_RD, meta.send_splits, meta.recv_splits)
        return weighted_combine(y_SD, meta.kept_idx_S, w_TK, out_dtype, row_of_pair_P=meta.row_of_pair_P)

    def _exchange(self, x_RD: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        if self.comm_timer is None:
            return all_to_all(x_RD, out_splits, in_splits, self.ep_group)
        return _TimedAllToAllFn.apply(x_RD, out_splits, in_splits, self.ep_group, self.comm_timer)

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
