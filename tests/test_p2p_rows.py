"""Peer-store kernels (parallel/p2p_rows.py) and the P2P dispatcher's routes, in one process:
G "ranks" are G local buffers whose addresses form the pointer table, as symmetric memory gives
them, and every rank's phase runs before the next phase (so every wait is already satisfied; the
flags' counts are checked). The counts go out in the same kernel that reads everybody's, so the
dispatch runs twice: the first pass (waiting for nothing) completes the count matrices, the
second routes by them (waiting for the first pass's signals: on a GPU the waits are real). On CPU the kernels run in Triton's interpreter (fp32/fp16); the 2-GPU
run of the whole dispatcher is in tests/test_parallel.py.
"""

import os
import subprocess
import sys

import pytest
import torch

from moe.capacity import plan_routing
from parallel.p2p_rows import (
    UNMET, dispatch_rows, expand_rows, expand_rows_reference, p2p_routes_reference, pair_values, push_back, push_back_reference, push_rows, return_table,
    signal_peers, sum_returned, sum_returned_reference,
)
from parallel.token_rows import gather_slots
from tests.peers import G, buffer_ptrs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]

# (tokens per rank, experts, top-k, capacity, routing): G = 3 ranks
CASES = {
    "dropless": ((7, 5, 9), 6, 2, None, "random"),
    "capacity": ((8, 8, 8), 6, 3, 3, "random"),
    "zero_token_rank": ((6, 0, 4), 6, 2, None, "random"),
    "all_to_one_expert": ((5, 4, 3), 6, 1, None, "one_expert"),
    "one_token": ((1, 1, 1), 3, 2, None, "random"),
}
TIMEOUT_MS = 20_000  # a wrong target traps after this on a GPU instead of hanging the test run



def _flags(n=G):
    return [torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(n)]


def _plans(case, seed=0):
    tokens, E, K, capacity, routing = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    plans, experts = [], []
    for T in tokens:
        if routing == "one_expert":
            e = torch.zeros(T, K, dtype=torch.int64)
        else:
            e = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
        priority = torch.rand(T, K, generator=gen)
        plans.append(plan_routing(e.to(DEVICE), priority.to(DEVICE), E, capacity))
        experts.append(e)
    return plans, experts


def _copy_blocks(bufs, me, T_cap, rows=None, blocks=None):
    """The dispatcher's copy-engine moves (parallel.p2p_dispatcher._send_rows, _send_blocks)
    between the local buffers standing for the ranks' regions."""
    from parallel.p2p_dispatcher import _send_blocks, _send_rows

    class Regions:
        def peer_views(self, name):
            return bufs

    if blocks is None:
        _send_rows(rows, Regions(), "rows", me, T_cap)
    else:
        _send_blocks(blocks, Regions(), "rows", me, T_cap)


