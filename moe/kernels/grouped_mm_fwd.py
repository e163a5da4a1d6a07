"""Persistent Triton grouped matmul over packed rows: the forward pass and the input gradient.

``out[rows of s] = act(a[rows of s] @ b[s % L])`` where the rows of ``a`` come in J segments,
segment s holding rows ``offsets[s-1]:offsets[s]``, and J is a multiple of the L weight groups.
With J = L a segment is a group (the dispatchers' layout); with J = G·L (G source ranks) rows
in a (source rank, local expert) order need no regrouping by expert. One segment per group runs
faster: each segment's end leaves a partial tile (bench/results/expert_layout.md). The same kernel computes the forward
(``a = x_MI``, ``b[l] = w[l]``, ``(I, N)``) and dgrad (``a = dy_MN``, ``b[l] = w[l]ᵀ``, read
through swapped strides, no copy).

Legend: M packed rows, I reduction width, N output width, L weight groups, J row segments (a
multiple of L), F = N/2 for SwiGLU. The kernel's own parameters keep the matmul names: ``K`` is
I, ``S`` is J, ``G`` is L.

Three kernels. Hopper with 16-byte aligned rows (I and N multiples of 8 in bf16) and b with a
unit stride: ``moe.kernels.grouped_mm_tma`` (whole-tensor tensor descriptors, flattened
persistent tile loop), or on sm_90 without an activation ``moe.kernels.grouped_mm_gluon`` (the
same tiles and bits, warp-specialized with an asynchronous store; ``gluon_ok``). Otherwise the
pointer-load kernel below.

Scheduling of the pointer-load kernel: ``grid = #SMs`` programs; each walks the work list ``(group, m-tile, n-tile)`` with
a stride of the grid size. The list is never materialised: every program scans the J segment
offsets on the device, counting tiles per group, so the launch path reads no group size on the
host (no host sync). After the J segments comes one more pseudo-group, the rows
``offsets[-1]:M``, whose tiles store zeros: padding rows are zero in the output without a host
read of ``offsets[-1]``. Within a group the tiles are swizzled in bands of ``GROUP_M`` m-tiles
so that a wave of programs shares a few rows of ``a`` and a few column strips of ``b[g]`` in L2.

Loads: plain pointer loads with rows clamped into the group, pipelined with cp.async; masked
pointer stores.

Activations. ``"gelu"``: fused into the epilogue (fp32, on the accumulator); with
``save_preact`` the pre-activation ``z`` is stored too. ``"swiglu"``: the GEMM writes
``z = [gate | up]`` (M, 2F) and one fused elementwise Triton pass (``moe.kernels.activation``)
makes ``silu(gate) * up``; ``z`` is what the backward needs anyway. Why not the epilogue:
measured on an H100 (bf16, bench/grouped_gemm.py), an epilogue version with two
accumulators (gate and up tiles of one output tile) had to run on pointer loads (its
tensor-descriptor build died with "illegal instruction", triton 3.6) and its forward was
0.65-0.99x the speed of a TMA GEMM followed by PyTorch's silu·mul on all four bench shapes.
The backward's counterpart was measured too and not kept: SwiGLU's backward in the epilogue of
the dgrad kernel that makes dh (the TMA kernel, a quarter of the tile at a time: read gate and
up, write dz and h; bit-identical) made that kernel 0.50 ms slower in the OLMoE-shaped layer's
fwd+bwd (4.71 -> 5.22 ms: the epilogue's 1.3 GB of traffic stalls the tensor cores) while the
0.56 ms elementwise pass went, so the layer's kernels went 9.92 -> 9.86 ms and bench/moe_layer.py
read the same 441 TFLOP/s (H100, 2026-11-24).
The forward epilogue again, on the TMA kernel (H100, 2026-11-24, OLMoE / Qwen3-A3B shapes at T 16k
top-8, 5 alternating rounds; z and h bit-identical to the two passes): gate and up as two
accumulators fed by two TMA boxes ran 0.86x / 0.86x the GEMM plus the pass; one accumulator fed by
a 5-D descriptor whose box is [gate block | up block] 0.71x / 0.71x. A Gluon probe whose two
consumer warpgroups take turns at the mainloop (one's epilogue beside the other's matmuls, a
128x128 tile each) wrote z and h at 1.03-1.04x / 1.07-1.09x (two runs), but its plain GEMM ran 0.91-1.04x this
kernel's 128x256 cooperative tile; not kept yet.
"""

import torch
import triton
import triton.language as tl

from kernel_floor import AUTOTUNE, INTERPRET, band_swizzle, check_segments, fixed_config, sm_count, tma_ok
from moe.kernels.activation import ACTIVATIONS, gelu_tanh, swiglu_forward
from moe.kernels.grouped_mm_gluon import gluon_ok, grouped_mm_gluon
from moe.kernels.grouped_mm_tma import TILE_M, grouped_mm_tma

def _prune_configs(configs, named_args, **kwargs):
    if AUTOTUNE or INTERPRET:
        return configs
    tile = lambda kw: kw["BLOCK_M"] * kw["BLOCK_K"] + kw["BLOCK_K"] * kw["BLOCK_N"]  # noqa: E731
    return fixed_config(configs, tile, named_args["a_ptr"].element_size())

