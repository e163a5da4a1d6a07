"""Dispatchers: move routed rows to their experts and back.

Legend: T tokens, D model dim, K experts per token (top-k), P = T·K pairs, E experts, L experts
on this rank, R rows for the local experts, J row segments.

Model code never talks to the network: ``MoELayer`` hands the rows to a :class:`Dispatcher`,
whose abstract methods are the whole contract. A dispatcher keeps no state between ``dispatch()``
and ``combine()``: everything ``combine()`` needs travels in the frozen :class:`DispatchMeta`
that ``dispatch()`` returns, so any number of layers can be in flight at once.
:class:`LocalDispatcher` is the one-process case; the expert-parallel ones are in ``parallel/``.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernel_floor import check_pair_weights
from moe.capacity import RoutingPlan
from moe.kernels.combine import gather_rows, sum_combine, weighted_combine


def check_combine_weights(name: str, w_TK, plan: RoutingPlan) -> None:
    """``dispatch``'s w_TK must be the (T, K) fp32 combine weights of the plan's pairs."""
    if not isinstance(w_TK, torch.Tensor):
        raise TypeError(f"{name}: w_TK must be the (T, K) fp32 combine weights, got {type(w_TK).__name__}")
    check_pair_weights(name, w_TK, *plan.kept_TK.shape)


@dataclass(frozen=True)
class DispatchMeta:
    """Base of what ``combine`` needs from ``dispatch``; each dispatcher subclasses it with its
    own fields. Frozen: a dispatch's metadata is read by its combine and by both backwards, so
    nothing may change it in between."""


class Dispatcher(ABC):
    """How ``MoELayer`` moves the rows of its (token, slot) pairs to the experts and back."""

    @property
    @abstractmethod
    def ep_size(self) -> int:
        """Ranks of the expert-parallel group; rank r holds experts ``[r·L, (r+1)·L)``, L = E / ep_size."""

    @property
    @abstractmethod
    def ep_rank(self) -> int:
        """This process's rank in the expert-parallel group."""

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan, w_TK: torch.Tensor, row_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DispatchMeta]:
        """x_TD (T, D), the routing plan and the combine weights w_TK (T, K) fp32 (zero for dropped
        pairs) -> (rows_RD, offsets_J, w_R, meta).

        rows_RD (R, D): the rows for the local experts in J segments, in ``row_dtype`` (default
        x's); offsets_J (J,) int32: the cumulative end of each segment (what the grouped GEMM
        takes). J is a multiple of L and segment s belongs to local expert ``s % L`` (J = L: rows
        sorted by expert). Rows past ``offsets_J[-1]`` are padding, which the grouped GEMM writes
        as zeros. w_R (R,) fp32: each row's combine weight, which the experts apply to their
        output (``moe.kernels.grouped_mlp``'s ``w_R``; differentiable, its gradient reaches
        w_TK); None when a dispatcher's ``combine`` applies the weights itself (a third party's:
        every dispatcher of this library returns w_R). The backward sums
        each token's K row gradients in fp32 into x's dtype.

        Why the experts weight: the weights' gradient then comes from the expert MLP's backward,
        which recomputes the activation anyway, and no (R, D) output rows are kept for it
        (measured, H100, OLMoE-shaped layer, T 16k, top-8, bench/moe_layer.py --profile OLMoE:
        32 KiB a token fewer saved bytes; the combine's backward went from 0.42 to 0.22 ms, the
        SwiGLU backward pass that now makes the weights' gradient stayed at 0.56 ms); and an
        expert-parallel combine can sum a token's rows on the experts' rank before sending them
        back (:mod:`parallel.dispatcher`).

        ``row_dtype``: the MoE layer passes its experts' compute dtype. Under autocast the layer's
        input is fp32 (the RMSNorm before it runs in fp32), the experts compute in bf16: rows
        packed in fp32 would be cast by the experts anyway, after twice the bytes crossed the
        network and the memory (measured, 6 OLMoE-shaped layers on an H100: 12 ms of a 156 ms
        step in the fp32 → bf16 casts of the rows and their gradients).
        """

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y_RD (R, D) expert outputs in dispatch order, weighted by the experts with ``dispatch``'s
        w_R (unless that was None) -> out_TD (T, D): ``Σ_k (w[t, k] ·) y[row of (t, k)]``
        accumulated in fp32, cast to ``out_dtype`` (default y's); dropped pairs contribute zero."""

    def run_experts(self, experts, x_TD: torch.Tensor, plan: RoutingPlan, experts_TK: torch.Tensor,
                    w_TK: torch.Tensor, out_dtype: torch.dtype | None = None,
                    row_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The layer's routed path: :meth:`dispatch` (rows in ``row_dtype``),
        ``experts(rows_RD, offsets_J, w_R) -> y_RD``, :meth:`combine`; x_TD (T, D), the plan and its
        experts_TK (T, K), w_TK (T, K) fp32 combine weights (zero for dropped pairs) -> out_TD (T, D).
        The three steps in order here; a dispatcher that overlaps its exchanges with the experts
        (:class:`parallel.ExpertParallelDispatcher` with ``overlap_chunks``) overrides it.
        """
        rows_RD, offsets_J, w_R, meta = self.dispatch(x_TD, plan, w_TK, row_dtype)
        return self.combine(experts(rows_RD, offsets_J, w_R), meta, out_dtype)

    @abstractmethod
    def reduce_aux_inputs(self, routed_E: torch.Tensor, prob_sum_E: torch.Tensor,
                          num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The load-balancing loss's inputs summed over every rank that holds part of the batch,
        so the loss equals the one-process loss on the concatenated batch.

        routed_E (E,) int64 pairs routed per expert, prob_sum_E (E,) fp32 router probabilities
        summed over the tokens (differentiable), num_tokens T -> (routed_E, prob_sum_E,
        num_tokens_0d): the token count a 0-d tensor of prob_sum_E's dtype, whatever the
        dispatcher, made with no host sync. An all-reduced count lives on prob_sum_E's device;
        a count known on the host is a CPU tensor (see :meth:`LocalDispatcher.reduce_aux_inputs`).
        """

    @abstractmethod
    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(..., E) per-expert counts summed over the expert-parallel group (no gradient): the
        rows each rank's grouped GEMM really processes, and the global load the user watches."""

    def reduce_aux_and_counts(self, routed_E: torch.Tensor, kept_E: torch.Tensor, prob_sum_E: torch.Tensor,
                              num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both reductions a layer's forward makes: routed_E, kept_E (E,) int64 pairs routed to and
        kept by each expert, prob_sum_E, num_tokens -> (routed_E, prob_sum_E, num_tokens_0d) of
        :meth:`reduce_aux_inputs` and counts_2E, :meth:`reduce_counts` of the stacked
        [routed_E, kept_E].

        The two calls here, so a dispatcher need only implement them; one whose two groups hold
        the same ranks can sum both in one collective
        (:meth:`parallel.ExpertParallelDispatcher.reduce_aux_and_counts`).
        """
        routed, prob_sum, num_tokens_0d = self.reduce_aux_inputs(routed_E, prob_sum_E, num_tokens)
        return routed, prob_sum, num_tokens_0d, self.reduce_counts(torch.stack([routed_E, kept_E]))


@dataclass(frozen=True)
class LocalDispatchMeta(DispatchMeta):
    """order_P: (P,) packing order of the pairs (kept first, by expert); num_tokens: T; top_k: K."""

    order_P: torch.Tensor
    num_tokens: int
    top_k: int


class _GatherRowsFn(torch.autograd.Function):
    """x_TD (T, D) -> rows_RD (P, D) ``x[order_P // K]`` in ``row_dtype``. Backward: each
    token's kept rows' gradients summed in fp32 into x's dtype by the combine's kernel (weights:
    1 kept, 0 dropped), deterministic; ``index_select``'s own backward adds them with atomics,
    in the rows' dtype."""

    @staticmethod
    def forward(ctx, x_TD, order_P, kept_TK, row_dtype):
        ctx.save_for_backward(order_P, kept_TK)
        ctx.x_dtype = x_TD.dtype
        return gather_rows(x_TD, order_P, kept_TK.shape[1], row_dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        order_P, kept_TK = ctx.saved_tensors
        return weighted_combine(grad_RD, order_P, kept_TK.to(torch.float32), ctx.x_dtype), None, None, None


class LocalDispatcher(Dispatcher):
    """All experts on this process: dispatch is a gather, combine the sum of each token's rows
    (weighted by the experts).

    Every pair (dropped ones too) is packed, dropped pairs last, so shapes never depend on the
    routing and nothing waits on the host; the grouped GEMM writes zeros for rows past the last
    offset, which is what a dropped pair contributes.
    """

    ep_size = 1
    ep_rank = 0

    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan, w_TK: torch.Tensor, row_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LocalDispatchMeta]:
        check_combine_weights("LocalDispatcher.dispatch", w_TK, plan)
        T, K = plan.kept_TK.shape
        rows_RD = _GatherRowsFn.apply(x_TD, plan.order_P, plan.kept_TK, row_dtype or x_TD.dtype)
        offsets_J = torch.cumsum(plan.kept_per_expert_E, 0).to(torch.int32)
        w_R = w_TK.reshape(-1).index_select(0, plan.order_P)
        return rows_RD, offsets_J, w_R, LocalDispatchMeta(plan.order_P, T, K)

    def combine(self, y_RD: torch.Tensor, meta: LocalDispatchMeta,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # row r holds pair order_P[r], weighted by the experts; a dropped pair's row is zero (past the last offset)
        return sum_combine(y_RD, meta.order_P, meta.num_tokens, meta.top_k, out_dtype)

    def reduce_aux_inputs(self, routed_E: torch.Tensor, prob_sum_E: torch.Tensor,
                          num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs as they are; T as a CPU 0-d tensor, which device arithmetic reads as a
        number, like the Python int it replaces: CUDA divides by a CPU scalar as a multiply by its
        reciprocal but by a device tensor as a true division, so a device T would move the
        one-process loss by an ulp (and copying it there would wait for the stream)."""
        return routed_E, prob_sum_E, torch.full((), num_tokens, dtype=prob_sum_E.dtype, device="cpu")

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts
