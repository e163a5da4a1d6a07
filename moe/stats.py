"""Per-layer routing statistics, returned as data (tensors; no host sync until logged).

Legend: E experts.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEStats:
    """One forward's routing health.

    routed_per_expert: (E,) pairs routed to each expert before the cap.
    tokens_per_expert: (E,) pairs each expert kept (and computed).
    dropped_pairs: () pairs dropped by the capacity; they contribute zero, the residual carries them.
    dropped_fraction: () dropped / routed.
    capacity: C per expert and rank, or None (dropless).
    max_load, mean_load: () kept pairs of the busiest expert and of the mean one; the busiest is
        the straggler every rank waits for. load_imbalance = max / mean.
    router_entropy: () mean over tokens of the entropy of the normalised router scores (nats).
    block_m: the grouped GEMM's row tile.
    tiles_per_expert: (E,) row tiles run per expert: ``ceil(kept / block_m)`` (an expert's rows
        are one segment, from every source rank together under expert parallelism).
    padded_slots_per_expert: (E,) ``tiles · block_m − kept``: rows of work the GEMM wastes.
    tile_utilization: () ``Σ kept / Σ tiles · block_m`` (1.0 when every tile is full).
    """

    routed_per_expert: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped_pairs: torch.Tensor
    dropped_fraction: torch.Tensor
    capacity: int | None
    max_load: torch.Tensor
    mean_load: torch.Tensor
    load_imbalance: torch.Tensor
    router_entropy: torch.Tensor
    block_m: int
    tiles_per_expert: torch.Tensor
    padded_slots_per_expert: torch.Tensor
    tile_utilization: torch.Tensor

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
    scores_TE: torch.Tensor,
    capacity: int | None,
    block_m: int,
    tiles_E: torch.Tensor | None = None,
) -> MoEStats:
    """Stats from per-expert counts (already summed over the ranks the user wants to see).

    ``tiles_E``: (E,) row tiles the grouped GEMM ran per expert, default ``ceil(kept / block_m)``
    (an expert's rows are one segment, with expert parallelism too: the dispatchers hand them over
    expert-major); the world sums of :mod:`parallel.stats` pass the sum over replicas."""
    routed_E = routed_E.detach()
    kept_E = kept_E.detach()
    routed = routed_E.sum()
    kept = kept_E.sum()
    dropped = routed - kept
    kept_f = kept_E.float()
    mean_load = kept_f.mean()
    max_load = kept_f.max()
    with torch.no_grad():
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)
        entropy_T = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1)
        entropy = entropy_T.mean() if entropy_T.numel() else entropy_T.sum()
    tiles_E = (kept_E + block_m - 1) // block_m if tiles_E is None else tiles_E.detach()
    padded_E = tiles_E * block_m - kept_E
    tile_rows = (tiles_E.sum() * block_m).float()
    return MoEStats(
        routed_per_expert=routed_E,
        tokens_per_expert=kept_E,
        dropped_pairs=dropped,
        dropped_fraction=dropped.float() / routed.clamp_min(1).float(),
        capacity=capacity,
        max_load=max_load,
        mean_load=mean_load,
        load_imbalance=max_load / mean_load.clamp_min(1e-20),
        router_entropy=entropy,
        block_m=block_m,
        tiles_per_expert=tiles_E,
        padded_slots_per_expert=padded_E,
        tile_utilization=torch.where(tile_rows > 0, kept.float() / tile_rows.clamp_min(1), torch.ones_like(tile_rows)),
    )
