"""FlashAttention kernels against the PyTorch reference; the reference against SDPA; the attention
module; RoPE.

Accuracy rule: against the fp32 reference, our error (max abs, for O, dQ, dK, dV) must be at most
2× the error of plain PyTorch computing in the same low precision, plus a small floor per dtype
(the floor covers outputs that are exactly representable, e.g. dQ = 0 when S = 1).
"""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.bias import causal_lower_right

from attention import Attention, attention_reference, flash_attention
import attention.flash_attn as fa
import attention.flash_attn_hopper as fah
import attention.flash_attn_hopper_bwd as fab
from attention.flash_attn import attention_forward
from attention.reference import visible_keys
from attention.rope import apply_rope, rope_cos_sin
from tests.sm90 import run_child

ATOL_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
DEVICE_GPU = "cuda"
# The kernels run on CPU tensors only through the interpreter (set by conftest without a GPU);
# on a GPU machine the same cases are covered by the compiled `gpu` tests below.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="Triton interpreter cases (no GPU present)")


def _inputs(B, H, Hkv, S, Hd, dtype, device, Sk=None):
    Sk = S if Sk is None else Sk
    q = torch.randn(B, H, S, Hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, Hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, Hd, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(B, H, S, Hd, device=device, dtype=dtype)
    return q, k, v, do


def _out_and_grads(fn, q, k, v, do):
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def _assert_accurate(ours, q, k, v, do, causal, window, dtype, scale=None):
    """``ours`` (o, dq, dk, dv) against the fp32 reference on q, k, v, by the accuracy rule."""
    exact = _out_and_grads(
        lambda a, b, c: attention_reference(a, b, c, causal, scale, window=window), q, k, v, do)
    torch_low = _out_and_grads(
        lambda a, b, c: attention_reference(a, b, c, causal, scale, upcast=False, window=window),
        q, k, v, do)
    for name, x, ref, base in zip(("o", "dq", "dk", "dv"), ours, exact, torch_low):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
        err = (x.float() - ref.float()).abs().max().item()
        torch_err = (base.float() - ref.float()).abs().max().item()
        bound = 2 * torch_err + ATOL_FLOOR[dtype]
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (torch {torch_err:.3g})"


def _ours(q, k, v, do, causal, window):
    """flash_attention's (o, dq, dk, dv)."""
    return _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal=causal, window=window),
                          q, k, v, do)


def _check_against_reference(B, H, Hkv, S, Hd, causal, dtype, device, Sk=None, window=None):
    """S queries against Sk keys (default S)."""
    q, k, v, do = _inputs(B, H, Hkv, S, Hd, dtype, device, Sk)
    ours = _ours(q, k, v, do, causal, window)
    _assert_accurate(ours, q, k, v, do, causal, window, dtype)


def _mask_by_diagonals(Sq, Sk, causal, window):
    """The visibility rule written with diagonals (key j of query i lies on diagonal j − i; the
    query's own, bottom-right aligned, is Sk − Sq): independent of ``visible_keys``."""
    keep = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        keep = keep.tril(Sk - Sq)
    if window is not None:
        keep = keep.tril(Sk - Sq + window[1]).triu(Sk - Sq - window[0])
    return keep


def _check_rows_seeing_nothing(Sq, Sk, causal, window, dtype, device):
    """Queries that see no key output exactly 0 and get dQ = 0, LSE = +inf there; every other
    row's LSE is the base-2 log-sum-exp of its scaled visible scores; the rest by the rule."""
    H, Hkv, Hd = 2, 1, 32
    empty = ~_mask_by_diagonals(Sq, Sk, causal, window).any(dim=1).to(device)
    assert empty.any() and not empty.all()
    q, k, v, do = _inputs(1, H, Hkv, Sq, Hd, dtype, device, Sk)
    ours = _ours(q, k, v, do, causal, window)
    o, dq = ours[0], ours[1]
    assert (o[:, :, empty] == 0).all() and (dq[:, :, empty] == 0).all()
    _assert_accurate(ours, q, k, v, do, causal, window, dtype)
    _, lse = attention_forward(q.detach(), k.detach(), v.detach(), causal, window=window)
    assert (lse[:, :, empty] == float("inf")).all()
    kk = k.detach().float().repeat_interleave(H // Hkv, dim=1)
    scores = (q.detach().float() @ kk.transpose(-1, -2)) / math.sqrt(Hd)
    scores = scores.masked_fill(~_mask_by_diagonals(Sq, Sk, causal, window).to(device), -math.inf)
    lse_ref = torch.logsumexp(scores, dim=-1) / math.log(2)
    torch.testing.assert_close(lse[:, :, ~empty], lse_ref[:, :, ~empty], rtol=1e-4, atol=2e-3)


def _check_skips_unseen_blocks(poison_keys, dtype, device, A):
    """Blocks outside every window are never visited: inputs that no result depends on are NaN,
    and the results stay exact only if no program takes them into a dot (0 · NaN = NaN). With
    poisoned keys every kernel is checked (k and v are both NaN); with poisoned queries, the
    dK/dV kernel (a forward or dQ program of rows that see nothing masks its scores to −inf, so
    a visit there would not show). Only visits of blocks below A are caught.

    A: a multiple of every block size in use. poison_keys: A/2 queries at key positions
    2A … 2.5A − 1 of 2.5A keys with window (A/2 − 1, 0) see keys from 1.5A + 1 on; keys below A
    are NaN. Otherwise: 2.5A queries against A/2 keys, causal, so queries below 2A see nothing;
    their q and dO rows below A are NaN (the dK/dV kernel must skip those query blocks).
    """
    if poison_keys:
        Sq, Sk, window = A // 2, 5 * A // 2, (A // 2 - 1, 0)
    else:
        Sq, Sk, window = 5 * A // 2, A // 2, None
    q, k, v, do = _inputs(1, 4, 2, Sq, 32, dtype, device, Sk)
    poisoned = [t.detach().clone() for t in (q, k, v, do)]
    for t in (poisoned[1:3] if poison_keys else poisoned[::3]):
        t[:, :, :A] = float("nan")
    pq, pk, pv, pdo = (t.requires_grad_(i < 3) for i, t in enumerate(poisoned))
    ours = _ours(pq, pk, pv, pdo, True, window)
    _assert_accurate(ours, q, k, v, do, True, window, dtype)


def _check_empty_lengths(device):
    """No query: empty output, zero dK and dV. No key: every query outputs 0, dQ = 0."""
    for Sq, Sk in ((0, 5), (5, 0)):
        q, k, v, do = _inputs(1, 2, 1, Sq, 32, torch.float16, device, Sk)
        o, dq, dk, dv = _out_and_grads(lambda a, b, c: flash_attention(a, b, c), q, k, v, do)
        assert o.shape == (1, 2, Sq, 32) and dk.shape == (1, 1, Sk, 32)
        for t in (o, dq, dk, dv):
            assert (t == 0).all()


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
@pytest.mark.parametrize("strided", ["q", "kv", "qkv"])
def test_interpreter_backward_takes_a_strided_last_dim(strided):
    """q, k or v whose last dim is not contiguous (a transposed (B, H, Hd, S) buffer): the forward
    made its own contiguous copies, and the backward once read the tensors autograd saved, the
    caller's, as if their last stride were 1 (dq off by ~1e19, dk and dv by ~7)."""
    q, k, v, do = _inputs(1, 2, 2, 24, 40, torch.float32, "cpu")
    views = {}
    for name, t in zip("qkv", (q, k, v)):
        views[name] = (t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
                       if name in strided else t)
        assert (views[name].stride(-1) != 1) == (name in strided)
    q, k, v = views["q"], views["k"], views["v"]
    _assert_accurate(_ours(q, k, v, do, True, None), q, k, v, do, True, None, torch.float32)


@interpreter_only
@pytest.mark.parametrize("scale", [0.7, 0.0, -0.7])
@pytest.mark.parametrize("causal", [True, False])
def test_interpreter_scale_argument(scale, causal):
    """Any scale SDPA takes, the forward and the backward, on scores spread over about ±200 (in
    units of log2 after scaling): 70 keys give full key blocks (the unmasked path, whose row max
    is taken before scaling: for a negative scale that was the smallest score and exp2
    overflowed, until the wrapper negated q instead) and masked ones."""
    q, k, v, do = _inputs(1, 2, 2, 70, 32, torch.float32, "cpu")
    q = (q.detach() * 8).requires_grad_()
    ours = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal, scale=scale), q, k, v, do)
    ref = _out_and_grads(lambda a, b, c: attention_reference(a, b, c, causal, scale=scale),
                         q, k, v, do)
    for name, x, y in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert (x - y).abs().max().item() <= 1e-4 * (1 + y.abs().max().item()), name


