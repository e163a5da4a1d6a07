"""Plain PyTorch attention, the reference for the Triton kernels in ``flash_attn.py``.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Sq query length,
Sk key/value length, Hd head dim.
"""

import math

import torch


def visible_keys(Sq, Sk, causal=True, window=None, device=None):
    """(Sq, Sk) bool: whether query i sees key j, the rule of ``flash_attention``.

    Bottom-right alignment: query i sits at key position i' = i + Sk − Sq and sees key j iff
    i' − left <= j <= i' + right, with ``window=(left, right)`` (None: unlimited both ways) and
    right = 0 when ``causal``.
    """
    aligned_S1 = torch.arange(Sq, device=device)[:, None] + (Sk - Sq)
    key_1S = torch.arange(Sk, device=device)[None, :]
    keep_SS = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if window is not None:
        keep_SS &= key_1S >= aligned_S1 - window[0]
        keep_SS &= key_1S <= aligned_S1 + window[1]
    if causal:
        keep_SS &= key_1S <= aligned_S1
    return keep_SS


def attention_reference(q_BHSHd, k_BHkvSHd, v_BHkvSHd, causal=True, scale=None, upcast=True,
                        window=None):
    """Softmax attention by the textbook formula; materialises the Sq×Sk scores.

    q_BHSHd: (B, H, Sq, Hd); k_BHkvSHd, v_BHkvSHd: (B, Hkv, Sk, Hd), any float dtype. Key/value
    head j serves query heads j·H/Hkv … (j+1)·H/Hkv − 1 (GQA). ``causal`` and ``window`` mask
    keys as :func:`visible_keys` says (bottom-right aligned; top-left when Sq == Sk); a query that
    sees no key outputs 0 and gets zero gradients.
    ``upcast=True`` computes in at least fp32 (the accuracy reference; fp64 stays fp64);
    ``upcast=False`` computes every product in the input dtype, which is what plain PyTorch gives
    at that precision (the baseline error the kernels are held to). Returns (B, H, Sq, Hd) in q's
    dtype; differentiable.
    """
    H, Hkv = q_BHSHd.shape[1], k_BHkvSHd.shape[1]
    scale = 1.0 / math.sqrt(q_BHSHd.shape[-1]) if scale is None else scale
    dtype = torch.promote_types(q_BHSHd.dtype, torch.float32) if upcast else q_BHSHd.dtype
    q, k, v = (t.to(dtype) for t in (q_BHSHd, k_BHkvSHd, v_BHkvSHd))
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores_BHSS = (q @ k.transpose(-1, -2)) * scale
    if causal or window is not None:
        keep_SS = visible_keys(q.shape[2], k.shape[2], causal, window, q.device)
        scores_BHSS = scores_BHSS.masked_fill(~keep_SS, float("-inf"))
        # A row that sees no key is softmax(all -inf) = NaN: the second fill makes it 0, and the
        # backward of the first zeroes the NaN gradient that softmax gives that row.
        probs_BHSS = torch.softmax(scores_BHSS, dim=-1).masked_fill(~keep_SS, 0.0)
    else:
        probs_BHSS = torch.softmax(scores_BHSS, dim=-1)
    return (probs_BHSS @ v).to(q_BHSHd.dtype)
