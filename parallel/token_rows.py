"""Token rows for the all-to-all dispatcher: a token crosses to a rank once, however many of its
K pairs go there.

Legend: T tokens (or, on the receiving side, the token rows received), D row width, K experts per
token (top-k), G ranks of the expert-parallel group, M rows of a buffer.

Why: at top-8 of 64 experts on 2 ranks a token has about 4 pairs on the other rank. Sent as one
row per pair (the pair layout this replaced), its row crossed the link 4 times each way and 4
times again in each backward. On 2×H200 the exchange was 8.3 % of the OLMoE-shaped step with
NCCL, all of it exposed, and its kernels about 12 % with P2P (bench/results/step_profile.md).
Sent once, the receiver copies it into the pair rows its experts read (a local pass), and on the
way back it sums the pairs' outputs, which the experts have already weighted, into one row
(DeepEP's layout).

Where rows go is written as ``-1``-padded int64 row indices, one table per buffer:

- the sender's ``own_TK``: the row of the experts' input that holds pair (t, k) when this rank's
  own experts take it (first its place, until the counts are in: :func:`expert_rows`), -1 when
  the pair goes to another rank or is dropped; and ``sent_TG``: the row of
  token t's unique row for rank g in the send buffer, -1 when t has no kept pair on g (always for
  this rank);
- the receiver's ``row_MK``: for received token row m, the row of the experts' input that holds
  the token's pair k, or -1.

The experts' input is expert-major: local expert l's rows are one segment, its pairs from each
source rank in rank order within it (:func:`expert_rows`), so the grouped GEMM sees L segments.
The sender can only number its pairs among its own rows for a rank (their *places*, by local
expert); the receiver turns places into rows once every source's counts are in. Why one segment
per expert, not one per (source, expert) as before: measured on an H100 at OLMoE's EP 2 shapes
(32 experts a rank, 65,536 rows, probe timings of this change), the grouped GEMM's forward and
dgrad took 946 / 960 µs on 64 segments against 887 / 880 µs on 32 (each segment end leaves a
partial tile), and the weight gradient's fp32 master-gradient epilogue runs on one segment per
expert only: 1361 → 1286 µs (D → 2F) and 694 → 579 µs (F → D), the separate accumulate pass gone.

- :func:`scatter_slots`: ``dst[table[t, j]] = x[t]`` through one table (the dispatch's packing and
  expansion, the combine backward's).
- :func:`gather_slots`: ``out[t] = Σ_k a[table_a[t, k]] + Σ_g b[table_b[t, g]]`` in fp32, the
  second table optional (the combine's pre-sum and final sum, the dispatch backward's).
- :func:`write_headers`: the headers of the send buffer's unique rows, in one launch (the same
  in PyTorch took ~12 ops and 0.4 ms of host time a dispatch, measured on an H100 host).
- :func:`locate_pairs`: each pair's rank, place there and own row, and each token's ranks, in
  one launch (the same in PyTorch: ~13 ops).
- :func:`expert_rows`: places turned into rows of the expert-major input, in one launch.

The first two are the gather-sum family of :mod:`kernel_floor`: a token's K + G slots are its
"pairs", and ``_locate`` reads the first K from one table and the rest from the other. The PyTorch
references feed the family's reference (used on CPU, tested against the kernels).
"""

import torch
import triton
import triton.language as tl

from kernel_floor import (
    cdiv, check_rows, gather_sum, gather_sum_reference, next_power_of_2, scatter_rows,
    scatter_rows_reference, use_reference,
)


@triton.jit
def _locate(pair, live, a_ptr, b_ptr, K, G):
    """(in a, in b, row, row) of a block of slots: slot ``j = pair % (K + G)`` of token
    ``pair // (K + G)``, read from table a (K columns) when j < K, else from table b (G columns)."""
    t = pair // (K + G)
    j = pair % (K + G)
    first = j < K
    row_a = tl.load(a_ptr + t * K + j, mask=live & first, other=-1)
    row_b = tl.load(b_ptr + t * G + (j - K), mask=live & ~first, other=-1)
    row = tl.where(first, row_a, row_b)
    there = live & (row >= 0)
    return there & first, there & ~first, row, row


