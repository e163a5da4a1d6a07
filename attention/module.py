"""Causal self-attention block: fused QKV projection, optional q/k RMSNorm, RoPE, GQA, FlashAttention,
output projection.

Shape legend: B batch, S sequence, D model dim, H query heads, Hkv key/value heads, Hd head dim.
"""

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from attention.flash_attn import flash_attention
from attention.reference import visible_keys
from attention.rope import apply_rope, rope_cos_sin


class Attention(nn.Module):
    """Multi-head causal self-attention with grouped key/value heads.

    ``n_kv_heads`` defaults to ``n_heads`` (plain MHA); 1 gives MQA. ``head_dim`` defaults to
    ``dim // n_heads``. On CUDA tensors the Triton FlashAttention kernel runs; elsewhere
    ``scaled_dot_product_attention`` (same math, same masking).

    ``qk_norm``: an RMSNorm (eps ``norm_eps``) of the queries and of the keys before RoPE, over
    each head's Hd with one gain shared by the heads (``"head"``, Qwen3-MoE), or over the whole
    projection, H·Hd and Hkv·Hd wide (``"full"``, OLMoE). ``qkv_bias``: biases on the query, key
    and value projections (Qwen2-MoE); ``out_bias``: on the output projection.
    ``sliding_window`` W: query i attends to keys ``i − W < j <= i`` (Mistral's and Hugging Face's
    sliding_window; the kernel's ``window=(W − 1, 0)``); None: to every ``j <= i``.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float = 10000.0, *, qkv_bias: bool = False,
                 out_bias: bool = False, qk_norm: Literal["none", "head", "full"] = "none", norm_eps: float = 1e-5,
                 sliding_window: int | None = None):
        super().__init__()
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        self.sliding_window = sliding_window
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        head_dim = dim // n_heads if head_dim is None else head_dim
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be positive and even, got {head_dim}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        if qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be none, head or full, got {qk_norm!r}")
        self.rope_theta = rope_theta
        self.qk_norm = qk_norm
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=qkv_bias)
        self.out = nn.Linear(n_heads * head_dim, dim, bias=out_bias)
        if qk_norm != "none":
            q_width, k_width = (head_dim, head_dim) if qk_norm == "head" else (n_heads * head_dim, n_kv_heads * head_dim)
            self.q_norm = nn.RMSNorm(q_width, eps=norm_eps)
            self.k_norm = nn.RMSNorm(k_width, eps=norm_eps)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """x_BSD: (B, S, D) -> (B, S, D), causal (within the sliding window)."""
        B, S, _ = x_BSD.shape
        H, Hkv, Hd = self.n_heads, self.n_kv_heads, self.head_dim
        # (B, S, H·Hd), (B, S, Hkv·Hd), (B, S, Hkv·Hd): views of the one projection
        q, k, v = self.qkv(x_BSD).split((H * Hd, Hkv * Hd, Hkv * Hd), dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BSHHd, k_BSHkvHd, v_BSHkvHd = q.view(B, S, H, Hd), k.view(B, S, Hkv, Hd), v.view(B, S, Hkv, Hd)
        if self.qk_norm == "head":
            q_BSHHd, k_BSHkvHd = self.q_norm(q_BSHHd), self.k_norm(k_BSHkvHd)
        cos_table, sin_table = rope_cos_sin(S, Hd, self.rope_theta, device=x_BSD.device)
        q_BSHHd = apply_rope(q_BSHHd, cos_table, sin_table)
        k_BSHkvHd = apply_rope(k_BSHkvHd, cos_table, sin_table)
        # (B, S, H, Hd) memory viewed as (B, H, S, Hd): the kernel takes strides, no copy.
        q, k, v = (t.transpose(1, 2) for t in (q_BSHHd, k_BSHkvHd, v_BSHkvHd))
        W = self.sliding_window
        window = (W - 1, 0) if W is not None and W < S else None
        if x_BSD.is_cuda:
            o_BHSHd = flash_attention(q, k, v, causal=True, window=window)
        elif window is None:
            o_BHSHd = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
        else:
            visible_SS = visible_keys(S, S, causal=True, window=window, device=x_BSD.device)
            o_BHSHd = F.scaled_dot_product_attention(q, k, v, attn_mask=visible_SS, enable_gqa=Hkv != H)
        return self.out(o_BHSHd.transpose(1, 2).reshape(B, S, H * Hd))
