"""The MoE layer's router losses and mean entropy from their reduced inputs, one kernel each way.

Legend: T tokens, E experts, K experts per token (top-k), N the token count the balancing loss
divides by (the world's, under expert parallelism).

    lb      = E · Σ_e (routed_e / (N·K)) · (prob_sum_e / N)     (load_balancing_loss)
    z       = mean_t lse_t²                                     (router_z_loss)
    loss    = aux_coef · lb + z_coef · z
    entropy = mean_t entropy_t                                  (a stat, no gradient)

N is clamped to at least 1; a mean over no tokens is 0.

Why a kernel: as PyTorch ops these scalars were ~14 launches a layer's forward (casts, divisions,
a dot product as mul + sum, square, mean, the coefficients) and ~8 in its backward, each 15–35 µs
of host time (see moe/kernels/router_topk.py) on hosts that the 2×H200 step profile of
olmoe_bench showed falling behind the GPUs (16 MoE layers × 8 micro-batches a step;
bench/results/step_profile.md). Here one launch each way: the forward a single program (E ≤ 1024
values, T lse values walked in blocks), the backward a program per block of tokens
(``d lse_t = (g_z + z_coef·g_loss) · 2·lse_t / T``; program 0 also writes
``d prob_sum_e = (g_lb + aux_coef·g_loss) · E · routed_e / (N²·K)``).

Off CUDA the PyTorch formulas of :mod:`moe.losses` run (``router_losses_reference``);
tests/test_router_loss.py checks the kernels against them.
"""

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernel_floor import INTERPRET, cdiv, next_power_of_2, use_reference
from moe.kernels.router_topk import MAX_EXPERTS
from moe.losses import load_balancing_loss, router_z_loss, token_mean

_BLOCK_T = 64 if INTERPRET else 1024


@triton.jit
def _count(NT, n_host, N_ON_HOST: tl.constexpr):
    """N, at least 1: the scalar argument, or the 0-d device tensor's value."""
    if N_ON_HOST:
        n = n_host
    else:
        n = tl.load(NT).to(tl.float32)
    return tl.maximum(n, 1.0)