@triton.jit
def _to_a(pair, live, a_ptr, b_ptr, K, G):
    in_a, _, row, _ = _locate(pair, live, a_ptr, b_ptr, K, G)
    return tl.where(in_a, 0, -1), row


def locate_reference(table_TK: torch.Tensor, table_TG: torch.Tensor | None = None):
    """PyTorch version of ``_locate`` for every slot: (in a, in b, row, row), each (T, K + G)."""
    row = table_TK if table_TG is None else torch.cat([table_TK, table_TG], 1)
    there = row >= 0
    first = torch.arange(row.shape[1], device=row.device) < table_TK.shape[1]
    return there & first, there & ~first, row, row


def _check_table(name: str, what: str, table: torch.Tensor, T: int) -> None:
    if table.dim() != 2 or table.dtype != torch.int64 or table.shape[0] != T or not table.is_contiguous():
        raise ValueError(f"{name}: {what} must be a contiguous ({T}, slots) int64 tensor, got "
                         f"{table.dtype} {tuple(table.shape)}")


def scatter_slots(x_TD: torch.Tensor, table_TK: torch.Tensor, dst_MD: torch.Tensor, backend: str = "auto") -> None:
    """``dst[table[t, k]] = x[t]`` (cast to dst's dtype) for every slot whose row is not -1; other
    rows of dst untouched.

    x_TD: (T, D) rows, unit column stride; table_TK: (T, K) int64, K any number of slots;
    dst_MD: (M, D) rows, unit column stride, written in place (M > every row the table names:
    not checked on the GPU).
    """
    T, D = x_TD.shape
    _check_table("scatter_slots", "table_TK", table_TK, T)
    check_rows("scatter_slots: x_TD", x_TD, None, D, any_row_stride=True)
    check_rows("scatter_slots: dst_MD", dst_MD, None, D, any_row_stride=True)
    if use_reference(backend, not x_TD.is_cuda):
        in_a, _, row, _ = located = locate_reference(table_TK)
        scatter_rows_reference(x_TD, (torch.where(in_a, 0, -1), row), located, [dst_MD])
        return
    K = table_TK.shape[1]
    scatter_rows(x_TD, _to_a, _locate, table_TK, None, K, 0, dst_MD, dst_MD.dtype, dst_MD.stride(0), K=K)