@interpreter_only
@pytest.mark.parametrize("Sq,Sk,H,Hkv,causal", [
    (17, 70, 2, 2, True), (17, 70, 4, 1, False), (70, 17, 4, 2, True), (70, 17, 2, 2, False),
    (1, 127, 4, 1, True), (127, 1, 2, 1, False), (33, 80, 2, 2, True),
])
def test_interpreter_cross_lengths_fp16(Sq, Sk, H, Hkv, causal):
    """Sq != Sk (cross-attention, chunked prefill), causal bottom-right aligned."""
    _check_against_reference(1, H, Hkv, Sq, 32, causal, torch.float16, "cpu", Sk=Sk)


@interpreter_only
@pytest.mark.parametrize("Sq,Sk,causal", [(40, 100, True), (100, 40, True), (48, 20, False)])
def test_interpreter_cross_lengths_fp32(Sq, Sk, causal):
    _check_against_reference(1, 4, 2, Sq, 64, causal, torch.float32, "cpu", Sk=Sk)


@interpreter_only
@pytest.mark.parametrize("Sq,Sk,H,Hkv,causal,window,dtype", [
    # Narrower than every block (3 < 16), wider than a block, and a window over Sq < Sk.
    (70, 70, 2, 2, True, (3, 0), torch.float16),
    (80, 80, 2, 1, True, (40, 0), torch.float16),
    (30, 100, 4, 2, True, (20, 0), torch.float32),
    # Left and right, non-causal, also with lengths that differ either way.
    (70, 70, 2, 1, False, (5, 7), torch.float16),
    (64, 64, 2, 2, False, (0, 0), torch.float32),
    (40, 90, 2, 1, False, (17, 3), torch.float16),
    (90, 40, 2, 1, False, (2, 30), torch.float32),
])
def test_interpreter_window(Sq, Sk, H, Hkv, causal, window, dtype):
    _check_against_reference(1, H, Hkv, Sq, 32, causal, dtype, "cpu", Sk=Sk, window=window)


@interpreter_only
@pytest.mark.parametrize("Sq,Sk,causal,window", [
    (64, 64, True, (1, 0)), (64, 64, True, (15, 0)), (64, 64, True, (16, 0)),
    (64, 64, True, (17, 0)), (64, 64, True, (33, 0)), (64, 64, False, (0, 1)),
    (64, 64, False, (16, 15)), (64, 64, False, (31, 17)), (48, 64, True, (1, 0)),
    (47, 64, True, (17, 0)), (64, 49, True, (16, 0)), (64, 33, False, (15, 32)),
    (49, 64, False, (32, 1)), (63, 80, True, None), (80, 65, True, None),
])
def test_interpreter_band_edges(Sq, Sk, causal, window):
    """Band edges at, just before and just after block boundaries (interpreter blocks are 16 and
    32): an off-by-one in the key and mirrored query ranges at these block shapes shows up in
    one of these (the GPU lists' shapes: test_interpreter_every_listed_block_shape)."""
    _check_against_reference(1, 1, 1, Sq, 16, causal, torch.float32, "cpu", Sk=Sk, window=window)


@interpreter_only
def test_interpreter_every_listed_block_shape(monkeypatch):
    """The interpreter runs one small config; here every (BLOCK_M, BLOCK_N) of the GPU lists is
    forced in turn (the shapes a GPU run only times unless the autotuner picks them): the plain
    path at ragged lengths, causal and not, and a band, against the reference."""
    kernels = ((fa._attn_fwd_kernel, fa.FWD_SPACE), (fa._attn_bwd_dkdv_kernel, fa.DKDV_SPACE),
               (fa._attn_bwd_dq_kernel, fa.DQ_SPACE))
    shapes = [sorted({(bm, bn) for bm, bn, _, _ in narrow + wide}) for _, (narrow, wide) in kernels]
    for i in range(max(map(len, shapes))):
        for (kernel, _), listed in zip(kernels, shapes):
            bm, bn = listed[i % len(listed)]
            monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn},
                                                                  num_warps=4, num_stages=1)])
        for Sq, Sk, causal, window in ((130, 130, True, None), (70, 70, False, None),
                                       (100, 130, True, (40, 0))):
            _check_against_reference(1, 1, 1, Sq, 16, causal, torch.float32, "cpu", Sk=Sk,
                                     window=window)


@interpreter_only
@pytest.mark.parametrize("Sq,Sk,causal,window,dtype", [
    (70, 20, True, None, torch.float16), (50, 30, True, (4, 0), torch.float32),
    (60, 20, False, (3, 2), torch.float16),
])
def test_interpreter_rows_seeing_nothing(Sq, Sk, causal, window, dtype):
    _check_rows_seeing_nothing(Sq, Sk, causal, window, dtype, "cpu")


@interpreter_only
@pytest.mark.parametrize("poison_keys", [True, False])
def test_interpreter_skips_blocks_outside_every_window(poison_keys):
    _check_skips_unseen_blocks(poison_keys, torch.float32, "cpu", A=32)


@interpreter_only
@pytest.mark.parametrize("Hd,Sq,Sk,H,Hkv,causal,window,dtype", [
    (96, 70, 70, 2, 2, True, None, torch.float16),
    (96, 17, 127, 4, 2, False, None, torch.float32),
    (96, 70, 40, 2, 1, True, (9, 0), torch.float16),
    (256, 33, 33, 2, 2, True, None, torch.float16),
    (256, 1, 70, 4, 1, False, None, torch.float32),
    (256, 40, 40, 2, 1, False, (6, 4), torch.float32),
    (8, 17, 17, 2, 2, True, None, torch.float16),
    (40, 127, 1, 2, 2, False, None, torch.float32),
])
def test_interpreter_head_dims(Hd, Sq, Sk, H, Hkv, causal, window, dtype):
    """Head dims that are not a power of two run on padded tiles; 256 on the widest."""
    _check_against_reference(1, H, Hkv, Sq, Hd, causal, dtype, "cpu", Sk=Sk, window=window)


@interpreter_only
def test_interpreter_empty_lengths():
    _check_empty_lengths("cpu")


