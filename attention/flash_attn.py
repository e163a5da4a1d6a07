"""FlashAttention forward and backward in Triton (FlashAttention-2 scheme), with GQA.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, each key/value head serving
H / Hkv query heads), Sq query length, Sk key/value length, Hd head dim.

- ``_attn_fwd_kernel``: one program per (query block, b, h); streams key/value blocks through an
  online softmax, writes O and the per-row log-sum-exp (fp32, base 2, of the scaled scores).
  The Sq×Sk score matrix never exists in memory. On an H100/H200, the plain case (Sq == Sk, no
  window, Hd 64, 128 or 256, or 33-127 from 256 keys, fp16/bf16, a nonzero scale, at least 2^19
  visible scores) runs the warp-specialized Gluon forward of ``flash_attn_hopper`` instead
  (bench/results/attention.md: 1.00–1.12× cuDNN at Hd 128, S 1k–16k, where this kernel gave
  0.80–0.92×; at Hd 256 1.25–1.48× this kernel, bench/results/attention_hd256.md).
- ``_attn_bwd_delta_kernel``: delta = rowsum(dO ∘ O) in fp32 (and the Gluon backward's turn
  counters zeroed).
- ``_attn_bwd_dkdv_kernel``: one program per (key block, b, hkv); recomputes the scores of every
  query block of all H / Hkv query heads of its group and accumulates dK, dV in registers, so the GQA
  sum over the group needs no atomics.
- ``_attn_bwd_dq_kernel``: one program per (query block, b, h); recomputes the scores against
  every key block and accumulates dQ in registers. No atomics anywhere: repeated backward passes
  are bit-identical.
- On an H100/H200 the case Sq == Sk, no window, Hd 64, 128 or 256 (or 33-127 from 256 keys),
  fp16/bf16, any scale, at >= 2^27 visible scores takes the Gluon backward of
  ``flash_attn_hopper_bwd`` instead of the last two: one kernel, five matmuls instead of seven
  (bench/results/attention.md: fwd+bwd 0.98–1.07× cuDNN at S 2k–16k where these gave 0.75–0.98×;
  S 1k is bound by host time on some hosts; at Hd 256 1.14–1.22× these, bench/results/
  attention_hd256.md), with dQ summed by TMA reduce-add in a fixed order unless
  ``deterministic=False``.

Which keys a query sees. Queries and keys are aligned bottom-right (FlashAttention >= 2.1,
``torch.nn.attention.bias.causal_lower_right``): query i sits at key position i' = i + Sk − Sq, so
the last query lines up with the last key, which is what chunked prefill (Sq new queries after
Sk − Sq cached keys) needs; with Sq == Sk this is the usual top-left diagonal. Query i sees key j
iff i' − left <= j <= i' + right, with ``window=(left, right)`` (FlashAttention-2's
``window_size``; None: unlimited both ways) and right = 0 under ``causal``. A query that sees no
key (i' + right < 0: only when Sq > Sk, causal or with a short right reach) outputs 0, gets zero
gradients, and its LSE holds +inf: the recomputed probabilities exp2(s − LSE) of the backward are
then exactly 0, never NaN.

Only the blocks a band can reach are visited. ``_block_ranges`` gives each block of one axis the
range of the other axis that any of its rows sees (query blocks: keys, for the forward and dQ;
key blocks: the queries whose window holds any of its keys, the mirrored band, for dK/dV), split
into an interior that every row sees whole (no mask: the fast path) and the blocks at either edge
of the band or at the sequence end, which pay for a mask. Blocks outside every window cost nothing.

Head dims: any multiple of 8 up to 256. The tiles are BLOCK_D = next power of two (>= 16) wide;
loads and stores mask the columns past Hd (zeros, which add nothing to the dot products), so Hd 96
runs on 128-wide tiles and powers of two from 16 pay no mask (the Gluon kernels' 64- and 128-wide
tiles take Hd 33-127 the same way, by TMA's zero fill: ``flash_attn_hopper.WIDE_TILE_FROM``). The
kernels take arbitrary strides (last dim contiguous), so (B, S, H, Hd) tensors viewed as (B, H, S,
Hd) need no copy.
"""

import math

import torch
import triton
import triton.language as tl

from attention.flash_attn_hopper import hopper_forward, hopper_forward_ok
from attention.flash_attn_hopper_bwd import (TURN_ROWS, hopper_backward, hopper_backward_ok,
                                             hopper_turn_counters)
