"""Per-layer routing statistics, returned as data (tensors; no host sync until logged).

Legend: E experts.
"""

from dataclasses import dataclass, field
from functools import cached_property

import torch

from moe.kernels.router_topk import token_entropy
from moe.losses import token_mean


@dataclass(frozen=True)
class MoEStats:
    """One forward's routing health.

    routed_per_expert: (E,) pairs routed to each expert before the cap.
    tokens_per_expert: (E,) pairs each expert kept (and computed).
    capacity: C per expert and rank, or None (dropless).
    block_m: the grouped GEMM's row tile.
    router_entropy: () mean over tokens of the entropy of the normalised router scores (nats).

    Derived on first read (each a few small kernels; a layer's forward launches none of them, so
    the micro-batches of a step whose stats nobody reads pay nothing: at 16 layers and 8
    micro-batches a step they were ~17 launches a layer forward, ~2,200 a step, on hosts that the
    2×H200 profiles showed launch-bound, bench/results/step_profile.md; no step gain measured):

    dropped_pairs: () pairs dropped by the capacity; they contribute zero, the residual carries them.
    dropped_fraction: () dropped / routed.
    max_load, mean_load: () kept pairs of the busiest expert and of the mean one; the busiest is
        the straggler every rank waits for. load_imbalance = max / mean.
    tiles_per_expert: (E,) row tiles run per expert: ``ceil(kept / block_m)`` (an expert's rows
        are one segment, from every source rank together under expert parallelism).
    padded_slots_per_expert: (E,) ``tiles · block_m − kept``: rows of work the GEMM wastes.
    tile_utilization: () ``Σ kept / Σ tiles · block_m`` (1.0 when every tile is full).
    """

    routed_per_expert: torch.Tensor
    tokens_per_expert: torch.Tensor
    capacity: int | None
    block_m: int
    router_entropy: torch.Tensor  # computed in the forward: the scores it reads are (T, E), not kept
    given_tiles_E: torch.Tensor | None = field(default=None, repr=False)  # else from the kept counts

    # every stat, counts and derived, in one order (what the tests compare, what world sums rebuild)
    NAMES = ("routed_per_expert", "tokens_per_expert", "dropped_pairs", "dropped_fraction", "capacity", "max_load",
             "mean_load", "load_imbalance", "router_entropy", "block_m", "tiles_per_expert",
             "padded_slots_per_expert", "tile_utilization")

    @cached_property
    def dropped_pairs(self) -> torch.Tensor:
        return self.routed_per_expert.sum() - self.tokens_per_expert.sum()

    @cached_property
    def dropped_fraction(self) -> torch.Tensor:
        return self.dropped_pairs.float() / self.routed_per_expert.sum().clamp_min(1).float()

    @cached_property
    def max_load(self) -> torch.Tensor:
        return self.tokens_per_expert.float().max()

    @cached_property
    def mean_load(self) -> torch.Tensor:
        return self.tokens_per_expert.float().mean()

    @cached_property
    def load_imbalance(self) -> torch.Tensor:
        return self.max_load / self.mean_load.clamp_min(1e-20)

    @cached_property
    def tiles_per_expert(self) -> torch.Tensor:
        if self.given_tiles_E is not None:
            return self.given_tiles_E
        return (self.tokens_per_expert + self.block_m - 1) // self.block_m

    @cached_property
    def padded_slots_per_expert(self) -> torch.Tensor:
        return self.tiles_per_expert * self.block_m - self.tokens_per_expert

    @cached_property
    def tile_utilization(self) -> torch.Tensor:
        tile_rows = (self.tiles_per_expert.sum() * self.block_m).float()
        kept = self.tokens_per_expert.sum().float()
        return torch.where(tile_rows > 0, kept / tile_rows.clamp_min(1), torch.ones_like(tile_rows))

    def scalars(self) -> dict[str, float]:
        """The scalar stats as Python floats, for logging (one host sync)."""
        names = ("dropped_pairs", "dropped_fraction", "max_load", "mean_load", "load_imbalance", "router_entropy", "tile_utilization")
        values = torch.stack([getattr(self, n).detach().float().cpu() for n in names]).tolist()
        out = dict(zip(names, values))
        out["capacity"] = float("nan") if self.capacity is None else float(self.capacity)
        return out


def compute_stats(
    routed_E: torch.Tensor,
    kept_E: torch.Tensor,
    scores_TE: torch.Tensor | None,
    capacity: int | None,
    block_m: int,
    tiles_E: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> MoEStats:
    """Stats from per-expert counts (already summed over the ranks the user wants to see), the
    derived ones computed when first read.

    ``tiles_E``: (E,) row tiles the grouped GEMM ran per expert, default ``ceil(kept / block_m)``
    (an expert's rows are one segment, with expert parallelism too: the dispatchers hand them over
    expert-major); ``entropy``: the router entropy, default from ``scores_TE`` (T, E), computed
    here (a derived stat that kept the scores would keep T·E floats a layer until its next
    forward); the world sums of :mod:`parallel.stats` pass both, the MoE layer the mean of the
    router's per-token entropy (its kernel computes it with the scores)."""
    if entropy is None:
        entropy = token_mean(token_entropy(scores_TE))
    return MoEStats(
        routed_per_expert=routed_E.detach(), tokens_per_expert=kept_E.detach(), capacity=capacity, block_m=block_m,
        router_entropy=entropy, given_tiles_E=None if tiles_E is None else tiles_E.detach(),
    )
