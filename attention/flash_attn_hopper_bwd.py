"""The attention backward on Hopper (sm_90) in Gluon: five matmuls, dQ summed across key blocks.

Why. The Triton backward makes dK/dV in one kernel (per key block: S = QKᵀ, dP = dO·Vᵀ, dV, dK) and
dQ in a second (per query block: S and dP again, then dQ): seven matmuls where five suffice. At Hd
128 on an H100 its matmuls already ran at cuDNN's rate, so the two extra ones were the gap (2.34 +
1.21 ms against cuDNN's 2.48 ms at S 4096; a profile not kept in bench/results). This kernel
follows FlashAttention-3's backward (Shah et al. 2024, appendix), written in Gluon:

- **One CTA per (128-key block, K/V head).** K and V stay in shared memory. A producer warp
  streams the Q and dO blocks (64 rows at Hd 128, 128 at Hd 64: ``BLOCK_M``) and their LSE and
  Δ rows, of every query head in the group, through a ``STAGES``-deep ring (TMA, ready/empty
  mbarriers). Two consumer warpgroups (one 8-warp partition at 240 registers) hold dK and dV
  (128×Hd fp32 each) in registers.
- **Transposed products.** Each step computes Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (keys × queries), so
  Pᵀ and dSᵀ sit in registers as wgmma wants its A operand for dV += Pᵀ·dO and dK += dSᵀ·Q.
- **Hd 256: 64 keys a CTA, the head dim split.** 128×256 fp32 dK and dV do not fit in registers;
  with 64 keys each warpgroup holds half the head dim of them, computes Sᵀ and dPᵀ for half the
  query rows, and both write Pᵀ and dSᵀ to shared memory, from which every product's A operand
  then comes (FlashAttention-3's Hd 256 tiling); one Q/dO stage (``BLOCK_N``, ``STAGES``).
- **dQ in the same kernel.** dSᵀ goes to shared memory once (double-buffered, one barrier per
  step); dQ_i = dS·K is the fifth matmul. A writer warp adds its BLOCK_M×Hd fp32 partial into
  an fp32 accumulator by TMA reduce-add (L2-resident: the CTAs of one head run together).
  Deterministic, the key block that adds last into a dQ block knows it (its turn is the last),
  so up to ``FINISH_DQ_TO`` keys it takes the others' sum from the accumulator by TMA instead,
  adds its own and stores the block in q's dtype (``_finish_dq``); otherwise a pass after the
  kernel casts the accumulator.
- **Deterministic by default.** Float addition is not associative, so the order of the key blocks'
  adds into one dQ block must not depend on timing. With ``deterministic=True`` a counter per
  (query head, query block) makes a key block wait for its turn, after the blocks before it in
  a fixed order have added theirs and their adds have completed (FA3's scheme). The order follows
  the walk of the query blocks (``WALK_*``), chosen so that the block before in the order got
  there a step earlier instead of just now: then no CTA trails the previous one by an add's
  round trip at every block. The writer frees the shared-memory partial as soon as the TMA has
  read it, and waits for the add's completion only to release the turn.

Measured, fwd+bwd against cuDNN through SDPA, Hd 128, deterministic (bench/results/attention.md):
H200, the 2026-12-04 table, 1.034 / 1.017 / 1.021 / 0.997 / 0.998× non-causal at S 1k–16k and
1.086 / 1.023 / 1.036 / 1.022 / 1.006× causal (``deterministic=False`` 0.98–1.05×); H100,
2026-11-25, 0.99–1.02× non-causal and 0.99–1.06× causal. Probes on an H100 whose tables were not
kept: with one walk for all (DESCENDING) the turns cost 4–12 % (0.93 / 0.96 / 0.89 / 0.99× at S
4k / 16k, non-causal then causal): a CTA trailed its predecessor by an add's round trip at every
block. A wgmma left running across the loop's back edge made ptxas serialize every wgmma of the
kernel (C7515; 454 TFLOP/s instead of about 520 at S 4096), now checked by
tests/test_attention.py; LSE and Δ loaded by the consumers from global memory cost spills (they
come through shared memory now).

Scope as the forward's: Sq == Sk, no window, Hd 64, 128 or 256 (33-63, 65-127 on the first two's
tiles from ``flash_attn_hopper.WIDE_TILE_FROM`` keys), fp16/bf16, sm_90, TMA strides, ≥ 2^27
visible scores (``hopper_backward_ok``); the rest takes the Triton kernels.
"""

import functools
import os

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from attention.flash_attn_hopper import (gluon_case, kernel_head_dim, tma_descriptor,
                                         unchecked_descriptor)
from kernel_floor import cached_launch, cdiv, gluon_layout, partition_args, sm_count