from kernel_floor import INTERPRET, aligned16, cached_launch, cdiv, next_power_of_2

MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
# The autotune key. S_BUCKET is passed to the kernels for it alone; CAUSAL and BAND also pick
# the code path at compile time (see _visible); ALIGN decides whether the tiles pipeline at all
# (``_aligned``), so each value tunes on its own.
_TUNE_KEY = ["HEAD_DIM", "CAUSAL", "BAND", "S_BUCKET", "ALIGN"]


def _tune(space, wide_space, interpreter_point):
    """``triton.autotune`` arguments. On a GPU, ``space`` serves head-dim tiles up to 128 wide and
    ``wide_space`` the 256-wide ones (smaller blocks and 2 stages: the 256-wide q/k/v tiles and
    fp32 accumulators must fit in registers and shared memory), split by pruning on BLOCK_D. The
    interpreter cannot autotune, so it gets one small config."""
    if INTERPRET:
        bm, bn = interpreter_point
        return {"configs": [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4,
                                          num_stages=1)], "key": _TUNE_KEY}
    narrow, wide = ([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                     for bm, bn, w, s in configs] for configs in (space, wide_space))

    def by_tile_width(configs, named_args, **kwargs):
        return [c for c in configs if (c in wide) == (kwargs["BLOCK_D"] > 128)]

    return {"configs": narrow + wide, "key": _TUNE_KEY,
            "prune_configs_by": {"early_config_prune": by_tile_width}}


# (BLOCK_M, BLOCK_N, num_warps, num_stages); any block sizes work (the key ranges are computed per
# block; a dK/dV shape with BLOCK_N % BLOCK_M != 0, which no list holds, would take the slower band
# code also without a band). Chosen from 7 candidates per kernel timed on an H100 (bf16, B·S = 16k;
# `python bench/attention.py --tune`): Hd 128 picks fwd 128x64 w8 s3 (4.24 ms at S=16k vs 4.39 for
# 128x128), dK/dV 64x128 w8 s3 (9.0 ms; 64x64 w4 15.3), dQ 128x64 w8 s3 (5.0 ms; 64x64 w4 6.3);
# Hd 64 causal picks fwd 128x64 w8 s4, dK/dV 64x64 w4 s3 and dQ 128x64 w4 s3. Candidates that
# never came first or second are dropped. The 256-wide lists (Hd 129-256) from 7 candidates each on
# an H200 (`python bench/attention.py --tune --head-dims 256`, S 4k / 16k, causal and not; the
# same winner in all four): fwd 128x64 w8 s2 (4.31 ms at S 16k; 128x32 w8 s3 4.67, and the list
# before's best 128x32 w8 s2 6.67), dK/dV 64x64 w8 s2 (14.9 ms; 32x32 w4 s3 19.0, before 32x64 w8
# s2 22.0), dQ 64x32 w4 s3 (6.85 ms; 128x32 w8 s2 7.57, before 32x32 w4 s2 15.1); a second space
# around them kept them (bench/results/attention_hd256.md). Each 256-wide list ends in a small
# block kept from the list before, for fp32, whose tiles take twice the shared memory (the
# autotuner skips a config that does not fit; tests/test_attention.py runs fp32 at Hd 256 on the
# GPU).
# (narrow, wide) lists; the interpreter's tests force each listed block shape in turn.
FWD_SPACE = ([(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)],
             [(128, 64, 8, 2), (128, 32, 8, 3), (32, 32, 4, 2)])
DKDV_SPACE = ([(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 4, 3), (32, 64, 4, 4)],
              [(64, 64, 8, 2), (32, 32, 4, 3), (16, 32, 4, 2)])
DQ_SPACE = ([(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)],
            [(64, 32, 4, 3), (128, 32, 8, 2), (32, 32, 4, 2)])
_FWD_TUNE = _tune(*FWD_SPACE, (32, 16))
_DKDV_TUNE = _tune(*DKDV_SPACE, (16, 32))
_DQ_TUNE = _tune(*DQ_SPACE, (32, 16))


def _s_bucket(S):
    """Autotune key for the length: 1024, 2048, 4096 or 8192 (all multiples of 16, so they share
    one compiled specialisation), so tests at odd lengths and long benchmarks tune separately
    without a re-tune per length."""
    return min(max(next_power_of_2(S), 1024), 8192)


