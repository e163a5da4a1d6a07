"""Hopper grouped matmul (no activation) in Gluon: a producer warp, two consumer warpgroups and
an asynchronous TMA-store epilogue.

``y[rows of s] = a[rows of s] @ b[s % L]`` as ``grouped_mm_tma``, for the same operands, with the
same 128×256 tiles, 64-wide reduction chunks, tile order and fp32 accumulation: the output is
bit for bit that kernel's (tests/test_grouped_mm.py checks it on the GPU).

Why a second Hopper kernel. The Triton TMA kernel's epilogue stores each tile from registers
while its tensor cores wait; with the stores' mask ANDed with a runtime 0 (every instruction
but the writes) it ran 2-18 % faster (H200, bench/results/grouped_gemm.md), and Triton 3.6 has
no way to overlap the store with the next tile (its ``warp_specialize`` is a no-op on sm_90,
a TMA store is waited for where it is issued). Gluon says it directly:

- **A producer warp** issues the TMA loads of each tile's A (128×64) and B (64×256) chunks into a
  ``STAGES``-deep ring of shared-memory slots (ready / empty mbarriers) and runs ahead into the
  next tile while the consumers finish the current one.
- **Two consumer warpgroups** each multiply 64 of the tile's 128 rows by the 256 columns (one
  asynchronous wgmma per chunk, the previous chunk's slot released once only the newest wgmma is
  still running), with 240 registers a thread (``setmaxnreg``) for the 64×256 fp32
  accumulator.
- **The epilogue does not wait for its store.** Each consumer writes its 64×256 slice to its own
  shared-memory buffer and sends it by TMA; it waits for that send only before writing the
  buffer again, a tile later, so the write overlaps the next tile's matmuls. A slice that
  reaches past its segment's end (its rows belong to the next segment, whose tile writes them)
  cannot go by TMA, which clips only at the tensor's edge: it is staged in the same buffer and
  stored masked, 16 bytes a thread, from a row-major layout.
- **A tile table** (``_tile_table_kernel``, one small Triton launch): each tile's first row,
  column tile, weight group and rows left in its segment, so a tile reads four independent
  words instead of the Triton kernel's binary search over the segments (whose dependent loads
  the Triton kernel's flattened pipeline hides during the previous tile, and a warp-specialized
  consumer would not: 9 dependent loads at DeepSeek-V3's 256 segments).

Measured (H200, bf16, 5 alternating rounds, bench/results/grouped_gemm_gluon.md, 2026-12-02),
over the TMA kernel on each expert projection of the four bench shapes: forward 1.007–1.131×,
dgrad 1.012–1.091×; against ``torch._grouped_mm`` 1.010–1.179×. A first version in which each
consumer searched the segments for every tile lost 8–15 % on DeepSeek-V3 (256 segments); the
table made that 1–5 % gained.

Scope (``gluon_ok``): sm_90, bf16/fp16, no activation (the SwiGLU layer's four GEMMs are
activation-free: its SwiGLU is a separate pass), TMA-addressable operands and output.
"""

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_floor import (SCALAR, GLUON_DTYPES, aligned16, band_swizzle, capability, cdiv, gluon_layout,
                          partition_args, sm_count)
from moe.kernels.grouped_mm_tma import TILE_M, TILE_N, _GROUP_M, segment_tiles

BLOCK_K = 64
STAGES = 3  # 3 × (16 + 32) KB of ring + 2 × 32 KB of store buffers: 208 KB of the 227 KB
WG_M = 64  # rows per consumer warpgroup: one m64 wgmma row block
PRODUCER_REGS = 24
CONSUMER_REGS = (65536 - 128 * PRODUCER_REGS) // (128 * 2) // 8 * 8  # 240
MAX_NREG = 65536 // (128 * 3) // 8 * 8  # the launch's share: 3 warpgroups' worth of threads
TABLE_BLOCK = 256
ENABLED = True
"""Whether the grouped GEMM's launchers route what the Gluon kernels accept to them (this
forward/dgrad where ``gluon_ok``, ``grouped_mm_wgrad_gluon`` where ``wgrad_gluon_ok``): the
benches' A/B switch; off, those calls take the Triton TMA kernels."""


