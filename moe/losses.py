"""Router losses. Legend: T tokens, E experts, K experts per token (top-k)."""

import torch


def load_balancing_loss(routed_E: torch.Tensor, prob_sum_E: torch.Tensor, num_tokens: int | torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer loss ``E · Σ_e f_e · P_e``.

    ``f_e = routed_e / (T·K)``: the fraction of (token, slot) pairs routed to e (before the
    capacity drops anything; no gradient). ``P_e = prob_sum_e / T``: the mean router probability
    of e (the gradient flows through it). Equals 1 for perfectly uniform routing.
    The inputs are sums, so they can be summed over ranks before the loss is formed; the token
    count T may be a 0-d tensor (the global count, kept on the device to avoid a host sync).
    """
    num_experts = routed_E.numel()
    f_E = routed_E.to(torch.float32) / (num_tokens * top_k)
    p_E = prob_sum_E / num_tokens
    return num_experts * torch.sum(f_E * p_E)


def token_mean(v_T: torch.Tensor) -> torch.Tensor:
    """The mean over the tokens of a per-token value; 0 (not NaN) for no tokens."""
    return v_T.mean() if v_T.numel() else v_T.sum()


def router_z_loss(logits_TE: torch.Tensor, lse_T: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE z-loss ``mean_t logsumexp(logits_t)²``: keeps router logits small. ``lse_T``: the
    logsumexp if already computed (the router's kernel makes it with the scores)."""
    if lse_T is None:
        lse_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return token_mean(lse_T.square())