@pytest.mark.parametrize("engine", [False, True], ids=["kernels", "copy_engine"])
@pytest.mark.parametrize("case", list(CASES))
def test_dispatcher_data_flow_in_one_process(case, engine):
    """The P2P dispatcher's passes over G local buffers: counts, routes and rows lay every
    receiver's rows out expert-major (by local expert, then source rank, then token), with
    offsets its experts' row ends, src where each row came from and w each row's combine weight;
    then experts that weight their rows (y = w · (2·x + 1) on the valid rows, garbage on the
    padding), the way home and the sum give Σ_k w · (2·x + 1); and the backward passes (experts
    y = w · x) give dx = Σ_k w · g and dw = <g, x> per kept pair, 0 per dropped one. ``engine``:
    the copy-engine mode, the token rows moved as whole blocks between the kernels (no kernel
    stores one) and the way back signalled by :func:`signal_peers`."""
    tokens, E, K, _, _ = CASES[case]
    L, D, P_cap = E // G, 8, max(tokens) * K
    R_cap = G * P_cap
    plans, experts = _plans(case)
    T_cap = max(tokens)

    def own(r, rows):  # the copy engines' mode reads rank r's own block of rows where it is
        return (rows[r], r * T_cap) if engine else ()

    xs = [torch.randn(T, D, device=DEVICE) for T in tokens]
    ws = [torch.rand(T, K, device=DEVICE) * p.kept_TK for T, p in zip(tokens, plans)]
    # zeros, not garbage: the first pass routes by a partial count matrix (within bounds)
    counts = [torch.zeros((G, E), dtype=torch.int64, device=DEVICE) for _ in range(G)]
    counts_flags = _flags()
    # the first pass waits for nothing: its target (state + G) is 0; the second for the first's signals
    states = [torch.tensor([-G], device=DEVICE) for _ in range(G)]
    toks = [torch.full((G * T_cap, D), float("nan"), device=DEVICE) for _ in range(G)]  # token rows
    tok_of = [torch.full((R_cap,), -1, dtype=torch.int64, device=DEVICE) for _ in range(G)]
    src = [torch.full((R_cap,), -1, dtype=torch.int64, device=DEVICE) for _ in range(G)]
    w_recv = [torch.full((R_cap,), float("nan"), device=DEVICE) for _ in range(G)]
    leads = [torch.full((T_cap * G,), 7, dtype=torch.int32, device=DEVICE) for _ in range(G)]  # zeroed by the call
    for rounds in (1, 2):
        routes = []
        for r in range(G):
            routes.append(dispatch_rows(
                xs[r], ws[r], plans[r].order_P, plans[r].kept_per_expert_E, buffer_ptrs(counts), buffer_ptrs(counts_flags),
                states[r], counts[r], counts_flags[r], buffer_ptrs(toks), buffer_ptrs(src), buffer_ptrs(w_recv),
                torch.float32, r, K, P_cap, R_cap, buffer_ptrs(tok_of), leads[r], timeout_ms=TIMEOUT_MS,
                store_rows=not engine))
        if engine:
            if rounds == 1:
                assert all(bool(t.isnan().all()) for t in toks)  # no kernel stored a row
            for r in range(G):
                _copy_blocks(toks, r, T_cap, rows=xs[r])
            # the own block is not copied: each rank reads it from its x
            assert all(bool(toks[r][r * T_cap:(r + 1) * T_cap].isnan().all()) for r in range(G))
        assert [int(f) for f in counts_flags] == [rounds * G] * G
        # each call advanced its target by G
        assert [s.tolist() for s in states] == [[(rounds - 1) * G]] * G
    for r in range(G):
        assert torch.equal(counts[r], torch.stack([p.kept_per_expert_E for p in plans]))
    n_rows = []
    for d in range(G):
        expected, origin, weight, ends = [], [], [], []
        for l in range(L):
            for s in range(G):
                kept = plans[s].kept_TK
                for t in range(tokens[s]):
                    for k in range(K):
                        if experts[s][t, k] == d * L + l and kept[t, k]:
                            expected.append(xs[s][t])
                            origin.append(s * P_cap + t * K + k)
                            weight.append(float(ws[s][t, k]))
            ends.append(len(expected))
        R = len(expected)
        n_rows.append(R)
        assert routes[d][2].tolist() == ends
        assert src[d][:R].tolist() == origin
        assert w_recv[d][:R].tolist() == weight
        assert tok_of[d][:R].tolist() == [o // P_cap * T_cap + o % P_cap // K for o in origin]
        if R:
            torch.testing.assert_close(expand_rows(toks[d], tok_of[d], routes[d][2][-1:], *own(d, xs))[:R],
                                       torch.stack(expected))
    # each token's row crossed to each rank once: one pair of each (token, rank) stored it (none,
    # under the copy engines)
    for r in range(G):
        if engine:
            assert (routes[r][3] == -1).all()
            continue
        kept, tokrow, dest = plans[r].kept_TK, routes[r][3], routes[r][1]
        for t in range(tokens[r]):
            for d in range(G):
                ks = [k for k in range(K) if kept[t, k] and int(dest[t, k]) == d]
                stored = [k for k in ks if int(tokrow[t, k]) >= 0]
                assert len(stored) == min(len(ks), 1) and all(int(tokrow[t, k]) == r * T_cap + t for k in stored)
        assert (tokrow[~kept] == -1).all()
    # the experts' pair rows, copied from the token rows; padding rows NaN: nothing may read them
    recv = []
    for d in range(G):
        rows = expand_rows(toks[d], tok_of[d], routes[d][2][-1:], *own(d, xs))
        rows[n_rows[d]:] = float("nan")
        torch.testing.assert_close(rows[:n_rows[d]],
                                   expand_rows_reference(toks[d], tok_of[d], routes[d][2][-1:], *own(d, xs))[:n_rows[d]])
        recv.append(rows)

    # The way back: each receiver sums a (source, token)'s rows and stores one row into the
    # source's return buffer (its own sources' into its own), the weights' gradients per pair;
    # the source sums its G rows of each token
    m = torch.arange(G * T_cap, device=DEVICE)
    rows_TG = (torch.arange(G, device=DEVICE)[None, :] * T_cap + torch.arange(T_cap, device=DEVICE)[:, None]).contiguous()
    n_M = torch.tensor([G * T_cap], device=DEVICE)

    def home(r, y_RD, g_R=None):  # what the dispatcher's _home_and_sum sends
        table = return_table(src[r], routes[r][2][-1:], G, T_cap, K)
        sums = gather_slots(y_RD, table, out_dtype=torch.float32)
        if engine:
            own_sums[r] = sums  # the final sum reads this rank's own block here
            _copy_blocks(ret, r, T_cap, blocks=sums)
            sent = signal_peers(buffer_ptrs(back_flags), expected[r], r)
        else:
            src_M = torch.where((table >= 0).any(1), (m // T_cap) * (G * T_cap) + r * T_cap + m % T_cap, -1)
            sent = push_back(sums, src_M, n_M, buffer_ptrs(ret), torch.float32, r, G * T_cap, buffer_ptrs(back_flags),
                             expected[r], own_too=True)
        if g_R is not None:
            sent += push_back(None, src[r], routes[r][2][-1:], buffer_ptrs(ret), torch.float32, r, P_cap,
                              buffer_ptrs(back_flags), expected[r], g_R, buffer_ptrs(ret_g), num_rows=R_cap)
        return sent

    ys = [w[:, None] * (2 * b + 1) for b, w in zip(recv, w_recv)]
    own_sums = [None] * G
    ret = [torch.full((G * T_cap, D), float("nan"), device=DEVICE) for _ in range(G)]
    ret_g = [torch.full((P_cap,), float("nan"), device=DEVICE) for _ in range(G)]
    back_flags, expected = _flags(), _flags()
    signals = [home(r, ys[r]) for r in range(G)]
    assert len(set(signals)) == 1 and [int(f) for f in back_flags] == [(G - 1) * signals[0]] * G
    assert [int(e) for e in expected] == [int(f) for f in back_flags]  # each rank's target: its flag's value
    gs = [torch.randn(T, D, device=DEVICE) for T in tokens]
    grad_toks = [torch.full((G * T_cap, D), float("nan"), device=DEVICE) for _ in range(G)]

    def returned(r):  # the rows of token t from the ranks holding a kept pair of it (unsent rows stay NaN)
        T = tokens[r]
        has = torch.zeros((T, G + 1), dtype=torch.bool, device=DEVICE)
        has.scatter_(1, torch.where(routes[r][0] >= 0, routes[r][1], G), True)
        return torch.where(has[:, :G], rows_TG[:T], -1)

    def mine(r):  # the copy engines' mode: rank r's own sums read where they are
        return {"own_MD": own_sums[r], "me": r} if engine else {}

    for r in range(G):
        if engine:  # nobody copied rank r's own sums into its return buffer
            assert bool(ret[r][r * T_cap:(r + 1) * T_cap].isnan().all())
        out = sum_returned(ret[r], returned(r), torch.float32, back_flags[r], expected[r], TIMEOUT_MS, **mine(r))
        torch.testing.assert_close(out, (2 * xs[r] + 1) * ws[r].sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, sum_returned_reference(ret[r], returned(r), torch.float32, **mine(r)))
        if engine:
            _copy_blocks(grad_toks, r, T_cap, rows=gs[r])
        else:
            push_rows(gs[r], routes[r][3], routes[r][1], buffer_ptrs(grad_toks), torch.float32, me=r)
    grad_rows = [expand_rows(grad_toks[d], tok_of[d], routes[d][2][-1:], *own(d, gs)) for d in range(G)]
    for d in range(G):
        grad_rows[d][n_rows[d]:] = float("nan")
    # experts y = w · x: d rows = w · dy, dw = <dy, x>, on the valid rows (the padding's NaN stays)
    d_rows = [w[:, None] * g for g, w in zip(grad_rows, w_recv)]
    dw_R = [(g * b).sum(-1) for g, b in zip(grad_rows, recv)]
    back = [home(r, d_rows[r], dw_R[r]) for r in range(G)]
    assert len(set(back)) == 1
    assert [int(e) for e in expected] == [int(f) for f in back_flags] == [(G - 1) * (signals[0] + back[0])] * G
    for r in range(G):
        dx = sum_returned(ret[r], returned(r), torch.float32, back_flags[r], expected[r], TIMEOUT_MS, **mine(r))
        dw = pair_values(routes[r][0], routes[r][1], dw_R[r], ret_g[r], r)
        torch.testing.assert_close(dx, gs[r] * ws[r].sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw, torch.where(plans[r].kept_TK, (gs[r] * xs[r]).sum(-1, keepdim=True), 0.0),
                                   rtol=1e-5, atol=1e-5)


def test_signal_peers_signals_every_other_rank_once_and_advances_the_target():
    flags, expects = _flags(), _flags()
    for me in range(G):
        assert signal_peers(buffer_ptrs(flags), expects[me], me) == 1
    assert [int(f) for f in flags] == [G - 1] * G  # each rank signalled by the G - 1 others
    assert [int(e) for e in expects] == [G - 1] * G
    with pytest.raises(ValueError, match="me=3 is not a rank of the 3 flags"):
        signal_peers(buffer_ptrs(flags), expects[0], G)


def _routes(order, counts, me, K):
    """dispatch_rows' routes for a count matrix, its rows moved into scratch buffers (D = 1); its
    own counts row goes to a scratch matrix."""
    G_, E = counts.shape
    T = order.numel() // K
    rows = max(int(counts.sum()), 1)
    recv = [torch.zeros(G_ * T, 1, device=DEVICE) for _ in range(G_)]  # token rows
    src, tok = ([torch.zeros(rows, dtype=torch.int64, device=DEVICE) for _ in range(G_)] for _ in range(2))
    w = [torch.zeros(rows, device=DEVICE) for _ in range(G_)]
    scratch = [torch.zeros(G_, E, dtype=torch.int64, device=DEVICE) for _ in range(G_)]
    flags = _flags(G_)
    # one call signals each flag once: its own flag's target is 1 = state + G_
    state = torch.tensor([1 - G_], device=DEVICE)
    return dispatch_rows(torch.zeros(T, 1, device=DEVICE), torch.zeros(T, K, device=DEVICE), order.to(DEVICE),
                         counts[me].to(DEVICE), buffer_ptrs(scratch), buffer_ptrs(flags), state, counts.to(DEVICE),
                         flags[me], buffer_ptrs(recv), buffer_ptrs(src), buffer_ptrs(w), torch.float32, me, K, T * K, rows,
                         buffer_ptrs(tok), torch.zeros(T * G_, dtype=torch.int32, device=DEVICE), timeout_ms=TIMEOUT_MS)


@pytest.mark.parametrize("G_, E, K", [(2, 8, 2), (3, 6, 3), (4, 12, 1), (5, 5, 2), (8, 64, 8)])
def test_routes_match_the_reference(G_, E, K):
    """Random count matrices (zero rows and columns included, L not a power of two) and
    plans with dropped pairs: rows, destinations and segment ends as the plain loops say."""
    gen = torch.Generator().manual_seed(G_ * 100 + E)
    for me in range(G_):
        T = 11
        experts = torch.randint(0, E, (T * K,), generator=gen)
        kept = torch.rand(T * K, generator=gen) < 0.8
        if me == 1:
            kept[:] = False
        key = torch.where(kept, experts, E)
        order = torch.argsort(key, stable=True)
        counts = torch.randint(0, 9, (G_, E), generator=gen)
        counts[G_ - 1] = 0
        counts[me] = torch.zeros(E, dtype=torch.int64).scatter_add_(0, experts[kept], torch.ones(int(kept.sum()), dtype=torch.int64))
        ref = p2p_routes_reference(order, counts, me, K)
        got = _routes(order, counts, me, K)
        for a, b in zip(got, ref):
            assert torch.equal(a.cpu(), b), (me, a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, K, D", [(9, 3, 70), (1, 1, 5), (0, 2, 16), (13, 8, 130)])
def test_push_back_matches_its_reference(T, K, D, dtype):
    """With and without the rows' weight gradients (g_R). (push_rows and sum_returned, the
    gather-sum family's P2P members: tests/test_gather_sum.py)"""
    rows, me, P_cap = T * K + 3, 1, T * K + 2
    y = torch.randn(rows, D, device=DEVICE).to(dtype)
    g = torch.randn(rows, device=DEVICE)
    src = torch.randperm(G * P_cap, device=DEVICE)[:rows]  # distinct places: the GPU stores in no set order
    src[1] = -1  # a row that stays
    n = torch.tensor([rows - 2], dtype=torch.int32, device=DEVICE)
    # rows and weights, rows only, weights only (y None); own rows kept or stored home too
    for with_y, with_g, own_too in ((True, False, False), (True, True, False), (True, False, True),
                                    (False, True, False)):
        rets = [torch.zeros(P_cap, D, device=DEVICE, dtype=dtype) for _ in range(G)]
        ret_gs = [torch.zeros(P_cap, device=DEVICE) for _ in range(G)]
        ref_rets, ref_gs = [r.clone() for r in rets], [r.clone() for r in ret_gs]
        flags, expected = _flags(), torch.full((1,), 5, dtype=torch.int64, device=DEVICE)
        signals = push_back(y if with_y else None, src, n, buffer_ptrs(rets), dtype, me, P_cap, buffer_ptrs(flags),
                            expected, *((g, buffer_ptrs(ret_gs)) if with_g else ()), own_too=own_too, num_rows=rows)
        push_back_reference(y if with_y else None, src, n, ref_rets, me, P_cap, *((g, ref_gs) if with_g else ()),
                            own_too=own_too)
        for a, b in zip(rets + ret_gs, ref_rets + ref_gs):
            assert torch.equal(a, b)
        assert [int(f) for f in flags] == [0 if g_ == me else signals for g_ in range(G)]
        assert int(expected) == 5 + (G - 1) * signals  # what the peers' matching calls send this rank
        if with_g and int(n) > 0:  # some weight gradient went to another rank
            assert any(bool((r != 0).any()) for r in ret_gs)
        # own rows: stored into this rank's own buffer only with own_too; nothing without rows
        mine = [int(src[r]) % P_cap for r in range(int(n)) if int(src[r]) // P_cap == me]
        if mine and D:
            assert bool((rets[me][mine] != 0).any()) == (own_too and with_y)
        if not with_y:
            assert all(not bool(r.any()) for r in rets)


def test_dispatch_sends_its_counts_row_to_every_rank_once():
    """The counts part of dispatch_rows: row ``me`` of every rank's matrix, one signal to every
    rank's flag per call, the target advanced by G."""
    E, K, T, me = 6, 2, 5, 1
    mats = [torch.zeros((G, E), dtype=torch.int64, device=DEVICE) for _ in range(G)]
    counts = torch.tensor([2, 0, 3, 1, 0, 4], dtype=torch.int64, device=DEVICE)  # T·K pairs, all kept
    # only this rank signals: call n waits for its own flag's n signals (target state + G)
    flags, state = _flags(), torch.tensor([1 - G], device=DEVICE)
    order = torch.arange(T * K, device=DEVICE)
    recv = [torch.zeros(T * K * G, 3, device=DEVICE) for _ in range(G)]
    src, tok = ([torch.zeros(T * K * G, dtype=torch.int64, device=DEVICE) for _ in range(G)] for _ in range(2))
    w = [torch.zeros(T * K * G, device=DEVICE) for _ in range(G)]
    lead = torch.zeros(T * G, dtype=torch.int32, device=DEVICE)
    for call in (1, 2):
        dispatch_rows(torch.zeros(T, 3, device=DEVICE), torch.zeros(T, K, device=DEVICE), order, counts, buffer_ptrs(mats),
                      buffer_ptrs(flags), state, mats[me], flags[me], buffer_ptrs(recv), buffer_ptrs(src), buffer_ptrs(w),
                      torch.float32, me, K, T * K, T * K * G, buffer_ptrs(tok), lead, timeout_ms=TIMEOUT_MS)
        for m in mats:
            assert torch.equal(m[me], counts) and (m[0] == 0).all() and (m[2] == 0).all()
        assert [int(f) for f in flags] == [call] * G
        assert state.tolist() == [call]  # the target advanced by G
        state[0] = call + 1 - G


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU an unmet wait times out and traps: the subprocess tests below")
def test_each_wait_is_for_its_own_target():
    """In the interpreter an unmet wait adds UNMET to its flag: the dispatch from a fresh state
    waits for every rank's counts (G signals, here only its own came), the next one for 2G; the
    way back's sum for exactly ``expect``."""
    E, K, T, me = 6, 2, 5, 1
    mats = [torch.zeros((G, E), dtype=torch.int64, device=DEVICE) for _ in range(G)]
    counts = torch.tensor([2, 0, 3, 1, 0, 4], dtype=torch.int64, device=DEVICE)
    flags, state = _flags(), torch.zeros(1, dtype=torch.int64, device=DEVICE)  # as every slot starts
    rows = T * K * G
    recv = [torch.zeros(rows, 3, device=DEVICE) for _ in range(G)]
    src, tok = ([torch.zeros(rows, dtype=torch.int64, device=DEVICE) for _ in range(G)] for _ in range(2))
    w = [torch.zeros(rows, device=DEVICE) for _ in range(G)]

    def dispatch():
        dispatch_rows(torch.zeros(T, 3, device=DEVICE), torch.zeros(T, K, device=DEVICE), torch.arange(T * K, device=DEVICE),
                      counts, buffer_ptrs(mats), buffer_ptrs(flags), state, mats[me], flags[me], buffer_ptrs(recv),
                      buffer_ptrs(src), buffer_ptrs(w), torch.float32, me, K, T * K, rows, buffer_ptrs(tok),
                      torch.zeros(T * G, dtype=torch.int32, device=DEVICE), timeout_ms=TIMEOUT_MS)

    dispatch()
    assert int(flags[me]) == 1 + UNMET  # waited for G signals, one came
    flags[me].fill_(2 * G - 1)  # every rank's counts of the next call in, but this rank's own
    dispatch()
    assert int(flags[me]) == 2 * G and state.tolist() == [2 * G]
    ret, rows_TG = torch.ones(4, 3, device=DEVICE), torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)
    for expect, after in ((5, 4 + UNMET), (4, 4)):
        flag = torch.full((1,), 4, dtype=torch.int64, device=DEVICE)
        sum_returned(ret, rows_TG, torch.float32, flag, torch.full((1,), expect, dtype=torch.int64, device=DEVICE))
        assert int(flag) == after, expect


def test_bad_arguments_raise():
    """(push_rows' and sum_returned's checks: tests/test_gather_sum.py)"""
    ptrs = buffer_ptrs([torch.zeros(10, 4, device=DEVICE)] * G)
    x = torch.randn(4, 4, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    state = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    counts = torch.zeros(G, 6, dtype=torch.int64, device=DEVICE)
    order = torch.arange(8, device=DEVICE)
    def dispatch(order_=order, counts_E=counts[0], counts_GE=counts, P_cap=8, w=torch.zeros(4, 2, device=DEVICE),
                 R_cap=10, lead=torch.zeros(4 * G, dtype=torch.int32, device=DEVICE)):
        return dispatch_rows(x, w, order_, counts_E, ptrs, ptrs, state, counts_GE, flag, ptrs, ptrs, ptrs,
                             torch.float32, 0, 2, P_cap, R_cap, ptrs, lead)
    with pytest.raises(ValueError, match="P_cap"):
        dispatch(P_cap=7)
    with pytest.raises(ValueError, match="order_P"):
        dispatch(order_=order[:7])
    with pytest.raises(ValueError, match="counts_GE"):
        dispatch(counts_GE=counts[:, :5])
    with pytest.raises(ValueError, match="counts_E"):
        dispatch(counts_E=counts[0].int())
    with pytest.raises(ValueError, match="w_TK"):
        dispatch(w=torch.zeros(4, 3, device=DEVICE))
    with pytest.raises(ValueError, match="R_cap"):
        dispatch(R_cap=0)
    with pytest.raises(ValueError, match="lead_TG"):
        dispatch(lead=torch.zeros(4 * G - 1, dtype=torch.int32, device=DEVICE))
    state = torch.zeros(3, dtype=torch.int64, device=DEVICE)  # three elements where one is needed
    with pytest.raises(ValueError, match="state must be a contiguous 1-element int64 tensor"):
        dispatch()
    with pytest.raises(ValueError, match="g_R"):
        push_back(x, torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int32), ptrs,
                  torch.float32, 0, 8, ptrs, flag, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="n_rows"):
        push_back(x, torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(2, dtype=torch.int32), ptrs,
                  torch.float32, 0, 8, ptrs, flag)
    with pytest.raises(ValueError, match="expect must be a contiguous 1-element int64"):
        push_back(x, torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int32), ptrs,
                  torch.float32, 0, 8, ptrs, flag.int())


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernel traps: the subprocess test below")
def test_dispatch_into_too_small_buffers_moves_nothing():
    """A count matrix giving a rank more rows than R_cap: no row, source, weight or offset is
    written anywhere, every pair's route is -1 (in the interpreter; a GPU also traps)."""
    T, K, E, D, R_cap = 4, 2, 2, 3, 5  # one rank keeps 8 pairs for its own experts: 8 rows, 5 fit
    counts = torch.zeros(1, E, dtype=torch.int64)
    flag, state = _flags(1)[0], torch.tensor([0])
    recv, src, w = torch.full((R_cap + 4, D), 7.0), torch.full((R_cap + 4,), -5), torch.full((R_cap + 4,), 7.0)
    tok = torch.full((R_cap + 4,), -5)
    route = dispatch_rows(torch.randn(T, D), torch.rand(T, K), torch.arange(T * K), torch.tensor([4, 4]),
                          buffer_ptrs([counts]), buffer_ptrs([flag]), state, counts, flag, buffer_ptrs([recv]),
                          buffer_ptrs([src]), buffer_ptrs([w]), torch.float32, 0, K, T * K, R_cap, buffer_ptrs([tok]),
                          torch.zeros(T, dtype=torch.int32),
                          out=(torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K, dtype=torch.int64),
                               torch.full((E,), -3, dtype=torch.int32), torch.zeros(T, K, dtype=torch.int64)))
    assert (route[0] == -1).all() and route[2].tolist() == [-3] * E and (route[3] == -1).all()
    assert (recv == 7.0).all() and (src == -5).all() and (w == 7.0).all() and (tok == -5).all()


_NEVER_SIGNALLED = """
import torch
from parallel.p2p_rows import sum_returned
rows = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
y = torch.ones(2, 4, device="cuda")
flag = torch.zeros(1, dtype=torch.int64, device="cuda")
sum_returned(y, rows, torch.float32, flag, torch.ones(1, dtype=torch.int64, device="cuda"), timeout_ms=500)
torch.cuda.synchronize()
"""


_COUNTS_NEVER_COME = """
import torch
from parallel.p2p_rows import dispatch_rows
ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device="cuda")
T, K, E, D = 4, 2, 4, 8  # 2 ranks, the peer never sends its counts: the flag stays at 1 of 2
x, w = torch.randn(T, D, device="cuda"), torch.rand(T, K, device="cuda")
counts = [torch.zeros(2, E, dtype=torch.int64, device="cuda") for _ in range(2)]
flags = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2)]
bufs = [[torch.zeros(16 * n, device="cuda", dtype=dt) for _ in range(2)]
        for n, dt in ((D, torch.float32), (1, torch.int64), (1, torch.float32), (1, torch.int64))]
dispatch_rows(x, w, torch.arange(T * K, device="cuda"), torch.tensor([2, 2, 2, 2], device="cuda"), ptrs(counts),
              ptrs(flags), torch.zeros(1, dtype=torch.int64, device="cuda"), counts[0], flags[0], ptrs(bufs[0]),
              ptrs(bufs[1]), ptrs(bufs[2]), torch.float32, 0, K, T * K, 16, ptrs(bufs[3]),
              torch.zeros(T * 2, dtype=torch.int32, device="cuda"), timeout_ms=500)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("script", [_NEVER_SIGNALLED, _COUNTS_NEVER_COME], ids=["sum_returned", "dispatch"])
def test_wait_that_is_never_signalled_fails_instead_of_hanging(script):
    """A peer that never signals (ranks disagreeing on the calls) ends in a CUDA error with the
    kernel's message, after the timeout, not in a hang: the way back's sum waiting for its
    ``expect``, a dispatch from a fresh state waiting for both ranks' counts."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "P2P wait timed out" in proc.stdout + proc.stderr


_OVERFLOW = """
import torch
from parallel.p2p_rows import dispatch_rows
ptr = lambda t: torch.tensor([t.data_ptr()], dtype=torch.int64, device="cuda")
T, K, E, D, R_cap = 4, 2, 2, 8, 5  # one rank keeps 8 pairs for its own experts: 8 rows, 5 fit
x, w = torch.randn(T, D, device="cuda"), torch.rand(T, K, device="cuda")
counts = torch.zeros(1, E, dtype=torch.int64, device="cuda")
flag, state = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
recv = torch.full((R_cap, D), 7.0, device="cuda")
src = torch.zeros(R_cap, dtype=torch.int64, device="cuda")
wr = torch.zeros(R_cap, device="cuda")
order = torch.arange(T * K, device="cuda")
mine = torch.tensor([4, 4], dtype=torch.int64, device="cuda")
tok = torch.zeros(R_cap, dtype=torch.int64, device="cuda")
dispatch_rows(x, w, order, mine, ptr(counts), ptr(flag), state, counts, flag, ptr(recv), ptr(src), ptr(wr),
              torch.float32, 0, K, T * K, R_cap, ptr(tok), torch.zeros(T, dtype=torch.int32, device="cuda"),
              timeout_ms=5000)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dispatch_into_too_small_buffers_fails_instead_of_writing_past_them():
    """A rank whose rows would not fit its receive buffer (the layers cap less than the dispatcher
    was sized for) stops every rank with the kernel's message, before any row moves."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", _OVERFLOW], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "would receive more rows than its buffer holds" in proc.stdout + proc.stderr


def test_symmetric_buffer_is_zero_on_every_rank_before_a_peer_can_store(monkeypatch):
    """A peer may store its counts and signal this rank's flag as soon as it is past its
    allocation, so this rank's zero_() must be on the device before: queued first, then a device
    barrier of the group on the same stream (a peer's later stores wait for it), then the host
    waits. The exchange is no such point (the pool reuses exchanged segments, and rendezvous then
    answers from its cache). 2×H200: a slot allocated at the second dispatch, zeroed after its
    exchange, waited forever for its counts flag."""
    import parallel.p2p_dispatcher as p2p

    events = []

    class Stream:
        def synchronize(self):
            events.append("sync")

    class Checked(p2p._SymmetricBuffer):
        def _empty(self, nbytes, device):
            return torch.full((nbytes,), 7, dtype=torch.uint8)

        def _exchange(self, group, buf):
            events.append("exchange")
            return [buf.data_ptr()]

        def barrier(self):
            events.append("barrier with zeros" if not self.bytes.any() else "barrier before the zeros")

    def current_stream(device=None):
        assert device == torch.device("cpu"), f"the stream of another device: {device}"
        return Stream()

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    buf = Checked(None, {"rows": ((3, 4), torch.float32), "flag": ((1,), torch.int64)}, torch.device("cpu"), 1000)
    assert events == ["exchange", "barrier with zeros", "sync"]
    assert buf.views["rows"].shape == (3, 4) and int(buf.views["flag"]) == 0
    assert int(buf.ptrs["flag"][0]) - int(buf.ptrs["rows"][0]) == 256  # regions aligned to 256 bytes


def _cpu_symmetric_buffers(monkeypatch, sizes, shift=0):
    """G real ``_SymmetricBuffer`` objects on CPU tensors: their memory, address exchange and
    barrier stand in for symmetric memory's (every rank's bytes in one process); ``shift``: the
    handles map a peer's buffer that many bytes off the exchanged address."""
    import parallel.p2p_dispatcher as p2p

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"synchronize": lambda s: None})())
    everyone = []

    class Handle:
        def __init__(self, rank):
            self.rank = rank

        def get_remote_tensor(self, peer, sizes, dtype):
            whole = everyone[peer].bytes
            return torch.cat([whole[shift:], whole[:shift]]) if shift else whole

    class CpuBuffer(p2p._SymmetricBuffer):
        def _empty(self, nbytes, device):
            return torch.empty(nbytes, dtype=torch.uint8)

        def _exchange(self, group, buf):
            self.handle = Handle(len(everyone))
            everyone.append(self)
            return [0] * G  # filled in below, once every rank's buffer exists

        def barrier(self):
            pass

    bufs = [CpuBuffer(None, sizes, torch.device("cpu"), TIMEOUT_MS) for _ in range(G)]
    for b in bufs:
        b._base_ptrs = [o.bytes.data_ptr() for o in bufs]
    return bufs