# The order in which a CTA (one key block j) walks its query blocks, and so the fixed order of the
# key blocks' adds into each dQ block (``_turn``); ``_walk`` picks one per call.
# - DESCENDING: every CTA from the last block down; key blocks add in order 0, 1, … Each CTA then
#   trails its predecessor by one add's round trip (completion, release, poll) at every block.
# - CYCLIC (non-causal): CTA j starts at block j − 1 and wraps round, so at each step the CTAs of
#   a head sit on different blocks and the one before in a block's order got there a step earlier:
#   no waiting. A CTA also waits for CTAs launched after it, so all n_k CTAs of a head must be
#   resident at once.
# - ASCENDING (causal): CTA j walks up from its diagonal and the grid launches high j first; block
#   i's order is the nearest key block first, which reached it BLOCK_N / BLOCK_M steps earlier (CTA
#   j+1 starts that many blocks higher: two at Hd 128, one at Hd 64 and 256). Waits only for CTAs
#   launched before it, like DESCENDING.
# H100, fwd+bwd against cuDNN, deterministic, B·S 16k, H 16 (a probe, 5 alternating do_bench
# rounds): S 4096 0.916 → 0.975 non-causal, 0.893 → 0.974 causal; the non-deterministic mode gave
# 0.973 / 0.988 in the same run. At S 16384 (n_k 128) DESCENDING was as fast (1.016 / 0.984; Hd
# 128, before the Hd 64 kernel took 128-row steps); causal Hd 64 ascends at every length
# (``_walk``).
WALK_DESCENDING = gl.constexpr(0)
WALK_CYCLIC = gl.constexpr(1)
WALK_ASCENDING = gl.constexpr(2)
# Query rows per step, by head dim. At Hd 64, dK and dV take 32 registers a thread each, which
# leaves room for 128-column Sᵀ and dPᵀ tiles: half the steps per key block, so half the barriers
# and dQ hand-overs. H100, fwd+bwd against cuDNN (a probe, 5 alternating rounds, S 1k–16k, causal
# and not): 0.96–1.08× with 128 rows against 0.91–1.03× with 64 (and 0.90–0.98× for the Triton
# backward). Its cost: ptxas keeps up to 6 scalars on the stack, one reloaded per step, beside the
# wgmmas. At Hd 128 the 64-column tiles already fill the consumers' 240 registers.
BLOCK_M = {64: 128, 128: 64, 256: 64}
HEAD_DIMS = tuple(BLOCK_M)
# One turn counter per TURN_ROWS query rows, the finest block: the Δ kernel zeroes them all, and a
# kernel with coarser blocks uses the first B·H·⌈S / BLOCK_M⌉ (``hopper_turn_counters``).
TURN_ROWS = min(BLOCK_M.values())
# Keys per CTA: two warpgroups × 64, each holding its keys' rows of dK and dV. At Hd 256 those rows
# would take 256 registers a thread, so a CTA takes 64 keys and the warpgroups split the head dim
# instead (``_bwd_consumer``: FlashAttention-3's Hd 256 tiling, 64 × 64 with one Q/dO stage). Its
# buffers, 224 of the kernel's 225 KB of shared memory: Q, dO, K, V 32 KB each, Pᵀ and dSᵀ
# double-buffered 16 KB each, the fp32 dQ partial 64 KB; no room for a second stage or
# ``FINISH_DQ``'s 64 KB.
BLOCK_N = {64: 128, 128: 128, 256: 64}
STAGES = {64: 2, 128: 2, 256: 1}
CONSUMER_REGS = 240
PRODUCER_REGS = 24
MAX_NREG = 168  # 12 warps (8 consumers, the producer's warpgroup) × 168 = the 64K register file
# At 2^27 visible scores (B 16, H 16, S 1024, causal) the Triton backward was once faster (fwd+bwd
# 1.042 against 1.068 ms), but that call is bound by host time, and this path's launches now cost
# less of it (kernel_floor.cached_launch, the Δ kernel zeroing the turn counters): H100, do_bench
# fwd+bwd, 0.845 against 0.937 ms (cuDNN 0.771), and 1.04 against 0.87× cuDNN on another host
# (2026-11-24). Below 2^27 the two took turns (host-bound either way). Measured at Hd 128; Hd 64
# takes the same threshold, unmeasured below it.
MIN_SCORES = 1 << 27
# Up to this many keys the deterministic kernel finishes dQ itself (``FINISH_DQ``: the last adder
# of each block takes the others' sum back and stores the block in q's dtype), instead of a pass
# over the fp32 accumulator after it (48 µs of a 660 µs fwd+bwd at Hd 128 S 1k causal). The last
# adder waits for that sum at its step, and the walks order the adds by arrival, so one CTA a
# head is the last adder of every block (ASCENDING: key block 0; DESCENDING non-causal: n_k − 1)
# or of the upper half of them (CYCLIC at Hd 128); elsewhere (CYCLIC at Hd 64, DESCENDING causal)
# each CTA finishes the blocks at the end of its walk: the cost grows with the walk. H200,
# fwd+bwd against the pass, 7 alternating rounds, same bits, two runs at S 1k: 1.011 and 1.040×
# (Hd 128 causal), 1.015 and 1.009× (Hd 128), 1.061 and 1.052× (Hd 64 causal), 1.023 and 1.014×
# (Hd 64); one run at S 4k: 1.005 / 0.975× (Hd 128 causal / not), 1.018 / 1.003× (Hd 64); S 16k:
# 0.999 / 0.985×, 0.981 / 1.011× (2026-12-03, bench/results/attention.md); at S 2k 0.998 /
# 0.998× (Hd 128), 1.020 / 1.004× (Hd 64), A-vs-A 0.994-1.000 (2026-12-04): not a win at every
# row, so the gate stays at 1k. A version that finished a step late, to hide the wait, lost more
# (0.967-0.992× at S 4k-16k) and broke the repeat bits at Hd 64.
FINISH_DQ_TO = 1024


