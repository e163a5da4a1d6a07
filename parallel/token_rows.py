"""Token rows for the all-to-all dispatcher: a token crosses to a rank once, however many of its
K pairs go there.

Legend: T tokens, D row width, K experts per token (top-k), G ranks of the expert-parallel group,
S = K + G slots of a token, U rows of a buffer of unique rows (one per token and remote rank),
R rows of the experts' input.

Why: at top-8 of 64 experts on 2 ranks a token has about 4 pairs on the other rank. Sent as one
row per pair (the pair layout this replaced), its row crossed the link 4 times each way and 4
times again in each backward; on 2×H200 those copies were about 8.5 % of the OLMoE-shaped step
(bench/results/step_profile.md, P2P). Sent once, the receiver copies it into the pair rows its
experts read (a local pass), and on the way back it sums the pairs' outputs, which the experts
have already weighted, into one row (DeepEP's layout).

Where rows go is written as ``-1``-padded int64 row indices in two tables, read by one locator:

- the sender's **slot table** ``slot_TS`` (T, K + G): slot ``k < K`` is the row of pair (t, k)
  among this rank's own rows (the rows its own experts read; -1 when the pair goes to another
  rank or is dropped); slot ``K + g`` is the row of token t's unique row for rank g in the send
  buffer (-1 when t has no kept pair on g, and always for this rank);
- the receiver's **row table** ``row_UK`` (U, K): for received unique row u, slot k is the row of
  the experts' input that holds the token's pair k, or -1.

A table splits its slots at ``split``: slots before it point into buffer ``a``, the others into
buffer ``b`` (the slot table at K: own rows, unique rows; the row table at K: all into ``a``).

- :func:`scatter_slots`: ``dst[table[t, s]] = x[t]`` for the slots of one side of the split (the
  dispatch's packing and expansion, the combine backward's).
- :func:`gather_slots`: ``out[t] = Σ_{s < split} a[table[t, s]] + Σ_{s ≥ split} b[table[t, s]]``
  in fp32 (the combine's pre-sum and final sum, the dispatch backward's).

Both are the gather-sum family of :mod:`kernel_floor` with ``_locate`` as the locator; the PyTorch
references feed the family's reference (used on CPU, tested against the kernels).
"""

from typing import Literal

import torch
import triton
import triton.language as tl

from kernel_floor import gather_sum, gather_sum_reference, scatter_rows, scatter_rows_reference, use_reference


@triton.jit
def _locate(pair, live, table_ptr, _unused_ptr, split, S):
    """(in a, in b, row, row) of a block of slots: slot ``pair % S`` of token ``pair // S``."""
    row = tl.load(table_ptr + pair, mask=live, other=-1)
    first = (pair % S) < split
    there = live & (row >= 0)
    return there & first, there & ~first, row, row


@triton.jit
def _to_a(pair, live, table_ptr, _unused_ptr, split, S):
    in_a, _, row, _ = _locate(pair, live, table_ptr, _unused_ptr, split, S)
    return tl.where(in_a, 0, -1), row


@triton.jit
def _to_b(pair, live, table_ptr, _unused_ptr, split, S):
    _, in_b, row, _ = _locate(pair, live, table_ptr, _unused_ptr, split, S)
    return tl.where(in_b, 0, -1), row


def locate_reference(table_TS: torch.Tensor, split: int):
    """PyTorch version of ``_locate`` for every slot: (in a, in b, row, row), each (T, S)."""
    there = table_TS >= 0
    first = torch.arange(table_TS.shape[1], device=table_TS.device) < split
    return there & first, there & ~first, table_TS, table_TS


def _check(name: str, table_TS: torch.Tensor, split: int, T: int) -> None:
    if table_TS.dim() != 2 or table_TS.dtype != torch.int64 or table_TS.shape[0] != T \
            or not table_TS.is_contiguous():
        raise ValueError(f"{name}: table_TS must be a contiguous ({T}, S) int64 tensor, got "
                         f"{table_TS.dtype} {tuple(table_TS.shape)}")
    if not 0 <= split <= table_TS.shape[1]:
        raise ValueError(f"{name}: split={split} must be in [0, S={table_TS.shape[1]}]")