def test_copy_engine_blocks_land_where_the_kernels_read(monkeypatch):
    """The dispatcher's own buffers, peer views and block copies (what its copy-engine mode runs):
    rank s's rows at rows s·T_cap... of every other rank's token buffer, its sums for rank g's
    tokens at rows s·T_cap... of rank g's return buffer (g ≠ s), its own block and the regions next
    to them untouched (the own block is read where it is)."""
    from parallel.p2p_dispatcher import _send_blocks, _send_rows

    T_cap, D = 5, 4
    sizes = {"recv": ((G * T_cap, D), torch.float16), "tok": ((7,), torch.int64), "ret": ((G * T_cap, D), torch.float32)}
    bufs = _cpu_symmetric_buffers(monkeypatch, sizes)
    assert all(bool((b.bytes == 0).all()) for b in bufs)  # zeroed before the exchange
    versions = [b.bytes._version for b in bufs]
    xs = [torch.randn(T_cap - r, D).half() for r in range(G)]  # fewer tokens than T_cap on ranks 1, 2
    for r in range(G):
        assert torch.equal(_send_rows(xs[r], bufs[r], "recv", r, T_cap), xs[r])  # as sent: the own block
    for d in range(G):
        for s in range(G):
            block = bufs[d].views["recv"][s * T_cap:(s + 1) * T_cap]
            if s == d:
                assert (block == 0).all(), d
                continue
            assert torch.equal(block[:xs[s].shape[0]], xs[s]) and (block[xs[s].shape[0]:] == 0).all(), (d, s)
        assert (bufs[d].views["tok"] == 0).all()
    sums = [torch.randn(G * T_cap, D) for _ in range(G)]
    for r in range(G):
        _send_blocks(sums[r], bufs[r], "ret", r, T_cap)
    for g in range(G):
        for r in range(G):
            block = bufs[g].views["ret"][r * T_cap:(r + 1) * T_cap]
            assert (block == 0).all() if r == g else torch.equal(block, sums[r][g * T_cap:(g + 1) * T_cap]), (g, r)
    # the copies bump no version the buffers' own views share: autograd holds such views (the
    # dispatch's w_R) and would refuse their backward after an in-place change of their base
    assert [b.bytes._version for b in bufs] == versions


