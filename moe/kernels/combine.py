"""The combine's weighted sum, fused with the un-permute: ``out[t] = Σ_k w[t, k] · y[row of (t, k)]``.

Legend: R expert-output rows, D model dim, T tokens, K experts per token (top-k), P = T·K pairs.

The expert outputs come back in the order the dispatcher packed them (by expert, or by source
rank and expert); ``pair_R[r]`` names the (token, slot) pair of row r. Un-permuting them into
pair order and then summing each token's K weighted rows reads and writes the P rows twice more
than needed (and the PyTorch weighted sum in fp32 materialises two more (P, D) fp32
temporaries). Here the gather-sum family of :mod:`kernel_floor` does it in one pass each way,
with the inverse index ``row_of_pair`` as the locator:

- forward, one program per token: reads its K rows, writes one row;
- backward, one program per token: ``dy[row] = w[p] · dout[t]`` and ``dw[p] = <dout[t], y[row]>``
  (fp32) for each of its pairs p = (t, k): no atomics, deterministic.

A pair with no row (dropped by the capacity, or not sent) contributes zero and gets ``dw = 0``.
:func:`sum_combine` is the same pair of kernels without weights, for rows the experts weighted
already (``moe.LocalDispatcher``'s combine): it keeps no output rows.
:func:`gather_rows`, the local dispatch's packing, is the backward kernel without weights.
``weighted_combine_reference`` is the plain PyTorch version beside it.
"""

import torch
import triton
import triton.language as tl

from kernel_floor import gather_sum, gather_sum_reference, scatter_rows, use_reference


@triton.jit
def _locate_row(pair, live, row_of_pair_ptr, _unused_ptr, _me, R):
    """The pair's row of y (``row_of_pair``; -1: none), one buffer."""
    row = tl.load(row_of_pair_ptr + pair, mask=live, other=-1)
    has = live & (row >= 0) & (row < R)
    return has, has, row, row


@triton.jit
def _to_row(pair, live, row_of_pair_ptr, _unused_ptr, _me, R):
    """The pair's gradient row of y, buffer 0 (-1: the pair has no row)."""
    has, _, row, _ = _locate_row(pair, live, row_of_pair_ptr, _unused_ptr, _me, R)
    return tl.where(has, 0, -1), row


def _check_rows(y_RD: torch.Tensor, pair_R: torch.Tensor, num_pairs: int) -> None:
    if y_RD.dim() != 2:
        raise ValueError(f"y_RD must be 2-D (R, D), got shape {tuple(y_RD.shape)}")
    if pair_R.dim() != 1 or pair_R.shape[0] != y_RD.shape[0] or pair_R.dtype != torch.int64:
        raise ValueError(f"pair_R must be int64 of shape ({y_RD.shape[0]},), got {pair_R.dtype} {tuple(pair_R.shape)}")
    if y_RD.shape[0] > num_pairs:
        raise ValueError(f"y_RD has {y_RD.shape[0]} rows, more than the T·K = {num_pairs} pairs")
    if y_RD.device != pair_R.device:
        raise ValueError(f"y_RD and pair_R on different devices: {y_RD.device}, {pair_R.device}")


def _check(y_RD: torch.Tensor, pair_R: torch.Tensor, w_TK: torch.Tensor) -> None:
    if w_TK.dim() != 2 or w_TK.dtype != torch.float32:
        raise ValueError(f"w_TK must be a 2-D (T, K) fp32 tensor, got {w_TK.dtype} {tuple(w_TK.shape)}")
    if w_TK.device != y_RD.device:
        raise ValueError(f"y_RD and w_TK on different devices: {y_RD.device}, {w_TK.device}")
    _check_rows(y_RD, pair_R, w_TK.numel())