def _check_rows(name: str, what: str, t_MD: torch.Tensor, D: int) -> None:
    """Rows of width D with unit column stride (any row stride: a buffer's rows may carry a tail)."""
    if t_MD.dim() != 2 or t_MD.shape[1] != D or (t_MD.shape[0] > 0 and D > 1 and t_MD.stride(1) != 1):
        raise ValueError(f"{name}: {what} must be (M, {D}) rows with unit column stride, got "
                         f"{tuple(t_MD.shape)} strides {t_MD.stride()}")


def scatter_slots(x_TD: torch.Tensor, table_TS: torch.Tensor, split: int, dst_MD: torch.Tensor,
                  side: Literal["a", "b"], backend: str = "auto") -> None:
    """``dst[table[t, s]] = x[t]`` (cast to dst's dtype) for every slot s on ``side`` of the split
    ("a": s < split, "b": s >= split) whose row is not -1; other rows of dst untouched.

    x_TD: (T, D) rows, unit column stride; table_TS: (T, S) int64; dst_MD: (M, D) rows, unit column
    stride, written in place (M > every row the side names: not checked on the GPU).
    """
    T, D = x_TD.shape
    _check("scatter_slots", table_TS, split, T)
    _check_rows("scatter_slots", "x_TD", x_TD, D)
    _check_rows("scatter_slots", "dst_MD", dst_MD, D)
    if side not in ("a", "b"):
        raise ValueError(f"scatter_slots: side must be 'a' or 'b', got {side!r}")
    if use_reference(backend, not x_TD.is_cuda):
        in_a, in_b, row, _ = located = locate_reference(table_TS, split)
        mine = in_a if side == "a" else in_b
        scatter_rows_reference(x_TD, (torch.where(mine, 0, -1), row), located, [dst_MD])
        return
    scatter_rows(x_TD, _to_a if side == "a" else _to_b, _locate, table_TS, None, split, table_TS.shape[1],
                 dst_MD, dst_MD.dtype, dst_MD.stride(0), K=table_TS.shape[1])


def gather_slots(a_MD: torch.Tensor, b_MD: torch.Tensor | None, table_TS: torch.Tensor, split: int,
                 out_dtype: torch.dtype | None = None, out_TD: torch.Tensor | None = None,
                 backend: str = "auto") -> torch.Tensor:
    """``out[t] = Σ_{s < split} a[table[t, s]] + Σ_{s >= split} b[table[t, s]]`` (rows -1 add
    nothing), accumulated in fp32.

    a_MD, b_MD: (M, D) and (M', D) rows of one dtype, unit column stride (b None: every slot
    names a row of a, or -1). Returns (T, D) in ``out_dtype`` (default a's), or writes ``out_TD``
    ((T, D), unit column stride, e.g. the first D columns of a send buffer) and returns it.
    """
    T, D = table_TS.shape[0], a_MD.shape[1]
    _check("gather_slots", table_TS, split, T)
    _check_rows("gather_slots", "a_MD", a_MD, D)
    if b_MD is not None:
        _check_rows("gather_slots", "b_MD", b_MD, D)
        if b_MD.dtype != a_MD.dtype:
            raise ValueError(f"gather_slots: a_MD ({a_MD.dtype}) and b_MD ({b_MD.dtype}) must share a dtype")
    if out_TD is not None:
        _check_rows("gather_slots", "out_TD", out_TD, D)
        if out_TD.shape[0] != T:
            raise ValueError(f"gather_slots: out_TD must have the table's {T} rows, got {tuple(out_TD.shape)}")
    if use_reference(backend, not a_MD.is_cuda):
        out = gather_sum_reference(locate_reference(table_TS, split), a_MD, b_MD, None,
                                   out_TD.dtype if out_TD is not None else out_dtype)
        return out if out_TD is None else out_TD.copy_(out)
    return gather_sum(T, D, _locate, table_TS, None, split, table_TS.shape[1], a_MD, b_MD, None,
                      out_dtype, K=table_TS.shape[1], out_TD=out_TD)
