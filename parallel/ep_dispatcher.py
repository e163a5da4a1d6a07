"""What every expert-parallel dispatcher shares, whatever moves its rows.

Legend: E experts, R rows this rank receives for its experts, D model dim.

:class:`ExpertParallelDispatcher` holds the groups, the check that the experts split over the
ranks, the one-rank fallback to :class:`~moe.dispatch.LocalDispatcher`, the rule that keeps ranks
that receive nothing in the autograd graph, and the global reductions of the load-balancing
loss's inputs and of the expert counts. A transport (:class:`~parallel.AllToAllDispatcher`:
NCCL all-to-all; :class:`~parallel.P2PDispatcher`: NVLink peer stores) implements
``_dispatch_ep`` and ``_combine_ep`` for a group of more than one rank.
"""

from abc import abstractmethod
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from moe.capacity import RoutingPlan
from moe.dispatch import Dispatcher, DispatchMeta, LocalDispatcher, LocalDispatchMeta
from parallel import flight
from parallel.all_to_all import all_reduce_sum


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


class ExpertParallelDispatcher(Dispatcher):
    """Base of the dispatchers for :class:`moe.MoELayer` over an expert-parallel process group.

    Args:
        ep_group: the expert-parallel group (this rank holds experts ``[r·L, (r+1)·L)`` where r
            is its rank in the group).
        world_group: every rank holding part of the batch; the load-balancing loss's inputs are
            summed over it. Default: the default (world) group.

    With a group of one rank, dispatch and combine are the local gather/scatter (no host sync)
    and only the loss inputs are reduced. Subclasses implement the exchange for more ranks.
    """

    def __init__(self, ep_group=None, world_group=None):
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed.init_process_group() first")
        self.ep_group = ep_group
        self.world_group = world_group
        self._ep_size = dist.get_world_size(ep_group)
        self._ep_rank = dist.get_rank(ep_group)
        self._local = LocalDispatcher()

    @property
    def ep_size(self) -> int:
        return self._ep_size

    @property
    def ep_rank(self) -> int:
        return self._ep_rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ep_size={self.ep_size}, ep_rank={self.ep_rank})"

    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, DispatchMeta]:
        if self.ep_size == 1:
            return self._local.dispatch(x_TD, plan)
        num_experts = plan.kept_per_expert_E.numel()
        if num_experts % self.ep_size:
            raise ValueError(f"{type(self).__name__}: {num_experts} experts do not split over {self.ep_size} ranks")
        rows_RD, offsets_J, meta = self._dispatch_ep(x_TD, plan, num_experts)
        if rows_RD.shape[0] == 0:
            meta = replace(meta, empty_rows_RD=rows_RD)
        return rows_RD, offsets_J, meta

    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta, w_TK: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if isinstance(meta, LocalDispatchMeta):
            return self._local.combine(y_RD, meta, w_TK, out_dtype)
        y_RD = _keep_in_graph(y_RD, meta.empty_rows_RD)
        return self._combine_ep(y_RD, meta, w_TK, out_dtype or y_RD.dtype)

    @abstractmethod
    def _dispatch_ep(self, x_TD: torch.Tensor, plan: RoutingPlan,
                     num_experts: int) -> tuple[torch.Tensor, torch.Tensor, ExpertParallelMeta]:
        """:meth:`dispatch` over more than one rank; ``num_experts`` E is a multiple of ep_size."""

    @abstractmethod
    def _combine_ep(self, y_RD: torch.Tensor, meta: ExpertParallelMeta, w_TK: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
        """:meth:`combine` of what :meth:`_dispatch_ep` returned; y_RD is already kept in the graph."""

    def reduce_aux_inputs(self, routed_E: torch.Tensor, prob_sum_E: torch.Tensor,
                          num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(..., E) per-expert counts summed over the expert-parallel group (no gradient)."""
        if self.ep_size == 1:
            return counts
        total = counts.detach().clone()
        flight.record("all_reduce of the expert counts", self.ep_group)
        dist.all_reduce(total, group=self.ep_group)
        return total
