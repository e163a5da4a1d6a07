"""The router after its logits, one kernel each way: scores, the expert-bias selection, top-k,
the combine weights, and per token the logsumexp (the z-loss) and the routing entropy (a stat).

Legend: T tokens, E experts, K experts per token (top-k).

Why a kernel: in PyTorch the router's tail was ~40 launches a layer's forward (softmax, bias add,
topk's two, gather, the renormalisation's three, logsumexp's nine for the z-loss, the entropy's
seven) and ~25 in its backward (one per autograd node: gather, div, clamp, softmax, logsumexp,
...), counted on an H100 (one OLMoE-shaped layer, 2026-11-28). Each is a tiny kernel but 15–35 µs
of host time: in the profiled 2×H200 step, rank 0's CPU time per call was 18 µs for aten::mul and
aten::div, 36 µs for aten::where, 7 µs of it in cudaLaunchKernel. That step (olmoe_bench, 16
layers, 8 micro-batches) counted 15.6k of its 32k launches in the router and the plan, and one
rank's host falling behind the GPUs was the largest part of the exposed exchange
(bench/results/step_profile.md). Here: one forward launch, one backward launch.

Forward, a program per BLOCK_T tokens with all E columns in registers (E ≤ 1024):

- scores: softmax of the logits, or their sigmoid; lse = logsumexp of the logits;
- selection: the scores, or with an expert bias the logits (softmax) or the scores (sigmoid)
  plus the bias, exactly as :class:`moe.router.Router` selects; NaN selects as -inf;
- top-K by K rounds of a row max, the lowest column among the maxima (torch.topk leaves ties
  unspecified; this one is deterministic) that was not taken yet: the K experts are distinct
  even for a row of -inf;
- priority = the chosen experts' scores; weights = priority / max(Σ priority, 1e-20) (when
  renormalising) × the scaling factor;
- entropy of the scores normalised per token (no gradient).

Backward, from the saved logits, lse and priorities: the gradients of the weights and priorities
land on the chosen columns of the scores' gradient (``∂w_k/∂p_j = (c·δ_jk − w_k) / S`` with S
the priorities' sum when renormalising, else c·δ_jk), then through the softmax
(``p ⊙ (g − Σ p g)``) or the sigmoid (``s(1 − s) ⊙ g``), plus the lse's gradient times the
softmax of the logits. The scores' gradient may be a broadcast (the load-balancing loss reads
``scores.sum(0)``): its strides are passed, nothing is expanded.

Off CUDA, and for what the kernel does not cover (group-limited selection, force_balance),
:class:`moe.router.Router` runs the PyTorch ops; tests/test_router_topk.py checks the kernels
against them.
"""

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernel_floor import INTERPRET, cdiv, next_power_of_2

MAX_EXPERTS = 1024
# the top-k is K unrolled rounds over the token block: compiling K = 64 at E = 1024 took minutes
MAX_TOP_K = 32


@triton.jit
def _load_logits(L, rows, cols, T, E):
    """(BLOCK_T, BLOCK_E) logits, -inf past E (a row past T reads zeros: no NaN from it)."""
    ok = (rows < T)[:, None] & (cols < E)[None, :]
    x = tl.load(L + rows[:, None].to(tl.int64) * E + cols[None, :], mask=ok, other=0.0)
    return tl.where((cols < E)[None, :], x, float("-inf"))


@triton.jit
def _router_topk_fwd_kernel(L, BIAS, S, EXPERTS, PRIORITY, WEIGHTS, LSE, ENTROPY, T, E, scale,
                            K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                            RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = (cols < E)[None, :]
    x = _load_logits(L, rows, cols, T, E)
    row_max = tl.max(x, 1)
    ex = tl.exp(x - row_max[:, None])
    sum_ex = tl.sum(ex, 1)
    lse = row_max + tl.log(sum_ex)
    if SIGMOID:
        scores = tl.where(col_ok, tl.sigmoid(x), 0.0)
    else:
        scores = ex / sum_ex[:, None]
    tl.store(S + rows[:, None].to(tl.int64) * E + cols[None, :], scores, mask=row_ok[:, None] & col_ok)
    tl.store(LSE + rows, lse, mask=row_ok)

    # the routing entropy of the scores normalised per token, as moe.stats computes it
    q = scores / tl.maximum(tl.sum(scores, 1), 1e-20)[:, None]
    entropy = -tl.sum(tl.where(col_ok, q * tl.log(tl.maximum(q, 1e-20)), 0.0), 1)
    tl.store(ENTROPY + rows, entropy, mask=row_ok)

    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=cols < E, other=0.0)
        if SIGMOID:
            select = scores + bias[None, :]
        else:
            select = x + bias[None, :]
    else:
        select = scores
    select = tl.where(col_ok & (select == select), select, float("-inf"))  # NaN → -inf, past E → -inf
    taken = cols[None, :] >= E
    kcols = tl.arange(0, BLOCK_K)
    experts = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    priority = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for k in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), select), 1)
        pick = tl.min(tl.where((select == best[:, None]) & ~taken, cols[None, :], BLOCK_E), 1)
        hit = cols[None, :] == pick[:, None]
        taken = taken | hit
        experts = tl.where(kcols[None, :] == k, pick[:, None], experts)
        priority = tl.where(kcols[None, :] == k, tl.sum(tl.where(hit, scores, 0.0), 1)[:, None], priority)
    if RENORMALIZE:
        weights = priority / tl.maximum(tl.sum(priority, 1), 1e-20)[:, None] * scale
    else:
        weights = priority * scale
    pair_offs = rows[:, None].to(tl.int64) * K + kcols[None, :]
    pair_ok = row_ok[:, None] & (kcols < K)[None, :]
    tl.store(EXPERTS + pair_offs, experts.to(tl.int64), mask=pair_ok)
    tl.store(PRIORITY + pair_offs, priority, mask=pair_ok)
    tl.store(WEIGHTS + pair_offs, weights, mask=pair_ok)