def finishes_dq(deterministic: bool, seq_len: int, head_d: int) -> bool:
    """Whether the kernel finishes dQ itself (``FINISH_DQ``): deterministic, to ``FINISH_DQ_TO``
    keys, and where its 64-row sum of the others fits beside the rest (not Hd 256's tiling)."""
    return deterministic and seq_len <= FINISH_DQ_TO and BLOCK_N[head_d] == 128
# A deterministic CTA that waits this long for its turn traps (``_wait_for_turn``): the longest
# honest wait is a head's backward, milliseconds.
STUCK_NS = 10 * 10**9


@gluon.jit
def _query_block(a, it, WALK: gl.constexpr):
    """Step ``it`` of the CTA's walk: (head within the group, query block)."""
    g = it // a.n_i
    r = it - g * a.n_i
    if WALK == WALK_ASCENDING:
        i = a.i_hi - a.n_i + 1 + r
    elif WALK == WALK_CYCLIC:
        i = (a.i_hi - r + a.j) % a.n_i
    else:
        i = a.i_hi - r
    return g, i


@gluon.jit
def _turn(i, j, n_k, BM: gl.constexpr, BN: gl.constexpr, WALK: gl.constexpr):
    """Key block j's place in the fixed order of adds into query block i (see the walks)."""
    if WALK == WALK_ASCENDING:
        t = gl.minimum((i * BM + BM - 1) // BN, n_k - 1) - j
    elif WALK == WALK_CYCLIC:
        # The CTAs past block i reached it after wrapping round, so they add first.
        if j > i:
            t = j - i - 1
        else:
            t = gl.maximum(n_k - i - 1, 0) + j
    else:
        t = j
    return t


@gluon.jit
def _last_turn(i, n_k, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """The last place in query block i's order of adds: its key blocks less one (the causal
    ones up to its last row's, as ``_turn`` counts them)."""
    if CAUSAL:
        return gl.minimum((i * BM + BM - 1) // BN, n_k - 1)
    else:
        return n_k - 1


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of a shared-memory tile into global memory (cp.reduce.async.bulk.tensor).
    Gluon 3.6's hopper ``tma`` module has only the plain copy; its builder has the reduce."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _warp_ptx(ptx: gl.constexpr):
    """The writer warp issues the operand-less PTX statement ``ptx`` (an elementwise asm over one
    warp's lanes, its dummy result a copy of the input)."""
    one_warp: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise(ptx + "\n mov.b32 $0, $1;", "=r,r",
                              [gl.full([32], 0, gl.int32, layout=one_warp)], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _bulk_wait_all():
    """``cp.async.bulk.wait_group 0``: this thread's bulk copies have completed their writes.
    (``tma.store_wait`` is the ``.read`` form: only the shared-memory source is free.)"""
    _warp_ptx("cp.async.bulk.wait_group 0;")


@gluon.jit
def _fence_proxy_async_global():
    """``fence.proxy.async.global``: what this thread's generic loads saw (the turn's acquire) is
    ordered before its next TMA read of global memory."""
    _warp_ptx("fence.proxy.async.global;")


@gluon.jit
def _wait_for_turn(sem, turn, stuck_ns):
    """Spin (acquire loads) until the counter at ``sem`` equals ``turn``. A CTA that waits longer
    than ``stuck_ns`` traps: the kernel fails with an error instead of hanging the GPU, should a
    CTA it waits for never run (CYCLIC with fewer SMs free than ``_walk`` assumed)."""
    one_warp: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lanes = gl.zeros([32], gl.int32, layout=one_warp)
    gl.inline_asm_elementwise(
        """{
        .reg .pred ok, late;
        .reg .u32 seen;
        .reg .u64 start, now;
        mov.u64 start, %globaltimer;
        TURN_POLL:
        ld.acquire.gpu.global.u32 seen, [$1];
        setp.eq.u32 ok, seen, $2;
        @ok bra TURN_DONE;
        mov.u64 now, %globaltimer;
        sub.u64 now, now, start;
        setp.gt.u64 late, now, $3;
        @late trap;
        bra TURN_POLL;
        TURN_DONE:
        mov.u32 $0, seen;
        }""", "=r,l,r,l", [sem + lanes, turn + lanes, stuck_ns + lanes.to(gl.int64)],
        dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _finish_dq(dq_smem, acc_smem, dq_out, acc_bar, it, add):
    """The consumers' last partial of a dQ block (in ``dq_smem``) plus, if ``add``, the sum of
    the earlier ones (``acc_smem``, by TMA from the accumulator), in q's dtype into ``dq_out``
    (``dq_smem``'s first half). Through shared memory in a plain layout, not from the wgmma
    registers: a second store path from those (fp32 and q's dtype) cost the Hd 64 step 2-3
    reloaded spills at every step (sm_90 SASS)."""
    HEAD_D: gl.constexpr = dq_smem.type.shape[1]
    # 16-byte reads, a row of Hd fp32 across HEAD_D // 4 lanes, 8 warps down the rows
    rows: gl.constexpr = gl.BlockedLayout([1, 4], [128 // HEAD_D, HEAD_D // 4], [8, 1], [1, 0])
    gl.thread_barrier()  # both warpgroups' rows are in dq_smem
    dq = dq_smem.load(rows)
    if add:
        mbarrier.wait(acc_bar, it & 1)
        dq = acc_smem.load(rows) + dq  # the one fp32 addition the TMA add made: the same bits
    gl.thread_barrier()  # every row read before the narrower copy overwrites dq_smem
    dq_out.store(dq.to(dq_out.dtype))


@partition_args
class _BwdArgs:
    """What the three partitions of one CTA share."""
    # global memory: the TMA descriptors, the LSE and Δ rows, the turn counters
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    dk_desc: tma.tensor_descriptor
    dv_desc: tma.tensor_descriptor
    dq_desc: tma.tensor_descriptor  # the fp32 accumulator, rows (b·H + h)·SQ_PAD + query
    dqo_desc: tma.tensor_descriptor  # dq in q's dtype (FINISH_DQ; otherwise q_desc, unused)
    LSE: gl.tensor
    DELTA: gl.tensor
    SEM: gl.tensor
    # shared memory and its mbarriers
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    pt_smem: gl.shared_memory_descriptor  # Pᵀ where the warpgroups split the head dim
    dq_smem: gl.shared_memory_descriptor
    acc_smem: gl.shared_memory_descriptor
    lse_smem: gl.shared_memory_descriptor
    delta_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor
    dq_full: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    acc_bar: gl.shared_memory_descriptor
    # the CTA's work: batch, K/V head and key block; n_i query blocks of each of GROUP heads,
    # the last of them i_hi
    b: gl.tensor
    hk: gl.tensor
    j: gl.tensor
    H: gl.tensor
    GROUP: gl.tensor
    SQ: gl.tensor
    SQ_PAD: gl.tensor
    n_i: gl.tensor
    i_hi: gl.tensor
    qk_scale: gl.tensor
    sm_scale: gl.tensor


@gluon.jit
def _bwd_producer(a, WALK: gl.constexpr):
    """One warp: K and V once, then Q and dO of every step through the ring."""
    NSTAGE: gl.constexpr = a.q_smem.type.shape[0]
    BM: gl.constexpr = a.q_smem.type.shape[3]
    BN: gl.constexpr = a.k_smem.type.shape[2]
    row_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
    mbarrier.expect(a.kv_bar, a.k_desc.block_type.nbytes + a.v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a.k_desc, [a.b, a.hk, a.j * BN, 0], a.kv_bar, a.k_smem)
    tma.async_copy_global_to_shared(a.v_desc, [a.b, a.hk, a.j * BN, 0], a.kv_bar, a.v_smem)
    for it in range(a.GROUP * a.n_i):
        g, i = _query_block(a, it, WALK)
        h = a.hk * a.GROUP + g
        s = it % NSTAGE
        phase = (it // NSTAGE) & 1
        # A fresh mbarrier counts as having completed the phase before 0: no wait on the first lap.
        mbarrier.wait(a.qdo_empty.index(s), phase ^ 1)
        mbarrier.expect(a.q_ready.index(s), a.q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a.q_desc, [a.b, h, i * BM, 0], a.q_ready.index(s),
                                        a.q_smem.index(s))
        mbarrier.expect(a.do_ready.index(s), a.do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a.do_desc, [a.b, h, i * BM, 0], a.do_ready.index(s),
                                        a.do_smem.index(s))
        # LSE and Δ of the block's rows go through shared memory too: loaded by the consumers,
        # their latency sat in every step, and their 16 columns per thread cost registers. A row
        # past the end gets LSE +inf, so P = 0 there (its Q and dO rows are TMA zeros).
        rows = i * BM + gl.arange(0, BM, layout=row_layout)
        bh = (a.b * a.H + h).to(gl.int64)
        in_q = rows < a.SQ
        a.lse_smem.index(s).store(gl.load(a.LSE + bh * a.SQ + rows, mask=in_q, other=float("inf")))
        a.delta_smem.index(s).store(gl.load(a.DELTA + bh * a.SQ + rows, mask=in_q, other=0.0))
        mbarrier.arrive(a.q_ready.index(s), count=1)


@gluon.jit
def _bwd_consumer(a, CAUSAL: gl.constexpr, FINISH_DQ: gl.constexpr, WALK: gl.constexpr):
    """Two warpgroups (8 warps): keys j·BN … against every query block of the group. With
    ``FINISH_DQ``, where this key block adds last into a dQ block, the sum so far comes from the
    writer (``acc_smem``) and the finished block goes out in q's dtype."""
    NSTAGE: gl.constexpr = a.q_smem.type.shape[0]
    BM: gl.constexpr = a.q_smem.type.shape[3]
    HEAD_D: gl.constexpr = a.q_smem.type.shape[4]
    BN: gl.constexpr = a.k_smem.type.shape[2]
    dtype: gl.constexpr = a.q_desc.dtype
    # 128 keys: Sᵀ and dPᵀ (BN × BM), each warpgroup owning 64 keys; dK and dV (BN × Hd) likewise,
    # Pᵀ and dSᵀ their A operands from registers. 64 keys (Hd 256): each warpgroup owns half the
    # queries of Sᵀ and dPᵀ and half the head dim of dK and dV, whose A operands (all the keys'
    # and queries' Pᵀ and dSᵀ) then come from shared memory.
    SPLIT_HEAD: gl.constexpr = BN == 64
    if SPLIT_HEAD:
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, BM // 2, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, HEAD_D // 2, 16])
    else:
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, BM, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, HEAD_D, 16])
    # dQ (BM × Hd): one 64-row tile has the warpgroups split Hd; 128 rows, the rows.
    if BM == 64:
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, HEAD_D // 2, 16])
    else:
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    per_query: gl.constexpr = gl.SliceLayout(0, st_layout)

    start_n = a.j * BN
    keys = start_n + gl.arange(0, BN, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([BN, HEAD_D], gl.float32, layout=kv_layout)
    dv = gl.zeros([BN, HEAD_D], gl.float32, layout=kv_layout)
    dq_zero = gl.zeros([BM, HEAD_D], gl.float32, layout=dq_layout)
    st_zero = gl.zeros([BN, BM], gl.float32, layout=st_layout)
    k_tile = a.k_smem.reshape([BN, HEAD_D])
    v_tile = a.v_smem.reshape([BN, HEAD_D])
    dq_out = a.dq_smem._reinterpret(dtype, [1, 1, BM, HEAD_D], a.dqo_desc.layout)
    dq_out = dq_out.reshape([BM, HEAD_D])
    n_k = gl.cdiv(a.SQ, BN)
    mbarrier.wait(a.kv_bar, 0)
    for it in range(a.GROUP * a.n_i):
        g, i = _query_block(a, it, WALK)
        start_m = i * BM
        s = it % NSTAGE
        phase = (it // NSTAGE) & 1
        cols = start_m + gl.arange(0, BM, layout=per_query)
        mbarrier.wait(a.q_ready.index(s), phase)
        q_tile = a.q_smem.index(s).reshape([BM, HEAD_D])
        st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        mbarrier.wait(a.do_ready.index(s), phase)
        do_tile = a.do_smem.index(s).reshape([BM, HEAD_D])
        dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, ))  # dPᵀ may still run
        pt = gl.exp2(st * a.qk_scale - a.lse_smem.index(s).load(per_query)[None, :])
        if CAUSAL:
            if start_m < start_n + BN - 1:  # the block crosses the diagonal
                pt = gl.where(cols[None, :] >= keys[:, None], pt, 0.0)
        if SPLIT_HEAD:
            pt_buf = a.pt_smem.index(it % 2)
            pt_buf.store(pt.to(dtype))
            dpt = warpgroup_mma_wait(0, deps=(dpt, ))
        else:
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_tile, dv,
                               is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt, ))  # dV += Pᵀ·dO may still run
        # dSᵀ = Pᵀ ∘ (dPᵀ − Δ), with the softmax scale folded in for both dK and dQ.
        ds = (pt * (dpt - a.delta_smem.index(s).load(per_query)[None, :]) * a.sm_scale).to(dtype)
        ds_buf = a.ds_smem.index(it % 2)
        ds_buf.store(ds)
        fence_async_shared()
        # Both warpgroups' keys (or queries) are in dSᵀ (and Pᵀ) before either reads all of it.
        # The buffers written here were last read by the products two steps ago, which both
        # warpgroups waited for in the previous step, before its barrier.
        gl.thread_barrier()
        if SPLIT_HEAD:
            dv = warpgroup_mma(pt_buf, do_tile, dv, is_async=True)
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_tile, dq_zero, use_acc=False, is_async=True)
        if SPLIT_HEAD:
            dk = warpgroup_mma(ds_buf, q_tile, dk, is_async=True)
        else:
            dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q_tile, dk, is_async=True)
        # dQ goes before dK, so its hand-over to the writer overlaps the dK product. Every wgmma
        # is waited for within its step: one still running across the loop's back edge made
        # ptxas serialize all of them (C7515: 454 TFLOP/s at S 4096, each HGMMA waited on).
        dq, dv = warpgroup_mma_wait(1, deps=(dq, dv))
        mbarrier.wait(a.dq_empty, (it & 1) ^ 1)
        a.dq_smem.store(dq)
        if FINISH_DQ:
            last_turn = _last_turn(i, n_k, BM, BN, CAUSAL)
            if _turn(i, a.j, n_k, BM, BN, WALK) == last_turn:
                _finish_dq(a.dq_smem, a.acc_smem, dq_out, a.acc_bar, it, last_turn > 0)
        fence_async_shared()
        mbarrier.arrive(a.dq_full, count=1)
        dk = warpgroup_mma_wait(0, deps=(dk, ))
        mbarrier.arrive(a.qdo_empty.index(s), count=1)

    k_tile.store(dk.to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(a.dk_desc, [a.b, a.hk, start_n, 0], a.k_smem)
    tma.async_copy_shared_to_global(a.dv_desc, [a.b, a.hk, start_n, 0], a.v_smem)
    tma.store_wait(0)


@gluon.jit
def _bwd_dq_writer(a, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr, FINISH_DQ: gl.constexpr,
                   WALK: gl.constexpr, stuck_ns):
    """One warp: adds each step's dQ partial (shared memory, fp32) into the accumulator by TMA.
    With ``FINISH_DQ`` (deterministic), the last adder of a dQ block instead loads the sum of the
    others for the consumers (``acc_smem``) and stores what they finish from it, in q's dtype,
    into dq: no pass over the accumulator after the kernel, and its last adds never happen."""
    BM: gl.constexpr = a.q_smem.type.shape[3]
    BN: gl.constexpr = a.k_smem.type.shape[2]
    HEAD_D: gl.constexpr = a.q_smem.type.shape[4]
    dq_out = a.dq_smem._reinterpret(a.dqo_desc.dtype, [1, 1, BM, HEAD_D], a.dqo_desc.layout)
    n_k = gl.cdiv(a.SQ, BN)
    for it in range(a.GROUP * a.n_i):
        g, i = _query_block(a, it, WALK)
        bh = a.b * a.H + a.hk * a.GROUP + g
        # The first in the fixed order stores instead of adding, so the accumulator need not be
        # zeroed first (a 4·B·H·S·Hd-byte pass, ~4 % of fwd+bwd at S 1024).
        first = False
        last = False
        if DETERMINISTIC:
            # Wait for this block's turn before the partial is even ready: the poll's latency
            # then hides behind the consumers' step instead of adding to the chain of turns.
            sem = a.SEM + bh * (a.i_hi + 1) + i
            turn = _turn(i, a.j, n_k, BM, BN, WALK)
            _wait_for_turn(sem, turn, stuck_ns)
            first = turn == 0
        if FINISH_DQ:
            last = turn == _last_turn(i, n_k, BM, BN, CAUSAL)
            if last and turn > 0:
                # acc_smem is free: the consumers read it before the last dq_full this warp took.
                _fence_proxy_async_global()
                mbarrier.expect(a.acc_bar, a.dq_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a.dq_desc, [bh * a.SQ_PAD + i * BM, 0], a.acc_bar,
                                                a.acc_smem)
            else:
                # acc_bar completes a phase every step, so the consumers wait on the step's parity.
                mbarrier.arrive(a.acc_bar, count=1)
        mbarrier.wait(a.dq_full, it & 1)
        if last:
            tma.async_copy_shared_to_global(a.dqo_desc, [a.b, a.hk * a.GROUP + g, i * BM, 0],
                                            dq_out)
        elif first:
            tma.async_copy_shared_to_global(a.dq_desc, [bh * a.SQ_PAD + i * BM, 0], a.dq_smem)
        else:
            _tma_reduce_add(a.dq_desc, [bh * a.SQ_PAD + i * BM, 0], a.dq_smem)
        tma.store_wait(0)  # the partial has left shared memory: the consumers may write the next
        mbarrier.arrive(a.dq_empty, count=1)
        if DETERMINISTIC:
            _bulk_wait_all()  # the adds have landed in L2, not only been read
            gl.thread_barrier()
            gl.atomic_add(sem, 1, sem="release")


# Launched through cached_launch, so nothing but the constexprs and dtypes may pick the binary.
@gluon.jit(do_not_specialize=["H", "GROUP", "SQ", "SQ_PAD", "stuck_ns"],
           do_not_specialize_on_alignment=["LSE", "DELTA", "SEM"])
def _attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, dqo_desc,
                            LSE, DELTA, SEM, H, GROUP, SQ, SQ_PAD, qk_scale, sm_scale, stuck_ns,
                            CAUSAL: gl.constexpr,
                            DETERMINISTIC: gl.constexpr, FINISH_DQ: gl.constexpr,
                            WALK: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    if WALK == WALK_ASCENDING:
        j = gl.cdiv(SQ, BLOCK_N) - 1 - gl.program_id(0)
    else:
        j = gl.program_id(0)  # key block; the fastest grid axis, so a head's CTAs start together
    bhk = gl.program_id(1)
    HKV = H // GROUP
    b = bhk // HKV
    hk = bhk % HKV
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    if BLOCK_N == 64:  # the warpgroups split the head dim: Pᵀ goes through shared memory too
        pt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    else:  # (not used)
        pt_smem = ds_smem
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], dq_desc.layout)
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gl.static_assert(DETERMINISTIC or not FINISH_DQ, "only a fixed order knows the last add")
    gl.static_assert(BLOCK_N == 128 or not FINISH_DQ, "no room for the sum at 64 keys")
    if FINISH_DQ:  # the last adders' sums of the others: 32 KB, 226 of the 227 KB with it
        acc_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], dq_desc.layout)
        acc_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(acc_bar, count=1)
    else:  # (neither is used)
        acc_smem = dq_smem
        acc_bar = dq_full
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(dq_full, count=1)
    mbarrier.init(dq_empty, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=2)  # Q's bytes, and the producer's LSE/Δ stores
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=1)
    n_q = gl.cdiv(SQ, BLOCK_M)
    if CAUSAL:
        i_lo = (j * BLOCK_N) // BLOCK_M  # earlier query blocks see none of these keys
    else:
        i_lo = 0
    a = _BwdArgs(q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, do_desc=do_desc, dk_desc=dk_desc,
                 dv_desc=dv_desc, dq_desc=dq_desc, dqo_desc=dqo_desc, LSE=LSE, DELTA=DELTA, SEM=SEM,
                 q_smem=q_smem, do_smem=do_smem, k_smem=k_smem, v_smem=v_smem, ds_smem=ds_smem,
                 pt_smem=pt_smem, dq_smem=dq_smem, acc_smem=acc_smem, lse_smem=lse_smem,
                 delta_smem=delta_smem, kv_bar=kv_bar, q_ready=q_ready, do_ready=do_ready,
                 qdo_empty=qdo_empty,
                 dq_full=dq_full, dq_empty=dq_empty, acc_bar=acc_bar, b=b, hk=hk, j=j, H=H,
                 GROUP=GROUP, SQ=SQ, SQ_PAD=SQ_PAD, n_i=n_q - i_lo, i_hi=n_q - 1,
                 qk_scale=qk_scale, sm_scale=sm_scale)
    gl.warp_specialize([(_bwd_consumer, (a, CAUSAL, FINISH_DQ, WALK)), (_bwd_producer, (a, WALK)),
                        (_bwd_dq_writer, (a, CAUSAL, DETERMINISTIC, FINISH_DQ, WALK, stuck_ns))],
                       [1, 1],
                       [PRODUCER_REGS, PRODUCER_REGS])


def hopper_backward_ok(q, k, v, do, causal, window) -> bool:
    """Whether ``hopper_backward`` serves these inputs (else the Triton kernels do)."""
    return (gluon_case(q, k, causal, window, MIN_SCORES, HEAD_DIMS, q, k, v, do)
            # An expanded gradient (grad_outputs=w.expand(...)) has zero strides, which TMA
            # descriptors were never tried with; the Triton kernels take any stride.
            and 0 not in do.stride())


@functools.lru_cache(maxsize=None)
def _walk(causal, n_k, device, head_d):
    """The walk for a call (see WALK_*). CYCLIC needs a head's n_k CTAs resident together (one per
    SM: the kernel takes 198 KB of shared memory at Hd 128, 226 KB with ``FINISH_DQ``, 225 KB at
    Hd 256, whose 64-key CTAs make n_k twice as large for a length). It is used only
    where they fit in half the SMs, leaving room for kernels on other streams (NCCL), and not
    under an MPS thread limit set in this process's environment. A limit set by the MPS daemon,
    or an SM partition, is not visible here: should fewer than n_k SMs be free, the waiting CTAs
    trap after ``STUCK_NS`` (an error, not a hang); pass ``deterministic=False`` there. Past that
    size DESCENDING measured as fast, but for the causal Hd 64 kernel: ASCENDING, which waits only
    for CTAs launched before it and so needs none resident together, ran 1.076 / 1.072 / 1.050×
    DESCENDING at S 12k / 16k / 32k (A-vs-A 0.995-1.001; H200, fwd+bwd, 7 alternating rounds,
    2026-12-04, bench/results/attention.md); at Hd 128 1.017× at 12k and 0.989× at 16k, and
    0.997 / 0.993× at 16k / 32k in a later run: its turns cost nothing there (nondet / det
    1.001-1.002) but its schedule 2-3 % (nondet ASCENDING / DESCENDING 0.971 / 0.980; a host model
    of the launch order, a head's longest CTA last, puts that in the tail), as much as
    DESCENDING's turns (1.4-2.8 %). ASCENDING with the launch's last head descending (its longest
    CTA first) ran 0.98-1.03× the shipped walks, about 1 % faster from 4k keys: not kept (its last
    head's bits would depend on the batch; 047533b, bench/results/attention.md). At Hd 64 with
    ``deterministic=False`` (no turns) ASCENDING ran 0.983 / 1.000× DESCENDING at S 16k / 32k:
    short of the loss at both lengths that a rule per mode needed, so both modes ascend. The walk
    fixes the order of the adds, so dQ's bits depend on it, hence (but for causal Hd 64) on the
    device's SM count: repeats on one setup are bit-identical, an H100 SXM and PCIe may differ in
    the last bits. Cached per (causal, n_k, device, head dim), the environment read once: its
    8–16 µs of host time sat between the Δ and backward launches (H100 host)."""
    if causal and head_d == 64:
        return int(WALK_ASCENDING)
    if n_k > sm_count(device) // 2:
        return int(WALK_DESCENDING)
    if causal:
        return int(WALK_ASCENDING)
    if os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        return int(WALK_DESCENDING)
    return int(WALK_CYCLIC)