@triton.jit
def _query_block(SQ, H, GROUP, BLOCK_M: tl.constexpr):
    """This program's query block start and its (batch, head, kv head) indices. Causal: the last
    query blocks have the most work; launch them first so the tail of the grid is made of short
    programs (the order is harmless without a mask)."""
    start_m = (tl.cdiv(SQ, BLOCK_M) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    h = bh % H
    return start_m, bh, (bh // H).to(tl.int64), h, h // GROUP


@triton.jit
def _block_ranges(start, n_self, n_other, diag_lo, diag_hi,
                  BLOCK_SELF: tl.constexpr, BLOCK_OTHER: tl.constexpr):
    """The other axis' range for the block ``[start, start + BLOCK_SELF)`` of one axis, where
    index i of this axis sees index j of the other iff diag_lo <= j − i <= diag_hi (queries over
    keys: the band's DIAG_LO, DIAG_HI; keys over queries, the mirror: −DIAG_HI, −DIAG_LO).

    Returns ``lo <= full_lo <= full_hi <= hi``: ``[lo, hi)`` holds every j that a row of the block
    sees (nothing outside it is visited; empty when the block sees nothing); every row sees every j
    of ``[full_lo, full_hi)`` and it lies inside ``n_other``, so those blocks need no mask. lo,
    full_lo and full_hi are multiples of BLOCK_OTHER or equal to hi (leaving the later ranges
    empty), so every range walks whole aligned blocks.
    """
    last = tl.minimum(start + BLOCK_SELF, n_self) - 1
    # Floor/ceil to a block only on non-negative values (division rounds toward zero on a GPU,
    # down in the interpreter). Few scalar ops: each costs the interpreter a millisecond.
    lo = tl.maximum(start + diag_lo, 0) // BLOCK_OTHER * BLOCK_OTHER
    hi = tl.maximum(tl.minimum(last + diag_hi + 1, n_other), lo)
    full_lo = tl.minimum((tl.maximum(last + diag_lo, lo) + BLOCK_OTHER - 1)
                         // BLOCK_OTHER * BLOCK_OTHER, hi)
    full_hi = tl.maximum(tl.maximum(tl.minimum(start + diag_hi + 1, hi), 0)
                         // BLOCK_OTHER * BLOCK_OTHER, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _plain_ranges(start_m, SK, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """_block_ranges of a query block without a band (Sq == Sk, no window), in the fewest
    scalars: (0, 0, full_hi, hi), keys [0, full_hi) unmasked and [full_hi, hi) masked (the
    diagonal block, or the ragged end)."""
    if CAUSAL:
        full_hi = start_m // BLOCK_N * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M, SK)
    else:
        full_hi = SK // BLOCK_N * BLOCK_N
        hi = SK
    return 0, 0, full_hi, hi


@triton.jit
def _visible(q_pos, k_pos, SQ, SK, DIAG_LO, DIAG_HI, CAUSAL: tl.constexpr, BAND: tl.constexpr):
    """Whether query ``q_pos`` sees key ``k_pos`` (broadcast against each other): both inside
    their sequences, and the key on a diagonal of the band.

    BAND is False for the common case, Sq == Sk without a window. Then the kernels take their
    ranges from _plain_ranges and this plain test: the general band code made the backward
    kernels spill registers where the plain code does not (ptxas -v, sm_90: dK/dV hd 64 at 64×64,
    4 warps, 48 bytes against 0) and cost that case 3-10% of fwd+bwd time on an H100 (same-run
    A/B; hd 64 causal the worst)."""
    if BAND:
        diag = k_pos - q_pos
        keep = (q_pos < SQ) & (k_pos < SK) & (diag >= DIAG_LO) & (diag <= DIAG_HI)
    else:
        # Only the streamed axis' end (SK None: the dK/dV kernel, which streams queries). The
        # program's own rows past the end (queries in the forward and dQ, keys in dK/dV) are
        # never stored, and each output row depends only on its own row of scores, so they
        # cannot reach a stored result; they stay finite (key 0 is always seen here).
        keep = (q_pos < SQ) if SK is None else (k_pos < SK)
        if CAUSAL:
            keep = keep & (q_pos >= k_pos)
    return keep


@triton.jit
def _row_mask(rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(rows, BLOCK_D) mask: rows inside the sequence, and columns inside the head dim when the
    tile is padded."""
    mask = (rows < n_rows)[:, None]
    if HEAD_DIM != BLOCK_D:
        mask = mask & (offs_d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _aligned(stride_b, stride_h, stride_s, ALIGN: tl.constexpr):
    """A tensor's strides from the host's stride // ALIGN (``_strides_in``): the product with the
    constant tells Triton each is a multiple of ALIGN elements (16 bytes). Its launcher marks an
    int only when the int is a multiple of 16, so Hd 72's row stride of 72 (any Hd ≡ 8 mod 16,
    contiguous) got 2-byte loads and stores and no cp.async pipeline (``tl.multiple_of`` on the
    stride changed nothing); with ALIGN 8, 16-byte cp.async as at Hd 96 (sm_90 PTX of the forward,
    tests/test_attention.py)."""
    return stride_b * ALIGN, stride_h * ALIGN, stride_s * ALIGN


@triton.jit
def _load_pair(A, B, rows, stride_a, stride_b, offs_d, n_rows, ROW_MASK: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr = False):
    """(rows, BLOCK_D) tiles of A and B at the same rows (k and v, or q and dO), zeros where
    masked: rows past ``n_rows`` when ROW_MASK, padded head-dim columns always; interior tiles of
    a power-of-two head dim load without a mask. ALIGNED: every row starts on 16 bytes (for a
    kernel whose pointers and strides are not specialized, so that Triton cannot know). (One call
    for both tiles: every nested call costs the interpreter milliseconds.)"""
    a_ptrs = A + rows[:, None] * stride_a + offs_d[None, :]
    b_ptrs = B + rows[:, None] * stride_b + offs_d[None, :]
    if ALIGNED:
        a_ptrs = tl.multiple_of(a_ptrs, [16, 16])
        b_ptrs = tl.multiple_of(b_ptrs, [16, 16])
    if ROW_MASK:
        mask = _row_mask(rows, n_rows, offs_d, HEAD_DIM, BLOCK_D)
        a = tl.load(a_ptrs, mask=mask, other=0.0)
        b = tl.load(b_ptrs, mask=mask, other=0.0)
    elif HEAD_DIM != BLOCK_D:
        a = tl.load(a_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    return a, b


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d, lo, hi,
               SQ, SK, DIAG_LO, DIAG_HI, qk_scale, CAUSAL: tl.constexpr,
               BAND: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v = _load_pair(K, V, cols, stride_ks, stride_vs, offs_d, SK, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = _visible(offs_m[:, None], cols[None, :], SQ, SK, DIAG_LO, DIAG_HI, CAUSAL, BAND)
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; subtracting 0 instead makes its p
            # and alpha exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])
        else:
            # The max before scaling is the scaled scores' max for qk_scale >= 0, which
            # attention_forward ensures; one multiply a row instead of one an element.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(**_FWD_TUNE)
@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE,
                     stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                     stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                     H, GROUP, SQ, SK, DIAG_LO, DIAG_HI, S_BUCKET, qk_scale,
                     CAUSAL: tl.constexpr, BAND: tl.constexpr, ALIGN: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    stride_qb, stride_qh, stride_qs = _aligned(stride_qb, stride_qh, stride_qs, ALIGN)
    stride_kb, stride_kh, stride_ks = _aligned(stride_kb, stride_kh, stride_ks, ALIGN)
    stride_vb, stride_vh, stride_vs = _aligned(stride_vb, stride_vh, stride_vs, ALIGN)
    stride_ob, stride_oh, stride_os = _aligned(stride_ob, stride_oh, stride_os, ALIGN)
    start_m, bh, b, h, hk = _query_block(SQ, H, GROUP, BLOCK_M)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    O += b * stride_ob + h * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=_row_mask(offs_m, SQ, offs_d, HEAD_DIM, BLOCK_D), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if BAND:
        lo, full_lo, full_hi, hi = _block_ranges(start_m, SQ, SK, DIAG_LO, DIAG_HI,
                                                 BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_n,
                                   offs_d, lo, full_lo, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                                   CAUSAL, BAND, True, HEAD_DIM, BLOCK_D, BLOCK_N)
    else:
        lo, full_lo, full_hi, hi = _plain_ranges(start_m, SK, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_n,
                               offs_d, full_lo, full_hi, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                               CAUSAL, BAND, False, HEAD_DIM, BLOCK_D, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_n,
                               offs_d, full_hi, hi, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                               CAUSAL, BAND, True, HEAD_DIM, BLOCK_D, BLOCK_N)
    # l_i >= 1 for a row that saw a key (its maximum contributes exp2(0)); l_i = 0 and acc = 0
    # for one that saw none: it outputs 0 and its LSE is +inf (see the module docstring).
    seen = l_i > 0
    l_i = tl.where(seen, l_i, 1.0)
    tl.store(O + offs_m[:, None] * stride_os + offs_d[None, :],
             (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=_row_mask(offs_m, SQ, offs_d, HEAD_DIM, BLOCK_D))
    tl.store(LSE + bh * SQ + offs_m, tl.where(seen, m_i + tl.math.log2(l_i), float("inf")),
             mask=offs_m < SQ)


# Launched through cached_launch (``_delta``): ALIGNED stands in for the alignment Triton would
# otherwise specialize on (without it the loads are 2-byte, with it 16-byte: sm_90 PTX); the
# strides are int64 whatever their value (a batch stride reaches 2^31 at H 128, S 128k, Hd 128).
@triton.jit(do_not_specialize=["stride_ob", "stride_oh", "stride_os", "stride_dob", "stride_doh",
                               "stride_dos", "H", "SQ"],
            do_not_specialize_on_alignment=["O", "DO", "DELTA", "SEM"])
def _attn_bwd_delta_kernel(O, DO, DELTA, SEM, stride_ob: tl.int64, stride_oh: tl.int64,
                           stride_os: tl.int64, stride_dob: tl.int64, stride_doh: tl.int64,
                           stride_dos: tl.int64, H, SQ, ZERO_SEM: tl.constexpr,
                           ALIGNED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    bh = tl.program_id(1)
    if ZERO_SEM:  # one counter per program: (bh, query block)
        tl.store(SEM + bh * tl.num_programs(0) + tl.program_id(0), 0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o, do = _load_pair(O + b * stride_ob + h * stride_oh, DO + b * stride_dob + h * stride_doh,
                       offs_m, stride_os, stride_dos, offs_d, SQ, True, HEAD_DIM, BLOCK_D, ALIGNED)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * SQ + offs_m, delta, mask=offs_m < SQ)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qs, stride_dos, offs_n, offs_d, lo, hi,
                SQ, SK, DIAG_LO, DIAG_HI, qk_scale, CAUSAL: tl.constexpr,
                BAND: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do = _load_pair(Q, DO, offs_m, stride_qs, stride_dos, offs_d, SQ, MASKED, HEAD_DIM,
                           BLOCK_D)
        if MASKED:
            row_ok = offs_m < SQ
            lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
        else:
            lse = tl.load(LSE + offs_m)
            delta = tl.load(DELTA + offs_m)
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            keep = _visible(offs_m[None, :], offs_n[:, None], SQ, SK if BAND else None,
                            DIAG_LO, DIAG_HI, CAUSAL, BAND)
            pT = tl.where(keep, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.autotune(**_DKDV_TUNE)
@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                          stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                          stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
                          stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
                          H, GROUP, SQ, SK, DIAG_LO, DIAG_HI, S_BUCKET, qk_scale, sm_scale,
                          CAUSAL: tl.constexpr, BAND: tl.constexpr, ALIGN: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    stride_qb, stride_qh, stride_qs = _aligned(stride_qb, stride_qh, stride_qs, ALIGN)
    stride_kb, stride_kh, stride_ks = _aligned(stride_kb, stride_kh, stride_ks, ALIGN)
    stride_vb, stride_vh, stride_vs = _aligned(stride_vb, stride_vh, stride_vs, ALIGN)
    stride_dob, stride_doh, stride_dos = _aligned(stride_dob, stride_doh, stride_dos, ALIGN)
    stride_dkb, stride_dkh, stride_dks = _aligned(stride_dkb, stride_dkh, stride_dks, ALIGN)
    stride_dvb, stride_dvh, stride_dvs = _aligned(stride_dvb, stride_dvh, stride_dvs, ALIGN)
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    H_KV = H // GROUP
    b = (bhk // H_KV).to(tl.int64)
    hk = bhk % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k, v = _load_pair(K + b * stride_kb + hk * stride_kh, V + b * stride_vb + hk * stride_vh,
                      offs_n, stride_ks, stride_vs, offs_d, SK, True, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if BAND or BLOCK_N % BLOCK_M != 0:
        # The queries whose window holds any key of this block: the mirrored band.
        lo, full_lo, full_hi, hi = _block_ranges(start_n, SK, SQ, -DIAG_HI, -DIAG_LO,
                                                 BLOCK_N, BLOCK_M)
        diag_hi, tail_lo = full_lo, full_hi
    else:
        # Without a band, in the fewest scalars: the diagonal block's queries [start_n,
        # diag_hi) masked (causal), then [full_lo, full_hi) unmasked, then the ragged end.
        lo, hi = start_n, SQ
        diag_hi = tl.minimum(start_n + BLOCK_N, SQ)
        full_lo = start_n + BLOCK_N if CAUSAL else 0
        full_hi = SQ // BLOCK_M * BLOCK_M
        tail_lo = tl.maximum(full_lo, full_hi)
    # The G query heads of this key/value head, summed in a fixed order: no atomics.
    for g in range(GROUP):
        h = hk * GROUP + g
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        LSEh = LSE + (b * H + h) * SQ
        DELTAh = DELTA + (b * H + h) * SQ
        if BAND or CAUSAL:  # otherwise full_lo == 0: the next two loops cover every query
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qs, stride_dos,
                                 offs_n, offs_d, lo, diag_hi, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                                 CAUSAL, BAND, True, HEAD_DIM, BLOCK_D, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qs, stride_dos, offs_n,
                             offs_d, full_lo, full_hi, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                             CAUSAL, BAND, False, HEAD_DIM, BLOCK_D, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qs, stride_dos, offs_n,
                             offs_d, tail_lo, hi, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                             CAUSAL, BAND, True, HEAD_DIM, BLOCK_D, BLOCK_M)
    col_mask = _row_mask(offs_n, SK, offs_d, HEAD_DIM, BLOCK_D)
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_mask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d, lo, hi,
              SQ, SK, DIAG_LO, DIAG_HI, qk_scale, CAUSAL: tl.constexpr,
              BAND: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v = _load_pair(K, V, cols, stride_ks, stride_vs, offs_d, SK, MASKED, HEAD_DIM, BLOCK_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            keep = _visible(offs_m[:, None], cols[None, :], SQ, SK, DIAG_LO, DIAG_HI, CAUSAL, BAND)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.autotune(**_DQ_TUNE)
@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                        stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
                        stride_dqb, stride_dqh, stride_dqs,
                        H, GROUP, SQ, SK, DIAG_LO, DIAG_HI, S_BUCKET, qk_scale, sm_scale,
                        CAUSAL: tl.constexpr, BAND: tl.constexpr, ALIGN: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    stride_qb, stride_qh, stride_qs = _aligned(stride_qb, stride_qh, stride_qs, ALIGN)
    stride_kb, stride_kh, stride_ks = _aligned(stride_kb, stride_kh, stride_ks, ALIGN)
    stride_vb, stride_vh, stride_vs = _aligned(stride_vb, stride_vh, stride_vs, ALIGN)
    stride_dob, stride_doh, stride_dos = _aligned(stride_dob, stride_doh, stride_dos, ALIGN)
    stride_dqb, stride_dqh, stride_dqs = _aligned(stride_dqb, stride_dqh, stride_dqs, ALIGN)
    start_m, bh, b, h, hk = _query_block(SQ, H, GROUP, BLOCK_M)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < SQ
    q, do = _load_pair(Q + b * stride_qb + h * stride_qh, DO + b * stride_dob + h * stride_doh,
                       offs_m, stride_qs, stride_dos, offs_d, SQ, True, HEAD_DIM, BLOCK_D)
    lse = tl.load(LSE + bh * SQ + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * SQ + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if BAND:
        lo, full_lo, full_hi, hi = _block_ranges(start_m, SQ, SK, DIAG_LO, DIAG_HI,
                                                 BLOCK_M, BLOCK_N)
        dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                       lo, full_lo, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                       CAUSAL, BAND, True, HEAD_DIM, BLOCK_D, BLOCK_N)
    else:
        lo, full_lo, full_hi, hi = _plain_ranges(start_m, SK, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   full_lo, full_hi, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                   CAUSAL, BAND, False, HEAD_DIM, BLOCK_D, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   full_hi, hi, SQ, SK, DIAG_LO, DIAG_HI, qk_scale,
                   CAUSAL, BAND, True, HEAD_DIM, BLOCK_D, BLOCK_N)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=_row_mask(offs_m, SQ, offs_d, HEAD_DIM, BLOCK_D))


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_window(window, causal):
    if window is None:
        return
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)):
        raise ValueError(f"window must be None or (left, right), two ints >= 0, got {window!r}")
    if causal and window[1] > 0:
        raise ValueError(f"window right = {window[1]} with causal=True, which sees no key after "
                         f"the query: pass window=({window[0]}, 0), or causal=False")


def _check_inputs(q, k, v, causal, window):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, heads, S, Hd), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} unsupported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    B, H, _, Hd = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    Bk, Hkv, _, Hdk = k.shape  # the k/v length may differ from the q length
    if Hd % HEAD_DIM_MULTIPLE or not 0 < Hd <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {Hd} unsupported: it must be a multiple of "
                         f"{HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]")
    if Hdk != Hd:
        raise ValueError(f"k/v head dim {Hdk} != q head dim {Hd}")
    if Bk != B:
        raise ValueError(f"k/v batch {Bk} != q batch {B}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads H={H} must be a multiple of k/v heads Hkv={Hkv}")
    _check_window(window, causal)


def _launch_args(q, k, causal, window):
    """Length, band and tune-key arguments shared by the kernels: (SQ, SK, DIAG_LO, DIAG_HI,
    S_BUCKET). Key j of query i lies on diagonal j − i; the band is the diagonals
    Sk − Sq − left … Sk − Sq + right. An unlimited side is clamped to one that already reaches
    every key (left Sk, right Sq), so the kernels have no "unlimited" case."""
    Sq, Sk = q.shape[2], k.shape[2]
    left, right = (Sk, Sq) if window is None else window
    left, right = min(left, Sk), (0 if causal else min(right, Sq))
    # Tune for the longest run of keys (queries, for dK/dV) one block streams.
    longest = min(max(Sq, Sk), left + right + 1)
    return Sq, Sk, Sk - Sq - left, Sk - Sq + right, _s_bucket(longest)


def _path_args(q, k, causal, window):
    """The compile-time CAUSAL and BAND (a window, or Sq != Sk: see _visible)."""
    return {"CAUSAL": bool(causal), "BAND": window is not None or q.shape[2] != k.shape[2]}


def _head_dim_args(Hd):
    return {"HEAD_DIM": Hd, "BLOCK_D": max(16, next_power_of_2(Hd))}


def _align(*tensors):
    """The kernels' ALIGN: the elements in 16 bytes if every tensor's base is 16-byte aligned and
    its batch, head and row strides are multiples of them (``_aligned``), else 1. Also 1 with a
    stride of 2^31 or more: the launcher types that one int64, but its quotient could pass as
    int32 and overflow once multiplied back."""
    align = 16 // tensors[0].element_size()
    if all(t.data_ptr() % 16 == 0 and all(s % align == 0 and s < 2**31 for s in _strides(t))
           for t in tensors):
        return align
    return 1


def _strides_in(align, *tensors):
    """The tensors' ``_strides`` one after another, in units of ``align`` elements, as the
    kernels' ``_aligned`` takes them."""
    return tuple(s // align for t in tensors for s in _strides(t))


def attention_forward(q, k, v, causal=True, scale=None, window=None):
    """Launch the forward kernel.

    q: (B, H, Sq, Hd); k, v: (B, Hkv, Sk, Hd); fp16/bf16 (fp32 runs with tf32 dots on a GPU).
    Returns o (B, H, Sq, Hd) with q's dtype and strides, and lse (B, H, Sq) fp32: the base-2
    log-sum-exp of the scores scaled by scale·log2(e), which the backward reuses (+inf for a query
    that sees no key).
    """
    _check_inputs(q, k, v, causal, window)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, H, Sq, Hd = q.shape
    scale = 1.0 / math.sqrt(Hd) if scale is None else float(scale)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    if q.numel() == 0:
        return o, lse
    if scale < 0:
        # softmax(s·q·kᵀ) = softmax(|s|·(−q)·kᵀ), with the same LSE, so the backward takes q and s
        # as given. The kernels take a row's max before scaling: the scaled scores' max only for
        # s >= 0 (a negative s gave NaN).
        q, scale = -q, -scale
    # The Gluon forward masks scores before scaling them (-inf · 0 is NaN): a positive scale only.
    if scale > 0 and hopper_forward_ok(q, k, v, causal, window):
        return hopper_forward(q, k, v, o, lse, causal, scale * _LOG2E)
    grid = lambda meta: (cdiv(Sq, meta["BLOCK_M"]), B * H)  # noqa: E731
    align = _align(q, k, v, o)
    _attn_fwd_kernel[grid](
        q, k, v, o, lse, *_strides_in(align, q, k, v, o),
        H, H // k.shape[1], *_launch_args(q, k, causal, window), scale * _LOG2E,
        **_path_args(q, k, causal, window), ALIGN=align, **_head_dim_args(Hd),
    )
    return o, lse


def _delta(o, do, delta, sem):
    """delta = rowsum(dO ∘ O) in fp32. Also zeros ``sem`` when given: the deterministic Gluon
    backward's turn counters, one per (b, h, TURN_ROWS-row query block), so one per program here,
    which saves that backward a launch."""
    B, H, Sq, Hd = o.shape
    cached_launch(_attn_bwd_delta_kernel, (cdiv(Sq, TURN_ROWS), B * H), (o.dtype, do.dtype),
                  o, do, delta, delta if sem is None else sem, *_strides(o), *_strides(do), H, Sq,
                  ZERO_SEM=sem is not None, ALIGNED=aligned16(o, do), BLOCK_M=TURN_ROWS,
                  **_head_dim_args(Hd))


def attention_backward(do, q, k, v, o, lse, causal=True, scale=None, window=None,
                       deterministic=True):
    """Launch the backward kernels; returns dq, dk, dv shaped and typed like q, k, v.

    do, o: (B, H, Sq, Hd); lse: (B, H, Sq) fp32 from ``attention_forward``. Bit-reproducible
    unless ``deterministic=False``, which lets the Hopper kernel add the key blocks' dQ parts in
    arrival order (the Triton kernels are deterministic either way).
    """
    # Autograd saved the caller's q, k, v: the kernels take them, as the forward did, with a
    # unit last stride.
    q, k, v, do = (_last_dim_contiguous(t) for t in (q, k, v, do))
    B, H, Sq, Hd = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(Hd) if scale is None else float(scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:  # no query: keys and values get no gradient
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)
    if hopper_backward_ok(q, k, v, do, causal, window):
        sem = hopper_turn_counters(q) if deterministic else None
        launch = hopper_backward(do, q, k, v, lse, delta, sem, dq, dk, dv, causal, scale,
                                 scale * _LOG2E)
        _delta(o, do, delta, sem)
        return launch()
    _delta(o, do, delta, None)
    common = (H, H // Hkv, *_launch_args(q, k, causal, window), scale * _LOG2E, scale)
    align = _align(q, k, v, do, dq, dk, dv)
    constexprs = {**_path_args(q, k, causal, window), "ALIGN": align, **_head_dim_args(Hd)}
    if Sk > 0:
        _attn_bwd_dkdv_kernel[lambda meta: (cdiv(Sk, meta["BLOCK_N"]), B * Hkv)](
            q, k, v, do, lse, delta, dk, dv, *_strides_in(align, q, k, v, do, dk, dv), *common,
            **constexprs,
        )
    _attn_bwd_dq_kernel[lambda meta: (cdiv(Sq, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, *_strides_in(align, q, k, v, do, dq), *common, **constexprs,
    )
    return dq, dk, dv


class FlashAttentionFn(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, o and the fp32 log-sum-exp (O(Sq) memory), no scores."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window, deterministic):
        o, lse = attention_forward(q, k, v, causal, scale, window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.window, ctx.deterministic = causal, scale, window, deterministic
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.window,
                                        ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal=True, scale=None, window=None, deterministic=True):
    """Softmax attention without the Sq×Sk matrix.

    q: (B, H, Sq, Hd); k, v: (B, Hkv, Sk, Hd) with H % Hkv == 0; Hd a multiple of 8 up to 256;
    fp16 or bf16 (fp32 accepted). ``scale`` defaults to 1/sqrt(Hd). Query i sits at key position
    i' = i + Sk − Sq (bottom-right alignment) and sees key j iff i' − left <= j <= i' + right:
    ``window=(left, right)`` (ints >= 0; None: unlimited), right = 0 when ``causal``. A query
    that sees no key outputs 0. Returns (B, H, Sq, Hd) in q's dtype.
    """
    return FlashAttentionFn.apply(q, k, v, causal, scale, window, deterministic)
