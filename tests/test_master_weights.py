"""The experts' fp32 master weights under a 16-bit autocast: one cast per optimizer step and the
weight gradients added into ``.grad`` in one pass or in the wgrad kernel's epilogue
(``moe.master_weight_step``), against the plain ``w.to(dtype)`` path and the fp32 sums."""

import pytest
import torch

from kernel_floor import INTERPRET
from moe import GroupedExperts, master_weight_step
from moe.kernels.master_grad import accumulate_master_grad_, accumulate_wgrad_

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


def _wgrad_fp32(x_MI, dy_MN, offsets_J, L):
    """Σ over the segments of group l of x_sᵀ @ dy_s, in fp32 from the 16-bit rows."""
    dw = torch.zeros(L, x_MI.shape[1], dy_MN.shape[1], device=x_MI.device)
    start = 0
    for s, end in enumerate(offsets_J.tolist()):
        dw[s % L] += x_MI[start:end].float().T @ dy_MN[start:end].float()
        start = end
    return dw


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_wgrad_adds_the_unrounded_fp32_sums(device):
    if device == "cpu" and not INTERPRET:
        pytest.skip("the wgrad kernel runs on CPU tensors only under TRITON_INTERPRET (a machine without a GPU)")
    # ragged I and N (the half-tile masks of the epilogue), an empty and a one-row group; the
    # tight tolerance also proves the epilogue ran: a 16-bit dw on the way is off by ~1e-3
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    L, I, N = (4, 48, 80) if device == "cpu" else (4, 320, 400)
    offsets = torch.tensor([0, 1, 17, 40], device=device, dtype=torch.int32)
    master = torch.zeros(L, I, N, device=device, requires_grad=True)
    x = torch.randn(40, I, device=device).to(dtype)
    expected = None
    for _ in range(2):
        dy = torch.randn(40, N, device=device).to(dtype)
        accumulate_wgrad_(master, x, dy, offsets)
        part = _wgrad_fp32(x, dy, offsets, L)
        expected = part if expected is None else expected + part
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, expected, rtol=1e-5, atol=1e-5)
    assert not master.grad[0].any(), "an empty group adds nothing"


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_wgrad_of_several_segments_per_group_and_bad_shapes(device):
    if device == "cpu" and not INTERPRET:
        pytest.skip("the wgrad kernel runs on CPU tensors only under TRITON_INTERPRET (a machine without a GPU)")
    L, I, N = 2, 16, 24
    offsets = torch.tensor([3, 7, 7, 12], device=device, dtype=torch.int32)  # J = 2·L: the two-pass form
    master = torch.zeros(L, I, N, device=device, requires_grad=True)
    x, dy = torch.randn(12, I, device=device).half(), torch.randn(12, N, device=device).half()
    accumulate_wgrad_(master, x, dy, offsets)
    torch.testing.assert_close(master.grad, _wgrad_fp32(x, dy, offsets, L), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match=r"do not make the gradient of a master weight of shape \(2, 16, 24\)"):
        accumulate_wgrad_(master, x, dy[:, :8], offsets)


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
        if activation == "gelu":  # the one-pass add of the 16-bit dw: the same fp32 sums
            assert torch.equal(a, b)
        else:  # added unrounded in the wgrad epilogue: plain's dw was rounded to 16 bits
            assert ((a - b).norm() / a.norm()).item() < 4e-3
    assert copies[0] is not None and all(c is copies[0] for c in copies), "one cast for all micro-batches"
    assert experts._copies is None and not experts.fuse_master_weights, "leaving frees the copies"


@pytest.fixture
def triton_mlp(monkeypatch, request):
    """The experts' MLP on the Triton path on CPU too (the interpreter): where the SwiGLU node
    and the wgrad epilogue run."""
    import moe.experts as experts_module
    from moe.kernels import grouped_mlp

    if request.getfixturevalue("device") == "cpu" and not INTERPRET:
        pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET (a machine without a GPU)")
    monkeypatch.setattr(experts_module, "grouped_mlp", lambda *args, **kw: grouped_mlp(*args, **kw, backend="triton"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
def test_swiglu_weight_gradients_come_from_the_epilogue_once(device, recompute, triton_mlp):
    # the epilogue ran: not the plain path's bits (it rounds each micro-batch's dw to 16 bits),
    # and within that rounding of them (a second add would double them)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    experts = GroupedExperts(3, 64, 32, "swiglu", device=device)
    experts.recompute = recompute
    offsets = torch.tensor([5, 5, 30], device=device, dtype=torch.int32)
    xs = [torch.randn(30, 64, device=device) for _ in range(2)]  # the second adds into the first
    plain, _ = _step(experts, xs, offsets, device, dtype, fused=False)
    fused, _ = _step(experts, xs, offsets, device, dtype, fused=True)
    for a, b in zip(plain, fused):
        assert not torch.equal(a, b)
        assert ((a - b).norm() / a.norm()).item() < 4e-3


@pytest.mark.parametrize("device", DEVICES)
def test_a_gradient_of_the_input_alone_leaves_the_weights_alone(device, triton_mlp):
    experts = GroupedExperts(2, 64, 32, "swiglu", device=device)
    offsets = torch.tensor([4, 9], device=device, dtype=torch.int32)
    x = torch.randn(9, 64, device=device, requires_grad=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    with master_weight_step(experts), torch.autocast(device, dtype=dtype):
        (dx,) = torch.autograd.grad(experts(x, offsets).float().sum(), x)
        experts(x, offsets).float().sum().backward(inputs=[x])
    assert dx.shape == x.shape and x.grad is not None
    assert experts.w1_LDU.grad is None and experts.w2_LFD.grad is None


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
