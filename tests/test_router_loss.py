"""The router losses' kernels (moe/kernels/router_loss.py) against the PyTorch formulas in fp64.

On CPU the kernels run under the interpreter (token blocks of 64, so the lse walk loops); on a
GPU the same tests run compiled, plus the count given on the host beside device tensors (the
one-process dispatcher's).
"""

import pytest
import torch

from moe.kernels.router_loss import router_losses, router_losses_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, inputs, use, coefs):
    routed, prob, n, lse, ent = inputs
    prob, lse = prob.detach().clone().requires_grad_(), lse.detach().clone().requires_grad_()
    lb, z, loss, mean_ent = fn(routed, prob, n, lse, ent, 8, *coefs)
    weights = {"lb": (lb, 1.3), "z": (z, -0.7), "loss": (loss, 2.0)}
    total = sum(v * w for k, (v, w) in weights.items() if k in use)
    d_prob, d_lse = torch.autograd.grad(total, (prob, lse), allow_unused=True)
    return (lb, z, loss, mean_ent), d_prob, d_lse


def _inputs(T, E, n_value, n_device=DEVICE):
    routed = torch.randint(0, 50, (E,), device=DEVICE)
    prob = torch.rand(E, device=DEVICE) * T / E
    return routed, prob, torch.tensor(float(n_value), device=n_device), 3 * torch.randn(T, device=DEVICE), \
        torch.rand(T, device=DEVICE)


def _check(inputs, use, coefs=(0.01, 0.001), backend="triton"):
    out, d_prob, d_lse = _run(lambda *a: router_losses(*a, backend=backend), inputs, use, coefs)
    r, p, n, lse, ent = inputs
    fp64 = (r, p.double(), n.double(), lse.double(), ent.double())
    ref, r_prob, r_lse = _run(router_losses_reference, fp64, use, coefs)
    for name, a, b in zip(("lb", "z", "loss", "entropy"), out, ref):
        assert a.shape == () and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double().cpu(), b.cpu(), rtol=1e-5, atol=1e-7, msg=name)
    for a, b, like in ((d_prob, r_prob, p), (d_lse, r_lse, lse)):  # None (unused) as zeros
        a = torch.zeros_like(like) if a is None else a
        b = torch.zeros_like(like, dtype=torch.float64) if b is None else b
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-8)


# no tokens (means 0, N clamped to 1), one token, ragged lse blocks, E not a power of two
@pytest.mark.parametrize("T,E,n", [(0, 8, 0), (1, 1, 1), (37, 6, 37), (300, 64, 600), (129, 129, 1000)])
def test_matches_reference(T, E, n):
    inputs = _inputs(T, E, n)
    _check(inputs, {"lb", "z", "loss"})
    _check(inputs, {"loss"})  # training: only the weighted sum reaches the backward
    _check(inputs, {"lb"})
    _check(inputs, {"z"}, coefs=(0.0, 0.0))


def test_without_autograd():
    with torch.no_grad():
        out = router_losses(*_inputs(10, 4, 10), 8, 0.01, 0.001, backend="triton")
    assert all(v.grad_fn is None and torch.isfinite(v) for v in out)


@pytest.mark.gpu
def test_count_on_the_host_beside_device_tensors():
    _check(_inputs(500, 64, 500, n_device="cpu"), {"lb", "z", "loss"})
    _check(_inputs(500, 64, 0, n_device="cpu"), {"loss"})
