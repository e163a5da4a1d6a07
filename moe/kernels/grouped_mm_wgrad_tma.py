"""Hopper weight gradient of the grouped matmul, one row segment per group: ``dw[g] = x_gᵀ @ dy_g``.

Legend: M packed rows, I input width, N output width, L weight groups (= row segments);
``group_size`` = the ``k_tiles · n_tiles`` output tiles of one group's ``dw[l]``. The kernels' own
parameters keep the matmul names: ``K`` is I, ``G`` is L.

The general kernel (``grouped_mm_wgrad``) walks tiles and restarts its software pipeline at
every tile: a tile's reduction loop runs over its group's rows, a trip count that changes from
group to group, and Triton only flattens (prefetches across) nested loops whose inner trip
count is invariant. Here the loops are ordered group → tile → row chunk: for one group the
chunk count is fixed, so the tile loop flattens and the loads of the next tile are issued
during the current tile's last chunks and its store. The group's two tensor descriptors (row
bound = the group's end, so rows of the next group load as zeros) are built once per group
and program instead of once per tile.

Work split: the grid (one program per SM, rounded down to a multiple of the team size) forms
``n_teams`` teams; team t takes groups ``t, t + n_teams, ...`` and its programs share each
group's tiles with a stride of the team size. Few teams keep few groups' rows in L2 at once;
enough tiles per program and group (~6) amortize the pipeline fill, hence
``n_teams = clamp(round(6 · grid / group_size), 1, 8)``. Measured on an H100 (bf16, 3 rounds
against ``torch._grouped_mm`` in one run; table in bench/results/grouped_gemm.md), anchor time
over ours: DeepSeek-V3 (group_size = 448) 1.010 with 2 teams, 0.948 with 1, 0.851 for the
general kernel; OLMoE (group_size = 64) 0.996 with 8 teams, 0.96 with 1, 0.82 with 12; Mixtral
(group_size = 1792) 0.976 with 1 team, 0.868 general.

Pipeline depth: with many teams each program walks only ~6 tiles of a group between two restarts of
its pipeline (new descriptors, new chunk count), and a deeper pipeline (4 stages) hides more of each
restart; with few teams the 3-stage loop is as fast or faster. Measured on an H100 (bf16, 5 rounds
against ``torch._grouped_mm``'s wgrad in one run; table in bench/results/grouped_gemm.md), anchor
time over ours, 3 stages → 4 stages (measured with ``warp_specialize=True`` on the tile loop, which
Triton 3.6 compiles to the same sm_90 PTX as without it: the difference is the stages): OLMoE (8
teams) 0.959 → 1.004, Qwen3 (8 teams) 0.944 → 0.995, Mixtral (1 team) 1.004 → 0.985, DeepSeek-V3 (2
teams) 1.034 → 1.014. Four stages of (64×128 + 64×256) bf16 fit shared memory only with the epilogue
stored in two 128×128 halves (192 + 32 KB); the halves cost nothing measurable at 3 stages
(0.94–1.01 either way).

Master-gradient epilogue (``moe.kernels.master_grad.accumulate_wgrad_``): given an fp32 ``dw``
(the experts' fp32 ``.grad`` under ``moe.master_weight_step``), the fp32 tile is added into it
with plain loads and stores instead of being rounded to 16 bits, stored, and added by a second
pass, which read and wrote 2 + 2 + 4 + 4 bytes a parameter where this reads and writes 4 + 4.

Only for one segment per group (J = L) and 16-bit operands: with J = G·L segments a tile
reduces over G segments, each needing its own descriptors, and fp32 tiles do not fit shared
memory with the TMA-store epilogue. Those cases run the general kernel.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernel_floor import INTERPRET, band_swizzle, cdiv, sm_count, use_tensor_descriptors

# (BLOCK_K, BLOCK_N, BLOCK_M, GROUP_K): the general kernel's winning tile on the H100;
# the interpreter walks small tiles so that tests at sizes <= 128 run several of each loop.
_TILE = (32, 32, 16, 2) if INTERPRET else (128, 256, 64, 8)
_TILES_PER_PROGRAM = 6
_MAX_TEAMS = 8
_DEEP_FROM_TEAMS = 4  # n_teams from which the 4-stage pipeline runs


@triton.jit
def segment_descriptors(x_ptr, dy_ptr, offsets_ptr, seg, K, N, stride_xm, stride_dym,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row count of segment ``seg`` and tensor descriptors over its rows of x (rows, K) and dy
    (rows, N): rows of other segments load as zeros."""
    row_end = tl.load(offsets_ptr + seg).to(tl.int32)
    row_start = tl.load(offsets_ptr + seg - 1, mask=seg > 0, other=0).to(tl.int32)
    rows = row_end - row_start
    x_desc = tl.make_tensor_descriptor(x_ptr + tl.cast(row_start, tl.int64) * stride_xm,
                                       shape=[tl.maximum(rows, 1), K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    dy_desc = tl.make_tensor_descriptor(dy_ptr + tl.cast(row_start, tl.int64) * stride_dym,
                                        shape=[tl.maximum(rows, 1), N], strides=[stride_dym, 1],
                                        block_shape=[BLOCK_M, BLOCK_N])
    return rows, x_desc, dy_desc


@triton.jit
def _grouped_mm_wgrad_tma_kernel(
    x_ptr, dy_ptr, dw_desc, dw_ptr, offsets_ptr,
    N, K, G, TEAM, N_TEAMS, stride_xm, stride_dym, stride_dwg, stride_dwk,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    GROUP_K: tl.constexpr, EPILOGUE: tl.constexpr,
):
    """EPILOGUE 0: dw_desc, a 3-D descriptor over dw (G, K, N), block (1, BLOCK_K, BLOCK_N // 2),
    clipped at K, N, receives the tile in dw's dtype. 1: the fp32 tile is stored at ``dw_ptr``
    (fp32 (G, K, N), unit last stride); 2: added to what is there."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    group_size = k_tiles * n_tiles
    slot = pid % TEAM
    for g in range(pid // TEAM, G, N_TEAMS):
        first = g * group_size
        # This program's tiles of group g: global index congruent to its slot modulo the team.
        t0 = first + (slot - first % TEAM + TEAM) % TEAM
        if t0 < first + group_size:
            rows, x_desc, dy_desc = segment_descriptors(x_ptr, dy_ptr, offsets_ptr, g, K, N, stride_xm, stride_dym,
                                                        BLOCK_M, BLOCK_K, BLOCK_N)
            chunks = tl.cdiv(rows, BLOCK_M)
            for tile in tl.range(t0, first + group_size, TEAM, flatten=True):
                tile_k, tile_n = band_swizzle(tile - first, k_tiles, n_tiles, GROUP_K)
                acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
                for mt in range(0, chunks):
                    xt = x_desc.load([mt * BLOCK_M, tile_k * BLOCK_K]).T
                    dy = dy_desc.load([mt * BLOCK_M, tile_n * BLOCK_N])
                    acc = tl.dot(xt, dy, acc)
                left, right = acc.reshape(BLOCK_K, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                if EPILOGUE == 0:
                    dw_desc.store([g, tile_k * BLOCK_K, tile_n * BLOCK_N],
                                  left.to(dw_desc.dtype).reshape(1, BLOCK_K, BLOCK_N // 2))
                    dw_desc.store([g, tile_k * BLOCK_K, tile_n * BLOCK_N + BLOCK_N // 2],
                                  right.to(dw_desc.dtype).reshape(1, BLOCK_K, BLOCK_N // 2))
                else:
                    # fp32 master gradient: plain loads and stores, a quarter of the tile at a
                    # time: the layout change of a half (128 x 128 fp32, 64 KB of shared memory)
                    # beside the 4-stage pipeline (192 KB) needed 262,208 B of 232,448 on an H100
                    ks = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
                    row_ptrs = dw_ptr + tl.cast(g, tl.int64) * stride_dwg + tl.cast(ks, tl.int64) * stride_dwk
                    ns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N // 4)
                    l0, l1 = left.reshape(BLOCK_K, 2, BLOCK_N // 4).permute(0, 2, 1).split()
                    r0, r1 = right.reshape(BLOCK_K, 2, BLOCK_N // 4).permute(0, 2, 1).split()
                    _store_fp32(row_ptrs, ns, l0, ks < K, N, EPILOGUE == 2)
                    _store_fp32(row_ptrs, ns + BLOCK_N // 4, l1, ks < K, N, EPILOGUE == 2)
                    _store_fp32(row_ptrs, ns + BLOCK_N // 2, r0, ks < K, N, EPILOGUE == 2)
                    _store_fp32(row_ptrs, ns + 3 * BLOCK_N // 4, r1, ks < K, N, EPILOGUE == 2)


@triton.jit
def _store_fp32(row_ptrs, cols, part, row_ok, N, ADD: tl.constexpr):
    """Store (or with ADD add into) the fp32 columns ``cols`` of the rows at ``row_ptrs``."""
    ptrs = row_ptrs[:, None] + cols[None, :]
    mask = row_ok[:, None] & (cols < N)[None, :]
    if ADD:
        part += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, part, mask=mask)


def wgrad_tma_plan(L: int, I: int, N: int, device: torch.device) -> tuple[int, int, bool]:
    """(programs per team, teams, deep pipeline) for ``dw`` of shape (L, I, N)."""
    block_k, block_n = _TILE[:2]
    group_size = cdiv(I, block_k) * cdiv(N, block_n)
    grid = min(sm_count(device), L * group_size)
    n_teams = max(1, min(_MAX_TEAMS, round(_TILES_PER_PROGRAM * grid / group_size), grid))
    return grid // n_teams, n_teams, n_teams >= _DEEP_FROM_TEAMS


def grouped_mm_wgrad_tma(x_MI: torch.Tensor, dy_MN: torch.Tensor, offsets_J: torch.Tensor,
                         dw_LIN: torch.Tensor, accumulate: bool = False) -> None:
    """Fill ``dw_LIN`` (L, I, N) for operands checked by ``grouped_mm_wgrad``: 16-bit, row-major,
    16-byte aligned rows, one segment per group (``offsets_J`` has L entries).

    An fp32 ``dw_LIN`` (row-major) receives the fp32 sums unrounded, and with ``accumulate``
    they are added to its contents (``moe.kernels.master_grad.accumulate_wgrad_``); a 16-bit one
    is overwritten in its dtype."""
    L, I, N = dw_LIN.shape
    block_k, block_n, block_m, group_k = _TILE
    team, n_teams, deep = wgrad_tma_plan(L, I, N, x_MI.device)
    fp32 = dw_LIN.dtype == torch.float32
    if accumulate and not fp32:
        raise ValueError(f"accumulate needs an fp32 dw_LIN, got {dw_LIN.dtype}")
    use_tensor_descriptors()
    dw_desc = TensorDescriptor(dw_LIN, list(dw_LIN.shape), list(dw_LIN.stride()), [1, block_k, block_n // 2])
    _grouped_mm_wgrad_tma_kernel[(team * n_teams,)](
        x_MI, dy_MN, dw_desc, dw_LIN, offsets_J,
        N, I, L, team, n_teams, x_MI.stride(0), dy_MN.stride(0), dw_LIN.stride(0), dw_LIN.stride(1),
        BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_M=block_m, GROUP_K=group_k,
        EPILOGUE=(2 if accumulate else 1) if fp32 else 0, num_stages=4 if deep else 3, num_warps=8,
    )
