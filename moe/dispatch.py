"""Dispatchers: move routed rows to their experts and back.

Legend: T tokens, D model dim, K slots per token, P = T·K pairs, E experts, L experts on this
rank, R rows for the local experts.

Model code never talks to the network: ``MoELayer`` hands the rows to a dispatcher. A dispatcher
keeps no state between ``dispatch()`` and ``combine()``; everything ``combine()`` needs travels in
the frozen metadata that ``dispatch()`` returns. Every dispatcher implements:

- ``ep_size``, ``ep_rank``: the expert-parallel group; rank r holds experts ``[r·L, (r+1)·L)``.
- ``dispatch(x_TD, plan) -> (rows_RD, offsets_S, meta)``: the rows for the local experts in S
  segments and the cumulative end offset of each segment (int32, for the grouped GEMM); S is a
  multiple of L and segment s belongs to local expert ``s % L`` (S = L: rows sorted by expert).
- ``combine(y_RD, meta, w_TK, out_dtype=None) -> out_TD``: each token's K expert outputs summed
  with the combine weights ``w_TK`` (T, K) fp32, in fp32, cast to ``out_dtype``; dropped pairs
  contribute zero.
- ``reduce_aux_inputs(routed_E, prob_sum_E, num_tokens)``: the load-balancing loss's inputs summed
  over every rank that holds part of the batch, so the loss equals the one-process loss on the
  concatenated batch (the token count may come back as an int or a 0-d tensor).
- ``reduce_counts(counts_XE)``: per-expert counts (any leading dims) summed over the
  expert-parallel group (the rows each rank's grouped GEMM really processes, and the global load
  the user watches).
"""

from dataclasses import dataclass

import torch

from moe.capacity import RoutingPlan
from moe.kernels.combine import weighted_combine


@dataclass(frozen=True)
class LocalDispatchMeta:
    """order_P: (P,) packing order of the pairs (kept first, by expert); top_k: K."""

    order_P: torch.Tensor
    top_k: int


class LocalDispatcher:
    """All experts on this process: dispatch is a gather, combine the inverse scatter.

    Every pair (dropped ones too) is packed, dropped pairs last, so shapes never depend on the
    routing and nothing waits on the host; the grouped GEMM writes zeros for rows past the last
    offset, which is what a dropped pair contributes.
    """

    ep_size = 1
    ep_rank = 0

    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchMeta]:
        top_k = plan.kept_TK.shape[1]
        rows_RD = x_TD.index_select(0, plan.order_P // top_k)
        offsets_E = torch.cumsum(plan.kept_per_expert_E, 0).to(torch.int32)
        return rows_RD, offsets_E, LocalDispatchMeta(plan.order_P, top_k)

    def combine(self, y_RD: torch.Tensor, meta: LocalDispatchMeta, w_TK: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # row r holds pair order_P[r]; a dropped pair's row is zero (past the last offset)
        return weighted_combine(y_RD, meta.order_P, w_TK, out_dtype)

    def reduce_aux_inputs(self, routed_E, prob_sum_E, num_tokens):
        return routed_E, prob_sum_E, num_tokens

    def reduce_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        return counts_E
