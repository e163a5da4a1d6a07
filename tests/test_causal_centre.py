"""The causal-centring scan kernels (moe/kernels/causal_centre.py) against fp64 PyTorch.

On CPU the kernels run under the interpreter (BLOCK_S 32, so sequences of more than 32 positions
carry a running sum between chunks); on a GPU the same tests run compiled, plus a model-sized
case, and the router's dispatch to the kernels is checked.
"""

import pytest
import torch

from moe.kernels.causal_centre import causal_centre_reference, causal_centre_triton
from moe.router import causal_centre

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp64(x_TE, seq_len, g_TE):
    x64 = x_TE.detach().double().requires_grad_()
    y64 = causal_centre_reference(x64, seq_len)
    (dx64,) = torch.autograd.grad(y64, x64, g_TE.double())
    return y64, dx64


# Sequences of one position, under one chunk, across chunk edges (31, 32, 33, 100), E below,
# at and above the expert block (16), and odd.
@pytest.mark.parametrize("B,S,E", [(1, 1, 4), (3, 1, 16), (2, 5, 7), (1, 31, 16), (2, 32, 17),
                                   (3, 33, 5), (2, 100, 33), (1, 128, 64)])
def test_matches_fp64(B, S, E):
    x = (3.0 * torch.randn(B * S, E, device=DEVICE) + 5.0).requires_grad_()  # a large common part
    g = torch.randn(B * S, E, device=DEVICE)
    y = causal_centre_triton(x, S)
    (dx,) = torch.autograd.grad(y, x, g)
    y64, dx64 = _fp64(x, S, g)
    assert y.dtype == torch.float32 and y.shape == (B * S, E)
    torch.testing.assert_close(y.double(), y64, rtol=0, atol=1e-5 * (1 + y64.abs().max().item()))
    torch.testing.assert_close(dx.double(), dx64, rtol=0, atol=1e-5 * (1 + dx64.abs().max().item()))


def test_first_position_unchanged_and_sequences_independent():
    B, S, E = 3, 40, 8
    x = torch.randn(B * S, E, device=DEVICE)
    y = causal_centre_triton(x, S)
    assert torch.equal(y.view(B, S, E)[:, 0], x.view(B, S, E)[:, 0])
    x2 = x.clone()
    x2.view(B, S, E)[1] += 100.0  # another sequence's values must not leak into the others
    y2 = causal_centre_triton(x2, S)
    assert torch.equal(y2.view(B, S, E)[0], y.view(B, S, E)[0])
    assert torch.equal(y2.view(B, S, E)[2], y.view(B, S, E)[2])


def test_non_contiguous_gradient():
    B, S, E = 2, 50, 6
    x = torch.randn(B * S, E, device=DEVICE, requires_grad=True)
    g = torch.randn(E, B * S, device=DEVICE).t()  # a transposed view reaches the backward
    (dx,) = torch.autograd.grad(causal_centre_triton(x, S), x, g)
    _, dx64 = _fp64(x, S, g)
    torch.testing.assert_close(dx.double(), dx64, rtol=0, atol=1e-5)


def test_errors_name_the_argument():
    x = torch.randn(10, 4, device=DEVICE)
    with pytest.raises(ValueError, match="seq_len=3 must divide"):
        causal_centre_triton(x, 3)
    with pytest.raises(ValueError, match="2-D fp32"):
        causal_centre_triton(x.double(), 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B,S,E", [(3, 129, 64), (2, 300, 17)])
def test_gpu_partial_chunk_after_a_carry(B, S, E):
    """Compiled chunks are 128 positions: a carried sum, then a partial last chunk."""
    test_matches_fp64(B, S, E)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_model_sized_and_router_dispatch(monkeypatch):
    """olmoe_bench's micro-batch (8 sequences of 2048, 64 experts): the kernels within fp32
    accumulation error of fp64, and the router's ``causal_centre`` runs them on CUDA."""
    S, E = 2048, 64
    x = (torch.randn(8 * S, E, device="cuda") + 2.0).requires_grad_()
    g = torch.randn(8 * S, E, device="cuda")
    y = causal_centre_triton(x, S)
    (dx,) = torch.autograd.grad(y, x, g)
    y64, dx64 = _fp64(x, S, g)
    assert (y.double() - y64).abs().max().item() < 1e-5
    assert (dx.double() - dx64).abs().max().item() < 1e-4
    calls = []
    import moe.router as router
    monkeypatch.setattr(router, "causal_centre_triton", lambda *a: calls.append(a) or y)
    causal_centre(x, S)
    assert len(calls) == 1
