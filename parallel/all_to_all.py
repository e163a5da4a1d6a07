"""Differentiable collectives: variable-split all-to-all and sum all-reduce.

Legend: R rows, D row width (any trailing shape).
"""

import torch
import torch.distributed as dist

from parallel import flight


class AllToAllFn(torch.autograd.Function):
    """``all_to_all_single`` with per-rank row splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        ctx.layer = flight.RECORDER.layer
        flight.record("all_to_all", group)
        return _exchange(x_RD, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        out_splits, in_splits = ctx.splits
        flight.record("all_to_all (backward)", ctx.group, ctx.layer)
        return _exchange(grad_RD, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x_RD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x_RD.new_empty((sum(out_splits),) + tuple(x_RD.shape[1:]))
    dist.all_to_all_single(out, x_RD.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x_RD: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    """Send ``x_RD[rows of chunk j]`` to rank j of ``group``; return the chunks received, by source.

    Args:
        x_RD: (sum(in_splits), ...) rows, chunk j (``in_splits[j]`` rows, possibly 0) goes to
            group rank j.
        out_splits: rows to receive from each group rank (must match what they send).
        in_splits: rows to send to each group rank.
        group: process group (default: the world).

    Returns (sum(out_splits), ...). Differentiable: the gradient travels back with the splits
    swapped. Every rank of the group must call it (and run its backward) in the same order.
    Uses the single-tensor form: gloo's list form fails on uneven sizes, the single form takes
    uneven and zero splits on both gloo and NCCL.
    """
    if len(out_splits) != len(in_splits):
        raise ValueError(f"all_to_all: out_splits has {len(out_splits)} entries, in_splits {len(in_splits)}")
    if x_RD.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all: x_RD has {x_RD.shape[0]} rows but in_splits sum to {sum(in_splits)}")
    return AllToAllFn.apply(x_RD, list(out_splits), list(in_splits), group)


class AllReduceSumFn(torch.autograd.Function):
    """Sum over the group; the backward sums the gradients over the group.

    Why the backward sums: when every rank adds the same reduced value to its loss and the
    data-parallel sync later averages the dense gradients over the W ranks, the gradient that
    reaches rank r's local input is ``(1/W) · Σ_ranks dℓ/d(sum) = dℓ/d(sum)``: exactly the
    one-process gradient of the loss formed from the global sum.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, what: str):
        ctx.group = group
        ctx.what = what
        ctx.layer = flight.RECORDER.layer
        flight.record(what, group)
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flight.record(f"{ctx.what} (backward)", ctx.group, ctx.layer)
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None, None


def all_reduce_sum(x: torch.Tensor, group=None, what: str = "all_reduce_sum") -> torch.Tensor:
    """Differentiable ``all_reduce(SUM)`` (out of place); see :class:`AllReduceSumFn`. ``what``
    names it in the flight recorder (:mod:`parallel.flight`), which reports the collective a
    hung rank waits in."""
    return AllReduceSumFn.apply(x, group, what)