def gather_slots(a_MD: torch.Tensor, table_TK: torch.Tensor, b_MD: torch.Tensor | None = None,
                 table_TG: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 out_TD: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``out[t] = Σ_k a[table_TK[t, k]] + Σ_g b[table_TG[t, g]]`` (rows -1 add nothing), in fp32.

    a_MD, b_MD: (M, D) and (M', D) rows of one dtype, unit column stride; table_TK (T, K) into a,
    table_TG (T, G) into b (both or neither of b and table_TG). Returns (T, D) in ``out_dtype``
    (default a's), or writes ``out_TD`` ((T, D), unit column stride, e.g. the row columns of a
    send buffer) and returns it.
    """
    T, D = table_TK.shape[0], a_MD.shape[1]
    _check_table("gather_slots", "table_TK", table_TK, T)
    check_rows("gather_slots: a_MD", a_MD, None, D, any_row_stride=True)
    if (b_MD is None) != (table_TG is None):
        raise ValueError("gather_slots: b_MD and table_TG go together")
    if b_MD is not None:
        _check_table("gather_slots", "table_TG", table_TG, T)
        check_rows("gather_slots: b_MD", b_MD, None, D, any_row_stride=True)
        if b_MD.dtype != a_MD.dtype:
            raise ValueError(f"gather_slots: a_MD ({a_MD.dtype}) and b_MD ({b_MD.dtype}) must share a dtype")
    if out_TD is not None:
        check_rows("gather_slots: out_TD", out_TD, T, D, any_row_stride=True)
    if use_reference(backend, not a_MD.is_cuda):
        out = gather_sum_reference(locate_reference(table_TK, table_TG), a_MD, b_MD, None,
                                   out_TD.dtype if out_TD is not None else out_dtype)
        return out if out_TD is None else out_TD.copy_(out)
    K, G = table_TK.shape[1], 0 if table_TG is None else table_TG.shape[1]
    return gather_sum(T, D, _locate, table_TK, table_TG, K, G, a_MD, b_MD, None, out_dtype, K=K + G, out_TD=out_TD)


@triton.jit
def _headers_kernel(place_ptr, dest_ptr, w_ptr, sent_ptr, place_out_ptr, w_out_ptr, T, stride_out,
                    K: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    live = t < T
    for g in range(G):
        row = tl.load(sent_ptr + t * G + g, mask=live, other=-1)
        go = live & (row >= 0)
        for k in tl.static_range(K):
            dest = tl.load(dest_ptr + t * K + k, mask=go, other=-1)
            place = tl.load(place_ptr + t * K + k, mask=go, other=-1)
            tl.store(place_out_ptr + row * stride_out + k, tl.where(dest == g, place, -1).to(tl.int32), mask=go)
            tl.store(w_out_ptr + row * stride_out + k, tl.load(w_ptr + t * K + k, mask=go, other=0.0), mask=go)


def write_headers_reference(place_TK, dest_TK, w_TK, sent_TG, place_MK, weight_MK) -> None:
    """PyTorch version of :func:`write_headers` (same arguments, same writes)."""
    (T, K), G = place_TK.shape, sent_TG.shape[1]
    g_TGK = torch.arange(G, device=place_TK.device)[None, :, None]
    row_TG = sent_TG.clamp(min=0)
    go_TG = sent_TG >= 0
    values = torch.where(dest_TK[:, None, :] == g_TGK, place_TK[:, None, :], -1).to(torch.int32)
    place_MK[row_TG[go_TG]] = values[go_TG]
    weight_MK[row_TG[go_TG]] = w_TK[:, None, :].expand(T, G, K)[go_TG]


def write_headers(place_TK: torch.Tensor, dest_TK: torch.Tensor, w_TK: torch.Tensor, sent_TG: torch.Tensor,
                  place_MK: torch.Tensor, weight_MK: torch.Tensor, backend: str = "auto") -> None:
    """For every sent unique row m = sent_TG[t, g] >= 0, its whole header: ``place_MK[m, k]`` =
    place_TK[t, k] where pair (t, k) goes to rank g (dest_TK[t, k] == g), else -1, and
    ``weight_MK[m, k] = w_TK[t, k]``. Other rows untouched.

    place_TK, dest_TK: (T, K) int64; w_TK: (T, K) fp32; sent_TG: (T, G) int64 (contiguous);
    place_MK (M, K) int32 and weight_MK (M, K) fp32: views of the headers, with one row stride
    and unit column stride (the dispatcher's bit-cast views of its send buffer).
    """
    (T, K), G = place_TK.shape, sent_TG.shape[1]
    for name, t, dtype in (("place_TK", place_TK, torch.int64), ("dest_TK", dest_TK, torch.int64),
                           ("w_TK", w_TK, torch.float32)):
        if t.shape != (T, K) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"write_headers: {name} must be a contiguous ({T}, {K}) {dtype}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    _check_table("write_headers", "sent_TG", sent_TG, T)
    if place_MK.dtype != torch.int32 or weight_MK.dtype != torch.float32 or place_MK.shape != weight_MK.shape \
            or place_MK.shape[1] != K or place_MK.stride() != weight_MK.stride() or place_MK.stride(1) != 1:
        raise ValueError(f"write_headers: place_MK (int32) and weight_MK (fp32) must be (M, {K}) views with one "
                         f"row stride, got {place_MK.dtype} {tuple(place_MK.shape)} {place_MK.stride()} and "
                         f"{weight_MK.dtype} {tuple(weight_MK.shape)} {weight_MK.stride()}")
    if use_reference(backend, not place_TK.is_cuda):
        write_headers_reference(place_TK, dest_TK, w_TK, sent_TG, place_MK, weight_MK)
        return
    if T == 0 or G == 0:
        return
    BLOCK_T = 128
    _headers_kernel[(cdiv(T, BLOCK_T),)](place_TK, dest_TK, w_TK, sent_TG, place_MK, weight_MK, T,
                                                place_MK.stride(0), K=K, G=G, BLOCK_T=BLOCK_T, num_warps=4)


@triton.jit
def _locate_pairs_kernel(pos_ptr, ends_ptr, dest_ptr, place_ptr, own_ptr, has_ptr, T, me,
                         K: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    live = t < T
    ranks = tl.zeros((BLOCK_T,), dtype=tl.int64)  # bit g: a kept pair of the token is on rank g
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + k, mask=live, other=0)
        dest = tl.zeros((BLOCK_T,), dtype=tl.int64)
        start = tl.zeros((BLOCK_T,), dtype=tl.int64)
        for g in range(G):  # ends are non-decreasing: the last end <= pos starts its rank's places
            end = tl.load(ends_ptr + g)
            past = pos >= end
            dest += past.to(tl.int64)
            start = tl.where(past, end, start)
        place = tl.where(dest < G, pos - start, -1)
        tl.store(dest_ptr + t * K + k, dest, mask=live)
        tl.store(place_ptr + t * K + k, place, mask=live)
        tl.store(own_ptr + t * K + k, tl.where(dest == me, place, -1), mask=live)
        ranks |= tl.where(dest < G, tl.full((BLOCK_T,), 1, tl.int64) << dest, 0)
    for g in range(G):
        on_g = ((ranks >> g) & 1) * (g != me).to(tl.int64)
        tl.store(has_ptr + g * T + t, on_g, mask=live)


def locate_pairs_reference(pos_TK: torch.Tensor, ends_G: torch.Tensor, me: int):
    """PyTorch version of :func:`locate_pairs`."""
    G = ends_G.numel()
    per_rank_G = torch.diff(ends_G, prepend=ends_G.new_zeros(1))
    dest_TK = torch.searchsorted(ends_G, pos_TK, right=True)  # G: past every rank's pairs, dropped
    place_TK = torch.where(dest_TK < G, pos_TK - (ends_G - per_rank_G)[dest_TK.clamp(max=G - 1)], -1)
    own_TK = torch.where(dest_TK == me, place_TK, -1)
    remote_TK = (dest_TK != me) & (dest_TK < G)
    has_TG = torch.zeros((pos_TK.shape[0], G + 1), dtype=torch.int64, device=pos_TK.device)
    has_TG.scatter_(1, torch.where(remote_TK, dest_TK, G), 1)
    return dest_TK, place_TK, own_TK, has_TG[:, :G].t().contiguous()


def locate_pairs(pos_TK: torch.Tensor, ends_G: torch.Tensor, me: int, backend: str = "auto"):
    """Where each pair goes, from its send position: pairs sorted by destination rank, then
    expert (kept first), sit at ``pos_TK``; rank g takes positions ``[ends[g-1], ends[g])``.

    pos_TK: (T, K) int64 contiguous; ends_G: (G,) int64 cumulative, non-decreasing; me: this rank.
    Returns dest_TK (T, K) int64 each pair's rank (G: dropped, at or past ends[-1]); place_TK its
    place among the pairs its rank receives from here (-1: dropped); own_TK the place where the
    rank is ``me``, else -1; has_GT (G, T) int64: 1 where token t has a kept pair on rank g != me.
    """
    if pos_TK.dim() != 2 or pos_TK.dtype != torch.int64 or not pos_TK.is_contiguous():
        raise ValueError(f"locate_pairs: pos_TK must be a contiguous (T, K) int64 tensor, got "
                         f"{pos_TK.dtype} {tuple(pos_TK.shape)}")
    if ends_G.dim() != 1 or ends_G.dtype != torch.int64 or not 0 <= me < ends_G.numel() or ends_G.numel() > 62:
        raise ValueError(f"locate_pairs: ends_G must be (G,) int64 with G <= 62 and 0 <= me < G, got "
                         f"{ends_G.dtype} {tuple(ends_G.shape)}, me={me}")
    if use_reference(backend, not pos_TK.is_cuda):
        return locate_pairs_reference(pos_TK, ends_G, me)
    (T, K), G = pos_TK.shape, ends_G.numel()
    dest_TK, place_TK, own_TK = (torch.empty_like(pos_TK) for _ in range(3))
    has_GT = pos_TK.new_empty((G, T))
    if T:
        BLOCK_T = 128
        _locate_pairs_kernel[(cdiv(T, BLOCK_T),)](pos_TK, ends_G.contiguous(), dest_TK, place_TK, own_TK,
                                                         has_GT, T, me, K=K, G=G, BLOCK_T=BLOCK_T, num_warps=4)
    return dest_TK, place_TK, own_TK, has_GT


@triton.jit
def _expert_rows_kernel(place_ptr, counts_ptr, rows_ptr, T, stride_place, source, block, me, G, L,
                        K: tl.constexpr, GP: tl.constexpr, LP: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    live = t < T
    valid = live
    g = tl.arange(0, GP)
    el = tl.arange(0, LP)
    ok = (g[:, None] < G) & (el[None, :] < L)
    c = tl.load(counts_ptr + g[:, None] * (L + 1) + el[None, :], mask=ok, other=0)  # [source, local expert]
    per_expert = tl.sum(c, axis=0)
    first = (tl.cumsum(per_expert, 0) - per_expert)[None, :] + tl.cumsum(c, axis=0) - c  # row of a segment's start
    end = tl.cumsum(c, axis=1)  # place past a segment, within its source's places
    shift = first - (end - c)
    end = tl.where(ok, end, tl.cast(2**62, tl.int64))
    if source >= 0:
        src = tl.full((BLOCK_T,), source, tl.int64)
    elif block > 0:  # one block of rows per other rank; its first (unique rows) are valid
        b = t // block
        src = b + (b >= me).to(tl.int64)
        valid = live & (t - b * block < tl.load(counts_ptr + src * (L + 1) + L, mask=live, other=0))
    else:  # the received rows come by source rank, counts_ptr's last column of each
        unique_end = tl.cumsum(tl.load(counts_ptr + g * (L + 1) + L, mask=g < G, other=0), 0)
        src = tl.sum(((unique_end[None, :] <= t[:, None]) & (g[None, :] < G)).to(tl.int64), axis=1)
    mine = g[None, :, None] == src[:, None, None]
    end_t = tl.sum(tl.where(mine, end[None, :, :], 0), axis=1)  # [token, local expert] of its source
    shift_t = tl.sum(tl.where(mine, shift[None, :, :], 0), axis=1)
    for k in tl.static_range(K):
        place = tl.load(place_ptr + t * stride_place + k, mask=valid, other=-1).to(tl.int64)
        expert = tl.sum((end_t <= place[:, None]).to(tl.int64), axis=1)
        step = tl.sum(tl.where(el[None, :] == expert[:, None], shift_t, 0), axis=1)
        tl.store(rows_ptr + t * K + k, tl.where(place >= 0, place + step, -1), mask=live)


def expert_rows_reference(place_TK: torch.Tensor, recv_counts: torch.Tensor, source: int | None,
                          blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """PyTorch version of :func:`expert_rows`."""
    T, L = place_TK.shape[0], recv_counts.shape[1] - 1
    c_GL = recv_counts[:, :L]
    per_expert = c_GL.sum(0)
    end_GL = c_GL.cumsum(1)
    shift_GL = (per_expert.cumsum(0) - per_expert)[None, :] + c_GL.cumsum(0) - c_GL - (end_GL - c_GL)
    place = place_TK.to(torch.int64)
    if source is not None:
        src_T = torch.full((T,), source, dtype=torch.int64, device=place_TK.device)
    elif blocks is not None:
        block, me = blocks
        t = torch.arange(T, device=place_TK.device)
        src_T = t // block + (t // block >= me).long()
        place = torch.where((t % block < recv_counts[src_T, L])[:, None], place, -1)
    else:
        src_T = torch.repeat_interleave(torch.arange(recv_counts.shape[0], device=place_TK.device),
                                        recv_counts[:, L], output_size=T)
    expert = (end_GL[src_T][:, None, :] <= place[:, :, None]).sum(-1).clamp(max=max(L - 1, 0))
    return torch.where(place >= 0, place + shift_GL[src_T[:, None], expert], -1)


def expert_rows(place_TK: torch.Tensor, recv_counts: torch.Tensor, source: int | None = None,
                blocks: tuple[int, int] | None = None, backend: str = "auto") -> torch.Tensor:
    """Rows of the expert-major experts' input for pairs numbered by their source's places.

    The input holds local expert 0's rows, then expert 1's, ...; within an expert, the pairs from
    source rank 0, then 1, ... A source numbers the pairs it sends here 0, 1, ... by local expert
    (its *places*); place p of source g in local expert l's run ``[end[g, l-1], end[g, l])`` is
    row ``first[g, l] + p - end[g, l-1]``.

    place_TK: (T, K) int32 or int64 places (-1: none), unit column stride, any row stride (the
    received headers' view); recv_counts: (G, L + 1) int64, contiguous: per source rank its pairs
    for each local expert, then (last column) its unique rows; source: the rank every row of
    place_TK came from (this rank's own pairs), or None: rows come by source rank, as many from
    each as its unique rows (a receive buffer); blocks: with source None, ``(B, me)``: the rows
    come in G - 1 blocks of B rows, one per rank but ``me`` in rank order, of which the first
    (its unique rows) are valid and the rest padding (the padded exchange: T = (G - 1)·B; a
    padding row's places are not read and its rows are -1). Returns (T, K) int64 rows, -1 where
    the place is.
    """
    if place_TK.dim() != 2 or place_TK.dtype not in (torch.int32, torch.int64) or \
            (place_TK.shape[1] > 1 and place_TK.stride(1) != 1):
        raise ValueError(f"expert_rows: place_TK must be a (T, K) int32/int64 tensor with unit column stride, got "
                         f"{place_TK.dtype} {tuple(place_TK.shape)} {place_TK.stride()}")
    if recv_counts.dim() != 2 or recv_counts.dtype != torch.int64 or recv_counts.shape[1] < 2 or \
            not recv_counts.is_contiguous():
        raise ValueError(f"expert_rows: recv_counts must be a contiguous (G, L + 1) int64 tensor, got "
                         f"{recv_counts.dtype} {tuple(recv_counts.shape)}")
    G, L = recv_counts.shape[0], recv_counts.shape[1] - 1
    if source is not None and not 0 <= source < G:
        raise ValueError(f"expert_rows: source {source} is not a rank of {G}")
    if blocks is not None and (source is not None or blocks[0] < 1 or not 0 <= blocks[1] < G
                               or place_TK.shape[0] != (G - 1) * blocks[0]):
        raise ValueError(f"expert_rows: blocks (B, me) = {blocks} needs source None, B >= 1, me a rank of {G} and "
                         f"(G - 1)·B rows, got {place_TK.shape[0]} rows")
    if use_reference(backend, not place_TK.is_cuda):
        return expert_rows_reference(place_TK, recv_counts, source, blocks)
    T, K = place_TK.shape
    rows_TK = torch.empty((T, K), dtype=torch.int64, device=place_TK.device)
    if T and K:
        GP, LP = next_power_of_2(G), next_power_of_2(L)
        BLOCK_T = max(16, 4096 // (GP * LP))  # the [token, source, expert] selection: ~4096 elements
        _expert_rows_kernel[(cdiv(T, BLOCK_T),)](
            place_TK, recv_counts, rows_TK, T, place_TK.stride(0), -1 if source is None else source,
            *(blocks or (0, 0)), G, L,
            K=K, GP=GP, LP=LP, BLOCK_T=BLOCK_T, num_warps=4)
    return rows_TK
