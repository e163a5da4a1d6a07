"""The options of an MoE layer, written once: :class:`MoEConfig`.

:class:`moe.MoELayer` takes one (``config=``) or builds one from its keyword arguments, and the
training config embeds it as its ``moe`` section, so each option's type, choices, default and
check live here and nowhere else. Choices are ``Literal`` annotations (the training config's
parser reads them from there); their lists belong to the modules that implement them.
"""

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from moe.capacity import DropPolicy
from moe.mlp import Activation
from moe.router import Centre, ScoreFunc, check_group_limit


def check_positive_int(name: str, value) -> None:
    """Raise ValueError ``"<name> must be a positive int"`` unless ``value`` is an int > 0 (a
    bool is not an int here: ``True`` experts is a mistake, not 1)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class MoEConfig:
    """What an MoE layer computes (the model width and where its weights live are the layer's).

    num_experts: E, routed experts (over the whole expert-parallel group).
    top_k: K, experts per token (``1 <= K <= E``).
    hidden_dim: F, each expert's hidden width.
    every_n_layers: a model option: block i is an MoE block when ``(i + 1) % every_n_layers == 0``
        and ``i >= first_dense_layers`` (:meth:`is_moe_layer`), a dense one otherwise.
    first_dense_layers: a model option: the first this many blocks are dense (DeepSeek-V3's
        ``first_k_dense_replace``).
    capacity_factor: ``C = ceil(capacity_factor · T · K / E)`` pairs per expert and rank; ``None``
        is dropless. Must be > 0.
    drop_policy: over capacity, ``"probs"`` keeps an expert's highest-scoring pairs,
        ``"position"`` its earliest tokens. Dropped pairs contribute zero (the residual carries
        the token) and are counted in the stats.
    capacity_groups: split the tokens into this many equal contiguous groups and cap each
        separately (to reproduce several ranks' per-rank capacity in one process).
    activation: ``"swiglu"`` (gate and up in one GEMM of width 2F) or ``"gelu"``.
    score_func: ``"softmax"`` or ``"sigmoid"`` router scores.
    renormalize: renormalise the K chosen scores to sum to 1.
    num_shared_experts: dense experts every token goes through, fused into one MLP of width
        ``num_shared_experts · shared_hidden_dim``.
    shared_hidden_dim: hidden width of one shared expert; ``None`` is F.
    aux_loss_coef: coefficient of the load-balancing loss in :attr:`moe.MoEAux.loss`.
    z_loss_coef: coefficient of the router z-loss.
    expert_bias: keep a selection-only bias for aux-loss-free balancing (see
        :meth:`moe.Router.update_expert_bias` and :func:`moe.update_expert_biases`).
    bias_update_rate: step of that bias rule, in the units the bias is added to (sigmoid: the
        scores; softmax: the logits); None: the score function's default
        (:data:`moe.router.BIAS_UPDATE_RATE`: 1e-3 sigmoid, 3e-2 softmax).
    n_group, topk_group: group-limited top-k (DeepSeek-V3): the E experts form ``n_group`` equal
        contiguous groups, a group scores the sum of its two best selection scores (with the
        expert bias when on), and the top-K is taken among the experts of the ``topk_group`` best
        groups only. Selection only; ``n_group=1`` is plain top-k. See :class:`moe.Router`.
    routed_scaling_factor: the combine weights (after renormalisation) are multiplied by it
        (DeepSeek-V3's ``routed_scaling_factor``).
    shared_expert_gate: the shared experts' output is multiplied per token by
        ``sigmoid(x · w_g)`` (one ``Linear(D, 1)`` without bias, ``layer.shared_expert_gate``)
        before it is added (Qwen2-MoE). Needs ``num_shared_experts > 0``.
    router_centre: ``"causal"``: a token's router logits minus the mean of those of the earlier
        tokens of its sequence (see :class:`moe.Router`); the layer's input must then be
        ``(..., S, D)``.
    force_balance: benchmark only: the top-k selection is uniform random (see :class:`moe.Router`).
    """

    # each field's metadata["help"] is its one-line meaning (the training script's --help)
    num_experts: int = field(default=8, metadata={"help": "E, routed experts (over the whole expert-parallel group)"})
    top_k: int = field(default=2, metadata={"help": "K, experts per token, 1 <= K <= E"})
    hidden_dim: int = field(default=256, metadata={"help": "F, hidden width of each expert"})
    every_n_layers: int = field(default=1, metadata={
        "help": "block i is an MoE block when (i + 1) % every_n_layers == 0 (and i >= first_dense_layers), "
                "a dense one otherwise"})
    first_dense_layers: int = field(default=0, metadata={
        "help": "the first this many blocks are dense (DeepSeek-V3's first_k_dense_replace)"})
    capacity_factor: float | None = field(default=None, metadata={
        "help": "C = ceil(capacity_factor · T · K / E) pairs per expert and rank (T: this rank's tokens); "
                "none: dropless; > 0. C is a cap, nothing is padded to it"})
    drop_policy: DropPolicy = field(default="probs", metadata={
        "help": "over capacity: probs keeps an expert's highest-scoring (token, slot) pairs (ties: earlier token), "
                "position its earliest tokens; dropped pairs contribute zero and are counted"})
    capacity_groups: int = field(default=1, metadata={
        "help": "cap each of this many equal contiguous token groups separately: one process with N drops "
                "exactly what N data-parallel ranks drop"})
    activation: Activation = field(default="swiglu", metadata={
        "help": "expert MLP: swiglu (gate and up in one GEMM of width 2F) or gelu"})
    score_func: ScoreFunc = field(default="softmax", metadata={"help": "router scores: softmax or sigmoid"})
    renormalize: bool = field(default=True, metadata={"help": "renormalise the K chosen scores to sum to 1"})
    num_shared_experts: int = field(default=0, metadata={
        "help": "dense experts every token goes through, fused into one MLP of width num_shared_experts · "
                "shared_hidden_dim"})
    shared_hidden_dim: int | None = field(default=None, metadata={"help": "hidden width of one shared expert; none: F"})
    aux_loss_coef: float = field(default=0.01, metadata={
        "help": "coefficient of the Switch load-balancing loss E · Σ_e f_e · P_e"})
    z_loss_coef: float = field(default=0.001, metadata={
        "help": "coefficient of the router z-loss mean(logsumexp(logits)²)"})
    expert_bias: bool = field(default=False, metadata={
        "help": "a per-expert bias for selection only (aux-loss-free balancing, DeepSeek-V3), added to the scores "
                "(sigmoid) or to the logits (softmax: selection by p_e · exp(b_e), since 2026-11-24; before, to the "
                "probabilities): b_e += rate · sign(mean load − load_e) once per step"})
    bias_update_rate: float | None = field(default=None, metadata={
        "help": "the rate of the expert_bias rule, in the units the bias is added to; none: 1e-3 with sigmoid scores "
                "(DeepSeek-V3), 3e-2 with softmax logits (the best of those measured, bench/results/routing_health.md)"})
    n_group: int = field(default=1, metadata={
        "help": "group-limited routing (DeepSeek-V3): the experts form n_group equal contiguous groups, each scored by "
                "the sum of its top-2 selection scores (bias included); 1: plain top-k"})
    topk_group: int = field(default=1, metadata={
        "help": "the top_k experts are chosen among the experts of the topk_group best groups only, "
                "1 <= topk_group <= n_group, top_k <= topk_group · num_experts / n_group"})
    routed_scaling_factor: float = field(default=1.0, metadata={
        "help": "multiplies the routed experts' combine weights (after renormalisation), DeepSeek-V3 style; > 0"})
    shared_expert_gate: bool = field(default=False, metadata={
        "help": "multiply the shared experts' output by sigmoid(x · w_g) per token, w_g a (dim, 1) weight "
                "(Qwen2-MoE); needs num_shared_experts > 0"})
    router_centre: Centre = field(default="none", metadata={
        "help": "causal: a token's router logits minus the mean of the logits of its sequence's earlier tokens, "
                "which removes the component a causal attention's prefix averages give every token of a sequence "
                "(a component that, left in, sent every token to the same experts: bench/results/routing_health.md); "
                "not exportable to a Hugging Face architecture; none: plain logits"})
    force_balance: bool = field(default=False, metadata={
        "help": "BENCHMARK ONLY (Megatron's force load balancing): each token's top_k experts are drawn uniformly "
                "at random instead of by the router, so every expert gets about T·K/E pairs whatever the model "
                "learned; the combine weights and losses still come from the router. For speed comparisons "
                "that must not depend on the routing; never for a model you want to use"})

    def validate(self, prefix: str = "MoEConfig: ") -> "MoEConfig":
        """Raise ValueError unless every option is in range; return self.

        Each message is ``prefix`` + the offending field's name + the problem, so the caller
        says where the options came from (``"MoELayer: "``, the training config's ``"moe."``).
        """
        for name in ("num_experts", "top_k", "hidden_dim", "every_n_layers", "capacity_groups"):
            check_positive_int(prefix + name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"{prefix}top_k={self.top_k} must be <= num_experts={self.num_experts}")
        hints = typing.get_type_hints(MoEConfig)
        for f in dataclasses.fields(self):
            value, tp = getattr(self, f.name), hints[f.name]
            allowed = typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None
            if allowed and value not in allowed:
                raise ValueError(f"{prefix}{f.name} must be one of {allowed}, got {value!r}")
            # NaN passes every `< 0` check below (nan < 0 is False) and capacity_factor=inf
            # overflowed only in the first forward (issue #18); no float option means either
            if float in (tp, *typing.get_args(tp)) and value is not None and not math.isfinite(value):
                raise ValueError(f"{prefix}{f.name} must be a finite number, got {value!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"{prefix}capacity_factor must be > 0 or None, got {self.capacity_factor!r}")
        for name in ("num_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{prefix}{name} must be an int >= 0, got {value!r}")
        if self.shared_hidden_dim is not None:
            check_positive_int(prefix + "shared_hidden_dim", self.shared_hidden_dim)
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{prefix}{name} must be >= 0, got {getattr(self, name)}")
        check_group_limit(self.num_experts, self.top_k, self.n_group, self.topk_group, prefix)
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"{prefix}routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError(f"{prefix}shared_expert_gate=True gates the shared experts' output: it needs "
                             f"num_shared_experts > 0, got num_shared_experts={self.num_shared_experts}")
        return self

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` (0-based) of a model is an MoE block: every
        ``every_n_layers``-th, counting from 1, so the last of each run of n, after the first
        ``first_dense_layers``."""
        return layer_idx >= self.first_dense_layers and (layer_idx + 1) % self.every_n_layers == 0
