"""The gather-sum family (kernel_floor.gather_sum): its one forward and one backward kernel under
each of the three locators that use them, against the family's one PyTorch reference.

- the local combines (``moe.kernels.combine``): one buffer in dispatch order, ``weighted_combine``
  (the local dispatch's backward, with weights 1 and 0) and ``sum_combine`` (rows the experts
  weighted: the local dispatcher's combine);
- the NCCL dispatcher's token rows (``parallel.token_rows``): row tables into an own-rows and a
  unique-rows buffer;
- the P2P dispatcher's sum and push (``parallel.p2p_rows``): the own rows and the return buffer,
  stores through a table of G buffer addresses (G local buffers stand for the ranks).

Every test runs the Triton kernels: on CPU through Triton's interpreter (fp32/fp16, small sizes),
on a GPU compiled (bf16 too, and larger sizes in the ``gpu`` tests). Inputs are fresh random
rows in a random order, with dropped pairs, empty buffers, one token and all pairs to one rank.
"""

import pytest
import torch

from moe.kernels.combine import gather_rows, sum_combine, weighted_combine, weighted_combine_reference
from parallel.p2p_rows import pair_values, push_rows, push_rows_reference, sum_returned, sum_returned_reference
from parallel.token_rows import expert_rows, gather_slots, locate_pairs, scatter_slots, write_headers
from tests.peers import G, buffer_ptrs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# The local combine: one buffer, the inverse index row_of_pair as the locator.

COMBINE_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _check_combine(T, K, D, num_rows, dtype, device=DEVICE, out_dtype=None):
    gen = torch.Generator().manual_seed(T * 1000 + K * 10 + D)
    pair_R = torch.randperm(T * K, generator=gen)[:num_rows].to(device)
    y = torch.randn(num_rows, D, generator=gen).to(device, dtype).requires_grad_()
    w = torch.rand(T, K, generator=gen).to(device).requires_grad_()
    dout = torch.randn(T, D, generator=gen).to(device, out_dtype or dtype)

    y_ref = y.detach().double().requires_grad_()
    w_ref = w.detach().double().requires_grad_()
    out_ref = weighted_combine_reference(y_ref, pair_R, w_ref.float(), torch.float64)
    out = weighted_combine(y, pair_R, w, out_dtype=out_dtype, backend="triton")
    assert out.shape == (T, D) and out.dtype == (out_dtype or dtype)
    if T == 0:
        return
    out.backward(dout)
    out_ref.backward(dout.double())
    tol = COMBINE_TOL[dtype]
    assert _rel_err(out, out_ref) < tol
    if num_rows:
        assert _rel_err(y.grad, y_ref.grad) < tol
    # pairs without a row get exactly zero weight gradient
    has_row = torch.zeros(T * K, dtype=torch.bool, device=device)
    has_row[pair_R] = True
    assert (w.grad.view(-1)[~has_row] == 0).all()
    if num_rows:
        assert _rel_err(w.grad.view(-1)[has_row], w_ref.grad.view(-1)[has_row]) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,K,D,num_rows", [
    (13, 2, 70, 26),    # every pair has a row, D not a multiple of the block
    (13, 4, 130, 37),   # 15 pairs dropped, D spans three blocks
    (9, 1, 64, 9),      # top-1
    (5, 3, 33, 0),      # nothing came back: zeros, zero gradients
    (0, 2, 16, 0),      # no tokens
])
def test_combine_matches_reference(T, K, D, num_rows, dtype):
    _check_combine(T, K, D, num_rows, dtype)


