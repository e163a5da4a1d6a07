"""FlashAttention kernels against the PyTorch reference; the attention module; RoPE.

Accuracy rule: against the fp32 reference, our error (max abs, for O, dQ, dK, dV) must be at most
2× the error of plain PyTorch computing in the same low precision, plus a small floor per dtype
(the floor covers outputs that are exactly representable, e.g. dQ = 0 when S = 1).
"""

import pytest
import torch

from attention import Attention, attention_reference, flash_attention
from attention.rope import apply_rope, rope_cos_sin

ATOL_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
DEVICE_GPU = "cuda"
# The kernels run on CPU tensors only through the interpreter (set by conftest without a GPU);
# on a GPU machine the same cases are covered by the compiled `gpu` tests below.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="Triton interpreter cases (no GPU present)")


def _inputs(B, H, Hkv, S, Hd, dtype, device):
    q = torch.randn(B, H, S, Hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, Hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, Hd, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(B, H, S, Hd, device=device, dtype=dtype)
    return q, k, v, do


def _out_and_grads(fn, q, k, v, do):
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def _check_against_reference(B, H, Hkv, S, Hd, causal, dtype, device):
    q, k, v, do = _inputs(B, H, Hkv, S, Hd, dtype, device)
    ours = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, do)
    exact = _out_and_grads(lambda a, b, c: attention_reference(a, b, c, causal), q, k, v, do)
    torch_low = _out_and_grads(
        lambda a, b, c: attention_reference(a, b, c, causal, upcast=False), q, k, v, do)
    for name, x, ref, base in zip(("o", "dq", "dk", "dv"), ours, exact, torch_low):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
        err = (x.float() - ref.float()).abs().max().item()
        torch_err = (base.float() - ref.float()).abs().max().item()
        bound = 2 * torch_err + ATOL_FLOOR[dtype]
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (torch {torch_err:.3g})"


# ---- CPU: Triton interpreter, small sizes ------------------------------------------------------

@interpreter_only
@pytest.mark.parametrize("S", [1, 17, 70])
@pytest.mark.parametrize("H,Hkv", [(2, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_interpreter_fp16(S, H, Hkv, causal):
    _check_against_reference(1, H, Hkv, S, 32, causal, torch.float16, "cpu")


@interpreter_only
@pytest.mark.parametrize("S,Hd,H,Hkv,causal", [(33, 64, 4, 2, True), (48, 32, 8, 1, False)])
def test_interpreter_fp32(S, Hd, H, Hkv, causal):
    _check_against_reference(2, H, Hkv, S, Hd, causal, torch.float32, "cpu")


@interpreter_only
def test_interpreter_strided_inputs_match_contiguous():
    """(B, S, H, Hd) memory viewed as (B, H, S, Hd), as the module passes it, gives the same."""
    B, S, H, Hd = 1, 40, 2, 32
    base = torch.randn(B, S, 3 * H, Hd, dtype=torch.float16)
    q, k, v = (t.transpose(1, 2) for t in base.split(H, dim=2))
    strided = flash_attention(q, k, v, causal=True)
    contiguous = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(strided, contiguous)


@interpreter_only
def test_interpreter_scale_argument():
    q, k, v, _ = _inputs(1, 2, 2, 20, 32, torch.float32, "cpu")
    out = flash_attention(q, k, v, causal=False, scale=0.3)
    ref = attention_reference(q, k, v, causal=False, scale=0.3)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "q_shape,kv_shape,dtypes,match",
    [
        ((1, 2, 8, 48), (1, 2, 8, 48), (torch.float16,) * 2, "head dim 48"),
        ((1, 2, 8, 32), (1, 2, 8, 32), (torch.float16, torch.bfloat16), "dtypes differ"),
        ((1, 6, 8, 32), (1, 4, 8, 32), (torch.float16,) * 2, "multiple of k/v heads"),
        ((1, 2, 8, 32), (1, 2, 9, 32), (torch.float16,) * 2, "Sq == Sk"),
        ((1, 2, 8, 32), (1, 2, 8, 32), (torch.int32,) * 2, "unsupported"),
    ],
)
def test_clear_errors(q_shape, kv_shape, dtypes, match):
    q = torch.ones(q_shape).to(dtypes[0])
    k = torch.ones(kv_shape).to(dtypes[1])
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k.clone())


def test_rope_is_relative_and_norm_preserving():
    """<rope(q, m), rope(k, n)> depends only on m − n; rotations keep the norm."""
    Hd, S = 16, 12
    cos, sin = rope_cos_sin(S, Hd, theta=100.0)
    q = torch.randn(Hd, dtype=torch.float64)
    k = torch.randn(Hd, dtype=torch.float64)
    rq = apply_rope(q.expand(1, S, 1, Hd).contiguous(), cos, sin)[0, :, 0]
    rk = apply_rope(k.expand(1, S, 1, Hd).contiguous(), cos, sin)[0, :, 0]
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(S), atol=1e-5)
    dots = rq @ rk.T
    for shift in range(-3, 4):
        diag = torch.diagonal(dots, offset=shift)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-5), shift
    assert not torch.allclose(dots[0, 1], dots[0, 2])