# Row tile reported before any launch / without autotune (the default config's BLOCK_M).
DEFAULT_BLOCK_M = 128

# Interpreter: one small config (autotune with several configs fails there) so that the
# K loop and the tile walk both iterate on test sizes <= 128.
_INTERPRET_CONFIG = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2})


def _configs():
    if INTERPRET:
        return [_INTERPRET_CONFIG]
    # 128x256 with 3 stages won every bench shape's forward and dgrad on an H100; 128x128
    # tiles, two persistent programs per SM and 64x64 tiles were tried and never won.
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=stages, num_warps=warps)
        for bm, bn, stages, warps in [(128, 256, 3, 8), (128, 256, 4, 8), (128, 128, 4, 8), (64, 128, 4, 4)]
    ]


@triton.jit
def _tile_dot(a_ptrs, b_ptrs, a_step, b_step, k_tiles, K, offs_k, acc,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += a_tile @ b_tile over the reduction dimension, K-masked only when K is ragged."""
    for kt in range(0, k_tiles):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


@triton.jit
def _tile_ptrs(base_ptr, stride_m, row_start, rows, N, tile_m, tile_n, offs_m, offs_n,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Addresses and mask of output tile (tile_m, tile_n) of a group of ``rows`` rows starting at
    ``row_start`` in a row-major (M, N) output with row stride ``stride_m``."""
    local_m = tile_m * BLOCK_M + offs_m
    cols = tile_n * BLOCK_N + offs_n
    base = base_ptr + tl.cast(row_start, tl.int64) * stride_m
    ptrs = base + local_m[:, None] * stride_m + cols[None, :]
    return ptrs, (local_m < rows)[:, None] & (cols < N)[None, :]


@triton.autotune(configs=_configs(), key=["N", "K", "ACT"], prune_configs_by={"early_config_prune": _prune_configs})
@triton.heuristics({
    "EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
    "EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0,
})
@triton.jit
def grouped_mm_kernel(
    a_ptr, b_ptr, offsets_ptr, y_ptr, z_ptr,
    M, N, K, S, G,
    stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_ym, stride_zm,
    ACT: tl.constexpr, SAVE_Z: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One persistent program, pointer loads. ACT: 0 none, 2 tanh-GELU."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    tile = pid
    tiles_before = 0
    row_start = 0
    for g in range(0, S + 1):
        if g < S:
            row_end = tl.load(offsets_ptr + g).to(tl.int32)
        else:
            row_end = M
        rows = row_end - row_start
        m_tiles = tl.cdiv(rows, BLOCK_M)
        group_tiles = m_tiles * n_tiles
        while tile < tiles_before + group_tiles:
            tile_m, tile_n = band_swizzle(tile - tiles_before, m_tiles, n_tiles, GROUP_M)

            if g == S:
                # Padding rows past offsets[-1]: zeros, nothing to multiply.
                y_ptrs, out_mask = _tile_ptrs(y_ptr, stride_ym, row_start, rows, N, tile_m, tile_n,
                                              offs_m, offs_n, BLOCK_M, BLOCK_N)
                tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty), mask=out_mask)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                # Rows past the group's end are clamped (not masked): they read valid rows,
                # their results are never stored, and the loads stay unmasked along M.
                a_rows = tl.minimum(tile_m * BLOCK_M + offs_m, rows - 1)
                b_cols = tile_n * BLOCK_N + offs_n
                if not EVEN_N:
                    b_cols = tl.where(b_cols < N, b_cols, 0)
                a_base = a_ptr + tl.cast(row_start, tl.int64) * stride_am
                a_ptrs = a_base + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
                b_base = b_ptr + tl.cast(g % G, tl.int64) * stride_bg
                b_ptrs = b_base + offs_k[:, None] * stride_bk + b_cols[None, :] * stride_bn
                acc = _tile_dot(a_ptrs, b_ptrs, BLOCK_K * stride_ak, BLOCK_K * stride_bk, k_tiles, K,
                                offs_k, acc, BLOCK_K, EVEN_K, DOT_PRECISION)
                # Store addresses are built after the main loop: built before it, 128x128 64-bit
                # pointers stayed live across it (255 registers and a stack frame in ptxas' report).
                y_ptrs, out_mask = _tile_ptrs(y_ptr, stride_ym, row_start, rows, N, tile_m, tile_n,
                                              offs_m, offs_n, BLOCK_M, BLOCK_N)
                if ACT == 2:
                    if SAVE_Z:
                        z_ptrs, _ = _tile_ptrs(z_ptr, stride_zm, row_start, rows, N, tile_m, tile_n,
                                               offs_m, offs_n, BLOCK_M, BLOCK_N)
                        tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=out_mask)
                    out = gelu_tanh(acc)
                else:
                    out = acc
                tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=out_mask)
            tile += num_programs
        tiles_before += group_tiles
        row_start = row_end


_ran_block_m: dict[tuple[int, int, torch.dtype], int] = {}


