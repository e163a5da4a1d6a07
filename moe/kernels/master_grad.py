"""A weight gradient added into its fp32 master gradient in one pass, or in the wgrad kernel.

Mixed-precision training keeps the experts' weights in fp32 and runs their GEMMs on a 16-bit
copy, so each micro-batch's weight gradient comes out of the wgrad kernel in 16 bits. Through
``w.to(bf16)`` autograd then spends two passes over it: ``ToCopyBackward`` (16-bit → a new fp32
tensor: 2 + 4 bytes a parameter) and ``AccumulateGrad`` (``grad += new``: 4 + 4 + 4), where one
pass reads 2 + 4 and writes 4 (the step's first micro-batch: reads 2, writes 4). The sum is the
same fp32 addition, so the gradient is bit-identical. Profiled on an H100 (OLMoE-shaped model at
6 layers, 2.4B expert parameters): autograd's two passes took about 8 ms each a micro-batch
(PyTorch's mixed-dtype copy ran at about 1.8 TB/s), this pass 8 ms with accumulation and 3.3 ms
on a step's first micro-batch; with the cast kept for the whole step (``moe.master_weight_step``)
a 16-micro-batch step ran 1.136x faster (bench/results/master_weights.md, its first run).

One pass fewer: the SwiGLU MLP's backward (``GroupedSwiGLUMLPFn``) sees that its weights are
such casts (:func:`tag_master_copy`) and calls :func:`accumulate_wgrad_`, whose Hopper kernel
adds its fp32 tile into ``.grad`` in the epilogue: 4 + 4 bytes a parameter instead of the
16-bit ``dw`` written (2), then read with ``.grad`` (2 + 4) and ``.grad`` written (4). Only
with one row segment per expert (J = L: every dispatcher's layout, expert-parallel ones
included); J = G·L segments keep the two-pass add, so there the weight gradient is rounded to
16 bits first. Measured on an H100 against the two-pass add (bench/results/master_weights.md):
1.026x at one micro-batch a step, 1.004x at 16 (within the run's round-to-round spread).
"""

from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from kernel_floor import INTERPRET, cdiv, tma_ok
from moe.kernels.grouped_mm_wgrad import grouped_mm_wgrad, hopper_wgrad_

_BLOCK = 128 if INTERPRET else 4096


@triton.jit
def _accumulate_kernel(dst_ptr, src_ptr, n, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
    if not FIRST:
        value = tl.load(dst_ptr + offs, mask=mask) + value
    tl.store(dst_ptr + offs, value, mask=mask)


def accumulate_master_grad_(master: torch.Tensor, grad: torch.Tensor) -> None:
    """``master.grad += grad`` in fp32; ``master.grad = grad`` as fp32 when it is None.

    Args:
        master: an fp32 leaf tensor (the weight autograd would accumulate into).
        grad: its gradient in any floating dtype, master's shape.
    """
    if grad.shape != master.shape:
        raise ValueError(f"grad of shape {tuple(grad.shape)} for a master weight of shape {tuple(master.shape)}")
    if not ((grad.is_cuda or INTERPRET) and _fp32_grad_ok(master, grad.device)):
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)
        return
    grad = grad.contiguous()
    with _fp32_grad(master) as (dst, first):
        n = grad.numel()
        if n:
            _accumulate_kernel[(cdiv(n, _BLOCK),)](dst, grad, n, FIRST=first, BLOCK=_BLOCK, num_warps=8)


def accumulate_wgrad_(master: torch.Tensor, x_MI: torch.Tensor, dy_MN: torch.Tensor, offsets_J: torch.Tensor) -> None:
    """``master.grad += dw`` with ``dw[l] = x[rows of l]ᵀ @ dy[rows of l]`` (``grouped_mm_wgrad``
    with one segment per group), in fp32.

    Where the Hopper wgrad kernels run (16-bit rows, tensor descriptors, J = L, an fp32
    row-major master and gradient; the Gluon one where ``wgrad_gluon_ok``) their epilogue adds
    the fp32 sums into ``.grad`` (writes them
    when ``.grad`` is None): no 16-bit ``dw`` is written and read again, and the sums are not
    rounded to 16 bits on the way (so the result is closer to the fp32 truth than
    ``accumulate_master_grad_(master, grouped_mm_wgrad(...))``, not bit-equal to it). Elsewhere
    it is that two-pass form.

    Args:
        master: fp32 (L, I, N) leaf tensor. x_MI, dy_MN, offsets_J: as ``grouped_mm_wgrad``
            (J a multiple of L; J = G·L segments take the two-pass form).
    """
    L, I, N = master.shape
    if (x_MI.shape[1], dy_MN.shape[1]) != (I, N) or offsets_J.shape[0] % L:
        raise ValueError(f"rows (M, {x_MI.shape[1]}) x (M, {dy_MN.shape[1]}) in {offsets_J.shape[0]} segments do not "
                         f"make the gradient of a master weight of shape {tuple(master.shape)}")
    old = master.grad
    fused = (offsets_J.shape[0] == L and x_MI.shape[0] > 0 and _fp32_grad_ok(master, x_MI.device)
             and x_MI.dtype in (torch.float16, torch.bfloat16) and x_MI.dtype == dy_MN.dtype
             and x_MI.stride(1) == 1 and dy_MN.stride(1) == 1
             and tma_ok(x_MI, dy_MN, *([] if old is None else [old])))
    if not fused:
        accumulate_master_grad_(master, grouped_mm_wgrad(x_MI, dy_MN, offsets_J, L))
        return
    with _fp32_grad(master) as (dst, first):
        hopper_wgrad_(x_MI, dy_MN, offsets_J, dst, accumulate=not first)


def _fp32_grad_ok(master: torch.Tensor, device: torch.device) -> bool:
    """Whether ``master.grad`` can be written in place as an fp32 row-major tensor on ``device``:
    an fp32 master whose ``.grad`` is None or already such a tensor."""
    old = master.grad
    return master.dtype == torch.float32 and (
        old is None or (old.dtype == torch.float32 and old.is_contiguous() and old.device == device))


@contextmanager
def _fp32_grad(master: torch.Tensor):
    """``(dst, first)``: ``master.grad`` to add into, or (``first``) a new row-major fp32 tensor
    to write, which becomes ``master.grad`` when the block ends (checked by :func:`_fp32_grad_ok`)."""
    first = master.grad is None
    dst = torch.empty_like(master, memory_format=torch.contiguous_format) if first else master.grad
    yield dst, first
    if first:
        master.grad = dst


def tag_master_copy(copy: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Mark ``copy`` (a 16-bit cast of the fp32 ``master`` whose autograd node adds into
    ``master.grad``) so that a matmul's backward may add its weight gradient into ``master.grad``
    itself (:func:`accumulate_wgrad_`) and hand the copy no gradient. Returns ``copy``."""
    copy._fp32_master = master
    return copy


def master_of(copy: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master of a :func:`tag_master_copy` tensor, else None."""
    return getattr(copy, "_fp32_master", None)