def _module_reference(mod, x_BSD):
    """The module's math written out with the fp32 attention reference."""
    B, S, _ = x_BSD.shape
    H, Hkv, Hd = mod.n_heads, mod.n_kv_heads, mod.head_dim
    q, k, v = mod.qkv(x_BSD).view(B, S, H + 2 * Hkv, Hd).split((H, Hkv, Hkv), dim=2)
    cos, sin = rope_cos_sin(S, Hd, mod.rope_theta, device=x_BSD.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return mod.out(o.transpose(1, 2).reshape(B, S, H * Hd))


def test_module_cpu_matches_reference_and_is_causal():
    mod = Attention(dim=64, n_heads=4, n_kv_heads=2, qkv_bias=True, out_bias=True)
    x = torch.randn(2, 23, 64)
    y = mod(x)
    assert y.shape == x.shape
    assert torch.allclose(y, _module_reference(mod, x), atol=1e-5)
    x2 = x.clone()
    x2[:, 15:] = torch.randn(2, 8, 64)
    assert torch.equal(mod(x2)[:, :15], y[:, :15])
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mod.parameters())


def test_module_rejects_bad_heads():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        Attention(dim=64, n_heads=6, n_kv_heads=4)


# ---- GPU: compiled kernels, bf16 ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 17, 239, 1000])
@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Hd", [64, 128])
def test_gpu_bf16(S, H, Hkv, causal, Hd):
    _check_against_reference(2, H, Hkv, S, Hd, causal, torch.bfloat16, DEVICE_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("Hd,dtype", [(32, torch.bfloat16), (128, torch.float16)])
def test_gpu_other_head_dim_and_fp16(Hd, dtype):
    _check_against_reference(2, 4, 2, 777, Hd, True, dtype, DEVICE_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_backward_bit_identical_on_repeat(causal):
    """Race detector: no atomics, so every repeat must give the same bits."""
    q, k, v, do = _inputs(2, 16, 4, 2049, 128, torch.bfloat16, DEVICE_GPU)
    first = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, do)
    for _ in range(3):
        again = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal=causal),
                               q, k, v, do)
        for name, x, y in zip(("o", "dq", "dk", "dv"), first, again):
            assert torch.equal(x, y), f"{name} differs between repeats"


@pytest.mark.gpu
def test_gpu_memory_linear_in_S():
    """fwd+bwd at S=32768, hd128, B=1, H=16 fits; extra peak memory grows linearly in S."""
    extra = {}
    for S in (8192, 16384, 32768):
        q, k, v, do = _inputs(1, 16, 16, S, 128, torch.bfloat16, DEVICE_GPU)
        # Warm-up first: autotuning allocates its own buffers, which must stay out of the peak.
        _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal=True), q, k, v, do)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal=True), q, k, v, do)
        torch.cuda.synchronize()
        extra[S] = torch.cuda.max_memory_allocated() - base
        assert all(torch.isfinite(g).all() for g in grads)
        del q, k, v, do, grads
    per_token = {S: b / S for S, b in extra.items()}
    print("attention fwd+bwd extra peak bytes:", extra)
    # An S×S fp32 matrix would add 16·S² bytes per head; linear growth keeps bytes/token flat.
    assert max(per_token.values()) <= 1.1 * min(per_token.values()), per_token


@pytest.mark.gpu
def test_gpu_module_matches_reference():
    mod = Attention(dim=512, n_heads=8, n_kv_heads=2, head_dim=64).to(DEVICE_GPU, torch.bfloat16)
    x = torch.randn(2, 301, 512, device=DEVICE_GPU, dtype=torch.bfloat16)
    y = mod(x)
    ref = _module_reference(mod, x)
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)
    y.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in mod.parameters())