def test_a_peer_mapping_off_the_kernels_address_is_refused(monkeypatch):
    bufs = _cpu_symmetric_buffers(monkeypatch, {"recv": ((6, 4), torch.float16)}, shift=256)
    with pytest.raises(RuntimeError, match="rank 1's mapped region 'recv' is at"):
        bufs[0].peer_views("recv")


def test_the_own_block_readers_refuse_what_does_not_fit():
    tok, of, n = torch.zeros(6, 4), torch.zeros(3, dtype=torch.int64), torch.tensor([3])
    with pytest.raises(ValueError, match="must be tok_MD's dtype"):
        expand_rows(tok, of, n, torch.zeros(3, 4, dtype=torch.float16), 3)
    with pytest.raises(ValueError, match="a block within its 6 rows"):
        expand_rows(tok, of, n, torch.zeros(3, 4), 4)
    flag, expect = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    rows_TG = torch.zeros(2, G, dtype=torch.int64)
    with pytest.raises(ValueError, match="own_MD must be ret_MD's dtype"):
        sum_returned(tok, rows_TG, torch.float32, flag, expect, own_MD=tok.half(), me=0)
    with pytest.raises(ValueError, match=f"me a rank of {G}, got {G}"):
        sum_returned(tok, rows_TG, torch.float32, flag, expect, own_MD=tok, me=G)


