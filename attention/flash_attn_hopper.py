"""The attention forward on Hopper (sm_90) in Gluon: warp-specialized, FlashAttention-3's scheme.

Why a second forward. The Triton forward (``flash_attn._attn_fwd_kernel``) reached 0.80× cuDNN at
Hd 128 on an H100 (a probe whose table was not kept; below): every warp both waits for its loads
and runs the softmax between its two matmuls, so the tensor cores idle while the exponentials run.
Triton 3.6's automatic warp specialization (``tl.range(warp_specialize=True)``) compiles but
changes nothing on Hopper (same registers and spills, no ``setmaxnreg``), and tensor-descriptor
loads gave 3 %. Gluon lets the kernel say what FlashAttention-3 does (Shah et al. 2024, §3.1–3.2):

- **Warp specialization.** One producer warp only issues TMA loads: the Q tile as 64-row slots,
  then the K/V blocks through a ``STAGES``-deep ring of shared-memory slots with ready/empty
  mbarriers. Two consumer warpgroups (three at Hd 64 on long sequences: ``plan``) each own one
  64-row slot and run its matmuls and softmax. Registers follow the roles (``setmaxnreg``): 24 for
  the producer, 240 for each of two consumers (160 for three), so S (64×128 fp32), O (64×Hd fp32)
  and P live in registers without spills (``ptxas``: 0 bytes of stack; tests/test_attention.py
  cross-compiles it on CPU to keep it so).
- **Intra-warpgroup overlap.** Each consumer issues S(j) = Q·K(j)ᵀ and O += P(j−1)·V(j−1) as two
  asynchronous wgmma groups, waits for S(j) alone, and computes the softmax of S(j) while the P·V
  matmul still runs; only then it waits for O and rescales it. The exponentials hide behind the
  tensor cores instead of between them.
- Operands stay in shared memory (K and V as wgmma's B operand, Q as A); P goes to the P·V matmul
  from registers. The output reuses Q's slot for its TMA store.
- **Persistent.** One CTA per SM walks work units (one tile; causal: the tiles m and n_m − 1 − m
  together, so every unit costs the same). Q has two buffers (three for ``cross_tile``): the
  producer loads the next tile's Q and K/V while the consumers finish the current one, and a
  tile's output store runs while the consumers work on. One loop serves all of a tile's key
  blocks, masked or not (``_consumer`` says why); at Hd 128 on short sequences it serves all of
  the CTA's tiles, a tile's last P·V hidden behind the next tile's first softmax (``plan``).
  Without the causal mask a tile's first block is peeled out of it: that step has no P·V of a
  zero P to run (``plan``: 1.01–1.05× the loop alone, H200).
  Against the one-CTA-per-tile version (H100, 5 alternating rounds, same bits out), against
  cuDNN: S 1024 0.93 → 1.00–1.02× non-causal, 0.89 → 0.98× causal; S 2048 0.95 → 0.98–1.01×,
  0.94 → 1.04–1.06×; S 4096 0.97 → 0.99–1.03×, 0.98 → 1.07–1.08×.

Measured: every row of bench/results/attention.md's table (H200, 2026-12-04, bf16, Hd 64 and 128, S
1k–16k, causal and not) 1.005–1.141× cuDNN. Before that, on an H100 (bf16, B·S = 16k, H 16 at Hd
128 and 32 at Hd 64; 3 alternating rounds of do_bench, probe run 2026-11-24), ms against cuDNN
through SDPA: Hd 128 S 4096 0.956 vs 0.925 (0.97×), causal 0.542 vs 0.530 (0.98×), S 16384 3.73 vs
3.72 (1.00×); S 1024 causal 0.86×. The Triton forward in the same run: 0.80, 0.80, 0.85, 0.69×. A
scheduling barrier that makes the two warpgroups take turns at the tensor cores (FA3's ping-pong)
measured within 2 % either way and is left out; so were 64-wide key blocks (5–15 % slower) and
three stages (within 2 %). The single loop (a later change) then moved Hd 128 causal S 1k from 0.95
to 1.00× cuDNN and S 4k from 1.10 to 1.05×, the rest within 1 %; it is what made three consumers
pay at Hd 64, where the Triton forward had been 0.85–0.96× (probe, 5 rounds, 2026-11-24; its table
was not kept). A quarter of the softmax's exp2 on the FMA pipe (a cubic polynomial and an exponent
shift, FlashAttention-4's Blackwell trick; at Hd 64 the MUFU's exp2 time equals the matmuls') took
the Hd 64 loop's MUFU ops from 66 to 50 and ran 0.91–0.97× the MUFU-only kernel at every row, Hd
128 too (H200, 5 alternating rounds, probe 2026-12-02). Not profiled; the likely cost is its 114
added instructions a block step. Also slower in that probe: 256-key blocks at Hd 64 with two
consumers (0.78–0.80×; ptxas spills 48 bytes), a third Q buffer for the loop per tile at Hd 128
non-causal (0.990–0.993× at S 4k and 8k); key blocks of 160 (FlashAttention-3 takes 176 at Hd 128
non-causal) do not compile, since Gluon's tensors take power-of-two shapes only. At Hd 64 S 1k–2k
causal, two CTAs an SM (one 64-row consumer each, or two with 64-key blocks; the register file
split between them) ran 0.89–0.95× the plan, and a three-deep K/V ring 0.98–0.99× (H200, 5
alternating rounds, probe 2026-12-02). Dealing the causal launch's last heads tile by tile, longest
first, so that the CTAs the pairs left a unit short take them, measured 1.002× at S 1k causal
(A-vs-A 0.997; a host model of the idle round had expected 1.019×), 0.997–1.024× at S 2k–16k (H200,
7 rounds, probe 2026-12-03): not taken.

Scope: the plain case only (Sq == Sk, no window), Hd 64, 128 and 256 (and 33-63, 65-127 on the
first two's tiles from ``WIDE_TILE_FROM`` keys), fp16/bf16, an sm_90 GPU and TMA-compatible strides
(``hopper_forward_ok``), and a positive softmax scale (the caller's check: the mask sets scores to
-inf before they are scaled); everything else takes the Triton kernels. The output matches the
Triton forward's contract (O in q's dtype and strides, base-2 LSE of the scaled scores), so the
Triton backward consumes it unchanged.
"""

