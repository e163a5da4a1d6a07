"""Model FLOPs per token and MFU.

Counted per token, forward, multiply-add = 2 FLOPs, only the *active* parameters (the K routed
experts a token visits, not all E):

- attention projections: ``2·D·(H + 2·Hkv)·Hd`` (QKV) + ``2·H·Hd·D`` (out);
- attention scores, causal: ``QKᵀ`` and ``PV`` are ``2·S·H·Hd`` each without a mask; a causal
  token attends to (S+1)/2 keys on average, so ``2·2·H·Hd·(S+1)/2``; with a sliding window of
  W < S keys, ``(W(W+1)/2 + (S−W)·W) / S`` keys on average (:func:`mean_visible_keys`);
- MoE block: router ``2·D·E`` + K experts · ``2·D·F·(3 if SwiGLU else 2)`` + shared experts the same
  with their width; dense block: ``2·D·F_dense·(3 or 2)``;
- LM head ``2·D·V`` (the embedding lookup costs no FLOPs).

Training FLOPs = 3 × forward (backward = 2 × forward). Dropped (token, expert) pairs are
counted as if computed: MFU measures useful model FLOPs of the configured model.
MFU = training FLOPs per second per GPU / that GPU's peak dense bf16 FLOP/s.
"""

import math

import torch

from train.config import Config

# dense bf16 tensor-core peak (no sparsity), by a substring of torch.cuda.get_device_name()
PEAK_BF16_FLOPS = (
    ("H200", 989e12),  # H200 SXM, same tensor cores as H100 SXM
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # H100 SXM
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)


def forward_flops_per_token(cfg: Config) -> float:
    m, e = cfg.model, cfg.moe
    D, S, V = m.dim, cfg.data.seq_len, m.vocab_size
    H = m.n_heads
    Hkv = m.n_kv_heads or H
    Hd = m.head_dim or D // H
    mlp_mults = 3 if e.activation == "swiglu" else 2
    flops = 2.0 * D * V
    for i in range(m.n_layers):
        flops += 2 * D * (H + 2 * Hkv) * Hd + 2 * H * Hd * D
        flops += 2 * 2 * H * Hd * mean_visible_keys(S, m.sliding_window)
        if e.is_moe_layer(i):
            flops += 2 * D * e.num_experts
            flops += e.top_k * 2 * D * e.hidden_dim * mlp_mults
            if e.num_shared_experts:
                flops += 2 * D * e.num_shared_experts * (e.shared_hidden_dim or e.hidden_dim) * mlp_mults
        else:
            flops += 2 * D * m.dense_hidden_dim * mlp_mults
    return flops


def mean_visible_keys(S: int, window: int | None) -> float:
    """Keys a causal query of a length-S sequence attends to, on average: query i sees
    ``min(i + 1, W)``."""
    if window is None or window >= S:
        return (S + 1) / 2
    return (window * (window + 1) / 2 + (S - window) * window) / S


def train_flops_per_token(cfg: Config) -> float:
    return 3.0 * forward_flops_per_token(cfg)


def peak_flops(device: torch.device) -> float:
    """Peak dense bf16 FLOP/s of ``device``; NaN on a CPU or an unknown GPU (MFU then reads NaN)."""
    if device.type != "cuda":
        return math.nan
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak
    return math.nan


def param_counts(model: torch.nn.Module, cfg: Config, ep: int) -> dict[str, float]:
    """Total (all experts, over the EP group) and active (per token) parameter counts."""
    from train.model import expert_parameter_names

    expert_names = expert_parameter_names(model)
    dense = sum(p.numel() for n, p in model.named_parameters() if n not in expert_names)
    local_expert = sum(p.numel() for n, p in model.named_parameters() if n in expert_names)
    total_expert = local_expert * ep
    active_expert = total_expert * cfg.moe.top_k / cfg.moe.num_experts
    return {"params_total": dense + total_expert, "params_active": dense + active_expert, "params_dense": dense}
