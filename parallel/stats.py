"""World-level view of the MoE stats, and the expert-bias update that needs it.

Legend: E experts.

Inside the layer, :meth:`ExpertParallelDispatcher.reduce_aux_and_counts` sums the per-expert
counts over the expert-parallel group only (the rows that group's GEMMs process). With DP × EP
(edp > 1) each EP group sees only its share of the batch, so:

- the user's global view (tokens per expert, dropped fraction of the whole batch) needs a sum
  over the world (done here in one all-reduce for all layers);
- the aux-loss-free expert-bias rule MUST use that world count: the bias is replicated on every
  rank, and EP groups applying different updates would let the replicas drift apart.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from moe.layer import moe_layers
from moe.stats import MoEStats, compute_stats
from parallel import flight


def _world_counts(model: nn.Module, dims) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per layer: world routed (E,), kept (E,) and GEMM row tiles (E,), mean router entropy ().
    One all-reduce."""
    layers = {name: m for name, m in moe_layers(model).items() if m.last_aux is not None}
    if not layers or dims.world_size == 1:
        return {name: (m.last_aux.stats.routed_per_expert, m.last_aux.stats.tokens_per_expert,
                       m.last_aux.stats.tiles_per_expert, m.last_aux.stats.router_entropy)
                for name, m in layers.items()}
    # [routed | kept | tiles | entropy] per layer in fp64 (exact counts), summed over the world.
    # The counts are already EP-group sums, identical on the ep ranks of a group: the world sum
    # counts each ep times. The entropy is a per-rank mean.
    parts = []
    for m in layers.values():
        s = m.last_aux.stats
        parts += [s.routed_per_expert.double(), s.tokens_per_expert.double(), s.tiles_per_expert.double(),
                  s.router_entropy.double().reshape(1)]
    flat = torch.cat(parts)
    flight.record("all_reduce of the MoE stats", dims.world_group)
    dist.all_reduce(flat, group=dims.world_group)
    out, start = {}, 0
    for name, m in layers.items():
        e = m.last_aux.stats.routed_per_expert.numel()
        counts = [(flat[start + i * e:start + (i + 1) * e] / dims.ep).round().long() for i in range(3)]
        out[name] = (*counts, flat[start + 3 * e] / dims.world_size)
        start += 3 * e + 1
    return out


def global_moe_stats(model: nn.Module, dims) -> dict[str, MoEStats]:
    """Each MoE layer's latest stats over the whole world (collective on every rank).

    Counts (routed, kept, dropped, loads, tiles) are world sums; the router entropy is the mean of
    the per-rank means (equal shards make it the global mean). ``capacity`` stays per rank.
    """
    out = {}
    layers = moe_layers(model)
    for name, (routed_E, kept_E, tiles_E, entropy) in _world_counts(model, dims).items():
        s = layers[name].last_aux.stats
        out[name] = compute_stats(routed_E, kept_E, None, s.capacity, s.block_m, tiles_E,
                                  entropy.to(s.router_entropy.dtype))
    return out


def update_expert_biases_global(model: nn.Module, dims) -> None:
    """The aux-loss-free bias rule of every ``expert_bias=True`` layer, from world counts, so all
    replicas apply the same update (collective on every rank; the DP × EP counterpart of
    :func:`moe.update_expert_biases`)."""
    counts = _world_counts(model, dims)
    for name, m in moe_layers(model).items():
        if m.router.expert_bias is not None and name in counts:
            m.router.update_expert_bias(counts[name][0])
