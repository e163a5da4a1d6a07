"""Grouped matmul over packed rows; the Triton kernels replace the reference on CUDA."""

from moe.kernels.reference import apply_activation, grouped_mm_reference

grouped_mm = grouped_mm_reference


def row_tile_size(K: int, N: int, dtype) -> int:
    """Row tile (BLOCK_M) of the grouped GEMM for these shapes; 128 until the Triton kernel lands."""
    return 128

__all__ = ["apply_activation", "grouped_mm", "grouped_mm_reference", "row_tile_size"]
