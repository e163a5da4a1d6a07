"""Hand-checked capacity, drop policies, losses and stats."""

import dataclasses
import math

import pytest
import torch

from moe import MoELayer, expert_capacity, load_balancing_loss, moe_aux_loss, moe_stats, plan_routing, router_z_loss
from moe.capacity import max_received_rows
from moe.stats import MoEStats, compute_stats


@pytest.mark.parametrize(
    "T,E,K,cf,expected",
    [(10, 4, 2, 1.0, 5), (10, 4, 2, 1.1, 6), (10, 4, 2, 0.01, 1), (7, 3, 1, 1.0, 3), (8, 8, 2, 1.25, 3), (5, 4, 2, None, None)],
)
def test_capacity_formula_and_rounding(T, E, K, cf, expected):
    assert expert_capacity(T, E, K, cf) == expected


def test_capacity_factor_must_be_positive():
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(4, 2, 1, 0.0)


# 5 tokens, K=2, 3 experts. Pairs p = t·2 + k.
EXPERTS = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0]])
PRIORITY = torch.tensor([[0.5, 0.3], [0.2, 0.7], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])


def test_position_policy_keeps_earliest():
    plan = plan_routing(EXPERTS, PRIORITY, 3, capacity=2, drop_policy="position")
    # expert 0 gets tokens 0,1,2,3,4 -> keeps 0,1; expert 1 gets 0,2,3 -> keeps 0,2; expert 2 gets 1,4 -> both
    expected = torch.tensor([[1, 1], [1, 1], [1, 0], [0, 0], [1, 0]], dtype=torch.bool)
    assert torch.equal(plan.kept_TK, expected)
    assert plan.kept_per_expert_E.tolist() == [2, 2, 2]
    assert plan.routed_per_expert_E.tolist() == [5, 3, 2]


def test_probs_policy_keeps_highest_weight():
    plan = plan_routing(EXPERTS, PRIORITY, 3, capacity=2, drop_policy="probs")
    # expert 0 priorities: t0 .5, t1 .2, t2 .4, t3 .9, t4 .5 -> keeps t3 (.9) and t0 (.5 ties t4, earlier wins)
    # expert 1: t0 .3, t2 .6, t3 .1 -> keeps t2, t0; expert 2: t1 .7, t4 .5 -> both
    expected = torch.tensor([[1, 1], [0, 1], [1, 0], [1, 0], [1, 0]], dtype=torch.bool)
    assert torch.equal(plan.kept_TK, expected)


def test_ties_are_broken_by_position():
    experts = torch.zeros(4, 1, dtype=torch.long)
    priority = torch.full((4, 1), 0.25)
    plan = plan_routing(experts, priority, 2, capacity=3, drop_policy="probs")
    assert plan.kept_TK.squeeze(1).tolist() == [True, True, True, False]


def test_capacity_at_least_tokens_drops_nothing():
    for policy in ("probs", "position"):
        plan = plan_routing(EXPERTS, PRIORITY, 3, capacity=5, drop_policy=policy)
        assert bool(plan.kept_TK.all())
        plan = plan_routing(EXPERTS, PRIORITY, 3, capacity=50, drop_policy=policy)
        assert bool(plan.kept_TK.all())


def test_order_packs_kept_pairs_by_expert_then_dropped():
    plan = plan_routing(EXPERTS, PRIORITY, 3, capacity=2, drop_policy="position")
    order = plan.order_P.tolist()
    flat = EXPERTS.reshape(-1).tolist()
    kept = plan.kept_TK.reshape(-1).tolist()
    n_kept = sum(kept)
    assert all(kept[p] for p in order[:n_kept]) and not any(kept[p] for p in order[n_kept:])
    assert [flat[p] for p in order[:n_kept]] == sorted(flat[p] for p in order[:n_kept])
    assert sorted(order) == list(range(10))


def test_dropless_keeps_all_and_zero_token_experts():
    plan = plan_routing(EXPERTS, PRIORITY, 5, capacity=None)
    assert bool(plan.kept_TK.all())
    assert plan.kept_per_expert_E.tolist() == [5, 3, 2, 0, 0]


def test_bad_drop_policy():
    with pytest.raises(ValueError, match="drop_policy"):
        plan_routing(EXPERTS, PRIORITY, 3, capacity=2, drop_policy="random")


def test_load_balancing_loss_formula():
    # 4 tokens, K=1, E=2: 3 pairs to expert 0, 1 to expert 1; mean probs (0.6, 0.4)
    routed = torch.tensor([3, 1])
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.5, 0.5], [0.3, 0.7]])
    loss = load_balancing_loss(routed, probs.sum(0), 4, 1)
    assert loss.item() == pytest.approx(2 * (0.75 * 0.6 + 0.25 * 0.4))
    # uniform routing and uniform probabilities give exactly 1
    assert load_balancing_loss(torch.tensor([2, 2]), torch.full((4, 2), 0.5).sum(0), 4, 1).item() == pytest.approx(1.0)


def test_z_loss_formula():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    lse = [math.log(2.0), math.log(math.e + math.e**2)]
    assert router_z_loss(logits).item() == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2, rel=1e-6)


def test_layer_losses_match_formulas_and_reach_router():
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, 2, aux_loss_coef=0.5, z_loss_coef=0.25)
    x = torch.randn(9, 8)
    _, aux = layer.forward_with_aux(x)
    logits = x @ layer.router.weight.t()
    probs = logits.softmax(-1)
    top = probs.topk(2, -1).indices
    f = torch.bincount(top.reshape(-1), minlength=4).float() / 18
    lb = 4 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    assert aux.load_balancing_loss.item() == pytest.approx(lb.item(), rel=1e-5)
    assert aux.z_loss.item() == pytest.approx(z.item(), rel=1e-5)
    assert aux.loss.item() == pytest.approx(0.5 * lb.item() + 0.25 * z.item(), rel=1e-5)
    aux.loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.w1_LDU.grad is None  # the losses touch only the router


