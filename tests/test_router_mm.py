"""The router's 3xTF32 logits kernel (moe/kernels/router_mm.py) against fp64 PyTorch.

On CPU the kernel runs under the interpreter (sizes <= 128, several tiles and K slices each);
on a GPU the same tests run compiled, plus model-sized cases where TF32 alone would miss the
tolerance (that is what the 3x split is for).
"""

import pytest
import torch

from moe.kernels import router_mm
from moe.kernels.router_mm import router_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x_TD, w_ED, dlogits_TE):
    x64 = x_TD.detach().double().requires_grad_()
    w64 = w_ED.detach().double().requires_grad_()
    logits = x64 @ w64.t()
    dx, dw = torch.autograd.grad(logits, (x64, w64), dlogits_TE.double())
    return logits, dx, dw


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T,D,E", [(1, 16, 8), (37, 48, 7), (100, 64, 16), (128, 96, 33)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_matches_fp64(T, D, E, x_dtype):
    x = torch.randn(T, D, device=DEVICE).to(x_dtype).requires_grad_()
    w = (0.02 * torch.randn(E, D, device=DEVICE)).requires_grad_()
    dlogits = torch.randn(T, E, device=DEVICE)
    logits = router_logits(x, w, backend="triton")
    dx, dw = torch.autograd.grad(logits, (x, w), dlogits)
    ref, dx_ref, dw_ref = _reference(x, w, dlogits)
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    assert dx.dtype == x_dtype and dw.dtype == torch.float32
    assert _rel(logits, ref) < 1e-5
    # dx is stored in x's dtype: its rounding, not the product's, bounds the error
    assert _rel(dx, dx_ref) < (1e-5 if x_dtype == torch.float32 else 1e-3)
    assert _rel(dw, dw_ref) < 1e-5


def test_weight_grad_split_over_tokens_sums_in_order(monkeypatch):
    """dw's K (token) range cut into slices: the value of one slice; bit-identical on repeats
    (meaningful on a GPU, where a split summed with atomics would not be)."""
    x = torch.randn(300, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    dlogits = torch.randn(300, 8, device=DEVICE)
    monkeypatch.setattr(router_mm, "_weight_grad_splits", lambda *a: 3)
    dw3 = torch.autograd.grad(router_logits(x, w, backend="triton"), w, dlogits)[0]
    dw3_again = torch.autograd.grad(router_logits(x, w, backend="triton"), w, dlogits)[0]
    monkeypatch.setattr(router_mm, "_weight_grad_splits", lambda *a: 1)
    dw1 = torch.autograd.grad(router_logits(x, w, backend="triton"), w, dlogits)[0]
    assert torch.equal(dw3, dw3_again)
    assert _rel(dw3, _reference(x, w, dlogits)[2]) < 1e-5
    assert _rel(dw3, dw1) < 1e-5


def test_empty_tokens_and_reference_backend():
    w = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    logits = router_logits(x, w, backend="triton")
    assert logits.shape == (0, 4)
    dw = torch.autograd.grad(logits.sum(), w)[0]
    assert torch.equal(dw, torch.zeros_like(w))
    # the reference is F.linear in fp32 (fp64 inputs too), autocast or not
    x = torch.randn(5, 16, device=DEVICE, dtype=torch.bfloat16)
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        ref = router_logits(x, w, backend="reference")
    assert ref.dtype == torch.float32
    assert torch.equal(ref, x.float() @ w.detach().t())
    assert router_logits(x.double(), w.double()).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,D,E", [(16384, 2048, 64), (4099, 7168, 256), (1000, 2048, 128)])
def test_model_sized_beats_tf32(T, D, E, x_dtype):
    """At model sizes the kernel is fp32-accurate: logits and dw within 1e-5 of fp64, where plain
    TF32 is not; dx within its storage rounding (fp32 x: 1e-5 too, the 3x split)."""
    x = torch.randn(T, D, device="cuda", dtype=x_dtype, requires_grad=True)
    w = (0.02 * torch.randn(E, D, device="cuda")).requires_grad_()
    dlogits = torch.randn(T, E, device="cuda") / T
    logits = router_logits(x, w, backend="triton")
    dx, dw = torch.autograd.grad(logits, (x, w), dlogits)
    ref, dx_ref, dw_ref = _reference(x, w, dlogits)
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32 = x.float() @ w.detach().t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert _rel(logits, ref) < 1e-5 < _rel(tf32, ref)
    # dx is stored in x's dtype: at T = 16k, dlogits / T puts fp16 dx among the subnormals (below
    # 6.1e-5), where the kernel's error (1.76e-3 from fp64 on an H100) is exactly the rounding of
    # the exact dx to fp16; so the bound is twice that rounding, never looser than the dtype's
    storage = _rel(dx_ref.to(x_dtype), dx_ref)
    assert _rel(dx, dx_ref) < max({torch.bfloat16: 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}[x_dtype], 2 * storage)
    assert _rel(dw, dw_ref) < 1e-5


@pytest.mark.gpu
def test_auto_runs_the_kernel_for_16_bit_x_only(monkeypatch):
    calls = []
    monkeypatch.setattr(router_mm.RouterLogitsFn, "apply", lambda *a: calls.append(a[0].dtype) or a[0].new_zeros(1))
    w = torch.randn(4, 32, device="cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        router_logits(torch.randn(3, 32, device="cuda", dtype=dtype), w)
    assert calls == [torch.bfloat16, torch.float16]
