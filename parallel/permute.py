"""Row permutations with cheap backward passes (no zero fill, no atomics).

Legend: N rows in, M rows out, D row width.

``torch.index_select``'s backward zero-fills and scatter-adds (atomics on CUDA); when the index
is a permutation every gradient row is written exactly once, so a plain ``index_copy_`` into an
empty buffer is enough, and the inverse holds for the scatter.
"""

import torch


class GatherPermutationFn(torch.autograd.Function):
    """``out[j] = x[idx[j]]`` where ``idx`` is a permutation of ``range(N)``."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, idx_N: torch.Tensor):
        ctx.save_for_backward(idx_N)
        return x_ND.index_select(0, idx_N)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        (idx_N,) = ctx.saved_tensors
        return torch.empty_like(grad_ND).index_copy_(0, idx_N, grad_ND), None


class ScatterRowsFn(torch.autograd.Function):
    """``out[idx[j]] = y[j]``, ``out[fill_idx] = 0``; ``idx`` and ``fill_idx`` together cover
    every one of the M output rows exactly once."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, idx_N: torch.Tensor, fill_idx: torch.Tensor, num_rows: int):
        ctx.save_for_backward(idx_N)
        out_MD = y_ND.new_empty((num_rows,) + tuple(y_ND.shape[1:])).index_copy_(0, idx_N, y_ND)
        if fill_idx.numel():
            out_MD.index_fill_(0, fill_idx, 0)
        return out_MD

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor):
        (idx_N,) = ctx.saved_tensors
        return grad_MD.index_select(0, idx_N), None, None, None


def gather_permutation(x_ND: torch.Tensor, idx_N: torch.Tensor) -> torch.Tensor:
    """(N, D), idx (N,) int64 permutation -> (N, D) ``x[idx]``."""
    return GatherPermutationFn.apply(x_ND, idx_N)


def scatter_rows(y_ND: torch.Tensor, idx_N: torch.Tensor, num_rows: int, fill_idx: torch.Tensor | None = None) -> torch.Tensor:
    """(N, D) -> (num_rows, D) with row ``idx[j]`` = ``y[j]`` and rows ``fill_idx`` zero.

    ``idx`` (N,) and ``fill_idx`` (M - N,) int64 must partition ``range(num_rows)``.
    """
    if fill_idx is None:
        fill_idx = idx_N.new_empty(0)
    if idx_N.numel() + fill_idx.numel() != num_rows:
        raise ValueError(f"scatter_rows: {idx_N.numel()} + {fill_idx.numel()} indices do not cover {num_rows} rows")
    return ScatterRowsFn.apply(y_ND, idx_N, fill_idx, num_rows)
