"""The chunked LM head + cross-entropy (train/lm_loss.py) against ``F.cross_entropy(F.linear(h,
W).float(), y)``: the loss and the gradients of h and W in fp32, bf16 autocast, bf16 and fp16,
odd sizes and chunkings; the same with a bias b (``F.linear(h, W, b)``) and its gradient; what it
keeps for the backward; the model's ``model(tokens, targets)``
against the logits path, tied and untied, in one process and under FSDP2; on a GPU at a
realistic size, with its peak memory."""

import re

import pytest
import torch
import torch.nn.functional as F

import train.lm_loss
from parallel import ParallelDims
from tests.distributed import run_distributed
from tests.test_fsdp import BATCH, SEQ, Case, _config, _full, _rel
from tests.test_train import SMALL
from train.config import load_config
from train.lm_loss import LOGITS_BUDGET_BYTES, chunk_rows, linear_cross_entropy
from train.model import MoETransformer
from train.parallelize import parallelize, reduce_gradients

# name -> (dtype of h and W, autocast dtype or None, tolerance): max |ours - reference| over
# max |reference|, for the loss and each gradient. fp32: summation order only. bf16 / fp16: the
# logits and the gradients' GEMMs round to the compute dtype as the reference does, but a
# chunk's weight-gradient product is rounded before the fp32 sum (the reference rounds the whole
# sum once): differences of a few units of the dtype's last place (bf16: 2^-8 = 3.9e-3)
DTYPES = {
    "fp32": (torch.float32, None, 1e-5),
    "bf16_autocast": (torch.float32, torch.bfloat16, 1.6e-2),
    "bf16": (torch.bfloat16, None, 1.6e-2),
    "fp16": (torch.float16, None, 2e-3),
}
SIZES = [(37, 16, 50), (1, 8, 3), (64, 24, 1000), (130, 32, 7)]  # (T, D, V)


def _inputs(T, D, V, dtype):
    h_TD = torch.randn(T, D, dtype=dtype, requires_grad=True)
    weight_VD = (torch.randn(V, D) / D**0.5).to(dtype).requires_grad_()
    return h_TD, weight_VD, torch.randint(0, V, (T,))


def _bias(V, dtype):
    """An LM head's bias, in the weight's dtype (under autocast its fp32 master, cast like it): large
    enough to move the loss and every gradient well past the tolerances."""
    return (0.5 * torch.randn(V)).to(dtype).requires_grad_()


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def _rel_err(ours, ref) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("T, D, V", SIZES)
def test_loss_and_gradients_match_the_reference(name, T, D, V):
    dtype, autocast, tol = DTYPES[name]
    h_TD, weight_VD, y_T = _inputs(T, D, V, dtype)
    scale = torch.tensor(0.37)  # the incoming gradient of the loss: not 1
    with _autocast(autocast):
        ref = F.cross_entropy(F.linear(h_TD, weight_VD).float(), y_T)
    ref_h, ref_w = torch.autograd.grad(ref, (h_TD, weight_VD), scale)
    for chunk in (1, 5, T, T + 3, None):  # T not a multiple; one chunk; a chunk larger than T; the default
        with _autocast(autocast):
            loss = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=chunk)
        grad_h, grad_w = torch.autograd.grad(loss, (h_TD, weight_VD), scale)
        assert loss.dtype == torch.float32 and loss.shape == ()
        assert grad_h.dtype == dtype and grad_w.dtype == dtype
        assert abs(loss.item() - ref.item()) <= tol * abs(ref.item()), (chunk, loss.item(), ref.item())
        assert _rel_err(grad_h, ref_h) <= tol, (chunk, _rel_err(grad_h, ref_h))
        assert _rel_err(grad_w, ref_w) <= tol, (chunk, _rel_err(grad_w, ref_w))


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("T, D, V", SIZES)
def test_with_a_bias_the_loss_and_the_three_gradients_match_the_reference(name, T, D, V):
    dtype, autocast, tol = DTYPES[name]
    h_TD, weight_VD, y_T = _inputs(T, D, V, dtype)
    bias_V = _bias(V, dtype)
    inputs = (h_TD, weight_VD, bias_V)
    scale = torch.tensor(0.37)
    with _autocast(autocast):
        ref = F.cross_entropy(F.linear(h_TD, weight_VD, bias_V).float(), y_T)
    ref_grads = torch.autograd.grad(ref, inputs, scale)
    for chunk in (1, 5, T, T + 3, None):  # T not a multiple; one chunk; a chunk larger than T; the default
        with _autocast(autocast):
            loss = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=chunk, bias_V=bias_V)
        grads = torch.autograd.grad(loss, inputs, scale)
        assert loss.dtype == torch.float32 and loss.shape == ()
        assert [g.dtype for g in grads] == [dtype] * 3
        assert abs(loss.item() - ref.item()) <= tol * abs(ref.item()), (chunk, loss.item(), ref.item())
        errors = [_rel_err(g, r) for g, r in zip(grads, ref_grads)]  # h, weight, bias
        assert max(errors) <= tol, (chunk, errors)


