"""The router's fused tail (moe/kernels/router_topk.py) against its PyTorch ops in fp64.

On CPU the kernels run under the interpreter (token blocks of 256 / next_pow2(E) rows, so the
cases walk several blocks with a ragged tail); on a GPU the same tests run compiled, plus the
router's dispatch to them and a model-sized case.
"""

import pytest
import torch

from moe import Router
from moe.kernels.router_topk import MAX_EXPERTS, MAX_TOP_K, router_topk, router_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _outputs_and_grads(fn, logits, bias, K, sigmoid, renorm, scale, grads, broadcast):
    x = logits.detach().clone().requires_grad_()
    scores, experts, priority, weights, lse, entropy = fn(x, bias, K, sigmoid, renorm, scale)
    g_scores, g_priority, g_weights, g_lse = (g.to(x.dtype) for g in grads)
    # the load-balancing loss reads scores.sum(0): its gradient reaches the kernel as a broadcast
    s_term = (scores.sum(0) * g_scores[0]).sum() if broadcast else (scores * g_scores).sum()
    loss = s_term + (priority * g_priority).sum() + (weights * g_weights).sum() + (lse * g_lse).sum()
    (dx,) = torch.autograd.grad(loss, x)
    return (scores, experts, priority, weights, lse, entropy), dx


def _check(T, E, K, sigmoid, bias, renorm, scale, broadcast=False):
    logits = 2.0 * torch.randn(T, E, device=DEVICE)
    bias_E = 0.5 * torch.randn(E, device=DEVICE) if bias else None
    grads = [torch.randn(T, E, device=DEVICE), torch.randn(T, K, device=DEVICE),
             torch.randn(T, K, device=DEVICE), torch.randn(T, device=DEVICE)]
    out, dx = _outputs_and_grads(router_topk, logits, bias_E, K, sigmoid, renorm, scale, grads, broadcast)
    ref, dx64 = _outputs_and_grads(router_topk_reference, logits.double(), None if bias_E is None else bias_E.double(),
                                   K, sigmoid, renorm, scale, grads, broadcast)
    assert out[1].dtype == torch.int64 and out[1].shape == (T, K)
    assert torch.equal(out[1], ref[1]), "a different expert choice"
    for name, a, b in zip(("scores", "priority", "weights", "lse", "entropy"), (out[0], *out[2:]), (ref[0], *ref[2:])):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=name)
    row_l1 = dx64.abs().sum().item() / max(1, T)  # the gradient's scale: its mean row L1 norm
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-5 * (1 + row_l1))


# one expert, K = E, ragged token blocks, E not a power of two (also past 128), top-8 of 64
@pytest.mark.parametrize("T,E,K", [(0, 8, 2), (1, 1, 1), (7, 5, 2), (5, 8, 8), (33, 64, 8), (19, 129, 8)])
@pytest.mark.parametrize("sigmoid", [False, True])
def test_matches_reference(T, E, K, sigmoid):
    _check(T, E, K, sigmoid, bias=False, renorm=True, scale=1.0)
    _check(T, E, K, sigmoid, bias=True, renorm=True, scale=1.0)


@pytest.mark.parametrize("renorm,scale", [(False, 1.0), (True, 2.5), (False, 0.5)])
@pytest.mark.parametrize("broadcast", [False, True])
def test_weights_options_and_broadcast_gradient(renorm, scale, broadcast):
    _check(40, 16, 4, False, bias=True, renorm=renorm, scale=scale, broadcast=broadcast)
    _check(40, 16, 4, True, bias=False, renorm=renorm, scale=scale, broadcast=broadcast)


def test_only_some_outputs_have_gradients():
    x = torch.randn(20, 12, device=DEVICE, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    for fn, inp in ((router_topk, x), (router_topk_reference, x64)):
        scores, _, _, weights, _, _ = fn(inp, None, 3, False, True, 1.0)
        (weights.square().sum() + scores[:, 0].sum()).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)


def test_ties_pick_the_lowest_experts_and_stay_distinct():
    E, K = 10, 4
    logits = torch.zeros(3, E, device=DEVICE)
    logits[1] = float("-inf")
    logits[2] = float("nan")
    _, experts, _, _, _, _ = router_topk(logits, None, K, False, True, 1.0)
    assert experts[0].tolist() == [0, 1, 2, 3]
    for row in experts[1:].tolist():  # no expert twice, every one in range, even with no ranking
        assert len(set(row)) == K and all(0 <= e < E for e in row)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="logits_TE must be 2-D fp32"):
        router_topk(torch.zeros(4, 8, dtype=torch.float64), None, 2, False, True, 1.0)
    with pytest.raises(ValueError, match="top_k <= E"):
        router_topk(torch.zeros(4, 8), None, 9, False, True, 1.0)
    with pytest.raises(ValueError, match=f"top_k <= {MAX_TOP_K}"):
        router_topk(torch.zeros(4, 64), None, MAX_TOP_K + 1, False, True, 1.0)
    with pytest.raises(ValueError, match=f"E <= {MAX_EXPERTS}"):
        router_topk(torch.zeros(1, MAX_EXPERTS + 1), None, 2, False, True, 1.0)
    with pytest.raises(ValueError, match=r"bias_E must be \(8,\) fp32"):
        router_topk(torch.zeros(4, 8), torch.zeros(7), 2, False, True, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_runs_the_kernel_on_cuda_and_matches_the_ops(score_func):
    torch.manual_seed(1)
    router = Router(256, 64, 8, score_func=score_func, expert_bias=True, device="cuda")
    router.expert_bias.normal_(std=0.1)
    x = torch.randn(4096, 256, device="cuda")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = router(x)
    assert out.lse_T.grad_fn is not None and "RouterTopKFn" in type(out.weights_TK.grad_fn).__name__
    ref = router_topk_reference(out.logits_TE.detach(), router.expert_bias, 8, score_func == "sigmoid", True, 1.0)
    assert torch.equal(out.experts_TK, ref[1])
    torch.testing.assert_close(out.weights_TK, ref[3], rtol=1e-5, atol=1e-6)
    _check(16384, 64, 8, score_func == "sigmoid", bias=True, renorm=True, scale=1.0, broadcast=True)
