"""kernel_floor.cached_launch: the JIT's binary reused without the JIT's per-call binding.

The reuse is only sound for a kernel whose binary depends on its constexprs alone. These tests
launch one such kernel first at "nice" arguments (a length that is a multiple of 16, aligned
pointers: what Triton would specialize on) and then at awkward ones (odd lengths, pointers
2 bytes off alignment, a length of 1), each against PyTorch; a kernel that specializes is
refused before it runs.
"""

import pytest
import torch
import triton
import triton.language as tl

from kernel_floor import cached_launch


@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["X", "Y"])
def _axpy(X, Y, N, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < N
    x = tl.load(X + offs, mask=keep)
    tl.store(Y + offs, tl.load(Y + offs, mask=keep) + alpha * x, mask=keep)


@triton.jit
def _axpy_specialized(X, Y, N, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * alpha, mask=offs < N)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_cached_launch_matches_torch_at_awkward_arguments(dtype):
    base_x = torch.randn(4099, device="cuda", dtype=dtype)
    base_y = torch.randn(4099, device="cuda", dtype=dtype)
    # (offset, length): aligned and a multiple of 16 first, so a binary specialized on these
    # would be the one reused for the rest.
    for offset, n in ((0, 4096), (1, 4095), (3, 17), (0, 1), (1, 1000)):
        for block in (128, 1024):
            x, y = base_x[offset:offset + n], base_y[offset:offset + n].clone()
            want = y.float() + 0.5 * x.float()
            cached_launch(_axpy, (triton.cdiv(n, block),), dtype, x, y, n, 0.5, BLOCK=block)
            torch.testing.assert_close(y.float(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_cached_launch_refuses_a_specializing_kernel():
    x = torch.randn(64, device="cuda")
    y = torch.zeros_like(x)
    with pytest.raises(ValueError, match="'X'.*do_not_specialize_on_alignment"):
        cached_launch(_axpy_specialized, (1,), x.dtype, x, y, 64, 1.0, BLOCK=64)
    assert not y.any(), "the refused kernel ran"
