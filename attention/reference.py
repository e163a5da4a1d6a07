"""Plain PyTorch attention, the reference for the Triton kernels in ``flash_attn.py``.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), S sequence, Hd head dim.
"""

import math

import torch


def attention_reference(q_BHSHd, k_BHkvSHd, v_BHkvSHd, causal=True, scale=None, upcast=True):
    """Softmax attention by the textbook formula; materialises the S×S scores.

    q_BHSHd: (B, H, S, Hd); k_BHkvSHd, v_BHkvSHd: (B, Hkv, S, Hd), any float dtype. Key/value head j
    serves query heads j·H/Hkv … (j+1)·H/Hkv − 1 (GQA). ``causal`` masks keys after the query
    (diagonal aligned top-left, which is self-attention since both have length S).
    ``upcast=True`` computes in fp32 (the accuracy reference); ``upcast=False`` computes every
    product in the input dtype, which is what plain PyTorch gives at that precision (the
    baseline error the kernels are held to). Returns (B, H, S, Hd) in q's dtype; differentiable.
    """
    H, Hkv = q_BHSHd.shape[1], k_BHkvSHd.shape[1]
    scale = 1.0 / math.sqrt(q_BHSHd.shape[-1]) if scale is None else scale
    dtype = torch.float32 if upcast else q_BHSHd.dtype
    q, k, v = (t.to(dtype) for t in (q_BHSHd, k_BHkvSHd, v_BHkvSHd))
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores_BHSS = (q @ k.transpose(-1, -2)) * scale
    if causal:
        S_q, S_k = scores_BHSS.shape[-2:]
        keep_SS = torch.ones(S_q, S_k, dtype=torch.bool, device=q.device).tril()
        scores_BHSS = scores_BHSS.masked_fill(~keep_SS, float("-inf"))
    probs_BHSS = torch.softmax(scores_BHSS, dim=-1)
    return (probs_BHSS @ v).to(q_BHSHd.dtype)
