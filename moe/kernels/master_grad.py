"""A 16-bit weight gradient added into its fp32 master gradient in one pass.

Mixed-precision training keeps the experts' weights in fp32 and runs their GEMMs on a 16-bit
copy, so each micro-batch's weight gradient comes out of the wgrad kernel in 16 bits. Through
``w.to(bf16)`` autograd then spends two passes over it: ``ToCopyBackward`` (16-bit → a new fp32
tensor: 2 + 4 bytes a parameter) and ``AccumulateGrad`` (``grad += new``: 4 + 4 + 4), where one
pass reads 2 + 4 and writes 4 (the step's first micro-batch: reads 2, writes 4). The sum is the
same fp32 addition, so the gradient is bit-identical. Profiled on an H100 (OLMoE-shaped model at
6 layers, 2.4B expert parameters): autograd's two passes took about 8 ms each a micro-batch
(PyTorch's mixed-dtype copy ran at about 1.8 TB/s), this pass 8 ms with accumulation and 3.3 ms
on a step's first micro-batch; with the cast kept for the whole step (``moe.master_weight_step``)
a 16-micro-batch step ran 1.136x faster (bench/results/master_weights.md).
"""

import torch
import triton
import triton.language as tl

from kernel_floor import INTERPRET

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
    old = master.grad
    usable = old is None or (old.dtype == torch.float32 and old.is_contiguous() and old.device == grad.device)
    if not (grad.is_cuda or INTERPRET) or not usable or master.dtype != torch.float32:
        if old is None:
            master.grad = grad.to(master.dtype)
        else:
            old.add_(grad)
        return
    grad = grad.contiguous()
    dst = torch.empty_like(master, memory_format=torch.contiguous_format) if old is None else old
    n = grad.numel()
    if n:
        _accumulate_kernel[(triton.cdiv(n, _BLOCK),)](dst, grad, n, FIRST=old is None, BLOCK=_BLOCK, num_warps=8)
    if old is None:
        master.grad = dst
