"""Rotary position embedding (rotate-half convention, as in GPT-NeoX and Llama).

Shape legend: B batch, S sequence length, H heads, Hd head dim (even).
"""

import torch


def rope_cos_sin(S, head_dim, theta=10000.0, device=None):
    """cos, sin tables, each (S, Hd/2) fp32: angle[s, i] = s · theta^(−2i/Hd)."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                         / head_dim)
    angle_table = torch.arange(S, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angle_table.cos(), angle_table.sin()


def apply_rope(x_BSHHd, cos_table, sin_table):
    """Rotate pairs (x[..., i], x[..., i + Hd/2]) by angle[s, i]; computed in fp32.

    x_BSHHd: (B, S, H, Hd), any float dtype; cos_table, sin_table: (S, Hd/2) fp32.
    Returns a new contiguous (B, S, H, Hd) tensor in x's dtype.
    """
    x1, x2 = x_BSHHd.float().chunk(2, dim=-1)
    cos, sin = cos_table[:, None, :], sin_table[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_BSHHd.dtype)
