"""The experts' fp32 master weights under a 16-bit autocast: one cast per optimizer step and the
weight gradients added into ``.grad`` in one pass (``moe.master_weight_step``), against the
plain ``w.to(dtype)`` path, bit for bit."""

import pytest
import torch

from moe import GroupedExperts, master_weight_step
from moe.kernels.master_grad import accumulate_master_grad_

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 127, 129, 1000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_accumulate_is_the_fp32_sum(device, n, dtype):
    master = torch.zeros(n, device=device, requires_grad=True)
    parts = [torch.randn(n, device=device).to(dtype) for _ in range(3)]
    expected = parts[0].float()
    accumulate_master_grad_(master, parts[0])
    assert torch.equal(master.grad, expected)
    for p in parts[1:]:
        expected = expected + p.float()
        accumulate_master_grad_(master, p)
    assert torch.equal(master.grad, expected)


def test_accumulate_rejects_a_wrong_shape():
    master = torch.zeros(4, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"grad of shape \(3, 4\)"):
        accumulate_master_grad_(master, torch.zeros(3, 4))


def _step(experts, xs, offsets, device, dtype, fused):
    """Forward and backward of each micro-batch under autocast; the cast copies seen per micro-batch."""
    experts.zero_grad(set_to_none=True)
    copies = []
    ctx = master_weight_step(experts) if fused else torch.enable_grad()
    with ctx:
        for x in xs:
            with torch.autocast(device, dtype=dtype):
                y = experts(x, offsets)
            (y.float() * torch.linspace(-1, 1, y.shape[1], device=device)).sum().backward()
            copies.append(experts._copies)
    return [p.grad.clone() for p in experts.parameters()], copies


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation, recompute", [("swiglu", False), ("swiglu", True), ("gelu", False)])
def test_master_weight_step_equals_the_plain_cast(device, activation, recompute):
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    D, F, L = (64, 32, 3) if device == "cpu" else (256, 192, 4)
    experts = GroupedExperts(L, D, F, activation, device=device)
    experts.recompute = recompute
    offsets = torch.tensor([5, 5, 17, 30][:L], device=device, dtype=torch.int32)  # an empty group
    xs = [torch.randn(33, D, device=device) for _ in range(3)]
    plain, _ = _step(experts, xs, offsets, device, dtype, fused=False)
    fused, copies = _step(experts, xs, offsets, device, dtype, fused=True)
    for a, b in zip(plain, fused):
        assert b.dtype == torch.float32
        assert torch.equal(a, b)
    assert copies[0] is not None and all(c is copies[0] for c in copies), "one cast for all micro-batches"
    assert experts._copies is None and not experts.fuse_master_weights, "leaving frees the copies"


def test_a_weight_changed_inside_the_step_is_cast_again():
    experts = GroupedExperts(2, 64, 32, device="cpu")
    offsets = torch.tensor([4, 9], dtype=torch.int32)
    x = torch.randn(9, 64)
    with master_weight_step(experts):
        with torch.autocast("cpu", dtype=torch.float16):
            experts(x, offsets)
            first = experts._copies
            with torch.no_grad():
                experts.w2_LFD.mul_(2)
            y = experts(x, offsets)
            assert experts._copies is not first
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(y, experts(x, offsets))


def test_fp32_compute_and_weights_already_16_bit_take_the_plain_path():
    experts = GroupedExperts(2, 64, 32, device="cpu")
    offsets = torch.tensor([4, 9], dtype=torch.int32)
    with master_weight_step(experts):
        experts(torch.randn(9, 64), offsets).sum().backward()  # no autocast: fp32 compute
        assert experts._copies is None
        experts.half()
        experts(torch.randn(9, 64, dtype=torch.float16), offsets).float().sum().backward()
        assert experts._copies is None and experts.w1_LDU.grad.dtype == torch.float16