from dataclasses import dataclass

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_floor import (GLUON_DTYPES, cached_launch, capability, cdiv, gluon_layout,
                          next_power_of_2, partition_args, sm_count, tma_ok)

WG_M = 64  # query rows per consumer warpgroup: one m64 wgmma row block
PRODUCER_REGS = 24


@dataclass(frozen=True)
class Plan:
    """A launch's tiling: ``warpgroups`` consumers of WG_M query rows each (BLOCK_M = their sum),
    key blocks of ``block_n``, a ``stages``-deep K/V ring, and the register split."""

    warpgroups: int
    block_n: int = 128
    stages: int = 2
    q_buffers: int = 2  # Q (and output) buffers: _consumer says why cross_tile takes three
    cross_tile: bool = False  # the CTA's tiles as one stream of block steps (_consumer)
    half_diagonal: bool = False  # consumer 0's diagonal step over half the keys (_consumer; causal only)
    peel_first: bool = False  # a tile's first step without the P·V of a zero P (_consumer)

    def __post_init__(self):
        if self.q_buffers < 1 or (self.cross_tile and self.q_buffers < 2):
            # the stream holds a tile's buffer until the next tile's first step has stored it
            raise ValueError(f"Plan.q_buffers must be at least 1, and 2 with cross_tile, got "
                             f"{self.q_buffers}")
        if self.peel_first and self.cross_tile:
            raise ValueError("Plan.peel_first does not combine with Plan.cross_tile: in the stream "
                             "a tile's first step carries the previous tile's last P·V, so there "
                             "is no P·V of a zero P to skip")

    @property
    def block_m(self) -> int:
        return self.warpgroups * WG_M

    @property
    def max_nreg(self) -> int:
        """The launch's registers per thread: the 64K register file over the CTA's warps (the
        producer's single warp holds a whole warpgroup's share), rounded down to 8."""
        return 65536 // (128 * (self.warpgroups + 1)) // 8 * 8

    @property
    def consumer_regs(self) -> int:
        """What ``setmaxnreg`` gives each worker consumer thread once the producer drops to 24
        (the default partition, consumer 0, takes what is left: 240 or 168)."""
        return (65536 - 128 * PRODUCER_REGS) // (128 * self.warpgroups) // 8 * 8

    def constexprs(self, head_dim: int, causal: bool) -> dict:
        """The forward kernel's constexpr arguments in this tiling: what ``hopper_forward``
        launches and the sm_90 compile test (tests/test_attention.py) compiles."""
        return dict(CAUSAL=causal, BLOCK_M=self.block_m, BLOCK_N=self.block_n, HEAD_D=head_dim,
                    STAGES=self.stages, CONSUMER_REGS=self.consumer_regs,
                    PRODUCER_REGS=PRODUCER_REGS, Q_BUFFERS=self.q_buffers,
                    CROSS_TILE=self.cross_tile, HALF_DIAGONAL=self.half_diagonal,
                    PEEL_FIRST=self.peel_first)


HEAD_DIMS = (64, 128, 256)
# Two consumers (240 registers each) by default. At Hd 64 a 64×128×64 product takes half the
# tensor-core time of Hd 128's against the same 64×128 softmax, so two warpgroups leave the
# exponentials exposed; a third (FlashAttention-3's 192-row tiles, 160 registers each) hides them
# once tiles are many, and loses where the 192-row tiles' padding and causal diagonals weigh.
# Against cuDNN, H100, bf16, B·S 16k, H 32, two / three consumers (probe, 5 alternating rounds,
# 2026-11-24): causal S 1k 0.94 / 0.67, 2k 1.01 / 0.87, 4k 0.99 / 0.99, 16k 1.01 / 1.09;
# non-causal S 1k 0.99 / 0.95, 4k 0.98 / 1.05, 16k 0.99 / 1.11. Non-causal S 2k, not measured then
# (H200, 5 alternating rounds, probe 2026-12-02): two consumers 0.993× cuDNN, three 1.033×, three
# 1.034× two's speed; at S 1k three 0.948× two's (causal S 2k: 0.882×). Without the causal
# diagonals the 192-row tiles pay from a shorter length. (Not their unit count: at this bench's
# B·H·S both leave about 3 % of the launch idle in its last round, 4,096 units in 31.03 rounds of
# 132 SMs against 2,816 in 21.3.)
WIDE_HD64_FROM = 4096
WIDE_HD64_NONCAUSAL_FROM = 2048


# Consumer 0's half-width diagonal step, against every consumer's full one, same bits out (H200,
# bf16, B·S 16k, 5 alternating rounds, probe 2026-11-28): Hd 64 causal S 1k 1.039×, 2k 1.037×
# (cuDNN: 0.943 → 0.986×, 0.999 → 1.037×); at Hd 128 it lost, 0.991 / 0.965 / 0.959× at S 1k / 2k /
# 4k. Why is not profiled: there the matmuls rather than the 64×128 softmax bound a step, so the
# saved quarter block buys less, against the consumers' uneven tiles and consumer 0's larger code.
# Only the two-consumer tiling can take it (tile = one key block).

