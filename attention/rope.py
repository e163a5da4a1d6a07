"""Rotary position embedding (rotate-half convention, as in GPT-NeoX and Llama).

Shape legend: B batch, S sequence length, H heads, Hd head dim (even).

On CUDA one Triton pass rotates a (B, S, H, Hd) tensor of any strides (a view of the fused qkv
output) into a new contiguous one, math in fp32, and its backward is the same pass rotating the
gradient by the opposite angle (a rotation's inverse). Written in PyTorch, the same math is about
ten elementwise kernels each way (the fp32 upcast, chunk, four products, two sums, the cat, the
cast back) over fp32 intermediates. Measured on an H100 (bench/rope.py, bench/results/rope.md,
q and k of one block, fwd+bwd, 5 alternating rounds): 1.64x the PyTorch ops at OLMoE's shape,
2.09-2.24x at Qwen3-A3B's and at head dim 64; in the OLMoE-shaped step at 6 layers the attention
category's GPU time fell 19.8 → 12.0 ms (bench/results/step_profile.md).
"""

import torch
import triton
import triton.language as tl

from kernel_floor import cdiv, next_power_of_2, use_reference

_BLOCK_ROWS = 32


def rope_cos_sin(S, head_dim, theta=10000.0, device=None):
    """cos, sin tables, each (S, Hd/2) fp32: angle[s, i] = s · theta^(−2i/Hd)."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                         / head_dim)
    angle_table = torch.arange(S, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angle_table.cos(), angle_table.sin()


@triton.jit
def _rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, R, S, H, stride_b, stride_s, stride_h,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, SIGN: tl.constexpr):
    """Rows r = (b, s, h) of x (B, S, H, 2·HALF), strided; out contiguous. SIGN -1: the inverse."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < R)[:, None] & (cols < HALF)[None, :]
    h = (rows % H).to(tl.int64)
    s = (rows // H) % S
    b = (rows // (H * S)).to(tl.int64)
    src = (x_ptr + b * stride_b + s.to(tl.int64) * stride_s + h * stride_h)[:, None] + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    table = s[:, None] * HALF + cols[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0) * SIGN
    dst = out_ptr + rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def _rope_triton(x_BSHHd: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, sign: int) -> torch.Tensor:
    B, S, H, Hd = x_BSHHd.shape
    if x_BSHHd.stride(3) != 1:
        x_BSHHd = x_BSHHd.contiguous()
    out = torch.empty(B, S, H, Hd, dtype=x_BSHHd.dtype, device=x_BSHHd.device)
    rows = B * S * H
    if rows:
        _rope_kernel[(cdiv(rows, _BLOCK_ROWS),)](
            x_BSHHd, out, cos_table, sin_table, rows, S, H, *x_BSHHd.stride()[:3],
            HALF=Hd // 2, BLOCK_HALF=next_power_of_2(Hd // 2), BLOCK_ROWS=_BLOCK_ROWS, SIGN=sign, num_warps=4)
    return out


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSHHd, cos_table, sin_table):
        ctx.save_for_backward(cos_table, sin_table)
        return _rope_triton(x_BSHHd, cos_table, sin_table, 1)

    @staticmethod
    def backward(ctx, grad_BSHHd):
        cos_table, sin_table = ctx.saved_tensors
        return _rope_triton(grad_BSHHd, cos_table, sin_table, -1), None, None


def apply_rope(x_BSHHd, cos_table, sin_table, backend: str = "auto"):
    """Rotate pairs (x[..., i], x[..., i + Hd/2]) by angle[s, i]; computed in fp32.

    x_BSHHd: (B, S, H, Hd), any float dtype and strides; cos_table, sin_table: (S, Hd/2) fp32
    contiguous. backend: ``"auto"`` (the Triton pass on CUDA, PyTorch elsewhere), ``"triton"``
    or ``"reference"``. Returns a new contiguous (B, S, H, Hd) tensor in x's dtype.
    """
    B, S, H, Hd = x_BSHHd.shape
    if cos_table.shape != (S, Hd // 2) or sin_table.shape != (S, Hd // 2):
        raise ValueError(f"apply_rope: cos/sin tables of shape ({S}, {Hd // 2}) needed for x of shape "
                         f"{tuple(x_BSHHd.shape)}, got {tuple(cos_table.shape)}, {tuple(sin_table.shape)}")
    if not use_reference(backend, not x_BSHHd.is_cuda):
        return _RopeFn.apply(x_BSHHd, cos_table.float().contiguous(), sin_table.float().contiguous())
    x1, x2 = x_BSHHd.float().chunk(2, dim=-1)
    cos, sin = cos_table[:, None, :], sin_table[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_BSHHd.dtype)
