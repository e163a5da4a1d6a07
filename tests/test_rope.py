"""The Triton RoPE pass (forward and its inverse-rotation backward) against the PyTorch reference."""

import pytest
import torch

from attention.rope import apply_rope, rope_cos_sin

CPU_DTYPES = [torch.float32, torch.float16]  # bf16 math is not exact under the interpreter
# the Triton pass runs on CPU tensors only under the interpreter (set without a GPU)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _compare(x, cos, sin, atol, rtol=0.0):
    x_ref = x.detach().clone().requires_grad_(True)
    x_tri = x.detach().clone().requires_grad_(True)
    ref = apply_rope(x_ref, cos, sin, backend="reference")
    out = apply_rope(x_tri, cos, sin, backend="triton")
    assert out.is_contiguous() and out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad)
    torch.testing.assert_close(x_tri.grad, x_ref.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 3, 16), (1, 5, 2, 6), (1, 1, 1, 2)])
def test_triton_matches_reference(shape, dtype):
    B, S, H, Hd = shape
    cos, sin = rope_cos_sin(S, Hd, theta=100.0, device=DEV)
    _compare(torch.randn(shape, device=DEV).to(dtype), cos, sin, 1e-6 if dtype == torch.float32 else 2e-3)


def test_triton_reads_a_strided_view_of_the_fused_projection():
    B, S, H, Hkv, Hd = 2, 9, 4, 2, 8
    qkv = torch.randn(B, S, (H + 2 * Hkv) * Hd, device=DEV).view(B, S, H + 2 * Hkv, Hd)
    k = qkv[:, :, H:H + Hkv]  # not contiguous: strides of the whole projection
    assert not k.is_contiguous()
    cos, sin = rope_cos_sin(S, Hd, device=DEV)
    _compare(k, cos, sin, 1e-6)


def test_backward_is_the_inverse_rotation():
    cos, sin = rope_cos_sin(6, 8, device=DEV)
    x = torch.randn(1, 6, 2, 8, device=DEV, requires_grad=True)
    y = apply_rope(x, cos, sin, backend="triton")
    (g,) = torch.autograd.grad(y, x, y)  # the rotation's transpose applied to its output gives x back
    torch.testing.assert_close(g, x.detach(), atol=1e-6, rtol=0)


def test_tables_of_the_wrong_shape_raise():
    cos, sin = rope_cos_sin(5, 8)
    with pytest.raises(ValueError, match=r"tables of shape \(6, 4\)"):
        apply_rope(torch.randn(1, 6, 2, 8), cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 2048, 16, 128), (2, 33, 4, 64), (1, 1, 3, 256)])
def test_gpu_bf16_matches_reference(shape):
    B, S, H, Hd = shape
    cos, sin = rope_cos_sin(S, Hd, device="cuda")
    x = torch.randn(B, S, H + 2, Hd, device="cuda", dtype=torch.bfloat16)[:, :, 1:H + 1]
    # one bf16 rounding of the fp32 result apart at most (the kernel may fuse a multiply-add)
    _compare(x, cos, sin, 2 ** -8, rtol=2 ** -7)