def test_a_peer_copy_leaves_the_views_autograd_holds_usable(monkeypatch):
    """The failure of the copy-engine mode's first GPU run, on CPU: a rank hands autograd a view
    of its buffer (the dispatch's w_R) and a peer's block copy lands in the same buffer before the
    backward, which then must not see "its base ... modified inplace"."""
    from parallel.p2p_dispatcher import _send_rows

    T_cap, D = 3, 4
    bufs = _cpu_symmetric_buffers(monkeypatch, {"recv": ((G * T_cap, D), torch.float32), "w": ((5,), torch.float32)})

    class Dispatch(torch.autograd.Function):  # returns a view of rank 1's buffer, as _P2PDispatchFn does
        @staticmethod
        def forward(ctx, x):
            return x * 2, bufs[1].views["w"].view_as(bufs[1].views["w"])

        @staticmethod
        def backward(ctx, g, _):
            return g * 2

    x = torch.randn(5, requires_grad=True)
    y, w_R = Dispatch.apply(x)
    loss = (y * w_R.unsqueeze(-1).squeeze(-1)).sum()
    _send_rows(torch.randn(T_cap, D), bufs[0], "recv", 0, T_cap)  # rank 0's rows into rank 1's buffer
    loss.backward()
    assert torch.equal(x.grad, 2 * bufs[1].views["w"])
