"""Row gathers and scatters for the dispatcher, with cheap, deterministic backward passes.

Legend: N rows in, M rows out, D row width, T tokens, K slots per token, P = T·K pairs.

- The copies move rows as 16-byte (or 8-byte) elements: ``index_select`` / ``index_copy_`` run
  one thread per element, so viewing a bf16 row of D values as D/8 complex128 values makes each
  thread move 16 bytes instead of 2 (the bytes are only copied, never interpreted).
- When the index is a permutation every gradient row is written exactly once, so the backward is
  a plain copy into an empty buffer: no zero fill, no atomics (``torch.index_select``'s own
  backward zero-fills and scatter-adds).
- The token gather's backward sums each token's K pair gradients with ``sum(dim=1)`` over the
  pair-ordered gradient (fp32 accumulation, deterministic) instead of ``index_add_`` (atomics).
"""

import torch


def _wide(t_ND: torch.Tensor) -> torch.Tensor:
    """The same bytes as (N, D·itemsize / w) elements of the widest w in (16, 8) bytes that
    divides a row and the address; ``t`` itself when no such view exists."""
    if t_ND.dim() != 2 or t_ND.numel() == 0 or not t_ND.is_contiguous():
        return t_ND
    row_bytes = t_ND.shape[1] * t_ND.element_size()
    for wide, width in ((torch.complex128, 16), (torch.int64, 8)):
        if t_ND.element_size() < width and row_bytes % width == 0 and t_ND.data_ptr() % width == 0:
            return t_ND.view(wide)
    return t_ND


def _select(x_ND: torch.Tensor, idx_M: torch.Tensor) -> torch.Tensor:
    return _wide(x_ND.contiguous()).index_select(0, idx_M).view(x_ND.dtype)


def _scatter(y_ND: torch.Tensor, idx_N: torch.Tensor, num_rows: int, fill_idx: torch.Tensor | None) -> torch.Tensor:
    y_ND = y_ND.contiguous()
    out_MD = y_ND.new_empty((num_rows,) + tuple(y_ND.shape[1:]))
    out_wide, y_wide = _wide(out_MD), _wide(y_ND)
    if out_wide.dtype != y_wide.dtype:  # alignment differs: copy element by element
        out_wide, y_wide = out_MD, y_ND
    out_wide.index_copy_(0, idx_N, y_wide)
    if fill_idx is not None and fill_idx.numel():
        out_MD.index_fill_(0, fill_idx, 0)
    return out_MD


class GatherPermutationFn(torch.autograd.Function):
    """``out[j] = x[idx[j]]`` where ``idx`` is a permutation of ``range(N)``."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, idx_N: torch.Tensor):
        ctx.save_for_backward(idx_N)
        return _select(x_ND, idx_N)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        (idx_N,) = ctx.saved_tensors
        return _scatter(grad_ND, idx_N, grad_ND.shape[0], None), None


class ScatterRowsFn(torch.autograd.Function):
    """``out[idx[j]] = y[j]``, ``out[fill_idx] = 0``; ``idx`` and ``fill_idx`` together cover
    every one of the M output rows exactly once."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, idx_N: torch.Tensor, fill_idx: torch.Tensor, num_rows: int):
        ctx.save_for_backward(idx_N)
        return _scatter(y_ND, idx_N, num_rows, fill_idx)

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor):
        (idx_N,) = ctx.saved_tensors
        return _select(grad_MD, idx_N), None, None, None


class GatherPairsFn(torch.autograd.Function):
    """``rows[j] = x[order[j] // K]``: each (token, slot) pair's token row, in ``order``, a
    permutation of the P = T·K pairs."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order_P: torch.Tensor, top_k: int):
        ctx.save_for_backward(order_P)
        ctx.top_k = top_k
        ctx.num_tokens = x_TD.shape[0]
        return _select(x_TD, order_P // top_k)

    @staticmethod
    def backward(ctx, grad_PD: torch.Tensor):
        (order_P,) = ctx.saved_tensors
        by_pair_PD = _scatter(grad_PD, order_P, grad_PD.shape[0], None)
        grad_TD = by_pair_PD.view(ctx.num_tokens, ctx.top_k, *grad_PD.shape[1:]).sum(dim=1)
        return grad_TD, None, None


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


def gather_pairs(x_TD: torch.Tensor, order_P: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T, D), order (T·K,) int64 permutation of the pairs -> (T·K, D) token rows in that order."""
    if order_P.numel() != x_TD.shape[0] * top_k:
        raise ValueError(f"gather_pairs: order has {order_P.numel()} entries, expected T·K = {x_TD.shape[0] * top_k}")
    return GatherPairsFn.apply(x_TD, order_P, top_k)
