"""FlashAttention forward and backward in Triton (FlashAttention-2 scheme), with GQA.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, each key/value head serving
H / Hkv query heads), S sequence (queries and keys have the same length), Hd head dim.

- ``_attn_fwd_kernel``: one program per (query block, b, h); streams key/value blocks through an
  online softmax, writes O and the per-row log-sum-exp (fp32, base 2, of the scaled scores).
  The S×S score matrix never exists in memory.
- ``_attn_bwd_delta_kernel``: delta = rowsum(dO ∘ O) in fp32.
- ``_attn_bwd_dkdv_kernel``: one program per (key block, b, hkv); recomputes the scores of every
  query block of all H / Hkv query heads of its group and accumulates dK, dV in registers, so the GQA
  sum over the group needs no atomics.
- ``_attn_bwd_dq_kernel``: one program per (query block, b, h); recomputes the scores against
  every key block and accumulates dQ in registers. No atomics anywhere: repeated backward passes
  are bit-identical.

Causal masking aligns the diagonal top-left (self-attention, Sq == Sk). Blocks entirely above the
diagonal are never visited; only blocks crossing the diagonal or the sequence end pay for masks.
The kernels take arbitrary strides (last dim contiguous), so (B, S, H, Hd) tensors viewed as
(B, H, S, Hd) need no copy.
"""

import math

import torch
import triton
import triton.language as tl

from kernel_floor import INTERPRET

SUPPORTED_HEAD_DIMS = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


def _configs(space, interpreter_point):
    """Autotune space on a GPU; the interpreter cannot autotune, so it gets one small config."""
    if INTERPRET:
        bm, bn = interpreter_point
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in space
    ]


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward and dQ need BLOCK_M % BLOCK_N == 0 (the
# causal split at the diagonal), dK/dV needs BLOCK_N % BLOCK_M == 0. Chosen from 7 candidates per
# kernel timed on an H100 (bf16, B·S = 16k; `python bench/attention.py --tune`): Hd 128 picks
# fwd 128x64 w8 s3 (4.24 ms at S=16k vs 4.39 for 128x128), dK/dV 64x128 w8 s3 (9.0 ms; 64x64 w4
# 15.3), dQ 128x64 w8 s3 (5.0 ms; 64x64 w4 6.3); Hd 64 causal picks fwd 128x64 w8 s4, dK/dV
# 64x64 w4 s3 and dQ 128x64 w4 s3. Candidates that never came first or second are dropped.
_FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)], (32, 16))
_DKDV_CONFIGS = _configs(
    [(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 4, 3), (32, 64, 4, 4)], (16, 32)
)
_DQ_CONFIGS = _configs([(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)], (32, 16))
_TUNE_KEY = ["HEAD_DIM", "CAUSAL", "S_BUCKET"]


def _s_bucket(S):
    """Autotune key for the length: 1024, 2048, 4096 or 8192 (all multiples of 16, so they share
    one compiled specialisation), so tests at odd lengths and long benchmarks tune separately
    without a re-tune per length."""
    return min(max(triton.next_power_of_2(S), 1024), 8192)


