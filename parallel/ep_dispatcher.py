"""What every expert-parallel dispatcher shares, whatever moves its rows.

Legend: E experts, R rows this rank receives for its experts, D model dim.

:class:`ExpertParallelDispatcher` holds the groups, the check that the experts split over the
ranks, the one-rank fallback to :class:`~moe.dispatch.LocalDispatcher`, the rule that keeps ranks
that receive nothing in the autograd graph, and the global reductions of the load-balancing
loss's inputs and of the expert counts. A transport (:class:`~parallel.AllToAllDispatcher`:
NCCL all-to-all; :class:`~parallel.P2PDispatcher`: NVLink peer stores) implements
``_dispatch_ep`` and ``_combine_ep`` for a group of more than one rank.
"""

import contextlib
import math
from abc import abstractmethod
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from kernel_floor import cdiv
from moe.capacity import RoutingPlan, max_received_rows, split_plan
from moe.config import check_positive_int
from moe.dispatch import Dispatcher, DispatchMeta, LocalDispatcher, LocalDispatchMeta, check_combine_weights
from parallel import flight
from parallel.all_to_all import all_reduce_sum
from parallel.comm import SideStreams


@dataclass(frozen=True, kw_only=True)
class ExpertParallelMeta(DispatchMeta):
    """Base of the expert-parallel dispatchers' metadata.

    empty_rows_RD: when this rank received no rows (R = 0), the (0, D) rows handed to the
        experts, set by :meth:`ExpertParallelDispatcher.dispatch` (see :func:`_keep_in_graph`).
    """

    empty_rows_RD: torch.Tensor | None = None


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
    """Make both exchange backwards run on every rank, whatever this rank received.

    The backward exchanges are collectives: if one rank's autograd graph skipped them, the other
    ranks would wait forever. A rank that received no rows (R = 0) has experts that compute
    nothing, so its expert output does not depend on the received rows nor on the weights. Two
    rules make the graph the same on every rank:
    - the dispatch exchange's backward exists iff ``x_TD`` or the combine weights require grad (the
      same on every rank; both transports' dispatches carry the weights); when R = 0 the (empty) received
      rows are tied to the output with a zero gradient, so the backward reaches that exchange (costs
      nothing: the tensors have 0 rows);
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


class ExpertParallelDispatcher(Dispatcher):
    """Base of the dispatchers for :class:`moe.MoELayer` over an expert-parallel process group.

    Args:
        ep_group: the expert-parallel group (this rank holds experts ``[r·L, (r+1)·L)`` where r
            is its rank in the group).
        world_group: every rank holding part of the batch; the load-balancing loss's inputs are
            summed over it. Default: the default (world) group.
        overlap_chunks: N; :meth:`run_experts` cuts a layer's tokens into N contiguous chunks and
            pipelines them, so that one chunk's exchange runs while another chunk's experts
            compute (see :meth:`run_experts`). 1: no pipelining.

    With a group of one rank, dispatch and combine are the local gather/scatter (no host sync)
    and only the loss inputs are reduced. Subclasses implement the exchange for more ranks.
    """

    def __init__(self, ep_group=None, world_group=None, overlap_chunks: int = 1):
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed.init_process_group() first")
        check_positive_int(f"{type(self).__name__}: overlap_chunks", overlap_chunks)
        self.ep_group = ep_group
        self.world_group = world_group
        self.overlap_chunks = overlap_chunks
        self._ep_size = dist.get_world_size(ep_group)
        self._ep_rank = dist.get_rank(ep_group)
        # the same ranks in both groups (one node's ParallelDims: edp 1): reduce_aux_and_counts
        # then sums the loss's inputs and the counts in one collective
        self._one_reduction = self._ep_size > 1 and _ranks(ep_group) == _ranks(world_group)
        self._local = LocalDispatcher()
        self._overlap_streams = SideStreams()
        # a transport with fixed buffers sets both (_set_token_bound)
        self.max_tokens: int | None = None
        self.dispatch_tokens: int | None = None

    def _set_token_bound(self, max_tokens: int, capacity_factor: float | None, capacity_groups: int) -> None:
        """Validate and keep the bound on the tokens a rank passes to one dispatch, and the MoE
        layers' capacity (when they cap), which size the buffers of a transport whose host never
        learns what it receives (:meth:`_received_rows_bound`)."""
        name = type(self).__name__
        check_positive_int(f"{name}: max_tokens", max_tokens)
        check_positive_int(f"{name}: capacity_groups", capacity_groups)
        if capacity_factor is not None and not 0 < capacity_factor < math.inf:
            raise ValueError(f"{name}: capacity_factor must be a finite number > 0 or None, got {capacity_factor}")
        if capacity_factor is not None and max_tokens < capacity_groups:
            raise ValueError(f"{name}: max_tokens={max_tokens} tokens do not fill capacity_groups={capacity_groups}")
        self.max_tokens = max_tokens
        self.capacity_factor, self.capacity_groups = capacity_factor, capacity_groups
        # the most tokens of one dispatch: a chunk's share under run_experts' chunks
        self.dispatch_tokens = cdiv(max_tokens, self.overlap_chunks)

    def _check_dispatch_tokens(self, T: int) -> None:
        """Refuse a dispatch of more than :attr:`dispatch_tokens` tokens, which its buffers do
        not hold."""
        if T > self.dispatch_tokens:
            bound = (f"max_tokens={self.max_tokens}" if self.overlap_chunks == 1 else
                     f"a chunk's {self.dispatch_tokens} (max_tokens={self.max_tokens}, "
                     f"overlap_chunks={self.overlap_chunks})")
            raise ValueError(f"{type(self).__name__}: {T} tokens on rank {self.ep_rank} exceed {bound}")

    def _received_rows_bound(self, num_experts: int, top_k: int, tokens: int | None = None) -> int:
        """The most rows this rank's experts receive in one dispatch of at most ``tokens`` tokens a
        rank (default ``max_tokens``; a chunk of a layer's tokens passes fewer): the dropless
        bound, or the capacity's over the layer's ``max_tokens`` where smaller
        (:func:`moe.capacity.max_received_rows`)."""
        dropless = self.ep_size * (self.max_tokens if tokens is None else tokens) * top_k
        return min(dropless, max_received_rows(self.max_tokens, num_experts, top_k, self.capacity_factor,
                                               self.capacity_groups, self.ep_size))

    def _token_bound_repr(self) -> str:
        capped = ("" if self.capacity_factor is None else
                  f", capacity_factor={self.capacity_factor}, capacity_groups={self.capacity_groups}")
        return f"max_tokens={self.max_tokens}{capped}"

    @property
    def ep_size(self) -> int:
        return self._ep_size

    @property
    def ep_rank(self) -> int:
        return self._ep_rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ep_size={self.ep_size}, ep_rank={self.ep_rank})"

    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan, w_TK: torch.Tensor, row_dtype: torch.dtype | None = None,
                 prepared=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DispatchMeta]:
        """See :meth:`moe.Dispatcher.dispatch`; ``prepared``: this dispatch's entry of
        :meth:`_prepare` when :meth:`run_experts` prepared several at once (None: its own)."""
        if self.ep_size == 1:
            return self._local.dispatch(x_TD, plan, w_TK, row_dtype)
        check_combine_weights(f"{type(self).__name__}.dispatch", w_TK, plan)
        num_experts = plan.kept_per_expert_E.numel()
        if num_experts % self.ep_size:
            raise ValueError(f"{type(self).__name__}: {num_experts} experts do not split over {self.ep_size} ranks")
        if prepared is None:
            prepared = self._prepare([plan])[0]
        rows_RD, offsets_J, w_R, meta = self._dispatch_ep(x_TD, plan, w_TK, num_experts, prepared,
                                                          row_dtype or x_TD.dtype)
        if rows_RD.shape[0] == 0:
            meta = replace(meta, empty_rows_RD=rows_RD)
        return rows_RD, offsets_J, w_R, meta

    def run_experts(self, experts, x_TD: torch.Tensor, plan: RoutingPlan, experts_TK: torch.Tensor,
                    w_TK: torch.Tensor, out_dtype: torch.dtype | None = None,
                    row_dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`moe.Dispatcher.run_experts`, pipelined over ``overlap_chunks`` = N token chunks.

        The whole plan's drops are cut into N chunk plans (:func:`moe.capacity.split_plan`). What
        every chunk dispatch needs first (the NCCL transport: its route, and the per-expert and
        unique-row counts, read on the host) is made and exchanged for all N at once
        (:meth:`_prepare`: one host sync per layer, not N). Then, on a second CUDA stream, the N
        dispatches are enqueued; on the current stream the experts of chunk c wait only for dispatch
        c, and combine c (second stream again) waits only for them. So the second stream runs
        dispatch c+1 while chunk c's experts compute, and combine c while chunk c+1's experts
        compute: of the 2N exchanges, dispatch 0 and combine N−1 are left exposed. The backward
        keeps the overlap: autograd runs each backward on its forward's stream (combine c's backward
        beside the experts' backward of chunk c+1's, ...).

        The results equal the unchunked path's up to the experts' and combine's rounding (the
        same pairs, weights and drops; the weight gradients summed over chunks). On a CPU the
        chunks run one after the other. A transport with fixed buffers (``max_tokens``) refuses a
        layer of more tokens first.
        """
        if self.max_tokens is not None and x_TD.shape[0] > self.max_tokens:
            # before the chunks: each is checked against its share, which a larger layer could pass
            raise ValueError(f"{type(self).__name__}: {x_TD.shape[0]} tokens on rank {self.ep_rank} exceed "
                             f"max_tokens={self.max_tokens}")
        if self.ep_size == 1 or self.overlap_chunks == 1:
            return super().run_experts(experts, x_TD, plan, experts_TK, w_TK, out_dtype, row_dtype)
        chunks = split_plan(plan, experts_TK, self.overlap_chunks)
        main, side = _current_stream(x_TD.device), self._overlap_streams.get(x_TD.device)
        if side is not None:
            side.wait_stream(main)  # the plan and x_TD are made on the current stream
        dispatched, ready = [], []
        with _on(side):
            prepared = self._prepare([chunk_plan for _, chunk_plan in chunks])
            for (tokens, chunk_plan), prep in zip(chunks, prepared):
                dispatched.append(self.dispatch(x_TD[tokens], chunk_plan, w_TK[tokens], row_dtype, prep))
                ready.append(side.record_event() if side is not None else None)
        outs = []
        for (rows_RD, offsets_J, w_R, meta), event in zip(dispatched, ready):
            if side is not None:
                main.wait_event(event)
                # made on the side stream and saved by the experts for their backward: unrecorded,
                # offsets_J went back to the side stream's pool once the experts' backward was
                # enqueued, where the side stream's next allocation (chunk c−1's combine backward,
                # the next to run) could overwrite it while the wgrad kernel still read it (an
                # illegal address in the first backward of the OLMoE-shaped step on 2×H200, 3 runs
                # of 3; fixed by this record, 3 of 3 clean; the tiny GPU test had passed)
                _record_stream(main, rows_RD, offsets_J, *([] if w_R is None else [w_R]))
            y_RD = experts(rows_RD, offsets_J, w_R)
            if side is not None:
                side.wait_stream(main)
                _record_stream(side, y_RD)
            with _on(side):
                out_TD = self.combine(y_RD, meta, out_dtype)
            outs.append(out_TD)
        if side is not None:
            main.wait_stream(side)
            _record_stream(main, *outs)
            _record_stream(side, x_TD, w_TK)  # read there through their chunks' views
        return torch.cat(outs)

    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if isinstance(meta, LocalDispatchMeta):
            return self._local.combine(y_RD, meta, out_dtype)
        y_RD = _keep_in_graph(y_RD, meta.empty_rows_RD)
        return self._combine_ep(y_RD, meta, out_dtype or y_RD.dtype)

    def _prepare(self, plans: list[RoutingPlan]) -> list:
        """What N dispatches need before they move rows, done for all N at once from their plans:
        one entry per dispatch, handed to :meth:`_dispatch_ep`. None here."""
        return [None] * len(plans)

    @abstractmethod
    def _dispatch_ep(self, x_TD: torch.Tensor, plan: RoutingPlan, w_TK: torch.Tensor, num_experts: int, prepared,
                     row_dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ExpertParallelMeta]:
        """:meth:`dispatch` over more than one rank; ``num_experts`` E is a multiple of ep_size;
        ``prepared``: this dispatch's entry of :meth:`_prepare`; rows sent and returned in
        ``row_dtype``, the backward's sum in fp32 into x's dtype."""

    @abstractmethod
    def _combine_ep(self, y_RD: torch.Tensor, meta: ExpertParallelMeta, out_dtype: torch.dtype) -> torch.Tensor:
        """:meth:`combine` of what :meth:`_dispatch_ep` returned; y_RD is already kept in the graph."""

    def reduce_aux_inputs(self, routed_E: torch.Tensor, prob_sum_E: torch.Tensor,
                          num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sum the load-balancing loss's inputs over the world in one all-reduce.

        routed_E (E,) int64, prob_sum_E (E,) fp32 (differentiable: the backward sums the
        gradients over the world, see :class:`~parallel.all_to_all.AllReduceSumFn`), num_tokens
        T. The global token count stays a (0-d) device tensor, so the loss needs no host sync.
        """
        prob_sum, routed_1E, num_tokens_0d = self._sum_over_world(
            prob_sum_E, routed_E[None], num_tokens, "all_reduce of the load-balancing inputs")
        return routed_1E[0], prob_sum, num_tokens_0d

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(..., E) per-expert counts summed over the expert-parallel group (no gradient)."""
        if self.ep_size == 1:
            return counts
        total = counts.detach().clone()
        flight.record("all_reduce of the expert counts", self.ep_group)
        dist.all_reduce(total, group=self.ep_group)
        return total

    def reduce_aux_and_counts(self, routed_E: torch.Tensor, kept_E: torch.Tensor, prob_sum_E: torch.Tensor,
                              num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`moe.Dispatcher.reduce_aux_and_counts` in one all-reduce when the world group and
        the expert-parallel group hold the same ranks (expert-data-parallel degree 1, the common
        one-node layout): the counts' sum over the EP group is then their sum over the world, so
        they travel with the loss's inputs. Otherwise the two calls (with one EP rank, only the
        loss's inputs make a collective). The one collective bypasses :meth:`reduce_aux_inputs` and
        :meth:`reduce_counts`: a subclass that changes either changes this too.

        Why: every collective is a point where the ranks wait for each other, and a layer's
        forward made two. On 2×H200 (EP 2, OLMoE-shaped, 16 MoE layers, 8 micro-batches a step)
        their all-reduce kernels took 115 ms (the counts, int64) and 79 ms (the loss's inputs,
        fp64) a step, mostly waiting for the slower rank (bench/results/step_profile.md, the
        P2P A/B run of 5172b30; not yet re-measured with the one all-reduce).
        """
        if not self._one_reduction:
            return super().reduce_aux_and_counts(routed_E, kept_E, prob_sum_E, num_tokens)
        prob_sum, counts_2E, num_tokens_0d = self._sum_over_world(
            prob_sum_E, torch.stack([routed_E, kept_E]), num_tokens,
            "all_reduce of the load-balancing inputs and the expert counts")
        return counts_2E[0], prob_sum, num_tokens_0d, counts_2E

    def _sum_over_world(self, prob_sum_E: torch.Tensor, counts_CE: torch.Tensor, num_tokens: int,
                        what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prob_sum_E (E,) (differentiable), counts_CE (C, E) integer counts, num_tokens T, each
        summed over the world in one all-reduce (named ``what`` in the flight recorder) ->
        (prob_sum_E, counts_CE (no gradient, counts' dtype), num_tokens_0d in prob_sum_E's dtype).

        Packed in fp64: exact for counts below 2^53, and one dtype for the probabilities and the
        counts, so they need one collective.
        """
        num_experts = prob_sum_E.numel()
        packed = torch.cat([
            prob_sum_E.to(torch.float64),
            counts_CE.detach().to(torch.float64).reshape(-1),
            prob_sum_E.new_full((1,), num_tokens, dtype=torch.float64),
        ])
        total = all_reduce_sum(packed, self.world_group, what)
        counts = total[num_experts:-1].detach().round().to(counts_CE.dtype).view(counts_CE.shape)
        return total[:num_experts].to(prob_sum_E.dtype), counts, total[-1].detach().to(prob_sum_E.dtype)


def _ranks(group) -> set[int]:
    """The global ranks of ``group`` (None: the default group)."""
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _current_stream(device: torch.device) -> "torch.cuda.Stream | None":
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _record_stream(stream: "torch.cuda.Stream | None", *tensors: torch.Tensor) -> None:
    """``record_stream(stream)`` on each tensor: the caching allocator then reuses its memory only
    once ``stream``'s work queued before it is freed is done. Nothing on a CPU."""
    if stream is not None:
        for t in tensors:
            t.record_stream(stream)


def _on(stream: "torch.cuda.Stream | None"):
    """``torch.cuda.stream(stream)``, or nothing to switch when there is none (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