# The CTA's tiles as one stream of block steps (``cross_tile``, three Q buffers) against a loop per
# tile, same bits out (H200, bf16, B·S 16k, H 16, forward, 5 alternating rounds, probe 2026-12-02;
# bench/results/attention.md), the stream's speed: Hd 128 S 1k 1.020× causal and 1.015×
# non-causal, S 2k 0.997 / 1.005, S 4k 0.983 / 1.008, S 16k 0.981 / 0.976 (A-vs-A 0.983–1.006).
# A tile's fixed costs (its first S awaited alone, its last P·V and output store with the tensor
# cores idle, both consumers at once) weigh where tiles are short; the stream's larger loop (the
# output code sits in it) costs a little on every step. At Hd 64 the stream lost 2–12 % at every
# length (its loop 926 SASS instructions against 684 at three consumers; and consumer 0's half
# diagonal cannot be taken in it).
CROSS_TILE_HD128_TO = 2048

# A tile's first step peeled (``peel_first``: S and its softmax without the P·V of the zero P)
# against the loop's every step, same bits out (H200, bf16, B·S 16k, forward, 7 alternating rounds,
# A-vs-A 0.994–1.002, 2026-12-03, docs/pending/peel_ab.py of 1f97923; bench/results/attention.md):
# non-causal Hd 64 S 1k / 2k / 4k / 16k 1.043 / 1.050 / 1.044 / 1.035× (cuDNN: 0.967 → 1.005× at S
# 1k), Hd 128 S 4k / 16k 1.015 / 1.010×. Causal it lost, Hd 64 S 1k 0.964× (0.981× with consumer 0's
# half-diagonal copy left unpeeled), S 2k 1.000×; earlier (2026-12-02) Hd 128 S 4k 0.993×. Not
# profiled: the peeled copy of the step also holds the mask (causal SASS at Hd 64 S 1k: 3216 → 4920
# instructions; three consumers at S 4k spill 176 bytes with it, none without), while a non-causal
# step is only the matmuls and the softmax. The stream (``cross_tile``) has no zero P·V to drop but
# the CTA's first.


# Hd 256: one Q buffer per consumer (a tile's output leaves it before the next tile's Q comes), so
# 64-key blocks fit in a two-stage ring (197 KB); two buffers (128 KB) leave room for 32-key
# blocks only. Forward against the Triton kernel, H200, bf16, B·S 16k, H 8, 5 alternating rounds,
# 2026-12-04 (bench/results/attention_hd256.md): non-causal S 1k / 4k / 16k 1.387 / 1.292 /
# 1.298×, causal 1.484 / 1.361 / 1.253× (0.986-1.054× cuDNN by median TFLOP/s); two buffers and
# 32-key blocks 1.038-1.305×. The backward stays on the Triton kernels, which read this forward's
# LSE. The smallest call timed had 2^27 visible scores: below that MIN_SCORES, set at Hd 128, rules
# Hd 256 unmeasured.
HD256 = Plan(warpgroups=2, block_n=64, stages=2, q_buffers=1)


def plan(head_dim: int, seq_len: int, causal: bool) -> Plan:
    """The tiling ``hopper_forward`` launches for this head dim, length and mask."""
    if head_dim == 256:
        return HD256
    if head_dim == 128:
        if seq_len <= CROSS_TILE_HD128_TO:
            return Plan(warpgroups=2, q_buffers=3, cross_tile=True)
        return Plan(warpgroups=2, peel_first=not causal)
    wide = seq_len >= (WIDE_HD64_FROM if causal else WIDE_HD64_NONCAUSAL_FROM)
    return Plan(warpgroups=3 if wide else 2, half_diagonal=causal and not wide,
                peel_first=not causal)


# Small calls are bound by host time, so the cheaper launch wins. Since this kernel launches
# through kernel_floor.cached_launch (the Triton forward through its autotuner), it was the faster
# at 8 of 9 sizes from 2^19 to 2^27 visible scores (H100, do_bench of the forward through
# flash_attention, bf16, 2026-11-24): e.g. 2^27 causal 0.179 against 0.239 ms, 2^25 non-causal
# 0.088 / 0.139, 2^19 causal 0.091 / 0.128; 2^24 causal 0.148 / 0.126 the exception. Smaller
# calls are not measured and stay on Triton. Measured at Hd 128 with the peeled kernel; Hd 64 below
# 2^29 scores (B·H·S² of bench/attention.py's smallest row) is not measured.
MIN_SCORES = 1 << 19


@gluon.jit
def _unit_tiles(u, n_m, CAUSAL: gl.constexpr):
    """How many query tiles work unit ``u`` holds: causal units pair a long tile with a short one
    (rows m and n_m − 1 − m together see n_m + 1 key blocks when BLOCK_M == BLOCK_N, within one
    block of that with 192-row tiles), so every unit costs about the same and a CTA's share does
    not depend on which units it drew; the middle tile of an odd n_m is alone."""
    if CAUSAL:
        p = u % ((n_m + 1) // 2)
        n = 1 + (p < n_m - 1 - p).to(gl.int32)
    else:
        n = 1
    return n


@gluon.jit
def _tile(a, u, t, CAUSAL: gl.constexpr):
    """Tile ``t`` of unit ``u``: (batch, head, K/V head, batch·head, first row, key blocks). The
    units of one head are consecutive, so the CTAs at work together share its K/V in L2."""
    # A tile: a Q buffer's rows, one slot per consumer. A key block: a K ring slot's rows.
    NWG: gl.constexpr = a.q_smem.type.shape[0] // a.q_empty.type.shape[0]
    BLOCK_M: gl.constexpr = NWG * a.q_smem.type.shape[3]
    BLOCK_N: gl.constexpr = a.k_smem.type.shape[3]
    if CAUSAL:
        n_pairs = (a.n_m + 1) // 2
        bh = u // n_pairs
        p = u - bh * n_pairs
        if t == 0:
            m = a.n_m - 1 - p  # the long tile first
        else:
            m = p
    else:
        bh = u // a.n_m
        m = u - bh * a.n_m
    h = bh % a.H
    start_m = m * BLOCK_M
    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, a.SK)
    else:
        hi = a.SK
    # Every consumer walks the same blocks (the ring's slots are released by all of them).
    return bh // a.H, h, h // a.GROUP, bh, start_m, gl.cdiv(hi, BLOCK_N)