@triton.jit
def _tile_table_kernel(tile_end_ptr, offsets_ptr, table_ptr, S, G, n_tiles, capacity,
                       LOG_S: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Row ``t`` of ``table`` (capacity, 4) int32 for each tile ``t < tile_end[S-1]``: first row
    m0, column tile, weight group, rows of the segment from m0 on; in the Triton TMA kernel's
    order (segments in turn, bands of GROUP_M m-tiles within one)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = (t < tl.load(tile_end_ptr + S - 1)) & (t < capacity)
    lo = tl.zeros((BLOCK,), tl.int32)
    hi = tl.full((BLOCK,), S - 1, tl.int32)
    for _ in tl.static_range(LOG_S):  # the first s with tile_end[s] > t
        mid = (lo + hi) // 2
        left = tl.load(tile_end_ptr + mid) > t
        hi = tl.where(left, mid, hi)
        lo = tl.where(left, lo, mid + 1)
    first = lo > 0
    tiles_before = tl.load(tile_end_ptr + lo - 1, mask=first, other=0)
    row_start = tl.load(offsets_ptr + lo - 1, mask=first, other=0).to(tl.int32)
    rows = tl.load(offsets_ptr + lo).to(tl.int32) - row_start
    # A dead lane may land on an empty segment: one m-tile keeps its swizzle from dividing by 0.
    m_tiles = tl.maximum(tl.cdiv(rows, BLOCK_M), 1)
    tile_m, tile_n = band_swizzle(t - tiles_before, m_tiles, n_tiles, GROUP_M)
    row = table_ptr + tl.cast(t, tl.int64) * 4
    tl.store(row, row_start + tile_m * BLOCK_M, mask=live)
    tl.store(row + 1, tile_n, mask=live)
    tl.store(row + 2, lo % G, mask=live)
    tl.store(row + 3, rows - tile_m * BLOCK_M, mask=live)


@gluon.jit
def _tiles(a):
    """How many tiles this call has (read on the device; never past the table's rows)."""
    return gl.minimum(gl.load(a.tile_end_ptr + a.S - 1), a.capacity)


@partition_args
class _Args:
    """What the producer and the two consumers share."""
    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    y_desc: tma.tensor_descriptor
    y_ptr: gl.tensor
    table_ptr: gl.tensor
    tile_end_ptr: gl.tensor
    S: SCALAR
    capacity: SCALAR
    N: SCALAR
    K: SCALAR
    stride_ym: SCALAR
    a_smem: gl.shared_memory_descriptor
    b_smem: gl.shared_memory_descriptor
    c_smem: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@gluon.jit
def _producer(a, B_TRANS: gl.constexpr):
    NSTAGE: gl.constexpr = a.a_smem.type.shape[0]
    BK: gl.constexpr = a.a_smem.type.shape[2]
    BN: gl.constexpr = a.y_desc.block_type.shape[1]
    k_tiles = gl.cdiv(a.K, BK)
    it = 0  # chunks loaded by this CTA: picks the slot and its phase
    for t in range(gl.program_id(0), _tiles(a), gl.num_programs(0)):
        m0 = gl.load(a.table_ptr + 4 * t)
        n0 = gl.load(a.table_ptr + 4 * t + 1) * BN
        g = gl.load(a.table_ptr + 4 * t + 2)
        for kt in range(k_tiles):
            s = it % NSTAGE
            # A fresh mbarrier counts as having completed the phase before 0: the first pass
            # through the ring does not wait.
            mbarrier.wait(a.empty.index(s), ((it // NSTAGE) & 1) ^ 1)
            mbarrier.expect(a.ready.index(s), a.a_desc.block_type.nbytes + a.b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a.a_desc, [m0, kt * BK], a.ready.index(s), a.a_smem.index(s))
            if B_TRANS:
                tma.async_copy_global_to_shared(a.b_desc, [g, n0, kt * BK], a.ready.index(s),
                                                a.b_smem.index(s))
            else:
                tma.async_copy_global_to_shared(a.b_desc, [g, kt * BK, n0], a.ready.index(s),
                                                a.b_smem.index(s))
            it += 1


@gluon.jit
def _consumer(a, WG: gl.constexpr, B_TRANS: gl.constexpr):
    """Rows m0 + 64·WG ... + 63 of each tile. Rows past the segment's end (the next segment's)
    are multiplied and not stored, as in the Triton kernel."""
    NSTAGE: gl.constexpr = a.a_smem.type.shape[0]
    BK: gl.constexpr = a.a_smem.type.shape[2]
    ROWS: gl.constexpr = a.y_desc.block_type.shape[0]
    BN: gl.constexpr = a.y_desc.block_type.shape[1]
    dtype: gl.constexpr = a.y_desc.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    # The masked tail's layout: a warp covers a row, 8 elements (16 bytes) a thread.
    tail_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    # Alignment the compiler can see (gluon_ok: N and the row stride are multiples of 8), so the
    # tail's stores are 16 bytes wide wherever N is not a multiple of 16 too.
    N = a.N // 8 * 8
    stride_ym = a.stride_ym // 8 * 8
    k_tiles = gl.cdiv(a.K, BK)
    buf = a.c_smem.index(WG)
    offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, tail_layout))
    offs_c = gl.arange(0, BN, layout=gl.SliceLayout(0, tail_layout))
    it = 0
    for t in range(gl.program_id(0), _tiles(a), gl.num_programs(0)):
        m0 = gl.load(a.table_ptr + 4 * t) + WG * ROWS
        n0 = gl.load(a.table_ptr + 4 * t + 1) * BN
        left = gl.load(a.table_ptr + 4 * t + 3) - WG * ROWS
        acc = gl.zeros([ROWS, BN], gl.float32, layout=acc_layout)
        for kt in range(k_tiles):
            s = it % NSTAGE
            mbarrier.wait(a.ready.index(s), (it // NSTAGE) & 1)
            a_tile = a.a_smem.index(s).slice(WG * ROWS, ROWS)
            if B_TRANS:
                b_tile = a.b_smem.index(s).reshape([BN, BK]).permute((1, 0))
            else:
                b_tile = a.b_smem.index(s).reshape([BK, BN])
            acc = warpgroup_mma(a_tile, b_tile, acc, is_async=True)
            # The previous chunk's wgmma is done once at most this one is in flight: free its slot.
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(a.empty.index((it + NSTAGE - 1) % NSTAGE), count=1, pred=kt > 0)
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(a.empty.index((it + NSTAGE - 1) % NSTAGE), count=1)

        # The previous tile's store from this buffer is done (each thread waits for the copies
        # it issued; the barrier makes that every thread's knowledge) before the buffer is
        # written again.
        tma.store_wait(0)
        gl.thread_barrier()
        if left >= ROWS:
            buf.store(acc.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(a.y_desc, [m0, n0], buf)
        elif left > 0:
            buf.store(acc.to(dtype))
            gl.thread_barrier()
            out = buf.load(tail_layout)
            rows = m0 + offs_r
            cols = n0 + offs_c
            ptrs = a.y_ptr + rows.to(gl.int64)[:, None] * stride_ym + cols[None, :]
            gl.store(ptrs, out, mask=(offs_r < left)[:, None] & (cols < N)[None, :])
    tma.store_wait(0)


@gluon.jit
def _consumer_0(a, B_TRANS: gl.constexpr):
    _consumer(a, 0, B_TRANS)


@gluon.jit
def _consumer_1(a, B_TRANS: gl.constexpr):
    _consumer(a, 1, B_TRANS)


@gluon.jit
def _grouped_mm_gluon_kernel(a_desc, b_desc, y_desc, y_ptr, table_ptr, tile_end_ptr, S, capacity,
                             N, K, stride_ym, B_TRANS: gl.constexpr, STAGES: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """a_desc over a (M, K) in (128, 64) blocks; b_desc over the 3-D weight in (1, 64, 256)
    blocks, or with B_TRANS over the stored (L, N, K) in (1, 256, 64) blocks; y_desc over y
    (M, N) in (64, 256) blocks."""
    dtype: gl.constexpr = a_desc.dtype
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    ROWS: gl.constexpr = y_desc.block_type.shape[0]
    BN: gl.constexpr = y_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
    if B_TRANS:
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BN, BK], b_desc.layout)
    else:
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BK, BN], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [2, ROWS, BN], y_desc.layout)  # one per consumer
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # a slot is free once both consumers are done
    a = _Args(a_desc=a_desc, b_desc=b_desc, y_desc=y_desc, y_ptr=y_ptr, table_ptr=table_ptr,
              tile_end_ptr=tile_end_ptr, S=S, capacity=capacity, N=N, K=K, stride_ym=stride_ym,
              a_smem=a_smem, b_smem=b_smem, c_smem=c_smem, ready=ready, empty=empty)
    gl.warp_specialize([(_consumer_0, (a, B_TRANS)), (_consumer_1, (a, B_TRANS)),
                        (_producer, (a, B_TRANS))], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_ok(a_MI: torch.Tensor, b_LIN: torch.Tensor, y: torch.Tensor, activation: str | None,
             save_z: bool) -> bool:
    """Whether ``grouped_mm_gluon`` serves this call: an sm_90 GPU, bf16/fp16, no activation and
    no pre-activation output, operands ``grouped_mm_tma`` reads (checked by the caller) and a y
    whose rows TMA can write (16-byte aligned base and row stride, unit column stride; a
    one-column y has unit strides that ``tma_ok`` would pass, and no 16-byte rows; N a multiple
    of 8, which the masked tail's 16-byte stores assume); and ``ENABLED``."""
    return (ENABLED and a_MI.is_cuda and capability(a_MI.device) == (9, 0) and a_MI.dtype in GLUON_DTYPES
            and activation is None and not save_z and a_MI.shape[1] > 0 and y.shape[1] % 8 == 0
            and y.stride(1) == 1 and y.stride(0) * y.element_size() % 16 == 0 and aligned16(y))


def tile_table(offsets_J: torch.Tensor, tile_end: torch.Tensor, M: int, N: int, L: int) -> torch.Tensor:
    """The (capacity, 4) int32 tile table of ``_tile_table_kernel`` (no host sync: the capacity
    bounds the tile count, ``Σ cdiv(rows_s, 128) ≤ cdiv(M, 128) + J`` m-tiles)."""
    J = offsets_J.shape[0]
    capacity = (cdiv(M, TILE_M) + J) * cdiv(N, TILE_N)
    table = torch.empty(capacity, 4, dtype=torch.int32, device=offsets_J.device)
    _tile_table_kernel[(cdiv(capacity, TABLE_BLOCK),)](
        tile_end, offsets_J, table, J, L, cdiv(N, TILE_N), capacity,
        LOG_S=max(J.bit_length(), 1), BLOCK_M=TILE_M, GROUP_M=_GROUP_M, BLOCK=TABLE_BLOCK)
    return table


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor of ``t`` in ``block`` blocks, in the default swizzled layout."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gluon_layout(tuple(block), GLUON_DTYPES[t.dtype]))


def grouped_mm_gluon(a_MI: torch.Tensor, b_LIN: torch.Tensor, offsets_J: torch.Tensor, y: torch.Tensor,
                     programs: int | None = None) -> None:
    """Write ``y`` for operands ``grouped_mm_forward`` checked and ``gluon_ok`` accepts (shapes
    as ``grouped_mm_tma``). ``programs``: CTAs to launch (default one per SM; tests take fewer so
    that each walks many tiles and reuses its buffers)."""
    M, I = a_MI.shape
    L, _, N = b_LIN.shape
    J = offsets_J.shape[0]
    b_trans = b_LIN.stride(2) != 1
    tile_end = segment_tiles(offsets_J, y, M, N)
    table = tile_table(offsets_J, tile_end, M, N, L)
    a_desc = descriptor(a_MI, [TILE_M, BLOCK_K])
    if b_trans:
        b_desc = descriptor(b_LIN.transpose(1, 2), [1, TILE_N, BLOCK_K])
    else:
        b_desc = descriptor(b_LIN, [1, BLOCK_K, TILE_N])
    y_desc = descriptor(y, [WG_M, TILE_N])
    _grouped_mm_gluon_kernel[(programs or sm_count(a_MI.device),)](
        a_desc, b_desc, y_desc, y, table, tile_end, J, table.shape[0], N, I, y.stride(0),
        B_TRANS=b_trans, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4, maxnreg=MAX_NREG)
