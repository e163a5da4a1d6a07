"""Grouped matmul over packed rows: Triton kernels on CUDA, the PyTorch reference elsewhere."""

from moe.kernels.grouped_mm import grouped_mlp, grouped_mm, grouped_mm_triton
from moe.kernels.grouped_mm_fwd import DEFAULT_BLOCK_M, row_tile_size
from moe.kernels.reference import apply_activation, grouped_mm_reference

__all__ = [
    "DEFAULT_BLOCK_M",
    "apply_activation",
    "grouped_mlp",
    "grouped_mm",
    "grouped_mm_reference",
    "grouped_mm_triton",
    "row_tile_size",
]
