"""Top-k router, computed in fp32.

Legend: T tokens, D model dim, E experts, K experts per token (top-k).
"""

import typing
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from moe.kernels.causal_centre import causal_centre_reference, causal_centre_triton
from moe.kernels.router_mm import router_logits
from moe.kernels.router_topk import MAX_EXPERTS, MAX_TOP_K, router_topk, router_topk_reference

ScoreFunc = Literal["softmax", "sigmoid"]
SCORE_FUNCS = typing.get_args(ScoreFunc)
Centre = Literal["none", "causal"]
CENTRES = typing.get_args(Centre)
# the expert-bias rule's default step: DeepSeek-V3's 1e-3 on sigmoid scores; on softmax logits
# 3e-2, which ended the OLMoE-shaped benchmark's 300 steps at a worst layer of 1.6 / 1.6 / 2.2
# over three seeds against 2.1 / 2.2 / 2.6 for 1e-3 on the scores (bench/results/routing_health.md)
BIAS_UPDATE_RATE = {"sigmoid": 1e-3, "softmax": 3e-2}


@dataclass(frozen=True)
class RouterOutput:
    """What the router decided for T tokens. Every tensor is fp32 except the indices.

    logits_TE: raw router logits (the z-loss reads them).
    scores_TE: softmax probabilities, or sigmoid scores.
    experts_TK: (T, K) int64 chosen experts, distinct per token.
    priority_TK: (T, K) unbiased score of each chosen expert; the ``probs`` drop policy keeps
        an expert's highest-priority pairs.
    weights_TK: (T, K) combine weights: the priorities, renormalised over K when asked, times
        the routed scaling factor.
    lse_T: (T,) logsumexp of each token's logits (the z-loss reads it).
    entropy_T: (T,) entropy of each token's scores normalised to sum to 1 (a stat, no gradient).
    """

    logits_TE: torch.Tensor
    scores_TE: torch.Tensor
    experts_TK: torch.Tensor
    priority_TK: torch.Tensor
    weights_TK: torch.Tensor
    lse_T: torch.Tensor
    entropy_T: torch.Tensor


# a pytree node, so that module hooks see the tensors inside (FSDP2 unshards a module's parameters
# for its backward from hooks on the tensors of its output: without this, a sharded router's
# weight is gone when the backward of its logits needs it)
torch.utils._pytree.register_dataclass(RouterOutput)


def check_group_limit(num_experts: int, top_k: int, n_group: int, topk_group: int, prefix: str = "") -> None:
    """Raise ValueError, naming the field (after ``prefix``), unless group-limited routing can
    pick ``top_k`` experts: ``n_group`` and ``topk_group`` positive ints, ``n_group`` divides
    ``num_experts``, ``topk_group <= n_group`` and ``top_k <= topk_group · num_experts / n_group``
    (the experts of the kept groups)."""
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{prefix}{name} must be a positive int, got {value!r}")
    if num_experts % n_group:
        raise ValueError(f"{prefix}n_group={n_group} must divide num_experts={num_experts} (equal expert groups)")
    if topk_group > n_group:
        raise ValueError(f"{prefix}topk_group={topk_group} must be <= n_group={n_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(
            f"{prefix}topk_group={topk_group} keeps {topk_group} of n_group={n_group} groups of "
            f"{num_experts // n_group} experts: {topk_group * (num_experts // n_group)} experts, fewer than top_k={top_k}"
        )