@triton.jit
def _router_loss_fwd_kernel(ROUTED, PROB, NT, n_host, LSE, ENT, LB, Z, LOSS, MEAN_ENT, T, tokens, E, K, aux_coef,
                            z_coef, N_ON_HOST: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    n = _count(NT, n_host, N_ON_HOST)
    e = tl.arange(0, BLOCK_E)
    routed = tl.load(ROUTED + e, mask=e < E, other=0).to(tl.float32)
    prob = tl.load(PROB + e, mask=e < E, other=0.0)
    lb = E * tl.sum((routed / (n * K)) * (prob / n), 0)
    sq = tl.zeros([BLOCK_T], tl.float32)
    ent = tl.zeros([BLOCK_T], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        lse = tl.load(LSE + t, mask=t < T, other=0.0)
        sq += lse * lse
        ent += tl.load(ENT + t, mask=t < T, other=0.0)
    z = tl.sum(sq, 0) / tokens
    tl.store(LB, lb)
    tl.store(Z, z)
    tl.store(LOSS, aux_coef * lb + z_coef * z)
    tl.store(MEAN_ENT, tl.sum(ent, 0) / tokens)


@triton.jit
def _router_loss_bwd_kernel(ROUTED, NT, n_host, LSE, G_LB, G_Z, G_LOSS, D_PROB, D_LSE, T, tokens, E, K, aux_coef,
                            z_coef, N_ON_HOST: tl.constexpr, HAS_GLB: tl.constexpr, HAS_GZ: tl.constexpr,
                            HAS_GLOSS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    g_lb = 0.0
    g_z = 0.0
    if HAS_GLB:
        g_lb += tl.load(G_LB)
    if HAS_GZ:
        g_z += tl.load(G_Z)
    if HAS_GLOSS:
        g_loss = tl.load(G_LOSS)
        g_lb += aux_coef * g_loss
        g_z += z_coef * g_loss
    pid = tl.program_id(0)
    if pid == 0:
        n = _count(NT, n_host, N_ON_HOST)
        e = tl.arange(0, BLOCK_E)
        routed = tl.load(ROUTED + e, mask=e < E, other=0).to(tl.float32)
        tl.store(D_PROB + e, g_lb * E * (routed / (n * K)) / n, mask=e < E)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    lse = tl.load(LSE + t, mask=t < T, other=0.0)
    tl.store(D_LSE + t, g_z * 2.0 * lse / tokens, mask=t < T)


def _count_args(num_tokens: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
    """(pointer, scalar, on_host) for N: a CPU count beside device tensors (the one-process
    dispatcher's) goes as a scalar (no copy, no wait), a count where the tensors are (the
    all-reduced one) by its address."""
    if num_tokens.device == like.device:
        return num_tokens, 0.0, False
    return like, float(num_tokens), True


class RouterLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routed_E, prob_sum_E, num_tokens, lse_T, entropy_T, top_k, aux_coef, z_coef):
        E, T = prob_sum_E.numel(), lse_T.numel()
        lb, z, loss, mean_entropy = (torch.empty((), device=prob_sum_E.device, dtype=torch.float32) for _ in range(4))
        nt, n_host, on_host = _count_args(num_tokens, prob_sum_E)
        block_e = next_power_of_2(E)
        _router_loss_fwd_kernel[(1,)](
            routed_E, prob_sum_E, nt, n_host, lse_T, entropy_T, lb, z, loss, mean_entropy, T, float(max(T, 1)), E,
            top_k, aux_coef, z_coef, N_ON_HOST=on_host, BLOCK_E=block_e, BLOCK_T=_BLOCK_T, num_warps=4)
        ctx.save_for_backward(routed_E, lse_T, *([] if on_host else [num_tokens]))
        ctx.args = (n_host, on_host, top_k, aux_coef, z_coef)
        ctx.mark_non_differentiable(mean_entropy)
        ctx.set_materialize_grads(False)  # an unused loss's gradient stays None: no zeros made
        return lb, z, loss, mean_entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lb, g_z, g_loss, _g_entropy):
        routed_E, lse_T, *device_count = ctx.saved_tensors
        n_host, on_host, top_k, aux_coef, z_coef = ctx.args
        # autograd calls this only when one of the three losses has a gradient; it stands in for
        # the absent ones (never read)
        anything = next(g for g in (g_lb, g_z, g_loss) if g is not None)
        E, T = routed_E.numel(), lse_T.numel()
        d_prob = torch.empty(E, device=lse_T.device, dtype=torch.float32)
        d_lse = torch.empty_like(lse_T)
        nt = device_count[0] if device_count else d_prob
        _router_loss_bwd_kernel[(max(1, cdiv(T, _BLOCK_T)),)](
            routed_E, nt, n_host, lse_T, *(g if g is not None else anything for g in (g_lb, g_z, g_loss)),
            d_prob, d_lse, T, float(max(T, 1)), E, top_k, aux_coef, z_coef, N_ON_HOST=on_host,
            HAS_GLB=g_lb is not None, HAS_GZ=g_z is not None, HAS_GLOSS=g_loss is not None,
            BLOCK_E=next_power_of_2(E), BLOCK_T=_BLOCK_T, num_warps=4)
        return None, d_prob, None, d_lse, None, None, None, None


def router_losses_reference(routed_E, prob_sum_E, num_tokens, lse_T, entropy_T, top_k, aux_coef, z_coef):
    """The PyTorch formulas: (lb, z, loss, mean_entropy)."""
    lb = load_balancing_loss(routed_E, prob_sum_E, num_tokens.clamp_min(1), top_k)
    z = router_z_loss(None, lse_T)
    return lb, z, aux_coef * lb + z_coef * z, token_mean(entropy_T)


def router_losses(routed_E: torch.Tensor, prob_sum_E: torch.Tensor, num_tokens: torch.Tensor, lse_T: torch.Tensor,
                  entropy_T: torch.Tensor, top_k: int, aux_coef: float, z_coef: float, backend: str = "auto"):
    """routed_E (E,) int64 pairs routed per expert, prob_sum_E (E,) fp32 summed router
    probabilities (differentiable), num_tokens 0-d (CPU or the device's), lse_T (T,) fp32
    (differentiable), entropy_T (T,) fp32 -> 0-d fp32 (lb, z, loss, mean_entropy), the module
    docstring's formulas. ``backend``: "auto" runs the kernels on CUDA for up to
    :data:`~moe.kernels.router_topk.MAX_EXPERTS` experts (all E in one block, as the router's)."""
    if use_reference(backend, not prob_sum_E.is_cuda) or prob_sum_E.numel() > MAX_EXPERTS:
        return router_losses_reference(routed_E, prob_sum_E, num_tokens, lse_T, entropy_T, top_k, aux_coef, z_coef)
    return RouterLossFn.apply(routed_E.contiguous(), prob_sum_E.float().contiguous(), num_tokens,
                              lse_T.float().contiguous(), entropy_T.float().contiguous(), top_k, float(aux_coef),
                              float(z_coef))