def test_combine_of_identical_rows_is_the_row_times_the_kept_weights():
    """Closed form, independent of any locator: when every row of token t is x[t], the
    combine is x[t] · Σ_k w[t, k] over the pairs that have a row, and dw[t, k] = <dout[t], x[t]>
    for those pairs, 0 for the others."""
    T, K, D = 11, 3, 40
    x_TD = torch.randn(T, D, device=DEVICE)
    pair_R = torch.randperm(T * K, device=DEVICE)[:25]
    y_RD = x_TD[pair_R // K].clone().requires_grad_()
    w_TK = torch.rand(T, K, device=DEVICE).requires_grad_()
    out = weighted_combine(y_RD, pair_R, w_TK, backend="triton")
    has_TK = torch.zeros(T * K, dtype=torch.bool, device=DEVICE)
    has_TK[pair_R] = True
    has_TK = has_TK.view(T, K)
    torch.testing.assert_close(out, x_TD * (w_TK * has_TK).sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)
    dout = torch.randn(T, D, device=DEVICE)
    out.backward(dout)
    torch.testing.assert_close(w_TK.grad, torch.where(has_TK, (dout * x_TD).sum(-1, keepdim=True), 0.0),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,K,D,num_rows", [(13, 4, 130, 37), (9, 1, 64, 9), (5, 3, 33, 0), (0, 2, 16, 0)])
def test_sum_combine_matches_reference(T, K, D, num_rows, dtype):
    """The combine of rows weighted already: the sum of each token's rows (pairs without one add
    nothing) against the PyTorch reference on float64 rows, and, backward, each row's gradient
    its token's dout exactly."""
    gen = torch.Generator().manual_seed(T * 100 + K * 10 + D)
    pair_R = torch.randperm(T * K, generator=gen)[:num_rows].to(DEVICE)
    y = torch.randn(num_rows, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    dout = torch.randn(T, D, generator=gen).to(DEVICE, dtype)
    y_ref = y.detach().double().requires_grad_()
    out_ref = sum_combine(y_ref, pair_R, T, K, backend="reference")
    out = sum_combine(y, pair_R, T, K, out_dtype=torch.float32, backend="triton")
    assert out.shape == (T, D) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="pairs"):
        sum_combine(y, pair_R, 0 if num_rows else -1, K)
    if num_rows == 0:  # nothing came back: zeros, and the reference keeps no graph
        assert (out == 0).all()
        return
    out.backward(dout.float())
    out_ref.backward(dout.double())
    assert _rel_err(out, out_ref) < COMBINE_TOL[dtype]
    assert torch.equal(y.grad, dout[pair_R // K])
    assert torch.equal(y_ref.grad, dout[pair_R // K].double())


def test_combine_out_dtype_is_respected():
    _check_combine(7, 2, 40, 11, torch.float16, out_dtype=torch.float32)


@pytest.mark.parametrize("T,K,D", [(1, 1, 8), (37, 3, 70), (12, 8, 130)])
@pytest.mark.parametrize("x_dtype,row_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float16)])
def test_gather_rows_is_index_select(T, K, D, x_dtype, row_dtype):
    """The dispatch's packing kernel: the reference's rows bit for bit (a copy and a cast), for a
    random and a reversed permutation of the pairs."""
    x = torch.randn(T, D, device=DEVICE).to(x_dtype)
    for order in (torch.randperm(T * K, device=DEVICE), torch.arange(T * K, device=DEVICE).flip(0)):
        ours = gather_rows(x, order, K, row_dtype, backend="triton")
        ref = gather_rows(x, order, K, row_dtype, backend="reference")
        assert ours.dtype == row_dtype and torch.equal(ours, ref)
        assert torch.equal(ours, x[order // K].to(row_dtype))


def test_combine_rejects_bad_arguments():
    y = torch.randn(4, 8)
    w = torch.rand(3, 2)
    pair = torch.tensor([0, 2, 3, 5])
    with pytest.raises(ValueError, match="pair_R"):
        weighted_combine(y, pair[:3], w)
    with pytest.raises(ValueError, match="pair_R"):
        weighted_combine(y, pair.int(), w)
    with pytest.raises(ValueError, match="w_TK"):
        weighted_combine(y, pair, w.double())
    with pytest.raises(ValueError, match="pairs"):
        weighted_combine(torch.randn(7, 8), torch.arange(7), w)
    with pytest.raises(ValueError, match="backend"):
        weighted_combine(y, pair, w, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,D,num_rows", [(1000, 8, 2048, 7001), (4097, 2, 4096, 8194), (3, 2, 100, 1)])
def test_combine_gpu_bf16_matches_reference(T, K, D, num_rows):
    _check_combine(T, K, D, num_rows, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The NCCL dispatcher's token rows: row tables into one or two buffers.

# rows are copied or summed over at most K + G terms in fp32, then rounded once to the dtype
TOKEN_ROWS_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _row_table(T, slots, rows, missing=0.3, seed=0):
    """(T, slots) int64 naming distinct rows of a buffer of ``rows`` rows, a random share -1 (every
    slot when the buffer has no rows)."""
    gen = torch.Generator().manual_seed(seed)
    there = (torch.rand(T * slots, generator=gen) >= missing).nonzero()[:, 0][:rows]
    table = torch.full((T * slots,), -1, dtype=torch.int64)
    table[there] = torch.randperm(rows, generator=gen)[:there.numel()]
    return table.view(T, slots).to(DEVICE)


TOKEN_CASES = [  # T, K, G, rows of a, rows of b
    (37, 3, 2, 60, 40),
    (29, 4, 0, 90, 0),   # one table (the receiver's)
    (16, 1, 3, 0, 30),   # no own rows
    (12, 2, 1, 20, 0),   # no unique rows
    (1, 4, 2, 4, 2),
    (0, 3, 2, 0, 0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,G,rows_a,rows_b", TOKEN_CASES)
def test_scatter_slots_matches_reference(T, K, G, rows_a, rows_b, dtype):
    D = 70  # not a multiple of the interpreter's 64-column block
    x_TD = torch.randn(T, D, device=DEVICE).to(dtype)
    for slots, rows, seed in ((K, rows_a, 0), (G, rows_b, 1)):
        table = _row_table(T, slots, rows, seed=seed)
        # the destination's rows carry a 6-column head, as the dispatcher's send buffer does
        got, want = (torch.full((rows + 1, D + 6), 7.0, device=DEVICE, dtype=dtype) for _ in range(2))
        scatter_slots(x_TD, table, got[:, 6:], backend="triton")
        scatter_slots(x_TD, table, want[:, 6:], backend="reference")
        torch.testing.assert_close(got, want, rtol=TOKEN_ROWS_TOL[dtype], atol=TOKEN_ROWS_TOL[dtype])
        assert ((got[:, 6:] != 7.0).any(-1).sum() == (table >= 0).sum()).item()
        assert (got[:, :6] == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,G,rows_a,rows_b", TOKEN_CASES)
def test_gather_slots_matches_reference(T, K, G, rows_a, rows_b, dtype):
    D = 70
    a_TK, b_TG = _row_table(T, K, rows_a, seed=2), _row_table(T, G, rows_b, seed=3)
    a_MD = torch.randn(rows_a, D, device=DEVICE).to(dtype)
    b_MD = torch.randn(rows_b, D + 3, device=DEVICE).to(dtype)[:, 3:]  # a strided view, as the dispatcher reads
    for b, table in ((None, None), (b_MD, b_TG)):
        got = gather_slots(a_MD, a_TK, b, table, torch.float32, backend="triton")
        want = gather_slots(a_MD, a_TK, b, table, torch.float32, backend="reference")
        torch.testing.assert_close(got, want, rtol=TOKEN_ROWS_TOL[dtype], atol=TOKEN_ROWS_TOL[dtype])
    out = torch.full((T, D + 5), 7.0, device=DEVICE, dtype=dtype)
    written = gather_slots(a_MD, a_TK, b_MD, b_TG, out_TD=out[:, 5:], backend="triton")
    assert written.data_ptr() == out[:, 5:].data_ptr()
    torch.testing.assert_close(out[:, 5:].float(), want, rtol=TOKEN_ROWS_TOL[dtype], atol=TOKEN_ROWS_TOL[dtype])
    assert (out[:, :5] == 7.0).all()


def test_token_round_trip_is_the_sum_of_each_tokens_pair_rows():
    """A dispatch and combine with identity experts, independent of the reference: a token sent
    once to a rank, copied into its pair rows there, summed back into one row, added to its own
    pair rows, is its row times its number of kept pairs."""
    T, K, D = 23, 3, 40
    gen = torch.Generator().manual_seed(3)
    x_TD = torch.randn(T, D, generator=gen).to(DEVICE)
    own_TK = torch.rand(T, K, generator=gen) < 0.4                    # pairs on this rank
    far_TK = ~own_TK & (torch.rand(T, K, generator=gen) < 0.7)        # pairs on the other rank
    own_rows = own_TK.flatten().cumsum(0).view(T, K) - 1
    sent_T = far_TK.any(-1)
    n_own, n_sent, n_far = int(own_TK.sum()), int(sent_T.sum()), int(far_TK.sum())
    own_table = torch.where(own_TK, own_rows, -1).to(DEVICE)
    sent_table = torch.where(sent_T, sent_T.cumsum(0) - 1, -1)[:, None].to(DEVICE)
    # the receiver lays the far pairs out after its own rows, in a shuffled order
    row_MK = torch.full((n_sent, K), -1, dtype=torch.int64)
    row_MK[far_TK[sent_T]] = n_own + torch.randperm(n_far, generator=gen)
    row_MK = row_MK.to(DEVICE)
    send_MD = torch.empty(n_sent, D, device=DEVICE)
    rows_RD = torch.full((n_own + n_far, D), float("nan"), device=DEVICE)
    scatter_slots(x_TD, sent_table, send_MD, backend="triton")
    scatter_slots(x_TD, own_table, rows_RD, backend="triton")
    scatter_slots(send_MD, row_MK, rows_RD, backend="triton")
    assert not rows_RD.isnan().any()
    home_MD = gather_slots(rows_RD, row_MK, backend="triton")
    out_TD = gather_slots(rows_RD, own_table, home_MD, sent_table, backend="triton")
    kept = (own_TK | far_TK).sum(-1, keepdim=True).to(DEVICE)
    torch.testing.assert_close(out_TD, x_TD * kept, rtol=1e-5, atol=1e-5)
    assert 0 < n_own < n_own + n_far


@pytest.mark.parametrize("T,K,G", [(37, 3, 3), (1, 8, 2), (0, 2, 2), (20, 2, 5)])
def test_write_headers_matches_reference(T, K, G):
    gen = torch.Generator().manual_seed(T + K)
    dest_TK = torch.randint(0, G + 1, (T, K), generator=gen)  # G: dropped
    place_TK = torch.randint(0, 1000, (T, K), generator=gen)
    w_TK = torch.rand(T, K, generator=gen)
    has_TG = torch.zeros(T, G + 1, dtype=torch.int64).scatter_(1, dest_TK, 1)[:, :G]
    has_TG[:, 1] = 0  # rank 1 is this one: nothing sent to it
    sent_TG = torch.where(has_TG > 0, has_TG.t().flatten().cumsum(0).view(G, T).t() - 1, -1).contiguous()
    M = int(has_TG.sum())
    args = [t.to(DEVICE) for t in (place_TK, dest_TK, w_TK, sent_TG)]
    heads = []
    for backend in ("triton", "reference"):
        buf = torch.full((M + 1, 2 * K + 3), 5, dtype=torch.int32, device=DEVICE)  # one row never sent
        write_headers(*args, buf[:, :K], buf[:, K:2 * K].view(torch.float32), backend=backend)
        heads.append(buf)
    assert torch.equal(heads[0], heads[1])
    assert (heads[0][M] == 5).all() and (heads[0][:, 2 * K:] == 5).all()
    # every sent row's places: the token's pairs on its rank, -1 elsewhere
    for t, g in has_TG.nonzero().tolist():
        m = sent_TG[t, g]
        want = torch.where(dest_TK[t] == g, place_TK[t], -1).to(torch.int32)
        assert torch.equal(heads[0][m, :K].cpu(), want)


@pytest.mark.parametrize("T,K,G,me,drop", [(37, 3, 3, 1, 0.25), (29, 1, 4, 3, 0.0), (16, 8, 2, 0, 0.5),
                                           (12, 2, 3, 2, 1.0), (1, 4, 5, 0, 0.0), (0, 2, 2, 1, 0.0)])
def test_locate_pairs_matches_reference(T, K, G, me, drop):
    """Send positions of a random routing (kept pairs by rank, ranks that keep none included),
    located by the kernel and by the reference; every kept pair's place counts within its rank."""
    gen = torch.Generator().manual_seed(T * G + K)
    rank_P = torch.randint(0, G, (T * K,), generator=gen)
    rank_P[rank_P == min(1, G - 1)] = 0  # rank 1 keeps no pair: equal ends
    kept_P = torch.rand(T * K, generator=gen) >= drop
    order = torch.sort(torch.where(kept_P, rank_P, G), stable=True).indices
    pos_TK = torch.empty(T * K, dtype=torch.int64)
    pos_TK[order] = torch.arange(T * K)
    ends_G = torch.bincount(rank_P[kept_P], minlength=G).cumsum(0)
    pos_TK, ends_G = pos_TK.view(T, K).to(DEVICE), ends_G.to(DEVICE)
    got = locate_pairs(pos_TK, ends_G, me, backend="triton")
    want = locate_pairs(pos_TK, ends_G, me, backend="reference")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    dest_TK = got[0].cpu().flatten()
    assert torch.equal(dest_TK, torch.where(kept_P, rank_P, G))


def _places_by_source(c_GL, K, gen):
    """Every pair (g, l, i) of a (G, L) count matrix, numbered by its source as a sender does
    (place = Σ_{l' < l} c[g, l'] + i), dealt at random into token rows of K slots (-1 padded):
    per source its token rows, and each slot's (l, g, i)."""
    G, L = c_GL.shape
    rows_G, keys_G = [], []
    for g in range(G):
        pairs = [(el, g, i) for el in range(L) for i in range(int(c_GL[g, el]))]
        pairs = [pairs[j] for j in torch.randperm(len(pairs), generator=gen).tolist()]
        n_rows = -(-len(pairs) // K) + int(torch.randint(0, 2, (1,), generator=gen))  # a row of -1 now and then
        slots = torch.randperm(n_rows * K, generator=gen)[:len(pairs)]
        place, key = torch.full((n_rows * K,), -1, dtype=torch.int32), [None] * (n_rows * K)
        for slot, (el, src, i) in zip(slots.tolist(), pairs):
            place[slot] = int(c_GL[g, :el].sum()) + i
            key[slot] = (el, src, i)
        rows_G.append(place.view(n_rows, K))
        keys_G.append(key)
    return rows_G, keys_G


@pytest.mark.parametrize("G,L,K", [(2, 3, 2), (3, 5, 4), (4, 1, 3), (1, 6, 2), (5, 7, 8), (2, 128, 3), (8, 32, 2)])
def test_expert_rows_make_the_input_expert_major(G, L, K):
    """Places of random count matrices (a source with no pairs, an expert with no rows) turned
    into rows, by the kernel and by the reference, for a receive buffer (rows by source) and for
    one source's own pairs. Independently of either: the rows are a permutation of the input's,
    in the order (local expert, source, place), i.e. one segment per expert, sources in rank
    order within it."""
    gen = torch.Generator().manual_seed(G * 10 + L)
    c_GL = torch.randint(0, 6, (G, L), generator=gen)
    c_GL[G // 2] = 0
    c_GL[:, L // 2] = 0
    rows_G, keys_G = _places_by_source(c_GL, K, gen)
    counts = torch.cat([c_GL, torch.tensor([[r.shape[0]] for r in rows_G])], 1).to(DEVICE)
    place_MK = torch.cat(rows_G)
    wide = torch.full((place_MK.shape[0], K + 3), 9, dtype=torch.int32)  # a header-like row stride
    wide[:, :K] = place_MK
    got = expert_rows(wide.to(DEVICE)[:, :K], counts, backend="triton")
    assert torch.equal(got, expert_rows(place_MK.to(DEVICE), counts, backend="reference"))
    keys = [k for key in keys_G for k in key]
    named = [(key, row) for key, row in zip(keys, got.cpu().flatten().tolist()) if key is not None]
    assert all(row == -1 for key, row in zip(keys, got.cpu().flatten().tolist()) if key is None)
    assert [row for _, row in sorted(named)] == list(range(int(c_GL.sum())))
    for me in range(G):  # one source's own pairs: the same rows as in the buffer
        own = expert_rows(rows_G[me].to(DEVICE), counts, me, backend="triton")
        assert torch.equal(own, expert_rows(rows_G[me].to(DEVICE), counts, me, backend="reference"))
        start = sum(r.shape[0] for r in rows_G[:me])
        assert torch.equal(own, got[start:start + rows_G[me].shape[0]])
    if G == 1:
        return
    # the padded exchange's buffer: one block of B rows per other rank, its unique rows first, then
    # padding whose headers hold garbage (places past every segment, negative, huge)
    B = max(r.shape[0] for r in rows_G) + 2
    for me in range(G):
        blocks, expect = [], []
        for g in range(G):
            if g != me:
                n = rows_G[g].shape[0]
                garbage = torch.randint(-2**30, 2**30, (B - n, K), generator=gen, dtype=torch.int32)
                blocks.append(torch.cat([rows_G[g], garbage]))
                start = sum(r.shape[0] for r in rows_G[:g])
                expect.append(torch.cat([got[start:start + n].cpu(), torch.full((B - n, K), -1)]))
        padded = torch.cat(blocks).to(DEVICE)
        from_blocks = expert_rows(padded, counts, blocks=(B, me), backend="triton")
        assert torch.equal(from_blocks, expert_rows(padded, counts, blocks=(B, me), backend="reference"))
        assert torch.equal(from_blocks.cpu(), torch.cat(expect))


def test_token_rows_bad_arguments_name_the_field():
    x_TD = torch.randn(4, 8, device=DEVICE)
    table = torch.full((4, 3), -1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="table_TK"):
        scatter_slots(x_TD, table.int(), torch.empty(8, 8, device=DEVICE))
    with pytest.raises(ValueError, match="table_TK"):
        scatter_slots(x_TD, table[:3], torch.empty(8, 8, device=DEVICE))
    with pytest.raises(ValueError, match="dst_MD"):
        scatter_slots(x_TD, table, torch.empty(8, 9, device=DEVICE))
    with pytest.raises(ValueError, match="dst_MD"):
        scatter_slots(x_TD, table, torch.empty(8, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="go together"):
        gather_slots(x_TD, table, x_TD)
    with pytest.raises(ValueError, match="table_TG"):
        gather_slots(x_TD, table, x_TD, table[:, :2].t().contiguous())
    with pytest.raises(ValueError, match="share a dtype"):
        gather_slots(x_TD, table, x_TD.half(), table)
    with pytest.raises(ValueError, match="out_TD"):
        gather_slots(x_TD, table, out_TD=torch.empty(3, 8, device=DEVICE))
    counts = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="place_TK"):
        expert_rows(table.float(), counts)
    with pytest.raises(ValueError, match="place_TK"):
        expert_rows(table.t(), counts)
    with pytest.raises(ValueError, match="recv_counts"):
        expert_rows(table, counts.int())
    with pytest.raises(ValueError, match="source 2"):
        expert_rows(table, counts, 2)
    with pytest.raises(ValueError, match="blocks"):
        expert_rows(table, counts, blocks=(3, 0))  # 4 rows are not (G - 1) blocks of 3


# ---------------------------------------------------------------------------------------------
# The P2P dispatcher's sum and push: own rows or the return buffer, stores through an address table.

P2P_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}



def _random_pairs(T, K, rows, dropped=0.25, seed=0):
    """Distinct (dest, row) places for T·K pairs over G buffers of ``rows`` rows; some dropped."""
    gen = torch.Generator().manual_seed(seed)
    places = torch.randperm(G * rows, generator=gen)[:T * K]
    dest = (places // rows).view(T, K)
    row = (places % rows).view(T, K)
    row[torch.rand(T, K, generator=gen) < dropped] = -1
    return row.to(DEVICE), dest.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, K, D", [(9, 3, 70), (1, 1, 5), (0, 2, 16), (13, 8, 130)])
def test_p2p_push_rows_matches_its_reference(T, K, D, dtype):
    rows, me, P_cap = T * K + 3, 1, T * K + 2
    row, dest = _random_pairs(T, K, rows)
    x = torch.randn(T, D, device=DEVICE).to(dtype)
    tol = P2P_TOL[dtype]

    bufs = [torch.zeros(rows, D, device=DEVICE, dtype=dtype) for _ in range(G)]
    ref_bufs = [b.clone() for b in bufs]
    push_rows(x, row, dest, buffer_ptrs(bufs), dtype, me=me)
    push_rows_reference(x, row, dest, ref_bufs, me=me)
    for b, r in zip(bufs, ref_bufs):
        torch.testing.assert_close(b.float(), r.float(), rtol=tol, atol=tol)
    assert T == 0 or any(bool((b != 0).any()) for b in bufs)

    # the dispatch backward's weight gradients: own rows' in place, the others' where push_back put
    # them; against plain loops
    g_own, g_ret = torch.randn(rows, device=DEVICE), torch.randn(P_cap, device=DEVICE)
    expected = [[0.0 if row[t, k] < 0 else float(g_own[row[t, k]] if dest[t, k] == me else g_ret[t * K + k])
                 for k in range(K)] for t in range(T)]
    assert pair_values(row, dest, g_own, g_ret, me).tolist() == expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, D", [(9, 70), (1, 5), (0, 16), (13, 130)])
def test_p2p_sum_returned_matches_its_reference(T, D, dtype):
    """Each token's rows of G return blocks, some absent (-1), summed in fp32; the flag already at
    its target (a wait that is satisfied)."""
    gen = torch.Generator().manual_seed(T + D)
    ret = torch.randn(G * (T + 2), D, generator=gen).to(DEVICE, dtype)
    rows_TG = torch.arange(G)[None, :] * (T + 2) + torch.arange(T)[:, None]
    rows_TG = torch.where(torch.rand(T, G, generator=gen) < 0.3, -1, rows_TG).contiguous().to(DEVICE)
    flag = torch.full((1,), 3, dtype=torch.int64, device=DEVICE)
    tol = P2P_TOL[dtype]
    for out_dtype in (dtype, torch.float32):
        out = sum_returned(ret, rows_TG, out_dtype, flag, flag.clone())
        ref = sum_returned_reference(ret, rows_TG, out_dtype)
        assert out.dtype == ref.dtype == out_dtype
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        loops = [sum((ret[r].float() for r in rows_TG[t].tolist() if r >= 0), torch.zeros(D, device=DEVICE))
                 for t in range(T)]
        if T:
            torch.testing.assert_close(out.float(), torch.stack(loops), rtol=tol, atol=tol)


def test_p2p_bad_arguments_raise():
    row, dest = _random_pairs(4, 2, 10)
    ptrs = buffer_ptrs([torch.zeros(10, 4, device=DEVICE)] * G)
    x = torch.randn(4, 4, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        push_rows(x, row.int(), dest, ptrs, torch.float32)
    with pytest.raises(ValueError, match="tokens"):
        push_rows(x[:3], row, dest, ptrs, torch.float32)
    with pytest.raises(ValueError, match="buffer dtype"):
        push_rows(x, row, dest, ptrs, torch.int32)
    with pytest.raises(ValueError, match="rows_TG"):
        sum_returned(x, row.int(), torch.float32, flag, flag)
    with pytest.raises(ValueError, match="flag"):
        sum_returned(x, row, torch.float32, flag.int(), flag)
    with pytest.raises(ValueError, match="expect must be a contiguous 1-element int64"):
        sum_returned(x, row, torch.float32, flag, 1)
