"""Expert capacity and the token-drop policy.

Legend: T tokens, K experts per token (top-k), P = T·K (token, slot) pairs, E experts, C capacity
per expert, Q capacity groups.
A pair is ``p = t·K + k``. The capacity is a cap on the pairs an expert keeps, never a size that
anything is padded to.
"""

import math
import typing
from dataclasses import dataclass
from typing import Literal

import torch

from moe.kernels.expert_sort import count_keys, sort_by_key

DropPolicy = Literal["probs", "position"]
DROP_POLICIES = typing.get_args(DropPolicy)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """``C = ceil(capacity_factor · T · K / E)``; ``None`` means dropless.

    ``T`` is the number of tokens of one capacity group (the tokens of one rank), so every rank
    computes the same C from values it knows. A C of T or more never drops: a token picks an
    expert at most once.
    """
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def max_received_rows(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None,
                      capacity_groups: int, ep: int) -> int:
    """The most rows one rank's experts can receive in one expert-parallel dispatch, every rank of
    the ep ranks passing at most ``num_tokens`` tokens: ep·T·K dropless (every pair of every rank
    to this rank's experts). With a capacity each expert keeps at most C pairs per capacity group
    of each source rank (:func:`plan_routing`), and at most T (a token picks an expert once), so
    the L = E / ep experts of a rank receive at most ep · L · min(Q · C, T) = E · min(Q · C, T)
    rows, C the capacity of T / Q tokens; whichever is smaller."""
    dropless = ep * num_tokens * top_k
    if capacity_factor is None:
        return dropless
    C = expert_capacity(num_tokens // capacity_groups, num_experts, top_k, capacity_factor)
    return min(dropless, num_experts * min(capacity_groups * C, num_tokens))


@dataclass(frozen=True)
class RoutingPlan:
    """Which pairs are kept and in which order they are packed.

    order_P: (P,) int64 pair indices: kept pairs first, sorted by expert (ties by pair index),
        then the dropped pairs. Sorting by expert also sorts by destination rank, since rank r
        holds experts ``[r·L, (r+1)·L)``.
    kept_TK: (T, K) bool.
    kept_per_expert_E: (E,) int64 pairs each expert keeps.
    routed_per_expert_E: (E,) int64 pairs routed to each expert before the cap.
    """

    order_P: torch.Tensor
    kept_TK: torch.Tensor
    kept_per_expert_E: torch.Tensor
    routed_per_expert_E: torch.Tensor


def plan_routing(
    experts_TK: torch.Tensor,
    priority_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    drop_policy: DropPolicy = "probs",
    capacity_groups: int = 1,
) -> RoutingPlan:
    """Apply the capacity and sort the pairs by expert. No host synchronisation.

    Args:
        experts_TK: (T, K) int64 chosen experts.
        priority_TK: (T, K) fp32 router score of each pair.
        capacity: C per expert and capacity group, or None.
        drop_policy: ``"probs"`` keeps each expert's C highest-priority pairs (equal priorities:
            the earlier token wins); ``"position"`` keeps its C earliest tokens.
        capacity_groups: Q; the T tokens are Q equal contiguous groups (one per data-parallel
            shard) and the cap applies within each. One process with Q = the number of
            data-parallel ranks, on the concatenated batch, drops exactly what those ranks drop
            on their shards.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    T, K = experts_TK.shape
    expert_P = experts_TK.reshape(-1)
    if capacity is None:  # dropless: every pair kept, the pairs by expert, the kept counts the routed
        order_P, routed_E = sort_by_key(expert_P, num_experts)
        kept_P = torch.ones_like(expert_P, dtype=torch.bool)
        return RoutingPlan(order_P, kept_P.view(T, K), routed_E, routed_E)
    routed_E = count_keys(expert_P, num_experts)
    if T % capacity_groups:
        raise ValueError(f"{T} tokens do not split into capacity_groups={capacity_groups} equal groups")
    pair_P = torch.arange(T * K, device=expert_P.device)
    group_P = pair_P // (K * (T // capacity_groups))
    segment_P = group_P * num_experts + expert_P
    if drop_policy == "probs":
        # stable sort: equal priorities keep pair order, so the earlier token wins the tie
        by_priority = torch.argsort(-priority_TK.reshape(-1), stable=True)
    else:
        by_priority = pair_P
    ranked = by_priority[torch.argsort(segment_P[by_priority], stable=True)]
    seg_sorted = segment_P[ranked]
    seg_sizes = count_keys(seg_sorted, capacity_groups * num_experts)
    seg_starts = torch.cumsum(seg_sizes, 0) - seg_sizes
    rank_in_seg = pair_P - seg_starts[seg_sorted]
    kept_P = torch.empty_like(expert_P, dtype=torch.bool)
    kept_P[ranked] = rank_in_seg < capacity
    order_P, kept_E = _pack(expert_P, kept_P, num_experts)
    return RoutingPlan(order_P, kept_P.view(T, K), kept_E, routed_E)


def _pack(expert_P: torch.Tensor, kept_P: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_P, kept_per_expert_E) of a plan: kept pairs sorted by expert, then the dropped
    pairs (key E); the stable sort keeps pair order within an expert."""
    order_P, count_E1 = sort_by_key(torch.where(kept_P, expert_P, num_experts), num_experts + 1)
    return order_P, count_E1[:num_experts]


def split_plan(plan: RoutingPlan, experts_TK: torch.Tensor, num_chunks: int) -> list[tuple[slice, RoutingPlan]]:
    """The plan of T tokens as the plans of ``num_chunks`` contiguous token ranges (as equal as
    possible), for dispatching a layer's tokens chunk by chunk. Always ``num_chunks`` of them,
    empty ones too when T < num_chunks: under expert parallelism every rank makes the same
    dispatches (collectives), whatever its own token count.

    The drops are the whole plan's (the capacity was applied over all T tokens), so the chunks
    together keep exactly its pairs. Each chunk's ``order_P`` indexes the chunk's own pairs
    ``(t − start)·K + k``. ``routed_per_expert_E`` counts the chunk's pairs before the cap.
    Returns ``[(token slice, chunk plan), ...]``. No host synchronisation.
    """
    T, K = plan.kept_TK.shape
    num_experts = plan.kept_per_expert_E.numel()
    bounds = [T * c // num_chunks for c in range(num_chunks + 1)]
    chunks = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        expert_P = experts_TK[start:end].reshape(-1)
        kept_P = plan.kept_TK[start:end].reshape(-1)
        order_P, kept_E = _pack(expert_P, kept_P, num_experts)
        routed_E = count_keys(expert_P, num_experts)
        chunks.append((slice(start, end), RoutingPlan(order_P, kept_P.view(end - start, K), kept_E, routed_E)))
    return chunks