def causal_centre(logits_TE: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """Each token's logits minus the mean of the earlier tokens' of its sequence (sequences of
    ``seq_len`` consecutive tokens; a sequence's first token unchanged). fp32 in, fp32 out: the
    scan kernels of moe/kernels/causal_centre.py on CUDA, the PyTorch formula elsewhere."""
    T, E = logits_TE.shape
    if seq_len is None or seq_len < 1 or T % seq_len:
        raise ValueError(f"Router(centre='causal') needs the tokens as whole sequences: seq_len={seq_len!r} "
                         f"with {T} tokens")
    if logits_TE.is_cuda and logits_TE.dtype == torch.float32:
        return causal_centre_triton(logits_TE, seq_len)
    return causal_centre_reference(logits_TE, seq_len)


class Router(nn.Module):
    """``logits = x @ Wrᵀ`` in fp32 (autocast off), scores, top-k.

    Args:
        dim: D. num_experts: E. top_k: K.
        score_func: ``"softmax"`` (probabilities over E) or ``"sigmoid"`` (independent scores,
            DeepSeek-V3 style).
        renormalize: divide the K chosen scores by their sum, so the combine weights sum to 1.
        expert_bias: keep a per-expert bias (a buffer, not a parameter) for the top-k *selection
            only*; the combine weights and the losses never see it. It is moved by
            :meth:`update_expert_bias` (aux-loss-free load balancing). With sigmoid scores it is
            added to the scores, as DeepSeek-V3 does; with softmax scores to the logits, so a token
            picks by ``p_e · exp(b_e)``: softmax scores average 1/E, and a bias added to them
            outgrows them at a rate that suits sigmoid scores (E 64, rate 1e-2: every token picked
            the same experts by bias alone, bench/results/routing_health.md), while a logit bias
            acts in proportion whatever E.
        bias_update_rate: step size of that rule, in the units the bias is added to; None: the
            default of the score function (:data:`BIAS_UPDATE_RATE`).
        n_group, topk_group: group-limited selection (DeepSeek-V3's ``noaux_tc``): the E experts
            form ``n_group`` equal contiguous groups (``[g·E/n_group, (g+1)·E/n_group)``); a group's
            score is the sum of its two highest selection scores (the scores, or with an expert
            bias the biased scores or logits; its one score when a group holds one expert); the
            experts of all but the ``topk_group`` best groups are excluded (-inf) before the
            top-K. Selection only: the combine weights are the chosen experts' unbiased scores as
            without groups.
            ``n_group=1`` (or ``topk_group == n_group``) keeps every expert and runs no extra op.
        routed_scaling_factor: multiplies the combine weights (after the renormalisation), as
            DeepSeek-V3's ``routed_scaling_factor``; 1.0 runs no extra op.
        centre: ``"causal"``: a token's logits minus the mean of the logits of the earlier tokens of
            its sequence (the first token's unchanged), before the scores: the same as routing the
            input minus the mean of the earlier inputs, since the logits are linear in it, at E
            instead of D columns. Why: a causal attention writes averages over each prefix into
            the residual stream, a component common to the sequence's tokens; a router that reads
            it sends them all to the same experts. In the OLMoE-shaped benchmark the part of the
            router input common to the batch was 95-100 % of its mean square at step 11; with
            this centring, the embedding at std 1.0, an LM-head bias and the expert-bias rule,
            every layer's load max/mean stayed at 1.75-1.93 or below from step 1 over 300 steps
            (6 layers, 8 sequences a step, three seeds), where the plain router reached 8.0
            (bench/results/routing_health.md). It needs the sequence length (``seq_len`` of
            :meth:`forward`). A router with it is not a plain linear router: no Hugging Face
            architecture can write it.
        force_balance: benchmark only (Megatron's ``moe_router_force_load_balancing``): the K
            experts of each token are the top-K of uniform random scores, drawn from the device's
            default generator, instead of the router's; the combine weights are still the chosen
            experts' router scores, so the router trains and every kernel sees the shapes of
            perfectly balanced routing.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        renormalize: bool = True,
        expert_bias: bool = False,
        bias_update_rate: float | None = None,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        centre: Centre = "none",
        force_balance: bool = False,
        device=None,
    ):
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if centre not in CENTRES:
            raise ValueError(f"centre must be one of {CENTRES}, got {centre!r}")
        if bias_update_rate is None:
            bias_update_rate = BIAS_UPDATE_RATE[score_func]
        if bias_update_rate < 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {bias_update_rate}")
        check_group_limit(num_experts, top_k, n_group, topk_group)
        if not routed_scaling_factor > 0:  # NaN included
            raise ValueError(f"routed_scaling_factor must be > 0, got {routed_scaling_factor}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.renormalize = renormalize
        self.bias_update_rate = bias_update_rate
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.centre = centre
        self.force_balance = force_balance
        # The router stays fp32 whatever the model's dtype: top-k on bf16 logits flips
        # near-ties and the softmax of bf16 logits loses the small probabilities.
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=torch.float32))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x_TD: torch.Tensor, seq_len: int | None = None) -> RouterOutput:
        """``x_TD``: T tokens, ``seq_len`` consecutive ones per sequence (needed by ``centre``)."""
        logits_TE = router_logits(x_TD, self.weight)
        if self.centre == "causal":
            logits_TE = causal_centre(logits_TE, seq_len)
        # a model cast to bf16 casts the bias buffer too: the selection stays fp32 (as the sum did)
        bias_E = None if self.expert_bias is None else self.expert_bias.float()
        args = (logits_TE, bias_E, self.top_k, self.score_func == "sigmoid", self.renormalize,
                self.routed_scaling_factor)
        if self.force_balance:
            route = router_topk_reference(*args, limit=torch.rand_like)
        elif self.topk_group < self.n_group:
            route = router_topk_reference(*args, limit=self._limit_to_groups)
        elif logits_TE.is_cuda and logits_TE.shape[1] <= MAX_EXPERTS and self.top_k <= MAX_TOP_K:
            route = router_topk(*args)  # one kernel each way: see moe/kernels/router_topk.py
        else:
            route = router_topk_reference(*args)
        return RouterOutput(logits_TE, *route)

    def _limit_to_groups(self, select_TE: torch.Tensor) -> torch.Tensor:
        """The selection scores with the experts of all but the ``topk_group`` best of the
        ``n_group`` groups (G groups of S experts) set to -inf."""
        T, G = select_TE.shape[0], self.n_group
        select_TGS = select_TE.view(T, G, self.num_experts // G)
        # DeepSeek-V3's group score: the sum of the group's top-2 selection scores (top-1 when
        # a group holds a single expert, where top-2 does not exist)
        group_TG = select_TGS.topk(min(2, select_TGS.shape[-1]), dim=-1).values.sum(dim=-1)
        keep_TG = group_TG.topk(self.topk_group, dim=-1, sorted=False).indices
        drop_TG = torch.ones_like(group_TG, dtype=torch.bool).scatter_(1, keep_TG, False)
        # -inf, not HF's 0.0: a biased score can be negative, and a 0 would let an expert of a
        # dropped group outrank it (DeepSeek's own inference code masks with -inf)
        return select_TGS.masked_fill(drop_TG.unsqueeze(-1), float("-inf")).flatten(1)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Aux-loss-free balancing rule (DeepSeek-V3): ``b_e += rate · sign(mean load − load_e)``.

        Call it once per optimizer step, outside autograd, with the tokens routed to each
        expert over the whole batch (the global count under data/expert parallelism, so every
        rank applies the same update). Overloaded experts become less likely to be chosen.
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs a router built with expert_bias=True")
        load_E = tokens_per_expert_E.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E)
