"""MoELayer: router → capacity → dispatch → grouped-GEMM experts → combine.

Legend: T tokens (all leading dims flattened), D model dim, F expert hidden dim, E experts,
K experts per token, P = T·K pairs, L experts on this rank, R rows for the local experts.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from moe.capacity import DROP_POLICIES, expert_capacity, plan_routing
from moe.dispatch import LocalDispatcher
from moe.experts import GroupedExperts
from moe.losses import load_balancing_loss, router_z_loss
from moe.mlp import ACTIVATIONS, DenseMLP
from moe.router import SCORE_FUNCS, Router
from moe.stats import MoEStats, compute_stats


@dataclass(frozen=True)
class MoEAux:
    """A forward's router losses and stats.

    load_balancing_loss, z_loss: () fp32, unscaled. loss: () the two with their coefficients,
    ready to add to the task loss. stats: :class:`MoEStats`.
    """

    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    loss: torch.Tensor
    stats: MoEStats


def _check_positive(**values):
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"MoELayer: {name} must be a positive int, got {value!r}")


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer: ``(..., D) -> (..., D)``.

    Args:
        dim: D, model width.
        hidden_dim: F, each expert's hidden width.
        num_experts: E, routed experts (over the whole expert-parallel group).
        top_k: K, experts per token (``1 <= K <= E``).
        capacity_factor: ``C = ceil(capacity_factor · T · K / E)`` pairs per expert and rank;
            ``None`` (default) is dropless. Must be > 0.
        drop_policy: over capacity, ``"probs"`` keeps an expert's highest-scoring pairs,
            ``"position"`` its earliest tokens. Dropped pairs contribute zero (the residual
            carries the token) and are counted in the stats.
        capacity_groups: split the tokens into this many equal contiguous groups and cap each
            separately (to reproduce N ranks' per-rank capacity in one process). Default 1.
        activation: ``"swiglu"`` (gate and up in one GEMM of width 2F) or ``"gelu"``.
        score_func: ``"softmax"`` or ``"sigmoid"`` router scores.
        renormalize: renormalise the K chosen scores to sum to 1 (default True).
        expert_bias: keep a selection-only bias for aux-loss-free balancing (see
            :meth:`Router.update_expert_bias` and :func:`update_expert_biases`).
        bias_update_rate: step of that bias rule (default 1e-3).
        num_shared_experts: dense experts every token goes through (default 0), fused into one
            MLP of width ``num_shared_experts · shared_hidden_dim``.
        shared_hidden_dim: hidden width of one shared expert (default F).
        aux_loss_coef: coefficient of the load-balancing loss in :attr:`MoEAux.loss` (0.01).
        z_loss_coef: coefficient of the router z-loss (0.001).
        dispatcher: how rows reach experts; default :class:`LocalDispatcher` (all experts here).
            An expert-parallel dispatcher from ``parallel`` makes this rank hold E / ep_size experts.
        check_finite: raise if the input holds NaN/Inf (costs one host sync per call).
        device, dtype: of the expert and shared weights (the router is always fp32).

    ``forward(x)`` returns the output and keeps the latest :class:`MoEAux` in ``self.last_aux``
    for :func:`moe_aux_loss` / :func:`moe_stats`; ``forward_with_aux(x)`` returns both.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        *,
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        capacity_groups: int = 1,
        activation: str = "swiglu",
        score_func: str = "softmax",
        renormalize: bool = True,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        num_shared_experts: int = 0,
        shared_hidden_dim: int | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        dispatcher=None,
        check_finite: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_positive(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts, top_k=top_k, capacity_groups=capacity_groups)
        if top_k > num_experts:
            raise ValueError(f"MoELayer: top_k={top_k} must be <= num_experts={num_experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoELayer: capacity_factor must be > 0 or None, got {capacity_factor!r}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"MoELayer: drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoELayer: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"MoELayer: score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"MoELayer: num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
        if shared_hidden_dim is not None:
            _check_positive(shared_hidden_dim=shared_hidden_dim)
        for name, coef in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if coef < 0:
                raise ValueError(f"MoELayer: {name} must be >= 0, got {coef}")
        self.dispatcher = LocalDispatcher() if dispatcher is None else dispatcher
        if num_experts % self.dispatcher.ep_size:
            raise ValueError(
                f"MoELayer: num_experts={num_experts} must be divisible by the expert-parallel size {self.dispatcher.ep_size}"
            )
        self.dim = dim
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.capacity_groups = capacity_groups
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.check_finite = check_finite
        self.num_local_experts = num_experts // self.dispatcher.ep_size
        self.router = Router(
            dim, num_experts, top_k, score_func=score_func, renormalize=renormalize,
            expert_bias=expert_bias, bias_update_rate=bias_update_rate, device=device,
        )
        self.experts = GroupedExperts(self.num_local_experts, dim, hidden_dim, activation, device=device, dtype=dtype)
        self.shared_experts = None
        if num_shared_experts:
            width = num_shared_experts * (shared_hidden_dim or hidden_dim)
            self.shared_experts = DenseMLP(dim, width, activation, device=device, dtype=dtype)
        self.last_aux: MoEAux | None = None

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoELayer input x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"MoELayer input x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"MoELayer input x must have last dim = dim = {self.dim}, got shape {tuple(x.shape)}")
        if self.check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("MoELayer input x contains NaN or Inf")

    def forward_with_aux(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        """x (..., D) float -> ((..., D) same dtype, MoEAux)."""
        self._check_input(x)
        x_TD = x.reshape(-1, self.dim)
        T, K = x_TD.shape[0], self.top_k
        if T % self.capacity_groups:
            raise ValueError(f"MoELayer: {T} tokens do not split into capacity_groups={self.capacity_groups}")

        route = self.router(x_TD)
        capacity = expert_capacity(T // self.capacity_groups, self.num_experts, K, self.capacity_factor)
        plan = plan_routing(route.experts_TK, route.priority_TK, self.num_experts, capacity, self.drop_policy, self.capacity_groups)

        rows_RD, offsets_S, meta = self.dispatcher.dispatch(x_TD, plan)
        y_RD = self.experts(rows_RD, offsets_S)
        # fp32 accumulation of the K weighted expert outputs; dropped pairs weigh zero
        w_TK = route.weights_TK * plan.kept_TK
        out_TD = self.dispatcher.combine(y_RD, meta, w_TK, x.dtype)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD).to(x.dtype)

        routed_E, prob_sum_E, num_tokens = self.dispatcher.reduce_aux_inputs(
            plan.routed_per_expert_E, self._normalized(route.scores_TE).sum(0), T
        )
        num_tokens = num_tokens.clamp_min(1)
        lb_loss = load_balancing_loss(routed_E, prob_sum_E, num_tokens, K)
        z_loss = router_z_loss(route.logits_TE)
        # one collective for the three counts; the GEMM tiles each rank's rows of an expert
        # separately (one row segment per source rank), so tiles are summed, not recomputed
        block_m = self.experts.row_tile_size(self.experts.compute_dtype(x_TD))
        tiles_E = (plan.kept_per_expert_E + block_m - 1) // block_m
        counts_3E = self.dispatcher.reduce_counts(torch.stack([plan.routed_per_expert_E, plan.kept_per_expert_E, tiles_E]))
        stats = compute_stats(counts_3E[0], counts_3E[1], route.scores_TE, capacity, block_m, counts_3E[2])
        aux = MoEAux(lb_loss, z_loss, self.aux_loss_coef * lb_loss + self.z_loss_coef * z_loss, stats)
        return out_TD.view(x.shape), aux

    @staticmethod
    def _normalized(scores_TE: torch.Tensor) -> torch.Tensor:
        # P_e of the balancing loss is a distribution over experts: softmax scores already are
        # one, sigmoid scores are normalised per token (DeepSeek-V3's sequence-wise loss).
        return scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.last_aux = self.forward_with_aux(x)
        return out


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of ``last_aux.loss`` (coefficients applied) over the model's MoE layers that ran."""
    losses = [m.last_aux.loss for m in moe_layers(model).values() if m.last_aux is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()


def moe_stats(model: nn.Module) -> dict[str, MoEStats]:
    """Latest stats of every MoE layer that ran, by module name."""
    return {name: m.last_aux.stats for name, m in moe_layers(model).items() if m.last_aux is not None}


def update_expert_biases(model: nn.Module) -> None:
    """Apply the aux-loss-free bias rule to every layer built with ``expert_bias=True``, from
    the routed counts of its latest forward (global over the expert-parallel group)."""
    for m in moe_layers(model).values():
        if m.router.expert_bias is not None and m.last_aux is not None:
            m.router.update_expert_bias(m.last_aux.stats.routed_per_expert)
