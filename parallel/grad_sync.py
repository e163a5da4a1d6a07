"""Gradient synchronisation for data × expert parallelism.

Every rank's loss is a mean over its own tokens; the target is the gradient of the mean of the
W ranks' losses, i.e. one process trained on the concatenated batch (equal shards).

- Dense parameters (everything outside a :class:`moe.experts.GroupedExperts`) are replicated on
  all W ranks: sum over the world, divide by W.
- Expert parameters: rank r's shard already holds, through the all-to-all backward, the
  contributions of every token of its EP group. The EDP group holds the other copies of that
  shard, one per EP group, so the sum over the EDP group covers all W ranks' losses: divide by
  W (not by the EDP size).

Tensors are flattened into one buffer per (device, dtype) and bucket, so a model costs a few
all-reduces, not one per parameter. A parameter that requires grad but has none on this rank (a
branch it did not use) gets zeros, so every rank issues the same collectives.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from moe.experts import GroupedExperts
from parallel import flight

# 64 MiB buckets: big enough to reach the link's bandwidth, small enough not to double the
# gradient memory of a large model.
BUCKET_BYTES = 64 << 20


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of every :class:`GroupedExperts` in ``model`` (the expert-parallel shards)."""
    params = []
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            params.extend(module.parameters())
    return params


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def _buckets(grads: list[torch.Tensor]):
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for group in by_kind.values():
        bucket, size = [], 0
        for g in group:
            nbytes = g.numel() * g.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            yield bucket


def all_reduce_mean_(grads: list[torch.Tensor], group, divisor: int) -> None:
    """In place: each gradient becomes its sum over ``group`` divided by ``divisor``."""
    if dist.get_world_size(group) == 1:  # e.g. the EDP group when ep = world: nothing to sum
        if divisor != 1 and grads:  # skipped at one process under torchrun: a pass over every gradient for nothing
            torch._foreach_div_(grads, divisor)
        return
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        flight.record("all_reduce of a gradient bucket", group)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(divisor)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def _by_kind(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """``model``'s parameters as (sharded by FSDP, replicated dense, replicated experts)."""
    expert_ids = {id(p) for p in expert_parameters(model)}
    sharded, dense, experts = [], [], []
    for p in model.parameters():
        if isinstance(p, DTensor):
            sharded.append(p)
        else:
            (experts if id(p) in expert_ids else dense).append(p)
    return sharded, dense, experts


def clip_grad_norm_(model: nn.Module, max_norm: float, dims=None, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """The gradient norm of one process on the global batch, and clipping to ``max_norm``.

    Call after the gradients are reduced (:func:`sync_gradients`, or FSDP's reduce-scatter).
    Three kinds of gradient, each counted once:
    - sharded (a DTensor, under FSDP): every element lives on exactly one rank (FSDP pads with
      zeros), so the local squares are summed over the world;
    - replicated dense: the same on every rank, counted as is;
    - replicated experts: each rank of an expert-parallel group holds different experts, so their
      squares are summed over the EP group (``dims``: a :class:`~parallel.dims.ParallelDims`,
      None for one process).
    Every gradient is scaled by ``max_norm / norm`` when that is below 1 (``max_norm`` 0: no
    clipping). With a fused ``optimizer`` (``fused=True``) the factor is handed to it instead, as
    its ``grad_scale``, which its kernel divides each gradient by as it reads it (and writes the
    result back): the same clipped step without a pass that reads and writes every gradient
    (2.7B fp32 gradients: 8 ms of a 185 ms step on an H100, bench/results/step_profile.md).
    Returns the norm as a device tensor: read it only when logging, so no host sync per step.
    """
    sharded, dense, experts = ([p.grad for p in params if p.grad is not None] for params in _by_kind(model))
    sharded = [g.to_local() for g in sharded]
    device = next(model.parameters()).device

    # accumulated in fp64: fp32 squares overflow past 1.8e19, and a diverging run (optim.lr=1e4,
    # tests/test_faults.py) had every gradient finite but an fp32 norm of inf
    def squared_norm(grads):
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum()

    dense_sq, expert_sq, sharded_sq = squared_norm(dense), squared_norm(experts), squared_norm(sharded)
    if dims is not None and dims.ep > 1 and experts:
        flight.record("all_reduce of the expert gradients' squared norm", dims.ep_group)
        dist.all_reduce(expert_sq, group=dims.ep_group)
    if dims is not None and dims.world_size > 1 and sharded:
        flight.record("all_reduce of the sharded gradients' squared norm", dims.world_group)
        dist.all_reduce(sharded_sq, group=dims.world_group)
    norm = (dense_sq + expert_sq + sharded_sq).sqrt()
    if max_norm > 0:
        factor = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
        if optimizer is None:
            torch._foreach_mul_(dense + experts + sharded, factor)
        elif not all(group.get("fused") for group in optimizer.param_groups):
            raise ValueError("clip_grad_norm_: the optimizer clips by grad_scale only with fused=True")
        else:
            optimizer.grad_scale = 1.0 / factor
    return norm.float()


def sync_gradients(model: nn.Module, dims) -> None:
    """Make ``model``'s gradients those of one process on the concatenated batch.

    Args:
        model: the rank's model after ``backward()``.
        dims: a :class:`~parallel.dims.ParallelDims` with groups built.

    Call once per optimizer step, after the last backward (with gradient accumulation the
    reduction is linear, so one sync of the summed gradients suffices). Dense gradients: world
    sum / W. Expert gradients: EDP-group sum / W. Parameters sharded by FSDP (DTensors) are left
    alone: FSDP has reduce-scattered them during the backward.
    """
    _, dense, experts = _by_kind(model)
    n = dims.world_size
    all_reduce_mean_(_grads(dense), dims.world_group, n)
    all_reduce_mean_(_grads(experts), dims.edp_group, n)
