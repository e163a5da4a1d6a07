"""A naive per-token MoE: loops over tokens and their K experts, shares no code with moe/.

It reads the parameters of a ``MoELayer`` and recomputes routing, capacity and the expert MLPs
one (token, slot) pair at a time, in fp32 from the layer's parameters (autograd flows to them).
"""

import math

import torch
import torch.nn.functional as F


def naive_expert(x_D, w1_DU, w2_FD, activation):
    h = x_D.float() @ w1_DU.float()
    if activation == "swiglu":
        half = h.shape[-1] // 2
        h = F.silu(h[:half]) * h[half:]
    else:
        h = F.gelu(h, approximate="tanh")
    return h @ w2_FD.float()


def naive_moe(layer, x, capacity_groups=1):
    """Returns (out in fp32, kept as a set of (t, k), router logits)."""
    D = layer.dim
    x_TD = x.reshape(-1, D)
    T, E, K = x_TD.shape[0], layer.config.num_experts, layer.config.top_k
    logits = x_TD.float() @ layer.router.weight.float().t()
    if layer.router.score_func == "softmax":
        scores = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits)
    bias = layer.router.expert_bias
    select = scores if bias is None else (logits if layer.router.score_func == "softmax" else scores) + bias
    chosen = [torch.topk(select[t], K).indices.tolist() for t in range(T)]
    # capacity, pair by pair
    kept = set((t, k) for t in range(T) for k in range(K))
    if layer.config.capacity_factor is not None:
        group_T = T // capacity_groups
        C = math.ceil(layer.config.capacity_factor * group_T * K / E)
        for g in range(capacity_groups):
            for e in range(E):
                pairs = [(t, k) for t in range(g * group_T, (g + 1) * group_T) for k in range(K) if chosen[t][k] == e]
                if layer.config.drop_policy == "probs":
                    pairs.sort(key=lambda p: (-scores[p[0], e].item(), p[0]))
                for p in pairs[C:]:
                    kept.discard(p)
    w1, w2 = layer.experts.w1_LDU, layer.experts.w2_LFD
    rows = []
    for t in range(T):
        prio = torch.stack([scores[t, e] for e in chosen[t]])
        weights = prio / prio.sum() if layer.router.renormalize else prio
        acc = torch.zeros(D)
        for k, e in enumerate(chosen[t]):
            if (t, k) in kept:
                acc = acc + weights[k] * naive_expert(x_TD[t], w1[e], w2[e], layer.experts.activation)
        if layer.shared_experts is not None:
            sh = layer.shared_experts
            acc = acc + naive_expert(x_TD[t], sh.w1.weight.t(), sh.w2.weight.t(), sh.activation)
        rows.append(acc)
    out = torch.stack(rows) if rows else torch.zeros(0, D)
    return out.view(x.shape), kept, logits