def test_stats_tile_utilization_hand_case():
    kept = torch.tensor([5, 0, 4])
    routed = torch.tensor([6, 1, 4])
    stats = compute_stats(routed, kept, torch.full((3, 3), 1 / 3), capacity=5, block_m=4)
    assert stats.tiles_per_expert.tolist() == [2, 0, 1]
    assert stats.padded_slots_per_expert.tolist() == [3, 0, 0]
    assert stats.tile_utilization.item() == pytest.approx(9 / 12)
    assert stats.dropped_pairs.item() == 2 and stats.dropped_fraction.item() == pytest.approx(2 / 11)
    assert stats.max_load.item() == 5 and stats.mean_load.item() == pytest.approx(3.0)
    assert stats.router_entropy.item() == pytest.approx(math.log(3), rel=1e-5)
    assert set(stats.scalars()) >= {"dropped_fraction", "tile_utilization", "load_imbalance", "capacity"}


def test_a_layer_forward_derives_no_stats_until_they_are_read():
    # the derived stats cost ~25 small kernels a layer forward; a forward launches none of them
    layer = MoELayer(8, 12, 4, 2, capacity_factor=1.0)
    _, aux = layer.forward_with_aux(torch.randn(10, 8))
    derived = [n for n in MoEStats.NAMES if n not in {f.name for f in dataclasses.fields(MoEStats)}]
    assert len(derived) == 8 and not set(derived) & set(vars(aux.stats))
    kept = aux.stats.tokens_per_expert.float()
    assert aux.stats.load_imbalance.item() == pytest.approx((kept.max() / kept.mean()).item())
    assert aux.stats.dropped_pairs.item() == (aux.stats.routed_per_expert.sum() - kept.sum()).item() > 0
    assert "load_imbalance" in vars(aux.stats)  # computed once, then kept


def test_model_helpers_sum_over_layers():
    model = torch.nn.Sequential(MoELayer(8, 12, 4, 2), torch.nn.Linear(8, 8), MoELayer(8, 12, 4, 1))
    assert moe_aux_loss(model).item() == 0.0
    model(torch.randn(5, 8))
    total = model[0].last_aux.loss + model[2].last_aux.loss
    assert moe_aux_loss(model).item() == pytest.approx(total.item())
    assert set(moe_stats(model)) == {"0", "2"}


def test_expert_bias_changes_selection_only():
    torch.manual_seed(1)
    layer = MoELayer(8, 12, 4, 1, expert_bias=True, bias_update_rate=10.0)
    x = torch.randn(32, 8)
    _, aux = layer.forward_with_aux(x)
    busiest = int(aux.stats.routed_per_expert.argmax())
    layer.router.update_expert_bias(aux.stats.routed_per_expert)
    assert layer.router.expert_bias[busiest] < 0
    route = layer.router(x)
    assert busiest not in route.experts_TK.reshape(-1).tolist()  # a bias of -10 deselects it
    # combine weights are the unbiased scores (renormalised over K=1 -> 1.0)
    assert torch.allclose(route.weights_TK, torch.ones_like(route.weights_TK))
    assert torch.allclose(route.priority_TK, route.scores_TE.gather(1, route.experts_TK))


@pytest.mark.parametrize("G, E, K, T, cf, Q", [(2, 8, 2, 32, 1.0, 1), (4, 8, 1, 20, 1.5, 2), (2, 4, 2, 16, None, 1),
                                               (8, 64, 8, 64, 1.25, 1), (2, 6, 3, 12, 0.5, 3), (4, 8, 1, 12, 1.0, 3),
                                               (4, 4, 2, 8, 4.0, 1), (2, 8, 2, 16, 16.0, 2)])
def test_max_received_rows_bounds_what_a_rank_receives(G, E, K, T, cf, Q):
    """The P2P buffers' bound against G source ranks' plans: random routing stays under it; routing
    that sends every pair to rank 0's experts reaches it when every expert there overflows."""
    bound = max_received_rows(T, E, K, cf, Q, G)
    L = E // G
    gen = torch.Generator().manual_seed(G * E + K)

    C = expert_capacity(T // Q, E, K, cf)

    def received(skewed: bool) -> torch.Tensor:
        rows = torch.zeros(G, dtype=torch.int64)
        for _ in range(G):
            if skewed:  # rank 0's L experts first, round robin (all of them when K > L), the rest after
                t = torch.arange(T)[:, None]
                own = (t * K + torch.arange(min(K, L))) % L
                experts = torch.cat([own, L + (t * K + torch.arange(K - own.shape[1])) % (E - L)], 1)
            else:
                experts = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
            plan = plan_routing(experts, torch.rand(T, K, generator=gen), E, C, "probs", Q)
            rows += plan.kept_per_expert_E.view(G, L).sum(-1)
        return rows

    for _ in range(3):
        assert int(received(False).max()) <= bound
    skewed = int(received(True)[0])
    assert skewed <= bound
    if cf is None:
        assert skewed == bound == G * T * K
    else:
        assert bound == min(G * T * K, E * min(Q * C, T))
        if K > L or (T // Q) * K // L >= C:  # every expert of rank 0 fills its cap in every group
            assert skewed == bound
    assert skewed > 0