def test_reference_visible_keys_by_hand():
    """The rule on small cases worked out by hand (rows: queries, columns: keys)."""
    def table(rows):
        return torch.tensor([[c == "x" for c in r] for r in rows])
    # Bottom-right causal: the last query sees every key; the first Sk − Sq keys are the cache.
    assert torch.equal(visible_keys(3, 5), table(["xxx..", "xxxx.", "xxxxx"]))
    # More queries than keys: the first two see nothing.
    assert torch.equal(visible_keys(4, 2), table(["..", "..", "x.", "xx"]))
    assert torch.equal(visible_keys(3, 5, window=(1, 0)), table([".xx..", "..xx.", "...xx"]))
    assert torch.equal(visible_keys(3, 3, causal=False, window=(0, 1)),
                       table(["xx.", ".xx", "..x"]))
    assert torch.equal(visible_keys(2, 4, causal=False, window=(3, 0)), table(["xxx.", "xxxx"]))


@pytest.mark.parametrize("Sq,Sk,causal,window", [
    (5, 12, True, None), (12, 5, True, None), (9, 9, True, None), (7, 13, False, None),
    (13, 7, False, None), (16, 16, True, (3, 0)), (6, 15, True, (4, 0)), (15, 6, True, (2, 0)),
    (11, 11, False, (2, 3)), (8, 14, False, (0, 5)), (14, 8, False, (4, 0)),
])
def test_reference_matches_sdpa_fp64(Sq, Sk, causal, window):
    """The reference (fp64) against SDPA with a boolean mask from the rule (GQA, rows that see
    nothing included), and bottom-right causal against ``causal_lower_right`` where it is
    defined (Sq <= Sk)."""
    q, k, v, do = _inputs(2, 4, 2, Sq, 8, torch.float64, "cpu", Sk)
    ours = _out_and_grads(lambda a, b, c: attention_reference(a, b, c, causal, window=window),
                          q, k, v, do)
    mask = _mask_by_diagonals(Sq, Sk, causal, window)
    sdpa = _out_and_grads(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=mask, enable_gqa=True), q, k, v, do)
    for name, x, ref in zip(("o", "dq", "dk", "dv"), ours, sdpa):
        torch.testing.assert_close(x, ref, msg=name)
    if causal and window is None and Sq <= Sk:
        lower_right = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Sq, Sk),
                                                     enable_gqa=True)
        torch.testing.assert_close(ours[0], lower_right)


@pytest.mark.parametrize("window,causal", [
    ((-1, 0), True), ((2, -3), False), ((4,), True), ((1, 2, 3), False), ((1.5, 0), True),
    ((True, 0), True), (8, True), ("ab", False), ((2, 1), True),
])
def test_window_errors(window, causal):
    q = torch.ones(1, 2, 8, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, q.clone(), q.clone(), causal=causal, window=window)