@partition_args
class _FwdArgs:
    """What the partitions of one persistent CTA share."""
    # global memory: the TMA descriptors (O goes out through Q's slots) and the LSE rows
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    o_desc: tma.tensor_descriptor
    LSE: gl.tensor
    # shared memory and its mbarriers
    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_bars: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    # the problem: heads, query heads per K/V head, lengths, query tiles a head (n_m), the
    # units the CTAs share out
    H: gl.tensor
    GROUP: gl.tensor
    SQ: gl.tensor
    SK: gl.tensor
    n_m: gl.tensor
    n_units: gl.tensor
    qk_scale: gl.tensor


@gluon.jit
def _producer(a, CAUSAL: gl.constexpr):
    """One warp: for each tile, its Q slots, then every K/V block through the ring. It runs
    ahead into the next tile (Q has two or three buffers) while the consumers finish the current
    one."""
    NSTAGE: gl.constexpr = a.k_smem.type.shape[0]
    NQ: gl.constexpr = a.q_empty.type.shape[0]
    NWG: gl.constexpr = a.q_smem.type.shape[0] // NQ
    ROWS: gl.constexpr = a.q_smem.type.shape[3]
    tc = 0  # tiles done by this CTA: picks the Q buffer and its phase
    kv = 0  # K/V blocks done by this CTA: picks the ring slot and its phase
    for u in range(gl.program_id(0), a.n_units, gl.num_programs(0)):
        for t in range(_unit_tiles(u, a.n_m, CAUSAL)):
            b, h, hk, _, start_m, n_blocks = _tile(a, u, t, CAUSAL)
            qb = tc % NQ
            j0 = 0
            if NQ == 1:
                # The one Q buffer returns only once the previous tile's output has left it: the
                # ring's first blocks of this tile load meanwhile, so only Q's latency shows.
                j0 = gl.minimum(n_blocks, NSTAGE)
                for j in range(j0):
                    _load_kv(a, b, hk, kv, j)
            # A fresh mbarrier counts as having completed the phase before 0, so the first use
            # of each buffer (and the first pass through the ring) does not wait.
            mbarrier.wait(a.q_empty.index(qb), ((tc // NQ) & 1) ^ 1)
            for w in gl.static_range(NWG):
                mbarrier.expect(a.q_bars.index(NWG * qb + w), a.q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a.q_desc, [b, h, start_m + w * ROWS, 0],
                                                a.q_bars.index(NWG * qb + w),
                                                a.q_smem.index(NWG * qb + w))
            for j in range(j0, n_blocks):
                _load_kv(a, b, hk, kv, j)
            tc += 1
            kv += n_blocks


@gluon.jit
def _load_kv(a, b, hk, kv, j):
    """The producer's loads of key block ``j`` of the tile, ``kv + j`` of the CTA's ring."""
    NSTAGE: gl.constexpr = a.k_smem.type.shape[0]
    BN: gl.constexpr = a.k_smem.type.shape[3]
    s = (kv + j) % NSTAGE
    phase = ((kv + j) // NSTAGE) & 1
    mbarrier.wait(a.k_empty.index(s), phase ^ 1)
    mbarrier.expect(a.k_ready.index(s), a.k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a.k_desc, [b, hk, j * BN, 0], a.k_ready.index(s),
                                    a.k_smem.index(s))
    mbarrier.wait(a.v_empty.index(s), phase ^ 1)
    mbarrier.expect(a.v_ready.index(s), a.v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a.v_desc, [b, hk, j * BN, 0], a.v_ready.index(s),
                                    a.v_smem.index(s))


@gluon.jit
def _store_tile(a, acc, m_i, l_i, tile, WG: gl.constexpr, CAUSAL: gl.constexpr,
                row_s: gl.constexpr, row_o: gl.constexpr):
    """Consumer ``WG``'s rows of a finished tile (``tile``: its unit, its index in the unit and
    the CTA's count of tiles before it): O = acc / l out through the tile's Q slot (its Q is no
    longer read) by a TMA store left in flight, and the base-2 LSE by plain stores. The tile's
    head is recomputed here rather than held in registers through the loop."""
    ROWS: gl.constexpr = acc.shape[0]
    NQ: gl.constexpr = a.q_empty.type.shape[0]
    NWG: gl.constexpr = a.q_smem.type.shape[0] // NQ
    u, t, tc = tile
    b, h, _, bh, start_m, _ = _tile(a, u, t, CAUSAL)
    my_m = start_m + WG * ROWS
    slot = NWG * (tc % NQ) + WG
    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    o_tile = a.q_smem.index(slot).reshape(acc.shape)
    # One reciprocal a row, not a division an element: with the stream (``_kv_step``) this code
    # sits in the block loop, and the divisions' SASS (64 a thread) made that loop 1,075
    # instructions against 890. With them the stream ran 0.971 / 0.992× main's kernel at Hd 128
    # S 16k (non-causal / causal), without them 0.983 / 0.997× (H200 probes, 2026-12-02).
    o_tile.store((acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None]).to(a.q_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(a.o_desc, [b, h, my_m, 0], a.q_smem.index(slot))
    offs_m = my_m + gl.arange(0, ROWS, layout=row_s)
    gl.store(a.LSE + bh.to(gl.int64) * a.SQ + offs_m,
             gl.where(seen, m_i + gl.log2(l_safe), float("inf")), mask=offs_m < a.SQ)


@gluon.jit
def _finish_tile(a, p, acc, m_i, l_i, it, use_acc, tile, WG: gl.constexpr, CAUSAL: gl.constexpr,
                 row_s: gl.constexpr, row_o: gl.constexpr):
    """A tile's last P·V, P of ring block ``it`` (over the first ``p.shape[1]`` keys), on O
    (``use_acc`` false: O starts here), then its rows out (``_store_tile``)."""
    NSTAGE: gl.constexpr = a.k_smem.type.shape[0]
    last = it % NSTAGE
    mbarrier.wait(a.v_ready.index(last), (it // NSTAGE) & 1)
    v_tile = a.v_smem.index(last).reshape([a.v_smem.type.shape[3], a.v_smem.type.shape[4]])
    acc = warpgroup_mma(p, v_tile.slice(0, p.shape[1]), acc, use_acc=use_acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(a.v_empty.index(last), count=1)
    _store_tile(a, acc, m_i, l_i, tile, WG, CAUSAL, row_s, row_o)


@gluon.jit
def _kv_step(a, q_tile, p, m_i, l_i, acc, it, j, my_m, prev, pv_acc, WG: gl.constexpr,
             CAUSAL: gl.constexpr, CROSS_TILE: gl.constexpr, s_zero, s_layout: gl.constexpr,
             p_layout: gl.constexpr, o_layout: gl.constexpr, FIRST: gl.constexpr = False):
    """Key block ``j`` of the tile, ``it`` of the ring (the CTA's count, across its tiles):
    S = Q·K(it)ᵀ runs beside the previous block's O += P·V, whose softmax it follows. Returns
    this block's P, already the 16-bit P·V operand, and the updated m, l and O. S covers the
    block's first ``s_zero.shape[1]`` keys (all of them, or the half a diagonal block shows
    consumer 0: ``_consumer``); m and l come and go in the caller's row layout.

    - ``CROSS_TILE``: the previous block may be the previous tile's last. At ``j == 0`` the P·V
      just issued finished that tile (``prev``: its unit, its tile in the unit and the CTA's
      tile count), so its rows leave here (``_store_tile``), after this tile's first softmax:
      a tile's last P·V hides behind the next tile's first S and softmax. A tile's O starts in
      its first P·V (``pv_acc`` false: the block before was its tile's first), not from zeros
      written at ``j == 0``: O passes no branch or select, which made ptxas copy the
      accumulator around every wgmma (SASS: 32 warpgroup waits and 168 moves in the loop
      against 4 and 6; 0.75–0.87× the forward before, H200). So O holds garbage after
      ``j == 0``, never read. Only the CTA's first step has no previous block: its P is zero
      and multiplies this block's own V, a product that is discarded.
    - Without it the caller starts each tile with zero O and P and ends it with the last P·V;
      at ``j == 0`` the zero P multiplies this block's own V (loaded data), a product that
      adds nothing (unless V holds inf or NaN, which any masked entry's zero would meet too);
      its slot is released by the real one. ``FIRST`` (the plan's ``peel_first``, a second
      copy of the step for ``j == 0``) issues S alone and leaves O the caller's zeros.
    - The mask costs only where a block crosses the sequence end or the warpgroup's diagonal,
      a uniform branch around the select; the softmax after it is one copy for every block. No
      running max stays -inf past block 0 (Sq == Sk and no window: every row sees key 0), so
      the usual guard against -inf − -inf is not needed.
    - P leaves converted once the previous P·V is done: carried in fp32 across the loop's back
      edge beside the next S it held 64 more registers a thread, which three consumers' 160
      (Hd 64) cannot spare (ptxas: 3.6 KB of spills; none after)."""
    NSTAGE: gl.constexpr = a.k_smem.type.shape[0]
    HEAD_D: gl.constexpr = a.k_smem.type.shape[4]
    BN: gl.constexpr = a.k_smem.type.shape[3]
    KEYS: gl.constexpr = s_zero.shape[1]
    row_in: gl.constexpr = m_i.type.layout
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s = it % NSTAGE
    mbarrier.wait(a.k_ready.index(s), (it // NSTAGE) & 1)
    k_tile = a.k_smem.index(s).reshape([BN, HEAD_D]).slice(0, KEYS)
    s_acc = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if FIRST:
        s_acc = warpgroup_mma_wait(0, deps=(s_acc, ))
    else:
        if CROSS_TILE:
            vit = it - (it > 0).to(gl.int32)
        else:
            vit = it - (j > 0).to(gl.int32)
        vs = vit % NSTAGE
        mbarrier.wait(a.v_ready.index(vs), (vit // NSTAGE) & 1)
        v_tile = a.v_smem.index(vs).reshape([BN, HEAD_D])
        acc = warpgroup_mma(p, v_tile, acc, use_acc=pv_acc, is_async=True)
        s_acc = warpgroup_mma_wait(1, deps=(s_acc, ))
    mbarrier.arrive(a.k_empty.index(s), count=1)
    start_n = j * BN
    need = start_n + KEYS > a.SK
    if CAUSAL:
        need = need | (start_n + KEYS - 1 > my_m)
    if need:
        cols = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
        keep = cols[None, :] < a.SK
        if CAUSAL:
            rows = my_m + gl.arange(0, s_acc.shape[0], layout=gl.SliceLayout(1, s_layout))
            keep = keep & (rows[:, None] >= cols[None, :])
        s_acc = gl.where(keep, s_acc, float("-inf"))
    m_old = gl.convert_layout(m_i, row_s)  # no-ops: a row's threads do not depend on S's width
    l_old = gl.convert_layout(l_i, row_s)
    if CROSS_TILE:
        m_old_run = gl.where(j > 0, m_old, float("-inf"))  # a new tile's rows have seen nothing
    else:
        m_old_run = m_old  # the caller's fresh -inf at j == 0
    m_new = gl.maximum(m_old_run, gl.max(s_acc, 1) * a.qk_scale)
    p32 = gl.exp2(s_acc * a.qk_scale - m_new[:, None])
    alpha = gl.exp2(m_old_run - m_new)  # 0 at j == 0, where (CROSS_TILE) l_old is the last tile's
    l_new = l_old * alpha + gl.sum(p32, 1)
    if not FIRST:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if CROSS_TILE:
            mbarrier.arrive(a.v_empty.index(vs), count=1, pred=it > 0)
            if j == 0:
                if it > 0:
                    _store_tile(a, acc, m_old, l_old, prev, WG, CAUSAL, row_s, row_o)
        else:
            mbarrier.arrive(a.v_empty.index(vs), count=1, pred=j > 0)
    p = gl.convert_layout(p32.to(a.q_desc.dtype), p_layout)
    m_new = gl.convert_layout(m_new, row_in)
    l_new = gl.convert_layout(l_new, row_in)
    if not FIRST:  # (FIRST: O is the caller's zeros, as alpha would make it)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    return p, m_new, l_new, acc


@gluon.jit
def _release_q(q_empty, tc):
    """Hand tile ``tc``'s Q buffer back to the producer once the tile's output, stored from it,
    has left it (this warpgroup's one TMA store in flight)."""
    tma.store_wait(0)
    mbarrier.arrive(q_empty.index(tc % q_empty.type.shape[0]), count=1)


@gluon.jit
def _consumer(a, WG: gl.constexpr, CAUSAL: gl.constexpr, CROSS_TILE: gl.constexpr,
              HALF_DIAGONAL: gl.constexpr, PEEL_FIRST: gl.constexpr):
    """One warpgroup: for each tile, query rows start_m + 64·WG ... + 63 against its key blocks.
    Every consumer walks all of the tile's blocks (the ring's slots are released by all), so a
    block past a warpgroup's diagonal is computed and masked away, FlashAttention-3's choice too,
    with one exception (``HALF_DIAGONAL``, the plan's choice): when a causal tile is one key
    block tall (two consumers of 64 rows, 128-key blocks), consumer 0's rows see only the first
    half of the tile's last, diagonal block, so its last step reads those 64 keys alone. That is
    a quarter of a diagonal block's work, 0.5 of the 9 block-steps of a causal unit at S 1k
    (5.6 %).
    One loop serves every block: the consumers are separate code (one copy per warpgroup), and
    an earlier version that peeled the first and the masked blocks into copies of the step held
    ~130 KB of instructions at Hd 64 with three consumers; causal S 1k then ran at 0.40× cuDNN,
    42 % of its stalls waiting for instructions (ncu, H100). One loop: 69 KB, 0.94×. Two other
    copies exist where they measured faster: the half diagonal step, in consumer 0 only (+416
    SASS instructions, 6.7 KB), and without the causal mask the tile's first step (``PEEL_FIRST``,
    ``plan`` has the numbers: +1,232 instructions at Hd 64 S 1k).

    ``CROSS_TILE`` (the plan's choice) runs the CTA's tiles as one stream of block steps: a
    tile's last P·V and its output store happen in the next tile's first step (``_kv_step``).
    Then a tile's Q buffer returns to the producer at the end of the next tile, once that store
    has read it: a buffer is held for two tiles, and a third (``Plan.q_buffers``) lets the
    producer load the next tile's Q during the current one, so a one-block tile of a causal pair
    does not wait for its Q (two buffers: 1–10 % slower at Hd 128, most at S 1k causal; H200
    probe of an earlier version of the stream, 2026-12-02). Without it, a tile ends with its last
    P·V and its store, and its buffer returns at the next tile's start.

    The half step relies on Sq == Sk (``gluon_case``): a 128-row causal tile then has key blocks
    0 ... m, the last one its diagonal. The skipped keys were masked to exp2(-inf) = 0, so the
    output is bit for bit the full step's for finite inputs (a non-finite V there made consumer
    0's rows NaN before and no longer does). It is not taken with ``CROSS_TILE``, whose next
    step would multiply the half P."""
    NQ: gl.constexpr = a.q_empty.type.shape[0]
    NWG: gl.constexpr = a.q_smem.type.shape[0] // NQ
    ROWS: gl.constexpr = a.q_smem.type.shape[3]
    HEAD_D: gl.constexpr = a.q_smem.type.shape[4]
    BN: gl.constexpr = a.k_smem.type.shape[3]
    dtype: gl.constexpr = a.q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([ROWS, BN], gl.float32, layout=s_layout)
    # consumer 0 of a one-block-tall tile: its ROWS rows see the diagonal block's first ROWS keys
    HALF_DIAG: gl.constexpr = (CAUSAL and HALF_DIAGONAL and not CROSS_TILE and WG == 0
                               and NWG * ROWS == BN)
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, ROWS, 16])
    half_zero = gl.zeros([ROWS, ROWS], gl.float32, layout=half_layout)

    tc = 0
    kv = 0
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=o_layout)
    p = gl.zeros([ROWS, BN], dtype, layout=p_layout)
    u_prev = 0  # CROSS_TILE: the previous tile's unit, tile in it and key blocks
    t_prev = 0
    n_prev = 1
    for u in range(gl.program_id(0), a.n_units, gl.num_programs(0)):
        for t in range(_unit_tiles(u, a.n_m, CAUSAL)):
            _, _, _, _, start_m, n_blocks = _tile(a, u, t, CAUSAL)
            slot = NWG * (tc % NQ) + WG
            my_m = start_m + WG * ROWS
            q_tile = a.q_smem.index(slot).reshape([ROWS, HEAD_D])
            if NQ == 1:
                # One buffer (Hd 256, where two do not fit beside the ring): the previous tile's
                # output leaves it before this tile's Q can come, so the load's latency shows.
                if tc > 0:
                    _release_q(a.q_empty, tc - 1)
            mbarrier.wait(a.q_bars.index(slot), (tc // NQ) & 1)
            if not CROSS_TILE:
                if NQ > 1 and tc > 0:
                    # The previous tile's output store ran while this tile's Q was awaited.
                    _release_q(a.q_empty, tc - 1)
                m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
                l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
                acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=o_layout)
                p = gl.zeros([ROWS, BN], dtype, layout=p_layout)
            n_full = n_blocks
            if HALF_DIAG:
                n_full = n_blocks - 1
            j0 = 0
            if PEEL_FIRST:
                if n_full > 0:
                    p, m_i, l_i, acc = _kv_step(a, q_tile, p, m_i, l_i, acc, kv, 0, my_m,
                                                (u, t, tc), True, WG, CAUSAL, CROSS_TILE, s_zero,
                                                s_layout, p_layout, o_layout, True)
                j0 = 1
            for j in range(j0, n_full):
                if CROSS_TILE:
                    # This step's P·V is of the block before: the last tile's last at j == 0.
                    pv_acc = (j > 1) | ((j == 0) & (n_prev > 1))
                else:
                    pv_acc = True
                p, m_i, l_i, acc = _kv_step(a, q_tile, p, m_i, l_i, acc, kv + j, j, my_m,
                                            (u_prev, t_prev, tc - 1), pv_acc, WG, CAUSAL,
                                            CROSS_TILE, s_zero, s_layout, p_layout, o_layout)
            if CROSS_TILE:
                if tc > 0:
                    # The previous tile's output was stored in this tile's first step.
                    _release_q(a.q_empty, tc - 1)
            else:
                if HALF_DIAG:
                    j = n_blocks - 1
                    p_last, m_i, l_i, acc = _kv_step(a, q_tile, p, m_i, l_i, acc, kv + j, j,
                                                     my_m, (u, t, tc), True, WG, CAUSAL,
                                                     CROSS_TILE, half_zero, half_layout,
                                                     p_layout, o_layout)
                else:
                    p_last = p
                _finish_tile(a, p_last, acc, m_i, l_i, kv + n_blocks - 1, True, (u, t, tc), WG,
                             CAUSAL, row_s, row_o)
            u_prev = u
            t_prev = t
            n_prev = n_blocks
            tc += 1
            kv += n_blocks
    if CROSS_TILE:
        if tc > 0:
            # The last tile's last P·V, which no next tile's first step issues.
            _finish_tile(a, p, acc, m_i, l_i, kv - 1, n_prev > 1, (u_prev, t_prev, tc - 1), WG,
                         CAUSAL, row_s, row_o)
    tma.store_wait(0)


@gluon.jit
def _consumer_0(a, CAUSAL: gl.constexpr, CROSS_TILE: gl.constexpr, HALF_DIAGONAL: gl.constexpr,
                PEEL_FIRST: gl.constexpr):
    _consumer(a, 0, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)


@gluon.jit
def _consumer_1(a, CAUSAL: gl.constexpr, CROSS_TILE: gl.constexpr, HALF_DIAGONAL: gl.constexpr,
                PEEL_FIRST: gl.constexpr):
    _consumer(a, 1, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)


@gluon.jit
def _consumer_2(a, CAUSAL: gl.constexpr, CROSS_TILE: gl.constexpr, HALF_DIAGONAL: gl.constexpr,
                PEEL_FIRST: gl.constexpr):
    _consumer(a, 2, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)


# Launched through cached_launch, so nothing but the constexprs and dtypes may pick the binary.
@gluon.jit(do_not_specialize=["H", "GROUP", "SQ", "SK", "n_units"],
           do_not_specialize_on_alignment=["LSE"])
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, GROUP, SQ, SK, n_units,
                            qk_scale, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            Q_BUFFERS: gl.constexpr, CROSS_TILE: gl.constexpr,
                            HALF_DIAGONAL: gl.constexpr, PEEL_FIRST: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]  # WG_M
    NWG: gl.constexpr = BLOCK_M // ROWS
    dtype: gl.constexpr = q_desc.dtype
    # Q: Q_BUFFERS buffers × one slot per consumer; a slot's output goes out through it.
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * NWG, 1, 1, ROWS, HEAD_D],
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * NWG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS * NWG):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_empty.index(i), count=NWG)  # every consumer's output has left it
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NWG)  # a slot is free once every consumer is done
        mbarrier.init(v_empty.index(i), count=NWG)
    a = _FwdArgs(q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, o_desc=o_desc, LSE=LSE,
                 q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, q_bars=q_bars, q_empty=q_empty,
                 k_ready=k_ready, v_ready=v_ready, k_empty=k_empty, v_empty=v_empty, H=H,
                 GROUP=GROUP, SQ=SQ, SK=SK, n_m=gl.cdiv(SQ, BLOCK_M), n_units=n_units,
                 qk_scale=qk_scale)
    if NWG == 2:
        gl.warp_specialize([(_consumer_0, (a, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)),
                            (_consumer_1, (a, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)),
                            (_producer, (a, CAUSAL))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer_0, (a, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)),
                            (_consumer_1, (a, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)),
                            (_consumer_2, (a, CAUSAL, CROSS_TILE, HALF_DIAGONAL, PEEL_FIRST)),
                            (_producer, (a, CAUSAL))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# A head dim between two tile widths the kernels take (33-63, 65-127: Phi-3's 96, ...) runs the
# wider one's kernels on the caller's tensors: the TMA descriptors keep the tensors' Hd columns but
# move blocks of the tile's width, so a load fills the columns past Hd with zeros, which add
# nothing to any dot product, and a store drops them (TMA clips a box at the tensor's bounds, as
# it does the rows past S). Exact, with no padded copy and the tile's own binaries. From 256 keys
# (H200, bf16, B·S 16k, H 32, 5 alternating rounds, 2026-12-04, bench/results/attention_wide_tiles.md),
# fwd+bwd against the Triton kernels (on power-of-two masked tiles): Hd 96 1.16-1.62x at S 256-32k,
# causal and not, Hd 48 1.12-1.56x at S 256-16k; Hd 72, 120, 40 and 56 1.12-1.56x at S 256-4k
# against the Triton kernels with their rows aligned (``flash_attn._aligned``). At 128 keys Hd 96
# causal read 0.999x. The rule set before those runs: the shortest length from which the route is
# >= 1.05x the Triton path at every length, both masks. Against cuDNN: 0.996-1.093x at Hd 96 from
# 1k keys, but 0.55-0.86x causal at 256, where both our paths lose to it. Every row was fwd+bwd:
# the forward alone on the route (what an inference call runs) is timed only from 1k keys.
WIDE_TILE_FROM = 256
# The tile widths the route was measured on; Hd 129-255 on the Hd 256 forward is not measured.
WIDE_TILES = (64, 128)


def kernel_head_dim(head_d: int, seq_len: int, head_dims) -> int | None:
    """The head dim (tile width) the Gluon kernels run a call at: ``head_d`` itself if it is in
    ``head_dims``; the next power of two if that is in ``head_dims`` and ``WIDE_TILES`` and the
    call has ``WIDE_TILE_FROM`` keys or more; else None (the Triton kernels)."""
    if head_d in head_dims:
        return head_d
    tile = next_power_of_2(head_d)
    if tile in head_dims and tile in WIDE_TILES and seq_len >= WIDE_TILE_FROM:
        return tile
    return None


def gluon_case(q, k, causal, window, min_scores, head_dims, *tensors) -> bool:
    """The case the Gluon kernels serve: an sm_90 GPU, Sq == Sk, no window, at least
    ``min_scores`` visible scores, a head dim ``kernel_head_dim`` maps into ``head_dims``,
    fp16/bf16, and ``tensors`` with a unit last stride and TMA-compatible alignment."""
    B, H, S, Hd = q.shape
    return (q.is_cuda and capability(q.device) == (9, 0)
            and window is None and k.shape[2] == S and S > 0
            and B * H * S * S // (2 if causal else 1) >= min_scores
            and kernel_head_dim(Hd, S, head_dims) is not None
            and q.dtype in GLUON_DTYPES
            and all(t.stride(-1) == 1 for t in tensors) and tma_ok(*tensors))


def hopper_forward_ok(q, k, v, causal, window) -> bool:
    """Whether ``hopper_forward`` serves these inputs (else the Triton kernels do)."""
    return gluon_case(q, k, causal, window, MIN_SCORES, HEAD_DIMS, q, k, v)


def unchecked_descriptor(t, block_shape, layout):
    """A TMA descriptor of ``t`` built without the dataclass's own checks, 2 of its 3.3 µs of
    host time (H100 host). For the callers' tensors: q, k, v and dO were checked by their
    ``*_ok`` (alignment by ``tma_ok``, the unit last stride); o, dq, dk and dv are ``empty_like``
    them (their strides), and the dQ accumulator is allocated contiguous; none is empty."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.padding = t, list(t.shape), list(t.stride()), "zero"
    d.block_shape, d.layout = block_shape, layout
    return d


def tma_descriptor(t, rows, width):
    """The TMA descriptor of ``t`` (B, heads, S, Hd) in (1, 1, rows, width) blocks, width >= Hd:
    the columns past Hd load as zeros and are not stored (``WIDE_TILE_FROM``)."""
    return unchecked_descriptor(t, [1, 1, rows, width],
                                gluon_layout((1, 1, rows, width), GLUON_DTYPES[t.dtype]))


def hopper_forward(q, k, v, o, lse, causal, scale_log2):
    """q, o: (B, H, S, Hd); k, v: (B, Hkv, S, Hd); lse: (B, H, S) fp32; ``scale_log2`` = softmax
    scale · log2(e). Fills ``o`` and ``lse`` as ``flash_attn.attention_forward`` allocates them
    and returns them."""
    B, H, S, Hd = q.shape
    head_d = kernel_head_dim(Hd, S, HEAD_DIMS)
    tiling = plan(head_d, S, causal)
    n_m = cdiv(S, tiling.block_m)
    n_units = B * H * ((n_m + 1) // 2 if causal else n_m)
    cached_launch(
        _attn_fwd_hopper_kernel, (min(n_units, sm_count(q.device)), ), q.dtype,
        tma_descriptor(q, WG_M, head_d), tma_descriptor(k, tiling.block_n, head_d),
        tma_descriptor(v, tiling.block_n, head_d), tma_descriptor(o, WG_M, head_d), lse, H,
        H // k.shape[1], S, S, n_units, scale_log2, **tiling.constexprs(head_d, causal),
        num_warps=4, maxnreg=tiling.max_nreg)
    return o, lse
