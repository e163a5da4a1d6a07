"""The router's causal centring, ``y = x − (sum of the earlier positions' x) / max(position, 1)``
per sequence, as one scan kernel for the forward and one for the backward.

Legend: T tokens = B sequences × S positions, E experts (the logits' columns).

Why a kernel: PyTorch's cumsum along the position dim of the (B, S, E) logits runs its outer-dim
scan, which walks each of the B·E columns serially: 98 ms of a 1.8 s step (olmoe_bench, 16 MoE
layers, 8 micro-batches of 16k tokens, 2×H200, bench/step_profile.py, 2026-11-24). The centring's
fwd+bwd on an H100 (T 16k, E 64, S 2048; 5 alternating rounds of do_bench): 1.20 ms with that
scan, 0.40 ms scanning a transposed copy along its last dim, 0.13 ms with these kernels (E 128,
S 4096: 2.36 / 0.45 / 0.21; S 1024: 0.62 / 0.32 / 0.12), fp64 error unchanged (3e-7).

The kernels: one program per (sequence, block of experts) walks the positions in BLOCK_S-row
chunks, ``tl.cumsum`` inside a chunk and a running sum carried between chunks, so every element
is read and written once. The backward is the same walk from the end:
``dx_s = g_s − Σ_{t>s} g_t / max(t, 1)``. Sums are fp32 in chunk order: not the bits of
PyTorch's scan, within a few ulps of it (tests/test_causal_centre.py against fp64).
Off CUDA the wrapper runs the PyTorch formula (``causal_centre_reference``).
"""

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernel_floor import INTERPRET, cdiv, next_power_of_2


@triton.jit
def _centre_kernel(X, Y, S, E, BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """Forward: Y = X − exclusive prefix sum / max(s, 1). Backward (X = dY, Y = dX): walks from
    the last position, Y = X − exclusive suffix sum of X / max(t, 1)."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    base = b.to(tl.int64) * S * E
    carry = tl.zeros([BLOCK_E], tl.float32)
    n_chunks = tl.cdiv(S, BLOCK_S)
    for c in range(n_chunks):
        if BACKWARD:
            start = (n_chunks - 1 - c) * BLOCK_S
        else:
            start = c * BLOCK_S
        pos = start + tl.arange(0, BLOCK_S)
        ok = (pos < S)[:, None] & col_ok[None, :]
        offs = base + pos[:, None].to(tl.int64) * E + cols[None, :]
        x = tl.load(X + offs, mask=ok, other=0.0)
        count = tl.maximum(pos, 1).to(tl.float32)[:, None]
        if BACKWARD:
            h = x / count
            before = tl.cumsum(h, 0, reverse=True) - h + carry[None, :]
            y = x - before
            carry += tl.sum(h, 0)
        else:
            before = tl.cumsum(x, 0) - x + carry[None, :]
            y = x - before / count
            carry += tl.sum(x, 0)
        tl.store(Y + offs, y, mask=ok)


def _launch(x_TE: torch.Tensor, seq_len: int, backward: bool) -> torch.Tensor:
    T, E = x_TE.shape
    x_TE = x_TE.contiguous()
    y_TE = torch.empty_like(x_TE)
    block_e = min(next_power_of_2(E), 16)
    block_s = 32 if INTERPRET else 128
    grid = (T // seq_len, cdiv(E, block_e))
    _centre_kernel[grid](x_TE, y_TE, seq_len, E, BACKWARD=backward, BLOCK_S=block_s,
                         BLOCK_E=block_e, num_warps=4)
    return y_TE


class CausalCentreFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, seq_len):
        ctx.seq_len = seq_len
        return _launch(logits_TE, seq_len, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_TE):
        return _launch(grad_TE, ctx.seq_len, backward=True), None


def causal_centre_reference(logits_TE: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The PyTorch formula (CPU, fp64, and the tests' reference)."""
    T, E = logits_TE.shape
    logits_BSE = logits_TE.view(T // seq_len, seq_len, E)
    before_BSE = logits_BSE.cumsum(1) - logits_BSE  # the sum over the earlier positions
    count_S1 = torch.arange(seq_len, device=logits_TE.device, dtype=logits_TE.dtype)[:, None].clamp_min(1)
    return (logits_BSE - before_BSE / count_S1).view(T, E)


def causal_centre_triton(logits_TE: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The kernels, with autograd; fp32 (T, E) logits, T a multiple of ``seq_len``."""
    if logits_TE.dim() != 2 or logits_TE.dtype != torch.float32:
        raise ValueError(f"causal_centre_triton: logits_TE must be 2-D fp32, got {tuple(logits_TE.shape)} "
                         f"{logits_TE.dtype}")
    if seq_len < 1 or logits_TE.shape[0] % seq_len:
        raise ValueError(f"causal_centre_triton: seq_len={seq_len} must divide the {logits_TE.shape[0]} tokens")
    return CausalCentreFn.apply(logits_TE, seq_len)
