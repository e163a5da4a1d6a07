"""Triton weight gradient of the grouped matmul: ``dw[l] = Σ_{s % L = l} x_sᵀ @ dy_s``.

With one segment per group, 16-bit operands and tensor descriptors available, the launcher
hands over to ``moe.kernels.grouped_mm_wgrad_tma`` (group-major loops, flattened tile loop), or
on sm_90 with dw in the operands' dtype and at least 128 rows a group on average (where it
measured faster: ``wgrad_gluon_ok``) to
``moe.kernels.grouped_mm_wgrad_gluon`` (warp-specialized, its loads running ahead across
groups); the kernel here serves the rest (J = G·L segments, fp32, unaligned rows, pre-Hopper).

Legend: M packed rows in J row segments, I input width, N output width, L weight groups
(J a multiple of L; segment s belongs to weight group s % L, see ``grouped_mm_fwd``). The
kernel's own parameters keep the matmul names: ``K`` is I, ``S`` is J, ``G`` is L.

Work list: the ``L * k_tiles * n_tiles`` output tiles ``(group, k-tile, n-tile)`` of ``dw``,
group-major, the tiles of one group swizzled in bands of ``GROUP_K`` k-tiles, so that the
programs resident at one time share the group's rows of x and dy in L2. A tile's program loops
over the rows of its group's segments in chunks of ``BLOCK_M``, each segment bounded by its
``[start, end)`` read on the device (rows are not aligned to the chunk). The work list depends only on shapes, so no
host sync; a tile of an empty group runs no iteration and stores zeros.

Two schedules (autotuned): one program per tile, or ``PERSISTENT``: one program per SM walking
the list with a stride of the grid. The persistent form pays off with the ``STORE_TMA``
epilogue: the tile is written by an asynchronous TMA store from shared memory (a 3-D descriptor
over ``dw``, clipped at I and N), which Triton waits for only before the next tile's store, so
the write of one tile overlaps the next tile's main loop. DeepSeek-V3's wgrad writes a 7.5 GB
``dw`` (256 × 7168 × 2048 bf16) from ~256-row reductions: at 3.35 TB/s that write alone is
2.2 ms of the 5.2 ms cuBLAS takes, so an epilogue that stalls the SM on it is what lost.
"""

import torch
import triton
import triton.language as tl

from kernel_floor import (
    AUTOTUNE, INTERPRET, band_swizzle, cdiv, check_segments, fixed_config, sm_count, tma_ok,
    use_tensor_descriptors,
)
from moe.kernels.grouped_mm_wgrad_gluon import grouped_mm_wgrad_gluon, wgrad_gluon_ok
from moe.kernels.grouped_mm_wgrad_tma import grouped_mm_wgrad_tma, segment_descriptors

# Interpreter: one small config with every feature on (tensor-descriptor loads where the
# operands allow, persistent walk over 3 programs, TMA store).
_INTERPRET_CONFIG = triton.Config({"BLOCK_K": 32, "BLOCK_N": 32, "BLOCK_M": 16, "GROUP_K": 2, "USE_TMA": True,
                                   "PERSISTENT": True, "STORE_TMA": True})


def wgrad_configs():
    """The kernel's autotune configs (public: tests and bench/grouped_gemm.py time each one)."""
    if INTERPRET:
        return [_INTERPRET_CONFIG]
    return [
        triton.Config({"BLOCK_K": bk, "BLOCK_N": bn, "BLOCK_M": bm, "GROUP_K": 8, "USE_TMA": tma,
                       "PERSISTENT": persistent, "STORE_TMA": store_tma},
                      num_stages=stages, num_warps=warps)
        for bk, bn, bm, stages, warps, tma, persistent, store_tma in [
            # H100, bench/grouped_gemm.py --wgrad-configs, ms ours / cuBLAS:
            # persistent + TMA store won Mixtral 3.15/2.90, OLMoE 0.97/0.92, Qwen3 0.79/0.79 with
            # TMA loads and DeepSeek-V3 5.89/5.27 with pointer loads (per-tile descriptors cost
            # more on its ~256-row groups); the one-program-per-tile form with a pointer store
            # came second (3.16, 0.97, 0.83, 6.48). A TMA store without the persistent walk lost
            # (DeepSeek-V3 7.96): the store then ends every program instead of overlapping the
            # next tile. 128-row chunks and 4 stages never won.
            (128, 256, 64, 3, 8, True, True, True),
            (128, 256, 64, 3, 8, False, True, True),
            (128, 256, 64, 3, 8, True, False, False),
            (128, 256, 64, 3, 8, False, False, False),
        ]
    ]