@triton.jit
def _router_topk_bwd_kernel(L, LSE, EXPERTS, PRIORITY, G_S, gs_stride_t, gs_stride_e, G_P, G_W, G_LSE,
                            DL, T, E, scale, K: tl.constexpr, SIGMOID: tl.constexpr,
                            RENORMALIZE: tl.constexpr, HAS_GS: tl.constexpr, HAS_GP: tl.constexpr,
                            HAS_GW: tl.constexpr, HAS_GLSE: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = (cols < E)[None, :]
    x = _load_logits(L, rows, cols, T, E)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    softmax = tl.exp(x - lse[:, None])  # 0 past E
    if SIGMOID:
        scores = tl.where(col_ok, tl.sigmoid(x), 0.0)
    else:
        scores = softmax
    grad = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    if HAS_GS:
        grad += tl.load(G_S + rows[:, None].to(tl.int64) * gs_stride_t + cols[None, :] * gs_stride_e,
                        mask=row_ok[:, None] & col_ok, other=0.0)
    if HAS_GP or HAS_GW:
        kcols = tl.arange(0, BLOCK_K)
        pair_offs = rows[:, None].to(tl.int64) * K + kcols[None, :]
        pair_ok = row_ok[:, None] & (kcols < K)[None, :]
        experts = tl.load(EXPERTS + pair_offs, mask=pair_ok, other=-1)
        g_pair = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        if HAS_GW:
            g_w = tl.load(G_W + pair_offs, mask=pair_ok, other=0.0)
            if RENORMALIZE:
                priority = tl.load(PRIORITY + pair_offs, mask=pair_ok, other=0.0)
                total = tl.sum(priority, 1)
                clamped = total < 1e-20  # clamp_min's gradient: none through a clamped sum
                denom = tl.maximum(total, 1e-20)
                weights = priority / denom[:, None] * scale
                through_sum = tl.where(clamped, 0.0, tl.sum(g_w * weights, 1))
                g_pair += (scale * g_w - through_sum[:, None]) / denom[:, None]
            else:
                g_pair += scale * g_w
        if HAS_GP:
            g_pair += tl.load(G_P + pair_offs, mask=pair_ok, other=0.0)
        for k in tl.static_range(K):
            pick_k = tl.sum(tl.where(kcols[None, :] == k, experts, 0), 1)
            g_k = tl.sum(tl.where(kcols[None, :] == k, g_pair, 0.0), 1)
            grad += tl.where(cols[None, :] == pick_k[:, None], g_k[:, None], 0.0)
    if SIGMOID:
        dx = scores * (1.0 - scores) * grad
    else:
        dx = scores * (grad - tl.sum(scores * grad, 1)[:, None])
    if HAS_GLSE:
        dx += tl.load(G_LSE + rows, mask=row_ok, other=0.0)[:, None] * softmax
    tl.store(DL + rows[:, None].to(tl.int64) * E + cols[None, :], dx, mask=row_ok[:, None] & col_ok)


def _blocks(E: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K): the token block holds 4k scores (32 a thread at 4 warps); the
    interpreter's 256, so small tests walk several blocks."""
    block_e = next_power_of_2(E)
    block_t = max(1, min(128, (256 if INTERPRET else 4096) // block_e))
    return block_t, block_e, next_power_of_2(K)


def _flat(grad: torch.Tensor | None, absent: torch.Tensor) -> torch.Tensor:
    """A gradient as the kernel reads it, contiguous; ``absent`` (never read) stands in for None."""
    return absent if grad is None else grad.contiguous()


class RouterTopKFn(torch.autograd.Function):
    """(logits_TE fp32, bias_E or None, K, sigmoid, renormalize, scale) -> (scores_TE, experts_TK
    int64, priority_TK, weights_TK, lse_T, entropy_T)."""

    @staticmethod
    def forward(ctx, logits_TE, bias_E, top_k, sigmoid, renormalize, scale):
        T, E = logits_TE.shape
        logits_TE = logits_TE.contiguous()
        dev = logits_TE.device
        scores = torch.empty(T, E, device=dev, dtype=torch.float32)
        experts = torch.empty(T, top_k, device=dev, dtype=torch.int64)
        priority = torch.empty(T, top_k, device=dev, dtype=torch.float32)
        weights = torch.empty(T, top_k, device=dev, dtype=torch.float32)
        lse = torch.empty(T, device=dev, dtype=torch.float32)
        entropy = torch.empty(T, device=dev, dtype=torch.float32)
        block_t, block_e, block_k = _blocks(E, top_k)
        if T:
            _router_topk_fwd_kernel[(cdiv(T, block_t),)](
                logits_TE, bias_E if bias_E is not None else logits_TE, scores, experts, priority, weights,
                lse, entropy, T, E, scale, K=top_k, SIGMOID=sigmoid, HAS_BIAS=bias_E is not None,
                RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4)
        ctx.save_for_backward(logits_TE, lse, experts, priority)
        ctx.args = (top_k, sigmoid, renormalize, scale)
        ctx.mark_non_differentiable(experts, entropy)
        # the outputs nothing reads (the priorities, in training) reach the backward as None, not
        # as zeros autograd would make: a launch each, and a term the kernel skips
        ctx.set_materialize_grads(False)
        return scores, experts, priority, weights, lse, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_scores, _g_experts, g_priority, g_weights, g_lse, _g_entropy):
        logits_TE, lse, experts, priority = ctx.saved_tensors
        top_k, sigmoid, renormalize, scale = ctx.args
        T, E = logits_TE.shape
        dl = torch.empty_like(logits_TE)
        block_t, block_e, block_k = _blocks(E, top_k)
        if T:
            _router_topk_bwd_kernel[(cdiv(T, block_t),)](
                logits_TE, lse, experts, priority, g_scores if g_scores is not None else logits_TE,
                *(g_scores.stride() if g_scores is not None else (0, 0)), _flat(g_priority, logits_TE),
                _flat(g_weights, logits_TE), _flat(g_lse, logits_TE), dl, T, E, scale, K=top_k, SIGMOID=sigmoid,
                RENORMALIZE=renormalize, HAS_GS=g_scores is not None, HAS_GP=g_priority is not None,
                HAS_GW=g_weights is not None, HAS_GLSE=g_lse is not None, BLOCK_T=block_t, BLOCK_E=block_e,
                BLOCK_K=block_k, num_warps=4)
        return dl, None, None, None, None, None


def token_entropy(scores_TE: torch.Tensor) -> torch.Tensor:
    """(T,) entropy (nats) of each token's scores normalised to sum to 1, no gradient."""
    with torch.no_grad():
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)
        return -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1)


