"""The attention forward on Hopper (sm_90) in Gluon: warp-specialized, FlashAttention-3's scheme.

Why a second forward. The Triton forward (``flash_attn._attn_fwd_kernel``) reached 0.80× cuDNN
at Hd 128 on an H100 (bench/results/attention.md): every warp both waits for its loads and runs
the softmax between its two matmuls, so the tensor cores idle while the exponentials run. Triton
3.6's automatic warp specialization (``tl.range(warp_specialize=True)``) compiles but changes
nothing on Hopper (same registers and spills, no ``setmaxnreg``), and tensor-descriptor loads gave
3 %. Gluon lets the kernel say what FlashAttention-3 does (Shah et al. 2024, §3.1–3.2):

- **Warp specialization.** One producer warp only issues TMA loads: the 128-row Q tile as two
  64-row halves, then the K/V blocks through a ``STAGES``-deep ring of shared-memory slots with
  ready/empty mbarriers. Two consumer warpgroups each own one 64-row half and run its matmuls and
  softmax. Registers follow the roles (``setmaxnreg``): 24 for the producer, 240 for each consumer,
  so S (64×128 fp32), O (64×Hd fp32) and P live in registers without spills (``ptxas``: 0 bytes
  of stack; tests/test_attention.py cross-compiles it on CPU to keep it so).
- **Intra-warpgroup overlap.** Each consumer issues S(j) = Q·K(j)ᵀ and O += P(j−1)·V(j−1) as two
  asynchronous wgmma groups, waits for S(j) alone, and computes the softmax of S(j) while the P·V
  matmul still runs; only then it waits for O and rescales it. The exponentials hide behind the
  tensor cores instead of between them.
- Operands stay in shared memory (K and V as wgmma's B operand, Q as A); P goes to the P·V matmul
  from registers. The output reuses Q's slot for its TMA store.

Measured on an H100 (bf16, B·S = 16k, H 16 at Hd 128 and 32 at Hd 64; 3 alternating rounds of
do_bench, probe run 2026-11-24), ms against cuDNN through SDPA: Hd 128 S 4096 0.956 vs 0.925
(0.97×), causal 0.542 vs 0.530 (0.98×), S 16384 3.73 vs 3.72 (1.00×); S 1024 causal 0.86×. The
Triton forward in the same run: 0.80, 0.80, 0.85, 0.69×. At Hd 64 (S 4096 causal) the Triton
forward stays: 0.92× against this kernel's 0.89× (the 64×64 S·Q products leave the softmax
exposed; FA3 uses 192-row tiles there). A scheduling barrier that makes the two warpgroups take
turns at the tensor cores (FA3's ping-pong) measured within 2 % either way and is left out; so
were 64-wide key blocks (5–15 % slower) and three stages (within 2 %).

Scope: the plain case only (Sq == Sk, no window), Hd 128, fp16/bf16, an sm_90 GPU and
TMA-compatible strides (``hopper_forward_ok``); everything else takes the Triton kernels. The
output matches the Triton forward's contract (O in q's dtype and strides, base-2 LSE of the scaled
scores), so the Triton backward consumes it unchanged.
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_floor import tma_ok

# Hd 64 stays on the Triton forward, which was faster there (0.735 vs 0.760 ms at S 4096 causal).
HEAD_DIMS = (128,)
BLOCK_M = 128  # two consumer warpgroups × 64 rows
BLOCK_N = 128
STAGES = 2
CONSUMER_REGS = 240
PRODUCER_REGS = 24
# The register file is 64K per SM; one CTA of 12 warps (the producer's warpgroup counts whole):
# 168 × 384 threads fits, and setmaxnreg then moves 24 → 240 between the roles.
MAX_NREG = 168
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# Below some size the launch's host time decides: building four tensor descriptors and the
# warp-specialized launch cost more host time than the Triton kernel's. Measured on the H100 host
# (do_bench of the forward through flash_attention, 2026-11-24, bf16): at B 16, H 16, S 1024,
# causal (2^27 visible scores) this kernel took 0.191 ms against the Triton forward's 0.238
# (cuDNN 0.161). An earlier session's 0.309 vs 0.277 ms there predates the cached layouts and
# set the bar at 2^28; smaller calls are not measured and stay on Triton.
MIN_SCORES = 1 << 27


@gluon.jit
def _softmax_step(s_acc, m_i, l_i, start_n, start_m, offs_m, SK, qk_scale, CAUSAL: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax over one key block. Returns P (fp32, unnormalised), the rescale factor
    alpha of the old rows, and the new running max and sum. Only blocks that cross the diagonal
    or the sequence end pay for the mask."""
    need_mask = start_n + BLOCK_N > SK
    if CAUSAL:
        need_mask = need_mask | (start_n + BLOCK_N - 1 > start_m)
    if need_mask:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = cols[None, :] < SK
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= cols[None, :])
        s_acc = gl.where(keep, s_acc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_acc, 1))
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s_acc - m_sub[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s_acc, 1) * qk_scale)
        m_sub = m_new
        p = gl.exp2(s_acc * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_sub)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _producer(a, CAUSAL: gl.constexpr):
    """One warp: both Q halves, then every K/V block of the tile through the ring."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty,
     v_empty, LSE, b, h, hk, bh, start_m, SQ, SK, n_blocks, qk_scale) = a
    NSTAGE: gl.constexpr = k_smem.type.shape[0]
    HALF: gl.constexpr = q_smem.type.shape[3]
    BN: gl.constexpr = k_smem.type.shape[3]
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + w * HALF, 0], q_bars.index(w),
                                        q_smem.index(w))
    for j in range(n_blocks):
        s = j % NSTAGE
        phase = (j // NSTAGE) & 1
        # A fresh mbarrier counts as having completed the phase before 0, so the first pass
        # through the ring does not wait.
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BN, 0], k_ready.index(s),
                                        k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BN, 0], v_ready.index(s),
                                        v_smem.index(s))


@gluon.jit
def _consumer(a, WG: gl.constexpr, CAUSAL: gl.constexpr):
    """One warpgroup: query rows start_m + 64·WG ... + 63 against every key block."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty,
     v_empty, LSE, b, h, hk, bh, start_m, SQ, SK, n_blocks, qk_scale) = a
    NSTAGE: gl.constexpr = k_smem.type.shape[0]
    HALF: gl.constexpr = q_smem.type.shape[3]
    HEAD_D: gl.constexpr = q_smem.type.shape[4]
    BN: gl.constexpr = k_smem.type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    my_m = start_m + WG * HALF
    offs_m = my_m + gl.arange(0, HALF, layout=row_s)
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([HALF], gl.float32, layout=row_s)
    acc = gl.zeros([HALF, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF, BN], gl.float32, layout=s_layout)
    q_tile = q_smem.index(WG).reshape([HALF, HEAD_D])
    mbarrier.wait(q_bars.index(WG), 0)

    mbarrier.wait(k_ready.index(0), 0)
    k_tile = k_smem.index(0).reshape([BN, HEAD_D])
    s_acc = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_acc = warpgroup_mma_wait(0, deps=(s_acc, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, 0, my_m, offs_m, SK, qk_scale, CAUSAL,
                                       BN, s_layout)
    for j in range(1, n_blocks):
        s = j % NSTAGE
        sp = (j - 1) % NSTAGE
        mbarrier.wait(k_ready.index(s), (j // NSTAGE) & 1)
        k_tile = k_smem.index(s).reshape([BN, HEAD_D])
        s_acc = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_ready.index(sp), ((j - 1) // NSTAGE) & 1)
        v_tile = v_smem.index(sp).reshape([BN, HEAD_D])
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc, is_async=True)
        s_acc = warpgroup_mma_wait(1, deps=(s_acc, ))  # S(j) done; P(j-1)·V(j-1) still running
        mbarrier.arrive(k_empty.index(s), count=1)
        p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, j * BN, my_m, offs_m, SK, qk_scale,
                                           CAUSAL, BN, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    last = (n_blocks - 1) % NSTAGE
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // NSTAGE) & 1)
    v_tile = v_smem.index(last).reshape([BN, HEAD_D])
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    q_tile.store((acc / gl.convert_layout(l_safe, row_o)[:, None]).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, my_m, 0], q_smem.index(WG))
    gl.store(LSE + bh.to(gl.int64) * SQ + offs_m,
             gl.where(seen, m_i + gl.log2(l_safe), float("inf")), mask=offs_m < SQ)
    tma.store_wait(0)


@gluon.jit
def _consumer_0(a, CAUSAL: gl.constexpr):
    _consumer(a, 0, CAUSAL)


@gluon.jit
def _consumer_1(a, CAUSAL: gl.constexpr):
    _consumer(a, 1, CAUSAL)


@gluon.jit
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, GROUP, SQ, SK, qk_scale,
                            CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    HALF: gl.constexpr = BLOCK_M // 2
    pid = gl.program_id(0)
    if CAUSAL:
        pid = gl.cdiv(SQ, BLOCK_M) - 1 - pid  # the longest rows first: the tail wave is short
    start_m = pid * BLOCK_M
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # a slot is free once both warpgroups are done
        mbarrier.init(v_empty.index(i), count=2)
    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, SK)
    else:
        hi = SK
    # Both warpgroups walk the same blocks (the ring's slots are released by both); with
    # BLOCK_N == BLOCK_M the first half's last block still holds keys it sees.
    n_blocks = gl.cdiv(hi, BLOCK_N)
    a = (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready,
         k_empty, v_empty, LSE, b, h, hk, bh, start_m, SQ, SK, n_blocks, qk_scale)
    gl.warp_specialize([(_consumer_0, (a, CAUSAL)), (_consumer_1, (a, CAUSAL)),
                        (_producer, (a, CAUSAL))], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def hopper_forward_ok(q, k, v, causal, window) -> bool:
    """Whether ``hopper_forward`` serves these inputs (else the Triton kernels do)."""
    B, H, S, _ = q.shape
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)
            and window is None and k.shape[2] == S and S > 0
            and B * H * S * S // (2 if causal else 1) >= MIN_SCORES
            and q.shape[3] in HEAD_DIMS and q.dtype in _GL_DTYPES
            and all(t.stride(-1) == 1 for t in (q, k, v)) and tma_ok(q, k, v))


@functools.lru_cache(maxsize=None)
def _smem_layout(rows, head_dim, dtype):
    """The swizzled shared-memory layout of a (1, 1, rows, Hd) tile; cached: building it took
    4.5 µs of the launch's host time."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], _GL_DTYPES[dtype])


def _descriptor(t, rows):
    block = [1, 1, rows, t.shape[3]]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            _smem_layout(rows, t.shape[3], t.dtype))


def hopper_forward(q, k, v, o, lse, causal, scale_log2):
    """q, o: (B, H, S, Hd); k, v: (B, Hkv, S, Hd); lse: (B, H, S) fp32; ``scale_log2`` = softmax
    scale · log2(e). Fills ``o`` and ``lse`` as ``flash_attn.attention_forward`` allocates them
    and returns them."""
    B, H, S, Hd = q.shape
    _attn_fwd_hopper_kernel[(triton.cdiv(S, BLOCK_M), B * H)](
        _descriptor(q, BLOCK_M // 2), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N),
        _descriptor(o, BLOCK_M // 2), lse, H, H // k.shape[1], S, S, scale_log2, CAUSAL=causal,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=Hd, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAX_NREG)
    return o, lse