def row_of_pair(pair_R: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """(P,) int64 inverse of ``pair_R`` (R,): the row of each pair, -1 for pairs without one."""
    rows_P = torch.full((num_pairs,), -1, dtype=torch.int64, device=pair_R.device)
    return rows_P.index_copy_(0, pair_R, torch.arange(pair_R.shape[0], device=pair_R.device))


class WeightedCombineFn(torch.autograd.Function):
    """Triton forward and backward of :func:`weighted_combine`."""

    @staticmethod
    def forward(ctx, y_RD, pair_R, w_TK, out_dtype):
        T, K = w_TK.shape
        R, D = y_RD.shape
        y_RD = y_RD.contiguous()
        w_TK = w_TK.contiguous()
        row_of_pair_P = row_of_pair(pair_R, T * K)
        out_TD = gather_sum(T, D, _locate_row, row_of_pair_P, None, 0, R, y_RD, w_TK=w_TK, out_dtype=out_dtype, K=K)
        ctx.save_for_backward(y_RD, row_of_pair_P, w_TK)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        y_RD, row_of_pair_P, w_TK = ctx.saved_tensors
        K = w_TK.shape[1]
        R = y_RD.shape[0]
        dout_TD = dout_TD.contiguous()
        dy_RD = torch.empty_like(y_RD)
        dw_TK = torch.empty_like(w_TK)  # every entry written: the pair's dot, or 0 without a row
        scatter_rows(dout_TD, _to_row, _locate_row, row_of_pair_P, None, 0, R, dy_RD, dy_RD.dtype,
                     dy_RD.stride(0), K=K, w_TK=w_TK, ya_MD=y_RD, dw_TK=dw_TK, zero_dropped=True)
        return dy_RD, None, dw_TK, None


class SumCombineFn(torch.autograd.Function):
    """Triton forward and backward of :func:`sum_combine`: the weighted combine's kernels without
    weights, so nothing but the row locator is kept (no output rows: there is no weight gradient)."""

    @staticmethod
    def forward(ctx, y_RD, pair_R, num_tokens, top_k, out_dtype):
        R, D = y_RD.shape
        row_of_pair_P = row_of_pair(pair_R, num_tokens * top_k)
        out_TD = gather_sum(num_tokens, D, _locate_row, row_of_pair_P, None, 0, R, y_RD.contiguous(),
                            out_dtype=out_dtype, K=top_k)
        ctx.save_for_backward(row_of_pair_P)
        ctx.rows = (R, D, y_RD.dtype)
        ctx.top_k = top_k
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        (row_of_pair_P,) = ctx.saved_tensors
        R, D, dtype = ctx.rows
        dy_RD = dout_TD.new_empty((R, D), dtype=dtype)
        scatter_rows(dout_TD.contiguous(), _to_row, _locate_row, row_of_pair_P, None, 0, R, dy_RD, dtype,
                     dy_RD.stride(0), K=ctx.top_k)
        return dy_RD, None, None, None, None


def gather_rows(x_TD: torch.Tensor, order_P: torch.Tensor, top_k: int, row_dtype: torch.dtype,
                backend: str = "auto") -> torch.Tensor:
    """The dispatch's packing: ``rows[r] = x[order_P[r] // top_k]`` in ``row_dtype`` (P, D), not
    differentiable (the dispatcher's autograd node sums the gradient back with the combine).

    It lives here because it is the combine backward's scatter kernel without weights: one
    program per token reads its row once and writes its K copies (cast on the store). PyTorch's
    ``index_select`` reads a source row per output row: measured on an H100 (OLMoE layer, T 16k,
    K 8, D 2048, bf16), 0.22 ms here against 0.35 ms. ``order_P`` must hold each of the T·K
    pair ids once (the local dispatcher's plan does: dropped pairs are packed last); a row named
    by no pair would stay uninitialised, where ``index_select`` needed only valid ids.

    Why pack at all rather than gather inside the first grouped GEMM's A-load: Hopper's TMA loads
    boxes, not lists of rows, so a gathered A tile means pointer loads (cp.async). Measured on an
    H100 (OLMoE shape, 2026-11-24, bit-identical outputs): the TMA GEMM with pointer-gathered A
    took 1.93-2.18 ms against 1.70-1.75 ms on packed rows plus 0.24 ms here; the weight gradient
    with gathered rows 2.08 ms against 1.93 (with the row indices prefetched a chunk ahead;
    2.90 without). Inside Triton 3.6's flattened persistent loop a pointer A-load is not
    pipelined at all (sm_90 PTX: ld.global then st.shared, no cp.async; 3.26 ms).
    """
    T, D = x_TD.shape
    if use_reference(backend, not x_TD.is_cuda):
        # cast the T tokens, then gather the P = T·K rows: the cast touches K times fewer rows
        return x_TD.to(row_dtype).index_select(0, order_P // top_k)
    rows_PD = x_TD.new_empty((order_P.shape[0], D), dtype=row_dtype)
    row_of_pair_P = row_of_pair(order_P, T * top_k)
    scatter_rows(x_TD.contiguous(), _to_row, _locate_row, row_of_pair_P, None, 0, rows_PD.shape[0], rows_PD,
                 row_dtype, rows_PD.stride(0), K=top_k)
    return rows_PD


def _located(pair_R: torch.Tensor, T: int, K: int):
    """The PyTorch locator's output for one buffer: (has, has, row, row), each (T, K)."""
    row_TK = row_of_pair(pair_R, T * K).view(T, K)
    has_TK = row_TK >= 0
    return has_TK, has_TK, row_TK, row_TK


def weighted_combine_reference(y_RD: torch.Tensor, pair_R: torch.Tensor, w_TK: torch.Tensor,
                               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """PyTorch version: each pair's row (zeros for pairs without one), then the weighted sum over
    the K slots in fp32 (:func:`kernel_floor.gather_sum_reference`)."""
    return gather_sum_reference(_located(pair_R, *w_TK.shape), y_RD, None, w_TK, out_dtype)


def weighted_combine(y_RD: torch.Tensor, pair_R: torch.Tensor, w_TK: torch.Tensor,
                     out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """``out[t] = Σ_k w[t, k] · y[r]`` over the rows r with ``pair_R[r] = t·K + k``, in fp32.

    Args:
        y_RD: (R, D) expert outputs, bf16/fp16/fp32, any row order.
        pair_R: (R,) int64 distinct pair indices in ``[0, T·K)``: the (token, slot) of each row.
            Pairs named by no row contribute zero.
        w_TK: (T, K) fp32 combine weights (differentiable).
        out_dtype: of the result (default y's dtype).
        backend: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"triton"`` (on CPU only
            under ``TRITON_INTERPRET=1``) or ``"reference"``.

    Returns:
        out_TD: (T, D) in ``out_dtype``. Gradients flow to ``y_RD`` and ``w_TK``.
    """
    reference = use_reference(backend, not y_RD.is_cuda)
    _check(y_RD, pair_R, w_TK)
    if reference:
        return weighted_combine_reference(y_RD, pair_R, w_TK, out_dtype)
    return WeightedCombineFn.apply(y_RD, pair_R, w_TK, out_dtype or y_RD.dtype)


def sum_combine(y_RD: torch.Tensor, pair_R: torch.Tensor, num_tokens: int, top_k: int,
                out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """``out[t] = Σ_k y[r]`` over the rows r with ``pair_R[r] = t·K + k``, in fp32: the combine for
    rows that come weighted already (``moe.kernels.grouped_mlp``'s ``w_R``).

    Args as :func:`weighted_combine`, with the (T, K) shape given as ``num_tokens``, ``top_k``;
    ``pair_R`` must be distinct (as there): the backward writes each row's gradient ``dout[t]``
    through the inverse index, so a row whose pair another row also names would be left
    unwritten. Differentiable in ``y_RD``.
    """
    _check_rows(y_RD, pair_R, num_tokens * top_k)
    if use_reference(backend, not y_RD.is_cuda):
        return gather_sum_reference(_located(pair_R, num_tokens, top_k), y_RD, None, None, out_dtype)
    return SumCombineFn.apply(y_RD, pair_R, num_tokens, top_k, out_dtype or y_RD.dtype)