def _prune_configs(configs, named_args, **kwargs):
    if not kwargs.get("TMA_OK", False):
        configs = [c for c in configs if not (c.kwargs["USE_TMA"] or c.kwargs["STORE_TMA"])] or configs
    if AUTOTUNE or INTERPRET:
        return configs
    tile = lambda kw: kw["BLOCK_K"] * kw["BLOCK_M"] + kw["BLOCK_M"] * kw["BLOCK_N"]  # noqa: E731
    return fixed_config(configs, tile, named_args["x_ptr"].element_size())


@triton.autotune(configs=wgrad_configs(), key=["N", "K"], prune_configs_by={"early_config_prune": _prune_configs})
@triton.heuristics({
    "EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
    "EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0,
})
@triton.jit
def grouped_mm_wgrad_kernel(
    x_ptr, dy_ptr, offsets_ptr, dw_ptr,
    N, K, S, G,
    stride_xm, stride_dym,
    stride_dwg, stride_dwk,
    DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    TMA_OK: tl.constexpr, USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, STORE_TMA: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_K: tl.constexpr,
):
    """USE_TMA: x and dy read through tensor descriptors built per tile, bounded by the group's
    rows (rows of other groups load as zeros). PERSISTENT only changes the grid (see the
    launcher): the loop below walks tiles ``pid, pid + grid, ...``."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    group_size = k_tiles * n_tiles
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if STORE_TMA and TMA_OK:
        dw_desc = tl.make_tensor_descriptor(dw_ptr, shape=[G, K, N], strides=[stride_dwg, stride_dwk, 1],
                                            block_shape=[1, BLOCK_K, BLOCK_N])
    for tile in range(tl.program_id(0), G * group_size, tl.num_programs(0)):
        g = tile // group_size
        tile_k, tile_n = band_swizzle(tile % group_size, k_tiles, n_tiles, GROUP_K)

        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for seg in range(g, S, G):
            row_end = tl.load(offsets_ptr + seg).to(tl.int32)
            row_start = tl.load(offsets_ptr + seg - 1, mask=seg > 0, other=0).to(tl.int32)
            rows = row_end - row_start
            if USE_TMA and TMA_OK:
                _, x_desc, dy_desc = segment_descriptors(x_ptr, dy_ptr, offsets_ptr, seg, K, N, stride_xm,
                                                         stride_dym, BLOCK_M, BLOCK_K, BLOCK_N)
                for mt in range(0, tl.cdiv(rows, BLOCK_M)):
                    xt = x_desc.load([mt * BLOCK_M, tile_k * BLOCK_K]).T
                    dy = dy_desc.load([mt * BLOCK_M, tile_n * BLOCK_N])
                    acc = tl.dot(xt, dy, acc, input_precision=DOT_PRECISION)
            else:
                # Masks along the contiguous dimension only where K or N is ragged: a clamped index
                # (tl.where) would hide the contiguity and turn 16-byte loads into 2-byte ones (seen
                # in the SASS: LDG.E.U16, no cp.async pipelining).
                offs_kt = tile_k * BLOCK_K + offs_k
                offs_nt = tile_n * BLOCK_N + offs_n
                x_ptrs = x_ptr + tl.cast(row_start, tl.int64) * stride_xm + offs_m[None, :] * stride_xm + offs_kt[:, None]
                dy_ptrs = dy_ptr + tl.cast(row_start, tl.int64) * stride_dym + offs_m[:, None] * stride_dym + offs_nt[None, :]
                for mt in range(0, tl.cdiv(rows, BLOCK_M)):
                    row_ok = offs_m < rows - mt * BLOCK_M
                    x_mask = row_ok[None, :]
                    dy_mask = row_ok[:, None]
                    if not EVEN_K:
                        x_mask = x_mask & (offs_kt < K)[:, None]
                    if not EVEN_N:
                        dy_mask = dy_mask & (offs_nt < N)[None, :]
                    xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
                    dy = tl.load(dy_ptrs, mask=dy_mask, other=0.0)
                    acc = tl.dot(xt, dy, acc, input_precision=DOT_PRECISION)
                    x_ptrs += BLOCK_M * stride_xm
                    dy_ptrs += BLOCK_M * stride_dym

        out = acc.to(dw_ptr.dtype.element_ty)
        if STORE_TMA and TMA_OK:
            dw_desc.store([g, tile_k * BLOCK_K, tile_n * BLOCK_N], out.reshape(1, BLOCK_K, BLOCK_N))
        else:
            # Addresses built after the main loop, so they are not live across it.
            offs_kt = tile_k * BLOCK_K + offs_k
            offs_nt = tile_n * BLOCK_N + offs_n
            dw_ptrs = dw_ptr + tl.cast(g, tl.int64) * stride_dwg + offs_kt[:, None] * stride_dwk + offs_nt[None, :]
            tl.store(dw_ptrs, out, mask=(offs_kt < K)[:, None] & (offs_nt < N)[None, :])


def hopper_wgrad_(x_MI: torch.Tensor, dy_MN: torch.Tensor, offsets_J: torch.Tensor, dw_LIN: torch.Tensor,
                  accumulate: bool = False) -> None:
    """Fill ``dw_LIN`` (16-bit, or fp32 and with ``accumulate`` added into) with one segment per
    group: ``grouped_mm_wgrad_gluon`` where ``wgrad_gluon_ok``, else ``grouped_mm_wgrad_tma``, for
    operands the latter takes (checked by the caller: 16-bit, TMA-addressable, J = L)."""
    if wgrad_gluon_ok(x_MI, dw_LIN):
        grouped_mm_wgrad_gluon(x_MI, dy_MN, offsets_J, dw_LIN, accumulate=accumulate)
    else:
        grouped_mm_wgrad_tma(x_MI, dy_MN, offsets_J, dw_LIN, accumulate=accumulate)


def grouped_mm_wgrad(x_MI: torch.Tensor, dy_MN: torch.Tensor, offsets_J: torch.Tensor,
                     num_groups: int | None = None) -> torch.Tensor:
    """``dw[l] = Σ_{s % L = l} x[rows of s]ᵀ @ dy[rows of s]``; groups with no rows give zeros.

    Args:
        x_MI: (M, I) bf16/fp16/fp32, row-major, rows sorted by group.
        dy_MN: (M, N) same dtype, row-major.
        offsets_J: (J,) int32/int64 cumulative end offsets of the row segments on x's device
            (rows at or past ``offsets[-1]`` are ignored).
        num_groups: L, the weight groups (default J); J must be a multiple of it.

    Returns:
        dw_LIN: (L, I, N) contiguous, x's dtype, accumulated in fp32.
    """
    if x_MI.dim() != 2 or dy_MN.dim() != 2 or x_MI.shape[0] != dy_MN.shape[0]:
        raise ValueError(f"x_MI (M, I) and dy_MN (M, N) must share M, got {tuple(x_MI.shape)} and "
                         f"{tuple(dy_MN.shape)}")
    if x_MI.dtype != dy_MN.dtype or x_MI.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x_MI and dy_MN must share a bf16/fp16/fp32 dtype, got {x_MI.dtype}, {dy_MN.dtype}")
    if x_MI.stride(1) != 1 or dy_MN.stride(1) != 1:
        raise ValueError(f"x_MI and dy_MN must be row-major, got strides {x_MI.stride()}, {dy_MN.stride()}")
    if offsets_J.dim() != 1 or offsets_J.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets_J must be a 1-D int32/int64 tensor, got {offsets_J.dtype} {tuple(offsets_J.shape)}")
    if not (x_MI.device == dy_MN.device == offsets_J.device):
        raise ValueError(f"x_MI, dy_MN, offsets_J on different devices: {x_MI.device}, {dy_MN.device}, "
                         f"{offsets_J.device}")
    I, N, J = x_MI.shape[1], dy_MN.shape[1], offsets_J.shape[0]
    L = J if num_groups is None else num_groups
    check_segments(offsets_J, L)
    dw = x_MI.new_empty(L, I, N)
    if dw.numel() == 0:
        return dw
    tma = tma_ok(x_MI, dy_MN, dw)
    if tma and J == L and x_MI.dtype != torch.float32:
        hopper_wgrad_(x_MI, dy_MN, offsets_J, dw)
        return dw
    if tma:
        use_tensor_descriptors()
    num_sms = sm_count(x_MI.device)

    def grid(meta):
        tiles = L * cdiv(I, meta["BLOCK_K"]) * cdiv(N, meta["BLOCK_N"])
        return (min(tiles, num_sms) if meta["PERSISTENT"] else tiles,)

    grouped_mm_wgrad_kernel[grid](
        x_MI, dy_MN, offsets_J, dw,
        N, I, J, L,
        x_MI.stride(0), dy_MN.stride(0),
        dw.stride(0), dw.stride(1),
        DOT_PRECISION="ieee" if x_MI.dtype == torch.float32 else "tf32", TMA_OK=tma,
    )
    return dw
