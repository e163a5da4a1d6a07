"""train/flops.py against an independent count: 6 · active parameters + attention scores.

The formula in train/flops.py is written per layer from the config; here the parameters are
counted from a built model instead (on the meta device, so the OLMoE-shaped benchmark costs no
memory): every matrix of a token's path is one multiply-add per weight, forward, the routed
experts at K of E. What a parameter count does not see is added by hand: the causal attention
scores (QKᵀ and PV, counted query by query: min(i + 1, W) keys for query i) and, with tied embeddings, the LM head
that reuses the embedding matrix (the lookup itself costs nothing).
"""

import pytest
import torch

from moe import GroupedExperts
from train.config import Config, apply_overrides, from_yaml
from train.flops import forward_flops_per_token
from train.model import MoETransformer


def independent_forward_flops(cfg: Config) -> float:
    with torch.device("meta"):
        model = MoETransformer(cfg)
    m, e = cfg.model, cfg.moe
    expert_params = {id(p) for mod in model.modules() if isinstance(mod, GroupedExperts) for p in mod.parameters()}
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embed.weight":  # norm gains and biases: no matmul; the lookup: none
            continue
        active += p.numel() * (e.top_k / e.num_experts if id(p) in expert_params else 1.0)
    if m.tie_embeddings:
        active += model.embed.weight.numel()  # the LM head is the embedding matrix
    H, Hd = m.n_heads, m.head_dim or m.dim // m.n_heads
    S, W = cfg.data.seq_len, m.sliding_window or cfg.data.seq_len
    visible = sum(min(i + 1, W) for i in range(S)) / S  # query i sees its last min(i + 1, W) keys
    scores = m.n_layers * 2 * 2 * H * Hd * visible
    return 2 * active + scores


@pytest.mark.parametrize("overrides", [
    ["--model.tie_embeddings=true"],
    ["--model.tie_embeddings=false", "--model.n_kv_heads=2", "--model.head_dim=48"],
    ["--moe.num_shared_experts=2", "--moe.shared_hidden_dim=40", "--moe.every_n_layers=2", "--moe.activation=gelu"],
    ["--moe.first_dense_layers=1", "--model.qkv_bias=true", "--moe.top_k=3"],
    ["--model.sliding_window=5"], ["--model.sliding_window=33"], ["--model.sliding_window=40"],
])
def test_flops_equal_six_times_active_params_plus_attention(overrides):
    cfg = apply_overrides(Config(), ["--model.dim=96", "--model.n_layers=3", "--model.n_heads=4", "--model.vocab_size=300",
                                     "--moe.num_experts=6", "--moe.hidden_dim=24", "--data.seq_len=33", *overrides])
    assert forward_flops_per_token(cfg) == pytest.approx(independent_forward_flops(cfg), rel=1e-12)


def test_flops_of_the_olmoe_benchmark():
    """The benchmark's MFU rests on this count: 6 × 1.18B active parameters without the embedding
    (1.28B with it) + the causal attention scores: 7.476 GFLOP per trained token."""
    cfg = from_yaml("configs/olmoe_bench.yaml")
    fwd = forward_flops_per_token(cfg)
    assert fwd == pytest.approx(independent_forward_flops(cfg), rel=1e-12)
    assert 3 * fwd == pytest.approx(7.476e9, rel=1e-3)
