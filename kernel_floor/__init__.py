"""The kernel floor: what the Triton kernels of ``moe/kernels``, ``parallel`` and ``attention``
share, written once (launch-time runtime facts, the gather-sum kernel family). The three import
it by these public names."""

from kernel_floor.gather_sum import gather_sum, gather_sum_reference, scatter_rows, scatter_rows_reference
from kernel_floor.runtime import (
    AUTOTUNE, BACKENDS, GLUON_DTYPES, INTERPRET, ROW_BLOCK_D, ROW_BLOCK_T, SCALAR, TL_DTYPES, aligned16,
    band_swizzle, cached_launch, capability, cdiv, check_pair_weights, check_rows, check_segments,
    fixed_config, gluon_layout, grid_programs, next_power_of_2, partition_args, sm_count, tl_dtype,
    tma_ok, use_reference, use_tensor_descriptors,
)

__all__ = [
    "AUTOTUNE", "BACKENDS", "GLUON_DTYPES", "INTERPRET", "ROW_BLOCK_D", "ROW_BLOCK_T", "SCALAR", "TL_DTYPES",
    "aligned16", "band_swizzle", "cached_launch", "capability", "cdiv", "check_pair_weights",
    "check_rows", "check_segments", "fixed_config", "gather_sum", "gather_sum_reference",
    "gluon_layout", "grid_programs", "next_power_of_2", "partition_args", "scatter_rows",
    "scatter_rows_reference", "sm_count", "tl_dtype", "tma_ok", "use_reference",
    "use_tensor_descriptors",
]