@pytest.mark.parametrize(
    "q_shape,kv_shape,dtypes,match",
    [
        ((1, 2, 8, 36), (1, 2, 8, 36), (torch.float16,) * 2, "head dim 36"),
        ((1, 2, 8, 264), (1, 2, 8, 264), (torch.float16,) * 2, "head dim 264"),
        ((1, 2, 8, 32), (1, 2, 8, 32), (torch.float16, torch.bfloat16), "dtypes differ"),
        ((1, 6, 8, 32), (1, 4, 8, 32), (torch.float16,) * 2, "multiple of k/v heads"),
        ((1, 2, 8, 32), (2, 2, 9, 32), (torch.float16,) * 2, "k/v batch"),
        ((1, 2, 8, 32), (1, 2, 9, 64), (torch.float16,) * 2, "k/v head dim 64"),
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
    window = None if mod.sliding_window is None else (mod.sliding_window - 1, 0)
    o = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window=window)
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


def test_module_sliding_window_cpu():
    """Query i sees keys i-W < j <= i: the reference with window (W-1, 0), outputs from position
    W+2 on blind to the first three tokens, and a window >= S the plain causal module."""
    W = 5
    mod = Attention(dim=64, n_heads=4, n_kv_heads=2, sliding_window=W)
    x = torch.randn(2, 23, 64)
    y = mod(x)
    assert torch.allclose(y, _module_reference(mod, x), atol=1e-5)
    x2 = x.clone()
    x2[:, :3] = torch.randn(2, 3, 64)
    y2 = mod(x2)
    assert torch.equal(y2[:, W + 2:], y[:, W + 2:]) and not torch.allclose(y2[:, W + 1], y[:, W + 1])
    mod.sliding_window = 23
    full = Attention(dim=64, n_heads=4, n_kv_heads=2)
    full.load_state_dict(mod.state_dict())
    assert torch.equal(mod(x), full(x))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            Attention(dim=64, n_heads=4, sliding_window=bad)


def test_module_rejects_bad_heads():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        Attention(dim=64, n_heads=6, n_kv_heads=4)


# ---- GPU: compiled kernels, bf16 and fp16 ------------------------------------------------------

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
@pytest.mark.parametrize("Sq,Sk", [(256, 2048), (2048, 256), (700, 1500), (1500, 700), (1, 999)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Hd", [64, 128])
def test_gpu_cross_lengths_bf16(Sq, Sk, causal, Hd):
    _check_against_reference(2, 8, 2, Sq, Hd, causal, torch.bfloat16, DEVICE_GPU, Sk=Sk)


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk,causal,window", [
    (2048, 2048, True, (256, 0)), (2000, 2000, True, (10, 0)), (1024, 2048, True, (100, 0)),
    (2000, 2000, False, (128, 64)), (300, 1200, False, (17, 5)), (1200, 300, False, (0, 700)),
    (1500, 700, True, (50, 0)),
])
@pytest.mark.parametrize("Hd,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (256, torch.float16)])
def test_gpu_window(Sq, Sk, causal, window, Hd, dtype):
    _check_against_reference(2, 8, 2, Sq, Hd, causal, dtype, DEVICE_GPU, Sk=Sk, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 17, 239, 1000])
@pytest.mark.parametrize("Hd", [96, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_head_dims_bf16(S, Hd, causal):
    _check_against_reference(2, 8, 2, S, Hd, causal, torch.bfloat16, DEVICE_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_head_dim_256_fp32(causal):
    """fp32 at Hd 256, forward and backward: its tiles take twice bf16's shared memory, and the
    small block at the end of each 256-wide list is there for it (the autotuner skips a config
    that does not fit: one must). The dots run in tf32 on a GPU (10 mantissa bits, as fp16), so
    the bound is fp16's order of error against the fp32 reference, not the accuracy rule's fp32
    floor; a wrong block is off by O(1)."""
    q, k, v, do = _inputs(1, 4, 2, 300, 256, torch.float32, DEVICE_GPU)
    ours = _ours(q, k, v, do, causal, None)
    exact = _out_and_grads(lambda a, b, c: attention_reference(a, b, c, causal), q, k, v, do)
    for name, x, ref in zip(("o", "dq", "dk", "dv"), ours, exact):
        assert x.dtype == torch.float32 and torch.isfinite(x).all(), name
        err = (x - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item(), f"{name}: error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("Hd", [40, 96, 256])
def test_gpu_head_dims_fp16_cross(Hd):
    _check_against_reference(2, 8, 2, 333, Hd, True, torch.float16, DEVICE_GPU, Sk=1027)


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk,causal,window", [
    (1500, 300, True, None), (1200, 500, True, (64, 0)), (900, 100, False, (30, 20)),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rows_seeing_nothing(Sq, Sk, causal, window, dtype):
    _check_rows_seeing_nothing(Sq, Sk, causal, window, dtype, DEVICE_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("poison_keys", [True, False])
def test_gpu_skips_blocks_outside_every_window(poison_keys):
    _check_skips_unseen_blocks(poison_keys, torch.bfloat16, DEVICE_GPU, A=128)


@pytest.mark.gpu
def test_gpu_empty_lengths():
    _check_empty_lengths(DEVICE_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk,causal,window", [
    (2049, 2049, True, None), (2049, 2049, False, None), (1000, 2049, True, (300, 0)),
    (2049, 700, False, (100, 60)),
])
def test_gpu_backward_bit_identical_on_repeat(Sq, Sk, causal, window):
    """Race detector: no atomics, so every repeat must give the same bits."""
    q, k, v, do = _inputs(2, 16, 4, Sq, 128, torch.bfloat16, DEVICE_GPU, Sk)

    def fn(a, b, c):
        return flash_attention(a, b, c, causal=causal, window=window)

    first = _out_and_grads(fn, q, k, v, do)
    for _ in range(3):
        again = _out_and_grads(fn, q, k, v, do)
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
@pytest.mark.parametrize("sliding_window", [None, 64])
def test_gpu_module_matches_reference(sliding_window):
    mod = Attention(dim=512, n_heads=8, n_kv_heads=2, head_dim=64, sliding_window=sliding_window)
    mod = mod.to(DEVICE_GPU, torch.bfloat16)
    x = torch.randn(2, 301, 512, device=DEVICE_GPU, dtype=torch.bfloat16)
    y = mod(x)
    ref = _module_reference(mod, x)
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)
    y.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in mod.parameters())


# ---- The Hopper (Gluon) forward ----------------------------------------------------------------

_SM90_RESOURCES = """
import json, re, sys
import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
import attention.flash_attn_hopper as fah
import attention.flash_attn_hopper_bwd as fab
from kernel_floor import GLUON_DTYPES, gluon_layout
from tests.sm90 import compile_sm90, cuobjdump, map_cases, ptxas_log


def resources(case):
    kind, causal, deterministic, head_d, dtype, walk, seq_len = case
    name = "bf16" if dtype == "bfloat16" else "fp16"

    def desc(rows):
        return f"tensordesc<{name}[1,1,{rows},{head_d}],{gluon_layout((1, 1, rows, head_d), GLUON_DTYPES[getattr(torch, dtype)])!r}>"
    if kind == "fwd":
        plan = fah.plan(head_d, seq_len, causal)
        signature = {"q_desc": desc(fah.WG_M), "k_desc": desc(plan.block_n),
                     "v_desc": desc(plan.block_n), "o_desc": desc(fah.WG_M), "LSE": "*fp32",
                     "H": "i32", "GROUP": "i32", "SQ": "i32", "SK": "i32", "n_units": "i32",
                     "qk_scale": "fp32"}
        constexprs = plan.constexprs(head_d, causal)
        fn, warps, max_nreg = fah._attn_fwd_hopper_kernel, 4, plan.max_nreg
    else:
        block_m = fab.BLOCK_M[head_d]
        dq_layout = gl.NVMMASharedLayout.get_default_for([block_m, head_d], gl.float32)
        block_n = fab.BLOCK_N[head_d]
        signature = {"q_desc": desc(block_m), "k_desc": desc(block_n),
                     "v_desc": desc(block_n), "do_desc": desc(block_m),
                     "dk_desc": desc(block_n), "dv_desc": desc(block_n),
                     "dq_desc": f"tensordesc<fp32[{block_m},{head_d}],{dq_layout!r}>",
                     "dqo_desc": desc(block_m),
                     "LSE": "*fp32", "DELTA": "*fp32", "SEM": "*i32", "H": "i32", "GROUP": "i32",
                     "SQ": "i32", "SQ_PAD": "i32", "qk_scale": "fp32", "sm_scale": "fp32",
                     "stuck_ns": "i64"}
        constexprs = {"CAUSAL": causal, "DETERMINISTIC": deterministic,
                      "FINISH_DQ": fab.finishes_dq(deterministic, seq_len, head_d), "WALK": walk,
                      "BLOCK_M": block_m}
        constexprs.update({"BLOCK_N": block_n, "HEAD_D": head_d, "STAGES": fab.STAGES[head_d],
                           "CONSUMER_REGS": fab.CONSUMER_REGS,
                           "PRODUCER_REGS": fab.PRODUCER_REGS})
        fn, warps, max_nreg = fab._attn_bwd_hopper_kernel, 8, fab.MAX_NREG
    signature.update({name: "constexpr" for name in constexprs})
    kernel, log = compile_sm90(GluonASTSource(fn, signature, constexprs),
                               {"num_warps": warps, "maxnreg": max_nreg})
    usage, sass = cuobjdump(kernel, "--dump-resource-usage"), cuobjdump(kernel, "-sass")
    # The block loops: conditional backward branches (the loops' closing tests; the out-of-line
    # mbarrier retries jump back unconditionally) whose body issues wgmma and holds no such loop.
    code = [(int(a, 16), t) for a, t in re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in code
             if (m := re.search(r"^@!?U?P\\d BRA (?:!?U?P\\d, )?(0x[0-9a-f]+)", t.strip()))
             and int(m.group(1), 16) < a]
    mma = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and "HGMMA" in t for a, t in code)]
    hot = [(lo, hi) for lo, hi in mma
           if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in mma)]
    spills_in_loops = sum(1 for a, t in code if ("LDL" in t or "STL" in t)
                          and any(lo <= a <= hi for lo, hi in hot))
    # wgmma fences and waits in the busiest hot loop: ptxas adds them, with moves, where it
    # cannot keep an accumulator in place across an asynchronous wgmma (no C7515 is printed then)
    warpgroup_ops = max((sum(1 for a, t in code if lo <= a <= hi and t.startswith("WARPGROUP"))
                         for lo, hi in hot), default=0)
    return [int(re.search(r"REG:(\\d+)", usage).group(1)),
            int(re.search(r"STACK:(\\d+)", usage).group(1)),
            "setmaxnreg" in kernel.asm["ptx"], "C7515" in ptxas_log(kernel, log),
            max_nreg, len(hot), spills_in_loops, warpgroup_ops]


print(json.dumps(map_cases(resources, json.loads(sys.argv[1]))))
"""


def test_forward_plan_rejects_tilings_the_kernel_cannot_run():
    """A Plan the forward kernel would misread fails where it is built, naming the field: no Q
    buffer, one in the stream (which holds a tile's buffer until the next tile's first step has
    stored it), or the first step peeled in the stream (which has no zero P·V to skip); every
    tiling ``plan`` picks is buildable."""
    for q_buffers, cross_tile in ((0, False), (1, True)):
        with pytest.raises(ValueError, match="q_buffers"):
            fah.Plan(warpgroups=2, q_buffers=q_buffers, cross_tile=cross_tile)
    fah.Plan(warpgroups=2, q_buffers=1)
    with pytest.raises(ValueError, match="peel_first"):
        fah.Plan(warpgroups=2, q_buffers=3, cross_tile=True, peel_first=True)
    for Hd in fah.HEAD_DIMS:
        for S in (1, 1024, 2048, 4096, 16384):
            for causal in (True, False):
                assert isinstance(fah.plan(Hd, S, causal), fah.Plan)


def test_backward_walk_follows_the_measured_rule(monkeypatch):
    """``_walk``: causal Hd 64 ascends at every length (measured faster than DESCENDING past half
    the SMs); otherwise ASCENDING (causal) or CYCLIC up to half the SMs' key blocks, DESCENDING
    past them; each a walk the kernel can take for that causality."""
    monkeypatch.setattr(fab, "sm_count", lambda device: 132)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    walk = fab._walk.__wrapped__  # uncached: sm_count is patched
    asc, cyc, desc = int(fab.WALK_ASCENDING), int(fab.WALK_CYCLIC), int(fab.WALK_DESCENDING)
    for causal, head_d, n_k, expected in [(True, 64, 1, asc), (True, 64, 66, asc), (True, 64, 67, asc),
                                          (True, 64, 512, asc), (True, 128, 66, asc),
                                          (True, 128, 67, desc), (False, 64, 66, cyc),
                                          (False, 64, 67, desc), (False, 128, 1, cyc),
                                          (False, 128, 512, desc)]:
        got = walk(causal, n_k, "device", head_d)
        assert got == expected and fab.walk_possible(got, causal), (causal, head_d, n_k, got)


def test_wide_tiles_follow_the_measured_rule():
    """Hd 33-63 and 65-127 run the Hd 64 and 128 Gluon kernels (TMA zero-fills the columns past
    Hd) from ``WIDE_TILE_FROM`` keys, 256, the shortest length at which every timed head dim ran
    >= 1.05x the Triton path (at 128 keys Hd 96 causal read 0.999x); Hd 64, 128 and 256 at any
    length; no other head dim ever (Hd 129-255 on the Hd 256 tiles is not measured)."""
    assert fah.WIDE_TILE_FROM == 256
    for head_dims in (fah.HEAD_DIMS, fab.HEAD_DIMS):
        for head_d, tile in ((40, 64), (48, 64), (56, 64), (72, 128), (96, 128), (120, 128)):
            assert fah.kernel_head_dim(head_d, 256, head_dims) == tile
            assert fah.kernel_head_dim(head_d, 1 << 15, head_dims) == tile
            assert fah.kernel_head_dim(head_d, 255, head_dims) is None
        for head_d in (64, 128):
            assert fah.kernel_head_dim(head_d, 1, head_dims) == head_d
        for head_d in (8, 16, 24, 32, 136, 192, 248):
            assert fah.kernel_head_dim(head_d, 1 << 15, head_dims) is None
    # Hd 256: its own tiles at any length, the forward's and the backward's (64 keys a CTA)
    for head_dims in (fah.HEAD_DIMS, fab.HEAD_DIMS):
        assert fah.kernel_head_dim(256, 1, head_dims) == 256


def test_hopper_kernels_compile_for_sm90_without_spills_or_serialized_wgmma():
    """The warp-specialized kernels' register plans hold when compiled for sm_90 (no GPU needed:
    Triton's bundled ptxas; a child process, since the interpreter that conftest switches on
    cannot compile): registers within the launch budget (``max_nreg``), no spills (but the few
    the Hd 64 backward's 128-row steps cost, bounded below), setmaxnreg
    present (without it every warp keeps the launch's 168 or 128 registers and the consumers
    spill), and no C7515 from ptxas.
    C7515 means ptxas waits for every wgmma where it is issued: the backward once carried a
    running wgmma across its loop's back edge and lost 10-20 % that way with no other sign."""
    import json

    walks = [int(fab.WALK_DESCENDING), int(fab.WALK_CYCLIC), int(fab.WALK_ASCENDING)]
    # The forward at each tiling: two consumers, and three (Hd 64 from WIDE_HD64_FROM keys, or
    # WIDE_HD64_NONCAUSAL_FROM without the causal mask); at Hd 128 a loop per tile and (to
    # CROSS_TILE_HD128_TO keys) one stream of the CTA's tiles.
    cases = [["fwd", True, False, 128, "bfloat16", None, 4096],
             ["fwd", False, False, 128, "float16", None, 4096],
             ["fwd", True, False, 128, "bfloat16", None, fah.CROSS_TILE_HD128_TO],
             ["fwd", False, False, 128, "float16", None, 1024],
             ["fwd", True, False, 64, "bfloat16", None, 1024],
             ["fwd", True, False, 64, "bfloat16", None, fah.WIDE_HD64_FROM],
             ["fwd", False, False, 64, "float16", None, fah.WIDE_HD64_NONCAUSAL_FROM],
             # one Q buffer, at Hd 256 beside a two-stage ring of 64-key blocks
             ["fwd", True, False, 256, "bfloat16", None, 4096],
             ["fwd", False, False, 256, "float16", None, 4096],
             ["bwd", False, False, 128, "float16", walks[0], fab.FINISH_DQ_TO],
             ["bwd", False, False, 64, "float16", walks[0], fab.FINISH_DQ_TO],
             ["bwd", True, False, 256, "float16", int(fab.WALK_ASCENDING), 4096]]
    # Every walk a call can take, deterministic, with the in-kernel dQ finish (to FINISH_DQ_TO
    # keys) and without it (longer calls).
    cases += [["bwd", causal, True, head_d, "bfloat16", walk, seq_len]
              for seq_len in (fab.FINISH_DQ_TO, fab.FINISH_DQ_TO + 1)
              for head_d in fab.HEAD_DIMS for causal in (True, False) for walk in walks
              if fab.walk_possible(walk, causal)]
    run = run_child(_SM90_RESOURCES, json.dumps(cases), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for case, (regs, stack, moves, serialized, budget, loops, spills_in_loops,
               warpgroup_ops) in zip(cases, json.loads(run.stdout.splitlines()[-1]), strict=True):
        # The Hd 64 backward's 128-row steps leave up to 6 scalars on the stack, one reloaded
        # per step (measured worth it: fab.BLOCK_M); anything more is a changed register plan.
        stack_bytes, reloads = (24, 1) if case[0] == "bwd" and case[3] == 64 else (0, 0)
        assert (regs <= budget and stack <= stack_bytes and moves and not serialized
                and loops >= (fah.plan(case[3], case[6], case[1]).warpgroups if case[0] == "fwd" else 1)
                and spills_in_loops <= reloads), (
            case, regs, stack, moves, serialized, loops, spills_in_loops)
        # 2 wgmma groups a forward step and 5 matmuls a backward step, as measured; the forward
        # once copied O around every wgmma (32 here, 0.75-0.87x as fast: flash_attn_hopper._kv_step)
        assert warpgroup_ops <= (4 if case[0] == "fwd" else 9), (case, warpgroup_ops)


_DELTA_LOADS = """
import re
from triton.compiler import ASTSource
import attention.flash_attn as fa
from tests.sm90 import compile_sm90
strides = ["stride_ob", "stride_oh", "stride_os", "stride_dob", "stride_doh", "stride_dos"]
for aligned in (True, False):
    constexprs = {"ZERO_SEM": True, "ALIGNED": aligned, "HEAD_DIM": 128, "BLOCK_D": 128,
                  "BLOCK_M": 64}
    signature = {"O": "*bf16", "DO": "*bf16", "DELTA": "*fp32", "SEM": "*i32",
                 **{n: "i64" for n in strides}, "H": "i32", "SQ": "i32",
                 **{n: "constexpr" for n in constexprs}}
    ptx = compile_sm90(ASTSource(fa._attn_bwd_delta_kernel, signature, constexprs), {})[0].asm["ptx"]
    print(aligned, sorted(set(re.findall(r"ld\\.global\\.[\\w.]+", ptx))))
"""


def test_delta_kernel_loads_16_bytes_when_aligned():
    """The Δ kernel leaves its pointers and strides unspecialized (cached_launch reuses one
    binary), so its ALIGNED flag must restore the 16-byte loads Triton's own specialization gave
    (sm_90 PTX, compiled on CPU): without it every bf16 element is a separate 2-byte load."""
    run = run_child(_DELTA_LOADS, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    aligned, unaligned = run.stdout.splitlines()[-2:]
    assert aligned == "True ['ld.global.v4.b32']", aligned
    assert unaligned == "False ['ld.global.b16']", unaligned


_TRITON_LOADS = """
import re
from triton.compiler import ASTSource
import attention.flash_attn as fa
from tests.sm90 import compile_sm90
for kernel in (fa._attn_fwd_kernel, fa._attn_bwd_dkdv_kernel, fa._attn_bwd_dq_kernel):
    fn = kernel.fn  # under the autotuner
    constexprs = {"CAUSAL": False, "BAND": False, "HEAD_DIM": 72, "BLOCK_D": 128, "BLOCK_M": 64,
                  "BLOCK_N": 64}
    for align in (8, 1):
        # pointers 16-byte aligned, as the launcher marks them; the ints unmarked, as it leaves
        # Hd 72's (their quotients by ALIGN: the row stride 72 // 8 = 9)
        signature = {n: "constexpr" if n in constexprs or n == "ALIGN"
                     else "*fp32" if n in ("LSE", "DELTA")
                     else "*bf16" if n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")
                     else "fp32" if n.endswith("scale") else "i32" for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if signature[n].startswith("*")}
        source = ASTSource(fn, signature, {**constexprs, "ALIGN": align}, attrs)
        ptx = compile_sm90(source, {"num_warps": 4, "num_stages": 2})[0].asm["ptx"]
        narrow = sorted(set(re.findall(r"(?:ld|st)\\.global\\.b16", ptx)))
        print(fn.__name__, align, "cp.async.cg.shared.global" in ptx, narrow)
"""


def test_align_marks_strides_only_when_every_one_divides():
    """``_align``: 16 bytes' worth of elements when every base is 16-byte aligned and every
    batch, head and row stride a multiple of it (zero strides too) and below 2^31; else 1."""
    class Fake:  # a tensor's address and strides without its memory
        def __init__(self, ptr, strides, size=2):
            self.ptr, self.strides, self.size = ptr, strides, size

        def data_ptr(self):
            return self.ptr

        def stride(self, dim=None):
            return self.strides if dim is None else self.strides[dim]

        def element_size(self):
            return self.size
    q = torch.empty(2, 4, 33, 72, dtype=torch.bfloat16)
    assert fa._align(q, q.transpose(1, 2).contiguous().transpose(1, 2)) == 8
    assert fa._align(q[:, :1].expand(2, 4, 33, 72)) == 8  # a zero head stride
    assert fa._align(q.float()) == 4
    assert fa._align(Fake(16, (72 * 33 * 4, 72 * 33, 72, 1))) == 8
    assert fa._align(Fake(8, (72 * 33 * 4, 72 * 33, 72, 1))) == 1  # the base
    assert fa._align(q, Fake(16, (72 * 33 * 4, 72 * 33, 76, 1))) == 1  # one row stride of another
    assert fa._align(Fake(16, (2**31, 72 * 33, 72, 1))) == 1  # past int32


def test_triton_kernels_load_16_bytes_at_head_dims_off_16():
    """Hd 72 (any Hd ≡ 8 mod 16): with the host's ALIGN the forward and both backward kernels
    pipeline their tiles through 16-byte cp.async and store no 2-byte element alone; without it
    (Triton's own marks) 2-byte loads and stores, no cp.async (sm_90 PTX, compiled on CPU)."""
    run = run_child(_TRITON_LOADS, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()[-6:]
    for name, aligned, unaligned in zip(("fwd", "dkdv", "dq"), lines[0::2], lines[1::2]):
        assert aligned.endswith(" 8 True []"), (name, aligned)
        assert unaligned.endswith(" 1 False ['ld.global.b16', 'st.global.b16']"), (name, unaligned)


@interpreter_only
def test_interpreter_deterministic_flag_reaches_the_backward():
    """deterministic=False only frees the Hopper kernel's dQ order; elsewhere (here the Triton
    kernels) the gradients are the same bits."""
    q, k, v, do = _inputs(1, 2, 1, 33, 16, torch.float32, "cpu")
    fixed = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, True), q, k, v, do)
    free = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, True, deterministic=False),
                          q, k, v, do)
    for name, x, y in zip(("o", "dq", "dk", "dv"), fixed, free):
        assert torch.equal(x, y), name


def test_hopper_kernels_refuse_what_they_do_not_serve():
    q = torch.randn(1, 2, 8, 128)
    assert not fah.hopper_forward_ok(q, q, q, True, None)  # CPU tensors: the Triton kernels
    assert not fab.hopper_backward_ok(q, q, q, q, True, None)


def _gpu_heads(B, h, S, Hd, dtype, layout):
    """A (B, h, S, Hd) GPU tensor: contiguous ("BHSD") or a transposed (B, S, h, Hd) ("BSHD")."""
    if layout == "BSHD":
        return torch.randn(B, S, h, Hd, device=DEVICE_GPU, dtype=dtype).transpose(1, 2)
    return torch.randn(B, h, S, Hd, device=DEVICE_GPU, dtype=dtype)


def _assert_near_triton(names, ours, triton_run, dtype):
    """Each of ``ours`` within 1e-2 of the largest value (plus the dtype's floor) of the Triton
    kernels' result, with its shape, dtype and strides: two kernels' accumulation orders apart."""
    for name, x, y in zip(names, ours, triton_run, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype and x.stride() == y.stride(), name
        assert not x.isnan().any(), f"{name}: rows left unwritten"
        scale = y.float().abs().max().item()
        assert (x.float() - y.float()).abs().max().item() <= 1e-2 * scale + ATOL_FLOOR[dtype], name


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


_HOPPER_FORWARD_CASES = [  # (B, H, Hkv, S, Hd, causal, dtype, layout)
    (2, 16, 16, 4096, 128, True, torch.bfloat16, "BSHD"),
    (1, 8, 2, 4097, 128, False, torch.bfloat16, "BHSD"),
    (3, 4, 1, 1000, 128, True, torch.float16, "BSHD"),
    (4, 16, 4, 1100, 128, True, torch.bfloat16, "BHSD"),  # 320 units: CTAs loop; odd tile count
    (2, 8, 8, 129, 128, False, torch.bfloat16, "BHSD"),
    (4, 2, 2, 64, 128, True, torch.float16, "BSHD"),
    (1, 1, 1, 1, 128, True, torch.bfloat16, "BHSD"),
    (8, 32, 32, 64, 128, True, torch.bfloat16, "BHSD"),  # 256 one-block tiles: CTAs run two in a row
    # Hd 64: two consumers below WIDE_HD64_FROM keys (WIDE_HD64_NONCAUSAL_FROM non-causal), three
    # (192-row tiles, so a causal tile's diagonal crosses two key blocks) from there.
    (2, 32, 32, 4096, 64, True, torch.bfloat16, "BSHD"),
    (1, 8, 2, 4097, 64, False, torch.bfloat16, "BHSD"),
    (3, 4, 1, 1000, 64, True, torch.float16, "BSHD"),
    (4, 16, 4, 1100, 64, True, torch.bfloat16, "BHSD"),
    (2, 8, 8, 192, 64, True, torch.bfloat16, "BHSD"),  # three consumers: one whole tile
    (2, 8, 8, 193, 64, True, torch.bfloat16, "BHSD"),  # three consumers: a one-row second tile
    (1, 4, 4, 200, 64, False, torch.bfloat16, "BHSD"),
    (1, 4, 2, 2048, 64, False, torch.bfloat16, "BSHD"),  # three consumers, non-causal only
    (2, 4, 2, 384, 64, True, torch.float16, "BHSD"),
    (1, 4, 4, 1050, 64, True, torch.bfloat16, "BHSD"),  # the end cuts a diagonal's first half
    (1, 1, 1, 1, 64, True, torch.bfloat16, "BHSD"),
    # Hd 65-127 on the Hd 128 kernels' tiles: the columns past Hd load as zeros, stores drop them
    (2, 8, 2, 1000, 96, True, torch.bfloat16, "BSHD"),
    (1, 4, 4, 4097, 96, False, torch.bfloat16, "BHSD"),
    (2, 4, 2, 129, 72, True, torch.float16, "BHSD"),
    (1, 2, 1, 1, 120, True, torch.bfloat16, "BSHD"),
    # Hd 33-63 on the Hd 64 kernels' tiles, the same way
    (2, 8, 2, 1000, 48, True, torch.bfloat16, "BSHD"),
    (1, 4, 4, 2049, 56, False, torch.float16, "BHSD"),
    (2, 4, 2, 193, 40, True, torch.bfloat16, "BHSD"),
    # Hd 256: one Q buffer, handed on between a CTA's tiles (8·32 causal 512-row heads: about
    # eight tiles a CTA), odd lengths, GQA; one tiling, so "planned" only
    (8, 32, 8, 512, 256, True, torch.bfloat16, "BHSD"),
    (2, 4, 2, 1000, 256, True, torch.bfloat16, "BSHD"),
    (1, 8, 2, 4097, 256, False, torch.float16, "BHSD"),
    (3, 2, 1, 129, 256, False, torch.bfloat16, "BHSD"),
    (1, 1, 1, 1, 256, True, torch.bfloat16, "BSHD"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon forward is for sm_90")
@pytest.mark.parametrize("B,H,Hkv,S,Hd,causal,dtype,layout,tiling", [
    (*case, tiling) for case in _HOPPER_FORWARD_CASES for tiling in ("planned", "other")
    if tiling == "planned" or case[4] != 256])
def test_gpu_hopper_forward_matches_triton_forward(B, H, Hkv, S, Hd, causal, dtype, layout,
                                                   tiling, monkeypatch):
    """O and LSE of the Gluon forward against the Triton forward (forced) on the same inputs:
    long and odd lengths, GQA, both layouts. The backward consumes either one's LSE.
    ``tiling="other"`` runs each case in the tiling its length and mask do not get: at Hd 64 two
    consumers where the plan takes three (192-row tiles) and three where it takes two; at Hd 128 a
    loop per tile where the plan streams the CTA's tiles, and the stream where it does not (Hd
    33-63 as Hd 64, 65-127 as Hd 128; Hd 256 has one tiling)."""
    monkeypatch.setattr(fah, "WIDE_TILE_FROM", 0)  # Hd 33-127 at any length
    head_d = fah.kernel_head_dim(Hd, S, fah.HEAD_DIMS)
    if tiling == "other":
        if head_d == 64:
            wide = fah.plan(head_d, S, causal).warpgroups == 3
            for name in ("WIDE_HD64_FROM", "WIDE_HD64_NONCAUSAL_FROM"):
                monkeypatch.setattr(fah, name, 1 << 30 if wide else 0)
            assert (fah.plan(head_d, S, causal).warpgroups == 3) != wide
        else:
            streamed = fah.plan(head_d, S, causal).cross_tile
            monkeypatch.setattr(fah, "CROSS_TILE_HD128_TO", 0 if streamed else 1 << 30)
            assert fah.plan(head_d, S, causal).cross_tile != streamed

    q, k, v = (_gpu_heads(B, h, S, Hd, dtype, layout) for h in (H, Hkv, Hkv))
    monkeypatch.setattr(fah, "MIN_SCORES", 0)  # small cases too: the kernel, not the dispatch
    assert fah.hopper_forward_ok(q, k, v, causal, None)
    o, lse = attention_forward(q, k, v, causal)
    monkeypatch.setattr(fa, "hopper_forward_ok", lambda *a: False)
    o_ref, lse_ref = attention_forward(q, k, v, causal)
    assert o.stride() == o_ref.stride()
    assert (o.float() - o_ref.float()).abs().max().item() <= 2 * ATOL_FLOOR[dtype]
    assert (lse - lse_ref).abs().max().item() <= 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon forward is for sm_90")
@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("Hd", [64, 128])
def test_gpu_non_positive_scale(scale, Hd, monkeypatch):
    """A zero scale goes to the Triton forward (the Gluon forward masks scores before it scales
    them: -inf · 0 is NaN); a negative one to the Gluon forward on −q with |scale|. The Gluon
    backward masks after exp2 and takes any scale. Scores spread wide (q · 8), so a row max
    taken before a negative scale overflows exp2. Both by the accuracy rule."""
    q, k, v, do = _inputs(2, 4, 4, 1000, Hd, torch.bfloat16, DEVICE_GPU)
    q = (q.detach() * 8).requires_grad_()
    assert fah.hopper_forward_ok(q, k, v, True, None)
    monkeypatch.setattr(fab, "MIN_SCORES", 0)
    assert fab.hopper_backward_ok(q, k, v, do, True, None)
    ours = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, True, scale=scale), q, k, v, do)
    _assert_accurate(ours, q, k, v, do, True, None, torch.bfloat16, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon backward is for sm_90")
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("B,H,Hkv,S,causal,dtype,layout", [
    (2, 16, 16, 4096, True, torch.bfloat16, "BSHD"),
    (1, 8, 2, 4097, False, torch.bfloat16, "BHSD"),
    (3, 4, 1, 1000, True, torch.float16, "BSHD"),
    (2, 8, 8, 129, False, torch.bfloat16, "BHSD"),
    (1, 4, 4, 200, True, torch.bfloat16, "BHSD"),
    (4, 2, 2, 64, True, torch.float16, "BSHD"),
    (1, 1, 1, 1, True, torch.bfloat16, "BHSD"),
])
@pytest.mark.parametrize("Hd", [64, 128, 96, 48, 256])
def test_gpu_hopper_backward(B, H, Hkv, S, causal, dtype, layout, deterministic, Hd, monkeypatch):
    """The Gluon backward against the Triton backward (forced) on the same forward: long and odd
    lengths, GQA, both layouts, one-row and partial blocks, Hd 96 and 48 on wider tiles; against the
    fp32 reference by the accuracy rule where that fits in memory; and bit-identical on repeat
    when deterministic. Each case takes the walk ``_walk`` picks for it (the next test forces
    the others)."""
    _check_hopper_backward(B, H, Hkv, S, Hd, causal, dtype, layout, deterministic, monkeypatch)


@pytest.mark.gpu
@pytest.mark.timeout(300)  # a wrong turn order would leave a CTA waiting forever
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon backward is for sm_90")
@pytest.mark.parametrize("walk,B,H,Hkv,S,causal", [
    ("DESCENDING", 1, 8, 2, 4097, False), ("CYCLIC", 1, 8, 2, 4097, False),
    ("DESCENDING", 3, 4, 1, 1000, True), ("ASCENDING", 3, 4, 1, 1000, True),
    ("ASCENDING", 2, 4, 4, 4096, True), ("CYCLIC", 2, 4, 4, 129, False),
    # 142 CTAs (282 at Hd 256), more than the SMs hold (a head's 71 fit; at Hd 256 its 141 do not:
    # ASCENDING needs none resident together)
    ("ASCENDING", 1, 4, 2, 9000, True),
])
@pytest.mark.parametrize("Hd", [64, 128, 256])
def test_gpu_hopper_backward_every_walk(walk, B, H, Hkv, S, causal, Hd, monkeypatch):
    """Every order of the deterministic adds (``WALK_*``), whichever ``_walk`` would pick here."""
    forced = int(getattr(fab, "WALK_" + walk))
    monkeypatch.setattr(fab, "_walk", lambda *a: forced)
    _check_hopper_backward(B, H, Hkv, S, Hd, causal, torch.bfloat16, "BHSD", True, monkeypatch)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon backward is for sm_90")
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("walk,B,H,Hkv,S,causal", [
    ("DESCENDING", 1, 4, 2, 1000, False), ("CYCLIC", 2, 2, 1, 129, False),
    ("DESCENDING", 2, 4, 4, 333, True), ("ASCENDING", 1, 4, 2, 1000, True),
    ("ASCENDING", 1, 2, 2, 1, True), ("CYCLIC", 1, 2, 1, 1500, False),
])
@pytest.mark.parametrize("Hd", [64, 128, 72, 40, 256])
def test_gpu_hopper_backward_writes_every_gradient_row(walk, B, H, Hkv, S, causal, Hd,
                                                      deterministic, monkeypatch):
    """dq, dk, dv and the fp32 dQ accumulator start as NaN: every row must be written
    (deterministic, to FINISH_DQ_TO keys, dq's rows by the last adder of each block, from the
    others' sum: a block it missed, or one it read before the first adder's store, shows as NaN,
    one read before the other adds were in as a wrong sum; past FINISH_DQ_TO and
    nondeterministic, by the pass after the kernel, whose dk and dv are checked the same way), at
    every walk, odd lengths, GQA, a one-row sequence and Hd 72 and 40 on wider tiles, against the
    Triton backward."""
    forced = int(getattr(fab, "WALK_" + walk))
    monkeypatch.setattr(fab, "_walk", lambda *a: forced)
    monkeypatch.setattr(fab, "MIN_SCORES", 0)
    monkeypatch.setattr(fah, "WIDE_TILE_FROM", 0)  # Hd 72 and 40 at any length
    q, k, v = (_gpu_heads(B, h, S, Hd, torch.bfloat16, "BHSD").requires_grad_() for h in (H, Hkv, Hkv))
    do = _gpu_heads(B, H, S, Hd, torch.bfloat16, "BHSD")
    assert fab.hopper_backward_ok(q, k, v, do, causal, None)
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*shape, dtype=None, **kw):  # the fp32 dQ accumulator; not the int turn counters
        t = empty(*shape, dtype=dtype, **kw)
        return t.fill_(float("nan")) if dtype == torch.float32 else t
    with monkeypatch.context() as m:
        m.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
        m.setattr(torch, "empty", nan_empty)
        ours = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal, deterministic=deterministic),
                              q, k, v, do)[1:]
    with monkeypatch.context() as m:
        m.setattr(fa, "hopper_backward_ok", lambda *a: False)
        triton_grads = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal), q, k, v, do)[1:]
    _assert_near_triton(("dq", "dk", "dv"), ours, triton_grads, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon kernels are for sm_90")
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_head_dim_96_takes_the_gluon_kernels_from_its_length(causal, monkeypatch):
    """Unpatched, Hd 96 reaches both Gluon kernels at ``WIDE_TILE_FROM`` keys and the forward
    not one key shorter; there o, dq, dk and dv match the Triton kernels' (forced). B·H 4096, so
    the causal backward's 2^27 visible scores (``fab.MIN_SCORES``) are there at 256 keys."""
    q, k, v, do = _inputs(128, 32, 32, fah.WIDE_TILE_FROM, 96, torch.bfloat16, DEVICE_GPU)
    assert fah.hopper_forward_ok(q, k, v, causal, None)
    assert fab.hopper_backward_ok(q, k, v, do, causal, None)
    short = q.detach()[:, :, 1:]
    assert not fah.hopper_forward_ok(short, short, short, causal, None)
    ours = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal), q, k, v, do)
    with monkeypatch.context() as m:
        m.setattr(fa, "hopper_forward_ok", lambda *a: False)
        m.setattr(fa, "hopper_backward_ok", lambda *a: False)
        triton_run = _out_and_grads(lambda a, b, c: flash_attention(a, b, c, causal), q, k, v, do)
    _assert_near_triton(("o", "dq", "dk", "dv"), ours, triton_run, torch.bfloat16)


