"""Hopper weight gradient of the grouped matmul in Gluon, one row segment per group:
``dw[g] = x_gᵀ @ dy_g`` with a producer warp, two consumer warpgroups and a TMA-store epilogue
that is not waited for.

The same arrangement as the forward's Gluon kernel (``grouped_mm_gluon``), for the other
reduction: a tile is 128 rows of ``dw[g]`` (two 64-row halves, one per consumer) by 256 columns,
reduced over the group's rows in chunks of 64.

- **The producer** walks the tiles ``pid, pid + #CTAs, ...`` of all groups in order (every
  group has the same ``cdiv(I, 128) · cdiv(N, 256)`` tiles, so a tile's group is a division, and
  the CTAs at work together share a few groups' rows in L2), and loads each chunk's two 64×64
  halves of x and its 64×256 block of dy into a ``STAGES``-deep ring. Unlike the Triton kernel,
  whose software pipeline restarts at every group (its row count changes the loop), it runs
  ahead across tiles and groups.
- **A group's rows through one host descriptor** (``ragged_descriptor``, Triton's
  ``triton.tools.ragged_tma`` scheme, which QuACK's varlen-K GEMM also took up): x and dy are seen
  as 4-D tensors whose two leading coordinates move the base to the group's end through 64-bit
  address wraparound, so the third, the row within the group, runs up to the group's row count
  and a chunk's rows past it load as zeros (TMA's out-of-bounds fill), not the next group's.
  Nothing is built on the device. An earlier version built each tile's descriptors there, in a
  global slot that the loads in flight read (a race a review found), and lost to the Triton
  kernel where groups are short (DeepSeek-V3, 0.88×), those builds the suspected cause (not
  profiled).
- **Each consumer** multiplies its half of x's chunk, transposed in shared memory (wgmma reads
  16-bit A either way), by the dy block: one asynchronous wgmma a chunk, the previous chunk's
  slot freed once only the newest wgmma is still running; a group's last, partial chunk only
  over its rows rounded up to 16 (``_last_chunk_mma``), not over the zeros past them.
- **The epilogue**: the 64×256 tile half goes to its own shared-memory buffer and out by TMA
  through a 3-D descriptor over dw (clipped at I and N, so no masked tail), waited for only
  before that buffer is written again, a tile later. A group with no rows stores zeros.

  An fp32 dw (the master gradient's, ``moe.kernels.master_grad.accumulate_wgrad_``) is stored,
  or added to, straight from the accumulator's registers instead (``_store_fp32``): an fp32
  half would take 64 KB of shared memory a consumer; the 16-bit store buffers' 64 KB make room
  for a fourth ring stage (48 KB, ``FP32_STAGES``).

Scope (``wgrad_gluon_ok``): sm_90, bf16/fp16 operands, dw in their dtype or fp32, one segment
per group, TMA-addressable operands.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.tools.ragged_tma import create_ragged_descriptor

from kernel_floor import SCALAR, GLUON_DTYPES, band_swizzle, capability, cdiv, gluon_layout, partition_args, sm_count
from moe.kernels import grouped_mm_gluon
from moe.kernels.grouped_mm_gluon import CONSUMER_REGS, MAX_NREG, PRODUCER_REGS, WG_M, descriptor

BLOCK_K = 2 * WG_M  # rows of dw[g] a tile: one 64-row half per consumer
BLOCK_N = 256
BLOCK_M = 64  # the reduction chunk: rows of x and dy
GROUP_K = gl.constexpr(8)  # bands of 8 row tiles of dw[g], as the Triton wgrad
STAGES = 3  # 3 × (16 + 32) KB of ring + 2 × 32 KB of store buffers, as the forward's
FP32_STAGES = 4  # the fp32 epilogue stores from registers: the store buffers' room takes a 4th stage
RAGGED_ROWS = 1 << 30  # the ragged view's row bound (triton.tools.ragged_tma's): more than any x has
_RAGGED = gl.constexpr(RAGGED_ROWS)


@gluon.jit
def _tile(a, t):
    """Tile ``t``: its group, row tile of dw[g], column tile, and the group's first row and
    row count."""
    g = t // a.tiles_per_group
    tile_k, tile_n = band_swizzle(t - g * a.tiles_per_group, a.k_tiles, a.n_tiles, GROUP_K)
    row_start = gl.load(a.offsets_ptr + g - 1, mask=g > 0, other=0).to(gl.int32)
    return g, tile_k, tile_n, row_start, gl.load(a.offsets_ptr + g).to(gl.int32) - row_start


@partition_args
class _Args:
    """What the producer and the two consumers share."""
    x_desc: tma.tensor_descriptor
    dy_desc: tma.tensor_descriptor
    dw_desc: (tma.tensor_descriptor, gl.constexpr)  # None (a constexpr) for the fp32 epilogues
    dw_ptr: gl.tensor
    offsets_ptr: gl.tensor
    K: SCALAR
    N: SCALAR
    n_tiles_total: SCALAR
    tiles_per_group: SCALAR
    k_tiles: SCALAR
    n_tiles: SCALAR
    x_smem: gl.shared_memory_descriptor
    dy_smem: gl.shared_memory_descriptor
    c_smem: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@gluon.jit
def _producer(a):
    NSTAGE: gl.constexpr = a.dy_smem.type.shape[0]
    ROWS: gl.constexpr = a.x_smem.type.shape[3]
    HALF: gl.constexpr = a.x_smem.type.shape[4]
    BN: gl.constexpr = a.dy_smem.type.shape[4]
    it = 0
    for t in range(gl.program_id(0), a.n_tiles_total, gl.num_programs(0)):
        g, tile_k, tile_n, row_start, rows = _tile(a, t)
        # ragged coordinates (triton.tools.ragged_tma.to_ragged_indices): the group's end, then
        # its row r as RAGGED_ROWS - rows + r, out of bounds (zeros) from r = rows on
        end = row_start + rows
        first = _RAGGED - rows
        k0 = tile_k * 2 * HALF
        for mt in range(gl.cdiv(rows, ROWS)):
            s = it % NSTAGE
            mbarrier.wait(a.empty.index(s), ((it // NSTAGE) & 1) ^ 1)
            mbarrier.expect(a.ready.index(s), 2 * a.x_desc.block_type.nbytes + a.dy_desc.block_type.nbytes)
            row = first + mt * ROWS
            tma.async_copy_global_to_shared(a.x_desc, [_RAGGED, end, row, k0], a.ready.index(s),
                                            a.x_smem.index(2 * s))
            tma.async_copy_global_to_shared(a.x_desc, [_RAGGED, end, row, k0 + HALF], a.ready.index(s),
                                            a.x_smem.index(2 * s + 1))
            tma.async_copy_global_to_shared(a.dy_desc, [_RAGGED, end, row, tile_n * BN], a.ready.index(s),
                                            a.dy_smem.index(s))
            it += 1


@gluon.jit
def _last_chunk_mma(x_tile, dy_tile, acc, left):
    """acc + x_tileᵀ · dy_tile over the chunk's first ``left`` (1 ... 64) rows, rounded up to 16:
    the rows past the group's end are zeros (the ragged view), and multiplying them is waste a
    whole-chunk wgmma pays: half a chunk a tile on average, of DeepSeek-V3's ~4.5 (CUTLASS and
    the Triton kernel pay it too); 16-row steps leave an eighth of one. Synchronous: the
    epilogue needs it next. The accumulator starts at +0 and the skipped products are exact
    zeros, so the output is the whole chunk's, bit for bit.

    Only 16-row slices: with a 32-row one (``slice(0, 32)``) every group whose last chunk had
    17-48 rows came out wrong on an H200 (triton 3.6; relative error 0.02-0.7, on all of dw[g]'s
    rows but its first 64, for I = 200, 256 and 1024), where two 16-row slices in its place are
    bit-equal to the whole-chunk wgmma (2026-12-02; tests/test_grouped_mm.py's 16-row edges)."""
    gl.static_assert(x_tile.type.shape[0] == 64, "four 16-row k-steps a chunk")
    if left > 48:
        acc = warpgroup_mma(x_tile.permute((1, 0)), dy_tile, acc)
    else:
        acc = warpgroup_mma(x_tile.slice(0, 16).permute((1, 0)), dy_tile.slice(0, 16), acc)
        if left > 16:
            acc = warpgroup_mma(x_tile.slice(16, 16).permute((1, 0)), dy_tile.slice(16, 16), acc)
        if left > 32:
            acc = warpgroup_mma(x_tile.slice(32, 16).permute((1, 0)), dy_tile.slice(32, 16), acc)
    return acc


@gluon.jit
def _store_fp32(dw_g, acc, row0, col0, K, N, ADD: gl.constexpr):
    """Store (ADD: add into) the fp32 tile half ``acc`` at rows ``row0 ...``, columns ``col0 ...``
    of the fp32 (K, N) ``dw_g``, straight from the accumulator's registers (a thread's pairs of
    columns, 8 bytes, four threads a 32-byte sector of a row): an fp32 half through shared memory
    would take 64 KB a consumer beside the ring. A quarter of the columns at a time, so that the
    values added to (ADD) hold 32 registers, not 128, beside the accumulator's 128 (the splits
    are the accumulator's own registers: each thread holds columns of every quarter)."""
    Q: gl.constexpr = acc.shape[1] // 4
    left, right = acc.reshape([acc.shape[0], 2, 2 * Q]).permute((0, 2, 1)).split()
    l0, l1 = left.reshape([acc.shape[0], 2, Q]).permute((0, 2, 1)).split()
    r0, r1 = right.reshape([acc.shape[0], 2, Q]).permute((0, 2, 1)).split()
    _store_fp32_part(dw_g, l0, row0, col0, K, N, ADD)
    _store_fp32_part(dw_g, l1, row0, col0 + Q, K, N, ADD)
    _store_fp32_part(dw_g, r0, row0, col0 + 2 * Q, K, N, ADD)
    _store_fp32_part(dw_g, r1, row0, col0 + 3 * Q, K, N, ADD)


@gluon.jit
def _store_fp32_part(dw_g, part, row0, col0, K, N, ADD: gl.constexpr):
    layout: gl.constexpr = part.type.layout
    rows = row0 + gl.arange(0, part.shape[0], layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, part.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = dw_g + gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < K, 1) & gl.expand_dims(cols < N, 0)
    if ADD:
        part += gl.load(ptrs, mask=mask, other=0.0)
    gl.store(ptrs, part, mask=mask)


@gluon.jit
def _consumer(a, WG: gl.constexpr, EPILOGUE: gl.constexpr):
    NSTAGE: gl.constexpr = a.dy_smem.type.shape[0]
    ROWS: gl.constexpr = a.x_smem.type.shape[3]
    HALF: gl.constexpr = a.x_smem.type.shape[4]
    BN: gl.constexpr = a.dy_smem.type.shape[4]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    buf = a.c_smem.index(WG)  # (the 16-bit epilogue's)
    it = 0
    # (tile program_id exists: the host launches at most one CTA a tile)
    g, tile_k, tile_n, _, rows = _tile(a, gl.program_id(0))
    for t in range(gl.program_id(0), a.n_tiles_total, gl.num_programs(0)):
        acc = gl.zeros([HALF, BN], gl.float32, layout=acc_layout)
        full = rows // ROWS
        for mt in range(full):
            s = it % NSTAGE
            mbarrier.wait(a.ready.index(s), (it // NSTAGE) & 1)
            acc = warpgroup_mma(a.x_smem.index(2 * s + WG).reshape([ROWS, HALF]).permute((1, 0)),
                                a.dy_smem.index(s).reshape([ROWS, BN]), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(a.empty.index((it + NSTAGE - 1) % NSTAGE), count=1, pred=mt > 0)
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(a.empty.index((it + NSTAGE - 1) % NSTAGE), count=1, pred=full > 0)
        if rows > full * ROWS:
            s = it % NSTAGE
            mbarrier.wait(a.ready.index(s), (it // NSTAGE) & 1)
            acc = _last_chunk_mma(a.x_smem.index(2 * s + WG).reshape([ROWS, HALF]),
                                  a.dy_smem.index(s).reshape([ROWS, BN]), acc, rows - full * ROWS)
            mbarrier.arrive(a.empty.index(s), count=1)
            it += 1
        # The next tile's coordinates (the last tile's again after the last), loaded before this
        # tile's epilogue: their dependent global loads then wait behind it, not between the
        # next tile's start and its first wgmma, which a short group's tile (~4 chunks on
        # DeepSeek-V3) would feel.
        t_next = gl.minimum(t + gl.num_programs(0), a.n_tiles_total - 1)
        g_next, tile_k_next, tile_n_next, _, rows_next = _tile(a, t_next)
        row0 = tile_k * 2 * HALF + WG * HALF
        if EPILOGUE == 0:
            # The previous tile's store from this buffer is done before it is written again (each
            # thread waits for its own copies; the barrier makes that every thread's knowledge).
            tma.store_wait(0)
            gl.thread_barrier()
            buf.reshape([HALF, BN]).store(acc.to(a.dw_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(a.dw_desc, [g, row0, tile_n * BN], buf)
        else:
            _store_fp32(a.dw_ptr + g.to(gl.int64) * a.K * a.N, acc, row0, tile_n * BN, a.K, a.N, EPILOGUE == 2)
        g, tile_k, tile_n, rows = g_next, tile_k_next, tile_n_next, rows_next
    if EPILOGUE == 0:
        tma.store_wait(0)


@gluon.jit
def _consumer_0(a, EPILOGUE: gl.constexpr):
    _consumer(a, 0, EPILOGUE)


@gluon.jit
def _consumer_1(a, EPILOGUE: gl.constexpr):
    _consumer(a, 1, EPILOGUE)


@gluon.jit
def _grouped_mm_wgrad_gluon_kernel(x_desc, dy_desc, dw_desc, dw_ptr, offsets_ptr, G, K, N,
                                   BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                                   STAGES: gl.constexpr, EPILOGUE: gl.constexpr,
                                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """x_desc, dy_desc: ``ragged_descriptor`` of x (M, K) in (BLOCK_M, BLOCK_K / 2) blocks and of
    dy (M, N) in (BLOCK_M, BLOCK_N) blocks. EPILOGUE 0: dw_desc over dw (G, K, N) in (1,
    BLOCK_K / 2, BLOCK_N) blocks receives the tiles in the operands' dtype; 1: the fp32 tiles are
    stored at ``dw_ptr`` (fp32 (G, K, N), contiguous); 2: added to what is there."""
    dtype: gl.constexpr = x_desc.dtype
    # slot s of the ring: x halves 2s and 2s + 1, dy block s, each in its descriptor's 4-D block
    ROWS: gl.constexpr = x_desc.block_type.shape[2]
    HALF: gl.constexpr = BLOCK_K // 2
    x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, 1, 1, ROWS, HALF], x_desc.layout)
    dy_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, ROWS, BLOCK_N], dy_desc.layout)
    if EPILOGUE == 0:
        c_smem = gl.allocate_shared_memory(dtype, [2, 1, HALF, BLOCK_N], dw_desc.layout)
    else:
        c_smem = x_smem  # not used: the fp32 epilogue stores from registers
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # a slot is free once both consumers are done
    k_tiles = gl.cdiv(K, BLOCK_K)
    n_tiles = gl.cdiv(N, BLOCK_N)
    a = _Args(x_desc=x_desc, dy_desc=dy_desc, dw_desc=dw_desc, dw_ptr=dw_ptr, offsets_ptr=offsets_ptr, K=K, N=N,
              n_tiles_total=G * k_tiles * n_tiles, tiles_per_group=k_tiles * n_tiles, k_tiles=k_tiles,
              n_tiles=n_tiles, x_smem=x_smem, dy_smem=dy_smem, c_smem=c_smem, ready=ready, empty=empty)
    gl.warp_specialize([(_consumer_0, (a, EPILOGUE)), (_consumer_1, (a, EPILOGUE)), (_producer, (a, ))], [4, 1],
                       [CONSUMER_REGS, PRODUCER_REGS])


# Where it wins. Against grouped_mm_wgrad_tma, same bits out (H200, bf16, 5 alternating rounds,
# bench/results/grouped_gemm_gluon.md, 2026-12-02), up / down projection: Mixtral (8 groups of
# ~2048 rows, dw[g] 4096 x 28672 / 14336 x 4096) 1.038 / 1.043x, OLMoE (64 of ~2048) 1.140 /
# 1.101x, Qwen3-A3B (128 of ~1024) 1.109 / 1.112x, DeepSeek-V3 (256 of ~256) 1.063 / 1.128x; the
# whole layer's fwd+bwd 1.004-1.040x faster with it. So every group count; below 128 rows a group
# on average (half a tile's chunks) it was not measured, and the Triton kernel keeps those.
MIN_GROUPS = 1
MIN_ROWS_PER_GROUP = 128
ROUTED = True
# The fp32 add epilogue (the master gradient's: from registers, 4 ring stages) against
# grouped_mm_wgrad_tma's, same values out (same run, the "wgrad += fp32" rows), up / down: OLMoE
# 1.060 / 1.036x, Qwen3-A3B 1.001 / 1.015x (parity: A-vs-A 1.011-1.012), but Mixtral 0.962 /
# 0.950x and DeepSeek-V3 0.897 / 0.867x (its 30 GB fp32 dw read and written, about 12 ms of HBM
# traffic, against about 8 ms of matmul). Why it loses on those is not profiled (a guess: each
# quarter's loads are waited for before the next quarter's, where the TMA kernel's 8 warps a
# tile hide more of them). So from 16 groups (Mixtral's 8 lose, at as many rows a group as
# OLMoE's that win: the count stands for "not Mixtral", nothing more is known) of 1024 rows on
# average (DeepSeek-V3's 256 lose), with I and N multiples of 16 (otherwise the stores are
# 4-byte ones and the add spills: sm_90 compile, not measured).
FP32_ROUTED = True
FP32_MIN_GROUPS = 16
FP32_MIN_ROWS_PER_GROUP = 1024


def wgrad_gluon_ok(x_MI: torch.Tensor, dw_LIN: torch.Tensor) -> bool:
    """Whether ``grouped_mm_wgrad_gluon`` serves this weight gradient (the caller has checked
    what ``grouped_mm_wgrad_tma`` needs: 16-bit, aligned rows, one segment per group): an sm_90
    GPU, rows the ragged view can address, ``ROUTED`` and ``grouped_mm_gluon.ENABLED``, and the
    measured range where it beats (fp32: matches or beats) the Triton kernel, by x's rows over the groups (padding
    included: the group sizes are on the device): for dw in the operands' dtype at least
    ``MIN_GROUPS`` groups of ``MIN_ROWS_PER_GROUP`` rows on average; for a contiguous fp32 dw
    (the master gradient's, with ``FP32_ROUTED``) ``FP32_MIN_GROUPS`` of ``FP32_MIN_ROWS_PER_GROUP``,
    I and N multiples of 16."""
    L, M = dw_LIN.shape[0], x_MI.shape[0]
    if dw_LIN.dtype == x_MI.dtype:
        size_ok = L >= MIN_GROUPS and MIN_ROWS_PER_GROUP * L <= M
    else:
        size_ok = (FP32_ROUTED and dw_LIN.dtype == torch.float32 and dw_LIN.is_contiguous()
                   and L >= FP32_MIN_GROUPS and FP32_MIN_ROWS_PER_GROUP * L <= M
                   and dw_LIN.shape[1] % 16 == 0 and dw_LIN.shape[2] % 16 == 0)
    return (ROUTED and grouped_mm_gluon.ENABLED and x_MI.is_cuda and capability(x_MI.device) == (9, 0)
            and x_MI.dtype in GLUON_DTYPES and size_ok and M <= RAGGED_ROWS)


def ragged_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """Triton's ragged view of the rows of ``t`` (M, C) (``triton.tools.ragged_tma``: shape
    [0x7FFF0000, 0x7FFF0000, RAGGED_ROWS, C], strides [2^34 - s, s, s, 1] for rows s elements
    apart) as a Gluon descriptor in (1, 1, *block) blocks of the default swizzled layout: the
    block at ``[RAGGED_ROWS, start + rows, RAGGED_ROWS - rows + r, c]`` (its
    ``to_ragged_indices``) holds rows start + r, ... of the segment of ``rows`` rows from
    ``start``, and zeros past its end. Addresses wrap mod 2^64: the first axis adds
    -RAGGED_ROWS · s (RAGGED_ROWS · 2^34 elements of 16 bits is 2^65 bytes), the second and third
    (start + rows) · s and (RAGGED_ROWS - rows + r) · s, together row start + r; the third axis's
    bound, RAGGED_ROWS, puts r >= rows out of bounds."""
    if t.shape[0] > RAGGED_ROWS:
        raise ValueError(f"grouped_mm_wgrad_gluon: {t.shape[0]} rows, over the ragged view's {RAGGED_ROWS}")
    view = create_ragged_descriptor(t, block)
    return TensorDescriptor(t, view.shape, view.strides, view.block_shape,
                            gluon_layout(tuple(view.block_shape), GLUON_DTYPES[t.dtype]))


def grouped_mm_wgrad_gluon(x_MI: torch.Tensor, dy_MN: torch.Tensor, offsets_J: torch.Tensor,
                           dw_LIN: torch.Tensor, programs: int | None = None, accumulate: bool = False) -> None:
    """Fill ``dw_LIN`` (L, I, N), contiguous, for operands ``wgrad_gluon_ok`` accepts: in x's
    dtype, or fp32 (the sums unrounded), with ``accumulate`` added to its contents
    (``moe.kernels.master_grad.accumulate_wgrad_``). ``programs``: CTAs to launch (default one
    per SM; tests take fewer)."""
    L, I, N = dw_LIN.shape
    fp32 = dw_LIN.dtype == torch.float32
    if accumulate and not fp32:
        raise ValueError(f"accumulate needs an fp32 dw_LIN, got {dw_LIN.dtype}")
    if fp32 and not dw_LIN.is_contiguous():  # the fp32 epilogue addresses dw by its shape
        raise ValueError(f"an fp32 dw_LIN must be contiguous, got strides {dw_LIN.stride()}")
    tiles = L * cdiv(I, BLOCK_K) * cdiv(N, BLOCK_N)
    _grouped_mm_wgrad_gluon_kernel[(min(programs or sm_count(x_MI.device), tiles),)](
        ragged_descriptor(x_MI, [BLOCK_M, WG_M]), ragged_descriptor(dy_MN, [BLOCK_M, BLOCK_N]),
        None if fp32 else descriptor(dw_LIN, [1, WG_M, BLOCK_N]), dw_LIN, offsets_J, L, I, N,
        BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, STAGES=FP32_STAGES if fp32 else STAGES,
        EPILOGUE=(2 if accumulate else 1) if fp32 else 0, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAX_NREG)