@pytest.mark.parametrize("name", list(DTYPES))
def test_without_gradients_the_loss_is_the_same(name):
    dtype, autocast, _ = DTYPES[name]
    h_TD, weight_VD, y_T = _inputs(45, 16, 300, dtype)
    with _autocast(autocast):
        with_grad = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=8)
        with torch.no_grad():
            without = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=8)
        detached = linear_cross_entropy(h_TD.detach(), weight_VD.detach(), y_T, chunk=8)
    assert with_grad.requires_grad and not without.requires_grad and not detached.requires_grad
    assert torch.equal(with_grad.detach(), without) and torch.equal(without, detached)


@pytest.mark.parametrize("name", list(DTYPES))
def test_with_a_bias_without_gradients_the_loss_is_the_same(name):
    dtype, autocast, tol = DTYPES[name]
    h_TD, weight_VD, y_T = _inputs(45, 16, 300, dtype)
    bias_V = _bias(300, dtype)
    with _autocast(autocast):
        ref = F.cross_entropy(F.linear(h_TD, weight_VD, bias_V).float(), y_T)
        with_grad = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=8, bias_V=bias_V)
        with torch.no_grad():
            without = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=8, bias_V=bias_V)
        detached = linear_cross_entropy(h_TD.detach(), weight_VD.detach(), y_T, chunk=8, bias_V=bias_V.detach())
    assert with_grad.requires_grad and not without.requires_grad and not detached.requires_grad
    assert torch.equal(with_grad.detach(), without) and torch.equal(without, detached)
    assert abs(without.item() - ref.item()) <= tol * ref.item(), (without.item(), ref.item())


@pytest.mark.parametrize("needs", ["both", "h", "weight"])
def test_keeps_the_gradients_only_never_the_logits(needs):
    T, D, V = 64, 8, 1000  # T·V fp32 is 7.5 times h and W together
    h_TD, weight_VD, y_T = _inputs(T, D, V, torch.float32)
    h_TD.requires_grad_(needs != "weight")
    weight_VD.requires_grad_(needs != "h")
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=16)
    grads = [t.numel() * t.element_size() for t in (h_TD, weight_VD) if t.requires_grad]
    assert sorted(saved) == sorted(grads)  # the gradients of what needs one, no (T, V) tensor
    loss.backward()
    assert (h_TD.grad is not None) == h_TD.requires_grad and (weight_VD.grad is not None) == weight_VD.requires_grad


@pytest.mark.parametrize("name", list(DTYPES))
def test_with_only_the_bias_needing_a_gradient_only_its_gradient_is_kept(name):
    dtype, autocast, tol = DTYPES[name]
    T, D, V = 64, 8, 1000
    h_TD, weight_VD, y_T = _inputs(T, D, V, dtype)
    h_TD.requires_grad_(False)
    weight_VD.requires_grad_(False)
    bias_V = _bias(V, dtype)
    scale = torch.tensor(0.37)
    with _autocast(autocast):
        ref = F.cross_entropy(F.linear(h_TD, weight_VD, bias_V).float(), y_T)
    (ref_grad,) = torch.autograd.grad(ref, bias_V, scale)
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(autocast):
        loss = linear_cross_entropy(h_TD, weight_VD, y_T, chunk=13, bias_V=bias_V)  # 13 does not divide 64
    assert loss.requires_grad and saved == [V * bias_V.element_size()]  # the bias's gradient alone
    loss.backward(scale)
    assert h_TD.grad is None and weight_VD.grad is None and bias_V.grad.dtype == dtype
    assert _rel_err(bias_V.grad, ref_grad) <= tol, _rel_err(bias_V.grad, ref_grad)