@triton.jit
def _query_block(S, H, GROUP, BLOCK_M: tl.constexpr):
    """This program's query block start and its (batch, head, kv head) indices. Causal: the last
    query blocks have the most work; launch them first so the tail of the grid is made of short
    programs (the order is harmless without a mask)."""
    start_m = (tl.cdiv(S, BLOCK_M) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    h = bh % H
    return start_m, bh, (bh // H).to(tl.int64), h, h // GROUP


@triton.jit
def _key_ranges(start_m, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key positions ``[0, full_end)`` that need no mask for this query block, and the end of
    ``[full_end, masked_end)`` that needs one (the diagonal block, or the ragged last block)."""
    if CAUSAL:
        full_end = start_m
        masked_end = tl.minimum(start_m + BLOCK_M, S)
    else:
        full_end = (S // BLOCK_N) * BLOCK_N
        masked_end = S
    return full_end, masked_end


@triton.jit
def _load_kv(K, V, cols, stride_ks, stride_vs, offs_d, S, MASKED: tl.constexpr):
    """(BLOCK_N, HEAD_DIM) tiles of k and v at key positions ``cols``."""
    k_ptrs = K + cols[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + cols[:, None] * stride_vs + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=(cols < S)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=(cols < S)[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _score_mask(offs_m, cols, S, CAUSAL: tl.constexpr):
    """Scores to keep in a masked block: keys inside the sequence, and not after the query."""
    keep = (cols < S)[None, :]
    if CAUSAL:
        keep = keep & (offs_m[:, None] >= cols[None, :])
    return keep


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d, lo, hi,
               S, qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v = _load_kv(K, V, cols, stride_ks, stride_vs, offs_d, S, MASKED)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            qk = tl.where(_score_mask(offs_m, cols, S, CAUSAL), qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE,
                     stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                     stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                     H, GROUP, S, S_BUCKET, qk_scale,
                     HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, bh, b, h, hk = _query_block(S, H, GROUP, BLOCK_M)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    O += b * stride_ob + h * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S
    q = tl.load(Q + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end, masked_end = _key_ranges(start_m, S, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_n,
                               offs_d, 0, full_end, S, qk_scale, CAUSAL, False, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_n,
                               offs_d, full_end, masked_end, S, qk_scale, CAUSAL, True, BLOCK_N)
    acc = acc / l_i[:, None]
    tl.store(O + offs_m[:, None] * stride_os + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + bh * S + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _attn_bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_os,
                           stride_dob, stride_doh, stride_dos, H, S,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * S + offs_m, delta, mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qs, stride_dos, offs_n, offs_d, lo, hi,
                S, qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = Q + offs_m[:, None] * stride_qs + offs_d[None, :]
        do_ptrs = DO + offs_m[:, None] * stride_dos + offs_d[None, :]
        if MASKED:
            row_ok = offs_m < S
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(LSE + offs_m)
            delta = tl.load(DELTA + offs_m)
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            keep = row_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(keep, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                          stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                          stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
                          stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
                          H, GROUP, S, S_BUCKET, qk_scale, sm_scale,
                          HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    H_KV = H // GROUP
    b = (bhk // H_KV).to(tl.int64)
    hk = bhk % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < S
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    full_end = (S // BLOCK_M) * BLOCK_M
    if CAUSAL:
        full_start = start_n + BLOCK_N
    else:
        full_start = 0
    # The G query heads of this key/value head, summed in a fixed order: no atomics.
    for g in range(GROUP):
        h = hk * GROUP + g
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        LSEh = LSE + (b * H + h) * S
        DELTAh = DELTA + (b * H + h) * S
        if CAUSAL:
            # Query blocks crossing the diagonal of this key block; those above it are skipped.
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qs, stride_dos,
                                 offs_n, offs_d, start_n, tl.minimum(start_n + BLOCK_N, S), S,
                                 qk_scale, CAUSAL, True, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qs, stride_dos, offs_n,
                             offs_d, full_start, full_end, S, qk_scale, CAUSAL, False, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qs, stride_dos, offs_n,
                             offs_d, tl.maximum(full_start, full_end), S, S, qk_scale, CAUSAL,
                             True, BLOCK_M)
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d, lo, hi,
              S, qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v = _load_kv(K, V, cols, stride_ks, stride_vs, offs_d, S, MASKED)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_score_mask(offs_m, cols, S, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                        stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
                        stride_dqb, stride_dqh, stride_dqs,
                        H, GROUP, S, S_BUCKET, qk_scale, sm_scale,
                        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, bh, b, h, hk = _query_block(S, H, GROUP, BLOCK_M)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh * S + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * S + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end, masked_end = _key_ranges(start_m, S, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   0, full_end, S, qk_scale, CAUSAL, False, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   full_end, masked_end, S, qk_scale, CAUSAL, True, BLOCK_N)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_inputs(q, k, v, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, heads, S, Hd), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} unsupported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    B, H, S, Hd = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    Bk, Hkv, Sk, Hdk = k.shape
    if Hd not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {Hd} unsupported; supported: {SUPPORTED_HEAD_DIMS}")
    if Hdk != Hd:
        raise ValueError(f"k/v head dim {Hdk} != q head dim {Hd}")
    if Bk != B:
        raise ValueError(f"k/v batch {Bk} != q batch {B}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads H={H} must be a multiple of k/v heads Hkv={Hkv}")
    if Sk != S:
        mode = "causal" if causal else "non-causal"
        raise ValueError(f"k/v length {Sk} != q length {S}: only self-attention (Sq == Sk) is "
                         f"supported ({mode})")


def attention_forward(q, k, v, causal=True, scale=None):
    """Launch the forward kernel.

    q: (B, H, S, Hd); k, v: (B, Hkv, S, Hd); fp16/bf16 (fp32 runs with tf32 dots on a GPU).
    Returns o (B, H, S, Hd) with q's dtype and strides, and lse (B, H, S) fp32: the base-2
    log-sum-exp of the scores scaled by scale·log2(e), which the backward reuses.
    """
    _check_inputs(q, k, v, causal)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, H, S, Hd = q.shape
    scale = 1.0 / math.sqrt(Hd) if scale is None else float(scale)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    if q.numel() == 0:
        return o, lse
    grid = lambda meta: (triton.cdiv(S, meta["BLOCK_M"]), B * H)  # noqa: E731
    _attn_fwd_kernel[grid](
        q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        H, H // k.shape[1], S, _s_bucket(S), scale * _LOG2E,
        HEAD_DIM=Hd, CAUSAL=bool(causal),
    )
    return o, lse


def attention_backward(do, q, k, v, o, lse, causal=True, scale=None):
    """Launch the backward kernels; returns dq, dk, dv shaped and typed like q, k, v.

    do, o: (B, H, S, Hd); lse: (B, H, S) fp32 from ``attention_forward``. Deterministic.
    """
    do = _last_dim_contiguous(do)
    B, H, S, Hd = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(Hd) if scale is None else float(scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk, dv
    delta = torch.empty_like(lse)
    delta_block = 64
    _attn_bwd_delta_kernel[(triton.cdiv(S, delta_block), B * H)](
        o, do, delta, *_strides(o), *_strides(do), H, S, HEAD_DIM=Hd, BLOCK_M=delta_block,
    )
    common = (H, H // Hkv, S, _s_bucket(S), scale * _LOG2E, scale)
    _attn_bwd_dkdv_kernel[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v),
        *_strides(do), *_strides(dk), *_strides(dv), *common, HEAD_DIM=Hd, CAUSAL=bool(causal),
    )
    _attn_bwd_dq_kernel[lambda meta: (triton.cdiv(S, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dq), *common, HEAD_DIM=Hd, CAUSAL=bool(causal),
    )
    return dq, dk, dv


class FlashAttentionFn(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, o and the fp32 log-sum-exp (O(S) memory), no scores."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal=True, scale=None):
    """Softmax attention without the S×S matrix.

    q: (B, H, S, Hd); k, v: (B, Hkv, S, Hd) with H % Hkv == 0; Hd in {32, 64, 128}; fp16 or bf16
    (fp32 accepted). ``scale`` defaults to 1/sqrt(Hd). Causal masking is top-left aligned and
    needs Sq == Sk (the only case supported). Returns (B, H, S, Hd) in q's dtype.
    """
    return FlashAttentionFn.apply(q, k, v, causal, scale)