def walk_possible(walk, causal) -> bool:
    """Whether ``_walk`` can pick ``walk`` for this causality: DESCENDING either way, ASCENDING
    causal only (it starts at the diagonal), CYCLIC non-causal only (it starts at block 0), as
    ``_turn``'s orders assume."""
    other = WALK_ASCENDING if causal else WALK_CYCLIC
    return walk in (WALK_DESCENDING.value, other.value)


def hopper_turn_counters(q):
    """The deterministic mode's turn counters, one per (b, h, TURN_ROWS query rows), not zeroed:
    the Δ kernel that runs first zeros them (``flash_attn._delta``), one launch fewer."""
    return torch.empty(q.shape[0] * q.shape[1], cdiv(q.shape[2], TURN_ROWS),
                       device=q.device, dtype=torch.int32)


def hopper_backward(do, q, k, v, lse, delta, sem, dq, dk, dv, causal, scale, scale_log2):
    """Prepares the fill of dq, dk, dv (allocated like q, k, v) from the forward's base-2 LSE and
    ``flash_attn.attention_backward``'s delta (rowsum(dO ∘ O), fp32); ``scale_log2`` = scale ·
    log2(e). Deterministic when given ``sem``, zeroed ``hopper_turn_counters``; None: dQ's parts
    are added in arrival order.

    Returns ``launch``, to call once the Δ kernel that fills ``delta`` (and zeros ``sem``) is
    queued: it launches this kernel and returns (dq, dk, dv). The accumulator and the descriptors
    are built before, so that the Δ kernel's run on the GPU covers only the launch's host time
    (one-process A/B, H100: 1.07× fwd+bwd at B 16, H 16, S 1k causal, where the GPU waited for
    the host; 1.00× where it did not)."""
    B, H, S, Hd = q.shape
    Hkv = k.shape[1]
    head_d = kernel_head_dim(Hd, S, HEAD_DIMS)  # the tile width: >= Hd
    block_m, block_n = BLOCK_M[head_d], BLOCK_N[head_d]
    n_k = cdiv(S, block_n)
    s_pad = cdiv(S, block_m) * block_m  # no TMA block spills into the next head's rows
    deterministic = sem is not None
    # Deterministic: each block's first adder stores, so every row (the padding too) is written.
    # Hd columns: on a wider tile the TMA stores and adds drop the columns past Hd.
    dq_acc = (torch.empty if deterministic else torch.zeros)(B * H * s_pad, Hd, device=q.device,
                                                             dtype=torch.float32)
    dq_desc = unchecked_descriptor(dq_acc, [block_m, head_d],
                                   gluon_layout((block_m, head_d), gl.float32))
    walk = _walk(causal, n_k, q.device, head_d)
    finish_dq = finishes_dq(deterministic, S, head_d)
    assert walk_possible(walk, causal), (walk, causal)
    q_desc = tma_descriptor(q, block_m, head_d)
    args = (q_desc, *(tma_descriptor(t, block_n, head_d) for t in (k, v)),
            tma_descriptor(do, block_m, head_d),
            *(tma_descriptor(t, block_n, head_d) for t in (dk, dv)), dq_desc,
            # dqo_desc, not read without FINISH_DQ
            tma_descriptor(dq, block_m, head_d) if finish_dq else q_desc,
            lse, delta,
            delta if sem is None else sem,  # (SEM is not read unless deterministic)
            H, H // Hkv, S, s_pad, scale_log2, scale, STUCK_NS)

    def launch():
        cached_launch(
            _attn_bwd_hopper_kernel, (n_k, B * Hkv), (q.dtype, do.dtype), *args, CAUSAL=causal,
            DETERMINISTIC=deterministic, FINISH_DQ=finish_dq, WALK=walk, BLOCK_M=block_m,
            BLOCK_N=block_n, HEAD_D=head_d, STAGES=STAGES[head_d], CONSUMER_REGS=CONSUMER_REGS,
            PRODUCER_REGS=PRODUCER_REGS, num_warps=8, maxnreg=MAX_NREG)
        if not finish_dq:  # (else the kernel's last adders wrote dq)
            acc = dq_acc.view(B, H, s_pad, Hd)
            dq.copy_(acc if s_pad == S else acc[:, :, :S])  # (a slice is one more op's host time)
        return dq, dk, dv
    return launch
