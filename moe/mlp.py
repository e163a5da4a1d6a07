"""Dense feed-forward block: the shared experts of an MoE layer (every token goes through it).

Legend: T tokens (any leading dims), D model dim, F hidden dim.
"""

import typing
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

Activation = Literal["swiglu", "gelu"]
ACTIVATIONS = typing.get_args(Activation)


class DenseMLP(nn.Module):
    """``swiglu``: ``W2 (silu(x W_gate) * (x W_up))`` with gate and up in one matmul of width 2F;
    ``gelu``: ``W2 gelu(x W1)``. No biases."""

    def __init__(self, dim: int, hidden_dim: int, activation: Activation = "swiglu", *, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        width = 2 * hidden_dim if activation == "swiglu" else hidden_dim
        self.w1 = nn.Linear(dim, width, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h = self.w1(x_TD)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.w2(h)