def test_a_second_backward_through_a_retained_graph_fails_rather_than_scaling_twice():
    h_TD, weight_VD, y_T = _inputs(9, 4, 11, torch.float32)
    loss = linear_cross_entropy(h_TD, weight_VD, y_T)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16 math is not exact under the interpreter
@pytest.mark.parametrize("n, V", [(5, 300), (1, 2), (3, 256)])
def test_softmax_pass_equals_the_pytorch_math(n, V, dtype):
    """The Triton pass (one row per program, V in blocks, the last ragged) against the same math
    in PyTorch ops: the summed loss, and the gradient it writes over the logits."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs it on CPU tensors
    logits = (3 * torch.randn(n, V, device=dev)).to(dtype)
    y = torch.randint(0, V, (n,), device=dev)
    y[0] = V - 1
    ref_loss, ref_grad = train.lm_loss._softmax_xent_reference(logits, y, 1 / 7, with_grad=True)
    grad = logits.clone()
    loss = train.lm_loss._softmax_xent_(grad, y, 1 / 7, with_grad=True)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)
    untouched = logits.clone()
    assert torch.allclose(train.lm_loss._softmax_xent_(untouched, y, 1 / 7, with_grad=False), ref_loss, rtol=1e-5)
    assert torch.equal(untouched, logits), "without a gradient the logits are left as they are"


def test_chunk_rows_keep_the_fp32_logits_near_the_budget():
    assert chunk_rows(50304) == 7936 and chunk_rows(151936) == 2560  # the module's arithmetic
    for V in (256, 32000, 50304, 129280, 151936, 262144):
        assert chunk_rows(V) % 128 == 0 and LOGITS_BUDGET_BYTES * 0.7 < chunk_rows(V) * V * 4 <= LOGITS_BUDGET_BYTES
    assert chunk_rows(10**8) == 128  # the floor: one GEMM tile of rows


def test_wrong_shapes_are_one_clear_error():
    h_TD, weight_VD, y_T = _inputs(6, 4, 10, torch.float32)
    with pytest.raises(ValueError, match=r"takes h \(T, D\), weight \(V, D\), targets \(T,\)"):
        linear_cross_entropy(h_TD, weight_VD, y_T[:5])
    with pytest.raises(ValueError, match="chunk >= 1"):
        linear_cross_entropy(h_TD, weight_VD, y_T, chunk=0)


@pytest.mark.parametrize("shape", [(9,), (10, 1), (1, 10), ()])
def test_a_wrong_bias_shape_is_the_same_clear_error(shape):
    h_TD, weight_VD, y_T = _inputs(6, 4, 10, torch.float32)
    named = r"bias_V \(V,\) or None.*got \(6, 4\), \(10, 4\), \(6,\), " + re.escape(str(shape))  # and its shape
    with pytest.raises(ValueError, match=named):
        linear_cross_entropy(h_TD, weight_VD, y_T, bias_V=torch.zeros(shape, requires_grad=True))


def _model(tied: bool) -> MoETransformer:
    cfg = load_config(SMALL[2:] + ["--moe.num_experts=4", f"--model.tie_embeddings={str(tied).lower()}"])
    model = MoETransformer(cfg)
    model.init_weights(0)
    return model


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_the_models_loss_and_gradients_equal_the_logits_path(tied, autocast, monkeypatch):
    monkeypatch.setattr(train.lm_loss, "chunk_rows", lambda V: 7)  # 51 tokens: 8 chunks, the last of 2
    model = _model(tied)
    V = model.cfg.model.vocab_size
    x_BS, y_BS = torch.randint(0, V, (3, 17)), torch.randint(0, V, (3, 17))
    results = []
    for chunked in (False, True):
        with _autocast(autocast):
            loss = model(x_BS, y_BS) if chunked else F.cross_entropy(model(x_BS).flatten(0, 1), y_BS.flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (ref, ref_grads), (ours, grads) = results
    # fp32: only the LM head's summation order differs; bf16 autocast: see DTYPES
    tol = 1e-5 if autocast is None else 1.6e-2
    assert abs(ours.item() - ref.item()) <= tol * ref.item()
    assert grads.keys() == ref_grads.keys() and ("lm_head.weight" in grads) != tied
    bad = {n: _rel_err(grads[n], g) for n, g in ref_grads.items() if not _rel_err(grads[n], g) <= tol}
    assert not bad, bad  # embed.weight included: tied, the head's gradient joins the lookup's


def _fsdp_paths(rank: int, world: int, tied: bool) -> dict:
    """One FSDP2 model (EP 2 over 2 ranks: the root's LM head and embedding sharded over both):
    model(x, y) against F.cross_entropy of model(x), each rank on its own batch: the loss and
    every reduced gradient, whole."""
    device = torch.device("cpu")
    dims = ParallelDims(world, 2).build_mesh(device.type)
    cfg = _config(Case("lm_loss", ep=2, tie_embeddings=tied), world, 2, BATCH, 1, device)
    model = MoETransformer(cfg, dispatcher=dims.dispatcher())
    model.init_weights(3)
    model = parallelize(model, cfg, dims, device)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    x_BS, y_BS = tokens[:, :-1], tokens[:, 1:]
    results = []
    for chunked in (False, True):
        loss = model(x_BS, y_BS) if chunked else F.cross_entropy(model(x_BS).flatten(0, 1), y_BS.flatten())
        loss.backward()
        reduce_gradients(model, dims)
        results.append((loss.detach(), {n: _full(p.grad) for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (ref, ref_grads), (ours, grads) = results
    return {"loss": _rel(ours, ref), **{n: _rel(grads[n], g) for n, g in ref_grads.items()}}


@pytest.mark.parametrize("tied", [True, False])
def test_under_fsdp2_the_unsharded_weight_gets_its_gradient(tied):
    for errors in run_distributed(_fsdp_paths, 2, tied, timeout_s=120.0):
        bad = {n: e for n, e in errors.items() if not e <= 2e-5}
        assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_realistic_size_matches_and_needs_a_fraction_of_the_memory(with_bias):
    T, D, V = 8192, 2048, 50304
    h_TD = torch.randn(T, D, device="cuda", requires_grad=True)  # fp32, as the final norm's output
    weight_VD = (torch.randn(V, D, device="cuda") / D**0.5).requires_grad_()  # fp32 master
    bias_V = (0.5 * torch.randn(V, device="cuda")).requires_grad_() if with_bias else None  # fp32 master
    inputs = (h_TD, weight_VD) + ((bias_V,) if with_bias else ())
    y_T = torch.randint(0, V, (T,), device="cuda")

    def run(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        grads = torch.autograd.grad(loss, inputs)
        torch.cuda.synchronize()
        return loss.detach(), grads, torch.cuda.max_memory_allocated() - base

    ref, ref_grads, ref_peak = run(lambda: F.cross_entropy(F.linear(h_TD, weight_VD, bias_V).float(), y_T))
    ours, grads, peak = run(lambda: linear_cross_entropy(h_TD, weight_VD, y_T, bias_V=bias_V))
    assert abs(ours.item() - ref.item()) <= 1e-4 * ref.item()
    assert len(grads) == len(inputs)
    for g, r in zip(grads, ref_grads):  # h, weight and, with_bias, the bias
        assert ((g - r).norm() / r.norm()).item() < 1e-2
    # the reference holds (T, V) fp32 tensors (1.6 GB each) at once; ours a chunk and the weight's
    # fp32 gradient: about 1.1 GB against about 5 GB
    assert peak < ref_peak / 3, (peak / 2**30, ref_peak / 2**30)
