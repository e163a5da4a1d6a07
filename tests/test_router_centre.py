"""``moe.router_centre="causal"``: a token's router logits minus the mean of the logits of the
earlier tokens of its sequence, checked against routing the centred *input* (the definition;
fp64, a loop over positions), for exact invariance to a component common to a sequence, for
causality and sequence independence, and for the errors that name the option.
"""

import pytest
import torch

from moe import MoELayer, Router


def _reference_logits(x_BSD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """(B·S, E) fp64: the router on ``x_t − mean(x_0 … x_{t−1})`` (``x_0`` as is), per sequence."""
    rows = []
    for seq in x_BSD.double():
        for t in range(seq.shape[0]):
            centred = seq[t] - seq[:t].mean(0) if t else seq[t]
            rows.append(centred @ weight_ED.double().T)
    return torch.stack(rows)


def _router(D=12, E=8, K=3, seed=0, **kw) -> Router:
    torch.manual_seed(seed)
    router = Router(D, E, K, centre="causal", **kw)
    router.reset_parameters(std=0.5)
    return router


@pytest.mark.parametrize("B,S", [(1, 1), (1, 7), (3, 5), (2, 16)])
def test_logits_scores_and_gradients_match_the_centred_input(B, S):
    router = _router(seed=B * 100 + S)
    x_BSD = torch.randn(B, S, 12, dtype=torch.float32, requires_grad=True)
    out = router(x_BSD.reshape(B * S, 12), seq_len=S)
    x_ref = x_BSD.detach().clone().requires_grad_(True)
    w_ref = router.weight.detach().clone().requires_grad_(True)
    ref_TE = _reference_logits(x_ref, w_ref)
    torch.testing.assert_close(out.logits_TE, ref_TE.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.scores_TE, ref_TE.softmax(-1).float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.experts_TK, ref_TE.float().topk(3, dim=-1).indices)
    g_TK = torch.randn(out.weights_TK.shape, dtype=torch.float64)
    (out.weights_TK.double() * g_TK).sum().backward()
    ref_w_TK = ref_TE.softmax(-1).gather(1, out.experts_TK)
    (ref_w_TK / ref_w_TK.sum(-1, keepdim=True) * g_TK).sum().backward()
    torch.testing.assert_close(x_BSD.grad, x_ref.grad.float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(router.weight.grad, w_ref.grad.float(), rtol=1e-4, atol=1e-6)


def test_a_component_common_to_a_sequence_changes_no_route_but_the_first():
    """``x_t + c`` routes exactly as ``x_t`` for every t ≥ 1 (c cancels in ``x_t − mean x_<t``),
    while the plain router sends the shifted tokens to the experts c favours."""
    torch.manual_seed(1)
    B, S, D, E, K = 2, 64, 16, 16, 2
    centred, plain = _router(D, E, K, seed=1), Router(D, E, K)
    plain.weight.data.copy_(centred.weight.data)
    x_BSD = torch.randn(B, S, D)
    c_B1D = 20 * torch.randn(B, 1, D)  # one large vector per sequence, 20× a token's own
    routes = [r(v.reshape(-1, D), seq_len=S).experts_TK.view(B, S, K)
              for r in (centred, plain) for v in (x_BSD, x_BSD + c_B1D)]
    assert torch.equal(routes[0][:, 1:], routes[1][:, 1:])
    load_E = torch.bincount(routes[3].flatten(), minlength=E).float()
    assert load_E.max() / load_E.mean() > 3  # the plain router: most tokens on the same experts
    load_E = torch.bincount(routes[1].flatten(), minlength=E).float()
    assert load_E.max() / load_E.mean() < 3


def test_causal_and_per_sequence():
    """A token's route depends on its own sequence's tokens up to itself only."""
    router = _router(seed=2)
    x_BSD = torch.randn(3, 10, 12)
    later, other = x_BSD.clone(), x_BSD.clone()
    later[0, 6:] = torch.randn(4, 12)  # sequence 0 after position 5
    other[1] = torch.randn(10, 12)     # all of sequence 1
    base, a, b = (router(v.reshape(30, 12), seq_len=10).logits_TE.view(3, 10, -1) for v in (x_BSD, later, other))
    assert torch.equal(a[0, :6], base[0, :6]) and not torch.allclose(a[0, 6:], base[0, 6:])
    assert torch.equal(a[1:], base[1:])
    assert torch.equal(b[[0, 2]], base[[0, 2]])


def test_layer_centres_over_its_input_sequences():
    """The layer passes its input's S: the route inside a (B, S, D) forward is the router's on
    (B·S, D) with seq_len=S, and its logits are the plain ones centred per sequence."""
    torch.manual_seed(3)
    layer = MoELayer(12, 10, 8, 2, router_centre="causal")
    seen = []
    layer.router.register_forward_hook(lambda mod, args, out: seen.append(out))
    x_BSD = torch.randn(2, 9, 12)
    layer(x_BSD)
    want = layer.router(x_BSD.reshape(18, 12), seq_len=9)
    assert torch.equal(seen[0].experts_TK, want.experts_TK) and torch.equal(seen[0].weights_TK, want.weights_TK)
    plain_BSE = (x_BSD @ layer.router.weight.T).double()
    prefix_BSE = torch.stack([plain_BSE[:, :t].mean(1) if t else torch.zeros(2, 8, dtype=torch.float64)
                              for t in range(9)], 1)
    torch.testing.assert_close(seen[0].logits_TE, (plain_BSE - prefix_BSE).reshape(18, 8).float(), rtol=1e-5, atol=1e-5)


def test_errors_name_the_option():
    with pytest.raises(ValueError, match=r"^centre must be one of \('none', 'causal'\), got 'batch'"):
        Router(4, 8, 2, centre="batch")
    with pytest.raises(ValueError, match=r"^MoELayer: router_centre must be one of"):
        MoELayer(4, 6, 8, 2, router_centre="yes")
    with pytest.raises(ValueError, match=r"^MoELayer with router_centre='causal' centres over each sequence: x must be "
                                         r"\(\.\.\., S, D\), got shape \(6, 4\)"):
        MoELayer(4, 6, 8, 2, router_centre="causal")(torch.randn(6, 4))
    router = _router(D=4)
    for seq_len in (None, 4, 0):
        with pytest.raises(ValueError, match=rf"needs the tokens as whole sequences: seq_len={seq_len}"):
            router(torch.randn(6, 4), seq_len=seq_len)
