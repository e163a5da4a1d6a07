"""MoELayer against the naive per-token reference: outputs and every gradient."""

import zlib

import pytest
import torch

from moe import MoEConfig, MoELayer
from tests.naive_moe import naive_moe

# (atol, rtol) of the layer in this dtype against the fp32 naive reference of the same weights
TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def _grads(layer, x):
    names = [n for n, p in layer.named_parameters() if p.grad is not None]
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters() if n in names}}


def _run(layer, x, fn):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(layer, x)
    # a random cotangent, so every output element's gradient path is checked
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    (out.float() * g).sum().backward()
    return out.detach().float().cpu(), {n: g.cpu() for n, g in _grads(layer, x).items()}


def _assert_close(a, b, dtype, what):
    atol, rtol = TOLERANCES[dtype]
    scale = b.abs().max().clamp_min(1.0)
    err = (a.float() - b.float()).abs().max()
    assert err <= atol * scale + rtol * b.abs().max(), f"{what}: max err {err:.3e} (scale {scale:.3e})"


CASES = [
    # capacity_factor, drop_policy, activation, score_func, renormalize, shared
    (None, "probs", "swiglu", "softmax", True, 0),
    (1.0, "probs", "swiglu", "softmax", True, 0),
    (0.5, "position", "swiglu", "softmax", False, 0),
    (0.75, "probs", "gelu", "sigmoid", True, 1),
    (None, "position", "gelu", "softmax", False, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cf,policy,act,score,renorm,shared", CASES)
def test_matches_naive_reference(dtype, cf, policy, act, score, renorm, shared):
    # a seed of the case itself, the same in every process (hash() of a str is salted per process)
    torch.manual_seed(zlib.crc32(repr((cf, policy, act, score, renorm, shared)).encode()) % 1000)
    layer = MoELayer(
        24, 40, 6, 2, capacity_factor=cf, drop_policy=policy, activation=act, score_func=score,
        renormalize=renorm, num_shared_experts=shared, shared_hidden_dim=16, dtype=dtype,
    )
    # larger router weights spread the scores, so routing is decided clearly
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(3, 7, 24).to(dtype)
    out, grads = _run(layer, x, lambda m, x: m(x))
    ref, ref_grads = _run(layer, x, lambda m, x: naive_moe(m, x)[0])
    assert out.shape == x.shape and layer.last_aux is not None
    _assert_close(out, ref, dtype, "output")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        _assert_close(grads[name], ref_grads[name], dtype, f"grad {name}")


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_recomputed_experts_give_the_same_gradients(act):
    """``experts.recompute`` (activation checkpointing of the expert MLP) with the combine weights
    passed into the experts: the checkpoint keeps them as an input, and every gradient (the
    router's through the weights) is the one without recomputation."""
    torch.manual_seed(5)
    layer = MoELayer(24, 40, 6, 2, activation=act)
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(3, 7, 24)
    out, grads = _run(layer, x, lambda m, x: m(x))
    layer.experts.recompute = True
    out_r, grads_r = _run(layer, x, lambda m, x: m(x))
    assert torch.equal(out, out_r) and grads.keys() == grads_r.keys()
    assert grads["router.weight"].abs().sum() > 0
    for name in grads:
        assert torch.equal(grads[name], grads_r[name]), name


def test_dropped_pairs_are_counted_and_contribute_zero():
    torch.manual_seed(3)
    layer = MoELayer(8, 16, 4, 2, capacity_factor=0.25)
    x = torch.randn(16, 8)
    out, aux = layer.forward_with_aux(x)
    _, kept, _ = naive_moe(layer, x)
    dropped = 16 * 2 - len(kept)
    assert dropped > 0
    assert int(aux.stats.dropped_pairs) == dropped
    assert aux.stats.dropped_fraction.item() == pytest.approx(dropped / 32)
    assert int(aux.stats.tokens_per_expert.sum()) == len(kept)
    assert aux.stats.tokens_per_expert.max() <= aux.stats.capacity == 2
    # a token whose two pairs were both dropped gets exactly zero (the residual carries it)
    for t in range(16):
        if (t, 0) not in kept and (t, 1) not in kept:
            assert torch.all(out[t] == 0)


def test_all_tokens_to_one_expert_and_empty_experts():
    layer = MoELayer(8, 16, 4, 1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0
    x = torch.rand(10, 8) + 0.1  # positive, so expert 2's logit is the largest for every token
    out, aux = layer.forward_with_aux(x)
    assert aux.stats.tokens_per_expert.tolist() == [0, 0, 10, 0]
    ref, _, _ = naive_moe(layer, x)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert aux.stats.load_imbalance.item() == pytest.approx(4.0)


@pytest.mark.parametrize("E,K,T", [(1, 1, 5), (4, 4, 5), (4, 2, 1), (8, 2, 0)])
def test_edge_shapes(E, K, T):
    layer = MoELayer(8, 12, E, K, capacity_factor=1.0)
    x = torch.randn(T, 8, requires_grad=True)
    out, aux = layer.forward_with_aux(x)
    assert out.shape == (T, 8)
    ref, _, _ = naive_moe(layer, x)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    (out.sum() + aux.loss).backward()
    assert x.grad.shape == x.shape


def test_leading_dims_and_dtype_preserved():
    layer = MoELayer(8, 12, 4, 2, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 4, 8, dtype=torch.bfloat16)
    assert layer(x).shape == x.shape and layer(x).dtype == torch.bfloat16


def test_config_and_arguments_build_the_same_layer():
    config = MoEConfig(num_experts=4, hidden_dim=12, capacity_factor=0.5, activation="gelu")
    torch.manual_seed(2)
    by_args = MoELayer(8, 12, 4, 2, capacity_factor=0.5, activation="gelu")
    torch.manual_seed(2)
    by_config = MoELayer(8, config=config)
    config.top_k = 1  # the layer keeps its own copy
    assert by_config.config == by_args.config and by_config.config.top_k == 2
    x = torch.randn(10, 8)
    torch.testing.assert_close(by_config(x), by_args(x), rtol=0, atol=0)


def test_capacity_groups_cap_each_group():
    torch.manual_seed(5)
    layer = MoELayer(8, 12, 4, 2, capacity_factor=0.5, capacity_groups=2)
    x = torch.randn(12, 8)
    out, aux = layer.forward_with_aux(x)
    ref, kept, _ = naive_moe(layer, x, capacity_groups=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert int(aux.stats.tokens_per_expert.sum()) == len(kept)
    assert aux.stats.capacity == 2  # ceil(0.5 · 6 · 2 / 4) per group


@pytest.mark.gpu
@pytest.mark.parametrize("cf", [None, 0.5])
def test_cuda_layer_with_triton_experts_matches_naive(cf):
    """The whole layer on CUDA (Triton grouped GEMM, bf16 autocast) against the fp32 naive reference."""
    torch.manual_seed(11)
    layer = MoELayer(128, 192, 8, 2, capacity_factor=cf, num_shared_experts=1, shared_hidden_dim=64)
    torch.nn.init.normal_(layer.router.weight, std=0.3)
    x = torch.randn(4, 61, 128)
    ref, ref_grads = _run(layer, x, lambda m, x: naive_moe(m, x)[0])
    layer.cuda()
    def fwd(m, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x.cuda())
    out, grads = _run(layer, x, fwd)
    _assert_close(out, ref, torch.bfloat16, "output")
    for name in ref_grads:
        _assert_close(grads[name], ref_grads[name], torch.bfloat16, f"grad {name}")
