"""MoELayer: router → capacity → dispatch → grouped-GEMM experts → combine.

Legend: T tokens (all leading dims flattened), D model dim, F expert hidden dim, E experts,
K experts per token (top-k), P = T·K pairs, L experts on this rank, R rows for the local experts.
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from moe.capacity import expert_capacity, plan_routing
from moe.config import MoEConfig, check_positive_int
from moe.dispatch import Dispatcher, LocalDispatcher
from moe.experts import GroupedExperts
from moe.kernels.router_loss import router_losses
from moe.mlp import DenseMLP
from moe.router import Router
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


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer: ``(..., D) -> (..., D)``.

    The options are one :class:`MoEConfig` (its docstring says what each does), given either
    as ``config=`` or, for convenience, as arguments: ``hidden_dim``, ``num_experts`` (both
    required then) and ``top_k`` by position or keyword, any other field of
    :class:`MoEConfig` by keyword (``capacity_factor=1.25``, ``activation="gelu"``, ...), the rest
    at MoEConfig's defaults. Not both: options beside ``config=`` raise TypeError. The layer keeps
    its own validated copy as ``self.config`` (later edits of the caller's config change nothing).

    Args besides the options:
        dim: D, model width.
        dispatcher: how rows reach experts; default :class:`LocalDispatcher` (all experts here).
            An expert-parallel dispatcher from ``parallel`` makes this rank hold E / ep_size experts.
        check_finite: raise if the input holds NaN/Inf (costs one host sync per call).
        device, dtype: of the expert and shared weights (the router is always fp32).

    ``forward(x)`` returns the output and keeps the latest :class:`MoEAux` in ``self.last_aux``
    for :func:`moe_aux_loss` / :func:`moe_stats`; ``forward_with_aux(x)`` returns both.

    Initialisation does not depend on the expert-parallel size: the router, the shared experts and
    their gate are drawn from the global RNG (the same amount on every rank), and the routed
    experts from one generator per *global* expert, seeded from one value drawn from the global
    CPU RNG here (:class:`GroupedExperts`' ``init_seed``). So with the same ``torch.manual_seed(s)``
    on every rank (``parallel.init_distributed(seed=s)``), a model built under EP on W ranks holds
    exactly the one-process model's dense and router weights, and rank r exactly its experts
    ``[r·L, (r+1)·L)``.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        *,
        config: MoEConfig | None = None,
        dispatcher: Dispatcher | None = None,
        check_finite: bool = False,
        device=None,
        dtype=None,
        **options,
    ):
        super().__init__()
        given = {k: v for k, v in (("hidden_dim", hidden_dim), ("num_experts", num_experts), ("top_k", top_k)) if v is not None}
        given.update(options)
        if config is not None and given:
            raise TypeError(f"MoELayer: options go in config= or as arguments, not both (got config= and {', '.join(given)})")
        if config is None:
            missing = [k for k in ("hidden_dim", "num_experts") if k not in given]
            if missing:
                raise TypeError(f"MoELayer: missing {' and '.join(missing)} (or pass config=MoEConfig(...))")
            config = MoEConfig(**given)
        check_positive_int("MoELayer: dim", dim)
        self.config = cfg = dataclasses.replace(config).validate("MoELayer: ")
        self.dispatcher = LocalDispatcher() if dispatcher is None else dispatcher
        if cfg.num_experts % self.dispatcher.ep_size:
            raise ValueError(
                f"MoELayer: num_experts={cfg.num_experts} must be divisible by the expert-parallel size {self.dispatcher.ep_size}"
            )
        self.dim = dim
        self.check_finite = check_finite
        self.num_local_experts = cfg.num_experts // self.dispatcher.ep_size
        self.router = Router(
            dim, cfg.num_experts, cfg.top_k, score_func=cfg.score_func, renormalize=cfg.renormalize,
            expert_bias=cfg.expert_bias, bias_update_rate=cfg.bias_update_rate, n_group=cfg.n_group,
            topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
            centre=cfg.router_centre, force_balance=cfg.force_balance, device=device,
        )
        # One draw from the global CPU RNG, the same whatever the EP size or device: global expert
        # e is initialised from its own generator seeded init_seed + e, so with one
        # torch.manual_seed on every rank, rank r's experts are the one-process layer's experts
        # [r·L, (r+1)·L) and the RNG a layer consumes (router, this draw, shared experts) does not
        # depend on L.
        init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.experts = GroupedExperts(
            self.num_local_experts, dim, cfg.hidden_dim, cfg.activation, device=device, dtype=dtype,
            init_seed=init_seed, first_expert=self.dispatcher.ep_rank * self.num_local_experts,
        )
        self.shared_experts = None
        if cfg.num_shared_experts:
            width = cfg.num_shared_experts * (cfg.shared_hidden_dim or cfg.hidden_dim)
            self.shared_experts = DenseMLP(dim, width, cfg.activation, device=device, dtype=dtype)
        # Qwen2-MoE's per-token gate of the shared experts: sigmoid(x · w_g), w_g = weight.T (D, 1)
        self.shared_expert_gate = None
        if cfg.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False, device=device, dtype=dtype)
        self.last_aux: MoEAux | None = None

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoELayer input x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"MoELayer input x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"MoELayer input x must have last dim = dim = {self.dim}, got shape {tuple(x.shape)}")
        if self.config.router_centre != "none" and x.dim() < 3:
            raise ValueError(f"MoELayer with router_centre={self.config.router_centre!r} centres over each sequence: "
                             f"x must be (..., S, D), got shape {tuple(x.shape)}")
        if self.check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("MoELayer input x contains NaN or Inf")

    def forward_with_aux(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        """x (..., D) float -> ((..., D) same dtype, MoEAux)."""
        self._check_input(x)
        cfg = self.config
        x_TD = x.reshape(-1, self.dim)
        T, K = x_TD.shape[0], cfg.top_k
        if T % cfg.capacity_groups:
            raise ValueError(f"MoELayer: {T} tokens do not split into capacity_groups={cfg.capacity_groups}")

        route = self.router(x_TD, seq_len=x.shape[-2] if x.dim() >= 3 else None)
        capacity = expert_capacity(T // cfg.capacity_groups, cfg.num_experts, K, cfg.capacity_factor)
        plan = plan_routing(route.experts_TK, route.priority_TK, cfg.num_experts, capacity, cfg.drop_policy, cfg.capacity_groups)

        # dispatch → experts → combine (fp32 accumulation of the K weighted expert outputs;
        # dropped pairs weigh zero), pipelined in chunks by a dispatcher that overlaps
        w_TK = route.weights_TK if capacity is None else route.weights_TK * plan.kept_TK  # dropless: all kept
        out_TD = self.dispatcher.run_experts(self.experts, x_TD, plan, route.experts_TK, w_TK, x.dtype,
                                             row_dtype=self.experts.compute_dtype(x_TD))
        if self.shared_experts is not None:
            shared_TD = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = shared_TD * torch.sigmoid(self.shared_expert_gate(x_TD))
            out_TD = out_TD + shared_TD.to(x.dtype)

        # the loss's inputs over the world and both counts over the EP group in one call: one
        # collective a layer where the two groups are the same ranks (every collective is a point
        # where the ranks wait for each other: see ExpertParallelDispatcher.reduce_aux_and_counts)
        routed_E, prob_sum_E, num_tokens, counts_2E = self.dispatcher.reduce_aux_and_counts(
            plan.routed_per_expert_E, plan.kept_per_expert_E, self._normalized(route.scores_TE).sum(0), T
        )
        lb_loss, z_loss, loss, entropy = router_losses(routed_E, prob_sum_E, num_tokens, route.lse_T,
                                                       route.entropy_T, K, cfg.aux_loss_coef, cfg.z_loss_coef)
        # the GEMM tiles an expert's rows from every source rank as one segment (the dispatchers
        # hand them over expert-major), so its tiles follow from the summed count (a lower bound
        # under overlap_chunks > 1: each chunk is its own GEMM)
        block_m = self.experts.row_tile_size(self.experts.compute_dtype(x_TD))
        stats = compute_stats(counts_2E[0], counts_2E[1], None, capacity, block_m, entropy=entropy)
        aux = MoEAux(lb_loss, z_loss, loss, stats)
        return out_TD.view(x.shape), aux

    def _normalized(self, scores_TE: torch.Tensor) -> torch.Tensor:
        # P_e of the balancing loss is a distribution over experts: softmax scores already are
        # one (taken as they are: three launches fewer a forward), sigmoid scores are normalised
        # per token (DeepSeek-V3's sequence-wise loss).
        if self.config.score_func == "softmax":
            return scores_TE
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
