"""Launch-time facts shared by the Triton kernels: interpreter mode, autotuning switch, SM
count, tensor-descriptor eligibility and scratch, the config fallback without autotuning."""

import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# MOE_AUTOTUNE=0: each grouped-GEMM kernel runs the first config of its list (the one that won
# most bench shapes) whose pipelined tiles fit in shared memory for the operands' dtype.
# Autotuning compiles and times every config for every new (N, K, dtype): on a fresh 2×H200
# machine the NCCL equivalence test ran past 100 s with it and took 14.5 s without (2026-11-22).
AUTOTUNE = os.environ.get("MOE_AUTOTUNE", "1") != "0"
# Hopper's shared memory per block, less 16 KB for the epilogue and barriers.
_SMEM_BUDGET = 232448 - 16384


def fixed_config(configs, tile_elems, elem_bytes: int):
    """MOE_AUTOTUNE=0: the first config whose ``num_stages · tile_elems(kwargs)`` elements of
    ``elem_bytes`` fit in shared memory (fp32 operands need smaller tiles than bf16)."""
    for c in configs:
        if c.num_stages * tile_elems(c.kwargs) * elem_bytes <= _SMEM_BUDGET:
            return [c]
    return configs[-1:]

BACKENDS = ("auto", "triton", "reference")


def use_reference(backend: str, auto_reference: bool) -> bool:
    """Whether a kernel's wrapper runs its PyTorch reference: ``backend`` is one of
    :data:`BACKENDS` ("auto" picks the reference when ``auto_reference``, e.g. off CUDA)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend == "reference" or (backend == "auto" and auto_reference)


_num_sms: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached); 3 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 3  # interpreter: a few programs, so that each one walks several tiles
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms[index]


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the tensor descriptors the kernels build on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors: Hopper or newer (or the interpreter), 16-byte aligned base and
    non-unit strides (the unit stride is checked by the caller)."""
    first = tensors[0]
    if first.is_cuda:
        if torch.cuda.get_device_capability(first.device)[0] < 9:
            return False
    elif not INTERPRET:
        return False
    for t in tensors:
        if t.data_ptr() % 16 or any((st * t.element_size()) % 16 for st in t.stride() if st != 1):
            return False
    return True


def use_tensor_descriptors() -> None:
    """Install the descriptor scratch allocator; the allocator is a context variable, so this
    runs before every launch (autograd's backward runs in another thread)."""
    triton.set_allocator(_scratch)
