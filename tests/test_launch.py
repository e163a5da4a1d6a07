"""kernel_floor.cached_launch: the JIT's binary reused without the JIT's per-call binding.

The reuse is only sound for a kernel whose binary depends on its constexprs alone. These tests
launch one such kernel first at "nice" arguments (a length that is a multiple of 16, aligned
pointers, a small int64: what Triton would specialize on or type as i32) and then at awkward
ones (odd lengths, pointers one element off alignment, a length of 1, an int64 past 2^31), each
against PyTorch, and count that only the first launch per constexpr set compiles; a kernel that
specializes is refused before it runs (on CPU too, in the interpreter).
"""

import pytest
import torch
import triton
import triton.language as tl

from kernel_floor import cached_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit(do_not_specialize=["N", "shift"], do_not_specialize_on_alignment=["X", "Y"])
def _axpy(X, Y, N, alpha, shift: tl.int64, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < N
    x = tl.load(X + offs, mask=keep)
    y = tl.load(Y + offs, mask=keep) + alpha * x + (shift % 7).to(tl.float32)
    tl.store(Y + offs, y, mask=keep)


@triton.jit
def _copy_specialized(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N), mask=offs < N)


@triton.jit(do_not_specialize_on_alignment=["X", "Y"])
def _copy_int_specialized(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N), mask=offs < N)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_cached_launch_matches_torch_at_awkward_arguments(dtype, monkeypatch):
    compiles = []
    run = _axpy.run
    monkeypatch.setattr(_axpy, "run", lambda *a, **kw: compiles.append(1) or run(*a, **kw))
    base_x = torch.randn(4099, device="cuda", dtype=dtype)
    base_y = torch.randn(4099, device="cuda", dtype=dtype)
    # (offset, length, shift): aligned, a multiple of 16 and a small shift first, so a binary
    # specialized on these would be the one reused for the rest.
    cases = ((0, 4096, 3), (1, 4095, 2**33 + 5), (3, 17, 11), (0, 1, 0), (1, 1000, 2**40 + 1))
    for offset, n, shift in cases:
        for block in (128, 1024):
            x, y = base_x[offset:offset + n], base_y[offset:offset + n].clone()
            want = y.float() + 0.5 * x.float() + shift % 7
            cached_launch(_axpy, (triton.cdiv(n, block),), dtype, x, y, n, 0.5, shift,
                          BLOCK=block)
            torch.testing.assert_close(y.float(), want, rtol=1e-3, atol=1e-2)
    assert len(compiles) == 2, f"{len(compiles)} JIT launches: one per BLOCK expected"


@pytest.mark.parametrize("kernel, name, lists", [
    (_copy_specialized, "X", "do_not_specialize_on_alignment"),
    (_copy_int_specialized, "N", "do_not_specialize"),
])
def test_cached_launch_refuses_a_specializing_kernel(kernel, name, lists):
    x = torch.randn(64, device=DEVICE)
    y = torch.zeros_like(x)
    with pytest.raises(ValueError, match=f"'{name}'; list it in {lists}$"):
        cached_launch(kernel, (1,), x.dtype, x, y, 64, BLOCK=64)
    assert not y.any(), "the refused kernel ran"
