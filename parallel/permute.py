"""The dispatcher's row gather (token rows in send order), with a cheap, deterministic backward.

Legend: N rows in, M rows out, D row width, T tokens, K slots per token, P = T·K pairs.

- The copies move rows as 16-byte (or 8-byte) elements: ``index_select`` / ``index_copy_`` run
  one thread per element, so viewing a bf16 row of D values as D/8 complex128 values makes each
  thread move 16 bytes instead of 2 (the bytes are only copied, never interpreted).
- The pair order is a permutation, so every pair-ordered gradient row is written exactly once:
  a plain copy into an empty buffer, no zero fill, no atomics (``torch.index_select``'s own
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


def _scatter(y_ND: torch.Tensor, idx_N: torch.Tensor, num_rows: int) -> torch.Tensor:
    y_ND = y_ND.contiguous()
    out_MD = y_ND.new_empty((num_rows,) + tuple(y_ND.shape[1:]))
    out_wide, y_wide = _wide(out_MD), _wide(y_ND)
    if out_wide.dtype != y_wide.dtype:  # alignment differs: copy element by element
        out_wide, y_wide = out_MD, y_ND
    out_wide.index_copy_(0, idx_N, y_wide)
    return out_MD


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
        by_pair_PD = _scatter(grad_PD, order_P, grad_PD.shape[0])
        grad_TD = by_pair_PD.view(ctx.num_tokens, ctx.top_k, *grad_PD.shape[1:]).sum(dim=1)
        return grad_TD, None, None


def gather_pairs(x_TD: torch.Tensor, order_P: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T, D), order (T·K,) int64 permutation of the pairs -> (T·K, D) token rows in that order."""
    if order_P.numel() != x_TD.shape[0] * top_k:
        raise ValueError(f"gather_pairs: order has {order_P.numel()} entries, expected T·K = {x_TD.shape[0] * top_k}")
    return GatherPairsFn.apply(x_TD, order_P, top_k)