def router_topk_reference(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, sigmoid: bool,
                          renormalize: bool, scale: float, limit=None):
    """The PyTorch ops, :func:`router_topk`'s outputs. ``limit``: a function of the (detached)
    selection scores that returns the scores to take the top-K of (group-limited selection, or
    force_balance's random scores), or None."""
    scores_TE = logits_TE.sigmoid() if sigmoid else logits_TE.softmax(dim=-1)
    if bias_E is None:
        select_TE = scores_TE
    else:  # see Router's expert_bias for the domain
        select_TE = (scores_TE if sigmoid else logits_TE) + bias_E
    if limit is not None:
        select_TE = limit(select_TE.detach())
    experts_TK = select_TE.topk(top_k, dim=-1, sorted=True).indices
    priority_TK = scores_TE.gather(1, experts_TK)
    weights_TK = priority_TK
    if renormalize:
        weights_TK = priority_TK / priority_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if scale != 1.0:
        weights_TK = weights_TK * scale
    lse_T = torch.logsumexp(logits_TE, dim=-1)
    return scores_TE, experts_TK, priority_TK, weights_TK, lse_T, token_entropy(scores_TE)


def router_topk(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, sigmoid: bool,
                renormalize: bool, scale: float):
    """The kernels with autograd; ``logits_TE`` (T, E) fp32 with E ≤ :data:`MAX_EXPERTS` (and K ≤
    :data:`MAX_TOP_K`), ``bias_E`` (E,) fp32 selection bias or None. Returns (scores_TE, experts_TK int64, priority_TK,
    weights_TK, lse_T, entropy_T); the experts and the entropy carry no gradient."""
    if logits_TE.dim() != 2 or logits_TE.dtype != torch.float32:
        raise ValueError(f"router_topk: logits_TE must be 2-D fp32, got {tuple(logits_TE.shape)} {logits_TE.dtype}")
    E = logits_TE.shape[1]
    if not (1 <= top_k <= E <= MAX_EXPERTS and top_k <= MAX_TOP_K):
        raise ValueError(f"router_topk: needs 1 <= top_k <= E <= {MAX_EXPERTS} and top_k <= {MAX_TOP_K}, "
                         f"got top_k={top_k}, E={E}")
    if bias_E is not None and (bias_E.shape != (E,) or bias_E.dtype != torch.float32):
        raise ValueError(f"router_topk: bias_E must be ({E},) fp32, got {tuple(bias_E.shape)} {bias_E.dtype}")
    return RouterTopKFn.apply(logits_TE, bias_E, top_k, sigmoid, renormalize, float(scale))
