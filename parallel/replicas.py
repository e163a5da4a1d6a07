"""Check that the parameters that should be the same on several ranks are.

Nothing broadcasts a model's initial weights: each rank builds its own copy, and the dense
parameters are replicas only if every rank drew them from the same seed (and an expert shard's
copies in its expert-data-parallel group likewise). :func:`sync_gradients` keeps replicas equal
once they are, never makes them so. :func:`check_replicas_agree` compares them through a small
fingerprint per tensor, all-gathered: a few numbers per parameter, not the parameters.
"""

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import flight
from parallel.grad_sync import _by_kind

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per step of the fingerprint: bounds its int64 temporaries to 32 MiB
_FIELDS = 6  # numel, Σ bits, Σ bits², Σ (i+1)·bits (all int64, wrapping), fp64 Σ x, fp64 Σ x² (as int64 bits)

_HINT = ("call torch.manual_seed(<same seed>) on every rank before building the model "
         "(or parallel.init_distributed(seed=...)); after training steps, every rank must run "
         "sync_gradients and the same optimizer step")


def _fingerprint(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(6,) int64 on ``device``: the element count; three wrapping int64 sums of the elements' bit
    patterns (plain, squared, weighted by position): exact and independent of the summation
    order, so equal tensors give equal numbers on any thread count, and a changed bit or two
    swapped elements change them; then the fp64 sum and sum of squares (bit-cast, for the message
    and for ``rtol`` > 0)."""
    x = p.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1)
    ints = torch.zeros(3, dtype=torch.int64, device=x.device)
    floats = torch.zeros(2, dtype=torch.float64, device=x.device)
    bits = x.view(_BITS[x.element_size()]) if x.is_floating_point() else x
    for start in range(0, x.numel(), _CHUNK):
        b = bits[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + b.numel(), dtype=torch.int64, device=b.device)
        ints += torch.stack([b.sum(), (b * b).sum(), (b * pos).sum()])
        f = x[start:start + _CHUNK].to(torch.float64)
        floats += torch.stack([f.sum(), (f * f).sum()])
    numel = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    return torch.cat([numel, ints, floats.view(torch.int64)]).to(device)


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(t: torch.Tensor, group, what: str) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    flight.record(what, group)
    dist.all_gather(parts, t, group=group)
    return [part.cpu() for part in parts]


@torch.no_grad()
def check_replicas_agree(model: nn.Module, dims, *, rtol: float = 0.0) -> int:
    """Raise unless every replicated parameter of ``model`` is the same on all its ranks.

    Args:
        model: this rank's model (call on every rank: the check is a collective).
        dims: the :class:`~parallel.ParallelDims` with its mesh built.
        rtol: 0 (default): bitwise equal, which replicas are when they start from one seed and
            take the same synchronised steps; > 0: fp64 sums and sums of squares equal within
            ``rtol``.

    What must agree, classified as :func:`~parallel.sync_gradients` does: dense parameters
    (everything outside a :class:`moe.GroupedExperts`, routers included) over the whole world;
    expert parameters over their expert-data-parallel group (the ranks that hold the same experts,
    ``dims.edp_ranks``; none when ``ep`` = world). Parameters sharded by FSDP (DTensors) hold
    different pieces on every rank and are skipped; buffers are not compared.

    Costs two small all-gathers over the world (a header, then six int64 per parameter) and one
    pass over the parameters. Every rank reaches the same verdict: on a mismatch all raise one
    ``ValueError`` naming the first differing parameter (in ``model.named_parameters()`` order)
    and two ranks, e.g. ``blocks.0.moe.router.weight differs between rank 0 and rank 1 ...``.
    Returns the number of (parameter, rank) fingerprints compared with a replica's; 0 on one
    process.
    """
    if rtol < 0:
        raise ValueError(f"check_replicas_agree: rtol must be >= 0, got {rtol}")
    if dims.world_size == 1:
        return 0
    group = dims.world_group
    ranks = dist.get_process_group_ranks(group)
    _, dense, experts = _by_kind(model)
    kinds = {id(p): "dense" for p in dense} | {id(p): "experts" for p in experts}
    entries = [(name, p, kinds[id(p)]) for name, p in model.named_parameters() if id(p) in kinds]
    device = _comm_device(group)

    # the same model on every rank (names, shapes, dtypes, kinds) before comparing values
    layout = "\n".join(f"{name} {tuple(p.shape)} {p.dtype} {kind}" for name, p, kind in entries)
    header = torch.tensor([len(entries), zlib.crc32(layout.encode())], dtype=torch.int64, device=device)
    headers = _all_gather(header, group, "all_gather of the parameter layout (check_replicas_agree)")
    for i, h in enumerate(headers[1:], 1):
        if not torch.equal(h, headers[0]):
            raise ValueError(
                f"check_replicas_agree: rank {ranks[0]} and rank {ranks[i]} built different models "
                f"({int(headers[0][0])} vs {int(h[0])} replicated parameters, or other names, shapes, dtypes): "
                f"build the same model on every rank"
            )
    if not entries:
        return 0

    local = torch.stack([_fingerprint(p, device) for _, p, _ in entries])
    prints = _all_gather(local, group, "all_gather of the parameter fingerprints (check_replicas_agree)")
    pos = {r: i for i, r in enumerate(ranks)}
    world_pairs = [(ranks[0], r) for r in ranks[1:]]
    edp_pairs = []
    for q in range(dims.ep):
        members = dims.edp_ranks(q)
        edp_pairs += [(members[0], r) for r in members[1:]]

    compared = 0
    for i, (name, _, kind) in enumerate(entries):
        for a, b in (world_pairs if kind == "dense" else edp_pairs):
            fa, fb = prints[pos[a]][i], prints[pos[b]][i]
            sums_a, sums_b = fa[4:].view(torch.float64), fb[4:].view(torch.float64)
            if rtol == 0:
                same = torch.equal(fa[:4], fb[:4])
            else:
                same = bool(torch.isclose(sums_a, sums_b, rtol=rtol, atol=0.0, equal_nan=True).all())
            compared += 1
            if not same:
                which = "" if kind == "dense" else " (they hold the same experts: their expert-data-parallel group)"
                raise ValueError(
                    f"{name} differs between rank {a} and rank {b}{which}, fp64 sum {sums_a[0].item():.9g} vs "
                    f"{sums_b[0].item():.9g}: {_HINT}"
                )
    return compared
