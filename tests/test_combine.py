"""Fused un-permute + weighted sum of the combine against its PyTorch reference.

On CPU the Triton kernels run through the interpreter (fp32/fp16, small sizes); on a GPU the
same checks run compiled in bf16. Every check uses fresh random inputs, rows in a random order,
and pairs that have no row (dropped), and compares the output and both gradients.
"""

import pytest
import torch

from moe.kernels.combine import weighted_combine, weighted_combine_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(T, K, D, num_rows, dtype, device=DEVICE, out_dtype=None):
    gen = torch.Generator().manual_seed(T * 1000 + K * 10 + D)
    pair_R = torch.randperm(T * K, generator=gen)[:num_rows].to(device)
    y = torch.randn(num_rows, D, generator=gen).to(device, dtype).requires_grad_()
    w = torch.rand(T, K, generator=gen).to(device).requires_grad_()
    dout = torch.randn(T, D, generator=gen).to(device, out_dtype or dtype)

    y_ref = y.detach().double().requires_grad_()
    w_ref = w.detach().double().requires_grad_()
    out_ref = weighted_combine_reference(y_ref, pair_R, w_ref.float(), torch.float64)
    out = weighted_combine(y, pair_R, w, out_dtype=out_dtype, backend="triton")
    assert out.shape == (T, D) and out.dtype == (out_dtype or dtype)
    if T == 0:
        return
    out.backward(dout)
    out_ref.backward(dout.double())
    tol = TOLERANCE[dtype]
    assert _rel_err(out, out_ref) < tol
    if num_rows:
        assert _rel_err(y.grad, y_ref.grad) < tol
    # pairs without a row get exactly zero weight gradient
    has_row = torch.zeros(T * K, dtype=torch.bool, device=device)
    has_row[pair_R] = True
    assert (w.grad.view(-1)[~has_row] == 0).all()
    if num_rows:
        assert _rel_err(w.grad.view(-1)[has_row], w_ref.grad.view(-1)[has_row]) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,K,D,num_rows", [
    (13, 2, 70, 26),    # every pair has a row, D not a multiple of the block
    (13, 4, 130, 37),   # 15 pairs dropped, D spans three blocks
    (9, 1, 64, 9),      # top-1
    (5, 3, 33, 0),      # nothing came back: zeros, zero gradients
    (0, 2, 16, 0),      # no tokens
])
def test_interpreter_matches_reference(T, K, D, num_rows, dtype):
    _check(T, K, D, num_rows, dtype)


def test_out_dtype_is_respected():
    _check(7, 2, 40, 11, torch.float16, out_dtype=torch.float32)


def test_rejects_bad_arguments():
    y = torch.randn(4, 8)
    w = torch.rand(3, 2)
    pair = torch.tensor([0, 2, 3, 5])
    with pytest.raises(ValueError, match="pair_R"):
        weighted_combine(y, pair[:3], w)
    with pytest.raises(ValueError, match="pair_R"):
        weighted_combine(y, pair.int(), w)
    with pytest.raises(ValueError, match="w_TK"):
        weighted_combine(y, pair, w.double())
    with pytest.raises(ValueError, match="pairs"):
        weighted_combine(torch.randn(7, 8), torch.arange(7), w)
    with pytest.raises(ValueError, match="backend"):
        weighted_combine(y, pair, w, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,D,num_rows", [(1000, 8, 2048, 7001), (4097, 2, 4096, 8194), (3, 2, 100, 1)])
def test_gpu_bf16_matches_reference(T, K, D, num_rows):
    _check(T, K, D, num_rows, torch.bfloat16)