def row_tile_size(I: int, N: int, dtype: torch.dtype) -> int:
    """BLOCK_M the forward kernel ran with for a weight of shape (L, I, N) in ``dtype``.

    This is the autotuned choice once a forward with these shapes has run (for SwiGLU pass the
    weight's N = 2F), and ``DEFAULT_BLOCK_M`` (128) before that, on CPU, or with the reference.
    """
    return _ran_block_m.get((int(I), int(N), dtype), DEFAULT_BLOCK_M)


def _check_operands(a_MI: torch.Tensor, b_LIN: torch.Tensor, offsets_J: torch.Tensor) -> None:
    if a_MI.dim() != 2:
        raise ValueError(f"a_MI must be 2-D (M, I), got shape {tuple(a_MI.shape)}")
    if b_LIN.dim() != 3:
        raise ValueError(f"b_LIN must be 3-D (L, I, N), got shape {tuple(b_LIN.shape)}")
    if a_MI.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"a_MI dtype must be bf16, fp16 or fp32, got {a_MI.dtype}")
    if b_LIN.dtype != a_MI.dtype:
        raise ValueError(f"b_LIN dtype {b_LIN.dtype} differs from a_MI dtype {a_MI.dtype}")
    if a_MI.shape[1] != b_LIN.shape[1]:
        raise ValueError(f"a_MI has I={a_MI.shape[1]} but b_LIN has I={b_LIN.shape[1]}")
    check_segments(offsets_J, b_LIN.shape[0])
    if offsets_J.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets_J must be int32 or int64, got {offsets_J.dtype}")
    if not (a_MI.device == b_LIN.device == offsets_J.device):
        raise ValueError(f"a_MI, b_LIN, offsets_J on different devices: "
                         f"{a_MI.device}, {b_LIN.device}, {offsets_J.device}")
    if a_MI.stride(1) != 1:
        raise ValueError(f"a_MI must be row-major (stride(1) == 1), got strides {a_MI.stride()}")


def grouped_mm_forward(
    a_MI: torch.Tensor,
    b_LIN: torch.Tensor,
    offsets_J: torch.Tensor,
    activation: str | None = None,
    save_preact: bool = False,
    record_tile: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the persistent grouped matmul: ``y = act(a[rows of s] @ b[s % L])``.

    Args:
        a_MI: (M, I) bf16/fp16/fp32, row-major, rows sorted by group.
        b_LIN: (L, I, N) same dtype, any strides (dgrad passes ``w.transpose(1, 2)``).
        offsets_J: (J,) int32/int64 cumulative end offsets of the J row segments on a's
            device, non-decreasing, ``offsets[-1] <= M`` (not checked: that would need a host
            sync); J a multiple of L, segment s multiplies by ``b[s % L]``.
        activation: None, ``"swiglu"`` (N even, output N/2 = silu(gate) * up) or ``"gelu"``.
        save_preact: also return the pre-activation ``z`` (M, N) (None without activation).
        record_tile: remember the BLOCK_M the kernel ran with, for ``row_tile_size``.

    Returns:
        ``(y, z)``: y (M, N or N/2) in a's dtype, rows at or past ``offsets[-1]`` zero; z or None.
    """
    _check_operands(a_MI, b_LIN, offsets_J)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'swiglu' or 'gelu', got {activation!r}")
    M, I = a_MI.shape
    L, _, N = b_LIN.shape
    if activation == "swiglu":
        if N % 2:
            raise ValueError(f"swiglu needs an even N ([gate | up]), got N={N}")
        z, _ = grouped_mm_forward(a_MI, b_LIN, offsets_J, None, record_tile=record_tile)
        return swiglu_forward(z), (z if save_preact else None)
    y = a_MI.new_empty(M, N)
    save_z = save_preact and activation is not None
    z = a_MI.new_empty(M, N) if save_z else None
    if M == 0 or N == 0:
        return y, z
    b_trans = b_LIN.stride(2) != 1
    # b must have one unit stride for tensor descriptors: (L, I, N) row-major or its transpose.
    if (b_LIN.stride(1) == 1 if b_trans else True) and tma_ok(a_MI, b_LIN):
        if gluon_ok(a_MI, b_LIN, y, activation, save_z):
            grouped_mm_gluon(a_MI, b_LIN, offsets_J, y)
        else:
            grouped_mm_tma(a_MI, b_LIN, offsets_J, y, z, ACTIVATIONS[activation])
        block_m = TILE_M
    else:
        grouped_mm_kernel[(sm_count(a_MI.device),)](
            a_MI, b_LIN, offsets_J, y, z if save_z else y,
            M, N, I, offsets_J.shape[0], L,
            a_MI.stride(0), a_MI.stride(1),
            b_LIN.stride(0), b_LIN.stride(1), b_LIN.stride(2),
            y.stride(0), z.stride(0) if save_z else 0,
            ACT=ACTIVATIONS[activation], SAVE_Z=save_z,
            DOT_PRECISION="ieee" if a_MI.dtype == torch.float32 else "tf32",
        )
        block_m = grouped_mm_kernel.best_config.kwargs["BLOCK_M"]
    if record_tile:
        _ran_block_m[(I, N, a_MI.dtype)] = block_m
    return y, z
