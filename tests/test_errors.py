"""Bad construction and bad input raise one clear error naming the argument."""

import math
import typing

import pytest
import torch

from moe import MoEConfig, MoELayer


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=5), "top_k=5 must be <= num_experts=4"),
        (dict(dim=0), "dim must be a positive int"),
        (dict(hidden_dim=-3), "hidden_dim must be a positive int"),
        (dict(num_experts=0, top_k=1), "num_experts must be a positive int"),
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
        (dict(capacity_factor=-1.0), "capacity_factor must be > 0"),
        (dict(drop_policy="random"), "drop_policy"),
        (dict(activation="relu"), "activation"),
        (dict(score_func="tanh"), "score_func"),
        (dict(num_shared_experts=-1), "num_shared_experts"),
        (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
        (dict(capacity_groups=0), "capacity_groups"),
    ],
)
def test_bad_construction(kwargs, match):
    args = dict(dim=8, hidden_dim=16, num_experts=4, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MoELayer(**args)


MOE_FLOAT_FIELDS = [name for name, tp in typing.get_type_hints(MoEConfig).items() if float in (tp, *typing.get_args(tp))]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", MOE_FLOAT_FIELDS)
def test_non_finite_float_options(name, value):
    """NaN passed the ``>= 0`` checks and capacity_factor=inf failed only in the forward (issue #18)."""
    with pytest.raises(ValueError, match=f"^MoELayer: {name} must be a finite number, got {value}$"):
        MoELayer(8, 16, 4, **{name: value})
    with pytest.raises(ValueError, match=f"^MoEConfig: {name} must be a finite number, got {value}$"):
        MoEConfig(**{name: value}).validate()


@pytest.mark.parametrize("kwargs,match", [(dict(top_k=9), "top_k=9 must be <= num_experts=8"), (dict(drop_policy="random"), "drop_policy")])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(8, config=MoEConfig(**kwargs))


def test_config_and_option_arguments_do_not_mix():
    with pytest.raises(TypeError, match="not both .*top_k"):
        MoELayer(8, config=MoEConfig(), top_k=1)


def test_option_arguments_need_hidden_dim_and_num_experts():
    with pytest.raises(TypeError, match="missing num_experts"):
        MoELayer(8, hidden_dim=16)


def test_wrong_last_dim():
    with pytest.raises(ValueError, match="last dim = dim = 8"):
        MoELayer(8, 16, 4)(torch.randn(3, 7))


def test_non_floating_input():
    with pytest.raises(TypeError, match="floating-point"):
        MoELayer(8, 16, 4)(torch.ones(3, 8, dtype=torch.long))


def test_nan_input_with_check_finite():
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        MoELayer(8, 16, 4, check_finite=True)(x)


def test_tokens_not_divisible_by_capacity_groups():
    with pytest.raises(ValueError, match="capacity_groups=2"):
        MoELayer(8, 16, 4, capacity_factor=1.0, capacity_groups=2)(torch.randn(3, 8))


def test_experts_not_divisible_by_ep_size():
    class FakeDispatcher:
        ep_size, ep_rank = 3, 0

    with pytest.raises(ValueError, match="num_experts=4 must be divisible by the expert-parallel size 3"):
        MoELayer(8, 16, 4, dispatcher=FakeDispatcher())


def test_dispatch_needs_the_combine_weights():
    from moe.capacity import plan_routing
    from moe.dispatch import LocalDispatcher

    plan = plan_routing(torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2), 4, None)
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="w_TK must be the"):
        LocalDispatcher().dispatch(x, plan, None)
    with pytest.raises(ValueError, match="w_TK must be fp32 of shape"):
        LocalDispatcher().dispatch(x, plan, torch.rand(2, 3))