_STUCK_TURN = """
import torch
import attention.flash_attn as fa
import attention.flash_attn_hopper_bwd as fab
from attention import flash_attention
fab.MIN_SCORES, fab.STUCK_NS = 0, 2 * 10**8
q, k, v, do = (torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
torch.autograd.grad(flash_attention(q, k, v, True), (q, k, v), do)
torch.cuda.synchronize()
print("control ok", flush=True)
delta = fa._delta
fa._delta = lambda o, do, d, sem: (delta(o, do, d, sem), sem.fill_(1 << 20))  # never a turn
torch.autograd.grad(flash_attention(q, k, v, True), (q, k, v), do)
torch.cuda.synchronize()
print("no trap", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon backward is for sm_90")
def test_gpu_hopper_backward_stuck_turn_fails_instead_of_hanging():
    """A deterministic CTA whose turn never comes (here: counters that start past every turn;
    in use: CYCLIC with fewer SMs free than it needs) traps after STUCK_NS: the process gets a
    CUDA error, not a hung GPU. Run in a child, since the trap ends its CUDA context."""
    run = run_child(_STUCK_TURN, timeout=240)
    assert "control ok" in run.stdout and "no trap" not in run.stdout, run.stdout + run.stderr
    assert run.returncode != 0 and "CUDA" in run.stderr, run.stderr[-2000:]


def _check_hopper_backward(B, H, Hkv, S, Hd, causal, dtype, layout, deterministic, monkeypatch):
    q, k, v = (_gpu_heads(B, h, S, Hd, dtype, layout).requires_grad_() for h in (H, Hkv, Hkv))
    do = _gpu_heads(B, H, S, Hd, dtype, layout)
    monkeypatch.setattr(fab, "MIN_SCORES", 0)  # small cases too: the kernel, not the dispatch
    monkeypatch.setattr(fah, "WIDE_TILE_FROM", 0)  # and Hd 33-127's
    assert fab.hopper_backward_ok(q, k, v, do, causal, None)

    def run():
        return _out_and_grads(
            lambda a, b, c: flash_attention(a, b, c, causal, deterministic=deterministic),
            q, k, v, do)

    ours = run()
    if deterministic:
        for name, x, y in zip(("o", "dq", "dk", "dv"), ours, run()):
            assert torch.equal(x, y), f"{name} differs between repeats"
    with monkeypatch.context() as m:
        m.setattr(fa, "hopper_backward_ok", lambda *a: False)
        triton_grads = run()[1:]
    _assert_near_triton(("dq", "dk", "dv"), ours[1:], triton_grads, dtype)
    if S <= 1024:
        _assert_accurate(ours, q, k, v, do, causal, None, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [17, 1000])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_triton_forward_still_accurate(S, causal, monkeypatch):
    """On Hopper the plain Hd 64 and 128 cases take the Gluon forward; this keeps the Triton
    forward (every other GPU) under the accuracy rule too."""
    monkeypatch.setattr(fa, "hopper_forward_ok", lambda *a: False)
    _check_against_reference(2, 8, 2, S, 128, causal, torch.bfloat16, DEVICE_GPU)
