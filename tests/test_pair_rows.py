"""parallel.pair_rows: the Triton scatter/gather of pair rows against the PyTorch reference.

On CPU the kernels run in Triton's interpreter (fp32/fp16), on a GPU compiled (bf16 too).
Routing is random: pairs sorted by destination rank and expert, some dropped; cases include a
rank with no own rows, a rank sending nothing away, every pair dropped, and one token.
"""

import pytest
import torch

from parallel.pair_rows import (
    gather_pairs_sum, gather_pairs_sum_reference, locate_reference, scatter_pairs, scatter_pairs_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# rows are copied or summed over at most K = 3 terms in fp32, then rounded once to the dtype
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _route(T, K, G, L, me, drop=0.25, to=None, seed=0):
    """(pos_TK, ends_G): send positions of a random routing (kept pairs by expert, dropped last)."""
    gen = torch.Generator().manual_seed(seed)
    expert_P = torch.randint(0, G * L, (T * K,), generator=gen) if to is None else torch.full((T * K,), to)
    kept_P = torch.rand(T * K, generator=gen) >= drop
    key = torch.where(kept_P, expert_P, G * L)
    order = torch.sort(key, stable=True).indices
    pos = torch.empty_like(order)
    pos[order] = torch.arange(T * K)
    per_rank = torch.bincount(expert_P[kept_P] // L, minlength=G)
    return pos.view(T, K).to(DEVICE), per_rank.cumsum(0).to(DEVICE)


CASES = [  # T, K, G, L, me, kwargs
    (37, 2, 2, 3, 0, {}),
    (37, 3, 3, 2, 1, {}),
    (29, 1, 4, 1, 3, {"drop": 0.0}),
    (16, 2, 2, 2, 1, {"to": 0}),       # every pair to rank 0: rank 1 has no own rows
    (16, 2, 2, 2, 0, {"to": 1, "drop": 0.0}),  # ... and rank 0 keeps none, sends all
    (16, 2, 2, 2, 0, {"to": 0}),       # rank 0 sends nothing away
    (12, 2, 3, 2, 2, {"drop": 1.0}),   # every pair dropped
    (1, 3, 2, 2, 1, {}),
]


def _buffers(pos_TK, ends_G, me):
    is_local, is_remote, *_ = locate_reference(pos_TK, ends_G, me)
    return int(is_local.sum()), int(is_remote.sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,G,L,me,kw", CASES)
def test_scatter_pairs_matches_reference(T, K, G, L, me, kw, dtype):
    D = 70  # not a multiple of the interpreter's 64-column block
    pos_TK, ends_G = _route(T, K, G, L, me, **kw)
    n_local, n_remote = _buffers(pos_TK, ends_G, me)
    x_TD = torch.randn(T, D, device=DEVICE).to(dtype)
    w_TK = torch.rand(T, K, device=DEVICE)
    for local, rows in ((True, n_local), (False, n_remote + 5)):  # a remote buffer may be larger
        y_ND = torch.randn(rows, D, device=DEVICE).to(dtype)
        for with_w in (False, True):
            w = w_TK if with_w else None
            got, want = (torch.full((rows, D), 7.0, device=DEVICE, dtype=dtype) for _ in range(2))
            dw_got, dw_want = (torch.full((T, K), -3.0, device=DEVICE) for _ in range(2))
            scatter_pairs(x_TD, pos_TK, ends_G, me, got, local, w, y_ND, dw_got, backend="triton")
            scatter_pairs_reference(x_TD, pos_TK, ends_G, me, want, local, w, y_ND, dw_want)
            torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
            torch.testing.assert_close(dw_got, dw_want, rtol=1e-3, atol=1e-3)
        written = (got != 7.0).any(-1).sum().item()
        assert written <= (n_local if local else n_remote)
    # the two passes write every dw entry once (dropped pairs: 0, by the remote pass)
    dw_TK = torch.full((T, K), float("nan"), device=DEVICE)
    for local, rows in ((True, n_local), (False, n_remote)):
        scatter_pairs(x_TD, pos_TK, ends_G, me, torch.empty(rows, D, device=DEVICE, dtype=dtype), local, w_TK,
                      torch.randn(rows, D, device=DEVICE).to(dtype), dw_TK, backend="triton")
    assert not dw_TK.isnan().any()
    assert (dw_TK[pos_TK >= ends_G[-1]] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,G,L,me,kw", CASES)
def test_gather_pairs_sum_matches_reference(T, K, G, L, me, kw, dtype):
    D = 70
    pos_TK, ends_G = _route(T, K, G, L, me, **kw)
    n_local, n_remote = _buffers(pos_TK, ends_G, me)
    remote_ND = torch.randn(n_remote, D, device=DEVICE).to(dtype)
    local_ND = torch.randn(n_local, D, device=DEVICE).to(dtype)
    w_TK = torch.rand(T, K, device=DEVICE)
    for w in (None, w_TK):
        got = gather_pairs_sum(remote_ND, local_ND, pos_TK, ends_G, me, w, torch.float32, backend="triton")
        want = gather_pairs_sum_reference(remote_ND, local_ND, pos_TK, ends_G, me, w, torch.float32)
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_scatter_then_gather_is_the_weighted_sum_of_each_token_over_its_kept_pairs():
    """Round trip through both buffers: independent of the reference's own locate logic."""
    T, K, G, L, me, D = 23, 3, 3, 2, 1, 40
    pos_TK, ends_G = _route(T, K, G, L, me, seed=3)
    n_local, n_remote = _buffers(pos_TK, ends_G, me)
    x_TD = torch.randn(T, D, device=DEVICE)
    w_TK = torch.rand(T, K, device=DEVICE)
    local_ND = torch.empty(n_local, D, device=DEVICE)
    remote_ND = torch.empty(n_remote, D, device=DEVICE)
    scatter_pairs(x_TD, pos_TK, ends_G, me, local_ND, True, backend="triton")
    scatter_pairs(x_TD, pos_TK, ends_G, me, remote_ND, False, backend="triton")
    got = gather_pairs_sum(remote_ND, local_ND, pos_TK, ends_G, me, w_TK, backend="triton")
    kept_TK = pos_TK < ends_G[-1]
    torch.testing.assert_close(got, x_TD * (w_TK * kept_TK).sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)
    assert 0 < n_local < kept_TK.sum() and n_local + n_remote == kept_TK.sum()


def test_bad_arguments_name_the_field():
    pos_TK, ends_G = _route(4, 2, 2, 2, 0)
    x_TD = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="pos_TK"):
        scatter_pairs(x_TD, pos_TK.int(), ends_G, 0, torch.empty(8, 8, device=DEVICE), True)
    with pytest.raises(ValueError, match="me=2"):
        scatter_pairs(x_TD, pos_TK, ends_G, 2, torch.empty(8, 8, device=DEVICE), True)
    with pytest.raises(ValueError, match="w_TK"):
        gather_pairs_sum(x_TD, x_TD, pos_TK, ends_G, 0, torch.ones(4, 3, device=DEVICE))
    with pytest.raises(ValueError, match="y_MD and dw_TK"):
        scatter_pairs(x_TD, pos_TK, ends_G, 0, torch.empty(8, 8, device=DEVICE), True, y_MD=x_TD)
