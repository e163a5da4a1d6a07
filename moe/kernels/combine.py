"""The combine's weighted sum, fused with the un-permute: ``out[t] = Σ_k w[t, k] · y[row of (t, k)]``.

Legend: R expert-output rows, D model dim, T tokens, K slots per token, P = T·K pairs.

The expert outputs come back in the order the dispatcher packed them (by expert, or by source
rank and expert); ``pair_R[r]`` names the (token, slot) pair of row r. Un-permuting them into
pair order and then summing each token's K weighted rows reads and writes the P rows twice more
than needed (and the PyTorch weighted sum in fp32 materialises two more (P, D) fp32
temporaries). Here one Triton pass gathers each token's K rows by the inverse index and sums
them in fp32:

- forward, one program per token: reads its K rows, writes one row;
- backward, one program per row r of y: ``dy[r] = w[p] · dout[t]`` and
  ``dw[p] = <dout[t], y[r]>`` (fp32) for its pair p = (t, k), one read of ``dout[t]`` and of
  ``y[r]``, one write of ``dy[r]``: no atomics, deterministic.

A pair with no row (dropped by the capacity, or not sent) contributes zero and gets ``dw = 0``.
``weighted_combine_reference`` is the plain PyTorch version beside it.
"""

import torch
import triton
import triton.language as tl

from moe.kernels.launch import INTERPRET, use_reference

# 1024 bf16 columns over 4 warps: 8 per thread, 16-byte loads.
_BLOCK_D = 64 if INTERPRET else 1024


@triton.jit
def _weighted_combine_fwd_kernel(y_ptr, row_of_pair_ptr, w_ptr, out_ptr, R, D, stride_y, stride_out,
                                 K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for k in range(K):
            row = tl.load(row_of_pair_ptr + t * K + k)
            if (row >= 0) & (row < R):
                wk = tl.load(w_ptr + t * K + k)
                y = tl.load(y_ptr + row * stride_y + cols, mask=cols < D, other=0.0)
                acc += wk * y.to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def _weighted_combine_bwd_kernel(dout_ptr, y_ptr, pair_ptr, w_ptr, dy_ptr, dw_ptr, D,
                                 stride_dout, stride_y, stride_dy,
                                 K: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    p = tl.load(pair_ptr + r)
    wp = tl.load(w_ptr + p)
    dout_row = dout_ptr + (p // K) * stride_dout
    y_row = y_ptr + r.to(tl.int64) * stride_y
    dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        g = tl.load(dout_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(dy_ptr + r.to(tl.int64) * stride_dy + cols, (wp * g).to(dy_ptr.dtype.element_ty), mask=cols < D)
        dot += g * y
    tl.store(dw_ptr + p, tl.sum(dot, axis=0))


def _check(y_RD: torch.Tensor, pair_R: torch.Tensor, w_TK: torch.Tensor) -> None:
    if y_RD.dim() != 2:
        raise ValueError(f"y_RD must be 2-D (R, D), got shape {tuple(y_RD.shape)}")
    if pair_R.dim() != 1 or pair_R.shape[0] != y_RD.shape[0] or pair_R.dtype != torch.int64:
        raise ValueError(f"pair_R must be int64 of shape ({y_RD.shape[0]},), got {pair_R.dtype} {tuple(pair_R.shape)}")
    if w_TK.dim() != 2 or w_TK.dtype != torch.float32:
        raise ValueError(f"w_TK must be a 2-D (T, K) fp32 tensor, got {w_TK.dtype} {tuple(w_TK.shape)}")
    if y_RD.shape[0] > w_TK.numel():
        raise ValueError(f"y_RD has {y_RD.shape[0]} rows, more than the T·K = {w_TK.numel()} pairs")
    if not (y_RD.device == pair_R.device == w_TK.device):
        raise ValueError(f"y_RD, pair_R, w_TK on different devices: {y_RD.device}, {pair_R.device}, {w_TK.device}")


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
        out_TD = y_RD.new_empty((T, D), dtype=out_dtype)
        if T and D:
            row_of_pair_P = row_of_pair(pair_R, T * K)
            _weighted_combine_fwd_kernel[(T,)](y_RD, row_of_pair_P, w_TK, out_TD, R, D, y_RD.stride(0),
                                               out_TD.stride(0), K=K, BLOCK_D=_BLOCK_D, num_warps=4)
        ctx.save_for_backward(y_RD, pair_R, w_TK)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        y_RD, pair_R, w_TK = ctx.saved_tensors
        T, K = w_TK.shape
        R, D = y_RD.shape
        dout_TD = dout_TD.contiguous()
        dy_RD = torch.empty_like(y_RD)
        dw_TK = torch.zeros_like(w_TK)
        if R and D:
            _weighted_combine_bwd_kernel[(R,)](dout_TD, y_RD, pair_R, w_TK, dy_RD, dw_TK, D,
                                               dout_TD.stride(0), y_RD.stride(0), dy_RD.stride(0),
                                               K=K, BLOCK_D=_BLOCK_D, num_warps=4)
        return dy_RD, None, dw_TK, None


def weighted_combine_reference(y_RD: torch.Tensor, pair_R: torch.Tensor, w_TK: torch.Tensor,
                               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """PyTorch version: un-permute into pair order (zeros for pairs without a row), then the
    weighted sum over the K slots in fp32."""
    T, K = w_TK.shape
    y_PD = y_RD.new_zeros((T * K, y_RD.shape[1])).index_copy(0, pair_R, y_RD)
    out_TD = (y_PD.view(T, K, y_RD.shape[1]).float() * w_TK.unsqueeze(-1)).sum(dim=1)
    return out_TD.to(out_dtype or y_RD.dtype)


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
